//! The history checker: overlapping holders, stale writes accepted, fence regressions.
//!
//! It knows only what the histories prove, and reports a violation only when the
//! events *prove* one (so a correct system never fails it, however slow or paused its
//! processes were):
//!
//! - **Overlap.** A grant is *certainly held* from the completion of the acquire that
//!   returned it until the earliest of (a) the invoke of its first release and (b) the
//!   latest `invoke + granted ttl` over the acquire and the renewals that confirmed it.
//!   (b) is a lower bound of the server's expiry: the server starts a lease when it
//!   processes the request, which is after the invoke, on a monotonic clock that does
//!   not run while it is down, and a restart gives every lease its full TTL again. For
//!   an acquire that was retried with the same `request_id`, the invoke of the *first*
//!   attempt counts, since the grant may have been made then. Two grants of one lock
//!   (a mutex) whose certainly-held intervals intersect are a violation: the server
//!   granted the lock while it was still held.
//! - **Stale write accepted.** A write accepted by the resource whose fence is not
//!   greater than that of a write accepted *before it was invoked* (completed earlier).
//!   That is exactly what a fenced resource must refuse.
//! - **Fence regression.** A grant whose acquire was first invoked after another grant
//!   (of any lock: fences are one counter) had completed, with a fence not greater
//!   than that grant's; and two grants (owner tokens) with the same fence.
//!
//! - **Lost grant.** A renewal answered `not_held` while the grant was certainly held
//!   (it completed before the certain end computed from the acquire and the renewals
//!   confirmed before it was invoked, and no release of the grant had been invoked):
//!   the store forgot a grant it had acknowledged — e.g. a new leader without it.
//!
//! Operations whose completion is missing are indeterminate and prove nothing.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use crate::history::{Event, OpKind, Outcome, Phase};

/// The kinds of violation the checker reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ViolationKind {
    /// Two grants of one lock were certainly held at the same time.
    Overlap,
    /// The resource accepted a write whose fence was not newer than one it had
    /// accepted before.
    StaleWriteAccepted,
    /// A later grant got a fence not greater than an earlier one, or a fence was
    /// issued twice.
    FenceRegression,
    /// The store said an acknowledged grant was not held while it certainly was.
    LostGrant,
}

/// One violation, with the events that prove it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// What kind.
    pub kind: ViolationKind,
    /// The evidence, for a human.
    pub message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.kind, self.message)
    }
}

/// What the checker found in a set of histories.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Operations with both events.
    pub operations: usize,
    /// Operations with an invoke and no complete.
    pub indeterminate: usize,
    /// Distinct grants (owner tokens) seen.
    pub grants: usize,
    /// Writes the resource accepted.
    pub writes_accepted: usize,
    /// Writes the resource refused as stale.
    pub writes_refused: usize,
    /// Every violation found (empty for a correct run).
    pub violations: Vec<Violation>,
}

impl Report {
    /// How many violations of `kind` were found.
    pub fn count(&self, kind: ViolationKind) -> usize {
        self.violations.iter().filter(|v| v.kind == kind).count()
    }
}

/// Longest list of violations of one kind kept in a report (the count of a broken run
/// says enough; the first ones say why).
const MAX_VIOLATIONS_PER_KIND: usize = 1000;

/// One operation: its invoke and, if it arrived, its complete.
#[derive(Debug)]
struct Op<'a> {
    invoke: &'a Event,
    complete: Option<&'a Event>,
}

/// A grant, by owner token.
#[derive(Debug)]
struct Grant<'a> {
    lock: &'a str,
    token: &'a str,
    fence: u64,
    worker: u32,
    /// First invoke of the acquire (over retries with the same request id).
    requested_ns: u64,
    /// First completion that returned it.
    granted_ns: u64,
    /// Lower bound of the server's expiry.
    valid_until_ns: u64,
    /// Invoke of its first release.
    released_ns: Option<u64>,
}

impl Grant<'_> {
    fn held_until_ns(&self) -> u64 {
        self.released_ns
            .map_or(self.valid_until_ns, |r| r.min(self.valid_until_ns))
    }
}

