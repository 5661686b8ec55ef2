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
use utoipa::{IntoParams, ToSchema};

use crate::auth::{Action, Caller};
use crate::engine::{Handle, Requester, RunState};
use crate::error::{ApiError, ApiErrorKind, CommonErrors, ErrorBody};
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
        // `not_leader` names the leader's URL when the member knows it; the field is
        // absent (not null) otherwise, so `{"code","message"}` stays the whole body.
        let mut response = (status, Json(ErrorBody::from(&self))).into_response();
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
        serde_json::from_slice(&bytes)
            .map(JsonBody)
            .map_err(body_error)
    }
}

/// A body serde refused. A required field that is absent is a missing argument:
/// `invalid_argument` naming the field, as for any field whose value is wrong and as
/// for fields required only in some combinations (`ttl_ms` without `session`), which
/// only the core can tell. Everything else about the body's shape is `invalid_json`.
/// serde's derive words an absent field as "missing field `x`"
/// (`serde::de::Error::missing_field`, which serde_json does not override).
fn body_error(e: serde_json::Error) -> ApiError {
    if e.classify() == serde_json::error::Category::Data {
        let text = e.to_string();
        let missing = text
            .strip_prefix("missing field `")
            .and_then(|rest| rest.split_once('`'))
            .map(|(field, _)| field);
        if let Some(field) = missing {
            return invalid(field, "is missing; this route requires it");
        }
    }
    ApiError::new(ApiErrorKind::InvalidJson, format!("invalid JSON body: {e}"))
}

fn too_large(max_body_bytes: usize) -> ApiError {
    ApiError::new(
        ApiErrorKind::PayloadTooLarge,
        format!("request body is larger than {max_body_bytes} bytes"),
    )
}

/// `POST /v1/acquire`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = AcquireRequest)]
pub(crate) struct AcquireBody {
    /// The lock: 1–256 bytes of UTF-8 without control or invisible characters. Or
    /// `names` instead, for a multi-lock request.
    #[serde(default, deserialize_with = "present")]
    name: Option<String>,
    /// Several locks as one request (1–64 distinct names): all granted or none,
    /// answered as `{"grants": [...]}` in the order asked.
    #[serde(default, deserialize_with = "present")]
    names: Option<Vec<String>>,
    /// The lease, 10 ms–24 h. Required without `session`, absent with it (the
    /// session's lease holds the lock).
    ttl_ms: Option<u64>,
    /// How long to queue for the lock if it is held (default 0: answer `held` at once).
    wait_ms: Option<u64>,
    /// Who holds it, for people reading lock views and the audit log (≤ 1 KiB).
    owner: Option<String>,
    /// Idempotency key (≤ 128 bytes): a retry with the same id gets the same grant.
    request_id: Option<String>,
    /// How many may hold the lock at once (a semaphore; default 1).
    limit: Option<u32>,
    /// After a lease expires, how long nobody gets the lock (default 0, ≤ 60 s).
    lock_delay_ms: Option<u64>,
    /// A session id: the lock lives as long as the session.
    session: Option<String>,
    mode: Option<String>,
}

/// `POST /v1/renew`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = RenewRequest)]
pub(crate) struct RenewBody {
    /// The lock.
    name: String,
    /// The token of the grant.
    owner_token: String,
    /// A new lease; default: the grant's.
    ttl_ms: Option<u64>,
}

/// `POST /v1/release`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = ReleaseRequest)]
pub(crate) struct ReleaseBody {
    /// The lock (one grant; or `grants` for several).
    #[serde(default, deserialize_with = "present")]
    name: Option<String>,
    /// The token of the grant (`token` is accepted too).
    #[serde(alias = "token", default, deserialize_with = "present")]
    owner_token: Option<String>,
    /// Several grants released in one step (1–64).
    #[serde(default, deserialize_with = "present")]
    grants: Option<Vec<GrantRef>>,
}

/// A field that may be absent (another field replaces it) but, when present, is
/// never `null`: `null` stays a malformed body, as for a required field.
fn present<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    T::deserialize(d).map(Some)
}

/// A grant named by its lock and owner token.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct GrantRef {
    /// The lock.
    name: String,
    /// The token of the grant (`token` is accepted too).
    #[serde(alias = "token")]
    owner_token: String,
}

/// `POST /v1/downgrade`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = DowngradeRequest)]
pub(crate) struct DowngradeBody {
    /// The lock.
    name: String,
    /// The token of the exclusive grant (`token` is accepted too).
    #[serde(alias = "token")]
    owner_token: String,
}

