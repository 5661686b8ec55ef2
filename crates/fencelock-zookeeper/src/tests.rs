//! Unit tests of the pieces that need no server, and of the recipe's internals
//! against a real ZooKeeper (fences, a lost `create` answer, which nodes a waiter
//! watches, clean-up of abandoned nodes) where a test needs the backend's own session.

use super::*;
use std::net::SocketAddr;

use fencelock_testkit::Proxy;

/// Longest any awaited step may take before a test fails instead of hanging.
const STEP: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(10);

async fn start() -> fencelock_testkit::ZooKeeper {
    tokio::task::spawn_blocking(fencelock_testkit::ZooKeeper::start)
        .await
        .expect("start task")
        .expect("zookeeper starts")
}

fn backend(servers: &str) -> ZooKeeperBackend {
    ZooKeeperBackend::new(ZooKeeperConfig::new(servers)).expect("backend")
}

fn spec(name: &str, wait: Duration) -> AcquireSpec {
    let mut spec = AcquireSpec::new(name, TTL);
    spec.wait = wait;
    spec
}

async fn step<T>(future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(STEP, future)
        .await
        .expect("a step took too long")
}

/// The backend's session for [`TTL`].
fn session_of(backend: &ZooKeeperBackend) -> Arc<Session> {
    let timeout_ms = u32::try_from(TTL.as_millis()).expect("ttl");
    backend
        .inner
        .live_session(timeout_ms)
        .expect("a session for TTL")
}

async fn children(session: &Session, parent: &str) -> Vec<String> {
    match step(session.client().list_children(parent)).await {
        Ok(children) => children,
        Err(zk::Error::NoNode) => Vec::new(),
        Err(e) => panic!("list {parent}: {e}"),
    }
}

async fn stat(session: &Session, path: &str) -> zk::Stat {
    step(session.client().check_stat(path))
        .await
        .unwrap_or_else(|e| panic!("exists {path}: {e}"))
        .unwrap_or_else(|| panic!("{path} exists"))
}

/// Polls until `check` holds (bounded by [`STEP`]).
async fn until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let give_up = Instant::now() + STEP;
    while !check().await {
        assert!(Instant::now() < give_up, "gave up waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_is_the_czxid_of_the_holders_node() {
    let zk = start().await;
    let backend = backend(&zk.connect_string());
    for name in ["zk:fence-a", "zk:fence-b", "zk:fence-a"] {
        let lease = step(backend.acquire(&spec(name, Duration::ZERO)))
            .await
            .expect("acquire");
        let session = session_of(&backend);
        let path = format!("{}/{}", backend.inner.parent_path(name), lease.owner_token);
        let stat = stat(&session, &path).await;
        assert_eq!(
            lease.fence,
            u64::try_from(stat.czxid).expect("czxid"),
            "{path}"
        );
        assert_eq!(
            stat.ephemeral_owner,
            session.id(),
            "{path} is ephemeral and ours"
        );
        assert!(step(backend.release(&lease)).await.expect("release"));
    }
}

/// A create whose answer was lost (simulated: the node is created on the backend's
/// own session with the request's prefix, as the lost create did) is found and
/// adopted by the retry with the same request id; no second node is created, and a
/// duplicate from a second lost create is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_create_answer_is_recovered_by_the_retry() {
    let zk = start().await;
    let backend = backend(&zk.connect_string());
    let name = "zk:lost-create";
    let request = spec(name, Duration::ZERO);
    let session = step(backend.inner.session(TTL)).await.expect("session");
    let parent = backend.inner.parent_path(name);
    step(
        backend
            .inner
            .ensure_parent(&session, &parent, Instant::now() + STEP),
    )
    .await
    .expect("parents");
    let prefix = node_prefix(session.id(), 1, &request.request_id);
    let mut created = Vec::new();
    let options = CreateMode::EphemeralSequential.with_acls(Acls::anyone_all());
    for _ in 0..2 {
        let path = format!("{parent}/{prefix}");
        let (stat, sequence) = step(session.client().create(&path, &[], &options))
            .await
            .expect("create");
        created.push((format!("{prefix}{sequence}"), stat.czxid));
    }
    let lease = step(backend.acquire(&request))
        .await
        .expect("retry acquires");
    assert_eq!(
        lease.owner_token, created[0].0,
        "the first lost node is adopted"
    );
    assert_eq!(lease.fence, u64::try_from(created[0].1).expect("czxid"));
    assert_eq!(children(&session, &parent).await, [created[0].0.clone()]);
    let again = step(backend.acquire(&request))
        .await
        .expect("another retry");
    assert_eq!(
        (&again.owner_token, again.fence),
        (&lease.owner_token, lease.fence)
    );
    assert!(step(backend.release(&lease)).await.expect("release"));
    assert!(children(&session, &parent).await.is_empty());
}

