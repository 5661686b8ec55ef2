//! The core's reference-model test (`crates/fencelock-core/tests/model.rs`, the
//! model and runner in `crates/fencelock-core/tests/common/model.rs`) catches each
//! planted bug of the lock kinds: with ONE protection of the core switched off
//! through `fencelock_core::PlantedBugs` (compiled in only here, where
//! `fencelock-sim` enables the `planted-bugs` feature), random scripts compared
//! step by step with the model fail, and the failure names what broke.
//!
//! The model's source is shared, not copied: this file includes the core's test
//! module by path, so the comparison that runs in the core's CI is the one shown
//! to catch these bugs.

use crate::common;

use std::panic::{catch_unwind, AssertUnwindSafe};

use common::model::{run_core, Coverage};
use common::{config_strategy, steps_strategy};
use fencelock_core::{Core, PlantedBugs};
use proptest::test_runner::{Config as RunnerConfig, TestCaseError, TestRng, TestRunner};

/// Runs random scripts against a core with `bugs` planted until the comparison
/// fails; the failure must contain one of `expect`.
fn caught(bugs: PlantedBugs, expect: &[&str]) {
    // A fixed seed: which check a shrunk failure ends on depends on the scripts
    // drawn, and a test must say the same thing on every run.
    let config = RunnerConfig {
        cases: 4000,
        max_shrink_iters: 2000,
        failure_persistence: None,
        ..RunnerConfig::default()
    };
    let rng = TestRng::deterministic_rng(config.rng_algorithm);
    let mut runner = TestRunner::new_with_rng(config, rng);
    let result = runner.run(
        &(config_strategy(), steps_strategy(80)),
        |(config, steps)| {
            let mut core = Core::new(config.clone());
            // The core's own after-command check stays off: the comparison with
            // the model must catch the bug by itself.
            core.plant_bugs(PlantedBugs {
                no_check_after_command: true,
                ..bugs
            });
            let mut coverage = Coverage::default();
            catch_unwind(AssertUnwindSafe(|| {
                run_core(core, config, &steps, &mut coverage)
            }))
            .unwrap_or_else(|panic| {
                let text = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                Err(TestCaseError::fail(format!("panicked: {text}")))
            })
        },
    );
    let Err(failure) = result else {
        panic!("planted {bugs:?} was not caught by the model comparison");
    };
    let text = failure.to_string();
    eprintln!("planted {bugs:?}: caught: {text}");
    assert!(
        expect.iter().any(|e| text.contains(e)),
        "planted {bugs:?} failed for another reason: {text}"
    );
}

#[test]
fn the_model_catches_a_multi_lock_granted_partly() {
    caught(
        PlantedBugs {
            partial_multi_grant: true,
            ..PlantedBugs::default()
        },
        &[
            "partly granted",
            "multi-lock hand-offs differ",
            "hand-offs differ",
        ],
    );
}

#[test]
fn the_model_catches_a_reader_granted_past_a_queued_writer() {
    caught(
        PlantedBugs {
            reader_jumps_writer: true,
            ..PlantedBugs::default()
        },
        &["granted at once past", "replies differ"],
    );
}

#[test]
fn the_model_catches_an_election_term_reused() {
    caught(
        PlantedBugs {
            reuse_term: true,
            ..PlantedBugs::default()
        },
        &["not strictly increasing", "hand-off fences not consecutive"],
    );
}
