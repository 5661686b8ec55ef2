//! Advisory mode: [`PostgresAdvisoryBackend`].

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio_postgres::{Client, SimpleQueryMessage};

#[cfg(feature = "deadpool")]
use super::table::pooled;
use super::{
    new_owner_token, open, pg_error, refuse_unsupported, server_ended_session, timed_out, ttl_ms,
    Ended, PostgresConfig,
};
use fencelock_backend::{
    AcquireSpec, BoxFuture, Capabilities, FenceGuarantee, Lease, LockBackend, LockMode,
};
use fencelock_backend::{Error, ErrorKind};

/// How often a backend waiting for a lock checks that its client is still there
/// (`client_connection_check_interval`), so an abandoned wait leaves the queue.
const CLIENT_CHECK_MS: u32 = 1000;

/// The advisory-lock key of a lock name: a stable 64-bit hash (FNV-1a, then the
/// SplitMix64 finalizer), the same in every version of this crate and on every
/// platform.
///
/// Two names with the same key are **one lock** to PostgreSQL: holding one blocks the
/// other (never the reverse: exclusion is kept, only availability suffers). With
/// random names a collision is expected only around 2³² distinct names; names chosen
/// by an adversary can collide on purpose. Other applications using advisory locks in
/// the same database share the key space too. An operator finds a holder with
/// `SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 AND
/// classid = (key >> 32) & 4294967295 AND objid = key & 4294967295` (as `oid`s); the holding session's
/// `application_name` starts with `fencelock:` and the lock name.
pub fn advisory_key(name: &str) -> i64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in name.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash ^= hash >> 30;
    hash = hash.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    hash ^= hash >> 27;
    hash = hash.wrapping_mul(0x94d0_49bb_1331_11eb);
    hash ^= hash >> 31;
    hash as i64
}

/// PostgreSQL session-level advisory locks (`pg_advisory_lock`), one dedicated
/// connection per held lock. **No fencing tokens**: every fence is 0.
///
/// # What it promises, and what it cannot
///
/// - **No fence** ([`FenceGuarantee::None`]). A holder that pauses past its lease and
///   wakes up cannot be told apart from the new holder by the resource. Use it only
///   for resources that tolerate an overlap, or use [`PostgresBackend`](super::PostgresBackend).
/// - **The lock is the session.** Each held lock owns one connection; the lock lives
///   exactly as long as that server session. It cannot be used through a
///   transaction-pooling proxy (PgBouncer `pool_mode = transaction` or `statement`):
///   the proxy would hand the session, and the lock, to another client. Each held
///   lock and each acquire in progress costs one server connection
///   ([`PostgresConfig::max_connections`] bounds them).
/// - **The lease is the session's idle timeout.** The session is opened with
///   `idle_session_timeout` = ttl (PostgreSQL 14 or later), so a holder that stops
///   talking (paused, partitioned, crashed) loses its session — and the lock — a ttl
///   after its last statement finished, by the server's clock. A renewal is a
///   statement on that session (which restarts the idle timer) that also checks, in
///   `pg_locks`, that the session still holds the lock. A dropped TCP connection
///   frees the lock as soon as the server notices it.
/// - **Waiting is PostgreSQL's lock queue**: `pg_advisory_lock` under `lock_timeout`
///   = the caller's wait, a push wake-up. PostgreSQL's lock manager grants a freed lock
///   to the waiters queued first, and a new request that conflicts with a queued one
///   waits behind it; the documentation does not promise an order, so `fifo` is
///   false. `wait = 0` is `pg_try_advisory_lock`.
/// - **Idempotent retries are in-process only.** The backend remembers which request
///   ids hold which connection; a retry through another backend value or process
///   cannot find the grant (it waits, or is refused with `Held`).
/// - Keys are a 64-bit hash of the name ([`advisory_key`]): names whose keys collide
///   are one lock.
/// - Not re-entrant: a second acquire of a held name (new request id) opens its own
///   session and is refused or waits like anybody else's.
/// - No semaphores, no lock-delay, no sessions (refused with
///   [`ErrorKind::InvalidArgument`]).
/// - **Reader-writer locks**: a shared request is `pg_advisory_lock_shared` (any
///   number of readers, never with a writer), and [`LockBackend::downgrade`] takes the
///   shared lock on the holder's session before it lets go of the exclusive one, so
///   the key is never free in between. Still no fences. No elections: a leader's
///   value needs a table ([`PostgresBackend`](super::PostgresBackend) has them).
///
/// Dropping the backend closes every connection, which releases its locks.
#[derive(Debug, Clone)]
pub struct PostgresAdvisoryBackend {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    source: Source,
    config: PostgresConfig,
    slots: Arc<Semaphore>,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Held locks by owner token.
    held: HashMap<String, Arc<Held>>,
    /// Owner token of each held lock's request id.
    by_request: HashMap<String, String>,
    /// Request ids with an acquire in progress.
    in_flight: HashSet<String>,
}

