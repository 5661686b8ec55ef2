//! The invariant checker: a model of what must hold, kept from what the server and
//! the resource did, independent of the core's own bookkeeping.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

use fencelock_core::{
    Command, Core, Error as CoreError, EventKind, Grant, LockName, Mode, Outcome, Owner,
    OwnerToken, Reply, SessionId, Value,
};

/// The invariants the simulation checks on every step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Invariant {
    /// Per the server's state, a lock has more holders than its limit.
    HolderLimit,
    /// Fences of acknowledged grants are not strictly increasing per lock, or a fence
    /// was handed out twice (also across restarts).
    FenceOrder,
    /// The resource accepted a write whose fence is not newer than one it accepted.
    StaleWriteAccepted,
    /// A queued request was granted out of FIFO order, or a request barged past the
    /// queue.
    FifoOrder,
    /// A queued request was granted after its wait or its session was over.
    ExpiredWaiterGranted,
    /// An acknowledged grant is missing after a restart, or the fence counter came
    /// back at or below an acknowledged fence.
    AckedGrantLost,
    /// More clients believed (by their own conservative deadline) they held a lock
    /// than its limit allows.
    MutualExclusion,
    /// After the quiet tail a lease is still held, a request still queued, or a
    /// client still busy: something never freed.
    Liveness,
    /// A multi-lock request was granted on some of its locks without the others.
    MultiLock,
    /// An election term was given to two leaders or did not increase, or a client
    /// saw the term go back or a value its term's leader never published.
    ElectionTerm,
    /// After the quiet tail a multi-lock request is still neither granted nor
    /// ended.
    Deadlock,
    /// The run panicked (a broken assertion inside the core or the harness).
    Panic,
}

impl fmt::Display for Invariant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Invariant::HolderLimit => "holder-limit",
            Invariant::FenceOrder => "fence-order",
            Invariant::StaleWriteAccepted => "stale-write-accepted",
            Invariant::FifoOrder => "fifo-order",
            Invariant::ExpiredWaiterGranted => "expired-waiter-granted",
            Invariant::AckedGrantLost => "acked-grant-lost",
            Invariant::MutualExclusion => "mutual-exclusion",
            Invariant::Liveness => "liveness",
            Invariant::MultiLock => "multi-lock-all-or-nothing",
            Invariant::ElectionTerm => "election-term",
            Invariant::Deadlock => "deadlock",
            Invariant::Panic => "panic",
        };
        f.write_str(s)
    }
}

/// The first broken invariant of a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// Which invariant.
    pub invariant: Invariant,
    /// Virtual time (ms since the start of the run).
    pub at_ms: u64,
    /// What was seen.
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} at {} ms: {}",
            self.invariant, self.at_ms, self.detail
        )
    }
}

/// A queued request as the checker saw it: its token, the service time its wait
/// ends (exclusive), and its session.
type Queued = (OwnerToken, u64, Option<SessionId>);

#[derive(Debug, Default)]
pub(crate) struct Checker {
    /// Virtual time of the step being checked.
    pub(crate) at_ms: u64,
    limits: BTreeMap<LockName, u32>,
    /// Server view (from events): fences held per lock, this server lifetime.
    live: BTreeMap<LockName, BTreeMap<u64, Mode>>,
    /// Highest fence granted in this server lifetime.
    last_granted: u64,
    /// Queued requests per lock, FIFO, this server lifetime.
    queues: BTreeMap<LockName, VecDeque<Queued>>,
    /// Sessions and the service time their lease ends (exclusive).
    sessions: BTreeMap<SessionId, u64>,
    /// Fences whose grant ended in a command not yet synced, with that command's
    /// record number.
    unsynced_ended: Vec<(u64, u64)>,
    /// Fences whose grant ended in a synced command.
    durable_ended: BTreeSet<u64>,
    /// Every acknowledged grant: fence → (lock, token).
    acked: BTreeMap<u64, (LockName, OwnerToken)>,
    /// Acknowledged grants not durably ended: these must survive a crash.
    acked_open: BTreeMap<u64, LockName>,
    /// Highest acknowledged fence per lock.
    acked_max: BTreeMap<LockName, u64>,
    /// Last accepted fence per resource key.
    resource_last: BTreeMap<String, u64>,
    /// Queued multi-lock requests, this server lifetime: each part's token → every
    /// part's token, in the order asked.
    groups: BTreeMap<OwnerToken, Vec<OwnerToken>>,
    /// The election's lock, if the run has one.
    election: Option<LockName>,
    /// The last term (a leader's fence) granted, this server lifetime.
    last_term: u64,
    /// Every term's leader (by owner), this server lifetime.
    leaders: BTreeMap<u64, Owner>,
    /// The values published (campaigned or proclaimed with) in each term, over the
    /// run: a term lost in a crash before it was durable may be granted again,
    /// and a client may only ever be shown one of these.
    published: BTreeMap<u64, BTreeSet<String>>,
    /// The highest term each client has seen in a leader answer.
    observed: BTreeMap<usize, u64>,
    pub(crate) violation: Option<Violation>,
}

