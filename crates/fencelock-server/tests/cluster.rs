//! Cluster mode over real loopback TCP: three (or four) in-process members, each a
//! whole `Server` with its own data directory, peer listener and Raft.
//!
//! What only a process kill shows (kill -9 of the leader, SIGSTOP) is in the CLI's
//! and the chaos crate's tests; these check the API contract and the invariants a
//! graceful stop or a membership change exercises.

use crate::support;

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fencelock_server::cluster::ClusterConfig;
use fencelock_server::{EngineConfig, PeerTlsConfig, Server, ServerConfig};
use serde_json::{json, Value};
use support::Client;

const HEARTBEAT: Duration = Duration::from_millis(50);
/// Three election timeouts at a 50 ms heartbeat (see `ClusterConfig::min_ttl`).
const MIN_TTL_MS: u64 = 1500;
const SECRET: &str = "a-cluster-secret-for-tests";

/// A free loopback port, this test process's until it exits (see
/// [`fencelock_testkit::free_port`]): a restarted member finds its port still free.
fn free_port() -> SocketAddr {
    let port = fencelock_testkit::free_port().expect("a free port");
    SocketAddr::from(([127, 0, 0, 1], port))
}

struct Member {
    id: u64,
    server: Option<Server>,
    dir: PathBuf,
    listen: SocketAddr,
    peer: SocketAddr,
}

impl Member {
    fn client(&self) -> Client {
        Client::new(self.listen)
    }

    fn url(&self) -> String {
        format!("http://{}", self.listen)
    }
}

struct Cluster {
    members: Vec<Member>,
    peers: BTreeMap<u64, SocketAddr>,
    _root: tempfile::TempDir,
}

fn config(
    id: u64,
    dir: &Path,
    listen: SocketAddr,
    peer: SocketAddr,
    peers: &BTreeMap<u64, SocketAddr>,
    join: bool,
    adjust: &dyn Fn(&mut ServerConfig),
) -> ServerConfig {
    let mut engine = EngineConfig::new(dir);
    engine.cluster = Some(ClusterConfig {
        node_id: id,
        peer_listen: peer,
        peers: peers.clone(),
        join,
        advertise_url: String::new(),
        secret: Some(SECRET.into()),
        tls: None,
        heartbeat: HEARTBEAT,
        dial: BTreeMap::new(),
        leader_probe: true,
    });
    let mut config = ServerConfig::new(listen, engine);
    adjust(&mut config);
    config
}

impl Cluster {
    /// Starts member `id` empty, waiting to be added (`--join`).
    async fn start_joining(&mut self, id: u64) {
        let dir = self._root.path().join(format!("m{id}"));
        let (listen, peer) = (free_port(), free_port());
        let server = Server::start(config(
            id,
            &dir,
            listen,
            peer,
            &BTreeMap::new(),
            true,
            &|_| {},
        ))
        .await
        .unwrap_or_else(|e| panic!("member {id} starts: {e:?}"));
        self.members.push(Member {
            id,
            server: Some(server),
            dir,
            listen,
            peer,
        });
    }

    async fn start(n: u64) -> Cluster {
        Cluster::start_with(n, &|_, _| {}).await
    }

    /// Starts `n` members; `adjust(id, config)` changes one member's settings.
    async fn start_with(n: u64, adjust: &dyn Fn(u64, &mut ServerConfig)) -> Cluster {
        let root = tempfile::tempdir().unwrap();
        let mut members = Vec::new();
        let mut peers = BTreeMap::new();
        for id in 1..=n {
            let peer = free_port();
            peers.insert(id, peer);
            members.push(Member {
                id,
                server: None,
                dir: root.path().join(format!("m{id}")),
                listen: free_port(),
                peer,
            });
        }
        let mut cluster = Cluster {
            members,
            peers,
            _root: root,
        };
        for i in 0..cluster.members.len() {
            cluster.restart_with(i, adjust).await;
        }
        cluster
    }

    async fn restart(&mut self, i: usize) {
        self.restart_with(i, &|_, _| {}).await;
    }

    async fn restart_with(&mut self, i: usize, adjust: &dyn Fn(u64, &mut ServerConfig)) {
        let m = &self.members[i];
        let id = m.id;
        let config = config(id, &m.dir, m.listen, m.peer, &self.peers, false, &|c| {
            adjust(id, c)
        });
        self.members[i].server = Some(Server::start(config).await.expect("member starts"));
    }

    async fn stop(&mut self, i: usize) {
        if let Some(server) = self.members[i].server.take() {
            tokio::time::timeout(support::IO_TIMEOUT, server.shutdown())
                .await
                .expect("member stops in time")
                .expect("member stops cleanly");
        }
    }

    async fn stop_all(&mut self) {
        for i in 0..self.members.len() {
            self.stop(i).await;
        }
    }

    fn running(&self) -> impl Iterator<Item = (usize, &Member)> {
        self.members
            .iter()
            .enumerate()
            .filter(|(_, m)| m.server.is_some())
    }

