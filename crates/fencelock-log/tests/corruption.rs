//! Damage at every byte of a log directory, class by class: every bit flip in a
//! snapshot, the manifest, segment headers, record length words, checksums,
//! payloads, seals and the zero fill after the data; every truncation of every
//! file; every zeroing from a record boundary to the end of a segment; every
//! deletion of a set of files. Each case must end as the crate docs say:
//!
//! - a torn tail — damage after the newest segment's data, or, after a crash, in
//!   its final sync batch — is discarded and reported in `truncated_tail_bytes`,
//!   and exactly the records before it come back;
//! - anything else is `Corrupt`, with the file (and, for records, the offset of
//!   the first bad record) in the error and its message; nothing is loaded.
//!
//! Each layout is checked three times: after a clean close (the manifest records
//! where the newest segment's durable data ends); after a process crash (it does
//! not, but `log.durable` records the end of the last fdatasync); and after a
//! power loss that also lost `log.durable`'s last write (it records the end of the
//! batch before). What remains undetected is only the documented limit: after a
//! power loss, damage past the last durable end that reached the disk looks like
//! a torn or never-written batch.

use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use fencelock_log::{Log, LogErrorKind, LogOptions};

const SEGMENT_HEADER: u64 = 56;
const RECORD_HEADER: u64 = 8;
const SEAL: u64 = 32;
const MANIFEST: &str = "log.manifest";
const DURABLE: &str = "log.durable";

/// How the log in a layout stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// Dropped: the manifest records the durable end.
    Closed,
    /// `kill -9`: the manifest is stale, `log.durable` holds the last sync's end.
    Killed,
    /// Power loss: as `Killed`, and the write of the last sync's end to
    /// `log.durable` never reached the disk either.
    PowerLoss,
}

