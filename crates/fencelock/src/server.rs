//! The fencelock server as a [`LockBackend`]: `Acquire`, `Renew` and `Release` over the
//! wire protocol `flw/1` (see [`Transport`]), everything else over gRPC
//! (`fencelock.v1.Locks`).

use std::time::Duration;

use fencelock_proto as pb;
use fencelock_proto::locks_client::LocksClient;
use tonic::metadata::MetadataValue;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Request, Status};

use fencelock_proto::wire::{Request as WireRequest, Response as WireResponse};

use crate::backend::{AcquireSpec, BoxFuture, Capabilities, FenceGuarantee, Lease, LockBackend};
use crate::wire::WireClient;
use crate::{Error, ErrorKind};
use tokio_rustls::rustls::pki_types::ServerName;

/// How to reach a fencelock server.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ServerConfig {
    /// The server's URL, e.g. `http://127.0.0.1:7420`.
    pub url: String,
    /// How long to wait for a TCP connection before a request fails as
    /// [`ErrorKind::Unavailable`]. Default 5 s.
    pub connect_timeout: Duration,
    /// How long a request may take beyond any time it asked the server to wait.
    /// Default 10 s.
    pub request_timeout: Duration,
    /// A bearer token sent with every request, if the server requires one.
    pub token: Option<String>,
    /// For `https://` URLs: the PEM certificate(s) of the CA to trust instead of the
    /// system's roots (e.g. a private CA).
    pub ca_cert_pem: Option<Vec<u8>>,
    /// How `Acquire`, `Renew` and `Release` travel. Default [`Transport::Wire`].
    pub transport: Transport,
}

/// How the hot-path calls (`Acquire`, `Renew`, `Release`) reach the server. Listings,
/// force-release and watches always use gRPC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Transport {
    /// The wire protocol `flw/1` on the same port (inside TLS for `https://` URLs),
    /// a fraction of gRPC's CPU per request, falling back to gRPC for a server that
    /// does not speak it.
    #[default]
    Wire,
    /// gRPC for everything.
    Grpc,
}

impl ServerConfig {
    /// The defaults for `url`.
    pub fn new(url: impl Into<String>) -> ServerConfig {
        ServerConfig {
            url: url.into(),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
            token: None,
            ca_cert_pem: None,
            transport: Transport::Wire,
        }
    }
}

/// The fencelock server, spoken to over gRPC: durable fences, FIFO waiters with
/// direct hand-off, leases on the server's monotonic clock.
///
/// The connection is shared by every clone and re-established after a failure; a
/// request sent while the server is unreachable fails as [`ErrorKind::Unavailable`].
#[derive(Debug, Clone)]
pub struct FencelockBackend {
    client: LocksClient<Channel>,
    /// The `flw/1` connection, unless gRPC was chosen.
    wire: Option<WireClient>,
    request_timeout: Duration,
    authorization: Option<MetadataValue<tonic::metadata::Ascii>>,
}

/// The longest wait one `Acquire` call may ask for (the server's default bound);
/// longer waits are split into several calls.
const MAX_WAIT_PER_CALL: Duration = Duration::from_secs(3600);

impl FencelockBackend {
    /// Connects to the server at `config.url`, failing if it cannot be reached within
    /// `connect_timeout`.
    pub async fn connect(config: ServerConfig) -> Result<FencelockBackend, Error> {
        let endpoint = endpoint(&config)?;
        if let Some(wire) = wire_client(&config, &endpoint)? {
            let backend = FencelockBackend::from_channel(endpoint.connect_lazy(), &config)?;
            match wire.connect().await {
                Ok(()) => return Ok(backend.with_wire(wire)),
                // An older server: gRPC only, connected eagerly below.
                Err(_) if !wire.usable() => {}
                Err(e) => return Err(e),
            }
        }
        let channel = endpoint.connect().await.map_err(|e| {
            Error::new(
                ErrorKind::Unavailable,
                format!("cannot connect to {}: {}", config.url, source_chain(&e)),
            )
        })?;
        FencelockBackend::from_channel(channel, &config)
    }

