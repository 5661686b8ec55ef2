//! The reference model of the core, and the runner that compares the two.
//!
//! The model follows docs/design.md §2 and the public rustdoc with the plainest data
//! structures: a `Vec` of locks, each with a `Vec` of holders (absolute deadlines)
//! and a `Vec` FIFO queue, linear scans everywhere. Time is simulated by repeatedly
//! taking the earliest due deadline and acting on it, all at the command's `now`.
//! It covers shared and exclusive modes and downgrade; multi-lock requests (1 to
//! `MAX_NAMES_PER_REQUEST` names, all or nothing, queued on every lock in one step,
//! granted only when heading every queue, one fence per name, released together or
//! one by one, timing out or cancelled as a whole); and elections (a campaign is an
//! exclusive acquire with a value, only the leader proclaims, resign is release,
//! the term is the fence, the leader query shows leader, value and term).
//!
//! Where the design leaves a choice open, the model makes the core's choice, so that
//! whole states can be compared: same-instant deadlines in the order sessions,
//! leases, waits, lock-delay ends (then by id); a session's grants end in token
//! order; when several errors apply, the same one wins; a head waiter whose wait and
//! session are both over leaves as `SessionEnded`; lock-delay counts from when the
//! expiry is processed; endings are remembered per (owner token, lock). Hand-off
//! fences are not predicted across locks: both number a command's grants
//! consecutively, and the model adopts the core's numbering afterwards.
//!
//! Every step compares the reply, the hand-off grants (per lock, in order), the
//! multi-lock hand-offs, the wait ends, the events, the whole exported state and
//! every election's leader, and checks the invariants on the core alone: at most
//! `limit` holders, never a writer with another holder, fences strictly increasing
//! over the run (so terms are never reused), FIFO hand-off, nobody granted at once
//! past a queued request, no multi-lock request granted partly, one arrival order
//! that every queue agrees with, no grant to a waiter whose wait or session is over
//! (deadlines are exclusive), lock-delay honoured, `check_invariants()` clean. A
//! run ends with the no-deadlock check ([`Runner::drain`]).

use std::collections::{BTreeMap, BTreeSet};

use super::{render_command, Step};
use fencelock_core::{
    Acquire, Command, Config, Core, ErrorKind, Event, EventKind, Fence, Grant, GrantEnd,
    HolderImage, LeaseImage, LockImage, LockName, Mode, Outcome, Owner, OwnerToken, Reason, Reply,
    RequestId, SessionId, SessionImage, StateImage, Value, WaitEnd, WaiterImage,
    MAX_NAMES_PER_REQUEST,
};
use proptest::test_runner::TestCaseError;

// ---------------------------------------------------------------------------------
// The reference model.
// ---------------------------------------------------------------------------------

