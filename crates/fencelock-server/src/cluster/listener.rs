//! The peer port's accept loop. Only other members should connect here, so it is
//! small and strict:
//!
//! - **Connection admission** is the client port's [`Admission`] with fixed, small
//!   pools (it fits as is: what admits a peer connection differs, not the pools): a
//!   new connection waits in the unauthenticated pool (its oldest evicted when full)
//!   and is closed at [`AUTH_TIMEOUT`] unless it authenticates: with mutual TLS and
//!   no cluster secret, by its verified client certificate at the handshake;
//!   otherwise by its first request that carries the secret (the `gate` in
//!   `network.rs`, which runs before any body is read). At most
//!   [`MAX_PEER_CONNECTIONS`] are admitted, and [`MAX_PEER_CONNECTIONS_PER_IP`]
//!   from one address. So strangers cannot hold a member's peers out.
//! - **Timeouts**: the first byte and the TLS handshake within [`HANDSHAKE_TIMEOUT`],
//!   the HTTP/2 preface or HTTP/1.1 headers within [`HEADER_READ_TIMEOUT`]; HTTP/2
//!   keepalive pings close dead connections.
//! - **A mode mismatch is named**: a plain connection to a TLS peer port (or a TLS
//!   handshake on a plain one) is closed at its first byte with a warning saying
//!   that every member must use the same peer TLS settings, instead of failing
//!   somewhere inside HTTP/2 or TLS.

use std::collections::HashMap;
use std::hash::Hash;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};

use crate::admission::{Admission, Refused, Ticket};
use crate::preface;

/// Peer connections admitted at once. A member keeps one HTTP/2 connection to each
/// peer, so this is far above any real cluster's needs.
const MAX_PEER_CONNECTIONS: usize = 64;
/// Peer connections not yet authenticated, at once (the oldest is closed for a new
/// one).
const MAX_UNAUTHENTICATED: usize = 64;
/// Peer connections from one address (several members may share a host or a NAT).
const MAX_PEER_CONNECTIONS_PER_IP: usize = 64;
/// Time a peer connection has to authenticate.
const AUTH_TIMEOUT: Duration = Duration::from_secs(5);
/// Time a peer connection has to send its first byte and finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Time a peer connection has to send the HTTP/2 preface (or HTTP/1.1 headers).
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Concurrent requests on one peer connection (openraft has a few in flight).
const MAX_STREAMS: u32 = 256;
/// How often an HTTP/2 peer connection is pinged, and how long an answer may take.
const KEEPALIVE: Duration = Duration::from_secs(10);
/// How long connections get to finish after a stop before they are dropped.
const STOP_GRACE: Duration = Duration::from_secs(2);
/// The first byte of a TLS handshake record.
const TLS_HANDSHAKE: u8 = 0x16;
/// At most one warning per kind in this period.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// What a peer request carries in its extensions: its connection's place in the
/// pools, for the `gate` in `network.rs` to admit it.
#[derive(Clone)]
pub(crate) struct PeerConnection(pub(crate) Arc<Ticket>);

/// Lets a warning through at most once per period per key: a misconfigured member
/// retries many times a second, and strangers can connect as often as they like.
pub(crate) struct LogThrottle<K> {
    every: Duration,
    last: Mutex<HashMap<K, Instant>>,
}

impl<K: Eq + Hash> LogThrottle<K> {
    /// At most one per `every` per key. Keys must come from a bounded set.
    pub(crate) fn new(every: Duration) -> LogThrottle<K> {
        LogThrottle {
            every,
            last: Mutex::new(HashMap::new()),
        }
    }

    /// Whether a warning for `key` may be logged now.
    pub(crate) fn allow(&self, key: K) -> bool {
        let now = Instant::now();
        let mut last = self
            .last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match last.get(&key) {
            Some(at) if now.duration_since(*at) < self.every => false,
            _ => {
                last.insert(key, now);
                true
            }
        }
    }
}

/// What every connection of the peer listener shares.
struct Shared {
    router: axum::Router,
    builder: hyper_util::server::conn::auto::Builder<hyper_util::rt::TokioExecutor>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    /// A cluster secret is configured: connections authenticate with a request.
    secret: bool,
    warnings: LogThrottle<&'static str>,
}

/// Serves `router` (the peer routes) on `listener` until `stop`: optionally inside
/// mutual TLS (`tls`), with connection admission and timeouts (see the module
/// docs). `secret`: whether requests must carry the cluster secret (then a
/// connection is admitted by its first request that does).
pub(crate) async fn serve(
    listener: TcpListener,
    router: axum::Router,
    tls: Option<tokio_rustls::TlsAcceptor>,
    secret: bool,
    mut stop: oneshot::Receiver<()>,
) {
    use hyper_util::rt::{TokioExecutor, TokioTimer};

    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(KEEPALIVE)
        .keep_alive_timeout(KEEPALIVE)
        .max_concurrent_streams(MAX_STREAMS);
    let shared = Arc::new(Shared {
        router,
        builder,
        tls,
        secret,
        warnings: LogThrottle::new(WARN_EVERY),
    });
    let limits = crate::Limits {
        max_connections: MAX_PEER_CONNECTIONS,
        max_unauthenticated_connections: MAX_UNAUTHENTICATED,
        max_connections_per_ip: MAX_PEER_CONNECTIONS_PER_IP,
        auth_timeout: AUTH_TIMEOUT,
        ..crate::Limits::default()
    };
    // Not exported: the client port's connection metrics stay the client port's.
    let admission = Admission::new(&limits, Arc::default());
    let (stopping, stopping_rx) = watch::channel(());
    loop {
        let Some((stream, peer)) =
            crate::admission::accept_until(&listener, &mut stop, "peer").await
        else {
            break;
        };
        let ticket = match admission.enter(peer.ip()) {
            Ok(ticket) => Arc::new(ticket),
            Err(Refused::PerIp(max)) => {
                tracing::debug!(%peer, max, "refused a peer connection: too many from its address");
                continue;
            }
        };
        let shared = shared.clone();
        let stopping = stopping_rx.clone();
        tokio::spawn(async move {
            // Dropping the connection's future closes it.
            tokio::select! {
                () = connection(shared, stream, peer, ticket.clone(), stopping) => {}
                () = ticket.unauthenticated_end() => {}
            }
        });
    }
    let _ = stopping.send(());
    drop(listener);
    admission.all_ended(STOP_GRACE).await;
}

