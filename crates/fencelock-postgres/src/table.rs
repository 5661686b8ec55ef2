//! Table mode: [`PostgresBackend`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_postgres::{AsyncMessage, Client, Statement};

use super::{
    new_owner_token, open, pg_error, quote_identifier, refuse_unsupported, timed_out, ttl_ms,
    PostgresConfig,
};
use fencelock_backend::{
    AcquireSpec, BoxFuture, Capabilities, FenceGuarantee, Leader, Lease, LockBackend, LockMode,
    MAX_TTL,
};
use fencelock_backend::{Backoff, Error, ErrorKind};

/// While the listening connection is down, waiters re-check this often (a release's
/// notification may be lost meanwhile).
const FALLBACK_POLL: Duration = Duration::from_millis(250);

/// The shortest pause between two attempts of one waiter (a lease that ends "now" by
/// the server's clock may still be a few microseconds away).
const MIN_PAUSE: Duration = Duration::from_millis(1);

/// Key of the transaction-level advisory lock that serialises concurrent `CREATE
/// TABLE IF NOT EXISTS` (which can otherwise fail with a unique violation on the
/// catalog). "fencelock" in ASCII.
const DDL_LOCK_KEY: i64 = 0x6665_6e63_656c_6f63;

/// PostgreSQL through a lock table: durable per-lock fences, push wake-ups, leases
/// on the database server's clock.
///
/// # The table
///
/// ```sql
/// CREATE TABLE distributed_lock (
///   lock_name   text PRIMARY KEY,      -- 1..=256 bytes
///   owner_token text,                  -- NULL while free
///   owner       text NOT NULL,         -- who holds it (free text)
///   request_id  text,                  -- the holder's idempotency key
///   fencing_seq bigint NOT NULL,       -- the last fence of this lock
///   lease_until timestamptz NOT NULL,  -- by the server's clock; -infinity when free
///   updated_at  timestamptz NOT NULL,
///   leader_value text                  -- an election's leader's value
/// );
/// ```
///
/// A table made by an earlier version (without `leader_value`) gets the column at
/// connect: `ALTER TABLE … ADD COLUMN IF NOT EXISTS leader_value text`, a catalog-only
/// change that earlier versions' statements never notice, given up after 1 s rather
/// than queued behind a long transaction. A role that may not alter the table keeps
/// working without elections (`Capabilities::elections` false, campaigns
/// `Unsupported`) until the column is added by its owner.
///
/// [`connect`](PostgresBackend::connect) creates it (and the schema) if missing, under
/// a transaction-level advisory lock so concurrent first connects do not collide; a
/// role without `CREATE` can use a table created beforehand. Rows are never deleted:
/// a release marks the row free and keeps `fencing_seq`, so fences never go back.
/// **Do not delete rows** (or truncate the table) while any grant's fence may still be
/// checked by a resource: the lock's fences would restart at 1. Restoring the
/// database from a backup older than the last grant rolls fences back the same way.
///
/// # What it promises
///
/// - **Exclusion and expiry by the server's clock.** A grant is one `INSERT … ON
///   CONFLICT (lock_name) DO UPDATE … WHERE lease_until < now()`: the row lock makes
///   concurrent attempts on one lock take turns, and `now()` is the database's
///   transaction time, never the client's clock. It is a *wall* clock, though: if the
///   server's clock jumps forward, leases end early (`monotonic_leases` is false).
/// - **Durable, per-lock increasing fences.** The fence (`fencing_seq + 1`) is
///   computed in the statement that wins the row, under its row lock, and commits with
///   the grant; the connection sets `synchronous_commit = on`, so a grant is
///   acknowledged after its WAL record is flushed (on a server running with
///   `fsync = on`; a streaming standby promoted by failover may lack commits that
///   were not replicated synchronously). Fences are per lock, not global.
/// - **Idempotent retries.** The grant stores its request id; an acquire retried with
///   the same request id while that grant is held returns the same grant. Request
///   ids are not scoped to a caller: keep them secret and random (the client library
///   does).
/// - **Owner-checked renew and release**, each one statement. A release marks the
///   row free and sends `pg_notify(channel, lock_name)` in the same transaction.
/// - **Push wake-ups, not FIFO.** Each backend keeps one extra connection that
///   `LISTEN`s on the channel and wakes its waiters for that lock name; a waiter also
///   sleeps only until the holder's `lease_until` (an expiry sends nothing). Woken
///   waiters race for the row: no arrival order is kept. While the listening
///   connection is down a waiter re-checks every 250 ms. Built on the application's
///   client or pool there is no listening connection: waiters re-check every 250 ms
///   and when the holder's lease ends, and `push_wakeups` is false.
/// - No semaphores (`limit > 1`), no lock-delay, no sessions: such requests are
///   refused with [`ErrorKind::InvalidArgument`].
///
/// # Elections
///
/// An election is a lock row whose holder also set `leader_value`: a campaign is the
/// acquire statement writing the value with the grant, so the term is the grant's
/// fence; `proclaim` updates the value where the owner token matches and the lease has
/// not ended (`NotHeld` otherwise); `leader` reads the live holder. Observers poll
/// (no push for leader changes), and a plain grant of the name clears the value.
///
/// # Reader-writer locks
///
/// None: a shared request is refused with [`ErrorKind::Unsupported`] (and
/// `Capabilities::shared` is false). A lock is one row with one owner token and one
/// `fencing_seq`; readers would need a holder per row and a writer's fence above
/// every reader's, which is another table design, not a flag on this one.
/// [`PostgresAdvisoryBackend`](super::PostgresAdvisoryBackend) has shared locks
/// (`pg_advisory_lock_shared`), without fences.
///
/// # Connections
///
/// Every call is a single statement, so table mode needs no dedicated connection for
/// a lock. [`connect`](PostgresBackend::connect) opens its own command connection
/// (it sets `synchronous_commit = on` once and prepares its statements there) and,
/// for the first waiter, a listening one (`LISTEN` belongs to a session): connect
/// directly or through a session-pooling proxy, not a transaction-pooling one
/// (PgBouncer `pool_mode = transaction`), where neither would follow the statements.
/// [`with_client`](PostgresBackend::with_client) and `with_pool` (feature
/// `deadpool`) run the same statements on the application's client or pooled
/// clients and open nothing themselves.
#[derive(Debug, Clone)]
pub struct PostgresBackend {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    source: Source,
    config: PostgresConfig,
    sql: Sql,
    /// The command connection (our own, or the application's client with our
    /// statements prepared on it).
    conn: tokio::sync::Mutex<Slot>,
    /// How strong fences are: durable unless the session commits asynchronously.
    fences: FenceGuarantee,
    /// The table has the `leader_value` column.
    elections: bool,
    waiters: Arc<Waiters>,
    /// The listening task, started by the first acquire that waits.
    listener: Mutex<Option<AbortOnDrop>>,
}

