//! Locks on Redis: a single instance ([`RedisBackend`]) or Redlock over several
//! independent instances ([`RedlockBackend`]). Behind the cargo feature `redis`.
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//! use fencelock::redis::{RedisBackend, RedisConfig};
//! use fencelock::Client;
//!
//! # async fn demo() -> Result<(), fencelock::Error> {
//! let backend = RedisBackend::connect(RedisConfig::new("127.0.0.1:6379")).await?;
//! let client = Client::from_backend(Arc::new(backend));
//! let guard = client.lock("job:nightly").ttl(Duration::from_secs(30)).acquire().await?;
//! println!("fence {}", guard.fence());
//! guard.release().await?;
//! # Ok(()) }
//! ```
//!
//! The client speaks RESP2 itself (no Redis crate): plain TCP, optional `AUTH` and
//! `SELECT`; no TLS, and no Redis Cluster (a lock's keys may live in different
//! slots) or Sentinel discovery.
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
//! A waiter subscribes to that channel *before* each attempt (on one pub/sub
//! connection per backend, shared by all its waits), then sleeps until a release is
//! published or the holder's remaining `PTTL` runs out (an expiry publishes nothing),
//! and tries again — all within the request's `wait`. Waiters are not queued: whoever
//! tries first after a release wins (no FIFO).
//!
//! # What Redis cannot promise
//!
//! - **Fences are best-effort.** A restart without the data (no persistence, or
//!   `appendfsync everysec`/`no` losing the last second), a failover to a replica that
//!   had not received the last writes (replication is asynchronous), or an eviction of
//!   the counter (`maxmemory-policy allkeys-*`) can hand out a fence again. The backend
//!   reports [`FenceGuarantee::Durable`] only if, when it connected, the server said
//!   `appendonly yes`, `appendfsync always`, a `maxmemory-policy` that cannot evict a
//!   key without expiry, and that it is a primary without replicas; if `CONFIG` is
//!   unavailable (renamed, forbidden) it reports `BestEffort`. Settings changed later
//!   are not noticed.
//! - **Leases follow the Redis server's wall clock.** Redis stores expiries as absolute
//!   Unix times, so a clock step on the Redis host (NTP, an operator) expires leases
//!   early or late (`monotonic_leases: false`). Only fences protect the resource then.
//! - **No FIFO, no lock-delay, no sessions:** a non-zero `lock_delay` is refused with
//!   `InvalidArgument`.
//! - Single instance means a single point of failure: while Redis is unreachable every
//!   call fails with `Unavailable` (each call reconnects), and holders lose their locks
//!   when their leases run out.

mod pubsub;
mod redlock;
mod resp;

use std::time::Duration;

use tokio::time::Instant;

pub use redlock::{RedlockBackend, RedlockConfig};

use fencelock_backend::{AcquireSpec, BoxFuture, Capabilities, FenceGuarantee, Lease, LockBackend};
use fencelock_backend::{Error, ErrorKind};
use pubsub::{Subscriber, Subscription};
use resp::{Endpoint, Pool, Reply, Script};

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
static ACQUIRE: Script = Script {
    source: concat_script!(
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
    ),
};

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
static SEMAPHORE_ACQUIRE: Script = Script {
    source: concat_script!(
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
    ),
};

/// Extends the lease if the grant (mutex or semaphore slot) is still the caller's.
/// KEYS: holders, data, lock hash. ARGV: token, ttl ms.
static RENEW: Script = Script {
    source: concat_script!(
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
    ),
};

/// Deletes the grant (mutex or semaphore slot) if it is still the caller's, and wakes
/// the lock's waiters. KEYS: holders, data, lock hash. ARGV: token, channel.
static RELEASE: Script = Script {
    source: concat_script!(
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
    ),
};

/// Most holders of one semaphore (as the fencelock server).
pub const MAX_SEMAPHORE_LIMIT: u32 = 1024;

/// How to reach one Redis server.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RedisConfig {
    /// `host:port` of the server.
    pub addr: String,
    /// ACL user name (`AUTH user password`); `None` for the default user.
    pub username: Option<String>,
    /// Password, if the server requires one.
    pub password: Option<String>,
    /// Database number (`SELECT`). Default 0.
    pub database: u32,
    /// Prefix of every key and channel this backend uses. Default `fencelock:`.
    pub key_prefix: String,
    /// How long a TCP connection (and its `AUTH`/`SELECT`) may take. Default 5 s.
    pub connect_timeout: Duration,
    /// How long one command may take before the call fails as `Unavailable` and its
    /// connection is dropped. Default 5 s.
    pub request_timeout: Duration,
    /// Most connections open at once for commands (the pub/sub connection aside).
    /// Default 32.
    pub max_connections: usize,
    /// Most locks this backend waits on at once (pub/sub channels). Default 10 000.
    pub max_waited_locks: usize,
}

