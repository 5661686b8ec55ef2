//! gRPC API (`fencelock.v1.Locks`, from `proto/fencelock/v1/locks.proto`): the same
//! operations as [`crate::http`], through the same [`Handle`], with the same errors.
//!
//! It shares the HTTP port: [`add_routes`] mounts the tonic service under
//! `/fencelock.v1.Locks/` on the axum router, and `axum::serve` speaks HTTP/1 (JSON)
//! and HTTP/2 with prior knowledge (gRPC) on one listener.
//!
//! Errors: every [`ApiError`] becomes a [`Status`] in one place (the `From` impl
//! below), which also puts the stable code ([`ApiErrorKind::code`]) into the
//! [`ERROR_CODE_METADATA`] entry, so clients can tell `held` from `not_held` without
//! parsing messages. A request that is not valid protobuf, or that tonic cannot read
//! at all, is INVALID_ARGUMENT rather than tonic's INTERNAL: no client input may look
//! like a server fault. (A message over the 64 KiB limit is tonic's OUT_OF_RANGE.)
//!
//! Streams never hold up a graceful shutdown: `KeepAlive` and `Watch` end with
//! UNAVAILABLE once the engine leaves [`RunState::Running`].

use std::pin::Pin;

use fencelock_core::{EventKind, Fence, Grant, LockName, LockView, OwnerToken, Reason};
use futures_util::Stream;
use tokio::sync::{broadcast, watch};
use tonic::metadata::MetadataValue;
use tonic::{Code, Request, Response, Status, Streaming};

use crate::auth::{grpc_caller, Action};
use crate::engine::{AcquireArgs, Handle, Position, Requester, RunState, SharedEvent, WatchEvent};
use crate::error::{ApiError, ApiErrorKind};
use crate::http::{MAX_BODY_BYTES, MAX_PAGE};
use crate::input::{invalid, lock_name, owner, prefix, session_id};

/// Messages, server and client generated from `fencelock/v1/locks.proto` (the
/// `fencelock-proto` crate).
pub use fencelock_proto as pb;

use pb::locks_server::{Locks, LocksServer};

pub use fencelock_proto::{ERROR_CODE_METADATA, LEADER_METADATA, MISSED_EVENTS_METADATA};
/// Default page size of `ListLocks` (when `limit` is 0).
pub const DEFAULT_PAGE: usize = 100;

/// Adds the gRPC service's routes to `router`, with messages of at most
/// [`MAX_BODY_BYTES`].
pub fn add_routes(router: axum::Router, handle: Handle) -> axum::Router {
    add_routes_with_limit(router, handle, MAX_BODY_BYTES)
}

/// Adds the gRPC service's routes to `router`, with messages of at most
/// `max_message_bytes`.
pub fn add_routes_with_limit(
    router: axum::Router,
    handle: Handle,
    max_message_bytes: usize,
) -> axum::Router {
    let service =
        LocksServer::new(LocksService { handle }).max_decoding_message_size(max_message_bytes);
    let mut grpc = axum::Router::new().route_service("/fencelock.v1.Locks/{*method}", service);
    grpc = add_reflection(grpc, max_message_bytes);
    let grpc = grpc.layer(axum::middleware::map_response(rejected_request_is_invalid));
    router.merge(grpc)
}

/// The path prefixes of gRPC server reflection, v1 and the older v1alpha that
/// some tools still ask first.
const REFLECTION_PREFIXES: [&str; 2] = [
    "/grpc.reflection.v1.ServerReflection/",
    "/grpc.reflection.v1alpha.ServerReflection/",
];

/// Whether `path` is a gRPC reflection call: open without a token, like
/// `/v1/openapi.json` (see `auth`), since it describes only the API's shape.
pub(crate) fn is_reflection(path: &str) -> bool {
    REFLECTION_PREFIXES.iter().any(|p| path.starts_with(p))
}

/// Adds gRPC server reflection (`grpcurl list`, Postman) over the descriptor set
/// `fencelock-proto` builds, so a client in any language can discover
/// `fencelock.v1.Locks` from the server itself.
fn add_reflection(grpc: axum::Router, max_message_bytes: usize) -> axum::Router {
    let v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(fencelock_proto::FILE_DESCRIPTOR_SET)
        .build_v1();
    let v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(fencelock_proto::FILE_DESCRIPTOR_SET)
        .build_v1alpha();
    match (v1, v1alpha) {
        (Ok(v1), Ok(v1alpha)) => grpc
            .route_service(
                "/grpc.reflection.v1.ServerReflection/{*method}",
                v1.max_decoding_message_size(max_message_bytes),
            )
            .route_service(
                "/grpc.reflection.v1alpha.ServerReflection/{*method}",
                v1alpha.max_decoding_message_size(max_message_bytes),
            ),
        // The set is compiled in and checked by `reflection_lists_the_locks_service`;
        // should it ever not load, the API itself still serves.
        (Err(e), _) | (_, Err(e)) => {
            tracing::error!(error = %e, "gRPC reflection is off: the descriptor set does not load");
            grpc
        }
    }
}

