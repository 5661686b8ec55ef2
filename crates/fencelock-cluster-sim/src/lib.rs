//! A seeded fault-injection simulation of a fencelock cluster.
//!
//! Each run starts 3 or 5 **real** members in one process — the engine task in
//! cluster mode, openraft, the state machine, the Raft log store (in memory: an
//! append is durable at once) — over a simulated network ([`net`]) on tokio's
//! paused clock, so seconds of virtual time pass in milliseconds. Clients follow
//! the client library's rules (a request id per acquire, retried on another member
//! after `not_leader` or a failure; a conservative deadline of *first send + ttl −
//! ttl/10*; renewal every ttl/3; lost at the deadline) and readers make
//! linearizable reads, while a fault driver crashes and restarts members, isolates
//! the leader (a paused or partitioned leader: it still believes it leads), cuts
//! single links, and makes the network lossy and slow. Then the network heals and
//! a probe must get a grant within a bound.
//!
//! Checked after every run (see [`Invariant`]):
//! - no two clients believe they hold the same lock at once (exclusion);
//! - no fence is issued twice, and a grant acknowledged before another was asked
//!   for has the smaller fence (fence order, across leaders);
//! - a linearizable read shows every grant acknowledged before it was sent whose
//!   holder still believed it held the lock when the read returned (no stale read,
//!   no lost acknowledged grant);
//! - progress after the heal, and no member failed (panicked).
//!
//! The seed fixes the fault schedule and the clients' choices. It does not fix the
//! interleaving bit for bit: openraft draws its election timeouts from its own
//! random source. So a failing seed is a strong hint, not an exact replay.
//!
//! Planted bugs ([`ClusterBugs`], the real code paths behind the server's
//! `planted-bugs` feature) show the checker catches what it claims to.

pub mod net;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencelock_core::{LockName, Owner, RequestId};
use fencelock_server::cluster::{ClusterConfig, Directory};
use fencelock_server::engine::{
    start_member, AcquireArgs, ClusterBugs, Durability, EngineConfig, Handle, MemberSpec,
    Requester, RunState,
};
use fencelock_server::ApiErrorKind;
use fencelock_sim::Rng;
use tokio::time::Instant;

use crate::net::{Net, SimNetwork, SimProbe};

/// Lease of every simulated grant.
const TTL_MS: u64 = 2_000;
/// Heartbeat of the simulated members: elections time out after 250–500 ms, and
/// the TTL floor is 1.5 s.
const HEARTBEAT: Duration = Duration::from_millis(50);

/// What one run simulates.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Members: 3 or 5.
    pub members: usize,
    /// Clients acquiring, holding, renewing and releasing.
    pub clients: usize,
    /// Readers making linearizable reads of random locks on random members.
    pub readers: usize,
    /// Distinct locks they contend for.
    pub locks: usize,
    /// Virtual time with faults.
    pub fault_ms: u64,
    /// Protections switched off.
    pub bugs: ClusterBugs,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            members: 3,
            clients: 5,
            readers: 2,
            locks: 2,
            fault_ms: 6_000,
            bugs: ClusterBugs::default(),
        }
    }
}

/// The invariants a run checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Invariant {
    /// Two clients believed they held the same lock at the same time.
    MutualExclusion,
    /// A fence was issued twice, or a later grant got a smaller fence.
    FenceOrder,
    /// A linearizable read missed a grant that was acknowledged before it and still
    /// believed held after it.
    StaleRead,
    /// A queued request was passed over, or a retried one lost its place.
    Fifo,
    /// A grant a client was told of is missing from the applied history.
    LostGrant,
    /// No grant within the bound after the network healed.
    Progress,
    /// A member failed (its engine panicked: a broken invariant).
    MemberFailed,
}

/// The first broken invariant of a run.
#[derive(Debug, Clone)]
pub struct Violation {
    /// Which.
    pub invariant: Invariant,
    /// What exactly.
    pub detail: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}: {}", self.invariant, self.detail)
    }
}

