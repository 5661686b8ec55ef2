//! ZooKeeper as a [`LockBackend`] (cargo feature `zookeeper`): the ephemeral-sequential
//! lock recipe over this crate's own implementation of the ZooKeeper protocol (jute
//! over tokio; no client library, no JVM).
//!
//! ```no_run
//! use std::sync::Arc;
//! use fencelock::zookeeper::{ZooKeeperBackend, ZooKeeperConfig};
//!
//! # fn demo() -> Result<(), fencelock::Error> {
//! let backend = ZooKeeperBackend::new(ZooKeeperConfig::new("10.0.0.1:2181,10.0.0.2:2181"))?;
//! let client = fencelock::Client::from_backend(Arc::new(backend));
//! # let _ = client; Ok(()) }
//! ```
//!
//! Needs ZooKeeper 3.5.3 or later (container nodes, `create2`); tested against 3.8.
//!
//! # The recipe
//! A lock `name` is a container node `<root>/<encoded name>` (percent-encoded, so any
//! name is a single safe znode name; ZooKeeper deletes the container once it is empty).
//! An acquire creates an **ephemeral-sequential** child
//! `lock-<session id>-<limit>-<encoded request id>-<sequence>`, lists the children and
//! sorts them by sequence: the first `limit` are the holders. A waiter watches only
//! the `limit` nodes just ahead of it (for a mutex, its immediate predecessor), never
//! the parent, so a release wakes one waiter, not the whole queue. Release deletes
//! the node; a waiter whose wait ends deletes its own.
//!
//! **Idempotent retries:** the session id and request id in the node name make a
//! retry find the node an earlier attempt created, even one whose `create` answer was
//! lost (Curator's "protected mode"): an acquire first looks for a child with its
//! prefix and adopts it, and never creates a second one. A node left behind by an
//! attempt that gave up while disconnected is deleted in the background as soon as
//! the session reconnects (a retry with the same request id waits for that first).
//!
//! # Leases are sessions
//! ZooKeeper has no per-node TTL: an ephemeral node lives as long as the session that
//! created it. So a lease **is** a session: the backend keeps one session per distinct
//! requested `ttl`, whose session timeout is that ttl, shared by every grant and
//! waiter of that ttl. The session is kept alive by pings every third of its timeout
//! while the backend runs; the server expires it (deleting its nodes, which frees the
//! locks and wakes the next waiters) once it has heard nothing from the client for the
//! timeout — a crashed, paused or partitioned holder loses its locks after at most
//! `ttl` plus one server tick (`tickTime`; expiries are rounded up to a tick).
//!
//! - The server negotiates the timeout into `[minSessionTimeout, maxSessionTimeout]`
//!   (by default 2 and 20 ticks). A ttl above the maximum is refused with
//!   `InvalidArgument` (the lease could not be kept); a ttl below the minimum is
//!   granted as the minimum, and [`Lease::ttl`] reports what was granted.
//! - `renew` does not extend anything by itself: it is an `exists` round trip that
//!   proves the session is alive and the node still ours, and returns the session
//!   timeout (a lease runs at least that long from the moment the server answered).
//!   While the connection is down (**suspended**: the session may still live) renew
//!   fails with `Unavailable`, so the guard's conservative deadline decides; once the
//!   session is **lost** (the server says it expired, or no server answered for a
//!   whole timeout since the last reply, as Curator assumes) renew says `NotHeld`.
//! - A grant that is neither released nor lost stays held for as long as the backend
//!   runs (its session is pinged whether or not anybody renews). Dropping the
//!   [`ZooKeeperBackend`] closes its sessions, deleting every node it holds.
//! - A release while disconnected fails with `Unavailable` at once and deletes the
//!   node in the background as soon as the session reconnects (if it expires instead,
//!   the node goes with it).
//!
//! # Fences
//! The fence is the node's creation zxid (`czxid`): the zxid of the transaction that
//! created it, unique and strictly increasing across the whole ensemble (epoch in the
//! high 32 bits), and holders are granted in node-creation order — so a later grant
//! of a lock always carries a larger fence. ZooKeeper fsyncs its transaction log before
//! acknowledging a write (`forceSync=yes`, the default): fences are
//! [`FenceGuarantee::Durable`]. A server run with `forceSync=no` weakens this.
//!
//! # What it cannot promise
//! - No lock-delay: a freed lock goes to the next waiter at once (`lock_delay > 0` is
//!   refused). No sessions API beyond the per-ttl session described above.
//! - Expiry is decided on the ZooKeeper leader's monotonic clock (`System.nanoTime`
//!   in 3.5+), but only to a tick: a lost holder's lock is freed up to one `tickTime`
//!   after its ttl.
//! - Every grant on one backend with the same ttl shares one session: when it expires,
//!   all of them are lost together.
//! - The lock tree is created with the open ACL (`world:anyone`); anyone who can write
//!   to the ensemble can delete a lock node (the holder then sees `NotHeld` on its next
//!   renewal, after another client may already hold the lock).
//! - A lock used with different `limit`s at once is refused with `LimitMismatch` for
//!   the later arrivals while a node with another limit is ahead of them.
//! - `acquire` can overrun its wait by up to two thirds of the ttl when the connection
//!   dies silently mid-request (that is when the backend declares it dead), and
//!   opening a session may take up to `connect_timeout` per server.
//! - `renew` cannot change a session's timeout: it returns the session's, whatever
//!   ttl it is asked for.
//! - No ZooKeeper authentication (`addauth`, SASL) and no TLS: use it on a trusted
//!   network, or put the ensemble's own access control in front.
//! - After a reconnect, server-side watches are not re-registered (no `SetWatches`):
//!   every waiter simply lists its queue again.

