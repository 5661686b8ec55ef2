//! Chaos over a real 3-member cluster: member processes with a TCP proxy on every
//! link, workers that follow the leader and write a shared resource through a
//! `FileGate`, and one fault per step (see `fencelock_chaos::cluster`).
//!
//! ```text
//! cargo test -p fencelock-cli --test chaos_cluster              # short, < 3 minutes
//! FENCELOCK_CHAOS_LONG=1 cargo test -p fencelock-cli --test chaos_cluster   # long
//! FENCELOCK_CHAOS_SEED=42 cargo test -p fencelock-cli --test chaos_cluster  # replay
//! FENCELOCK_CHAOS_FAULTS=kill_leader,kill_all cargo test -p fencelock-cli --test chaos_cluster
//! ```
//!
//! Two cases:
//! - `cluster_chaos_fenced`: every fault once (the long run: `FENCELOCK_CHAOS_ROUNDS`
//!   times, default 3, with a follower isolated while 25 000 entries are committed so
//!   it needs a snapshot). The checker must find no violation, and after every heal
//!   (and during every fault that leaves a majority) some worker must get a grant
//!   within `PROGRESS_BOUND`.
//! - `cluster_chaos_planted_bug`: the same cluster with the resource's fence check off
//!   (and the workers ignoring the lost signal) must make the checker report stale
//!   writes accepted — and nothing else, since the cluster itself is fine.
//!
//! The file has its own `main` (no libtest harness): with `FENCELOCK_CHAOS_WORKER`
//! set the process is a worker. A name filter after `--` selects cases by substring.

#[allow(dead_code)] // Only `BIN`: the members are started by fencelock_chaos::cluster.
mod support;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use fencelock_chaos::checker::ViolationKind;
use fencelock_chaos::cluster::{self, ClusterChaosConfig, ClusterSummary, Fault, PROGRESS_BOUND};

fn config(seed: u64) -> ClusterChaosConfig {
    let me = std::env::current_exe().expect("the test binary's path");
    ClusterChaosConfig::new(PathBuf::from(support::BIN), me, seed)
}

fn env_u64(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    Some(
        value
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value:?} is not a number")),
    )
}

fn long() -> bool {
    std::env::var("FENCELOCK_CHAOS_LONG").is_ok_and(|v| v == "1")
}

fn run(config: &ClusterChaosConfig) -> Result<ClusterSummary, String> {
    let summary = cluster::run(config)?;
    print!("{summary}");
    for v in summary.report.violations.iter().take(10) {
        println!("  {v}");
    }
    if let Some(dir) = &summary.kept_dir {
        println!("  run directory kept: {}", dir.display());
    }
    Ok(summary)
}

fn cluster_chaos_fenced(seed: u64) -> Result<(), String> {
    let mut config = config(seed);
    if long() {
        let rounds = env_u64("FENCELOCK_CHAOS_ROUNDS").unwrap_or(3) as usize;
        config.faults = Fault::ALL.repeat(rounds);
        // A snapshot every 20,000 entries keeping 2,000 (the server's policy): 25,000
        // entries after the cut cross at least one snapshot that purges past it.
        config.isolate_entries = 25_000;
        config.isolate_for = Duration::from_secs(10);
        config.isolate_max = Duration::from_secs(600);
        config.load_threads = 6;
    }
    // FENCELOCK_CHAOS_FAULTS=a,b,… replaces the steps (names as Fault::name).
    if let Ok(names) = std::env::var("FENCELOCK_CHAOS_FAULTS") {
        config.faults = names
            .split(',')
            .map(|n| Fault::from_name(n).ok_or_else(|| format!("unknown fault {n:?}")))
            .collect::<Result<_, _>>()?;
    }
    let s = run(&config)?;
    let mut problems = Vec::new();
    if !s.report.violations.is_empty() {
        problems.push(format!("{} violations", s.report.violations.len()));
    }
    if let Some(d) = s.divergence() {
        problems.push(d);
    }
    for step in s.slow_steps() {
        problems.push(format!(
            "{:?}: no grant in time (bound {:?} after the heal, {PROGRESS_BOUND:?} during a \
             fault that leaves a majority; failover {:?}, after heal {:?})",
            step.fault,
            step.fault.progress_bound(s.ttl),
            step.failover,
            step.progress
        ));
    }
    // The faults must have happened and bitten: every step but the membership change
    // (reported, see the module docs of fencelock_chaos::cluster) did what it set out
    // to, and the workers got many grants.
    for step in &s.steps {
        if !step.done && !matches!(step.fault, Fault::AddRemoveMember | Fault::StopHolder) {
            problems.push(format!("{:?} did not happen: {}", step.fault, step.detail));
        }
    }
    // The long run isolates a follower long enough that the leader has purged the
    // entries it lacks: it must catch up from a snapshot.
    if long() {
        for step in s.steps.iter().filter(|s| s.fault == Fault::IsolateFollower) {
            if step.snapshot_installed != Some(true) {
                problems.push(format!(
                    "the isolated follower caught up without a snapshot: {}",
                    step.detail
                ));
            }
        }
    }
    if s.report.grants < 2 * s.steps.len() {
        problems.push(format!(
            "only {} grants in {} steps",
            s.report.grants,
            s.steps.len()
        ));
    }
    if s.workers_killed != 0 {
        problems.push(format!(
            "{} workers did not stop when asked",
            s.workers_killed
        ));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("; "))
    }
}

fn cluster_chaos_planted_bug(seed: u64) -> Result<(), String> {
    let mut config = config(seed);
    config.fenced = false;
    config.faults = vec![
        Fault::StopHolder,
        Fault::KillLeader,
        Fault::StopHolder,
        Fault::PartitionLeader,
        Fault::StopHolder,
    ];
    let s = run(&config)?;
    let stale = s.report.count(ViolationKind::StaleWriteAccepted);
    if stale == 0 {
        return Err(format!(
            "with the fence check off the checker reported no stale write accepted ({:?})",
            s.steps.iter().map(|s| &s.detail).collect::<Vec<_>>()
        ));
    }
    let other = s.report.violations.len() - stale;
    if other != 0 {
        return Err(format!(
            "{other} violations besides stale writes: {:?}",
            s.report.violations
        ));
    }
    Ok(())
}

/// One test case: a seed in, a failure message out.
type Case = fn(u64) -> Result<(), String>;

fn main() -> ExitCode {
    if let Ok(worker) = std::env::var(fencelock_chaos::WORKER_ENV) {
        return ExitCode::from(fencelock_chaos::worker::main(&worker) as u8);
    }
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let cases: [(&str, Case); 2] = [
        ("cluster_chaos_fenced", cluster_chaos_fenced),
        ("cluster_chaos_planted_bug", cluster_chaos_planted_bug),
    ];
    // libtest's listing, as cargo-nextest asks for it: none of the cases is ignored.
    if std::env::args().any(|a| a == "--list") {
        if !std::env::args().any(|a| a == "--ignored") {
            for (name, _) in cases {
                println!("{name}: test");
            }
        }
        return ExitCode::SUCCESS;
    }
    let seed = env_u64("FENCELOCK_CHAOS_SEED").unwrap_or_else(fencelock_chaos::monotonic_ns);
    println!(
        "cluster chaos seed {seed} (replay the run's choices with FENCELOCK_CHAOS_SEED={seed})"
    );
    let mut failed = 0;
    for (name, case) in cases {
        if !filters.is_empty() && !filters.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        match case(seed) {
            Ok(()) => println!("test {name} ... ok"),
            Err(e) => {
                println!("test {name} ... FAILED: {e}");
                failed += 1;
            }
        }
    }
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