/// What a run did and found.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Grants acknowledged to clients.
    pub grants: u64,
    /// Linearizable reads that returned.
    pub reads: u64,
    /// Requests that queued, in the longest complete event stream (what FIFO and
    /// "no lost grant" were checked against; 0 if no stream was complete).
    pub queued: u64,
    /// Faults injected, by kind.
    pub faults: BTreeMap<&'static str, u64>,
    /// Peer messages delivered and dropped.
    pub messages: (u64, u64),
    /// The first violation, if any.
    pub violation: Option<Violation>,
    /// Pre-Vote elections the members' dead-leader watchdogs started (after a
    /// leader crashed; `fencelock_server::cluster::watchdog`).
    pub watchdog_elections: u64,
}

#[derive(Debug, Clone)]
struct GrantRecord {
    client: usize,
    /// The request id (also the owner).
    request: String,
    lock: String,
    fence: u64,
    token: String,
    invoke: Instant,
    ack: Instant,
    /// When the client stopped believing it held the lock (release sent, or its
    /// conservative deadline passed); `None` while still held at the end.
    end: Option<Instant>,
}

#[derive(Debug, Clone)]
struct ReadRecord {
    lock: String,
    invoke: Instant,
    complete: Instant,
    fences: Vec<u64>,
}

/// One lock event as a member applied it.
#[derive(Debug, Clone)]
enum Applied {
    Queued {
        lock: String,
        owner: String,
    },
    Granted {
        lock: String,
        owner: String,
        fence: u64,
    },
    WaitEnded {
        lock: String,
        owner: String,
    },
}

/// The events one run of one member applied, in order.
#[derive(Debug, Default)]
struct EventStream {
    /// Subscribed before any client command existed: the whole history.
    from_start: bool,
    /// The member fell behind the event channel: events after `events` are missing.
    lagged: bool,
    events: Vec<Applied>,
}

#[derive(Default)]
struct History {
    grants: Vec<GrantRecord>,
    reads: Vec<ReadRecord>,
    streams: Vec<EventStream>,
}

/// Records the lock events `h` applies from now on (a restarted member re-applies
/// its log, so its stream is a suffix of the history, possibly all of it).
fn record_events(h: &Handle, history: &Arc<Mutex<History>>, from_start: bool) {
    use fencelock_core::EventKind;
    use tokio::sync::broadcast::error::RecvError;
    let mut rx = h.subscribe();
    let index = {
        let mut hist = history.lock().unwrap();
        hist.streams.push(EventStream {
            from_start,
            ..EventStream::default()
        });
        hist.streams.len() - 1
    };
    let history = history.clone();
    tokio::spawn(async move {
        loop {
            let event = match rx.recv().await {
                Ok(event) => event,
                Err(RecvError::Lagged(_)) => {
                    history.lock().unwrap().streams[index].lagged = true;
                    return;
                }
                Err(RecvError::Closed) => return,
            };
            let lock = event.name.as_str().to_owned();
            let owner = event.owner.as_str().to_owned();
            let applied = match (&event.kind, event.fence) {
                (EventKind::Queued, _) => Applied::Queued { lock, owner },
                (EventKind::Granted, Some(fence)) => Applied::Granted {
                    lock,
                    owner,
                    fence: fence.get(),
                },
                (EventKind::WaitEnded(_), _) => Applied::WaitEnded { lock, owner },
                _ => continue,
            };
            history.lock().unwrap().streams[index].events.push(applied);
        }
    });
}

/// The members of a run, as clients see them.
struct Cluster {
    handles: Mutex<Vec<Option<Handle>>>,
    /// Paused members (index) and when they resume.
    paused: Mutex<BTreeMap<usize, Instant>>,
}

impl Cluster {
    fn handle(&self, i: usize) -> Option<Handle> {
        self.handles.lock().unwrap()[i].clone()
    }

    /// Member `i` for a client request: a request to a paused member waits until
    /// it resumes (in its socket buffer, as it were).
    async fn reach(&self, i: usize) -> Option<Handle> {
        let until = self.paused.lock().unwrap().get(&i).copied();
        if let Some(until) = until {
            tokio::time::sleep_until(until).await;
        }
        self.handle(i)
    }

    fn len(&self) -> usize {
        self.handles.lock().unwrap().len()
    }
}

