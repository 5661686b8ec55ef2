//! Peer RPCs: openraft's messages, postcard-encoded, as HTTP/2 POSTs to the peer
//! port, over mutual TLS when the cluster has peer TLS ([`crate::tls::PeerTlsConfig`]:
//! the peer's certificate is verified against the CA under the IP of its recorded
//! peer address, and this member presents its own). Every request carries the
//! cluster secret (when set), the sender's id and URL, and a fingerprint of its core
//! configuration: a member whose configuration differs is refused, so every member
//! applies commands with the same bounds. The peer port's accept loop (admission,
//! timeouts, the TLS handshake) is in `listener.rs`.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use futures_util::future::BoxFuture;
use futures_util::stream::BoxStream;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioIo};
use openraft::error::{
    NetworkError, RPCError, RaftError, ReplicationClosed, StreamingError, Unreachable,
};
use openraft::network::v2::RaftNetworkV2;
use openraft::network::{stream_append_sequential, RPCOption, RaftNetworkFactory};
use openraft::raft::StreamAppendResult;
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, TransferLeaderRequest,
    VoteRequest, VoteResponse,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::append_stream;
use super::listener::{LogThrottle, PeerConnection};
use super::{Directory, LeaderContact, Member, Raft, SnapshotMeta, TypeConfig, Vote};

/// Header: `Bearer <cluster secret>`.
const AUTHORIZATION: &str = "authorization";
/// Header: the sender's member id.
const NODE_HEADER: &str = "x-fencelock-node";
/// Header: the sender's advertised client URL.
const URL_HEADER: &str = "x-fencelock-url";
/// Header: hex SHA-256 of the sender's core configuration.
const CONFIG_HEADER: &str = "x-fencelock-config";
/// Largest peer message accepted (a snapshot of a very large state).
pub const MAX_PEER_BODY: usize = 1 << 30;

/// Who this member is on the peer port, and what it checks of others.
#[derive(Debug, Clone)]
pub struct PeerIdentity {
    /// This member's id.
    pub node_id: u64,
    /// This member's client URL.
    pub url: String,
    /// The cluster secret.
    pub secret: Option<String>,
    /// Fingerprint of the core configuration.
    pub config: String,
}

impl PeerIdentity {
    fn headers(&self) -> Vec<(&'static str, String)> {
        let mut headers = vec![
            (NODE_HEADER, self.node_id.to_string()),
            (URL_HEADER, self.url.clone()),
            (CONFIG_HEADER, self.config.clone()),
        ];
        if let Some(secret) = &self.secret {
            headers.push((AUTHORIZATION, format!("Bearer {secret}")));
        }
        headers
    }
}

/// A peer request's body: a whole message, or a replication stream's messages.
pub(super) type PeerBody = http_body_util::combinators::BoxBody<Bytes, std::convert::Infallible>;

type HttpClient = hyper_util::client::legacy::Client<Connector, PeerBody>;

/// A connection to a peer: plain TCP, or mutual TLS over it.
enum PeerStream {
    /// Plain TCP (no peer TLS).
    Plain(TcpStream),
    /// Mutual TLS.
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl AsyncRead for PeerStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            PeerStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            PeerStream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for PeerStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            PeerStream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            PeerStream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            PeerStream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            PeerStream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            PeerStream::Plain(s) => s.is_write_vectored(),
            PeerStream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            PeerStream::Plain(s) => Pin::new(s).poll_flush(cx),
            PeerStream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            PeerStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            PeerStream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

impl Connection for PeerStream {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

/// Dials peers for the HTTP/2 client: TCP, then the TLS handshake when the cluster
/// has peer TLS.
#[derive(Clone)]
struct Connector {
    tcp: HttpConnector,
    tls: Option<tokio_rustls::TlsConnector>,
    /// Dial address (`--peer-dial`) → the IP the peer's certificate is verified
    /// for: that of its recorded peer address. Other addresses are their own name.
    names: Arc<Mutex<HashMap<String, IpAddr>>>,
    /// Handshake failures are configuration errors, retried many times a second.
    warnings: Arc<LogThrottle<String>>,
}

impl Connector {
    fn new(tls: Option<tokio_rustls::TlsConnector>) -> Connector {
        let mut tcp = HttpConnector::new();
        tcp.set_nodelay(true);
        tcp.set_connect_timeout(Some(Duration::from_secs(1)));
        // The scheme is `https` with peer TLS; this connector does the TLS itself.
        tcp.enforce_http(false);
        Connector {
            tcp,
            tls,
            names: Arc::default(),
            warnings: Arc::new(LogThrottle::new(Duration::from_secs(10))),
        }
    }

