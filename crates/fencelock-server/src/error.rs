//! The API's error type, shared by HTTP and gRPC, with stable codes.

use std::fmt;

use fencelock_core::{Error as CoreError, ErrorKind};
use serde::Serialize;
use utoipa::openapi::schema::{ObjectBuilder, Schema, Type};
use utoipa::openapi::RefOr;
use utoipa::{IntoResponses, ToSchema};

/// An error answered to a client. `kind().code()` is stable and documented.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    kind: ApiErrorKind,
    message: String,
    /// With [`ApiErrorKind::NotLeader`]: the URL clients should use instead, when known.
    leader: Option<String>,
}

/// Stable classification of an [`ApiError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ApiErrorKind {
    /// The body is not valid JSON of the expected shape (400).
    InvalidJson,
    /// An argument is out of range or inconsistent (400).
    InvalidArgument,
    /// The body is larger than the limit (413).
    PayloadTooLarge,
    /// No such lock or route (404).
    NotFound,
    /// Wrong HTTP method for the route (405).
    MethodNotAllowed,
    /// The lock is held and the request did not wait (409).
    Held,
    /// The lock was not acquired within `wait_ms` (409).
    Timeout,
    /// The owner token does not hold the lock (409).
    NotHeld,
    /// The owner token's lease expired (409).
    Expired,
    /// The lock exists with another `limit` (409).
    LimitMismatch,
    /// The session does not exist or ended (404).
    SessionNotFound,
    /// A server bound was reached (429).
    ResourceExhausted,
    /// No credentials, or credentials the server does not know (401).
    Unauthenticated,
    /// The caller's role or lock-name prefixes do not allow the request (403).
    PermissionDenied,
    /// The caller's token made too many acquire attempts; retry later (429).
    RateLimited,
    /// The wait was cancelled (499-like; only seen by in-process callers).
    Cancelled,
    /// The server is shutting down or its storage failed (503).
    Unavailable,
    /// This cluster member is not the leader; [`ApiError::leader`] names the
    /// leader's URL when known (503).
    NotLeader,
    /// A bug or an I/O failure on the server (500). Never caused by client input.
    Internal,
    /// A watch cannot resume at the position it named: the events after it were
    /// compacted away, or the position is not from this server's log (410). The
    /// watcher re-reads the locks and watches again from now.
    WatchCompacted,
}

impl ApiErrorKind {
    /// Every kind, in the order of the documentation.
    pub const ALL: [ApiErrorKind; 20] = [
        ApiErrorKind::InvalidJson,
        ApiErrorKind::InvalidArgument,
        ApiErrorKind::PayloadTooLarge,
        ApiErrorKind::NotFound,
        ApiErrorKind::MethodNotAllowed,
        ApiErrorKind::Held,
        ApiErrorKind::Timeout,
        ApiErrorKind::NotHeld,
        ApiErrorKind::Expired,
        ApiErrorKind::LimitMismatch,
        ApiErrorKind::SessionNotFound,
        ApiErrorKind::ResourceExhausted,
        ApiErrorKind::Unauthenticated,
        ApiErrorKind::PermissionDenied,
        ApiErrorKind::RateLimited,
        ApiErrorKind::Cancelled,
        ApiErrorKind::Unavailable,
        ApiErrorKind::NotLeader,
        ApiErrorKind::Internal,
        ApiErrorKind::WatchCompacted,
    ];