/// Runs one seed.
pub fn run_seed(seed: u64, options: Options) -> Report {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("a tokio runtime");
    rt.block_on(run(seed, options))
}

struct Slot {
    dir: tempfile::TempDir,
    log: fencelock_server::cluster::log_store::LogStore,
}

async fn start(id: u64, slot: &Slot, n: usize, net: &Arc<Net>, bugs: ClusterBugs) -> Handle {
    let mut engine = EngineConfig::new(slot.dir.path());
    engine.durability = Durability::None;
    let fake: std::net::SocketAddr = "127.0.0.1:9".parse().expect("an address");
    engine.cluster = Some(ClusterConfig {
        node_id: id,
        peer_listen: fake,
        peers: (1..=n as u64).map(|i| (i, fake)).collect(),
        join: false,
        advertise_url: format!("http://sim-{id}"),
        secret: None,
        tls: None,
        heartbeat: HEARTBEAT,
        dial: BTreeMap::new(),
        leader_probe: true,
    });
    let (handle, runtime) = start_member(MemberSpec {
        config: engine,
        network: SimNetwork {
            from: id,
            net: net.clone(),
        },
        log_store: slot.log.after_crash(),
        directory: Arc::new(Directory::default()),
        on_shutdown: None,
        import: None,
        probe: Some(Arc::new(SimProbe {
            from: id,
            net: net.clone(),
        })),
        bugs,
    })
    .await
    .expect("a simulated member starts");
    net.up(
        id,
        runtime.shared.raft.clone(),
        runtime.shared.contact.clone(),
    );
    handle
}

/// How many elections member `h`'s dead-leader watchdog started.
fn watchdog_elections(h: &Handle) -> u64 {
    h.metrics()
        .cluster
        .watchdog_elections
        .load(std::sync::atomic::Ordering::Relaxed)
}

/// The member a `not_leader` answer points at (`http://sim-N`).
fn leader_index(e: &fencelock_server::ApiError) -> Option<usize> {
    let url = e.message();
    let at = url.find("http://sim-")?;
    let digits: String = url[at + 11..]
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits.parse::<usize>().ok().map(|id| id - 1)
}

