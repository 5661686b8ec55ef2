//! The fencelock server as a [`LockBackend`]: `Acquire`, `Renew` and `Release` over the
//! wire protocol `flw/1` (see [`Transport`]), everything else over gRPC
//! (`fencelock.v1.Locks`).

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::time::Instant;

use fencelock_proto as pb;
use fencelock_proto::locks_client::LocksClient;
use tonic::metadata::MetadataValue;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::Request;

use fencelock_proto::wire::{Request as WireRequest, Response as WireResponse};

use crate::codes::error_from_status;
use crate::route::{self, Failure, Next, Route};
use crate::view::{LockEvent, LockInfo, LockPage, WatchPosition};
use crate::wire::WireClient;
use crate::{Error, ErrorKind};
use fencelock_backend::Backoff;
use fencelock_backend::{
    validate_value, AcquireSpec, BoxFuture, Capabilities, FenceGuarantee, Leader, Lease,
    LockBackend, SessionLease,
};
use tokio_rustls::rustls::pki_types::ServerName;

/// The pause between rounds of a call while the cluster is between leaders: 25–50 ms
/// after the first round, then 50–100 ms. An election takes about half a second
/// (the members' leader lease: 10 heartbeats), and a pause that grew like a general
/// retry's (up to 2 s) would leave a client waiting long after the new leader
/// serves; a round costs each member a `not_leader` answer.
const BETWEEN_LEADERS: Backoff =
    Backoff::new(Duration::from_millis(50), Duration::from_millis(100));

/// How to reach a fencelock server, or the members of a fencelock cluster.
///
/// With several endpoints the client sends each request to the member that last
/// answered; a member that is not the leader answers `not_leader` with the leader's
/// URL, and the request follows it; a member that cannot be reached is skipped for the
/// next one. While the cluster is between leaders a call tries again with backoff
/// within its own deadline (an acquire's wait, else `request_timeout`); beyond that the
/// caller's retries (acquire within its wait, renewals within the lease's safe
/// deadline) take over.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ServerConfig {
    /// The server's URL, e.g. `http://127.0.0.1:7420`, or the URLs of a cluster's
    /// members separated by commas (`http://10.0.0.1:7420,http://10.0.0.2:7420`).
    pub url: String,
    /// More members of the same cluster, besides those in `url` (see
    /// [`ServerConfig::endpoints`]).
    pub endpoints: Vec<String>,
    /// How long to wait for a TCP connection before a request fails as
    /// [`ErrorKind::Unavailable`]. Default 5 s.
    pub connect_timeout: Duration,
    /// How long a request may take beyond any time it asked the server to wait.
    /// Default 10 s.
    pub request_timeout: Duration,
    /// A bearer token sent with every request, if the server requires one.
    pub token: Option<String>,
    /// For `https://` URLs: the PEM certificate(s) of the CA to trust instead of the
    /// system's roots (e.g. a private CA).
    pub ca_cert_pem: Option<Vec<u8>>,
    /// How `Acquire`, `Renew` and `Release` travel. Default [`Transport::Wire`].
    pub transport: Transport,
}

/// How the hot-path calls (`Acquire`, `Renew`, `Release`) reach the server. Listings,
/// force-release and watches always use gRPC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Transport {
    /// The wire protocol `flw/1` on the same port (inside TLS for `https://` URLs),
    /// a fraction of gRPC's CPU per request, falling back to gRPC for a server that
    /// does not speak it.
    #[default]
    Wire,
    /// gRPC for everything.
    Grpc,
}

impl ServerConfig {
    /// The defaults for `url` (one URL, or a comma-separated list of a cluster's).
    pub fn new(url: impl Into<String>) -> ServerConfig {
        ServerConfig {
            url: url.into(),
            endpoints: Vec::new(),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
            token: None,
            ca_cert_pem: None,
            transport: Transport::Wire,
        }
    }

    /// The defaults for the members of a cluster at `urls` (tried in this order
    /// until the leader is found).
    pub fn with_endpoints<I, S>(urls: I) -> ServerConfig
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        ServerConfig::new(String::new()).endpoints(urls)
    }

    /// Adds the members at `urls` to the ones already configured.
    pub fn endpoints<I, S>(mut self, urls: I) -> ServerConfig
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.endpoints.extend(urls.into_iter().map(Into::into));
        self
    }

    /// Every endpoint, in order: those of `url`, then [`endpoints`](ServerConfig::endpoints),
    /// normalized (no trailing `/`), without repeats.
    pub fn urls(&self) -> Vec<String> {
        let mut urls = route::split_list(&self.url);
        for url in self.endpoints.iter().flat_map(|u| route::split_list(u)) {
            if !urls.contains(&url) {
                urls.push(url);
            }
        }
        urls
    }
}

/// Builder methods: `ServerConfig::new(url).token(t).ca_cert_pem(pem)`, since the
/// struct cannot be built with a literal outside this crate.
impl ServerConfig {
    /// Sets [`token`](ServerConfig::token): the bearer token sent with every request.
    pub fn token(mut self, token: impl Into<String>) -> ServerConfig {
        self.token = Some(token.into());
        self
    }

    /// Sets [`ca_cert_pem`](ServerConfig::ca_cert_pem): the PEM certificate(s) of the
    /// CA to trust for `https://` URLs instead of the system's roots.
    pub fn ca_cert_pem(mut self, pem: impl Into<Vec<u8>>) -> ServerConfig {
        self.ca_cert_pem = Some(pem.into());
        self
    }