    /// The name `authority` (`ip:port`) is verified under.
    fn server_name(&self, authority: &str) -> Option<rustls::pki_types::ServerName<'static>> {
        let names = self.names.lock().unwrap_or_else(|e| e.into_inner());
        let ip = match names.get(authority) {
            Some(ip) => *ip,
            None => authority.parse::<SocketAddr>().ok()?.ip(),
        };
        Some(rustls::pki_types::ServerName::IpAddress(ip.into()))
    }
}

/// What the connector fails with.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl tower::Service<axum::http::Uri> for Connector {
    type Response = TokioIo<PeerStream>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.tcp.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: axum::http::Uri) -> Self::Future {
        let authority = uri
            .authority()
            .map(|a| a.as_str().to_owned())
            .unwrap_or_default();
        let name = self.server_name(&authority);
        let tcp = self.tcp.call(uri);
        let tls = self.tls.clone();
        let warnings = self.warnings.clone();
        Box::pin(async move {
            let tcp = tcp.await?.into_inner();
            let Some(tls) = tls else {
                return Ok(TokioIo::new(PeerStream::Plain(tcp)));
            };
            let name = name.ok_or_else(|| format!("{authority} is not an IP:port peer address"))?;
            match tls.connect(name, tcp).await {
                Ok(stream) => Ok(TokioIo::new(PeerStream::Tls(Box::new(stream)))),
                Err(e) => {
                    if warnings.allow(authority.clone()) {
                        tracing::warn!(
                            peer = %authority,
                            error = %e,
                            "TLS handshake with a peer failed: every member of a cluster must use the same peer TLS settings, with certificates signed by the same --peer-tls-ca and naming the IP of their peer address"
                        );
                    }
                    Err(e.into())
                }
            }
        })
    }
}

/// Builds peer clients for openraft.
#[derive(Clone)]
pub struct Network {
    identity: Arc<PeerIdentity>,
    directory: Arc<Directory>,
    http: HttpClient,
    connector: Connector,
    dial: Arc<BTreeMap<u64, SocketAddr>>,
}

impl Network {
    /// A network with one HTTP/2 connection pool for all peers; `tls`: dial them
    /// with mutual TLS (see [`crate::tls::PeerTlsConfig::connector`]).
    pub fn new(
        identity: Arc<PeerIdentity>,
        directory: Arc<Directory>,
        dial: BTreeMap<u64, SocketAddr>,
        tls: Option<tokio_rustls::TlsConnector>,
    ) -> Network {
        let connector = Connector::new(tls);
        let http = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            .http2_only(true)
            .build(connector.clone());
        Network {
            identity,
            directory,
            http,
            connector,
            dial: Arc::new(dial),
        }
    }

    fn scheme(&self) -> &'static str {
        if self.connector.tls.is_some() {
            "https"
        } else {
            "http"
        }
    }
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = Peer;

    async fn new_client(&mut self, target: u64, node: &Member) -> Peer {
        let addr = match self.dial.get(&target) {
            Some(addr) => {
                // The peer is still verified as the member the cluster records.
                if let Ok(recorded) = node.peer_addr.parse::<SocketAddr>() {
                    let mut names = self
                        .connector
                        .names
                        .lock()
                        .unwrap_or_else(|e| e.into_inner());
                    names.insert(addr.to_string(), recorded.ip());
                }
                addr.to_string()
            }
            None => node.peer_addr.clone(),
        };
        Peer {
            target,
            addr,
            network: self.clone(),
        }
    }
}

/// openraft's client for one peer.
pub struct Peer {
    target: u64,
    addr: String,
    network: Network,
}

pub(super) fn unreachable(e: impl std::fmt::Display) -> RPCError<TypeConfig> {
    RPCError::Unreachable(Unreachable::new(&std::io::Error::other(e.to_string())))
}

pub(super) fn network_error(e: impl std::fmt::Display) -> RPCError<TypeConfig> {
    RPCError::Network(NetworkError::new(&std::io::Error::other(e.to_string())))
}

