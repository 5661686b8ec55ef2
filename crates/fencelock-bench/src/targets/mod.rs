//! One client of each lock service, behind [`Locker`]: acquire (waiting as long as
//! it takes, the way that service's users wait), then release.

use std::future::Future;
use std::time::Duration;

pub mod cluster;
pub mod etcd;
pub mod fencelock;
pub mod mysql;
pub mod pg;
pub mod redis;
pub mod zk;

/// Lease length every target asks for. Holds in the workloads are short, so no lease
/// should ever expire during a run.
pub const TTL: Duration = Duration::from_secs(10);

/// How long one acquire may wait before it counts as an error.
pub const MAX_WAIT: Duration = Duration::from_secs(30);

/// Polling targets (Redis, the PostgreSQL table) retry a busy lock after this, plus
/// up to as much again of jitter.
pub const POLL_INTERVAL: Duration = Duration::from_millis(1);

/// A grant as the workload sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// The fencing token, for targets that hand one out.
    pub fence: Option<u64>,
}

/// One client's connection to a lock service. A locker holds at most one lock.
pub trait Locker: Send + Sized + 'static {
    /// What `connect` needs (shared by all clients of a run).
    type Config: Send + Sync + 'static;

    /// Opens client number `client`'s own connection (and session or lease).
    fn connect(
        config: &Self::Config,
        client: usize,
    ) -> impl Future<Output = anyhow::Result<Self>> + Send;

    /// Takes `key`, waiting until it is free.
    fn acquire(&mut self, key: &str) -> impl Future<Output = anyhow::Result<Grant>> + Send;

    /// Releases the lock taken by the last `acquire`.
    fn release(&mut self) -> impl Future<Output = anyhow::Result<()>> + Send;
}

/// A random-enough owner token: unique per client and acquire.
pub(crate) fn token(client: usize, n: u64) -> String {
    format!("{:08x}-{client}-{n}", std::process::id())
}

/// Sleeps [`POLL_INTERVAL`] plus jitter (so polling clients do not run in lockstep).
pub(crate) async fn poll_pause(seed: &mut u64) {
    // xorshift: no rand crate needed for jitter.
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    let jitter_us = *seed % (POLL_INTERVAL.as_micros() as u64 + 1);
    tokio::time::sleep(POLL_INTERVAL + Duration::from_micros(jitter_us)).await;
}
