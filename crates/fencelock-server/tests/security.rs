//! Authentication, authorization, limits and TLS over real sockets: each test starts
//! its own server on `127.0.0.1:0` with its own temporary data directory and tokens.
//!
//! The refusal tests take a fingerprint of the whole state with an admin token before
//! and after the refused requests, so "refused" always also means "changed nothing".

use crate::support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use fencelock_server::grpc::pb::locks_client::LocksClient;
use fencelock_server::grpc::pb::{
    self, AcquireRequest, CloseSessionRequest, ForceReleaseRequest, GetLockRequest,
    KeepAliveRequest, ListLocksRequest, OpenSessionRequest, ReleaseRequest, RenewRequest,
    WatchRequest,
};
use fencelock_server::grpc::ERROR_CODE_METADATA;
use fencelock_server::{AuthConfig, RateLimit, Role, ServerConfig, TlsConfig, TokenConfig};
use serde_json::{json, Value};
use support::{poll_until, Response, TestServer, IO_TIMEOUT};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::Channel;
use tonic::{Code, Status};

const ADMIN: &str = "admin-secret";
const ADMIN_A: &str = "admin-a-secret";
const CLIENT_A: &str = "client-a-secret";
const CLIENT_A2: &str = "client-a2-secret";
const READER_A: &str = "reader-a-secret";
const LIMITED: &str = "limited-secret";

fn token(name: &str, role: Role, prefixes: &[&str], secret: &str) -> TokenConfig {
    TokenConfig {
        name: name.to_owned(),
        role,
        prefixes: prefixes.iter().map(|p| (*p).to_owned()).collect(),
        sha256: fencelock_server::auth::hash_token(secret),
        acquire_rate: None,
        request_rate: None,
        quotas: Default::default(),
    }
}

/// Tokens: an admin of everything, and an admin, two clients and a reader of `a:`.
fn tokens() -> AuthConfig {
    let mut limited = token("limited", Role::Client, &[""], LIMITED);
    limited.acquire_rate = Some(RateLimit {
        per_second: 1,
        burst: 3,
    });
    AuthConfig {
        tokens: vec![
            token("root", Role::Admin, &[""], ADMIN),
            token("admin-a", Role::Admin, &["a:"], ADMIN_A),
            token("client-a", Role::Client, &["a:"], CLIENT_A),
            token("client-a2", Role::Client, &["a:"], CLIENT_A2),
            token("reader-a", Role::Reader, &["a:"], READER_A),
            limited,
        ],
    }
}

async fn secure_server(adjust: impl FnOnce(&mut ServerConfig)) -> TestServer {
    TestServer::start_configured(|c| {
        c.auth = tokens();
        adjust(c);
    })
    .await
}

