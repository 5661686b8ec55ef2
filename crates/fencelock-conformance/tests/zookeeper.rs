//! The conformance suite against ZooKeeper: a throwaway standalone server
//! (`fencelock_testkit::ZooKeeper`: tickTime 2 s, sessions of 1–60 s, durable log),
//! reached by `fencelock::zookeeper::ZooKeeperBackend`; then what is particular to
//! ZooKeeper: the ttl-to-session mapping and renewal across a partition.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use fencelock::zookeeper::{ZooKeeperBackend, ZooKeeperConfig};
use fencelock::{AcquireSpec, BoxFuture, Error, ErrorKind, LockBackend};
use fencelock_conformance::{connect, step, Fixture, Partitioned, STEP};

struct ZooKeeper {
    server: fencelock_testkit::ZooKeeper,
}

impl Fixture for ZooKeeper {
    fn addrs(&self) -> Vec<SocketAddr> {
        vec![SocketAddr::from(([127, 0, 0, 1], self.server.port()))]
    }

    fn connect<'a>(
        &'a self,
        addrs: &'a [SocketAddr],
    ) -> BoxFuture<'a, Result<Arc<dyn LockBackend>, Error>> {
        Box::pin(async move {
            let servers: Vec<String> = addrs.iter().map(SocketAddr::to_string).collect();
            let backend = ZooKeeperBackend::new(ZooKeeperConfig::new(&servers.join(",")))?;
            Ok(Arc::new(backend) as Arc<dyn LockBackend>)
        })
    }
}

async fn start() -> ZooKeeper {
    let server = tokio::task::spawn_blocking(fencelock_testkit::ZooKeeper::start)
        .await
        .expect("start task")
        .expect("zookeeper starts");
    ZooKeeper { server }
}

fencelock_conformance::conformance_suite!(start());

fn spec(name: &str, ttl: Duration) -> AcquireSpec {
    let mut spec = AcquireSpec::new(name, ttl);
    spec.owner = "zookeeper-test".to_owned();
    spec
}

/// The lease is the session: a ttl below the server's minSessionTimeout (1 s here)
/// is granted as the minimum and reported so; one above maxSessionTimeout (60 s) is
/// refused rather than silently shortened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_is_the_negotiated_session_timeout() {
    let zk = start().await;
    let backend = connect(&zk).await;
    let short = step(backend.acquire(&spec("zk:ttl-short", Duration::from_millis(300))))
        .await
        .expect("a short ttl is granted");
    assert_eq!(
        short.ttl,
        Duration::from_secs(1),
        "granted ttl must be the server's minimum"
    );
    let renewed = step(backend.renew(&short, Duration::from_millis(300)))
        .await
        .expect("renew");
    assert_eq!(renewed, Duration::from_secs(1));
    assert!(step(backend.release(&short)).await.expect("release"));

    let e = step(backend.acquire(&spec("zk:ttl-long", Duration::from_secs(120))))
        .await
        .expect_err("a ttl above maxSessionTimeout");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let exact = step(backend.acquire(&spec("zk:ttl-long", Duration::from_secs(60))))
        .await
        .expect("the maximum itself is granted");
    assert_eq!(exact.ttl, Duration::from_secs(60));
    assert!(step(backend.release(&exact)).await.expect("release"));

    let mut delayed = spec("zk:ttl-short", Duration::from_secs(2));
    delayed.lock_delay = Duration::from_secs(1);
    let e = step(backend.acquire(&delayed))
        .await
        .expect_err("lock-delay is not supported");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
}

