//! Issue 19 item 4 against the real binary: a reader opens 100 dashboard live
//! streams while 500 locks are held. Each stream used to re-render the whole lock
//! table after every event batch and every second (acquires fell from 23.3k/s to
//! 395/s with 100 streams). Now the token's `max_streams` quota refuses the streams
//! beyond it (429 `resource_exhausted`), and the streams it allows share one
//! renderer: `fencelock_dashboard_renders_total` grows with the changes, not with
//! the viewers. Prints one `ATTACK 4: … -> …` line.

use crate::attack;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use attack::{http, metric, serve, token};
use serde_json::json;

const ADMIN: &str = "flk_streams_admin_secret";
const READER: &str = "flk_streams_reader_secret";
/// The reader's own stream quota.
const MAX_STREAMS: usize = 8;
const STREAMS: usize = 100;
const LOCKS: usize = 500;
const CHANGES: usize = 20;

/// Opens `/ui/stream` as the reader and reads the answer's head: the status, and
/// the connection if the stream was opened (kept open by the caller).
fn open_stream(addr: std::net::SocketAddr) -> (u16, Option<TcpStream>) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "GET /ui/stream HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {READER}\r\n\r\n"
    )
    .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && head.len() < 8192 {
        match s.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => break,
        }
    }
    let status = String::from_utf8_lossy(&head)
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, (status == 200).then_some(s))
}

/// Runs `fencelock watch` (gRPC) as the reader for at most 10 s: `refused …` if it
/// ended with `resource_exhausted`, else what it did.
fn watch_outcome(addr: std::net::SocketAddr) -> String {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_fencelock"))
        .args([
            "watch",
            "--server",
            &format!("http://{addr}"),
            "--token",
            READER,
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn fencelock watch");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            let mut stderr = String::new();
            let _ = child.stderr.take().unwrap().read_to_string(&mut stderr);
            return if stderr.contains("resource_exhausted") || stderr.contains("max_streams") {
                format!("refused ({status})")
            } else {
                format!("ended otherwise ({status}): {stderr}")
            };
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return "opened (not refused)".to_owned();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_reader_with_100_dashboard_streams_is_held_to_its_quota_and_one_render_per_change() {
    let config = format!(
        "{}{}",
        token("root", "admin", &[""], ADMIN, ""),
        token(
            "dashboards",
            "reader",
            &[""],
            READER,
            &format!("max_streams = {MAX_STREAMS}")
        )
    );
    let s = serve(&config);
    let admin = format!("Bearer {ADMIN}");
    let acquire = |name: String| {
        let a = http(
            s.addr,
            "POST",
            "/v1/acquire",
            &[
                ("Host", "localhost"),
                ("Authorization", &admin),
                ("Content-Type", "application/json"),
            ],
            &json!({"name": name, "ttl_ms": 600_000}).to_string(),
        );
        assert_eq!(a.status, 200, "{}", a.body);
    };
    for i in 0..LOCKS {
        acquire(format!("held:{i:04}"));
    }

    let mut open = Vec::new();
    let mut refused = 0;
    for _ in 0..STREAMS {
        match open_stream(s.addr) {
            (200, Some(stream)) => open.push(stream),
            (429, _) => refused += 1,
            (status, _) => panic!("a stream answered {status}"),
        }
    }
    // The quota counts gRPC watches too: with the dashboard streams at the quota, a
    // `fencelock watch` of the same token is refused.
    let watch = watch_outcome(s.addr);
    let renders_before = metric(s.addr, ADMIN, "fencelock_dashboard_renders_total");
    let started = Instant::now();
    for i in 0..CHANGES {
        acquire(format!("change:{i:02}"));
    }
    // Until a stream shows the last change (the renderer renders at most every
    // 250 ms, and every second), however long that takes on a loaded machine.
    let last = format!("change:{:02}", CHANGES - 1);
    let mut seen = Vec::new();
    let mut buf = [0u8; 16384];
    while !String::from_utf8_lossy(&seen).contains(&last) {
        match open[0].read(&mut buf) {
            Ok(n) if n > 0 => seen.extend_from_slice(&buf[..n]),
            other => panic!("the stream ended before it showed {last}: {other:?}"),
        }
    }
    let renders_after = metric(s.addr, ADMIN, "fencelock_dashboard_renders_total");
    let renders = renders_after
        .zip(renders_before)
        .map(|(after, before)| after - before);
    // One render per change at most, and one per second of the window.
    let bound = CHANGES as u64 + 2 + started.elapsed().as_secs();
    println!(
        "ATTACK 4: a reader (max_streams {MAX_STREAMS}) opened {STREAMS} dashboard streams \
         with {LOCKS} locks held, then {CHANGES} locks changed -> {} streams opened, {refused} \
         refused with 429 resource_exhausted, a gRPC watch {watch}; {} renders for {} \
         viewers (bound {bound})",
        open.len(),
        renders.map_or("no render counter:".to_owned(), |r| r.to_string()),
        open.len()
    );
    assert_eq!(open.len(), MAX_STREAMS);
    assert_eq!(refused, STREAMS - MAX_STREAMS);
    assert!(watch.starts_with("refused"), "{watch}");
    let renders = renders.expect("fencelock_dashboard_renders_total is exported");
    assert!(renders <= bound, "{renders} renders for {CHANGES} changes");

    // Closed streams give their slots back (the server notices at its next write,
    // at most a second later).
    drop(open);
    let deadline = Instant::now() + Duration::from_secs(15);
    let reopened = loop {
        match open_stream(s.addr) {
            (200, Some(stream)) => break stream,
            (429, _) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(200)),
            (status, _) => panic!("after closing every stream, a new one answered {status}"),
        }
    };
    drop(reopened);
}
