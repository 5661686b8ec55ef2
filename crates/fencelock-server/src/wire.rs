//! The wire protocol `flw/1` ([`fencelock_proto::wire`]) on one connection: the client
//! library's fast path for `Acquire`, `Renew` and `Release`, on the same port as HTTP
//! and gRPC (the accept loop tells it apart by its first byte).
//!
//! One task per connection reads frames and hands each request to the engine with a
//! *sink* for its answer (`GrantSink`, `ReplySink` in [`crate::engine`]):
//! the engine calls it on the thread that delivers the answer — the writer thread,
//! once the change is durable — and the sink encodes the answer into the
//! connection's output and, on plain TCP, writes it to the socket right there (a
//! non-blocking write under the connection's lock, so frames never interleave).
//! Neither the connection task nor the runtime worker it runs on is woken to send an
//! answer: on this 2-core VM each such wake of an idle worker cost tens of
//! microseconds per request. Whatever the socket does not take at once, and
//! everything on TLS (or any other stream), the connection task writes. The requests
//! go through the same validation as gRPC ([`crate::grpc`]), so authorization, rate
//! limits and error codes are the same.
//!
//! Bounds: a frame is at most `max_body_bytes`; at most `max_streams_per_connection`
//! acquires are in flight per connection (one more is refused at once with
//! `resource_exhausted`, so that renewals behind it are never held up by waits), and
//! as many again of everything else (beyond that the connection is not read until
//! something is answered); a connection that sends nothing for [`IDLE_TIMEOUT`] is
//! closed (the client pings while idle), and so is one with no request in flight
//! for `Limits::idle_timeout` (pings do not count; see `IdleCheck` in `lib.rs`). A
//! waiting acquire, multi-lock or campaign leaves the queue on [`Op::Cancel`], or
//! when the connection ends.
//! Every request gets exactly one answer; a cancelled one gets `cancelled` (after its
//! real answer, if that was sent first — the client then gives back a grant it no
//! longer wants), and a grant that finds its request cancelled or its connection
//! gone is released by the engine.
//!
//! Admission (see `admission.rs`): a connection is admitted by a Hello that
//! succeeds (with authentication off: by its first Hello or request; pings admit
//! nothing). A Hello that fails on a connection that had a principal drops it and
//! closes the connection once what is in flight is answered: the client presented
//! a token the server does not know, and nothing it sends after that may run as the
//! earlier principal (issue 19, item 8). A failed first Hello leaves the connection
//! unauthenticated, to try again until its auth deadline.
//!
//! [`Op::Cancel`]: fencelock_proto::wire::Op::Cancel

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencelock_core::Command;
use fencelock_proto::wire::{self, Request, Response, Sink, WireError};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::TcpStream;
use tokio::sync::{oneshot, watch, Notify};
use tokio::time::Instant;

use crate::admission::{Admission, Ticket};
use crate::auth::{Authenticator, Principal};
use crate::engine::{typed, GrantSink, Handle, ReplySink, Requester};
use crate::error::{ApiError, ApiErrorKind};
use crate::grpc;
use crate::limits::Limits;
use crate::preface::Prefixed;

/// A connection that sends nothing (not even a ping) for this long is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// What every wire connection shares.
pub(crate) struct WireOptions {
    pub(crate) handle: Handle,
    pub(crate) auth: Authenticator,
    /// Largest frame accepted.
    pub(crate) max_frame: usize,
    /// Most requests in flight on one connection.
    pub(crate) max_in_flight: usize,
    /// Time to send the magic bytes.
    pub(crate) header_read_timeout: Duration,
    /// A connection with no request in flight this long is closed.
    pub(crate) idle_timeout: Duration,
}

fn error_response(error: &ApiError) -> Response {
    Response::Error(WireError {
        code: error.kind().code().to_owned(),
        message: error.message().to_owned(),
        // Empty when unknown: older clients skip field 3 either way.
        leader: error.leader().unwrap_or_default().to_owned(),
    })
}

