//! etcd v3 as a [`LockBackend`] (feature `etcd`): [`EtcdBackend`].
//!
//! # The recipe
//!
//! The lock is etcd's own `concurrency.Mutex` recipe, spoken over gRPC (KV, Watch and
//! Lease services; no `v3lock` service, so key names stay ours):
//!
//! - Every grant has **its own etcd lease**, with the requested ttl rounded **up** to
//!   whole seconds (etcd leases are whole seconds, and etcd raises leases below its
//!   minimum — 1.5 × the election timeout, rounded up: 2 s with default settings). The
//!   [`Lease::ttl`] returned is the length etcd granted, never the one asked for.
//! - The grant is the key `<prefix>/<lock name>/<request id>` (both escaped, so names
//!   may contain `/` or any other character without colliding), attached to that
//!   lease, created in one transaction: *if the key does not exist, put it*. A retry
//!   with the same request id finds its own key: the same create revision, the same
//!   fence, the same owner token.
//! - The holders are the first `limit` keys under `<prefix>/<lock name>/` in create
//!   revision order; the others wait, in that order (FIFO). A mutex waiter watches only
//!   the key just ahead of it (no thundering herd on release); a semaphore waiter
//!   (`limit` > 1) watches the lock's range for deletions, since any of the holders
//!   ahead can free its place. While it waits, a waiter keeps its lease alive.
//! - A waiter whose wait runs out, or whose `acquire` future is dropped, revokes its
//!   lease, which deletes its key.
//! - The **fence** is the key's create revision: etcd's cluster-wide revision,
//!   strictly increasing and persisted through raft before the grant is answered.
//!   Holders are granted in create revision order, so each lock's fences grow.
//! - `renew` checks that the key still exists with this grant's lease and create
//!   revision, then sends one `LeaseKeepAlive` on the lease; `NotHeld` when either is
//!   gone. `release` deletes the key in a transaction that compares its create
//!   revision and lease (so it never touches another grant), then revokes the lease.
//! - A **session** is an etcd lease of its own: a grant under it puts its key on that
//!   lease instead of a new one (the owner token says so), and its release deletes the
//!   key only. The keep-alive is a `LeaseKeepAlive` of that lease; closing revokes it,
//!   deleting every key on it. A session that expires ends its grants with it.
//!
//! # Reader-writer locks and elections
//!
//! - **Shared locks** are etcd's `recipes.RWMutex` on the same queue: a reader's key
//!   carries `mode=shared`. A reader holds once no writer's key is ahead of it, and
//!   otherwise watches the nearest writer ahead; a writer holds once no key at all is
//!   ahead, and watches the nearest one. So readers share, a writer excludes them, and
//!   a queued writer blocks readers that arrive after it (FIFO across modes). Fences
//!   stay create revisions: a writer's is larger than every reader's before it.
//!   Readers are not counted: a shared lock takes `limit` 1.
//! - **Downgrade** rewrites the writer's key in place with `mode=shared` (a
//!   transaction comparing its create revision, lease and mod revision): the key keeps
//!   its create revision, so the grant keeps its fence and its place in the queue. A
//!   reader waits on the nearest writer ahead for its deletion *or a put*, so readers
//!   queued right behind hold at once; writers behind still wait for the deletion.
//!   Creating a second, reader key instead would queue it behind any writer already
//!   waiting, and deleting the writer's key would then hand that writer the lock.
//! - **Elections** are etcd's `concurrency.Election`: a candidate is an ordinary
//!   exclusive key of the election's name carrying `value=<v>`; the oldest key leads
//!   and its create revision is the term. `proclaim` rewrites the value in a
//!   transaction that compares the key's create revision and lease, so a deposed
//!   leader changes nothing (`NotHeld`); `leader` reads the oldest key; observing
//!   watches the election's keys from the revision read.
//!
//! # What etcd cannot promise
//!
//! - Leases are whole seconds, and never shorter than etcd's minimum: a 300 ms ttl is
//!   granted (and reported) as 2 s on a default cluster. `renew` cannot change a
//!   lease's length: it restores the length granted at `acquire`, whatever ttl it is
//!   given, and returns that.
//! - Lease expiry is decided by the leader on its monotonic clock (Go's `time.Now`
//!   readings carry one), never a client's clock. But a leader change *extends* every
//!   lease: the new leader gives each the full ttl again (plus an election timeout)
//!   because etcd 3.4 does not checkpoint remaining ttls by default (a restarted
//!   single member does the same). So a lease never ends before the client's deadline
//!   (the lost-lock signal stays correct), but a crashed holder may keep others waiting
//!   up to about twice its ttl across a failover or restart.
//! - Fences are durable and never reused, unless the cluster is restored from a backup
//!   (`etcdctl snapshot restore` rewinds the revision to the snapshot's): after a
//!   restore, bump the revision past any fence ever issued (`etcdutl snapshot restore
//!   --bump-revision` in etcd ≥ 3.5).
//! - No lock-delay (a `lock_delay` is refused). A waiter cut off from
//!   etcd for its whole ttl loses its place (its key expires); the next attempt queues
//!   again at the back.
//! - A holder that stops without releasing, or a waiter whose cleanup cannot reach
//!   etcd, blocks the lock until its lease runs out (at most its ttl, plus the lessor's
//!   500 ms check interval).
//! - Anyone with write access to the prefix can delete a grant's key, ending that
//!   grant early: see below for what auth protects.
//!
//! # TLS and auth
//!
//! - `https://` endpoints with [`EtcdConfig::tls`] ([`EtcdTls`]): the CA certificates
//!   to trust, and a client certificate for clusters that require one
//!   (`--client-cert-auth`), through rustls.
//! - [`EtcdConfig::credentials`] ([`EtcdCredentials`]): etcd's own users. The backend
//!   calls `Auth.Authenticate` on first use and sends the token it gets on every
//!   request. When etcd refuses the token — simple tokens (etcd's default) expire
//!   after `--auth-token-ttl` unused and all at a restart; JWT tokens also end with
//!   their ttl, and are too old after a permission change — it authenticates again
//!   and repeats the request once: etcd refuses such a request before doing
//!   anything, so repeating it is safe. A wrong user or password is
//!   [`ErrorKind::PermissionDenied`] at [`EtcdBackend::connect`] (or at first use
//!   with [`connect_lazy`](EtcdBackend::connect_lazy)); so is a user without read
//!   and write permission on the prefix. The password is sent only to `Authenticate` and
//!   never shown. Without TLS it crosses the network in clear, like everything else.
//!   A cluster without auth enabled accepts the credentials unused (as etcd's own
//!   client does).
//! - What auth protects: with a role granting read and write on `<prefix>/` to the
//!   lock users only, no other etcd user can read, take, delete or forge a grant.
//!   Among the lock users it protects nothing: each can delete any grant's key. Fences
//!   stay the protection against a holder that lost its grant.
//! - An application that already has a `tonic` [`Channel`] to etcd (its own TLS
//!   setup, a proxy, a load balancer) hands it to [`EtcdBackend::from_channel`];
//!   credentials, prefix and request timeout still come from an [`EtcdConfig`].

mod config;
mod keys;

use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Status};

use fencelock_backend::{
    AcquireSpec, BoxFuture, Capabilities, FenceGuarantee, Leader, Lease, LockBackend, LockMode,
    SessionLease,
};
use fencelock_backend::{Error, ErrorKind};
use keys::Token;
use tonic::metadata::AsciiMetadataValue;

pub use config::{EtcdConfig, EtcdCredentials, EtcdTls, MAX_ENDPOINTS};
/// The `tonic` this crate is built with, for [`EtcdBackend::from_channel`]'s
/// [`Channel`].
pub use tonic;

/// The generated etcd v3 client (KV, Watch, Lease, Auth) from the vendored
/// `proto/etcd/etcd.proto`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
mod pb {
    tonic::include_proto!("etcdserverpb");
}

use pb::compare::{CompareResult, CompareTarget, TargetUnion};
use pb::range_request::{SortOrder, SortTarget};
use pb::request_op::Request as Op;
use pb::response_op::Response as OpResponse;

/// Most keys [`EtcdBackend::queue`] lists.
pub const MAX_QUEUE_LISTED: usize = 10_000;

/// Locks in etcd v3 (see the [module docs](self) for the recipe and what etcd can and
/// cannot promise): durable fences (create revisions), FIFO waiters woken by watches,
/// semaphores, leases on the etcd leader's monotonic clock in whole seconds.
///
/// Cheap to clone; clones share the connections.
#[derive(Debug, Clone)]
pub struct EtcdBackend {
    members: Arc<Members>,
    prefix: String,
    request_timeout: Duration,
    wakeups: Arc<AtomicU64>,
    waits: Arc<AtomicU64>,
    /// With credentials: the current token.
    auth: Option<Arc<Auth>>,
}

