//! Behaviour of `fencelock-log` through its public API, on real files in temp dirs.
//!
//! Tests that damage files compute offsets from the documented on-disk format:
//! a 56-byte segment header, then records framed as `[len u32][crc u32][payload]`,
//! and a 32-byte seal at the end of every segment but the newest.
//!
//! A crashed process never runs `Log`'s `Drop`, which records the durable end in
//! the manifest; tests of crash states use [`crash`] to drop the log that way.

use std::fs::{self, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use fencelock_log::{
    read_snapshot_file, write_snapshot_at, write_snapshot_file, Log, LogErrorKind, LogOptions,
    Recovered, MAX_RECORD_BYTES,
};

const SEGMENT_HEADER: u64 = 56;
const RECORD_HEADER: u64 = 8;
const SEAL: u64 = 32;
const MANIFEST: &str = "log.manifest";
const DURABLE: &str = "log.durable";

fn opts(segment_bytes: u64) -> LogOptions {
    LogOptions {
        segment_bytes,
        fsync: true,
    }
}

fn open(dir: &Path, opts: LogOptions) -> (Log, Recovered) {
    match Log::open(dir, opts) {
        Ok(opened) => opened,
        Err(e) => panic!("open {} failed: {e}", dir.display()),
    }
}

/// A record whose content and length vary with `i`.
fn rec(i: usize) -> Vec<u8> {
    let mut r = format!("record-{i:05}-").into_bytes();
    r.resize(r.len() + i % 37, b'a' + (i % 26) as u8);
    r
}

/// Drops `log` the way a crash would leave the directory: `Drop` records the
/// durable end in the manifest, which a crashed process never does, so the
/// manifest is put back as it was.
fn crash(log: Log) {
    let path = log.dir().join(MANIFEST);
    let saved = fs::read(&path).unwrap();
    drop(log);
    fs::write(&path, saved).unwrap();
}

/// Appends `records` as one batch and syncs.
fn write_batch(log: &mut Log, records: &[Vec<u8>]) {
    for r in records {
        log.append(r).unwrap();
    }
    let stats = log.sync().unwrap();
    assert_eq!(stats.records, records.len());
}

/// Appends `records` as one batch and writes it without syncing: what a crash
/// during its fdatasync leaves, a batch that may be torn.
fn write_unsynced(log: &mut Log, records: &[Vec<u8>]) {
    for r in records {
        log.append(r).unwrap();
    }
    log.write().unwrap();
}

/// File offsets of each record, for records written into a fresh segment 0.
fn record_offsets(records: &[Vec<u8>]) -> Vec<u64> {
    let mut off = SEGMENT_HEADER;
    records
        .iter()
        .map(|r| {
            let at = off;
            off += RECORD_HEADER + r.len() as u64;
            at
        })
        .collect()
}

fn segment(dir: &Path, seq: u64) -> PathBuf {
    dir.join(format!("log-{seq:016}.seg"))
}

fn files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

fn patch(path: &Path, offset: u64, bytes: &[u8]) {
    let f = OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(bytes, offset).unwrap();
}

fn flip_byte(path: &Path, offset: u64) {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, offset).unwrap();
    f.write_all_at(&[b[0] ^ 0x01], offset).unwrap();
}

/// Opening `dir` must fail with `Corrupt`, naming `file` (and `offset`, if given).
fn check_corrupt(dir: &Path, options: LogOptions, file: &Path, offset: Option<u64>) -> String {
    let err = match Log::open(dir, options) {
        Ok((_, rec)) => panic!(
            "expected corruption in {}, opened with {rec:?}",
            file.display()
        ),
        Err(e) => e,
    };
    let msg = err.to_string();
    assert_eq!(err.kind(), LogErrorKind::Corrupt, "{msg}");
    assert_eq!(err.path(), Some(file), "{msg}");
    let name = file.file_name().unwrap().to_str().unwrap();
    assert!(msg.contains(name), "message does not name {name}: {msg}");
    if let Some(offset) = offset {
        assert_eq!(err.offset(), Some(offset), "{msg}");
        assert!(msg.contains(&format!("offset {offset}")), "{msg}");
    }
    msg
}

#[test]
fn written_records_survive_a_process_crash_and_buffered_ones_do_not() {
    let dir = tempfile::tempdir().unwrap();
    let all: Vec<Vec<u8>> = (0..60).map(rec).collect();
    {
        let (mut log, _) = open(dir.path(), opts(256));
        write_batch(&mut log, &all[..10]);
        // Written without fdatasync, across several small segments: in the page
        // cache, which a crash of the process does not lose.
        for r in &all[10..50] {
            log.append(r).unwrap();
        }
        log.write().unwrap();
        // Only buffered in the process: lost with it.
        for r in &all[50..] {
            log.append(r).unwrap();
        }
        crash(log);
    }
    let (_log, recovered) = open(dir.path(), opts(256));
    assert_eq!(recovered.records, all[..50]);
}

