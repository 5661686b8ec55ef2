//! Locks on Redis, through the [`redis`] crate: one server ([`RedisBackend`], plain or
//! TLS, found directly or through Sentinel), a Redis Cluster, or Redlock over several
//! independent servers ([`RedlockBackend`]). Behind the `fencelock` cargo feature
//! `redis`.
//!
//! ```no_run
//! use std::time::Duration;
//! use fencelock_backend::{AcquireSpec, LockBackend};
//! use fencelock_redis::{RedisBackend, RedisConfig};
//!
//! # async fn demo() -> Result<(), fencelock_backend::Error> {
//! let backend = RedisBackend::connect(RedisConfig::new("redis://127.0.0.1:6379/")).await?;
//! let lease = backend.acquire(&AcquireSpec::new("job:nightly", Duration::from_secs(30))).await?;
//! println!("fence {}", lease.fence);
//! backend.release(&lease).await?;
//! # Ok(()) }
//! ```
//!
//! Applications usually take locks through `fencelock::Client::from_backend`, which
//! adds guards, renewal and the lost-lock signal on top.
//!
//! # Connecting
//!
//! Every mode speaks through the `redis` crate (re-exported as [`redis`], so an
//! application hands over values of the same version):
//!
//! - [`RedisBackend::connect`]: a URL, `redis://[user:password@]host:port/db`, or
//!   `rediss://…` for TLS (the system's roots, or the CA in [`RedisConfig::tls`]).
//!   One `ConnectionManager`: one multiplexed connection that reconnects by itself.
//! - [`RedisBackend::from_client`]: the application's `redis::Client`; the backend
//!   opens one `ConnectionManager` from it.
//! - [`RedisBackend::from_connection_manager`]: the application's own
//!   `ConnectionManager`. Every command goes through it; the backend opens no
//!   connection for commands.
//! - [`RedisBackend::sentinel`] / [`RedisBackend::from_sentinel_client`]: a master
//!   name and the sentinels' addresses (optionally TLS). The backend asks the
//!   sentinels for the master, keeps one multiplexed connection to it, and asks again
//!   after a call fails on a connection error or a `READONLY` (the master was
//!   demoted).
//! - [`RedisBackend::cluster`] / [`RedisBackend::from_cluster_client`]: a Redis
//!   Cluster through `redis::cluster_async`, which routes each script to the node
//!   owning its keys and follows `MOVED`/`ASK` and failovers.
//!
//! **Wake-ups need their own connection.** A waiter sleeps until a release is
//! published on the lock's channel; subscribing takes a connection in pub/sub mode,
//! which cannot carry commands. The backend opens it lazily, on the first acquire
//! with a non-zero `wait`, from the same client (Sentinel: the master; Cluster: the
//! node given for it — a `PUBLISH` reaches every node of a cluster), and shares it
//! between all waits. Built from a bare `ConnectionManager` (no client to open it
//! from) or with [`RedisOptions::wakeups`] off, the backend opens none: waiters then
//! try again every [`RedisOptions::poll_interval`] (or at the holder's expiry, if
//! sooner), and `push_wakeups` is false. While the pub/sub connection cannot be
//! opened, waiters poll the same way and try to subscribe again on each turn.
//!
//! # How a lock is kept
//!
//! Lock `NAME` is a hash at `{prefix}lock:NAME` (`token`, `fence`, `request`, `owner`)
//! with a Redis expiry (`PEXPIRE`) of the lease; its fence counter is the plain integer
//! `{prefix}fence:NAME`, which never expires. One Lua script takes a free lock and
//! `INCR`s its counter, so the fence of every grant of a lock is larger than the one
//! before, as long as Redis keeps its data. The script also stores the request id: an
//! acquire retried with the same id while the grant is held gets the same owner token
//! and fence back instead of `Held`. Renew and release are compare-and-`PEXPIRE` /
//! compare-and-`DEL` scripts on the owner token, so they never touch another holder's
//! grant; release `PUBLISH`es on `{prefix}wake:NAME`.
//!
//! A semaphore (`limit` > 1, at most [`MAX_SEMAPHORE_LIMIT`]) keeps its holders in the
//! sorted set `{prefix}sem:NAME` (owner token scored by its lease's expiry, in ms of
//! the Redis server's `TIME`) and their fences and request ids in the hash
//! `{prefix}sem-data:NAME`; every script first drops the holders whose expiry has
//! passed, so a slot frees when its lease runs out. Each holder draws its own fence
//! from the same counter. A lock held as a mutex refuses a semaphore request and vice
//! versa, as does a semaphore held with another `limit` (`LimitMismatch`).
//!
//! **In a cluster** a script may only touch keys of one hash slot, so the name goes
//! into a hash tag: `{prefix}lock:{NAME}`, `{prefix}fence:{NAME}`, `{prefix}sem:{NAME}`,
//! `{prefix}sem-data:{NAME}` (with `%` and `}` in the name written `%25` and `%7D`, so
//! the tag always ends where the name does). All keys of one lock live on one node;
//! different locks spread over the cluster. The prefix must not contain `{` or `}`.
//!
//! Waiters are not queued: whoever tries first after a release wins (no FIFO).
//!
//! # What Redis cannot promise
//!
//! - **Fences are best-effort** unless one server keeps every write. A restart without
//!   the data (no persistence, or `appendfsync everysec`/`no` losing the last second),
//!   a failover to a replica that had not received the last writes (replication is
//!   asynchronous), or an eviction of the counter (`maxmemory-policy allkeys-*`) can
//!   hand out a fence again. A single server (URL, client or connection manager) is
//!   reported [`FenceGuarantee::Durable`] only if, when the backend was built, it said
//!   `appendonly yes`, `appendfsync always`, a `maxmemory-policy` that cannot evict a
//!   key without expiry, and that it is a primary without replicas; if `CONFIG` is
//!   unavailable (renamed, forbidden) it reports `BestEffort`. Settings changed later
//!   are not noticed.
//! - **Sentinel and Cluster are always `BestEffort`.** Their point is failover, and a
//!   failover promotes a replica that may have missed the last grants: the lock can
//!   have two holders for a moment and a fence can be handed out twice. Use them for
//!   availability, not for fences you must trust.
//! - **Leases follow the Redis server's wall clock.** Redis stores expiries as absolute
//!   Unix times, so a clock step on the Redis host (NTP, an operator) expires leases
//!   early or late (`monotonic_leases: false`). Only fences protect the resource then.
//! - **No FIFO, no lock-delay, no sessions:** a non-zero `lock_delay` is refused with
//!   `InvalidArgument`.
//! - While Redis is unreachable every call fails with `Unavailable` (the connection
//!   reconnects in the background), and holders lose their locks when their leases
//!   run out.
//!
//! # Reader-writer locks and elections: none
//!
//! A shared request, a downgrade and every election call answer
//! [`ErrorKind::Unsupported`], and
//! `Capabilities::shared`, `downgrade` and `elections` are false. Redisson's
//! `RReadWriteLock` in Lua would work while one server keeps every write, but what it
//! adds is exactly what a failover or an unpersisted restart loses: a writer waits on
//! a reader count and a mode field that a promoted replica may not have, so a writer
//! would be granted beside live readers, with a fence no larger than theirs. A
//! leader's term is its fence, and a reused term is two leaders that fencing cannot
//! tell apart. Both promises rest on fences this backend can only give best-effort;
//! rather than claim them and break them on failover, Redis says no. Use etcd,
//! ZooKeeper or the fencelock server for them.
#![deny(missing_docs)]