/// One key under a lock, as [`EtcdBackend::queue`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueueEntry {
    /// The etcd key.
    pub key: String,
    /// The request id of the acquire that made it.
    pub request_id: String,
    /// Its create revision: the fence of the grant, once it holds.
    pub fence: u64,
    /// The etcd lease it is attached to.
    pub lease_id: i64,
    /// The limit it asked for.
    pub limit: u32,
    /// Exclusive, or shared (a reader).
    pub mode: LockMode,
    /// Who asked.
    pub owner: String,
}

impl EtcdBackend {
    /// Connects to the cluster, failing with [`ErrorKind::Unavailable`] if no member
    /// answers a linearizable read within `request_timeout`.
    pub async fn connect(config: EtcdConfig) -> Result<EtcdBackend, Error> {
        // A server that wants a client certificate and gets none drops the connection
        // after the handshake: the error alone does not say why.
        let hint = config
            .tls
            .as_ref()
            .is_some_and(|tls| !tls.has_client_certificate());
        let backend = EtcdBackend::connect_lazy(config)?;
        let (dir, _) = keys::lock_dir(&backend.prefix, "");
        // A member that cannot be reached passes the requests to the next one.
        let mut tries = backend.members.channels.len();
        loop {
            let probe = pb::RangeRequest {
                key: dir.clone(),
                count_only: true,
                ..Default::default()
            };
            match backend.range(probe).await {
                Ok(_) => return Ok(backend),
                Err(e) if e.kind() == ErrorKind::Unavailable && tries > 1 => tries -= 1,
                Err(e) if e.kind() == ErrorKind::Unavailable && hint => {
                    return Err(Error::new(
                        e.kind(),
                        format!(
                            "{} (if etcd requires client certificates, give \
                             EtcdTls::with_client_certificate)",
                            e.message()
                        ),
                    ));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Like [`connect`](EtcdBackend::connect), but connects (and authenticates) on
    /// first use: requests fail instead. Must be called within a tokio runtime.
    ///
    /// Requests go to one member at a time, the first endpoint to start with; a
    /// request that fails as [`ErrorKind::Unavailable`] (a member down, stalled or cut
    /// off from the leader) moves the next request to the next endpoint, in a circle.
    pub fn connect_lazy(config: EtcdConfig) -> Result<EtcdBackend, Error> {
        if config.endpoints.is_empty() || config.endpoints.len() > MAX_ENDPOINTS {
            return Err(invalid(format!(
                "give 1 to {MAX_ENDPOINTS} etcd endpoints, not {}",
                config.endpoints.len()
            )));
        }
        let mut channels = Vec::with_capacity(config.endpoints.len());
        for url in &config.endpoints {
            let mut endpoint = Endpoint::from_shared(url.clone())
                .map_err(|e| invalid(format!("invalid etcd endpoint {url:?}: {e}")))?;
            match (endpoint.uri().scheme_str(), &config.tls) {
                (Some("http"), None) => {}
                (Some("https"), Some(tls)) => {
                    endpoint = endpoint.tls_config(tls.client_config()).map_err(|e| {
                        invalid(format!("TLS settings for etcd endpoint {url:?}: {e}"))
                    })?;
                }
                (Some("https"), None) => {
                    return Err(invalid(format!(
                        "etcd endpoint {url:?} is https:// but no TLS settings \
                         (EtcdConfig::tls) are given"
                    )));
                }
                (Some("http"), Some(_)) => {
                    return Err(invalid(format!(
                        "etcd endpoint {url:?} is plain http:// although TLS settings are \
                         given: use https://"
                    )));
                }
                _ => {
                    return Err(invalid(format!(
                        "etcd endpoint {url:?}: give an http:// or https:// URL"
                    )));
                }
            }
            let endpoint = endpoint
                .connect_timeout(config.connect_timeout)
                .tcp_nodelay(true)
                .http2_keep_alive_interval(Duration::from_secs(10))
                .keep_alive_timeout(Duration::from_secs(5))
                .keep_alive_while_idle(true);
            channels.push(endpoint.connect_lazy());
        }
        EtcdBackend::with_channels(channels, config)
    }

    /// Locks over `channel`, a connection to etcd the application built and set up
    /// itself (TLS, proxies, load balancing): the backend only sends requests on it.
    /// Credentials, prefix and request timeout come from `config`, whose
    /// `endpoints` and `tls` must be empty (start from [`EtcdConfig::default`]).
    /// Connects on first use, like [`connect_lazy`](EtcdBackend::connect_lazy).
    pub fn from_channel(
        channel: tonic::transport::Channel,
        config: EtcdConfig,
    ) -> Result<EtcdBackend, Error> {
        if !config.endpoints.is_empty() || config.tls.is_some() {
            return Err(invalid(
                "EtcdBackend::from_channel connects through the channel given: leave \
                 EtcdConfig::endpoints and EtcdConfig::tls empty"
                    .to_owned(),
            ));
        }
        EtcdBackend::with_channels(vec![channel], config)
    }

    fn with_channels(channels: Vec<Channel>, config: EtcdConfig) -> Result<EtcdBackend, Error> {
        if config.prefix.chars().any(char::is_control) {
            return Err(invalid(
                "the key prefix must not contain control characters".to_owned(),
            ));
        }
        Ok(EtcdBackend {
            members: Arc::new(Members {
                channels,
                current: AtomicUsize::new(0),
            }),
            prefix: config.prefix.trim_end_matches('/').to_owned(),
            request_timeout: config.request_timeout,
            wakeups: Arc::new(AtomicU64::new(0)),
            waits: Arc::new(AtomicU64::new(0)),
            auth: config.credentials.map(|credentials| {
                Arc::new(Auth {
                    credentials,
                    current: tokio::sync::Mutex::new(None),
                    authentications: AtomicU64::new(0),
                })
            }),
        })
    }

    /// The keys under lock `name` in create revision order (at most
    /// [`MAX_QUEUE_LISTED`]): the first `limit` hold it, the rest wait in this order.
    pub async fn queue(&self, name: &str) -> Result<Vec<QueueEntry>, Error> {
        let (dir, end) = keys::lock_dir(&self.prefix, name);
        let reply = self
            .range(pb::RangeRequest {
                key: dir.clone(),
                range_end: end,
                sort_order: SortOrder::Ascend as i32,
                sort_target: SortTarget::Create as i32,
                limit: MAX_QUEUE_LISTED as i64,
                ..Default::default()
            })
            .await?;
        reply
            .kvs
            .into_iter()
            .map(|kv| {
                let key = String::from_utf8_lossy(&kv.key).into_owned();
                let request_id = kv
                    .key
                    .strip_prefix(dir.as_slice())
                    .and_then(|rest| std::str::from_utf8(rest).ok())
                    .and_then(keys::unescape);
                match (request_id, keys::parse_value(&kv.value)) {
                    (Some(request_id), Some(entry)) => Ok(QueueEntry {
                        key,
                        request_id,
                        fence: revision_u64(kv.create_revision)?,
                        lease_id: kv.lease,
                        limit: entry.limit,
                        mode: if entry.shared {
                            LockMode::Shared
                        } else {
                            LockMode::Exclusive
                        },
                        owner: entry.owner,
                    }),
                    _ => Err(foreign_key(&key)),
                }
            })
            .collect()
    }

    /// How many times a waiter of this backend (and its clones) was woken by a watch
    /// event and looked at the queue again. A mutex waiter is woken only when the key
    /// just ahead of it goes, so this counts hand-offs, not every release.
    pub fn wakeups(&self) -> u64 {
        self.wakeups.load(Ordering::Relaxed)
    }

    /// How many times a waiter of this backend (and its clones) looked at the queue
    /// and started waiting for a key ahead of it to go: once when it queues, then
    /// once after each wakeup that did not make it the holder.
    pub fn waits(&self) -> u64 {
        self.waits.load(Ordering::Relaxed)
    }

    /// How many times this backend (and its clones) authenticated: once at first use,
    /// then once each time etcd no longer knew the token. 0 without credentials.
    pub fn authentications(&self) -> u64 {
        self.auth
            .as_ref()
            .map_or(0, |auth| auth.authentications.load(Ordering::Relaxed))
    }

    /// `message` as a request with the request timeout and, if there is one, the
    /// session's token.
    fn request<T>(&self, message: T, session: Option<&Session>) -> Request<T> {
        let mut request = Request::new(message);
        request.set_timeout(self.request_timeout);
        if let Some(value) = session.and_then(|session| session.token.as_ref()) {
            request.metadata_mut().insert(TOKEN_METADATA, value.clone());
        }
        request
    }

    /// The session to send requests with (`None` without credentials), authenticating
    /// first if there is none — or if the current one is `stale` (etcd refused its
    /// token). Concurrent callers wait for one authentication.
    async fn session(&self, stale: Option<u64>) -> Result<Option<Session>, Error> {
        let Some(auth) = &self.auth else {
            return Ok(None);
        };
        let mut current = auth.current.lock().await;
        match &*current {
            Some(session) if Some(session.generation) != stale => return Ok(Some(session.clone())),
            _ => {}
        }
        let previous = current.as_ref().map_or(0, |session| session.generation);
        let session = Session {
            token: self.authenticate(&auth.credentials).await?,
            generation: previous + 1,
        };
        auth.authentications.fetch_add(1, Ordering::Relaxed);
        *current = Some(session.clone());
        Ok(Some(session))
    }

    /// A token for `credentials`; `None` if the cluster has auth turned off.
    async fn authenticate(
        &self,
        credentials: &EtcdCredentials,
    ) -> Result<Option<AsciiMetadataValue>, Error> {
        let request = self.request(
            pb::AuthenticateRequest {
                name: credentials.user().to_owned(),
                password: credentials.password().to_owned(),
            },
            None,
        );
        let (index, channel) = self.members.current();
        let reply = pb::auth_client::AuthClient::new(channel)
            .authenticate(request)
            .await;
        match reply {
            Ok(reply) => {
                let token = AsciiMetadataValue::try_from(reply.into_inner().token)
                    .map_err(|_| unexpected("auth token"))?;
                Ok(Some(token))
            }
            Err(status)
                if status.code() == Code::FailedPrecondition
                    && status.message() == "etcdserver: authentication is not enabled" =>
            {
                Ok(None)
            }
            Err(status)
                if status.code() == Code::InvalidArgument
                    && status
                        .message()
                        .starts_with("etcdserver: authentication failed") =>
            {
                Err(Error::new(
                    ErrorKind::PermissionDenied,
                    format!(
                        "etcd refused to authenticate user {:?}: wrong user name or password",
                        credentials.user()
                    ),
                ))
            }
            Err(status) => Err(self.members.failed(index, status_error(status))),
        }
    }

    /// Runs one request on the current member, with the token if there are
    /// credentials. If etcd refuses the token (expired, or older than a permission
    /// change), authenticates again and repeats the request once: etcd checks the
    /// token before it does anything. An `Unavailable` failure moves later calls to
    /// the next member.
    async fn call<M, T, F, Fut>(&self, message: M, call: F) -> Result<T, Error>
    where
        M: Clone,
        F: Fn(Channel, Request<M>) -> Fut,
        Fut: Future<Output = Result<T, Failure>>,
    {
        let mut stale = None;
        loop {
            let session = self.session(stale).await?;
            let request = self.request(message.clone(), session.as_ref());
            let (index, channel) = self.members.current();
            let error = match call(channel, request).await {
                Ok(reply) => return Ok(reply),
                Err(Failure::Status(status)) => match &session {
                    Some(session) if stale.is_none() && refused_token(&status) => {
                        stale = Some(session.generation);
                        continue;
                    }
                    _ => status_error(status),
                },
                Err(Failure::Error(error)) => error,
            };
            return Err(self.members.failed(index, error));
        }
    }

    async fn range(&self, request: pb::RangeRequest) -> Result<pb::RangeResponse, Error> {
        self.call(request, |channel, request| async move {
            let reply = pb::kv_client::KvClient::new(channel).range(request).await;
            Ok(reply?.into_inner())
        })
        .await
    }

    async fn txn(&self, request: pb::TxnRequest) -> Result<pb::TxnResponse, Error> {
        self.call(request, |channel, request| async move {
            let reply = pb::kv_client::KvClient::new(channel).txn(request).await;
            Ok(reply?.into_inner())
        })
        .await
    }

    /// A new lease of `ttl_s` seconds: its id and the ttl etcd granted.
    async fn grant_lease(&self, ttl_s: i64) -> Result<(i64, i64), Error> {
        let request = pb::LeaseGrantRequest { ttl: ttl_s, id: 0 };
        let reply = self
            .call(request, |channel, request| async move {
                let reply = pb::lease_client::LeaseClient::new(channel)
                    .lease_grant(request)
                    .await;
                Ok(reply?.into_inner())
            })
            .await?;
        if reply.id <= 0 || reply.ttl < ttl_s {
            return Err(Error::new(
                ErrorKind::Protocol,
                format!(
                    "etcd granted lease {} for {} s, asked for {ttl_s} s",
                    reply.id, reply.ttl
                ),
            ));
        }
        Ok((reply.id, reply.ttl))
    }

    /// One `LeaseKeepAlive` round trip: the lease's ttl from now, in seconds, or
    /// `NotHeld` if it has expired or been revoked.
    async fn keep_alive(&self, lease_id: i64) -> Result<i64, Error> {
        let round_trip = |channel, request: Request<pb::LeaseKeepAliveRequest>| async move {
            let reply = pb::lease_client::LeaseClient::new(channel)
                .lease_keep_alive(request.map(tokio_stream::once))
                .await;
            match reply?.into_inner().message().await? {
                Some(reply) if reply.id == lease_id => Ok(reply.ttl),
                Some(reply) => Err(Failure::Error(Error::new(
                    ErrorKind::Protocol,
                    format!("keep-alive of lease {lease_id} answered for {}", reply.id),
                ))),
                None => Err(Failure::Error(Error::new(
                    ErrorKind::Unavailable,
                    "etcd ended a keep-alive without an answer",
                ))),
            }
        };
        let timeout = self.request_timeout;
        let request = pb::LeaseKeepAliveRequest { id: lease_id };
        let ttl = self
            .call(request, |channel, request| async move {
                tokio::time::timeout(timeout, round_trip(channel, request))
                    .await
                    .map_err(|_| {
                        Failure::Error(Error::new(
                            ErrorKind::Unavailable,
                            "etcd keep-alive timed out",
                        ))
                    })?
            })
            .await?;
        if ttl <= 0 {
            return Err(Error::new(
                ErrorKind::NotHeld,
                format!("lease {lease_id} has expired or was revoked"),
            ));
        }
        Ok(ttl)
    }

    /// Revokes a lease (deleting its keys); a lease already gone is fine.
    async fn revoke(&self, lease_id: i64) -> Result<(), Error> {
        let request = pb::LeaseRevokeRequest { id: lease_id };
        let revoked = self
            .call(request, |channel, request| async move {
                let reply = pb::lease_client::LeaseClient::new(channel)
                    .lease_revoke(request)
                    .await;
                Ok(reply.map(drop)?)
            })
            .await;
        match revoked {
            // etcd's "requested lease not found".
            Err(e) if e.kind() == ErrorKind::NotHeld => Ok(()),
            other => other,
        }
    }

    async fn acquire_inner(
        &self,
        spec: &AcquireSpec,
        candidate: Option<&str>,
    ) -> Result<Lease, Error> {
        spec.validate()?;
        if spec.mode == LockMode::Shared && spec.limit != 1 {
            return Err(invalid(
                "the etcd backend admits any number of readers: a shared lock takes limit 1"
                    .to_owned(),
            ));
        }
        if !spec.lock_delay.is_zero() {
            return Err(invalid(
                "the etcd backend has no lock-delay; use fences (lock_delay must be zero)"
                    .to_owned(),
            ));
        }
        let start = Instant::now();
        // An unrepresentable deadline is as good as none.
        let deadline = start
            .checked_add(spec.wait)
            .unwrap_or(start + Duration::from_secs(100 * 365 * 24 * 3600));
        let place = Place::new(&self.prefix, spec, candidate);

        // From here until the grant is returned, giving up revokes the lease (and with
        // it the key; a session's lease stays, only the key goes), also when this
        // future is dropped.
        let (mut pending, granted_ttl_s) = self.pending_grant(spec, &place).await?;
        let queued = self
            .enqueue(&place, spec, &mut pending, granted_ttl_s)
            .await?;
        let mut turn = queued.turn;

        let keepalive_every = Duration::from_secs(u64::try_from(queued.ttl_s).unwrap_or(1)) / 3;
        let mut next_keepalive = Instant::now() + keepalive_every;
        // Each pass waits for a deletion ahead of us, and every deletion brings the
        // grant closer: the loop ends by the deadline at the latest.
        loop {
            let target = match turn {
                Turn::Granted => break,
                Turn::Wait(target) => target,
            };
            if spec.wait.is_zero() {
                pending.give_up().await;
                return Err(Error::new(
                    ErrorKind::Held,
                    format!("{:?} is held", spec.name),
                ));
            }
            self.waits.fetch_add(1, Ordering::Relaxed);
            let keep = KeepAlive {
                lease_id: pending.lease_id,
                every: keepalive_every,
                next: &mut next_keepalive,
            };
            let woken = self.wait_for_change(&target, deadline, Some(keep)).await?;
            if !woken {
                pending.give_up().await;
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!("{:?} not acquired within {:?}", spec.name, spec.wait),
                ));
            }
            self.wakeups.fetch_add(1, Ordering::Relaxed);
            turn = self.turn(&place, queued.revision, spec).await?;
        }
        let token = Token {
            lease_id: pending.lease_id,
            session: spec.session.is_some(),
            revision: queued.revision,
            escaped_request_id: place.escaped_request_id,
        };
        pending.keep();
        Ok(Lease::new(
            spec.name.clone(),
            revision_u64(queued.revision)?,
            token.encode(),
            Duration::from_secs(u64::try_from(queued.ttl_s).unwrap_or(0)),
        ))
    }

    /// Puts the request's key in the lock's queue on the pending lease — or, for a
    /// retry, finds the key an earlier try made and takes over its lease instead.
    async fn enqueue(
        &self,
        place: &Place,
        spec: &AcquireSpec,
        pending: &mut PendingGrant,
        granted_ttl_s: i64,
    ) -> Result<Queued, Error> {
        let created = self.txn(create_txn(place, pending.lease_id)).await?;
        if !created.succeeded {
            return self.requeue(place, spec, pending, created).await;
        }
        let revision = header_revision(created.header.as_ref())?;
        let [OpResponse::ResponseRange(oldest), OpResponse::ResponseRange(newest), OpResponse::ResponsePut(_)] =
            responses(created, "create transaction")?
        else {
            return Err(unexpected("create transaction"));
        };
        // A mutex and a semaphore must not share a name: a limit-1 holder would share
        // its lock. (Every key agrees with the oldest, by induction.)
        if let Some(first) = oldest.kvs.first() {
            let refused = match keys::parse_value(&first.value) {
                Some(entry) if entry.limit == spec.limit => None,
                Some(keys::Entry { limit, .. }) => Some(Error::new(
                    ErrorKind::LimitMismatch,
                    format!(
                        "{:?} is held with limit {limit}, not {}",
                        spec.name, spec.limit
                    ),
                )),
                None => Some(foreign_key(&String::from_utf8_lossy(&first.key))),
            };
            if let Some(e) = refused {
                pending.give_up().await;
                return Err(e);
            }
        }
        // Every key already there was created before ours.
        let turn = if spec.mode == LockMode::Shared {
            if oldest.count == 0 {
                Turn::Granted
            } else {
                self.turn(place, revision, spec).await?
            }
        } else if oldest.count < i64::from(spec.limit) {
            Turn::Granted
        } else {
            let predecessor = newest.kvs.into_iter().next().map(|kv| kv.key);
            Turn::wait(spec.limit, predecessor, place, revision)?
        };
        Ok(Queued {
            revision,
            ttl_s: granted_ttl_s,
            turn,
        })
    }

    /// A retry whose key exists already (`created` failed its compare and read the
    /// key): adopt that key's lease, drop the one granted for this try.
    async fn requeue(
        &self,
        place: &Place,
        spec: &AcquireSpec,
        pending: &mut PendingGrant,
        created: pb::TxnResponse,
    ) -> Result<Queued, Error> {
        let [OpResponse::ResponseRange(read)] = responses(created, "create transaction")? else {
            return Err(unexpected("create transaction"));
        };
        let Some(found) = read.kvs.into_iter().next() else {
            return Err(Error::new(
                ErrorKind::Unavailable,
                "the grant's key vanished during the retry; try again",
            ));
        };
        if pending.session_key.is_some() {
            if found.lease != pending.lease_id {
                return Err(invalid(format!(
                    "request id {:?} was used for a grant outside this session",
                    spec.request_id
                )));
            }
        } else {
            let unused = std::mem::replace(&mut pending.lease_id, found.lease);
            let _ = self.revoke(unused).await;
        }
        let ttl_s = match self.keep_alive(found.lease).await {
            Err(e) if e.kind() == ErrorKind::NotHeld => {
                return Err(Error::new(
                    ErrorKind::Unavailable,
                    "the grant made for an earlier try has expired; try again",
                ))
            }
            other => other?,
        };
        let turn = self.turn(place, found.create_revision, spec).await?;
        Ok(Queued {
            revision: found.create_revision,
            ttl_s,
            turn,
        })
    }

    /// Where the request's key (created at `revision`) stands now: a holder, or the
    /// key(s) to watch.
    async fn turn(&self, place: &Place, revision: i64, spec: &AcquireSpec) -> Result<Turn, Error> {
        match spec.mode {
            LockMode::Shared => self.reader_turn(place, revision).await,
            _ => self.counted_turn(place, revision, spec.limit).await,
        }
    }

    /// A reader's turn (etcd's `recipes.RWMutex`): it holds once no writer is ahead of
    /// it, and otherwise waits for the nearest writer ahead to go — or to become a
    /// reader (a downgrade rewrites its key), so it watches that key's puts too.
    /// Readers ahead do not matter; writers behind it wait for it.
    async fn reader_turn(&self, place: &Place, revision: i64) -> Result<Turn, Error> {
        let (now, ahead) = self.queue_ahead(place, revision, None).await?;
        let mut writer = None;
        for kv in ahead {
            match keys::parse_value(&kv.value) {
                Some(entry) if entry.shared => {}
                Some(_) => {
                    writer = Some(kv.key);
                    break;
                }
                None => return Err(foreign_key(&String::from_utf8_lossy(&kv.key))),
            }
        }
        Ok(match writer {
            None => Turn::Granted,
            Some(key) => Turn::Wait(WatchTarget {
                key,
                range_end: Vec::new(),
                after_revision: now,
                puts: true,
            }),
        })
    }

    /// A writer's or a semaphore holder's turn: it holds once fewer than `limit` keys
    /// are ahead of it.
    async fn counted_turn(&self, place: &Place, revision: i64, limit: u32) -> Result<Turn, Error> {
        let (now, ahead) = self.queue_ahead(place, revision, Some(limit)).await?;
        if ahead.len() < limit as usize {
            return Ok(Turn::Granted);
        }
        let predecessor = ahead.into_iter().next().map(|kv| kv.key);
        Turn::wait(limit, predecessor, place, now)
    }

    /// The one queue read of every turn: checks that the request's key (created at
    /// `revision`) is still queued, and returns the revision read at with the keys
    /// ahead of it, nearest first — all of them with their values (a reader needs the
    /// modes), or only the `limit` nearest, keys only.
    async fn queue_ahead(
        &self,
        place: &Place,
        revision: i64,
        limit: Option<u32>,
    ) -> Result<(i64, Vec<pb::KeyValue>), Error> {
        if revision < 2 {
            // etcd's first write is revision 2; 0 would switch the filter below off.
            return Err(unexpected("create revision"));
        }
        let reply = self
            .txn(pb::TxnRequest {
                compare: Vec::new(),
                success: vec![
                    range_op(pb::RangeRequest {
                        key: place.key.clone(),
                        keys_only: true,
                        ..Default::default()
                    }),
                    range_op(pb::RangeRequest {
                        key: place.dir.clone(),
                        range_end: place.dir_end.clone(),
                        max_create_revision: revision - 1,
                        sort_order: SortOrder::Descend as i32,
                        sort_target: SortTarget::Create as i32,
                        limit: limit.map_or(0, i64::from),
                        keys_only: limit.is_some(),
                        ..Default::default()
                    }),
                ],
                failure: Vec::new(),
            })
            .await?;
        let now = header_revision(reply.header.as_ref())?;
        let [OpResponse::ResponseRange(mine), OpResponse::ResponseRange(ahead)] =
            responses(reply, "queue read")?
        else {
            return Err(unexpected("queue read"));
        };
        let still_queued = mine
            .kvs
            .first()
            .is_some_and(|kv| kv.create_revision == revision);
        if !still_queued {
            return Err(Error::new(
                ErrorKind::Unavailable,
                "the waiting request's lease expired (etcd unreachable for its ttl); try again",
            ));
        }
        // (The `max_create_revision` filter applies to `kvs`, not to `count`.)
        Ok((now, ahead.kvs))
    }

    /// Watches `target` for a deletion (with `puts`, for a write too): `true` when one
    /// happened (or the history it would be in was compacted: look again), `false`
    /// when `deadline` passed first. With `keep`, keeps the waiter's lease alive
    /// meanwhile. The one wait of every queue (locks, shared locks, campaigns) and of
    /// observing an election.
    async fn wait_for_change(
        &self,
        target: &WatchTarget,
        deadline: Instant,
        mut keep: Option<KeepAlive<'_>>,
    ) -> Result<bool, Error> {
        let mut watch = match self.open_watch(target, deadline).await? {
            Opened::Watching(watch) => watch,
            Opened::Answered(woken) => return Ok(woken),
        };
        // Without a lease to keep, the keep-alive branch never fires.
        let far = deadline + Duration::from_secs(1);
        loop {
            let next_keepalive = keep.as_ref().map_or(far, |k| *k.next);
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => return Ok(false),
                _ = tokio::time::sleep_until(next_keepalive), if keep.is_some() => {
                    let Some(k) = keep.as_mut() else { continue };
                    match tokio::time::timeout_at(deadline, self.keep_alive(k.lease_id)).await {
                        Err(_) => return Ok(false),
                        Ok(Err(e)) if e.kind() == ErrorKind::NotHeld => {
                            return Err(Error::new(
                                ErrorKind::Unavailable,
                                "the waiting request's lease expired; try again",
                            ));
                        }
                        Ok(result) => result?,
                    };
                    *k.next = Instant::now() + k.every;
                }
                message = watch.events.message() => {
                    let message = message.map_err(|status| watch.failed(status))?;
                    if let Some(woken) = watch_outcome(message)? {
                        return Ok(woken);
                    }
                }
            }
        }
    }

    /// Opens a watch for deletions of `target` and reads etcd's answer to it (within
    /// the request timeout). etcd checks a watch's token only then, and refuses a
    /// token it no longer knows as `permission denied`: then this authenticates again
    /// and tries once more.
    async fn open_watch(
        &self,
        target: &WatchTarget,
        deadline: Instant,
    ) -> Result<Opened<'_>, Error> {
        let create = pb::WatchRequest {
            request_union: Some(pb::watch_request::RequestUnion::CreateRequest(
                pb::WatchCreateRequest {
                    key: target.key.clone(),
                    range_end: target.range_end.clone(),
                    start_revision: target.after_revision + 1,
                    filters: if target.puts {
                        Vec::new()
                    } else {
                        vec![pb::watch_create_request::FilterType::Noput as i32]
                    },
                    ..Default::default()
                },
            )),
        };
        let mut stale = None;
        loop {
            let session = self.session(stale).await?;
            // The request side stays open while we wait: etcd ends the watch when it
            // closes. Dropping both ends cancels the watch.
            let (requests, receiver) = tokio::sync::mpsc::channel(1);
            requests
                .try_send(create.clone())
                .map_err(|_| unexpected("watch request queue"))?;
            let request = self.request(
                tokio_stream::wrappers::ReceiverStream::new(receiver),
                session.as_ref(),
            );
            let (member, channel) = self.members.current();
            let retry = |status: &Status| match &session {
                Some(session) if stale.is_none() && refused_token(status) => {
                    Some(session.generation)
                }
                _ => None,
            };
            let failed = |status| self.members.failed(member, status_error(status));
            let answer_by = deadline.min(Instant::now() + self.request_timeout);
            let timed_out = || {
                if answer_by == deadline {
                    Ok(Opened::Answered(false))
                } else {
                    let e = Error::new(ErrorKind::Unavailable, "etcd did not answer a watch");
                    Err(self.members.failed(member, e))
                }
            };
            let mut client = pb::watch_client::WatchClient::new(channel);
            let mut events = match tokio::time::timeout_at(answer_by, client.watch(request)).await {
                Err(_) => return timed_out(),
                Ok(Ok(reply)) => reply.into_inner(),
                Ok(Err(status)) => match retry(&status) {
                    Some(generation) => {
                        stale = Some(generation);
                        continue;
                    }
                    None => return Err(failed(status)),
                },
            };
            let first = match tokio::time::timeout_at(answer_by, events.message()).await {
                Err(_) => return timed_out(),
                Ok(message) => message.map_err(failed)?,
            };
            if let Some(reply) = &first {
                if reply.canceled && reply.cancel_reason == PERMISSION_DENIED {
                    if let Some(session) = session.as_ref().filter(|_| stale.is_none()) {
                        stale = Some(session.generation);
                        continue;
                    }
                }
            }
            let watch = Watch {
                events,
                _requests: requests,
                backend: self,
                member,
            };
            return Ok(match watch_outcome(first)? {
                Some(woken) => Opened::Answered(woken),
                None => Opened::Watching(Box::new(watch)),
            });
        }
    }

