//! The client side of the wire protocol `flw/1` ([`fencelock_proto::wire`]): one
//! multiplexed TCP connection per [`crate::FencelockBackend`] (shared by its clones) for
//! `Acquire`, `Renew` and `Release`.
//!
//! A caller registers its request and encodes it into the connection's output
//! buffer; on plain TCP it then writes that buffer to the socket itself (a
//! non-blocking write, under the connection's lock, so frames never interleave),
//! saving a hop to another task per request. Whatever the socket does not take at
//! once, and everything on TLS, the connection task writes. That task reads the
//! socket and routes answers to their callers by id, pings when nothing was sent
//! for a [`PING_INTERVAL`] (the server closes silent connections), and when the
//! connection breaks fails every request in flight as [`ErrorKind::Unavailable`].
//! The next request opens a new connection. A caller that stops waiting for an
//! acquire (dropped, or timed out) sends `Cancel`, so the server takes it out of the
//! queue; a grant that was already on its way is released by the connection task.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencelock_proto::wire::{self, Request, Response, Sink};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::{oneshot, Notify};
use tokio_rustls::rustls::pki_types::ServerName;

use crate::{Error, ErrorKind};

/// How long the connection may stay silent before the client pings. The task checks
/// once per interval whether anything was sent since its last check, so the longest
/// silence is two intervals, well inside the server's 60 s idle limit.
pub(crate) const PING_INTERVAL: Duration = Duration::from_secs(20);

type Reply = oneshot::Sender<Result<Response, Error>>;

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
    conn: Mutex<Option<Link>>,
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

fn unavailable(message: impl Into<String>) -> Error {
    Error::new(ErrorKind::Unavailable, message)
}

/// One open connection, shared by its callers and its task.
struct Conn {
    state: Mutex<ConnState>,
    /// Wakes the task: output it must write, or the client went away.
    wake: Notify,
}

/// What callers and the connection task share, under the connection's lock.
#[derive(Default)]
struct ConnState {
    calls: Calls,
    /// Encoded requests not yet written, in order.
    out: Vec<u8>,
    /// The task is writing output it took from `out`: nobody else may write until it
    /// is done, or frames would interleave.
    task_writing: bool,
    /// Something was sent since the task's last ping check.
    sent: bool,
    /// Set once the connection broke (every later request fails with it), or the
    /// client that opened it went away.
    failed: Option<Error>,
    /// On plain TCP, the socket's write side, which callers write to directly;
    /// dropped when the connection fails, so the socket closes with the task.
    direct: Option<Arc<OwnedWriteHalf>>,
}

impl Conn {
    /// The state. Its critical sections never panic between changes, so a poisoned
    /// lock still holds a consistent value.
    fn lock(&self) -> std::sync::MutexGuard<'_, ConnState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn usable(&self) -> bool {
        self.lock().failed.is_none()
    }

    /// Registers `request` under `id` and sends it.
    fn send(&self, id: u64, request: &Request, reply: Reply) -> Result<(), Error> {
        let mut state = self.lock();
        if let Some(e) = &state.failed {
            return Err(e.clone());
        }
        let ConnState { calls, out, .. } = &mut *state;
        calls.call(id, request, reply, out);
        self.push(&mut state);
        Ok(())
    }

    /// The caller of `id` gave up: if it is still unanswered, tell the server.
    fn cancel(&self, id: u64) {
        let mut state = self.lock();
        if state.failed.is_some() {
            return;
        }
        let ConnState { calls, out, .. } = &mut *state;
        if calls.cancel(id, out) {
            self.push(&mut state);
        }
    }

    /// Gets `out` onto the socket: directly if the socket is plain TCP, takes it all
    /// now and the task is not writing; otherwise by waking the task.
    fn push(&self, state: &mut ConnState) {
        if state.task_writing || state.out.is_empty() {
            return; // the task takes `out` up when its write completes
        }
        if let Some(socket) = &state.direct {
            match socket.try_write(&state.out) {
                Ok(n) if n == state.out.len() => {
                    state.out.clear();
                    state.sent = true;
                    return;
                }
                Ok(n) => {
                    state.out.drain(..n);
                    state.sent = true;
                }
                // Full, or broken: the task waits for room, or finds the error.
                Err(_) => {}
            }
        }
        self.wake.notify_one();
    }

    /// Ends the connection: every request in flight fails with `error`.
    fn fail(&self, error: Error) {
        let mut state = self.lock();
        if state.failed.is_none() {
            state.failed = Some(error.clone());
        }
        state.direct = None;
        for (_, reply) in state.calls.pending.drain() {
            let _ = reply.send(Err(error.clone()));
        }
    }
}