/// How a request presents (or fails to present) credentials.
#[derive(Debug, Clone, Copy)]
enum Cred<'a> {
    None,
    Bearer(&'a str),
    Header(&'a str),
    Cookie(&'a str),
}

async fn call(
    t: &TestServer,
    cred: Cred<'_>,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> Response {
    let auth;
    let mut headers: Vec<(&str, &str)> = Vec::new();
    match cred {
        Cred::None => {}
        Cred::Bearer(token) => {
            auth = format!("Bearer {token}");
            headers.push(("Authorization", &auth));
        }
        Cred::Header(value) => headers.push(("Authorization", value)),
        Cred::Cookie(token) => {
            auth = format!("fencelock_token={token}");
            headers.push(("Cookie", &auth));
        }
    }
    let bytes = body.map(|b| b.to_string()).unwrap_or_default();
    if body.is_some() {
        headers.push(("Content-Type", "application/json"));
    }
    t.client
        .request(method, path, &headers, bytes.as_bytes())
        .await
}

async fn admin(t: &TestServer, method: &str, path: &str, body: Option<Value>) -> Value {
    call(t, Cred::Bearer(ADMIN), method, path, body.as_ref())
        .await
        .expect_json(200)
}

/// Everything a refused request could have changed, read with the admin token:
/// every lock with its holders' fences and owners and its waiters, and the number
/// of open sessions.
async fn fingerprint(t: &TestServer) -> Value {
    let list = admin(t, "GET", "/v1/locks?limit=1000", None).await;
    let locks: Vec<Value> = list["locks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            let holders: Vec<Value> = l["holders"]
                .as_array()
                .unwrap()
                .iter()
                .map(|h| json!([h["fence"], h["owner"], h["session"]]))
                .collect();
            json!({"name": l["name"], "holders": holders, "waiters": l["waiters"]})
        })
        .collect();
    let metrics = call(t, Cred::Bearer(ADMIN), "GET", "/metrics", None).await;
    assert_eq!(metrics.status, 200);
    let sessions = support::metric(&metrics.text(), "fencelock_sessions");
    json!({"locks": locks, "sessions": sessions})
}

async fn acquire_as(t: &TestServer, secret: &str, name: &str) -> Value {
    call(
        t,
        Cred::Bearer(secret),
        "POST",
        "/v1/acquire",
        Some(&json!({"name": name, "ttl_ms": 60_000, "owner": "test"})),
    )
    .await
    .expect_json(200)
}

/// Locks `a:held` and `b:held` (own leases) and `b:sess` (in a session), all taken
/// by the admin. Returns the owner tokens of the first two and the session id.
async fn setup(t: &TestServer) -> (String, String, String) {
    let a = acquire_as(t, ADMIN, "a:held").await;
    let b = acquire_as(t, ADMIN, "b:held").await;
    let session = admin(
        t,
        "POST",
        "/v1/sessions",
        Some(json!({"ttl_ms": 60_000, "owner": "s"})),
    )
    .await;
    let session = session["session"].as_str().unwrap().to_owned();
    admin(
        t,
        "POST",
        "/v1/acquire",
        Some(json!({"name": "b:sess", "session": session})),
    )
    .await;
    (
        a["owner_token"].as_str().unwrap().to_owned(),
        b["owner_token"].as_str().unwrap().to_owned(),
        session,
    )
}

/// Every HTTP endpoint but the open health checks, aimed at `b:` locks (outside the
/// `a:` tokens' prefixes), with real owner tokens and session ids so that an
/// endpoint that forgot its check would visibly change the state.
fn endpoints(b_token: &str, session: &str) -> Vec<(&'static str, String, Option<Value>)> {
    vec![
        (
            "POST",
            "/v1/acquire".into(),
            Some(json!({"name": "b:new", "ttl_ms": 60_000})),
        ),
        (
            "POST",
            "/v1/renew".into(),
            Some(json!({"name": "b:held", "owner_token": b_token, "ttl_ms": 10})),
        ),
        (
            "POST",
            "/v1/release".into(),
            Some(json!({"name": "b:held", "owner_token": b_token})),
        ),
        ("GET", "/v1/locks/b:held".into(), None),
        ("GET", "/v1/locks?prefix=b:".into(), None),
        (
            "POST",
            "/v1/sessions".into(),
            Some(json!({"ttl_ms": 60_000})),
        ),
        ("POST", format!("/v1/sessions/{session}/keepalive"), None),
        ("DELETE", format!("/v1/sessions/{session}"), None),
        (
            "POST",
            "/v1/admin/force-release".into(),
            Some(json!({"name": "b:held", "reason": "test"})),
        ),
        ("GET", "/v1/admin/snapshot".into(), None),
        ("GET", "/metrics".into(), None),
        ("GET", "/v1/audit".into(), None),
        ("GET", "/v1/watch?prefix=b:".into(), None),
        ("GET", "/no/such/route".into(), None),
    ]
}

#[tokio::test]
async fn every_http_endpoint_refuses_missing_or_wrong_credentials_without_a_change() {
    let t = secure_server(|_| {}).await;
    let (_, b_token, session) = setup(&t).await;
    let before = fingerprint(&t).await;

    for (method, path, body) in endpoints(&b_token, &session) {
        for cred in [
            Cred::None,
            Cred::Bearer("wrong"),
            Cred::Bearer(""),
            Cred::Header("Basic YWRtaW4tc2VjcmV0"),
            Cred::Header(ADMIN),
            Cred::Cookie("wrong"),
        ] {
            let r = call(&t, cred, method, &path, body.as_ref()).await;
            let what = format!("{method} {path} with {cred:?}");
            assert_eq!(r.status, 401, "{what}: {}", r.text());
            r.expect_error(401, "unauthenticated");
            assert!(
                r.header("www-authenticate")
                    .is_some_and(|v| v.starts_with("Bearer")),
                "{what}: {:?}",
                r.headers
            );
        }
    }
    assert_eq!(fingerprint(&t).await, before);
    // The session was not closed, nor its lock released.
    admin(
        &t,
        "POST",
        &format!("/v1/sessions/{session}/keepalive"),
        None,
    )
    .await;
    admin(&t, "GET", "/v1/locks/b:sess", None).await;

    // Health checks stay open.
    assert_eq!(
        call(&t, Cred::None, "GET", "/healthz", None).await.status,
        200
    );
    assert_eq!(
        call(&t, Cred::None, "GET", "/readyz", None).await.status,
        200
    );
    t.stop().await;
}

#[tokio::test]
async fn every_http_endpoint_refuses_what_the_token_may_not_do_without_a_change() {
    let t = secure_server(|_| {}).await;
    let (a_token, b_token, session) = setup(&t).await;
    let before = fingerprint(&t).await;

    // Out of prefix (client-a and admin-a may only touch `a:`) or out of role.
    for (method, path, body) in endpoints(&b_token, &session) {
        // /metrics counts every lock: refused to tokens limited to some prefixes.
        let allowed_anyway = matches!(path.as_str(), "/no/such/route")
            || path.starts_with("/v1/sessions")
            || path == "/v1/audit";
        for secret in [CLIENT_A, ADMIN_A, READER_A] {
            let r = call(&t, Cred::Bearer(secret), method, &path, body.as_ref()).await;
            let what = format!("{method} {path} as {secret}: {}", r.text());
            if allowed_anyway {
                // Sessions are not tied to a prefix; a reader may still not use them.
                if path.starts_with("/v1/sessions") && secret == READER_A {
                    r.expect_error(403, "permission_denied");
                } else {
                    assert_ne!(r.status, 401, "{what}");
                    assert_ne!(r.status, 403, "{what}");
                }
                continue;
            }
            assert_eq!(r.status, 403, "{what}");
            r.expect_error(403, "permission_denied");
        }
    }
    // The session calls above that were allowed (keepalive, close by client-a) did
    // change something: take the fingerprint again from here on.
    let _ = before;
    let before = fingerprint(&t).await;

    // Within the prefix, but not the role.
    let role_cases: Vec<(&str, &str, Value)> = vec![
        (
            CLIENT_A,
            "/v1/admin/force-release",
            json!({"name": "a:held", "reason": "x"}),
        ),
        (
            READER_A,
            "/v1/acquire",
            json!({"name": "a:new", "ttl_ms": 60_000}),
        ),
        (
            READER_A,
            "/v1/release",
            json!({"name": "a:held", "owner_token": a_token}),
        ),
        (
            READER_A,
            "/v1/renew",
            json!({"name": "a:held", "owner_token": a_token}),
        ),
        (
            READER_A,
            "/v1/admin/force-release",
            json!({"name": "a:held", "reason": "x"}),
        ),
    ];
    for (secret, path, body) in role_cases {
        let r = call(&t, Cred::Bearer(secret), "POST", path, Some(&body)).await;
        let message = r.expect_error(403, "permission_denied");
        assert!(message.contains("role"), "{path} as {secret}: {message}");
    }
    // A client token of every prefix still cannot take a snapshot (admin only).
    let r = call(&t, Cred::Bearer(LIMITED), "GET", "/v1/admin/snapshot", None).await;
    r.expect_error(403, "permission_denied");
    assert_eq!(fingerprint(&t).await, before);

    // What the tokens may do, they can.
    let r = call(&t, Cred::Bearer(READER_A), "GET", "/v1/locks/a:held", None).await;
    assert_eq!(r.expect_json(200)["name"], "a:held");
    let r = call(
        &t,
        Cred::Bearer(ADMIN_A),
        "POST",
        "/v1/admin/force-release",
        Some(&json!({"name": "a:held", "reason": "test"})),
    )
    .await;
    assert_eq!(r.expect_json(200)["fences"].as_array().unwrap().len(), 1);
    let r = call(&t, Cred::Bearer(ADMIN), "GET", "/v1/admin/snapshot", None).await;
    assert_eq!(r.status, 200);
    t.stop().await;
}

#[tokio::test]
async fn listings_show_only_the_tokens_prefixes() {
    let t = secure_server(|_| {}).await;
    for name in ["a:1", "a:2", "b:1", "c"] {
        acquire_as(&t, ADMIN, name).await;
    }
    let names = |v: Value| -> Vec<String> {
        v["locks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["name"].as_str().unwrap().to_owned())
            .collect()
    };
    let list = |secret, query: &'static str| {
        let t = &t;
        async move {
            call(
                t,
                Cred::Bearer(secret),
                "GET",
                &format!("/v1/locks{query}"),
                None,
            )
            .await
        }
    };
    assert_eq!(
        names(list(READER_A, "").await.expect_json(200)),
        ["a:1", "a:2"]
    );
    assert_eq!(
        names(list(READER_A, "?prefix=a:2").await.expect_json(200)),
        ["a:2"]
    );
    // Paging across the cut-down listing.
    let page = list(READER_A, "?limit=1").await.expect_json(200);
    assert_eq!(page["next_after"], "a:1");
    let page = list(READER_A, "?limit=1&after=a:1").await.expect_json(200);
    assert_eq!(names(page), ["a:2"]);
    list(READER_A, "?prefix=b:")
        .await
        .expect_error(403, "permission_denied");
    assert_eq!(
        names(list(ADMIN, "").await.expect_json(200)),
        ["a:1", "a:2", "b:1", "c"]
    );
    t.stop().await;
}

#[tokio::test]
async fn cookie_authenticates_browsers_and_state_changes_must_be_same_origin() {
    let t = secure_server(|_| {}).await;
    let addr = t.addr().to_string();
    let cookie = format!("theme=dark; fencelock_token={CLIENT_A}");
    let r = t
        .client
        .request("GET", "/v1/locks", &[("Cookie", &cookie)], b"")
        .await;
    assert_eq!(r.expect_json(200)["locks"], json!([]));

    let body = json!({"name": "a:cookie", "ttl_ms": 60_000}).to_string();
    // Another site's page cannot make the browser acquire for its user.
    for origin in [None, Some("http://evil.example".to_owned())] {
        let mut headers = vec![("Cookie", cookie.as_str())];
        if let Some(origin) = &origin {
            headers.push(("Origin", origin.as_str()));
        }
        let r = t
            .client
            .request("POST", "/v1/acquire", &headers, body.as_bytes())
            .await;
        r.expect_error(403, "permission_denied");
    }
    assert_eq!(fingerprint(&t).await["locks"], json!([]));
    // The server's own pages can.
    let origin = format!("http://{addr}");
    let r = t
        .client
        .request(
            "POST",
            "/v1/acquire",
            &[("Cookie", &cookie), ("Origin", &origin)],
            body.as_bytes(),
        )
        .await;
    assert_eq!(r.expect_json(200)["name"], "a:cookie");
    t.stop().await;
}

#[tokio::test]
async fn request_ids_are_scoped_to_the_token() {
    let t = secure_server(|_| {}).await;
    let body = json!({"name": "a:idem", "ttl_ms": 60_000, "request_id": "r-1"});
    let first = call(
        &t,
        Cred::Bearer(CLIENT_A),
        "POST",
        "/v1/acquire",
        Some(&body),
    )
    .await
    .expect_json(200);
    // Another token presenting the same id does not get the grant (or its owner token).
    let other = call(
        &t,
        Cred::Bearer(CLIENT_A2),
        "POST",
        "/v1/acquire",
        Some(&body),
    )
    .await;
    other.expect_error(409, "held");
    // The same token retrying does.
    let again = call(
        &t,
        Cred::Bearer(CLIENT_A),
        "POST",
        "/v1/acquire",
        Some(&body),
    )
    .await
    .expect_json(200);
    assert_eq!(again["owner_token"], first["owner_token"]);
    assert_eq!(again["fence"], first["fence"]);
    // Clients may still send ids of the documented 128 bytes, and no more.
    let long = json!({"name": "a:long", "ttl_ms": 60_000, "request_id": "r".repeat(128)});
    call(
        &t,
        Cred::Bearer(CLIENT_A),
        "POST",
        "/v1/acquire",
        Some(&long),
    )
    .await
    .expect_json(200);
    let too_long = json!({"name": "a:long2", "ttl_ms": 60_000, "request_id": "r".repeat(129)});
    call(
        &t,
        Cred::Bearer(CLIENT_A),
        "POST",
        "/v1/acquire",
        Some(&too_long),
    )
    .await
    .expect_error(400, "invalid_argument");
    t.stop().await;
}

#[tokio::test]
async fn acquire_attempts_over_the_tokens_rate_get_429_and_recover() {
    let t = secure_server(|_| {}).await;
    // `limited` may make 3 attempts at once, then 1 per second: 20 attempts in a row
    // could only all pass if they took 17 s (the bucket itself is tested with a fake
    // clock in `auth.rs` and `limits.rs`).
    let mut refused = None;
    for i in 0..20 {
        let body = json!({"name": format!("r:{i}"), "ttl_ms": 60_000});
        let r = call(
            &t,
            Cred::Bearer(LIMITED),
            "POST",
            "/v1/acquire",
            Some(&body),
        )
        .await;
        if r.status == 429 {
            let message = r.expect_error(429, "rate_limited");
            assert_eq!(r.header("retry-after"), Some("1"));
            assert!(message.contains("retry in"), "{message}");
            refused = Some(format!("r:{i}"));
            break;
        }
        r.expect_json(200);
    }
    let refused = refused.expect("the rate limit refused an attempt");
    // The refused attempt took nothing.
    call(
        &t,
        Cred::Bearer(ADMIN),
        "GET",
        &format!("/v1/locks/{refused}"),
        None,
    )
    .await
    .expect_error(404, "not_found");
    // Other tokens are not affected.
    acquire_as(&t, ADMIN, "r:admin").await;
    // And the token recovers as its bucket refills.
    poll_until(
        "the rate-limited token to acquire again",
        IO_TIMEOUT,
        || async {
            let body = json!({"name": "r:later", "ttl_ms": 60_000});
            let r = call(
                &t,
                Cred::Bearer(LIMITED),
                "POST",
                "/v1/acquire",
                Some(&body),
            )
            .await;
            (r.status == 200).then_some(())
        },
    )
    .await;
    t.stop().await;
}

#[tokio::test]
async fn body_limit_is_configurable() {
    let t = secure_server(|c| c.limits.max_body_bytes = 2048).await;
    let body = json!({"name": "a:big", "ttl_ms": 60_000, "owner": "o".repeat(1000)});
    call(
        &t,
        Cred::Bearer(CLIENT_A),
        "POST",
        "/v1/acquire",
        Some(&body),
    )
    .await
    .expect_json(200);
    let body = json!({"name": "a:bigger", "ttl_ms": 60_000, "owner": "o".repeat(3000)});
    let message = call(
        &t,
        Cred::Bearer(CLIENT_A),
        "POST",
        "/v1/acquire",
        Some(&body),
    )
    .await
    .expect_error(413, "payload_too_large");
    assert!(message.contains("2048"), "{message}");
    t.stop().await;
}

/// An authenticated request on a new connection, which then closes.
const AUTHENTICATED_GET: &[u8] =
    b"GET /v1/locks HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer admin-secret\r\n\r\n";

/// A keep-alive connection that made one authenticated request (so it holds a slot
/// of `max_connections`) and then idles.
async fn admitted_idle_connection(t: &TestServer) -> tokio::net::TcpStream {
    let mut idle = tokio::net::TcpStream::connect(t.addr()).await.unwrap();
    idle.write_all(AUTHENTICATED_GET).await.unwrap();
    let mut head = Vec::new();
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let mut buf = [0u8; 1024];
        let n = tokio::time::timeout(IO_TIMEOUT, idle.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "closed before answering");
        head.extend_from_slice(&buf[..n]);
    }
    assert!(head.starts_with(b"HTTP/1.1 200"), "{head:?}");
    idle
}

