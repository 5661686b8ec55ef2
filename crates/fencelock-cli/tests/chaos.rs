//! Chaos test over real processes: the `fencelock` binary, worker processes that lock
//! and write a shared resource through a `FileGate`, `SIGSTOP`ped holders and
//! `kill -9`ed servers (see the `fencelock-chaos` crate for the run and the checker).
//!
//! ```text
//! cargo test -p fencelock-cli --test chaos                      # ~10 rounds
//! FENCELOCK_CHAOS_ROUNDS=200 cargo test -p fencelock-cli --test chaos
//! FENCELOCK_CHAOS_SEED=42 cargo test -p fencelock-cli --test chaos   # replay choices
//! ```
//!
//! Two cases:
//! - `chaos_fenced`: with the fence check on, the checker must find no violation, and
//!   the faults must really have happened (every round restarted the server, stopped
//!   holders were overtaken, and some stale write was refused).
//! - `chaos_planted_bug`: the same run with the resource's fence check off must make
//!   the checker report stale writes accepted — or the checker proves nothing.
//!
//! This file has its own `main` (no libtest harness): when `FENCELOCK_CHAOS_WORKER` is
//! set, the process is a worker; otherwise it runs the two cases. A name filter given
//! after `--` selects cases by substring, as libtest's would.

use std::path::PathBuf;
use std::process::ExitCode;

use fencelock_chaos::checker::ViolationKind;
use fencelock_chaos::scenario::{self, ChaosConfig, Summary};

const BIN: &str = env!("CARGO_BIN_EXE_fencelock");

/// Rounds of the short run in `cargo test`.
const DEFAULT_ROUNDS: u32 = 10;

fn config(rounds: u32, seed: u64) -> ChaosConfig {
    let me = std::env::current_exe().expect("the test binary's path");
    ChaosConfig::new(PathBuf::from(BIN), me, rounds, seed)
}

fn env_u64(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    Some(
        value
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value:?} is not a number")),
    )
}

fn run(config: &ChaosConfig) -> Result<Summary, String> {
    let summary = scenario::run(config)?;
    println!("{summary}");
    for v in summary.report.violations.iter().take(10) {
        println!("  {v}");
    }
    Ok(summary)
}

fn chaos_fenced(rounds: u32, seed: u64) -> Result<(), String> {
    let s = run(&config(rounds, seed))?;
    let mut problems = Vec::new();
    if !s.report.violations.is_empty() {
        problems.push(format!(
            "{} violations (histories kept in {:?})",
            s.report.violations.len(),
            s.kept_dir
        ));
    }
    if s.restarts != rounds {
        problems.push(format!("{} restarts, expected {rounds}", s.restarts));
    }
    // The faults must have bitten, or the run proves little: most stops overtaken by
    // another holder's write, some late write refused, and every restart followed by
    // a successful acquire. (A stop that lands inside a write holds the file's flock:
    // nobody can overtake it.)
    if s.takeovers * 2 < rounds {
        problems.push(format!(
            "only {} of {rounds} stopped holders were overtaken",
            s.takeovers
        ));
    }
    if s.report.writes_refused == 0 {
        problems.push("no stale write was refused: the SIGSTOPs never hit a writer".into());
    }
    if s.recoveries.len() != s.restarts as usize {
        problems.push(format!(
            "{} of {} restarts were followed by a successful acquire",
            s.recoveries.len(),
            s.restarts
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

fn chaos_planted_bug(rounds: u32, seed: u64) -> Result<(), String> {
    let mut config = config(rounds, seed);
    config.fenced = false;
    let s = run(&config)?;
    let stale = s.report.count(ViolationKind::StaleWriteAccepted);
    if stale == 0 {
        return Err(format!(
            "with the fence check off the checker reported no stale write accepted ({} sigstops, {} takeovers)",
            s.sigstops, s.takeovers
        ));
    }
    // The server itself is fine: only the resource was broken.
    let other = s.report.violations.len() - stale;
    if other != 0 {
        return Err(format!(
            "{other} violations besides stale writes: {:?}",
            s.report.violations
        ));
    }
    Ok(())
}

/// One test case: rounds and seed in, a failure message out.
type Case = fn(u32, u64) -> Result<(), String>;

fn main() -> ExitCode {
    if let Ok(worker) = std::env::var(fencelock_chaos::WORKER_ENV) {
        return ExitCode::from(fencelock_chaos::worker::main(&worker) as u8);
    }
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let cases: [(&str, Case); 2] = [
        ("chaos_fenced", chaos_fenced),
        ("chaos_planted_bug", chaos_planted_bug),
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
    let rounds = env_u64("FENCELOCK_CHAOS_ROUNDS").map_or(DEFAULT_ROUNDS, |r| r as u32);
    let seed = env_u64("FENCELOCK_CHAOS_SEED").unwrap_or_else(fencelock_chaos::monotonic_ns);
    println!("chaos seed {seed} (replay the run's choices with FENCELOCK_CHAOS_SEED={seed})");
    let mut failed = 0;
    for (name, case) in cases {
        if !filters.is_empty() && !filters.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        // The planted-bug run needs only a few stops to show the checker works.
        let rounds = if name == "chaos_planted_bug" {
            rounds.min(4)
        } else {
            rounds
        };
        match case(rounds, seed) {
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
