//! The conformance suite against a Redis Cluster of three masters, plus: every key of
//! one lock lands in one hash slot (the name is the hash tag, escaped so that names
//! with braces stay distinct locks), and locks spread over the nodes.
//!
//! Partitions: the fixture's addresses are the nodes'; a client given proxies maps the
//! nodes' addresses (as `CLUSTER SLOTS` reports them) to its proxies.

use crate::raw_redis;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use fencelock::redis::redis;
use fencelock::redis::redis::cluster::ClusterClientBuilder;
use fencelock::redis::redis::cluster::NodeAddress;
use fencelock::redis::{ClusterConfig, RedisBackend, RedisOptions};
use fencelock::{AcquireSpec, BoxFuture, Error, ErrorKind, FenceGuarantee, LockBackend};
use fencelock_conformance::{step, Fixture};
use fencelock_testkit::RedisCluster;

struct Cluster {
    cluster: RedisCluster,
}

fn options() -> RedisOptions {
    let mut options = RedisOptions::default();
    options.request_timeout = Duration::from_secs(1);
    options.connect_timeout = Duration::from_secs(2);
    options
}

impl Fixture for Cluster {
    fn addrs(&self) -> Vec<SocketAddr> {
        self.cluster
            .nodes()
            .iter()
            .map(|node| SocketAddr::from(([127, 0, 0, 1], node.port())))
            .collect()
    }

    fn connect<'a>(
        &'a self,
        addrs: &'a [SocketAddr],
    ) -> BoxFuture<'a, Result<Arc<dyn LockBackend>, Error>> {
        Box::pin(async move {
            let map: HashMap<NodeAddress, NodeAddress> = self
                .addrs()
                .iter()
                .zip(addrs)
                .map(|(node, via)| {
                    (
                        NodeAddress::new("127.0.0.1", node.port()),
                        NodeAddress::new("127.0.0.1", via.port()),
                    )
                })
                .collect();
            let urls: Vec<String> = addrs.iter().map(|a| format!("redis://{a}/")).collect();
            let client = ClusterClientBuilder::new(urls.clone())
                .node_address_map(map)
                .connection_timeout(Duration::from_secs(2))
                .response_timeout(Duration::from_secs(1))
                .build()
                .expect("a cluster client");
            let wakeups = redis::Client::open(urls[0].as_str()).expect("a node url");
            let backend =
                RedisBackend::from_cluster_client(client, Some(wakeups), options()).await?;
            Ok(Arc::new(backend) as Arc<dyn LockBackend>)
        })
    }
}

async fn start() -> Cluster {
    let cluster = tokio::task::spawn_blocking(RedisCluster::start)
        .await
        .expect("start task")
        .expect("a redis cluster starts");
    Cluster { cluster }
}

fencelock_conformance::conformance_suite!(start());

/// Which node holds `key` (by asking each; the cluster has no replicas).
fn node_of(cluster: &RedisCluster, key: &str) -> Option<usize> {
    cluster.nodes().iter().position(|node| {
        raw_redis::command(node.port(), &["EXISTS", key]) == raw_redis::Value::Int(1)
    })
}

/// A lock's hash and its fence counter live on one node (one slot), different locks
/// spread over the nodes, and names that differ only around braces or `%` are
/// different locks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locks_keys_share_a_slot_and_locks_spread() {
    let cluster = start().await;
    let mut config = ClusterConfig::new(cluster.cluster.urls());
    config.options = options();
    let backend = step(RedisBackend::cluster(config))
        .await
        .expect("connect to the cluster");
    let caps = backend.capabilities();
    assert_eq!(caps.fences, FenceGuarantee::BestEffort);
    assert_eq!(caps.backend, "redis-cluster");
    let mut nodes = Vec::new();
    let names: Vec<String> = (0..12).map(|i| format!("spread-{i}")).collect();
    let tricky = ["}", "a}b", "a%7Db", "{x}", "%"];
    let mut leases = Vec::new();
    for name in names.iter().map(String::as_str).chain(tricky) {
        let lease = step(backend.acquire(&AcquireSpec::new(name, Duration::from_secs(60))))
            .await
            .unwrap_or_else(|e| panic!("acquire {name:?}: {e}"));
        let tag = name.replace('%', "%25").replace('}', "%7D");
        let lock = node_of(&cluster.cluster, &format!("fencelock:lock:{{{tag}}}"));
        let fence = node_of(&cluster.cluster, &format!("fencelock:fence:{{{tag}}}"));
        assert!(lock.is_some(), "{name:?}: no lock key");
        assert_eq!(lock, fence, "{name:?}: lock and fence on different nodes");
        nodes.push(lock);
        leases.push(lease);
    }
    nodes.sort_unstable();
    nodes.dedup();
    assert!(nodes.len() > 1, "every lock on one node: {nodes:?}");
    // A semaphore's keys share the slot too (the script would fail otherwise).
    let mut slot = AcquireSpec::new("pool", Duration::from_secs(60));
    slot.limit = 2;
    let semaphore = step(backend.acquire(&slot))
        .await
        .expect("a semaphore slot");
    leases.push(semaphore);
    for lease in &leases {
        assert!(step(backend.release(lease)).await.expect("release"));
    }

    let mut bad = ClusterConfig::new(cluster.cluster.urls());
    bad.options.key_prefix = "{app}:".to_owned();
    let e = step(RedisBackend::cluster(bad))
        .await
        .expect_err("a prefix with braces");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
}