/// Only authenticated connections count against `max_connections` (issue 19, item
/// 1): over it, an authenticated request is refused with 503, while `/healthz`
/// still answers (a connection that has not authenticated holds no slot).
#[tokio::test]
async fn connections_over_the_cap_get_503_until_one_closes() {
    let t = secure_server(|c| c.limits.max_connections = 1).await;
    // An open, idle, authenticated connection takes the only slot.
    let idle = admitted_idle_connection(&t).await;
    let answer = t.client.raw(AUTHENTICATED_GET, IO_TIMEOUT).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("\"unavailable\""), "{answer}");
    assert!(answer.contains("maximum of 1 connections"), "{answer}");
    let health = t
        .client
        .raw(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", IO_TIMEOUT)
        .await;
    assert!(health.starts_with(b"HTTP/1.1 200"), "{health:?}");
    drop(idle);
    poll_until("a connection slot to free up", IO_TIMEOUT, || async {
        let answer = t.client.raw(AUTHENTICATED_GET, IO_TIMEOUT).await;
        answer.starts_with(b"HTTP/1.1 200").then_some(())
    })
    .await;
    t.stop().await;
}

/// The server announces `max_streams_per_connection` as HTTP/2
/// SETTINGS_MAX_CONCURRENT_STREAMS, so clients queue calls beyond it.
#[tokio::test]
async fn http2_streams_per_connection_are_capped() {
    let t = secure_server(|c| c.limits.max_streams_per_connection = 7).await;
    let mut stream = tokio::net::TcpStream::connect(t.addr()).await.unwrap();
    // The client preface and an empty SETTINGS frame.
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend_from_slice(&[0, 0, 0, 0x4, 0, 0, 0, 0, 0]);
    stream.write_all(&hello).await.unwrap();
    let read_settings = async {
        loop {
            let mut head = [0u8; 9];
            stream.read_exact(&mut head).await.unwrap();
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let mut payload = vec![0u8; len];
            stream.read_exact(&mut payload).await.unwrap();
            let (kind, flags) = (head[3], head[4]);
            if kind == 0x4 && flags & 0x1 == 0 {
                return payload
                    .chunks(6)
                    .map(|e| {
                        let id = u16::from_be_bytes([e[0], e[1]]);
                        (id, u32::from_be_bytes([e[2], e[3], e[4], e[5]]))
                    })
                    .collect::<Vec<_>>();
            }
        }
    };
    let settings = tokio::time::timeout(IO_TIMEOUT, read_settings)
        .await
        .expect("the server's SETTINGS in time");
    // 0x3 = SETTINGS_MAX_CONCURRENT_STREAMS.
    assert!(settings.contains(&(0x3, 7)), "{settings:?}");
    drop(stream);
    t.stop().await;
}

