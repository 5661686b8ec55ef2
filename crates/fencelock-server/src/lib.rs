//! The fencelock lock server: a durable command log under the sans-IO core, with an
//! HTTP/JSON API and a gRPC API on one port.
//!
//! Start with [`Server::start`]; it recovers the data directory, starts the engine
//! (see [`engine`] for how durability and replies are ordered) and serves both
//! protocols until [`Server::shutdown`].
#![deny(missing_docs)]

mod admission;
pub mod audit;
pub mod auth;
pub mod cluster;
pub mod codec;
pub mod dashboard;
pub mod engine;
pub mod error;
pub mod grpc;
pub mod http;
mod input;
pub mod limits;
pub mod metrics;
pub mod openapi;
pub mod origin;
mod preface;
pub mod series;
pub mod startup;
pub mod tls;
pub mod vocab;
pub mod watch_sse;
pub mod wire;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

pub use auth::{Action, AuthConfig, Principal, Role, TokenConfig};
pub use engine::{
    AcquireArgs, Durability, EngineConfig, Handle, RecoveryReport, Requester, RunState,
    DEFAULT_WRITER_POLL, SERVER_ACTOR,
};
pub use error::{ApiError, ApiErrorKind};
pub use limits::{Limits, QuotaOverrides, Quotas, RateLimit};
pub use startup::{
    ConfigError, ConfigErrorKind, RecoveryError, RecoveryErrorKind, StartError, StartErrorKind,
};
pub use tls::{PeerTlsConfig, TlsConfig};

/// Default time a client has to send a request's headers (also the longest an idle
/// HTTP/1.1 keep-alive connection is kept waiting for its next request).
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How often an HTTP/2 (gRPC) connection is pinged, and how long an answer may take
/// before the connection is closed as dead.
pub const HTTP2_KEEPALIVE: Duration = Duration::from_secs(20);

/// How long an idle connection that is being closed has to finish closing (HTTP/2:
/// to answer the PING of its graceful GOAWAY) before it is dropped. Nothing is in
/// flight on it, so dropping loses nothing.
const IDLE_CLOSE_GRACE: Duration = Duration::from_secs(1);

/// Everything a server needs to start.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address for HTTP/JSON and gRPC (one port).
    pub listen: SocketAddr,
    /// Storage and bounds.
    pub engine: EngineConfig,
    /// Time a client has to send a request's headers before its connection is closed,
    /// so stalled or idle connections cannot pile up.
    pub header_read_timeout: Duration,
    /// Accepted tokens; none: authentication off (then only loopback addresses may
    /// be served, unless `insecure`).
    pub auth: AuthConfig,
    /// Serve a non-loopback address without authentication (`--insecure`).
    pub insecure: bool,
    /// TLS certificate and key; `None`: plain TCP.
    pub tls: Option<TlsConfig>,
    /// Body size, connections, streams, acquire rate.
    pub limits: Limits,
}

impl ServerConfig {
    /// A configuration with the default timeouts.
    pub fn new(listen: SocketAddr, engine: EngineConfig) -> ServerConfig {
        ServerConfig {
            listen,
            engine,
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            auth: AuthConfig::default(),
            insecure: false,
            tls: None,
            limits: Limits::default(),
        }
    }
}

/// A running server.
pub struct Server {
    handle: Handle,
    addr: SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    serving: tokio::task::JoinHandle<std::io::Result<()>>,
}

/// The HTTP routes and the gRPC service on one router, without authentication
/// (see [`secure_app`]).
pub fn app(handle: Handle) -> axum::Router {
    grpc::add_routes(http::router(handle.clone()), handle)
}

/// [`app`] behind the authentication layer ([`auth::layer`]) and with the body size
/// limit of `limits`: what [`Server::start`] serves.
pub fn secure_app(
    handle: Handle,
    authenticator: auth::Authenticator,
    limits: &Limits,
) -> axum::Router {
    grpc::add_routes_with_limit(
        http::router(handle.clone()),
        handle.clone(),
        limits.max_body_bytes,
    )
    .layer(axum::Extension(http::BodyLimit(limits.max_body_bytes)))
    // The same limit for axum's own extractors (the dashboard's forms).
    .layer(axum::extract::DefaultBodyLimit::max(limits.max_body_bytes))
    // Inside the authentication layer: sees the `Principal` it inserted.
    .layer(axum::middleware::from_fn(admit))
    .layer(axum::middleware::from_fn_with_state(
        authenticator.clone(),
        auth::layer,
    ))
    .layer(axum::middleware::from_fn_with_state(
        authenticator.enabled(),
        origin::layer,
    ))
    .layer(axum::middleware::map_response_with_state(
        handle,
        count_refusals,
    ))
}

