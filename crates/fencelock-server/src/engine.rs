//! The engine: drives the sans-IO core, makes every change durable before anyone
//! hears of it (a holder's own release excepted: see below), and fires timers.
//!
//! Two threads of control:
//! - the **engine task** owns the [`Core`]. It takes requests in batches, stamps each
//!   with the service clock, applies it, encodes it as a log record, and queues the
//!   replies (and hand-off grants, and events) as *deliveries* of the current batch
//!   (`Delivery`, in `delivery`: data saying what goes to whom);
//! - the **writer thread** owns the `Log`. It takes whole batches, writes them, makes
//!   them durable with one fdatasync for as many batches as have queued up (group
//!   commit), and only then runs their deliveries. A delivery wakes the future that
//!   awaits it (HTTP, gRPC) or calls a sink (`GrantSink`, `ReplySink`: the wire
//!   protocol's, which writes the answer to the client's socket right there).
//!
//! So no reply, no grant and no event leaves the server before the command that
//! produced it is durable, the engine never waits for the disk (it applies the next
//! batch while the previous one syncs), and no lock is held across I/O. One reply
//! goes out earlier: a successful release is answered once its record is written,
//! before the fdatasync (`EngineTask::release` says why that is safe), which takes
//! one fsync off every acquire + release pair. A group whose every reply already
//! went out that way is held back (at most `HOLD_UNANSWERED_GROUP`) to share the
//! next batch's fdatasync, so that a client's next request does not find the writer
//! busy syncing its release.
//!
//! A panic on the engine task, the writer thread or the replica thread (a delivery's
//! sink included) fails the server (`RunState::Failed`, with a log line naming it):
//! nothing more is acknowledged and nothing waits for an answer that cannot come.
//! The engine's inbox holds at most [`ENGINE_QUEUE`] client requests; the next is
//! refused at once (`queue`).
//!
//! Handing the deliveries back to the engine task instead (so the writer starts the
//! next group sooner) measured +5 % at W2 but was reverted on W4 evidence that later
//! proved to be noise; docs/benchmarks-history.md ("Afternoon work") has the figures.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fencelock_core::{
    Command, Config as CoreConfig, Core, Error as CoreError, ErrorKind, Event, EventKind, Grant,
    GrantEnd, LockName, Mode, Outcome, Owner, OwnerToken, Quota, Reply, RequestId, SessionId,
    SessionView, Tenant, Value, WaitEnd,
};
use fencelock_log::LogOptions;
use tokio::sync::{broadcast, oneshot, watch};

use crate::audit::{self, AuditConfig, AuditEntry};
use crate::auth::{Principal, Role};
use crate::codec::{self, RecordMeta};
use crate::error::{ApiError, ApiErrorKind};
use crate::metrics::Metrics;
use crate::startup::{RecoveryError, StartError};

mod delivery;
mod handle;
mod history;
mod queue;
mod recovery;
mod replica;
mod replicated;
pub(crate) mod typed;
mod writer;

use delivery::Delivery;
pub use handle::Handle;
use handle::Shared;
use history::History;
pub use history::{Position, Resume, WatchEvent, DEFAULT_WATCH_HISTORY};
pub use queue::ENGINE_QUEUE;
use queue::{EngineRx, EngineTx};
use recovery::recover_into;
pub use recovery::{recover, Recovery, RecoveryReport, Replayed};
use replica::{dir_id, Snapshotter};
#[cfg(feature = "planted-bugs")]
pub use replicated::ClusterBugs;
pub use replicated::{
    start_cluster, start_member, storage_for_tests, ClusterRuntime, ClusterShared, MemberSpec,
};
use typed::Acquired;
use writer::{Writer, WriterMsg};

/// Whether acknowledged changes survive power loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Every batch is fdatasync'd before its replies go out (the default; a
    /// successful release is answered once written, before the fdatasync).
    Fsync,
    /// **Unsafe, for benchmarks only**: records are written but never synced, so a
    /// power loss or kernel crash can lose acknowledged grants and let fences repeat.
    None,
}

/// How the engine stores and bounds its state.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Directory for the log segments and snapshots.
    pub data_dir: PathBuf,
    /// Whether to fdatasync.
    pub durability: Durability,
    /// Bounds enforced by the core.
    pub core: CoreConfig,
    /// Size of each preallocated log segment.
    pub segment_bytes: u64,
    /// Take a snapshot once this many log bytes were written since the last one (or
    /// a quarter of the last snapshot's size, if that is larger: see
    /// [`SNAPSHOT_WRITE_AMPLIFICATION`]). Bounds how much log a restart replays.
    pub snapshot_after_bytes: u64,
    /// Retention of the audit log (in `data_dir/audit`).
    pub audit: AuditConfig,
    /// The longest the log writer polls for the next batch before it sleeps, when
    /// small writes follow each other closely (see [`DEFAULT_WRITER_POLL`]); zero:
    /// it never polls.
    pub writer_poll: Duration,
    /// The least fence the next grant may get (`--fence-floor`): applied at start
    /// as a logged `RaiseFenceFloor` if the recovered state is below it, so a
    /// server restarted into an empty or older data directory never reissues a
    /// fence that was seen. 0: none.
    pub fence_floor: u64,
    /// Cluster mode (`--node-id`, `--peers`, …): commands are replicated with Raft
    /// and the log lives in `data_dir/raft`. `None`: a single server.
    pub cluster: Option<crate::cluster::ClusterConfig>,
    /// How many recent events the server keeps for watches to resume from (see
    /// [`Position`]); a watch whose last event is older is told so.
    pub watch_history: usize,
}

/// The default bound of the log writer's polling: up to this long after a small
/// write, while the next batch keeps coming within it, the writer polls its channel
/// instead of sleeping. A sleeping writer is woken by a system call, and on a VM
/// often by the wake-up of a halted vCPU, which cost tens of µs on each request of
/// a lone client (W1 p50 −22 to −29 %, docs/benchmarks-history.md). The window adapts like the
/// kernel's guest halt-polling: it opens while batches come closer than this, closes
/// when they do not (sparse traffic burns no CPU), and stays shut while writes are
/// large (a busy server needs its cores for the work). Its price: with one client
/// at a time, up to one core busy polling between that client's requests.
pub const DEFAULT_WRITER_POLL: Duration = Duration::from_micros(200);

impl EngineConfig {
    /// Defaults for a data directory: fsync on, 64 MiB segments, snapshot every 16 MiB
    /// of log (or every quarter snapshot-size of log, if the state is larger).
    pub fn new(data_dir: impl Into<PathBuf>) -> EngineConfig {
        EngineConfig {
            data_dir: data_dir.into(),
            durability: Durability::Fsync,
            core: CoreConfig::default(),
            segment_bytes: 64 << 20,
            snapshot_after_bytes: 16 << 20,
            audit: AuditConfig::default(),
            writer_poll: DEFAULT_WRITER_POLL,
            fence_floor: 0,
            cluster: None,
            watch_history: DEFAULT_WATCH_HISTORY,
        }
    }
}

/// Lifecycle of the engine, observable by the API layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunState {
    /// Serving.
    Running,
    /// Shutting down: waits were cancelled, new waits are refused.
    Draining,
    /// Stopped cleanly; everything acknowledged is durable.
    Stopped,
    /// Storage failed; the engine stopped (fail-stop) and nothing more is acknowledged.
    Failed(String),
}

/// Arguments of an acquire, already validated as types.
#[derive(Debug, Clone)]
pub struct AcquireArgs {
    /// The lock.
    pub name: LockName,
    /// Lease; required without a session.
    pub ttl_ms: Option<u64>,
    /// How long to wait; 0 = do not wait.
    pub wait_ms: u64,
    /// Who is asking.
    pub owner: Owner,
    /// Idempotency key.
    pub request_id: Option<RequestId>,
    /// Holders admitted (1 = mutex).
    pub limit: u32,
    /// Lock-delay after expiry or forced release.
    pub lock_delay_ms: u64,
    /// Hold under this session.
    pub session: Option<SessionId>,
    /// Exclusive (a writer) or shared (a reader).
    pub mode: Mode,
    /// An election campaign's value (exclusive, limit 1).
    pub value: Option<Value>,
}

