//! The simulated world: one server node (the real core, a simulated disk), clients
//! that follow the client library's rules, a fenced resource, a network, and faults.
//! Everything runs on one virtual clock from one seed.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap};

use fencelock_core::{
    Command, Core, ErrorKind, Grant, LockName, Mode, Owner, OwnerToken, RequestId, SessionId,
    StateImage, Value,
};
use fencelock_fence::MemoryGate;

use crate::check::{Checker, Invariant};
use crate::rng::Rng;
use crate::{FaultCounts, Options, PlantedBug, Stats};

mod client;
mod server;

/// Every duration in the simulation is a multiple of this, so that deadlines of
/// different requests often fall on the same instant: the ties where ordering bugs
/// live.
const GRID_MS: u64 = 5;
/// How long after the faults stop the run goes on, so every lease can free.
const TAIL_MS: u64 = 6_000;
/// Hard bound on the events of one run (a run uses a few thousand).
const MAX_EVENTS: u64 = 2_000_000;
/// A client's answer timeout for renew and release requests.
const RPC_TIMEOUT_MS: u64 = 300;
/// Mixed into the seed for the draw of the reader-writer lock.
const RW_SEED: u64 = 0x7277_6c6f_636b;
/// Mixed into the seed for the draw of multi-lock and election clients.
const KINDS_SEED: u64 = 0x006b_696e_6473;
/// The waits multi-lock clients draw from: shorter than every TTL less its
/// margin, so a grant after the longest wait still leaves time to use it (they
/// hold without renewing).
const MULTI_WAITS: [u64; 3] = [0, 100, 200];

fn grid(ms: u64) -> u64 {
    (ms / GRID_MS).max(1) * GRID_MS
}

/// A request from a client to the server.
#[derive(Debug, Clone)]
enum Request {
    Acquire {
        name: LockName,
        ttl_ms: u64,
        wait_ms: u64,
        request_id: RequestId,
        limit: u32,
        lock_delay_ms: u64,
        session: Option<SessionId>,
        mode: Mode,
        /// An election campaign's value (the election's lock, exclusive).
        value: Option<Value>,
    },
    /// A multi-lock request: (lock, limit, mode) per part, in the order asked.
    AcquireAll {
        parts: Vec<(LockName, u32, Mode)>,
        ttl_ms: u64,
        wait_ms: u64,
        request_id: RequestId,
    },
    ReleaseAll {
        grants: Vec<(LockName, OwnerToken)>,
    },
    Proclaim {
        name: LockName,
        token: OwnerToken,
        value: Value,
    },
    /// Who leads an election now (a read).
    Leader {
        name: LockName,
    },
    Renew {
        name: LockName,
        token: OwnerToken,
        ttl_ms: u64,
    },
    Release {
        name: LockName,
        token: OwnerToken,
    },
    Downgrade {
        name: LockName,
        token: OwnerToken,
    },
    OpenSession {
        ttl_ms: u64,
    },
    KeepAlive {
        id: SessionId,
    },
    CloseSession {
        id: SessionId,
    },
}

/// Why a request failed, as the client sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    Held,
    NotHeld,
    /// The wait in the queue ended.
    Timeout,
    /// Transient: the server restarted or the request was cancelled.
    Unavailable,
    Other,
}

#[derive(Debug, Clone)]
enum Answer {
    Granted {
        fence: u64,
        token: OwnerToken,
        ttl_ms: u64,
    },
    /// Every part of a multi-lock request: (fence, token), in the order asked.
    GrantedAll {
        grants: Vec<(u64, OwnerToken)>,
        ttl_ms: u64,
    },
    Renewed {
        ttl_ms: u64,
    },
    Released,
    Proclaimed,
    /// The election's leader: its term (fence) and value, if it has one.
    Leader {
        term: Option<u64>,
        value: Option<Value>,
    },
    Downgraded,
    SessionOpened {
        id: SessionId,
        ttl_ms: u64,
    },
    KeptAlive {
        ttl_ms: u64,
    },
    SessionClosed,
    Failed(Failure),
}