mod conn;
mod redlock;
mod wake;

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{AsyncConnectionConfig, ConnectionAddr, Script, TlsCertificates, TlsMode, Value};
use tokio::time::Instant;

pub use redis;
pub use redlock::{RedlockBackend, RedlockConfig};

use conn::{map_error, Commands, SentinelMaster};
use fencelock_backend::{AcquireSpec, BoxFuture, Capabilities, FenceGuarantee, Lease, LockBackend};
use fencelock_backend::{Error, ErrorKind};
use wake::{Subscriber, Subscription, WakeSource};

/// Lua: `now` in milliseconds on the Redis server's clock (scripts may read `TIME`:
/// Redis 7 replicates a script's effects, not the script).
macro_rules! now_lua {
    () => {
        "local clock = redis.call('TIME')\n\
         local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)\n"
    };
}

/// A script: `now_lua!()` followed by the given parts.
macro_rules! concat_script {
    ($($part:expr),* $(,)?) => {
        concat!(now_lua!(), $($part),*)
    };
}

/// Takes a free mutex and draws its next fence, atomically; or reports the holder
/// (and the grant itself if the holder is this request id). KEYS: lock hash, fence
/// counter, semaphore holders. Returns `{status, token, fence, pttl}` with status
/// 2 = new grant, 1 = this request's grant, 0 = held by another, 3 = the lock is held
/// as a semaphore.
static ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat_script!(
        r#"
if redis.call('ZCOUNT', KEYS[3], '(' .. now, '+inf') > 0 then
  return {3, '', '0', 0}
end
local held = redis.call('HMGET', KEYS[1], 'token', 'fence', 'request')
if held[1] then
  local pttl = redis.call('PTTL', KEYS[1])
  if held[3] == ARGV[3] then
    return {1, held[1], held[2], pttl}
  end
  return {0, '', '0', pttl}
end
redis.call('INCR', KEYS[2])
local fence = redis.call('GET', KEYS[2])
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'fence', fence, 'request', ARGV[3], 'owner', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {2, ARGV[1], fence, tonumber(ARGV[2])}
"#
    ))
});

/// Drops a semaphore's holders whose lease ran out (at most `limit` of them), then
/// (`keep`) makes the holders set and its data live exactly as long as the last holder.
/// KEYS: holders (token → expiry ms), data (`limit`; `f:`/`q:`/`o:` + token: fence,
/// request id, owner; `r:` + request id: token).
macro_rules! semaphore_expire_lua {
    () => {
        r#"
local function forget(token)
  local request = redis.call('HGET', KEYS[2], 'q:' .. token)
  if request then
    redis.call('HDEL', KEYS[2], 'r:' .. request)
  end
  redis.call('HDEL', KEYS[2], 'f:' .. token, 'q:' .. token, 'o:' .. token)
  redis.call('ZREM', KEYS[1], token)
end
local function keep()
  local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
  if last[2] then
    local left = tonumber(last[2]) - now
    redis.call('PEXPIRE', KEYS[1], left)
    redis.call('PEXPIRE', KEYS[2], left)
  else
    redis.call('DEL', KEYS[2])
  end
end
for _, token in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do
  forget(token)
end
"#
    };
}

