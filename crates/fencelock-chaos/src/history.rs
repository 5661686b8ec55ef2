//! The history format: one JSON object per line, one file per worker.
//!
//! Every operation is two events with the same `(worker, op)`: an *invoke*, written
//! before the request is sent, and a *complete*, written after its answer arrived.
//! Times are [`monotonic_ns`](crate::monotonic_ns). An invoke is never later than the
//! real send and a complete never earlier than the real answer (a pause between the
//! two only widens the gap), which is what the checker's reasoning relies on.
//!
//! An operation with an invoke but no complete (the worker died or stopped first) is
//! *indeterminate*: the checker assumes nothing about its effect.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// What an operation does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    /// One acquire call to the server (the client may make several per acquire).
    Acquire,
    /// One renew call (the guard's background renewal, or the client's confirmation).
    Renew,
    /// One release call.
    Release,
    /// A fenced write to the resource that `lock` protects.
    Write,
}

/// Which end of an operation an event marks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Before the request was sent.
    Invoke,
    /// After the answer arrived.
    Complete,
}

/// How an operation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Acquire granted, renew confirmed, release released.
    Ok,
    /// The store said the grant is gone (renew or release `not_held`).
    NotHeld,
    /// The write was applied by the resource.
    Accepted,
    /// The resource refused the write as stale.
    Refused,
    /// Any other error (`detail` says which); the effect is unknown.
    Failed,
}

/// One line of a history file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// The worker that recorded it.
    pub worker: u32,
    /// The operation's number within the worker (pairs invoke and complete).
    pub op: u64,
    /// What the operation does.
    pub kind: OpKind,
    /// Invoke or complete.
    pub phase: Phase,
    /// `CLOCK_MONOTONIC`, nanoseconds.
    pub time_ns: u64,
    /// The lock (for a write: the lock that protects the resource).
    pub lock: String,
    /// The grant's fence (renew, release and write invokes; acquire completes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fence: Option<u64>,
    /// The grant's owner token (as for `fence`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// The acquire's idempotency key (acquire invokes): retries share it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// The lease length asked for (acquire and renew invokes) or granted (completes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
    /// How it ended (completes only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<Outcome>,
    /// Error kind or message for `Failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

impl Event {
    /// An event with only the fields every event has.
    pub fn new(
        worker: u32,
        op: u64,
        kind: OpKind,
        phase: Phase,
        time_ns: u64,
        lock: &str,
    ) -> Event {
        Event {
            worker,
            op,
            kind,
            phase,
            time_ns,
            lock: lock.to_owned(),
            fence: None,
            token: None,
            request_id: None,
            ttl_ms: None,
            outcome: None,
            detail: None,
        }
    }
}

/// Appends events to one worker's history file, a line per event with one `write`
/// call each (so a crash loses at most a tail, never mixes lines).
#[derive(Debug)]
pub struct HistoryWriter {
    worker: u32,
    state: Mutex<WriterState>,
}

#[derive(Debug)]
struct WriterState {
    file: File,
    next_op: u64,
}

impl HistoryWriter {
    /// Opens (creates or appends to) `path` for worker `worker`.
    pub fn open(path: &Path, worker: u32) -> std::io::Result<HistoryWriter> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(HistoryWriter {
            worker,
            state: Mutex::new(WriterState { file, next_op: 0 }),
        })
    }

    /// The worker id.
    pub fn worker(&self) -> u32 {
        self.worker
    }

    /// Records the invoke of a new operation, stamped now; `fill` sets its fields.
    /// Returns the operation number for [`complete`](HistoryWriter::complete).
    pub fn invoke(&self, kind: OpKind, lock: &str, fill: impl FnOnce(&mut Event)) -> u64 {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let op = state.next_op;
        state.next_op += 1;
        let mut event = Event::new(
            self.worker,
            op,
            kind,
            Phase::Invoke,
            crate::monotonic_ns(),
            lock,
        );
        fill(&mut event);
        write_line(&mut state.file, &event);
        op
    }

    /// Records the completion of operation `op`, stamped now.
    pub fn complete(
        &self,
        op: u64,
        kind: OpKind,
        lock: &str,
        outcome: Outcome,
        fill: impl FnOnce(&mut Event),
    ) {
        let mut event = Event::new(
            self.worker,
            op,
            kind,
            Phase::Complete,
            crate::monotonic_ns(),
            lock,
        );
        event.outcome = Some(outcome);
        fill(&mut event);
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        write_line(&mut state.file, &event);
    }
}

fn write_line(file: &mut File, event: &Event) {
    let mut line = serde_json::to_vec(event).expect("an Event always serializes");
    line.push(b'\n');
    // A history that cannot be written would make the run's verdict meaningless.
    file.write_all(&line).expect("append to the history file");
}

/// Reads every event of one history file. A torn last line (the worker was killed
/// while writing it) is skipped; any other unreadable line is an error.
pub fn read_file(path: &Path) -> Result<Vec<Event>, String> {
    let file = File::open(path).map_err(|e| format!("open {}: {e}", path.display()))?;
    let lines: Vec<String> = BufReader::new(file)
        .lines()
        .collect::<Result<_, _>>()
        .map_err(|e| format!("read {}: {e}", path.display()))?;
    let mut events = Vec::with_capacity(lines.len());
    for (i, line) in lines.iter().enumerate() {
        match serde_json::from_str(line) {
            Ok(event) => events.push(event),
            Err(_) if i + 1 == lines.len() => {}
            Err(e) => return Err(format!("{}:{}: {e}", path.display(), i + 1)),
        }
    }
    Ok(events)
}

/// Reads every `*.jsonl` history file in `dir`.
pub fn read_dir(dir: &Path) -> Result<Vec<Event>, String> {
    let mut events = Vec::new();
    let entries = std::fs::read_dir(dir).map_err(|e| format!("list {}: {e}", dir.display()))?;
    for entry in entries {
        let path = entry
            .map_err(|e| format!("list {}: {e}", dir.display()))?
            .path();
        if path.extension().is_some_and(|ext| ext == "jsonl") {
            events.extend(read_file(&path)?);
        }
    }
    Ok(events)
}