#[test]
fn round_trip_across_many_small_segments_preserves_order() {
    let dir = tempfile::tempdir().unwrap();
    let all: Vec<Vec<u8>> = (0..300).map(rec).collect();
    {
        let (mut log, recovered) = open(dir.path(), opts(256));
        assert_eq!(
            recovered,
            Recovered {
                snapshot: None,
                records: vec![],
                truncated_tail_bytes: 0
            }
        );
        for batch in all[..200].chunks(7) {
            write_batch(&mut log, batch);
        }
    }
    {
        let (mut log, recovered) = open(dir.path(), opts(256));
        assert_eq!(recovered.records, all[..200]);
        assert_eq!(recovered.truncated_tail_bytes, 0);
        for batch in all[200..].chunks(11) {
            write_batch(&mut log, batch);
        }
    }
    let (_log, recovered) = open(dir.path(), opts(256));
    assert_eq!(recovered.records, all);
    let segments = files(dir.path())
        .iter()
        .filter(|n| n.ends_with(".seg"))
        .count();
    assert!(segments > 10, "expected many segments, got {segments}");
}

#[test]
fn snapshot_returns_state_and_later_records_and_deletes_obsolete_files() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = open(dir.path(), opts(512));
    let before: Vec<Vec<u8>> = (0..60).map(rec).collect();
    write_batch(&mut log, &before);
    assert!(files(dir.path()).len() > 3, "{:?}", files(dir.path()));
    assert!(log.bytes_since_snapshot() > 0);

    log.append(b"unsynced-before-snapshot").unwrap();
    log.snapshot(b"state after 61 records").unwrap();
    assert_eq!(log.bytes_since_snapshot(), 0);
    let on_disk = files(dir.path());
    assert_eq!(on_disk.len(), 4, "{on_disk:?}");
    assert_eq!(on_disk[1], DURABLE);
    assert_eq!(on_disk[2], MANIFEST);
    let snap_seq: u64 = on_disk[3]
        .strip_prefix("snap-")
        .unwrap()
        .strip_suffix(".snap")
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        snap_seq > 3,
        "snapshot should follow several segments: {on_disk:?}"
    );
    assert_eq!(on_disk[0], format!("log-{snap_seq:016}.seg"));

    let after: Vec<Vec<u8>> = (100..110).map(rec).collect();
    write_batch(&mut log, &after);
    assert!(log.bytes_since_snapshot() > 0);
    drop(log);

    let (log, recovered) = open(dir.path(), opts(512));
    assert_eq!(
        recovered.snapshot.as_deref(),
        Some(&b"state after 61 records"[..])
    );
    assert_eq!(recovered.records, after);
    assert_eq!(
        log.bytes_since_snapshot(),
        after
            .iter()
            .map(|r| RECORD_HEADER + r.len() as u64)
            .sum::<u64>()
    );

    // A second snapshot replaces the first one and its segments.
    let mut log = log;
    log.snapshot(b"second").unwrap();
    drop(log);
    let on_disk = files(dir.path());
    assert_eq!(on_disk.len(), 4, "{on_disk:?}");
    let (_, recovered) = open(dir.path(), opts(512));
    assert_eq!(recovered.snapshot.as_deref(), Some(&b"second"[..]));
    assert!(recovered.records.is_empty());
}

#[test]
fn crash_during_a_roll_before_the_seal_recovers_and_seals() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = open(dir.path(), opts(4096));
    write_batch(&mut log, &[rec(1), rec(2)]);
    let data_end = SEGMENT_HEADER + 2 * RECORD_HEADER + (rec(1).len() + rec(2).len()) as u64;
    assert_eq!(log.start_segment().unwrap(), 1);
    crash(log);
    // The crash window of a roll: segment 1 exists (empty), segment 0's seal was
    // not written yet; and leftover temp files from interrupted creations.
    patch(&segment(dir.path(), 0), data_end, &[0u8; SEAL as usize]);
    fs::write(dir.path().join("log-0000000000000002.seg.tmp"), b"partial").unwrap();
    fs::write(
        dir.path().join("snap-0000000000000002.snap.tmp"),
        b"partial",
    )
    .unwrap();
    fs::write(dir.path().join("log.manifest.tmp"), b"partial").unwrap();

    let (mut log, recovered) = open(dir.path(), opts(4096));
    assert_eq!(recovered.records, [rec(1), rec(2)]);
    assert_eq!(
        files(dir.path()),
        [
            "log-0000000000000000.seg",
            "log-0000000000000001.seg",
            DURABLE,
            MANIFEST
        ]
    );
    let sealed = fs::read(segment(dir.path(), 0)).unwrap();
    assert_ne!(
        sealed[data_end as usize..(data_end + SEAL) as usize],
        [0u8; SEAL as usize],
        "open did not finish the roll by writing the seal"
    );
    write_batch(&mut log, &[rec(3)]);
    drop(log);
    let (_, recovered) = open(dir.path(), opts(4096));
    assert_eq!(recovered.records, [rec(1), rec(2), rec(3)]);
}

