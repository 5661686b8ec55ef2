//! W4 (sessions) and W5 (recovery): fencelock-only workloads, spoken in raw gRPC
//! (`fencelock_proto`) so that the harness can drive a hundred thousand sessions or a
//! million locks without a guard and a renewal task for each.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use fencelock_proto::locks_client::LocksClient;
use fencelock_proto::{self as pb, EventKind};
use tonic::transport::{Channel, Endpoint};

use crate::peers::{self, Peer};
use crate::workload::Percentiles;

async fn channels(url: &str, n: usize) -> anyhow::Result<Vec<LocksClient<Channel>>> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let channel = Endpoint::from_shared(url.to_owned())?.connect().await?;
        out.push(LocksClient::new(channel));
    }
    Ok(out)
}

/// CPU seconds (user + system) a process has used so far.
pub fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command (which may contain spaces) end with ')'.
    let rest = stat.rsplit_once(')').context("bad /proc stat")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>()? + fields[12].parse::<u64>()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Ok(ticks as f64 / hz)
}

/// Resident memory of a process in MiB.
pub fn rss_mib(pid: u32) -> anyhow::Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .context("no VmRSS")?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()?;
    Ok(kib / 1024.0)
}

/// W4's shape.
#[derive(Debug, Clone)]
pub struct SessionsSpec {
    /// Sessions kept alive.
    pub sessions: usize,
    /// Session lease.
    pub ttl: Duration,
    /// How long all sessions are kept alive after they are open.
    pub hold: Duration,
    /// Sessions that are left to expire (each holding a lock) to measure precision.
    pub expiry_sample: usize,
}

/// What W4 measured.
#[derive(Debug, Clone, Default)]
pub struct SessionsOutcome {
    /// Sessions opened.
    pub opened: u64,
    /// Opens per second during the ramp.
    pub open_per_s: f64,
    /// Sessions whose keep-alive failed during the hold (they expired: the node could
    /// not keep up).
    pub lost: u64,
    /// Keep-alives answered during the hold, per second.
    pub keepalives_per_s: f64,
    /// The longest time a session went unrenewed (it expires past `ttl`).
    pub max_renew_gap_s: f64,
    /// Keep-alive round trips during the hold (send to answer, µs): how long a
    /// renewal waits on a node carrying every session's keep-alives.
    pub keepalive_latency: Percentiles,
    /// Server CPU during the hold, in cores (1.0 = one core busy).
    pub server_cpu_cores: f64,
    /// Server RSS at the end.
    pub server_rss_mib: f64,
    /// Lateness of expiry: event time minus (open acknowledged + TTL), ms.
    pub expiry_late_ms: Percentiles,
    /// Sample sessions whose expiry was never seen.
    pub expiry_missing: u64,
}

const STREAMS: usize = 32;