mod jute;
mod session;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use self::jute::{code, mode, op, Reader};
use self::session::{Dial, Fault, Session, State, Watcher};
use fencelock_backend::{AcquireSpec, BoxFuture, Capabilities, FenceGuarantee, Lease, LockBackend};
use fencelock_backend::{Error, ErrorKind};

/// How to reach a ZooKeeper ensemble.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ZooKeeperConfig {
    /// `host:port` of each server, tried in turn.
    pub servers: Vec<String>,
    /// The node under which every lock lives, e.g. `/fencelock` (the default). Created
    /// (persistent) on first use.
    pub root: String,
    /// Longest wait for a connection and session handshake with one server. Default 5 s.
    pub connect_timeout: Duration,
    /// Most sessions one backend opens (one per distinct ttl in use). Default 16.
    pub max_sessions: usize,
    /// Most requests in flight on one session. Default 1024.
    pub max_in_flight: usize,
}

impl ZooKeeperConfig {
    /// The defaults for a ZooKeeper connect string, `host:port[,host:port...]` (no
    /// chroot suffix: use [`root`](ZooKeeperConfig::root)).
    pub fn new(connect_string: &str) -> ZooKeeperConfig {
        ZooKeeperConfig {
            servers: connect_string
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect(),
            root: "/fencelock".to_owned(),
            connect_timeout: Duration::from_secs(5),
            max_sessions: 16,
            max_in_flight: 1024,
        }
    }
}

/// Locks on a ZooKeeper ensemble (see the [module docs](self) for the recipe and what
/// it promises). Cheap to share behind an `Arc`; dropping the last handle closes its
/// sessions, releasing everything it holds.
#[derive(Debug)]
pub struct ZooKeeperBackend {
    inner: Arc<Inner>,
}

/// The largest `limit` accepted (the fencelock server's default bound; a waiter
/// watches `limit` nodes).
pub const MAX_LIMIT: u32 = 1024;
/// The largest `max_in_flight` accepted.
const MAX_IN_FLIGHT: usize = 1 << 20;
/// The most rounds (list, watch, wake) one acquire makes before giving up.
const MAX_ROUNDS: u32 = 100_000;
/// How often a background clean-up retries before it gives up on a node.
const RETIRE_ATTEMPTS: u32 = 64;
/// Most parent paths remembered as existing.
const MAX_KNOWN_PARENTS: usize = 4096;
/// Prefix of every lock node's name.
const NODE_PREFIX: &str = "lock-";

