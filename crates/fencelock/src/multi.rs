//! [`MultiLockRequest`] and [`MultiLockGuard`]: several locks taken as one
//! all-or-nothing request, renewed together and lost together.
//!
//! The store queues the request on every name at once (the fencelock server's
//! `AcquireAll`), so two clients asking for overlapping sets in opposite orders cannot
//! deadlock. A store without that ([`Capabilities::multi`](crate::Capabilities::multi)
//! false) is refused with [`ErrorKind::Unsupported`]: taking the names one at a time
//! instead could deadlock, so it is never done.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::client::{budget_end, Client};
use crate::guard::{held_now, release_leases, release_part, release_set, Kept, Lifeline, Timing};
use crate::{Error, ErrorKind, LockOptions, LostReason};
use fencelock_backend::{request_id, AcquireSpec, Lease, LockBackend, LockMode};

/// A multi-lock being built ([`Client::lock_all`]): set options, then
/// [`acquire`](MultiLockRequest::acquire) or [`try_acquire`](MultiLockRequest::try_acquire).
#[derive(Debug)]
#[must_use = "a lock request does nothing until acquired"]
pub struct MultiLockRequest {
    client: Client,
    names: Vec<String>,
    options: LockOptions,
}

impl MultiLockRequest {
    pub(crate) fn new(client: Client, names: Vec<String>) -> MultiLockRequest {
        MultiLockRequest {
            client,
            names,
            options: LockOptions::default(),
        }
    }

    /// Replaces all options ([`LockOptions::limit`] and
    /// [`LockOptions::lock_delay`] apply to every name of the set).
    pub fn options(mut self, options: LockOptions) -> MultiLockRequest {
        self.options = options;
        self
    }

    /// Lease length of every grant (renewed together in the background).
    pub fn ttl(mut self, ttl: Duration) -> MultiLockRequest {
        self.options.ttl = ttl;
        self
    }

    /// How long to wait for the whole set.
    pub fn wait(mut self, wait: Duration) -> MultiLockRequest {
        self.options.wait = wait;
        self
    }

    /// Waits for the set with no limit (see [`LockOptions::wait_forever`]).
    pub fn wait_forever(self) -> MultiLockRequest {
        self.wait(Duration::MAX)
    }

    /// Who holds the locks, for operators.
    pub fn owner(mut self, owner: impl Into<String>) -> MultiLockRequest {
        self.options.owner = owner.into();
        self
    }

    /// The idempotency key every attempt of this acquisition carries (default: a
    /// fresh random one): a retry gets the grants an earlier attempt already made.
    pub fn request_id(mut self, id: impl Into<String>) -> MultiLockRequest {
        self.options.request_id = Some(id.into());
        self
    }

    /// How long before the server could expire the first lease the guard reports
    /// the set lost.
    pub fn safety_margin(mut self, margin: Duration) -> MultiLockRequest {
        self.options.safety_margin = Some(margin);
        self
    }

    /// Exclusive (the default) or [`LockMode::Shared`] on every name of the set.
    pub fn mode(mut self, mode: LockMode) -> MultiLockRequest {
        self.options.mode = mode;
        self
    }

    /// Acquires every name, or none, waiting up to the wait budget. Errors:
    /// [`ErrorKind::Unsupported`] on a store without multi-locks,
    /// [`ErrorKind::InvalidArgument`] for an empty set (or one the store refuses:
    /// duplicate names, too many), [`ErrorKind::Timeout`] if not granted in time (or
    /// [`ErrorKind::Held`] with a zero wait), a transient kind if the store stayed
    /// unreachable for the whole budget.
    pub async fn acquire(self) -> Result<MultiLockGuard, Error> {
        acquire(self.client, self.names, self.options).await
    }

    /// Acquires the set only if every name is free now: [`ErrorKind::Held`]
    /// otherwise.
    pub async fn try_acquire(mut self) -> Result<MultiLockGuard, Error> {
        self.options.wait = Duration::ZERO;
        self.acquire().await
    }
}

