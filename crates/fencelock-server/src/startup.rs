//! The errors of recovery and start-up: typed, with the file and offset where they
//! apply, so the `fencelock serve` binary can tell a data directory in use from a
//! corrupt one or a failing disk (and exit with a documented code). They become an
//! [`ApiError`] only where an API answers with one.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use fencelock_log::{LogError, LogErrorKind};

use crate::error::{ApiError, ApiErrorKind};

/// The error's underlying cause, for [`std::error::Error::source`].
type Source = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What kind of [`RecoveryError`] it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RecoveryErrorKind {
    /// Another process (or another server in this one) has the data directory (or
    /// its audit or Raft log) open: two servers must never share one.
    Locked,
    /// Data on disk failed validation (a checksum, a format, a cut or missing
    /// file, a snapshot that does not decode or is inconsistent). Nothing corrupt
    /// was loaded; [`RecoveryError::path`] names the file and
    /// [`RecoveryError::offset`] the byte offset where known.
    Corrupt,
    /// An operating-system call failed: permission denied, a full disk, a directory
    /// deleted or replaced while open, a thread that could not start.
    Io,
    /// A setting is out of range for the data found (log options, a fence floor).
    Invalid,
}

/// Recovering a data directory failed (see [`recover`](crate::engine::recover)).
#[derive(Debug)]
pub struct RecoveryError {
    kind: RecoveryErrorKind,
    path: Option<PathBuf>,
    offset: Option<u64>,
    message: String,
    source: Option<Source>,
}

impl RecoveryError {
    /// An error of `kind` about `path` (if any), with a complete explanation.
    pub(crate) fn new(
        kind: RecoveryErrorKind,
        path: Option<&Path>,
        message: impl Into<String>,
    ) -> RecoveryError {
        RecoveryError {
            kind,
            path: path.map(Path::to_path_buf),
            offset: None,
            message: message.into(),
            source: None,
        }
    }

    /// A failed I/O call `what` on `path`.
    pub(crate) fn io(what: &str, path: &Path, e: io::Error) -> RecoveryError {
        RecoveryError {
            kind: RecoveryErrorKind::Io,
            path: Some(path.to_path_buf()),
            offset: None,
            message: format!("cannot {what} {}: {e}", path.display()),
            source: Some(Box::new(e)),
        }
    }

    /// Data in `path` that does not decode or does not fit together.
    pub(crate) fn corrupt(path: &Path, message: impl Into<String>) -> RecoveryError {
        RecoveryError::new(RecoveryErrorKind::Corrupt, Some(path), message)
    }

    /// A log error (`context` says which log: "the log", "the audit log", …), with
    /// its kind, file and offset.
    pub(crate) fn from_log(context: &str, e: LogError) -> RecoveryError {
        let kind = match e.kind() {
            LogErrorKind::Locked => RecoveryErrorKind::Locked,
            LogErrorKind::Corrupt => RecoveryErrorKind::Corrupt,
            LogErrorKind::InvalidOptions => RecoveryErrorKind::Invalid,
            // Poisoned, Replaced, TooLarge while recovering: the disk or the
            // directory misbehaved under us.
            _ => RecoveryErrorKind::Io,
        };
        let message = match kind {
            RecoveryErrorKind::Locked => format!(
                "{context} in {} is in use by another fencelock server",
                e.path()
                    .map_or_else(String::new, |p| p.display().to_string())
            ),
            _ => format!("cannot open {context}: {e}"),
        };
        RecoveryError {
            kind,
            path: e.path().map(Path::to_path_buf),
            offset: e.offset(),
            message,
            source: Some(Box::new(e)),
        }
    }

    /// The same error, explained by `message` instead.
    pub(crate) fn with_message(mut self, message: String) -> RecoveryError {
        self.message = message;
        self
    }

    /// The category.
    pub fn kind(&self) -> RecoveryErrorKind {
        self.kind
    }

    /// The file or directory the error is about, if any.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The byte offset in [`path`](Self::path) where corruption was found, if known.
    pub fn offset(&self) -> Option<u64> {
        self.offset
    }

