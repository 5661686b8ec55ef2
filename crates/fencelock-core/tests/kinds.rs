//! Reader-writer locks, downgrade, multi-locks and elections: the rules of
//! docs/design.md, one scenario each.

use fencelock_core::{
    Acquire, Command, Config, Core, ErrorKind, EventKind, LockName, Mode, Outcome, Owner,
    OwnerToken, Reply, Value, MAX_NAMES_PER_REQUEST,
};

fn name(s: &str) -> LockName {
    LockName::new(s).expect("valid name")
}

fn tok(t: u128) -> OwnerToken {
    OwnerToken::from_u128(t)
}

fn acquire(lock: &str, t: u128, mode: Mode, wait_ms: u64) -> Acquire {
    Acquire {
        name: name(lock),
        token: tok(t),
        ttl_ms: Some(1000),
        wait_ms,
        owner: Owner::default(),
        request_id: None,
        limit: 1,
        lock_delay_ms: 0,
        session: None,
        tenant: None,
        quota: None,
        mode,
        value: None,
    }
}

fn granted(reply: Result<Reply, fencelock_core::Error>) -> u64 {
    match reply {
        Ok(Reply::Granted(g)) => g.fence.get(),
        other => panic!("expected a grant, got {other:?}"),
    }
}

fn handed_off(core: &mut Core) -> Vec<(u128, u64)> {
    core.take_outcomes()
        .into_iter()
        .flat_map(|o| match o {
            Outcome::Granted(g) => vec![(g.token.as_u128(), g.fence.get())],
            Outcome::GrantedAll(gs) => gs
                .into_iter()
                .map(|g| (g.token.as_u128(), g.fence.get()))
                .collect(),
            _ => Vec::new(),
        })
        .collect()
}

#[test]
fn readers_share_a_queued_writer_blocks_later_readers_and_goes_first() {
    let mut core = Core::new(Config::default());
    let r1 = granted(core.apply(0, Command::Acquire(acquire("rw", 1, Mode::Shared, 0))));
    let r2 = granted(core.apply(0, Command::Acquire(acquire("rw", 2, Mode::Shared, 0))));
    assert!(r2 > r1);
    // A writer queues behind the readers ...
    let w = core.apply(0, Command::Acquire(acquire("rw", 3, Mode::Exclusive, 100)));
    assert!(matches!(w, Ok(Reply::Queued { position: 0, .. })), "{w:?}");
    // ... and a reader arriving after it queues too (no writer starvation) ...
    let r3 = core.apply(0, Command::Acquire(acquire("rw", 4, Mode::Shared, 100)));
    assert!(
        matches!(r3, Ok(Reply::Queued { position: 1, .. })),
        "{r3:?}"
    );
    let r4 = core.apply(0, Command::Acquire(acquire("rw", 5, Mode::Shared, 100)));
    assert!(
        matches!(r4, Ok(Reply::Queued { position: 2, .. })),
        "{r4:?}"
    );
    core.take_outcomes();
    core.apply(
        1,
        Command::Release {
            name: name("rw"),
            token: tok(1),
        },
    )
    .expect("released");
    assert_eq!(handed_off(&mut core), vec![], "one reader still holds");
    core.apply(
        1,
        Command::Release {
            name: name("rw"),
            token: tok(2),
        },
    )
    .expect("released");
    // ... the writer goes first, with a fence above every reader's before it ...
    let writer = handed_off(&mut core);
    assert_eq!(writer.len(), 1);
    assert_eq!(writer[0].0, 3);
    assert!(writer[0].1 > r2);
    // ... and the readers queued behind it are granted together once it leaves.
    core.apply(
        2,
        Command::Release {
            name: name("rw"),
            token: tok(3),
        },
    )
    .expect("released");
    let readers = handed_off(&mut core);
    assert_eq!(readers.iter().map(|g| g.0).collect::<Vec<_>>(), vec![4, 5]);
    assert!(readers[0].1 > writer[0].1 && readers[1].1 > readers[0].1);
    assert_eq!(core.check_invariants(), Ok(()));
}

