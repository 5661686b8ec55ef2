//! Redlock: one lock over N independent Redis servers, held while a majority holds it.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use tokio::task::JoinSet;
use tokio::time::Instant;

use redis::Script;

use super::wake::Subscription;
use super::RedisConfig;
use super::{check_spec, check_ttl, gone, new_token, not_granted, Attempt, Instance};
use fencelock_backend::{AcquireSpec, BoxFuture, Capabilities, FenceGuarantee, Lease, LockBackend};
use fencelock_backend::{Error, ErrorKind};

/// Raises an instance's fence counter to the grant's fence and records it in the
/// grant — only while the caller still holds the lock there, in the same script.
static WRITE_BACK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then
  return 0
end
local counter = tonumber(redis.call('GET', KEYS[2]) or '0')
if counter < tonumber(ARGV[2]) then
  redis.call('SET', KEYS[2], ARGV[2])
end
redis.call('HSET', KEYS[1], 'fence', ARGV[2])
return 1
"#,
    )
});

/// Requests remembered for idempotent retries (see [`RedlockBackend`]).
const MAX_REMEMBERED: usize = 4096;
/// Most instances one Redlock may span.
const MAX_INSTANCES: usize = 15;

/// The instances of a Redlock and how long each may take to answer.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RedlockConfig {
    /// The independent Redis servers (an odd number, typically 3 or 5). Each entry's
    /// own timeouts and limits apply to its connections.
    pub instances: Vec<RedisConfig>,
    /// How long one instance may take to answer one step of an acquire, renew or
    /// release before it counts as failed for that step. Keep it well below the ttl:
    /// it is spent out of the lease. Default 250 ms.
    pub instance_timeout: Duration,
    /// Upper bound of the random pause before retrying after an attempt that failed
    /// because contenders split the instances between them. Default 50 ms.
    pub retry_jitter: Duration,
}

impl RedlockConfig {
    /// The defaults for `instances`.
    pub fn new(instances: Vec<RedisConfig>) -> RedlockConfig {
        RedlockConfig {
            instances,
            instance_timeout: Duration::from_millis(250),
            retry_jitter: Duration::from_millis(50),
        }
    }
}

/// The Redlock algorithm over independent Redis servers, as a [`LockBackend`].
///
/// # How it works
///
/// An attempt runs the single-instance acquire script on every instance at once, each
/// bounded by `instance_timeout`. It succeeds if a majority (N/2+1) granted it and
/// time is left: the lease reported is the **validity**
/// `min(remaining lease on those instances) − elapsed − drift`, with
/// `drift = ttl/100 + 2 ms`, which must be positive. Otherwise the attempt releases
/// its grant on *every* instance (including those that did not answer in time) and,
/// if another holder was seen, waits — for a release published on any instance, or
/// the earliest remaining `PTTL` — and tries again within `wait`. If no holder was
/// seen (instances down or slow), the acquire fails as `Unavailable`. Renew extends
/// the lease on every instance and succeeds with `ttl − elapsed − drift` if a majority
/// renewed in time; release deletes it everywhere.
///
/// # Fences
///
/// Each instance counts fences on its own, so the largest of one majority's counters
/// can be smaller than a fence an earlier grant took from another majority. To make
/// fences increase anyway, an acquire takes the largest fence of its majority, `f`,
/// and writes it back (`counter = max(counter, f)`, recorded in the grant too) on
/// every instance *where it still holds the lock, in the same script*, and returns
/// only if a majority took the write-back. A later grant needs a majority, so it
/// shares an instance with that write-back majority; there it could only take the
/// lock after this grant's key was gone, so after the write-back, and its `INCR` there
/// yields more than `f`. This holds whatever the clocks do, **as long as no instance
/// loses data**: [`FenceGuarantee::Durable`] is reported only if every instance looked
/// durable at connect time (see the [module docs](super)), else `BestEffort`.
///
/// # What Redlock cannot promise
///
/// - **Clocks.** Each instance expires keys on its own wall clock. A clock that jumps
///   forward (or runs fast beyond the `drift` allowance) expires the key early on that
///   instance, and a second majority can form while the first holder's validity has
///   not run out: two holders. Fences still increase (above), so only a resource that
///   checks fences stays safe.
/// - **Restarts without fsync.** An instance restarted without its data forgets the
///   keys and its counter: with it, a second majority can form (two holders) and the
///   counter's fences can repeat. Delay restarts by a ttl, or run every instance with
///   `appendfsync always`.
/// - **Pauses.** A holder paused (GC, SIGSTOP, swap) past its validity still believes
///   it holds the lock; nothing in Redis can stop its late writes. Only fencing
///   protects the resource. (`fencelock::Client`'s lost-lock signal fires at
///   the conservative deadline, which a paused process notices only when it runs.)
/// - **Idempotent retries are per backend object.** A retry of the same `request_id`
///   through this `RedlockBackend` returns the same grant (it remembers the owner
///   token of the last 4096 requests); the same request id sent through another
///   backend object counts as another holder.
/// - **Late answers.** An instance too slow for `instance_timeout` may still apply a
///   failed attempt's acquire after the attempt's release reached it (they travel on
///   different connections); that key blocks the lock there until its ttl runs out.
/// - No FIFO (contenders race; a random pause breaks ties), no lock-delay, no
///   sessions, no semaphores.
#[derive(Debug)]
pub struct RedlockBackend {
    instances: Vec<Arc<Instance>>,
    instance_timeout: Duration,
    retry_jitter: Duration,
    poll_interval: Duration,
    fences: FenceGuarantee,
    requests: Mutex<HashMap<String, Remembered>>,
}

