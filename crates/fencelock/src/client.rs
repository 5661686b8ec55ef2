//! [`Client`]: locks over any [`LockBackend`], with retries, renewal and the
//! lost-lock signal.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::guard::{Lifeline, LockGuard, Timing};
use crate::server::{FencelockBackend, ServerConfig};
use crate::session::SessionRequest;
use crate::{Error, ErrorKind};
use fencelock_backend::{request_id, Backoff};
use fencelock_backend::{AcquireSpec, Capabilities, LockBackend, LockMode, SessionLease};

/// Options of one lock acquisition. Start from [`LockOptions::default`] and adjust.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockOptions {
    /// Lease length; the guard renews it in the background. Default 30 s.
    pub ttl: Duration,
    /// How long to wait for the lock (transient errors are retried within this budget
    /// too). Default 60 s; zero means answer at once; [`Duration::MAX`] waits forever
    /// (see [`LockOptions::wait_forever`]).
    pub wait: Duration,
    /// Who holds the lock, for operators. Default: `hostname:pid`-like text.
    pub owner: String,
    /// Holders the lock admits: 1 = mutex, N = semaphore. Default 1.
    pub limit: u32,
    /// After an expiry or forced release of this grant, the lock stays unavailable this
    /// long (for resources that cannot check fences). Default zero.
    pub lock_delay: Duration,
    /// How long before the lease could possibly expire on the server the guard
    /// reports the lock lost. Default: a tenth of the TTL (at least 1 ms).
    pub safety_margin: Option<Duration>,
    /// Retry delays for transient errors.
    pub backoff: Backoff,
    /// The idempotency key of this acquisition: every retry (on this or another
    /// cluster member) carries it, so a retry gets the grant or queue place an earlier
    /// attempt already made. Default: a fresh random id per acquisition. Ids are
    /// scoped to the lock name and the token; use unguessable ones.
    pub request_id: Option<String>,
    /// Exclusive (the default) or shared (a reader). A store without reader-writer
    /// locks refuses shared with [`ErrorKind::Unsupported`]; it is never granted as
    /// exclusive instead.
    pub mode: LockMode,
}

impl Default for LockOptions {
    fn default() -> LockOptions {
        LockOptions {
            ttl: Duration::from_secs(30),
            wait: Duration::from_secs(60),
            owner: default_owner(),
            limit: 1,
            lock_delay: Duration::ZERO,
            safety_margin: None,
            backoff: Backoff::default(),
            request_id: None,
            mode: LockMode::Exclusive,
        }
    }
}

impl LockOptions {
    /// Sets [`ttl`](LockOptions::ttl).
    pub fn ttl(mut self, ttl: Duration) -> LockOptions {
        self.ttl = ttl;
        self
    }

    /// Sets [`wait`](LockOptions::wait).
    pub fn wait(mut self, wait: Duration) -> LockOptions {
        self.wait = wait;
        self
    }

    /// Waits for the lock with no limit ([`wait`](LockOptions::wait) =
    /// [`Duration::MAX`]); the server is asked again at least hourly.
    pub fn wait_forever(self) -> LockOptions {
        self.wait(Duration::MAX)
    }

    /// Sets [`owner`](LockOptions::owner).
    pub fn owner(mut self, owner: impl Into<String>) -> LockOptions {
        self.owner = owner.into();
        self
    }

    /// Sets [`limit`](LockOptions::limit) (a semaphore of `limit` holders).
    pub fn limit(mut self, limit: u32) -> LockOptions {
        self.limit = limit;
        self
    }

    /// Sets [`lock_delay`](LockOptions::lock_delay).
    pub fn lock_delay(mut self, lock_delay: Duration) -> LockOptions {
        self.lock_delay = lock_delay;
        self
    }

    /// Sets [`safety_margin`](LockOptions::safety_margin).
    pub fn safety_margin(mut self, margin: Duration) -> LockOptions {
        self.safety_margin = Some(margin);
        self
    }

    /// Sets [`backoff`](LockOptions::backoff).
    pub fn backoff(mut self, backoff: Backoff) -> LockOptions {
        self.backoff = backoff;
        self
    }