    /// Sets [`connect_timeout`](ServerConfig::connect_timeout).
    pub fn connect_timeout(mut self, timeout: Duration) -> ServerConfig {
        self.connect_timeout = timeout;
        self
    }

    /// Sets [`request_timeout`](ServerConfig::request_timeout).
    pub fn request_timeout(mut self, timeout: Duration) -> ServerConfig {
        self.request_timeout = timeout;
        self
    }

    /// Sets [`transport`](ServerConfig::transport).
    pub fn transport(mut self, transport: Transport) -> ServerConfig {
        self.transport = transport;
        self
    }
}

/// The fencelock server, spoken to over `flw/1` and gRPC: durable fences, FIFO
/// waiters with direct hand-off, leases on the server's monotonic clock.
///
/// The connections are shared by every clone and re-established after a failure; a
/// request sent while no member is reachable fails as [`ErrorKind::Unavailable`].
/// With several endpoints (a cluster), requests follow the leader (see
/// [`ServerConfig`]).
#[derive(Debug, Clone)]
pub struct FencelockBackend {
    shared: Arc<Shared>,
}

/// What every clone of a backend shares.
struct Shared {
    /// For members added later (a leader named by another member).
    config: ServerConfig,
    /// The endpoints, configured ones first; only grows, up to [`route::MAX_ENDPOINTS`].
    nodes: RwLock<Vec<Arc<Node>>>,
    /// The index of the member that answered last: where requests start.
    current: AtomicUsize,
    request_timeout: Duration,
    authorization: Option<MetadataValue<tonic::metadata::Ascii>>,
}

