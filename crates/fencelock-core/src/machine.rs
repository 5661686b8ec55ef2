//! The lock state machine.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

use crate::command::{
    Acquire, Command, Error, ErrorKind, Event, EventKind, Grant, GrantEnd, InvariantError,
    InvariantErrorKind, Outcome, Quota, Reply, WaitEnd,
};
use crate::idhash::IdMap;
use crate::image::{HolderImage, LeaseImage, LockImage, SessionImage, StateImage, WaiterImage};
use crate::types::{
    Fence, LockName, Mode, Owner, OwnerToken, Reason, RequestId, SessionId, Tenant, Value,
};

/// A live state that breaks an invariant.
fn broken(message: impl Into<String>) -> InvariantError {
    InvariantError::new(InvariantErrorKind::Broken, message)
}

/// An image that breaks an invariant.
fn bad_image(message: impl Into<String>) -> InvariantError {
    InvariantError::new(InvariantErrorKind::BadImage, message)
}

/// The highest fence floor [`Command::RaiseFenceFloor`] accepts: 2^63, which leaves
/// 2^63 fences (centuries at any rate) before the counter could run out.
pub const MAX_FENCE_FLOOR: u64 = 1 << 63;

/// Most names in one multi-lock request ([`Command::AcquireAll`]) or one
/// [`Command::ReleaseAll`].
pub const MAX_NAMES_PER_REQUEST: usize = 64;

/// Bounds and ranges the core enforces. Every queue and table is bounded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Shortest lease (and session) a client may ask for.
    pub min_ttl_ms: u64,
    /// Longest lease (and session) a client may ask for.
    pub max_ttl_ms: u64,
    /// Longest `wait_ms`.
    pub max_wait_ms: u64,
    /// Longest `lock_delay_ms`.
    pub max_lock_delay_ms: u64,
    /// Largest semaphore `limit`.
    pub max_limit: u32,
    /// Most locks that may exist at once (held, queued for, or in lock-delay).
    pub max_locks: usize,
    /// Most queued requests per lock.
    pub max_waiters_per_lock: usize,
    /// Most queued requests in total.
    pub max_waiters: usize,
    /// Most open sessions.
    pub max_sessions: usize,
    /// Most locks held or queued for by one session.
    pub max_locks_per_session: usize,
    /// How many ended grants are remembered so renew/release can say *why* they did
    /// nothing (`expired` vs `not_held`).
    pub max_recent_ends: usize,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            min_ttl_ms: 10,
            max_ttl_ms: 24 * 3600 * 1000,
            max_wait_ms: 3600 * 1000,
            max_lock_delay_ms: 60 * 1000,
            max_limit: 1024,
            max_locks: 4_000_000,
            max_waiters_per_lock: 10_000,
            max_waiters: 1_000_000,
            max_sessions: 1_000_000,
            max_locks_per_session: 10_000,
            max_recent_ends: 65_536,
        }
    }
}

/// A lease: either the holder's own, or its session's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lease {
    Own { ttl_ms: u64, deadline_ms: u64 },
    Session(SessionId),
}

#[derive(Debug, Clone)]
struct Holder {
    name: LockName,
    fence: Fence,
    owner: Owner,
    request_id: Option<RequestId>,
    lease: Lease,
    granted_at_ms: u64,
    lock_delay_ms: u64,
    tenant: Option<Tenant>,
    mode: Mode,
    value: Option<Value>,
}

#[derive(Debug, Clone)]
struct Waiter {
    name: LockName,
    owner: Owner,
    request_id: Option<RequestId>,
    ttl_ms: Option<u64>,
    session: Option<SessionId>,
    lock_delay_ms: u64,
    enqueued_at_ms: u64,
    wait_deadline_ms: u64,
    tenant: Option<Tenant>,
    mode: Mode,
    value: Option<Value>,
    /// A multi-lock request's parts (this one included), in the order asked.
    group: Option<Arc<[OwnerToken]>>,
}

#[derive(Debug, Clone, Default)]
struct Lock {
    limit: u32,
    /// Tokens of the holders, in grant order (so in fence order).
    holders: Vec<OwnerToken>,
    /// How many of the holders are shared.
    shared: usize,
    /// Tokens of queued requests, FIFO.
    waiters: VecDeque<OwnerToken>,
    /// No grants before this service time (lock-delay).
    blocked_until_ms: u64,
}

#[derive(Debug, Clone)]
struct Session {
    owner: Owner,
    /// The principal that opened it (`None`: an old record's, owned by nobody).
    tenant: Option<Tenant>,
    ttl_ms: u64,
    deadline_ms: u64,
    holders: BTreeSet<OwnerToken>,
    waiters: BTreeSet<OwnerToken>,
}

/// What one principal uses now, kept in step with the tables on every grant,
/// release, expiry, hand-off and session end (checked by
/// [`Core::check_invariants`]). A queued request counts in `waiting` only; quotas
/// compare `held + waiting` with `max_held_locks`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Usage {
    sessions: u64,
    held: u64,
    waiting: u64,
}

/// The lock table's key: the name, with its first 16 bytes also kept inline (zero
/// padded, big-endian) so that almost every compare while walking the table is one
/// integer compare instead of a pointer chase into the name's heap text. With a
/// million locks a walk makes a few dozen compares, and chasing the text of each
/// was most of an `acquire`'s cost (and of a restart's log replay).
///
/// Orders exactly like the names: names hold no NUL (no control characters), so
/// zero padding sorts a name before every longer name it prefixes; equal heads of
/// two names that are not both longer than 16 bytes mean equal names.
#[derive(Debug, Clone)]
struct NameKey {
    head: u128,
    name: LockName,
}

/// Bytes of a name kept inline in [`NameKey`].
const NAME_HEAD_BYTES: usize = 16;

impl NameKey {
    fn new(name: LockName) -> NameKey {
        let bytes = name.as_str().as_bytes();
        let n = bytes.len().min(NAME_HEAD_BYTES);
        let mut head = [0u8; NAME_HEAD_BYTES];
        head[..n].copy_from_slice(&bytes[..n]);
        debug_assert!(!bytes.contains(&0), "lock names hold no NUL");
        NameKey {
            head: u128::from_be_bytes(head),
            name,
        }
    }

    fn of(name: &LockName) -> NameKey {
        NameKey::new(name.clone())
    }
}

impl Ord for NameKey {
    fn cmp(&self, other: &NameKey) -> std::cmp::Ordering {
        self.head.cmp(&other.head).then_with(|| {
            let (a, b) = (self.name.as_str(), other.name.as_str());
            // The lengths live in the (fat) pointers: no pointer chase for short names.
            if a.len() <= NAME_HEAD_BYTES && b.len() <= NAME_HEAD_BYTES {
                std::cmp::Ordering::Equal
            } else {
                a.as_bytes()[NAME_HEAD_BYTES.min(a.len())..]
                    .cmp(&b.as_bytes()[NAME_HEAD_BYTES.min(b.len())..])
            }
        })
    }
}

impl PartialOrd for NameKey {
    fn partial_cmp(&self, other: &NameKey) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for NameKey {
    fn eq(&self, other: &NameKey) -> bool {
        self.cmp(other).is_eq()
    }
}

impl Eq for NameKey {}

/// A deadline the core must act on. Ordered, so same-instant deadlines are processed
/// in a fixed order and replay is deterministic.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Timer {
    Session(SessionId),
    Lease(OwnerToken),
    Wait(OwnerToken),
    Unblock(LockName),
}

/// The read-only view of one holder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HolderView {
    /// Its fence.
    pub fence: Fence,
    /// Its owner text.
    pub owner: Owner,
    /// Its session, if session-held.
    pub session: Option<SessionId>,
    /// How long it has held the lock.
    pub held_ms: u64,
    /// Lease time left (the session's, if session-held).
    pub ttl_remaining_ms: u64,
    /// Exclusive or shared.
    pub mode: Mode,
    /// An election leader's value.
    pub value: Option<Value>,
}

/// The read-only view of one lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockView {
    /// The lock.
    pub name: LockName,
    /// How many holders it admits.
    pub limit: u32,
    /// Current holders, in grant order.
    pub holders: Vec<HolderView>,
    /// Queued requests.
    pub waiters: usize,
    /// Lock-delay time left (0 if none).
    pub lock_delay_remaining_ms: u64,
    /// The first queued requests, in queue order, at most [`MAX_VIEW_WAITERS`];
    /// filled by [`Core::lock`] and [`Core::lock_at`] only (empty in
    /// [`Core::locks`], so listing stays O(locks)).
    pub waiting: Vec<WaiterView>,
    /// How many of the `waiters` asked for a shared grant (the rest exclusive);
    /// counted by [`Core::lock`] and [`Core::lock_at`] only (0 in [`Core::locks`]).
    pub shared_waiters: usize,
}

/// Most waiters listed in one [`LockView::waiting`].
pub const MAX_VIEW_WAITERS: usize = 100;

/// The read-only view of one queued request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WaiterView {
    /// Its place in the queue (0: next to be granted).
    pub position: usize,
    /// Its owner text.
    pub owner: Owner,
    /// Its session, if it asked for a session-held grant.
    pub session: Option<SessionId>,
    /// How long it has been queued.
    pub waiting_ms: u64,
    /// The mode it asked for.
    pub mode: Mode,
}

/// The read-only view of one open session (for operators; the id is the owner's
/// secret and the server shows it to nobody else).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionView {
    /// The session.
    pub id: SessionId,
    /// Its owner text.
    pub owner: Owner,
    /// The principal that opened it (`None`: opened before principals were recorded).
    pub tenant: Option<Tenant>,
    /// Its lease length.
    pub ttl_ms: u64,
    /// Lease time left.
    pub ttl_remaining_ms: u64,
    /// Locks it holds.
    pub holding: Vec<LockName>,
    /// Locks it waits for.
    pub waiting: Vec<LockName>,
}

/// Counts for gauges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Stats {
    /// Locks that exist (held, queued for, or in lock-delay).
    pub locks: usize,
    /// Grants currently held.
    pub holders: usize,
    /// Requests currently queued.
    pub waiters: usize,
    /// Open sessions.
    pub sessions: usize,
    /// The fence the next grant will get.
    pub next_fence: u64,
    /// Grants currently held in shared mode (the rest are exclusive).
    pub shared_holders: usize,
    /// Requests currently queued in shared mode (the rest are exclusive).
    pub shared_waiters: usize,
}

/// The sans-IO lock state machine.
///
/// # Driver contract
/// - Feed commands with a **monotonic service time** `now_ms` that never goes
///   backwards, also across restarts (the server continues from the last logged time).
/// - Persist every command (with its `now_ms`) before releasing its reply or any
///   outcome it produced; replaying the same `(now_ms, command)` sequence on a fresh
///   core (or on an imported snapshot) yields the same state and the same outputs.
/// - After every command, drain [`Core::take_outcomes`] and deliver them.
/// - Propose [`Command::Tick`] once [`Core::next_deadline_ms`] has passed; every
///   command also processes the deadlines due at its `now_ms` first.
#[derive(Debug, Clone)]
pub struct Core {
    config: Config,
    now_ms: u64,
    next_fence: u64,
    /// Every lock record, in name order (for listing by prefix).
    locks: BTreeMap<NameKey, Lock>,
    holders: IdMap<OwnerToken, Holder>,
    waiters: IdMap<OwnerToken, Waiter>,
    sessions: IdMap<SessionId, Session>,
    /// Per-principal usage, for quotas; a principal using nothing has no entry.
    usage: HashMap<Tenant, Usage>,
    request_ids: HashMap<(LockName, RequestId), OwnerToken>,
    timers: BTreeSet<(u64, Timer)>,
    recent_ends: IdMap<OwnerToken, (LockName, GrantEnd)>,
    recent_order: VecDeque<OwnerToken>,
    outcomes: Vec<Outcome>,
    /// Shared holders and shared waiters, for [`Stats`].
    shared_holders: usize,
    shared_waiters: usize,
    #[cfg(feature = "planted-bugs")]
    planted: PlantedBugs,
}

