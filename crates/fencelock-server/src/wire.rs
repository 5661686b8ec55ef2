//! The wire protocol `flw/1` ([`fencelock_proto::wire`]) on one connection: the client
//! library's fast path for `Acquire`, `Renew` and `Release`, on the same port as HTTP
//! and gRPC (the accept loop tells it apart by its first byte).
//!
//! One task per connection reads frames, runs each request as a future of its own (an
//! acquire may wait in the queue while later requests are answered), and writes the
//! answers as they complete, several per write when several are ready. The requests go
//! through the same functions as gRPC ([`crate::grpc`]), so validation, authorization,
//! rate limits and error codes are the same.
//!
//! Bounds: a frame is at most `max_body_bytes`; at most `max_streams_per_connection`
//! acquires are in flight per connection (one more is refused at once with
//! `resource_exhausted`, so that renewals behind it are never held up by waits), and
//! as many again of everything else (beyond that the connection is not read until
//! something completes); a connection that sends nothing for [`IDLE_TIMEOUT`] is closed (the
//! client pings while idle). Dropping a waiting acquire — on [`Op::Cancel`], or when
//! the connection ends — takes it out of the queue. Every request gets exactly one
//! answer; a cancelled one gets `cancelled` (after its real answer, if that was sent
//! first — the client then gives back a grant it no longer wants).
//!
//! [`Op::Cancel`]: fencelock_proto::wire::Op::Cancel

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use fencelock_proto::wire::{self, Request, Response, WireError};
use futures_util::future::{AbortHandle, Abortable};
use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::FutureExt;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::auth::{Authenticator, Principal};
use crate::engine::Handle;
use crate::error::{ApiError, ApiErrorKind};
use crate::grpc;
use crate::limits::Limits;

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
}

type Answer = Pin<Box<dyn Future<Output = Option<(u64, Response)>> + Send>>;

