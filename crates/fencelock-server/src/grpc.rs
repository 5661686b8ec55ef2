//! gRPC API (placeholder until the proto lands).

use crate::engine::Handle;

/// Adds the gRPC service's routes to `router`.
pub fn add_routes(router: axum::Router, _handle: Handle) -> axum::Router {
    router
}
