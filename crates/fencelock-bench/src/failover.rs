//! The failover workload: under W2 load (clients on their own keys), `kill -9` the
//! cluster's leader and time how long until a client gets a grant on a key nobody
//! has used yet; restart the killed member, wait until the cluster is whole again,
//! and repeat.
//!
//! The probe is a fresh client per attempt (`L::connect`, then `acquire` on a new
//! key), a new attempt every 50 ms, overlapping, cycling through the members (a
//! client cannot know which one died): the time from the kill to the first grant any
//! new request gets, including the client's own discovery of the new leader
//! (fencelock) or of a live member (etcd, ZooKeeper). A new key, so that a lease of
//! a dead client cannot be what is timed.
//!
//! Bounded: `kills` rounds; each round's probe gives up after `probe_timeout`, the
//! restart after `heal_timeout`; every load operation has a timeout.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::checker::{Checker, Summary};
use crate::cluster::Cluster;
use crate::targets::Locker;

/// One failover run's shape.
#[derive(Debug, Clone)]
pub struct FailoverSpec {
    /// Leader kills (rounds).
    pub kills: usize,
    /// W2 load clients, each on its own key.
    pub load_clients: usize,
    /// Load before each kill, with the cluster healthy.
    pub settle: Duration,
    /// A new probe attempt starts this often (attempts overlap).
    pub attempt_every: Duration,
    /// One probe attempt (connect + acquire) is given up after this.
    pub attempt_timeout: Duration,
    /// A round whose probe has no grant after this counts as a timeout.
    pub probe_timeout: Duration,
    /// The restarted member and the cluster must be healthy within this.
    pub heal_timeout: Duration,
    /// Prefix of every key (unique per run).
    pub key_prefix: String,
}

/// One kill.
#[derive(Debug, Clone)]
pub struct Round {
    /// The killed leader (member number, from 1).
    pub leader: usize,
    /// From the kill to the probe's first grant; `None` if the probe timed out.
    pub grant_after: Option<Duration>,
    /// Probe attempts started, the successful one included.
    pub attempts: u64,
    /// The probe's first failure, if any (what a client saw meanwhile).
    pub first_error: Option<String>,
    /// From the restart to a healthy cluster.
    pub heal: Duration,
}

/// What the failover run measured.
#[derive(Debug, Clone, Default)]
pub struct FailoverOutcome {
    /// Every round.
    pub rounds: Vec<Round>,
    /// Load pairs completed over the whole run.
    pub load_pairs: u64,
    /// Load operations that failed or timed out (expected around each kill).
    pub load_errors: u64,
    /// The checker over the load and probe grants.
    pub checked: Summary,
    /// Seconds the run took.
    pub seconds: f64,
}

/// What the load clients share.
#[derive(Default)]
struct Load {
    checker: Checker,
    stop: AtomicBool,
    pairs: AtomicU64,
    errors: AtomicU64,
}

/// Keeps one load client going: acquire/release on its own key; after an error it
/// reconnects (to the next member) and moves to a fresh key, as the old one may be
/// held by its dead connection's lease until the lease runs out.
async fn load_client<L: Locker>(
    config: Arc<L::Config>,
    client: usize,
    prefix: String,
    op_timeout: Duration,
    shared: Arc<Load>,
) {
    let Load {
        checker,
        stop,
        pairs,
        errors,
    } = &*shared;
    let mut generation = 0usize;
    let mut locker: Option<L> = None;
    while !stop.load(Ordering::Relaxed) {
        let key = format!("{prefix}load-{client}-{generation}");
        let mut current = match locker.take() {
            Some(l) => l,
            None => {
                // Client number `client + 16 * generation`: a Spread client moves on
                // to another member after each failure.
                let id = client + 16 * generation;
                match tokio::time::timeout(op_timeout, L::connect(&config, id)).await {
                    Ok(Ok(l)) => l,
                    _ => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        generation += 1;
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                }
            }
        };
        let t0 = Instant::now();
        checker.waiting(&key, client, t0);
        let grant = match tokio::time::timeout(op_timeout, current.acquire(&key)).await {
            Ok(Ok(grant)) => grant,
            _ => {
                checker.gave_up(&key, client, t0);
                errors.fetch_add(1, Ordering::Relaxed);
                generation += 1;
                continue;
            }
        };
        checker.granted(&key, client, t0, grant.fence, false);
        checker.releasing(&key, client);
        match tokio::time::timeout(op_timeout, current.release()).await {
            Ok(Ok(())) => {
                pairs.fetch_add(1, Ordering::Relaxed);
                locker = Some(current);
            }
            _ => {
                errors.fetch_add(1, Ordering::Relaxed);
                generation += 1;
            }
        }
    }
}

