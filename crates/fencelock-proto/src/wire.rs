//! The fencelock wire protocol, `flw/1`: the hot-path calls (`Acquire`, `Renew`,
//! `Release`) as length-prefixed frames on a plain (or TLS) TCP connection to the same
//! port as HTTP and gRPC.
//!
//! gRPC costs the server and the client most of their CPU per request in HTTP/2
//! framing, HPACK and task hand-offs; a lock request is a few dozen bytes. `flw/1`
//! carries the same protobuf messages as `fencelock.v1.Locks`, so the schema, its
//! validation and its error codes stay one.
//!
//! ## Connection
//! The client opens with [`CLIENT_MAGIC`] (its first byte can start neither an HTTP/1.1
//! method nor the HTTP/2 preface, so the server tells the protocols apart from it); the
//! server answers [`SERVER_MAGIC`]. A server that does not speak `flw/1` answers HTTP
//! instead, and a client falls back to gRPC. Then both sides send frames:
//!
//! ```text
//! frame = length:u32le  op:u8  id:u64le  message:protobuf   (length counts op..end)
//! ```
//!
//! Requests are multiplexed: the client picks a fresh `id` per request and the server
//! answers each with the same `id`, in any order (an acquire may wait while later
//! requests are answered). [`Op::Cancel`] abandons a waiting acquire, multi-lock or
//! campaign (its `id` is the request's): the server answers it with the error
//! `cancelled` — after the request's own answer if that was already sent, in which
//! case the client should release a grant it no longer wants. With authentication on, the first request is
//! [`Op::Hello`] carrying the bearer token. A frame longer than the server's limit, or
//! one that does not parse, is answered with an error; a frame whose length cannot be
//! trusted ends the connection.
//!
//! ## Errors and clusters
//! An [`Op::Error`] frame carries a [`WireError`]: the stable code, a message, and —
//! since cluster mode, as protobuf field 3, which older clients skip — the leader's URL
//! when a member that is not the leader answers `not_leader`. The client then sends
//! the request again to that URL (or to its next endpoint when the field is empty).

use prost::Message;

pub use crate::sink::Sink;
use crate::{
    AcquireAllRequest, AcquireAllResponse, AcquireRequest, CampaignRequest, DowngradeRequest,
    Grant, LeaderRequest, LeaderResponse, ProclaimRequest, ReleaseAllRequest, ReleaseAllResponse,
    ReleaseRequest, ReleaseResponse, RenewRequest, RenewResponse,
};

/// What a client sends first.
pub const CLIENT_MAGIC: [u8; 8] = *b"\xF1flw/1\r\n";
/// What a server that speaks `flw/1` answers.
pub const SERVER_MAGIC: [u8; 8] = *b"\xF2flw/1\r\n";
/// The largest frame either side accepts by default (length field included).
pub const MAX_FRAME_BYTES: usize = 64 * 1024;
/// Bytes before the message: length, op, id.
pub const HEADER_BYTES: usize = 4 + 1 + 8;

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// Client → server: authenticate the connection ([`Hello`]). Answered with
    /// [`Op::Welcome`] or [`Op::Error`].
    Hello = 1,
    /// Client → server: an [`AcquireRequest`]. Answered with [`Op::Grant`].
    Acquire = 2,
    /// Client → server: a [`RenewRequest`]. Answered with [`Op::Renewed`].
    Renew = 3,
    /// Client → server: a [`ReleaseRequest`]. Answered with [`Op::Released`].
    Release = 4,
    /// Client → server: stop waiting for the acquire with this id (empty message).
    /// Answered with the error `cancelled` to the same id.
    Cancel = 5,
    /// Either way: are you there? Answered with [`Op::Pong`] (empty message).
    Ping = 6,
    /// Client → server: an [`AcquireAllRequest`] (several locks, all or none).
    /// Answered with [`Op::GrantedAll`]; [`Op::Cancel`] abandons it like an acquire.
    AcquireAll = 7,
    /// Client → server: a [`ReleaseAllRequest`]. Answered with [`Op::ReleasedAll`].
    ReleaseAll = 8,
    /// Client → server: a [`DowngradeRequest`]. Answered with [`Op::Grant`].
    Downgrade = 9,
    /// Client → server: a [`CampaignRequest`] (waits like an acquire). Answered with
    /// [`Op::Grant`]; [`Op::Cancel`] abandons it like an acquire.
    Campaign = 10,
    /// Client → server: a [`ProclaimRequest`]. Answered with [`Op::Grant`].
    Proclaim = 11,
    /// Client → server: a [`LeaderRequest`]. Answered with [`Op::Leader`].
    Leader = 12,
    /// Server → client: the connection is authenticated (empty message).
    Welcome = 0x81,
    /// Server → client: a [`Grant`].
    Grant = 0x82,
    /// Server → client: a [`RenewResponse`].
    Renewed = 0x83,
    /// Server → client: a [`ReleaseResponse`].
    Released = 0x84,
    /// Answer to [`Op::Ping`].
    Pong = 0x86,
    /// Server → client: an [`AcquireAllResponse`].
    GrantedAll = 0x87,
    /// Server → client: a [`ReleaseAllResponse`].
    ReleasedAll = 0x88,
    /// Server → client: a [`LeaderResponse`].
    LeaderIs = 0x89,
    /// Server → client: the request failed ([`WireError`]).
    Error = 0xFF,
}

