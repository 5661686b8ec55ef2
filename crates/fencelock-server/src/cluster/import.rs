//! A single server's data directory becomes the first member of a cluster,
//! keeping its locks, sessions and fences.
//!
//! `start_cluster` on a directory that holds a single server's log goes through
//! these steps, each durable before the next, so that a crash anywhere leaves a
//! directory the next start carries on from, without losing the state or importing
//! it twice:
//!
//! 1. [`prepare`] recovers the single server's state (snapshot and log, as a
//!    restart would) and writes its image to `raft/import.snap` — a backup file:
//!    temp name, fdatasync, rename, directory fsync.
//! 2. It moves the single server's files (segments, snapshots, manifest, durable
//!    mark, audit log) into `imported-single-node/`, one rename each; a start that
//!    finds some still in place with `raft/import.snap` staged moves the rest.
//! 3. The member forms a one-member cluster and, once it leads, proposes the image
//!    as an import entry ([`crate::codec::Replicated::Import`]). Every member
//!    applies it the same way, to an *empty* state only (no locks, sessions or
//!    recently ended grants): the image replaces it, its times shifted to the
//!    cluster's service time, its next fence raised to the cluster's if that is
//!    larger, then `Recover` runs as at a single server's restart (every lease and
//!    session gets a full TTL, queued requests are dropped).
//! 4. Once the entry is applied here, `raft/import.snap` is deleted ([`finish`]);
//!    only then does the member serve clients (until then they get 503
//!    `unavailable`).
//!
//! Idempotence: after step 2 the single server's files are out of the way, so the
//! image is read from `raft/import.snap` only, and proposed again at every start
//! until step 4. A crash between 3 and 4 leaves the entry in the Raft log: the
//! restarted member replays it (applying it to its empty state), remembers its
//! digest, and answers the new proposal of the same image "already imported"
//! instead of applying it — the state is not empty any more. Any other import
//! into a state that is not empty is refused by every member alike, and the
//! member stops.
//!
//! Refused at start, with a message naming this workflow: a single server's files
//! beside Raft state without a staged import (which of the two holds the locks?),
//! and a single server's directory started with more than one member in `--peers`
//! or with `--join` (another member could serve clients from an empty state before
//! the import).

use std::path::{Path, PathBuf};

use fencelock_core::StateImage;

use super::ClusterConfig;
use crate::codec;
use crate::engine::EngineConfig;
use crate::startup::{RecoveryError, StartError};

/// The staged image, in the Raft directory, while an import is under way.
pub const STAGED_FILE: &str = "import.snap";
/// Where the single server's files go, in the data directory.
pub const ASIDE_DIR: &str = "imported-single-node";
/// The largest image that can be imported: one Raft log entry holds it, and a
/// log record is at most `fencelock_log::MAX_RECORD_BYTES` (the rest is room for
/// the entry's own fields).
pub const MAX_IMPORT_BYTES: usize = fencelock_log::MAX_RECORD_BYTES - (64 << 10);

/// A single server's state staged for import.
#[derive(Debug, Clone)]
pub struct Staged {
    /// `codec::encode_snapshot` of the image (the content of [`STAGED_FILE`]).
    pub snapshot: Vec<u8>,
    /// The staged file, deleted once the import is applied.
    pub path: PathBuf,
}

/// The SHA-256 of a staged image: how a member recognises an import it applied.
pub(crate) fn digest(snapshot: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, snapshot);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// Moves every service time of `image` forward by `delta_ms`: the state as if
/// the single server's clock had been the cluster's. Relations between times
/// (deadlines after now, grants before it) are kept, so the image stays valid.
pub(crate) fn shift_times(image: &mut StateImage, delta_ms: u64) {
    let shift = |t: &mut u64| *t = t.saturating_add(delta_ms);
    shift(&mut image.now_ms);
    for lock in &mut image.locks {
        shift(&mut lock.blocked_until_ms);
        for h in &mut lock.holders {
            shift(&mut h.granted_at_ms);
            if let fencelock_core::LeaseImage::Own { deadline_ms, .. } = &mut h.lease {
                shift(deadline_ms);
            }
        }
        for w in &mut lock.waiters {
            shift(&mut w.enqueued_at_ms);
            shift(&mut w.wait_deadline_ms);
        }
    }
    for s in &mut image.sessions {
        shift(&mut s.deadline_ms);
    }
}