#[test]
fn in_the_crash_window_of_a_roll_a_lost_last_record_is_still_corruption() {
    // Unsealed with an empty successor looks like the crash window, but the
    // successor's header says where the records end.
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = open(dir.path(), opts(4096));
    write_batch(&mut log, &[rec(1), rec(2)]);
    let second = SEGMENT_HEADER + RECORD_HEADER + rec(1).len() as u64;
    let data_end = second + RECORD_HEADER + rec(2).len() as u64;
    log.start_segment().unwrap();
    crash(log);
    let seg = segment(dir.path(), 0);
    patch(
        &seg,
        second,
        &vec![0u8; (data_end + SEAL - second) as usize],
    );
    let msg = check_corrupt(dir.path(), opts(4096), &seg, Some(second));
    assert!(msg.contains("log-0000000000000001.seg"), "{msg}");
}

#[test]
fn the_segment_after_a_snapshot_deleted_is_corruption() {
    // Snapshots are written after their segment, so no crash leaves one without it.
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = open(dir.path(), opts(4096));
    write_batch(&mut log, &[rec(1), rec(2)]);
    log.snapshot(b"state").unwrap();
    write_batch(&mut log, &[rec(3)]);
    drop(log);
    fs::remove_file(segment(dir.path(), 1)).unwrap();
    let msg = check_corrupt(dir.path(), opts(4096), &segment(dir.path(), 1), None);
    assert!(msg.contains("missing"), "{msg}");
}

#[test]
fn torn_tail_garbled_last_record_is_discarded_and_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    let records: Vec<Vec<u8>> = (0..10).map(rec).collect();
    let (mut log, _) = open(dir.path(), opts(64 << 10));
    write_batch(&mut log, &records[..6]);
    write_unsynced(&mut log, &records[6..]);
    crash(log);

    let offsets = record_offsets(&records);
    let last = offsets[9];
    patch(&segment(dir.path(), 0), last + 4, &[0xAB; 12]); // CRC and part of the payload

    let (mut log, recovered) = open(dir.path(), opts(64 << 10));
    assert_eq!(recovered.records, records[..9]);
    assert_eq!(
        recovered.truncated_tail_bytes,
        RECORD_HEADER + records[9].len() as u64
    );
    write_batch(&mut log, &[b"new".to_vec()]);
    drop(log);

    let (_, recovered) = open(dir.path(), opts(64 << 10));
    let mut expected = records[..9].to_vec();
    expected.push(b"new".to_vec());
    assert_eq!(recovered.records, expected);
    assert_eq!(
        recovered.truncated_tail_bytes, 0,
        "torn bytes must be zeroed on recovery"
    );
}

#[test]
fn torn_tail_partial_record_is_discarded_and_appends_continue() {
    let dir = tempfile::tempdir().unwrap();
    let records: Vec<Vec<u8>> = (0..8).map(rec).collect();
    let (mut log, _) = open(dir.path(), opts(64 << 10));
    write_unsynced(&mut log, &records);
    crash(log);

    // Only the header and 3 payload bytes of the last record reached the disk.
    let offsets = record_offsets(&records);
    let cut = offsets[7] + RECORD_HEADER + 3;
    patch(
        &segment(dir.path(), 0),
        cut,
        &vec![0u8; records[7].len() - 3],
    );

    let (mut log, recovered) = open(dir.path(), opts(64 << 10));
    assert_eq!(recovered.records, records[..7]);
    assert_eq!(recovered.truncated_tail_bytes, RECORD_HEADER + 3);
    let more: Vec<Vec<u8>> = (100..104).map(rec).collect();
    write_batch(&mut log, &more);
    drop(log);

    let (_, recovered) = open(dir.path(), opts(64 << 10));
    assert_eq!(recovered.records, [&records[..7], &more[..]].concat());
    assert_eq!(recovered.truncated_tail_bytes, 0);
}

#[test]
fn truncating_the_newest_segment_is_corruption_even_inside_a_record() {
    // Preallocated segments never get shorter in a crash, so a short file was cut.
    let records: Vec<Vec<u8>> = (0..8).map(rec).collect();
    let offsets = record_offsets(&records);
    for cut in [offsets[7], offsets[7] + RECORD_HEADER + 3, 4096] {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, _) = open(dir.path(), opts(64 << 10));
        write_batch(&mut log, &records);
        crash(log);
        let seg = segment(dir.path(), 0);
        OpenOptions::new()
            .write(true)
            .open(&seg)
            .unwrap()
            .set_len(cut)
            .unwrap();
        let msg = check_corrupt(dir.path(), opts(64 << 10), &seg, Some(cut));
        assert!(msg.contains("truncated"), "{msg}");
    }
}