/// Counts a refusal at the edge (401, 403, 429) in the metrics, as the HTTP layer does.
fn count_refusal(handle: &Handle, error: &ApiError) {
    if matches!(
        error.kind(),
        ApiErrorKind::Unauthenticated | ApiErrorKind::PermissionDenied | ApiErrorKind::RateLimited
    ) {
        handle.metrics().count_refusal(error.kind());
    }
}

/// Serves `flw/1` on `io` — a stream whose first bytes are the client's magic — for
/// `handle`, as the accept loop serves a connection it told apart: tokens checked by
/// `auth`, frames and requests in flight bounded by `limits`. Ends when the client
/// leaves or breaks the protocol. For tests and fuzzing over in-memory streams: the
/// connection is alone in its pools, and its auth deadline is not enforced (the
/// accept loop does that).
pub async fn serve_stream<I>(io: I, handle: Handle, auth: Authenticator, limits: &Limits)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    // Pools of its own, counted apart: not the server's gauge of unauthenticated
    // connections.
    let admission = Admission::new(limits, Arc::default());
    let Ok(ticket) = admission.enter(std::net::Ipv4Addr::LOCALHOST.into()) else {
        unreachable!("the first connection of fresh pools is always taken")
    };
    let options = Arc::new(WireOptions {
        handle,
        auth,
        max_frame: limits.max_body_bytes,
        max_in_flight: limits.max_streams_per_connection as usize,
        header_read_timeout: crate::DEFAULT_HEADER_READ_TIMEOUT,
        idle_timeout: limits.idle_timeout,
    });
    // Never stopping: the sender lives as long as the connection.
    let (_never, stopping) = watch::channel(());
    serve_connection(io, options, Arc::new(ticket), stopping).await;
}

/// Serves `flw/1` on a plain TCP connection whose first bytes (the client's magic)
/// are in `stream`'s prefix: answers are written to the socket by whichever thread
/// delivers them (see the module docs).
pub(crate) async fn serve_tcp(
    stream: Prefixed<TcpStream>,
    options: Arc<WireOptions>,
    ticket: Arc<Ticket>,
    stopping: watch::Receiver<()>,
) {
    let (prefix, tcp) = stream.into_parts();
    let (rd, wr) = tcp.into_split();
    let wr = Arc::new(wr);
    serve(
        Prefixed::new(prefix, rd),
        Sink::Direct(wr.clone()),
        Some(wr),
        options,
        ticket,
        stopping,
    )
    .await;
}

/// Serves `flw/1` on `io` (TLS, or any other stream), whose first bytes are the
/// client's magic, until the client leaves, breaks the protocol, idles out, or the
/// server stops (`stopping` changes: then the requests in flight are answered first).
/// Only the connection task writes to `io`.
pub(crate) async fn serve_connection<I>(
    io: I,
    options: Arc<WireOptions>,
    ticket: Arc<Ticket>,
    stopping: watch::Receiver<()>,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (rd, wr) = tokio::io::split(io);
    serve(
        rd,
        Sink::Stream(Box::new(wr)),
        None,
        options,
        ticket,
        stopping,
    )
    .await;
}

async fn serve<R>(
    mut rd: R,
    mut sink: Sink,
    direct: Option<Arc<OwnedWriteHalf>>,
    options: Arc<WireOptions>,
    ticket: Arc<Ticket>,
    mut stopping: watch::Receiver<()>,
) where
    R: AsyncRead + Unpin,
{
    let mut magic = [0u8; wire::CLIENT_MAGIC.len()];
    let greeted = tokio::time::timeout(options.header_read_timeout, rd.read_exact(&mut magic));
    if !matches!(greeted.await, Ok(Ok(_))) || magic != wire::CLIENT_MAGIC {
        return;
    }
    if sink.write_all(&wire::SERVER_MAGIC).await.is_err() {
        return;
    }
    options
        .handle
        .metrics()
        .wire_connections
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let outbox = Arc::new(Outbox {
        state: Mutex::new(OutState {
            direct,
            ..OutState::default()
        }),
        wake: Notify::new(),
        handle: options.handle.clone(),
    });
    let mut conn = Connection {
        options: options.clone(),
        principal: (!options.auth.enabled()).then(Principal::anonymous),
        outbox: outbox.clone(),
        reading: true,
        ticket,
        requests: 0,
    };
    serve_requests(&mut conn, &mut rd, &mut sink, &mut stopping).await;
    // Answers still to come are refused (a grant is then released), waits leave their
    // queues, and the socket closes with the last handle on its write side.
    for listener in outbox.close() {
        options.handle.cancel_listener(listener);
    }
    if conn.reading {
        return;
    }
    let _ = sink.shutdown().await;
}

