//! What goes into the state machine (commands) and what comes out (replies, outcomes).

use std::fmt;

use crate::types::{
    Fence, LockName, Mode, Owner, OwnerToken, Reason, RequestId, SessionId, Tenant, Value,
};

/// One principal's quotas, carried inside the logged command that they limit (so
/// replay decides exactly as the live server did, whatever the configuration says
/// by then).
///
/// A queued acquire counts against `max_waiters` *and* `max_held_locks`: handing
/// it the lock later turns a waiter into a holder, which then never takes the
/// principal over its `max_held_locks`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Quota {
    /// Most open sessions.
    pub max_sessions: u32,
    /// Most held grants plus queued acquires.
    pub max_held_locks: u32,
    /// Most queued acquires.
    pub max_waiters: u32,
}

/// An acquire request. The server supplies `token` (fresh random bits); the core never
/// makes up randomness, so replaying the same commands gives the same state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acquire {
    /// The lock to acquire.
    pub name: LockName,
    /// The owner token this grant (or this queued request) will carry.
    pub token: OwnerToken,
    /// Lease length. Required without a session; must be absent with one (the
    /// session's lease governs).
    pub ttl_ms: Option<u64>,
    /// How long to wait in the queue; 0 = fail at once with `Held`.
    pub wait_ms: u64,
    /// Who is asking (free text for operators).
    pub owner: Owner,
    /// Idempotency key: a retry with the same key and name gets the same grant.
    pub request_id: Option<RequestId>,
    /// Number of concurrent holders the lock admits (1 = a mutex).
    pub limit: u32,
    /// After this holder's lease *expires* or is force-released, keep the lock
    /// unavailable this long (Chubby's lock-delay). 0 = none.
    pub lock_delay_ms: u64,
    /// Hold the lock under this session's lease instead of a lease of its own.
    /// Only the principal that opened the session may attach locks to it.
    pub session: Option<SessionId>,
    /// Who asks: the grant (or queued request) counts against this principal's
    /// usage. `None` in records written before principals were recorded.
    pub tenant: Option<Tenant>,
    /// The principal's quota; `None` = unlimited (anonymous, or an old record).
    pub quota: Option<Quota>,
    /// Exclusive (a writer, the default) or shared (a reader).
    pub mode: Mode,
    /// An election campaign's value: the grant is the election's leader and
    /// publishes it. Exclusive grants only.
    pub value: Option<Value>,
}

/// A state change proposed to the core. Every command is logged before its reply is
/// released, so replaying the log replays every decision, expiries included.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Take a lock (or a semaphore slot), or queue for it.
    Acquire(Acquire),
    /// Take several locks as one request: all of them or none, queued on every
    /// lock at once and granted only when it can be granted on each at the same
    /// time. Each part names its own lock, token, mode and limit; every other field
    /// must be the same in all parts. 1..=[`MAX_NAMES_PER_REQUEST`](crate::MAX_NAMES_PER_REQUEST)
    /// distinct names.
    AcquireAll(Vec<Acquire>),
    /// Turn an exclusive grant into a shared one without releasing it: the fence is
    /// kept, and readers queued right behind may be granted with it.
    Downgrade {
        /// The lock.
        name: LockName,
        /// The grant's owner token.
        token: OwnerToken,
    },
    /// Change the value an election's leader publishes.
    Proclaim {
        /// The election (its lock).
        name: LockName,
        /// The leader's owner token.
        token: OwnerToken,
        /// The new value.
        value: Value,
    },
    /// Give several grants back in one transition (all or nothing: every one must
    /// be held, or already released by its token).
    ReleaseAll {
        /// The grants, as (lock, owner token).
        grants: Vec<(LockName, OwnerToken)>,
    },
    /// Extend a held lease. With a session-held lock this keeps the session alive.
    Renew {
        /// The lock.
        name: LockName,
        /// The grant's owner token.
        token: OwnerToken,
        /// New lease length; `None` keeps the current one.
        ttl_ms: Option<u64>,
    },
    /// Give a lock back; the head waiter is granted in the same transition.
    Release {
        /// The lock.
        name: LockName,
        /// The grant's owner token.
        token: OwnerToken,
    },
    /// Operator action: take a lock away from its holder(s). Lock-delay applies.
    ForceRelease {
        /// The lock.
        name: LockName,
        /// Only the holder with this fence; `None` = every holder.
        fence: Option<Fence>,
        /// Why; always reported in the event.
        reason: Reason,
    },
    /// The client behind a queued acquire went away (or gave up).
    CancelWait {
        /// The lock.
        name: LockName,
        /// The queued request's token.
        token: OwnerToken,
    },
    /// Open a session: a lease that can hold many locks.
    OpenSession {
        /// Server-chosen random id.
        id: SessionId,
        /// Session lease length.
        ttl_ms: u64,
        /// Who owns the session.
        owner: Owner,
        /// The principal opening it: the session's owner for keep-alive, attach
        /// and close. `None` in old records: owned by nobody.
        tenant: Option<Tenant>,
        /// The principal's quota; `None` = unlimited.
        quota: Option<Quota>,
    },
    /// Renew a session lease (and so every lock it holds).
    KeepAlive {
        /// The session.
        id: SessionId,
    },
    /// Close a session: release its locks cleanly and drop its queued requests.
    CloseSession {
        /// The session.
        id: SessionId,
    },
    /// Process every lease, wait and lock-delay deadline that has passed.
    Tick,
    /// The server restarted: every lease and session gets a full fresh TTL, and every
    /// queued request is dropped (its client is gone).
    Recover,
    /// A new cluster leader took over: every lease and session gets a full fresh
    /// TTL, as after a restart (the new leader cannot know how much of a lease the
    /// holder believes is left), but queued requests keep their place: their
    /// clients retry with the same request id.
    Promote,
    /// Make every fence from now on at least `floor` (used after restoring a backup).
    RaiseFenceFloor {
        /// The least fence the next grant may get.
        floor: u64,
    },
}

