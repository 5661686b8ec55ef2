//! Issue 19's connection attacks against the real binary, scaled down to run in
//! seconds: connections that never authenticate (item 1), one address opening
//! many, idle connections, and a failed `flw/1` re-Hello (item 8). Each attack test
//! prints one `ATTACK <item>: <what was tried> -> <outcome>` line (collected into
//! `docs/security.md` with `cargo test -p fencelock-cli --test it attacks_connections::
//! -- --nocapture`).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use fencelock::{AcquireSpec, FencelockBackend, LockBackend, ServerConfig};
use fencelock_proto::wire::{self, Hello, Request, Response};
use fencelock_proto::AcquireRequest;

use crate::attack;
use crate::support;

/// Longest any wait in these tests may take before the test fails instead of hanging.
const BOUND: Duration = Duration::from_secs(20);

/// A client token for `a:` (its hash is in the config) and its config entry.
const CLIENT: &str = "attack-test-client-token";
/// A reader over every lock: `/metrics` counts every tenant, so only such a token
/// may read it.
const METRICS: &str = "attack-test-metrics-token";

fn client_entry() -> String {
    format!(
        "[[auth.tokens]]\nname = \"client-a\"\nrole = \"client\"\nprefixes = [\"a:\"]\n\
         sha256 = \"{}\"\n\
         [[auth.tokens]]\nname = \"metrics\"\nrole = \"reader\"\nprefixes = [\"\"]\n\
         sha256 = \"{}\"\n",
        fencelock_server::auth::hash_token(CLIENT),
        fencelock_server::auth::hash_token(METRICS)
    )
}

use attack::Server;

impl Server {
    /// `fencelock serve` on a random loopback port with `config` as its config file.
    fn start(config: &str) -> Server {
        attack::serve(config)
    }

    /// One HTTP/1.1 request on a fresh connection: status and body.
    fn http(&self, method: &str, path: &str, token: Option<&str>, body: &str) -> (u16, String) {
        http_on(
            TcpStream::connect(self.addr).expect("connect"),
            method,
            path,
            token,
            body,
        )
    }

    /// An acquire over HTTP with the client token: the status.
    fn acquire_http(&self, name: &str) -> u16 {
        let body = format!("{{\"name\":\"{name}\",\"ttl_ms\":60000}}");
        let (status, text) = self.http("POST", "/v1/acquire", Some(CLIENT), &body);
        assert!(status == 200 || status == 503, "{status} {text}");
        status
    }

    /// A metric's value (with its labels, if any, as in `name{reason="x"}`).
    fn metric(&self, name: &str) -> f64 {
        let (status, text) = self.http("GET", "/metrics", Some(METRICS), "");
        assert_eq!(status, 200, "{text}");
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| {
                let (n, v) = l.rsplit_once(' ')?;
                (n == name).then(|| v.trim().parse().ok()).flatten()
            })
            .unwrap_or_else(|| panic!("no metric {name} in:\n{text}"))
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

fn http_on(
    mut s: TcpStream,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> (u16, String) {
    s.set_read_timeout(Some(BOUND)).unwrap();
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{auth}\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(request.as_bytes()).expect("send the request");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP answer: {out:?}"));
    (status, out)
}

/// An acquire over `flw/1` with the client library and the client token.
fn acquire_wire(server: &Server, name: &str) -> Result<u64, fencelock::Error> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let mut config = ServerConfig::new(server.url());
        config.token = Some(CLIENT.to_owned());
        let backend = FencelockBackend::connect(config).await?;
        let lease = backend
            .acquire(&AcquireSpec::new(name, Duration::from_secs(60)))
            .await?;
        Ok(lease.fence)
    })
}

fn frames(requests: &[(u64, Request)]) -> Vec<u8> {
    let mut out = wire::CLIENT_MAGIC.to_vec();
    for (id, request) in requests {
        wire::encode_request(&mut out, *id, request);
    }
    out
}

/// A `flw/1` connection that never says Hello: the magic and a ping.
fn wire_without_hello(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.write_all(&frames(&[(1, Request::Ping)])).expect("send");
    s
}

/// An idle HTTP/2 connection that never sends a request: the client preface and an
/// empty SETTINGS frame.
fn http2_without_request(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connect");
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend_from_slice(&[0, 0, 0, 0x4, 0, 0, 0, 0, 0]);
    s.write_all(&hello).expect("send the preface");
    s
}

/// Whether the server has closed `s` (reads what is there without waiting).
fn closed_now(s: &mut TcpStream) -> bool {
    s.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 4096];
    let closed = loop {
        match s.read(&mut buf) {
            Ok(0) => break true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break false,
            Err(_) => break true,
        }
    };
    s.set_nonblocking(false).unwrap();
    closed
}