/// The client's hold on its current connection: dropping it (the client went away,
/// or reconnected) stops the connection task.
struct Link(Arc<Conn>);

impl Drop for Link {
    fn drop(&mut self) {
        self.0.fail(unavailable("the client closed the connection"));
        self.0.wake.notify_one();
    }
}

/// Sends `Cancel` for a waiting acquire unless disarmed (the answer arrived).
struct CancelOnDrop {
    conn: Option<Arc<Conn>>,
    id: u64,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            conn.cancel(self.id);
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
        let conn = self.connection().await?;
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (reply, answer) = oneshot::channel();
        conn.send(id, &request, reply)?;
        let mut cancel = CancelOnDrop {
            conn: cancellable.then_some(conn),
            id,
        };
        let within = self.shared.request_timeout.saturating_add(extra_time);
        let answer = match tokio::time::timeout(within, answer).await {
            Ok(answer) => {
                cancel.conn = None;
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
            Response::Error(e) => Err(crate::codes::error_from_wire(e)),
            other => Ok(other),
        }
    }

    /// Opens the connection now (for an eager connect).
    pub(crate) async fn connect(&self) -> Result<(), Error> {
        self.connection().await.map(drop)
    }

    async fn connection(&self) -> Result<Arc<Conn>, Error> {
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        let _one = self.shared.connecting.lock().await;
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        let opened = tokio::time::timeout(self.shared.connect_timeout, self.open()).await;
        let conn = opened.map_err(|_| {
            unavailable(format!(
                "cannot connect to {} within {:?}",
                self.shared.addr, self.shared.connect_timeout
            ))
        })??;
        *lock_slot(&self.shared.conn) = Some(Link(conn.clone()));
        Ok(conn)
    }

    fn current(&self) -> Option<Arc<Conn>> {
        let slot = lock_slot(&self.shared.conn);
        slot.as_ref()
            .map(|link| link.0.clone())
            .filter(|conn| conn.usable())
    }

    async fn open(&self) -> Result<Arc<Conn>, Error> {
        let addr = &self.shared.addr;
        let mut stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| unavailable(format!("cannot connect to {addr}: {e}")))?;
        let _ = stream.set_nodelay(true);
        match &self.shared.tls {
            None => {
                let input = self.handshake(&mut stream).await?;
                let (rd, wr) = stream.into_split();
                let wr = Arc::new(wr);
                let conn = Conn::new(Some(wr.clone()));
                tokio::spawn(run(rd, Sink::Direct(wr), conn.clone(), input));
                Ok(conn)
            }
            Some((connector, name)) => {
                let mut stream = connector
                    .connect(name.clone(), stream)
                    .await
                    .map_err(|e| unavailable(format!("TLS handshake with {addr} failed: {e}")))?;
                let input = self.handshake(&mut stream).await?;
                let (rd, wr) = tokio::io::split(stream);
                let conn = Conn::new(None);
                tokio::spawn(run(rd, Sink::Stream(Box::new(wr)), conn.clone(), input));
                Ok(conn)
            }
        }
    }

    /// Says the magic (and hello) and checks the answer. Returns the bytes read past
    /// the answer.
    async fn handshake<S>(&self, stream: &mut S) -> Result<Vec<u8>, Error>
    where
        S: AsyncRead + AsyncWrite + Unpin,
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
            match read_response(stream, &mut input).await.map_err(lost)? {
                (_, Response::Welcome) => {}
                (_, Response::Error(e)) => return Err(crate::codes::error_from_wire(e)),
                (_, other) => {
                    return Err(Error::new(
                        ErrorKind::Protocol,
                        format!("the server answered Hello with {other:?}"),
                    ))
                }
            }
        }
        Ok(input)
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

