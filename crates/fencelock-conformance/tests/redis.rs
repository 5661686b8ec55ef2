//! The conformance suite against a single Redis instance ([`RedisBackend`]), plus the
//! Redis-specific promises: the acquire script is atomic (fences distinct and
//! increasing in grant order under contention), waiters are woken by the release's
//! `PUBLISH` and do not poll, a waiter wakes when the holder's lease expires, a broken
//! connection is `Unavailable` and the next call reconnects, and fences are called
//! durable only when the server's settings say so.

use crate::raw_redis;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fencelock::redis::{redis, RedisBackend, RedisConfig, RedisOptions};
use fencelock::{AcquireSpec, BoxFuture, Error, ErrorKind, FenceGuarantee, LockBackend};
use fencelock_conformance::{step, Fixture, Proxy};
use tokio::time::Instant;

struct Redis {
    server: fencelock_testkit::Redis,
}

impl Fixture for Redis {
    fn addrs(&self) -> Vec<SocketAddr> {
        vec![SocketAddr::from(([127, 0, 0, 1], self.server.port()))]
    }

    fn connect<'a>(
        &'a self,
        addrs: &'a [SocketAddr],
    ) -> BoxFuture<'a, Result<Arc<dyn LockBackend>, Error>> {
        Box::pin(async move {
            let backend = RedisBackend::connect(config(addrs[0])).await?;
            Ok(Arc::new(backend) as Arc<dyn LockBackend>)
        })
    }
}

fn config(addr: SocketAddr) -> RedisConfig {
    let mut config = RedisConfig::new(addr.to_string());
    // Short enough that a stalled connection fails a call well within a case.
    config.options.request_timeout = Duration::from_secs(1);
    config
}

async fn start() -> Redis {
    let server = tokio::task::spawn_blocking(fencelock_testkit::Redis::start)
        .await
        .expect("start task")
        .expect("redis-server starts");
    Redis { server }
}

fencelock_conformance::conformance_suite!(start());

async fn backend(redis: &Redis) -> Arc<RedisBackend> {
    let addr = redis.addrs()[0];
    Arc::new(
        step(RedisBackend::connect(config(addr)))
            .await
            .expect("connect"),
    )
}

fn waiting(name: &str, ttl: Duration, wait: Duration) -> AcquireSpec {
    let mut spec = AcquireSpec::new(name, ttl);
    spec.wait = wait;
    spec
}

/// Checks grants listed in the order they were made: `None` if every fence is larger
/// than the one before, else the first offending pair.
fn first_out_of_order(fences_in_grant_order: &[u64]) -> Option<(u64, u64)> {
    fences_in_grant_order
        .windows(2)
        .find(|w| w[1] <= w[0])
        .map(|w| (w[0], w[1]))
}

#[test]
fn the_order_check_catches_a_reused_or_lower_fence() {
    assert_eq!(first_out_of_order(&[1, 2, 5, 9]), None);
    assert_eq!(first_out_of_order(&[1, 2, 2, 3]), Some((2, 2)));
    assert_eq!(first_out_of_order(&[1, 3, 2]), Some((3, 2)));
}

/// Many tasks (on several backends) contend for one lock: never two holders at once,
/// and the fences, in the order the grants were made, are distinct and increasing —
/// the script takes the lock and draws the fence atomically.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fences_are_distinct_and_increasing_under_contention() {
    let redis = start().await;
    let backends = [
        backend(&redis).await,
        backend(&redis).await,
        backend(&redis).await,
    ];
    let inside = Arc::new(AtomicBool::new(false));
    let sequence = Arc::new(AtomicU64::new(0));
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for task in 0..12 {
        let backend = backends[task % backends.len()].clone();
        let (inside, sequence, log) = (inside.clone(), sequence.clone(), log.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..5 {
                let spec = waiting(
                    "contended",
                    Duration::from_secs(30),
                    Duration::from_secs(60),
                );
                let lease = backend
                    .acquire(&spec)
                    .await
                    .expect("granted within the wait");
                assert!(!inside.swap(true, Ordering::SeqCst), "two holders at once");
                let order = sequence.fetch_add(1, Ordering::SeqCst);
                log.lock().expect("log").push((order, lease.fence));
                inside.store(false, Ordering::SeqCst);
                assert!(backend.release(&lease).await.expect("release"));
            }
        }));
    }
    for task in tasks {
        step(task).await.expect("contender");
    }
    let mut log = log.lock().expect("log").clone();
    log.sort_unstable();
    let fences: Vec<u64> = log.iter().map(|&(_, fence)| fence).collect();
    assert_eq!(fences.len(), 60);
    assert_eq!(first_out_of_order(&fences), None, "fences {fences:?}");
}