#[derive(Debug)]
struct Sql {
    acquire: String,
    holder: String,
    renew: String,
    release: String,
    /// Empty without the `leader_value` column.
    campaign: String,
    proclaim: String,
    leader: String,
}

impl Sql {
    /// The statements on `table`; with `elections`, the table has `leader_value`, which
    /// a new grant of a plain lock clears and a campaign sets.
    fn new(table: &str, elections: bool) -> Sql {
        let mut sql = Sql::plain(table);
        if elections {
            let clear = "updated_at  = now() \
                 WHERE l.lease_until < now()";
            sql.acquire = sql.acquire.replacen(
                clear,
                "leader_value = CASE WHEN l.lease_until < now() THEN NULL ELSE l.leader_value END, \
                   updated_at  = now() \
                 WHERE l.lease_until < now()",
                1,
            );
            sql.campaign = format!(
                "INSERT INTO {table} AS l \
                   (lock_name, owner_token, owner, request_id, fencing_seq, lease_until, updated_at, leader_value) \
                 VALUES ($1, $2, $3, $4, 1, now() + $5::bigint * interval '1 millisecond', now(), $6) \
                 ON CONFLICT (lock_name) DO UPDATE SET \
                   owner_token = CASE WHEN l.lease_until < now() THEN EXCLUDED.owner_token ELSE l.owner_token END, \
                   owner       = CASE WHEN l.lease_until < now() THEN EXCLUDED.owner ELSE l.owner END, \
                   request_id  = CASE WHEN l.lease_until < now() THEN EXCLUDED.request_id ELSE l.request_id END, \
                   fencing_seq = CASE WHEN l.lease_until < now() THEN l.fencing_seq + 1 ELSE l.fencing_seq END, \
                   lease_until = CASE WHEN l.lease_until < now() THEN EXCLUDED.lease_until ELSE l.lease_until END, \
                   leader_value = CASE WHEN l.lease_until < now() THEN EXCLUDED.leader_value ELSE l.leader_value END, \
                   updated_at  = now() \
                 WHERE l.lease_until < now() OR l.request_id = EXCLUDED.request_id \
                 RETURNING fencing_seq, owner_token"
            );
            sql.proclaim = format!(
                "UPDATE {table} SET leader_value = $3, updated_at = now() \
                 WHERE lock_name = $1 AND owner_token = $2 AND lease_until >= now() \
                 RETURNING fencing_seq"
            );
            sql.leader = format!(
                "SELECT owner, coalesce(leader_value, ''), fencing_seq FROM {table} \
                 WHERE lock_name = $1 AND owner_token IS NOT NULL AND lease_until >= now()"
            );
        }
        sql
    }

