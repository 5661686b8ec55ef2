//! HTTP/JSON v1: the contract curl, other languages and the dashboard rely on.
//!
//! Every request body is read with a size limit and parsed as JSON whatever its
//! content type (with tokens, `curl -d` works; with authentication off the origin
//! layer, `crate::origin`, lets only JSON bodies through, so `curl --json`); any
//! client mistake is a 4xx with a stable `{"error":{"code","message"}}`, never a 500.

use axum::body::{Body, Bytes};
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{FromRequest, Path, Query, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use fencelock_core::{Fence, Grant, LockName, LockView, Reason};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::auth::{Action, Caller};
use crate::engine::{AcquireArgs, Handle, Requester, RunState};
use crate::error::{ApiError, ApiErrorKind};
use crate::input::{self, invalid};

/// Largest request body accepted by default, in bytes (see [`BodyLimit`]).
pub const MAX_BODY_BYTES: usize = crate::limits::DEFAULT_MAX_BODY_BYTES;

/// The largest request body, in bytes, for [`JsonBody`]: a request extension (the
/// server adds it from [`crate::limits::Limits::max_body_bytes`]); without it,
/// [`MAX_BODY_BYTES`].
#[derive(Debug, Clone, Copy)]
pub struct BodyLimit(pub usize);
/// How long a client may take to send a request body.
pub const BODY_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// Largest page of `GET /v1/locks`.
pub const MAX_PAGE: usize = 1000;

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.kind().http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut error = json!({"code": self.kind().code(), "message": self.message()});
        // `not_leader` names the leader's URL when the member knows it; the field is
        // absent (not null) otherwise, so `{"code","message"}` stays the whole body.
        if let (Some(url), Some(fields)) = (self.leader(), error.as_object_mut()) {
            fields.insert("leader".to_owned(), serde_json::Value::from(url));
        }
        let body = json!({ "error": error });
        let mut response = (status, Json(body)).into_response();
        // For the edge's metrics layer (`count_refusals`).
        response.extensions_mut().insert(self.kind());
        if self.kind() == ApiErrorKind::RateLimited {
            // Buckets refill at least one attempt per second.
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        }
        response
    }
}

/// A JSON body, read with [`BodyLimit`] as the limit, any content type.
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, _state: &S) -> Result<Self, ApiError> {
        use futures_util::StreamExt;
        let max_body_bytes = req
            .extensions()
            .get::<BodyLimit>()
            .map_or(MAX_BODY_BYTES, |l| l.0);
        // A body announced larger than the limit is refused before any of it is read
        // (the client may be waiting for an answer before it sends it).
        let announced = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if announced.is_some_and(|len| len > max_body_bytes as u64) {
            return Err(too_large(max_body_bytes));
        }
        let mut body = req.into_body().into_data_stream();
        let mut bytes = Vec::new();
        // A client that announces a body and then stalls must not hold a task forever.
        let deadline = tokio::time::Instant::now() + BODY_READ_TIMEOUT;
        loop {
            let next = tokio::time::timeout_at(deadline, body.next())
                .await
                .map_err(|_| {
                    ApiError::new(
                        ApiErrorKind::InvalidJson,
                        format!(
                            "the request body did not arrive within {} s",
                            BODY_READ_TIMEOUT.as_secs()
                        ),
                    )
                })?;
            let Some(chunk) = next else { break };
            // A body that cannot be read (cut short, broken chunked framing) is a
            // client mistake, but not a too-large body.
            let chunk = chunk.map_err(|e| {
                ApiError::new(
                    ApiErrorKind::InvalidJson,
                    format!("cannot read the request body: {e}"),
                )
            })?;
            if bytes.len() + chunk.len() > max_body_bytes {
                return Err(too_large(max_body_bytes));
            }
            bytes.extend_from_slice(&chunk);
        }
        if bytes.is_empty() {
            return Err(ApiError::new(
                ApiErrorKind::InvalidJson,
                "request body is empty; expected a JSON object",
            ));
        }
        serde_json::from_slice(&bytes).map(JsonBody).map_err(|e| {
            ApiError::new(ApiErrorKind::InvalidJson, format!("invalid JSON body: {e}"))
        })
    }
}

