//! The conformance suite against ZooKeeper: a throwaway standalone server
//! (`fencelock_testkit::ZooKeeper`: tickTime 2 s, sessions of 1–60 s, durable log),
//! reached by `fencelock::zookeeper::ZooKeeperBackend` the way an application with
//! access control would: digest auth, creator-only ACLs, a chroot (`/app`). The whole
//! suite runs twice: on the plain port and on the TLS port. Then what is particular to
//! ZooKeeper: the ttl-to-session mapping, renewal across a partition, what the ACLs
//! keep out, the chroot, and the application's own client carrying the locks.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use fencelock::zookeeper::zookeeper_client::{self as zk, TlsOptions};
use fencelock::zookeeper::{LockTree, ZooKeeperBackend, ZooKeeperConfig};
use fencelock::{AcquireSpec, BoxFuture, Error, ErrorKind, LockBackend};
use fencelock_conformance::{connect, step, Fixture, Partitioned, STEP};
use fencelock_testkit::{ZooKeeperOptions, ZOOKEEPER_SUPER_USER};

/// The digest user the suite's clients authenticate as.
const USER: (&str, &str) = ("fencelock", "conformance");
/// The chroot every client of the suite works in.
const CHROOT: &str = "/app";

struct ZooKeeper {
    server: fencelock_testkit::ZooKeeper,
    /// Clients connect to the TLS port.
    tls: bool,
}

impl ZooKeeper {
    fn port(&self) -> u16 {
        match self.tls {
            true => self.server.secure_port().expect("a TLS port"),
            false => self.server.port(),
        }
    }

    /// The suite's configuration for `addrs`: digest auth (so creator-only ACLs), the
    /// chroot, and TLS verified against the test CA on the TLS port.
    fn config(&self, addrs: &[SocketAddr]) -> ZooKeeperConfig {
        let servers: Vec<String> = addrs.iter().map(SocketAddr::to_string).collect();
        let connect_string = format!("{}{CHROOT}", servers.join(","));
        let config = ZooKeeperConfig::new(&connect_string)
            .digest(USER.0, USER.1)
            .expect("digest user");
        match self.tls {
            true => config.tls(self.tls_options()),
            false => config,
        }
    }

    fn tls_options(&self) -> TlsOptions {
        let ca = self.server.ca().expect("a TLS server has a CA");
        let pem = std::fs::read_to_string(&ca.ca_cert).expect("read the CA");
        TlsOptions::new().with_pem_ca(&pem).expect("the CA parses")
    }
}

impl Fixture for ZooKeeper {
    fn addrs(&self) -> Vec<SocketAddr> {
        vec![SocketAddr::from(([127, 0, 0, 1], self.port()))]
    }

    fn connect<'a>(
        &'a self,
        addrs: &'a [SocketAddr],
    ) -> BoxFuture<'a, Result<Arc<dyn LockBackend>, Error>> {
        Box::pin(async move {
            let backend = ZooKeeperBackend::new(self.config(addrs))?;
            Ok(Arc::new(backend) as Arc<dyn LockBackend>)
        })
    }
}

async fn start_with(tls: bool) -> ZooKeeper {
    let mut options = ZooKeeperOptions::default();
    options.tls = tls;
    let server =
        tokio::task::spawn_blocking(move || fencelock_testkit::ZooKeeper::start_with(&options))
            .await
            .expect("start task")
            .expect("zookeeper starts");
    ZooKeeper { server, tls }
}

async fn start() -> ZooKeeper {
    start_with(false).await
}

fencelock_conformance::conformance_suite!(start());

/// The same suite with every byte to ZooKeeper over TLS (the secure client port).
mod tls {
    fencelock_conformance::conformance_suite!(super::start_with(true));
}

fn spec(name: &str, ttl: Duration) -> AcquireSpec {
    let mut spec = AcquireSpec::new(name, ttl);
    spec.owner = "zookeeper-test".to_owned();
    spec
}