    fn plain(table: &str) -> Sql {
        Sql {
            campaign: String::new(),
            proclaim: String::new(),
            leader: String::new(),
            // The fence is drawn here, after the row is won (the conflict arm runs
            // under the row lock, after a concurrent winner committed). On a retry of
            // a held grant (same request id, lease not over) every column keeps its
            // value and the existing grant is returned.
            acquire: format!(
                "INSERT INTO {table} AS l \
                   (lock_name, owner_token, owner, request_id, fencing_seq, lease_until, updated_at) \
                 VALUES ($1, $2, $3, $4, 1, now() + $5::bigint * interval '1 millisecond', now()) \
                 ON CONFLICT (lock_name) DO UPDATE SET \
                   owner_token = CASE WHEN l.lease_until < now() THEN EXCLUDED.owner_token ELSE l.owner_token END, \
                   owner       = CASE WHEN l.lease_until < now() THEN EXCLUDED.owner ELSE l.owner END, \
                   request_id  = CASE WHEN l.lease_until < now() THEN EXCLUDED.request_id ELSE l.request_id END, \
                   fencing_seq = CASE WHEN l.lease_until < now() THEN l.fencing_seq + 1 ELSE l.fencing_seq END, \
                   lease_until = CASE WHEN l.lease_until < now() THEN EXCLUDED.lease_until ELSE l.lease_until END, \
                   updated_at  = now() \
                 WHERE l.lease_until < now() OR l.request_id = EXCLUDED.request_id \
                 RETURNING fencing_seq, owner_token"
            ),
            // Milliseconds until the current lease ends (0 if it has), for a waiter's
            // timer.
            holder: format!(
                "SELECT CASE WHEN lease_until <= clock_timestamp() THEN 0::bigint \
                   ELSE ceil(extract(epoch FROM lease_until - clock_timestamp()) * 1000)::bigint END \
                 FROM {table} WHERE lock_name = $1"
            ),
            renew: format!(
                "UPDATE {table} SET lease_until = now() + $3::bigint * interval '1 millisecond', \
                   updated_at = now() \
                 WHERE lock_name = $1 AND owner_token = $2 AND lease_until >= now() \
                 RETURNING fencing_seq"
            ),
            release: format!(
                "WITH released AS ( \
                   UPDATE {table} SET owner_token = NULL, request_id = NULL, \
                     lease_until = '-infinity', updated_at = now() \
                   WHERE lock_name = $1 AND owner_token = $2 AND lease_until >= now() \
                   RETURNING lock_name) \
                 SELECT pg_notify($3, lock_name) FROM released"
            ),
        }
    }
}

/// Where connections come from.
#[derive(Debug)]
enum Source {
    /// Our own: a command connection (reopened after it breaks) and a listening one.
    Own(Box<tokio_postgres::Config>),
    /// The application's client, shared; never reopened.
    Client(Arc<Client>),
    /// The application's pool: one pooled client per call.
    #[cfg(feature = "deadpool")]
    Pool(deadpool_postgres::Pool),
}

/// Which statement to run.
#[derive(Debug, Clone, Copy)]
enum Stmt {
    Acquire,
    Holder,
    Renew,
    Release,
    Campaign,
    Proclaim,
    Leader,
}

impl Sql {
    #[cfg(feature = "deadpool")]
    fn text(&self, which: Stmt) -> &str {
        match which {
            Stmt::Acquire => &self.acquire,
            Stmt::Holder => &self.holder,
            Stmt::Renew => &self.renew,
            Stmt::Release => &self.release,
            Stmt::Campaign => &self.campaign,
            Stmt::Proclaim => &self.proclaim,
            Stmt::Leader => &self.leader,
        }
    }
}

/// The command connection, or the last failure to open it.
#[derive(Debug, Default)]
struct Slot {
    conn: Option<Arc<Conn>>,
    failure: Option<(Instant, Error)>,
}

/// The command connection and its prepared statements.
#[derive(Debug)]
struct Conn {
    client: Arc<Client>,
    acquire: Statement,
    holder: Statement,
    renew: Statement,
    release: Statement,
    /// Campaign, proclaim and leader, where the table has `leader_value`.
    elections: Option<[Statement; 3]>,
}

impl Conn {
    fn statement(&self, which: Stmt) -> Option<&Statement> {
        let election = |i: usize| self.elections.as_ref().map(|e| &e[i]);
        match which {
            Stmt::Acquire => Some(&self.acquire),
            Stmt::Holder => Some(&self.holder),
            Stmt::Renew => Some(&self.renew),
            Stmt::Release => Some(&self.release),
            Stmt::Campaign => election(0),
            Stmt::Proclaim => election(1),
            Stmt::Leader => election(2),
        }
    }
}

impl PostgresBackend {
    /// Connects, creates the schema and table if missing, and prepares the
    /// statements. Fails with [`ErrorKind::InvalidArgument`] for a bad connection
    /// string or identifier, [`ErrorKind::Unavailable`] if the server cannot be
    /// reached within `connect_timeout`.
    pub async fn connect(config: PostgresConfig) -> Result<PostgresBackend, Error> {
        let pg = config.pg_config()?;
        let (client, _ended) = open(&pg, config.connect_timeout).await?;
        let backend = PostgresBackend::build(Source::Own(Box::new(pg)), config, &client).await?;
        drop(client);
        backend.inner.conn().await?;
        Ok(backend)
    }