/// tonic answers a request it cannot even read (no message, a bad frame or
/// compression flag) with INTERNAL before any handler runs. That is the client's
/// mistake: say INVALID_ARGUMENT. Such answers are trailers-only responses without
/// [`ERROR_CODE_METADATA`]; every status a handler returns has that entry (and any
/// other INTERNAL would come in trailers), so nothing else is touched.
async fn rejected_request_is_invalid(
    mut response: axum::response::Response,
) -> axum::response::Response {
    let headers = response.headers_mut();
    let internal = headers
        .get("grpc-status")
        .is_some_and(|code| code.as_bytes() == b"13");
    if internal && !headers.contains_key(ERROR_CODE_METADATA) {
        headers.insert("grpc-status", axum::http::HeaderValue::from_static("3"));
        headers.insert(
            ERROR_CODE_METADATA,
            axum::http::HeaderValue::from_static(ApiErrorKind::InvalidArgument.code()),
        );
    }
    response
}

/// The same rule for a request stream read by a handler: a stream that tonic cannot
/// read is the client's mistake.
fn request_stream_error(status: Status) -> Status {
    if status.code() == Code::Internal && status.metadata().get(ERROR_CODE_METADATA).is_none() {
        return ApiError::new(
            ApiErrorKind::InvalidArgument,
            format!("malformed request stream: {}", status.message()),
        )
        .into();
    }
    status
}

impl From<ApiError> for Status {
    fn from(error: ApiError) -> Status {
        let kind = error.kind();
        let code = match kind {
            ApiErrorKind::InvalidJson | ApiErrorKind::InvalidArgument => Code::InvalidArgument,
            ApiErrorKind::Held
            | ApiErrorKind::NotHeld
            | ApiErrorKind::Expired
            | ApiErrorKind::LimitMismatch => Code::FailedPrecondition,
            ApiErrorKind::Timeout => Code::DeadlineExceeded,
            ApiErrorKind::NotFound | ApiErrorKind::SessionNotFound => Code::NotFound,
            ApiErrorKind::ResourceExhausted
            | ApiErrorKind::PayloadTooLarge
            | ApiErrorKind::RateLimited => Code::ResourceExhausted,
            ApiErrorKind::Unauthenticated => Code::Unauthenticated,
            ApiErrorKind::PermissionDenied => Code::PermissionDenied,
            ApiErrorKind::Unavailable | ApiErrorKind::NotLeader => Code::Unavailable,
            ApiErrorKind::Cancelled => Code::Cancelled,
            ApiErrorKind::Internal => Code::Internal,
            ApiErrorKind::MethodNotAllowed => Code::Unimplemented,
            ApiErrorKind::WatchCompacted => Code::OutOfRange,
        };
        let mut status = Status::new(code, error.message());
        status
            .metadata_mut()
            .insert(ERROR_CODE_METADATA, MetadataValue::from_static(kind.code()));
        // A URL that is not a valid header value (never one we advertise) is left
        // out: the client then tries its other endpoints, as when none is known.
        if let Some(value) = error
            .leader()
            .and_then(|url| MetadataValue::try_from(url).ok())
        {
            status.metadata_mut().insert(LEADER_METADATA, value);
        }
        status
    }
}

/// What an acquire or campaign asks, before it is checked.
fn acquire_input<'a>(
    ttl_ms: Option<u64>,
    wait_ms: u64,
    owner: &'a str,
    request_id: Option<&'a str>,
    session: Option<&'a str>,
) -> crate::input::AcquireInput<'a> {
    crate::input::AcquireInput {
        ttl_ms,
        wait_ms,
        owner,
        request_id,
        limit: 1,
        lock_delay_ms: 0,
        session,
        mode: None,
        value: None,
    }
}

/// The arguments of an acquire by `caller`, once it is allowed (role, prefix, rate).
pub(crate) fn acquire_args(
    caller: &crate::auth::Principal,
    r: pb::AcquireRequest,
) -> Result<AcquireArgs, ApiError> {
    let name = lock_name("name", &r.name)?;
    crate::input::AcquireInput {
        // Protobuf's absent is 0.
        limit: r.limit.max(1),
        lock_delay_ms: r.lock_delay_ms,
        mode: Some(&r.mode),
        ..acquire_input(
            r.ttl_ms,
            r.wait_ms,
            &r.owner,
            r.request_id.as_deref(),
            r.session.as_deref(),
        )
    }
    .one(caller, name)
}