/// Runs W4 against the server at `url` (process `pid`).
pub async fn sessions(url: &str, pid: u32, spec: &SessionsSpec) -> anyhow::Result<SessionsOutcome> {
    let clients = channels(url, 8).await?;
    let ttl_ms = spec.ttl.as_millis() as u64;
    // STREAMS tasks each open their share of the sessions and keep them alive: a
    // session is renewed once ttl/2 has passed since it was opened or last renewed,
    // before opening the next one, so the ramp itself never lets a session expire.
    // Renewals go over one KeepAlive stream per task, which the server answers in order.
    let ramp = Instant::now();
    let stop = Arc::new(tokio::sync::Notify::new());
    let answered = Arc::new(AtomicU64::new(0));
    let lost = Arc::new(AtomicU64::new(0));
    let opened = Arc::new(AtomicU64::new(0));
    let max_gap_us = Arc::new(AtomicU64::new(0));
    // Keep-alive round trips, recorded only while `holding` (after the ramp).
    let holding = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let latencies = Arc::new(std::sync::Mutex::new(Vec::<u32>::new()));
    let interval = spec.ttl / 2;
    let mut keepers = Vec::new();
    for i in 0..STREAMS {
        let mut client = clients[i % clients.len()].clone();
        let n = spec.sessions / STREAMS + usize::from(i < spec.sessions % STREAMS);
        let (stop, answered, lost, opened, max_gap_us) = (
            stop.clone(),
            answered.clone(),
            lost.clone(),
            opened.clone(),
            max_gap_us.clone(),
        );
        let (holding, latencies) = (holding.clone(), latencies.clone());
        keepers.push(tokio::spawn(async move {
            let mut due: std::collections::VecDeque<(Instant, String)> =
                std::collections::VecDeque::with_capacity(n);
            let mut opened_here = 0;
            let stopped = stop.notified();
            tokio::pin!(stopped);
            'reopen: loop {
                let (tx, rx) = tokio::sync::mpsc::channel(1);
                let mut responses = client
                    .keep_alive(tokio_stream::wrappers::ReceiverStream::new(rx))
                    .await?
                    .into_inner();
                loop {
                    let now = Instant::now();
                    if let Some((last, _)) = due.front().filter(|(t, _)| *t + interval <= now) {
                        max_gap_us.fetch_max((now - *last).as_micros() as u64, Ordering::Relaxed);
                        let (_, session) = due.pop_front().expect("front exists");
                        tx.send(pb::KeepAliveRequest {
                            session: session.clone(),
                        })
                        .await?;
                        let reply = responses.message().await;
                        if holding.load(Ordering::Relaxed) {
                            let us = now.elapsed().as_micros().min(u128::from(u32::MAX)) as u32;
                            latencies.lock().unwrap_or_else(|p| p.into_inner()).push(us);
                        }
                        match reply {
                            Ok(Some(_)) => {
                                answered.fetch_add(1, Ordering::Relaxed);
                                due.push_back((now, session));
                            }
                            _ => {
                                // Gone (expired): count it and carry on on a new stream.
                                lost.fetch_add(1, Ordering::Relaxed);
                                continue 'reopen;
                            }
                        }
                    } else if opened_here < n {
                        let open = client
                            .open_session(pb::OpenSessionRequest {
                                ttl_ms,
                                owner: "w4".into(),
                            })
                            .await?
                            .into_inner();
                        opened_here += 1;
                        opened.fetch_add(1, Ordering::Relaxed);
                        due.push_back((Instant::now(), open.session));
                    } else {
                        let next = due.front().map_or(now + interval, |(t, _)| *t + interval);
                        tokio::select! {
                            _ = &mut stopped => return anyhow::Ok(()),
                            _ = tokio::time::sleep_until(next.into()) => {}
                        }
                    }
                }
            }
        }));
    }
    while opened.load(Ordering::Relaxed) < spec.sessions as u64 {
        anyhow::ensure!(
            keepers.iter().all(|k| !k.is_finished()),
            "a keep-alive task failed during the ramp"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let open_s = ramp.elapsed().as_secs_f64();
    let opened = opened.load(Ordering::Relaxed);

    // Expiry precision: sessions that are never renewed, each holding one lock.
    let mut watch = clients[0]
        .clone()
        .watch(pb::WatchRequest {
            prefix: "w4-expiry/".into(),
            after: None,
        })
        .await?
        .into_inner();
    let mut due = std::collections::HashMap::new();
    for i in 0..spec.expiry_sample {
        let mut client = clients[i % clients.len()].clone();
        // The lease cannot start before the request is sent: measuring from the answer
        // instead would call a slow answer (a loaded machine) an early expiry.
        let sent = Instant::now();
        let open = client
            .open_session(pb::OpenSessionRequest {
                ttl_ms,
                owner: "w4-expiry".into(),
            })
            .await?
            .into_inner();
        let name = format!("w4-expiry/{i}");
        client
            .acquire(pb::AcquireRequest {
                name: name.clone(),
                session: Some(open.session),
                limit: 1,
                ..Default::default()
            })
            .await?;
        due.insert(name, sent + spec.ttl);
    }
    let cpu0 = cpu_seconds(pid)?;
    let answered0 = answered.load(Ordering::Relaxed);
    holding.store(true, Ordering::Relaxed);
    let hold_start = Instant::now();
    let hold_end = hold_start + spec.hold.max(spec.ttl + Duration::from_secs(2));
    let mut late_us = Vec::new();
    while !due.is_empty() {
        let next = tokio::time::timeout_at(hold_end.into(), watch.message()).await;
        let Ok(Ok(Some(event))) = next else { break };
        if event.kind == EventKind::Expired as i32 || event.kind == EventKind::Released as i32 {
            if let Some(deadline) = due.remove(&event.name) {
                let now = Instant::now();
                let late = now.saturating_duration_since(deadline).as_micros() as i64
                    - deadline.saturating_duration_since(now).as_micros() as i64;
                // Early expiries would be negative; clamp into the u32 histogram at 0
                // and count them separately below.
                anyhow::ensure!(late >= -50_000, "a session expired {late} µs early");
                late_us.push(late.max(0) as u32);
            }
        }
    }
    tokio::time::sleep_until(hold_end.into()).await;
    let held_s = hold_start.elapsed().as_secs_f64();
    let cpu = cpu_seconds(pid)? - cpu0;
    let answered_in_hold = answered.load(Ordering::Relaxed) - answered0;
    holding.store(false, Ordering::Relaxed);
    let keepalive_latency = Percentiles::of(std::mem::take(
        &mut *latencies.lock().unwrap_or_else(|p| p.into_inner()),
    ));
    stop.notify_waiters();
    for keeper in keepers {
        keeper.abort();
    }
    Ok(SessionsOutcome {
        opened,
        open_per_s: opened as f64 / open_s,
        lost: lost.load(Ordering::Relaxed),
        keepalives_per_s: answered_in_hold as f64 / held_s,
        max_renew_gap_s: max_gap_us.load(Ordering::Relaxed) as f64 / 1e6,
        keepalive_latency,
        server_cpu_cores: cpu / held_s,
        server_rss_mib: rss_mib(pid)?,
        expiry_missing: due.len() as u64,
        expiry_late_ms: {
            let p = Percentiles::of(late_us);
            Percentiles {
                p50_us: p.p50_us / 1000,
                p99_us: p.p99_us / 1000,
                p999_us: p.p999_us / 1000,
                max_us: p.max_us / 1000,
            }
        },
    })
}

/// W5's shape.
#[derive(Debug, Clone)]
pub struct RecoverySpec {
    /// Locks held when the server is killed.
    pub locks: usize,
    /// Held locks whose fence is read back after the restart.
    pub spot_checks: usize,
    /// Keep the data directory here (for profiling restarts) instead of a temp dir.
    pub keep_data: Option<std::path::PathBuf>,
}

/// What W5 measured.
#[derive(Debug, Clone, Default)]
pub struct RecoveryOutcome {
    /// Locks acquired (and held) before the kill.
    pub locks: u64,
    /// Acquires per second while filling.
    pub fill_per_s: f64,
    /// Server RSS before the kill.
    pub rss_before_mib: f64,
    /// Size of the data directory at the kill.
    pub data_mib: f64,
    /// From spawning the restarted server to its first answered request.
    pub ready_s: f64,
    /// The largest fence seen before the kill.
    pub max_fence_before: u64,
    /// The first fence after the restart.
    pub first_fence_after: u64,
    /// Spot-checked locks that came back with a different fence, or not at all.
    pub lost_or_changed: u64,
    /// `first_fence_after <= max_fence_before` (must be 0).
    pub fence_decreases: u64,
}

fn dir_mib(dir: &Path) -> f64 {
    fn walk(dir: &Path) -> u64 {
        std::fs::read_dir(dir)
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok())
                    .map(|e| match e.metadata() {
                        Ok(m) if m.is_dir() => walk(&e.path()),
                        Ok(m) => m.len(),
                        Err(_) => 0,
                    })
                    .sum()
            })
            .unwrap_or(0)
    }
    walk(dir) as f64 / (1024.0 * 1024.0)
}