async fn acquire(
    client: Client,
    names: Vec<String>,
    options: LockOptions,
) -> Result<MultiLockGuard, Error> {
    let backend = client.backend();
    let caps = backend.capabilities();
    if !caps.multi {
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "the {} backend has no multi-locks (taking the locks one at a time could deadlock)",
                caps.backend
            ),
        ));
    }
    if options.mode == LockMode::Shared && !caps.shared {
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!("the {} backend has no shared (reader) locks", caps.backend),
        ));
    }
    if names.is_empty() {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            "name at least one lock",
        ));
    }
    let timing = options.validate()?;
    let budget_end = budget_end(options.wait);
    let names_ref: Vec<&str> = names.iter().map(String::as_str).collect();
    let mut spec = AcquireSpec::new(names[0].clone(), options.ttl);
    spec.owner = options.owner.clone();
    spec.limit = options.limit;
    spec.lock_delay = options.lock_delay;
    spec.mode = options.mode;
    // One id for every attempt, whichever member gets it.
    spec.request_id = options.request_id.clone().unwrap_or_else(request_id);
    let mut first_sent: Option<Instant> = None;
    let mut attempt = 0u32;
    loop {
        let sent = Instant::now();
        let mut lease_base = *first_sent.get_or_insert(sent);
        spec.wait = budget_end.saturating_duration_since(sent);
        match backend.acquire_all(&names_ref, &spec).await {
            Ok(mut leases) => {
                let mut granted = shortest(&leases, options.ttl);
                // After a long wait the first send proves little of the leases (they
                // started when the wait ended): renewals sent now prove fresh ones.
                if Instant::now().saturating_duration_since(lease_base) > options.ttl / 4 {
                    match confirm(&*backend, &leases, &options, budget_end).await {
                        Ok((sent, ttl)) => {
                            lease_base = sent;
                            granted = ttl;
                            for lease in &mut leases {
                                lease.ttl = ttl;
                            }
                        }
                        Err(e) if e.kind() == ErrorKind::NotHeld => {
                            // Part of the set expired before it could be used: give
                            // the rest back and try afresh.
                            let _ = release_leases(&*backend, &leases).await;
                            spec.request_id = request_id();
                            first_sent = None;
                            if Instant::now() >= budget_end {
                                return Err(Error::new(
                                    ErrorKind::Timeout,
                                    format!("{names:?} not acquired within {:?}", options.wait),
                                ));
                            }
                            continue;
                        }
                        Err(e) => {
                            let _ = release_leases(&*backend, &leases).await;
                            return Err(e);
                        }
                    }
                }
                return Ok(MultiLockGuard::start(
                    backend, leases, lease_base, granted, timing,
                ));
            }
            // One call waits at most an hour on the server; the budget may be longer.
            Err(e) if e.kind() == ErrorKind::Timeout && Instant::now() < budget_end => {}
            Err(e) if e.is_transient() => {
                let delay = options.backoff.delay(attempt);
                attempt = attempt.saturating_add(1);
                if Instant::now() + delay >= budget_end {
                    return Err(e);
                }
                tokio::time::sleep(delay).await;
            }
            // The last sliver of a wait budget is sent as "don't wait".
            Err(e) if e.kind() == ErrorKind::Held && !options.wait.is_zero() => {
                return Err(Error::new(ErrorKind::Timeout, e.message()));
            }
            Err(e) => return Err(e),
        }
    }
}

/// The shortest lease of `leases` (`ttl` if there are none).
fn shortest(leases: &[Lease], ttl: Duration) -> Duration {
    leases.iter().map(|l| l.ttl).min().unwrap_or(ttl)
}

/// Renews every grant once, retrying transient errors within the wait budget; the
/// renewals' send instant and the shortest lease granted.
async fn confirm(
    backend: &dyn LockBackend,
    leases: &[Lease],
    options: &LockOptions,
    budget_end: Instant,
) -> Result<(Instant, Duration), Error> {
    let mut attempt = 0u32;
    loop {
        let sent = Instant::now();
        let answers = futures_util::future::join_all(
            leases.iter().map(|lease| backend.renew(lease, options.ttl)),
        )
        .await;
        let mut granted = options.ttl;
        let mut transient = None;
        for answer in answers {
            match answer {
                Ok(ttl) => granted = granted.min(ttl),
                Err(e) if e.is_transient() => {
                    transient.get_or_insert(e);
                }
                Err(e) => return Err(e),
            }
        }
        let Some(e) = transient else {
            return Ok((sent, granted));
        };
        let delay = options.backoff.delay(attempt);
        attempt = attempt.saturating_add(1);
        if Instant::now() + delay >= budget_end {
            return Err(e);
        }
        tokio::time::sleep(delay).await;
    }
}

/// Held locks taken together ([`Client::lock_all`]): one grant and fence per name,
/// renewed together by one background task, lost together.
///
/// Pass each name's [`fence`](MultiLockGuard::fence) with every write to what that
/// lock protects, and stop writing when [`lost`](MultiLockGuard::lost) resolves: it
/// resolves when any grant of the set is or may be lost. Release them together
/// ([`release`](MultiLockGuard::release)) or some now and the rest later
/// ([`release_some`](MultiLockGuard::release_some)). Dropping the guard releases
/// what it still holds in the background.
#[derive(Debug)]
pub struct MultiLockGuard {
    /// The grants not released yet, in the order asked; shared with the renewal task.
    held: Arc<Mutex<Vec<Lease>>>,
    /// Dropping it tells the renewal task to release what is left.
    lifeline: Lifeline,
    backend: Arc<dyn LockBackend>,
    renewer: tokio::task::JoinHandle<()>,
}