#[test]
fn a_shared_acquire_on_a_semaphore_admits_at_most_limit_readers() {
    let mut core = Core::new(Config::default());
    let shared = |t| Acquire {
        limit: 2,
        ..acquire("sem", t, Mode::Shared, 0)
    };
    granted(core.apply(0, Command::Acquire(shared(1))));
    granted(core.apply(0, Command::Acquire(shared(2))));
    let third = core.apply(0, Command::Acquire(shared(3)));
    assert_eq!(third.map_err(|e| e.kind()), Err(ErrorKind::Held));
    // On a mutex (limit 1) readers are bounded by `max_limit` instead.
    let mut core = Core::new(Config {
        max_limit: 3,
        ..Config::default()
    });
    for t in 1..=3 {
        granted(core.apply(0, Command::Acquire(acquire("rw", t, Mode::Shared, 0))));
    }
    let fourth = core.apply(0, Command::Acquire(acquire("rw", 4, Mode::Shared, 0)));
    assert_eq!(fourth.map_err(|e| e.kind()), Err(ErrorKind::Held));
}

#[test]
fn downgrade_keeps_the_fence_and_lets_queued_readers_in_but_not_past_a_writer() {
    let mut core = Core::new(Config::default());
    let fence = granted(core.apply(0, Command::Acquire(acquire("d", 1, Mode::Exclusive, 0))));
    for (t, mode) in [
        (2, Mode::Shared),
        (3, Mode::Shared),
        (4, Mode::Exclusive),
        (5, Mode::Shared),
    ] {
        core.apply(0, Command::Acquire(acquire("d", t, mode, 100)))
            .expect("queued");
    }
    core.take_outcomes();
    let reply = core.apply(
        1,
        Command::Downgrade {
            name: name("d"),
            token: tok(1),
        },
    );
    match reply {
        Ok(Reply::Downgraded { grant, downgraded }) => {
            assert!(downgraded);
            assert_eq!(grant.fence.get(), fence);
            assert_eq!(grant.mode, Mode::Shared);
        }
        other => panic!("{other:?}"),
    }
    let outcomes = core.take_outcomes();
    assert!(outcomes
        .iter()
        .any(|o| matches!(o, Outcome::Event(e) if e.kind == EventKind::Downgraded)));
    let granted: Vec<u128> = outcomes
        .iter()
        .filter_map(|o| match o {
            Outcome::Granted(g) => Some(g.token.as_u128()),
            _ => None,
        })
        .collect();
    // The readers right behind join; the writer waits; the reader behind it too.
    assert_eq!(granted, vec![2, 3]);
    let view = core.lock(&name("d")).expect("held");
    assert_eq!(view.holders.len(), 3);
    assert_eq!(view.waiters, 2);
    // Downgrading again changes nothing; an unknown token is not_held.
    let again = core.apply(
        1,
        Command::Downgrade {
            name: name("d"),
            token: tok(1),
        },
    );
    assert!(matches!(
        again,
        Ok(Reply::Downgraded {
            downgraded: false,
            ..
        })
    ));
    let stranger = core.apply(
        1,
        Command::Downgrade {
            name: name("d"),
            token: tok(9),
        },
    );
    assert_eq!(stranger.map_err(|e| e.kind()), Err(ErrorKind::NotHeld));
}

#[test]
fn multi_locks_in_opposite_orders_do_not_deadlock() {
    let mut core = Core::new(Config::default());
    granted(core.apply(0, Command::Acquire(acquire("a", 1, Mode::Exclusive, 0))));
    granted(core.apply(0, Command::Acquire(acquire("b", 2, Mode::Exclusive, 0))));
    let ab = vec![
        acquire("a", 10, Mode::Exclusive, 100),
        acquire("b", 11, Mode::Exclusive, 100),
    ];
    let ba = vec![
        acquire("b", 20, Mode::Exclusive, 100),
        acquire("a", 21, Mode::Exclusive, 100),
    ];
    assert!(matches!(
        core.apply(0, Command::AcquireAll(ab)),
        Ok(Reply::QueuedAll { .. })
    ));
    assert!(matches!(
        core.apply(0, Command::AcquireAll(ba)),
        Ok(Reply::QueuedAll { .. })
    ));
    core.take_outcomes();
    // Freeing `a` grants nothing: the first request also needs `b`. Nothing is
    // granted partly.
    core.apply(
        1,
        Command::Release {
            name: name("a"),
            token: tok(1),
        },
    )
    .expect("released");
    assert_eq!(handed_off(&mut core), vec![]);
    core.apply(
        1,
        Command::Release {
            name: name("b"),
            token: tok(2),
        },
    )
    .expect("released");
    let first = handed_off(&mut core);
    assert_eq!(first.iter().map(|g| g.0).collect::<Vec<_>>(), vec![10, 11]);
    assert!(
        first[1].1 > first[0].1,
        "one fence per name, in the order asked"
    );
    let reply = core.apply(
        2,
        Command::ReleaseAll {
            grants: vec![(name("a"), tok(10)), (name("b"), tok(11))],
        },
    );
    assert_eq!(
        reply,
        Ok(Reply::ReleasedAll {
            released: vec![true, true]
        })
    );
    let second = handed_off(&mut core);
    assert_eq!(second.iter().map(|g| g.0).collect::<Vec<_>>(), vec![20, 21]);
    assert_eq!(core.check_invariants(), Ok(()));
}

