//! Determinism and snapshots: what the durable log and snapshot recovery rely on.
//!
//! - The same `(now_ms, command)` sequence on a fresh core gives the same replies,
//!   outcomes and state (two cores in one process also have different `HashMap`
//!   seeds, so iteration order must not leak into outputs).
//! - A core rebuilt with `import(export())` at any point continues exactly like the
//!   original.
//! - `import` refuses an image that breaks an invariant, instead of loading it.

use crate::common;

use common::{config_strategy, name, owner_of, sid, steps_strategy, tok, Step};
use fencelock_core::{
    Command, Config, Core, Fence, GrantEnd, HolderImage, LeaseImage, LockImage, Outcome, Owner,
    Reply, RequestId, SessionImage, StateImage, WaiterImage,
};
use proptest::prelude::*;
use proptest::sample::Index;

type Output = (Result<Reply, fencelock_core::Error>, Vec<Outcome>);

fn step(core: &mut Core, now: u64, step: &Step) -> Output {
    let reply = core.apply(now, step.command.clone());
    (reply, core.take_outcomes())
}

/// Runs `steps` from `start` and returns every output.
fn run_from(core: &mut Core, mut now: u64, steps: &[Step]) -> Vec<Output> {
    steps
        .iter()
        .map(|s| {
            now += s.dt_ms;
            step(core, now, s)
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 500,
        failure_persistence: None,
        .. ProptestConfig::default()
    })]

    /// Replaying the same commands on a fresh core gives identical replies,
    /// outcomes, final state and next deadline.
    #[test]
    fn replaying_a_script_gives_identical_outputs(
        config in config_strategy(),
        steps in steps_strategy(80),
    ) {
        let mut first = Core::new(config.clone());
        let mut second = Core::new(config);
        let a = run_from(&mut first, 0, &steps);
        let b = run_from(&mut second, 0, &steps);
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            prop_assert_eq!(x, y, "step {} ({:?}) differs on replay", i, steps[i]);
        }
        prop_assert_eq!(first.export(), second.export());
        prop_assert_eq!(first.next_deadline_ms(), second.next_deadline_ms());
        prop_assert_eq!(first.stats(), second.stats());
    }

    /// A snapshot taken at a random point and imported into a new core continues
    /// exactly like the original: same replies, outcomes and final state.
    #[test]
    fn snapshot_then_continue_matches_the_original(
        config in config_strategy(),
        steps in steps_strategy(80),
        split in any::<Index>(),
    ) {
        let split = split.index(steps.len() + 1);
        let (before, after) = steps.split_at(split);
        let mut original = Core::new(config.clone());
        run_from(&mut original, 0, before);
        let now = original.now_ms();

        let image = original.export();
        let mut restored = Core::import(config, image.clone())
            .map_err(|e| TestCaseError::fail(format!("a live core's image was refused: {e}")))?;
        prop_assert_eq!(restored.export(), image, "import(export()) changed the state");
        prop_assert_eq!(restored.next_deadline_ms(), original.next_deadline_ms());

        let a = run_from(&mut original, now, after);
        let b = run_from(&mut restored, now, after);
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            prop_assert_eq!(
                x, y,
                "step {} ({:?}) after the snapshot at step {} differs", split + i, after[i], split
            );
        }
        prop_assert_eq!(original.export(), restored.export());
        prop_assert_eq!(original.stats(), restored.stats());
    }
}

// ---------------------------------------------------------------------------------
// Corrupted images.
// ---------------------------------------------------------------------------------

fn config() -> Config {
    Config::default()
}