/// Reads until the server closes `s`: everything read, and whether it closed
/// within `within`.
fn read_until_closed(s: &mut TcpStream, within: Duration) -> (Vec<u8>, bool) {
    let deadline = Instant::now() + within;
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return (out, false);
        }
        s.set_read_timeout(Some(left)).unwrap();
        match s.read(&mut buf) {
            Ok(0) => return (out, true),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return (out, true),
            Err(_) => return (out, false),
        }
    }
}

/// The `flw/1` answers in `bytes` (after the server's magic).
fn wire_answers(bytes: &[u8]) -> Vec<(u64, Response)> {
    let mut rest = bytes.strip_prefix(&wire::SERVER_MAGIC[..]).unwrap_or(bytes);
    let mut answers = Vec::new();
    while let Ok(Some(n)) = wire::frame_len(rest, wire::MAX_FRAME_BYTES) {
        answers.push(wire::decode_response(&rest[..n]).expect("a valid answer"));
        rest = &rest[n..];
    }
    answers
}

/// Raises this process's soft limit of open files to at least `min` (its children,
/// the server among them, inherit it).
fn raise_open_files(min: u64) {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a struct we own.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
        if limit.rlim_cur < min {
            assert!(
                limit.rlim_max >= min,
                "hard limit of open files below {min}"
            );
            limit.rlim_cur = min;
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &limit), 0);
        }
    }
}

/// The config of the item 1 attacks: tokens on, a small unauthenticated pool, an
/// authenticated pool smaller than the attack, and an auth deadline longer than the
/// test (so only eviction can be what lets clients in).
fn item1_config(max_connections: usize) -> String {
    format!(
        "[limits]\nmax_connections = {max_connections}\nmax_unauthenticated_connections = 64\n\
         auth_timeout_ms = 60000\n\n{}",
        client_entry()
    )
}

/// While the attacker's connections are held: an authenticated acquire over HTTP
/// and over `flw/1`, and `/healthz`, all succeed. Returns how many attacker
/// connections the server closed.
fn clients_get_in(server: &Server, attackers: &mut [TcpStream], what: &str) -> usize {
    assert_eq!(
        server.http("GET", "/healthz", None, "").0,
        200,
        "/healthz with {what}"
    );
    assert_eq!(
        server.acquire_http("a:http"),
        200,
        "an authenticated HTTP acquire was refused with {what}"
    );
    let fence = acquire_wire(server, "a:wire");
    assert!(fence.is_ok(), "flw/1 acquire with {what}: {fence:?}");
    attackers
        .iter_mut()
        .map(closed_now)
        .filter(|closed| *closed)
        .count()
}

/// Regression (issue 19, item 1): `flw/1` connections that never send Hello (and
/// ping to stay alive) took a `max_connections` slot each, so every authenticated
/// request and `/healthz` answered 503 while they were held.
#[test]
fn connections_that_never_say_hello_cannot_lock_clients_out() {
    const ATTACKERS: usize = 600;
    const MAX_CONNECTIONS: usize = 512;
    raise_open_files(ATTACKERS as u64 + 500);
    let server = Server::start(&item1_config(MAX_CONNECTIONS));
    let mut attackers: Vec<TcpStream> = (0..ATTACKERS)
        .map(|_| wire_without_hello(server.addr))
        .collect();
    // They keep pinging.
    for s in &mut attackers {
        let _ = s.write_all(&frames(&[(2, Request::Ping)])[wire::CLIENT_MAGIC.len()..]);
    }
    let closed = clients_get_in(&server, &mut attackers, "600 flw/1 connections held");
    let unauthenticated = server.metric("fencelock_unauthenticated_connections");
    assert!(unauthenticated <= 64.0, "{unauthenticated}");
    let evicted =
        server.metric("fencelock_connections_closed_total{reason=\"unauthenticated_evicted\"}");
    assert!(evicted >= (ATTACKERS - 64) as f64, "{evicted}");
    assert!(
        closed >= ATTACKERS - 64 - 3,
        "only {closed} attackers closed"
    );
    println!(
        "ATTACK 1: {ATTACKERS} flw/1 connections that never send Hello (pinging) against \
         max_unauthenticated_connections=64, max_connections={MAX_CONNECTIONS} -> HTTP acquire \
         200, flw/1 acquire granted, /healthz 200; {closed} attacker connections closed \
         ({evicted} evicted oldest-first)"
    );
}