/// An acquire request's owner token, kept for its retries.
#[derive(Debug)]
struct Remembered {
    token: String,
    until: Instant,
}

/// How one attempt went.
enum Outcome {
    Granted(Lease),
    /// Another holder was seen; retry after its remaining lease (if known). `split`:
    /// this attempt also won some instances (contenders divided them).
    Contended {
        pttl: Option<Duration>,
        split: bool,
    },
}

impl RedlockBackend {
    /// Connects to the instances; fails as `Unavailable` unless a majority answers.
    pub async fn connect(config: RedlockConfig) -> Result<RedlockBackend, Error> {
        if config.instances.is_empty() || config.instances.len() > MAX_INSTANCES {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "a redlock needs 1 to {MAX_INSTANCES} instances, got {}",
                    config.instances.len()
                ),
            ));
        }
        if config.instance_timeout.is_zero() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "instance_timeout must be positive",
            ));
        }
        let mut instances = Vec::new();
        for instance in &config.instances {
            instances.push(Arc::new(Instance::lazy(instance)?));
        }
        let mut backend = RedlockBackend {
            instances,
            instance_timeout: config.instance_timeout,
            retry_jitter: config.retry_jitter,
            poll_interval: config
                .instances
                .iter()
                .map(|c| c.options.poll_interval)
                .min()
                .unwrap_or(Duration::from_millis(100)),
            fences: FenceGuarantee::BestEffort,
            requests: Mutex::new(HashMap::new()),
        };
        // Settings are read with each instance's own (longer) timeouts.
        let timeout = config
            .instances
            .iter()
            .map(|c| c.options.connect_timeout + c.options.request_timeout * 4)
            .max()
            .unwrap_or_default();
        let answers = backend
            .on_all_within(timeout, |_, instance| async move {
                instance.fence_guarantee().await
            })
            .await;
        let reached = answers.iter().filter(|a| a.is_ok()).count();
        if reached < backend.majority() {
            let why = answers
                .into_iter()
                .find_map(Result::err)
                .map(|e| e.to_string())
                .unwrap_or_default();
            return Err(Error::new(
                ErrorKind::Unavailable,
                format!(
                    "only {reached} of {} redis instances answered: {why}",
                    backend.instances.len()
                ),
            ));
        }
        if answers
            .iter()
            .all(|a| matches!(a, Ok(FenceGuarantee::Durable)))
        {
            backend.fences = FenceGuarantee::Durable;
        }
        Ok(backend)
    }

    fn majority(&self) -> usize {
        self.instances.len() / 2 + 1
    }

    fn drift(ttl: Duration) -> Duration {
        ttl / 100 + Duration::from_millis(2)
    }

    /// Runs `step` on every instance at once, each bounded by `instance_timeout`;
    /// results in instance order.
    async fn on_all<T, F, Fut>(&self, step: F) -> Vec<Result<T, Error>>
    where
        F: Fn(usize, Arc<Instance>) -> Fut,
        Fut: Future<Output = Result<T, Error>> + Send + 'static,
        T: Send + 'static,
    {
        self.on_all_within(self.instance_timeout, step).await
    }

    async fn on_all_within<T, F, Fut>(&self, timeout: Duration, step: F) -> Vec<Result<T, Error>>
    where
        F: Fn(usize, Arc<Instance>) -> Fut,
        Fut: Future<Output = Result<T, Error>> + Send + 'static,
        T: Send + 'static,
    {
        let mut tasks = JoinSet::new();
        for (index, instance) in self.instances.iter().enumerate() {
            let work = step(index, instance.clone());
            tasks.spawn(async move {
                let result = match tokio::time::timeout(timeout, work).await {
                    Ok(result) => result,
                    Err(_) => Err(Error::new(
                        ErrorKind::Unavailable,
                        format!("redis instance {index} did not answer within {timeout:?}"),
                    )),
                };
                (index, result)
            });
        }
        let mut results: Vec<Result<T, Error>> = (0..self.instances.len())
            .map(|_| Err(Error::new(ErrorKind::Internal, "a redlock step was lost")))
            .collect();
        while let Some(joined) = tasks.join_next().await {
            if let Ok((index, result)) = joined {
                if let Some(slot) = results.get_mut(index) {
                    *slot = result;
                }
            }
        }
        results
    }

    /// The owner token for this request: the one used before if it is a retry.
    fn token_for(&self, spec: &AcquireSpec) -> Result<String, Error> {
        let mut requests = self.lock_requests()?;
        let now = Instant::now();
        let until = now + spec.wait + spec.ttl + Duration::from_secs(1);
        if let Some(entry) = requests.get_mut(&spec.request_id) {
            entry.until = entry.until.max(until);
            return Ok(entry.token.clone());
        }
        if requests.len() >= MAX_REMEMBERED {
            requests.retain(|_, r| r.until > now);
        }
        if requests.len() >= MAX_REMEMBERED {
            let oldest = requests
                .iter()
                .min_by_key(|(_, r)| r.until)
                .map(|(id, _)| id.clone());
            if let Some(oldest) = oldest {
                requests.remove(&oldest);
            }
        }
        let token = new_token();
        requests.insert(
            spec.request_id.clone(),
            Remembered {
                token: token.clone(),
                until,
            },
        );
        Ok(token)
    }

    fn lock_requests(
        &self,
    ) -> Result<std::sync::MutexGuard<'_, HashMap<String, Remembered>>, Error> {
        self.requests
            .lock()
            .map_err(|_| Error::new(ErrorKind::Internal, "redlock request table poisoned"))
    }

    /// One attempt on all instances (see the type docs).
    async fn attempt(&self, spec: &Arc<AcquireSpec>, token: &Arc<str>) -> Result<Outcome, Error> {
        let started = Instant::now();
        let answers = self
            .on_all(|_, instance| {
                let (spec, token) = (spec.clone(), token.clone());
                async move { instance.try_acquire(&spec, &token).await }
            })
            .await;
        let mut ours = Vec::new();
        let mut held: Vec<Option<Duration>> = Vec::new();
        let mut first_error = None;
        for answer in answers {
            match answer {
                Ok(Attempt::Granted(grant)) if *grant.token == **token => ours.push(grant),
                // The same request id granted through another backend object.
                Ok(Attempt::Granted(grant)) => held.push(Some(grant.remaining)),
                Ok(Attempt::Held { pttl }) => held.push(pttl),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        let lease = Lease::new(spec.name.clone(), 0, token.to_string(), spec.ttl);
        if ours.len() >= self.majority() {
            // For a retry whose grant is still held everywhere it was, every fence here
            // is at most the one written back before, and one of them is it: the same
            // fence comes back.
            let fence = ours.iter().map(|g| g.fence).max().unwrap_or_default();
            let fence_text: Arc<str> = fence.to_string().into();
            let written = self
                .on_all(|_, instance| {
                    let (name, token, fence) =
                        (spec.name.clone(), token.clone(), fence_text.clone());
                    async move {
                        let mut call = WRITE_BACK.prepare_invoke();
                        call.key(instance.keys.lock(&name))
                            .key(instance.keys.fence(&name));
                        call.arg(&*token).arg(&*fence);
                        let written: i64 = instance
                            .commands
                            .script(&call, instance.request_timeout)
                            .await?;
                        Ok(written == 1)
                    }
                })
                .await
                .into_iter()
                .filter(|w| matches!(w, Ok(true)))
                .count();
            let shortest = ours.iter().map(|g| g.remaining).min().unwrap_or_default();
            let validity = shortest
                .checked_sub(started.elapsed() + Self::drift(spec.ttl))
                .filter(|v| !v.is_zero());
            if let (true, Some(validity)) = (written >= self.majority(), validity) {
                return Ok(Outcome::Granted(Lease::new(
                    spec.name.clone(),
                    fence,
                    token.to_string(),
                    validity,
                )));
            }
        }
        // Not granted: undo what this attempt took, everywhere (also where the answer
        // was lost), so no instance keeps a partial grant until it expires.
        self.release_everywhere(&lease).await;
        if held.is_empty() {
            // A permanent error (no permission, a foreign value under the key) keeps
            // its kind: retrying cannot help.
            let kind = match &first_error {
                Some(e) if !e.is_transient() => e.kind(),
                _ => ErrorKind::Unavailable,
            };
            return Err(Error::new(
                kind,
                format!(
                    "{:?}: only {} of {} redis instances granted it ({})",
                    spec.name,
                    ours.len(),
                    self.instances.len(),
                    first_error
                        .map(|e| e.to_string())
                        .unwrap_or_else(|| "no validity left".to_owned())
                ),
            ));
        }
        Ok(Outcome::Contended {
            pttl: held.into_iter().flatten().min(),
            split: !ours.is_empty(),
        })
    }

    async fn release_everywhere(&self, lease: &Lease) -> Vec<Result<bool, Error>> {
        let lease = Arc::new(lease.clone());
        self.on_all(|_, instance| {
            let lease = lease.clone();
            async move { instance.release(&lease).await }
        })
        .await
    }

    /// Subscribes to the lock's channel on every instance that has no live
    /// subscription; instances that fail are skipped (the `PTTL` timer still bounds the
    /// wait).
    async fn subscribe_all(&self, name: &str, subscriptions: &mut [Option<Subscription>]) {
        let missing: Vec<bool> = subscriptions
            .iter()
            .map(|s| s.as_ref().is_none_or(Subscription::is_dead))
            .collect();
        if !missing.iter().any(|m| *m) {
            return;
        }
        let timeout = self.instance_timeout;
        let wanted = Arc::new(missing);
        let name: Arc<str> = name.into();
        let fresh = self
            .on_all(|index, instance| {
                let wanted = wanted.clone();
                let name = name.clone();
                async move {
                    if !wanted.get(index).copied().unwrap_or(false)
                        || !instance.subscriber.enabled()
                    {
                        return Ok(None);
                    }
                    let channel = instance.keys.channel(&name);
                    instance
                        .subscriber
                        .subscribe(&channel, timeout)
                        .await
                        .map(Some)
                }
            })
            .await;
        for (slot, fresh) in subscriptions.iter_mut().zip(fresh) {
            if let Ok(Some(subscription)) = fresh {
                *slot = Some(subscription);
            }
        }
    }
}

/// Resolves when any live subscription gets a message (never, if none is live).
async fn any_message(subscriptions: &mut [Option<Subscription>]) {
    let mut waits: Vec<_> = subscriptions
        .iter_mut()
        .flatten()
        .filter(|s| !s.is_dead())
        .map(|s| Box::pin(s.changed()))
        .collect();
    if waits.is_empty() {
        return std::future::pending().await;
    }
    std::future::poll_fn(|cx| {
        for wait in waits.iter_mut() {
            if wait.as_mut().poll(cx).is_ready() {
                return std::task::Poll::Ready(());
            }
        }
        std::task::Poll::Pending
    })
    .await
}

fn jitter(max: Duration) -> Duration {
    let nanos = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX);
    Duration::from_nanos(fencelock_backend::random_u64() % nanos.saturating_add(1))
}