/// A `zookeeper-client` session on the plain port: with `auth` as a digest
/// `(user, password)`, in `chroot`.
async fn raw_client(zk: &ZooKeeper, auth: Option<(&str, &str)>, chroot: &str) -> zk::Client {
    let mut connector = zk::Client::connector();
    if let Some((user, password)) = auth {
        connector = connector.with_auth("digest", format!("{user}:{password}").as_bytes());
    }
    let connect_string = format!("{}{chroot}", zk.server.connect_string());
    step(connector.connect(&connect_string))
        .await
        .expect("a raw ZooKeeper session")
}

/// Where a lease's node lives, inside the suite's chroot (the backend's default root;
/// the name encodes to itself when it has only letters, digits and `_`).
fn node_path(lease: &fencelock::Lease) -> String {
    format!("/fencelock/{}/{}", lease.name, lease.owner_token)
}

/// The lease is the session: a ttl below the server's minSessionTimeout (1 s here)
/// is granted as the minimum and reported so; one above maxSessionTimeout (60 s) is
/// refused rather than silently shortened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_is_the_negotiated_session_timeout() {
    let zk = start().await;
    let backend = connect(&zk).await;
    let short = step(backend.acquire(&spec("zk:ttl-short", Duration::from_millis(300))))
        .await
        .expect("a short ttl is granted");
    assert_eq!(
        short.ttl,
        Duration::from_secs(1),
        "granted ttl must be the server's minimum"
    );
    let renewed = step(backend.renew(&short, Duration::from_millis(300)))
        .await
        .expect("renew");
    assert_eq!(renewed, Duration::from_secs(1));
    assert!(step(backend.release(&short)).await.expect("release"));

    let e = step(backend.acquire(&spec("zk:ttl-long", Duration::from_secs(120))))
        .await
        .expect_err("a ttl above maxSessionTimeout");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let exact = step(backend.acquire(&spec("zk:ttl-long", Duration::from_secs(60))))
        .await
        .expect("the maximum itself is granted");
    assert_eq!(exact.ttl, Duration::from_secs(60));
    assert!(step(backend.release(&exact)).await.expect("release"));

    let mut delayed = spec("zk:ttl-short", Duration::from_secs(2));
    delayed.lock_delay = Duration::from_secs(1);
    let e = step(backend.acquire(&delayed))
        .await
        .expect_err("lock-delay is not supported");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
}

/// A holder cut off from the server: while the connection is merely down
/// (suspended) renew is `Unavailable`; once the server expired the session (proved by
/// another client being granted the lock) renew is `NotHeld` and release `false`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_expiry_while_holding_makes_renew_not_held() {
    let zk = start().await;
    let ttl = Duration::from_secs(6);
    let holder = Partitioned::connect(&zk).await;
    let other = connect(&zk).await;
    let name = "zk:expiry";
    let lease = step(holder.backend.acquire(&spec(name, ttl)))
        .await
        .expect("acquire");
    assert_eq!(
        step(holder.backend.renew(&lease, ttl))
            .await
            .expect("renew"),
        ttl
    );
    holder.cut();
    // The renewal goes into the stalled proxy; the client gives up on the connection
    // after 2/5 of the timeout (2.4 s), long before it could consider the session
    // lost (7/5 of it after the last reply).
    let e = step(holder.backend.renew(&lease, ttl))
        .await
        .expect_err("renew while cut off");
    assert_eq!(
        e.kind(),
        ErrorKind::Unavailable,
        "renew while suspended: {e}"
    );
    let mut waiting = spec(name, Duration::from_secs(60));
    waiting.wait = STEP;
    let next = step(other.acquire(&waiting))
        .await
        .expect("granted after the holder's session expired");
    assert!(next.fence > lease.fence);
    holder.heal();
    let e = step(holder.backend.renew(&lease, ttl))
        .await
        .expect_err("renew after expiry");
    assert_eq!(e.kind(), ErrorKind::NotHeld, "renew after expiry: {e}");
    assert!(!step(holder.backend.release(&lease)).await.expect("release"));
    // The backend opens a fresh session for new work.
    let mut again = spec(name, ttl);
    again.wait = Duration::ZERO;
    let e = step(holder.backend.acquire(&again))
        .await
        .expect_err("still held by the other client");
    assert_eq!(e.kind(), ErrorKind::Held, "{e}");
    assert!(step(other.release(&next)).await.expect("release"));
    let lease = step(holder.backend.acquire(&again))
        .await
        .expect("acquire on a new session");
    assert!(step(holder.backend.release(&lease)).await.expect("release"));
}

