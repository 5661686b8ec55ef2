//! ZooKeeper as a [`LockBackend`] (cargo feature `zookeeper`): the ephemeral-sequential
//! lock recipe over the [`zookeeper_client`] crate, which speaks the protocol, keeps
//! the session alive, reconnects and re-registers watches.
//!
//! The backend takes what the application already has:
//!
//! - a connect string, chroot included (`10.0.0.1:2181,10.0.0.2:2181/app`), with
//!   [`ZooKeeperConfig::new`];
//! - a connector configuration: digest auth ([`ZooKeeperConfig::digest`], ZooKeeper's
//!   `addauth digest user:password`), TLS (`ZooKeeperConfig::tls`, cargo feature
//!   `tls`), or any [`zookeeper_client::Connector`] put in
//!   [`ZooKeeperConfig::connector`] (SASL: enable `zookeeper-client`'s `sasl` feature
//!   in your own `Cargo.toml` and call `Connector::with_sasl`; fencelock's tests do
//!   not exercise SASL);
//! - a [`zookeeper_client::Client`] the application built and keeps using, with
//!   [`ZooKeeperBackend::from_client`]: its session carries the locks, no second
//!   session is opened.
//!
//! ```no_run
//! use fencelock_zookeeper::{ZooKeeperBackend, ZooKeeperConfig};
//!
//! # fn demo() -> Result<(), fencelock_backend::Error> {
//! let config = ZooKeeperConfig::new("10.0.0.1:2181,10.0.0.2:2181/app").digest("locks", "s3cret")?;
//! let backend = ZooKeeperBackend::new(config)?;
//! // fencelock::Client::from_backend(Arc::new(backend)) puts guards on top.
//! # let _ = backend; Ok(()) }
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
//! created it, and the server expires a session once it has heard nothing from it for
//! the negotiated **session timeout** (rounded up to a server tick, `tickTime`). So a
//! lease **is** a session, and a grant's [`Lease::ttl`] is its session's timeout:
//!
//! - From a connect string ([`ZooKeeperBackend::new`]) the backend keeps one session
//!   per distinct requested `ttl`, asking for that ttl as its timeout, shared by every
//!   grant and waiter of that ttl. The server negotiates the timeout into
//!   `[minSessionTimeout, maxSessionTimeout]` (by default 2 and 20 ticks): a ttl above
//!   the maximum is refused with `InvalidArgument` (the lease could not be kept), a
//!   ttl below the minimum is granted as the minimum and reported so.
//! - On the application's own client ([`ZooKeeperBackend::from_client`]) there is one
//!   session: every grant's ttl is that session's timeout, whatever ttl was asked.
//!   A long-lived application session (say 30 s) makes every lock outlive a crashed
//!   holder by that long; give locks their own backend when that matters.
//!
//! `zookeeper-client` pings every 3/20 of the timeout, declares a connection dead
//! after 2/5 of it without a byte from the server, and reconnects with the same
//! session. A holder that is crashed, paused or partitioned loses its locks at most
//! one timeout plus one tick after the server last heard from it; the server frees
//! them by deleting the session's nodes, which wakes the next waiters.
//!
//! - `renew` does not extend anything by itself (the session is pinged whether or not
//!   anybody renews): it is an `exists` round trip that proves the session is alive
//!   and the node still ours, and returns the session timeout (a lease runs at least
//!   that long from the moment the server answered). While the connection is down
//!   (**suspended**: the session may still live) renew fails with `Unavailable`, so
//!   the guard's conservative deadline decides; once the session is **lost** (the
//!   server says it expired on a reconnect, or `zookeeper-client` gave up reconnecting
//!   7/5 of the timeout after it last heard from the server) renew says `NotHeld`.
//! - A grant that is neither released nor lost stays held for as long as its session
//!   lives. Dropping a [`ZooKeeperBackend`] built from a connect string closes its
//!   sessions, deleting every node it holds; one built on the application's client
//!   leaves the session to the application.
//! - A release while disconnected fails with `Unavailable` at once and deletes the
//!   node in the background as soon as the session reconnects (if it expires instead,
//!   the node goes with it).
//! - A lost session is replaced: the next acquire of that ttl opens a new one. The
//!   application's own session cannot be replaced: once it has ended, acquires fail
//!   with `Unavailable` until the backend is built on a new client.
//!
//! # Fences
//! The fence is the node's creation zxid (`czxid`): the zxid of the transaction that
//! created it, unique and strictly increasing across the whole ensemble (epoch in the
//! high 32 bits), and holders are granted in node-creation order — so a later grant
//! of a lock always carries a larger fence. ZooKeeper fsyncs its transaction log before
//! acknowledging a write (`forceSync=yes`, the default): fences are
//! [`FenceGuarantee::Durable`]. A server run with `forceSync=no` weakens this.
//!
//! # Access control
//! Every node the backend creates (the root, each lock's container, each lock node)
//! gets [`LockTree::acls`]: open (`world:anyone`) by default, **creator-only** after
//! [`ZooKeeperConfig::digest`] or [`LockTree::creator_only`], so that only sessions
//! authenticated as the same user can create, read or delete lock nodes. With open
//! ACLs anyone who can reach the ensemble can delete a holder's node (the holder then
//! sees `NotHeld` on its next renewal, after another client may already hold the lock).
//! A chroot that does not exist yet is created, with the same ACLs.
//!
//! # TLS
//! Cargo feature `tls` turns on `zookeeper-client`'s TLS (rustls) for servers with a
//! `secureClientPort`. That crate asks for rustls with its default crypto provider
//! (aws-lc-rs), so the feature compiles aws-lc-rs next to the ring provider the rest
//! of fencelock uses; before connecting, the backend installs ring as rustls's process
//! default unless the application installed a provider first (rustls cannot choose one
//! by itself when both are compiled in — a TLS client the application builds itself
//! needs a provider installed the same way). Tested against Debian's ZooKeeper 3.8
//! (Netty `secureClientPort`, PEM key store, no client certificate).
//!
//! # Reader-writer locks and elections
//! - **Shared locks** are Curator's `InterProcessReadWriteLock` in the same queue: a
//!   reader's node is named `read-…` instead of `lock-…`. A reader holds once no
//!   writer's node is ahead of it and otherwise watches the nearest writer ahead; a
//!   writer holds once it is first, watching its predecessor. So a queued writer blocks
//!   later readers (FIFO across modes), and a writer's fence (czxid) is larger than
//!   every reader's before it. Readers are not counted: a shared lock takes `limit` 1.
//! - **Downgrade** marks the writer's own node as shared (`setData` of `shared`,
//!   guarded by its version and owner): the node keeps its czxid, so the grant keeps
//!   its fence and its place. A reader reads (and watches) the nearest writer ahead,
//!   skipping downgraded ones, so readers right behind are woken and hold; writers
//!   behind still wait for the deletion. Curator's own downgrade (take a `read-` node,
//!   then delete the writer's) would queue the new node behind a writer already
//!   waiting, which then holds beside it.
//! - **Elections** are Curator's `LeaderLatch`: a candidate is a lock node whose data
//!   is `<owner>\n<value>`; the first node leads and its czxid is the term. `proclaim`
//!   is `setData` with the version just read, on a node still owned by the leader's
//!   session (`NotHeld` once it is gone); observing watches the election's children
//!   and the leader's data.
//!
//! # What it cannot promise
//! - No lock-delay: a freed lock goes to the next waiter at once (`lock_delay > 0` is
//!   refused). No sessions API beyond the per-ttl session described above.
//! - Expiry is decided on the ZooKeeper leader's monotonic clock (`System.nanoTime`
//!   in 3.5+), but only to a tick: a lost holder's lock is freed up to one `tickTime`
//!   after its ttl.
//! - Every grant on one session shares its fate: when it expires, all of them are
//!   lost together.
//! - A lock used with different `limit`s at once is refused with `LimitMismatch` for
//!   the later arrivals while a node with another limit is ahead of them.
//! - `acquire` can overrun its wait by up to 2/5 of the ttl when the connection dies
//!   silently mid-request (that is when the client declares it dead), and opening a
//!   session may take up to `connect_timeout` per server.
//! - `renew` cannot change a session's timeout: it returns the session's, whatever
//!   ttl it is asked for.
#![deny(missing_docs)]