/// A semaphore slot: like `ACQUIRE`, for `limit` holders. KEYS: holders, data, fence
/// counter, mutex lock hash. ARGV: token, ttl ms, request id, owner, limit.
static SEMAPHORE_ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat_script!(
        semaphore_expire_lua!(),
        r#"
if redis.call('EXISTS', KEYS[4]) == 1 then
  return {3, '', '0', 0}
end
local holders = redis.call('ZCARD', KEYS[1])
if holders > 0 and redis.call('HGET', KEYS[2], 'limit') ~= ARGV[5] then
  return {3, '', '0', 0}
end
local mine = redis.call('HGET', KEYS[2], 'r:' .. ARGV[3])
if mine then
  local expiry = redis.call('ZSCORE', KEYS[1], mine)
  if expiry then
    return {1, mine, redis.call('HGET', KEYS[2], 'f:' .. mine), tonumber(expiry) - now}
  end
end
if holders >= tonumber(ARGV[5]) then
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {0, '', '0', tonumber(first[2]) - now}
end
redis.call('INCR', KEYS[3])
local fence = redis.call('GET', KEYS[3])
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('HSET', KEYS[2], 'limit', ARGV[5], 'f:' .. ARGV[1], fence, 'q:' .. ARGV[1], ARGV[3],
  'o:' .. ARGV[1], ARGV[4], 'r:' .. ARGV[3], ARGV[1])
keep()
return {2, ARGV[1], fence, tonumber(ARGV[2])}
"#
    ))
});

/// Extends the lease if the grant (mutex or semaphore slot) is still the caller's.
/// KEYS: holders, data, lock hash. ARGV: token, ttl ms.
static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat_script!(
        semaphore_expire_lua!(),
        r#"
if redis.call('HGET', KEYS[3], 'token') == ARGV[1] then
  redis.call('PEXPIRE', KEYS[3], ARGV[2])
  return 1
end
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
  keep()
  return 1
end
return 0
"#
    ))
});

/// Deletes the grant (mutex or semaphore slot) if it is still the caller's, and wakes
/// the lock's waiters. KEYS: holders, data, lock hash. ARGV: token, channel.
static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat_script!(
        semaphore_expire_lua!(),
        r#"
if redis.call('HGET', KEYS[3], 'token') == ARGV[1] then
  redis.call('DEL', KEYS[3])
  redis.call('PUBLISH', ARGV[2], 'released')
  return 1
end
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  forget(ARGV[1])
  keep()
  redis.call('PUBLISH', ARGV[2], 'released')
  return 1
end
return 0
"#
    ))
});

/// Most holders of one semaphore (as the fencelock server).
pub const MAX_SEMAPHORE_LIMIT: u32 = 1024;

/// What every mode shares: key names, timeouts, wake-ups.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RedisOptions {
    /// Prefix of every key and channel this backend uses. Default `fencelock:`.
    pub key_prefix: String,
    /// How long opening a connection may take. Default 5 s.
    pub connect_timeout: Duration,
    /// How long one call to Redis may take before it fails as `Unavailable`.
    /// Default 5 s.
    pub request_timeout: Duration,
    /// Whether waiters subscribe to releases (one extra pub/sub connection, opened on
    /// the first wait). Default on.
    pub wakeups: bool,
    /// How often a waiter tries again when it has no wake-ups. Default 100 ms.
    pub poll_interval: Duration,
    /// Most locks this backend waits on at once (pub/sub channels). Default 10 000.
    pub max_waited_locks: usize,
}

impl Default for RedisOptions {
    fn default() -> RedisOptions {
        RedisOptions {
            key_prefix: "fencelock:".to_owned(),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(5),
            wakeups: true,
            poll_interval: Duration::from_millis(100),
            max_waited_locks: 10_000,
        }
    }
}

impl RedisOptions {
    fn check(&self, cluster: bool) -> Result<(), Error> {
        if self.request_timeout.is_zero() || self.connect_timeout.is_zero() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "connect_timeout and request_timeout must be positive",
            ));
        }
        if self.poll_interval.is_zero() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "poll_interval must be positive",
            ));
        }
        if cluster && self.key_prefix.contains(['{', '}']) {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "in a cluster the key prefix must not contain '{' or '}' (the lock name is the hash tag)",
            ));
        }
        Ok(())
    }

    fn manager_config(&self) -> ConnectionManagerConfig {
        ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.connect_timeout))
            .set_response_timeout(Some(self.request_timeout))
            // Reconnecting is retried by the next call; a short burst here is enough.
            .set_number_of_retries(2)
    }

    fn connection_config(&self) -> AsyncConnectionConfig {
        AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.connect_timeout))
            .set_response_timeout(Some(self.request_timeout))
    }
}

/// How to reach one Redis server.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RedisConfig {
    /// `redis://[user:password@]host:port[/db]`, `rediss://…` for TLS, or a bare
    /// `host:port` (plain TCP).
    pub url: String,
    /// For `rediss://`: the CA to trust instead of the system's roots, and a client
    /// certificate for mutual TLS. `None`: the system's roots.
    pub tls: Option<TlsCertificates>,
    /// Key names, timeouts, wake-ups.
    pub options: RedisOptions,
}