/// Regression (issue 19, item 1): HTTP/2 connections that never send a request
/// did the same.
#[test]
fn http2_connections_without_a_request_cannot_lock_clients_out() {
    const ATTACKERS: usize = 300;
    const MAX_CONNECTIONS: usize = 256;
    raise_open_files(ATTACKERS as u64 + 500);
    let server = Server::start(&item1_config(MAX_CONNECTIONS));
    let mut attackers: Vec<TcpStream> = (0..ATTACKERS)
        .map(|_| http2_without_request(server.addr))
        .collect();
    let closed = clients_get_in(&server, &mut attackers, "300 idle HTTP/2 connections held");
    let evicted =
        server.metric("fencelock_connections_closed_total{reason=\"unauthenticated_evicted\"}");
    assert!(evicted >= (ATTACKERS - 64) as f64, "{evicted}");
    println!(
        "ATTACK 1: {ATTACKERS} HTTP/2 connections sending only the preface and SETTINGS against \
         max_unauthenticated_connections=64, max_connections={MAX_CONNECTIONS} -> HTTP acquire \
         200, flw/1 acquire granted, /healthz 200; {closed} attacker connections closed \
         ({evicted} evicted oldest-first)"
    );
}

/// A connection that keeps pinging (`flw/1`) or asking for `/healthz` (HTTP/1.1
/// keep-alive) but never authenticates is closed at `auth_timeout`.
#[test]
fn a_connection_that_never_authenticates_is_closed_at_the_auth_deadline() {
    let server = Server::start(&format!(
        "[limits]\nauth_timeout_ms = 1000\n\n{}",
        client_entry()
    ));
    let mut pinging = wire_without_hello(server.addr);
    let mut polling = TcpStream::connect(server.addr).unwrap();
    let opened = Instant::now();
    let healthz = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";
    let (mut pinging_open, mut polling_open) = (true, true);
    while (pinging_open || polling_open) && opened.elapsed() < BOUND {
        pinging_open = pinging_open
            && pinging
                .write_all(&frames(&[(3, Request::Ping)])[wire::CLIENT_MAGIC.len()..])
                .is_ok()
            && !closed_now(&mut pinging);
        polling_open =
            polling_open && polling.write_all(healthz).is_ok() && !closed_now(&mut polling);
        std::thread::sleep(Duration::from_millis(100));
    }
    let took = opened.elapsed();
    assert!(
        !pinging_open && !polling_open,
        "still open after {took:?}: flw/1 {pinging_open}, HTTP {polling_open}"
    );
    assert!(took >= Duration::from_millis(900), "closed early: {took:?}");
    let timed_out = server.metric("fencelock_connections_closed_total{reason=\"auth_timeout\"}");
    assert!(timed_out >= 2.0, "{timed_out}");
    println!(
        "ATTACK 1: a flw/1 connection pinging and an HTTP/1.1 connection asking for /healthz \
         every 100 ms, neither authenticating, auth_timeout=1s -> both closed within {:.1} s",
        took.as_secs_f64()
    );
}

/// `max_connections_per_ip` refuses the next connection from an address that has
/// that many open, authenticated or not, while another address is still served.
#[test]
fn one_address_cannot_take_more_than_its_share() {
    const PER_IP: usize = 4;
    let server = Server::start(&format!(
        "[limits]\nmax_connections_per_ip = {PER_IP}\n\n{}",
        client_entry()
    ));
    // One authenticated (admitted) connection and three that are not.
    let mut held = vec![TcpStream::connect(server.addr).unwrap()];
    let request =
        format!("GET /v1/locks HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {CLIENT}\r\n\r\n");
    held[0].write_all(request.as_bytes()).unwrap();
    let mut answer = [0u8; 12];
    held[0].set_read_timeout(Some(BOUND)).unwrap();
    held[0].read_exact(&mut answer).unwrap();
    assert_eq!(&answer, b"HTTP/1.1 200");
    held.extend((1..PER_IP).map(|_| http2_without_request(server.addr)));

    let (status, text) = server.http("GET", "/healthz", None, "");
    assert_eq!(
        status,
        503,
        "connection {} from 127.0.0.1: {text}",
        PER_IP + 1
    );
    assert!(text.contains("from one address"), "{text}");
    let other = {
        let socket = std::net::SocketAddr::from(([127, 0, 0, 2], 0));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let stream = runtime.block_on(async {
            let s = tokio::net::TcpSocket::new_v4().unwrap();
            s.bind(socket)
                .expect("bind 127.0.0.2 (a loopback alias on Linux)");
            s.connect(server.addr).await.unwrap()
        });
        let stream = stream.into_std().unwrap();
        stream.set_nonblocking(false).unwrap();
        stream
    };
    let (status, text) = http_on(other, "GET", "/healthz", None, "");
    assert_eq!(status, 200, "from 127.0.0.2: {text}");
    // Closing them frees the address's share (the metrics come from 127.0.0.1 too).
    drop(held);
    let deadline = Instant::now() + BOUND;
    while server.http("GET", "/healthz", None, "").0 != 200 {
        assert!(Instant::now() < deadline, "127.0.0.1 still refused");
        std::thread::sleep(Duration::from_millis(20));
    }
    // At least the one above (the polling may have been refused too).
    assert!(server.metric("fencelock_connections_refused_per_ip_total") >= 1.0);
    println!(
        "ATTACK 1: {} connections from 127.0.0.1 against max_connections_per_ip={PER_IP} -> \
         connection {} refused with 503, 127.0.0.2 still served",
        PER_IP + 1,
        PER_IP + 1
    );
}

