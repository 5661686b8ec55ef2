//! Issue 19 items 2, 3 and 7 tried against the real binary, as the attacker did,
//! scaled down (a quota of 50 sessions instead of a million opened): one tenant
//! cannot exhaust the session or lock tables for the others, cannot keep alive,
//! attach to or close another principal's session, and never sees a session id.
//! Each test prints one `ATTACK <item>: … -> …` line for docs/security.md.

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use fencelock::{FencelockBackend, ServerConfig};
use fencelock_server::auth::hash_token;
use serde_json::{json, Value};

use crate::support;

/// Per-token quotas of the test config (scaled down from the defaults).
const MAX_SESSIONS: usize = 50;
const MAX_HELD: usize = 20;
const MAX_WAITERS: usize = 5;

/// Every loop of these tests stops after this many requests.
const MAX_TRIES: usize = 200;

/// (name, role, prefixes): the attacker's setup from the issue, plus an
/// unrestricted admin (`ops`) who cleans up.
const TOKENS: [(&str, &str, &str); 6] = [
    ("a", "client", r#"["a:"]"#),
    ("b", "client", r#"["b:"]"#),
    ("c", "client", r#"["c:"]"#),
    ("reader", "reader", r#"[""]"#),
    ("adm", "admin", r#"["a:"]"#),
    ("ops", "admin", r#"[""]"#),
];

fn secret(name: &str) -> String {
    format!("secret-of-{name}-0123456789abcdef")
}

fn config() -> String {
    let mut c = format!(
        "[limits]\nmax_sessions_per_token = {MAX_SESSIONS}\nmax_held_locks_per_token = {MAX_HELD}\nmax_waiters_per_token = {MAX_WAITERS}\n"
    );
    for (name, role, prefixes) in TOKENS {
        c += &format!(
            "\n[[auth.tokens]]\nname = \"{name}\"\nrole = \"{role}\"\nprefixes = {prefixes}\nsha256 = \"{}\"\n",
            hash_token(&secret(name))
        );
    }
    c
}

/// `fencelock serve` on a data directory that outlives it (for restarts).
struct Server {
    child: Child,
    addr: SocketAddr,
}

impl Server {
    fn start(dir: &Path) -> Server {
        let config_path: PathBuf = dir.join("fencelock.toml");
        std::fs::write(&config_path, config()).expect("write config");
        let (child, addr) = support::serve([
            OsStr::new("--config"),
            config_path.as_os_str(),
            OsStr::new("--data-dir"),
            dir.join("data").as_os_str(),
        ]);
        Server { child, addr }
    }

    /// One request as `token`: status and JSON body.
    fn call(&self, token: &str, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut s = TcpStream::connect(self.addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            secret(token),
            body.len()
        )
        .expect("send");
        let mut out = Vec::new();
        s.read_to_end(&mut out).expect("read");
        let text = String::from_utf8_lossy(&out);
        let (head, body) = text.split_once("\r\n\r\n").expect("a response");
        let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
        (status, serde_json::from_str(body).unwrap_or(Value::Null))
    }

    /// The raw body of a GET as `token` (to search it for secrets).
    fn text(&self, token: &str, path: &str) -> String {
        self.call(token, "GET", path, None).1.to_string()
    }

    fn open_session(&self, token: &str) -> (u16, Value) {
        self.call(
            token,
            "POST",
            "/v1/sessions",
            Some(json!({"ttl_ms": 600_000})),
        )
    }

    fn stop(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn code(body: &Value) -> &str {
    body["error"]["code"].as_str().unwrap_or("")
}

/// Item 2: token `a` opens sessions until refused; `b` and the admins still open
/// theirs, also after a restart, and an admin lists and closes `a`'s sessions.
#[test]
fn one_token_cannot_exhaust_the_session_table() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path());
    let mut opened = 0;
    let mut refusal = None;
    for _ in 0..MAX_TRIES {
        match server.open_session("a") {
            (200, _) => opened += 1,
            (status, body) => {
                refusal = Some((status, body));
                break;
            }
        }
    }
    let (status, body) =
        refusal.unwrap_or_else(|| panic!("a opened {opened} sessions, none refused"));
    assert_eq!((status, code(&body)), (429, "resource_exhausted"), "{body}");
    assert!(body.to_string().contains("max_sessions"), "{body}");
    assert_eq!(opened, MAX_SESSIONS);
    for other in ["b", "adm", "ops"] {
        assert_eq!(server.open_session(other).0, 200, "{other} opens a session");
    }

    // Across a restart: the quota holds (a's sessions are still open), others open.
    server.stop();
    let server = Server::start(dir.path());
    assert_eq!(server.open_session("a").0, 429, "a is still at its quota");
    for other in ["b", "adm", "ops"] {
        assert_eq!(
            server.open_session(other).0,
            200,
            "{other} after the restart"
        );
    }

    // The admin API: ops sees a's sessions by handle (never the id) and closes one.
    let (status, list) = server.call("ops", "GET", "/v1/admin/sessions", None);
    assert_eq!(status, 200, "{list}");
    let of_a: Vec<&Value> = list["sessions"]
        .as_array()
        .expect("sessions")
        .iter()
        .filter(|s| s["principal"] == "a")
        .collect();
    assert_eq!(of_a.len(), MAX_SESSIONS);
    let handle = of_a[0]["handle"].as_str().expect("handle");
    assert_eq!(handle.len(), 16);
    // `adm` is limited to `a:`: a's empty sessions are none of its business.
    let (status, mine) = server.call("adm", "GET", "/v1/admin/sessions", None);
    assert_eq!(status, 200);
    assert!(
        mine["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["principal"] == "adm"),
        "{mine}"
    );
    let path = format!("/v1/admin/sessions/{handle}");
    assert_eq!(server.call("adm", "DELETE", &path, None).0, 404);
    assert_eq!(
        server.call("a", "DELETE", &path, None).0,
        403,
        "clients are not admins"
    );
    let (status, closed) = server.call("ops", "DELETE", &path, None);
    assert_eq!(
        (status, closed["closed"].as_bool()),
        (200, Some(true)),
        "{closed}"
    );
    assert_eq!(server.open_session("a").0, 200, "a has room for one again");

    // The same through the CLI: `fencelock sessions ls --json` and `close HANDLE`.
    let cli = |args: &[&str]| {
        let url = format!("http://{}", server.addr);
        let out = std::process::Command::new(support::BIN)
            .args(args)
            .args(["--server", &url, "--token", &secret("ops")])
            .output()
            .expect("run the CLI");
        assert!(out.status.success(), "{args:?}: {out:?}");
        String::from_utf8(out.stdout).expect("UTF-8")
    };
    let listed: Value = serde_json::from_str(&cli(&["sessions", "ls", "--json"])).expect("JSON");
    let other = listed["sessions"]
        .as_array()
        .expect("sessions")
        .iter()
        .find(|s| s["principal"] == "a")
        .and_then(|s| s["handle"].as_str())
        .expect("one of a's sessions")
        .to_owned();
    assert!(
        cli(&["sessions", "ls"]).contains(&other),
        "the table lists it"
    );
    let closed = cli(&["sessions", "close", &other]);
    assert!(closed.contains("closed"), "{closed}");
    let audit = server.text("reader", "/v1/audit?limit=1000");
    assert!(
        audit.contains("\"actor\":\"ops\""),
        "the close names ops: {audit}"
    );

    println!(
        "ATTACK 2: token a opened sessions until refused ({opened} opened, quota {MAX_SESSIONS}), then a restart -> a refused 429 resource_exhausted (max_sessions) before and after the restart; b and both admins still opened sessions; an admin listed a's {MAX_SESSIONS} sessions by handle and closed one (HTTP and `fencelock sessions ls/close`)"
    );
}

/// Item 3: token `c` tries to keep alive, attach to and close `a`'s session, whose
/// id it has seen nowhere (readers see handles only); `a`'s locks stay held, and
/// every audit entry of a change names its actor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_are_not_bearer_secrets_across_principals() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path());
    let url = format!("http://{}", server.addr);
    let mut reader_config = ServerConfig::new(url);
    reader_config.token = Some(secret("reader"));
    let reader = FencelockBackend::connect(reader_config)
        .await
        .expect("connect");
    let mut events = reader.watch("").await.expect("watch");

    let (status, opened) = server.open_session("a");
    assert_eq!(status, 200, "{opened}");
    let id = opened["session"].as_str().expect("id").to_owned();
    let handle = opened["handle"].as_str().expect("handle").to_owned();
    for lock in ["a:1", "a:2"] {
        let (status, g) = server.call(
            "a",
            "POST",
            "/v1/acquire",
            Some(json!({"name": lock, "session": id})),
        );
        assert_eq!(status, 200, "{g}");
        assert_eq!(
            g["session"],
            id.as_str(),
            "the owner's own grant carries the id"
        );
    }

    // What readers see: handles, never the id.
    let views = server.text("reader", "/v1/locks");
    let one = server.text("reader", "/v1/locks/a:1");
    assert!(views.contains(&handle) && one.contains(&handle), "{views}");
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while seen.len() < 2 {
        let left = deadline.saturating_duration_since(Instant::now());
        let event = tokio::time::timeout(left, events.next())
            .await
            .expect("two grant events within 30 s")
            .expect("watch")
            .expect("event");
        seen.push(event.session.clone().unwrap_or_default());
    }
    assert_eq!(
        seen,
        [handle.clone(), handle.clone()],
        "watch events show the handle"
    );

    // The attack: c with a's session id (as if it had leaked anyway).
    let missing = "0123456789abcdef0123456789abcdef";
    let mut refused = Vec::new();
    for (what, method, path, body) in [
        (
            "keepalive",
            "POST",
            format!("/v1/sessions/{id}/keepalive"),
            None,
        ),
        (
            "attach c:evil",
            "POST",
            "/v1/acquire".to_owned(),
            Some(json!({"name": "c:evil", "session": id})),
        ),
        ("close", "DELETE", format!("/v1/sessions/{id}"), None),
    ] {
        let (status, body) = server.call("c", method, &path, body.clone());
        let probe = path.replace(&id, missing);
        let probe_body = body_for_probe(what, missing);
        let (missing_status, missing_reply) = server.call("c", method, &probe, probe_body);
        assert_eq!(
            (status, code(&body)),
            (404, "session_not_found"),
            "{what}: {body}"
        );
        assert_eq!(
            (missing_status, code(&missing_reply)),
            (status, code(&body)),
            "{what}: a foreign session answers like a missing one"
        );
        refused.push(format!("{what} {status}"));
    }
    // a's locks survived c's attempts; c:evil was never taken.
    let (status, lock) = server.call("reader", "GET", "/v1/locks/a:1", None);
    assert_eq!(status, 200, "a:1 is still held: {lock}");
    assert_eq!(lock["holders"].as_array().map(Vec::len), Some(1));
    assert_eq!(
        server.call("reader", "GET", "/v1/locks/c:evil", None).0,
        404
    );

    // Audit: no id anywhere, every entry of a change names its actor.
    assert_eq!(
        server
            .call("a", "DELETE", &format!("/v1/sessions/{id}"), None)
            .0,
        200
    );
    let (status, audit) = server.call("reader", "GET", "/v1/audit?limit=1000", None);
    assert_eq!(status, 200);
    assert!(
        !audit.to_string().contains(&id),
        "the audit log leaks the id: {audit}"
    );
    let entries = audit["entries"].as_array().expect("entries");
    assert!(entries.len() >= 5, "grants, releases, session end: {audit}");
    for e in entries {
        assert!(e["actor"].is_string(), "entry without an actor: {e}");
    }
    assert!(
        entries.iter().any(|e| e["kind"] == "session_ended"
            && e["actor"] == "a"
            && e["session"] == handle.as_str()),
        "{audit}"
    );
    assert!(!server.text("reader", "/v1/locks").contains(&id));

    println!(
        "ATTACK 3: token c (prefix c:) used token a's session id: {} -> each 404 session_not_found, same as a missing session; a's 2 locks stayed held; lock views, watch events and {} audit entries showed the session's 16-hex handle, never its id; every audit entry named its actor",
        refused.join(", "),
        entries.len()
    );
}

fn body_for_probe(what: &str, missing: &str) -> Option<Value> {
    (what == "attach c:evil").then(|| json!({"name": "c:evil", "session": missing}))
}

/// Item 7: token `a` queues acquires and acquires distinct locks until refused;
/// `b` still acquires.
#[test]
fn one_token_cannot_fill_the_lock_table() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path());
    let acquire = |token: &str, name: &str, wait_ms: u64| {
        let body = json!({"name": name, "ttl_ms": 600_000, "wait_ms": wait_ms});
        server.call(token, "POST", "/v1/acquire", Some(body))
    };
    assert_eq!(acquire("a", "a:0", 0).0, 200);
    // Queued acquires (a queues behind itself: it may touch `a:` only), each on its
    // own connection, until the queue quota; they time out after 3 s.
    std::thread::scope(|scope| {
        let waiting: Vec<_> = (0..MAX_WAITERS)
            .map(|_| scope.spawn(|| acquire("a", "a:0", 3_000)))
            .collect();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (_, lock) = server.call("reader", "GET", "/v1/locks/a:0", None);
            if lock["waiters"] == MAX_WAITERS {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the waiters never queued: {lock}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let (status, body) = acquire("a", "a:0", 3_000);
        assert_eq!((status, code(&body)), (429, "resource_exhausted"), "{body}");
        assert!(body.to_string().contains("max_waiters"), "{body}");

        // Distinct locks: held + queued reach max_held_locks, then refusal.
        let mut granted = 1;
        let mut refusal = None;
        for i in 1..MAX_TRIES {
            match acquire("a", &format!("a:{i}"), 0) {
                (200, _) => granted += 1,
                (status, body) => {
                    refusal = Some((status, body));
                    break;
                }
            }
        }
        let (status, body) =
            refusal.unwrap_or_else(|| panic!("a acquired {granted} locks, none refused"));
        assert_eq!((status, code(&body)), (429, "resource_exhausted"), "{body}");
        assert!(body.to_string().contains("max_held_locks"), "{body}");
        assert_eq!(granted + MAX_WAITERS, MAX_HELD);
        // b is not affected.
        for i in 0..MAX_HELD {
            assert_eq!(
                acquire("b", &format!("b:{i}"), 0).0,
                200,
                "b acquires b:{i}"
            );
        }
        for w in waiting {
            assert_eq!(
                w.join().expect("waiter").0,
                409,
                "the queued acquires time out"
            );
        }
        println!(
            "ATTACK 7: token a queued {MAX_WAITERS} acquires and acquired {granted} distinct locks, then tried one more of each -> refused 429 resource_exhausted (max_waiters, then max_held_locks: queued acquires count as held); token b still acquired {MAX_HELD} locks"
        );
    });
}