    async fn renew_inner(&self, lease: &Lease) -> Result<Duration, Error> {
        let token = Token::parse(&lease.owner_token)?;
        let key = token.key(&self.prefix, &lease.name);
        // First the key, so that another grant's lease is never kept alive by a token
        // that does not belong to this lock.
        let reply = self
            .range(pb::RangeRequest {
                key,
                keys_only: true,
                ..Default::default()
            })
            .await?;
        let ours = reply
            .kvs
            .first()
            .is_some_and(|kv| kv.create_revision == token.revision && kv.lease == token.lease_id);
        if !ours {
            return Err(not_held(&lease.name, "held"));
        }
        // A lease that was alive when its key was read and answers this keep-alive was
        // alive throughout (etcd never revives a lease), so the key is still there.
        let ttl_s = self.keep_alive(token.lease_id).await?;
        Ok(Duration::from_secs(u64::try_from(ttl_s).unwrap_or(0)))
    }

    async fn release_inner(&self, lease: &Lease) -> Result<bool, Error> {
        let token = Token::parse(&lease.owner_token)?;
        let key = token.key(&self.prefix, &lease.name);
        let reply = self
            .txn(pb::TxnRequest {
                compare: vec![
                    compare(
                        &key,
                        CompareTarget::Create,
                        TargetUnion::CreateRevision(token.revision),
                    ),
                    compare(
                        &key,
                        CompareTarget::Lease,
                        TargetUnion::Lease(token.lease_id),
                    ),
                ],
                success: vec![pb::RequestOp {
                    request: Some(Op::RequestDeleteRange(pb::DeleteRangeRequest {
                        key,
                        ..Default::default()
                    })),
                }],
                failure: Vec::new(),
            })
            .await?;
        if !reply.succeeded {
            return Ok(false);
        }
        // The key is gone, so the lock is released; an unrevoked lease holds nothing
        // and runs out by itself. A session's lease is the session's to end.
        if !token.session {
            let _ = self.revoke(token.lease_id).await;
        }
        Ok(true)
    }
}

