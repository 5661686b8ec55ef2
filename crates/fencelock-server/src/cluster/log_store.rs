//! The Raft log on the fencelock command log (`fencelock-log`): the same segments,
//! checksums, torn-tail rules and group commit as the single-node server.
//!
//! `fencelock-log` only appends, so the store appends *what happened* to the Raft log
//! (an entry, a vote, a truncation, a purge, the committed id) and rebuilds the
//! current view by replaying those records at open. Every write goes through one
//! writer thread that appends whatever is queued and covers it with one fdatasync
//! (group commit), then tells openraft which appends are durable. Old records are
//! dropped by compaction: a `fencelock-log` snapshot of the live view (vote,
//! committed, purged id and the entries not yet purged).

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::io;
use std::ops::RangeBounds;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use fencelock_log::{Log, LogOptions};
use openraft::entry::RaftEntry;
use openraft::storage::{IOFlushed, LogState, RaftLogReader, RaftLogStorage};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use super::{Entry, LogId, TypeConfig, Vote};
use crate::metrics::Histogram;
use crate::startup::RecoveryError;

/// Compact once the records since the last compaction exceed this many bytes and
/// are more than [`COMPACT_RATIO`] times the live view.
const COMPACT_MIN_BYTES: u64 = 16 << 20;
const COMPACT_RATIO: u64 = 4;
/// Most jobs the writer takes into one fdatasync.
const MAX_GROUP: usize = 4096;
/// Bound on queued writer jobs: openraft's log task waits (backpressure) beyond it.
const QUEUE: usize = 8192;

/// What one record of the Raft log's `fencelock-log` says.
#[derive(Debug, Serialize, Deserialize)]
enum Record {
    Entry(Entry),
    Vote(Vote),
    Committed(Option<LogId>),
    /// Entries after this id (all, with `None`) are gone.
    TruncateAfter(Option<LogId>),
    /// Entries up to and including this id are gone.
    Purge(LogId),
}

/// The whole live view, as a compaction snapshot.
#[derive(Debug, Default, Serialize, Deserialize)]
struct View {
    vote: Option<Vote>,
    committed: Option<LogId>,
    purged: Option<LogId>,
    entries: BTreeMap<u64, Entry>,
}

impl View {
    fn apply(&mut self, record: Record) {
        match record {
            Record::Entry(entry) => {
                self.entries.insert(entry.index(), entry);
            }
            Record::Vote(vote) => self.vote = Some(vote),
            Record::Committed(committed) => self.committed = committed,
            Record::TruncateAfter(after) => {
                let from = after.map_or(0, |id| id.index() + 1);
                let _ = self.entries.split_off(&from);
            }
            Record::Purge(upto) => {
                let keep = self.entries.split_off(&(upto.index() + 1));
                self.entries = keep;
                if self.purged.as_ref() < Some(&upto) {
                    self.purged = Some(upto);
                }
            }
        }
    }

    fn encoded_len_estimate(&self) -> u64 {
        // The entries dominate; 64 bytes of envelope each is generous.
        self.entries.len() as u64 * 64
    }
}

enum Job {
    /// Records, and who to tell once they are durable.
    Write {
        records: Vec<Vec<u8>>,
        done: Done,
    },
    Stop(oneshot::Sender<()>),
}

enum Done {
    Flushed(IOFlushed<TypeConfig>),
    Waiting(oneshot::Sender<io::Result<()>>),
    /// Nobody waits and nothing needs it durable: written to the file (so it
    /// survives the process), and synced only by the next group that needs a sync.
    Lazy,
}

impl Done {
    fn send(self, result: io::Result<()>) {
        match self {
            Done::Flushed(callback) => callback.io_completed(result),
            Done::Waiting(tx) => {
                let _ = tx.send(result);
            }
            Done::Lazy => {}
        }
    }

    fn needs_sync(&self) -> bool {
        !matches!(self, Done::Lazy)
    }
}

/// The Raft log storage. Cheap to clone: clones share the view and the writer.
#[derive(Clone)]
pub struct LogStore {
    view: Arc<Mutex<View>>,
    /// `None`: in memory only (the simulation), where an append is "durable" at once.
    jobs: Option<std::sync::mpsc::SyncSender<Job>>,
    dir: PathBuf,
    /// Each group's sync duration, µs (`fencelock_raft_log_sync_seconds`).
    sync_time: Arc<Histogram>,
}

