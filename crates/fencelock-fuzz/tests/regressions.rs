//! Inputs the fuzzers found, each kept as a test once its bug was fixed. Each test
//! names the bug it guards against.

/// fencelock-server's codec accepted a log record at service time near `u64::MAX`;
/// replaying it overflowed `now_ms + ttl_ms` in the core (a panic at start-up in a
/// debug build, a wrapped lease deadline in a release build). Now the decoder
/// refuses times above `codec::MAX_TIME_MS`.
#[test]
fn log_record_at_the_end_of_time_is_refused_not_overflowed() {
    let input = [
        2, 255, 255, 255, 255, 255, 255, 255, 255, 2, 0, 0, 0, 0, 0, 0, 0, 0, 104, 229, 207, 139,
        1, 0, 0, 1, 3, 0, 0, 0, 111, 112, 115, 1, 1, 0, 0, 0, 98, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        0, 0, 0, 0, 0, 1, 232, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 119, 49, 0,
        1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ];
    assert!(fencelock_server::codec::decode_record(&input).is_err());
    fencelock_fuzz::codec::log_record(&input);
}

/// Harness bug (not the server's): `Core::import` reads a fence counter of 0 as 1,
/// so an imported image may export `next_fence: 1` for a stored 0.
#[test]
fn snapshot_with_a_zero_fence_counter_imports_as_one() {
    // An empty state at service time 1 with a fence counter of 0.
    let mut input = b"FLSNAP01\x01".to_vec();
    input.extend_from_slice(&1u64.to_le_bytes()); // now_ms
    input.extend_from_slice(&0u64.to_le_bytes()); // next_fence
    input.extend_from_slice(&[0; 12]); // no sessions, locks or recent ends
    assert!(fencelock_server::codec::decode_snapshot(&input).is_ok());
    fencelock_fuzz::codec::snapshot(&input);
}

/// Harness bug (not the core's): a hand-off due at `now_ms` happens before the
/// command's own grant in the same step, so fences of one step come in any order.
#[test]
fn handoff_before_a_direct_grant_in_one_step() {
    let input = [
        255, 255, 255, 255, 255, 126, 255, 255, 255, 255, 255, 183, 184, 185, 186, 187, 188, 189,
        190, 191, 192, 178, 178, 178, 178, 178, 178, 178, 178, 30, 0, 0, 0, 178, 178, 178, 178,
        178, 178, 178, 178, 178, 178, 178, 178, 178, 178, 178, 178, 178, 178, 178, 178, 178, 178,
        178, 178, 178, 178, 178, 178, 178, 86, 178, 178, 178, 178, 178, 178, 178, 178, 178, 178,
        178, 178, 178, 178, 178, 178, 178, 178, 178, 178, 178, 178, 178, 178, 178, 178, 176, 178,
        178, 178, 178, 178, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 255, 255, 255, 27, 28, 29,
        30, 31, 32, 224, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 178, 178, 178, 178, 178, 178,
        178, 178, 178, 178, 178, 178, 77, 77, 77, 77, 77, 77, 77, 224, 34, 35, 36, 37, 38, 39, 40,
        178, 178, 178, 178, 178, 178, 178, 178, 178, 178, 178, 178, 178, 193, 194, 195, 208, 209,
        82, 211, 212, 178, 178, 178, 178, 178, 178, 178, 178, 30, 0, 0, 0, 178, 178, 178, 178, 178,
        178, 178, 178, 178, 178, 178, 178, 178, 178, 178, 178, 178, 178, 178, 178, 178, 178, 178,
        178, 178, 213, 0, 0, 5, 127, 128, 129, 130, 32, 255, 255, 255, 255, 255, 255, 255, 255,
        255, 255, 255,
    ];
    fencelock_fuzz::core_seq::core_commands(&input);
}

