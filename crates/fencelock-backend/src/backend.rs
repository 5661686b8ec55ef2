//! The seam between the lock API and a lock store: [`LockBackend`].
//!
//! The guard logic (renewal, the lost-lock signal, retries, release on drop) lives in
//! `fencelock::Client` and works the same over every backend. A backend only
//! knows how to acquire, renew and release one grant on its store, and says what the
//! store can guarantee in [`Capabilities`]. The fencelock server
//! (`fencelock::FencelockBackend`) is the first implementation; other
//! stores implement the same trait.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use crate::Error;

/// A boxed future, as the object-safe [`LockBackend`] methods return.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a backend is asked to acquire. Built by `fencelock::LockRequest`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AcquireSpec {
    /// The lock name.
    pub name: String,
    /// Lease length.
    pub ttl: Duration,
    /// How long this one attempt may wait for the lock; zero = answer at once.
    pub wait: Duration,
    /// Who is asking (free text for operators).
    pub owner: String,
    /// Holders the lock admits (1 = a mutex).
    pub limit: u32,
    /// Lock-delay after an expiry or forced release of this grant; zero = none.
    pub lock_delay: Duration,
    /// Idempotency key: every retry of one acquire carries the same key, so a grant
    /// whose answer was lost is returned again instead of being granted twice.
    pub request_id: String,
}

impl AcquireSpec {
    /// A request for `name` with lease `ttl`, no wait, limit 1, no lock-delay, an
    /// empty owner and a fresh random request id.
    pub fn new(name: impl Into<String>, ttl: Duration) -> AcquireSpec {
        AcquireSpec {
            name: name.into(),
            ttl,
            wait: Duration::ZERO,
            owner: String::new(),
            limit: 1,
            lock_delay: Duration::ZERO,
            request_id: crate::backoff::request_id(),
        }
    }
}

/// Longest lock name, in bytes (the fencelock server's limit; every backend keeps it,
/// so a name valid on one store is valid on all).
pub const MAX_NAME_BYTES: usize = 256;
/// Longest owner text, in bytes.
pub const MAX_OWNER_BYTES: usize = 1024;
/// Longest request id, in bytes.
pub const MAX_REQUEST_ID_BYTES: usize = 256;
/// Longest lease a backend accepts (24 h, as the fencelock server).
pub const MAX_TTL: Duration = Duration::from_secs(24 * 3600);

impl AcquireSpec {
    /// Checks the request against the rules every backend shares (the fencelock
    /// server's): a name of 1..=256 bytes without control characters, an owner of at
    /// most 1024 bytes, a request id of 1..=256 bytes, `ttl` in 1 ms..=24 h, `limit` at
    /// least 1. Stores with narrower rules (whole-second leases, no semaphores) check
    /// those themselves. Errors are `InvalidArgument` with a message naming the field.
    pub fn validate(&self) -> Result<(), Error> {
        check_text("lock name", &self.name, false, MAX_NAME_BYTES)?;
        check_text("owner", &self.owner, true, MAX_OWNER_BYTES)?;
        check_text("request_id", &self.request_id, false, MAX_REQUEST_ID_BYTES)?;
        if self.ttl < Duration::from_millis(1) || self.ttl > MAX_TTL {
            return Err(invalid(format!(
                "ttl must be between 1ms and {}s, got {:?}",
                MAX_TTL.as_secs(),
                self.ttl
            )));
        }
        if self.limit == 0 {
            return Err(invalid("limit must be at least 1".to_owned()));
        }
        Ok(())
    }
}

fn invalid(message: String) -> Error {
    Error::new(crate::ErrorKind::InvalidArgument, message)
}

fn check_text(what: &str, text: &str, allow_empty: bool, max_bytes: usize) -> Result<(), Error> {
    if text.is_empty() && !allow_empty {
        Err(invalid(format!("{what} must not be empty")))
    } else if text.len() > max_bytes {
        Err(invalid(format!("{what} must be at most {max_bytes} bytes")))
    } else if text.chars().any(char::is_control) {
        Err(invalid(format!(
            "{what} must not contain control characters"
        )))
    } else {
        Ok(())
    }
}