/// Any lock name is one znode: names with `/`, unicode or percent signs are distinct
/// locks (the encoding is injective), and each is exclusive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_are_encoded_safely() {
    let zk = start().await;
    let a = connect(&zk).await;
    let b = connect(&zk).await;
    let names = ["a/b", "a%2Fb", "a-b", "ünï/çødé/..", ".", ".."];
    let mut leases = Vec::new();
    for name in names {
        leases.push(
            step(a.acquire(&spec(name, Duration::from_secs(10))))
                .await
                .unwrap_or_else(|e| panic!("acquire {name:?}: {e}")),
        );
        let e = step(b.acquire(&spec(name, Duration::from_secs(10))))
            .await
            .expect_err("held");
        assert_eq!(e.kind(), ErrorKind::Held, "{name:?}: {e}");
    }
    for lease in &leases {
        assert!(step(a.release(lease)).await.expect("release"));
    }
}

/// A lock in use as a semaphore of one limit refuses a request with another limit
/// (`LimitMismatch`), and the refused request leaves nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_different_limit_is_refused() {
    let zk = start().await;
    let a = connect(&zk).await;
    let b = connect(&zk).await;
    let name = "zk:limits";
    let mut two = spec(name, Duration::from_secs(10));
    two.limit = 2;
    let first = step(a.acquire(&two)).await.expect("limit 2");
    let e = step(b.acquire(&spec(name, Duration::from_secs(10))))
        .await
        .expect_err("limit 1 while in use with limit 2");
    assert_eq!(e.kind(), ErrorKind::LimitMismatch, "{e}");
    two.request_id = AcquireSpec::new(name, Duration::from_secs(10)).request_id;
    let second = step(b.acquire(&two)).await.expect("the second of two");
    assert!(step(a.release(&first)).await.expect("release"));
    assert!(step(b.release(&second)).await.expect("release"));
    let mutex = step(b.acquire(&spec(name, Duration::from_secs(10))))
        .await
        .expect("a free lock takes any limit");
    assert!(step(b.release(&mutex)).await.expect("release"));
}

/// A semaphore waiter watches the `limit` nodes ahead of it, not just its immediate
/// predecessor: the release of the first holder (not its predecessor) wakes it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphore_waiter_wakes_when_any_holder_ahead_leaves() {
    let zk = start().await;
    let clients = [connect(&zk).await, connect(&zk).await, connect(&zk).await];
    let name = "zk:semaphore-wake";
    let ttl = Duration::from_secs(10);
    let request = move |wait: Duration| {
        let mut spec = spec(name, ttl);
        spec.limit = 2;
        spec.wait = wait;
        spec
    };
    let first = step(clients[0].acquire(&request(Duration::ZERO)))
        .await
        .expect("first");
    let second = step(clients[1].acquire(&request(Duration::ZERO)))
        .await
        .expect("second");
    let waiter = clients[2].clone();
    let task = tokio::spawn(async move { waiter.acquire(&request(STEP)).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!task.is_finished(), "granted while two of two are held");
    assert!(step(clients[0].release(&first)).await.expect("release"));
    let third = step(task)
        .await
        .expect("task")
        .expect("granted when the first holder left");
    assert!(third.fence > second.fence);
    assert!(step(clients[1].release(&second)).await.expect("release"));
    assert!(step(clients[2].release(&third)).await.expect("release"));
}