/// Three waiters queue behind a holder; each watches only its predecessor, so a
/// release wakes exactly the next one: the last waiter gets no watch notification
/// until its own predecessor goes (a herd implementation watching the parent, or
/// every node ahead, would notify it on each release).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_watches_only_its_predecessor() {
    let zk = start().await;
    let name = "zk:predecessor";
    let holder = backend(&zk.connect_string());
    let held = step(holder.acquire(&spec(name, Duration::ZERO)))
        .await
        .expect("hold");
    let parent = holder.inner.parent_path(name);
    let holder_session = session_of(&holder);
    let mut waiters = Vec::new();
    for index in 0..3usize {
        let waiter = Arc::new(backend(&zk.connect_string()));
        let task = {
            let waiter = waiter.clone();
            tokio::spawn(async move { waiter.acquire(&spec(name, STEP)).await })
        };
        until("the waiter queued and watches", || {
            let waiter = waiter.clone();
            let holder_session = holder_session.clone();
            let parent = parent.clone();
            async move {
                let queued = children(&holder_session, &parent).await.len() == index + 2;
                let watching = waiter
                    .inner
                    .live_session(10_000)
                    .is_some_and(|s| s.watch_count() > 0);
                queued && watching
            }
        })
        .await;
        waiters.push((waiter, task));
    }
    let (backends, mut tasks): (Vec<_>, Vec<_>) = waiters.into_iter().unzip();
    let events = |i: usize| session_of(&backends[i]).watch_events();
    assert!(step(holder.release(&held)).await.expect("release"));
    for i in 0..3 {
        let lease = step(&mut tasks[i])
            .await
            .expect("task")
            .expect("granted in turn");
        assert_eq!(events(i), 1, "waiter {i} woken once");
        for (later, task) in tasks.iter().enumerate().skip(i + 1) {
            assert_eq!(
                events(later),
                0,
                "waiter {later} woken by the release before waiter {i}"
            );
            assert!(!task.is_finished(), "waiter {later} granted out of turn");
        }
        assert!(step(backends[i].release(&lease)).await.expect("release"));
    }
}

/// A waiter whose wait runs out deletes its node; so does a `try` refused as held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_gives_up_leaves_no_node() {
    let zk = start().await;
    let name = "zk:give-up";
    let holder = backend(&zk.connect_string());
    let other = backend(&zk.connect_string());
    let held = step(holder.acquire(&spec(name, Duration::ZERO)))
        .await
        .expect("hold");
    let e = step(other.acquire(&spec(name, Duration::ZERO)))
        .await
        .expect_err("held");
    assert_eq!(e.kind(), ErrorKind::Held, "{e}");
    let e = step(other.acquire(&spec(name, Duration::from_millis(300))))
        .await
        .expect_err("times out");
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    let parent = holder.inner.parent_path(name);
    assert_eq!(
        children(&session_of(&holder), &parent).await,
        std::slice::from_ref(&held.owner_token)
    );
    assert!(step(holder.release(&held)).await.expect("release"));
}

/// A waiter cut off from the server when its wait ends cannot delete its node; the
/// node is deleted in the background once the connection is back (the session
/// survived), instead of blocking the lock for as long as the session lives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_abandoned_while_disconnected_is_deleted_on_reconnect() {
    let zk = start().await;
    let name = "zk:abandoned";
    let holder = backend(&zk.connect_string());
    let held = step(holder.acquire(&spec(name, Duration::ZERO)))
        .await
        .expect("hold");
    let proxy = Proxy::start(SocketAddr::from(([127, 0, 0, 1], zk.port())))
        .await
        .expect("proxy");
    let waiter = Arc::new(backend(&proxy.addr().to_string()));
    let task = {
        let waiter = waiter.clone();
        tokio::spawn(async move { waiter.acquire(&spec(name, Duration::from_secs(1))).await })
    };
    let parent = holder.inner.parent_path(name);
    let holder_session = session_of(&holder);
    until("the waiter queued", || {
        let (session, parent) = (holder_session.clone(), parent.clone());
        async move { children(&session, &parent).await.len() == 2 }
    })
    .await;
    proxy.pause();
    let e = step(task).await.expect("task").expect_err("not granted");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert_eq!(
        children(&holder_session, &parent).await.len(),
        2,
        "the node is left while cut off"
    );
    proxy.resume();
    until("the abandoned node is deleted", || {
        let (session, parent) = (holder_session.clone(), parent.clone());
        async move { children(&session, &parent).await.len() == 1 }
    })
    .await;
    assert!(matches!(session_of(&waiter).state(), State::Connected));
    assert!(step(holder.release(&held)).await.expect("release"));
}