/// Protections a simulation test switches off, one at a time, to show that its checker
/// catches their absence. Compiled in only with the `planted-bugs` feature (enabled by
/// `fencelock-sim` alone, never by the server or the CLI), and all off unless
/// [`Core::plant_bugs`] is called.
#[cfg(feature = "planted-bugs")]
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PlantedBugs {
    /// Release checks the lock name only: a token that does not hold `name` releases
    /// the first holder of `name` instead of getting `not_held`.
    pub release_by_name_only: bool,
    /// Hand-off grants the head waiter even when its wait or its session is over.
    pub grant_expired_waiters: bool,
    /// An expired grant is not taken off its principal's usage (so the principal
    /// is refused by its quota while holding less than it).
    pub leak_usage_on_expiry: bool,
    /// An acquire retried with its request id while queued goes to the back of
    /// the queue (as if the retry were a new request): it loses its place.
    pub requeue_retries: bool,
    /// A reader arriving while readers hold the lock is granted at once, even past
    /// a queued writer.
    pub reader_jumps_writer: bool,
    /// A multi-lock request at the head of one queue is granted that lock alone,
    /// without waiting to be grantable on all of its locks.
    pub partial_multi_grant: bool,
    /// An election campaign is granted the last fence issued again instead of a
    /// new one: a term reused.
    pub reuse_term: bool,
    /// Not a bug: skips the core's own invariant check after each command (debug
    /// builds), so a test shows that *its* checker catches a planted bug alone.
    pub no_check_after_command: bool,
}

fn err(kind: ErrorKind, message: impl Into<String>) -> Error {
    Error::new(kind, message)
}

/// Whether `lock` can take one more holder in `mode` now (lock-delay and the queue
/// aside): exclusive and shared holders never mix; exclusive holders are at most
/// `limit`; shared ones at most `limit`, or `max_limit` on a lock with `limit` 1
/// (a reader-writer lock admits any number of readers).
fn admits(lock: &Lock, mode: Mode, max_limit: u32) -> bool {
    let exclusive = lock.holders.len() - lock.shared;
    match mode {
        Mode::Exclusive => lock.shared == 0 && exclusive < lock.limit as usize,
        Mode::Shared => exclusive == 0 && lock.shared < reader_limit(lock.limit, max_limit),
    }
}

/// Most shared holders a lock with `limit` admits.
fn reader_limit(limit: u32, max_limit: u32) -> usize {
    if limit == 1 {
        max_limit.max(1) as usize
    } else {
        limit as usize
    }
}

fn check_range(what: &str, value: u64, min: u64, max: u64) -> Result<(), Error> {
    if value < min || value > max {
        return Err(err(
            ErrorKind::InvalidArgument,
            format!("{what} must be between {min} and {max}, got {value}"),
        ));
    }
    Ok(())
}

impl Core {
    /// An empty core. The first fence it issues is 1.
    pub fn new(config: Config) -> Core {
        Core {
            config,
            now_ms: 0,
            next_fence: 1,
            locks: BTreeMap::new(),
            holders: IdMap::default(),
            waiters: IdMap::default(),
            sessions: IdMap::default(),
            usage: HashMap::new(),
            request_ids: HashMap::new(),
            timers: BTreeSet::new(),
            recent_ends: IdMap::default(),
            recent_order: VecDeque::new(),
            outcomes: Vec::new(),
            shared_holders: 0,
            shared_waiters: 0,
            #[cfg(feature = "planted-bugs")]
            planted: PlantedBugs::default(),
        }
    }

    /// Switches off the protections `bugs` names (for the simulation's planted-bug
    /// tests only). Not carried by [`Core::export`]: a recovered core has none.
    #[cfg(feature = "planted-bugs")]
    #[doc(hidden)]
    pub fn plant_bugs(&mut self, bugs: PlantedBugs) {
        self.planted = bugs;
    }

    /// Sets the next fence to `next`, lower or not (the cluster simulation's
    /// "fence from a member-local counter" planted bug).
    #[cfg(feature = "planted-bugs")]
    #[doc(hidden)]
    pub fn plant_next_fence(&mut self, next: u64) {
        self.next_fence = next;
    }

    /// The bounds in force.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The latest service time the core has seen.
    pub fn now_ms(&self) -> u64 {
        self.now_ms
    }

    /// The earliest deadline (lease, wait, session, lock-delay) still pending.
    pub fn next_deadline_ms(&self) -> Option<u64> {
        self.timers.first().map(|(at, _)| *at)
    }

    /// Takes the outcomes produced since the last call, in order.
    pub fn take_outcomes(&mut self) -> Vec<Outcome> {
        std::mem::take(&mut self.outcomes)
    }

    /// Drops the outcomes produced since the last call (when replaying a log, whose
    /// outcomes were delivered before), keeping their buffer for the next command.
    pub fn discard_outcomes(&mut self) {
        self.outcomes.clear();
    }

    /// Makes room for `grants` more holders (and their request ids) without growing
    /// the tables: before replaying that many log records, say. Growing them in the
    /// middle of a replay moves, and rehashes, every entry of a million-lock state.
    pub fn reserve(&mut self, grants: usize) {
        self.holders.reserve(grants);
        self.request_ids.reserve(grants);
    }

    /// Counts for gauges.
    pub fn stats(&self) -> Stats {
        Stats {
            locks: self.locks.len(),
            holders: self.holders.len(),
            waiters: self.waiters.len(),
            sessions: self.sessions.len(),
            next_fence: self.next_fence,
            shared_holders: self.shared_holders,
            shared_waiters: self.shared_waiters,
        }
    }

    /// Applies one command at service time `now_ms`. Deadlines due at `now_ms` are
    /// processed first. An `Err` changed nothing except those deadlines.
    pub fn apply(&mut self, now_ms: u64, command: Command) -> Result<Reply, Error> {
        debug_assert!(now_ms >= self.now_ms, "service time went backwards");
        self.now_ms = self.now_ms.max(now_ms);
        self.process_deadlines();
        let reply = match command {
            Command::Acquire(acquire) => self.acquire(acquire),
            Command::AcquireAll(parts) => self.acquire_all(parts),
            Command::Downgrade { name, token } => self.downgrade(name, token),
            Command::Proclaim { name, token, value } => self.proclaim(name, token, value),
            Command::ReleaseAll { grants } => self.release_all(grants),
            Command::Renew {
                name,
                token,
                ttl_ms,
            } => self.renew(name, token, ttl_ms),
            Command::Release { name, token } => self.release(name, token),
            Command::ForceRelease {
                name,
                fence,
                reason,
            } => self.force_release(name, fence, reason),
            Command::CancelWait { name, token } => Ok(self.cancel_wait(&name, token)),
            Command::OpenSession {
                id,
                ttl_ms,
                owner,
                tenant,
                quota,
            } => self.open_session(id, ttl_ms, owner, tenant, quota),
            Command::KeepAlive { id } => self.keep_alive(id),
            Command::CloseSession { id } => self.close_session(id),
            Command::Tick => Ok(Reply::Ticked),
            Command::Recover => {
                self.recover();
                Ok(Reply::Recovered)
            }
            Command::Promote => {
                self.refresh_leases();
                Ok(Reply::Promoted)
            }
            Command::RaiseFenceFloor { floor } => {
                if floor > MAX_FENCE_FLOOR {
                    return Err(err(
                        ErrorKind::InvalidArgument,
                        format!("fence floor must be at most {MAX_FENCE_FLOOR}, got {floor}"),
                    ));
                }
                self.next_fence = self.next_fence.max(floor).max(1);
                Ok(Reply::FenceFloorRaised {
                    next_fence: self.next_fence,
                })
            }
        };
        #[cfg(all(debug_assertions, feature = "planted-bugs"))]
        let check = !self.planted.no_check_after_command;
        #[cfg(all(debug_assertions, not(feature = "planted-bugs")))]
        let check = true;
        #[cfg(debug_assertions)]
        if check && self.holders.len() + self.waiters.len() < 512 {
            if let Err(broken) = self.check_invariants() {
                panic!("invariant broken after command: {broken}");
            }
        }
        reply
    }

    fn check_ttl(&self, what: &str, ttl_ms: u64) -> Result<(), Error> {
        check_range(what, ttl_ms, self.config.min_ttl_ms, self.config.max_ttl_ms)
    }

    /// Checks one acquire's arguments (the parts that need no state).
    fn check_acquire_args(&self, a: &Acquire) -> Result<(), Error> {
        match (a.ttl_ms, a.session) {
            (Some(_), Some(_)) => {
                return Err(err(
                    ErrorKind::InvalidArgument,
                    "give either ttl_ms or session, not both: a session-held lock lives on the session's lease",
                ))
            }
            (None, None) => {
                return Err(err(
                    ErrorKind::InvalidArgument,
                    "ttl_ms is required when no session is given",
                ))
            }
            (Some(ttl_ms), None) => self.check_ttl("ttl_ms", ttl_ms)?,
            (None, Some(_)) => {}
        }
        let c = &self.config;
        check_range("limit", u64::from(a.limit), 1, u64::from(c.max_limit))?;
        check_range("wait_ms", a.wait_ms, 0, c.max_wait_ms)?;
        check_range("lock_delay_ms", a.lock_delay_ms, 0, c.max_lock_delay_ms)?;
        if a.value.is_some() && (a.mode != Mode::Exclusive || a.limit != 1) {
            return Err(err(
                ErrorKind::InvalidArgument,
                "an election campaign (an acquire with a value) is exclusive with limit 1",
            ));
        }
        Ok(())
    }