impl RedisConfig {
    /// The defaults for the server at `url` (or `host:port`).
    pub fn new(url: impl Into<String>) -> RedisConfig {
        RedisConfig {
            url: url.into(),
            tls: None,
            options: RedisOptions::default(),
        }
    }

    /// The `redis::Client` for this server (no connection yet).
    pub fn client(&self) -> Result<redis::Client, Error> {
        install_crypto_provider();
        if self.url.is_empty() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "the redis address must not be empty",
            ));
        }
        let url = if self.url.contains("://") {
            self.url.clone()
        } else {
            format!("redis://{}", self.url)
        };
        let client = match &self.tls {
            Some(certificates) => redis::Client::build_with_tls(url, certificates.clone()),
            None => redis::Client::open(url),
        };
        client.map_err(|e| Error::new(ErrorKind::InvalidArgument, format!("redis url: {e}")))
    }
}

/// How to find a master through Redis Sentinel.
#[derive(Clone)]
#[non_exhaustive]
pub struct SentinelConfig {
    /// The name the sentinels monitor the master under.
    pub master_name: String,
    /// The sentinels, as `host:port`.
    pub sentinels: Vec<String>,
    /// TLS for the connections to the sentinels and to the master (`None`: plain TCP).
    pub tls: Option<TlsCertificates>,
    /// ACL user on the master (`None`: the default user).
    pub username: Option<String>,
    /// Password on the master.
    pub password: Option<String>,
    /// Database number on the master. Default 0.
    pub database: i64,
    /// How connections to the master are opened (timeouts, DNS resolver). Default:
    /// the timeouts of `options`.
    pub connection: AsyncConnectionConfig,
    /// Key names, timeouts, wake-ups.
    pub options: RedisOptions,
}

impl std::fmt::Debug for SentinelConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentinelConfig")
            .field("master_name", &self.master_name)
            .field("sentinels", &self.sentinels)
            .field("tls", &self.tls.is_some())
            .field("database", &self.database)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl SentinelConfig {
    /// The defaults for master `master_name` known to `sentinels` (`host:port`).
    pub fn new(master_name: impl Into<String>, sentinels: Vec<String>) -> SentinelConfig {
        let options = RedisOptions::default();
        SentinelConfig {
            master_name: master_name.into(),
            sentinels,
            tls: None,
            username: None,
            password: None,
            database: 0,
            connection: options.connection_config(),
            options,
        }
    }

    fn client(&self) -> Result<SentinelClient, Error> {
        if self.master_name.is_empty() || self.sentinels.is_empty() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "sentinel mode needs a master name and at least one sentinel",
            ));
        }
        let mut addrs = Vec::new();
        for sentinel in &self.sentinels {
            let (host, port) = sentinel
                .rsplit_once(':')
                .and_then(|(host, port)| Some((host, port.parse::<u16>().ok()?)))
                .filter(|(host, _)| !host.is_empty())
                .ok_or_else(|| {
                    Error::new(
                        ErrorKind::InvalidArgument,
                        format!("a sentinel address must be host:port, got {sentinel:?}"),
                    )
                })?;
            let host = host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned();
            addrs.push(match self.tls {
                Some(_) => ConnectionAddr::TcpTls {
                    host,
                    port,
                    insecure: false,
                    tls_params: None,
                },
                None => ConnectionAddr::Tcp(host, port),
            });
        }
        let invalid =
            |e: redis::RedisError| Error::new(ErrorKind::InvalidArgument, format!("sentinel: {e}"));
        let mut builder =
            SentinelClientBuilder::new(addrs, &self.master_name, SentinelServerType::Master)
                .map_err(invalid)?
                .set_client_to_redis_db(self.database);
        if let Some(username) = &self.username {
            builder = builder.set_client_to_redis_username(username);
        }
        if let Some(password) = &self.password {
            builder = builder.set_client_to_redis_password(password);
        }
        if let Some(certificates) = &self.tls {
            builder = builder
                .set_client_to_sentinel_tls_mode(TlsMode::Secure)
                .set_client_to_sentinel_certificates(certificates.clone())
                .set_client_to_redis_tls_mode(TlsMode::Secure)
                .set_client_to_redis_certificates(certificates.clone());
        }
        builder.build().map_err(invalid)
    }
}

/// How to reach a Redis Cluster.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ClusterConfig {
    /// Some of its nodes, as URLs (`redis://host:port`, `rediss://…`) or `host:port`;
    /// the rest is discovered. The first also carries the wake-up subscription.
    pub nodes: Vec<String>,
    /// For `rediss://`: the CA to trust and an optional client certificate.
    pub tls: Option<TlsCertificates>,
    /// Key names, timeouts, wake-ups.
    pub options: RedisOptions,
}

impl ClusterConfig {
    /// The defaults for the cluster reached through `nodes`.
    pub fn new(nodes: Vec<String>) -> ClusterConfig {
        ClusterConfig {
            nodes,
            tls: None,
            options: RedisOptions::default(),
        }
    }
}