#[test]
fn a_multi_lock_that_times_out_leaves_every_queue() {
    let mut core = Core::new(Config::default());
    granted(core.apply(0, Command::Acquire(acquire("a", 1, Mode::Exclusive, 0))));
    let parts = vec![
        acquire("a", 10, Mode::Exclusive, 50),
        acquire("b", 11, Mode::Shared, 50),
    ];
    core.apply(0, Command::AcquireAll(parts)).expect("queued");
    // `b` is free but queued for: a single request on it waits its turn.
    let single = core.apply(0, Command::Acquire(acquire("b", 12, Mode::Exclusive, 0)));
    assert_eq!(single.map_err(|e| e.kind()), Err(ErrorKind::Held));
    core.take_outcomes();
    core.apply(50, Command::Tick).expect("ticked");
    let ended: Vec<u128> = core
        .take_outcomes()
        .into_iter()
        .filter_map(|o| match o {
            Outcome::WaitEnded { token, .. } => Some(token.as_u128()),
            _ => None,
        })
        .collect();
    assert_eq!(ended, vec![10, 11]);
    assert_eq!(core.lock(&name("b")), None);
    granted(core.apply(50, Command::Acquire(acquire("b", 12, Mode::Exclusive, 0))));
}

#[test]
fn bad_multi_lock_requests_are_refused_and_change_nothing() {
    let mut core = Core::new(Config::default());
    let before = core.export();
    let refused = |core: &mut Core, parts: Vec<Acquire>| {
        core.apply(0, Command::AcquireAll(parts))
            .map_err(|e| e.kind())
    };
    assert_eq!(refused(&mut core, vec![]), Err(ErrorKind::InvalidArgument));
    let dup = vec![
        acquire("a", 1, Mode::Exclusive, 0),
        acquire("a", 2, Mode::Shared, 0),
    ];
    assert_eq!(refused(&mut core, dup), Err(ErrorKind::InvalidArgument));
    let many = (0..=MAX_NAMES_PER_REQUEST as u128)
        .map(|i| acquire(&format!("n{i}"), i + 1, Mode::Exclusive, 0))
        .collect();
    assert_eq!(refused(&mut core, many), Err(ErrorKind::InvalidArgument));
    let mut mixed = vec![
        acquire("a", 1, Mode::Exclusive, 0),
        acquire("b", 2, Mode::Exclusive, 0),
    ];
    mixed[1].wait_ms = 5;
    assert_eq!(refused(&mut core, mixed), Err(ErrorKind::InvalidArgument));
    assert_eq!(core.export(), before);
    // All or nothing: one held lock refuses the whole request.
    granted(core.apply(0, Command::Acquire(acquire("b", 9, Mode::Exclusive, 0))));
    let both = vec![
        acquire("a", 1, Mode::Exclusive, 0),
        acquire("b", 2, Mode::Exclusive, 0),
    ];
    assert_eq!(refused(&mut core, both), Err(ErrorKind::Held));
    assert_eq!(core.lock(&name("a")), None);
}