#[derive(Debug, Clone)]
enum Ev {
    ToServer {
        from: usize,
        rpc: u64,
        request: Request,
    },
    ToClient {
        to: usize,
        rpc: u64,
        answer: Answer,
    },
    ToResource {
        from: usize,
        key: String,
        fence: u64,
    },
    ClientWake {
        client: usize,
        generation: u64,
    },
    ServerSync {
        epoch: u64,
    },
    ServerTick {
        epoch: u64,
    },
    ServerRestart,
    Fault,
}

struct Scheduled {
    at: u64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    /// Reversed: the heap pops the earliest event, ties in scheduling order.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

/// One logged command on the simulated disk. `wall_ms` is stamped like the real
/// record's wall time (for audit); nothing may read it back.
#[derive(Debug, Clone)]
struct Record {
    now_ms: u64,
    #[allow(dead_code)]
    wall_ms: i64,
    command: Command,
}

struct Server {
    core: Option<Core>,
    /// Bumped at every crash: timers of a dead incarnation are ignored.
    epoch: u64,
    /// The durable state: a snapshot and the synced records after it.
    snapshot: Option<StateImage>,
    synced: Vec<Record>,
    /// Appended, not yet fsynced: lost in a power loss, partly kept when only the
    /// process dies.
    unsynced: Vec<Record>,
    /// Records appended so far (the next record's number).
    appended: u64,
    /// Replies held until the records they depend on are synced, with the grants
    /// they acknowledge.
    pending: Vec<(usize, u64, Answer, Vec<Grant>)>,
    sync_at: Option<u64>,
    tick_at: Option<u64>,
    /// Service time at `started_at` (virtual): the monotonic service clock.
    base_ms: u64,
    started_at: u64,
    /// Clients waiting for a queued request, by its token.
    listeners: BTreeMap<OwnerToken, Vec<(usize, u64)>>,
    wall_offset_ms: i64,
    /// A stop-the-world pause (GC, swapping): requests, syncs and timers wait until
    /// then, while the monotonic clock runs on.
    paused_until: u64,
    snapshot_every: usize,
    rng: Rng,
}

#[derive(Debug, Clone)]
struct Rpc {
    id: u64,
    sent: u64,
    timeout_at: u64,
}

#[derive(Debug, Clone)]
struct Acquiring {
    lock: usize,
    /// Shared (a reader) only on a reader-writer lock.
    mode: Mode,
    /// Chubby's lock-delay after this holder's lease expires (usually 0).
    lock_delay_ms: u64,
    /// The session the request is made on (session clients).
    session: Option<SessionId>,
    ttl_ms: u64,
    request_id: RequestId,
    first_sent: Option<u64>,
    budget_end: u64,
    attempt: u32,
    retry_at: u64,
    /// An election campaign's value (the election's lock).
    value: Option<Value>,
}

/// A multi-lock request on its way (retried with its request id like a single one).
#[derive(Debug, Clone)]
struct AcquiringAll {
    /// (lock, mode) per part, in the order asked.
    parts: Vec<(usize, Mode)>,
    ttl_ms: u64,
    request_id: RequestId,
    first_sent: Option<u64>,
    budget_end: u64,
    attempt: u32,
    retry_at: u64,
}

/// One held part of a multi-lock grant.
#[derive(Debug, Clone)]
struct Part {
    lock: usize,
    mode: Mode,
    fence: u64,
    token: OwnerToken,
}

/// A multi-lock grant. Its holder does not renew: it uses the locks only before
/// the conservative deadline (first send + ttl − margin), then releases them
/// together or one by one.
#[derive(Debug, Clone)]
struct HoldingAll {
    /// The parts still held (a part leaves when its release is sent).
    parts: Vec<Part>,
    ttl_ms: u64,
    deadline: u64,
    /// Parts (indices into `parts` at grant time, as locks) still to write once.
    writes: Vec<usize>,
    next_write_at: u64,
    release_at: u64,
    /// Release the parts one by one instead of together.
    one_by_one: bool,
}

#[derive(Debug, Clone)]
struct Holding {
    lock: usize,
    /// A reader never writes to the resource.
    mode: Mode,
    /// Held on this session of the client's: valid while the session is.
    session: Option<SessionId>,
    ttl_ms: u64,
    fence: u64,
    token: OwnerToken,
    /// The conservative local deadline: send instant + ttl − margin.
    deadline: u64,
    last_sent: u64,
    /// False until a renewal sent after the grant confirmed it (after a long wait);
    /// until then the client neither believes it holds the lock nor writes.
    confirmed: bool,
    /// An unconfirmed grant is given up if not confirmed by then (the wait budget).
    confirm_until: u64,
    writes_done: u32,
    writes_total: u32,
    next_write_at: u64,
    release_at: u64,
    renew_attempt: u32,
    renew_retry_at: u64,
    /// An election's leader: the value it published last.
    value: Option<Value>,
}

#[derive(Debug, Clone)]
enum State {
    Idle {
        next_at: u64,
    },
    Acquiring(Acquiring),
    Holding(Holding),
    AcquiringAll(AcquiringAll),
    HoldingAll(HoldingAll),
    /// Waiting for the answer to a leader query.
    Observing {
        give_up: u64,
    },
    Releasing {
        give_up: u64,
    },
}

/// What a client does with the locks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// One lock at a time (shared or exclusive on the reader-writer lock).
    Single,
    /// Multi-lock requests: random overlapping sets of the plain locks, in random
    /// order.
    Multi,
    /// An election's candidate: campaigns, proclaims while leading, resigns, and
    /// asks who leads.
    Elector,
}