#[tokio::test]
async fn bad_configurations_refuse_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let engine = fencelock_server::EngineConfig::new(dir.path());
    let mut exposed = ServerConfig::new("0.0.0.0:0".parse().unwrap(), engine.clone());
    let e = fencelock_server::Server::start(exposed.clone())
        .await
        .err()
        .expect("no auth on 0.0.0.0 is refused");
    assert!(e.message().contains("--insecure"), "{e}");
    exposed.auth = AuthConfig {
        tokens: vec![token("bad name", Role::Admin, &[""], "x")],
    };
    assert!(fencelock_server::Server::start(exposed).await.is_err());
    let mut tls = ServerConfig::new("127.0.0.1:0".parse().unwrap(), engine);
    tls.tls = Some(TlsConfig {
        cert_path: dir.path().join("missing.pem"),
        key_path: dir.path().join("missing.key"),
    });
    let e = fencelock_server::Server::start(tls)
        .await
        .err()
        .expect("missing certificate files are refused");
    assert!(e.message().contains("missing.pem"), "{e}");
}

// ---------------------------------------------------------------------------------
// gRPC

fn grpc_code(status: &Status) -> Option<&str> {
    status.metadata().get(ERROR_CODE_METADATA)?.to_str().ok()
}

fn req<T>(message: T, credentials: Option<&str>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(value) = credentials {
        request
            .metadata_mut()
            .insert("authorization", value.parse().unwrap());
    }
    request
}

