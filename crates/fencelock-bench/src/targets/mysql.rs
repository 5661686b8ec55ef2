//! MySQL/MariaDB through `fencelock-mysql`'s table mode ([`MysqlTableLocker`]): the
//! reference material's `distributed_lock` table on InnoDB, each acquire a transaction
//! that locks the row (`SELECT … FOR UPDATE`) and draws the fence under that lock; a
//! busy lock is polled by the backend.

use std::time::Duration;

use fencelock::{AcquireSpec, Lease, LockBackend};
use fencelock_mysql::{MysqlBackend, MysqlConfig};

use super::{Grant, Locker, MAX_WAIT, TTL};

/// One client: its own backend and a pool of one connection.
pub struct MysqlTableLocker {
    backend: MysqlBackend,
    held: Option<Lease>,
}

impl Locker for MysqlTableLocker {
    /// A `mysql://user:password@host:port/database` URL.
    type Config = String;

    async fn connect(url: &String, _client: usize) -> anyhow::Result<Self> {
        let mut config = MysqlConfig::default();
        config.max_connections = 1;
        // The workloads' holds are short: poll as eagerly as the other polling targets.
        config.max_poll_interval = Duration::from_millis(2);
        let backend = MysqlBackend::connect(url, config).await?;
        Ok(MysqlTableLocker {
            backend,
            held: None,
        })
    }

    async fn acquire(&mut self, key: &str) -> anyhow::Result<Grant> {
        let mut spec = AcquireSpec::new(key, TTL);
        spec.wait = MAX_WAIT;
        let lease = self.backend.acquire(&spec).await?;
        let fence = lease.fence;
        self.held = Some(lease);
        Ok(Grant { fence: Some(fence) })
    }

    async fn release(&mut self) -> anyhow::Result<()> {
        if let Some(lease) = self.held.take() {
            anyhow::ensure!(
                self.backend.release(&lease).await?,
                "the lock was not held at release"
            );
        }
        Ok(())
    }
}