impl std::fmt::Debug for Shared {
    // Not derived: the config and the authorization hold the token.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let nodes = self.nodes.read().unwrap_or_else(|p| p.into_inner());
        let urls: Vec<&str> = nodes.iter().map(|n| n.url.as_str()).collect();
        f.debug_struct("FencelockBackend")
            .field("endpoints", &urls)
            .field("current", &self.current.load(Ordering::Relaxed))
            .field("request_timeout", &self.request_timeout)
            .field("token", &self.authorization.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// One member's connections.
#[derive(Debug)]
struct Node {
    url: String,
    endpoint: Endpoint,
    client: LocksClient<Channel>,
    /// The `flw/1` connection, unless gRPC was chosen.
    wire: Option<WireClient>,
}

impl Node {
    /// A member reached on first use.
    fn lazy(url: &str, config: &ServerConfig) -> Result<Node, Error> {
        let endpoint = endpoint(url, config)?;
        let wire = wire_client(url, config, &endpoint)?;
        Ok(Node {
            url: url.to_owned(),
            client: LocksClient::new(endpoint.connect_lazy()),
            endpoint,
            wire,
        })
    }

    /// Connects now: `flw/1` if asked for and spoken, else gRPC.
    async fn connect(&mut self) -> Result<(), Error> {
        if let Some(wire) = &self.wire {
            match wire.connect().await {
                Ok(()) => return Ok(()),
                // An older server: gRPC only, connected eagerly below.
                Err(_) if !wire.usable() => {}
                Err(e) => return Err(e),
            }
        }
        let channel = self.endpoint.connect().await.map_err(|e| {
            Error::new(
                ErrorKind::Unavailable,
                format!("cannot connect to {}: {}", self.url, source_chain(&e)),
            )
        })?;
        self.client = LocksClient::new(channel);
        Ok(())
    }

    /// The `flw/1` connection, while the server is known to speak it.
    fn wire(&self) -> Option<&WireClient> {
        self.wire.as_ref().filter(|w| w.usable())
    }
}

/// The longest wait one `Acquire` call may ask for (the server's default bound);
/// longer waits are split into several calls.
const MAX_WAIT_PER_CALL: Duration = Duration::from_secs(3600);

impl FencelockBackend {
    /// Connects to the server at `config.url` (to the first member of a cluster that
    /// can be reached), failing if none can be within `connect_timeout` each.
    pub async fn connect(config: ServerConfig) -> Result<FencelockBackend, Error> {
        // A bad token is the caller's mistake, whether or not a server answers.
        authorization(&config)?;
        let urls = config.urls();
        let mut nodes = Vec::with_capacity(urls.len());
        for url in &urls {
            nodes.push(Node::lazy(url, &config)?);
        }
        let mut last = None;
        let mut connected = None;
        for (i, node) in nodes.iter_mut().enumerate() {
            match node.connect().await {
                Ok(()) => {
                    connected = Some(i);
                    break;
                }
                // Another member may do (unreachable, stopping, not the leader).
                Err(e) if e.kind() == ErrorKind::Unavailable => last = Some(e),
                // A bad token or TLS setting: the same for every member.
                Err(e) => return Err(e),
            }
        }
        let Some(current) = connected else {
            return Err(last.unwrap_or_else(no_url));
        };
        FencelockBackend::from_nodes(nodes, current, config)
    }

    /// Like [`connect`](FencelockBackend::connect), but connects on first use (and
    /// never fails for an unreachable server: requests do).
    pub fn connect_lazy(config: ServerConfig) -> Result<FencelockBackend, Error> {
        let nodes = config
            .urls()
            .iter()
            .map(|url| Node::lazy(url, &config))
            .collect::<Result<Vec<_>, _>>()?;
        FencelockBackend::from_nodes(nodes, 0, config)
    }

    fn from_nodes(
        nodes: Vec<Node>,
        current: usize,
        config: ServerConfig,
    ) -> Result<FencelockBackend, Error> {
        if nodes.is_empty() {
            return Err(no_url());
        }
        let authorization = authorization(&config)?;
        Ok(FencelockBackend {
            shared: Arc::new(Shared {
                nodes: RwLock::new(nodes.into_iter().map(Arc::new).collect()),
                current: AtomicUsize::new(current),
                request_timeout: config.request_timeout,
                authorization,
                config,
            }),
        })
    }

    /// The URL of the member requests go to first (the leader, once one answered).
    pub fn current_url(&self) -> String {
        let nodes = self.nodes();
        let i = self.shared.current.load(Ordering::Relaxed);
        nodes
            .get(i)
            .or(nodes.first())
            .map(|n| n.url.clone())
            .unwrap_or_default()
    }

    fn nodes(&self) -> std::sync::RwLockReadGuard<'_, Vec<Arc<Node>>> {
        // A panic while holding the lock cannot leave the list half-written (push only).
        self.shared.nodes.read().unwrap_or_else(|p| p.into_inner())
    }

    fn node(&self, i: usize) -> Option<Arc<Node>> {
        self.nodes().get(i).cloned()
    }

    /// The index of `url`, added to the endpoints if new (bounded by
    /// [`route::MAX_ENDPOINTS`]); `None` if it cannot be added.
    fn add(&self, url: &str) -> Option<usize> {
        let mut nodes = self.shared.nodes.write().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = nodes.iter().position(|n| n.url == url) {
            return Some(i);
        }
        if nodes.len() >= route::MAX_ENDPOINTS {
            return None;
        }
        let node = Node::lazy(url, &self.shared.config).ok()?;
        nodes.push(Arc::new(node));
        Some(nodes.len() - 1)
    }

    /// Runs `op` on the member that answered last, following `not_leader` answers and
    /// passing over unreachable members (each at most once per round), until one
    /// answers or `deadline` passes. The failure of the last member tried is returned.
    ///
    /// A round in which some member answered `not_leader` means a cluster between
    /// leaders (an election, or a leader that just died and is still named): another
    /// round follows after a backoff, as long as it can start before `rounds_until`.
    /// A round of unreachable members only is not repeated here: the caller's own
    /// retries (acquire within its wait, renewal within the lease) decide.
    async fn call<T, F, Fut>(
        &self,
        deadline: Instant,
        rounds_until: Instant,
        mut op: F,
    ) -> Result<T, Error>
    where
        F: FnMut(Arc<Node>) -> Fut,
        Fut: Future<Output = Result<T, Error>>,
    {
        let backoff = BETWEEN_LEADERS;
        let mut round = 0u32;
        loop {
            let len = self.nodes().len();
            let mut route = Route::new(self.shared.current.load(Ordering::Relaxed), len);
            let mut between_leaders = false;
            let error = loop {
                let Some(node) = self.node(route.current()) else {
                    return Err(no_url());
                };
                let error = match op(node).await {
                    Ok(answer) => {
                        self.shared
                            .current
                            .store(route.current(), Ordering::Relaxed);
                        return Ok(answer);
                    }
                    Err(e) => e,
                };
                let failure = if error.is_not_leader() {
                    between_leaders = true;
                    Failure::NotLeader(error.leader())
                } else if error.kind() == ErrorKind::Unavailable {
                    Failure::Unreachable
                } else {
                    Failure::Final
                };
                let endpoints: Vec<String> = self.nodes().iter().map(|n| n.url.clone()).collect();
                let moved = match route.after(&endpoints, failure) {
                    Next::Endpoint(_) => true,
                    Next::Add(url) => match self.add(&url) {
                        Some(i) => {
                            route.relocate(i);
                            true
                        }
                        None => false,
                    },
                    Next::Stop => false,
                };
                // The next request (or round) starts past the member that failed last.
                self.shared
                    .current
                    .store(route.current(), Ordering::Relaxed);
                if matches!(failure, Failure::Final) || Instant::now() >= deadline {
                    return Err(error);
                }
                if !moved {
                    break error;
                }
            };
            let delay = backoff.delay(round);
            round = round.saturating_add(1);
            if !between_leaders || Instant::now() + delay >= rounds_until.min(deadline) {
                return Err(error);
            }
            tokio::time::sleep(delay).await;
        }
    }

    /// How long one member gets to answer a renewal of a lease of `ttl`. With several
    /// members, a third of the ttl (the renewal interval; at least 100 ms): a leader
    /// that hangs (stopped, partitioned) must not use up the lease before the next
    /// member is asked. With one, the request timeout, as before: there is no one
    /// else to ask.
    fn renew_hop_limit(&self, ttl: Duration) -> Duration {
        if self.nodes().len() > 1 {
            (ttl / 3)
                .max(Duration::from_millis(100))
                .min(self.shared.request_timeout)
        } else {
            self.shared.request_timeout
        }
    }

    /// How long a call that asks no wait may go on retrying between leaders.
    fn rounds_until(&self) -> Instant {
        self.deadline(Duration::ZERO)
    }

    /// The deadline of a call that asks the server to wait `wait`.
    fn deadline(&self, wait: Duration) -> Instant {
        let total = self.shared.request_timeout.saturating_add(wait);
        Instant::now()
            .checked_add(total)
            .unwrap_or_else(|| Instant::now() + MAX_WAIT_PER_CALL)
    }

    fn request<T>(&self, message: T, extra_time: Duration) -> Request<T> {
        let mut request = Request::new(message);
        request.set_timeout(self.shared.request_timeout.saturating_add(extra_time));
        if let Some(auth) = &self.shared.authorization {
            request.metadata_mut().insert("authorization", auth.clone());
        }
        request
    }

    /// One unary gRPC call through [`Self::call`] (following the leader, passing
    /// over unreachable members): `build` makes the message for each member tried,
    /// given what is left of the server-side wait, and `rpc` sends it.
    ///
    /// `wait` is `None` for a call that asks no wait (rounds between leaders for up
    /// to a request timeout); `Some` for one the server holds up to that long (at
    /// most [`MAX_WAIT_PER_CALL`]), retried between leaders only within the wait.
    async fn unary<M, R, B, F, Fut>(
        &self,
        wait: Option<Duration>,
        build: B,
        rpc: F,
    ) -> Result<R, Error>
    where
        B: Fn(Duration) -> M,
        F: Fn(LocksClient<Channel>, Request<M>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<R>, tonic::Status>>,
    {
        let (deadline, rounds_until, wait_until) = match wait {
            None => (self.deadline(Duration::ZERO), self.rounds_until(), None),
            Some(wait) => {
                let wait = wait.min(MAX_WAIT_PER_CALL);
                let until = Instant::now() + wait;
                (self.deadline(wait), until, Some(until))
            }
        };
        let (build, rpc) = (&build, &rpc);
        self.call(deadline, rounds_until, |node| async move {
            let wait = wait_until.map_or(Duration::ZERO, |u| {
                u.saturating_duration_since(Instant::now())
            });
            rpc(node.client.clone(), self.request(build(wait), wait))
                .await
                .map(tonic::Response::into_inner)
                .map_err(error_from_status)
        })
        .await
    }

    /// One lock's holders and queue; [`ErrorKind::NotFound`] if nobody holds, waits
    /// for, or is delayed on it.
    pub async fn get_lock(&self, name: &str) -> Result<LockInfo, Error> {
        let info = self
            .unary(
                None,
                |_| pb::GetLockRequest {
                    name: name.to_owned(),
                },
                |mut c, r| async move { c.get_lock(r).await },
            )
            .await?;
        Ok(LockInfo::from(info))
    }

    /// Locks whose names start with `prefix`, in name order, a page at a time: pass the
    /// previous page's `next_after` as `after`. `limit` 0 means the server's default.
    pub async fn list_locks(
        &self,
        prefix: &str,
        after: Option<String>,
        limit: u32,
    ) -> Result<LockPage, Error> {
        let page = self
            .unary(
                None,
                |_| pb::ListLocksRequest {
                    prefix: prefix.to_owned(),
                    after: after.clone(),
                    limit,
                },
                |mut c, r| async move { c.list_locks(r).await },
            )
            .await?;
        Ok(LockPage::from(page))
    }

    /// Operator action: takes `name` from its holder(s) (only the one with `fence`, if
    /// given), with a reason for the audit trail. Returns the fences released.
    pub async fn force_release(
        &self,
        name: &str,
        fence: Option<u64>,
        reason: &str,
    ) -> Result<Vec<u64>, Error> {
        let answer = self
            .unary(
                None,
                |_| pb::ForceReleaseRequest {
                    name: name.to_owned(),
                    fence,
                    reason: reason.to_owned(),
                },
                |mut c, r| async move { c.force_release(r).await },
            )
            .await?;
        Ok(answer.fences)
    }

    /// Durable lock events for names starting with `prefix`, from now on. If the
    /// connection drops, the server restarts or the watcher falls behind, the
    /// stream reconnects (to any endpoint, with backoff) and resumes after the
    /// last event it returned, missing and repeating none; if the server can no
    /// longer resume there, [`EventStream::next`] fails with
    /// [`ErrorKind::WatchCompacted`]: re-read the state and watch again.
    pub async fn watch(&self, prefix: &str) -> Result<EventStream, Error> {
        self.watch_after(prefix, None).await
    }

    /// [`Self::watch`], resuming after `after` (the position of the last event seen,
    /// [`LockEvent::position`]) instead of from now on.
    pub async fn watch_after(
        &self,
        prefix: &str,
        after: Option<WatchPosition>,
    ) -> Result<EventStream, Error> {
        let (inner, start) = self.open_watch(prefix, after).await?;
        Ok(EventStream {
            backend: self.clone(),
            prefix: prefix.to_owned(),
            last: start.or(after),
            inner: Some(inner),
            reconnect_for: DEFAULT_WATCH_RECONNECT,
            ended: false,
        })
    }

    /// Opens one `Watch` call: its stream and the position it starts after (sent by
    /// the server in the response metadata).
    async fn open_watch(
        &self,
        prefix: &str,
        after: Option<WatchPosition>,
    ) -> Result<(tonic::Streaming<pb::LockEvent>, Option<WatchPosition>), Error> {
        self.call(
            self.deadline(Duration::ZERO),
            self.rounds_until(),
            |node| async move {
                let mut request = Request::new(pb::WatchRequest {
                    prefix: prefix.to_owned(),
                    after: after.map(|p| pb::WatchPosition {
                        index: p.index,
                        ordinal: p.ordinal,
                    }),
                });
                if let Some(auth) = &self.shared.authorization {
                    request.metadata_mut().insert("authorization", auth.clone());
                }
                let response = node
                    .client
                    .clone()
                    .watch(request)
                    .await
                    .map_err(error_from_status)?;
                let start = response
                    .metadata()
                    .get(fencelock_proto::WATCH_START_METADATA)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse().ok());
                Ok((response.into_inner(), start))
            },
        )
        .await
    }
}

/// How long an [`EventStream`] keeps trying to reconnect by default.
pub const DEFAULT_WATCH_RECONNECT: Duration = Duration::from_secs(60);

/// The `authorization` metadata of `config`'s token.
fn authorization(
    config: &ServerConfig,
) -> Result<Option<MetadataValue<tonic::metadata::Ascii>>, Error> {
    let Some(token) = &config.token else {
        return Ok(None);
    };
    let value = format!("Bearer {token}").parse().map_err(|_| {
        Error::new(
            ErrorKind::InvalidArgument,
            "the token must be printable ASCII",
        )
    })?;
    Ok(Some(value))
}

fn no_url() -> Error {
    Error::new(ErrorKind::InvalidArgument, "no server URL was given")
}

/// A stream of lock events from [`FencelockBackend::watch`]: it remembers the
/// position of the last event it returned and, when the connection drops or the
/// server restarts, reconnects and resumes after it.
#[derive(Debug)]
pub struct EventStream {
    backend: FencelockBackend,
    prefix: String,
    /// The last event returned (or where the watch began).
    last: Option<WatchPosition>,
    /// The open call; `None` while reconnecting.
    inner: Option<tonic::Streaming<pb::LockEvent>>,
    reconnect_for: Duration,
    /// The server said it cannot resume: nothing more comes.
    ended: bool,
}

impl EventStream {
    /// The next event; `Ok(None)` when the server ended the stream cleanly.
    ///
    /// A dropped connection, a server restart or a watcher that fell behind is
    /// handled here: the stream reconnects (trying every endpoint, with backoff,
    /// for up to [`Self::set_reconnect_for`]; default 60 s)
    /// and resumes after [`Self::position`]. Errors:
    /// [`ErrorKind::WatchCompacted`] if the server can no longer resume there (the
    /// stream is over: re-read the state and watch again);
    /// [`ErrorKind::Unavailable`] if no server could be reached in time (calling
    /// `next` again tries again, from the same position).
    pub async fn next(&mut self) -> Result<Option<LockEvent>, Error> {
        if self.ended {
            return Err(compacted_over());
        }
        let mut round = 0u32;
        let mut reconnecting_since: Option<Instant> = None;
        loop {
            let inner = match &mut self.inner {
                Some(inner) => inner,
                None => match self.backend.open_watch(&self.prefix, self.last).await {
                    Ok((inner, start)) => {
                        self.last = self.last.or(start);
                        self.inner.insert(inner)
                    }
                    Err(e) if e.kind() == ErrorKind::WatchCompacted => {
                        self.ended = true;
                        return Err(e);
                    }
                    Err(e) if e.kind().is_transient() => {
                        let since = *reconnecting_since.get_or_insert_with(Instant::now);
                        let delay = Backoff::default().delay(round);
                        round = round.saturating_add(1);
                        if since.elapsed() + delay >= self.reconnect_for {
                            return Err(e);
                        }
                        tokio::time::sleep(delay).await;
                        continue;
                    }
                    Err(e) => return Err(e),
                },
            };
            match inner.message().await {
                Ok(Some(event)) => {
                    let event = LockEvent::from(event);
                    // Never twice: a resumed call starts after `last`.
                    if let (Some(p), Some(last)) = (event.position, self.last) {
                        if p <= last {
                            continue;
                        }
                    }
                    if event.position.is_some() {
                        self.last = event.position;
                    }
                    return Ok(Some(event));
                }
                Ok(None) => return Ok(None),
                Err(status) => {
                    let lagged = status.code() == tonic::Code::DataLoss;
                    let error = error_from_status(status);
                    self.inner = None;
                    if error.kind() == ErrorKind::WatchCompacted {
                        self.ended = true;
                        return Err(error);
                    }
                    // Without a position (a server too old to send one) there is
                    // nothing to resume from.
                    if self.last.is_none() || !(lagged || error.kind().is_transient()) {
                        return Err(error);
                    }
                }
            }
        }
    }

