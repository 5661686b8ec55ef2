//! One chaos run: the real server, worker processes, faults, and the verdict.
//!
//! A run is `rounds` rounds of: let the workers run a moment; `SIGSTOP` a worker that
//! holds a lock until its lease has run out and another worker has written the
//! resource with a newer fence (or a bound passed), then `SIGCONT` it; let them run;
//! `kill -9` the server and start it again on the same data directory and port. Then
//! the workers are stopped, their histories checked ([`crate::checker`]), and the
//! recovery time of each restart (kill to the first acquire that succeeded after it)
//! measured from the histories.

use std::ffi::OsString;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::checker::{self, Report};
use crate::history::{self, OpKind, Outcome, Phase};
use crate::http::get_json;
use crate::worker::{self, Rng, WorkerConfig};
use crate::{monotonic_ns, WORKER_ENV};

/// How long the server may take to become ready after a (re)start.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long after a restart some worker must have acquired a lock.
const RECOVERY_BOUND: Duration = Duration::from_secs(60);
/// How long a `SIGSTOP` may last while waiting for another worker to write.
const STOP_BOUND: Duration = Duration::from_secs(20);
/// How long to look for a worker that holds a lock before giving up on one `SIGSTOP`.
const HOLDER_SEARCH: Duration = Duration::from_secs(10);

/// What to run.
#[derive(Debug, Clone)]
pub struct ChaosConfig {
    /// The `fencelock` binary.
    pub server_bin: PathBuf,
    /// The program that becomes a worker when [`WORKER_ENV`] is set.
    pub worker_program: PathBuf,
    /// Its arguments.
    pub worker_args: Vec<OsString>,
    /// Worker processes.
    pub workers: u32,
    /// Locks (each protecting its own resource file).
    pub locks: u32,
    /// Fault rounds: one `SIGSTOP` and one `kill -9` of the server each.
    pub rounds: u32,
    /// Lease length the workers ask for.
    pub ttl_ms: u64,
    /// False plants the bug: the workers write without the fence check.
    pub fenced: bool,
    /// Seed of every random choice of the run and its workers.
    pub seed: u64,
}

impl ChaosConfig {
    /// A short run's defaults: 4 workers on 2 locks, 800 ms leases.
    pub fn new(
        server_bin: PathBuf,
        worker_program: PathBuf,
        rounds: u32,
        seed: u64,
    ) -> ChaosConfig {
        ChaosConfig {
            server_bin,
            worker_program,
            worker_args: Vec::new(),
            workers: 4,
            locks: 2,
            rounds,
            ttl_ms: 800,
            fenced: true,
            seed,
        }
    }
}

/// The outcome of a run.
#[derive(Debug)]
pub struct Summary {
    /// The seed (rerun with it to repeat the run's choices).
    pub seed: u64,
    /// Whether the resource checked fences.
    pub fenced: bool,
    /// Rounds run.
    pub rounds: u32,
    /// `SIGSTOP`s sent to lock holders.
    pub sigstops: u32,
    /// Of those, how many lasted until another worker had written with a newer fence.
    pub takeovers: u32,
    /// Stops that caught the worker inside a `FileGate` write: it holds the file's
    /// `flock`, so no other writer of that file gets through until it resumes, and the
    /// stop is ended early (after two lease lengths).
    pub stops_inside_write: u32,
    /// `kill -9` + restart of the server.
    pub restarts: u32,
    /// For each restart, kill → the restarted server answers `/readyz` with 200.
    pub ready_after: Vec<Duration>,
    /// Workers that had to be killed at the end (did not stop in time).
    pub workers_killed: u32,
    /// The checker's verdict.
    pub report: Report,
    /// For each restart, kill → first successful acquire after it.
    pub recoveries: Vec<Duration>,
    /// The server's largest resident set seen (bytes), read from `/proc`.
    pub max_server_rss_bytes: u64,
    /// Wall time of the run.
    pub elapsed: Duration,
    /// The run's directory, kept when a fenced run found violations.
    pub kept_dir: Option<PathBuf>,
}

impl Summary {
    /// The `p`-th percentile (0..=100, nearest rank) of the recovery times.
    pub fn recovery_percentile(&self, p: u32) -> Option<Duration> {
        percentile(&self.recoveries, p)
    }
}

