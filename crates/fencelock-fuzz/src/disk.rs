//! Files on disk: the command log and its snapshots (`fencelock-log`), whole data
//! directories as the server recovers them, and the audit store's records.

use std::path::{Path, PathBuf};

use fencelock_core::Config as CoreConfig;
use fencelock_log::{Log, LogErrorKind, LogOptions, MIN_SEGMENT_BYTES};
use fencelock_server::audit::{AuditConfig, AuditStore};
use fencelock_server::codec::{encode_record, RecordMeta};

use crate::{plant, Input, MAX_INPUT_BYTES};

/// Most operations (appends, syncs, snapshots) one input performs.
const MAX_OPS: usize = 256;

/// What was made durable, to compare recovery against.
#[derive(Debug, Default)]
struct Truth {
    snapshot: Option<Vec<u8>>,
    synced: Vec<Vec<u8>>,
}

/// How [`log_dir_outcome`] ended, for tests that check what an input does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogDirOutcome {
    /// The damaged log was refused as corrupt; the error named this file.
    Refused {
        /// The file name (the directory was temporary).
        file: String,
    },
    /// The log opened with `records` of the `synced` records that were made durable.
    Loaded {
        /// Records recovered after the snapshot.
        records: usize,
        /// Records synced after the snapshot before the log was closed or crashed.
        synced: usize,
        /// Whether the log was dropped as in a crash (without `Drop`'s manifest update).
        crashed: bool,
    },
}

/// Writes a real log (appends, syncs and snapshots chosen by the input, small
/// segments so it rolls), closes it cleanly or as in a crash, damages its files
/// (bit flips, truncation, zeroed ranges, deleted files), then opens it. Oracle
/// (the guarantees of format version 2, see `fencelock-log`'s crate docs):
/// - undamaged: exactly the snapshot and every synced record come back;
/// - damaged: either a `Corrupt` error naming a file of the directory, or the true
///   snapshot and a *prefix* of the synced records — never an altered, reordered,
///   invented or skipped record. With every file deleted (but `log.durable`,
///   which is ignored without a manifest) it is a new, empty log;
/// - after a clean close, the prefix is all of them: any loss of a synced record
///   is refused;
/// - after a crash, if only bits were flipped, any synced record that is missing
///   is reported in `truncated_tail_bytes` (never dropped silently);
/// - after a successful open, appends continue and survive the next open.
pub fn log_dir(data: &[u8]) {
    let _ = log_dir_outcome(data);
}

