//! The checker catches each planted bug: with ONE protection switched off (the real
//! code path, through `fencelock_core::PlantedBugs` for the core's checks), the
//! simulation finds a violation of the expected kind within a bounded number of
//! seeds, and prints the seed and the command that replays it.

use fencelock_sim::{replay_command, run_seed, Invariant, Options, PlantedBug};

/// Seeds tried per bug before the test fails.
const MAX_SEEDS: u64 = 1_000;

fn caught(bug: PlantedBug, expected: &[Invariant]) {
    let options = Options {
        planted: Some(bug),
        ..Options::default()
    };
    for seed in 0..MAX_SEEDS {
        if let Some(v) = run_seed(seed, options).violation {
            show(&format!(
                "planted {}: caught at seed {seed} ({} seeds tried): {v}\n  replay: {}",
                bug.name(),
                seed + 1,
                replay_command(seed, Some(bug))
            ));
            assert!(
                expected.contains(&v.invariant),
                "planted {}: seed {seed} broke {v}, expected one of {expected:?}",
                bug.name()
            );
            return;
        }
    }
    panic!("planted {} was not caught in {MAX_SEEDS} seeds", bug.name());
}

/// Prints a line past the test harness's output capture, so the figures show in
/// every run (CI logs included), not only with `--nocapture`.
fn show(line: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "{line}");
}

#[test]
fn missing_fence_check_at_the_resource_is_caught() {
    caught(
        PlantedBug::NoFenceCheckAtResource,
        &[Invariant::StaleWriteAccepted],
    );
}

#[test]
fn fence_counter_that_is_not_durable_is_caught() {
    caught(
        PlantedBug::FenceCounterNotDurable,
        &[Invariant::AckedGrantLost, Invariant::FenceOrder],
    );
}

#[test]
fn release_by_name_only_is_caught() {
    caught(PlantedBug::ReleaseByNameOnly, &[Invariant::MutualExclusion]);
}

#[test]
fn granting_an_expired_waiter_is_caught() {
    caught(
        PlantedBug::GrantExpiredWaiters,
        &[Invariant::ExpiredWaiterGranted],
    );
}

/// A reader granted past a queued writer on the simulation's reader-writer lock:
/// the checker sees a direct grant while a request is queued.
#[test]
fn a_reader_granted_past_a_queued_writer_is_caught() {
    caught(
        PlantedBug::ReaderJumpsWriter,
        &[
            Invariant::FifoOrder,
            Invariant::HolderLimit,
            Invariant::MutualExclusion,
        ],
    );
}

#[test]
fn a_server_that_never_arms_its_timer_is_caught_by_the_liveness_check() {
    caught(PlantedBug::NoExpiryTimer, &[Invariant::Liveness]);
}

/// `Core::check_invariants` recounts every principal's usage (issue 19's quotas):
/// with expiry no longer taking a grant off its principal's count, the count
/// drifts and the check says so; the same run without the bug passes.
#[test]
fn usage_count_drift_is_caught_by_the_invariant_check() {
    use fencelock_core::{
        Acquire, Command, Config, Core, LockName, Owner, OwnerToken, PlantedBugs, Tenant,
    };
    let run = |bugs: PlantedBugs| {
        let mut core = Core::new(Config::default());
        core.plant_bugs(bugs);
        let acquire = Acquire {
            name: LockName::new("a:1").expect("valid"),
            token: OwnerToken::from_u128(1),
            ttl_ms: Some(100),
            wait_ms: 0,
            owner: Owner::default(),
            request_id: None,
            limit: 1,
            lock_delay_ms: 0,
            session: None,
            tenant: Some(Tenant::new("a").expect("valid")),
            quota: None,
            mode: fencelock_core::Mode::Exclusive,
            value: None,
        };
        core.apply(0, Command::Acquire(acquire)).expect("granted");
        // Expiry, applied by a check-free path: the debug build's after-command
        // check would stop the process instead of reporting.
        let image = core.export();
        core.apply(200, Command::Tick).map(|_| ()).ok();
        (image, core.check_invariants())
    };
    let (_, clean) = run(PlantedBugs::default());
    assert_eq!(clean, Ok(()));
    let planted = std::panic::catch_unwind(|| {
        run(PlantedBugs {
            leak_usage_on_expiry: true,
            ..PlantedBugs::default()
        })
        .1
    });
    // Debug builds check after every command and panic there; release builds
    // return the broken invariant from the explicit check. Either way: caught.
    let caught = match planted {
        Ok(result) => result.expect_err("drift reported").to_string(),
        Err(panic) => panic.downcast_ref::<String>().cloned().unwrap_or_default(),
    };
    show(&format!("planted leak_usage_on_expiry: caught: {caught}"));
    assert!(caught.contains("usage counts out of step"), "{caught}");
}
