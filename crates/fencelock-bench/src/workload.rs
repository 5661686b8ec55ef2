//! W1–W3: closed loops of N clients, each acquiring and releasing as fast as it can,
//! with a warm-up and a bounded measured window. Every grant and release goes through
//! the [`Checker`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::checker::{Checker, Summary};
use crate::targets::Locker;

/// Which keys the clients use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keys {
    /// Each client its own key (W1, W2).
    Distinct,
    /// All clients one key (W3).
    Shared,
}

/// One run's shape.
#[derive(Debug, Clone)]
pub struct Spec {
    /// Client tasks, each with its own connection.
    pub clients: usize,
    /// Which keys they use.
    pub keys: Keys,
    /// Not measured (but checked).
    pub warmup: Duration,
    /// Measured.
    pub measure: Duration,
    /// Prefix of every key, unique per run (so runs never see each other's state).
    pub key_prefix: String,
}

/// Latency percentiles in microseconds.
#[derive(Debug, Clone, Copy, Default)]
pub struct Percentiles {
    /// Median.
    pub p50_us: u64,
    /// 99th percentile.
    pub p99_us: u64,
    /// 99.9th percentile.
    pub p999_us: u64,
    /// Largest.
    pub max_us: u64,
}

impl Percentiles {
    /// From unsorted samples.
    pub fn of(mut samples: Vec<u32>) -> Percentiles {
        if samples.is_empty() {
            return Percentiles::default();
        }
        samples.sort_unstable();
        let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize] as u64;
        Percentiles {
            p50_us: at(0.5),
            p99_us: at(0.99),
            p999_us: at(0.999),
            max_us: at(1.0),
        }
    }
}

/// What one run measured.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// Acquire+release pairs completed in the measured window.
    pub pairs: u64,
    /// The measured window.
    pub seconds: f64,
    /// Acquire+release latency.
    pub pair: Percentiles,
    /// Acquire latency (the wait, under contention).
    pub wait: Percentiles,
    /// Failed acquires or releases (all windows).
    pub errors: u64,
    /// The first error, if any.
    pub first_error: Option<String>,
    /// The checker's counts.
    pub checked: Summary,
}

struct ClientResult {
    pairs: u64,
    pair_us: Vec<u32>,
    wait_us: Vec<u32>,
    errors: u64,
    first_error: Option<String>,
}

fn micros(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX)
}

/// Runs `spec` against target `L`.
pub async fn run<L: Locker>(config: Arc<L::Config>, spec: &Spec) -> anyhow::Result<Outcome> {
    let mut lockers = Vec::with_capacity(spec.clients);
    for client in 0..spec.clients {
        lockers.push(
            L::connect(&config, client)
                .await
                .with_context(|| format!("connect client {client}"))?,
        );
    }
    let checker = Arc::new(Checker::new());
    let start = Instant::now() + Duration::from_millis(20);
    let measure_from = start + spec.warmup;
    let end = measure_from + spec.measure;
    let mut tasks = Vec::new();
    for (client, mut locker) in lockers.into_iter().enumerate() {
        let key = match spec.keys {
            Keys::Distinct => format!("{}{client}", spec.key_prefix),
            Keys::Shared => format!("{}shared", spec.key_prefix),
        };
        let checker = checker.clone();
        tasks.push(tokio::spawn(async move {
            let mut r = ClientResult {
                pairs: 0,
                pair_us: Vec::new(),
                wait_us: Vec::new(),
                errors: 0,
                first_error: None,
            };
            tokio::time::sleep_until(start.into()).await;
            loop {
                let t0 = Instant::now();
                if t0 >= end {
                    break;
                }
                checker.waiting(&key, client, t0);
                let acquired = tokio::select! {
                    a = locker.acquire(&key) => Some(a),
                    _ = tokio::time::sleep_until(end.into()) => None,
                };
                let grant = match acquired {
                    None => {
                        checker.gave_up(&key, client, t0);
                        break;
                    }
                    Some(Err(e)) => {
                        checker.gave_up(&key, client, t0);
                        r.errors += 1;
                        r.first_error
                            .get_or_insert_with(|| format!("acquire: {e:#}"));
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                    Some(Ok(grant)) => grant,
                };
                let t1 = Instant::now();
                let measured = t0 >= measure_from && t1 < end;
                checker.granted(&key, client, t0, grant.fence, measured);
                checker.releasing(&key, client);
                if let Err(e) = locker.release().await {
                    r.errors += 1;
                    r.first_error
                        .get_or_insert_with(|| format!("release: {e:#}"));
                }
                let t2 = Instant::now();
                if measured && t2 <= end {
                    r.pairs += 1;
                    r.pair_us.push(micros(t2 - t0));
                    r.wait_us.push(micros(t1 - t0));
                }
            }
            (r, locker)
        }));
    }
    let mut outcome = Outcome {
        seconds: spec.measure.as_secs_f64(),
        ..Outcome::default()
    };
    let (mut pair_us, mut wait_us) = (Vec::new(), Vec::new());
    let mut lockers = Vec::new();
    for task in tasks {
        let (r, locker) = task.await?;
        outcome.pairs += r.pairs;
        outcome.errors += r.errors;
        if outcome.first_error.is_none() {
            outcome.first_error = r.first_error;
        }
        pair_us.extend(r.pair_us);
        wait_us.extend(r.wait_us);
        lockers.push(locker);
    }
    drop(lockers);
    outcome.pair = Percentiles::of(pair_us);
    outcome.wait = Percentiles::of(wait_us);
    outcome.checked = checker.summary();
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_one_to_a_thousand() {
        let p = Percentiles::of((1..=1000).rev().collect());
        assert_eq!(
            (p.p50_us, p.p99_us, p.p999_us, p.max_us),
            (501, 990, 999, 1000)
        );
        assert_eq!(Percentiles::of(Vec::new()).max_us, 0);
    }
}
