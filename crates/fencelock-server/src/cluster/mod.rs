//! Cluster mode: the engine's commands replicated with Raft (openraft).
//!
//! A member runs the same engine as a single server, but a client's command is not
//! applied when it arrives: the leader stamps it (its service time, the actor) and
//! proposes it; every member applies it once it is committed (written and
//! fdatasynced on a majority), in log order, and the member that proposed it answers
//! its client from that apply. So the state, fences included, is one state machine
//! replicated everywhere, and an answer never reports a change a failover could
//! undo.
//!
//! - [`log_store`]: the Raft log on `fencelock-log` (group commit).
//! - [`state_machine`]: openraft's state machine, a bridge to the engine task, which
//!   owns the core; snapshots are the core's image.
//! - [`network`]: peer RPCs over HTTP/2 on the peer port, authenticated with the
//!   cluster secret and/or mutual TLS, refused when the sender's core configuration
//!   differs.
//! - `append_stream`: pipelined replication, one HTTP/2 stream per follower.
//! - `listener`: the peer port's accept loop: TLS, connection admission, timeouts.
//! - [`import`]: a single server's data directory becomes the first member.
//! - [`watchdog`]: a follower whose leader went silent probes the leader's peer
//!   port and, when the process is gone, campaigns as soon as the voters allow.

pub mod api;
mod append_stream;
pub mod import;
pub(crate) mod listener;
pub mod log_store;
pub mod network;
pub mod state_machine;
pub mod watchdog;

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::startup::ConfigError;

/// One proposal: a command record (the single-node log's record encoding, with its
/// service time and actor) and which request on which member it answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Proposal {
    /// The member that proposed it (and answers its client).
    pub origin: u64,
    /// A number drawn when the proposer started: answers go only to requests of
    /// this run of the member (request numbers restart with it).
    pub incarnation: u64,
    /// The proposer's request number.
    pub seq: u64,
    /// `codec::encode_record` of the command.
    pub record: Vec<u8>,
}

impl fmt::Display for Proposal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "proposal {}#{} ({} bytes)",
            self.origin,
            self.seq,
            self.record.len()
        )
    }
}

/// A member as the cluster records it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// `host:port` of its peer listener.
    pub peer_addr: String,
    /// The URL clients should use for it.
    pub url: String,
}

impl fmt::Display for Member {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (peer {})", self.url, self.peer_addr)
    }
}

openraft::declare_raft_types!(
    /// The Raft types of a fencelock cluster.
    pub TypeConfig:
        D = Proposal,
        R = (),
        NodeId = u64,
        Node = Member,
);

/// A Raft log entry.
pub type Entry = openraft::alias::EntryOf<TypeConfig>;
/// A Raft log id.
pub type LogId = openraft::alias::LogIdOf<TypeConfig>;
/// A Raft vote.
pub type Vote = openraft::alias::VoteOf<TypeConfig>;
/// The Raft handle.
pub type Raft = openraft::Raft<TypeConfig, state_machine::StateMachine>;
/// The membership as applied.
pub type StoredMembership = openraft::alias::StoredMembershipOf<TypeConfig>;
/// A snapshot's metadata.
pub type SnapshotMeta = openraft::alias::SnapshotMetaOf<TypeConfig>;

/// The least heartbeat interval.
pub const MIN_HEARTBEAT: Duration = Duration::from_millis(20);

