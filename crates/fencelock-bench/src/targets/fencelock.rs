//! fencelock through its own client library (`fencelock::Client`, over the wire
//! protocol or over gRPC): server-side FIFO waits with direct hand-off, guards with
//! background renewal.

use fencelock::{Client, LockGuard, ServerConfig, Transport};

use super::{Grant, Locker, MAX_WAIT, TTL};

/// A `fencelock::Client` with its own connection.
pub struct FencelockLocker {
    client: Client,
    owner: String,
    guard: Option<LockGuard>,
}

/// Where and how a [`FencelockLocker`] connects.
#[derive(Debug, Clone)]
pub struct FencelockTarget {
    /// The server URL, e.g. `http://127.0.0.1:7420`.
    pub url: String,
    /// The client's transport for acquire/renew/release (the library's default is
    /// the wire protocol; gRPC shows what the transport is worth).
    pub transport: Transport,
}

impl Locker for FencelockLocker {
    type Config = FencelockTarget;

    async fn connect(target: &FencelockTarget, client: usize) -> anyhow::Result<Self> {
        let mut config = ServerConfig::new(target.url.clone());
        config.transport = target.transport;
        Ok(FencelockLocker {
            client: Client::connect_with(config).await?,
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

/// fencelock over its raw gRPC API, without the client library's guard (no renewal
/// task, no lost-lock signal): shows what the library costs per acquire.
pub struct FencelockGrpcLocker {
    client: fencelock_proto::locks_client::LocksClient<tonic::transport::Channel>,
    owner: String,
    id: usize,
    n: u64,
    held: Option<(String, String)>,
}

impl Locker for FencelockGrpcLocker {
    /// The server URL, e.g. `http://127.0.0.1:7420`.
    type Config = String;

    async fn connect(url: &String, client: usize) -> anyhow::Result<Self> {
        let channel = tonic::transport::Endpoint::from_shared(url.clone())?
            .tcp_nodelay(true)
            .connect()
            .await?;
        Ok(FencelockGrpcLocker {
            client: fencelock_proto::locks_client::LocksClient::new(channel),
            owner: format!("bench-client-{client}"),
            id: client,
            n: 0,
            held: None,
        })
    }

    async fn acquire(&mut self, key: &str) -> anyhow::Result<Grant> {
        self.n += 1;
        let grant = self
            .client
            .acquire(fencelock_proto::AcquireRequest {
                name: key.to_owned(),
                ttl_ms: Some(TTL.as_millis() as u64),
                wait_ms: MAX_WAIT.as_millis() as u64,
                owner: self.owner.clone(),
                // Unique per client: the server scopes request ids to the lock name,
                // so two clients sharing one would be handed the same grant (the
                // checker caught exactly that in a first version).
                request_id: Some(super::token(self.id, self.n)),
                limit: 1,
                ..Default::default()
            })
            .await?
            .into_inner();
        self.held = Some((grant.name, grant.owner_token));
        Ok(Grant {
            fence: Some(grant.fence),
        })
    }

    async fn release(&mut self) -> anyhow::Result<()> {
        if let Some((name, owner_token)) = self.held.take() {
            let released = self
                .client
                .release(fencelock_proto::ReleaseRequest { name, owner_token })
                .await?
                .into_inner()
                .released;
            anyhow::ensure!(released, "the lock was gone at release");
        }
        Ok(())
    }
}