/// `AcquireAll` by `caller` (gRPC and the wire protocol): the grants in the order
/// asked. Dropping the future takes the request out of every queue.
pub(crate) async fn acquire_all_call(
    handle: &Handle,
    caller: &crate::auth::Principal,
    r: pb::AcquireAllRequest,
) -> Result<pb::AcquireAllResponse, ApiError> {
    let names = crate::input::names(&r.names)?;
    let parts = crate::input::AcquireInput {
        limit: r.limit.max(1),
        lock_delay_ms: r.lock_delay_ms,
        mode: Some(&r.mode),
        ..acquire_input(
            r.ttl_ms,
            r.wait_ms,
            &r.owner,
            r.request_id.as_deref(),
            r.session.as_deref(),
        )
    }
    .args(caller, names)?;
    let grants = handle.acquire_all(&Requester::of(caller), parts).await?;
    Ok(pb::AcquireAllResponse {
        grants: grants.into_iter().map(grant_pb).collect(),
    })
}

/// `ReleaseAll` by `caller` (gRPC and the wire protocol).
pub(crate) async fn release_all_call(
    handle: &Handle,
    caller: &crate::auth::Principal,
    r: pb::ReleaseAllRequest,
) -> Result<pb::ReleaseAllResponse, ApiError> {
    let grants = crate::input::grants(
        caller,
        r.grants
            .iter()
            .map(|g| (g.name.as_str(), g.owner_token.as_str())),
    )?;
    let released = handle.release_all(&Requester::of(caller), grants).await?;
    Ok(pb::ReleaseAllResponse { released })
}

/// `Downgrade` by `caller` (gRPC and the wire protocol).
pub(crate) async fn downgrade_call(
    handle: &Handle,
    caller: &crate::auth::Principal,
    r: pb::DowngradeRequest,
) -> Result<pb::Grant, ApiError> {
    let (name, token) = crate::input::held(caller, Action::Renew, &r.name, &r.owner_token)?;
    let grant = handle
        .downgrade(&Requester::of(caller), name, token)
        .await?;
    Ok(grant_pb(grant))
}

/// `Campaign` by `caller` (gRPC and the wire protocol): the leader's grant, its
/// fence the term.
pub(crate) async fn campaign_call(
    handle: &Handle,
    caller: &crate::auth::Principal,
    r: pb::CampaignRequest,
) -> Result<pb::Grant, ApiError> {
    let name = lock_name("name", &r.name)?;
    let args = crate::input::AcquireInput {
        value: Some(&r.value),
        ..acquire_input(
            r.ttl_ms,
            r.wait_ms,
            &r.owner,
            r.request_id.as_deref(),
            r.session.as_deref(),
        )
    }
    .one(caller, name)?;
    Ok(grant_pb(
        handle.acquire(&Requester::of(caller), args).await?,
    ))
}

/// `Proclaim` by `caller` (gRPC and the wire protocol).
pub(crate) async fn proclaim_call(
    handle: &Handle,
    caller: &crate::auth::Principal,
    r: pb::ProclaimRequest,
) -> Result<pb::Grant, ApiError> {
    let value = crate::input::value(&r.value)?;
    let (name, token) = crate::input::held(caller, Action::Renew, &r.name, &r.owner_token)?;
    let grant = handle
        .proclaim(&Requester::of(caller), name, token, value)
        .await?;
    Ok(grant_pb(grant))
}

/// `Leader` by `caller` (gRPC and the wire protocol).
pub(crate) async fn leader_call(
    handle: &Handle,
    caller: &crate::auth::Principal,
    r: pb::LeaderRequest,
) -> Result<pb::LeaderResponse, ApiError> {
    let name = lock_name("name", &r.name)?;
    caller.authorize(Action::Read, Some(name.as_str()))?;
    let view = handle.lock(name.clone()).await?;
    let leader = view
        .as_ref()
        .and_then(crate::http::leader_of)
        .map(|h| pb::Leader {
            name: name.to_string(),
            value: h.value.as_ref().map_or("", |v| v.as_str()).to_owned(),
            term: h.fence.get(),
            owner: h.owner.as_str().to_owned(),
        });
    Ok(pb::LeaderResponse { leader })
}

/// `Acquire` by `caller`: shared by gRPC and the wire protocol ([`crate::wire`]).
/// Dropping the future takes a waiting request out of the queue.
pub(crate) async fn acquire_call(
    handle: &Handle,
    caller: &crate::auth::Principal,
    r: pb::AcquireRequest,
) -> Result<pb::Grant, ApiError> {
    let args = acquire_args(caller, r)?;
    Ok(grant_pb(
        handle.acquire(&Requester::of(caller), args).await?,
    ))
}