/// Harness bug (not the core's): `Core::import` accepts sessions in any order and
/// `export` lists them by id, so the round trip compares sessions sorted.
#[test]
fn snapshot_with_sessions_out_of_id_order() {
    let input = [
        70, 76, 83, 78, 65, 80, 48, 49, 1, 1, 0, 0, 0, 0, 0, 0, 0, 3, 0, 255, 255, 255, 0, 0, 0, 2,
        0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0,
        0, 0, 0, 0, 0, 2, 0, 0, 0, 119, 48, 0, 0, 232, 3, 0, 0, 0, 0, 233, 0, 3, 0, 0, 0, 0, 0, 0,
        0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 255, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ];
    fencelock_fuzz::codec::snapshot(&input);
}

/// `Core::import` accepted a session with `ttl_ms` 0 from a (checksummed) snapshot;
/// the `Recover` at start-up then gave it a deadline of `now`, breaking the
/// invariant "no session past its lease" (a panic in a debug build). Now import
/// refuses a zero TTL on sessions, holders and waiters.
#[test]
fn snapshot_with_a_zero_ttl_session_is_refused() {
    let input = [
        70, 76, 83, 78, 65, 80, 48, 49, 1, 1, 0, 0, 0, 0, 0, 0, 0, 3, 0, 255, 255, 255, 0, 0, 0, 2,
        0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0,
        0, 0, 0, 0, 0, 2, 0, 0, 0, 119, 48, 0, 0, 232, 3, 0, 0, 0, 0, 0, 0, 233, 3, 0, 0, 0, 0, 0,
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ];
    let image = fencelock_server::codec::decode_snapshot(&input).unwrap();
    let refused = fencelock_core::Core::import(Default::default(), image).unwrap_err();
    assert!(refused.message().contains("ttl_ms 0"), "{refused}");
    fencelock_fuzz::codec::snapshot(&input);
}

/// Fixed in log format version 2. A segment that is not the newest, truncated
/// inside an empty record's header so that only zero bytes remain, read as a clean
/// end in version 1: its record was dropped without an error and the next
/// segment's records followed (a gap, not a prefix; the harness had to accept a
/// subsequence). Version 2 segments record their capacity and end in a seal, so
/// this is refused now, and the harness accepts only a prefix again.
///
/// Input: 96-byte segments (an empty record each); append, sync, append, sync
/// (the roll seals `log-0` and creates `log-1`); a clean close; one damage: file 0
/// (`log-0`) cut to 59 bytes (the header and 3 zero bytes of the record's length
/// word).
#[test]
fn older_segment_cut_to_zero_bytes_is_refused() {
    let input = [0, 0, 0, 0, 0, 0, 4, 0, 0, 4, 7, 0, 1, 0, 59, 3];
    assert_eq!(
        fencelock_fuzz::disk::log_dir_outcome(&input),
        Some(fencelock_fuzz::disk::LogDirOutcome::Refused {
            file: "log-0000000000000000.seg".into()
        })
    );
}

/// The same log, undamaged but crashed, and with the older segment's last record
/// and seal zeroed instead of cut (a clean end to a version 1 reader): refused too.
#[test]
fn older_segment_zeroed_from_a_record_boundary_is_refused() {
    // Damage: file 0, at 56 (its record), kind 4 (zero), 63 more bytes: to the end.
    let input = [0, 0, 0, 0, 0, 0, 4, 0, 0, 4, 7, 1, 1, 0, 56, 4, 63];
    assert_eq!(
        fencelock_fuzz::disk::log_dir_outcome(&input),
        Some(fencelock_fuzz::disk::LogDirOutcome::Refused {
            file: "log-0000000000000000.seg".into()
        })
    );
    // Undamaged, the same input loads both records.
    let undamaged = [0, 0, 0, 0, 0, 0, 4, 0, 0, 4, 7, 1, 0];
    assert_eq!(
        fencelock_fuzz::disk::log_dir_outcome(&undamaged),
        Some(fencelock_fuzz::disk::LogDirOutcome::Loaded {
            records: 2,
            synced: 2,
            crashed: true
        })
    );
}

