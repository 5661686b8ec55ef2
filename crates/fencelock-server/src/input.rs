//! Parsing of client input into the core's types, shared by HTTP and gRPC so both
//! accept and refuse exactly the same things, with the same messages.

use fencelock_core::{LockName, Owner, OwnerToken, RequestId, SessionId};

use crate::error::{ApiError, ApiErrorKind};

/// An `invalid_argument` error naming the field.
pub fn invalid(field: &str, e: impl std::fmt::Display) -> ApiError {
    ApiError::new(ApiErrorKind::InvalidArgument, format!("{field}: {e}"))
}

/// A lock name from the field `field`.
pub fn lock_name(field: &str, s: &str) -> Result<LockName, ApiError> {
    LockName::new(s).map_err(|e| invalid(field, e))
}

/// An owner token (32 hex digits).
pub fn owner_token(s: &str) -> Result<OwnerToken, ApiError> {
    s.parse().map_err(|e| invalid("owner_token", e))
}

/// A session id (32 hex digits).
pub fn session_id(s: &str) -> Result<SessionId, ApiError> {
    s.parse().map_err(|e| invalid("session", e))
}

/// Owner text (may be empty).
pub fn owner(s: &str) -> Result<Owner, ApiError> {
    Owner::new(s).map_err(|e| invalid("owner", e))
}

/// An optional idempotency key.
pub fn request_id(s: Option<&str>) -> Result<Option<RequestId>, ApiError> {
    s.map(RequestId::new)
        .transpose()
        .map_err(|e| invalid("request_id", e))
}

/// A listing prefix: empty, or itself a valid lock name, so that listing is a range
/// scan and never a walk over every lock.
pub fn prefix(s: String) -> Result<String, ApiError> {
    if !s.is_empty() {
        lock_name("prefix", &s)?;
    }
    Ok(s)
}