/// Whether `name`, at the top of a data directory, is one of a single server's
/// log files (see the `fencelock-log` crate docs), or a leftover of writing one.
fn is_single_node_file(name: &str) -> bool {
    let base = name.strip_suffix(".tmp").unwrap_or(name);
    (base.starts_with("log-") && base.ends_with(".seg"))
        || (base.starts_with("snap-") && base.ends_with(".snap"))
        || base == "log.manifest"
        || name == "log.durable"
}

/// The single server's files at the top of `dir`, sorted.
fn single_node_files(dir: &Path) -> std::io::Result<Vec<String>> {
    let mut names = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(names),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let name = entry?.file_name();
        if let Some(name) = name.to_str() {
            if is_single_node_file(name) {
                names.push(name.to_owned());
            }
        }
    }
    names.sort();
    Ok(names)
}

/// Whether `raft_dir` holds a member's Raft state (a log or a state machine
/// snapshot).
fn has_raft_state(raft_dir: &Path) -> bool {
    let log_files = std::fs::read_dir(raft_dir.join("log"))
        .map(|mut entries| entries.next().is_some())
        .unwrap_or(false);
    log_files || raft_dir.join("sm.snap").exists()
}

fn refuse(what: String) -> StartError {
    StartError::config(what)
}

fn io_error(what: &str, path: &Path, e: std::io::Error) -> StartError {
    RecoveryError::io(what, path, e).into()
}

fn corrupt(what: &str, path: &Path, e: impl std::fmt::Display) -> StartError {
    RecoveryError::corrupt(path, format!("cannot {what} {}: {e}", path.display())).into()
}

/// Steps 1 and 2 (see the module docs): finds a single server's state in the data
/// directory or a staged one in the Raft directory, stages it and moves the single
/// server's files aside. `None`: nothing to import. Refuses what it cannot import
/// safely.
pub fn prepare(config: &EngineConfig, raft_dir: &Path) -> Result<Option<Staged>, StartError> {
    let dir = &config.data_dir;
    let cluster = config
        .cluster
        .as_ref()
        .ok_or_else(|| refuse("an import needs a cluster configuration".into()))?;
    let files = single_node_files(dir).map_err(|e| io_error("list", dir, e))?;
    let staged_path = raft_dir.join(STAGED_FILE);
    let staged = staged_path.exists();
    if files.is_empty() && !staged {
        return Ok(None);
    }
    refuse_unless_alone(dir, cluster)?;
    let snapshot = if staged {
        let bytes = fencelock_log::read_snapshot_file(&staged_path)
            .map_err(|e| RecoveryError::from_log("the staged import", e))?;
        check(config, &bytes, &staged_path)?;
        bytes
    } else {
        if has_raft_state(raft_dir) {
            return Err(refuse(format!(
                "{} holds both a cluster member's Raft state ({}) and a single server's data \
                 not imported into it ({}); refusing to guess which holds the locks: move one \
                 of them away (see README, \"From a single server\")",
                dir.display(),
                raft_dir.display(),
                files.join(", ")
            )));
        }
        let aside = dir.join(ASIDE_DIR);
        if std::fs::read_dir(&aside).is_ok_and(|mut e| e.next().is_some()) {
            return Err(refuse(format!(
                "{} holds a single server's data to import, but {} is not empty (an earlier \
                 import?); move it away first",
                dir.display(),
                aside.display()
            )));
        }
        let bytes = recover_image(config)?;
        fencelock_log::write_snapshot_file(&staged_path, &bytes)
            .map_err(|e| RecoveryError::from_log("the staged import", e))?;
        tracing::info!(
            staged = %staged_path.display(),
            bytes = bytes.len(),
            "staged a single server's state for import into a new cluster"
        );
        bytes
    };
    if !files.is_empty() {
        move_aside(dir, &files)
            .map_err(|e| io_error("move the single server's files out of", dir, e))?;
        tracing::info!(
            to = %dir.join(ASIDE_DIR).display(),
            files = files.len(),
            "moved the single server's files aside"
        );
    }
    Ok(Some(Staged {
        snapshot,
        path: staged_path,
    }))
}

