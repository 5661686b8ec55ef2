//! Readable scenarios of the lock semantics (docs/design.md §2), one `check()` per step.
//!
//! `check(core, at_ms, command, expect)` applies `command` at service time `at_ms`
//! and compares a one-line rendering of the reply, followed by one `-> …` line per
//! outcome a client is waiting for (hand-off grants and wait ends; watcher events
//! are left out), with `expect`.

use fencelock_core::{
    Acquire, Command, Config, Core, Fence, LockName, Outcome, Owner, OwnerToken, Reason, Reply,
    RequestId, SessionId,
};

fn name(s: &str) -> LockName {
    LockName::new(s).expect("valid name")
}

fn tok(t: u128) -> OwnerToken {
    OwnerToken::from_u128(t)
}

fn sid(s: u128) -> SessionId {
    SessionId::from_u128(s)
}

fn render_grant(verb: &str, g: &fencelock_core::Grant) -> String {
    let mut s = format!(
        "{verb} {} fence={} t{} ttl={}",
        g.name,
        g.fence,
        g.token.as_u128(),
        g.ttl_ms
    );
    if let Some(id) = g.session {
        s += &format!(" s{}", id.as_u128());
    }
    s
}

fn render(reply: &Result<Reply, fencelock_core::Error>, outcomes: &[Outcome]) -> String {
    let mut lines = vec![match reply {
        Err(e) => format!("error {}", e.kind().code()),
        Ok(Reply::Granted(g)) => render_grant("granted", g),
        Ok(Reply::Renewed(g)) => render_grant("renewed", g),
        Ok(Reply::Queued { token, position }) => {
            format!("queued t{} position={position}", token.as_u128())
        }
        Ok(Reply::Released { released }) => format!("released={released}"),
        Ok(Reply::ForceReleased { fences }) => {
            let fences: Vec<u64> = fences.iter().map(|f| f.get()).collect();
            format!("force-released fences={fences:?}")
        }
        Ok(Reply::WaitCancelled { cancelled }) => format!("cancelled={cancelled}"),
        Ok(Reply::SessionOpened { id, ttl_ms }) => {
            format!("session-opened s{} ttl={ttl_ms}", id.as_u128())
        }
        Ok(Reply::KeptAlive { ttl_ms }) => format!("kept-alive ttl={ttl_ms}"),
        Ok(Reply::SessionClosed { released }) => format!("session-closed released={released}"),
        Ok(Reply::Ticked) => "ticked".into(),
        Ok(Reply::Recovered) => "recovered".into(),
        Ok(Reply::Promoted) => "promoted".into(),
        Ok(Reply::FenceFloorRaised { next_fence }) => format!("next-fence={next_fence}"),
        Ok(Reply::GrantedAll(grants)) => {
            let grants: Vec<String> = grants.iter().map(|g| render_grant("", g)).collect();
            format!("granted-all [{}]", grants.join(";"))
        }
        Ok(Reply::QueuedAll { tokens }) => {
            let tokens: Vec<String> = tokens.iter().map(|t| format!("t{}", t.as_u128())).collect();
            format!("queued-all {}", tokens.join(" "))
        }
        Ok(Reply::Downgraded { grant, downgraded }) => {
            format!("{} downgraded={downgraded}", render_grant("shared", grant))
        }
        Ok(Reply::Proclaimed(g)) => render_grant("proclaimed", g),
        Ok(Reply::ReleasedAll { released }) => format!("released-all {released:?}"),
    }];
    for o in outcomes {
        match o {
            Outcome::Granted(g) => lines.push(render_grant("-> granted", g)),
            Outcome::GrantedAll(grants) => {
                for g in grants {
                    lines.push(render_grant("-> granted-all", g));
                }
            }
            Outcome::WaitEnded {
                token,
                name,
                reason,
            } => lines.push(format!(
                "-> wait-ended {name} t{} {reason:?}",
                token.as_u128()
            )),
            Outcome::Event(_) => {}
        }
    }
    lines.join("\n")
}