/// `POST /v1/elections/{name}/campaign`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = CampaignRequest)]
pub(crate) struct CampaignBody {
    /// What the leader publishes (≤ 4096 bytes, no control characters).
    value: String,
    /// The lease, as for an acquire.
    ttl_ms: Option<u64>,
    /// How long to wait to lead (default 0).
    wait_ms: Option<u64>,
    /// Who campaigns.
    owner: Option<String>,
    /// Idempotency key.
    request_id: Option<String>,
    /// A session id: lead as long as the session lives.
    session: Option<String>,
}

/// `POST /v1/elections/{name}/proclaim`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = ProclaimRequest)]
pub(crate) struct ProclaimBody {
    /// The leader's token (`token` is accepted too).
    #[serde(alias = "token")]
    owner_token: String,
    /// The new value.
    value: String,
}

/// `POST /v1/elections/{name}/resign`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = ResignRequest)]
pub(crate) struct ResignBody {
    /// The leader's token (`token` is accepted too).
    #[serde(alias = "token")]
    owner_token: String,
}

/// `POST /v1/admin/force-release`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = ForceReleaseRequest)]
pub(crate) struct ForceReleaseBody {
    /// The lock.
    name: String,
    /// Only the holder with this fence; default: every holder.
    fence: Option<u64>,
    /// Why, for the audit log (1 byte–1 KiB).
    reason: String,
}

/// `POST /v1/sessions`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = OpenSessionRequest)]
pub(crate) struct OpenSessionBody {
    /// The session's lease, 10 ms–24 h; each keepalive renews it.
    ttl_ms: u64,
    /// Who holds it, for people.
    owner: Option<String>,
}

/// The query of `GET /v1/locks`.
#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct ListParams {
    /// Only locks whose names start with this (default: all the token may read).
    #[serde(default)]
    prefix: String,
    /// The `next_after` of the previous page.
    after: Option<String>,
    /// Page size, 1–1000 (default 100).
    limit: Option<usize>,
    /// Cluster mode: read this member's state without asking the leader.
    #[serde(default)]
    stale: bool,
}

/// The query of `GET /v1/locks/{name}`.
#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct ShowParams {
    /// Cluster mode: read this member's state without asking the leader.
    #[serde(default)]
    stale: bool,
}

/// A grant: pass `fence` to the resource with every write.
#[derive(Serialize, ToSchema)]
#[schema(as = Grant)]
pub(crate) struct GrantJson {
    /// The lock.
    name: String,
    /// The fencing token: larger than every fence granted before, on any lock.
    fence: u64,
    /// The secret that renews and releases this grant.
    owner_token: String,
    /// The lease granted.
    ttl_ms: u64,
    /// The session holding it, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    session: Option<String>,
    /// `exclusive` (a writer) or `shared` (a reader).
    mode: &'static str,
}

/// The grants of a multi-lock request, in the order asked.
#[derive(Serialize, ToSchema)]
#[schema(as = Grants)]
pub(crate) struct GrantsJson {
    /// One grant per name.
    grants: Vec<GrantJson>,
}

/// What an acquire answers: one grant, or for `names` all of them.
#[derive(Serialize, ToSchema)]
#[serde(untagged)]
#[schema(as = AcquireAnswer)]
pub(crate) enum AcquireAnswer {
    /// One lock's grant.
    One(GrantJson),
    /// A multi-lock request's grants.
    Several(GrantsJson),
}

/// The answer to a release of several grants.
#[derive(Serialize, ToSchema)]
#[schema(as = ReleasedAll)]
pub(crate) struct ReleasedAllJson {
    /// Per grant, in the order given: `false` only if its token had released it.
    released: Vec<bool>,
}

/// What a release answers: for one grant or, for `grants`, for each.
#[derive(Serialize, ToSchema)]
#[serde(untagged)]
#[schema(as = ReleaseAnswer)]
pub(crate) enum ReleaseAnswer {
    /// One grant's release.
    One(ReleasedJson),
    /// Several grants' releases.
    Several(ReleasedAllJson),
}

/// The answer to a resignation.
#[derive(Serialize, ToSchema)]
#[schema(as = Resigned)]
pub(crate) struct ResignedJson {
    /// `false` only if this token had resigned already.
    released: bool,
}

/// An election's leader.
#[derive(Serialize, ToSchema)]
#[schema(as = Leader)]
pub(crate) struct LeaderInfoJson {
    /// The election.
    name: String,
    /// The leader's owner text.
    owner: String,
    /// The value it campaigned with or last proclaimed.
    value: String,
    /// Its term: the fence of its grant.
    term: u64,
    /// How long it has led.
    held_ms: u64,
    /// Time left on its lease.
    ttl_remaining_ms: u64,
}

