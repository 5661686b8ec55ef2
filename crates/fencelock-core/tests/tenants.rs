//! Sessions owned by the principal that opened them, and per-principal quotas
//! (issue 19 items 2, 3, 7): checked through `Core::apply` like a client would.

use crate::common;

use common::{name, owner_of, sid, tok};
use fencelock_core::{
    Acquire, Command, Config, Core, ErrorKind, Owner, Quota, Reply, SessionId, Tenant,
};
use proptest::prelude::*;

fn tenant(t: &str) -> Tenant {
    Tenant::new(t).expect("valid principal")
}

const QUOTA: Quota = Quota {
    max_sessions: 2,
    max_held_locks: 3,
    max_waiters: 2,
};

fn acquire(lock: &str, t: u128, who: &str, session: Option<SessionId>, wait_ms: u64) -> Command {
    Command::Acquire(Acquire {
        name: name(lock),
        token: tok(t),
        ttl_ms: session.is_none().then_some(1000),
        wait_ms,
        owner: owner_of(tok(t)),
        request_id: None,
        limit: 1,
        lock_delay_ms: 0,
        session,
        tenant: Some(tenant(who)),
        quota: Some(QUOTA),
        mode: fencelock_core::Mode::Exclusive,
        value: None,
    })
}

fn open(id: u128, who: &str) -> Command {
    Command::OpenSession {
        id: sid(id),
        ttl_ms: 1000,
        owner: Owner::default(),
        tenant: Some(tenant(who)),
        quota: Some(QUOTA),
    }
}

fn kind(r: Result<Reply, fencelock_core::Error>) -> Result<Reply, ErrorKind> {
    r.map_err(|e| e.kind())
}

/// Regression for issue 19 item 3: principal `c` attached a lock to `a`'s session.
/// A session answers another principal exactly like a missing one.
#[test]
fn only_the_opener_attaches_locks_to_a_session() {
    let mut core = Core::new(Config::default());
    core.apply(0, open(1, "a")).expect("opens");
    let before = core.export();
    let err = core
        .apply(1, acquire("c:evil", 1, "c", Some(sid(1)), 0))
        .expect_err("not c's session");
    assert_eq!(err.kind(), ErrorKind::SessionNotFound);
    let missing = core
        .apply(1, acquire("c:evil", 1, "c", Some(sid(9)), 0))
        .expect_err("no such session");
    assert_eq!(
        err.message().replace(&sid(1).to_string(), "ID"),
        missing.message().replace(&sid(9).to_string(), "ID")
    );
    assert_eq!(
        core.export().locks,
        before.locks,
        "the refusal changed nothing"
    );
    assert!(matches!(
        kind(core.apply(2, acquire("a:1", 2, "a", Some(sid(1)), 0))),
        Ok(Reply::Granted(_))
    ));
    let view = core.session(sid(1)).expect("open");
    assert_eq!(view.tenant, Some(tenant("a")));
    assert_eq!(view.holding, vec![name("a:1")]);
}

/// Regression for issue 19 item 2: one principal filled the session table.
#[test]
fn sessions_stop_at_the_principals_quota_and_others_still_open() {
    let mut core = Core::new(Config::default());
    core.apply(0, open(1, "a")).expect("first");
    core.apply(0, open(2, "a")).expect("second");
    let err = core.apply(0, open(3, "a")).expect_err("over quota");
    assert_eq!(err.kind(), ErrorKind::QuotaExceeded);
    assert!(err.message().contains("max_sessions"), "{err}");
    core.apply(0, open(4, "b")).expect("b has its own quota");
    core.apply(1, Command::CloseSession { id: sid(1) })
        .expect("closes");
    core.apply(1, open(3, "a"))
        .expect("room again after a close");
    assert_eq!(core.usage(&tenant("a")), (2, 0, 0));
    // Expiry frees the quota too.
    core.apply(2000, Command::Tick).expect("tick");
    assert_eq!(core.usage(&tenant("a")), (0, 0, 0));
    core.check_invariants().expect("consistent");
}