impl Peer {
    /// POSTs `body` to `/raft/{path}` with this member's identity, waiting up to
    /// `timeout` for the answer's headers; records the sender's URL they carry.
    async fn send(
        &self,
        path: &str,
        body: PeerBody,
        timeout: Duration,
    ) -> Result<axum::http::Response<hyper::body::Incoming>, RPCError<TypeConfig>> {
        let mut request = axum::http::Request::post(format!(
            "{}://{}/raft/{path}",
            self.network.scheme(),
            self.addr
        ));
        for (name, value) in self.network.identity.headers() {
            request = request.header(name, value);
        }
        let request = request.body(body).map_err(network_error)?;
        let response = tokio::time::timeout(timeout, self.network.http.request(request))
            .await
            .map_err(|_| {
                network_error(format!(
                    "peer {} did not answer within {timeout:?}",
                    self.target
                ))
            })?
            .map_err(|e| {
                unreachable(format!(
                    "peer {} at {}: {}",
                    self.target,
                    self.addr,
                    error_chain(&e)
                ))
            })?;
        if let (Some(id), Some(url)) = (
            header(response.headers(), NODE_HEADER).and_then(|v| v.parse().ok()),
            header(response.headers(), URL_HEADER),
        ) {
            self.network.directory.learn(id, url);
        }
        Ok(response)
    }

    /// The error for a refusal (secret, configuration): not transient, so said
    /// loudly, with the peer's reason.
    fn refused(&self, status: StatusCode, body: &[u8]) -> RPCError<TypeConfig> {
        let why = String::from_utf8_lossy(body).into_owned();
        tracing::warn!(peer = self.target, %status, %why, "peer refused a raft request");
        unreachable(format!("peer {} refused: {status} {why}", self.target))
    }

    async fn call<Req, Resp>(
        &self,
        path: &str,
        req: &Req,
        timeout: Duration,
    ) -> Result<Result<Resp, RaftError<TypeConfig>>, RPCError<TypeConfig>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
    {
        let body = postcard::to_allocvec(req).map_err(network_error)?;
        let response = self
            .send(path, Full::new(Bytes::from(body)).boxed(), timeout)
            .await?;
        let status = response.status();
        let bytes = tokio::time::timeout(timeout, response.into_body().collect())
            .await
            .map_err(|_| network_error("peer answer timed out"))?
            .map_err(network_error)?
            .to_bytes();
        if !status.is_success() {
            return Err(self.refused(status, &bytes));
        }
        postcard::from_bytes(&bytes).map_err(network_error)
    }
}

/// An error and its sources, `a: b: c` (the HTTP client's own message is only
/// "client error (Connect)").
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(e) = source {
        text.push_str(": ");
        text.push_str(&e.to_string());
        source = e.source();
    }
    text
}

/// A peer's own Raft failure (it stopped): to us, an unreachable peer.
fn raft_error(e: RaftError<TypeConfig>) -> RPCError<TypeConfig> {
    unreachable(format!("the peer's raft failed: {e}"))
}

