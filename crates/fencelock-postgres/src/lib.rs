//! PostgreSQL as a lock store, two ways (feature `postgres`).
//!
//! - [`PostgresBackend`] (**table mode**): one row per lock in a table (by default
//!   `public.distributed_lock`, created if missing), the reference design's
//!   `lock_name` primary key, `owner_token`, `fencing_seq`, `lease_until`. Every call
//!   is one SQL statement; the fence is drawn under the row lock of the grant it
//!   belongs to and commits with it, so fences are durable and per-lock increasing.
//!   Waiters are woken by `LISTEN`/`NOTIFY` on release and by a timer at the holder's
//!   `lease_until` (an expiry sends no notification).
//! - [`PostgresAdvisoryBackend`] (**advisory mode**): `pg_advisory_lock` on a
//!   dedicated connection per held lock, with `idle_session_timeout` as the lease.
//!   **No fencing tokens** (every fence is 0): protect only resources that tolerate an
//!   overlap, or use table mode.
//!
//! Both decide expiry on the database server, never on the client's clock, but on the
//! server's *wall* clock (`now()`, or the session's idle timer): a jump of the
//! server's clock can end leases early or late. So neither claims
//! [`Capabilities::monotonic_leases`](fencelock_backend::Capabilities::monotonic_leases).
//!
//! # Whose connections
//!
//! Each backend is built from a connection string (it opens its own connections), or
//! from what the application already holds:
//!
//! | | own connections ([`connect`](PostgresBackend::connect)) | the application's `tokio_postgres::Client` | the application's `deadpool_postgres::Pool` (feature `deadpool`) |
//! |---|---|---|---|
//! | table mode | a command connection and a `LISTEN` connection | [`PostgresBackend::with_client`]: statements on that client, **no other connection**; waiters poll | `PostgresBackend::with_pool`: a pooled client per statement, **no other connection**; waiters poll |
//! | advisory mode | one dedicated connection per held lock | — (refused by design: see below) | `PostgresAdvisoryBackend::with_pool`: each held lock takes a connection **out of the pool** and closes it on release |
//!
//! Table mode needs no dedicated connection: every call is one statement. Only its
//! push wake-ups need one (`LISTEN` belongs to a session), so over the application's
//! client or pool waiters poll instead. Advisory locks belong to a session, so advisory
//! mode needs one dedicated session per held lock; it cannot share one client (one
//! session cannot carry a separate lease per lock, and PostgreSQL grants a session a
//! lock it already holds).
//!
//! Connections opened from a connection string use `tokio-postgres` without TLS
//! (`sslmode=disable`): reach the database over a trusted network or a local tunnel.
//! The application's client or pool may use any TLS it was built with.
//!
//! ```no_run
//! use std::time::Duration;
//! use fencelock_backend::{AcquireSpec, LockBackend};
//! use fencelock_postgres::{PostgresBackend, PostgresConfig};
//!
//! # async fn demo() -> Result<(), fencelock_backend::Error> {
//! let config = PostgresConfig::new("host=127.0.0.1 user=app dbname=app");
//! let backend = PostgresBackend::connect(config).await?;
//! // Applications take locks through the client library (guards, renewal, the
//! // lost-lock signal): `fencelock::Client::from_backend(Arc::new(backend))`, with
//! // `fencelock`'s feature `postgres` (`fencelock::postgres` is this crate).
//! let lease = backend
//!     .acquire(&AcquireSpec::new("job:daily-settlement", Duration::from_secs(30)))
//!     .await?;
//! println!("fence {}", lease.fence);
//! backend.release(&lease).await?;
//! # Ok(()) }
//! ```

mod advisory;
mod table;

use std::time::Duration;

use tokio_postgres::error::SqlState;
use tokio_postgres::Socket;

use fencelock_backend::MAX_TTL;
use fencelock_backend::{Error, ErrorKind};

pub use advisory::{advisory_key, PostgresAdvisoryBackend};
pub use table::PostgresBackend;