/// The `p`-th percentile (nearest rank) of `values`.
pub fn percentile(values: &[Duration], p: u32) -> Option<Duration> {
    if values.is_empty() {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort();
    let rank = (u64::from(p.min(100)) * sorted.len() as u64)
        .div_ceil(100)
        .max(1);
    Some(sorted[rank as usize - 1])
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = |d: Option<Duration>| d.map_or("-".to_owned(), |d| format!("{}ms", d.as_millis()));
        let r = &self.report;
        write!(
            f,
            "chaos summary: fenced={} seed={} rounds={} operations={} indeterminate={} grants={} \
             writes_accepted={} writes_refused={} sigstops={} takeovers={} stops_inside_write={} \
             restarts={} violations={} ready_p50={} ready_p99={} recovery_p50={} recovery_p99={} \
             recovery_max={} server_max_rss={}MiB elapsed={:.1}s",
            self.fenced,
            self.seed,
            self.rounds,
            r.operations,
            r.indeterminate,
            r.grants,
            r.writes_accepted,
            r.writes_refused,
            self.sigstops,
            self.takeovers,
            self.stops_inside_write,
            self.restarts,
            r.violations.len(),
            ms(percentile(&self.ready_after, 50)),
            ms(percentile(&self.ready_after, 99)),
            ms(self.recovery_percentile(50)),
            ms(self.recovery_percentile(99)),
            ms(self.recovery_percentile(100)),
            self.max_server_rss_bytes >> 20,
            self.elapsed.as_secs_f64(),
        )
    }
}