    fn acquire(&mut self, a: Acquire) -> Result<Reply, Error> {
        self.check_acquire_args(&a)?;

        // Idempotent retry: the same request id on the same lock gets the same answer.
        if let Some(request_id) = &a.request_id {
            let key = (a.name.clone(), request_id.clone());
            if let Some(&token) = self.request_ids.get(&key) {
                if self.holders.contains_key(&token) {
                    return Ok(Reply::Granted(self.grant_of(token)));
                }
                if self.waiters.contains_key(&token) {
                    #[cfg(feature = "planted-bugs")]
                    if self.planted.requeue_retries {
                        let lock = self.locks.get_mut(&NameKey::of(&a.name));
                        let queue = &mut lock.expect("indexed waiter's lock").waiters;
                        queue.retain(|t| *t != token);
                        queue.push_back(token);
                    }
                    let position = self.locks[&NameKey::of(&a.name)]
                        .waiters
                        .iter()
                        .position(|t| *t == token)
                        .expect("indexed waiter is queued");
                    return Ok(Reply::Queued { token, position });
                }
                unreachable!("request id index points at a live grant or waiter");
            }
        }

        if let Some(id) = a.session {
            // Another principal's session answers exactly like a missing one: its
            // existence is not revealed.
            let session = self
                .sessions
                .get(&id)
                .filter(|s| s.tenant == a.tenant)
                .ok_or_else(|| Self::session_missing(id))?;
            if session.holders.len() + session.waiters.len() >= self.config.max_locks_per_session {
                return Err(err(
                    ErrorKind::ResourceExhausted,
                    format!(
                        "session {id} already holds or waits for {} locks",
                        self.config.max_locks_per_session
                    ),
                ));
            }
        }
        if self.holders.contains_key(&a.token) || self.waiters.contains_key(&a.token) {
            return Err(err(
                ErrorKind::InvalidArgument,
                "owner token already in use",
            ));
        }
        if self.next_fence == u64::MAX {
            return Err(err(ErrorKind::ResourceExhausted, "fence space exhausted"));
        }
        // Checked before anything changes: a grant or a queued request both count
        // against `max_held_locks` (see [`Quota`]).
        self.check_held_quota(a.tenant.as_ref(), a.quota.as_ref(), 1)?;

        let now = self.now_ms;
        // One walk of the lock table for the common case: `entry` both decides and,
        // when the lock is free, takes it (pushes the holder) before `grant` runs.
        // With a million locks every walk costs a few microseconds of string
        // compares; this path used to walk it three times.
        let at_capacity = self.locks.len() >= self.config.max_locks;
        let max_limit = self.config.max_limit;
        #[cfg(feature = "planted-bugs")]
        let jump = self.planted.reader_jumps_writer && a.mode == Mode::Shared;
        #[cfg(not(feature = "planted-bugs"))]
        let jump = false;
        let (available, queue_len) = match self.locks.entry(NameKey::of(&a.name)) {
            Entry::Occupied(mut entry) => {
                let lock = entry.get_mut();
                if lock.limit != a.limit {
                    return Err(err(
                        ErrorKind::LimitMismatch,
                        format!(
                            "lock {} exists with limit {}, request asked for {}",
                            a.name, lock.limit, a.limit
                        ),
                    ));
                }
                let free = admits(lock, a.mode, max_limit);
                let blocked = lock.blocked_until_ms > now;
                // Strict FIFO across modes: anyone queued (a writer above all) goes
                // first, so readers cannot starve a writer.
                let queue_clear = lock.waiters.is_empty() || (jump && lock.shared > 0);
                let available = free && !blocked && queue_clear;
                if available {
                    lock.holders.push(a.token);
                    lock.shared += usize::from(a.mode == Mode::Shared);
                }
                (available, lock.waiters.len())
            }
            Entry::Vacant(entry) => {
                if at_capacity {
                    return Err(err(
                        ErrorKind::ResourceExhausted,
                        format!(
                            "the server holds its maximum of {} locks",
                            self.config.max_locks
                        ),
                    ));
                }
                entry.insert(Lock {
                    limit: a.limit,
                    holders: vec![a.token],
                    shared: usize::from(a.mode == Mode::Shared),
                    ..Lock::default()
                });
                (true, 0)
            }
        };

        if available {
            let waiter = Waiter {
                name: a.name,
                owner: a.owner,
                request_id: a.request_id,
                ttl_ms: a.ttl_ms,
                session: a.session,
                lock_delay_ms: a.lock_delay_ms,
                enqueued_at_ms: now,
                wait_deadline_ms: now,
                tenant: a.tenant,
                mode: a.mode,
                value: a.value,
                group: None,
            };
            let grant = self.grant_pushed(a.token, waiter, false);
            return Ok(Reply::Granted(grant));
        }

        if a.wait_ms == 0 {
            let lock = &self.locks[&NameKey::of(&a.name)];
            let message = if lock.blocked_until_ms > now {
                format!(
                    "lock {} is in lock-delay for {} more ms",
                    a.name,
                    lock.blocked_until_ms - now
                )
            } else {
                format!(
                    "lock {} is held ({} of {} holders, {} queued)",
                    a.name,
                    lock.holders.len(),
                    lock.limit,
                    lock.waiters.len()
                )
            };
            return Err(err(ErrorKind::Held, message));
        }
        if queue_len >= self.config.max_waiters_per_lock
            || self.waiters.len() >= self.config.max_waiters
        {
            return Err(err(
                ErrorKind::ResourceExhausted,
                format!("too many queued requests for lock {}", a.name),
            ));
        }
        self.check_waiter_quota(a.tenant.as_ref(), a.quota.as_ref(), 1)?;

        // Queue.
        let deadline = now.saturating_add(a.wait_ms);
        if let Some(request_id) = &a.request_id {
            self.request_ids
                .insert((a.name.clone(), request_id.clone()), a.token);
        }
        if let Some(id) = a.session {
            self.sessions
                .get_mut(&id)
                .expect("checked above")
                .waiters
                .insert(a.token);
        }
        self.timers.insert((deadline, Timer::Wait(a.token)));
        let lock = self
            .locks
            .get_mut(&NameKey::of(&a.name))
            .expect("exists when not available");
        lock.waiters.push_back(a.token);
        let position = lock.waiters.len() - 1;
        self.count(a.tenant.as_ref(), |u| u.waiting += 1);
        self.shared_waiters += usize::from(a.mode == Mode::Shared);
        self.outcomes.push(Outcome::Event(Event {
            kind: EventKind::Queued,
            name: a.name.clone(),
            fence: None,
            owner: a.owner.clone(),
            session: a.session,
            tenant: a.tenant.clone(),
            at_ms: now,
            duration_ms: 0,
            reason: None,
            mode: a.mode,
            value: a.value.clone(),
            handoff: false,
        }));
        self.waiters.insert(
            a.token,
            Waiter {
                name: a.name,
                owner: a.owner,
                request_id: a.request_id,
                ttl_ms: a.ttl_ms,
                session: a.session,
                lock_delay_ms: a.lock_delay_ms,
                enqueued_at_ms: now,
                wait_deadline_ms: deadline,
                tenant: a.tenant,
                mode: a.mode,
                value: a.value,
                group: None,
            },
        );
        Ok(Reply::Queued {
            token: a.token,
            position,
        })
    }

    /// Turns `w` (already removed from any queue) into a holder with a new fence.
    fn grant(&mut self, token: OwnerToken, w: Waiter) -> Grant {
        let lock = self
            .locks
            .get_mut(&NameKey::of(&w.name))
            .expect("lock exists for a grant");
        lock.holders.push(token);
        lock.shared += usize::from(w.mode == Mode::Shared);
        self.grant_pushed(token, w, true)
    }

    /// [`Core::grant`] once `token` is already pushed onto its lock's holders.
    fn grant_pushed(&mut self, token: OwnerToken, w: Waiter, handoff: bool) -> Grant {
        let now = self.now_ms;
        #[cfg(feature = "planted-bugs")]
        if self.planted.reuse_term && w.value.is_some() && self.next_fence > 1 {
            self.next_fence -= 1;
        }
        let fence = Fence::new(self.next_fence).expect("fences start at 1");
        assert!(self.next_fence < u64::MAX, "fence space exhausted");
        self.next_fence += 1;
        self.shared_holders += usize::from(w.mode == Mode::Shared);
        let lease = match (w.session, w.ttl_ms) {
            (Some(id), _) => {
                self.sessions
                    .get_mut(&id)
                    .expect("granted waiter's session is live")
                    .holders
                    .insert(token);
                Lease::Session(id)
            }
            (None, Some(ttl_ms)) => {
                let deadline_ms = now + ttl_ms;
                self.timers.insert((deadline_ms, Timer::Lease(token)));
                Lease::Own {
                    ttl_ms,
                    deadline_ms,
                }
            }
            (None, None) => unreachable!("validated at acquire"),
        };
        if let Some(request_id) = &w.request_id {
            self.request_ids
                .insert((w.name.clone(), request_id.clone()), token);
        }
        debug_assert!(self.locks[&NameKey::of(&w.name)].holders.contains(&token));
        self.count(w.tenant.as_ref(), |u| u.held += 1);
        self.outcomes.push(Outcome::Event(Event {
            kind: EventKind::Granted,
            name: w.name.clone(),
            fence: Some(fence),
            owner: w.owner.clone(),
            session: w.session,
            tenant: w.tenant.clone(),
            at_ms: now,
            duration_ms: now - w.enqueued_at_ms,
            reason: None,
            mode: w.mode,
            value: w.value.clone(),
            handoff,
        }));
        self.holders.insert(
            token,
            Holder {
                name: w.name,
                fence,
                owner: w.owner,
                request_id: w.request_id,
                lease,
                granted_at_ms: now,
                lock_delay_ms: w.lock_delay_ms,
                tenant: w.tenant,
                mode: w.mode,
                value: w.value,
            },
        );
        self.grant_of(token)
    }

    fn grant_of(&self, token: OwnerToken) -> Grant {
        let h = &self.holders[&token];
        let (ttl_ms, session) = match h.lease {
            Lease::Own { ttl_ms, .. } => (ttl_ms, None),
            Lease::Session(id) => (self.sessions[&id].ttl_ms, Some(id)),
        };
        Grant {
            name: h.name.clone(),
            fence: h.fence,
            token,
            ttl_ms,
            session,
            mode: h.mode,
        }
    }

    /// Grants queued requests, in queue order, while the head of the queue can be
    /// granted and the lock is not in lock-delay; a multi-lock request only once it
    /// heads, and can be granted on, every one of its locks. Follows every lock a
    /// multi-lock grant or wait end touched. Removes lock records nothing refers to.
    fn hand_off(&mut self, name: &LockName) {
        let mut work = vec![name.clone()];
        while let Some(name) = work.pop() {
            self.hand_off_one(&name, &mut work);
        }
    }

    fn hand_off_one(&mut self, name: &LockName, work: &mut Vec<LockName>) {
        let now = self.now_ms;
        let max_limit = self.config.max_limit;
        loop {
            let Some(lock) = self.locks.get(&NameKey::of(name)) else {
                return;
            };
            if lock.blocked_until_ms > now {
                break;
            }
            let Some(&token) = lock.waiters.front() else {
                break;
            };
            let w = &self.waiters[&token];
            if !admits(lock, w.mode, max_limit) {
                break;
            }
            // Never grant to a request whose wait or session is over at this instant
            // (deadlines are exclusive). Same-instant deadlines may not have been
            // processed yet, so this is a real path, not just a guard.
            let session_over = w
                .session
                .is_some_and(|id| self.sessions.get(&id).is_none_or(|s| s.deadline_ms <= now));
            let over = session_over || w.wait_deadline_ms <= now;
            #[cfg(feature = "planted-bugs")]
            let over = over && !self.planted.grant_expired_waiters;
            if over {
                let reason = if session_over {
                    WaitEnd::SessionEnded
                } else {
                    WaitEnd::TimedOut
                };
                work.extend(self.end_waits(token, reason));
                continue;
            }
            let Some(group) = w.group.clone() else {
                let w = self.take_waiter(token);
                let grant = self.grant(token, w);
                self.outcomes.push(Outcome::Granted(grant));
                continue;
            };
            #[cfg(feature = "planted-bugs")]
            if self.planted.partial_multi_grant {
                let w = self.take_waiter(token);
                let grant = self.grant(token, w);
                self.outcomes.push(Outcome::Granted(grant));
                continue;
            }
            if !self.grantable(token) {
                break;
            }
            let mut grants = Vec::with_capacity(group.len());
            for &part in group.iter() {
                let w = self.take_waiter(part);
                if w.name != *name {
                    work.push(w.name.clone());
                }
                grants.push(self.grant(part, w));
            }
            self.outcomes.push(Outcome::GrantedAll(grants));
        }
        self.drop_lock_if_unused(name);
    }

    /// Whether the queued request `token` (every part of it, for a multi-lock
    /// request) heads its queue and can be granted now.
    fn grantable(&self, token: OwnerToken) -> bool {
        let Some(w) = self.waiters.get(&token) else {
            return false;
        };
        let parts: &[OwnerToken] = match &w.group {
            Some(group) => group,
            None => std::slice::from_ref(&token),
        };
        parts.iter().all(|part| {
            let Some(w) = self.waiters.get(part) else {
                return false;
            };
            self.locks.get(&NameKey::of(&w.name)).is_some_and(|lock| {
                lock.blocked_until_ms <= self.now_ms
                    && lock.waiters.front() == Some(part)
                    && admits(lock, w.mode, self.config.max_limit)
            })
        })
    }

