//! A chaos worker: a process that loops acquire → hold → fenced write → release,
//! recording every operation in its history file.
//!
//! The worker deliberately does **not** look at [`LockGuard::lost`] before it writes,
//! as if its pause struck between checking and writing: the fence is the only thing
//! that protects the resource. Renewals are the guard's own (every ttl/3); they are
//! recorded by wrapping the client's backend ([`RecordingBackend`]), so the history
//! holds exactly the calls the client library made.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use fencelock::{
    AcquireSpec, BoxFuture, Capabilities, Client, Error, ErrorKind, FencelockBackend, Lease,
    LockBackend, LockGuard, ServerConfig,
};
use fencelock_fence::FileGate;
use serde::{Deserialize, Serialize};

use crate::history::{HistoryWriter, OpKind, Outcome};
use crate::leader::LeaderBackend;

/// What one worker does. Passed as JSON in [`WORKER_ENV`](crate::WORKER_ENV).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerConfig {
    /// The worker's number; its owner string on the server is `w<id>`.
    pub id: u32,
    /// The server, e.g. `http://127.0.0.1:7420`.
    pub url: String,
    /// Cluster mode: every member's URL. When non-empty the worker talks to the
    /// leader among them ([`LeaderBackend`]) and `url` is ignored.
    #[serde(default)]
    pub urls: Vec<String>,
    /// Skip the write when the guard reports the lock lost (a renewal could not
    /// reach a leader before the lease's conservative deadline). False: write anyway,
    /// as if a pause struck between that check and the write.
    #[serde(default)]
    pub stop_when_lost: bool,
    /// The locks to pick from (at random); each protects the resource file
    /// [`resource_name`]`(lock)` in `resource_dir`.
    pub locks: Vec<String>,
    /// The directory of the resource files (shared by all workers).
    pub resource_dir: PathBuf,
    /// The history file (appended to).
    pub history: PathBuf,
    /// The worker finishes its current round and exits once this file exists.
    pub stop_file: PathBuf,
    /// Lease length asked for.
    pub ttl_ms: u64,
    /// How long one acquire may wait.
    pub wait_ms: u64,
    /// Longest hold before the write (each hold is random in 0..=hold_ms).
    pub hold_ms: u64,
    /// Write through the [`FileGate`] (true), or write the file directly without any
    /// fence check (false: the planted bug).
    pub fenced: bool,
    /// Seed of the worker's choices.
    pub seed: u64,
}

/// The resource file that `lock` protects.
pub fn resource_name(lock: &str) -> String {
    lock.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect()
}

/// The fence in a resource file's content (the workers write `fence=<n> …`).
pub fn written_fence(content: &str) -> Option<u64> {
    content
        .split_whitespace()
        .find_map(|word| word.strip_prefix("fence="))
        .and_then(|n| n.parse().ok())
}

/// Runs a worker until its stop file appears. Returns the process exit code.
pub fn main(config_json: &str) -> i32 {
    let config: WorkerConfig = match serde_json::from_str(config_json) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("chaos worker: bad configuration: {e}");
            return 2;
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("start the tokio runtime");
    match runtime.block_on(run(config)) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("chaos worker: {e}");
            1
        }
    }
}

/// A small deterministic generator (xorshift64*) for the worker's choices.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed` (any value).
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15 | 1)
    }

    /// The next value.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A value in `0..=max`.
    pub fn below_or_eq(&mut self, max: u64) -> u64 {
        self.next_u64() % (max + 1)
    }
}