    /// Like [`connect`](FencelockBackend::connect), but connects on first use (and
    /// never fails for an unreachable server: requests do).
    pub fn connect_lazy(config: ServerConfig) -> Result<FencelockBackend, Error> {
        let endpoint = endpoint(&config)?;
        let backend = FencelockBackend::from_channel(endpoint.connect_lazy(), &config)?;
        Ok(match wire_client(&config, &endpoint)? {
            Some(wire) => backend.with_wire(wire),
            None => backend,
        })
    }

    fn with_wire(mut self, wire: WireClient) -> FencelockBackend {
        self.wire = Some(wire);
        self
    }

    /// The `flw/1` connection, while the server is known to speak it.
    fn wire(&self) -> Option<&WireClient> {
        self.wire.as_ref().filter(|w| w.usable())
    }

    fn from_channel(channel: Channel, config: &ServerConfig) -> Result<FencelockBackend, Error> {
        let authorization = match &config.token {
            None => None,
            Some(token) => Some(format!("Bearer {token}").parse().map_err(|_| {
                Error::new(
                    ErrorKind::InvalidArgument,
                    "the token must be printable ASCII",
                )
            })?),
        };
        Ok(FencelockBackend {
            client: LocksClient::new(channel),
            wire: None,
            request_timeout: config.request_timeout,
            authorization,
        })
    }

    fn request<T>(&self, message: T, extra_time: Duration) -> Request<T> {
        let mut request = Request::new(message);
        request.set_timeout(self.request_timeout.saturating_add(extra_time));
        if let Some(auth) = &self.authorization {
            request.metadata_mut().insert("authorization", auth.clone());
        }
        request
    }

    /// One lock's holders and queue; [`ErrorKind::NotFound`] if nobody holds, waits
    /// for, or is delayed on it.
    pub async fn get_lock(&self, name: &str) -> Result<pb::LockInfo, Error> {
        let request = self.request(
            pb::GetLockRequest {
                name: name.to_owned(),
            },
            Duration::ZERO,
        );
        let response = self.client.clone().get_lock(request).await;
        Ok(response.map_err(error_from_status)?.into_inner())
    }

    /// Locks whose names start with `prefix`, in name order, a page at a time: pass the
    /// previous page's `next_after` as `after`. `limit` 0 means the server's default.
    pub async fn list_locks(
        &self,
        prefix: &str,
        after: Option<String>,
        limit: u32,
    ) -> Result<pb::ListLocksResponse, Error> {
        let request = self.request(
            pb::ListLocksRequest {
                prefix: prefix.to_owned(),
                after,
                limit,
            },
            Duration::ZERO,
        );
        let response = self.client.clone().list_locks(request).await;
        Ok(response.map_err(error_from_status)?.into_inner())
    }

    /// Operator action: takes `name` from its holder(s) (only the one with `fence`, if
    /// given), with a reason for the audit trail. Returns the fences released.
    pub async fn force_release(
        &self,
        name: &str,
        fence: Option<u64>,
        reason: &str,
    ) -> Result<Vec<u64>, Error> {
        let request = self.request(
            pb::ForceReleaseRequest {
                name: name.to_owned(),
                fence,
                reason: reason.to_owned(),
            },
            Duration::ZERO,
        );
        let response = self.client.clone().force_release(request).await;
        Ok(response.map_err(error_from_status)?.into_inner().fences)
    }

    /// Durable lock events for names starting with `prefix`, from now on. The stream
    /// ends with an error if the watcher fell behind or the server went away: re-read
    /// the state and watch again.
    pub async fn watch(&self, prefix: &str) -> Result<EventStream, Error> {
        let mut request = Request::new(pb::WatchRequest {
            prefix: prefix.to_owned(),
        });
        if let Some(auth) = &self.authorization {
            request.metadata_mut().insert("authorization", auth.clone());
        }
        let response = self.client.clone().watch(request).await;
        Ok(EventStream {
            inner: response.map_err(error_from_status)?.into_inner(),
        })
    }
}

