//! The integration tests of this crate, one module per file, linked into one test
//! binary: one link and one copy of the shared test support instead of one per file.
//! Run one file's tests with `cargo nextest run -p fencelock-conformance -E 'test(/^<file>::/)'`
//! or `cargo test -p fencelock-conformance --test it <file>::`.

#[macro_use]
mod planted_support;
#[path = "support/raw_redis.rs"]
mod raw_redis;
mod support;

mod etcd;
mod etcd_auth;
mod etcd_sessions;
mod etcd_tls;
mod fencelock_server;
mod fencelock_server_grpc;
mod mysql;
mod mysql_specific;
mod planted;
mod planted_kinds;
mod postgres;
mod postgres_advisory;
mod postgres_app_connections;
mod postgres_specific;
mod redis;
mod redis_cluster;
mod redis_sentinel;
mod redis_tls;
mod redlock;
mod zookeeper;