/// Who leads an election.
#[derive(Serialize, ToSchema)]
#[schema(as = LeaderAnswer)]
pub(crate) struct LeaderJson {
    /// `null` when nobody leads.
    leader: Option<LeaderInfoJson>,
}

/// A renewed grant.
#[derive(Serialize, ToSchema)]
#[schema(as = Renewed)]
pub(crate) struct RenewedJson {
    /// The lock.
    name: String,
    /// The grant's fence, unchanged.
    fence: u64,
    /// The new lease, from now.
    ttl_ms: u64,
}

/// The answer to a release.
#[derive(Serialize, ToSchema)]
#[schema(as = Released)]
pub(crate) struct ReleasedJson {
    /// `false` only for a repeat of a release already done.
    released: bool,
    /// With `released: false`: `already_released`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(schema_with = already_released_schema)]
    reason: Option<&'static str>,
}

fn already_released_schema() -> impl Into<utoipa::openapi::RefOr<utoipa::openapi::Schema>> {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::String)
        .enum_values(Some(["already_released"]))
}

/// The answer to a forced release.
#[derive(Serialize, ToSchema)]
#[schema(as = ForceReleased)]
pub(crate) struct ForceReleasedJson {
    /// The fences of the grants released.
    fences: Vec<u64>,
}

/// One page of `GET /v1/locks`.
#[derive(Serialize, ToSchema)]
#[schema(as = LockPage)]
pub(crate) struct LockPageJson {
    /// The locks, in name order.
    locks: Vec<LockJson>,
    /// Set when the page is full: pass it as `after` for the next page; `null` at
    /// the end.
    #[schema(required = true)]
    next_after: Option<String>,
}

/// A new session.
#[derive(Serialize, ToSchema)]
#[schema(as = Session)]
pub(crate) struct SessionJson {
    /// The session id: a secret, for its owner only (acquire with it, keep it alive,
    /// close it).
    session: String,
    /// What everyone else sees of it (lock views, the audit log).
    handle: String,
    /// The session's lease.
    ttl_ms: u64,
}

/// A session kept alive.
#[derive(Serialize, ToSchema)]
#[schema(as = SessionKeptAlive)]
pub(crate) struct KeptAliveJson {
    /// The session id.
    session: String,
    /// The lease, from now.
    ttl_ms: u64,
}

/// A closed session.
#[derive(Serialize, ToSchema)]
#[schema(as = SessionClosed)]
pub(crate) struct ClosedJson {
    /// Always `true`.
    closed: bool,
    /// How many of its locks were released.
    released: usize,
}

/// One session in `GET /v1/admin/sessions`.
#[derive(Serialize, ToSchema)]
#[schema(as = AdminSession)]
pub(crate) struct AdminSessionJson {
    /// The session's handle (never its id).
    handle: String,
    /// The token name that opened it; `null` with authentication off.
    #[schema(required = true)]
    principal: Option<String>,
    /// Its owner text.
    owner: String,
    /// Its lease.
    ttl_ms: u64,
    /// Time left before it expires without a keepalive.
    ttl_remaining_ms: u64,
    /// Locks it holds.
    locks: usize,
    /// Acquires it has queued.
    waiting: usize,
}

/// `GET /v1/admin/sessions`.
#[derive(Serialize, ToSchema)]
#[schema(as = AdminSessionList)]
pub(crate) struct AdminSessionListJson {
    /// The sessions.
    sessions: Vec<AdminSessionJson>,
}

impl From<Grant> for GrantJson {
    fn from(g: Grant) -> GrantJson {
        GrantJson {
            name: g.name.to_string(),
            fence: g.fence.get(),
            owner_token: g.token.to_string(),
            ttl_ms: g.ttl_ms,
            session: g.session.map(|s| s.to_string()),
            mode: g.mode.as_str(),
        }
    }
}

/// One holder of a lock.
#[derive(Serialize, ToSchema)]
#[schema(as = Holder)]
pub(crate) struct HolderJson {
    /// Its fence.
    fence: u64,
    /// Its owner text.
    owner: String,
    /// How long it has held the lock.
    held_ms: u64,
    /// Time left on its lease.
    ttl_remaining_ms: u64,
    /// The handle of its session, if it holds through one.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    session: Option<String>,
    /// `exclusive` (a writer) or `shared` (a reader).
    mode: &'static str,
    /// An election leader's value.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    value: Option<String>,
}

