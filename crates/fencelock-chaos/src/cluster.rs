//! Chaos over a real 3-member cluster: member processes, per-link proxies, faults as
//! steps, and the same workers and checker as the single-server run.
//!
//! [`run`] starts three `fencelock serve` members on random loopback ports, each in
//! its own data directory, with a TCP proxy ([`crate::proxy`]) for every ordered pair
//! of members (member i dials member j through proxy (i, j): `--peer-dial`). The
//! workers get all three URLs and follow the leader ([`crate::leader`]). Then each
//! [`Fault`] of the configuration runs as one step: inject, wait, heal, and measure
//! progress — the time from the heal (and, for faults that leave a majority, from
//! the fault) to the first acquire some worker completed successfully. At the end the
//! workers stop and [`crate::checker::check`] judges every history: no overlapping
//! holders, no stale write accepted, fences strictly increasing, no acknowledged
//! grant lost.

use std::ffi::OsString;
use std::fmt;
use std::fs::OpenOptions;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::checker::{self, Report};
use crate::history;
use crate::http;
use crate::monotonic_ns;
use crate::proxy::{LinkMode, Proxies};
use crate::scenario::{self, percentile, signal, Stop, Tail, Workers};
use crate::worker::{Rng, WorkerConfig};

/// Members of the cluster.
pub const MEMBERS: u64 = 3;
/// How long a (re)started member may take to answer `GET /v1/cluster`.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the cluster may take to agree on a leader.
const LEADER_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a step waits for a grant before it records "no progress".
const PROGRESS_WAIT: Duration = Duration::from_secs(30);
/// The progress the run promises after each heal (and after a fault that leaves a
/// majority connected): some worker completes an acquire within this bound.
pub const PROGRESS_BOUND: Duration = Duration::from_secs(5);
/// How long a restarted or healed member may take to catch up.
const CATCH_UP_TIMEOUT: Duration = Duration::from_secs(60);

/// One fault step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// `kill -9` the leader; once a new leader granted, restart it.
    KillLeader,
    /// `SIGSTOP` the leader past three election timeouts, then `SIGCONT` it.
    StopLeader,
    /// Cut every link to and from the leader (it is the minority), then heal.
    PartitionLeader,
    /// Cut every link of a follower while the others commit
    /// [`ClusterChaosConfig::isolate_entries`] entries (or for
    /// [`ClusterChaosConfig::isolate_for`]), then heal and wait for it to catch up.
    IsolateFollower,
    /// Cut, delay and restore single links at random for a few seconds.
    FlapLinks,
    /// `kill -9` all three members and restart them.
    KillAll,
    /// Restart the members one by one (`SIGTERM`), followers first, each after the
    /// previous one has rejoined.
    RollingRestart,
    /// Start a fourth member, add it with `POST /v1/cluster/members`, then remove it
    /// with `DELETE /v1/cluster/members/4`. What worked is reported, not asserted.
    AddRemoveMember,
    /// `SIGSTOP` a worker that holds a lock until another worker has written with a
    /// newer fence, then resume it (its late write must be refused).
    StopHolder,
}

impl Fault {
    /// Every fault, in the order a full run injects them.
    pub const ALL: [Fault; 9] = [
        Fault::StopHolder,
        Fault::KillLeader,
        Fault::StopLeader,
        Fault::PartitionLeader,
        Fault::IsolateFollower,
        Fault::FlapLinks,
        Fault::KillAll,
        Fault::RollingRestart,
        Fault::AddRemoveMember,
    ];

    /// The promised time from the heal to the next grant: [`PROGRESS_BOUND`], plus
    /// one lease for [`Fault::KillAll`] — every holder lost its lease during that
    /// outage, and the new leader gives every lease a full TTL before it expires
    /// anything, so a lock whose holder gave up stays held up to one more TTL.
    pub fn progress_bound(self, ttl: Duration) -> Duration {
        match self {
            Fault::KillAll => PROGRESS_BOUND + ttl,
            _ => PROGRESS_BOUND,
        }
    }

    /// Parses a snake_case name (`kill_leader`, `isolate_follower`, …).
    pub fn from_name(name: &str) -> Option<Fault> {
        Fault::ALL.into_iter().find(|f| f.name() == name.trim())
    }

