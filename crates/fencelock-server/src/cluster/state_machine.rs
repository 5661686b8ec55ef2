//! openraft's state machine: a bridge to the engine task, which owns the core.
//!
//! Committed entries go to the engine in order; it applies each to the core and
//! answers the request that proposed it (on the member that proposed it), then
//! tells openraft the entry is applied. A snapshot is the core's image at an
//! applied log id, written durably to `sm.snap`; on restart openraft installs it
//! and re-applies the committed log after it.

use std::io;
use std::path::PathBuf;

use futures_util::StreamExt;
use openraft::storage::{ApplyResponder, EntryResponder, RaftSnapshotBuilder, RaftStateMachine};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

use super::{Entry, LogId, SnapshotMeta, StoredMembership, TypeConfig};

/// The snapshot file in the cluster directory.
const SNAPSHOT_FILE: &str = "sm.snap";

/// What the state machine asks of the engine task.
pub enum SmRequest {
    /// Apply these committed entries in order; answer `done` after the last.
    Apply {
        /// The entries, each with the responder openraft waits on.
        entries: Vec<(Entry, Option<ApplyResponder<TypeConfig>>)>,
        /// Sent once all are applied.
        done: oneshot::Sender<()>,
    },
    /// The last applied log id and membership.
    AppliedState(oneshot::Sender<(Option<LogId>, StoredMembership)>),
    /// The core's image at the last applied id.
    Build(oneshot::Sender<(Vec<u8>, Option<LogId>, StoredMembership)>),
    /// Answer once the audit entries of every applied entry are durable. The audit
    /// log is synced lazily (its entries are rebuilt by re-applying the log after
    /// the snapshot), so it must be before a snapshot becomes the restart point.
    AuditDurable(oneshot::Sender<()>),
    /// Replace the core by this image.
    Install {
        /// `codec::encode_snapshot` of the image.
        image: Vec<u8>,
        /// What it covers.
        meta: SnapshotMeta,
        /// The outcome (an undecodable image is an error).
        done: oneshot::Sender<Result<(), crate::startup::RecoveryError>>,
    },
}

/// The state machine handle openraft drives.
pub struct StateMachine {
    engine: mpsc::Sender<SmRequest>,
    dir: PathBuf,
}

/// A snapshot file's content.
#[derive(Serialize, Deserialize)]
struct SnapshotFile {
    meta: SnapshotMeta,
    image: Vec<u8>,
}

fn gone() -> io::Error {
    io::Error::other("the lock engine stopped")
}

impl StateMachine {
    /// A state machine whose requests go to `engine`; snapshots live in `dir`.
    pub fn new(engine: mpsc::Sender<SmRequest>, dir: PathBuf) -> StateMachine {
        StateMachine { engine, dir }
    }

    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> SmRequest) -> io::Result<T> {
        let (tx, rx) = oneshot::channel();
        self.engine.send(make(tx)).await.map_err(|_| gone())?;
        rx.await.map_err(|_| gone())
    }
}

/// Builds a snapshot from the engine's image.
pub struct Builder {
    engine: mpsc::Sender<SmRequest>,
    dir: PathBuf,
}

impl RaftSnapshotBuilder<TypeConfig> for Builder {
    type SnapshotData = Vec<u8>;

    async fn build_snapshot(
        &mut self,
    ) -> Result<openraft::alias::SnapshotOf<TypeConfig, Vec<u8>>, io::Error> {
        let (tx, rx) = oneshot::channel();
        self.engine
            .send(SmRequest::Build(tx))
            .await
            .map_err(|_| gone())?;
        let (image, last_log_id, last_membership) = rx.await.map_err(|_| gone())?;
        audit_durable(&self.engine).await?;
        let meta = SnapshotMeta {
            last_log_id,
            last_membership,
        };
        write_snapshot(&self.dir, &meta, &image).await?;
        Ok(openraft::alias::SnapshotOf::<TypeConfig, Vec<u8>> {
            meta,
            snapshot: image,
        })
    }
}

/// Waits until the audit entries of everything applied are durable.
async fn audit_durable(engine: &mpsc::Sender<SmRequest>) -> io::Result<()> {
    let (tx, rx) = oneshot::channel();
    engine
        .send(SmRequest::AuditDurable(tx))
        .await
        .map_err(|_| gone())?;
    // An audit writer that failed has logged it and records nothing more: the
    // snapshot goes on without it.
    let _ = rx.await;
    Ok(())
}

async fn write_snapshot(
    dir: &std::path::Path,
    meta: &SnapshotMeta,
    image: &[u8],
) -> io::Result<()> {
    let file = SnapshotFile {
        meta: meta.clone(),
        image: image.to_vec(),
    };
    let bytes = postcard::to_allocvec(&file).map_err(io::Error::other)?;
    let path = dir.join(SNAPSHOT_FILE);
    // Always durable, even in benchmarks without fsync: snapshots are rare.
    tokio::task::spawn_blocking(move || {
        fencelock_log::write_snapshot_file(&path, &bytes).map_err(io::Error::other)
    })
    .await
    .map_err(io::Error::other)?
}

impl RaftStateMachine<TypeConfig> for StateMachine {
    type SnapshotData = Vec<u8>;
    type SnapshotBuilder = Builder;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), io::Error> {
        self.ask(SmRequest::AppliedState).await
    }

    async fn apply<Strm>(&mut self, mut entries: Strm) -> Result<(), io::Error>
    where
        Strm: futures_util::Stream<Item = Result<EntryResponder<TypeConfig>, io::Error>>
            + Unpin
            + Send,
    {
        let mut batch = Vec::new();
        while let Some(item) = entries.next().await {
            batch.push(item?);
        }
        if batch.is_empty() {
            return Ok(());
        }
        self.ask(|done| SmRequest::Apply {
            entries: batch,
            done,
        })
        .await
    }

    async fn get_snapshot_builder(&mut self) -> Builder {
        Builder {
            engine: self.engine.clone(),
            dir: self.dir.clone(),
        }
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta,
        snapshot: Vec<u8>,
    ) -> Result<(), io::Error> {
        // What this member applied before is not in the leader's image's replay.
        audit_durable(&self.engine).await?;
        write_snapshot(&self.dir, meta, &snapshot).await?;
        let meta = meta.clone();
        self.ask(|done| SmRequest::Install {
            image: snapshot,
            meta,
            done,
        })
        .await?
        .map_err(io::Error::other)
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<openraft::alias::SnapshotOf<TypeConfig, Vec<u8>>>, io::Error> {
        let path = self.dir.join(SNAPSHOT_FILE);
        if !path.exists() {
            return Ok(None);
        }
        let bytes = tokio::task::spawn_blocking(move || fencelock_log::read_snapshot_file(&path))
            .await
            .map_err(io::Error::other)?
            .map_err(io::Error::other)?;
        let file: SnapshotFile = postcard::from_bytes(&bytes).map_err(io::Error::other)?;
        Ok(Some(openraft::alias::SnapshotOf::<TypeConfig, Vec<u8>> {
            meta: file.meta,
            snapshot: file.image,
        }))
    }
}