/// Applies `command` at `at_ms`; the rendered reply and outcomes must equal `expect`
/// (compared line by line, surrounding whitespace ignored).
#[track_caller]
fn check(core: &mut Core, at_ms: u64, command: impl Into<Command>, expect: &str) {
    let command = command.into();
    let reply = core.apply(at_ms, command.clone());
    let got = render(&reply, &core.take_outcomes());
    let want: Vec<&str> = expect.trim().lines().map(str::trim).collect();
    assert_eq!(
        got.lines().collect::<Vec<_>>(),
        want,
        "\n at {at_ms} ms: {command:?}\n got:\n{got}\n"
    );
    if let Err(broken) = core.check_invariants() {
        panic!("invariant broken after {command:?}: {broken}");
    }
}

// --- Command builders -------------------------------------------------------------

/// `acquire("a", 1)`: a mutex, own lease of 1000 ms, no wait; adjust with methods.
fn acquire(lock: &str, token: u128) -> Acq {
    Acq(Acquire {
        name: name(lock),
        token: tok(token),
        ttl_ms: Some(1000),
        wait_ms: 0,
        owner: Owner::new(&format!("t{token}")).expect("valid owner"),
        request_id: None,
        limit: 1,
        lock_delay_ms: 0,
        session: None,
        tenant: None,
        quota: None,
        mode: fencelock_core::Mode::Exclusive,
        value: None,
    })
}

struct Acq(Acquire);

impl Acq {
    fn ttl(mut self, ttl_ms: u64) -> Acq {
        self.0.ttl_ms = Some(ttl_ms);
        self
    }
    fn wait(mut self, wait_ms: u64) -> Acq {
        self.0.wait_ms = wait_ms;
        self
    }
    fn limit(mut self, limit: u32) -> Acq {
        self.0.limit = limit;
        self
    }
    fn delay(mut self, lock_delay_ms: u64) -> Acq {
        self.0.lock_delay_ms = lock_delay_ms;
        self
    }
    fn request_id(mut self, id: &str) -> Acq {
        self.0.request_id = Some(RequestId::new(id).expect("valid request id"));
        self
    }
    /// Hold under session `s` (and so without a lease of its own).
    fn session(mut self, s: u128) -> Acq {
        self.0.session = Some(sid(s));
        self.0.ttl_ms = None;
        self
    }
    /// Both a ttl and a session (invalid).
    fn session_and_ttl(mut self, s: u128) -> Acq {
        self.0.session = Some(sid(s));
        self
    }
}

impl From<Acq> for Command {
    fn from(a: Acq) -> Command {
        Command::Acquire(a.0)
    }
}

fn release(lock: &str, token: u128) -> Command {
    Command::Release {
        name: name(lock),
        token: tok(token),
    }
}

fn renew(lock: &str, token: u128) -> Command {
    Command::Renew {
        name: name(lock),
        token: tok(token),
        ttl_ms: None,
    }
}

/// Renew with a new lease length.
fn renew_ttl(lock: &str, token: u128, ttl_ms: u64) -> Command {
    Command::Renew {
        name: name(lock),
        token: tok(token),
        ttl_ms: Some(ttl_ms),
    }
}

fn cancel_wait(lock: &str, token: u128) -> Command {
    Command::CancelWait {
        name: name(lock),
        token: tok(token),
    }
}

fn force_release(lock: &str, fence: Option<u64>) -> Command {
    Command::ForceRelease {
        name: name(lock),
        fence: fence.and_then(Fence::new),
        reason: Reason::new("operator: stuck job").expect("valid reason"),
    }
}

fn open_session(s: u128, ttl_ms: u64) -> Command {
    Command::OpenSession {
        id: sid(s),
        ttl_ms,
        owner: Owner::new(&format!("s{s}")).expect("valid owner"),
        tenant: None,
        quota: None,
    }
}