/// `Renew` by `caller` (gRPC and the wire protocol).
pub(crate) async fn renew_call(
    handle: &Handle,
    caller: &crate::auth::Principal,
    r: pb::RenewRequest,
) -> Result<pb::RenewResponse, ApiError> {
    let (name, token, ttl_ms) = renew_args(caller, &r)?;
    let requester = Requester::of(caller);
    Ok(renew_pb(
        handle.renew(&requester, name, token, ttl_ms).await?,
    ))
}

/// The arguments of a renew by `caller`, once it is allowed (role, prefix, rate).
pub(crate) fn renew_args(
    caller: &crate::auth::Principal,
    r: &pb::RenewRequest,
) -> Result<(LockName, OwnerToken, Option<u64>), ApiError> {
    let (name, token) = crate::input::held(caller, Action::Renew, &r.name, &r.owner_token)?;
    Ok((name, token, r.ttl_ms))
}

/// The answer to a successful renew.
pub(crate) fn renew_pb(g: Grant) -> pb::RenewResponse {
    pb::RenewResponse {
        name: g.name.to_string(),
        fence: g.fence.get(),
        ttl_ms: g.ttl_ms,
    }
}

/// `Release` by `caller` (gRPC and the wire protocol).
pub(crate) async fn release_call(
    handle: &Handle,
    caller: &crate::auth::Principal,
    r: pb::ReleaseRequest,
) -> Result<pb::ReleaseResponse, ApiError> {
    let (name, token) = release_args(caller, &r)?;
    let requester = Requester::of(caller);
    Ok(release_pb(handle.release(&requester, name, token).await?))
}

/// The arguments of a release by `caller`, once it is allowed (role, prefix, rate).
pub(crate) fn release_args(
    caller: &crate::auth::Principal,
    r: &pb::ReleaseRequest,
) -> Result<(LockName, OwnerToken), ApiError> {
    crate::input::held(caller, Action::Release, &r.name, &r.owner_token)
}

/// The answer to a release: whether this call released the grant.
pub(crate) fn release_pb(released: bool) -> pb::ReleaseResponse {
    let reason = if released { "" } else { "already_released" };
    pb::ReleaseResponse {
        released,
        reason: reason.to_owned(),
    }
}

/// A grant as the API shows it.
pub(crate) fn grant_pb(g: Grant) -> pb::Grant {
    pb::Grant {
        name: g.name.to_string(),
        fence: g.fence.get(),
        owner_token: g.token.to_string(),
        ttl_ms: g.ttl_ms,
        session: g.session.map(|s| s.to_string()),
        mode: g.mode.as_str().to_owned(),
    }
}

fn lock_info(v: LockView) -> pb::LockInfo {
    pb::LockInfo {
        name: v.name.to_string(),
        limit: v.limit,
        holders: v
            .holders
            .into_iter()
            .map(|h| pb::Holder {
                fence: h.fence.get(),
                owner: h.owner.as_str().to_owned(),
                held_ms: h.held_ms,
                ttl_remaining_ms: h.ttl_remaining_ms,
                // The handle, never the id: readers see this view.
                session: h.session.map(crate::input::session_handle),
                mode: h.mode.as_str().to_owned(),
                value: h.value.map(|v| v.as_str().to_owned()),
            })
            .collect(),
        waiters: v.waiters as u64,
        lock_delay_remaining_ms: v.lock_delay_remaining_ms,
    }
}

fn event_pb(e: &fencelock_core::Event) -> pb::LockEvent {
    let kind = crate::vocab::event(e.kind)
        .pb()
        .unwrap_or(pb::EventKind::Unspecified);
    let wait_end = match e.kind {
        EventKind::WaitEnded(end) => crate::vocab::wait_end_pb(end),
        _ => pb::WaitEnd::Unspecified,
    };
    pb::LockEvent {
        kind: kind.into(),
        name: e.name.to_string(),
        fence: e.fence.map(Fence::get),
        owner: e.owner.as_str().to_owned(),
        session: e.session.map(crate::input::session_handle),
        at_ms: e.at_ms,
        duration_ms: e.duration_ms,
        reason: e.reason.as_ref().map(|r| r.as_str().to_owned()),
        wait_end: wait_end.into(),
        mode: e.mode.as_str().to_owned(),
        value: e.value.as_ref().map(|v| v.as_str().to_owned()),
        handoff: e.handoff,
        ..Default::default()
    }
}