/// Whether `lock` takes one more holder in `mode`, as docs/design.md says: exclusive
/// and shared never together; exclusive ones up to `limit`; shared ones up to
/// `limit`, or `max_limit` when `limit` is 1.
fn admits(lock: &MLock, mode: Mode, max_limit: u32) -> bool {
    let shared = lock
        .holders
        .iter()
        .filter(|h| h.mode == Mode::Shared)
        .count();
    let exclusive = lock.holders.len() - shared;
    let readers = if lock.limit == 1 {
        max_limit as usize
    } else {
        lock.limit as usize
    };
    match mode {
        Mode::Exclusive => shared == 0 && exclusive < lock.limit as usize,
        Mode::Shared => exclusive == 0 && shared < readers,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MLease {
    Own { ttl: u64, deadline: u64 },
    Session(SessionId),
}

#[derive(Debug, Clone)]
struct MHolder {
    token: OwnerToken,
    fence: u64,
    owner: Owner,
    request_id: Option<RequestId>,
    lease: MLease,
    granted_at: u64,
    lock_delay: u64,
    mode: Mode,
    value: Option<Value>,
}

#[derive(Debug, Clone)]
struct MWaiter {
    token: OwnerToken,
    owner: Owner,
    request_id: Option<RequestId>,
    ttl: Option<u64>,
    session: Option<SessionId>,
    lock_delay: u64,
    enqueued_at: u64,
    wait_deadline: u64,
    mode: Mode,
    value: Option<Value>,
    /// A multi-lock request's parts (this one included), in the order asked;
    /// empty for a single request.
    group: Vec<OwnerToken>,
}

#[derive(Debug, Clone)]
struct MLock {
    name: LockName,
    limit: u32,
    blocked_until: u64,
    /// The lock-delay end still has to be acted on (hand-off when it passes).
    unblock_pending: bool,
    holders: Vec<MHolder>,
    queue: Vec<MWaiter>,
}

#[derive(Debug, Clone)]
struct MSession {
    id: SessionId,
    owner: Owner,
    ttl: u64,
    deadline: u64,
}

/// What one command produced, besides its reply.
#[derive(Debug, Default)]
struct MOut {
    /// Hand-offs, in the model's order (fences as the model numbered them), the
    /// parts of multi-lock hand-offs included.
    grants: Vec<Grant>,
    /// Multi-lock hand-offs: each request's tokens, in the order asked.
    granted_all: Vec<Vec<OwnerToken>>,
    wait_ends: Vec<(OwnerToken, LockName, WaitEnd)>,
    events: Vec<Event>,
}

#[derive(Debug, Clone)]
struct Model {
    cfg: Config,
    now: u64,
    next_fence: u64,
    locks: Vec<MLock>,
    sessions: Vec<MSession>,
    /// Why recent grants ended, oldest first, at most `cfg.max_recent_ends`.
    recent: Vec<(OwnerToken, LockName, GrantEnd)>,
}

/// Which deadline is due. Same-instant deadlines are taken in this order (then by
/// id), the core's fixed order that keeps replay deterministic.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Due {
    Session(SessionId),
    Lease(OwnerToken),
    Wait(OwnerToken),
    Unblock(LockName),
}

type MReply = Result<Reply, ErrorKind>;

impl Model {
    fn new(cfg: Config) -> Model {
        Model {
            cfg,
            now: 0,
            next_fence: 1,
            locks: Vec::new(),
            sessions: Vec::new(),
            recent: Vec::new(),
        }
    }

    fn lock_index(&self, name: &LockName) -> Option<usize> {
        self.locks.iter().position(|l| l.name == *name)
    }

    fn session(&self, id: SessionId) -> Option<&MSession> {
        self.sessions.iter().find(|s| s.id == id)
    }

    fn grant_value(&self, name: &LockName, h: &MHolder) -> Grant {
        let (ttl_ms, session) = match h.lease {
            MLease::Own { ttl, .. } => (ttl, None),
            MLease::Session(id) => (self.session(id).expect("live session").ttl, Some(id)),
        };
        Grant {
            name: name.clone(),
            fence: Fence::new(h.fence).expect("fence > 0"),
            token: h.token,
            ttl_ms,
            session,
            mode: h.mode,
        }
    }

    /// Makes `w` a holder of lock `li` with the next fence; `handoff`: from the queue
    /// rather than in reply to the acquire.
    fn grant(&mut self, li: usize, w: MWaiter, handoff: bool, out: &mut MOut) -> Grant {
        let fence = self.next_fence;
        self.next_fence += 1;
        let lease = match w.session {
            Some(id) => MLease::Session(id),
            None => {
                let ttl = w.ttl.expect("own lease has a ttl");
                MLease::Own {
                    ttl,
                    deadline: self.now + ttl,
                }
            }
        };
        let h = MHolder {
            token: w.token,
            fence,
            owner: w.owner.clone(),
            request_id: w.request_id,
            lease,
            granted_at: self.now,
            lock_delay: w.lock_delay,
            mode: w.mode,
            value: w.value.clone(),
        };
        let name = self.locks[li].name.clone();
        out.events.push(Event {
            tenant: super::model_tenant(),
            kind: EventKind::Granted,
            name: name.clone(),
            fence: Fence::new(fence),
            owner: w.owner.clone(),
            session: w.session,
            at_ms: self.now,
            duration_ms: self.now - w.enqueued_at,
            reason: None,
            mode: w.mode,
            value: w.value.clone(),
            handoff,
        });
        let grant = self.grant_value(&name, &h);
        self.locks[li].holders.push(h);
        grant
    }

    fn remember_end(&mut self, token: OwnerToken, name: LockName, end: GrantEnd) {
        if self.cfg.max_recent_ends == 0 {
            return;
        }
        match self.recent.iter_mut().find(|(t, _, _)| *t == token) {
            Some(entry) => *entry = (token, name, end),
            None => self.recent.push((token, name, end)),
        }
        while self.recent.len() > self.cfg.max_recent_ends {
            self.recent.remove(0);
        }
    }

    fn recent_end(&self, name: &LockName, token: OwnerToken) -> Option<GrantEnd> {
        self.recent
            .iter()
            .find(|(t, n, _)| *t == token && n == name)
            .map(|(_, _, e)| *e)
    }

    /// Ends holder `token` of lock `li`. Lock-delay applies unless it was a clean
    /// release. No hand-off here.
    fn end_grant(
        &mut self,
        li: usize,
        token: OwnerToken,
        end: GrantEnd,
        reason: Option<Reason>,
        out: &mut MOut,
    ) -> u64 {
        let pos = self.locks[li]
            .holders
            .iter()
            .position(|h| h.token == token)
            .expect("ending a holder");
        let h = self.locks[li].holders.remove(pos);
        if end != GrantEnd::Released && h.lock_delay > 0 {
            let until = self.now + h.lock_delay;
            let lock = &mut self.locks[li];
            if until > lock.blocked_until {
                lock.blocked_until = until;
                lock.unblock_pending = true;
            }
        }
        let lock_name = self.locks[li].name.clone();
        self.remember_end(token, lock_name, end);
        let session = match h.lease {
            MLease::Session(id) => Some(id),
            MLease::Own { .. } => None,
        };
        let name = self.locks[li].name.clone();
        out.events.push(Event {
            tenant: super::model_tenant(),
            kind: EventKind::Ended(end),
            name: name.clone(),
            fence: Fence::new(h.fence),
            owner: h.owner.clone(),
            session,
            at_ms: self.now,
            duration_ms: self.now - h.granted_at,
            reason,
            mode: h.mode,
            value: h.value.clone(),
            handoff: false,
        });
        h.fence
    }

    fn end_wait(&mut self, li: usize, pos: usize, why: WaitEnd, out: &mut MOut) {
        let w = self.locks[li].queue.remove(pos);
        self.push_wait_end(li, w, why, out);
    }

    fn push_wait_end(&mut self, li: usize, w: MWaiter, why: WaitEnd, out: &mut MOut) {
        let name = self.locks[li].name.clone();
        out.events.push(Event {
            tenant: super::model_tenant(),
            kind: EventKind::WaitEnded(why),
            name: name.clone(),
            fence: None,
            owner: w.owner.clone(),
            session: w.session,
            at_ms: self.now,
            duration_ms: self.now - w.enqueued_at,
            reason: None,
            mode: w.mode,
            value: w.value.clone(),
            handoff: false,
        });
        out.wait_ends.push((w.token, name, why));
    }

    /// Grants from the head of the queue while there is a free slot and no
    /// lock-delay. A head whose wait or session is over at `now` leaves instead
    /// (with every other part of its request). A multi-lock request is granted only
    /// when it heads *every* one of its queues and each of those locks admits it,
    /// then on all of them at once; the locks it (or a wait end) touched are handed
    /// off in turn.
    fn hand_off(&mut self, li: usize, out: &mut MOut) {
        let mut work = vec![self.locks[li].name.clone()];
        // Bounded: every round grants or removes a waiter, or ends one lock's turn.
        for _ in 0..100_000 {
            let Some(name) = work.pop() else {
                return;
            };
            let Some(li) = self.lock_index(&name) else {
                continue;
            };
            loop {
                let lock = &self.locks[li];
                if lock.blocked_until > self.now
                    || lock.queue.is_empty()
                    || !admits(lock, lock.queue[0].mode, self.cfg.max_limit)
                {
                    break;
                }
                let w = lock.queue[0].clone();
                let session_over = w
                    .session
                    .is_some_and(|id| self.session(id).is_none_or(|s| s.deadline <= self.now));
                if session_over || w.wait_deadline <= self.now {
                    let why = if session_over {
                        WaitEnd::SessionEnded
                    } else {
                        WaitEnd::TimedOut
                    };
                    work.extend(self.end_request(w.token, why, out));
                    continue;
                }
                if w.group.is_empty() {
                    let w = self.locks[li].queue.remove(0);
                    let g = self.grant(li, w, true, out);
                    out.grants.push(g);
                    continue;
                }
                if !self.heads_every_queue(&w.group) {
                    break;
                }
                for &part in &w.group {
                    let (pli, _) = self.find_waiter(part).expect("checked: heads its queue");
                    let pw = self.locks[pli].queue.remove(0);
                    let g = self.grant(pli, pw, true, out);
                    out.grants.push(g);
                    work.push(self.locks[pli].name.clone());
                }
                out.granted_all.push(w.group.clone());
            }
        }
        panic!("model: hand-off did not terminate");
    }

    /// Whether every part of a multi-lock request heads its queue on a lock that
    /// admits it now (no lock-delay).
    fn heads_every_queue(&self, group: &[OwnerToken]) -> bool {
        group.iter().all(|&part| {
            self.find_waiter(part).is_some_and(|(li, pos)| {
                let lock = &self.locks[li];
                pos == 0
                    && lock.blocked_until <= self.now
                    && admits(lock, lock.queue[0].mode, self.cfg.max_limit)
            })
        })
    }

    /// Ends the queued request `token` belongs to: every part of a multi-lock
    /// request. Returns the locks whose queues changed.
    fn end_request(&mut self, token: OwnerToken, why: WaitEnd, out: &mut MOut) -> Vec<LockName> {
        let Some((li, pos)) = self.find_waiter(token) else {
            return Vec::new();
        };
        let group = self.locks[li].queue[pos].group.clone();
        let parts = if group.is_empty() { vec![token] } else { group };
        let mut names = Vec::new();
        for part in parts {
            if let Some((li, pos)) = self.find_waiter(part) {
                self.end_wait(li, pos, why, out);
                names.push(self.locks[li].name.clone());
            }
        }
        names
    }

    /// Forgets lock records nobody holds, waits for or is delayed on.
    fn gc(&mut self) {
        let now = self.now;
        self.locks
            .retain(|l| !l.holders.is_empty() || !l.queue.is_empty() || l.blocked_until > now);
    }

    /// Ends session `id`: its queued requests leave first (so no hand-off can grant
    /// to it), then its grants end with `end`, then the touched locks hand off.
    fn end_session(&mut self, id: SessionId, end: GrantEnd, out: &mut MOut) -> usize {
        let mut touched = Vec::new();
        for li in 0..self.locks.len() {
            while let Some(pos) = self.locks[li]
                .queue
                .iter()
                .position(|w| w.session == Some(id))
            {
                self.end_wait(li, pos, WaitEnd::SessionEnded, out);
                touched.push(li);
            }
        }
        // Same-instant endings are taken in token order (it decides which endings
        // `max_recent_ends` still remembers).
        let mut mine: Vec<(OwnerToken, usize)> = Vec::new();
        for (li, l) in self.locks.iter().enumerate() {
            for h in &l.holders {
                if h.lease == MLease::Session(id) {
                    mine.push((h.token, li));
                }
            }
        }
        mine.sort();
        let released = mine.len();
        for (token, li) in mine {
            self.end_grant(li, token, end, None, out);
            touched.push(li);
        }
        self.sessions.retain(|s| s.id != id);
        for li in touched {
            self.hand_off(li, out);
        }
        released
    }

    /// The earliest deadline at or before `now`, if any (linear scan).
    fn earliest_due(&self) -> Option<(u64, Due)> {
        let now = self.now;
        let mut due: Vec<(u64, Due)> = Vec::new();
        for s in &self.sessions {
            if s.deadline <= now {
                due.push((s.deadline, Due::Session(s.id)));
            }
        }
        for l in &self.locks {
            for h in &l.holders {
                if let MLease::Own { deadline, .. } = h.lease {
                    if deadline <= now {
                        due.push((deadline, Due::Lease(h.token)));
                    }
                }
            }
            for w in &l.queue {
                if w.wait_deadline <= now {
                    due.push((w.wait_deadline, Due::Wait(w.token)));
                }
            }
            if l.unblock_pending && l.blocked_until <= now {
                due.push((l.blocked_until, Due::Unblock(l.name.clone())));
            }
        }
        due.into_iter().min()
    }

    fn process_deadlines(&mut self, out: &mut MOut) {
        // Bounded: each iteration removes a deadline and adds only future ones.
        for _ in 0..10_000 {
            let Some((_, due)) = self.earliest_due() else {
                self.gc();
                return;
            };
            match due {
                Due::Session(id) => {
                    self.end_session(id, GrantEnd::Expired, out);
                }
                Due::Lease(token) => {
                    let li = self
                        .locks
                        .iter()
                        .position(|l| l.holders.iter().any(|h| h.token == token))
                        .expect("due lease is held");
                    self.end_grant(li, token, GrantEnd::Expired, None, out);
                    self.hand_off(li, out);
                }
                Due::Wait(token) => {
                    for name in self.end_request(token, WaitEnd::TimedOut, out) {
                        let li = self.lock_index(&name).expect("not collected mid-command");
                        self.hand_off(li, out);
                    }
                }
                Due::Unblock(name) => {
                    let li = self.lock_index(&name).expect("delayed lock exists");
                    self.locks[li].unblock_pending = false;
                    self.hand_off(li, out);
                }
            }
        }
        panic!("model: deadline processing did not terminate");
    }

    fn find_waiter(&self, token: OwnerToken) -> Option<(usize, usize)> {
        self.locks.iter().enumerate().find_map(|(li, l)| {
            l.queue
                .iter()
                .position(|w| w.token == token)
                .map(|pos| (li, pos))
        })
    }

    fn find_holder(&self, name: &LockName, token: OwnerToken) -> Option<(usize, usize)> {
        let li = self.lock_index(name)?;
        let hi = self.locks[li]
            .holders
            .iter()
            .position(|h| h.token == token)?;
        Some((li, hi))
    }

    fn token_in_use(&self, token: OwnerToken) -> bool {
        self.locks.iter().any(|l| {
            l.holders.iter().any(|h| h.token == token) || l.queue.iter().any(|w| w.token == token)
        })
    }

    fn ttl_ok(&self, ttl: u64) -> bool {
        (self.cfg.min_ttl_ms..=self.cfg.max_ttl_ms).contains(&ttl)
    }

    /// Why renew/release did nothing: how this token's grant on this lock ended.
    fn not_held(&self, name: &LockName, token: OwnerToken) -> ErrorKind {
        match self.recent_end(name, token) {
            Some(GrantEnd::Expired) => ErrorKind::Expired,
            _ => ErrorKind::NotHeld,
        }
    }

    fn apply(&mut self, now: u64, command: &Command) -> (MReply, MOut) {
        let mut out = MOut::default();
        self.now = self.now.max(now);
        self.process_deadlines(&mut out);
        let reply = match command {
            Command::Acquire(a) => self.acquire(a, &mut out),
            Command::Downgrade { name, token } => self.downgrade(name, *token, &mut out),
            Command::Proclaim { name, token, value } => {
                self.proclaim(name, *token, value, &mut out)
            }
            Command::AcquireAll(parts) => self.acquire_all(parts, &mut out),
            Command::ReleaseAll { grants } => self.release_all(grants, &mut out),
            Command::Renew {
                name,
                token,
                ttl_ms,
            } => self.renew(name, *token, *ttl_ms),
            Command::Release { name, token } => match self.find_holder(name, *token) {
                Some((li, _)) => {
                    self.end_grant(li, *token, GrantEnd::Released, None, &mut out);
                    self.hand_off(li, &mut out);
                    Ok(Reply::Released { released: true })
                }
                None if self.recent_end(name, *token) == Some(GrantEnd::Released) => {
                    Ok(Reply::Released { released: false })
                }
                None => Err(self.not_held(name, *token)),
            },
            Command::ForceRelease {
                name,
                fence,
                reason,
            } => {
                let victims: Vec<OwnerToken> = match self.lock_index(name) {
                    Some(li) => self.locks[li]
                        .holders
                        .iter()
                        .filter(|h| fence.is_none_or(|f| f.get() == h.fence))
                        .map(|h| h.token)
                        .collect(),
                    None => Vec::new(),
                };
                if victims.is_empty() {
                    Err(ErrorKind::NotHeld)
                } else {
                    let li = self.lock_index(name).expect("has holders");
                    let fences = victims
                        .into_iter()
                        .map(|t| {
                            let f = self.end_grant(
                                li,
                                t,
                                GrantEnd::ForceReleased,
                                Some(reason.clone()),
                                &mut out,
                            );
                            Fence::new(f).expect("fence > 0")
                        })
                        .collect();
                    self.hand_off(li, &mut out);
                    Ok(Reply::ForceReleased { fences })
                }
            }
            Command::CancelWait { name, token } => {
                // Cancelling one part of a multi-lock request cancels all of it.
                let queued = self
                    .find_waiter(*token)
                    .is_some_and(|(li, _)| self.locks[li].name == *name);
                if queued {
                    for name in self.end_request(*token, WaitEnd::Cancelled, &mut out) {
                        let li = self.lock_index(&name).expect("not collected mid-command");
                        self.hand_off(li, &mut out);
                    }
                }
                Ok(Reply::WaitCancelled { cancelled: queued })
            }
            Command::OpenSession {
                id, ttl_ms, owner, ..
            } => {
                if !self.ttl_ok(*ttl_ms) || self.session(*id).is_some() {
                    Err(ErrorKind::InvalidArgument)
                } else if self.sessions.len() >= self.cfg.max_sessions {
                    Err(ErrorKind::ResourceExhausted)
                } else {
                    self.sessions.push(MSession {
                        id: *id,
                        owner: owner.clone(),
                        ttl: *ttl_ms,
                        deadline: self.now + ttl_ms,
                    });
                    Ok(Reply::SessionOpened {
                        id: *id,
                        ttl_ms: *ttl_ms,
                    })
                }
            }
            Command::KeepAlive { id } => self.keep_alive(*id),
            Command::CloseSession { id } => {
                if self.session(*id).is_none() {
                    Err(ErrorKind::SessionNotFound)
                } else {
                    let released = self.end_session(*id, GrantEnd::Released, &mut out);
                    Ok(Reply::SessionClosed { released })
                }
            }
            Command::Tick => Ok(Reply::Ticked),
            Command::Recover | Command::Promote => {
                let now = self.now;
                let recover = matches!(command, Command::Recover);
                for li in 0..self.locks.len() {
                    // A restart drops the queue (its clients are gone); a new
                    // cluster leader keeps it (they retry with their request ids).
                    while recover && !self.locks[li].queue.is_empty() {
                        self.end_wait(li, 0, WaitEnd::ServerRestarted, &mut out);
                    }
                    for h in &mut self.locks[li].holders {
                        if let MLease::Own { ttl, .. } = h.lease {
                            h.lease = MLease::Own {
                                ttl,
                                deadline: now + ttl,
                            };
                        }
                    }
                }
                for s in &mut self.sessions {
                    s.deadline = now + s.ttl;
                }
                Ok(if recover {
                    Reply::Recovered
                } else {
                    Reply::Promoted
                })
            }
            Command::RaiseFenceFloor { floor } => {
                self.next_fence = self.next_fence.max(*floor).max(1);
                Ok(Reply::FenceFloorRaised {
                    next_fence: self.next_fence,
                })
            }
        };
        self.gc();
        (reply, out)
    }

    fn downgrade(&mut self, name: &LockName, token: OwnerToken, out: &mut MOut) -> MReply {
        let Some((li, hi)) = self.find_holder(name, token) else {
            return Err(self.not_held(name, token));
        };
        let h = &self.locks[li].holders[hi];
        if h.mode == Mode::Shared {
            let grant = self.grant_value(name, h);
            return Ok(Reply::Downgraded {
                grant,
                downgraded: false,
            });
        }
        if h.value.is_some() || self.locks[li].holders.len() > 1 {
            return Err(ErrorKind::InvalidArgument);
        }
        let h = &mut self.locks[li].holders[hi];
        h.mode = Mode::Shared;
        out.events.push(Event {
            tenant: super::model_tenant(),
            kind: EventKind::Downgraded,
            name: name.clone(),
            fence: Fence::new(h.fence),
            owner: h.owner.clone(),
            session: match h.lease {
                MLease::Session(id) => Some(id),
                MLease::Own { .. } => None,
            },
            at_ms: self.now,
            duration_ms: self.now - h.granted_at,
            reason: None,
            mode: Mode::Shared,
            value: None,
            handoff: false,
        });
        self.hand_off(li, out);
        let (li, hi) = self.find_holder(name, token).expect("still held");
        let grant = self.grant_value(name, &self.locks[li].holders[hi]);
        Ok(Reply::Downgraded {
            grant,
            downgraded: true,
        })
    }

    fn proclaim(
        &mut self,
        name: &LockName,
        token: OwnerToken,
        value: &Value,
        out: &mut MOut,
    ) -> MReply {
        let Some((li, hi)) = self.find_holder(name, token) else {
            return Err(self.not_held(name, token));
        };
        if self.locks[li].limit != 1 || self.locks[li].holders[hi].mode != Mode::Exclusive {
            return Err(ErrorKind::InvalidArgument);
        }
        let h = &mut self.locks[li].holders[hi];
        h.value = Some(value.clone());
        out.events.push(Event {
            tenant: super::model_tenant(),
            kind: EventKind::Proclaimed,
            name: name.clone(),
            fence: Fence::new(h.fence),
            owner: h.owner.clone(),
            session: match h.lease {
                MLease::Session(id) => Some(id),
                MLease::Own { .. } => None,
            },
            at_ms: self.now,
            duration_ms: self.now - h.granted_at,
            reason: None,
            mode: Mode::Exclusive,
            value: Some(value.clone()),
            handoff: false,
        });
        let h = &self.locks[li].holders[hi];
        Ok(Reply::Proclaimed(self.grant_value(name, h)))
    }

    fn keep_alive(&mut self, id: SessionId) -> MReply {
        let now = self.now;
        let s = self
            .sessions
            .iter_mut()
            .find(|s| s.id == id)
            .ok_or(ErrorKind::SessionNotFound)?;
        s.deadline = now + s.ttl;
        Ok(Reply::KeptAlive { ttl_ms: s.ttl })
    }

    fn renew(&mut self, name: &LockName, token: OwnerToken, ttl_ms: Option<u64>) -> MReply {
        let Some((li, hi)) = self.find_holder(name, token) else {
            return Err(self.not_held(name, token));
        };
        match self.locks[li].holders[hi].lease {
            MLease::Own { ttl, .. } => {
                let ttl = ttl_ms.unwrap_or(ttl);
                if !self.ttl_ok(ttl) {
                    return Err(ErrorKind::InvalidArgument);
                }
                self.locks[li].holders[hi].lease = MLease::Own {
                    ttl,
                    deadline: self.now + ttl,
                };
            }
            MLease::Session(id) => {
                if ttl_ms.is_some() {
                    return Err(ErrorKind::InvalidArgument);
                }
                self.keep_alive(id)?;
            }
        }
        let h = &self.locks[li].holders[hi];
        Ok(Reply::Renewed(self.grant_value(name, h)))
    }

    /// Whether one acquire's arguments are in range (nothing about the state).
    fn args_ok(&self, a: &Acquire) -> bool {
        let lease_ok = match (a.ttl_ms, a.session) {
            (Some(ttl), None) => self.ttl_ok(ttl),
            (None, Some(_)) => true,
            _ => false,
        };
        lease_ok
            && (1..=self.cfg.max_limit).contains(&a.limit)
            && a.wait_ms <= self.cfg.max_wait_ms
            && a.lock_delay_ms <= self.cfg.max_lock_delay_ms
            && (a.value.is_none() || (a.mode == Mode::Exclusive && a.limit == 1))
    }

    /// Locks session `id` holds or waits for.
    fn session_used(&self, id: SessionId) -> usize {
        self.locks
            .iter()
            .map(|l| {
                l.holders
                    .iter()
                    .filter(|h| h.lease == MLease::Session(id))
                    .count()
                    + l.queue.iter().filter(|w| w.session == Some(id)).count()
            })
            .sum()
    }

    /// The index of lock `name`, made (empty, with `limit`) if it does not exist.
    fn lock_or_new(&mut self, name: &LockName, limit: u32) -> usize {
        if let Some(li) = self.lock_index(name) {
            return li;
        }
        self.locks.push(MLock {
            name: name.clone(),
            limit,
            blocked_until: 0,
            unblock_pending: false,
            holders: Vec::new(),
            queue: Vec::new(),
        });
        self.locks.len() - 1
    }

    /// `a` as a request queued now (or about to be granted).
    fn waiter_of(&self, a: &Acquire, group: Vec<OwnerToken>) -> MWaiter {
        MWaiter {
            token: a.token,
            owner: a.owner.clone(),
            request_id: a.request_id.clone(),
            ttl: a.ttl_ms,
            session: a.session,
            lock_delay: a.lock_delay_ms,
            enqueued_at: self.now,
            wait_deadline: self.now + a.wait_ms,
            mode: a.mode,
            value: a.value.clone(),
            group,
        }
    }

    fn queued_event(&self, a: &Acquire) -> Event {
        Event {
            tenant: super::model_tenant(),
            kind: EventKind::Queued,
            name: a.name.clone(),
            fence: None,
            owner: a.owner.clone(),
            session: a.session,
            at_ms: self.now,
            duration_ms: 0,
            reason: None,
            mode: a.mode,
            value: a.value.clone(),
            handoff: false,
        }
    }

    /// The holder or queued request on `name` with request id `rid`: its token
    /// and whether it holds.
    fn by_request_id(&self, name: &LockName, rid: &RequestId) -> Option<(OwnerToken, bool)> {
        let lock = &self.locks[self.lock_index(name)?];
        let held = lock
            .holders
            .iter()
            .find(|h| h.request_id.as_ref() == Some(rid));
        let queued = lock
            .queue
            .iter()
            .find(|w| w.request_id.as_ref() == Some(rid));
        held.map(|h| (h.token, true))
            .or(queued.map(|w| (w.token, false)))
    }

    /// A multi-lock request, as docs/design.md says: all locks or none; granted
    /// at once only if every lock is free for it with nobody queued; otherwise
    /// queued on every lock in one step (so every queue orders it after all that
    /// came before), and granted later only as a whole.
    fn acquire_all(&mut self, parts: &[Acquire], out: &mut MOut) -> MReply {
        use ErrorKind::*;
        let Some(first) = parts.first() else {
            return Err(InvalidArgument);
        };
        if parts.len() > MAX_NAMES_PER_REQUEST {
            return Err(InvalidArgument);
        }
        for (i, p) in parts.iter().enumerate() {
            let same = p.ttl_ms == first.ttl_ms
                && p.wait_ms == first.wait_ms
                && p.owner == first.owner
                && p.request_id == first.request_id
                && p.lock_delay_ms == first.lock_delay_ms
                && p.session == first.session;
            let repeated = parts[..i]
                .iter()
                .any(|q| q.name == p.name || q.token == p.token);
            if !self.args_ok(p)
                || !same
                || p.value.is_some()
                || repeated
                || self.token_in_use(p.token)
            {
                return Err(InvalidArgument);
            }
        }
        if let Some(rid) = &first.request_id {
            let found: Vec<Option<(OwnerToken, bool)>> = parts
                .iter()
                .map(|p| self.by_request_id(&p.name, rid))
                .collect();
            if found.iter().any(Option::is_some) {
                let tokens: Vec<OwnerToken> = found.iter().flatten().map(|f| f.0).collect();
                if found.iter().all(|f| matches!(f, Some((_, true)))) {
                    let grants = parts
                        .iter()
                        .zip(&tokens)
                        .map(|(p, t)| {
                            let (li, hi) = self.find_holder(&p.name, *t).expect("found held");
                            self.grant_value(&p.name, &self.locks[li].holders[hi])
                        })
                        .collect();
                    return Ok(Reply::GrantedAll(grants));
                }
                if found.iter().all(|f| matches!(f, Some((_, false)))) {
                    return Ok(Reply::QueuedAll { tokens });
                }
                return Err(InvalidArgument);
            }
        }
        if let Some(id) = first.session {
            if self.session(id).is_none() {
                return Err(SessionNotFound);
            }
            if self.session_used(id) + parts.len() > self.cfg.max_locks_per_session {
                return Err(ResourceExhausted);
            }
        }
        let mut vacant = 0;
        let mut all_free = true;
        for p in parts {
            match self.lock_index(&p.name) {
                Some(li) => {
                    let lock = &self.locks[li];
                    if lock.limit != p.limit {
                        return Err(LimitMismatch);
                    }
                    all_free &= admits(lock, p.mode, self.cfg.max_limit)
                        && lock.blocked_until <= self.now
                        && lock.queue.is_empty();
                }
                None => vacant += 1,
            }
        }
        if self.locks.len() + vacant > self.cfg.max_locks {
            return Err(ResourceExhausted);
        }
        if all_free {
            let mut grants = Vec::new();
            for p in parts {
                let li = self.lock_or_new(&p.name, p.limit);
                let w = self.waiter_of(p, Vec::new());
                grants.push(self.grant(li, w, false, out));
            }
            return Ok(Reply::GrantedAll(grants));
        }
        if first.wait_ms == 0 {
            return Err(Held);
        }
        let crowded = parts.iter().any(|p| {
            self.lock_index(&p.name)
                .is_some_and(|li| self.locks[li].queue.len() >= self.cfg.max_waiters_per_lock)
        });
        let total_waiting: usize = self.locks.iter().map(|l| l.queue.len()).sum();
        if crowded || total_waiting + parts.len() > self.cfg.max_waiters {
            return Err(ResourceExhausted);
        }
        let group: Vec<OwnerToken> = parts.iter().map(|p| p.token).collect();
        for p in parts {
            let li = self.lock_or_new(&p.name, p.limit);
            out.events.push(self.queued_event(p));
            let w = self.waiter_of(p, group.clone());
            self.locks[li].queue.push(w);
        }
        Ok(Reply::QueuedAll { tokens: group })
    }

    /// Several releases in one step: refused as a whole unless every grant is held
    /// or was released by its token; then each ends, then each lock hands off.
    fn release_all(&mut self, grants: &[(LockName, OwnerToken)], out: &mut MOut) -> MReply {
        if grants.is_empty() || grants.len() > MAX_NAMES_PER_REQUEST {
            return Err(ErrorKind::InvalidArgument);
        }
        for (i, (name, token)) in grants.iter().enumerate() {
            if grants[..i].iter().any(|(_, t)| t == token) {
                return Err(ErrorKind::InvalidArgument);
            }
            if self.find_holder(name, *token).is_none()
                && self.recent_end(name, *token) != Some(GrantEnd::Released)
            {
                return Err(self.not_held(name, *token));
            }
        }
        let mut released = Vec::new();
        for (name, token) in grants {
            let held = self.find_holder(name, *token);
            if let Some((li, _)) = held {
                self.end_grant(li, *token, GrantEnd::Released, None, out);
            }
            released.push(held.is_some());
        }
        for (name, _) in grants {
            if let Some(li) = self.lock_index(name) {
                self.hand_off(li, out);
            }
        }
        Ok(Reply::ReleasedAll { released })
    }

    fn acquire(&mut self, a: &Acquire, out: &mut MOut) -> MReply {
        use ErrorKind::*;
        if !self.args_ok(a) {
            return Err(InvalidArgument);
        }
        // A retry with the same request id on the same lock gets the same answer.
        if let (Some(rid), Some(li)) = (&a.request_id, self.lock_index(&a.name)) {
            let lock = &self.locks[li];
            if let Some(h) = lock
                .holders
                .iter()
                .find(|h| h.request_id.as_ref() == Some(rid))
            {
                return Ok(Reply::Granted(self.grant_value(&a.name, h)));
            }
            if let Some(pos) = lock
                .queue
                .iter()
                .position(|w| w.request_id.as_ref() == Some(rid))
            {
                return Ok(Reply::Queued {
                    token: lock.queue[pos].token,
                    position: pos,
                });
            }
        }
        if let Some(id) = a.session {
            if self.session(id).is_none() {
                return Err(SessionNotFound);
            }
            if self.session_used(id) >= self.cfg.max_locks_per_session {
                return Err(ResourceExhausted);
            }
        }
        if self.token_in_use(a.token) {
            return Err(InvalidArgument);
        }
        let li = match self.lock_index(&a.name) {
            Some(li) => {
                if self.locks[li].limit != a.limit {
                    return Err(LimitMismatch);
                }
                li
            }
            None => {
                if self.locks.len() >= self.cfg.max_locks {
                    return Err(ResourceExhausted);
                }
                self.locks.push(MLock {
                    name: a.name.clone(),
                    limit: a.limit,
                    blocked_until: 0,
                    unblock_pending: false,
                    holders: Vec::new(),
                    queue: Vec::new(),
                });
                self.locks.len() - 1
            }
        };
        let w = self.waiter_of(a, Vec::new());
        let lock = &self.locks[li];
        let available = admits(lock, a.mode, self.cfg.max_limit)
            && lock.blocked_until <= self.now
            && lock.queue.is_empty();
        if available {
            return Ok(Reply::Granted(self.grant(li, w, false, out)));
        }
        if a.wait_ms == 0 {
            return Err(Held);
        }
        let total_waiting: usize = self.locks.iter().map(|l| l.queue.len()).sum();
        if lock.queue.len() >= self.cfg.max_waiters_per_lock
            || total_waiting >= self.cfg.max_waiters
        {
            return Err(ResourceExhausted);
        }
        out.events.push(self.queued_event(a));
        let lock = &mut self.locks[li];
        lock.queue.push(w);
        Ok(Reply::Queued {
            token: a.token,
            position: lock.queue.len() - 1,
        })
    }

    /// After comparing, adopt the core's fence numbering for hand-offs: both number
    /// the grants of one command consecutively, but may interleave locks differently
    /// (e.g. when a session ending frees several locks).
    fn adopt_fences(&mut self, fences: &BTreeMap<OwnerToken, u64>) {
        for l in &mut self.locks {
            for h in &mut l.holders {
                if let Some(f) = fences.get(&h.token) {
                    h.fence = *f;
                }
            }
        }
    }

    /// The model's state in the core's image format (for a whole-state comparison).
    fn image(&self) -> StateImage {
        let mut locks: Vec<LockImage> = self
            .locks
            .iter()
            .map(|l| LockImage {
                name: l.name.clone(),
                limit: l.limit,
                blocked_until_ms: l.blocked_until,
                holders: l
                    .holders
                    .iter()
                    .map(|h| HolderImage {
                        tenant: super::model_tenant(),
                        token: h.token,
                        fence: Fence::new(h.fence).expect("fence > 0"),
                        owner: h.owner.clone(),
                        request_id: h.request_id.clone(),
                        lease: match h.lease {
                            MLease::Own { ttl, deadline } => LeaseImage::Own {
                                ttl_ms: ttl,
                                deadline_ms: deadline,
                            },
                            MLease::Session(id) => LeaseImage::Session(id),
                        },
                        granted_at_ms: h.granted_at,
                        lock_delay_ms: h.lock_delay,
                        mode: h.mode,
                        value: h.value.clone(),
                    })
                    .collect(),
                waiters: l
                    .queue
                    .iter()
                    .map(|w| WaiterImage {
                        tenant: super::model_tenant(),
                        token: w.token,
                        owner: w.owner.clone(),
                        request_id: w.request_id.clone(),
                        ttl_ms: w.ttl,
                        session: w.session,
                        lock_delay_ms: w.lock_delay,
                        enqueued_at_ms: w.enqueued_at,
                        wait_deadline_ms: w.wait_deadline,
                        mode: w.mode,
                        value: w.value.clone(),
                        group: w.group.clone(),
                    })
                    .collect(),
            })
            .collect();
        locks.sort_by(|a, b| a.name.cmp(&b.name));
        let mut sessions: Vec<SessionImage> = self
            .sessions
            .iter()
            .map(|s| SessionImage {
                tenant: super::model_tenant(),
                id: s.id,
                owner: s.owner.clone(),
                ttl_ms: s.ttl,
                deadline_ms: s.deadline,
            })
            .collect();
        sessions.sort_by_key(|s| s.id);
        StateImage {
            now_ms: self.now,
            next_fence: self.next_fence,
            locks,
            sessions,
            recent_ends: self.recent.clone(),
        }
    }
}

// ---------------------------------------------------------------------------------
// The comparison.
// ---------------------------------------------------------------------------------

fn fail(msg: String) -> TestCaseError {
    TestCaseError::fail(msg)
}

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)*) => {
        if !$cond {
            return Err(fail(format!($($fmt)*)));
        }
    };
}