    /// Ends the wait of `token` and, for a multi-lock request, of every other part
    /// still queued. Returns the locks whose queues changed (to hand off).
    fn end_waits(&mut self, token: OwnerToken, reason: WaitEnd) -> Vec<LockName> {
        let parts: Vec<OwnerToken> = match self.waiters.get(&token) {
            Some(w) => match &w.group {
                Some(group) => group.to_vec(),
                None => vec![token],
            },
            None => return Vec::new(),
        };
        let mut names = Vec::with_capacity(parts.len());
        for t in parts {
            if self.waiters.contains_key(&t) {
                names.push(self.end_wait(t, reason));
            }
        }
        names
    }

    fn drop_lock_if_unused(&mut self, name: &LockName) {
        let key = NameKey::of(name);
        if let Some(lock) = self.locks.get(&key) {
            if lock.holders.is_empty()
                && lock.waiters.is_empty()
                && lock.blocked_until_ms <= self.now_ms
            {
                self.locks.remove(&key);
            }
        }
    }

    /// Ends a grant: removes it everywhere, records why, emits the event, applies
    /// lock-delay for expiry and forced release. Does not hand off.
    fn end_grant(&mut self, token: OwnerToken, end: GrantEnd, reason: Option<Reason>) -> Fence {
        let now = self.now_ms;
        let h = self.holders.remove(&token).expect("ending a live grant");
        match h.lease {
            Lease::Own { deadline_ms, .. } => {
                self.timers.remove(&(deadline_ms, Timer::Lease(token)));
            }
            Lease::Session(id) => {
                if let Some(s) = self.sessions.get_mut(&id) {
                    s.holders.remove(&token);
                }
            }
        }
        if let Some(request_id) = &h.request_id {
            self.request_ids
                .remove(&(h.name.clone(), request_id.clone()));
        }
        let lock = self
            .locks
            .get_mut(&NameKey::of(&h.name))
            .expect("holder's lock exists");
        lock.holders.retain(|t| *t != token);
        if h.mode == Mode::Shared {
            lock.shared -= 1;
            self.shared_holders -= 1;
        }
        if end != GrantEnd::Released && h.lock_delay_ms > 0 {
            let until = now + h.lock_delay_ms;
            if until > lock.blocked_until_ms {
                if lock.blocked_until_ms > now {
                    self.timers
                        .remove(&(lock.blocked_until_ms, Timer::Unblock(h.name.clone())));
                }
                lock.blocked_until_ms = until;
                self.timers.insert((until, Timer::Unblock(h.name.clone())));
            }
        }
        self.remember_end(token, h.name.clone(), end);
        #[cfg(feature = "planted-bugs")]
        let leak = self.planted.leak_usage_on_expiry && end == GrantEnd::Expired;
        #[cfg(not(feature = "planted-bugs"))]
        let leak = false;
        if !leak {
            self.count(h.tenant.as_ref(), |u| u.held -= 1);
        }
        self.outcomes.push(Outcome::Event(Event {
            kind: EventKind::Ended(end),
            name: h.name,
            fence: Some(h.fence),
            owner: h.owner,
            session: match h.lease {
                Lease::Session(id) => Some(id),
                Lease::Own { .. } => None,
            },
            tenant: h.tenant,
            at_ms: now,
            duration_ms: now - h.granted_at_ms,
            reason,
            mode: h.mode,
            value: h.value,
            handoff: false,
        }));
        h.fence
    }

    fn remember_end(&mut self, token: OwnerToken, name: LockName, end: GrantEnd) {
        if self.config.max_recent_ends == 0 {
            return;
        }
        if self.recent_ends.insert(token, (name, end)).is_none() {
            self.recent_order.push_back(token);
        }
        while self.recent_order.len() > self.config.max_recent_ends {
            let old = self.recent_order.pop_front().expect("non-empty");
            self.recent_ends.remove(&old);
        }
    }

    /// Removes a queued request from every index, without telling anyone.
    fn take_waiter(&mut self, token: OwnerToken) -> Waiter {
        let w = self.waiters.remove(&token).expect("taking a live waiter");
        self.count(w.tenant.as_ref(), |u| u.waiting -= 1);
        self.shared_waiters -= usize::from(w.mode == Mode::Shared);
        self.timers
            .remove(&(w.wait_deadline_ms, Timer::Wait(token)));
        if let Some(id) = w.session {
            if let Some(s) = self.sessions.get_mut(&id) {
                s.waiters.remove(&token);
            }
        }
        if let Some(request_id) = &w.request_id {
            self.request_ids
                .remove(&(w.name.clone(), request_id.clone()));
        }
        if let Some(lock) = self.locks.get_mut(&NameKey::of(&w.name)) {
            if lock.waiters.front() == Some(&token) {
                lock.waiters.pop_front();
            } else {
                lock.waiters.retain(|t| *t != token);
            }
        }
        w
    }

    fn push_wait_ended(&mut self, token: OwnerToken, w: Waiter, reason: WaitEnd) {
        self.outcomes.push(Outcome::Event(Event {
            kind: EventKind::WaitEnded(reason),
            name: w.name.clone(),
            fence: None,
            owner: w.owner,
            session: w.session,
            tenant: w.tenant,
            at_ms: self.now_ms,
            duration_ms: self.now_ms - w.enqueued_at_ms,
            reason: None,
            mode: w.mode,
            value: w.value,
            handoff: false,
        }));
        self.outcomes.push(Outcome::WaitEnded {
            token,
            name: w.name,
            reason,
        });
    }

    /// Removes a queued request and tells its client why. The caller hands off
    /// afterwards if the request may have been at the head of a lock with free slots.
    fn end_wait(&mut self, token: OwnerToken, reason: WaitEnd) -> LockName {
        let w = self.take_waiter(token);
        let name = w.name.clone();
        self.push_wait_ended(token, w, reason);
        name
    }

    /// How `token`'s grant on `name` ended, if it did so recently.
    fn recent_end(&self, name: &LockName, token: OwnerToken) -> Option<GrantEnd> {
        self.recent_ends
            .get(&token)
            .filter(|(n, _)| n == name)
            .map(|(_, end)| *end)
    }

    fn not_held_error(&self, name: &LockName, token: OwnerToken) -> Error {
        match self.recent_end(name, token) {
            Some(GrantEnd::Expired) => err(
                ErrorKind::Expired,
                format!("the lease on {name} for this owner token expired"),
            ),
            Some(GrantEnd::ForceReleased) => err(
                ErrorKind::NotHeld,
                format!("the grant on {name} for this owner token was force-released"),
            ),
            Some(GrantEnd::Released) => err(
                ErrorKind::NotHeld,
                format!("the grant on {name} for this owner token was released"),
            ),
            None => err(
                ErrorKind::NotHeld,
                format!("this owner token does not hold {name}"),
            ),
        }
    }

    fn holder_of(&self, name: &LockName, token: OwnerToken) -> Option<&Holder> {
        self.holders.get(&token).filter(|h| h.name == *name)
    }

    fn renew(
        &mut self,
        name: LockName,
        token: OwnerToken,
        ttl_ms: Option<u64>,
    ) -> Result<Reply, Error> {
        let Some(h) = self.holder_of(&name, token) else {
            return Err(self.not_held_error(&name, token));
        };
        match h.lease {
            Lease::Own {
                ttl_ms: old_ttl,
                deadline_ms,
            } => {
                let ttl_ms = ttl_ms.unwrap_or(old_ttl);
                self.check_ttl("ttl_ms", ttl_ms)?;
                let new_deadline = self.now_ms + ttl_ms;
                self.timers.remove(&(deadline_ms, Timer::Lease(token)));
                self.timers.insert((new_deadline, Timer::Lease(token)));
                self.holders.get_mut(&token).expect("checked").lease = Lease::Own {
                    ttl_ms,
                    deadline_ms: new_deadline,
                };
            }
            Lease::Session(id) => {
                if ttl_ms.is_some() {
                    return Err(err(
                        ErrorKind::InvalidArgument,
                        "this lock is held by a session: renewing it keeps the session alive, with the session's ttl; omit ttl_ms",
                    ));
                }
                self.keep_alive(id)?;
            }
        }
        Ok(Reply::Renewed(self.grant_of(token)))
    }

    fn release(&mut self, name: LockName, token: OwnerToken) -> Result<Reply, Error> {
        #[cfg(feature = "planted-bugs")]
        let token = match self.locks.get(&NameKey::of(&name)) {
            Some(lock)
                if self.planted.release_by_name_only && self.holder_of(&name, token).is_none() =>
            {
                lock.holders.first().copied().unwrap_or(token)
            }
            _ => token,
        };
        if self.holder_of(&name, token).is_some() {
            self.end_grant(token, GrantEnd::Released, None);
            self.hand_off(&name);
            return Ok(Reply::Released { released: true });
        }
        if self.recent_end(&name, token) == Some(GrantEnd::Released) {
            return Ok(Reply::Released { released: false });
        }
        Err(self.not_held_error(&name, token))
    }

