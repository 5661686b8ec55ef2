//! The engine: drives the sans-IO core, makes every change durable before anyone
//! hears of it (a holder's own release excepted: see below), and fires timers.
//!
//! Two threads of control:
//! - the **engine task** owns the [`Core`]. It takes requests in batches, stamps each
//!   with the service clock, applies it, encodes it as a log record, and queues the
//!   replies (and hand-off grants, and events) as *deliveries* of the current batch;
//! - the **writer thread** owns the [`Log`]. It takes whole batches, writes them, makes
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
//! Handing the deliveries back to the engine task instead (so the writer starts the
//! next group sooner) measured +5 % at W2 but was reverted on W4 evidence that later
//! proved to be noise; BENCHMARKS.md ("Afternoon work") has the figures.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fencelock_core::{
    Acquire, Command, Config as CoreConfig, Core, Error as CoreError, ErrorKind, Event, EventKind,
    Fence, Grant, GrantEnd, LockName, LockView, Outcome, Owner, OwnerToken, Quota, Reason, Reply,
    RequestId, SessionId, SessionView, Tenant, WaitEnd,
};
use fencelock_log::{Log, LogOptions, Recovered};
use tokio::sync::{broadcast, mpsc, oneshot, watch};

use crate::audit::{self, AuditConfig, AuditEntry, AuditIndex, AuditQuery, AuditStore};
use crate::auth::{Principal, Role};
use crate::codec::{self, RecordMeta};
use crate::error::{ApiError, ApiErrorKind};
use crate::metrics::Metrics;

mod replicated;
#[cfg(feature = "planted-bugs")]
pub use replicated::ClusterBugs;
pub use replicated::{
    start_cluster, start_member, storage_for_tests, ClusterRuntime, ClusterShared, MemberSpec,
};

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
}

/// The default bound of the log writer's polling: up to this long after a small
/// write, while the next batch keeps coming within it, the writer polls its channel
/// instead of sleeping. A sleeping writer is woken by a system call, and on a VM
/// often by the wake-up of a halted vCPU, which cost tens of µs on each request of
/// a lone client (W1 p50 −22 to −29 %, BENCHMARKS.md). The window adapts like the
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
        }
    }
}

/// What recovery found at start.
#[derive(Debug, Clone, Default)]
pub struct RecoveryReport {
    /// Whether a snapshot was loaded.
    pub snapshot_loaded: bool,
    /// Log records replayed after the snapshot.
    pub records_replayed: usize,
    /// Bytes of a torn (never acknowledged) record discarded at the log's tail.
    pub truncated_tail_bytes: u64,
    /// Locks held after recovery.
    pub locks_held: usize,
    /// The next fence.
    pub next_fence: u64,
    /// Time spent recovering.
    pub duration: Duration,
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

/// A lock event after it became durable, for watchers.
pub type SharedEvent = Arc<Event>;

type Delivery = Box<dyn FnOnce() + Send>;
/// A read of the core, given the service time of the read (ms): what views count
/// held and remaining time to.
type Read = Box<dyn FnOnce(&Core, u64) -> Delivery + Send>;

/// Where an acquire's answer goes, called on the thread that delivers it (the writer
/// thread, once the grant is durable): the wire protocol writes it to the client's
/// socket there ([`crate::wire`]). Returns whether anyone took the answer; a grant
/// nobody took is released.
pub(crate) type GrantSink = Box<dyn FnOnce(Result<Grant, ApiError>) -> bool + Send>;

/// Where a command's answer goes, called on the thread that delivers it (see
/// [`GrantSink`]).
pub(crate) type ReplySink = Box<dyn FnOnce(Result<Reply, ApiError>) + Send>;

/// An acquire's answer: to a future awaiting it, or to a sink.
enum AcquireReply {
    Channel(oneshot::Sender<Result<Grant, ApiError>>),
    Sink(GrantSink),
}

impl AcquireReply {
    /// Delivers `result`; false if nobody took it (the asker went away).
    fn send(self, result: Result<Grant, ApiError>) -> bool {
        match self {
            AcquireReply::Channel(tx) => tx.send(result).is_ok(),
            AcquireReply::Sink(sink) => sink(result),
        }
    }
}

/// A command's answer: to a future awaiting it, or to a sink.
enum CommandReply {
    Channel(oneshot::Sender<Result<Reply, ApiError>>),
    Sink(ReplySink),
}

impl CommandReply {
    fn send(self, result: Result<Reply, CoreError>) {
        self.send_api_result(result.map_err(ApiError::from));
    }

    fn send_api(self, error: ApiError) {
        self.send_api_result(Err(error));
    }