/// Regression for issue 19 item 7: one principal filled the lock table. Queued
/// requests count against `max_held_locks` as well, so hand-offs never take a
/// principal over it.
#[test]
fn held_locks_and_waiters_stop_at_the_quota_and_hand_offs_stay_within_it() {
    let mut core = Core::new(Config::default());
    // b holds x and y; a queues for both, then takes one lock directly.
    core.apply(0, acquire("x", 100, "b", None, 0)).expect("b x");
    core.apply(0, acquire("y", 101, "b", None, 0)).expect("b y");
    assert!(matches!(
        kind(core.apply(0, acquire("x", 1, "a", None, 500))),
        Ok(Reply::Queued { .. })
    ));
    assert!(matches!(
        kind(core.apply(0, acquire("y", 2, "a", None, 500))),
        Ok(Reply::Queued { .. })
    ));
    assert!(matches!(
        kind(core.apply(0, acquire("z", 3, "a", None, 0))),
        Ok(Reply::Granted(_))
    ));
    assert_eq!(core.usage(&tenant("a")), (0, 1, 2));
    // held 1 + waiting 2 = max_held_locks 3: neither a grant nor a wait.
    let err = core
        .apply(0, acquire("w", 4, "a", None, 0))
        .expect_err("over");
    assert_eq!(err.kind(), ErrorKind::QuotaExceeded);
    assert!(err.message().contains("max_held_locks"), "{err}");
    let before = core.export();
    assert_eq!(
        core.apply(0, acquire("x", 5, "a", None, 500))
            .map_err(|e| e.kind()),
        Err(ErrorKind::QuotaExceeded)
    );
    assert_eq!(core.export(), before, "a refusal changes nothing");
    // b is untouched by a's quota.
    core.apply(0, acquire("w", 102, "b", None, 0))
        .expect("b still acquires");
    // Hand-offs: b releases; a gets both, at exactly its quota.
    core.apply(
        1,
        Command::Release {
            name: name("x"),
            token: tok(100),
        },
    )
    .expect("release");
    core.apply(
        1,
        Command::Release {
            name: name("y"),
            token: tok(101),
        },
    )
    .expect("release");
    assert_eq!(core.usage(&tenant("a")), (0, 3, 0));
    core.check_invariants().expect("consistent");
    // Every lease ends: usage goes back to nothing.
    core.apply(5000, Command::Tick).expect("tick");
    assert_eq!(core.usage(&tenant("a")), (0, 0, 0));
}

#[test]
fn waiters_stop_at_their_own_quota() {
    let mut core = Core::new(Config::default());
    let quota = Quota {
        max_waiters: 1,
        ..QUOTA
    };
    for (i, lock) in ["x", "y"].iter().enumerate() {
        core.apply(0, acquire(lock, 100 + i as u128, "b", None, 0))
            .expect("b holds");
    }
    let queue = |lock: &str, t: u128| {
        let Command::Acquire(mut a) = acquire(lock, t, "a", None, 500) else {
            unreachable!()
        };
        a.quota = Some(quota);
        Command::Acquire(a)
    };
    core.apply(0, queue("x", 1)).expect("queued");
    let err = core.apply(0, queue("y", 2)).expect_err("second wait");
    assert_eq!(err.kind(), ErrorKind::QuotaExceeded);
    assert!(err.message().contains("max_waiters"), "{err}");
}

/// Usage is rebuilt from a snapshot image, and an old-format session (no recorded
/// principal) is owned by nobody: no principal may attach to it.
#[test]
fn usage_and_owners_survive_export_and_import() {
    let mut core = Core::new(Config::default());
    core.apply(0, open(1, "a")).expect("opens");
    core.apply(0, acquire("a:1", 1, "a", Some(sid(1)), 0))
        .expect("attach");
    core.apply(0, acquire("a:2", 2, "a", None, 0))
        .expect("own lease");
    core.apply(
        0,
        Command::OpenSession {
            id: sid(2),
            ttl_ms: 1000,
            owner: Owner::default(),
            tenant: None,
            quota: None,
        },
    )
    .expect("old-style session");
    let copy = Core::import(Config::default(), core.export()).expect("imports");
    assert_eq!(copy.usage(&tenant("a")), (1, 2, 0));
    assert_eq!(copy.export(), core.export());
    let mut copy = copy;
    let err = copy
        .apply(1, acquire("a:3", 3, "a", Some(sid(2)), 0))
        .expect_err("nobody's");
    assert_eq!(err.kind(), ErrorKind::SessionNotFound);
}