/// A client's session (the server's session API): one lease for all its locks,
/// kept alive every third of its TTL.
#[derive(Debug, Clone)]
struct Session {
    id: SessionId,
    ttl_ms: u64,
    /// Conservative: send instant of the last confirmed keep-alive + ttl − margin.
    deadline: u64,
    last_sent: u64,
    attempt: u32,
    retry_at: u64,
}

struct Client {
    rng: Rng,
    role: Role,
    /// Holds its locks on a session instead of leases of their own.
    uses_session: bool,
    session: Option<Session>,
    /// The session's own request (open, keep-alive, close), beside `rpc`.
    session_rpc: Option<Rpc>,
    /// When to try opening a session again after a failure.
    open_retry_at: u64,
    owner: Owner,
    dead: bool,
    paused_until: u64,
    generation: u64,
    wake_at: Option<u64>,
    rpc_seq: u64,
    requests: u64,
    rpc: Option<Rpc>,
    state: State,
    /// Partitions: messages client→server / server→client are dropped until then.
    to_server_cut_until: u64,
    from_server_cut_until: u64,
}

struct LockSpec {
    name: LockName,
    limit: u32,
    /// A reader-writer lock: clients take it shared or exclusive.
    rw: bool,
    /// The election's lock: only electors take it (always last in `locks`).
    election: bool,
}