mod client;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::select_all;
use tokio::time::Instant;
pub use zookeeper_client;
use zookeeper_client::{self as zk, Acl, Acls, CreateMode};

use self::client::{Fault, Session, State};
use fencelock_backend::{
    AcquireSpec, BoxFuture, Capabilities, FenceGuarantee, Leader, Lease, LockBackend, LockMode,
};
use fencelock_backend::{Error, ErrorKind};

/// Where the locks live in the tree and who may touch them.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct LockTree {
    /// The node under which every lock lives, e.g. `/fencelock` (the default), inside
    /// the connection's chroot if it has one. Created (persistent) on first use.
    pub root: String,
    /// The ACL of every node the backend creates; must not be empty. Default: open
    /// (`world:anyone` may do anything).
    pub acls: Vec<Acl>,
}

impl Default for LockTree {
    fn default() -> LockTree {
        LockTree {
            root: "/fencelock".to_owned(),
            acls: Acls::anyone_all().to_vec(),
        }
    }
}

impl LockTree {
    /// Locks under `root`, with open ACLs.
    pub fn new(root: &str) -> LockTree {
        LockTree {
            root: root.to_owned(),
            ..LockTree::default()
        }
    }

    /// Makes the nodes the backend creates accessible only to sessions authenticated
    /// as the creator (ZooKeeper's `CREATOR_ALL_ACL`, scheme `auth`). The session must
    /// be authenticated (digest, SASL or a TLS client certificate), or every create
    /// fails with `PermissionDenied`.
    pub fn creator_only(mut self) -> LockTree {
        self.acls = Acls::creator_all().to_vec();
        self
    }
}

/// How to reach a ZooKeeper ensemble and open sessions on it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ZooKeeperConfig {
    /// `host:port[,host:port...][/chroot]`, as every ZooKeeper client takes it; a
    /// server may be prefixed `tcp://` or (feature `tls`) `tcp+tls://`.
    pub connect_string: String,
    /// How sessions are opened: auth, TLS, SASL. The backend sets the session timeout
    /// (one session per ttl) and fails over to the next server at once
    /// (`with_fail_eagerly`) itself.
    pub connector: zk::Connector,
    /// Where the locks live and their ACLs.
    pub tree: LockTree,
    /// Longest wait for a connection and session handshake with one server. Default 5 s.
    pub connect_timeout: Duration,
    /// Most sessions one backend opens (one per distinct ttl in use). Default 16.
    pub max_sessions: usize,
    /// Most requests in flight on one session. Default 1024.
    pub max_in_flight: usize,
    /// Every server speaks TLS (set by [`ZooKeeperConfig::tls`]).
    #[cfg(feature = "tls")]
    secure: bool,
}

impl ZooKeeperConfig {
    /// The defaults for a ZooKeeper connect string (checked by
    /// [`ZooKeeperBackend::new`]).
    pub fn new(connect_string: &str) -> ZooKeeperConfig {
        ZooKeeperConfig {
            connect_string: connect_string.to_owned(),
            connector: zk::Client::connector(),
            tree: LockTree::default(),
            connect_timeout: Duration::from_secs(5),
            max_sessions: 16,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            #[cfg(feature = "tls")]
            secure: false,
        }
    }

    /// Authenticates every session as `user` (ZooKeeper's `addauth digest
    /// user:password`) and makes the nodes the backend creates accessible to that
    /// user only ([`LockTree::creator_only`]). `InvalidArgument` for an empty user or
    /// password, a `:` in the user, or control characters.
    pub fn digest(mut self, user: &str, password: &str) -> Result<ZooKeeperConfig, Error> {
        if user.is_empty() || password.is_empty() {
            return Err(invalid("digest user and password must not be empty"));
        }
        if user.contains(':') {
            return Err(invalid("a digest user must not contain ':'"));
        }
        if user.chars().chain(password.chars()).any(char::is_control) {
            return Err(invalid(
                "digest user and password must not contain control characters",
            ));
        }
        self.connector = self
            .connector
            .with_auth("digest", format!("{user}:{password}").as_bytes());
        self.tree = self.tree.creator_only();
        Ok(self)
    }