#[test]
fn an_election_leader_proclaims_and_the_next_term_is_larger() {
    let mut core = Core::new(Config::default());
    let campaign = |t: u128, v: &str| Acquire {
        value: Some(Value::new(v).expect("valid")),
        ..acquire("leader", t, Mode::Exclusive, 100)
    };
    let term1 = granted(core.apply(0, Command::Acquire(campaign(1, "host-1"))));
    core.apply(0, Command::Acquire(campaign(2, "host-2")))
        .expect("queued");
    core.take_outcomes();
    let reply = core.apply(
        1,
        Command::Proclaim {
            name: name("leader"),
            token: tok(1),
            value: Value::new("host-1:8080").expect("valid"),
        },
    );
    assert!(
        matches!(reply, Ok(Reply::Proclaimed(ref g)) if g.fence.get() == term1),
        "{reply:?}"
    );
    let proclaimed = core.take_outcomes().into_iter().find_map(|o| match o {
        Outcome::Event(e) if e.kind == EventKind::Proclaimed => e.value,
        _ => None,
    });
    assert_eq!(proclaimed.as_ref().map(Value::as_str), Some("host-1:8080"));
    let view = core.lock(&name("leader")).expect("led");
    assert_eq!(
        view.holders[0].value.as_ref().map(Value::as_str),
        Some("host-1:8080")
    );
    // A follower cannot proclaim; the leader cannot downgrade.
    let follower = core.apply(
        1,
        Command::Proclaim {
            name: name("leader"),
            token: tok(2),
            value: Value::default(),
        },
    );
    assert_eq!(follower.map_err(|e| e.kind()), Err(ErrorKind::NotHeld));
    let down = core.apply(
        1,
        Command::Downgrade {
            name: name("leader"),
            token: tok(1),
        },
    );
    assert_eq!(down.map_err(|e| e.kind()), Err(ErrorKind::InvalidArgument));
    // Resigning hands leadership on, with a larger term and its own value.
    core.apply(
        2,
        Command::Release {
            name: name("leader"),
            token: tok(1),
        },
    )
    .expect("resigned");
    let next = handed_off(&mut core);
    assert_eq!(next[0].0, 2);
    assert!(next[0].1 > term1);
    let view = core.lock(&name("leader")).expect("led");
    assert_eq!(
        view.holders[0].value.as_ref().map(Value::as_str),
        Some("host-2")
    );
    // A value on a shared acquire is refused.
    let shared = Acquire {
        value: Some(Value::default()),
        ..acquire("other", 3, Mode::Shared, 0)
    };
    let refused = core.apply(2, Command::Acquire(shared));
    assert_eq!(
        refused.map_err(|e| e.kind()),
        Err(ErrorKind::InvalidArgument)
    );
}

#[test]
fn images_carry_modes_values_and_multi_lock_queues() {
    let mut core = Core::new(Config::default());
    granted(core.apply(0, Command::Acquire(acquire("a", 1, Mode::Shared, 0))));
    let campaign = Acquire {
        value: Some(Value::new("v").expect("valid")),
        ..acquire("e", 2, Mode::Exclusive, 0)
    };
    granted(core.apply(0, Command::Acquire(campaign)));
    let parts = vec![
        acquire("e", 3, Mode::Exclusive, 100),
        acquire("a", 4, Mode::Shared, 100),
    ];
    core.apply(0, Command::AcquireAll(parts)).expect("queued");
    let image = core.export();
    let copy = Core::import(Config::default(), image.clone()).expect("valid image");
    assert_eq!(copy.export(), image);
    // A multi-lock part missing from one queue is a broken image.
    let mut broken = image.clone();
    for l in &mut broken.locks {
        if l.name == name("a") {
            l.waiters.clear();
        }
    }
    assert!(Core::import(Config::default(), broken).is_err());
    // So is one whose parts disagree on when the wait ends (one request, one wait).
    let mut broken = image.clone();
    for l in &mut broken.locks {
        if l.name == name("a") {
            l.waiters[0].wait_deadline_ms += 1;
        }
    }
    let refused = Core::import(Config::default(), broken).expect_err("refused");
    assert!(refused.message().contains("disagree"), "{refused}");
    // So is a writer next to a reader.
    let mut broken = image;
    let mut writer = broken.locks[0].holders[0].clone();
    writer.token = tok(99);
    writer.fence = fencelock_core::Fence::new(broken.next_fence).expect("non-zero");
    writer.mode = Mode::Exclusive;
    broken.next_fence += 1;
    broken.locks[0].holders.push(writer);
    let refused = Core::import(Config::default(), broken).expect_err("refused");
    assert!(
        refused.message().contains("exclusive holder together"),
        "{refused}"
    );
}
