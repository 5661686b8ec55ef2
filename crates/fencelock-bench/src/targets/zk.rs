//! ZooKeeper 3.8 with the Curator `InterProcessMutex` recipe: create an
//! ephemeral-sequential node under the lock's parent, list the children, and if ours
//! is not the lowest, watch the one just before it and wait for its deletion. Release
//! deletes our node. The fence is our node's sequence number, which orders holders.
//!
//! Spoken through the `zookeeper-client` crate (one session per client, kept alive by
//! its pings), as an application would use ZooKeeper.

use std::collections::HashSet;

use anyhow::Context;
use zookeeper_client::{Acls, Client, CreateMode};

use super::{Grant, Locker, TTL};

/// The parent of every lock's parent.
const ROOT: &str = "/fencelock-bench";

/// One ZooKeeper session.
pub struct ZkLocker {
    client: Client,
    /// The path of the node of the lock we hold or wait for.
    node: Option<String>,
    /// Lock parents known to exist.
    parents: HashSet<String>,
}

impl ZkLocker {
    async fn ensure_parent(&mut self, parent: &str) -> anyhow::Result<()> {
        if self.parents.contains(parent) {
            return Ok(());
        }
        let persistent = CreateMode::Persistent.with_acls(Acls::anyone_all());
        self.client
            .mkdir(parent, &persistent)
            .await
            .with_context(|| format!("create {parent}"))?;
        self.parents.insert(parent.to_owned());
        Ok(())
    }
}

impl Locker for ZkLocker {
    /// The loopback client port.
    type Config = u16;

    async fn connect(port: &u16, _client: usize) -> anyhow::Result<Self> {
        let client = Client::connector()
            .with_session_timeout(TTL)
            .connect(&format!("127.0.0.1:{port}"))
            .await
            .with_context(|| format!("connect to zookeeper on port {port}"))?;
        Ok(ZkLocker {
            client,
            node: None,
            parents: HashSet::new(),
        })
    }

    async fn acquire(&mut self, key: &str) -> anyhow::Result<Grant> {
        let parent = format!("{ROOT}/{}", key.replace('/', "_"));
        self.ensure_parent(&parent).await?;
        let prefix = format!("{parent}/lock-");
        let ephemeral = CreateMode::EphemeralSequential.with_acls(Acls::anyone_all());
        let (_, sequence) = self
            .client
            .create(&prefix, &[], &ephemeral)
            .await
            .context("create lock node")?;
        let mine = sequence.into_i64();
        self.node = Some(format!("{prefix}{sequence}"));
        loop {
            let children = self
                .client
                .list_children(&parent)
                .await
                .with_context(|| format!("getChildren {parent}"))?;
            let mut predecessor: Option<(i64, String)> = None;
            for child in children {
                let seq: i64 = child
                    .rsplit('-')
                    .next()
                    .unwrap_or_default()
                    .parse()
                    .with_context(|| format!("no sequence number in {child}"))?;
                if seq < mine && predecessor.as_ref().is_none_or(|(p, _)| seq > *p) {
                    predecessor = Some((seq, child));
                }
            }
            let Some((_, child)) = predecessor else {
                let fence = u64::try_from(mine).context("negative sequence number")?;
                return Ok(Grant { fence: Some(fence) });
            };
            let path = format!("{parent}/{child}");
            let (stat, watcher) = self
                .client
                .check_and_watch_stat(&path)
                .await
                .with_context(|| format!("exists {path}"))?;
            if stat.is_some() {
                // Deleted, or the session's end: either way, look again.
                watcher.changed().await;
            }
        }
    }

    async fn release(&mut self) -> anyhow::Result<()> {
        if let Some(node) = self.node.take() {
            self.client
                .delete(&node, None)
                .await
                .with_context(|| format!("delete {node}"))?;
        }
        Ok(())
    }
}