impl Checker {
    pub(crate) fn new(limits: BTreeMap<LockName, u32>, election: Option<LockName>) -> Checker {
        Checker {
            limits,
            election,
            ..Checker::default()
        }
    }

    /// Multi-lock requests queued and neither granted nor ended (each by its tokens).
    pub(crate) fn open_multi_requests(&self) -> BTreeSet<Vec<OwnerToken>> {
        self.groups.values().cloned().collect()
    }

    /// A leader grant: at most one leader per term, terms strictly increasing.
    fn on_leader(&mut self, term: u64, owner: &Owner, value: Option<&Value>) {
        if term <= self.last_term {
            let detail = format!("leader term {term} granted after term {}", self.last_term);
            self.fail(Invariant::ElectionTerm, detail);
        }
        self.last_term = self.last_term.max(term);
        let leader = self.leaders.entry(term).or_insert_with(|| owner.clone());
        if leader != owner {
            let detail = format!("term {term} led by {owner:?} after {leader:?}");
            self.fail(Invariant::ElectionTerm, detail);
        }
        self.publish(term, value);
    }

    fn publish(&mut self, term: u64, value: Option<&Value>) {
        let values = self.published.entry(term).or_default();
        values.extend(value.map(|v| v.as_str().to_owned()));
    }

    /// A client was told who leads: terms it sees never go back, and the value is
    /// one that term's leader published (campaigned or proclaimed with).
    pub(crate) fn on_observed(&mut self, client: usize, term: Option<u64>, value: Option<&Value>) {
        let Some(term) = term else {
            return;
        };
        let seen = self.observed.entry(client).or_default();
        if term < *seen {
            let detail = format!("client {client} saw term {term} after term {}", *seen);
            return self.fail(Invariant::ElectionTerm, detail);
        }
        *seen = term;
        let published = self
            .published
            .get(&term)
            .is_some_and(|values| value.is_some_and(|v| values.contains(v.as_str())));
        if !published {
            let detail = format!(
                "client {client} saw term {term} with value {value:?}, which its leader never published"
            );
            self.fail(Invariant::ElectionTerm, detail);
        }
    }

    /// A hand-off to `grant`: its request heads the lock's queue, and its wait and
    /// session are not over.
    fn check_handoff(&mut self, now: u64, grant: &Grant) {
        let queue = self.queues.entry(grant.name.clone()).or_default();
        match queue.front().copied() {
            Some((token, deadline, session)) if token == grant.token => {
                queue.pop_front();
                if deadline <= now {
                    self.fail(
                        Invariant::ExpiredWaiterGranted,
                        format!(
                            "{} granted fence {} at service time {now} to a request whose wait ended at {deadline}",
                            grant.name, grant.fence
                        ),
                    );
                }
                if let Some(id) = session {
                    match self.sessions.get(&id) {
                        Some(end) if *end > now => {}
                        end => {
                            let detail = format!(
                                "{} granted fence {} at service time {now} to a request of session {id}, whose lease ended at {end:?}",
                                grant.name, grant.fence
                            );
                            self.fail(Invariant::ExpiredWaiterGranted, detail);
                        }
                    }
                }
            }
            head => {
                let detail = format!(
                    "{} granted fence {} to {} while the head of the queue is {head:?}",
                    grant.name, grant.fence, grant.token
                );
                self.fail(Invariant::FifoOrder, detail);
            }
        }
    }