/// The connection task's loop: reads and handles requests, writes what the sinks
/// could not, until the client leaves (or breaks the connection), or — once no
/// longer reading (stopping, or a framing error) — every request is answered.
async fn serve_requests<R: AsyncRead + Unpin>(
    conn: &mut Connection,
    rd: &mut R,
    sink: &mut Sink,
    stopping: &mut watch::Receiver<()>,
) {
    let max_in_flight = conn.options.max_in_flight;
    let mut input: Vec<u8> = Vec::with_capacity(4096);
    let mut writing: Vec<u8> = Vec::with_capacity(4096);
    let mut heard = Instant::now();
    // Armed once and moved only when it fires: re-arming it for every read cost a
    // timer-wheel update per request.
    let idle = tokio::time::sleep(IDLE_TIMEOUT);
    tokio::pin!(idle);
    let idle_timeout = conn.options.idle_timeout;
    let mut checks = tokio::time::interval_at(Instant::now() + idle_timeout, idle_timeout);
    let mut no_requests = crate::IdleCheck::default();
    loop {
        if flush(&conn.outbox, sink, &mut writing).await.is_err() {
            return;
        }
        let room = {
            let mut state = conn.outbox.lock();
            if !conn.reading && state.in_flight.is_empty() && state.out.is_empty() {
                return;
            }
            // Beyond the acquires' own bound, renewals and releases may add as many
            // again; past that the connection is not read until something is answered.
            let room = state.in_flight.len() < 2 * max_in_flight;
            // Waiting for answers (for room, or to finish): the sinks wake the task.
            state.task_waits = !room || !conn.reading;
            room
        };
        if input.capacity() - input.len() < 1024 {
            input.reserve(4096);
        }
        tokio::select! {
            () = conn.outbox.wake.notified() => {}
            read = rd.read_buf(&mut input), if conn.reading && room => {
                match read {
                    // The client left (or broke the connection).
                    Ok(0) | Err(_) => return,
                    Ok(_) => heard = Instant::now(),
                }
                let used = conn.frames(&input);
                input.drain(..used);
            }
            () = &mut idle, if conn.reading => {
                if heard.elapsed() >= IDLE_TIMEOUT {
                    tracing::debug!("closed a wire connection idle for {IDLE_TIMEOUT:?}");
                    return;
                }
                idle.as_mut().reset(heard + IDLE_TIMEOUT);
            }
            _ = checks.tick(), if conn.reading => {
                let in_flight = !conn.outbox.lock().in_flight.is_empty();
                if no_requests.idle(conn.requests, in_flight) {
                    tracing::debug!(?idle_timeout, "closing a wire connection with no requests");
                    conn.options
                        .handle
                        .metrics()
                        .connections
                        .closed_idle
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    return;
                }
            }
            _ = stopping.changed(), if conn.reading => conn.reading = false,
        }
    }
}

/// Writes what the sinks and the task left in `out` (and what is added meanwhile)
/// until it is empty, keeping the sinks from writing until then. `writing` is a
/// spare buffer.
async fn flush(outbox: &Outbox, sink: &mut Sink, writing: &mut Vec<u8>) -> std::io::Result<()> {
    loop {
        {
            let mut state = outbox.lock();
            if state.out.is_empty() {
                state.task_writing = false;
                return Ok(());
            }
            state.task_writing = true;
            std::mem::swap(&mut state.out, writing);
        }
        let written = sink.write_all(writing).await;
        writing.clear();
        if written.is_err() {
            outbox.lock().task_writing = false;
        }
        written?;
    }
}