/// The connection slot. Its critical sections only clone or replace a link and
/// cannot panic, so a poisoned lock still holds a consistent value.
fn lock_slot(slot: &Mutex<Option<Link>>) -> std::sync::MutexGuard<'_, Option<Link>> {
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

impl Conn {
    fn new(direct: Option<Arc<OwnedWriteHalf>>) -> Arc<Conn> {
        Arc::new(Conn {
            state: Mutex::new(ConnState {
                direct,
                ..ConnState::default()
            }),
            wake: Notify::new(),
        })
    }
}

/// The connection task: see the module docs.
async fn run<R>(mut rd: R, mut sink: Sink, conn: Arc<Conn>, mut input: Vec<u8>)
where
    R: AsyncRead + Unpin,
{
    let mut writing = Vec::with_capacity(4096);
    // Armed once and moved only when it fires: re-arming it for every write cost a
    // timer-wheel update per request.
    let ping = tokio::time::sleep(PING_INTERVAL);
    tokio::pin!(ping);
    let failure = loop {
        if let Err(e) = flush(&conn, &mut sink, &mut writing).await {
            break unavailable(format!("connection to the server lost: {e}"));
        }
        if conn.lock().failed.is_some() {
            return; // the client went away
        }
        if input.capacity() - input.len() < 1024 {
            input.reserve(4096);
        }
        tokio::select! {
            () = conn.wake.notified() => {}
            read = rd.read_buf(&mut input) => {
                match read {
                    Ok(0) => break unavailable("the server closed the connection"),
                    Err(e) => break unavailable(format!("connection to the server lost: {e}")),
                    Ok(_) => {}
                }
                let mut state = conn.lock();
                let ConnState { calls, out, .. } = &mut *state;
                if let Err(e) = calls.route(&mut input, out) {
                    break e;
                }
            }
            () = &mut ping => {
                let mut state = conn.lock();
                if !std::mem::take(&mut state.sent) {
                    wire::encode_request(&mut state.out, 0, &Request::Ping);
                }
                ping.as_mut().reset(tokio::time::Instant::now() + PING_INTERVAL);
            }
        }
    };
    conn.fail(failure);
}

