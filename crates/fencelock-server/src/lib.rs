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
pub mod metrics;

use std::net::SocketAddr;

pub use engine::{AcquireArgs, Durability, EngineConfig, Handle, RecoveryReport, RunState};
pub use error::{ApiError, ApiErrorKind};

/// Everything a server needs to start.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address for HTTP/JSON and gRPC (one port).
    pub listen: SocketAddr,
    /// Storage and bounds.
    pub engine: EngineConfig,
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
        let serving = tokio::spawn(async move {
            axum::serve(listener, router)
                .with_graceful_shutdown(async move {
                    let _ = stopped.await;
                })
                .await
        });
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