/// Runs W5: fills a fresh durable server with `spec.locks` held locks, kills it with
/// SIGKILL, restarts it on the same data directory and times it until it answers;
/// then checks that held locks kept their fences and new fences are larger.
pub async fn recovery(binary: &Path, spec: &RecoverySpec) -> anyhow::Result<RecoveryOutcome> {
    let temp = tempfile::Builder::new()
        .prefix("fencelock-bench-w5-")
        .tempdir()?;
    let data = match &spec.keep_data {
        Some(dir) => {
            std::fs::create_dir_all(dir)?;
            dir.clone()
        }
        None => temp.path().to_owned(),
    };
    let server = peers::fencelock(binary, true, Some(&data))?;
    let url = format!("http://127.0.0.1:{}", server.port());
    let clients = channels(&url, 8).await?;
    let fill = Instant::now();
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for t in 0..64 {
        let mut client = clients[t % clients.len()].clone();
        let (next, total) = (next.clone(), spec.locks as u64);
        let spot = spec.spot_checks as u64;
        tasks.push(tokio::spawn(async move {
            let mut max_fence = 0u64;
            let mut spots = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total {
                    return anyhow::Ok((max_fence, spots));
                }
                let grant = client
                    .acquire(pb::AcquireRequest {
                        name: format!("w5/{i:07}"),
                        ttl_ms: Some(3_600_000),
                        limit: 1,
                        // As the client library sends one with every acquire.
                        request_id: Some(format!("{:016x}{i:016x}", std::process::id())),
                        ..Default::default()
                    })
                    .await?
                    .into_inner();
                max_fence = max_fence.max(grant.fence);
                if i % (total / spot.max(1)).max(1) == 0 {
                    spots.push((grant.name, grant.fence));
                }
            }
        }));
    }
    let (mut max_fence, mut spots) = (0, Vec::new());
    for task in tasks {
        let (m, s) = task.await??;
        max_fence = max_fence.max(m);
        spots.extend(s);
    }
    let fill_s = fill.elapsed().as_secs_f64();
    let rss_before = rss_mib(server.pid())?;
    drop(clients);
    drop(server); // SIGKILL
    let data_mib = dir_mib(&data);

    let restart = Instant::now();
    let server: Peer = peers::fencelock(binary, true, Some(&data))?;
    let ready_s = restart.elapsed().as_secs_f64();
    let url = format!("http://127.0.0.1:{}", server.port());
    let mut client = channels(&url, 1).await?.remove(0);
    let mut lost_or_changed = 0;
    for (name, fence) in &spots {
        let info = client
            .get_lock(pb::GetLockRequest { name: name.clone() })
            .await;
        let same = info.is_ok_and(|i| i.into_inner().holders.iter().any(|h| h.fence == *fence));
        lost_or_changed += u64::from(!same);
    }
    let first = client
        .acquire(pb::AcquireRequest {
            name: "w5/after-restart".into(),
            ttl_ms: Some(60_000),
            limit: 1,
            ..Default::default()
        })
        .await?
        .into_inner()
        .fence;
    drop(server);
    Ok(RecoveryOutcome {
        locks: spec.locks as u64,
        fill_per_s: spec.locks as f64 / fill_s,
        rss_before_mib: rss_before,
        data_mib,
        ready_s,
        max_fence_before: max_fence,
        first_fence_after: first,
        lost_or_changed,
        fence_decreases: u64::from(first <= max_fence),
    })
}