impl LockBackend for RedlockBackend {
    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::new("redlock", self.fences);
        caps.push_wakeups = self.instances.iter().all(|i| i.subscriber.enabled());
        caps
    }

    fn acquire<'a>(&'a self, spec: &'a AcquireSpec) -> BoxFuture<'a, Result<Lease, Error>> {
        Box::pin(async move {
            check_spec(spec, 1)?;
            let deadline = Instant::now() + spec.wait;
            let token = self.token_for(spec)?;
            let token: Arc<str> = token.into();
            let shared_spec = Arc::new(spec.clone());
            let mut subscriptions: Vec<Option<Subscription>> =
                self.instances.iter().map(|_| None).collect();
            // Bounded by the deadline: every turn returns or sleeps until a release,
            // an expiry, or the deadline.
            loop {
                if !spec.wait.is_zero() {
                    self.subscribe_all(&spec.name, &mut subscriptions).await;
                }
                let (pttl, split) = match self.attempt(&shared_spec, &token).await? {
                    Outcome::Granted(lease) => return Ok(lease),
                    Outcome::Contended { pttl, split } => (pttl, split),
                };
                let now = Instant::now();
                if now >= deadline {
                    return Err(not_granted(spec));
                }
                let left = deadline - now;
                let mut nap = pttl.map_or(left, |p| p.min(left));
                if subscriptions.iter().all(Option::is_none) {
                    // No wake-ups (off, or no instance could subscribe): poll.
                    nap = nap.min(self.poll_interval);
                }
                tokio::select! {
                    _ = tokio::time::sleep(nap) => {}
                    _ = any_message(&mut subscriptions) => {}
                }
                // Contenders that split the instances would split them again if they
                // retried in step.
                if split {
                    let pause = jitter(self.retry_jitter)
                        .min(deadline.saturating_duration_since(Instant::now()));
                    tokio::time::sleep(pause).await;
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
            let started = Instant::now();
            let shared = Arc::new(lease.clone());
            let answers = self
                .on_all(|_, instance| {
                    let lease = shared.clone();
                    async move { instance.renew(&lease, ttl).await }
                })
                .await;
            let renewed = answers.iter().filter(|a| matches!(a, Ok(true))).count();
            let refused = answers.iter().filter(|a| matches!(a, Ok(false))).count();
            let validity = ttl
                .checked_sub(started.elapsed() + Self::drift(ttl))
                .filter(|v| !v.is_zero());
            match validity {
                Some(validity) if renewed >= self.majority() => Ok(validity),
                _ if self.instances.len() - refused < self.majority() => Err(gone(&lease.name)),
                _ => Err(Error::new(
                    ErrorKind::Unavailable,
                    format!(
                        "{:?} renewed on {renewed} of {} redis instances in time",
                        lease.name,
                        self.instances.len()
                    ),
                )),
            }
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            let answers = self.release_everywhere(lease).await;
            if let Ok(mut requests) = self.lock_requests() {
                requests.retain(|_, r| r.token != lease.owner_token);
            }
            let released = answers.iter().any(|a| matches!(a, Ok(true)));
            let refused = answers.iter().filter(|a| matches!(a, Ok(false))).count();
            if released {
                Ok(true)
            } else if refused >= self.majority() {
                Ok(false)
            } else {
                Err(Error::new(
                    ErrorKind::Unavailable,
                    format!(
                        "release of {:?}: only {refused} of {} redis instances answered",
                        lease.name,
                        self.instances.len()
                    ),
                ))
            }
        })
    }
}
