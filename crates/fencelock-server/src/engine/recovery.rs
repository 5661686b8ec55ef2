//! Recovery: the state loaded from a data directory (the newest snapshot and the
//! log records after it), at start and for offline tools.

use std::path::Path;
use std::time::{Duration, Instant};

use fencelock_core::{Config as CoreConfig, Core};
use fencelock_log::{Log, LogOptions, Recovered};

use crate::audit::{self, AuditConfig, AuditEntry, AuditStore};
use crate::codec;
use crate::startup::RecoveryError;

use super::history::History;

/// What recovery found at start.
#[derive(Debug, Clone, Default)]
pub struct RecoveryReport {
    /// Whether a snapshot was loaded.
    pub snapshot_loaded: bool,
    /// Log records replayed after the snapshot.
    pub records_replayed: usize,
    /// Bytes of a torn (never acknowledged) record discarded at the log's tail.
    pub truncated_tail_bytes: u64,
    /// Locks held after recovery.
    pub locks_held: usize,
    /// The next fence.
    pub next_fence: u64,
    /// Time spent recovering.
    pub duration: Duration,
}

/// What [`recover`] loaded.
pub struct Recovery {
    /// The command log, open for appending.
    pub log: Log,
    /// The state.
    pub core: Core,
    /// What was found.
    pub report: RecoveryReport,
    /// The snapshot and records read.
    pub recovered: Recovered,
    /// The last sequence number and the rebuilt audit entries.
    pub replayed: Replayed,
    /// The audit store (`DATA_DIR/audit`), if asked for.
    pub audit: Option<AuditStore>,
}

/// Loads the state from `dir` (snapshot + log replay) without starting anything.
/// Used at start and by offline tools. With `audit`, also opens the audit store in
/// `dir/audit` (after the command log, whose lock keeps other servers out) and
/// rebuilds the entries of the records past its high-water mark
/// (see [`AuditStore::high_water`]).
///
/// Errors: [`Locked`](crate::RecoveryErrorKind::Locked) if another server has the
/// directory, [`Corrupt`](crate::RecoveryErrorKind::Corrupt) naming the file (and
/// the offset, for the log) if anything fails validation,
/// [`Io`](crate::RecoveryErrorKind::Io) if the directory cannot be read or written.
pub fn recover(
    log_opts: LogOptions,
    dir: &Path,
    config: &CoreConfig,
    audit: Option<&AuditConfig>,
) -> Result<Recovery, RecoveryError> {
    recover_into(log_opts, dir, config, audit, None)
}

/// [`recover`], also filling `history` with the events of the records replayed.
pub(crate) fn recover_into(
    log_opts: LogOptions,
    dir: &Path,
    config: &CoreConfig,
    audit: Option<&AuditConfig>,
    history: Option<&History>,
) -> Result<Recovery, RecoveryError> {
    let started = Instant::now();
    let (log, recovered) = Log::open(dir, log_opts.clone())
        .map_err(|e| RecoveryError::from_log("the data directory", e))?;
    let audit_dir = dir.join("audit");
    if audit.is_some() {
        std::fs::create_dir_all(&audit_dir)
            .map_err(|e| RecoveryError::io("create", &audit_dir, e))?;
    }
    let fsync = log_opts.fsync;
    let open_audit = audit.map(|config| {
        let config = config.clone();
        move || AuditStore::open(&audit_dir, config.clone(), fsync)
    });
    let (core, replayed, audit) = replay(
        config,
        recovered.snapshot.as_deref(),
        &recovered.records,
        dir,
        open_audit.as_ref().map(|f| f as &AuditOpener),
        history,
    )?;
    let stats = core.stats();
    let report = RecoveryReport {
        snapshot_loaded: recovered.snapshot.is_some(),
        records_replayed: recovered.records.len(),
        truncated_tail_bytes: recovered.truncated_tail_bytes,
        locks_held: stats.holders,
        next_fence: stats.next_fence,
        duration: started.elapsed(),
    };
    Ok(Recovery {
        log,
        core,
        report,
        recovered,
        replayed,
        audit,
    })
}