impl RaftNetworkV2<TypeConfig> for Peer {
    type SnapshotData = Vec<u8>;

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.call("append", &rpc, option.hard_ttl())
            .await?
            .map_err(raft_error)
    }

    /// Pipelined (see `append_stream`): requests go as openraft makes them, without
    /// waiting for the answer to the one before. A member without the stream route
    /// (an older version, during a rolling upgrade) gets one request at a time.
    fn stream_append<'s, S>(
        &'s mut self,
        input: S,
        option: RPCOption,
    ) -> BoxFuture<'s, Result<BoxStream<'s, StreamAnswer>, RPCError<TypeConfig>>>
    where
        S: futures_util::Stream<Item = AppendEntriesRequest<TypeConfig>> + Send + Unpin + 'static,
    {
        Box::pin(async move {
            let ttl = option.hard_ttl();
            let (tx, rx) = tokio::sync::mpsc::channel(append_stream::SEND_QUEUE);
            let response = self
                .send("append-stream", append_stream::request_body(rx), ttl)
                .await?;
            let status = response.status();
            if status == StatusCode::NOT_FOUND {
                return stream_append_sequential(self, input, option).await;
            }
            if !status.is_success() {
                let bytes = tokio::time::timeout(ttl, response.into_body().collect())
                    .await
                    .ok()
                    .and_then(Result::ok)
                    .map(|c| c.to_bytes())
                    .unwrap_or_default();
                return Err(self.refused(status, &bytes));
            }
            let sent = Arc::default();
            let sender = append_stream::spawn_sender(input, tx, Arc::clone(&sent));
            Ok(append_stream::answers(
                response.into_body(),
                sent,
                sender,
                ttl,
                self.target,
                MAX_PEER_BODY,
            ))
        })
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.call("vote", &rpc, option.hard_ttl())
            .await?
            .map_err(raft_error)
    }

    async fn pre_vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.call("pre-vote", &rpc, option.hard_ttl())
            .await?
            .map_err(raft_error)
    }

    async fn full_snapshot(
        &mut self,
        vote: Vote,
        snapshot: openraft::alias::SnapshotOf<TypeConfig, Vec<u8>>,
        cancel: impl Future<Output = ReplicationClosed> + Send + 'static,
        option: RPCOption,
    ) -> Result<SnapshotResponse<TypeConfig>, StreamingError<TypeConfig>> {
        let req = (vote, snapshot.meta, snapshot.snapshot);
        let timeout = option.hard_ttl().max(Duration::from_secs(60));
        tokio::select! {
            closed = cancel => Err(StreamingError::Closed(closed)),
            result = self.call::<_, SnapshotResponse<TypeConfig>>("snapshot", &req, timeout) => match result {
                Ok(Ok(response)) => Ok(response),
                Ok(Err(e)) => Err(StreamingError::from(raft_error(e))),
                Err(e) => Err(StreamingError::from(e)),
            },
        }
    }

    async fn transfer_leader(
        &mut self,
        req: TransferLeaderRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<openraft::raft::TransferLeaderResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.call("transfer-leader", &req, option.hard_ttl())
            .await?
            .map_err(raft_error)
    }
}

/// One answer of a replication stream, as openraft takes it.
type StreamAnswer = Result<StreamAppendResult<TypeConfig>, RPCError<TypeConfig>>;

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// What the peer port's handlers share.
#[derive(Clone)]
pub struct PeerState {
    /// The local Raft.
    pub raft: Raft,
    /// This member.
    pub identity: Arc<PeerIdentity>,
    /// Where peers' URLs are recorded.
    pub directory: Arc<Directory>,
    /// Where accepted replication from the leader is recorded (for readiness).
    pub contact: Arc<LeaderContact>,
}

/// The peer port's routes.
pub fn router(state: PeerState) -> axum::Router {
    axum::Router::new()
        .route("/raft/append", post(append))
        .route("/raft/append-stream", post(append_stream_handler))
        .route("/raft/vote", post(vote))
        .route("/raft/pre-vote", post(pre_vote))
        .route("/raft/snapshot", post(snapshot))
        .route("/raft/transfer-leader", post(transfer_leader))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_PEER_BODY))
        .layer(axum::middleware::from_fn_with_state(state.clone(), gate))
        .with_state(state)
}

/// In front of every peer route, before any body is read: a request without the
/// cluster secret (when one is set) is refused with 401; otherwise its connection
/// is admitted (`listener.rs`), or refused with 503 when the peer port has its
/// maximum of admitted connections.
async fn gate(
    State(state): State<PeerState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if let Some(secret) = &state.identity.secret {
        let presented = header(request.headers(), AUTHORIZATION)
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        if !crate::auth::secrets_equal(presented.as_bytes(), secret.as_bytes()) {
            return (StatusCode::UNAUTHORIZED, "wrong or missing cluster secret").into_response();
        }
    }
    if let Some(PeerConnection(ticket)) = request.extensions().get::<PeerConnection>() {
        if let Err(refused) = ticket.admit() {
            let refused = refused.into_error();
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                refused.message().to_owned(),
            )
                .into_response();
        }
    }
    next.run(request).await
}

/// Refuses a request from a member with another configuration; records the
/// sender's URL. (The secret is checked by [`gate`].)
fn check_sender(state: &PeerState, headers: &HeaderMap) -> Result<(), Box<Response>> {
    let config = header(headers, CONFIG_HEADER).unwrap_or("");
    if config != state.identity.config {
        return Err(Box::new((
            StatusCode::CONFLICT,
            format!(
                "core configuration differs: this member has {}, the sender {config}; every member must run with the same limits",
                state.identity.config
            ),
        )
            .into_response()));
    }
    if let (Some(id), Some(url)) = (
        header(headers, NODE_HEADER).and_then(|v| v.parse().ok()),
        header(headers, URL_HEADER),
    ) {
        state.directory.learn(id, url);
    }
    Ok(())
}