    /// The position of the last event returned (or where the watch began): what a
    /// later [`FencelockBackend::watch_after`] resumes after.
    pub fn position(&self) -> Option<WatchPosition> {
        self.last
    }

    /// How long [`Self::next`] keeps trying to reconnect before it gives up with
    /// [`ErrorKind::Unavailable`].
    pub fn set_reconnect_for(&mut self, budget: Duration) {
        self.reconnect_for = budget;
    }
}

fn compacted_over() -> Error {
    Error::new(
        ErrorKind::WatchCompacted,
        "this watch cannot resume; re-read the state and watch again",
    )
}

fn endpoint(url: &str, config: &ServerConfig) -> Result<Endpoint, Error> {
    let endpoint = Endpoint::from_shared(url.to_owned()).map_err(|e| {
        Error::new(
            ErrorKind::InvalidArgument,
            format!("invalid server URL {url:?}: {e}"),
        )
    })?;
    let endpoint = if endpoint.uri().scheme_str() == Some("https") {
        let tls = match &config.ca_cert_pem {
            Some(pem) => ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem)),
            None => ClientTlsConfig::new().with_native_roots(),
        };
        endpoint.tls_config(tls).map_err(|e| {
            Error::new(
                ErrorKind::InvalidArgument,
                format!("TLS settings for {url:?}: {}", source_chain(&e)),
            )
        })?
    } else if config.ca_cert_pem.is_some() {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("a CA certificate was given, but {url:?} is not an https:// URL"),
        ));
    } else {
        endpoint
    };
    Ok(endpoint
        .connect_timeout(config.connect_timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(5))
        .keep_alive_while_idle(true))
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl LockBackend for FencelockBackend {
    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::new("fencelock", FenceGuarantee::Durable);
        caps.fifo = true;
        caps.push_wakeups = true;
        caps.lock_delay = true;
        caps.sessions = true;
        caps.semaphores = true;
        caps.monotonic_leases = true;
        caps.shared = true;
        caps.downgrade = true;
        caps.elections = true;
        caps.multi = true;
        caps
    }

    fn downgrade<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            self.unary(
                None,
                |_| pb::DowngradeRequest {
                    name: lease.name.clone(),
                    owner_token: lease.owner_token.clone(),
                },
                |mut c, r| async move { c.downgrade(r).await },
            )
            .await
            .map(drop)
        })
    }

    fn campaign<'a>(
        &'a self,
        spec: &'a AcquireSpec,
        value: &'a str,
    ) -> BoxFuture<'a, Result<Lease, Error>> {
        Box::pin(async move {
            spec.validate()?;
            validate_value(value)?;
            // gRPC, not flw/1: dropping the call leaves the queue.
            let grant = self
                .unary(
                    Some(spec.wait),
                    |wait| pb::CampaignRequest {
                        name: spec.name.clone(),
                        value: value.to_owned(),
                        ttl_ms: spec.session.is_none().then(|| ms(spec.ttl)),
                        wait_ms: ms(wait),
                        owner: spec.owner.clone(),
                        request_id: Some(spec.request_id.clone()),
                        session: spec.session.clone(),
                    },
                    |mut c, r| async move { c.campaign(r).await },
                )
                .await?;
            Ok(lease_of(grant))
        })
    }

    fn proclaim<'a>(
        &'a self,
        lease: &'a Lease,
        value: &'a str,
    ) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            validate_value(value)?;
            self.unary(
                None,
                |_| pb::ProclaimRequest {
                    name: lease.name.clone(),
                    owner_token: lease.owner_token.clone(),
                    value: value.to_owned(),
                },
                |mut c, r| async move { c.proclaim(r).await },
            )
            .await
            .map(drop)
        })
    }

    fn leader<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<Leader>, Error>> {
        Box::pin(async move {
            let answer = self
                .unary(
                    None,
                    |_| pb::LeaderRequest {
                        name: name.to_owned(),
                    },
                    |mut c, r| async move { c.leader(r).await },
                )
                .await?;
            Ok(answer
                .leader
                .map(|l| Leader::new(l.name, l.value, l.term, l.owner)))
        })
    }

    fn acquire<'a>(&'a self, spec: &'a AcquireSpec) -> BoxFuture<'a, Result<Lease, Error>> {
        Box::pin(async move {
            spec.validate()?;
            let wait = spec.wait.min(MAX_WAIT_PER_CALL);
            let wait_until = Instant::now() + wait;
            // Every member tried gets the same request id: one that already granted
            // (or queued) it answers with that grant (or queue place).
            let grant = self
                .call(self.deadline(wait), wait_until, |node| async move {
                    let wait = wait_until.saturating_duration_since(Instant::now());
                    let message = pb::AcquireRequest {
                        name: spec.name.clone(),
                        // A session-held lock has the session's lease.
                        ttl_ms: spec.session.is_none().then(|| ms(spec.ttl)),
                        wait_ms: ms(wait),
                        owner: spec.owner.clone(),
                        request_id: Some(spec.request_id.clone()),
                        limit: spec.limit,
                        lock_delay_ms: ms(spec.lock_delay),
                        session: spec.session.clone(),
                        mode: spec.mode.as_str().to_owned(),
                    };
                    match node.wire() {
                        Some(wire) => {
                            match wire.call(WireRequest::Acquire(message), wait, true).await? {
                                WireResponse::Grant(grant) => Ok(grant),
                                other => Err(unexpected("Acquire", &other)),
                            }
                        }
                        None => Ok(node
                            .client
                            .clone()
                            .acquire(self.request(message, wait))
                            .await
                            .map_err(error_from_status)?
                            .into_inner()),
                    }
                })
                .await?;
            Ok(lease_of(grant))
        })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Duration, Error>> {
        Box::pin(async move {
            let hop_limit = self.renew_hop_limit(ttl);
            let renewed = self
                .call(
                    self.deadline(Duration::ZERO),
                    self.rounds_until(),
                    |node| async move {
                        let message = pb::RenewRequest {
                            name: lease.name.clone(),
                            owner_token: lease.owner_token.clone(),
                            ttl_ms: Some(ms(ttl)),
                        };
                        let renew = async {
                            match node.wire() {
                                Some(wire) => match wire
                                    .call(WireRequest::Renew(message), Duration::ZERO, false)
                                    .await?
                                {
                                    WireResponse::Renewed(renewed) => Ok(renewed),
                                    other => Err(unexpected("Renew", &other)),
                                },
                                None => Ok(node
                                    .client
                                    .clone()
                                    .renew(self.request(message, Duration::ZERO))
                                    .await
                                    .map_err(error_from_status)?
                                    .into_inner()),
                            }
                        };
                        match tokio::time::timeout(hop_limit, renew).await {
                            Ok(answer) => answer,
                            // A renewal is idempotent: a late answer changes nothing.
                            Err(_) => Err(Error::new(
                                ErrorKind::Unavailable,
                                format!("no answer from {} within {hop_limit:?}", node.url),
                            )),
                        }
                    },
                )
                .await?;
            Ok(Duration::from_millis(renewed.ttl_ms))
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            let released = self
                .call(
                    self.deadline(Duration::ZERO),
                    self.rounds_until(),
                    |node| async move {
                        let message = pb::ReleaseRequest {
                            name: lease.name.clone(),
                            owner_token: lease.owner_token.clone(),
                        };
                        match node.wire() {
                            Some(wire) => match wire
                                .call(WireRequest::Release(message), Duration::ZERO, false)
                                .await?
                            {
                                WireResponse::Released(r) => Ok(r.released),
                                other => Err(unexpected("Release", &other)),
                            },
                            None => node
                                .client
                                .clone()
                                .release(self.request(message, Duration::ZERO))
                                .await
                                .map(|r| r.into_inner().released)
                                .map_err(error_from_status),
                        }
                    },
                )
                .await;
            match released {
                // Already expired or taken: nothing of ours is left to release.
                Err(e) if e.kind() == ErrorKind::NotHeld => Ok(false),
                other => other,
            }
        })
    }

    fn acquire_all<'a>(
        &'a self,
        names: &'a [&'a str],
        spec: &'a AcquireSpec,
    ) -> BoxFuture<'a, Result<Vec<Lease>, Error>> {
        Box::pin(self.acquire_all_call(names, spec))
    }

    fn release_all<'a>(&'a self, leases: &'a [Lease]) -> BoxFuture<'a, Result<Vec<bool>, Error>> {
        Box::pin(self.release_all_call(leases))
    }

    fn open_session<'a>(
        &'a self,
        ttl: Duration,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<SessionLease, Error>> {
        Box::pin(self.open_session_call(ttl, owner))
    }

    fn keep_alive<'a>(
        &'a self,
        session: &'a SessionLease,
    ) -> BoxFuture<'a, Result<Duration, Error>> {
        Box::pin(self.keep_alive_call(session))
    }

    fn close_session<'a>(
        &'a self,
        session: &'a SessionLease,
    ) -> BoxFuture<'a, Result<usize, Error>> {
        Box::pin(self.close_session_call(session))
    }
}