/// An HTTP/2 connection with no request in flight is closed gracefully (GOAWAY)
/// after `idle_timeout`, and so is an authenticated `flw/1` connection that only
/// pings; a watch stream on another connection is a request in flight and is not
/// cut.
#[test]
fn idle_connections_are_closed_but_watches_are_not() {
    let server = Server::start(&format!(
        "[limits]\nidle_timeout_ms = 1000\nauth_timeout_ms = 60000\n\n{}",
        client_entry()
    ));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut config = ServerConfig::new(server.url());
    config.token = Some(CLIENT.to_owned());
    let (backend, mut watch) = runtime.block_on(async {
        let backend = FencelockBackend::connect(config).await.unwrap();
        let watch = backend.watch("a:").await.unwrap();
        (backend, watch)
    });
    let mut idle = http2_without_request(server.addr);
    let opened = Instant::now();
    let (bytes, closed) = read_until_closed(&mut idle, Duration::from_secs(10));
    let took = opened.elapsed();
    assert!(
        closed,
        "an idle HTTP/2 connection still open after {took:?}"
    );
    assert!(took >= Duration::from_millis(900), "closed early: {took:?}");
    // The server's frames: its SETTINGS, the ack of ours, then GOAWAY (type 7).
    let mut at = 0;
    let mut kinds = Vec::new();
    while at + 9 <= bytes.len() {
        let len = u32::from_be_bytes([0, bytes[at], bytes[at + 1], bytes[at + 2]]) as usize;
        kinds.push(bytes[at + 3]);
        at += 9 + len;
    }
    assert!(
        kinds.contains(&0x7),
        "closed without GOAWAY: frames {kinds:?}"
    );
    // An authenticated flw/1 connection that only pings (pings are no requests).
    let mut pinging = TcpStream::connect(server.addr).unwrap();
    let hello = Request::Hello(Hello {
        token: CLIENT.to_owned(),
    });
    pinging.write_all(&frames(&[(1, hello)])).unwrap();
    let opened = Instant::now();
    let mut pinging_open = true;
    while pinging_open && opened.elapsed() < BOUND {
        std::thread::sleep(Duration::from_millis(100));
        pinging_open = pinging
            .write_all(&frames(&[(2, Request::Ping)])[wire::CLIENT_MAGIC.len()..])
            .is_ok()
            && !closed_now(&mut pinging);
    }
    let pinged = opened.elapsed();
    assert!(
        !pinging_open,
        "a pinging flw/1 connection open after {pinged:?}"
    );
    assert!(
        pinged >= Duration::from_millis(900),
        "closed early: {pinged:?}"
    );
    // The watch has been open longer than idle_timeout and still delivers.
    assert_eq!(server.acquire_http("a:watched"), 200);
    let event = runtime.block_on(async { tokio::time::timeout(BOUND, watch.next()).await });
    let event = event.expect("the watch delivers in time");
    assert!(matches!(event, Ok(Some(_))), "the watch was cut: {event:?}");
    assert!(server.metric("fencelock_connections_closed_total{reason=\"idle\"}") >= 1.0);
    drop(backend);
    println!(
        "ATTACK 1: an HTTP/2 connection sending only the preface and SETTINGS, \
         and an authenticated flw/1 connection that only pings, idle_timeout=1s -> closed \
         after {:.1} s (with GOAWAY) and {:.1} s; a watch stream open longer on another \
         connection still delivered",
        took.as_secs_f64(),
        pinged.as_secs_f64()
    );
}