    /// Sets [`request_id`](LockOptions::request_id).
    pub fn request_id(mut self, id: impl Into<String>) -> LockOptions {
        self.request_id = Some(id.into());
        self
    }

    /// Sets [`mode`](LockOptions::mode).
    pub fn mode(mut self, mode: LockMode) -> LockOptions {
        self.mode = mode;
        self
    }

    pub(crate) fn validate(&self) -> Result<Timing, Error> {
        if self.ttl.is_zero() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "ttl must be positive",
            ));
        }
        if self.limit == 0 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "limit must be at least 1",
            ));
        }
        let margin = self
            .safety_margin
            .unwrap_or((self.ttl / 10).max(Duration::from_millis(1)));
        if margin >= self.ttl {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "safety margin {margin:?} must be shorter than the ttl {:?}",
                    self.ttl
                ),
            ));
        }
        Ok(Timing {
            ttl: self.ttl,
            margin,
            backoff: self.backoff,
        })
    }
}

/// `host:pid`, worked out once per process (it was read from `/etc/hostname` on every
/// lock request).
pub(crate) fn default_owner() -> String {
    static OWNER: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    OWNER.get_or_init(host_and_pid).clone()
}

fn host_and_pid() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|h| h.trim().to_owned())
        })
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown-host".to_owned());
    format!("{host}:{}", std::process::id())
}

/// Takes locks on a lock store, renews them in the background and says when they are
/// lost. Cheap to clone; clones share the connection.
///
/// ```no_run
/// # async fn demo() -> Result<(), fencelock::Error> {
/// use std::time::Duration;
/// let client = fencelock::Client::connect("http://127.0.0.1:7420").await?;
/// let guard = client
///     .lock("inventory:item:1234")
///     .ttl(Duration::from_secs(30))
///     .wait(Duration::from_secs(10))
///     .acquire()
///     .await?;
/// // Pass guard.fence() with every write to the protected resource.
/// println!("holding with fence {}", guard.fence());
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Client {
    backend: Arc<dyn LockBackend>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("backend", &self.backend.capabilities().backend)
            .finish()
    }
}

impl Client {
    /// Connects to a fencelock server at `url`, e.g. `http://127.0.0.1:7420`, with the
    /// default timeouts; for a cluster, the members' URLs separated by commas
    /// (`http://10.0.0.1:7420,http://10.0.0.2:7420`): requests follow the leader.
    /// Fails with [`ErrorKind::Unavailable`] if no server can be reached; later
    /// connection failures are retried per request.
    pub async fn connect(url: &str) -> Result<Client, Error> {
        Client::connect_with(ServerConfig::new(url)).await
    }

    /// Connects to a fencelock server with explicit settings (timeouts, token, the
    /// endpoints of a cluster: [`ServerConfig::with_endpoints`]).
    pub async fn connect_with(config: ServerConfig) -> Result<Client, Error> {
        Ok(Client::new(FencelockBackend::connect(config).await?))
    }

    /// A client over any lock store.
    pub fn new(backend: impl LockBackend) -> Client {
        Client {
            backend: Arc::new(backend),
        }
    }

    /// A client over a shared lock store.
    pub fn from_backend(backend: Arc<dyn LockBackend>) -> Client {
        Client { backend }
    }

    /// What the lock store behind this client guarantees.
    pub fn capabilities(&self) -> Capabilities {
        self.backend.capabilities()
    }

    /// Starts building an acquisition of `name` with default [`LockOptions`].
    pub fn lock(&self, name: impl Into<String>) -> LockRequest {
        LockRequest {
            client: self.clone(),
            name: name.into(),
            options: LockOptions::default(),
            session: None,
        }
    }