/// A single server's state goes into a new cluster of one member: a member that
/// joins, or one of several that form a cluster, could serve clients from an empty
/// state before the import is applied.
fn refuse_unless_alone(dir: &Path, cluster: &ClusterConfig) -> Result<(), StartError> {
    let alone =
        !cluster.join && cluster.peers.len() == 1 && cluster.peers.contains_key(&cluster.node_id);
    if alone {
        return Ok(());
    }
    Err(refuse(format!(
        "{} holds a single server's data (or its import is under way): it becomes the first \
         member of a cluster when this member starts alone, with --peers {}={} (not --join), \
         and imports it; then start the others with --join and add them with `fencelock \
         cluster add` (see README, \"From a single server\")",
        dir.display(),
        cluster.node_id,
        cluster.peer_listen
    )))
}

/// Recovers the single server's state as its own restart would (snapshot, then the
/// log), and encodes its image.
fn recover_image(config: &EngineConfig) -> Result<Vec<u8>, StartError> {
    let log_opts = fencelock_log::LogOptions {
        segment_bytes: config.segment_bytes,
        fsync: config.durability == crate::engine::Durability::Fsync,
    };
    let recovery = crate::engine::recover(log_opts, &config.data_dir, &config.core, None)?;
    // Closing the log releases the directory's lock before its files move.
    drop(recovery.log);
    if recovery.report.truncated_tail_bytes > 0 {
        tracing::warn!(
            bytes = recovery.report.truncated_tail_bytes,
            "discarded a torn record at the end of the single server's log (never acknowledged)"
        );
    }
    let image = recovery.core.export();
    let bytes = codec::encode_snapshot(&image);
    if bytes.len() > MAX_IMPORT_BYTES {
        return Err(refuse(format!(
            "the single server's state in {} is {} bytes encoded, more than an import \
             can carry ({MAX_IMPORT_BYTES} bytes, one Raft log entry); nothing was moved",
            config.data_dir.display(),
            bytes.len()
        )));
    }
    tracing::info!(
        locks = image.locks.len(),
        sessions = image.sessions.len(),
        next_fence = image.next_fence,
        "recovered the single server's state to import"
    );
    Ok(bytes)
}

/// Checks a staged image the way every member will apply it.
fn check(config: &EngineConfig, bytes: &[u8], path: &Path) -> Result<(), StartError> {
    let image = codec::decode_snapshot(bytes).map_err(|e| corrupt("decode", path, e))?;
    if bytes.len() > MAX_IMPORT_BYTES {
        return Err(refuse(format!(
            "{} is {} bytes, more than an import can carry ({MAX_IMPORT_BYTES} bytes)",
            path.display(),
            bytes.len()
        )));
    }
    fencelock_core::Core::import(config.core.clone(), image)
        .map(drop)
        .map_err(|e| corrupt("import", path, format!("inconsistent state: {e}")))
}

/// Moves `files` (and the audit log, unless an earlier start moved it) from `dir`
/// into `dir/imported-single-node`, then syncs both directories. The audit log
/// goes first: while any log file is still in place, `dir/audit` is the single
/// server's (a member creates its own only after this).
fn move_aside(dir: &Path, files: &[String]) -> std::io::Result<()> {
    let aside = dir.join(ASIDE_DIR);
    std::fs::create_dir_all(&aside)?;
    let audit = dir.join("audit");
    if audit.exists() && !aside.join("audit").exists() {
        std::fs::rename(&audit, aside.join("audit"))?;
    }
    for name in files {
        let to = aside.join(name);
        if to.exists() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!("{} exists in both places", to.display()),
            ));
        }
        std::fs::rename(dir.join(name), to)?;
    }
    std::fs::File::open(&aside)?.sync_all()?;
    std::fs::File::open(dir)?.sync_all()
}