/// One probe attempt: a new client (number `attempt`, so attempts cycle through
/// the members) acquires `key`. Returns the locker holding it.
async fn probe_once<L: Locker>(config: &L::Config, attempt: usize, key: &str) -> anyhow::Result<L> {
    let mut locker = L::connect(config, attempt).await?;
    locker.acquire(key).await?;
    Ok(locker)
}

/// Runs `spec` against `cluster`, with clients of type `L` configured by `config`.
pub async fn run<L: Locker>(
    cluster: &mut Cluster,
    config: Arc<L::Config>,
    spec: &FailoverSpec,
) -> anyhow::Result<FailoverOutcome> {
    let started = Instant::now();
    let shared = Arc::new(Load::default());
    let op_timeout = spec.attempt_timeout.max(Duration::from_secs(2));
    let mut load = Vec::new();
    for client in 0..spec.load_clients {
        load.push(tokio::spawn(load_client::<L>(
            config.clone(),
            client,
            spec.key_prefix.clone(),
            op_timeout,
            shared.clone(),
        )));
    }
    let result = rounds::<L>(cluster, &config, spec).await;
    shared.stop.store(true, Ordering::Relaxed);
    for task in load {
        // Each load operation is bounded by `op_timeout`, so this ends soon.
        let _ = tokio::time::timeout(op_timeout * 3 + Duration::from_secs(1), task).await;
    }
    Ok(FailoverOutcome {
        rounds: result?,
        load_pairs: shared.pairs.load(Ordering::Relaxed),
        load_errors: shared.errors.load(Ordering::Relaxed),
        checked: shared.checker.summary(),
        seconds: started.elapsed().as_secs_f64(),
    })
}

async fn rounds<L: Locker>(
    cluster: &mut Cluster,
    config: &Arc<L::Config>,
    spec: &FailoverSpec,
) -> anyhow::Result<Vec<Round>> {
    let mut rounds = Vec::with_capacity(spec.kills);
    let mut attempt_no = 0usize;
    for kill in 0..spec.kills {
        cluster.wait_healthy(spec.heal_timeout).await?;
        tokio::time::sleep(spec.settle).await;
        let leader = leader_of(cluster, spec.heal_timeout).await?;
        cluster.kill(leader)?;
        let (grant_after, attempts, first_error) = probe::<L>(
            config,
            spec,
            &format!("{}probe-{kill}-", spec.key_prefix),
            &mut attempt_no,
        )
        .await;
        cluster.restart(leader)?;
        let heal = cluster.wait_healthy(spec.heal_timeout).await?;
        eprintln!(
            "fencelock-bench: failover {}/{}: leader m{} killed, grant after {}, {attempts} attempts, healthy {:.1} s after restart",
            kill + 1,
            spec.kills,
            leader + 1,
            grant_after.map_or("none (timeout)".to_owned(), |d| format!("{} ms", d.as_millis())),
            heal.as_secs_f64()
        );
        rounds.push(Round {
            leader: leader + 1,
            grant_after,
            attempts,
            first_error,
            heal,
        });
    }
    Ok(rounds)
}