/// How to reach PostgreSQL and which table and channel to use.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PostgresConfig {
    /// A libpq-style connection string (`host=… port=… user=… dbname=…` or
    /// `postgresql://user@host:port/db`). TLS is not supported.
    pub conninfo: String,
    /// Table mode: the schema of the lock table (created if missing). Default
    /// `public`. An identifier: ASCII letters, digits and `_`, at most 63 bytes.
    pub schema: String,
    /// Table mode: the lock table (created if missing). Default `distributed_lock`.
    pub table: String,
    /// Table mode: the `NOTIFY` channel releases are announced on (payload: the lock
    /// name). Give every lock table its own. Default `fencelock_release`.
    pub channel: String,
    /// How long opening a connection may take before the call fails as
    /// [`ErrorKind::Unavailable`]. Default 5 s.
    pub connect_timeout: Duration,
    /// How long one statement may take (beyond any time it was asked to wait) before
    /// the call fails as [`ErrorKind::Unavailable`]. Default 10 s.
    pub request_timeout: Duration,
    /// Advisory mode: most connections open at once (each held lock and each acquire
    /// in progress has one); more fail as [`ErrorKind::ResourceExhausted`]. Default
    /// 64. Keep it below the server's `max_connections`.
    pub max_connections: usize,
}

impl Default for PostgresConfig {
    /// The defaults with an empty `conninfo`, for the constructors that take the
    /// application's client or pool (and do not use it).
    fn default() -> PostgresConfig {
        PostgresConfig::new("")
    }
}

impl PostgresConfig {
    /// The defaults for `conninfo`.
    pub fn new(conninfo: impl Into<String>) -> PostgresConfig {
        PostgresConfig {
            conninfo: conninfo.into(),
            schema: "public".to_owned(),
            table: "distributed_lock".to_owned(),
            channel: "fencelock_release".to_owned(),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
            max_connections: 64,
        }
    }

    /// The parsed connection settings, with our timeouts, keepalives and
    /// application name.
    fn pg_config(&self) -> Result<tokio_postgres::Config, Error> {
        let mut pg: tokio_postgres::Config = self.conninfo.parse().map_err(|e| {
            Error::new(
                ErrorKind::InvalidArgument,
                format!("invalid PostgreSQL connection string: {e}"),
            )
        })?;
        if self.connect_timeout.is_zero() || self.request_timeout.is_zero() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "connect_timeout and request_timeout must be positive",
            ));
        }
        pg.connect_timeout(self.connect_timeout)
            // A dead peer is noticed within ~25 s even on an idle connection.
            .keepalives(true)
            .keepalives_idle(Duration::from_secs(10))
            .keepalives_interval(Duration::from_secs(5))
            .keepalives_retries(3);
        if pg.get_application_name().is_none() {
            pg.application_name("fencelock");
        }
        Ok(pg)
    }
}

/// Checks that `value` is a plain SQL identifier and returns it double-quoted.
fn quote_identifier(what: &str, value: &str) -> Result<String, Error> {
    let plain = !value.is_empty()
        && value.len() <= 63
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_')
        && !value.as_bytes()[0].is_ascii_digit();
    if plain {
        Ok(format!("\"{value}\""))
    } else {
        Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "{what} {value:?} must be 1..=63 ASCII letters, digits or '_', not starting \
                 with a digit"
            ),
        ))
    }
}

/// A lease or renewal length in whole milliseconds, checked against the shared range.
fn ttl_ms(ttl: Duration) -> Result<i64, Error> {
    if ttl < Duration::from_millis(1) || ttl > MAX_TTL {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "ttl must be between 1ms and {}s, got {ttl:?}",
                MAX_TTL.as_secs()
            ),
        ));
    }
    Ok(i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX))
}

/// Refuses what neither PostgreSQL mode can do (semaphores, lock-delay).
fn refuse_unsupported(spec: &fencelock_backend::AcquireSpec, backend: &str) -> Result<(), Error> {
    if spec.limit > 1 {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "the {backend} backend has no semaphores: limit must be 1, got {}",
                spec.limit
            ),
        ));
    }
    if !spec.lock_delay.is_zero() {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("the {backend} backend has no lock-delay: lock_delay must be zero"),
        ));
    }
    Ok(())
}

/// A fresh owner token: 32 hex digits from the OS RNG.
fn new_owner_token() -> String {
    fencelock_backend::request_id()
}

/// Opens a connection and drives it on a task. The returned receiver says how the
/// connection ended (`None` until it has).
async fn open(
    pg: &tokio_postgres::Config,
    connect_timeout: Duration,
) -> Result<
    (
        tokio_postgres::Client,
        tokio::sync::watch::Receiver<Option<Ended>>,
    ),
    Error,
