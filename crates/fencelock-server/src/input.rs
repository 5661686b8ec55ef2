//! Parsing of client input into the core's types, shared by HTTP and gRPC so both
//! accept and refuse exactly the same things, with the same messages.

use fencelock_core::{
    LockName, LockView, Mode, Owner, OwnerToken, RequestId, SessionId, Value, MAX_NAMES_PER_REQUEST,
};

use crate::auth::{Action, Principal};
use crate::engine::{AcquireArgs, Handle};
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

/// What an acquire or a campaign asks, as it came (HTTP body or protobuf), before it
/// is checked: one shape so that every edge builds [`AcquireArgs`] the same way.
pub(crate) struct AcquireInput<'a> {
    /// Lease; required without a session.
    pub ttl_ms: Option<u64>,
    /// How long to wait; 0 = do not wait.
    pub wait_ms: u64,
    /// Who is asking (empty: anonymous).
    pub owner: &'a str,
    /// The client's idempotency key, before it is scoped to the caller.
    pub request_id: Option<&'a str>,
    /// Holders admitted (1 = mutex).
    pub limit: u32,
    /// Lock-delay after expiry or forced release.
    pub lock_delay_ms: u64,
    /// The session's handle.
    pub session: Option<&'a str>,
    /// `exclusive` (default) or `shared`.
    pub mode: Option<&'a str>,
    /// A campaign's value: then exclusive, limit 1 and no lock-delay.
    pub value: Option<&'a str>,
}

impl AcquireInput<'_> {
    /// The checked arguments for each of `names`, once `caller` may acquire every
    /// one of them (role, prefix) and within its rate of acquire attempts.
    pub(crate) fn args(
        &self,
        caller: &Principal,
        names: Vec<LockName>,
    ) -> Result<Vec<AcquireArgs>, ApiError> {
        for name in &names {
            caller.authorize(Action::Acquire, Some(name.as_str()))?;
        }
        let owner = owner(self.owner)?;
        let request_id = caller.scope_request_id(request_id(self.request_id)?)?;
        let session = self.session.map(session_id).transpose()?;
        let (mode, limit, lock_delay_ms, value) = match self.value {
            Some(v) => (Mode::Exclusive, 1, 0, Some(value(v)?)),
            None => (mode(self.mode)?, self.limit, self.lock_delay_ms, None),
        };
        caller.take_acquire_attempt()?;
        Ok(names
            .into_iter()
            .map(|name| AcquireArgs {
                name,
                ttl_ms: self.ttl_ms,
                wait_ms: self.wait_ms,
                owner: owner.clone(),
                request_id: request_id.clone(),
                limit,
                lock_delay_ms,
                session,
                mode,
                value: value.clone(),
            })
            .collect())
    }

    /// The checked arguments for one lock.
    pub(crate) fn one(&self, caller: &Principal, name: LockName) -> Result<AcquireArgs, ApiError> {
        self.args(caller, vec![name])?
            .pop()
            .ok_or_else(|| invalid("name", "name a lock"))
    }
}

/// A request about a grant the caller holds (renew, release, downgrade, proclaim,
/// resign): the lock and the owner token, once `caller` may do `action` on it and
/// within its request rate.
pub(crate) fn held(
    caller: &Principal,
    action: Action,
    name: &str,
    token: &str,
) -> Result<(LockName, OwnerToken), ApiError> {
    let name = lock_name("name", name)?;
    caller.authorize(action, Some(name.as_str()))?;
    let token = owner_token(token)?;
    caller.take_request()?;
    Ok((name, token))
}

/// The grants of a release-all (1 to [`MAX_NAMES_PER_REQUEST`]), each one `caller`
/// may release, within its request rate.
pub(crate) fn grants<'a>(
    caller: &Principal,
    grants: impl ExactSizeIterator<Item = (&'a str, &'a str)>,
) -> Result<Vec<(LockName, OwnerToken)>, ApiError> {
    if grants.len() == 0 || grants.len() > MAX_NAMES_PER_REQUEST {
        return Err(invalid(
            "grants",
            format!(
                "release 1 to {MAX_NAMES_PER_REQUEST} grants at once, got {}",
                grants.len()
            ),
        ));
    }
    let mut parsed = Vec::with_capacity(grants.len());
    for (name, token) in grants {
        let name = lock_name("name", name)?;
        caller.authorize(Action::Release, Some(name.as_str()))?;
        parsed.push((name, owner_token(token)?));
    }
    caller.take_request()?;
    Ok(parsed)
}