/// Which faults this seed injects, and how much.
struct FaultPlan {
    kinds: Vec<FaultKind>,
    gap_ms: (u64, u64),
    loss_pm: u64,
    dup_pm: u64,
    long_delay_pm: u64,
    stall_pm: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FaultKind {
    Pause,
    PartitionOneWay,
    PartitionTwoWay,
    Crash,
    WallJump,
    ClientDeath,
    ServerPause,
}

pub(crate) struct Sim {
    now: u64,
    seq: u64,
    queue: BinaryHeap<Scheduled>,
    fault_end: u64,
    end: u64,
    server: Server,
    clients: Vec<Client>,
    locks: Vec<LockSpec>,
    /// Locks single and multi-lock clients take: `locks[..plain]` (the election's
    /// lock, if any, comes after them).
    plain: usize,
    ttls: Vec<u64>,
    waits: Vec<u64>,
    gate: MemoryGate<u64>,
    /// The resource without its fence check (planted bug 1): last write wins.
    unfenced: BTreeMap<String, u64>,
    net: Rng,
    faults: Rng,
    wall: Rng,
    plan: FaultPlan,
    deaths: usize,
    pub(crate) checker: Checker,
    pub(crate) stats: Stats,
    pub(crate) digest: u64,
    options: Options,
}

impl Sim {
    pub(crate) fn new(seed: u64, options: Options) -> Sim {
        let mut root = Rng::new(seed);
        let mut setup = root.fork();
        let net = root.fork();
        let mut faults = root.fork();
        let wall = root.fork();
        let server_rng = root.fork();

        let mut locks = vec![LockSpec {
            name: LockName::new("lock:a").expect("valid"),
            limit: 1,
            rw: false,
            election: false,
        }];
        if setup.chance(600) {
            locks.push(LockSpec {
                name: LockName::new("lock:b").expect("valid"),
                limit: 1,
                rw: false,
                election: false,
            });
        }
        if setup.chance(400) {
            locks.push(LockSpec {
                name: LockName::new("sem").expect("valid"),
                limit: 2,
                rw: false,
                election: false,
            });
        }
        // Drawn from a generator of its own, so every other choice of the seed stays
        // as it was.
        if Rng::new(seed ^ RW_SEED).chance(500) {
            locks.push(LockSpec {
                name: LockName::new("rw").expect("valid"),
                limit: 1,
                rw: true,
                election: false,
            });
        }
        let mut clients: Vec<Client> = (0..setup.range(2, 5))
            .map(|i| Client {
                role: Role::Single,
                uses_session: setup.chance(300),
                session: None,
                session_rpc: None,
                open_retry_at: 0,
                rng: root.fork(),
                owner: Owner::new(&format!("client-{i}")).expect("valid"),
                dead: false,
                paused_until: 0,
                generation: 0,
                wake_at: None,
                rpc_seq: 0,
                requests: 0,
                rpc: None,
                state: State::Idle { next_at: 0 },
                to_server_cut_until: 0,
                from_server_cut_until: 0,
            })
            .collect();
        // Multi-lock and election clients, drawn from a generator of their own (so
        // the other choices of the seed stay as they were) and added after the
        // others: some seeds have both kinds, some one, some neither.
        let mut kinds = Rng::new(seed ^ KINDS_SEED);
        let mut extra = Vec::new();
        if kinds.chance(500) {
            if locks.len() < 2 {
                // Overlapping sets need two locks at least.
                locks.push(LockSpec {
                    name: LockName::new("lock:m").expect("valid"),
                    limit: 1,
                    rw: false,
                    election: false,
                });
            }
            extra.extend((0..kinds.range(1, 2)).map(|_| Role::Multi));
        }
        let plain = locks.len();
        if kinds.chance(500) {
            locks.push(LockSpec {
                name: LockName::new("leader").expect("valid"),
                limit: 1,
                rw: false,
                election: true,
            });
            extra.extend((0..kinds.range(2, 3)).map(|_| Role::Elector));
        }
        for role in extra {
            let i = clients.len();
            clients.push(Client {
                role,
                uses_session: false,
                session: None,
                session_rpc: None,
                open_retry_at: 0,
                rng: kinds.fork(),
                owner: Owner::new(&format!("client-{i}")).expect("valid"),
                dead: false,
                paused_until: 0,
                generation: 0,
                wake_at: None,
                rpc_seq: 0,
                requests: 0,
                rpc: None,
                state: State::Idle { next_at: 0 },
                to_server_cut_until: 0,
                from_server_cut_until: 0,
            });
        }
        let all = [
            FaultKind::Pause,
            FaultKind::PartitionOneWay,
            FaultKind::PartitionTwoWay,
            FaultKind::Crash,
            FaultKind::WallJump,
            FaultKind::ClientDeath,
            FaultKind::ServerPause,
        ];
        let mut kinds: Vec<FaultKind> =
            all.iter().copied().filter(|_| faults.chance(700)).collect();
        if kinds.is_empty() {
            kinds.push(all[faults.index(all.len())]);
        }
        let plan = FaultPlan {
            kinds,
            gap_ms: (faults.range(50, 200), faults.range(300, 900)),
            loss_pm: if faults.chance(700) {
                faults.range(5, 60)
            } else {
                0
            },
            dup_pm: if faults.chance(700) {
                faults.range(5, 40)
            } else {
                0
            },
            long_delay_pm: if faults.chance(700) {
                faults.range(5, 60)
            } else {
                0
            },
            stall_pm: if faults.chance(700) {
                faults.range(20, 150)
            } else {
                0
            },
        };
        let fault_end = grid(setup.range(5_000, 9_000));
        let limits = locks.iter().map(|l| (l.name.clone(), l.limit)).collect();
        let election = locks.iter().find(|l| l.election).map(|l| l.name.clone());
        let mut sim = Sim {
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            fault_end,
            end: fault_end + TAIL_MS,
            server: Server {
                core: None,
                epoch: 0,
                snapshot: None,
                synced: Vec::new(),
                unsynced: Vec::new(),
                appended: 0,
                pending: Vec::new(),
                sync_at: None,
                tick_at: None,
                base_ms: 0,
                started_at: 0,
                listeners: BTreeMap::new(),
                wall_offset_ms: 1_780_000_000_000,
                paused_until: 0,
                snapshot_every: setup.range(10, 200) as usize,
                rng: server_rng,
            },
            clients,
            locks,
            plain,
            ttls: vec![300, 450, 600],
            waits: vec![0, 200, 500, 1_000],
            gate: MemoryGate::named("sim"),
            unfenced: BTreeMap::new(),
            net,
            faults,
            wall,
            plan,
            deaths: 0,
            checker: Checker::new(limits, election),
            stats: Stats::default(),
            digest: 0xcbf2_9ce4_8422_2325,
            options,
        };
        sim.restart_server();
        for i in 0..sim.clients.len() {
            let first = grid(sim.clients[i].rng.range(0, 100));
            sim.clients[i].state = State::Idle { next_at: first };
            sim.wake_client(i, first);
        }
        let first_fault = grid(sim.faults.range(sim.plan.gap_ms.0, sim.plan.gap_ms.1));
        sim.schedule(first_fault, Ev::Fault);
        sim
    }