    /// Connects to every server with TLS (ZooKeeper's `secureClientPort`), verifying
    /// it with `options` (e.g. `TlsOptions::new().with_pem_ca(..)`; add
    /// `with_pem_identity` for servers that want a client certificate).
    #[cfg(feature = "tls")]
    pub fn tls(mut self, options: zk::TlsOptions) -> ZooKeeperConfig {
        self.connector = self.connector.with_tls(options);
        self.secure = true;
        self
    }
}

/// Locks on a ZooKeeper ensemble (see the [module docs](self) for the recipe and what
/// it promises). Cheap to share behind an `Arc`.
#[derive(Debug)]
pub struct ZooKeeperBackend {
    inner: Arc<Inner>,
}

/// The largest `limit` accepted (the fencelock server's default bound; a waiter
/// watches `limit` nodes).
pub const MAX_LIMIT: u32 = 1024;
/// The default and the largest `max_in_flight`.
const DEFAULT_MAX_IN_FLIGHT: usize = 1024;
const MAX_IN_FLIGHT: usize = 1 << 20;
/// Most attempts to open one session, and the pause between two.
const OPEN_ATTEMPTS: u32 = 64;
const OPEN_PAUSE: Duration = Duration::from_millis(100);
/// Most servers in a connect string.
const MAX_SERVERS: usize = 256;
/// The most rounds (list, watch, wake) one acquire makes before giving up.
const MAX_ROUNDS: u32 = 100_000;
/// Rounds of listing and reading one leader before giving up.
const MAX_READ_ROUNDS: u32 = 100;
/// The ttl of the session leader reads open when the backend has no live session: a
/// read holds nothing, so any session does (this one is shared with 10 s locks).
const READ_SESSION_TTL: Duration = Duration::from_secs(10);
/// How often a background clean-up retries before it gives up on a node.
const RETIRE_ATTEMPTS: u32 = 64;
/// Most parent paths remembered as existing.
const MAX_KNOWN_PARENTS: usize = 4096;
/// Prefix of every lock node's name.
const NODE_PREFIX: &str = "lock-";
/// A reader's node (Curator's `InterProcessReadWriteLock` names them `read-`).
const READ_PREFIX: &str = "read-";
/// The data of a writer's node that downgraded: it holds shared from then on.
const DOWNGRADED: &[u8] = b"shared";

#[derive(Debug)]
struct Inner {
    source: Source,
    tree: LockTree,
    /// Live sessions by requested timeout in milliseconds (connect-string backends).
    sessions: Mutex<HashMap<u32, Arc<Session>>>,
    /// Serializes session opening, so one ttl never gets two sessions.
    opening: tokio::sync::Mutex<()>,
    /// Lock parents known to exist (the root included).
    parents: Mutex<HashSet<String>>,
}

/// Where sessions come from.
#[derive(Debug)]
enum Source {
    /// Opened by the backend, one per ttl.
    Connect(Box<Dial>),
    /// The application's client: its one session.
    Shared(Arc<Session>),
}

#[derive(Debug)]
struct Dial {
    connect_string: String,
    connector: zk::Connector,
    #[cfg(feature = "tls")]
    secure: bool,
    /// For the whole connect string (per server times servers).
    connect_timeout: Duration,
    max_sessions: usize,
    max_in_flight: usize,
}

impl ZooKeeperBackend {
    /// A backend that opens its own sessions as `config` says. Sessions are opened on
    /// first use, so this does not touch the network; it fails only on a bad
    /// configuration.
    pub fn new(config: ZooKeeperConfig) -> Result<ZooKeeperBackend, Error> {
        let servers = check_connect_string(&config.connect_string)?;
        check_tree(&config.tree)?;
        if config.connect_timeout.is_zero() || config.max_sessions == 0 {
            return Err(invalid("connect_timeout and max_sessions must be positive"));
        }
        if config.max_in_flight == 0 || config.max_in_flight > MAX_IN_FLIGHT {
            return Err(invalid(format!(
                "max_in_flight must be between 1 and {MAX_IN_FLIGHT}"
            )));
        }
        let per_server = u32::try_from(servers).unwrap_or(u32::MAX);
        let dial = Dial {
            connect_string: config.connect_string,
            connector: config.connector,
            #[cfg(feature = "tls")]
            secure: config.secure,
            connect_timeout: config.connect_timeout.saturating_mul(per_server),
            max_sessions: config.max_sessions,
            max_in_flight: config.max_in_flight,
        };
        Ok(ZooKeeperBackend::with_source(
            Source::Connect(Box::new(dial)),
            config.tree,
        ))
    }

    /// A backend on the application's own client: every lock node lives in its session
    /// (no second session is opened), inside its chroot, under `tree`. Every grant's
    /// ttl is the session's timeout (see the [module docs](self)). The session stays
    /// the application's: dropping the backend does not close it.
    pub fn from_client(client: zk::Client, tree: LockTree) -> Result<ZooKeeperBackend, Error> {
        check_tree(&tree)?;
        let session = Arc::new(Session::new(client, DEFAULT_MAX_IN_FLIGHT));
        Ok(ZooKeeperBackend::with_source(Source::Shared(session), tree))
    }

    fn with_source(source: Source, tree: LockTree) -> ZooKeeperBackend {
        ZooKeeperBackend {
            inner: Arc::new(Inner {
                source,
                tree,
                sessions: Mutex::new(HashMap::new()),
                opening: tokio::sync::Mutex::new(()),
                parents: Mutex::new(HashSet::new()),
            }),
        }
    }