/// A stream of lock events from [`FencelockBackend::watch`].
#[derive(Debug)]
pub struct EventStream {
    inner: tonic::Streaming<pb::LockEvent>,
}

impl EventStream {
    /// The next event; `Ok(None)` when the server ended the stream cleanly.
    pub async fn next(&mut self) -> Result<Option<pb::LockEvent>, Error> {
        self.inner.message().await.map_err(error_from_status)
    }
}

fn endpoint(config: &ServerConfig) -> Result<Endpoint, Error> {
    let endpoint = Endpoint::from_shared(config.url.clone()).map_err(|e| {
        Error::new(
            ErrorKind::InvalidArgument,
            format!("invalid server URL {:?}: {e}", config.url),
        )
    })?;
    let endpoint = if endpoint.uri().scheme_str() == Some("https") {
        let tls = match &config.ca_cert_pem {
            Some(pem) => ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem)),
            None => ClientTlsConfig::new().with_native_roots(),
        };
        endpoint.tls_config(tls).map_err(|e| {
            Error::new(
                ErrorKind::InvalidArgument,
                format!("TLS settings for {:?}: {}", config.url, source_chain(&e)),
            )
        })?
    } else if config.ca_cert_pem.is_some() {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "a CA certificate was given, but {:?} is not an https:// URL",
                config.url
            ),
        ));
    } else {
        endpoint
    };
    Ok(endpoint
        .connect_timeout(config.connect_timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(5))
        .keep_alive_while_idle(true))
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl LockBackend for FencelockBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            backend: "fencelock",
            fences: FenceGuarantee::Durable,
            fifo: true,
            push_wakeups: true,
            lock_delay: true,
            sessions: true,
            semaphores: true,
            monotonic_leases: true,
        }
    }

    fn acquire<'a>(&'a self, spec: &'a AcquireSpec) -> BoxFuture<'a, Result<Lease, Error>> {
        Box::pin(async move {
            spec.validate()?;
            let wait = spec.wait.min(MAX_WAIT_PER_CALL);
            let message = pb::AcquireRequest {
                name: spec.name.clone(),
                ttl_ms: Some(ms(spec.ttl)),
                wait_ms: ms(wait),
                owner: spec.owner.clone(),
                request_id: Some(spec.request_id.clone()),
                limit: spec.limit,
                lock_delay_ms: ms(spec.lock_delay),
                session: None,
            };
            let grant = match self.wire() {
                Some(wire) => match wire.call(WireRequest::Acquire(message), wait, true).await? {
                    WireResponse::Grant(grant) => grant,
                    other => return Err(unexpected("Acquire", &other)),
                },
                None => self
                    .client
                    .clone()
                    .acquire(self.request(message, wait))
                    .await
                    .map_err(error_from_status)?
                    .into_inner(),
            };
            Ok(Lease {
                name: grant.name,
                fence: grant.fence,
                owner_token: grant.owner_token,
                ttl: Duration::from_millis(grant.ttl_ms),
            })
        })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Duration, Error>> {
        Box::pin(async move {
            let message = pb::RenewRequest {
                name: lease.name.clone(),
                owner_token: lease.owner_token.clone(),
                ttl_ms: Some(ms(ttl)),
            };
            let renewed = match self.wire() {
                Some(wire) => match wire
                    .call(WireRequest::Renew(message), Duration::ZERO, false)
                    .await?
                {
                    WireResponse::Renewed(renewed) => renewed,
                    other => return Err(unexpected("Renew", &other)),
                },
                None => self
                    .client
                    .clone()
                    .renew(self.request(message, Duration::ZERO))
                    .await
                    .map_err(error_from_status)?
                    .into_inner(),
            };
            Ok(Duration::from_millis(renewed.ttl_ms))
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            let message = pb::ReleaseRequest {
                name: lease.name.clone(),
                owner_token: lease.owner_token.clone(),
            };
            let released = match self.wire() {
                Some(wire) => {
                    match wire
                        .call(WireRequest::Release(message), Duration::ZERO, false)
                        .await
                    {
                        Ok(WireResponse::Released(r)) => Ok(r.released),
                        Ok(other) => Err(unexpected("Release", &other)),
                        Err(e) => Err(e),
                    }
                }
                None => self
                    .client
                    .clone()
                    .release(self.request(message, Duration::ZERO))
                    .await
                    .map(|r| r.into_inner().released)
                    .map_err(error_from_status),
            };
            match released {
                // Already expired or taken: nothing of ours is left to release.
                Err(e) if e.kind() == ErrorKind::NotHeld => Ok(false),
                other => other,
            }
        })
    }
}

