//! The client with several endpoints: it follows a member's `not_leader` answer to
//! the leader it names (even one it was not given), passes over members it cannot
//! reach or that know no leader, and sends every attempt of one acquisition with the
//! same request id. The "members" that are not the leader are fakes speaking `flw/1`
//! that answer every request with `not_leader`; the leader is a real server.

use crate::support;

#[allow(unused_imports)] // The proxy is for other test files.
use support::Proxy as _;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencelock::{AcquireSpec, Client, ErrorKind, FencelockBackend, LockBackend, ServerConfig};
use fencelock_proto::wire::{self, Request, Response, WireError};
use fencelock_proto::AcquireRequest;
use support::{TestServer, STEP};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::time::timeout;

/// A member that is not the leader: answers every request `not_leader`, naming
/// `leader` (or nobody), and remembers the request ids of the acquires it saw.
struct Follower {
    url: String,
    seen: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Follower {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Follower {
    async fn start(leader: Option<String>) -> Follower {
        Follower::start_knowing_after(leader, 0).await
    }

    /// A member that knows no leader for its first `unknown_for` answers (an
    /// election), then names `leader`.
    async fn start_knowing_after(leader: Option<String>, unknown_for: usize) -> Follower {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let answered = Arc::new(AtomicUsize::new(0));
        let task = tokio::spawn({
            let seen = seen.clone();
            async move {
                loop {
                    let Ok((socket, _)) = listener.accept().await else {
                        return;
                    };
                    let known = Known {
                        leader: leader.clone(),
                        unknown_for,
                        answered: answered.clone(),
                    };
                    tokio::spawn(serve(socket, known, seen.clone()));
                }
            }
        });
        Follower { url, seen, task }
    }

    fn seen(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }
}

/// What a fake member says about the leader.
struct Known {
    leader: Option<String>,
    unknown_for: usize,
    answered: Arc<AtomicUsize>,
}

impl Known {
    fn answer(&self) -> Response {
        let n = self.answered.fetch_add(1, Ordering::Relaxed);
        not_leader(if n < self.unknown_for {
            &None
        } else {
            &self.leader
        })
    }
}

async fn serve(mut socket: tokio::net::TcpStream, known: Known, seen: Arc<Mutex<Vec<String>>>) {
    let mut magic = [0u8; 8];
    if socket.read_exact(&mut magic).await.is_err() || magic != wire::CLIENT_MAGIC {
        return;
    }
    if socket.write_all(&wire::SERVER_MAGIC).await.is_err() {
        return;
    }
    let mut input = Vec::new();
    loop {
        while let Ok(Some(n)) = wire::frame_len(&input, wire::MAX_FRAME_BYTES) {
            let Ok((id, request)) = wire::decode_request(&input[..n]) else {
                return;
            };
            input.drain(..n);
            let answer = match request {
                Request::Ping => Response::Pong,
                Request::Acquire(AcquireRequest { request_id, .. }) => {
                    seen.lock().unwrap().push(request_id.unwrap_or_default());
                    known.answer()
                }
                _ => known.answer(),
            };
            let mut out = Vec::new();
            wire::encode_response(&mut out, id, &answer);
            if socket.write_all(&out).await.is_err() {
                return;
            }
        }
        match socket.read_buf(&mut input).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

fn not_leader(leader: &Option<String>) -> Response {
    Response::Error(WireError {
        code: "not_leader".into(),
        message: "this member is not the leader".into(),
        leader: leader.clone().unwrap_or_default(),
    })
}

/// A loopback URL nothing listens on.
async fn dead_url() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    url
}

#[tokio::test]
async fn a_named_leader_is_followed_even_when_it_was_not_configured() {
    let server = TestServer::start().await;
    let follower = Follower::start(Some(server.url())).await;
    // Only the follower is configured: the leader is learned from its answer.
    let client = Client::connect(&follower.url).await.unwrap();

    let guard = timeout(STEP, client.lock("f:a").acquire())
        .await
        .unwrap()
        .unwrap();
    let mut raw = server.raw().await;
    let held = raw.get_lock(fencelock_proto::GetLockRequest { name: "f:a".into() });
    let info = held.await.unwrap().into_inner();
    assert_eq!(info.holders.len(), 1, "{info:?}");
    assert_eq!(info.holders[0].fence, guard.fence());
    assert_eq!(follower.seen().len(), 1, "one attempt went to the follower");

    // Later calls go to the leader directly.
    let second = timeout(STEP, client.lock("f:b").try_acquire())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(follower.seen().len(), 1, "{:?}", follower.seen());
    assert!(guard.release().await.unwrap());
    assert!(second.release().await.unwrap());
}

#[tokio::test]
async fn unreachable_and_leaderless_members_are_passed_over() {
    let server = TestServer::start().await;
    let leaderless = Follower::start(None).await;
    let list = format!("{},{},{}", dead_url().await, leaderless.url, server.url());
    let client = Client::connect(&list).await.unwrap();

    let guard = timeout(STEP, client.lock("p:a").try_acquire())
        .await
        .unwrap()
        .unwrap();
    assert!(guard.fence() > 0);
    assert!(guard.release().await.unwrap());

    // The same through the builder, with gRPC for the hot path: the dead member is
    // passed over (the gRPC-only client cannot speak to the flw/1 fake at all).
    let mut config = ServerConfig::with_endpoints([dead_url().await, server.url()]);
    config.transport = fencelock::Transport::Grpc;
    let grpc = Client::connect_with(config).await.unwrap();
    let guard = timeout(STEP, grpc.lock("p:b").try_acquire())
        .await
        .unwrap()
        .unwrap();
    assert!(guard.release().await.unwrap());
}

#[tokio::test]
async fn no_member_reachable_is_unavailable_not_a_hang() {
    let leaderless = Follower::start(None).await;
    let list = format!("{},{}", dead_url().await, leaderless.url);
    let client = Client::connect(&list).await.unwrap();
    let err = timeout(
        STEP,
        client
            .lock("n:a")
            .wait(Duration::from_millis(300))
            .acquire(),
    )
    .await
    .unwrap()
    .unwrap_err();
    // Which of the two failures comes last depends on where the last round started.
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(!leaderless.seen().is_empty());

    // A member alone that knows no leader: its answer is what the caller gets.
    let alone = Client::connect(&leaderless.url).await.unwrap();
    let err = timeout(STEP, alone.lock("n:b").try_acquire())
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(err.is_not_leader(), "{err}");
    assert_eq!(err.leader(), None);

    let err = Client::connect(&dead_url().await).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
}

#[tokio::test]
async fn every_attempt_of_one_acquisition_carries_the_same_request_id() {
    let server = TestServer::start().await;
    let follower = Follower::start(Some(server.url())).await;
    let client = Client::connect(&follower.url).await.unwrap();

    let guard = timeout(STEP, client.lock("r:a").acquire())
        .await
        .unwrap()
        .unwrap();
    let ids = follower.seen();
    assert_eq!(ids.len(), 1);
    assert_eq!(ids[0].len(), 32, "a generated id: {ids:?}");
    // The leader got the same id: presenting it again returns the same grant.
    let again = server
        .raw()
        .await
        .acquire(AcquireRequest {
            name: "r:a".into(),
            ttl_ms: Some(30_000),
            request_id: Some(ids[0].clone()),
            limit: 1,
            ..AcquireRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.owner_token, guard.owner_token());
    assert_eq!(again.fence, guard.fence());

    // A caller's own id is the one sent.
    let other = Client::connect(&follower.url).await.unwrap();
    let mine = timeout(STEP, other.lock("r:b").request_id("my-id-0001").acquire())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        follower.seen().last().map(String::as_str),
        Some("my-id-0001")
    );
    assert!(mine.release().await.unwrap());
    assert!(guard.release().await.unwrap());
}

#[tokio::test]
async fn the_backend_itself_rides_out_an_election_within_the_wait() {
    let server = TestServer::start().await;
    // Three answers without a leader, then the leader's name.
    let electing = Follower::start_knowing_after(Some(server.url()), 3).await;
    let backend = FencelockBackend::connect(ServerConfig::new(electing.url.clone()))
        .await
        .unwrap();
    let mut spec = AcquireSpec::new("e:a", Duration::from_secs(30));
    spec.wait = Duration::from_secs(10);
    // One call to the backend (no client retry loop around it).
    let lease = timeout(STEP, backend.acquire(&spec))
        .await
        .unwrap()
        .unwrap();
    let ids = electing.seen();
    assert_eq!(
        ids.len(),
        4,
        "three rounds without a leader, then followed: {ids:?}"
    );
    assert!(ids.iter().all(|id| *id == spec.request_id), "{ids:?}");
    assert!(backend.release(&lease).await.unwrap());

    // Without a wait, one round only: the election is the caller's to retry.
    let electing = Follower::start_knowing_after(Some(server.url()), 3).await;
    let backend = FencelockBackend::connect(ServerConfig::new(electing.url.clone()))
        .await
        .unwrap();
    let spec = AcquireSpec::new("e:b", Duration::from_secs(30));
    let err = timeout(STEP, backend.acquire(&spec))
        .await
        .unwrap()
        .unwrap_err();
    assert!(err.is_not_leader(), "{err}");
    assert_eq!(electing.seen().len(), 1);
}
