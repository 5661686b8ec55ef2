//! The lock kinds over `flw/1`: shared acquires, multi-locks, release-all,
//! downgrade and elections, and their bad inputs refused with `invalid_argument`.

use crate::support;

use fencelock_proto::wire::{self, Request, Response};
use fencelock_proto::{
    AcquireAllRequest, AcquireRequest, CampaignRequest, DowngradeRequest, Grant, LeaderRequest,
    ProclaimRequest, ReleaseAllRequest, ReleaseRequest,
};
use support::{TestServer, IO_TIMEOUT};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

struct Conn {
    stream: TcpStream,
    input: Vec<u8>,
}

impl Conn {
    async fn open(server: &TestServer) -> Conn {
        let mut stream = TcpStream::connect(server.addr()).await.expect("connected");
        stream.write_all(&wire::CLIENT_MAGIC).await.expect("sent");
        let mut magic = [0u8; 8];
        tokio::time::timeout(IO_TIMEOUT, stream.read_exact(&mut magic))
            .await
            .expect("the server answers the magic in time")
            .expect("read");
        assert_eq!(magic, wire::SERVER_MAGIC);
        Conn {
            stream,
            input: Vec::new(),
        }
    }

    async fn send(&mut self, id: u64, request: Request) {
        let mut out = Vec::new();
        wire::encode_request(&mut out, id, &request);
        self.stream.write_all(&out).await.expect("sent");
    }

    /// The next answer, whichever request it is for.
    async fn recv(&mut self) -> (u64, Response) {
        let read = async {
            loop {
                if let Some(n) =
                    wire::frame_len(&self.input, wire::MAX_FRAME_BYTES).expect("framed")
                {
                    let answer = wire::decode_response(&self.input[..n]).expect("decoded");
                    self.input.drain(..n);
                    return answer;
                }
                let n = self.stream.read_buf(&mut self.input).await.expect("read");
                assert!(n > 0, "the server closed the connection");
            }
        };
        tokio::time::timeout(IO_TIMEOUT, read)
            .await
            .expect("an answer in time")
    }

