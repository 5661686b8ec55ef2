//! W6 read-mostly: N clients on one key, each operation shared with probability
//! `shared_percent` % and exclusive otherwise (a seeded generator per client, so the
//! sequence of modes is the same in every run), acquire → release in a closed loop,
//! with a warm-up and a bounded measured window like W1–W3. Every grant and release
//! goes through the [`RwChecker`].
//!
//! All three stores are driven the same way: a `fencelock::Client` per client over the
//! store's `LockBackend` (the fencelock server's own, `fencelock-etcd`'s reader-writer
//! recipe, `fencelock-zookeeper`'s Curator recipe), so each holds its grant under a
//! `LockGuard` with the same renewal task, and only the store differs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use fencelock::{Client, LockMode};

use crate::checker::{Mode, RwChecker, Summary};
use crate::targets::{MAX_WAIT, TTL};
use crate::workload::Percentiles;

/// The store a W6 (or election) client talks to.
#[derive(Debug, Clone)]
pub enum Store {
    /// A fencelock server at this URL (the client library's default transport).
    Fencelock(String),
    /// An etcd member at this URL, through `fencelock-etcd`.
    Etcd(String),
    /// A ZooKeeper server on this loopback port, through `fencelock-zookeeper`.
    ZooKeeper(u16),
}

impl Store {
    /// A client with a connection (or session) of its own.
    pub async fn client(&self) -> anyhow::Result<Client> {
        Ok(match self {
            Store::Fencelock(url) => Client::connect(url).await?,
            Store::Etcd(url) => Client::new(
                fencelock_etcd::EtcdBackend::connect(fencelock_etcd::EtcdConfig::new(url.clone()))
                    .await?,
            ),
            Store::ZooKeeper(port) => Client::new(fencelock_zookeeper::ZooKeeperBackend::new(
                fencelock_zookeeper::ZooKeeperConfig::new(&format!("127.0.0.1:{port}")),
            )?),
        })
    }

    /// `fencelock`, `etcd` or `zookeeper`: the store's kind and its endpoint, as the
    /// `candidate` subcommand takes them.
    pub fn kind_and_endpoint(&self) -> (&'static str, String) {
        match self {
            Store::Fencelock(url) => ("fencelock", url.clone()),
            Store::Etcd(url) => ("etcd", url.clone()),
            Store::ZooKeeper(port) => ("zookeeper", port.to_string()),
        }
    }

    /// The inverse of [`kind_and_endpoint`](Store::kind_and_endpoint).
    pub fn parse(kind: &str, endpoint: &str) -> anyhow::Result<Store> {
        Ok(match kind {
            "fencelock" => Store::Fencelock(endpoint.to_owned()),
            "etcd" => Store::Etcd(endpoint.to_owned()),
            "zookeeper" => Store::ZooKeeper(endpoint.parse().context("zookeeper port")?),
            other => anyhow::bail!("unknown store {other:?} (fencelock, etcd, zookeeper)"),
        })
    }
}

/// One W6 run's shape.
#[derive(Debug, Clone)]
pub struct RwSpec {
    /// Client tasks, each with its own connection.
    pub clients: usize,
    /// Share of shared (reader) operations, in percent (95 for W6).
    pub shared_percent: u64,
    /// Seeds the clients' generators (client `i` uses `seed` mixed with `i`).
    pub seed: u64,
    /// Not measured (but checked).
    pub warmup: Duration,
    /// Measured.
    pub measure: Duration,
    /// The one key, unique per run.
    pub key: String,
}

/// The figures of one mode.
#[derive(Debug, Clone, Default)]
pub struct ModeOutcome {
    /// Grants (acquire + release completed) in the measured window.
    pub grants: u64,
    /// Acquire + release latency.
    pub pair: Percentiles,
    /// Acquire latency (the wait).
    pub wait: Percentiles,
}

/// What one W6 run measured.
#[derive(Debug, Clone, Default)]
pub struct RwOutcome {
    /// Shared operations.
    pub shared: ModeOutcome,
    /// Exclusive operations.
    pub exclusive: ModeOutcome,
    /// The measured window.
    pub seconds: f64,
    /// Failed acquires or releases (all windows).
    pub errors: u64,
    /// The first error, if any.
    pub first_error: Option<String>,
    /// The reader-writer checker's counts.
    pub checked: Summary,
}

/// A per-client generator of modes: splitmix64, seeded from the run's seed and the
/// client number, so a run's mix of modes is reproducible.
#[derive(Debug, Clone)]
pub struct ModeMix {
    state: u64,
    shared_percent: u64,
}