impl EtcdBackend {
    /// `concurrency.Election.Proclaim`: rewrites the leader's key with the new value,
    /// in a transaction that compares its create revision and lease (the term), so a
    /// deposed leader changes nothing.
    async fn proclaim_inner(&self, lease: &Lease, value: &str) -> Result<(), Error> {
        fencelock_backend::validate_value(value)?;
        let token = Token::parse(&lease.owner_token)?;
        let key = token.key(&self.prefix, &lease.name);
        let (mut entry, _) = self.read_held(&key, &token, &lease.name, "led").await?;
        entry.value = Some(value.to_owned());
        if self.rewrite_held(key, &token, &entry, None).await? {
            Ok(())
        } else {
            Err(not_held(&lease.name, "led"))
        }
    }

    /// Reads the key the grant `token` holds: its entry and mod revision, or `NotHeld`
    /// ("is not {verb} by this grant") when the key is gone or belongs to another grant.
    async fn read_held(
        &self,
        key: &[u8],
        token: &Token,
        name: &str,
        verb: &str,
    ) -> Result<(keys::Entry, i64), Error> {
        let reply = self
            .range(pb::RangeRequest {
                key: key.to_vec(),
                ..Default::default()
            })
            .await?;
        let Some(kv) = reply.kvs.into_iter().next() else {
            return Err(not_held(name, verb));
        };
        if kv.create_revision != token.revision || kv.lease != token.lease_id {
            return Err(not_held(name, verb));
        }
        let Some(entry) = keys::parse_value(&kv.value) else {
            return Err(foreign_key(&String::from_utf8_lossy(&kv.key)));
        };
        Ok((entry, kv.mod_revision))
    }