impl RedisConfig {
    /// The defaults for the server at `addr` (`host:port`).
    pub fn new(addr: impl Into<String>) -> RedisConfig {
        RedisConfig {
            addr: addr.into(),
            username: None,
            password: None,
            database: 0,
            key_prefix: "fencelock:".to_owned(),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(5),
            max_connections: 32,
            max_waited_locks: 10_000,
        }
    }

    fn endpoint(&self) -> Endpoint {
        Endpoint {
            addr: self.addr.clone(),
            username: self.username.clone(),
            password: self.password.clone(),
            database: self.database,
            connect_timeout: self.connect_timeout,
            request_timeout: self.request_timeout,
        }
    }
}

/// One Redis server as a [`LockBackend`] (see the [module docs](self) for the
/// guarantees).
///
/// Cheap to share behind an `Arc`; calls from many tasks use a bounded pool of
/// connections. A failed connection is dropped (the call fails as `Unavailable`) and
/// the next call connects again.
#[derive(Debug)]
pub struct RedisBackend {
    instance: Instance,
    fences: FenceGuarantee,
}

impl RedisBackend {
    /// Connects to the server (failing as `Unavailable` if it cannot be reached) and
    /// reads its persistence settings to decide how strong its fences are.
    pub async fn connect(config: RedisConfig) -> Result<RedisBackend, Error> {
        let instance = Instance::new(&config)?;
        let fences = instance.fence_guarantee().await?;
        Ok(RedisBackend { instance, fences })
    }
}

