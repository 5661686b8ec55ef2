//! The one error type of the client library.

use std::fmt;

/// What went wrong, in a form a program can match on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The request was refused as malformed (bad lock name, ttl out of range, …).
    /// Retrying the same request cannot help.
    InvalidArgument,
    /// The lock is held and the caller did not want to wait (`try_acquire`).
    Held,
    /// The lock was not granted within the caller's wait budget.
    Timeout,
    /// The grant is no longer held (released, expired or taken by an operator).
    NotHeld,
    /// The lock is, or may be, lost: renewal failed or could not be confirmed before
    /// the client's conservative deadline. Stop touching the protected resource.
    LockLost,
    /// The lock exists with a different `limit` than the one requested.
    LimitMismatch,
    /// The session named in the request does not exist (any more).
    SessionNotFound,
    /// The thing asked about does not exist (e.g. a lock nobody holds).
    NotFound,
    /// The server could not be reached, or it is shutting down. Transient.
    Unavailable,
    /// A server bound was hit (too many waiters, locks, …). Transient.
    ResourceExhausted,
    /// The caller is not authenticated, or not allowed to do this.
    PermissionDenied,
    /// The server answered something this client does not understand.
    Protocol,
    /// The server reported an internal failure.
    Internal,
    /// This backend cannot do what was asked honestly (see [`crate::Capabilities`]):
    /// e.g. a shared lock on a store without reader-writer locks.
    Unsupported,
    /// A watch cannot resume where it left off: the server no longer has the events
    /// after the last one seen (or never had them). Re-read the state and watch
    /// again from now.
    WatchCompacted,
}

impl ErrorKind {
    /// A stable lower-case name (`held`, `timeout`, `lock_lost`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidArgument => "invalid_argument",
            ErrorKind::Held => "held",
            ErrorKind::Timeout => "timeout",
            ErrorKind::NotHeld => "not_held",
            ErrorKind::LockLost => "lock_lost",
            ErrorKind::LimitMismatch => "limit_mismatch",
            ErrorKind::SessionNotFound => "session_not_found",
            ErrorKind::NotFound => "not_found",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::ResourceExhausted => "resource_exhausted",
            ErrorKind::PermissionDenied => "permission_denied",
            ErrorKind::Protocol => "protocol",
            ErrorKind::Internal => "internal",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::WatchCompacted => "watch_compacted",
        }
    }

    /// Whether the same request may succeed if retried later (the client retries
    /// these itself, within the caller's wait budget).
    pub fn is_transient(self) -> bool {
        matches!(self, ErrorKind::Unavailable | ErrorKind::ResourceExhausted)
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error of the client library: a [`kind`](Error::kind) to match on, and a message
/// for people.
#[derive(Debug, Clone)]
pub struct Error {
    kind: ErrorKind,
    message: String,
    /// Set for a cluster member's `not_leader` answer.
    not_leader: bool,
    /// With `not_leader`: the leader's URL, when the member named it.
    leader: Option<String>,
}

impl Error {
    /// An error of `kind` with a message.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error {
            kind,
            message: message.into(),
            not_leader: false,
            leader: None,
        }
    }

    /// A cluster member's `not_leader` answer: [`ErrorKind::Unavailable`] (another
    /// member can serve the request), naming the leader's URL when known.
    pub fn not_leader(message: impl Into<String>, leader: Option<String>) -> Error {
        Error {
            kind: ErrorKind::Unavailable,
            message: message.into(),
            not_leader: true,
            leader: leader.filter(|url| !url.is_empty()),
        }
    }

    /// Whether a cluster member answered that it is not the leader. The client
    /// follows such answers itself; one reaches the caller only when no member could
    /// serve the request in time. Its kind is [`ErrorKind::Unavailable`].
    pub fn is_not_leader(&self) -> bool {
        self.not_leader
    }

    /// With [`is_not_leader`](Error::is_not_leader): the leader's URL, when the member
    /// knew it.
    pub fn leader(&self) -> Option<&str> {
        self.leader.as_deref()
    }

    /// What went wrong.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The human-readable message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether retrying the same request later may succeed.
    pub fn is_transient(&self) -> bool {
        self.kind.is_transient()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind, self.message)
    }
}

impl std::error::Error for Error {}