    /// A multi-lock request: all of its locks or none (see [`Command::AcquireAll`]).
    fn acquire_all(&mut self, parts: Vec<Acquire>) -> Result<Reply, Error> {
        let Some(first) = parts.first() else {
            return Err(err(
                ErrorKind::InvalidArgument,
                "a multi-lock request names at least one lock",
            ));
        };
        if parts.len() > MAX_NAMES_PER_REQUEST {
            return Err(err(
                ErrorKind::InvalidArgument,
                format!(
                    "a multi-lock request names at most {MAX_NAMES_PER_REQUEST} locks, got {}",
                    parts.len()
                ),
            ));
        }
        let mut names = BTreeSet::new();
        let mut tokens = BTreeSet::new();
        for p in &parts {
            self.check_acquire_args(p)?;
            let same = p.ttl_ms == first.ttl_ms
                && p.wait_ms == first.wait_ms
                && p.owner == first.owner
                && p.request_id == first.request_id
                && p.lock_delay_ms == first.lock_delay_ms
                && p.session == first.session
                && p.tenant == first.tenant
                && p.quota == first.quota;
            if !same {
                return Err(err(
                    ErrorKind::InvalidArgument,
                    "the parts of a multi-lock request differ in more than name, token, mode and limit",
                ));
            }
            if p.value.is_some() {
                return Err(err(
                    ErrorKind::InvalidArgument,
                    "an election campaign names one election, not a set",
                ));
            }
            if !names.insert(p.name.clone()) {
                return Err(err(
                    ErrorKind::InvalidArgument,
                    format!("lock {} appears twice in a multi-lock request", p.name),
                ));
            }
            if !tokens.insert(p.token)
                || self.holders.contains_key(&p.token)
                || self.waiters.contains_key(&p.token)
            {
                return Err(err(
                    ErrorKind::InvalidArgument,
                    "owner token already in use",
                ));
            }
        }
        let n = parts.len();

        // Idempotent retry: every part must still be where the first request left it.
        if let Some(request_id) = &first.request_id {
            let found: Vec<Option<OwnerToken>> = parts
                .iter()
                .map(|p| {
                    self.request_ids
                        .get(&(p.name.clone(), request_id.clone()))
                        .copied()
                })
                .collect();
            if found.iter().any(Option::is_some) {
                let found: Vec<OwnerToken> = found.into_iter().flatten().collect();
                if found.len() == n && found.iter().all(|t| self.holders.contains_key(t)) {
                    return Ok(Reply::GrantedAll(
                        found.into_iter().map(|t| self.grant_of(t)).collect(),
                    ));
                }
                if found.len() == n && found.iter().all(|t| self.waiters.contains_key(t)) {
                    return Ok(Reply::QueuedAll { tokens: found });
                }
                return Err(err(
                    ErrorKind::InvalidArgument,
                    "this request_id belongs to another request on some of these locks, or to one partly released",
                ));
            }
        }

        if let Some(id) = first.session {
            let session = self
                .sessions
                .get(&id)
                .filter(|s| s.tenant == first.tenant)
                .ok_or_else(|| Self::session_missing(id))?;
            if session.holders.len() + session.waiters.len() + n > self.config.max_locks_per_session
            {
                return Err(err(
                    ErrorKind::ResourceExhausted,
                    format!(
                        "session {id} would hold or wait for more than {} locks",
                        self.config.max_locks_per_session
                    ),
                ));
            }
        }
        if self.next_fence.saturating_add(n as u64) == u64::MAX {
            return Err(err(ErrorKind::ResourceExhausted, "fence space exhausted"));
        }
        self.check_held_quota(first.tenant.as_ref(), first.quota.as_ref(), n)?;

        let now = self.now_ms;
        let mut vacant = 0;
        let mut unavailable: Option<LockName> = None;
        for p in &parts {
            match self.locks.get(&NameKey::of(&p.name)) {
                Some(lock) => {
                    if lock.limit != p.limit {
                        return Err(err(
                            ErrorKind::LimitMismatch,
                            format!(
                                "lock {} exists with limit {}, request asked for {}",
                                p.name, lock.limit, p.limit
                            ),
                        ));
                    }
                    let available = admits(lock, p.mode, self.config.max_limit)
                        && lock.blocked_until_ms <= now
                        && lock.waiters.is_empty();
                    if !available && unavailable.is_none() {
                        unavailable = Some(p.name.clone());
                    }
                }
                None => vacant += 1,
            }
        }
        if self.locks.len() + vacant > self.config.max_locks {
            return Err(err(
                ErrorKind::ResourceExhausted,
                format!(
                    "the server holds its maximum of {} locks",
                    self.config.max_locks
                ),
            ));
        }

        if unavailable.is_none() {
            let mut grants = Vec::with_capacity(n);
            for p in parts {
                let lock = self.locks.entry(NameKey::of(&p.name)).or_insert(Lock {
                    limit: p.limit,
                    ..Lock::default()
                });
                lock.holders.push(p.token);
                lock.shared += usize::from(p.mode == Mode::Shared);
                let waiter = Waiter {
                    name: p.name,
                    owner: p.owner,
                    request_id: p.request_id,
                    ttl_ms: p.ttl_ms,
                    session: p.session,
                    lock_delay_ms: p.lock_delay_ms,
                    enqueued_at_ms: now,
                    wait_deadline_ms: now,
                    tenant: p.tenant,
                    mode: p.mode,
                    value: None,
                    group: None,
                };
                grants.push(self.grant_pushed(p.token, waiter, false));
            }
            return Ok(Reply::GrantedAll(grants));
        }
        if first.wait_ms == 0 {
            let name = unavailable.map(|n| n.to_string()).unwrap_or_default();
            return Err(err(
                ErrorKind::Held,
                format!("lock {name} is held, in lock-delay or queued for"),
            ));
        }
        let crowded = parts.iter().any(|p| {
            self.locks
                .get(&NameKey::of(&p.name))
                .is_some_and(|l| l.waiters.len() >= self.config.max_waiters_per_lock)
        });
        if crowded || self.waiters.len() + n > self.config.max_waiters {
            return Err(err(
                ErrorKind::ResourceExhausted,
                "too many queued requests for one of these locks",
            ));
        }
        self.check_waiter_quota(first.tenant.as_ref(), first.quota.as_ref(), n)?;

        // Queue on every lock in this one transition: every queue then orders this
        // request after everything queued before it, so no two multi-lock requests
        // can each wait behind the other.
        let deadline = now.saturating_add(first.wait_ms);
        let group: Arc<[OwnerToken]> = parts.iter().map(|p| p.token).collect();
        for p in parts {
            if let Some(request_id) = &p.request_id {
                self.request_ids
                    .insert((p.name.clone(), request_id.clone()), p.token);
            }
            if let Some(id) = p.session {
                if let Some(s) = self.sessions.get_mut(&id) {
                    s.waiters.insert(p.token);
                }
            }
            self.timers.insert((deadline, Timer::Wait(p.token)));
            let lock = self.locks.entry(NameKey::of(&p.name)).or_insert(Lock {
                limit: p.limit,
                ..Lock::default()
            });
            lock.waiters.push_back(p.token);
            self.count(p.tenant.as_ref(), |u| u.waiting += 1);
            self.shared_waiters += usize::from(p.mode == Mode::Shared);
            self.outcomes.push(Outcome::Event(Event {
                kind: EventKind::Queued,
                name: p.name.clone(),
                fence: None,
                owner: p.owner.clone(),
                session: p.session,
                tenant: p.tenant.clone(),
                at_ms: now,
                duration_ms: 0,
                reason: None,
                mode: p.mode,
                value: None,
                handoff: false,
            }));
            self.waiters.insert(
                p.token,
                Waiter {
                    name: p.name,
                    owner: p.owner,
                    request_id: p.request_id,
                    ttl_ms: p.ttl_ms,
                    session: p.session,
                    lock_delay_ms: p.lock_delay_ms,
                    enqueued_at_ms: now,
                    wait_deadline_ms: deadline,
                    tenant: p.tenant,
                    mode: p.mode,
                    value: None,
                    group: Some(group.clone()),
                },
            );
        }
        Ok(Reply::QueuedAll {
            tokens: group.to_vec(),
        })
    }

    fn downgrade(&mut self, name: LockName, token: OwnerToken) -> Result<Reply, Error> {
        let Some(h) = self.holder_of(&name, token) else {
            return Err(self.not_held_error(&name, token));
        };
        if h.mode == Mode::Shared {
            return Ok(Reply::Downgraded {
                grant: self.grant_of(token),
                downgraded: false,
            });
        }
        if h.value.is_some() {
            return Err(err(
                ErrorKind::InvalidArgument,
                "an election's leader holds it exclusively: resign instead of downgrading",
            ));
        }
        let lock = self
            .locks
            .get_mut(&NameKey::of(&name))
            .expect("holder's lock exists");
        if lock.holders.len() > 1 {
            return Err(err(
                ErrorKind::InvalidArgument,
                format!("{name} has other exclusive holders (a semaphore): only a sole writer can downgrade"),
            ));
        }
        lock.shared += 1;
        self.shared_holders += 1;
        let h = self.holders.get_mut(&token).expect("checked above");
        h.mode = Mode::Shared;
        let event = Event {
            kind: EventKind::Downgraded,
            name: name.clone(),
            fence: Some(h.fence),
            owner: h.owner.clone(),
            session: match h.lease {
                Lease::Session(id) => Some(id),
                Lease::Own { .. } => None,
            },
            tenant: h.tenant.clone(),
            at_ms: self.now_ms,
            duration_ms: self.now_ms - h.granted_at_ms,
            reason: None,
            mode: Mode::Shared,
            value: None,
            handoff: false,
        };
        self.outcomes.push(Outcome::Event(event));
        // Readers queued right behind may join now.
        self.hand_off(&name);
        Ok(Reply::Downgraded {
            grant: self.grant_of(token),
            downgraded: true,
        })
    }

    fn proclaim(
        &mut self,
        name: LockName,
        token: OwnerToken,
        value: Value,
    ) -> Result<Reply, Error> {
        let Some(h) = self.holder_of(&name, token) else {
            return Err(self.not_held_error(&name, token));
        };
        let limit = self.locks[&NameKey::of(&name)].limit;
        if h.mode != Mode::Exclusive || limit != 1 {
            return Err(err(
                ErrorKind::InvalidArgument,
                format!("only the exclusive holder of {name} (limit 1) leads it and can proclaim"),
            ));
        }
        let h = self.holders.get_mut(&token).expect("checked above");
        h.value = Some(value.clone());
        let event = Event {
            kind: EventKind::Proclaimed,
            name,
            fence: Some(h.fence),
            owner: h.owner.clone(),
            session: match h.lease {
                Lease::Session(id) => Some(id),
                Lease::Own { .. } => None,
            },
            tenant: h.tenant.clone(),
            at_ms: self.now_ms,
            duration_ms: self.now_ms - h.granted_at_ms,
            reason: None,
            mode: Mode::Exclusive,
            value: Some(value),
            handoff: false,
        };
        self.outcomes.push(Outcome::Event(event));
        Ok(Reply::Proclaimed(self.grant_of(token)))
    }

    fn release_all(&mut self, grants: Vec<(LockName, OwnerToken)>) -> Result<Reply, Error> {
        if grants.is_empty() || grants.len() > MAX_NAMES_PER_REQUEST {
            return Err(err(
                ErrorKind::InvalidArgument,
                format!(
                    "release 1 to {MAX_NAMES_PER_REQUEST} grants at once, got {}",
                    grants.len()
                ),
            ));
        }
        let mut seen = BTreeSet::new();
        for (name, token) in &grants {
            if !seen.insert(*token) {
                return Err(err(
                    ErrorKind::InvalidArgument,
                    format!("owner token for {name} appears twice"),
                ));
            }
            let held = self.holder_of(name, *token).is_some();
            if !held && self.recent_end(name, *token) != Some(GrantEnd::Released) {
                return Err(self.not_held_error(name, *token));
            }
        }
        let mut released = Vec::with_capacity(grants.len());
        for (name, token) in &grants {
            let held = self.holder_of(name, *token).is_some();
            if held {
                self.end_grant(*token, GrantEnd::Released, None);
            }
            released.push(held);
        }
        for (name, _) in &grants {
            self.hand_off(name);
        }
        Ok(Reply::ReleasedAll { released })
    }

    fn force_release(
        &mut self,
        name: LockName,
        fence: Option<Fence>,
        reason: Reason,
    ) -> Result<Reply, Error> {
        let holders: Vec<OwnerToken> = match self.locks.get(&NameKey::of(&name)) {
            Some(lock) => lock
                .holders
                .iter()
                .copied()
                .filter(|t| fence.is_none_or(|f| self.holders[t].fence == f))
                .collect(),
            None => Vec::new(),
        };
        if holders.is_empty() {
            let what = match fence {
                Some(f) => format!("no holder of {name} has fence {f}"),
                None => format!("{name} has no holders"),
            };
            return Err(err(ErrorKind::NotHeld, what));
        }
        let fences = holders
            .into_iter()
            .map(|t| self.end_grant(t, GrantEnd::ForceReleased, Some(reason.clone())))
            .collect();
        self.hand_off(&name);
        Ok(Reply::ForceReleased { fences })
    }

    fn cancel_wait(&mut self, name: &LockName, token: OwnerToken) -> Reply {
        let queued = self.waiters.get(&token).is_some_and(|w| w.name == *name);
        if queued {
            for name in self.end_waits(token, WaitEnd::Cancelled) {
                self.hand_off(&name);
            }
        }
        Reply::WaitCancelled { cancelled: queued }
    }

    fn open_session(
        &mut self,
        id: SessionId,
        ttl_ms: u64,
        owner: Owner,
        tenant: Option<Tenant>,
        quota: Option<Quota>,
    ) -> Result<Reply, Error> {
        self.check_ttl("session ttl_ms", ttl_ms)?;
        if self.sessions.contains_key(&id) {
            return Err(err(ErrorKind::InvalidArgument, "session id already in use"));
        }
        if let (Some(tenant), Some(quota)) = (&tenant, &quota) {
            if self.usage_of(tenant).sessions >= u64::from(quota.max_sessions) {
                return Err(err(
                    ErrorKind::QuotaExceeded,
                    format!(
                        "principal {tenant} has its quota of {} open sessions (max_sessions)",
                        quota.max_sessions
                    ),
                ));
            }
        }
        if self.sessions.len() >= self.config.max_sessions {
            return Err(err(
                ErrorKind::ResourceExhausted,
                format!(
                    "the server has its maximum of {} sessions",
                    self.config.max_sessions
                ),
            ));
        }
        let deadline_ms = self.now_ms + ttl_ms;
        self.timers.insert((deadline_ms, Timer::Session(id)));
        self.count(tenant.as_ref(), |u| u.sessions += 1);
        self.sessions.insert(
            id,
            Session {
                owner,
                tenant,
                ttl_ms,
                deadline_ms,
                holders: BTreeSet::new(),
                waiters: BTreeSet::new(),
            },
        );
        Ok(Reply::SessionOpened { id, ttl_ms })
    }