/// A holder cut off from the server: while the connection is merely down
/// (suspended) renew is `Unavailable`; once the server expired the session (proved by
/// another client being granted the lock) renew is `NotHeld` and release `false`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_expiry_while_holding_makes_renew_not_held() {
    let zk = start().await;
    let ttl = Duration::from_secs(6);
    let holder = Partitioned::connect(&zk).await;
    let other = connect(&zk).await;
    let name = "zk:expiry";
    let lease = step(holder.backend.acquire(&spec(name, ttl)))
        .await
        .expect("acquire");
    assert_eq!(
        step(holder.backend.renew(&lease, ttl))
            .await
            .expect("renew"),
        ttl
    );
    holder.cut();
    // The renewal goes into the stalled proxy; the backend gives up on the connection
    // after two thirds of the timeout (4 s), before it could consider the session
    // lost (6 s after the last reply).
    let e = step(holder.backend.renew(&lease, ttl))
        .await
        .expect_err("renew while cut off");
    assert_eq!(
        e.kind(),
        ErrorKind::Unavailable,
        "renew while suspended: {e}"
    );
    let mut waiting = spec(name, Duration::from_secs(60));
    waiting.wait = STEP;
    let next = step(other.acquire(&waiting))
        .await
        .expect("granted after the holder's session expired");
    assert!(next.fence > lease.fence);
    holder.heal();
    let e = step(holder.backend.renew(&lease, ttl))
        .await
        .expect_err("renew after expiry");
    assert_eq!(e.kind(), ErrorKind::NotHeld, "renew after expiry: {e}");
    assert!(!step(holder.backend.release(&lease)).await.expect("release"));
    // The backend opens a fresh session for new work.
    let mut again = spec(name, ttl);
    again.wait = Duration::ZERO;
    let e = step(holder.backend.acquire(&again))
        .await
        .expect_err("still held by the other client");
    assert_eq!(e.kind(), ErrorKind::Held, "{e}");
    assert!(step(other.release(&next)).await.expect("release"));
    let lease = step(holder.backend.acquire(&again))
        .await
        .expect("acquire on a new session");
    assert!(step(holder.backend.release(&lease)).await.expect("release"));
}

/// Any lock name is one znode: names with `/`, unicode or percent signs are distinct
/// locks (the encoding is injective), and each is exclusive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_are_encoded_safely() {
    let zk = start().await;
    let a = connect(&zk).await;
    let b = connect(&zk).await;
    let names = ["a/b", "a%2Fb", "a-b", "ünï/çødé/..", ".", ".."];
    let mut leases = Vec::new();
    for name in names {
        leases.push(
            step(a.acquire(&spec(name, Duration::from_secs(10))))
                .await
                .unwrap_or_else(|e| panic!("acquire {name:?}: {e}")),
        );
        let e = step(b.acquire(&spec(name, Duration::from_secs(10))))
            .await
            .expect_err("held");
        assert_eq!(e.kind(), ErrorKind::Held, "{name:?}: {e}");
    }
    for lease in &leases {
        assert!(step(a.release(lease)).await.expect("release"));
    }
}

/// A lock in use as a semaphore of one limit refuses a request with another limit
/// (`LimitMismatch`), and the refused request leaves nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_different_limit_is_refused() {
    let zk = start().await;
    let a = connect(&zk).await;
    let b = connect(&zk).await;
    let name = "zk:limits";
    let mut two = spec(name, Duration::from_secs(10));
    two.limit = 2;
    let first = step(a.acquire(&two)).await.expect("limit 2");
    let e = step(b.acquire(&spec(name, Duration::from_secs(10))))
        .await
        .expect_err("limit 1 while in use with limit 2");
    assert_eq!(e.kind(), ErrorKind::LimitMismatch, "{e}");
    two.request_id = AcquireSpec::new(name, Duration::from_secs(10)).request_id;
    let second = step(b.acquire(&two)).await.expect("the second of two");
    assert!(step(a.release(&first)).await.expect("release"));
    assert!(step(b.release(&second)).await.expect("release"));
    let mutex = step(b.acquire(&spec(name, Duration::from_secs(10))))
        .await
        .expect("a free lock takes any limit");
    assert!(step(b.release(&mutex)).await.expect("release"));
}