impl MultiLockGuard {
    fn start(
        backend: Arc<dyn LockBackend>,
        leases: Vec<Lease>,
        sent: Instant,
        granted: Duration,
        timing: Timing,
    ) -> MultiLockGuard {
        let held = Arc::new(Mutex::new(leases));
        let (lifeline, renewer) = Lifeline::start(
            backend.clone(),
            Kept::Leases(held.clone()),
            sent,
            granted,
            timing,
        );
        MultiLockGuard {
            held,
            lifeline,
            backend,
            renewer,
        }
    }

    /// The names still held, in the order asked.
    pub fn names(&self) -> Vec<String> {
        held_now(&self.held).into_iter().map(|l| l.name).collect()
    }

    /// The fence of `name`'s grant (`None` if this guard does not hold `name`): pass
    /// it with every write to what `name` protects.
    pub fn fence(&self, name: &str) -> Option<u64> {
        held_now(&self.held)
            .iter()
            .find(|l| l.name == name)
            .map(|l| l.fence)
    }

    /// Each name still held with its fence, in the order asked.
    pub fn fences(&self) -> Vec<(String, u64)> {
        held_now(&self.held)
            .into_iter()
            .map(|l| (l.name, l.fence))
            .collect()
    }

    /// The grants still held, as the store reported them.
    pub fn leases(&self) -> Vec<Lease> {
        held_now(&self.held)
    }

    /// How long every lock of the set is still certainly held; `None` once any is
    /// or may be lost.
    pub fn valid_for(&self) -> Option<Duration> {
        self.lifeline.valid_for()
    }

    /// Whether any lock of the set is, or may be, lost.
    pub fn is_lost(&self) -> bool {
        self.valid_for().is_none()
    }

    /// Resolves when any lock of the set is or may be lost: the store refused a
    /// renewal of one (expired, or taken by an operator), or no renewal was confirmed
    /// before the conservative local deadline. Then the others are released too.
    pub fn lost(&self) -> impl Future<Output = LostReason> + Send + 'static {
        self.lifeline.lost()
    }

    /// Stops renewal and releases every lock still held in one request; per name
    /// (in [`names`](MultiLockGuard::names) order), whether this call released it
    /// (`false`: already gone).
    pub async fn release(self) -> Result<Vec<bool>, Error> {
        self.renewer.abort();
        let leases = held_now(&self.held);
        let result = release_set(
            &*self.backend,
            &leases,
            &self.lifeline.state,
            self.lifeline.timing,
        )
        .await;
        // Once the task has ended, nothing more is renewed for this guard.
        let _ = (&mut { self.renewer }).await;
        result
    }

    /// Releases `names` now (one request) and keeps renewing the rest; per name given,
    /// whether this call released it. A name this guard does not hold is
    /// [`ErrorKind::InvalidArgument`] and nothing is released. The names leave the
    /// guard even if the release fails (their leases then expire on the store).
    /// Releasing the last ones ends the guard as [`release`](Self::release) does.
    pub async fn release_some(&mut self, names: &[&str]) -> Result<Vec<bool>, Error> {
        let (leaving, left) = {
            let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            let mut leaving = Vec::with_capacity(names.len());
            for name in names {
                let Some(lease) = held.iter().find(|l| l.name == *name) else {
                    return Err(Error::new(
                        ErrorKind::InvalidArgument,
                        format!("this guard does not hold {name:?}"),
                    ));
                };
                if !leaving.iter().any(|l: &Lease| l.name == *name) {
                    leaving.push(lease.clone());
                }
            }
            held.retain(|l| !leaving.iter().any(|g| g.owner_token == l.owner_token));
            (leaving, held.len())
        };
        let timing = self.lifeline.timing;
        let released = if left == 0 {
            self.renewer.abort();
            release_set(&*self.backend, &leaving, &self.lifeline.state, timing).await
        } else {
            release_part(&*self.backend, &leaving, &self.lifeline.state, timing).await
        }?;
        // Per name given (a name given twice answers twice).
        Ok(names
            .iter()
            .map(|name| {
                leaving
                    .iter()
                    .position(|l| l.name == *name)
                    .and_then(|i| released.get(i).copied())
                    .unwrap_or(false)
            })
            .collect())
    }
}
