//! The conformance suite against Redlock over three independent Redis instances
//! ([`RedlockBackend`]), plus what Redlock itself promises: one instance down still
//! grants, two down is `Unavailable` and leaves nothing held on the live one, a key
//! held on two instances blocks the lock, and fences keep increasing when the majority
//! changes (the write-back).

use crate::raw_redis;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use fencelock::redis::{RedisConfig, RedlockBackend, RedlockConfig};
use fencelock::{AcquireSpec, BoxFuture, Error, ErrorKind, LockBackend};
use fencelock_conformance::{step, Fixture};

struct Redlock {
    servers: Vec<Option<fencelock_testkit::Redis>>,
}

impl Fixture for Redlock {
    fn addrs(&self) -> Vec<SocketAddr> {
        self.servers
            .iter()
            .flatten()
            .map(|s| SocketAddr::from(([127, 0, 0, 1], s.port())))
            .collect()
    }

    fn connect<'a>(
        &'a self,
        addrs: &'a [SocketAddr],
    ) -> BoxFuture<'a, Result<Arc<dyn LockBackend>, Error>> {
        Box::pin(async move {
            let backend = RedlockBackend::connect(config(addrs)).await?;
            Ok(Arc::new(backend) as Arc<dyn LockBackend>)
        })
    }
}

fn config(addrs: &[SocketAddr]) -> RedlockConfig {
    let instances = addrs
        .iter()
        .map(|addr| {
            let mut instance = RedisConfig::new(addr.to_string());
            instance.options.connect_timeout = Duration::from_secs(1);
            instance.options.request_timeout = Duration::from_secs(1);
            instance
        })
        .collect();
    let mut config = RedlockConfig::new(instances);
    // Loopback, but a loaded 2-core test machine: generous, and still well below the
    // shortest ttl the cases use.
    config.instance_timeout = Duration::from_millis(500);
    config
}

async fn start() -> Redlock {
    let mut servers = Vec::new();
    for _ in 0..3 {
        let server = tokio::task::spawn_blocking(fencelock_testkit::Redis::start)
            .await
            .expect("start task")
            .expect("redis-server starts");
        servers.push(Some(server));
    }
    Redlock { servers }
}

fencelock_conformance::conformance_suite!(start());

impl Redlock {
    fn port(&self, index: usize) -> u16 {
        self.servers[index].as_ref().expect("running").port()
    }

    /// Stops instance `index` (its port then refuses connections).
    fn stop(&mut self, index: usize) {
        self.servers[index] = None;
    }

    async fn backend(&self, addrs: &[SocketAddr]) -> RedlockBackend {
        step(RedlockBackend::connect(config(addrs)))
            .await
            .expect("connect")
    }
}

fn lock_key(name: &str) -> String {
    format!("fencelock:lock:{name}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_of_three_instances_down_still_grants() {
    let mut redlock = start().await;
    let addrs = redlock.addrs();
    let backend = redlock.backend(&addrs).await;
    redlock.stop(2);
    let lease = step(backend.acquire(&AcquireSpec::new("one-down", Duration::from_secs(30))))
        .await
        .expect("granted by two of three");
    assert!(lease.ttl > Duration::ZERO && lease.ttl < Duration::from_secs(30));
    for index in [0, 1] {
        assert!(raw_redis::exists(
            redlock.port(index),
            &lock_key("one-down")
        ));
    }
    let renewed = step(backend.renew(&lease, Duration::from_secs(30)))
        .await
        .expect("renewed by two of three");
    assert!(renewed > Duration::ZERO);
    assert!(step(backend.release(&lease)).await.expect("release"));
    for index in [0, 1] {
        assert!(!raw_redis::exists(
            redlock.port(index),
            &lock_key("one-down")
        ));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_of_three_instances_down_is_unavailable_and_leaves_nothing_held() {
    let mut redlock = start().await;
    let addrs = redlock.addrs();
    let backend = redlock.backend(&addrs).await;
    redlock.stop(1);
    redlock.stop(2);
    for wait in [Duration::ZERO, Duration::from_secs(2)] {
        let mut spec = AcquireSpec::new("two-down", Duration::from_secs(30));
        spec.wait = wait;
        let e = step(backend.acquire(&spec))
            .await
            .expect_err("no majority with two of three down");
        assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
        assert!(
            !raw_redis::exists(redlock.port(0), &lock_key("two-down")),
            "the failed attempt left its grant on the live instance"
        );
    }
    // The live instance's counter moved, but no grant is left: it is free there.
    assert_eq!(
        raw_redis::command(redlock.port(0), &["DBSIZE"]),
        raw_redis::Value::Int(1),
        "only the fence counter may remain"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_held_on_two_instances_blocks_the_lock() {
    let redlock = start().await;
    let backend = redlock.backend(&redlock.addrs()).await;
    let name = "preset";
    for index in [0, 2] {
        let reply = raw_redis::command(
            redlock.port(index),
            &[
                "HSET",
                &lock_key(name),
                "token",
                "someone-else",
                "fence",
                "7",
            ],
        );
        assert_eq!(reply, raw_redis::Value::Int(2));
        raw_redis::command(redlock.port(index), &["PEXPIRE", &lock_key(name), "60000"]);
    }
    let e = step(backend.acquire(&AcquireSpec::new(name, Duration::from_secs(30))))
        .await
        .expect_err("a majority is held by another");
    assert_eq!(e.kind(), ErrorKind::Held, "{e}");
    let mut spec = AcquireSpec::new(name, Duration::from_secs(30));
    spec.wait = Duration::from_millis(1500);
    let e = step(backend.acquire(&spec)).await.expect_err("still held");
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    // The free instance was taken by the attempts and given back each time.
    assert!(!raw_redis::exists(redlock.port(1), &lock_key(name)));
    // The other holder's grants are untouched.
    for index in [0, 2] {
        let token = raw_redis::command(redlock.port(index), &["HGET", &lock_key(name), "token"]);
        assert_eq!(token.text(), Some("someone-else"));
    }
}

/// Counters differ per instance; the write-back makes a later grant through another
/// majority still get a larger fence. Without it, the grant through instances 1 and 2
/// below would get fence 2 after fence 101.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fences_increase_when_the_majority_changes() {
    let mut redlock = start().await;
    let addrs = redlock.addrs();
    let backend = redlock.backend(&addrs).await;
    let name = "moving-majority";
    raw_redis::command(
        redlock.port(0),
        &["SET", &format!("fencelock:fence:{name}"), "100"],
    );
    let first = step(backend.acquire(&AcquireSpec::new(name, Duration::from_secs(30))))
        .await
        .expect("acquire");
    assert_eq!(first.fence, 101, "the largest fence of the majority");
    for index in [1, 2] {
        let counter = raw_redis::command(
            redlock.port(index),
            &["GET", &format!("fencelock:fence:{name}")],
        );
        assert_eq!(
            counter.text(),
            Some("101"),
            "instance {index} was not written back"
        );
    }
    assert!(step(backend.release(&first)).await.expect("release"));
    redlock.stop(0);
    let second = step(backend.acquire(&AcquireSpec::new(name, Duration::from_secs(30))))
        .await
        .expect("acquire through instances 1 and 2");
    assert!(
        second.fence > first.fence,
        "fence went from {} to {}",
        first.fence,
        second.fence
    );
    assert!(step(backend.release(&second)).await.expect("release"));
}