    /// A fresh direct grant on `grant`'s lock: nobody may be waiting for it.
    fn check_direct(&mut self, grant: &Grant) {
        if let Some(head) = self.queues.get(&grant.name).and_then(|q| q.front()) {
            let detail = format!(
                "{} granted fence {} directly while {} is queued",
                grant.name, grant.fence, head.0
            );
            self.fail(Invariant::FifoOrder, detail);
        }
    }

    pub(crate) fn fail(&mut self, invariant: Invariant, detail: impl Into<String>) {
        if self.violation.is_none() {
            self.violation = Some(Violation {
                invariant,
                at_ms: self.at_ms,
                detail: detail.into(),
            });
        }
    }

    fn limit(&self, name: &LockName) -> usize {
        self.limits.get(name).copied().unwrap_or(1) as usize
    }

    /// At most `limit` writers, and never a writer with another holder (readers are
    /// not counted against the limit of a reader-writer lock).
    fn check_holders(&mut self, name: &LockName) {
        let limit = self.limit(name);
        let Some(held) = self.live.get(name) else {
            return;
        };
        let readers = held.values().filter(|m| **m == Mode::Shared).count();
        let writers = held.len() - readers;
        if writers > limit || (writers > 0 && readers > 0) {
            let detail = format!("{name} has holders {held:?}, limit {limit}");
            self.fail(Invariant::HolderLimit, detail);
        }
    }