/// A grant as the backend reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Lease {
    /// The lock name.
    pub name: String,
    /// The fencing token: larger than every fence issued before for this lock (see
    /// [`Capabilities::fences`] for how strong that promise is on this backend).
    pub fence: u64,
    /// Identifies this grant; renew and release need it.
    pub owner_token: String,
    /// The lease length the store granted.
    pub ttl: Duration,
}

impl Lease {
    /// A lease (for backends outside this crate).
    pub fn new(name: String, fence: u64, owner_token: String, ttl: Duration) -> Lease {
        Lease {
            name,
            fence,
            owner_token,
            ttl,
        }
    }
}

/// How strong a backend's fencing tokens are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FenceGuarantee {
    /// Strictly increasing and never reused, across crashes and restarts (the counter
    /// is durable before a grant is acknowledged).
    Durable,
    /// Increasing while the store keeps its data; a crash or failover can reuse
    /// or lower fences (e.g. Redis without `appendfsync always`).
    BestEffort,
    /// No fencing tokens; the fence is always 0. Protect only resources that can
    /// tolerate overlap, or use lock-delay.
    None,
}

/// What a backend guarantees. Read it before relying on a property.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// The backend's name (`fencelock`, `redis`, …).
    pub backend: &'static str,
    /// How strong fencing tokens are.
    pub fences: FenceGuarantee,
    /// Waiters are granted in arrival order.
    pub fifo: bool,
    /// Waiters are woken by the store when the lock frees (no polling).
    pub push_wakeups: bool,
    /// Lock-delay after an expiry is supported.
    pub lock_delay: bool,
    /// Sessions (one lease holding many locks) are supported.
    pub sessions: bool,
    /// Semaphores (`limit` > 1) are supported.
    pub semaphores: bool,
    /// Leases are decided on the store's own monotonic clock (never a client's clock
    /// or a wall clock that can jump).
    pub monotonic_leases: bool,
}

impl Capabilities {
    /// A store named `backend` with fences of strength `fences` and none of the
    /// optional features; a store crate sets the fields it supports:
    /// `let mut caps = Capabilities::new("mystore", FenceGuarantee::Durable); caps.fifo = true;`
    pub fn new(backend: &'static str, fences: FenceGuarantee) -> Capabilities {
        Capabilities {
            backend,
            fences,
            fifo: false,
            push_wakeups: false,
            lock_delay: false,
            sessions: false,
            semaphores: false,
            monotonic_leases: false,
        }
    }
}

/// A lock store. Implementations must be cheap to share (`Arc`) and safe to call
/// concurrently.
///
/// Contract:
/// - `acquire` waits at most `spec.wait` on the store and returns the grant, or an
///   [`Error`] whose kind is `Held` (wait was zero), `Timeout` (wait passed),
///   a transient kind (`Unavailable`, `ResourceExhausted`) or a permanent one. A retry
///   with the same `request_id` must not create a second grant.
/// - `renew` extends the lease to `ttl` from the moment the store processes it and
///   returns the lease length granted; `NotHeld` when the grant is gone.
/// - `release` returns `true` if it released the grant, `false` if it was already
///   gone (released or expired); it never touches another holder's grant.
pub trait LockBackend: Send + Sync + 'static {
    /// What this backend guarantees.
    fn capabilities(&self) -> Capabilities;

    /// Acquires a lock (see the trait docs for the contract).
    fn acquire<'a>(&'a self, spec: &'a AcquireSpec) -> BoxFuture<'a, Result<Lease, Error>>;

    /// Renews a held lease for `ttl`; returns the lease length granted.
    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Duration, Error>>;

    /// Releases a held lease.
    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<bool, Error>>;
}

impl std::fmt::Debug for dyn LockBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.capabilities().backend)
    }
}
