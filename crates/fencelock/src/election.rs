//! Leader elections over any [`LockBackend`] that has them: [`Election`],
//! [`Leadership`] and [`Election::run_as_leader`].
//!
//! An election is a lock with a value: the leader holds it exclusively, its value (an
//! address, say) is what the others read, and its term is the grant's fence. So the
//! leader's writes are fenced like any holder's, and [`Leadership::lost`] is the
//! guard's lost-lock signal: it fires before the store can have let another leader in.
//!
//! ```no_run
//! # async fn demo() -> Result<(), fencelock::Error> {
//! use std::time::Duration;
//! use futures_util::StreamExt;
//!
//! let client = fencelock::Client::connect("http://127.0.0.1:7420").await?;
//! let election = client.election("scheduler").ttl(Duration::from_secs(10));
//!
//! // Followers: who leads, and every change.
//! let mut changes = Box::pin(election.observe());
//! if let Some(Ok(Some(leader))) = changes.next().await {
//!     println!("{} leads at term {} ({})", leader.owner, leader.term, leader.value);
//! }
//!
//! // A candidate: run the scheduler while leading, stop it the moment leadership may
//! // be lost.
//! let outcome = election
//!     .run_as_leader(
//!         "10.0.0.7:8080",
//!         |term| println!("leading at term {term}"),
//!         |term| async move { /* schedule, passing `term` as the fence */ term },
//!         |term| println!("stopped leading at term {term}"),
//!     )
//!     .await;
//! # let _ = outcome;
//! # Ok(()) }
//! ```

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::Stream;

use crate::client::{Client, LockOptions};
use crate::guard::{LockGuard, LostReason};
use crate::{Error, ErrorKind};
use fencelock_backend::{Leader, LockBackend};

/// How long one push wait ([`LockBackend::leader_change`]) lasts before it is asked
/// again: a bound on a watch silently lost in a network failure.
const PUSH_WAIT: Duration = Duration::from_secs(30);

impl Client {
    /// The election `name`, with default [`LockOptions`] for campaigns (lease 30 s,
    /// wait 60 s). [`ErrorKind::Unsupported`] from its calls on a store whose
    /// [`Capabilities::elections`](crate::Capabilities::elections) is false.
    pub fn election(&self, name: impl Into<String>) -> Election {
        Election {
            client: self.clone(),
            name: name.into(),
            options: LockOptions::default(),
        }
    }
}

/// One election: campaign in it, or read and follow its leader. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Election {
    client: Client,
    name: String,
    options: LockOptions,
}

impl Election {
    /// The election's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Replaces the campaign options (lease, wait, owner, backoff, safety margin).
    pub fn options(mut self, options: LockOptions) -> Election {
        self.options = options;
        self
    }

    /// The leader's lease length (renewed in the background while it leads).
    pub fn ttl(mut self, ttl: Duration) -> Election {
        self.options.ttl = ttl;
        self
    }

    /// How long [`campaign`](Election::campaign) waits to become leader.
    pub fn wait(mut self, wait: Duration) -> Election {
        self.options.wait = wait;
        self
    }

    /// Who campaigns, for operators (shows as [`Leader::owner`]).
    pub fn owner(mut self, owner: impl Into<String>) -> Election {
        self.options.owner = owner.into();
        self
    }

    /// Campaigns with `value` (at most [`MAX_VALUE_BYTES`](crate::MAX_VALUE_BYTES),
    /// no control characters): waits up to the wait budget to lead, then returns the
    /// leadership, renewed in the background like a lock. [`ErrorKind::Timeout`] if
    /// another candidate led the whole time.
    pub async fn campaign(&self, value: impl Into<String>) -> Result<Leadership, Error> {
        let value = value.into();
        let mut options = self.options.clone();
        options.limit = 1;
        options.mode = crate::LockMode::Exclusive;
        let guard = self
            .client
            .acquire_as(self.name.clone(), options, None, Some(&value))
            .await?;
        Ok(Leadership {
            backend: self.client.backend(),
            guard,
        })
    }

    /// Who leads now, if anyone.
    pub async fn leader(&self) -> Result<Option<Leader>, Error> {
        self.check()?;
        self.client.backend().leader(&self.name).await
    }