impl ModeMix {
    /// The generator of client `client` in a run seeded `seed`.
    pub fn new(seed: u64, client: usize, shared_percent: u64) -> ModeMix {
        ModeMix {
            state: seed ^ (client as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
            shared_percent,
        }
    }

    /// The next operation's mode.
    pub fn next_mode(&mut self) -> Mode {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        if z % 100 < self.shared_percent {
            Mode::Shared
        } else {
            Mode::Exclusive
        }
    }
}

#[derive(Default)]
struct Samples {
    grants: u64,
    pair_us: Vec<u32>,
    wait_us: Vec<u32>,
}

impl Samples {
    fn outcome(self) -> ModeOutcome {
        ModeOutcome {
            grants: self.grants,
            pair: Percentiles::of(self.pair_us),
            wait: Percentiles::of(self.wait_us),
        }
    }
}

fn micros(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX)
}

/// Runs W6 against `store`.
pub async fn run(store: &Store, spec: &RwSpec) -> anyhow::Result<RwOutcome> {
    let mut clients = Vec::with_capacity(spec.clients);
    for client in 0..spec.clients {
        clients.push(
            store
                .client()
                .await
                .with_context(|| format!("connect client {client}"))?,
        );
    }
    let checker = Arc::new(RwChecker::new());
    let start = Instant::now() + Duration::from_millis(20);
    let measure_from = start + spec.warmup;
    let end = measure_from + spec.measure;
    let mut tasks = Vec::new();
    for (n, client) in clients.into_iter().enumerate() {
        let checker = checker.clone();
        let key = spec.key.clone();
        let mut mix = ModeMix::new(spec.seed, n, spec.shared_percent);
        tasks.push(tokio::spawn(async move {
            let mut samples = [Samples::default(), Samples::default()];
            let (mut errors, mut first_error) = (0u64, None::<String>);
            tokio::time::sleep_until(start.into()).await;
            loop {
                let t0 = Instant::now();
                if t0 >= end {
                    break;
                }
                let mode = mix.next_mode();
                let lock_mode = match mode {
                    Mode::Shared => LockMode::Shared,
                    Mode::Exclusive => LockMode::Exclusive,
                };
                checker.waiting(&key, n);
                let request = client.lock(&key).ttl(TTL).wait(MAX_WAIT).mode(lock_mode);
                let acquired = tokio::select! {
                    a = request.acquire() => Some(a),
                    _ = tokio::time::sleep_until(end.into()) => None,
                };
                let guard = match acquired {
                    None => {
                        checker.gave_up(&key, n);
                        break;
                    }
                    Some(Err(e)) => {
                        checker.gave_up(&key, n);
                        errors += 1;
                        first_error.get_or_insert_with(|| format!("acquire {mode:?}: {e}"));
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                    Some(Ok(guard)) => guard,
                };
                let t1 = Instant::now();
                checker.granted(&key, n, mode, Some(guard.fence()));
                checker.releasing(&key, n);
                if let Err(e) = guard.release().await {
                    errors += 1;
                    first_error.get_or_insert_with(|| format!("release {mode:?}: {e}"));
                }
                let t2 = Instant::now();
                if t0 >= measure_from && t2 <= end {
                    let s = &mut samples[usize::from(mode == Mode::Exclusive)];
                    s.grants += 1;
                    s.pair_us.push(micros(t2 - t0));
                    s.wait_us.push(micros(t1 - t0));
                }
            }
            (samples, errors, first_error, client)
        }));
    }
    let mut outcome = RwOutcome {
        seconds: spec.measure.as_secs_f64(),
        ..RwOutcome::default()
    };
    let mut all = [Samples::default(), Samples::default()];
    let mut clients = Vec::new();
    for task in tasks {
        let (samples, errors, first_error, client) = task.await?;
        for (into, from) in all.iter_mut().zip(samples) {
            into.grants += from.grants;
            into.pair_us.extend(from.pair_us);
            into.wait_us.extend(from.wait_us);
        }
        outcome.errors += errors;
        if outcome.first_error.is_none() {
            outcome.first_error = first_error;
        }
        clients.push(client);
    }
    drop(clients);
    let [shared, exclusive] = all;
    outcome.shared = shared.outcome();
    outcome.exclusive = exclusive.outcome();
    outcome.checked = checker.summary();
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mix_is_reproducible_and_near_the_asked_share() {
        let modes = |seed, client| {
            let mut mix = ModeMix::new(seed, client, 95);
            (0..10_000).map(|_| mix.next_mode()).collect::<Vec<_>>()
        };
        assert_eq!(modes(7, 3), modes(7, 3));
        assert_ne!(modes(7, 3), modes(7, 4));
        let shared = modes(7, 3).iter().filter(|&&m| m == Mode::Shared).count();
        assert!(
            (9_300..=9_700).contains(&shared),
            "{shared} of 10000 shared"
        );
    }
}
