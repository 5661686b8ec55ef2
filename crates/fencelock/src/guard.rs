//! [`LockGuard`]: a held lock, its background renewal and its lost-lock signal.
//!
//! **Invariant:** the guard's deadline is never later than the earliest instant the
//! store can expire the lease: it is `send instant of the last confirmed acquire or
//! renewal + granted ttl − safety margin`, and the store starts a lease no earlier than
//! it receives the request. [`LockGuard::lost`] resolves at that deadline at the latest
//! (within the timer's 1 ms resolution), whatever the renewal task is doing. A grant
//! held under a session has the session's deadline (the same rule, counted from the
//! session's last confirmed keep-alive), which only its keep-alive extends.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::{Error, ErrorKind};
use fencelock_backend::Backoff;
use fencelock_backend::{BoxFuture, Lease, LockBackend, SessionLease};

/// Renewal settings of one guard, validated by the client.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timing {
    pub ttl: Duration,
    pub margin: Duration,
    pub backoff: Backoff,
}

/// Why a lock is (or may be) lost.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum LostReason {
    /// No renewal was confirmed before the guard's conservative deadline; the store may
    /// expire the lease at any moment after it.
    DeadlineReached,
    /// The store says the grant is gone (expired, or taken by an operator), or refused
    /// to renew it.
    Revoked(Error),
    /// This guard released the lock.
    Released,
}

impl LostReason {
    /// This reason as an [`ErrorKind::LockLost`] error about lock `name`.
    pub fn into_error(self, name: &str) -> Error {
        let why = match self {
            LostReason::DeadlineReached => {
                "renewal was not confirmed before the lease's safe deadline".to_owned()
            }
            LostReason::Revoked(e) => format!("the store refused to renew it ({e})"),
            LostReason::Released => "it was released".to_owned(),
        };
        Error::new(ErrorKind::LockLost, format!("lock {name:?} lost: {why}"))
    }
}

#[derive(Debug)]
pub(crate) struct State {
    deadline: Instant,
    lost: Option<LostReason>,
}

/// Nothing is ever sent on a guard's control channel: it closing (the guard dropped
/// without [`LockGuard::release`]) tells the renewal task to release.
pub(crate) enum Control {}

/// What a renewal task keeps alive: one grant, a session (and with it every grant
/// held under it), or the grants of one multi-lock (those not yet released one by
/// one: the guard removes a grant from the set before releasing it).
#[derive(Debug, Clone)]
pub(crate) enum Kept {
    Lease(Lease),
    Session(SessionLease),
    Leases(Arc<Mutex<Vec<Lease>>>),
}

/// The grants of a multi-lock still held. A poisoned lock only means a panic
/// elsewhere while it was held; the list itself is always whole.
pub(crate) fn held_now(held: &Mutex<Vec<Lease>>) -> Vec<Lease> {
    held.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// Renews every grant of a multi-lock at once; the shortest lease granted. A grant
/// the store refuses makes the whole set lost (its error is returned), unless it was
/// released one by one meanwhile.
async fn renew_all(
    backend: &dyn LockBackend,
    held: &Mutex<Vec<Lease>>,
    ttl: Duration,
) -> Result<Duration, Error> {
    let leases = held_now(held);
    let answers =
        futures_util::future::join_all(leases.iter().map(|lease| backend.renew(lease, ttl))).await;
    let mut granted = ttl;
    let mut transient = None;
    for (lease, answer) in leases.iter().zip(answers) {
        match answer {
            Ok(ttl) => granted = granted.min(ttl),
            Err(_)
                if !held_now(held)
                    .iter()
                    .any(|l| l.owner_token == lease.owner_token) => {}
            Err(e) if e.is_transient() => {
                transient.get_or_insert(e);
            }
            Err(e) => {
                return Err(Error::new(
                    e.kind(),
                    format!("lock {:?} of the set: {}", lease.name, e.message()),
                ))
            }
        }
    }
    match transient {
        Some(e) => Err(e),
        None => Ok(granted),
    }
}

impl Kept {
    /// Extends the lease; the length granted.
    fn extend<'a>(
        &'a self,
        backend: &'a dyn LockBackend,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Duration, Error>> {
        match self {
            Kept::Lease(lease) => backend.renew(lease, ttl),
            Kept::Session(session) => backend.keep_alive(session),
            Kept::Leases(held) => Box::pin(renew_all(backend, held, ttl)),
        }
    }

    /// Gives the lease back, retrying transient errors until it would have expired
    /// anyway, and marks it released.
    async fn end(
        &self,
        backend: &dyn LockBackend,
        state: &watch::Sender<State>,
        timing: Timing,
    ) -> Result<(), Error> {
        match self {
            Kept::Lease(lease) => release(backend, lease, state, timing).await.map(drop),
            Kept::Session(session) => close_session(backend, session, state, timing)
                .await
                .map(drop),
            Kept::Leases(held) => release_set(backend, &held_now(held), state, timing)
                .await
                .map(drop),
        }
    }
}