impl Op {
    /// The op of a byte, if it is one.
    pub fn from_u8(b: u8) -> Option<Op> {
        Some(match b {
            1 => Op::Hello,
            2 => Op::Acquire,
            3 => Op::Renew,
            4 => Op::Release,
            5 => Op::Cancel,
            6 => Op::Ping,
            7 => Op::AcquireAll,
            8 => Op::ReleaseAll,
            9 => Op::Downgrade,
            10 => Op::Campaign,
            11 => Op::Proclaim,
            12 => Op::Leader,
            0x87 => Op::GrantedAll,
            0x88 => Op::ReleasedAll,
            0x89 => Op::LeaderIs,
            0x81 => Op::Welcome,
            0x82 => Op::Grant,
            0x83 => Op::Renewed,
            0x84 => Op::Released,
            0x86 => Op::Pong,
            0xFF => Op::Error,
            _ => return None,
        })
    }
}

/// The message of [`Op::Hello`].
#[derive(Clone, PartialEq, Message)]
pub struct Hello {
    /// The bearer token (as in `Authorization: Bearer …`).
    #[prost(string, tag = "1")]
    pub token: String,
}

/// The message of [`Op::Error`]: the stable error code (`held`, `timeout`, …, as in
/// gRPC's `fencelock-error-code`) and a message for people.
///
/// With the code `not_leader` (a cluster member that is not the leader), `leader`
/// (field 3) is the leader's URL when the member knows it. The field was added after
/// the first release of `flw/1`: older clients skip it as an unknown protobuf field,
/// and an empty string means "unknown", so the frame stays compatible both ways.
#[derive(Clone, PartialEq, Message)]
pub struct WireError {
    /// Stable snake_case code.
    #[prost(string, tag = "1")]
    pub code: String,
    /// What went wrong.
    #[prost(string, tag = "2")]
    pub message: String,
    /// With `not_leader`: the leader's URL (`http://host:port`), empty when unknown.
    #[prost(string, tag = "3")]
    pub leader: String,
}

/// A request, decoded.
#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    /// See [`Op::Hello`].
    Hello(Hello),
    /// See [`Op::Acquire`].
    Acquire(AcquireRequest),
    /// See [`Op::Renew`].
    Renew(RenewRequest),
    /// See [`Op::Release`].
    Release(ReleaseRequest),
    /// See [`Op::Cancel`].
    Cancel,
    /// See [`Op::Ping`].
    Ping,
    /// See [`Op::AcquireAll`].
    AcquireAll(AcquireAllRequest),
    /// See [`Op::ReleaseAll`].
    ReleaseAll(ReleaseAllRequest),
    /// See [`Op::Downgrade`].
    Downgrade(DowngradeRequest),
    /// See [`Op::Campaign`].
    Campaign(CampaignRequest),
    /// See [`Op::Proclaim`].
    Proclaim(ProclaimRequest),
    /// See [`Op::Leader`].
    Leader(LeaderRequest),
}