#[test]
fn torn_write_that_lost_a_sector_inside_the_final_batch_is_a_torn_tail() {
    let dir = tempfile::tempdir().unwrap();
    let first = vec![rec(0), rec(1)];
    let last = vec![vec![b'b'; 3000], rec(2), rec(3)];
    let (mut log, _) = open(dir.path(), opts(64 << 10));
    write_batch(&mut log, &first);
    write_unsynced(&mut log, &last);
    crash(log);

    // Writeback persisted the end of the last batch but lost a sector in its middle.
    let offsets = record_offsets(&[first.clone(), last.clone()].concat());
    let big = offsets[2];
    let sector = (big + RECORD_HEADER).div_ceil(512) * 512;
    patch(&segment(dir.path(), 0), sector, &[0u8; 512]);

    let (mut log, recovered) = open(dir.path(), opts(64 << 10));
    assert_eq!(recovered.records, first);
    let end = offsets[4] + RECORD_HEADER + last[2].len() as u64;
    assert_eq!(recovered.truncated_tail_bytes, end - big);
    write_batch(&mut log, &[b"c".to_vec()]);
    drop(log);
    let (_, recovered) = open(dir.path(), opts(64 << 10));
    assert_eq!(
        recovered.records,
        [first[0].clone(), first[1].clone(), b"c".to_vec()]
    );
    assert_eq!(recovered.truncated_tail_bytes, 0);
}

#[test]
fn flipped_byte_in_record_followed_by_a_later_batch_is_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let records: Vec<Vec<u8>> = (0..10).map(rec).collect();
    let (mut log, _) = open(dir.path(), opts(64 << 10));
    write_batch(&mut log, &records[..5]);
    write_batch(&mut log, &records[5..]);
    drop(log);

    let offsets = record_offsets(&records);
    let seg = segment(dir.path(), 0);
    flip_byte(&seg, offsets[2] + RECORD_HEADER + 3);
    let msg = check_corrupt(dir.path(), opts(64 << 10), &seg, Some(offsets[2]));
    assert!(msg.contains("checksum mismatch"), "{msg}");
    assert!(msg.contains("later sync batch"), "{msg}");
}

#[test]
fn lost_sector_in_a_batch_followed_by_a_later_batch_is_corruption() {
    // Regression guard: zeros inside a record look like a torn write, but a later
    // batch proves the record had been fdatasynced; dropping it would lose
    // acknowledged records.
    let dir = tempfile::tempdir().unwrap();
    let records = vec![rec(0), vec![b'b'; 3000], rec(1), rec(2), rec(3)];
    let (mut log, _) = open(dir.path(), opts(64 << 10));
    write_batch(&mut log, &records[..3]);
    write_batch(&mut log, &records[3..]);
    drop(log);

    let offsets = record_offsets(&records);
    let seg = segment(dir.path(), 0);
    patch(
        &seg,
        (offsets[1] + RECORD_HEADER).div_ceil(512) * 512,
        &[0u8; 512],
    );
    let msg = check_corrupt(dir.path(), opts(64 << 10), &seg, Some(offsets[1]));
    assert!(msg.contains("later sync batch"), "{msg}");
}

#[test]
fn after_a_crash_a_flipped_byte_in_the_final_synced_batch_is_corruption() {
    // Issue 19, item 9: a bit flip in an acknowledged record of the final batch
    // was dropped as a torn tail and its fence issued again. log.durable, written
    // after the fdatasync returned, proves the batch had been durable.
    let dir = tempfile::tempdir().unwrap();
    let records: Vec<Vec<u8>> = (0..10).map(rec).collect();
    let (mut log, _) = open(dir.path(), opts(64 << 10));
    write_batch(&mut log, &records[..4]);
    write_batch(&mut log, &records[4..]);
    crash(log);

    let offsets = record_offsets(&records);
    let seg = segment(dir.path(), 0);
    flip_byte(&seg, offsets[6] + RECORD_HEADER);
    let msg = check_corrupt(dir.path(), opts(64 << 10), &seg, Some(offsets[6]));
    assert!(msg.contains(DURABLE), "{msg}");
    // Refusing changed nothing: the damage is still there to refuse again.
    check_corrupt(dir.path(), opts(64 << 10), &seg, Some(offsets[6]));
}

#[test]
fn after_a_power_loss_that_lost_the_durable_end_a_flipped_final_batch_looks_torn() {
    // Documented limit: log.durable is not synced per batch, so a power loss can
    // lose its last write; then nothing proves the final batch's fdatasync
    // completed, and damage inside it is handled like a torn write.
    let dir = tempfile::tempdir().unwrap();
    let records: Vec<Vec<u8>> = (0..10).map(rec).collect();
    let (mut log, _) = open(dir.path(), opts(64 << 10));
    write_batch(&mut log, &records[..4]);
    let before_last = fs::read(dir.path().join(DURABLE)).unwrap();
    write_batch(&mut log, &records[4..]);
    crash(log);
    fs::write(dir.path().join(DURABLE), before_last).unwrap();

    let offsets = record_offsets(&records);
    flip_byte(&segment(dir.path(), 0), offsets[6] + RECORD_HEADER);
    let (_, recovered) = open(dir.path(), opts(64 << 10));
    assert_eq!(recovered.records, records[..6]);
    let end = offsets[9] + RECORD_HEADER + records[9].len() as u64;
    assert_eq!(recovered.truncated_tail_bytes, end - offsets[6]);
}