/// Where sessions come from.
#[derive(Debug)]
enum Source {
    /// A new connection per lock.
    Own(Box<tokio_postgres::Config>),
    /// A connection taken out of the application's pool per lock (never returned).
    #[cfg(feature = "deadpool")]
    Pool(deadpool_postgres::Pool),
}

/// A held lock's session: its own connection, or one taken out of a pool.
#[derive(Debug)]
enum Session {
    Own(Client),
    #[cfg(feature = "deadpool")]
    Pooled(deadpool_postgres::ClientWrapper),
}

impl std::ops::Deref for Session {
    type Target = Client;

    fn deref(&self) -> &Client {
        match self {
            Session::Own(client) => client,
            #[cfg(feature = "deadpool")]
            Session::Pooled(client) => client,
        }
    }
}

/// One held lock: its session.
#[derive(Debug)]
struct Held {
    lease: Lease,
    key: i64,
    /// Held with `pg_advisory_lock_shared` (a reader), or downgraded to it.
    shared: std::sync::atomic::AtomicBool,
    request_id: String,
    client: Session,
    ended: watch::Receiver<Option<Ended>>,
    _slot: OwnedSemaphorePermit,
}

impl PostgresAdvisoryBackend {
    /// Checks the configuration and that the server can be reached and is
    /// PostgreSQL 14 or later (for `idle_session_timeout`). Each lock then opens its
    /// own connection.
    pub async fn connect(config: PostgresConfig) -> Result<PostgresAdvisoryBackend, Error> {
        let pg = config.pg_config()?;
        if config.max_connections == 0 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "max_connections must be at least 1",
            ));
        }
        let (client, _ended) = open(&pg, config.connect_timeout).await?;
        check_version(&client, &config).await?;
        Ok(PostgresAdvisoryBackend::new(
            Source::Own(Box::new(pg)),
            config,
        ))
    }

    /// Uses the application's `deadpool-postgres` pool (feature `deadpool`). An
    /// advisory lock belongs to a session, so each held lock (and each acquire in
    /// progress) takes one connection **out of the pool for good**: it is held for the
    /// lock's life and closed on release, never returned, so neither the lock nor the
    /// session's timeouts reach another user of the pool — and the pool opens a fresh
    /// connection in its place. The pool's `max_size` bounds held locks together with
    /// the application's own use (`config.max_connections` also applies);
    /// `config.conninfo` is not used. The pool's server must be PostgreSQL 14 or
    /// later. (There is no constructor on a single application client: one session
    /// cannot hold per-lock leases, and PostgreSQL would grant the same session a
    /// second hold of its own lock.)
    #[cfg(feature = "deadpool")]
    pub async fn with_pool(
        pool: deadpool_postgres::Pool,
        config: PostgresConfig,
    ) -> Result<PostgresAdvisoryBackend, Error> {
        if config.max_connections == 0 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "max_connections must be at least 1",
            ));
        }
        let client = pooled(&pool, config.connect_timeout).await?;
        check_version(&client, &config).await?;
        drop(client);
        Ok(PostgresAdvisoryBackend::new(Source::Pool(pool), config))
    }

    fn new(source: Source, config: PostgresConfig) -> PostgresAdvisoryBackend {
        PostgresAdvisoryBackend {
            inner: Arc::new(Inner {
                source,
                slots: Arc::new(Semaphore::new(config.max_connections)),
                config,
                state: Mutex::new(State::default()),
            }),
        }
    }

    /// Locks held through this backend.
    pub fn held(&self) -> usize {
        self.inner.state().held.len()
    }
}

/// Advisory mode needs `idle_session_timeout` (PostgreSQL 14).
async fn check_version(client: &Client, config: &PostgresConfig) -> Result<(), Error> {
    let version = tokio::time::timeout(
        config.request_timeout,
        client.query_one("SELECT current_setting('server_version_num')::int", &[]),
    )
    .await
    .map_err(|_| timed_out("read the server version", config.request_timeout))?
    .map_err(|e| pg_error(&e, "read the server version"))?
    .get::<_, i32>(0);
    if version < 140_000 {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "advisory mode needs PostgreSQL 14 or later (idle_session_timeout is its \
                 lease); the server is version {version}"
            ),
        ));
    }
    Ok(())
}

