//! The wire protocol `flw/1` over a real server: a raw test client on a tokio
//! `TcpStream` sends frames (good and bad) and reads the answers.

use crate::support;

use std::time::Duration;

use fencelock_proto::wire::{self, Hello, Request, Response};
use fencelock_proto::{AcquireRequest, Grant, ReleaseRequest, RenewRequest};
use fencelock_server::{AuthConfig, Role, TokenConfig};
use support::{TestServer, IO_TIMEOUT};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One raw `flw/1` connection.
struct Conn {
    stream: TcpStream,
    input: Vec<u8>,
}

impl Conn {
    async fn open(server: &TestServer) -> Conn {
        let mut stream = TcpStream::connect(server.addr()).await.unwrap();
        stream.write_all(&wire::CLIENT_MAGIC).await.unwrap();
        let mut magic = [0u8; 8];
        tokio::time::timeout(IO_TIMEOUT, stream.read_exact(&mut magic))
            .await
            .expect("the server answers the magic in time")
            .unwrap();
        assert_eq!(magic, wire::SERVER_MAGIC);
        Conn {
            stream,
            input: Vec::new(),
        }
    }

    async fn send(&mut self, id: u64, request: Request) {
        let mut out = Vec::new();
        wire::encode_request(&mut out, id, &request);
        self.stream.write_all(&out).await.unwrap();
    }

    async fn send_raw(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.unwrap();
    }

    /// The next answer, or `None` if the server closed the connection.
    async fn recv(&mut self) -> Option<(u64, Response)> {
        let read = async {
            loop {
                if let Some(n) = wire::frame_len(&self.input, wire::MAX_FRAME_BYTES).unwrap() {
                    let answer = wire::decode_response(&self.input[..n]).unwrap();
                    self.input.drain(..n);
                    return Some(answer);
                }
                match self.stream.read_buf(&mut self.input).await {
                    Ok(0) | Err(_) => return None,
                    Ok(_) => {}
                }
            }
        };
        tokio::time::timeout(IO_TIMEOUT, read)
            .await
            .expect("an answer (or a close) in time")
    }

    async fn call(&mut self, id: u64, request: Request) -> Response {
        self.send(id, request).await;
        let (got, response) = self.recv().await.expect("an answer");
        assert_eq!(got, id);
        response
    }

    async fn acquire(&mut self, id: u64, name: &str, wait_ms: u64) -> Response {
        self.call(id, acquire(name, wait_ms)).await
    }
}

fn acquire(name: &str, wait_ms: u64) -> Request {
    Request::Acquire(AcquireRequest {
        name: name.into(),
        ttl_ms: Some(30_000),
        wait_ms,
        owner: "wire-test".into(),
        ..Default::default()
    })
}

fn grant(response: Response) -> Grant {
    match response {
        Response::Grant(g) => g,
        other => panic!("expected a grant, got {other:?}"),
    }
}

fn error_code(response: &Response) -> &str {
    match response {
        Response::Error(e) => &e.code,
        other => panic!("expected an error, got {other:?}"),
    }
}

fn release(g: &Grant) -> Request {
    Request::Release(ReleaseRequest {
        name: g.name.clone(),
        owner_token: g.owner_token.clone(),
    })
}

#[tokio::test]
async fn acquire_renew_release_round_trip() {
    let server = TestServer::start().await;
    let mut c = Conn::open(&server).await;
    let first = grant(c.acquire(1, "wire:a", 0).await);
    assert_eq!(first.name, "wire:a");
    assert_eq!(first.ttl_ms, 30_000);
    assert_eq!(error_code(&c.acquire(2, "wire:a", 0).await), "held");
    let renewed = c
        .call(
            3,
            Request::Renew(RenewRequest {
                name: "wire:a".into(),
                owner_token: first.owner_token.clone(),
                ttl_ms: Some(5_000),
            }),
        )
        .await;
    match renewed {
        Response::Renewed(r) => assert_eq!((r.fence, r.ttl_ms), (first.fence, 5_000)),
        other => panic!("expected Renewed, got {other:?}"),
    }
    match c.call(4, release(&first)).await {
        Response::Released(r) => assert!(r.released),
        other => panic!("expected Released, got {other:?}"),
    }
    // Released twice: the second releases nothing, as over gRPC.
    match c.call(5, release(&first)).await {
        Response::Released(r) => {
            assert_eq!((r.released, r.reason.as_str()), (false, "already_released"))
        }
        other => panic!("expected Released, got {other:?}"),
    }
    let second = grant(c.acquire(6, "wire:a", 0).await);
    assert!(second.fence > first.fence);
    assert_eq!(c.call(7, Request::Ping).await, Response::Pong);
    // The HTTP API sees the lock the wire protocol took.
    let view = server.client.get("/v1/locks/wire:a").await;
    assert_eq!(view.status, 200, "{view:?}");
    assert_eq!(view.json()["holders"][0]["fence"], second.fence);
    server.stop().await;
}