/// A watched event with its position and wall-clock time.
fn watch_event_pb(e: &WatchEvent) -> pb::LockEvent {
    pb::LockEvent {
        position: Some(pb::WatchPosition {
            index: e.position.index,
            ordinal: e.position.ordinal,
        }),
        time_ms: e.wall_ms,
        ..event_pb(&e.event)
    }
}

/// Resolves once the engine stops serving (draining, stopped or failed), with the
/// status a stream ends on.
async fn stopping(run: &mut watch::Receiver<RunState>) -> Status {
    let state = match run.wait_for(|s| *s != RunState::Running).await {
        Ok(state) => state.clone(),
        Err(_) => RunState::Stopped,
    };
    let message = match state {
        RunState::Failed(why) => format!("the server stopped: {why}"),
        _ => "the server is shutting down".to_owned(),
    };
    ApiError::new(ApiErrorKind::Unavailable, message).into()
}

type GrpcStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// The state of one `KeepAlive` call.
struct KeepAliveCall {
    handle: Handle,
    caller: crate::auth::Principal,
    requests: Streaming<pb::KeepAliveRequest>,
    run: watch::Receiver<RunState>,
}

impl KeepAliveCall {
    /// The answer to the next request; `None` when the client finished sending.
    async fn next(&mut self) -> Option<Result<pb::KeepAliveResponse, Status>> {
        let request = tokio::select! {
            request = self.requests.message() => request,
            status = stopping(&mut self.run) => return Some(Err(status)),
        };
        let request = match request {
            Ok(Some(request)) => request,
            Ok(None) => return None,
            Err(status) => return Some(Err(request_stream_error(status))),
        };
        let renewed = async {
            let id = session_id(&request.session)?;
            self.caller.take_request()?;
            let requester = Requester::of(&self.caller);
            let ttl_ms = self.handle.keep_alive(&requester, id).await?;
            Ok::<_, ApiError>(pb::KeepAliveResponse {
                session: id.to_string(),
                ttl_ms,
            })
        };
        Some(renewed.await.map_err(Status::from))
    }

    fn into_stream(self) -> GrpcStream<pb::KeepAliveResponse> {
        // The first error ends the stream (it becomes the call's status).
        Box::pin(futures_util::stream::unfold(
            Some(self),
            |call| async move {
                let mut call = call?;
                let item = call.next().await?;
                let more = item.is_ok();
                Some((item, more.then_some(call)))
            },
        ))
    }
}

/// The state of one `Watch` call.
struct WatchCall {
    /// Resumed: the events missed, sent before the live ones.
    backlog: std::collections::VecDeque<SharedEvent>,
    /// The last event sent (or the position resumed after): a live event at or
    /// before it was in the backlog.
    last: Option<Position>,
    events: broadcast::Receiver<SharedEvent>,
    /// Events are sent for names that start with any of these (the requested prefix,
    /// cut down to the caller's prefixes).
    ranges: Vec<String>,
    run: watch::Receiver<RunState>,
    /// Set once the engine stops serving: how many events were already queued for
    /// this watcher then (they are still sent), and the status to end with.
    closing: Option<(usize, Status)>,
}

impl WatchCall {
    /// The next event whose name has the prefix, or the status to end with.
    async fn next(&mut self) -> Option<Result<pb::LockEvent, Status>> {
        loop {
            if let Some(event) = self.backlog.pop_front() {
                self.last = Some(event.position);
                if self.wanted(&event) {
                    return Some(Ok(watch_event_pb(&event)));
                }
                continue;
            }
            let received = match &mut self.closing {
                Some((0, _)) => {
                    let (_, status) = self.closing.take()?;
                    return Some(Err(status));
                }
                Some((left, _)) => {
                    *left -= 1;
                    match self.events.try_recv() {
                        Ok(event) => Ok(event),
                        Err(broadcast::error::TryRecvError::Lagged(missed)) => {
                            Err(broadcast::error::RecvError::Lagged(missed))
                        }
                        Err(_) => {
                            *left = 0;
                            continue;
                        }
                    }
                }
                None => tokio::select! {
                    received = self.events.recv() => received,
                    status = stopping(&mut self.run) => {
                        self.closing = Some((self.events.len(), status));
                        continue;
                    }
                },
            };
            match received {
                Ok(event) if self.last.is_some_and(|last| event.position <= last) => {}
                Ok(event) => {
                    self.last = Some(event.position);
                    if self.wanted(&event) {
                        return Some(Ok(watch_event_pb(&event)));
                    }
                }
                Err(broadcast::error::RecvError::Lagged(missed)) => {
                    let mut status = Status::data_loss(format!(
                        "this watcher fell behind and missed {missed} events; \
                         re-read the locks and watch again"
                    ));
                    status
                        .metadata_mut()
                        .insert(MISSED_EVENTS_METADATA, MetadataValue::from(missed));
                    return Some(Err(status));
                }
                Err(broadcast::error::RecvError::Closed) => {
                    return Some(Err(ApiError::new(
                        ApiErrorKind::Unavailable,
                        "the lock engine stopped",
                    )
                    .into()));
                }
            }
        }
    }