fn reply_kind(r: &Result<Reply, fencelock_core::Error>) -> Result<&Reply, ErrorKind> {
    r.as_ref().map_err(|e| e.kind())
}

fn sort_events(mut events: Vec<Event>) -> Vec<Event> {
    events.sort_by_key(|e| format!("{e:?}"));
    events
}

/// Hand-off grants grouped per lock, each group in grant order.
fn per_lock(grants: &[Grant]) -> BTreeMap<LockName, Vec<(OwnerToken, u64, Option<SessionId>)>> {
    let mut m: BTreeMap<_, Vec<_>> = BTreeMap::new();
    for g in grants {
        m.entry(g.name.clone())
            .or_default()
            .push((g.token, g.ttl_ms, g.session));
    }
    m
}

/// Checks on the core alone, from its state before and after one command.
struct RunChecks {
    /// The largest fence the core ever issued in this run.
    max_fence: u64,
}

impl RunChecks {
    fn check_step(
        &mut self,
        now: u64,
        before: &StateImage,
        after: &StateImage,
        reply: &Result<Reply, fencelock_core::Error>,
        handoffs: &[Grant],
        wait_ends: &[(OwnerToken, LockName, WaitEnd)],
    ) -> Result<(), TestCaseError> {
        let lock_before = |name: &LockName| before.locks.iter().find(|l| l.name == *name);
        let held_before = |token: OwnerToken| {
            before
                .locks
                .iter()
                .any(|l| l.holders.iter().any(|h| h.token == token))
        };

        // Fences: every new grant, in the order made, is larger than any before.
        let mut new_grants: Vec<&Grant> = handoffs.iter().collect();
        // An idempotent retry returns an earlier grant, possibly one handed off
        // earlier in this same command.
        let direct: Vec<&Grant> = match reply {
            Ok(Reply::Granted(g)) => vec![g],
            Ok(Reply::GrantedAll(gs)) => gs.iter().collect(),
            _ => Vec::new(),
        };
        let direct: Vec<&Grant> = direct
            .into_iter()
            .filter(|g| !held_before(g.token) && !handoffs.iter().any(|h| h.token == g.token))
            .collect();
        new_grants.extend(direct.iter().copied());

        // Strict FIFO across modes: a request granted at once found nobody still
        // queued on any of its locks (a reader never jumps a queued writer). The
        // command's own deadlines run first: who left or was granted then is gone.
        for g in &direct {
            if let Some(l) = lock_before(&g.name) {
                let still_queued = l
                    .waiters
                    .iter()
                    .filter(|w| !wait_ends.iter().any(|(t, _, _)| *t == w.token))
                    .filter(|w| !handoffs.iter().any(|h| h.token == w.token))
                    .count();
                ensure!(
                    still_queued == 0,
                    "{} granted at once past {still_queued} queued requests",
                    g.name
                );
            }
        }

        // All or nothing: a hand-off to a part of a multi-lock request grants every
        // part of it in the same command.
        let waiter_before = |token: OwnerToken| {
            before
                .locks
                .iter()
                .flat_map(|l| l.waiters.iter())
                .find(|w| w.token == token)
        };
        for g in handoffs {
            if let Some(w) = waiter_before(g.token) {
                for part in &w.group {
                    ensure!(
                        handoffs.iter().any(|h| h.token == *part),
                        "multi-lock request {:?} partly granted: {:?} on {} without {:?}",
                        w.group,
                        g.token,
                        g.name,
                        part
                    );
                }
            }
        }
        for g in &new_grants {
            ensure!(
                g.fence.get() > self.max_fence,
                "fence {} issued after fence {} (not strictly increasing)",
                g.fence,
                self.max_fence
            );
            self.max_fence = g.fence.get();
        }

        // Lock-delay: no grant on a lock that was delayed past `now`.
        for g in &new_grants {
            if let Some(l) = lock_before(&g.name) {
                ensure!(
                    l.blocked_until_ms <= now,
                    "grant on {} at {now} during lock-delay (until {})",
                    g.name,
                    l.blocked_until_ms
                );
            }
        }

        // Hand-offs go to live waiters, in queue order, skipping nobody who stays.
        for g in handoffs {
            let l = lock_before(&g.name).expect("hand-off on a lock that existed");
            let w = l
                .waiters
                .iter()
                .find(|w| w.token == g.token)
                .ok_or_else(|| fail(format!("hand-off to {:?}, who was not queued", g.token)))?;
            ensure!(
                w.wait_deadline_ms > now,
                "hand-off at {now} to a waiter whose wait ended at {}",
                w.wait_deadline_ms
            );
            if let Some(id) = w.session {
                let s = before.sessions.iter().find(|s| s.id == id);
                ensure!(
                    s.is_some_and(|s| s.deadline_ms > now),
                    "hand-off at {now} to a waiter of an expired session"
                );
            }
        }
        for (name, granted) in per_lock(handoffs) {
            let l = lock_before(&name).expect("checked above");
            let remaining: Vec<OwnerToken> = l
                .waiters
                .iter()
                .map(|w| w.token)
                .filter(|t| !wait_ends.iter().any(|(e, n, _)| e == t && *n == name))
                .collect();
            let granted: Vec<OwnerToken> = granted.iter().map(|g| g.0).collect();
            ensure!(
                remaining.starts_with(&granted),
                "{name}: hand-offs {granted:?} are not the head of the queue {remaining:?}"
            );
        }

        // No deadlock: every queue orders its requests by one global arrival order,
        // so no two requests each wait behind the other.
        check_one_arrival_order(after)?;

        // At most `limit` exclusive holders, never one with a shared holder.
        for l in &after.locks {
            let shared = l.holders.iter().filter(|h| h.mode == Mode::Shared).count();
            let exclusive = l.holders.len() - shared;
            ensure!(
                exclusive <= l.limit as usize,
                "{}: {} holders > limit {}",
                l.name,
                exclusive,
                l.limit
            );
            ensure!(
                exclusive == 0 || shared == 0,
                "{}: a writer together with {shared} readers",
                l.name
            );
        }
        Ok(())
    }
}