    /// The leader now, then every change of leader, value or term (`None`: nobody
    /// leads). Pushed by the store where it can ([`LockBackend::leader_change`]: etcd,
    /// ZooKeeper), else polled with the options' backoff. Transient errors are retried
    /// quietly; a permanent one is the last item.
    pub fn observe(&self) -> impl Stream<Item = Result<Option<Leader>, Error>> + Send + 'static {
        let observer = Observer {
            backend: self.client.backend(),
            name: self.name.clone(),
            backoff: self.options.backoff,
            known: None,
            push: true,
            quiet_polls: 0,
            failures: 0,
            done: self.check().err(),
            ended: false,
        };
        futures_util::stream::unfold(observer, |mut observer| async move {
            let item = observer.next().await?;
            Some((item, observer))
        })
    }

    /// Campaigns with `value`, and once leading calls `started(term)`, runs
    /// `work(term)` until it finishes or leadership is lost, then calls
    /// `stopped(term)`. If leadership is lost first, `work` is dropped at its next
    /// `.await` and the result is [`ErrorKind::LockLost`]; if `work` finishes, the
    /// leader resigns and its output is returned. `work` must pass the term as the
    /// fence with every write: dropping it stops this task, not a write already sent.
    pub async fn run_as_leader<S, W, Fut, T, E>(
        &self,
        value: impl Into<String>,
        started: S,
        work: W,
        stopped: E,
    ) -> Result<T, Error>
    where
        S: FnOnce(u64),
        W: FnOnce(u64) -> Fut,
        Fut: Future<Output = T>,
        E: FnOnce(u64),
    {
        let leadership = self.campaign(value).await?;
        let term = leadership.term();
        let lost = leadership.lost();
        started(term);
        let work = work(term);
        let outcome = tokio::select! {
            biased;
            reason = lost => Err(reason.into_error(&self.name)),
            output = work => Ok(output),
        };
        stopped(term);
        if outcome.is_ok() {
            // The work is done; a failed resignation only leaves the lease to expire.
            let _ = leadership.resign().await;
        }
        outcome
    }

    fn check(&self) -> Result<(), Error> {
        let caps = self.client.capabilities();
        if caps.elections {
            Ok(())
        } else {
            Err(Error::new(
                ErrorKind::Unsupported,
                format!("the {} backend has no elections", caps.backend),
            ))
        }
    }
}

/// State of one [`Election::observe`] stream.
struct Observer {
    backend: Arc<dyn LockBackend>,
    name: String,
    backoff: crate::Backoff,
    /// The last leader emitted; `None` before the first item.
    known: Option<Option<Leader>>,
    /// Whether the store may push changes (until it says `Unsupported`).
    push: bool,
    /// Polls in a row that saw no change: the poll interval grows with them.
    quiet_polls: u32,
    /// Transient failures in a row.
    failures: u32,
    /// A permanent error to emit as the last item.
    done: Option<Error>,
    ended: bool,
}

impl Observer {
    /// The next change, a final error, or `None` after that error.
    async fn next(&mut self) -> Option<Result<Option<Leader>, Error>> {
        if self.ended {
            return None;
        }
        if let Some(e) = self.done.take() {
            self.ended = true;
            return Some(Err(e));
        }
        loop {
            let read = match &self.known {
                None => self.backend.leader(&self.name).await,
                Some(known) if self.push => {
                    let answer = self
                        .backend
                        .leader_change(&self.name, known.as_ref(), PUSH_WAIT)
                        .await;
                    match answer {
                        Err(e) if e.kind() == ErrorKind::Unsupported => {
                            self.push = false;
                            continue;
                        }
                        other => other,
                    }
                }
                Some(_) => {
                    tokio::time::sleep(self.backoff.delay(self.quiet_polls)).await;
                    self.quiet_polls = self.quiet_polls.saturating_add(1);
                    self.backend.leader(&self.name).await
                }
            };
            match read {
                Ok(leader) => {
                    self.failures = 0;
                    if self.known.as_ref() != Some(&leader) {
                        self.known = Some(leader.clone());
                        self.quiet_polls = 0;
                        return Some(Ok(leader));
                    }
                }
                Err(e) if e.is_transient() => {
                    tokio::time::sleep(self.backoff.delay(self.failures)).await;
                    self.failures = self.failures.saturating_add(1);
                }
                Err(e) => {
                    self.ended = true;
                    return Some(Err(e));
                }
            }
        }
    }
}

/// Leading an election: a [`LockGuard`] on the election, renewed in the background,
/// with the leader's value. Dropping it resigns in the background.
#[derive(Debug)]
pub struct Leadership {
    backend: Arc<dyn LockBackend>,
    guard: LockGuard,
}

impl Leadership {
    /// The leader's term: larger than every earlier leader's. Pass it as the fence
    /// with every write the leader makes.
    pub fn term(&self) -> u64 {
        self.guard.fence()
    }

    /// The election's name.
    pub fn name(&self) -> &str {
        self.guard.name()
    }