/// What the server-side FIFO audit saw.
#[derive(Debug, Clone, Default)]
pub struct FifoAudit {
    /// Grants seen on the event stream.
    pub grants: u64,
    /// Grants to a queued request while an earlier-queued one was still waiting.
    pub inversions: u64,
    /// The stream ended early (e.g. the watcher fell behind): the audit is partial.
    pub incomplete: bool,
}

/// Audits FIFO order on the server's own event stream (`Watch`), for every lock whose
/// name starts with `prefix`: `QUEUED` events give the arrival order at the server,
/// `GRANTED` and `WAIT_ENDED` remove requests; a grant to any but the oldest queued
/// request of its lock is an inversion. Unlike the checker's client-side stamps, this
/// cannot be fooled by a client that was descheduled between stamping and sending.
/// Requests are told apart by their owner text, so each client must use its own.
/// Stops when `stop` is notified.
pub async fn fifo_audit(
    url: String,
    prefix: String,
    stop: Arc<tokio::sync::Notify>,
) -> anyhow::Result<tokio::task::JoinHandle<FifoAudit>> {
    let mut client = channels(&url, 1).await?.remove(0);
    let mut events = client
        .watch(pb::WatchRequest {
            prefix,
            after: None,
        })
        .await?
        .into_inner();
    Ok(tokio::spawn(async move {
        let mut book = FifoBook::default();
        let stopped = stop.notified();
        tokio::pin!(stopped);
        loop {
            let event = tokio::select! {
                _ = &mut stopped => return book.audit,
                e = events.message() => e,
            };
            let Ok(Some(event)) = event else {
                book.audit.incomplete = true;
                return book.audit;
            };
            if let Ok(kind) = EventKind::try_from(event.kind) {
                book.observe(kind, event.name, event.owner);
            }
        }
    }))
}