/// Checks the events of every worker of one run (in any order).
pub fn check(events: &[Event]) -> Report {
    let mut report = Report::default();
    let ops = pair(events, &mut report);

    // The first invoke of each request id (retries of one acquire share it).
    let mut first_request: HashMap<&str, u64> = HashMap::new();
    for op in ops.iter().filter(|op| op.invoke.kind == OpKind::Acquire) {
        if let Some(rid) = op.invoke.request_id.as_deref() {
            let first = first_request.entry(rid).or_insert(op.invoke.time_ns);
            *first = (*first).min(op.invoke.time_ns);
        }
    }

    let mut grants: BTreeMap<&str, Grant<'_>> = BTreeMap::new();
    for op in &ops {
        let Some(done) = op.complete else { continue };
        if op.invoke.kind != OpKind::Acquire || done.outcome != Some(Outcome::Ok) {
            continue;
        }
        let (Some(token), Some(fence)) = (done.token.as_deref(), done.fence) else {
            continue;
        };
        let requested_ns = op
            .invoke
            .request_id
            .as_deref()
            .and_then(|rid| first_request.get(rid).copied())
            .unwrap_or(op.invoke.time_ns);
        let valid_until_ns = requested_ns + ms_to_ns(done.ttl_ms.unwrap_or(0));
        let grant = grants.entry(token).or_insert(Grant {
            lock: &op.invoke.lock,
            token,
            fence,
            worker: op.invoke.worker,
            requested_ns,
            granted_ns: done.time_ns,
            valid_until_ns,
            released_ns: None,
        });
        grant.requested_ns = grant.requested_ns.min(requested_ns);
        grant.granted_ns = grant.granted_ns.min(done.time_ns);
        grant.valid_until_ns = grant.valid_until_ns.max(valid_until_ns);
    }
    for op in &ops {
        let Some(token) = op.invoke.token.as_deref() else {
            continue;
        };
        let Some(grant) = grants.get_mut(token) else {
            continue;
        };
        match op.invoke.kind {
            OpKind::Renew => {
                if let Some(done) = op.complete {
                    if done.outcome == Some(Outcome::Ok) {
                        let until = op.invoke.time_ns + ms_to_ns(done.ttl_ms.unwrap_or(0));
                        grant.valid_until_ns = grant.valid_until_ns.max(until);
                    }
                }
            }
            OpKind::Release => {
                let at = op.invoke.time_ns;
                grant.released_ns = Some(grant.released_ns.map_or(at, |r| r.min(at)));
            }
            OpKind::Acquire | OpKind::Write => {}
        }
    }
    report.grants = grants.len();
    let grants: Vec<&Grant<'_>> = grants.values().collect();

    check_overlaps(&grants, &mut report);
    check_fences(&grants, &mut report);
    check_writes(&ops, &mut report);
    check_lost(&ops, &grants, &first_request, &mut report);
    report
}