    /// Uses a client the application already has, shared with it: every call is one
    /// statement on that connection (prepared there once), and **no other connection
    /// is opened** — so waiters poll (every 250 ms, and when the holder's lease ends)
    /// instead of being woken by `NOTIFY`, and `push_wakeups` is false. Creates the
    /// table if missing. `config.conninfo` is not used.
    ///
    /// The session's settings are left alone: fences are `Durable` unless the
    /// session's `synchronous_commit` is `off` (then `BestEffort`; read once, here).
    /// If the connection breaks, calls fail as [`ErrorKind::Unavailable`] until the
    /// application builds a new backend on a new client. Do not run `BEGIN` … `COMMIT`
    /// as separate statements on the shared client while the backend is in use: the
    /// lock's statements would join that transaction.
    pub async fn with_client(
        client: Arc<Client>,
        config: PostgresConfig,
    ) -> Result<PostgresBackend, Error> {
        let shared = client.clone();
        let backend = PostgresBackend::build(Source::Client(client), config, &shared).await?;
        backend.inner.conn().await?;
        Ok(backend)
    }

    /// Uses the application's `deadpool-postgres` pool (feature `deadpool`): each call
    /// takes a client from the pool for its one statement (prepared once per pooled
    /// connection) and gives it back; **no connection is opened outside the pool**.
    /// Waiters poll as with [`with_client`](PostgresBackend::with_client)
    /// (`push_wakeups` is false: `LISTEN` would pin a pooled connection), and fences
    /// are `Durable` unless a pooled session's `synchronous_commit` is `off`. Creates
    /// the table if missing. `config.conninfo` is not used.
    #[cfg(feature = "deadpool")]
    pub async fn with_pool(
        pool: deadpool_postgres::Pool,
        config: PostgresConfig,
    ) -> Result<PostgresBackend, Error> {
        let client = pooled(&pool, config.connect_timeout).await?;
        PostgresBackend::build(Source::Pool(pool), config, &client).await
    }

    /// Checks the configuration, creates the table through `client` and reads how
    /// durable commits are on the application's sessions.
    async fn build(
        source: Source,
        config: PostgresConfig,
        client: &Client,
    ) -> Result<PostgresBackend, Error> {
        let schema = quote_identifier("schema", &config.schema)?;
        let table = quote_identifier("table", &config.table)?;
        quote_identifier("channel", &config.channel)?;
        if config.connect_timeout.is_zero() || config.request_timeout.is_zero() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "connect_timeout and request_timeout must be positive",
            ));
        }
        let qualified = format!("{schema}.{table}");
        let prepare = async {
            let elections = ensure_table(client, &config, &schema, &qualified).await?;
            if matches!(source, Source::Own(_)) {
                // Our own sessions set synchronous_commit = on themselves.
                return Ok((FenceGuarantee::Durable, elections));
            }
            let row = client
                .query_one("SELECT current_setting('synchronous_commit')", &[])
                .await
                .map_err(|e| pg_error(&e, "read synchronous_commit"))?;
            let fences = if row.get::<_, String>(0) == "off" {
                FenceGuarantee::BestEffort
            } else {
                FenceGuarantee::Durable
            };
            Ok((fences, elections))
        };
        let (fences, elections) = tokio::time::timeout(config.request_timeout, prepare)
            .await
            .map_err(|_| timed_out("create the lock table", config.request_timeout))??;
        Ok(PostgresBackend {
            inner: Arc::new(Inner {
                source,
                sql: Sql::new(&qualified, elections),
                elections,
                config,
                conn: tokio::sync::Mutex::new(Slot::default()),
                fences,
                waiters: Arc::new(Waiters::default()),
                listener: Mutex::new(None),
            }),
        })
    }

    /// The lock table's qualified, quoted name (`"public"."distributed_lock"`).
    pub fn table(&self) -> String {
        format!(
            "\"{}\".\"{}\"",
            self.inner.config.schema, self.inner.config.table
        )
    }
}

/// Creates the table if missing; returns whether it has the `leader_value` column
/// (elections), adding it to a table made by an earlier version when this role may.
async fn ensure_table(
    client: &Client,
    config: &PostgresConfig,
    schema: &str,
    qualified: &str,
) -> Result<bool, Error> {
    let exists = client
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&qualified])
        .await
        .map_err(|e| pg_error(&e, "look up the lock table"))?;
    if exists.get::<_, bool>(0) {
        return add_leader_value(client, qualified).await;
    }
    let ddl = format!(
        "BEGIN;
         SELECT pg_advisory_xact_lock({DDL_LOCK_KEY});
         CREATE SCHEMA IF NOT EXISTS {schema};
         CREATE TABLE IF NOT EXISTS {qualified} (
           lock_name   text PRIMARY KEY CHECK (octet_length(lock_name) BETWEEN 1 AND 256),
           owner_token text,
           owner       text NOT NULL DEFAULT '',
           request_id  text,
           fencing_seq bigint NOT NULL CHECK (fencing_seq > 0),
           lease_until timestamptz NOT NULL,
           updated_at  timestamptz NOT NULL,
           leader_value text
         );
         COMMIT;"
    );
    client.batch_execute(&ddl).await.map_err(|e| {
        pg_error(
            &e,
            &format!(
                "create the lock table {}.{} (create it beforehand if this role may not)",
                config.schema, config.table
            ),
        )
    })?;
    add_leader_value(client, qualified).await
}