/// A lock as it is now.
#[derive(Serialize, ToSchema)]
#[schema(as = Lock)]
pub(crate) struct LockJson {
    /// Its name.
    name: String,
    /// How many may hold it at once.
    limit: u32,
    /// Its holders.
    holders: Vec<HolderJson>,
    /// How many acquires queue for it.
    waiters: usize,
    /// Time left of its lock-delay (nobody gets it until then).
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
                    mode: h.mode.as_str(),
                    value: h.value.map(|v| v.as_str().to_owned()),
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

/// A body without a required field, answered as serde's missing fields are (the
/// field is optional in the body's type only because `names`/`grants` may replace it).
fn missing_field(field: &str) -> ApiError {
    invalid(field, "is missing; this route requires it")
}

/// `POST /v1/release {"grants": [...]}`: several grants in one step.
async fn release_all(
    h: &Handle,
    caller: &crate::auth::Principal,
    grants: Vec<GrantRef>,
) -> Result<Json<ReleasedAllJson>, ApiError> {
    let grants = input::grants(
        caller,
        grants
            .iter()
            .map(|g| (g.name.as_str(), g.owner_token.as_str())),
    )?;
    let released = h.release_all(&Requester::of(caller), grants).await?;
    Ok(Json(ReleasedAllJson { released }))
}

/// Takes a lock (or queues for it up to `wait_ms`); with `names`, several as one
/// request, all or none.
#[utoipa::path(post, path = "/v1/acquire", tag = "locks",
    request_body = AcquireBody,
    responses(
        (status = 200, description = "Granted: a grant, or for `names` `{\"grants\": [...]}` in the order asked.", body = AcquireAnswer),
        (status = 404, description = "`session_not_found`: `session` names no open session of this caller.", body = ErrorBody),
        (status = 409, description = "`held` (not waiting), `timeout` (`wait_ms` ran out) or `limit_mismatch` (held with another `limit`).", body = ErrorBody),
        CommonErrors,
    ))]
pub(crate) async fn acquire(
    State(h): State<Handle>,
    Caller(caller): Caller,
    JsonBody(b): JsonBody<AcquireBody>,
) -> Result<Json<AcquireAnswer>, ApiError> {
    let names = match (&b.name, &b.names) {
        (Some(one), None) => vec![name(one)?],
        (None, Some(list)) => input::names(list)?,
        (None, None) => return Err(missing_field("name")),
        (Some(_), Some(_)) => {
            return Err(invalid(
                "name",
                "give either name (one lock) or names (several), not both",
            ))
        }
    };
    let multi = b.names.is_some();
    let mut args = input::AcquireInput {
        ttl_ms: b.ttl_ms,
        wait_ms: b.wait_ms.unwrap_or(0),
        owner: b.owner.as_deref().unwrap_or(""),
        request_id: b.request_id.as_deref(),
        limit: b.limit.unwrap_or(1),
        lock_delay_ms: b.lock_delay_ms.unwrap_or(0),
        session: b.session.as_deref(),
        mode: b.mode.as_deref(),
        value: None,
    }
    .args(&caller, names)?;
    let requester = Requester::of(&caller);
    if multi {
        let grants = h.acquire_all(&requester, args).await?;
        let grants: Vec<GrantJson> = grants.into_iter().map(GrantJson::from).collect();
        return Ok(Json(AcquireAnswer::Several(GrantsJson { grants })));
    }
    let Some(one) = args.pop() else {
        return Err(invalid("name", "name a lock"));
    };
    let grant: GrantJson = h.acquire(&requester, one).await?.into();
    Ok(Json(AcquireAnswer::One(grant)))
}

/// Turns an exclusive grant into a shared one without releasing it: the fence is
/// kept, and readers queued right behind it are granted with it.
#[utoipa::path(post, path = "/v1/downgrade", tag = "locks",
    request_body = DowngradeBody,
    responses(
        (status = 200, description = "Downgraded (or shared already): the grant, now `shared`.", body = GrantJson),
        (status = 409, description = "`not_held` or `expired`.", body = ErrorBody),
        CommonErrors,
    ))]
pub(crate) async fn downgrade(
    State(h): State<Handle>,
    Caller(caller): Caller,
    JsonBody(b): JsonBody<DowngradeBody>,
) -> Result<Json<GrantJson>, ApiError> {
    let (name, token) = input::held(&caller, Action::Renew, &b.name, &b.owner_token)?;
    let grant = h.downgrade(&Requester::of(&caller), name, token).await?;
    Ok(Json(grant.into()))
}