/// One peer connection: its first byte (TLS or not), the TLS handshake, then HTTP
/// until it ends.
async fn connection(
    shared: Arc<Shared>,
    stream: TcpStream,
    peer: SocketAddr,
    ticket: Arc<Ticket>,
    mut stopping: watch::Receiver<()>,
) {
    let mut first = [0u8; 1];
    let peeked = tokio::select! {
        peeked = tokio::time::timeout(HANDSHAKE_TIMEOUT, stream.peek(&mut first)) => peeked,
        _ = stopping.changed() => return,
    };
    match peeked {
        Ok(Ok(1..)) => {}
        _ => return, // closed, failed, or silent
    }
    let tls_hello = first[0] == TLS_HANDSHAKE;
    let Some(acceptor) = shared.tls.clone() else {
        if tls_hello {
            if shared.warnings.allow("tls-on-plain") {
                tracing::warn!(
                    %peer,
                    "a peer connection speaks TLS, but this member's peer port is plain: every member of a cluster must use the same peer TLS settings (--peer-tls-cert, --peer-tls-key, --peer-tls-ca)"
                );
            }
            return;
        }
        return serve_http(&shared, stream, ticket, stopping).await;
    };
    if !tls_hello {
        if shared.warnings.allow("plain-on-tls") {
            tracing::warn!(
                %peer,
                "a peer connection is not TLS, but this member's peer port requires mutual TLS: every member of a cluster must use the same peer TLS settings (--peer-tls-cert, --peer-tls-key, --peer-tls-ca)"
            );
        }
        return;
    }
    let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream));
    let stream = tokio::select! {
        done = handshake => match done {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => {
                if shared.warnings.allow("handshake") {
                    tracing::warn!(
                        %peer,
                        error = %e,
                        "refused a peer connection: its TLS handshake failed (a peer needs a certificate signed by this member's --peer-tls-ca)"
                    );
                }
                return;
            }
            Err(_) => {
                tracing::debug!(%peer, "a peer TLS handshake timed out");
                return;
            }
        },
        _ = stopping.changed() => return,
    };
    // The verified client certificate authenticates the connection, unless a
    // secret is required as well.
    if !shared.secret {
        if let Err(e) = ticket.admit() {
            tracing::debug!(%peer, ?e, "refused a peer connection");
            return;
        }
    }
    serve_http(&shared, stream, ticket, stopping).await
}

/// HTTP/2 (or HTTP/1.1) on one peer connection until it ends, or until a stop.
async fn serve_http<I>(
    shared: &Shared,
    mut io: I,
    ticket: Arc<Ticket>,
    mut stopping: watch::Receiver<()>,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use tower::ServiceExt;

    let start = tokio::select! {
        start = preface::read_start(&mut io, HEADER_READ_TIMEOUT) => start,
        _ = stopping.changed() => None,
    };
    let Some(start) = start else { return };
    let io = preface::Prefixed::new(start, io);
    let router = shared.router.clone();
    let extension = PeerConnection(ticket);
    let service = tower::service_fn(move |mut request: axum::extract::Request<_>| {
        request.extensions_mut().insert(extension.clone());
        router.clone().oneshot(request)
    });
    let service = hyper_util::service::TowerToHyperService::new(service);
    let connection = shared
        .builder
        .serve_connection(hyper_util::rt::TokioIo::new(io), service);
    tokio::pin!(connection);
    let grace = tokio::time::sleep(Duration::MAX);
    tokio::pin!(grace);
    let mut closing = false;
    loop {
        tokio::select! {
            _ = connection.as_mut() => return,
            () = &mut grace, if closing => return,
            _ = stopping.changed(), if !closing => {
                connection.as_mut().graceful_shutdown();
                closing = true;
                grace.as_mut().reset(tokio::time::Instant::now() + STOP_GRACE);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::LogThrottle;
    use std::time::Duration;

    #[test]
    fn a_throttle_lets_one_warning_per_key_through() {
        let t = LogThrottle::new(Duration::from_secs(3600));
        assert!(t.allow("a"));
        assert!(!t.allow("a"));
        assert!(t.allow("b"));
        let t = LogThrottle::new(Duration::ZERO);
        assert!(t.allow("a"));
        assert!(t.allow("a"));
    }
}
