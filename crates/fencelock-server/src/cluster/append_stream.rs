//! Pipelined replication: one long-lived HTTP/2 request per replication stream
//! (`POST /raft/append-stream`), whose body carries the leader's AppendEntries
//! requests and whose answer body carries the follower's results, in order.
//!
//! openraft's default sends one AppendEntries and waits for its answer before the
//! next. Every commit also sends an entry-less request that only carries the new
//! commit index, so with one request at a time the next entry waited for that
//! request's round trip: a whole extra round per commit in serial workloads (one
//! hand-off after another). Here the leader sends each request as soon as openraft
//! makes it, and the follower feeds them, in order, to `Raft::stream_append`.
//!
//! Each message is a 4-byte big-endian length and a postcard body (hand-written:
//! ten lines, where a codec crate would need an `AsyncRead` adapter around the body).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use futures_util::stream::BoxStream;
use futures_util::{Stream, StreamExt};
use http_body_util::BodyExt;
use openraft::error::RPCError;
use openraft::raft::{AppendEntriesRequest, StreamAppendError, StreamAppendResult};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::mpsc;

use super::TypeConfig;

/// Requests encoded ahead of the connection (openraft produces them no faster than
/// it appends, so this only absorbs bursts).
pub(super) const SEND_QUEUE: usize = 64;

/// What the follower answers for each request: openraft's result, or why its Raft
/// stopped (the stream ends after it).
pub(super) type Answer = Result<StreamAppendResult<TypeConfig>, String>;

/// One message: its length (4 bytes, big-endian) and its postcard encoding.
pub(super) fn frame<T: Serialize>(value: &T) -> Result<Bytes, postcard::Error> {
    let body = postcard::to_allocvec(value)?;
    let mut framed = Vec::with_capacity(4 + body.len());
    framed.extend_from_slice(&(body.len() as u32).to_be_bytes());
    framed.extend_from_slice(&body);
    Ok(Bytes::from(framed))
}

/// Splits a byte stream back into messages.
#[derive(Debug, Default)]
pub(super) struct Frames {
    buf: Vec<u8>,
    /// Where the unread part of `buf` starts.
    start: usize,
    max: usize,
}

impl Frames {
    /// A reader that refuses messages longer than `max` bytes.
    pub(super) fn new(max: usize) -> Frames {
        Frames {
            buf: Vec::new(),
            start: 0,
            max,
        }
    }

    /// Adds received bytes.
    pub(super) fn push(&mut self, bytes: &[u8]) {
        if self.start > 0 && self.start == self.buf.len() {
            self.buf.clear();
            self.start = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole message, decoded; `None` until one is complete.
    pub(super) fn next<T: DeserializeOwned>(&mut self) -> Option<Result<T, String>> {
        let unread = &self.buf[self.start..];
        let len_bytes: [u8; 4] = unread.get(..4)?.try_into().ok()?;
        let len = u32::from_be_bytes(len_bytes) as usize;
        if len > self.max {
            return Some(Err(format!(
                "a peer message of {len} bytes is above the limit of {}",
                self.max
            )));
        }
        let body = unread.get(4..4 + len)?;
        let decoded =
            postcard::from_bytes(body).map_err(|e| format!("undecodable peer message: {e}"));
        self.start += 4 + len;
        Some(decoded)
    }
}

/// The follower's side: decodes the requests of `body` in order, hands them to
/// openraft's pipelined append, and encodes each answer as it comes. A request that
/// cannot be read ends the stream (the leader sees it end early and reconnects).
/// `on_accepted` runs for every answer that is not a refusal for a higher vote.
pub(super) fn serve(
    raft: super::Raft,
    body: Body,
    max: usize,
    on_accepted: impl Fn() + Send + 'static,
) -> impl Stream<Item = Result<Bytes, Infallible>> + Send + 'static {
    let requests = futures_util::stream::unfold(
        (body.into_data_stream(), Frames::new(max)),
        |(mut data, mut frames)| async move {
            loop {
                match frames.next::<AppendEntriesRequest<TypeConfig>>() {
                    Some(Ok(req)) => return Some((req, (data, frames))),
                    Some(Err(why)) => {
                        tracing::warn!(%why, "ending a replication stream from the leader");
                        return None;
                    }
                    None => {}
                }
                match data.next().await {
                    Some(Ok(chunk)) => frames.push(&chunk),
                    _ => return None,
                }
            }
        },
    );
    // The answers borrow `raft`, so a task owns both and forwards the answers; it
    // ends when the answer body is dropped (the connection or stream is gone).
    let (tx, mut rx) = mpsc::channel::<Bytes>(SEND_QUEUE);
    tokio::spawn(async move {
        let mut results = std::pin::pin!(raft.stream_append(requests));
        while let Some(item) = results.next().await {
            let answer: Answer = match item {
                Ok(result) => {
                    if !matches!(result, Err(StreamAppendError::HigherVote(_))) {
                        on_accepted();
                    }
                    Ok(result)
                }
                Err(fatal) => Err(fatal.to_string()),
            };
            let bytes = match frame(&answer) {
                Ok(bytes) => bytes,
                Err(e) => {
                    tracing::error!(error = %e, "cannot encode a replication answer");
                    return;
                }
            };
            if tx.send(bytes).await.is_err() {
                return;
            }
        }
    });
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)).map(Ok)
}