fn election(path: Result<Path<String>, PathRejection>) -> Result<LockName, ApiError> {
    let Path(raw) = path.map_err(path_error)?;
    name(&raw)
}

/// Waits (up to `wait_ms`) to lead the election; the grant's fence is the term.
#[utoipa::path(post, path = "/v1/elections/{name}/campaign", tag = "elections",
    params(("name" = String, Path, description = "The election (a lock name).")),
    request_body = CampaignBody,
    responses(
        (status = 200, description = "Leading: the leader's grant.", body = GrantJson),
        (status = 409, description = "`held` (not waiting) or `timeout`.", body = ErrorBody),
        CommonErrors,
    ))]
pub(crate) async fn campaign(
    State(h): State<Handle>,
    Caller(caller): Caller,
    path: Result<Path<String>, PathRejection>,
    JsonBody(b): JsonBody<CampaignBody>,
) -> Result<Json<GrantJson>, ApiError> {
    let name = election(path)?;
    let args = input::AcquireInput {
        ttl_ms: b.ttl_ms,
        wait_ms: b.wait_ms.unwrap_or(0),
        owner: b.owner.as_deref().unwrap_or(""),
        request_id: b.request_id.as_deref(),
        limit: 1,
        lock_delay_ms: 0,
        session: b.session.as_deref(),
        mode: None,
        value: Some(&b.value),
    }
    .one(&caller, name)?;
    Ok(Json(h.acquire(&Requester::of(&caller), args).await?.into()))
}

/// The leader publishes a new value.
#[utoipa::path(post, path = "/v1/elections/{name}/proclaim", tag = "elections",
    params(("name" = String, Path, description = "The election.")),
    request_body = ProclaimBody,
    responses(
        (status = 200, description = "Proclaimed: the leader's grant.", body = GrantJson),
        (status = 409, description = "`not_held` or `expired`: the token no longer leads.", body = ErrorBody),
        CommonErrors,
    ))]
pub(crate) async fn proclaim(
    State(h): State<Handle>,
    Caller(caller): Caller,
    path: Result<Path<String>, PathRejection>,
    JsonBody(b): JsonBody<ProclaimBody>,
) -> Result<Json<GrantJson>, ApiError> {
    let Path(election) = path.map_err(path_error)?;
    let value = input::value(&b.value)?;
    let (name, token) = input::held(&caller, Action::Renew, &election, &b.owner_token)?;
    let grant = h
        .proclaim(&Requester::of(&caller), name, token, value)
        .await?;
    Ok(Json(grant.into()))
}

/// Gives leadership up (a release of the leader's grant).
#[utoipa::path(post, path = "/v1/elections/{name}/resign", tag = "elections",
    params(("name" = String, Path, description = "The election.")),
    request_body = ResignBody,
    responses(
        (status = 200, description = "Resigned (or, for a repeat, resigned already).", body = ResignedJson),
        (status = 409, description = "`not_held` or `expired`.", body = ErrorBody),
        CommonErrors,
    ))]
pub(crate) async fn resign(
    State(h): State<Handle>,
    Caller(caller): Caller,
    path: Result<Path<String>, PathRejection>,
    JsonBody(b): JsonBody<ResignBody>,
) -> Result<Json<ResignedJson>, ApiError> {
    let Path(election) = path.map_err(path_error)?;
    let (name, token) = input::held(&caller, Action::Release, &election, &b.owner_token)?;
    let released = h.release(&Requester::of(&caller), name, token).await?;
    Ok(Json(ResignedJson { released }))
}

/// Who leads the election now (its sole exclusive holder), or `null`.
#[utoipa::path(get, path = "/v1/elections/{name}", tag = "elections",
    params(
        ("name" = String, Path, description = "The election."),
        ShowParams,
    ),
    responses(
        (status = 200, description = "The leader, or `null`.", body = LeaderJson),
        CommonErrors,
    ))]
pub(crate) async fn leader(
    State(h): State<Handle>,
    Caller(caller): Caller,
    path: Result<Path<String>, PathRejection>,
    query: Result<Query<ShowParams>, QueryRejection>,
) -> Result<Json<LeaderJson>, ApiError> {
    let name = election(path)?;
    let Query(p) = query.map_err(|e| invalid("query", e.body_text()))?;
    caller.authorize(Action::Read, Some(name.as_str()))?;
    let view = h.lock_with(name.clone(), p.stale).await?;
    let leader = view.as_ref().and_then(leader_of).map(|h| LeaderInfoJson {
        name: name.to_string(),
        owner: h.owner.as_str().to_owned(),
        value: h.value.as_ref().map_or("", |v| v.as_str()).to_owned(),
        term: h.fence.get(),
        held_ms: h.held_ms,
        ttl_remaining_ms: h.ttl_remaining_ms,
    });
    Ok(Json(LeaderJson { leader }))
}

