//! The fencelock gRPC API, `fencelock.v1.Locks` (see `proto/fencelock/v1/locks.proto`):
//! the messages, the client ([`locks_client::LocksClient`]) and the server trait
//! ([`locks_server::Locks`]), generated at build time by `protox` and
//! `tonic-prost-build` (no system `protoc`).
//!
//! Both the server (`fencelock-server`) and the client library (`fencelock`) use this
//! crate, so the client never depends on the server.
//!
//! **API boundary:** every error status the server sends carries the stable error code
//! (`held`, `not_held`, `timeout`, …) in the [`ERROR_CODE_METADATA`] entry.

#![deny(missing_docs)]

use std::marker::PhantomData;

use prost::Message;
use tonic::codec::{Codec, DecodeBuf, Decoder};
use tonic::metadata::MetadataValue;
use tonic::{Code, Status};

#[allow(missing_docs)]
mod generated {
    tonic::include_proto!("fencelock.v1");
}
pub use generated::*;

mod sink;
pub mod vocab;
pub mod wire;

/// The encoded `FileDescriptorSet` of `fencelock.v1` (and what it imports), with
/// source info: what the server's gRPC reflection serves.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/fencelock_descriptor.bin"));

/// Metadata entry of every error status that holds the stable error code
/// (`held`, `not_held`, `timeout`, …).
pub const ERROR_CODE_METADATA: &str = "fencelock-error-code";
/// Metadata entry of a `not_leader` status (UNAVAILABLE) from a cluster member that
/// knows the leader: the leader's URL (`http://host:port`). Absent when unknown.
pub const LEADER_METADATA: &str = "x-fencelock-leader";
/// Metadata entry of a `Watch` that ended with DATA_LOSS: how many events it missed.
pub const MISSED_EVENTS_METADATA: &str = "fencelock-missed-events";

/// Response metadata of `Watch`: the position (`index.ordinal`) the stream starts
/// after, so that a client that saw no event yet can still resume without a gap.
pub const WATCH_START_METADATA: &str = "fencelock-watch-after";
/// The error code of a malformed message.
pub const INVALID_ARGUMENT_CODE: &str = "invalid_argument";

/// The stable error code of a status (from [`ERROR_CODE_METADATA`]), if it has one.
pub fn error_code(status: &Status) -> Option<&str> {
    status
        .metadata()
        .get(ERROR_CODE_METADATA)
        .and_then(|v| v.to_str().ok())
}

/// The leader's URL of a `not_leader` status (from [`LEADER_METADATA`]), if it names one.
pub fn leader_url(status: &Status) -> Option<&str> {
    status
        .metadata()
        .get(LEADER_METADATA)
        .and_then(|v| v.to_str().ok())
        .filter(|url| !url.is_empty())
}

/// Prost's encoding, but a message that does not decode is the sender's mistake
/// (INVALID_ARGUMENT with code `invalid_argument`), not prost's INTERNAL. The
/// generated code uses it (see `build.rs`).
#[derive(Debug, Clone)]
pub struct ProtoCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for ProtoCodec<T, U> {
    fn default() -> Self {
        ProtoCodec(PhantomData)
    }
}

impl<T, U> Codec for ProtoCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = tonic_prost::ProstEncoder<T>;
    type Decoder = ProtoDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        tonic_prost::ProstEncoder::default()
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProtoDecoder(PhantomData)
    }
}

/// The decoder of [`ProtoCodec`].
#[derive(Debug)]
pub struct ProtoDecoder<U>(PhantomData<U>);

impl<U: Message + Default> Decoder for ProtoDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        U::decode(src).map(Some).map_err(|e| {
            let mut status = Status::new(
                Code::InvalidArgument,
                format!("malformed protobuf message: {e}"),
            );
            status.metadata_mut().insert(
                ERROR_CODE_METADATA,
                MetadataValue::from_static(INVALID_ARGUMENT_CODE),
            );
            status
        })
    }
}
