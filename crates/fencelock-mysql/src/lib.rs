//! # fencelock-mysql: MySQL and MariaDB as a lock store, two ways
//!
//! - [`MysqlBackend`] (**table mode**): one InnoDB row per lock in a table (by default
//!   `distributed_lock`, created if missing). Acquire, renew and release are each one
//!   short transaction that first locks the lock's row (`SELECT … FOR UPDATE`); the
//!   fence is drawn under that row lock and commits with the grant, so fences are
//!   durable and per-lock increasing. Waiters poll (no push wake-ups).
//! - [`MysqlGetLockBackend`] (**`GET_LOCK` mode**): the server's named user-level locks,
//!   one dedicated session per held lock, the session's `wait_timeout` as the lease.
//!   **No fencing tokens** (every fence is 0): protect only resources that tolerate an
//!   overlap, or use table mode.
//!
//! Both decide expiry on the database server, never on the client's clock — but on the
//! server's *wall* clock (`UTC_TIMESTAMP(6)`, or the session's idle timer): a jump of
//! the server's clock can end leases early or late, so neither claims
//! [`Capabilities::monotonic_leases`](fencelock_backend::Capabilities::monotonic_leases).
//!
//! Each backend is built from a URL (`mysql://user:password@host:port/database`; it
//! opens its own connections) or from a `mysql_async::Pool` the application already
//! has:
//!
//! | | from a URL | from the application's pool |
//! |---|---|---|
//! | table mode | its own pool (at most [`MysqlConfig::max_connections`]) | borrows a connection per call, returns it at once |
//! | `GET_LOCK` mode | one new connection per held lock | takes one of the pool's connections per held lock, for as long as it is held, and closes it on release |
//!
//! Table mode needs no dedicated connection and keeps no session state. `GET_LOCK`
//! mode does: the lock *is* the session.
//!
//! Connections are made without TLS: reach the database over a trusted network or a
//! local tunnel.
//!
//! Neither has reader-writer locks or elections: a shared request is refused with
//! [`ErrorKind::Unsupported`] (never granted as exclusive), and the capabilities say
//! so. `GET_LOCK` has no shared mode, and a table row holds one owner and one fence.
//!
//! ```no_run
//! use std::sync::Arc;
//! use fencelock_mysql::{MysqlBackend, MysqlConfig};
//!
//! # async fn demo() -> Result<(), fencelock_backend::Error> {
//! let backend =
//!     MysqlBackend::connect("mysql://app:secret@127.0.0.1:3306/app", MysqlConfig::default())
//!         .await?;
//! // fencelock::Client::from_backend(Arc::new(backend)) takes locks through it.
//! # let _ = Arc::new(backend);
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

mod get_lock;
mod table;

use std::time::Duration;

use fencelock_backend::{AcquireSpec, Error, ErrorKind, MAX_TTL};

pub use get_lock::MysqlGetLockBackend;
pub use table::MysqlBackend;

/// Settings shared by both backends.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MysqlConfig {
    /// Table mode: the lock table, in the connection's database (created if missing).
    /// Default `distributed_lock`. ASCII letters, digits and `_`, at most 64 bytes.
    pub table: String,
    /// How long opening a connection may take before the call fails as
    /// [`ErrorKind::Unavailable`]. Default 5 s.
    pub connect_timeout: Duration,
    /// How long one call may take (beyond any time it was asked to wait) before it
    /// fails as [`ErrorKind::Unavailable`]. Default 10 s.
    pub request_timeout: Duration,
    /// Built from a URL: most connections open at once (table mode: the pool's size;
    /// `GET_LOCK` mode: held locks plus acquires in progress, more fail as
    /// [`ErrorKind::ResourceExhausted`]). Default 64; keep it below the server's
    /// `max_connections`.
    pub max_connections: usize,
    /// Table mode: the longest pause between two attempts of a waiting acquire (it
    /// starts at 10 ms and doubles up to this, and never sleeps past the holder's
    /// lease). Default 250 ms.
    pub max_poll_interval: Duration,
}

