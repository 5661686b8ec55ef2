//! The real binary's secure defaults: no tokens means loopback only (a non-loopback
//! address is refused with exit code 2 unless `--insecure`), and a token made by
//! `fencelock token new` works when its printed entry is put into the config.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_fencelock");

fn wait(child: &mut Child, within: Duration) -> ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("fencelock did not exit within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A running `fencelock serve`, its loopback address and its log lines so far.
struct Serving {
    child: Child,
    addr: SocketAddr,
    log: Vec<Value>,
}

impl Drop for Serving {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `fencelock serve ARGS --log-format json` and waits for its "serving" line.
fn serve(data_dir: &Path, args: &[&str]) -> Serving {
    let mut child = Command::new(BIN)
        .arg("serve")
        .args(args)
        .args(["--log-format", "json", "--data-dir"])
        .arg(data_dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn fencelock serve");
    let stderr = child.stderr.take().expect("piped stderr");
    let mut lines = BufReader::new(stderr).lines();
    let mut log = Vec::new();
    let addr: SocketAddr = loop {
        let line = lines
            .next()
            .expect("the server exited before it was serving")
            .expect("read stderr");
        let v: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
        log.push(v.clone());
        if let Some(listen) = v.get("listen").and_then(Value::as_str) {
            break listen.parse().expect("listen address");
        }
    };
    // The lines logged right after the serving line (the auth notice).
    if let Some(Ok(line)) = lines.next() {
        log.push(serde_json::from_str(&line).unwrap_or(Value::Null));
    }
    std::thread::spawn(move || for _ in lines {});
    let addr = SocketAddr::from(([127, 0, 0, 1], addr.port()));
    Serving { child, addr, log }
}

fn http(addr: SocketAddr, method: &str, path: &str, token: Option<&str>, body: &str) -> u16 {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\n{auth}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn non_loopback_without_tokens_refuses_to_start_unless_insecure() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(BIN)
        .args(["serve", "--listen", "0.0.0.0:0", "--data-dir"])
        .arg(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = wait(&mut child, Duration::from_secs(20));
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("without authentication"), "{stderr}");
    assert!(stderr.contains("--insecure"), "{stderr}");

    let mut s = serve(dir.path(), &["--listen", "0.0.0.0:0", "--insecure"]);
    assert_eq!(http(s.addr, "GET", "/v1/locks", None, ""), 200);
    assert!(
        s.log
            .iter()
            .any(|l| l["level"] == "WARN"
                && l["message"].as_str().unwrap_or("").contains("--insecure")),
        "{:?}",
        s.log
    );
    let _ = Command::new("kill")
        .args(["-TERM", &s.child.id().to_string()])
        .status();
    assert!(wait(&mut s.child, Duration::from_secs(20)).success());
}

#[test]
fn loopback_without_tokens_says_authentication_is_off() {
    let dir = tempfile::tempdir().unwrap();
    let s = serve(dir.path(), &["--listen", "127.0.0.1:0"]);
    assert!(
        s.log.iter().any(|l| l["message"]
            .as_str()
            .unwrap_or("")
            .contains("authentication is off")),
        "{:?}",
        s.log
    );
    assert_eq!(http(s.addr, "GET", "/v1/locks", None, ""), 200);
}

/// `fencelock token new ARGS`: the token and the config entry it prints.
fn new_token(args: &[&str]) -> (String, String) {
    let out = Command::new(BIN)
        .args(["token", "new"])
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    let token = text
        .lines()
        .find(|l| l.starts_with("flk_"))
        .expect("the token is printed")
        .to_owned();
    let entry = text[text.find("[[auth.tokens]]").expect("the config entry")..].to_owned();
    assert!(!entry.contains(&token), "the config holds only the hash");
    (token, entry)
}

#[test]
fn a_new_token_works_once_its_entry_is_in_the_config() {
    let (token, entry) = new_token(&["--name", "ci", "--role", "client", "--prefix", "job:"]);
    let (admin, admin_entry) = new_token(&["--name", "ops", "--role", "admin", "--prefix", ""]);

    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("fencelock.toml");
    std::fs::write(
        &config,
        format!("listen = \"0.0.0.0:0\"\n{entry}\n{admin_entry}"),
    )
    .unwrap();
    let data = dir.path().join("data");
    // With a token configured, a non-loopback address needs no --insecure.
    let s = serve(&data, &["--config", config.to_str().unwrap()]);
    let acquire = |name: &str| format!("{{\"name\":\"{name}\",\"ttl_ms\":60000}}");
    assert_eq!(http(s.addr, "GET", "/v1/locks", None, ""), 401);
    assert_eq!(http(s.addr, "GET", "/v1/locks", Some("flk_wrong"), ""), 401);
    assert_eq!(http(s.addr, "GET", "/v1/locks", Some(&token), ""), 200);
    assert_eq!(
        http(
            s.addr,
            "POST",
            "/v1/acquire",
            Some(&token),
            &acquire("job:1")
        ),
        200
    );
    assert_eq!(
        http(
            s.addr,
            "POST",
            "/v1/acquire",
            Some(&token),
            &acquire("other:1")
        ),
        403
    );
    assert_eq!(http(s.addr, "GET", "/healthz", None, ""), 200);

    // `fencelock backup` needs the admin token.
    let server = format!("http://{}", s.addr);
    let out = dir.path().join("backup.flsnap");
    let backup = |token: Option<&str>| {
        let mut cmd = Command::new(BIN);
        cmd.args(["backup", "--server", &server, "--out"])
            .arg(&out)
            .env_remove("FENCELOCK_TOKEN");
        if let Some(token) = token {
            cmd.args(["--token", token]);
        }
        cmd.output().unwrap()
    };
    // 77 for both, as for the other client commands; the 401 is said as such.
    let refused = backup(Some(&token));
    assert_eq!(refused.status.code(), Some(77), "{refused:?}");
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("not allowed: "),
        "{refused:?}"
    );
    let refused = backup(None);
    assert_eq!(refused.status.code(), Some(77), "{refused:?}");
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        said.contains("not authenticated: ") && !said.contains("permission_denied"),
        "{refused:?}"
    );
    assert!(!out.exists());
    let done = backup(Some(&admin));
    assert!(done.status.success(), "{done:?}");
    assert!(out.exists());
}