/// A waiter sleeps on the pub/sub channel while the lock is held: no acquire
/// attempts reach Redis during the wait, and the release wakes it at once. The same
/// count catches a polling waiter (planted below).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_is_woken_by_release_without_polling() {
    let redis = start().await;
    let port = redis.server.port();
    let holder = backend(&redis).await;
    let waiter = backend(&redis).await;
    let held = step(holder.acquire(&AcquireSpec::new("quiet", Duration::from_secs(60))))
        .await
        .expect("acquire");
    let started = raw_redis::evalsha_calls(port);
    let task = {
        let waiter = waiter.clone();
        tokio::spawn(async move {
            let spec = waiting("quiet", Duration::from_secs(60), Duration::from_secs(25));
            let result = waiter.acquire(&spec).await;
            (result, Instant::now())
        })
    };
    // Its first attempt (after subscribing) is the one script it may run.
    let first_attempt_by = Instant::now() + Duration::from_secs(10);
    let mut before = raw_redis::evalsha_calls(port);
    while before == started {
        assert!(Instant::now() < first_attempt_by, "the waiter never tried");
        tokio::time::sleep(Duration::from_millis(20)).await;
        before = raw_redis::evalsha_calls(port);
    }
    assert_eq!(before, started + 1, "the waiter tried more than once");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let during = raw_redis::evalsha_calls(port) - before;
    assert_eq!(during, 0, "the waiter ran {during} scripts while it waited");
    assert!(
        !task.is_finished(),
        "the waiter gave up while the lock was held"
    );
    let released_at = Instant::now();
    assert!(step(holder.release(&held)).await.expect("release"));
    let (result, granted_at) = step(task).await.expect("waiter");
    let lease = result.expect("granted after the release");
    assert!(
        granted_at.duration_since(released_at) < Duration::from_secs(10),
        "woken {:?} after the release",
        granted_at.duration_since(released_at)
    );
    assert!(lease.fence > held.fence);
    assert!(step(waiter.release(&lease)).await.expect("release"));

    // The planted bug: a waiter that polls every 100 ms. The same count sees it.
    let held = step(holder.acquire(&AcquireSpec::new("quiet", Duration::from_secs(60))))
        .await
        .expect("acquire");
    let before = raw_redis::evalsha_calls(port);
    let polling_until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < polling_until {
        let e = step(waiter.acquire(&AcquireSpec::new("quiet", Duration::from_secs(60))))
            .await
            .expect_err("held");
        assert_eq!(e.kind(), ErrorKind::Held);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let polled = raw_redis::evalsha_calls(port) - before;
    assert!(
        polled >= 5,
        "the count missed a polling waiter ({polled} calls)"
    );
    assert!(step(holder.release(&held)).await.expect("release"));
}

