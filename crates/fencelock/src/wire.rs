//! The client side of the wire protocol `flw/1` ([`fencelock_proto::wire`]): one
//! multiplexed TCP connection per [`crate::FencelockBackend`] (shared by its clones) for
//! `Acquire`, `Renew` and `Release`.
//!
//! A connection task owns the socket: it writes the requests queued since its last
//! write in one go, routes answers to their callers by id, pings when it has sent
//! nothing for [`PING_INTERVAL`] (the server closes silent connections), and when the
//! connection breaks fails every request in flight as [`ErrorKind::Unavailable`]. The
//! next request opens a new connection. A caller that stops waiting for an acquire
//! (dropped, or timed out) sends `Cancel`, so the server takes it out of the queue; a
//! grant that was already on its way is released by the connection task.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencelock_proto::wire::{self, Request, Response};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_rustls::rustls::pki_types::ServerName;

use crate::{Error, ErrorKind};

/// How long the connection may stay silent before the client pings (well inside the
/// server's 60 s idle limit).
pub(crate) const PING_INTERVAL: Duration = Duration::from_secs(20);

type Reply = oneshot::Sender<Result<Response, Error>>;

enum Out {
    Call {
        id: u64,
        request: Request,
        reply: Reply,
    },
    Cancel(u64),
}

/// A lazily (re)connected `flw/1` connection to one server.
#[derive(Debug, Clone)]
pub(crate) struct WireClient {
    shared: Arc<Shared>,
}

struct Shared {
    /// `host:port`.
    addr: String,
    /// For `https://` URLs: the connector and the name the certificate must carry.
    tls: Option<(tokio_rustls::TlsConnector, ServerName<'static>)>,
    token: Option<String>,
    connect_timeout: Duration,
    request_timeout: Duration,
    conn: Mutex<Option<mpsc::UnboundedSender<Out>>>,
    connecting: tokio::sync::Mutex<()>,
    next_id: AtomicU64,
    /// The server answered the magic with something else: use gRPC.
    unsupported: AtomicBool,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WireClient")
            .field("addr", &self.addr)
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Out {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Out::Call { id, .. } => write!(f, "Call({id})"),
            Out::Cancel(id) => write!(f, "Cancel({id})"),
        }
    }
}

fn unavailable(message: impl Into<String>) -> Error {
    Error::new(ErrorKind::Unavailable, message)
}

/// Sends `Cancel` for a waiting acquire unless disarmed (the answer arrived).
struct CancelOnDrop {
    tx: Option<mpsc::UnboundedSender<Out>>,
    id: u64,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(Out::Cancel(self.id));
        }
    }
}

impl WireClient {
    /// A client for the server at `addr` (`host:port`), inside TLS if `tls` is given;
    /// connects on first use.
    pub(crate) fn new(
        addr: String,
        tls: Option<(tokio_rustls::TlsConnector, ServerName<'static>)>,
        token: Option<String>,
        connect_timeout: Duration,
        request_timeout: Duration,
    ) -> WireClient {
        WireClient {
            shared: Arc::new(Shared {
                addr,
                tls,
                token,
                connect_timeout,
                request_timeout,
                conn: Mutex::new(None),
                connecting: tokio::sync::Mutex::new(()),
                next_id: AtomicU64::new(1),
                unsupported: AtomicBool::new(false),
            }),
        }
    }

    /// False once the server has shown it does not speak `flw/1`.
    pub(crate) fn usable(&self) -> bool {
        !self.shared.unsupported.load(Ordering::Relaxed)
    }

    /// Sends `request` and waits for its answer, at most the request timeout plus
    /// `extra_time` (the wait the request asks the server for). A server's error
    /// answer becomes an [`Error`] by its stable code. With `cancellable`, giving up
    /// (drop or timeout) tells the server to stop waiting.
    pub(crate) async fn call(
        &self,
        request: Request,
        extra_time: Duration,
        cancellable: bool,
    ) -> Result<Response, Error> {
        let tx = self.connection().await?;
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (reply, answer) = oneshot::channel();
        tx.send(Out::Call { id, request, reply })
            .map_err(|_| unavailable("the connection to the server closed"))?;
        let mut cancel = CancelOnDrop {
            tx: cancellable.then_some(tx),
            id,
        };
        let within = self.shared.request_timeout.saturating_add(extra_time);
        let answer = match tokio::time::timeout(within, answer).await {
            Ok(answer) => {
                cancel.tx = None;
                answer.map_err(|_| unavailable("the connection to the server closed"))??
            }
            Err(_) => {
                return Err(unavailable(format!(
                    "no answer from {} within {within:?}",
                    self.shared.addr
                )))
            }
        };
        match answer {
            Response::Error(e) => Err(Error::new(
                crate::server::kind_from_code(&e.code),
                e.message,
            )),
            other => Ok(other),
        }
    }

    /// Opens the connection now (for an eager connect).
    pub(crate) async fn connect(&self) -> Result<(), Error> {
        self.connection().await.map(drop)
    }

    async fn connection(&self) -> Result<mpsc::UnboundedSender<Out>, Error> {
        if let Some(tx) = self.current() {
            return Ok(tx);
        }
        let _one = self.shared.connecting.lock().await;
        if let Some(tx) = self.current() {
            return Ok(tx);
        }
        let opened = tokio::time::timeout(self.shared.connect_timeout, self.open()).await;
        let tx = opened.map_err(|_| {
            unavailable(format!(
                "cannot connect to {} within {:?}",
                self.shared.addr, self.shared.connect_timeout
            ))
        })??;
        *lock_slot(&self.shared.conn) = Some(tx.clone());
        Ok(tx)
    }

    fn current(&self) -> Option<mpsc::UnboundedSender<Out>> {
        let conn = lock_slot(&self.shared.conn);
        conn.as_ref().filter(|tx| !tx.is_closed()).cloned()
    }

    async fn open(&self) -> Result<mpsc::UnboundedSender<Out>, Error> {
        let addr = &self.shared.addr;
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| unavailable(format!("cannot connect to {addr}: {e}")))?;
        let _ = stream.set_nodelay(true);
        match &self.shared.tls {
            None => self.handshake(stream).await,
            Some((connector, name)) => {
                let stream = connector
                    .connect(name.clone(), stream)
                    .await
                    .map_err(|e| unavailable(format!("TLS handshake with {addr} failed: {e}")))?;
                self.handshake(stream).await
            }
        }
    }

