//! The integration tests of this crate, one module per file, linked into one test
//! binary: one link and one copy of the shared test support instead of one per file.
//! Run one file's tests with `cargo nextest run -p fencelock-server -E 'test(/^<file>::/)'`
//! or `cargo test -p fencelock-server --test it <file>::`.

mod support;

mod audit;
mod audit_memory;
mod cluster;
mod dashboard_auth;
mod dashboard_browser;
mod dashboard_escaping;
mod dashboard_kinds;
mod deploy;
mod e2e_cross_origin;
mod e2e_dashboard;
mod grpc;
mod http_api;
mod kinds_grpc;
mod kinds_http;
mod kinds_recovery;
mod kinds_wire;
mod openapi;
mod raft_storage;
mod recovery;
mod reflection;
mod security;
mod startup_errors;
mod tenants;
mod vocab;
mod watch_sse;
mod wire;