#[derive(Debug)]
struct Inner {
    dial: Arc<Dial>,
    root: String,
    max_sessions: usize,
    /// Live sessions by requested timeout in milliseconds.
    sessions: Mutex<HashMap<u32, Arc<Session>>>,
    /// Serializes session opening, so one ttl never gets two sessions.
    opening: tokio::sync::Mutex<()>,
    /// Lock parents known to exist (the root included).
    parents: Mutex<HashSet<String>>,
}

impl ZooKeeperBackend {
    /// A backend for `config`. Sessions are opened on first use, so this does not
    /// touch the network; it fails only on a bad configuration.
    pub fn new(config: ZooKeeperConfig) -> Result<ZooKeeperBackend, Error> {
        if config.servers.is_empty() {
            return Err(invalid("no ZooKeeper servers given"));
        }
        if config.servers.iter().any(|s| s.contains('/')) {
            return Err(invalid(
                "a chroot suffix in the connect string is not supported: set root instead",
            ));
        }
        check_root(&config.root)?;
        if config.connect_timeout.is_zero() || config.max_sessions == 0 {
            return Err(invalid("connect_timeout and max_sessions must be positive"));
        }
        if config.max_in_flight == 0 || config.max_in_flight > MAX_IN_FLIGHT {
            return Err(invalid(format!(
                "max_in_flight must be between 1 and {MAX_IN_FLIGHT}"
            )));
        }
        Ok(ZooKeeperBackend {
            inner: Arc::new(Inner {
                dial: Arc::new(Dial {
                    servers: config.servers,
                    connect_timeout: config.connect_timeout,
                    max_in_flight: config.max_in_flight,
                }),
                root: config.root,
                max_sessions: config.max_sessions,
                sessions: Mutex::new(HashMap::new()),
                opening: tokio::sync::Mutex::new(()),
                parents: Mutex::new(HashSet::new()),
            }),
        })
    }

    async fn acquire_lock(&self, spec: &AcquireSpec) -> Result<Lease, Error> {
        spec.validate()?;
        if !spec.lock_delay.is_zero() {
            return Err(invalid(
                "ZooKeeper locks have no lock-delay: a freed lock goes to the next waiter at once",
            ));
        }
        if spec.limit > MAX_LIMIT {
            return Err(invalid(format!("limit must be at most {MAX_LIMIT}")));
        }
        let started = Instant::now();
        let deadline = started
            .checked_add(spec.wait)
            .unwrap_or(started + fencelock_backend::MAX_TTL);
        let session = self.inner.session(spec.ttl).await?;
        let parent = self.inner.parent_path(&spec.name);
        let prefix = node_prefix(session.id(), spec.limit, &spec.request_id);
        let key = format!("{parent}/{prefix}");
        let grace = session.timeout() / 3;
        if !session.retired(&key, deadline.max(started + grace)).await {
            return Err(Error::new(
                ErrorKind::Unavailable,
                "an earlier attempt with this request id left a node that is still being deleted",
            ));
        }
        let mut attempt = Attempt {
            inner: &self.inner,
            spec,
            session,
            parent,
            prefix,
            node: None,
            uncertain: false,
            deadline,
        };
        let result = attempt.run().await;
        if result.is_err() {
            attempt.abandon().await;
        }
        result
    }

    async fn renew_lease(&self, lease: &Lease) -> Result<Duration, Error> {
        let Some((session, path)) = self.inner.grant(lease) else {
            return Err(not_held(
                lease,
                "its session is not one of this backend's live sessions",
            ));
        };
        let connect_by = Instant::now() + session.timeout() / 3;
        let body = jute::path_watch(&path, false);
        match session.call(op::EXISTS, body, connect_by).await {
            Ok(body) => {
                let stat = Reader(&body).stat().map_err(malformed)?;
                if stat.ephemeral_owner != session.id() {
                    return Err(not_held(lease, "its node belongs to another session"));
                }
                Ok(session.timeout())
            }
            Err(Fault::Server(code::NO_NODE)) => Err(not_held(lease, "its node is gone")),
            Err(Fault::Lost | Fault::Closed) => Err(not_held(lease, "its session expired")),
            Err(fault) => Err(error(fault)),
        }
    }

