//! Table mode: [`MysqlBackend`].

use std::sync::Arc;
use std::time::Duration;

use mysql_async::prelude::Queryable;
use mysql_async::{Pool, TxOpts};
use tokio::time::Instant;

use super::{
    invalid, my_error, quote_identifier, refuse_unsupported, server_code, timed_out, ttl_us,
    within, MysqlConfig,
};
use fencelock_backend::{
    AcquireSpec, BoxFuture, Capabilities, Error, ErrorKind, FenceGuarantee, Lease, LockBackend,
    MAX_TTL,
};

/// The first pause of a waiting acquire; it doubles up to `max_poll_interval`.
const FIRST_POLL: Duration = Duration::from_millis(10);

/// How many times one attempt is retried after losing a deadlock or a duplicate-key
/// race (two first acquires of a new name), before the error is returned.
const RACE_RETRIES: u32 = 5;

/// MySQL or MariaDB through an InnoDB lock table: durable per-lock fences drawn under
/// the row lock, leases on the database server's clock, polling waiters.
///
/// # The table
///
/// ```sql
/// CREATE TABLE distributed_lock (
///   lock_name   VARBINARY(256) NOT NULL PRIMARY KEY, -- the name's UTF-8 bytes
///   owner_token VARBINARY(64),                       -- NULL while free
///   owner       VARBINARY(1024) NOT NULL DEFAULT '', -- who holds it (free text)
///   request_id  VARBINARY(256),                      -- the holder's idempotency key
///   fencing_seq BIGINT UNSIGNED NOT NULL,            -- the last fence of this lock
///   lease_until DATETIME(6) NOT NULL,                -- UTC, by the server's clock
///   updated_at  DATETIME(6) NOT NULL
/// ) ENGINE=InnoDB;
/// ```
///
/// The reference design's `distributed_lock` table, with two deliberate changes:
/// names are `VARBINARY`, so they compare byte for byte (a `VARCHAR` under the usual
/// case-insensitive collation would make `Job` and `job` one lock), and times are
/// `DATETIME(6)` in UTC written with `UTC_TIMESTAMP(6)` (a `TIMESTAMP` follows the
/// session's time zone and ends in 2038).
///
/// The constructors create it if missing (`CREATE TABLE IF NOT EXISTS`); a role
/// without `CREATE` can use a table created beforehand. A table of another engine is
/// refused: only InnoDB has the row locks and transactions this relies on. Rows are
/// never deleted: a release marks the row free and keeps `fencing_seq`. **Do not
/// delete rows** (or truncate the table) while a grant's fence may still be checked:
/// the lock's fences would restart at 1. Restoring an older backup does the same.
///
/// # What it promises
///
/// - **Exclusion, and expiry by the server's clock.** Each call is a transaction that
///   starts with `SELECT … FOR UPDATE` on the lock's row: concurrent calls for one
///   lock take turns, and each judges the lease against `UTC_TIMESTAMP(6)`, the
///   database server's system clock read when the statement starts — never the
///   client's clock. It is a *wall* clock: if the server's clock jumps forward,
///   leases end early, so `monotonic_leases` is false. Keep the server on NTP with
///   slewing, and leases well above any step you expect.
/// - **Durable, per-lock increasing fences.** The fence (`fencing_seq + 1`) is computed
///   while the row lock is held and written in the same transaction as the grant; the
///   grant is returned only after `COMMIT` succeeds. With
///   `innodb_flush_log_at_trx_commit = 1` (InnoDB's default) a commit is on disk
///   before it is acknowledged, and [`Capabilities::fences`] is
///   [`FenceGuarantee::Durable`]; with any other value an operating-system crash can
///   lose the last second of commits, so it says [`FenceGuarantee::BestEffort`]
///   (read once, when the backend is built). A replica promoted by failover may lack
///   commits that were not replicated synchronously (semi-sync or Galera). Fences are
///   per lock, not global.
/// - **Idempotent retries.** The grant stores its request id; an acquire retried with
///   the same request id while that grant is held returns the same grant. Request ids
///   are not scoped to a caller: keep them secret and random (the client library does).
/// - **Owner-checked renew and release**, each a transaction that locks the row and
///   checks the owner token and the lease before writing. An expired holder's late
///   release or renew changes nothing, even after another holder took the lock.
/// - **Polling, not push, not FIFO.** A waiter retries after 10 ms, doubling up to
///   [`MysqlConfig::max_poll_interval`], and never sleeps past the holder's lease.
///   Waiters race for the row when it frees: no arrival order is kept.
/// - **No semaphores.** A semaphore would need one row per holder and a count taken
///   under a lock on all of them; it is refused with [`ErrorKind::InvalidArgument`],
///   as are lock-delay and sessions.
///
/// Every call borrows a connection only for its transaction and leaves no session
/// state behind, so it works through the application's pool and through proxies that
/// pool per transaction.
#[derive(Debug, Clone)]
pub struct MysqlBackend {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    pool: Pool,
    config: MysqlConfig,
    fences: FenceGuarantee,
    sql: Sql,
}