/// A grant: the lock is held under `token` and fenced by `fence`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The lock.
    pub name: LockName,
    /// This grant's fencing token.
    pub fence: Fence,
    /// This grant's owner token.
    pub token: OwnerToken,
    /// Lease length (the session's, for a session-held lock).
    pub ttl_ms: u64,
    /// The session holding it, if any.
    pub session: Option<SessionId>,
    /// How it holds the lock.
    pub mode: Mode,
}

/// The direct answer to a command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// The lock was granted now (or earlier, to the same `request_id`).
    Granted(Grant),
    /// Every lock of an [`Command::AcquireAll`] was granted now (or earlier, to the
    /// same `request_id`), in the order asked.
    GrantedAll(Vec<Grant>),
    /// An [`Command::AcquireAll`] waits in every queue; an [`Outcome::GrantedAll`]
    /// or an [`Outcome::WaitEnded`] for each part follows later.
    QueuedAll {
        /// The parts' tokens, in the order asked.
        tokens: Vec<OwnerToken>,
    },
    /// The grant is shared now.
    Downgraded {
        /// The grant, now shared, with its fence kept.
        grant: Grant,
        /// Whether this command changed it (`false`: it was already shared).
        downgraded: bool,
    },
    /// The leader's value was changed.
    Proclaimed(Grant),
    /// Several grants were given back; one flag per grant, as for
    /// [`Reply::Released`].
    ReleasedAll {
        /// Whether each was released by this command.
        released: Vec<bool>,
    },
    /// The request waits in the queue; an [`Outcome::Granted`] or
    /// [`Outcome::WaitEnded`] with this token follows later.
    Queued {
        /// The token the grant will carry (for an idempotent retry, the first
        /// request's token).
        token: OwnerToken,
        /// Zero-based place in the queue.
        position: usize,
    },
    /// The lease was extended.
    Renewed(Grant),
    /// The lock was released now (`true`) or had already been released by this
    /// same token (`false`: an idempotent retry).
    Released {
        /// Whether this command released it.
        released: bool,
    },
    /// The fences of the holders that were force-released.
    ForceReleased {
        /// Fences taken away.
        fences: Vec<Fence>,
    },
    /// The queued request was removed (`false` if it was no longer queued).
    WaitCancelled {
        /// Whether a queued request was removed.
        cancelled: bool,
    },
    /// A session was opened.
    SessionOpened {
        /// The session.
        id: SessionId,
        /// Its lease.
        ttl_ms: u64,
    },
    /// A session lease was renewed.
    KeptAlive {
        /// Its lease.
        ttl_ms: u64,
    },
    /// A session was closed.
    SessionClosed {
        /// How many locks it released.
        released: usize,
    },
    /// Deadlines were processed.
    Ticked,
    /// Leases were refreshed after a restart.
    Recovered,
    /// Leases were refreshed for a new leader.
    Promoted,
    /// The fence floor was raised.
    FenceFloorRaised {
        /// The next fence that will be issued.
        next_fence: u64,
    },
}

/// Why a queued request left the queue without a grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitEnd {
    /// `wait_ms` passed.
    TimedOut,
    /// Its session expired or was closed.
    SessionEnded,
    /// The client cancelled (or went away).
    Cancelled,
    /// The server restarted; the client must retry.
    ServerRestarted,
}

/// How a grant ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrantEnd {
    /// Released by its holder (or its session was closed).
    Released,
    /// Its lease (or its session) expired.
    Expired,
    /// Taken away by an operator.
    ForceReleased,
}

