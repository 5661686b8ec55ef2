//! The fencelock server backend's lock kinds: shared acquires, downgrade,
//! elections and multi-locks, against a real server.

// Each test binary uses a different part of the support module.
use crate::support;

use std::time::Duration;

use fencelock::{AcquireSpec, ErrorKind, LockBackend, LockMode};
use support::TestServer;

fn spec(name: &str) -> AcquireSpec {
    AcquireSpec::new(name, Duration::from_secs(30))
}

fn shared(name: &str) -> AcquireSpec {
    let mut s = spec(name);
    s.mode = LockMode::Shared;
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_acquires_downgrade_and_elections_through_the_backend() {
    let server = TestServer::start().await;
    let backend = server.backend().await;
    let caps = backend.capabilities();
    assert!(caps.shared && caps.downgrade && caps.elections);

    // Two readers hold together; a writer is refused (it would otherwise have been
    // granted exclusively if the mode were dropped on the way).
    let r1 = backend.acquire(&shared("b:rw")).await.expect("a reader");
    let r2 = backend
        .acquire(&shared("b:rw"))
        .await
        .expect("a second reader");
    assert!(r2.fence > r1.fence);
    let writer = backend
        .acquire(&spec("b:rw"))
        .await
        .expect_err("readers hold it");
    assert_eq!(writer.kind(), ErrorKind::Held);

    let w = backend.acquire(&spec("b:w")).await.expect("a writer");
    backend.downgrade(&w).await.expect("downgraded");
    backend
        .acquire(&shared("b:w"))
        .await
        .expect("a reader joins the downgraded writer");

    assert_eq!(backend.leader("b:e").await.expect("asked"), None);
    let lead = backend
        .campaign(&spec("b:e"), "host-1")
        .await
        .expect("leading");
    backend
        .proclaim(&lead, "host-1b")
        .await
        .expect("proclaimed");
    let leader = backend
        .leader("b:e")
        .await
        .expect("asked")
        .expect("a leader");
    assert_eq!(
        (leader.value.as_str(), leader.term),
        ("host-1b", lead.fence)
    );
    let long = "v".repeat(4097);
    let refused = backend.proclaim(&lead, &long).await.expect_err("too long");
    assert_eq!(refused.kind(), ErrorKind::InvalidArgument);
    backend.release(&lead).await.expect("resigned");
    let stale = backend
        .proclaim(&lead, "late")
        .await
        .expect_err("not leading");
    assert_eq!(stale.kind(), ErrorKind::NotHeld);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_all_is_all_or_nothing_and_releases_together() {
    let server = TestServer::start().await;
    let backend = server.backend().await;
    let held = backend.acquire(&spec("b:y")).await.expect("held");
    let refused = backend
        .acquire_all(&["b:x", "b:y"], &spec("unused"))
        .await
        .expect_err("b:y is held");
    assert_eq!(refused.kind(), ErrorKind::Held);
    backend.release(&held).await.expect("released");
    let leases = backend
        .acquire_all(&["b:y", "b:x"], &spec("unused"))
        .await
        .expect("both");
    let names: Vec<&str> = leases.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["b:y", "b:x"]);
    assert!(leases[1].fence > leases[0].fence);
    let released = backend.release_all(&leases).await.expect("released");
    assert_eq!(released, [true, true]);

    // Under a session, every lock of the set is held by the session.
    let session = backend
        .open_session(Duration::from_secs(30), "set")
        .await
        .expect("a session");
    let mut under = spec("unused");
    under.session = Some(session.id.clone());
    let leases = backend
        .acquire_all(&["b:s1", "b:s2"], &under)
        .await
        .expect("both under the session");
    for lease in &leases {
        let info = backend.get_lock(&lease.name).await.expect("read");
        assert!(info.holders[0].session.is_some(), "{info:?}");
    }
    assert_eq!(backend.close_session(&session).await.expect("closed"), 2);
}

/// The generic client layer (`LockRequest::mode`, `LockGuard::downgrade`,
/// `Client::election`) over the server backend, and a shared lock held under a
/// session: the acquire carries both the session and the mode, over either
/// transport.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_layer_takes_modes_downgrades_and_elects_through_the_server() {
    use fencelock::Client;
    let server = TestServer::start().await;
    let client = Client::new(server.backend().await);

    let r1 = client
        .lock("c:rw")
        .shared()
        .acquire()
        .await
        .expect("a reader");
    let r2 = client
        .lock("c:rw")
        .mode(LockMode::Shared)
        .acquire()
        .await
        .expect("a second reader");
    assert!(r2.fence() > r1.fence());
    let writer = client
        .lock("c:rw")
        .try_acquire()
        .await
        .expect_err("readers hold it");
    assert_eq!(writer.kind(), ErrorKind::Held);

    let w = client.lock("c:w").acquire().await.expect("a writer");
    let fence = w.fence();
    w.downgrade().await.expect("downgraded");
    assert_eq!(w.fence(), fence);
    client
        .lock("c:w")
        .shared()
        .try_acquire()
        .await
        .expect("a reader joins the downgraded writer");
    let refused = client
        .lock("c:w")
        .try_acquire()
        .await
        .expect_err("a writer waits for the readers");
    assert_eq!(refused.kind(), ErrorKind::Held);

    let election = client.election("c:e");
    assert_eq!(election.leader().await.expect("asked"), None);
    let leading = election.campaign("host-1").await.expect("leading");
    leading.proclaim("host-2").await.expect("proclaimed");
    let seen = election.leader().await.expect("asked").expect("a leader");
    assert_eq!((seen.value.as_str(), seen.term), ("host-2", leading.term()));
    assert!(leading.resign().await.expect("resigned"));
    assert_eq!(election.leader().await.expect("asked"), None);

    let backend = server.backend().await;
    for transport in [fencelock::Transport::Wire, fencelock::Transport::Grpc] {
        let config = fencelock::ServerConfig::new(server.url()).transport(transport);
        let client = Client::connect_with(config).await.expect("connected");
        let session = client
            .session(Duration::from_secs(30))
            .owner("readers")
            .await
            .expect("a session");
        let name = format!("c:session:{transport:?}");
        let a = session.lock(&name).shared().acquire().await.expect("a");
        let b = session.lock(&name).shared().acquire().await.expect("b");
        let info = backend.get_lock(&name).await.expect("read");
        assert_eq!(info.holders.len(), 2, "{transport:?}: {info:?}");
        assert!(info.holders.iter().all(|h| h.session.is_some()), "{info:?}");
        assert!(b.fence() > a.fence());
        assert_eq!(session.close().await.expect("closed"), 2, "{transport:?}");
    }
}