    /// Whether the event's lock is one this watch is about.
    fn wanted(&self, event: &WatchEvent) -> bool {
        self.ranges
            .iter()
            .any(|r| event.name.as_str().starts_with(r.as_str()))
    }

    fn into_stream(self) -> GrpcStream<pb::LockEvent> {
        // The first error ends the stream (it becomes the call's status).
        Box::pin(futures_util::stream::unfold(
            Some(self),
            |call| async move {
                let mut call = call?;
                let item = call.next().await?;
                let more = item.is_ok();
                Some((item, more.then_some(call)))
            },
        ))
    }
}

/// The `fencelock.v1.Locks` service over an engine handle.
struct LocksService {
    handle: Handle,
}

#[tonic::async_trait]
impl Locks for LocksService {
    async fn acquire_all(
        &self,
        request: Request<pb::AcquireAllRequest>,
    ) -> Result<Response<pb::AcquireAllResponse>, Status> {
        let caller = grpc_caller(&request)?;
        // Awaited here: a cancelled call drops it, which leaves every queue.
        let grants = acquire_all_call(&self.handle, &caller, request.into_inner()).await?;
        Ok(Response::new(grants))
    }

    async fn release_all(
        &self,
        request: Request<pb::ReleaseAllRequest>,
    ) -> Result<Response<pb::ReleaseAllResponse>, Status> {
        let caller = grpc_caller(&request)?;
        let released = release_all_call(&self.handle, &caller, request.into_inner()).await?;
        Ok(Response::new(released))
    }

    async fn downgrade(
        &self,
        request: Request<pb::DowngradeRequest>,
    ) -> Result<Response<pb::Grant>, Status> {
        let caller = grpc_caller(&request)?;
        let grant = downgrade_call(&self.handle, &caller, request.into_inner()).await?;
        Ok(Response::new(grant))
    }

    async fn campaign(
        &self,
        request: Request<pb::CampaignRequest>,
    ) -> Result<Response<pb::Grant>, Status> {
        let caller = grpc_caller(&request)?;
        let grant = campaign_call(&self.handle, &caller, request.into_inner()).await?;
        Ok(Response::new(grant))
    }

    async fn proclaim(
        &self,
        request: Request<pb::ProclaimRequest>,
    ) -> Result<Response<pb::Grant>, Status> {
        let caller = grpc_caller(&request)?;
        let grant = proclaim_call(&self.handle, &caller, request.into_inner()).await?;
        Ok(Response::new(grant))
    }

    async fn resign(
        &self,
        request: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        let caller = grpc_caller(&request)?;
        let released = release_call(&self.handle, &caller, request.into_inner()).await?;
        Ok(Response::new(released))
    }

    async fn leader(
        &self,
        request: Request<pb::LeaderRequest>,
    ) -> Result<Response<pb::LeaderResponse>, Status> {
        let caller = grpc_caller(&request)?;
        let leader = leader_call(&self.handle, &caller, request.into_inner()).await?;
        Ok(Response::new(leader))
    }

    async fn acquire(
        &self,
        request: Request<pb::AcquireRequest>,
    ) -> Result<Response<pb::Grant>, Status> {
        let caller = grpc_caller(&request)?;
        // Awaited here, not spawned: if the client cancels the call, this future is
        // dropped, and dropping it takes the request out of the queue.
        let grant = acquire_call(&self.handle, &caller, request.into_inner()).await?;
        Ok(Response::new(grant))
    }

    async fn renew(
        &self,
        request: Request<pb::RenewRequest>,
    ) -> Result<Response<pb::RenewResponse>, Status> {
        let caller = grpc_caller(&request)?;
        let renewed = renew_call(&self.handle, &caller, request.into_inner()).await?;
        Ok(Response::new(renewed))
    }

    async fn release(
        &self,
        request: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        let caller = grpc_caller(&request)?;
        let released = release_call(&self.handle, &caller, request.into_inner()).await?;
        Ok(Response::new(released))
    }