#[tokio::test]
async fn a_waiting_acquire_does_not_hold_up_later_requests() {
    let server = TestServer::start().await;
    let mut holder = Conn::open(&server).await;
    let held = grant(holder.acquire(1, "wire:queue", 0).await);
    let mut waiter = Conn::open(&server).await;
    waiter.send(10, acquire("wire:queue", 20_000)).await;
    // Answered while the acquire waits.
    assert_eq!(waiter.call(11, Request::Ping).await, Response::Pong);
    let other = grant(waiter.acquire(12, "wire:other", 0).await);
    assert_eq!(other.name, "wire:other");
    holder.call(2, release(&held)).await;
    let (id, handed) = waiter.recv().await.expect("the hand-off");
    assert_eq!(id, 10);
    assert!(grant(handed).fence > held.fence);
    server.stop().await;
}

#[tokio::test]
async fn cancelled_or_disconnected_waiters_leave_the_queue() {
    let server = TestServer::start().await;
    let mut holder = Conn::open(&server).await;
    let held = grant(holder.acquire(1, "wire:c", 0).await);
    let mut cancels = Conn::open(&server).await;
    cancels.send(5, acquire("wire:c", 20_000)).await;
    let mut leaves = Conn::open(&server).await;
    leaves.send(6, acquire("wire:c", 20_000)).await;
    let mut last = Conn::open(&server).await;
    last.send(7, acquire("wire:c", 20_000)).await;
    // All three are queued (in this order) once each has answered a ping after it.
    for c in [&mut cancels, &mut leaves, &mut last] {
        assert_eq!(c.call(99, Request::Ping).await, Response::Pong);
    }
    let queued = server.client.get("/v1/locks/wire:c").await;
    assert_eq!(queued.json()["waiters"], 3, "{queued:?}");
    cancels.send(5, Request::Cancel).await;
    drop(leaves);
    // The cancelled acquire is answered `cancelled`, and nothing else.
    let (id, answer) = cancels.recv().await.unwrap();
    assert_eq!((id, error_code(&answer)), (5, "cancelled"));
    assert_eq!(cancels.call(100, Request::Ping).await, Response::Pong);
    holder.call(2, release(&held)).await;
    let (id, handed) = last.recv().await.expect("the hand-off");
    assert_eq!(id, 7);
    assert!(grant(handed).fence > held.fence);
    server.stop().await;
}

#[tokio::test]
async fn bad_frames_get_clear_errors_and_lose_nothing() {
    let server = TestServer::start().await;
    let mut c = Conn::open(&server).await;
    let held = grant(c.acquire(1, "wire:bad", 0).await);

    // An unknown op, protobuf that does not parse, a bad name, a bad token: each an
    // error answered to its id, and the connection goes on.
    let mut frame = Vec::new();
    wire::encode_request(&mut frame, 2, &Request::Ping);
    frame[4] = 0x42;
    c.send_raw(&frame).await;
    let (id, answer) = c.recv().await.unwrap();
    assert_eq!((id, error_code(&answer)), (2, "invalid_argument"));

    let mut frame = Vec::new();
    wire::encode_request(&mut frame, 3, &Request::Ping);
    frame[4] = wire::Op::Acquire as u8;
    frame.extend_from_slice(&[0x0a, 0xff, 0x01]);
    let body = (frame.len() - 4) as u32;
    frame[..4].copy_from_slice(&body.to_le_bytes());
    c.send_raw(&frame).await;
    let (id, answer) = c.recv().await.unwrap();
    assert_eq!((id, error_code(&answer)), (3, "invalid_argument"));

    assert_eq!(error_code(&c.acquire(4, "", 0).await), "invalid_argument");
    let renew_bad = Request::Renew(RenewRequest {
        name: "wire:bad".into(),
        owner_token: "not-a-token".into(),
        ttl_ms: None,
    });
    assert_eq!(error_code(&c.call(5, renew_bad).await), "invalid_argument");
    let ttl_zero = Request::Acquire(AcquireRequest {
        name: "wire:zero".into(),
        ttl_ms: Some(0),
        ..Default::default()
    });
    assert_eq!(error_code(&c.call(6, ttl_zero).await), "invalid_argument");
    assert_eq!(c.call(7, Request::Ping).await, Response::Pong);

    // A length over the limit cannot be trusted: an error, then the connection ends.
    c.send_raw(&(10u32 << 20).to_le_bytes()).await;
    let (id, answer) = c.recv().await.unwrap();
    assert_eq!((id, error_code(&answer)), (0, "payload_too_large"));
    assert!(c.recv().await.is_none(), "the connection is closed");

    // The lock taken before is untouched.
    let view = server.client.get("/v1/locks/wire:bad").await;
    assert_eq!(view.json()["holders"][0]["fence"], held.fence);

    // A wrong magic is not answered at all.
    let mut stream = TcpStream::connect(server.addr()).await.unwrap();
    stream.write_all(b"\xF1nope!!\n").await.unwrap();
    let mut buf = [0u8; 16];
    let n = tokio::time::timeout(IO_TIMEOUT, stream.read(&mut buf))
        .await
        .unwrap()
        .unwrap_or(0);
    assert_eq!(n, 0, "closed without an answer");
    server.stop().await;
}

