//! The conformance suite against one Redis server that speaks only TLS (`rediss://`,
//! trusting the test CA), plus: a client that does not trust that CA is refused.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use fencelock::redis::redis::TlsCertificates;
use fencelock::redis::{RedisBackend, RedisConfig};
use fencelock::{BoxFuture, Error, ErrorKind, LockBackend};
use fencelock_conformance::{step, Fixture};

struct TlsRedis {
    server: fencelock_testkit::Redis,
    ca_pem: Vec<u8>,
    _dir: tempfile::TempDir,
}

impl Fixture for TlsRedis {
    fn addrs(&self) -> Vec<SocketAddr> {
        vec![SocketAddr::from(([127, 0, 0, 1], self.server.port()))]
    }

    fn connect<'a>(
        &'a self,
        addrs: &'a [SocketAddr],
    ) -> BoxFuture<'a, Result<Arc<dyn LockBackend>, Error>> {
        Box::pin(async move {
            let backend = RedisBackend::connect(self.config(addrs[0])).await?;
            Ok(Arc::new(backend) as Arc<dyn LockBackend>)
        })
    }
}

impl TlsRedis {
    fn config(&self, addr: SocketAddr) -> RedisConfig {
        // The server certificate names 127.0.0.1, so the proxies' addresses verify too.
        let mut config = RedisConfig::new(format!("rediss://{addr}/"));
        config.tls = Some(TlsCertificates {
            client_tls: None,
            root_cert: Some(self.ca_pem.clone()),
        });
        config.options.request_timeout = Duration::from_secs(1);
        config
    }
}

async fn start() -> TlsRedis {
    tokio::task::spawn_blocking(|| {
        let dir = tempfile::tempdir().expect("temp dir");
        let ca = fencelock_testkit::TestCa::create(dir.path()).expect("a test CA");
        let ca_pem = std::fs::read(&ca.ca_cert).expect("the CA certificate");
        let server = fencelock_testkit::Redis::start_tls(&ca).expect("redis-server with TLS");
        TlsRedis {
            server,
            ca_pem,
            _dir: dir,
        }
    })
    .await
    .expect("start task")
}

fencelock_conformance::conformance_suite!(start());

/// Without the test CA (the system's roots only) the handshake fails: the backend
/// really verifies the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_the_client_does_not_trust_is_refused() {
    let redis = start().await;
    let mut config = redis.config(redis.addrs()[0]);
    config.tls = None;
    config.options.connect_timeout = Duration::from_secs(2);
    let e = step(RedisBackend::connect(config))
        .await
        .expect_err("an untrusted certificate");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    let trusted = redis.config(redis.addrs()[0]);
    step(RedisBackend::connect(trusted))
        .await
        .expect("the same server with its CA");
}
