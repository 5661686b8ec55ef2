//! The HTTP middleware: a tower [`Layer`] (usable with axum) that admits a request only
//! if its `Fencing-Token` header is newer than the last one accepted for its resource.
//!
//! | request | answer |
//! |---|---|
//! | the key function returns `None` (not a fenced request) | passed through unchanged |
//! | no `Fencing-Token` header | **428** `fence_required` |
//! | header not a decimal `u64`, or repeated | **400** `invalid_fence` |
//! | token ≤ last accepted for the key | **409** `stale_fence`, with `fence` and `last_fence` |
//! | the gate failed (e.g. its database) | **503** `fence_unavailable` |
//! | token newer | recorded, then the request goes to the inner service |
//!
//! Errors have the shape of fencelock's own API:
//! `{"error":{"code":"stale_fence","message":"…","fence":5,"last_fence":7}}`.
//!
//! 428 (Precondition Required, RFC 6585) rather than 400 for a missing header: the
//! request is well-formed, it only lacks the precondition the server requires, and a
//! client can tell "you forgot the token" from "your token is garbage".
//!
//! **Atomic with the write.** The new fence is recorded before the inner service runs,
//! and a per-key lock is held until the inner service has produced its response, so
//! requests for one key reach the handler one at a time, in increasing fence order: a
//! request admitted with fence 5 cannot still be writing when one with fence 6 writes.
//! (Response bodies that keep writing after the handler returned are not covered.) A
//! fence is spent once admitted, even if the handler then fails: retry with a new grant.
//!
//! The per-key lock is local to the process. With several instances of a service
//! behind a load balancer, back the layer with a shared gate
//! ([`FenceLayer::with_gate`]) *and* keep the resource's own writes fenced, or route
//! each key to one instance.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Uri};
use tower::{Layer, Service};

use crate::{ErrorKind, FenceError, FenceGate, GateMetrics, MemoryGate};

/// The request header that carries the fence: `Fencing-Token: 42`.
pub const FENCING_TOKEN_HEADER: &str = "fencing-token";

/// What the key function sees of a request.
#[derive(Debug, Clone, Copy)]
pub struct RequestHead<'a> {
    /// The method.
    pub method: &'a Method,
    /// The URI (path and query).
    pub uri: &'a Uri,
    /// The headers.
    pub headers: &'a HeaderMap<HeaderValue>,
}

/// The tower layer. See the [module docs](self) for the rules.
///
/// ```
/// use axum::{routing::put, Router};
/// use fencelock_fence::FenceLayer;
///
/// let fence = FenceLayer::by_path();
/// let app: Router = Router::new()
///     .route("/reports/{name}", put(|| async { "saved" }))
///     .layer(fence.clone());
/// // fence.stale_rejections() counts the 409s.
/// ```
pub struct FenceLayer<K, G = MemoryGate<()>> {
    shared: Arc<Shared<K, G>>,
}