/// Who sends a command to the engine: the actor its audit entries name, the
/// principal that owns what it creates (sessions, grants, queued requests) and
/// whose quota limits it, and, for an admin, the prefixes it may manage others'
/// sessions within.
#[derive(Debug, Clone)]
pub struct Requester {
    /// `None`: the server itself. Cloning a `Principal` and its `Tenant` is cloning
    /// two `Arc`s, so a requester costs no allocation.
    principal: Option<Principal>,
    tenant: Option<Tenant>,
    quota: Option<Quota>,
}

/// The actor of what the server does by itself: expiries, hand-offs, restarts,
/// grants released because their client went away.
pub const SERVER_ACTOR: &str = "server";

impl Requester {
    /// The caller behind an authenticated request (or the anonymous principal).
    pub fn of(principal: &Principal) -> Requester {
        Requester {
            principal: Some(principal.clone()),
            tenant: principal.tenant(),
            quota: principal.quotas().map(|q| Quota {
                max_sessions: q.max_sessions,
                max_held_locks: q.max_held_locks,
                max_waiters: q.max_waiters,
            }),
        }
    }

    /// The anonymous principal's caller (authentication off): admin on every lock,
    /// no quota. What tests and embedders use.
    pub fn anonymous() -> Requester {
        Requester::of(&Principal::anonymous())
    }

    fn server() -> Requester {
        Requester {
            principal: None,
            tenant: None,
            quota: None,
        }
    }

    /// The name the audit log records.
    pub fn actor(&self) -> &str {
        self.principal
            .as_ref()
            .map_or(SERVER_ACTOR, Principal::name)
    }

    /// Whether this caller may keep alive or close `session`: the principal that
    /// opened it may; so may an admin covering every lock it holds or waits for
    /// (an admin limited to some prefixes only for a session that holds or waits
    /// for at least one lock, all of them within its prefixes: an empty session
    /// shows nothing such an admin is responsible for). A session from an old log
    /// (no recorded principal) is owned by nobody.
    pub fn may_manage(&self, session: &SessionView) -> bool {
        if session.tenant.is_some() && session.tenant == self.tenant {
            return true;
        }
        let Some(admin) = self.principal.as_ref().filter(|p| p.role() == Role::Admin) else {
            return false;
        };
        if admin.covers_everything() {
            return true;
        }
        let mut names = session.holding.iter().chain(&session.waiting).peekable();
        names.peek().is_some() && names.all(|n| admin.covers(n.as_str()))
    }
}

/// Events a watcher may fall behind by before it is told it missed some.
pub const EVENT_BUFFER: usize = 4096;

/// A lock event after it became durable, for watchers, with its position.
pub type SharedEvent = Arc<WatchEvent>;

/// Puts the events among `outcomes` of the record `meta` into `history`, at their
/// positions (recovery: these were delivered before, watches may resume from them).
fn record_events(history: &History, meta: &RecordMeta, outcomes: Vec<Outcome>) {
    let events = outcomes.into_iter().filter_map(|o| match o {
        Outcome::Event(event) => Some(event),
        _ => None,
    });
    for (ordinal, event) in (0u32..).zip(events) {
        history.push(Arc::new(WatchEvent {
            position: Position {
                index: meta.seq,
                ordinal,
            },
            wall_ms: meta.wall_ms,
            event,
        }));
    }
    history.applied(meta.seq);
}

/// A read of the core, given the service time of the read (ms): what views count
/// held and remaining time to. It returns the answer to send once durable
/// ([`Delivery::Read`]).
type Read = Box<dyn FnOnce(&Core, u64) -> Box<dyn FnOnce() + Send> + Send>;

/// Where an acquire's answer goes, called on the thread that delivers it (the writer
/// thread, once the grant is durable): the wire protocol writes it to the client's
/// socket there ([`crate::wire`]). Returns whether anyone took the answer; a grant
/// nobody took is released.
pub(crate) type GrantSink = Box<dyn FnOnce(Result<Grant, ApiError>) -> bool + Send>;

/// Where a command's answer goes, called on the thread that delivers it (see
/// [`GrantSink`]).
pub(crate) type ReplySink = Box<dyn FnOnce(Result<Reply, ApiError>) + Send>;

/// An acquire's answer: to a future awaiting it, or to a sink; a multi-lock
/// request's (all its grants) to a future.
enum AcquireReply {
    Channel(oneshot::Sender<Result<Grant, ApiError>>),
    Sink(GrantSink),
    All(oneshot::Sender<Result<Vec<Grant>, ApiError>>),
}

impl AcquireReply {
    /// Delivers `result`; false if nobody took it (the asker went away).
    fn send(self, result: Result<Grant, ApiError>) -> bool {
        match self {
            AcquireReply::Channel(tx) => tx.send(result).is_ok(),
            AcquireReply::Sink(sink) => sink(result),
            AcquireReply::All(tx) => tx.send(result.map(|g| vec![g])).is_ok(),
        }
    }

    /// Delivers a multi-lock request's grants (in the order asked).
    fn send_all(self, result: Result<Vec<Grant>, ApiError>) -> bool {
        match self {
            AcquireReply::All(tx) => tx.send(result).is_ok(),
            // Only a multi-lock request's listener is ever given several grants.
            single => single.send(result.and_then(|grants| {
                grants.into_iter().next().ok_or_else(|| {
                    ApiError::new(ApiErrorKind::Internal, "a multi-lock grant without grants")
                })
            })),
        }
    }
}

/// A command's answer: to a future awaiting it, or to a sink.
enum CommandReply {
    Channel(oneshot::Sender<Result<Reply, ApiError>>),
    Sink(ReplySink),
}

impl CommandReply {
    /// Delivers `result` (nobody hearing it is not an error: the asker went away).
    fn send(self, result: Result<Reply, ApiError>) {
        match self {
            CommandReply::Channel(tx) => {
                let _ = tx.send(result);
            }
            CommandReply::Sink(sink) => sink(result),
        }
    }
}

enum Msg {
    /// A `Command::Acquire` or `Command::AcquireAll`.
    Acquire {
        command: Command,
        caller: Requester,
        listener: u128,
        reply: AcquireReply,
    },
    Command {
        command: Command,
        /// Who asked: the audit log's actor, and for keep-alive and close, whose
        /// ownership of the session is checked.
        caller: Requester,
        reply: CommandReply,
    },
    /// The client behind `listener` stopped waiting.
    CancelListener {
        listener: u128,
    },
    /// A grant reached nobody (its client went away): give the lock back.
    ReleaseOrphan {
        name: LockName,
        token: OwnerToken,
    },
    Read(Read),
    /// Cluster mode: proposal `seq` will not be applied here (`error` says why).
    Abandon {
        seq: u64,
        error: ApiError,
    },
    /// Cluster mode: the tick proposal finished (committed, or `refused`).
    TickDone {
        refused: bool,
    },
    Drain,
    Shutdown(oneshot::Sender<()>),
}

fn random_u128() -> u128 {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).expect("the operating system's random source failed");
    u128::from_le_bytes(bytes)
}

/// The monotonic service clock: continues from the last logged time across restarts,
/// and advances only while the server runs (downtime only ever extends leases).
#[derive(Clone, Copy)]
struct ServiceClock {
    base_ms: u64,
    /// tokio's clock (the same as std's outside tests): under a paused test clock,
    /// leases run on the virtual time the timers use.
    start: tokio::time::Instant,
}