/// Harness bug (not the log's), found by `seeds.rs`'s proptest run: the manifest and
/// the only segment deleted after a clean close leave just `log.durable`. The log
/// ignores that file without a manifest (a directory wiped to start over may keep
/// it; see the `fencelock-log` crate docs, "The durable end") and opens a new,
/// empty log, as documented and tested in `fencelock-log`'s `corruption.rs`. The
/// harness counted `log.durable` as a surviving file, so it expected the synced
/// record and called the new log a silent loss.
///
/// Input: 96-byte segments; append an empty record, sync; a clean close; two
/// damages: file 2 (`log.manifest`) deleted, then file 0 (`log-0`) deleted.
#[test]
fn only_log_durable_left_is_a_new_log() {
    let input = [0, 0, 0, 0, 0, 0, 4, 7, 0, 2, 2, 0, 5, 0, 0, 5];
    assert_eq!(
        fencelock_fuzz::disk::log_dir_outcome(&input),
        Some(fencelock_fuzz::disk::LogDirOutcome::Loaded {
            records: 0,
            synced: 0,
            crashed: false
        })
    );
    // Without the second deletion the segment proves the manifest existed.
    let manifest_only = [0, 0, 0, 0, 0, 0, 4, 7, 0, 1, 2, 0, 5];
    assert_eq!(
        fencelock_fuzz::disk::log_dir_outcome(&manifest_only),
        Some(fencelock_fuzz::disk::LogDirOutcome::Refused {
            file: "log.manifest".into()
        })
    );
}

/// Harness bug (not the core's): an idempotent retry (same `request_id`) that arrives
/// in the step whose due deadlines hand the lock to the very waiter it retries gets
/// that grant as its reply, while the hand-off reports it as an outcome: one grant
/// (same fence, same owner token) seen twice in one step, not two grants.
#[test]
fn a_retry_answered_by_the_hand_off_of_the_same_step() {
    let input = [
        85, 0, 130, 130, 130, 130, 130, 130, 130, 130, 130, 130, 2, 130, 130, 130, 130, 130, 130,
        130, 130, 130, 130, 130, 130, 130, 130, 130, 130, 137, 138, 108, 140, 141, 142, 143, 144,
        149, 150, 147, 145, 148, 146, 151, 152, 153, 154, 155, 156, 157, 158, 159, 160, 161, 162,
        163, 164, 165, 130, 130, 130, 53, 53, 53, 53, 24, 0, 53, 36, 53, 53, 53, 53, 53, 53, 53,
        53, 53, 53, 53, 53, 48, 48, 50, 49, 53, 51, 50, 51, 51, 51, 52, 52, 50, 54, 85, 0, 0, 0, 1,
        168, 20, 0, 0, 14, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 206, 206, 206, 206, 206, 206, 206, 96,
        222, 206, 206, 206, 206, 206, 206, 206, 206, 206, 206, 206, 206, 206, 206, 206, 57, 54,
        175, 12, 0, 0, 0, 0, 0, 48, 48, 55, 48, 56, 0, 0, 0, 0, 0, 23, 0, 0, 0, 206, 206, 206, 206,
        206, 206, 206, 2, 0, 0, 0, 0, 0, 0, 0, 53, 36, 53, 53, 53, 53, 53, 53, 53, 53, 53, 53, 53,
        53, 48, 48, 50, 49, 53, 51, 50, 51, 51, 51, 52, 52, 50, 54, 85, 0, 0, 0, 1, 168, 20, 0, 0,
        14, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 206, 206, 206, 206, 206, 206, 206, 96, 206, 206, 206,
        206, 206, 206, 206, 206, 206, 206, 206, 0, 4, 0, 0, 0, 0,
    ];
    fencelock_fuzz::core_seq::core_commands(&input);
}