impl Inner {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn forget(&self, held: &Held) {
        let mut state = self.state();
        state.held.remove(&held.lease.owner_token);
        if state.by_request.get(&held.request_id) == Some(&held.lease.owner_token) {
            state.by_request.remove(&held.request_id);
        }
    }

    /// The grant already made for this request (same request id and name) if its
    /// session is alive; otherwise marks the request id in progress (one check, under
    /// one lock, so two concurrent attempts with one id cannot both grant).
    fn existing_or_begin(&self, spec: &AcquireSpec) -> Result<Option<Lease>, Error> {
        let mut state = self.state();
        let found = state
            .by_request
            .get(&spec.request_id)
            .and_then(|token| state.held.get(token))
            .filter(|held| held.lease.name == spec.name)
            .cloned();
        if let Some(held) = found {
            if !held.client.is_closed() {
                return Ok(Some(held.lease.clone()));
            }
            state.held.remove(&held.lease.owner_token);
            state.by_request.remove(&held.request_id);
        }
        if !state.in_flight.insert(spec.request_id.clone()) {
            return Err(Error::new(
                ErrorKind::Unavailable,
                "an acquire with this request id is still in progress",
            ));
        }
        Ok(None)
    }

    async fn grant(&self, spec: &AcquireSpec) -> Result<Lease, Error> {
        let ttl_ms = ttl_ms(spec.ttl)?;
        let slot = self.slots.clone().try_acquire_owned().map_err(|_| {
            Error::new(
                ErrorKind::ResourceExhausted,
                format!(
                    "{} advisory-lock connections are open (max_connections)",
                    self.config.max_connections
                ),
            )
        })?;
        let (client, ended) = match &self.source {
            Source::Own(pg) => {
                let mut pg = (**pg).clone();
                pg.application_name(application_name(&spec.name));
                let (client, ended) = open(&pg, self.config.connect_timeout).await?;
                (Session::Own(client), ended)
            }
            #[cfg(feature = "deadpool")]
            Source::Pool(pool) => {
                let client = pooled(pool, self.config.connect_timeout).await?;
                // Out of the pool for good: dropping it closes the session.
                let client = deadpool_postgres::Object::take(client);
                // The pool drives the connection: its end is seen as a closed client.
                let (_, ended) = watch::channel(None);
                (Session::Pooled(client), ended)
            }
        };
        let key = advisory_key(&spec.name);
        let shared = spec.mode == LockMode::Shared;
        let mode = if shared { "_shared" } else { "" };
        // One simple query: the lease (idle timeout) is in force before the lock is
        // taken, so no instant exists at which the session holds the lock without it.
        let settings = format!(
            "SET idle_session_timeout = {ttl_ms}; SET statement_timeout = 0; \
             SET client_connection_check_interval = {CLIENT_CHECK_MS};"
        );
        let (sql, budget) = if spec.wait.is_zero() {
            (
                format!("{settings} SELECT pg_try_advisory_lock{mode}({key})::text;"),
                self.config.request_timeout,
            )
        } else {
            let wait_ms = spec.wait.as_millis().clamp(1, i32::MAX as u128);
            (
                format!(
                    "{settings} SET lock_timeout = {wait_ms}; \
                     SELECT 'true' FROM pg_advisory_lock{mode}({key}); SET lock_timeout = 0;"
                ),
                spec.wait.saturating_add(self.config.request_timeout),
            )
        };
        let answer = match tokio::time::timeout(budget, client.simple_query(&sql)).await {
            Err(_) => return Err(timed_out("acquire", budget)),
            Ok(Err(e))
                if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) =>
            {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!("{:?} was not granted within {:?}", spec.name, spec.wait),
                ))
            }
            Ok(Err(e)) => return Err(pg_error(&e, "acquire")),
            Ok(Ok(messages)) => messages,
        };
        let granted = answer.iter().any(|m| match m {
            SimpleQueryMessage::Row(row) => row.get(0) == Some("true"),
            _ => false,
        });
        if !granted {
            return Err(Error::new(
                ErrorKind::Held,
                format!("{:?} is held", spec.name),
            ));
        }
        let lease = Lease::new(spec.name.clone(), 0, new_owner_token(), spec.ttl);
        let held = Arc::new(Held {
            lease: lease.clone(),
            key,
            shared: std::sync::atomic::AtomicBool::new(shared),
            request_id: spec.request_id.clone(),
            client,
            ended,
            _slot: slot,
        });
        let mut state = self.state();
        state
            .by_request
            .insert(spec.request_id.clone(), lease.owner_token.clone());
        state.held.insert(lease.owner_token.clone(), held);
        Ok(lease)
    }

    fn held(&self, lease: &Lease) -> Option<Arc<Held>> {
        self.state()
            .held
            .get(&lease.owner_token)
            .filter(|h| h.lease.name == lease.name)
            .cloned()
    }
}