/// How a member joins and talks to its cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterConfig {
    /// This member's id (≥ 1).
    pub node_id: u64,
    /// Where this member listens for its peers.
    pub peer_listen: SocketAddr,
    /// The initial members: id → peer address. A fresh cluster forms from them.
    /// Ignored with `join`.
    pub peers: BTreeMap<u64, SocketAddr>,
    /// Start empty and wait to be added to an existing cluster (`fencelock cluster
    /// add`) instead of forming one from `peers`. A member that forms a cluster
    /// writes the first membership entry; a joining one must not, or its first
    /// entry would differ from the cluster's under the same log id.
    pub join: bool,
    /// The URL clients should use for this member.
    pub advertise_url: String,
    /// Shared secret every peer request carries; `None` and no `tls`: peer traffic
    /// is not authenticated (loopback only, unless `insecure`).
    pub secret: Option<String>,
    /// Mutual TLS on the peer port: the peer listener speaks TLS and requires a
    /// client certificate from the CA, and peers are dialed with TLS. Every member
    /// of a cluster must use the same mode. May be combined with `secret`.
    pub tls: Option<crate::tls::PeerTlsConfig>,
    /// Raft heartbeat interval (see [`ClusterConfig::election_timeout`]).
    pub heartbeat: Duration,
    /// Where to dial some members instead of their recorded peer address (id →
    /// address): for fault-injection proxies between members, or address
    /// translation. Empty: dial what the membership records.
    pub dial: BTreeMap<u64, SocketAddr>,
    /// Run the dead-leader watchdog ([`watchdog`]): a follower whose leader has been
    /// silent for two heartbeats connects to the leader's peer port, and if the
    /// connection is refused (the process is gone) campaigns as soon as the voters'
    /// leader leases run out rather than a random election timeout later. Off: Raft's
    /// timing alone (for networks that answer a partition with refused connections).
    pub leader_probe: bool,
}

impl ClusterConfig {
    /// The election timeout range: between 5 and 10 heartbeats.
    pub fn election_timeout(&self) -> (Duration, Duration) {
        (self.heartbeat * 5, self.heartbeat * 10)
    }

    /// The least lease (and session TTL) a cluster accepts: three of the longest
    /// election timeouts, so that a holder renewing at a third of its TTL can reach
    /// the next leader before its own conservative deadline passes.
    pub fn min_ttl(&self) -> Duration {
        self.election_timeout().1 * 3
    }

    /// Checks the settings (not the network).
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.node_id == 0 {
            return Err(ConfigError::invalid("--node-id must be at least 1"));
        }
        if !self.join && !self.peers.contains_key(&self.node_id) {
            return Err(ConfigError::invalid(format!(
                "--peers must list this member ({}) with its peer address",
                self.node_id
            )));
        }
        if self.heartbeat < MIN_HEARTBEAT {
            return Err(ConfigError::invalid(format!(
                "the heartbeat must be at least {} ms",
                MIN_HEARTBEAT.as_millis()
            )));
        }
        if let Some(secret) = &self.secret {
            if secret.len() < 16 {
                return Err(ConfigError::invalid(
                    "the cluster secret must be at least 16 characters",
                ));
            }
        }
        Ok(())
    }

    /// openraft's settings for these timings.
    pub(crate) fn raft_config(&self) -> openraft::Config {
        let (min, max) = self.election_timeout();
        openraft::Config {
            cluster_name: "fencelock".into(),
            heartbeat_interval: self.heartbeat.as_millis() as u64,
            election_timeout_min: min.as_millis() as u64,
            election_timeout_max: max.as_millis() as u64,
            enable_pre_vote: Some(true),
            // Standard Raft: a restarted leader holds a new election. Restoring its
            // old term would let it reuse log ids it had already sent (but not
            // written) before it stopped, under which followers keep other entries.
            enable_leader_restore: Some(false),
            snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(20_000),
            max_in_snapshot_log_to_keep: 2_000,
            ..openraft::Config::default()
        }
    }
}

/// The hex SHA-256 of the core configuration, sent with every peer request:
/// members refuse peers whose configuration differs (they would decide the same
/// command differently).
pub fn config_fingerprint(config: &fencelock_core::Config) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, format!("{config:?}").as_bytes());
    digest.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// The leader as this member knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderInfo {
    /// Its id.
    pub id: u64,
    /// Its client URL.
    pub url: String,
}

/// Client URLs of the members, learnt from peer traffic: every peer request and
/// answer names its sender's id and advertised URL. Members formed from `--peers`
/// know only each other's peer addresses until they hear from each other.
#[derive(Debug, Default)]
pub struct Directory {
    urls: std::sync::Mutex<BTreeMap<u64, String>>,
}