/// What the connection task and the threads that answer its requests share.
struct Outbox {
    state: Mutex<OutState>,
    /// Wakes the task: output it must write (the socket did not take it, or only the
    /// task writes), or an answer it waits for ([`OutState::task_waits`]).
    wake: Notify,
    handle: Handle,
}

/// The connection's output and its requests in flight, under the connection's lock.
#[derive(Default)]
struct OutState {
    /// Encoded answers not yet written, in order.
    out: Vec<u8>,
    /// The task is writing output it took from `out`: nobody else may write until it
    /// is done, or frames would interleave.
    task_writing: bool,
    /// On plain TCP, the socket's write side, which sinks write to directly; dropped
    /// when the connection ends, so that the socket closes with the task.
    direct: Option<Arc<OwnedWriteHalf>>,
    /// Requests not yet answered, by id: an acquire with its engine listener, `None`
    /// for a renewal or release.
    in_flight: HashMap<u64, Option<u128>>,
    /// How many of them are acquires.
    acquires: usize,
    /// The requests run on their own task (see `spawn_kind_call`), by id: sending
    /// (or dropping) stops the task's call, which leaves any queue it waits in.
    stops: HashMap<u64, oneshot::Sender<()>>,
    /// The connection ended: answers still to come are refused.
    closed: bool,
    /// The task waits for an answer (room to read, or the last one before it ends).
    task_waits: bool,
}

impl Outbox {
    /// The state. Its critical sections never panic between changes, so a poisoned
    /// lock still holds a consistent value.
    fn lock(&self) -> std::sync::MutexGuard<'_, OutState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sends `response`, which needs no request in flight (a ping's, a refusal's).
    fn reply(&self, id: u64, response: &Response) {
        let mut state = self.lock();
        wire::encode_response(&mut state.out, id, response);
        self.push(&mut state);
    }

    /// Sends the answer to request `id`, unless the request was cancelled or the
    /// connection has ended: false then (nobody took it).
    fn answer(&self, id: u64, response: &Response) -> bool {
        let mut state = self.lock();
        if state.closed {
            return false;
        }
        match state.in_flight.remove(&id) {
            None => return false, // a cancelled acquire
            Some(Some(_)) => state.acquires -= 1,
            Some(None) => {}
        }
        state.stops.remove(&id);
        wire::encode_response(&mut state.out, id, response);
        self.push(&mut state);
        if state.task_waits {
            state.task_waits = false;
            self.wake.notify_one();
        }
        true
    }

    /// Gets `out` onto the socket: directly if the socket is plain TCP, takes it all
    /// now and the task is not writing; otherwise by waking the task.
    fn push(&self, state: &mut OutState) {
        if state.task_writing || state.out.is_empty() {
            return; // the task takes `out` up when its write completes
        }
        if let Some(socket) = &state.direct {
            match socket.try_write(&state.out) {
                Ok(n) if n == state.out.len() => {
                    state.out.clear();
                    return;
                }
                Ok(n) => {
                    state.out.drain(..n);
                }
                // Full, or broken: the task waits for room, or finds the error.
                Err(_) => {}
            }
        }
        self.wake.notify_one();
    }

    /// The connection ended: refuses answers still to come, drops the shared write
    /// side, and returns the listeners of the acquires still waiting.
    fn close(&self) -> Vec<u128> {
        let mut state = self.lock();
        state.closed = true;
        state.direct = None;
        state.acquires = 0;
        // Dropping the senders stops the calls still waiting.
        state.stops.clear();
        state.in_flight.drain().filter_map(|(_, l)| l).collect()
    }

    /// The sink of acquire `id`'s answer.
    fn grant_sink(self: &Arc<Self>, id: u64) -> GrantSink {
        let outbox = self.clone();
        Box::new(move |result| {
            let response = match result {
                Ok(grant) => Response::Grant(grpc::grant_pb(grant)),
                Err(e) => {
                    count_refusal(&outbox.handle, &e);
                    error_response(&e)
                }
            };
            outbox.answer(id, &response)
        })
    }

