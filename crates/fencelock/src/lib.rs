//! # fencelock: distributed locks with fencing tokens
//!
//! A lock alone cannot guarantee "one at a time": a holder can pause (GC, SIGSTOP, a
//! slow network) past its lease and wake up still writing. So every grant carries a
//! **fencing token** ([`LockGuard::fence`]) that only grows, and the protected resource
//! refuses writes with a fence older than one it has already seen (see the
//! `fencelock-fence` crate for ready-made checks).
//!
//! This crate takes locks, renews them in the background, and tells you — *before* the
//! store can have expired the lease — when a lock is or may be lost
//! ([`LockGuard::lost`]).
//!
//! ```no_run
//! use std::time::Duration;
//! use fencelock::{Client, LockOptions};
//!
//! # async fn demo() -> Result<(), fencelock::Error> {
//! let client = Client::connect("http://127.0.0.1:7420").await?;
//!
//! // A guard: renewed until released or dropped.
//! let guard = client.lock("job:daily-settlement").ttl(Duration::from_secs(30)).acquire().await?;
//! println!("fence {}", guard.fence());
//! guard.release().await?;
//!
//! // Or a closure that is cancelled the moment the lock is lost.
//! let total = client
//!     .with_lock("inventory:item:1234", LockOptions::default(), async |guard| {
//!         // write to the resource with `guard.fence()` ...
//!         guard.fence()
//!     })
//!     .await?;
//! # let _ = total;
//! # Ok(()) }
//! ```
//!
//! [`Client::session`] opens a [`Session`]: many locks under one keep-alive, every
//! guard lost when the session is. [`blocking`] is the same client for programs
//! without an async runtime.
//!
//! The store is a [`LockBackend`]; the fencelock server ([`FencelockBackend`]) is the
//! first one, and [`Client::capabilities`] says what a store guarantees.
//!
//! Other stores, each behind a cargo feature of the same name (see each module's docs
//! for what the store can and cannot promise):
//! - `redis`: `redis::RedisBackend` (one server, plain or TLS, through Sentinel, or a
//!   Redis Cluster; on the `redis` crate) and `redis::RedlockBackend`.
//! - `postgres`: `postgres::PostgresBackend` (a lock table with durable fences) and
//!   `postgres::PostgresAdvisoryBackend` (advisory locks, no fences).
//! - `mysql`: `mysql::MysqlBackend` (a lock table with durable fences) and
//!   `mysql::MysqlGetLockBackend` (`GET_LOCK`, no fences), on MySQL or MariaDB.
//! - `etcd`: `etcd::EtcdBackend`, etcd v3 (durable fences, FIFO, watches, semaphores,
//!   sessions).
//! - `zookeeper`: `zookeeper::ZooKeeperBackend` (durable fences, FIFO, watches,
//!   semaphores; chroot, digest auth, or the application's own ZooKeeper client);
//!   `zookeeper-tls` adds TLS.

#![deny(missing_docs)]

pub mod blocking;
mod client;
mod codes;
mod election;
mod guard;
mod route;
mod server;
mod session;
mod view;
mod wire;

/// etcd v3 (feature `etcd`): the `fencelock-etcd` crate.
#[cfg(feature = "etcd")]
pub use fencelock_etcd as etcd;
/// MySQL and MariaDB (feature `mysql`): the `fencelock-mysql` crate.
#[cfg(feature = "mysql")]
pub use fencelock_mysql as mysql;
/// PostgreSQL (feature `postgres`): the `fencelock-postgres` crate.
#[cfg(feature = "postgres")]
pub use fencelock_postgres as postgres;
/// Redis and Redlock (feature `redis`): the `fencelock-redis` crate.
#[cfg(feature = "redis")]
pub use fencelock_redis as redis;
/// ZooKeeper (feature `zookeeper`): the `fencelock-zookeeper` crate.
#[cfg(feature = "zookeeper")]
pub use fencelock_zookeeper as zookeeper;

/// The README's Rust snippets, compiled as doctests: a snippet that no longer compiles
/// fails `cargo test` (the dev-dependencies turn on the features they use).
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeSnippets;

pub use client::{Client, LockOptions, LockRequest};
pub use election::{Election, Leadership};
pub use fencelock_backend::{
    AcquireSpec, Backoff, BoxFuture, Capabilities, Error, ErrorKind, FenceGuarantee, Leader, Lease,
    LockBackend, LockMode, SessionLease, MAX_NAME_BYTES, MAX_OWNER_BYTES, MAX_REQUEST_ID_BYTES,
    MAX_TTL, MAX_VALUE_BYTES,
};
/// The event vocabulary shared with the server (names, labels, the old audit
/// names, [`vocab::human_ms`]): the same words in the audit log, watch, the dashboard,
/// metrics and the CLI.
pub use fencelock_proto::vocab;
pub use guard::{LockGuard, LostReason};
pub use server::{EventStream, FencelockBackend, ServerConfig, Transport};
pub use session::{Session, SessionRequest};
pub use view::{EventKind, HolderInfo, LockEvent, LockInfo, LockPage, WaitEnd, WatchPosition};