/// The queues as the server's events describe them (see [`fifo_audit`]).
#[derive(Debug, Default)]
pub struct FifoBook {
    queues: std::collections::HashMap<String, Vec<String>>,
    /// What has been counted.
    pub audit: FifoAudit,
}

impl FifoBook {
    /// Takes one event of lock `name` for the request of `owner`.
    pub fn observe(&mut self, kind: EventKind, name: String, owner: String) {
        let queue = self.queues.entry(name).or_default();
        match kind {
            EventKind::Queued => queue.push(owner),
            EventKind::Granted => {
                self.audit.grants += 1;
                if let Some(at) = queue.iter().position(|o| *o == owner) {
                    self.audit.inversions += u64::from(at > 0);
                    queue.remove(at);
                }
            }
            EventKind::WaitEnded => queue.retain(|o| *o != owner),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(events: &[(EventKind, &str, &str)]) -> FifoAudit {
        let mut book = FifoBook::default();
        for (kind, name, owner) in events {
            book.observe(*kind, name.to_string(), owner.to_string());
        }
        book.audit
    }

    #[test]
    fn fifo_hand_offs_are_not_inversions() {
        use EventKind::*;
        let a = run(&[
            (Granted, "k", "a"),
            (Queued, "k", "b"),
            (Queued, "k", "c"),
            (Released, "k", "a"),
            (Granted, "k", "b"),
            (Queued, "k", "a"),
            (Granted, "k", "c"),
            (Granted, "k", "a"),
        ]);
        assert_eq!((a.grants, a.inversions), (4, 0));
    }

    #[test]
    fn catches_a_planted_overtake() {
        use EventKind::*;
        let a = run(&[
            (Granted, "k", "a"),
            (Queued, "k", "b"),
            (Queued, "other", "x"),
            (Queued, "k", "c"),
            // c is granted while b, queued earlier on the same lock, still waits.
            (Granted, "k", "c"),
            (Granted, "other", "x"),
            // b gave up: no longer ahead of anyone.
            (WaitEnded, "k", "b"),
            (Queued, "k", "d"),
            (Granted, "k", "d"),
        ]);
        assert_eq!((a.grants, a.inversions), (4, 1));
    }
}