/// Renewals answered `not_held` while their grant was certainly held.
fn check_lost(
    ops: &[Op<'_>],
    grants: &[&Grant<'_>],
    first_request: &HashMap<&str, u64>,
    report: &mut Report,
) {
    let by_token: HashMap<&str, &Grant<'_>> = grants.iter().map(|g| (g.token, *g)).collect();
    // Per token: the acquires' lower bounds, confirmed renewals (complete, bound) and
    // the first release invoke.
    let mut acquired: HashMap<&str, u64> = HashMap::new();
    let mut renewed: HashMap<&str, Vec<(u64, u64)>> = HashMap::new();
    for op in ops {
        let Some(done) = op.complete else { continue };
        if done.outcome != Some(Outcome::Ok) {
            continue;
        }
        match op.invoke.kind {
            OpKind::Acquire => {
                if let Some(token) = done.token.as_deref() {
                    let requested = op
                        .invoke
                        .request_id
                        .as_deref()
                        .and_then(|rid| first_request.get(rid).copied())
                        .unwrap_or(op.invoke.time_ns);
                    let until = requested + ms_to_ns(done.ttl_ms.unwrap_or(0));
                    let bound = acquired.entry(token).or_insert(until);
                    *bound = (*bound).max(until);
                }
            }
            OpKind::Renew => {
                if let Some(token) = op.invoke.token.as_deref() {
                    let until = op.invoke.time_ns + ms_to_ns(done.ttl_ms.unwrap_or(0));
                    renewed
                        .entry(token)
                        .or_default()
                        .push((done.time_ns, until));
                }
            }
            OpKind::Release | OpKind::Write => {}
        }
    }
    for op in ops.iter().filter(|op| op.invoke.kind == OpKind::Renew) {
        let Some(done) = op.complete else { continue };
        if done.outcome != Some(Outcome::NotHeld) {
            continue;
        }
        let Some(token) = op.invoke.token.as_deref() else {
            continue;
        };
        let (Some(grant), Some(&acquired_until)) = (by_token.get(token), acquired.get(token))
        else {
            continue;
        };
        if grant.released_ns.is_some_and(|r| r < op.invoke.time_ns) {
            continue;
        }
        let certain_until = renewed
            .get(token)
            .into_iter()
            .flatten()
            .filter(|(complete, _)| *complete < op.invoke.time_ns)
            .map(|(_, until)| *until)
            .fold(acquired_until, u64::max);
        if done.time_ns < certain_until {
            let message = format!(
                "{}: a renewal invoked at {} ns was answered not_held at {} ns, before {} ns",
                describe(grant),
                op.invoke.time_ns,
                done.time_ns,
                certain_until
            );
            push(report, ViolationKind::LostGrant, message);
        }
    }
}

fn ms_to_ns(ms: u64) -> u64 {
    ms.saturating_mul(1_000_000)
}

/// Pairs invokes with completes; counts operations.
fn pair<'a>(events: &'a [Event], report: &mut Report) -> Vec<Op<'a>> {
    let mut by_key: HashMap<(u32, u64), Op<'a>> = HashMap::new();
    let mut completes = Vec::new();
    for event in events {
        match event.phase {
            Phase::Invoke => {
                by_key.insert(
                    (event.worker, event.op),
                    Op {
                        invoke: event,
                        complete: None,
                    },
                );
            }
            Phase::Complete => completes.push(event),
        }
    }
    for event in completes {
        if let Some(op) = by_key.get_mut(&(event.worker, event.op)) {
            op.complete = Some(event);
        }
    }
    let mut ops: Vec<Op<'a>> = by_key.into_values().collect();
    ops.sort_by_key(|op| (op.invoke.time_ns, op.invoke.worker, op.invoke.op));
    report.operations = ops.iter().filter(|op| op.complete.is_some()).count();
    report.indeterminate = ops.len() - report.operations;
    ops
}

fn push(report: &mut Report, kind: ViolationKind, message: String) {
    if report.count(kind) < MAX_VIOLATIONS_PER_KIND {
        report.violations.push(Violation { kind, message });
    }
}

fn describe(g: &Grant<'_>) -> String {
    format!(
        "grant fence {} of {:?} to worker {} (token {}, granted at {} ns, certainly held until {} ns)",
        g.fence,
        g.lock,
        g.worker,
        g.token,
        g.granted_ns,
        g.held_until_ns()
    )
}

