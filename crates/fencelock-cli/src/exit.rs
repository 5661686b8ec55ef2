//! The exit codes of the `fencelock` command (documented in the README and `--help`).

use fencelock::ErrorKind;
use fencelock_server::{RecoveryError, RecoveryErrorKind, StartError, StartErrorKind};

/// Something failed that has no more specific code.
pub const FAILURE: u8 = 1;
/// Bad flags or configuration.
pub const USAGE: u8 = 2;
/// The server could not be reached, or (`cluster …`) no leader answered within
/// `--wait` (sysexits' `EX_UNAVAILABLE`).
pub const UNAVAILABLE: u8 = 69;
/// The token is missing, wrong, or not allowed to do this (sysexits' `EX_NOPERM`).
pub const NO_PERMISSION: u8 = 77;
/// `run`: the lock was lost while the command ran, so it was stopped
/// (sysexits' `EX_TEMPFAIL`: try again).
pub const LOCK_LOST: u8 = 75;
/// The lock was not acquired within `--wait` (as `timeout(1)` reports a timeout).
pub const NOT_ACQUIRED: u8 = 124;
/// `run`: the command exists but could not be executed (as shells report it).
pub const CANNOT_EXECUTE: u8 = 126;
/// `run`: the command was not found (as shells report it).
pub const COMMAND_NOT_FOUND: u8 = 127;

/// `serve`: the data directory holds data that fails validation (a checksum, a cut
/// or missing file); nothing was loaded (sysexits' `EX_DATAERR`).
pub const CORRUPT_DATA: u8 = 65;
/// `serve`: an address could not be bound (sysexits' `EX_OSERR`).
pub const CANNOT_LISTEN: u8 = 71;
/// `serve`: the data directory is in use by another fencelock server (sysexits'
/// `EX_CANTCREAT`: the server cannot take it).
pub const DATA_DIR_IN_USE: u8 = 73;
/// `serve`: reading or writing the data directory failed (permissions, a full
/// disk; sysexits' `EX_IOERR`).
pub const STORAGE_IO: u8 = 74;

/// The exit code when `serve` cannot start.
pub fn for_start(e: &StartError) -> u8 {
    match e.kind() {
        StartErrorKind::Config => USAGE,
        StartErrorKind::Listen => CANNOT_LISTEN,
        StartErrorKind::Recovery => match e.recovery().map(RecoveryError::kind) {
            Some(RecoveryErrorKind::Locked) => DATA_DIR_IN_USE,
            Some(RecoveryErrorKind::Corrupt) => CORRUPT_DATA,
            Some(RecoveryErrorKind::Io) => STORAGE_IO,
            Some(RecoveryErrorKind::Invalid) => USAGE,
            _ => FAILURE,
        },
        _ => FAILURE,
    }
}

/// The exit code for a client library error.
pub fn for_error(kind: ErrorKind) -> u8 {
    match kind {
        ErrorKind::Held | ErrorKind::Timeout => NOT_ACQUIRED,
        ErrorKind::Unavailable => UNAVAILABLE,
        ErrorKind::LockLost => LOCK_LOST,
        ErrorKind::InvalidArgument => USAGE,
        ErrorKind::PermissionDenied => NO_PERMISSION,
        _ => FAILURE,
    }
}