    fn send_api_result(self, result: Result<Reply, ApiError>) {
        match self {
            CommandReply::Channel(tx) => {
                let _ = tx.send(result);
            }
            CommandReply::Sink(sink) => sink(result),
        }
    }
}

enum Msg {
    Acquire {
        acquire: Acquire,
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

enum WriterMsg {
    Batch {
        records: Vec<Vec<u8>>,
        /// The audit entries of those records (and of refused renews).
        audit: Vec<AuditEntry>,
        /// Replies that may go out once the records are written, before their
        /// fdatasync: successful releases (see [`EngineTask::release`]).
        written: Vec<Delivery>,
        /// Watch events: after the fdatasync, but nobody's reply waits for them.
        events: Vec<Delivery>,
        /// Replies, grants and reads: after the fdatasync.
        deliveries: Vec<Delivery>,
    },
    /// The snapshot of the state before segment `seq` is durable (and this many bytes
    /// long): drop what it covers.
    Forget {
        seq: u64,
        snapshot_bytes: u64,
    },
    /// Encode the state for a backup, once every change answered before this
    /// message has reached the replica.
    Backup(oneshot::Sender<Vec<u8>>),
    Stop(oneshot::Sender<()>),
}

struct Shared {
    tx: mpsc::UnboundedSender<Msg>,
    /// Backups go through the writer (see [`WriterMsg::Backup`]); `None` in
    /// cluster mode, which has no writer thread.
    writer: Option<std::sync::mpsc::Sender<WriterMsg>>,
    /// Cluster mode: the Raft handle and who leads.
    cluster: Option<Arc<ClusterShared>>,
    metrics: Arc<Metrics>,
    events: broadcast::Sender<SharedEvent>,
    state: watch::Receiver<RunState>,
    started: Instant,
    recovery: RecoveryReport,
    audit: Arc<std::sync::Mutex<AuditIndex>>,
    /// Numbers the acquire calls (their listeners); only ever compared, so a counter
    /// (not a random draw, a system call) is enough.
    next_listener: std::sync::atomic::AtomicU64,
}

/// A cheap, cloneable handle to the engine: what the HTTP and gRPC layers call.
#[derive(Clone)]
pub struct Handle {
    shared: Arc<Shared>,
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

/// What [`recover`] loaded.
pub struct Recovery {
    /// The command log, open for appending.
    pub log: Log,
    /// The state.
    pub core: Core,
    /// What was found.
    pub report: RecoveryReport,
    /// The snapshot and records read.
    pub recovered: Recovered,
    /// The last sequence number and the rebuilt audit entries.
    pub replayed: Replayed,
    /// The audit store (`DATA_DIR/audit`), if asked for.
    pub audit: Option<AuditStore>,
}

/// Loads the state from `dir` (snapshot + log replay) without starting anything.
/// Used at start and by offline tools. With `audit`, also opens the audit store in
/// `dir/audit` (after the command log, whose lock keeps other servers out) and
/// rebuilds the entries of the records past its high-water mark
/// (see [`AuditStore::high_water`]).
pub fn recover(
    log_opts: LogOptions,
    dir: &Path,
    config: &CoreConfig,
    audit: Option<&AuditConfig>,
) -> Result<Recovery, ApiError> {
    let started = Instant::now();
    let storage = |e: fencelock_log::LogError| match e.kind() {
        fencelock_log::LogErrorKind::Locked => ApiError::new(
            ApiErrorKind::Unavailable,
            format!(
                "data dir {} is in use by another fencelock server",
                dir.display()
            ),
        ),
        _ => ApiError::new(ApiErrorKind::Internal, format!("cannot open the log: {e}")),
    };
    let (log, recovered) = Log::open(dir, log_opts.clone()).map_err(storage)?;
    let audit_dir = dir.join("audit");
    if audit.is_some() {
        std::fs::create_dir_all(&audit_dir).map_err(|e| {
            ApiError::new(
                ApiErrorKind::Internal,
                format!("cannot create {}: {e}", audit_dir.display()),
            )
        })?;
    }
    let fsync = log_opts.fsync;
    let open_audit = audit.map(|config| {
        let config = config.clone();
        move || AuditStore::open(&audit_dir, config.clone(), fsync)
    });
    let (core, replayed, audit) = replay(
        config,
        recovered.snapshot.as_deref(),
        &recovered.records,
        dir,
        open_audit.as_ref().map(|f| f as &AuditOpener),
    )?;
    let stats = core.stats();
    let report = RecoveryReport {
        snapshot_loaded: recovered.snapshot.is_some(),
        records_replayed: recovered.records.len(),
        truncated_tail_bytes: recovered.truncated_tail_bytes,
        locks_held: stats.holders,
        next_fence: stats.next_fence,
        duration: started.elapsed(),
    };
    Ok(Recovery {
        log,
        core,
        report,
        recovered,
        replayed,
        audit,
    })
}

/// What a replay found besides the state.
#[derive(Debug, Default)]
pub struct Replayed {
    /// The highest record sequence number replayed (0 if none).
    pub last_seq: u64,
    /// Audit entries rebuilt for records past the audit store's high-water mark.
    pub audit: Vec<AuditEntry>,
}

/// Opens the audit store (on a thread of its own, beside the snapshot import).
type AuditOpener = dyn Fn() -> Result<AuditStore, ApiError> + Sync;

/// Rebuilds a core from a snapshot and the log records after it. With `open_audit`,
/// also opens the audit store and rebuilds the entries of the records past its
/// high-water mark.
pub(crate) fn replay(
    config: &CoreConfig,
    snapshot: Option<&[u8]>,
    records: &[Vec<u8>],
    dir: &Path,
    open_audit: Option<&AuditOpener>,
) -> Result<(Core, Replayed, Option<AuditStore>), ApiError> {
    let corrupt = |what: String| ApiError::new(ApiErrorKind::Internal, what);
    // The log records are decoded, and the audit store is opened (its index is
    // rebuilt from its own log), on other threads while this one decodes and
    // imports the snapshot: the three are independent, and a restart with a
    // million locks spends seconds on them.
    let (core, decoded, audit) = std::thread::scope(|scope| {
        let auditor = open_audit.map(|open| scope.spawn(open));
        let decoder = scope.spawn(|| {
            records
                .iter()
                .enumerate()
                .map(|(i, record)| codec::decode_record(record).map_err(|e| (i, e)))
                .collect::<Result<Vec<_>, _>>()
        });
        let core = match snapshot {
            Some(bytes) => codec::decode_snapshot(bytes)
                .map_err(|e| corrupt(format!("snapshot in {}: {e}", dir.display())))
                .and_then(|image| {
                    // Room for every record to be a grant: growing the tables
                    // mid-replay rehashed a million entries.
                    Core::import_with_room(config.clone(), image, records.len()).map_err(|e| {
                        corrupt(format!(
                            "snapshot in {} is inconsistent: {e}",
                            dir.display()
                        ))
                    })
                }),
            None => {
                let mut core = Core::new(config.clone());
                core.reserve(records.len());
                Ok(core)
            }
        };
        let decoded = decoder.join().expect("the record decoder never panics");
        let audit = auditor
            .map(|auditor| {
                auditor
                    .join()
                    .expect("opening the audit store never panics")
            })
            .transpose();
        (core, decoded, audit)
    });
    // The audit store's errors first, as when it was opened before the replay.
    let audit = audit?;
    let audit_high_water = audit.as_ref().map(AuditStore::high_water);
    let mut core = core?;
    let decoded =
        decoded.map_err(|(i, e)| corrupt(format!("log record {i} in {}: {e}", dir.display())))?;
    let mut replayed = Replayed::default();
    for (meta, command) in decoded {
        replayed.last_seq = replayed.last_seq.max(meta.seq);
        // Replies and outcomes were delivered before the crash; only the state (and
        // the audit entries a crash may have lost) matters.
        match audit_high_water {
            Some(high_water) if meta.seq >= high_water.0 && meta.seq > 0 => {
                let result = core.apply(meta.now_ms.max(core.now_ms()), command.clone());
                let outcomes = core.take_outcomes();
                let entries = audit::entries_for(&meta, &command, &result, &outcomes);
                replayed.audit.extend(audit::missing(high_water, entries));
            }
            _ => {
                let _ = core.apply(meta.now_ms.max(core.now_ms()), command);
                core.discard_outcomes();
            }
        }
    }
    Ok((core, replayed, audit))
}

/// Opens the data directory, recovers, and starts the engine task and writer thread.
/// Must be called inside a tokio runtime.
pub fn start(config: EngineConfig) -> Result<Handle, ApiError> {
    let log_opts = LogOptions {
        segment_bytes: config.segment_bytes,
        fsync: config.durability == Durability::Fsync,
    };
    let Recovery {
        mut log,
        mut core,
        report,
        mut recovered,
        replayed,
        audit,
    } = recover(
        log_opts.clone(),
        &config.data_dir,
        &config.core,
        Some(&config.audit),
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
        ApiError::new(ApiErrorKind::Internal, format!("cannot write the log: {e}"))
    };
    let meta = RecordMeta {
        seq: next_seq,
        now_ms: now,
        wall_ms: audit::wall_ms(),
        actor: Some(SERVER_ACTOR.to_owned()),
    };
    next_seq += 1;
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
            return Err(ApiError::new(
                ApiErrorKind::InvalidArgument,
                format!("fence floor {}: {e}", config.fence_floor),
            ));
        }
        let outcomes = core.take_outcomes();
        let record = codec::encode_record(&meta, &command);
        log.append(&record).map_err(io)?;
        recovered.records.push(record);
        audit_entries.extend(audit::entries_for(&meta, &command, &result, &outcomes));
        tracing::info!(
            floor = config.fence_floor,
            was = report.next_fence,
            "raised the next fence to the configured fence floor"
        );
        report.next_fence = core.stats().next_fence;
    }
    log.sync().map_err(io)?;
    audit_store.commit(audit_entries).map_err(|e| {
        ApiError::new(
            ApiErrorKind::Internal,
            format!("cannot write the audit log: {e}"),
        )
    })?;
    let audit_index = audit_store.shared_index();

    let metrics = Arc::new(Metrics::default());
    metrics.set_state_gauges(&core.stats());
    metrics
        .audit_entries
        .store(audit_store.len() as u64, Ordering::Relaxed);
    let (tx, rx) = mpsc::unbounded_channel();
    let (events, _) = broadcast::channel(EVENT_BUFFER);
    let (state_tx, state_rx) = watch::channel(RunState::Running);
    let (writer_tx, writer_rx) = std::sync::mpsc::channel();

    // What recovery found counts towards the next snapshot, so the log to replay
    // stays bounded across restarts.
    let last_snapshot_bytes = recovered.snapshot.as_ref().map_or(0, |s| s.len() as u64);
    let bytes_since_cut = recovered.records.iter().map(|r| r.len() as u64).sum();
    let (snap_tx, snap_rx) = std::sync::mpsc::channel();
    let supervisor_state = state_tx.clone();
    let thread_error = |e: std::io::Error| {
        ApiError::new(
            ApiErrorKind::Internal,
            format!("cannot start a thread: {e}"),
        )
    };
    let snapshotter = Snapshotter {
        config: config.core.clone(),
        dir: config.data_dir.clone(),
        dir_id: dir_id(&config.data_dir),
        fsync: log_opts.fsync,
        writer: writer_tx.clone(),
        state: state_tx.clone(),
    };
    std::thread::Builder::new()
        .name("fencelock-snapshot".into())
        .spawn(move || snapshotter.run(recovered, snap_rx))
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
        sync_gate: tests::SYNC_GATE.with(|gate| gate.borrow_mut().take()),
        #[cfg(test)]
        replica_gate: tests::REPLICA_GATE.with(|gate| gate.borrow_mut().take()),
    };
    std::thread::Builder::new()
        .name("fencelock-writer".into())
        .spawn(move || writer.run(writer_rx))
        .map_err(thread_error)?;