fn io_error(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

fn encode(record: &Record) -> io::Result<Vec<u8>> {
    postcard::to_allocvec(record).map_err(io_error)
}

impl LogStore {
    /// Opens (or creates) the Raft log in `dir`, replaying it into the live view,
    /// and starts its writer thread.
    pub fn open(dir: &Path, fsync: bool) -> Result<LogStore, RecoveryError> {
        std::fs::create_dir_all(dir).map_err(|e| RecoveryError::io("create", dir, e))?;
        let opts = LogOptions {
            fsync,
            ..LogOptions::default()
        };
        let (log, recovered) =
            Log::open(dir, opts).map_err(|e| RecoveryError::from_log("the raft log", e))?;
        let mut view = match &recovered.snapshot {
            Some(bytes) => postcard::from_bytes::<View>(bytes).map_err(|e| {
                RecoveryError::corrupt(
                    dir,
                    format!("corrupt raft log snapshot in {}: {e}", dir.display()),
                )
            })?,
            None => View::default(),
        };
        for (i, bytes) in recovered.records.iter().enumerate() {
            let record: Record = postcard::from_bytes(bytes).map_err(|e| {
                RecoveryError::corrupt(
                    dir,
                    format!("corrupt raft log record {i} in {}: {e}", dir.display()),
                )
            })?;
            view.apply(record);
        }
        let view = Arc::new(Mutex::new(view));
        let (jobs, rx) = std::sync::mpsc::sync_channel(QUEUE);
        let sync_time = Arc::new(Histogram::sync_micros());
        let writer = Writer {
            log,
            view: view.clone(),
            sync_time: sync_time.clone(),
        };
        std::thread::Builder::new()
            .name("fencelock-raft-log".into())
            .spawn(move || writer.run(rx))
            .map_err(|e| RecoveryError::io("start the writer thread of", dir, e))?;
        Ok(LogStore {
            view,
            jobs: Some(jobs),
            dir: dir.to_owned(),
            sync_time,
        })
    }

    /// A log kept in memory only, for the cluster simulation: everything appended
    /// counts as durable at once, and [`LogStore::after_crash`] sees all of it.
    pub fn in_memory() -> LogStore {
        LogStore {
            view: Arc::default(),
            jobs: None,
            dir: PathBuf::from("(memory)"),
            sync_time: Arc::new(Histogram::sync_micros()),
        }
    }

    /// The same in-memory log, as a member restarted after a crash finds it.
    pub fn after_crash(&self) -> LogStore {
        self.clone()
    }

    fn view(&self) -> std::sync::MutexGuard<'_, View> {
        // A panic while holding the view is a bug elsewhere; the data is still
        // the last consistent view.
        self.view.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn submit(&self, records: Vec<Vec<u8>>, done: Done) -> io::Result<()> {
        let Some(jobs) = &self.jobs else {
            done.send(Ok(()));
            return Ok(());
        };
        jobs.send(Job::Write { records, done }).map_err(|_| {
            io_error(format!(
                "the raft log writer for {} stopped",
                self.dir.display()
            ))
        })
    }

    /// The durations of this log's syncs (the member's metrics render them).
    pub fn sync_histogram(&self) -> Arc<Histogram> {
        self.sync_time.clone()
    }

    /// Stops the writer after everything queued is written, and durable where it was
    /// waited for (a lazy committed id is written but not synced).
    pub async fn stop(&self) {
        let Some(jobs) = &self.jobs else { return };
        let (tx, rx) = oneshot::channel();
        if jobs.send(Job::Stop(tx)).is_ok() {
            let _ = rx.await;
        }
    }
}

struct Writer {
    log: Log,
    view: Arc<Mutex<View>>,
    sync_time: Arc<Histogram>,
}

impl Writer {
    fn run(mut self, rx: std::sync::mpsc::Receiver<Job>) {
        let mut failed: Option<String> = None;
        while let Ok(first) = rx.recv() {
            let mut group = Vec::new();
            let mut stop = None;
            match first {
                Job::Stop(tx) => stop = Some(tx),
                job => group.push(job),
            }
            while stop.is_none() && group.len() < MAX_GROUP {
                match rx.try_recv() {
                    Ok(Job::Stop(tx)) => stop = Some(tx),
                    Ok(job) => group.push(job),
                    Err(_) => break,
                }
            }
            let result = match &failed {
                Some(e) => Err(io_error(e)),
                None => self.write(&group),
            };
            if let Err(e) = &result {
                if failed.is_none() {
                    tracing::error!(error = %e, "the raft log cannot be written; this member stops accepting writes");
                    failed = Some(e.to_string());
                }
            }
            for job in group {
                if let Job::Write { done, .. } = job {
                    done.send(match &result {
                        Ok(()) => Ok(()),
                        Err(e) => Err(io_error(e)),
                    });
                }
            }
            if let Some(tx) = stop {
                // The log (and its directory lock) goes first: whoever waits on
                // the stop may reopen the directory at once.
                drop(self);
                let _ = tx.send(());
                return;
            }
        }
    }

    fn write(&mut self, group: &[Job]) -> io::Result<()> {
        let mut needs_sync = false;
        for job in group {
            if let Job::Write { records, done } = job {
                needs_sync |= done.needs_sync();
                for record in records {
                    self.log.append(record).map_err(io_error)?;
                }
            }
        }
        if !needs_sync {
            return self.log.write().map_err(io_error);
        }
        let started = std::time::Instant::now();
        self.log.sync().map_err(io_error)?;
        self.sync_time.observe(started.elapsed().as_micros() as u64);
        self.maybe_compact()
    }

    /// Replaces the records written so far by one snapshot of the live view once
    /// they are much larger than it.
    fn maybe_compact(&mut self) -> io::Result<()> {
        let since = self.log.bytes_since_snapshot();
        if since < COMPACT_MIN_BYTES {
            return Ok(());
        }
        let state = {
            let view = self.view.lock().unwrap_or_else(|e| e.into_inner());
            if since < COMPACT_RATIO * view.encoded_len_estimate() {
                return Ok(());
            }
            // The view already includes every record written (the store updates it
            // before it queues the record), so a snapshot of it covers them all.
            postcard::to_allocvec(&*view).map_err(io_error)?
        };
        self.log.snapshot(&state).map_err(io_error)
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, io::Error> {
        Ok(self
            .view()
            .entries
            .range(range)
            .map(|(_, e)| e.clone())
            .collect())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, io::Error> {
        Ok(self.view().vote)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, io::Error> {
        let view = self.view();
        let last = view
            .entries
            .values()
            .next_back()
            .map(|e| e.log_id())
            .or(view.purged);
        Ok(LogState {
            last_purged_log_id: view.purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote) -> Result<(), io::Error> {
        // The view first, as for every record: a compaction snapshots the view,
        // and must not drop a record the view does not yet reflect.
        let record = Record::Vote(*vote);
        let bytes = encode(&record)?;
        self.view().apply(record);
        let (tx, rx) = oneshot::channel();
        self.submit(vec![bytes], Done::Waiting(tx))?;
        rx.await
            .map_err(|_| io_error("the raft log writer stopped"))?
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), io::Error> {
        // Neither waited for nor synced on its own (the next entry's sync covers
        // it): a committed id lost in a crash only means re-applying less on
        // restart, and the member catches up from the leader. Syncing it put one
        // more fdatasync in every commit round, ahead of the next entry's.
        let record = Record::Committed(committed);
        let bytes = encode(&record)?;
        self.view().apply(record);
        self.submit(vec![bytes], Done::Lazy)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, io::Error> {
        Ok(self.view().committed)
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: IOFlushed<TypeConfig>,
    ) -> Result<(), io::Error>
    where
        I: IntoIterator<Item = Entry> + Send,
        I::IntoIter: Send,
    {
        let mut records = Vec::new();
        {
            let mut view = self.view();
            for entry in entries {
                let record = Record::Entry(entry);
                records.push(encode(&record)?);
                view.apply(record);
            }
        }
        self.submit(records, Done::Flushed(callback))
    }

    async fn truncate_after(&mut self, last_log_id: Option<LogId>) -> Result<(), io::Error> {
        let record = Record::TruncateAfter(last_log_id);
        let bytes = encode(&record)?;
        self.view().apply(record);
        let (tx, rx) = oneshot::channel();
        self.submit(vec![bytes], Done::Waiting(tx))?;
        rx.await
            .map_err(|_| io_error("the raft log writer stopped"))?
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), io::Error> {
        let record = Record::Purge(log_id);
        let bytes = encode(&record)?;
        self.view().apply(record);
        let (tx, rx) = oneshot::channel();
        self.submit(vec![bytes], Done::Waiting(tx))?;
        rx.await
            .map_err(|_| io_error("the raft log writer stopped"))?
    }
}
