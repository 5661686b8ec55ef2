//! `fencelock serve` on damaged data: a checksum failure anywhere but a torn tail
//! (in the command log, a snapshot or the audit log) stops the server before it
//! serves, with exit status 1 and a message naming the file and offset; a torn
//! tail at the end of the newest segment is discarded with a warning and the
//! acknowledged state comes back.
//!
//! Damage that used to look like a clean end of the log (format version 1) stops
//! it too: a segment cut or zeroed at a record boundary, a deleted newest segment,
//! a deleted manifest, a data directory wiped except for its manifest.
//!
//! Offsets follow the log's documented format (version 2): a 56-byte segment
//! header, then records `[len u32][crc u32][payload]`, and a 32-byte seal (a
//! record with bit 30 of its length word set) ending every segment but the
//! newest; a snapshot has a 32-byte header.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_fencelock");

struct Server {
    child: Child,
    addr: SocketAddr,
    log: std::sync::mpsc::Receiver<String>,
}

fn serve_cmd(data_dir: &Path, config: Option<&Path>) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--log-format", "json"])
        .arg("--data-dir")
        .arg(data_dir);
    if let Some(config) = config {
        cmd.arg("--config").arg(config);
    }
    cmd
}

fn start(data_dir: &Path, config: Option<&Path>) -> Server {
    let mut child = serve_cmd(data_dir, config)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn fencelock serve");
    let (tx, log) = std::sync::mpsc::channel();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines
            .next()
            .expect("server exited before it was serving")
            .unwrap();
        let _ = tx.send(line.clone());
        let v: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
        if let Some(listen) = v.get("listen").and_then(Value::as_str) {
            break listen.parse().unwrap();
        }
    };
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    Server { child, addr, log }
}

impl Server {
    fn post(&self, path: &str, body: &str) -> (u16, String) {
        let mut s = TcpStream::connect(self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write!(
            s,
            "POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        let status = out.split_whitespace().nth(1).unwrap().parse().unwrap();
        (status, out)
    }

    fn acquire(&self, name: &str) -> u16 {
        self.post(
            "/v1/acquire",
            &format!(r#"{{"name":"{name}","ttl_ms":600000}}"#),
        )
        .0
    }

    /// Stops with SIGTERM (which syncs the audit log) and returns the log lines.
    fn stop(mut self) -> Vec<String> {
        let sent = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.child.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "no exit 20 s after SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
        self.log.try_iter().collect()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `fencelock serve` on `data_dir` must refuse to start: exit 65 (corrupt data), and stderr
/// naming each of `needles`.
/// If it starts serving instead, it is stopped and the test fails at once.
fn check_refused(data_dir: &Path, config: Option<&Path>, needles: &[&str]) {
    let mut child = serve_cmd(data_dir, config)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = String::new();
    for line in BufReader::new(child.stderr.take().unwrap()).lines() {
        let line = line.unwrap();
        stderr.push_str(&line);
        stderr.push('\n');
        let v: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
        if v.get("listen").is_some() {
            let _ = child.kill();
            let _ = child.wait();
            panic!("it served: {stderr}");
        }
    }
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(65), "{stderr}");
    assert!(!stderr.contains("fencelock serving"), "it served: {stderr}");
    for needle in needles {
        assert!(
            stderr.contains(needle),
            "stderr does not say {needle:?}: {stderr}"
        );
    }
}

fn flip(path: &Path, offset: u64) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, offset).unwrap();
    f.write_all_at(&[b[0] ^ 0x01], offset).unwrap();
}

const SEGMENT_HEADER: u64 = 56;

/// The start of each record frame of a segment, then where its records end (where
/// its seal starts, if it has one): walk the frames from the header to the eight
/// zero bytes or the seal that end the data.
fn boundaries(segment: &[u8]) -> Vec<u64> {
    let mut off = SEGMENT_HEADER as usize;
    let mut v = Vec::new();
    loop {
        v.push(off as u64);
        let header = &segment[off..off + 8];
        let word = u32::from_le_bytes(header[..4].try_into().unwrap());
        if header == [0; 8] || word & (1 << 30) != 0 {
            return v;
        }
        off += 8 + (word & 0x00ff_ffff) as usize;
    }
}

/// Where a segment's records end.
fn data_end(segment: &[u8]) -> u64 {
    *boundaries(segment).last().unwrap()
}

fn cut(path: &Path, len: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(len)
        .unwrap();
}

fn zero(path: &Path, from: u64) {
    let len = std::fs::metadata(path).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(&vec![0u8; (len - from) as usize], from)
        .unwrap();
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let dst = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &dst);
        } else {
            std::fs::copy(entry.path(), dst).unwrap();
        }
    }
}

