//! `GET_LOCK` mode: [`MysqlGetLockBackend`].

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Opts, Pool};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{my_error, refuse_unsupported, timed_out, ttl_us, within, MysqlConfig};
use fencelock_backend::{
    AcquireSpec, BoxFuture, Capabilities, Error, ErrorKind, FenceGuarantee, Lease, LockBackend,
};

/// Longest wait handed to `GET_LOCK` in one call (a year): longer waits are as good as
/// forever.
const MAX_WAIT_SECS: f64 = 365.0 * 24.0 * 3600.0;

/// Takes the lock for a name: the name itself when it has at most 64 characters
/// (MySQL's limit for lock names), else `SHA2(name, 256)` as 64 hex digits; returns
/// the `GET_LOCK` result and the key used.
const GET_LOCK: &str = "SELECT GET_LOCK(k, ?), k FROM \
     (SELECT IF(CHAR_LENGTH(?) > 64, SHA2(?, 256), ?) AS k) AS key_of_name";

/// MySQL or MariaDB user-level locks (`GET_LOCK`), one dedicated session per held
/// lock. **No fencing tokens**: every fence is 0.
///
/// # What it promises, and what it cannot
///
/// - **No fence** ([`FenceGuarantee::None`]). A holder that pauses past its lease and
///   wakes up cannot be told apart from the new holder by the resource. Use it only
///   for resources that tolerate an overlap, or use [`MysqlBackend`](super::MysqlBackend).
/// - **The lock is the session, and a session is a connection.** `GET_LOCK` locks
///   belong to the server session that took them and end with it. So each held lock,
///   and each acquire in progress, costs one server connection (a thread on the
///   server, memory, a slot of its `max_connections`) for as long as it lasts. Built
///   from a URL, the backend opens a connection per lock (at most
///   [`MysqlConfig::max_connections`]; more fail as [`ErrorKind::ResourceExhausted`])
///   and closes it on release. Built from the application's pool, it takes one of the
///   pool's connections per held lock — the pool has that many fewer for the
///   application — and closes it on release instead of returning it, so the lock and
///   the session settings never reach another user of the pool. (A connection that
///   goes back to the pool anyway, because the backend was dropped while holding, is
///   returned with a session reset, which releases its locks.) It cannot work through
///   a proxy that pools per transaction.
/// - **The lease is the session's idle timeout.** The session's `wait_timeout` is set
///   to the ttl, rounded *up* to whole seconds (the granted lease, reported in
///   [`Lease::ttl`] and by renew), so a holder that stops talking (paused,
///   partitioned, crashed) loses its session — and the lock — that long after its
///   last statement, by the server's clock. A renewal is a statement on that session
///   (which restarts the idle timer) that also checks `IS_USED_LOCK(key) =
///   CONNECTION_ID()`. A broken connection cannot tell whether the server has ended
///   the session yet: renew and release then say [`ErrorKind::LockLost`].
/// - **Waiting is the server's lock queue**: `GET_LOCK(key, wait)` wakes the waiter
///   when the lock frees (a push wake-up); the server promises no order, so `fifo` is
///   false. `wait = 0` answers at once.
/// - **Names.** MySQL limits lock names to 64 characters: a longer name is locked
///   under `SHA2(name, 256)` (64 hex digits), computed by the server; two names
///   collide only if SHA-256 does. Lock names share one namespace per server (all
///   databases): other applications' `GET_LOCK` names can clash with ours. Some
///   servers compare lock names without regard to case (MariaDB does not).
/// - **Idempotent retries are in-process only.** The backend remembers which request
///   ids hold which session; a retry through another backend value or process cannot
///   find the grant (it waits, or is refused with `Held`).
/// - Not re-entrant: a second acquire of a held name (new request id) opens its own
///   session and is refused or waits like anybody else's.
/// - No semaphores, no lock-delay, no sessions (refused with
///   [`ErrorKind::InvalidArgument`]).
///
/// Dropping the backend closes every connection it opened, which releases its locks.
#[derive(Debug, Clone)]
pub struct MysqlGetLockBackend {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    source: Source,
    config: MysqlConfig,
    state: Mutex<State>,
}

/// Where sessions come from.
#[derive(Debug)]
enum Source {
    /// New connections, at most `max_connections` at once.
    Url { opts: Opts, slots: Arc<Semaphore> },
    /// The application's pool.
    Pool(Pool),
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

/// One held lock: its session.
#[derive(Debug)]
struct Held {
    lease: Lease,
    key: String,
    request_id: String,
    /// Taken out (and closed) on release.
    conn: tokio::sync::Mutex<Option<Conn>>,
    _slot: Option<OwnedSemaphorePermit>,
}

impl MysqlGetLockBackend {
    /// Checks the URL and settings and that the server can be reached. Each lock then
    /// opens its own connection.
    pub async fn connect(url: &str, config: MysqlConfig) -> Result<MysqlGetLockBackend, Error> {
        let opts = config.opts(url)?;
        let conn = within(
            "connect to MySQL",
            config.connect_timeout,
            Conn::new(opts.clone()),
        )
        .await?;
        // Closing can only fail on a connection that broke; it is gone either way.
        let _ = tokio::time::timeout(config.request_timeout, conn.disconnect()).await;
        Ok(MysqlGetLockBackend::new(
            Source::Url {
                opts,
                slots: Arc::new(Semaphore::new(config.max_connections)),
            },
            config,
        ))
    }

