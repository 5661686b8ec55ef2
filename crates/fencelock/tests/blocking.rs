//! `fencelock::blocking` against a real fencelock server, from plain threads: acquire,
//! renewal while the caller's thread blocks, release, release on drop, and a clear
//! error (not a panic) when called from inside an async runtime.

use crate::support;

use std::time::Duration;

use fencelock::{blocking, ErrorKind};
use support::TestServer;

/// The server runs on a runtime of its own; the test's thread is not inside it.
fn server() -> (tokio::runtime::Runtime, TestServer) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let server = runtime.block_on(TestServer::start());
    (runtime, server)
}

/// (Caught planted: a guard whose drop left the lease to expire — the next
/// `try_acquire` was refused `held`.)
#[test]
fn acquire_release_and_drop_releases_before_returning() {
    let (_runtime, server) = server();
    let client = blocking::Client::connect(&server.url()).unwrap();
    assert_eq!(client.capabilities().backend, "fencelock");

    let guard = client.lock("b:1").owner("blocking").acquire().unwrap();
    assert_eq!(guard.name(), "b:1");
    let held = client.lock("b:1").try_acquire().unwrap_err();
    assert_eq!(held.kind(), ErrorKind::Held, "{held}");
    let fence = guard.fence();
    assert!(guard.release().unwrap(), "released by this call");

    let guard = client.lock("b:1").try_acquire().unwrap();
    assert!(guard.fence() > fence);
    let fence = guard.fence();
    drop(guard);
    // Free the moment drop returned: no wait for a lease to run out.
    let next = client.lock("b:1").try_acquire().unwrap();
    assert!(next.fence() > fence);
}

#[test]
fn the_lock_is_renewed_while_the_callers_thread_blocks() {
    let (_runtime, server) = server();
    let client = blocking::Client::connect(&server.url()).unwrap();
    let ttl = Duration::from_millis(600);
    let guard = client.lock("b:renew").ttl(ttl).acquire().unwrap();
    // Blocking work (not awaiting anything) for three lease lengths.
    std::thread::sleep(ttl * 3);
    assert!(guard.valid_for().is_some(), "still held after 3 TTLs");
    assert!(!guard.is_lost());
    let busy = client.lock("b:renew").try_acquire().unwrap_err();
    assert_eq!(busy.kind(), ErrorKind::Held, "{busy}");
    assert!(guard.wait_lost(Duration::from_millis(1)).unwrap().is_none());
}

#[tokio::test]
async fn inside_an_async_runtime_it_is_an_error_not_a_panic() {
    let server = TestServer::start().await;
    let err = blocking::Client::connect(&server.url()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    assert!(err.message().contains("fencelock::Client"), "{err}");
}