impl ServiceClock {
    fn now_ms(&self) -> u64 {
        self.base_ms + self.start.elapsed().as_millis() as u64
    }

    fn instant_of(&self, service_ms: u64) -> tokio::time::Instant {
        self.start + Duration::from_millis(service_ms.saturating_sub(self.base_ms))
    }
}

/// Opens the data directory, recovers, and starts the engine task and writer thread.
/// Must be called inside a tokio runtime.
pub fn start(config: EngineConfig) -> Result<Handle, StartError> {
    let log_opts = LogOptions {
        segment_bytes: config.segment_bytes,
        fsync: config.durability == Durability::Fsync,
    };
    let history = Arc::new(History::new(config.watch_history, 0));
    let Recovery {
        mut log,
        mut core,
        report,
        mut recovered,
        replayed,
        audit,
    } = recover_into(
        log_opts.clone(),
        &config.data_dir,
        &config.core,
        Some(&config.audit),
        Some(&history),
    )?;
    let mut audit_store = audit.expect("asked for");
    let high_water = audit_store.high_water();
    let mut next_seq = replayed.last_seq.max(high_water.0) + 1;
    if !replayed.audit.is_empty() {
        tracing::info!(
            entries = replayed.audit.len(),
            "audit log: rebuilt entries from the command log"
        );
    }

    // Every lease restarts with its full TTL; queued requests are gone with their
    // clients. The restart itself is a logged command, so replay stays exact.
    let clock = ServiceClock {
        base_ms: core.now_ms() + 1,
        start: tokio::time::Instant::now(),
    };
    let now = clock.now_ms();
    let io = |e: fencelock_log::LogError| {
        StartError::from(RecoveryError::from_log("the data directory", e))
    };
    let meta = RecordMeta {
        seq: next_seq,
        now_ms: now,
        wall_ms: audit::wall_ms(),
        actor: Some(SERVER_ACTOR.to_owned()),
    };
    next_seq += 1;
    if recovered.records.is_empty() {
        // Every earlier event went into the snapshot.
        history.reset(meta.seq - 1);
    }
    let recover_record = codec::encode_record(&meta, &Command::Recover);
    log.append(&recover_record).map_err(io)?;
    recovered.records.push(recover_record);
    let result = core.apply(now, Command::Recover);
    assert!(result.is_ok(), "recover never fails");
    let outcomes = core.take_outcomes();
    let mut audit_entries = replayed.audit;
    audit_entries.extend(audit::entries_for(
        &meta,
        &Command::Recover,
        &result,
        &outcomes,
    ));
    record_events(&history, &meta, outcomes);
    // The fence floor, logged like any command so replay and the replica agree;
    // only when it raises something (a restart past it logs nothing).
    let mut report = report;
    if core.stats().next_fence < config.fence_floor {
        let command = Command::RaiseFenceFloor {
            floor: config.fence_floor,
        };
        let meta = RecordMeta {
            seq: next_seq,
            now_ms: now,
            wall_ms: audit::wall_ms(),
            actor: None,
        };
        next_seq += 1;
        let result = core.apply(now, command.clone());
        if let Err(e) = &result {
            return Err(StartError::config(format!(
                "fence floor {}: {e}",
                config.fence_floor
            )));
        }
        let outcomes = core.take_outcomes();
        let record = codec::encode_record(&meta, &command);
        log.append(&record).map_err(io)?;
        recovered.records.push(record);
        audit_entries.extend(audit::entries_for(&meta, &command, &result, &outcomes));
        record_events(&history, &meta, outcomes);
        tracing::info!(
            floor = config.fence_floor,
            was = report.next_fence,
            "raised the next fence to the configured fence floor"
        );
        report.next_fence = core.stats().next_fence;
    }
    log.sync().map_err(io)?;
    audit_store
        .commit(audit_entries)
        .map_err(|e| StartError::from(RecoveryError::from_log("the audit log", e)))?;
    let audit_index = audit_store.shared_index();

    let metrics = Arc::new(Metrics::default());
    metrics.set_state_gauges(&core.stats());
    metrics
        .audit_entries
        .store(audit_store.len() as u64, Ordering::Relaxed);
    let (tx, rx) = queue::queue();
    let (events, _) = broadcast::channel(EVENT_BUFFER);
    let (state_tx, state_rx) = watch::channel(RunState::Running);
    let (writer_tx, writer_rx) = std::sync::mpsc::channel();

    // What recovery found counts towards the next snapshot, so the log to replay
    // stays bounded across restarts.
    let last_snapshot_bytes = recovered.snapshot.as_ref().map_or(0, |s| s.len() as u64);
    let bytes_since_cut = recovered.records.iter().map(|r| r.len() as u64).sum();
    let (snap_tx, snap_rx) = std::sync::mpsc::channel();
    let supervisor_state = state_tx.clone();
    let thread_error =
        |e: std::io::Error| StartError::internal(format!("cannot start a thread: {e}"));
    let snapshotter = Snapshotter {
        config: config.core.clone(),
        dir: config.data_dir.clone(),
        dir_id: dir_id(&config.data_dir),
        fsync: log_opts.fsync,
        writer: writer_tx.clone(),
        state: state_tx.clone(),
    };
    spawn_fail_stop(
        "fencelock-snapshot",
        "replica",
        state_tx.clone(),
        move || snapshotter.run(recovered, snap_rx),
    )
    .map_err(thread_error)?;
    let writer = Writer {
        log,
        audit: audit_store,
        metrics: metrics.clone(),
        state: state_tx.clone(),
        replica: snap_tx.clone(),
        snapshot_after_bytes: config.snapshot_after_bytes,
        last_snapshot_bytes,
        bytes_since_cut,
        cut_in_flight: false,
        hold_unanswered: log_opts.fsync,
        writer_poll: config.writer_poll,
        #[cfg(test)]
        sync_gate: writer::gate::SYNC_GATE.with(|gate| gate.borrow_mut().take()),
        #[cfg(test)]
        replica_gate: writer::gate::REPLICA_GATE.with(|gate| gate.borrow_mut().take()),
    };
    spawn_fail_stop(
        "fencelock-writer",
        "log writer",
        state_tx.clone(),
        move || writer.run(writer_rx),
    )
    .map_err(thread_error)?;

    let engine = EngineTask {
        core,
        clock,
        rx,
        self_tx: tx.clone(),
        writer: writer_tx.clone(),
        metrics: metrics.clone(),
        events: events.clone(),
        history: history.clone(),
        event_record: (0, 0),
        state: state_tx,
        records: Vec::new(),
        audit: Vec::new(),
        outcomes: Vec::new(),
        next_seq,
        written: Vec::new(),
        event_deliveries: Vec::new(),
        deliveries: Vec::new(),
        listeners: std::collections::HashMap::new(),
        listener_index: std::collections::HashMap::new(),
        draining: false,
        replicated: None,
    };
    let engine_task = tokio::spawn(engine.run());
    // A panic in the engine is a broken invariant: stop serving (fail-stop) and say so.
    tokio::spawn(async move {
        if let Err(e) = engine_task.await {
            if e.is_panic() {
                let what = "the lock engine panicked (a broken invariant); stopped".to_owned();
                tracing::error!(error = %what, "fail-stop");
                let _ = supervisor_state.send(RunState::Failed(what));
            }
        }
    });

    Ok(Handle {
        shared: Arc::new(Shared {
            tx,
            writer: Some(writer_tx),
            cluster: None,
            metrics,
            events,
            history,
            state: state_rx,
            started: Instant::now(),
            recovery: report,
            audit: audit_index,
            next_listener: std::sync::atomic::AtomicU64::new(1),
        }),
    })
}

