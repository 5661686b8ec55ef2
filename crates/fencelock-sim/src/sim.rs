//! The simulated world: one server node (the real core, a simulated disk), clients
//! that follow the client library's rules, a fenced resource, a network, and faults.
//! Everything runs on one virtual clock from one seed.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap};

use fencelock_core::{
    Acquire, Command, Config, Core, ErrorKind, Grant, LockName, Outcome, Owner, OwnerToken,
    PlantedBugs, Reply, RequestId, SessionId, StateImage, WaitEnd,
};
use fencelock_fence::MemoryGate;

use crate::check::{Checker, Invariant};
use crate::rng::Rng;
use crate::{FaultCounts, Options, PlantedBug, Stats};

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
    Renewed {
        ttl_ms: u64,
    },
    Released,
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
    /// Appended, not yet fsynced: lost in a crash.
    unsynced: Vec<Record>,
    /// Replies held until the records they depend on are synced.
    pending: Vec<(usize, u64, Answer, Option<Grant>)>,
    sync_at: Option<u64>,
    tick_at: Option<u64>,
    /// Service time at `started_at` (virtual): the monotonic service clock.
    base_ms: u64,
    started_at: u64,
    /// Clients waiting for a queued request, by its token.
    listeners: BTreeMap<OwnerToken, Vec<(usize, u64)>>,
    wall_offset_ms: i64,
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
}

#[derive(Debug, Clone)]
struct Holding {
    lock: usize,
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
}