impl Default for MysqlConfig {
    fn default() -> MysqlConfig {
        MysqlConfig {
            table: "distributed_lock".to_owned(),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
            max_connections: 64,
            max_poll_interval: Duration::from_millis(250),
        }
    }
}

impl MysqlConfig {
    fn check(&self) -> Result<(), Error> {
        if self.connect_timeout.is_zero() || self.request_timeout.is_zero() {
            return Err(invalid(
                "connect_timeout and request_timeout must be positive".to_owned(),
            ));
        }
        if self.max_connections == 0 {
            return Err(invalid("max_connections must be at least 1".to_owned()));
        }
        if self.max_poll_interval < Duration::from_millis(1) {
            return Err(invalid("max_poll_interval must be at least 1ms".to_owned()));
        }
        Ok(())
    }

    /// The parsed URL with our settings: TCP only (never the server's Unix socket,
    /// whatever the URL's host), keepalives, and a pool of `max_connections`.
    fn opts(&self, url: &str) -> Result<mysql_async::Opts, Error> {
        self.check()?;
        let parsed = mysql_async::Opts::from_url(url)
            .map_err(|e| invalid(format!("invalid MySQL URL: {e}")))?;
        let constraints = mysql_async::PoolConstraints::new(0, self.max_connections)
            .ok_or_else(|| invalid("max_connections must be at least 1".to_owned()))?;
        let builder = mysql_async::OptsBuilder::from_opts(parsed)
            .prefer_socket(false)
            .tcp_keepalive(Some(10_000u32))
            .pool_opts(mysql_async::PoolOpts::default().with_constraints(constraints));
        Ok(builder.into())
    }
}

fn invalid(message: String) -> Error {
    Error::new(ErrorKind::InvalidArgument, message)
}

/// Checks that `value` is a plain SQL identifier and returns it backquoted.
fn quote_identifier(what: &str, value: &str) -> Result<String, Error> {
    let plain = !value.is_empty()
        && value.len() <= 64
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_')
        && !value.as_bytes()[0].is_ascii_digit();
    if plain {
        Ok(format!("`{value}`"))
    } else {
        Err(invalid(format!(
            "{what} {value:?} must be 1..=64 ASCII letters, digits or '_', not starting with a \
             digit"
        )))
    }
}

/// A lease length in whole microseconds, checked against the shared range.
fn ttl_us(ttl: Duration) -> Result<u64, Error> {
    if ttl < Duration::from_millis(1) || ttl > MAX_TTL {
        return Err(invalid(format!(
            "ttl must be between 1ms and {}s, got {ttl:?}",
            MAX_TTL.as_secs()
        )));
    }
    Ok(u64::try_from(ttl.as_micros()).unwrap_or(u64::MAX))
}

/// Refuses what neither mode can do (semaphores, lock-delay).
fn refuse_unsupported(spec: &AcquireSpec, backend: &str) -> Result<(), Error> {
    if spec.mode != fencelock_backend::LockMode::Exclusive {
        // GET_LOCK has no shared mode, and the table's one holder row has room for one
        // owner: a reader must not be granted as a writer instead.
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!("the {backend} backend has no shared (reader) locks (see its Capabilities)"),
        ));
    }
    if spec.limit > 1 {
        return Err(invalid(format!(
            "the {backend} backend has no semaphores: limit must be 1, got {}",
            spec.limit
        )));
    }
    if !spec.lock_delay.is_zero() {
        return Err(invalid(format!(
            "the {backend} backend has no lock-delay: lock_delay must be zero"
        )));
    }
    Ok(())
}

/// Server error codes that mean "try again": deadlock victim, lock wait timeout,
/// shutdown in progress, connection or query killed, read-only server.
const TRANSIENT_CODES: [u16; 6] = [1213, 1205, 1053, 1927, 1317, 1290];
/// Too many connections (server-wide, per user).
const EXHAUSTED_CODES: [u16; 3] = [1040, 1203, 1226];
/// Access denied (database, login, table, column, privilege).
const DENIED_CODES: [u16; 5] = [1044, 1045, 1142, 1143, 1227];

