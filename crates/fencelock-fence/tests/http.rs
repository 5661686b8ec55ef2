//! The HTTP middleware, in front of an axum app whose handler records what it applied.

use crate::support;

use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::State;
use axum::routing::put;
use axum::Router;
use fencelock_fence::{render_prometheus, FenceLayer, GateMetrics, RequestHead};
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use support::Rng;
use tower::ServiceExt;

/// What the handler applied: (path, fence header) in the order the writes happened.
type Applied = Arc<Mutex<Vec<(String, u64)>>>;

/// An app with `PUT /items/{id}` behind the layer. The handler yields before it
/// records its write, so concurrent requests really overlap inside it.
fn app<K, G>(layer: FenceLayer<K, G>) -> (Router, Applied)
where
    FenceLayer<K, G>: tower::Layer<axum::routing::Route> + Clone + Send + Sync + 'static,
    <FenceLayer<K, G> as tower::Layer<axum::routing::Route>>::Service: tower::Service<
            Request<Body>,
            Response = http::Response<Body>,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + Sync
        + 'static,
    <<FenceLayer<K, G> as tower::Layer<axum::routing::Route>>::Service as tower::Service<
        Request<Body>,
    >>::Future: Send + 'static,
{
    let applied: Applied = Arc::default();
    let router = Router::new()
        .route(
            "/items/{id}",
            put(
                |State(applied): State<Applied>, req: Request<Body>| async move {
                    tokio::task::yield_now().await;
                    let fence = req.headers()["fencing-token"]
                        .to_str()
                        .unwrap()
                        .parse()
                        .unwrap();
                    applied
                        .lock()
                        .unwrap()
                        .push((req.uri().path().to_owned(), fence));
                    "applied"
                },
            )
            .get(|| async { "read" }),
        )
        .with_state(Arc::clone(&applied))
        .layer(layer);
    (router, applied)
}

async fn send(app: &Router, method: &str, path: &str, tokens: &[&str]) -> (StatusCode, Value) {
    let mut req = Request::builder().method(method).uri(path);
    for token in tokens {
        req = req.header("Fencing-Token", *token);
    }
    let response = app
        .clone()
        .oneshot(req.body(Body::empty()).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, body)
}

#[tokio::test]
async fn stale_tokens_get_409_and_never_reach_the_handler() {
    let layer = FenceLayer::by_path();
    let (app, applied) = app(layer.clone());

    assert_eq!(
        send(&app, "PUT", "/items/1", &["5"]).await,
        (StatusCode::OK, json!("applied"))
    );
    for stale in ["5", "4", "0"] {
        let (status, body) = send(&app, "PUT", "/items/1", &[stale]).await;
        assert_eq!(status, StatusCode::CONFLICT, "{body}");
        assert_eq!(body["error"]["code"], "stale_fence");
        assert_eq!(body["error"]["fence"], stale.parse::<u64>().unwrap());
        assert_eq!(body["error"]["last_fence"], 5);
        assert!(body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("/items/1"));
    }
    // Another key has its own fences.
    assert_eq!(
        send(&app, "PUT", "/items/2", &["1"]).await.0,
        StatusCode::OK
    );
    assert_eq!(
        send(&app, "PUT", "/items/1", &["6"]).await.0,
        StatusCode::OK
    );
    assert_eq!(
        *applied.lock().unwrap(),
        [
            ("/items/1".into(), 5),
            ("/items/2".into(), 1),
            ("/items/1".into(), 6)
        ]
    );
    assert_eq!(layer.stale_rejections(), 3);
    assert_eq!(layer.name(), "http");
    assert!(render_prometheus(&[&layer])
        .contains("fencelock_fence_stale_rejections_total{gate=\"http\"} 3\n"));
}

