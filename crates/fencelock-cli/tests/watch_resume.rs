//! A watch resumes across a `kill -9` of the real server binary without a gap or a
//! repeat (issue 22, item 5): the client library's `EventStream` and the CLI's
//! `fencelock watch --json`, both watching while the server is killed and started
//! again on the same port and data directory, with events before the kill (some
//! read, some still unread), while the watchers are disconnected, and after.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, SystemTime};

use fencelock::{
    AcquireSpec, EventStream, FencelockBackend, LockBackend, ServerConfig, WatchPosition,
};
use serde_json::Value;

use crate::support;

use support::BIN;

/// Longest a single step may take before the test fails instead of hanging.
const STEP: Duration = Duration::from_secs(30);

/// What a watcher saw of one event, as the checker compares it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    position: WatchPosition,
    /// `kind name fence`.
    what: String,
}

/// The gap checker: positions strictly increase (no repeat, no reordering) and
/// the events are exactly the ones made, in order (no gap, nothing extra).
fn check(expected: &[String], seen: &[Seen]) -> Result<(), String> {
    for pair in seen.windows(2) {
        if pair[1].position <= pair[0].position {
            return Err(format!(
                "position {} came after {}: a repeat or a reordering",
                pair[1].position, pair[0].position
            ));
        }
    }
    for (i, want) in expected.iter().enumerate() {
        match seen.get(i) {
            Some(got) if got.what == *want => {}
            Some(got) => {
                return Err(format!(
                    "event {i}: expected {want:?}, saw {:?} at {}",
                    got.what, got.position
                ))
            }
            None => return Err(format!("event {i} ({want:?}) never came")),
        }
    }
    if seen.len() > expected.len() {
        return Err(format!("extra events: {:?}", &seen[expected.len()..]));
    }
    Ok(())
}

/// `fencelock serve` on `listen` with `data_dir`, once it serves.
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

fn kill9(mut child: Child) {
    child.kill().expect("SIGKILL");
    child.wait().expect("reap");
}

/// `fencelock watch --json` against `url`: its stdout lines, parsed, on a channel.
fn cli_watch(url: &str, prefix: &str) -> (Child, mpsc::Receiver<Value>) {
    let mut child = Command::new(BIN)
        .args(["watch", "--json", "--prefix", prefix, "--server", url])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn fencelock watch");
    let stdout: ChildStdout = child.stdout.take().expect("piped stdout");
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
    (child, rx)
}

/// One acquire and release of `name`: the events they make, in order.
async fn round(backend: &FencelockBackend, name: &str) -> [String; 2] {
    let lease = tokio::time::timeout(
        STEP,
        backend.acquire(&AcquireSpec::new(name, Duration::from_secs(60))),
    )
    .await
    .expect("acquire in time")
    .expect("acquire");
    let released = tokio::time::timeout(STEP, backend.release(&lease))
        .await
        .expect("release in time")
        .expect("release");
    assert!(released);
    [
        format!("granted {name} {}", lease.fence),
        format!("released {name} {}", lease.fence),
    ]
}

/// The next `n` events of `stream`.
async fn read(stream: &mut EventStream, n: usize, into: &mut Vec<Seen>) {
    for _ in 0..n {
        let event = tokio::time::timeout(STEP, stream.next())
            .await
            .expect("an event in time")
            .expect("the watch goes on")
            .expect("the stream does not end");
        into.push(Seen {
            position: event.position.expect("events carry their position"),
            what: format!(
                "{} {} {}",
                event.kind.as_str(),
                event.name,
                event.fence.unwrap_or(0)
            ),
        });
    }
}

