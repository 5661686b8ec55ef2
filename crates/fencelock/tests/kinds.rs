//! The fencelock server backend's lock kinds: shared acquires, downgrade,
//! elections and multi-locks, against a real server.

// Each test binary uses a different part of the support module.
#[allow(unused_imports)]
mod support;

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
}
