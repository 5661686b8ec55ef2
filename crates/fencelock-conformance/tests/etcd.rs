//! The conformance suite against etcd (`fencelock::etcd`, feature `etcd`): a
//! throwaway single-member etcd 3.4 per case on a random loopback port, reached over
//! gRPC. Then what is particular to the etcd recipe: fences are create revisions, a
//! mutex waiter watches only its predecessor, sub-second ttls are rounded up and
//! reported, escaped names never collide.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use fencelock::etcd::{EtcdBackend, EtcdConfig};
use fencelock::{AcquireSpec, BoxFuture, Error, ErrorKind, Lease, LockBackend};
use fencelock_conformance::{step, Fixture, STEP};
use fencelock_testkit::Etcd;
use tokio::time::Instant;

struct EtcdFixture {
    etcd: Etcd,
}

impl EtcdFixture {
    /// A direct client with its own connection.
    async fn client(&self) -> EtcdBackend {
        step(EtcdBackend::connect(EtcdConfig::new(self.etcd.url())))
            .await
            .expect("connect to etcd")
    }
}

impl Fixture for EtcdFixture {
    fn addrs(&self) -> Vec<SocketAddr> {
        vec![SocketAddr::from(([127, 0, 0, 1], self.etcd.port()))]
    }

    fn connect<'a>(
        &'a self,
        addrs: &'a [SocketAddr],
    ) -> BoxFuture<'a, Result<Arc<dyn LockBackend>, Error>> {
        Box::pin(async move {
            let backend =
                EtcdBackend::connect(EtcdConfig::new(format!("http://{}", addrs[0]))).await?;
            Ok(Arc::new(backend) as Arc<dyn LockBackend>)
        })
    }

    // etcd's shortest lease on a default cluster (1.5 × the 1 s election timeout,
    // rounded up): granted exactly.
    fn short_ttl(&self) -> Duration {
        Duration::from_secs(2)
    }
}

async fn start() -> EtcdFixture {
    let etcd = tokio::task::spawn_blocking(Etcd::start)
        .await
        .expect("start task")
        .expect("etcd starts (Debian package etcd-server)");
    EtcdFixture { etcd }
}

fencelock_conformance::conformance_suite!(start());

const LONG_TTL: Duration = Duration::from_secs(60);

fn waiting(name: &str, wait: Duration) -> AcquireSpec {
    let mut spec = AcquireSpec::new(name, LONG_TTL);
    spec.owner = "etcd-test".to_owned();
    spec.wait = wait;
    spec
}

async fn acquire(backend: &EtcdBackend, spec: &AcquireSpec) -> Lease {
    step(backend.acquire(spec))
        .await
        .unwrap_or_else(|e| panic!("acquire {:?}: {e}", spec.name))
}

/// Polls `condition` until it holds, failing the test after [`STEP`].
async fn until<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let give_up = Instant::now() + STEP;
    while !condition().await {
        assert!(Instant::now() < give_up, "gave up waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn queue_len(backend: &EtcdBackend, name: &str) -> usize {
    step(backend.queue(name)).await.expect("queue").len()
}

/// The fence is the create revision of the grant's key, as a Range reads it back; a
/// later grant's key has a larger one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_is_the_create_revision_of_the_key() {
    let fixture = start().await;
    let backend = fixture.client().await;
    let name = "etcd:fence";
    let mut fences = Vec::new();
    for _ in 0..3 {
        let spec = waiting(name, Duration::ZERO);
        let lease = acquire(&backend, &spec).await;
        let queue = step(backend.queue(name)).await.expect("queue");
        assert_eq!(queue.len(), 1, "{queue:?}");
        let entry = &queue[0];
        assert_eq!(entry.fence, lease.fence, "fence vs create revision");
        assert_eq!(entry.request_id, spec.request_id);
        assert_eq!(
            entry.key,
            format!("fencelock/etcd:fence/{}", spec.request_id)
        );
        assert_eq!((entry.limit, entry.owner.as_str()), (1, "etcd-test"));
        assert!(
            lease
                .owner_token
                .starts_with(&format!("{}:", entry.lease_id)),
            "the owner token names the key's lease: {} vs {}",
            lease.owner_token,
            entry.lease_id
        );
        fences.push(lease.fence);
        assert!(step(backend.release(&lease)).await.expect("release"));
        assert_eq!(queue_len(&backend, name).await, 0, "release left the key");
    }
    assert!(fences.windows(2).all(|w| w[0] < w[1]), "{fences:?}");
}