/// Starts thread `name` running `body`. A panic there (a broken invariant, or a
/// delivery's sink that panicked on the writer thread) fails the engine
/// (fail-stop) with a log line naming `what` and the panic: without it the server
/// would go on answering `/readyz` with 200 while nothing it accepts is written.
fn spawn_fail_stop(
    name: &str,
    what: &'static str,
    state: watch::Sender<RunState>,
    body: impl FnOnce() + Send + 'static,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) else {
                return;
            };
            let why = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "no message".to_owned());
            let what = format!("the {what} thread panicked ({why}); stopped");
            tracing::error!(error = %what, "fail-stop: nothing more will be acknowledged");
            let _ = state.send(RunState::Failed(what));
        })
        .map(drop)
}

struct EngineTask {
    core: Core,
    clock: ServiceClock,
    /// Client requests (bounded) and the engine's own messages, in one FIFO.
    rx: EngineRx,
    self_tx: EngineTx,
    writer: std::sync::mpsc::Sender<WriterMsg>,
    metrics: Arc<Metrics>,
    events: broadcast::Sender<SharedEvent>,
    /// Recent events, for watches to resume from.
    history: Arc<History>,
    /// The index and wall-clock time of the record whose outcomes are routed next:
    /// its events' positions and time.
    event_record: (u64, u64),
    state: watch::Sender<RunState>,
    records: Vec<Vec<u8>>,
    /// Audit entries of this batch.
    audit: Vec<AuditEntry>,
    /// Outcomes of the last applied command, not yet routed.
    outcomes: Vec<Outcome>,
    /// Sequence number of the next log record.
    next_seq: u64,
    /// Replies of this batch that go out once its records are written (releases).
    written: Vec<Delivery>,
    /// Watch events of this batch: they go out after its fdatasync.
    event_deliveries: Vec<Delivery>,
    /// Replies, grants and reads of this batch: they go out after its fdatasync.
    deliveries: Vec<Delivery>,
    /// Clients waiting on a queued request, by the request's owner token.
    listeners: std::collections::HashMap<OwnerToken, Vec<(u128, AcquireReply)>>,
    /// Which queued request each listener waits on.
    listener_index: std::collections::HashMap<u128, (LockName, OwnerToken)>,
    draining: bool,
    /// Cluster mode's state (see [`replicated`]); `None` for a single server.
    replicated: Option<replicated::Replicated>,
}

/// Snapshots write at most this many bytes per byte of log: a snapshot is taken once
/// the log since the last one reaches `snapshot_after_bytes` or the last snapshot's
/// size divided by this, whichever is larger.
///
/// A restart replays that much log at most, and replaying a log record costs about
/// twice what importing the same bytes of snapshot does. At 1 (every snapshot-size of
/// log) a restart with a million locks replayed up to ~900k records, 1.3–2.6 s of
/// it; at 4 it replays at most ~230k, for a snapshot (about 1 s of the replica
/// thread's CPU at a million locks) every quarter state-size of log.
pub const SNAPSHOT_WRITE_AMPLIFICATION: u64 = 4;

/// Most requests applied before a batch goes to the writer.
const MAX_BATCH: usize = 4096;

impl EngineTask {
    async fn run(mut self) {
        // One timer for the next deadline, moved only when that deadline comes
        // earlier: one that fires early costs a tick that finds nothing due, where
        // re-arming it for every batch cost a timer-wheel update per batch.
        let timer = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(timer);
        let mut armed: Option<tokio::time::Instant> = None;
        loop {
            let deadline = self
                .core
                .next_deadline_ms()
                .map(|d| self.clock.instant_of(d));
            if let Some(at) = deadline {
                if armed.is_none_or(|armed| at < armed) {
                    timer.as_mut().reset(at);
                    armed = Some(at);
                }
            }
            let first = tokio::select! {
                msg = self.rx.recv() => msg,
                () = &mut timer, if armed.is_some() => {
                    armed = None;
                    None
                }
            };
            let mut stop = None;
            match first {
                Some(Msg::Shutdown(done)) => stop = Some(done),
                Some(msg) => self.handle(msg),
                None => self.execute(Command::Tick, None),
            }
            if stop.is_none() {
                for _ in 1..MAX_BATCH {
                    match self.rx.try_recv() {
                        Ok(Msg::Shutdown(done)) => {
                            stop = Some(done);
                            break;
                        }
                        Ok(msg) => self.handle(msg),
                        Err(_) => break,
                    }
                }
            }
            if !self.flush() {
                return;
            }
            if let Some(done) = stop {
                let (writer_done_tx, writer_done) = oneshot::channel();
                let _ = self.writer.send(WriterMsg::Stop(writer_done_tx));
                let _ = tokio::task::spawn_blocking(move || writer_done.blocking_recv()).await;
                // A storage failure found while stopping stays the last word.
                self.state.send_if_modified(|state| {
                    let failed = matches!(state, RunState::Failed(_));
                    if !failed {
                        *state = RunState::Stopped;
                    }
                    !failed
                });
                let _ = done.send(());
                return;
            }
        }
    }

    fn handle(&mut self, msg: Msg) {
        match msg {
            Msg::Acquire {
                command,
                caller,
                listener,
                reply,
            } => self.acquire(command, caller, listener, reply),
            Msg::Command {
                command: command @ Command::Release { .. },
                caller,
                reply,
            } => self.release(command, caller, reply),
            Msg::Command {
                command,
                caller,
                reply,
            } => {
                if let Some(missing) = self.foreign_session(&command, &caller) {
                    self.deliveries.push(Delivery::reply(reply, Err(missing)));
                    return;
                }
                self.execute_as(command, caller, Some(reply));
            }
            Msg::CancelListener { listener } => self.cancel_listener(listener),
            Msg::ReleaseOrphan { name, token } => {
                self.execute(Command::Release { name, token }, None);
            }
            Msg::Read(read) => {
                self.execute(Command::Tick, None);
                let answer = read(&self.core, self.core.now_ms());
                self.deliveries.push(Delivery::Read(answer));
            }
            Msg::Drain => self.drain(),
            Msg::Abandon { .. } | Msg::TickDone { .. } => {
                unreachable!("only cluster mode proposes")
            }
            Msg::Shutdown(_) => unreachable!("handled by run"),
        }
    }

    /// Another principal's session answers like a missing one (nothing to apply,
    /// so nothing logged): its existence is not revealed. The owner is told apart
    /// in O(1); only others cost a walk of the session's locks.
    fn foreign_session(&self, command: &Command, caller: &Requester) -> Option<CoreError> {
        let id = match command {
            Command::KeepAlive { id } | Command::CloseSession { id } => *id,
            _ => return None,
        };
        let foreign = match self.core.session_tenant(id) {
            None => false,
            Some(Some(owner)) if Some(owner) == caller.tenant.as_ref() => false,
            Some(_) => self
                .core
                .session(id)
                .is_some_and(|view| !caller.may_manage(&view)),
        };
        foreign.then(|| session_missing(id))
    }

    /// Forgets `listener`; returns the queued request to cancel if it was the
    /// last one waiting on it.
    fn forget_listener(&mut self, listener: u128) -> Option<(LockName, OwnerToken)> {
        let (name, token) = self.listener_index.remove(&listener)?;
        let remaining = self.listeners.get_mut(&token).map(|ls| {
            ls.retain(|(id, _)| *id != listener);
            ls.len()
        });
        if remaining == Some(0) {
            self.listeners.remove(&token);
            return Some((name, token));
        }
        None
    }