    /// Says the magic (and hello), checks the answer, and starts the connection task.
    async fn handshake<S>(&self, mut stream: S) -> Result<mpsc::UnboundedSender<Out>, Error>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let addr = &self.shared.addr;
        let mut hello = wire::CLIENT_MAGIC.to_vec();
        if let Some(token) = &self.shared.token {
            let token = token.clone();
            wire::encode_request(&mut hello, 0, &Request::Hello(wire::Hello { token }));
        }
        let lost = |e: std::io::Error| unavailable(format!("connection to {addr} failed: {e}"));
        stream.write_all(&hello).await.map_err(lost)?;
        stream.flush().await.map_err(lost)?;
        let mut magic = [0u8; wire::SERVER_MAGIC.len()];
        stream.read_exact(&mut magic).await.map_err(lost)?;
        if magic != wire::SERVER_MAGIC {
            // An older server answered HTTP: it only speaks gRPC.
            self.shared.unsupported.store(true, Ordering::Relaxed);
            return Err(unavailable(format!("{addr} does not speak flw/1")));
        }
        let mut input = Vec::with_capacity(4096);
        if self.shared.token.is_some() {
            match read_response(&mut stream, &mut input).await.map_err(lost)? {
                (_, Response::Welcome) => {}
                (_, Response::Error(e)) => {
                    return Err(Error::new(
                        crate::server::kind_from_code(&e.code),
                        e.message,
                    ))
                }
                (_, other) => {
                    return Err(Error::new(
                        ErrorKind::Protocol,
                        format!("the server answered Hello with {other:?}"),
                    ))
                }
            }
        }
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(stream, rx, input));
        Ok(tx)
    }
}