    async fn release_lease(&self, lease: &Lease) -> Result<bool, Error> {
        let Some((session, path)) = self.inner.grant(lease) else {
            return Ok(false);
        };
        // No waiting for a reconnect: while disconnected the node is deleted in the
        // background as soon as the session is back (see below).
        let connect_by = Instant::now();
        match session
            .call(op::DELETE, jute::delete(&path), connect_by)
            .await
        {
            Ok(_) => Ok(true),
            Err(Fault::Server(code::NO_NODE) | Fault::Lost | Fault::Closed) => Ok(false),
            Err(Fault::Disconnected) => {
                // Delete it as soon as the session is back (or it dies with it).
                let prefix = lease
                    .owner_token
                    .trim_end_matches(|c: char| c.is_ascii_digit());
                let parent = self.inner.parent_path(&lease.name);
                retire(session, parent, prefix.to_owned());
                Err(error(Fault::Disconnected))
            }
            Err(fault) => Err(error(fault)),
        }
    }
}

impl Inner {
    /// The live session for `ttl`, opened if needed.
    async fn session(&self, ttl: Duration) -> Result<Arc<Session>, Error> {
        // Whole milliseconds, rounded up; validate() bounds ttl to 24 h.
        let timeout_ms = u32::try_from(ttl.as_nanos().div_ceil(1_000_000)).unwrap_or(u32::MAX);
        if let Some(session) = self.live_session(timeout_ms) {
            return Ok(session);
        }
        let _opening = self.opening.lock().await;
        if let Some(session) = self.live_session(timeout_ms) {
            return Ok(session);
        }
        {
            let mut sessions = lock(&self.sessions);
            sessions.retain(|_, s| !matches!(s.state(), State::Lost | State::Closed));
            if sessions.len() >= self.max_sessions {
                return Err(Error::new(
                    ErrorKind::ResourceExhausted,
                    format!(
                        "{} ZooKeeper sessions open (one per distinct ttl): use fewer distinct ttls or raise max_sessions",
                        sessions.len()
                    ),
                ));
            }
        }
        let requested = i32::try_from(timeout_ms).unwrap_or(i32::MAX);
        let session = Session::open(self.dial.clone(), requested)
            .await
            .map_err(error)?;
        if session.timeout() < Duration::from_millis(u64::from(timeout_ms)) {
            return Err(invalid(format!(
                "ttl {ttl:?} is longer than this ZooKeeper server allows (it granted a {:?} session: see maxSessionTimeout)",
                session.timeout()
            )));
        }
        let session = Arc::new(session);
        lock(&self.sessions).insert(timeout_ms, session.clone());
        Ok(session)
    }

    fn live_session(&self, timeout_ms: u32) -> Option<Arc<Session>> {
        lock(&self.sessions)
            .get(&timeout_ms)
            .filter(|s| matches!(s.state(), State::Connected | State::Suspended))
            .cloned()
    }

    /// The session and node path of a lease this backend granted, if its session is
    /// still one of ours. Nothing else is ever renewed or deleted.
    fn grant(&self, lease: &Lease) -> Option<(Arc<Session>, String)> {
        let node = parse_node(&lease.owner_token)?;
        let session = lock(&self.sessions)
            .values()
            .find(|s| s.id() == node.session)
            .cloned()?;
        let path = format!("{}/{}", self.parent_path(&lease.name), lease.owner_token);
        Some((session, path))
    }

    fn parent_path(&self, name: &str) -> String {
        format!("{}/{}", self.root, encode(name))
    }

    /// Creates the root's nodes (persistent) and `parent` (a container) if missing.
    async fn ensure_parent(
        &self,
        session: &Session,
        parent: &str,
        connect_by: Instant,
    ) -> Result<(), Fault> {
        if lock(&self.parents).contains(parent) {
            return Ok(());
        }
        let mut path = String::new();
        let root_known = lock(&self.parents).contains(&self.root);
        if !root_known {
            for component in self.root.split('/').skip(1) {
                path.push('/');
                path.push_str(component);
                create_if_missing(session, op::CREATE2, &path, mode::PERSISTENT, connect_by)
                    .await?;
            }
        }
        create_if_missing(
            session,
            op::CREATE_CONTAINER,
            parent,
            mode::CONTAINER,
            connect_by,
        )
        .await?;
        let mut parents = lock(&self.parents);
        if parents.len() >= MAX_KNOWN_PARENTS {
            parents.clear();
        }
        parents.insert(self.root.clone());
        parents.insert(parent.to_owned());
        Ok(())
    }