/// The CLI's next `n` events (waiting in a blocking thread: the channel is std's).
async fn read_cli(rx: mpsc::Receiver<Value>, n: usize) -> (mpsc::Receiver<Value>, Vec<Value>) {
    tokio::task::spawn_blocking(move || {
        let lines = (0..n)
            .map(|i| {
                rx.recv_timeout(STEP)
                    .unwrap_or_else(|e| panic!("the CLI printed {i} of {n} events: {e}"))
            })
            .collect();
        (rx, lines)
    })
    .await
    .expect("reader thread")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_resumes_across_kill_9_without_gaps_or_repeats() {
    let dir = tempfile::tempdir().unwrap();
    let (server, addr) = support::serve([OsStr::new("--data-dir"), dir.path().as_os_str()]);
    let url = format!("http://{addr}");
    let backend = FencelockBackend::connect(ServerConfig::new(url.clone()))
        .await
        .unwrap();
    let mut stream = backend.watch("job:").await.unwrap();
    let (mut cli_child, cli_events) = cli_watch(&url, "job:");
    let mut expected = Vec::new();
    let mut seen = Vec::new();

    // Before. The CLI watches once it has connected: make events until it prints
    // one (the library's watch was open before the first).
    let (first_cli, cli_events) = {
        let mut rx = cli_events;
        loop {
            expected.extend(round(&backend, "job:probe").await);
            let (back, printed) = tokio::task::spawn_blocking(move || {
                let printed = rx.recv_timeout(Duration::from_secs(1));
                (rx, printed)
            })
            .await
            .unwrap();
            rx = back;
            match printed {
                Ok(line) => break (line, rx),
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    assert!(expected.len() < 60, "the CLI never printed an event")
                }
                Err(e) => panic!("the CLI watch ended: {e}"),
            }
        }
    };
    for name in ["job:a", "other:x", "job:b"] {
        let events = round(&backend, name).await;
        if name.starts_with("job:") {
            expected.extend(events);
        }
    }
    read(&mut stream, expected.len(), &mut seen).await;
    // Unread when the server dies: durable, not yet taken by the watcher.
    for name in ["job:c", "job:d"] {
        expected.extend(round(&backend, name).await);
    }

    kill9(server);
    let (server, again) = serve(dir.path(), &addr.to_string());
    assert_eq!(again, addr);

    // During: while the library's watcher is disconnected (it reconnects when read).
    for name in ["job:e", "job:f"] {
        expected.extend(round(&backend, name).await);
    }
    read(&mut stream, expected.len() - seen.len(), &mut seen).await;
    // After: on the resumed stream.
    for name in ["job:g", "other:y", "job:h"] {
        let events = round(&backend, name).await;
        if name.starts_with("job:") {
            expected.extend(events);
        }
    }
    read(&mut stream, expected.len() - seen.len(), &mut seen).await;
    check(&expected, &seen).unwrap();

    // The checker catches what it is for: a planted gap, repeat or reordering.
    let mut gap = seen.clone();
    gap.remove(seen.len() / 2);
    assert!(check(&expected, &gap).is_err(), "a gap went unnoticed");
    let mut repeat = seen.clone();
    repeat.insert(seen.len() / 2, seen[seen.len() / 2].clone());
    assert!(
        check(&expected, &repeat).is_err(),
        "a repeat went unnoticed"
    );
    let mut swapped = seen.clone();
    swapped.swap(1, 2);
    assert!(check(&expected, &swapped).is_err(), "a swap went unnoticed");

    // The CLI watched across the kill too: from the first event it printed on,
    // the same events, with RFC 3339 wall-clock times.
    let first: WatchPosition = first_cli["position"].as_str().unwrap().parse().unwrap();
    let from = seen.iter().position(|e| e.position == first).unwrap();
    let want = &expected[from..];
    let (_, rest) = read_cli(cli_events, want.len() - 1).await;
    let mut cli_seen = vec![first_cli];
    cli_seen.extend(rest);
    let cli: Vec<Seen> = cli_seen
        .iter()
        .map(|v| Seen {
            position: v["position"]
                .as_str()
                .and_then(|p| p.parse().ok())
                .unwrap_or_else(|| panic!("no position: {v}")),
            what: format!(
                "{} {} {}",
                v["kind"].as_str().unwrap(),
                v["name"].as_str().unwrap(),
                v["fence"].as_u64().unwrap_or(0)
            ),
        })
        .collect();
    check(want, &cli).unwrap();
    let now = SystemTime::now();
    for v in &cli_seen {
        let at = v["time"].as_str().unwrap_or_else(|| panic!("no time: {v}"));
        assert_eq!(v["at"], v["time"], "the old name stays the same time");
        let ms = v["time_ms"]
            .as_u64()
            .unwrap_or_else(|| panic!("no time_ms: {v}"));
        let at = humantime::parse_rfc3339(at).unwrap_or_else(|e| panic!("{at}: {e}"));
        let age = now.duration_since(at).unwrap_or_default();
        assert!(age < Duration::from_secs(600), "{v}: not wall-clock time");
        assert_eq!(
            at.duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_millis() as u64,
            ms,
            "{v}"
        );
        assert!(v.get("at_ms").is_none(), "{v}: the uptime is not printed");
    }
    let _ = cli_child.kill();
    let _ = cli_child.wait();
    kill9(server);
}
