//! Long simulation runs: `cargo run -p fencelock-sim --release -- --seeds 100000`.
//!
//! Options: `--seeds N` (default 10,000), `--first S` (first seed, default 0),
//! `--threads T` (default 2), `--seed S` (replay one seed with a step trace),
//! `--plant NAME` (switch off one protection: no-fence-check,
//! fence-counter-not-durable, release-by-name-only, grant-expired-waiters,
//! no-expiry-timer, reader-jumps-writer, partial-multi-grant, reuse-term).
//! Prints one summary line; exits 1 if any seed broke an invariant, 2 on bad usage.

use std::process::ExitCode;
use std::time::Instant;

use fencelock_sim::{replay_command, run_seed, Options, PlantedBug, SeedReport, Totals};

struct Args {
    seeds: u64,
    first: u64,
    threads: u64,
    replay: Option<u64>,
    planted: Option<PlantedBug>,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        seeds: 10_000,
        first: 0,
        threads: 2,
        replay: None,
        planted: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let number = |v: String| {
            v.parse::<u64>()
                .map_err(|_| format!("{flag}: not a number: {v:?}"))
        };
        match flag.as_str() {
            "--seeds" => args.seeds = number(value()?)?,
            "--first" => args.first = number(value()?)?,
            "--threads" => args.threads = number(value()?)?.clamp(1, 64),
            "--seed" => args.replay = Some(number(value()?)?),
            "--plant" => {
                let name = value()?;
                args.planted = Some(
                    PlantedBug::from_name(&name).ok_or(format!("unknown planted bug {name:?}"))?,
                );
            }
            "--help" | "-h" => {
                return Err("usage: fencelock-sim [--seeds N] [--first S] [--threads T] [--seed S] [--plant NAME]".into())
            }
            other => return Err(format!("unknown argument {other:?} (try --help)")),
        }
    }
    Ok(args)
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let options = Options {
        planted: args.planted,
        ..Options::default()
    };
    let started = Instant::now();
    let mut totals = Totals::default();
    if let Some(seed) = args.replay {
        totals.add(&run_seed(
            seed,
            Options {
                trace: true,
                ..options
            },
        ));
    } else {
        let (first, end, threads) = (args.first, args.first + args.seeds, args.threads);
        let reports: Vec<Vec<SeedReport>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    scope.spawn(move || {
                        (first + t..end)
                            .step_by(threads as usize)
                            .map(|seed| run_seed(seed, options))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("run_seed catches panics"))
                .collect()
        });
        let mut all: Vec<SeedReport> = reports.into_iter().flatten().collect();
        all.sort_by_key(|r| r.seed);
        for report in &all {
            totals.add(report);
        }
    }
    println!(
        "fencelock-sim: {totals} ({:.1} s)",
        started.elapsed().as_secs_f64()
    );
    for (seed, v) in totals.failures.iter().take(20) {
        println!(
            "FAILED seed {seed}: {v}\n  replay: {}",
            replay_command(*seed, args.planted)
        );
    }
    if totals.failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