/// The probe of one round, started just after the kill: a new attempt (a fresh
/// client on the next member, a new key) every `spec.attempt_every`, each given up
/// after `spec.attempt_timeout`, until one is granted or `spec.probe_timeout`
/// passes. Attempts overlap so that a request stuck on a member that lost its
/// leader (etcd keeps a forwarded proposal until the client's deadline) cannot hide
/// the moment the service is back: the time measured is that of the earliest grant,
/// to within `attempt_every`. Returns (kill → grant, attempts started, the first
/// failure seen).
async fn probe<L: Locker>(
    config: &Arc<L::Config>,
    spec: &FailoverSpec,
    key_prefix: &str,
    attempt_no: &mut usize,
) -> (Option<Duration>, u64, Option<String>) {
    let killed_at = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    let mut next_launch = killed_at;
    let mut attempts = 0u64;
    let mut first_error: Option<String> = None;
    let grant_after = loop {
        if killed_at.elapsed() >= spec.probe_timeout {
            break None;
        }
        if Instant::now() >= next_launch {
            attempts += 1;
            *attempt_no += 1;
            let (config, client, timeout) = (config.clone(), *attempt_no, spec.attempt_timeout);
            let key = format!("{key_prefix}{attempts}");
            set.spawn(async move {
                tokio::time::timeout(timeout, probe_once::<L>(&config, client, &key)).await
            });
            next_launch += spec.attempt_every;
            continue;
        }
        tokio::select! {
            Some(joined) = set.join_next() => match joined {
                Ok(Ok(Ok(mut locker))) => {
                    let at = killed_at.elapsed();
                    let _ = tokio::time::timeout(spec.attempt_timeout, locker.release()).await;
                    break Some(at);
                }
                Ok(Ok(Err(e))) => {
                    first_error.get_or_insert_with(|| format!("{e:#}"));
                }
                Ok(Err(_)) => {
                    first_error.get_or_insert_with(|| {
                        format!("attempt timed out after {:?}", spec.attempt_timeout)
                    });
                }
                Err(e) => {
                    first_error.get_or_insert_with(|| format!("attempt task: {e}"));
                }
            },
            _ = tokio::time::sleep_until(next_launch.into()) => {}
        }
    };
    // The attempts still under way are not needed (their keys are never used again).
    set.abort_all();
    (grant_after, attempts, first_error)
}

/// The leader's member index, waiting (at most `timeout`) while none is known.
async fn leader_of(cluster: &Cluster, timeout: Duration) -> anyhow::Result<usize> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(i) = cluster.leader().await {
            return Ok(i);
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "no {:?} leader found within {timeout:?}",
            cluster.kind()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Percentiles of the rounds' grant times in milliseconds: (p50, max), over the
/// rounds whose probe succeeded; a timed-out round counts as `probe_timeout`.
pub fn summary_ms(rounds: &[Round], probe_timeout: Duration) -> Option<(f64, f64)> {
    let mut ms: Vec<f64> = rounds
        .iter()
        .map(|r| r.grant_after.unwrap_or(probe_timeout).as_secs_f64() * 1e3)
        .collect();
    if ms.is_empty() {
        return None;
    }
    ms.sort_by(f64::total_cmp);
    let p50 = if ms.len() % 2 == 1 {
        ms[ms.len() / 2]
    } else {
        (ms[ms.len() / 2 - 1] + ms[ms.len() / 2]) / 2.0
    };
    Some((p50, ms[ms.len() - 1]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round(ms: Option<u64>) -> Round {
        Round {
            leader: 1,
            grant_after: ms.map(Duration::from_millis),
            attempts: 1,
            first_error: None,
            heal: Duration::ZERO,
        }
    }

    #[test]
    fn median_and_max_count_timeouts_as_the_timeout() {
        let rounds = [round(Some(300)), round(Some(100)), round(None)];
        assert_eq!(
            summary_ms(&rounds, Duration::from_secs(30)),
            Some((300.0, 30_000.0))
        );
        let even = [round(Some(100)), round(Some(400))];
        assert_eq!(
            summary_ms(&even, Duration::from_secs(30)),
            Some((250.0, 400.0))
        );
        assert_eq!(summary_ms(&[], Duration::from_secs(30)), None);
    }
}