/// Whether the table has `leader_value`; adds it if missing. A nullable column without
/// a default is a catalog change only (no rewrite, and statements of earlier versions
/// never name it), and the ALTER gives up after a second instead of queueing behind a
/// long transaction (and every lock statement behind it). If it cannot be added (no
/// privilege, a busy table) the backend works without elections.
async fn add_leader_value(client: &Client, qualified: &str) -> Result<bool, Error> {
    if has_leader_value(client, qualified).await? {
        return Ok(true);
    }
    // Only a table of fencelock's own shape is altered; any other is refused when the
    // statements are prepared, and must stay as it was.
    let ours = client
        .query_one(
            "SELECT count(*) = 7 FROM pg_attribute WHERE attrelid = to_regclass($1) \
               AND NOT attisdropped AND attname IN ('lock_name', 'owner_token', 'owner', \
               'request_id', 'fencing_seq', 'lease_until', 'updated_at')",
            &[&qualified],
        )
        .await
        .map_err(|e| pg_error(&e, "look up the lock table's columns"))?;
    if !ours.get::<_, bool>(0) {
        return Ok(false);
    }
    let alter = format!(
        "BEGIN; SET LOCAL lock_timeout = '1s'; \
         ALTER TABLE {qualified} ADD COLUMN IF NOT EXISTS leader_value text; COMMIT;"
    );
    if client.batch_execute(&alter).await.is_err() {
        // Leave the (shared) session outside the failed transaction.
        let _ = client.batch_execute("ROLLBACK").await;
        return Ok(false);
    }
    has_leader_value(client, qualified).await
}

async fn has_leader_value(client: &Client, qualified: &str) -> Result<bool, Error> {
    let row = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) \
               AND attname = 'leader_value' AND NOT attisdropped)",
            &[&qualified],
        )
        .await
        .map_err(|e| pg_error(&e, "look up the lock table's columns"))?;
    Ok(row.get(0))
}

/// A table without `leader_value` (made by an earlier version, which this role could
/// not alter) has no elections.
fn no_elections() -> Error {
    Error::new(
        ErrorKind::Unsupported,
        "this lock table has no leader_value column, so no elections (see \
         PostgresBackend's docs)",
    )
}

impl Inner {
    /// The command connection, opened if there is none or it broke. Calls that queued
    /// behind a failed attempt share its error instead of each trying (and waiting)
    /// again.
    async fn conn(&self) -> Result<Arc<Conn>, Error> {
        let queued_at = Instant::now();
        let mut slot = self.conn.lock().await;
        if let Some(conn) = &slot.conn {
            if !conn.client.is_closed() {
                return Ok(conn.clone());
            }
        }
        slot.conn = None;
        if let Some((failed_at, error)) = &slot.failure {
            if *failed_at >= queued_at {
                return Err(error.clone());
            }
        }
        match self.open_conn().await {
            Ok(conn) => {
                let conn = Arc::new(conn);
                slot.conn = Some(conn.clone());
                slot.failure = None;
                Ok(conn)
            }
            Err(error) => {
                slot.failure = Some((Instant::now(), error.clone()));
                Err(error)
            }
        }
    }

    async fn open_conn(&self) -> Result<Conn, Error> {
        let client = match &self.source {
            Source::Own(pg) => {
                let (client, _ended) = open(pg, self.config.connect_timeout).await?;
                Arc::new(client)
            }
            Source::Client(client) if client.is_closed() => {
                return Err(Error::new(
                    ErrorKind::Unavailable,
                    "the application's PostgreSQL connection is closed (build the backend on \
                     a new client)",
                ))
            }
            Source::Client(client) => client.clone(),
            #[cfg(feature = "deadpool")]
            Source::Pool(_) => {
                return Err(Error::new(
                    ErrorKind::Internal,
                    "a pooled backend has no command connection",
                ))
            }
        };
        let own = matches!(self.source, Source::Own(_));
        let prepare = async {
            if own {
                // Grants are acknowledged only after their commit is flushed, whatever
                // the server's default.
                client.batch_execute("SET synchronous_commit = on").await?;
            }
            let elections = if self.elections {
                Some([
                    client.prepare(&self.sql.campaign).await?,
                    client.prepare(&self.sql.proclaim).await?,
                    client.prepare(&self.sql.leader).await?,
                ])
            } else {
                None
            };
            Ok::<_, tokio_postgres::Error>(Conn {
                acquire: client.prepare(&self.sql.acquire).await?,
                holder: client.prepare(&self.sql.holder).await?,
                renew: client.prepare(&self.sql.renew).await?,
                release: client.prepare(&self.sql.release).await?,
                elections,
                client,
            })
        };
        let conn = tokio::time::timeout(self.config.request_timeout, prepare)
            .await
            .map_err(|_| timed_out("prepare statements", self.config.request_timeout))?
            .map_err(|e| {
                let mut error = pg_error(&e, "prepare statements on the lock table");
                if e.code().is_some_and(|c| c.code().starts_with("42")) {
                    error = Error::new(
                        ErrorKind::InvalidArgument,
                        format!(
                            "{} (does {}.{} have the columns fencelock expects? see \
                             PostgresBackend's docs)",
                            error.message(),
                            self.config.schema,
                            self.config.table
                        ),
                    );
                }
                error
            })?;
        Ok(conn)
    }