/// The request body of a stream: messages from a channel.
pub(super) fn request_body(rx: mpsc::Receiver<Bytes>) -> super::network::PeerBody {
    let mut rx = rx;
    let frames = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
        .map(|bytes| Ok::<_, Infallible>(hyper::body::Frame::data(bytes)));
    BodyExt::boxed(http_body_util::StreamBody::new(frames))
}

/// Sends `input`'s requests into `tx` as openraft makes them, recording when each
/// went (for its answer's deadline). Ends when `input` does (which ends the request
/// body) or when the stream is gone.
pub(super) fn spawn_sender<S>(
    mut input: S,
    tx: mpsc::Sender<Bytes>,
    sent: Arc<Mutex<VecDeque<Instant>>>,
) -> tokio::task::JoinHandle<()>
where
    S: Stream<Item = AppendEntriesRequest<TypeConfig>> + Send + Unpin + 'static,
{
    tokio::spawn(async move {
        // An entry-less request (a commit index, a probe) waits up to HOLD for the
        // next request and goes out in the same write: a commit is followed by the
        // next entry within a round trip in a busy cluster, and one wake-up of the
        // follower for both costs less than two.
        let mut held: Option<Bytes> = None;
        loop {
            let next = match &held {
                None => input.next().await,
                Some(_) => match tokio::time::timeout(HOLD, input.next()).await {
                    Ok(next) => next,
                    Err(_) => {
                        if let Some(bytes) = held.take() {
                            if !send(&tx, &sent, bytes, 1).await {
                                return;
                            }
                        }
                        continue;
                    }
                },
            };
            let Some(req) = next else {
                if let Some(bytes) = held.take() {
                    send(&tx, &sent, bytes, 1).await;
                }
                return;
            };
            let bytes = match frame(&req) {
                Ok(bytes) => bytes,
                Err(e) => {
                    tracing::error!(error = %e, "cannot encode an AppendEntries request");
                    return;
                }
            };
            let sent_ok = match held.take() {
                Some(first) => {
                    let mut both = Vec::with_capacity(first.len() + bytes.len());
                    both.extend_from_slice(&first);
                    both.extend_from_slice(&bytes);
                    send(&tx, &sent, Bytes::from(both), 2).await
                }
                None if req.entries.is_empty() => {
                    held = Some(bytes);
                    true
                }
                None => send(&tx, &sent, bytes, 1).await,
            };
            if !sent_ok {
                return;
            }
        }
    })
}

/// Longest an entry-less request waits for company (see `spawn_sender`).
const HOLD: Duration = Duration::from_millis(1);

/// Sends `bytes` (`count` requests), recording when they went. False: the stream
/// is gone.
async fn send(
    tx: &mpsc::Sender<Bytes>,
    sent: &Mutex<VecDeque<Instant>>,
    bytes: Bytes,
    count: usize,
) -> bool {
    {
        let now = Instant::now();
        let mut sent = lock(sent);
        for _ in 0..count {
            sent.push_back(now);
        }
    }
    tx.send(bytes).await.is_ok()
}

