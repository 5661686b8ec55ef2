//! Redis 7, single instance: `SET key token NX PX ttl` to acquire (polled while busy)
//! and a Lua compare-and-delete to release — the common recipe, not fencelock's Redis
//! backend. The fenced variant takes the lock and `INCR`s a per-lock fence counter in
//! one script.
//!
//! Through the `redis` crate (the client `fencelock-redis` uses too): one multiplexed
//! connection per client, scripts by `EVALSHA`.

use std::sync::LazyLock;

use anyhow::{bail, Context};
use redis::aio::MultiplexedConnection;
use redis::Script;

use super::{poll_pause, token, Grant, Locker, TTL};

/// Takes the lock and draws the next fence of that lock, atomically.
static FENCED_ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then \
         return redis.call('INCR', KEYS[2]) else return -1 end",
    )
});

/// Deletes the lock only if we still own it.
static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end",
    )
});

/// Where Redis listens and which variant to run.
#[derive(Debug, Clone)]
pub struct RedisConfig {
    /// Loopback port.
    pub port: u16,
    /// Use the fenced acquire script.
    pub fenced: bool,
}

/// One Redis connection.
pub struct RedisLocker {
    connection: MultiplexedConnection,
    fenced: bool,
    id: usize,
    n: u64,
    seed: u64,
    held: Option<(String, String)>,
}

impl Locker for RedisLocker {
    type Config = RedisConfig;

    async fn connect(config: &RedisConfig, client: usize) -> anyhow::Result<Self> {
        let redis = redis::Client::open(format!("redis://127.0.0.1:{}/", config.port))?;
        let mut connection = redis
            .get_multiplexed_async_connection()
            .await
            .with_context(|| format!("connect to redis on port {}", config.port))?;
        // Loaded up front, so the measured calls are all EVALSHA hits.
        for script in [&*FENCED_ACQUIRE, &*RELEASE] {
            script.prepare_invoke().load_async(&mut connection).await?;
        }
        Ok(RedisLocker {
            connection,
            fenced: config.fenced,
            id: client,
            n: 0,
            seed: 0x2545_f491_4f6c_dd1d ^ (client as u64 + 1),
            held: None,
        })
    }

    async fn acquire(&mut self, key: &str) -> anyhow::Result<Grant> {
        self.n += 1;
        let owner = token(self.id, self.n);
        let ttl_ms = u64::try_from(TTL.as_millis())?;
        loop {
            let fence = if self.fenced {
                let fence: i64 = FENCED_ACQUIRE
                    .key(key)
                    .key(format!("{key}:fence"))
                    .arg(&owner)
                    .arg(ttl_ms)
                    .invoke_async(&mut self.connection)
                    .await?;
                match fence {
                    -1 => None,
                    fence => Some(Some(u64::try_from(fence)?)),
                }
            } else {
                let set: Option<String> = redis::cmd("SET")
                    .arg(key)
                    .arg(&owner)
                    .arg("NX")
                    .arg("PX")
                    .arg(ttl_ms)
                    .query_async(&mut self.connection)
                    .await?;
                match set.as_deref() {
                    Some("OK") => Some(None),
                    None => None,
                    Some(other) => bail!("SET NX answered {other:?}"),
                }
            };
            if let Some(fence) = fence {
                self.held = Some((key.to_owned(), owner));
                return Ok(Grant { fence });
            }
            poll_pause(&mut self.seed).await;
        }
    }

    async fn release(&mut self) -> anyhow::Result<()> {
        if let Some((key, owner)) = self.held.take() {
            let released: i64 = RELEASE
                .key(&key)
                .arg(&owner)
                .invoke_async(&mut self.connection)
                .await?;
            anyhow::ensure!(released == 1, "the lock was gone at release");
        }
        Ok(())
    }
}
