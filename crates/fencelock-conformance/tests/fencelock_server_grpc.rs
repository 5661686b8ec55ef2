//! The conformance suite against the fencelock server, with the client on gRPC for
//! every call (`Transport::Grpc`) instead of the wire protocol.

use crate::support;

fencelock_conformance::conformance_suite!(support::start_with(fencelock::Transport::Grpc));