    /// One command applied at service time `now` with its reply and outcomes; if it
    /// is logged, its record number is `record`.
    pub(crate) fn on_apply(
        &mut self,
        now: u64,
        record: u64,
        command: &Command,
        result: &Result<Reply, CoreError>,
        outcomes: &[Outcome],
    ) {
        for outcome in outcomes {
            match outcome {
                Outcome::Event(e) => match e.kind {
                    EventKind::Granted => {
                        let fence = e.fence.map_or(0, |f| f.get());
                        if self.election.as_ref() == Some(&e.name) {
                            self.on_leader(fence, &e.owner, e.value.as_ref());
                        }
                        if fence <= self.last_granted {
                            self.fail(
                                Invariant::FenceOrder,
                                format!(
                                    "{} granted fence {fence} after fence {}",
                                    e.name, self.last_granted
                                ),
                            );
                        }
                        self.last_granted = self.last_granted.max(fence);
                        let held = self.live.entry(e.name.clone()).or_default();
                        held.insert(fence, e.mode);
                        self.check_holders(&e.name);
                    }
                    EventKind::Downgraded => {
                        let fence = e.fence.map_or(0, |f| f.get());
                        if let Some(mode) =
                            self.live.get_mut(&e.name).and_then(|h| h.get_mut(&fence))
                        {
                            *mode = Mode::Shared;
                        }
                    }
                    EventKind::Ended(_) => {
                        let fence = e.fence.map_or(0, |f| f.get());
                        if let Some(held) = self.live.get_mut(&e.name) {
                            held.remove(&fence);
                        }
                        self.unsynced_ended.push((record, fence));
                    }
                    EventKind::Proclaimed => {
                        let fence = e.fence.map_or(0, |f| f.get());
                        if self.election.as_ref() == Some(&e.name) {
                            self.publish(fence, e.value.as_ref());
                        }
                    }
                    EventKind::Queued | EventKind::WaitEnded(_) => {}
                },
                // All or nothing: every part of the request, each at the head of
                // its queue.
                Outcome::GrantedAll(grants) => {
                    let tokens: Vec<OwnerToken> = grants.iter().map(|g| g.token).collect();
                    let group = tokens.first().and_then(|t| self.groups.get(t)).cloned();
                    if group.as_ref() != Some(&tokens) {
                        let detail =
                            format!("multi-lock grant of {tokens:?} for the request {group:?}");
                        self.fail(Invariant::MultiLock, detail);
                    }
                    for t in &tokens {
                        self.groups.remove(t);
                    }
                    for grant in grants {
                        self.check_handoff(now, grant);
                    }
                }
                Outcome::Granted(grant) => {
                    if let Some(group) = self.groups.get(&grant.token) {
                        let detail = format!(
                            "{} granted alone (fence {}) to a part of multi-lock request {group:?}",
                            grant.name, grant.fence
                        );
                        self.fail(Invariant::MultiLock, detail);
                    }
                    self.check_handoff(now, grant);
                }
                Outcome::WaitEnded { token, name, .. } => {
                    if let Some(queue) = self.queues.get_mut(name) {
                        queue.retain(|(t, _, _)| t != token);
                    }
                    self.groups.remove(token);
                }
            }
        }
        match (command, result) {
            (Command::OpenSession { id, ttl_ms, .. }, Ok(_)) => {
                self.sessions.insert(*id, now + ttl_ms);
            }
            (Command::KeepAlive { id }, Ok(Reply::KeptAlive { ttl_ms })) => {
                self.sessions.insert(*id, now + ttl_ms);
            }
            (Command::Renew { .. }, Ok(Reply::Renewed(grant))) => {
                if let Some(id) = grant.session {
                    self.sessions.insert(id, now + grant.ttl_ms);
                }
            }
            (Command::CloseSession { id }, Ok(_)) => {
                self.sessions.remove(id);
            }
            (Command::Recover, Ok(_)) => {
                // Every session restarts with its full lease (checked against the
                // recovered state in `on_recovered`).
                self.sessions.clear();
            }
            _ => {}
        }
        if let Command::AcquireAll(parts) = command {
            match result {
                Ok(Reply::QueuedAll { tokens }) => {
                    let fresh = parts.iter().map(|p| p.token).eq(tokens.iter().copied());
                    if fresh {
                        for (part, token) in parts.iter().zip(tokens) {
                            let queue = self.queues.entry(part.name.clone()).or_default();
                            queue.push_back((*token, now + part.wait_ms, part.session));
                            self.groups.insert(*token, tokens.clone());
                        }
                    }
                }
                Ok(Reply::GrantedAll(grants)) => {
                    let fresh = parts
                        .iter()
                        .map(|p| p.token)
                        .eq(grants.iter().map(|g| g.token));
                    if fresh {
                        for grant in grants {
                            self.check_direct(grant);
                        }
                    }
                }
                _ => {}
            }
            return;
        }
        let Command::Acquire(acquire) = command else {
            return;
        };
        match result {
            Ok(Reply::Queued { token, .. }) => {
                let queue = self.queues.entry(acquire.name.clone()).or_default();
                if !queue.iter().any(|(t, _, _)| t == token) {
                    queue.push_back((*token, now + acquire.wait_ms, acquire.session));
                }
            }
            // A fresh direct grant: nobody may be waiting for this lock.
            Ok(Reply::Granted(grant)) if grant.token == acquire.token => self.check_direct(grant),
            _ => {}
        }
    }

    /// A `Granted` reply left the server (after its batch was synced).
    pub(crate) fn on_ack(&mut self, grant: &Grant) {
        let fence = grant.fence.get();
        match self.acked.get(&fence) {
            Some((_, token)) if *token == grant.token => return, // an idempotent retry
            Some((name, _)) => {
                let detail = format!(
                    "fence {fence} acknowledged for {} after it was acknowledged for another grant on {name}",
                    grant.name
                );
                return self.fail(Invariant::FenceOrder, detail);
            }
            None => {}
        }
        let max = self.acked_max.entry(grant.name.clone()).or_default();
        if fence <= *max {
            let detail = format!(
                "{} acknowledged fence {fence} after fence {}",
                grant.name, *max
            );
            *max = (*max).max(fence);
            return self.fail(Invariant::FenceOrder, detail);
        }
        *max = fence;
        self.acked.insert(fence, (grant.name.clone(), grant.token));
        if !self.durable_ended.contains(&fence) {
            self.acked_open.insert(fence, grant.name.clone());
        }
    }