fn segment(dir: &Path, seq: u64) -> PathBuf {
    dir.join(format!("log-{seq:016}.seg"))
}

/// Three acquires through a real server on `dir`, each its own batch (so the first
/// record has later batches), then a clean stop; the segment they are in.
fn three_batches(dir: &Path) -> PathBuf {
    let server = start(dir, None);
    for name in ["a", "b", "c"] {
        assert_eq!(server.acquire(name), 200);
    }
    server.stop();
    segment(dir, 0)
}

#[test]
fn a_flipped_bit_in_a_synced_record_stops_serve_naming_file_and_offset() {
    let dir = tempfile::tempdir().unwrap();
    let seg = three_batches(dir.path());
    flip(&seg, SEGMENT_HEADER + 8 + 1); // the payload of the first record
    check_refused(
        dir.path(),
        None,
        &[
            "corrupt log data",
            &seg.display().to_string(),
            "at offset 56",
            "checksum",
        ],
    );
}

#[test]
fn a_damaged_segment_header_stops_serve() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path(), None);
    assert_eq!(server.acquire("a"), 200);
    server.stop();
    let seg = segment(dir.path(), 0);
    flip(&seg, 17); // the sequence number
    check_refused(
        dir.path(),
        None,
        &[
            "corrupt log data",
            &seg.display().to_string(),
            "at offset 0",
        ],
    );
}

#[test]
fn a_torn_tail_is_discarded_with_a_warning_and_the_state_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path(), None);
    assert_eq!(server.acquire("a"), 200);
    server.stop();
    // Half a record after the last one: a write cut short by a crash.
    let seg = segment(dir.path(), 0);
    let end = data_end(&std::fs::read(&seg).unwrap());
    let f = std::fs::OpenOptions::new().write(true).open(&seg).unwrap();
    f.write_all_at(&[40, 0, 0, 0x80, 1, 2, 3, 4, b'x', b'y'], end)
        .unwrap();
    drop(f);
    let server = start(dir.path(), None);
    assert_eq!(server.acquire("a"), 409, "the acknowledged lock was lost");
    assert_eq!(server.acquire("b"), 200);
    let log = server.stop().join("\n");
    assert!(log.contains("\"truncated_tail_bytes\":10"), "{log}");
    assert!(log.contains("discarded a torn record"), "{log}");
}

#[test]
fn a_damaged_snapshot_stops_serve() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("fencelock.toml");
    std::fs::write(&config, "[storage]\nsnapshot_after_bytes = 1\n").unwrap();
    let data = dir.path().join("data");
    let server = start(&data, Some(&config));
    let snapshots = || -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(&data)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "snap"))
            .collect();
        v.sort();
        v
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut n = 0;
    while snapshots().is_empty() {
        n += 1;
        assert_eq!(server.acquire(&format!("l{n}")), 200);
        assert!(Instant::now() < deadline, "no snapshot was taken");
        std::thread::sleep(Duration::from_millis(50));
    }
    server.stop();
    // The newest one is what a start loads (older ones may linger until then).
    let snap = snapshots().pop().unwrap();
    flip(&snap, 32 + 3);
    check_refused(
        &data,
        Some(&config),
        &["corrupt log data", &snap.display().to_string(), "checksum"],
    );
}

#[test]
fn a_damaged_audit_log_stops_serve() {
    let dir = tempfile::tempdir().unwrap();
    // Two runs: each stop syncs the audit log, so its first record is followed by
    // a later sync batch and cannot be a torn tail.
    for name in ["a", "b"] {
        let server = start(dir.path(), None);
        assert_eq!(server.acquire(name), 200);
        server.stop();
    }
    let seg = segment(&dir.path().join("audit"), 0);
    flip(&seg, SEGMENT_HEADER + 8 + 2);
    check_refused(
        dir.path(),
        None,
        &[
            "audit log",
            "corrupt",
            &seg.display().to_string(),
            "at offset 56",
        ],
    );
}