#[test]
fn a_torn_tail_after_the_durable_end_is_still_recovered() {
    // The batch after the last completed fdatasync is torn (a sector of it lost)
    // while log.durable marks the batch before: dropped, the rest kept.
    let dir = tempfile::tempdir().unwrap();
    let records: Vec<Vec<u8>> = (0..6).map(rec).collect();
    let (mut log, _) = open(dir.path(), opts(64 << 10));
    write_batch(&mut log, &records[..3]);
    write_unsynced(&mut log, &records[3..]);
    crash(log);
    let offsets = record_offsets(&records);
    patch(&segment(dir.path(), 0), offsets[4] + 2, &[0xEE; 5]);
    let (_, recovered) = open(dir.path(), opts(64 << 10));
    assert_eq!(recovered.records, records[..4]);
    assert!(recovered.truncated_tail_bytes > 0);
}

#[test]
fn a_replaced_or_deleted_directory_poisons_the_log() {
    // Issue 19, item 5: after `rm -rf` of the data directory the server went on
    // acknowledging. The log notices and refuses to write into whatever sits at
    // the path now.
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("data");
    let (mut log, _) = open(&dir, opts(64 << 10));
    write_batch(&mut log, &[rec(1)]);
    log.check_identity().unwrap();
    fs::remove_dir_all(&dir).unwrap();
    let err = log.check_identity().unwrap_err();
    assert_eq!(err.kind(), LogErrorKind::Replaced, "{err}");
    assert!(err.to_string().contains("data"), "{err}");
    assert_eq!(log.sync().unwrap_err().kind(), LogErrorKind::Poisoned);
    // Replaced by a new directory: refused too, and the new one is left alone.
    let (mut log, _) = open(&dir, opts(64 << 10));
    let moved = parent.path().join("moved");
    fs::rename(&dir, &moved).unwrap();
    fs::create_dir(&dir).unwrap();
    assert_eq!(
        log.start_segment().unwrap_err().kind(),
        LogErrorKind::Replaced
    );
    drop(log);
    assert!(files(&dir).is_empty(), "{:?}", files(&dir));
    // A segment replaced under a live directory.
    let (mut log, _) = open(&moved, opts(64 << 10));
    let seg = segment(&moved, 0);
    let bytes = fs::read(&seg).unwrap();
    fs::remove_file(&seg).unwrap();
    fs::write(&seg, bytes).unwrap();
    let err = log.check_identity().unwrap_err();
    assert_eq!(err.kind(), LogErrorKind::Replaced, "{err}");
    assert!(err.to_string().contains("active segment"), "{err}");
}

#[test]
fn after_a_clean_close_damage_in_the_final_batch_is_corruption() {
    // The manifest records the durable end at close, so the final batch is known
    // to have been synced: a flipped byte, or the batch zeroed from a record
    // boundary to the end, is refused, not dropped as a torn tail.
    let records: Vec<Vec<u8>> = (0..10).map(rec).collect();
    let offsets = record_offsets(&records);
    let end = offsets[9] + RECORD_HEADER + records[9].len() as u64;
    type Damage = fn(&Path, &[u64], u64);
    let damage: [(&str, Damage); 2] = [
        ("flip", |seg, offsets, _| {
            flip_byte(seg, offsets[6] + RECORD_HEADER)
        }),
        ("zeroed at a record boundary", |seg, offsets, end| {
            patch(seg, offsets[6], &vec![0u8; (end - offsets[6]) as usize])
        }),
    ];
    for (what, damage) in damage {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, _) = open(dir.path(), opts(64 << 10));
        write_batch(&mut log, &records[..4]);
        write_batch(&mut log, &records[4..]);
        drop(log);
        let seg = segment(dir.path(), 0);
        damage(&seg, &offsets, end);
        let msg = check_corrupt(dir.path(), opts(64 << 10), &seg, Some(offsets[6]));
        assert!(msg.contains("manifest"), "{what}: {msg}");
    }
}

#[test]
fn damage_in_an_older_segment_is_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let records: Vec<Vec<u8>> = (0..40).map(rec).collect();
    let (mut log, _) = open(dir.path(), opts(256));
    for batch in records.chunks(3) {
        write_batch(&mut log, batch);
    }
    drop(log);
    // The last record of segment 0 (a full, fdatasynced, older segment).
    let seg = segment(dir.path(), 0);
    let mut off = SEGMENT_HEADER;
    let mut last = off;
    for r in &records {
        if off + RECORD_HEADER + r.len() as u64 > 256 - SEAL {
            break;
        }
        last = off;
        off += RECORD_HEADER + r.len() as u64;
    }
    flip_byte(&seg, last + RECORD_HEADER);
    let msg = check_corrupt(dir.path(), opts(256), &seg, Some(last));
    assert!(msg.contains("not the newest"), "{msg}");
}