    /// Forgets `conn` (after a timeout: a stalled connection is not trusted again).
    async fn discard(&self, conn: &Arc<Conn>) {
        let mut slot = self.conn.lock().await;
        if slot.conn.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn)) {
            slot.conn = None;
        }
    }

    /// Runs one statement within `request_timeout`: on the command connection, or on
    /// a client borrowed from the pool.
    async fn query(
        &self,
        what: &str,
        which: Stmt,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Vec<tokio_postgres::Row>, Error> {
        #[cfg(feature = "deadpool")]
        if let Source::Pool(pool) = &self.source {
            let timeout = self.config.request_timeout;
            let run = async {
                let client = pooled(pool, timeout).await?;
                let statement = client
                    .prepare_cached(self.sql.text(which))
                    .await
                    .map_err(|e| pg_error(&e, what))?;
                client
                    .query(&statement, params)
                    .await
                    .map_err(|e| pg_error(&e, what))
            };
            return tokio::time::timeout(timeout, run)
                .await
                .map_err(|_| timed_out(what, timeout))?;
        }
        let conn = self.conn().await?;
        let statement = conn.statement(which).ok_or_else(no_elections)?;
        match tokio::time::timeout(
            self.config.request_timeout,
            conn.client.query(statement, params),
        )
        .await
        {
            Ok(Ok(rows)) => Ok(rows),
            Ok(Err(e)) => Err(pg_error(&e, what)),
            Err(_) => {
                self.discard(&conn).await;
                Err(timed_out(what, self.config.request_timeout))
            }
        }
    }

    /// One attempt: the grant, or how long the current lease has left.
    async fn attempt(
        &self,
        spec: &AcquireSpec,
        token: &str,
        ttl_ms: i64,
        want_holder: bool,
        candidate: Option<&str>,
    ) -> Result<Attempt, Error> {
        let rows = match candidate {
            None => {
                self.query(
                    "acquire",
                    Stmt::Acquire,
                    &[&spec.name, &token, &spec.owner, &spec.request_id, &ttl_ms],
                )
                .await?
            }
            Some(value) => {
                self.query(
                    "campaign",
                    Stmt::Campaign,
                    &[
                        &spec.name,
                        &token,
                        &spec.owner,
                        &spec.request_id,
                        &ttl_ms,
                        &value,
                    ],
                )
                .await?
            }
        };
        if let Some(row) = rows.first() {
            let fence: i64 = row.get(0);
            let owner_token: String = row.get(1);
            let fence = u64::try_from(fence).map_err(|_| {
                Error::new(
                    ErrorKind::Internal,
                    format!("the lock table holds fence {fence}"),
                )
            })?;
            return Ok(Attempt::Granted(Lease::new(
                spec.name.clone(),
                fence,
                owner_token,
                spec.ttl,
            )));
        }
        if !want_holder {
            return Ok(Attempt::Held {
                remaining: Duration::ZERO,
            });
        }
        let rows = self
            .query("read the lock", Stmt::Holder, &[&spec.name])
            .await?;
        let remaining_ms = rows.first().map_or(0, |row| row.get::<_, i64>(0));
        // Clamped: a row edited by hand may claim any lease.
        let remaining = Duration::from_millis(u64::try_from(remaining_ms).unwrap_or(0));
        Ok(Attempt::Held {
            remaining: remaining.min(MAX_TTL),
        })
    }

    /// Starts the listening task unless it runs.
    fn ensure_listener(&self) {
        let Source::Own(pg) = &self.source else {
            // The application's connections: no LISTEN, waiters poll.
            return;
        };
        let mut listener = self.listener.lock().unwrap_or_else(|p| p.into_inner());
        if listener.is_none() {
            let task = tokio::spawn(listen(
                (**pg).clone(),
                self.config.connect_timeout,
                self.config.channel.clone(),
                self.waiters.clone(),
            ));
            *listener = Some(AbortOnDrop(task));
        }
    }
}

enum Attempt {
    Granted(Lease),
    Held { remaining: Duration },
}