#[test]
fn the_newest_segment_cut_at_a_record_boundary_stops_serve() {
    let dir = tempfile::tempdir().unwrap();
    let seg = three_batches(dir.path());
    let bounds = boundaries(&std::fs::read(&seg).unwrap());
    // At the end of the data (what a version 1 log took for a clean end), and
    // before the last record (which version 1 lost without a word).
    for at in [bounds[bounds.len() - 1], bounds[bounds.len() - 2]] {
        let copy = tempfile::tempdir().unwrap();
        copy_dir(dir.path(), copy.path());
        let seg = segment(copy.path(), 0);
        cut(&seg, at);
        check_refused(
            copy.path(),
            None,
            &[
                "corrupt log data",
                &seg.display().to_string(),
                &format!("at offset {at}"),
                "truncated",
            ],
        );
    }
    // Zeroed from the last record on instead: the manifest recorded at the clean
    // stop that it was durable.
    zero(&seg, bounds[bounds.len() - 2]);
    check_refused(
        dir.path(),
        None,
        &["corrupt log data", &seg.display().to_string(), "manifest"],
    );
}

#[test]
fn an_older_segment_cut_or_zeroed_and_a_deleted_newest_segment_stop_serve() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("fencelock.toml");
    std::fs::write(&config, "[storage]\nsegment_bytes = 1048576\n").unwrap();
    let data = dir.path().join("data");
    let server = start(&data, Some(&config));
    // Each grant logs about 1 KiB: fill segment 0 until segment 1 exists.
    let owner = "o".repeat(1000);
    let mut n = 0;
    while !segment(&data, 1).exists() {
        n += 1;
        assert!(n < 3000, "segment 1 was never created");
        let body = format!(r#"{{"name":"fill:{n}","ttl_ms":600000,"owner":"{owner}"}}"#);
        assert_eq!(server.post("/v1/acquire", &body).0, 200);
    }
    assert_eq!(server.acquire("last"), 200);
    server.stop();
    let older = std::fs::read(segment(&data, 0)).unwrap();
    let bounds = boundaries(&older);
    let last_record = bounds[bounds.len() - 2];

    type Damage = fn(&Path, u64);
    let cases: [(&str, Damage, u64, &[&str]); 3] = [
        // Its last record and seal zeroed: a clean end to a version 1 reader.
        (
            "zeroed",
            |d, at| zero(&segment(d, 0), at),
            0,
            &["cut or zeroed"],
        ),
        ("cut", |d, at| cut(&segment(d, 0), at), 0, &["truncated"]),
        // The newest segment deleted: segment 0's seal names it.
        (
            "deleted",
            |d, _| std::fs::remove_file(segment(d, 1)).unwrap(),
            1,
            &["missing"],
        ),
    ];
    for (what, damage, named, needles) in cases {
        let copy = dir.path().join(format!("copy-{what}"));
        copy_dir(&data, &copy);
        damage(&copy, last_record);
        let file = segment(&copy, named).display().to_string();
        let mut all = vec!["corrupt log data", file.as_str()];
        all.extend_from_slice(needles);
        check_refused(&copy, Some(&config), &all);
    }
}

#[test]
fn a_wiped_data_directory_that_kept_its_manifest_stops_serve() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path(), None);
    assert_eq!(server.acquire("a"), 200);
    server.stop();
    // The only segment deleted (with it every fence issued): the manifest says
    // the directory held data.
    let wiped = tempfile::tempdir().unwrap();
    copy_dir(dir.path(), wiped.path());
    std::fs::remove_file(segment(wiped.path(), 0)).unwrap();
    check_refused(
        wiped.path(),
        None,
        &[
            "corrupt log data",
            &segment(wiped.path(), 0).display().to_string(),
            "missing",
        ],
    );
    // The manifest deleted, the segment kept.
    let manifest = dir.path().join("log.manifest");
    std::fs::remove_file(&manifest).unwrap();
    check_refused(
        dir.path(),
        None,
        &[
            "corrupt log data",
            &manifest.display().to_string(),
            "manifest is missing",
        ],
    );
    // Starting over on purpose: delete the whole data directory.
    std::fs::remove_dir_all(dir.path()).unwrap();
    let server = start(dir.path(), None);
    assert_eq!(server.acquire("a"), 200);
    server.stop();
}
