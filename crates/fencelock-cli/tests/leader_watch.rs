//! `fencelock leader NAME --watch` keeps following the election across a `kill -9`
//! of the server (issue 23): the real binary watches while the server is killed and
//! started again on the same port and data directory, the leader resigns and another
//! one takes over, and the watcher — the same process, never restarted — prints the
//! new leader.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use fencelock::{AcquireSpec, FencelockBackend, LockBackend, ServerConfig};
use serde_json::Value;

use crate::support;

use support::BIN;

/// Longest a single step may take before the test fails instead of hanging.
const STEP: Duration = Duration::from_secs(30);
/// How long the server stays down: longer than the watcher's longest poll interval.
const OUTAGE: Duration = Duration::from_secs(5);

/// `fencelock serve` on `listen` (a port it served on before) with `data_dir`, once it
/// serves.
fn serve(data_dir: &Path, listen: &str) -> (Child, SocketAddr) {
    let mut child = Command::new(BIN)
        .args(["serve", "--listen", listen, "--log-format", "json"])
        .args([OsStr::new("--data-dir"), data_dir.as_os_str()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn fencelock serve");
    let stderr = child.stderr.take().expect("piped stderr");
    let mut lines = BufReader::new(stderr).lines();
    let addr = loop {
        let line = lines
            .next()
            .expect("server exited before it was serving")
            .expect("read stderr");
        let v: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
        if let Some(listen) = v.get("listen").and_then(Value::as_str) {
            break listen.parse().expect("listen address");
        }
    };
    std::thread::spawn(move || for _ in lines {});
    (child, addr)
}

/// A child killed when the test ends, pass or fail.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `fencelock leader NAME --watch --json` against `url`: its stdout lines, parsed.
fn leader_watch(url: &str, name: &str) -> (Killed, mpsc::Receiver<Value>) {
    let mut child = Command::new(BIN)
        .args(["leader", name, "--watch", "--json", "--server", url])
        .env_remove("FENCELOCK_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn fencelock leader --watch");
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            let value = serde_json::from_str(&line).unwrap_or(Value::String(line));
            if tx.send(value).is_err() {
                return;
            }
        }
    });
    (Killed(child), rx)
}

/// The first line the watcher prints that satisfies `wanted`, within [`STEP`];
/// fails the test with every line seen otherwise.
fn printed(seen: &mpsc::Receiver<Value>, what: &str, wanted: impl Fn(&Value) -> bool) -> Value {
    let until = Instant::now() + STEP;
    let mut lines = Vec::new();
    loop {
        let left = until.saturating_duration_since(Instant::now());
        match seen.recv_timeout(left) {
            Ok(line) if wanted(&line) => return line,
            Ok(line) => lines.push(line),
            Err(e) => panic!("the watcher never printed {what} ({e}); it printed {lines:?}"),
        }
    }
}

fn leads(line: &Value, value: &str, term: u64) -> bool {
    line["leader"]["value"] == value && line["leader"]["term"] == term
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_watch_prints_the_new_leader_after_the_server_is_killed_and_restarted() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let data = dir.path().join("data");
    let (server, addr) = support::serve([OsStr::new("--data-dir"), data.as_os_str()]);
    let server = Killed(server);
    let url = format!("http://{addr}");
    let spec = AcquireSpec::new("svc", Duration::from_secs(60));

    let backend = FencelockBackend::connect(ServerConfig::new(&url))
        .await
        .expect("connected");
    let first = backend
        .campaign(&spec, "host-a")
        .await
        .expect("host-a leads");
    let (_watcher, seen) = leader_watch(&url, "svc");
    printed(&seen, "host-a leading", |l| leads(l, "host-a", first.fence));

    // kill -9, then the same port and data directory: the term survives. The server
    // stays down for more than the watcher's longest poll interval (2 s), so the
    // watcher surely asks the dead port at least once and must reconnect (without
    // the pause a poll could fall after the restart and never notice).
    drop(server);
    tokio::time::sleep(OUTAGE).await;
    let (restarted, _) = serve(&data, &addr.to_string());
    let _server = Killed(restarted);
    let backend = FencelockBackend::connect(ServerConfig::new(&url))
        .await
        .expect("connected again");
    assert!(
        backend.release(&first).await.expect("host-a resigns"),
        "host-a's term survived the restart"
    );
    let second = backend
        .campaign(&spec, "host-b")
        .await
        .expect("host-b leads");
    assert!(second.fence > first.fence, "terms only grow");

    let line = printed(&seen, "host-b leading", |l| {
        leads(l, "host-b", second.fence)
    });
    assert_eq!(line["name"], "svc", "{line}");
    assert!(line["at"].is_string(), "a wall-clock time: {line}");
}