    /// The sink of renewal `id`'s answer.
    fn renew_sink(self: &Arc<Self>, id: u64) -> ReplySink {
        let outbox = self.clone();
        Box::new(move |result| {
            let response = match result.and_then(typed::renewed) {
                Ok(grant) => Response::Renewed(grpc::renew_pb(grant)),
                Err(e) => error_response(&e),
            };
            outbox.answer(id, &response);
        })
    }

    /// The sink of release `id`'s answer.
    fn release_sink(self: &Arc<Self>, id: u64) -> ReplySink {
        let outbox = self.clone();
        Box::new(move |result| {
            let response = match result.and_then(typed::released) {
                Ok(released) => Response::Released(grpc::release_pb(released)),
                Err(e) => error_response(&e),
            };
            outbox.answer(id, &response);
        })
    }
}

/// One connection's state, owned by its task.
struct Connection {
    options: Arc<WireOptions>,
    /// Who the connection speaks for; `None` until a good `Hello` when tokens are on.
    principal: Option<Principal>,
    outbox: Arc<Outbox>,
    /// Still reading requests (false once stopping, after a framing error, or a
    /// failed re-Hello).
    reading: bool,
    /// The connection's place in the pools: admitted by the first good Hello.
    ticket: Arc<Ticket>,
    /// Frames other than pings so far (for the idle check).
    requests: u64,
}

impl Connection {
    fn reply(&mut self, id: u64, response: &Response) {
        self.outbox.reply(id, response);
    }

    fn refuse(&mut self, id: u64, error: ApiError) {
        count_refusal(&self.options.handle, &error);
        self.reply(id, &error_response(&error));
    }

    /// Handles the whole frames at the start of `input`; returns the bytes used.
    fn frames(&mut self, input: &[u8]) -> usize {
        let mut used = 0;
        while self.reading {
            match wire::frame_len(&input[used..], self.options.max_frame) {
                Ok(Some(n)) => {
                    self.frame(&input[used..used + n]);
                    used += n;
                }
                Ok(None) => break,
                Err(e) => {
                    // The length cannot be trusted, so neither can anything after it:
                    // answer, finish what is in flight, close.
                    let kind = if e.message.contains("larger") {
                        ApiErrorKind::PayloadTooLarge
                    } else {
                        ApiErrorKind::InvalidArgument
                    };
                    self.reply(0, &error_response(&ApiError::new(kind, e.message)));
                    self.reading = false;
                    return input.len();
                }
            }
        }
        used
    }

    fn frame(&mut self, frame: &[u8]) {
        let (id, request) = match wire::decode_request(frame) {
            Ok(decoded) => decoded,
            Err(e) => {
                let error = ApiError::new(ApiErrorKind::InvalidArgument, e.message);
                return self.reply(e.id.unwrap_or(0), &error_response(&error));
            }
        };
        if !matches!(request, Request::Ping) {
            self.requests += 1;
        }
        match request {
            Request::Ping => self.reply(id, &Response::Pong),
            Request::Cancel => {
                // Taken out of the queue if it still waits; a grant on its way finds
                // it gone and is released by the engine. Either way the client hears
                // `cancelled` for the id, after any answer it was sent.
                let (listener, stop) = {
                    let mut state = self.outbox.lock();
                    let listener = state.in_flight.get(&id).copied().flatten();
                    if listener.is_some() {
                        state.in_flight.remove(&id);
                        state.acquires -= 1;
                    }
                    let stop = state.stops.remove(&id);
                    if stop.is_some() {
                        state.in_flight.remove(&id);
                    }
                    (listener, stop)
                };
                if let Some(listener) = listener {
                    self.options.handle.cancel_listener(listener);
                }
                if let Some(stop) = stop {
                    let _ = stop.send(());
                }
                let cancelled = ApiError::new(ApiErrorKind::Cancelled, "cancelled by the client");
                self.reply(id, &error_response(&cancelled));
            }
            Request::Hello(hello) => self.hello(id, &hello.token),
            request => self.call(id, request),
        }
    }