    /// Forgets that `parent` (and the root) exist, after a create found it missing.
    fn forget_parent(&self, parent: &str) {
        let mut parents = lock(&self.parents);
        parents.remove(parent);
        parents.remove(&self.root);
    }
}

async fn create_if_missing(
    session: &Session,
    opcode: i32,
    path: &str,
    node_mode: i32,
    connect_by: Instant,
) -> Result<(), Fault> {
    match session
        .call(opcode, jute::create(path, node_mode), connect_by)
        .await
    {
        Ok(_) | Err(Fault::Server(code::NODE_EXISTS)) => Ok(()),
        Err(fault) => Err(fault),
    }
}

/// One acquire on one session.
struct Attempt<'a> {
    inner: &'a Inner,
    spec: &'a AcquireSpec,
    session: Arc<Session>,
    parent: String,
    /// `lock-<session>-<limit>-<request id>-`: every node of this request.
    prefix: String,
    /// Our node's name once created or found, and its czxid once known.
    node: Option<(String, Option<i64>)>,
    /// A create's answer was lost: our node may exist under an unknown name.
    uncertain: bool,
    deadline: Instant,
}

/// What one round of the recipe decided.
enum Step {
    Granted(Lease),
    Refused(Error),
    /// Something changed: look again at once.
    Again,
    /// Watches are set: wait for a change.
    Wait,
}

/// A lock node's name, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Node<'a> {
    name: &'a str,
    session: i64,
    limit: u32,
    sequence: i64,
}