/// Removes a request id from the in-progress set when dropped.
struct InFlight<'a> {
    inner: &'a Inner,
    request_id: &'a str,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.inner.state().in_flight.remove(self.request_id);
    }
}

/// `fencelock:NAME`, cut to PostgreSQL's 63 bytes (on a character boundary); the
/// server shows non-ASCII characters as `?`.
fn application_name(name: &str) -> String {
    let mut text = format!("fencelock:{name}");
    let mut end = text.len().min(63);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    text
}

/// Why a session is gone: `NotHeld` when the server ended it (its locks are gone),
/// `LockLost` when only our connection broke (the server frees the lock when it
/// notices, at the latest when the lease runs out).
async fn session_gone(held: &Held, what: &str) -> Error {
    let mut ended = held.ended.clone();
    // The connection task records the reason as it ends; give it a moment.
    let _ = tokio::time::timeout(Duration::from_millis(200), ended.wait_for(Option::is_some)).await;
    let reason = ended.borrow().clone();
    match reason {
        Some(Ended::ByServer(reason)) => Error::new(
            ErrorKind::NotHeld,
            format!(
                "{what} {:?}: the server ended the session holding it ({reason})",
                held.lease.name
            ),
        ),
        Some(Ended::Lost(reason)) => Error::new(
            ErrorKind::LockLost,
            format!(
                "{what} {:?}: the connection holding the lock broke ({reason}); the server \
                 frees it when it notices, at the latest when the lease runs out",
                held.lease.name
            ),
        ),
        Some(Ended::Closed) | None => Error::new(
            ErrorKind::LockLost,
            format!(
                "{what} {:?}: the connection holding the lock is closed",
                held.lease.name
            ),
        ),
    }
}

/// What a failed statement on a held lock's session means: the session is gone
/// (`NotHeld`/`LockLost`, and the grant is forgotten) or a transient error.
async fn failed_on_session(
    inner: &Inner,
    held: &Held,
    e: &tokio_postgres::Error,
    what: &str,
) -> Error {
    if e.code().is_some_and(server_ended_session) {
        inner.forget(held);
        return Error::new(
            ErrorKind::NotHeld,
            format!(
                "{what} {:?}: the server ended the session holding it ({e})",
                held.lease.name
            ),
        );
    }
    if e.code().is_none() || held.client.is_closed() {
        inner.forget(held);
        return session_gone(held, what).await;
    }
    pg_error(e, what)
}