/// The lock server child: same port and data directory across restarts.
struct ServerChild {
    bin: PathBuf,
    port: u16,
    data_dir: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

impl ServerChild {
    fn start(bin: &Path, dir: &Path) -> Result<ServerChild, String> {
        let data_dir = dir.join("data");
        std::fs::create_dir_all(&data_dir).map_err(|e| format!("create data dir: {e}"))?;
        let mut last = String::new();
        // Another process may take the free port before the server binds it.
        for _ in 0..5 {
            let port = fencelock_testkit::free_port().map_err(|e| e.to_string())?;
            let mut server = ServerChild {
                bin: bin.to_owned(),
                port,
                data_dir: data_dir.clone(),
                log: dir.join("server.log"),
                child: None,
            };
            match server.spawn_and_wait() {
                Ok(()) => return Ok(server),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    fn spawn(&mut self) -> Result<(), String> {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| format!("open server log: {e}"))?;
        let err = log.try_clone().map_err(|e| format!("server log: {e}"))?;
        let child = Command::new(&self.bin)
            .arg("serve")
            .arg("--listen")
            .arg(format!("127.0.0.1:{}", self.port))
            .arg("--data-dir")
            .arg(&self.data_dir)
            .arg("--log-format")
            .arg("json")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("start {}: {e}", self.bin.display()))?;
        self.child = Some(child);
        Ok(())
    }

    /// Starts the server and waits until `/readyz` answers 200.
    fn spawn_and_wait(&mut self) -> Result<(), String> {
        self.spawn()?;
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(answer) = fencelock_testkit::probe(
                self.port,
                b"GET /readyz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
                64,
            ) {
                if answer.starts_with(b"HTTP/1.1 200") {
                    return Ok(());
                }
            }
            let child = self.child.as_mut().expect("spawned");
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Err(format!(
                    "the server exited with {status} before it was ready on port {}; see {}",
                    self.port,
                    self.log.display()
                ));
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "the server was not ready on port {} within {READY_TIMEOUT:?}",
                    self.port
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// `kill -9`, reaped.
    fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Restarts on the same port; the port may linger for a moment after a kill.
    fn restart(&mut self) -> Result<(), String> {
        let mut last = String::new();
        for _ in 0..50 {
            match self.spawn_and_wait() {
                Ok(()) => return Ok(()),
                Err(e) => last = e,
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(last)
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal(child.id(), libc::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
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

impl Drop for ServerChild {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The worker children; killed on drop.
pub(crate) struct Workers {
    pub(crate) children: Vec<Child>,
}

impl Drop for Workers {
    fn drop(&mut self) {
        for child in &mut self.children {
            signal(child.id(), libc::SIGCONT);
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

pub(crate) fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: signalling a child of ours that has not been reaped (so its pid is
    // still its own).
    unsafe { libc::kill(pid as libc::pid_t, sig) };
}

/// Resident set size of a process, from `/proc/<pid>/status` (`VmRSS`), in bytes.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Runs one chaos run. Errors are failures of the harness (a process that would not
/// start), not violations: those are in the summary's report.
pub fn run(config: &ChaosConfig) -> Result<Summary, crate::ChaosError> {
    let started = Instant::now();
    let dir = tempfile::Builder::new()
        .prefix("fencelock-chaos-")
        .tempdir()
        .map_err(|e| format!("temp dir: {e}"))?;
    let resource_dir = dir.path().join("resource");
    let history_dir = dir.path().join("history");
    let stop_file = dir.path().join("stop");
    for d in [&resource_dir, &history_dir] {
        std::fs::create_dir_all(d).map_err(|e| format!("create {}: {e}", d.display()))?;
    }
    let mut rng = Rng::new(config.seed);
    let mut server = ServerChild::start(&config.server_bin, dir.path())?;
    let locks: Vec<String> = (0..config.locks).map(|i| format!("chaos:{i}")).collect();

    let mut workers = Workers {
        children: Vec::new(),
    };
    for id in 0..config.workers {
        let worker = WorkerConfig {
            id,
            url: format!("http://127.0.0.1:{}", server.port),
            urls: Vec::new(),
            stop_when_lost: false,
            locks: locks.clone(),
            resource_dir: resource_dir.clone(),
            history: history_dir.join(format!("w{id}.jsonl")),
            stop_file: stop_file.clone(),
            ttl_ms: config.ttl_ms,
            wait_ms: 2 * config.ttl_ms,
            hold_ms: config.ttl_ms / 2,
            fenced: config.fenced,
            seed: config.seed.wrapping_add(u64::from(id) + 1),
        };
        let log = dir.path().join(format!("w{id}.log"));
        workers.children.push(spawn_worker(
            &config.worker_program,
            &config.worker_args,
            &worker,
            &log,
        )?);
    }

    let mut summary = Summary {
        seed: config.seed,
        fenced: config.fenced,
        rounds: config.rounds,
        sigstops: 0,
        takeovers: 0,
        stops_inside_write: 0,
        restarts: 0,
        ready_after: Vec::new(),
        workers_killed: 0,
        report: Report::default(),
        recoveries: Vec::new(),
        max_server_rss_bytes: 0,
        elapsed: Duration::ZERO,
        kept_dir: None,
    };
    let mut kills_ns = Vec::new();
    let mut tails: Vec<Tail> = (0..config.workers)
        .map(|id| Tail::new(history_dir.join(format!("w{id}.jsonl"))))
        .collect();
    let pause = |rng: &mut Rng| Duration::from_millis(100 + rng.below_or_eq(300));
    std::thread::sleep(Duration::from_millis(500));
    for _ in 0..config.rounds {
        let stop = stop_a_holder(
            &mut rng,
            server.port,
            &workers,
            &locks,
            &resource_dir,
            &history_dir,
            config.ttl_ms,
        );
        if let Some(stop) = stop {
            summary.sigstops += 1;
            summary.takeovers += u32::from(stop == Stop::OvertakenBy);
            summary.stops_inside_write += u32::from(stop == Stop::InsideWrite);
        }
        std::thread::sleep(pause(&mut rng));
        if let Some(rss) = server.pid().and_then(rss_bytes) {
            summary.max_server_rss_bytes = summary.max_server_rss_bytes.max(rss);
        }
        let killed = Instant::now();
        kills_ns.push(monotonic_ns());
        server.kill9();
        server.restart()?;
        summary.ready_after.push(killed.elapsed());
        summary.restarts += 1;
        // Liveness: some worker must get a lock from the restarted server.
        let kill_ns = *kills_ns.last().expect("pushed above");
        let recovery_end = Instant::now() + RECOVERY_BOUND;
        while !tails.iter_mut().any(|t| t.acquired_after(kill_ns)) {
            if Instant::now() >= recovery_end {
                return Err(format!(
                    "no worker acquired a lock within {RECOVERY_BOUND:?} of restart {}; \
                     see {}",
                    summary.restarts,
                    dir.keep().display()
                )
                .into());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(pause(&mut rng));
    }

    summary.workers_killed = stop_workers(&mut workers, &stop_file, config.ttl_ms)?;
    if let Some(rss) = server.pid().and_then(rss_bytes) {
        summary.max_server_rss_bytes = summary.max_server_rss_bytes.max(rss);
    }
    server.stop();

    let events = history::read_dir(&history_dir)?;
    summary.report = checker::check(&events);
    summary.recoveries = recoveries(&events, &kills_ns);
    summary.elapsed = started.elapsed();
    if config.fenced && !summary.report.violations.is_empty() {
        summary.kept_dir = Some(dir.keep());
    }
    Ok(summary)
}

/// Starts one worker process: `program args…` with [`WORKER_ENV`] set to `worker`,
/// its stderr in `log`.
pub(crate) fn spawn_worker(
    program: &Path,
    args: &[OsString],
    worker: &WorkerConfig,
    log: &Path,
) -> Result<Child, String> {
    let log = File::create(log).map_err(|e| format!("worker log: {e}"))?;
    Command::new(program)
        .args(args)
        .env(
            WORKER_ENV,
            serde_json::to_string(worker).expect("serializable"),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| format!("start worker: {e}"))
}

/// Creates the stop file and waits for every worker to finish its round (bounded by
/// its wait and lease; resumed if stopped), killing those that do not. Returns how
/// many had to be killed.
pub(crate) fn stop_workers(
    workers: &mut Workers,
    stop_file: &Path,
    ttl_ms: u64,
) -> Result<u32, String> {
    File::create(stop_file).map_err(|e| format!("create the stop file: {e}"))?;
    let deadline = Instant::now() + Duration::from_millis(4 * ttl_ms) + Duration::from_secs(10);
    let mut killed = 0;
    for child in &mut workers.children {
        signal(child.id(), libc::SIGCONT);
        loop {
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
            if Instant::now() >= deadline {
                killed += 1;
                let _ = child.kill();
                let _ = child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    Ok(killed)
}

/// How one `SIGSTOP` ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    /// Another worker wrote the resource with a newer fence while it was stopped.
    OvertakenBy,
    /// It was stopped inside a write, holding the resource's `flock`.
    InsideWrite,
    /// Neither, within [`STOP_BOUND`].
    TimedOut,
}

/// Finds a worker that holds a lock, stops it until its lease is over and another
/// worker has written that lock's resource with a newer fence (bounded), and resumes
/// it. `None` if no holder was found.
pub(crate) fn stop_a_holder(
    rng: &mut Rng,
    port: u16,
    workers: &Workers,
    locks: &[String],
    resource_dir: &Path,
    history_dir: &Path,
    ttl_ms: u64,
) -> Option<Stop> {
    let search_end = Instant::now() + HOLDER_SEARCH;
    let (worker, fence, lock) = loop {
        let lock = &locks[rng.below_or_eq(locks.len() as u64 - 1) as usize];
        let found = get_json(port, &format!("/v1/locks/{lock}")).and_then(|(status, body)| {
            let holder = body.get("holders")?.as_array()?.first()?.clone();
            let owner = holder.get("owner")?.as_str()?;
            let id: usize = owner.strip_prefix('w')?.parse().ok()?;
            (status == 200).then_some((id, holder.get("fence")?.as_u64()?))
        });
        if let Some((id, fence)) = found {
            if id < workers.children.len() {
                break (id, fence, lock);
            }
        }
        if Instant::now() >= search_end {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let pid = workers.children[worker].id();
    signal(pid, libc::SIGSTOP);
    let stopped = Instant::now();
    let resource = resource_dir.join(worker::resource_name(lock));
    let history = history_dir.join(format!("w{worker}.jsonl"));
    let outcome = loop {
        let newer = std::fs::read_to_string(&resource)
            .ok()
            .and_then(|c| worker::written_fence(&c))
            .is_some_and(|f| f > fence);
        let elapsed = stopped.elapsed();
        if newer && elapsed >= Duration::from_millis(ttl_ms) {
            break Stop::OvertakenBy;
        }
        if elapsed >= Duration::from_millis(2 * ttl_ms) && inside_write(&history) {
            break Stop::InsideWrite;
        }
        if elapsed >= STOP_BOUND {
            break Stop::TimedOut;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    signal(pid, libc::SIGCONT);
    Some(outcome)
}

/// Follows a history file as it grows, remembering the latest successful acquire.
pub(crate) struct Tail {
    path: PathBuf,
    offset: u64,
    /// An unfinished last line, kept until its newline arrives.
    partial: Vec<u8>,
    last_acquired_ns: u64,
    /// Completion times of every successful acquire seen, in file order.
    acquired_ns: Vec<u64>,
}

impl Tail {
    pub(crate) fn new(path: PathBuf) -> Tail {
        Tail {
            path,
            offset: 0,
            partial: Vec::new(),
            last_acquired_ns: 0,
            acquired_ns: Vec::new(),
        }
    }

    /// Reads what was appended since the last call; true if the worker completed a
    /// successful acquire after `since_ns`.
    pub(crate) fn acquired_after(&mut self, since_ns: u64) -> bool {
        use std::io::{Seek, SeekFrom};
        let mut fresh = Vec::new();
        if let Ok(mut file) = File::open(&self.path) {
            if file.seek(SeekFrom::Start(self.offset)).is_ok() {
                let _ = file.read_to_end(&mut fresh);
            }
        }
        self.offset += fresh.len() as u64;
        self.partial.extend_from_slice(&fresh);
        let complete = self
            .partial
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(0, |i| i + 1);
        for line in self.partial[..complete].split(|&b| b == b'\n') {
            let Ok(e) = serde_json::from_slice::<history::Event>(line) else {
                continue;
            };
            if e.kind == OpKind::Acquire
                && e.phase == Phase::Complete
                && e.outcome == Some(Outcome::Ok)
            {
                self.last_acquired_ns = self.last_acquired_ns.max(e.time_ns);
                self.acquired_ns.push(e.time_ns);
            }
        }
        self.partial.drain(..complete);
        self.last_acquired_ns > since_ns
    }
}

impl Tail {
    /// The earliest successful acquire completed after `since_ns` among those read
    /// so far (`u64::MAX` if none).
    pub(crate) fn first_acquired_after(&self, since_ns: u64) -> u64 {
        self.acquired_ns
            .iter()
            .copied()
            .filter(|&t| t > since_ns)
            .min()
            .unwrap_or(u64::MAX)
    }
}

/// Whether a (stopped) worker's last event is the invoke of a write.
fn inside_write(history: &Path) -> bool {
    history::read_file(history)
        .ok()
        .and_then(|events| events.last().cloned())
        .is_some_and(|e| e.kind == OpKind::Write && e.phase == Phase::Invoke)
}

/// For each kill, the time until the first acquire that succeeded after it.
pub(crate) fn recoveries(events: &[history::Event], kills_ns: &[u64]) -> Vec<Duration> {
    let mut granted: Vec<u64> = events
        .iter()
        .filter(|e| {
            e.kind == OpKind::Acquire
                && e.phase == Phase::Complete
                && e.outcome == Some(Outcome::Ok)
        })
        .map(|e| e.time_ns)
        .collect();
    granted.sort_unstable();
    kills_ns
        .iter()
        .filter_map(|&kill| {
            let i = granted.partition_point(|&t| t <= kill);
            granted.get(i).map(|&t| Duration::from_nanos(t - kill))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let ms = |v: &[u64]| {
            v.iter()
                .map(|&m| Duration::from_millis(m))
                .collect::<Vec<_>>()
        };
        let values = ms(&[50, 10, 40, 20, 30]);
        assert_eq!(percentile(&values, 50), Some(Duration::from_millis(30)));
        assert_eq!(percentile(&values, 99), Some(Duration::from_millis(50)));
        assert_eq!(percentile(&values, 0), Some(Duration::from_millis(10)));
        assert_eq!(percentile(&[], 50), None);
    }

    #[test]
    fn recovery_is_kill_to_the_next_successful_acquire() {
        let mut events = Vec::new();
        for (op, (t, outcome)) in [
            (100, Outcome::Ok),
            (250, Outcome::Failed),
            (300, Outcome::Ok),
        ]
        .into_iter()
        .enumerate()
        {
            let mut e = history::Event::new(0, op as u64, OpKind::Acquire, Phase::Complete, t, "l");
            e.outcome = Some(outcome);
            events.push(e);
        }
        let r = recoveries(&events, &[200, 400]);
        assert_eq!(r, vec![Duration::from_nanos(100)]);
    }

    #[test]
    fn a_tail_sees_acquires_as_they_are_appended() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w0.jsonl");
        let mut tail = Tail::new(path.clone());
        assert!(!tail.acquired_after(0), "no file yet");
        let mut acquired = history::Event::new(0, 0, OpKind::Acquire, Phase::Complete, 500, "l");
        acquired.outcome = Some(Outcome::Ok);
        let line = serde_json::to_string(&acquired).unwrap() + "\n";
        let (first, rest) = line.split_at(10);
        std::fs::write(&path, first).unwrap();
        assert!(!tail.acquired_after(100), "half a line");
        let mut file = OpenOptions::new().append(true).open(&path).unwrap();
        file.write_all(rest.as_bytes()).unwrap();
        assert!(tail.acquired_after(100));
        assert!(
            !tail.acquired_after(500),
            "only acquires after the kill count"
        );
    }

    #[test]
    fn the_written_fence_is_read_back() {
        assert_eq!(worker::written_fence("fence=42 worker=3\n"), Some(42));
        assert_eq!(worker::written_fence("garbage"), None);
        assert_eq!(worker::resource_name("chaos:0"), "chaos-0");
    }
}
