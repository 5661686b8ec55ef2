//! The fencelock lock server: a durable command log under the sans-IO core, with an
//! HTTP/JSON API and a gRPC API on one port.
//!
//! Start with [`Server::start`]; it recovers the data directory, starts the engine
//! (see [`engine`] for how durability and replies are ordered) and serves both
//! protocols until [`Server::shutdown`].
#![deny(missing_docs)]

pub mod codec;
pub mod engine;
pub mod error;
pub mod grpc;
pub mod http;
mod input;
pub mod metrics;

use std::net::SocketAddr;
use std::time::Duration;

pub use engine::{AcquireArgs, Durability, EngineConfig, Handle, RecoveryReport, RunState};
pub use error::{ApiError, ApiErrorKind};

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
}

impl ServerConfig {
    /// A configuration with the default timeouts.
    pub fn new(listen: SocketAddr, engine: EngineConfig) -> ServerConfig {
        ServerConfig {
            listen,
            engine,
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
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

/// The HTTP routes and the gRPC service on one router.
pub fn app(handle: Handle) -> axum::Router {
    grpc::add_routes(http::router(handle.clone()), handle)
}

impl Server {
    /// Recovers the data directory, binds, and starts serving. Must run inside a
    /// tokio runtime.
    pub async fn start(config: ServerConfig) -> Result<Server, ApiError> {
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
        let router = app(handle.clone());
        let serving = tokio::spawn(serve(listener, router, config.header_read_timeout, stopped));
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

/// The accept loop: HTTP/1.1 and HTTP/2 (prior knowledge, for gRPC) on one listener,
/// with a header read timeout and HTTP/2 keepalive pings so that stalled, idle or dead
/// connections are closed, and a graceful stop (in-flight requests finish).
async fn serve(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    header_read_timeout: Duration,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    use hyper_util::server::conn::auto::Builder;
    use hyper_util::service::TowerToHyperService;

    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(HTTP2_KEEPALIVE)
        .keep_alive_timeout(HTTP2_KEEPALIVE);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
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
        let service = TowerToHyperService::new(router.clone());
        let connection = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), service)
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            // A connection that ends in an I/O or protocol error concerns only its
            // client.
            let _ = connection.await;
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}