    fn session_missing(id: SessionId) -> Error {
        err(
            ErrorKind::SessionNotFound,
            format!("session {id} does not exist (expired, closed or never opened)"),
        )
    }

    fn keep_alive(&mut self, id: SessionId) -> Result<Reply, Error> {
        let now = self.now_ms;
        let s = self
            .sessions
            .get_mut(&id)
            .ok_or_else(|| Self::session_missing(id))?;
        self.timers.remove(&(s.deadline_ms, Timer::Session(id)));
        s.deadline_ms = now + s.ttl_ms;
        self.timers.insert((s.deadline_ms, Timer::Session(id)));
        Ok(Reply::KeptAlive { ttl_ms: s.ttl_ms })
    }

    fn close_session(&mut self, id: SessionId) -> Result<Reply, Error> {
        if !self.sessions.contains_key(&id) {
            return Err(Self::session_missing(id));
        }
        let released = self.end_session(id, GrantEnd::Released);
        Ok(Reply::SessionClosed { released })
    }

    /// Ends a session: its queued requests leave, its grants end with `end`.
    fn end_session(&mut self, id: SessionId, end: GrantEnd) -> usize {
        let s = self.sessions.get(&id).expect("ending a live session");
        let waiters: Vec<OwnerToken> = s.waiters.iter().copied().collect();
        let holders: Vec<OwnerToken> = s.holders.iter().copied().collect();
        let deadline = s.deadline_ms;
        // Waiters go first, so no hand-off below can grant to this session.
        let mut names: Vec<LockName> = Vec::new();
        for token in waiters {
            names.extend(self.end_waits(token, WaitEnd::SessionEnded));
        }
        self.timers.remove(&(deadline, Timer::Session(id)));
        names.extend(holders.iter().map(|t| self.holders[t].name.clone()));
        let count = holders.len();
        for token in holders {
            self.end_grant(token, end, None);
        }
        let s = self.sessions.remove(&id).expect("checked above");
        self.count(s.tenant.as_ref(), |u| u.sessions -= 1);
        for name in names {
            self.hand_off(&name);
        }
        count
    }

    /// Processes every deadline at or before `now_ms`, earliest first.
    fn process_deadlines(&mut self) {
        let now = self.now_ms;
        while let Some((at, _)) = self.timers.first() {
            if *at > now {
                break;
            }
            let (_, timer) = self.timers.pop_first().expect("non-empty");
            match timer {
                Timer::Session(id) => {
                    self.end_session(id, GrantEnd::Expired);
                }
                Timer::Lease(token) => {
                    let name = self.holders[&token].name.clone();
                    self.end_grant(token, GrantEnd::Expired, None);
                    self.hand_off(&name);
                }
                Timer::Wait(token) => {
                    for name in self.end_waits(token, WaitEnd::TimedOut) {
                        self.hand_off(&name);
                    }
                }
                Timer::Unblock(name) => {
                    self.hand_off(&name);
                }
            }
        }
    }

    /// After a restart: every lease and session restarts with its full TTL (this only
    /// ever extends leases, which is safe); queued requests are dropped because their
    /// clients' connections are gone.
    fn recover(&mut self) {
        let queued: Vec<OwnerToken> = self
            .locks
            .values()
            .flat_map(|l| l.waiters.iter().copied())
            .collect();
        for token in queued {
            if self.waiters.contains_key(&token) {
                let name = self.end_wait(token, WaitEnd::ServerRestarted);
                self.drop_lock_if_unused(&name);
            }
        }
        self.refresh_leases();
    }

    /// Every lease and session restarts with its full TTL from now; waits keep
    /// their deadlines.
    fn refresh_leases(&mut self) {
        let now = self.now_ms;
        // Collected, then bulk-built: inserting a million timers one by one in hash
        // order was a fifth of a restart.
        let mut timers = Vec::with_capacity(self.holders.len() + self.sessions.len());
        for (token, h) in self.holders.iter_mut() {
            if let Lease::Own { ttl_ms, .. } = h.lease {
                let deadline_ms = now + ttl_ms;
                h.lease = Lease::Own {
                    ttl_ms,
                    deadline_ms,
                };
                timers.push((deadline_ms, Timer::Lease(*token)));
            }
        }
        for (id, s) in self.sessions.iter_mut() {
            s.deadline_ms = now + s.ttl_ms;
            timers.push((s.deadline_ms, Timer::Session(*id)));
        }
        for (key, lock) in &self.locks {
            if lock.blocked_until_ms > now {
                timers.push((lock.blocked_until_ms, Timer::Unblock(key.name.clone())));
            }
        }
        for (token, w) in &self.waiters {
            timers.push((w.wait_deadline_ms, Timer::Wait(*token)));
        }
        timers.sort_unstable();
        self.timers = timers.into_iter().collect();
    }

    /// Whether `tenant` may take `count` more grants or queued requests: both count
    /// against `max_held_locks` (see [`Quota`]). One check for a single acquire
    /// (`count` 1) and a multi-lock request (`count` = its parts).
    fn check_held_quota(
        &self,
        tenant: Option<&Tenant>,
        quota: Option<&Quota>,
        count: usize,
    ) -> Result<(), Error> {
        let (Some(tenant), Some(quota)) = (tenant, quota) else {
            return Ok(());
        };
        let used = self.usage_of(tenant);
        if used.held + used.waiting + count as u64 > u64::from(quota.max_held_locks) {
            let what = if count == 1 {
                "holds or waits for its quota of"
            } else {
                "would hold or wait for more than its quota of"
            };
            return Err(err(
                ErrorKind::QuotaExceeded,
                format!(
                    "principal {tenant} {what} {} locks (max_held_locks)",
                    quota.max_held_locks
                ),
            ));
        }
        Ok(())
    }

    /// Whether `tenant` may queue `count` more requests (`max_waiters`).
    fn check_waiter_quota(
        &self,
        tenant: Option<&Tenant>,
        quota: Option<&Quota>,
        count: usize,
    ) -> Result<(), Error> {
        let (Some(tenant), Some(quota)) = (tenant, quota) else {
            return Ok(());
        };
        if self.usage_of(tenant).waiting + count as u64 > u64::from(quota.max_waiters) {
            let what = if count == 1 {
                "has its quota of"
            } else {
                "would have more than its quota of"
            };
            return Err(err(
                ErrorKind::QuotaExceeded,
                format!(
                    "principal {tenant} {what} {} queued acquires (max_waiters)",
                    quota.max_waiters
                ),
            ));
        }
        Ok(())
    }

    fn usage_of(&self, tenant: &Tenant) -> Usage {
        self.usage.get(tenant).copied().unwrap_or_default()
    }

    /// Changes `tenant`'s usage by `change`; a principal left using nothing loses its
    /// entry, so the table holds only principals that use something.
    fn count(&mut self, tenant: Option<&Tenant>, change: impl FnOnce(&mut Usage)) {
        let Some(tenant) = tenant else { return };
        let usage = self.usage.entry(tenant.clone()).or_default();
        change(usage);
        if *usage == Usage::default() {
            self.usage.remove(tenant);
        }
    }

    /// The view of one open session, if it exists.
    pub fn session(&self, id: SessionId) -> Option<SessionView> {
        self.session_at(id, self.now_ms)
    }

    /// [`Core::session`] as seen at service time `now_ms` (never earlier than
    /// [`Core::now_ms`]): a reader whose clock has moved on since the last command
    /// sees the lease time left then. Nothing is expired by it: that takes a command.
    pub fn session_at(&self, id: SessionId, now_ms: u64) -> Option<SessionView> {
        let now = now_ms.max(self.now_ms);
        let s = self.sessions.get(&id)?;
        let mut holding: Vec<LockName> = s
            .holders
            .iter()
            .map(|t| self.holders[t].name.clone())
            .collect();
        holding.sort();
        let mut waiting: Vec<LockName> = s
            .waiters
            .iter()
            .map(|t| self.waiters[t].name.clone())
            .collect();
        waiting.sort();
        Some(SessionView {
            id,
            owner: s.owner.clone(),
            tenant: s.tenant.clone(),
            ttl_ms: s.ttl_ms,
            ttl_remaining_ms: s.deadline_ms.saturating_sub(now),
            holding,
            waiting,
        })
    }

    /// The principal that opened session `id` (`Some(None)`: recorded none), or
    /// `None` if it is not open. O(1): for checks on every keep-alive.
    pub fn session_tenant(&self, id: SessionId) -> Option<Option<&Tenant>> {
        self.sessions.get(&id).map(|s| s.tenant.as_ref())
    }

    /// The ids of every open session, in no particular order. O(sessions): for
    /// operators.
    pub fn session_ids(&self) -> Vec<SessionId> {
        self.sessions.keys().copied().collect()
    }

    /// What `tenant` uses now: (open sessions, held grants, queued requests).
    pub fn usage(&self, tenant: &Tenant) -> (u64, u64, u64) {
        let u = self.usage_of(tenant);
        (u.sessions, u.held, u.waiting)
    }

    /// The view of one lock, or `None` if nobody holds, waits for or delays it.
    pub fn lock(&self, name: &LockName) -> Option<LockView> {
        self.lock_at(name, self.now_ms)
    }

    /// [`Core::lock`] as seen at service time `now_ms` (never earlier than
    /// [`Core::now_ms`]): `held_ms` and the time left count to `now_ms`, for a
    /// reader whose clock has moved on since the last command (a cluster member
    /// between commands). Nothing is expired by it: a lease past its deadline shows
    /// 0 ms left until a command processes the expiry.
    pub fn lock_at(&self, name: &LockName, now_ms: u64) -> Option<LockView> {
        self.locks.get(&NameKey::of(name)).map(|lock| {
            let now = now_ms.max(self.now_ms);
            let mut view = self.view(name, lock, now);
            view.waiting = self.waiter_views(lock, now);
            view.shared_waiters = lock
                .waiters
                .iter()
                .filter(|t| self.waiters.get(t).is_some_and(|w| w.mode == Mode::Shared))
                .count();
            view
        })
    }

    /// The first [`MAX_VIEW_WAITERS`] queued requests of `lock`, in queue order.
    fn waiter_views(&self, lock: &Lock, now: u64) -> Vec<WaiterView> {
        lock.waiters
            .iter()
            .take(MAX_VIEW_WAITERS)
            .enumerate()
            .filter_map(|(position, t)| {
                let w = self.waiters.get(t)?;
                Some(WaiterView {
                    position,
                    owner: w.owner.clone(),
                    session: w.session,
                    waiting_ms: now.saturating_sub(w.enqueued_at_ms),
                    mode: w.mode,
                })
            })
            .collect()
    }

    /// Locks whose names start with `prefix`, in name order, starting after `after`,
    /// at most `max` of them.
    pub fn locks(&self, prefix: &str, after: Option<&LockName>, max: usize) -> Vec<LockView> {
        self.locks_at(prefix, after, max, self.now_ms)
    }

    /// [`Core::locks`] as seen at service time `now_ms` (see [`Core::lock_at`]).
    pub fn locks_at(
        &self,
        prefix: &str,
        after: Option<&LockName>,
        max: usize,
        now_ms: u64,
    ) -> Vec<LockView> {
        use std::ops::Bound;
        let now = now_ms.max(self.now_ms);
        let start = match after {
            Some(a) => Bound::Excluded(NameKey::of(a)),
            None => match LockName::recorded(prefix) {
                Ok(p) => Bound::Included(NameKey::new(p)),
                Err(_) => Bound::Unbounded,
            },
        };
        self.locks
            .range((start, Bound::Unbounded))
            .map(|(k, l)| (&k.name, l))
            .skip_while(|(n, _)| !n.as_str().starts_with(prefix) && n.as_str() < prefix)
            .take_while(|(n, _)| n.as_str().starts_with(prefix))
            .take(max)
            .map(|(n, l)| self.view(n, l, now))
            .collect()
    }