    async fn force_release(
        &self,
        request: Request<pb::ForceReleaseRequest>,
    ) -> Result<Response<pb::ForceReleaseResponse>, Status> {
        let caller = grpc_caller(&request)?;
        let r = request.into_inner();
        let name = lock_name("name", &r.name)?;
        caller.authorize(Action::ForceRelease, Some(name.as_str()))?;
        caller.take_request()?;
        let fence = match r.fence {
            Some(f) => Some(Fence::new(f).ok_or_else(|| invalid("fence", "must be at least 1"))?),
            None => None,
        };
        let reason = Reason::new(&r.reason).map_err(|e| invalid("reason", e))?;
        let fences = self
            .handle
            .force_release(&Requester::of(&caller), name, fence, reason)
            .await?;
        Ok(Response::new(pb::ForceReleaseResponse {
            fences: fences.into_iter().map(Fence::get).collect(),
        }))
    }

    async fn get_lock(
        &self,
        request: Request<pb::GetLockRequest>,
    ) -> Result<Response<pb::LockInfo>, Status> {
        let caller = grpc_caller(&request)?;
        let name = lock_name("name", &request.into_inner().name)?;
        caller.authorize(Action::Read, Some(name.as_str()))?;
        match self.handle.lock(name.clone()).await? {
            Some(view) => Ok(Response::new(lock_info(view))),
            None => Err(ApiError::new(
                ApiErrorKind::NotFound,
                format!("lock {name} is not held, queued for or in lock-delay"),
            )
            .into()),
        }
    }

    async fn list_locks(
        &self,
        request: Request<pb::ListLocksRequest>,
    ) -> Result<Response<pb::ListLocksResponse>, Status> {
        let caller = grpc_caller(&request)?;
        let r = request.into_inner();
        let prefix = prefix(r.prefix)?;
        caller.authorize(Action::Read, None)?;
        let ranges = caller.ranges(&prefix)?;
        let max = match r.limit as usize {
            0 => DEFAULT_PAGE,
            n if n <= MAX_PAGE => n,
            _ => return Err(invalid("limit", format!("must be between 1 and {MAX_PAGE}")).into()),
        };
        let after = r
            .after
            .as_deref()
            .map(|a| lock_name("after", a))
            .transpose()?;
        let views = crate::input::locks_in(&self.handle, ranges, after, max, false).await?;
        let next_after = (views.len() == max)
            .then(|| views.last().map(|v| v.name.to_string()))
            .flatten();
        Ok(Response::new(pb::ListLocksResponse {
            locks: views.into_iter().map(lock_info).collect(),
            next_after,
        }))
    }

    async fn open_session(
        &self,
        request: Request<pb::OpenSessionRequest>,
    ) -> Result<Response<pb::OpenSessionResponse>, Status> {
        let caller = grpc_caller(&request)?;
        caller.authorize(Action::Session, None)?;
        caller.take_request()?;
        let r = request.into_inner();
        let (id, ttl_ms) = self
            .handle
            .open_session(&Requester::of(&caller), r.ttl_ms, owner(&r.owner)?)
            .await?;
        Ok(Response::new(pb::OpenSessionResponse {
            session: id.to_string(),
            handle: crate::input::session_handle(id),
            ttl_ms,
        }))
    }

    async fn close_session(
        &self,
        request: Request<pb::CloseSessionRequest>,
    ) -> Result<Response<pb::CloseSessionResponse>, Status> {
        let caller = grpc_caller(&request)?;
        caller.authorize(Action::Session, None)?;
        caller.take_request()?;
        let id = session_id(&request.into_inner().session)?;
        let released = self
            .handle
            .close_session(&Requester::of(&caller), id)
            .await?;
        Ok(Response::new(pb::CloseSessionResponse {
            released: released as u64,
        }))
    }

    type KeepAliveStream = GrpcStream<pb::KeepAliveResponse>;

    async fn keep_alive(
        &self,
        request: Request<Streaming<pb::KeepAliveRequest>>,
    ) -> Result<Response<Self::KeepAliveStream>, Status> {
        let caller = grpc_caller(&request)?;
        caller.authorize(Action::Session, None)?;
        let call = KeepAliveCall {
            handle: self.handle.clone(),
            caller,
            requests: request.into_inner(),
            run: self.handle.watch_state(),
        };
        Ok(Response::new(call.into_stream()))
    }

    type WatchStream = GrpcStream<pb::LockEvent>;