/// An election's leader: the one exclusive holder of a lock that admits one.
pub(crate) fn leader_of(view: &LockView) -> Option<&fencelock_core::HolderView> {
    match view.holders.as_slice() {
        [h] if view.limit == 1 && h.mode == fencelock_core::Mode::Exclusive => Some(h),
        _ => None,
    }
}

/// Renews a grant's lease; the fence stays.
#[utoipa::path(post, path = "/v1/renew", tag = "locks",
    request_body = RenewBody,
    responses(
        (status = 200, description = "Renewed.", body = RenewedJson),
        (status = 409, description = "`not_held` (not this token's lock) or `expired` (its lease ended: the lock may be someone else's now).", body = ErrorBody),
        CommonErrors,
    ))]
pub(crate) async fn renew(
    State(h): State<Handle>,
    Caller(caller): Caller,
    JsonBody(b): JsonBody<RenewBody>,
) -> Result<Json<RenewedJson>, ApiError> {
    let (name, token) = input::held(&caller, Action::Renew, &b.name, &b.owner_token)?;
    let g = h
        .renew(&Requester::of(&caller), name, token, b.ttl_ms)
        .await?;
    Ok(Json(RenewedJson {
        name: g.name.to_string(),
        fence: g.fence.get(),
        ttl_ms: g.ttl_ms,
    }))
}

/// Releases a grant; the next waiter gets the lock at once.
#[utoipa::path(post, path = "/v1/release", tag = "locks",
    request_body = ReleaseBody,
    responses(
        (status = 200, description = "Released (or, for a repeat, already released); for `grants`, per grant.", body = ReleaseAnswer),
        (status = 409, description = "`not_held` or `expired`.", body = ErrorBody),
        CommonErrors,
    ))]
pub(crate) async fn release(
    State(h): State<Handle>,
    Caller(caller): Caller,
    JsonBody(b): JsonBody<ReleaseBody>,
) -> Result<Json<ReleaseAnswer>, ApiError> {
    let (name, token) = match (b.name, b.owner_token, b.grants) {
        (Some(name), Some(token), None) => (name, token),
        (None, None, Some(grants)) => {
            let Json(all) = release_all(&h, &caller, grants).await?;
            return Ok(Json(ReleaseAnswer::Several(all)));
        }
        (None, _, None) => return Err(missing_field("name")),
        (Some(_), None, None) => return Err(missing_field("owner_token")),
        _ => {
            return Err(invalid(
                "name",
                "give name and owner_token (one grant) or grants (several), not both",
            ))
        }
    };
    let (name, token) = input::held(&caller, Action::Release, &name, &token)?;
    let released = h.release(&Requester::of(&caller), name, token).await?;
    Ok(Json(ReleaseAnswer::One(ReleasedJson {
        released,
        reason: (!released).then_some("already_released"),
    })))
}

/// An admin releases a lock it does not hold, with a reason for the audit log.
#[utoipa::path(post, path = "/v1/admin/force-release", tag = "admin",
    request_body = ForceReleaseBody,
    responses(
        (status = 200, description = "Released.", body = ForceReleasedJson),
        (status = 409, description = "`not_held`: nobody (or not `fence`) holds it.", body = ErrorBody),
        CommonErrors,
    ))]
pub(crate) async fn force_release(
    State(h): State<Handle>,
    Caller(caller): Caller,
    JsonBody(b): JsonBody<ForceReleaseBody>,
) -> Result<Json<ForceReleasedJson>, ApiError> {
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
    Ok(Json(ForceReleasedJson { fences }))
}

fn path_error(e: PathRejection) -> ApiError {
    ApiError::new(ApiErrorKind::InvalidArgument, format!("bad path: {e}"))
}

/// One lock: its holders, waiters and lock-delay.
#[utoipa::path(get, path = "/v1/locks/{name}", tag = "locks",
    params(
        ("name" = String, Path, description = "The lock's name (it may contain `/`)."),
        ShowParams,
    ),
    responses(
        (status = 200, description = "The lock.", body = LockJson),
        (status = 404, description = "`not_found`: not held, queued for or in lock-delay.", body = ErrorBody),
        CommonErrors,
    ))]