    async fn acquire_lock(&self, spec: &AcquireSpec, data: Vec<u8>) -> Result<Lease, Error> {
        spec.validate()?;
        if spec.session.is_some() {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "the zookeeper backend has no sessions API (see its Capabilities)",
            ));
        }
        let shared = spec.mode == LockMode::Shared;
        if shared && spec.limit != 1 {
            return Err(invalid(
                "ZooKeeper read locks admit any number of readers: a shared lock takes limit 1",
            ));
        }
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
        let prefix = mode_prefix(shared, session.id(), spec.limit, &spec.request_id);
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
            shared,
            data,
        };
        let result = attempt.run().await;
        if result.is_err() {
            attempt.abandon().await;
        }
        result
    }

    /// `setData` on the leader's node, guarded by the version just read and by the
    /// node still being this session's: a deposed leader changes nothing.
    async fn proclaim_value(&self, lease: &Lease, value: &str) -> Result<(), Error> {
        fencelock_backend::validate_value(value)?;
        let Some((session, path)) = self.inner.grant(lease) else {
            return Err(not_held(
                lease,
                "its session is not one of this backend's live sessions",
            ));
        };
        let connect_by = Instant::now() + session.timeout() / 3;
        let (data, stat) = match session.run(connect_by, |c| c.get_data(&path)).await {
            Ok(found) => found,
            Err(Fault::Server(zk::Error::NoNode) | Fault::Lost | Fault::Closed) => {
                return Err(not_held(lease, "its node is gone"))
            }
            Err(fault) => return Err(error(fault)),
        };
        if stat.ephemeral_owner != session.id() {
            return Err(not_held(lease, "its node belongs to another session"));
        }
        let (owner, _) = parse_leader_data(&data);
        let data = leader_data(&owner, value);
        match session
            .run(connect_by, |c| c.set_data(&path, &data, Some(stat.version)))
            .await
        {
            Ok(_) => Ok(()),
            Err(Fault::Server(zk::Error::NoNode) | Fault::Lost | Fault::Closed) => {
                Err(not_held(lease, "its node is gone"))
            }
            Err(Fault::Server(zk::Error::BadVersion)) => Err(Error::new(
                ErrorKind::Unavailable,
                "another proclaim of this leader changed the value meanwhile; try again",
            )),
            Err(fault) => Err(error(fault)),
        }
    }

    /// Downgrade (Curator's: a write-lock holder becomes a reader): marks the writer's
    /// own node as shared with a `setData` guarded by the version just read and by the
    /// node still being this session's. The node stays where it is, so the grant keeps
    /// its fence (czxid) and its place in the queue; readers waiting on it are woken by
    /// its data watch and skip it, writers behind it still wait for its deletion.
    /// (Curator's way — a new `read-` node, then deleting the writer's — queues the new
    /// node behind any writer already waiting, which then holds together with it.)
    async fn downgrade_lock(&self, lease: &Lease) -> Result<(), Error> {
        let Some((session, path)) = self.inner.grant(lease) else {
            return Err(not_held(
                lease,
                "its session is not one of this backend's live sessions",
            ));
        };
        let node = parse_node(&lease.owner_token)
            .ok_or_else(|| invalid("not a lock grant of this backend"))?;
        if node.shared {
            return Ok(());
        }
        if node.limit != 1 {
            return Err(invalid(format!(
                "a semaphore holder (limit {}) cannot downgrade",
                node.limit
            )));
        }
        let connect_by = Instant::now() + session.timeout() / 3;
        let (data, stat) = match session.run(connect_by, |c| c.get_data(&path)).await {
            Ok(found) => found,
            Err(Fault::Server(zk::Error::NoNode) | Fault::Lost | Fault::Closed) => {
                return Err(not_held(lease, "its node is gone"))
            }
            Err(fault) => return Err(error(fault)),
        };
        if stat.ephemeral_owner != session.id() {
            return Err(not_held(lease, "its node belongs to another session"));
        }
        if data == DOWNGRADED {
            return Ok(());
        }
        if !data.is_empty() {
            return Err(invalid(
                "an election's leader cannot downgrade (resign instead)",
            ));
        }
        match session
            .run(connect_by, |c| {
                c.set_data(&path, DOWNGRADED, Some(stat.version))
            })
            .await
        {
            Ok(_) => Ok(()),
            Err(Fault::Server(zk::Error::NoNode) | Fault::Lost | Fault::Closed) => {
                Err(not_held(lease, "its node is gone"))
            }
            Err(Fault::Server(zk::Error::BadVersion)) => Err(Error::new(
                ErrorKind::Unavailable,
                "the node changed during the downgrade; try again",
            )),
            Err(fault) => Err(error(fault)),
        }
    }

    /// The election's leader (its first node), read on any live session of this
    /// backend; with `watch`, watches on the children and the leader's data.
    async fn read_leader(
        &self,
        name: &str,
        watch: bool,
    ) -> Result<(Option<Leader>, Vec<zk::OneshotWatcher>), Error> {
        let open = lock(&self.inner.sessions)
            .values()
            .find(|s| matches!(s.state(), State::Connected | State::Suspended))
            .cloned();
        let session = match open {
            Some(session) => session,
            None => self.inner.session(READ_SESSION_TTL).await?,
        };
        let parent = self.inner.parent_path(name);
        let connect_by = Instant::now() + session.timeout() / 3;
        let mut watchers = Vec::new();
        for _ in 0..MAX_READ_ROUNDS {
            let children = if watch {
                match session
                    .run(connect_by, |c| c.list_and_watch_children(&parent))
                    .await
                {
                    Ok((children, watcher)) => {
                        watchers.push(watcher);
                        children
                    }
                    Err(Fault::Server(zk::Error::NoNode)) => {
                        // No election node yet: watch for its creation.
                        let watcher = session
                            .run(connect_by, |c| c.check_and_watch_stat(&parent))
                            .await
                            .map_err(error)?
                            .1;
                        return Ok((None, vec![watcher]));
                    }
                    Err(fault) => return Err(error(fault)),
                }
            } else {
                match session.run(connect_by, |c| c.list_children(&parent)).await {
                    Ok(children) => children,
                    Err(Fault::Server(zk::Error::NoNode)) => return Ok((None, watchers)),
                    Err(fault) => return Err(error(fault)),
                }
            };
            let Some(first) = children
                .iter()
                .filter_map(|c| parse_node(c))
                .min_by_key(|n| n.sequence)
            else {
                return Ok((None, watchers));
            };
            let path = format!("{parent}/{}", first.name);
            let read = if watch {
                session
                    .run(connect_by, |c| c.get_and_watch_data(&path))
                    .await
                    .map(|(data, stat, watcher)| {
                        watchers.push(watcher);
                        (data, stat)
                    })
            } else {
                session.run(connect_by, |c| c.get_data(&path)).await
            };
            match read {
                Ok((data, stat)) => {
                    let (owner, value) = parse_leader_data(&data);
                    let term = u64::try_from(stat.czxid)
                        .map_err(|_| Error::new(ErrorKind::Protocol, "negative czxid"))?;
                    let leader = Leader::new(name.to_owned(), value, term, owner);
                    return Ok((Some(leader), watchers));
                }
                // The leader went between the listing and the read: list again.
                Err(Fault::Server(zk::Error::NoNode)) => watchers.clear(),
                Err(fault) => return Err(error(fault)),
            }
        }
        Err(Error::new(
            ErrorKind::Unavailable,
            format!("the leader of {name:?} kept changing while being read"),
        ))
    }

    async fn renew_lease(&self, lease: &Lease) -> Result<Duration, Error> {
        let Some((session, path)) = self.inner.grant(lease) else {
            return Err(not_held(
                lease,
                "its session is not one of this backend's live sessions",
            ));
        };
        let connect_by = Instant::now() + session.timeout() / 3;
        match session.run(connect_by, |c| c.check_stat(&path)).await {
            Ok(Some(stat)) if stat.ephemeral_owner == session.id() => Ok(session.timeout()),
            Ok(Some(_)) => Err(not_held(lease, "its node belongs to another session")),
            Ok(None) => Err(not_held(lease, "its node is gone")),
            Err(Fault::Lost | Fault::Closed) => Err(not_held(lease, "its session ended")),
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
        match session.run(connect_by, |c| c.delete(&path, None)).await {
            Ok(()) => Ok(true),
            Err(Fault::Server(zk::Error::NoNode) | Fault::Lost | Fault::Closed) => Ok(false),
            Err(Fault::Disconnected) => {
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
    /// The live session for `ttl`: the application's, or one opened for the ttl.
    async fn session(&self, ttl: Duration) -> Result<Arc<Session>, Error> {
        let dial = match &self.source {
            Source::Shared(session) => {
                return match session.state() {
                    State::Connected | State::Suspended => Ok(session.clone()),
                    State::Lost | State::Closed => Err(Error::new(
                        ErrorKind::Unavailable,
                        "the application's ZooKeeper session has ended: build the backend on a new client",
                    )),
                };
            }
            Source::Connect(dial) => dial,
        };
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
            sessions.retain(|_, s| matches!(s.state(), State::Connected | State::Suspended));
            if sessions.len() >= dial.max_sessions {
                return Err(Error::new(
                    ErrorKind::ResourceExhausted,
                    format!(
                        "{} ZooKeeper sessions open (one per distinct ttl): use fewer distinct ttls or raise max_sessions",
                        sessions.len()
                    ),
                ));
            }
        }
        let asked = Duration::from_millis(u64::from(timeout_ms));
        let client = dial.open(asked).await?;
        if client.session_timeout() < asked {
            return Err(invalid(format!(
                "ttl {ttl:?} is longer than this ZooKeeper server allows (it granted a {:?} session: see maxSessionTimeout)",
                client.session_timeout()
            )));
        }
        let session = Arc::new(Session::new(client, dial.max_in_flight));
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
        let session = match &self.source {
            Source::Shared(session) => Some(session.clone()).filter(|s| s.id() == node.session),
            Source::Connect(_) => lock(&self.sessions)
                .values()
                .find(|s| s.id() == node.session)
                .cloned(),
        }?;
        let path = format!("{}/{}", self.parent_path(&lease.name), lease.owner_token);
        Some((session, path))
    }

    fn parent_path(&self, name: &str) -> String {
        format!("{}/{}", self.tree.root, encode(name))
    }

    /// Creates the root (persistent, and the chroot if missing) and `parent` (a
    /// container) if missing.
    async fn ensure_parent(
        &self,
        session: &Session,
        parent: &str,
        connect_by: Instant,
    ) -> Result<(), Fault> {
        if lock(&self.parents).contains(parent) {
            return Ok(());
        }
        let root_known = lock(&self.parents).contains(&self.tree.root);
        if !root_known {
            self.ensure_root(session, connect_by).await?;
        }
        let acls = Acls::new(&self.tree.acls);
        let container = CreateMode::Container.with_acls(acls);
        match session
            .run(connect_by, |c| c.create(parent, &[], &container))
            .await
        {
            Ok(_) | Err(Fault::Server(zk::Error::NodeExists)) => {}
            Err(fault) => return Err(fault),
        }
        let mut parents = lock(&self.parents);
        if parents.len() >= MAX_KNOWN_PARENTS {
            parents.clear();
        }
        parents.insert(self.tree.root.clone());
        parents.insert(parent.to_owned());
        Ok(())
    }

    async fn ensure_root(&self, session: &Session, connect_by: Instant) -> Result<(), Fault> {
        let persistent = CreateMode::Persistent.with_acls(Acls::new(&self.tree.acls));
        let root = self.tree.root.as_str();
        match session
            .run(connect_by, |c| c.mkdir(root, &persistent))
            .await
        {
            // ZooKeeper answers NoNode for anything under a chroot that does not exist.
            Err(Fault::Server(zk::Error::NoNode)) => {}
            other => return other,
        }
        session
            .run(connect_by, |c| {
                let chroot = c.path().to_owned();
                let top = c.clone().chroot("/").unwrap_or_else(|same| same);
                let persistent = persistent.clone();
                async move {
                    if chroot == "/" {
                        return Err(zk::Error::NoNode);
                    }
                    top.mkdir(&chroot, &persistent).await
                }
            })
            .await?;
        session
            .run(connect_by, |c| c.mkdir(root, &persistent))
            .await
    }

    /// Forgets that `parent` (and the root) exist, after a create found it missing.
    fn forget_parent(&self, parent: &str) {
        let mut parents = lock(&self.parents);
        parents.remove(parent);
        parents.remove(&self.tree.root);
    }
}

impl Dial {
    /// Opens a new session asking for `timeout`: each attempt tries every server once
    /// (a server that is down is skipped at once); attempts repeat until
    /// `connect_timeout` runs out, since the first TLS handshake with a cold server can
    /// outlast the client's connection timeout (2/5 of a short session timeout).
    async fn open(&self, timeout: Duration) -> Result<zk::Client, Error> {
        let deadline = Instant::now() + self.connect_timeout;
        let mut last_error = None;
        for _ in 0..OPEN_ATTEMPTS {
            match tokio::time::timeout_at(deadline, self.open_once(timeout)).await {
                Ok(Ok(client)) => return Ok(client),
                Ok(Err(e)) if retry_open(&e) => last_error = Some(e),
                Ok(Err(e)) => return Err(zk_error(e)),
                Err(_) => break,
            }
            if Instant::now() + OPEN_PAUSE >= deadline {
                break;
            }
            tokio::time::sleep(OPEN_PAUSE).await;
        }
        let why = last_error.map_or_else(|| "no answer".to_owned(), |e| e.to_string());
        Err(Error::new(
            ErrorKind::Unavailable,
            format!(
                "no ZooKeeper session from {} within {:?}: {why}",
                self.connect_string, self.connect_timeout
            ),
        ))
    }

    async fn open_once(&self, timeout: Duration) -> Result<zk::Client, zk::Error> {
        let connector = self
            .connector
            .clone()
            .with_session_timeout(timeout)
            .with_fail_eagerly();
        #[cfg(feature = "tls")]
        {
            install_crypto_provider();
            if self.secure {
                return connector.secure_connect(&self.connect_string).await;
            }
        }
        connector.connect(&self.connect_string).await
    }
}

/// Whether opening a session may work on another attempt: the servers could not be
/// reached or did not finish the handshake in time.
fn retry_open(e: &zk::Error) -> bool {
    matches!(
        e,
        zk::Error::NoHosts
            | zk::Error::Timeout
            | zk::Error::ConnectionLoss
            | zk::Error::Custom(_)
            | zk::Error::UnexpectedError(_)
    )
}

/// Makes ring rustls's process-wide default, unless one is installed: with the `tls`
/// feature rustls has two providers compiled in and would not pick one.
#[cfg(feature = "tls")]
fn install_crypto_provider() {
    // An error means a provider is already installed, which is as good.
    let _ = rustls::crypto::ring::default_provider().install_default();
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
    /// A reader (a `read-` node).
    shared: bool,
    /// The node's data: a candidate's owner and value, else empty.
    data: Vec<u8>,
}

/// What one round of the recipe decided.
enum Step {
    Granted(Lease),
    Refused(Error),
    /// Something changed: look again at once.
    Again,
    /// These nodes are watched: wait for one of them to change.
    Wait(Vec<zk::OneshotWatcher>),
}

/// A lock node's name, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Node<'a> {
    name: &'a str,
    session: i64,
    limit: u32,
    sequence: i64,
    /// A reader's node.
    shared: bool,
}

impl Attempt<'_> {
    async fn run(&mut self) -> Result<Lease, Error> {
        for _ in 0..MAX_ROUNDS {
            match self.round().await {
                Ok(Step::Granted(lease)) => return Ok(lease),
                Ok(Step::Refused(e)) => return Err(e),
                Ok(Step::Again) => {}
                Ok(Step::Wait(watchers)) => {
                    // Watches survive a reconnect (the client sets them again), so
                    // only a node event, the session's end or the deadline wakes us.
                    let _watching = self.session.watching(watchers.len());
                    let changed = select_all(watchers.into_iter().map(|w| Box::pin(w.changed())));
                    tokio::select! {
                        (event, _, _) = changed => {
                            if event.event_type != zk::EventType::Session {
                                self.session.woken();
                            }
                        }
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

    async fn round(&mut self) -> Result<Step, Fault> {
        let connect_by = self.connect_by();
        let parent = self.parent.as_str();
        let children = match self
            .session
            .run(connect_by, |c| c.list_children(parent))
            .await
        {
            Ok(children) => children,
            Err(Fault::Server(zk::Error::NoNode)) => Vec::new(),
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
                .run(connect_by, |c| c.delete(&path, None))
                .await
            {
                Ok(()) | Err(Fault::Server(zk::Error::NoNode)) => {}
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
        if self.shared {
            return self.reader_round(ahead, connect_by).await;
        }
        // A writer waits for everything ahead, like a mutex.
        let blocker = match position < limit as usize {
            true => None,
            false => Some(position - limit as usize),
        };
        let Some(blocker) = blocker else {
            return self.granted().await;
        };
        if let Some(refused) = self.out_of_time(position) {
            return Ok(refused);
        }
        // Watch only the `limit` nodes just ahead: our turn can only come when one of
        // them goes (a node further ahead going shifts them all, and is seen then).
        let mut watchers = Vec::new();
        for node in &ahead[blocker..] {
            let path = format!("{}/{}", self.parent, node.name);
            match self
                .session
                .run(connect_by, |c| c.get_and_watch_data(&path))
                .await
            {
                Ok((_, _, watcher)) => watchers.push(watcher),
                Err(Fault::Server(zk::Error::NoNode)) => return Ok(Step::Again),
                Err(fault) => return Err(fault),
            }
        }
        if watchers.is_empty() {
            return Ok(Step::Again);
        }
        Ok(Step::Wait(watchers))
    }

    /// A reader's round (Curator's read lock): it waits only for the nearest writer
    /// ahead — skipping writers that downgraded (their node's data says so) — and
    /// watches that writer's node, whose deletion or downgrade wakes it.
    async fn reader_round(
        &mut self,
        ahead: &[Node<'_>],
        connect_by: Instant,
    ) -> Result<Step, Fault> {
        let mut end = ahead.len();
        while let Some(writer) = ahead[..end].iter().rposition(|n| !n.shared) {
            let path = format!("{}/{}", self.parent, ahead[writer].name);
            let (data, _, watcher) = match self
                .session
                .run(connect_by, |c| c.get_and_watch_data(&path))
                .await
            {
                Ok(found) => found,
                Err(Fault::Server(zk::Error::NoNode)) => return Ok(Step::Again),
                Err(fault) => return Err(fault),
            };
            if data == DOWNGRADED {
                end = writer;
                continue;
            }
            if let Some(refused) = self.out_of_time(ahead.len()) {
                return Ok(refused);
            }
            return Ok(Step::Wait(vec![watcher]));
        }
        self.granted().await
    }

    /// `Held` (no wait) or `Timeout` once the deadline has passed, with `ahead` nodes
    /// still in front.
    fn out_of_time(&self, ahead: usize) -> Option<Step> {
        if Instant::now() < self.deadline {
            return None;
        }
        let (kind, what) = if self.spec.wait.is_zero() {
            (ErrorKind::Held, "is held")
        } else {
            (ErrorKind::Timeout, "was not granted within the wait")
        };
        Some(Step::Refused(Error::new(
            kind,
            format!("lock {:?} {what} ({ahead} ahead)", self.spec.name),
        )))
    }

    /// Creates our node (and its parents), retrying when a parent vanishes.
    async fn create(&mut self, connect_by: Instant) -> Result<(), Fault> {
        let path = format!("{}/{}", self.parent, self.prefix);
        let options = CreateMode::EphemeralSequential.with_acls(Acls::new(&self.inner.tree.acls));
        for _ in 0..3 {
            self.inner
                .ensure_parent(&self.session, &self.parent, connect_by)
                .await?;
            match self
                .session
                .run(connect_by, |c| c.create(&path, &self.data, &options))
                .await
            {
                Ok((stat, sequence)) => {
                    let name = format!("{}{sequence}", self.prefix);
                    self.node = Some((name, Some(stat.czxid)));
                    return Ok(());
                }
                // The parent container was deleted (empty) in between: make it again.
                Err(Fault::Server(zk::Error::NoNode)) => self.inner.forget_parent(&self.parent),
                Err(fault) => {
                    self.uncertain = matches!(fault, Fault::Disconnected);
                    return Err(fault);
                }
            }
        }
        Err(Fault::Server(zk::Error::NoNode))
    }

    async fn granted(&mut self) -> Result<Step, Fault> {
        let Some((name, czxid)) = self.node.clone() else {
            return Err(Fault::Server(zk::Error::UnexpectedError(
                "granted without a node".to_owned(),
            )));
        };
        let czxid = match czxid {
            Some(czxid) => czxid,
            None => {
                // Adopted from an earlier attempt: read (and check) its Stat.
                let path = format!("{}/{name}", self.parent);
                let stat = self
                    .session
                    .run(self.connect_by(), |c| c.check_stat(&path))
                    .await?;
                match stat {
                    Some(stat) if stat.ephemeral_owner == self.session.id() => stat.czxid,
                    // Gone or not ours after all: look again.
                    _ => return Ok(Step::Again),
                }
            }
        };
        let fence = u64::try_from(czxid).map_err(|_| {
            Fault::Server(zk::Error::UnexpectedError(format!(
                "negative czxid {czxid}"
            )))
        })?;
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
            match self
                .session
                .run(Instant::now(), |c| c.delete(&path, None))
                .await
            {
                Ok(()) | Err(Fault::Server(zk::Error::NoNode) | Fault::Lost | Fault::Closed) => {
                    return
                }
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
/// `zookeeper-client` sends requests in the order they are made, so the listing also
/// sees a node whose `create` was still queued when its acquire gave up.
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
    let children = match session.run(connect_by, |c| c.list_children(parent)).await {
        Ok(children) => children,
        Err(Fault::Server(zk::Error::NoNode)) => return Ok(()),
        Err(fault) => return Err(fault),
    };
    for child in children.iter().filter(|c| c.starts_with(prefix)) {
        let path = format!("{parent}/{child}");
        match session.run(connect_by, |c| c.delete(&path, None)).await {
            Ok(()) | Err(Fault::Server(zk::Error::NoNode)) => {}
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
        caps.shared = true;
        caps.downgrade = true;
        caps.elections = true;
        caps
    }

    fn acquire<'a>(&'a self, spec: &'a AcquireSpec) -> BoxFuture<'a, Result<Lease, Error>> {
        Box::pin(self.acquire_lock(spec, Vec::new()))
    }

    /// Curator's `LeaderLatch`: a candidate is a lock node carrying its owner and
    /// value; the first node leads, and its czxid is the term.
    fn campaign<'a>(
        &'a self,
        spec: &'a AcquireSpec,
        value: &'a str,
    ) -> BoxFuture<'a, Result<Lease, Error>> {
        Box::pin(async move {
            fencelock_backend::validate_value(value)?;
            if spec.limit != 1 || spec.mode != LockMode::Exclusive {
                return Err(invalid(
                    "an election has one leader: campaign with limit 1, exclusive",
                ));
            }
            self.acquire_lock(spec, leader_data(&spec.owner, value))
                .await
        })
    }

    fn proclaim<'a>(
        &'a self,
        lease: &'a Lease,
        value: &'a str,
    ) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(self.proclaim_value(lease, value))
    }

    fn leader<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<Leader>, Error>> {
        Box::pin(async move { Ok(self.read_leader(name, false).await?.0) })
    }

    fn leader_change<'a>(
        &'a self,
        name: &'a str,
        known: Option<&'a Leader>,
        wait: Duration,
    ) -> BoxFuture<'a, Result<Option<Leader>, Error>> {
        Box::pin(async move {
            let deadline = Instant::now() + wait;
            loop {
                let (leader, watchers) = self.read_leader(name, true).await?;
                if leader.as_ref() != known || Instant::now() >= deadline || watchers.is_empty() {
                    return Ok(leader);
                }
                let changed = select_all(watchers.into_iter().map(|w| Box::pin(w.changed())));
                if tokio::time::timeout_at(deadline, changed).await.is_err() {
                    return Ok(leader);
                }
            }
        })
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

    /// Marks the writer's node as shared in place: the fence (czxid) stays.
    fn downgrade<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(self.downgrade_lock(lease))
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
/// appends the sequence number.
fn node_prefix(session: i64, limit: u32, request_id: &str) -> String {
    format!(
        "{NODE_PREFIX}{:016x}-{limit}-{}-",
        session as u64,
        encode(request_id)
    )
}

/// [`node_prefix`], or for a reader the same with `read-`.
fn mode_prefix(shared: bool, session: i64, limit: u32, request_id: &str) -> String {
    let prefix = node_prefix(session, limit, request_id);
    match shared {
        true => format!("{READ_PREFIX}{}", &prefix[NODE_PREFIX.len()..]),
        false => prefix,
    }
}

/// A candidate's node data: `<owner>\n<value>` (neither has control characters).
fn leader_data(owner: &str, value: &str) -> Vec<u8> {
    format!("{owner}\n{value}").into_bytes()
}

/// The `(owner, value)` in a node's data; empty for a plain lock's node.
fn parse_leader_data(data: &[u8]) -> (String, String) {
    let text = String::from_utf8_lossy(data);
    match text.split_once('\n') {
        Some((owner, value)) => (owner.to_owned(), value.to_owned()),
        None => (String::new(), String::new()),
    }
}

/// Parses a lock node's name; `None` for anything this backend did not create.
fn parse_node(name: &str) -> Option<Node<'_>> {
    let (shared, rest) = match name.strip_prefix(READ_PREFIX) {
        Some(rest) => (true, rest),
        None => (false, name.strip_prefix(NODE_PREFIX)?),
    };
    let mut parts = rest.split('-');
    let (session, limit, request, sequence) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |s: &str| s.len() == 16 && s.bytes().all(|b| b.is_ascii_hexdigit());
    let encoded = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'~' || b == b'%')
    };
    // Ten digits, or nineteen once a parent's counter passes 2^31 (ZOOKEEPER-4706).
    let digits = |s: &str| matches!(s.len(), 10 | 19) && s.bytes().all(|b| b.is_ascii_digit());
    if parts.next().is_some() || !hex(session) || !encoded(request) || !digits(sequence) {
        return None;
    }
    Some(Node {
        name,
        session: u64::from_str_radix(session, 16).ok()? as i64,
        limit: limit.parse().ok().filter(|l| *l >= 1)?,
        sequence: sequence.parse().ok()?,
        shared,
    })
}

fn check_root(root: &str) -> Result<(), Error> {
    check_path(root).map_err(|why| invalid(format!("root {root:?} {why}")))?;
    if root == "/zookeeper" || root.starts_with("/zookeeper/") {
        return Err(invalid(format!(
            "root {root:?} is inside ZooKeeper's reserved /zookeeper tree"
        )));
    }
    Ok(())
}

/// Checks `host:port[,host:port...][/chroot]` (optionally `tcp://` or `tcp+tls://`
/// per server) and returns the number of servers.
fn check_connect_string(connect_string: &str) -> Result<usize, Error> {
    let bad = |why: String| invalid(format!("connect string {connect_string:?}: {why}"));
    if connect_string.is_empty() {
        return Err(bad("no ZooKeeper servers given".to_owned()));
    }
    if connect_string
        .chars()
        .any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(bad("contains spaces or control characters".to_owned()));
    }
    let servers: Vec<&str> = connect_string.split(',').collect();
    if servers.len() > MAX_SERVERS {
        return Err(bad(format!("more than {MAX_SERVERS} servers")));
    }
    let last = servers.len() - 1;
    for (index, server) in servers.iter().enumerate() {
        let server = server
            .strip_prefix("tcp://")
            .or_else(|| server.strip_prefix("tcp+tls://"))
            .unwrap_or(server);
        let address = match server.find('/') {
            // The chroot follows the last server only.
            Some(at) if index == last => {
                let chroot = &server[at..];
                if chroot != "/" {
                    check_path(chroot).map_err(|why| bad(format!("chroot {chroot:?} {why}")))?;
                }
                &server[..at]
            }
            Some(_) => return Err(bad("a chroot may only follow the last server".to_owned())),
            None => server,
        };
        let port = address
            .rsplit_once(':')
            .filter(|(host, _)| !host.is_empty());
        if !port.is_some_and(|(_, port)| port.parse::<u16>().is_ok_and(|p| p > 0)) {
            return Err(bad(format!("{address:?} is not host:port")));
        }
    }
    Ok(servers.len())
}

/// Why `path` is not an absolute znode path without empty, `.` or `..` components.
fn check_path(path: &str) -> Result<(), String> {
    if !path.starts_with('/') || path.len() < 2 || path.ends_with('/') {
        return Err("must be an absolute node path like /fencelock".to_owned());
    }
    if path
        .split('/')
        .skip(1)
        .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Err("has an empty, . or .. component".to_owned());
    }
    if path.chars().any(char::is_control) {
        return Err("contains control characters".to_owned());
    }
    Ok(())
}

fn check_tree(tree: &LockTree) -> Result<(), Error> {
    check_root(&tree.root)?;
    if tree.acls.is_empty() {
        return Err(invalid("the lock tree's ACL list must not be empty"));
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

/// The error for a fault (callers map `Lost` themselves where it means `NotHeld`).
fn error(fault: Fault) -> Error {
    match fault {
        Fault::Disconnected => Error::new(
            ErrorKind::Unavailable,
            "connection to ZooKeeper lost (the session may still be alive)",
        ),
        Fault::Lost => Error::new(ErrorKind::Unavailable, "the ZooKeeper session expired"),
        Fault::Closed => Error::new(ErrorKind::Unavailable, "the ZooKeeper client is closed"),
        Fault::Busy => Error::new(
            ErrorKind::ResourceExhausted,
            "too many ZooKeeper requests in flight on one session",
        ),
        Fault::Server(e) => zk_error(e),
    }
}

fn zk_error(e: zk::Error) -> Error {
    let kind = match e {
        zk::Error::NoAuth | zk::Error::AuthFailed | zk::Error::InvalidAcl => {
            ErrorKind::PermissionDenied
        }
        zk::Error::BadArguments(_) => ErrorKind::InvalidArgument,
        zk::Error::ConnectionLoss
        | zk::Error::Timeout
        | zk::Error::NoHosts
        | zk::Error::Throttled
        | zk::Error::NotReadOnly
        | zk::Error::SessionExpired
        | zk::Error::SessionMoved
        | zk::Error::ClientClosed => ErrorKind::Unavailable,
        zk::Error::UnmarshalError { .. }
        | zk::Error::UnexpectedErrorCode(_)
        | zk::Error::MarshallingError => ErrorKind::Protocol,
        _ => ErrorKind::Internal,
    };
    Error::new(kind, format!("ZooKeeper: {e}"))
}
