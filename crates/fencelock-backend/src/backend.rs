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

/// How a grant holds its lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum LockMode {
    /// The only holder (a writer). The default.
    #[default]
    Exclusive,
    /// One of any number of readers (up to the lock's `limit`), never together with
    /// an exclusive holder. Strict FIFO across modes: a queued writer blocks readers
    /// that arrive after it.
    Shared,
}

impl LockMode {
    /// `"exclusive"` or `"shared"`, as on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            LockMode::Exclusive => "exclusive",
            LockMode::Shared => "shared",
        }
    }
}

/// Who leads an election now (see [`LockBackend::leader`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Leader {
    /// The election's name.
    pub name: String,
    /// The value the leader campaigned with or last proclaimed (e.g. its address).
    pub value: String,
    /// The leader's term: the fence of its grant, so its writes are fenced like any
    /// holder's, and a later leader always has a larger term.
    pub term: u64,
    /// The leader's owner text.
    pub owner: String,
}

impl Leader {
    /// A leader (for backends outside this crate).
    pub fn new(name: String, value: String, term: u64, owner: String) -> Leader {
        Leader {
            name,
            value,
            term,
            owner,
        }
    }
}

/// A session as the backend reports it: one lease that can hold many locks
/// ([`Capabilities::sessions`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SessionLease {
    /// The session's id; [`AcquireSpec::session`] takes it.
    pub id: String,
    /// The lease length the store granted.
    pub ttl: Duration,
}

impl SessionLease {
    /// A session lease (for backends outside this crate).
    pub fn new(id: String, ttl: Duration) -> SessionLease {
        SessionLease { id, ttl }
    }
}

/// Longest election value, in bytes.
pub const MAX_VALUE_BYTES: usize = 4096;

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
    /// Exclusive (the default) or shared.
    pub mode: LockMode,
    /// Hold the lock under this session's lease (see [`LockBackend::open_session`])
    /// instead of a lease of its own; `ttl` is then ignored by the store.
    pub session: Option<String>,
}