impl LockBackend for RedisBackend {
    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::new("redis", self.fences);
        caps.push_wakeups = true;
        caps.semaphores = true;
        caps
    }

    fn acquire<'a>(&'a self, spec: &'a AcquireSpec) -> BoxFuture<'a, Result<Lease, Error>> {
        Box::pin(async move {
            check_spec(spec, MAX_SEMAPHORE_LIMIT)?;
            let deadline = Instant::now() + spec.wait;
            let token = new_token();
            let channel = self.instance.channel(&spec.name);
            let mut subscription: Option<Subscription> = None;
            // Bounded by the deadline: every turn either returns or sleeps until a
            // release, the holder's expiry, or the deadline.
            loop {
                if !spec.wait.is_zero() && subscription.as_ref().is_none_or(Subscription::is_dead) {
                    // A dead subscription is given back before subscribing again.
                    drop(subscription.take());
                    let left = deadline.saturating_duration_since(Instant::now());
                    let timeout = left.min(self.instance.pool.endpoint().request_timeout);
                    match self.instance.subscriber.subscribe(&channel, timeout).await {
                        Ok(s) => subscription = Some(s),
                        Err(_) if Instant::now() >= deadline => {
                            return Err(not_granted(spec));
                        }
                        Err(e) => return Err(e),
                    }
                }
                let pttl = match self.instance.try_acquire(spec, &token).await? {
                    Attempt::Granted(grant) => return Ok(grant.into_lease(spec)),
                    Attempt::Held { pttl } => pttl,
                };
                let now = Instant::now();
                if now >= deadline {
                    return Err(not_granted(spec));
                }
                let left = deadline - now;
                let nap = pttl.map_or(left, |p| p.min(left));
                match subscription.as_mut() {
                    Some(s) => {
                        tokio::select! {
                            _ = tokio::time::sleep(nap) => {}
                            _ = s.changed() => {}
                        }
                    }
                    None => tokio::time::sleep(nap).await,
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

fn ms(d: Duration) -> String {
    d.as_millis().to_string()
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

/// One Redis server: its command pool, its pub/sub connection and key names.
#[derive(Debug)]
struct Instance {
    pool: Pool,
    subscriber: Subscriber,
    prefix: String,
}

impl Instance {
    fn new(config: &RedisConfig) -> Result<Instance, Error> {
        if config.addr.is_empty() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "the redis address must not be empty",
            ));
        }
        Ok(Instance {
            pool: Pool::new(config.endpoint(), config.max_connections),
            subscriber: Subscriber::new(config.endpoint(), config.max_waited_locks.max(1)),
            prefix: config.key_prefix.clone(),
        })
    }

    fn lock_key(&self, name: &str) -> Vec<u8> {
        format!("{}lock:{name}", self.prefix).into_bytes()
    }

    fn fence_key(&self, name: &str) -> Vec<u8> {
        format!("{}fence:{name}", self.prefix).into_bytes()
    }

    fn holders_key(&self, name: &str) -> Vec<u8> {
        format!("{}sem:{name}", self.prefix).into_bytes()
    }

    fn holders_data_key(&self, name: &str) -> Vec<u8> {
        format!("{}sem-data:{name}", self.prefix).into_bytes()
    }

    fn channel(&self, name: &str) -> Vec<u8> {
        format!("{}wake:{name}", self.prefix).into_bytes()
    }

    /// One attempt: a grant (new, or this request's earlier one) or the holder's PTTL.
    async fn try_acquire(&self, spec: &AcquireSpec, token: &str) -> Result<Attempt, Error> {
        let ttl_ms = ms(spec.ttl);
        let limit = spec.limit.to_string();
        let (lock, fence) = (self.lock_key(&spec.name), self.fence_key(&spec.name));
        let holders = self.holders_key(&spec.name);
        let args: [&[u8]; 5] = [
            token.as_bytes(),
            ttl_ms.as_bytes(),
            spec.request_id.as_bytes(),
            spec.owner.as_bytes(),
            limit.as_bytes(),
        ];
        let reply = if spec.limit == 1 {
            let keys: [&[u8]; 3] = [&lock, &fence, &holders];
            self.pool.eval(&ACQUIRE, &keys, &args[..4]).await?
        } else {
            let data = self.holders_data_key(&spec.name);
            let keys: [&[u8]; 4] = [&holders, &data, &fence, &lock];
            self.pool.eval(&SEMAPHORE_ACQUIRE, &keys, &args).await?
        };
        let items = reply.into_array()?;
        let [status, token, fence, pttl] = items.as_slice() else {
            return Err(Error::new(
                ErrorKind::Protocol,
                "the acquire script answered the wrong number of values",
            ));
        };
        let pttl = pttl.as_int()?;
        // PTTL: -2 no key (cannot happen inside the script), -1 no expiry (someone
        // else's PERSIST): then only a release or the wait's end wakes a waiter.
        let remaining = u64::try_from(pttl).ok().map(Duration::from_millis);
        match status.as_int()? {
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
                let fence = fence.as_text()?.parse::<u64>().map_err(|_| {
                    Error::new(
                        ErrorKind::Protocol,
                        "a fence stored in redis is not a number",
                    )
                })?;
                Ok(Attempt::Granted(Grant {
                    token: token.as_text()?.to_owned(),
                    fence,
                    remaining: remaining.unwrap_or(spec.ttl).min(spec.ttl),
                }))
            }
            _ => Err(resp::unexpected("status 0, 1, 2 or 3", status)),
        }
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<bool, Error> {
        let ttl_ms = ms(ttl);
        let reply = self
            .pool
            .eval(
                &RENEW,
                &[
                    &self.holders_key(&lease.name),
                    &self.holders_data_key(&lease.name),
                    &self.lock_key(&lease.name),
                ],
                &[lease.owner_token.as_bytes(), ttl_ms.as_bytes()],
            )
            .await?;
        Ok(reply.as_int()? == 1)
    }

    async fn release(&self, lease: &Lease) -> Result<bool, Error> {
        let reply = self
            .pool
            .eval(
                &RELEASE,
                &[
                    &self.holders_key(&lease.name),
                    &self.holders_data_key(&lease.name),
                    &self.lock_key(&lease.name),
                ],
                &[lease.owner_token.as_bytes(), &self.channel(&lease.name)],
            )
            .await?;
        Ok(reply.as_int()? == 1)
    }

    /// One `CONFIG GET` value; `None` if CONFIG is unavailable.
    async fn config_get(&self, parameter: &str) -> Result<Option<String>, Error> {
        let reply = self
            .pool
            .command(&[b"CONFIG", b"GET", parameter.as_bytes()])
            .await?;
        Ok(match reply {
            Reply::Array(Some(items)) => items
                .get(1)
                .and_then(|v| v.as_text().ok())
                .map(str::to_owned),
            // Renamed or forbidden (NOPERM): we cannot tell, so we do not claim it.
            _ => None,
        })
    }

    /// `Durable` only if the server says every acknowledged write is fsync'd and the
    /// fence counter cannot be evicted or lost to a failover (see the module docs).
    async fn fence_guarantee(&self) -> Result<FenceGuarantee, Error> {
        let aof = self.config_get("appendonly").await?;
        let fsync = self.config_get("appendfsync").await?;
        let policy = self.config_get("maxmemory-policy").await?;
        let replication = match self.pool.command(&[b"INFO", b"replication"]).await? {
            Reply::Bulk(Some(text)) => String::from_utf8_lossy(&text).into_owned(),
            _ => String::new(),
        };
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
