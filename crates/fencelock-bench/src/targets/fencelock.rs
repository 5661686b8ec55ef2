//! fencelock through its own client library (`fencelock::Client`): server-side FIFO
//! waits with direct hand-off, guards with background renewal.

use fencelock::{Client, LockGuard};

use super::{Grant, Locker, MAX_WAIT, TTL};

/// A `fencelock::Client` with its own connection.
pub struct FencelockLocker {
    client: Client,
    owner: String,
    guard: Option<LockGuard>,
}

impl Locker for FencelockLocker {
    /// The server URL, e.g. `http://127.0.0.1:7420`.
    type Config = String;

    async fn connect(url: &String, client: usize) -> anyhow::Result<Self> {
        Ok(FencelockLocker {
            client: Client::connect(url).await?,
            // Lock events carry it, so the server-side FIFO audit can tell clients apart.
            owner: format!("bench-client-{client}"),
            guard: None,
        })
    }

    async fn acquire(&mut self, key: &str) -> anyhow::Result<Grant> {
        let guard = self
            .client
            .lock(key)
            .ttl(TTL)
            .wait(MAX_WAIT)
            .owner(self.owner.clone())
            .acquire()
            .await?;
        let fence = guard.fence();
        self.guard = Some(guard);
        Ok(Grant { fence: Some(fence) })
    }

    async fn release(&mut self) -> anyhow::Result<()> {
        if let Some(guard) = self.guard.take() {
            anyhow::ensure!(guard.release().await?, "the lock was gone at release");
        }
        Ok(())
    }
}