/// Fails unless there is one order of requests (a multi-lock request is one
/// request on all of its queues) that every queue agrees with: the "waits behind"
/// relation must have no cycle, so no set of requests can wait for each other.
pub fn check_one_arrival_order(state: &StateImage) -> Result<(), TestCaseError> {
    let request = |w: &WaiterImage| w.group.first().copied().unwrap_or(w.token);
    let mut behind: BTreeMap<OwnerToken, BTreeSet<OwnerToken>> = BTreeMap::new();
    for l in &state.locks {
        for (i, w) in l.waiters.iter().enumerate() {
            let later = l.waiters[i + 1..].iter().map(request);
            behind.entry(request(w)).or_default().extend(later);
        }
    }
    // Peel off requests nobody waits behind; whatever is left holds a cycle.
    while !behind.is_empty() {
        let waiting: BTreeSet<OwnerToken> = behind.values().flatten().copied().collect();
        let first: Vec<OwnerToken> = behind
            .keys()
            .filter(|r| !waiting.contains(r))
            .copied()
            .collect();
        ensure!(
            !first.is_empty(),
            "queues disagree on the arrival order: requests {:?} wait for each other (deadlock)",
            behind.keys().collect::<Vec<_>>()
        );
        for r in first {
            behind.remove(&r);
        }
    }
    Ok(())
}