/// Sessions, over gRPC (`OpenSession`, `KeepAlive`, `CloseSession`).
impl FencelockBackend {
    async fn open_session_call(&self, ttl: Duration, owner: &str) -> Result<SessionLease, Error> {
        if ttl.is_zero() || ttl > fencelock_backend::MAX_TTL {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "session ttl must be between 1ms and {}s, got {ttl:?}",
                    fencelock_backend::MAX_TTL.as_secs()
                ),
            ));
        }
        let opened = self
            .unary(
                None,
                |_| pb::OpenSessionRequest {
                    ttl_ms: ms(ttl),
                    owner: owner.to_owned(),
                },
                |mut c, r| async move { c.open_session(r).await },
            )
            .await?;
        Ok(SessionLease::new(
            opened.session,
            Duration::from_millis(opened.ttl_ms),
        ))
    }

    /// One keep-alive: a `KeepAlive` stream carrying one request. Each member gets
    /// what a renewal gets to answer, so a hung leader cannot use up the session.
    async fn keep_alive_call(&self, session: &SessionLease) -> Result<Duration, Error> {
        let hop_limit = self.renew_hop_limit(session.ttl);
        self.call(
            self.deadline(Duration::ZERO),
            self.rounds_until(),
            |node| async move {
                let once = async {
                    let message = pb::KeepAliveRequest {
                        session: session.id.clone(),
                    };
                    let mut request = Request::new(tokio_stream::once(message));
                    request.set_timeout(self.shared.request_timeout);
                    if let Some(auth) = &self.shared.authorization {
                        request.metadata_mut().insert("authorization", auth.clone());
                    }
                    let mut answers = node
                        .client
                        .clone()
                        .keep_alive(request)
                        .await
                        .map_err(error_from_status)?
                        .into_inner();
                    match answers.message().await.map_err(error_from_status)? {
                        Some(answer) => Ok(Duration::from_millis(answer.ttl_ms)),
                        None => Err(Error::new(
                            ErrorKind::Unavailable,
                            format!("{} ended the keep-alive stream without an answer", node.url),
                        )),
                    }
                };
                match tokio::time::timeout(hop_limit, once).await {
                    Ok(answer) => answer,
                    // A keep-alive is idempotent: a late answer changes nothing.
                    Err(_) => Err(Error::new(
                        ErrorKind::Unavailable,
                        format!("no answer from {} within {hop_limit:?}", node.url),
                    )),
                }
            },
        )
        .await
    }

    async fn close_session_call(&self, session: &SessionLease) -> Result<usize, Error> {
        let closed = self
            .unary(
                None,
                |_| pb::CloseSessionRequest {
                    session: session.id.clone(),
                },
                |mut c, r| async move { c.close_session(r).await },
            )
            .await?;
        Ok(usize::try_from(closed.released).unwrap_or(usize::MAX))
    }
}