    /// Applies one command at the current service time and logs it if it changed
    /// state. Outcomes stay in the core until [`Self::route_outcomes`].
    fn apply_logged(&mut self, command: Command, caller: Requester) -> Result<Reply, CoreError> {
        let now = self.clock.now_ms().max(self.core.now_ms());
        let due = self.core.next_deadline_ms().is_some_and(|d| d <= now);
        let is_tick = matches!(command, Command::Tick);
        let copy = command.clone();
        let result = self.core.apply(now, command);
        let outcomes = self.core.take_outcomes();
        // An error changed nothing but the deadlines it processed; a tick with
        // nothing due changed nothing at all. Neither needs replaying.
        let logged = due || (result.is_ok() && !is_tick);
        let mut meta = RecordMeta {
            seq: 0,
            now_ms: now,
            wall_ms: audit::wall_ms(),
            actor: Some(caller.actor().to_owned()),
        };
        if logged {
            meta.seq = self.next_seq;
            self.next_seq += 1;
            self.records.push(codec::encode_record(&meta, &copy));
        }
        // A command that is not logged changed nothing, so it made no event.
        self.event_record = (meta.seq, meta.wall_ms);
        self.audit
            .extend(audit::entries_for(&meta, &copy, &result, &outcomes));
        self.outcomes.extend(outcomes);
        if matches!(&result, Err(e) if e.kind() == ErrorKind::Held) {
            self.metrics
                .acquire_conflicts
                .fetch_add(1, Ordering::Relaxed);
        }
        result
    }

    /// Applies and logs one command, and queues its reply (to `reply`, if anyone
    /// asked) and its outcomes as deliveries of the current batch.
    fn execute(&mut self, command: Command, reply: Option<CommandReply>) {
        self.execute_as(command, Requester::server(), reply);
    }

    /// [`Self::execute`] on behalf of `actor` (recorded in the audit log).
    fn execute_as(&mut self, command: Command, caller: Requester, reply: Option<CommandReply>) {
        let result = self.apply_logged(command, caller);
        // Events (and hand-offs) first: a watcher sees a change no later than the
        // client whose request made it hears back.
        self.route_outcomes();
        if let Some(reply) = reply {
            self.deliveries.push(Delivery::reply(reply, result));
        }
    }

    /// A holder's release. Its reply goes out once the record is *written* (in the
    /// page cache: it survives a crash of the server process), without waiting for
    /// the fdatasync: saying "released" early risks nothing. Should a power loss
    /// undo the release, the lock is simply still held after the restart until its
    /// lease ends, as if the holder had died before releasing; fences are not
    /// involved, and everything that depends on the release — the grant it hands
    /// to the next waiter, its watch event, its audit entry, another client's
    /// acquire or read — comes later in the log and still waits for the fdatasync
    /// that covers it. The other side of that: watchers see the release's event, and
    /// audit queries and backups its entry and its state, only once that fdatasync
    /// completes, a little after the holder heard "released". Refusals (`not_held`)
    /// reflect others' changes and wait like every other reply; so do operators'
    /// forced releases.
    fn release(&mut self, command: Command, caller: Requester, reply: CommandReply) {
        let result = self.apply_logged(command, caller);
        self.route_outcomes();
        let early = matches!(result, Ok(Reply::Released { .. }));
        let delivery = Delivery::reply(reply, result);
        if early {
            self.written.push(delivery);
        } else {
            self.deliveries.push(delivery);
        }
    }

    fn acquire(
        &mut self,
        command: Command,
        caller: Requester,
        listener: u128,
        reply: AcquireReply,
    ) {
        let Some((name, wait_ms)) = acquire_target(&command) else {
            let err = ApiError::new(ApiErrorKind::InvalidArgument, "name at least one lock");
            self.deliveries
                .push(Delivery::refused(listener, reply, err));
            return;
        };
        if self.draining && wait_ms > 0 {
            let err = ApiError::new(ApiErrorKind::Unavailable, "the server is shutting down");
            self.deliveries
                .push(Delivery::refused(listener, reply, err));
            return;
        }
        let result = self.apply_logged(command, caller);
        self.route_outcomes();
        match result.map_err(ApiError::from).and_then(typed::acquired) {
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
        }
    }

    /// Sends a grant to its listeners once durable; if none of them is still there,
    /// releases it (a lock granted to a departed client must not sit until expiry).
    fn deliver_grant(&mut self, grant: Grant, listeners: Vec<(u128, AcquireReply)>) {
        self.deliveries.push(Delivery::Granted {
            grant,
            listeners,
            orphans: Some(self.self_tx.clone()),
        });
    }

    /// [`Self::deliver_grant`] for a multi-lock request's grants: all released if
    /// nobody takes them.
    fn deliver_grants(&mut self, grants: Vec<Grant>, listeners: Vec<(u128, AcquireReply)>) {
        self.deliveries.push(Delivery::GrantedAll {
            grants,
            listeners,
            orphans: Some(self.self_tx.clone()),
        });
    }

    fn route_outcomes(&mut self) {
        // Events first, so watchers see a change no later than the clients it answers.
        let mut events: Vec<SharedEvent> = Vec::new();
        let mut outcomes = Vec::new();
        let (index, wall_ms) = self.event_record;
        for outcome in std::mem::take(&mut self.outcomes) {
            match outcome {
                Outcome::Event(event) => {
                    let ordinal = u32::try_from(events.len()).unwrap_or(u32::MAX);
                    events.push(Arc::new(WatchEvent {
                        position: Position { index, ordinal },
                        wall_ms,
                        event,
                    }));
                }
                other => outcomes.push(other),
            }
        }
        if !events.is_empty() {
            self.event_deliveries.push(Delivery::Events {
                events,
                metrics: self.metrics.clone(),
                sender: self.events.clone(),
                history: self.history.clone(),
            });
        }
        for outcome in outcomes {
            match outcome {
                Outcome::Granted(grant) => {
                    let listeners = self.take_listeners(grant.token);
                    self.deliver_grant(grant, listeners);
                }
                // Its client listens on the first part's token.
                Outcome::GrantedAll(grants) => {
                    let listeners = match grants.first() {
                        Some(first) => self.take_listeners(first.token),
                        None => Vec::new(),
                    };
                    self.deliver_grants(grants, listeners);
                }
                Outcome::WaitEnded {
                    token,
                    name,
                    reason,
                } => {
                    // A wait cancelled by its client (or by a drain) answers nobody.
                    let listeners = self.take_listeners(token);
                    if !listeners.is_empty() {
                        self.deliveries.push(Delivery::Refused {
                            listeners,
                            error: wait_end_error(&name, reason),
                        });
                    }
                }
                Outcome::Event(_) => {}
            }
        }
    }

    fn take_listeners(&mut self, token: OwnerToken) -> Vec<(u128, AcquireReply)> {
        let listeners = self.listeners.remove(&token).unwrap_or_default();
        for (id, _) in &listeners {
            self.listener_index.remove(id);
        }
        listeners
    }

    fn cancel_listener(&mut self, listener: u128) {
        if let Some((name, token)) = self.forget_listener(listener) {
            self.execute(Command::CancelWait { name, token }, None);
        }
    }

    /// Ends every wait (clients get `unavailable` and retry elsewhere or later) and
    /// refuses new ones, so that graceful shutdown is not held up by long polls.
    fn drain(&mut self) {
        self.draining = true;
        let _ = self.state.send(RunState::Draining);
        let waiting: std::collections::BTreeSet<(LockName, OwnerToken)> =
            self.listener_index.values().cloned().collect();
        for (name, token) in waiting {
            let listeners = self.take_listeners(token);
            self.execute(Command::CancelWait { name, token }, None);
            let error = ApiError::new(ApiErrorKind::Unavailable, "the server is shutting down");
            self.deliveries.push(Delivery::Refused { listeners, error });
        }
    }

    /// Hands the batch to the writer. Returns false if the writer is gone (storage
    /// failed), in which case the engine stops.
    fn flush(&mut self) -> bool {
        self.metrics.set_state_gauges(&self.core.stats());
        if self.records.is_empty()
            && self.written.is_empty()
            && self.event_deliveries.is_empty()
            && self.deliveries.is_empty()
            && self.audit.is_empty()
        {
            return true;
        }
        let batch = WriterMsg::Batch {
            records: std::mem::take(&mut self.records),
            audit: std::mem::take(&mut self.audit),
            written: std::mem::take(&mut self.written),
            events: std::mem::take(&mut self.event_deliveries),
            deliveries: std::mem::take(&mut self.deliveries),
        };
        if self.writer.send(batch).is_err() {
            return false;
        }
        true
    }
}