impl Attempt<'_> {
    async fn run(&mut self) -> Result<Lease, Error> {
        let mut watcher = self.session.watcher();
        for _ in 0..MAX_ROUNDS {
            match self.round(&mut watcher).await {
                Ok(Step::Granted(lease)) => return Ok(lease),
                Ok(Step::Refused(e)) => return Err(e),
                Ok(Step::Again) => {}
                Ok(Step::Wait) => {
                    tokio::select! {
                        _ = watcher.changed() => {}
                        _ = tokio::time::sleep_until(self.deadline) => {}
                    }
                }
                // The connection dropped: wait for the session to come back within the
                // wait budget, then look again (our node, if any, is still there).
                Err(Fault::Disconnected) if Instant::now() < self.deadline => {
                    if let Err(fault) = self.session.connected(self.deadline).await {
                        return Err(self.fault(fault));
                    }
                }
                Err(fault) => return Err(self.fault(fault)),
            }
        }
        Err(Error::new(
            ErrorKind::Unavailable,
            format!(
                "the queue of {:?} changed more than {MAX_ROUNDS} times during one acquire",
                self.spec.name
            ),
        ))
    }

    fn fault(&self, fault: Fault) -> Error {
        match fault {
            Fault::Lost => Error::new(
                ErrorKind::Unavailable,
                "the ZooKeeper session expired during the acquire (a retry opens a new one)",
            ),
            other => error(other),
        }
    }

    /// Waiting for a connection: until the deadline, but a zero wait still rides out
    /// a short blip.
    fn connect_by(&self) -> Instant {
        self.deadline
            .max(Instant::now() + self.session.timeout() / 3)
    }

    async fn round(&mut self, watcher: &mut Watcher) -> Result<Step, Fault> {
        let connect_by = self.connect_by();
        let listing = self
            .session
            .call(
                op::GET_CHILDREN,
                jute::path_watch(&self.parent, false),
                connect_by,
            )
            .await;
        let children = match listing {
            Ok(body) => Reader(&body).strings().map_err(malformed_fault)?,
            Err(Fault::Server(code::NO_NODE)) => Vec::new(),
            Err(fault) => return Err(fault),
        };
        let mut queue: Vec<Node<'_>> = children.iter().filter_map(|c| parse_node(c)).collect();
        queue.sort_by_key(|n| n.sequence);
        let ours: Vec<&str> = queue
            .iter()
            .filter(|n| n.name.starts_with(&self.prefix))
            .map(|n| n.name)
            .collect();
        let Some(&mine) = ours.first() else {
            if self.node.take().is_some() {
                return Ok(Step::Refused(Error::new(
                    ErrorKind::Unavailable,
                    format!(
                        "the lock node of this acquire of {:?} was deleted while waiting",
                        self.spec.name
                    ),
                )));
            }
            self.create(connect_by).await?;
            return Ok(Step::Again);
        };
        self.uncertain = false;
        if self.node.as_ref().is_none_or(|(name, _)| name != mine) {
            self.node = Some((mine.to_owned(), None));
        }
        // A create retried after a lost answer can leave a second node: keep the first.
        for extra in &ours[1..] {
            let path = format!("{}/{extra}", self.parent);
            match self
                .session
                .call(op::DELETE, jute::delete(&path), connect_by)
                .await
            {
                Ok(_) | Err(Fault::Server(code::NO_NODE)) => {}
                Err(fault) => return Err(fault),
            }
        }
        let position = queue.iter().position(|n| n.name == mine).unwrap_or(0);
        let ahead = &queue[..position];
        let limit = self.spec.limit;
        if let Some(other) = ahead.iter().find(|n| n.limit != limit) {
            return Ok(Step::Refused(Error::new(
                ErrorKind::LimitMismatch,
                format!(
                    "lock {:?} is in use with limit {}, not {limit}",
                    self.spec.name, other.limit
                ),
            )));
        }
        if position < limit as usize {
            return self.granted().await;
        }
        if Instant::now() >= self.deadline {
            let (kind, what) = if self.spec.wait.is_zero() {
                (ErrorKind::Held, "is held")
            } else {
                (ErrorKind::Timeout, "was not granted within the wait")
            };
            return Ok(Step::Refused(Error::new(
                kind,
                format!("lock {:?} {what} ({} ahead)", self.spec.name, position),
            )));
        }
        // Watch only the `limit` nodes just ahead: our turn can only come when one of
        // them goes (a node further ahead going shifts them all, and is seen then).
        watcher.reset();
        for node in &ahead[position - limit as usize..] {
            let path = format!("{}/{}", self.parent, node.name);
            watcher.watch(&path)?;
            let body = jute::path_watch(&path, true);
            match self.session.call(op::GET_DATA, body, connect_by).await {
                Ok(_) => {}
                Err(Fault::Server(code::NO_NODE)) => return Ok(Step::Again),
                Err(fault) => return Err(fault),
            }
        }
        Ok(Step::Wait)
    }

    /// Creates our node (and its parents), retrying when a parent vanishes.
    async fn create(&mut self, connect_by: Instant) -> Result<(), Fault> {
        let path = format!("{}/{}", self.parent, self.prefix);
        for _ in 0..3 {
            self.inner
                .ensure_parent(&self.session, &self.parent, connect_by)
                .await?;
            let body = jute::create(&path, mode::EPHEMERAL_SEQUENTIAL);
            match self.session.call(op::CREATE2, body, connect_by).await {
                Ok(body) => {
                    let mut r = Reader(&body);
                    let created = r.string().map_err(malformed_fault)?;
                    let stat = r.stat().map_err(malformed_fault)?;
                    let name = created.rsplit('/').next().unwrap_or_default().to_owned();
                    self.node = Some((name, Some(stat.czxid)));
                    return Ok(());
                }
                // The parent container was deleted (empty) in between: make it again.
                Err(Fault::Server(code::NO_NODE)) => self.inner.forget_parent(&self.parent),
                Err(fault) => {
                    self.uncertain = matches!(fault, Fault::Disconnected);
                    return Err(fault);
                }
            }
        }
        Err(Fault::Server(code::NO_NODE))
    }

    async fn granted(&mut self) -> Result<Step, Fault> {
        let Some((name, czxid)) = self.node.clone() else {
            return Err(Fault::Protocol("granted without a node".to_owned()));
        };
        let czxid = match czxid {
            Some(czxid) => czxid,
            None => {
                // Adopted from an earlier attempt: read (and check) its Stat.
                let path = format!("{}/{name}", self.parent);
                let body = jute::path_watch(&path, false);
                let body = self
                    .session
                    .call(op::EXISTS, body, self.connect_by())
                    .await?;
                let stat = Reader(&body).stat().map_err(malformed_fault)?;
                if stat.ephemeral_owner != self.session.id() {
                    return Err(Fault::Protocol(format!(
                        "{path} is not owned by this session"
                    )));
                }
                stat.czxid
            }
        };
        let fence =
            u64::try_from(czxid).map_err(|_| Fault::Protocol(format!("negative czxid {czxid}")))?;
        Ok(Step::Granted(Lease::new(
            self.spec.name.clone(),
            fence,
            name,
            self.session.timeout(),
        )))
    }

    /// After a failed acquire: deletes our node now, or in the background once the
    /// session is back. Nothing to do when the session is gone (so are its nodes).
    async fn abandon(&mut self) {
        if self.node.is_none() && !self.uncertain {
            return;
        }
        match self.session.state() {
            State::Lost | State::Closed => return,
            // Waiting for the connection here would only delay the caller further.
            State::Suspended => {
                let (parent, prefix) = (self.parent.clone(), self.prefix.clone());
                return retire(self.session.clone(), parent, prefix);
            }
            State::Connected => {}
        }
        if let (Some((name, _)), false) = (&self.node, self.uncertain) {
            let path = format!("{}/{name}", self.parent);
            let now = Instant::now();
            match self
                .session
                .call(op::DELETE, jute::delete(&path), now)
                .await
            {
                Ok(_) | Err(Fault::Server(code::NO_NODE) | Fault::Lost | Fault::Closed) => return,
                Err(_) => {}
            }
        }
        retire(
            self.session.clone(),
            self.parent.clone(),
            self.prefix.clone(),
        );
    }
}