async fn run(seed: u64, options: Options) -> Report {
    let mut root = Rng::new(seed);
    let mut fork = || Rng::new(root.next_u64());
    let net = Net::new(fork());
    let n = options.members;
    let slots: Vec<Slot> = (0..n)
        .map(|_| Slot {
            dir: tempfile::tempdir().expect("a temporary directory"),
            log: fencelock_server::cluster::log_store::LogStore::in_memory(),
        })
        .collect();
    let history = Arc::new(Mutex::new(History::default()));
    let mut handles = Vec::new();
    for (i, slot) in slots.iter().enumerate() {
        let h = start(i as u64 + 1, slot, n, &net, options.bugs).await;
        record_events(&h, &history, true);
        handles.push(Some(h));
    }
    let cluster = Arc::new(Cluster {
        handles: Mutex::new(handles),
        paused: Mutex::default(),
    });
    let start_at = Instant::now();
    let fault_end = start_at + Duration::from_millis(options.fault_ms);

    let mut clients = Vec::new();
    for c in 0..options.clients {
        clients.push(tokio::spawn(client(
            c,
            cluster.clone(),
            history.clone(),
            fork(),
            options.locks,
            fault_end,
        )));
    }
    for _ in 0..options.readers {
        clients.push(tokio::spawn(reader(
            cluster.clone(),
            history.clone(),
            fork(),
            options.locks,
            fault_end,
        )));
    }
    let mut report = Report::default();
    let mut rng = fork();
    let mut down: BTreeMap<usize, Instant> = BTreeMap::new();
    let ids: Vec<u64> = (1..=n as u64).collect();
    let mut heal_at: Option<Instant> = None;
    // Fault driver.
    let real = std::time::Instant::now();
    while Instant::now() < fault_end {
        tokio::time::sleep(Duration::from_millis(rng.range(200, 900))).await;
        if std::env::var_os("SIMDEBUG").is_some() {
            eprintln!(
                "virtual {:?} real {:?}",
                Instant::now() - start_at,
                real.elapsed()
            );
        }
        let now = Instant::now();
        // Restart members whose downtime is over.
        let due: Vec<usize> = down
            .iter()
            .filter(|(_, at)| **at <= now)
            .map(|(i, _)| *i)
            .collect();
        for i in due {
            down.remove(&i);
            let h = start(i as u64 + 1, &slots[i], n, &net, options.bugs).await;
            record_events(&h, &history, false);
            cluster.handles.lock().unwrap()[i] = Some(h);
        }
        if heal_at.is_some_and(|at| at <= now) {
            net.heal();
            heal_at = None;
        }
        let leader = current_leader(&cluster).await;
        let max_down = (n - 1) / 2;
        let fault = rng.index(7);
        let mut count = |k: &'static str| *report.faults.entry(k).or_default() += 1;
        match fault {
            0 | 1 if down.len() < max_down => {
                let victim = match (fault, leader) {
                    (1, Some(l)) => l,
                    _ => rng.index(n),
                };
                if down.contains_key(&victim) {
                    continue;
                }
                count(if fault == 1 { "crash-leader" } else { "crash" });
                net.down(victim as u64 + 1);
                let h = cluster.handles.lock().unwrap()[victim].take();
                if let Some(h) = h {
                    report.watchdog_elections += watchdog_elections(&h);
                    h.shutdown().await;
                }
                down.insert(victim, now + Duration::from_millis(rng.range(300, 2_500)));
            }
            2 => {
                if let Some(l) = leader {
                    count("isolate-leader");
                    net.isolate(l as u64 + 1, &ids, true);
                    heal_at = Some(now + Duration::from_millis(rng.range(600, 3_000)));
                }
            }
            3 => {
                count("isolate-member");
                net.isolate(rng.index(n) as u64 + 1, &ids, true);
                heal_at = Some(now + Duration::from_millis(rng.range(300, 2_000)));
            }
            4 => {
                count("lossy-slow");
                net.weather(rng.range(50, 300), rng.range(0, 80));
                heal_at = Some(now + Duration::from_millis(rng.range(500, 2_500)));
            }
            6 => {
                // A paused member (SIGSTOP, a long GC): nothing in or out until it
                // resumes, then everything late. Its own timers keep running.
                let victim = match leader {
                    Some(l) if rng.chance(500) => l,
                    _ => rng.index(n),
                };
                count(if Some(victim) == leader {
                    "pause-leader"
                } else {
                    "pause"
                });
                let until = now + Duration::from_millis(rng.range(300, 2_000));
                net.pause(victim as u64 + 1, until);
                cluster.paused.lock().unwrap().insert(victim, until);
            }
            5 => {
                let from = rng.index(n) as u64 + 1;
                let to = rng.index(n) as u64 + 1;
                if from != to {
                    count("cut-link");
                    net.cut(from, to);
                    heal_at = Some(now + Duration::from_millis(rng.range(300, 2_000)));
                }
            }
            _ => {}
        }
    }
    // Heal, restart everyone, and let the clients finish.
    net.heal();
    for i in std::mem::take(&mut down).into_keys() {
        let h = start(i as u64 + 1, &slots[i], n, &net, options.bugs).await;
        record_events(&h, &history, false);
        cluster.handles.lock().unwrap()[i] = Some(h);
    }
    let dbg = |what: &str| {
        if std::env::var_os("SIMDEBUG").is_some() {
            eprintln!(
                "{what}: virtual {:?} real {:?}",
                Instant::now() - start_at,
                real.elapsed()
            );
        }
    };
    dbg("healed");
    for c in clients {
        let _ = c.await;
    }
    dbg("clients done");
    if std::env::var_os("SIMDEBUG").is_some() {
        for i in 0..n {
            if let Some(h) = cluster.handle(i) {
                let Some(c) = h.cluster() else { continue };
                let m = openraft::async_runtime::WatchReceiver::borrow_watched(&c.raft.metrics())
                    .clone();
                eprintln!(
                    "member {i}: {:?} term {} last_log {:?} applied {:?} snapshot {:?}",
                    m.state, m.current_term, m.last_log_index, m.last_applied, m.snapshot
                );
            }
        }
        eprintln!("messages {:?}", net.counts.lock().unwrap());
    }
    // Progress: a fresh grant within the bound.
    let probe_start = Instant::now();
    let progressed = probe(&cluster, Duration::from_secs(10)).await;
    dbg("probed");
    report.messages = *net.counts.lock().unwrap();
    let failed: Vec<String> = (0..n)
        .filter_map(|i| cluster.handle(i))
        .filter_map(|h| match h.state() {
            RunState::Failed(why) => Some(why),
            _ => None,
        })
        .collect();
    for i in 0..n {
        let h = cluster.handles.lock().unwrap()[i].take();
        if let Some(h) = h {
            report.watchdog_elections += watchdog_elections(&h);
            h.shutdown().await;
        }
    }
    dbg("stopped");
    let history = std::mem::take(&mut *history.lock().unwrap());
    report.grants = history.grants.len() as u64;
    report.reads = history.reads.len() as u64;
    report.queued = history
        .streams
        .iter()
        .filter(|s| s.from_start && !s.lagged)
        .map(|s| {
            s.events
                .iter()
                .filter(|e| matches!(e, Applied::Queued { .. }))
                .count() as u64
        })
        .max()
        .unwrap_or(0);
    report.violation = check(&history).or_else(|| {
        if let Some(why) = failed.first() {
            return Some(Violation {
                invariant: Invariant::MemberFailed,
                detail: why.clone(),
            });
        }
        (!progressed).then(|| Violation {
            invariant: Invariant::Progress,
            detail: format!(
                "no grant within 10 s of the heal (probe from {:?} after start)",
                probe_start - start_at
            ),
        })
    });
    drop(slots);
    report
}

