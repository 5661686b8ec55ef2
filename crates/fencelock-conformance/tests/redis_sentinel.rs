//! The conformance suite against a master found through Redis Sentinel, plus: the
//! backend talks to the master the sentinel names, calls its fences best-effort, and
//! follows a failover to the promoted replica.
//!
//! Partitions: the fixture's address is the master's; a client given a proxy in its
//! place still asks the (real) sentinel, which names the real master, and reaches that
//! address through a DNS resolver mapping it to the proxy — so cutting the proxy cuts
//! the client's commands, as a partition between it and the master would.

use crate::raw_redis;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use fencelock::redis::redis::io::AsyncDNSResolver;
use fencelock::redis::redis::{RedisFuture, TlsCertificates};
use fencelock::redis::{RedisBackend, SentinelConfig};
use fencelock::{AcquireSpec, BoxFuture, Error, ErrorKind, FenceGuarantee, LockBackend};
use fencelock_conformance::{step, Fixture};
use fencelock_testkit::RedisSentinel;

struct Sentinel {
    deployment: RedisSentinel,
}

/// Resolves 127.0.0.1:`from` to `to`, every other address as given.
struct Remap {
    from: u16,
    to: SocketAddr,
}

impl AsyncDNSResolver for Remap {
    fn resolve<'a, 'b: 'a>(
        &'a self,
        host: &'b str,
        port: u16,
    ) -> RedisFuture<'a, Box<dyn Iterator<Item = SocketAddr> + Send + 'a>> {
        let addr = if port == self.from {
            self.to
        } else {
            let ip = host.parse().unwrap_or([127, 0, 0, 1].into());
            SocketAddr::new(ip, port)
        };
        Box::pin(async move { Ok(Box::new(std::iter::once(addr)) as Box<_>) })
    }
}

impl Fixture for Sentinel {
    fn addrs(&self) -> Vec<SocketAddr> {
        vec![SocketAddr::from((
            [127, 0, 0, 1],
            self.deployment.master().port(),
        ))]
    }

    fn connect<'a>(
        &'a self,
        addrs: &'a [SocketAddr],
    ) -> BoxFuture<'a, Result<Arc<dyn LockBackend>, Error>> {
        Box::pin(async move {
            let backend = RedisBackend::sentinel(self.config(addrs[0])).await?;
            Ok(Arc::new(backend) as Arc<dyn LockBackend>)
        })
    }
}

impl Sentinel {
    fn config(&self, master: SocketAddr) -> SentinelConfig {
        let mut config = SentinelConfig::new(
            RedisSentinel::MASTER_NAME,
            vec![format!("127.0.0.1:{}", self.deployment.port())],
        );
        config.options.request_timeout = Duration::from_secs(1);
        config.connection = config.connection.set_dns_resolver(Remap {
            from: self.deployment.master().port(),
            to: master,
        });
        config
    }
}

async fn start() -> Sentinel {
    let deployment = tokio::task::spawn_blocking(RedisSentinel::start)
        .await
        .expect("start task")
        .expect("redis-server and redis-sentinel start");
    Sentinel { deployment }
}

fencelock_conformance::conformance_suite!(start());

/// The grant lands on the master the sentinel names; fences are best-effort (a
/// failover may lose the last grants), whatever the master's persistence settings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_live_on_the_named_master_and_fences_are_best_effort() {
    let sentinel = start().await;
    let port = sentinel.deployment.master().port();
    for (parameter, value) in [("appendonly", "yes"), ("appendfsync", "always")] {
        let reply = raw_redis::command(port, &["CONFIG", "SET", parameter, value]);
        assert_eq!(reply.text(), Some("OK"), "{reply:?}");
    }
    let backend = step(RedisBackend::sentinel(sentinel.config(sentinel.addrs()[0])))
        .await
        .expect("connect through the sentinel");
    let caps = backend.capabilities();
    assert_eq!(caps.fences, FenceGuarantee::BestEffort);
    assert_eq!(caps.backend, "redis-sentinel");
    let lease = step(backend.acquire(&AcquireSpec::new("named", Duration::from_secs(60))))
        .await
        .expect("acquire");
    assert!(raw_redis::exists(port, "fencelock:lock:named"));
    assert!(step(backend.release(&lease)).await.expect("release"));
    assert!(!raw_redis::exists(port, "fencelock:lock:named"));

    let mut unknown = sentinel.config(sentinel.addrs()[0]);
    unknown.master_name = "nobody".to_owned();
    let e = step(RedisBackend::sentinel(unknown))
        .await
        .expect_err("a master the sentinel does not know");
    assert!(e.is_transient(), "{e}");
}