/// Admits the request's connection (see [`admission`]) once a request on it passed
/// authentication with a [`Principal`]; `/healthz` and `/readyz` admit nobody. If
/// `max_connections` connections are admitted already, the request is refused with
/// 503 `unavailable` and the connection stays unauthenticated (so it is closed at
/// its auth deadline). Requests served without an accept loop (tests of
/// [`secure_app`]) carry no connection and pass.
async fn admit(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    if let Some(connection) = request.extensions().get::<HttpConnection>() {
        let open = matches!(request.uri().path(), "/healthz" | "/readyz");
        if !open && request.extensions().get::<Principal>().is_some() {
            if let Err(refused) = connection.ticket.admit() {
                let grpc = request
                    .headers()
                    .get(axum::http::header::CONTENT_TYPE)
                    .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
                return auth::refuse(grpc, refused.into_error());
            }
        }
    }
    next.run(request).await
}

/// Counts the requests refused at the edge (401, 403, 429) in the metrics: HTTP
/// answers carry their [`ApiErrorKind`] as a response extension, gRPC answers their
/// stable code in the `fencelock-error-code` header (errors are trailers-only
/// responses).
async fn count_refusals(
    axum::extract::State(handle): axum::extract::State<Handle>,
    response: axum::response::Response,
) -> axum::response::Response {
    if let Some(kind) = response.extensions().get::<ApiErrorKind>() {
        handle.metrics().count_refusal(*kind);
    } else if let Some(code) = response.headers().get(grpc::ERROR_CODE_METADATA) {
        let kind = match code.as_bytes() {
            b"unauthenticated" => Some(ApiErrorKind::Unauthenticated),
            b"permission_denied" => Some(ApiErrorKind::PermissionDenied),
            b"rate_limited" => Some(ApiErrorKind::RateLimited),
            _ => None,
        };
        if let Some(kind) = kind {
            handle.metrics().count_refusal(kind);
        }
    }
    response
}

impl Server {
    /// Recovers the data directory, binds, and starts serving. Must run inside a
    /// tokio runtime.
    pub async fn start(config: ServerConfig) -> Result<Server, StartError> {
        auth::check_exposure(config.listen, &config.auth, config.insecure)?;
        config.limits.check()?;
        let authenticator = auth::Authenticator::with_limits(&config.auth, &config.limits)?;
        let tls = config.tls.as_ref().map(TlsConfig::acceptor).transpose()?;
        // Built before the first request: an unauthenticated connection that asks for
        // it must be answered well within `limits.auth_timeout`, even on a busy host.
        let _ = openapi::json();
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(|e| StartError::listen("", config.listen, e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| StartError::internal(format!("no local address: {e}")))?;
        let handle = match &config.engine.cluster {
            None => engine::start(config.engine)?,
            Some(cluster) => {
                // Protected mode covers the peer port too: it needs peer
                // authentication, a cluster secret or mutual TLS.
                if cluster.secret.is_none()
                    && cluster.tls.is_none()
                    && !config.insecure
                    && !cluster.peer_listen.ip().is_loopback()
                {
                    return Err(ConfigError::new(
                        ConfigErrorKind::Insecure,
                        format!(
                            "refusing to listen for peers on {} without peer authentication: \
                             set --cluster-secret-file or mutual TLS (--peer-tls-cert, \
                             --peer-tls-key, --peer-tls-ca), listen for peers on a loopback \
                             address, or pass --insecure",
                            cluster.peer_listen
                        ),
                    )
                    .into());
                }
                let mut engine = config.engine.clone();
                if let Some(c) = engine.cluster.as_mut() {
                    if c.advertise_url.is_empty() {
                        let scheme = if config.tls.is_some() {
                            "https"
                        } else {
                            "http"
                        };
                        c.advertise_url = format!("{scheme}://{addr}");
                    }
                }
                engine::start_cluster(engine).await?.0
            }
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let router = secure_app(handle.clone(), authenticator.clone(), &config.limits);
        let wire = Arc::new(wire::WireOptions {
            handle: handle.clone(),
            auth: authenticator,
            max_frame: config.limits.max_body_bytes,
            max_in_flight: config.limits.max_streams_per_connection as usize,
            header_read_timeout: config.header_read_timeout,
            idle_timeout: config.limits.idle_timeout,
        });
        let options = ServeOptions {
            wire,
            header_read_timeout: config.header_read_timeout,
            limits: config.limits,
            tls,
            handle: handle.clone(),
        };
        let serving = tokio::spawn(serve(listener, router, options, stopped));
        Ok(Server {
            handle,
            addr,
            stop,
            serving,
        })
    }

    /// The bound address (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The engine handle.
    pub fn handle(&self) -> &Handle {
        &self.handle
    }

    /// Graceful shutdown: end waits, stop accepting, finish in-flight requests, make
    /// everything durable, stop the engine.
    pub async fn shutdown(self) -> std::io::Result<()> {
        self.handle.drain();
        let _ = self.stop.send(());
        let served = self
            .serving
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e)));
        self.handle.shutdown().await;
        served
    }
}