impl Directory {
    /// Records what member `id` says its URL is.
    pub fn learn(&self, id: u64, url: &str) {
        let mut urls = self.urls.lock().unwrap_or_else(|e| e.into_inner());
        if urls.get(&id).map(String::as_str) != Some(url) {
            urls.insert(id, url.to_owned());
        }
    }

    /// Member `id`'s URL, if heard of.
    pub fn url(&self, id: u64) -> Option<String> {
        let urls = self.urls.lock().unwrap_or_else(|e| e.into_inner());
        urls.get(&id).cloned()
    }
}

/// When this member last accepted replication from a leader (an AppendEntries,
/// heartbeats included, that openraft did not refuse for a higher vote). openraft
/// reports no such time for a follower, and a follower whose leader is gone keeps
/// naming it (Pre-Vote keeps its term), so readiness and the dead-leader watchdog
/// need this to tell a follower cut off from its leader from a healthy one.
/// Recorded by the peer listener (by the simulated network in the simulation),
/// after openraft handled the message, so never before openraft's own record of
/// it. On tokio's clock, so the simulation's virtual time applies.
///
/// Also when this member last refused a (pre-)vote because the candidate's log was
/// behind its own: the watchdog then campaigns without waiting its turn, since the
/// member that asked cannot win without it.
#[derive(Debug, Default)]
pub struct LeaderContact {
    last: std::sync::Mutex<Option<tokio::time::Instant>>,
    outranked: std::sync::Mutex<Option<tokio::time::Instant>>,
    wake: tokio::sync::Notify,
}

impl LeaderContact {
    /// Records a contact now.
    pub fn record(&self) {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        *last = Some(tokio::time::Instant::now());
    }

    /// When the last contact was; `None` if never.
    pub fn last(&self) -> Option<tokio::time::Instant> {
        *self.last.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How long ago the last contact was; `None` if never.
    pub fn since(&self) -> Option<Duration> {
        self.last().map(|at| at.elapsed())
    }

    /// Records the answer to a (pre-)vote request that asked with `asked` (the
    /// candidate's last log id): a refusal because this member's log is longer
    /// is noted, and wakes the watchdog.
    pub fn record_vote_answer(
        &self,
        asked: Option<&LogId>,
        answer: &openraft::raft::VoteResponse<TypeConfig>,
    ) {
        if !answer.vote_granted && answer.last_log_id.as_ref() > asked {
            let mut outranked = self.outranked.lock().unwrap_or_else(|e| e.into_inner());
            *outranked = Some(tokio::time::Instant::now());
            drop(outranked);
            self.wake.notify_one();
        }
    }

    /// When this member last refused a candidate whose log was behind its own.
    pub fn outranked(&self) -> Option<tokio::time::Instant> {
        *self.outranked.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Resolves after the next [`LeaderContact::record_vote_answer`] that noted a
    /// refusal (or at once if one came since the last call).
    pub async fn outranked_changed(&self) {
        self.wake.notified().await;
    }
}

/// Why a member is not ready to serve (`/readyz`; see
/// [`ClusterShared::readiness`](crate::engine::ClusterShared::readiness)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum NotReadyKind {
    /// The member is not in the cluster's membership.
    NotMember,
    /// The member is a learner, still catching up.
    Learner,
    /// No leader is known.
    NoLeader,
    /// This member leads, but no quorum confirmed it within the lease.
    Unconfirmed,
    /// The leader was not heard from within the lease.
    LeaderSilent,
    /// The member applied too few of the committed entries.
    Lagging,
}

/// A member is not ready to serve, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotReady {
    kind: NotReadyKind,
    message: String,
}

impl NotReady {
    pub(crate) fn new(kind: NotReadyKind, message: impl Into<String>) -> NotReady {
        NotReady {
            kind,
            message: message.into(),
        }
    }

    /// The reason's category.
    pub fn kind(&self) -> NotReadyKind {
        self.kind
    }
}

impl fmt::Display for NotReady {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for NotReady {}
