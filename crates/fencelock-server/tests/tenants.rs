//! Sessions belong to the principal that opened them, admins manage them by handle
//! within their prefixes, and every mutating request is rate limited (issue 19
//! items 2, 3): over HTTP and gRPC, against an in-process server.

use crate::support;

use fencelock_proto::wire::{self, Hello, Request, Response as WireResponse};
use fencelock_proto::AcquireRequest;
use fencelock_server::grpc::pb::locks_client::LocksClient;
use fencelock_server::grpc::pb::{CloseSessionRequest, KeepAliveRequest};
use fencelock_server::{AuthConfig, QuotaOverrides, RateLimit, Role, TokenConfig};
use serde_json::{json, Value};
use support::{Response, TestServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;

fn token(name: &str, role: Role, prefixes: &[&str]) -> TokenConfig {
    TokenConfig {
        name: name.to_owned(),
        role,
        prefixes: prefixes.iter().map(|p| (*p).to_owned()).collect(),
        sha256: fencelock_server::auth::hash_token(&secret(name)),
        acquire_rate: None,
        request_rate: None,
        quotas: Default::default(),
    }
}

fn secret(name: &str) -> String {
    format!("{name}-secret")
}

/// Two clients of the same prefix (ownership is by principal, not by prefix), a
/// client of everything, an admin of `a:`, an admin of everything, and a token
/// allowed 2 mutating requests at once.
async fn server() -> TestServer {
    let mut one = token("one", Role::Client, &["a:"]);
    one.quotas = QuotaOverrides {
        max_held_locks: Some(1),
        ..QuotaOverrides::default()
    };
    let mut slow = token("slow", Role::Client, &["a:"]);
    slow.request_rate = Some(RateLimit {
        per_second: 1,
        burst: 2,
    });
    TestServer::start_configured(|c| {
        c.auth = AuthConfig {
            tokens: vec![
                token("a1", Role::Client, &["a:"]),
                token("a2", Role::Client, &["a:"]),
                token("wide", Role::Client, &[""]),
                token("adm", Role::Admin, &["a:"]),
                token("root", Role::Admin, &[""]),
                slow,
                one,
            ],
        }
    })
    .await
}

async fn call(
    t: &TestServer,
    who: &str,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> Response {
    let auth = format!("Bearer {}", secret(who));
    let mut headers = vec![("Authorization", auth.as_str())];
    let bytes = body.map(|b| b.to_string()).unwrap_or_default();
    if !bytes.is_empty() {
        headers.push(("Content-Type", "application/json"));
    }
    t.client
        .request(method, path, &headers, bytes.as_bytes())
        .await
}

async fn open(t: &TestServer, who: &str) -> (String, String) {
    let v = call(
        t,
        who,
        "POST",
        "/v1/sessions",
        Some(json!({"ttl_ms": 60_000})),
    )
    .await
    .expect_json(200);
    (
        v["session"].as_str().unwrap().to_owned(),
        v["handle"].as_str().unwrap().to_owned(),
    )
}

async fn attach(t: &TestServer, who: &str, name: &str, session: &str) -> Response {
    call(
        t,
        who,
        "POST",
        "/v1/acquire",
        Some(json!({"name": name, "session": session})),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_opener_or_a_covering_admin_manages_a_session() {
    let t = server().await;
    let (id, handle) = open(&t, "a1").await;
    attach(&t, "a1", "a:1", &id).await.expect_json(200);

    // a2 has the same prefix, but the session is a1's: every use is a 404 that
    // reads like a missing session.
    let keep = format!("/v1/sessions/{id}/keepalive");
    let close = format!("/v1/sessions/{id}");
    call(&t, "a2", "POST", &keep, None)
        .await
        .expect_error(404, "session_not_found");
    call(&t, "a2", "DELETE", &close, None)
        .await
        .expect_error(404, "session_not_found");
    attach(&t, "a2", "a:2", &id)
        .await
        .expect_error(404, "session_not_found");
    // Over gRPC too.
    let mut grpc = LocksClient::connect(format!("http://{}", t.addr()))
        .await
        .unwrap();
    let mut request = tonic::Request::new(CloseSessionRequest {
        session: id.clone(),
    });
    let bearer = format!("Bearer {}", secret("a2"));
    request
        .metadata_mut()
        .insert("authorization", bearer.parse().unwrap());
    assert_eq!(
        grpc.close_session(request).await.unwrap_err().code(),
        Code::NotFound
    );
    let keepalive = futures_util::stream::iter([KeepAliveRequest {
        session: id.clone(),
    }]);
    let mut request = tonic::Request::new(keepalive);
    request
        .metadata_mut()
        .insert("authorization", bearer.parse().unwrap());
    let status = match grpc.keep_alive(request).await {
        Ok(response) => response.into_inner().message().await.unwrap_err(),
        Err(status) => status,
    };
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    // The owner keeps it alive.
    call(&t, "a1", "POST", &keep, None).await.expect_json(200);
    // gRPC's OpenSession answers the id and the handle everyone else sees.
    let mut request = tonic::Request::new(fencelock_server::grpc::pb::OpenSessionRequest {
        ttl_ms: 60_000,
        owner: String::new(),
    });
    let a1 = format!("Bearer {}", secret("a1"));
    request
        .metadata_mut()
        .insert("authorization", a1.parse().unwrap());
    let opened = grpc.open_session(request).await.unwrap().into_inner();
    attach(&t, "a1", "a:3", &opened.session)
        .await
        .expect_json(200);
    let shown = call(&t, "a1", "GET", "/v1/locks/a:3", None)
        .await
        .expect_json(200);
    assert_eq!(shown["holders"][0]["session"], opened.handle.as_str());
    assert_ne!(opened.handle, opened.session);

    // adm (admin of a:) may manage it: it holds only a: locks. It lists it by
    // handle, with its principal, and never sees the id.
    let list = call(&t, "adm", "GET", "/v1/admin/sessions", None).await;
    assert!(!list.text().contains(&id), "{}", list.text());
    let list = list.expect_json(200);
    let first = list["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["handle"] == handle.as_str())
        .expect("a1's session is listed");
    assert_eq!(first["principal"], "a1");
    assert_eq!(first["locks"], 1);

    // A session of `wide` holding a: and b: locks is beyond adm, not beyond root.
    let (wide, wide_handle) = open(&t, "wide").await;
    attach(&t, "wide", "a:9", &wide).await.expect_json(200);
    attach(&t, "wide", "b:9", &wide).await.expect_json(200);
    let path = format!("/v1/admin/sessions/{wide_handle}");
    call(&t, "adm", "DELETE", &path, None)
        .await
        .expect_error(404, "session_not_found");
    call(&t, "adm", "DELETE", &format!("/v1/sessions/{wide}"), None)
        .await
        .expect_error(404, "session_not_found");
    call(&t, "a1", "DELETE", &path, None)
        .await
        .expect_error(403, "permission_denied");
    call(&t, "adm", "DELETE", "/v1/admin/sessions/xyz", None)
        .await
        .expect_error(400, "invalid_argument");
    let closed = call(&t, "root", "DELETE", &path, None)
        .await
        .expect_json(200);
    assert_eq!(closed["released"], 2);
    // adm closes a1's by id as well (an admin covering all its locks).
    call(&t, "adm", "DELETE", &close, None)
        .await
        .expect_json(200);

    let audit = call(&t, "root", "GET", "/v1/audit?limit=1000", None)
        .await
        .expect_json(200);
    let ends: Vec<(&Value, &Value)> = audit["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "session_ended")
        .map(|e| (&e["session"], &e["actor"]))
        .collect();
    assert_eq!(
        ends,
        [
            (&json!(wide_handle), &json!("root")),
            (&json!(handle), &json!("adm"))
        ]
    );
    t.stop().await;
}

#[tokio::test]
async fn session_and_lock_requests_share_the_request_rate_limit() {
    let t = server().await;
    let (id, _) = open(&t, "slow").await;
    call(
        &t,
        "slow",
        "POST",
        &format!("/v1/sessions/{id}/keepalive"),
        None,
    )
    .await
    .expect_json(200);
    // The burst of 2 is spent: sessions, renewals and releases are refused alike.
    for (method, path, body) in [
        (
            "POST",
            "/v1/sessions".to_owned(),
            Some(json!({"ttl_ms": 60_000})),
        ),
        ("POST", format!("/v1/sessions/{id}/keepalive"), None),
        ("DELETE", format!("/v1/sessions/{id}"), None),
        (
            "POST",
            "/v1/renew".to_owned(),
            Some(json!({"name": "a:1", "owner_token": "0123456789abcdef0123456789abcdef"})),
        ),
        (
            "POST",
            "/v1/release".to_owned(),
            Some(json!({"name": "a:1", "owner_token": "0123456789abcdef0123456789abcdef"})),
        ),
    ] {
        let r = call(&t, "slow", method, &path, body).await;
        assert_eq!(r.status, 429, "{method} {path}: {}", r.text());
        assert_eq!(r.error_code().as_deref(), Some("rate_limited"), "{path}");
    }
    t.stop().await;
}

/// One `flw/1` call on a fresh connection after `Hello` as `who`.
async fn wire_acquire(t: &TestServer, who: &str, request: AcquireRequest) -> WireResponse {
    let mut stream = tokio::net::TcpStream::connect(t.addr()).await.unwrap();
    stream.write_all(&wire::CLIENT_MAGIC).await.unwrap();
    let mut out = Vec::new();
    let hello = Request::Hello(Hello { token: secret(who) });
    wire::encode_request(&mut out, 1, &hello);
    wire::encode_request(&mut out, 2, &Request::Acquire(request));
    stream.write_all(&out).await.unwrap();
    let mut input = Vec::new();
    let mut magic = [0u8; 8];
    stream.read_exact(&mut magic).await.unwrap();
    let read = async {
        let mut answers = Vec::new();
        while answers.len() < 2 {
            if let Some(n) = wire::frame_len(&input, wire::MAX_FRAME_BYTES).unwrap() {
                answers.push(wire::decode_response(&input[..n]).unwrap());
                input.drain(..n);
                continue;
            }
            assert!(
                stream.read_buf(&mut input).await.unwrap() > 0,
                "closed early"
            );
        }
        answers
    };
    let answers = tokio::time::timeout(support::IO_TIMEOUT, read)
        .await
        .expect("answers in time");
    assert_eq!(answers[0], (1, WireResponse::Welcome));
    answers[1].1.clone()
}

fn wire_error(response: &WireResponse) -> &str {
    match response {
        WireResponse::Error(e) => &e.code,
        other => panic!("expected an error, got {other:?}"),
    }
}

/// `flw/1` goes through the same core checks: another principal's session is
/// `session_not_found`, and a token at its `max_held_locks` is `resource_exhausted`.
#[tokio::test]
async fn the_wire_protocol_enforces_ownership_and_quotas_too() {
    let t = server().await;
    let (id, _) = open(&t, "a1").await;
    let on_session = |name: &str, session: Option<String>| AcquireRequest {
        name: name.into(),
        ttl_ms: session.is_none().then_some(30_000),
        session,
        ..Default::default()
    };
    let stolen = wire_acquire(&t, "a2", on_session("a:w", Some(id.clone()))).await;
    assert_eq!(wire_error(&stolen), "session_not_found");
    let mine = wire_acquire(&t, "a1", on_session("a:w", Some(id.clone()))).await;
    assert!(matches!(mine, WireResponse::Grant(_)), "{mine:?}");

    let first = wire_acquire(&t, "one", on_session("a:1", None)).await;
    assert!(matches!(first, WireResponse::Grant(_)), "{first:?}");
    let second = wire_acquire(&t, "one", on_session("a:2", None)).await;
    assert_eq!(wire_error(&second), "resource_exhausted");
    t.stop().await;
}
