//! [`Session`]: one lease, kept alive by one background task, under which any number of
//! locks are held.

use std::future::{Future, IntoFuture};
use std::time::Duration;

use tokio::time::Instant;

use crate::client::{default_owner, LockRequest};
use crate::guard::{self, Kept, Lifeline, LostReason, Timing};
use crate::{Client, Error, ErrorKind};
use fencelock_backend::{Backoff, BoxFuture, SessionLease};

/// A session being opened: set options, then [`open`](SessionRequest::open) it (or
/// `.await` the request).
#[derive(Debug)]
#[must_use = "a session request does nothing until opened"]
pub struct SessionRequest {
    client: Client,
    ttl: Duration,
    owner: String,
    safety_margin: Option<Duration>,
    backoff: Backoff,
}

impl SessionRequest {
    pub(crate) fn new(client: Client, ttl: Duration) -> SessionRequest {
        SessionRequest {
            client,
            ttl,
            owner: default_owner(),
            safety_margin: None,
            backoff: Backoff::default(),
        }
    }

    /// Who owns the session (and the locks under it), for operators. Default:
    /// `host:pid`.
    pub fn owner(mut self, owner: impl Into<String>) -> SessionRequest {
        self.owner = owner.into();
        self
    }

    /// How long before the server could expire the session it is reported lost.
    /// Default: a tenth of the TTL (at least 1 ms).
    pub fn safety_margin(mut self, margin: Duration) -> SessionRequest {
        self.safety_margin = Some(margin);
        self
    }

    /// Retry delays for transient errors of keep-alives and of closing.
    pub fn backoff(mut self, backoff: Backoff) -> SessionRequest {
        self.backoff = backoff;
        self
    }

    /// Opens the session and starts its keep-alive. One attempt: opening is not
    /// idempotent, so a transient error is returned rather than retried (a session
    /// opened by a lost answer expires after its TTL). [`ErrorKind::Unsupported`] if
    /// the store has no sessions.
    pub async fn open(self) -> Result<Session, Error> {
        let timing = self.timing()?;
        let backend = self.client.backend();
        if !backend.capabilities().sessions {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "the {} backend does not support sessions (see its Capabilities)",
                    backend.capabilities().backend
                ),
            ));
        }
        let sent = Instant::now();
        let lease = backend.open_session(self.ttl, &self.owner).await?;
        let (lifeline, keep_alive) = Lifeline::start(
            backend,
            Kept::Session(lease.clone()),
            sent,
            lease.ttl,
            timing,
        );
        Ok(Session {
            client: self.client,
            lease,
            owner: self.owner,
            lifeline,
            keep_alive,
        })
    }

    fn timing(&self) -> Result<Timing, Error> {
        if self.ttl.is_zero() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "session ttl must be positive",
            ));
        }
        let margin = self
            .safety_margin
            .unwrap_or((self.ttl / 10).max(Duration::from_millis(1)));
        if margin >= self.ttl {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "safety margin {margin:?} must be shorter than the session ttl {:?}",
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

impl IntoFuture for SessionRequest {
    type Output = Result<Session, Error>;
    type IntoFuture = BoxFuture<'static, Result<Session, Error>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(self.open())
    }
}

/// An open session: one lease on the store, renewed by one background keep-alive,
/// under which [`lock`](Session::lock) takes any number of locks. Their guards do not
/// renew themselves; when the session is or may be lost (a keep-alive refused, or none
/// confirmed before the session's conservative deadline), every guard under it
/// reports [`LockGuard::lost`](crate::LockGuard::lost), before the store can have
/// expired the session.
///
/// [`close`](Session::close) ends it and releases its locks. Once this handle and every
/// guard taken under it are dropped, the session is closed in the background.
///
/// ```no_run
/// # async fn demo() -> Result<(), fencelock::Error> {
/// use std::time::Duration;
/// let client = fencelock::Client::connect("http://127.0.0.1:7420").await?;
/// let session = client.session(Duration::from_secs(10)).owner("worker-7").await?;
/// let a = session.lock("account:1").acquire().await?;
/// let b = session.lock("account:2").acquire().await?;
/// // One keep-alive holds both; either guard's lost() fires if the session ends.
/// println!("fences {} and {}", a.fence(), b.fence());
/// session.close().await?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Session {
    client: Client,
    lease: SessionLease,
    owner: String,
    lifeline: Lifeline,
    keep_alive: tokio::task::JoinHandle<()>,
}

impl Session {
    /// The session's id on the store (a secret: it grants acquiring under the session).
    pub fn id(&self) -> &str {
        &self.lease.id
    }

    /// The session's lease as the store granted it.
    pub fn lease(&self) -> &SessionLease {
        &self.lease
    }

    /// Starts building an acquisition of `name` held under this session: its lease is
    /// the session's (a [`ttl`](LockRequest::ttl) set on the request is ignored), and
    /// its owner defaults to the session's.
    pub fn lock(&self, name: impl Into<String>) -> LockRequest {
        self.client
            .lock(name)
            .owner(self.owner.clone())
            .in_session(self.lease.clone(), self.lifeline.clone())
    }

    /// Resolves when the session is or may be lost: a keep-alive refused (the session
    /// expired or was closed on the store), or none confirmed before the conservative
    /// deadline (last confirmed send + ttl − safety margin). Every guard under the
    /// session reports it too.
    pub fn lost(&self) -> impl Future<Output = LostReason> + Send + 'static {
        self.lifeline.lost()
    }

    /// How long the session is still certainly alive; `None` once it is or may be lost.
    pub fn valid_for(&self) -> Option<Duration> {
        self.lifeline.valid_for()
    }

    /// Whether the session is, or may be, lost.
    pub fn is_lost(&self) -> bool {
        self.valid_for().is_none()
    }

    /// Stops the keep-alive and closes the session on the store, releasing every lock
    /// held under it (their guards report [`LostReason::Released`]). Returns how many
    /// locks it released; 0 if the session had already ended.
    pub async fn close(self) -> Result<usize, Error> {
        self.keep_alive.abort();
        let result = guard::close_session(
            &*self.client.backend(),
            &self.lease,
            &self.lifeline.state,
            self.lifeline.timing,
        )
        .await;
        // Once the task has ended nothing more is sent for this session.
        let _ = (&mut { self.keep_alive }).await;
        result
    }
}