/// A release that cannot reach the server (connection stalled) fails as
/// `Unavailable`, and the node is deleted in the background once the connection is
/// back — the lock is free before the still-alive session could have expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_cut_off_completes_on_reconnect() {
    let zk = start().await;
    let ttl = Duration::from_secs(9);
    let holder = Partitioned::connect(&zk).await;
    let other = connect(&zk).await;
    let name = "zk:release-cut";
    let lease = step(holder.backend.acquire(&spec(name, ttl)))
        .await
        .expect("acquire");
    // The server hears from the session after this instant, so it cannot expire the
    // session before `touched + ttl`.
    let touched = tokio::time::Instant::now();
    step(holder.backend.renew(&lease, ttl))
        .await
        .expect("renew");
    holder.cut();
    // Sent into the stalled proxy: no answer, and the connection is declared dead
    // after 2/5 of the ttl. (Requests sent into the proxy are delivered when it
    // resumes, so the release is made only once the connection is known dead.)
    let e = step(holder.backend.renew(&lease, ttl))
        .await
        .expect_err("renew while cut off");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    let e = step(holder.backend.release(&lease))
        .await
        .expect_err("release while disconnected");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    holder.heal();
    let mut waiting = spec(name, ttl);
    waiting.wait = STEP;
    let next = step(other.acquire(&waiting)).await.expect("granted");
    assert!(
        touched.elapsed() < ttl,
        "the lock was freed only {:?} after the last renewal: by session expiry, not by the release",
        touched.elapsed()
    );
    assert!(step(other.release(&next)).await.expect("release"));
    assert_eq!(
        step(holder.backend.renew(&lease, ttl))
            .await
            .expect_err("released")
            .kind(),
        ErrorKind::NotHeld
    );
}

/// A connect string with a dead server still works (each server is tried in turn);
/// one with only dead servers fails as `Unavailable`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_servers_in_the_list_are_skipped() {
    let zk = start().await;
    let dead = SocketAddr::from((
        [127, 0, 0, 1],
        fencelock_testkit::free_port().expect("port"),
    ));
    for _ in 0..4 {
        let backend = ZooKeeperBackend::new(zk.config(&[dead, zk.addrs()[0]])).expect("backend");
        let lease = step(backend.acquire(&spec("zk:servers", Duration::from_secs(10))))
            .await
            .expect("acquire past a dead server");
        assert!(step(backend.release(&lease)).await.expect("release"));
    }
    let backend = ZooKeeperBackend::new(zk.config(&[dead])).expect("backend");
    let e = step(backend.acquire(&spec("zk:servers", Duration::from_secs(10))))
        .await
        .expect_err("no live server");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
}

/// The ACLs really restrict: a client that is not authenticated, or authenticated as
/// another user, can neither delete a holder's node, nor queue a node of its own, nor
/// list the queue — while the superuser can delete it (which proves the path is the
/// holder's node, and the holder then sees `NotHeld`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acls_keep_other_clients_out() {
    let zk = start().await;
    let holder = connect(&zk).await;
    let name = "acl_lock";
    let lease = step(holder.acquire(&spec(name, Duration::from_secs(10))))
        .await
        .expect("acquire");
    let path = node_path(&lease);
    let parent = format!("/fencelock/{name}");
    let anonymous = raw_client(&zk, None, CHROOT).await;
    let stranger = raw_client(&zk, Some(("someone", "else")), CHROOT).await;
    for (who, client) in [("anonymous", &anonymous), ("another user", &stranger)] {
        assert_eq!(
            step(client.delete(&path, None)).await,
            Err(zk::Error::NoAuth),
            "{who} deleting the holder's node"
        );
        let queued = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
        assert_eq!(
            step(client.create(&format!("{parent}/lock-"), &[], &queued))
                .await
                .map(|_| ()),
            Err(zk::Error::NoAuth),
            "{who} queueing a node"
        );
        assert_eq!(
            step(client.list_children(&parent)).await,
            Err(zk::Error::NoAuth),
            "{who} listing the queue"
        );
    }
    step(holder.renew(&lease, Duration::from_secs(10)))
        .await
        .expect("the holder still holds it");
    let admin = raw_client(&zk, Some(ZOOKEEPER_SUPER_USER), CHROOT).await;
    step(admin.delete(&path, None))
        .await
        .expect("the superuser deletes the node");
    let e = step(holder.renew(&lease, Duration::from_secs(10)))
        .await
        .expect_err("renew after the node was deleted");
    assert_eq!(e.kind(), ErrorKind::NotHeld, "{e}");
}

