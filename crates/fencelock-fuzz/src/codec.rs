//! The server's binary codec: log records and snapshots, exactly as recovery
//! decodes them (`fencelock_server::engine::recover` → `codec::decode_*` →
//! `Core::import` / `Core::apply`).

use fencelock_core::{Command, Config, Core};
use fencelock_server::codec::{
    decode_record, decode_replicated, decode_snapshot, encode_import, encode_record,
    encode_snapshot, Replicated, RECORD_VERSION, SNAPSHOT_VERSION,
};

use crate::{plant, MAX_INPUT_BYTES};

/// Decodes `data` as one log record. Anything decoded must re-encode to the same
/// bytes (the format has one encoding per value) and apply to a core without panic.
pub fn log_record(data: &[u8]) {
    if data.len() > MAX_INPUT_BYTES {
        return;
    }
    raft_entry(data);
    let Ok((meta, command)) = decode_record(data) else {
        return;
    };
    // Only the current version re-encodes byte for byte; older ones (no metadata,
    // no principals, no modes) are written in the current one and must decode the
    // same.
    let encoded = encode_record(&meta, &command);
    if data.first() == Some(&RECORD_VERSION) {
        assert_eq!(encoded, data, "record does not round-trip");
    } else {
        assert_eq!(
            decode_record(&encoded).as_ref(),
            Ok(&(meta.clone(), command.clone())),
            "an older record does not survive re-encoding"
        );
    }
    if let Command::ForceRelease {
        fence: Some(_),
        reason,
        ..
    } = &command
    {
        if !reason.as_str().is_empty() {
            plant("log_record", "a forced release of one fence decoded");
        }
    }
    // Replay applies every decoded record to the recovered core.
    let mut core = Core::new(small_config());
    let _ = core.apply(meta.now_ms, command);
    core.take_outcomes();
    core.check_invariants()
        .unwrap_or_else(|e| panic!("invariant broken by one decoded record: {e}"));
}

/// Decodes `data` as a cluster member's Raft entry (a command record or a single
/// server's imported state): an import must re-encode to the same bytes, and a
/// command must decode exactly as a log record does.
fn raft_entry(data: &[u8]) {
    match decode_replicated(data) {
        Ok(Replicated::Import { meta, snapshot }) => {
            assert_eq!(
                encode_import(&meta, &snapshot),
                data,
                "import does not round-trip"
            );
            // Applying it decodes the image: that must fail cleanly or import.
            if let Ok(image) = decode_snapshot(&snapshot) {
                let _ = Core::import(small_config(), image);
            }
        }
        Ok(Replicated::Command(meta, command)) => {
            assert_eq!(
                decode_record(data),
                Ok((meta, command)),
                "a command entry decodes unlike a log record"
            );
        }
        Err(_) => {}
    }
}

/// Decodes `data` as a snapshot and imports it; an image the core accepts must keep
/// its invariants while commands run on it, and export to the same image.
pub fn snapshot(data: &[u8]) {
    if data.len() > MAX_INPUT_BYTES {
        return;
    }
    let Ok(image) = decode_snapshot(data) else {
        return;
    };
    // Byte 8, after the magic, is the version: only the current one re-encodes byte
    // for byte; older ones (no principals, no modes) must decode the same once
    // re-encoded.
    let encoded = encode_snapshot(&image);
    if data.get(8) == Some(&SNAPSHOT_VERSION) {
        assert_eq!(encoded, data, "snapshot does not round-trip");
    } else {
        assert_eq!(
            decode_snapshot(&encoded).as_ref(),
            Ok(&image),
            "an older snapshot does not survive re-encoding"
        );
    }
    let Ok(mut core) = Core::import(small_config(), image.clone()) else {
        return;
    };
    if image
        .locks
        .iter()
        .any(|l| l.limit >= 2 && !l.holders.is_empty())
    {
        plant("snapshot", "a snapshot with a held semaphore was imported");
    }
    // Import starts the fence counter at 1 at least (a stored 0 means 1), and
    // export lists sessions in id order whatever order they were stored in.
    let mut expected = fencelock_core::StateImage {
        next_fence: image.next_fence.max(1),
        ..image
    };
    expected.sessions.sort_by_key(|s| s.id);
    assert_eq!(
        core.export(),
        expected,
        "an imported image exports differently"
    );
    // What recovery does next: `Recover`, then time passes and deadlines fire.
    let now = core.now_ms();
    core.apply(now, Command::Recover)
        .expect("Recover never fails");
    if let Some(deadline) = core.next_deadline_ms() {
        core.apply(deadline.max(now), Command::Tick)
            .expect("Tick never fails");
    }
    core.take_outcomes();
    core.check_invariants()
        .unwrap_or_else(|e| panic!("invariant broken after importing a snapshot: {e}"));
}

/// Core bounds for decoded state: the server's defaults.
fn small_config() -> Config {
    Config::default()
}