impl LockBackend for PostgresBackend {
    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::new("postgres", self.inner.fences);
        caps.push_wakeups = matches!(self.inner.source, Source::Own(_));
        caps.elections = self.inner.elections;
        caps
    }

    fn acquire<'a>(&'a self, spec: &'a AcquireSpec) -> BoxFuture<'a, Result<Lease, Error>> {
        Box::pin(self.acquire_as(spec, None))
    }

    /// A candidate is a grant of the election's row that also sets `leader_value`; its
    /// fence is the term.
    fn campaign<'a>(
        &'a self,
        spec: &'a AcquireSpec,
        value: &'a str,
    ) -> BoxFuture<'a, Result<Lease, Error>> {
        Box::pin(async move {
            if !self.inner.elections {
                return Err(no_elections());
            }
            fencelock_backend::validate_value(value)?;
            self.acquire_as(spec, Some(value)).await
        })
    }

    fn proclaim<'a>(
        &'a self,
        lease: &'a Lease,
        value: &'a str,
    ) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            if !self.inner.elections {
                return Err(no_elections());
            }
            fencelock_backend::validate_value(value)?;
            let rows = self
                .inner
                .query(
                    "proclaim",
                    Stmt::Proclaim,
                    &[&lease.name, &lease.owner_token, &value],
                )
                .await?;
            if rows.is_empty() {
                return Err(Error::new(
                    ErrorKind::NotHeld,
                    format!(
                        "{:?} is not led by this grant (resigned or expired)",
                        lease.name
                    ),
                ));
            }
            Ok(())
        })
    }

    fn leader<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<Leader>, Error>> {
        Box::pin(async move {
            if !self.inner.elections {
                return Err(no_elections());
            }
            let rows = self
                .inner
                .query("read the leader", Stmt::Leader, &[&name])
                .await?;
            let Some(row) = rows.first() else {
                return Ok(None);
            };
            let term: i64 = row.get(2);
            let term = u64::try_from(term).map_err(|_| {
                Error::new(
                    ErrorKind::Internal,
                    format!("the lock table holds fence {term}"),
                )
            })?;
            Ok(Some(Leader::new(
                name.to_owned(),
                row.get(1),
                term,
                row.get(0),
            )))
        })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Duration, Error>> {
        Box::pin(async move {
            let ttl_ms = ttl_ms(ttl)?;
            let rows = self
                .inner
                .query(
                    "renew",
                    Stmt::Renew,
                    &[&lease.name, &lease.owner_token, &ttl_ms],
                )
                .await?;
            if rows.is_empty() {
                return Err(Error::new(
                    ErrorKind::NotHeld,
                    format!(
                        "{:?} is not held with this owner token (released or expired)",
                        lease.name
                    ),
                ));
            }
            Ok(ttl)
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            let rows = self
                .inner
                .query(
                    "release",
                    Stmt::Release,
                    &[&lease.name, &lease.owner_token, &self.inner.config.channel],
                )
                .await?;
            Ok(!rows.is_empty())
        })
    }
}

impl PostgresBackend {
    async fn acquire_as(
        &self,
        spec: &AcquireSpec,
        candidate: Option<&str>,
    ) -> Result<Lease, Error> {
        {
            spec.validate()?;
            refuse_unsupported(spec, "postgres")?;
            if spec.mode != LockMode::Exclusive {
                // One row has room for one holder and one fence: see "Reader-writer
                // locks" on `PostgresBackend`.
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    "the postgres table backend has no shared (reader) locks (see its \
                     Capabilities); PostgresAdvisoryBackend has them, without fences",
                ));
            }
            let ttl_ms = ttl_ms(spec.ttl)?;
            let inner = &*self.inner;
            let token = new_owner_token();
            let now = Instant::now();
            // A wait too long to represent is as good as forever (30 years).
            let deadline = now
                .checked_add(spec.wait)
                .unwrap_or_else(|| now + Duration::from_secs(30 * 365 * 24 * 3600));
            let waits = !spec.wait.is_zero();
            // Subscribe before the first attempt, so that a release committed after
            // the attempt saw the lock held is never missed.
            let mut subscription = waits.then(|| {
                inner.ensure_listener();
                inner.waiters.subscribe(&spec.name)
            });
            // Bounded by the deadline: every round waits for a wake-up or a timer.
            loop {
                if let Some(s) = &mut subscription {
                    s.rx.borrow_and_update();
                }
                let remaining = match inner
                    .attempt(spec, &token, ttl_ms, waits, candidate)
                    .await?
                {
                    Attempt::Granted(lease) => return Ok(lease),
                    Attempt::Held { remaining } => remaining,
                };
                let now = Instant::now();
                let Some(subscription) = subscription.as_mut().filter(|_| now < deadline) else {
                    return Err(if waits {
                        Error::new(
                            ErrorKind::Timeout,
                            format!("{:?} was not granted within {:?}", spec.name, spec.wait),
                        )
                    } else {
                        Error::new(ErrorKind::Held, format!("{:?} is held", spec.name))
                    });
                };
                let mut wake = deadline.min(now + remaining.max(MIN_PAUSE));
                if !inner.waiters.listening() {
                    wake = wake.min(now + FALLBACK_POLL);
                }
                tokio::select! {
                    _ = subscription.rx.changed() => {}
                    _ = tokio::time::sleep_until(wake) => {}
                }
            }
        }
    }
}