async fn run(config: WorkerConfig) -> Result<(), String> {
    if config.locks.is_empty() {
        return Err("no locks to work on".into());
    }
    let history = Arc::new(
        HistoryWriter::open(&config.history, config.id)
            .map_err(|e| format!("open {}: {e}", config.history.display()))?,
    );
    let client = if config.urls.is_empty() {
        let mut server = ServerConfig::new(config.url.clone());
        server.connect_timeout = Duration::from_secs(1);
        server.request_timeout = Duration::from_secs(5);
        let inner = FencelockBackend::connect_lazy(server).map_err(|e| e.to_string())?;
        Client::new(RecordingBackend::new(inner, history.clone()))
    } else {
        let inner = LeaderBackend::new(&config.urls)?;
        Client::new(RecordingBackend::new(inner, history.clone()))
    };
    let gate = FileGate::new(&config.resource_dir).map_err(|e| e.to_string())?;
    let mut rng = Rng::new(config.seed);
    let ttl = Duration::from_millis(config.ttl_ms);
    let wait = Duration::from_millis(config.wait_ms);
    // Bounded by the stop file, which the run always creates (and then, after a grace
    // period, the run kills the process).
    while !config.stop_file.exists() {
        let lock = &config.locks[rng.below_or_eq(config.locks.len() as u64 - 1) as usize];
        let guard = match client
            .lock(lock.clone())
            .ttl(ttl)
            .wait(wait)
            .owner(format!("w{}", config.id))
            .acquire()
            .await
        {
            Ok(guard) => guard,
            Err(_) => {
                // Recorded by the backend; the server may be restarting.
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        tokio::time::sleep(Duration::from_millis(rng.below_or_eq(config.hold_ms))).await;
        if !(config.stop_when_lost && guard.is_lost()) {
            write(&history, &gate, &config, &guard).await;
        }
        // Recorded by the backend; a failure leaves the lease to expire.
        let _ = guard.release().await;
    }
    Ok(())
}

/// One write of `fence=<fence> worker=<id>` to the lock's resource, recorded.
async fn write(history: &HistoryWriter, gate: &FileGate, config: &WorkerConfig, guard: &LockGuard) {
    let lock = guard.name().to_owned();
    let fence = guard.fence();
    let token = guard.owner_token().to_owned();
    let op = history.invoke(OpKind::Write, &lock, |e| {
        e.fence = Some(fence);
        e.token = Some(token.clone());
    });
    let name = resource_name(&lock);
    let data = format!("fence={fence} worker={}\n", config.id);
    let gate = gate.clone();
    let dir = config.resource_dir.clone();
    let fenced = config.fenced;
    let result = tokio::task::spawn_blocking(move || {
        if fenced {
            gate.write(&name, fence, data.as_bytes())
                .map(|()| Outcome::Accepted)
                .or_else(|e| {
                    if e.is_stale() {
                        Ok(Outcome::Refused)
                    } else {
                        Err(e.to_string())
                    }
                })
        } else {
            unfenced_write(&dir.join(&name), data.as_bytes()).map(|()| Outcome::Accepted)
        }
    })
    .await
    .unwrap_or_else(|e| Err(format!("write task: {e}")));
    match result {
        Ok(outcome) => history.complete(op, OpKind::Write, &lock, outcome, |_| {}),
        Err(detail) => history.complete(op, OpKind::Write, &lock, Outcome::Failed, |e| {
            e.detail = Some(detail)
        }),
    }
}

/// The planted bug: replace the file without looking at any fence.
fn unfenced_write(path: &Path, data: &[u8]) -> Result<(), String> {
    let tmp = path.with_extension("unfenced-tmp");
    std::fs::write(&tmp, data).map_err(|e| e.to_string())?;
    std::fs::rename(&tmp, path).map_err(|e| e.to_string())
}

/// A [`LockBackend`] that records every call it passes on to the real one (a
/// server, or a cluster's leader through [`LeaderBackend`]: then one recorded
/// operation spans the retries the routing made, invoked before the first and
/// completed after the last).
#[derive(Debug)]
pub struct RecordingBackend<B = FencelockBackend> {
    inner: B,
    history: Arc<HistoryWriter>,
}

impl<B: LockBackend> RecordingBackend<B> {
    /// Wraps `inner`, recording into `history`.
    pub fn new(inner: B, history: Arc<HistoryWriter>) -> RecordingBackend<B> {
        RecordingBackend { inner, history }
    }
}

fn failed(e: &Error) -> (Outcome, Option<String>) {
    if e.kind() == ErrorKind::NotHeld {
        (Outcome::NotHeld, None)
    } else {
        (
            Outcome::Failed,
            Some(format!("{}: {}", e.kind().as_str(), e.message())),
        )
    }
}

impl<B: LockBackend> LockBackend for RecordingBackend<B> {
    fn capabilities(&self) -> Capabilities {
        let mut capabilities = self.inner.capabilities();
        // Only acquires, renewals and releases pass through: claim nothing else.
        capabilities.downgrade = false;
        capabilities.elections = false;
        capabilities.multi = false;
        capabilities
    }

    fn acquire<'a>(&'a self, spec: &'a AcquireSpec) -> BoxFuture<'a, Result<Lease, Error>> {
        Box::pin(async move {
            let op = self.history.invoke(OpKind::Acquire, &spec.name, |e| {
                e.request_id = Some(spec.request_id.clone());
                e.ttl_ms = Some(spec.ttl.as_millis() as u64);
            });
            let result = self.inner.acquire(spec).await;
            match &result {
                Ok(lease) => {
                    self.history
                        .complete(op, OpKind::Acquire, &spec.name, Outcome::Ok, |e| {
                            e.fence = Some(lease.fence);
                            e.token = Some(lease.owner_token.clone());
                            e.ttl_ms = Some(lease.ttl.as_millis() as u64);
                        })
                }
                Err(err) => {
                    let (outcome, detail) = failed(err);
                    self.history
                        .complete(op, OpKind::Acquire, &spec.name, outcome, |e| {
                            e.detail = detail
                        });
                }
            }
            result
        })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Duration, Error>> {
        Box::pin(async move {
            let op = self.history.invoke(OpKind::Renew, &lease.name, |e| {
                e.fence = Some(lease.fence);
                e.token = Some(lease.owner_token.clone());
                e.ttl_ms = Some(ttl.as_millis() as u64);
            });
            let result = self.inner.renew(lease, ttl).await;
            match &result {
                Ok(granted) => {
                    self.history
                        .complete(op, OpKind::Renew, &lease.name, Outcome::Ok, |e| {
                            e.ttl_ms = Some(granted.as_millis() as u64);
                        })
                }
                Err(err) => {
                    let (outcome, detail) = failed(err);
                    self.history
                        .complete(op, OpKind::Renew, &lease.name, outcome, |e| {
                            e.detail = detail
                        });
                }
            }
            result
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            let op = self.history.invoke(OpKind::Release, &lease.name, |e| {
                e.fence = Some(lease.fence);
                e.token = Some(lease.owner_token.clone());
            });
            let result = self.inner.release(lease).await;
            let (outcome, detail) = match &result {
                Ok(true) => (Outcome::Ok, None),
                Ok(false) => (Outcome::NotHeld, None),
                Err(err) => failed(err),
            };
            self.history
                .complete(op, OpKind::Release, &lease.name, outcome, |e| {
                    e.detail = detail
                });
            result
        })
    }
}