    /// The snake_case name.
    pub fn name(self) -> &'static str {
        match self {
            Fault::KillLeader => "kill_leader",
            Fault::StopLeader => "stop_leader",
            Fault::PartitionLeader => "partition_leader",
            Fault::IsolateFollower => "isolate_follower",
            Fault::FlapLinks => "flap_links",
            Fault::KillAll => "kill_all",
            Fault::RollingRestart => "rolling_restart",
            Fault::AddRemoveMember => "add_remove_member",
            Fault::StopHolder => "stop_holder",
        }
    }

    /// Whether a majority stays connected during the fault, so progress is due
    /// before the heal as well.
    pub fn keeps_majority(self) -> bool {
        matches!(
            self,
            Fault::KillLeader | Fault::StopLeader | Fault::PartitionLeader | Fault::IsolateFollower
        )
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct ClusterChaosConfig {
    /// The `fencelock` binary.
    pub server_bin: PathBuf,
    /// The program that becomes a worker when [`crate::WORKER_ENV`] is set.
    pub worker_program: PathBuf,
    /// Its arguments.
    pub worker_args: Vec<OsString>,
    /// Worker processes.
    pub workers: u32,
    /// Locks (each protecting its own resource file).
    pub locks: u32,
    /// Lease length the workers ask for (a cluster refuses less than three longest
    /// election timeouts: 3000 ms at the default heartbeat).
    pub ttl_ms: u64,
    /// `--raft-heartbeat-ms` of every member.
    pub heartbeat_ms: u64,
    /// False plants the bug: the workers write without the fence check (and do not
    /// look at the lost signal either).
    pub fenced: bool,
    /// The fault steps, in order.
    pub faults: Vec<Fault>,
    /// [`Fault::IsolateFollower`]: entries the leader must commit while the follower
    /// is cut off (0: only [`isolate_for`](Self::isolate_for)).
    pub isolate_entries: u64,
    /// [`Fault::IsolateFollower`]: the least isolation.
    pub isolate_for: Duration,
    /// [`Fault::IsolateFollower`] with `isolate_entries`: the longest isolation (the
    /// step stops waiting for the entries then).
    pub isolate_max: Duration,
    /// Threads that renew a lock of their own in a loop during
    /// [`Fault::IsolateFollower`], to grow the Raft log (unrecorded; 0: none).
    pub load_threads: u32,
    /// Seed of every random choice of the run and its workers.
    pub seed: u64,
}

impl ClusterChaosConfig {
    /// A short run's defaults: 4 workers on 2 locks, 3 s leases, heartbeat 100 ms,
    /// every fault once, a follower isolated for 3 s.
    pub fn new(server_bin: PathBuf, worker_program: PathBuf, seed: u64) -> ClusterChaosConfig {
        ClusterChaosConfig {
            server_bin,
            worker_program,
            worker_args: Vec::new(),
            workers: 4,
            locks: 2,
            ttl_ms: 3000,
            heartbeat_ms: 100,
            fenced: true,
            faults: Fault::ALL.to_vec(),
            isolate_entries: 0,
            isolate_for: Duration::from_secs(3),
            isolate_max: Duration::from_secs(3),
            load_threads: 0,
            seed,
        }
    }
}

/// What one step did and measured.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// The fault.
    pub fault: Fault,
    /// Fault → first successful acquire (faults that keep a majority only).
    pub failover: Option<Duration>,
    /// Heal → first successful acquire; `None`: none within the wait.
    pub progress: Option<Duration>,
    /// Whether the step did what it set out to (a holder found, the member joined…).
    pub done: bool,
    /// After the step: `(member, next fence)` of every member read at one applied
    /// index (`None`: they never showed the same index within 2 s).
    pub fences_at_same_index: Option<(u64, Vec<(u64, u64)>)>,
    /// [`Fault::IsolateFollower`]: whether the follower caught up by installing the
    /// leader's snapshot (its log says "install full snapshot" once more than before).
    pub snapshot_installed: Option<bool>,
    /// What happened, for a human.
    pub detail: String,
}

/// The outcome of a cluster run.
#[derive(Debug)]
pub struct ClusterSummary {
    /// The seed.
    pub seed: u64,
    /// Whether the resource checked fences.
    pub fenced: bool,
    /// The workers' lease length.
    pub ttl: Duration,
    /// One report per fault step.
    pub steps: Vec<StepReport>,
    /// Workers that had to be killed at the end.
    pub workers_killed: u32,
    /// The checker's verdict.
    pub report: Report,
    /// Wall time of the run.
    pub elapsed: Duration,
    /// The run's directory, kept when a fenced run found violations or a step made
    /// no progress.
    pub kept_dir: Option<PathBuf>,
    /// At the end, with the workers stopped: each member's applied log index and
    /// next fence (`fencelock_raft_applied_index`, `fencelock_next_fence`), once all
    /// had applied the same index (or as last read, after 10 s).
    pub final_state: Vec<(u64, Option<u64>, Option<u64>)>,
}

impl ClusterSummary {
    /// Members that applied the same log but disagree on the next fence: their state
    /// machines diverged. `None` when they agree (or did not reach one index).
    pub fn divergence(&self) -> Option<String> {
        // The first step after which members at one index disagreed.
        for (i, step) in self.steps.iter().enumerate() {
            if let Some((index, fences)) = &step.fences_at_same_index {
                if fences.iter().any(|f| f.1 != fences[0].1) {
                    return Some(format!(
                        "state machines diverged by step {} ({:?}): at applied index {index} the \
                         next fences (member, fence) were {fences:?}",
                        i + 1,
                        step.fault
                    ));
                }
            }
        }
        let first = self.final_state.first()?;
        let same_index = self
            .final_state
            .iter()
            .all(|m| m.1.is_some() && m.1 == first.1);
        let same_fence = self.final_state.iter().all(|m| m.2 == first.2);
        (same_index && !same_fence).then(|| {
            let members: Vec<String> = self
                .final_state
                .iter()
                .map(|(id, applied, fence)| {
                    format!("member {id}: applied {applied:?}, next fence {fence:?}")
                })
                .collect();
            format!("state machines diverged: {}", members.join("; "))
        })
    }
}

impl ClusterSummary {
    /// Heal → progress times of every step that made progress.
    pub fn progress_times(&self) -> Vec<Duration> {
        self.steps.iter().filter_map(|s| s.progress).collect()
    }

    /// Fault → progress times of the steps that kept a majority.
    pub fn failover_times(&self) -> Vec<Duration> {
        self.steps.iter().filter_map(|s| s.failover).collect()
    }

    /// Steps with no grant within [`Fault::progress_bound`] after the heal (or
    /// [`PROGRESS_BOUND`] after the fault, where a majority was left).
    pub fn slow_steps(&self) -> Vec<&StepReport> {
        self.steps
            .iter()
            .filter(|s| {
                s.progress
                    .is_none_or(|p| p > s.fault.progress_bound(self.ttl))
                    || (s.fault.keeps_majority() && s.failover.is_none_or(|p| p > PROGRESS_BOUND))
            })
            .collect()
    }
}