/// Regression (issue 19, item 8): a failed re-Hello on a `flw/1` connection kept
/// the previous principal, so whatever followed ran with the earlier token's
/// rights. Now it drops the principal and the connection closes.
#[test]
fn a_failed_re_hello_drops_the_principal() {
    let server = Server::start(&client_entry());
    let mut s = TcpStream::connect(server.addr).unwrap();
    let hello = |token: &str| {
        Request::Hello(Hello {
            token: token.to_owned(),
        })
    };
    let acquire = Request::Acquire(AcquireRequest {
        name: "a:after-rehello".to_owned(),
        ttl_ms: Some(60_000),
        ..AcquireRequest::default()
    });
    s.write_all(&frames(&[
        (1, hello(CLIENT)),
        (2, hello("not-a-token")),
        (3, acquire),
    ]))
    .unwrap();
    let (bytes, closed) = read_until_closed(&mut s, BOUND);
    let answers = wire_answers(&bytes);
    assert_eq!(
        answers.first(),
        Some(&(1, Response::Welcome)),
        "{answers:?}"
    );
    let refused = answers.iter().find(|(id, _)| *id == 2);
    assert!(
        matches!(refused, Some((_, Response::Error(e))) if e.code == "unauthenticated"),
        "{answers:?}"
    );
    assert!(
        !answers.iter().any(|(_, r)| matches!(r, Response::Grant(_))),
        "the acquire after a failed re-Hello ran as the earlier token: {answers:?}"
    );
    assert!(closed, "the connection stayed open: {answers:?}");
    // The lock is free: the acquire did not run.
    assert_eq!(server.acquire_http("a:after-rehello"), 200);
    println!(
        "ATTACK 8: flw/1 Hello with a client token, then Hello with an unknown token, then \
         an acquire, on one connection -> re-Hello refused (unauthenticated), the earlier \
         principal dropped, the acquire not run, the connection closed"
    );
}

/// Runs `openssl ARGS` (split at spaces) in `dir`: the Debian package openssl, as
/// the TLS test CA uses.
fn openssl(dir: &std::path::Path, args: &str) {
    let out = std::process::Command::new("openssl")
        .args(args.split_whitespace())
        .current_dir(dir)
        .output()
        .expect("run openssl (install the Debian package openssl)");
    assert!(out.status.success(), "openssl {args}: {out:?}");
}

/// Regression (issue 19, item 8): an expired TLS certificate was loaded without a
/// word, and clients then failed their handshakes with nothing in the server's log.
#[test]
fn an_expired_certificate_is_loaded_with_a_warning_naming_its_not_after() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    // A self-signed X.509 v3 certificate (rustls refuses v1) whose notAfter is a day
    // before its notBefore.
    std::fs::write(dir.path().join("ext.cnf"), "subjectAltName=DNS:localhost\n").unwrap();
    openssl(
        dir.path(),
        "req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout key.pem \
         -out fresh.pem -days 1 -subj /CN=localhost",
    );
    openssl(
        dir.path(),
        "x509 -x509toreq -in fresh.pem -signkey key.pem -out req.pem",
    );
    openssl(
        dir.path(),
        "x509 -req -in req.pem -signkey key.pem -days -1 -extfile ext.cnf -out expired.pem",
    );
    let mut child = std::process::Command::new(support::BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--log-format", "json"])
        .arg("--tls-cert")
        .arg(dir.path().join("expired.pem"))
        .arg("--tls-key")
        .arg(dir.path().join("key.pem"))
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn fencelock serve");
    let stderr = child.stderr.take().unwrap();
    let mut log = Vec::new();
    for line in std::io::BufReader::new(stderr).lines().take(100) {
        let line = line.expect("read stderr");
        let serving = line.contains("\"listen\"");
        log.push(line);
        if serving {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    let warning = log
        .iter()
        .find(|l| l.contains("EXPIRED"))
        .unwrap_or_else(|| panic!("no warning about the expired certificate in {log:#?}"));
    let v: serde_json::Value = serde_json::from_str(warning).unwrap();
    assert_eq!(v["level"], "WARN", "{warning}");
    let not_after = v["fields"]["not_after"]
        .as_str()
        .or(v["not_after"].as_str())
        .unwrap_or_else(|| panic!("no not_after field: {warning}"));
    assert!(
        not_after.len() == 20 && not_after.ends_with('Z') && not_after.contains('T'),
        "{not_after}"
    );
    assert!(
        log.last().is_some_and(|l| l.contains("\"listen\"")),
        "the server still starts: {log:#?}"
    );
    println!(
        "ATTACK 8: fencelock serve with a TLS certificate that expired (notAfter \
         {not_after}) -> started with a WARN log line naming its notAfter"
    );
}
