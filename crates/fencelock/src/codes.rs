//! The server's stable error codes (in gRPC status metadata and `flw/1` error
//! frames) as the client's [`Error`]s: shared by the gRPC calls (`server`) and the
//! wire client (`wire`), which both depend on this module and not on each other.

use tonic::{Code, Status};

use crate::{Error, ErrorKind};

/// The code of a cluster member that is not the leader.
pub(crate) const NOT_LEADER: &str = "not_leader";

/// The [`Error`] of a `flw/1` error frame.
pub(crate) fn error_from_wire(e: fencelock_proto::wire::WireError) -> Error {
    if e.code == NOT_LEADER {
        return Error::not_leader(e.message, Some(e.leader));
    }
    Error::new(kind_from_code(&e.code), e.message)
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
        "unavailable" | "cancelled" | "not_leader" => ErrorKind::Unavailable,
        "internal" => ErrorKind::Internal,
        "watch_compacted" => ErrorKind::WatchCompacted,
        _ => ErrorKind::Protocol,
    }
}

/// Maps a gRPC status to an [`Error`], by the server's stable error code when the
/// status carries one, else by the gRPC code (a status without a code did not come
/// from the fencelock server's handlers: transport failures, timeouts of this client).
pub(crate) fn error_from_status(status: Status) -> Error {
    let message = status.message().to_owned();
    if fencelock_proto::error_code(&status) == Some(NOT_LEADER) {
        let leader = fencelock_proto::leader_url(&status).map(str::to_owned);
        return Error::not_leader(message, leader);
    }
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

#[cfg(test)]
mod tests {
    use tonic::metadata::MetadataValue;

    use super::*;

    #[test]
    fn not_leader_answers_become_transient_errors_naming_the_leader() {
        let mut status = Status::new(Code::Unavailable, "not the leader");
        status.metadata_mut().insert(
            fencelock_proto::ERROR_CODE_METADATA,
            MetadataValue::from_static("not_leader"),
        );
        status.metadata_mut().insert(
            fencelock_proto::LEADER_METADATA,
            MetadataValue::from_static("http://127.0.0.1:7421"),
        );
        let e = error_from_status(status);
        assert_eq!(e.kind(), ErrorKind::Unavailable);
        assert!(e.is_transient() && e.is_not_leader());
        assert_eq!(e.leader(), Some("http://127.0.0.1:7421"));

        let frame = fencelock_proto::wire::WireError {
            code: "not_leader".into(),
            message: "m".into(),
            leader: String::new(),
        };
        let e = error_from_wire(frame);
        assert!(e.is_not_leader() && e.is_transient());
        assert_eq!(e.leader(), None, "an empty leader is unknown");

        // Other codes are not redirects, even UNAVAILABLE.
        let e = error_from_wire(fencelock_proto::wire::WireError {
            code: "unavailable".into(),
            message: "stopping".into(),
            leader: "http://ignored".into(),
        });
        assert!(!e.is_not_leader());
        assert_eq!(e.leader(), None);
        assert_eq!(e.kind(), ErrorKind::Unavailable);
    }
}
