//! Request bodies of all three protocols through the server's own code — the router
//! it serves (`fencelock_server::secure_app`: authentication layer, body limit,
//! HTTP/JSON handlers, the gRPC service with its `ProtoCodec`), and the `flw/1` wire
//! connection — and a real engine, so each body takes exactly the server's parse →
//! validate → `Core::apply` path.
//!
//! Contract: an HTTP answer below 500; a gRPC answer with HTTP 200 and a status that
//! is not UNKNOWN, INTERNAL, UNAVAILABLE or UNIMPLEMENTED; the engine still running.
//! One engine (in a temp dir, without fsync) serves every input of a process; the
//! core's bounds are small so its state stays bounded however long the run.

use std::sync::OnceLock;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use fencelock_server::auth::Authenticator;
use fencelock_server::{AuthConfig, Durability, EngineConfig, Handle, Limits, RunState};
use http_body_util::BodyExt;
use tower::ServiceExt;

use crate::{plant, MAX_INPUT_BYTES};

/// A request that takes longer than this is a hang: the harness panics.
const REQUEST_DEADLINE: Duration = Duration::from_secs(5);
/// How long a streaming gRPC call (KeepAlive, Watch) is read before it is dropped.
const STREAM_WINDOW: Duration = Duration::from_millis(20);

struct Fixture {
    runtime: tokio::runtime::Runtime,
    router: axum::Router,
    handle: Handle,
    authenticator: Authenticator,
    limits: Limits,
    _dir: tempfile::TempDir,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("tokio runtime");
        let dir = tempfile::tempdir().expect("temp dir");
        let mut engine = EngineConfig::new(dir.path().join("data"));
        engine.durability = Durability::None;
        engine.segment_bytes = 1 << 20;
        engine.snapshot_after_bytes = 1 << 20;
        engine.audit.max_bytes = 1 << 20;
        // Small bounds: the state stays small, and waits end quickly.
        engine.core.max_wait_ms = 20;
        engine.core.max_lock_delay_ms = 20;
        engine.core.max_locks = 512;
        engine.core.max_sessions = 64;
        engine.core.max_waiters = 256;
        let limits = Limits {
            acquire_rate: None,
            ..Limits::default()
        };
        let auth = AuthConfig::default();
        let authenticator = Authenticator::new(&auth, None).expect("anonymous authenticator");
        let handle = runtime
            .block_on(async { fencelock_server::engine::start(engine) })
            .expect("engine starts");
        let router = fencelock_server::secure_app(handle.clone(), authenticator.clone(), &limits);
        Fixture {
            runtime,
            router,
            handle,
            authenticator,
            limits,
            _dir: dir,
        }
    })
}

const HTTP_ROUTES: [(Method, &str); 8] = [
    (Method::POST, "/v1/acquire"),
    (Method::POST, "/v1/renew"),
    (Method::POST, "/v1/release"),
    (Method::POST, "/v1/admin/force-release"),
    (Method::POST, "/v1/sessions"),
    (Method::DELETE, "/v1/sessions/"),
    (Method::GET, "/v1/locks?"),
    (Method::GET, "/v1/locks/"),
];

/// The first byte picks an endpoint; the rest is its JSON body (POST) or the end of
/// its path or query (DELETE/GET).
pub fn http(data: &[u8]) {
    if data.len() > MAX_INPUT_BYTES || data.is_empty() {
        return;
    }
    let (method, route) = &HTTP_ROUTES[usize::from(data[0]) % HTTP_ROUTES.len()];
    let rest = &data[1..];
    let request = if *method == Method::POST {
        Request::builder()
            .method(method)
            .uri(*route)
            .header("content-type", "application/json")
            .body(Body::from(rest.to_vec()))
    } else {
        let Ok(tail) = std::str::from_utf8(rest) else {
            return;
        };
        let uri = format!("{route}{tail}");
        if uri.parse::<axum::http::Uri>().is_err() {
            return;
        }
        Request::builder()
            .method(method)
            .uri(uri)
            .body(Body::empty())
    };
    let Ok(request) = request else { return };
    let f = fixture();
    let (status, body) = f.runtime.block_on(async {
        let call = async {
            let response = f.router.clone().oneshot(request).await.expect("infallible");
            let status = response.status();
            let body = response
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            (status, body)
        };
        tokio::time::timeout(REQUEST_DEADLINE, call)
            .await
            .unwrap_or_else(|_| {
                panic!("{method} {route} did not answer within {REQUEST_DEADLINE:?}")
            })
    });
    assert!(
        status.as_u16() < 500,
        "{method} {route} answered {status} to client input: {}",
        String::from_utf8_lossy(&body)
    );
    if *route == "/v1/acquire" && status == StatusCode::OK && body_limit_at_least_two(rest) {
        plant("http", "a semaphore acquire was granted");
    }
    check_running(&f.handle);
}

fn body_limit_at_least_two(body: &[u8]) -> bool {
    // The harness only looks; the server parsed the body already.
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("limit").and_then(serde_json::Value::as_u64))
        .is_some_and(|limit| limit >= 2)
}

const GRPC_METHODS: [&str; 10] = [
    "Acquire",
    "Renew",
    "Release",
    "ForceRelease",
    "GetLock",
    "ListLocks",
    "OpenSession",
    "CloseSession",
    "KeepAlive",
    "Watch",
];