pub(crate) async fn show_lock(
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

/// The locks whose names start with `prefix`, in name order, a page at a time.
#[utoipa::path(get, path = "/v1/locks", tag = "locks",
    params(ListParams),
    responses(
        (status = 200, description = "One page.", body = LockPageJson),
        CommonErrors,
    ))]
pub(crate) async fn list_locks(
    State(h): State<Handle>,
    Caller(caller): Caller,
    query: Result<Query<ListParams>, QueryRejection>,
) -> Result<Json<LockPageJson>, ApiError> {
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
    Ok(Json(LockPageJson { locks, next_after }))
}

/// Opens a session: one keepalive for many locks.
#[utoipa::path(post, path = "/v1/sessions", tag = "sessions",
    request_body = OpenSessionBody,
    responses(
        (status = 200, description = "Opened.", body = SessionJson),
        CommonErrors,
    ))]
pub(crate) async fn open_session(
    State(h): State<Handle>,
    Caller(caller): Caller,
    JsonBody(b): JsonBody<OpenSessionBody>,
) -> Result<Json<SessionJson>, ApiError> {
    caller.authorize(Action::Session, None)?;
    caller.take_request()?;
    let owner = input::owner(b.owner.as_deref().unwrap_or(""))?;
    let (id, ttl_ms) = h
        .open_session(&Requester::of(&caller), b.ttl_ms, owner)
        .await?;
    // The id goes to its owner only, here; everyone else sees the handle.
    Ok(Json(SessionJson {
        session: id.to_string(),
        handle: input::session_handle(id),
        ttl_ms,
    }))
}

/// Renews a session's lease (and so every lock it holds).
#[utoipa::path(post, path = "/v1/sessions/{id}/keepalive", tag = "sessions",
    params(("id" = String, Path, description = "The session id.")),
    responses(
        (status = 200, description = "Kept alive.", body = KeptAliveJson),
        (status = 404, description = "`session_not_found` (also for another caller's session).", body = ErrorBody),
        CommonErrors,
    ))]
pub(crate) async fn keep_alive(
    State(h): State<Handle>,
    Caller(caller): Caller,
    path: Result<Path<String>, PathRejection>,
) -> Result<Json<KeptAliveJson>, ApiError> {
    caller.authorize(Action::Session, None)?;
    caller.take_request()?;
    let Path(raw) = path.map_err(path_error)?;
    let id = input::session_id(&raw)?;
    let ttl_ms = h.keep_alive(&Requester::of(&caller), id).await?;
    Ok(Json(KeptAliveJson {
        session: id.to_string(),
        ttl_ms,
    }))
}

/// Closes a session and releases its locks.
#[utoipa::path(delete, path = "/v1/sessions/{id}", tag = "sessions",
    params(("id" = String, Path, description = "The session id.")),
    responses(
        (status = 200, description = "Closed.", body = ClosedJson),
        (status = 404, description = "`session_not_found` (also for another caller's session).", body = ErrorBody),
        CommonErrors,
    ))]
pub(crate) async fn close_session(
    State(h): State<Handle>,
    Caller(caller): Caller,
    path: Result<Path<String>, PathRejection>,
) -> Result<Json<ClosedJson>, ApiError> {
    caller.authorize(Action::Session, None)?;
    caller.take_request()?;
    let Path(raw) = path.map_err(path_error)?;
    let id = input::session_id(&raw)?;
    let released = h.close_session(&Requester::of(&caller), id).await?;
    Ok(Json(ClosedJson {
        closed: true,
        released,
    }))
}

/// The query of `GET /v1/admin/sessions`.
#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct SessionListParams {
    /// Only sessions all of whose locks start with this.
    #[serde(default)]
    prefix: String,
    /// At most this many, 1–1000 (default 1000).
    limit: Option<usize>,
}

/// `GET /v1/admin/sessions?prefix=`: the open sessions this admin may manage
/// ([`Requester::may_manage`]) whose locks all start with `prefix`, by handle.
#[utoipa::path(get, path = "/v1/admin/sessions", tag = "admin",
    params(SessionListParams),
    responses(
        (status = 200, description = "The sessions.", body = AdminSessionListJson),
        CommonErrors,
    ))]