/// An expiry publishes nothing: the waiter wakes on the holder's remaining PTTL, not
/// at the end of its (much longer) wait, and without polling in between.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_wakes_when_the_holders_lease_expires() {
    let redis = start().await;
    let port = redis.server.port();
    let holder = backend(&redis).await;
    let waiter = backend(&redis).await;
    let ttl = Duration::from_millis(1500);
    let held = step(holder.acquire(&AcquireSpec::new("expiring", ttl)))
        .await
        .expect("acquire");
    let before = raw_redis::evalsha_calls(port);
    let started = Instant::now();
    let wait = Duration::from_secs(25);
    let lease = step(waiter.acquire(&waiting("expiring", Duration::from_secs(60), wait)))
        .await
        .expect("granted after the expiry");
    let waited = started.elapsed();
    let attempts = raw_redis::evalsha_calls(port) - before;
    assert!(
        waited + Duration::from_millis(50) >= ttl,
        "granted after {waited:?}, before the expiry"
    );
    assert!(
        waited < wait / 2,
        "woken only after {waited:?}, not on the expiry"
    );
    assert!(attempts <= 4, "{attempts} attempts: the waiter polled");
    assert!(lease.fence > held.fence);
    assert!(!step(holder.release(&held)).await.expect("release"));
}

/// The request id is stored with the grant in Redis, so even a retry through another
/// backend object (another process) gets the same grant back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_through_another_connection_gets_the_same_grant() {
    let redis = start().await;
    let first = backend(&redis).await;
    let second = backend(&redis).await;
    let spec = AcquireSpec::new("retried", Duration::from_secs(60));
    let lease = step(first.acquire(&spec)).await.expect("acquire");
    let again = step(second.acquire(&spec)).await.expect("retry");
    assert_eq!(
        (&again.owner_token, again.fence),
        (&lease.owner_token, lease.fence)
    );
    assert!(again.ttl <= lease.ttl);
    assert!(step(second.release(&again)).await.expect("release"));
    assert!(!step(first.release(&lease)).await.expect("already released"));
}

/// A stalled connection fails the call as `Unavailable` (within the request timeout);
/// once the network is back, the next call reconnects and works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_connection_is_unavailable_and_the_next_call_reconnects() {
    let redis = start().await;
    let proxy = Proxy::start(redis.addrs()[0]).await.expect("proxy");
    let backend = step(RedisBackend::connect(config(proxy.addr())))
        .await
        .expect("connect");
    let lease = step(backend.acquire(&AcquireSpec::new("flaky", Duration::from_secs(60))))
        .await
        .expect("acquire");
    proxy.pause();
    let e = step(backend.renew(&lease, Duration::from_secs(60)))
        .await
        .expect_err("renew through a stalled network");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    proxy.resume();
    let granted = step(backend.renew(&lease, Duration::from_secs(60)))
        .await
        .expect("renew after the network is back");
    assert_eq!(granted, Duration::from_secs(60));
    assert!(step(backend.release(&lease)).await.expect("release"));
}

/// Fences are reported durable only for `appendonly yes` + `appendfsync always`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fences_are_durable_only_with_fsync_always() {
    let redis = start().await;
    let port = redis.server.port();
    assert_eq!(
        backend(&redis).await.capabilities().fences,
        FenceGuarantee::BestEffort,
        "the testkit's redis runs without persistence"
    );
    for (parameter, value) in [("appendonly", "yes"), ("appendfsync", "everysec")] {
        let reply = raw_redis::command(port, &["CONFIG", "SET", parameter, value]);
        assert_eq!(reply.text(), Some("OK"), "{reply:?}");
    }
    assert_eq!(
        backend(&redis).await.capabilities().fences,
        FenceGuarantee::BestEffort
    );
    let reply = raw_redis::command(port, &["CONFIG", "SET", "appendfsync", "always"]);
    assert_eq!(reply.text(), Some("OK"), "{reply:?}");
    assert_eq!(
        backend(&redis).await.capabilities().fences,
        FenceGuarantee::Durable
    );
}

/// What the backend cannot do is refused, not approximated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_delay_is_refused() {
    let redis = start().await;
    let backend = backend(&redis).await;
    let mut spec = AcquireSpec::new("delayed", Duration::from_secs(60));
    spec.lock_delay = Duration::from_secs(1);
    let e = step(backend.acquire(&spec)).await.expect_err("lock-delay");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(!raw_redis::exists(
        redis.server.port(),
        "fencelock:lock:delayed"
    ));
}