/// The core and the model side by side, and what the run has seen so far.
struct Runner<'c> {
    core: Core,
    model: Model,
    checks: RunChecks,
    now: u64,
    script: Vec<Step>,
    coverage: &'c mut Coverage,
    /// Multi-lock requests queued and not yet granted or ended, by their tokens.
    pending_groups: BTreeSet<Vec<OwnerToken>>,
}

/// Runs `steps` on a fresh core and on the model, comparing after every step, then
/// checks that nothing deadlocks (see [`Runner::drain`]).
pub fn run(config: Config, steps: &[Step], coverage: &mut Coverage) -> Result<(), TestCaseError> {
    run_core(Core::new(config.clone()), config, steps, coverage)
}

/// [`run`] on a core the caller made (the planted-bug tests switch one of its
/// protections off first).
pub fn run_core(
    core: Core,
    config: Config,
    steps: &[Step],
    coverage: &mut Coverage,
) -> Result<(), TestCaseError> {
    let mut runner = Runner {
        core,
        model: Model::new(config),
        checks: RunChecks { max_fence: 0 },
        now: 0,
        script: Vec::new(),
        coverage,
        pending_groups: BTreeSet::new(),
    };
    for step in steps {
        runner.step(step.clone())?;
    }
    runner.drain()
}