fn core() -> Core {
    Core::new(Config::default())
}

/// Holders (fences) and queue length of a lock, or `None` if it has no record.
fn holders(core: &Core, lock: &str) -> Option<(Vec<u64>, usize)> {
    core.lock(&name(lock))
        .map(|v| (v.holders.iter().map(|h| h.fence.get()).collect(), v.waiters))
}

// --- Scenarios --------------------------------------------------------------------

#[rustfmt::skip]
#[test]
fn fifty_waiters_are_granted_in_fifo_order_one_hand_off_per_release() {
    let mut c = core();
    check(&mut c, 0, acquire("a", 100), "granted a fence=1 t100 ttl=1000");
    for t in 1..=50 {
        check(&mut c, t as u64, acquire("a", t).wait(100_000), &format!("queued t{t} position={}", t - 1));
    }
    // Each release hands the lock to exactly the next waiter, with the next fence.
    check(&mut c, 60, release("a", 100), "released=true\n-> granted a fence=2 t1 ttl=1000");
    for t in 1..50u128 {
        let next = format!("released=true\n-> granted a fence={} t{} ttl=1000", t + 2, t + 1);
        check(&mut c, 60 + t as u64, release("a", t), &next);
        assert_eq!(holders(&c, "a"), Some((vec![t as u64 + 2], 49 - t as usize)));
    }
    check(&mut c, 200, release("a", 50), "released=true");
    assert_eq!(holders(&c, "a"), None, "an unused lock leaves no record");
}

#[rustfmt::skip]
#[test]
fn a_semaphore_admits_limit_holders_each_with_its_own_fence() {
    let mut c = core();
    check(&mut c, 0, acquire("b", 1).limit(3), "granted b fence=1 t1 ttl=1000");
    check(&mut c, 0, acquire("b", 2).limit(3), "granted b fence=2 t2 ttl=1000");
    check(&mut c, 0, acquire("b", 3).limit(3), "granted b fence=3 t3 ttl=1000");
    check(&mut c, 0, acquire("b", 4).limit(3), "error held");
    check(&mut c, 0, acquire("b", 4).limit(2), "error limit_mismatch");
    check(&mut c, 0, acquire("b", 4).limit(3).wait(50), "queued t4 position=0");
    check(&mut c, 10, release("b", 2), "released=true\n-> granted b fence=4 t4 ttl=1000");
    assert_eq!(holders(&c, "b"), Some((vec![1, 3, 4], 0)));
}

#[rustfmt::skip]
#[test]
fn lock_delay_follows_expiry_and_forced_release_but_not_clean_release() {
    let mut c = core();
    // Expiry at 100 blocks the lock until 150 (deadlines are exclusive).
    check(&mut c, 0, acquire("a", 1).ttl(100).delay(50), "granted a fence=1 t1 ttl=100");
    check(&mut c, 99, acquire("a", 2), "error held");
    check(&mut c, 100, acquire("a", 2), "error held");
    check(&mut c, 100, renew("a", 1), "error expired");
    check(&mut c, 149, acquire("a", 2), "error held");
    check(&mut c, 150, acquire("a", 2), "granted a fence=2 t2 ttl=1000");

    // Waiters queued before or during the delay are granted when it ends, not at
    // the expiry. (The delay counts from when the expiry is processed: the driver
    // ticks at 100.)
    let mut c = core();
    check(&mut c, 0, acquire("a", 1).ttl(100).delay(50), "granted a fence=1 t1 ttl=100");
    check(&mut c, 10, acquire("a", 2).wait(200), "queued t2 position=0");
    check(&mut c, 100, Command::Tick, "ticked");
    check(&mut c, 120, acquire("a", 3).wait(100), "queued t3 position=1");
    check(&mut c, 149, Command::Tick, "ticked");
    check(&mut c, 150, Command::Tick, "ticked\n-> granted a fence=2 t2 ttl=1000");

    // Forced release: delayed too.
    let mut c = core();
    check(&mut c, 0, acquire("a", 1).delay(50), "granted a fence=1 t1 ttl=1000");
    check(&mut c, 10, force_release("a", None), "force-released fences=[1]");
    check(&mut c, 59, acquire("a", 2), "error held");
    check(&mut c, 60, acquire("a", 2), "granted a fence=2 t2 ttl=1000");

    // Clean release: free at once.
    let mut c = core();
    check(&mut c, 0, acquire("a", 1).delay(50), "granted a fence=1 t1 ttl=1000");
    check(&mut c, 10, release("a", 1), "released=true");
    check(&mut c, 10, acquire("a", 2), "granted a fence=2 t2 ttl=1000");
}