    /// The stable snake_case code.
    pub fn code(self) -> &'static str {
        match self {
            ApiErrorKind::InvalidJson => "invalid_json",
            ApiErrorKind::InvalidArgument => "invalid_argument",
            ApiErrorKind::PayloadTooLarge => "payload_too_large",
            ApiErrorKind::NotFound => "not_found",
            ApiErrorKind::MethodNotAllowed => "method_not_allowed",
            ApiErrorKind::Held => "held",
            ApiErrorKind::Timeout => "timeout",
            ApiErrorKind::NotHeld => "not_held",
            ApiErrorKind::Expired => "expired",
            ApiErrorKind::LimitMismatch => "limit_mismatch",
            ApiErrorKind::SessionNotFound => "session_not_found",
            ApiErrorKind::ResourceExhausted => "resource_exhausted",
            ApiErrorKind::Unauthenticated => "unauthenticated",
            ApiErrorKind::PermissionDenied => "permission_denied",
            ApiErrorKind::RateLimited => "rate_limited",
            ApiErrorKind::Cancelled => "cancelled",
            ApiErrorKind::Unavailable => "unavailable",
            ApiErrorKind::NotLeader => "not_leader",
            ApiErrorKind::Internal => "internal",
            ApiErrorKind::WatchCompacted => "watch_compacted",
        }
    }

    /// The HTTP status for this kind.
    pub fn http_status(self) -> u16 {
        match self {
            ApiErrorKind::InvalidJson | ApiErrorKind::InvalidArgument => 400,
            ApiErrorKind::PayloadTooLarge => 413,
            ApiErrorKind::NotFound | ApiErrorKind::SessionNotFound => 404,
            ApiErrorKind::MethodNotAllowed => 405,
            ApiErrorKind::Held
            | ApiErrorKind::Timeout
            | ApiErrorKind::NotHeld
            | ApiErrorKind::Expired
            | ApiErrorKind::LimitMismatch => 409,
            ApiErrorKind::ResourceExhausted | ApiErrorKind::RateLimited => 429,
            ApiErrorKind::Unauthenticated => 401,
            ApiErrorKind::PermissionDenied => 403,
            ApiErrorKind::Cancelled => 499,
            ApiErrorKind::Unavailable | ApiErrorKind::NotLeader => 503,
            ApiErrorKind::Internal => 500,
            ApiErrorKind::WatchCompacted => 410,
        }
    }
}

/// The body of every HTTP error answer: `{"error": {"code", "message", "leader"?}}`.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    /// What went wrong.
    pub error: ErrorDetail,
}

/// The inside of an [`ErrorBody`].
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// The stable code ([`ApiErrorKind::code`]); clients branch on it, never on the
    /// message.
    #[schema(schema_with = error_code_schema)]
    pub code: &'static str,
    /// An explanation for people; it names the field or the bound at fault.
    pub message: String,
    /// With `not_leader`: the leader's URL, when this member knows it (absent
    /// otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub leader: Option<String>,
}

impl From<&ApiError> for ErrorBody {
    fn from(e: &ApiError) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                code: e.kind.code(),
                message: e.message.clone(),
                leader: e.leader.clone(),
            },
        }
    }
}

/// The schema of [`ErrorDetail::code`]: a string, one of the stable codes.
fn error_code_schema() -> impl Into<RefOr<Schema>> {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(
            ApiErrorKind::ALL
                .iter()
                .filter(|k| **k != ApiErrorKind::Cancelled)
                .map(|k| k.code()),
        ))
}

/// The error answers every HTTP API route may give, for the OpenAPI document (each
/// route adds the ones particular to it: 404, 409).
#[derive(IntoResponses)]
#[allow(dead_code)] // Only its derived documentation is used.
pub enum CommonErrors {
    /// 400.
    #[response(
        status = 400,
        description = "`invalid_json`: the body is not JSON, not an object, has a field of \
        the wrong type or a field the route does not know. `invalid_argument`: a required \
        field is missing, or a value is out of range or inconsistent (the message names \
        the field)."
    )]
    BadRequest(ErrorBody),
    /// 401.
    #[response(
        status = 401,
        description = "`unauthenticated`: tokens are configured and the request has none, \
        or one the server does not know."
    )]
    Unauthenticated(ErrorBody),
    /// 403.
    #[response(
        status = 403,
        description = "`permission_denied`: the token's role or prefixes do not allow \
        this; with authentication off, a browser request from another origin."
    )]
    PermissionDenied(ErrorBody),
    /// 413.
    #[response(
        status = 413,
        description = "`payload_too_large`: the body is larger than `max_body_bytes`."
    )]
    PayloadTooLarge(ErrorBody),
    /// 429.
    #[response(
        status = 429,
        description = "`resource_exhausted` (a server bound or the token's quota; the \
        message names it) or `rate_limited` (with `Retry-After: 1`)."
    )]
    TooMany(ErrorBody),
    /// 500.
    #[response(
        status = 500,
        description = "`internal`: a server bug or a storage failure, never the client's \
        mistake."
    )]
    Internal(ErrorBody),
    /// 503.
    #[response(
        status = 503,
        description = "`unavailable` (shutting down, storage failed, overloaded) or, on a \
        cluster member that is not the leader, `not_leader` with the leader's URL in \
        `leader` when known."
    )]
    Unavailable(ErrorBody),
}