#[test]
fn corrupt_snapshot_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = open(dir.path(), opts(4096));
    write_batch(&mut log, &[rec(1)]);
    log.snapshot(b"the state of the world").unwrap();
    write_batch(&mut log, &[rec(2)]);
    drop(log);
    let snap = dir.path().join("snap-0000000000000001.snap");
    assert!(snap.exists(), "{:?}", files(dir.path()));
    flip_byte(&snap, 32 + 5);
    let msg = check_corrupt(dir.path(), opts(4096), &snap, None);
    assert!(msg.contains("checksum"), "{msg}");
}

#[test]
fn missing_middle_segment_is_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = open(dir.path(), opts(256));
    for batch in (0..60).map(rec).collect::<Vec<_>>().chunks(5) {
        write_batch(&mut log, batch);
    }
    drop(log);
    assert!(segment(dir.path(), 3).exists());
    fs::remove_file(segment(dir.path(), 2)).unwrap();
    let msg = check_corrupt(dir.path(), opts(256), &segment(dir.path(), 2), None);
    assert!(msg.contains("missing"), "{msg}");

    // Losing the first segment without a snapshot is caught the same way.
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = open(dir.path(), opts(256));
    write_batch(&mut log, &(0..30).map(rec).collect::<Vec<_>>());
    drop(log);
    fs::remove_file(segment(dir.path(), 0)).unwrap();
    check_corrupt(dir.path(), opts(256), &segment(dir.path(), 0), None);
}

#[test]
fn bad_segment_header_is_corruption() {
    for (what, offset, bytes) in [
        ("magic", 0, &b"NOTALOG!"[..]),
        ("version", 8, &[9, 0, 0, 0][..]),
        ("seq", 16, &[5][..]),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, _) = open(dir.path(), opts(4096));
        write_batch(&mut log, &[rec(1)]);
        drop(log);
        let seg = segment(dir.path(), 0);
        patch(&seg, offset, bytes);
        let msg = check_corrupt(dir.path(), opts(4096), &seg, Some(0));
        assert!(msg.contains("segment"), "{what}: {msg}");
    }
}

#[test]
fn segment_under_the_wrong_name_is_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = open(dir.path(), opts(4096));
    write_batch(&mut log, &[rec(1)]);
    let segment_0 = fs::read(segment(dir.path(), 0)).unwrap();
    log.snapshot(b"state").unwrap();
    drop(log);
    // A stale copy of segment 0 restored under segment 1's name.
    fs::write(segment(dir.path(), 1), segment_0).unwrap();
    let msg = check_corrupt(dir.path(), opts(4096), &segment(dir.path(), 1), Some(0));
    assert!(msg.contains("sequence 0"), "{msg}");
}

#[test]
fn fresh_segment_is_preallocated() {
    let dir = tempfile::tempdir().unwrap();
    let segment_bytes = 1 << 20;
    let (_log, _) = open(dir.path(), opts(segment_bytes));
    let meta = fs::metadata(segment(dir.path(), 0)).unwrap();
    assert_eq!(meta.len(), segment_bytes);
    // ext4/xfs/tmpfs support fallocate; the zero-writing fallback allocates too.
    assert!(
        meta.blocks() * 512 >= segment_bytes,
        "only {} blocks allocated",
        meta.blocks()
    );
}

#[test]
fn record_too_large_is_an_error_and_log_stays_usable() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = open(dir.path(), opts(64 << 10));
    log.append(b"before").unwrap();
    let err = log.append(&vec![0u8; MAX_RECORD_BYTES + 1]).unwrap_err();
    assert_eq!(err.kind(), LogErrorKind::TooLarge, "{err}");
    log.append(b"after").unwrap();
    log.sync().unwrap();
    drop(log);
    let (_, recovered) = open(dir.path(), opts(64 << 10));
    assert_eq!(recovered.records, [b"before".to_vec(), b"after".to_vec()]);
}

#[test]
fn record_larger_than_a_segment_gets_its_own_bigger_segment() {
    let dir = tempfile::tempdir().unwrap();
    let big = vec![7u8; 10_000];
    let (mut log, _) = open(dir.path(), opts(4096));
    write_batch(
        &mut log,
        &[rec(1), big.clone(), rec(2), vec![], big.clone()],
    );
    drop(log);
    let (_, recovered) = open(dir.path(), opts(4096));
    assert_eq!(
        recovered.records,
        [rec(1), big.clone(), rec(2), vec![], big.clone()]
    );
    let len = fs::metadata(segment(dir.path(), 1)).unwrap().len();
    assert_eq!(
        len,
        SEGMENT_HEADER + RECORD_HEADER + big.len() as u64 + SEAL
    );
}

