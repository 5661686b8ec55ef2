//! Damage at every byte of a log directory, class by class: every bit flip in a
//! snapshot, in segment headers, record length words, checksums and payloads, and
//! in the zero fill after the data; every truncation of a snapshot and of the newest
//! segment. Each case must end as the crate docs say:
//!
//! - a torn tail — damage in the final sync batch of the newest segment, or after
//!   its data — is discarded and reported in `truncated_tail_bytes`, and exactly
//!   the records before it come back;
//! - anything else is `Corrupt`, with the file (and, for records, the offset of
//!   the first bad record) in the error and its message; nothing is loaded.
//!
//! Not covered, because the format cannot tell it from a clean end: a segment cut
//! (or zeroed) exactly at a record boundary loses the records after the cut without
//! an error (see the report of issue 4).

use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use fencelock_log::{Log, LogErrorKind, LogOptions};

const SEGMENT_HEADER: u64 = 32;
const RECORD_HEADER: u64 = 8;

fn opts() -> LogOptions {
    LogOptions {
        segment_bytes: 512,
        fsync: false,
    }
}

fn rec(i: usize) -> Vec<u8> {
    let mut r = format!("record-{i:03}-").into_bytes();
    r.resize(r.len() + i % 7, b'a' + (i % 26) as u8);
    r
}

/// One record's place: its segment, frame start and end, and sync batch.
#[derive(Debug, Clone, Copy)]
struct Frame {
    seq: u64,
    start: u64,
    end: u64,
    batch: usize,
}

/// A log laid out as: `snap-1` (state "S"), `log-1` (an older segment with one
/// batch), `log-2` (the newest, with three batches). Returns the records after the
/// snapshot and where each one sits.
fn build(dir: &Path) -> (Vec<Vec<u8>>, Vec<Frame>) {
    let (mut log, _) = Log::open(dir, opts()).unwrap();
    log.append(b"before the snapshot").unwrap();
    log.sync().unwrap();
    log.snapshot(b"S").unwrap();
    let mut records = Vec::new();
    let mut frames = Vec::new();
    let mut off = SEGMENT_HEADER;
    let mut seq = 1;
    let batches: [&[usize]; 4] = [&[0, 1, 2], &[3, 4], &[5], &[6, 7, 8]];
    for (batch, ids) in batches.iter().enumerate() {
        if batch == 1 {
            seq = log.start_segment().unwrap();
            off = SEGMENT_HEADER;
        }
        for &i in *ids {
            let r = rec(i);
            log.append(&r).unwrap();
            let end = off + RECORD_HEADER + r.len() as u64;
            frames.push(Frame {
                seq,
                start: off,
                end,
                batch,
            });
            off = end;
            records.push(r);
        }
        log.sync().unwrap();
    }
    assert_eq!(seq, 2);
    drop(log);
    assert_eq!(
        names(dir),
        [
            "log-0000000000000001.seg",
            "log-0000000000000002.seg",
            "snap-0000000000000001.snap"
        ]
    );
    (records, frames)
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

fn segment(dir: &Path, seq: u64) -> PathBuf {
    dir.join(format!("log-{seq:016}.seg"))
}

fn snapshot(dir: &Path) -> PathBuf {
    dir.join("snap-0000000000000001.snap")
}

fn flip(path: &Path, offset: u64, bit: u8) {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, offset).unwrap();
    f.write_all_at(&[b[0] ^ (1 << bit)], offset).unwrap();
}

/// What opening a damaged copy must give.
#[derive(Debug)]
enum Expect {
    /// Refused as corrupt, naming `file` and (if given) `offset`.
    Corrupt { file: PathBuf, offset: Option<u64> },
    /// Opened: the first `keep` records come back, and a torn tail was reported.
    Torn { keep: usize },
}

fn check(dir: &Path, records: &[Vec<u8>], expect: &Expect, what: &str) {
    match (Log::open(dir, opts()), expect) {
        (Err(e), Expect::Corrupt { file, offset }) => {
            let msg = e.to_string();
            assert_eq!(e.kind(), LogErrorKind::Corrupt, "{what}: {msg}");
            assert_eq!(e.path(), Some(file.as_path()), "{what}: {msg}");
            let name = file.file_name().unwrap().to_str().unwrap();
            assert!(
                msg.contains(name),
                "{what}: message does not name {name}: {msg}"
            );
            if let Some(offset) = offset {
                assert_eq!(e.offset(), Some(*offset), "{what}: {msg}");
                assert!(
                    msg.contains(&format!("at offset {offset}")),
                    "{what}: {msg}"
                );
            }
        }
        (Ok((_, got)), Expect::Torn { keep }) => {
            assert_eq!(got.snapshot.as_deref(), Some(&b"S"[..]), "{what}");
            assert_eq!(got.records, records[..*keep], "{what}");
            assert!(
                got.truncated_tail_bytes > 0,
                "{what}: torn tail not reported"
            );
        }
        (Ok((_, got)), expect) => panic!(
            "{what}: expected {expect:?}, but it opened with {} records, {} torn bytes",
            got.records.len(),
            got.truncated_tail_bytes
        ),
        (Err(e), expect) => panic!("{what}: expected {expect:?}, got {e}"),
    }
}

