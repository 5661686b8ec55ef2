//! Clients of three-member clusters.
//!
//! - [`Spread`]: etcd and ZooKeeper clients connect to any member and the member
//!   forwards writes to its leader (etcd's `clientv3` balances over its endpoints,
//!   ZooKeeper's client picks a server from its connect string), so client `i`
//!   connects to member `i % 3`: the load is spread as those clients spread it.
//! - [`FencelockClusterLocker`]: fencelock followers do not forward — they answer
//!   `not_leader` — so the client asks the members who leads (`GET /v1/cluster`),
//!   connects there, and on an error asks again and follows a new leader.

use std::time::{Duration, Instant};

use super::fencelock::{FencelockLocker, FencelockTarget};
use super::{Grant, Locker, MAX_WAIT};
use crate::cluster;

/// Client `i` of `L` on member `i % n`: `Config` is one `L::Config` per member.
pub struct Spread<L>(L);

impl<L: Locker> Locker for Spread<L> {
    type Config = Vec<L::Config>;

    async fn connect(members: &Vec<L::Config>, client: usize) -> anyhow::Result<Self> {
        anyhow::ensure!(!members.is_empty(), "a cluster without members");
        let member = &members[client % members.len()];
        Ok(Spread(L::connect(member, client).await?))
    }

    async fn acquire(&mut self, key: &str) -> anyhow::Result<Grant> {
        self.0.acquire(key).await
    }

    async fn release(&mut self) -> anyhow::Result<()> {
        self.0.release().await
    }
}

/// How often a client looks for a leader again after an error before it gives up.
const MAX_FOLLOWS: usize = 3;

/// How often the members are asked while none knows a leader.
const DISCOVERY_PAUSE: Duration = Duration::from_millis(10);

/// The leader's client URL as some member reports it, asking members in turn
/// (starting at `first`) until one knows, until `deadline`.
pub async fn find_leader(
    urls: &[String],
    first: usize,
    deadline: Instant,
) -> anyhow::Result<String> {
    anyhow::ensure!(!urls.is_empty(), "a cluster without members");
    let ports: Vec<u16> = urls
        .iter()
        .map(|u| {
            u.rsplit(':')
                .next()
                .and_then(|p| p.trim_end_matches('/').parse().ok())
                .ok_or_else(|| anyhow::anyhow!("no port in member URL {u}"))
        })
        .collect::<anyhow::Result<_>>()?;
    loop {
        for k in 0..ports.len() {
            let port = ports[(first + k) % ports.len()];
            let status = cluster::fencelock_status(port).await;
            if let Some(url) = status.as_ref().and_then(|s| s["leader"]["url"].as_str()) {
                return Ok(url.to_owned());
            }
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "no member of {urls:?} knew a leader in time"
        );
        tokio::time::sleep(DISCOVERY_PAUSE).await;
    }
}

/// A fencelock client (the client library over the wire protocol) connected to the
/// cluster's leader, following it when it changes.
pub struct FencelockClusterLocker {
    urls: Vec<String>,
    client: usize,
    leader: String,
    inner: FencelockLocker,
}

impl FencelockClusterLocker {
    /// Finds the leader and connects to it, retrying (a reported leader may just have
    /// died) until `deadline`.
    async fn connect_leader(
        urls: &[String],
        client: usize,
        deadline: Instant,
    ) -> anyhow::Result<(String, FencelockLocker)> {
        loop {
            let leader = find_leader(urls, client, deadline).await?;
            let target = FencelockTarget {
                url: leader.clone(),
                transport: fencelock::Transport::Wire,
            };
            match FencelockLocker::connect(&target, client).await {
                Ok(inner) => return Ok((leader, inner)),
                Err(e) if Instant::now() >= deadline => {
                    return Err(e.context(format!("connect to the leader {leader}")))
                }
                Err(_) => tokio::time::sleep(DISCOVERY_PAUSE).await,
            }
        }
    }

    /// The leader this client talks to now.
    pub fn leader(&self) -> &str {
        &self.leader
    }
}

impl Locker for FencelockClusterLocker {
    /// Every member's client URL.
    type Config = Vec<String>;

    async fn connect(urls: &Vec<String>, client: usize) -> anyhow::Result<Self> {
        let (leader, inner) = Self::connect_leader(urls, client, Instant::now() + MAX_WAIT).await?;
        Ok(FencelockClusterLocker {
            urls: urls.clone(),
            client,
            leader,
            inner,
        })
    }

    async fn acquire(&mut self, key: &str) -> anyhow::Result<Grant> {
        let mut follows = 0;
        loop {
            let error = match self.inner.acquire(key).await {
                Ok(grant) => return Ok(grant),
                Err(e) => e,
            };
            // A follower's `not_leader` (or a leader gone): ask who leads now, and
            // follow if that is someone else; the same leader's error stands.
            follows += 1;
            let deadline = Instant::now() + MAX_WAIT;
            let leader = find_leader(&self.urls, self.client, deadline).await?;
            if follows > MAX_FOLLOWS || leader == self.leader {
                return Err(error);
            }
            let (leader, inner) = Self::connect_leader(&self.urls, self.client, deadline).await?;
            self.leader = leader;
            self.inner = inner;
        }
    }

    async fn release(&mut self) -> anyhow::Result<()> {
        self.inner.release().await
    }
}
