//! etcd v3.4 through its own lock API: one lease per client (granted at connect and
//! kept alive on a `LeaseKeepAlive` stream), `v3lockpb.Lock` (which waits server-side
//! for the earlier keys under the name to go), `Unlock` to release.
//!
//! Fence: the revision in the `Lock` answer's header. The lock is granted at the
//! revision that created our key or deleted the previous holder's key, and the next
//! holder is granted at a later revision, so it increases per lock name.

use std::time::Duration;

use tokio::task::JoinHandle;
use tonic::transport::{Channel, Endpoint};

use super::{Grant, Locker, TTL};

/// The vendored etcd messages and clients (`crates/fencelock/proto/etcd/etcd.proto`
/// and `proto/etcd/v3lock.proto`).
#[allow(missing_docs, clippy::all)]
pub mod pb {
    /// `etcdserverpb`: leases.
    pub mod etcdserverpb {
        tonic::include_proto!("etcdserverpb");
    }
    /// `v3lockpb`: the lock service.
    pub mod v3lockpb {
        tonic::include_proto!("v3lockpb");
    }
}

use pb::etcdserverpb::lease_client::LeaseClient;
use pb::etcdserverpb::{LeaseGrantRequest, LeaseKeepAliveRequest};
use pb::v3lockpb::lock_client::LockClient;
use pb::v3lockpb::{LockRequest, UnlockRequest};

/// One etcd client: a connection, a lease and its keep-alive task.
pub struct EtcdLocker {
    locks: LockClient<Channel>,
    lease: i64,
    key: Option<Vec<u8>>,
    keepalive: JoinHandle<()>,
}

impl Drop for EtcdLocker {
    fn drop(&mut self) {
        self.keepalive.abort();
    }
}

impl Locker for EtcdLocker {
    /// The client URL, e.g. `http://127.0.0.1:2379`.
    type Config = String;

    async fn connect(url: &String, _client: usize) -> anyhow::Result<Self> {
        let channel = Endpoint::from_shared(url.clone())?.connect().await?;
        let mut leases = LeaseClient::new(channel.clone());
        let lease = leases
            .lease_grant(LeaseGrantRequest {
                ttl: TTL.as_secs() as i64,
                id: 0,
            })
            .await?
            .into_inner()
            .id;
        let keepalive = tokio::spawn(async move {
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            let sender = tokio::spawn(async move {
                loop {
                    if tx.send(LeaseKeepAliveRequest { id: lease }).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(TTL / 3).await;
                }
            });
            let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
            if let Ok(response) = leases.lease_keep_alive(stream).await {
                let mut responses = response.into_inner();
                while let Ok(Some(_)) = responses.message().await {}
            }
            sender.abort();
        });
        Ok(EtcdLocker {
            locks: LockClient::new(channel),
            lease,
            key: None,
            keepalive,
        })
    }

    async fn acquire(&mut self, key: &str) -> anyhow::Result<Grant> {
        let mut request = tonic::Request::new(LockRequest {
            name: key.as_bytes().to_vec(),
            lease: self.lease,
        });
        request.set_timeout(super::MAX_WAIT + Duration::from_secs(1));
        let response = self.locks.lock(request).await?.into_inner();
        let revision = response
            .header
            .map(|h| h.revision)
            .ok_or_else(|| anyhow::anyhow!("etcd Lock answer without a header"))?;
        self.key = Some(response.key);
        Ok(Grant {
            fence: Some(u64::try_from(revision)?),
        })
    }

    async fn release(&mut self) -> anyhow::Result<()> {
        if let Some(key) = self.key.take() {
            self.locks.unlock(UnlockRequest { key }).await?;
        }
        Ok(())
    }
}