fn wait_end_error(name: &LockName, reason: WaitEnd) -> ApiError {
    match reason {
        WaitEnd::TimedOut => ApiError::new(
            ApiErrorKind::Timeout,
            format!("lock {name} was not acquired within wait_ms"),
        ),
        WaitEnd::SessionEnded => ApiError::new(
            ApiErrorKind::SessionNotFound,
            format!("the session ended while waiting for {name}"),
        ),
        WaitEnd::Cancelled => ApiError::new(ApiErrorKind::Cancelled, "the wait was cancelled"),
        WaitEnd::ServerRestarted => ApiError::new(
            ApiErrorKind::Unavailable,
            "the server restarted while waiting; retry",
        ),
    }
}

fn count_event(m: &Metrics, event: &Event) {
    m.count_event(crate::vocab::event(event.kind));
    match event.kind {
        EventKind::Granted => {
            m.grants.fetch_add(1, Ordering::Relaxed);
            m.acquire_wait.observe(event.duration_ms);
            m.series.grant(crate::audit::wall_ms(), event.duration_ms);
        }
        EventKind::Ended(end) => {
            let counter = match end {
                GrantEnd::Released => &m.releases,
                GrantEnd::Expired => &m.expiries,
                GrantEnd::ForceReleased => &m.forced_releases,
            };
            counter.fetch_add(1, Ordering::Relaxed);
            m.hold_time.observe(event.duration_ms);
        }
        EventKind::WaitEnded(WaitEnd::TimedOut) => {
            m.wait_timeouts.fetch_add(1, Ordering::Relaxed);
        }
        EventKind::Queued => m.series.queued(crate::audit::wall_ms()),
        EventKind::WaitEnded(_) | EventKind::Downgraded | EventKind::Proclaimed => {}
    }
    match (event.kind, event.mode) {
        (EventKind::Granted, Mode::Shared) => m.grants_shared.fetch_add(1, Ordering::Relaxed),
        (EventKind::Granted, Mode::Exclusive) => m.grants_exclusive.fetch_add(1, Ordering::Relaxed),
        (EventKind::Downgraded, _) => m.downgrades.fetch_add(1, Ordering::Relaxed),
        (EventKind::Proclaimed, _) => m.proclaims.fetch_add(1, Ordering::Relaxed),
        _ => 0,
    };
}

/// The lock an acquire message waits on (a multi-lock request's first) and how long
/// it may wait; `None` for an empty multi-lock request or another command.
fn acquire_target(command: &Command) -> Option<(LockName, u64)> {
    match command {
        Command::Acquire(a) => Some((a.name.clone(), a.wait_ms)),
        Command::AcquireAll(parts) => parts.first().map(|a| (a.name.clone(), a.wait_ms)),
        _ => None,
    }
}

fn session_missing(id: SessionId) -> CoreError {
    CoreError::new(
        ErrorKind::SessionNotFound,
        format!("session {id} does not exist (expired, closed or never opened)"),
    )
}

#[cfg(test)]
mod tests {
    use tokio::sync::mpsc;

    use super::writer::gate::{SyncGate, REPLICA_GATE, SYNC_GATE};
    use super::*;
    use crate::audit::AuditQuery;

    fn acquire_args(name: &LockName, wait_ms: u64) -> AcquireArgs {
        AcquireArgs {
            name: name.clone(),
            ttl_ms: Some(60_000),
            wait_ms,
            owner: Owner::default(),
            request_id: None,
            limit: 1,
            lock_delay_ms: 0,
            session: None,
            mode: Default::default(),
            value: None,
        }
    }

    /// An engine task that is not running: the test hands it messages and takes
    /// the batches it would give the writer.
    fn idle_task() -> (EngineTask, std::sync::mpsc::Receiver<WriterMsg>) {
        let (self_tx, rx) = queue::queue();
        let (writer, batches) = std::sync::mpsc::channel();
        let (events, _) = broadcast::channel(EVENT_BUFFER);
        let (state, _) = watch::channel(RunState::Running);
        let task = EngineTask {
            core: Core::new(CoreConfig::default()),
            clock: ServiceClock {
                base_ms: 1,
                start: tokio::time::Instant::now(),
            },
            rx,
            self_tx,
            writer,
            metrics: Arc::new(Metrics::default()),
            events,
            history: Arc::new(History::new(16, 0)),
            event_record: (0, 0),
            state,
            records: Vec::new(),
            audit: Vec::new(),
            outcomes: Vec::new(),
            next_seq: 1,
            written: Vec::new(),
            event_deliveries: Vec::new(),
            deliveries: Vec::new(),
            listeners: std::collections::HashMap::new(),
            listener_index: std::collections::HashMap::new(),
            draining: false,
            replicated: None,
        };
        (task, batches)
    }

    /// The batch the task hands the writer next (records, written, events,
    /// deliveries).
    type Taken = (Vec<Vec<u8>>, Vec<Delivery>, Vec<Delivery>, Vec<Delivery>);

    fn flushed(task: &mut EngineTask, batches: &std::sync::mpsc::Receiver<WriterMsg>) -> Taken {
        assert!(task.flush());
        match batches.try_recv() {
            Ok(WriterMsg::Batch {
                records,
                written,
                events,
                deliveries,
                ..
            }) => (records, written, events, deliveries),
            Ok(_) => panic!("not a batch"),
            Err(e) => panic!("no batch: {e}"),
        }
    }

    fn acquire_to_channel(
        task: &mut EngineTask,
        name: &LockName,
        wait_ms: u64,
        listener: u128,
    ) -> oneshot::Receiver<Result<Grant, ApiError>> {
        let (tx, rx) = oneshot::channel();
        let msg = handle::acquire_msg(
            &Requester::anonymous(),
            acquire_args(name, wait_ms),
            listener,
            AcquireReply::Channel(tx),
        );
        task.handle(msg);
        rx
    }

    /// Issue 20, item 2 (deliveries as data): a command's reply is queued as a
    /// `Reply` delivery of the batch that carries its record, to go out after that
    /// batch's fdatasync; nothing reaches the client until it is delivered.
    #[tokio::test]
    async fn a_commands_reply_waits_in_its_batch_as_a_reply_delivery() {
        let (mut task, batches) = idle_task();
        let (tx, mut rx) = oneshot::channel();
        task.handle(Msg::Command {
            command: Command::OpenSession {
                id: SessionId::from_u128(7),
                ttl_ms: 60_000,
                owner: Owner::default(),
                tenant: None,
                quota: None,
            },
            caller: Requester::anonymous(),
            reply: CommandReply::Channel(tx),
        });
        let (records, written, events, deliveries) = flushed(&mut task, &batches);
        assert_eq!(records.len(), 1, "the command's record rides in the batch");
        assert!(
            written.is_empty(),
            "only a release goes out before the sync"
        );
        assert!(events.is_empty());
        let [Delivery::Reply {
            result: Ok(Reply::SessionOpened { .. }),
            ..
        }] = deliveries.as_slice()
        else {
            panic!(
                "not one reply with the opened session: {}",
                deliveries.len()
            );
        };
        assert!(
            matches!(rx.try_recv(), Err(oneshot::error::TryRecvError::Empty)),
            "the client heard back before the delivery ran"
        );
        for delivery in deliveries {
            delivery.deliver();
        }
        assert!(matches!(rx.try_recv(), Ok(Ok(Reply::SessionOpened { .. }))));
    }