/// Redis as a [`LockBackend`]: one server, the master of a Sentinel deployment, or a
/// Redis Cluster (see the [crate docs](crate) for what each guarantees).
///
/// Cheap to share behind an `Arc`: every call goes over the same multiplexed
/// connection(s). A failed connection fails the call as `Unavailable` and is opened
/// again for the next.
#[derive(Debug)]
pub struct RedisBackend {
    instance: Instance,
    fences: FenceGuarantee,
    mode: &'static str,
}

impl RedisBackend {
    /// Connects to the server at `config.url` (failing as `Unavailable` if it cannot be
    /// reached) and reads its persistence settings to decide how strong its fences are.
    pub async fn connect(config: RedisConfig) -> Result<RedisBackend, Error> {
        install_crypto_provider();
        let instance = Instance::lazy(&config)?;
        let fences = instance.fence_guarantee().await?;
        Ok(RedisBackend {
            instance,
            fences,
            mode: "redis",
        })
    }

    /// Uses the application's `client`: opens one `ConnectionManager` from it for
    /// commands and, when needed, one pub/sub connection for wake-ups.
    pub async fn from_client(
        client: redis::Client,
        options: RedisOptions,
    ) -> Result<RedisBackend, Error> {
        install_crypto_provider();
        options.check(false)?;
        let manager = bounded_connect(
            options.connect_timeout,
            ConnectionManager::new_with_config(client.clone(), options.manager_config()),
        )
        .await?;
        RedisBackend::from_connection_manager(manager, Some(client), options).await
    }

    /// Uses the application's `manager` for every command (the backend opens no
    /// connection for commands). `wakeups`: a client of the same server to open the
    /// pub/sub connection from; `None` opens none, and waiters poll (see the
    /// [crate docs](crate)).
    pub async fn from_connection_manager(
        manager: ConnectionManager,
        wakeups: Option<redis::Client>,
        options: RedisOptions,
    ) -> Result<RedisBackend, Error> {
        install_crypto_provider();
        options.check(false)?;
        let source = match wakeups {
            Some(client) if options.wakeups => WakeSource::Client(Box::new(client)),
            _ => WakeSource::Off,
        };
        let instance = Instance::new(
            Commands::Manager(manager),
            source,
            Keys::plain(&options),
            &options,
        );
        let fences = instance.fence_guarantee().await?;
        Ok(RedisBackend {
            instance,
            fences,
            mode: "redis",
        })
    }

    /// Finds the master through the sentinels in `config` and connects to it. Fences
    /// are best-effort: a failover can lose the last grants.
    pub async fn sentinel(config: SentinelConfig) -> Result<RedisBackend, Error> {
        install_crypto_provider();
        let client = config.client()?;
        RedisBackend::from_sentinel_client(client, config.connection, config.options).await
    }

    /// Uses the application's `SentinelClient` (which must name the master, not a
    /// replica) to find the master; connections to it are opened with `connection`.
    pub async fn from_sentinel_client(
        sentinel: SentinelClient,
        connection: AsyncConnectionConfig,
        options: RedisOptions,
    ) -> Result<RedisBackend, Error> {
        install_crypto_provider();
        options.check(false)?;
        let master = Arc::new(SentinelMaster::new(sentinel, connection));
        let source = if options.wakeups {
            WakeSource::Sentinel(master.clone())
        } else {
            WakeSource::Off
        };
        let instance = Instance::new(
            Commands::Sentinel(master),
            source,
            Keys::plain(&options),
            &options,
        );
        instance.ping().await?;
        Ok(RedisBackend {
            instance,
            fences: FenceGuarantee::BestEffort,
            mode: "redis-sentinel",
        })
    }

    /// Connects to the Redis Cluster reached through `config.nodes`. Fences are
    /// best-effort: a failover can lose the last grants.
    pub async fn cluster(config: ClusterConfig) -> Result<RedisBackend, Error> {
        install_crypto_provider();
        let first = config.nodes.first().ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidArgument,
                "cluster mode needs at least one node",
            )
        })?;
        let urls: Vec<String> = config
            .nodes
            .iter()
            .map(|n| {
                if n.contains("://") {
                    n.clone()
                } else {
                    format!("redis://{n}")
                }
            })
            .collect();
        let invalid =
            |e: redis::RedisError| Error::new(ErrorKind::InvalidArgument, format!("cluster: {e}"));
        let mut builder = ClusterClientBuilder::new(urls)
            .connection_timeout(config.options.connect_timeout)
            .response_timeout(config.options.request_timeout);
        if let Some(certificates) = &config.tls {
            builder = builder.certs(certificates.clone());
        }
        let client = builder.build().map_err(invalid)?;
        let mut first = RedisConfig::new(first.clone());
        first.tls = config.tls.clone();
        let wakeups = first.client()?;
        RedisBackend::from_cluster_client(client, Some(wakeups), config.options).await
    }

    /// Uses the application's `ClusterClient`. `wakeups`: a client of any one node to
    /// open the pub/sub connection from (a `PUBLISH` reaches every node); `None` opens
    /// none, and waiters poll.
    pub async fn from_cluster_client(
        client: ClusterClient,
        wakeups: Option<redis::Client>,
        options: RedisOptions,
    ) -> Result<RedisBackend, Error> {
        install_crypto_provider();
        options.check(true)?;
        let connection =
            bounded_connect(options.connect_timeout, client.get_async_connection()).await?;
        let source = match wakeups {
            Some(client) if options.wakeups => WakeSource::Client(Box::new(client)),
            _ => WakeSource::Off,
        };
        let instance = Instance::new(
            Commands::Cluster(connection),
            source,
            Keys::tagged(&options),
            &options,
        );
        instance.ping().await?;
        Ok(RedisBackend {
            instance,
            fences: FenceGuarantee::BestEffort,
            mode: "redis-cluster",
        })
    }
}