    async fn watch(
        &self,
        request: Request<pb::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let caller = grpc_caller(&request)?;
        caller.authorize(Action::Watch, None)?;
        let request = request.into_inner();
        let prefix = prefix(request.prefix)?;
        let ranges = caller.ranges(&prefix)?;
        // Counted against the token's stream quota for as long as the stream lives.
        let slot = caller.open_stream()?;
        let after = request.after.map(|p| Position {
            index: p.index,
            ordinal: p.ordinal,
        });
        // Subscribed before the response goes out: every event made durable after
        // the client sees the stream open is delivered.
        let (backlog, start, events) = match after {
            Some(after) => {
                let resume = self.handle.resume(after)?;
                (resume.backlog.into(), after, resume.live)
            }
            None => {
                let (start, live) = self.handle.watch_now();
                (Default::default(), start, live)
            }
        };
        let call = WatchCall {
            backlog,
            last: Some(start),
            events,
            ranges,
            run: self.handle.watch_state(),
            closing: None,
        };
        let stream = futures_util::StreamExt::inspect(call.into_stream(), move |_| {
            let _held = &slot;
        });
        let mut response = Response::new(Box::pin(stream) as Self::WatchStream);
        // Digits and a dot: always a valid header value.
        if let Ok(value) = start.to_string().parse() {
            response
                .metadata_mut()
                .insert(fencelock_proto::WATCH_START_METADATA, value);
        }
        Ok(response)
    }
}

#[cfg(test)]
mod tests {
    use futures_util::StreamExt;

    use super::*;
    use crate::engine::{Durability, EngineConfig};
    use fencelock_core::{LockName, Owner};

    #[test]
    fn not_leader_status_names_the_leader_when_known() {
        let status = Status::from(ApiError::not_leader(Some("http://127.0.0.1:7421".into())));
        assert_eq!(status.code(), Code::Unavailable);
        assert_eq!(fencelock_proto::error_code(&status), Some("not_leader"));
        assert_eq!(
            fencelock_proto::leader_url(&status),
            Some("http://127.0.0.1:7421")
        );

        let unknown = Status::from(ApiError::not_leader(None));
        assert_eq!(unknown.code(), Code::Unavailable);
        assert_eq!(fencelock_proto::error_code(&unknown), Some("not_leader"));
        assert!(unknown.metadata().get(LEADER_METADATA).is_none());

        // Only not_leader carries it; a URL that cannot be a header value is left out.
        let other = Status::from(ApiError::new(ApiErrorKind::Unavailable, "stopping"));
        assert!(other.metadata().get(LEADER_METADATA).is_none());
        let bad = Status::from(ApiError::not_leader(Some("http://a\nb".to_owned())));
        assert_eq!(fencelock_proto::error_code(&bad), Some("not_leader"));
        assert!(bad.metadata().get(LEADER_METADATA).is_none());
    }

    /// A watcher that falls behind the event channel is told how many events it
    /// missed (DATA_LOSS), never silently skipped ahead.
    #[tokio::test]
    async fn lagging_watcher_ends_with_data_loss() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = EngineConfig::new(dir.path());
        config.durability = Durability::None;
        let handle = crate::engine::start(config).unwrap();
        let mut stream = WatchCall {
            backlog: Default::default(),
            last: None,
            events: handle.subscribe(),
            ranges: vec![String::new()],
            run: handle.watch_state(),
            closing: None,
        }
        .into_stream();
        let probe = handle.subscribe();

        // Each round makes two events (granted, released); the channel holds EVENT_BUFFER.
        let rounds: u64 = 2100;
        for _ in 0..rounds {
            let grant = handle
                .acquire(
                    &Requester::anonymous(),
                    AcquireArgs {
                        name: LockName::new("lag").unwrap(),
                        ttl_ms: Some(10_000),
                        wait_ms: 0,
                        owner: Owner::default(),
                        request_id: None,
                        limit: 1,
                        lock_delay_ms: 0,
                        session: None,
                        mode: Default::default(),
                        value: None,
                    },
                )
                .await
                .unwrap();
            let anonymous = Requester::anonymous();
            assert!(handle
                .release(&anonymous, grant.name, grant.token)
                .await
                .unwrap());
        }
        // A release is answered once written, its event only after the sync: wait
        // until every event is in the channel (the probe, subscribed with the
        // stream, counts what was sent since), else the watcher's first read could
        // come while the last events are still on their way and miss fewer.
        let sent = (2 * rounds) as usize;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while probe.len() < sent {
            assert!(
                std::time::Instant::now() < deadline,
                "only {} of {sent} events were sent",
                probe.len()
            );
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        assert_eq!(probe.len(), sent, "no other event was sent");
        let status = stream.next().await.unwrap().unwrap_err();
        assert_eq!(status.code(), Code::DataLoss, "{status:?}");
        let missed: u64 = status
            .metadata()
            .get(MISSED_EVENTS_METADATA)
            .unwrap()
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(
            missed,
            2 * rounds - crate::engine::EVENT_BUFFER as u64,
            "{status:?}"
        );
        assert!(status.message().contains(&missed.to_string()), "{status:?}");
        assert!(
            stream.next().await.is_none(),
            "the stream ends after the status"
        );
        handle.shutdown().await;
    }
}