/// The chroot confines the locks: the backend creates a missing chroot and keeps
/// every node under it, and the same lock name under another chroot is another lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chroot_holds_the_lock_tree() {
    let zk = start().await;
    let backend = connect(&zk).await;
    let name = "chroot_lock";
    let lease = step(backend.acquire(&spec(name, Duration::from_secs(10))))
        .await
        .expect("acquire");
    let admin = raw_client(&zk, Some(ZOOKEEPER_SUPER_USER), "").await;
    let under_chroot = format!("{CHROOT}{}", node_path(&lease));
    let stat = step(admin.check_stat(&under_chroot))
        .await
        .expect("stat")
        .unwrap_or_else(|| panic!("{under_chroot} exists"));
    assert_eq!(lease.fence, u64::try_from(stat.czxid).expect("czxid"));
    assert_eq!(
        step(admin.check_stat("/fencelock")).await.expect("stat"),
        None,
        "nothing outside the chroot"
    );
    let mut elsewhere = zk.config(&zk.addrs());
    elsewhere.connect_string = format!("{}/elsewhere", zk.server.connect_string());
    let other = ZooKeeperBackend::new(elsewhere).expect("backend");
    let there = step(other.acquire(&spec(name, Duration::from_secs(10))))
        .await
        .expect("the same name under another chroot is free");
    assert!(step(other.release(&there)).await.expect("release"));
    assert!(step(backend.release(&lease)).await.expect("release"));
}

/// The application's own client carries the locks: no second session or connection
/// is opened (the server's connection count and the node's owner say so), every grant
/// has the session's timeout as its ttl, and dropping the backend leaves the
/// application's session alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_applications_client_is_used() {
    let zk = start().await;
    let app = step(
        zk::Client::connector()
            .with_session_timeout(Duration::from_secs(8))
            .with_auth("digest", format!("{}:{}", USER.0, USER.1).as_bytes())
            .connect(&format!("{}{CHROOT}", zk.server.connect_string())),
    )
    .await
    .expect("the application's session");
    let alive = || {
        let mntr = zk.server.four_letter("mntr").expect("mntr");
        mntr.lines()
            .find_map(|l| l.strip_prefix("zk_num_alive_connections"))
            .and_then(|n| n.trim().parse::<u32>().ok())
            .unwrap_or_else(|| panic!("no connection count in {mntr:?}"))
    };
    let before = alive();
    let backend = ZooKeeperBackend::from_client(app.clone(), LockTree::default().creator_only())
        .expect("backend");
    let name = "app_lock";
    let lease = step(backend.acquire(&spec(name, Duration::from_secs(30))))
        .await
        .expect("acquire");
    assert_eq!(lease.ttl, app.session_timeout(), "the lease is the session");
    assert_eq!(
        alive(),
        before,
        "the backend opened a connection of its own"
    );
    let stat = step(app.check_stat(&node_path(&lease)))
        .await
        .expect("stat")
        .expect("the lock node");
    assert_eq!(
        stat.ephemeral_owner,
        app.session_id().0,
        "the lock node belongs to the application's session"
    );
    let other = connect(&zk).await;
    let e = step(other.acquire(&spec(name, Duration::from_secs(10))))
        .await
        .expect_err("held through the application's session");
    assert_eq!(e.kind(), ErrorKind::Held, "{e}");
    assert!(step(backend.release(&lease)).await.expect("release"));
    drop(backend);
    step(app.check_stat("/"))
        .await
        .expect("the application's session outlives the backend");
}

/// TLS is verified: a client that trusts another CA than the server's gets no
/// session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_verifies_the_server() {
    let zk = start_with(true).await;
    let trusted = connect(&zk).await;
    let lease = step(trusted.acquire(&spec("zk:tls", Duration::from_secs(10))))
        .await
        .expect("acquire over TLS");
    assert!(step(trusted.release(&lease)).await.expect("release"));
    let other_ca_dir = tempfile::tempdir().expect("temp dir");
    let other_ca = fencelock_testkit::TestCa::create(other_ca_dir.path()).expect("another CA");
    let pem = std::fs::read_to_string(&other_ca.ca_cert).expect("read the CA");
    let mut untrusting = zk.config(&zk.addrs());
    untrusting.connector = untrusting
        .connector
        .with_tls(TlsOptions::new().with_pem_ca(&pem).expect("the CA parses"));
    untrusting.connect_timeout = Duration::from_secs(3);
    let backend = ZooKeeperBackend::new(untrusting).expect("backend");
    let e = step(backend.acquire(&spec("zk:tls", Duration::from_secs(10))))
        .await
        .expect_err("a server with an unknown CA");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
}
