//! The client library and the CLI against a real 3-member cluster (`fencelock serve
//! --node-id …`, three processes on loopback): a client given every member's URL
//! finds the leader; after `kill -9` of the leader its guard keeps renewing on the new
//! leader without reporting the lock lost, a new acquire succeeds, `fencelock run`
//! keeps its command running, and `fencelock cluster status` still lists 3 members.
//! A single server's data directory becomes the first member of a cluster.

use crate::support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fencelock::{Client, ErrorKind, ServerConfig, Transport};
use serde_json::Value;
use tokio::time::{sleep, timeout, Instant};

/// Longest any step may take before the test fails instead of hanging.
const STEP: Duration = Duration::from_secs(60);

/// One `fencelock serve` cluster member; killed (SIGKILL) when dropped.
struct Member {
    id: u64,
    url: String,
    child: Child,
    /// Its data directory, unless the test keeps it (to restart the member on it).
    _dir: Option<tempfile::TempDir>,
}

impl Drop for Member {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A free loopback port, this test process's until it exits (see
/// [`fencelock_testkit::free_port`]).
fn free_port() -> u16 {
    fencelock_testkit::free_port().expect("a free port")
}

/// Starts members 1..=n of one cluster on fresh loopback ports.
fn start_cluster(n: u64) -> Vec<Member> {
    let ports: Vec<(u16, u16)> = (0..n).map(|_| (free_port(), free_port())).collect();
    let peers = ports
        .iter()
        .enumerate()
        .map(|(i, (_, peer))| format!("{}=127.0.0.1:{peer}", i + 1))
        .collect::<Vec<_>>()
        .join(",");
    ports
        .iter()
        .enumerate()
        .map(|(i, (listen, peer))| {
            let membership = ["--peers", peers.as_str()];
            spawn_member(i as u64 + 1, *listen, *peer, &membership)
        })
        .collect()
}

/// Starts member `id` serving clients on `listen` and peers on `peer`, with
/// `membership` (`--peers …` for a new cluster, `--join` for a later member).
fn spawn_member(id: u64, listen: u16, peer: u16, membership: &[&str]) -> Member {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut member = spawn_member_in(id, listen, peer, membership, dir.path().to_owned());
    member._dir = Some(dir);
    member
}

/// [`spawn_member`] on a data directory the caller keeps.
fn spawn_member_in(id: u64, listen: u16, peer: u16, membership: &[&str], dir: PathBuf) -> Member {
    let url = format!("http://127.0.0.1:{listen}");
    let child = Command::new(support::BIN)
        .args([
            "serve",
            "--log-format",
            "json",
            "--node-id",
            &id.to_string(),
        ])
        .args(["--listen", &format!("127.0.0.1:{listen}")])
        .args(["--peer-listen", &format!("127.0.0.1:{peer}")])
        .args(membership)
        .args(["--advertise-url", &url])
        .arg("--data-dir")
        .arg(&dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn fencelock serve");
    Member {
        id,
        url,
        child,
        _dir: None,
    }
}

fn list(members: &[&Member]) -> String {
    members
        .iter()
        .map(|m| m.url.as_str())
        .collect::<Vec<_>>()
        .join(",")
}

fn fencelock(servers: &str) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(support::BIN);
    cmd.env("FENCELOCK_SERVER", servers)
        .env_remove("FENCELOCK_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd
}

/// `fencelock cluster status --json` over `servers`, if it succeeds.
async fn status(servers: &str) -> Option<Value> {
    let out = timeout(
        STEP,
        fencelock(servers)
            .args(["cluster", "status", "--json"])
            .output(),
    )
    .await
    .expect("status answers in time")
    .expect("run fencelock cluster status");
    if !out.status.success() {
        return None;
    }
    serde_json::from_slice(&out.stdout).ok()
}

/// Waits until a member of `servers` names a leader other than `not`; its id.
async fn leader(servers: &str, not: Option<u64>) -> u64 {
    let give_up = Instant::now() + STEP;
    loop {
        if let Some(v) = status(servers).await {
            if let Some(id) = v["leader"]["id"].as_u64() {
                if Some(id) != not {
                    return id;
                }
            }
        }
        assert!(
            Instant::now() < give_up,
            "no leader (other than {not:?}) within {STEP:?}"
        );
        sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until `guard`'s deadline has moved past `deadline_then` (a renewal was
/// confirmed), failing if the guard reports the lock lost first.
async fn renewed_past(guard: &fencelock::LockGuard, deadline_then: Instant) {
    loop {
        assert!(
            !guard.is_lost(),
            "the guard reported the lock lost during the failover"
        );
        let left = guard.valid_for().expect("not lost");
        if Instant::now() + left > deadline_then + Duration::from_millis(500) {
            return;
        }
        assert!(
            Instant::now() < deadline_then,
            "no renewal confirmed within the lease"
        );
        sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the server says it has held `name` under `fence` for `more` beyond
/// what it said at the call: renewals that happened, not a fixed hold. Fails if the
/// lock changed hands or went free meanwhile.
async fn held_for_another(
    backend: &fencelock::FencelockBackend,
    name: &str,
    fence: u64,
    more: Duration,
) {
    let held_ms = || async {
        let info = backend.get_lock(name).await.ok()?;
        let holder = info.holders.first().expect("the lock is still held");
        assert_eq!(holder.fence, fence, "{name} changed hands: {info:?}");
        Some(holder.held_ms)
    };
    let give_up = Instant::now() + STEP;
    let since = loop {
        if let Some(ms) = held_ms().await {
            break ms;
        }
        assert!(Instant::now() < give_up, "{name} could not be read");
        sleep(Duration::from_millis(50)).await;
    };
    let until = since + more.as_millis() as u64;
    while held_ms().await.is_none_or(|ms| ms < until) {
        assert!(
            Instant::now() < give_up,
            "{name} was not held {more:?} more within {STEP:?}"
        );
        sleep(Duration::from_millis(100)).await;
    }
}

async fn wait_for_file(path: &Path) {
    timeout(STEP, async {
        while !path.exists() {
            sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{} never appeared", path.display()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_and_the_cli_follow_the_leader_through_a_kill() {
    let members = start_cluster(3);
    let all = list(&members.iter().collect::<Vec<_>>());
    let first_leader = leader(&all, None).await;

    // Followers first: the client has to be told where the leader is.
    let mut ordered: Vec<&Member> = members.iter().filter(|m| m.id != first_leader).collect();
    ordered.extend(members.iter().filter(|m| m.id == first_leader));
    let servers = list(&ordered);
    let client = timeout(STEP, Client::connect(&servers))
        .await
        .expect("connect in time")
        .expect("connect to the cluster");

    let ttl = Duration::from_secs(10);
    let guard = timeout(STEP, client.lock("c:held").ttl(ttl).acquire())
        .await
        .expect("acquire in time")
        .expect("acquire on the leader");
    let fence = guard.fence();

    // gRPC for the hot path too: the follower's UNAVAILABLE names the leader.
    let mut config = ServerConfig::new(servers.clone());
    config.transport = Transport::Grpc;
    let grpc = Client::connect_with(config)
        .await
        .expect("connect over gRPC");
    let over_grpc = timeout(STEP, grpc.lock("c:grpc").try_acquire())
        .await
        .expect("acquire in time")
        .expect("acquire over gRPC");
    let over_grpc_fence = over_grpc.fence();

    // `fencelock run` over the same list, its command running across the kill.
    let work = tempfile::tempdir().unwrap();
    let started = work.path().join("started");
    let script = format!("touch {}; sleep 6; echo ran-to-the-end", started.display());
    let run = fencelock(&servers)
        .args(["run", "--lock", "c:run", "--ttl", "9s", "--"])
        .args(["sh", "-c", &script])
        .spawn()
        .expect("spawn fencelock run");
    wait_for_file(&started).await;

    // kill -9 the leader.
    let dead = members
        .iter()
        .find(|m| m.id == first_leader)
        .expect("the leader is a member");
    let killed_at = Instant::now();
    let left_then = guard.valid_for().expect("held before the kill");
    let deadline_then = killed_at + left_then;
    // SAFETY: signals a child process this test started and still owns.
    assert_eq!(
        unsafe { libc::kill(dead.child.id() as libc::pid_t, libc::SIGKILL) },
        0
    );
    let survivors: Vec<&Member> = members.iter().filter(|m| m.id != first_leader).collect();
    let new_leader = leader(&list(&survivors), Some(first_leader)).await;
    assert_ne!(new_leader, first_leader);

    // (a) The guard renews on the new leader: its deadline moves past the one it had
    // at the kill, and it never reports the lock lost meanwhile.
    renewed_past(&guard, deadline_then).await;

    // (b) A new acquire succeeds on the new leader, and the old grant survived.
    let fresh = timeout(
        STEP,
        client.lock("c:new").wait(Duration::from_secs(20)).acquire(),
    )
    .await
    .expect("acquire in time")
    .expect("acquire after the failover");
    assert!(fresh.fence() > fence, "{} > {fence}", fresh.fence());
    let other = Client::connect(&servers).await.expect("connect");
    let held = timeout(STEP, other.lock("c:held").try_acquire())
        .await
        .expect("answer in time")
        .expect_err("the grant survived the failover");
    assert_eq!(held.kind(), ErrorKind::Held, "{held}");
    assert!(over_grpc
        .release()
        .await
        .expect("release over gRPC on the new leader"));
    let again = timeout(STEP, grpc.lock("c:grpc").try_acquire())
        .await
        .expect("acquire in time")
        .expect("acquire over gRPC after the failover");
    assert!(again.fence() > over_grpc_fence);

    // `fencelock run` kept its command running to the end.
    let out = timeout(STEP, run.wait_with_output())
        .await
        .expect("run ends in time")
        .expect("wait for fencelock run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("ran-to-the-end"),
        "{stderr}"
    );

    // The status, over the whole list (the dead member is passed over), still
    // names 3 members and the new leader.
    let v = status(&servers).await.expect("cluster status");
    let ids: Vec<u64> = v["members"]
        .as_array()
        .expect("members")
        .iter()
        .filter_map(|m| m["id"].as_u64())
        .collect();
    assert_eq!(ids.len(), 3, "{v}");
    assert_eq!(v["leader"]["id"].as_u64(), Some(new_leader), "{v}");

    assert!(guard.release().await.expect("release on the new leader"));
    assert!(fresh.release().await.expect("release"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_commands_transfer_the_leadership_and_the_guard_follows() {
    let members = start_cluster(3);
    let all = list(&members.iter().collect::<Vec<_>>());
    let first = leader(&all, None).await;
    let client = Client::connect(&all).await.expect("connect");
    let guard = timeout(
        STEP,
        client.lock("t:held").ttl(Duration::from_secs(3)).acquire(),
    )
    .await
    .expect("acquire in time")
    .expect("acquire");

    // Over the whole list: a follower first names the leader, which does it.
    let target = members
        .iter()
        .map(|m| m.id)
        .find(|id| *id != first)
        .unwrap();
    let mut ordered: Vec<&Member> = members.iter().filter(|m| m.id != first).collect();
    ordered.extend(members.iter().filter(|m| m.id == first));
    let out = timeout(
        STEP,
        fencelock(&list(&ordered))
            .args(["cluster", "transfer-leader", &target.to_string()])
            .output(),
    )
    .await
    .expect("transfer answers in time")
    .expect("run fencelock cluster transfer-leader");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&format!("member {target} is the leader")),
        "{stderr}"
    );
    assert_eq!(leader(&all, Some(first)).await, target);

    // The guard renews on the new leader for longer than its 3 s lease: the new
    // leader itself says it has held the lock a lease length more (however long
    // that takes on a loaded machine), under the same fence.
    let backend = fencelock::FencelockBackend::connect(ServerConfig::new(&all))
        .await
        .expect("connect");
    held_for_another(&backend, "t:held", guard.fence(), Duration::from_secs(3)).await;
    assert!(
        !guard.is_lost(),
        "the guard lost its lock over a leader transfer"
    );
    let fresh = timeout(STEP, client.lock("t:new").try_acquire())
        .await
        .expect("acquire in time")
        .expect("acquire after the transfer");
    assert!(fresh.fence() > guard.fence());

    // The text status names every member and the leader; bad input is a usage error.
    let out = timeout(STEP, fencelock(&all).args(["cluster", "status"]).output())
        .await
        .expect("status in time")
        .expect("run fencelock cluster status");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains(&format!("leader {target} (")), "{text}");
    assert_eq!(text.lines().count(), 2 + 3, "{text}");
    let out = timeout(
        STEP,
        fencelock(&all)
            .args(["cluster", "add", "--id", "9", "--peer-addr", "127.0.0.1:1"])
            .args(["--url", "ftp://nowhere"])
            .output(),
    )
    .await
    .expect("add answers in time")
    .expect("run fencelock cluster add");
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(guard.release().await.expect("release"));
}

/// The member ids `fencelock cluster status --json` lists, in order.
fn member_ids(status: &Value) -> Vec<u64> {
    let mut ids: Vec<u64> = status["members"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[])
        .iter()
        .filter_map(|m| m["id"].as_u64())
        .collect();
    ids.sort_unstable();
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_add_and_remove_change_the_membership() {
    let members = start_cluster(3);
    let all = list(&members.iter().collect::<Vec<_>>());
    leader(&all, None).await;

    let (listen, peer) = (free_port(), free_port());
    let fourth = spawn_member(4, listen, peer, &["--join"]);
    // A leader that has not yet committed an entry of its own term refuses membership
    // changes (503: not yet), and between leaders every member answers 503 with no
    // leader to name: `cluster add` itself retries both within --wait (this test
    // used to loop around it, on a 400 for the first).
    let out = timeout(
        STEP,
        fencelock(&all)
            .args(["cluster", "add", "--id", "4", "--json", "--wait", "40s"])
            .args(["--peer-addr", &format!("127.0.0.1:{peer}")])
            .args(["--url", &fourth.url])
            .output(),
    )
    .await
    .expect("add answers in time")
    .expect("run fencelock cluster add");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let added: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(member_ids(&added), [1, 2, 3, 4], "{added}");

    // The new member serves clients of the cluster (once it has heard from the
    // leader: until then it answers not_leader without a name, and the client
    // retries within the wait).
    let client = Client::connect(&fourth.url)
        .await
        .expect("connect to member 4");
    let guard = timeout(
        STEP,
        client.lock("m:a").wait(Duration::from_secs(20)).acquire(),
    )
    .await
    .expect("acquire in time")
    .expect("acquire through member 4");
    assert!(guard.release().await.expect("release"));

    let out = timeout(
        STEP,
        fencelock(&all)
            .args(["cluster", "remove", "4", "--json"])
            .output(),
    )
    .await
    .expect("remove answers in time")
    .expect("run fencelock cluster remove");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let removed: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(member_ids(&removed), [1, 2, 3], "{removed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guard_renews_past_a_stopped_leader() {
    let members = start_cluster(3);
    let all = list(&members.iter().collect::<Vec<_>>());
    let first = leader(&all, None).await;
    let client = Client::connect(&all).await.expect("connect");
    let guard = timeout(
        STEP,
        client.lock("s:held").ttl(Duration::from_secs(9)).acquire(),
    )
    .await
    .expect("acquire in time")
    .expect("acquire");
    // Renewals now go to the leader; stop it (SIGSTOP: connections stay open and
    // unanswered, unlike a kill).
    let stopped = members.iter().find(|m| m.id == first).expect("a member");
    let deadline_then = Instant::now() + guard.valid_for().expect("held");
    let pid = stopped.child.id() as libc::pid_t;
    // SAFETY: signals a child process this test started and still owns.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let survivors: Vec<&Member> = members.iter().filter(|m| m.id != first).collect();
    leader(&list(&survivors), Some(first)).await;
    renewed_past(&guard, deadline_then).await;
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    assert!(guard.release().await.expect("release"));
}

/// `GET /readyz` of `url` (plain HTTP/1.1): the status and the body.
async fn readyz(url: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let authority = url.strip_prefix("http://")?;
    let mut stream = tokio::net::TcpStream::connect(authority).await.ok()?;
    let request = format!("GET /readyz HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.ok()?;
    let status = answer.split_whitespace().nth(1)?.parse().ok()?;
    let body = answer.split_once("\r\n\r\n")?.1.to_owned();
    Some((status, body))
}

/// Issue 20: with no leader to be had, `cluster add` gave up at once (or, on a
/// leader that had lost its quorum, hung until the request timed out). It retries
/// within --wait now and then exits 69, saying no leader answered; the surviving
/// member's /readyz says it is not ready, and why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_commands_exit_69_when_no_leader_answers_within_the_wait() {
    let mut members = start_cluster(3);
    let all = list(&members.iter().collect::<Vec<_>>());
    leader(&all, None).await;
    let give_up = Instant::now() + STEP;
    loop {
        if readyz(&members[0].url).await.is_some_and(|(s, _)| s == 200) {
            break;
        }
        assert!(Instant::now() < give_up, "member 1 never became ready");
        sleep(Duration::from_millis(100)).await;
    }

    // kill -9 two of the three: whichever survives has no quorum.
    for dead in members.drain(1..) {
        drop(dead);
    }
    let survivor = &members[0];
    let give_up = Instant::now() + STEP;
    let why = loop {
        match readyz(&survivor.url).await {
            Some((503, body)) => break body,
            other => assert!(
                Instant::now() < give_up,
                "the survivor stayed ready: {other:?}"
            ),
        }
        sleep(Duration::from_millis(100)).await;
    };
    assert!(
        why.contains("\"unavailable\"") && why.contains("not ready: "),
        "{why}"
    );

    let out = timeout(
        STEP,
        fencelock(&all)
            .args(["cluster", "add", "--id", "4", "--wait", "2s"])
            .args(["--peer-addr", "127.0.0.1:1", "--url", "http://127.0.0.1:1"])
            .output(),
    )
    .await
    .expect("add gives up in time")
    .expect("run fencelock cluster add");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(69), "{stderr}");
    assert!(
        stderr.contains("no leader answered within 2s (--wait)"),
        "{stderr}"
    );

    // status prints what the survivor knows, and exits 69 unless it knows a leader
    // (a follower keeps naming its dead leader: Pre-Vote keeps its term).
    let out = timeout(
        STEP,
        fencelock(&survivor.url)
            .args(["cluster", "status", "--wait", "1s"])
            .output(),
    )
    .await
    .expect("status answers in time")
    .expect("run fencelock cluster status");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stdout.starts_with("member 1, term "), "{stdout}{stderr}");
    match out.status.code() {
        Some(0) => assert!(!stdout.contains("leader none known"), "{stdout}"),
        Some(69) => assert!(stdout.contains("leader none known"), "{stdout}{stderr}"),
        other => panic!("status exited {other:?}: {stderr}"),
    }
}

/// Runs `fencelock ARGS… --json` against `servers`; its JSON output, or its exit
/// code and stderr.
async fn cli_json(servers: &str, args: &[&str]) -> Result<Value, (Option<i32>, String)> {
    let out = timeout(STEP, fencelock(servers).args(args).arg("--json").output())
        .await
        .expect("the command answers in time")
        .expect("run fencelock");
    if !out.status.success() {
        return Err((
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ));
    }
    Ok(serde_json::from_slice(&out.stdout).expect("JSON output"))
}

/// Adds member `id` (started with `--join`) through `servers`, retrying while the
/// cluster is between leaders or finishing a configuration change.
async fn add(servers: &str, id: u64, peer: u16, url: &str) {
    let give_up = Instant::now() + STEP;
    let peer_addr = format!("127.0.0.1:{peer}");
    let id = id.to_string();
    let args = [
        "cluster",
        "add",
        "--id",
        &id,
        "--peer-addr",
        &peer_addr,
        "--url",
        url,
    ];
    loop {
        match cli_json(servers, &args).await {
            Ok(_) => return,
            Err((code, stderr)) => {
                assert!(
                    Instant::now() < give_up && matches!(code, Some(2 | 69)),
                    "{code:?}: {stderr}"
                );
                sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_server_becomes_a_cluster_whose_locks_survive_a_kill_of_its_first_member() {
    let root = tempfile::tempdir().expect("temp dir");
    let dir = root.path().join("data");
    let dir_arg = dir.to_str().expect("UTF-8 path");
    let (mut single, addr) = support::serve(["--data-dir", dir_arg]);
    let single_url = format!("http://{addr}");
    let held = cli_json(&single_url, &["acquire", "imp:held", "--ttl", "60s"])
        .await
        .expect("acquire");
    let pid = single.id() as libc::pid_t;
    // SAFETY: signals a child process this test started and still owns.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    assert!(single.wait().expect("wait").success());

    // The same directory, as the one member of a new cluster.
    let (listen, peer) = (free_port(), free_port());
    let peers = format!("1=127.0.0.1:{peer}");
    let mut first = spawn_member_in(1, listen, peer, &["--peers", &peers], dir.clone());
    let give_up = Instant::now() + STEP;
    let shown = loop {
        // Until the import is applied, clients get 503 (and retry).
        if let Ok(shown) = cli_json(&first.url, &["show", "imp:held"]).await {
            break shown;
        }
        assert!(Instant::now() < give_up, "the import is not served");
        sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(shown["holders"][0]["fence"], held["fence"], "{shown}");
    let token = held["owner_token"].as_str().expect("owner token");
    cli_json(&first.url, &["renew", "imp:held", "--owner-token", token])
        .await
        .expect("the old owner token renews");
    assert!(dir
        .join("imported-single-node")
        .join("log.manifest")
        .exists());

    // Two more members, then kill -9 the first: the new leader has the lock, and
    // fences keep increasing.
    let mut others = Vec::new();
    for id in [2, 3] {
        let (listen, peer) = (free_port(), free_port());
        let member = spawn_member(id, listen, peer, &["--join"]);
        add(&first.url, id, peer, &member.url).await;
        others.push(member);
    }
    let _ = first.child.kill();
    let _ = first.child.wait();
    let survivors = list(&others.iter().collect::<Vec<_>>());
    leader(&survivors, Some(1)).await;
    let shown = cli_json(&survivors, &["show", "imp:held"])
        .await
        .expect("show on the new leader");
    assert_eq!(shown["holders"][0]["fence"], held["fence"], "{shown}");
    let next = cli_json(&survivors, &["acquire", "imp:next", "--ttl", "60s"])
        .await
        .expect("acquire on the new leader");
    assert!(
        next["fence"].as_u64() > held["fence"].as_u64(),
        "{next} after {held}"
    );
    cli_json(&survivors, &["release", "imp:held", "--owner-token", token])
        .await
        .expect("the old owner token releases");

    // The first member comes back on its directory without importing again.
    drop(first);
    let back = spawn_member_in(1, listen, peer, &["--peers", &peers], dir.clone());
    let all = format!("{},{survivors}", back.url);
    let give_up = Instant::now() + STEP;
    while cli_json(&back.url, &["cluster", "status"])
        .await
        .map_or(true, |s| {
            member_ids(&s) != [1, 2, 3] || s["importing"] != Value::Bool(false)
        })
    {
        assert!(Instant::now() < give_up, "member 1 does not come back");
        sleep(Duration::from_millis(100)).await;
    }
    let err = cli_json(&all, &["show", "imp:held"]).await;
    assert!(
        matches!(&err, Err((Some(1), e)) if e.contains("imp:held is not held")),
        "imp:held stays released: {err:?}"
    );
    assert!(!dir.join("log.manifest").exists());
}
