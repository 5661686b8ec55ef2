//! # fencelock-bench
//!
//! Benchmarks fencelock side by side with etcd, ZooKeeper, Redis and PostgreSQL on the
//! same machine, in one run, and checks every peer's safety while it runs. The binary
//! (`src/main.rs`) starts each peer from its Debian package in a temporary directory
//! ([`peers`]), drives the workloads ([`workload`] for W1–W3, [`fleet`] for W4–W5)
//! through one client per target ([`targets`]), feeds every grant to the online
//! [`checker`], and writes one JSON line per run plus the tables and the chart of
//! `BENCHMARKS.md` ([`report`]). Three-member clusters ([`cluster`]) are measured with
//! W1–W3 and with leader kills ([`failover`]). Issue 22's kinds: W6 read-mostly
//! ([`read_mostly`], checked by [`checker::RwChecker`]) and the election failover of
//! candidate processes ([`election`]).

#![deny(missing_docs)]

pub mod checker;
pub mod cluster;
pub mod election;
pub mod failover;
pub mod fleet;
pub mod peers;
pub mod read_mostly;
pub mod report;
pub mod targets;
pub mod workload;