/// A valid, busy image at `now_ms = 100`: `a` (mutex) held by t1 with request id
/// `r1`, queued t2 (own lease) and t3 (session s1); `b` (2 slots) held by t4 (session
/// s1) and t5; `c` empty but in lock-delay until 130.
fn busy_image() -> StateImage {
    let holder = |t: u128, fence: u64, lease: LeaseImage| HolderImage {
        token: tok(t),
        fence: Fence::new(fence).expect("non-zero"),
        owner: owner_of(tok(t)),
        request_id: None,
        lease,
        granted_at_ms: 90,
        lock_delay_ms: 0,
        tenant: None,
        mode: fencelock_core::Mode::Exclusive,
        value: None,
    };
    let own = |deadline_ms| LeaseImage::Own {
        ttl_ms: 30,
        deadline_ms,
    };
    let waiter = |t: u128, session: Option<u128>| WaiterImage {
        token: tok(t),
        owner: owner_of(tok(t)),
        request_id: None,
        ttl_ms: session.is_none().then_some(30),
        session: session.map(sid),
        lock_delay_ms: 0,
        enqueued_at_ms: 95,
        wait_deadline_ms: 150,
        tenant: None,
        mode: fencelock_core::Mode::Exclusive,
        value: None,
        group: Vec::new(),
    };
    StateImage {
        now_ms: 100,
        next_fence: 6,
        locks: vec![
            LockImage {
                name: name("a"),
                limit: 1,
                blocked_until_ms: 0,
                holders: vec![HolderImage {
                    request_id: Some(RequestId::new("r1").expect("valid")),
                    ..holder(1, 3, own(120))
                }],
                waiters: vec![waiter(2, None), waiter(3, Some(1))],
            },
            LockImage {
                name: name("b"),
                limit: 2,
                blocked_until_ms: 0,
                holders: vec![
                    holder(4, 4, LeaseImage::Session(sid(1))),
                    holder(5, 5, own(125)),
                ],
                waiters: vec![],
            },
            LockImage {
                name: name("c"),
                limit: 1,
                blocked_until_ms: 130,
                holders: vec![],
                waiters: vec![],
            },
        ],
        sessions: vec![SessionImage {
            id: sid(1),
            owner: Owner::new("s1").expect("valid"),
            tenant: None,
            ttl_ms: 40,
            deadline_ms: 140,
        }],
        recent_ends: vec![(tok(9), name("gone"), GrantEnd::Expired)],
    }
}

/// The hand-built image is valid: it imports, exports unchanged, and works.
#[test]
fn busy_image_imports_and_round_trips() {
    let image = busy_image();
    let mut core = Core::import(config(), image.clone()).expect("valid image");
    assert_eq!(core.export(), image);
    assert_eq!(core.next_deadline_ms(), Some(120));
    // t1's lease ends at 120: t2 (next in line) gets `a` with fence 6.
    core.apply(120, Command::Tick).expect("tick");
    let granted: Vec<_> = core
        .take_outcomes()
        .into_iter()
        .filter_map(|o| match o {
            Outcome::Granted(g) => Some((g.token, g.fence.get())),
            _ => None,
        })
        .collect();
    assert_eq!(granted, vec![(tok(2), 6)]);
    core.check_invariants().expect("still consistent");
}