#[derive(Debug)]
struct Sql {
    lock_row: String,
    insert: String,
    grant: String,
    owner_row: String,
    renew: String,
    release: String,
}

impl Sql {
    fn new(table: &str) -> Sql {
        Sql {
            // Locks the row (the latest committed version, whatever the isolation
            // level) and reads the lease against the server's clock.
            lock_row: format!(
                "SELECT owner_token, request_id, fencing_seq, \
                   lease_until > UTC_TIMESTAMP(6), \
                   GREATEST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), lease_until), 0) \
                 FROM {table} WHERE lock_name = ? FOR UPDATE"
            ),
            insert: format!(
                "INSERT INTO {table} \
                   (lock_name, owner_token, owner, request_id, fencing_seq, lease_until, updated_at) \
                 VALUES (?, ?, ?, ?, 1, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, UTC_TIMESTAMP(6))"
            ),
            grant: format!(
                "UPDATE {table} SET owner_token = ?, owner = ?, request_id = ?, fencing_seq = ?, \
                   lease_until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, \
                   updated_at = UTC_TIMESTAMP(6) \
                 WHERE lock_name = ?"
            ),
            owner_row: format!(
                "SELECT owner_token = ? AND lease_until > UTC_TIMESTAMP(6) \
                 FROM {table} WHERE lock_name = ? FOR UPDATE"
            ),
            renew: format!(
                "UPDATE {table} SET lease_until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, \
                   updated_at = UTC_TIMESTAMP(6) \
                 WHERE lock_name = ?"
            ),
            release: format!(
                "UPDATE {table} SET owner_token = NULL, request_id = NULL, \
                   lease_until = '1970-01-01 00:00:00', updated_at = UTC_TIMESTAMP(6) \
                 WHERE lock_name = ?"
            ),
        }
    }
}

/// One attempt's outcome.
enum Attempt {
    Granted(Lease),
    Held { remaining: Duration },
}

impl MysqlBackend {
    /// Opens its own pool for `url` (`mysql://user:password@host:port/database`; the
    /// database holds the lock table), creates the table if missing and checks it.
    /// Fails with [`ErrorKind::InvalidArgument`] for a bad URL, setting or table,
    /// [`ErrorKind::Unavailable`] if the server cannot be reached within
    /// `connect_timeout`.
    pub async fn connect(url: &str, config: MysqlConfig) -> Result<MysqlBackend, Error> {
        let opts = config.opts(url)?;
        MysqlBackend::with_pool(Pool::new(opts), config).await
    }

    /// Uses the application's pool: each call borrows one connection for its
    /// transaction and returns it. Opens no connection of its own. The pool's default
    /// database holds the lock table, created if missing.
    /// [`MysqlConfig::max_connections`] does not apply (the pool has its own bound).
    pub async fn with_pool(pool: Pool, config: MysqlConfig) -> Result<MysqlBackend, Error> {
        config.check()?;
        let table = quote_identifier("table", &config.table)?;
        let fences = prepare_table(&pool, &config, &table).await?;
        Ok(MysqlBackend {
            inner: Arc::new(Inner {
                pool,
                sql: Sql::new(&table),
                config,
                fences,
            }),
        })
    }

    /// The lock table's quoted name (in the connection's database).
    pub fn table(&self) -> String {
        format!("`{}`", self.inner.config.table)
    }
}