    /// Resolves when leadership is or may be lost (the guard's lost-lock signal, see
    /// [`LockGuard::lost`]).
    pub fn lost(&self) -> impl Future<Output = LostReason> + Send + 'static {
        self.guard.lost()
    }

    /// Whether leadership is, or may be, lost.
    pub fn is_lost(&self) -> bool {
        self.guard.is_lost()
    }

    /// Publishes a new value for the followers. [`ErrorKind::NotHeld`] once this
    /// leadership is lost or resigned, from the store (its check decides, not this
    /// process's clock) or at once if this guard already knows.
    pub async fn proclaim(&self, value: impl Into<String>) -> Result<(), Error> {
        let value = value.into();
        fencelock_backend::validate_value(&value)?;
        if self.guard.is_lost() {
            return Err(Error::new(
                ErrorKind::NotHeld,
                format!("no longer leading {:?}", self.guard.name()),
            ));
        }
        self.backend.proclaim(self.guard.lease(), &value).await
    }

    /// Steps down: the next candidate can lead. `Ok(false)` if leadership was already
    /// gone.
    pub async fn resign(self) -> Result<bool, Error> {
        self.guard.release().await
    }

    /// The underlying guard (its lease and owner token).
    pub fn guard(&self) -> &LockGuard {
        &self.guard
    }
}

#[cfg(test)]
mod tests {
    //! The election layer over an in-memory store, on paused time.

    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
    use std::sync::Mutex;

    use futures_util::StreamExt;

    use super::*;
    use fencelock_backend::{AcquireSpec, BoxFuture, Capabilities, FenceGuarantee, Lease};

    /// One election at most, held by whoever campaigned last; renewals fail once
    /// `revoked` is set (as if an operator or an expiry ended the term).
    #[derive(Default)]
    struct Store {
        leader: Mutex<Option<Leader>>,
        revoked: AtomicBool,
        terms: AtomicU32,
        acquires: AtomicU32,
        push: bool,
        elections: bool,
        /// `leader_change` calls answered.
        pushes: AtomicU32,
    }

    impl LockBackend for Store {
        fn capabilities(&self) -> Capabilities {
            let mut caps = Capabilities::new("memory", FenceGuarantee::Durable);
            caps.elections = self.elections;
            caps
        }

        fn acquire<'a>(&'a self, spec: &'a AcquireSpec) -> BoxFuture<'a, Result<Lease, Error>> {
            self.acquires.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move { Ok(Lease::new(spec.name.clone(), 1, "t".into(), spec.ttl)) })
        }

