//! `Client::lock_all` against a real server (issue 22 item 3): overlapping sets asked
//! in opposite orders are all granted (no deadlock), one fence per name, the set is
//! lost when the server takes one of its locks, locks are released together or one
//! by one, and a store without multi-locks is refused without a lock being taken.

// Each test binary uses a different part of the support module.
use crate::support;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fencelock::{
    AcquireSpec, BoxFuture, Capabilities, Client, Error, ErrorKind, Lease, LockBackend, LostReason,
};
use support::{TestServer, STEP};

/// Rounds each of the two clients takes its set in.
const ROUNDS: u64 = 15;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_sets_in_opposite_orders_are_all_granted_with_a_fence_per_name() {
    let server = TestServer::start().await;
    assert!(server.backend().await.capabilities().multi);
    let forward = Client::new(server.backend().await);
    let backward = Client::new(server.backend().await);

    // Each client takes its set ROUNDS times, holding it across a yield so the two
    // requests overlap; one asks a, b, c and the other c, b, a.
    let take = |client: Client, names: [&'static str; 3]| {
        tokio::spawn(async move {
            let mut fences = Vec::new();
            for _ in 0..ROUNDS {
                let guard = client
                    .lock_all(names)
                    .ttl(Duration::from_secs(10))
                    .wait(STEP)
                    .acquire()
                    .await
                    .expect("the whole set, in time");
                assert_eq!(guard.names(), names);
                let got: Vec<u64> = names
                    .iter()
                    .map(|n| guard.fence(n).expect("a fence per name"))
                    .collect();
                fences.push((names, got));
                tokio::task::yield_now().await;
                assert_eq!(guard.release().await.expect("released"), [true; 3]);
            }
            fences
        })
    };
    let both = async {
        let a = take(forward, ["m:a", "m:b", "m:c"]);
        let b = take(backward, ["m:c", "m:b", "m:a"]);
        (a.await.expect("forward"), b.await.expect("backward"))
    };
    let (a, b) = tokio::time::timeout(STEP * 3, both)
        .await
        .expect("a deadlock: the two sets were not all granted in time");

    // Every grant of a name has its own fence, and they only grow.
    let mut per_name: std::collections::BTreeMap<&str, Vec<u64>> = Default::default();
    for (names, fences) in a.iter().chain(&b) {
        for (name, fence) in names.iter().zip(fences) {
            per_name.entry(name).or_default().push(*fence);
        }
    }
    for (name, mut fences) in per_name {
        let all = fences.len();
        fences.sort_unstable();
        fences.dedup();
        assert_eq!(fences.len(), all, "{name}: a fence given twice");
        assert_eq!(all as u64, 2 * ROUNDS, "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_set_is_lost_when_the_server_takes_one_of_its_locks() {
    let server = TestServer::start().await;
    let backend = server.backend().await;
    let client = Client::new(server.backend().await);
    let guard = client
        .lock_all(["f:a", "f:b"])
        .ttl(Duration::from_secs(3))
        .acquire()
        .await
        .expect("both");
    assert!(!guard.is_lost());
    let fence = guard.fence("f:b").expect("f:b held");
    assert_eq!(
        backend
            .force_release("f:b", Some(fence), "a test")
            .await
            .expect("forced"),
        [fence]
    );
    // The next renewal (a third of the ttl) finds f:b gone.
    let reason = tokio::time::timeout(STEP, guard.lost())
        .await
        .expect("lost() resolved");
    assert!(matches!(reason, LostReason::Revoked(_)), "{reason:?}");
    assert!(guard.is_lost());
    // The rest of the set is given back, not left to expire.
    support_poll(|| async {
        backend
            .get_lock("f:a")
            .await
            .err()
            .filter(|e| e.kind() == ErrorKind::NotFound)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_of_a_set_are_released_one_by_one_and_the_rest_kept() {
    let server = TestServer::start().await;
    let backend = server.backend().await;
    let client = Client::new(server.backend().await);
    let mut guard = client
        .lock_all(["r:a", "r:b", "r:c"])
        .ttl(Duration::from_secs(2))
        .acquire()
        .await
        .expect("all three");
    let fences = guard.fences();
    assert_eq!(fences.len(), 3);

    let unknown = guard
        .release_some(&["r:a", "r:x"])
        .await
        .expect_err("r:x is not in the set");
    assert_eq!(unknown.kind(), ErrorKind::InvalidArgument);
    assert_eq!(guard.names(), ["r:a", "r:b", "r:c"], "nothing released");

    assert_eq!(guard.release_some(&["r:b"]).await.expect("r:b"), [true]);
    assert_eq!(guard.names(), ["r:a", "r:c"]);
    let gone = backend.get_lock("r:b").await.expect_err("r:b released");
    assert_eq!(gone.kind(), ErrorKind::NotFound);
    // Someone else can take r:b now; the rest stay ours.
    let other = client.lock("r:b").try_acquire().await.expect("r:b is free");
    assert!(other.fence() > fences[2].1);

    // The rest are still renewed together: the server says it has held each past
    // two lease lengths (4 s; however long that takes on a loaded machine).
    for name in ["r:a", "r:c"] {
        let fence = guard.fence(name).expect("in the set");
        support::held_for(&backend, name, fence, Duration::from_secs(4)).await;
    }
    assert!(!guard.is_lost());
    for name in ["r:a", "r:c"] {
        let info = backend.get_lock(name).await.expect("still held");
        assert_eq!(
            info.holders[0].fence,
            guard.fence(name).expect("in the set")
        );
    }

    assert_eq!(guard.release_some(&["r:c"]).await.expect("r:c"), [true]);
    assert_eq!(guard.release().await.expect("the last"), [true]);
    let gone = backend.get_lock("r:a").await.expect_err("r:a released");
    assert_eq!(gone.kind(), ErrorKind::NotFound);
    other.release().await.expect("released");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_sets_are_refused_and_nothing_is_held() {
    let server = TestServer::start().await;
    let backend = server.backend().await;
    let client = Client::new(server.backend().await);
    let empty = client
        .lock_all(Vec::<String>::new())
        .acquire()
        .await
        .expect_err("an empty set");
    assert_eq!(empty.kind(), ErrorKind::InvalidArgument, "{empty}");
    let twice = client
        .lock_all(["d:a", "d:a"])
        .acquire()
        .await
        .expect_err("a name twice");
    assert_eq!(twice.kind(), ErrorKind::InvalidArgument, "{twice}");
    let held = client.lock("d:b").acquire().await.expect("d:b");
    let busy = client
        .lock_all(["d:a", "d:b"])
        .try_acquire()
        .await
        .expect_err("d:b is held");
    assert_eq!(busy.kind(), ErrorKind::Held, "{busy}");
    let waited = client
        .lock_all(["d:a", "d:b"])
        .wait(Duration::from_millis(200))
        .acquire()
        .await
        .expect_err("d:b stays held");
    assert_eq!(waited.kind(), ErrorKind::Timeout, "{waited}");
    // All or nothing: d:a was never taken.
    let free = backend.get_lock("d:a").await.expect_err("d:a untouched");
    assert_eq!(free.kind(), ErrorKind::NotFound);
    held.release().await.expect("released");
}

/// A store without multi-locks: `Unsupported`, and nothing is sent to it (taking
/// the names one at a time could deadlock, so it is never done).
#[tokio::test]
async fn a_store_without_multi_locks_is_unsupported_and_takes_nothing() {
    struct NoMulti {
        acquires: Arc<AtomicU32>,
    }
    impl LockBackend for NoMulti {
        fn capabilities(&self) -> Capabilities {
            Capabilities::new("single", fencelock::FenceGuarantee::Durable)
        }
        fn acquire<'a>(&'a self, spec: &'a AcquireSpec) -> BoxFuture<'a, Result<Lease, Error>> {
            self.acquires.fetch_add(1, Ordering::SeqCst);
            let lease = Lease::new(spec.name.clone(), 1, "t".into(), spec.ttl);
            Box::pin(async move { Ok(lease) })
        }
        fn renew<'a>(
            &'a self,
            _: &'a Lease,
            ttl: Duration,
        ) -> BoxFuture<'a, Result<Duration, Error>> {
            Box::pin(async move { Ok(ttl) })
        }
        fn release<'a>(&'a self, _: &'a Lease) -> BoxFuture<'a, Result<bool, Error>> {
            Box::pin(async { Ok(true) })
        }
    }
    let acquires = Arc::new(AtomicU32::new(0));
    let client = Client::new(NoMulti {
        acquires: acquires.clone(),
    });
    assert!(!client.capabilities().multi);
    let err = client
        .lock_all(["u:a", "u:b"])
        .acquire()
        .await
        .expect_err("no multi-locks");
    assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
    assert_eq!(acquires.load(Ordering::SeqCst), 0, "a lock was taken");
}

/// Polls `check` until it gives `Some`, within [`STEP`].
async fn support_poll<T, F, Fut>(mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    tokio::time::timeout(STEP, async {
        loop {
            if let Some(v) = check().await {
                return v;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("not within {STEP:?}"))
}