/// A response, decoded.
#[derive(Debug, Clone, PartialEq)]
pub enum Response {
    /// See [`Op::Welcome`].
    Welcome,
    /// See [`Op::Grant`].
    Grant(Grant),
    /// See [`Op::Renewed`].
    Renewed(RenewResponse),
    /// See [`Op::Released`].
    Released(ReleaseResponse),
    /// See [`Op::Pong`].
    Pong,
    /// See [`Op::Error`].
    Error(WireError),
    /// See [`Op::GrantedAll`].
    GrantedAll(AcquireAllResponse),
    /// See [`Op::ReleasedAll`].
    ReleasedAll(ReleaseAllResponse),
    /// See [`Op::LeaderIs`].
    Leader(LeaderResponse),
}

/// Why a frame could not be read. `id` is the frame's id when the header was whole, so
/// the error can be answered to the right request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameError {
    /// The id of the frame, if its header could be read.
    pub id: Option<u64>,
    /// What is wrong, for people.
    pub message: String,
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for FrameError {}

fn frame_error(id: Option<u64>, message: impl Into<String>) -> FrameError {
    FrameError {
        id,
        message: message.into(),
    }
}

/// Where the next frame of `buf` ends: `Ok(Some(n))` if `buf[..n]` is a whole frame,
/// `Ok(None)` if more bytes are needed, an error if the length field is out of range
/// (`max` bytes at most, at least a header) — then the stream cannot be resynchronised.
pub fn frame_len(buf: &[u8], max: usize) -> Result<Option<usize>, FrameError> {
    let Some(len) = buf.get(..4) else {
        return Ok(None);
    };
    let body = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
    let total = body.saturating_add(4);
    if total < HEADER_BYTES {
        return Err(frame_error(
            None,
            format!("a frame of {body} bytes is shorter than its header"),
        ));
    }
    if total > max {
        return Err(frame_error(
            None,
            format!("a frame of {total} bytes is larger than the limit of {max} bytes"),
        ));
    }
    Ok((buf.len() >= total).then_some(total))
}

/// Splits a whole frame (as delimited by [`frame_len`]) into its op byte, id and
/// message bytes.
fn split(frame: &[u8]) -> Result<(u8, u64, &[u8]), FrameError> {
    if frame.len() < HEADER_BYTES {
        return Err(frame_error(None, "a frame shorter than its header"));
    }
    let op = frame[4];
    let mut id = [0u8; 8];
    id.copy_from_slice(&frame[5..13]);
    Ok((op, u64::from_le_bytes(id), &frame[HEADER_BYTES..]))
}

fn decode<M: Message + Default>(id: u64, what: &str, bytes: &[u8]) -> Result<M, FrameError> {
    M::decode(bytes).map_err(|e| frame_error(Some(id), format!("malformed {what} message: {e}")))
}

fn expect_empty(id: u64, what: &str, bytes: &[u8]) -> Result<(), FrameError> {
    if bytes.is_empty() {
        Ok(())
    } else {
        Err(frame_error(
            Some(id),
            format!("a {what} frame carries no message"),
        ))
    }
}

/// Decodes a whole request frame: its id and the request.
pub fn decode_request(frame: &[u8]) -> Result<(u64, Request), FrameError> {
    let (op, id, message) = split(frame)?;
    let request = match Op::from_u8(op) {
        Some(Op::Hello) => Request::Hello(decode(id, "Hello", message)?),
        Some(Op::Acquire) => Request::Acquire(decode(id, "Acquire", message)?),
        Some(Op::Renew) => Request::Renew(decode(id, "Renew", message)?),
        Some(Op::Release) => Request::Release(decode(id, "Release", message)?),
        Some(Op::Cancel) => {
            expect_empty(id, "Cancel", message)?;
            Request::Cancel
        }
        Some(Op::Ping) => {
            expect_empty(id, "Ping", message)?;
            Request::Ping
        }
        Some(Op::AcquireAll) => Request::AcquireAll(decode(id, "AcquireAll", message)?),
        Some(Op::ReleaseAll) => Request::ReleaseAll(decode(id, "ReleaseAll", message)?),
        Some(Op::Downgrade) => Request::Downgrade(decode(id, "Downgrade", message)?),
        Some(Op::Campaign) => Request::Campaign(decode(id, "Campaign", message)?),
        Some(Op::Proclaim) => Request::Proclaim(decode(id, "Proclaim", message)?),
        Some(Op::Leader) => Request::Leader(decode(id, "Leader", message)?),
        _ => {
            return Err(frame_error(
                Some(id),
                format!("unknown request op {op:#04x}"),
            ))
        }
    };
    Ok((id, request))
}