const STOPS: [Stop; 3] = [Stop::Closed, Stop::Killed, Stop::PowerLoss];

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
/// batch and a seal), `log-2` (the newest, with three batches), `log.manifest`.
/// Returns the records after the snapshot and where each one sits. `stop`: how
/// the log ends (a crashed process never runs `Drop`, so the manifest keeps what
/// it held before).
fn build(dir: &Path, stop: Stop) -> (Vec<Vec<u8>>, Vec<Frame>) {
    let (mut log, _) = Log::open(dir, opts()).unwrap();
    log.append(b"before the snapshot").unwrap();
    log.sync().unwrap();
    log.snapshot(b"S").unwrap();
    let mut records = Vec::new();
    let mut frames = Vec::new();
    let mut off = SEGMENT_HEADER;
    let mut seq = 1;
    let batches: [&[usize]; 4] = [&[0, 1, 2], &[3, 4], &[5], &[6, 7, 8]];
    let mut durable_before_last = Vec::new();
    for (batch, ids) in batches.iter().enumerate() {
        if batch == batches.len() - 1 {
            durable_before_last = fs::read(dir.join(DURABLE)).unwrap();
        }
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
    let manifest = fs::read(dir.join(MANIFEST)).unwrap();
    drop(log);
    if stop != Stop::Closed {
        fs::write(dir.join(MANIFEST), manifest).unwrap();
    }
    if stop == Stop::PowerLoss {
        fs::write(dir.join(DURABLE), durable_before_last).unwrap();
    }
    assert_eq!(
        names(dir),
        [
            "log-0000000000000001.seg",
            "log-0000000000000002.seg",
            DURABLE,
            MANIFEST,
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
    /// Opened: the first `keep` records come back, no torn tail reported (the
    /// documented limit after a crash).
    Clean { keep: usize },
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
        (Ok((_, got)), Expect::Clean { keep }) => {
            assert_eq!(got.snapshot.as_deref(), Some(&b"S"[..]), "{what}");
            assert_eq!(got.records, records[..*keep], "{what}");
            assert_eq!(got.truncated_tail_bytes, 0, "{what}");
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

/// Where segment `seq`'s records end (its seal starts there, if it has one).
fn data_end(frames: &[Frame], seq: u64) -> u64 {
    frames
        .iter()
        .filter(|f| f.seq == seq)
        .map(|f| f.end)
        .max()
        .unwrap()
}

fn cut(path: &Path, len: u64) {
    OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(len)
        .unwrap();
}

fn zero(path: &Path, from: u64, to: u64) {
    let f = OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(&vec![0u8; (to - from) as usize], from)
        .unwrap();
}

#[test]
fn every_bit_flip_is_a_torn_tail_only_in_an_unmarked_final_batch_and_corruption_elsewhere() {
    for stop in STOPS {
        let base = tempfile::tempdir().unwrap();
        let (records, frames) = build(base.path(), stop);
        let last_batch = frames.iter().map(|f| f.batch).max().unwrap();
        let mut cases = 0;
        for name in names(base.path()) {
            let len = fs::metadata(base.path().join(&name)).unwrap().len();
            for offset in 0..len {
                // Two bits per byte: the lowest, and the one that holds the
                // batch-start flag in a length word.
                for bit in [0, 7] {
                    let dir = copy_of(base.path());
                    let path = dir.path().join(&name);
                    flip(&path, offset, bit);
                    let corrupt_at = |offset| Expect::Corrupt {
                        file: path.clone(),
                        offset: Some(offset),
                    };
                    let expect = if name == DURABLE {
                        // Evidence only: a damaged slot leaves the other, older one.
                        Expect::Clean {
                            keep: records.len(),
                        }
                    } else if name.starts_with("snap-") || name == MANIFEST {
                        corrupt_at(0)
                    } else {
                        let seq = if name == "log-0000000000000001.seg" {
                            1
                        } else {
                            2
                        };
                        let end = data_end(&frames, seq);
                        let hit = frames
                            .iter()
                            .position(|f| f.seq == seq && f.start <= offset && offset < f.end);
                        match hit {
                            _ if offset < SEGMENT_HEADER => corrupt_at(0),
                            // The older segment's seal, then the zeros after it.
                            None if seq == 1 && offset < end + SEAL => corrupt_at(end),
                            None if seq == 1 => corrupt_at(end + SEAL),
                            // Garbage after the newest segment's data: a torn write.
                            None => Expect::Torn {
                                keep: records.len(),
                            },
                            // In the final batch: torn, unless the manifest (after a
                            // clean close) or log.durable (after a process crash)
                            // marks that batch as durable.
                            Some(i)
                                if frames[i].seq == 2
                                    && frames[i].batch == last_batch
                                    && stop == Stop::PowerLoss =>
                            {
                                Expect::Torn { keep: i }
                            }
                            Some(i) => corrupt_at(frames[i].start),
                        }
                    };
                    check(
                        dir.path(),
                        &records,
                        &expect,
                        &format!("{stop:?}: flip bit {bit} at {name}:{offset}"),
                    );
                    cases += 1;
                }
            }
        }
        assert!(cases > 1000, "{cases}");
    }
}

#[test]
fn every_truncation_of_the_snapshot_or_the_manifest_is_corruption() {
    let base = tempfile::tempdir().unwrap();
    let (records, _) = build(base.path(), Stop::Closed);
    for name in ["snap-0000000000000001.snap", MANIFEST] {
        let len = fs::metadata(base.path().join(name)).unwrap().len();
        for at in 0..len {
            let dir = copy_of(base.path());
            let path = dir.path().join(name);
            cut(&path, at);
            let expect = Expect::Corrupt {
                file: path,
                offset: Some(0),
            };
            check(
                dir.path(),
                &records,
                &expect,
                &format!("{name} cut at {at}"),
            );
        }
    }
}

#[test]
fn every_truncation_of_a_segment_is_corruption_even_at_a_record_boundary() {
    for stop in STOPS {
        let base = tempfile::tempdir().unwrap();
        let (records, _) = build(base.path(), stop);
        for seq in [1, 2] {
            let len = fs::metadata(segment(base.path(), seq)).unwrap().len();
            for at in 0..len {
                let dir = copy_of(base.path());
                let path = segment(dir.path(), seq);
                cut(&path, at);
                // A header that is cut is bad at 0; after that, the file is
                // shorter than the capacity its header records.
                let offset = if at < SEGMENT_HEADER { 0 } else { at };
                let expect = Expect::Corrupt {
                    file: path,
                    offset: Some(offset),
                };
                check(
                    dir.path(),
                    &records,
                    &expect,
                    &format!("{stop:?}: log-{seq} cut at {at}"),
                );
            }
        }
    }
}

#[test]
fn zeroing_a_segment_from_a_record_boundary_to_its_end() {
    for stop in STOPS {
        let base = tempfile::tempdir().unwrap();
        let (records, frames) = build(base.path(), stop);
        let boundaries = |seq| {
            let mut v: Vec<u64> = frames
                .iter()
                .filter(|f| f.seq == seq)
                .map(|f| f.start)
                .collect();
            v.push(data_end(&frames, seq));
            v
        };
        // The older segment: the seal is always lost with the records, so it is
        // refused where the records end (the next segment's header says where).
        for from in boundaries(1) {
            let dir = copy_of(base.path());
            let path = segment(dir.path(), 1);
            let len = fs::metadata(&path).unwrap().len();
            zero(&path, from, len);
            let expect = Expect::Corrupt {
                file: path,
                offset: Some(from),
            };
            check(
                dir.path(),
                &records,
                &expect,
                &format!("{stop:?}: log-1 zeroed from {from}"),
            );
        }
        // Only the seal.
        let dir = copy_of(base.path());
        let path = segment(dir.path(), 1);
        let end = data_end(&frames, 1);
        zero(&path, end, end + SEAL);
        let expect = Expect::Corrupt {
            file: path,
            offset: Some(end),
        };
        check(dir.path(), &records, &expect, "log-1 seal zeroed");

        // The newest segment. After a power loss, log.durable still marks the
        // end of the batch before the last one.
        let end = data_end(&frames, 2);
        let last_batch = frames.iter().map(|f| f.batch).max().unwrap();
        let marked = match stop {
            Stop::Closed | Stop::Killed => end,
            Stop::PowerLoss => frames
                .iter()
                .filter(|f| f.batch == last_batch)
                .map(|f| f.start)
                .min()
                .unwrap(),
        };
        for from in boundaries(2) {
            let dir = copy_of(base.path());
            let path = segment(dir.path(), 2);
            let len = fs::metadata(&path).unwrap().len();
            zero(&path, from, len);
            let keep = frames
                .iter()
                .filter(|f| f.seq == 1 || f.end <= from)
                .count();
            let expect = if from >= marked {
                // The documented limit: after a power loss, batches past the
                // last durable end that reached the disk look unwritten.
                Expect::Clean { keep }
            } else {
                // The manifest (at close) or log.durable says how far the data
                // was durable.
                Expect::Corrupt {
                    file: path,
                    offset: Some(from),
                }
            };
            check(
                dir.path(),
                &records,
                &expect,
                &format!("{stop:?}: log-2 zeroed from {from}"),
            );
        }
    }
}

#[test]
fn deleting_files_is_corruption_unless_everything_is_gone() {
    let log1 = "log-0000000000000001.seg";
    let log2 = "log-0000000000000002.seg";
    let snap = "snap-0000000000000001.snap";
    // Each set of deleted files, and the file the error must name.
    let cases: [(&[&str], &str); 9] = [
        // The newest segment: the older one's seal names it.
        (&[log2], log2),
        (&[log1], log1),
        // Without the snapshot, segment 0 comes first; it is gone.
        (&[snap], "log-0000000000000000.seg"),
        (&[MANIFEST], MANIFEST),
        // The snapshot's own segment (it is created before the snapshot).
        (&[log1, log2], log1),
        // A wiped directory that kept its manifest: the newest segment recorded.
        (&[log1, log2, snap], log2),
        (&[log2, snap], "log-0000000000000000.seg"),
        (&[MANIFEST, log1, log2], MANIFEST),
        (&[MANIFEST, log2], MANIFEST),
    ];
    for stop in STOPS {
        let base = tempfile::tempdir().unwrap();
        let (records, _) = build(base.path(), stop);
        for (deleted, named) in cases {
            let dir = copy_of(base.path());
            for name in deleted {
                fs::remove_file(dir.path().join(name)).unwrap();
            }
            let named = if stop != Stop::Closed && deleted == [log1, log2, snap] {
                // After a crash the manifest's mark is from the first open.
                "log-0000000000000000.seg"
            } else {
                named
            };
            let expect = Expect::Corrupt {
                file: dir.path().join(named),
                offset: None,
            };
            check(
                dir.path(),
                &records,
                &expect,
                &format!("{stop:?}: deleted {deleted:?}"),
            );
        }
        // log.durable is evidence only: without it the rules before it apply.
        let dir = copy_of(base.path());
        fs::remove_file(dir.path().join(DURABLE)).unwrap();
        let all = Expect::Clean {
            keep: records.len(),
        };
        check(
            dir.path(),
            &records,
            &all,
            &format!("{stop:?}: deleted {DURABLE}"),
        );
        // Everything but log.durable deleted: a new directory; the stale mark of
        // the old one is ignored (and replaced).
        let dir = copy_of(base.path());
        for name in names(dir.path()).into_iter().filter(|n| n != DURABLE) {
            fs::remove_file(dir.path().join(name)).unwrap();
        }
        let (_, got) = Log::open(dir.path(), opts()).unwrap();
        assert!(got.snapshot.is_none() && got.records.is_empty());
        // Everything deleted: nothing is left to tell it from a new directory.
        let dir = copy_of(base.path());
        for name in names(dir.path()) {
            fs::remove_file(dir.path().join(name)).unwrap();
        }
        let (_, got) = Log::open(dir.path(), opts()).unwrap();
        assert!(got.snapshot.is_none() && got.records.is_empty());
    }
}