    /// Rewrites the key the grant `token` holds with `entry`, in a transaction that
    /// compares its create revision and lease (the grant) and, when given, its mod
    /// revision (nothing rewrote it since it was read). False: the grant no longer
    /// holds it, and nothing was written.
    async fn rewrite_held(
        &self,
        key: Vec<u8>,
        token: &Token,
        entry: &keys::Entry,
        mod_revision: Option<i64>,
    ) -> Result<bool, Error> {
        let mut checks = vec![
            compare(
                &key,
                CompareTarget::Create,
                TargetUnion::CreateRevision(token.revision),
            ),
            compare(
                &key,
                CompareTarget::Lease,
                TargetUnion::Lease(token.lease_id),
            ),
        ];
        if let Some(revision) = mod_revision {
            checks.push(compare(
                &key,
                CompareTarget::Mod,
                TargetUnion::ModRevision(revision),
            ));
        }
        let written = self
            .txn(pb::TxnRequest {
                compare: checks,
                success: vec![pb::RequestOp {
                    request: Some(Op::RequestPut(pb::PutRequest {
                        key,
                        value: keys::value(entry),
                        ignore_lease: true,
                        ..Default::default()
                    })),
                }],
                failure: Vec::new(),
            })
            .await?;
        Ok(written.succeeded)
    }

