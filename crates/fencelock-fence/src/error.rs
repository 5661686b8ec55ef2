//! The crate's error type.

use std::fmt;

/// Why a fenced write was not applied.
#[derive(Debug)]
pub struct FenceError {
    kind: ErrorKind,
    message: String,
    fence: Option<u64>,
    last_fence: Option<u64>,
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

/// The category of a [`FenceError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The write's fence is not greater than the last fence accepted for the resource
    /// (its holder lost the lock, or the write was already applied). Nothing changed.
    /// Do not retry with the same fence: acquire the lock again for a new one.
    Stale,
    /// The resource does not exist (the PostgreSQL row is missing). Nothing changed.
    NotFound,
    /// The fence cannot be stored by this gate (PostgreSQL's `BIGINT` holds fences up
    /// to `i64::MAX`). Nothing changed.
    FenceOutOfRange,
    /// The key or configuration is not valid for this gate (e.g. a file name with a
    /// `/`, an SQL identifier with a quote). Nothing changed.
    InvalidInput,
    /// The stored fence record is unreadable; the gate refuses to guess.
    Corrupt,
    /// An I/O error (file gate). The write may or may not have been applied; the
    /// resource is in either the old or the new state, never a mix.
    Io,
    /// A database error (PostgreSQL gate). Whether the write was applied depends on
    /// the transaction: if it was not committed, it was not applied.
    Database,
}

impl FenceError {
    /// The category of this error.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// True for [`ErrorKind::Stale`]: the write was refused by the fence check.
    pub fn is_stale(&self) -> bool {
        self.kind == ErrorKind::Stale
    }

    /// The fence of the refused write, when the error is about a fence.
    pub fn fence(&self) -> Option<u64> {
        self.fence
    }

    /// For [`ErrorKind::Stale`]: the last fence the resource accepted, when the gate
    /// knows it.
    pub fn last_fence(&self) -> Option<u64> {
        self.last_fence
    }

    pub(crate) fn new(kind: ErrorKind, message: impl Into<String>) -> FenceError {
        FenceError {
            kind,
            message: message.into(),
            fence: None,
            last_fence: None,
            source: None,
        }
    }

    pub(crate) fn stale(resource: &dyn fmt::Display, fence: u64, last: Option<u64>) -> FenceError {
        let message = match last {
            Some(last) => format!(
                "stale fence for {resource}: fence {fence} is not greater than the last accepted fence {last}"
            ),
            None => format!("stale fence for {resource}: fence {fence} is not greater than the last accepted fence"),
        };
        FenceError {
            kind: ErrorKind::Stale,
            message,
            fence: Some(fence),
            last_fence: last,
            source: None,
        }
    }

    pub(crate) fn with_source(
        mut self,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> FenceError {
        self.source = Some(Box::new(source));
        self
    }

    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn with_fence(mut self, fence: u64) -> FenceError {
        self.fence = Some(fence);
        self
    }
}

impl fmt::Display for FenceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The cause is reported by `source()`, not repeated here (print the chain, e.g.
        // with anyhow's `{:#}`, to see both).
        f.write_str(&self.message)
    }
}

impl std::error::Error for FenceError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|s| s as &(dyn std::error::Error + 'static))
    }
}
