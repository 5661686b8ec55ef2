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
/// `run`, `elect`: the lock (leadership) was lost while the command ran, so it was
/// stopped
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
/// `serve`: the data directory is in use by another fencelock server; `backup`: the
/// output file exists and `--force` was not given (sysexits' `EX_CANTCREAT`).
pub const CANNOT_CREATE: u8 = 73;
/// `serve`: reading or writing the data directory failed (permissions, a full
/// disk; sysexits' `EX_IOERR`).
pub const STORAGE_IO: u8 = 74;

/// Every exit code: its number, its name (the `code` of `--json` errors) and what it
/// means. `fencelock help exit-codes`, the man page and the README show this table.
pub const TABLE: &[(u8, &str, &str)] = &[
    (0, "ok", "success; `run`, `elect`: the command's own exit code (128+N if it was killed by signal N)"),
    (FAILURE, "failure", "any other failure: no such lock, no leader, a corrupt backup, storage failed while serving"),
    (USAGE, "usage", "bad flags, input or configuration"),
    (CORRUPT_DATA, "corrupt_data", "`serve`: the data directory holds data that fails validation"),
    (UNAVAILABLE, "unavailable", "the server could not be reached or is unavailable (`cluster`: no leader answered within --wait)"),
    (CANNOT_LISTEN, "cannot_listen", "`serve`: an address could not be bound"),
    (CANNOT_CREATE, "cannot_create", "`serve`: the data directory is in use by another server; `backup`: --out exists (add --force)"),
    (STORAGE_IO, "storage_io", "`serve`: reading or writing the data directory failed"),
    (LOCK_LOST, "lock_lost", "`run`, `elect`: the lock (leadership) was lost while the command ran; the command was stopped"),
    (NO_PERMISSION, "not_permitted", "not authenticated (no token, or one the server does not know) or not allowed"),
    (NOT_ACQUIRED, "not_acquired", "the lock was not acquired (held, and not freed within --wait)"),
    (CANNOT_EXECUTE, "cannot_execute", "`run`: the command could not be executed"),
    (COMMAND_NOT_FOUND, "command_not_found", "`run`: the command was not found"),
];

/// The name of an exit code (`failure` for one not in [`TABLE`]).
pub fn name(code: u8) -> &'static str {
    TABLE
        .iter()
        .find(|(c, _, _)| *c == code)
        .map_or("failure", |(_, name, _)| name)
}

/// [`TABLE`] as text for a terminal.
pub fn table_text() -> String {
    let mut out = String::from("Exit codes of fencelock:\n\n");
    for (code, name, meaning) in TABLE {
        out.push_str(&format!("  {code:>3}  {name:<17}  {meaning}\n"));
    }
    out.push_str(
        "\nWith --json, a failure is also printed to stderr as \
         {\"error\":{\"code\":NAME,\"message\":…,\"exit_code\":N}}.\n",
    );
    out
}

/// The exit code when `serve` cannot start.
pub fn for_start(e: &StartError) -> u8 {
    match e.kind() {
        StartErrorKind::Config => USAGE,
        StartErrorKind::Listen => CANNOT_LISTEN,
        StartErrorKind::Recovery => match e.recovery().map(RecoveryError::kind) {
            Some(RecoveryErrorKind::Locked) => CANNOT_CREATE,
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