/// Deletes, in the background, every node of `parent` whose name starts with
/// `prefix`, as soon as the session is connected; an acquire with the same prefix
/// waits for it (so it can never adopt a node that is about to be deleted).
fn retire(session: Arc<Session>, parent: String, prefix: String) {
    let key = format!("{parent}/{prefix}");
    if !session.begin_retire(&key) {
        return;
    }
    tokio::spawn(async move {
        for _ in 0..RETIRE_ATTEMPTS {
            match retire_once(&session, &parent, &prefix).await {
                Ok(()) | Err(Fault::Lost | Fault::Closed) => break,
                Err(_) => tokio::time::sleep(session.timeout() / 10).await,
            }
        }
        session.end_retire(&key);
    });
}

async fn retire_once(session: &Session, parent: &str, prefix: &str) -> Result<(), Fault> {
    let connect_by = Instant::now() + session.timeout();
    let listing = session
        .call(
            op::GET_CHILDREN,
            jute::path_watch(parent, false),
            connect_by,
        )
        .await;
    let children = match listing {
        Ok(body) => Reader(&body).strings().map_err(malformed_fault)?,
        Err(Fault::Server(code::NO_NODE)) => return Ok(()),
        Err(fault) => return Err(fault),
    };
    for child in children.iter().filter(|c| c.starts_with(prefix)) {
        let path = format!("{parent}/{child}");
        match session
            .call(op::DELETE, jute::delete(&path), connect_by)
            .await
        {
            Ok(_) | Err(Fault::Server(code::NO_NODE)) => {}
            Err(fault) => return Err(fault),
        }
    }
    Ok(())
}

impl LockBackend for ZooKeeperBackend {
    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::new("zookeeper", FenceGuarantee::Durable);
        caps.fifo = true;
        caps.push_wakeups = true;
        caps.semaphores = true;
        caps.monotonic_leases = true;
        caps
    }

    fn acquire<'a>(&'a self, spec: &'a AcquireSpec) -> BoxFuture<'a, Result<Lease, Error>> {
        Box::pin(self.acquire_lock(spec))
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        _ttl: Duration,
    ) -> BoxFuture<'a, Result<Duration, Error>> {
        Box::pin(self.renew_lease(lease))
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(self.release_lease(lease))
    }
}

/// Percent-encodes everything but ASCII letters, digits, `_` and `~`: any text
/// becomes one valid znode name (no `/`, never `.` or `..`, no `-` so node names split
/// unambiguously).
fn encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || byte == b'_' || byte == b'~' {
            out.push(char::from(byte));
        } else {
            let _ = write!(out, "%{byte:02X}");
        }
    }
    out
}

