//! The fencelock lock server: a durable command log under the sans-IO core, with an
//! HTTP/JSON API and a gRPC API on one port.
//!
//! Start with [`Server::start`]; it recovers the data directory, starts the engine
//! (see [`engine`] for how durability and replies are ordered) and serves both
//! protocols until [`Server::shutdown`].
#![deny(missing_docs)]

pub mod audit;
pub mod auth;
pub mod codec;
pub mod dashboard;
pub mod engine;
pub mod error;
pub mod grpc;
pub mod http;
mod input;
pub mod limits;
pub mod metrics;
mod preface;
pub mod tls;
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
pub use tls::TlsConfig;

/// Default time a client has to send a request's headers (also the longest an idle
/// HTTP/1.1 keep-alive connection is kept waiting for its next request).
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How often an HTTP/2 (gRPC) connection is pinged, and how long an answer may take
/// before the connection is closed as dead.
pub const HTTP2_KEEPALIVE: Duration = Duration::from_secs(20);

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
    .layer(axum::middleware::from_fn_with_state(
        authenticator,
        auth::layer,
    ))
    .layer(axum::middleware::map_response_with_state(
        handle,
        count_refusals,
    ))
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
    pub async fn start(config: ServerConfig) -> Result<Server, ApiError> {
        let refuse = |message: String| ApiError::new(ApiErrorKind::InvalidArgument, message);
        auth::check_exposure(config.listen, &config.auth, config.insecure).map_err(refuse)?;
        config.limits.check().map_err(refuse)?;
        let authenticator =
            auth::Authenticator::with_limits(&config.auth, &config.limits).map_err(refuse)?;
        let tls = config
            .tls
            .as_ref()
            .map(TlsConfig::acceptor)
            .transpose()
            .map_err(refuse)?;
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(|e| {
                ApiError::new(
                    ApiErrorKind::Unavailable,
                    format!("cannot listen on {}: {e}", config.listen),
                )
            })?;
        let addr = listener
            .local_addr()
            .map_err(|e| ApiError::new(ApiErrorKind::Internal, format!("no local address: {e}")))?;
        let handle = engine::start(config.engine)?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let router = secure_app(handle.clone(), authenticator.clone(), &config.limits);
        let wire = Arc::new(wire::WireOptions {
            handle: handle.clone(),
            auth: authenticator,
            max_frame: config.limits.max_body_bytes,
            max_in_flight: config.limits.max_streams_per_connection as usize,
            header_read_timeout: config.header_read_timeout,
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
    /// For the refused-connection counter.
    handle: Handle,
}

/// The accept loop: HTTP/1.1 and HTTP/2 (prior knowledge, for gRPC) on one listener,
/// optionally inside TLS, with a header read timeout and HTTP/2 keepalive pings so
/// that stalled, idle or dead connections are closed, a cap on connections and on
/// streams per connection, and a graceful stop (in-flight requests finish).
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
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let max_connections = options.limits.max_connections;
    let connections = Arc::new(tokio::sync::Semaphore::new(max_connections));
    // Tells connections still in their TLS handshake to give up.
    let (stopping, stopping_rx) = tokio::sync::watch::channel(());
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors and the like: back off, keep serving.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut stop => break,
        };
        let _ = stream.set_nodelay(true);
        let Ok(permit) = connections.clone().try_acquire_owned() else {
            options
                .handle
                .metrics()
                .refused_connections
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::debug!(
                max_connections,
                "refused a connection: too many connections"
            );
            tokio::spawn(refuse_connection(
                stream,
                options.tls.is_some(),
                max_connections,
            ));
            continue;
        };
        let watcher = graceful.watcher();
        let builder = builder.clone();
        let router = router.clone();
        let tls = options.tls.clone();
        let handshake_timeout = options.limits.tls_handshake_timeout;
        let header_read_timeout = options.header_read_timeout;
        let wire = options.wire.clone();
        let mut stopping = stopping_rx.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let Some(acceptor) = tls else {
                let mut stream = stream;
                let start = tokio::select! {
                    start = preface::read_start(&mut stream, header_read_timeout) => start,
                    _ = stopping.changed() => None,
                };
                let Some(start) = start else { return };
                let stream = preface::Prefixed::new(start, stream);
                if preface::is_wire(stream.prefix()) {
                    return wire::serve_tcp(stream, wire, stopping).await;
                }
                return serve_connection(&builder, stream, router, watcher).await;
            };
            let handshake = tokio::time::timeout(handshake_timeout, acceptor.accept(stream));
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
                _ = stopping.changed() => return,
            };
            let mut stream = stream;
            let start = tokio::select! {
                start = preface::read_start(&mut stream, header_read_timeout) => start,
                _ = stopping.changed() => None,
            };
            let Some(start) = start else { return };
            let stream = preface::Prefixed::new(start, stream);
            if preface::is_wire(stream.prefix()) {
                return wire::serve_connection(stream, wire, stopping).await;
            }
            serve_connection(&builder, stream, router, watcher).await
        });
    }
    let _ = stopping.send(());
    drop(listener);
    graceful.shutdown().await;
    // Wire connections answer what they have in flight, then close; give them as
    // long as HTTP connections had.
    let closed = connections.acquire_many(u32::try_from(max_connections).unwrap_or(u32::MAX));
    let _ = tokio::time::timeout(Duration::from_secs(10), closed).await;
    Ok(())
}

/// Serves HTTP/1.1 or HTTP/2 on one (plain or TLS) connection until it ends.
async fn serve_connection<I>(
    builder: &hyper_util::server::conn::auto::Builder<hyper_util::rt::TokioExecutor>,
    io: I,
    router: axum::Router,
    watcher: hyper_util::server::graceful::Watcher,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper_util::service::TowerToHyperService::new(router);
    let connection = builder
        .serve_connection_with_upgrades(hyper_util::rt::TokioIo::new(io), service)
        .into_owned();
    // A connection that ends in an I/O or protocol error concerns only its client.
    let _ = watcher.watch(connection).await;
}

/// Answers a connection over the cap: a 503 `unavailable` for plain HTTP/1.1, a
/// bare close for TLS (there is no session to answer in without a handshake).
async fn refuse_connection(mut stream: tokio::net::TcpStream, tls: bool, max: usize) {
    use tokio::io::AsyncWriteExt;
    if !tls {
        let body = serde_json::json!({"error": {
            "code": ApiErrorKind::Unavailable.code(),
            "message": format!("the server is serving its maximum of {max} connections; retry later"),
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
