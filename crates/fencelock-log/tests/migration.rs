//! Data directories written by format version 1 (before segment capacity, seals and
//! the manifest) still load, and are carried on in version 2.
//!
//! `tests/fixtures/v1-dir` was written by the version 1 code (commit a2f1300) with
//! the program in `tests/fixtures/v1-dir.generator.rs.txt`: a snapshot "v1 state"
//! and 24 records in 256-byte segments 1..=5.

use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use fencelock_log::{Log, LogErrorKind, LogOptions};

const V1_HEADER: u64 = 32;
const RECORD_HEADER: u64 = 8;

fn opts() -> LogOptions {
    LogOptions {
        segment_bytes: 256,
        fsync: false,
    }
}

/// The records the generator appended after its snapshot.
fn v1_records() -> Vec<Vec<u8>> {
    (0..6)
        .flat_map(|batch| {
            (0..4).map(move |i| format!("v1-record-{batch}-{i}-xxxxxxxxxxxxxxxx").into_bytes())
        })
        .collect()
}

/// A copy of the fixture in a new temp dir.
fn v1_dir() -> tempfile::TempDir {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/v1-dir");
    let dst = tempfile::tempdir().unwrap();
    for entry in fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        fs::copy(entry.path(), dst.path().join(entry.file_name())).unwrap();
    }
    dst
}

fn segment(dir: &Path, seq: u64) -> PathBuf {
    dir.join(format!("log-{seq:016}.seg"))
}

fn version(path: &Path) -> u32 {
    let bytes = fs::read(path).unwrap();
    u32::from_le_bytes(bytes[8..12].try_into().unwrap())
}

/// Where a version 1 segment's records end.
fn v1_data_end(path: &Path) -> u64 {
    let bytes = fs::read(path).unwrap();
    let mut off = V1_HEADER as usize;
    while off + 8 <= bytes.len() && bytes[off..off + 8] != [0; 8] {
        let word = u32::from_le_bytes(bytes[off..off + 4].try_into().unwrap());
        off += RECORD_HEADER as usize + (word & 0x00ff_ffff) as usize;
    }
    off as u64
}

#[test]
fn a_version_1_directory_loads_and_goes_on_in_version_2() {
    let dir = v1_dir();
    assert!(!dir.path().join("log.manifest").exists());
    assert_eq!(version(&segment(dir.path(), 5)), 1);
    let (mut log, got) = Log::open(dir.path(), opts()).unwrap();
    assert_eq!(got.snapshot.as_deref(), Some(&b"v1 state"[..]));
    assert_eq!(got.records, v1_records());
    assert_eq!(got.truncated_tail_bytes, 0);
    // The version 1 segments are left as they are; new records go to version 2.
    assert!(dir.path().join("log.manifest").exists());
    assert_eq!(version(&segment(dir.path(), 5)), 1);
    assert_eq!(version(&segment(dir.path(), 6)), 2);
    let more: Vec<Vec<u8>> = (0..20).map(|i| format!("v2-{i}").into_bytes()).collect();
    for r in &more {
        log.append(r).unwrap();
    }
    log.sync().unwrap();
    drop(log);

    let (mut log, got) = Log::open(dir.path(), opts()).unwrap();
    assert_eq!(got.snapshot.as_deref(), Some(&b"v1 state"[..]));
    assert_eq!(got.records, [v1_records(), more.clone()].concat());
    // A snapshot drops the version 1 segments for good.
    log.snapshot(b"v2 state").unwrap();
    drop(log);
    for entry in fs::read_dir(dir.path()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "seg") {
            assert_eq!(version(&path), 2, "{}", path.display());
        }
    }
    let (_, got) = Log::open(dir.path(), opts()).unwrap();
    assert_eq!(got.snapshot.as_deref(), Some(&b"v2 state"[..]));
    assert!(got.records.is_empty());
}

#[test]
fn a_version_1_torn_tail_is_dropped_before_migrating() {
    let dir = v1_dir();
    let newest = segment(dir.path(), 5);
    let end = v1_data_end(&newest);
    // Half a record after the last one, as a crash mid-write leaves it.
    let f = OpenOptions::new().write(true).open(&newest).unwrap();
    f.write_all_at(&[40, 0, 0, 0x80, 1, 2, 3, 4, b'x', b'y'], end)
        .unwrap();
    drop(f);
    let (log, got) = Log::open(dir.path(), opts()).unwrap();
    assert_eq!(got.records, v1_records());
    assert_eq!(got.truncated_tail_bytes, 10);
    drop(log);
    let (_, got) = Log::open(dir.path(), opts()).unwrap();
    assert_eq!(got.records, v1_records());
    assert_eq!(got.truncated_tail_bytes, 0);
}

#[test]
fn after_migration_the_last_version_1_segment_is_checked_by_its_successor() {
    let dir = v1_dir();
    drop(Log::open(dir.path(), opts()).unwrap());
    // Zero the last record of segment 5 (a clean end to a version 1 reader).
    let newest_v1 = segment(dir.path(), 5);
    let end = v1_data_end(&newest_v1);
    let last = v1_records().last().unwrap().len() as u64 + RECORD_HEADER;
    let f = OpenOptions::new().write(true).open(&newest_v1).unwrap();
    f.write_all_at(&vec![0u8; last as usize], end - last)
        .unwrap();
    drop(f);
    let err = Log::open(dir.path(), opts()).unwrap_err();
    assert_eq!(err.kind(), LogErrorKind::Corrupt, "{err}");
    assert_eq!(err.path(), Some(newest_v1.as_path()), "{err}");
    assert_eq!(err.offset(), Some(end - last), "{err}");

    // Deleting the first version 2 segment is caught by the manifest.
    let dir = v1_dir();
    drop(Log::open(dir.path(), opts()).unwrap());
    fs::remove_file(segment(dir.path(), 6)).unwrap();
    let err = Log::open(dir.path(), opts()).unwrap_err();
    assert_eq!(err.kind(), LogErrorKind::Corrupt, "{err}");
    assert_eq!(err.path(), Some(segment(dir.path(), 6).as_path()), "{err}");
    assert!(err.to_string().contains("missing"), "{err}");
}

#[test]
fn a_version_2_segment_without_the_manifest_is_refused() {
    // What a version 1 reader never wrote cannot be mistaken for version 1 data.
    let dir = v1_dir();
    drop(Log::open(dir.path(), opts()).unwrap());
    fs::remove_file(dir.path().join("log.manifest")).unwrap();
    let err = Log::open(dir.path(), opts()).unwrap_err();
    assert_eq!(err.kind(), LogErrorKind::Corrupt, "{err}");
    assert_eq!(
        err.path(),
        Some(dir.path().join("log.manifest").as_path()),
        "{err}"
    );
}
