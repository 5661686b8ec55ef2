//! Sessions on etcd (`fencelock::etcd`): a session is one etcd lease; locks taken under
//! it through the client share its keep-alive, end with it, and releasing one (or
//! giving up a wait) leaves the session and its other locks alone. Against a
//! throwaway single-member etcd.

use std::time::Duration;

use fencelock::etcd::{EtcdBackend, EtcdConfig};
use fencelock::{Client, ErrorKind, LockBackend, LostReason};
use fencelock_conformance::step;
use fencelock_testkit::Etcd;

async fn start() -> Etcd {
    tokio::task::spawn_blocking(Etcd::start)
        .await
        .expect("start task")
        .expect("etcd starts (Debian package etcd-server)")
}

async fn backend(etcd: &Etcd) -> EtcdBackend {
    step(EtcdBackend::connect(EtcdConfig::new(etcd.url())))
        .await
        .expect("connect to etcd")
}

/// Locks under one session stay held past the session's ttl (its keep-alive keeps
/// them), a released one frees only itself, and closing frees the rest.
#[tokio::test]
async fn locks_under_a_session_live_and_end_with_it() {
    let etcd = start().await;
    let backend = backend(&etcd).await;
    assert!(backend.capabilities().sessions);
    let client = Client::new(backend);
    let other = Client::new(self::backend(&etcd).await);
    let session = step(client.session(Duration::from_secs(2)).open())
        .await
        .unwrap();
    assert_eq!(session.lease().ttl, Duration::from_secs(2));
    let a = step(session.lock("a").acquire()).await.unwrap();
    let b = step(session.lock("b").acquire()).await.unwrap();
    let c = step(session.lock("c").acquire()).await.unwrap();
    assert!(a.fence() < b.fence() && b.fence() < c.fence());
    assert!(a.owner_token().starts_with('s'), "{}", a.owner_token());

    // Two lease lengths later they are still held: only the session was kept alive.
    tokio::time::sleep(Duration::from_secs(4)).await;
    for name in ["a", "b", "c"] {
        let e = step(other.lock(name).try_acquire()).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Held, "{name}: {e}");
    }

    // Releasing one leaves the session (and the others) alone.
    assert!(step(b.release()).await.unwrap());
    let taken = step(other.lock("b").try_acquire()).await.unwrap();
    step(taken.release()).await.unwrap();
    assert!(!session.is_lost());
    let e = step(other.lock("a").try_acquire()).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Held, "{e}");

    assert_eq!(step(session.close()).await.unwrap(), 2);
    for guard in [&a, &c] {
        assert!(matches!(step(guard.lost()).await, LostReason::Released));
    }
    let again = step(other.lock("a").try_acquire()).await.unwrap();
    assert!(again.fence() > c.fence());
}

/// The session's lease revoked behind the client's back: the next keep-alive is refused
/// and every guard under it reports `lost()`.
#[tokio::test]
async fn a_session_ended_in_etcd_fires_every_guards_lost() {
    let etcd = start().await;
    let client = Client::new(backend(&etcd).await);
    let session = step(client.session(Duration::from_secs(2)).open())
        .await
        .unwrap();
    let guards = [
        step(session.lock("x").acquire()).await.unwrap(),
        step(session.lock("y").acquire()).await.unwrap(),
    ];
    let admin = backend(&etcd).await;
    assert_eq!(step(admin.close_session(session.lease())).await.unwrap(), 2);
    for guard in &guards {
        match step(guard.lost()).await {
            LostReason::Revoked(e) => assert_eq!(e.kind(), ErrorKind::SessionNotFound, "{e}"),
            other => panic!("{}: expected Revoked, got {other:?}", guard.name()),
        }
    }
    let gone = step(admin.keep_alive(session.lease())).await.unwrap_err();
    assert_eq!(gone.kind(), ErrorKind::SessionNotFound, "{gone}");
}

/// A wait under a session that runs out takes its own key away, not the session.
/// (Caught planted: giving up revoked the session's lease — the session was lost and
/// its lock freed.)
#[tokio::test]
async fn a_timed_out_wait_under_a_session_leaves_the_session_alive() {
    let etcd = start().await;
    let client = Client::new(backend(&etcd).await);
    let holder = Client::new(backend(&etcd).await);
    let held = step(holder.lock("busy").acquire()).await.unwrap();
    let session = step(client.session(Duration::from_secs(2)).open())
        .await
        .unwrap();
    let mine = step(session.lock("mine").acquire()).await.unwrap();
    let e = step(
        session
            .lock("busy")
            .wait(Duration::from_millis(300))
            .acquire(),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    // The session and its lock are intact, and the waiter's key is gone: the holder's
    // release frees the lock for anyone.
    let direct = backend(&etcd).await;
    assert!(step(direct.keep_alive(session.lease())).await.is_ok());
    assert!(!mine.is_lost());
    let e = step(holder.lock("mine").try_acquire()).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Held, "{e}");
    step(held.release()).await.unwrap();
    let next = step(holder.lock("busy").try_acquire()).await.unwrap();
    step(next.release()).await.unwrap();
    assert_eq!(step(session.close()).await.unwrap(), 1);
}