impl Runner<'_> {
    fn step(&mut self, step: Step) -> Result<(), TestCaseError> {
        self.now += step.dt_ms;
        let now = self.now;
        self.script.push(step.clone());
        let i = self.script.len() - 1;
        // Names the failing step and repeats the script up to it (proptest's
        // shrinking may leave harmless steps after the failing one).
        let script = &self.script;
        let at = || {
            let lines: Vec<String> = script.iter().map(|s| format!("{s:?}")).collect();
            format!(
                "step {i} (+{}ms, now={now}) {}\nscript up to here:\n    {}\n",
                step.dt_ms,
                render_command(&step.command),
                lines.join("\n    ")
            )
        };
        let core = &mut self.core;
        let model = &mut self.model;
        let before = core.export();
        let fence_start = model.next_fence;

        let got = core.apply(now, step.command.clone());
        let outcomes = core.take_outcomes();
        self.coverage.count(&got, &outcomes);
        let (want, mout) = model.apply(now, &step.command);

        // Every hand-off grant in the order the core made it (the parts of a
        // multi-lock grant in the order asked), and each multi-lock grant's tokens.
        let mut handoffs = Vec::new();
        let mut groups = Vec::new();
        let mut wait_ends = Vec::new();
        let mut events = Vec::new();
        for o in outcomes {
            match o {
                Outcome::Granted(g) => handoffs.push(g),
                Outcome::GrantedAll(gs) => {
                    groups.push(gs.iter().map(|g| g.token).collect::<Vec<_>>());
                    handoffs.extend(gs);
                }
                Outcome::WaitEnded {
                    token,
                    name,
                    reason,
                } => wait_ends.push((token, name, reason)),
                Outcome::Event(e) => events.push(e),
            }
        }

        // Hand-offs: the same per lock, in the same order; fences consecutive from
        // where the command started, in the order the core emitted them.
        ensure!(
            per_lock(&handoffs) == per_lock(&mout.grants),
            "{}: hand-offs differ\n core:  {handoffs:?}\n model: {:?}",
            at(),
            mout.grants
        );
        let (mut core_groups, mut model_groups) = (groups.clone(), mout.granted_all.clone());
        core_groups.sort();
        model_groups.sort();
        ensure!(
            core_groups == model_groups,
            "{}: multi-lock hand-offs differ\n core:  {core_groups:?}\n model: {model_groups:?}",
            at()
        );
        for (k, g) in handoffs.iter().enumerate() {
            ensure!(
                g.fence.get() == fence_start + k as u64,
                "{}: hand-off fences not consecutive: {handoffs:?}",
                at()
            );
        }
        let fences: BTreeMap<OwnerToken, u64> =
            handoffs.iter().map(|g| (g.token, g.fence.get())).collect();
        model.adopt_fences(&fences);

        // Reply.
        let mut want_reply = want.clone();
        let adopt = |g: &mut Grant| {
            if let Some(f) = fences.get(&g.token) {
                g.fence = Fence::new(*f).expect("fence > 0");
            }
        };
        match &mut want_reply {
            Ok(Reply::Granted(g)) | Ok(Reply::Renewed(g)) => adopt(g),
            Ok(Reply::GrantedAll(gs)) => gs.iter_mut().for_each(adopt),
            _ => {}
        }
        ensure!(
            reply_kind(&got) == want_reply.as_ref().map_err(|k| *k),
            "{}: replies differ\n core:  {got:?}\n model: {want_reply:?}",
            at()
        );

        // Wait ends (each token leaves a queue at most once per command).
        let mut core_ends = wait_ends.clone();
        let mut model_ends = mout.wait_ends.clone();
        core_ends.sort_by_key(|e| e.0);
        model_ends.sort_by_key(|e| e.0);
        ensure!(
            core_ends == model_ends,
            "{}: wait ends differ\n core:  {core_ends:?}\n model: {model_ends:?}",
            at()
        );

        // Events (order within a command is not part of the contract). A grant's
        // owner text names its token (`t<token>`), or a multi-lock request's
        // tokens (`g<token>.<token>…`, one part per lock).
        let model_events: Vec<Event> = mout
            .events
            .into_iter()
            .map(|mut e| {
                if e.kind == EventKind::Granted {
                    let tokens = e.owner.as_str()[1..]
                        .split('.')
                        .map(|t| OwnerToken::from_u128(t.parse().expect("owner names tokens")));
                    for token in tokens {
                        let on_this_lock = handoffs
                            .iter()
                            .any(|g| g.token == token && g.name == e.name);
                        if on_this_lock {
                            e.fence = Fence::new(fences[&token]);
                        }
                    }
                }
                e
            })
            .collect();
        let (core_events, model_events) = (sort_events(events), sort_events(model_events));
        ensure!(
            core_events == model_events,
            "{}: events differ\n core:  {core_events:#?}\n model: {model_events:#?}",
            at()
        );

        // The whole state.
        let after = core.export();
        let model_image = model.image();
        ensure!(
            after == model_image,
            "{}: states differ\n core:  {after:#?}\n model: {model_image:#?}",
            at()
        );

        // The leader query: every election's leader, value and term, as the model
        // has them (the view is a separate path from the image).
        for l in &model.locks {
            let leader = l.holders.iter().find(|h| h.value.is_some());
            let view = core.lock(&l.name);
            let shown = view
                .as_ref()
                .and_then(|v| v.holders.iter().find(|h| h.value.is_some()));
            ensure!(
                leader.map(|h| (h.fence, h.value.clone()))
                    == shown.map(|h| (h.fence.get(), h.value.clone())),
                "{}: leader of {} differs\n core:  {shown:?}\n model: {leader:?}",
                at(),
                l.name
            );
        }

        // Invariants on the core alone.
        self.checks
            .check_step(now, &before, &after, &got, &handoffs, &wait_ends)
            .map_err(|e| fail(format!("{}: {e}", at())))?;
        if let Ok(Reply::Granted(g)) = &got {
            let held_before = before
                .locks
                .iter()
                .any(|l| l.holders.iter().any(|h| h.token == g.token));
            if held_before || handoffs.iter().any(|h| h.token == g.token) {
                self.coverage.retried_grants += 1;
            }
        }
        if let Err(broken) = core.check_invariants() {
            return Err(fail(format!("{}: check_invariants: {broken}", at())));
        }

        // Multi-lock requests still owed an answer.
        // (A retry answers with the first request's tokens: not a new request.)
        if let (Command::AcquireAll(parts), Ok(Reply::QueuedAll { tokens })) = (&step.command, &got)
        {
            if parts.iter().map(|p| p.token).eq(tokens.iter().copied()) {
                self.pending_groups.insert(tokens.clone());
            }
        }
        for g in &groups {
            self.pending_groups.remove(g);
        }
        self.pending_groups
            .retain(|g| !wait_ends.iter().any(|(t, _, _)| g.contains(t)));
        Ok(())
    }

    /// No deadlock: every holder releases (again and again as hand-offs make new
    /// holders), and when only waiters are left time moves to the next deadline
    /// (a lock-delay's end, a wait's end); then time passes every lease and wait.
    /// By then every queued multi-lock request must have been granted or have
    /// left its queues (timed out, cancelled, its session ended), and nothing is
    /// left held or queued. Each of these steps is compared with the model too.
    fn drain(&mut self) -> Result<(), TestCaseError> {
        for _ in 0..500 {
            let state = self.core.export();
            let waiting: usize = state.locks.iter().map(|l| l.waiters.len()).sum();
            if waiting == 0 {
                break;
            }
            let held: Vec<(LockName, OwnerToken)> = state
                .locks
                .iter()
                .flat_map(|l| l.holders.iter().map(|h| (l.name.clone(), h.token)))
                .collect();
            if held.is_empty() {
                let Some(at) = self.core.next_deadline_ms() else {
                    return Err(fail(format!(
                        "deadlock: {waiting} queued requests, no holder, no deadline\n{state:#?}"
                    )));
                };
                let dt_ms = at.saturating_sub(self.now);
                self.step(Step {
                    dt_ms,
                    command: Command::Tick,
                })?;
            }
            for (name, token) in held {
                self.step(Step {
                    dt_ms: 0,
                    command: Command::Release { name, token },
                })?;
            }
        }
        // Past every lease and wait, then past the lock-delay their expiry starts.
        let cfg = self.core.config();
        let (beyond, delay) = (
            cfg.max_ttl_ms + cfg.max_wait_ms + 1,
            cfg.max_lock_delay_ms + 1,
        );
        for dt_ms in [beyond, delay] {
            self.step(Step {
                dt_ms,
                command: Command::Tick,
            })?;
        }
        ensure!(
            self.pending_groups.is_empty(),
            "deadlock: multi-lock requests {:?} were neither granted nor ended",
            self.pending_groups
        );
        let state = self.core.export();
        ensure!(
            state.locks.is_empty(),
            "after every holder released and every lease passed, locks remain: {:#?}",
            state.locks
        );
        Ok(())
    }
}

