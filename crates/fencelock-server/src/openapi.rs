//! The OpenAPI 3.1 document of the HTTP API, served at `GET /v1/openapi.json`.
//!
//! It is derived from the handlers themselves: each handler's `#[utoipa::path]`
//! names its route, and its request and answer types (the very structs the handler
//! parses and serializes) derive their schemas, so a field added to an answer is in
//! the document without anyone writing it twice. Two tests keep the rest honest
//! (`tests/openapi.rs`): every `/v1` route of the router must be in the document, and
//! real answers of every route must match the document's schemas.
//!
//! The document is served without a token, like `/healthz`: it describes only the
//! API's shape, the same for every caller, and tools (code generators, Swagger UI)
//! fetch it before they know any credentials.

use std::sync::OnceLock;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::error::{ErrorBody, ErrorDetail};

/// The path of the document.
pub const PATH: &str = "/v1/openapi.json";

/// The HTTP API's OpenAPI description (see the module docs).
#[derive(OpenApi)]
#[openapi(
    info(
        title = "fencelock HTTP/JSON API",
        description = "A distributed lock server whose every grant carries a fencing token. \
Pass `fence` to the resource and have it refuse any write whose fence is not newer than \
the last it accepted. With tokens configured, every route but `/healthz`, `/readyz` and \
this document needs `Authorization: Bearer <token>`; with authentication off, bodies \
must be sent with `Content-Type: application/json`. Request bodies are JSON objects: \
an unknown field, a field of the wrong type or malformed JSON is 400 `invalid_json`; \
a missing required field, or a value out of range, is 400 `invalid_argument` naming \
the field. Answers may gain fields; none is removed or changes meaning within v1.",
        license(name = "Apache-2.0", identifier = "Apache-2.0"),
    ),
    paths(
        crate::http::acquire,
        crate::http::renew,
        crate::http::release,
        crate::http::downgrade,
        crate::http::campaign,
        crate::http::proclaim,
        crate::http::resign,
        crate::http::leader,
        crate::http::list_locks,
        crate::http::show_lock,
        crate::http::open_session,
        crate::http::keep_alive,
        crate::http::close_session,
        crate::http::force_release,
        crate::http::list_sessions,
        crate::http::admin_close_session,
        crate::http::snapshot,
        crate::dashboard::audit_api,
        crate::watch_sse::watch,
        crate::cluster::api::status,
        crate::cluster::api::add_member,
        crate::cluster::api::remove_member,
        crate::cluster::api::transfer_leader,
        document,
        crate::http::healthz,
        crate::http::readyz,
        crate::http::metrics,
    ),
    components(schemas(ErrorBody, ErrorDetail, crate::watch_sse::WatchEventJson)),
    modifiers(&Security),
    tags(
        (name = "locks", description = "Take, renew, release and read locks."),
        (name = "sessions", description = "One keepalive for many locks."),
        (name = "elections", description = "Campaign, proclaim, resign, and who leads."),
        (name = "admin", description = "Forced release, sessions of others, snapshots (role `admin`)."),
        (name = "audit", description = "Who held what, when."),
        (name = "cluster", description = "Membership and leadership (404 on a single server)."),
        (name = "operations", description = "Probes, metrics and this document."),
    )
)]
pub struct ApiDoc;

/// Bearer tokens, optional: a server without tokens configured takes none.
struct Security;

impl Modify for Security {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "A token from `fencelock token new`; none when the server has no \
                         tokens configured.",
                    ))
                    .build(),
            ),
        );
        openapi.security = Some(vec![
            SecurityRequirement::new("bearer", Vec::<String>::new()),
            SecurityRequirement::default(),
        ]);
    }
}

/// The document as JSON, built once.
pub fn json() -> &'static str {
    static DOCUMENT: OnceLock<String> = OnceLock::new();
    DOCUMENT.get_or_init(|| {
        // Serializing plain maps and strings cannot fail; an empty object would
        // still be valid JSON should it ever.
        ApiDoc::openapi()
            .to_pretty_json()
            .unwrap_or_else(|_| "{}".to_owned())
    })
}

/// This document.
#[utoipa::path(get, path = "/v1/openapi.json", tag = "operations",
    responses((status = 200, description = "The OpenAPI 3.1 document.", body = Object)))]
pub(crate) async fn document() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], json()).into_response()
}