/// `lock-<session id, 16 hex digits>-<limit>-<encoded request id>-`; ZooKeeper
/// appends a 10-digit sequence number.
fn node_prefix(session: i64, limit: u32, request_id: &str) -> String {
    format!(
        "{NODE_PREFIX}{:016x}-{limit}-{}-",
        session as u64,
        encode(request_id)
    )
}

/// Parses a lock node's name; `None` for anything this backend did not create.
fn parse_node(name: &str) -> Option<Node<'_>> {
    let mut parts = name.strip_prefix(NODE_PREFIX)?.split('-');
    let (session, limit, request, sequence) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |s: &str| s.len() == 16 && s.bytes().all(|b| b.is_ascii_hexdigit());
    let encoded = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'~' || b == b'%')
    };
    let digits = |s: &str| s.len() == 10 && s.bytes().all(|b| b.is_ascii_digit());
    if parts.next().is_some() || !hex(session) || !encoded(request) || !digits(sequence) {
        return None;
    }
    Some(Node {
        name,
        session: u64::from_str_radix(session, 16).ok()? as i64,
        limit: limit.parse().ok().filter(|l| *l >= 1)?,
        sequence: sequence.parse().ok()?,
    })
}

fn check_root(root: &str) -> Result<(), Error> {
    let bad = |why: &str| Err(invalid(format!("root {root:?} {why}")));
    if !root.starts_with('/') || root.len() < 2 || root.ends_with('/') {
        return bad("must be an absolute node path like /fencelock");
    }
    if root
        .split('/')
        .skip(1)
        .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return bad("has an empty, . or .. component");
    }
    if root.chars().any(char::is_control) {
        return bad("contains control characters");
    }
    if root == "/zookeeper" || root.starts_with("/zookeeper/") {
        return bad("is inside ZooKeeper's reserved /zookeeper tree");
    }
    Ok(())
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The data behind these mutexes stays consistent at every await-free step.
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn invalid(message: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidArgument, message)
}

fn not_held(lease: &Lease, why: &str) -> Error {
    Error::new(
        ErrorKind::NotHeld,
        format!("lock {:?} is not held by this grant: {why}", lease.name),
    )
}

fn malformed(e: jute::Malformed) -> Error {
    Error::new(
        ErrorKind::Protocol,
        format!("malformed ZooKeeper reply: {}", e.0),
    )
}

fn malformed_fault(e: jute::Malformed) -> Fault {
    Fault::Protocol(format!("malformed ZooKeeper reply: {}", e.0))
}

/// The error for a fault (callers map `Lost` themselves where it means `NotHeld`).
fn error(fault: Fault) -> Error {
    let (kind, message) = match fault {
        Fault::Disconnected => (
            ErrorKind::Unavailable,
            "connection to ZooKeeper lost (the session may still be alive)".to_owned(),
        ),
        Fault::Lost => (
            ErrorKind::Unavailable,
            "the ZooKeeper session expired".to_owned(),
        ),
        Fault::Closed => (
            ErrorKind::Unavailable,
            "the ZooKeeper backend is closed".to_owned(),
        ),
        Fault::Busy => (
            ErrorKind::ResourceExhausted,
            "too many ZooKeeper requests or watches in flight".to_owned(),
        ),
        Fault::Unreachable(why) => (
            ErrorKind::Unavailable,
            format!("cannot reach ZooKeeper: {why}"),
        ),
        Fault::Protocol(why) => (ErrorKind::Protocol, why),
        Fault::Server(err) => {
            let kind = match err {
                code::NO_AUTH | code::AUTH_FAILED | code::INVALID_ACL => {
                    ErrorKind::PermissionDenied
                }
                code::BAD_ARGUMENTS => ErrorKind::InvalidArgument,
                code::OPERATION_TIMEOUT
                | code::NEW_CONFIG_NO_QUORUM
                | code::THROTTLED
                | code::SESSION_MOVED
                | code::NOT_READ_ONLY
                | code::CONNECTION_LOSS => ErrorKind::Unavailable,
                _ => ErrorKind::Internal,
            };
            (kind, format!("ZooKeeper answered {}", jute::code_name(err)))
        }
    };
    Error::new(kind, message)
}
