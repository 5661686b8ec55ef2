//! The checker catches each planted cluster bug: with one protection switched off
//! (the real code path, behind the server's `planted-bugs` feature), some seed
//! breaks the expected invariant.

use fencelock_cluster_sim::{run_seed, Invariant, Options};
use fencelock_server::engine::ClusterBugs;

/// Seeds tried per bug before the test fails.
const MAX_SEEDS: u64 = 200;

fn caught(bugs: ClusterBugs, name: &str, expected: &[Invariant]) {
    let options = Options {
        bugs,
        ..Options::default()
    };
    for seed in 0..MAX_SEEDS {
        if let Some(v) = run_seed(seed, options).violation {
            println!("planted {name}: caught at seed {seed}: {v}");
            assert!(
                expected.contains(&v.invariant),
                "planted {name}: seed {seed} broke {v}, expected one of {expected:?}"
            );
            return;
        }
    }
    panic!("planted {name}: not caught in {MAX_SEEDS} seeds");
}

#[test]
fn apply_before_commit_is_caught() {
    caught(
        ClusterBugs {
            apply_before_commit: true,
            ..ClusterBugs::default()
        },
        "apply-before-commit",
        &[
            Invariant::MutualExclusion,
            Invariant::FenceOrder,
            Invariant::StaleRead,
        ],
    );
}

#[test]
fn a_new_leader_expiring_leases_at_once_is_caught() {
    caught(
        ClusterBugs {
            expire_on_promote: true,
            ..ClusterBugs::default()
        },
        "expire-on-promote",
        &[Invariant::MutualExclusion, Invariant::StaleRead],
    );
}

#[test]
fn fences_from_a_member_local_counter_are_caught() {
    caught(
        ClusterBugs {
            local_fence: true,
            ..ClusterBugs::default()
        },
        "local-fence",
        // In debug builds the core's own invariant check (every held fence below
        // the next) usually stops the member first.
        &[Invariant::FenceOrder, Invariant::MemberFailed],
    );
}

#[test]
fn reads_served_by_a_deposed_leader_are_caught() {
    caught(
        ClusterBugs {
            stale_leader_reads: true,
            ..ClusterBugs::default()
        },
        "stale-leader-reads",
        &[Invariant::StaleRead],
    );
}

#[test]
fn a_retried_waiter_losing_its_place_is_caught() {
    caught(
        ClusterBugs {
            requeue_retries: true,
            ..ClusterBugs::default()
        },
        "requeue-retries",
        &[Invariant::Fifo],
    );
}