impl fmt::Display for ClusterSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = |d: Option<Duration>| d.map_or("-".to_owned(), |d| format!("{}ms", d.as_millis()));
        let r = &self.report;
        let progress = self.progress_times();
        let failover = self.failover_times();
        writeln!(
            f,
            "cluster chaos summary: fenced={} seed={} faults={} operations={} indeterminate={} \
             grants={} writes_accepted={} writes_refused={} violations={} progress_p50={} \
             progress_max={} failover_p50={} failover_max={} elapsed={:.1}s",
            self.fenced,
            self.seed,
            self.steps.len(),
            r.operations,
            r.indeterminate,
            r.grants,
            r.writes_accepted,
            r.writes_refused,
            r.violations.len(),
            ms(percentile(&progress, 50)),
            ms(percentile(&progress, 100)),
            ms(percentile(&failover, 50)),
            ms(percentile(&failover, 100)),
            self.elapsed.as_secs_f64(),
        )?;
        writeln!(
            f,
            "  final member state (id, applied, next fence): {:?}",
            self.final_state
        )?;
        if let Some(d) = self.divergence() {
            writeln!(f, "  {d}")?;
        }
        for s in &self.steps {
            writeln!(
                f,
                "  step {:?}: done={} failover={} progress={} fences_at_same_index={:?} — {}",
                s.fault,
                s.done,
                ms(s.failover),
                ms(s.progress),
                s.fences_at_same_index,
                s.detail
            )?;
        }
        Ok(())
    }
}

/// One member process: same ports and data directory across restarts.
struct Member {
    id: u64,
    port: u16,
    peer_port: u16,
    data_dir: PathBuf,
    log: PathBuf,
    args: Vec<OsString>,
    child: Option<Child>,
}

