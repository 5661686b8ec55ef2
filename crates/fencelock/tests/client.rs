//! The client library against a real fencelock server: acquisition, renewal, the
//! lost-lock signal under a partition, `with_lock`, release on drop, retries.

use crate::support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use fencelock::{
    AcquireSpec, Client, ErrorKind, FenceGuarantee, LockBackend, LockOptions, LostReason,
    ServerConfig,
};
use fencelock_proto::EventKind;
use support::{next_event, watch_all, Counting, Proxy, TestServer, STEP};
use tokio::time::{timeout, Instant};

const SHORT_TTL: Duration = Duration::from_millis(600);

async fn client(server: &TestServer) -> Client {
    Client::connect(&server.url()).await.unwrap()
}

#[tokio::test]
async fn acquire_try_acquire_release_and_fences_grow() {
    let server = TestServer::start().await;
    let client = client(&server).await;

    let first = client.lock("job:a").owner("one").acquire().await.unwrap();
    assert_eq!(first.name(), "job:a");
    assert_eq!(first.owner_token().len(), 32);

    let held = client.lock("job:a").try_acquire().await.unwrap_err();
    assert_eq!(held.kind(), ErrorKind::Held, "{held}");

    let fence = first.fence();
    assert!(first.release().await.unwrap(), "release says it released");

    let second = client.lock("job:a").try_acquire().await.unwrap();
    assert!(second.fence() > fence, "{} > {fence}", second.fence());
    second.release().await.unwrap();

    let caps = client.capabilities();
    assert_eq!(caps.backend, "fencelock");
    assert_eq!(caps.fences, FenceGuarantee::Durable);
    assert!(caps.fifo && caps.push_wakeups && caps.semaphores);
}