async fn bounded_connect<T>(
    timeout: Duration,
    connecting: impl std::future::Future<Output = Result<T, redis::RedisError>>,
) -> Result<T, Error> {
    match tokio::time::timeout(timeout, connecting).await {
        Ok(result) => result.map_err(map_error),
        Err(_) => Err(Error::new(
            ErrorKind::Unavailable,
            format!("could not connect to redis within {timeout:?}"),
        )),
    }
}

impl LockBackend for RedisBackend {
    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::new(self.mode, self.fences);
        caps.push_wakeups = self.instance.subscriber.enabled();
        caps.semaphores = true;
        caps
    }

    fn acquire<'a>(&'a self, spec: &'a AcquireSpec) -> BoxFuture<'a, Result<Lease, Error>> {
        Box::pin(async move {
            check_spec(spec, MAX_SEMAPHORE_LIMIT)?;
            let deadline = Instant::now() + spec.wait;
            let token = new_token();
            let instance = &self.instance;
            let channel = instance.keys.channel(&spec.name);
            let wakeups = instance.subscriber.enabled() && !spec.wait.is_zero();
            let mut subscription: Option<Subscription> = None;
            // Bounded by the deadline: every turn either returns or sleeps until a
            // release, the holder's expiry, a poll, or the deadline.
            loop {
                if wakeups && subscription.as_ref().is_none_or(Subscription::is_dead) {
                    // A dead subscription is given back before subscribing again.
                    drop(subscription.take());
                    let left = deadline.saturating_duration_since(Instant::now());
                    let timeout = left.min(instance.request_timeout);
                    match instance.subscriber.subscribe(&channel, timeout).await {
                        Ok(s) => subscription = Some(s),
                        Err(_) if Instant::now() >= deadline => {
                            return Err(not_granted(spec));
                        }
                        // The pub/sub server may be down while the one holding the
                        // lock is not (a cluster node): poll this turn, subscribe
                        // again on the next.
                        Err(e) if e.kind() == ErrorKind::Unavailable => {}
                        Err(e) => return Err(e),
                    }
                }
                let pttl = match instance.try_acquire(spec, &token).await? {
                    Attempt::Granted(grant) => return Ok(grant.into_lease(spec)),
                    Attempt::Held { pttl } => pttl,
                };
                let now = Instant::now();
                if now >= deadline {
                    return Err(not_granted(spec));
                }
                let left = deadline - now;
                let mut nap = pttl.map_or(left, |p| p.min(left));
                match subscription.as_mut() {
                    Some(s) => {
                        tokio::select! {
                            _ = tokio::time::sleep(nap) => {}
                            _ = s.changed() => {}
                        }
                    }
                    None => {
                        nap = nap.min(instance.poll_interval);
                        tokio::time::sleep(nap).await;
                    }
                }
            }
        })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Duration, Error>> {
        Box::pin(async move {
            check_ttl(ttl)?;
            if self.instance.renew(lease, ttl).await? {
                Ok(ttl)
            } else {
                Err(gone(&lease.name))
            }
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move { self.instance.release(lease).await })
    }
}

/// The checks every Redis acquire makes before touching the store; `max_limit` 1 for
/// a backend without semaphores.
fn check_spec(spec: &AcquireSpec, max_limit: u32) -> Result<(), Error> {
    spec.validate()?;
    if spec.mode != fencelock_backend::LockMode::Exclusive {
        // Never granted as exclusive instead: see "Reader-writer locks and elections"
        // in the crate docs for why Redis has neither.
        return Err(Error::new(
            ErrorKind::Unsupported,
            "the redis backends have no shared (reader) locks (see their Capabilities)",
        ));
    }
    if spec.limit > max_limit {
        let message = if max_limit == 1 {
            format!(
                "redlock has no semaphores: limit must be 1, got {}",
                spec.limit
            )
        } else {
            format!("limit must be at most {max_limit}, got {}", spec.limit)
        };
        return Err(Error::new(ErrorKind::InvalidArgument, message));
    }
    if !spec.lock_delay.is_zero() {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            "the redis backend has no lock-delay: lock_delay must be zero",
        ));
    }
    Ok(())
}

fn check_ttl(ttl: Duration) -> Result<(), Error> {
    if ttl < Duration::from_millis(1) || ttl > fencelock_backend::MAX_TTL {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("ttl must be between 1ms and 24h, got {ttl:?}"),
        ));
    }
    Ok(())
}

fn not_granted(spec: &AcquireSpec) -> Error {
    if spec.wait.is_zero() {
        Error::new(ErrorKind::Held, format!("lock {:?} is held", spec.name))
    } else {
        Error::new(
            ErrorKind::Timeout,
            format!("lock {:?} not granted within {:?}", spec.name, spec.wait),
        )
    }
}

