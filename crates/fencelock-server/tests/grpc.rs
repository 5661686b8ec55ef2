//! The gRPC API over a real server: each test starts its own server on a random port
//! with its own temporary data directory, talks to it with the generated client, and
//! shuts it down.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use fencelock_server::grpc::pb::locks_client::LocksClient;
use fencelock_server::grpc::pb::{
    self, AcquireRequest, CloseSessionRequest, EventKind, ForceReleaseRequest, GetLockRequest,
    KeepAliveRequest, ListLocksRequest, OpenSessionRequest, ReleaseRequest, RenewRequest,
    WatchRequest,
};
use fencelock_server::grpc::ERROR_CODE_METADATA;
use fencelock_server::{EngineConfig, Server, ServerConfig};
use prost::bytes::BufMut;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::transport::Channel;
use tonic::{Code, Status};

/// Longest any single step may take before the test fails instead of hanging.
const STEP: Duration = Duration::from_secs(30);

struct TestServer {
    server: Server,
    client: LocksClient<Channel>,
    _dir: tempfile::TempDir,
}

impl TestServer {
    async fn start() -> TestServer {
        let dir = tempfile::tempdir().expect("a temporary data directory");
        let server = Server::start(ServerConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            EngineConfig::new(dir.path()),
        ))
        .await
        .expect("the server starts");
        let client = LocksClient::connect(format!("http://{}", server.local_addr()))
            .await
            .expect("the gRPC client connects");
        TestServer {
            server,
            client,
            _dir: dir,
        }
    }

    /// A new client (own connection).
    async fn connect(&self) -> LocksClient<Channel> {
        LocksClient::connect(format!("http://{}", self.server.local_addr()))
            .await
            .expect("the gRPC client connects")
    }

    /// Graceful shutdown, with the client still connected; must finish in time.
    async fn stop(self) {
        let TestServer { server, client, .. } = self;
        tokio::time::timeout(STEP, server.shutdown())
            .await
            .expect("shutdown finishes in time")
            .expect("shutdown is clean");
        drop(client);
    }
}

fn acquire(name: &str, ttl_ms: u64) -> AcquireRequest {
    AcquireRequest {
        name: name.to_owned(),
        ttl_ms: Some(ttl_ms),
        ..Default::default()
    }
}

fn error_code(status: &Status) -> Option<&str> {
    status.metadata().get(ERROR_CODE_METADATA)?.to_str().ok()
}

#[track_caller]
fn assert_status<T: std::fmt::Debug>(
    result: Result<tonic::Response<T>, Status>,
    code: Code,
    error: &str,
) -> Status {
    let status = result.expect_err("the call fails");
    assert_eq!(status.code(), code, "{status:?}");
    assert_eq!(error_code(&status), Some(error), "{status:?}");
    assert!(!status.message().is_empty(), "{status:?}");
    status
}

/// Waiters queued for `name` (0 if the lock does not exist).
async fn waiters(client: &mut LocksClient<Channel>, name: &str) -> u64 {
    let request = GetLockRequest {
        name: name.to_owned(),
    };
    match client.get_lock(request).await {
        Ok(info) => info.into_inner().waiters,
        Err(status) if status.code() == Code::NotFound => 0,
        Err(status) => panic!("get_lock {name}: {status:?}"),
    }
}