/// A semaphore's slot frees when its holder's lease runs out (no release, so no
/// message): a waiter gets it on the slot's expiry. Retries of a slot's request get the
/// same slot; a mutex and a semaphore, or two limits, exclude each other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphore_slots_expire_retry_and_refuse_other_limits() {
    let redis = start().await;
    let backend = backend(&redis).await;
    let name = "pool";
    let slot = |ttl: Duration, wait: Duration| {
        let mut spec = waiting(name, ttl, wait);
        spec.limit = 2;
        spec
    };
    let short = slot(Duration::from_millis(1500), Duration::ZERO);
    let first = step(backend.acquire(&short)).await.expect("first slot");
    let long = slot(Duration::from_secs(60), Duration::ZERO);
    let second = step(backend.acquire(&long)).await.expect("second slot");
    let again = step(backend.acquire(&long))
        .await
        .expect("retry of the second");
    assert_eq!(
        (&again.owner_token, again.fence),
        (&second.owner_token, second.fence)
    );
    assert!(second.fence > first.fence);

    let e = step(backend.acquire(&slot(Duration::from_secs(60), Duration::ZERO)))
        .await
        .expect_err("both slots taken");
    assert_eq!(e.kind(), ErrorKind::Held, "{e}");
    let mut other_limit = slot(Duration::from_secs(60), Duration::ZERO);
    other_limit.limit = 3;
    let e = step(backend.acquire(&other_limit))
        .await
        .expect_err("limit 3");
    assert_eq!(e.kind(), ErrorKind::LimitMismatch, "{e}");
    let e = step(backend.acquire(&AcquireSpec::new(name, Duration::from_secs(60))))
        .await
        .expect_err("a mutex on a semaphore");
    assert_eq!(e.kind(), ErrorKind::LimitMismatch, "{e}");

    let started = Instant::now();
    let third = step(backend.acquire(&slot(Duration::from_secs(60), Duration::from_secs(25))))
        .await
        .expect("granted when the first slot expires");
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_secs(12),
        "woken only after {waited:?}"
    );
    assert!(third.fence > second.fence);
    assert!(!step(backend.release(&first)).await.expect("expired slot"));
    let e = step(backend.renew(&first, Duration::from_secs(60)))
        .await
        .expect_err("renew of an expired slot");
    assert_eq!(e.kind(), ErrorKind::NotHeld, "{e}");
    assert_eq!(
        step(backend.renew(&second, Duration::from_secs(60)))
            .await
            .expect("renew"),
        Duration::from_secs(60)
    );
    for lease in [&second, &third] {
        assert!(step(backend.release(lease)).await.expect("release"));
    }
    // All slots gone: nothing of the semaphore is left, and a mutex may take the name.
    let port = redis.server.port();
    assert!(!raw_redis::exists(port, "fencelock:sem:pool"));
    assert!(!raw_redis::exists(port, "fencelock:sem-data:pool"));
    let mutex = step(backend.acquire(&AcquireSpec::new(name, Duration::from_secs(60))))
        .await
        .expect("a mutex after the semaphore");
    let mut semaphore = slot(Duration::from_secs(60), Duration::ZERO);
    semaphore.request_id = "another".to_owned();
    let e = step(backend.acquire(&semaphore))
        .await
        .expect_err("a semaphore on a mutex");
    assert_eq!(e.kind(), ErrorKind::LimitMismatch, "{e}");
    assert!(step(backend.release(&mutex)).await.expect("release"));
}

/// Many tasks contend for a semaphore of 3: never more than 3 holders at once, and
/// every grant has its own fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_contended_semaphore_never_exceeds_its_limit() {
    let redis = start().await;
    let backends = [backend(&redis).await, backend(&redis).await];
    let holders = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let most = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let fences = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for task in 0..9 {
        let backend = backends[task % backends.len()].clone();
        let (holders, most, fences) = (holders.clone(), most.clone(), fences.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..4 {
                let mut spec = waiting("slots", Duration::from_secs(30), Duration::from_secs(60));
                spec.limit = 3;
                let lease = backend
                    .acquire(&spec)
                    .await
                    .expect("granted within the wait");
                let now = holders.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                fences.lock().expect("fences").push(lease.fence);
                tokio::time::sleep(Duration::from_millis(5)).await;
                holders.fetch_sub(1, Ordering::SeqCst);
                assert!(backend.release(&lease).await.expect("release"));
            }
        }));
    }
    for task in tasks {
        step(task).await.expect("contender");
    }
    let most = most.load(Ordering::SeqCst);
    assert!(most <= 3, "{most} holders at once");
    let mut fences = fences.lock().expect("fences").clone();
    fences.sort_unstable();
    fences.dedup();
    assert_eq!(fences.len(), 36, "fences were reused");
}