/// The lease of a grant.
fn lease_of(grant: pb::Grant) -> Lease {
    Lease::new(
        grant.name,
        grant.fence,
        grant.owner_token,
        Duration::from_millis(grant.ttl_ms),
    )
}

/// Multi-locks, over gRPC (`AcquireAll`, `ReleaseAll`).
impl FencelockBackend {
    async fn acquire_all_call(
        &self,
        names: &[&str],
        spec: &AcquireSpec,
    ) -> Result<Vec<Lease>, Error> {
        if names.is_empty() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "name at least one lock",
            ));
        }
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        // gRPC, not flw/1: dropping the call leaves every queue.
        let all = self
            .unary(
                Some(spec.wait),
                |wait| pb::AcquireAllRequest {
                    names: names.clone(),
                    ttl_ms: spec.session.is_none().then(|| ms(spec.ttl)),
                    wait_ms: ms(wait),
                    owner: spec.owner.clone(),
                    request_id: Some(spec.request_id.clone()),
                    limit: spec.limit,
                    lock_delay_ms: ms(spec.lock_delay),
                    session: spec.session.clone(),
                    mode: spec.mode.as_str().to_owned(),
                },
                |mut c, r| async move { c.acquire_all(r).await },
            )
            .await?;
        Ok(all.grants.into_iter().map(lease_of).collect())
    }

    async fn release_all_call(&self, leases: &[Lease]) -> Result<Vec<bool>, Error> {
        let grants: Vec<pb::ReleaseRequest> = leases
            .iter()
            .map(|l| pb::ReleaseRequest {
                name: l.name.clone(),
                owner_token: l.owner_token.clone(),
            })
            .collect();
        let answer = self
            .unary(
                None,
                |_| pb::ReleaseAllRequest {
                    grants: grants.clone(),
                },
                |mut c, r| async move { c.release_all(r).await },
            )
            .await?;
        Ok(answer.released)
    }
}