    /// What a release hands on, as data: the holder's reply goes with the records
    /// written (before the sync), while the hand-off grant to the waiter and the
    /// watch events wait for the sync; a wait that times out is a refusal of the
    /// waiter, also after the sync.
    #[tokio::test]
    async fn a_release_is_answered_on_write_and_its_hand_off_waits_for_the_sync() {
        let (mut task, batches) = idle_task();
        let name = LockName::new("ledger").unwrap();
        let mut holder = acquire_to_channel(&mut task, &name, 0, 1);
        let (_, _, _, deliveries) = flushed(&mut task, &batches);
        let [Delivery::Granted {
            grant, listeners, ..
        }] = deliveries.as_slice()
        else {
            panic!("not one grant");
        };
        assert_eq!(listeners.iter().map(|(id, _)| *id).collect::<Vec<_>>(), [1]);
        let token = grant.token;
        deliveries.into_iter().for_each(Delivery::deliver);
        let first = holder.try_recv().unwrap().unwrap();
        assert_eq!(first.token, token);

        let mut waiter = acquire_to_channel(&mut task, &name, 30_000, 2);
        let (release_tx, mut released) = oneshot::channel();
        task.handle(Msg::Command {
            command: Command::Release {
                name: name.clone(),
                token,
            },
            caller: Requester::anonymous(),
            reply: CommandReply::Channel(release_tx),
        });
        let (records, written, events, deliveries) = flushed(&mut task, &batches);
        assert_eq!(records.len(), 2, "the waiter's acquire and the release");
        assert!(matches!(
            written.as_slice(),
            [Delivery::Reply {
                result: Ok(Reply::Released { released: true }),
                ..
            }]
        ));
        let [Delivery::Granted {
            grant: handed,
            listeners,
            orphans: Some(_),
        }] = deliveries.as_slice()
        else {
            panic!("not one hand-off grant (released if nobody takes it)");
        };
        let handed_fence = handed.fence;
        assert!(handed_fence > first.fence);
        assert_eq!(listeners.iter().map(|(id, _)| *id).collect::<Vec<_>>(), [2]);
        let kinds: Vec<EventKind> = events
            .iter()
            .flat_map(|d| match d {
                Delivery::Events { events, .. } => {
                    events.iter().map(|e| e.kind).collect::<Vec<_>>()
                }
                _ => panic!("not an event delivery among the events"),
            })
            .collect();
        assert!(
            kinds.contains(&EventKind::Ended(GrantEnd::Released)),
            "{kinds:?}"
        );
        assert!(kinds.contains(&EventKind::Granted), "{kinds:?}");
        assert!(
            matches!(waiter.try_recv(), Err(oneshot::error::TryRecvError::Empty)),
            "the hand-off went out before its delivery ran"
        );
        written.into_iter().for_each(Delivery::deliver);
        assert!(matches!(
            released.try_recv(),
            Ok(Ok(Reply::Released { released: true }))
        ));
        assert!(matches!(
            waiter.try_recv(),
            Err(oneshot::error::TryRecvError::Empty)
        ));
        events
            .into_iter()
            .chain(deliveries)
            .for_each(Delivery::deliver);
        assert_eq!(waiter.try_recv().unwrap().unwrap().fence, handed_fence);

        // Draining ends the next wait: the waiter's refusal is data too.
        let mut third = acquire_to_channel(&mut task, &name, 30_000, 3);
        let _ = flushed(&mut task, &batches);
        task.handle(Msg::Drain);
        let (_, _, _, deliveries) = flushed(&mut task, &batches);
        let [Delivery::Refused { listeners, error }] = deliveries.as_slice() else {
            panic!("not one refusal");
        };
        assert_eq!(error.kind(), ApiErrorKind::Unavailable);
        assert_eq!(listeners.iter().map(|(id, _)| *id).collect::<Vec<_>>(), [3]);
        deliveries.into_iter().for_each(Delivery::deliver);
        let refused = third.try_recv().unwrap().unwrap_err();
        assert_eq!(refused.kind(), ApiErrorKind::Unavailable);
    }

    /// A lone release (its group answers nobody, so the writer holds its fdatasync
    /// back for the next batch) still becomes durable, and its event and audit entry
    /// visible, when no next batch comes.
    #[tokio::test]
    async fn a_lone_release_is_synced_without_further_traffic() {
        let dir = tempfile::tempdir().unwrap();
        let handle = start(EngineConfig::new(dir.path())).unwrap();
        let name = LockName::new("nightly").unwrap();
        let grant = handle
            .acquire(&Requester::anonymous(), acquire_args(&name, 0))
            .await
            .unwrap();
        let mut events = handle.subscribe();
        let synced_before = handle.metrics().fsync.count();
        assert!(handle
            .release(&Requester::anonymous(), name.clone(), grant.token)
            .await
            .unwrap());
        let event = tokio::time::timeout(Duration::from_secs(10), events.recv())
            .await
            .expect("the release's event never came: its group was never synced")
            .unwrap();
        assert!(
            matches!(event.kind, EventKind::Ended(GrantEnd::Released)),
            "{event:?}"
        );
        assert_eq!(handle.metrics().fsync.count(), synced_before + 1);
        let entries = handle.audit(&AuditQuery {
            lock: Some("nightly".to_owned()),
            ..AuditQuery::newest(10)
        });
        assert_eq!(
            entries.last().map(|e| e.kind),
            Some(audit::AuditKind::Release)
        );
        handle.shutdown().await;
    }