/// Connections the server closed (a restart, `CLIENT KILL`) fail one call as
/// `Unavailable`; the backend then drops its idle connections and the next call
/// reconnects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_connections_fail_one_call_and_the_next_reconnects() {
    let redis = start().await;
    let backend = backend(&redis).await;
    let lease = step(backend.acquire(&AcquireSpec::new("killed", Duration::from_secs(60))))
        .await
        .expect("acquire");
    let killed = raw_redis::command(redis.server.port(), &["CLIENT", "KILL", "TYPE", "normal"]);
    assert!(
        matches!(killed, raw_redis::Value::Int(n) if n >= 1),
        "{killed:?}"
    );
    let e = step(backend.renew(&lease, Duration::from_secs(60)))
        .await
        .expect_err("the pooled connection is gone");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    let granted = step(backend.renew(&lease, Duration::from_secs(60)))
        .await
        .expect("a fresh connection");
    assert_eq!(granted, Duration::from_secs(60));
    assert!(step(backend.release(&lease)).await.expect("release"));
}

/// The application's own `ConnectionManager` carries every command: no other
/// connection appears on the server (no pub/sub one either, given no client to open
/// it from), and the manager's connection is the one that ran the scripts. Waiters
/// then poll and are still served. The same count sees a second connection (planted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_applications_connection_manager_carries_every_command() {
    let redis = start().await;
    let port = redis.server.port();
    let client = redis::Client::open(redis.server.url()).expect("url");
    let mut manager = step(client.get_connection_manager())
        .await
        .expect("the application's manager");
    let _: () = step(
        redis::cmd("CLIENT")
            .arg("SETNAME")
            .arg("app")
            .query_async(&mut manager),
    )
    .await
    .expect("name it");
    let before = raw_redis::clients(port, "normal");
    assert_eq!(before.len(), 1, "{before:?}");
    let mut options = RedisOptions::default();
    options.request_timeout = Duration::from_secs(5);
    let backend = step(RedisBackend::from_connection_manager(
        manager.clone(),
        None,
        options,
    ))
    .await
    .expect("a backend on the manager");
    assert!(!backend.capabilities().push_wakeups);
    let lease = step(backend.acquire(&AcquireSpec::new("app", Duration::from_secs(60))))
        .await
        .expect("acquire");
    let waiter = {
        let backend = Arc::new(
            step(RedisBackend::from_connection_manager(
                manager.clone(),
                None,
                RedisOptions::default(),
            ))
            .await
            .expect("a second backend on the manager"),
        );
        tokio::spawn(async move {
            backend
                .acquire(&waiting(
                    "app",
                    Duration::from_secs(60),
                    Duration::from_secs(25),
                ))
                .await
        })
    };
    step(backend.renew(&lease, Duration::from_secs(60)))
        .await
        .expect("renew");
    assert!(step(backend.release(&lease)).await.expect("release"));
    let next = step(waiter)
        .await
        .expect("waiter")
        .expect("a polling waiter is served");
    assert!(next.fence > lease.fence);
    let after = raw_redis::clients(port, "normal");
    assert_eq!(after.len(), 1, "another connection appeared: {after:?}");
    assert!(
        after[0].contains("name=app") && after[0].contains("cmd=evalsha"),
        "the application's connection did not run the scripts: {after:?}"
    );
    assert!(raw_redis::clients(port, "pubsub").is_empty());

    // The planted bug: a backend that opens its own connection. The count sees it.
    let _own = step(RedisBackend::from_client(client, RedisOptions::default()))
        .await
        .expect("a backend with its own manager");
    assert_eq!(raw_redis::clients(port, "normal").len(), 2);
}