    /// Downgrade: rewrites the writer's key in place with `shared` in its value, in a
    /// transaction that compares its create revision, lease and mod revision. The key
    /// keeps its create revision, so it keeps its place in the queue and its fence;
    /// readers waiting on it watch its puts and hold at once, writers behind it still
    /// wait for its deletion. (A second key for the reader would queue *behind* any
    /// writer already waiting, and deleting the writer's key would hand that writer the
    /// lock: not a downgrade.)
    async fn downgrade_inner(&self, lease: &Lease) -> Result<(), Error> {
        let token = Token::parse(&lease.owner_token)?;
        let key = token.key(&self.prefix, &lease.name);
        let (mut entry, mod_revision) = self.read_held(&key, &token, &lease.name, "held").await?;
        if entry.value.is_some() {
            return Err(invalid(
                "an election's leader cannot downgrade (resign instead)".to_owned(),
            ));
        }
        if entry.limit != 1 {
            return Err(invalid(format!(
                "a semaphore holder (limit {}) cannot downgrade",
                entry.limit
            )));
        }
        if entry.shared {
            return Ok(());
        }
        entry.shared = true;
        if self
            .rewrite_held(key, &token, &entry, Some(mod_revision))
            .await?
        {
            Ok(())
        } else {
            Err(not_held(&lease.name, "held"))
        }
    }

    /// The election's leader (its oldest key) and the revision it was read at.
    async fn read_leader(&self, name: &str) -> Result<(Option<Leader>, i64), Error> {
        let (dir, end) = keys::lock_dir(&self.prefix, name);
        let reply = self
            .range(pb::RangeRequest {
                key: dir,
                range_end: end,
                sort_order: SortOrder::Ascend as i32,
                sort_target: SortTarget::Create as i32,
                limit: 1,
                ..Default::default()
            })
            .await?;
        let revision = header_revision(reply.header.as_ref())?;
        let Some(kv) = reply.kvs.into_iter().next() else {
            return Ok((None, revision));
        };
        let Some(entry) = keys::parse_value(&kv.value) else {
            return Err(foreign_key(&String::from_utf8_lossy(&kv.key)));
        };
        let leader = Leader::new(
            name.to_owned(),
            entry.value.unwrap_or_default(),
            revision_u64(kv.create_revision)?,
            entry.owner,
        );
        Ok((Some(leader), revision))
    }

    /// `concurrency.Election.Observe`: reads the leader, and while it is `known`,
    /// watches the election's keys from the revision read and reads again on any
    /// change, until `wait` passes.
    async fn leader_change_inner(
        &self,
        name: &str,
        known: Option<&Leader>,
        wait: Duration,
    ) -> Result<Option<Leader>, Error> {
        let start = Instant::now();
        let deadline = start.checked_add(wait).unwrap_or(start);
        let (dir, end) = keys::lock_dir(&self.prefix, name);
        loop {
            let (leader, revision) = self.read_leader(name).await?;
            if leader.as_ref() != known || Instant::now() >= deadline {
                return Ok(leader);
            }
            let target = WatchTarget {
                key: dir.clone(),
                range_end: end.clone(),
                after_revision: revision,
                puts: true,
            };
            if !self.wait_for_change(&target, deadline, None).await? {
                return Ok(leader);
            }
        }
    }
}

/// Sessions: one etcd lease that many grants' keys are put on.
impl EtcdBackend {
    async fn open_session_inner(&self, ttl: Duration) -> Result<SessionLease, Error> {
        if ttl.is_zero() || ttl > fencelock_backend::MAX_TTL {
            return Err(invalid(format!(
                "session ttl must be between 1ms and {}s, got {ttl:?}",
                fencelock_backend::MAX_TTL.as_secs()
            )));
        }
        let (id, ttl_s) = self.grant_lease(whole_seconds(ttl)).await?;
        Ok(SessionLease::new(id.to_string(), seconds(ttl_s)))
    }

    async fn keep_alive_session(&self, session: &SessionLease) -> Result<Duration, Error> {
        let id = session_lease_id(&session.id)?;
        match self.keep_alive(id).await {
            Ok(ttl_s) => Ok(seconds(ttl_s)),
            Err(e) if e.kind() == ErrorKind::NotHeld => Err(session_gone(&session.id)),
            Err(e) => Err(e),
        }
    }

    /// Counts the grants on the session's lease (a keys-only read of the prefix), then
    /// revokes it, which deletes them.
    async fn close_session_inner(&self, session: &SessionLease) -> Result<usize, Error> {
        let id = session_lease_id(&session.id)?;
        if let Err(e) = self.keep_alive(id).await {
            return Err(match e.kind() {
                ErrorKind::NotHeld => session_gone(&session.id),
                _ => e,
            });
        }
        let start = format!("{}/", self.prefix).into_bytes();
        let mut end = start.clone();
        // The last byte is '/': adding one never carries.
        if let Some(last) = end.last_mut() {
            *last += 1;
        }
        let held = self
            .range(pb::RangeRequest {
                key: start,
                range_end: end,
                keys_only: true,
                ..Default::default()
            })
            .await?
            .kvs
            .iter()
            .filter(|kv| kv.lease == id)
            .count();
        self.revoke(id).await?;
        Ok(held)
    }

    /// The pending grant of an acquire, and the lease's length in seconds: on a new
    /// lease of its own, or on the session's (which must be alive).
    async fn pending_grant(
        &self,
        spec: &AcquireSpec,
        place: &Place,
    ) -> Result<(PendingGrant, i64), Error> {
        let Some(session) = &spec.session else {
            let (lease_id, ttl_s) = self.grant_lease(whole_seconds(spec.ttl)).await?;
            return Ok((PendingGrant::new(self.clone(), lease_id), ttl_s));
        };
        let lease_id = session_lease_id(session)?;
        let ttl_s = match self.keep_alive(lease_id).await {
            Err(e) if e.kind() == ErrorKind::NotHeld => return Err(session_gone(session)),
            other => other?,
        };
        let mut pending = PendingGrant::new(self.clone(), lease_id);
        pending.session_key = Some(place.key.clone());
        Ok((pending, ttl_s))
    }

    /// Undoes a pending grant: revokes its own lease, or deletes its key from a
    /// session's lease (only while the key is on that lease).
    async fn abandon(&self, lease_id: i64, session_key: Option<Vec<u8>>) -> Result<(), Error> {
        let Some(key) = session_key else {
            return self.revoke(lease_id).await;
        };
        self.txn(pb::TxnRequest {
            compare: vec![compare(
                &key,
                CompareTarget::Lease,
                TargetUnion::Lease(lease_id),
            )],
            success: vec![pb::RequestOp {
                request: Some(Op::RequestDeleteRange(pb::DeleteRangeRequest {
                    key,
                    ..Default::default()
                })),
            }],
            failure: Vec::new(),
        })
        .await
        .map(drop)
    }
}

/// A session id of this backend: an etcd lease id.
fn session_lease_id(id: &str) -> Result<i64, Error> {
    id.parse::<i64>()
        .ok()
        .filter(|&id| id > 0)
        .ok_or_else(|| invalid(format!("{id:?} is not a session of the etcd backend")))
}

fn session_gone(id: &str) -> Error {
    Error::new(
        ErrorKind::SessionNotFound,
        format!("session {id} has expired or was closed"),
    )
}

fn seconds(ttl_s: i64) -> Duration {
    Duration::from_secs(u64::try_from(ttl_s).unwrap_or(0))
}