fn check_overlaps(grants: &[&Grant<'_>], report: &mut Report) {
    let mut by_lock: BTreeMap<&str, Vec<&Grant<'_>>> = BTreeMap::new();
    for g in grants {
        if g.granted_ns < g.held_until_ns() {
            by_lock.entry(g.lock).or_default().push(g);
        }
    }
    for list in by_lock.values_mut() {
        list.sort_by_key(|g| g.granted_ns);
        // The grant whose certainly-held interval reaches furthest so far.
        let mut reach: Option<&Grant<'_>> = None;
        for g in list.iter() {
            if let Some(r) = reach {
                if g.granted_ns < r.held_until_ns() {
                    let message = format!("{} overlaps {}", describe(g), describe(r));
                    push(report, ViolationKind::Overlap, message);
                }
            }
            if reach.is_none_or(|r| g.held_until_ns() > r.held_until_ns()) {
                reach = Some(g);
            }
        }
    }
}

fn check_fences(grants: &[&Grant<'_>], report: &mut Report) {
    let mut by_fence: HashMap<u64, &Grant<'_>> = HashMap::new();
    for g in grants {
        if let Some(other) = by_fence.insert(g.fence, g) {
            let message = format!("fence reused: {} and {}", describe(g), describe(other));
            push(report, ViolationKind::FenceRegression, message);
        }
    }
    let mut by_granted: Vec<&Grant<'_>> = grants.to_vec();
    by_granted.sort_by_key(|g| g.granted_ns);
    // prefix_max[i]: the grant with the largest fence among by_granted[..=i].
    let mut prefix_max: Vec<&Grant<'_>> = Vec::with_capacity(by_granted.len());
    for g in &by_granted {
        let best = match prefix_max.last() {
            Some(b) if b.fence >= g.fence => *b,
            _ => *g,
        };
        prefix_max.push(best);
    }
    for g in grants {
        // Grants that had completed before this one was first requested.
        let before = by_granted.partition_point(|a| a.granted_ns < g.requested_ns);
        if before == 0 {
            continue;
        }
        let max = prefix_max[before - 1];
        if g.fence <= max.fence {
            let message = format!(
                "{} was requested at {} ns, after {}, but has a fence not greater",
                describe(g),
                g.requested_ns,
                describe(max)
            );
            push(report, ViolationKind::FenceRegression, message);
        }
    }
}

fn check_writes(ops: &[Op<'_>], report: &mut Report) {
    // Accepted writes by resource (lock), as (invoke, complete, fence, worker).
    let mut accepted: BTreeMap<&str, Vec<(u64, u64, u64, u32)>> = BTreeMap::new();
    for op in ops.iter().filter(|op| op.invoke.kind == OpKind::Write) {
        let Some(done) = op.complete else { continue };
        match done.outcome {
            Some(Outcome::Accepted) => {
                report.writes_accepted += 1;
                if let Some(fence) = op.invoke.fence {
                    accepted.entry(&op.invoke.lock).or_default().push((
                        op.invoke.time_ns,
                        done.time_ns,
                        fence,
                        op.invoke.worker,
                    ));
                }
            }
            Some(Outcome::Refused) => report.writes_refused += 1,
            _ => {}
        }
    }
    for (lock, writes) in &accepted {
        let mut by_complete = writes.clone();
        by_complete.sort_by_key(|w| w.1);
        let mut prefix_max = Vec::with_capacity(by_complete.len());
        for w in &by_complete {
            let best = match prefix_max.last() {
                Some(b) if fence_of(b) >= w.2 => *b,
                _ => *w,
            };
            prefix_max.push(best);
        }
        for &(invoke_ns, complete_ns, fence, worker) in writes {
            let before = by_complete.partition_point(|w| w.1 < invoke_ns);
            if before == 0 {
                continue;
            }
            let max = prefix_max[before - 1];
            if fence <= max.2 {
                let message = format!(
                    "resource of {lock:?}: write with fence {fence} by worker {worker} \
                     (invoked {invoke_ns} ns, accepted {complete_ns} ns) after the write with \
                     fence {} by worker {} had been accepted at {} ns",
                    max.2, max.3, max.1
                );
                push(report, ViolationKind::StaleWriteAccepted, message);
            }
        }
    }
}

fn fence_of(w: &(u64, u64, u64, u32)) -> u64 {
    w.2
}

#[cfg(test)]
// The history builders take an event's fields positionally, like a table row.
#[allow(clippy::too_many_arguments)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// Builds histories op by op; times in milliseconds.
    #[derive(Default)]
    struct History {
        events: Vec<Event>,
        next_op: u64,
    }

    impl History {
        fn op(
            &mut self,
            worker: u32,
            kind: OpKind,
            lock: &str,
            t0: u64,
            t1: Option<u64>,
        ) -> (Event, Option<Event>) {
            let op = self.next_op;
            self.next_op += 1;
            let invoke = Event::new(worker, op, kind, Phase::Invoke, t0 * MS, lock);
            let complete =
                t1.map(|t1| Event::new(worker, op, kind, Phase::Complete, t1 * MS, lock));
            (invoke, complete)
        }

        fn push(&mut self, (invoke, complete): (Event, Option<Event>)) {
            self.events.push(invoke);
            self.events.extend(complete);
        }

        /// A successful acquire that returned (fence, token) with lease `ttl` ms.
        fn acquire(
            &mut self,
            w: u32,
            lock: &str,
            rid: &str,
            t0: u64,
            t1: u64,
            fence: u64,
            token: &str,
            ttl: u64,
        ) {
            let (mut i, mut c) = self.op(w, OpKind::Acquire, lock, t0, Some(t1));
            i.request_id = Some(rid.into());
            i.ttl_ms = Some(ttl);
            let c_ref = c.as_mut().unwrap();
            c_ref.outcome = Some(Outcome::Ok);
            c_ref.fence = Some(fence);
            c_ref.token = Some(token.into());
            c_ref.ttl_ms = Some(ttl);
            self.push((i, c));
        }

        /// An acquire attempt that failed (server unreachable).
        fn acquire_failed(&mut self, w: u32, lock: &str, rid: &str, t0: u64, t1: u64) {
            let (mut i, mut c) = self.op(w, OpKind::Acquire, lock, t0, Some(t1));
            i.request_id = Some(rid.into());
            c.as_mut().unwrap().outcome = Some(Outcome::Failed);
            self.push((i, c));
        }

        fn on_grant(
            &mut self,
            kind: OpKind,
            w: u32,
            lock: &str,
            fence: u64,
            token: &str,
            t0: u64,
            t1: Option<u64>,
            outcome: Outcome,
        ) -> Option<&mut Event> {
            let (mut i, mut c) = self.op(w, kind, lock, t0, t1);
            i.fence = Some(fence);
            i.token = Some(token.into());
            if let Some(c) = c.as_mut() {
                c.outcome = Some(outcome);
            }
            self.push((i, c));
            let last = self.events.last_mut().unwrap();
            (last.phase == Phase::Complete).then_some(last)
        }

        fn renew(
            &mut self,
            w: u32,
            lock: &str,
            fence: u64,
            token: &str,
            t0: u64,
            t1: u64,
            ttl: u64,
        ) {
            let c = self.on_grant(
                OpKind::Renew,
                w,
                lock,
                fence,
                token,
                t0,
                Some(t1),
                Outcome::Ok,
            );
            c.unwrap().ttl_ms = Some(ttl);
        }

        fn release(&mut self, w: u32, lock: &str, fence: u64, token: &str, t0: u64, t1: u64) {
            self.on_grant(
                OpKind::Release,
                w,
                lock,
                fence,
                token,
                t0,
                Some(t1),
                Outcome::Ok,
            );
        }

        fn write(
            &mut self,
            w: u32,
            lock: &str,
            fence: u64,
            token: &str,
            t0: u64,
            t1: Option<u64>,
            outcome: Outcome,
        ) {
            self.on_grant(OpKind::Write, w, lock, fence, token, t0, t1, outcome);
        }

        fn check(&self) -> Report {
            check(&self.events)
        }
    }

    fn kinds(report: &Report) -> Vec<ViolationKind> {
        report.violations.iter().map(|v| v.kind).collect()
    }

    /// Two holders one after the other, the second waiting in the queue meanwhile.
    fn clean() -> History {
        let mut h = History::default();
        h.acquire(1, "l", "r1", 0, 1, 10, "a", 1000);
        h.write(1, "l", 10, "a", 10, Some(11), Outcome::Accepted);
        h.acquire(2, "l", "r2", 5, 22, 11, "b", 1000);
        h.release(1, "l", 10, "a", 20, 21);
        h.write(2, "l", 11, "b", 30, Some(31), Outcome::Accepted);
        h.release(2, "l", 11, "b", 40, 41);
        h
    }

    #[test]
    fn a_correct_history_has_no_violations() {
        let report = clean().check();
        assert_eq!(report.violations, vec![], "{report:?}");
        assert_eq!((report.operations, report.grants), (6, 2));
        assert_eq!((report.writes_accepted, report.writes_refused), (2, 0));
    }

    /// The paused holder: its lease ran out, another holder wrote, its late write is
    /// refused. Nothing wrong; the refusal is counted.
    fn paused_holder(outcome: Outcome) -> History {
        let mut h = History::default();
        h.acquire(1, "l", "r1", 0, 1, 10, "a", 100);
        h.renew(1, "l", 10, "a", 30, 31, 100);
        // Worker 1 is stopped at 40 ms; its lease ends no earlier than 130 ms.
        h.acquire(2, "l", "r2", 50, 140, 11, "b", 100);
        h.write(2, "l", 11, "b", 150, Some(151), Outcome::Accepted);
        // Worker 1 wakes up and writes with its old fence.
        h.write(1, "l", 10, "a", 300, Some(301), outcome);
        h
    }

    #[test]
    fn a_paused_holder_refused_is_no_violation() {
        let report = paused_holder(Outcome::Refused).check();
        assert_eq!(report.violations, vec![], "{report:?}");
        assert_eq!((report.writes_accepted, report.writes_refused), (1, 1));
    }

    #[test]
    fn planted_stale_write_accepted_is_reported() {
        let report = paused_holder(Outcome::Accepted).check();
        assert_eq!(
            kinds(&report),
            vec![ViolationKind::StaleWriteAccepted],
            "{report:?}"
        );
        assert!(
            report.violations[0]
                .message
                .contains("fence 10 by worker 1"),
            "{report:?}"
        );
    }

    #[test]
    fn planted_equal_fence_written_twice_is_a_stale_write() {
        let mut h = History::default();
        h.acquire(1, "l", "r1", 0, 1, 10, "a", 1000);
        h.write(1, "l", 10, "a", 10, Some(11), Outcome::Accepted);
        h.write(1, "l", 10, "a", 20, Some(21), Outcome::Accepted);
        assert_eq!(kinds(&h.check()), vec![ViolationKind::StaleWriteAccepted]);
    }

    #[test]
    fn concurrent_writes_prove_no_order() {
        // The older fence's write was invoked before the newer one completed: the
        // resource may have applied them in either order.
        let mut h = History::default();
        h.write(1, "l", 11, "b", 10, Some(20), Outcome::Accepted);
        h.write(2, "l", 10, "a", 15, Some(25), Outcome::Accepted);
        assert_eq!(h.check().violations, vec![]);
    }

    #[test]
    fn a_write_without_completion_proves_nothing() {
        let mut h = paused_holder(Outcome::Refused);
        h.write(3, "l", 9, "z", 400, None, Outcome::Accepted);
        let report = h.check();
        assert_eq!(report.violations, vec![]);
        assert_eq!(report.indeterminate, 1);
    }

    #[test]
    fn planted_overlap_is_reported() {
        let mut h = History::default();
        h.acquire(1, "l", "r1", 0, 1, 10, "a", 1000);
        h.write(1, "l", 10, "a", 10, Some(11), Outcome::Accepted);
        // Granted while "a" is certainly held (until 1000 ms, never released).
        h.acquire(2, "l", "r2", 100, 101, 11, "b", 1000);
        h.write(2, "l", 11, "b", 110, Some(111), Outcome::Accepted);
        let report = h.check();
        assert_eq!(kinds(&report), vec![ViolationKind::Overlap], "{report:?}");
        assert!(
            report.violations[0].message.contains("fence 11"),
            "{report:?}"
        );
    }

    #[test]
    fn overlap_is_judged_per_lock() {
        let mut h = History::default();
        h.acquire(1, "x", "r1", 0, 1, 10, "a", 1000);
        h.acquire(2, "y", "r2", 100, 101, 11, "b", 1000);
        assert_eq!(h.check().violations, vec![]);
    }

    #[test]
    fn a_confirmed_renewal_extends_the_certain_interval() {
        let base = |second_at: u64| {
            let mut h = History::default();
            h.acquire(1, "l", "r1", 0, 1, 10, "a", 100);
            // Renewed at 60 ms for 100 ms: held until at least 160 ms.
            h.renew(1, "l", 10, "a", 60, 61, 100);
            h.acquire(2, "l", "r2", 100, second_at, 11, "b", 1000);
            h.check()
        };
        assert_eq!(kinds(&base(150)), vec![ViolationKind::Overlap]);
        assert_eq!(base(170).violations, vec![]);
    }

    #[test]
    fn planted_lost_grant_is_reported() {
        let mut h = History::default();
        h.acquire(1, "l", "r1", 0, 1, 10, "a", 1000);
        h.renew(1, "l", 10, "a", 300, 301, 1000);
        // Certainly held until 1300 ms, yet the store denies it at 400 ms.
        h.on_grant(
            OpKind::Renew,
            1,
            "l",
            10,
            "a",
            399,
            Some(400),
            Outcome::NotHeld,
        );
        assert_eq!(kinds(&h.check()), vec![ViolationKind::LostGrant]);
        // The same answer after the certain end is an expiry, not a loss.
        let mut h = History::default();
        h.acquire(1, "l", "r1", 0, 1, 10, "a", 1000);
        h.on_grant(
            OpKind::Renew,
            1,
            "l",
            10,
            "a",
            1200,
            Some(1201),
            Outcome::NotHeld,
        );
        assert_eq!(h.check().violations, vec![]);
        // And after a release was invoked it is the release's doing.
        let mut h = History::default();
        h.acquire(1, "l", "r1", 0, 1, 10, "a", 1000);
        h.release(1, "l", 10, "a", 50, 60);
        h.on_grant(
            OpKind::Renew,
            1,
            "l",
            10,
            "a",
            70,
            Some(71),
            Outcome::NotHeld,
        );
        assert_eq!(h.check().violations, vec![]);
    }

    #[test]
    fn a_release_ends_the_certain_interval_at_its_invoke() {
        let mut h = History::default();
        h.acquire(1, "l", "r1", 0, 1, 10, "a", 1000);
        h.release(1, "l", 10, "a", 50, 70);
        h.acquire(2, "l", "r2", 40, 60, 11, "b", 1000);
        assert_eq!(h.check().violations, vec![]);
    }

    #[test]
    fn planted_fence_regression_is_reported() {
        let mut h = History::default();
        h.acquire(1, "l", "r1", 0, 1, 10, "a", 1000);
        h.release(1, "l", 10, "a", 10, 11);
        // Requested after fence 10 was granted, yet gets fence 9 (a lost counter).
        h.acquire(2, "l", "r2", 20, 21, 9, "b", 1000);
        let report = h.check();
        assert_eq!(
            kinds(&report),
            vec![ViolationKind::FenceRegression],
            "{report:?}"
        );
    }

    #[test]
    fn planted_fence_reuse_is_reported() {
        let mut h = History::default();
        h.acquire(1, "x", "r1", 0, 1, 10, "a", 1000);
        h.acquire(2, "y", "r2", 0, 1, 10, "b", 1000);
        assert_eq!(kinds(&h.check()), vec![ViolationKind::FenceRegression]);
    }

    #[test]
    fn a_retried_acquire_counts_from_its_first_attempt() {
        // Worker 2's first attempt may have been granted at once (fence 10) with the
        // answer lost; its retry returns that grant after worker 1 got fence 11 on
        // another lock. Not a regression.
        let mut h = History::default();
        h.acquire_failed(2, "x", "r2", 0, 3);
        h.acquire(1, "y", "r1", 1, 2, 11, "a", 1000);
        h.acquire(2, "x", "r2", 5, 6, 10, "b", 1000);
        assert_eq!(h.check().violations, vec![]);
        // The same without the shared request id is a regression.
        let mut h = History::default();
        h.acquire_failed(2, "x", "r2", 0, 3);
        h.acquire(1, "y", "r1", 1, 2, 11, "a", 1000);
        h.acquire(2, "x", "r3", 5, 6, 10, "b", 1000);
        assert_eq!(kinds(&h.check()), vec![ViolationKind::FenceRegression]);
    }

    #[test]
    fn the_same_grant_returned_twice_is_one_grant() {
        let mut h = History::default();
        h.acquire(1, "l", "r1", 0, 1, 10, "a", 1000);
        h.acquire(1, "l", "r1", 2, 3, 10, "a", 1000);
        let report = h.check();
        assert_eq!(report.violations, vec![]);
        assert_eq!(report.grants, 1);
    }

    #[test]
    fn histories_round_trip_through_the_file_format() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w1.jsonl");
        let writer = crate::history::HistoryWriter::open(&path, 1).unwrap();
        let op = writer.invoke(OpKind::Write, "l", |e| e.fence = Some(3));
        writer.complete(op, OpKind::Write, "l", Outcome::Refused, |_| {});
        // A torn last line (killed mid-write) is skipped.
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .and_then(|mut f| std::io::Write::write_all(&mut f, b"{\"worker\":1,\"op"))
            .unwrap();
        let events = crate::history::read_dir(dir.path()).unwrap();
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].fence, Some(3));
        assert_eq!(events[1].outcome, Some(Outcome::Refused));
        assert!(events[0].time_ns <= events[1].time_ns);
    }
}