#[tokio::test]
async fn a_waiter_gets_the_lock_when_the_holder_releases() {
    let server = TestServer::start().await;
    let client = client(&server).await;
    let holder = client.lock("q").acquire().await.unwrap();
    let fence = holder.fence();

    let waiter = tokio::spawn({
        let client = client.clone();
        async move { client.lock("q").wait(STEP).acquire().await }
    });
    // The waiter is queued on the server before the holder lets go.
    let mut raw = server.raw().await;
    timeout(STEP, async {
        loop {
            let info = raw
                .get_lock(fencelock_proto::GetLockRequest { name: "q".into() })
                .await
                .unwrap()
                .into_inner();
            if info.waiters == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap();
    holder.release().await.unwrap();
    let next = timeout(STEP, waiter).await.unwrap().unwrap().unwrap();
    assert!(next.fence() > fence);
}

#[tokio::test]
async fn waiting_past_the_budget_is_a_timeout() {
    let server = TestServer::start().await;
    let client = client(&server).await;
    let _holder = client.lock("busy").acquire().await.unwrap();
    let err = client
        .lock("busy")
        .wait(Duration::from_millis(50))
        .acquire()
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
}

#[tokio::test]
async fn semaphore_admits_limit_holders_each_with_its_own_fence() {
    let server = TestServer::start().await;
    let client = client(&server).await;
    let a = client.lock("pool").limit(2).acquire().await.unwrap();
    let b = client.lock("pool").limit(2).acquire().await.unwrap();
    assert_ne!(a.fence(), b.fence());
    let third = client
        .lock("pool")
        .limit(2)
        .try_acquire()
        .await
        .unwrap_err();
    assert_eq!(third.kind(), ErrorKind::Held);
    let mismatch = client
        .lock("pool")
        .limit(3)
        .try_acquire()
        .await
        .unwrap_err();
    assert_eq!(mismatch.kind(), ErrorKind::LimitMismatch);
}

#[tokio::test]
async fn bad_input_is_invalid_argument_and_checked_before_sending() {
    let server = TestServer::start().await;
    let client = client(&server).await;
    let cases = [
        (client.lock(""), "empty name"),
        (client.lock("x").ttl(Duration::ZERO), "zero ttl"),
        (client.lock("x").limit(0), "zero limit"),
        (
            client.lock("x").safety_margin(Duration::from_secs(60)),
            "margin ≥ ttl",
        ),
        (client.lock("bad\u{7}name"), "control character"),
    ];
    for (request, what) in cases {
        let err = request.try_acquire().await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{what}: {err}");
    }
}

#[tokio::test]
async fn renewal_keeps_the_lock_past_its_ttl() {
    let server = TestServer::start().await;
    let client = client(&server).await;
    let guard = client.lock("long").ttl(SHORT_TTL).acquire().await.unwrap();
    support::held_for(
        &server.backend().await,
        "long",
        guard.fence(),
        SHORT_TTL * 3,
    )
    .await;
    assert!(guard.valid_for().is_some(), "still held after 3 TTLs");
    let other = client.lock("long").try_acquire().await.unwrap_err();
    assert_eq!(other.kind(), ErrorKind::Held, "renewed lock is still held");
    assert!(guard.release().await.unwrap());
}

/// The central promise: a holder cut off from the server is told its lock is lost
/// before the server can expire the lease, and the next holder's fence is larger.
/// (Regression guard: a deadline counted from the *receipt* of the grant, or with the
/// margin added instead of subtracted, fires after the expiry and fails here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_holder_is_told_before_the_server_expires_it() {
    let server = TestServer::start().await;
    let proxy = Proxy::start(server.addr()).await.unwrap();
    let mut events = watch_all(&server).await;
    let cut_off = Client::connect(&proxy.url()).await.unwrap();
    let guard = cut_off
        .lock("inv:1")
        .ttl(Duration::from_secs(1))
        .safety_margin(Duration::from_millis(300))
        .acquire()
        .await
        .unwrap();
    let fence = guard.fence();
    next_event(&mut events, EventKind::Granted).await;

    // Both instants are taken by tasks that wait for their event concurrently.
    let expired = tokio::spawn(async move {
        let event = next_event(&mut events, EventKind::Expired).await;
        (event, Instant::now())
    });
    let lost = tokio::spawn({
        let lost = guard.lost();
        async move { (lost.await, Instant::now()) }
    });
    proxy.pause();

    let (reason, lost_at) = timeout(STEP, lost).await.unwrap().unwrap();
    assert!(matches!(reason, LostReason::DeadlineReached), "{reason:?}");
    assert!(guard.is_lost());
    let (event, expired_seen_at) = timeout(STEP, expired).await.unwrap().unwrap();
    assert_eq!(event.fence, Some(fence));
    assert!(
        lost_at < expired_seen_at,
        "lost() must fire before the server expires the lease ({:?} after)",
        lost_at - expired_seen_at
    );

    let next = client(&server).await.lock("inv:1").acquire().await.unwrap();
    assert!(next.fence() > fence);
}

#[tokio::test]
async fn force_release_is_reported_as_revoked_at_the_next_renewal() {
    let server = TestServer::start().await;
    let client = client(&server).await;
    let guard = client.lock("ops").ttl(SHORT_TTL).acquire().await.unwrap();
    let admin = server.backend().await;
    let taken = admin.force_release("ops", None, "test").await.unwrap();
    assert_eq!(taken, vec![guard.fence()]);
    let reason = timeout(STEP, guard.lost()).await.unwrap();
    match reason {
        LostReason::Revoked(e) => assert_eq!(e.kind(), ErrorKind::NotHeld, "{e}"),
        other => panic!("expected Revoked, got {other:?}"),
    }
    assert!(!guard.release().await.unwrap(), "nothing left to release");
}

#[tokio::test]
async fn with_lock_cancels_the_work_when_the_lock_is_lost() {
    let server = TestServer::start().await;
    let client = client(&server).await;
    let admin = server.backend().await;
    let (started, is_started) = tokio::sync::oneshot::channel();
    let dropped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    struct SetOnDrop(std::sync::Arc<std::sync::atomic::AtomicBool>);
    impl Drop for SetOnDrop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let flag = SetOnDrop(dropped.clone());
    let work = client.with_lock(
        "cancel-me",
        LockOptions::default().ttl(SHORT_TTL),
        async |guard| {
            let _flag = flag;
            started.send(guard.fence()).unwrap();
            std::future::pending::<()>().await;
            "finished"
        },
    );
    let killer = async {
        is_started.await.unwrap();
        admin
            .force_release("cancel-me", None, "test")
            .await
            .unwrap();
    };
    let (result, ()) = timeout(STEP, async { tokio::join!(work, killer) })
        .await
        .unwrap();
    let err = result.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::LockLost, "{err}");
    assert!(
        dropped.load(Ordering::SeqCst),
        "the work future was dropped"
    );
}

#[tokio::test]
async fn with_lock_returns_the_work_and_releases() {
    let server = TestServer::start().await;
    let client = client(&server).await;
    let mut events = watch_all(&server).await;
    let out = client
        .with_lock("w", LockOptions::default(), async |guard| guard.fence() * 2)
        .await
        .unwrap();
    let granted = next_event(&mut events, EventKind::Granted).await;
    assert_eq!(out, granted.fence.unwrap() * 2);
    let released = next_event(&mut events, EventKind::Released).await;
    assert_eq!(released.fence, granted.fence);
}

#[tokio::test]
async fn no_renewals_after_release_or_drop_and_drop_releases() {
    let server = TestServer::start().await;
    let counting = Counting::new(server.backend().await);
    let renews = counting.renews.clone();
    let releases = counting.releases.clone();
    let client = Client::new(counting);
    let mut events = watch_all(&server).await;

    // Explicit release.
    let guard = client.lock("r").ttl(SHORT_TTL).acquire().await.unwrap();
    timeout(STEP, async {
        while renews.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("renewed while held");
    guard.release().await.unwrap();
    let after_release = renews.load(Ordering::SeqCst);

    // Drop without release: released in the background (a RELEASED event, not an
    // expiry), then silence.
    let guard = client.lock("d").ttl(SHORT_TTL).acquire().await.unwrap();
    let fence = guard.fence();
    let renews_before_drop = renews.load(Ordering::SeqCst);
    drop(guard);
    let released = timeout(STEP, async {
        loop {
            let e = next_event(&mut events, EventKind::Released).await;
            if e.name == "d" {
                return e;
            }
        }
    })
    .await
    .unwrap();
    assert_eq!(released.fence, Some(fence));
    assert_eq!(releases.load(Ordering::SeqCst), 2);

    tokio::time::sleep(SHORT_TTL * 2).await;
    assert_eq!(
        renews.load(Ordering::SeqCst),
        renews_before_drop,
        "no renewal after drop"
    );
    assert!(renews_before_drop >= after_release);
    assert_eq!(
        after_release, renews_before_drop,
        "no renewal after release"
    );
}

#[test]
fn dropping_a_guard_outside_a_runtime_does_not_panic() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (guard, server) = runtime.block_on(async {
        let server = TestServer::start().await;
        let client = client(&server).await;
        (client.lock("outside").acquire().await.unwrap(), server)
    });
    let handle = std::thread::spawn(move || drop(guard));
    handle.join().expect("drop on a thread without a runtime");
    runtime.block_on(async move { server.server.shutdown().await.unwrap() });
}

#[tokio::test]
async fn unreachable_server_is_unavailable() {
    // A port that was just free: nothing listens on it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let err = Client::connect(&format!("http://127.0.0.1:{port}"))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    let err = Client::connect("not a url").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
}

/// Transient failures are retried (with backoff) within the wait budget.
#[tokio::test]
async fn acquire_retries_while_the_server_is_unreachable() {
    let server = TestServer::start().await;
    let proxy = Proxy::start(server.addr()).await.unwrap();
    let mut config = ServerConfig::new(proxy.url());
    config.request_timeout = Duration::from_millis(200);
    let client = Client::connect_with(config).await.unwrap();
    proxy.pause();
    let acquire = tokio::spawn({
        let client = client.clone();
        async move { client.lock("retry").wait(STEP).acquire().await }
    });
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(!acquire.is_finished(), "still retrying while cut off");
    proxy.resume();
    let guard = timeout(STEP, acquire).await.unwrap().unwrap().unwrap();
    // Only one grant was made, whatever the retries: the lock shows one holder.
    let info = server.backend().await.get_lock("retry").await.unwrap();
    assert_eq!(info.holders.len(), 1);
    assert_eq!(info.holders[0].fence, guard.fence());
}

#[tokio::test]
async fn a_retried_request_id_returns_the_same_grant() {
    let server = TestServer::start().await;
    let backend = server.backend().await;
    let spec = {
        let mut s = AcquireSpec::new("idem", Duration::from_secs(5));
        s.request_id = "req-1".into();
        s
    };
    let first = backend.acquire(&spec).await.unwrap();
    let again = backend.acquire(&spec).await.unwrap();
    assert_eq!(first, again);
}

#[tokio::test]
async fn reads_and_watch_through_the_backend() {
    let server = TestServer::start().await;
    let backend = server.backend().await;
    let mut events = backend.watch("app:").await.unwrap();
    let client = Client::new(backend.clone());
    let guard = client.lock("app:x").owner("me").acquire().await.unwrap();
    let event = timeout(STEP, events.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(event.kind, fencelock::EventKind::Granted);
    assert_eq!(event.name, "app:x");
    let info = backend.get_lock("app:x").await.unwrap();
    assert_eq!(info.holders[0].owner, "me");
    let page = backend.list_locks("app:", None, 0).await.unwrap();
    assert_eq!(page.locks.len(), 1);
    guard.release().await.unwrap();
    let gone = backend.get_lock("app:x").await.unwrap_err();
    assert_eq!(gone.kind(), ErrorKind::NotFound);
}

/// A watch event carries the fields of the one vocabulary: a direct grant and a
/// hand-off are both `Granted`, told apart by `handoff`; each has its mode and the
/// wall-clock `time_ms`.
#[tokio::test]
async fn watch_events_tell_a_handoff_from_a_direct_grant() {
    let server = TestServer::start().await;
    let backend = server.backend().await;
    let mut events = backend.watch("h:").await.unwrap();
    let client = Client::new(backend.clone());
    let mut first = Some(client.lock("h:x").owner("first").acquire().await.unwrap());
    let waiter = tokio::spawn({
        let client = client.clone();
        async move {
            client
                .lock("h:x")
                .owner("second")
                .mode(fencelock::LockMode::Shared)
                .wait(STEP)
                .acquire()
                .await
        }
    });
    let mut grants = Vec::new();
    while grants.len() < 2 {
        let event = timeout(STEP, events.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if event.kind == fencelock::EventKind::Queued {
            first.take().unwrap().release().await.unwrap();
        }
        if event.kind == fencelock::EventKind::Granted {
            assert!(event.time_ms > 1_700_000_000_000, "{event:?}");
            grants.push((event.owner, event.handoff, event.mode));
        }
    }
    let second = waiter.await.unwrap().unwrap();
    assert_eq!(
        grants,
        [
            (
                "first".to_owned(),
                false,
                Some(fencelock::LockMode::Exclusive)
            ),
            ("second".to_owned(), true, Some(fencelock::LockMode::Shared)),
        ]
    );
    second.release().await.unwrap();
}

/// The connection is re-established after the server restarts (same address, same
/// data): the guard keeps its lock through the restart (a restart gives every lease
/// its full TTL again), renewals resume, and new requests work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guard_survives_a_server_restart_and_the_client_reconnects() {
    let server = TestServer::start().await;
    let addr = server.addr();
    let TestServer { server, dir } = server;
    let client = Client::connect(&format!("http://{addr}")).await.unwrap();
    let guard = client
        .lock("restart")
        .ttl(Duration::from_secs(4))
        .acquire()
        .await
        .unwrap();
    server.shutdown().await.unwrap();
    let config =
        fencelock_server::ServerConfig::new(addr, fencelock_server::EngineConfig::new(dir.path()));
    let server = fencelock_server::Server::start(config).await.unwrap();
    // Renewed past its lease after the restart (the server says it has held it a
    // lease length since it came back; a restart gives every lease its full TTL
    // again): still valid and still the holder.
    support::held_for(
        &support::TestServer::backend_at(addr).await,
        "restart",
        guard.fence(),
        Duration::from_secs(4),
    )
    .await;
    assert!(guard.valid_for().is_some(), "lost across a quick restart");
    let busy = client.lock("restart").try_acquire().await.unwrap_err();
    assert_eq!(busy.kind(), ErrorKind::Held);
    assert!(guard.release().await.unwrap());
    server.shutdown().await.unwrap();
}

/// Regression: a waiter granted after waiting about a lease length used to get a
/// `LockLost` error, because its deadline counted from the acquire's send instant. The
/// grant is now confirmed by a renewal and handed out with a fresh deadline.
#[tokio::test]
async fn a_waiter_granted_after_more_than_a_ttl_gets_a_valid_guard() {
    let server = TestServer::start().await;
    let backend = server.backend().await;
    // A holder that never renews: its 1 s lease expires while the waiter waits.
    let stale = backend
        .acquire(&AcquireSpec::new("slow", Duration::from_secs(1)))
        .await
        .unwrap();
    let client = client(&server).await;
    let guard = client
        .lock("slow")
        .ttl(Duration::from_millis(800))
        .wait(STEP)
        .acquire()
        .await
        .expect("granted after the holder's lease expired");
    assert!(guard.fence() > stale.fence);
    assert!(guard.valid_for().is_some());
    // And it is renewed like any other guard: held past two lease lengths.
    support::held_for(&backend, "slow", guard.fence(), Duration::from_millis(1600)).await;
    assert!(guard.valid_for().is_some(), "renewed after the late grant");
    assert!(guard.release().await.unwrap());
}

/// Polls the server until `name` has `waiters` waiters (or the step times out).
async fn until_waiters(server: &TestServer, name: &str, waiters: u64) {
    let mut raw = server.raw().await;
    timeout(STEP, async {
        loop {
            let info = raw
                .get_lock(fencelock_proto::GetLockRequest { name: name.into() })
                .await
                .unwrap()
                .into_inner();
            if info.waiters == waiters {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{name} never had {waiters} waiters"));
}

#[tokio::test]
async fn a_dropped_acquire_leaves_the_queue_on_either_transport() {
    let server = TestServer::start().await;
    for transport in [fencelock::Transport::Wire, fencelock::Transport::Grpc] {
        let mut config = ServerConfig::new(server.url());
        config.transport = transport;
        let client = Client::connect_with(config).await.unwrap();
        let name = format!("dropped-{transport:?}");
        let holder = client.lock(&name).acquire().await.unwrap();
        let waiting = tokio::spawn({
            let client = client.clone();
            let name = name.clone();
            async move { client.lock(name).wait(STEP).acquire().await }
        });
        until_waiters(&server, &name, 1).await;
        // Dropping the acquire (here: aborting its task) takes it out of the queue, so
        // the lock is not handed to nobody when the holder lets go.
        waiting.abort();
        until_waiters(&server, &name, 0).await;
        let fence = holder.fence();
        holder.release().await.unwrap();
        let next = client.lock(&name).try_acquire().await.unwrap();
        assert!(next.fence() > fence, "{transport:?}");
    }
}

#[tokio::test]
async fn a_server_without_the_wire_protocol_is_spoken_to_over_grpc() {
    // The server's own routes (HTTP/JSON and gRPC) served by plain axum, which
    // answers the wire protocol's magic with an HTTP error, as servers before `flw/1`
    // did.
    let dir = tempfile::tempdir().unwrap();
    let handle =
        fencelock_server::engine::start(fencelock_server::EngineConfig::new(dir.path())).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let auth = fencelock_server::auth::Authenticator::new(&Default::default(), None).unwrap();
    let router = fencelock_server::secure_app(handle, auth, &Default::default());
    let serving = tokio::spawn(async move { axum::serve(listener, router).await });
    for connect in ["eager", "lazy"] {
        let config = ServerConfig::new(url.clone());
        let client = match connect {
            "eager" => Client::connect_with(config).await.unwrap(),
            _ => Client::new(fencelock::FencelockBackend::connect_lazy(config).unwrap()),
        };
        let name = format!("old-server-{connect}");
        let first = client.lock(&name).acquire().await.unwrap();
        let held = client.lock(&name).try_acquire().await.unwrap_err();
        assert_eq!(held.kind(), ErrorKind::Held, "{held}");
        let fence = first.fence();
        assert!(first.release().await.unwrap());
        let second = client.lock(&name).try_acquire().await.unwrap();
        assert!(second.fence() > fence);
        second.release().await.unwrap();
    }
    serving.abort();
}