    /// Waits until every running member names the same leader, among the running
    /// ones; returns its index.
    async fn leader(&self) -> usize {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let mut seen = Vec::new();
            for (_, m) in self.running() {
                let body = m.client().get("/v1/cluster").await.json();
                seen.push(body["leader"]["id"].as_u64());
            }
            if let Some(Some(id)) = seen.first().copied() {
                if seen.iter().all(|s| *s == Some(id)) {
                    if let Some((i, _)) = self.running().find(|(_, m)| m.id == id) {
                        return i;
                    }
                }
            }
            assert!(
                Instant::now() < deadline,
                "no agreed leader within 20 s: {seen:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

async fn acquire(c: &Client, body: Value) -> support::Response {
    c.post("/v1/acquire", &body).await
}

/// Polls `f` until it returns `Some`, for at most 10 s.
async fn eventually<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "not within 10 s: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cluster_forms_by_itself_and_followers_point_at_the_leader() {
    let mut cluster = Cluster::start(3).await;
    let l = cluster.leader().await;
    let leader = &cluster.members[l];
    let status = leader.client().get("/v1/cluster").await.expect_json(200);
    assert_eq!(status["node_id"], json!(leader.id));
    assert_eq!(status["leader"]["url"], json!(leader.url()));
    let members = status["members"].as_array().unwrap();
    assert_eq!(members.len(), 3);
    for m in &cluster.members {
        let entry = members.iter().find(|e| e["id"] == json!(m.id)).unwrap();
        assert_eq!(entry["peer_addr"], json!(m.peer.to_string()));
        assert_eq!(entry["url"], json!(m.url()));
        let role = if m.id == leader.id {
            "leader"
        } else {
            "follower"
        };
        assert_eq!(entry["role"], json!(role));
        assert!(entry["matched_index"].as_u64().is_some(), "{entry}");
    }

    let granted = acquire(&leader.client(), json!({"name": "job:a", "ttl_ms": 5000}))
        .await
        .expect_json(200);
    assert_eq!(granted["fence"], json!(1));

    let f = (l + 1) % 3;
    let follower = cluster.members[f].client();
    let message = acquire(&follower, json!({"name": "job:b", "ttl_ms": 5000}))
        .await
        .expect_error(503, "not_leader");
    assert!(message.contains(&leader.url()), "{message}");
    // A linearizable read goes through the leader; a stale one is local.
    follower
        .get("/v1/locks/job:a")
        .await
        .expect_error(503, "not_leader");
    eventually("the follower applies the grant", || async move {
        let r = follower.get("/v1/locks/job:a?stale=true").await;
        (r.status == 200).then_some(())
    })
    .await;
    let shown = leader
        .client()
        .get("/v1/locks/job:a")
        .await
        .expect_json(200);
    assert_eq!(shown["holders"][0]["fence"], json!(1));

    // Leases shorter than three election timeouts are refused, with the floor.
    let message = acquire(
        &leader.client(),
        json!({"name": "job:c", "ttl_ms": MIN_TTL_MS - 1}),
    )
    .await
    .expect_error(400, "invalid_argument");
    assert!(
        message.contains(&format!("at least {MIN_TTL_MS} ms")),
        "{message}"
    );
    let message = leader
        .client()
        .post("/v1/sessions", &json!({"ttl_ms": 100}))
        .await
        .expect_error(400, "invalid_argument");
    assert!(message.contains("cluster mode"), "{message}");

    // /metrics names the role and term.
    let metrics = leader.client().get("/metrics").await.text();
    assert!(metrics.contains("fencelock_raft_leader 1\n"), "{metrics}");
    let metrics = cluster.members[f].client().get("/metrics").await.text();
    assert!(metrics.contains("fencelock_raft_leader 0\n"), "{metrics}");
    cluster.stop_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_the_leader_stops_locks_fences_and_retries_carry_over() {
    let mut cluster = Cluster::start(3).await;
    let l = cluster.leader().await;
    let old = cluster.members[l].client();
    let held = acquire(
        &old,
        json!({"name": "inv:1", "ttl_ms": 4000, "request_id": "r-1"}),
    )
    .await
    .expect_json(200);
    let waiter_body =
        json!({"name": "inv:1", "ttl_ms": 4000, "wait_ms": 20000, "request_id": "r-2"});
    let queued = old.post("/v1/acquire", &waiter_body);
    // The waiter is queued before the leader goes away.
    let mut pending = Box::pin(queued);
    let waited = tokio::time::timeout(Duration::from_millis(300), &mut pending).await;
    assert!(waited.is_err(), "the second acquire waits: {waited:?}");
    cluster.stop(l).await;
    drop(pending);

    let n = cluster.leader().await;
    assert_ne!(n, l);
    let new = cluster.members[n].client();
    // The grant survived with its fence and a fresh full lease.
    let shown = new.get("/v1/locks/inv:1").await.expect_json(200);
    assert_eq!(shown["holders"][0]["fence"], held["fence"]);
    assert!(
        shown["holders"][0]["ttl_remaining_ms"].as_u64().unwrap() > 3000,
        "{shown}"
    );
    // A retry with the same request id gets the same grant, not a second one.
    let again = acquire(
        &new,
        json!({"name": "inv:1", "ttl_ms": 4000, "request_id": "r-1"}),
    )
    .await
    .expect_json(200);
    assert_eq!(again["owner_token"], held["owner_token"]);
    assert_eq!(again["fence"], held["fence"]);
    // The queued request kept its place: retried, it is granted when the holder
    // releases, before anyone who arrives later.
    let retry = tokio::spawn({
        async move {
            new.post(
                "/v1/acquire",
                &json!({"name": "inv:1", "ttl_ms": 4000, "wait_ms": 20000, "request_id": "r-2"}),
            )
            .await
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let late = tokio::spawn({
        async move {
            new.post(
                "/v1/acquire",
                &json!({"name": "inv:1", "ttl_ms": 4000, "wait_ms": 20000, "request_id": "r-3"}),
            )
            .await
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    new.post(
        "/v1/release",
        &json!({"name": "inv:1", "owner_token": held["owner_token"]}),
    )
    .await
    .expect_json(200);
    let second = retry.await.unwrap().expect_json(200);
    let second_fence = second["fence"].as_u64().unwrap();
    assert!(second_fence > held["fence"].as_u64().unwrap());
    new.post(
        "/v1/release",
        &json!({"name": "inv:1", "owner_token": second["owner_token"]}),
    )
    .await
    .expect_json(200);
    let third = late.await.unwrap().expect_json(200);
    assert!(third["fence"].as_u64().unwrap() > second_fence);
    cluster.stop_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_restart_keeps_every_lock_and_the_fence_counter() {
    let mut cluster = Cluster::start(3).await;
    let mut last = 0;
    for i in 0..20 {
        let body =
            json!({"name": format!("k:{i}"), "ttl_ms": 30000, "request_id": format!("k-{i}")});
        let (_, g) = acquire_at_leader(&cluster, body).await;
        last = g["fence"].as_u64().unwrap();
    }
    cluster.stop_all().await;
    for i in 0..3 {
        cluster.restart(i).await;
    }
    let l = cluster.leader().await;
    let c = cluster.members[l].client();
    let listed = c.get("/v1/locks?prefix=k:").await.expect_json(200);
    assert_eq!(listed["locks"].as_array().unwrap().len(), 20, "{listed}");
    let g = acquire(&c, json!({"name": "k:new", "ttl_ms": 30000}))
        .await
        .expect_json(200);
    assert!(g["fence"].as_u64().unwrap() > last, "{g} after {last}");
    cluster.stop_all().await;
}

/// A member's audit log is synced lazily (before a snapshot becomes its restart point
/// and at a clean stop), so what a crash takes from its tail must come back from the
/// Raft log. Here all of it goes: the member rebuilds every entry, the same ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_members_lost_audit_log_is_rebuilt_from_the_raft_log() {
    let mut cluster = Cluster::start(3).await;
    // Through whichever member leads: a loaded machine can see an election between
    // two requests (the stress pass saw `not_leader` here).
    for i in 0..10 {
        let name = format!("au:{i}");
        let body = json!({"name": name, "ttl_ms": 30000, "request_id": format!("au-{i}")});
        let (_, g) = acquire_at_leader(&cluster, body).await;
        release_at_leader(&cluster, &name, &g).await;
    }
    let l = cluster.leader().await;
    let c = cluster.members[l].client();
    let entries = |v: Value| -> Vec<(u64, String, String, u64)> {
        v["entries"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                (
                    e["seq"].as_u64().unwrap(),
                    e["kind"].as_str().unwrap().to_owned(),
                    e["name"].as_str().unwrap_or("").to_owned(),
                    e["fence"].as_u64().unwrap_or(0),
                )
            })
            .collect()
    };
    let before = entries(c.get("/v1/audit?limit=1000").await.expect_json(200));
    assert_eq!(before.len(), 20, "{before:?}");
    cluster.stop_all().await;
    let audit_dir = cluster.members[l].dir.join("audit");
    std::fs::remove_dir_all(&audit_dir).unwrap();
    for i in 0..3 {
        cluster.restart(i).await;
    }
    let c = cluster.members[l].client();
    let after = eventually("the audit log is rebuilt", || {
        let want = before.clone();
        async move {
            let r = c.get("/v1/audit?limit=1000").await;
            let got = (r.status == 200).then(|| entries(r.json()))?;
            (got == want).then_some(got)
        }
    })
    .await;
    assert_eq!(after, before);
    cluster.stop_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_peer_port_refuses_strangers_and_other_configurations() {
    // Member 3 runs with another max_ttl: it must never take part.
    let mut cluster = Cluster::start_with(3, &|id, c| {
        if id == 3 {
            c.engine.core.max_ttl_ms += 1;
        }
    })
    .await;
    let peer = cluster.members[0].peer;
    let raw_to = |path: &'static str, headers: Vec<(&'static str, String)>| async move {
        let mut req = format!("POST {path} HTTP/1.1\r\nhost: {peer}\r\nconnection: close\r\n");
        if !headers.iter().any(|(k, _)| *k == "content-length") {
            req.push_str("content-length: 0\r\n");
        }
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str("\r\n");
        let mut stream = tokio::net::TcpStream::connect(peer).await.unwrap();
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        stream.write_all(req.as_bytes()).await.unwrap();
        let mut out = String::new();
        stream.read_to_string(&mut out).await.unwrap();
        out
    };
    let raw = |headers| raw_to("/raft/vote", headers);
    let no_secret = raw(vec![]).await;
    assert!(no_secret.starts_with("HTTP/1.1 401"), "{no_secret}");
    // The secret is checked before the body is read: a stranger announcing a huge
    // body is refused at once, not waited for (the handler used to read the body,
    // up to 1 GiB, before it checked).
    let huge = tokio::time::timeout(
        support::IO_TIMEOUT,
        raw(vec![("content-length", "100000000".into())]),
    )
    .await
    .expect("refused without waiting for the body");
    assert!(huge.starts_with("HTTP/1.1 401"), "{huge}");
    let wrong = raw(vec![(
        "authorization",
        "Bearer not-the-secret-at-all".into(),
    )])
    .await;
    assert!(wrong.starts_with("HTTP/1.1 401"), "{wrong}");
    let other_config = raw(vec![
        ("authorization", format!("Bearer {SECRET}")),
        ("x-fencelock-config", "0000".into()),
    ])
    .await;
    assert!(other_config.starts_with("HTTP/1.1 409"), "{other_config}");
    assert!(
        other_config.contains("configuration differs"),
        "{other_config}"
    );
    // The replication stream's route is behind the same checks.
    let stream_no_secret = raw_to("/raft/append-stream", vec![]).await;
    assert!(
        stream_no_secret.starts_with("HTTP/1.1 401"),
        "{stream_no_secret}"
    );
    let stream_other_config = raw_to(
        "/raft/append-stream",
        vec![
            ("authorization", format!("Bearer {SECRET}")),
            ("x-fencelock-config", "0000".into()),
        ],
    )
    .await;
    assert!(
        stream_other_config.starts_with("HTTP/1.1 409"),
        "{stream_other_config}"
    );

    // Members 1 and 2 form a majority and a leader; 3 is never caught up.
    let deadline = Instant::now() + Duration::from_secs(20);
    let leader = loop {
        let s = cluster.members[0].client().get("/v1/cluster").await.json();
        if let Some(id) = s["leader"]["id"].as_u64() {
            break id;
        }
        assert!(Instant::now() < deadline, "members 1 and 2 elect nobody");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_ne!(leader, 3);
    let lc = cluster.members[leader as usize - 1].client();
    acquire(&lc, json!({"name": "x", "ttl_ms": 5000}))
        .await
        .expect_json(200);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let status = lc.get("/v1/cluster").await.expect_json(200);
    let third = status["members"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == json!(3))
        .unwrap()
        .clone();
    assert!(
        third["matched_index"].is_null() || third["matched_index"] == json!(0),
        "{third}"
    );
    let s3 = cluster.members[2]
        .client()
        .get("/v1/locks/x?stale=true")
        .await;
    assert_eq!(s3.status, 404, "member 3 must not have applied anything");
    cluster.stop_all().await;
}

/// Replication is pipelined: the leader sends AppendEntries on one stream without
/// waiting for each answer, and the follower answers them in order. Driven here
/// through the real peer client (`Network`), as the leader's replication would,
/// against a member of a running cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replication_stream_answers_pipelined_requests_in_order() {
    use fencelock_server::cluster::network::{Network, PeerIdentity};
    use fencelock_server::cluster::{Member as RaftMember, Vote};
    use openraft::network::v2::RaftNetworkV2;
    use openraft::network::{RPCOption, RaftNetworkFactory};
    use openraft::raft::{AppendEntriesRequest, StreamAppendError};
    use tokio_stream::StreamExt;

    let mut cluster = Cluster::start(3).await;
    let leader = cluster.leader().await;
    let status = cluster.members[leader]
        .client()
        .get("/v1/cluster")
        .await
        .json();
    let term = status["term"].as_u64().expect("a term");
    let leader_id = cluster.members[leader].id;
    let follower = cluster
        .members
        .iter()
        .find(|m| m.id != leader_id)
        .expect("a follower");
    // The leader's identity, as the follower checks it.
    let identity = PeerIdentity {
        node_id: leader_id,
        url: cluster.members[leader].url(),
        secret: Some(SECRET.into()),
        config: fencelock_server::cluster::config_fingerprint(
            &EngineConfig::new(&cluster.members[leader].dir).core,
        ),
    };
    let mut network = Network::new(
        std::sync::Arc::new(identity),
        std::sync::Arc::default(),
        BTreeMap::new(),
        None,
    );
    let target = RaftMember {
        peer_addr: follower.peer.to_string(),
        url: follower.url(),
    };
    let mut peer = network.new_client(follower.id, &target).await;
    let request = |vote: Vote| AppendEntriesRequest {
        vote,
        prev_log_id: None,
        leader_commit: None,
        entries: Vec::new(),
    };
    // Two from the current leader's vote, then one from a deposed leader's.
    let requests = vec![
        request(Vote::new_committed(term, leader_id)),
        request(Vote::new_committed(term, leader_id)),
        request(Vote::new_committed(term - 1, leader_id)),
    ];
    let answers: Vec<_> = {
        let stream = peer
            .stream_append(
                tokio_stream::iter(requests),
                RPCOption::new(support::IO_TIMEOUT),
            )
            .await
            .expect("the follower opens a replication stream");
        tokio::time::timeout(support::IO_TIMEOUT, stream.collect::<Vec<_>>())
            .await
            .expect("the stream ends after the refusal")
    };
    assert_eq!(answers.len(), 3, "{answers:?}");
    assert!(matches!(answers[0], Ok(Ok(_))), "{answers:?}");
    assert!(matches!(answers[1], Ok(Ok(_))), "{answers:?}");
    assert!(
        matches!(answers[2], Ok(Err(StreamAppendError::HigherVote(_)))),
        "{answers:?}"
    );
    cluster.stop_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn members_are_added_and_removed_and_leadership_moves() {
    let mut cluster = Cluster::start(3).await;
    // Every change goes through whichever member leads: an election may come between
    // two requests on a loaded machine, and each of these requests may be repeated.
    let (l, _) = acquire_at_leader(&cluster, json!({"name": "m:1", "ttl_ms": 30000})).await;

    // Member 4 starts empty, waiting to be added.
    cluster.start_joining(4).await;
    let (listen, peer) = (cluster.members[3].listen, cluster.members[3].peer);
    let add = json!({"id": 4, "peer_addr": peer.to_string(), "url": format!("http://{listen}")});
    let added = post_at_leader(&cluster, "/v1/cluster/members", &add).await;
    let four = added["members"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == json!(4))
        .unwrap()
        .clone();
    assert_eq!(four["role"], json!("follower"), "{added}");
    // It has the state.
    let c4 = Client::new(listen);
    eventually("member 4 applies the lock", || async {
        (c4.get("/v1/locks/m:1?stale=true").await.status == 200).then_some(())
    })
    .await;

    // Bad requests are refused before anything changes.
    let lc = cluster.members[cluster.leader().await].client();
    lc.post(
        "/v1/cluster/members",
        &json!({"id": 0, "peer_addr": "x", "url": "y"}),
    )
    .await
    .expect_error(400, "invalid_argument");
    lc.delete("/v1/cluster/members/99")
        .await
        .expect_error(404, "not_found");

    // Leadership moves to member 4, then member 1 (or whoever led) leaves.
    post_at_leader(&cluster, "/v1/cluster/transfer-leader", &json!({"id": 4})).await;
    assert_eq!(cluster.leader().await, 3);
    let old_id = cluster.members[l].id;
    let removed = c4
        .delete(&format!("/v1/cluster/members/{old_id}"))
        .await
        .expect_json(200);
    assert_eq!(removed["members"].as_array().unwrap().len(), 3, "{removed}");
    let (_, g) = acquire_at_leader(&cluster, json!({"name": "m:2", "ttl_ms": 30000})).await;
    assert_eq!(g["fence"], json!(2));
    cluster.stop_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_server_has_no_cluster_api() {
    let s = support::TestServer::start().await;
    s.client
        .get("/v1/cluster")
        .await
        .expect_error(404, "not_found");
    s.stop().await;
}

// ---------------------------------------------------------------------------------
// Peer TLS

/// `name`'s peer certificate for 127.0.0.1, signed by `ca`, as a member's settings.
fn peer_tls(ca: &fencelock_testkit::TestCa, name: &str) -> PeerTlsConfig {
    let (cert_path, key_path) = ca
        .peer(name, IpAddr::from([127, 0, 0, 1]))
        .expect("issue a peer certificate");
    PeerTlsConfig {
        cert_path,
        key_path,
        ca_path: ca.ca_cert.clone(),
    }
}

/// Test CA and a peer certificate per member.
fn cluster_certs(
    dir: &Path,
    ids: &[u64],
) -> (fencelock_testkit::TestCa, BTreeMap<u64, PeerTlsConfig>) {
    let ca = fencelock_testkit::TestCa::create(dir).expect("make a test CA");
    let tls = ids
        .iter()
        .map(|id| (*id, peer_tls(&ca, &format!("m{id}"))))
        .collect();
    (ca, tls)
}

/// A TLS client for a peer port: trusts `ca`, presents `identity`'s certificate if
/// given. No ALPN, so it can speak HTTP/1.1.
fn tls_client(ca: &Path, identity: Option<&PeerTlsConfig>) -> tokio_rustls::TlsConnector {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(fencelock_server::tls::provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let config = match identity {
        Some(id) => {
            let certs = CertificateDer::pem_file_iter(&id.cert_path)
                .unwrap()
                .collect::<Result<Vec<_>, _>>()
                .unwrap();
            let key = PrivateKeyDer::from_pem_file(&id.key_path).unwrap();
            builder.with_client_auth_cert(certs, key).unwrap()
        }
        None => builder.with_no_client_auth(),
    };
    tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
}

/// Reads what the server sends until it closes; an error after some bytes ends it.
async fn read_answer(io: &mut (impl tokio::io::AsyncRead + Unpin)) -> std::io::Result<String> {
    use tokio::io::AsyncReadExt;
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match io.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if out.is_empty() => return Err(e),
            Err(_) => break,
        }
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

const VOTE: &[u8] =
    b"POST /raft/vote HTTP/1.1\r\nhost: peer\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";

/// A vote request over TLS to a peer port: its answer, or how the handshake or the
/// connection failed. Never hangs: the peer port answers or closes.
async fn tls_vote(peer: SocketAddr, client: tokio_rustls::TlsConnector) -> std::io::Result<String> {
    use tokio::io::AsyncWriteExt;
    let exchange = async {
        let tcp = tokio::net::TcpStream::connect(peer).await?;
        let name = rustls::pki_types::ServerName::IpAddress(peer.ip().into());
        let mut tls = client.connect(name, tcp).await?;
        tls.write_all(VOTE).await?;
        read_answer(&mut tls).await
    };
    tokio::time::timeout(support::IO_TIMEOUT, exchange)
        .await
        .expect("the peer port answers or closes the connection; it does not hang")
}

/// The same request in plain HTTP.
async fn plain_vote(peer: SocketAddr) -> std::io::Result<String> {
    use tokio::io::AsyncWriteExt;
    let exchange = async {
        let mut tcp = tokio::net::TcpStream::connect(peer).await?;
        tcp.write_all(VOTE).await?;
        read_answer(&mut tcp).await
    };
    tokio::time::timeout(support::IO_TIMEOUT, exchange)
        .await
        .expect("the peer port answers or closes the connection; it does not hang")
}

fn is_http(answer: &std::io::Result<String>) -> bool {
    answer.as_ref().is_ok_and(|a| a.starts_with("HTTP/"))
}

/// Acquires through whichever member leads: every running member is tried, until
/// one grants. Members name a new leader a moment before it takes requests (it
/// answers `not_leader` until its first command is applied), and a loaded machine
/// can see an election or two at the start. `body` has a `request_id`, so a retry
/// never takes a second grant. Returns the leader's index and the grant.
async fn acquire_at_leader(cluster: &Cluster, body: Value) -> (usize, Value) {
    let body = &body;
    eventually("a leader grants the lock", || async move {
        for (i, m) in cluster.running() {
            let r = acquire(&m.client(), body.clone()).await;
            if r.status == 200 {
                return Some((i, r.json()));
            }
        }
        None
    })
    .await
}

/// Posts `body` to `path` at whichever member leads, again after a `not_leader`
/// answer, and returns the leader's 200 answer: for requests that may be repeated.
async fn post_at_leader(cluster: &Cluster, path: &str, body: &Value) -> Value {
    eventually("a leader answers", || async {
        for (_, m) in cluster.running() {
            let r = m.client().post(path, body).await;
            match r.status {
                200 => return Some(r.json()),
                503 => continue,
                _ => panic!("{path}: {} {}", r.status, r.text()),
            }
        }
        None
    })
    .await
}

/// Releases `grant` of `name` through whichever member leads, like
/// [`acquire_at_leader`]. A `not_leader` answer may come after the release was
/// proposed (the deposed leader's pending writes can still commit), so once a retry
/// is refused the lock must show that grant gone.
async fn release_at_leader(cluster: &Cluster, name: &str, grant: &Value) {
    let body = json!({"name": name, "owner_token": grant["owner_token"]});
    let body = &body;
    eventually("a leader releases the lock", || async move {
        for (_, m) in cluster.running() {
            let c = m.client();
            let r = c.post("/v1/release", body).await;
            match r.status {
                200 => return Some(()),
                503 => continue,
                _ => {
                    let shown = c.get(&format!("/v1/locks/{name}")).await;
                    match shown.status {
                        404 => return Some(()),
                        200 => {
                            let held = shown.json()["holders"][0]["fence"] == grant["fence"];
                            assert!(!held, "release refused while held: {}", r.text());
                            return Some(());
                        }
                        _ => continue,
                    }
                }
            }
        }
        None
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cluster_forms_over_mutual_tls_and_refuses_peers_without_a_certificate_of_its_ca() {
    let certs = tempfile::tempdir().unwrap();
    let (ca, tls) = cluster_certs(certs.path(), &[1, 2, 3]);
    // Mutual TLS alone authenticates the peers: no cluster secret.
    let mut cluster = Cluster::start_with(3, &|id, c| {
        let cluster = c.engine.cluster.as_mut().unwrap();
        cluster.secret = None;
        cluster.tls = Some(tls[&id].clone());
    })
    .await;
    cluster.leader().await;
    let (l, granted) = acquire_at_leader(
        &cluster,
        json!({"name": "tls:a", "ttl_ms": 5000, "request_id": "tls-1"}),
    )
    .await;
    assert_eq!(granted["fence"], json!(1));
    for (i, m) in cluster.running().filter(|(i, _)| *i != l) {
        let c = m.client();
        let shown = eventually(
            &format!("member {} applies the grant", i + 1),
            || async move {
                let r = c.get("/v1/locks/tls:a?stale=true").await;
                (r.status == 200).then(|| r.json())
            },
        )
        .await;
        assert_eq!(shown["holders"][0]["fence"], json!(1), "{shown}");
    }

    let peer = cluster.members[0].peer;
    // The control: a member's certificate gets through the handshake and the gate;
    // the request is refused only for its missing configuration fingerprint.
    let member = tls_vote(peer, tls_client(&ca.ca_cert, Some(&tls[&2]))).await;
    assert!(
        member.as_ref().is_ok_and(|a| a.starts_with("HTTP/1.1 409")),
        "{member:?}"
    );
    // No client certificate: refused in the handshake.
    let anonymous = tls_vote(peer, tls_client(&ca.ca_cert, None)).await;
    assert!(!is_http(&anonymous), "{anonymous:?}");
    // A certificate from another CA: refused in the handshake.
    let other = tempfile::tempdir().unwrap();
    let other_ca = fencelock_testkit::TestCa::create(other.path()).unwrap();
    let stranger = peer_tls(&other_ca, "stranger");
    let forged = tls_vote(peer, tls_client(&ca.ca_cert, Some(&stranger))).await;
    assert!(!is_http(&forged), "{forged:?}");
    // Plain HTTP on the TLS port: closed at its first byte, nothing answered.
    let plain = plain_vote(peer).await;
    assert!(!is_http(&plain), "{plain:?}");
    assert!(plain.as_ref().map_or(true, String::is_empty), "{plain:?}");
    cluster.stop_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_without_peer_tls_is_not_accepted_by_a_tls_cluster() {
    let certs = tempfile::tempdir().unwrap();
    let (ca, tls) = cluster_certs(certs.path(), &[1, 2]);
    // Member 3 runs plain (no secret either: its peer port is on loopback).
    let mut cluster = Cluster::start_with(3, &|id, c| {
        let cluster = c.engine.cluster.as_mut().unwrap();
        cluster.secret = None;
        cluster.tls = tls.get(&id).cloned();
    })
    .await;
    let (l, _) = acquire_at_leader(
        &cluster,
        json!({"name": "mixed", "ttl_ms": 5000, "request_id": "mixed-1"}),
    )
    .await;
    assert_ne!(l, 2, "the plain member leads a TLS cluster");
    let lc = cluster.members[l].client();
    let oc = cluster.members[1 - l].client();
    eventually("the other TLS member applies the grant", || async move {
        (oc.get("/v1/locks/mixed?stale=true").await.status == 200).then_some(())
    })
    .await;
    let status = lc.get("/v1/cluster").await.expect_json(200);
    let third = status["members"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == json!(3))
        .unwrap()
        .clone();
    assert!(
        third["matched_index"].is_null() || third["matched_index"] == json!(0),
        "{third}"
    );
    let s3 = cluster.members[2]
        .client()
        .get("/v1/locks/mixed?stale=true")
        .await;
    assert_eq!(s3.status, 404, "member 3 must not have applied anything");
    // A TLS handshake on the plain port is closed at its first byte.
    let tls_on_plain = tls_vote(
        cluster.members[2].peer,
        tls_client(&ca.ca_cert, Some(&tls[&1])),
    )
    .await;
    assert!(tls_on_plain.is_err(), "{tls_on_plain:?}");
    cluster.stop_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protected_mode_needs_a_secret_or_mutual_tls_on_a_non_loopback_peer_port() {
    let root = tempfile::tempdir().unwrap();
    let (_ca, tls) = cluster_certs(root.path(), &[1]);
    let peers = BTreeMap::from([(1, free_port())]);
    let open = |dir: &str, tls: Option<PeerTlsConfig>| {
        config(
            1,
            &root.path().join(dir),
            free_port(),
            "0.0.0.0:0".parse().unwrap(),
            &peers,
            false,
            &|c| {
                let cluster = c.engine.cluster.as_mut().unwrap();
                cluster.secret = None;
                cluster.tls = tls.clone();
            },
        )
    };
    let refused = match Server::start(open("plain", None)).await {
        Ok(_) => {
            panic!("a member listening for peers on 0.0.0.0 without peer authentication started")
        }
        Err(e) => e,
    };
    let message = refused.message();
    assert!(message.contains("without peer authentication"), "{message}");
    assert!(message.contains("--peer-tls-cert"), "{message}");
    assert!(message.contains("--cluster-secret-file"), "{message}");
    let server = Server::start(open("mtls", Some(tls[&1].clone())))
        .await
        .expect("a member with mutual TLS starts on 0.0.0.0");
    tokio::time::timeout(support::IO_TIMEOUT, server.shutdown())
        .await
        .expect("stops in time")
        .expect("stops cleanly");
}

/// `GET /readyz` on a member: 200 `ready`, or the 503 `unavailable` message.
async fn readyz(m: &Member) -> Result<(), String> {
    let r = m.client().get("/readyz").await;
    if r.status == 200 {
        assert_eq!(r.text(), "ready\n");
        return Ok(());
    }
    Err(r.expect_error(503, "unavailable"))
}

/// Issue 20: `/readyz` said 200 on every running member, caught up or not, so a
/// load balancer or a rolling restart could not wait for a member to be part of
/// the cluster again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn readyz_is_ready_only_on_a_caught_up_voter_in_touch_with_a_quorum() {
    let mut cluster = Cluster::start(3).await;
    let l = cluster.leader().await;
    for (_, m) in cluster.running() {
        eventually(
            "every member of a healthy cluster is ready",
            || async move { readyz(m).await.ok() },
        )
        .await;
    }

    // Member 4 starts empty, waiting to be added: not ready.
    cluster.start_joining(4).await;
    let peer = cluster.members[3].peer;
    let four = &cluster.members[3];
    let why = readyz(four)
        .await
        .expect_err("a member waiting to be added");
    assert!(why.contains("not in the cluster's membership"), "{why}");

    // A learner (caught up, not yet promoted) is not ready either.
    let raft = &cluster.members[l]
        .server
        .as_ref()
        .expect("the leader runs")
        .handle()
        .cluster()
        .expect("cluster mode")
        .raft;
    let node = fencelock_server::cluster::Member {
        peer_addr: peer.to_string(),
        url: four.url(),
    };
    raft.add_learner(4, node, true)
        .await
        .expect("member 4 joins as a learner");
    // (Once its own metrics show the membership entry it holds.)
    eventually("member 4 reports being a learner", || async move {
        let why = readyz(four).await.expect_err("a learner is not ready");
        why.contains("is a learner").then_some(())
    })
    .await;

    // Promoted, it becomes ready.
    let lc = cluster.members[l].client();
    lc.post(
        "/v1/cluster/members",
        &json!({"id": 4, "peer_addr": peer.to_string(), "url": four.url()}),
    )
    .await
    .expect_json(200);
    eventually("member 4 is ready once a voter", || async move {
        readyz(four).await.ok()
    })
    .await;

    // Two of four voters stopped (the leader among them): no quorum, and the
    // survivors say so.
    let other = (0..3).find(|i| *i != l).expect("a follower");
    cluster.stop(l).await;
    cluster.stop(other).await;
    for (_, m) in cluster.running() {
        let why = eventually("a member without a quorum is not ready", || async move {
            readyz(m).await.err()
        })
        .await;
        assert!(
            why.contains("not heard from the leader")
                || why.contains("no leader is known")
                || why.contains("no quorum has acknowledged"),
            "{why}"
        );
    }
    cluster.stop_all().await;
}

/// Issue 20: in cluster mode a read's `held_ms` and time left were counted to the
/// last applied command's time, so on an idle cluster they stood still. They count
/// to the answering member's clock at the read now, on the leader (linearizable)
/// and on a follower (`?stale=true`), for one lock and for a listing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reads_count_held_and_left_time_to_the_moment_of_the_read() {
    let mut cluster = Cluster::start(3).await;
    let l = cluster.leader().await;
    let lc = cluster.members[l].client();
    let ttl_ms = 60_000;
    acquire(&lc, json!({"name": "t:a", "ttl_ms": ttl_ms}))
        .await
        .expect_json(200);
    let f = (l + 1) % 3;
    let fc = cluster.members[f].client();
    let holder_of = |v: &Value| -> (u64, u64) {
        let h = &v["holders"][0];
        (
            h["held_ms"].as_u64().expect("held_ms"),
            h["ttl_remaining_ms"].as_u64().expect("ttl_remaining_ms"),
        )
    };
    for (who, c, path) in [
        ("leader", &lc, "/v1/locks/t:a"),
        ("follower", &fc, "/v1/locks/t:a?stale=true"),
        ("leader listing", &lc, "/v1/locks?prefix=t:"),
        ("follower listing", &fc, "/v1/locks?prefix=t:&stale=true"),
    ] {
        let listing = path.starts_with("/v1/locks?");
        // Nothing is written after the grant, yet held time grows.
        let (held, left) = eventually(&format!("{who}: held time grows"), || async move {
            let r = c.get(path).await;
            if r.status != 200 {
                return None;
            }
            let body = r.json();
            let view = if listing {
                body["locks"][0].clone()
            } else {
                body
            };
            let (held, left) = holder_of(&view);
            (held >= 300).then_some((held, left))
        })
        .await;
        // Both count to the same moment: together they are the whole lease.
        assert_eq!(held + left, ttl_ms, "{who}: held {held} + left {left}");
    }
    cluster.stop_all().await;
}

/// Issue 20: the Raft log's fdatasyncs were not measured (the single-node
/// `fencelock_log_sync_seconds` stays empty in cluster mode).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn raft_log_syncs_are_measured() {
    let mut cluster = Cluster::start(3).await;
    let l = cluster.leader().await;
    let lc = cluster.members[l].client();
    let syncs = |text: String| support::metric(&text, "fencelock_raft_log_sync_seconds_count");
    let before = syncs(lc.get("/metrics").await.text()).expect("the histogram is rendered");
    acquire(&lc, json!({"name": "s:a", "ttl_ms": 5000}))
        .await
        .expect_json(200);
    // The grant's entry is synced on the leader too (perhaps after a quorum of
    // followers answered, so polled).
    let lc = &lc;
    eventually("the leader's sync count grows", || async move {
        let now = syncs(lc.get("/metrics").await.text())?;
        (now > before).then_some(())
    })
    .await;
    let text = lc.get("/metrics").await.text();
    assert!(
        text.contains("# TYPE fencelock_raft_log_sync_seconds histogram"),
        "{text}"
    );
    cluster.stop_all().await;
}

/// Issue 20: the dashboard said nothing about the cluster. The index page of a
/// member has a "Cluster" section: this member, its role and term, the leader,
/// and a row per member (with replication progress on the leader).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_dashboard_shows_the_cluster() {
    let mut cluster = Cluster::start(3).await;
    let l = cluster.leader().await;
    let leader = &cluster.members[l];
    let html = leader.client().get("/").await.text();
    assert!(html.contains("<h2>Cluster</h2>"), "{html}");
    assert!(
        html.contains(&format!(
            "This is member <b>{}</b>, <b>leader</b>, term <b>",
            leader.id
        )),
        "{html}"
    );
    assert!(
        html.contains(&format!("<a href=\"{0}\">{0}</a>", leader.url())),
        "{html}"
    );
    for m in &cluster.members {
        let row = html
            .split("<tr data-member=")
            .find(|r| r.starts_with(&format!("\"{}\"", m.id)))
            .unwrap_or_else(|| panic!("no row for member {}: {html}", m.id));
        assert!(row.contains(&m.url()), "{row}");
        let role = if m.id == leader.id {
            "leader"
        } else {
            "follower"
        };
        assert!(row.contains(&format!("<td>{role}</td>")), "{row}");
    }
    let follower = &cluster.members[(l + 1) % 3];
    let html = follower.client().get("/").await.text();
    assert!(html.contains("<h2>Cluster</h2>"), "{html}");
    assert!(html.contains("known on the leader only"), "{html}");

    let single = support::TestServer::start().await;
    let html = single.client.get("/").await.text();
    assert!(html.contains("<h2>Health</h2>"), "{html}");
    assert!(!html.contains("<h2>Cluster</h2>"), "{html}");
    single.stop().await;
    cluster.stop_all().await;
}

/// A single server on `dir` (no cluster), on a free port.
async fn single_server(dir: &Path) -> (Server, Client) {
    let listen = free_port();
    let server = Server::start(ServerConfig::new(listen, EngineConfig::new(dir)))
        .await
        .expect("the single server starts");
    (server, Client::new(listen))
}

/// A one-member cluster on `dir`, as `fencelock serve --node-id 1 --peers 1=…`.
fn alone(root: tempfile::TempDir, dir: PathBuf) -> Cluster {
    let peer = free_port();
    Cluster {
        members: vec![Member {
            id: 1,
            server: None,
            dir,
            listen: free_port(),
            peer,
        }],
        peers: BTreeMap::from([(1, peer)]),
        _root: root,
    }
}

/// Waits until member `i` leads and has imported (its status says so).
async fn imported(cluster: &Cluster, i: usize) {
    let c = cluster.members[i].client();
    let id = cluster.members[i].id;
    eventually("the member leads and has imported", || async move {
        let s = c.get("/v1/cluster").await.json();
        (s["leader"]["id"] == json!(id) && s["importing"] == json!(false)).then_some(())
    })
    .await;
}

/// Starts member `id` with `--join` and adds it through the leader `via`.
async fn add_member(cluster: &mut Cluster, id: u64, via: &Client) {
    let dir = cluster._root.path().join(format!("m{id}"));
    let (listen, peer) = (free_port(), free_port());
    let server = Server::start(config(
        id,
        &dir,
        listen,
        peer,
        &BTreeMap::new(),
        true,
        &|_| {},
    ))
    .await
    .expect("the new member starts");
    cluster.members.push(Member {
        id,
        server: Some(server),
        dir,
        listen,
        peer,
    });
    via.post(
        "/v1/cluster/members",
        &json!({"id": id, "peer_addr": peer.to_string(), "url": format!("http://{listen}")}),
    )
    .await
    .expect_json(200);
}

fn fence(grant: &Value) -> u64 {
    grant["fence"].as_u64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_single_servers_directory_becomes_the_first_member_with_its_locks_and_fences() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("m1");

    // A single server: a held lock, a released one, a session holding one, and a
    // queued request.
    let (single, c) = single_server(&dir).await;
    let a = acquire(&c, json!({"name": "imp:a", "ttl_ms": 30000}))
        .await
        .expect_json(200);
    let b = acquire(&c, json!({"name": "imp:b", "ttl_ms": 30000}))
        .await
        .expect_json(200);
    c.post(
        "/v1/release",
        &json!({"name": "imp:b", "owner_token": b["owner_token"]}),
    )
    .await
    .expect_json(200);
    let session = c
        .post("/v1/sessions", &json!({"ttl_ms": 30000}))
        .await
        .expect_json(200);
    let s = acquire(&c, json!({"name": "imp:s", "session": session["session"]}))
        .await
        .expect_json(200);
    let waiter_body = json!({"name": "imp:a", "ttl_ms": 30000, "wait_ms": 20000});
    let mut waiter = Box::pin(c.post("/v1/acquire", &waiter_body));
    let waited = tokio::time::timeout(Duration::from_millis(300), &mut waiter).await;
    assert!(waited.is_err(), "the second acquire of imp:a waits");
    let shown = c.get("/v1/locks/imp:a").await.expect_json(200);
    assert_eq!(shown["waiters"], json!(1), "{shown}");
    single.shutdown().await.unwrap();
    drop(waiter);
    let old_fences = [fence(&a), fence(&b), fence(&s)];
    let last_old = *old_fences.iter().max().unwrap();

    // The same directory, started as the one member of a new cluster.
    let mut cluster = alone(root, dir.clone());
    cluster.restart(0).await;
    imported(&cluster, 0).await;
    let m1 = cluster.members[0].client();
    // The single server's files moved aside; nothing is left to import again.
    assert!(dir.join("imported-single-node/log.manifest").exists());
    assert!(dir.join("imported-single-node/audit").exists());
    assert!(!dir.join("log.manifest").exists());
    assert!(!dir.join("raft/import.snap").exists());

    // Same holders, same fences; the queued request is gone, as after a restart.
    let shown = m1.get("/v1/locks/imp:a").await.expect_json(200);
    assert_eq!(shown["holders"][0]["fence"], a["fence"], "{shown}");
    assert_eq!(shown["waiters"], json!(0), "{shown}");
    assert!(
        shown["holders"][0]["ttl_remaining_ms"].as_u64().unwrap() > 20000,
        "a full lease again: {shown}"
    );
    m1.get("/v1/locks/imp:b")
        .await
        .expect_error(404, "not_found");
    let shown = m1.get("/v1/locks/imp:s").await.expect_json(200);
    assert_eq!(shown["holders"][0]["fence"], s["fence"], "{shown}");
    // The old owner tokens and the session still work.
    let renewed = m1
        .post(
            "/v1/renew",
            &json!({"name": "imp:a", "owner_token": a["owner_token"]}),
        )
        .await
        .expect_json(200);
    assert_eq!(renewed["fence"], a["fence"]);
    m1.post(
        &format!(
            "/v1/sessions/{}/keepalive",
            session["session"].as_str().unwrap()
        ),
        &json!({}),
    )
    .await
    .expect_json(200);
    // A repeat release of the released lock is recognised.
    let again = m1
        .post(
            "/v1/release",
            &json!({"name": "imp:b", "owner_token": b["owner_token"]}),
        )
        .await
        .expect_json(200);
    assert_eq!(again["released"], json!(false), "{again}");
    m1.post(
        "/v1/release",
        &json!({"name": "imp:a", "owner_token": a["owner_token"]}),
    )
    .await
    .expect_json(200);
    // Fences go on from the single server's.
    let n = acquire(&m1, json!({"name": "imp:n", "ttl_ms": 30000}))
        .await
        .expect_json(200);
    assert!(fence(&n) > last_old, "{n} after {old_fences:?}");

    // Two more members get the state through the log.
    add_member(&mut cluster, 2, &m1).await;
    add_member(&mut cluster, 3, &m1).await;
    for i in [1, 2] {
        let follower = cluster.members[i].client();
        eventually("a new member applies the log up to imp:n", || async move {
            let r = follower.get("/v1/locks/imp:n?stale=true").await;
            (r.status == 200).then_some(())
        })
        .await;
        let shown = follower
            .get("/v1/locks/imp:s?stale=true")
            .await
            .expect_json(200);
        assert_eq!(shown["holders"][0]["fence"], s["fence"], "{shown}");
        follower
            .get("/v1/locks/imp:a?stale=true")
            .await
            .expect_error(404, "not_found");
    }

    // The first member goes away: the new leader has the imported locks, and fences
    // still increase.
    cluster.stop(0).await;
    let l = cluster.leader().await;
    let lc = cluster.members[l].client();
    let shown = lc.get("/v1/locks/imp:s").await.expect_json(200);
    assert_eq!(shown["holders"][0]["fence"], s["fence"], "{shown}");
    let after = acquire(&lc, json!({"name": "imp:after", "ttl_ms": 30000}))
        .await
        .expect_json(200);
    assert!(fence(&after) > fence(&n), "{after} after {n}");

    // It comes back without importing again: imp:a stays released.
    cluster.restart(0).await;
    let back = cluster.members[0].client();
    eventually("the first member catches up", || async move {
        let r = back.get("/v1/locks/imp:after?stale=true").await;
        (r.status == 200).then_some(())
    })
    .await;
    back.get("/v1/locks/imp:a?stale=true")
        .await
        .expect_error(404, "not_found");
    let status = back.get("/v1/cluster").await.expect_json(200);
    assert_eq!(status["importing"], json!(false), "{status}");
    assert!(!dir.join("log.manifest").exists());
    cluster.stop_all().await;
}

/// The image `fencelock backup` would save of the single server whose files are in
/// `dir`, written where an import stages it.
fn stage(single_dir: &Path, member_dir: &Path) {
    let recovery = fencelock_server::engine::recover(
        fencelock_log::LogOptions::default(),
        single_dir,
        &fencelock_core::Config::default(),
        None,
    )
    .unwrap();
    drop(recovery.log);
    let bytes = fencelock_server::codec::encode_snapshot(&recovery.core.export());
    fencelock_log::write_snapshot_file(&member_dir.join("raft/import.snap"), &bytes).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_import_is_applied_once_and_conflicting_state_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("m1");
    let (single, c) = single_server(&dir).await;
    let x = acquire(&c, json!({"name": "once:x", "ttl_ms": 30000}))
        .await
        .expect_json(200);
    single.shutdown().await.unwrap();
    let mut cluster = alone(root, dir.clone());
    cluster.restart(0).await;
    imported(&cluster, 0).await;
    let m1 = cluster.members[0].client();
    m1.post(
        "/v1/release",
        &json!({"name": "once:x", "owner_token": x["owner_token"]}),
    )
    .await
    .expect_json(200);
    cluster.stop(0).await;

    // A crash after the import was applied, before its staged file was deleted:
    // the next start proposes the same image again, and it is not applied twice
    // (once:x, released since, stays released).
    stage(&dir.join("imported-single-node"), &dir);
    cluster.restart(0).await;
    imported(&cluster, 0).await;
    assert!(!dir.join("raft/import.snap").exists());
    m1.get("/v1/locks/once:x")
        .await
        .expect_error(404, "not_found");
    let y = acquire(&m1, json!({"name": "once:y", "ttl_ms": 30000}))
        .await
        .expect_json(200);
    assert!(fence(&y) > fence(&x));
    cluster.stop(0).await;

    // Another single server's image staged into a cluster that holds state: every
    // member refuses it, this one stops, clients are never served from it.
    let other = cluster._root.path().join("other");
    let (single, c) = single_server(&other).await;
    acquire(&c, json!({"name": "other:z", "ttl_ms": 30000}))
        .await
        .expect_json(200);
    single.shutdown().await.unwrap();
    stage(&other, &dir);
    cluster.restart(0).await;
    let server = cluster.members[0].server.as_ref().unwrap();
    let mut state = server.handle().watch_state();
    let why = tokio::time::timeout(support::IO_TIMEOUT, async {
        loop {
            if let fencelock_server::RunState::Failed(why) = state.borrow_and_update().clone() {
                return why;
            }
            state.changed().await.unwrap();
        }
    })
    .await
    .expect("the member stops");
    assert!(why.contains("cannot import"), "{why}");
    assert!(why.contains("already holds state"), "{why}");
    assert!(dir.join("raft/import.snap").exists(), "the image is kept");
    let refused = m1.get("/v1/locks/once:y?stale=true").await;
    assert_eq!(refused.error_code().as_deref(), Some("unavailable"));
    assert!(refused.text().contains("importing"), "{}", refused.text());
    assert_eq!(m1.get("/readyz").await.status, 503);
    cluster.stop(0).await;
    std::fs::remove_file(dir.join("raft/import.snap")).unwrap();

    // A single server's files beside a member's Raft state, nothing staged: which
    // holds the locks? Refused, and nothing is moved.
    for entry in std::fs::read_dir(&other).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::rename(entry.path(), dir.join(entry.file_name())).unwrap();
        }
    }
    let m = &cluster.members[0];
    let err = Server::start(config(
        1,
        &dir,
        m.listen,
        m.peer,
        &cluster.peers,
        false,
        &|_| {},
    ))
    .await
    .err()
    .expect("refused");
    let message = err.to_string();
    assert!(message.contains("holds both"), "{message}");
    assert!(message.contains("From a single server"), "{message}");
    assert!(dir.join("log.manifest").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_servers_directory_is_imported_only_by_a_member_starting_alone() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("m1");
    let (single, _) = single_server(&dir).await;
    single.shutdown().await.unwrap();
    let peers: BTreeMap<u64, SocketAddr> = (1..=3).map(|id| (id, free_port())).collect();
    let (listen, peer) = (free_port(), peers[&1]);
    for (peers, join) in [(peers.clone(), false), (BTreeMap::new(), true)] {
        let err = Server::start(config(1, &dir, listen, peer, &peers, join, &|_| {}))
            .await
            .err()
            .expect("refused");
        let message = err.to_string();
        assert!(message.contains("--peers 1="), "{message}");
        assert!(message.contains("fencelock cluster add"), "{message}");
        assert!(dir.join("log.manifest").exists(), "nothing moved");
        assert!(!dir.join("imported-single-node").exists());
    }
}

/// The lock kinds go through the Raft log like every command: a queued multi-lock is
/// answered by the leader once granted on every lock, and every member applies the
/// same readers and election value.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lock_kinds_work_through_the_raft_log() {
    let mut cluster = Cluster::start(3).await;
    let l = cluster.leader().await;
    let c = cluster.members[l].client();
    let a = acquire(&c, json!({"name": "kc:a", "ttl_ms": 30000}))
        .await
        .expect_json(200);
    let pending = c
        .send_json(
            "/v1/acquire",
            &json!({"names": ["kc:b", "kc:a"], "ttl_ms": 30000, "wait_ms": 20000}),
        )
        .await;
    eventually("the multi-lock queues", || async move {
        (c.get("/v1/locks/kc:a").await.json()["waiters"] == 1).then_some(())
    })
    .await;
    c.post(
        "/v1/release",
        &json!({"name": "kc:a", "owner_token": a["owner_token"]}),
    )
    .await
    .expect_json(200);
    let all = pending.response().await.expect_json(200);
    assert_eq!(all["grants"].as_array().map(Vec::len), Some(2), "{all}");
    for _ in 0..2 {
        acquire(
            &c,
            json!({"name": "kc:rw", "ttl_ms": 30000, "mode": "shared"}),
        )
        .await
        .expect_json(200);
    }
    c.post(
        "/v1/elections/kc:e/campaign",
        &json!({"value": "m1", "ttl_ms": 30000}),
    )
    .await
    .expect_json(200);
    for (_, m) in cluster.running() {
        let fc = m.client();
        eventually("every member applied the kinds", || async move {
            let rw = fc.get("/v1/locks/kc:rw?stale=true").await.json();
            let e = fc.get("/v1/locks/kc:e?stale=true").await.json();
            let readers = rw["holders"].as_array().map(Vec::len) == Some(2)
                && rw["holders"][1]["mode"] == "shared";
            (readers && e["holders"][0]["value"] == "m1").then_some(())
        })
        .await;
    }
    cluster.stop_all().await;
}

/// Watch positions are Raft log indexes, the same on every member: a watch
/// resumed on another member after the last event seen on one gets exactly the
/// events that followed (issue 22, item 5).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_watch_resumes_on_another_member_at_the_same_positions() {
    let mut cluster = Cluster::start(3).await;
    let l = cluster.leader().await;
    let others: Vec<usize> = (0..3).filter(|i| *i != l).collect();
    let (a, b) = (&cluster.members[others[0]], &cluster.members[others[1]]);
    let within = Duration::from_secs(20);
    let mut on_a = a
        .client()
        .send("GET", "/v1/watch?prefix=w:", &[], b"")
        .await;
    let head = on_a.read_until("\r\n\r\n", within).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let leader = cluster.members[l].client();
    let mut fences = Vec::new();
    for name in ["w:a", "w:b", "w:end"] {
        let grant = acquire(&leader, json!({"name": name, "ttl_ms": 60_000}))
            .await
            .expect_json(200);
        leader
            .post(
                "/v1/release",
                &json!({"name": name, "owner_token": grant["owner_token"]}),
            )
            .await
            .expect_json(200);
        fences.push(fence(&grant));
    }
    let raw = on_a
        .read_until("\"kind\":\"released\",\"name\":\"w:end\"", within)
        .await;
    let seen = support::sse_events(&format!("{head}{raw}"));
    let whats = |events: &[support::Sse]| -> Vec<String> {
        events
            .iter()
            .map(|e| format!("{} {} {}", e.event, e.data["name"], e.data["fence"]))
            .collect()
    };
    assert_eq!(seen.len(), 6, "{:?}", whats(&seen));
    for pair in seen.windows(2) {
        let (x, y) = (&pair[0].id, &pair[1].id);
        let index = |id: &str| id.split_once('.').unwrap().0.parse::<u64>().unwrap();
        assert!(index(x) <= index(y), "{x} then {y}");
        assert_ne!(x, y);
    }

    // On the other follower, after A's second event: the last four, same ids.
    let after = &seen[1].id;
    let mut on_b = b
        .client()
        .send(
            "GET",
            &format!("/v1/watch?prefix=w:&after={after}"),
            &[],
            b"",
        )
        .await;
    let last = format!("id: {}\n", seen[5].id);
    let raw = on_b.read_until(&last, within).await;
    let resumed = support::sse_events(&raw);
    assert_eq!(whats(&resumed), whats(&seen[2..]));
    let ids = |events: &[support::Sse]| events.iter().map(|e| e.id.clone()).collect::<Vec<_>>();
    assert_eq!(ids(&resumed), ids(&seen[2..]));
    cluster.stop_all().await;
}