/// An answer of the wrong kind: the server broke the protocol.
fn unexpected(call: &str, answer: &WireResponse) -> Error {
    Error::new(
        ErrorKind::Protocol,
        format!("the server answered {call} with {answer:?}"),
    )
}

/// The `flw/1` client for `config`, if it asks for the wire transport.
fn wire_client(
    url: &str,
    config: &ServerConfig,
    endpoint: &Endpoint,
) -> Result<Option<WireClient>, Error> {
    let uri = endpoint.uri();
    if config.transport != Transport::Wire {
        return Ok(None);
    }
    let Some(host) = uri.host() else {
        return Ok(None);
    };
    let https = uri.scheme_str() == Some("https");
    let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let addr = if bare.contains(':') {
        format!("[{bare}]:{port}")
    } else {
        format!("{bare}:{port}")
    };
    let tls = if https {
        let name = ServerName::try_from(bare.to_owned()).map_err(|e| {
            Error::new(
                ErrorKind::InvalidArgument,
                format!("invalid server name in {url:?}: {e}"),
            )
        })?;
        Some((
            crate::wire::tls_connector(config.ca_cert_pem.as_deref())?,
            name,
        ))
    } else {
        None
    };
    Ok(Some(WireClient::new(
        addr,
        tls,
        config.token.clone(),
        config.connect_timeout,
        config.request_timeout,
    )))
}