/// Waiters of this backend, by lock name, and whether the listener is listening.
#[derive(Debug, Default)]
struct Waiters {
    state: Mutex<WaitersState>,
}

#[derive(Debug, Default)]
struct WaitersState {
    /// One entry per lock name some acquire of this backend waits for (so bounded by
    /// the acquires in progress); removed by the last waiter.
    by_name: HashMap<String, watch::Sender<u64>>,
    listening: bool,
}

impl Waiters {
    fn lock(&self) -> std::sync::MutexGuard<'_, WaitersState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn subscribe(self: &Arc<Self>, name: &str) -> Subscription {
        let mut state = self.lock();
        let sender = state
            .by_name
            .entry(name.to_owned())
            .or_insert_with(|| watch::channel(0).0);
        Subscription {
            rx: sender.subscribe(),
            name: name.to_owned(),
            waiters: self.clone(),
        }
    }

    fn wake(&self, name: &str) {
        if let Some(sender) = self.lock().by_name.get(name) {
            sender.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    fn listening(&self) -> bool {
        self.lock().listening
    }

    /// Records the listener's state and wakes every waiter: notifications may have
    /// been missed while it was down.
    fn set_listening(&self, listening: bool) {
        let mut state = self.lock();
        state.listening = listening;
        for sender in state.by_name.values() {
            sender.send_modify(|n| *n = n.wrapping_add(1));
        }
    }
}

struct Subscription {
    rx: watch::Receiver<u64>,
    name: String,
    waiters: Arc<Waiters>,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut state = self.waiters.lock();
        // `self.rx` still counts: remove the entry if it is the last receiver.
        if state
            .by_name
            .get(&self.name)
            .is_some_and(|sender| sender.receiver_count() <= 1)
        {
            state.by_name.remove(&self.name);
        }
    }
}

#[derive(Debug)]
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The listening task: `LISTEN channel` on its own connection, wake the waiters of
/// each notified lock name; reconnect (with backoff) when the connection ends. Runs
/// until the backend is dropped.
async fn listen(
    pg: tokio_postgres::Config,
    connect_timeout: Duration,
    channel: String,
    waiters: Arc<Waiters>,
) {
    let backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
    let mut failures = 0u32;
    loop {
        if listen_once(&pg, connect_timeout, &channel, &waiters).await {
            failures = 0;
        }
        waiters.set_listening(false);
        tokio::time::sleep(backoff.delay(failures)).await;
        failures = failures.saturating_add(1);
    }
}

/// One listening connection, until it ends. Returns whether it was listening at some
/// point (then the backoff starts over).
async fn listen_once(
    pg: &tokio_postgres::Config,
    connect_timeout: Duration,
    channel: &str,
    waiters: &Waiters,
) -> bool {
    let connecting = pg.connect(tokio_postgres::NoTls);
    let Ok(Ok((client, mut connection))) = tokio::time::timeout(connect_timeout, connecting).await
    else {
        return false;
    };
    // The channel was checked to be a plain identifier.
    let statement = format!("LISTEN \"{channel}\"");
    let listen = client.batch_execute(&statement);
    tokio::pin!(listen);
    let mut listened = false;
    loop {
        tokio::select! {
            done = &mut listen, if !listened => match done {
                Ok(()) => {
                    listened = true;
                    waiters.set_listening(true);
                }
                Err(_) => return false,
            },
            message = std::future::poll_fn(|cx| connection.poll_message(cx)) => match message {
                Some(Ok(AsyncMessage::Notification(n))) => waiters.wake(n.payload()),
                Some(Ok(_)) => {}
                Some(Err(_)) | None => return listened,
            },
        }
    }
}

/// A client from the application's pool within `timeout`.
#[cfg(feature = "deadpool")]
pub(crate) async fn pooled(
    pool: &deadpool_postgres::Pool,
    timeout: Duration,
) -> Result<deadpool_postgres::Object, Error> {
    match tokio::time::timeout(timeout, pool.get()).await {
        Err(_) => Err(timed_out("take a connection from the pool", timeout)),
        Ok(Ok(client)) => Ok(client),
        Ok(Err(deadpool_postgres::PoolError::Backend(e))) => {
            Err(pg_error(&e, "take a connection from the pool"))
        }
        Ok(Err(e)) => Err(Error::new(
            ErrorKind::Unavailable,
            format!("take a connection from the pool: {e}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_grant_clears_the_leader_value_only_where_the_column_exists() {
        let clears = "leader_value = CASE WHEN l.lease_until < now() THEN NULL";
        assert!(Sql::new("t", true).acquire.contains(clears));
        assert!(!Sql::new("t", false).acquire.contains("leader_value"));
        assert!(Sql::new("t", false).campaign.is_empty());
    }
}