impl ApiError {
    /// Builds an error.
    pub fn new(kind: ApiErrorKind, message: impl Into<String>) -> ApiError {
        ApiError {
            kind,
            message: message.into(),
            leader: None,
        }
    }

    /// A write (or linearizable read) sent to a member that is not the leader.
    /// `leader` is the leader's advertised URL, when this member knows it.
    pub fn not_leader(leader: Option<String>) -> ApiError {
        let message = match &leader {
            Some(url) => format!("this member is not the leader; send the request to {url}"),
            None => {
                "this member is not the leader and no leader is known yet; retry shortly".to_owned()
            }
        };
        ApiError {
            kind: ApiErrorKind::NotLeader,
            message,
            leader,
        }
    }

    /// The leader's URL, with [`ApiErrorKind::NotLeader`] (when known).
    pub fn leader(&self) -> Option<&str> {
        self.leader.as_deref()
    }

    /// The classification.
    pub fn kind(&self) -> ApiErrorKind {
        self.kind
    }

    /// The explanation.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl From<CoreError> for ApiError {
    fn from(e: CoreError) -> ApiError {
        let kind = match e.kind() {
            ErrorKind::InvalidArgument => ApiErrorKind::InvalidArgument,
            ErrorKind::Held => ApiErrorKind::Held,
            ErrorKind::NotHeld => ApiErrorKind::NotHeld,
            ErrorKind::Expired => ApiErrorKind::Expired,
            ErrorKind::LimitMismatch => ApiErrorKind::LimitMismatch,
            ErrorKind::SessionNotFound => ApiErrorKind::SessionNotFound,
            // A per-token quota is a bound like the global ones: 429, and the
            // message names the quota.
            ErrorKind::ResourceExhausted | ErrorKind::QuotaExceeded => {
                ApiErrorKind::ResourceExhausted
            }
            _ => ApiErrorKind::Internal,
        };
        ApiError::new(kind, e.message())
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.code(), self.message)
    }
}

impl std::error::Error for ApiError {}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ALL` is where the documented list of codes comes from. A new kind breaks the
    /// match below until it is given the next index; list it in `ALL` at that index.
    #[test]
    fn all_lists_every_kind_once_in_order() {
        fn index(kind: ApiErrorKind) -> usize {
            match kind {
                ApiErrorKind::InvalidJson => 0,
                ApiErrorKind::InvalidArgument => 1,
                ApiErrorKind::PayloadTooLarge => 2,
                ApiErrorKind::NotFound => 3,
                ApiErrorKind::MethodNotAllowed => 4,
                ApiErrorKind::Held => 5,
                ApiErrorKind::Timeout => 6,
                ApiErrorKind::NotHeld => 7,
                ApiErrorKind::Expired => 8,
                ApiErrorKind::LimitMismatch => 9,
                ApiErrorKind::SessionNotFound => 10,
                ApiErrorKind::ResourceExhausted => 11,
                ApiErrorKind::Unauthenticated => 12,
                ApiErrorKind::PermissionDenied => 13,
                ApiErrorKind::RateLimited => 14,
                ApiErrorKind::Cancelled => 15,
                ApiErrorKind::Unavailable => 16,
                ApiErrorKind::NotLeader => 17,
                ApiErrorKind::Internal => 18,
                ApiErrorKind::WatchCompacted => 19,
            }
        }
        for (i, kind) in ApiErrorKind::ALL.iter().enumerate() {
            assert_eq!(index(*kind), i, "{kind:?}");
        }
    }
}