    fn trace(&self, what: impl FnOnce() -> String) {
        if self.options.trace {
            eprintln!("[{:>6} ms] {}", self.now, what());
        }
    }

    fn mix(&mut self, word: u64) {
        self.digest = (self.digest ^ word).wrapping_mul(0x0100_0000_01b3);
    }

    fn schedule(&mut self, at: u64, ev: Ev) {
        self.seq += 1;
        self.queue.push(Scheduled {
            at,
            seq: self.seq,
            ev,
        });
    }

    fn in_fault_phase(&self) -> bool {
        self.now < self.fault_end
    }

    /// Runs to the end (or the first violation), then checks liveness.
    pub(crate) fn run(&mut self) {
        while let Some(next) = self.queue.pop() {
            if next.at > self.end || self.checker.violation.is_some() {
                break;
            }
            self.stats.events += 1;
            if self.stats.events > MAX_EVENTS {
                self.checker
                    .fail(Invariant::Liveness, "event budget exhausted (a busy loop?)");
                break;
            }
            debug_assert!(next.at >= self.now, "time went backwards");
            self.now = next.at;
            self.checker.at_ms = self.now;
            self.handle(next.ev);
            self.check_beliefs();
        }
        if self.checker.violation.is_none() {
            self.now = self.end;
            self.checker.at_ms = self.end;
            self.check_liveness();
        }
    }

    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::ToServer { from, rpc, request } => {
                if self.clients[from].to_server_cut_until > self.now {
                    self.trace(|| format!("drop (partition) c{from} → server: {request:?}"));
                    return;
                }
                if self.server.core.is_none() {
                    self.trace(|| format!("drop (server down) c{from} → server: {request:?}"));
                    return;
                }
                if self.server.paused_until > self.now {
                    let at = self.server.paused_until;
                    self.schedule(at, Ev::ToServer { from, rpc, request });
                    return;
                }
                self.trace(|| format!("server ← c{from} rpc {rpc}: {request:?}"));
                self.server_request(from, rpc, request);
            }
            Ev::ToClient { to, rpc, answer } => {
                let c = &self.clients[to];
                if c.dead {
                    return;
                }
                if c.from_server_cut_until > self.now {
                    self.trace(|| format!("drop (partition) server → c{to}: {answer:?}"));
                    return;
                }
                if c.paused_until > self.now {
                    let at = c.paused_until;
                    self.schedule(at, Ev::ToClient { to, rpc, answer });
                    return;
                }
                self.trace(|| format!("c{to} ← rpc {rpc}: {answer:?}"));
                self.client_answer(to, rpc, answer);
                self.client_step(to);
            }
            Ev::ToResource { from, key, fence } => self.resource_write(from, &key, fence),
            Ev::ClientWake { client, generation } => {
                let c = &self.clients[client];
                let paused_until = c.paused_until;
                if c.dead || c.generation != generation {
                    return;
                }
                self.clients[client].wake_at = None;
                if paused_until > self.now {
                    self.wake_client(client, paused_until);
                    return;
                }
                self.client_step(client);
            }
            Ev::ServerSync { epoch } => {
                if epoch == self.server.epoch && self.server.core.is_some() {
                    if self.server.paused_until > self.now {
                        let at = self.server.paused_until;
                        return self.schedule(at, Ev::ServerSync { epoch });
                    }
                    self.server.sync_at = None;
                    self.sync();
                }
            }
            Ev::ServerTick { epoch } => {
                if epoch == self.server.epoch
                    && self.server.core.is_some()
                    && self.server.tick_at == Some(self.now)
                {
                    if self.server.paused_until > self.now {
                        let at = self.server.paused_until;
                        self.server.tick_at = Some(at);
                        return self.schedule(at, Ev::ServerTick { epoch });
                    }
                    self.server.tick_at = None;
                    let _ = self.server_apply(Command::Tick);
                }
            }
            Ev::ServerRestart => self.restart_server(),
            Ev::Fault => self.inject_fault(),
        }
    }

    // ---------------------------------------------------------------------------
    // Network
    // ---------------------------------------------------------------------------

    fn net_delay(&mut self) -> u64 {
        let mut delay = grid(self.net.range(1, 25));
        if self.in_fault_phase() && self.net.chance(self.plan.long_delay_pm) {
            delay += grid(self.net.range(50, 700));
            self.stats.faults.msg_delayed += 1;
        }
        delay
    }

    /// Sends over the client↔server network: loss, duplication and delay apply in
    /// the fault phase; partitions apply on delivery.
    fn send(&mut self, ev: Ev) {
        if self.in_fault_phase() && self.net.chance(self.plan.loss_pm) {
            self.stats.faults.msg_lost += 1;
            self.trace(|| format!("lost: {ev:?}"));
            return;
        }
        let copies = if self.in_fault_phase() && self.net.chance(self.plan.dup_pm) {
            self.stats.faults.msg_duplicated += 1;
            2
        } else {
            1
        };
        for _ in 0..copies {
            let at = self.now + self.net_delay();
            self.schedule(at, ev.clone());
        }
    }

    // ---------------------------------------------------------------------------
    // Resource
    // ---------------------------------------------------------------------------

    fn resource_write(&mut self, from: usize, key: &str, fence: u64) {
        let value = from as u64;
        let accepted = if self.options.planted == Some(PlantedBug::NoFenceCheckAtResource) {
            // Planted bug 1: the resource writes without the gate.
            self.unfenced.insert(key.to_owned(), value);
            true
        } else {
            self.gate.set(key, fence, value).is_ok()
        };
        self.mix(6 << 32 | fence << 1 | u64::from(accepted));
        self.trace(|| format!("resource ← c{from} {key} fence {fence}: accepted={accepted}"));
        if accepted {
            self.stats.writes_accepted += 1;
            self.checker.on_write_accepted(key, fence);
        } else {
            self.stats.writes_rejected += 1;
        }
    }

    /// Mutual exclusion as the clients see it: no more clients believe they hold a
    /// lock (before their own conservative deadline) than its limit, and never a
    /// writer together with a reader (readers are not counted against the limit).
    fn check_beliefs(&mut self) {
        for (l, lock) in self.locks.iter().enumerate() {
            let believers: Vec<(usize, u64, Mode)> = self
                .clients
                .iter()
                .enumerate()
                .flat_map(|(i, c)| match &c.state {
                    State::Holding(h)
                        if !c.dead
                            && h.confirmed
                            && h.lock == l
                            && self.now < Sim::hold_deadline(c, h) =>
                    {
                        vec![(i, h.fence, h.mode)]
                    }
                    // A multi-lock holder believes it holds every part it has not
                    // released, until its deadline.
                    State::HoldingAll(h) if !c.dead && self.now < h.deadline => h
                        .parts
                        .iter()
                        .filter(|p| p.lock == l)
                        .map(|p| (i, p.fence, p.mode))
                        .collect(),
                    _ => Vec::new(),
                })
                .collect();
            let readers = believers.iter().filter(|b| b.2 == Mode::Shared).count();
            let writers = believers.len() - readers;
            if writers > lock.limit as usize || (writers > 0 && readers > 0) {
                let detail = format!(
                    "{}: clients (client, fence) {believers:?} all believe they hold it (limit {})",
                    lock.name, lock.limit
                );
                self.checker.fail(Invariant::MutualExclusion, detail);
            }
        }
    }

    fn check_liveness(&mut self) {
        if self.server.core.is_none() {
            return self
                .checker
                .fail(Invariant::Liveness, "server still down at the end");
        }
        // Quiesced: every client stopped, time passed every lease and wait. A
        // multi-lock request still queued now waits for something that never comes.
        let open = self.checker.open_multi_requests();
        if !open.is_empty() {
            let detail = format!(
                "after a quiet tail of {TAIL_MS} ms, multi-lock requests {open:?} were neither granted nor ended"
            );
            return self.checker.fail(Invariant::Deadlock, detail);
        }
        let stats = self.server.core.as_ref().expect("up").stats();
        if stats.holders > 0 || stats.waiters > 0 || stats.sessions > 0 {
            let detail = format!(
                "after a quiet tail of {TAIL_MS} ms: {} holders, {} waiters, {} sessions remain",
                stats.holders, stats.waiters, stats.sessions
            );
            return self.checker.fail(Invariant::Liveness, detail);
        }
        if let Some((i, c)) = self
            .clients
            .iter()
            .enumerate()
            .find(|(_, c)| !c.dead && !matches!(c.state, State::Idle { .. }))
        {
            let detail = format!("client {i} still busy at the end: {:?}", c.state);
            self.checker.fail(Invariant::Liveness, detail);
        }
    }

    // ---------------------------------------------------------------------------
    // Faults
    // ---------------------------------------------------------------------------

    fn inject_fault(&mut self) {
        if !self.in_fault_phase() {
            return;
        }
        let kind = self.plan.kinds[self.faults.index(self.plan.kinds.len())];
        let i = self.faults.index(self.clients.len());
        let max_ttl = *self.ttls.iter().max().expect("ttls");
        match kind {
            FaultKind::Pause => {
                if !self.clients[i].dead {
                    let d = grid(self.faults.range(max_ttl / 2, 3 * max_ttl));
                    let c = &mut self.clients[i];
                    c.paused_until = c.paused_until.max(self.now + d);
                    self.stats.faults.pause += 1;
                    self.trace(|| format!("FAULT: client {i} paused for {d} ms"));
                }
            }
            FaultKind::PartitionOneWay | FaultKind::PartitionTwoWay => {
                let d = grid(self.faults.range(100, 1_500));
                let until = (self.now + d).min(self.fault_end);
                let two_way = kind == FaultKind::PartitionTwoWay;
                let to_server = two_way || self.faults.chance(500);
                let c = &mut self.clients[i];
                if to_server {
                    c.to_server_cut_until = c.to_server_cut_until.max(until);
                }
                if !to_server || two_way {
                    c.from_server_cut_until = c.from_server_cut_until.max(until);
                }
                if two_way {
                    self.stats.faults.partition_two_way += 1;
                } else {
                    self.stats.faults.partition_one_way += 1;
                }
                self.trace(|| {
                    format!("FAULT: client {i} partitioned from the server (two-way {two_way}, to-server {to_server}) for {d} ms")
                });
            }
            FaultKind::Crash => self.crash_server(),
            FaultKind::ServerPause => {
                if self.server.core.is_some() {
                    let d = grid(self.faults.range(50, 2 * max_ttl));
                    self.server.paused_until = self.server.paused_until.max(self.now + d);
                    self.stats.faults.server_pause += 1;
                    self.trace(|| format!("FAULT: server paused for {d} ms"));
                }
            }
            FaultKind::WallJump => {
                let jump = self.wall.range(1, 7_200_000) as i64;
                let back = self.wall.chance(500);
                if self.options.wall_clock_jumps {
                    self.server.wall_offset_ms += if back { -jump } else { jump };
                }
                self.stats.faults.wall_jump += 1;
                self.trace(|| {
                    format!(
                        "FAULT: wall clock jumps {}{jump} ms",
                        if back { "-" } else { "+" }
                    )
                });
            }
            FaultKind::ClientDeath => {
                let alive = self.clients.iter().filter(|c| !c.dead).count();
                if self.deaths == 0 && alive > 1 && !self.clients[i].dead {
                    self.deaths += 1;
                    self.clients[i].dead = true;
                    self.stats.faults.client_death += 1;
                    self.trace(|| format!("FAULT: client {i} dies"));
                }
            }
        }
        let gap = grid(self.faults.range(self.plan.gap_ms.0, self.plan.gap_ms.1));
        self.schedule(self.now + gap, Ev::Fault);
    }
}

fn failure_of(kind: ErrorKind) -> Failure {
    match kind {
        ErrorKind::Held => Failure::Held,
        ErrorKind::NotHeld | ErrorKind::Expired | ErrorKind::SessionNotFound => Failure::NotHeld,
        _ => Failure::Other,
    }
}

impl FaultCounts {
    /// Adds `other` into `self`.
    pub(crate) fn add(&mut self, other: &FaultCounts) {
        self.pause += other.pause;
        self.stall += other.stall;
        self.partition_one_way += other.partition_one_way;
        self.partition_two_way += other.partition_two_way;
        self.crash += other.crash;
        self.crash_kept_unsynced += other.crash_kept_unsynced;
        self.wall_jump += other.wall_jump;
        self.client_death += other.client_death;
        self.server_pause += other.server_pause;
        self.msg_lost += other.msg_lost;
        self.msg_duplicated += other.msg_duplicated;
        self.msg_delayed += other.msg_delayed;
    }
}