fn lock(sent: &Mutex<VecDeque<Instant>>) -> std::sync::MutexGuard<'_, VecDeque<Instant>> {
    sent.lock().unwrap_or_else(|e| e.into_inner())
}

/// Aborts the sender when the answer stream is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The leader's side: the follower's answers, in order. Each must come within
/// `ttl` of its request being sent, as for a single AppendEntries; a stream that
/// ends while requests await answers, or an undecodable answer, is a network error.
pub(super) fn answers(
    body: hyper::body::Incoming,
    sent: Arc<Mutex<VecDeque<Instant>>>,
    sender: tokio::task::JoinHandle<()>,
    ttl: Duration,
    target: u64,
    max: usize,
) -> BoxStream<'static, Result<StreamAppendResult<TypeConfig>, RPCError<TypeConfig>>> {
    struct State {
        body: hyper::body::Incoming,
        frames: Frames,
        sent: Arc<Mutex<VecDeque<Instant>>>,
        _sender: AbortOnDrop,
        done: bool,
    }
    let state = State {
        body,
        frames: Frames::new(max),
        sent,
        _sender: AbortOnDrop(sender),
        done: false,
    };
    futures_util::stream::unfold(state, move |mut st| async move {
        if st.done {
            return None;
        }
        loop {
            if let Some(decoded) = st.frames.next::<Answer>() {
                lock(&st.sent).pop_front();
                let item = match decoded {
                    Ok(Ok(result)) => Ok(result),
                    Ok(Err(fatal)) => Err(super::network::unreachable(format!(
                        "peer {target}'s raft stopped: {fatal}"
                    ))),
                    Err(why) => Err(super::network::network_error(why)),
                };
                st.done = item.is_err();
                return Some((item, st));
            }
            // Wait for more bytes, but no later than the oldest unanswered
            // request's deadline; with none in flight, look again after `ttl`.
            let oldest = lock(&st.sent).front().copied();
            let wait = oldest.map_or(ttl, |at| {
                (at + ttl).saturating_duration_since(Instant::now())
            });
            match tokio::time::timeout(wait, st.body.frame()).await {
                Ok(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        st.frames.push(&data);
                    }
                }
                Ok(Some(Err(e))) => {
                    st.done = true;
                    let e = super::network::network_error(format!(
                        "replication stream to peer {target} broke: {e}"
                    ));
                    return Some((Err(e), st));
                }
                Ok(None) => {
                    st.done = true;
                    if lock(&st.sent).is_empty() {
                        return None;
                    }
                    let e = super::network::network_error(format!(
                        "peer {target} ended the replication stream with requests unanswered"
                    ));
                    return Some((Err(e), st));
                }
                Err(_) => {
                    let late = lock(&st.sent).front().is_some_and(|at| at.elapsed() >= ttl);
                    if late {
                        st.done = true;
                        let e = super::network::network_error(format!(
                            "peer {target} did not answer an AppendEntries within {ttl:?}"
                        ));
                        return Some((Err(e), st));
                    }
                }
            }
        }
    })
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_split_a_byte_stream_back_into_messages_however_it_is_cut() {
        let messages: Vec<(u64, String)> =
            (0..20).map(|i| (i, "x".repeat(i as usize * 7))).collect();
        let mut bytes = Vec::new();
        for m in &messages {
            bytes.extend_from_slice(&frame(m).expect("encodes"));
        }
        for cut in [1, 3, 5, 64, bytes.len()] {
            let mut frames = Frames::new(1 << 20);
            let mut got = Vec::new();
            for chunk in bytes.chunks(cut) {
                frames.push(chunk);
                while let Some(m) = frames.next::<(u64, String)>() {
                    got.push(m.expect("decodes"));
                }
            }
            assert_eq!(got, messages, "cut every {cut} bytes");
        }
    }

    /// A follower on a local port that answers (after its headers, at once) only
    /// once it holds `n` requests, each with its `prev_log_id`.
    async fn follower_holding(n: usize) -> std::net::SocketAddr {
        use axum::response::IntoResponse;
        let answer_after = move |body: Body| async move {
            let answers = futures_util::stream::once(async move {
                let mut data = body.into_data_stream();
                let mut frames = Frames::new(1 << 20);
                let mut held = Vec::new();
                while held.len() < n {
                    match frames.next::<AppendEntriesRequest<TypeConfig>>() {
                        Some(req) => held.push(req.expect("a request")),
                        None => match data.next().await {
                            Some(Ok(chunk)) => frames.push(&chunk),
                            _ => panic!("the stream ended with {} requests", held.len()),
                        },
                    }
                }
                let mut out = Vec::new();
                for req in &held {
                    let answer: Answer = Ok(Ok(req.prev_log_id));
                    out.extend_from_slice(&frame(&answer).expect("encodes"));
                }
                Ok::<_, Infallible>(Bytes::from(out))
            });
            Body::from_stream(answers).into_response()
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a port");
        let addr = listener.local_addr().expect("its address");
        let app =
            axum::Router::new().route("/raft/append-stream", axum::routing::post(answer_after));
        tokio::spawn(async move { axum::serve(listener, app).await });
        addr
    }

    /// Opens a stream to `addr` with the real peer client, sends `count` entry-less
    /// requests and keeps the input open (as openraft does between writes), and
    /// returns the first `count` answers.
    async fn answers_from(
        addr: std::net::SocketAddr,
        count: usize,
    ) -> Vec<Result<StreamAppendResult<TypeConfig>, RPCError<TypeConfig>>> {
        use super::super::network::{Network, PeerIdentity};
        use super::super::{Member, Vote};
        use openraft::network::v2::RaftNetworkV2;
        use openraft::network::{RPCOption, RaftNetworkFactory};

        let identity = PeerIdentity {
            node_id: 1,
            url: "http://127.0.0.1:1".into(),
            secret: None,
            config: String::new(),
        };
        let mut network =
            Network::new(Arc::new(identity), Arc::default(), Default::default(), None);
        let member = Member {
            peer_addr: addr.to_string(),
            url: String::new(),
        };
        let mut peer = network.new_client(2, &member).await;
        let requests: Vec<_> = (0..count)
            .map(|_| AppendEntriesRequest::<TypeConfig> {
                vote: Vote::new_committed(1, 1),
                prev_log_id: None,
                leader_commit: None,
                entries: Vec::new(),
            })
            .collect();
        let input = futures_util::stream::iter(requests).chain(futures_util::stream::pending());
        let option = RPCOption::new(Duration::from_secs(5));
        let answers = peer
            .stream_append(Box::pin(input), option)
            .await
            .expect("the stream opens");
        tokio::time::timeout(Duration::from_secs(10), answers.take(count).collect())
            .await
            .expect("the answers come")
    }

    /// The leader's side pipelines: a follower that answers only once it holds two
    /// requests gets both. A client that waited for each answer before sending
    /// the next (openraft's default) never sends the second, and times out.
    #[tokio::test]
    async fn the_leader_sends_the_next_request_before_the_answer_to_the_last() {
        let got = answers_from(follower_holding(2).await, 2).await;
        assert_eq!(got.len(), 2);
        assert!(got.iter().all(|a| matches!(a, Ok(Ok(None)))), "{got:?}");
    }

    /// An entry-less request that nothing follows still goes out (after `HOLD`).
    #[tokio::test]
    async fn a_lone_entry_less_request_is_not_held_forever() {
        let got = answers_from(follower_holding(1).await, 1).await;
        assert_eq!(got.len(), 1);
        assert!(matches!(got[0], Ok(Ok(None))), "{got:?}");
    }

    #[test]
    fn a_message_above_the_limit_is_refused_before_it_is_buffered() {
        let mut frames = Frames::new(16);
        frames.push(&1000u32.to_be_bytes());
        let refused = frames.next::<String>().expect("an answer without the body");
        assert!(refused.unwrap_err().contains("above the limit"));
    }
}