/// The conservative deadline and lost signal of a lease (a guard's or a session's), kept
/// by a renewal task.
#[derive(Debug, Clone)]
pub(crate) struct Lifeline {
    pub state: Arc<watch::Sender<State>>,
    /// Dropping every clone tells the renewal task to give the lease back.
    pub control: mpsc::UnboundedSender<Control>,
    pub timing: Timing,
}

impl Lifeline {
    /// Starts renewing `kept`, first sent at `sent` and granted for `granted`; returns
    /// the lifeline and the renewal task.
    pub(crate) fn start(
        backend: Arc<dyn LockBackend>,
        kept: Kept,
        sent: Instant,
        granted: Duration,
        timing: Timing,
    ) -> (Lifeline, tokio::task::JoinHandle<()>) {
        let deadline = (sent + granted).checked_sub(timing.margin).unwrap_or(sent);
        let state = Arc::new(watch::Sender::new(State {
            deadline,
            lost: None,
        }));
        let (control, inbox) = mpsc::unbounded_channel();
        let renewer = Renewer {
            backend,
            kept,
            state: state.clone(),
            timing,
            last_sent: sent,
        };
        let task = tokio::spawn(renewer.run(inbox));
        let lifeline = Lifeline {
            state,
            control,
            timing,
        };
        (lifeline, task)
    }

    /// See [`LockGuard::lost`].
    pub(crate) fn lost(&self) -> impl Future<Output = LostReason> + Send + 'static {
        lost_signal(self.state.clone())
    }

    /// See [`LockGuard::valid_for`].
    pub(crate) fn valid_for(&self) -> Option<Duration> {
        valid_for(&self.state)
    }

    /// The reason the lease is lost, if it is.
    pub(crate) fn lost_reason(&self) -> Option<LostReason> {
        self.state.borrow().lost.clone()
    }
}

/// A held lock. Pass [`fence`](LockGuard::fence) with every write to the protected
/// resource, and stop writing when [`lost`](LockGuard::lost) resolves.
///
/// The lease is renewed in the background (every third of the TTL) until the guard is
/// released or dropped. Dropping the guard releases the lock in the background; it
/// never blocks and never panics, even outside a runtime (then the lease simply
/// expires on the store).
#[derive(Debug)]
pub struct LockGuard {
    lease: Lease,
    state: Arc<watch::Sender<State>>,
    /// Closes when the guard is dropped: the renewal task then releases.
    _control: mpsc::UnboundedSender<Control>,
    backend: Arc<dyn LockBackend>,
    renewer: tokio::task::JoinHandle<()>,
    timing: Timing,
    /// For a grant held under a session: keeps the session open while the guard lives.
    _session: Option<mpsc::UnboundedSender<Control>>,
}

impl LockGuard {
    /// Starts the renewal task for a fresh grant whose request was first sent at
    /// `sent`. Must be called within a tokio runtime.
    pub(crate) fn start(
        backend: Arc<dyn LockBackend>,
        lease: Lease,
        sent: Instant,
        timing: Timing,
    ) -> LockGuard {
        let (lifeline, renewer) = Lifeline::start(
            backend.clone(),
            Kept::Lease(lease.clone()),
            sent,
            lease.ttl,
            timing,
        );
        LockGuard {
            lease,
            state: lifeline.state,
            _control: lifeline.control,
            backend,
            renewer,
            timing,
            _session: None,
        }
    }