/// Polls (bounded) until `name` has exactly `n` waiters.
async fn wait_for_waiters(client: &mut LocksClient<Channel>, name: &str, n: u64) {
    let deadline = Instant::now() + STEP;
    loop {
        let now = waiters(client, name).await;
        if now == n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{name} still has {now} waiters, expected {n}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Polls (bounded) until the acquire `call` waits in the queue of `name`; fails at
/// once if the call already ended.
async fn wait_until_queued<T: std::fmt::Debug>(
    client: &mut LocksClient<Channel>,
    name: &str,
    call: tokio::task::JoinHandle<T>,
) -> tokio::task::JoinHandle<T> {
    let deadline = Instant::now() + STEP;
    while waiters(client, name).await != 1 {
        if call.is_finished() {
            panic!("the waiting acquire ended early: {:?}", call.await);
        }
        assert!(Instant::now() < deadline, "{name} has no waiter");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    call
}

#[tokio::test]
async fn acquire_renew_release_with_growing_fences() {
    let mut t = TestServer::start().await;
    let c = &mut t.client;

    let mut last_fence = 0;
    for round in 0..3 {
        let g = c
            .acquire(acquire("job:a", 30_000))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(g.name, "job:a");
        assert!(
            g.fence > last_fence,
            "round {round}: fence {} after {last_fence}",
            g.fence
        );
        last_fence = g.fence;
        assert_eq!(g.ttl_ms, 30_000);
        assert_eq!(g.session, None);
        assert_eq!(g.owner_token.len(), 32, "{g:?}");
        assert!(g.owner_token.bytes().all(|b| b.is_ascii_hexdigit()));

        let renewed = c
            .renew(RenewRequest {
                name: g.name.clone(),
                owner_token: g.owner_token.clone(),
                ttl_ms: Some(60_000),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            (renewed.fence, renewed.ttl_ms),
            (g.fence, 60_000),
            "renewal keeps the fence"
        );

        let release = ReleaseRequest {
            name: g.name.clone(),
            owner_token: g.owner_token.clone(),
        };
        let r = c.release(release.clone()).await.unwrap().into_inner();
        assert!(r.released);
        assert_eq!(r.reason, "");
        // Idempotent: says why it did nothing.
        let again = c.release(release).await.unwrap().into_inner();
        assert!(!again.released);
        assert_eq!(again.reason, "already_released");
    }

    // A renewal with a token that never held the lock.
    c.acquire(acquire("job:a", 30_000)).await.unwrap();
    let stranger = RenewRequest {
        name: "job:a".to_owned(),
        owner_token: "0123456789abcdef0123456789abcdef".to_owned(),
        ttl_ms: None,
    };
    assert_status(
        c.renew(stranger).await,
        Code::FailedPrecondition,
        "not_held",
    );
    t.stop().await;
}

#[tokio::test]
async fn held_lock_is_failed_precondition_with_code_held() {
    let mut t = TestServer::start().await;
    let c = &mut t.client;
    c.acquire(acquire("held", 30_000)).await.unwrap();
    let status = assert_status(
        c.acquire(acquire("held", 30_000)).await,
        Code::FailedPrecondition,
        "held",
    );
    assert!(status.message().contains("held"), "{status:?}");
    t.stop().await;
}

#[tokio::test]
async fn waiter_is_handed_the_lock_on_release() {
    let mut t = TestServer::start().await;
    let first = t
        .client
        .acquire(acquire("handoff", 30_000))
        .await
        .unwrap()
        .into_inner();

    let mut other = t.connect().await;
    let waiting = tokio::spawn(async move {
        let request = AcquireRequest {
            wait_ms: 30_000,
            owner: "second".to_owned(),
            ..acquire("handoff", 30_000)
        };
        other.acquire(request).await
    });
    let waiting = wait_until_queued(&mut t.client, "handoff", waiting).await;

    t.client
        .release(ReleaseRequest {
            name: first.name.clone(),
            owner_token: first.owner_token.clone(),
        })
        .await
        .unwrap();
    let second = tokio::time::timeout(STEP, waiting)
        .await
        .expect("the waiter is answered")
        .unwrap()
        .expect("the waiter gets the lock")
        .into_inner();
    assert!(second.fence > first.fence, "{second:?} after {first:?}");
    assert_ne!(second.owner_token, first.owner_token);

    let info = t
        .client
        .get_lock(GetLockRequest {
            name: "handoff".to_owned(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.holders.len(), 1);
    assert_eq!(info.holders[0].owner, "second");
    assert_eq!(info.holders[0].fence, second.fence);
    assert_eq!(info.waiters, 0);
    t.stop().await;
}

#[tokio::test]
async fn wait_times_out_with_deadline_exceeded() {
    let mut t = TestServer::start().await;
    let c = &mut t.client;
    c.acquire(acquire("busy", 30_000)).await.unwrap();
    let request = AcquireRequest {
        wait_ms: 50,
        ..acquire("busy", 30_000)
    };
    let result = tokio::time::timeout(STEP, c.acquire(request))
        .await
        .expect("the wait ends");
    assert_status(result, Code::DeadlineExceeded, "timeout");
    assert_eq!(waiters(c, "busy").await, 0);
    t.stop().await;
}

#[tokio::test]
async fn cancelled_acquire_call_leaves_the_queue() {
    let mut t = TestServer::start().await;
    let holder = t
        .client
        // Outlives the polling below, so only the cancellation can empty the queue.
        .acquire(acquire("cancel", 600_000))
        .await
        .unwrap()
        .into_inner();

    let mut other = t.connect().await;
    let waiting = tokio::spawn(async move {
        let request = AcquireRequest {
            wait_ms: 600_000,
            ..acquire("cancel", 30_000)
        };
        other.acquire(request).await
    });
    let waiting = wait_until_queued(&mut t.client, "cancel", waiting).await;

    // The client gives up: the call's future is dropped, the stream is reset, the
    // server drops the handler, and the handle takes the request out of the queue.
    waiting.abort();
    assert!(waiting.await.unwrap_err().is_cancelled());
    wait_for_waiters(&mut t.client, "cancel", 0).await;

    // And the cancelled request is never granted: after the release the lock is free.
    t.client
        .release(ReleaseRequest {
            name: holder.name,
            owner_token: holder.owner_token,
        })
        .await
        .unwrap();
    let status = t
        .client
        .get_lock(GetLockRequest {
            name: "cancel".to_owned(),
        })
        .await;
    assert_status(status, Code::NotFound, "not_found");
    t.stop().await;
}

#[tokio::test]
async fn session_keepalive_stream_and_close_releases_locks() {
    let mut t = TestServer::start().await;
    let c = &mut t.client;
    let opened = c
        .open_session(OpenSessionRequest {
            ttl_ms: 30_000,
            owner: "worker-1".to_owned(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(opened.ttl_ms, 30_000);
    assert_eq!(opened.session.len(), 32);

    let request = AcquireRequest {
        name: "s:1".to_owned(),
        session: Some(opened.session.clone()),
        ..Default::default()
    };
    let g = c.acquire(request).await.unwrap().into_inner();
    assert_eq!(g.session.as_deref(), Some(opened.session.as_str()));
    assert_eq!(g.ttl_ms, 30_000);

    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut responses = c
        .keep_alive(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    for _ in 0..3 {
        tx.send(KeepAliveRequest {
            session: opened.session.clone(),
        })
        .await
        .unwrap();
        let response = tokio::time::timeout(STEP, responses.message())
            .await
            .expect("a keepalive response")
            .unwrap()
            .expect("the stream is open");
        assert_eq!(response.session, opened.session);
        assert_eq!(response.ttl_ms, 30_000);
    }
    // The client finishes sending: the stream ends cleanly.
    drop(tx);
    let end = tokio::time::timeout(STEP, responses.message())
        .await
        .unwrap();
    assert!(matches!(end, Ok(None)), "{end:?}");

    let closed = c
        .close_session(CloseSessionRequest {
            session: opened.session.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(closed.released, 1);
    let gone = c
        .get_lock(GetLockRequest {
            name: "s:1".to_owned(),
        })
        .await;
    assert_status(gone, Code::NotFound, "not_found");
    let again = c
        .close_session(CloseSessionRequest {
            session: opened.session,
        })
        .await;
    assert_status(again, Code::NotFound, "session_not_found");
    t.stop().await;
}

#[tokio::test]
async fn keepalive_for_a_gone_session_ends_with_not_found() {
    let mut t = TestServer::start().await;
    let c = &mut t.client;
    let session = c
        .open_session(OpenSessionRequest {
            ttl_ms: 30_000,
            owner: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .session;

    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut responses = c
        .keep_alive(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let keep_alive = KeepAliveRequest {
        session: session.clone(),
    };
    tx.send(keep_alive.clone()).await.unwrap();
    let first = tokio::time::timeout(STEP, responses.message())
        .await
        .unwrap();
    assert!(matches!(first, Ok(Some(_))), "{first:?}");

    c.close_session(CloseSessionRequest { session })
        .await
        .unwrap();
    tx.send(keep_alive).await.unwrap();
    let status = tokio::time::timeout(STEP, responses.message())
        .await
        .unwrap()
        .expect_err("the session is gone");
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    assert_eq!(error_code(&status), Some("session_not_found"));
    t.stop().await;
}

async fn next_event(events: &mut tonic::Streaming<pb::LockEvent>) -> pb::LockEvent {
    tokio::time::timeout(STEP, events.message())
        .await
        .expect("an event in time")
        .expect("no error")
        .expect("the stream is open")
}

#[tokio::test]
async fn watch_streams_events_of_the_prefix_only() {
    let mut t = TestServer::start().await;
    let c = &mut t.client;
    let mut events = c
        .watch(WatchRequest {
            prefix: "w:".to_owned(),
            after: None,
        })
        .await
        .unwrap()
        .into_inner();

    let other = c
        .acquire(acquire("other", 30_000))
        .await
        .unwrap()
        .into_inner();
    let mine = c
        .acquire(acquire("w:a", 30_000))
        .await
        .unwrap()
        .into_inner();
    c.release(ReleaseRequest {
        name: other.name,
        owner_token: other.owner_token,
    })
    .await
    .unwrap();
    c.release(ReleaseRequest {
        name: mine.name.clone(),
        owner_token: mine.owner_token,
    })
    .await
    .unwrap();

    // Events arrive in order; those of `other` happened in between and are skipped.
    let mut seen = Vec::new();
    for _ in 0..2 {
        let event = tokio::time::timeout(STEP, events.message())
            .await
            .expect("an event")
            .unwrap()
            .expect("the stream is open");
        seen.push(event);
    }
    let kinds: Vec<EventKind> = seen.iter().map(|e| e.kind()).collect();
    assert_eq!(kinds, [EventKind::Granted, EventKind::Released], "{seen:?}");
    for event in &seen {
        assert_eq!(event.name, "w:a");
        assert_eq!(event.fence, Some(mine.fence));
    }
    assert!(seen[1].at_ms >= seen[0].at_ms);

    // A forced release carries its reason; still nothing from other names.
    c.acquire(acquire("other", 30_000)).await.unwrap();
    let g = c
        .acquire(acquire("w:b", 30_000))
        .await
        .unwrap()
        .into_inner();
    c.force_release(ForceReleaseRequest {
        name: "w:b".to_owned(),
        fence: None,
        reason: "stuck job".to_owned(),
    })
    .await
    .unwrap();
    let granted = next_event(&mut events).await;
    assert_eq!(
        (granted.kind(), granted.name.as_str()),
        (EventKind::Granted, "w:b")
    );
    let forced = next_event(&mut events).await;
    assert_eq!(forced.kind(), EventKind::ForceReleased);
    assert_eq!(forced.fence, Some(g.fence));
    assert_eq!(forced.reason.as_deref(), Some("stuck job"));
    t.stop().await;
}

/// Every malformed argument is INVALID_ARGUMENT with the code `invalid_argument`.
#[tokio::test]
async fn bad_input_is_invalid_argument() {
    let mut t = TestServer::start().await;
    let c = &mut t.client;
    let held = c.acquire(acquire("ok", 30_000)).await.unwrap().into_inner();
    let long = "x".repeat(300);
    let token = "0123456789abcdef0123456789abcdef";

    #[track_caller]
    fn check<T: std::fmt::Debug>(case: &str, result: Result<tonic::Response<T>, Status>) {
        let status = match result {
            Ok(ok) => panic!("{case}: accepted: {ok:?}"),
            Err(status) => status,
        };
        assert_eq!(status.code(), Code::InvalidArgument, "{case}: {status:?}");
        assert_eq!(
            error_code(&status),
            Some("invalid_argument"),
            "{case}: {status:?}"
        );
        assert!(!status.message().is_empty(), "{case}");
    }

    check("empty name", c.acquire(acquire("", 30_000)).await);
    check("300-byte name", c.acquire(acquire(&long, 30_000)).await);
    check(
        "control character",
        c.acquire(acquire("a\nb", 30_000)).await,
    );
    check("ttl 0", c.acquire(acquire("a", 0)).await);
    let no_ttl = AcquireRequest {
        name: "a".to_owned(),
        ..Default::default()
    };
    check("no ttl and no session", c.acquire(no_ttl).await);
    let bad_session = AcquireRequest {
        session: Some("not-a-session".to_owned()),
        ttl_ms: None,
        ..acquire("a", 0)
    };
    check("bad session", c.acquire(bad_session).await);
    let huge_limit = AcquireRequest {
        limit: u32::MAX,
        ..acquire("a", 30_000)
    };
    check("limit too large", c.acquire(huge_limit).await);
    let empty_request_id = AcquireRequest {
        request_id: Some(String::new()),
        ..acquire("a", 30_000)
    };
    check("empty request_id", c.acquire(empty_request_id).await);
    let long_wait = AcquireRequest {
        wait_ms: u64::MAX,
        ..acquire("a", 30_000)
    };
    check("wait_ms too long", c.acquire(long_wait).await);

    let bad_tokens = [
        String::new(),
        "xyz".to_owned(),
        token[1..].to_owned(),
        format!("{token}0"),
        token.replace('0', "g"),
    ];
    for bad in &bad_tokens {
        let renew = RenewRequest {
            name: "ok".to_owned(),
            owner_token: bad.to_owned(),
            ttl_ms: None,
        };
        check(&format!("renew with token {bad:?}"), c.renew(renew).await);
        let release = ReleaseRequest {
            name: "ok".to_owned(),
            owner_token: bad.to_owned(),
        };
        check(
            &format!("release with token {bad:?}"),
            c.release(release).await,
        );
    }
    let renew_ttl_0 = RenewRequest {
        name: held.name.clone(),
        owner_token: held.owner_token.clone(),
        ttl_ms: Some(0),
    };
    check("renew with ttl 0", c.renew(renew_ttl_0).await);
    let release_empty_name = ReleaseRequest {
        name: String::new(),
        owner_token: held.owner_token.clone(),
    };
    check(
        "release with empty name",
        c.release(release_empty_name).await,
    );

    let fence_0 = ForceReleaseRequest {
        name: "ok".to_owned(),
        fence: Some(0),
        reason: "r".to_owned(),
    };
    check("force release fence 0", c.force_release(fence_0).await);
    let no_reason = ForceReleaseRequest {
        name: "ok".to_owned(),
        fence: None,
        reason: String::new(),
    };
    check(
        "force release without reason",
        c.force_release(no_reason).await,
    );

    let get = GetLockRequest { name: long.clone() };
    check("get a 300-byte name", c.get_lock(get).await);
    let list = ListLocksRequest {
        limit: 1001,
        ..Default::default()
    };
    check("list limit 1001", c.list_locks(list).await);
    let list = ListLocksRequest {
        prefix: long.clone(),
        ..Default::default()
    };
    check("list with a 300-byte prefix", c.list_locks(list).await);
    let list = ListLocksRequest {
        after: Some(String::new()),
        ..Default::default()
    };
    check("list after an empty name", c.list_locks(list).await);

    let session = OpenSessionRequest {
        ttl_ms: 0,
        owner: String::new(),
    };
    check("session ttl 0", c.open_session(session).await);
    let session = OpenSessionRequest {
        ttl_ms: 30_000,
        owner: "o".repeat(2000),
    };
    check("session owner too long", c.open_session(session).await);
    let close = CloseSessionRequest {
        session: "zz".to_owned(),
    };
    check("close a bad session id", c.close_session(close).await);
    check(
        "watch a 300-byte prefix",
        c.watch(WatchRequest {
            prefix: long,
            after: None,
        })
        .await,
    );

    // A bad session id on the keepalive stream ends it with INVALID_ARGUMENT.
    let bad = KeepAliveRequest {
        session: "nope".to_owned(),
    };
    let mut responses = c
        .keep_alive(futures_util::stream::iter([bad]))
        .await
        .unwrap()
        .into_inner();
    let status = tokio::time::timeout(STEP, responses.message())
        .await
        .unwrap()
        .expect_err("a bad session id");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");

    // None of that disturbed the lock that is held.
    let info = c
        .get_lock(GetLockRequest {
            name: "ok".to_owned(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.holders[0].fence, held.fence);
    t.stop().await;
}

/// Sends raw bytes as the request message (to send what the generated client can't).
#[derive(Clone, Copy, Default)]
struct RawCodec;

struct RawEncoder;

impl Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = Status;

    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

struct GrantDecoder;

impl Decoder for GrantDecoder {
    type Item = pb::Grant;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<pb::Grant>, Status> {
        use prost::Message;
        pb::Grant::decode(src)
            .map(Some)
            .map_err(|e| Status::internal(e.to_string()))
    }
}

impl Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = pb::Grant;
    type Encoder = RawEncoder;
    type Decoder = GrantDecoder;

    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }

    fn decoder(&mut self) -> GrantDecoder {
        GrantDecoder
    }
}

async fn raw_acquire(
    t: &TestServer,
    message: Vec<u8>,
) -> Result<tonic::Response<pb::Grant>, Status> {
    let channel = Channel::from_shared(format!("http://{}", t.server.local_addr()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/fencelock.v1.Locks/Acquire");
    grpc.unary(tonic::Request::new(message), path, RawCodec)
        .await
}

/// Regression: prost's codec answers a message it cannot decode with INTERNAL, which
/// would look like a server fault; ours says INVALID_ARGUMENT.
#[tokio::test]
async fn malformed_and_oversized_messages_are_client_errors() {
    let mut t = TestServer::start().await;

    // Field 1 (name) claims 127 bytes that are not there.
    let truncated = raw_acquire(&t, vec![0x0a, 0x7f, b'a']).await;
    assert_status(truncated, Code::InvalidArgument, "invalid_argument");
    // Field 1 (name) is not UTF-8.
    let not_utf8 = raw_acquire(&t, vec![0x0a, 0x02, 0xff, 0xfe]).await;
    assert_status(not_utf8, Code::InvalidArgument, "invalid_argument");
    // A well-formed message through the same path works.
    let mut ok = Vec::new();
    prost::Message::encode(&acquire("raw", 30_000), &mut ok).unwrap();
    let grant = raw_acquire(&t, ok).await.unwrap().into_inner();
    assert_eq!(grant.name, "raw");

    // Over the 64 KiB limit: refused before decoding (tonic answers OUT_OF_RANGE).
    let oversized = AcquireRequest {
        owner: "o".repeat(70 * 1024),
        ..acquire("big", 30_000)
    };
    let status = t.client.acquire(oversized).await.unwrap_err();
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
    assert!(status.message().contains("too large"), "{status:?}");

    // The server is fine afterwards.
    t.client.acquire(acquire("after", 30_000)).await.unwrap();
    t.stop().await;
}

/// Sends `frames` (gRPC length-prefixed messages, as raw bytes) to `path` over HTTP/2.
async fn raw_frames(t: &TestServer, path: &str, frames: &'static str) -> Status {
    use tonic::codegen::{http, Service};
    let mut channel = Channel::from_shared(format!("http://{}", t.server.local_addr()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    std::future::poll_fn(|cx| channel.poll_ready(cx))
        .await
        .unwrap();
    let request = http::Request::post(format!("http://{}{path}", t.server.local_addr()))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(tonic::body::Body::new(frames.to_owned()))
        .unwrap();
    let response = channel.call(request).await.unwrap();
    assert_eq!(response.status(), 200);
    // A request tonic cannot read is answered with the status in the headers; a
    // stream a handler reads ends with the status in the trailers.
    if let Some(status) = Status::from_header_map(response.headers()) {
        return status;
    }
    let mut body = response.into_body();
    loop {
        let frame = std::future::poll_fn(|cx| {
            tonic::codegen::Body::poll_frame(std::pin::Pin::new(&mut body), cx)
        });
        let frame = tokio::time::timeout(STEP, frame)
            .await
            .expect("a frame in time")
            .expect("the response ends with trailers")
            .expect("a readable response");
        if let Ok(trailers) = frame.into_trailers() {
            return Status::from_header_map(&trailers).expect("a status in the trailers");
        }
    }
}

/// Regression: tonic answers a request it cannot read (no message, a bad frame flag)
/// with INTERNAL before any handler runs; that is the client's mistake.
#[tokio::test]
async fn unreadable_requests_are_invalid_argument() {
    let mut t = TestServer::start().await;
    // (case, method, request body: gRPC frames of flag, 4-byte length, message)
    let cases = [
        ("no message", "Acquire", ""),
        ("bad compression flag", "GetLock", "\x02\0\0\0\0"),
        ("compressed without an encoding", "Watch", "\x01\0\0\0\0"),
        ("truncated frame", "ListLocks", "\0\0\0\0\x09ab"),
        ("bad frame on a stream", "KeepAlive", "\x02\0\0\0\0"),
        ("truncated frame on a stream", "KeepAlive", "\0\0\0\0\x09a"),
        (
            "malformed message on a stream",
            "KeepAlive",
            "\0\0\0\0\x02\x0a\x7f",
        ),
    ];
    for (case, method, frames) in cases {
        let path = format!("/fencelock.v1.Locks/{method}");
        let status = raw_frames(&t, &path, frames).await;
        assert_eq!(status.code(), Code::InvalidArgument, "{case}: {status:?}");
        assert_eq!(error_code(&status), Some("invalid_argument"), "{case}");
    }
    // Statuses from the handlers are left alone.
    let status = raw_frames(&t, "/fencelock.v1.Locks/GetLock", "\0\0\0\0\0").await;
    assert_eq!(
        status.code(),
        Code::InvalidArgument,
        "empty name: {status:?}"
    );
    assert!(status.message().contains("name"), "{status:?}");
    let unknown = raw_frames(&t, "/fencelock.v1.Locks/Nope", "").await;
    assert_eq!(unknown.code(), Code::Unimplemented, "{unknown:?}");

    t.client.acquire(acquire("after", 30_000)).await.unwrap();
    t.stop().await;
}

#[tokio::test]
async fn semaphore_admits_limit_holders() {
    let mut t = TestServer::start().await;
    let c = &mut t.client;
    let slot = |owner: &str| AcquireRequest {
        limit: 2,
        owner: owner.to_owned(),
        ..acquire("pool", 30_000)
    };
    let a = c.acquire(slot("a")).await.unwrap().into_inner();
    let b = c.acquire(slot("b")).await.unwrap().into_inner();
    assert!(b.fence > a.fence, "each holder has its own fence");
    assert_status(c.acquire(slot("c")).await, Code::FailedPrecondition, "held");
    let other_limit = AcquireRequest {
        limit: 3,
        ..acquire("pool", 30_000)
    };
    assert_status(
        c.acquire(other_limit).await,
        Code::FailedPrecondition,
        "limit_mismatch",
    );
    // limit 0 means 1, which is also another limit.
    assert_status(
        c.acquire(acquire("pool", 30_000)).await,
        Code::FailedPrecondition,
        "limit_mismatch",
    );

    let info = c
        .get_lock(GetLockRequest {
            name: "pool".to_owned(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.limit, 2);
    let owners: Vec<&str> = info.holders.iter().map(|h| h.owner.as_str()).collect();
    assert_eq!(owners, ["a", "b"]);

    c.release(ReleaseRequest {
        name: a.name,
        owner_token: a.owner_token,
    })
    .await
    .unwrap();
    let c2 = c.acquire(slot("c")).await.unwrap().into_inner();
    assert!(c2.fence > b.fence);
    t.stop().await;
}

#[tokio::test]
async fn get_list_and_force_release() {
    let mut t = TestServer::start().await;
    let c = &mut t.client;
    let mut fences = Vec::new();
    for name in ["l:1", "l:2", "l:3", "m:1"] {
        let request = AcquireRequest {
            owner: format!("owner of {name}"),
            lock_delay_ms: 0,
            ..acquire(name, 30_000)
        };
        fences.push(c.acquire(request).await.unwrap().into_inner().fence);
    }

    let info = c
        .get_lock(GetLockRequest {
            name: "l:2".to_owned(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (info.name.as_str(), info.limit, info.waiters),
        ("l:2", 1, 0)
    );
    assert_eq!(info.holders.len(), 1);
    let h = &info.holders[0];
    assert_eq!((h.fence, h.owner.as_str()), (fences[1], "owner of l:2"));
    assert!(
        h.ttl_remaining_ms <= 30_000 && h.ttl_remaining_ms > 0,
        "{h:?}"
    );
    assert_eq!(h.session, None);
    assert_status(
        c.get_lock(GetLockRequest {
            name: "none".to_owned(),
        })
        .await,
        Code::NotFound,
        "not_found",
    );

    let page = c
        .list_locks(ListLocksRequest {
            prefix: "l:".to_owned(),
            after: None,
            limit: 2,
        })
        .await
        .unwrap()
        .into_inner();
    let names: Vec<&str> = page.locks.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["l:1", "l:2"]);
    assert_eq!(page.next_after.as_deref(), Some("l:2"));
    let rest = c
        .list_locks(ListLocksRequest {
            prefix: "l:".to_owned(),
            after: page.next_after,
            limit: 2,
        })
        .await
        .unwrap()
        .into_inner();
    let names: Vec<&str> = rest.locks.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["l:3"]);
    assert_eq!(rest.next_after, None);
    let all = c
        .list_locks(ListLocksRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(all.locks.len(), 4, "limit 0 means the default page");

    let taken = c
        .force_release(ForceReleaseRequest {
            name: "m:1".to_owned(),
            fence: None,
            reason: "operator test".to_owned(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(taken.fences, [fences[3]]);
    let nothing = c
        .force_release(ForceReleaseRequest {
            name: "m:1".to_owned(),
            fence: None,
            reason: "again".to_owned(),
        })
        .await;
    assert_status(nothing, Code::FailedPrecondition, "not_held");
    let next = c
        .acquire(acquire("m:1", 30_000))
        .await
        .unwrap()
        .into_inner();
    assert!(
        next.fence > fences[3],
        "a new, larger fence after a forced release"
    );
    t.stop().await;
}

/// Plain HTTP/1.1 over a blocking socket; returns the whole response.
fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(STEP)).unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
}

#[tokio::test]
async fn http_and_grpc_share_one_port() {
    let mut t = TestServer::start().await;
    let g = t
        .client
        .acquire(acquire("shared:1", 30_000))
        .await
        .unwrap()
        .into_inner();
    let addr = t.server.local_addr();

    let (health, lock) = tokio::task::spawn_blocking(move || {
        (
            http_get(addr, "/healthz"),
            http_get(addr, "/v1/locks/shared:1"),
        )
    })
    .await
    .unwrap();
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    assert!(health.ends_with("ok\n"), "{health}");
    assert!(lock.starts_with("HTTP/1.1 200"), "{lock}");
    assert!(lock.contains(&format!("\"fence\":{}", g.fence)), "{lock}");

    // And gRPC still works on the same connection pool afterwards.
    let renewed = t
        .client
        .renew(RenewRequest {
            name: g.name,
            owner_token: g.owner_token,
            ttl_ms: None,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(renewed.fence, g.fence);
    t.stop().await;
}

/// Open streams and waits must not hold up a graceful shutdown: they end with
/// UNAVAILABLE.
#[tokio::test]
async fn shutdown_ends_streams_and_waits() {
    let mut t = TestServer::start().await;
    let mut other = t.connect().await;
    let c = &mut t.client;
    let mut events = c.watch(WatchRequest::default()).await.unwrap().into_inner();
    let session = c
        .open_session(OpenSessionRequest {
            ttl_ms: 30_000,
            owner: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .session;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut keepalives = c
        .keep_alive(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    tx.send(KeepAliveRequest { session }).await.unwrap();
    keepalives.message().await.unwrap().unwrap();
    let held = c.acquire(acquire("x", 30_000)).await.unwrap().into_inner();
    let waiting = tokio::spawn(async move {
        other
            .acquire(AcquireRequest {
                wait_ms: 600_000,
                ..acquire("x", 30_000)
            })
            .await
    });
    let waiting = wait_until_queued(c, "x", waiting).await;

    // The watch saw what happened before the shutdown.
    let granted = events.message().await.unwrap().unwrap();
    assert_eq!(
        (granted.kind(), granted.fence),
        (EventKind::Granted, Some(held.fence))
    );
    let queued = events.message().await.unwrap().unwrap();
    assert_eq!(queued.kind(), EventKind::Queued);

    t.stop().await;

    let waited = waiting.await.unwrap();
    assert_status(waited, Code::Unavailable, "unavailable");
    let mut watch_end = None;
    // Events made durable before the drain may still arrive first (bounded).
    for _ in 0..16 {
        match tokio::time::timeout(STEP, events.message()).await.unwrap() {
            Ok(Some(_)) => continue,
            other => {
                watch_end = Some(other);
                break;
            }
        }
    }
    let status = watch_end
        .expect("the watch ends")
        .expect_err("with a status");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(error_code(&status), Some("unavailable"));
    let status = tokio::time::timeout(STEP, keepalives.message())
        .await
        .unwrap()
        .expect_err("the keepalive stream ends with a status");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    drop(tx);
}