#[test]
fn empty_records_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let records = vec![vec![], b"x".to_vec(), vec![], vec![]];
    let (mut log, _) = open(dir.path(), opts(4096));
    write_batch(&mut log, &records);
    write_batch(&mut log, &[vec![]]);
    drop(log);
    let (_, recovered) = open(dir.path(), opts(4096));
    assert_eq!(recovered.records, [&records[..], &[vec![]]].concat());
}

#[test]
fn one_fdatasync_per_sync_and_bounded_write_behind() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = open(dir.path(), opts(64 << 20));
    let records: Vec<Vec<u8>> = (0..6000).map(|i| vec![(i % 251) as u8; 1000]).collect();
    for r in &records {
        log.append(r).unwrap();
    }
    let stats = log.sync().unwrap();
    assert_eq!(stats.records, 6000);
    assert_eq!(stats.bytes, 6000 * 1008);
    assert_eq!(stats.fsyncs, 1);
    assert_eq!(log.sync().unwrap().fsyncs, 0, "nothing to sync");
    drop(log);
    let (_, recovered) = open(dir.path(), opts(64 << 20));
    assert_eq!(recovered.records, records);
}

#[test]
fn fsync_false_round_trips_after_clean_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let options = LogOptions {
        segment_bytes: 512,
        fsync: false,
    };
    let records: Vec<Vec<u8>> = (0..50).map(rec).collect();
    let (mut log, _) = open(dir.path(), options.clone());
    write_batch(&mut log, &records[..30]);
    assert_eq!(log.sync().unwrap().fsyncs, 0);
    log.snapshot(b"snap").unwrap();
    write_batch(&mut log, &records[30..]);
    drop(log);
    let (_, recovered) = open(dir.path(), options);
    assert_eq!(recovered.snapshot.as_deref(), Some(&b"snap"[..]));
    assert_eq!(recovered.records, records[30..]);
}

#[test]
fn second_open_of_the_same_directory_is_locked() {
    let dir = tempfile::tempdir().unwrap();
    let (log, _) = open(dir.path(), opts(4096));
    let err = Log::open(dir.path(), opts(4096)).unwrap_err();
    assert_eq!(err.kind(), LogErrorKind::Locked, "{err}");
    drop(log);
    open(dir.path(), opts(4096));
}

#[test]
fn invalid_segment_size_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let err = Log::open(dir.path(), opts(10)).unwrap_err();
    assert_eq!(err.kind(), LogErrorKind::InvalidOptions, "{err}");
}

#[test]
fn snapshot_file_round_trip_and_corruption_detection() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("backup.snap");
    for state in [&b""[..], &b"some state"[..], &vec![0x5a; 100_000][..]] {
        write_snapshot_file(&path, state).unwrap();
        assert_eq!(read_snapshot_file(&path).unwrap(), state);
    }
    assert_eq!(
        files(dir.path()),
        ["backup.snap"],
        "no temp file left behind"
    );

    let len = fs::metadata(&path).unwrap().len();
    let truncate = |p: &Path| {
        let f = OpenOptions::new().write(true).open(p).unwrap();
        f.set_len(len - 1).unwrap();
    };
    type Damage<'a> = &'a dyn Fn(&Path);
    let damage: [(&str, Damage); 4] = [
        ("payload bit flip", &|p| flip_byte(p, 32 + 777)),
        ("bad magic", &|p| patch(p, 0, b"X")),
        ("length field", &|p| flip_byte(p, 16)),
        ("truncated", &truncate),
    ];
    for (what, damage) in damage {
        write_snapshot_file(&path, &vec![0x5a; 100_000]).unwrap();
        damage(&path);
        let err = read_snapshot_file(&path).unwrap_err();
        assert_eq!(err.kind(), LogErrorKind::Corrupt, "{what}: {err}");
        assert!(err.to_string().contains("backup.snap"), "{what}: {err}");
    }
}

/// xorshift64*: a tiny deterministic generator so failures replay from their seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// A record with runs of zeros (like encoded integers) and an occasional empty one.
    fn record(&mut self) -> Vec<u8> {
        let len = match self.below(8) {
            0 => 0,
            1 => 600 + self.below(1500),
            _ => 1 + self.below(120),
        };
        (0..len)
            .map(|_| {
                if self.below(3) == 0 {
                    0
                } else {
                    self.next() as u8
                }
            })
            .collect()
    }
}