/// An answer of the wrong kind: the server broke the protocol.
fn unexpected(call: &str, answer: &WireResponse) -> Error {
    Error::new(
        ErrorKind::Protocol,
        format!("the server answered {call} with {answer:?}"),
    )
}

/// The `flw/1` client for `config`, if it asks for the wire transport.
fn wire_client(config: &ServerConfig, endpoint: &Endpoint) -> Result<Option<WireClient>, Error> {
    let uri = endpoint.uri();
    if config.transport != Transport::Wire {
        return Ok(None);
    }
    let Some(host) = uri.host() else {
        return Ok(None);
    };
    let https = uri.scheme_str() == Some("https");
    let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let addr = if bare.contains(':') {
        format!("[{bare}]:{port}")
    } else {
        format!("{bare}:{port}")
    };
    let tls = if https {
        let name = ServerName::try_from(bare.to_owned()).map_err(|e| {
            Error::new(
                ErrorKind::InvalidArgument,
                format!("invalid server name in {:?}: {e}", config.url),
            )
        })?;
        Some((
            crate::wire::tls_connector(config.ca_cert_pem.as_deref())?,
            name,
        ))
    } else {
        None
    };
    Ok(Some(WireClient::new(
        addr,
        tls,
        config.token.clone(),
        config.connect_timeout,
        config.request_timeout,
    )))
}

/// The client's [`ErrorKind`] of one of the server's stable error codes.
pub(crate) fn kind_from_code(code: &str) -> ErrorKind {
    match code {
        "held" => ErrorKind::Held,
        "timeout" => ErrorKind::Timeout,
        "not_held" | "expired" => ErrorKind::NotHeld,
        "limit_mismatch" => ErrorKind::LimitMismatch,
        "session_not_found" => ErrorKind::SessionNotFound,
        "not_found" => ErrorKind::NotFound,
        "invalid_argument" | "invalid_json" | "payload_too_large" => ErrorKind::InvalidArgument,
        "resource_exhausted" | "rate_limited" => ErrorKind::ResourceExhausted,
        "unauthenticated" | "permission_denied" => ErrorKind::PermissionDenied,
        "unavailable" | "cancelled" => ErrorKind::Unavailable,
        "internal" => ErrorKind::Internal,
        _ => ErrorKind::Protocol,
    }
}

/// Maps a gRPC status to an [`Error`], by the server's stable error code when the
/// status carries one, else by the gRPC code (a status without a code did not come
/// from the fencelock server's handlers: transport failures, timeouts of this client).
pub(crate) fn error_from_status(status: Status) -> Error {
    let message = status.message().to_owned();
    let kind = match fencelock_proto::error_code(&status) {
        Some(code) => kind_from_code(code),
        None => match status.code() {
            // No answer from the server in time, a broken connection, a refused one.
            Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown => {
                ErrorKind::Unavailable
            }
            Code::ResourceExhausted => ErrorKind::ResourceExhausted,
            Code::Unauthenticated | Code::PermissionDenied => ErrorKind::PermissionDenied,
            Code::InvalidArgument | Code::OutOfRange => ErrorKind::InvalidArgument,
            Code::Internal => ErrorKind::Internal,
            _ => ErrorKind::Protocol,
        },
    };
    let message = if message.is_empty() {
        format!("{:?}", status.code())
    } else {
        message
    };
    Error::new(kind, message)
}

fn source_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}