    /// `now` is at least `self.now_ms`, so at least every grant's time.
    fn view(&self, name: &LockName, lock: &Lock, now: u64) -> LockView {
        debug_assert!(now >= self.now_ms);
        let holders = lock
            .holders
            .iter()
            .map(|t| {
                let h = &self.holders[t];
                let (deadline, session) = match h.lease {
                    Lease::Own { deadline_ms, .. } => (deadline_ms, None),
                    Lease::Session(id) => (self.sessions[&id].deadline_ms, Some(id)),
                };
                HolderView {
                    fence: h.fence,
                    owner: h.owner.clone(),
                    session,
                    held_ms: now - h.granted_at_ms,
                    ttl_remaining_ms: deadline.saturating_sub(now),
                    mode: h.mode,
                    value: h.value.clone(),
                }
            })
            .collect();
        LockView {
            name: name.clone(),
            limit: lock.limit,
            holders,
            waiters: lock.waiters.len(),
            lock_delay_remaining_ms: lock.blocked_until_ms.saturating_sub(now),
            waiting: Vec::new(),
            shared_waiters: 0,
        }
    }

    /// One lock's holders: exclusive and shared never together, each within its
    /// bound, fences increasing in grant order, values on exclusive holders only,
    /// and `lock.shared` counting the shared ones. `holder` looks a token up.
    fn check_modes(
        max_limit: u32,
        name: &LockName,
        lock: &Lock,
        holder: impl Fn(&OwnerToken) -> Option<(Mode, Fence, bool)>,
    ) -> Result<(), String> {
        let mut shared = 0;
        let mut last: Option<Fence> = None;
        for t in &lock.holders {
            let (mode, fence, valued) =
                holder(t).ok_or_else(|| format!("{name}: unknown holder"))?;
            if mode == Mode::Shared {
                shared += 1;
                if valued {
                    return Err(format!("{name}: a shared holder carries an election value"));
                }
            }
            if last.is_some_and(|l| l >= fence) {
                return Err(format!(
                    "{name}: holders' fences are not increasing in grant order"
                ));
            }
            last = Some(fence);
        }
        if shared != lock.shared {
            return Err(format!("{name}: shared holder count out of step"));
        }
        let exclusive = lock.holders.len() - shared;
        if exclusive > 0 && shared > 0 {
            return Err(format!(
                "{name}: an exclusive holder together with shared holders"
            ));
        }
        if exclusive > lock.limit as usize {
            return Err(format!(
                "{name}: {exclusive} holders > limit {}",
                lock.limit
            ));
        }
        if shared > reader_limit(lock.limit, max_limit) {
            return Err(format!(
                "{name}: {shared} shared holders > {} readers",
                reader_limit(lock.limit, max_limit)
            ));
        }
        Ok(())
    }

    /// The queues: no queue stalls with a grantable request at its head (FIFO
    /// across modes, hand-off complete), every multi-lock request waits on all of
    /// its locks (never partly granted), and all queues order requests the same
    /// way (so no two requests wait for each other: no deadlock). O(waiters).
    fn check_queues(&self) -> Result<(), String> {
        // A request's place in the global order: its group's first token.
        let id = |t: &OwnerToken| -> Option<OwnerToken> {
            let w = self.waiters.get(t)?;
            Some(w.group.as_ref().map_or(*t, |g| g[0]))
        };
        let mut after: HashMap<OwnerToken, Vec<OwnerToken>> = HashMap::new();
        let mut before: HashMap<OwnerToken, usize> = HashMap::new();
        for (token, w) in &self.waiters {
            if let Some(group) = &w.group {
                if !group.contains(token) {
                    return Err(format!("{}: a multi-lock part outside its group", w.name));
                }
                let mut names = BTreeSet::new();
                for part in group.iter() {
                    let p = self.waiters.get(part).ok_or_else(|| {
                        format!("{}: a multi-lock request partly granted", w.name)
                    })?;
                    // One request: the same group, session and wait on every lock.
                    let same = p.group.as_deref() == Some(&group[..])
                        && p.session == w.session
                        && p.wait_deadline_ms == w.wait_deadline_ms;
                    if !same || !names.insert(p.name.clone()) {
                        return Err(format!("{}: a multi-lock request's parts disagree", w.name));
                    }
                }
            }
            let Some(lock) = self.locks.get(&NameKey::of(&w.name)) else {
                return Err(format!("{}: waiter of no lock", w.name));
            };
            if lock.waiters.front() != Some(token) {
                continue;
            }
            if self.grantable(*token) {
                return Err(format!(
                    "{}: the head of the queue could be granted (FIFO stalled)",
                    w.name
                ));
            }
            before.entry(id(token).unwrap_or(*token)).or_insert(0);
            for pair in lock.waiters.iter().collect::<Vec<_>>().windows(2) {
                let (a, b) = (id(pair[0]), id(pair[1]));
                let (Some(a), Some(b)) = (a, b) else {
                    return Err(format!("{}: unknown waiter", w.name));
                };
                after.entry(a).or_default().push(b);
                *before.entry(b).or_insert(0) += 1;
                before.entry(a).or_insert(0);
            }
        }
        // Kahn's algorithm: the queues agree with one order iff their union of
        // "queued right before" edges has no cycle.
        let mut ready: Vec<OwnerToken> = before
            .iter()
            .filter(|(_, n)| **n == 0)
            .map(|(t, _)| *t)
            .collect();
        let mut done = 0;
        while let Some(t) = ready.pop() {
            done += 1;
            for next in after.get(&t).map(Vec::as_slice).unwrap_or_default() {
                let n = before.get_mut(next).ok_or("queue order index broken")?;
                *n -= 1;
                if *n == 0 {
                    ready.push(*next);
                }
            }
        }
        if done != before.len() {
            return Err("queues order multi-lock requests differently (a deadlock cycle)".into());
        }
        Ok(())
    }

    /// Checks every internal invariant; returns the first broken one. O(state).
    pub fn check_invariants(&self) -> Result<(), InvariantError> {
        let mut fences = Vec::with_capacity(self.holders.len());
        let mut counted_holders = 0;
        let mut counted_waiters = 0;
        let mut shared_holders = 0;
        for (key, lock) in &self.locks {
            let name = &key.name;
            Self::check_modes(self.config.max_limit, name, lock, |t| {
                self.holders
                    .get(t)
                    .map(|h| (h.mode, h.fence, h.value.is_some()))
            })
            .map_err(broken)?;
            shared_holders += lock.shared;
            if lock.holders.is_empty()
                && lock.waiters.is_empty()
                && lock.blocked_until_ms <= self.now_ms
            {
                return Err(broken(format!("{name}: unused lock record kept")));
            }
            for t in &lock.holders {
                let h = self
                    .holders
                    .get(t)
                    .ok_or_else(|| broken(format!("{name}: unknown holder")))?;
                if h.name != *name {
                    return Err(broken(format!("{name}: holder filed under another lock")));
                }
                if h.fence.get() >= self.next_fence {
                    return Err(broken(format!(
                        "{name}: fence {} is ahead of the counter",
                        h.fence
                    )));
                }
                fences.push(h.fence);
                match h.lease {
                    Lease::Own { deadline_ms, .. } => {
                        if deadline_ms <= self.now_ms {
                            return Err(broken(format!("{name}: holder past its lease")));
                        }
                    }
                    Lease::Session(id) => {
                        let s = self
                            .sessions
                            .get(&id)
                            .ok_or_else(|| broken(format!("{name}: holder of a dead session")))?;
                        if !s.holders.contains(t) {
                            return Err(broken(format!(
                                "{name}: session does not list its holder"
                            )));
                        }
                    }
                }
                counted_holders += 1;
            }
            for t in &lock.waiters {
                let w = self
                    .waiters
                    .get(t)
                    .ok_or_else(|| broken(format!("{name}: unknown waiter")))?;
                if w.name != *name || w.wait_deadline_ms <= self.now_ms {
                    return Err(broken(format!("{name}: misfiled or timed-out waiter")));
                }
                if let Some(id) = w.session {
                    let s = self
                        .sessions
                        .get(&id)
                        .ok_or_else(|| broken(format!("{name}: waiter of a dead session")))?;
                    if !s.waiters.contains(t) {
                        return Err(broken(format!("{name}: session does not list its waiter")));
                    }
                }
                counted_waiters += 1;
            }
        }
        fences.sort_unstable();
        if let Some(w) = fences.windows(2).find(|w| w[0] == w[1]) {
            return Err(broken(format!("fence {} is held twice", w[0])));
        }
        if counted_holders != self.holders.len() || counted_waiters != self.waiters.len() {
            return Err(broken("holder or waiter table out of step with the locks"));
        }
        let shared_waiters = self
            .waiters
            .values()
            .filter(|w| w.mode == Mode::Shared)
            .count();
        if shared_holders != self.shared_holders || shared_waiters != self.shared_waiters {
            return Err(broken("shared holder or waiter counts out of step"));
        }
        self.check_queues().map_err(broken)?;
        for (id, s) in &self.sessions {
            if s.deadline_ms <= self.now_ms {
                return Err(broken(format!("session {id} past its lease")));
            }
            if !self.timers.contains(&(s.deadline_ms, Timer::Session(*id))) {
                return Err(broken(format!("session {id} has no timer")));
            }
        }
        if self
            .request_ids
            .values()
            .any(|t| !self.holders.contains_key(t) && !self.waiters.contains_key(t))
        {
            return Err(broken("request id points at nothing"));
        }
        let mut usage: HashMap<Tenant, Usage> = HashMap::new();
        for t in self.sessions.values().filter_map(|s| s.tenant.clone()) {
            usage.entry(t).or_default().sessions += 1;
        }
        for t in self.holders.values().filter_map(|h| h.tenant.clone()) {
            usage.entry(t).or_default().held += 1;
        }
        for t in self.waiters.values().filter_map(|w| w.tenant.clone()) {
            usage.entry(t).or_default().waiting += 1;
        }
        if usage != self.usage {
            return Err(broken(
                "per-principal usage counts out of step with the tables",
            ));
        }
        Ok(())
    }

    /// Exports the whole state, for a snapshot. Deterministic: same state, same image.
    pub fn export(&self) -> StateImage {
        let locks = self
            .locks
            .iter()
            .map(|(key, lock)| LockImage {
                name: key.name.clone(),
                limit: lock.limit,
                blocked_until_ms: lock.blocked_until_ms,
                holders: lock
                    .holders
                    .iter()
                    .map(|t| {
                        let h = &self.holders[t];
                        HolderImage {
                            token: *t,
                            fence: h.fence,
                            owner: h.owner.clone(),
                            request_id: h.request_id.clone(),
                            lease: match h.lease {
                                Lease::Own {
                                    ttl_ms,
                                    deadline_ms,
                                } => LeaseImage::Own {
                                    ttl_ms,
                                    deadline_ms,
                                },
                                Lease::Session(id) => LeaseImage::Session(id),
                            },
                            granted_at_ms: h.granted_at_ms,
                            lock_delay_ms: h.lock_delay_ms,
                            tenant: h.tenant.clone(),
                            mode: h.mode,
                            value: h.value.clone(),
                        }
                    })
                    .collect(),
                waiters: lock
                    .waiters
                    .iter()
                    .map(|t| {
                        let w = &self.waiters[t];
                        WaiterImage {
                            token: *t,
                            owner: w.owner.clone(),
                            request_id: w.request_id.clone(),
                            ttl_ms: w.ttl_ms,
                            session: w.session,
                            lock_delay_ms: w.lock_delay_ms,
                            enqueued_at_ms: w.enqueued_at_ms,
                            wait_deadline_ms: w.wait_deadline_ms,
                            tenant: w.tenant.clone(),
                            mode: w.mode,
                            value: w.value.clone(),
                            group: w.group.as_deref().map(<[_]>::to_vec).unwrap_or_default(),
                        }
                    })
                    .collect(),
            })
            .collect();
        let mut sessions: Vec<SessionImage> = self
            .sessions
            .iter()
            .map(|(id, s)| SessionImage {
                id: *id,
                owner: s.owner.clone(),
                tenant: s.tenant.clone(),
                ttl_ms: s.ttl_ms,
                deadline_ms: s.deadline_ms,
            })
            .collect();
        sessions.sort_by_key(|s| s.id);
        StateImage {
            now_ms: self.now_ms,
            next_fence: self.next_fence,
            locks,
            sessions,
            recent_ends: self
                .recent_order
                .iter()
                .map(|t| {
                    let (name, end) = &self.recent_ends[t];
                    (*t, name.clone(), *end)
                })
                .collect(),
        }
    }