> {
    // tokio-postgres applies connect_timeout per host; bound the whole handshake too.
    let connecting = pg.connect(tokio_postgres::NoTls);
    let (client, connection) = tokio::time::timeout(connect_timeout, connecting)
        .await
        .map_err(|_| {
            Error::new(
                ErrorKind::Unavailable,
                format!("cannot connect to PostgreSQL within {connect_timeout:?}"),
            )
        })?
        .map_err(|e| pg_error(&e, "connect to PostgreSQL"))?;
    let (ended_tx, ended_rx) = tokio::sync::watch::channel(None);
    tokio::spawn(drive(connection, ended_tx));
    Ok((client, ended_rx))
}

async fn drive(
    connection: tokio_postgres::Connection<Socket, tokio_postgres::tls::NoTlsStream>,
    ended: tokio::sync::watch::Sender<Option<Ended>>,
) {
    let outcome = connection.await;
    ended.send_replace(Some(match outcome {
        Ok(()) => Ended::Closed,
        Err(e) => match e.code() {
            Some(code) if server_ended_session(code) => Ended::ByServer(e.to_string()),
            _ => Ended::Lost(e.to_string()),
        },
    }));
}

/// How a connection ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Ended {
    /// We closed it (the client was dropped).
    Closed,
    /// The server ended the session (idle-session timeout, terminated by an
    /// administrator, shutdown): its session-level locks are gone.
    ByServer(String),
    /// The connection broke: the server may still have the session for a while.
    Lost(String),
}

/// Error codes with which the server ends a session (and with it, its locks).
fn server_ended_session(code: &SqlState) -> bool {
    [
        SqlState::IDLE_SESSION_TIMEOUT,
        SqlState::ADMIN_SHUTDOWN,
        SqlState::CRASH_SHUTDOWN,
        SqlState::IDLE_IN_TRANSACTION_SESSION_TIMEOUT,
    ]
    .contains(code)
}

/// Maps a tokio-postgres error to the client library's kinds: connection trouble,
/// shutdowns, conflicts and overload are transient; permissions are
/// `PermissionDenied`; the rest is `Internal`.
fn pg_error(e: &tokio_postgres::Error, what: &str) -> Error {
    let message = format!("{what}: {}", error_chain(e));
    let Some(code) = e.code() else {
        // No SQLSTATE: an I/O error, a closed connection, a timeout, a protocol
        // surprise. All but the last are connection trouble.
        return Error::new(ErrorKind::Unavailable, message);
    };
    let class = &code.code()[..2];
    let kind = match class {
        // connection exception; operator intervention (shutdown, cannot connect now);
        // transaction rollback (serialization failure, deadlock); read-only standby.
        "08" | "57" | "40" => ErrorKind::Unavailable,
        "25" if *code == SqlState::READ_ONLY_SQL_TRANSACTION => ErrorKind::Unavailable,
        // insufficient resources (too many connections, out of memory, disk full).
        "53" => ErrorKind::ResourceExhausted,
        // invalid authorization; insufficient privilege.
        "28" => ErrorKind::PermissionDenied,
        "42" if *code == SqlState::INSUFFICIENT_PRIVILEGE => ErrorKind::PermissionDenied,
        _ => ErrorKind::Internal,
    };
    Error::new(kind, message)
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        let next = inner.to_string();
        if !text.contains(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = inner.source();
    }
    text
}

/// A request that ran out of `request_timeout`.
fn timed_out(what: &str, after: Duration) -> Error {
    Error::new(
        ErrorKind::Unavailable,
        format!("{what}: no answer from PostgreSQL within {after:?}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_checked_and_quoted() {
        assert_eq!(quote_identifier("table", "locks_2").unwrap(), "\"locks_2\"");
        for bad in ["", "2x", "a-b", "a\"b", "a b", &"x".repeat(64)] {
            let e = quote_identifier("table", bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{bad:?}");
        }
    }

    #[test]
    fn ttl_range_is_checked() {
        assert_eq!(ttl_ms(Duration::from_millis(1500)).unwrap(), 1500);
        assert!(ttl_ms(Duration::from_micros(10)).is_err());
        assert!(ttl_ms(MAX_TTL * 2).is_err());
    }

    #[test]
    fn bad_conninfo_is_an_invalid_argument() {
        let e = PostgresConfig::new("host=x port=notaport")
            .pg_config()
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    }
}