/// Given a client for wake-ups, the backend on the application's manager opens the
/// pub/sub connection only when a waiter needs it, and just one for every wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wakeups_open_one_pubsub_connection_on_the_first_wait() {
    let redis = start().await;
    let port = redis.server.port();
    let client = redis::Client::open(redis.server.url()).expect("url");
    let manager = step(client.get_connection_manager())
        .await
        .expect("the application's manager");
    let backend = Arc::new(
        step(RedisBackend::from_connection_manager(
            manager,
            Some(client),
            RedisOptions::default(),
        ))
        .await
        .expect("backend"),
    );
    assert!(backend.capabilities().push_wakeups);
    let held = step(backend.acquire(&AcquireSpec::new("one", Duration::from_secs(60))))
        .await
        .expect("acquire");
    let other = step(backend.acquire(&AcquireSpec::new("two", Duration::from_secs(60))))
        .await
        .expect("acquire");
    assert!(
        raw_redis::clients(port, "pubsub").is_empty(),
        "a pub/sub connection before any wait"
    );
    let waiters: Vec<_> = ["one", "two"]
        .into_iter()
        .map(|name| {
            let backend = backend.clone();
            tokio::spawn(async move {
                backend
                    .acquire(&waiting(
                        name,
                        Duration::from_secs(60),
                        Duration::from_secs(25),
                    ))
                    .await
            })
        })
        .collect();
    // Both waiters subscribed: Redis lists one pub/sub client with two channels.
    let subscribed_by = Instant::now() + Duration::from_secs(10);
    loop {
        let pubsub = raw_redis::clients(port, "pubsub");
        if pubsub.len() == 1 && pubsub[0].contains("sub=2") {
            break;
        }
        assert!(
            pubsub.len() <= 1,
            "more than one pub/sub connection: {pubsub:?}"
        );
        assert!(
            Instant::now() < subscribed_by,
            "never subscribed: {pubsub:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(raw_redis::clients(port, "normal").len(), 1);
    for lease in [&held, &other] {
        assert!(step(backend.release(lease)).await.expect("release"));
    }
    for waiter in waiters {
        let lease = step(waiter).await.expect("waiter").expect("woken");
        assert!(step(backend.release(&lease)).await.expect("release"));
    }
    // The pub/sub connection stays open for later waits (listed as `normal` once it
    // has unsubscribed from every channel).
    let open = raw_redis::clients(port, "pubsub").len() + raw_redis::clients(port, "normal").len();
    assert_eq!(open, 2);
}

/// A pub/sub server that cannot be reached (a cluster's wake-up node down, say) does
/// not fail waits: the waiter polls and is served once the lock is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_poll_while_the_pubsub_connection_cannot_be_opened() {
    let redis = start().await;
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("address").port()
    };
    let client = redis::Client::open(redis.server.url()).expect("url");
    let manager = step(client.get_connection_manager())
        .await
        .expect("manager");
    let nowhere = redis::Client::open(format!("redis://127.0.0.1:{closed}/")).expect("url");
    let backend = Arc::new(
        step(RedisBackend::from_connection_manager(
            manager,
            Some(nowhere),
            RedisOptions::default(),
        ))
        .await
        .expect("backend"),
    );
    let held = step(backend.acquire(&AcquireSpec::new("deaf", Duration::from_secs(60))))
        .await
        .expect("acquire");
    let waiter = {
        let backend = backend.clone();
        tokio::spawn(async move {
            backend
                .acquire(&waiting(
                    "deaf",
                    Duration::from_secs(60),
                    Duration::from_secs(25),
                ))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiter.is_finished(),
        "the waiter gave up while the lock was held"
    );
    assert!(step(backend.release(&held)).await.expect("release"));
    let lease = step(waiter)
        .await
        .expect("waiter")
        .expect("served by polling");
    assert!(lease.fence > held.fence);
}