impl AcquireSpec {
    /// A request for `name` with lease `ttl`, no wait, limit 1, no lock-delay, an
    /// empty owner, exclusive mode and a fresh random request id.
    pub fn new(name: impl Into<String>, ttl: Duration) -> AcquireSpec {
        AcquireSpec {
            name: name.into(),
            ttl,
            wait: Duration::ZERO,
            owner: String::new(),
            limit: 1,
            lock_delay: Duration::ZERO,
            request_id: crate::backoff::request_id(),
            mode: LockMode::Exclusive,
            session: None,
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

/// Checks an election value: at most [`MAX_VALUE_BYTES`] bytes of UTF-8 without
/// control characters (it shows on the dashboard and in `fencelock leader`).
pub fn validate_value(value: &str) -> Result<(), Error> {
    check_text("value", value, true, MAX_VALUE_BYTES)
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
    /// Reader-writer locks ([`LockMode::Shared`]) are supported, with the same fence
    /// guarantee as exclusive grants.
    pub shared: bool,
    /// An exclusive holder can become a shared one without releasing
    /// ([`LockBackend::downgrade`]).
    pub downgrade: bool,
    /// Leader elections ([`LockBackend::campaign`], [`LockBackend::proclaim`],
    /// [`LockBackend::leader`]) are supported.
    pub elections: bool,
    /// Multi-locks: several names acquired as one all-or-nothing request that cannot
    /// deadlock against an overlapping one ([`LockBackend::acquire_all`],
    /// [`LockBackend::release_all`]). Never emulated by taking the names one at a
    /// time, which can deadlock.
    pub multi: bool,
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
            shared: false,
            downgrade: false,
            elections: false,
            multi: false,
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

    /// Turns an exclusive grant into a shared one without releasing it: the grant
    /// keeps its fence and its place in the queue, readers queued right behind it are
    /// let in, writers still wait. A store that can only do this by making a new grant
    /// (a new key or node, with a new fence, queued behind waiting writers) must not
    /// claim it. `Unsupported` unless [`Capabilities::downgrade`].
    fn downgrade<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<(), Error>> {
        let _ = lease;
        Box::pin(async { Err(unsupported("downgrade")) })
    }

    /// Campaigns in the election `spec.name`: waits (up to `spec.wait`) to hold it
    /// exclusively, with `value` published as the leader's value. The lease's fence is
    /// the leader's term. `Unsupported` unless [`Capabilities::elections`].
    fn campaign<'a>(
        &'a self,
        spec: &'a AcquireSpec,
        value: &'a str,
    ) -> BoxFuture<'a, Result<Lease, Error>> {
        let _ = (spec, value);
        Box::pin(async { Err(unsupported("elections")) })
    }

    /// Changes the leader's value while `lease` leads; `NotHeld` once it does not.
    fn proclaim<'a>(
        &'a self,
        lease: &'a Lease,
        value: &'a str,
    ) -> BoxFuture<'a, Result<(), Error>> {
        let _ = (lease, value);
        Box::pin(async { Err(unsupported("elections")) })
    }

    /// Acquires every lock in `names` as one request: all or none, waiting up to
    /// `spec.wait`, each with its own lease and fence, in the order given (`spec`
    /// gives everything but the name; its `name` is not used). The store queues the
    /// request on every lock at once, so two callers asking for overlapping sets in
    /// different orders never deadlock. `Unsupported` unless [`Capabilities::multi`].
    fn acquire_all<'a>(
        &'a self,
        names: &'a [&'a str],
        spec: &'a AcquireSpec,
    ) -> BoxFuture<'a, Result<Vec<Lease>, Error>> {
        let _ = (names, spec);
        Box::pin(async { Err(unsupported("multi-locks")) })
    }

    /// Releases several leases in one step; per lease, whether this call released it
    /// (`false`: already gone). `Unsupported` unless [`Capabilities::multi`].
    fn release_all<'a>(&'a self, leases: &'a [Lease]) -> BoxFuture<'a, Result<Vec<bool>, Error>> {
        let _ = leases;
        Box::pin(async { Err(unsupported("multi-locks")) })
    }

    /// Opens a session with lease `ttl`: locks acquired under it share its one
    /// keep-alive, and all end when it ends. `Unsupported` unless
    /// [`Capabilities::sessions`].
    fn open_session<'a>(
        &'a self,
        ttl: Duration,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<SessionLease, Error>> {
        let _ = (ttl, owner);
        Box::pin(async { Err(unsupported("sessions")) })
    }

    /// Renews a session's lease (and so every lock it holds); returns the lease
    /// length granted, or `SessionNotFound` once it has ended.
    fn keep_alive<'a>(
        &'a self,
        session: &'a SessionLease,
    ) -> BoxFuture<'a, Result<Duration, Error>> {
        let _ = session;
        Box::pin(async { Err(unsupported("sessions")) })
    }

    /// Closes a session, releasing its locks; returns how many it released.
    fn close_session<'a>(
        &'a self,
        session: &'a SessionLease,
    ) -> BoxFuture<'a, Result<usize, Error>> {
        let _ = session;
        Box::pin(async { Err(unsupported("sessions")) })
    }

    /// Who leads the election `name` now, if anyone.
    fn leader<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<Leader>, Error>> {
        let _ = name;
        Box::pin(async { Err(unsupported("elections")) })
    }

    /// Waits until the leader of `name` is no longer `known` (another holder, value or
    /// term, or none), at most `wait`, and returns the leader then. Stores that can
    /// push changes (etcd and ZooKeeper watches) implement it; the default is
    /// `Unsupported`, and `fencelock::Election::observe` then polls
    /// [`leader`](LockBackend::leader) instead.
    fn leader_change<'a>(
        &'a self,
        name: &'a str,
        known: Option<&'a Leader>,
        wait: Duration,
    ) -> BoxFuture<'a, Result<Option<Leader>, Error>> {
        let _ = (name, known, wait);
        Box::pin(async { Err(unsupported("leader watches")) })
    }
}

fn unsupported(what: &str) -> Error {
    Error::new(
        crate::ErrorKind::Unsupported,
        format!("this backend does not support {what} (see its Capabilities)"),
    )
}

impl std::fmt::Debug for dyn LockBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.capabilities().backend)
    }
}