impl LockBackend for PostgresAdvisoryBackend {
    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::new("postgres-advisory", FenceGuarantee::None);
        caps.push_wakeups = true;
        caps.shared = true;
        caps.downgrade = true;
        caps
    }

    /// Takes the shared lock on the same session, then lets go of the exclusive one:
    /// the session holds the key throughout (its own locks never conflict), and
    /// readers queued behind it are granted.
    fn downgrade<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            let inner = &*self.inner;
            let Some(held) = inner.held(lease) else {
                return Err(Error::new(
                    ErrorKind::NotHeld,
                    format!("{:?} is not held with this owner token", lease.name),
                ));
            };
            if held.shared.load(std::sync::atomic::Ordering::SeqCst) {
                return Ok(());
            }
            if held.client.is_closed() {
                inner.forget(&held);
                return Err(session_gone(&held, "downgrade").await);
            }
            let sql = format!(
                "SELECT pg_advisory_lock_shared({key}); SELECT pg_advisory_unlock({key})::text",
                key = held.key
            );
            let timeout = inner.config.request_timeout;
            match tokio::time::timeout(timeout, held.client.simple_query(&sql)).await {
                Err(_) => Err(timed_out("downgrade", timeout)),
                Ok(Err(e)) => Err(failed_on_session(inner, &held, &e, "downgrade").await),
                Ok(Ok(messages)) => {
                    held.shared.store(true, std::sync::atomic::Ordering::SeqCst);
                    let unlocked = messages.iter().any(
                        |m| matches!(m, SimpleQueryMessage::Row(row) if row.get(0) == Some("true")),
                    );
                    if unlocked {
                        Ok(())
                    } else {
                        Err(Error::new(
                            ErrorKind::NotHeld,
                            format!("the session did not hold {:?} exclusively", lease.name),
                        ))
                    }
                }
            }
        })
    }

    fn acquire<'a>(&'a self, spec: &'a AcquireSpec) -> BoxFuture<'a, Result<Lease, Error>> {
        Box::pin(async move {
            spec.validate()?;
            refuse_unsupported(spec, "postgres-advisory")?;
            let inner = &*self.inner;
            if let Some(lease) = inner.existing_or_begin(spec)? {
                return Ok(lease);
            }
            // Cleared however the attempt ends, cancellation included.
            let _in_flight = InFlight {
                inner,
                request_id: &spec.request_id,
            };
            inner.grant(spec).await
        })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Duration, Error>> {
        Box::pin(async move {
            let ttl_ms = ttl_ms(ttl)?;
            let inner = &*self.inner;
            let Some(held) = inner.held(lease) else {
                return Err(Error::new(
                    ErrorKind::NotHeld,
                    format!("{:?} is not held with this owner token", lease.name),
                ));
            };
            if held.client.is_closed() {
                inner.forget(&held);
                return Err(session_gone(&held, "renew").await);
            }
            let key = held.key as u64;
            // The statement itself restarts the session's idle timer (the lease).
            let sql = format!(
                "SET idle_session_timeout = {ttl_ms}; \
                 SELECT count(*)::text FROM pg_locks WHERE locktype = 'advisory' \
                   AND pid = pg_backend_pid() AND granted AND objsubid = 1 \
                   AND classid = {} AND objid = {}",
                key >> 32,
                key & 0xffff_ffff
            );
            let timeout = inner.config.request_timeout;
            match tokio::time::timeout(timeout, held.client.simple_query(&sql)).await {
                Err(_) => Err(timed_out("renew", timeout)),
                Ok(Err(e)) => Err(failed_on_session(inner, &held, &e, "renew").await),
                Ok(Ok(messages)) => {
                    let holds = messages.iter().any(
                        |m| matches!(m, SimpleQueryMessage::Row(row) if row.get(0) == Some("1")),
                    );
                    if holds {
                        Ok(ttl)
                    } else {
                        inner.forget(&held);
                        Err(Error::new(
                            ErrorKind::NotHeld,
                            format!("the session no longer holds {:?}", lease.name),
                        ))
                    }
                }
            }
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            let inner = &*self.inner;
            let Some(held) = inner.held(lease) else {
                return Ok(false);
            };
            // Whatever happens next, this grant's session is done: dropping the last
            // reference closes it, which frees the lock if the unlock did not.
            inner.forget(&held);
            if held.client.is_closed() {
                return gone_is_false(session_gone(&held, "release").await);
            }
            let mode = if held.shared.load(std::sync::atomic::Ordering::SeqCst) {
                "_shared"
            } else {
                ""
            };
            let sql = format!("SELECT pg_advisory_unlock{mode}({})::text", held.key);
            let timeout = inner.config.request_timeout;
            match tokio::time::timeout(timeout, held.client.simple_query(&sql)).await {
                Err(_) => Err(Error::new(
                    ErrorKind::LockLost,
                    format!(
                        "release {:?}: no answer within {timeout:?}; the connection is closed and \
                         the server frees the lock when it notices, at the latest when the \
                         lease runs out",
                        lease.name
                    ),
                )),
                Ok(Err(e)) => gone_is_false(failed_on_session(inner, &held, &e, "release").await),
                Ok(Ok(messages)) => Ok(messages.iter().any(
                    |m| matches!(m, SimpleQueryMessage::Row(row) if row.get(0) == Some("true")),
                )),
            }
        })
    }
}

/// For release: a session the server ended took the lock with it (`false`, already
/// gone); anything else stays an error.
fn gone_is_false(e: Error) -> Result<bool, Error> {
    if e.kind() == ErrorKind::NotHeld {
        Ok(false)
    } else {
        Err(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advisory_keys_are_stable() {
        // Pinned: changing the hash would split every deployed lock in two.
        assert_ne!(advisory_key("a"), advisory_key("b"));
        assert_eq!(advisory_key("job:daily-settlement"), PINNED_KEY);
    }

    /// Computed independently (Python: FNV-1a 64 over the UTF-8 bytes, then the
    /// SplitMix64 finalizer).
    const PINNED_KEY: i64 = 8_164_265_855_136_074_449;

    #[test]
    fn application_names_fit() {
        assert_eq!(application_name("x"), "fencelock:x");
        let long = application_name(&"é".repeat(100));
        assert!(long.len() <= 63);
    }
}