fn reply<T: Serialize>(state: &PeerState, value: &T) -> Response {
    match postcard::to_allocvec(value) {
        Ok(bytes) => {
            let mut response = bytes.into_response();
            let headers = response.headers_mut();
            headers.insert(NODE_HEADER, HeaderValue::from(state.identity.node_id));
            if let Ok(url) = HeaderValue::from_str(&state.identity.url) {
                headers.insert(URL_HEADER, url);
            }
            response
        }
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, Box<Response>> {
    postcard::from_bytes(body).map_err(|e| {
        Box::new(
            (
                StatusCode::BAD_REQUEST,
                format!("undecodable peer message: {e}"),
            )
                .into_response(),
        )
    })
}

async fn append(State(state): State<PeerState>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(refused) = check_sender(&state, &headers) {
        return *refused;
    }
    let req: AppendEntriesRequest<TypeConfig> = match decode(&body) {
        Ok(req) => req,
        Err(bad) => return *bad,
    };
    let result = state.raft.append_entries(req).await;
    // Refused for a higher vote: the sender is no leader of ours.
    if matches!(&result, Ok(r) if !matches!(r, AppendEntriesResponse::HigherVote(_))) {
        state.contact.record();
    }
    reply(&state, &result)
}

/// A replication stream from the leader (see `append_stream`).
async fn append_stream_handler(
    State(state): State<PeerState>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    if let Err(refused) = check_sender(&state, &headers) {
        return *refused;
    }
    let contact = state.contact.clone();
    let answers = append_stream::serve(state.raft.clone(), body, MAX_PEER_BODY, move || {
        contact.record()
    });
    let mut response = axum::body::Body::from_stream(answers).into_response();
    let headers = response.headers_mut();
    headers.insert(NODE_HEADER, HeaderValue::from(state.identity.node_id));
    if let Ok(url) = HeaderValue::from_str(&state.identity.url) {
        headers.insert(URL_HEADER, url);
    }
    response
}

async fn vote(State(state): State<PeerState>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(refused) = check_sender(&state, &headers) {
        return *refused;
    }
    let req: VoteRequest<TypeConfig> = match decode(&body) {
        Ok(req) => req,
        Err(bad) => return *bad,
    };
    let asked = req.last_log_id;
    let result = state.raft.vote(req).await;
    if let Ok(answer) = &result {
        state.contact.record_vote_answer(asked.as_ref(), answer);
    }
    reply(&state, &result)
}

async fn pre_vote(State(state): State<PeerState>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(refused) = check_sender(&state, &headers) {
        return *refused;
    }
    let req: VoteRequest<TypeConfig> = match decode(&body) {
        Ok(req) => req,
        Err(bad) => return *bad,
    };
    let asked = req.last_log_id;
    let result = state.raft.pre_vote(req).await;
    if let Ok(answer) = &result {
        state.contact.record_vote_answer(asked.as_ref(), answer);
    }
    reply(&state, &result)
}

async fn snapshot(State(state): State<PeerState>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(refused) = check_sender(&state, &headers) {
        return *refused;
    }
    let (vote, meta, data): (Vote, SnapshotMeta, Vec<u8>) = match decode(&body) {
        Ok(req) => req,
        Err(bad) => return *bad,
    };
    let snapshot = openraft::alias::SnapshotOf::<TypeConfig, Vec<u8>> {
        meta,
        snapshot: data,
    };
    let result = state
        .raft
        .install_full_snapshot(vote, snapshot)
        .await
        .map_err(RaftError::<TypeConfig>::Fatal);
    reply(&state, &result)
}

async fn transfer_leader(
    State(state): State<PeerState>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(refused) = check_sender(&state, &headers) {
        return *refused;
    }
    let req: TransferLeaderRequest<TypeConfig> = match decode(&body) {
        Ok(req) => req,
        Err(bad) => return *bad,
    };
    let result = state
        .raft
        .handle_transfer_leader(req)
        .await
        .map_err(RaftError::<TypeConfig>::Fatal);
    reply(&state, &result)
}