    fn hello(&mut self, id: u64, token: &str) {
        if !self.options.auth.enabled() {
            if self.admit(id) {
                self.reply(id, &Response::Welcome);
            }
            return;
        }
        match self.options.auth.authenticate(token) {
            Some(principal) => {
                // Admitted before the principal is set: no request runs on a
                // connection that is not admitted.
                if self.admit(id) {
                    self.principal = Some(principal);
                    self.reply(id, &Response::Welcome);
                }
            }
            None => {
                let unknown = ApiError::new(ApiErrorKind::Unauthenticated, "unknown token");
                if self.principal.take().is_some() {
                    // A failed re-Hello: nothing more runs as the earlier principal.
                    tracing::debug!("closing a wire connection after a failed re-Hello");
                    self.reading = false;
                    let closing = ApiError::new(
                        ApiErrorKind::Unauthenticated,
                        "unknown token; this connection's earlier token no longer applies \
                         and the connection closes",
                    );
                    return self.refuse(id, closing);
                }
                self.refuse(id, unknown);
            }
        }
    }

    /// Admits the connection (see the module docs); if it cannot be, answers `id`
    /// with `unavailable` and stops reading, so the connection closes.
    fn admit(&mut self, id: u64) -> bool {
        match self.ticket.admit() {
            Ok(()) => true,
            Err(refused) => {
                self.reading = false;
                self.reply(id, &error_response(&refused.into_error()));
                false
            }
        }
    }

    fn call(&mut self, id: u64, request: Request) {
        let Some(caller) = self.principal.clone() else {
            return self.refuse(
                id,
                ApiError::new(
                    ApiErrorKind::Unauthenticated,
                    "this connection needs a token: send Hello with it first",
                ),
            );
        };
        if !self.admit(id) {
            return;
        }
        let handle = &self.options.handle;
        let acquire = matches!(request, Request::Acquire(_));
        {
            let state = self.outbox.lock();
            if state.in_flight.contains_key(&id) {
                drop(state);
                return self.reply(
                    id,
                    &error_response(&ApiError::new(
                        ApiErrorKind::InvalidArgument,
                        format!("request id {id} is already in flight on this connection"),
                    )),
                );
            }
            if acquire && state.acquires >= self.options.max_in_flight {
                // Refused rather than left unread: renewals and releases behind it on
                // this connection must not wait for a queue to move.
                let error = ApiError::new(
                    ApiErrorKind::ResourceExhausted,
                    format!(
                        "{} acquires are already in flight on this connection",
                        state.acquires
                    ),
                );
                drop(state);
                return self.reply(id, &error_response(&error));
            }
        }
        let sent = match request {
            Request::Acquire(r) => grpc::acquire_args(&caller, r).and_then(|args| {
                // In flight before it is sent: the answer may come from another thread
                // before `acquire_to` returns.
                let listener = handle.new_listener();
                self.register(id, Some(listener));
                let requester = Requester::of(&caller);
                handle.acquire_to(&requester, args, listener, self.outbox.grant_sink(id))
            }),
            Request::Renew(r) => grpc::renew_args(&caller, &r).and_then(|(name, token, ttl_ms)| {
                self.register(id, None);
                let renew = Command::Renew {
                    name,
                    token,
                    ttl_ms,
                };
                handle.command_to(&Requester::of(&caller), renew, self.outbox.renew_sink(id))
            }),
            Request::Release(r) => grpc::release_args(&caller, &r).and_then(|(name, token)| {
                self.register(id, None);
                let release = Command::Release { name, token };
                handle.command_to(
                    &Requester::of(&caller),
                    release,
                    self.outbox.release_sink(id),
                )
            }),
            Request::Hello(_) | Request::Cancel | Request::Ping => {
                unreachable!("answered without the engine")
            }
            kind => {
                self.register(id, None);
                self.spawn_kind_call(id, caller, kind);
                Ok(())
            }
        };
        if let Err(e) = sent {
            // Refused before the engine saw it, or the engine is gone.
            self.unregister(id);
            self.refuse(id, e);
        }
    }