/// What the accept loop needs besides the listener and the router.
struct ServeOptions {
    /// For connections that speak `flw/1`.
    wire: Arc<wire::WireOptions>,
    header_read_timeout: Duration,
    limits: Limits,
    tls: Option<tokio_rustls::TlsAcceptor>,
    /// For the connection counters.
    handle: Handle,
}

/// What one HTTP connection's requests carry in their extensions: its place in the
/// pools (for [`admit`]) and what tells whether it is idle.
#[derive(Clone)]
struct HttpConnection {
    ticket: Arc<admission::Ticket>,
    activity: Arc<Activity>,
}

/// Requests on one HTTP connection: started, and in flight (until the response body
/// ends, so a long-lived watch stream counts as in flight).
#[derive(Default)]
struct Activity {
    started: std::sync::atomic::AtomicU64,
    in_flight: std::sync::atomic::AtomicU64,
}

/// Drops with the request it counts in flight (its response body, or its future).
struct InFlight(Arc<Activity>);

impl InFlight {
    fn start(activity: &Arc<Activity>) -> InFlight {
        use std::sync::atomic::Ordering::Relaxed;
        activity.started.fetch_add(1, Relaxed);
        activity.in_flight.fetch_add(1, Relaxed);
        InFlight(activity.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0
            .in_flight
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Tells when a connection has been idle for a whole `idle_timeout`, checked once
/// per `idle_timeout`: idle at a check if nothing was in flight at the previous
/// check, nothing started since, and nothing is in flight now. So a connection is
/// closed between one and two `idle_timeout`s after its last request ended, at the
/// price of two counters per request (no clock read on the request path).
#[derive(Default)]
pub(crate) struct IdleCheck {
    started_before: u64,
    busy_before: bool,
}

impl IdleCheck {
    /// One check: `started` requests so far, `in_flight` now. True: close it.
    pub(crate) fn idle(&mut self, started: u64, in_flight: bool) -> bool {
        let idle = !self.busy_before && !in_flight && started == self.started_before;
        self.started_before = started;
        self.busy_before = in_flight;
        idle
    }
}

/// The accept loop: HTTP/1.1 and HTTP/2 (prior knowledge, for gRPC) and `flw/1` on
/// one listener, optionally inside TLS, with a header read timeout and HTTP/2
/// keepalive pings so that stalled or dead connections are closed, connection
/// admission ([`admission`]: an unauthenticated pool with a deadline, the
/// `max_connections` pool, a cap per IP), idle connections closed, a cap on streams
/// per connection, and a graceful stop (in-flight requests finish).
///
/// The loop itself only accepts: the TLS handshake (bounded by
/// `limits.tls_handshake_timeout`) and everything after it run in the connection's
/// own task, so one slow client never delays the next.
async fn serve(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    options: ServeOptions,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioExecutor, TokioTimer};
    use hyper_util::server::conn::auto::Builder;

    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(options.header_read_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(HTTP2_KEEPALIVE)
        .keep_alive_timeout(HTTP2_KEEPALIVE)
        .max_concurrent_streams(options.limits.max_streams_per_connection);
    let builder = Arc::new(builder);
    let admission = admission::Admission::new(
        &options.limits,
        options.handle.metrics().connections.clone(),
    );
    // Tells connections to stop: those in their TLS handshake give up, the others
    // finish what is in flight.
    let (stopping, stopping_rx) = tokio::sync::watch::channel(());
    loop {
        let Some((stream, peer)) = admission::accept_until(&listener, &mut stop, "client").await
        else {
            break;
        };
        let ticket = match admission.enter(peer.ip()) {
            Ok(ticket) => Arc::new(ticket),
            Err(admission::Refused::PerIp(max)) => {
                tracing::debug!(%peer, max, "refused a connection: too many from its address");
                let message = format!(
                    "the server is serving its maximum of {max} connections from one address; \
                     retry later"
                );
                tokio::spawn(refuse_connection(stream, options.tls.is_some(), message));
                continue;
            }
        };
        let connection = Connection {
            builder: builder.clone(),
            router: router.clone(),
            tls: options.tls.clone(),
            handshake_timeout: options.limits.tls_handshake_timeout,
            header_read_timeout: options.header_read_timeout,
            idle_timeout: options.limits.idle_timeout,
            wire: options.wire.clone(),
            handle: options.handle.clone(),
            stopping: stopping_rx.clone(),
        };
        tokio::spawn(async move {
            // Dropping the connection's future closes it. Once this resolves the
            // connection can no longer be admitted, so it has nothing in flight
            // beyond the open routes (`/healthz`, `/readyz`, the API description)
            // and refusals.
            tokio::select! {
                () = connection.serve(stream, ticket.clone()) => {}
                () = ticket.unauthenticated_end() => {}
            }
        });
    }
    let _ = stopping.send(());
    drop(listener);
    // Connections answer what they have in flight, then close.
    admission.all_ended(Duration::from_secs(10)).await;
    Ok(())
}

/// What one connection's task needs.
struct Connection {
    builder: Arc<hyper_util::server::conn::auto::Builder<hyper_util::rt::TokioExecutor>>,
    router: axum::Router,
    tls: Option<tokio_rustls::TlsAcceptor>,
    handshake_timeout: Duration,
    header_read_timeout: Duration,
    idle_timeout: Duration,
    wire: Arc<wire::WireOptions>,
    handle: Handle,
    stopping: tokio::sync::watch::Receiver<()>,
}

impl Connection {
    /// TLS (if configured), then `flw/1` or HTTP by the first bytes, until the
    /// connection ends.
    async fn serve(mut self, stream: tokio::net::TcpStream, ticket: Arc<admission::Ticket>) {
        let Some(acceptor) = self.tls.clone() else {
            let mut stream = stream;
            let start = tokio::select! {
                start = preface::read_start(&mut stream, self.header_read_timeout) => start,
                _ = self.stopping.changed() => None,
            };
            let Some(start) = start else { return };
            let stream = preface::Prefixed::new(start, stream);
            if preface::is_wire(stream.prefix()) {
                return wire::serve_tcp(stream, self.wire, ticket, self.stopping).await;
            }
            return self.serve_http(stream, ticket).await;
        };
        let handshake = tokio::time::timeout(self.handshake_timeout, acceptor.accept(stream));
        let stream = tokio::select! {
            done = handshake => match done {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "TLS handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::debug!("TLS handshake timed out");
                    return;
                }
            },
            _ = self.stopping.changed() => return,
        };
        let mut stream = stream;
        let start = tokio::select! {
            start = preface::read_start(&mut stream, self.header_read_timeout) => start,
            _ = self.stopping.changed() => None,
        };
        let Some(start) = start else { return };
        let stream = preface::Prefixed::new(start, stream);
        if preface::is_wire(stream.prefix()) {
            return wire::serve_connection(stream, self.wire, ticket, self.stopping).await;
        }
        self.serve_http(stream, ticket).await
    }

    /// Serves HTTP/1.1 or HTTP/2 on one (plain or TLS) connection until it ends; on
    /// stop, or once idle for `idle_timeout`, it is shut down gracefully (hyper
    /// finishes the requests in flight, HTTP/2 sends GOAWAY).
    async fn serve_http<I>(mut self, io: I, ticket: Arc<admission::Ticket>)
    where
        I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        use http_body_util::BodyExt;
        use tower::ServiceExt;

        let state = HttpConnection {
            ticket,
            activity: Arc::default(),
        };
        let activity = state.activity.clone();
        let router = self.router.clone();
        let service = tower::service_fn(move |mut request: axum::extract::Request<_>| {
            let in_flight = InFlight::start(&state.activity);
            request.extensions_mut().insert(state.clone());
            let router = router.clone();
            async move {
                let response = router.oneshot(request).await?;
                // In flight until the body ends (or is dropped with the connection).
                Ok::<_, std::convert::Infallible>(response.map(|body| {
                    axum::body::Body::new(body.map_frame(move |frame| {
                        let _ = &in_flight;
                        frame
                    }))
                }))
            }
        });
        let service = hyper_util::service::TowerToHyperService::new(service);
        let connection = self
            .builder
            .serve_connection_with_upgrades(hyper_util::rt::TokioIo::new(io), service);
        tokio::pin!(connection);
        let mut idle = IdleCheck::default();
        let mut checks = tokio::time::interval_at(
            tokio::time::Instant::now() + self.idle_timeout,
            self.idle_timeout,
        );
        let mut closing = false;
        // Set when an idle connection is shut down: HTTP/2's graceful shutdown waits
        // for the client to answer a PING after the first GOAWAY, and a client that
        // never answers would keep it open until keepalive gives up.
        let grace = tokio::time::sleep(Duration::MAX);
        tokio::pin!(grace);
        let mut grace_armed = false;
        loop {
            tokio::select! {
                // An I/O or protocol error concerns only its client.
                _ = connection.as_mut() => return,
                () = &mut grace, if grace_armed => {
                    tracing::debug!("dropped an idle connection that did not close after GOAWAY");
                    return;
                }
                _ = self.stopping.changed(), if !closing => {
                    connection.as_mut().graceful_shutdown();
                    closing = true;
                }
                _ = checks.tick(), if !closing => {
                    use std::sync::atomic::Ordering::Relaxed;
                    let started = activity.started.load(Relaxed);
                    let in_flight = activity.in_flight.load(Relaxed) > 0;
                    if idle.idle(started, in_flight) {
                        tracing::debug!(idle_timeout = ?self.idle_timeout, "closing an idle connection");
                        self.handle
                            .metrics()
                            .connections
                            .closed_idle
                            .fetch_add(1, Relaxed);
                        connection.as_mut().graceful_shutdown();
                        closing = true;
                        grace
                            .as_mut()
                            .reset(tokio::time::Instant::now() + IDLE_CLOSE_GRACE);
                        grace_armed = true;
                    }
                }
            }
        }
    }
}

/// Answers a connection that is refused at once (over `max_connections_per_ip`): a
/// 503 `unavailable` for plain HTTP/1.1, a bare close for TLS (there is no session
/// to answer in without a handshake).
async fn refuse_connection(mut stream: tokio::net::TcpStream, tls: bool, message: String) {
    use tokio::io::AsyncWriteExt;
    if !tls {
        let body = serde_json::json!({"error": {
            "code": ApiErrorKind::Unavailable.code(),
            "message": message,
        }})
        .to_string();
        let response = format!(
            "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        let write = async {
            stream.write_all(response.as_bytes()).await?;
            stream.shutdown().await
        };
        let _ = tokio::time::timeout(Duration::from_secs(1), write).await;
    }
}

#[cfg(test)]
mod tests {
    use super::IdleCheck;

    #[test]
    fn idle_means_a_whole_check_period_without_requests() {
        let mut check = IdleCheck::default();
        // A fresh connection that sends nothing is idle at the first check.
        assert!(check.idle(0, false));
        let mut check = IdleCheck::default();
        assert!(
            !check.idle(1, false),
            "a request started since the last check"
        );
        assert!(check.idle(1, false));
        let mut check = IdleCheck::default();
        assert!(!check.idle(1, true), "a request in flight (a watch)");
        assert!(!check.idle(1, true));
        assert!(!check.idle(1, false), "it may have ended just now");
        assert!(check.idle(1, false));
    }
}