/// Every corruption is refused by `import`. The ones marked "regression" were
/// loaded before import checked them, and each could later crash the core or
/// make it misbehave.
#[test]
fn import_refuses_corrupted_images() {
    type Corrupt = fn(&mut StateImage);
    let cases: &[(&str, Corrupt)] = &[
        ("two holders of one lock share a token", |i| {
            i.locks[1].holders[1].token = tok(4);
        }),
        ("holders of two locks share a token", |i| {
            i.locks[1].holders[1].token = tok(1);
        }),
        ("two waiters share a token", |i| {
            i.locks[0].waiters[1].token = tok(2);
        }),
        (
            "a waiter shares a token with a holder of the same lock",
            |i| {
                i.locks[0].waiters[0].token = tok(1);
            },
        ),
        // Regression: with the waiter's lock first, the holder check missed it.
        (
            "a waiter shares a token with a holder of a later lock",
            |i| {
                i.locks[0].waiters[0].token = tok(5);
            },
        ),
        // The lock table is bulk-loaded from the image, which must be in name order.
        ("locks out of name order", |i| {
            i.locks.swap(0, 1);
        }),
        ("more holders than the limit", |i| {
            i.locks[1].limit = 1;
        }),
        ("two holders share a fence", |i| {
            i.locks[1].holders[1].fence = Fence::new(3).expect("non-zero");
        }),
        ("a fence at or above the next fence", |i| {
            i.next_fence = 5;
        }),
        ("a holder past its lease", |i| {
            i.locks[1].holders[1].lease = LeaseImage::Own {
                ttl_ms: 30,
                deadline_ms: 100,
            };
        }),
        ("a waiter past its wait", |i| {
            i.locks[0].waiters[0].wait_deadline_ms = 100;
        }),
        ("a session past its lease", |i| {
            i.sessions[0].deadline_ms = 100;
        }),
        ("a holder of an unknown session", |i| {
            i.locks[1].holders[0].lease = LeaseImage::Session(sid(2));
        }),
        ("a waiter of an unknown session", |i| {
            i.locks[0].waiters[1].session = Some(sid(2));
        }),
        ("a lock listed twice", |i| {
            let mut again = i.locks[2].clone();
            again.blocked_until_ms = 140;
            i.locks.push(again);
        }),
        ("a session listed twice", |i| {
            let again = i.sessions[0].clone();
            i.sessions.push(again);
        }),
        ("an unused lock record", |i| {
            i.locks[2].blocked_until_ms = 100;
        }),
        ("a free slot while requests are queued", |i| {
            i.locks[0].limit = 2;
        }),
        // Regression: loaded, then `unreachable!` when the waiter was granted.
        ("a waiter with neither a ttl nor a session", |i| {
            i.locks[0].waiters[0].ttl_ms = None;
        }),
        ("a waiter with both a ttl and a session", |i| {
            i.locks[0].waiters[1].ttl_ms = Some(30);
        }),
        // Regression: loaded, then an arithmetic overflow (`now - granted_at`)
        // in `lock()` or when the grant ended.
        ("a holder granted in the future", |i| {
            i.locks[1].holders[1].granted_at_ms = 101;
        }),
        ("a waiter queued in the future", |i| {
            i.locks[0].waiters[0].enqueued_at_ms = 101;
        }),
        // Regression: a lock nobody could ever be granted, its queue stuck.
        ("a limit of 0 with requests queued", |i| {
            i.locks[0].limit = 0;
            i.locks[0].holders.clear();
        }),
        // Regression: the request-id index silently kept only one of them.
        ("a request id used twice on one lock", |i| {
            i.locks[0].waiters[0].request_id = Some(RequestId::new("r1").expect("valid"));
        }),
    ];
    let mut accepted = Vec::new();
    for (what, corrupt) in cases {
        let mut image = busy_image();
        corrupt(&mut image);
        assert_ne!(
            image,
            busy_image(),
            "{what}: the corruption changed nothing"
        );
        match Core::import(config(), image) {
            Ok(_) => accepted.push(*what),
            Err(why) => {
                assert_eq!(
                    why.kind(),
                    fencelock_core::InvariantErrorKind::BadImage,
                    "{what}"
                );
                assert!(
                    !why.message().is_empty(),
                    "{what}: refused without a reason"
                );
            }
        }
    }
    assert!(
        accepted.is_empty(),
        "import accepted corrupted images: {accepted:#?}"
    );
}

/// The same request id on two *different* locks is fine (the key is the pair).
#[test]
fn import_accepts_one_request_id_on_two_locks() {
    let mut image = busy_image();
    image.locks[1].holders[1].request_id = Some(RequestId::new("r1").expect("valid"));
    let core = Core::import(config(), image.clone()).expect("valid image");
    assert_eq!(core.export(), image);
}
