//! The crate's error type.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

/// What went wrong, for callers that need to react differently (for example,
/// refuse to start on [`LogErrorKind::Corrupt`] but retry on [`LogErrorKind::Io`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LogErrorKind {
    /// An operating-system I/O call failed (open, write, fdatasync, rename, ...).
    /// A failure while writing or syncing also poisons the [`Log`](crate::Log).
    Io,
    /// On-disk data failed validation: bad magic or version, checksum mismatch
    /// that is not a torn tail, a segment cut short or missing (from the sequence,
    /// after a seal, or below the manifest's high-water mark), a missing seal or
    /// manifest, a corrupt snapshot. The message names the file and, where it
    /// applies, the offset.
    Corrupt,
    /// A record is larger than [`MAX_RECORD_BYTES`](crate::MAX_RECORD_BYTES) or a
    /// snapshot is larger than [`MAX_SNAPSHOT_BYTES`](crate::MAX_SNAPSHOT_BYTES).
    /// Nothing was written; the log stays usable.
    TooLarge,
    /// [`LogOptions`](crate::LogOptions) are out of range.
    InvalidOptions,
    /// Another [`Log`](crate::Log) (in this or another process) holds the data directory.
    Locked,
    /// An earlier write or sync failed, so what is on disk is unknown; the log
    /// refuses further work. Drop it and [`Log::open`](crate::Log::open) again to recover.
    Poisoned,
    /// The data directory, or a file of the log in it, is no longer the one the
    /// log opened (deleted, renamed away or replaced): found by
    /// [`Log::check_identity`](crate::Log::check_identity) and before every step
    /// that writes by path. The log is poisoned: it never writes into whatever now
    /// sits at the path.
    Replaced,
}

/// Error returned by every fallible operation of this crate.
///
/// `Display` names the file and, for corruption, the byte offset, e.g.
/// `corrupt log data in /data/log-0000000000000003.seg at offset 4168: record checksum mismatch ...`.
#[derive(Debug)]
pub struct LogError {
    kind: LogErrorKind,
    path: Option<PathBuf>,
    offset: Option<u64>,
    message: String,
    source: Option<io::Error>,
}

impl LogError {
    /// The category of the error.
    pub fn kind(&self) -> LogErrorKind {
        self.kind
    }

    /// The file (or directory) the error is about, if any.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The byte offset in [`path`](Self::path) where corruption was found, if it applies.
    pub fn offset(&self) -> Option<u64> {
        self.offset
    }

    pub(crate) fn io(path: &Path, what: &str, source: io::Error) -> LogError {
        LogError {
            kind: LogErrorKind::Io,
            path: Some(path.to_path_buf()),
            offset: None,
            message: what.to_string(),
            source: Some(source),
        }
    }

    pub(crate) fn corrupt(
        path: &Path,
        offset: Option<u64>,
        message: impl Into<String>,
    ) -> LogError {
        LogError {
            kind: LogErrorKind::Corrupt,
            path: Some(path.to_path_buf()),
            offset,
            message: message.into(),
            source: None,
        }
    }

    pub(crate) fn new(
        kind: LogErrorKind,
        path: Option<&Path>,
        message: impl Into<String>,
    ) -> LogError {
        LogError {
            kind,
            path: path.map(Path::to_path_buf),
            offset: None,
            message: message.into(),
            source: None,
        }
    }
}

impl fmt::Display for LogError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.kind {
            LogErrorKind::Io => "log I/O error",
            LogErrorKind::Corrupt => "corrupt log data",
            LogErrorKind::TooLarge => "too large",
            LogErrorKind::InvalidOptions => "invalid log options",
            LogErrorKind::Locked => "log directory is locked",
            LogErrorKind::Poisoned => "log is poisoned",
            LogErrorKind::Replaced => "data directory was deleted or replaced",
        };
        f.write_str(what)?;
        if let Some(path) = &self.path {
            write!(f, " in {}", path.display())?;
        }
        if let Some(offset) = self.offset {
            write!(f, " at offset {offset}")?;
        }
        if !self.message.is_empty() {
            write!(f, ": {}", self.message)?;
        }
        if let Some(source) = &self.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

impl std::error::Error for LogError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_ref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}