/// Every gRPC method, aimed at `b:` locks, with `credentials` as the whole
/// `authorization` value; the result of each, by method name.
async fn every_grpc_call(
    c: &mut LocksClient<Channel>,
    credentials: Option<&str>,
    b_token: &str,
    session: &str,
) -> Vec<(&'static str, Result<(), Status>)> {
    let cr = credentials;
    let mut out: Vec<(&'static str, Result<(), Status>)> = Vec::new();
    let acquire = AcquireRequest {
        name: "b:new".into(),
        ttl_ms: Some(60_000),
        ..Default::default()
    };
    out.push(("Acquire", c.acquire(req(acquire, cr)).await.map(drop)));
    let renew = RenewRequest {
        name: "b:held".into(),
        owner_token: b_token.into(),
        ttl_ms: Some(10),
    };
    out.push(("Renew", c.renew(req(renew, cr)).await.map(drop)));
    let release = ReleaseRequest {
        name: "b:held".into(),
        owner_token: b_token.into(),
    };
    out.push(("Release", c.release(req(release, cr)).await.map(drop)));
    let force = ForceReleaseRequest {
        name: "b:held".into(),
        fence: None,
        reason: "test".into(),
    };
    out.push((
        "ForceRelease",
        c.force_release(req(force, cr)).await.map(drop),
    ));
    let get = GetLockRequest {
        name: "b:held".into(),
    };
    out.push(("GetLock", c.get_lock(req(get, cr)).await.map(drop)));
    let list = ListLocksRequest {
        prefix: "b:".into(),
        ..Default::default()
    };
    out.push(("ListLocks", c.list_locks(req(list, cr)).await.map(drop)));
    let open = OpenSessionRequest {
        ttl_ms: 60_000,
        owner: String::new(),
    };
    out.push(("OpenSession", c.open_session(req(open, cr)).await.map(drop)));
    let close = CloseSessionRequest {
        session: session.into(),
    };
    out.push((
        "CloseSession",
        c.close_session(req(close, cr)).await.map(drop),
    ));
    let keepalive = futures_util::stream::iter(vec![KeepAliveRequest {
        session: session.into(),
    }]);
    out.push((
        "KeepAlive",
        c.keep_alive(req(keepalive, cr)).await.map(drop),
    ));
    let watch = WatchRequest {
        prefix: "b:".into(),
        after: None,
    };
    out.push(("Watch", c.watch(req(watch, cr)).await.map(drop)));
    out
}

async fn grpc_client(t: &TestServer) -> LocksClient<Channel> {
    LocksClient::connect(format!("http://{}", t.addr()))
        .await
        .expect("the gRPC client connects")
}

#[tokio::test]
async fn every_grpc_method_refuses_bad_credentials_and_other_prefixes_without_a_change() {
    let t = secure_server(|_| {}).await;
    let (_, b_token, session) = setup(&t).await;
    let before = fingerprint(&t).await;
    let mut c = grpc_client(&t).await;

    for credentials in [None, Some("Bearer wrong"), Some("Basic eA=="), Some(ADMIN)] {
        for (method, result) in every_grpc_call(&mut c, credentials, &b_token, &session).await {
            let status = result.expect_err(method);
            assert_eq!(status.code(), Code::Unauthenticated, "{method}: {status:?}");
            assert_eq!(grpc_code(&status), Some("unauthenticated"), "{method}");
        }
    }
    let client = format!("Bearer {CLIENT_A}");
    for (method, result) in every_grpc_call(&mut c, Some(&client), &b_token, &session).await {
        match method {
            // Not about a lock: client-a may use sessions.
            "OpenSession" | "CloseSession" | "KeepAlive" => {}
            _ => {
                let status = result.expect_err(method);
                assert_eq!(
                    status.code(),
                    Code::PermissionDenied,
                    "{method}: {status:?}"
                );
                assert_eq!(grpc_code(&status), Some("permission_denied"), "{method}");
            }
        }
    }
    let reader = format!("Bearer {READER_A}");
    for (method, result) in every_grpc_call(&mut c, Some(&reader), &b_token, &session).await {
        let status = result.expect_err(method);
        assert_eq!(
            status.code(),
            Code::PermissionDenied,
            "{method}: {status:?}"
        );
    }
    // client-a closed the session above (allowed); everything else is as it was.
    let mut before = before;
    let after = fingerprint(&t).await;
    before["sessions"] = after["sessions"].clone();
    let without_session = |v: &Value| {
        v["locks"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|l| l["name"] != "b:sess")
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(without_session(&after), without_session(&before));
    admin(&t, "GET", "/v1/locks/b:held", None).await;

    // A client token cannot force-release even inside its prefixes.
    let force = ForceReleaseRequest {
        name: "a:held".into(),
        fence: None,
        reason: "x".into(),
    };
    let status = c
        .force_release(req(force, Some(&client)))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    admin(&t, "GET", "/v1/locks/a:held", None).await;
    t.stop().await;
}

#[tokio::test]
async fn grpc_watch_and_list_are_cut_down_to_the_prefixes() {
    let t = secure_server(|_| {}).await;
    let mut c = grpc_client(&t).await;
    let reader = format!("Bearer {READER_A}");
    let mut events = c
        .watch(req(
            WatchRequest {
                prefix: String::new(),
                after: None,
            },
            Some(&reader),
        ))
        .await
        .unwrap()
        .into_inner();
    acquire_as(&t, ADMIN, "b:first").await;
    acquire_as(&t, ADMIN, "a:second").await;
    let event = tokio::time::timeout(IO_TIMEOUT, events.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(event.name, "a:second", "b:first is outside the prefixes");
    assert_eq!(event.kind, pb::EventKind::Granted as i32);

    let list = c
        .list_locks(req(ListLocksRequest::default(), Some(&reader)))
        .await
        .unwrap()
        .into_inner();
    let names: Vec<&str> = list.locks.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["a:second"]);
    t.stop().await;
}

#[tokio::test]
async fn grpc_rate_limit_is_resource_exhausted_with_code_rate_limited() {
    let t = secure_server(|_| {}).await;
    let mut c = grpc_client(&t).await;
    let limited = format!("Bearer {LIMITED}");
    let mut refused = false;
    for i in 0..20 {
        let acquire = AcquireRequest {
            name: format!("g:{i}"),
            ttl_ms: Some(60_000),
            ..Default::default()
        };
        match c.acquire(req(acquire, Some(&limited))).await {
            Ok(_) => {}
            Err(status) => {
                assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
                assert_eq!(grpc_code(&status), Some("rate_limited"));
                refused = true;
                break;
            }
        }
    }
    assert!(refused, "the rate limit refused an attempt");
    t.stop().await;
}

/// The value of `fencelock_requests_refused_total{reason="…"}` (or of a metric without
/// labels when `reason` is empty), read with the admin token.
async fn refused(t: &TestServer, metric: &str, reason: &str) -> u64 {
    let text = call(t, Cred::Bearer(ADMIN), "GET", "/metrics", None).await;
    assert_eq!(text.status, 200);
    let body = String::from_utf8_lossy(&text.body).into_owned();
    let series = if reason.is_empty() {
        format!("{metric} ")
    } else {
        format!("{metric}{{reason=\"{reason}\"}} ")
    };
    body.lines()
        .find_map(|l| l.strip_prefix(&series))
        .unwrap_or_else(|| panic!("{series} not in /metrics:\n{body}"))
        .parse()
        .unwrap()
}

/// Refusals at the edge are counted by reason, over both protocols, and connections
/// over the cap are counted too.
#[tokio::test]
async fn refusals_are_counted_in_the_metrics() {
    const REFUSED: &str = "fencelock_requests_refused_total";
    let t = secure_server(|_| {}).await;
    assert_eq!(refused(&t, REFUSED, "unauthenticated").await, 0);
    let body = json!({"name": "b:x", "ttl_ms": 60_000});
    call(&t, Cred::None, "POST", "/v1/acquire", Some(&body))
        .await
        .expect_error(401, "unauthenticated");
    call(
        &t,
        Cred::Bearer(CLIENT_A),
        "POST",
        "/v1/acquire",
        Some(&body),
    )
    .await
    .expect_error(403, "permission_denied");
    let mut c = grpc_client(&t).await;
    let acquire = || AcquireRequest {
        name: "b:x".into(),
        ttl_ms: Some(60_000),
        ..Default::default()
    };
    let status = c.acquire(req(acquire(), None)).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
    let status = c
        .acquire(req(acquire(), Some(&format!("Bearer {CLIENT_A}"))))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    assert_eq!(refused(&t, REFUSED, "unauthenticated").await, 2);
    assert_eq!(refused(&t, REFUSED, "permission_denied").await, 2);

    let limited = format!("Bearer {LIMITED}");
    let mut rate_limited = 0;
    for i in 0..20 {
        let mut request = acquire();
        request.name = format!("g:{i}");
        if c.acquire(req(request, Some(&limited))).await.is_err() {
            rate_limited += 1;
        }
    }
    assert!(rate_limited > 0);
    assert_eq!(refused(&t, REFUSED, "rate_limited").await, rate_limited);
    t.stop().await;

    let t = secure_server(|c| c.limits.max_connections = 1).await;
    let idle = admitted_idle_connection(&t).await;
    let answer = t.client.raw(AUTHENTICATED_GET, IO_TIMEOUT).await;
    assert!(answer.starts_with(b"HTTP/1.1 503"));
    drop(idle);
    let count = poll_until("a connection slot to free up", IO_TIMEOUT, || async {
        let text = call(&t, Cred::Bearer(ADMIN), "GET", "/metrics", None).await;
        (text.status == 200).then(|| String::from_utf8_lossy(&text.body).into_owned())
    })
    .await;
    let line = count
        .lines()
        .find(|l| l.starts_with("fencelock_connections_refused_total "))
        .unwrap();
    assert_ne!(line, "fencelock_connections_refused_total 0", "{line}");
    t.stop().await;
}

// ---------------------------------------------------------------------------------
// TLS

/// A test CA and a certificate for `localhost` / `127.0.0.1` signed by it. Returns
/// (CA certificate, server certificate, server key).
fn test_ca(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let ca = fencelock_testkit::TestCa::create(dir).expect("make a test CA");
    (ca.ca_cert, ca.server_cert, ca.server_key)
}

fn tls_connector(ca: &Path, alpn: &[u8]) -> tokio_rustls::TlsConnector {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let mut config = rustls::ClientConfig::builder_with_provider(fencelock_server::tls::provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![alpn.to_vec()];
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

#[tokio::test]
async fn tls_round_trip_for_http1_and_grpc_with_a_test_ca() {
    let certs = tempfile::tempdir().unwrap();
    let (ca, cert, key) = test_ca(certs.path());
    let t = secure_server(|c| {
        c.tls = Some(TlsConfig {
            cert_path: cert,
            key_path: key,
        })
    })
    .await;
    let addr = t.addr();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();

    // HTTP/1.1 over TLS, with a token.
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut tls = tls_connector(&ca, b"http/1.1")
        .connect(name.clone(), tcp)
        .await
        .expect("the TLS handshake succeeds");
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    let body = json!({"name": "a:tls", "ttl_ms": 60_000}).to_string();
    let request = format!(
        "POST /v1/acquire HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {CLIENT_A}\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    tls.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(IO_TIMEOUT, tls.read_to_end(&mut answer)).await;
    // A peer that closes without close_notify is still a complete HTTP answer here.
    let _ = read.expect("an answer in time");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("\"fence\":1"), "{answer}");

    // gRPC (HTTP/2, ALPN h2) over TLS.
    let connector = tls_connector(&ca, b"h2");
    let channel = tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_uri| {
            let connector = connector.clone();
            let name = name.clone();
            async move {
                let tcp = tokio::net::TcpStream::connect(addr).await?;
                let tls = connector.connect(name, tcp).await?;
                assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
            }
        }))
        .await
        .expect("the gRPC channel connects over TLS");
    let mut c = LocksClient::new(channel);
    let client = format!("Bearer {CLIENT_A}");
    let info = c
        .get_lock(req(
            GetLockRequest {
                name: "a:tls".into(),
            },
            Some(&client),
        ))
        .await
        .expect("GetLock over TLS")
        .into_inner();
    assert_eq!(info.holders[0].fence, 1);
    let status = c
        .get_lock(req(
            GetLockRequest {
                name: "a:tls".into(),
            },
            None,
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);

    // Plain text on the TLS port gets no HTTP answer.
    let answer = t
        .client
        .raw(
            b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n",
            Duration::from_secs(5),
        )
        .await;
    assert!(!answer.starts_with(b"HTTP/1.1 200"), "{answer:?}");
    // A client that never finishes its handshake does not block others: with it
    // connected, a new TLS connection still works.
    let _silent = tokio::net::TcpStream::connect(addr).await.unwrap();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut tls = tls_connector(&ca, b"http/1.1")
        .connect(
            rustls::pki_types::ServerName::try_from("localhost").unwrap(),
            tcp,
        )
        .await
        .expect("a handshake while another is pending");
    tls.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(IO_TIMEOUT, tls.read_to_end(&mut answer))
        .await
        .expect("an answer in time");
    assert!(
        answer.starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&answer)
    );
    t.stop().await;
}

/// A client that connects and never starts its TLS handshake is disconnected after
/// `tls_handshake_timeout`, so it cannot hold a connection slot for long.
#[tokio::test]
async fn a_silent_tls_client_is_dropped_after_the_handshake_timeout() {
    let certs = tempfile::tempdir().unwrap();
    let (_, cert, key) = test_ca(certs.path());
    let t = secure_server(|c| {
        c.tls = Some(TlsConfig {
            cert_path: cert,
            key_path: key,
        });
        c.limits.tls_handshake_timeout = Duration::from_millis(200);
    })
    .await;
    let mut silent = tokio::net::TcpStream::connect(t.addr()).await.unwrap();
    let mut buf = [0u8; 16];
    // Without the timeout the server would wait for the handshake forever, and this
    // read would fail the test after IO_TIMEOUT.
    let read = tokio::time::timeout(IO_TIMEOUT, silent.read(&mut buf))
        .await
        .expect("the server closes the connection");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    t.stop().await;
}