/// A fresh copy of the built log in a new temp dir.
fn copy_of(src: &Path) -> tempfile::TempDir {
    let dst = tempfile::tempdir().unwrap();
    for name in names(src) {
        fs::copy(src.join(&name), dst.path().join(&name)).unwrap();
    }
    dst
}

#[test]
fn every_bit_flip_is_a_torn_tail_only_in_the_final_batch_and_corruption_elsewhere() {
    let base = tempfile::tempdir().unwrap();
    let (records, frames) = build(base.path());
    let last_batch = frames.iter().map(|f| f.batch).max().unwrap();
    let mut cases = 0;
    for name in names(base.path()) {
        let len = fs::metadata(base.path().join(&name)).unwrap().len();
        for offset in 0..len {
            // Two bits per byte: the lowest, and the one that holds the batch-start
            // flag in a length word.
            for bit in [0, 7] {
                let dir = copy_of(base.path());
                let path = dir.path().join(&name);
                flip(&path, offset, bit);
                let expect = if name.starts_with("snap-") {
                    Expect::Corrupt {
                        file: path.clone(),
                        offset: Some(0),
                    }
                } else {
                    let seq = if name == "log-0000000000000001.seg" {
                        1
                    } else {
                        2
                    };
                    let data_end = frames
                        .iter()
                        .filter(|f| f.seq == seq)
                        .map(|f| f.end)
                        .max()
                        .unwrap();
                    let hit = frames
                        .iter()
                        .position(|f| f.seq == seq && f.start <= offset && offset < f.end);
                    match hit {
                        _ if offset < SEGMENT_HEADER => Expect::Corrupt {
                            file: path.clone(),
                            offset: Some(0),
                        },
                        // Garbage after the older segment's data: it had been synced.
                        None if seq == 1 => Expect::Corrupt {
                            file: path.clone(),
                            offset: Some(data_end),
                        },
                        // Garbage after the newest segment's data: a torn write.
                        None => Expect::Torn {
                            keep: records.len(),
                        },
                        Some(i) if frames[i].seq == 2 && frames[i].batch == last_batch => {
                            Expect::Torn { keep: i }
                        }
                        Some(i) => Expect::Corrupt {
                            file: path.clone(),
                            offset: Some(frames[i].start),
                        },
                    }
                };
                check(
                    dir.path(),
                    &records,
                    &expect,
                    &format!("flip bit {bit} at {name}:{offset}"),
                );
                cases += 1;
            }
        }
    }
    assert!(cases > 1000, "{cases}");
}

#[test]
fn every_truncation_of_the_snapshot_is_corruption() {
    let base = tempfile::tempdir().unwrap();
    let (records, _) = build(base.path());
    let len = fs::metadata(snapshot(base.path())).unwrap().len();
    for cut in 0..len {
        let dir = copy_of(base.path());
        let path = snapshot(dir.path());
        OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(cut)
            .unwrap();
        let expect = Expect::Corrupt {
            file: path,
            offset: Some(0),
        };
        check(
            dir.path(),
            &records,
            &expect,
            &format!("snapshot cut at {cut}"),
        );
    }
}

#[test]
fn truncating_the_newest_segment_inside_a_record_is_a_torn_tail_and_in_its_header_is_corruption() {
    let base = tempfile::tempdir().unwrap();
    let (records, frames) = build(base.path());
    for cut in 0..frames.last().unwrap().end {
        let inside = frames
            .iter()
            .position(|f| f.seq == 2 && f.start < cut && cut < f.end);
        let expect = if cut < SEGMENT_HEADER {
            Expect::Corrupt {
                file: segment(base.path(), 2),
                offset: Some(0),
            }
        } else if let Some(i) = inside {
            // A partial record at the very end: what a crash mid-write leaves.
            Expect::Torn { keep: i }
        } else {
            continue; // a record boundary: see the module docs
        };
        let dir = copy_of(base.path());
        let path = segment(dir.path(), 2);
        OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(cut)
            .unwrap();
        let expect = match expect {
            Expect::Corrupt { offset, .. } => Expect::Corrupt { file: path, offset },
            torn => torn,
        };
        check(
            dir.path(),
            &records,
            &expect,
            &format!("log-2 cut at {cut}"),
        );
    }
}

#[test]
fn truncating_an_older_segment_inside_a_record_is_corruption() {
    let base = tempfile::tempdir().unwrap();
    let (records, frames) = build(base.path());
    for cut in 0..frames
        .iter()
        .filter(|f| f.seq == 1)
        .map(|f| f.end)
        .max()
        .unwrap()
    {
        let inside = frames
            .iter()
            .position(|f| f.seq == 1 && f.start < cut && cut < f.end);
        let offset = if cut < SEGMENT_HEADER {
            0
        } else if let Some(i) = inside {
            frames[i].start
        } else {
            continue; // a record boundary: see the module docs
        };
        let dir = copy_of(base.path());
        let path = segment(dir.path(), 1);
        OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(cut)
            .unwrap();
        let expect = Expect::Corrupt {
            file: path,
            offset: Some(offset),
        };
        check(
            dir.path(),
            &records,
            &expect,
            &format!("log-1 cut at {cut}"),
        );
    }
}