/// After a failover the old master is a replica (writes fail with `READONLY`) or gone:
/// calls fail as `Unavailable` until the backend asks the sentinel again, and then
/// grants land on the promoted replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backend_follows_a_failover() {
    let deployment = tokio::task::spawn_blocking(RedisSentinel::start_with_replica)
        .await
        .expect("start task")
        .expect("a master, a replica and a sentinel");
    let mut config = SentinelConfig::new(
        RedisSentinel::MASTER_NAME,
        vec![format!("127.0.0.1:{}", deployment.port())],
    );
    config.options.request_timeout = Duration::from_secs(1);
    let backend = step(RedisBackend::sentinel(config))
        .await
        .expect("connect through the sentinel");
    let before = step(backend.acquire(&AcquireSpec::new("before", Duration::from_secs(60))))
        .await
        .expect("acquire on the first master");
    // The grant reached the replica before the failover (replication is asynchronous).
    let acked = raw_redis::command(deployment.master().port(), &["WAIT", "1", "10000"]);
    assert_eq!(acked, raw_redis::Value::Int(1));
    let deployment = tokio::task::spawn_blocking(move || {
        deployment.failover().expect("failover");
        deployment
    })
    .await
    .expect("failover task");
    let promoted = deployment.replica().expect("a replica").port();
    // Bounded: each attempt takes at most the request timeout (plus asking the
    // sentinel), and the loop gives up after 30 s.
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    let after = loop {
        match step(backend.acquire(&AcquireSpec::new("after", Duration::from_secs(60)))).await {
            Ok(lease) => break lease,
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
                assert!(
                    tokio::time::Instant::now() < until,
                    "still failing after the failover: {e}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let role = raw_redis::command(promoted, &["ROLE"]);
    assert!(
        matches!(&role, raw_redis::Value::Array(items) if items.first().and_then(raw_redis::Value::text) == Some("master")),
        "{role:?}"
    );
    assert!(raw_redis::exists(promoted, "fencelock:lock:after"));
    assert!(after.fence > 0);
    // The grant made before the failover was replicated, so it is still held there.
    let e = step(backend.acquire(&AcquireSpec::new("before", Duration::from_secs(60))))
        .await
        .expect_err("the earlier grant survived the failover");
    assert_eq!(e.kind(), ErrorKind::Held, "{e}");
    assert!(step(backend.release(&before)).await.expect("release"));
}

/// Sentinel and master over TLS only (both ports TLS, trusting the test CA): locks,
/// and a waiter woken by the release through the TLS pub/sub connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_and_master_over_tls() {
    let (deployment, ca_pem, _dir) = tokio::task::spawn_blocking(|| {
        let dir = tempfile::tempdir().expect("temp dir");
        let ca = fencelock_testkit::TestCa::create(dir.path()).expect("a test CA");
        let ca_pem = std::fs::read(&ca.ca_cert).expect("the CA certificate");
        let deployment = RedisSentinel::start_tls(&ca).expect("TLS master and sentinel");
        (deployment, ca_pem, dir)
    })
    .await
    .expect("start task");
    let mut config = SentinelConfig::new(
        RedisSentinel::MASTER_NAME,
        vec![format!("127.0.0.1:{}", deployment.port())],
    );
    config.tls = Some(TlsCertificates {
        client_tls: None,
        root_cert: Some(ca_pem),
    });
    let backend = Arc::new(
        step(RedisBackend::sentinel(config))
            .await
            .expect("connect through the sentinel over TLS"),
    );
    let held = step(backend.acquire(&AcquireSpec::new("tls", Duration::from_secs(60))))
        .await
        .expect("acquire");
    let waiter = {
        let backend = backend.clone();
        tokio::spawn(async move {
            let mut spec = AcquireSpec::new("tls", Duration::from_secs(60));
            spec.wait = Duration::from_secs(25);
            backend.acquire(&spec).await
        })
    };
    // The waiter holds a subscription on the master before the release.
    let subscribed_by = tokio::time::Instant::now() + Duration::from_secs(10);
    while !deployment
        .master()
        .cli(&["PUBSUB", "NUMSUB", "fencelock:wake:tls"])
        .is_ok_and(|out| out.lines().nth(1).map(str::trim) == Some("1"))
    {
        assert!(
            tokio::time::Instant::now() < subscribed_by,
            "the waiter never subscribed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(step(backend.release(&held)).await.expect("release"));
    let lease = step(waiter)
        .await
        .expect("waiter")
        .expect("woken by the release");
    assert!(lease.fence > held.fence);
    assert!(step(backend.release(&lease)).await.expect("release"));
}