    /// The replica hears of a group's records after its clients do, yet a backup
    /// asked for after an answer still includes what was answered: it waits for the
    /// writer to feed the replica first.
    #[tokio::test]
    async fn a_backup_asked_for_after_an_answer_includes_it_though_the_replica_hears_later() {
        let dir = tempfile::tempdir().unwrap();
        let gate = Arc::new(SyncGate::default());
        REPLICA_GATE.with(|g| *g.borrow_mut() = Some(gate.clone()));
        let handle = start(EngineConfig::new(dir.path())).unwrap();
        let name = LockName::new("payroll").unwrap();
        gate.set(true);
        let grant = tokio::time::timeout(
            Duration::from_secs(10),
            handle.acquire(&Requester::anonymous(), acquire_args(&name, 0)),
        )
        .await
        .expect("answers go out before the replica is fed")
        .unwrap();
        let opener = gate.clone();
        let open = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            opener.set(false);
        });
        let backup = tokio::time::timeout(Duration::from_secs(10), handle.snapshot())
            .await
            .expect("the backup follows the replica's records")
            .unwrap();
        open.join().unwrap();
        let image = codec::decode_snapshot(&backup).unwrap();
        assert!(
            image.next_fence > grant.fence.get(),
            "the backup misses fence {} that was answered before it was asked for",
            grant.fence
        );
        handle.shutdown().await;
    }

    /// A release is answered once its record is written, before its fdatasync; the
    /// grant it hands to the waiter is not.
    #[tokio::test]
    async fn a_release_is_answered_before_its_fsync_and_its_hand_off_after() {
        let dir = tempfile::tempdir().unwrap();
        let gate = Arc::new(SyncGate::default());
        SYNC_GATE.with(|g| *g.borrow_mut() = Some(gate.clone()));
        let handle = start(EngineConfig::new(dir.path())).unwrap();
        let name = LockName::new("report.csv").unwrap();
        let first = handle
            .acquire(&Requester::anonymous(), acquire_args(&name, 0))
            .await
            .unwrap();
        let waiting = handle.clone();
        let waiter_name = name.clone();
        let mut waiter = tokio::spawn(async move {
            waiting
                .acquire(&Requester::anonymous(), acquire_args(&waiter_name, 30_000))
                .await
        });
        // Reads are answered after the fsync: once one sees the waiter, its queued
        // record is durable and the writer is idle.
        let deadline = Instant::now() + Duration::from_secs(10);
        while handle.lock(name.clone()).await.unwrap().unwrap().waiters != 1 {
            assert!(Instant::now() < deadline, "the waiter never queued");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }

        gate.set(true);
        let released = tokio::time::timeout(
            Duration::from_secs(10),
            handle.release(&Requester::anonymous(), name.clone(), first.token),
        )
        .await
        .expect("a release must be answered without waiting for the fdatasync");
        assert!(released.unwrap());
        // The hand-off grant is in the same record, which is not durable yet.
        assert!(
            tokio::time::timeout(Duration::from_millis(300), &mut waiter)
                .await
                .is_err(),
            "a grant went out before its record was durable"
        );

        gate.set(false);
        let second = tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .expect("the grant follows the fdatasync")
            .unwrap()
            .unwrap();
        assert!(second.fence > first.fence);
        handle.shutdown().await;
    }

    /// A sink gets its grant only once the grant is durable, and a grant its sink
    /// refuses (the wire request was cancelled, or its connection ended) is released
    /// rather than left held until its lease ends.
    #[tokio::test]
    async fn a_sink_hears_of_a_grant_after_its_fsync_and_a_refused_grant_is_released() {
        let dir = tempfile::tempdir().unwrap();
        let gate = Arc::new(SyncGate::default());
        SYNC_GATE.with(|g| *g.borrow_mut() = Some(gate.clone()));
        let handle = start(EngineConfig::new(dir.path())).unwrap();
        let name = LockName::new("ledger").unwrap();

        gate.set(true);
        let (heard, mut answers) = mpsc::unbounded_channel();
        let sink: GrantSink = Box::new(move |result| {
            let _ = heard.send(result);
            false // nobody takes it
        });
        let listener = handle.new_listener();
        handle
            .acquire_to(
                &Requester::anonymous(),
                acquire_args(&name, 0),
                listener,
                sink,
            )
            .unwrap();
        assert!(
            tokio::time::timeout(Duration::from_millis(300), answers.recv())
                .await
                .is_err(),
            "a sink heard of a grant before it was durable"
        );
        gate.set(false);
        let refused = tokio::time::timeout(Duration::from_secs(10), answers.recv())
            .await
            .expect("the grant follows the fdatasync")
            .unwrap()
            .unwrap();

        let deadline = Instant::now() + Duration::from_secs(10);
        while handle
            .lock(name.clone())
            .await
            .unwrap()
            .is_some_and(|view| !view.holders.is_empty())
        {
            assert!(
                Instant::now() < deadline,
                "the refused grant was never released"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let next = handle
            .acquire(&Requester::anonymous(), acquire_args(&name, 0))
            .await
            .unwrap();
        assert!(next.fence > refused.fence);
        handle.shutdown().await;
    }

    /// Issue 19, item 5: a data directory deleted while serving fails the engine
    /// (within the identity check's period), and a shutdown afterwards does not
    /// report a clean stop or write anything at the path.
    #[tokio::test]
    async fn a_deleted_data_directory_fails_the_engine_and_is_no_clean_stop() {
        let parent = tempfile::tempdir().unwrap();
        let dir = parent.path().join("data");
        let handle = start(EngineConfig::new(&dir)).unwrap();
        assert_eq!(handle.state(), RunState::Running);
        std::fs::remove_dir_all(&dir).unwrap();
        let mut state = handle.watch_state();
        // Only whether it came: the `Ref` that `wait_for` returns holds the
        // state's lock, which the engine needs to stop.
        let failed = tokio::time::timeout(
            Duration::from_secs(10),
            state.wait_for(|s| matches!(s, RunState::Failed(_))),
        )
        .await
        .is_ok();
        assert!(failed, "still {:?} 10 s after the delete", handle.state());
        handle.shutdown().await;
        match handle.state() {
            RunState::Failed(why) => assert!(why.contains("deleted or replaced"), "{why}"),
            other => panic!("{other:?}"),
        }
        assert!(!dir.exists(), "something was written at the deleted path");
    }

    /// Issue 20, item 2: with the engine's queue full, a client's request is
    /// refused at once with 503 `unavailable` (and counted), the engine's own
    /// messages still get in, and every request admitted is answered.
    #[tokio::test]
    async fn a_full_queue_refuses_requests_at_once_and_loses_nothing() {
        let dir = tempfile::tempdir().unwrap();
        queue::test_capacity::set(2);
        let handle = start(EngineConfig::new(dir.path())).unwrap();
        let anyone = Requester::anonymous();
        let name = LockName::new("batch").unwrap();
        // A current-thread runtime: the engine task takes nothing from its queue
        // until this test awaits.
        let (heard, mut answers) = mpsc::unbounded_channel();
        let sink = |who: &'static str| -> GrantSink {
            let heard = heard.clone();
            Box::new(move |result| heard.send((who, result)).is_ok())
        };
        let holder = handle.new_listener();
        handle
            .acquire_to(&anyone, acquire_args(&name, 0), holder, sink("holder"))
            .unwrap();
        let waiter = handle.new_listener();
        handle
            .acquire_to(&anyone, acquire_args(&name, 30_000), waiter, sink("waiter"))
            .unwrap();
        let refused = handle
            .acquire_to(
                &anyone,
                acquire_args(&name, 0),
                handle.new_listener(),
                sink("refused"),
            )
            .unwrap_err();
        assert_eq!(refused.kind().http_status(), 503, "{refused}");
        assert_eq!(refused.kind(), ApiErrorKind::Unavailable);
        assert!(refused.message().contains("overloaded"), "{refused}");
        assert_eq!(
            handle.metrics().refused_overloaded.load(Ordering::Relaxed),
            1
        );
        assert!(handle
            .metrics()
            .render()
            .contains("fencelock_requests_refused_total{reason=\"overloaded\"} 1\n"));
        // The waiter's cancellation is the engine's own business: it goes in
        // behind the full queue, and after the acquire it cancels.
        handle.cancel_listener(waiter);

        let (who, granted) = tokio::time::timeout(Duration::from_secs(10), answers.recv())
            .await
            .expect("an admitted acquire was never answered")
            .unwrap();
        assert_eq!(who, "holder");
        let granted = granted.unwrap();
        // Reads are requests too: more of them than the bound, one after another,
        // show the queue's room comes back as the engine takes them.
        for _ in 0..5 {
            let view = handle.lock(name.clone()).await.unwrap().unwrap();
            assert_eq!(view.holders.len(), 1);
            assert_eq!(view.waiters, 0, "the cancellation was lost");
        }
        assert!(handle
            .release(&anyone, name.clone(), granted.token)
            .await
            .unwrap());
        assert!(answers.try_recv().is_err(), "the refused acquire was run");
        assert_eq!(
            handle.metrics().refused_overloaded.load(Ordering::Relaxed),
            1
        );
        handle.shutdown().await;
    }

    /// The fence floor is applied once, at start, and the gauges show the
    /// recovered state before any command (issue 19, items 5 and 8).
    #[tokio::test]
    async fn a_fence_floor_raises_the_next_fence_once_and_the_gauges_show_it() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = EngineConfig::new(dir.path());
        config.fence_floor = 1_000;
        let handle = start(config.clone()).unwrap();
        assert_eq!(handle.recovery().next_fence, 1_000);
        assert_eq!(handle.metrics().next_fence.load(Ordering::Relaxed), 1_000);
        handle.shutdown().await;
        config.fence_floor = 10;
        let handle = start(config.clone()).unwrap();
        assert_eq!(
            handle.recovery().next_fence,
            1_000,
            "a lower floor is a no-op"
        );
        handle.shutdown().await;
        config.fence_floor = fencelock_core::MAX_FENCE_FLOOR + 1;
        let err = start(config).map(|_| ()).unwrap_err();
        assert_eq!(err.kind(), crate::StartErrorKind::Config, "{err}");
    }
}