    /// A guard for a grant held under `session`: no renewal of its own (the session's
    /// keep-alive keeps it), its deadline the session's, lost when the session is.
    /// Must be called within a tokio runtime.
    pub(crate) fn start_in_session(
        backend: Arc<dyn LockBackend>,
        lease: Lease,
        session: &Lifeline,
    ) -> LockGuard {
        let (deadline, lost) = {
            let s = session.state.borrow();
            (s.deadline, s.lost.clone())
        };
        let state = Arc::new(watch::Sender::new(State { deadline, lost }));
        let (control, inbox) = mpsc::unbounded_channel();
        let follower = follow_session(
            session.state.subscribe(),
            state.clone(),
            inbox,
            backend.clone(),
            lease.clone(),
            session.timing,
        );
        LockGuard {
            lease,
            state,
            _control: control,
            backend,
            renewer: tokio::spawn(follower),
            timing: session.timing,
            _session: Some(session.control.clone()),
        }
    }

    /// The lock name.
    pub fn name(&self) -> &str {
        &self.lease.name
    }

    /// The fencing token of this grant: send it with every write to the protected
    /// resource, which must refuse writes with a fence older than one it has seen.
    pub fn fence(&self) -> u64 {
        self.lease.fence
    }

    /// The owner token that identifies this grant on the store.
    pub fn owner_token(&self) -> &str {
        &self.lease.owner_token
    }

    /// The grant as the store reported it.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// How long the lock is still certainly held (until the conservative local
    /// deadline); `None` once it is or may be lost.
    pub fn valid_for(&self) -> Option<Duration> {
        valid_for(&self.state)
    }

    /// Turns this exclusive grant into a shared one without releasing it: readers
    /// waiting behind it may then join. The fence stays. [`ErrorKind::Unsupported`]
    /// where the store has no downgrade ([`fencelock_backend::Capabilities::downgrade`]),
    /// [`ErrorKind::NotHeld`] once the grant is gone.
    pub async fn downgrade(&self) -> Result<(), Error> {
        if !self.backend.capabilities().downgrade {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "the {} backend cannot downgrade a lock",
                    self.backend.capabilities().backend
                ),
            ));
        }
        self.backend.downgrade(&self.lease).await
    }

    /// Whether the lock is, or may be, lost.
    pub fn is_lost(&self) -> bool {
        self.valid_for().is_none()
    }

    /// Resolves when the lock is or may be lost: when the store refuses a renewal, or
    /// at the conservative local deadline if no renewal was confirmed before it —
    /// which is before the store can have expired the lease. Can be called many times;
    /// each future resolves with the same reason.
    pub fn lost(&self) -> impl Future<Output = LostReason> + Send + 'static {
        lost_signal(self.state.clone())
    }

    /// Stops renewal and releases the lock. `Ok(true)` if this call released it,
    /// `Ok(false)` if it was already gone (expired or taken). No renewal is sent after
    /// this returns.
    pub async fn release(self) -> Result<bool, Error> {
        // Stop the renewal task and release from here, in parallel: one round trip
        // instead of a hop to the task and back.
        self.renewer.abort();
        let result = release(&*self.backend, &self.lease, &self.state, self.timing).await;
        // The task may be in the middle of a poll on another thread: once it has
        // ended, nothing more can be sent for this guard.
        let _ = (&mut { self.renewer }).await;
        result
    }
}

fn valid_for(state: &watch::Sender<State>) -> Option<Duration> {
    let state = state.borrow();
    if state.lost.is_some() {
        return None;
    }
    let left = state.deadline.saturating_duration_since(Instant::now());
    (!left.is_zero()).then_some(left)
}

/// Resolves when the lease of `state` is or may be lost (see [`LockGuard::lost`]).
fn lost_signal(state: Arc<watch::Sender<State>>) -> impl Future<Output = LostReason> + Send {
    let mut changes = state.subscribe();
    async move {
        loop {
            let deadline = {
                let current = changes.borrow_and_update();
                if let Some(reason) = &current.lost {
                    return reason.clone();
                }
                current.deadline
            };
            tokio::select! {
                _ = changes.changed() => {}
                _ = tokio::time::sleep_until(deadline) => {
                    // Sticky: once reported lost, renewals no longer extend it.
                    state.send_if_modified(|s| {
                        if s.lost.is_none() && Instant::now() >= s.deadline {
                            s.lost = Some(LostReason::DeadlineReached);
                            true
                        } else {
                            false
                        }
                    });
                }
            }
        }
    }
}