/// Decodes a whole response frame: the id it answers and the response.
pub fn decode_response(frame: &[u8]) -> Result<(u64, Response), FrameError> {
    let (op, id, message) = split(frame)?;
    let response = match Op::from_u8(op) {
        Some(Op::Welcome) => {
            expect_empty(id, "Welcome", message)?;
            Response::Welcome
        }
        Some(Op::Grant) => Response::Grant(decode(id, "Grant", message)?),
        Some(Op::Renewed) => Response::Renewed(decode(id, "Renewed", message)?),
        Some(Op::Released) => Response::Released(decode(id, "Released", message)?),
        Some(Op::Pong) => {
            expect_empty(id, "Pong", message)?;
            Response::Pong
        }
        Some(Op::Error) => Response::Error(decode(id, "Error", message)?),
        Some(Op::GrantedAll) => Response::GrantedAll(decode(id, "GrantedAll", message)?),
        Some(Op::ReleasedAll) => Response::ReleasedAll(decode(id, "ReleasedAll", message)?),
        Some(Op::LeaderIs) => Response::Leader(decode(id, "Leader", message)?),
        _ => {
            return Err(frame_error(
                Some(id),
                format!("unknown response op {op:#04x}"),
            ))
        }
    };
    Ok((id, response))
}

/// Appends one frame to `out`.
fn encode(out: &mut Vec<u8>, op: Op, id: u64, message: Option<&dyn EncodeTo>) {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    out.push(op as u8);
    out.extend_from_slice(&id.to_le_bytes());
    if let Some(m) = message {
        m.encode_to(out);
    }
    let body = u32::try_from(out.len() - start - 4).expect("a frame larger than 4 GiB");
    out[start..start + 4].copy_from_slice(&body.to_le_bytes());
}

/// Object-safe protobuf encoding into a `Vec`.
trait EncodeTo {
    fn encode_to(&self, out: &mut Vec<u8>);
}

impl<M: Message> EncodeTo for M {
    fn encode_to(&self, out: &mut Vec<u8>) {
        out.reserve(self.encoded_len());
        self.encode_raw(out);
    }
}

/// Appends the frame of request `id` to `out`.
///
/// # Panics
/// If the encoded message exceeds 4 GiB (the length field's range). The client
/// library bounds every field long before that; a peer refuses anything above
/// [`MAX_FRAME_BYTES`] anyway.
pub fn encode_request(out: &mut Vec<u8>, id: u64, request: &Request) {
    match request {
        Request::Hello(m) => encode(out, Op::Hello, id, Some(m)),
        Request::Acquire(m) => encode(out, Op::Acquire, id, Some(m)),
        Request::Renew(m) => encode(out, Op::Renew, id, Some(m)),
        Request::Release(m) => encode(out, Op::Release, id, Some(m)),
        Request::Cancel => encode(out, Op::Cancel, id, None),
        Request::Ping => encode(out, Op::Ping, id, None),
        Request::AcquireAll(m) => encode(out, Op::AcquireAll, id, Some(m)),
        Request::ReleaseAll(m) => encode(out, Op::ReleaseAll, id, Some(m)),
        Request::Downgrade(m) => encode(out, Op::Downgrade, id, Some(m)),
        Request::Campaign(m) => encode(out, Op::Campaign, id, Some(m)),
        Request::Proclaim(m) => encode(out, Op::Proclaim, id, Some(m)),
        Request::Leader(m) => encode(out, Op::Leader, id, Some(m)),
    }
}

