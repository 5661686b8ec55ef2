//! Test helpers: a real fencelock server per test, the testkit's TCP proxy that can
//! cut the client off (a partition), and a backend wrapper that counts the calls that reach
//! the real server.
#![allow(dead_code)] // Each test binary uses a different part of this module.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fencelock::{
    AcquireSpec, BoxFuture, Capabilities, Error, FencelockBackend, Lease, LockBackend,
    ServerConfig, SessionLease,
};
use fencelock_proto::{self as proto, locks_client::LocksClient};

/// Longest any awaited step may take before a test fails instead of hanging.
pub const STEP: Duration = Duration::from_secs(20);

/// A fencelock server on `127.0.0.1:0` with its own data directory.
pub struct TestServer {
    pub server: fencelock_server::Server,
    pub dir: tempfile::TempDir,
}

impl TestServer {
    pub async fn start() -> TestServer {
        let dir = tempfile::tempdir().unwrap();
        let config = fencelock_server::ServerConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            fencelock_server::EngineConfig::new(dir.path()),
        );
        let server = fencelock_server::Server::start(config)
            .await
            .expect("server starts");
        TestServer { server, dir }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.server.local_addr())
    }

    pub fn addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    /// A raw gRPC client straight to the server (for watching and inspecting).
    pub async fn raw(&self) -> LocksClient<tonic::transport::Channel> {
        LocksClient::connect(self.url()).await.unwrap()
    }

    pub async fn backend(&self) -> FencelockBackend {
        TestServer::backend_at(self.addr()).await
    }

    /// A backend of the server at `addr` (one restarted by the test itself).
    pub async fn backend_at(addr: SocketAddr) -> FencelockBackend {
        FencelockBackend::connect(ServerConfig::new(format!("http://{addr}")))
            .await
            .unwrap()
    }
}

/// Waits until the server says it has held `name` under `fence` for `at_least`: the
/// renewals a test means by "still held after N lease lengths", observed as they
/// happen rather than assumed from a fixed hold. Fails if the lock changed hands or
/// went free meanwhile, or after [`STEP`].
pub async fn held_for(backend: &FencelockBackend, name: &str, fence: u64, at_least: Duration) {
    let at_least_ms = at_least.as_millis() as u64;
    tokio::time::timeout(STEP, async {
        loop {
            let info = backend
                .get_lock(name)
                .await
                .expect("the lock is still held");
            let holder = info.holders.first().expect("the lock is still held");
            assert_eq!(holder.fence, fence, "{name} changed hands: {info:?}");
            if holder.held_ms >= at_least_ms {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{name} was not held {at_least:?} within {STEP:?}"));
}

/// Watches every lock event of the server, from now on.
pub async fn watch_all(server: &TestServer) -> tonic::Streaming<proto::LockEvent> {
    server
        .raw()
        .await
        .watch(proto::WatchRequest {
            prefix: String::new(),
            after: None,
        })
        .await
        .unwrap()
        .into_inner()
}

/// The next event of `kind` on the stream (skipping others), bounded by [`STEP`].
pub async fn next_event(
    events: &mut tonic::Streaming<proto::LockEvent>,
    kind: proto::EventKind,
) -> proto::LockEvent {
    tokio::time::timeout(STEP, async {
        loop {
            let event = events.message().await.unwrap().expect("stream open");
            if event.kind == kind as i32 {
                return event;
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no {kind:?} event within {STEP:?}"))
}

// Not every test binary uses it.
#[allow(unused_imports)]
pub use fencelock_testkit::Proxy;

/// A real backend that counts the calls made through it.
pub struct Counting {
    pub inner: FencelockBackend,
    pub renews: Arc<AtomicU64>,
    pub releases: Arc<AtomicU64>,
    pub keep_alives: Arc<AtomicU64>,
}

impl Counting {
    pub fn new(inner: FencelockBackend) -> Counting {
        Counting {
            inner,
            renews: Arc::default(),
            releases: Arc::default(),
            keep_alives: Arc::default(),
        }
    }
}

impl LockBackend for Counting {
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn acquire<'a>(&'a self, spec: &'a AcquireSpec) -> BoxFuture<'a, Result<Lease, Error>> {
        self.inner.acquire(spec)
    }
    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Duration, Error>> {
        self.renews.fetch_add(1, Ordering::SeqCst);
        self.inner.renew(lease, ttl)
    }
    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<bool, Error>> {
        self.releases.fetch_add(1, Ordering::SeqCst);
        self.inner.release(lease)
    }
    fn open_session<'a>(
        &'a self,
        ttl: Duration,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<SessionLease, Error>> {
        self.inner.open_session(ttl, owner)
    }
    fn keep_alive<'a>(
        &'a self,
        session: &'a SessionLease,
    ) -> BoxFuture<'a, Result<Duration, Error>> {
        self.keep_alives.fetch_add(1, Ordering::SeqCst);
        self.inner.keep_alive(session)
    }
    fn close_session<'a>(
        &'a self,
        session: &'a SessionLease,
    ) -> BoxFuture<'a, Result<usize, Error>> {
        self.inner.close_session(session)
    }
}