#[test]
fn names_encode_to_single_safe_znode_names() {
    for name in [
        "a/b",
        ".",
        "..",
        "x-y",
        "ünï/çødé",
        "%41",
        "job:daily settlement",
    ] {
        let encoded = encode(name);
        assert!(
            encoded
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'~' || b == b'%'),
            "{name:?} encoded as {encoded:?}"
        );
        assert!(!encoded.contains('-') && !encoded.contains('/') && !encoded.contains('.'));
    }
    // Distinct names stay distinct (percent-encoding is injective).
    assert_ne!(encode("a/b"), encode("a%2Fb"));
    assert_eq!(encode("a/b"), "a%2Fb");
}

#[test]
fn node_names_round_trip() {
    let prefix = node_prefix(0x0123_4567_89ab_cdef, 3, "req-1/x");
    let name = format!("{prefix}0000000042");
    let node = parse_node(&name).expect("parses");
    assert_eq!(node.session, 0x0123_4567_89ab_cdef);
    assert_eq!(node.limit, 3);
    assert_eq!(node.sequence, 42);
    assert!(name.starts_with(&prefix));
    // A session id with the top bit set survives the hex round trip.
    let name = format!("{}0000000001", node_prefix(-2, 1, "r"));
    let node = parse_node(&name).expect("parses");
    assert_eq!(node.session, -2);
    // Past 2^31 children ZooKeeper writes nineteen digits.
    let name = format!("{prefix}0000000002147483648");
    assert_eq!(parse_node(&name).expect("parses").sequence, 1 << 31);
    for foreign in [
        "lock-",
        "other-0123456789abcdef-1-r-0000000001",
        "lock-0123456789abcdef-1-r-000000001",
        "lock-0123456789abcdef-0-r-0000000001",
        "lock-0123456789abcdef-1-a/b-0000000001",
        "lock-0123456789abcdef-1-r-0000000001-x",
        "lock-123-1-r-0000000001",
    ] {
        assert_eq!(parse_node(foreign), None, "{foreign:?} must not parse");
    }
}

#[test]
fn reader_nodes_and_leader_data_round_trip() {
    let writer = format!("{}0000000007", mode_prefix(false, 5, 1, "w"));
    let reader = format!("{}0000000008", mode_prefix(true, 5, 1, "r"));
    assert!(writer.starts_with("lock-") && reader.starts_with("read-"));
    let (writer, reader) = (
        parse_node(&writer).expect("parses"),
        parse_node(&reader).expect("parses"),
    );
    assert_eq!((writer.shared, writer.sequence), (false, 7));
    assert_eq!((reader.shared, reader.sequence, reader.limit), (true, 8, 1));
    assert_eq!(parse_node("read-"), None);
    assert_eq!(
        parse_leader_data(&leader_data("host:1", "10.0.0.1:80")),
        ("host:1".to_owned(), "10.0.0.1:80".to_owned())
    );
    // A plain lock's node has no data: no owner, no value.
    assert_eq!(parse_leader_data(b""), (String::new(), String::new()));
}

#[test]
fn bad_configs_are_refused() {
    for root in [
        "",
        "/",
        "fencelock",
        "/a/",
        "/a//b",
        "/a/./b",
        "/zookeeper/x",
    ] {
        let mut config = ZooKeeperConfig::new("127.0.0.1:2181");
        config.tree.root = root.to_owned();
        let e = ZooKeeperBackend::new(config).expect_err(root);
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{root}: {e}");
    }
    for servers in [
        "",
        " , ",
        "127.0.0.1",
        "127.0.0.1:0",
        "127.0.0.1:99999",
        ":2181",
        "a:1,,b:2",
        "a:1/x,b:2",
        "a:1/x/",
        "a:1/x/../y",
        "a:1 /x",
    ] {
        let e = ZooKeeperBackend::new(ZooKeeperConfig::new(servers)).expect_err(servers);
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{servers}: {e}");
    }
    for servers in [
        "127.0.0.1:2181/chroot",
        "a:1,tcp://b:2,[::1]:3/app/locks",
        "a:1/",
    ] {
        ZooKeeperBackend::new(ZooKeeperConfig::new(servers)).expect(servers);
    }
    let mut config = ZooKeeperConfig::new("127.0.0.1:2181");
    config.tree.acls.clear();
    let e = ZooKeeperBackend::new(config).expect_err("no acls");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    for (user, password) in [("", "pw"), ("u", ""), ("a:b", "pw"), ("u", "p\nw")] {
        let e = ZooKeeperConfig::new("127.0.0.1:2181")
            .digest(user, password)
            .expect_err(user);
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{user:?}: {e}");
    }
    let mut config = ZooKeeperConfig::new("127.0.0.1:2181");
    config.tree.root = "/a/b-c".to_owned();
    ZooKeeperBackend::new(config).expect("a nested root");
}