struct Shared<K, G> {
    key: K,
    gate: G,
    /// One async lock per key with a request in flight.
    in_flight: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl<K, G> Clone for FenceLayer<K, G> {
    fn clone(&self) -> Self {
        FenceLayer {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<K, G: GateMetrics> std::fmt::Debug for FenceLayer<K, G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FenceLayer")
            .field("gate", &self.shared.gate.name())
            .finish_non_exhaustive()
    }
}

/// The key function of [`FenceLayer::by_path`].
pub type PathKey = fn(&RequestHead<'_>) -> Option<String>;

impl FenceLayer<PathKey> {
    /// Fences by path: the resource key is the request path, for every method except
    /// `GET`, `HEAD` and `OPTIONS` (reads pass through unchecked). Fences are kept in
    /// memory, in a gate named `"http"`.
    pub fn by_path() -> FenceLayer<PathKey> {
        fn path_key(req: &RequestHead<'_>) -> Option<String> {
            let read = [Method::GET, Method::HEAD, Method::OPTIONS];
            (!read.contains(req.method)).then(|| req.uri.path().to_owned())
        }
        FenceLayer::new(path_key as PathKey)
    }
}

impl<K> FenceLayer<K>
where
    K: Fn(&RequestHead<'_>) -> Option<String>,
{
    /// Fences the requests for which `key` returns a resource key; the others pass
    /// through. Fences are kept in memory, in a gate named `"http"`.
    pub fn new(key: K) -> FenceLayer<K> {
        FenceLayer::with_gate(MemoryGate::named("http"), key)
    }
}

impl<K, G> FenceLayer<K, G>
where
    K: Fn(&RequestHead<'_>) -> Option<String>,
    G: FenceGate<Key = str, Write = ()>,
{
    /// Like [`new`](FenceLayer::new), with the fences kept by `gate` (its `apply`
    /// records the fence; the write itself is the inner service's).
    pub fn with_gate(gate: G, key: K) -> FenceLayer<K, G> {
        FenceLayer {
            shared: Arc::new(Shared {
                key,
                gate,
                in_flight: Mutex::new(HashMap::new()),
            }),
        }
    }
}

impl<K, G> FenceLayer<K, G> {
    /// The gate that keeps the fences.
    pub fn gate(&self) -> &G {
        &self.shared.gate
    }
}

impl<K, G: GateMetrics> GateMetrics for FenceLayer<K, G> {
    fn name(&self) -> &str {
        self.shared.gate.name()
    }

    fn stale_rejections(&self) -> u64 {
        self.shared.gate.stale_rejections()
    }
}

impl<S, K, G> Layer<S> for FenceLayer<K, G> {
    type Service = FenceService<S, K, G>;

    fn layer(&self, inner: S) -> FenceService<S, K, G> {
        FenceService {
            inner,
            shared: Arc::clone(&self.shared),
        }
    }
}

/// The service [`FenceLayer`] wraps around an inner service.
pub struct FenceService<S, K, G = MemoryGate<()>> {
    inner: S,
    shared: Arc<Shared<K, G>>,
}

impl<S: Clone, K, G> Clone for FenceService<S, K, G> {
    fn clone(&self) -> Self {
        FenceService {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S, K, G> std::fmt::Debug for FenceService<S, K, G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FenceService").finish_non_exhaustive()
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, K, G, ReqBody, ResBody> Service<Request<ReqBody>> for FenceService<S, K, G>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send,
    K: Fn(&RequestHead<'_>) -> Option<String> + Send + Sync + 'static,
    G: FenceGate<Key = str, Write = ()> + Send + Sync + 'static,
    ReqBody: Send + 'static,
    ResBody: From<String> + Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Response<ResBody>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        // The instance that was polled ready serves this request; keep a fresh clone.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let head = RequestHead {
            method: req.method(),
            uri: req.uri(),
            headers: req.headers(),
        };
        let Some(key) = (self.shared.key)(&head) else {
            return Box::pin(inner.call(req));
        };
        let fence = match parse_token(req.headers()) {
            Ok(fence) => fence,
            Err(response) => return Box::pin(std::future::ready(Ok(response.into_response()))),
        };
        let shared = Arc::clone(&self.shared);
        Box::pin(async move {
            let lock = shared.key_lock(&key);
            let guard = Arc::clone(&lock).lock_owned().await;
            let admitted = shared.gate.apply(&key, fence, ()).await;
            let result = match admitted {
                Ok(_) => inner.call(req).await,
                Err(e) => Ok(rejection(&key, fence, &e).into_response()),
            };
            drop(guard);
            shared.release_key_lock(&key, lock);
            result
        })
    }
}

impl<K, G> Shared<K, G> {
    fn key_lock(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut map = self
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        Arc::clone(map.entry(key.to_owned()).or_default())
    }

    /// Forgets the key's lock when no other request holds or awaits it.
    fn release_key_lock(&self, key: &str, lock: Arc<tokio::sync::Mutex<()>>) {
        let mut map = self
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Clones are only made under the map lock: the map's and ours means no waiter.
        if Arc::strong_count(&lock) == 2 {
            map.remove(key);
        }
    }
}

/// A JSON error response, built for any body type.
struct ErrorResponse {
    status: StatusCode,
    code: &'static str,
    message: String,
    fences: Option<(u64, Option<u64>)>,
}

impl ErrorResponse {
    fn into_response<B: From<String>>(self) -> Response<B> {
        let mut body = format!(
            "{{\"error\":{{\"code\":\"{}\",\"message\":{}",
            self.code,
            json_string(&self.message)
        );
        if let Some((fence, last)) = self.fences {
            body.push_str(&format!(",\"fence\":{fence}"));
            if let Some(last) = last {
                body.push_str(&format!(",\"last_fence\":{last}"));
            }
        }
        body.push_str("}}");
        let mut response = Response::new(B::from(body));
        *response.status_mut() = self.status;
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        response
    }
}

fn parse_token(headers: &HeaderMap) -> Result<u64, ErrorResponse> {
    let mut values = headers.get_all(FENCING_TOKEN_HEADER).iter();
    let Some(value) = values.next() else {
        return Err(ErrorResponse {
            status: StatusCode::PRECONDITION_REQUIRED,
            code: "fence_required",
            message: "this request needs a Fencing-Token header with the lock's fence".into(),
            fences: None,
        });
    };
    let invalid = |why: &str| ErrorResponse {
        status: StatusCode::BAD_REQUEST,
        code: "invalid_fence",
        message: format!("Fencing-Token {why}"),
        fences: None,
    };
    if values.next().is_some() {
        return Err(invalid("must be given once"));
    }
    let text = value.to_str().unwrap_or("");
    if text.is_empty() || text.len() > 20 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(invalid(
            "must be a decimal integer from 0 to 18446744073709551615",
        ));
    }
    text.parse()
        .map_err(|_| invalid("must be a decimal integer from 0 to 18446744073709551615"))
}

fn rejection(key: &str, fence: u64, err: &FenceError) -> ErrorResponse {
    match err.kind() {
        ErrorKind::Stale => ErrorResponse {
            status: StatusCode::CONFLICT,
            code: "stale_fence",
            message: format!(
                "fence {fence} is not newer than the last fence accepted for {key}; \
                 the lock was lost or the request was already applied"
            ),
            fences: Some((fence, err.last_fence())),
        },
        _ => ErrorResponse {
            status: StatusCode::SERVICE_UNAVAILABLE,
            code: "fence_unavailable",
            message: format!("the fence check for {key} failed: {err}"),
            fences: None,
        },
    }
}

fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}