/// Creates the table if missing, checks its engine, and reads how durable commits are.
async fn prepare_table(
    pool: &Pool,
    config: &MysqlConfig,
    table: &str,
) -> Result<FenceGuarantee, Error> {
    let mut conn = within("connect to MySQL", config.connect_timeout, pool.get_conn()).await?;
    let setup = async {
        let database: Option<Option<String>> = conn.query_first("SELECT DATABASE()").await?;
        let Some(database) = database.flatten() else {
            return Ok(Err(invalid(
                "no database selected: name one in the URL (mysql://…/database)".to_owned(),
            )));
        };
        let engine_sql = "SELECT engine FROM information_schema.tables \
                          WHERE table_schema = DATABASE() AND table_name = ?";
        let mut engine: Option<String> = conn.exec_first(engine_sql, (&config.table,)).await?;
        if engine.is_none() {
            conn.query_drop(format!(
                "CREATE TABLE IF NOT EXISTS {table} (
                   lock_name   VARBINARY(256) NOT NULL PRIMARY KEY,
                   owner_token VARBINARY(64) NULL,
                   owner       VARBINARY(1024) NOT NULL DEFAULT '',
                   request_id  VARBINARY(256) NULL,
                   fencing_seq BIGINT UNSIGNED NOT NULL,
                   lease_until DATETIME(6) NOT NULL,
                   updated_at  DATETIME(6) NOT NULL
                 ) ENGINE=InnoDB"
            ))
            .await?;
            engine = conn.exec_first(engine_sql, (&config.table,)).await?;
        }
        if !engine.is_some_and(|e| e.eq_ignore_ascii_case("InnoDB")) {
            return Ok(Err(invalid(format!(
                "the lock table {database}.{} is not an InnoDB table: its row locks and \
                 transactions are what make the lock safe",
                config.table
            ))));
        }
        let flush: Option<u64> = conn
            .query_first("SELECT @@global.innodb_flush_log_at_trx_commit")
            .await?;
        Ok(Ok(if flush == Some(1) {
            FenceGuarantee::Durable
        } else {
            FenceGuarantee::BestEffort
        }))
    };
    match tokio::time::timeout(config.request_timeout, setup).await {
        Ok(Ok(checked)) => checked,
        Ok(Err(e)) => Err(my_error(
            &e,
            &format!(
                "create or check the lock table {} (create it beforehand if this user may not)",
                config.table
            ),
        )),
        Err(_) => Err(timed_out("create the lock table", config.request_timeout)),
    }
}

/// What `lock_row` reads.
type LockRow = (Option<String>, Option<String>, u64, i64, i64);

impl Inner {
    /// One attempt, retried a few times after losing a deadlock or a first-insert
    /// race (the loser's transaction was rolled back; nothing was granted).
    async fn attempt(
        &self,
        spec: &AcquireSpec,
        token: &str,
        ttl_us: u64,
    ) -> Result<Attempt, Error> {
        let mut tries = 0;
        loop {
            let once = tokio::time::timeout(
                self.config.request_timeout,
                self.attempt_once(spec, token, ttl_us),
            )
            .await;
            match once {
                Err(_) => return Err(timed_out("acquire", self.config.request_timeout)),
                Ok(Ok(attempt)) => return Ok(attempt),
                Ok(Err(e))
                    if tries < RACE_RETRIES && matches!(server_code(&e), Some(1213 | 1062)) =>
                {
                    tries += 1;
                }
                Ok(Err(e)) => return Err(my_error(&e, "acquire")),
            }
        }
    }