/// The task of a guard held under a session: its deadline follows the session's
/// (extended only once a keep-alive is confirmed), it is lost when the session is, and
/// dropping the guard releases the grant.
async fn follow_session(
    mut session: watch::Receiver<State>,
    state: Arc<watch::Sender<State>>,
    mut inbox: mpsc::UnboundedReceiver<Control>,
    backend: Arc<dyn LockBackend>,
    lease: Lease,
    timing: Timing,
) {
    loop {
        let (deadline, lost) = {
            let s = session.borrow_and_update();
            (s.deadline, s.lost.clone())
        };
        if let Some(reason) = lost {
            mark_lost(&state, reason);
            return;
        }
        state.send_if_modified(|s| {
            if s.lost.is_none() && deadline > s.deadline {
                s.deadline = deadline;
                true
            } else {
                false
            }
        });
        let control = tokio::select! {
            changed = session.changed() => match changed {
                Ok(()) => continue,
                // Nothing extends the session any more: the guard's own deadline ends
                // it; a drop still releases.
                Err(_) => inbox.recv().await,
            },
            control = inbox.recv() => control,
        };
        match control {
            Some(never) => match never {},
            // The guard was dropped without release.
            None => {
                let _ = release(&*backend, &lease, &state, timing).await;
                return;
            }
        }
    }
}

/// Releases, retrying transient errors until the lease would have expired anyway, and
/// marks the guard released.
async fn release(
    backend: &dyn LockBackend,
    lease: &Lease,
    state: &watch::Sender<State>,
    timing: Timing,
) -> Result<bool, Error> {
    until_expiry(state, timing, || backend.release(lease)).await
}

/// Releases the grants of a multi-lock in one request, retrying transient errors until
/// the leases would have expired anyway, and marks the set released.
pub(crate) async fn release_set(
    backend: &dyn LockBackend,
    leases: &[Lease],
    state: &watch::Sender<State>,
    timing: Timing,
) -> Result<Vec<bool>, Error> {
    if leases.is_empty() {
        mark_lost(state, LostReason::Released);
        return Ok(Vec::new());
    }
    until_expiry(state, timing, || release_leases(backend, leases)).await
}

/// Releases `leases` in one request. The store refuses the whole request when one of
/// them is already gone (expired, or taken by an operator); then each is released on
/// its own (`false` for the gone ones), which is safe where acquiring one at a time
/// is not.
pub(crate) async fn release_leases(
    backend: &dyn LockBackend,
    leases: &[Lease],
) -> Result<Vec<bool>, Error> {
    match backend.release_all(leases).await {
        Err(e) if e.kind() == ErrorKind::NotHeld => {
            let mut released = Vec::with_capacity(leases.len());
            for lease in leases {
                released.push(match backend.release(lease).await {
                    Err(e) if e.kind() == ErrorKind::NotHeld => false,
                    other => other?,
                });
            }
            Ok(released)
        }
        other => other,
    }
}

/// Releases some grants of a multi-lock that keeps the others: as [`release_set`],
/// but the set is not marked released.
pub(crate) async fn release_part(
    backend: &dyn LockBackend,
    leases: &[Lease],
    state: &watch::Sender<State>,
    timing: Timing,
) -> Result<Vec<bool>, Error> {
    retry_until_expiry(state, timing, || release_leases(backend, leases)).await
}

/// Closes a session, retrying transient errors until its lease would have expired
/// anyway, and marks it released; how many locks it released (0 if it was gone).
pub(crate) async fn close_session(
    backend: &dyn LockBackend,
    session: &SessionLease,
    state: &watch::Sender<State>,
    timing: Timing,
) -> Result<usize, Error> {
    match until_expiry(state, timing, || backend.close_session(session)).await {
        // Already ended (expired, or closed by an operator): nothing left to close.
        Err(e) if e.kind() == ErrorKind::SessionNotFound => Ok(0),
        other => other,
    }
}

