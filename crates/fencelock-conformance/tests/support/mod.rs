//! The fencelock server as a conformance fixture: an in-process server on a random
//! loopback port with its own data directory, reached over the wire protocol (the
//! client's default) or over gRPC.

use std::net::SocketAddr;
use std::sync::Arc;

use fencelock::{BoxFuture, Error, FencelockBackend, LockBackend, ServerConfig, Transport};
use fencelock_conformance::Fixture;

/// A fencelock server on a random loopback port with its own data directory.
pub struct Fencelock {
    server: fencelock_server::Server,
    transport: Transport,
    _dir: tempfile::TempDir,
}

impl Fixture for Fencelock {
    fn addrs(&self) -> Vec<SocketAddr> {
        vec![self.server.local_addr()]
    }

    fn connect<'a>(
        &'a self,
        addrs: &'a [SocketAddr],
    ) -> BoxFuture<'a, Result<Arc<dyn LockBackend>, Error>> {
        Box::pin(async move {
            let mut config = ServerConfig::new(format!("http://{}", addrs[0]));
            config.transport = self.transport;
            let backend = FencelockBackend::connect(config).await?;
            Ok(Arc::new(backend) as Arc<dyn LockBackend>)
        })
    }
}

/// Starts a [`Fencelock`] fixture whose clients use the default transport.
#[allow(dead_code)] // Not every test file that shares this module uses it.
pub async fn start() -> Fencelock {
    start_with(Transport::default()).await
}

/// Starts a [`Fencelock`] fixture whose clients use `transport`.
pub async fn start_with(transport: Transport) -> Fencelock {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = fencelock_server::ServerConfig::new(
        "127.0.0.1:0".parse().expect("address"),
        fencelock_server::EngineConfig::new(dir.path()),
    );
    let server = fencelock_server::Server::start(config)
        .await
        .expect("server starts");
    Fencelock {
        server,
        transport,
        _dir: dir,
    }
}