#[derive(Debug, Clone)]
enum State {
    Idle { next_at: u64 },
    Acquiring(Acquiring),
    Holding(Holding),
    Releasing { give_up: u64 },
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
        }];
        if setup.chance(600) {
            locks.push(LockSpec {
                name: LockName::new("lock:b").expect("valid"),
                limit: 1,
            });
        }
        if setup.chance(400) {
            locks.push(LockSpec {
                name: LockName::new("sem").expect("valid"),
                limit: 2,
            });
        }
        let clients = (0..setup.range(2, 5))
            .map(|i| Client {
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
        let all = [
            FaultKind::Pause,
            FaultKind::PartitionOneWay,
            FaultKind::PartitionTwoWay,
            FaultKind::Crash,
            FaultKind::WallJump,
            FaultKind::ClientDeath,
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
                pending: Vec::new(),
                sync_at: None,
                tick_at: None,
                base_ms: 0,
                started_at: 0,
                listeners: BTreeMap::new(),
                wall_offset_ms: 1_780_000_000_000,
                snapshot_every: setup.range(10, 200) as usize,
                rng: server_rng,
            },
            clients,
            locks,
            ttls: vec![300, 450, 600],
            waits: vec![0, 200, 500, 1_000],
            gate: MemoryGate::named("sim"),
            unfenced: BTreeMap::new(),
            net,
            faults,
            wall,
            plan,
            deaths: 0,
            checker: Checker::new(limits),
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
                    self.server.sync_at = None;
                    self.sync();
                }
            }
            Ev::ServerTick { epoch } => {
                if epoch == self.server.epoch
                    && self.server.core.is_some()
                    && self.server.tick_at == Some(self.now)
                {
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
    // Server
    // ---------------------------------------------------------------------------

    fn service_now(&self) -> u64 {
        self.server.base_ms + (self.now - self.server.started_at)
    }

    fn wall_now(&self) -> i64 {
        self.now as i64 + self.server.wall_offset_ms
    }

    /// Applies a command the way the engine does: at the service time, logged if it
    /// changed state, its outcomes routed, its replies held until the next sync.
    fn server_apply(&mut self, command: Command) -> Result<Reply, fencelock_core::Error> {
        let now = self.service_now();
        let wall_ms = self.wall_now();
        let core = self.server.core.as_mut().expect("server is up");
        let due = core.next_deadline_ms().is_some_and(|d| d <= now);
        let is_tick = matches!(command, Command::Tick);
        let result = core.apply(now, command.clone());
        let outcomes = core.take_outcomes();
        self.stats.commands += 1;
        self.checker.on_apply(now, &command, &result, &outcomes);
        if due || (result.is_ok() && !is_tick) {
            self.server.unsynced.push(Record {
                now_ms: now,
                wall_ms,
                command: command.clone(),
            });
        }
        self.mix(now);
        self.mix(match &result {
            Ok(Reply::Granted(g)) => 1 << 32 | g.fence.get(),
            Ok(Reply::Queued { position, .. }) => 2 << 32 | *position as u64,
            Ok(_) => 3,
            Err(e) => 4 << 32 | e.kind().code().len() as u64,
        });
        let shown = self.options.trace.then(|| format!("{result:?}"));
        self.trace(|| {
            format!(
                "server applied at service {now}: {command:?} → {}",
                shown.unwrap_or_default()
            )
        });
        for outcome in outcomes {
            match outcome {
                Outcome::Granted(grant) => {
                    self.mix(5 << 32 | grant.fence.get());
                    for (client, rpc) in self
                        .server
                        .listeners
                        .remove(&grant.token)
                        .unwrap_or_default()
                    {
                        let answer = Answer::Granted {
                            fence: grant.fence.get(),
                            token: grant.token,
                            ttl_ms: grant.ttl_ms,
                        };
                        self.server
                            .pending
                            .push((client, rpc, answer, Some(grant.clone())));
                    }
                }
                Outcome::WaitEnded { token, reason, .. } => {
                    let failure = match reason {
                        WaitEnd::TimedOut => Failure::Timeout,
                        _ => Failure::Unavailable,
                    };
                    for (client, rpc) in self.server.listeners.remove(&token).unwrap_or_default() {
                        self.server
                            .pending
                            .push((client, rpc, Answer::Failed(failure), None));
                    }
                }
                Outcome::Event(_) => {}
            }
        }
        self.schedule_sync();
        self.schedule_tick();
        result
    }

    fn schedule_sync(&mut self) {
        let s = &self.server;
        if s.sync_at.is_none() && (!s.unsynced.is_empty() || !s.pending.is_empty()) {
            let at = self.now + GRID_MS;
            self.server.sync_at = Some(at);
            let epoch = self.server.epoch;
            self.schedule(at, Ev::ServerSync { epoch });
        }
    }

    fn schedule_tick(&mut self) {
        let Some(deadline) = self.server.core.as_ref().and_then(|c| c.next_deadline_ms()) else {
            return;
        };
        let at = self.server.started_at + deadline.saturating_sub(self.server.base_ms);
        let at = at.max(self.now);
        if self.server.tick_at.is_none_or(|t| at < t) {
            self.server.tick_at = Some(at);
            let epoch = self.server.epoch;
            self.schedule(at, Ev::ServerTick { epoch });
        }
    }

    /// Group commit: everything appended so far becomes durable at once, then the
    /// replies that waited for it go out.
    fn sync(&mut self) {
        let records = std::mem::take(&mut self.server.unsynced);
        self.server.synced.extend(records);
        for (client, rpc, answer, grant) in std::mem::take(&mut self.server.pending) {
            if let Some(grant) = &grant {
                self.checker.on_ack(grant);
            }
            self.send(Ev::ToClient {
                to: client,
                rpc,
                answer,
            });
        }
        self.checker.on_sync();
        // At a sync point the live state is exactly the durable state: snapshot it
        // now and then, as the engine's replica does, and drop the log it covers.
        if self.server.synced.len() >= self.server.snapshot_every {
            let core = self.server.core.as_ref().expect("up");
            self.server.snapshot = Some(core.export());
            self.server.synced.clear();
        }
    }

    fn server_request(&mut self, from: usize, rpc: u64, request: Request) {
        match request {
            Request::Acquire {
                name,
                ttl_ms,
                wait_ms,
                request_id,
                limit,
                lock_delay_ms,
                session,
            } => {
                let token = OwnerToken::from_u128(
                    u128::from(self.server.rng.next_u64()) << 64
                        | u128::from(self.server.rng.next_u64()),
                );
                let owner = self.clients[from].owner.clone();
                let result = self.server_apply(Command::Acquire(Acquire {
                    name,
                    token,
                    ttl_ms: session.is_none().then_some(ttl_ms),
                    wait_ms,
                    owner,
                    request_id: Some(request_id),
                    limit,
                    lock_delay_ms,
                    session,
                }));
                match result {
                    Ok(Reply::Granted(grant)) => {
                        let answer = Answer::Granted {
                            fence: grant.fence.get(),
                            token: grant.token,
                            ttl_ms: grant.ttl_ms,
                        };
                        self.server.pending.push((from, rpc, answer, Some(grant)));
                    }
                    Ok(Reply::Queued { token, .. }) => {
                        self.server
                            .listeners
                            .entry(token)
                            .or_default()
                            .push((from, rpc));
                    }
                    Ok(other) => unreachable!("acquire replied {other:?}"),
                    Err(e) => {
                        let failure = failure_of(e.kind());
                        self.server
                            .pending
                            .push((from, rpc, Answer::Failed(failure), None));
                    }
                }
            }
            Request::Renew {
                name,
                token,
                ttl_ms,
            } => {
                let answer = match self.server_apply(Command::Renew {
                    name,
                    token,
                    ttl_ms: Some(ttl_ms),
                }) {
                    Ok(Reply::Renewed(grant)) => Answer::Renewed {
                        ttl_ms: grant.ttl_ms,
                    },
                    Ok(other) => unreachable!("renew replied {other:?}"),
                    Err(e) => Answer::Failed(failure_of(e.kind())),
                };
                self.server.pending.push((from, rpc, answer, None));
            }
            Request::Release { name, token } => {
                let answer = match self.server_apply(Command::Release { name, token }) {
                    Ok(_) => Answer::Released,
                    Err(e) => Answer::Failed(failure_of(e.kind())),
                };
                self.server.pending.push((from, rpc, answer, None));
            }
            Request::OpenSession { ttl_ms } => {
                let id = SessionId::from_u128(
                    u128::from(self.server.rng.next_u64()) << 64
                        | u128::from(self.server.rng.next_u64()),
                );
                let owner = self.clients[from].owner.clone();
                let answer = match self.server_apply(Command::OpenSession { id, ttl_ms, owner }) {
                    Ok(_) => Answer::SessionOpened { id, ttl_ms },
                    Err(e) => Answer::Failed(failure_of(e.kind())),
                };
                self.server.pending.push((from, rpc, answer, None));
            }
            Request::KeepAlive { id } => {
                let answer = match self.server_apply(Command::KeepAlive { id }) {
                    Ok(Reply::KeptAlive { ttl_ms }) => Answer::KeptAlive { ttl_ms },
                    Ok(other) => unreachable!("keep-alive replied {other:?}"),
                    Err(e) => Answer::Failed(failure_of(e.kind())),
                };
                self.server.pending.push((from, rpc, answer, None));
            }
            Request::CloseSession { id } => {
                let answer = match self.server_apply(Command::CloseSession { id }) {
                    Ok(_) => Answer::SessionClosed,
                    Err(e) => Answer::Failed(failure_of(e.kind())),
                };
                self.server.pending.push((from, rpc, answer, None));
            }
        }
        self.schedule_sync();
    }

    fn crash_server(&mut self) {
        if self.server.core.is_none() {
            return;
        }
        self.stats.faults.crash += 1;
        let lost = self.server.unsynced.len();
        self.trace(|| format!("CRASH: {lost} unsynced records and their replies lost"));
        let s = &mut self.server;
        s.core = None;
        s.epoch += 1;
        s.unsynced.clear();
        s.pending.clear();
        s.listeners.clear();
        s.sync_at = None;
        s.tick_at = None;
        self.checker.on_crash();
        let down = grid(self.faults.range(10, 400));
        self.schedule(self.now + down, Ev::ServerRestart);
    }

    fn core_config() -> Config {
        Config {
            max_recent_ends: 4_096,
            ..Config::default()
        }
    }

    fn planted_core_bugs(&self) -> PlantedBugs {
        PlantedBugs {
            release_by_name_only: self.options.planted == Some(PlantedBug::ReleaseByNameOnly),
            grant_expired_waiters: self.options.planted == Some(PlantedBug::GrantExpiredWaiters),
        }
    }

    /// Recovery as the engine does it: import the snapshot, replay the synced log
    /// (outcomes were delivered before the crash), continue the service clock from
    /// the last logged time, and log + sync a `Recover` before serving.
    fn restart_server(&mut self) {
        let config = Sim::core_config();
        let mut core = match &self.server.snapshot {
            Some(image) => {
                self.stats.snapshot_restarts += 1;
                Core::import(config.clone(), image.clone())
                    .unwrap_or_else(|e| panic!("snapshot refused on recovery: {e}"))
            }
            None => Core::new(config.clone()),
        };
        // The same code replays the log as ran it (a planted bug included).
        core.plant_bugs(self.planted_core_bugs());
        for record in &self.server.synced {
            let _ = core.apply(record.now_ms.max(core.now_ms()), record.command.clone());
            core.take_outcomes();
        }
        if self.options.planted == Some(PlantedBug::FenceCounterNotDurable) {
            // Planted bug 2: the fence counter is not recovered; it restarts just
            // above the fences still held.
            let mut image = core.export();
            image.next_fence = image
                .locks
                .iter()
                .flat_map(|l| l.holders.iter().map(|h| h.fence.get() + 1))
                .max()
                .unwrap_or(1);
            core = Core::import(config, image).expect("a consistent image");
        }
        core.plant_bugs(self.planted_core_bugs());
        self.checker.on_replayed(&core);
        let base_ms = if self.server.epoch == 0 && self.server.synced.is_empty() {
            0
        } else {
            core.now_ms() + 1
        };
        self.server.base_ms = base_ms;
        self.server.started_at = self.now;
        self.server.core = Some(core);
        self.trace(|| format!("server up: service clock at {base_ms}"));
        if self.server.epoch > 0 {
            let result = self.server_apply(Command::Recover);
            assert!(result.is_ok(), "recover never fails");
            self.server.sync_at = None;
            self.sync();
            let core = self.server.core.as_ref().expect("up");
            self.checker.on_recovered(core);
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

    // ---------------------------------------------------------------------------
    // Clients
    // ---------------------------------------------------------------------------

    fn wake_client(&mut self, i: usize, at: u64) {
        let c = &mut self.clients[i];
        if c.wake_at.is_some_and(|w| w <= at && w >= self.now) {
            return;
        }
        c.generation += 1;
        c.wake_at = Some(at);
        let generation = c.generation;
        self.schedule(
            at,
            Ev::ClientWake {
                client: i,
                generation,
            },
        );
    }

    fn backoff(&mut self, i: usize, attempt: u32) -> u64 {
        let cap = (10u64 << attempt.min(5)).min(200);
        grid(self.clients[i].rng.range(cap / 2, cap))
    }

    fn send_request(&mut self, i: usize, request: Request, timeout_ms: u64) {
        let c = &mut self.clients[i];
        c.rpc_seq += 1;
        let rpc = c.rpc_seq;
        c.rpc = Some(Rpc {
            id: rpc,
            sent: self.now,
            timeout_at: self.now + timeout_ms,
        });
        self.stats.ops += 1;
        self.send(Ev::ToServer {
            from: i,
            rpc,
            request,
        });
    }

    fn margin(ttl_ms: u64) -> u64 {
        (ttl_ms / 10).max(1)
    }

    /// Sends an acquire (first attempt or retry with the same request id).
    fn send_acquire(&mut self, i: usize) {
        let State::Acquiring(a) = &mut self.clients[i].state else {
            return;
        };
        let sent = self.now;
        a.first_sent.get_or_insert(sent);
        let wait_ms = a.budget_end.saturating_sub(sent);
        let lock = &self.locks[a.lock];
        let session = a.session;
        let request = Request::Acquire {
            name: lock.name.clone(),
            ttl_ms: a.ttl_ms,
            wait_ms,
            request_id: a.request_id.clone(),
            limit: lock.limit,
            lock_delay_ms: a.lock_delay_ms,
            session,
        };
        self.send_request(i, request, wait_ms + RPC_TIMEOUT_MS);
    }

    /// Gives up a held (or possibly held) lock: a best-effort release with the owner
    /// token, as the guard does after its deadline.
    fn give_up(&mut self, i: usize, h: &Holding) {
        let name = self.locks[h.lock].name.clone();
        let margin = Sim::margin(h.ttl_ms);
        self.clients[i].state = State::Releasing {
            give_up: self.now + margin.max(RPC_TIMEOUT_MS),
        };
        self.send_request(
            i,
            Request::Release {
                name,
                token: h.token,
            },
            margin.max(RPC_TIMEOUT_MS),
        );
    }

    fn go_idle(&mut self, i: usize) {
        let think = grid(self.clients[i].rng.range(5, 150));
        self.clients[i].rpc = None;
        self.clients[i].state = State::Idle {
            next_at: self.now + think,
        };
    }

    fn client_answer(&mut self, i: usize, rpc: u64, answer: Answer) {
        if let Some(outstanding) = self.clients[i].session_rpc.clone().filter(|r| r.id == rpc) {
            self.mix(8 << 32 | (i as u64) << 8 | rpc);
            return self.session_answer(i, outstanding, answer);
        }
        let Some(outstanding) = self.clients[i].rpc.clone().filter(|r| r.id == rpc) else {
            return; // a duplicate, or the answer to a request given up on
        };
        self.mix(7 << 32 | (i as u64) << 8 | rpc);
        let c = &mut self.clients[i];
        c.rpc = None;
        match (c.state.clone(), answer) {
            (
                State::Acquiring(a),
                Answer::Granted {
                    fence,
                    token,
                    ttl_ms,
                },
            ) => {
                let base = a.first_sent.unwrap_or(outstanding.sent);
                let lock = &self.locks[a.lock];
                let writes_total = if lock.limit == 1 {
                    c.rng.range(1, 3) as u32
                } else {
                    0
                };
                let hold = grid(c.rng.range(0, ttl_ms));
                self.stats.grants_seen += 1;
                self.stats.session_grants += u64::from(a.session.is_some());
                c.state = State::Holding(Holding {
                    lock: a.lock,
                    session: a.session,
                    ttl_ms,
                    fence,
                    token,
                    deadline: (base + ttl_ms)
                        .saturating_sub(Sim::margin(ttl_ms))
                        .max(base),
                    last_sent: base,
                    // After a long wait the send instant proves little: confirm
                    // with a renewal before using the lock (as the client does).
                    // (A session-held lock lives on the session's lease, whose
                    // deadline the keep-alives keep.)
                    confirmed: a.session.is_some() || self.now - base <= ttl_ms / 4,
                    confirm_until: a.budget_end,
                    writes_done: 0,
                    writes_total,
                    next_write_at: self.now,
                    release_at: self.now + hold,
                    renew_attempt: 0,
                    renew_retry_at: self.now,
                });
            }
            (State::Acquiring(a), Answer::Failed(failure)) => match failure {
                Failure::Timeout if self.now < a.budget_end => {
                    self.send_acquire(i);
                }
                Failure::Unavailable => self.acquire_retry(i, a),
                _ => self.go_idle(i),
            },
            (State::Holding(mut h), Answer::Renewed { ttl_ms }) => {
                if h.confirmed && self.now >= h.deadline {
                    // Sticky: once the deadline passed, the lock is lost.
                    return self.give_up(i, &h);
                }
                let new_deadline = (outstanding.sent + ttl_ms)
                    .saturating_sub(Sim::margin(ttl_ms))
                    .max(outstanding.sent);
                h.deadline = h.deadline.max(new_deadline);
                h.last_sent = outstanding.sent;
                h.confirmed = true;
                h.renew_attempt = 0;
                self.clients[i].state = State::Holding(h);
            }
            (State::Holding(_), Answer::Failed(Failure::Unavailable)) => self.renew_transient(i),
            // The client library starts over when the confirmation finds the grant
            // gone; it does not hold the lock either way.
            (State::Holding(h), Answer::Failed(_)) if !h.confirmed => self.go_idle(i),
            (State::Holding(h), Answer::Failed(_)) => self.give_up(i, &h),
            (State::Releasing { .. }, _) => self.go_idle(i),
            (state, answer) => {
                unreachable!("client {i} in {state:?} got {answer:?} for its outstanding request")
            }
        }
    }

    fn session_answer(&mut self, i: usize, outstanding: Rpc, answer: Answer) {
        let now = self.now;
        let delay = self.backoff(i, 1);
        let c = &mut self.clients[i];
        c.session_rpc = None;
        match answer {
            Answer::SessionOpened { id, ttl_ms } => {
                let sent = outstanding.sent;
                c.session = Some(Session {
                    id,
                    ttl_ms,
                    deadline: (sent + ttl_ms).saturating_sub(Sim::margin(ttl_ms)),
                    last_sent: sent,
                    attempt: 0,
                    retry_at: now,
                });
            }
            Answer::KeptAlive { ttl_ms } => {
                if let Some(s) = c.session.as_mut().filter(|s| now < s.deadline) {
                    let sent = outstanding.sent;
                    s.deadline = s
                        .deadline
                        .max((sent + ttl_ms).saturating_sub(Sim::margin(ttl_ms)));
                    s.last_sent = sent;
                    s.attempt = 0;
                }
            }
            Answer::Failed(Failure::NotHeld) => {
                // The server no longer knows the session: everything on it is gone.
                c.session = None;
            }
            Answer::Failed(_) => match c.session.as_mut() {
                Some(s) => {
                    s.attempt += 1;
                    s.retry_at = now + delay;
                }
                None => c.open_retry_at = now + delay,
            },
            Answer::SessionClosed => {}
            other => unreachable!("client {i} got {other:?} for a session request"),
        }
    }

    fn send_session_request(&mut self, i: usize, request: Request, timeout_ms: u64) {
        let c = &mut self.clients[i];
        c.rpc_seq += 1;
        let rpc = c.rpc_seq;
        c.session_rpc = Some(Rpc {
            id: rpc,
            sent: self.now,
            timeout_at: self.now + timeout_ms,
        });
        self.stats.ops += 1;
        self.send(Ev::ToServer {
            from: i,
            rpc,
            request,
        });
    }

    /// The session task of a session client: open, keep alive every third of the
    /// TTL, give up at the conservative deadline, close when done.
    fn session_step(&mut self, i: usize) {
        let now = self.now;
        let active = self.in_fault_phase();
        let delay = self.backoff(i, 2);
        let c = &mut self.clients[i];
        if !c.uses_session || c.dead {
            return;
        }
        if c.session_rpc.as_ref().is_some_and(|r| now >= r.timeout_at) {
            c.session_rpc = None;
            match c.session.as_mut() {
                Some(s) => s.retry_at = now + delay,
                None => c.open_retry_at = now + delay,
            }
        }
        if c.session_rpc.is_some() {
            return;
        }
        match c.session.clone() {
            None => {
                if active && now >= c.open_retry_at && matches!(c.state, State::Idle { .. }) {
                    let ttl_ms = self.ttls[c.rng.index(self.ttls.len())];
                    self.send_session_request(i, Request::OpenSession { ttl_ms }, RPC_TIMEOUT_MS);
                }
            }
            Some(s) if now >= s.deadline => c.session = None,
            Some(s) if !active && matches!(c.state, State::Idle { .. }) => {
                c.session = None;
                self.send_session_request(i, Request::CloseSession { id: s.id }, RPC_TIMEOUT_MS);
            }
            Some(s) => {
                if now >= s.last_sent + s.ttl_ms / 3 && now >= s.retry_at {
                    let timeout = s.deadline - now;
                    self.send_session_request(i, Request::KeepAlive { id: s.id }, timeout);
                }
            }
        }
    }

    /// The instant a hold stops being valid for its client: its own deadline, or its
    /// session's (0 once the session is gone).
    fn hold_deadline(c: &Client, h: &Holding) -> u64 {
        match h.session {
            None => h.deadline,
            Some(id) => c
                .session
                .as_ref()
                .filter(|s| s.id == id)
                .map_or(0, |s| s.deadline),
        }
    }

    /// A renewal failed transiently: retry after a backoff (a confirmed hold until
    /// its deadline, a confirmation within the wait budget).
    fn renew_transient(&mut self, i: usize) {
        let State::Holding(h) = self.clients[i].state.clone() else {
            return;
        };
        let delay = self.backoff(i, h.renew_attempt);
        if !h.confirmed && self.now + delay >= h.confirm_until {
            return self.give_up(i, &h);
        }
        if let State::Holding(h) = &mut self.clients[i].state {
            h.renew_attempt += 1;
            h.renew_retry_at = self.now + delay;
        }
    }

    /// A transient failure: retry with backoff within the wait budget, as the client
    /// library does (a try-lock, with no budget, gives up at once).
    fn acquire_retry(&mut self, i: usize, a: Acquiring) {
        let delay = self.backoff(i, a.attempt);
        if self.now + delay >= a.budget_end {
            return self.go_idle(i);
        }
        if let State::Acquiring(a) = &mut self.clients[i].state {
            a.attempt += 1;
            a.retry_at = self.now + delay;
        }
    }

    /// Acts on the client's state at `now`, then sets its next wake-up.
    fn client_step(&mut self, i: usize) {
        let now = self.now;
        let active = self.in_fault_phase();
        self.session_step(i);
        for _ in 0..4 {
            let c = &mut self.clients[i];
            if c.dead {
                return;
            }
            let timed_out = c.rpc.as_ref().is_some_and(|r| now >= r.timeout_at);
            match c.state.clone() {
                State::Idle { next_at } => {
                    if now < next_at || !active || c.uses_session && c.session.is_none() {
                        break;
                    }
                    let session = c.session.as_ref().map(|s| s.id);
                    let lock = c.rng.index(self.locks.len());
                    let ttl_ms = self.ttls[c.rng.index(self.ttls.len())];
                    let wait_ms = self.waits[c.rng.index(self.waits.len())];
                    c.requests += 1;
                    let request_id =
                        RequestId::new(&format!("c{i}-{}", c.requests)).expect("valid");
                    let lock_delay_ms = [0, 0, 0, 50, 100][c.rng.index(5)];
                    c.state = State::Acquiring(Acquiring {
                        lock,
                        lock_delay_ms,
                        session,
                        ttl_ms,
                        request_id,
                        first_sent: None,
                        budget_end: now + wait_ms,
                        attempt: 0,
                        retry_at: now,
                    });
                    self.send_acquire(i);
                    break;
                }
                State::Acquiring(a) => {
                    if a.session.is_some() && a.session != c.session.as_ref().map(|s| s.id) {
                        // The session ended under the request: start over.
                        self.go_idle(i);
                        continue;
                    }
                    if timed_out {
                        c.rpc = None;
                        self.acquire_retry(i, a);
                        continue;
                    }
                    if c.rpc.is_none() && now >= a.retry_at {
                        self.send_acquire(i);
                    }
                    break;
                }
                State::Holding(mut h) => {
                    if h.confirmed && now >= Sim::hold_deadline(c, &h) {
                        self.stats.deadline_losses += 1;
                        self.give_up(i, &h);
                        continue;
                    }
                    if timed_out {
                        // A renewal that got no answer (a confirmed hold's renewal
                        // times out only at its deadline, handled above).
                        c.rpc = None;
                        self.renew_transient(i);
                        continue;
                    }
                    let renew_due =
                        h.session.is_none() && (!h.confirmed || now >= h.last_sent + h.ttl_ms / 3);
                    if c.rpc.is_none() && renew_due && now >= h.renew_retry_at {
                        let request = Request::Renew {
                            name: self.locks[h.lock].name.clone(),
                            token: h.token,
                            ttl_ms: h.ttl_ms,
                        };
                        let timeout = if h.confirmed {
                            h.deadline - now
                        } else {
                            RPC_TIMEOUT_MS
                        };
                        self.send_request(i, request, timeout);
                    }
                    let c = &mut self.clients[i];
                    if !h.confirmed {
                        break;
                    }
                    if h.writes_done < h.writes_total && now >= h.next_write_at {
                        // The deadline was checked above; a stall between that check
                        // and the write reaching the resource is exactly what fences
                        // are for.
                        let key = format!("{}/{}", self.locks[h.lock].name, h.writes_done);
                        h.writes_done += 1;
                        h.next_write_at = now + grid(c.rng.range(10, 60));
                        let mut at = now + grid(c.rng.range(1, 20));
                        if self.now < self.fault_end && c.rng.chance(self.plan.stall_pm) {
                            let stall = grid(c.rng.range(h.ttl_ms / 2, 3 * h.ttl_ms));
                            c.paused_until = c.paused_until.max(now + stall);
                            at += stall;
                            self.stats.faults.stall += 1;
                        }
                        self.stats.writes += 1;
                        c.state = State::Holding(h.clone());
                        self.schedule(
                            at,
                            Ev::ToResource {
                                from: i,
                                key,
                                fence: h.fence,
                            },
                        );
                        continue;
                    }
                    if h.writes_done >= h.writes_total && now >= h.release_at {
                        let name = self.locks[h.lock].name.clone();
                        c.state = State::Releasing {
                            give_up: now + RPC_TIMEOUT_MS,
                        };
                        self.send_request(
                            i,
                            Request::Release {
                                name,
                                token: h.token,
                            },
                            RPC_TIMEOUT_MS,
                        );
                    }
                    break;
                }
                State::Releasing { give_up } => {
                    if timed_out || now >= give_up {
                        self.go_idle(i);
                        continue;
                    }
                    break;
                }
            }
        }
        self.rewake(i);
    }

    /// The next instant the client has something to do.
    fn rewake(&mut self, i: usize) {
        let c = &self.clients[i];
        if c.dead {
            return;
        }
        let mut next = c.rpc.as_ref().map(|r| r.timeout_at);
        let mut at = |t: u64| next = Some(next.map_or(t, |n: u64| n.min(t)));
        let idle = matches!(c.state, State::Idle { .. });
        let active = self.now < self.fault_end;
        if c.uses_session {
            match (&c.session_rpc, &c.session) {
                (Some(r), _) => at(r.timeout_at),
                (None, Some(s)) => {
                    at(s.deadline);
                    at((s.last_sent + s.ttl_ms / 3).max(s.retry_at).max(self.now));
                    if idle && !active {
                        at(self.now); // time to close it
                    }
                }
                (None, None) => {
                    if idle && active {
                        at(c.open_retry_at.max(self.now));
                    }
                }
            }
        }
        match &c.state {
            State::Idle { next_at } => {
                if active && (!c.uses_session || c.session.is_some()) {
                    at((*next_at).max(self.now));
                }
            }
            State::Acquiring(a) => {
                if c.rpc.is_none() {
                    at(a.retry_at.max(self.now));
                }
            }
            State::Holding(h) => {
                if h.confirmed {
                    at(Sim::hold_deadline(c, h));
                }
                if c.rpc.is_none() && h.session.is_none() {
                    at((h.last_sent + h.ttl_ms / 3)
                        .max(h.renew_retry_at)
                        .max(self.now));
                }
                if h.confirmed {
                    if h.writes_done < h.writes_total {
                        at(h.next_write_at.max(self.now));
                    } else {
                        at(h.release_at.max(self.now));
                    }
                }
            }
            State::Releasing { give_up } => at(*give_up),
        }
        let paused_until = c.paused_until;
        if let Some(t) = next {
            self.wake_client(i, t.max(paused_until).max(self.now));
        }
    }

    /// Mutual exclusion as the clients see it: no more clients believe they hold a
    /// lock (before their own conservative deadline) than its limit.
    fn check_beliefs(&mut self) {
        for (l, lock) in self.locks.iter().enumerate() {
            let believers: Vec<(usize, u64)> = self
                .clients
                .iter()
                .enumerate()
                .filter_map(|(i, c)| match &c.state {
                    State::Holding(h)
                        if !c.dead
                            && h.confirmed
                            && h.lock == l
                            && self.now < Sim::hold_deadline(c, h) =>
                    {
                        Some((i, h.fence))
                    }
                    _ => None,
                })
                .collect();
            if believers.len() > lock.limit as usize {
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
        let _ = self.server_apply(Command::Tick);
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
        self.wall_jump += other.wall_jump;
        self.client_death += other.client_death;
        self.msg_lost += other.msg_lost;
        self.msg_duplicated += other.msg_duplicated;
        self.msg_delayed += other.msg_delayed;
    }
}
