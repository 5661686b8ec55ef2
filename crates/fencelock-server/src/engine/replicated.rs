//! The engine in cluster mode: the same engine task and core, but a client's
//! command is proposed to Raft rather than applied, and applied (by every member)
//! only once committed. The member that proposed it answers from that apply.
//!
//! What must happen before what lives here as data the engine task owns:
//! `pending` (proposals awaiting their apply, by proposal number), the applied log
//! id, and leadership as openraft reports it. The task applies committed entries
//! strictly in log order; nothing is answered before the entry that decides it is
//! applied, and only a leader stamps and proposes.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fencelock_core::{Command, LockName, Reply};
use openraft::async_runtime::WatchReceiver;
use openraft::entry::RaftEntry;
use openraft::error::{ClientWriteError, RaftError};
use openraft::{EntryPayload, ServerState};
use tokio::sync::{mpsc, oneshot, watch};

type MetricsRx = openraft::alias::WatchReceiverOf<TypeConfig, openraft::RaftMetrics<TypeConfig>>;

use super::history::History;
use super::typed::{self, Acquired};
use super::{
    AcquireReply, CommandReply, Delivery, EngineConfig, EngineTask, Handle, Msg, Requester,
    RunState, ServiceClock, Shared, EVENT_BUFFER,
};
use crate::audit::{self, AuditEntry, AuditStore};
use crate::cluster::import::Staged;
use crate::cluster::state_machine::SmRequest;
use crate::cluster::watchdog::{LeaderProbe, TcpProbe, Timing};
use crate::cluster::{
    Directory, LeaderContact, LeaderInfo, Proposal, Raft, StoredMembership, TypeConfig,
};
use crate::cluster::{NotReady, NotReadyKind};
use crate::codec::{self, RecordMeta, Replicated as ReplicatedRecord};
use crate::error::{ApiError, ApiErrorKind};
use crate::startup::{RecoveryError, RecoveryErrorKind, StartError};

/// Most state machine requests queued for the engine (openraft waits beyond it).
pub(crate) const SM_QUEUE: usize = 64;

/// A proposal's asker, waiting for its apply.
pub(super) enum Pending {
    Acquire {
        listener: u128,
        /// The lock asked for (the listener waits on it if the acquire queues).
        name: LockName,
        reply: AcquireReply,
    },
    Command(CommandReply),
    /// This member's import of a single server's state (see `cluster::import`).
    Import,
}

/// How an import entry was applied (the same on every member).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ImportOutcome {
    /// The image replaced the empty state.
    Applied {
        locks: usize,
        sessions: usize,
        next_fence: u64,
    },
    /// This image was applied earlier in the log (a crash came before the staged
    /// file was deleted): nothing changed.
    AlreadyApplied,
    /// The state was not empty, or the image unusable: nothing changed.
    Refused(String),
}

/// A single server's state this member imports: proposed whenever it leads and no
/// proposal of it is in flight, until one is applied.
pub(super) struct PendingImport {
    snapshot: Vec<u8>,
    in_flight: bool,
    done: Option<oneshot::Sender<ImportOutcome>>,
}

/// What the engine task keeps in cluster mode.
pub(super) struct Replicated {
    pub(super) node_id: u64,
    /// Drawn at start; see `Proposal::incarnation`.
    pub(super) incarnation: u64,
    pub(super) raft: Option<Raft>,
    pub(super) directory: Arc<Directory>,
    pub(super) pending: HashMap<u64, Pending>,
    pub(super) next_seq: u64,
    pub(super) applied: Option<crate::cluster::LogId>,
    /// The service time of the last applied command and when it was applied here:
    /// a follower's clock for reads (see `EngineTask::read_time_ms`).
    pub(super) applied_time: Option<(u64, tokio::time::Instant)>,
    pub(super) membership: StoredMembership,
    /// Leadership as last reported: `Some(term)` while this member leads.
    pub(super) leading: Option<u64>,
    pub(super) leader: Option<u64>,
    /// Least TTL accepted (ms): see `ClusterConfig::min_ttl`.
    pub(super) min_ttl_ms: u64,
    pub(super) tick_in_flight: bool,
    /// After a refused tick (openraft still reports this member as leader but will
    /// not take writes, e.g. its leader lease lapsed), no tick before this: the
    /// deadline is still due, and retrying at once would spin.
    pub(super) tick_retry_at: Option<tokio::time::Instant>,
    /// How long to wait after a refused tick: one heartbeat.
    pub(super) tick_retry_pause: Duration,
    /// Audit entries go to this thread, which writes them to the audit store.
    pub(super) audit: AuditWriter,
    /// The Raft log (stopped at shutdown, releasing its directory).
    pub(super) log_store: Option<crate::cluster::log_store::LogStore>,
    /// Stops the peer listener.
    pub(super) stop_peers: Option<oneshot::Sender<()>>,
    /// The audit store's high-water mark at start: entries at or below it were
    /// recorded before (re-applied after a restart) and are not recorded again.
    pub(super) audit_high_water: (u64, u32),
    /// The single server's state to import, until its entry is applied here.
    pub(super) import: Option<PendingImport>,
    /// The digest of the import entry applied in this run (replayed from the log
    /// after a restart): a new proposal of the same image is "already imported".
    pub(super) imported: Option<[u8; 32]>,
    /// Set while this member imports: clients are refused (503) until it is clear.
    pub(super) importing: Arc<AtomicBool>,
    #[cfg(feature = "planted-bugs")]
    pub(super) bugs: ClusterBugs,
    /// With the `local_fence` bug: the next fence by this member's own count.
    #[cfg(feature = "planted-bugs")]
    pub(super) local_fence: u64,
}

/// Shared with the handle: what it needs to route a read or name the leader.
pub struct ClusterShared {
    /// The Raft handle.
    pub raft: Raft,
    /// This member's id.
    pub node_id: u64,
    /// Learnt member URLs.
    pub directory: Arc<Directory>,
    /// This member's advertised URL.
    pub url: String,
    /// When this member last accepted the leader's replication.
    pub contact: Arc<LeaderContact>,
    /// How long a leader counts as confirmed by a quorum, and a follower as in
    /// touch with its leader: the longest election timeout (openraft's leader
    /// lease).
    pub lease: Duration,
    /// Set while this member imports a single server's state: until the import is
    /// applied (and its staged file deleted), clients are refused.
    pub(crate) importing: Arc<AtomicBool>,
    #[cfg(feature = "planted-bugs")]
    pub(crate) stale_leader_reads: bool,
}

/// Most entries a member's applied index may be behind the cluster's commit index
/// and still be ready (`/readyz`): a few group commits' worth, so a healthy member
/// under load stays ready while one catching up (a restart, a snapshot, a slow
/// disk) does not.
pub const READY_MAX_LAG: u64 = 1_000;

/// What a client hears while its member imports a single server's state.
pub(crate) fn importing_error() -> ApiError {
    ApiError::new(
        ApiErrorKind::Unavailable,
        "this member is importing a single server's state into the cluster; retry shortly",
    )
}

impl ClusterShared {
    /// Whether this member is still importing a single server's state (clients
    /// are refused until it is done).
    pub fn importing(&self) -> bool {
        self.importing.load(Ordering::Acquire)
    }