    /// The explanation (what `Display` prints).
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for RecoveryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for RecoveryError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

impl From<RecoveryError> for ApiError {
    /// For the admin calls that recover a directory while serving: a directory in
    /// use is `unavailable`, anything else a server fault.
    fn from(e: RecoveryError) -> ApiError {
        let kind = match e.kind {
            RecoveryErrorKind::Locked => ApiErrorKind::Unavailable,
            _ => ApiErrorKind::Internal,
        };
        ApiError::new(kind, e.message)
    }
}

/// What kind of [`StartError`] it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StartErrorKind {
    /// The configuration is refused (limits, tokens, TLS files, an exposed address
    /// without authentication, cluster settings, a directory that may not be used
    /// this way).
    Config,
    /// An address could not be bound (in use, not local, not permitted).
    Listen,
    /// Recovering the data directory failed; [`StartError::recovery`] says how.
    Recovery,
    /// Anything else the server needed to start (a thread, a runtime resource).
    Internal,
}

/// A server (or engine) could not start.
#[derive(Debug)]
pub struct StartError {
    kind: StartErrorKind,
    message: String,
    source: Option<Source>,
}

impl StartError {
    /// A refused configuration.
    pub(crate) fn config(message: impl Into<String>) -> StartError {
        StartError {
            kind: StartErrorKind::Config,
            message: message.into(),
            source: None,
        }
    }

    /// An address that could not be bound.
    pub(crate) fn listen(what: &str, addr: std::net::SocketAddr, e: io::Error) -> StartError {
        StartError {
            kind: StartErrorKind::Listen,
            message: format!("cannot listen {what}on {addr}: {e}"),
            source: Some(Box::new(e)),
        }
    }

    /// Anything else.
    pub(crate) fn internal(message: impl Into<String>) -> StartError {
        StartError {
            kind: StartErrorKind::Internal,
            message: message.into(),
            source: None,
        }
    }

    /// The category.
    pub fn kind(&self) -> StartErrorKind {
        self.kind
    }

    /// With [`StartErrorKind::Recovery`]: the recovery error (its kind, file, offset).
    pub fn recovery(&self) -> Option<&RecoveryError> {
        self.source.as_deref()?.downcast_ref::<RecoveryError>()
    }

    /// The explanation (what `Display` prints).
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl From<RecoveryError> for StartError {
    fn from(e: RecoveryError) -> StartError {
        StartError {
            kind: StartErrorKind::Recovery,
            message: e.message.clone(),
            source: Some(Box::new(e)),
        }
    }
}

impl fmt::Display for StartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for StartError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// What kind of [`ConfigError`] it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ConfigErrorKind {
    /// A value is out of range, malformed or inconsistent with another.
    Invalid,
    /// The settings would expose the server (or its peer port) without
    /// authentication; `--insecure` allows it.
    Insecure,
    /// A certificate or key file cannot be read or is not usable.
    Tls,
}

/// A setting is refused (limits, tokens, TLS files, cluster settings).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    kind: ConfigErrorKind,
    message: String,
}

impl ConfigError {
    /// An error of `kind`, explained by `message`.
    pub fn new(kind: ConfigErrorKind, message: impl Into<String>) -> ConfigError {
        ConfigError {
            kind,
            message: message.into(),
        }
    }

    /// A value out of range or malformed.
    pub(crate) fn invalid(message: impl Into<String>) -> ConfigError {
        ConfigError::new(ConfigErrorKind::Invalid, message)
    }

    /// The category.
    pub fn kind(&self) -> ConfigErrorKind {
        self.kind
    }

    /// The explanation (what `Display` prints).
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ConfigError {}

impl From<ConfigError> for StartError {
    fn from(e: ConfigError) -> StartError {
        StartError {
            kind: StartErrorKind::Config,
            message: e.message.clone(),
            source: Some(Box::new(e)),
        }
    }
}

impl From<ConfigError> for ApiError {
    /// For settings sent through the API: the caller's input is refused.
    fn from(e: ConfigError) -> ApiError {
        ApiError::new(ApiErrorKind::InvalidArgument, e.message)
    }
}