/// A TLS connector trusting `ca_cert_pem` (PEM certificates), or the system's roots.
pub(crate) fn tls_connector(
    ca_cert_pem: Option<&[u8]>,
) -> Result<tokio_rustls::TlsConnector, Error> {
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::CertificateDer;
    use tokio_rustls::rustls::{crypto, ClientConfig, RootCertStore};

    let invalid = |m: String| Error::new(ErrorKind::InvalidArgument, m);
    let mut roots = RootCertStore::empty();
    match ca_cert_pem {
        Some(pem) => {
            for cert in CertificateDer::pem_slice_iter(pem) {
                let cert = cert.map_err(|e| invalid(format!("the CA certificate: {e}")))?;
                roots
                    .add(cert)
                    .map_err(|e| invalid(format!("the CA certificate: {e}")))?;
            }
            if roots.is_empty() {
                return Err(invalid(
                    "the CA certificate PEM holds no certificate".into(),
                ));
            }
        }
        // None found: every handshake fails as untrusted, like tonic's.
        None => {
            roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
        }
    }
    let config = ClientConfig::builder_with_provider(Arc::new(crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid(format!("TLS settings: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// The connection slot. Its critical sections only clone or replace a sender and
/// cannot panic, so a poisoned lock still holds a consistent value.
fn lock_slot(
    slot: &Mutex<Option<mpsc::UnboundedSender<Out>>>,
) -> std::sync::MutexGuard<'_, Option<mpsc::UnboundedSender<Out>>> {
    slot.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Reads one whole response frame during the handshake (bytes after it stay in
/// `input`).
async fn read_response<S: AsyncRead + Unpin>(
    stream: &mut S,
    input: &mut Vec<u8>,
) -> std::io::Result<(u64, Response)> {
    let invalid = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
    loop {
        if let Some(n) =
            wire::frame_len(input, wire::MAX_FRAME_BYTES).map_err(|e| invalid(e.message))?
        {
            let decoded = wire::decode_response(&input[..n]).map_err(|e| invalid(e.message));
            input.drain(..n);
            return decoded;
        }
        if stream.read_buf(input).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
}

/// The connection task: see the module docs.
async fn run<S>(stream: S, mut rx: mpsc::UnboundedReceiver<Out>, mut input: Vec<u8>)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut rd, mut wr) = tokio::io::split(stream);
    let mut calls = Calls::default();
    let mut out: Vec<u8> = Vec::with_capacity(4096);
    let mut sent = Instant::now();
    // Armed once and moved only when it fires: re-arming it for every write cost a
    // timer-wheel update per request.
    let ping = tokio::time::sleep(PING_INTERVAL);
    tokio::pin!(ping);
    let failure = loop {
        if !out.is_empty() {
            if let Err(e) = write(&mut wr, &out).await {
                break unavailable(format!("connection to the server lost: {e}"));
            }
            out.clear();
            sent = Instant::now();
        }
        if input.capacity() - input.len() < 1024 {
            input.reserve(4096);
        }
        tokio::select! {
            next = rx.recv() => {
                let Some(next) = next else { return };
                calls.queue(next, &mut out);
                while let Ok(next) = rx.try_recv() {
                    calls.queue(next, &mut out);
                }
            }
            read = rd.read_buf(&mut input) => {
                match read {
                    Ok(0) => break unavailable("the server closed the connection"),
                    Err(e) => break unavailable(format!("connection to the server lost: {e}")),
                    Ok(_) => {}
                }
                match calls.route(&mut input, &mut out) {
                    Ok(()) => {}
                    Err(e) => break e,
                }
            }
            () = &mut ping => {
                if sent.elapsed() >= PING_INTERVAL {
                    wire::encode_request(&mut out, 0, &Request::Ping);
                    sent = Instant::now();
                }
                ping.as_mut().reset(sent + PING_INTERVAL);
            }
        }
    };
    for (_, reply) in calls.pending.drain() {
        let _ = reply.send(Err(failure.clone()));
    }
}

/// Writes and flushes (a TLS stream holds what it encrypted until flushed).
async fn write<W: AsyncWrite + Unpin>(wr: &mut W, bytes: &[u8]) -> std::io::Result<()> {
    wr.write_all(bytes).await?;
    wr.flush().await
}

/// Ids of the releases the connection task sends itself: above every caller's id.
const OWN_IDS: u64 = 1 << 63;

/// The requests of one connection that await answers.
#[derive(Default)]
struct Calls {
    /// By id, the callers still waiting.
    pending: HashMap<u64, Reply>,
    /// Acquires whose callers gave up: their `cancelled` answer (or a grant that beat
    /// the cancel) is still to come.
    cancelled: std::collections::HashSet<u64>,
    /// The next id of a release of an unwanted grant.
    own_id: u64,
}

impl Calls {
    fn queue(&mut self, next: Out, out: &mut Vec<u8>) {
        match next {
            Out::Call { id, request, reply } => {
                wire::encode_request(out, id, &request);
                self.pending.insert(id, reply);
            }
            Out::Cancel(id) => {
                if self.pending.remove(&id).is_some() {
                    self.cancelled.insert(id);
                    wire::encode_request(out, id, &Request::Cancel);
                }
            }
        }
    }

    /// Hands the whole answers in `input` to their callers; gives back grants that
    /// arrive for cancelled acquires (queued in `out`). An answer to id 0 (pongs, and
    /// the server's framing errors) concerns the connection.
    fn route(&mut self, input: &mut Vec<u8>, out: &mut Vec<u8>) -> Result<(), Error> {
        let protocol = |m: String| Error::new(ErrorKind::Protocol, m);
        let mut used = 0;
        while let Some(n) = wire::frame_len(&input[used..], wire::MAX_FRAME_BYTES)
            .map_err(|e| protocol(format!("the server sent a bad frame: {e}")))?
        {
            let (id, response) = wire::decode_response(&input[used..used + n])
                .map_err(|e| protocol(format!("the server sent a bad frame: {e}")))?;
            used += n;
            match (id, response) {
                (0, Response::Pong) => {}
                (0, Response::Error(e)) => {
                    return Err(Error::new(
                        ErrorKind::Protocol,
                        format!("the server refused this connection: {}", e.message),
                    ))
                }
                (id, response) => {
                    if let Some(reply) = self.pending.remove(&id) {
                        let _ = reply.send(Ok(response));
                    } else if self.cancelled.remove(&id) {
                        if let Response::Grant(grant) = response {
                            // Granted before the cancel arrived: nobody wants it.
                            let release = Request::Release(fencelock_proto::ReleaseRequest {
                                name: grant.name,
                                owner_token: grant.owner_token,
                            });
                            wire::encode_request(out, OWN_IDS | self.own_id, &release);
                            self.own_id = self.own_id.wrapping_add(1) % OWN_IDS;
                        }
                    }
                }
            }
        }
        input.drain(..used);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(id: u64, response: &Response) -> Vec<u8> {
        let mut input = Vec::new();
        wire::encode_response(&mut input, id, response);
        input
    }

    fn grant(name: &str) -> Response {
        Response::Grant(fencelock_proto::Grant {
            name: name.into(),
            fence: 7,
            owner_token: "t".into(),
            ttl_ms: 1000,
            session: None,
        })
    }

    #[test]
    fn a_grant_for_a_cancelled_acquire_is_released_and_answers_reach_their_callers() {
        let mut calls = Calls::default();
        let mut out = Vec::new();
        let (reply, mut answered) = oneshot::channel();
        calls.queue(
            Out::Call {
                id: 1,
                request: Request::Ping,
                reply,
            },
            &mut out,
        );
        let (reply, _dropped) = oneshot::channel();
        calls.queue(
            Out::Call {
                id: 2,
                request: Request::Ping,
                reply,
            },
            &mut out,
        );
        calls.queue(Out::Cancel(2), &mut out);
        // Cancel of something already answered (or never sent) sends nothing.
        calls.queue(Out::Cancel(9), &mut out);
        let mut frames = Vec::new();
        let mut rest = &out[..];
        while let Some(n) = wire::frame_len(rest, wire::MAX_FRAME_BYTES).unwrap() {
            frames.push(wire::decode_request(&rest[..n]).unwrap());
            rest = &rest[n..];
        }
        assert_eq!(
            frames,
            [(1, Request::Ping), (2, Request::Ping), (2, Request::Cancel)]
        );

        // The grant beat the cancel: it is released; then `cancelled` arrives and is
        // dropped; the other caller gets its answer.
        let mut input = answer(2, &grant("a"));
        input.extend(answer(
            2,
            &Response::Error(wire::WireError {
                code: "cancelled".into(),
                message: String::new(),
            }),
        ));
        input.extend(answer(1, &Response::Pong));
        let mut out = Vec::new();
        calls.route(&mut input, &mut out).unwrap();
        assert!(input.is_empty(), "every whole frame is used");
        let n = wire::frame_len(&out, wire::MAX_FRAME_BYTES)
            .unwrap()
            .unwrap();
        assert_eq!(n, out.len(), "one frame: the release");
        let (id, release) = wire::decode_request(&out).unwrap();
        assert!(id >= OWN_IDS);
        assert_eq!(
            release,
            Request::Release(fencelock_proto::ReleaseRequest {
                name: "a".into(),
                owner_token: "t".into(),
            })
        );
        assert_eq!(answered.try_recv().unwrap().unwrap(), Response::Pong);
        assert!(calls.cancelled.is_empty() && calls.pending.is_empty());

        // A cancelled acquire answered only `cancelled` sends nothing back.
        let (reply, _dropped) = oneshot::channel();
        calls.queue(
            Out::Call {
                id: 3,
                request: Request::Ping,
                reply,
            },
            &mut Vec::new(),
        );
        calls.queue(Out::Cancel(3), &mut Vec::new());
        let mut input = answer(
            3,
            &Response::Error(wire::WireError {
                code: "cancelled".into(),
                message: String::new(),
            }),
        );
        let mut out = Vec::new();
        calls.route(&mut input, &mut out).unwrap();
        assert!(out.is_empty() && calls.cancelled.is_empty());
    }

    #[test]
    fn a_partial_frame_waits_and_a_bad_one_ends_the_connection() {
        let mut calls = Calls::default();
        let whole = answer(1, &Response::Pong);
        let mut input = whole[..5].to_vec();
        calls.route(&mut input, &mut Vec::new()).unwrap();
        assert_eq!(input.len(), 5, "kept until the rest arrives");
        let mut input = vec![0xff, 0xff, 0xff, 0xff, 0];
        let err = calls.route(&mut input, &mut Vec::new()).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Protocol);
    }
}