/// The leader as the members report it (index), if they agree.
async fn current_leader(cluster: &Cluster) -> Option<usize> {
    for i in 0..cluster.len() {
        if let Some(h) = cluster.handle(i) {
            if let Some(c) = h.cluster() {
                if let Some(l) = c.leader() {
                    return Some(l.id as usize - 1);
                }
            }
        }
    }
    None
}

fn args(name: &str, wait_ms: u64, request_id: &str) -> AcquireArgs {
    AcquireArgs {
        name: LockName::new(name).expect("a valid lock name"),
        ttl_ms: Some(TTL_MS),
        wait_ms,
        // The owner names the request, so the event streams tell waiters apart.
        owner: Owner::new(request_id).expect("a valid owner"),
        request_id: Some(RequestId::new(request_id).expect("a valid request id")),
        limit: 1,
        lock_delay_ms: 0,
        session: None,
        mode: Default::default(),
        value: None,
    }
}

/// Acquires `name` with one request id, following `not_leader` and retrying on
/// failures until the wait budget (plus slack) is spent.
async fn acquire(
    cluster: &Cluster,
    rng: &mut Rng,
    name: &str,
    request_id: &str,
    wait_ms: u64,
) -> Option<fencelock_core::Grant> {
    let first = Instant::now();
    let give_up = first + Duration::from_millis(wait_ms + 2_000);
    let mut target = rng.index(cluster.len());
    while Instant::now() < give_up {
        let Some(h) = cluster.reach(target).await else {
            target = rng.index(cluster.len());
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let left = give_up.saturating_duration_since(Instant::now());
        let wait = (left.as_millis() as u64).min(wait_ms);
        let attempt = tokio::time::timeout(
            Duration::from_millis(wait + 1_000),
            h.acquire(&Requester::anonymous(), args(name, wait, request_id)),
        )
        .await;
        match attempt {
            Ok(Ok(grant)) => return Some(grant),
            Ok(Err(e)) if e.kind() == ApiErrorKind::NotLeader => {
                target = leader_index(&e).unwrap_or_else(|| rng.index(cluster.len()));
            }
            Ok(Err(e)) if matches!(e.kind(), ApiErrorKind::Held | ApiErrorKind::Timeout) => {
                return None;
            }
            _ => target = rng.index(cluster.len()),
        }
        tokio::time::sleep(Duration::from_millis(rng.range(20, 120))).await;
    }
    None
}

async fn client(
    id: usize,
    cluster: Arc<Cluster>,
    history: Arc<Mutex<History>>,
    mut rng: Rng,
    locks: usize,
    until: Instant,
) {
    let margin = Duration::from_millis(TTL_MS / 10);
    let ttl = Duration::from_millis(TTL_MS);
    let mut n = 0u64;
    while Instant::now() < until {
        n += 1;
        let lock = format!("L{}", rng.index(locks));
        if rng.chance(300) {
            read(&cluster, &history, &mut rng, &lock).await;
            continue;
        }
        let request_id = format!("c{id}-{n}");
        let invoke = Instant::now();
        let Some(grant) = acquire(&cluster, &mut rng, &lock, &request_id, 1_500).await else {
            continue;
        };
        let ack = Instant::now();
        let mut deadline = invoke + ttl - margin;
        let index = {
            let mut h = history.lock().unwrap();
            h.grants.push(GrantRecord {
                client: id,
                request: request_id.clone(),
                lock: lock.clone(),
                fence: grant.fence.get(),
                token: grant.token.to_string(),
                invoke,
                ack,
                end: None,
            });
            h.grants.len() - 1
        };
        let hold_until = ack + Duration::from_millis(rng.range(50, 3_000));
        let end = loop {
            let now = Instant::now();
            if now >= deadline {
                break deadline; // lost: it stops believing at its deadline
            }
            if now >= hold_until {
                break now; // releasing: it stops believing before it sends
            }
            let next = (now + ttl / 3).min(hold_until).min(deadline);
            tokio::time::sleep_until(next).await;
            if Instant::now() >= deadline || Instant::now() >= hold_until {
                continue;
            }
            let sent = Instant::now();
            let target = rng.index(cluster.len());
            let mut renewed = false;
            for t in [
                target,
                (target + 1) % cluster.len(),
                (target + 2) % cluster.len(),
            ] {
                let Some(h) = cluster.reach(t).await else {
                    continue;
                };
                let r = tokio::time::timeout(
                    Duration::from_millis(300),
                    h.renew(
                        &Requester::anonymous(),
                        grant.name.clone(),
                        grant.token,
                        Some(TTL_MS),
                    ),
                )
                .await;
                if let Ok(Ok(_)) = r {
                    renewed = true;
                    break;
                }
                if let Ok(Err(e)) = &r {
                    if matches!(e.kind(), ApiErrorKind::NotHeld | ApiErrorKind::Expired) {
                        break;
                    }
                }
            }
            if renewed {
                deadline = deadline.max(sent + ttl - margin);
            }
        };
        history.lock().unwrap().grants[index].end = Some(end);
        if end < deadline {
            // Best effort: the lease ends it otherwise.
            for t in 0..cluster.len() {
                if let Some(h) = cluster.reach(t).await {
                    let r = tokio::time::timeout(
                        Duration::from_millis(300),
                        h.release(&Requester::anonymous(), grant.name.clone(), grant.token),
                    )
                    .await;
                    if matches!(r, Ok(Ok(_))) {
                        break;
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.range(0, 200))).await;
    }
}

/// Reads a random lock every few tens of milliseconds until `until`.
async fn reader(
    cluster: Arc<Cluster>,
    history: Arc<Mutex<History>>,
    mut rng: Rng,
    locks: usize,
    until: Instant,
) {
    while Instant::now() < until {
        let lock = format!("L{}", rng.index(locks));
        read(&cluster, &history, &mut rng, &lock).await;
        tokio::time::sleep(Duration::from_millis(rng.range(20, 150))).await;
    }
}

async fn read(cluster: &Cluster, history: &Mutex<History>, rng: &mut Rng, lock: &str) {
    let name = LockName::new(lock).expect("a valid lock name");
    let mut target = rng.index(cluster.len());
    for _ in 0..3 {
        let Some(h) = cluster.reach(target).await else {
            target = rng.index(cluster.len());
            continue;
        };
        let invoke = Instant::now();
        let r = tokio::time::timeout(Duration::from_millis(500), h.lock(name.clone())).await;
        match r {
            Ok(Ok(view)) => {
                let fences = view
                    .map(|v| v.holders.iter().map(|h| h.fence.get()).collect())
                    .unwrap_or_default();
                history.lock().unwrap().reads.push(ReadRecord {
                    lock: lock.to_owned(),
                    invoke,
                    complete: Instant::now(),
                    fences,
                });
                return;
            }
            Ok(Err(e)) if e.kind() == ApiErrorKind::NotLeader => {
                target = leader_index(&e).unwrap_or_else(|| rng.index(cluster.len()));
            }
            _ => target = rng.index(cluster.len()),
        }
    }
}

/// A grant, for the probe: any member, any outcome but a grant is no progress.
async fn probe(cluster: &Cluster, within: Duration) -> bool {
    let mut rng = Rng::new(0);
    let deadline = Instant::now() + within;
    let mut n = 0;
    while Instant::now() < deadline {
        n += 1;
        if acquire(
            cluster,
            &mut rng,
            &format!("probe-{n}"),
            &format!("probe-{n}"),
            500,
        )
        .await
        .is_some()
        {
            return true;
        }
    }
    false
}

/// FIFO over one member's applied events: a queued request is granted only when
/// every request queued before it on that lock has left the queue, nobody is
/// granted past waiters without having queued, and a request retried with its
/// request id (after a failover) never queues a second time: it keeps its place.
fn check_fifo(stream: &EventStream) -> Option<Violation> {
    let mut queues: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    let violation = |detail: String| {
        Some(Violation {
            invariant: Invariant::Fifo,
            detail,
        })
    };
    for e in &stream.events {
        match e {
            Applied::Queued { lock, owner } => {
                let queue = queues.entry(lock).or_default();
                if queue.contains(&owner.as_str()) {
                    return violation(format!(
                        "{owner} queued twice for {lock}: its retry lost its place"
                    ));
                }
                queue.push(owner);
            }
            Applied::Granted { lock, owner, .. } => {
                let queue = queues.entry(lock).or_default();
                match queue.iter().position(|o| o == owner) {
                    Some(0) => {
                        queue.remove(0);
                    }
                    Some(_) => {
                        return violation(format!(
                            "{owner} was granted {lock} ahead of {} queued before it",
                            queue[0]
                        ))
                    }
                    // (A stream that began mid-run may have missed its queueing.)
                    None if stream.from_start && !queue.is_empty() => {
                        return violation(format!(
                            "{owner} was granted {lock} without queueing while {} waited",
                            queue[0]
                        ))
                    }
                    None => {}
                }
            }
            Applied::WaitEnded { lock, owner } => {
                if let Some(queue) = queues.get_mut(lock.as_str()) {
                    queue.retain(|o| o != owner);
                }
            }
        }
    }
    None
}

/// The invariants over a run's history.
fn check(history: &History) -> Option<Violation> {
    let end_of = |g: &GrantRecord| g.end.unwrap_or(g.ack + Duration::from_secs(3600));
    let grants = &history.grants;
    // One fence, one grant.
    let mut by_fence: BTreeMap<u64, &GrantRecord> = BTreeMap::new();
    for g in grants {
        if let Some(other) = by_fence.insert(g.fence, g) {
            if other.token != g.token {
                return Some(Violation {
                    invariant: Invariant::FenceOrder,
                    detail: format!(
                        "fence {} issued twice: to client {} on {} and client {} on {}",
                        g.fence, other.client, other.lock, g.client, g.lock
                    ),
                });
            }
        }
    }
    for a in grants {
        for b in grants {
            if a.token == b.token {
                continue;
            }
            // A grant acknowledged before another was asked for has the smaller fence.
            if a.ack < b.invoke && a.fence >= b.fence {
                return Some(Violation {
                    invariant: Invariant::FenceOrder,
                    detail: format!(
                        "client {} got fence {} on {} before client {} asked for {} and got fence {}",
                        a.client, a.fence, a.lock, b.client, b.lock, b.fence
                    ),
                });
            }
            if a.lock == b.lock && a.ack < end_of(b) && b.ack < end_of(a) {
                return Some(Violation {
                    invariant: Invariant::MutualExclusion,
                    detail: format!(
                        "clients {} (fence {}) and {} (fence {}) both believed they held {}",
                        a.client, a.fence, b.client, b.fence, a.lock
                    ),
                });
            }
        }
    }
    for stream in &history.streams {
        if let Some(v) = check_fifo(stream) {
            return Some(v);
        }
    }
    // No lost acknowledged grant: a member that applied the whole history (and
    // is the furthest along) applied every grant a client was told of.
    let complete = history
        .streams
        .iter()
        .filter(|s| s.from_start && !s.lagged)
        .max_by_key(|s| s.events.len());
    if let Some(stream) = complete {
        let applied: std::collections::BTreeSet<(&str, &str, u64)> = stream
            .events
            .iter()
            .filter_map(|e| match e {
                Applied::Granted { lock, owner, fence } => {
                    Some((lock.as_str(), owner.as_str(), *fence))
                }
                _ => None,
            })
            .collect();
        let last_fence = applied.iter().map(|g| g.2).max().unwrap_or(0);
        for g in grants.iter().filter(|g| g.fence <= last_fence) {
            if !applied.contains(&(g.lock.as_str(), g.request.as_str(), g.fence)) {
                return Some(Violation {
                    invariant: Invariant::LostGrant,
                    detail: format!(
                        "client {} was granted {} with fence {} ({}), which the history does not hold",
                        g.client, g.lock, g.fence, g.request
                    ),
                });
            }
        }
    }
    for r in &history.reads {
        for g in grants.iter().filter(|g| g.lock == r.lock) {
            if g.ack < r.invoke && end_of(g) > r.complete && !r.fences.contains(&g.fence) {
                return Some(Violation {
                    invariant: Invariant::StaleRead,
                    detail: format!(
                        "a read of {} showed fences {:?}, without fence {} held by client {} since before the read",
                        r.lock, r.fences, g.fence, g.client
                    ),
                });
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(client: usize, request: &str, fence: u64) -> GrantRecord {
        let at = Instant::now();
        GrantRecord {
            client,
            request: request.to_owned(),
            lock: "L0".to_owned(),
            fence,
            token: format!("t{fence}"),
            invoke: at,
            ack: at,
            end: Some(at),
        }
    }

    fn granted(owner: &str, fence: u64) -> Applied {
        Applied::Granted {
            lock: "L0".to_owned(),
            owner: owner.to_owned(),
            fence,
        }
    }

    fn queued(owner: &str) -> Applied {
        Applied::Queued {
            lock: "L0".to_owned(),
            owner: owner.to_owned(),
        }
    }

    fn stream(events: Vec<Applied>) -> EventStream {
        EventStream {
            from_start: true,
            lagged: false,
            events,
        }
    }

    #[test]
    fn an_acknowledged_grant_missing_from_the_history_is_lost() {
        let mut history = History {
            grants: vec![grant(0, "a", 1), grant(1, "b", 2)],
            streams: vec![stream(vec![granted("a", 1), granted("c", 3)])],
            ..History::default()
        };
        let v = check(&history).expect("a lost grant");
        assert_eq!(v.invariant, Invariant::LostGrant, "{v}");
        history.streams = vec![stream(vec![granted("a", 1), granted("b", 2)])];
        assert!(check(&history).is_none());
    }

    #[test]
    fn fifo_catches_a_waiter_passed_over_or_queued_twice() {
        let passed = stream(vec![
            granted("a", 1),
            queued("b"),
            queued("c"),
            granted("c", 2),
        ]);
        assert_eq!(
            check_fifo(&passed).map(|v| v.invariant),
            Some(Invariant::Fifo)
        );
        let twice = stream(vec![granted("a", 1), queued("b"), queued("b")]);
        assert_eq!(
            check_fifo(&twice).map(|v| v.invariant),
            Some(Invariant::Fifo)
        );
        let barged = stream(vec![granted("a", 1), queued("b"), granted("x", 2)]);
        assert_eq!(
            check_fifo(&barged).map(|v| v.invariant),
            Some(Invariant::Fifo)
        );
        let fine = stream(vec![
            granted("a", 1),
            queued("b"),
            queued("c"),
            granted("b", 2),
            granted("c", 3),
        ]);
        assert!(check_fifo(&fine).is_none());
    }
}