/// Holder H and mutex waiters W1, W2, W3 queued in that order. W2 gives up: only W3
/// (whose predecessor it was) is woken, and it then watches W1. H releases: W1 is
/// granted and W3 is not woken. W1 releases: W3 is woken and granted. So W3 is woken
/// exactly twice — a waiter that watched the holder or the whole lock would be woken
/// by every release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mutex_waiter_watches_only_its_predecessor() {
    let fixture = start().await;
    let observer = fixture.client().await;
    let name = "etcd:chain";
    let holder = fixture.client().await;
    let held = acquire(&holder, &waiting(name, Duration::ZERO)).await;

    let mut waiters = Vec::new();
    let mut tasks = Vec::new();
    for (index, wait) in [STEP / 2, Duration::from_secs(2), STEP / 2]
        .into_iter()
        .enumerate()
    {
        let waiter = fixture.client().await;
        waiters.push(waiter.clone());
        tasks.push(tokio::spawn(async move {
            waiter.acquire(&waiting(name, wait)).await
        }));
        // Queued in order: each key exists before the next waiter starts.
        until("the waiter is queued", || async {
            queue_len(&observer, name).await == index + 2
        })
        .await;
    }
    let (w1, w2, w3) = (&waiters[0], &waiters[1], &waiters[2]);
    let mut tasks = tasks.into_iter();
    let (t1, t2, t3) = (
        tasks.next().expect("w1"),
        tasks.next().expect("w2"),
        tasks.next().expect("w3"),
    );

    let gave_up = step(t2).await.expect("w2 task").expect_err("w2 granted");
    assert_eq!(gave_up.kind(), ErrorKind::Timeout, "{gave_up}");
    until("w3 woken by w2 leaving", || async { w3.wakeups() == 1 }).await;
    // Its next wait (on w1) has begun: a release before that would find w3 first in
    // line when it looks, granted without a second wakeup.
    until("w3 waits for w1", || async { w3.waits() == 2 }).await;
    assert_eq!(queue_len(&observer, name).await, 3, "w2's key is gone");

    assert!(step(holder.release(&held)).await.expect("release"));
    let first = step(t1).await.expect("w1 task").expect("w1 granted");
    assert!(first.fence > held.fence);
    assert_eq!(w1.wakeups(), 1, "w1 is woken once, by the holder's release");
    assert!(step(w1.release(&first)).await.expect("release"));
    let last = step(t3).await.expect("w3 task").expect("w3 granted");
    assert!(last.fence > first.fence);
    assert_eq!(
        w3.wakeups(),
        2,
        "w3 must be woken only when its predecessor goes (w2, then w1)"
    );
    assert_eq!(
        w2.wakeups(),
        0,
        "w2's predecessor (w1) never went while it waited"
    );
    assert!(step(w3.release(&last)).await.expect("release"));
}

/// A 300 ms ttl becomes a whole-second etcd lease, and the grant reports what etcd
/// granted: the lock outlives the ttl asked for, and renewals report the same length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sub_second_ttl_is_rounded_up_and_reported() {
    let fixture = start().await;
    let backend = fixture.client().await;
    let other = fixture.client().await;
    let name = "etcd:short";
    let asked = Duration::from_millis(300);
    let mut spec = AcquireSpec::new(name, asked);
    spec.owner = "etcd-test".to_owned();
    let lease = acquire(&backend, &spec).await;
    assert!(
        lease.ttl >= Duration::from_secs(1),
        "granted {:?}",
        lease.ttl
    );
    assert_eq!(
        lease.ttl.subsec_nanos(),
        0,
        "not whole seconds: {:?}",
        lease.ttl
    );
    // Twice the ttl asked for, well within the one reported: still held.
    tokio::time::sleep(asked * 2).await;
    let refused = step(other.acquire(&waiting(name, Duration::ZERO)))
        .await
        .expect_err("another client was granted the lock within its reported ttl");
    assert_eq!(refused.kind(), ErrorKind::Held, "{refused}");
    let renewed = step(backend.renew(&lease, asked)).await.expect("renew");
    assert_eq!(renewed, lease.ttl, "renew restores the length granted");
    assert!(step(backend.release(&lease)).await.expect("release"));
}