    let engine = EngineTask {
        core,
        clock,
        rx,
        self_tx: tx.clone(),
        writer: writer_tx.clone(),
        metrics: metrics.clone(),
        events: events.clone(),
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
            state: state_rx,
            started: Instant::now(),
            recovery: report,
            audit: audit_index,
            next_listener: std::sync::atomic::AtomicU64::new(1),
        }),
    })
}

struct EngineTask {
    core: Core,
    clock: ServiceClock,
    rx: mpsc::UnboundedReceiver<Msg>,
    self_tx: mpsc::UnboundedSender<Msg>,
    writer: std::sync::mpsc::Sender<WriterMsg>,
    metrics: Arc<Metrics>,
    events: broadcast::Sender<SharedEvent>,
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
                None => self.execute(Command::Tick, |_| {}),
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
                acquire,
                caller,
                listener,
                reply,
            } => self.acquire(acquire, caller, listener, reply),
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
                    self.deliveries
                        .push(Box::new(move || reply.send(Err(missing))));
                    return;
                }
                self.execute_as(command, caller, move |result| reply.send(result));
            }
            Msg::CancelListener { listener } => self.cancel_listener(listener),
            Msg::ReleaseOrphan { name, token } => {
                self.execute(Command::Release { name, token }, |_| {});
            }
            Msg::Read(read) => {
                self.execute(Command::Tick, |_| {});
                let delivery = read(&self.core, self.core.now_ms());
                self.deliveries.push(delivery);
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

    /// Applies and logs one command, and queues its reply (via `reply`) and its
    /// outcomes as deliveries of the current batch.
    fn execute(
        &mut self,
        command: Command,
        reply: impl FnOnce(Result<Reply, CoreError>) + Send + 'static,
    ) {
        self.execute_as(command, Requester::server(), reply);
    }

    /// [`Self::execute`] on behalf of `actor` (recorded in the audit log).
    fn execute_as(
        &mut self,
        command: Command,
        caller: Requester,
        reply: impl FnOnce(Result<Reply, CoreError>) + Send + 'static,
    ) {
        let result = self.apply_logged(command, caller);
        // Events (and hand-offs) first: a watcher sees a change no later than the
        // client whose request made it hears back.
        self.route_outcomes();
        self.deliveries.push(Box::new(move || reply(result)));
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
        let delivery: Delivery = Box::new(move || reply.send(result));
        if early {
            self.written.push(delivery);
        } else {
            self.deliveries.push(delivery);
        }
    }

    fn acquire(
        &mut self,
        acquire: Acquire,
        caller: Requester,
        listener: u128,
        reply: AcquireReply,
    ) {
        if self.draining && acquire.wait_ms > 0 {
            let err = ApiError::new(ApiErrorKind::Unavailable, "the server is shutting down");
            self.deliveries.push(Box::new(move || {
                let _ = reply.send(Err(err));
            }));
            return;
        }
        let name = acquire.name.clone();
        let result = self.apply_logged(Command::Acquire(acquire), caller);
        self.route_outcomes();
        match result {
            Ok(Reply::Granted(grant)) => self.deliver_grant(grant, vec![(listener, reply)]),
            Ok(Reply::Queued { token, .. }) => {
                self.listeners
                    .entry(token)
                    .or_default()
                    .push((listener, reply));
                self.listener_index.insert(listener, (name, token));
            }
            Ok(other) => unreachable!("acquire replied {other:?}"),
            Err(e) => {
                let err = ApiError::from(e);
                self.deliveries.push(Box::new(move || {
                    let _ = reply.send(Err(err));
                }));
            }
        }
    }

    /// Sends a grant to its listeners once durable; if none of them is still there,
    /// releases it (a lock granted to a departed client must not sit until expiry).
    fn deliver_grant(&mut self, grant: Grant, listeners: Vec<(u128, AcquireReply)>) {
        let orphans = self.self_tx.clone();
        self.deliveries.push(Box::new(move || {
            let mut delivered = false;
            for (_, reply) in listeners {
                delivered |= reply.send(Ok(grant.clone()));
            }
            if !delivered {
                let _ = orphans.send(Msg::ReleaseOrphan {
                    name: grant.name,
                    token: grant.token,
                });
            }
        }));
    }

    fn route_outcomes(&mut self) {
        // Events first, so watchers see a change no later than the clients it answers.
        let mut events: Vec<SharedEvent> = Vec::new();
        let mut outcomes = Vec::new();
        for outcome in std::mem::take(&mut self.outcomes) {
            match outcome {
                Outcome::Event(event) => events.push(Arc::new(event)),
                other => outcomes.push(other),
            }
        }
        if !events.is_empty() {
            let metrics = self.metrics.clone();
            let sender = self.events.clone();
            self.event_deliveries.push(Box::new(move || {
                for event in events {
                    count_event(&metrics, &event);
                    // No watcher is not an error.
                    let _ = sender.send(event);
                }
            }));
        }
        for outcome in outcomes {
            match outcome {
                Outcome::Granted(grant) => {
                    let listeners = self.take_listeners(grant.token);
                    self.deliver_grant(grant, listeners);
                }
                Outcome::WaitEnded {
                    token,
                    name,
                    reason,
                } => {
                    let listeners = self.take_listeners(token);
                    let err = wait_end_error(&name, reason);
                    self.deliveries.push(Box::new(move || {
                        for (_, reply) in listeners {
                            let _ = reply.send(Err(err.clone()));
                        }
                    }));
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
            self.execute(Command::CancelWait { name, token }, |_| {});
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
            self.execute(Command::CancelWait { name, token }, |_| {});
            let err = ApiError::new(ApiErrorKind::Unavailable, "the server is shutting down");
            self.deliveries.push(Box::new(move || {
                for (_, reply) in listeners {
                    let _ = reply.send(Err(err.clone()));
                }
            }));
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
    match event.kind {
        EventKind::Granted => {
            m.grants.fetch_add(1, Ordering::Relaxed);
            m.acquire_wait.observe(event.duration_ms);
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
        EventKind::Queued | EventKind::WaitEnded(_) => {}
    }
}

/// What the writer has written and still has to sync and deliver.
#[derive(Default)]
struct Group {
    durable: Vec<Vec<u8>>,
    audit: Vec<AuditEntry>,
    events: Vec<Delivery>,
    deliveries: Vec<Delivery>,
}

/// How long the writer holds back the fdatasync of a group that answers nobody
/// (see `Writer::run`). Bounds how much later than its holder's answer a lone
/// release's event and audit entry appear.
const HOLD_UNANSWERED_GROUP: Duration = Duration::from_millis(1);

/// How often the writer checks that the data directory is still the one it
/// opened (`Log::check_identity`: six `stat` calls). Checking before every
/// fdatasync would cost each group commit; this bounds how long a deleted or
/// replaced directory goes unnoticed (issue 19, item 5). Rolls, snapshots and the
/// shutdown check too.
const IDENTITY_CHECK_EVERY: Duration = Duration::from_millis(200);

/// Whether the writer may hold `group`, held for `held_for` so far, back for the next
/// batch's fdatasync: only if it has records to sync, nobody's reply waits for it,
/// and it has not been held for [`HOLD_UNANSWERED_GROUP`] already (a stream of lone
/// releases must not keep their events and audit entries back forever).
fn may_hold(group: &Group, held_for: Duration) -> bool {
    !group.durable.is_empty() && group.deliveries.is_empty() && held_for < HOLD_UNANSWERED_GROUP
}

/// The first poll window once batches are seen to follow each other closely (or
/// the bound, if that is smaller).
const SPIN_START: Duration = Duration::from_micros(50);
/// The largest write (records) after which the writer still polls: a larger one
/// means many clients at once, whose work needs the cores more than the writer
/// needs a fast wake-up.
const SPIN_MAX_RECORDS: usize = 2;

/// How long the writer polls its channel before it sleeps (see
/// [`DEFAULT_WRITER_POLL`]): the window grows while the next batch keeps arriving
/// within `max` of the last write, shrinks to nothing when it does not, and is shut
/// after writes of more than [`SPIN_MAX_RECORDS`] records.
#[derive(Debug)]
struct SpinPolicy {
    window: Duration,
    /// The bound of the window ([`EngineConfig::writer_poll`]).
    max: Duration,
    /// Records written since the last receive.
    records: usize,
}

impl SpinPolicy {
    fn new(max: Duration) -> SpinPolicy {
        SpinPolicy {
            window: Duration::ZERO,
            max,
            records: 0,
        }
    }

    /// Receives the next message: polls for up to the window (never past
    /// `deadline`), then blocks (until `deadline`, if any).
    fn recv<T>(
        &mut self,
        rx: &std::sync::mpsc::Receiver<T>,
        deadline: Option<Instant>,
    ) -> Result<T, std::sync::mpsc::RecvTimeoutError> {
        use std::sync::mpsc::{RecvTimeoutError, TryRecvError};
        let started = Instant::now();
        let mut until = started + self.window();
        if let Some(deadline) = deadline {
            until = until.min(deadline);
        }
        loop {
            match rx.try_recv() {
                Ok(msg) => {
                    self.observe(started.elapsed());
                    return Ok(msg);
                }
                Err(TryRecvError::Disconnected) => return Err(RecvTimeoutError::Disconnected),
                Err(TryRecvError::Empty) if Instant::now() < until => std::hint::spin_loop(),
                Err(TryRecvError::Empty) => break,
            }
        }
        let got = match deadline {
            None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
            Some(deadline) => rx.recv_timeout(deadline.saturating_duration_since(Instant::now())),
        };
        if got.is_ok() {
            self.observe(started.elapsed());
        }
        got
    }

    /// The poll window for the next receive.
    fn window(&self) -> Duration {
        if self.records > SPIN_MAX_RECORDS {
            Duration::ZERO
        } else {
            self.window
        }
    }

    /// Adapts the window to a message that came `waited` after the receive began.
    fn observe(&mut self, waited: Duration) {
        if self.records > SPIN_MAX_RECORDS {
            self.window = Duration::ZERO;
        } else if waited <= self.window {
            // Caught while polling: keep the window.
        } else if waited <= self.max {
            // A wider window would have caught it.
            self.window = (self.window * 2).clamp(SPIN_START.min(self.max), self.max);
        } else {
            // Too far apart to poll for: halve, down to nothing.
            self.window /= 2;
            if self.window < SPIN_START / 4 {
                self.window = Duration::ZERO;
            }
        }
    }
}

/// The writer thread: appends batches, syncs once per group, feeds the replica,
/// runs deliveries, and cuts the log for snapshots.
struct Writer {
    log: Log,
    audit: AuditStore,
    metrics: Arc<Metrics>,
    state: watch::Sender<RunState>,
    replica: std::sync::mpsc::Sender<ReplicaMsg>,
    snapshot_after_bytes: u64,
    last_snapshot_bytes: u64,
    bytes_since_cut: u64,
    cut_in_flight: bool,
    /// Whether to hold back groups that answer nobody (only when syncing: without
    /// fdatasync there is nothing to share).
    hold_unanswered: bool,
    /// The bound of the writer's polling for the next batch.
    writer_poll: Duration,
    /// Tests hold the fdatasync here to see what goes out before it.
    #[cfg(test)]
    sync_gate: Option<Arc<tests::SyncGate>>,
    /// Tests hold the writer here, after a group's answers and before the replica
    /// hears of its records.
    #[cfg(test)]
    replica_gate: Option<Arc<tests::SyncGate>>,
}

impl Writer {
    fn fail(&self, what: String) {
        tracing::error!(error = %what, "storage failed; stopping (fail-stop): nothing more will be acknowledged");
        let _ = self.state.send(RunState::Failed(what));
    }

    /// False (and the engine failed) if the data directory is no longer the one
    /// the log opened.
    fn check_identity(&mut self) -> bool {
        match self.log.check_identity() {
            Ok(()) => true,
            Err(e) => {
                self.fail(format!(
                    "data directory {} was deleted or replaced while serving; stopped \
                     acknowledging (what was acknowledged since it went is gone with it; \
                     restart with --fence-floor): {e}",
                    self.log.dir().display()
                ));
                false
            }
        }
    }

    /// Makes a group durable (one fdatasync), appends its audit entries, feeds the
    /// replica, runs its events and deliveries, and cuts the log for a snapshot when
    /// due. False if storage failed (the writer has stopped).
    fn commit(&mut self, group: Group) -> bool {
        let Group {
            durable,
            audit: audit_entries,
            events,
            deliveries,
        } = group;
        if !durable.is_empty() {
            #[cfg(test)]
            if let Some(gate) = &self.sync_gate {
                gate.pass();
            }
            let started = Instant::now();
            if let Err(e) = self.log.sync() {
                self.fail(format!("sync: {e}"));
                return false;
            }
            self.metrics
                .fsync
                .observe(started.elapsed().as_micros() as u64);
            self.metrics.batch_size.observe(durable.len() as u64);
        }
        // The audit entries of the records just made durable go to the audit
        // log (and its index, for queries) before anyone hears of the change.
        // They are synced before the records they derive from may be dropped
        // (Forget, in `run`); until then a crash is repaired at start by replaying
        // the records past the audit store's high-water mark.
        if !audit_entries.is_empty() {
            let started = Instant::now();
            if let Err(e) = self.audit.append(audit_entries) {
                self.fail(format!("audit log: {e}"));
                return false;
            }
            self.metrics
                .audit_write
                .observe(started.elapsed().as_micros() as u64);
            self.metrics
                .audit_entries
                .store(self.audit.len() as u64, Ordering::Relaxed);
        }
        // Events first: a watcher sees a change no later than the client it answers
        // (releases excepted: they were answered once written).
        for delivery in events.into_iter().chain(deliveries) {
            delivery();
        }
        // The replica hears of the records after the clients do: waking its thread
        // is a system call (and, on a VM, often a wake-up of an idle vCPU) that
        // would otherwise sit between the fdatasync and every answer. A backup
        // still includes every change answered before it was asked for: it is
        // asked of the writer (`WriterMsg::Backup`), which passes it on only after
        // this send, in the same channel.
        if !durable.is_empty() {
            #[cfg(test)]
            if let Some(gate) = &self.replica_gate {
                gate.pass();
            }
            let _ = self.replica.send(ReplicaMsg::Records(durable));
        }
        // Snapshot once the log since the last one is as large as the configured
        // threshold or a quarter of the last snapshot, whichever is larger:
        // recovery then replays at most that much log, and snapshots never write
        // more than four times what the log did.
        let threshold = self
            .snapshot_after_bytes
            .max(self.last_snapshot_bytes / SNAPSHOT_WRITE_AMPLIFICATION);
        if self.bytes_since_cut >= threshold && !self.cut_in_flight {
            match self.log.start_segment() {
                Ok(seq) => {
                    self.bytes_since_cut = 0;
                    self.cut_in_flight = true;
                    let _ = self.replica.send(ReplicaMsg::Cut(seq));
                }
                Err(e) => {
                    self.fail(format!("start a segment: {e}"));
                    return false;
                }
            }
        }
        true
    }

    fn run(mut self, rx: std::sync::mpsc::Receiver<WriterMsg>) {
        // Written but not yet synced: a group whose every reply already went out
        // (releases), held back for the next batch to share its fdatasync, and
        // since when.
        let mut held: Option<(Group, Instant)> = None;
        let mut spin = SpinPolicy::new(self.writer_poll);
        let mut next_check = Instant::now() + IDENTITY_CHECK_EVERY;
        loop {
            if Instant::now() >= next_check {
                next_check = Instant::now() + IDENTITY_CHECK_EVERY;
                if !self.check_identity() {
                    return;
                }
            }
            let first = match &held {
                None => match spin.recv(&rx, Some(next_check)) {
                    Ok(first) => first,
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
                },
                Some((_, since)) => match spin.recv(&rx, Some(*since + HOLD_UNANSWERED_GROUP)) {
                    Ok(first) => first,
                    Err(timeout_or_gone) => {
                        let (group, _) = held.take().expect("matched Some");
                        if !self.commit(group) {
                            return;
                        }
                        match timeout_or_gone {
                            std::sync::mpsc::RecvTimeoutError::Timeout => continue,
                            std::sync::mpsc::RecvTimeoutError::Disconnected => return,
                        }
                    }
                },
            };
            // Group commit: every batch that queued up while the last sync ran, up
            // to (and including) the next control message, which must see them
            // durable.
            let mut pending = vec![first];
            while matches!(pending.last(), Some(WriterMsg::Batch { .. })) {
                match rx.try_recv() {
                    Ok(more) => pending.push(more),
                    Err(_) => break,
                }
            }
            let (mut group, held_since) = match held.take() {
                Some((group, since)) => (group, Some(since)),
                None => (Group::default(), None),
            };
            let mut written = Vec::new();
            let mut after = None;
            spin.records = 0;
            for msg in pending {
                match msg {
                    WriterMsg::Batch {
                        records,
                        audit,
                        written: w,
                        events,
                        deliveries,
                    } => {
                        group.audit.extend(audit);
                        spin.records += records.len();
                        for record in &records {
                            if let Err(e) = self.log.append(record) {
                                return self.fail(format!("append: {e}"));
                            }
                            self.bytes_since_cut += record.len() as u64;
                        }
                        group.durable.extend(records);
                        written.extend(w);
                        group.events.extend(events);
                        group.deliveries.extend(deliveries);
                    }
                    other => after = Some(other),
                }
            }
            // Releases are answered once their records are written (see
            // `EngineTask::release`); the rest waits for the fdatasync.
            if !written.is_empty() {
                if let Err(e) = self.log.write() {
                    return self.fail(format!("write: {e}"));
                }
                for delivery in written {
                    delivery();
                }
            }
            // A group that answers nobody (a lone release: its holder has its
            // answer; only its event and audit entry wait) is held for the next
            // batch, HOLD_UNANSWERED_GROUP at most from when it was first held: a
            // client that releases and then acquires would otherwise find the
            // writer in the release's fdatasync and wait for it before its own
            // could start.
            if self.hold_unanswered && after.is_none() {
                let since = held_since.unwrap_or_else(Instant::now);
                if may_hold(&group, since.elapsed()) {
                    held = Some((group, since));
                    continue;
                }
            }
            if !self.commit(group) {
                return;
            }
            match after {
                Some(WriterMsg::Forget {
                    seq,
                    snapshot_bytes,
                }) => {
                    self.cut_in_flight = false;
                    self.last_snapshot_bytes = snapshot_bytes;
                    // The audit entries of the records about to be dropped can no
                    // longer be rebuilt from them: make them durable first.
                    if let Err(e) = self.audit.sync() {
                        return self.fail(format!("audit log sync: {e}"));
                    }
                    if let Err(e) = self.log.forget_before(seq) {
                        return self.fail(format!("drop log covered by snapshot {seq}: {e}"));
                    }
                }
                Some(WriterMsg::Backup(reply)) => {
                    let _ = self.replica.send(ReplicaMsg::Backup(reply));
                }
                Some(WriterMsg::Stop(done)) => {
                    // A directory that vanished is no clean stop: say so (the
                    // engine then does not report `Stopped`).
                    if !self.check_identity() {
                        return;
                    }
                    // A clean stop leaves nothing to rebuild.
                    if let Err(e) = self.audit.sync() {
                        return self.fail(format!("audit log sync: {e}"));
                    }
                    // A snapshot the replica is writing must land while the data
                    // directory is still ours; then close the logs (releasing their
                    // directory locks) before saying we stopped: a server started
                    // right after must find neither the directory in use nor a
                    // snapshot appearing under its feet.
                    let (replica_done, replica_stopped) = oneshot::channel();
                    if self.replica.send(ReplicaMsg::Stop(replica_done)).is_ok() {
                        let _ = replica_stopped.blocking_recv();
                    }
                    drop(self);
                    let _ = done.send(());
                    return;
                }
                Some(WriterMsg::Batch { .. }) | None => {}
            }
        }
    }
}

/// What the replica thread is told.
enum ReplicaMsg {
    /// Durable records, in log order.
    Records(Vec<Vec<u8>>),
    /// The log was cut before segment `seq`: snapshot the state here.
    Cut(u64),
    /// Encode the current state for a backup.
    Backup(oneshot::Sender<Vec<u8>>),
    /// Finish what was asked before (a snapshot in progress) and stop.
    Stop(oneshot::Sender<()>),
}

/// The replica thread: a second core that replays durable records, so snapshots
/// (and backups) are taken without pausing the engine. It costs a second copy of
/// the state in memory and about one more `apply` per command of CPU.
struct Snapshotter {
    config: CoreConfig,
    dir: PathBuf,
    /// Device and inode of `dir` at start: a snapshot is written by path, and
    /// never into a directory that replaced ours.
    dir_id: Option<(u64, u64)>,
    fsync: bool,
    writer: std::sync::mpsc::Sender<WriterMsg>,
    state: watch::Sender<RunState>,
}

impl Snapshotter {
    fn fail(&self, what: String) {
        tracing::error!(error = %what, "snapshot failed; stopping (fail-stop)");
        let _ = self.state.send(RunState::Failed(what));
    }

    fn run(self, recovered: Recovered, rx: std::sync::mpsc::Receiver<ReplicaMsg>) {
        // Built here, off the start-up path: the engine already serves.
        let mut replica = match replay(
            &self.config,
            recovered.snapshot.as_deref(),
            &recovered.records,
            &self.dir,
            None,
        ) {
            Ok((core, _, _)) => core,
            Err(e) => return self.fail(format!("replica: {e}")),
        };
        drop(recovered);
        while let Ok(msg) = rx.recv() {
            match msg {
                ReplicaMsg::Records(records) => {
                    for record in records {
                        match codec::decode_record(&record) {
                            Ok((meta, command)) => {
                                let _ = replica.apply(meta.now_ms.max(replica.now_ms()), command);
                                replica.discard_outcomes();
                            }
                            Err(e) => {
                                return self.fail(format!("replica cannot decode a record: {e}"))
                            }
                        }
                    }
                }
                ReplicaMsg::Cut(seq) => {
                    if dir_id(&self.dir) != self.dir_id {
                        return self.fail(format!(
                            "data directory {} was deleted or replaced while serving; \
                             snapshot {seq} not written",
                            self.dir.display()
                        ));
                    }
                    let started = Instant::now();
                    let bytes = codec::encode_snapshot(&replica.export());
                    if let Err(e) =
                        fencelock_log::write_snapshot_at(&self.dir, seq, &bytes, self.fsync)
                    {
                        return self.fail(format!("write snapshot {seq}: {e}"));
                    }
                    tracing::info!(
                        segment = seq,
                        bytes = bytes.len(),
                        took_ms = started.elapsed().as_millis() as u64,
                        "snapshot written"
                    );
                    let forget = WriterMsg::Forget {
                        seq,
                        snapshot_bytes: bytes.len() as u64,
                    };
                    if self.writer.send(forget).is_err() {
                        return; // the writer stopped; the next start recovers from the snapshot
                    }
                }
                ReplicaMsg::Backup(reply) => {
                    let _ = reply.send(codec::encode_snapshot(&replica.export()));
                }
                ReplicaMsg::Stop(done) => {
                    let _ = done.send(());
                    return;
                }
            }
        }
    }
}

/// Device and inode of `path`, if it exists.
fn dir_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// The message of an acquire with a fresh owner token.
fn acquire_msg(caller: &Requester, args: AcquireArgs, listener: u128, reply: AcquireReply) -> Msg {
    Msg::Acquire {
        caller: caller.clone(),
        acquire: Acquire {
            name: args.name,
            token: OwnerToken::from_u128(random_u128()),
            ttl_ms: args.ttl_ms,
            wait_ms: args.wait_ms,
            owner: args.owner,
            request_id: args.request_id,
            limit: args.limit,
            lock_delay_ms: args.lock_delay_ms,
            session: args.session,
            tenant: caller.tenant.clone(),
            quota: caller.quota,
        },
        listener,
        reply,
    }
}

/// Cancels a wait if the acquiring future is dropped before it finished; releases the
/// grant if it arrived but was never read.
struct AcquireGuard {
    shared: Arc<Shared>,
    listener: u128,
    rx: Option<oneshot::Receiver<Result<Grant, ApiError>>>,
}

impl Drop for AcquireGuard {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else {
            return;
        };
        match rx.try_recv() {
            Ok(Ok(grant)) => {
                let _ = self.shared.tx.send(Msg::ReleaseOrphan {
                    name: grant.name,
                    token: grant.token,
                });
            }
            Ok(Err(_)) | Err(oneshot::error::TryRecvError::Closed) => {}
            Err(oneshot::error::TryRecvError::Empty) => {
                let _ = self.shared.tx.send(Msg::CancelListener {
                    listener: self.listener,
                });
            }
        }
    }
}

fn handle_missing(handle: &str) -> ApiError {
    ApiError::new(
        ApiErrorKind::SessionNotFound,
        format!(
            "no session with handle {handle} you may manage (expired, closed, never opened, or not within your prefixes)"
        ),
    )
}

fn session_missing(id: SessionId) -> CoreError {
    CoreError::new(
        ErrorKind::SessionNotFound,
        format!("session {id} does not exist (expired, closed or never opened)"),
    )
}

fn unavailable() -> ApiError {
    ApiError::new(
        ApiErrorKind::Unavailable,
        "the lock engine is not running (shutting down or storage failed)",
    )
}

impl Handle {
    fn send(&self, msg: Msg) -> Result<(), ApiError> {
        self.shared.tx.send(msg).map_err(|_| unavailable())
    }

    async fn command(&self, caller: &Requester, command: Command) -> Result<Reply, ApiError> {
        let (tx, rx) = oneshot::channel();
        self.send(Msg::Command {
            command,
            caller: caller.clone(),
            reply: CommandReply::Channel(tx),
        })?;
        match rx.await {
            Ok(result) => result,
            Err(_) => Err(unavailable()),
        }
    }

    /// Reads the core's state after everything before it is durable.
    /// In cluster mode the read is linearizable: the leader confirms it still leads
    /// (ReadIndex) and reads once everything committed before is applied; another
    /// member answers `not_leader`.
    pub async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Core) -> T + Send + 'static,
    ) -> Result<T, ApiError> {
        self.read_at(move |core, _| f(core), false).await
    }

    /// Reads this member's state as applied so far, without asking the leader
    /// (`?stale=true`): possibly behind the cluster. The same as
    /// [`Handle::read`] on a single server.
    pub async fn read_local<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Core) -> T + Send + 'static,
    ) -> Result<T, ApiError> {
        self.read_at(move |core, _| f(core), true).await
    }

    /// [`Handle::read`] (or with `stale`, [`Handle::read_local`]), with the
    /// service time of the read for `f`: on a single server the time of the tick
    /// that precedes every read; on a cluster member its clock at the read (see
    /// `EngineTask::read_time_ms`), so views do not stop at the last applied
    /// command's time while the cluster is idle.
    async fn read_at<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Core, u64) -> T + Send + 'static,
        stale: bool,
    ) -> Result<T, ApiError> {
        // A member importing a single server's state would show an empty one.
        if self.shared.cluster().is_some_and(|c| c.importing()) {
            return Err(replicated::importing_error());
        }
        if let (Some(cluster), false) = (self.shared.cluster(), stale) {
            cluster.read_barrier().await?;
        }
        let (tx, rx) = oneshot::channel();
        self.send(Msg::Read(Box::new(move |core, now_ms| {
            let value = f(core, now_ms);
            Box::new(move || {
                let _ = tx.send(value);
            })
        })))?;
        rx.await.map_err(|_| unavailable())
    }

    /// Acquires a lock, waiting up to `args.wait_ms`. Dropping the future cancels the
    /// wait; a grant that arrives for a dropped future is released.
    pub async fn acquire(&self, caller: &Requester, args: AcquireArgs) -> Result<Grant, ApiError> {
        let listener = self.new_listener();
        let (tx, rx) = oneshot::channel();
        self.send(acquire_msg(
            caller,
            args,
            listener,
            AcquireReply::Channel(tx),
        ))?;
        let mut guard = AcquireGuard {
            shared: self.shared.clone(),
            listener,
            rx: Some(rx),
        };
        let result = guard.rx.as_mut().expect("set above").await;
        guard.rx = None;
        result.unwrap_or_else(|_| Err(unavailable()))
    }

    /// A fresh listener id for [`Handle::acquire_to`].
    pub(crate) fn new_listener(&self) -> u128 {
        u128::from(self.shared.next_listener.fetch_add(1, Ordering::Relaxed))
    }

    /// Sends an acquire whose answer goes to `sink` (see [`GrantSink`]) rather than
    /// to an awaiting future. `listener` (from [`Handle::new_listener`]) is what
    /// [`Handle::cancel_listener`] takes to stop the wait.
    pub(crate) fn acquire_to(
        &self,
        caller: &Requester,
        args: AcquireArgs,
        listener: u128,
        sink: GrantSink,
    ) -> Result<(), ApiError> {
        self.send(acquire_msg(
            caller,
            args,
            listener,
            AcquireReply::Sink(sink),
        ))
    }

    /// The client behind `listener` stopped waiting: its request leaves the queue (a
    /// grant already on its way finds the sink refusing it and is released).
    pub(crate) fn cancel_listener(&self, listener: u128) {
        let _ = self.send(Msg::CancelListener { listener });
    }

    /// Sends a client's `command` (a renew or a release) whose answer goes to `sink`
    /// (see [`ReplySink`]) rather than to an awaiting future.
    pub(crate) fn command_to(
        &self,
        caller: &Requester,
        command: Command,
        sink: ReplySink,
    ) -> Result<(), ApiError> {
        self.send(Msg::Command {
            command,
            caller: caller.clone(),
            reply: CommandReply::Sink(sink),
        })
    }

    /// Extends a lease (or the holding session).
    pub async fn renew(
        &self,
        caller: &Requester,
        name: LockName,
        token: OwnerToken,
        ttl_ms: Option<u64>,
    ) -> Result<Grant, ApiError> {
        match self
            .command(
                caller,
                Command::Renew {
                    name,
                    token,
                    ttl_ms,
                },
            )
            .await?
        {
            Reply::Renewed(grant) => Ok(grant),
            other => unreachable!("renew replied {other:?}"),
        }
    }

    /// Releases a grant. `Ok(false)`: this token had already released it.
    pub async fn release(
        &self,
        caller: &Requester,
        name: LockName,
        token: OwnerToken,
    ) -> Result<bool, ApiError> {
        match self
            .command(caller, Command::Release { name, token })
            .await?
        {
            Reply::Released { released } => Ok(released),
            other => unreachable!("release replied {other:?}"),
        }
    }

    /// Operator action: takes a lock from its holder(s). Returns the fences taken.
    /// The audit log records the caller as the actor, with the reason.
    pub async fn force_release(
        &self,
        caller: &Requester,
        name: LockName,
        fence: Option<Fence>,
        reason: Reason,
    ) -> Result<Vec<Fence>, ApiError> {
        tracing::warn!(lock = %name, ?fence, reason = reason.as_str(), actor = caller.actor(), "forced release requested");
        match self
            .command(
                caller,
                Command::ForceRelease {
                    name,
                    fence,
                    reason,
                },
            )
            .await?
        {
            Reply::ForceReleased { fences } => Ok(fences),
            other => unreachable!("force release replied {other:?}"),
        }
    }

    /// Opens a session owned by the caller's principal (within its quota); returns
    /// its id, which only the caller learns.
    pub async fn open_session(
        &self,
        caller: &Requester,
        ttl_ms: u64,
        owner: Owner,
    ) -> Result<(SessionId, u64), ApiError> {
        let id = SessionId::from_u128(random_u128());
        let command = Command::OpenSession {
            id,
            ttl_ms,
            owner,
            tenant: caller.tenant.clone(),
            quota: caller.quota,
        };
        match self.command(caller, command).await? {
            Reply::SessionOpened { id, ttl_ms } => Ok((id, ttl_ms)),
            other => unreachable!("open session replied {other:?}"),
        }
    }

    /// Renews a session; returns its ttl. Another principal's session (see
    /// [`Requester::may_manage`]) is `session_not_found`, like a missing one.
    pub async fn keep_alive(&self, caller: &Requester, id: SessionId) -> Result<u64, ApiError> {
        match self.command(caller, Command::KeepAlive { id }).await? {
            Reply::KeptAlive { ttl_ms } => Ok(ttl_ms),
            other => unreachable!("keepalive replied {other:?}"),
        }
    }

    /// Closes a session; returns how many locks it released. Another principal's
    /// session (see [`Requester::may_manage`]) is `session_not_found`.
    pub async fn close_session(
        &self,
        caller: &Requester,
        id: SessionId,
    ) -> Result<usize, ApiError> {
        match self.command(caller, Command::CloseSession { id }).await? {
            Reply::SessionClosed { released } => Ok(released),
            other => unreachable!("close session replied {other:?}"),
        }
    }

    /// An admin closes the session with handle `handle` (see
    /// `input::session_handle`) if [`Requester::may_manage`] allows; the audit
    /// log names the admin. Returns how many locks it released.
    ///
    /// The handle is resolved off the engine (hashing every open session's id is
    /// O(sessions): a million take a fraction of a second the engine must not
    /// stall for), then the close goes through the same ownership check as by id.
    pub async fn close_session_by_handle(
        &self,
        caller: &Requester,
        handle: String,
    ) -> Result<usize, ApiError> {
        let ids = self.read(|core| core.session_ids()).await?;
        let wanted = handle.clone();
        let found: Vec<SessionId> = tokio::task::spawn_blocking(move || {
            ids.into_iter()
                .filter(|id| crate::input::session_handle(*id) == wanted)
                .collect()
        })
        .await
        .map_err(|_| unavailable())?;
        match found.as_slice() {
            [id] => self.close_session(caller, *id).await.map_err(|e| {
                if e.kind() == ApiErrorKind::SessionNotFound {
                    handle_missing(&handle)
                } else {
                    e
                }
            }),
            [] => Err(handle_missing(&handle)),
            _ => Err(ApiError::new(
                ApiErrorKind::InvalidArgument,
                format!(
                    "{} open sessions share the handle {handle}: close by id, or wait for one to end",
                    found.len()
                ),
            )),
        }
    }

    /// The open sessions `caller` may manage ([`Requester::may_manage`]) whose locks all
    /// start with `prefix`, in id order, at most `max`.
    pub async fn sessions(
        &self,
        caller: &Requester,
        prefix: String,
        max: usize,
    ) -> Result<Vec<SessionView>, ApiError> {
        let caller = caller.clone();
        self.read_at(
            move |core, now_ms| {
                let mut ids = core.session_ids();
                ids.sort_unstable();
                ids.into_iter()
                    .filter_map(|id| core.session_at(id, now_ms))
                    .filter(|s| caller.may_manage(s))
                    .filter(|s| {
                        s.holding
                            .iter()
                            .chain(&s.waiting)
                            .all(|n| n.as_str().starts_with(&prefix))
                    })
                    .take(max)
                    .collect()
            },
            false,
        )
        .await
    }

    /// The view of one lock, if it exists.
    pub async fn lock(&self, name: LockName) -> Result<Option<LockView>, ApiError> {
        self.lock_with(name, false).await
    }

    /// [`Handle::lock`], or with `stale` this member's view (see
    /// [`Handle::read_local`]).
    pub async fn lock_with(
        &self,
        name: LockName,
        stale: bool,
    ) -> Result<Option<LockView>, ApiError> {
        self.read_at(move |core, now_ms| core.lock_at(&name, now_ms), stale)
            .await
    }

    /// [`Handle::locks`], or with `stale` this member's view (see
    /// [`Handle::read_local`]).
    pub async fn locks_with(
        &self,
        prefix: String,
        after: Option<LockName>,
        max: usize,
        stale: bool,
    ) -> Result<Vec<LockView>, ApiError> {
        self.read_at(
            move |core, now_ms| core.locks_at(&prefix, after.as_ref(), max, now_ms),
            stale,
        )
        .await
    }

    /// Locks by prefix, paginated by name.
    pub async fn locks(
        &self,
        prefix: String,
        after: Option<LockName>,
        max: usize,
    ) -> Result<Vec<LockView>, ApiError> {
        self.locks_with(prefix, after, max, false).await
    }

    /// A consistent snapshot of the whole durable state (for `fencelock backup`). It
    /// includes every change acknowledged before the call: the request goes through
    /// the writer, after everything it has answered (a release answered before its
    /// fdatasync included: the backup waits for that fdatasync). It is encoded by the
    /// replica, so the engine does not pause for it.
    pub async fn snapshot(&self) -> Result<Vec<u8>, ApiError> {
        let Some(writer) = &self.shared.writer else {
            // Cluster mode: everything committed before is applied once the barrier
            // passes.
            return self
                .read(|core| codec::encode_snapshot(&core.export()))
                .await;
        };
        let (tx, rx) = oneshot::channel();
        writer
            .send(WriterMsg::Backup(tx))
            .map_err(|_| unavailable())?;
        rx.await.map_err(|_| unavailable())
    }

    /// Cluster mode: the Raft handle and leadership; `None` on a single server.
    pub fn cluster(&self) -> Option<&Arc<ClusterShared>> {
        self.shared.cluster()
    }

    /// Durable lock events from now on. A slow watcher that falls behind by more
    /// than the channel's capacity is told how many events it missed.
    pub fn subscribe(&self) -> broadcast::Receiver<SharedEvent> {
        self.shared.events.subscribe()
    }

    /// Audit entries matching `query`, newest last. Every change acknowledged
    /// before the call is included (entries are durable and indexed before the
    /// change is acknowledged; a release's once the fdatasync that follows its early
    /// answer completes, see `EngineTask::release`), unless retention has dropped it.
    pub fn audit(&self, query: &AuditQuery) -> Vec<AuditEntry> {
        self.shared
            .audit
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .query(query)
    }

    /// The server's metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    /// What recovery found at start.
    pub fn recovery(&self) -> &RecoveryReport {
        &self.shared.recovery
    }

    /// Time since the engine started.
    pub fn uptime(&self) -> Duration {
        self.shared.started.elapsed()
    }

    /// The current run state.
    pub fn state(&self) -> RunState {
        self.shared.state.borrow().clone()
    }

    /// A receiver that sees every run-state change (for shutdown and fail-stop).
    pub fn watch_state(&self) -> watch::Receiver<RunState> {
        self.shared.state.clone()
    }

    /// Starts shutting down: every wait ends with `unavailable`, new waits are
    /// refused, everything else is still served.
    pub fn drain(&self) {
        let _ = self.send(Msg::Drain);
    }

    /// Stops the engine after making everything applied so far durable.
    pub async fn shutdown(&self) {
        let (tx, rx) = oneshot::channel();
        if self.send(Msg::Shutdown(tx)).is_ok() {
            let _ = rx.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::sync::{Condvar, Mutex};

    use super::*;

    /// Holds the writer before its fdatasync while closed.
    #[derive(Default)]
    pub(super) struct SyncGate {
        closed: Mutex<bool>,
        opened: Condvar,
    }

    impl SyncGate {
        pub(super) fn pass(&self) {
            let closed = self.closed.lock().unwrap();
            drop(self.opened.wait_while(closed, |closed| *closed).unwrap());
        }

        fn set(&self, closed: bool) {
            *self.closed.lock().unwrap() = closed;
            self.opened.notify_all();
        }
    }

    thread_local! {
        /// The gate for the next engine started on this thread.
        pub(super) static SYNC_GATE: RefCell<Option<Arc<SyncGate>>> = const { RefCell::new(None) };
        /// The replica gate (see `Writer::replica_gate`) of the next engine started
        /// on this thread.
        pub(super) static REPLICA_GATE: RefCell<Option<Arc<SyncGate>>> = const { RefCell::new(None) };
    }

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
        }
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
            since_wall_ms: 0,
            limit: 10,
        });
        assert_eq!(
            entries.last().map(|e| e.kind),
            Some(audit::AuditKind::Release)
        );
        handle.shutdown().await;
    }

    #[test]
    fn the_writer_polls_only_while_small_writes_follow_each_other_closely() {
        const SPIN_MAX: Duration = DEFAULT_WRITER_POLL;
        let mut spin = SpinPolicy::new(SPIN_MAX);
        assert_eq!(
            spin.window(),
            Duration::ZERO,
            "no polling before any traffic"
        );
        // Batches 80 µs apart (W1's rhythm): the window opens and grows to its bound.
        spin.records = 2;
        spin.observe(Duration::from_micros(80));
        assert_eq!(spin.window(), SPIN_START);
        spin.observe(Duration::from_micros(80));
        assert_eq!(spin.window(), SPIN_START * 2);
        spin.observe(Duration::from_micros(80));
        assert_eq!(spin.window(), Duration::from_micros(100), "caught: kept");
        spin.observe(Duration::from_micros(150));
        spin.observe(Duration::from_micros(190));
        assert_eq!(spin.window(), SPIN_MAX, "never past the bound");
        // A busy server (large writes) does not poll, whatever the rhythm.
        spin.records = SPIN_MAX_RECORDS + 1;
        assert_eq!(spin.window(), Duration::ZERO);
        spin.observe(Duration::from_micros(80));
        spin.records = 2;
        assert_eq!(spin.window(), Duration::ZERO, "closed after a large write");
        // Sparse traffic closes the window again.
        spin.observe(Duration::from_micros(80));
        spin.observe(Duration::from_micros(80));
        spin.observe(Duration::from_micros(80));
        assert_eq!(spin.window(), SPIN_START * 2);
        for _ in 0..4 {
            spin.observe(Duration::from_millis(5));
        }
        assert_eq!(
            spin.window(),
            Duration::ZERO,
            "batches 5 ms apart: no polling"
        );
        // A bound of zero turns polling off.
        let mut off = SpinPolicy::new(Duration::ZERO);
        off.records = 1;
        for _ in 0..3 {
            off.observe(Duration::from_micros(80));
            assert_eq!(off.window(), Duration::ZERO);
        }
        off.observe(Duration::ZERO);
        assert_eq!(off.window(), Duration::ZERO);
    }

    #[test]
    fn a_polling_writer_still_takes_a_message_that_comes_after_its_window() {
        let (tx, rx) = std::sync::mpsc::channel();
        let mut spin = SpinPolicy::new(DEFAULT_WRITER_POLL);
        spin.window = DEFAULT_WRITER_POLL;
        spin.records = 1;
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            tx.send(7).unwrap();
            tx
        });
        assert_eq!(spin.recv(&rx, None).unwrap(), 7);
        // And a deadline ends the wait with a timeout, not a message.
        let deadline = Instant::now() + Duration::from_millis(5);
        assert!(matches!(
            spin.recv(&rx, Some(deadline)),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout)
        ));
        assert!(Instant::now() >= deadline);
        drop(sender.join().unwrap());
        assert!(matches!(
            spin.recv(&rx, None),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected)
        ));
    }

    #[test]
    fn only_a_group_that_answers_nobody_is_held_and_never_past_the_bound() {
        let lone_release = || Group {
            durable: vec![b"record".to_vec()],
            events: vec![Box::new(|| {})],
            ..Group::default()
        };
        assert!(may_hold(&lone_release(), Duration::ZERO));
        assert!(!may_hold(&lone_release(), HOLD_UNANSWERED_GROUP));
        let mut answers = lone_release();
        answers.deliveries.push(Box::new(|| {}));
        assert!(!may_hold(&answers, Duration::ZERO), "a reply waits for it");
        assert!(
            !may_hold(&Group::default(), Duration::ZERO),
            "nothing to sync"
        );
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
        assert_eq!(err.kind(), ApiErrorKind::InvalidArgument, "{err}");
    }
}