    /// Rebuilds a core from an image, checking it: an image that breaks an invariant
    /// is refused, never loaded.
    ///
    /// Every invariant [`Core::check_invariants`] checks is checked here in the one
    /// pass that builds the tables (a second pass over a million locks, with a random
    /// lookup per holder, was a tenth of a restart); debug builds run the full check
    /// afterwards as well.
    pub fn import(config: Config, image: StateImage) -> Result<Core, InvariantError> {
        Core::import_with_room(config, image, 0)
    }

    /// [`Core::import`], with room for `grants` more holders on top of the image's
    /// (see [`Core::reserve`]; cheaper here, before the tables are filled).
    pub fn import_with_room(
        config: Config,
        image: StateImage,
        grants: usize,
    ) -> Result<Core, InvariantError> {
        let mut core = Core::new(config);
        // Built as vectors and bulk-loaded: much cheaper than a million inserts.
        let mut timers: Vec<(u64, Timer)> = Vec::new();
        let mut locks: Vec<(NameKey, Lock)> = Vec::with_capacity(image.locks.len());
        let holders: usize = image.locks.iter().map(|l| l.holders.len()).sum();
        let waiters: usize = image.locks.iter().map(|l| l.waiters.len()).sum();
        let mut fences: Vec<u64> = Vec::with_capacity(holders);
        core.holders.reserve(holders + grants);
        core.waiters.reserve(waiters);
        // Sized up front: growing it rehashes every (name, request id) string with
        // SipHash, which was a sixth of a restart with a million locks.
        let request_ids = image
            .locks
            .iter()
            .flat_map(|l| {
                let h = l.holders.iter().map(|h| h.request_id.is_some());
                h.chain(l.waiters.iter().map(|w| w.request_id.is_some()))
            })
            .filter(|has| *has)
            .count();
        core.request_ids.reserve(request_ids + grants);
        core.sessions.reserve(image.sessions.len());
        timers.reserve(holders + waiters + image.sessions.len());
        core.now_ms = image.now_ms;
        core.next_fence = image.next_fence.max(1);
        let now = core.now_ms;
        for s in image.sessions {
            // `Recover` restarts every lease at `now + ttl_ms`: a zero TTL would
            // make it expire at once, which no live core can have written.
            if s.ttl_ms == 0 {
                return Err(bad_image(format!("session {} has ttl_ms 0", s.id)));
            }
            if s.deadline_ms <= now {
                return Err(bad_image(format!("session {} past its lease", s.id)));
            }
            timers.push((s.deadline_ms, Timer::Session(s.id)));
            core.count(s.tenant.as_ref(), |u| u.sessions += 1);
            let dup = core.sessions.insert(
                s.id,
                Session {
                    owner: s.owner,
                    tenant: s.tenant,
                    ttl_ms: s.ttl_ms,
                    deadline_ms: s.deadline_ms,
                    holders: BTreeSet::new(),
                    waiters: BTreeSet::new(),
                },
            );
            if dup.is_some() {
                return Err(bad_image(format!("session {} appears twice", s.id)));
            }
        }
        for l in image.locks {
            let name = l.name;
            if l.limit == 0 {
                return Err(bad_image(format!("lock {name} has limit 0")));
            }
            let blocked = l.blocked_until_ms > now;
            if l.holders.is_empty() && l.waiters.is_empty() && !blocked {
                return Err(bad_image(format!("{name}: unused lock record kept")));
            }
            let mut lock = Lock {
                shared: l.holders.iter().filter(|h| h.mode == Mode::Shared).count(),
                limit: l.limit,
                blocked_until_ms: l.blocked_until_ms,
                holders: Vec::with_capacity(l.holders.len()),
                waiters: VecDeque::with_capacity(l.waiters.len()),
            };
            if blocked {
                timers.push((l.blocked_until_ms, Timer::Unblock(name.clone())));
            }
            for h in l.holders {
                if h.granted_at_ms > now {
                    return Err(bad_image(format!(
                        "holder {} was granted in the future",
                        h.token
                    )));
                }
                if h.fence.get() >= core.next_fence {
                    return Err(bad_image(format!(
                        "{name}: fence {} is ahead of the counter",
                        h.fence
                    )));
                }
                fences.push(h.fence.get());
                let lease = match h.lease {
                    LeaseImage::Own {
                        ttl_ms,
                        deadline_ms,
                    } => {
                        if ttl_ms == 0 {
                            return Err(bad_image(format!("holder {} has ttl_ms 0", h.token)));
                        }
                        if deadline_ms <= now {
                            return Err(bad_image(format!("{name}: holder past its lease")));
                        }
                        timers.push((deadline_ms, Timer::Lease(h.token)));
                        Lease::Own {
                            ttl_ms,
                            deadline_ms,
                        }
                    }
                    LeaseImage::Session(id) => {
                        core.sessions
                            .get_mut(&id)
                            .ok_or_else(|| bad_image(format!("holder of unknown session {id}")))?
                            .holders
                            .insert(h.token);
                        Lease::Session(id)
                    }
                };
                if let Some(r) = &h.request_id {
                    if core
                        .request_ids
                        .insert((name.clone(), r.clone()), h.token)
                        .is_some()
                    {
                        return Err(bad_image(format!(
                            "request id {} appears twice on {name}",
                            r.as_str()
                        )));
                    }
                }
                lock.holders.push(h.token);
                core.count(h.tenant.as_ref(), |u| u.held += 1);
                core.shared_holders += usize::from(h.mode == Mode::Shared);
                let dup = core.holders.insert(
                    h.token,
                    Holder {
                        name: name.clone(),
                        fence: h.fence,
                        owner: h.owner,
                        request_id: h.request_id,
                        lease,
                        granted_at_ms: h.granted_at_ms,
                        lock_delay_ms: h.lock_delay_ms,
                        tenant: h.tenant,
                        mode: h.mode,
                        value: h.value,
                    },
                );
                if dup.is_some() || core.waiters.contains_key(&h.token) {
                    return Err(bad_image(format!("owner token {} appears twice", h.token)));
                }
            }
            for w in l.waiters {
                if w.ttl_ms == Some(0) {
                    return Err(bad_image(format!("waiter {} has ttl_ms 0", w.token)));
                }
                if w.ttl_ms.is_some() == w.session.is_some() {
                    return Err(bad_image(format!(
                        "waiter {} needs exactly one of ttl_ms and session",
                        w.token
                    )));
                }
                if w.enqueued_at_ms > now {
                    return Err(bad_image(format!(
                        "waiter {} was queued in the future",
                        w.token
                    )));
                }
                if w.wait_deadline_ms <= now {
                    return Err(bad_image(format!("{name}: timed-out waiter")));
                }
                if let Some(id) = w.session {
                    core.sessions
                        .get_mut(&id)
                        .ok_or_else(|| bad_image(format!("waiter of unknown session {id}")))?
                        .waiters
                        .insert(w.token);
                }
                if let Some(r) = &w.request_id {
                    if core
                        .request_ids
                        .insert((name.clone(), r.clone()), w.token)
                        .is_some()
                    {
                        return Err(bad_image(format!(
                            "request id {} appears twice on {name}",
                            r.as_str()
                        )));
                    }
                }
                timers.push((w.wait_deadline_ms, Timer::Wait(w.token)));
                lock.waiters.push_back(w.token);
                core.count(w.tenant.as_ref(), |u| u.waiting += 1);
                core.shared_waiters += usize::from(w.mode == Mode::Shared);
                let dup = core.waiters.insert(
                    w.token,
                    Waiter {
                        name: name.clone(),
                        owner: w.owner,
                        request_id: w.request_id,
                        ttl_ms: w.ttl_ms,
                        session: w.session,
                        lock_delay_ms: w.lock_delay_ms,
                        enqueued_at_ms: w.enqueued_at_ms,
                        wait_deadline_ms: w.wait_deadline_ms,
                        tenant: w.tenant,
                        mode: w.mode,
                        value: w.value,
                        group: (!w.group.is_empty()).then(|| w.group.into()),
                    },
                );
                if dup.is_some() || core.holders.contains_key(&w.token) {
                    return Err(bad_image(format!("owner token {} appears twice", w.token)));
                }
            }
            let holders = &core.holders;
            Self::check_modes(core.config.max_limit, &name, &lock, |t| {
                holders.get(t).map(|h| (h.mode, h.fence, h.value.is_some()))
            })
            .map_err(bad_image)?;
            let key = NameKey::new(name);
            if locks.last().is_some_and(|(last, _)| *last >= key) {
                return Err(bad_image(format!(
                    "lock {} is out of order or appears twice",
                    key.name
                )));
            }
            locks.push((key, lock));
        }
        fences.sort_unstable();
        if let Some(w) = fences.windows(2).find(|w| w[0] == w[1]) {
            return Err(bad_image(format!("fence {} is held twice", w[0])));
        }
        drop(fences);
        for (token, name, end) in image.recent_ends {
            core.remember_end(token, name, end);
        }
        core.locks = locks.into_iter().collect();
        core.timers = timers.into_iter().collect();
        core.check_queues().map_err(bad_image)?;
        debug_assert_eq!(core.check_invariants(), Ok(()));
        Ok(core)
    }
}

#[cfg(test)]
mod name_key_tests {
    use super::*;
    use proptest::prelude::*;

    fn key(s: &str) -> NameKey {
        NameKey::new(LockName::new(s).expect("valid name"))
    }

    /// The lock table lists in name order only if its key orders exactly like the
    /// names, around the 16 inline bytes too (prefixes, equal heads, multibyte text).
    #[test]
    fn orders_like_the_names_at_the_inline_boundary() {
        let names = [
            "a",
            "ab",
            "a b",
            "w5/0000001",
            "w5/0000010",
            "0123456789abcde",
            "0123456789abcdef",
            "0123456789abcdef0",
            "0123456789abcdeg",
            "0123456789abcdef\u{e9}",
            "0123456789abcdefz",
            "0123456789abcde\u{e9}",
            "\u{e9}",
            "~",
        ];
        for a in names {
            for b in names {
                assert_eq!(key(a).cmp(&key(b)), a.cmp(b), "{a:?} vs {b:?}");
                assert_eq!(key(a) == key(b), a == b, "{a:?} == {b:?}");
            }
        }
    }

    proptest! {
        #[test]
        fn orders_like_the_names(a in "[ a-c\u{e9}]{1,20}", b in "[ a-c\u{e9}]{1,20}") {
            prop_assert_eq!(key(&a).cmp(&key(&b)), a.cmp(&b));
            prop_assert_eq!(key(&a) == key(&b), a == b);
        }
    }
}
