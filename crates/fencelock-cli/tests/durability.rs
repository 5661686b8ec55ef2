//! Durability of the real binary: `kill -9`, graceful shutdown, backup and restore.
//!
//! Each test runs `fencelock serve` as a child process on a random loopback port in
//! its own temp dir, and talks HTTP/JSON to it.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support;

use support::BIN;

struct Proc {
    child: Child,
    addr: SocketAddr,
}

fn start(data_dir: &Path) -> Proc {
    let (child, addr) = support::serve([OsStr::new("--data-dir"), data_dir.as_os_str()]);
    Proc { child, addr }
}

impl Proc {
    fn kill9(mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reap");
    }

    fn sigterm(mut self) -> std::process::ExitStatus {
        let sent = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(sent.success());
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(Instant::now() < deadline, "no exit 20 s after SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let (status, bytes) = http(self.addr, method, path, body.map(|b| b.to_string()));
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    fn acquire(&self, name: &str, ttl_ms: u64) -> (u64, String) {
        let (status, v) = self.call(
            "POST",
            "/v1/acquire",
            Some(json!({"name": name, "ttl_ms": ttl_ms})),
        );
        assert_eq!(status, 200, "acquire {name}: {v}");
        (
            v["fence"].as_u64().unwrap(),
            v["owner_token"].as_str().unwrap().to_owned(),
        )
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn http(addr: SocketAddr, method: &str, path: &str, body: Option<String>) -> (u16, Vec<u8>) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let body = body.unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let split = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("headers");
    let head = String::from_utf8_lossy(&out[..split]).to_string();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, out[split + 4..].to_vec())
}

fn temp() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

#[test]
fn kill_9_keeps_every_acknowledged_lock_and_fences_only_grow() {
    let dir = temp();
    let mut held: Vec<(String, u64, String)> = Vec::new();
    let mut max_fence = 0;
    for round in 0..4 {
        let server = start(dir.path());
        // Everything acknowledged before the crash is still there, with a fresh TTL.
        for (name, fence, _) in &held {
            let (status, v) = server.call("GET", &format!("/v1/locks/{name}"), None);
            assert_eq!(status, 200, "round {round}: {name} lost after kill -9: {v}");
            assert_eq!(v["holders"][0]["fence"].as_u64(), Some(*fence));
            let remaining = v["holders"][0]["ttl_remaining_ms"].as_u64().unwrap();
            assert!(
                remaining > 50_000,
                "lease not refreshed: {remaining} ms left"
            );
        }
        // Tokens issued before the crash still renew and release.
        if let Some((name, fence, token)) = held.pop() {
            let (status, v) = server.call(
                "POST",
                "/v1/renew",
                Some(json!({"name": name, "owner_token": token})),
            );
            assert_eq!((status, v["fence"].as_u64()), (200, Some(fence)), "{v}");
            let (status, _) = server.call(
                "POST",
                "/v1/release",
                Some(json!({"name": name, "owner_token": token})),
            );
            assert_eq!(status, 200);
        }
        // New grants: every fence larger than any fence seen before.
        for i in 0..5 {
            let name = format!("job:{round}:{i}");
            let (fence, token) = server.acquire(&name, 60_000);
            assert!(fence > max_fence, "fence {fence} after {max_fence}");
            max_fence = fence;
            held.push((name, fence, token));
        }
        // Grants and releases that churn the log right up to the crash.
        for i in 0..20 {
            let (fence, token) = server.acquire(&format!("churn:{i}"), 60_000);
            assert!(fence > max_fence);
            max_fence = fence;
            let (status, _) = server.call(
                "POST",
                "/v1/release",
                Some(json!({"name": format!("churn:{i}"), "owner_token": token})),
            );
            assert_eq!(status, 200);
        }
        server.kill9();
    }
}

#[test]
fn sigterm_exits_zero_and_keeps_state() {
    let dir = temp();
    let server = start(dir.path());
    let (fence, _) = server.acquire("report.csv", 60_000);
    let status = server.sigterm();
    assert!(status.success(), "graceful shutdown exit status {status:?}");
    let server = start(dir.path());
    let (status, v) = server.call("GET", "/v1/locks/report.csv", None);
    assert_eq!(
        (status, v["holders"][0]["fence"].as_u64()),
        (200, Some(fence))
    );
}

#[test]
fn sigterm_ends_long_waits_instead_of_hanging() {
    let dir = temp();
    let server = start(dir.path());
    server.acquire("busy", 60_000);
    let addr = server.addr;
    let waiter = std::thread::spawn(move || {
        http(
            addr,
            "POST",
            "/v1/acquire",
            Some(json!({"name": "busy", "ttl_ms": 1000, "wait_ms": 600_000}).to_string()),
        )
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.call("GET", "/v1/locks/busy", None).1["waiters"] != 1 {
        assert!(Instant::now() < deadline, "waiter never queued");
        std::thread::sleep(Duration::from_millis(10));
    }
    let status = server.sigterm();
    assert!(status.success());
    let (code, body) = waiter.join().unwrap();
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        (code, v["error"]["code"].as_str()),
        (503, Some("unavailable"))
    );
}

#[test]
fn a_second_server_on_the_same_data_dir_is_refused() {
    let dir = temp();
    let _first = start(dir.path());
    let out = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--log-format", "json"])
        .arg("--data-dir")
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(73));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("in use by another fencelock server"),
        "{stderr}"
    );
}

fn run(args: &[&str], paths: &[&Path]) -> (bool, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(args);
    for p in paths {
        cmd.arg(p);
    }
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn restore_from_backup_never_reissues_a_fence() {
    let dir = temp();
    let backup: PathBuf = dir.path().join("backup.flsnap");
    let live = dir.path().join("live");
    let server = start(&live);
    let (kept, _) = server.acquire("kept", 60_000);
    let url = format!("http://{}", server.addr);
    let (ok, out) = run(&["backup", "--server", &url, "--out"], &[&backup]);
    assert!(ok, "backup failed: {out}");
    // The live server goes on granting after the backup was taken.
    let mut max_fence = kept;
    for i in 0..50 {
        let (fence, token) = server.acquire(&format!("after:{i}"), 60_000);
        max_fence = max_fence.max(fence);
        server.call(
            "POST",
            "/v1/release",
            Some(json!({"name": format!("after:{i}"), "owner_token": token})),
        );
    }
    server.kill9();

    // Restoring over a non-empty directory is refused.
    let (ok, out) = run(
        &["restore", "--from"],
        &[&backup, Path::new("--data-dir"), &live],
    );
    assert!(!ok && out.contains("not empty"), "{out}");

    let restored = dir.path().join("restored");
    let (ok, out) = run(
        &["restore", "--from"],
        &[&backup, Path::new("--data-dir"), &restored],
    );
    assert!(ok, "restore failed: {out}");
    let server = start(&restored);
    let (status, v) = server.call("GET", "/v1/locks/kept", None);
    assert_eq!(
        (status, v["holders"][0]["fence"].as_u64()),
        (200, Some(kept))
    );
    let (status, _) = server.call("GET", "/v1/locks/after:0", None);
    assert_eq!(status, 404, "state after the backup must not be in it");
    let (fence, _) = server.acquire("new", 60_000);
    assert!(
        fence > max_fence,
        "fence {fence} after restore, but {max_fence} was issued before"
    );

    // A damaged backup is refused, not loaded.
    let mut bytes = std::fs::read(&backup).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    let broken = dir.path().join("broken.flsnap");
    std::fs::write(&broken, bytes).unwrap();
    let (ok, out) = run(
        &["restore", "--from"],
        &[&broken, Path::new("--data-dir"), &dir.path().join("x")],
    );
    assert!(!ok, "a corrupt backup was restored: {out}");
}

#[test]
fn bad_config_is_a_usage_error() {
    let dir = temp();
    let config = dir.path().join("bad.toml");
    std::fs::write(&config, "lisen = \"127.0.0.1:1\"\n").unwrap();
    let out = Command::new(BIN)
        .args(["serve", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("lisen"));
}

#[test]
fn environment_configures_serve_and_flags_override_it() {
    let dir = temp();
    let from_env = dir.path().join("from-env");
    let from_flag = dir.path().join("from-flag");
    let config = dir.path().join("fencelock.toml");
    std::fs::write(&config, "listen = \"127.0.0.1:1\"\nlog_format = \"json\"\n").unwrap();
    // The file says port 1; the environment overrides it; the data dir comes from
    // the environment unless a flag names one.
    for (flag, expected) in [(None, &from_env), (Some(&from_flag), &from_flag)] {
        let mut cmd = Command::new(BIN);
        cmd.arg("serve")
            .env("FENCELOCK_CONFIG", &config)
            .env("FENCELOCK_LISTEN", "127.0.0.1:0")
            .env("FENCELOCK_DATA_DIR", &from_env)
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some(f) = flag {
            cmd.arg("--data-dir").arg(f);
        }
        let mut child = cmd.spawn().unwrap();
        let stderr = child.stderr.take().unwrap();
        let line = BufReader::new(stderr)
            .lines()
            .map(|l| l.unwrap())
            .find(|l| l.contains("\"listen\""))
            .expect("serving line");
        let v: Value = serde_json::from_str(&line).expect("JSON log line (format from the file)");
        assert_ne!(v["listen"].as_str(), Some("127.0.0.1:1"));
        assert_eq!(v["data_dir"].as_str(), Some(expected.to_str().unwrap()));
        assert!(
            expected.join("LOCK").exists() || std::fs::read_dir(expected).unwrap().next().is_some()
        );
        child.kill().unwrap();
        child.wait().unwrap();
    }
}

/// Storage failure is fail-stop: when the disk fills up (a tmpfs of 1.5 MiB in a
/// private user and mount namespace, so nothing outside the test is touched and no
/// root is needed), the server
/// acknowledges nothing more and exits with status 1 saying why.
#[test]
fn a_full_disk_stops_the_server_without_acknowledging_more() {
    let dir = temp();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let config = dir.path().join("small.toml");
    std::fs::write(&config, "[storage]\nsegment_bytes = 1048576\n").unwrap();
    let script = format!(
        "mount -t tmpfs -o size=2560k tmpfs '{}' && exec '{}' serve --config '{}' --data-dir '{}' --listen 127.0.0.1:0 --log-format json",
        data.display(),
        BIN,
        config.display(),
        data.display()
    );
    let mut child = Command::new("unshare")
        .args(["--user", "--map-root-user", "--mount", "sh", "-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("unshare (util-linux) runs");
    let stderr = child.stderr.take().unwrap();
    let mut lines = BufReader::new(stderr).lines();
    let addr: SocketAddr = loop {
        let line = lines
            .next()
            .expect("server exited before serving (the tmpfs mount needs user namespaces)")
            .unwrap();
        let v: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
        if let Some(listen) = v.get("listen").and_then(Value::as_str) {
            break listen.parse().unwrap();
        }
    };
    let log = std::thread::spawn(move || lines.map(|l| l.unwrap()).collect::<Vec<_>>());

    // Each grant logs about 1 KiB, and about as much to the audit log; the first
    // segment of each (1 MiB, preallocated) fills after ~1,000 and the next one cannot
    // be allocated (2.5 MiB of tmpfs).
    let owner = "o".repeat(1000);
    let mut acknowledged = 0;
    let mut refused = None;
    for i in 0..5_000 {
        let body =
            json!({"name": format!("fill:{i}"), "ttl_ms": 60_000, "owner": owner}).to_string();
        let result = std::panic::catch_unwind(|| http(addr, "POST", "/v1/acquire", Some(body)));
        match result {
            Ok((200, _)) => acknowledged += 1,
            Ok((status, body)) => {
                refused = Some(format!("{status} {}", String::from_utf8_lossy(&body)));
                break;
            }
            Err(_) => {
                refused = Some("connection failed".to_owned());
                break;
            }
        }
    }
    let refused = refused.expect("the disk never filled up");
    assert!(
        acknowledged > 500,
        "only {acknowledged} grants before the disk was full"
    );
    assert!(
        refused.starts_with("503") || refused == "connection failed",
        "after the storage failure: {refused}"
    );
    let status = child.wait().unwrap();
    assert_eq!(
        status.code(),
        Some(1),
        "exit status after a storage failure"
    );
    let log = log.join().unwrap().join("\n");
    assert!(log.contains("fail-stop"), "{log}");
    assert!(!log.contains("panicked"), "{log}");
}