pub(crate) async fn list_sessions(
    State(h): State<Handle>,
    Caller(caller): Caller,
    query: Result<Query<SessionListParams>, QueryRejection>,
) -> Result<Json<AdminSessionListJson>, ApiError> {
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
    let sessions = views
        .into_iter()
        .map(|s| AdminSessionJson {
            handle: input::session_handle(s.id),
            principal: s.tenant.as_ref().map(|t| t.as_str().to_owned()),
            owner: s.owner.as_str().to_owned(),
            ttl_ms: s.ttl_ms,
            ttl_remaining_ms: s.ttl_remaining_ms,
            locks: s.holding.len(),
            waiting: s.waiting.len(),
        })
        .collect();
    Ok(Json(AdminSessionListJson { sessions }))
}

/// `DELETE /v1/admin/sessions/{handle}`: an admin closes a session by its handle.
#[utoipa::path(delete, path = "/v1/admin/sessions/{handle}", tag = "admin",
    params(("handle" = String, Path, description = "The session's handle (16 hex digits).")),
    responses(
        (status = 200, description = "Closed.", body = ClosedJson),
        (status = 404, description = "`session_not_found`.", body = ErrorBody),
        CommonErrors,
    ))]
pub(crate) async fn admin_close_session(
    State(h): State<Handle>,
    Caller(caller): Caller,
    path: Result<Path<String>, PathRejection>,
) -> Result<Json<ClosedJson>, ApiError> {
    caller.authorize(Action::ForceRelease, None)?;
    caller.take_request()?;
    let Path(raw) = path.map_err(path_error)?;
    let handle = input::handle(&raw)?;
    let released = h
        .close_session_by_handle(&Requester::of(&caller), handle)
        .await?;
    Ok(Json(ClosedJson {
        closed: true,
        released,
    }))
}

/// A consistent snapshot of the server's state (what `fencelock backup` saves).
#[utoipa::path(get, path = "/v1/admin/snapshot", tag = "admin",
    responses(
        (status = 200, description = "The snapshot.", content_type = "application/octet-stream", body = Vec<u8>),
        CommonErrors,
    ))]
pub(crate) async fn snapshot(
    State(h): State<Handle>,
    Caller(caller): Caller,
) -> Result<Response, ApiError> {
    caller.authorize(Action::Snapshot, None)?;
    let bytes = h.snapshot().await?;
    Ok((
        [(header::CONTENT_TYPE, "application/octet-stream")],
        Body::from(Bytes::from(bytes)),
    )
        .into_response())
}

/// Liveness: `ok` while the process serves.
#[utoipa::path(get, path = "/healthz", tag = "operations",
    responses((status = 200, description = "`ok`.", content_type = "text/plain", body = String)))]
pub(crate) async fn healthz() -> &'static str {
    "ok\n"
}

/// `GET /readyz`: 200 `ready` while the server serves; 503 `unavailable` with the
/// reason in the message otherwise. A cluster member is ready only when it is caught
/// up (`ClusterShared::readiness`: a voter, in touch with a leader that a quorum
/// confirms, applied within `READY_MAX_LAG` entries of the commit index).
#[utoipa::path(get, path = "/readyz", tag = "operations",
    responses(
        (status = 200, description = "`ready`.", content_type = "text/plain", body = String),
        (status = 503, description = "`unavailable`, the reason in the message.", body = ErrorBody),
    ))]
pub(crate) async fn readyz(State(h): State<Handle>) -> Response {
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

/// Prometheus metrics (a reader token whose prefixes include `""`).
#[utoipa::path(get, path = "/metrics", tag = "operations",
    responses(
        (status = 200, description = "Prometheus text format 0.0.4.", content_type = "text/plain", body = String),
        CommonErrors,
    ))]
pub(crate) async fn metrics(
    State(h): State<Handle>,
    Caller(caller): Caller,
) -> Result<Response, ApiError> {
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
        .route("/v1/downgrade", post(downgrade))
        .route("/v1/elections/{name}", get(leader))
        .route("/v1/elections/{name}/campaign", post(campaign))
        .route("/v1/elections/{name}/proclaim", post(proclaim))
        .route("/v1/elections/{name}/resign", post(resign))
        .route("/v1/locks", get(list_locks))
        .route("/v1/locks/{*name}", get(show_lock))
        .route("/v1/sessions", post(open_session))
        .route("/v1/sessions/{id}", delete(close_session))
        .route("/v1/sessions/{id}/keepalive", post(keep_alive))
        .route("/v1/admin/force-release", post(force_release))
        .route("/v1/admin/sessions", get(list_sessions))
        .route("/v1/admin/sessions/{handle}", delete(admin_close_session))
        .route("/v1/admin/snapshot", get(snapshot))
        .route("/v1/openapi.json", get(crate::openapi::document))
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
    use crate::engine::AcquireArgs;

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
            mode: Default::default(),
            value: None,
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