/// A semaphore waiter watches the `limit` nodes ahead of it, not just its immediate
/// predecessor: the release of the first holder (not its predecessor) wakes it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphore_waiter_wakes_when_any_holder_ahead_leaves() {
    let zk = start().await;
    let clients = [connect(&zk).await, connect(&zk).await, connect(&zk).await];
    let name = "zk:semaphore-wake";
    let ttl = Duration::from_secs(10);
    let request = move |wait: Duration| {
        let mut spec = spec(name, ttl);
        spec.limit = 2;
        spec.wait = wait;
        spec
    };
    let first = step(clients[0].acquire(&request(Duration::ZERO)))
        .await
        .expect("first");
    let second = step(clients[1].acquire(&request(Duration::ZERO)))
        .await
        .expect("second");
    let waiter = clients[2].clone();
    let task = tokio::spawn(async move { waiter.acquire(&request(STEP)).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!task.is_finished(), "granted while two of two are held");
    assert!(step(clients[0].release(&first)).await.expect("release"));
    let third = step(task)
        .await
        .expect("task")
        .expect("granted when the first holder left");
    assert!(third.fence > second.fence);
    assert!(step(clients[1].release(&second)).await.expect("release"));
    assert!(step(clients[2].release(&third)).await.expect("release"));
}

/// A release that cannot reach the server (connection stalled) fails as
/// `Unavailable`, and the node is deleted in the background once the connection is
/// back — the lock is free before the still-alive session could have expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_cut_off_completes_on_reconnect() {
    let zk = start().await;
    let ttl = Duration::from_secs(9);
    let holder = Partitioned::connect(&zk).await;
    let other = connect(&zk).await;
    let name = "zk:release-cut";
    let lease = step(holder.backend.acquire(&spec(name, ttl)))
        .await
        .expect("acquire");
    // The server hears from the session after this instant, so it cannot expire the
    // session before `touched + ttl`.
    let touched = tokio::time::Instant::now();
    step(holder.backend.renew(&lease, ttl))
        .await
        .expect("renew");
    holder.cut();
    // Sent into the stalled proxy: no answer, and the connection is declared dead
    // after two thirds of the ttl. (Requests sent into the proxy are delivered when
    // it resumes, so the release is made only once the connection is known dead.)
    let e = step(holder.backend.renew(&lease, ttl))
        .await
        .expect_err("renew while cut off");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    let e = step(holder.backend.release(&lease))
        .await
        .expect_err("release while disconnected");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    holder.heal();
    let mut waiting = spec(name, ttl);
    waiting.wait = STEP;
    let next = step(other.acquire(&waiting)).await.expect("granted");
    assert!(
        touched.elapsed() < ttl,
        "the lock was freed only {:?} after the last renewal: by session expiry, not by the release",
        touched.elapsed()
    );
    assert!(step(other.release(&next)).await.expect("release"));
    assert_eq!(
        step(holder.backend.renew(&lease, ttl))
            .await
            .expect_err("released")
            .kind(),
        ErrorKind::NotHeld
    );
}

/// A connect string with a dead server still works (each server is tried in turn,
/// from a random one); one with only dead servers fails as `Unavailable`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_servers_in_the_list_are_skipped() {
    let zk = start().await;
    let dead = format!(
        "127.0.0.1:{}",
        fencelock_testkit::free_port().expect("port")
    );
    let servers = format!("{dead},{}", zk.server.connect_string());
    for _ in 0..4 {
        let backend = ZooKeeperBackend::new(ZooKeeperConfig::new(&servers)).expect("backend");
        let lease = step(backend.acquire(&spec("zk:servers", Duration::from_secs(10))))
            .await
            .expect("acquire past a dead server");
        assert!(step(backend.release(&lease)).await.expect("release"));
    }
    let backend = ZooKeeperBackend::new(ZooKeeperConfig::new(&dead)).expect("backend");
    let e = step(backend.acquire(&spec("zk:servers", Duration::from_secs(10))))
        .await
        .expect_err("no live server");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
}