    async fn attempt_once(
        &self,
        spec: &AcquireSpec,
        token: &str,
        ttl_us: u64,
    ) -> Result<Attempt, mysql_async::Error> {
        let mut conn = self.pool.get_conn().await?;
        let mut tx = conn.start_transaction(TxOpts::default()).await?;
        let row: Option<LockRow> = tx.exec_first(&self.sql.lock_row, (&spec.name,)).await?;
        let fence = match row {
            None => {
                tx.exec_drop(
                    &self.sql.insert,
                    (&spec.name, token, &spec.owner, &spec.request_id, ttl_us),
                )
                .await?;
                1
            }
            Some((owner_token, request_id, seq, live, remaining_us)) => {
                if live != 0 {
                    tx.rollback().await?;
                    if let (Some(owner_token), true) =
                        (owner_token, request_id.as_deref() == Some(&spec.request_id))
                    {
                        // A retry of the grant that holds the lock: the same grant.
                        return Ok(Attempt::Granted(Lease::new(
                            spec.name.clone(),
                            seq,
                            owner_token,
                            spec.ttl,
                        )));
                    }
                    // Clamped: a row edited by hand may claim any lease.
                    let remaining = Duration::from_micros(u64::try_from(remaining_us).unwrap_or(0));
                    return Ok(Attempt::Held {
                        remaining: remaining.min(MAX_TTL),
                    });
                }
                let Some(fence) = seq.checked_add(1) else {
                    tx.rollback().await?;
                    return Err(mysql_async::Error::Other(
                        format!("the fence of {:?} is exhausted", spec.name).into(),
                    ));
                };
                tx.exec_drop(
                    &self.sql.grant,
                    (
                        token,
                        &spec.owner,
                        &spec.request_id,
                        fence,
                        ttl_us,
                        &spec.name,
                    ),
                )
                .await?;
                fence
            }
        };
        tx.commit().await?;
        Ok(Attempt::Granted(Lease::new(
            spec.name.clone(),
            fence,
            token.to_owned(),
            spec.ttl,
        )))
    }

    /// Locks the row, checks that `lease` still holds it, and if so runs `write`
    /// (with `params`) and commits. Returns whether it did.
    async fn if_held(
        &self,
        lease: &Lease,
        write: &str,
        params: mysql_async::Params,
    ) -> Result<bool, mysql_async::Error> {
        let mut conn = self.pool.get_conn().await?;
        let mut tx = conn.start_transaction(TxOpts::default()).await?;
        let holds: Option<Option<i64>> = tx
            .exec_first(&self.sql.owner_row, (&lease.owner_token, &lease.name))
            .await?;
        if holds.flatten() != Some(1) {
            tx.rollback().await?;
            return Ok(false);
        }
        tx.exec_drop(write, params).await?;
        tx.commit().await?;
        Ok(true)
    }
}

impl LockBackend for MysqlBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities::new("mysql", self.inner.fences)
    }

    fn acquire<'a>(&'a self, spec: &'a AcquireSpec) -> BoxFuture<'a, Result<Lease, Error>> {
        Box::pin(async move {
            spec.validate()?;
            refuse_unsupported(spec, "mysql")?;
            let ttl_us = ttl_us(spec.ttl)?;
            let inner = &*self.inner;
            let token = fencelock_backend::request_id();
            let now = Instant::now();
            // A wait too long to represent is as good as forever (30 years).
            let deadline = now
                .checked_add(spec.wait)
                .unwrap_or_else(|| now + Duration::from_secs(30 * 365 * 24 * 3600));
            let mut poll = FIRST_POLL;
            // Bounded by the deadline: every round sleeps at least a millisecond.
            loop {
                let remaining = match inner.attempt(spec, &token, ttl_us).await? {
                    Attempt::Granted(lease) => return Ok(lease),
                    Attempt::Held { remaining } => remaining,
                };
                let now = Instant::now();
                if spec.wait.is_zero() {
                    return Err(Error::new(
                        ErrorKind::Held,
                        format!("{:?} is held", spec.name),
                    ));
                }
                if now >= deadline {
                    return Err(Error::new(
                        ErrorKind::Timeout,
                        format!("{:?} was not granted within {:?}", spec.name, spec.wait),
                    ));
                }
                let pause = poll.min(remaining).max(Duration::from_millis(1));
                tokio::time::sleep_until(deadline.min(now + pause)).await;
                poll = (poll * 2).min(inner.config.max_poll_interval);
            }
        })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Duration, Error>> {
        Box::pin(async move {
            let ttl_us = ttl_us(ttl)?;
            let inner = &*self.inner;
            let renewed = within(
                "renew",
                inner.config.request_timeout,
                inner.if_held(lease, &inner.sql.renew, (ttl_us, &lease.name).into()),
            )
            .await?;
            if renewed {
                Ok(ttl)
            } else {
                Err(Error::new(
                    ErrorKind::NotHeld,
                    format!(
                        "{:?} is not held with this owner token (released or expired)",
                        lease.name
                    ),
                ))
            }
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            let inner = &*self.inner;
            within(
                "release",
                inner.config.request_timeout,
                inner.if_held(lease, &inner.sql.release, (&lease.name,).into()),
            )
            .await
        })
    }
}
