//! Many seeds of the cluster simulation, 3 and 5 members: no violation.
//!
//! `FENCELOCK_CLUSTER_SIM_SEEDS=N` runs N seeds (default 1,000),
//! `FENCELOCK_CLUSTER_SIM_FIRST_SEED=S` from seed S.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use fencelock_cluster_sim::{run_seed, Options};

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Every fourth seed runs five members.
fn options(seed: u64) -> Options {
    Options {
        members: if seed % 4 == 3 { 5 } else { 3 },
        ..Options::default()
    }
}

#[test]
fn every_seed_keeps_every_invariant() {
    let seeds = env("FENCELOCK_CLUSTER_SIM_SEEDS", 1_000);
    let first = env("FENCELOCK_CLUSTER_SIM_FIRST_SEED", 0);
    let next = AtomicU64::new(first);
    let totals = Mutex::new((
        0u64,
        0u64,
        0u64,
        0u64,
        BTreeMap::<&'static str, u64>::new(),
        0u64,
    ));
    let failures = Mutex::new(Vec::new());
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let seed = next.fetch_add(1, Ordering::Relaxed);
                if seed >= first + seeds {
                    return;
                }
                let report = run_seed(seed, options(seed));
                let mut t = totals.lock().unwrap();
                t.0 += 1;
                t.1 += report.grants;
                t.3 += report.queued;
                t.2 += report.reads;
                t.5 += report.watchdog_elections;
                for (k, v) in &report.faults {
                    *t.4.entry(k).or_default() += v;
                }
                if let Some(v) = report.violation {
                    failures.lock().unwrap().push(format!("seed {seed}: {v}"));
                }
            });
        }
    });
    let (runs, grants, reads, queued, faults, watchdog) = totals.into_inner().unwrap();
    println!(
        "cluster sim: {runs} seeds from {first}, {grants} grants, {reads} linearizable reads, {queued} queued requests in complete event streams, faults {faults:?}, {watchdog} dead-leader watchdog elections"
    );
    assert!(
        queued > runs / 2,
        "hardly any request queued: FIFO was barely exercised ({queued} queued)"
    );
    assert!(
        grants > runs,
        "the clients hardly got anything: {grants} grants"
    );
    // The watchdog's early elections are among what the invariants were checked
    // against: crashed leaders are common enough that a run of more than a few
    // seeds without one means the watchdog is not running.
    let crashed_leaders = faults.get("crash-leader").copied().unwrap_or(0);
    assert!(
        crashed_leaders < 20 || watchdog > 0,
        "{crashed_leaders} leader crashes but no watchdog election"
    );
    let failures = failures.into_inner().unwrap();
    assert!(
        failures.is_empty(),
        "{} violations:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