/// Appends the frame answering request `id` to `out`.
///
/// # Panics
/// If the encoded message exceeds 4 GiB, as [`encode_request`].
pub fn encode_response(out: &mut Vec<u8>, id: u64, response: &Response) {
    match response {
        Response::Welcome => encode(out, Op::Welcome, id, None),
        Response::Grant(m) => encode(out, Op::Grant, id, Some(m)),
        Response::Renewed(m) => encode(out, Op::Renewed, id, Some(m)),
        Response::Released(m) => encode(out, Op::Released, id, Some(m)),
        Response::Pong => encode(out, Op::Pong, id, None),
        Response::Error(m) => encode(out, Op::Error, id, Some(m)),
        Response::GrantedAll(m) => encode(out, Op::GrantedAll, id, Some(m)),
        Response::ReleasedAll(m) => encode(out, Op::ReleasedAll, id, Some(m)),
        Response::Leader(m) => encode(out, Op::LeaderIs, id, Some(m)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_frame(out: &[u8]) -> &[u8] {
        let n = frame_len(out, MAX_FRAME_BYTES).unwrap().unwrap();
        assert_eq!(n, out.len(), "exactly one frame");
        out
    }

    #[test]
    fn requests_round_trip() {
        let requests = [
            Request::Hello(Hello {
                token: "flk_secret".into(),
            }),
            Request::Acquire(AcquireRequest {
                name: "inventory:item:1234".into(),
                ttl_ms: Some(30_000),
                wait_ms: 5_000,
                owner: "worker-7".into(),
                request_id: Some("r-1".into()),
                limit: 3,
                lock_delay_ms: 10,
                session: None,
                mode: "shared".into(),
            }),
            Request::AcquireAll(AcquireAllRequest {
                names: vec!["a".into(), "b".into()],
                ttl_ms: Some(1_000),
                wait_ms: 10,
                owner: "w".into(),
                request_id: Some("r-2".into()),
                limit: 1,
                lock_delay_ms: 0,
                session: None,
                mode: "exclusive".into(),
            }),
            Request::ReleaseAll(ReleaseAllRequest {
                grants: vec![ReleaseRequest {
                    name: "a".into(),
                    owner_token: "t".into(),
                }],
            }),
            Request::Downgrade(DowngradeRequest {
                name: "a".into(),
                owner_token: "t".into(),
            }),
            Request::Campaign(CampaignRequest {
                name: "e".into(),
                value: "host:1".into(),
                ttl_ms: Some(1_000),
                wait_ms: 5,
                owner: "w".into(),
                request_id: None,
                session: None,
            }),
            Request::Proclaim(ProclaimRequest {
                name: "e".into(),
                owner_token: "t".into(),
                value: "host:2".into(),
            }),
            Request::Leader(LeaderRequest { name: "e".into() }),
            Request::Renew(RenewRequest {
                name: "a".into(),
                owner_token: "t".into(),
                ttl_ms: None,
            }),
            Request::Release(ReleaseRequest {
                name: "a".into(),
                owner_token: "t".into(),
            }),
            Request::Cancel,
            Request::Ping,
        ];
        for (i, request) in requests.iter().enumerate() {
            let mut out = Vec::new();
            encode_request(&mut out, u64::MAX - i as u64, request);
            let (id, back) = decode_request(one_frame(&out)).unwrap();
            assert_eq!(id, u64::MAX - i as u64);
            assert_eq!(&back, request);
        }
    }

    #[test]
    fn responses_round_trip() {
        let responses = [
            Response::Welcome,
            Response::Grant(Grant {
                name: "a".into(),
                fence: 42,
                owner_token: "t".into(),
                ttl_ms: 1000,
                session: Some("s".into()),
                mode: "shared".into(),
            }),
            Response::GrantedAll(AcquireAllResponse { grants: vec![] }),
            Response::ReleasedAll(ReleaseAllResponse {
                released: vec![true, false],
            }),
            Response::Leader(LeaderResponse {
                leader: Some(crate::Leader {
                    name: "e".into(),
                    value: "host:2".into(),
                    term: 9,
                    owner: "w".into(),
                }),
            }),
            Response::Renewed(RenewResponse {
                name: "a".into(),
                fence: 42,
                ttl_ms: 1000,
            }),
            Response::Released(ReleaseResponse {
                released: true,
                reason: String::new(),
            }),
            Response::Pong,
            Response::Error(WireError {
                code: "held".into(),
                message: "held by someone".into(),
                leader: String::new(),
            }),
            Response::Error(WireError {
                code: "not_leader".into(),
                message: "not the leader".into(),
                leader: "http://127.0.0.1:7421".into(),
            }),
        ];
        for (i, response) in responses.iter().enumerate() {
            let mut out = Vec::new();
            encode_response(&mut out, i as u64, response);
            let (id, back) = decode_response(one_frame(&out)).unwrap();
            assert_eq!(id, i as u64);
            assert_eq!(&back, response);
        }
    }

    /// `WireError` as clients before the `leader` field knew it.
    #[derive(Clone, PartialEq, Message)]
    struct OldWireError {
        #[prost(string, tag = "1")]
        code: String,
        #[prost(string, tag = "2")]
        message: String,
    }

    #[test]
    fn error_leader_field_is_compatible_both_ways() {
        let new = WireError {
            code: "not_leader".into(),
            message: "m".into(),
            leader: "http://10.0.0.2:7420".into(),
        };
        // An older client decodes the code and message and skips the leader.
        let old = OldWireError::decode(new.encode_to_vec().as_slice()).unwrap();
        assert_eq!(
            (old.code.as_str(), old.message.as_str()),
            ("not_leader", "m")
        );
        // An older server's frame decodes with the leader unknown (empty).
        let from_old = WireError::decode(old.encode_to_vec().as_slice()).unwrap();
        assert_eq!(from_old.leader, "");
        assert_eq!(from_old.code, "not_leader");
    }

    #[test]
    fn frames_split_at_their_length() {
        let mut out = Vec::new();
        encode_request(&mut out, 1, &Request::Ping);
        let first = out.len();
        encode_request(&mut out, 2, &Request::Cancel);
        assert_eq!(frame_len(&out, MAX_FRAME_BYTES), Ok(Some(first)));
        assert_eq!(frame_len(&out[..first - 1], MAX_FRAME_BYTES), Ok(None));
        assert_eq!(frame_len(&out[..3], MAX_FRAME_BYTES), Ok(None));
    }

    #[test]
    fn bad_frames_are_errors_with_their_id() {
        // A length below the header, or above the limit, cannot be trusted.
        assert!(frame_len(&[3, 0, 0, 0], MAX_FRAME_BYTES).is_err());
        assert!(frame_len(&u32::MAX.to_le_bytes(), MAX_FRAME_BYTES).is_err());
        let mut big = Vec::new();
        encode_request(
            &mut big,
            1,
            &Request::Hello(Hello {
                token: "x".repeat(100),
            }),
        );
        assert!(frame_len(&big, 64).is_err());

        let mut out = Vec::new();
        encode_request(&mut out, 7, &Request::Ping);
        out[4] = 0x42;
        let err = decode_request(&out).unwrap_err();
        assert_eq!(err.id, Some(7));
        assert!(err.message.contains("unknown request op"), "{err}");

        // A message that is not protobuf of the expected type.
        let mut out = Vec::new();
        encode_request(&mut out, 9, &Request::Ping);
        out[4] = Op::Acquire as u8;
        out.extend_from_slice(&[0x0a, 0xff]);
        let body = (out.len() - 4) as u32;
        out[..4].copy_from_slice(&body.to_le_bytes());
        let err = decode_request(&out).unwrap_err();
        assert_eq!(err.id, Some(9));
        assert!(err.message.contains("malformed Acquire"), "{err}");

        // A ping with a message, a response op sent as a request.
        let mut out = Vec::new();
        encode_request(&mut out, 3, &Request::Ping);
        out.push(1);
        let body = (out.len() - 4) as u32;
        out[..4].copy_from_slice(&body.to_le_bytes());
        assert_eq!(decode_request(&out).unwrap_err().id, Some(3));
        let mut out = Vec::new();
        encode_response(&mut out, 4, &Response::Pong);
        assert_eq!(decode_request(&out).unwrap_err().id, Some(4));
        assert!(decode_request(&[1, 0, 0, 0, 6]).is_err());
    }
}