fn too_large(max_body_bytes: usize) -> ApiError {
    ApiError::new(
        ApiErrorKind::PayloadTooLarge,
        format!("request body is larger than {max_body_bytes} bytes"),
    )
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AcquireBody {
    name: String,
    ttl_ms: Option<u64>,
    wait_ms: Option<u64>,
    owner: Option<String>,
    request_id: Option<String>,
    limit: Option<u32>,
    lock_delay_ms: Option<u64>,
    session: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RenewBody {
    name: String,
    owner_token: String,
    ttl_ms: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReleaseBody {
    name: String,
    owner_token: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ForceReleaseBody {
    name: String,
    fence: Option<u64>,
    reason: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OpenSessionBody {
    ttl_ms: u64,
    owner: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListParams {
    #[serde(default)]
    prefix: String,
    after: Option<String>,
    limit: Option<usize>,
    /// Cluster mode: read this member's state without asking the leader.
    #[serde(default)]
    stale: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ShowParams {
    /// Cluster mode: read this member's state without asking the leader.
    #[serde(default)]
    stale: bool,
}

#[derive(Serialize)]
struct GrantJson {
    name: String,
    fence: u64,
    owner_token: String,
    ttl_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    session: Option<String>,
}

impl From<Grant> for GrantJson {
    fn from(g: Grant) -> GrantJson {
        GrantJson {
            name: g.name.to_string(),
            fence: g.fence.get(),
            owner_token: g.token.to_string(),
            ttl_ms: g.ttl_ms,
            session: g.session.map(|s| s.to_string()),
        }
    }
}

#[derive(Serialize)]
struct HolderJson {
    fence: u64,
    owner: String,
    held_ms: u64,
    ttl_remaining_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    session: Option<String>,
}

#[derive(Serialize)]
struct LockJson {
    name: String,
    limit: u32,
    holders: Vec<HolderJson>,
    waiters: usize,
    lock_delay_remaining_ms: u64,
}

impl From<LockView> for LockJson {
    fn from(v: LockView) -> LockJson {
        LockJson {
            name: v.name.to_string(),
            limit: v.limit,
            holders: v
                .holders
                .into_iter()
                .map(|h| HolderJson {
                    fence: h.fence.get(),
                    owner: h.owner.as_str().to_owned(),
                    held_ms: h.held_ms,
                    ttl_remaining_ms: h.ttl_remaining_ms,
                    // The handle, never the id: readers see this view.
                    session: h.session.map(input::session_handle),
                })
                .collect(),
            waiters: v.waiters,
            lock_delay_remaining_ms: v.lock_delay_remaining_ms,
        }
    }
}

fn name(s: &str) -> Result<LockName, ApiError> {
    input::lock_name("name", s)
}

async fn acquire(
    State(h): State<Handle>,
    Caller(caller): Caller,
    JsonBody(b): JsonBody<AcquireBody>,
) -> Result<Json<GrantJson>, ApiError> {
    let name = name(&b.name)?;
    caller.authorize(Action::Acquire, Some(name.as_str()))?;
    caller.take_acquire_attempt()?;
    let args = AcquireArgs {
        name,
        ttl_ms: b.ttl_ms,
        wait_ms: b.wait_ms.unwrap_or(0),
        owner: input::owner(b.owner.as_deref().unwrap_or(""))?,
        request_id: caller.scope_request_id(input::request_id(b.request_id.as_deref())?)?,
        limit: b.limit.unwrap_or(1),
        lock_delay_ms: b.lock_delay_ms.unwrap_or(0),
        session: b.session.as_deref().map(input::session_id).transpose()?,
    };
    Ok(Json(h.acquire(&Requester::of(&caller), args).await?.into()))
}

async fn renew(
    State(h): State<Handle>,
    Caller(caller): Caller,
    JsonBody(b): JsonBody<RenewBody>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let name = name(&b.name)?;
    caller.authorize(Action::Renew, Some(name.as_str()))?;
    caller.take_request()?;
    let token = input::owner_token(&b.owner_token)?;
    let g = h
        .renew(&Requester::of(&caller), name, token, b.ttl_ms)
        .await?;
    Ok(Json(
        json!({"name": g.name.as_str(), "fence": g.fence.get(), "ttl_ms": g.ttl_ms}),
    ))
}

async fn release(
    State(h): State<Handle>,
    Caller(caller): Caller,
    JsonBody(b): JsonBody<ReleaseBody>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let name = name(&b.name)?;
    caller.authorize(Action::Release, Some(name.as_str()))?;
    caller.take_request()?;
    let token = input::owner_token(&b.owner_token)?;
    let released = h.release(&Requester::of(&caller), name, token).await?;
    Ok(Json(if released {
        json!({"released": true})
    } else {
        json!({"released": false, "reason": "already_released"})
    }))
}

async fn force_release(
    State(h): State<Handle>,
    Caller(caller): Caller,
    JsonBody(b): JsonBody<ForceReleaseBody>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let name = name(&b.name)?;
    caller.authorize(Action::ForceRelease, Some(name.as_str()))?;
    caller.take_request()?;
    let fence = match b.fence {
        Some(f) => Some(Fence::new(f).ok_or_else(|| invalid("fence", "must be at least 1"))?),
        None => None,
    };
    let reason = Reason::new(&b.reason).map_err(|e| invalid("reason", e))?;
    let fences = h
        .force_release(&Requester::of(&caller), name, fence, reason)
        .await?;
    let fences: Vec<u64> = fences.into_iter().map(Fence::get).collect();
    Ok(Json(json!({ "fences": fences })))
}

fn path_error(e: PathRejection) -> ApiError {
    ApiError::new(ApiErrorKind::InvalidArgument, format!("bad path: {e}"))
}

async fn show_lock(
    State(h): State<Handle>,
    Caller(caller): Caller,
    path: Result<Path<String>, PathRejection>,
    query: Result<Query<ShowParams>, QueryRejection>,
) -> Result<Json<LockJson>, ApiError> {
    let Path(raw) = path.map_err(path_error)?;
    let Query(p) = query.map_err(|e| invalid("query", e.body_text()))?;
    let name = name(&raw)?;
    caller.authorize(Action::Read, Some(name.as_str()))?;
    match h.lock_with(name.clone(), p.stale).await? {
        Some(view) => Ok(Json(view.into())),
        None => Err(ApiError::new(
            ApiErrorKind::NotFound,
            format!("lock {name} is not held, queued for or in lock-delay"),
        )),
    }
}

async fn list_locks(
    State(h): State<Handle>,
    Caller(caller): Caller,
    query: Result<Query<ListParams>, QueryRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let Query(p) = query.map_err(|e| invalid("query", e.body_text()))?;
    let prefix = input::prefix(p.prefix)?;
    caller.authorize(Action::Read, None)?;
    let ranges = caller.ranges(&prefix)?;
    let max = p.limit.unwrap_or(100);
    if max == 0 || max > MAX_PAGE {
        return Err(invalid(
            "limit",
            format!("must be between 1 and {MAX_PAGE}"),
        ));
    }
    let after = p.after.as_deref().map(name).transpose()?;
    let views = crate::input::locks_in(&h, ranges, after, max, p.stale).await?;
    let next_after = (views.len() == max)
        .then(|| views.last().map(|v| v.name.to_string()))
        .flatten();
    let locks: Vec<LockJson> = views.into_iter().map(LockJson::from).collect();
    Ok(Json(json!({"locks": locks, "next_after": next_after})))
}

async fn open_session(
    State(h): State<Handle>,
    Caller(caller): Caller,
    JsonBody(b): JsonBody<OpenSessionBody>,
) -> Result<Json<serde_json::Value>, ApiError> {
    caller.authorize(Action::Session, None)?;
    caller.take_request()?;
    let owner = input::owner(b.owner.as_deref().unwrap_or(""))?;
    let (id, ttl_ms) = h
        .open_session(&Requester::of(&caller), b.ttl_ms, owner)
        .await?;
    // The id goes to its owner only, here; everyone else sees the handle.
    Ok(Json(json!({
        "session": id.to_string(),
        "handle": input::session_handle(id),
        "ttl_ms": ttl_ms,
    })))
}

async fn keep_alive(
    State(h): State<Handle>,
    Caller(caller): Caller,
    path: Result<Path<String>, PathRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    caller.authorize(Action::Session, None)?;
    caller.take_request()?;
    let Path(raw) = path.map_err(path_error)?;
    let id = input::session_id(&raw)?;
    let ttl_ms = h.keep_alive(&Requester::of(&caller), id).await?;
    Ok(Json(json!({"session": id.to_string(), "ttl_ms": ttl_ms})))
}

async fn close_session(
    State(h): State<Handle>,
    Caller(caller): Caller,
    path: Result<Path<String>, PathRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    caller.authorize(Action::Session, None)?;
    caller.take_request()?;
    let Path(raw) = path.map_err(path_error)?;
    let id = input::session_id(&raw)?;
    let released = h.close_session(&Requester::of(&caller), id).await?;
    Ok(Json(json!({"closed": true, "released": released})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SessionListParams {
    #[serde(default)]
    prefix: String,
    limit: Option<usize>,
}

/// `GET /v1/admin/sessions?prefix=`: the open sessions this admin may manage
/// ([`Requester::may_manage`]) whose locks all start with `prefix`, by handle.
async fn list_sessions(
    State(h): State<Handle>,
    Caller(caller): Caller,
    query: Result<Query<SessionListParams>, QueryRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let Query(p) = query.map_err(|e| invalid("query", e.body_text()))?;
    caller.authorize(Action::ForceRelease, None)?;
    let prefix = input::prefix(p.prefix)?;
    let max = p.limit.unwrap_or(MAX_PAGE);
    if max == 0 || max > MAX_PAGE {
        return Err(invalid(
            "limit",
            format!("must be between 1 and {MAX_PAGE}"),
        ));
    }
    let views = h.sessions(&Requester::of(&caller), prefix, max).await?;
    let sessions: Vec<serde_json::Value> = views
        .into_iter()
        .map(|s| {
            json!({
                "handle": input::session_handle(s.id),
                "principal": s.tenant.as_ref().map(|t| t.as_str()),
                "owner": s.owner.as_str(),
                "ttl_ms": s.ttl_ms,
                "ttl_remaining_ms": s.ttl_remaining_ms,
                "locks": s.holding.len(),
                "waiting": s.waiting.len(),
            })
        })
        .collect();
    Ok(Json(json!({ "sessions": sessions })))
}

/// `DELETE /v1/admin/sessions/{handle}`: an admin closes a session by its handle.
async fn admin_close_session(
    State(h): State<Handle>,
    Caller(caller): Caller,
    path: Result<Path<String>, PathRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    caller.authorize(Action::ForceRelease, None)?;
    caller.take_request()?;
    let Path(raw) = path.map_err(path_error)?;
    let handle = input::handle(&raw)?;
    let released = h
        .close_session_by_handle(&Requester::of(&caller), handle)
        .await?;
    Ok(Json(json!({"closed": true, "released": released})))
}

async fn snapshot(State(h): State<Handle>, Caller(caller): Caller) -> Result<Response, ApiError> {
    caller.authorize(Action::Snapshot, None)?;
    let bytes = h.snapshot().await?;
    Ok((
        [(header::CONTENT_TYPE, "application/octet-stream")],
        Body::from(Bytes::from(bytes)),
    )
        .into_response())
}

async fn healthz() -> &'static str {
    "ok\n"
}

/// `GET /readyz`: 200 `ready` while the server serves; 503 `unavailable` with the
/// reason in the message otherwise. A cluster member is ready only when it is caught
/// up (`ClusterShared::readiness`: a voter, in touch with a leader that a quorum
/// confirms, applied within `READY_MAX_LAG` entries of the commit index).
async fn readyz(State(h): State<Handle>) -> Response {
    let why = match h.state() {
        RunState::Running if h.cluster().is_some_and(|c| c.importing()) => {
            Some("importing a single server's state".to_owned())
        }
        RunState::Running => h
            .cluster()
            .and_then(|c| c.readiness().err())
            .map(|e| e.to_string()),
        other => Some(format!("{other:?}")),
    };
    match why {
        None => (StatusCode::OK, "ready\n").into_response(),
        Some(why) => {
            ApiError::new(ApiErrorKind::Unavailable, format!("not ready: {why}")).into_response()
        }
    }
}

async fn metrics(State(h): State<Handle>, Caller(caller): Caller) -> Result<Response, ApiError> {
    caller.authorize(Action::Metrics, None)?;
    Ok((
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        h.metrics().render(),
    )
        .into_response())
}

async fn not_found() -> ApiError {
    ApiError::new(ApiErrorKind::NotFound, "no such route")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        ApiErrorKind::MethodNotAllowed,
        "this route does not accept that method",
    )
}

/// The HTTP routes, bound to an engine handle.
pub fn router(handle: Handle) -> Router {
    Router::new()
        .route("/v1/acquire", post(acquire))
        .route("/v1/renew", post(renew))
        .route("/v1/release", post(release))
        .route("/v1/locks", get(list_locks))
        .route("/v1/locks/{*name}", get(show_lock))
        .route("/v1/sessions", post(open_session))
        .route("/v1/sessions/{id}", delete(close_session))
        .route("/v1/sessions/{id}/keepalive", post(keep_alive))
        .route("/v1/admin/force-release", post(force_release))
        .route("/v1/admin/sessions", get(list_sessions))
        .route("/v1/admin/sessions/{handle}", delete(admin_close_session))
        .route("/v1/admin/snapshot", get(snapshot))
        .route("/v1/watch", get(crate::watch_sse::watch))
        // Cluster membership and leadership (404 on a single server).
        .merge(crate::cluster::api::routes(Router::new()))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .merge(crate::dashboard::routes())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(handle)
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn rendered(error: ApiError) -> (StatusCode, serde_json::Value) {
        let response = error.into_response();
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        (status, serde_json::from_slice(&bytes).unwrap())
    }

    #[tokio::test]
    async fn not_leader_body_names_the_leader_when_known() {
        let (status, body) =
            rendered(ApiError::not_leader(Some("http://127.0.0.1:7421".into()))).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body["error"]["code"], "not_leader");
        assert_eq!(body["error"]["leader"], "http://127.0.0.1:7421");
        assert!(body["error"]["message"].as_str().unwrap().contains("7421"));

        let (status, body) = rendered(ApiError::not_leader(None)).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body["error"]["code"], "not_leader");
        let fields = body["error"].as_object().unwrap();
        assert!(!fields.contains_key("leader"), "{body}");
    }

    #[tokio::test]
    async fn other_errors_keep_code_and_message_only() {
        let (status, body) = rendered(ApiError::new(ApiErrorKind::Held, "held")).await;
        assert_eq!(status, StatusCode::CONFLICT);
        let mut keys: Vec<&String> = body["error"].as_object().unwrap().keys().collect();
        keys.sort();
        assert_eq!(keys, ["code", "message"]);
    }

    /// Issue 20, item 2: a delivery that panics on the log writer's thread (here a
    /// planted sink) fails the server: `RunState::Failed` naming the panic,
    /// `/readyz` 503, requests answered 503 rather than left hanging, and a
    /// shutdown that returns and does not call the stop clean.
    #[tokio::test]
    async fn a_panic_on_the_writer_thread_fails_the_server_and_nothing_hangs() {
        use std::time::Duration;

        use crate::engine::{start, EngineConfig, GrantSink};

        let dir = tempfile::tempdir().unwrap();
        let handle = start(EngineConfig::new(dir.path())).unwrap();
        let anyone = Requester::anonymous();
        let args = |name: &str| AcquireArgs {
            name: LockName::new(name).unwrap(),
            ttl_ms: Some(60_000),
            wait_ms: 0,
            owner: Default::default(),
            request_id: None,
            limit: 1,
            lock_delay_ms: 0,
            session: None,
        };
        let planted: GrantSink = Box::new(|_| panic!("planted: a sink that panics"));
        handle
            .acquire_to(&anyone, args("a"), handle.new_listener(), planted)
            .unwrap();
        let mut state = handle.watch_state();
        // Only whether it came: the `Ref` that `wait_for` returns holds the lock.
        let failed = tokio::time::timeout(
            Duration::from_secs(10),
            state.wait_for(|s| matches!(s, RunState::Failed(_))),
        )
        .await
        .is_ok();
        assert!(failed, "still {:?} 10 s after the panic", handle.state());
        match handle.state() {
            RunState::Failed(why) => assert!(
                why.contains("log writer thread panicked") && why.contains("planted"),
                "{why}"
            ),
            other => panic!("{other:?}"),
        }
        let ready = readyz(State(handle.clone())).await;
        assert_eq!(ready.status(), StatusCode::SERVICE_UNAVAILABLE);
        for name in ["b", "c"] {
            let err =
                tokio::time::timeout(Duration::from_secs(10), handle.acquire(&anyone, args(name)))
                    .await
                    .expect("a request hung after the writer panicked")
                    .unwrap_err();
            assert_eq!(err.kind().http_status(), 503, "{err}");
        }
        tokio::time::timeout(Duration::from_secs(10), handle.shutdown())
            .await
            .expect("the shutdown hung");
        assert!(
            matches!(handle.state(), RunState::Failed(_)),
            "{:?}",
            handle.state()
        );
    }
}