/// What kind of lock event happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// A grant was made (directly or by hand-off to a waiter).
    Granted,
    /// A grant ended.
    Ended(GrantEnd),
    /// A request joined the queue.
    Queued,
    /// A request left the queue without a grant.
    WaitEnded(WaitEnd),
    /// An exclusive grant became shared (its fence kept).
    Downgraded,
    /// An election's leader published a new value (in [`Event::value`]).
    Proclaimed,
}

/// A lock event, for watchers, metrics and audit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// What happened.
    pub kind: EventKind,
    /// The lock.
    pub name: LockName,
    /// The grant's fence (for `Granted` and `Ended`).
    pub fence: Option<Fence>,
    /// The owner text of the grant or request.
    pub owner: Owner,
    /// The session involved, if any.
    pub session: Option<SessionId>,
    /// The principal the grant or request belongs to, if recorded.
    pub tenant: Option<Tenant>,
    /// Service time of the event.
    pub at_ms: u64,
    /// For `Granted`: time spent queued. For `Ended`: time held.
    pub duration_ms: u64,
    /// For forced releases: the operator's reason.
    pub reason: Option<Reason>,
    /// The grant's or request's mode.
    pub mode: Mode,
    /// The election value, for `Granted` and `Proclaimed` of a leader.
    pub value: Option<Value>,
    /// For `Granted`: the lock was handed to a queued request (on a release,
    /// expiry, forced release, downgrade or a wait ending ahead of it) rather than
    /// granted to the acquire that asked. Always false for other kinds.
    pub handoff: bool,
}

/// Something the driver must act on after a command, besides its direct reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// A queued request was granted (hand-off); answer the waiting client.
    Granted(Grant),
    /// A queued [`Command::AcquireAll`] was granted on every lock at once; answer
    /// the waiting client (listening on the first part's token).
    GrantedAll(Vec<Grant>),
    /// A queued request left the queue without a grant; answer the waiting client.
    WaitEnded {
        /// The queued request's token.
        token: OwnerToken,
        /// The lock.
        name: LockName,
        /// Why.
        reason: WaitEnd,
    },
    /// A lock event for watchers and metrics.
    Event(Event),
}

/// Why a command did nothing. These are ordinary answers to client mistakes or
/// contention, never broken invariants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    kind: ErrorKind,
    message: String,
}

/// The stable classification of an [`Error`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// An argument is out of range or inconsistent.
    InvalidArgument,
    /// The lock is held (or in lock-delay) and the request did not wait.
    Held,
    /// The token does not hold this lock.
    NotHeld,
    /// The token held this lock, but its lease expired.
    Expired,
    /// The lock exists with a different `limit`.
    LimitMismatch,
    /// The session does not exist (never opened, expired or closed).
    SessionNotFound,
    /// A bound was reached (locks, waiters, sessions, locks per session).
    ResourceExhausted,
    /// A per-principal quota ([`Quota`]) was reached; the message names it.
    QuotaExceeded,
}

impl ErrorKind {
    /// The stable snake_case code used on the wire.
    pub fn code(self) -> &'static str {
        match self {
            ErrorKind::InvalidArgument => "invalid_argument",
            ErrorKind::Held => "held",
            ErrorKind::NotHeld => "not_held",
            ErrorKind::Expired => "expired",
            ErrorKind::LimitMismatch => "limit_mismatch",
            ErrorKind::SessionNotFound => "session_not_found",
            ErrorKind::ResourceExhausted => "resource_exhausted",
            ErrorKind::QuotaExceeded => "quota_exceeded",
        }
    }
}

impl Error {
    /// Builds an error.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error {
            kind,
            message: message.into(),
        }
    }

    /// The classification.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// A human-readable explanation.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.code(), self.message)
    }
}

impl std::error::Error for Error {}

/// What kind of [`InvariantError`] it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum InvariantErrorKind {
    /// A live core's state breaks an invariant
    /// ([`Core::check_invariants`](crate::Core::check_invariants)): a bug.
    Broken,
    /// A state image breaks an invariant and was refused
    /// ([`Core::import`](crate::Core::import)): corrupt or forged input.
    BadImage,
}

/// A state (live or imported) that breaks an invariant; the message names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvariantError {
    kind: InvariantErrorKind,
    message: String,
}

impl InvariantError {
    pub(crate) fn new(kind: InvariantErrorKind, message: impl Into<String>) -> InvariantError {
        InvariantError {
            kind,
            message: message.into(),
        }
    }

    /// The category.
    pub fn kind(&self) -> InvariantErrorKind {
        self.kind
    }

    /// Which invariant, and where.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for InvariantError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for InvariantError {}
