//! Runs the simulation over many seeds; every failure prints its seed and the command
//! that replays it.
//!
//! - `cargo test -p fencelock-sim --test it seeds::`: 1,000 seeds (0..1000), under a minute
//!   in a debug build (long runs: `cargo run -p fencelock-sim --release -- --seeds N`).
//! - `FENCELOCK_SIM_SEEDS=N`: run N seeds instead; `FENCELOCK_SIM_FIRST_SEED=S` starts
//!   at S.
//! - `FENCELOCK_SIM_SEED=S`: replay seed S alone, printing every step
//!   (`FENCELOCK_SIM_PLANT=NAME` replays it with a planted bug).

use fencelock_sim::{replay_command, run_seed, Options, PlantedBug, Totals};

fn env_u64(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    Some(
        value
            .parse()
            .unwrap_or_else(|_| panic!("{name} must be a number, got {value:?}")),
    )
}

/// Runs `count` seeds from `first` on two threads; the totals are independent of
/// the split (every seed is its own world).
fn run_many(first: u64, count: u64, options: Options) -> Totals {
    let threads = 2u64;
    let parts: Vec<Totals> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                scope.spawn(move || {
                    let mut totals = Totals::default();
                    let mut seed = first + t;
                    while seed < first + count {
                        totals.add(&run_seed(seed, options));
                        seed += threads;
                    }
                    totals
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("no panic escapes run_seed"))
            .collect()
    });
    let mut totals = Totals::default();
    for part in parts {
        totals.seeds += part.seeds;
        totals.stats = sum(totals.stats, part.stats);
        totals.failures.extend(part.failures);
    }
    totals.failures.sort_by_key(|(seed, _)| *seed);
    totals
}

fn sum(a: fencelock_sim::Stats, b: fencelock_sim::Stats) -> fencelock_sim::Stats {
    let mut t = Totals::default();
    for s in [a, b] {
        t.add(&fencelock_sim::SeedReport {
            seed: 0,
            violation: None,
            stats: s,
            digest: 0,
        });
    }
    t.stats
}

/// Prints a line past the test harness's output capture, so the figures show in
/// every run (CI logs included), not only with `--nocapture`.
fn show(line: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "{line}");
}

#[test]
fn every_seed_holds_every_invariant() {
    let planted = std::env::var("FENCELOCK_SIM_PLANT").ok().map(|name| {
        PlantedBug::from_name(&name).unwrap_or_else(|| panic!("unknown planted bug {name:?}"))
    });
    if let Some(seed) = env_u64("FENCELOCK_SIM_SEED") {
        let report = run_seed(
            seed,
            Options {
                planted,
                trace: true,
                ..Options::default()
            },
        );
        let mut totals = Totals::default();
        totals.add(&report);
        show(&format!("fencelock-sim seed {seed}: {totals}"));
        if let Some(v) = &report.violation {
            panic!(
                "seed {seed}: {v}\nreplay: {}",
                replay_command(seed, planted)
            );
        }
        return;
    }
    let first = env_u64("FENCELOCK_SIM_FIRST_SEED").unwrap_or(0);
    let count = env_u64("FENCELOCK_SIM_SEEDS").unwrap_or(1_000);
    let started = std::time::Instant::now();
    let totals = run_many(
        first,
        count,
        Options {
            planted,
            ..Options::default()
        },
    );
    show(&format!(
        "fencelock-sim: {totals} ({:.1} s)",
        started.elapsed().as_secs_f64()
    ));
    for (seed, v) in &totals.failures {
        println!(
            "FAILED seed {seed}: {v}\n  replay: {}",
            replay_command(*seed, planted)
        );
    }
    assert!(
        totals.failures.is_empty(),
        "{} seeds failed",
        totals.failures.len()
    );
    // The run must have exercised what it claims to check.
    let s = &totals.stats;
    if count >= 100 {
        let f = &s.faults;
        for (kind, n) in [
            ("pause", f.pause),
            ("stall", f.stall),
            ("partition_one_way", f.partition_one_way),
            ("partition_two_way", f.partition_two_way),
            ("crash", f.crash),
            ("crash_kept_unsynced", f.crash_kept_unsynced),
            ("wall_jump", f.wall_jump),
            ("client_death", f.client_death),
            ("server_pause", f.server_pause),
            ("msg_lost", f.msg_lost),
            ("msg_duplicated", f.msg_duplicated),
            ("msg_delayed", f.msg_delayed),
        ] {
            assert!(n > 0, "no {kind} fault was injected in {count} seeds");
        }
        assert!(
            s.writes_rejected > 0,
            "no stale write ever reached the resource"
        );
        assert!(
            s.deadline_losses > 0,
            "no client ever lost a lock to its deadline"
        );
    }
}

#[test]
fn a_seed_replays_bit_for_bit() {
    for seed in [1, 42, 977] {
        let a = run_seed(seed, Options::default());
        let b = run_seed(seed, Options::default());
        assert_eq!(a.digest, b.digest, "seed {seed}");
        assert_eq!(a.stats, b.stats, "seed {seed}");
    }
    assert_ne!(
        run_seed(1, Options::default()).digest,
        run_seed(2, Options::default()).digest
    );
}

/// The server decides on its monotonic service clock only: the same seed with and
/// without wall-clock jumps makes exactly the same decisions.
#[test]
fn wall_clock_jumps_change_no_decision() {
    let mut jumped = 0;
    for seed in 0..40 {
        let with = run_seed(seed, Options::default());
        let without = run_seed(
            seed,
            Options {
                wall_clock_jumps: false,
                ..Options::default()
            },
        );
        assert!(
            with.violation.is_none(),
            "seed {seed}: {:?}",
            with.violation
        );
        assert_eq!(with.digest, without.digest, "seed {seed}");
        jumped += with.stats.faults.wall_jump;
    }
    assert!(jumped > 0, "no seed jumped the wall clock");
}