#[derive(Debug, Clone)]
enum Step {
    Acquire {
        lock: usize,
        t: u128,
        who: usize,
        session: Option<u128>,
        wait_ms: u64,
    },
    Release {
        lock: usize,
        t: u128,
    },
    Open {
        id: u128,
        who: usize,
    },
    Close {
        id: u128,
    },
    Cancel {
        lock: usize,
        t: u128,
    },
    Recover,
    Wait {
        ms: u64,
    },
}

const LOCKS: [&str; 4] = ["p", "q", "r", "s"];
const WHO: [&str; 3] = ["a", "b", "c"];

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (0..4usize, 1u128..=12, 0..3usize, prop::option::of(1u128..=4), prop_oneof![Just(0u64), 5u64..=50])
            .prop_map(|(lock, t, who, session, wait_ms)| Step::Acquire { lock, t, who, session, wait_ms }),
        3 => (0..4usize, 1u128..=12).prop_map(|(lock, t)| Step::Release { lock, t }),
        2 => (1u128..=4, 0..3usize).prop_map(|(id, who)| Step::Open { id, who }),
        1 => (1u128..=4).prop_map(|id| Step::Close { id }),
        1 => (0..4usize, 1u128..=12).prop_map(|(lock, t)| Step::Cancel { lock, t }),
        1 => Just(Step::Recover),
        3 => (1u64..=40).prop_map(|ms| Step::Wait { ms }),
    ]
}

proptest! {
    /// Random traffic of three principals with small quotas: the usage counts stay
    /// in step with the tables (`check_invariants` recounts them), no principal ever
    /// exceeds a quota, and a snapshot restores the same usage.
    #[test]
    fn usage_stays_in_step_and_within_quota(steps in prop::collection::vec(step(), 1..120)) {
        let config = Config { min_ttl_ms: 1, ..Config::default() };
        let mut core = Core::new(config.clone());
        let mut now = 0;
        for s in steps {
            let command = match s {
                Step::Acquire { lock, t, who, session, wait_ms } => Command::Acquire(Acquire {
                    name: name(LOCKS[lock]),
                    token: tok(t),
                    ttl_ms: session.is_none().then_some(30),
                    wait_ms,
                    owner: owner_of(tok(t)),
                    request_id: None,
                    limit: 1,
                    lock_delay_ms: 0,
                    session: session.map(sid),
                    tenant: Some(tenant(WHO[who])),
                    quota: Some(QUOTA),
                    mode: fencelock_core::Mode::Exclusive,
                    value: None,
                }),
                Step::Release { lock, t } => Command::Release { name: name(LOCKS[lock]), token: tok(t) },
                Step::Open { id, who } => Command::OpenSession {
                    id: sid(id), ttl_ms: 25, owner: Owner::default(),
                    tenant: Some(tenant(WHO[who])), quota: Some(QUOTA),
                },
                Step::Close { id } => Command::CloseSession { id: sid(id) },
                Step::Cancel { lock, t } => Command::CancelWait { name: name(LOCKS[lock]), token: tok(t) },
                Step::Recover => Command::Recover,
                Step::Wait { ms } => { now += ms; Command::Tick }
            };
            let _ = core.apply(now, command);
            core.discard_outcomes();
            prop_assert_eq!(core.check_invariants(), Ok(()));
            for who in WHO {
                let (sessions, held, waiting) = core.usage(&tenant(who));
                prop_assert!(sessions <= u64::from(QUOTA.max_sessions));
                prop_assert!(held + waiting <= u64::from(QUOTA.max_held_locks));
                prop_assert!(waiting <= u64::from(QUOTA.max_waiters));
            }
        }
        let copy = Core::import(config, core.export()).expect("imports");
        for who in WHO {
            prop_assert_eq!(copy.usage(&tenant(who)), core.usage(&tenant(who)));
        }
    }
}