    /// Starts building a multi-lock: every name in `names` acquired as one
    /// all-or-nothing request, one fence per name, renewed together
    /// ([`MultiLockGuard`](crate::MultiLockGuard)). Two clients asking for overlapping
    /// sets in any order cannot deadlock. [`ErrorKind::Unsupported`] on a store whose
    /// [`Capabilities::multi`] is false (the locks are never taken one at a time
    /// instead).
    ///
    /// ```no_run
    /// # async fn demo(client: fencelock::Client) -> Result<(), fencelock::Error> {
    /// let both = client.lock_all(["account:17", "account:42"]).acquire().await?;
    /// let from = both.fence("account:17");
    /// let to = both.fence("account:42");
    /// // ... debit with `from`, credit with `to` ...
    /// # let _ = (from, to);
    /// both.release().await?;
    /// # Ok(()) }
    /// ```
    pub fn lock_all<I, S>(&self, names: I) -> crate::MultiLockRequest
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        crate::MultiLockRequest::new(self.clone(), names.into_iter().map(Into::into).collect())
    }

    /// Starts opening a session with lease `ttl`: locks taken under it
    /// ([`Session::lock`](crate::Session::lock)) share its one keep-alive and are all
    /// lost when it is. `.await` it (or call [`open`](SessionRequest::open)) to open;
    /// [`ErrorKind::Unsupported`] if the store has no sessions
    /// ([`Capabilities::sessions`]).
    pub fn session(&self, ttl: Duration) -> SessionRequest {
        SessionRequest::new(self.clone(), ttl)
    }

    pub(crate) fn backend(&self) -> Arc<dyn LockBackend> {
        self.backend.clone()
    }

    /// Acquires `name`, runs `work(&guard)` while holding it, and releases it.
    ///
    /// If the lock is lost while `work` runs, `work` is cancelled (dropped at its next
    /// `.await`) and the result is an error of kind [`ErrorKind::LockLost`]. `work`
    /// must pass [`guard.fence()`](LockGuard::fence) to every write of the protected
    /// resource: cancellation stops this task, not a write already on the wire.
    ///
    /// ```no_run
    /// # async fn demo(client: fencelock::Client) -> Result<(), fencelock::Error> {
    /// let fence = client
    ///     .with_lock("job:nightly", fencelock::LockOptions::default(), async |guard| {
    ///         // write to the resource with guard.fence() ...
    ///         guard.fence()
    ///     })
    ///     .await?;
    /// # let _ = fence; Ok(()) }
    /// ```
    pub async fn with_lock<F, T>(
        &self,
        name: impl Into<String>,
        options: LockOptions,
        work: F,
    ) -> Result<T, Error>
    where
        F: AsyncFnOnce(&LockGuard) -> T,
    {
        let guard = self.lock(name).options(options).acquire().await?;
        let lost = guard.lost();
        let output = {
            let work = work(&guard);
            tokio::select! {
                biased;
                reason = lost => Err(reason),
                output = work => Ok(output),
            }
        };
        match output {
            Err(reason) => Err(reason.into_error(guard.name())),
            Ok(output) => {
                // The work is done; a failed release only leaves the lease to expire.
                let _ = guard.release().await;
                Ok(output)
            }
        }
    }

    async fn acquire(
        &self,
        name: String,
        options: LockOptions,
        session: Option<InSession>,
    ) -> Result<LockGuard, Error> {
        self.acquire_as(name, options, session, None).await
    }

    /// Refuses what the store cannot do honestly, before anything is sent: a shared
    /// lock on a store without them must not become an exclusive one.
    fn check_kind(&self, options: &LockOptions, campaign: Option<&str>) -> Result<(), Error> {
        let caps = self.capabilities();
        if options.mode == LockMode::Shared && !caps.shared {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("the {} backend has no shared (reader) locks", caps.backend),
            ));
        }
        if let Some(value) = campaign {
            if !caps.elections {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    format!("the {} backend has no elections", caps.backend),
                ));
            }
            fencelock_backend::validate_value(value)?;
        }
        Ok(())
    }

    /// Acquires `name` as a lock, or with `campaign` as the value of a leader in the
    /// election `name`.
    pub(crate) async fn acquire_as(
        &self,
        name: String,
        options: LockOptions,
        session: Option<InSession>,
        campaign: Option<&str>,
    ) -> Result<LockGuard, Error> {
        self.check_kind(&options, campaign)?;
        let timing = options.validate()?;
        let budget_end = budget_end(options.wait);
        let mut attempt = 0u32;
        let mut spec = AcquireSpec::new(name, options.ttl);
        spec.wait = options.wait;
        spec.owner = options.owner.clone();
        spec.limit = options.limit;
        spec.lock_delay = options.lock_delay;
        spec.mode = options.mode;
        // One id for every attempt of this acquisition, whichever member gets it.
        spec.request_id = options.request_id.clone().unwrap_or_else(request_id);
        if let Some(InSession(lease, _)) = &session {
            spec.session = Some(lease.id.clone());
            spec.ttl = lease.ttl;
        }
        // The first send of this request id: a retry can return a grant made for an
        // earlier attempt, whose lease started no earlier than this.
        let mut first_sent: Option<Instant> = None;
        loop {
            let sent = Instant::now();
            let lease_base = *first_sent.get_or_insert(sent);
            spec.wait = budget_end.saturating_duration_since(sent);
            let answer = match campaign {
                Some(value) => self.backend.campaign(&spec, value).await,
                None => self.backend.acquire(&spec).await,
            };
            match answer {
                Ok(lease) if session.is_some() => {
                    return self.held_in_session(lease, session);
                }
                Ok(mut lease) => {
                    let mut lease_base = lease_base;
                    // After a long wait in the queue the send instant proves little of
                    // the lease (it started when the wait ended): a renewal sent now
                    // proves a fresh one before the guard is handed out.
                    if Instant::now().saturating_duration_since(lease_base) > options.ttl / 4 {
                        match self.confirm(&lease, &options, budget_end).await {
                            Ok((sent, ttl)) => {
                                lease_base = sent;
                                lease.ttl = ttl;
                            }
                            Err(e) if e.kind() == ErrorKind::NotHeld => {
                                // Expired before it could be used: a fresh attempt.
                                spec.request_id = request_id();
                                first_sent = None;
                                if Instant::now() >= budget_end {
                                    return Err(Error::new(
                                        ErrorKind::Timeout,
                                        format!(
                                            "{:?} not acquired within {:?}",
                                            spec.name, options.wait
                                        ),
                                    ));
                                }
                                continue;
                            }
                            Err(e) => {
                                let _ = self.backend.release(&lease).await;
                                return Err(e);
                            }
                        }
                    }
                    return Ok(LockGuard::start(
                        self.backend.clone(),
                        lease,
                        lease_base,
                        timing,
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
                // The last sliver of a wait budget is sent as "don't wait": still a
                // timeout to the caller who asked to wait.
                Err(e) if e.kind() == ErrorKind::Held && !options.wait.is_zero() => {
                    return Err(Error::new(ErrorKind::Timeout, e.message()));
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// The instant a wait budget of `wait` ends; [`Duration::MAX`] (waiting forever) ends
/// in the far future instead of overflowing.
pub(crate) fn budget_end(wait: Duration) -> Instant {
    const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
    let now = Instant::now();
    now.checked_add(wait.min(FOREVER))
        .or_else(|| now.checked_add(Duration::from_secs(365 * 24 * 3600)))
        .unwrap_or(now)
}

/// The session a lock request is bound to.
#[derive(Debug, Clone)]
pub(crate) struct InSession(SessionLease, Lifeline);

impl Client {
    /// The guard of a grant made under a session; the lock error if the session was
    /// lost by the time the grant arrived (the grant is then given back).
    fn held_in_session(
        &self,
        lease: crate::Lease,
        session: Option<InSession>,
    ) -> Result<LockGuard, Error> {
        let Some(InSession(_, lifeline)) = session else {
            return Err(Error::new(ErrorKind::Internal, "no session"));
        };
        if let Some(reason) = lifeline.lost_reason() {
            let backend = self.backend.clone();
            let name = lease.name.clone();
            // The store may already have dropped it with the session; the owner token
            // makes this safe either way.
            tokio::spawn(async move {
                let _ = backend.release(&lease).await;
            });
            return Err(reason.into_error(&name));
        }
        Ok(LockGuard::start_in_session(
            self.backend.clone(),
            lease,
            &lifeline,
        ))
    }

    /// Renews a fresh grant once, retrying transient errors within the wait budget;
    /// returns the renewal's send instant and the lease length it granted.
    async fn confirm(
        &self,
        lease: &crate::Lease,
        options: &LockOptions,
        budget_end: Instant,
    ) -> Result<(Instant, Duration), Error> {
        let mut attempt = 0u32;
        loop {
            let sent = Instant::now();
            match self.backend.renew(lease, options.ttl).await {
                Ok(ttl) => return Ok((sent, ttl)),
                Err(e) if e.is_transient() => {
                    let delay = options.backoff.delay(attempt);
                    attempt = attempt.saturating_add(1);
                    if Instant::now() + delay >= budget_end {
                        return Err(e);
                    }
                    tokio::time::sleep(delay).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// An acquisition being built: set options, then [`acquire`](LockRequest::acquire) or
/// [`try_acquire`](LockRequest::try_acquire).
#[derive(Debug)]
#[must_use = "a lock request does nothing until acquired"]
pub struct LockRequest {
    client: Client,
    name: String,
    options: LockOptions,
    /// Held under this session's lease instead of one of its own.
    session: Option<InSession>,
}

impl LockRequest {
    /// Replaces all options.
    pub fn options(mut self, options: LockOptions) -> LockRequest {
        self.options = options;
        self
    }

    /// Lease length (renewed in the background).
    pub fn ttl(mut self, ttl: Duration) -> LockRequest {
        self.options.ttl = ttl;
        self
    }

    /// How long to wait for the lock.
    pub fn wait(mut self, wait: Duration) -> LockRequest {
        self.options.wait = wait;
        self
    }

    /// Waits for the lock with no limit (see [`LockOptions::wait_forever`]).
    pub fn wait_forever(self) -> LockRequest {
        self.wait(Duration::MAX)
    }

    /// Binds the request to a session (see [`crate::Session::lock`]).
    pub(crate) fn in_session(mut self, lease: SessionLease, lifeline: Lifeline) -> LockRequest {
        self.session = Some(InSession(lease, lifeline));
        self
    }

    /// Who holds the lock, for operators.
    pub fn owner(mut self, owner: impl Into<String>) -> LockRequest {
        self.options.owner = owner.into();
        self
    }

    /// A semaphore admitting `limit` holders.
    pub fn limit(mut self, limit: u32) -> LockRequest {
        self.options.limit = limit;
        self
    }

    /// Lock-delay after an expiry or forced release of this grant.
    pub fn lock_delay(mut self, lock_delay: Duration) -> LockRequest {
        self.options.lock_delay = lock_delay;
        self
    }

    /// How long before the server could expire the lease the guard reports it lost.
    pub fn safety_margin(mut self, margin: Duration) -> LockRequest {
        self.options.safety_margin = Some(margin);
        self
    }

    /// The idempotency key every attempt of this acquisition carries (default: a
    /// fresh random one).
    pub fn request_id(mut self, id: impl Into<String>) -> LockRequest {
        self.options.request_id = Some(id.into());
        self
    }

    /// Exclusive (the default) or [`LockMode::Shared`]; see [`LockOptions::mode`].
    pub fn mode(mut self, mode: LockMode) -> LockRequest {
        self.options.mode = mode;
        self
    }

    /// A shared (reader) lock: any number of readers hold it together, never with a
    /// writer. [`ErrorKind::Unsupported`] on a store whose
    /// [`Capabilities::shared`] is false.
    pub fn shared(self) -> LockRequest {
        self.mode(LockMode::Shared)
    }

    /// Acquires the lock, waiting up to the wait budget. Errors: [`ErrorKind::Timeout`]
    /// if not granted in time (or [`ErrorKind::Held`] with a zero wait), a transient
    /// kind if the store stayed unreachable for the whole budget, or a permanent one.
    pub async fn acquire(self) -> Result<LockGuard, Error> {
        self.client
            .acquire(self.name, self.options, self.session)
            .await
    }

    /// Acquires the lock only if it is free now: [`ErrorKind::Held`] otherwise.
    pub async fn try_acquire(mut self) -> Result<LockGuard, Error> {
        self.options.wait = Duration::ZERO;
        self.acquire().await
    }
}