/// Step 4: the import is applied; the staged image goes, durably, so that no later
/// start proposes it again.
pub fn finish(staged: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(staged) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    match staged.parent() {
        Some(parent) => std::fs::File::open(parent)?.sync_all(),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_single_servers_log_files_are_moved() {
        for name in [
            "log-0000000000000000.seg",
            "log-0000000000000003.seg.tmp",
            "snap-0000000000000002.snap",
            "snap-0000000000000002.snap.tmp",
            "log.manifest",
            "log.manifest.tmp",
            "log.durable",
        ] {
            assert!(is_single_node_file(name), "{name}");
        }
        for name in ["raft", "audit", ASIDE_DIR, "sm.snap", "notes.txt", "log"] {
            assert!(!is_single_node_file(name), "{name}");
        }
    }

    /// A move cut short by a crash is finished by the next one: nothing is lost,
    /// nothing is moved twice, and the audit log moves only while it is the
    /// single server's.
    #[test]
    fn a_move_cut_short_is_finished() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path();
        let files = ["log-0000000000000000.seg", "log.durable", "log.manifest"];
        for f in files {
            std::fs::write(dir.join(f), f).unwrap();
        }
        std::fs::create_dir(dir.join("audit")).unwrap();
        std::fs::write(dir.join("audit").join("a"), "single").unwrap();
        // The crash: the audit log and one file moved.
        std::fs::create_dir(dir.join(ASIDE_DIR)).unwrap();
        std::fs::rename(dir.join("audit"), dir.join(ASIDE_DIR).join("audit")).unwrap();
        std::fs::rename(dir.join(files[0]), dir.join(ASIDE_DIR).join(files[0])).unwrap();
        let left = single_node_files(dir).unwrap();
        assert_eq!(left, ["log.durable", "log.manifest"]);
        move_aside(dir, &left).unwrap();
        assert!(single_node_files(dir).unwrap().is_empty());
        for f in files {
            assert_eq!(
                std::fs::read_to_string(dir.join(ASIDE_DIR).join(f)).unwrap(),
                f
            );
        }
        // A member's own audit log, made after the move, stays.
        std::fs::create_dir(dir.join("audit")).unwrap();
        move_aside(dir, &[]).unwrap();
        assert!(dir.join("audit").exists());
        assert_eq!(
            std::fs::read_to_string(dir.join(ASIDE_DIR).join("audit").join("a")).unwrap(),
            "single"
        );
    }

    #[test]
    fn shifted_images_stay_valid_and_keep_their_spans() {
        use fencelock_core::{Acquire, Command, Config, Core, Owner, OwnerToken};
        let mut core = Core::new(Config::default());
        for (i, wait_ms) in [(1u128, 0u64), (2, 60_000)] {
            core.apply(
                1_000,
                Command::Acquire(Acquire {
                    name: fencelock_core::LockName::new("a").unwrap(),
                    token: OwnerToken::from_u128(i),
                    ttl_ms: Some(5_000),
                    wait_ms,
                    owner: Owner::new("o").unwrap(),
                    request_id: None,
                    limit: 1,
                    lock_delay_ms: 0,
                    session: None,
                    tenant: None,
                    quota: None,
                    mode: Default::default(),
                    value: None,
                }),
            )
            .unwrap();
        }
        let before = core.export();
        let mut image = before.clone();
        shift_times(&mut image, 7_000);
        assert_eq!(image.now_ms, before.now_ms + 7_000);
        let holder = &image.locks[0].holders[0];
        assert_eq!(
            holder.lease,
            fencelock_core::LeaseImage::Own {
                ttl_ms: 5_000,
                deadline_ms: 13_000
            }
        );
        assert_eq!(image.locks[0].waiters[0].wait_deadline_ms, 68_000);
        Core::import(Config::default(), image).unwrap();
    }
}