/// What the generated runs exercised. A comparison that never sees a hand-off, a
/// lock-delay or a multi-lock hand-off proves nothing about them, so the property
/// test asserts these.
#[derive(Debug, Default)]
pub struct Coverage {
    pub handoffs: usize,
    pub session_handoffs: usize,
    pub queued: usize,
    pub lock_delay_refusals: usize,
    pub retried_grants: usize,
    pub expired_errors: usize,
    pub forced: usize,
    pub wait_ends: BTreeMap<String, usize>,
    /// Multi-lock requests granted at once.
    pub multi_granted: usize,
    /// Multi-lock requests queued.
    pub multi_queued: usize,
    /// Multi-lock requests granted by hand-off.
    pub multi_handoffs: usize,
    /// Multi-lock requests that left their queues without a grant.
    pub multi_wait_ends: usize,
    /// Several grants released in one command.
    pub released_all: usize,
    /// Election campaigns granted (leadership taken, directly or by hand-off).
    pub leaders: usize,
    /// Values a leader proclaimed.
    pub proclaimed: usize,
}

impl Coverage {
    fn count(&mut self, reply: &Result<Reply, fencelock_core::Error>, outcomes: &[Outcome]) {
        match reply {
            Ok(Reply::Queued { .. }) => self.queued += 1,
            Ok(Reply::ForceReleased { .. }) => self.forced += 1,
            Ok(Reply::GrantedAll(_)) => self.multi_granted += 1,
            Ok(Reply::QueuedAll { .. }) => self.multi_queued += 1,
            Ok(Reply::ReleasedAll { released }) if released.len() > 1 => self.released_all += 1,
            Ok(Reply::Proclaimed(_)) => self.proclaimed += 1,
            Err(e) if e.kind() == ErrorKind::Held && e.message().contains("lock-delay") => {
                self.lock_delay_refusals += 1
            }
            Err(e) if e.kind() == ErrorKind::Expired => self.expired_errors += 1,
            _ => {}
        }
        for o in outcomes {
            match o {
                Outcome::GrantedAll(_) => self.multi_handoffs += 1,
                Outcome::Granted(g) => {
                    self.handoffs += 1;
                    self.session_handoffs += usize::from(g.session.is_some());
                }
                Outcome::WaitEnded { reason, .. } => {
                    *self.wait_ends.entry(format!("{reason:?}")).or_default() += 1;
                }
                Outcome::Event(e) => {
                    // A multi-lock request's owner text is `g<tokens>`.
                    let part = e.owner.as_str().starts_with('g');
                    self.multi_wait_ends +=
                        usize::from(part && matches!(e.kind, EventKind::WaitEnded(_)));
                    self.leaders += usize::from(e.kind == EventKind::Granted && e.value.is_some());
                }
            }
        }
    }
}