/// Runs `op` (a release), retrying transient errors until the lease would have expired
/// anyway, then marks the lease released.
async fn until_expiry<T, F, Fut>(
    state: &watch::Sender<State>,
    timing: Timing,
    op: F,
) -> Result<T, Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Error>>,
{
    let result = retry_until_expiry(state, timing, op).await;
    mark_lost(state, LostReason::Released);
    result
}

/// Runs `op`, retrying transient errors until the lease of `state` would have
/// expired anyway.
async fn retry_until_expiry<T, F, Fut>(
    state: &watch::Sender<State>,
    timing: Timing,
    mut op: F,
) -> Result<T, Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Error>>,
{
    let give_up = state.borrow().deadline + timing.margin;
    let mut attempt = 0u32;
    let result = loop {
        match op().await {
            Err(e) if e.is_transient() => {
                let delay = timing.backoff.delay(attempt);
                attempt = attempt.saturating_add(1);
                if Instant::now() + delay >= give_up {
                    break Err(e);
                }
                tokio::time::sleep(delay).await;
            }
            other => break other,
        }
    };
    result
}

fn mark_lost(state: &watch::Sender<State>, reason: LostReason) {
    state.send_if_modified(|s| {
        if s.lost.is_none() {
            s.lost = Some(reason);
            true
        } else {
            false
        }
    });
}

/// The background task of one guard, or of one session.
struct Renewer {
    backend: Arc<dyn LockBackend>,
    kept: Kept,
    state: Arc<watch::Sender<State>>,
    timing: Timing,
    last_sent: Instant,
}

impl Renewer {
    async fn run(mut self, mut inbox: mpsc::UnboundedReceiver<Control>) {
        loop {
            let next = self.last_sent + self.timing.ttl / 3;
            let control = tokio::select! {
                control = inbox.recv() => control,
                _ = tokio::time::sleep_until(next) => {
                    tokio::select! {
                        control = inbox.recv() => control,
                        renewed = self.renew() => match renewed {
                            Ok(()) => continue,
                            Err(reason) => {
                                let unconfirmed = matches!(reason, LostReason::DeadlineReached);
                                self.mark_lost(reason);
                                // A set is lost as a whole: the store may still hold
                                // its other grants, and nothing renews them now.
                                let set = matches!(self.kept, Kept::Leases(_));
                                if unconfirmed || set {
                                    // The grant may still exist on a slow store: free
                                    // it for the next holder (the owner token makes
                                    // this safe), but don't linger. A set's other
                                    // grants are surely still held: up to a lease.
                                    let bound = if unconfirmed {
                                        self.timing.margin
                                    } else {
                                        self.timing.ttl
                                    };
                                    let _ = tokio::time::timeout(
                                        bound,
                                        self.kept.end(&*self.backend, &self.state, self.timing),
                                    )
                                    .await;
                                }
                                return;
                            }
                        },
                    }
                }
            };
            match control {
                Some(never) => match never {},
                // The guard was dropped without release.
                None => {
                    let _ = self
                        .kept
                        .end(&*self.backend, &self.state, self.timing)
                        .await;
                    return;
                }
            }
        }
    }

    fn mark_lost(&self, reason: LostReason) {
        mark_lost(&self.state, reason);
    }

    fn deadline(&self) -> Instant {
        self.state.borrow().deadline
    }