/// Maps a driver error to the client library's kinds: connection trouble and
/// conflicts are transient, too many connections `ResourceExhausted`, access denied
/// `PermissionDenied`, the rest `Internal`.
fn my_error(e: &mysql_async::Error, what: &str) -> Error {
    let message = format!("{what}: {e}");
    let kind = match e {
        mysql_async::Error::Io(_) | mysql_async::Error::Other(_) => ErrorKind::Unavailable,
        mysql_async::Error::Driver(
            mysql_async::DriverError::ConnectionClosed | mysql_async::DriverError::PoolDisconnected,
        ) => ErrorKind::Unavailable,
        mysql_async::Error::Driver(_) => ErrorKind::Internal,
        mysql_async::Error::Url(_) => ErrorKind::InvalidArgument,
        mysql_async::Error::Server(server) if TRANSIENT_CODES.contains(&server.code) => {
            ErrorKind::Unavailable
        }
        mysql_async::Error::Server(server) if EXHAUSTED_CODES.contains(&server.code) => {
            ErrorKind::ResourceExhausted
        }
        mysql_async::Error::Server(server) if DENIED_CODES.contains(&server.code) => {
            ErrorKind::PermissionDenied
        }
        mysql_async::Error::Server(_) => ErrorKind::Internal,
    };
    Error::new(kind, message)
}

/// The server error code, if `e` is a server error.
fn server_code(e: &mysql_async::Error) -> Option<u16> {
    match e {
        mysql_async::Error::Server(server) => Some(server.code),
        _ => None,
    }
}

/// A call that ran out of `request_timeout`.
fn timed_out(what: &str, after: Duration) -> Error {
    Error::new(
        ErrorKind::Unavailable,
        format!("{what}: no answer from MySQL within {after:?}"),
    )
}

/// Runs `future` within `budget`, mapping driver errors and the timeout.
async fn within<T>(
    what: &str,
    budget: Duration,
    future: impl std::future::Future<Output = Result<T, mysql_async::Error>>,
) -> Result<T, Error> {
    match tokio::time::timeout(budget, future).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(my_error(&e, what)),
        Err(_) => Err(timed_out(what, budget)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_checked_and_quoted() {
        assert_eq!(quote_identifier("table", "locks_2").unwrap(), "`locks_2`");
        for bad in ["", "2x", "a-b", "a`b", "a b", &"x".repeat(65)] {
            let e = quote_identifier("table", bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{bad:?}");
        }
    }

    #[test]
    fn ttl_range_is_checked() {
        assert_eq!(ttl_us(Duration::from_millis(1500)).unwrap(), 1_500_000);
        assert!(ttl_us(Duration::from_micros(10)).is_err());
        assert!(ttl_us(MAX_TTL * 2).is_err());
    }

    #[test]
    fn bad_urls_and_settings_are_invalid_arguments() {
        let config = MysqlConfig::default();
        for url in ["postgres://x/y", "mysql://host:notaport/db", ""] {
            let e = config.opts(url).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{url:?}: {e}");
        }
        let zero = MysqlConfig {
            max_connections: 0,
            ..MysqlConfig::default()
        };
        let e = zero.opts("mysql://u@127.0.0.1/db").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    }

    #[test]
    fn errors_map_to_kinds() {
        let server = |code| {
            mysql_async::Error::Server(mysql_async::ServerError {
                code,
                message: String::new(),
                state: String::new(),
            })
        };
        assert_eq!(my_error(&server(1213), "x").kind(), ErrorKind::Unavailable);
        assert_eq!(
            my_error(&server(1040), "x").kind(),
            ErrorKind::ResourceExhausted
        );
        assert_eq!(
            my_error(&server(1045), "x").kind(),
            ErrorKind::PermissionDenied
        );
        assert_eq!(my_error(&server(1064), "x").kind(), ErrorKind::Internal);
    }
}