fn gone(name: &str) -> Error {
    Error::new(
        ErrorKind::NotHeld,
        format!("the grant of {name:?} is no longer held (released or expired)"),
    )
}

/// A fresh owner token: 128 random bits, as 32 hex digits.
fn new_token() -> String {
    fencelock_backend::request_id()
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A grant as one instance reported it.
#[derive(Debug, Clone)]
struct Grant {
    token: String,
    fence: u64,
    /// What is left of the lease on the instance (the full ttl for a new grant).
    remaining: Duration,
}

impl Grant {
    fn into_lease(self, spec: &AcquireSpec) -> Lease {
        Lease::new(spec.name.clone(), self.fence, self.token, self.remaining)
    }
}

/// One attempt's outcome on one instance.
#[derive(Debug, Clone)]
enum Attempt {
    Granted(Grant),
    /// Held by another request; its remaining lease if it has one.
    Held {
        pttl: Option<Duration>,
    },
}

/// The names of a lock's keys and channel.
#[derive(Debug, Clone)]
struct Keys {
    prefix: String,
    /// Cluster: the name is a hash tag, so all keys of a lock share a slot.
    tagged: bool,
}

impl Keys {
    fn plain(options: &RedisOptions) -> Keys {
        Keys {
            prefix: options.key_prefix.clone(),
            tagged: false,
        }
    }

    fn tagged(options: &RedisOptions) -> Keys {
        Keys {
            prefix: options.key_prefix.clone(),
            tagged: true,
        }
    }

    fn key(&self, kind: &str, name: &str) -> String {
        if self.tagged {
            // `}` would end the tag inside the name, and an empty tag hashes the whole
            // key; escaping keeps the tag exactly the (non-empty) name, injectively.
            let tag = name.replace('%', "%25").replace('}', "%7D");
            format!("{}{kind}:{{{tag}}}", self.prefix)
        } else {
            format!("{}{kind}:{name}", self.prefix)
        }
    }

    fn lock(&self, name: &str) -> String {
        self.key("lock", name)
    }

    fn fence(&self, name: &str) -> String {
        self.key("fence", name)
    }

    fn holders(&self, name: &str) -> String {
        self.key("sem", name)
    }

    fn holders_data(&self, name: &str) -> String {
        self.key("sem-data", name)
    }

    fn channel(&self, name: &str) -> String {
        format!("{}wake:{name}", self.prefix)
    }
}

/// One Redis deployment: its command path, its wake-ups and key names.
#[derive(Debug)]
struct Instance {
    commands: Commands,
    subscriber: Subscriber,
    keys: Keys,
    request_timeout: Duration,
    poll_interval: Duration,
}

impl Instance {
    fn new(commands: Commands, source: WakeSource, keys: Keys, options: &RedisOptions) -> Instance {
        Instance {
            commands,
            subscriber: Subscriber::new(source, options.max_waited_locks),
            keys,
            request_timeout: options.request_timeout,
            poll_interval: options.poll_interval,
        }
    }

    /// A server from its URL, connected on first use (a Redlock instance may be down
    /// when the Redlock is built).
    fn lazy(config: &RedisConfig) -> Result<Instance, Error> {
        config.options.check(false)?;
        let client = config.client()?;
        let manager = ConnectionManager::new_lazy_with_config(
            client.clone(),
            config.options.manager_config(),
        )
        .map_err(map_error)?;
        let source = if config.options.wakeups {
            WakeSource::Client(Box::new(client))
        } else {
            WakeSource::Off
        };
        Ok(Instance::new(
            Commands::Manager(manager),
            source,
            Keys::plain(&config.options),
            &config.options,
        ))
    }

    async fn ping(&self) -> Result<(), Error> {
        let _: String = self
            .commands
            .command(&redis::cmd("PING"), self.request_timeout)
            .await?;
        Ok(())
    }

    /// One attempt: a grant (new, or this request's earlier one) or the holder's PTTL.
    async fn try_acquire(&self, spec: &AcquireSpec, token: &str) -> Result<Attempt, Error> {
        let keys = &self.keys;
        let (lock, fence) = (keys.lock(&spec.name), keys.fence(&spec.name));
        let holders = keys.holders(&spec.name);
        let reply: (i64, String, String, i64) = if spec.limit == 1 {
            let mut call = ACQUIRE.prepare_invoke();
            call.key(&lock).key(&fence).key(&holders);
            call.arg(token)
                .arg(ms(spec.ttl))
                .arg(&spec.request_id)
                .arg(&spec.owner);
            self.commands.script(&call, self.request_timeout).await?
        } else {
            let data = keys.holders_data(&spec.name);
            let mut call = SEMAPHORE_ACQUIRE.prepare_invoke();
            call.key(&holders).key(&data).key(&fence).key(&lock);
            call.arg(token)
                .arg(ms(spec.ttl))
                .arg(&spec.request_id)
                .arg(&spec.owner)
                .arg(spec.limit);
            self.commands.script(&call, self.request_timeout).await?
        };
        let (status, token, fence, pttl) = reply;
        // PTTL: -2 no key (cannot happen inside the script), -1 no expiry (someone
        // else's PERSIST): then only a release or the wait's end wakes a waiter.
        let remaining = u64::try_from(pttl).ok().map(Duration::from_millis);
        match status {
            3 => Err(Error::new(
                ErrorKind::LimitMismatch,
                format!(
                    "{:?} is held with another limit than {}",
                    spec.name, spec.limit
                ),
            )),
            0 => Ok(Attempt::Held {
                pttl: remaining.map(|p| p.max(Duration::from_millis(1))),
            }),
            1 | 2 => {
                let fence = fence.parse::<u64>().map_err(|_| {
                    Error::new(
                        ErrorKind::Protocol,
                        "a fence stored in redis is not a number",
                    )
                })?;
                Ok(Attempt::Granted(Grant {
                    token,
                    fence,
                    remaining: remaining.unwrap_or(spec.ttl).min(spec.ttl),
                }))
            }
            other => Err(Error::new(
                ErrorKind::Protocol,
                format!("the acquire script answered status {other}"),
            )),
        }
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<bool, Error> {
        let keys = &self.keys;
        let mut call = RENEW.prepare_invoke();
        call.key(keys.holders(&lease.name))
            .key(keys.holders_data(&lease.name))
            .key(keys.lock(&lease.name));
        call.arg(&lease.owner_token).arg(ms(ttl));
        let renewed: i64 = self.commands.script(&call, self.request_timeout).await?;
        Ok(renewed == 1)
    }

    async fn release(&self, lease: &Lease) -> Result<bool, Error> {
        let keys = &self.keys;
        let mut call = RELEASE.prepare_invoke();
        call.key(keys.holders(&lease.name))
            .key(keys.holders_data(&lease.name))
            .key(keys.lock(&lease.name));
        call.arg(&lease.owner_token).arg(keys.channel(&lease.name));
        let released: i64 = self.commands.script(&call, self.request_timeout).await?;
        Ok(released == 1)
    }

    /// One `CONFIG GET` value; `None` if CONFIG is unavailable (renamed, forbidden).
    async fn config_get(&self, parameter: &str) -> Result<Option<String>, Error> {
        let mut command = redis::cmd("CONFIG");
        command.arg("GET").arg(parameter);
        let reply: Value = match self.commands.command(&command, self.request_timeout).await {
            Ok(reply) => reply,
            Err(e) if e.is_transient() => return Err(e),
            Err(_) => return Ok(None),
        };
        let text = |v: &Value| match v {
            Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
            Value::SimpleString(text) => Some(text.clone()),
            _ => None,
        };
        Ok(match &reply {
            Value::Array(items) => items.get(1).and_then(text),
            Value::Map(pairs) => pairs.first().and_then(|(_, v)| text(v)),
            _ => None,
        })
    }

    /// `Durable` only if the server says every acknowledged write is fsync'd and the
    /// fence counter cannot be evicted or lost to a failover (see the crate docs).
    async fn fence_guarantee(&self) -> Result<FenceGuarantee, Error> {
        let aof = self.config_get("appendonly").await?;
        let fsync = self.config_get("appendfsync").await?;
        let policy = self.config_get("maxmemory-policy").await?;
        let mut info = redis::cmd("INFO");
        info.arg("replication");
        let replication: String = self.commands.command(&info, self.request_timeout).await?;
        let lone_primary = replication.lines().any(|l| l.trim() == "role:master")
            && replication
                .lines()
                .any(|l| l.trim() == "connected_slaves:0");
        let durable = aof.as_deref() == Some("yes")
            && fsync.as_deref() == Some("always")
            && policy.is_some_and(|p| !p.starts_with("allkeys"))
            && lone_primary;
        Ok(if durable {
            FenceGuarantee::Durable
        } else {
            FenceGuarantee::BestEffort
        })
    }
}

/// Makes ring rustls's process-wide default unless one is installed. The `redis` crate's
/// TLS takes the process default, and with a second provider compiled into the program
/// (another crate turning on aws-lc-rs) rustls would refuse to pick one and panic.
pub(crate) fn install_crypto_provider() {
    // An error means a provider is already installed, which is as good.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

#[cfg(test)]
mod tests {
    use super::{Keys, RedisOptions};

    /// Cluster keys: every key of a lock carries the same non-empty hash tag, and
    /// names that differ only in braces or `%` get different tags.
    #[test]
    fn cluster_keys_share_one_tag_per_name() {
        let keys = Keys::tagged(&RedisOptions::default());
        let tag = |key: &str| {
            let start = key.find('{').expect("a tag") + 1;
            let end = start + key[start..].find('}').expect("a closed tag");
            key[start..end].to_owned()
        };
        let names = ["job", "}", "a}b", "a%7Db", "{x}", "%", "a%b"];
        let mut tags = Vec::new();
        for name in names {
            let lock = tag(&keys.lock(name));
            assert!(!lock.is_empty(), "{name:?}: empty tag");
            for other in [
                keys.fence(name),
                keys.holders(name),
                keys.holders_data(name),
            ] {
                assert_eq!(tag(&other), lock, "{name:?}: keys in different slots");
            }
            tags.push(lock);
        }
        tags.sort_unstable();
        tags.dedup();
        assert_eq!(tags.len(), names.len(), "two names share a tag: {tags:?}");
        let plain = Keys::plain(&RedisOptions::default());
        assert_eq!(plain.lock("job"), "fencelock:lock:job");
        assert_eq!(keys.lock("job"), "fencelock:lock:{job}");
    }
}