impl LockBackend for EtcdBackend {
    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::new("etcd", FenceGuarantee::Durable);
        caps.fifo = true;
        caps.push_wakeups = true;
        caps.semaphores = true;
        caps.monotonic_leases = true;
        caps.shared = true;
        caps.downgrade = true;
        caps.elections = true;
        caps.sessions = true;
        caps
    }

    fn acquire<'a>(&'a self, spec: &'a AcquireSpec) -> BoxFuture<'a, Result<Lease, Error>> {
        Box::pin(self.acquire_inner(spec, None))
    }

    /// etcd's `concurrency.Election`: a candidate is a key in the election's queue
    /// carrying its value; the oldest key leads, and its create revision is the term.
    fn campaign<'a>(
        &'a self,
        spec: &'a AcquireSpec,
        value: &'a str,
    ) -> BoxFuture<'a, Result<Lease, Error>> {
        Box::pin(async move {
            fencelock_backend::validate_value(value)?;
            if spec.limit != 1 || spec.mode != LockMode::Exclusive {
                return Err(invalid(
                    "an election has one leader: campaign with limit 1, exclusive".to_owned(),
                ));
            }
            self.acquire_inner(spec, Some(value)).await
        })
    }

    fn proclaim<'a>(
        &'a self,
        lease: &'a Lease,
        value: &'a str,
    ) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(self.proclaim_inner(lease, value))
    }

    fn leader<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<Leader>, Error>> {
        Box::pin(async move { Ok(self.read_leader(name).await?.0) })
    }

    fn leader_change<'a>(
        &'a self,
        name: &'a str,
        known: Option<&'a Leader>,
        wait: Duration,
    ) -> BoxFuture<'a, Result<Option<Leader>, Error>> {
        Box::pin(self.leader_change_inner(name, known, wait))
    }

    /// A session is an etcd lease of its own (whole seconds, as every lease here);
    /// locks acquired under it put their keys on it.
    fn open_session<'a>(
        &'a self,
        ttl: Duration,
        _owner: &'a str,
    ) -> BoxFuture<'a, Result<SessionLease, Error>> {
        Box::pin(self.open_session_inner(ttl))
    }

    fn keep_alive<'a>(
        &'a self,
        session: &'a SessionLease,
    ) -> BoxFuture<'a, Result<Duration, Error>> {
        Box::pin(self.keep_alive_session(session))
    }

    fn close_session<'a>(
        &'a self,
        session: &'a SessionLease,
    ) -> BoxFuture<'a, Result<usize, Error>> {
        Box::pin(self.close_session_inner(session))
    }

    /// Keeps the grant's lease alive for the length granted at `acquire` (etcd cannot
    /// change a lease's length, so `ttl` is not used) and returns that length.
    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        _ttl: Duration,
    ) -> BoxFuture<'a, Result<Duration, Error>> {
        Box::pin(self.renew_inner(lease))
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(self.release_inner(lease))
    }

    /// Rewrites the writer's key as a reader's in place: same key, same create
    /// revision, so the fence stays and the place in the queue too.
    fn downgrade<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(self.downgrade_inner(lease))
    }
}

/// One connection per cluster member, and the member requests go to now.
#[derive(Debug)]
struct Members {
    channels: Vec<Channel>,
    current: AtomicUsize,
}

impl Members {
    /// The member to send to, and its connection.
    fn current(&self) -> (usize, Channel) {
        let index = self.current.load(Ordering::Relaxed) % self.channels.len();
        (index, self.channels[index].clone())
    }

    /// Notes that a call to member `index` failed with `error`: if the member may be
    /// down or cut off, later calls go to the next one (unless another call moved on
    /// already). Returns `error`.
    fn failed(&self, index: usize, error: Error) -> Error {
        if error.kind() == ErrorKind::Unavailable && self.channels.len() > 1 {
            let next = (index + 1) % self.channels.len();
            let _ =
                self.current
                    .compare_exchange(index, next, Ordering::Relaxed, Ordering::Relaxed);
        }
        error
    }
}

/// etcd's metadata key for the auth token.
const TOKEN_METADATA: &str = "token";

/// How etcd cancels a watch it does not permit (also for a token it does not know).
const PERMISSION_DENIED: &str = "etcdserver: permission denied";

/// The credentials, and the session they opened.
struct Auth {
    credentials: EtcdCredentials,
    /// Locked while authenticating, so that concurrent requests wait for one
    /// authentication instead of each making its own.
    current: tokio::sync::Mutex<Option<Session>>,
    authentications: AtomicU64,
}

/// Shows the user; hides the password and the token.
impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("user", &self.credentials.user())
            .finish_non_exhaustive()
    }
}

/// One authentication's outcome.
#[derive(Clone)]
struct Session {
    /// The token to send; `None` if the cluster has auth turned off.
    token: Option<AsciiMetadataValue>,
    /// Counts authentications, so that a request refused with an old token does not
    /// throw away a newer one that another request already fetched.
    generation: u64,
}

/// Why a request failed: what etcd answered, or what the client made of it.
enum Failure {
    Status(Status),
    Error(Error),
}

impl From<Status> for Failure {
    fn from(status: Status) -> Failure {
        Failure::Status(status)
    }
}

/// Whether etcd refused the request's token (or its absence) before doing anything:
/// it does not know the token (expired, or the member restarted), the request came
/// without one although auth is on, or permissions changed since it was issued (JWT
/// tokens carry the permissions' revision; simple tokens are always current).
fn refused_token(status: &Status) -> bool {
    matches!(
        (status.code(), status.message()),
        (Code::Unauthenticated, "etcdserver: invalid auth token")
            | (Code::InvalidArgument, "etcdserver: user name is empty")
            | (
                Code::InvalidArgument,
                "etcdserver: revision of auth store is old"
            )
    )
}

/// A watch etcd accepted.
struct Watch<'a> {
    events: tonic::Streaming<pb::WatchResponse>,
    /// The request side: etcd ends the watch when it closes.
    _requests: tokio::sync::mpsc::Sender<pb::WatchRequest>,
    backend: &'a EtcdBackend,
    member: usize,
}

impl Watch<'_> {
    fn failed(&self, status: Status) -> Error {
        self.backend
            .members
            .failed(self.member, status_error(status))
    }
}

/// What opening a watch came to.
enum Opened<'a> {
    /// etcd accepted it; wait for its events.
    Watching(Box<Watch<'a>>),
    /// Nothing to wait for: `true` to look at the queue again, `false` when the
    /// deadline passed.
    Answered(bool),
}

/// What one watch message means for a waiter: `Some(true)` look at the queue again,
/// `None` keep waiting.
fn watch_outcome(message: Option<pb::WatchResponse>) -> Result<Option<bool>, Error> {
    match message {
        None => Err(Error::new(ErrorKind::Unavailable, "etcd ended the watch")),
        // Its start revision was compacted away: look again (the next watch starts
        // at a newer revision).
        Some(reply) if reply.compact_revision != 0 => Ok(Some(true)),
        Some(reply) if reply.canceled && reply.cancel_reason == PERMISSION_DENIED => {
            Err(Error::new(
                ErrorKind::PermissionDenied,
                "etcd refused to watch the lock: the user needs read permission on the prefix",
            ))
        }
        Some(reply) if reply.canceled => Err(Error::new(
            ErrorKind::Unavailable,
            format!("etcd cancelled the watch: {}", reply.cancel_reason),
        )),
        // Only what the filter lets pass: deletions, and puts where asked for.
        Some(reply) if !reply.events.is_empty() => Ok(Some(true)),
        // Created, or progress.
        Some(_) => Ok(None),
    }
}

/// Where one request lives in the key space: its lock's range and its own key.
struct Place {
    /// `<prefix>/<escaped name>/`.
    dir: Vec<u8>,
    /// The end of the lock's range.
    dir_end: Vec<u8>,
    /// The request's key: `dir` + the escaped request id.
    key: Vec<u8>,
    escaped_request_id: String,
    /// What the key says about the grant.
    entry: keys::Entry,
}

impl Place {
    fn new(prefix: &str, spec: &AcquireSpec, candidate: Option<&str>) -> Place {
        let (dir, dir_end) = keys::lock_dir(prefix, &spec.name);
        let escaped_request_id = keys::escape(&spec.request_id);
        let key = [dir.as_slice(), escaped_request_id.as_bytes()].concat();
        Place {
            dir,
            dir_end,
            key,
            escaped_request_id,
            entry: keys::Entry {
                limit: spec.limit,
                shared: spec.mode == LockMode::Shared,
                value: candidate.map(str::to_owned),
                owner: spec.owner.clone(),
            },
        }
    }
}