    /// Runs a multi-lock, downgrade or election request on its own task and answers
    /// it when done. [`Request::Cancel`] or the connection's end stops the call (a
    /// waiting multi-lock or campaign leaves its queues); grants that find the request
    /// cancelled or the connection gone are released.
    fn spawn_kind_call(&self, id: u64, caller: Principal, request: Request) {
        let handle = self.options.handle.clone();
        let outbox = self.outbox.clone();
        let (stop, stopped) = oneshot::channel();
        self.outbox.lock().stops.insert(id, stop);
        tokio::spawn(async move {
            let call = async {
                match request {
                    Request::AcquireAll(r) => {
                        match grpc::acquire_all_call(&handle, &caller, r).await {
                            Ok(all) => {
                                let granted = all.grants.clone();
                                (Response::GrantedAll(all), granted)
                            }
                            Err(e) => (error_response(&e), Vec::new()),
                        }
                    }
                    Request::Campaign(r) => match grpc::campaign_call(&handle, &caller, r).await {
                        Ok(grant) => (Response::Grant(grant.clone()), vec![grant]),
                        Err(e) => (error_response(&e), Vec::new()),
                    },
                    Request::ReleaseAll(r) => {
                        let answer = grpc::release_all_call(&handle, &caller, r).await;
                        (
                            answer.map_or_else(|e| error_response(&e), Response::ReleasedAll),
                            Vec::new(),
                        )
                    }
                    Request::Downgrade(r) => {
                        let answer = grpc::downgrade_call(&handle, &caller, r).await;
                        (
                            answer.map_or_else(|e| error_response(&e), Response::Grant),
                            Vec::new(),
                        )
                    }
                    Request::Proclaim(r) => {
                        let answer = grpc::proclaim_call(&handle, &caller, r).await;
                        (
                            answer.map_or_else(|e| error_response(&e), Response::Grant),
                            Vec::new(),
                        )
                    }
                    Request::Leader(r) => {
                        let answer = grpc::leader_call(&handle, &caller, r).await;
                        (
                            answer.map_or_else(|e| error_response(&e), Response::Leader),
                            Vec::new(),
                        )
                    }
                    other => {
                        let e = ApiError::new(
                            ApiErrorKind::Internal,
                            format!("{other:?} is not run on its own task"),
                        );
                        (error_response(&e), Vec::new())
                    }
                }
            };
            let (response, granted) = tokio::select! {
                biased;
                answered = call => answered,
                // Cancelled, or the connection ended: dropping the call leaves any
                // queue it waits in, and the client has its answer already.
                _ = stopped => return,
            };
            if !outbox.answer(id, &response) && !granted.is_empty() {
                // Nobody took the grants: give them back rather than let them
                // sit until their leases end.
                let grants = granted
                    .iter()
                    .filter_map(|g| {
                        let name = fencelock_core::LockName::new(&g.name).ok()?;
                        Some((name, g.owner_token.parse().ok()?))
                    })
                    .collect();
                let _ = handle.release_all(&Requester::of(&caller), grants).await;
            }
        });
    }

    fn register(&self, id: u64, listener: Option<u128>) {
        let mut state = self.outbox.lock();
        state.in_flight.insert(id, listener);
        if listener.is_some() {
            state.acquires += 1;
        }
    }