/// The first byte picks a method (and, in its top bit, whether the rest is sent
/// raw, to attack the gRPC framing); otherwise the rest is one protobuf message in
/// a well-formed frame.
pub fn grpc(data: &[u8]) {
    if data.len() > MAX_INPUT_BYTES || data.is_empty() {
        return;
    }
    let method = GRPC_METHODS[usize::from(data[0] & 0x7f) % GRPC_METHODS.len()];
    let raw = data[0] & 0x80 != 0;
    let message = &data[1..];
    let body = if raw {
        message.to_vec()
    } else {
        let mut framed = Vec::with_capacity(5 + message.len());
        framed.push(0);
        framed.extend_from_slice(&(message.len() as u32).to_be_bytes());
        framed.extend_from_slice(message);
        framed
    };
    let request = Request::builder()
        .method(Method::POST)
        .uri(format!("/fencelock.v1.Locks/{method}"))
        .version(axum::http::Version::HTTP_2)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Body::from(body))
        .expect("valid request");
    let streaming = matches!(method, "KeepAlive" | "Watch");
    let f = fixture();
    let (status, grpc_status, grpc_message) = f.runtime.block_on(async {
        let call = async {
            let response = f.router.clone().oneshot(request).await.expect("infallible");
            let status = response.status();
            let mut code = header_str(response.headers(), "grpc-status");
            let mut text = header_str(response.headers(), "grpc-message");
            let collect = response.into_body().collect();
            let collected = if streaming {
                tokio::time::timeout(STREAM_WINDOW, collect).await.ok()
            } else {
                Some(collect.await)
            };
            if let Some(Ok(c)) = collected {
                if let Some(trailers) = c.trailers() {
                    code = code.or_else(|| header_str(trailers, "grpc-status"));
                    text = text.or_else(|| header_str(trailers, "grpc-message"));
                }
            }
            (status, code, text)
        };
        tokio::time::timeout(REQUEST_DEADLINE, call)
            .await
            .unwrap_or_else(|_| panic!("gRPC {method} did not answer within {REQUEST_DEADLINE:?}"))
    });
    assert_eq!(
        status,
        StatusCode::OK,
        "gRPC {method}: HTTP status {status}"
    );
    // 2 UNKNOWN, 12 UNIMPLEMENTED, 13 INTERNAL, 14 UNAVAILABLE: never for client input.
    if let Some(code) = grpc_status.as_deref() {
        assert!(
            !matches!(code, "2" | "12" | "13" | "14"),
            "gRPC {method} answered status {code} ({grpc_message:?}) to client input"
        );
    }
    if method == "Acquire" && !raw && grpc_status.as_deref() == Some("0") {
        if let Ok(r) = <fencelock_proto::AcquireRequest as prost::Message>::decode(message) {
            if r.limit >= 2 {
                plant("grpc", "a semaphore acquire was granted");
            }
        }
    }
    check_running(&f.handle);
}

/// The bytes a client sends after the `flw/1` magic, through the server's wire
/// connection ([`fencelock_server::wire::serve_stream`]) over an in-memory stream.
///
/// Contract: every answer is a whole, well-formed response frame; no error answer
/// says `internal` or `unavailable`; the connection ends by itself once the input
/// does; the engine is still running.
pub fn wire(data: &[u8]) {
    use fencelock_proto::wire::{self as flw, Response};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    if data.len() > MAX_INPUT_BYTES {
        return;
    }
    let f = fixture();
    let output = f.runtime.block_on(async {
        let (mut client, server) = tokio::io::duplex(MAX_INPUT_BYTES + 4096);
        let serving = fencelock_server::wire::serve_stream(
            server,
            f.handle.clone(),
            f.authenticator.clone(),
            &f.limits,
        );
        let talk = async {
            client
                .write_all(&flw::CLIENT_MAGIC)
                .await
                .expect("in-memory write");
            client.write_all(data).await.expect("in-memory write");
            client.shutdown().await.expect("in-memory shutdown");
            let mut output = Vec::new();
            client
                .read_to_end(&mut output)
                .await
                .expect("in-memory read");
            output
        };
        let both = async { tokio::join!(serving, talk).1 };
        tokio::time::timeout(REQUEST_DEADLINE, both)
            .await
            .unwrap_or_else(|_| {
                panic!("the wire connection did not end within {REQUEST_DEADLINE:?}")
            })
    });
    assert_eq!(
        output.get(..flw::SERVER_MAGIC.len()),
        Some(&flw::SERVER_MAGIC[..]),
        "the server answers the magic first"
    );
    let mut rest = &output[flw::SERVER_MAGIC.len()..];
    while !rest.is_empty() {
        let n = flw::frame_len(rest, flw::MAX_FRAME_BYTES)
            .expect("the server frames its answers")
            .expect("the server's answers are whole frames");
        let (_, response) = flw::decode_response(&rest[..n]).expect("a well-formed answer");
        match &response {
            Response::Error(e) => assert!(
                !matches!(e.code.as_str(), "internal" | "unavailable"),
                "the wire protocol answered {} ({}) to client input",
                e.code,
                e.message
            ),
            Response::Grant(g) if data_asks_for_a_semaphore(data) && g.fence > 0 => {
                plant("wire", "a semaphore acquire was granted");
            }
            _ => {}
        }
        rest = &rest[n..];
    }
    check_running(&f.handle);
}

/// Whether any whole acquire frame in `data` asks for a semaphore (the harness only
/// looks; the server decoded the frames itself).
fn data_asks_for_a_semaphore(data: &[u8]) -> bool {
    use fencelock_proto::wire::{self as flw, Request};
    let mut rest = data;
    while let Ok(Some(n)) = flw::frame_len(rest, flw::MAX_FRAME_BYTES) {
        if let Ok((_, Request::Acquire(r))) = flw::decode_request(&rest[..n]) {
            if r.limit >= 2 {
                return true;
            }
        }
        rest = &rest[n..];
    }
    false
}

fn header_str(headers: &axum::http::HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

fn check_running(handle: &Handle) {
    let state = handle.state();
    assert_eq!(
        state,
        RunState::Running,
        "the engine stopped on client input"
    );
}