fn error_response(error: &ApiError) -> Response {
    Response::Error(WireError {
        code: error.kind().code().to_owned(),
        message: error.message().to_owned(),
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
/// leaves or breaks the protocol. For tests and fuzzing over in-memory streams.
pub async fn serve_stream<I>(io: I, handle: Handle, auth: Authenticator, limits: &Limits)
where
    I: AsyncRead + AsyncWrite + Unpin + Send,
{
    let options = Arc::new(WireOptions {
        handle,
        auth,
        max_frame: limits.max_body_bytes,
        max_in_flight: limits.max_streams_per_connection as usize,
        header_read_timeout: crate::DEFAULT_HEADER_READ_TIMEOUT,
    });
    // Never stopping: the sender lives as long as the connection.
    let (_never, stopping) = watch::channel(());
    serve_connection(io, options, stopping).await;
}

/// Serves `flw/1` on `io`, whose first bytes are the client's magic, until the client
/// leaves, breaks the protocol, idles out, or the server stops (`stopping` changes:
/// then the requests in flight are answered first).
pub(crate) async fn serve_connection<I>(
    io: I,
    options: Arc<WireOptions>,
    mut stopping: watch::Receiver<()>,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send,
{
    let (mut rd, mut wr) = tokio::io::split(io);
    let mut magic = [0u8; wire::CLIENT_MAGIC.len()];
    let greeted = tokio::time::timeout(options.header_read_timeout, rd.read_exact(&mut magic));
    if !matches!(greeted.await, Ok(Ok(_))) || magic != wire::CLIENT_MAGIC {
        return;
    }
    if write(&mut wr, &wire::SERVER_MAGIC).await.is_err() {
        return;
    }
    options
        .handle
        .metrics()
        .wire_connections
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut conn = Connection {
        options: options.clone(),
        principal: (!options.auth.enabled()).then(Principal::anonymous),
        in_flight: HashMap::new(),
        acquires: 0,
        answers: FuturesUnordered::new(),
        out: Vec::with_capacity(4096),
        reading: true,
    };
    let mut input: Vec<u8> = Vec::with_capacity(4096);
    let mut heard = Instant::now();
    // Armed once and moved only when it fires: re-arming it for every read cost a
    // timer-wheel update per request.
    let idle = tokio::time::sleep(IDLE_TIMEOUT);
    tokio::pin!(idle);
    loop {
        if !conn.out.is_empty() {
            if write(&mut wr, &conn.out).await.is_err() {
                return;
            }
            conn.out.clear();
        }
        if !conn.reading && conn.answers.is_empty() {
            let _ = wr.shutdown().await;
            return;
        }
        // Beyond the acquires' own bound, renewals and releases may add as many again;
        // past that the connection is not read until something completes.
        let room = conn.answers.len() < 2 * options.max_in_flight;
        if input.capacity() - input.len() < 1024 {
            input.reserve(4096);
        }
        tokio::select! {
            Some(answer) = conn.answers.next(), if !conn.answers.is_empty() => {
                conn.answered(answer);
                // Everything else already done goes out in the same write.
                while let Some(Some(answer)) = conn.answers.next().now_or_never() {
                    conn.answered(answer);
                }
            }
            read = rd.read_buf(&mut input), if conn.reading && room => {
                match read {
                    // The client left (or broke the connection): dropping the answers
                    // still pending takes its waits out of the queues.
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
            _ = stopping.changed(), if conn.reading => conn.reading = false,
        }
    }
}

/// Writes and flushes (a TLS stream holds what it encrypted until flushed).
async fn write<W: AsyncWrite + Unpin>(wr: &mut W, bytes: &[u8]) -> std::io::Result<()> {
    wr.write_all(bytes).await?;
    wr.flush().await
}

/// One connection's state.
struct Connection {
    options: Arc<WireOptions>,
    /// Who the connection speaks for; `None` until a good `Hello` when tokens are on.
    principal: Option<Principal>,
    /// Requests in flight by id, with the handle that cancels an acquire (`None` for
    /// renewals and releases).
    in_flight: HashMap<u64, Option<AbortHandle>>,
    /// How many of them are acquires.
    acquires: usize,
    answers: FuturesUnordered<Answer>,
    /// Encoded answers not yet written.
    out: Vec<u8>,
    /// Still reading requests (false once stopping, or after a framing error).
    reading: bool,
}

impl Connection {
    fn answered(&mut self, answer: Option<(u64, Response)>) {
        // `None`: a cancelled acquire, which gets no answer.
        if let Some((id, response)) = answer {
            if let Some(Some(_)) = self.in_flight.remove(&id) {
                self.acquires -= 1;
            }
            wire::encode_response(&mut self.out, id, &response);
        }
    }

    fn reply(&mut self, id: u64, response: &Response) {
        wire::encode_response(&mut self.out, id, response);
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
        match request {
            Request::Ping => self.reply(id, &Response::Pong),
            Request::Cancel => {
                // Aborted before it answered: the acquire leaves the queue, and a
                // grant it got meanwhile is given back by the engine. Either way the
                // client hears `cancelled` for the id, after any answer it was sent.
                if let Some(Some(abort)) = self.in_flight.remove(&id) {
                    abort.abort();
                    self.acquires -= 1;
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
            return self.reply(id, &Response::Welcome);
        }
        match self.options.auth.authenticate(token) {
            Some(principal) => {
                self.principal = Some(principal);
                self.reply(id, &Response::Welcome);
            }
            None => self.refuse(
                id,
                ApiError::new(ApiErrorKind::Unauthenticated, "unknown token"),
            ),
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
        if self.in_flight.contains_key(&id) {
            return self.reply(
                id,
                &error_response(&ApiError::new(
                    ApiErrorKind::InvalidArgument,
                    format!("request id {id} is already in flight on this connection"),
                )),
            );
        }
        let acquire = matches!(request, Request::Acquire(_));
        if acquire && self.acquires >= self.options.max_in_flight {
            // Refused rather than left unread: renewals and releases behind it on this
            // connection must not wait for a queue to move.
            let error = ApiError::new(
                ApiErrorKind::ResourceExhausted,
                format!(
                    "{} acquires are already in flight on this connection",
                    self.acquires
                ),
            );
            return self.reply(id, &error_response(&error));
        }
        let handle = self.options.handle.clone();
        let answer = async move {
            let result = match request {
                Request::Acquire(r) => grpc::acquire_call(&handle, &caller, r)
                    .await
                    .map(Response::Grant),
                Request::Renew(r) => grpc::renew_call(&handle, &caller, r)
                    .await
                    .map(Response::Renewed),
                Request::Release(r) => grpc::release_call(&handle, &caller, r)
                    .await
                    .map(Response::Released),
                Request::Hello(_) | Request::Cancel | Request::Ping => {
                    unreachable!("answered without a future")
                }
            };
            let response = result.unwrap_or_else(|e| {
                count_refusal(&handle, &e);
                error_response(&e)
            });
            Some((id, response))
        };
        if acquire {
            let (abort, registration) = AbortHandle::new_pair();
            self.in_flight.insert(id, Some(abort));
            self.acquires += 1;
            self.answers.push(Box::pin(
                Abortable::new(answer, registration).map(|done| done.ok().flatten()),
            ));
        } else {
            self.in_flight.insert(id, None);
            self.answers.push(Box::pin(answer));
        }
    }
}