/// A request's key in its lock's queue.
struct Queued {
    /// The key's create revision (the fence).
    revision: i64,
    /// The length of its lease, in seconds.
    ttl_s: i64,
    /// Holder or waiter, as of when it was queued.
    turn: Turn,
}

/// What a queued grant waits for.
enum Turn {
    /// It is among the first `limit` keys: it holds the lock.
    Granted,
    /// It waits for a deletion in this key range.
    Wait(WatchTarget),
}

/// A key (or range) to watch for deletions (and with `puts`, for writes too) after a
/// revision.
struct WatchTarget {
    key: Vec<u8>,
    range_end: Vec<u8>,
    after_revision: i64,
    puts: bool,
}

impl Turn {
    /// A mutex waiter watches only its predecessor; a semaphore waiter watches the
    /// lock's whole range (any holder ahead going frees a place).
    fn wait(
        limit: u32,
        predecessor: Option<Vec<u8>>,
        place: &Place,
        after_revision: i64,
    ) -> Result<Turn, Error> {
        let target = if limit == 1 {
            WatchTarget {
                key: predecessor.ok_or_else(|| unexpected("queue read"))?,
                range_end: Vec::new(),
                after_revision,
                puts: false,
            }
        } else {
            WatchTarget {
                key: place.dir.clone(),
                range_end: place.dir_end.clone(),
                after_revision,
                puts: false,
            }
        };
        Ok(Turn::Wait(target))
    }
}

/// The lease a waiter keeps alive while it watches, and when its next keep-alive is due.
struct KeepAlive<'a> {
    lease_id: i64,
    every: Duration,
    next: &'a mut Instant,
}

/// A lease granted for an acquire that has not answered yet. Dropped armed (the
/// acquire failed or was cancelled), it revokes the lease in the background;
/// [`PendingGrant::give_up`] revokes it before returning, so that a `Held` or `Timeout`
/// answer leaves nothing behind.
struct PendingGrant {
    backend: EtcdBackend,
    lease_id: i64,
    /// On a session's lease: the request's key, deleted (if still on that lease)
    /// instead of revoking the session.
    session_key: Option<Vec<u8>>,
    armed: bool,
}

impl PendingGrant {
    fn new(backend: EtcdBackend, lease_id: i64) -> PendingGrant {
        PendingGrant {
            backend,
            lease_id,
            session_key: None,
            armed: true,
        }
    }

    /// The grant is returned: keep the lease.
    fn keep(&mut self) {
        self.armed = false;
    }

    /// Revokes the lease now. If etcd cannot be reached the lease runs out by itself;
    /// if this is cancelled half-way, the drop tries again in the background.
    async fn give_up(&mut self) {
        let _ = self
            .backend
            .abandon(self.lease_id, self.session_key.clone())
            .await;
        self.armed = false;
    }
}

impl Drop for PendingGrant {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let backend = self.backend.clone();
            let lease_id = self.lease_id;
            let session_key = self.session_key.take();
            runtime.spawn(async move {
                let _ = backend.abandon(lease_id, session_key).await;
            });
        }
    }
}

/// The transaction that queues a new grant: if the request's key does not exist, read
/// the oldest and the newest key of the lock (with the count), then put the key on
/// `lease_id`; else read the key (a retry).
fn create_txn(place: &Place, lease_id: i64) -> pb::TxnRequest {
    let key = place.key.as_slice();
    let edge = |order: SortOrder| {
        range_op(pb::RangeRequest {
            key: place.dir.clone(),
            range_end: place.dir_end.clone(),
            sort_order: order as i32,
            sort_target: SortTarget::Create as i32,
            limit: 1,
            ..Default::default()
        })
    };
    pb::TxnRequest {
        compare: vec![compare(
            key,
            CompareTarget::Create,
            TargetUnion::CreateRevision(0),
        )],
        success: vec![
            edge(SortOrder::Ascend),
            edge(SortOrder::Descend),
            pb::RequestOp {
                request: Some(Op::RequestPut(pb::PutRequest {
                    key: key.to_vec(),
                    value: keys::value(&place.entry),
                    lease: lease_id,
                    ..Default::default()
                })),
            },
        ],
        failure: vec![range_op(pb::RangeRequest {
            key: key.to_vec(),
            ..Default::default()
        })],
    }
}

/// The `N` operation results of a transaction.
fn responses<const N: usize>(reply: pb::TxnResponse, what: &str) -> Result<[OpResponse; N], Error> {
    let results: Vec<OpResponse> = reply
        .responses
        .into_iter()
        .filter_map(|r| r.response)
        .collect();
    results.try_into().map_err(|_| unexpected(what))
}

fn range_op(range: pb::RangeRequest) -> pb::RequestOp {
    pb::RequestOp {
        request: Some(Op::RequestRange(range)),
    }
}

/// `key`'s `target` equals `value`.
fn compare(key: &[u8], target: CompareTarget, value: TargetUnion) -> pb::Compare {
    pb::Compare {
        result: CompareResult::Equal as i32,
        target: target as i32,
        key: key.to_vec(),
        target_union: Some(value),
        range_end: Vec::new(),
    }
}

/// `ttl` in whole seconds, rounded up (etcd leases are whole seconds).
fn whole_seconds(ttl: Duration) -> i64 {
    let seconds = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    i64::try_from(seconds).unwrap_or(i64::MAX)
}

fn header_revision(header: Option<&pb::ResponseHeader>) -> Result<i64, Error> {
    header
        .map(|h| h.revision)
        .filter(|&r| r > 0)
        .ok_or_else(|| unexpected("response header"))
}

fn revision_u64(revision: i64) -> Result<u64, Error> {
    u64::try_from(revision).map_err(|_| unexpected("create revision"))
}

fn invalid(message: String) -> Error {
    Error::new(ErrorKind::InvalidArgument, message)
}

fn unexpected(what: &str) -> Error {
    Error::new(
        ErrorKind::Protocol,
        format!("etcd answered an unexpected {what}"),
    )
}

fn not_held(name: &str, verb: &str) -> Error {
    Error::new(
        ErrorKind::NotHeld,
        format!("{name:?} is not {verb} by this grant"),
    )
}

fn foreign_key(key: &str) -> Error {
    Error::new(
        ErrorKind::Protocol,
        format!("{key:?} is under the lock prefix but was not written by fencelock"),
    )
}

/// Maps an etcd gRPC status to an [`Error`]. etcd reports a lost leader, a request
/// timeout and a leader change as `Unavailable`, too many requests as
/// `ResourceExhausted`, a lease that is gone as `NotFound`.
fn status_error(status: Status) -> Error {
    let kind = match status.code() {
        Code::Unavailable
        | Code::DeadlineExceeded
        | Code::Cancelled
        | Code::Aborted
        | Code::Unknown => ErrorKind::Unavailable,
        Code::ResourceExhausted => ErrorKind::ResourceExhausted,
        Code::Unauthenticated | Code::PermissionDenied => ErrorKind::PermissionDenied,
        Code::NotFound => ErrorKind::NotHeld,
        Code::InvalidArgument => ErrorKind::InvalidArgument,
        Code::Internal | Code::DataLoss => ErrorKind::Internal,
        _ => ErrorKind::Protocol,
    };
    let (kind, mut message) = match (status.code(), status.message()) {
        (_, "") => (kind, format!("etcd: {:?}", status.code())),
        (Code::InvalidArgument, "etcdserver: user name is empty") => (
            ErrorKind::PermissionDenied,
            "etcd has auth enabled: give EtcdConfig::credentials".to_owned(),
        ),
        (Code::PermissionDenied, _) => (
            kind,
            format!(
                "etcd: {} (the user needs read and write permission on the lock prefix)",
                status.message()
            ),
        ),
        (_, text) => (kind, format!("etcd: {text}")),
    };
    // Connection and TLS failures explain themselves only in the source chain, whose
    // links often repeat each other.
    let mut source = std::error::Error::source(&status);
    for _ in 0..8 {
        let Some(cause) = source else { break };
        let text = cause.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = cause.source();
    }
    Error::new(kind, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttls_round_up_to_whole_seconds() {
        for (ttl, seconds) in [
            (Duration::from_millis(1), 1),
            (Duration::from_millis(300), 1),
            (Duration::from_secs(1), 1),
            (Duration::from_millis(1001), 2),
            (Duration::from_secs(2), 2),
            (Duration::from_secs(24 * 3600), 24 * 3600),
        ] {
            assert_eq!(whole_seconds(ttl), seconds, "{ttl:?}");
        }
    }
}