#[tokio::test]
async fn missing_or_malformed_tokens_are_refused_and_reads_pass() {
    let (app, applied) = app(FenceLayer::by_path());
    let (status, body) = send(&app, "PUT", "/items/1", &[]).await;
    assert_eq!(status, StatusCode::PRECONDITION_REQUIRED);
    assert_eq!(body["error"]["code"], "fence_required");
    for bad in [
        &["abc"][..],
        &["-1"],
        &["1.5"],
        &[" 7"],
        &[""],
        &["18446744073709551616"],
        &["3", "4"],
    ] {
        let (status, body) = send(&app, "PUT", "/items/1", bad).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad:?}: {body}");
        assert_eq!(body["error"]["code"], "invalid_fence", "{bad:?}");
    }
    assert_eq!(
        send(&app, "PUT", "/items/1", &["18446744073709551615"])
            .await
            .0,
        StatusCode::OK
    );
    // GET is not fenced by `by_path`: it passes without a token.
    assert_eq!(
        send(&app, "GET", "/items/1", &[]).await,
        (StatusCode::OK, json!("read"))
    );
    assert_eq!(applied.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn custom_key_function() {
    // Fence per tenant header; requests without the header are not fenced.
    let layer = FenceLayer::new(|req: &RequestHead<'_>| {
        req.headers
            .get("tenant")
            .map(|t| format!("tenant:{}", t.to_str().unwrap_or("?")))
    });
    let (app, _) = app(layer);
    let put = |tenant: Option<&'static str>, token: &'static str| {
        let app = app.clone();
        async move {
            let mut req = Request::put("/items/1").header("Fencing-Token", token);
            if let Some(t) = tenant {
                req = req.header("tenant", t);
            }
            app.oneshot(req.body(Body::empty()).unwrap())
                .await
                .unwrap()
                .status()
        }
    };
    assert_eq!(put(Some("a"), "5").await, StatusCode::OK);
    assert_eq!(put(Some("b"), "5").await, StatusCode::OK);
    assert_eq!(put(Some("a"), "5").await, StatusCode::CONFLICT);
    assert_eq!(put(None, "1").await, StatusCode::OK);
}

/// Concurrent requests with random tokens for one key: the handler sees strictly
/// increasing fences (a request admitted earlier never writes after a newer one),
/// ends with the largest, and every request is either applied or a 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_apply_in_fence_order() {
    let mut rng = Rng::from_env("http concurrent");
    let layer = FenceLayer::by_path();
    let (app, applied) = app(layer.clone());
    let fences = rng.fences(300, 1000);
    let max = *fences.iter().max().unwrap();
    let tasks: Vec<_> = fences
        .into_iter()
        .map(|fence| {
            let app = app.clone();
            tokio::spawn(async move {
                let token = fence.to_string();
                send(&app, "PUT", "/items/1", &[token.as_str()]).await.0
            })
        })
        .collect();
    let mut ok = 0;
    for task in tasks {
        match task.await.unwrap() {
            StatusCode::OK => ok += 1,
            StatusCode::CONFLICT => {}
            other => panic!("unexpected status {other}"),
        }
    }
    let applied = applied.lock().unwrap();
    let order: Vec<u64> = applied.iter().map(|(_, f)| *f).collect();
    assert!(
        order.windows(2).all(|w| w[0] < w[1]),
        "writes out of fence order: {order:?}"
    );
    assert_eq!(order.last(), Some(&max));
    assert_eq!(ok, order.len());
    assert_eq!(ok as u64 + layer.stale_rejections(), 300);
}

/// Over a real socket: an axum server on 127.0.0.1:0 answers 409 with the JSON error.
#[tokio::test]
async fn real_server_answers_409_over_tcp() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let (app, _) = app(FenceLayer::by_path());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    let mut statuses = Vec::new();
    for token in ["7", "7"] {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!(
            "PUT /items/9 HTTP/1.1\r\nHost: test\r\nFencing-Token: {token}\r\n\
             Content-Length: 0\r\nConnection: close\r\n\r\n"
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        statuses.push(response);
    }
    assert!(statuses[0].starts_with("HTTP/1.1 200"), "{}", statuses[0]);
    assert!(statuses[1].starts_with("HTTP/1.1 409"), "{}", statuses[1]);
    assert!(
        statuses[1].contains("content-type: application/json"),
        "{}",
        statuses[1]
    );
    let body = statuses[1].split("\r\n\r\n").nth(1).unwrap();
    let body: Value = serde_json::from_str(body).unwrap();
    assert_eq!(body["error"]["code"], "stale_fence");
    server.abort();
}