    fn unregister(&self, id: u64) {
        let mut state = self.outbox.lock();
        if let Some(Some(_)) = state.in_flight.remove(&id) {
            state.acquires -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use futures_util::FutureExt;
    use tokio::net::TcpListener;

    use super::*;

    /// A connected pair: the server side split as [`serve_tcp`] splits it, and the
    /// client's stream.
    async fn socket_pair() -> (Arc<OwnedWriteHalf>, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        let (_rd, wr) = server.into_split();
        // Writable once the reactor has seen it so (as after the server's magic).
        wr.writable().await.unwrap();
        (Arc::new(wr), client)
    }

    #[test]
    fn not_leader_error_frame_carries_the_leader_when_known() {
        let known = error_response(&ApiError::not_leader(Some("http://127.0.0.1:7421".into())));
        let Response::Error(e) = known else {
            panic!("not an error frame: {known:?}")
        };
        assert_eq!(
            (e.code.as_str(), e.leader.as_str()),
            ("not_leader", "http://127.0.0.1:7421")
        );

        // Unknown leader, or another error: the field stays empty (not encoded).
        for error in [
            ApiError::not_leader(None),
            ApiError::new(ApiErrorKind::Unavailable, "stopping"),
        ] {
            let Response::Error(e) = error_response(&error) else {
                panic!("not an error frame")
            };
            assert_eq!(e.code, error.kind().code());
            assert_eq!(e.leader, "");
        }
    }

    async fn new_outbox(direct: Option<Arc<OwnedWriteHalf>>) -> (Arc<Outbox>, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let handle = crate::engine::start(crate::engine::EngineConfig::new(dir.path())).unwrap();
        let outbox = Arc::new(Outbox {
            state: Mutex::new(OutState {
                direct,
                ..OutState::default()
            }),
            wake: Notify::new(),
            handle,
        });
        (outbox, dir)
    }

    async fn read_answer(client: &mut TcpStream) -> (u64, Response) {
        let mut input = Vec::new();
        loop {
            if let Some(n) = wire::frame_len(&input, wire::MAX_FRAME_BYTES).unwrap() {
                return wire::decode_response(&input[..n]).unwrap();
            }
            let read = tokio::time::timeout(Duration::from_secs(10), client.read_buf(&mut input));
            assert!(read.await.unwrap().unwrap() > 0, "the socket closed");
        }
    }

    /// The point of the sinks: an answer delivered on another thread (the engine's
    /// writer thread) reaches the client's socket from that thread, without waking
    /// the connection task.
    #[tokio::test]
    async fn an_answer_is_written_to_the_socket_by_the_thread_that_delivers_it() {
        let (wr, mut client) = socket_pair().await;
        let (outbox, _dir) = new_outbox(Some(wr)).await;
        outbox.lock().in_flight.insert(7, None);
        let delivering = outbox.clone();
        let took = std::thread::spawn(move || delivering.answer(7, &Response::Pong))
            .join()
            .unwrap();
        assert!(took);
        assert_eq!(read_answer(&mut client).await, (7, Response::Pong));
        assert!(
            outbox.wake.notified().now_or_never().is_none(),
            "the connection task was woken to write an answer the socket took"
        );
        assert!(outbox.lock().in_flight.is_empty());
    }

    /// On any other stream (TLS), or while the task is writing, an answer waits in
    /// the output for the task, which is woken to write it.
    #[tokio::test]
    async fn without_a_direct_socket_or_while_the_task_writes_the_task_is_woken() {
        let (outbox, _dir) = new_outbox(None).await;
        outbox.lock().in_flight.insert(1, None);
        assert!(outbox.answer(1, &Response::Pong));
        assert!(!outbox.lock().out.is_empty());
        assert!(outbox.wake.notified().now_or_never().is_some());

        let (wr, _client) = socket_pair().await;
        let (outbox, _dir) = new_outbox(Some(wr)).await;
        outbox.lock().task_writing = true;
        outbox.lock().in_flight.insert(2, None);
        assert!(outbox.answer(2, &Response::Pong));
        assert!(
            !outbox.lock().out.is_empty(),
            "a sink wrote while the task was writing: frames could interleave"
        );
    }

    /// An answer to a cancelled acquire, or to any request once the connection has
    /// ended, is refused (the engine then releases a grant), and closing hands back
    /// the listeners of the acquires still waiting.
    #[tokio::test]
    async fn answers_to_cancelled_requests_or_a_closed_connection_are_refused() {
        let (wr, _client) = socket_pair().await;
        let (outbox, _dir) = new_outbox(Some(wr)).await;
        assert!(
            !outbox.answer(3, &Response::Pong),
            "no such request in flight (it was cancelled)"
        );
        {
            let mut state = outbox.lock();
            state.in_flight.insert(4, Some(40));
            state.in_flight.insert(5, None);
            state.acquires = 1;
        }
        assert_eq!(outbox.close(), vec![40]);
        assert!(!outbox.answer(4, &Response::Pong));
        assert!(!outbox.answer(5, &Response::Pong));
        let state = outbox.lock();
        assert!(
            state.direct.is_none(),
            "the socket must close with the task"
        );
        assert!(state.out.is_empty());
    }
}
