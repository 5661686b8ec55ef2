//! Model-based property test: the core against the naive reference model in
//! `common/model.rs` (its header says what it models and what each step compares),
//! over random scripts that mix single and multi-lock acquires, shared and
//! exclusive modes, downgrades, election campaigns, proclaims and resignations,
//! releases one by one and together, sessions, timeouts and restarts. Every run
//! ends with the no-deadlock check: once every holder releases and time passes
//! every lease, every queued multi-lock request has been granted or has left.
//!
//! More cases: `PROPTEST_CASES=50000 cargo test -p fencelock-core --test it model::`.
//! A failure prints the failing step, the script up to it (one `+dt command` per
//! line), and proptest's shrunk input. The planted bugs this comparison catches
//! (a multi-lock granted partly, a reader granted past a queued writer, an
//! election term reused) are in `crates/fencelock-sim/tests/model_planted.rs`,
//! the one crate that compiles the core's `planted-bugs` switches.

use crate::common;

use std::cell::RefCell;

use common::model::{run, Coverage};
use common::{config_strategy, owner_of, steps_strategy, Step};
use fencelock_core::{Acquire, Command, Config, Core, Owner};
use proptest::prelude::*;
use proptest::test_runner::TestRunner;

/// 4000 cases by default (a few seconds in debug); `PROPTEST_CASES` overrides.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4000)
}

/// The core and the reference model agree on every reply, hand-off, wait end, event
/// and on the whole state, and the invariants hold, after every command of random
/// scripts. A failure prints the shrunk script.
#[test]
fn core_matches_reference_model() {
    let cases = cases();
    let mut runner = TestRunner::new(ProptestConfig {
        cases,
        max_shrink_iters: 20_000,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let coverage = RefCell::new(Coverage::default());
    let result = runner.run(
        &(config_strategy(), steps_strategy(80)),
        |(config, steps)| run(config, &steps, &mut coverage.borrow_mut()),
    );
    if let Err(e) = result {
        panic!("{e}");
    }
    // Coverage of the generator (only meaningful with enough cases).
    let c = coverage.into_inner();
    eprintln!("{cases} cases; coverage: {c:?}");
    if cases >= 1000 {
        for (what, n) in [
            ("hand-offs", c.handoffs),
            ("hand-offs to session waiters", c.session_handoffs),
            ("queued acquires", c.queued),
            ("refusals during lock-delay", c.lock_delay_refusals),
            ("idempotent retries answered with a grant", c.retried_grants),
            ("`expired` answers", c.expired_errors),
            ("forced releases", c.forced),
            ("multi-lock requests granted at once", c.multi_granted),
            ("multi-lock requests queued", c.multi_queued),
            ("multi-lock hand-offs", c.multi_handoffs),
            (
                "multi-lock requests leaving their queues",
                c.multi_wait_ends,
            ),
            ("releases of several grants at once", c.released_all),
            ("election leaders", c.leaders),
            ("proclaimed values", c.proclaimed),
        ] {
            assert!(n >= 10, "the generator made only {n} {what}: {c:?}");
        }
        for reason in ["TimedOut", "SessionEnded", "Cancelled", "ServerRestarted"] {
            let n = c.wait_ends.get(reason).copied().unwrap_or(0);
            assert!(
                n >= 10,
                "the generator made only {n} {reason} wait ends: {c:?}"
            );
        }
    }
}

/// A fixed script through every command kind, so the comparison is known to run
/// on a busy state even if the random generator changes.
#[test]
fn model_agrees_on_a_fixed_busy_script() {
    use common::{name, sid, tok};
    let acquire =
        |n: &str, t: u128, ttl: Option<u64>, s: Option<u128>, wait_ms: u64, delay: u64| {
            Command::Acquire(Acquire {
                name: name(n),
                token: tok(t),
                ttl_ms: ttl,
                wait_ms,
                owner: owner_of(tok(t)),
                request_id: None,
                limit: if n == "b" { 2 } else { 1 },
                lock_delay_ms: delay,
                session: s.map(sid),
                tenant: common::model_tenant(),
                quota: None,
                mode: fencelock_core::Mode::Exclusive,
                value: None,
            })
        };
    let step = |dt_ms, command| Step { dt_ms, command };
    let script = vec![
        step(
            0,
            Command::OpenSession {
                id: sid(1),
                ttl_ms: 20,
                owner: Owner::default(),
                tenant: common::model_tenant(),
                quota: None,
            },
        ),
        step(0, acquire("a", 1, Some(10), None, 0, 5)),
        step(1, acquire("a", 2, None, Some(1), 30, 0)),
        step(1, acquire("a", 3, Some(10), None, 30, 0)),
        step(0, acquire("b", 4, Some(30), None, 0, 0)),
        step(0, acquire("b", 5, None, Some(1), 0, 0)),
        step(0, acquire("b", 6, Some(30), None, 20, 0)),
        // t1's lease ends at 10 with lock-delay 5: nobody gets `a` before 15.
        step(10, Command::Tick),
        step(4, Command::Tick),
        step(1, Command::Tick),
        // Session 1 expires at 20 (not kept alive): b's slot goes to t6.
        step(5, Command::Tick),
        step(0, Command::RaiseFenceFloor { floor: 20 }),
        step(0, Command::Recover),
        step(
            3,
            Command::Release {
                name: name("b"),
                token: tok(4),
            },
        ),
        step(
            0,
            Command::Release {
                name: name("b"),
                token: tok(4),
            },
        ),
        step(
            50,
            Command::Renew {
                name: name("a"),
                token: tok(3),
                ttl_ms: None,
            },
        ),
    ];
    let config = Config {
        min_ttl_ms: 5,
        max_ttl_ms: 60,
        max_wait_ms: 50,
        max_lock_delay_ms: 25,
        max_limit: 3,
        ..Config::default()
    };
    if let Err(e) = run(config, &script, &mut Coverage::default()) {
        panic!("{e}");
    }
}

/// The arrival-order check (no two requests wait for each other) catches queues
/// that disagree: two multi-lock requests queued on `a` and `b` pass; the same
/// state with one queue's order swapped (what a multi-lock request jumping a queue
/// would make: each waits behind the other) fails.
#[test]
fn the_arrival_order_check_catches_queues_that_disagree() {
    use common::model::check_one_arrival_order;
    use common::{name, tok};
    let mut core = Core::new(Config::default());
    let part = |n: &str, t: u128| Acquire {
        name: name(n),
        token: tok(t),
        ttl_ms: Some(100),
        wait_ms: 50,
        owner: Owner::default(),
        request_id: None,
        limit: 1,
        lock_delay_ms: 0,
        session: None,
        tenant: None,
        quota: None,
        mode: fencelock_core::Mode::Exclusive,
        value: None,
    };
    let holder = Acquire {
        wait_ms: 0,
        ..part("a", 1)
    };
    core.apply(0, Command::Acquire(holder)).expect("granted");
    for (first, second) in [(("a", 10), ("b", 11)), (("b", 20), ("a", 21))] {
        let parts = vec![part(first.0, first.1), part(second.0, second.1)];
        core.apply(0, Command::AcquireAll(parts)).expect("queued");
    }
    let state = core.export();
    assert!(check_one_arrival_order(&state).is_ok());
    let mut swapped = state;
    for l in &mut swapped.locks {
        if l.name == name("b") {
            l.waiters.reverse();
        }
    }
    let refused = check_one_arrival_order(&swapped).expect_err("a cycle");
    assert!(
        refused.to_string().contains("wait for each other"),
        "{refused}"
    );
}