#[rustfmt::skip]
#[test]
fn session_expiry_releases_all_its_locks_and_drops_its_waiters() {
    let mut c = core();
    check(&mut c, 0, open_session(1, 100), "session-opened s1 ttl=100");
    check(&mut c, 0, acquire("a", 1).session(1), "granted a fence=1 t1 ttl=100 s1");
    check(&mut c, 0, acquire("b", 2).session(1).delay(30), "granted b fence=2 t2 ttl=100 s1");
    check(&mut c, 0, acquire("c", 9), "granted c fence=3 t9 ttl=1000");
    check(&mut c, 0, acquire("c", 3).session(1).wait(500), "queued t3 position=0");
    check(&mut c, 0, acquire("a", 4).wait(500), "queued t4 position=0");
    // A renew of a session-held lock is a keepalive of the session.
    check(&mut c, 50, renew("a", 1), "renewed a fence=1 t1 ttl=100 s1");
    check(&mut c, 149, Command::Tick, "ticked");
    check(&mut c, 150, Command::Tick, "
        ticked
        -> wait-ended c t3 SessionEnded
        -> granted a fence=4 t4 ttl=1000");
    check(&mut c, 150, renew("b", 2), "error expired");
    check(&mut c, 150, Command::KeepAlive { id: sid(1) }, "error session_not_found");
    check(&mut c, 150, acquire("d", 5).session(1), "error session_not_found");
    // `b` expired with lock-delay 30, so it stays unavailable until 180.
    check(&mut c, 150, acquire("b", 6), "error held");
    check(&mut c, 180, acquire("b", 6), "granted b fence=5 t6 ttl=1000");
    assert_eq!(holders(&c, "c"), Some((vec![3], 0)));
}

#[rustfmt::skip]
#[test]
fn closing_a_session_releases_cleanly_without_lock_delay() {
    let mut c = core();
    check(&mut c, 0, open_session(1, 100), "session-opened s1 ttl=100");
    check(&mut c, 0, acquire("a", 1).session(1).delay(30), "granted a fence=1 t1 ttl=100 s1");
    check(&mut c, 0, acquire("a", 2).wait(100), "queued t2 position=0");
    check(&mut c, 10, Command::CloseSession { id: sid(1) }, "session-closed released=1\n-> granted a fence=2 t2 ttl=1000");
}

#[rustfmt::skip]
#[test]
fn a_retried_acquire_with_the_same_request_id_gets_the_same_grant() {
    let mut c = core();
    check(&mut c, 0, acquire("a", 1).request_id("job-7"), "granted a fence=1 t1 ttl=1000");
    // The retry carries a fresh token (the server draws one per request).
    check(&mut c, 5, acquire("a", 2).request_id("job-7"), "granted a fence=1 t1 ttl=1000");
    check(&mut c, 5, acquire("a", 3).request_id("other"), "error held");
    // A queued request is found again too.
    check(&mut c, 6, acquire("a", 4).request_id("job-8").wait(100), "queued t4 position=0");
    check(&mut c, 7, acquire("a", 5).request_id("job-8").wait(100), "queued t4 position=0");
    // Once released, the id is free again: a new grant with a new fence.
    check(&mut c, 8, release("a", 1), "released=true\n-> granted a fence=2 t4 ttl=1000");
    check(&mut c, 8, acquire("a", 5).request_id("job-8"), "granted a fence=2 t4 ttl=1000");
    check(&mut c, 9, release("a", 4), "released=true");
    check(&mut c, 9, acquire("a", 6).request_id("job-7"), "granted a fence=3 t6 ttl=1000");
}

#[rustfmt::skip]
#[test]
fn release_is_idempotent_and_says_why_it_did_nothing() {
    let mut c = core();
    check(&mut c, 0, acquire("a", 1), "granted a fence=1 t1 ttl=1000");
    check(&mut c, 1, release("a", 1), "released=true");
    check(&mut c, 2, release("a", 1), "released=false");
    check(&mut c, 2, release("a", 99), "error not_held");
    check(&mut c, 2, renew("a", 1), "error not_held");
    // Regression: endings were remembered per token only, so a token that had
    // released lock a answered "already released" for lock b too.
    check(&mut c, 3, release("b", 1), "error not_held");
}

#[rustfmt::skip]
#[test]
fn renew_and_release_after_expiry_answer_expired() {
    let mut c = core();
    check(&mut c, 0, acquire("a", 1).ttl(100), "granted a fence=1 t1 ttl=100");
    // Each renew restarts the full ttl from now: 99 -> ends at 199, 198 -> 298.
    check(&mut c, 99, renew("a", 1), "renewed a fence=1 t1 ttl=100");
    check(&mut c, 198, renew("a", 1), "renewed a fence=1 t1 ttl=100");
    // Deadlines are exclusive: at 298 the lease is over.
    check(&mut c, 298, renew("a", 1), "error expired");
    check(&mut c, 298, release("a", 1), "error expired");
    // The same token on another lock never held it: not_held, not expired.
    check(&mut c, 298, renew("b", 1), "error not_held");
}

#[rustfmt::skip]
#[test]
fn renew_can_change_the_lease_length() {
    let mut c = core();
    check(&mut c, 0, acquire("a", 1).ttl(100), "granted a fence=1 t1 ttl=100");
    check(&mut c, 50, renew_ttl("a", 1, 500), "renewed a fence=1 t1 ttl=500");
    check(&mut c, 549, Command::Tick, "ticked");
    check(&mut c, 549, renew_ttl("a", 1, 0), "error invalid_argument");
    check(&mut c, 549, renew("a", 1), "renewed a fence=1 t1 ttl=500");
}

#[rustfmt::skip]
#[test]
fn a_release_with_a_stale_token_never_touches_the_current_holder() {
    let mut c = core();
    check(&mut c, 0, acquire("a", 1).ttl(100), "granted a fence=1 t1 ttl=100");
    check(&mut c, 100, acquire("a", 2), "granted a fence=2 t2 ttl=1000");
    check(&mut c, 110, release("a", 1), "error expired");
    check(&mut c, 110, renew("a", 1), "error expired");
    check(&mut c, 110, cancel_wait("a", 1), "cancelled=false");
    assert_eq!(holders(&c, "a"), Some((vec![2], 0)));
    check(&mut c, 120, renew("a", 2), "renewed a fence=2 t2 ttl=1000");
    // A forced release of a stale fence does not touch it either.
    check(&mut c, 120, force_release("a", Some(1)), "error not_held");
    check(&mut c, 120, force_release("a", Some(2)), "force-released fences=[2]");
}

#[rustfmt::skip]
#[test]
fn a_waiter_is_never_granted_at_or_after_its_wait_deadline() {
    let mut c = core();
    check(&mut c, 0, acquire("a", 1).ttl(100), "granted a fence=1 t1 ttl=100");
    check(&mut c, 50, acquire("a", 2).wait(50), "queued t2 position=0");
    check(&mut c, 60, acquire("a", 3).wait(200), "queued t3 position=1");
    // The lease and t2's wait both end at 100: t2 leaves, t3 gets the lock.
    check(&mut c, 100, Command::Tick, "
        ticked
        -> wait-ended a t2 TimedOut
        -> granted a fence=2 t3 ttl=1000");
}

#[rustfmt::skip]
#[test]
fn cancel_wait_removes_a_queued_request() {
    let mut c = core();
    check(&mut c, 0, acquire("a", 1), "granted a fence=1 t1 ttl=1000");
    check(&mut c, 0, acquire("a", 2).wait(100), "queued t2 position=0");
    check(&mut c, 0, acquire("a", 3).wait(100), "queued t3 position=1");
    check(&mut c, 1, cancel_wait("a", 2), "cancelled=true\n-> wait-ended a t2 Cancelled");
    check(&mut c, 1, cancel_wait("a", 2), "cancelled=false");
    check(&mut c, 2, release("a", 1), "released=true\n-> granted a fence=2 t3 ttl=1000");
}

#[rustfmt::skip]
#[test]
fn promote_gives_every_lease_a_fresh_full_ttl_and_keeps_the_queue() {
    let mut c = core();
    check(&mut c, 0, open_session(1, 100), "session-opened s1 ttl=100");
    check(&mut c, 0, acquire("a", 1).ttl(100), "granted a fence=1 t1 ttl=100");
    check(&mut c, 0, acquire("b", 2).session(1), "granted b fence=2 t2 ttl=100 s1");
    check(&mut c, 0, acquire("a", 3).wait(1000), "queued t3 position=0");
    check(&mut c, 90, Command::Promote, "promoted");
    let view = c.lock(&name("a")).expect("held");
    assert_eq!((view.waiters, view.holders[0].ttl_remaining_ms), (1, 100));
    // Both leases now end at 190 instead of 100; the queued request then gets `a`.
    check(&mut c, 189, Command::Tick, "ticked");
    assert_eq!(c.stats().holders, 2);
    check(&mut c, 190, Command::Tick, "ticked\n-> granted a fence=3 t3 ttl=1000");
    assert_eq!(c.stats().holders, 1);
}

#[rustfmt::skip]
#[test]
fn views_at_a_later_time_count_to_it_without_expiring_anything() {
    let mut c = core();
    check(&mut c, 100, open_session(1, 500), "session-opened s1 ttl=500");
    check(&mut c, 100, acquire("a", 1).ttl(1000), "granted a fence=1 t1 ttl=1000");
    check(&mut c, 200, acquire("b", 2).delay(300), "granted b fence=2 t2 ttl=1000");
    check(&mut c, 250, force_release("b", None), "force-released fences=[2]");
    // A reader at 700 whose core last applied a command at 250 (a cluster member
    // between commands): held and left count to 700, not to 250.
    let a = c.lock_at(&name("a"), 700).expect("held");
    assert_eq!((a.holders[0].held_ms, a.holders[0].ttl_remaining_ms), (600, 400));
    assert_eq!(c.locks_at("", None, 10, 700)[0], a);
    assert_eq!(c.lock_at(&name("b"), 500).expect("in lock-delay").lock_delay_remaining_ms, 50);
    assert_eq!(c.session_at(sid(1), 550).expect("open").ttl_remaining_ms, 50);
    // Past the deadline: 0 left, still shown (expiry takes a command); never
    // earlier than the last command's time.
    let late = c.lock_at(&name("a"), 5_000).expect("not expired by a read");
    assert_eq!((late.holders[0].held_ms, late.holders[0].ttl_remaining_ms), (4_900, 0));
    assert_eq!(c.lock_at(&name("a"), 0), c.lock(&name("a")));
    assert_eq!(c.lock(&name("a")).expect("held").holders[0].held_ms, 150);
    assert_eq!(c.stats().holders, 1);
}

#[rustfmt::skip]
#[test]
fn recover_gives_every_lease_a_fresh_full_ttl_and_drops_waiters() {
    let mut c = core();
    check(&mut c, 0, open_session(1, 100), "session-opened s1 ttl=100");
    check(&mut c, 0, acquire("a", 1).ttl(100), "granted a fence=1 t1 ttl=100");
    check(&mut c, 0, acquire("b", 2).session(1), "granted b fence=2 t2 ttl=100 s1");
    check(&mut c, 0, acquire("a", 3).wait(1000), "queued t3 position=0");
    check(&mut c, 90, Command::Recover, "recovered\n-> wait-ended a t3 ServerRestarted");
    let view = c.lock(&name("a")).expect("held");
    assert_eq!((view.waiters, view.holders[0].ttl_remaining_ms), (0, 100));
    // Both leases now end at 190 instead of 100.
    check(&mut c, 189, Command::Tick, "ticked");
    assert_eq!(c.stats().holders, 2);
    check(&mut c, 190, Command::Tick, "ticked");
    assert_eq!(c.stats().holders, 0);
}

#[rustfmt::skip]
#[test]
fn raising_the_fence_floor_makes_the_next_fence_at_least_the_floor() {
    let mut c = core();
    check(&mut c, 0, acquire("a", 1), "granted a fence=1 t1 ttl=1000");
    check(&mut c, 0, Command::RaiseFenceFloor { floor: 1000 }, "next-fence=1000");
    check(&mut c, 0, acquire("b", 2), "granted b fence=1000 t2 ttl=1000");
    // Never lowers it.
    check(&mut c, 0, Command::RaiseFenceFloor { floor: 5 }, "next-fence=1001");
    check(&mut c, 0, acquire("c", 3), "granted c fence=1001 t3 ttl=1000");
    // Regression: a floor near u64::MAX let a later hand-off panic on an exhausted
    // fence counter. Floors above 2^63 are refused and change nothing.
    let too_high = fencelock_core::MAX_FENCE_FLOOR + 1;
    check(&mut c, 0, Command::RaiseFenceFloor { floor: too_high }, "error invalid_argument");
    check(&mut c, 0, acquire("d", 4), "granted d fence=1002 t4 ttl=1000");
}

#[rustfmt::skip]
#[test]
fn bounds_and_bad_arguments_give_the_right_error_kind() {
    let config = Config {
        min_ttl_ms: 10,
        max_ttl_ms: 10_000,
        max_wait_ms: 5_000,
        max_lock_delay_ms: 1_000,
        max_limit: 4,
        max_locks: 3,
        max_waiters_per_lock: 2,
        max_waiters: 3,
        max_sessions: 2,
        max_locks_per_session: 1,
        ..Config::default()
    };
    let mut c = Core::new(config);
    // Setup: `a` held with 2 waiters (its queue is full), `b` held, session s1
    // holding `c` (so no more locks may be created and s1 is at its bound).
    check(&mut c, 0, acquire("a", 1), "granted a fence=1 t1 ttl=1000");
    check(&mut c, 0, acquire("a", 2).wait(100), "queued t2 position=0");
    check(&mut c, 0, acquire("a", 3).wait(100), "queued t3 position=1");
    check(&mut c, 0, acquire("b", 4), "granted b fence=2 t4 ttl=1000");
    check(&mut c, 0, open_session(1, 1000), "session-opened s1 ttl=1000");
    check(&mut c, 0, acquire("c", 5).session(1), "granted c fence=3 t5 ttl=1000 s1");
    check(&mut c, 0, open_session(2, 1000), "session-opened s2 ttl=1000");

    let neither = Acquire {
        ttl_ms: None,
        ..acquire("b", 9).0
    };
    let cases: Vec<(&str, &str, Command)> = vec![
        ("invalid_argument",   "ttl 0",                  acquire("b", 9).ttl(0).into()),
        ("invalid_argument",   "ttl below the minimum",  acquire("b", 9).ttl(9).into()),
        ("invalid_argument",   "ttl too large",          acquire("b", 9).ttl(10_001).into()),
        ("invalid_argument",   "limit 0",                acquire("b", 9).limit(0).into()),
        ("invalid_argument",   "limit above max_limit",  acquire("b", 9).limit(5).into()),
        ("invalid_argument",   "wait too long",          acquire("b", 9).wait(5_001).into()),
        ("invalid_argument",   "lock-delay too long",    acquire("b", 9).delay(1_001).into()),
        ("invalid_argument",   "ttl and session",        acquire("b", 9).session_and_ttl(2).into()),
        ("invalid_argument",   "neither ttl nor session", Command::Acquire(neither)),
        ("invalid_argument",   "token already in use",   acquire("b", 1).into()),
        ("limit_mismatch",     "another limit",          acquire("b", 9).limit(2).into()),
        ("held",               "held, no wait",          acquire("b", 9).into()),
        ("session_not_found",  "unknown session",        acquire("b", 9).session(7).into()),
        ("resource_exhausted", "max_waiters_per_lock",   acquire("a", 9).wait(100).into()),
        ("resource_exhausted", "max_locks",              acquire("d", 9).into()),
        ("resource_exhausted", "max_locks_per_session",  acquire("b", 9).session(1).wait(100).into()),
        ("resource_exhausted", "max_sessions",           open_session(3, 1000)),
        ("invalid_argument",   "session ttl 0",          open_session(3, 0)),
        ("invalid_argument",   "session id in use",      open_session(1, 1000)),
        ("invalid_argument",   "renew ttl too large",    renew_ttl("b", 4, 10_001)),
        ("invalid_argument",   "renew session lock with a ttl", renew_ttl("c", 5, 100)),
        ("not_held",           "renew by a non-holder",  renew("b", 9)),
        ("not_held",           "release by a waiter",    release("a", 2)),
        ("not_held",           "force-release free lock", force_release("d", None)),
        ("session_not_found",  "keepalive unknown session", Command::KeepAlive { id: sid(7) }),
        ("session_not_found",  "close unknown session",  Command::CloseSession { id: sid(7) }),
    ];
    let before = c.export();
    for (code, what, command) in cases {
        let got = c.apply(1, command).map_err(|e| e.kind().code());
        assert_eq!(got, Err(code), "{what}");
        assert!(
            c.take_outcomes().is_empty(),
            "{what}: an error produced outcomes"
        );
    }
    let mut after = c.export();
    after.now_ms = before.now_ms;
    assert_eq!(after, before, "an error changed the state");
}

/// A lock's view lists its first waiters in queue order with how long each has
/// waited, bounded by `MAX_VIEW_WAITERS`; listing many locks leaves them out.
#[test]
fn a_lock_view_lists_its_first_waiters_in_queue_order() {
    use fencelock_core::MAX_VIEW_WAITERS;
    let mut c = Core::new(Config::default());
    c.apply(0, acquire("a", 1).ttl(60_000).into()).unwrap();
    let queued = MAX_VIEW_WAITERS as u128 + 5;
    for t in 0..queued {
        c.apply(10 + t as u64, acquire("a", 100 + t).wait(60_000).into())
            .unwrap();
    }
    let view = c.lock_at(&name("a"), 1_000).expect("a exists");
    assert_eq!(view.waiters, queued as usize);
    assert_eq!(view.waiting.len(), MAX_VIEW_WAITERS);
    for (i, w) in view.waiting.iter().enumerate() {
        assert_eq!(w.position, i);
        assert_eq!(w.owner.as_str(), format!("t{}", 100 + i));
        assert_eq!(w.waiting_ms, 1_000 - 10 - i as u64);
    }
    let listed = c.locks("", None, 10);
    assert_eq!(listed.len(), 1);
    assert!(listed[0].waiting.is_empty(), "{listed:?}");
}
