//! Sessions in the client against a real fencelock server: many locks under one
//! keep-alive, every guard told when the session is lost (ended on the server, or cut
//! off by a partition before the server can expire it), close and drop, waiting
//! forever, and a store without sessions.

use crate::support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use fencelock::{
    AcquireSpec, BoxFuture, Capabilities, Client, Error, ErrorKind, Lease, LockBackend,
    LockOptions, LostReason,
};
use fencelock_proto::EventKind;
use support::{next_event, watch_all, Counting, Proxy, TestServer, STEP};
use tokio::time::{timeout, Instant};

async fn client(server: &TestServer) -> Client {
    Client::connect(&server.url()).await.unwrap()
}

/// `DELETE /v1/admin/sessions/{handle}` over plain HTTP/1.1; the whole answer.
async fn admin_close_session(server: &TestServer, handle: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(server.addr()).await.unwrap();
    let request = format!(
        "DELETE /v1/admin/sessions/{handle} HTTP/1.1\r\nHost: localhost\r\n\
         Connection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    timeout(STEP, stream.read_to_string(&mut answer))
        .await
        .unwrap()
        .unwrap();
    answer
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

/// Fifty locks under one session: one keep-alive keeps them all, no guard renews on
/// its own, and every lock is still held after several session TTLs. (Caught planted:
/// session guards started as ordinary guards, with their own lease and renewal; and a
/// keep-alive per guard.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_locks_under_one_session_share_one_keep_alive() {
    let server = TestServer::start().await;
    let counting = Counting::new(server.backend().await);
    let (renews, keep_alives) = (counting.renews.clone(), counting.keep_alives.clone());
    let client = Client::new(counting);
    let ttl = Duration::from_millis(900);
    let session = client.session(ttl).owner("worker").await.unwrap();
    let mut guards = Vec::new();
    for i in 0..50 {
        guards.push(session.lock(format!("s50:{i}")).acquire().await.unwrap());
    }
    // Four keep-alives (one every ttl/3) cover more than a whole session TTL.
    timeout(STEP, async {
        while keep_alives.load(Ordering::SeqCst) < 4 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap();
    let backend = server.backend().await;
    let page = backend.list_locks("s50:", None, 100).await.unwrap();
    assert_eq!(page.locks.len(), 50, "every lock is still held");
    for guard in &guards {
        // Held, and for no longer than the session is: the session's lease is theirs.
        let left = guard.valid_for().expect("held");
        assert!(left <= ttl, "{}: valid for {left:?}", guard.name());
    }
    assert_eq!(
        renews.load(Ordering::SeqCst),
        0,
        "no guard renews by itself"
    );
    let sent = keep_alives.load(Ordering::SeqCst);
    assert!(sent < 10, "{sent} keep-alives for one session");
    assert_eq!(session.close().await.unwrap(), 50);
}

/// A lock taken under a session is held under it on the server (its holder names the
/// session), whichever transport carries the acquire.
#[tokio::test]
async fn a_session_lock_is_held_under_the_session_over_either_transport() {
    let server = TestServer::start().await;
    let backend = server.backend().await;
    for transport in [fencelock::Transport::Wire, fencelock::Transport::Grpc] {
        let config = fencelock::ServerConfig::new(server.url()).transport(transport);
        let client = Client::connect_with(config).await.unwrap();
        let session = client
            .session(Duration::from_secs(5))
            .owner("tx")
            .await
            .unwrap();
        let name = format!("tx:{transport:?}");
        let guard = session.lock(&name).acquire().await.unwrap();
        let info = backend.get_lock(&name).await.unwrap();
        assert_eq!(info.holders.len(), 1);
        assert_eq!(info.holders[0].fence, guard.fence());
        assert_eq!(info.holders[0].owner, "tx", "the session's owner");
        assert!(info.holders[0].session.is_some(), "{transport:?}: {info:?}");
        assert_eq!(session.close().await.unwrap(), 1, "{transport:?}");
    }
}

/// The issue's test: an operator closes the session on the server (`DELETE
/// /v1/admin/sessions/{handle}`), the next keep-alive is refused, and every guard
/// under the session reports `lost()` with that refusal. (Caught planted: guards that
/// do not follow the session's state never fire.)
#[tokio::test]
async fn a_session_ended_on_the_server_fires_every_guards_lost() {
    let server = TestServer::start().await;
    let client = client(&server).await;
    let session = client
        .session(Duration::from_millis(900))
        .await
        .expect("session");
    let mut guards = Vec::new();
    for i in 0..5 {
        guards.push(session.lock(format!("end:{i}")).acquire().await.unwrap());
    }
    // The operator finds the session's handle on a lock it holds and closes it.
    let info = server.backend().await.get_lock("end:0").await.unwrap();
    let handle = info.holders[0].session.clone().expect("session-held");
    let answer = admin_close_session(&server, &handle).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains(r#""released":5"#), "{answer}");
    for guard in &guards {
        match timeout(STEP, guard.lost()).await.unwrap() {
            LostReason::Revoked(e) => assert_eq!(e.kind(), ErrorKind::SessionNotFound, "{e}"),
            other => panic!("{}: expected Revoked, got {other:?}", guard.name()),
        }
        assert!(guard.is_lost());
    }
    assert!(matches!(
        timeout(STEP, session.lost()).await.unwrap(),
        LostReason::Revoked(_)
    ));
    // Nothing is left to close.
    assert_eq!(session.close().await.unwrap(), 0);
}

/// A session cut off from the server: every guard under it reports `lost()` before the
/// server expires the session (and with it the locks). (Caught planted: the guards'
/// deadline counted from the grant's arrival instead of the session's keep-alive; and
/// with the safety margin added instead of subtracted.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_session_is_lost_on_every_guard_before_the_server_expires_it() {
    let server = TestServer::start().await;
    let proxy = Proxy::start(server.addr()).await.unwrap();
    let mut events = watch_all(&server).await;
    let cut_off = Client::connect(&proxy.url()).await.unwrap();
    let session = cut_off
        .session(Duration::from_secs(1))
        .safety_margin(Duration::from_millis(300))
        .await
        .unwrap();
    let mut guards = Vec::new();
    for i in 0..3 {
        let guard = session.lock(format!("cut:{i}")).acquire().await.unwrap();
        next_event(&mut events, EventKind::Granted).await;
        guards.push(guard);
    }
    let expired = tokio::spawn(async move {
        let event = next_event(&mut events, EventKind::Expired).await;
        (event, Instant::now())
    });
    let lost: Vec<_> = guards
        .iter()
        .map(|g| {
            let lost = g.lost();
            tokio::spawn(async move { (lost.await, Instant::now()) })
        })
        .collect();
    proxy.pause();
    let (event, expired_at) = timeout(STEP, expired).await.unwrap().unwrap();
    assert!(event.name.starts_with("cut:"), "{event:?}");
    for (guard, lost) in guards.iter().zip(lost) {
        let (reason, lost_at) = timeout(STEP, lost).await.unwrap().unwrap();
        assert!(
            matches!(reason, LostReason::DeadlineReached),
            "{}: {reason:?}",
            guard.name()
        );
        assert!(
            lost_at < expired_at,
            "{}: lost() must fire before the server expires the session ({:?} after)",
            guard.name(),
            lost_at - expired_at
        );
    }
    assert!(session.is_lost());
}

/// Closing releases every lock under the session and their guards report `Released`;
/// a guard dropped under a live session releases only its own lock.
#[tokio::test]
async fn close_releases_every_lock_and_a_dropped_guard_releases_its_own() {
    let server = TestServer::start().await;
    let client = client(&server).await;
    let mut events = watch_all(&server).await;
    let session = client.session(Duration::from_secs(5)).await.unwrap();
    let kept = session.lock("close:kept").acquire().await.unwrap();
    let dropped = session.lock("close:dropped").acquire().await.unwrap();
    assert_eq!(kept.lease().ttl, session.lease().ttl, "the session's lease");
    let fence = dropped.fence();
    drop(dropped);
    let released = next_event(&mut events, EventKind::Released).await;
    assert_eq!(released.fence, Some(fence));
    assert!(kept.valid_for().is_some(), "the other lock is still held");

    assert_eq!(session.close().await.unwrap(), 1);
    assert!(matches!(
        timeout(STEP, kept.lost()).await.unwrap(),
        LostReason::Released
    ));
    let taken = client.lock("close:kept").try_acquire().await.unwrap();
    assert!(taken.fence() > kept.fence());
}

/// Dropping the session handle closes it only once the guards under it are gone too.
#[tokio::test]
async fn a_dropped_session_closes_once_its_guards_are_dropped() {
    let server = TestServer::start().await;
    let client = client(&server).await;
    let mut events = watch_all(&server).await;
    let session = client.session(Duration::from_secs(30)).await.unwrap();
    let guard = session.lock("drop:a").acquire().await.unwrap();
    let lost = guard.lost();
    drop(session);
    // Still alive: the guard keeps the session open.
    let busy = client.lock("drop:a").try_acquire().await.unwrap_err();
    assert_eq!(busy.kind(), ErrorKind::Held);
    assert!(guard.valid_for().is_some());
    let fence = guard.fence();
    drop(guard);
    // Released (by the guard's drop or the session's close), long before 30 s.
    let released = next_event(&mut events, EventKind::Released).await;
    assert_eq!(released.fence, Some(fence));
    assert!(matches!(
        timeout(STEP, lost).await.unwrap(),
        LostReason::Released
    ));
    // The session itself is gone on the server: nothing of it is listed.
    timeout(STEP, async {
        loop {
            let page = server
                .backend()
                .await
                .list_locks("", None, 0)
                .await
                .unwrap();
            if page.locks.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap();
}

/// `wait(Duration::MAX)` waits (there is no deadline arithmetic to overflow) and gets
/// the lock when the holder releases it, with and without a session. (Caught planted:
/// `Instant::now() + wait` panics with an overflow.)
#[tokio::test]
async fn waiting_forever_gets_the_lock_when_it_is_released() {
    let server = TestServer::start().await;
    let client = client(&server).await;
    let session = client.session(Duration::from_secs(5)).await.unwrap();
    for (i, in_session) in [false, true].into_iter().enumerate() {
        let name = format!("forever:{i}");
        let holder = client.lock(&name).acquire().await.unwrap();
        let request = if in_session {
            session.lock(&name).wait(Duration::MAX)
        } else {
            client
                .lock(&name)
                .options(LockOptions::default().wait_forever())
        };
        let waiting = tokio::spawn(request.acquire());
        until_waiters(&server, &name, 1).await;
        let fence = holder.fence();
        holder.release().await.unwrap();
        let guard = timeout(STEP, waiting).await.unwrap().unwrap().unwrap();
        assert!(guard.fence() > fence, "{name}");
        assert!(guard.valid_for().is_some());
    }
}

/// A wait too long for one request is refused as bad input, not overflowed, by the
/// server (the client splits a longer wait into calls of at most an hour).
#[tokio::test]
async fn the_server_refuses_a_wait_beyond_its_bound_as_bad_input() {
    let server = TestServer::start().await;
    let mut raw = server.raw().await;
    let status = raw
        .acquire(fencelock_proto::AcquireRequest {
            name: "huge-wait".into(),
            ttl_ms: Some(1000),
            wait_ms: u64::MAX,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert_eq!(
        fencelock_proto::error_code(&status),
        Some("invalid_argument")
    );
    // Nothing was queued or granted.
    let mut raw = server.raw().await;
    let info = raw
        .get_lock(fencelock_proto::GetLockRequest {
            name: "huge-wait".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(info.code(), tonic::Code::NotFound);
}

/// A store without sessions says so.
#[tokio::test]
async fn a_store_without_sessions_is_unsupported() {
    struct NoSessions;
    impl LockBackend for NoSessions {
        fn capabilities(&self) -> Capabilities {
            Capabilities::new("none", fencelock::FenceGuarantee::None)
        }
        fn acquire<'a>(&'a self, _: &'a AcquireSpec) -> BoxFuture<'a, Result<Lease, Error>> {
            Box::pin(async { Err(Error::new(ErrorKind::Internal, "not used")) })
        }
        fn renew<'a>(
            &'a self,
            _: &'a Lease,
            _: Duration,
        ) -> BoxFuture<'a, Result<Duration, Error>> {
            Box::pin(async { Err(Error::new(ErrorKind::Internal, "not used")) })
        }
        fn release<'a>(&'a self, _: &'a Lease) -> BoxFuture<'a, Result<bool, Error>> {
            Box::pin(async { Ok(false) })
        }
    }
    let client = Client::new(NoSessions);
    let err = client.session(Duration::from_secs(5)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
    let bad = client.session(Duration::ZERO).await.unwrap_err();
    assert_eq!(bad.kind(), ErrorKind::InvalidArgument, "{bad}");
}