/// Writes what callers left in `out` (and what is added meanwhile) until it is empty,
/// keeping callers from writing until then. `writing` is a spare buffer.
async fn flush(conn: &Conn, sink: &mut Sink, writing: &mut Vec<u8>) -> std::io::Result<()> {
    loop {
        {
            let mut state = conn.lock();
            if state.out.is_empty() {
                state.task_writing = false;
                return Ok(());
            }
            state.task_writing = true;
            state.sent = true;
            std::mem::swap(&mut state.out, writing);
        }
        let written = sink.write_all(writing).await;
        writing.clear();
        written?;
    }
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
    /// Encodes a request and awaits its answer.
    fn call(&mut self, id: u64, request: &Request, reply: Reply, out: &mut Vec<u8>) {
        wire::encode_request(out, id, request);
        self.pending.insert(id, reply);
    }

    /// Moves an unanswered call to the cancelled ones and encodes its `Cancel`; false
    /// if it was answered already (or never sent).
    fn cancel(&mut self, id: u64, out: &mut Vec<u8>) -> bool {
        if self.pending.remove(&id).is_none() {
            return false;
        }
        self.cancelled.insert(id);
        wire::encode_request(out, id, &Request::Cancel);
        true
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
            mode: "exclusive".into(),
        })
    }

    #[test]
    fn a_grant_for_a_cancelled_acquire_is_released_and_answers_reach_their_callers() {
        let mut calls = Calls::default();
        let mut out = Vec::new();
        let (reply, mut answered) = oneshot::channel();
        calls.call(1, &Request::Ping, reply, &mut out);
        let (reply, _dropped) = oneshot::channel();
        calls.call(2, &Request::Ping, reply, &mut out);
        calls.cancel(2, &mut out);
        // Cancel of something already answered (or never sent) sends nothing.
        calls.cancel(9, &mut out);
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
                leader: String::new(),
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
        calls.call(3, &Request::Ping, reply, &mut Vec::new());
        calls.cancel(3, &mut Vec::new());
        let mut input = answer(
            3,
            &Response::Error(wire::WireError {
                code: "cancelled".into(),
                message: String::new(),
                leader: String::new(),
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

#[cfg(test)]
mod socket_tests {
    use super::*;

    /// While the task writes output it took, a caller's request waits in `out` behind
    /// it (written directly, it would land inside the task's frames); once the task
    /// is done, a caller writes everything queued, in order.
    #[tokio::test]
    async fn a_caller_leaves_its_request_to_the_task_while_the_task_writes() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (mut peer, _) = listener.accept().await.unwrap();
        let (_rd, wr) = client.into_split();
        let conn = Conn::new(Some(Arc::new(wr)));
        conn.lock().task_writing = true;
        let (reply, _answer) = oneshot::channel();
        conn.send(1, &Request::Ping, reply).unwrap();
        assert!(!conn.lock().out.is_empty(), "left in `out` for the task");
        let mut input = vec![0u8; 256];
        assert!(
            tokio::time::timeout(Duration::from_millis(100), peer.read(&mut input))
                .await
                .is_err(),
            "nothing may reach the socket while the task writes"
        );

        conn.lock().task_writing = false;
        let (reply, _answer) = oneshot::channel();
        conn.send(2, &Request::Ping, reply).unwrap();
        assert!(conn.lock().out.is_empty(), "written directly");
        let mut input = Vec::new();
        let mut frames = Vec::new();
        while frames.len() < 2 {
            assert!(peer.read_buf(&mut input).await.unwrap() > 0);
            while let Some(n) = wire::frame_len(&input, wire::MAX_FRAME_BYTES).unwrap() {
                frames.push(wire::decode_request(&input[..n]).unwrap());
                input.drain(..n);
            }
        }
        assert_eq!(frames, [(1, Request::Ping), (2, Request::Ping)]);
    }

    /// When the server ends the connection, requests in flight fail, later ones fail
    /// at once (the next call reconnects), and the socket is closed though callers
    /// still hold the connection.
    #[tokio::test]
    async fn a_connection_the_server_ended_fails_its_calls_and_closes_its_socket() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (mut peer, _) = listener.accept().await.unwrap();
        let (rd, wr) = client.into_split();
        let wr = Arc::new(wr);
        let conn = Conn::new(Some(wr.clone()));
        tokio::spawn(run(rd, Sink::Direct(wr), conn.clone(), Vec::new()));
        let (reply, answer) = oneshot::channel();
        conn.send(1, &Request::Ping, reply).unwrap();

        peer.shutdown().await.unwrap();
        let failed = answer.await.unwrap().unwrap_err();
        assert_eq!(failed.kind(), ErrorKind::Unavailable);
        let (reply, _answer) = oneshot::channel();
        let refused = conn.send(2, &Request::Ping, reply).unwrap_err();
        assert_eq!(refused.kind(), ErrorKind::Unavailable);
        let mut rest = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), peer.read_to_end(&mut rest))
            .await
            .expect("the client closed its socket")
            .unwrap();
        assert!(!conn.usable());
    }

    /// Callers on several threads write straight to the socket while the peer reads
    /// slowly, so the socket fills and empties and the task writes what it did not
    /// take: the peer still gets every frame whole, each once, and each caller's in
    /// the order it sent them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn direct_writes_and_the_task_s_writes_never_interleave_frames() {
        const CALLERS: u64 = 4;
        const EACH: u64 = 4_000;
        // Small socket buffers on both sides, so the socket fills however fast this
        // machine drains loopback (autotuned buffers can hold every frame sent here).
        let server = tokio::net::TcpSocket::new_v4().unwrap();
        server.set_recv_buffer_size(16 * 1024).unwrap();
        server.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = server.listen(1).unwrap();
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_send_buffer_size(16 * 1024).unwrap();
        let client = socket
            .connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (mut peer, _) = listener.accept().await.unwrap();
        let (rd, wr) = client.into_split();
        let wr = Arc::new(wr);
        let conn = Conn::new(Some(wr.clone()));
        tokio::spawn(run(rd, Sink::Direct(wr), conn.clone(), Vec::new()));

        let reader = tokio::spawn(async move {
            let mut input = Vec::new();
            let mut next = vec![0u64; CALLERS as usize];
            let mut seen = 0;
            while seen < CALLERS * EACH {
                // A slow reader: the client's socket keeps filling.
                tokio::time::sleep(Duration::from_millis(1)).await;
                let mut chunk = [0u8; 8 * 1024];
                let n = peer.read(&mut chunk).await.unwrap();
                assert!(n > 0, "the client closed");
                input.extend_from_slice(&chunk[..n]);
                let mut used = 0;
                while let Some(n) = wire::frame_len(&input[used..], wire::MAX_FRAME_BYTES).unwrap()
                {
                    let (id, request) = wire::decode_request(&input[used..used + n])
                        .expect("a whole frame, not two interleaved");
                    used += n;
                    let (caller, n) = ((id - 1) / EACH, (id - 1) % EACH);
                    assert_eq!(
                        n, next[caller as usize],
                        "caller {caller}'s frames in order"
                    );
                    next[caller as usize] += 1;
                    let Request::Release(release) = request else {
                        panic!("sent releases only")
                    };
                    assert!(release.name.starts_with(&format!("{caller}-{n}-")));
                    seen += 1;
                }
                input.drain(..used);
            }
            peer
        });

        let mut callers = Vec::new();
        for caller in 0..CALLERS {
            let conn = conn.clone();
            callers.push(tokio::spawn(async move {
                let mut answers = Vec::new();
                let mut left_to_the_task = false;
                for n in 0..EACH {
                    let (reply, answer) = oneshot::channel();
                    let request = Request::Release(fencelock_proto::ReleaseRequest {
                        // Large enough that the socket's buffers fill.
                        name: format!("{caller}-{n}-{}", "x".repeat(300)),
                        owner_token: "t".into(),
                    });
                    conn.send(caller * EACH + n + 1, &request, reply).unwrap();
                    answers.push(answer);
                    left_to_the_task |= {
                        let state = conn.lock();
                        state.task_writing || !state.out.is_empty()
                    };
                    if n % 16 == 0 {
                        tokio::time::sleep(Duration::from_micros(50)).await;
                    }
                }
                (answers, left_to_the_task)
            }));
        }
        let mut answers = Vec::new();
        let mut left_to_the_task = false;
        for caller in callers {
            let (a, left) = caller.await.unwrap();
            answers.extend(a);
            left_to_the_task |= left;
        }
        assert!(
            left_to_the_task,
            "the socket took everything: the task's path was not exercised"
        );
        let mut peer = tokio::time::timeout(Duration::from_secs(60), reader)
            .await
            .expect("the peer got every frame")
            .unwrap();
        // Answers reach their callers.
        let mut out = Vec::new();
        wire::encode_response(&mut out, 1, &Response::Pong);
        peer.write_all(&out).await.unwrap();
        let first = answers.swap_remove(0);
        assert_eq!(first.await.unwrap().unwrap(), Response::Pong);
    }
}