    /// Renews until confirmed, retrying transient errors, but never past the deadline.
    async fn renew(&mut self) -> Result<(), LostReason> {
        let mut attempt = 0u32;
        loop {
            if self.state.borrow().lost.is_some() {
                return Err(LostReason::DeadlineReached);
            }
            let deadline = self.deadline();
            let sent = Instant::now();
            if sent >= deadline {
                return Err(LostReason::DeadlineReached);
            }
            let answer = tokio::time::timeout_at(
                deadline,
                self.kept.extend(&*self.backend, self.timing.ttl),
            )
            .await;
            match answer {
                Err(_elapsed) => return Err(LostReason::DeadlineReached),
                Ok(Ok(granted)) => {
                    let new_deadline = (sent + granted)
                        .checked_sub(self.timing.margin)
                        .unwrap_or(sent);
                    let mut still_held = false;
                    self.state.send_if_modified(|s| {
                        if s.lost.is_some() {
                            return false;
                        }
                        still_held = true;
                        if new_deadline > s.deadline {
                            s.deadline = new_deadline;
                            true
                        } else {
                            false
                        }
                    });
                    if !still_held {
                        return Err(LostReason::DeadlineReached);
                    }
                    self.last_sent = sent;
                    return Ok(());
                }
                Ok(Err(e)) if e.is_transient() => {
                    let delay = self.timing.backoff.delay(attempt);
                    attempt = attempt.saturating_add(1);
                    tokio::time::sleep_until((Instant::now() + delay).min(deadline)).await;
                }
                Ok(Err(e)) => return Err(LostReason::Revoked(e)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! The guard through a failover, on paused time: renewals answered `not_leader`
    //! (what a cluster says between leaders) are retried, and the lock is reported
    //! lost only at the conservative deadline.

    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;
    use fencelock_backend::{AcquireSpec, BoxFuture, Capabilities, FenceGuarantee};

    /// Renewals fail with `not_leader` while `failing` says so, then succeed.
    struct Electing {
        failing: Box<dyn Fn(u32) -> bool + Send + Sync>,
        renewals: AtomicU32,
    }

    impl LockBackend for Electing {
        fn capabilities(&self) -> Capabilities {
            let mut caps = Capabilities::new("electing", FenceGuarantee::Durable);
            caps.fifo = true;
            caps.push_wakeups = true;
            caps.lock_delay = true;
            caps.semaphores = true;
            caps.monotonic_leases = true;
            caps
        }

        fn acquire<'a>(&'a self, _: &'a AcquireSpec) -> BoxFuture<'a, Result<Lease, Error>> {
            Box::pin(async { Err(Error::new(ErrorKind::Internal, "not used")) })
        }

        fn renew<'a>(
            &'a self,
            _: &'a Lease,
            ttl: Duration,
        ) -> BoxFuture<'a, Result<Duration, Error>> {
            let n = self.renewals.fetch_add(1, Ordering::SeqCst);
            let fail = (self.failing)(n);
            Box::pin(async move {
                if fail {
                    Err(Error::not_leader("between leaders", None))
                } else {
                    Ok(ttl)
                }
            })
        }

        fn release<'a>(&'a self, _: &'a Lease) -> BoxFuture<'a, Result<bool, Error>> {
            Box::pin(async { Ok(true) })
        }
    }

    fn guard(backend: Arc<Electing>) -> LockGuard {
        let ttl = Duration::from_secs(3);
        let lease = Lease::new("l".into(), 7, "t".into(), ttl);
        let timing = Timing {
            ttl,
            margin: Duration::from_millis(300),
            backoff: Backoff::default(),
        };
        LockGuard::start(backend, lease, Instant::now(), timing)
    }

    #[tokio::test(start_paused = true)]
    async fn not_leader_renewals_are_retried_without_reporting_the_lock_lost() {
        // The first renewals (the first 1.5 s or so of retries) say not_leader.
        let backend = Arc::new(Electing {
            failing: Box::new(|n| n < 4),
            renewals: AtomicU32::new(0),
        });
        let guard = guard(backend.clone());
        let lost = guard.lost();
        tokio::pin!(lost);
        // Ten leases' worth of virtual time.
        let outcome = tokio::time::timeout(Duration::from_secs(30), &mut lost).await;
        assert!(outcome.is_err(), "lost fired: {:?}", outcome.ok());
        assert!(!guard.is_lost());
        assert!(backend.renewals.load(Ordering::SeqCst) > 10);
    }

    #[tokio::test(start_paused = true)]
    async fn a_cluster_without_a_leader_loses_the_lock_at_the_deadline_not_before() {
        let backend = Arc::new(Electing {
            failing: Box::new(|_| true),
            renewals: AtomicU32::new(0),
        });
        let start = Instant::now();
        let guard = guard(backend.clone());
        let reason = guard.lost().await;
        // Sent at `start`, 3 s lease, 300 ms margin.
        let at = start.elapsed();
        // Virtual time: the timer fires at the deadline (within its 1 ms resolution).
        assert!(
            at >= Duration::from_millis(2700) && at <= Duration::from_millis(2701),
            "{at:?} {reason:?}"
        );
        assert!(matches!(reason, LostReason::DeadlineReached), "{reason:?}");
        assert!(
            backend.renewals.load(Ordering::SeqCst) > 1,
            "renewal was retried"
        );
    }
}