/// Names that differ only in how `/`, `%` or non-ASCII characters sit in them are
/// different locks with disjoint key ranges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_with_slashes_and_unicode_do_not_collide() {
    let fixture = start().await;
    let backend = fixture.client().await;
    let names = [
        "a/b",
        "a",
        "b",
        "a/",
        "a%2Fb",
        "a/b/c",
        "ü/名前",
        "ü",
        "名前",
    ];
    let mut leases = Vec::new();
    for name in names {
        leases.push(acquire(&backend, &waiting(name, Duration::ZERO)).await);
    }
    for (name, lease) in names.iter().zip(&leases) {
        let queue = step(backend.queue(name)).await.expect("queue");
        assert_eq!(queue.len(), 1, "{name:?} sees {queue:?}");
        assert_eq!(queue[0].fence, lease.fence, "{name:?}");
    }
    for lease in &leases {
        assert!(step(backend.release(lease)).await.expect("release"));
    }
}

/// A semaphore's holders and a mutex request must not mix: whoever asks with another
/// limit than the holders' is refused (else a limit-1 holder would share its lock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_different_limit_is_refused() {
    let fixture = start().await;
    let backend = fixture.client().await;
    for (held_limit, asked_limit) in [(3, 1), (1, 3)] {
        let name = format!("etcd:limit-{held_limit}");
        let mut spec = waiting(&name, Duration::ZERO);
        spec.limit = held_limit;
        let lease = acquire(&backend, &spec).await;
        let mut other = waiting(&name, Duration::ZERO);
        other.limit = asked_limit;
        let e = step(backend.acquire(&other))
            .await
            .expect_err("granted with another limit");
        assert_eq!(e.kind(), ErrorKind::LimitMismatch, "{e}");
        assert_eq!(
            queue_len(&backend, &name).await,
            1,
            "the refused key stayed"
        );
        assert!(step(backend.release(&lease)).await.expect("release"));
    }
}

/// An acquire that is dropped while it waits leaves no key behind (its lease is
/// revoked), so it never becomes a phantom holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_waiter_leaves_no_key() {
    let fixture = start().await;
    let backend = fixture.client().await;
    let name = "etcd:dropped";
    let held = acquire(&backend, &waiting(name, Duration::ZERO)).await;
    let waiter = fixture.client().await;
    let task = tokio::spawn(async move {
        let _ = waiter.acquire(&waiting(name, STEP)).await;
    });
    until("the waiter is queued", || async {
        queue_len(&backend, name).await == 2
    })
    .await;
    task.abort();
    until("the dropped waiter's key is gone", || async {
        queue_len(&backend, name).await == 1
    })
    .await;
    assert!(step(backend.release(&held)).await.expect("release"));
}

/// What etcd cannot do is refused, not approximated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_requests_are_refused() {
    let fixture = start().await;
    let backend = fixture.client().await;
    let mut spec = waiting("etcd:delay", Duration::ZERO);
    spec.lock_delay = Duration::from_secs(1);
    let e = step(backend.acquire(&spec)).await.expect_err("lock-delay");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert_eq!(queue_len(&backend, "etcd:delay").await, 0);
    let forged = Lease::new("etcd:delay".to_owned(), 5, "1:5:a/b".to_owned(), LONG_TTL);
    let e = step(backend.release(&forged))
        .await
        .expect_err("forged token");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    for bad in [
        EtcdConfig::new("https://127.0.0.1:2379"),
        EtcdConfig::new("not a url"),
    ] {
        let e = EtcdBackend::connect_lazy(bad).expect_err("bad endpoint");
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    }
}