impl Member {
    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn spawn(&mut self, bin: &Path) -> Result<(), String> {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| format!("open member log: {e}"))?;
        let err = log.try_clone().map_err(|e| format!("member log: {e}"))?;
        let child = Command::new(bin)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("start member {}: {e}", self.id))?;
        self.child = Some(child);
        Ok(())
    }

    /// Starts the member and waits until it answers `GET /v1/cluster`; retries while
    /// its ports linger after a kill.
    fn start(&mut self, bin: &Path) -> Result<(), String> {
        let end = Instant::now() + START_TIMEOUT;
        loop {
            self.spawn(bin)?;
            loop {
                if self.status().is_some() {
                    return Ok(());
                }
                let child = self.child.as_mut().expect("spawned");
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    if Instant::now() >= end {
                        return Err(format!(
                            "member {} exited with {status}; see {}",
                            self.id,
                            self.log.display()
                        ));
                    }
                    break;
                }
                if Instant::now() >= end {
                    return Err(format!(
                        "member {} did not answer within {START_TIMEOUT:?}; see {}",
                        self.id,
                        self.log.display()
                    ));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Its `GET /v1/cluster`, when it answers 200.
    fn status(&self) -> Option<serde_json::Value> {
        self.child.as_ref()?;
        http::call(
            self.port,
            "GET",
            "/v1/cluster",
            None,
            Duration::from_millis(500),
        )
        .filter(|(status, _)| *status == 200)
        .map(|(_, body)| body)
    }

    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal(child.id(), libc::SIGCONT);
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// `SIGTERM`, then `kill -9` after 10 s.
    fn terminate(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal(child.id(), libc::SIGCONT);
            signal(child.id(), libc::SIGTERM);
            let end = Instant::now() + Duration::from_secs(10);
            while Instant::now() < end {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The three members and their link proxies.
struct Cluster {
    bin: PathBuf,
    members: Vec<Member>,
    proxies: Proxies,
}

/// `n` distinct free loopback ports.
fn free_ports(n: usize) -> Result<Vec<u16>, String> {
    let mut ports: Vec<u16> = Vec::with_capacity(n);
    for _ in 0..n * 20 {
        if ports.len() == n {
            break;
        }
        let port = fencelock_testkit::free_port().map_err(|e| e.to_string())?;
        if !ports.contains(&port) {
            ports.push(port);
        }
    }
    if ports.len() == n {
        Ok(ports)
    } else {
        Err("could not find distinct free ports".into())
    }
}

impl Cluster {
    fn start(bin: &Path, dir: &Path, heartbeat_ms: u64) -> Result<Cluster, String> {
        let ports = free_ports(2 * MEMBERS as usize)?;
        let mut proxies = Proxies::new()?;
        let peer_port = |id: u64| ports[(MEMBERS + id - 1) as usize];
        let peers = (1..=MEMBERS)
            .map(|id| format!("{id}=127.0.0.1:{}", peer_port(id)))
            .collect::<Vec<_>>()
            .join(",");
        let mut members = Vec::new();
        for id in 1..=MEMBERS {
            let mut dial = Vec::new();
            for to in (1..=MEMBERS).filter(|&to| to != id) {
                let target = SocketAddr::from((Ipv4Addr::LOCALHOST, peer_port(to)));
                let proxy = proxies.add(id, to, target)?;
                dial.push(format!("{to}=127.0.0.1:{proxy}"));
            }
            let port = ports[(id - 1) as usize];
            let data_dir = dir.join(format!("m{id}"));
            std::fs::create_dir_all(&data_dir).map_err(|e| format!("create data dir: {e}"))?;
            let args: Vec<OsString> = [
                "serve".to_owned(),
                "--node-id".into(),
                id.to_string(),
                "--listen".into(),
                format!("127.0.0.1:{port}"),
                "--peer-listen".into(),
                format!("127.0.0.1:{}", peer_port(id)),
                "--peers".into(),
                peers.clone(),
                "--peer-dial".into(),
                dial.join(","),
                "--advertise-url".into(),
                format!("http://127.0.0.1:{port}"),
                "--raft-heartbeat-ms".into(),
                heartbeat_ms.to_string(),
                "--log-format".into(),
                "json".into(),
                "--data-dir".into(),
            ]
            .into_iter()
            .map(OsString::from)
            .chain([data_dir.clone().into_os_string()])
            .collect();
            members.push(Member {
                id,
                port,
                peer_port: peer_port(id),
                data_dir,
                log: dir.join(format!("m{id}.log")),
                args,
                child: None,
            });
        }
        let mut cluster = Cluster {
            bin: bin.to_owned(),
            members,
            proxies,
        };
        for m in &mut cluster.members {
            m.spawn(bin)?;
        }
        for i in 0..cluster.members.len() {
            cluster.wait_up(i)?;
        }
        cluster.wait_leader(None)?;
        Ok(cluster)
    }

    fn member(&mut self, id: u64) -> &mut Member {
        &mut self.members[(id - 1) as usize]
    }

    fn urls(&self) -> Vec<String> {
        self.members.iter().map(Member::url).collect()
    }

    /// Waits until member index `i` answers (it was spawned).
    fn wait_up(&mut self, i: usize) -> Result<(), String> {
        let end = Instant::now() + START_TIMEOUT;
        while self.members[i].status().is_none() {
            if Instant::now() >= end {
                return Err(format!(
                    "member {} did not answer within {START_TIMEOUT:?}",
                    self.members[i].id
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// The leader as the running members (but `except`) see it: the one named in
    /// the highest term, if it agrees it leads.
    fn leader(&self, except: Option<u64>) -> Option<u64> {
        let statuses: Vec<(u64, serde_json::Value)> = self
            .members
            .iter()
            .filter(|m| Some(m.id) != except)
            .filter_map(|m| m.status().map(|s| (m.id, s)))
            .collect();
        let (_, best) = statuses
            .iter()
            .filter(|(_, s)| http::leader_id(s).is_some())
            .max_by_key(|(_, s)| s.get("term").and_then(|t| t.as_u64()).unwrap_or(0))?;
        let leader = http::leader_id(best)?;
        let agrees = statuses
            .iter()
            .any(|(id, s)| *id == leader && http::leader_id(s) == Some(leader));
        (agrees && Some(leader) != except).then_some(leader)
    }

    /// Waits for a leader other than `except`.
    fn wait_leader(&self, except: Option<u64>) -> Result<u64, String> {
        let end = Instant::now() + LEADER_TIMEOUT;
        loop {
            if let Some(leader) = self.leader(except) {
                return Ok(leader);
            }
            if Instant::now() >= end {
                return Err(format!("no leader within {LEADER_TIMEOUT:?}"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The leader's committed log index (`fencelock_raft_committed_index`).
    fn committed(&self, id: u64) -> Option<u64> {
        let m = &self.members[(id - 1) as usize];
        let (status, body) =
            http::call_raw(m.port, "GET", "/metrics", None, Duration::from_secs(2))?;
        if status != 200 {
            return None;
        }
        http::metric(
            &String::from_utf8_lossy(&body),
            "fencelock_raft_committed_index",
        )
        .map(|v| v as u64)
    }

    /// Reads every member's applied index and next fence until all show the same
    /// index (at most 2 s, while the workers keep the log moving).
    fn fences_at_same_index(&self) -> Option<(u64, Vec<(u64, u64)>)> {
        let end = Instant::now() + Duration::from_secs(2);
        while Instant::now() < end {
            let state: Vec<(u64, Option<u64>, Option<u64>)> = self
                .members
                .iter()
                .map(|m| {
                    let text =
                        http::call_raw(m.port, "GET", "/metrics", None, Duration::from_millis(500))
                            .filter(|(status, _)| *status == 200)
                            .map(|(_, body)| String::from_utf8_lossy(&body).into_owned())
                            .unwrap_or_default();
                    let read = |name| http::metric(&text, name).map(|v| v as u64);
                    (
                        m.id,
                        read("fencelock_raft_applied_index"),
                        read("fencelock_next_fence"),
                    )
                })
                .collect();
            let index = state[0].1;
            if index.is_some() && state.iter().all(|m| m.1 == index && m.2.is_some()) {
                let fences = state.iter().map(|m| (m.0, m.2.unwrap_or(0))).collect();
                return index.map(|i| (i, fences));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// `(member, applied index, next fence)` of every member, read until all report
    /// the same applied index (at most 10 s; the last reading otherwise).
    fn quiescent_state(&self) -> Vec<(u64, Option<u64>, Option<u64>)> {
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            let state: Vec<(u64, Option<u64>, Option<u64>)> = self
                .members
                .iter()
                .map(|m| {
                    let text =
                        http::call_raw(m.port, "GET", "/metrics", None, Duration::from_secs(2))
                            .filter(|(status, _)| *status == 200)
                            .map(|(_, body)| String::from_utf8_lossy(&body).into_owned())
                            .unwrap_or_default();
                    let read = |name| http::metric(&text, name).map(|v| v as u64);
                    (
                        m.id,
                        read("fencelock_raft_applied_index"),
                        read("fencelock_next_fence"),
                    )
                })
                .collect();
            let first = state[0].1;
            if first.is_some() && state.iter().all(|m| m.1 == first) || Instant::now() >= end {
                return state;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until the leader reports member `id` matched at `index` or beyond.
    fn wait_matched(&self, id: u64, index: u64) -> Option<Duration> {
        let started = Instant::now();
        while started.elapsed() < CATCH_UP_TIMEOUT {
            let matched = self
                .leader(None)
                .and_then(|l| self.members[(l - 1) as usize].status())
                .and_then(|s| {
                    s.get("members")?
                        .as_array()?
                        .iter()
                        .find(|m| m.get("id").and_then(|v| v.as_u64()) == Some(id))?
                        .get("matched_index")?
                        .as_u64()
                });
            if matched.is_some_and(|m| m >= index) {
                return Some(started.elapsed());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

/// Grows the Raft log: each thread acquires a lock of its own and renews it in a
/// loop at whichever member leads, until stopped. Counts the renewals confirmed.
struct Load {
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    fn start(threads: u32, ports: Vec<u16>, bound: Duration) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicU64::new(0));
        let threads = (0..threads)
            .map(|t| {
                let (stop, done, ports) = (stop.clone(), done.clone(), ports.clone());
                std::thread::spawn(move || load_loop(t, &ports, &stop, &done, bound))
            })
            .collect();
        Load {
            stop,
            done,
            threads,
        }
    }

    fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            let _ = t.join();
        }
        self.done.load(Ordering::Relaxed)
    }
}

fn load_loop(t: u32, ports: &[u16], stop: &AtomicBool, done: &AtomicU64, bound: Duration) {
    let name = format!("load:{t}");
    let end = Instant::now() + bound;
    let timeout = Duration::from_secs(1);
    let mut at = 0usize;
    let mut token: Option<String> = None;
    while !stop.load(Ordering::Relaxed) && Instant::now() < end {
        let port = ports[at % ports.len()];
        let answer = match &token {
            None => http::call(
                port,
                "POST",
                "/v1/acquire",
                Some(&serde_json::json!({"name": name, "ttl_ms": 60_000, "owner": "load"})),
                timeout,
            ),
            Some(tok) => http::call(
                port,
                "POST",
                "/v1/renew",
                Some(&serde_json::json!({"name": name, "owner_token": tok, "ttl_ms": 60_000})),
                timeout,
            ),
        };
        match answer {
            Some((200, body)) => {
                if token.is_none() {
                    token = body
                        .get("owner_token")
                        .and_then(|t| t.as_str())
                        .map(str::to_owned);
                } else {
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }
            Some((409, _)) => token = None,
            _ => {
                // Not the leader, or unreachable: try the next member.
                at += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// Runs one cluster chaos run. Errors are failures of the harness, not violations.
pub fn run(config: &ClusterChaosConfig) -> Result<ClusterSummary, crate::ChaosError> {
    let started = Instant::now();
    let dir = tempfile::Builder::new()
        .prefix("fencelock-cluster-chaos-")
        .tempdir()
        .map_err(|e| format!("temp dir: {e}"))?;
    let resource_dir = dir.path().join("resource");
    let history_dir = dir.path().join("history");
    let stop_file = dir.path().join("stop");
    for d in [&resource_dir, &history_dir] {
        std::fs::create_dir_all(d).map_err(|e| format!("create {}: {e}", d.display()))?;
    }
    let mut rng = Rng::new(config.seed);
    let mut cluster = Cluster::start(&config.server_bin, dir.path(), config.heartbeat_ms)?;
    let locks: Vec<String> = (0..config.locks).map(|i| format!("chaos:{i}")).collect();

    let mut workers = Workers {
        children: Vec::new(),
    };
    for id in 0..config.workers {
        let worker = WorkerConfig {
            id,
            url: cluster.members[0].url(),
            urls: cluster.urls(),
            stop_when_lost: config.fenced,
            locks: locks.clone(),
            resource_dir: resource_dir.clone(),
            history: history_dir.join(format!("w{id}.jsonl")),
            stop_file: stop_file.clone(),
            ttl_ms: config.ttl_ms,
            wait_ms: 2 * config.ttl_ms,
            hold_ms: config.ttl_ms / 4,
            fenced: config.fenced,
            seed: config.seed.wrapping_add(u64::from(id) + 1),
        };
        let log = dir.path().join(format!("w{id}.log"));
        workers.children.push(scenario::spawn_worker(
            &config.worker_program,
            &config.worker_args,
            &worker,
            &log,
        )?);
    }
    let mut tails: Vec<Tail> = (0..config.workers)
        .map(|id| Tail::new(history_dir.join(format!("w{id}.jsonl"))))
        .collect();
    // The first grant: the workers are up.
    if wait_grant(&mut tails, 0).is_none() {
        return Err(format!(
            "no worker acquired a lock within {PROGRESS_WAIT:?} of the start; see {}",
            dir.keep().display()
        )
        .into());
    }

    let mut ctx = Ctx {
        config,
        cluster: &mut cluster,
        tails: &mut tails,
        rng: &mut rng,
        workers: &workers,
        locks: &locks,
        resource_dir: &resource_dir,
        history_dir: &history_dir,
    };
    let mut steps = Vec::new();
    for &fault in &config.faults {
        let step = ctx.step(fault)?;
        steps.push(step);
        // Let the workers run between steps.
        std::thread::sleep(Duration::from_millis(300 + ctx.rng.below_or_eq(400)));
    }

    let workers_killed = scenario::stop_workers(&mut workers, &stop_file, config.ttl_ms)?;
    let final_state = cluster.quiescent_state();
    for m in &mut cluster.members {
        m.terminate();
    }
    drop(cluster);
    let events = history::read_dir(&history_dir)?;
    let mut summary = ClusterSummary {
        seed: config.seed,
        fenced: config.fenced,
        ttl: Duration::from_millis(config.ttl_ms),
        steps,
        workers_killed,
        report: checker::check(&events),
        elapsed: started.elapsed(),
        kept_dir: None,
        final_state,
    };
    if (config.fenced && !summary.report.violations.is_empty())
        || !summary.slow_steps().is_empty()
        || summary.divergence().is_some()
    {
        summary.kept_dir = Some(dir.keep());
    }
    Ok(summary)
}

/// Waits (up to [`PROGRESS_WAIT`]) for an acquire completed after `since_ns`;
/// returns the time from `since_ns` to that acquire's completion as seen now.
fn wait_grant(tails: &mut [Tail], since_ns: u64) -> Option<Duration> {
    let end = Instant::now() + PROGRESS_WAIT;
    loop {
        let mut first: Option<u64> = None;
        for t in tails.iter_mut() {
            if t.acquired_after(since_ns) {
                let at = t.first_acquired_after(since_ns);
                first = Some(first.map_or(at, |f| f.min(at)));
            }
        }
        if let Some(at) = first {
            return Some(Duration::from_nanos(at.saturating_sub(since_ns)));
        }
        if Instant::now() >= end {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// What a step needs.
struct Ctx<'a> {
    config: &'a ClusterChaosConfig,
    cluster: &'a mut Cluster,
    tails: &'a mut Vec<Tail>,
    rng: &'a mut Rng,
    workers: &'a Workers,
    locks: &'a [String],
    resource_dir: &'a Path,
    history_dir: &'a Path,
}

impl Ctx<'_> {
    fn step(&mut self, fault: Fault) -> Result<StepReport, String> {
        let mut report = self.inject(fault)?;
        report.fences_at_same_index = self.cluster.fences_at_same_index();
        Ok(report)
    }

    fn inject(&mut self, fault: Fault) -> Result<StepReport, String> {
        let mut report = StepReport {
            fault,
            failover: None,
            progress: None,
            done: true,
            fences_at_same_index: None,
            snapshot_installed: None,
            detail: String::new(),
        };
        let leader = self.cluster.wait_leader(None)?;
        let follower = (1..=MEMBERS)
            .filter(|&m| m != leader)
            .nth(self.rng.below_or_eq(MEMBERS - 2) as usize)
            .expect("a follower");
        let election_max = Duration::from_millis(10 * self.config.heartbeat_ms);
        let bin = self.cluster.bin.clone();
        let heal_ns = match fault {
            Fault::KillLeader => {
                let fault_ns = monotonic_ns();
                self.cluster.member(leader).kill9();
                let new = self.cluster.wait_leader(Some(leader))?;
                report.failover = wait_grant(self.tails, fault_ns);
                self.cluster.member(leader).start(&bin)?;
                report.detail = format!("killed leader {leader}; member {new} took over");
                monotonic_ns()
            }
            Fault::StopLeader => {
                let pid = self
                    .cluster
                    .member(leader)
                    .pid()
                    .ok_or("leader not running")?;
                let fault_ns = monotonic_ns();
                signal(pid, libc::SIGSTOP);
                std::thread::sleep(3 * election_max);
                let new = self.cluster.wait_leader(Some(leader));
                report.failover = wait_grant(self.tails, fault_ns);
                signal(pid, libc::SIGCONT);
                report.detail = format!(
                    "stopped leader {leader} for {:?}; new leader {new:?}",
                    Duration::from_nanos(monotonic_ns() - fault_ns)
                );
                new?;
                monotonic_ns()
            }
            Fault::PartitionLeader => {
                let fault_ns = monotonic_ns();
                self.cluster.proxies.set_member(leader, LinkMode::Cut);
                let new = self.cluster.wait_leader(Some(leader));
                report.failover = wait_grant(self.tails, fault_ns);
                let least = fault_ns + 3 * election_max.as_nanos() as u64;
                sleep_until_ns(least);
                self.cluster.proxies.set_all(LinkMode::Pass);
                report.detail = format!("cut leader {leader} off; new leader {new:?}");
                new?;
                monotonic_ns()
            }
            Fault::IsolateFollower => return self.isolate(follower, report),
            Fault::FlapLinks => {
                let mut flaps = Vec::new();
                for _ in 0..8 {
                    let a = 1 + self.rng.below_or_eq(MEMBERS - 1);
                    let b = 1 + (a + self.rng.below_or_eq(MEMBERS - 2)) % MEMBERS;
                    let mode = match self.rng.below_or_eq(2) {
                        0 => LinkMode::Cut,
                        1 => LinkMode::Delay(Duration::from_millis(50 + self.rng.below_or_eq(250))),
                        _ => LinkMode::Cut,
                    };
                    let both = self.rng.below_or_eq(1) == 0;
                    if both {
                        self.cluster.proxies.set_both(a, b, mode);
                    } else {
                        self.cluster.proxies.set(a, b, mode);
                    }
                    flaps.push(format!(
                        "{a}{}{b} {mode:?}",
                        if both { "<->" } else { "->" }
                    ));
                    std::thread::sleep(Duration::from_millis(200 + self.rng.below_or_eq(500)));
                    self.cluster.proxies.set_all(LinkMode::Pass);
                    std::thread::sleep(Duration::from_millis(100 + self.rng.below_or_eq(400)));
                }
                report.detail = format!("flapped {}", flaps.join(", "));
                monotonic_ns()
            }
            Fault::KillAll => {
                for m in &mut self.cluster.members {
                    m.kill9();
                }
                std::thread::sleep(Duration::from_millis(200));
                let restart_ns = monotonic_ns();
                for m in &mut self.cluster.members {
                    m.spawn(&bin)?;
                }
                for i in 0..self.cluster.members.len() {
                    self.cluster.wait_up(i)?;
                }
                let new = self.cluster.wait_leader(None)?;
                report.detail = format!("killed all three; leader {new} after restart");
                restart_ns
            }
            Fault::RollingRestart => {
                let order: Vec<u64> = (1..=MEMBERS)
                    .filter(|&m| m != leader)
                    .chain([leader])
                    .collect();
                let mut times = Vec::new();
                let mut last_ns = monotonic_ns();
                for id in order {
                    self.cluster.member(id).terminate();
                    last_ns = monotonic_ns();
                    self.cluster.member(id).start(&bin)?;
                    self.cluster.wait_leader(None)?;
                    let commit = self
                        .cluster
                        .leader(None)
                        .and_then(|l| self.cluster.committed(l))
                        .unwrap_or(0);
                    let caught_up = self.cluster.wait_matched(id, commit);
                    let grant = wait_grant(self.tails, last_ns);
                    times.push(format!(
                        "m{id}: caught up {:?}, grant {:?}",
                        caught_up.map(|d| d.as_millis()),
                        grant.map(|d| d.as_millis())
                    ));
                    if grant.is_none() {
                        break;
                    }
                }
                report.detail = format!("restarted in turn: {}", times.join("; "));
                last_ns
            }
            Fault::AddRemoveMember => return self.add_remove(leader, report),
            Fault::StopHolder => {
                let outcome = scenario::stop_a_holder(
                    self.rng,
                    self.cluster.members[(leader - 1) as usize].port,
                    self.workers,
                    self.locks,
                    self.resource_dir,
                    self.history_dir,
                    self.config.ttl_ms,
                );
                report.done = outcome == Some(Stop::OvertakenBy);
                report.detail = format!("holder stop: {outcome:?}");
                monotonic_ns()
            }
        };
        report.progress = wait_grant(self.tails, heal_ns);
        Ok(report)
    }

    fn isolate(&mut self, follower: u64, mut report: StepReport) -> Result<StepReport, String> {
        let leader = self.cluster.wait_leader(None)?;
        let snap = self.cluster.members[(follower - 1) as usize]
            .data_dir
            .join("raft")
            .join("sm.snap");
        let snap_before = modified(&snap);
        let log = self.cluster.members[(follower - 1) as usize].log.clone();
        let installs_before = count_lines(&log, "install full snapshot");
        let commit_before = self.cluster.committed(leader).unwrap_or(0);
        let fault_ns = monotonic_ns();
        self.cluster.proxies.set_member(follower, LinkMode::Cut);
        let ports: Vec<u16> = self.cluster.members.iter().map(|m| m.port).collect();
        let least = self.config.isolate_for.max(Duration::from_secs(1));
        let longest = self.config.isolate_max.max(least);
        let load = (self.config.load_threads > 0)
            .then(|| Load::start(self.config.load_threads, ports, longest));
        report.failover = wait_grant(self.tails, fault_ns);
        let target = commit_before + self.config.isolate_entries;
        let started = Instant::now();
        // At least `isolate_for`; with an entry target, until it is reached or
        // `isolate_max` has passed.
        loop {
            let elapsed = started.elapsed();
            let commit = self
                .cluster
                .leader(Some(follower))
                .and_then(|l| self.cluster.committed(l))
                .unwrap_or(0);
            if elapsed >= least && (commit >= target || elapsed >= longest) {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        let renewals = load.map_or(0, Load::stop);
        let commit_at_heal = self
            .cluster
            .leader(Some(follower))
            .and_then(|l| self.cluster.committed(l))
            .unwrap_or(0);
        self.cluster.proxies.set_all(LinkMode::Pass);
        let heal_ns = monotonic_ns();
        let caught_up = self.cluster.wait_matched(follower, commit_at_heal);
        report.progress = wait_grant(self.tails, heal_ns);
        let snapshot_written = modified(&snap) != snap_before;
        let installed = count_lines(&log, "install full snapshot") > installs_before;
        report.snapshot_installed = Some(installed);
        report.done = caught_up.is_some();
        report.detail = format!(
            "isolated follower {follower} for {:.1}s while {} entries were committed ({} load \
             renewals; target {}); caught up {:?} after the heal; {}; snapshot file {}",
            Duration::from_nanos(heal_ns - fault_ns).as_secs_f64(),
            commit_at_heal.saturating_sub(commit_before),
            renewals,
            self.config.isolate_entries,
            caught_up.map(|d| d.as_millis()),
            if installed {
                "installed the leader's snapshot"
            } else {
                "no snapshot installed (caught up from the log)"
            },
            if snapshot_written {
                "rewritten"
            } else {
                "unchanged"
            }
        );
        Ok(report)
    }

    fn add_remove(&mut self, leader: u64, mut report: StepReport) -> Result<StepReport, String> {
        let dir = self.cluster.members[0]
            .data_dir
            .parent()
            .ok_or("no run directory")?
            .to_owned();
        let ports = free_ports(2)?;
        let (port, peer_port) = (ports[0], ports[1]);
        let mut peers: Vec<String> = self
            .cluster
            .members
            .iter()
            .map(|m| format!("{}=127.0.0.1:{}", m.id, m.peer_port))
            .collect();
        peers.push(format!("4=127.0.0.1:{peer_port}"));
        let data_dir = dir.join("m4");
        std::fs::create_dir_all(&data_dir).map_err(|e| format!("create data dir: {e}"))?;
        let args: Vec<OsString> = [
            "serve".to_owned(),
            "--node-id".into(),
            "4".into(),
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--peer-listen".into(),
            format!("127.0.0.1:{peer_port}"),
            "--peers".into(),
            peers.join(","),
            "--advertise-url".into(),
            format!("http://127.0.0.1:{port}"),
            "--raft-heartbeat-ms".into(),
            self.config.heartbeat_ms.to_string(),
            "--log-format".into(),
            "json".into(),
            "--data-dir".into(),
        ]
        .into_iter()
        .map(OsString::from)
        .chain([data_dir.clone().into_os_string()])
        .collect();
        let mut fourth = Member {
            id: 4,
            port,
            peer_port,
            data_dir,
            log: dir.join("m4.log"),
            args,
            child: None,
        };
        let bin = self.cluster.bin.clone();
        fourth.start(&bin)?;
        let leader_port = self.cluster.members[(leader - 1) as usize].port;
        let fault_ns = monotonic_ns();
        let added = http::call(
            leader_port,
            "POST",
            "/v1/cluster/members",
            Some(&serde_json::json!({
                "id": 4,
                "peer_addr": format!("127.0.0.1:{peer_port}"),
                "url": format!("http://127.0.0.1:{port}"),
            })),
            Duration::from_secs(20),
        );
        // Joined: the leader reports it matched up to what was committed when it was
        // added (bounded).
        let commit = self
            .cluster
            .leader(None)
            .and_then(|l| self.cluster.committed(l))
            .unwrap_or(0);
        let caught_up = self.cluster.wait_matched(4, commit);
        let seen_by_four = fourth.status();
        let joined = self
            .cluster
            .leader(None)
            .and_then(|l| self.cluster.members[(l - 1) as usize].status())
            .and_then(|s| {
                s.get("members")?
                    .as_array()?
                    .iter()
                    .find(|m| m.get("id").and_then(|v| v.as_u64()) == Some(4))
                    .cloned()
            });
        let grant_with_four = wait_grant(self.tails, fault_ns);
        let removed_ns = monotonic_ns();
        let leader_now = self.cluster.wait_leader(None)?;
        let removed = http::call(
            self.cluster.members[(leader_now - 1) as usize].port,
            "DELETE",
            "/v1/cluster/members/4",
            None,
            Duration::from_secs(20),
        );
        fourth.terminate();
        report.failover = grant_with_four;
        report.done = added.as_ref().is_some_and(|(s, _)| *s == 200)
            && caught_up.is_some()
            && removed.as_ref().is_some_and(|(s, _)| *s == 200);
        report.detail = format!(
            "add member 4 (started with --peers listing all four): {:?}; caught up to index \
             {commit} after {:?}; as the leader lists it then: {}; member 4's own view: {}; \
             remove: {:?}",
            added.map(|(s, b)| format!("{s} {b}")),
            caught_up.map(|d| d.as_millis()),
            joined.map_or("absent".to_owned(), |j| j.to_string()),
            seen_by_four.map_or("no answer".to_owned(), |j| j.to_string()),
            removed.map(|(s, b)| format!("{s} {b}")),
        );
        report.progress = wait_grant(self.tails, removed_ns);
        Ok(report)
    }
}

/// Lines of the file at `path` that contain `needle` (0 if unreadable).
fn count_lines(path: &Path, needle: &str) -> usize {
    std::fs::read_to_string(path)
        .map(|text| text.lines().filter(|l| l.contains(needle)).count())
        .unwrap_or(0)
}

fn modified(path: &Path) -> Option<std::time::SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Sleeps until `CLOCK_MONOTONIC` reaches `ns` (at most 60 s).
fn sleep_until_ns(ns: u64) {
    let now = monotonic_ns();
    if ns > now {
        std::thread::sleep(Duration::from_nanos(ns - now).min(Duration::from_secs(60)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(final_state: Vec<(u64, Option<u64>, Option<u64>)>) -> ClusterSummary {
        ClusterSummary {
            seed: 0,
            fenced: true,
            ttl: Duration::from_secs(3),
            steps: Vec::new(),
            workers_killed: 0,
            report: Report::default(),
            elapsed: Duration::ZERO,
            kept_dir: None,
            final_state,
        }
    }

    #[test]
    fn members_that_applied_the_same_log_must_agree_on_the_fence() {
        let agree = summary(vec![(1, Some(9), Some(5)), (2, Some(9), Some(5))]);
        assert_eq!(agree.divergence(), None);
        let diverged = summary(vec![(1, Some(9), Some(5)), (2, Some(9), Some(7))]);
        assert!(diverged
            .divergence()
            .is_some_and(|d| d.contains("member 2")));
        // Different applied indexes prove nothing.
        let lagging = summary(vec![(1, Some(9), Some(5)), (2, Some(8), Some(4))]);
        assert_eq!(lagging.divergence(), None);
    }

    #[test]
    fn a_step_whose_members_disagree_is_named() {
        let mut s = summary(vec![(1, Some(9), Some(5)), (2, Some(9), Some(5))]);
        let step = |fences| StepReport {
            fault: Fault::RollingRestart,
            failover: None,
            progress: None,
            done: true,
            fences_at_same_index: Some((7, fences)),
            snapshot_installed: None,
            detail: String::new(),
        };
        s.steps = vec![step(vec![(1, 4), (2, 4)]), step(vec![(1, 4), (2, 6)])];
        assert!(s
            .divergence()
            .is_some_and(|d| d.contains("by step 2 (RollingRestart)")));
    }

    #[test]
    fn fault_names_round_trip() {
        for f in Fault::ALL {
            assert_eq!(Fault::from_name(f.name()), Some(f));
        }
        assert_eq!(Fault::from_name("nope"), None);
        assert_eq!(
            Fault::KillAll.progress_bound(Duration::from_secs(3)),
            PROGRESS_BOUND + Duration::from_secs(3)
        );
    }
}