/// What a replay found besides the state.
#[derive(Debug, Default)]
pub struct Replayed {
    /// The highest record sequence number replayed (0 if none).
    pub last_seq: u64,
    /// Audit entries rebuilt for records past the audit store's high-water mark.
    pub audit: Vec<AuditEntry>,
}

/// Opens the audit store (on a thread of its own, beside the snapshot import).
type AuditOpener = dyn Fn() -> Result<AuditStore, RecoveryError> + Sync;

/// Rebuilds a core from a snapshot and the log records after it. With `open_audit`,
/// also opens the audit store and rebuilds the entries of the records past its
/// high-water mark.
pub(crate) fn replay(
    config: &CoreConfig,
    snapshot: Option<&[u8]>,
    records: &[Vec<u8>],
    dir: &Path,
    open_audit: Option<&AuditOpener>,
    history: Option<&History>,
) -> Result<(Core, Replayed, Option<AuditStore>), RecoveryError> {
    let corrupt = |what: String| RecoveryError::corrupt(dir, what);
    // The log records are decoded, and the audit store is opened (its index is
    // rebuilt from its own log), on other threads while this one decodes and
    // imports the snapshot: the three are independent, and a restart with a
    // million locks spends seconds on them.
    let (core, decoded, audit) = std::thread::scope(|scope| {
        let auditor = open_audit.map(|open| scope.spawn(open));
        let decoder = scope.spawn(|| {
            records
                .iter()
                .enumerate()
                .map(|(i, record)| codec::decode_record(record).map_err(|e| (i, e)))
                .collect::<Result<Vec<_>, _>>()
        });
        let core = match snapshot {
            Some(bytes) => codec::decode_snapshot(bytes)
                .map_err(|e| corrupt(format!("corrupt snapshot in {}: {e}", dir.display())))
                .and_then(|image| {
                    // Room for every record to be a grant: growing the tables
                    // mid-replay rehashed a million entries.
                    Core::import_with_room(config.clone(), image, records.len()).map_err(|e| {
                        corrupt(format!(
                            "snapshot in {} is inconsistent: {e}",
                            dir.display()
                        ))
                    })
                }),
            None => {
                let mut core = Core::new(config.clone());
                core.reserve(records.len());
                Ok(core)
            }
        };
        let decoded = decoder.join().expect("the record decoder never panics");
        let audit = auditor
            .map(|auditor| {
                auditor
                    .join()
                    .expect("opening the audit store never panics")
            })
            .transpose();
        (core, decoded, audit)
    });
    // The audit store's errors first, as when it was opened before the replay.
    let audit = audit?;
    let audit_high_water = audit.as_ref().map(AuditStore::high_water);
    let mut core = core?;
    let decoded = decoded
        .map_err(|(i, e)| corrupt(format!("corrupt log record {i} in {}: {e}", dir.display())))?;
    let mut replayed = Replayed::default();
    if let (Some(history), Some((first, _))) = (history, decoded.first()) {
        // The events of the records before these went into the snapshot.
        history.reset(first.seq.saturating_sub(1));
    }
    for (meta, command) in decoded {
        replayed.last_seq = replayed.last_seq.max(meta.seq);
        // Replies were delivered before the crash; only the state, the audit
        // entries a crash may have lost and the events watches resume from matter.
        match audit_high_water {
            Some(high_water) if meta.seq >= high_water.0 && meta.seq > 0 => {
                let result = core.apply(meta.now_ms.max(core.now_ms()), command.clone());
                let outcomes = core.take_outcomes();
                let entries = audit::entries_for(&meta, &command, &result, &outcomes);
                replayed.audit.extend(audit::missing(high_water, entries));
                if let Some(history) = history {
                    super::record_events(history, &meta, outcomes);
                }
            }
            _ => {
                let _ = core.apply(meta.now_ms.max(core.now_ms()), command);
                match history {
                    Some(history) => super::record_events(history, &meta, core.take_outcomes()),
                    None => core.discard_outcomes(),
                }
            }
        }
    }
    Ok((core, replayed, audit))
}