    /// The records applied so far are durable.
    pub(crate) fn on_sync(&mut self) {
        for (_, fence) in std::mem::take(&mut self.unsynced_ended) {
            self.durable_ended(fence);
        }
    }

    fn durable_ended(&mut self, fence: u64) {
        self.acked_open.remove(&fence);
        self.durable_ended.insert(fence);
    }

    /// The server crashed: the records numbered `kept_below` and later were not
    /// synced and are gone (earlier ones reached the disk before the crash), and so
    /// is the server's view.
    pub(crate) fn on_crash(&mut self, kept_below: u64) {
        for (record, fence) in std::mem::take(&mut self.unsynced_ended) {
            if record < kept_below {
                self.durable_ended(fence);
            }
        }
        self.live.clear();
        self.queues.clear();
        self.sessions.clear();
        self.groups.clear();
        self.last_granted = 0;
        self.last_term = 0;
        self.leaders.clear();
    }

    /// The log was replayed (before the `Recover` command): the checker's view of
    /// the server starts again from the durable state, which it then follows.
    pub(crate) fn on_replayed(&mut self, core: &Core) {
        let image = core.export();
        self.live.clear();
        self.queues.clear();
        self.groups.clear();
        self.leaders.clear();
        self.last_granted = 0;
        self.last_term = 0;
        for lock in image.locks {
            if self.election.as_ref() == Some(&lock.name) {
                for h in &lock.holders {
                    self.last_term = self.last_term.max(h.fence.get());
                    self.leaders.insert(h.fence.get(), h.owner.clone());
                    self.publish(h.fence.get(), h.value.as_ref());
                }
            }
            for w in &lock.waiters {
                if !w.group.is_empty() {
                    self.groups.insert(w.token, w.group.clone());
                }
            }
            let fences: BTreeMap<u64, Mode> = lock
                .holders
                .iter()
                .map(|h| (h.fence.get(), h.mode))
                .collect();
            let last = fences.keys().next_back().copied().unwrap_or(0);
            self.last_granted = self.last_granted.max(last);
            self.live.insert(lock.name.clone(), fences);
            let queue = lock
                .waiters
                .iter()
                .map(|w| (w.token, w.wait_deadline_ms, w.session))
                .collect();
            self.queues.insert(lock.name, queue);
        }
        self.sessions = image
            .sessions
            .iter()
            .map(|s| (s.id, s.deadline_ms))
            .collect();
    }

    /// The server recovered (replay and the `Recover` command, synced): every
    /// acknowledged grant must still be there, and no acknowledged fence may be issued
    /// again.
    pub(crate) fn on_recovered(&mut self, core: &Core) {
        let next_fence = core.stats().next_fence;
        let top = self.acked.keys().next_back().copied().unwrap_or(0);
        if next_fence <= top {
            self.fail(
                Invariant::AckedGrantLost,
                format!("after restart the next fence is {next_fence}, but fence {top} was acknowledged"),
            );
        }
        let views = core.locks("", None, usize::MAX);
        let lost: Vec<u64> = self
            .acked_open
            .iter()
            .filter(|(fence, name)| {
                !views
                    .iter()
                    .any(|v| v.name == **name && v.holders.iter().any(|h| h.fence.get() == **fence))
            })
            .map(|(f, _)| *f)
            .collect();
        if let Some(fence) = lost.first() {
            self.fail(
                Invariant::AckedGrantLost,
                format!("acknowledged grant with fence {fence} is gone after restart"),
            );
        }
        self.sessions = core
            .export()
            .sessions
            .iter()
            .map(|s| (s.id, s.deadline_ms))
            .collect();
    }

    /// The resource accepted a write.
    pub(crate) fn on_write_accepted(&mut self, key: &str, fence: u64) {
        let last = self.resource_last.entry(key.to_owned()).or_default();
        if fence <= *last {
            let detail = format!("{key} accepted fence {fence} after fence {}", *last);
            *last = (*last).max(fence);
            return self.fail(Invariant::StaleWriteAccepted, detail);
        }
        *last = fence;
    }
}

