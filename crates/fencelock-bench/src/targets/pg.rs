//! PostgreSQL, two ways:
//! - [`PgTableLocker`]: the reference material's `distributed_lock` table (lock name
//!   as primary key, owner token, `fencing_seq` from a sequence, `lease_until`). An
//!   acquire is one `INSERT … ON CONFLICT DO UPDATE … WHERE lease_until < now`; a busy
//!   lock is polled. The fence is drawn by `nextval` *before* the row is won, so a
//!   slow winner can carry a smaller fence than the previous holder's; the checker
//!   reports it when it happens.
//! - [`PgAdvisoryLocker`]: `pg_advisory_lock(hashtext(name))`, which waits in the
//!   server; no fence, nothing written (so it is not in the durable tier).

use tokio_postgres::{Client, NoTls, Statement};

use super::{poll_pause, token, Grant, Locker};

/// The table, the sequence, and nothing else. Run once per database.
pub const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS distributed_lock (
  lock_name    VARCHAR(200) PRIMARY KEY,
  owner_token  VARCHAR(100) NOT NULL,
  fencing_seq  BIGINT NOT NULL,
  lease_until  TIMESTAMP NOT NULL,
  updated_at   TIMESTAMP NOT NULL
);
CREATE SEQUENCE IF NOT EXISTS fencing_seq;
";

const ACQUIRE: &str = "
INSERT INTO distributed_lock (lock_name, owner_token, fencing_seq, lease_until, updated_at)
VALUES ($1, $2, nextval('fencing_seq'), localtimestamp + interval '10 seconds', localtimestamp)
ON CONFLICT (lock_name) DO UPDATE
  SET owner_token = EXCLUDED.owner_token, fencing_seq = EXCLUDED.fencing_seq,
      lease_until = EXCLUDED.lease_until, updated_at = EXCLUDED.updated_at
  WHERE distributed_lock.lease_until < localtimestamp
RETURNING fencing_seq";

const RELEASE: &str = "DELETE FROM distributed_lock WHERE lock_name = $1 AND owner_token = $2";

async fn connect(conninfo: &str) -> anyhow::Result<Client> {
    let (client, connection) = tokio_postgres::connect(conninfo, NoTls).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

/// Creates the table and the sequence (idempotent).
pub async fn setup(conninfo: &str) -> anyhow::Result<()> {
    connect(conninfo).await?.batch_execute(SCHEMA).await?;
    Ok(())
}

/// A connection using the `distributed_lock` table.
pub struct PgTableLocker {
    client: Client,
    acquire: Statement,
    release: Statement,
    id: usize,
    n: u64,
    seed: u64,
    held: Option<(String, String)>,
}

impl Locker for PgTableLocker {
    /// A libpq-style connection string.
    type Config = String;

    async fn connect(conninfo: &String, client: usize) -> anyhow::Result<Self> {
        let c = connect(conninfo).await?;
        let acquire = c.prepare(ACQUIRE).await?;
        let release = c.prepare(RELEASE).await?;
        Ok(PgTableLocker {
            client: c,
            acquire,
            release,
            id: client,
            n: 0,
            seed: 0x9e37_79b9_7f4a_7c15 ^ (client as u64 + 1),
            held: None,
        })
    }

    async fn acquire(&mut self, key: &str) -> anyhow::Result<Grant> {
        self.n += 1;
        let owner = token(self.id, self.n);
        loop {
            let rows = self.client.query(&self.acquire, &[&key, &owner]).await?;
            if let Some(row) = rows.first() {
                let fence: i64 = row.get(0);
                self.held = Some((key.to_owned(), owner));
                return Ok(Grant {
                    fence: Some(u64::try_from(fence)?),
                });
            }
            poll_pause(&mut self.seed).await;
        }
    }

    async fn release(&mut self) -> anyhow::Result<()> {
        if let Some((key, owner)) = self.held.take() {
            let n = self.client.execute(&self.release, &[&key, &owner]).await?;
            anyhow::ensure!(n == 1, "the lock row was gone at release");
        }
        Ok(())
    }
}

/// A connection using session-level advisory locks.
pub struct PgAdvisoryLocker {
    client: Client,
    lock: Statement,
    unlock: Statement,
    held: Option<String>,
}

impl Locker for PgAdvisoryLocker {
    /// A libpq-style connection string.
    type Config = String;

    async fn connect(conninfo: &String, _client: usize) -> anyhow::Result<Self> {
        let c = connect(conninfo).await?;
        let lock = c.prepare("SELECT pg_advisory_lock(hashtext($1))").await?;
        let unlock = c.prepare("SELECT pg_advisory_unlock(hashtext($1))").await?;
        Ok(PgAdvisoryLocker {
            client: c,
            lock,
            unlock,
            held: None,
        })
    }

    async fn acquire(&mut self, key: &str) -> anyhow::Result<Grant> {
        self.client.query(&self.lock, &[&key]).await?;
        self.held = Some(key.to_owned());
        Ok(Grant { fence: None })
    }

    async fn release(&mut self) -> anyhow::Result<()> {
        if let Some(key) = self.held.take() {
            let row = self.client.query_one(&self.unlock, &[&key]).await?;
            anyhow::ensure!(
                row.get::<_, bool>(0),
                "advisory lock was not held at release"
            );
        }
        Ok(())
    }
}