        fn renew<'a>(
            &'a self,
            _: &'a Lease,
            ttl: Duration,
        ) -> BoxFuture<'a, Result<Duration, Error>> {
            let revoked = self.revoked.load(Ordering::SeqCst);
            Box::pin(async move {
                if revoked {
                    Err(Error::new(ErrorKind::NotHeld, "revoked"))
                } else {
                    Ok(ttl)
                }
            })
        }

        fn release<'a>(&'a self, _: &'a Lease) -> BoxFuture<'a, Result<bool, Error>> {
            *self.leader.lock().unwrap() = None;
            Box::pin(async { Ok(true) })
        }

        fn campaign<'a>(
            &'a self,
            spec: &'a AcquireSpec,
            value: &'a str,
        ) -> BoxFuture<'a, Result<Lease, Error>> {
            let term = u64::from(self.terms.fetch_add(1, Ordering::SeqCst)) + 1;
            *self.leader.lock().unwrap() = Some(Leader::new(
                spec.name.clone(),
                value.to_owned(),
                term,
                spec.owner.clone(),
            ));
            Box::pin(async move { Ok(Lease::new(spec.name.clone(), term, "t".into(), spec.ttl)) })
        }

        fn proclaim<'a>(
            &'a self,
            _: &'a Lease,
            value: &'a str,
        ) -> BoxFuture<'a, Result<(), Error>> {
            if let Some(leader) = self.leader.lock().unwrap().as_mut() {
                leader.value = value.to_owned();
            }
            Box::pin(async { Ok(()) })
        }

        fn leader<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Result<Option<Leader>, Error>> {
            let leader = self.leader.lock().unwrap().clone();
            Box::pin(async move { Ok(leader) })
        }

        fn leader_change<'a>(
            &'a self,
            name: &'a str,
            known: Option<&'a Leader>,
            wait: Duration,
        ) -> BoxFuture<'a, Result<Option<Leader>, Error>> {
            if !self.push {
                return Box::pin(async { Err(Error::new(ErrorKind::Unsupported, "no push")) });
            }
            Box::pin(async move {
                let end = tokio::time::Instant::now() + wait;
                loop {
                    let now = self.leader(name).await?;
                    if now.as_ref() != known || tokio::time::Instant::now() >= end {
                        self.pushes.fetch_add(1, Ordering::SeqCst);
                        return Ok(now);
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            })
        }
    }

    fn store(push: bool) -> Arc<Store> {
        Arc::new(Store {
            push,
            elections: true,
            ..Store::default()
        })
    }

    #[tokio::test(start_paused = true)]
    async fn run_as_leader_stops_its_work_on_loss() {
        let store = store(false);
        let client = Client::from_backend(store.clone());
        let election = client.election("scheduler").ttl(Duration::from_secs(3));
        let events = Arc::new(Mutex::new(Vec::new()));
        let (started, stopped, worked) = (events.clone(), events.clone(), events.clone());
        let revoke = store.clone();
        // Virtual time: a leadership of 3 s is lost within a few renewals; a minute
        // passing means the work outlived it.
        let run = election.run_as_leader(
            "me",
            move |term| started.lock().unwrap().push(format!("started {term}")),
            move |term| async move {
                // Leadership ends under the work; the work would run forever.
                revoke.revoked.store(true, Ordering::SeqCst);
                loop {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    worked.lock().unwrap().push(format!("tick {term}"));
                }
            },
            move |term| stopped.lock().unwrap().push(format!("stopped {term}")),
        );
        let outcome: Result<(), Error> = tokio::time::timeout(Duration::from_secs(60), run)
            .await
            .expect("the work was not stopped when leadership was lost");
        let e = outcome.expect_err("the work outlived its leadership");
        assert_eq!(e.kind(), ErrorKind::LockLost, "{e}");
        let events = events.lock().unwrap().clone();
        assert_eq!(events.first().map(String::as_str), Some("started 1"));
        assert_eq!(events.last().map(String::as_str), Some("stopped 1"));
        // No tick after "stopped": the work was dropped before the callback.
        assert!(events[1..events.len() - 1].iter().all(|e| e == "tick 1"));
    }

    #[tokio::test(start_paused = true)]
    async fn run_as_leader_resigns_when_the_work_ends() {
        let store = store(false);
        let client = Client::from_backend(store.clone());
        let output = client
            .election("scheduler")
            .run_as_leader("me", |_| {}, |term| async move { term * 10 }, |_| {})
            .await
            .expect("led");
        assert_eq!(output, 10);
        assert_eq!(store.leader.lock().unwrap().clone(), None, "did not resign");
    }

    async fn observe_changes(push: bool) {
        let store = store(push);
        let client = Client::from_backend(store.clone());
        let election = client.election("e");
        let mut changes = Box::pin(election.observe());
        assert_eq!(changes.next().await.expect("item").expect("read"), None);
        let leadership = election.campaign("a").await.expect("campaign");
        let seen = changes.next().await.expect("item").expect("read");
        assert_eq!(seen.map(|l| (l.value, l.term)), Some(("a".to_owned(), 1)));
        leadership.proclaim("b").await.expect("proclaim");
        let seen = changes.next().await.expect("item").expect("read");
        assert_eq!(seen.map(|l| (l.value, l.term)), Some(("b".to_owned(), 1)));
        leadership.resign().await.expect("resign");
        assert_eq!(changes.next().await.expect("item").expect("read"), None);
        assert_eq!(store.pushes.load(Ordering::SeqCst) > 0, push);
    }

    #[tokio::test(start_paused = true)]
    async fn observe_polls_and_emits_only_changes() {
        observe_changes(false).await;
    }

    #[tokio::test(start_paused = true)]
    async fn observe_uses_the_stores_push() {
        observe_changes(true).await;
    }

    #[tokio::test]
    async fn a_store_without_shared_locks_refuses_them_instead_of_granting_exclusive() {
        let store = store(false);
        let client = Client::from_backend(store.clone());
        let e = client
            .lock("l")
            .shared()
            .acquire()
            .await
            .expect_err("granted");
        assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
        assert_eq!(
            store.acquires.load(Ordering::SeqCst),
            0,
            "sent to the store"
        );
    }

    #[tokio::test]
    async fn a_store_without_elections_says_unsupported() {
        let store = Arc::new(Store::default());
        let client = Client::from_backend(store);
        let election = client.election("e");
        let e = election.campaign("v").await.expect_err("campaigned");
        assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
        let e = election.leader().await.expect_err("read");
        assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
        let first = Box::pin(election.observe()).next().await.expect("item");
        assert_eq!(first.expect_err("observed").kind(), ErrorKind::Unsupported);
    }

    #[tokio::test(start_paused = true)]
    async fn a_store_without_downgrade_says_unsupported() {
        let client = Client::from_backend(store(false));
        let guard = client.lock("l").acquire().await.expect("acquire");
        let e = guard.downgrade().await.expect_err("downgraded");
        assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
        assert!(
            !guard.is_lost(),
            "a refused downgrade must leave the lock held"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn proclaim_after_loss_is_not_held() {
        let store = store(false);
        let client = Client::from_backend(store.clone());
        let leadership = client.election("e").campaign("a").await.expect("campaign");
        store.revoked.store(true, Ordering::SeqCst);
        leadership.lost().await;
        let e = leadership.proclaim("b").await.expect_err("proclaimed");
        assert_eq!(e.kind(), ErrorKind::NotHeld, "{e}");
    }
}
