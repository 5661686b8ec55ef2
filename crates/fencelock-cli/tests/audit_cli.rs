//! The audit log through the real binary: acknowledged grants keep their audit
//! entries across `kill -9`, and `fencelock audit` shows them (table and JSON,
//! filtered by lock and age).
//!
//! Run: `cargo test -p fencelock-cli --test it audit_cli::`

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_fencelock");

struct Proc {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(data_dir: &Path) -> Proc {
    let mut child = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--log-format", "json"])
        .arg("--data-dir")
        .arg(data_dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn fencelock serve");
    let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
    let addr = loop {
        let line = lines
            .next()
            .expect("server exited before serving")
            .expect("read stderr");
        let v: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
        if let Some(listen) = v.get("listen").and_then(Value::as_str) {
            break listen.parse().expect("listen address");
        }
    };
    std::thread::spawn(move || for _ in lines {});
    Proc { child, addr }
}

/// One HTTP/1.1 exchange; `None` if the connection failed (the server was killed).
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> Option<(u16, Value)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).ok()?;
    let split = out.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&out[..split]).to_string();
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((
        status,
        serde_json::from_slice(&out[split + 4..]).unwrap_or(Value::Null),
    ))
}

fn audit_cli(addr: SocketAddr, args: &[&str]) -> String {
    let out = Command::new(BIN)
        .arg("audit")
        .arg("--server")
        .arg(format!("http://{addr}"))
        .args(args)
        .output()
        .expect("run fencelock audit");
    assert!(
        out.status.success(),
        "fencelock audit {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

#[test]
fn acknowledged_grants_keep_their_audit_entries_across_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path());
    let addr = server.addr;
    // Clients acquire as fast as they can; the server is killed mid-stream, after a
    // fixed number of acknowledgements (not after a time).
    let acked: Arc<Mutex<BTreeMap<u64, String>>> = Arc::default();
    let count = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..4)
        .map(|t| {
            let (acked, count) = (acked.clone(), count.clone());
            std::thread::spawn(move || {
                for i in 0.. {
                    let name = format!("k9:{t}:{i}");
                    let body =
                        json!({"name": name, "ttl_ms": 600_000, "owner": format!("client-{t}")});
                    match http(addr, "POST", "/v1/acquire", &body.to_string()) {
                        Some((200, v)) => {
                            acked
                                .lock()
                                .unwrap()
                                .insert(v["fence"].as_u64().unwrap(), name);
                            count.fetch_add(1, Ordering::SeqCst);
                        }
                        Some((status, v)) => panic!("acquire answered {status}: {v}"),
                        None => return, // killed
                    }
                }
            })
        })
        .collect();
    while count.load(Ordering::SeqCst) < 300 {
        std::thread::sleep(Duration::from_millis(2));
    }
    drop(server); // SIGKILL
    for c in clients {
        c.join().expect("client thread");
    }
    let acked = acked.lock().unwrap().clone();
    assert!(acked.len() >= 300);

    let server = start(dir.path());
    let json_out = audit_cli(server.addr, &["--json", "--limit", "1000"]);
    let v: Value = serde_json::from_str(&json_out).expect("--json prints JSON");
    let grants: BTreeMap<u64, String> = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "granted")
        .map(|e| {
            (
                e["fence"].as_u64().unwrap(),
                e["lock"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    for (fence, name) in &acked {
        assert_eq!(
            grants.get(fence),
            Some(name),
            "acknowledged grant {name} (fence {fence}) has no audit entry after kill -9"
        );
    }

    // The human table, filtered by lock and age.
    let (fence, name) = acked.iter().next().unwrap();
    let table = audit_cli(server.addr, &["--lock", name, "--since", "1h"]);
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("TIME (UTC)"), "{table}");
    assert_eq!(lines.len(), 2, "one entry for {name}: {table}");
    assert!(
        lines[1].contains("granted") && lines[1].contains(&format!(" {fence} ")),
        "{table}"
    );
    // Nothing was committed after now.
    let none = audit_cli(server.addr, &["--lock", name, "--since", "0s"]);
    assert!(none.contains("(no entries)"), "{none}");
    // A bad flag is a usage error, not a crash.
    let out = Command::new(BIN)
        .args(["audit", "--since", "soon"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}
