//! The replica thread: a second core that replays every durable record, so
//! snapshots and backups are encoded without pausing the engine.

use std::path::{Path, PathBuf};
use std::time::Instant;

use fencelock_core::Config as CoreConfig;
use fencelock_log::Recovered;
use tokio::sync::{oneshot, watch};

use super::recovery::replay;
use super::writer::WriterMsg;
use super::RunState;
use crate::codec;

/// What the replica thread is told.
pub(super) enum ReplicaMsg {
    /// Durable records, in log order.
    Records(Vec<Vec<u8>>),
    /// The log was cut before segment `seq`: snapshot the state here.
    Cut(u64),
    /// Encode the current state for a backup.
    Backup(oneshot::Sender<Vec<u8>>),
    /// Finish what was asked before (a snapshot in progress) and stop.
    Stop(oneshot::Sender<()>),
}

/// The replica thread: a second core that replays durable records, so snapshots
/// (and backups) are taken without pausing the engine. It costs a second copy of
/// the state in memory and about one more `apply` per command of CPU.
pub(super) struct Snapshotter {
    pub(super) config: CoreConfig,
    pub(super) dir: PathBuf,
    /// Device and inode of `dir` at start: a snapshot is written by path, and
    /// never into a directory that replaced ours.
    pub(super) dir_id: Option<(u64, u64)>,
    pub(super) fsync: bool,
    pub(super) writer: std::sync::mpsc::Sender<WriterMsg>,
    pub(super) state: watch::Sender<RunState>,
}

impl Snapshotter {
    fn fail(&self, what: String) {
        tracing::error!(error = %what, "snapshot failed; stopping (fail-stop)");
        let _ = self.state.send(RunState::Failed(what));
    }

    pub(super) fn run(self, recovered: Recovered, rx: std::sync::mpsc::Receiver<ReplicaMsg>) {
        // Built here, off the start-up path: the engine already serves.
        let mut replica = match replay(
            &self.config,
            recovered.snapshot.as_deref(),
            &recovered.records,
            &self.dir,
            None,
            None,
        ) {
            Ok((core, _, _)) => core,
            Err(e) => return self.fail(format!("replica: {e}")),
        };
        drop(recovered);
        while let Ok(msg) = rx.recv() {
            match msg {
                ReplicaMsg::Records(records) => {
                    for record in records {
                        match codec::decode_record(&record) {
                            Ok((meta, command)) => {
                                let _ = replica.apply(meta.now_ms.max(replica.now_ms()), command);
                                replica.discard_outcomes();
                            }
                            Err(e) => {
                                return self.fail(format!("replica cannot decode a record: {e}"))
                            }
                        }
                    }
                }
                ReplicaMsg::Cut(seq) => {
                    if dir_id(&self.dir) != self.dir_id {
                        return self.fail(format!(
                            "data directory {} was deleted or replaced while serving; \
                             snapshot {seq} not written",
                            self.dir.display()
                        ));
                    }
                    let started = Instant::now();
                    let bytes = codec::encode_snapshot(&replica.export());
                    if let Err(e) =
                        fencelock_log::write_snapshot_at(&self.dir, seq, &bytes, self.fsync)
                    {
                        return self.fail(format!("write snapshot {seq}: {e}"));
                    }
                    tracing::info!(
                        segment = seq,
                        bytes = bytes.len(),
                        took_ms = started.elapsed().as_millis() as u64,
                        "snapshot written"
                    );
                    let forget = WriterMsg::Forget {
                        seq,
                        snapshot_bytes: bytes.len() as u64,
                    };
                    if self.writer.send(forget).is_err() {
                        return; // the writer stopped; the next start recovers from the snapshot
                    }
                }
                ReplicaMsg::Backup(reply) => {
                    let _ = reply.send(codec::encode_snapshot(&replica.export()));
                }
                ReplicaMsg::Stop(done) => {
                    let _ = done.send(());
                    return;
                }
            }
        }
    }
}

/// Device and inode of `path`, if it exists.
pub(super) fn dir_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}
