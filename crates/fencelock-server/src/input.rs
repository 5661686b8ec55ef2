//! Parsing of client input into the core's types, shared by HTTP and gRPC so both
//! accept and refuse exactly the same things, with the same messages.

use fencelock_core::{
    LockName, LockView, Mode, Owner, OwnerToken, RequestId, SessionId, Value, MAX_NAMES_PER_REQUEST,
};

use crate::engine::Handle;
use crate::error::{ApiError, ApiErrorKind};

/// Longest `request_id` a client may send, in bytes. The core allows more, because
/// the server scopes each id to its caller by prepending the token's name
/// ([`crate::auth::Principal::scope_request_id`]).
pub const MAX_CLIENT_REQUEST_ID_BYTES: usize = 128;

/// An `invalid_argument` error naming the field.
pub fn invalid(field: &str, e: impl std::fmt::Display) -> ApiError {
    ApiError::new(ApiErrorKind::InvalidArgument, format!("{field}: {e}"))
}

/// A lock name from the field `field`.
pub fn lock_name(field: &str, s: &str) -> Result<LockName, ApiError> {
    LockName::new(s).map_err(|e| invalid(field, e))
}

/// A lock mode: `exclusive` (also when absent or empty) or `shared`.
pub fn mode(s: Option<&str>) -> Result<Mode, ApiError> {
    match s {
        None | Some("") => Ok(Mode::Exclusive),
        Some(text) => Mode::parse(text).ok_or_else(|| {
            invalid(
                "mode",
                format!("must be \"exclusive\" or \"shared\", got {text:?}"),
            )
        }),
    }
}

/// An election value (at most 4096 bytes, no control characters).
pub fn value(s: &str) -> Result<Value, ApiError> {
    Value::new(s).map_err(|e| invalid("value", e))
}

/// The names of a multi-lock request: 1 to [`MAX_NAMES_PER_REQUEST`], distinct,
/// each a valid lock name.
pub fn names(list: &[String]) -> Result<Vec<LockName>, ApiError> {
    if list.is_empty() {
        return Err(invalid("names", "name at least one lock"));
    }
    if list.len() > MAX_NAMES_PER_REQUEST {
        return Err(invalid(
            "names",
            format!(
                "at most {MAX_NAMES_PER_REQUEST} locks in one request, got {}",
                list.len()
            ),
        ));
    }
    let mut names: Vec<LockName> = Vec::with_capacity(list.len());
    for s in list {
        let name = lock_name("names", s)?;
        if names.contains(&name) {
            return Err(invalid("names", format!("{name} appears twice")));
        }
        names.push(name);
    }
    Ok(names)
}

/// An owner token (32 hex digits).
pub fn owner_token(s: &str) -> Result<OwnerToken, ApiError> {
    s.parse().map_err(|e| invalid("owner_token", e))
}

/// A session id (32 hex digits).
pub fn session_id(s: &str) -> Result<SessionId, ApiError> {
    s.parse().map_err(|e| invalid("session", e))
}

/// Bytes of SHA-256 a [`session_handle`] keeps (16 hex digits).
const HANDLE_BYTES: usize = 8;

/// A session's *handle*: the first 16 hex digits of the SHA-256 of its id's text.
/// Shown wherever others may look (lock views, watch events, the audit log, the
/// dashboard, the admin session list) instead of the id, which is the owner's
/// secret: the handle names the session but cannot be turned back into its id, so
/// it keeps nobody alive and closes nothing. 64 bits: two sessions of a million
/// share a handle with odds of about 1 in 36 million (an admin close by handle
/// then refuses, naming both; see [`crate::engine::Handle::close_session_by_handle`]).
pub fn session_handle(id: SessionId) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, id.to_string().as_bytes());
    hex::encode(&digest.as_ref()[..HANDLE_BYTES])
}

/// A session handle from a client: 16 lowercase hex digits.
pub fn handle(s: &str) -> Result<String, ApiError> {
    let ok = s.len() == 2 * HANDLE_BYTES
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if !ok {
        return Err(invalid(
            "handle",
            "a session handle is 16 lowercase hex digits",
        ));
    }
    Ok(s.to_owned())
}

/// Owner text (may be empty).
pub fn owner(s: &str) -> Result<Owner, ApiError> {
    Owner::new(s).map_err(|e| invalid("owner", e))
}

/// An optional idempotency key, at most [`MAX_CLIENT_REQUEST_ID_BYTES`] long.
pub fn request_id(s: Option<&str>) -> Result<Option<RequestId>, ApiError> {
    if s.is_some_and(|s| s.len() > MAX_CLIENT_REQUEST_ID_BYTES) {
        return Err(invalid(
            "request_id",
            format!("request_id must be at most {MAX_CLIENT_REQUEST_ID_BYTES} bytes"),
        ));
    }
    s.map(RequestId::new)
        .transpose()
        .map_err(|e| invalid("request_id", e))
}

/// One page of at most `max` locks after `after` whose names start with any of
/// `ranges` (prefixes none of which contains another, from
/// [`crate::auth::Principal::ranges`]), in name order.
pub async fn locks_in(
    handle: &Handle,
    ranges: Vec<String>,
    after: Option<LockName>,
    max: usize,
    stale: bool,
) -> Result<Vec<LockView>, ApiError> {
    let mut views = Vec::new();
    for range in ranges {
        views.extend(handle.locks_with(range, after.clone(), max, stale).await?);
    }
    views.sort_by(|a, b| a.name.as_str().cmp(b.name.as_str()));
    views.truncate(max);
    Ok(views)
}

/// A listing prefix: empty, or itself a valid lock name, so that listing is a range
/// scan and never a walk over every lock.
pub fn prefix(s: String) -> Result<String, ApiError> {
    if !s.is_empty() {
        lock_name("prefix", &s)?;
    }
    Ok(s)
}