#[tokio::test]
async fn acquires_in_flight_are_bounded_per_connection_and_renewals_still_pass() {
    let server = TestServer::start_configured(|c| c.limits.max_streams_per_connection = 2).await;
    let mut holder = Conn::open(&server).await;
    let a = grant(holder.acquire(1, "wire:f1", 0).await);
    grant(holder.acquire(2, "wire:f2", 0).await);
    let mut c = Conn::open(&server).await;
    let mine = grant(c.acquire(9, "wire:mine", 0).await);
    c.send(10, acquire("wire:f1", 20_000)).await;
    c.send(11, acquire("wire:f2", 20_000)).await;
    // Two acquires wait: a third is refused at once, while a renewal of a lock this
    // connection holds is still answered.
    assert_eq!(
        error_code(&c.acquire(12, "wire:f3", 20_000).await),
        "resource_exhausted"
    );
    let renew = Request::Renew(RenewRequest {
        name: mine.name.clone(),
        owner_token: mine.owner_token.clone(),
        ttl_ms: None,
    });
    assert!(matches!(c.call(13, renew).await, Response::Renewed(_)));
    // Once one wait ends, there is room again.
    holder.call(3, release(&a)).await;
    let (id, answer) = c.recv().await.unwrap();
    assert_eq!(id, 10);
    grant(answer);
    grant(c.acquire(14, "wire:f3", 0).await);
    server.stop().await;
}

#[tokio::test]
async fn tokens_are_checked_per_connection() {
    const SECRET: &str = "wire-client-secret";
    let server = TestServer::start_configured(|c| {
        c.auth = AuthConfig {
            tokens: vec![TokenConfig {
                name: "wire".into(),
                role: Role::Client,
                prefixes: vec!["a:".into()],
                sha256: fencelock_server::auth::hash_token(SECRET),
                acquire_rate: None,
                request_rate: None,
                quotas: Default::default(),
            }],
        };
    })
    .await;
    let mut c = Conn::open(&server).await;
    assert_eq!(error_code(&c.acquire(1, "a:x", 0).await), "unauthenticated");
    let hello = |token: &str| {
        Request::Hello(Hello {
            token: token.into(),
        })
    };
    assert_eq!(
        error_code(&c.call(2, hello("wrong")).await),
        "unauthenticated"
    );
    assert_eq!(error_code(&c.acquire(3, "a:x", 0).await), "unauthenticated");
    assert_eq!(c.call(4, hello(SECRET)).await, Response::Welcome);
    grant(c.acquire(5, "a:x", 0).await);
    assert_eq!(
        error_code(&c.acquire(6, "b:x", 0).await),
        "permission_denied"
    );
    server.stop().await;
}

#[tokio::test]
async fn shutdown_answers_waiters_and_closes_connections() {
    let server = TestServer::start().await;
    let mut holder = Conn::open(&server).await;
    grant(holder.acquire(1, "wire:s", 0).await);
    let mut waiter = Conn::open(&server).await;
    waiter.send(2, acquire("wire:s", 60_000)).await;
    assert_eq!(waiter.call(3, Request::Ping).await, Response::Pong);
    let _idle = Conn::open(&server).await;
    let stopping = tokio::spawn(server.stop());
    let (id, answer) = waiter.recv().await.expect("the waiter is answered");
    assert_eq!((id, error_code(&answer)), (2, "unavailable"));
    assert!(waiter.recv().await.is_none(), "then the connection closes");
    tokio::time::timeout(IO_TIMEOUT + Duration::from_secs(5), stopping)
        .await
        .expect("shutdown completes with wire connections open")
        .unwrap();
}