    async fn call(&mut self, id: u64, request: Request) -> Response {
        self.send(id, request).await;
        let (got, response) = self.recv().await;
        assert_eq!(got, id);
        response
    }
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

fn acquire(name: &str, mode: &str) -> Request {
    Request::Acquire(AcquireRequest {
        name: name.into(),
        ttl_ms: Some(30_000),
        mode: mode.into(),
        ..Default::default()
    })
}

#[tokio::test]
async fn kinds_round_trip_over_the_wire() {
    let server = TestServer::start().await;
    let mut c = Conn::open(&server).await;
    let r1 = grant(c.call(1, acquire("w:rw", "shared")).await);
    let r2 = grant(c.call(2, acquire("w:rw", "shared")).await);
    assert_eq!((r1.mode.as_str(), r2.mode.as_str()), ("shared", "shared"));
    assert_eq!(
        error_code(&c.call(3, acquire("w:rw", "exclusive")).await),
        "held"
    );

    let w = grant(c.call(4, acquire("w:w", "")).await);
    let d = grant(
        c.call(
            5,
            Request::Downgrade(DowngradeRequest {
                name: "w:w".into(),
                owner_token: w.owner_token.clone(),
            }),
        )
        .await,
    );
    assert_eq!((d.mode.as_str(), d.fence), ("shared", w.fence));

    let Response::GrantedAll(all) = c
        .call(
            6,
            Request::AcquireAll(AcquireAllRequest {
                names: vec!["w:a".into(), "w:b".into()],
                ttl_ms: Some(30_000),
                ..Default::default()
            }),
        )
        .await
    else {
        panic!("expected grants")
    };
    assert_eq!(all.grants.len(), 2);
    let grants = all
        .grants
        .iter()
        .map(|g| ReleaseRequest {
            name: g.name.clone(),
            owner_token: g.owner_token.clone(),
        })
        .collect();
    let Response::ReleasedAll(released) = c
        .call(7, Request::ReleaseAll(ReleaseAllRequest { grants }))
        .await
    else {
        panic!("expected a release")
    };
    assert_eq!(released.released, [true, true]);

    let lead = grant(
        c.call(
            8,
            Request::Campaign(CampaignRequest {
                name: "w:e".into(),
                value: "one".into(),
                ttl_ms: Some(30_000),
                ..Default::default()
            }),
        )
        .await,
    );
    grant(
        c.call(
            9,
            Request::Proclaim(ProclaimRequest {
                name: "w:e".into(),
                owner_token: lead.owner_token.clone(),
                value: "two".into(),
            }),
        )
        .await,
    );
    let Response::Leader(leader) = c
        .call(10, Request::Leader(LeaderRequest { name: "w:e".into() }))
        .await
    else {
        panic!("expected a leader")
    };
    let leader = leader.leader.expect("a leader");
    assert_eq!((leader.value.as_str(), leader.term), ("two", lead.fence));
}

#[tokio::test]
async fn bad_kind_inputs_over_the_wire_are_invalid_arguments() {
    let server = TestServer::start().await;
    let mut c = Conn::open(&server).await;
    let held = grant(c.call(1, acquire("w:held", "")).await);
    let set = |names: Vec<String>| {
        Request::AcquireAll(AcquireAllRequest {
            names,
            ttl_ms: Some(1000),
            ..Default::default()
        })
    };
    let many = (0..65).map(|i| format!("w:{i}")).collect();
    let cases = [
        ("unknown mode", acquire("w:x", "upgrade")),
        ("empty set", set(vec![])),
        ("duplicate names", set(vec!["w:x".into(), "w:x".into()])),
        ("set too large", set(many)),
        (
            "value too long",
            Request::Campaign(CampaignRequest {
                name: "w:e".into(),
                value: "v".repeat(4097),
                ttl_ms: Some(1000),
                ..Default::default()
            }),
        ),
        (
            "proclaimed value too long",
            Request::Proclaim(ProclaimRequest {
                name: "w:held".into(),
                owner_token: held.owner_token.clone(),
                value: "v".repeat(4097),
            }),
        ),
        (
            "release nothing",
            Request::ReleaseAll(ReleaseAllRequest { grants: vec![] }),
        ),
    ];
    for (i, (what, request)) in cases.into_iter().enumerate() {
        let answer = c.call(100 + i as u64, request).await;
        assert_eq!(error_code(&answer), "invalid_argument", "{what}");
    }
    // Nothing changed: the holder still holds, alone, exclusively, with no value.
    assert_eq!(
        error_code(&c.call(200, acquire("w:held", "shared")).await),
        "held"
    );
    let x = grant(c.call(201, acquire("w:x", "")).await);
    assert_eq!(
        x.mode, "exclusive",
        "w:x was never taken by a refused request"
    );
}

/// Waiters queued on `name`, as the HTTP API counts them.
async fn waiters(server: &TestServer, name: &str) -> u64 {
    let view = server.client.get(&format!("/v1/locks/{name}")).await;
    view.json()["waiters"].as_u64().unwrap_or(0)
}

#[tokio::test]
async fn cancel_takes_a_waiting_multi_lock_and_campaign_out_of_their_queues() {
    let server = TestServer::start().await;
    let mut holder = Conn::open(&server).await;
    let held = grant(holder.call(1, acquire("w:cm:a", "")).await);
    let leader = grant(
        holder
            .call(
                2,
                Request::Campaign(CampaignRequest {
                    name: "w:cm:e".into(),
                    value: "first".into(),
                    ttl_ms: Some(30_000),
                    ..Default::default()
                }),
            )
            .await,
    );

    let mut waiter = Conn::open(&server).await;
    waiter
        .send(
            5,
            Request::AcquireAll(AcquireAllRequest {
                names: vec!["w:cm:b".into(), "w:cm:a".into()],
                ttl_ms: Some(30_000),
                wait_ms: 20_000,
                ..Default::default()
            }),
        )
        .await;
    waiter
        .send(
            6,
            Request::Campaign(CampaignRequest {
                name: "w:cm:e".into(),
                value: "second".into(),
                ttl_ms: Some(30_000),
                wait_ms: 20_000,
                ..Default::default()
            }),
        )
        .await;
    // Both wait: each queue holds one waiter (the ping orders after the sends).
    assert_eq!(waiter.call(99, Request::Ping).await, Response::Pong);
    let deadline = tokio::time::Instant::now() + IO_TIMEOUT;
    while waiters(&server, "w:cm:a").await + waiters(&server, "w:cm:e").await < 2 {
        assert!(tokio::time::Instant::now() < deadline, "never queued");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(
        waiters(&server, "w:cm:b").await,
        1,
        "a multi-lock joins every queue"
    );

    for id in [5, 6] {
        waiter.send(id, Request::Cancel).await;
        let (got, answer) = waiter.recv().await;
        assert_eq!((got, error_code(&answer)), (id, "cancelled"));
    }
    // Out of every queue, and nothing else answered for them.
    assert_eq!(waiter.call(100, Request::Ping).await, Response::Pong);
    let deadline = tokio::time::Instant::now() + IO_TIMEOUT;
    loop {
        let left = [
            waiters(&server, "w:cm:a").await,
            waiters(&server, "w:cm:b").await,
            waiters(&server, "w:cm:e").await,
        ];
        if left == [0, 0, 0] {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "cancelled requests still queued: {left:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    // So the holders' releases hand nothing to the cancelled requests.
    holder
        .call(
            3,
            Request::Release(ReleaseRequest {
                name: held.name.clone(),
                owner_token: held.owner_token.clone(),
            }),
        )
        .await;
    holder
        .call(
            4,
            Request::Release(ReleaseRequest {
                name: leader.name.clone(),
                owner_token: leader.owner_token.clone(),
            }),
        )
        .await;
    for name in ["w:cm:a", "w:cm:b", "w:cm:e"] {
        let view = server.client.get(&format!("/v1/locks/{name}")).await;
        let holders = view.json()["holders"].as_array().map_or(0, Vec::len);
        assert_eq!(
            holders, 0,
            "{name} was granted to a cancelled request: {view:?}"
        );
    }
    assert_eq!(waiter.call(101, Request::Ping).await, Response::Pong);
}