/// Simulates a machine crash during the last, unsynced batch: every 512-byte sector
/// the batch touched independently keeps its old contents (zeros), gets the new
/// contents, or gets only a prefix of them. Recovery must succeed and return all
/// synced records plus a prefix of the torn batch, and appends must continue.
fn check_crash(seed: u64) {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let dir = tempfile::tempdir().unwrap();
    let options = LogOptions {
        segment_bytes: 256 << 10,
        fsync: false,
    };
    let seg = segment(dir.path(), 0);
    let (mut log, _) = open(dir.path(), options.clone());
    let mut synced = Vec::new();
    for _ in 0..1 + rng.below(4) {
        let batch: Vec<Vec<u8>> = (0..1 + rng.below(6)).map(|_| rng.record()).collect();
        write_batch(&mut log, &batch);
        synced.extend(batch);
    }
    let durable = fs::read(&seg).unwrap();
    let torn: Vec<Vec<u8>> = (0..1 + rng.below(8)).map(|_| rng.record()).collect();
    write_unsynced(&mut log, &torn);
    crash(log);
    let written = fs::read(&seg).unwrap();

    let mut image = durable.clone();
    for (i, (old, new)) in durable.chunks(512).zip(written.chunks(512)).enumerate() {
        if old == new {
            continue;
        }
        let keep = match rng.below(3) {
            0 => 0,
            1 => new.len(),
            _ => rng.below(new.len() as u64) as usize,
        };
        image[i * 512..i * 512 + keep].copy_from_slice(&new[..keep]);
    }
    fs::write(&seg, &image).unwrap();

    let (mut log, recovered) = match Log::open(dir.path(), options.clone()) {
        Ok(opened) => opened,
        Err(e) => panic!("seed {seed}: recovery after a simulated crash failed: {e}"),
    };
    let got = &recovered.records;
    assert!(
        got.len() >= synced.len(),
        "seed {seed}: lost synced records"
    );
    assert_eq!(
        got[..synced.len()],
        synced[..],
        "seed {seed}: synced records differ"
    );
    let kept = got.len() - synced.len();
    assert_eq!(
        got[synced.len()..],
        torn[..kept],
        "seed {seed}: not a prefix of the torn batch"
    );
    if image == written {
        assert_eq!(
            kept,
            torn.len(),
            "seed {seed}: a complete batch was dropped"
        );
    }
    write_batch(&mut log, &[b"after crash".to_vec()]);
    drop(log);
    let (_, again) = open(dir.path(), options);
    assert_eq!(again.truncated_tail_bytes, 0, "seed {seed}");
    assert_eq!(again.records[..got.len()], got[..], "seed {seed}");
    assert_eq!(
        again.records[got.len()..],
        [b"after crash".to_vec()],
        "seed {seed}"
    );
}

#[test]
fn recovery_after_simulated_crashes_keeps_synced_records() {
    // Replay one failure with FENCELOCK_LOG_SEED=<seed>.
    if let Ok(seed) = std::env::var("FENCELOCK_LOG_SEED") {
        return check_crash(seed.parse().expect("FENCELOCK_LOG_SEED must be a u64"));
    }
    for seed in 0..300 {
        check_crash(seed);
    }
}

fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// The background-snapshot protocol: cut the log, keep appending, write the snapshot
/// of the state at the cut from elsewhere, then forget what it covers.
#[test]
fn snapshot_at_a_cut_while_appending_continues() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = open(dir.path(), opts(4096));
    let before: Vec<Vec<u8>> = (0..50).map(rec).collect();
    write_batch(&mut log, &before);
    let cut = log.start_segment().unwrap();
    let after: Vec<Vec<u8>> = (50..60).map(rec).collect();
    write_batch(&mut log, &after[..5]);
    // Forgetting before the snapshot exists is refused: it would lose records.
    assert_eq!(
        log.forget_before(cut).unwrap_err().kind(),
        LogErrorKind::InvalidOptions
    );
    write_snapshot_at(dir.path(), cut, b"state-at-cut", true).unwrap();
    write_batch(&mut log, &after[5..]);
    // A crash here (snapshot written, old segments still there) recovers too.
    drop(log);
    let (mut log, recovered) = open(dir.path(), opts(4096));
    assert_eq!(recovered.snapshot.as_deref(), Some(&b"state-at-cut"[..]));
    assert_eq!(recovered.records, after);
    assert!(
        names(dir.path())
            .iter()
            .all(|n| !n.starts_with("log-") || n >= &format!("log-{cut:016}.seg")),
        "open removes segments the snapshot covers: {:?}",
        names(dir.path())
    );
    // The normal path: forget_before removes them while running.
    let cut2 = log.start_segment().unwrap();
    write_batch(&mut log, &[rec(99)]);
    write_snapshot_at(dir.path(), cut2, b"state-2", true).unwrap();
    log.forget_before(cut2).unwrap();
    let files = names(dir.path());
    assert_eq!(
        files.iter().filter(|n| n.starts_with("snap-")).count(),
        1,
        "{files:?}"
    );
    assert!(
        files
            .iter()
            .filter(|n| n.starts_with("log-"))
            .all(|n| n >= &format!("log-{cut2:016}.seg")),
        "{files:?}"
    );
    // A cut that does not exist yet is refused.
    assert_eq!(
        log.forget_before(cut2 + 5).unwrap_err().kind(),
        LogErrorKind::InvalidOptions
    );
    drop(log);
    let (_, recovered) = open(dir.path(), opts(4096));
    assert_eq!(recovered.snapshot.as_deref(), Some(&b"state-2"[..]));
    assert_eq!(recovered.records, vec![rec(99)]);
}