    /// The leader as this member knows it.
    pub fn leader(&self) -> Option<LeaderInfo> {
        let metrics = self.raft.metrics().borrow_watched().clone();
        let id = metrics.current_leader?;
        let url = if id == self.node_id {
            self.url.clone()
        } else {
            leader_url(&metrics.membership_config, &self.directory, id)?
        };
        Some(LeaderInfo { id, url })
    }

    /// Whether this member can serve as a caught-up part of the cluster (`/readyz`),
    /// or why not: it is a voter, a leader is known, the leader was confirmed by a
    /// quorum (on the leader) or was heard from (on a follower) within
    /// [`ClusterShared::lease`], and the applied index is at most
    /// `READY_MAX_LAG` entries behind the cluster's commit index.
    pub fn readiness(&self) -> Result<(), NotReady> {
        let m = self.raft.metrics().borrow_watched().clone();
        let me = self.node_id;
        let lease_ms = self.lease.as_millis();
        let membership = m.membership_config.membership();
        if membership.get_node(&me).is_none() {
            return Err(NotReady::new(
                NotReadyKind::NotMember,
                format!(
                "member {me} is not in the cluster's membership (it waits to be added with `fencelock cluster add`, or was removed)"
            ),
            ));
        }
        let voters: Vec<u64> = membership.voter_ids().collect();
        if !voters.contains(&me) {
            return Err(NotReady::new(
                NotReadyKind::Learner,
                format!("member {me} is a learner: it is catching up and not yet a voter"),
            ));
        }
        let Some(leader) = m.current_leader else {
            return Err(NotReady::new(
                NotReadyKind::NoLeader,
                "no leader is known (an election is under way, or there is no quorum)",
            ));
        };
        if leader == me {
            let alone = voters == [me];
            let confirmed = m
                .last_quorum_acked
                .as_ref()
                .is_some_and(|at| openraft::Instant::elapsed(&**at) < self.lease);
            if !alone && !confirmed {
                return Err(NotReady::new(
                    NotReadyKind::Unconfirmed,
                    format!(
                        "member {me} leads, but no quorum has acknowledged it within {lease_ms} ms"
                    ),
                ));
            }
        } else if self.contact.since().is_none_or(|since| since >= self.lease) {
            return Err(NotReady::new(
                NotReadyKind::LeaderSilent,
                format!(
                "member {me} has not heard from the leader (member {leader}) within {lease_ms} ms"
            ),
            ));
        }
        let applied = m.last_applied.map_or(0, |id| id.index);
        let committed = m.cluster_committed.map_or(0, |id| id.index);
        let behind = committed.saturating_sub(applied);
        if behind > READY_MAX_LAG {
            return Err(NotReady::new(
                NotReadyKind::Lagging,
                format!(
                "member {me} has applied up to index {applied}, {behind} entries behind the cluster's commit index {committed} (ready within {READY_MAX_LAG})"
            ),
            ));
        }
        Ok(())
    }

    /// `not_leader`, naming the leader if known.
    pub fn not_leader(&self) -> ApiError {
        ApiError::not_leader(self.leader().map(|l| l.url))
    }

    /// Waits until a read may be served linearizably here: this member leads (a
    /// quorum confirmed it, ReadIndex — never a clock-based lease) and has applied
    /// everything committed before the read arrived.
    pub async fn read_barrier(&self) -> Result<(), ApiError> {
        #[cfg(feature = "planted-bugs")]
        if self.stale_leader_reads {
            let believes =
                self.raft.metrics().borrow_watched().current_leader == Some(self.node_id);
            return if believes {
                Ok(())
            } else {
                Err(self.not_leader())
            };
        }
        match self
            .raft
            .ensure_linearizable(openraft::ReadPolicy::ReadIndex)
            .await
        {
            Ok(_) => Ok(()),
            Err(RaftError::APIError(openraft::error::LinearizableReadError::ForwardToLeader(
                _,
            ))) => Err(self.not_leader()),
            Err(e) => Err(ApiError::new(
                ApiErrorKind::Unavailable,
                format!("cannot confirm leadership for a linearizable read: {e}"),
            )),
        }
    }
}

/// Member `id`'s client URL: as recorded in the membership, else as heard.
pub(crate) fn leader_url(
    membership: &StoredMembership,
    directory: &Directory,
    id: u64,
) -> Option<String> {
    membership
        .membership()
        .get_node(&id)
        .map(|m| m.url.clone())
        .filter(|u| !u.is_empty())
        .or_else(|| directory.url(id))
}

/// What the audit thread is asked to do.
enum AuditMsg {
    /// Append these (durable at the next sync).
    Entries(Vec<AuditEntry>),
    /// Sync everything appended so far, then answer.
    Sync(oneshot::Sender<()>),
}

