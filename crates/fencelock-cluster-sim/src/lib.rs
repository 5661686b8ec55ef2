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

#[derive(Default)]
struct History {
    grants: Vec<GrantRecord>,
    reads: Vec<ReadRecord>,
}

/// The members of a run, as clients see them.
struct Cluster {
    handles: Mutex<Vec<Option<Handle>>>,
}

impl Cluster {
    fn handle(&self, i: usize) -> Option<Handle> {
        self.handles.lock().unwrap()[i].clone()
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
    let mut handles = Vec::new();
    for (i, slot) in slots.iter().enumerate() {
        handles.push(Some(start(i as u64 + 1, slot, n, &net, options.bugs).await));
    }
    let cluster = Arc::new(Cluster {
        handles: Mutex::new(handles),
    });
    let history = Arc::new(Mutex::new(History::default()));
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
            cluster.handles.lock().unwrap()[i] = Some(h);
        }
        if heal_at.is_some_and(|at| at <= now) {
            net.heal();
            heal_at = None;
        }
        let leader = current_leader(&cluster).await;
        let max_down = (n - 1) / 2;
        let fault = rng.index(6);
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
        owner: Owner::new("sim").expect("a valid owner"),
        request_id: Some(RequestId::new(request_id).expect("a valid request id")),
        limit: 1,
        lock_delay_ms: 0,
        session: None,
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
        let Some(h) = cluster.handle(target) else {
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
                let Some(h) = cluster.handle(t) else { continue };
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
                if let Some(h) = cluster.handle(t) {
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
        let Some(h) = cluster.handle(target) else {
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