    /// Uses the application's pool: each held lock takes one of its connections until
    /// released (see the type's docs). Checks that the pool can reach the server.
    /// [`MysqlConfig::max_connections`] does not apply (the pool has its own bound).
    pub async fn with_pool(pool: Pool, config: MysqlConfig) -> Result<MysqlGetLockBackend, Error> {
        config.check()?;
        let conn = within("connect to MySQL", config.connect_timeout, pool.get_conn()).await?;
        drop(conn);
        Ok(MysqlGetLockBackend::new(Source::Pool(pool), config))
    }

    fn new(source: Source, config: MysqlConfig) -> MysqlGetLockBackend {
        MysqlGetLockBackend {
            inner: Arc::new(Inner {
                source,
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

/// A lease in whole seconds, rounded up (the session's `wait_timeout`).
fn lease_secs(ttl: Duration) -> Result<u64, Error> {
    let us = ttl_us(ttl)?;
    Ok(us.div_ceil(1_000_000).max(1))
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

    fn held(&self, lease: &Lease) -> Option<Arc<Held>> {
        self.state()
            .held
            .get(&lease.owner_token)
            .filter(|h| h.lease.name == lease.name)
            .cloned()
    }

    /// The grant already made for this request (same request id and name); otherwise
    /// marks the request id in progress (one check under one lock, so two concurrent
    /// attempts with one id cannot both grant).
    fn existing_or_begin(&self, spec: &AcquireSpec) -> Result<Option<Lease>, Error> {
        let mut state = self.state();
        let found = state
            .by_request
            .get(&spec.request_id)
            .and_then(|token| state.held.get(token))
            .filter(|held| held.lease.name == spec.name)
            .map(|held| held.lease.clone());
        if let Some(lease) = found {
            return Ok(Some(lease));
        }
        if !state.in_flight.insert(spec.request_id.clone()) {
            return Err(Error::new(
                ErrorKind::Unavailable,
                "an acquire with this request id is still in progress",
            ));
        }
        Ok(None)
    }

    /// A fresh session for one lock.
    async fn session(&self) -> Result<(Conn, Option<OwnedSemaphorePermit>), Error> {
        let timeout = self.config.connect_timeout;
        match &self.source {
            Source::Url { opts, slots } => {
                let slot = slots.clone().try_acquire_owned().map_err(|_| {
                    Error::new(
                        ErrorKind::ResourceExhausted,
                        format!(
                            "{} GET_LOCK connections are open (max_connections)",
                            self.config.max_connections
                        ),
                    )
                })?;
                let conn = within("connect to MySQL", timeout, Conn::new(opts.clone())).await?;
                Ok((conn, Some(slot)))
            }
            Source::Pool(pool) => {
                let mut conn = within("connect to MySQL", timeout, pool.get_conn()).await?;
                // Should it ever return to the pool holding a lock: reset, which
                // releases it, whatever the pool's own setting.
                conn.reset_connection(true);
                Ok((conn, None))
            }
        }
    }

    async fn grant(&self, spec: &AcquireSpec) -> Result<Lease, Error> {
        let secs = lease_secs(spec.ttl)?;
        let (mut conn, slot) = self.session().await?;
        let wait_secs = spec.wait.as_secs_f64().min(MAX_WAIT_SECS);
        let budget = spec.wait.saturating_add(self.config.request_timeout);
        let take = async {
            // The lease is in force before the lock is taken: no instant exists at
            // which the session holds the lock without it.
            conn.query_drop(format!("SET SESSION wait_timeout = {secs}"))
                .await?;
            let name = spec.name.as_str();
            conn.exec_first::<(Option<i64>, String), _, _>(GET_LOCK, (wait_secs, name, name, name))
                .await
        };
        let answer = match tokio::time::timeout(budget, take).await {
            Err(_) => return Err(timed_out("acquire", budget)),
            Ok(Err(e)) => return Err(my_error(&e, "acquire")),
            Ok(Ok(answer)) => answer,
        };
        let key = match answer {
            Some((Some(1), key)) => key,
            Some((Some(_), _)) if spec.wait.is_zero() => {
                return Err(Error::new(
                    ErrorKind::Held,
                    format!("{:?} is held", spec.name),
                ))
            }
            Some((Some(_), _)) => {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!("{:?} was not granted within {:?}", spec.name, spec.wait),
                ))
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::Unavailable,
                    format!("GET_LOCK for {:?} answered NULL (killed?)", spec.name),
                ))
            }
        };
        let lease = Lease::new(
            spec.name.clone(),
            0,
            fencelock_backend::request_id(),
            Duration::from_secs(secs),
        );
        let held = Arc::new(Held {
            lease: lease.clone(),
            key,
            request_id: spec.request_id.clone(),
            conn: tokio::sync::Mutex::new(Some(conn)),
            _slot: slot,
        });
        let mut state = self.state();
        state
            .by_request
            .insert(spec.request_id.clone(), lease.owner_token.clone());
        state.held.insert(lease.owner_token.clone(), held);
        Ok(lease)
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

/// A held lock's session failed or went silent: it may be gone already or soon.
fn session_lost(what: &str, name: &str, why: &str) -> Error {
    Error::new(
        ErrorKind::LockLost,
        format!(
            "{what} {name:?}: {why}; the server frees the lock when it notices the \
             connection is gone, at the latest when the lease runs out"
        ),
    )
}

/// What a failed statement on a held lock's session means: a broken connection is a
/// lost lock; a server error on a working session is an ordinary error.
fn failed_on_session(e: &mysql_async::Error, what: &str, name: &str) -> Error {
    if e.is_fatal() {
        session_lost(
            what,
            name,
            &format!("the connection holding it failed ({e})"),
        )
    } else {
        my_error(e, what)
    }
}

impl LockBackend for MysqlGetLockBackend {
    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::new("mysql-get-lock", FenceGuarantee::None);
        caps.push_wakeups = true;
        caps
    }

    fn acquire<'a>(&'a self, spec: &'a AcquireSpec) -> BoxFuture<'a, Result<Lease, Error>> {
        Box::pin(async move {
            spec.validate()?;
            refuse_unsupported(spec, "mysql-get-lock")?;
            lease_secs(spec.ttl)?;
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
            let secs = lease_secs(ttl)?;
            let inner = &*self.inner;
            let not_held = || {
                Error::new(
                    ErrorKind::NotHeld,
                    format!("{:?} is not held with this owner token", lease.name),
                )
            };
            let Some(held) = inner.held(lease) else {
                return Err(not_held());
            };
            let mut slot = held.conn.lock().await;
            let Some(conn) = slot.as_mut() else {
                return Err(not_held());
            };
            let check = async {
                // Each statement restarts the session's idle timer (the lease).
                conn.query_drop(format!("SET SESSION wait_timeout = {secs}"))
                    .await?;
                conn.exec_first::<Option<i64>, _, _>(
                    "SELECT IS_USED_LOCK(?) = CONNECTION_ID()",
                    (&held.key,),
                )
                .await
            };
            let timeout = inner.config.request_timeout;
            match tokio::time::timeout(timeout, check).await {
                Err(_) => {
                    // A stalled session is not trusted again.
                    slot.take();
                    inner.forget(&held);
                    Err(session_lost(
                        "renew",
                        &lease.name,
                        &format!("no answer within {timeout:?}"),
                    ))
                }
                Ok(Err(e)) => {
                    if e.is_fatal() {
                        slot.take();
                        inner.forget(&held);
                    }
                    Err(failed_on_session(&e, "renew", &lease.name))
                }
                Ok(Ok(Some(Some(1)))) => Ok(Duration::from_secs(secs)),
                Ok(Ok(_)) => {
                    slot.take();
                    inner.forget(&held);
                    Err(Error::new(
                        ErrorKind::NotHeld,
                        format!("the session no longer holds {:?}", lease.name),
                    ))
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
            // Whatever happens next, this grant's session is done.
            inner.forget(&held);
            let Some(mut conn) = held.conn.lock().await.take() else {
                return Ok(false);
            };
            let timeout = inner.config.request_timeout;
            let unlock =
                conn.exec_first::<Option<i64>, _, _>("SELECT RELEASE_LOCK(?)", (&held.key,));
            let outcome = match tokio::time::timeout(timeout, unlock).await {
                Err(_) => Err(session_lost(
                    "release",
                    &lease.name,
                    &format!("no answer within {timeout:?}; the connection is closed"),
                )),
                Ok(Err(e)) => Err(failed_on_session(&e, "release", &lease.name)),
                Ok(Ok(released)) => Ok(released.flatten() == Some(1)),
            };
            // Closed, never returned to a pool: the session's settings (and any lock
            // the unlock did not free) end with it.
            let _ = tokio::time::timeout(timeout, conn.disconnect()).await;
            outcome
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_round_up_to_whole_seconds() {
        assert_eq!(lease_secs(Duration::from_millis(1)).unwrap(), 1);
        assert_eq!(lease_secs(Duration::from_millis(2000)).unwrap(), 2);
        assert_eq!(lease_secs(Duration::from_millis(2001)).unwrap(), 3);
        assert_eq!(
            lease_secs(Duration::ZERO).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
    }
}