/// Several endpoints are one backend that moves to the next member when one fails:
/// a port nobody listens on is skipped at connect, and a member that stalls (a paused
/// proxy) fails one request as `Unavailable` — the next goes to the next member.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_member_hands_requests_to_the_next() {
    let fixture = start().await;
    let proxy = fencelock_testkit::Proxy::start(fixture.addrs()[0])
        .await
        .expect("proxy");
    let dead = fencelock_testkit::free_port().expect("a free port");
    let mut config = EtcdConfig::new(format!("http://127.0.0.1:{dead}"));
    config.endpoints.push(proxy.url());
    config.endpoints.push(fixture.etcd.url());
    config.request_timeout = Duration::from_secs(1);
    let backend = step(EtcdBackend::connect(config))
        .await
        .expect("connect past the dead endpoint");
    let name = "etcd:endpoints";
    let mut last = 0;
    for _ in 0..5 {
        let lease = acquire(&backend, &waiting(name, Duration::ZERO)).await;
        assert!(lease.fence > last);
        last = lease.fence;
        step(backend.renew(&lease, LONG_TTL)).await.expect("renew");
        assert!(step(backend.release(&lease)).await.expect("release"));
    }
    proxy.pause();
    let spec = waiting(name, Duration::ZERO);
    let e = step(backend.acquire(&spec))
        .await
        .expect_err("a request through the stalled member");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    // The retry (same request id) goes to the live member.
    let lease = acquire(&backend, &spec).await;
    assert!(lease.fence > last);
    assert!(step(backend.release(&lease)).await.expect("release"));
}

/// The client library over etcd: a guard renews its 2 s lease in the background and
/// keeps the lock for several ttls, then releases it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guard_keeps_the_lock_past_its_ttl() {
    let fixture = start().await;
    let client = fencelock::Client::from_backend(Arc::new(fixture.client().await));
    let other = fixture.client().await;
    let name = "etcd:guard";
    let ttl = Duration::from_secs(2);
    let guard = step(client.lock(name).ttl(ttl).acquire())
        .await
        .expect("acquire a guard");
    tokio::time::sleep(ttl * 2 + ttl / 2).await;
    assert!(!guard.is_lost(), "the guard lost its lock while renewing");
    let refused = step(other.acquire(&waiting(name, Duration::ZERO)))
        .await
        .expect_err("another client was granted a renewed lock");
    assert_eq!(refused.kind(), ErrorKind::Held, "{refused}");
    let fence = guard.fence();
    step(guard.release()).await.expect("release");
    let next = acquire(&other, &waiting(name, Duration::ZERO)).await;
    assert!(next.fence > fence);
    assert!(step(other.release(&next)).await.expect("release"));
}

/// A semaphore waiter (which watches the whole lock, not one key) is woken when any
/// holder ahead of it goes — here the older of two — and is granted with a larger
/// fence than both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphore_waiter_is_woken_by_any_holder_leaving() {
    let fixture = start().await;
    let backend = fixture.client().await;
    let name = "etcd:semaphore-wait";
    let semaphore = |wait| {
        let mut spec = waiting(name, wait);
        spec.limit = 2;
        spec
    };
    let older = acquire(&backend, &semaphore(Duration::ZERO)).await;
    let newer = acquire(&backend, &semaphore(Duration::ZERO)).await;
    let waiter = fixture.client().await;
    let task = {
        let waiter = waiter.clone();
        tokio::spawn(async move { waiter.acquire(&semaphore(STEP / 2)).await })
    };
    until("the waiter is queued", || async {
        queue_len(&backend, name).await == 3
    })
    .await;
    assert!(step(backend.release(&older)).await.expect("release"));
    let lease = step(task).await.expect("task").expect("granted");
    assert!(lease.fence > newer.fence && newer.fence > older.fence);
    assert_eq!(waiter.wakeups(), 1);
    for (client, lease) in [(&backend, &newer), (&waiter, &lease)] {
        assert!(step(client.release(lease)).await.expect("release"));
    }
}