/// Each check fires on a planted history (the simulation's planted-bug tests cover
/// the others end to end).
#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use fencelock_core::{
        Acquire, Command, Event, EventKind, Fence, Grant, GrantEnd, LockName, Outcome, Owner,
        OwnerToken, Reply,
    };

    use super::{Checker, Invariant};

    fn name() -> LockName {
        LockName::new("l").expect("valid")
    }

    fn checker() -> Checker {
        Checker::new(BTreeMap::from([(name(), 1)]), None)
    }

    fn event(kind: EventKind, fence: u64) -> Outcome {
        Outcome::Event(Event {
            kind,
            name: name(),
            fence: Fence::new(fence),
            owner: Owner::new("o").expect("valid"),
            session: None,
            tenant: None,
            at_ms: 0,
            duration_ms: 0,
            reason: None,
            mode: fencelock_core::Mode::Exclusive,
            value: None,
            handoff: false,
        })
    }

    fn grant(token: u128, fence: u64) -> Grant {
        Grant {
            name: name(),
            fence: Fence::new(fence).expect("non-zero"),
            token: OwnerToken::from_u128(token),
            ttl_ms: 100,
            session: None,
            mode: fencelock_core::Mode::Exclusive,
        }
    }

    fn acquire(token: u128, wait_ms: u64) -> Command {
        Command::Acquire(Acquire {
            name: name(),
            token: OwnerToken::from_u128(token),
            ttl_ms: Some(100),
            wait_ms,
            owner: Owner::new("o").expect("valid"),
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

    fn broken(c: &Checker) -> Option<Invariant> {
        c.violation.as_ref().map(|v| v.invariant)
    }

    #[test]
    fn a_clean_history_passes() {
        let mut c = checker();
        c.on_apply(
            1,
            0,
            &Command::Tick,
            &Ok(Reply::Ticked),
            &[event(EventKind::Granted, 1)],
        );
        c.on_ack(&grant(1, 1));
        c.on_apply(
            2,
            1,
            &Command::Tick,
            &Ok(Reply::Ticked),
            &[
                event(EventKind::Ended(GrantEnd::Released), 1),
                event(EventKind::Granted, 2),
            ],
        );
        c.on_ack(&grant(2, 2));
        c.on_sync();
        c.on_write_accepted("k", 1);
        c.on_write_accepted("k", 2);
        assert_eq!(broken(&c), None);
    }

    #[test]
    fn two_holders_of_a_mutex_break_the_limit() {
        let mut c = checker();
        let both = [event(EventKind::Granted, 1), event(EventKind::Granted, 2)];
        c.on_apply(1, 0, &Command::Tick, &Ok(Reply::Ticked), &both);
        assert_eq!(broken(&c), Some(Invariant::HolderLimit));
    }

    fn shared(kind: EventKind, fence: u64) -> Outcome {
        let Outcome::Event(mut e) = event(kind, fence) else {
            unreachable!("an event")
        };
        e.mode = fencelock_core::Mode::Shared;
        Outcome::Event(e)
    }

    #[test]
    fn readers_share_a_mutex_but_never_with_a_writer() {
        let mut c = checker();
        let readers = [shared(EventKind::Granted, 1), shared(EventKind::Granted, 2)];
        c.on_apply(1, 0, &Command::Tick, &Ok(Reply::Ticked), &readers);
        assert_eq!(broken(&c), None);
        let writer = [event(EventKind::Granted, 3)];
        c.on_apply(2, 1, &Command::Tick, &Ok(Reply::Ticked), &writer);
        assert_eq!(broken(&c), Some(Invariant::HolderLimit));

        // A downgraded writer counts as a reader.
        let mut c = checker();
        let history = [
            event(EventKind::Granted, 1),
            event(EventKind::Downgraded, 1),
            shared(EventKind::Granted, 2),
        ];
        c.on_apply(1, 0, &Command::Tick, &Ok(Reply::Ticked), &history);
        assert_eq!(broken(&c), None);
    }

    #[test]
    fn a_fence_acknowledged_twice_or_backwards_breaks_fence_order() {
        let mut c = checker();
        c.on_ack(&grant(1, 5));
        c.on_ack(&grant(1, 5)); // the same grant again: an idempotent retry
        assert_eq!(broken(&c), None);
        c.on_ack(&grant(2, 5));
        assert_eq!(broken(&c), Some(Invariant::FenceOrder));
        let mut c = checker();
        c.on_ack(&grant(1, 5));
        c.on_ack(&grant(2, 4));
        assert_eq!(broken(&c), Some(Invariant::FenceOrder));
    }

    #[test]
    fn a_grant_past_the_queue_breaks_fifo() {
        let mut c = checker();
        let queued = |token| {
            Ok(Reply::Queued {
                token: OwnerToken::from_u128(token),
                position: 0,
            })
        };
        c.on_apply(1, 0, &acquire(1, 50), &queued(1), &[]);
        c.on_apply(2, 1, &acquire(2, 50), &queued(2), &[]);
        c.on_apply(
            3,
            2,
            &Command::Tick,
            &Ok(Reply::Ticked),
            &[Outcome::Granted(grant(2, 1))],
        );
        assert_eq!(broken(&c), Some(Invariant::FifoOrder));
        // Barging: a direct grant while a request is queued.
        let mut c = checker();
        c.on_apply(1, 0, &acquire(1, 50), &queued(1), &[]);
        c.on_apply(2, 1, &acquire(3, 0), &Ok(Reply::Granted(grant(3, 1))), &[]);
        assert_eq!(broken(&c), Some(Invariant::FifoOrder));
    }

    #[test]
    fn a_grant_at_the_end_of_the_wait_is_too_late() {
        let mut c = checker();
        let queued = Ok(Reply::Queued {
            token: OwnerToken::from_u128(1),
            position: 0,
        });
        c.on_apply(10, 0, &acquire(1, 50), &queued, &[]);
        c.on_apply(
            60,
            1,
            &Command::Tick,
            &Ok(Reply::Ticked),
            &[Outcome::Granted(grant(1, 1))],
        );
        assert_eq!(broken(&c), Some(Invariant::ExpiredWaiterGranted));
    }

    #[test]
    fn a_stale_write_accepted_is_caught() {
        let mut c = checker();
        c.on_write_accepted("k", 3);
        c.on_write_accepted("other", 1);
        c.on_write_accepted("k", 3);
        assert_eq!(broken(&c), Some(Invariant::StaleWriteAccepted));
    }

    /// After a crash, an acknowledged grant must still be held unless the record
    /// that ended it reached the disk.
    #[test]
    fn an_acknowledged_grant_may_only_vanish_with_a_durable_end() {
        // A core that granted fence 1 and released it: no holders, next fence 2.
        let mut core = fencelock_core::Core::new(fencelock_core::Config::default());
        core.apply(1, acquire(1, 0)).expect("granted");
        let release = Command::Release {
            name: name(),
            token: OwnerToken::from_u128(1),
        };
        core.apply(2, release).expect("released");
        let ended = [event(EventKind::Ended(GrantEnd::Released), 1)];
        for (kept_below, lost) in [(1, false), (0, true)] {
            let mut c = checker();
            c.on_ack(&grant(1, 1));
            c.on_apply(2, 0, &Command::Tick, &Ok(Reply::Ticked), &ended);
            c.on_crash(kept_below);
            c.on_recovered(&core);
            let expected = lost.then_some(Invariant::AckedGrantLost);
            assert_eq!(broken(&c), expected, "release record kept: {}", !lost);
        }
    }

    fn leader_event(fence: u64, owner: &str, value: &str) -> Outcome {
        let Outcome::Event(mut e) = event(EventKind::Granted, fence) else {
            unreachable!("an event")
        };
        e.owner = Owner::new(owner).expect("valid");
        e.value = Some(fencelock_core::Value::new(value).expect("valid"));
        Outcome::Event(e)
    }

    fn election_checker() -> Checker {
        Checker::new(BTreeMap::from([(name(), 1)]), Some(name()))
    }

    #[test]
    fn a_term_given_twice_or_seen_going_back_breaks_the_election() {
        let value = |v: &str| fencelock_core::Value::new(v).expect("valid");
        let mut c = election_checker();
        c.on_apply(
            1,
            0,
            &Command::Tick,
            &Ok(Reply::Ticked),
            &[leader_event(3, "a", "va")],
        );
        c.on_observed(0, Some(3), Some(&value("va")));
        assert_eq!(broken(&c), None);
        // A value the term's leader never published.
        c.on_observed(0, Some(3), Some(&value("vb")));
        assert_eq!(broken(&c), Some(Invariant::ElectionTerm));
        // The same term granted again in one server lifetime.
        let mut c = election_checker();
        let ended = event(EventKind::Ended(GrantEnd::Released), 3);
        c.on_apply(
            1,
            0,
            &Command::Tick,
            &Ok(Reply::Ticked),
            &[leader_event(3, "a", "va")],
        );
        c.on_apply(2, 1, &Command::Tick, &Ok(Reply::Ticked), &[ended]);
        c.on_apply(
            3,
            2,
            &Command::Tick,
            &Ok(Reply::Ticked),
            &[leader_event(3, "b", "vb")],
        );
        assert_eq!(broken(&c), Some(Invariant::ElectionTerm));
        // A client told an older term after a newer one.
        let mut c = election_checker();
        let resigned = event(EventKind::Ended(GrantEnd::Released), 3);
        c.on_apply(
            1,
            0,
            &Command::Tick,
            &Ok(Reply::Ticked),
            &[leader_event(3, "a", "va")],
        );
        c.on_apply(2, 1, &Command::Tick, &Ok(Reply::Ticked), &[resigned]);
        c.on_apply(
            3,
            2,
            &Command::Tick,
            &Ok(Reply::Ticked),
            &[leader_event(5, "b", "vb")],
        );
        c.on_observed(0, Some(5), Some(&value("vb")));
        c.on_observed(0, Some(3), Some(&value("va")));
        assert_eq!(broken(&c), Some(Invariant::ElectionTerm));
    }

    fn multi(tokens: &[u128], wait_ms: u64) -> Command {
        let parts = tokens
            .iter()
            .map(|t| {
                let Command::Acquire(mut a) = acquire(*t, wait_ms) else {
                    unreachable!("an acquire")
                };
                a.name = LockName::new(&format!("l{t}")).expect("valid");
                a
            })
            .collect();
        Command::AcquireAll(parts)
    }

    #[test]
    fn a_multi_lock_granted_partly_or_left_queued_is_caught() {
        let tokens = [1, 2].map(OwnerToken::from_u128).to_vec();
        let queued = Ok(Reply::QueuedAll {
            tokens: tokens.clone(),
        });
        let mut c = checker();
        c.on_apply(1, 0, &multi(&[1, 2], 50), &queued, &[]);
        // Still queued: what the end-of-run deadlock check reports.
        assert_eq!(c.open_multi_requests().len(), 1);
        let mut part = grant(1, 1);
        part.name = LockName::new("l1").expect("valid");
        c.on_apply(
            2,
            1,
            &Command::Tick,
            &Ok(Reply::Ticked),
            &[Outcome::Granted(part)],
        );
        assert_eq!(broken(&c), Some(Invariant::MultiLock));
        // Granted whole, or ended: nothing is left open.
        let mut c = checker();
        c.on_apply(1, 0, &multi(&[1, 2], 50), &queued, &[]);
        let grants: Vec<Grant> = [1u128, 2]
            .iter()
            .map(|t| {
                let mut g = grant(*t, *t as u64);
                g.name = LockName::new(&format!("l{t}")).expect("valid");
                g
            })
            .collect();
        c.on_apply(
            2,
            1,
            &Command::Tick,
            &Ok(Reply::Ticked),
            &[Outcome::GrantedAll(grants)],
        );
        assert_eq!(broken(&c), None);
        assert!(c.open_multi_requests().is_empty());
    }
}