/// Audit appends, in order, on a thread of their own. They are synced lazily — when
/// a snapshot is about to become the restart point, and at a clean stop — not per
/// batch: an entry lost in a crash is rebuilt when the log after the snapshot is
/// applied again, and a sync per batch would compete with the Raft log's own
/// fdatasyncs for the disk.
pub(super) struct AuditWriter {
    tx: Option<std::sync::mpsc::Sender<AuditMsg>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl AuditWriter {
    pub(super) fn spawn(mut store: AuditStore) -> std::io::Result<AuditWriter> {
        let (tx, rx) = std::sync::mpsc::channel::<AuditMsg>();
        let thread = std::thread::Builder::new()
            .name("fencelock-audit".into())
            .spawn(move || {
                let failed = |e: fencelock_log::LogError| {
                    tracing::error!(error = %e, "cannot write the audit log; audit entries are lost from here on");
                };
                for msg in rx.iter() {
                    let done = match msg {
                        AuditMsg::Entries(batch) => store.append(batch),
                        AuditMsg::Sync(reply) => store.sync().map(|()| {
                            let _ = reply.send(());
                        }),
                    };
                    if let Err(e) = done {
                        return failed(e);
                    }
                }
                // A clean stop leaves nothing to rebuild.
                if let Err(e) = store.sync() {
                    failed(e);
                }
            })?;
        Ok(AuditWriter {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    fn send(&self, entries: Vec<AuditEntry>) -> bool {
        self.tx
            .as_ref()
            .is_some_and(|tx| tx.send(AuditMsg::Entries(entries)).is_ok())
    }

    /// Answers `done` once everything sent before is durable (dropped unanswered if
    /// the writer failed).
    fn sync(&self, done: oneshot::Sender<()>) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(AuditMsg::Sync(done));
        }
    }

    /// Writes what is queued and releases the audit store.
    async fn stop(&mut self) {
        self.tx = None;
        if let Some(thread) = self.thread.take() {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
    }
}

/// An engine that panicked drops its writer without [`AuditWriter::stop`]: the
/// thread is joined here too, so the audit directory is released once the engine is
/// gone. A member restarted in the same process (the cluster simulation) found it
/// still locked by the old thread ("in use by another fencelock server").
impl Drop for AuditWriter {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl EngineTask {
    fn replica(&mut self) -> &mut Replicated {
        self.replicated.as_mut().expect("cluster mode")
    }

    /// The engine task in cluster mode.
    pub(super) async fn run_replicated(
        mut self,
        mut sm_rx: mpsc::Receiver<SmRequest>,
        mut attach: oneshot::Receiver<Raft>,
    ) {
        let timer = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(timer);
        let mut armed: Option<tokio::time::Instant> = None;
        let mut metrics: Option<MetricsRx> = None;
        // No Raft to attach (openraft's storage tests drive the state machine alone).
        let mut detached = false;
        loop {
            // No timer while a tick is on its way through Raft: the deadline it
            // processes is still in the past until it is applied.
            let r = self.replica();
            let (arm, retry_at) = (r.leading.is_some() && !r.tick_in_flight, r.tick_retry_at);
            if arm {
                let deadline = self
                    .core
                    .next_deadline_ms()
                    .map(|d| self.clock.instant_of(d));
                if let Some(at) = deadline.map(|at| retry_at.map_or(at, |retry| at.max(retry))) {
                    if armed.is_none_or(|armed| at < armed) {
                        timer.as_mut().reset(at);
                        armed = Some(at);
                    }
                }
            } else {
                armed = None;
            }
            tokio::select! {
                biased;
                req = sm_rx.recv() => match req {
                    Some(req) => self.sm_request(req),
                    None => return,
                },
                raft = &mut attach, if metrics.is_none() && !detached => match raft {
                    Ok(raft) => {
                        metrics = Some(raft.metrics());
                        self.replica().raft = Some(raft);
                        self.on_metrics(metrics.as_ref().expect("just set"));
                    }
                    Err(_) => detached = true,
                },
                changed = async { metrics.as_mut().expect("guarded").changed().await }, if metrics.is_some() => {
                    if changed.is_err() {
                        return;
                    }
                    self.on_metrics(metrics.as_ref().expect("guarded"));
                }
                msg = self.rx.recv() => match msg {
                    Some(Msg::Shutdown(done)) => {
                        self.flush_replicated();
                        if let Some(raft) = self.replica().raft.clone() {
                            let _ = raft.shutdown().await;
                        }
                        if let Some(stop) = self.replica().stop_peers.take() {
                            let _ = stop.send(());
                        }
                        if let Some(log) = self.replica().log_store.clone() {
                            log.stop().await;
                        }
                        self.replica().audit.stop().await;
                        let _ = self.state.send(super::RunState::Stopped);
                        let _ = done.send(());
                        return;
                    }
                    Some(msg) => self.handle_replicated(msg),
                    None => return,
                },
                () = &mut timer, if armed.is_some() => {
                    armed = None;
                    self.propose_tick();
                }
            }
            self.flush_replicated();
        }
    }

    fn on_metrics(&mut self, metrics: &MetricsRx) {
        let (leading, leader, term) = {
            let m = metrics.borrow_watched();
            let me = self.replica().node_id;
            let leading = m.state == ServerState::Leader && m.current_leader == Some(me);
            self.metrics.set_cluster(&m);
            (leading, m.current_leader, m.current_term)
        };
        let was = self.replica().leading;
        self.replica().leader = leader;
        match (was, leading) {
            (was, true) if was != Some(term) => {
                self.replica().leading = Some(term);
                // Service time continues from what the cluster applied; it never runs
                // ahead of real time, so no lease ends early.
                self.clock = ServiceClock {
                    base_ms: self.core.now_ms() + 1,
                    start: tokio::time::Instant::now(),
                };
                self.metrics
                    .cluster
                    .leader_changes
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                #[cfg(feature = "planted-bugs")]
                if self.replica().bugs.expire_on_promote {
                    self.clock.base_ms += self.core.config().max_ttl_ms;
                    return;
                }
                tracing::info!(term, "this member leads; every lease gets a full TTL");
                // The new leader cannot know how much of a lease its holder believes
                // is left: every lease restarts in full before anything expires.
                self.propose(Command::Promote, Requester::server(), None);
            }
            (Some(_), false) => {
                self.replica().leading = None;
                tracing::info!(term, leader = ?leader, "this member no longer leads");
            }
            _ => {}
        }
        self.propose_import();
    }

    /// Proposes the single server's state, if this member leads and has one to
    /// import with no proposal of it in flight.
    fn propose_import(&mut self) {
        let r = self.replica();
        if r.leading.is_none() {
            return;
        }
        let Some(import) = r.import.as_mut().filter(|i| !i.in_flight) else {
            return;
        };
        import.in_flight = true;
        let meta = self.stamp(&Requester::server());
        let record = match &self.replica().import {
            Some(import) => codec::encode_import(&meta, &import.snapshot),
            None => return,
        };
        tracing::info!(
            bytes = record.len(),
            "proposing the single server's state as the cluster's"
        );
        self.submit(record, Some(Pending::Import), false);
    }

    /// The import entry proposed here was applied (or refused): report it.
    fn import_answered(&mut self, outcome: ImportOutcome) {
        if let Some(mut import) = self.replica().import.take() {
            if let Some(done) = import.done.take() {
                let _ = done.send(outcome);
            }
        }
    }

    /// The service time a read on this member counts to. The leader reads its
    /// service clock (the one it stamps commands with). A follower has no clock of
    /// the cluster's: it takes the last applied command's time plus the time since
    /// it applied it, which stays at or behind the leader's clock while that leader
    /// leads (a command is applied here after the leader stamped it). After a
    /// failover the new leader's clock restarts from the applied time, so until its
    /// first command is applied here a follower may count a little ahead of it.
    /// Never earlier than the core's own time.
    fn read_time_ms(&mut self) -> u64 {
        let applied = self.core.now_ms();
        let r = self.replica();
        let now = if r.leading.is_some() {
            self.clock.now_ms()
        } else {
            match r.applied_time {
                Some((ms, at)) => ms.saturating_add(at.elapsed().as_millis() as u64),
                None => applied,
            }
        };
        now.max(applied)
    }

    /// After the core applied `command`: its audit entries (those not recorded
    /// before a restart), its outcomes routed, and a leader's service clock kept
    /// from falling behind the applied time.
    fn after_apply(
        &mut self,
        meta: &RecordMeta,
        command: &Command,
        result: &Result<Reply, fencelock_core::Error>,
    ) {
        let outcomes = self.core.take_outcomes();
        // Its events stand at its Raft log index.
        self.event_record = (meta.seq, meta.wall_ms);
        let entries = audit::entries_for(meta, command, result, &outcomes);
        let high_water = self.replica().audit_high_water;
        self.audit.extend(audit::missing(high_water, entries));
        self.outcomes.extend(outcomes);
        self.route_replicated_outcomes();
        if self.replica().leading.is_some() && self.clock.now_ms() < self.core.now_ms() {
            self.clock = ServiceClock {
                base_ms: self.core.now_ms(),
                start: tokio::time::Instant::now(),
            };
        }
    }

    fn not_leader(&mut self) -> ApiError {
        let r = self.replica();
        let Some(id) = r.leader.filter(|id| *id != r.node_id) else {
            return ApiError::not_leader(None);
        };
        ApiError::not_leader(leader_url(&r.membership, &r.directory, id))
    }

    fn check_ttl(&mut self, what: &str, ttl_ms: Option<u64>) -> Result<(), ApiError> {
        let min = self.replica().min_ttl_ms;
        match ttl_ms {
            Some(ttl) if ttl < min => Err(ApiError::new(
                ApiErrorKind::InvalidArgument,
                format!(
                    "{what} must be at least {min} ms in cluster mode (three election timeouts, so a lease outlives a failover)"
                ),
            )),
            _ => Ok(()),
        }
    }

    fn handle_replicated(&mut self, msg: Msg) {
        match msg {
            Msg::Acquire {
                command,
                caller,
                listener,
                reply,
            } => {
                let Some((name, wait_ms)) = super::acquire_target(&command) else {
                    let err =
                        ApiError::new(ApiErrorKind::InvalidArgument, "name at least one lock");
                    self.deliveries
                        .push(Delivery::refused(listener, reply, err));
                    return;
                };
                let ttl_ms = match &command {
                    Command::Acquire(a) => a.ttl_ms,
                    Command::AcquireAll(parts) => parts.first().and_then(|a| a.ttl_ms),
                    _ => None,
                };
                if self.draining && wait_ms > 0 {
                    let err =
                        ApiError::new(ApiErrorKind::Unavailable, "the server is shutting down");
                    self.deliveries
                        .push(Delivery::refused(listener, reply, err));
                    return;
                }
                let refused = self
                    .check_ttl("ttl_ms", ttl_ms)
                    .err()
                    .or_else(|| self.refused_while_importing())
                    .or_else(|| self.replica().leading.is_none().then(|| self.not_leader()));
                if let Some(err) = refused {
                    self.deliveries
                        .push(Delivery::refused(listener, reply, err));
                    return;
                }
                #[cfg(feature = "planted-bugs")]
                if self.replica().bugs.apply_before_commit {
                    let now = self.clock.now_ms().max(self.core.now_ms());
                    let speculative = self.core.apply(now, command.clone());
                    self.core.discard_outcomes();
                    if let Ok(Reply::Granted(grant)) = speculative {
                        self.deliveries.push(Delivery::Granted {
                            grant,
                            listeners: vec![(listener, reply)],
                            orphans: None,
                        });
                        self.propose(command, caller, None);
                        return;
                    }
                }
                self.propose(
                    command,
                    caller,
                    Some(Pending::Acquire {
                        listener,
                        name,
                        reply,
                    }),
                );
            }
            Msg::Command {
                command,
                caller,
                reply,
            } => {
                let ttl = match &command {
                    Command::OpenSession { ttl_ms, .. } => Some(*ttl_ms),
                    Command::Renew { ttl_ms, .. } => *ttl_ms,
                    _ => None,
                };
                let refused = self
                    .check_ttl("ttl_ms", ttl)
                    .err()
                    .or_else(|| self.refused_while_importing())
                    .or_else(|| self.replica().leading.is_none().then(|| self.not_leader()));
                if let Some(err) = refused {
                    self.deliveries.push(Delivery::Reply {
                        reply,
                        result: Err(err),
                    });
                    return;
                }
                if let Some(missing) = self.foreign_session(&command, &caller) {
                    self.deliveries.push(Delivery::reply(reply, Err(missing)));
                    return;
                }
                self.propose(command, caller, Some(Pending::Command(reply)));
            }
            Msg::CancelListener { listener } => {
                if let Some((name, token)) = self.forget_listener(listener) {
                    if self.replica().leading.is_some() {
                        self.propose(
                            Command::CancelWait { name, token },
                            Requester::server(),
                            None,
                        );
                    }
                }
            }
            Msg::ReleaseOrphan { name, token } => {
                if self.replica().leading.is_some() {
                    self.propose(Command::Release { name, token }, Requester::server(), None);
                }
            }
            Msg::Read(read) => {
                // The handle passed the read barrier (or asked for a stale read).
                let now_ms = self.read_time_ms();
                let answer = read(&self.core, now_ms);
                self.deliveries.push(Delivery::Read(answer));
            }
            Msg::Drain => {
                self.draining = true;
                let _ = self.state.send(super::RunState::Draining);
                let waiting: std::collections::BTreeSet<_> =
                    self.listener_index.values().cloned().collect();
                for (name, token) in waiting {
                    let listeners = self.take_listeners(token);
                    if self.replica().leading.is_some() {
                        self.propose(
                            Command::CancelWait { name, token },
                            Requester::server(),
                            None,
                        );
                    }
                    let error =
                        ApiError::new(ApiErrorKind::Unavailable, "the server is shutting down");
                    self.deliveries.push(Delivery::Refused { listeners, error });
                }
            }
            Msg::Abandon { seq, error } => {
                if let Some(pending) = self.replica().pending.remove(&seq) {
                    self.answer_error(pending, error);
                }
            }
            Msg::TickDone { refused } => {
                let r = self.replica();
                r.tick_in_flight = false;
                r.tick_retry_at = refused.then(|| tokio::time::Instant::now() + r.tick_retry_pause);
            }
            Msg::Shutdown(_) => unreachable!("handled by run_replicated"),
        }
    }

    fn refused_while_importing(&mut self) -> Option<ApiError> {
        self.replica()
            .importing
            .load(Ordering::Acquire)
            .then(importing_error)
    }

    fn answer_error(&mut self, pending: Pending, error: ApiError) {
        self.deliveries.push(match pending {
            Pending::Acquire {
                listener, reply, ..
            } => Delivery::refused(listener, reply, error),
            Pending::Command(reply) => Delivery::Reply {
                reply,
                result: Err(error),
            },
            Pending::Import => {
                // Not committed (this member stopped leading, or is stopping): it
                // is proposed again when this member leads.
                tracing::warn!(error = %error.message(), "the import was not committed; proposing it again once this member leads");
                if let Some(import) = self.replica().import.as_mut() {
                    import.in_flight = false;
                }
                return;
            }
        });
    }

    fn propose_tick(&mut self) {
        let r = self.replica();
        if r.leading.is_none() || r.tick_in_flight {
            return;
        }
        r.tick_in_flight = true;
        self.propose(Command::Tick, Requester::server(), None);
    }

    /// Stamps `command` with this leader's service time and proposes it; its
    /// answer goes to `pending` once applied (or an error if it cannot commit).
    fn propose(&mut self, command: Command, caller: Requester, pending: Option<Pending>) {
        let meta = self.stamp(&caller);
        let record = codec::encode_record(&meta, &command);
        self.submit(record, pending, matches!(command, Command::Tick));
    }

    /// A proposal's metadata: this leader's service time, the wall clock, the actor.
    fn stamp(&self, caller: &Requester) -> RecordMeta {
        RecordMeta {
            seq: 0,
            now_ms: self.clock.now_ms().max(self.core.now_ms()),
            wall_ms: audit::wall_ms(),
            actor: Some(caller.actor().to_owned()),
        }
    }

    /// Hands `record` to Raft; `pending` hears the outcome once it is applied, or
    /// an error if it cannot commit.
    fn submit(&mut self, record: Vec<u8>, pending: Option<Pending>, is_tick: bool) {
        let tx = self.self_tx.clone();
        let r = self.replica();
        let Some(raft) = r.raft.clone() else {
            if let Some(pending) = pending {
                let err = ApiError::not_leader(None);
                self.answer_error(pending, err);
            }
            return;
        };
        r.next_seq += 1;
        let seq = r.next_seq;
        if let Some(pending) = pending {
            r.pending.insert(seq, pending);
        }
        let proposal = Proposal {
            origin: r.node_id,
            incarnation: r.incarnation,
            seq,
            record,
        };
        let directory = r.directory.clone();
        tokio::spawn(async move {
            let written = raft.client_write(proposal).await;
            let refused = written.is_err();
            if let Err(e) = written {
                let error = match e {
                    RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => {
                        let url = f
                            .leader_node
                            .map(|m| m.url)
                            .filter(|u| !u.is_empty())
                            .or_else(|| f.leader_id.and_then(|id| directory.url(id)));
                        ApiError::not_leader(url)
                    }
                    other => ApiError::new(
                        ApiErrorKind::Unavailable,
                        format!("the cluster could not commit the request: {other}"),
                    ),
                };
                let _ = tx.send(Msg::Abandon { seq, error });
            }
            if is_tick {
                let _ = tx.send(Msg::TickDone { refused });
            }
        });
    }

    fn sm_request(&mut self, req: SmRequest) {
        match req {
            SmRequest::Apply { entries, done } => {
                for (entry, responder) in entries {
                    self.apply_entry(entry);
                    if let Some(responder) = responder {
                        responder.send(());
                    }
                }
                self.flush_replicated();
                let _ = done.send(());
            }
            SmRequest::AppliedState(tx) => {
                let r = self.replica();
                let _ = tx.send((r.applied, r.membership.clone()));
            }
            SmRequest::Build(tx) => {
                let image = codec::encode_snapshot(&self.core.export());
                let r = self.replica();
                let _ = tx.send((image, r.applied, r.membership.clone()));
            }
            SmRequest::AuditDurable(done) => {
                // Applied entries are committed: their audit entries may go now.
                let entries = std::mem::take(&mut self.audit);
                self.send_audit(entries);
                self.replica().audit.sync(done);
            }
            SmRequest::Install { image, meta, done } => {
                let corrupt =
                    |message: String| RecoveryError::new(RecoveryErrorKind::Corrupt, None, message);
                let result = codec::decode_snapshot(&image)
                    .map_err(|e| corrupt(format!("snapshot from the leader: {e}")))
                    .and_then(|image| {
                        fencelock_core::Core::import(self.core.config().clone(), image).map_err(
                            |e| corrupt(format!("snapshot from the leader is inconsistent: {e}")),
                        )
                    });
                match result {
                    Ok(core) => {
                        self.core = core;
                        // The events up to the snapshot are not in this history.
                        let index = meta.last_log_id.as_ref().map_or(0, |id| id.index);
                        self.history.reset(index);
                        let applied_ms = self.core.now_ms();
                        let r = self.replica();
                        r.applied = meta.last_log_id;
                        r.applied_time = Some((applied_ms, tokio::time::Instant::now()));
                        r.membership = meta.last_membership;
                        // Whoever waited on this member is answered by the new state
                        // no more: they retry (with their request ids).
                        let pending: Vec<Pending> = r.pending.drain().map(|(_, p)| p).collect();
                        for p in pending {
                            let err = ApiError::new(
                                ApiErrorKind::Unavailable,
                                "this member installed a snapshot; retry the request",
                            );
                            self.answer_error(p, err);
                        }
                        self.metrics.set_state_gauges(&self.core.stats());
                        let _ = done.send(Ok(()));
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "cannot install a snapshot");
                        let _ = done.send(Err(e));
                    }
                }
            }
        }
    }

    fn apply_entry(&mut self, entry: crate::cluster::Entry) {
        let log_id = entry.log_id();
        self.replica().applied = Some(log_id);
        match entry.payload {
            EntryPayload::Blank => {}
            EntryPayload::Membership(m) => {
                self.replica().membership = StoredMembership::new(Some(log_id), m);
            }
            EntryPayload::Normal(proposal) => self.apply_proposal(log_id.index(), proposal),
        }
    }

    fn apply_proposal(&mut self, index: u64, proposal: Proposal) {
        let (mut meta, command) = match codec::decode_replicated(&proposal.record) {
            Ok(ReplicatedRecord::Command(meta, command)) => (meta, command),
            Ok(ReplicatedRecord::Import { meta, snapshot }) => {
                return self.apply_import(index, &proposal, meta, &snapshot);
            }
            Err(e) => {
                // Every member refuses it alike, so the state stays the same
                // everywhere; the asker hears why.
                tracing::error!(index, error = %e, "undecodable command in the raft log; skipped");
                return;
            }
        };
        meta.seq = index;
        let now = meta.now_ms.max(self.core.now_ms());
        let is_tick = matches!(command, Command::Tick);
        let copy = command.clone();
        #[cfg(feature = "planted-bugs")]
        let local = self.replica().bugs.local_fence && self.replica().leading.is_some();
        #[cfg(feature = "planted-bugs")]
        if local {
            let next = self.replica().local_fence;
            self.core.plant_next_fence(next);
        }
        let result = self.core.apply(now, command);
        let applied_ms = self.core.now_ms();
        self.replica().applied_time = Some((applied_ms, tokio::time::Instant::now()));
        #[cfg(feature = "planted-bugs")]
        if local {
            self.replica().local_fence = self.core.stats().next_fence;
        }
        self.after_apply(&meta, &copy, &result);
        // Entries proposed by an earlier run of this member (replayed after a
        // restart) answer nobody: their request numbers are reused.
        let mine = proposal.origin == self.replica().node_id
            && proposal.incarnation == self.replica().incarnation;
        if mine && is_tick {
            self.replica().tick_in_flight = false;
        }
        let pending = if mine {
            self.replica().pending.remove(&proposal.seq)
        } else {
            None
        };
        match pending {
            None | Some(Pending::Import) => {}
            Some(Pending::Command(reply)) => {
                self.deliveries.push(Delivery::reply(reply, result));
            }
            Some(Pending::Acquire {
                listener,
                name,
                reply,
            }) => match result.map_err(ApiError::from).and_then(typed::acquired) {
                Ok(Acquired::Granted(grant)) => self.deliver_grant(grant, vec![(listener, reply)]),
                Ok(Acquired::GrantedAll(grants)) => {
                    self.deliver_grants(grants, vec![(listener, reply)]);
                }
                Ok(Acquired::Queued(token)) => {
                    self.listeners
                        .entry(token)
                        .or_default()
                        .push((listener, reply));
                    self.listener_index.insert(listener, (name, token));
                }
                Err(err) => {
                    self.deliveries
                        .push(Delivery::refused(listener, reply, err));
                }
            },
        }
    }

    /// Applies an import entry (see `cluster::import`), the same way on every
    /// member: to an empty state only. Answers the proposer whether it applied, had
    /// applied this image before (a re-proposal after a crash), or refused.
    fn apply_import(
        &mut self,
        index: u64,
        proposal: &Proposal,
        mut meta: RecordMeta,
        snapshot: &[u8],
    ) {
        meta.seq = index;
        let digest = crate::cluster::import::digest(snapshot);
        let outcome = self.import_state(&meta, snapshot, digest);
        match &outcome {
            ImportOutcome::Applied {
                locks,
                sessions,
                next_fence,
            } => tracing::info!(
                index,
                locks,
                sessions,
                next_fence,
                "imported a single server's state"
            ),
            ImportOutcome::AlreadyApplied => {
                tracing::info!(index, "this single server's state was imported before")
            }
            ImportOutcome::Refused(why) => {
                tracing::warn!(index, why = %why, "refused an import; nothing changed")
            }
        }
        let r = self.replica();
        let mine = proposal.origin == r.node_id && proposal.incarnation == r.incarnation;
        if mine && matches!(r.pending.get(&proposal.seq), Some(Pending::Import)) {
            r.pending.remove(&proposal.seq);
            self.import_answered(outcome);
        }
    }

    fn import_state(
        &mut self,
        meta: &RecordMeta,
        snapshot: &[u8],
        digest: [u8; 32],
    ) -> ImportOutcome {
        let stats = self.core.stats();
        let empty =
            stats.locks == 0 && stats.sessions == 0 && self.core.export().recent_ends.is_empty();
        if !empty {
            // Only the answer depends on what this member saw (the state does not:
            // every member decides by the replicated state alone).
            if self.replica().imported == Some(digest) {
                return ImportOutcome::AlreadyApplied;
            }
            return ImportOutcome::Refused(format!(
                "the cluster already holds state ({} locks, {} sessions, or recently ended grants); an import replaces an empty state only",
                stats.locks, stats.sessions
            ));
        }
        let mut image = match codec::decode_snapshot(snapshot) {
            Ok(image) => image,
            Err(e) => return ImportOutcome::Refused(format!("the imported state: {e}")),
        };
        // The single server's service time becomes the cluster's: every time moves
        // by the same amount, so leases and lock-delays keep what they had left.
        let now = meta.now_ms.max(self.core.now_ms()).max(image.now_ms);
        let delta_ms = now - image.now_ms;
        crate::cluster::import::shift_times(&mut image, delta_ms);
        image.next_fence = image.next_fence.max(stats.next_fence);
        let core = match fencelock_core::Core::import(self.core.config().clone(), image) {
            Ok(core) => core,
            Err(e) => {
                return ImportOutcome::Refused(format!("the imported state is inconsistent: {e}"))
            }
        };
        self.core = core;
        // As at the single server's own restart: every lease and session gets a
        // full TTL, queued requests (their clients are gone) are dropped.
        let result = self.core.apply(now, Command::Recover);
        let meta = RecordMeta {
            now_ms: now,
            ..meta.clone()
        };
        self.after_apply(&meta, &Command::Recover, &result);
        self.replica().imported = Some(digest);
        let stats = self.core.stats();
        ImportOutcome::Applied {
            locks: stats.locks,
            sessions: stats.sessions,
            next_fence: stats.next_fence,
        }
    }

    /// As in single-node mode, except that a grant nobody here listens for is left
    /// alone: its client may be retrying on another member (with its request id),
    /// and its lease ends it otherwise.
    fn route_replicated_outcomes(&mut self) {
        let outcomes = std::mem::take(&mut self.outcomes);
        let mut kept = Vec::with_capacity(outcomes.len());
        for outcome in outcomes {
            match outcome {
                fencelock_core::Outcome::Granted(grant)
                    if !self.listeners.contains_key(&grant.token) => {}
                fencelock_core::Outcome::GrantedAll(grants)
                    if !grants
                        .first()
                        .is_some_and(|g| self.listeners.contains_key(&g.token)) => {}
                fencelock_core::Outcome::WaitEnded { token, .. }
                    if !self.listeners.contains_key(&token) => {}
                other => kept.push(other),
            }
        }
        // Events are kept above: route_outcomes publishes them.
        self.outcomes = kept;
        self.route_outcomes();
    }

    /// Runs this round's deliveries at once (everything applied is committed and
    /// durable on a majority), and hands audit entries to their writer.
    fn flush_replicated(&mut self) {
        self.metrics.set_state_gauges(&self.core.stats());
        for d in std::mem::take(&mut self.written) {
            d.deliver();
        }
        for d in std::mem::take(&mut self.event_deliveries) {
            d.deliver();
        }
        for d in std::mem::take(&mut self.deliveries) {
            d.deliver();
        }
        let entries = std::mem::take(&mut self.audit);
        self.send_audit(entries);
    }

    fn send_audit(&mut self, entries: Vec<AuditEntry>) {
        if !entries.is_empty() {
            let count = entries.len() as u64;
            if self.replica().audit.send(entries) {
                self.metrics
                    .audit_entries
                    .fetch_add(count, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }
}

/// Everything `start_cluster` built besides the handle.
pub struct ClusterRuntime {
    /// Shared with the handle.
    pub shared: Arc<ClusterShared>,
    /// Stops the Raft log writer.
    pub log_store: crate::cluster::log_store::LogStore,
}

/// The initial membership from `--peers`: the same on every member, so that each
/// may initialize the cluster (openraft accepts identical initializations).
pub(crate) fn initial_members(
    peers: &BTreeMap<u64, std::net::SocketAddr>,
) -> BTreeMap<u64, crate::cluster::Member> {
    peers
        .iter()
        .map(|(id, addr)| {
            (
                *id,
                crate::cluster::Member {
                    peer_addr: addr.to_string(),
                    url: String::new(),
                },
            )
        })
        .collect()
}

impl Shared {
    pub(super) fn cluster(&self) -> Option<&Arc<ClusterShared>> {
        self.cluster.as_ref()
    }
}

fn internal(what: impl std::fmt::Display) -> ApiError {
    ApiError::new(ApiErrorKind::Internal, what.to_string())
}

/// What [`start_member`] needs besides the engine settings: how to reach peers,
/// where the Raft log lives, and what to stop at shutdown.
pub struct MemberSpec<N> {
    /// The engine settings; `cluster` must be set.
    pub config: EngineConfig,
    /// openraft's network (the peer port's HTTP/2 client, or a simulated one).
    pub network: N,
    /// The Raft log.
    pub log_store: crate::cluster::log_store::LogStore,
    /// Members' URLs (shared with the network, which learns them from peers).
    pub directory: Arc<Directory>,
    /// Sent at shutdown (stops the peer listener).
    pub on_shutdown: Option<oneshot::Sender<()>>,
    /// A single server's state to import once this member leads
    /// (`cluster::import::prepare`); clients are refused until it is applied.
    pub import: Option<Staged>,
    /// How the dead-leader watchdog probes a silent leader (`cluster::watchdog`):
    /// a TCP connect on a real network, the simulated network's view in the
    /// simulation. `None`, or `ClusterConfig::leader_probe` off: no watchdog.
    pub probe: Option<Arc<dyn LeaderProbe>>,
    /// Protections switched off for the simulation's planted-bug tests.
    #[cfg(feature = "planted-bugs")]
    pub bugs: ClusterBugs,
}

/// Protections the cluster simulation switches off, one at a time, to show that
/// its checker catches their absence (compiled in only with `planted-bugs`).
#[cfg(feature = "planted-bugs")]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClusterBugs {
    /// The leader applies an acquire and answers it when it arrives, before the
    /// command is committed.
    pub apply_before_commit: bool,
    /// A new leader expires leases at once instead of giving them a full TTL.
    pub expire_on_promote: bool,
    /// Fences come from a counter each member keeps while it leads.
    pub local_fence: bool,
    /// A member that believes it leads serves reads without ReadIndex.
    pub stale_leader_reads: bool,
    /// A queued request retried with its request id (after a failover) goes to
    /// the back of the queue.
    pub requeue_retries: bool,
}

/// Starts a cluster member over any network: the engine task in cluster mode,
/// then openraft; a fresh member (empty Raft log, not `join`) forms the cluster
/// from `peers`. Used by [`start_cluster`] and by the cluster simulation.
pub async fn start_member<N>(spec: MemberSpec<N>) -> Result<(Handle, ClusterRuntime), StartError>
where
    N: openraft::network::RaftNetworkFactory<TypeConfig>,
    N::Network: openraft::network::NetSnapshot<TypeConfig, SnapshotData = Vec<u8>>,
{
    let MemberSpec {
        config,
        network,
        log_store,
        directory,
        on_shutdown,
        import,
        probe,
        #[cfg(feature = "planted-bugs")]
        bugs,
    } = spec;
    let cluster = config
        .cluster
        .clone()
        .ok_or_else(|| StartError::config("a member needs a cluster configuration"))?;
    cluster.validate()?;
    let fsync = config.durability == super::Durability::Fsync;
    let raft_dir = config.data_dir.join("raft");
    std::fs::create_dir_all(&raft_dir).map_err(|e| RecoveryError::io("create", &raft_dir, e))?;
    let audit_dir = config.data_dir.join("audit");
    std::fs::create_dir_all(&audit_dir).map_err(|e| RecoveryError::io("create", &audit_dir, e))?;
    let audit_store = AuditStore::open(&audit_dir, config.audit.clone(), fsync)?;
    let audit_high_water = audit_store.high_water();
    let audit_index = audit_store.shared_index();
    let audit_len = audit_store.len() as u64;
    let audit = AuditWriter::spawn(audit_store)
        .map_err(|e| StartError::internal(format!("cannot start a thread: {e}")))?;

    directory.learn(cluster.node_id, &cluster.advertise_url);
    let mut metrics = crate::metrics::Metrics::default();
    metrics.cluster.log_sync = log_store.sync_histogram();
    let metrics = Arc::new(metrics);
    metrics
        .audit_entries
        .store(audit_len, std::sync::atomic::Ordering::Relaxed);
    #[allow(unused_mut)]
    let mut core = fencelock_core::Core::new(config.core.clone());
    #[cfg(feature = "planted-bugs")]
    core.plant_bugs(fencelock_core::PlantedBugs {
        requeue_retries: bugs.requeue_retries,
        ..Default::default()
    });
    metrics.set_state_gauges(&core.stats());
    let (tx, rx) = super::queue::queue();
    let (events, _) = tokio::sync::broadcast::channel(EVENT_BUFFER);
    let history = Arc::new(History::for_member(config.watch_history));
    let (state_tx, state_rx) = watch::channel(RunState::Running);
    let (sm_tx, sm_rx) = mpsc::channel(SM_QUEUE);
    let (attach_tx, attach_rx) = oneshot::channel();
    let importing = Arc::new(AtomicBool::new(import.is_some()));
    let (import_done_tx, import_done) = oneshot::channel();
    let staged_path = import.as_ref().map(|staged| staged.path.clone());
    let import = import.map(|staged| PendingImport {
        snapshot: staged.snapshot,
        in_flight: false,
        done: Some(import_done_tx),
    });
    let engine = EngineTask {
        core,
        clock: ServiceClock {
            base_ms: 1,
            start: tokio::time::Instant::now(),
        },
        rx,
        self_tx: tx.clone(),
        writer: std::sync::mpsc::channel().0,
        metrics: metrics.clone(),
        events: events.clone(),
        history: history.clone(),
        event_record: (0, 0),
        state: state_tx.clone(),
        records: Vec::new(),
        audit: Vec::new(),
        outcomes: Vec::new(),
        next_seq: 0,
        written: Vec::new(),
        event_deliveries: Vec::new(),
        deliveries: Vec::new(),
        listeners: HashMap::new(),
        listener_index: HashMap::new(),
        draining: false,
        replicated: Some(Replicated {
            node_id: cluster.node_id,
            incarnation: super::random_u128() as u64,
            raft: None,
            directory: directory.clone(),
            pending: HashMap::new(),
            next_seq: 0,
            applied: None,
            applied_time: None,
            membership: StoredMembership::default(),
            leading: None,
            leader: None,
            min_ttl_ms: cluster.min_ttl().as_millis() as u64,
            tick_in_flight: false,
            tick_retry_at: None,
            tick_retry_pause: cluster.heartbeat,
            audit,
            log_store: Some(log_store.clone()),
            stop_peers: on_shutdown,
            audit_high_water,
            import,
            imported: None,
            importing: importing.clone(),
            #[cfg(feature = "planted-bugs")]
            bugs,
            #[cfg(feature = "planted-bugs")]
            local_fence: 1,
        }),
    };
    let engine_task = tokio::spawn(engine.run_replicated(sm_rx, attach_rx));
    let supervisor_state = state_tx.clone();
    tokio::spawn(async move {
        if let Err(e) = engine_task.await {
            if e.is_panic() {
                let what = "the lock engine panicked (a broken invariant); stopped".to_owned();
                tracing::error!(error = %what, "fail-stop");
                let _ = supervisor_state.send(RunState::Failed(what));
            }
        }
    });

    if let Some(staged) = staged_path {
        tokio::spawn(finish_import(
            import_done,
            staged,
            importing.clone(),
            state_tx.clone(),
        ));
    }

    let sm = crate::cluster::state_machine::StateMachine::new(sm_tx, raft_dir.clone());
    let raft_config = Arc::new(
        cluster
            .raft_config()
            .validate()
            .map_err(|e| StartError::config(format!("raft settings: {e}")))?,
    );
    let raft = Raft::new(cluster.node_id, raft_config, network, log_store.clone(), sm)
        .await
        .map_err(|e| StartError::internal(format!("cannot start raft: {e}")))?;
    let initialized = raft
        .is_initialized()
        .await
        .map_err(|e| StartError::internal(format!("raft: {e}")))?;
    if !initialized && !cluster.join {
        match raft.initialize(initial_members(&cluster.peers)).await {
            Ok(()) => tracing::info!(
                members = cluster.peers.len(),
                "formed a new cluster from --peers"
            ),
            // Another member's initialization reached us first: the same cluster.
            Err(e) => tracing::info!(error = %e, "joined the cluster being formed"),
        }
    }
    if !initialized && cluster.join {
        tracing::info!("waiting to be added to a cluster (fencelock cluster add)");
    }
    let _ = attach_tx.send(raft.clone());
    let contact = Arc::new(LeaderContact::default());
    if let Some(probe) = probe.filter(|_| cluster.leader_probe) {
        let (_, max) = cluster.election_timeout();
        tokio::spawn(crate::cluster::watchdog::run(
            raft.clone(),
            cluster.node_id,
            contact.clone(),
            probe,
            Timing::new(cluster.heartbeat, max),
            metrics.cluster.watchdog_elections.clone(),
            state_tx.subscribe(),
        ));
    }
    let shared = Arc::new(ClusterShared {
        raft,
        node_id: cluster.node_id,
        directory,
        url: cluster.advertise_url.clone(),
        contact,
        lease: cluster.election_timeout().1,
        importing,
        #[cfg(feature = "planted-bugs")]
        stale_leader_reads: bugs.stale_leader_reads,
    });
    let handle = Handle {
        shared: Arc::new(Shared {
            tx,
            writer: None,
            cluster: Some(shared.clone()),
            metrics,
            events,
            history,
            state: state_rx,
            started: Instant::now(),
            recovery: super::RecoveryReport::default(),
            audit: audit_index,
            next_listener: std::sync::atomic::AtomicU64::new(1),
        }),
    };
    Ok((handle, ClusterRuntime { shared, log_store }))
}

/// Step 4 of an import (see `cluster::import`): once its entry is applied here,
/// deletes the staged image, then lets clients in. An import refused, or a staged
/// file that cannot be deleted, stops the member (`RunState::Failed`): serving
/// with the file in place could import it again at the next start.
async fn finish_import(
    done: oneshot::Receiver<ImportOutcome>,
    staged: std::path::PathBuf,
    importing: Arc<AtomicBool>,
    state: watch::Sender<RunState>,
) {
    let Ok(outcome) = done.await else {
        return; // the engine stopped first
    };
    let fail = |why: String| {
        tracing::error!(error = %why, "fail-stop");
        let _ = state.send(RunState::Failed(why));
    };
    if let ImportOutcome::Refused(why) = outcome {
        fail(format!(
            "cannot import the single server's state: {why}. It is kept in {} (a backup file);              if this member imported it before and stopped before deleting it, delete it",
            staged.display()
        ));
        return;
    }
    let path = staged.clone();
    match tokio::task::spawn_blocking(move || crate::cluster::import::finish(&path)).await {
        Ok(Ok(())) => {
            importing.store(false, Ordering::Release);
            tracing::info!(
                "the single server's state is the cluster's; serving clients (its files are in {}/)",
                crate::cluster::import::ASIDE_DIR
            );
        }
        Ok(Err(e)) => fail(format!(
            "the import is applied, but {} cannot be deleted: {e}; delete it before the next start",
            staged.display()
        )),
        Err(e) => fail(format!("the import's clean-up stopped: {e}")),
    }
}

/// Starts a cluster member on this machine's network: the Raft log in
/// `data_dir/raft/log` (fencelock-log), the peer listener (HTTP/2, optionally inside
/// mutual TLS, connection admission, the cluster secret, the configuration check),
/// and [`start_member`].
pub async fn start_cluster(config: EngineConfig) -> Result<(Handle, ClusterRuntime), StartError> {
    let cluster = config
        .cluster
        .clone()
        .ok_or_else(|| StartError::config("start_cluster needs a cluster configuration"))?;
    cluster.validate()?;
    // Read before anything is opened: a bad file is a configuration error.
    let (peer_acceptor, peer_connector) = match &cluster.tls {
        Some(tls) => (Some(tls.acceptor()?), Some(tls.connector()?)),
        None => (None, None),
    };
    let fsync = config.durability == super::Durability::Fsync;
    let raft_dir = config.data_dir.join("raft");
    std::fs::create_dir_all(&raft_dir).map_err(|e| RecoveryError::io("create", &raft_dir, e))?;
    // A single server's data becomes this member's state (or is refused) before
    // anything of the member is created.
    let import = crate::cluster::import::prepare(&config, &raft_dir)?;
    let log_store = crate::cluster::log_store::LogStore::open(&raft_dir.join("log"), fsync)?;
    let directory = Arc::new(Directory::default());
    let identity = Arc::new(crate::cluster::network::PeerIdentity {
        node_id: cluster.node_id,
        url: cluster.advertise_url.clone(),
        secret: cluster.secret.clone(),
        config: crate::cluster::config_fingerprint(&config.core),
    });
    let peer_listener = tokio::net::TcpListener::bind(cluster.peer_listen)
        .await
        .map_err(|e| StartError::listen("for peers ", cluster.peer_listen, e))?;
    let network = crate::cluster::network::Network::new(
        identity.clone(),
        directory.clone(),
        cluster.dial.clone(),
        peer_connector,
    );
    let (stop_peers, peers_stopped) = oneshot::channel::<()>();
    let probe = TcpProbe {
        dial: cluster.dial.clone(),
        timeout: Timing::new(cluster.heartbeat, cluster.election_timeout().1).probe_timeout(),
    };
    let (handle, runtime) = start_member(MemberSpec {
        config,
        network,
        log_store,
        directory,
        on_shutdown: Some(stop_peers),
        import,
        probe: Some(Arc::new(probe)),
        #[cfg(feature = "planted-bugs")]
        bugs: ClusterBugs::default(),
    })
    .await?;
    let peer_state = crate::cluster::network::PeerState {
        raft: runtime.shared.raft.clone(),
        identity,
        directory: runtime.shared.directory.clone(),
        contact: runtime.shared.contact.clone(),
    };
    let router = crate::cluster::network::router(peer_state);
    tokio::spawn(crate::cluster::listener::serve(
        peer_listener,
        router,
        peer_acceptor,
        cluster.secret.is_some(),
        peers_stopped,
    ));
    Ok((handle, runtime))
}

/// The Raft log and state machine of a member without Raft or network: the real
/// log store on `dir/log` and the real engine task behind the state machine, for
/// openraft's storage test suite.
#[doc(hidden)]
pub async fn storage_for_tests(
    dir: &std::path::Path,
) -> Result<
    (
        crate::cluster::log_store::LogStore,
        crate::cluster::state_machine::StateMachine,
    ),
    ApiError,
> {
    let log_store = crate::cluster::log_store::LogStore::open(&dir.join("log"), true)
        .map_err(|e| internal(format!("raft log: {e}")))?;
    let audit_dir = dir.join("audit");
    std::fs::create_dir_all(&audit_dir).map_err(internal)?;
    let audit_store = AuditStore::open(&audit_dir, Default::default(), false)?;
    let audit_high_water = audit_store.high_water();
    let audit = AuditWriter::spawn(audit_store).map_err(internal)?;
    let (tx, rx) = super::queue::queue();
    let (events, _) = tokio::sync::broadcast::channel(EVENT_BUFFER);
    let (state_tx, _state_rx) = watch::channel(RunState::Running);
    let (sm_tx, sm_rx) = mpsc::channel(SM_QUEUE);
    let (_attach_tx, attach_rx) = oneshot::channel();
    let engine = EngineTask {
        core: fencelock_core::Core::new(Default::default()),
        clock: ServiceClock {
            base_ms: 1,
            start: tokio::time::Instant::now(),
        },
        rx,
        self_tx: tx,
        writer: std::sync::mpsc::channel().0,
        metrics: Arc::new(crate::metrics::Metrics::default()),
        events,
        history: Arc::new(History::new(1, 0)),
        event_record: (0, 0),
        state: state_tx,
        records: Vec::new(),
        audit: Vec::new(),
        outcomes: Vec::new(),
        next_seq: 0,
        written: Vec::new(),
        event_deliveries: Vec::new(),
        deliveries: Vec::new(),
        listeners: HashMap::new(),
        listener_index: HashMap::new(),
        draining: false,
        replicated: Some(Replicated {
            node_id: 1,
            incarnation: super::random_u128() as u64,
            raft: None,
            directory: Arc::new(Directory::default()),
            pending: HashMap::new(),
            next_seq: 0,
            applied: None,
            applied_time: None,
            membership: StoredMembership::default(),
            leading: None,
            leader: None,
            min_ttl_ms: 0,
            tick_in_flight: false,
            tick_retry_at: None,
            tick_retry_pause: Duration::from_millis(50),
            audit,
            log_store: None,
            stop_peers: None,
            audit_high_water,
            import: None,
            imported: None,
            importing: Arc::new(AtomicBool::new(false)),
            #[cfg(feature = "planted-bugs")]
            bugs: ClusterBugs::default(),
            #[cfg(feature = "planted-bugs")]
            local_fence: 1,
        }),
    };
    tokio::spawn(engine.run_replicated(sm_rx, attach_rx));
    let sm = crate::cluster::state_machine::StateMachine::new(sm_tx, dir.to_owned());
    Ok((log_store, sm))
}