/// [`log_dir`], returning how it ended.
pub fn log_dir_outcome(data: &[u8]) -> Option<LogDirOutcome> {
    if data.len() > MAX_INPUT_BYTES {
        return None;
    }
    let mut input = Input::new(data);
    let opts = LogOptions {
        segment_bytes: MIN_SEGMENT_BYTES + input.below(600) as u64,
        fsync: false,
    };
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = tmp.path().join("log");
    let mut truth = Truth::default();
    let crashed;
    {
        let (mut log, recovered) = Log::open(&dir, opts.clone()).expect("open an empty dir");
        assert!(recovered.snapshot.is_none() && recovered.records.is_empty());
        let mut pending: Vec<Vec<u8>> = Vec::new();
        for _ in 0..MAX_OPS {
            match input.byte() % 8 {
                0..=3 => {
                    let record = input.bytes(64).to_vec();
                    log.append(&record).expect("append");
                    pending.push(record);
                }
                4 | 5 => {
                    log.sync().expect("sync");
                    truth.synced.append(&mut pending);
                }
                6 => {
                    let state = input.bytes(48).to_vec();
                    log.snapshot(&state).expect("snapshot");
                    truth.snapshot = Some(state);
                    truth.synced.clear();
                    pending.clear();
                }
                _ => break,
            }
        }
        // Dropped without a final sync: `pending` was never written. A crashed
        // process does not run `Drop`, which records the durable end in the
        // manifest: put back what the manifest held before.
        crashed = input.byte() & 1 == 1;
        let manifest = dir.join("log.manifest");
        let before = std::fs::read(&manifest).expect("read the manifest");
        drop(log);
        if crashed {
            std::fs::write(&manifest, before).expect("restore the manifest");
        }
    }
    let mut flips_only = true;
    let mut damaged = false;
    for _ in 0..input.below(4) {
        let files = files_in(&dir);
        if files.is_empty() {
            break;
        }
        let path = &files[input.below(files.len())];
        let mut bytes = std::fs::read(path).expect("read a log file");
        if bytes.is_empty() {
            continue;
        }
        let at = input.below(bytes.len());
        match input.byte() % 6 {
            0..=2 => bytes[at] ^= 1 << (input.byte() % 8),
            3 => {
                bytes.truncate(at);
                flips_only = false;
            }
            4 => {
                let end = (at + 1 + input.below(64)).min(bytes.len());
                bytes[at..end].fill(0);
                flips_only = false;
            }
            _ => {
                std::fs::remove_file(path).expect("remove a log file");
                damaged = true;
                flips_only = false;
                continue;
            }
        }
        std::fs::write(path, &bytes).expect("write a damaged log file");
        damaged = true;
    }

    // With every file deleted there is nothing left to tell a log from a new one.
    // `log.durable` does not count: without a manifest the log ignores it as left
    // over from a directory wiped to start over (crate docs, "The durable end").
    let all_deleted = files_in(&dir)
        .iter()
        .all(|p| p.file_name().is_some_and(|n| n == "log.durable"));
    let (mut log, recovered) = match Log::open(&dir, opts.clone()) {
        Ok(opened) => opened,
        Err(e) => {
            assert!(damaged, "an undamaged log failed to open: {e}");
            assert_eq!(e.kind(), LogErrorKind::Corrupt, "damage gave {e}");
            let named = e.path().is_some_and(|p| p.starts_with(&dir));
            assert!(
                named,
                "corruption error does not name a file of the log: {e}"
            );
            let file = e
                .path()
                .and_then(Path::file_name)
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            return Some(LogDirOutcome::Refused { file });
        }
    };
    let synced = if all_deleted { 0 } else { truth.synced.len() };
    if all_deleted {
        assert!(recovered.snapshot.is_none() && recovered.records.is_empty());
    } else {
        assert_eq!(
            recovered.snapshot, truth.snapshot,
            "a damaged or wrong snapshot was loaded"
        );
    }
    let n = recovered.records.len();
    assert!(
        n <= synced && recovered.records[..] == truth.synced[..n],
        "recovered records are not a prefix of the synced records"
    );
    if !damaged {
        assert_eq!(n, synced, "synced records lost without damage");
        assert_eq!(recovered.truncated_tail_bytes, 0);
    } else if !crashed {
        assert_eq!(
            n,
            synced,
            "after a clean close, damage dropped {} synced records without an error",
            synced - n
        );
    } else if flips_only && n < synced {
        assert!(
            recovered.truncated_tail_bytes > 0,
            "a bit flip dropped {} synced records silently",
            synced - n
        );
    }
    if n < synced {
        plant("log_dir", "damage dropped records as a torn tail");
    }
    // The log goes on from where recovery stopped.
    log.append(b"after recovery")
        .expect("append after recovery");
    log.sync().expect("sync after recovery");
    drop(log);
    let (_, again) = Log::open(&dir, opts).expect("reopen after recovery");
    let mut expected = recovered.records;
    expected.push(b"after recovery".to_vec());
    assert_eq!(again.snapshot, recovered.snapshot);
    assert_eq!(again.records, expected, "appends after recovery were lost");
    assert_eq!(again.truncated_tail_bytes, 0);
    Some(LogDirOutcome::Loaded {
        records: n,
        synced,
        crashed,
    })
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("list the log dir")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

/// Builds a data directory from the input — segments and snapshots with valid or
/// broken framing around arbitrary or well-formed payloads, stray temp files, an
/// audit log — and recovers it the way `fencelock serve` does
/// (`fencelock_server::engine::recover`). Must be `Ok` (with a core whose
/// invariants hold) or an error; never a panic.
pub fn recover_dir(data: &[u8]) {
    if data.len() > MAX_INPUT_BYTES {
        return;
    }
    let mut input = Input::new(data);
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = tmp.path().join("data");
    std::fs::create_dir_all(dir.join("audit")).expect("create dirs");
    for _ in 0..1 + input.below(5) {
        let seq = input.below(3) as u64;
        let kind = input.byte();
        let (sub, name) = match kind % 8 {
            0..=3 => ("", format!("log-{seq:016}.seg")),
            4 | 5 => ("", format!("snap-{seq:016}.snap")),
            6 => ("audit", format!("log-{seq:016}.seg")),
            _ => ("", format!("log-{seq:016}.seg.tmp")),
        };
        let bytes = if kind & 0x80 != 0 {
            input.bytes(512).to_vec()
        } else if kind % 8 == 4 || kind % 8 == 5 {
            snapshot_file(&payload(&mut input, true))
        } else {
            let mut out = segment_header(seq);
            for _ in 0..input.below(8) {
                frame_into(&mut out, &payload(&mut input, false));
            }
            // Preallocated zeros, or a damaged tail.
            if input.byte() & 1 == 0 {
                out.resize(out.len() + input.below(64), 0);
            } else {
                out.extend_from_slice(input.bytes(24));
            }
            out
        };
        std::fs::write(dir.join(sub).join(name), bytes).expect("write a data file");
    }
    let opts = LogOptions {
        segment_bytes: 4096,
        fsync: false,
    };
    let audit = AuditConfig::default();
    match fencelock_server::engine::recover(opts, &dir, &CoreConfig::default(), Some(&audit)) {
        Ok(recovery) => {
            recovery
                .core
                .check_invariants()
                .unwrap_or_else(|e| panic!("recovered core breaks an invariant: {e}"));
            if recovery.report.snapshot_loaded && recovery.report.records_replayed >= 1 {
                plant("recover_dir", "a snapshot and a record were recovered");
            }
        }
        Err(e) => assert!(!e.message().is_empty()),
    }
}

/// A record payload: raw bytes, or a well-formed encoded command (`snapshot`: a
/// well-formed empty-state snapshot, or raw bytes).
fn payload(input: &mut Input<'_>, snapshot: bool) -> Vec<u8> {
    let mode = input.byte();
    if mode & 1 == 0 {
        return input.bytes(96).to_vec();
    }
    if snapshot {
        let mut core = fencelock_core::Core::new(CoreConfig::default());
        for i in 0..input.below(4) {
            let op = input.byte();
            let _ = core.apply(i as u64, crate::core_seq::command(op, input));
        }
        return fencelock_server::codec::encode_snapshot(&core.export());
    }
    let meta = RecordMeta {
        seq: u64::from(input.byte()),
        now_ms: u64::from(input.u16()),
        wall_ms: 0,
        actor: None,
    };
    let op = input.byte();
    encode_record(&meta, &crate::core_seq::command(op, input))
}

/// A format version 1 segment header (32 bytes), which `fencelock-log` still reads
/// (see its crate docs); version 2 files are covered by `log_dir`, which damages
/// real ones.
fn segment_header(seq: u64) -> Vec<u8> {
    let mut h = vec![0u8; 32];
    h[0..8].copy_from_slice(b"FLOGSEG\0");
    h[8..12].copy_from_slice(&1u32.to_le_bytes());
    h[16..24].copy_from_slice(&seq.to_le_bytes());
    let crc = crc32fast::hash(&h[0..24]);
    h[24..28].copy_from_slice(&crc.to_le_bytes());
    h
}

/// One record frame `[len u32][crc u32][payload]`, batch-start flag set.
fn frame_into(out: &mut Vec<u8>, payload: &[u8]) {
    let word = payload.len() as u32 | 1 << 31;
    let mut crc = crc32fast::Hasher::new();
    crc.update(&word.to_le_bytes());
    crc.update(payload);
    out.extend_from_slice(&word.to_le_bytes());
    out.extend_from_slice(&crc.finalize().to_le_bytes());
    out.extend_from_slice(payload);
}

/// A snapshot file: 32-byte header, then the payload.
fn snapshot_file(payload: &[u8]) -> Vec<u8> {
    let mut h = vec![0u8; 32];
    h[0..8].copy_from_slice(b"FLOGSNP\0");
    h[8..12].copy_from_slice(&1u32.to_le_bytes());
    h[16..24].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    let mut crc = crc32fast::Hasher::new();
    crc.update(&h[0..24]);
    crc.update(payload);
    h[24..28].copy_from_slice(&crc.finalize().to_le_bytes());
    h.extend_from_slice(payload);
    h
}

/// Records of the audit store (`DATA_DIR/audit`): arbitrary record payloads and an
/// optional arbitrary compacted snapshot, appended with the real log, then opened
/// with `AuditStore::open`. Must be `Ok` or a "corrupt" error; never a panic.
pub fn audit_records(data: &[u8]) {
    if data.len() > MAX_INPUT_BYTES {
        return;
    }
    let mut input = Input::new(data);
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = tmp.path().join("audit");
    {
        let opts = LogOptions {
            segment_bytes: 4096,
            fsync: false,
        };
        let (mut log, _) = Log::open(&dir, opts).expect("open an empty dir");
        if input.byte() & 1 == 1 {
            log.snapshot(input.bytes(255)).expect("snapshot");
        }
        for _ in 0..input.below(16) {
            log.append(input.bytes(255)).expect("append");
        }
        log.sync().expect("sync");
    }
    let config = AuditConfig {
        max_age_ms: None,
        max_bytes: 1 << 20,
    };
    match AuditStore::open(&dir, config, false) {
        Ok(store) => {
            let query = fencelock_server::audit::AuditQuery::newest(usize::MAX);
            let entries = store.shared_index().lock().expect("index").query(&query);
            if entries.iter().any(|e| e.fence.is_some_and(|f| f >= 256)) {
                plant(
                    "audit_records",
                    "an entry with a fence of 256 or more decoded",
                );
            }
        }
        Err(e) => assert!(
            e.message().contains("corrupt"),
            "audit store refused with an unclear error: {e}"
        ),
    }
}