fn source_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn between_leaders_a_call_asks_again_at_least_every_100_ms() {
        // Regression: the general backoff (up to 2 s) left clients waiting up to a
        // second after a half-second election had ended.
        for round in 0..30 {
            let delay = BETWEEN_LEADERS.delay(round);
            assert!(
                delay >= Duration::from_millis(25) && delay <= Duration::from_millis(100),
                "round {round}: {delay:?}"
            );
        }
    }

    #[tokio::test]
    async fn debug_output_names_the_endpoints_but_not_the_token() {
        let mut config = ServerConfig::new("http://a:1,http://b:2");
        config.token = Some("s3cret-token".into());
        let backend = FencelockBackend::connect_lazy(config).unwrap();
        let text = format!("{backend:?}");
        assert!(text.contains("http://b:2"), "{text}");
        assert!(!text.contains("s3cret"), "{text}");
    }

    #[test]
    fn the_builder_sets_every_field() {
        let config = ServerConfig::new("https://a:1")
            .token("t0k")
            .ca_cert_pem(b"PEM".to_vec())
            .connect_timeout(Duration::from_millis(7))
            .request_timeout(Duration::from_millis(9))
            .transport(Transport::Grpc);
        assert_eq!(config.token.as_deref(), Some("t0k"));
        assert_eq!(config.ca_cert_pem.as_deref(), Some(&b"PEM"[..]));
        assert_eq!(config.connect_timeout, Duration::from_millis(7));
        assert_eq!(config.request_timeout, Duration::from_millis(9));
        assert_eq!(config.transport, Transport::Grpc);
    }

    #[test]
    fn endpoints_come_from_the_url_list_and_the_builder() {
        let config = ServerConfig::new("http://a:1, http://b:2/");
        assert_eq!(config.urls(), ["http://a:1", "http://b:2"]);
        let config = ServerConfig::with_endpoints(["http://a:1", "http://b:2"]);
        assert_eq!(config.urls(), ["http://a:1", "http://b:2"]);
        let config = ServerConfig::new("http://a:1").endpoints(["http://a:1/", "http://c:3"]);
        assert_eq!(config.urls(), ["http://a:1", "http://c:3"]);
        let err = FencelockBackend::connect_lazy(ServerConfig::new(" , ")).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    }
}
