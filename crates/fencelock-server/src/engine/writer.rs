//! The writer thread: appends the engine's batches to the log, makes them durable
//! with one fdatasync per group (group commit), appends their audit entries, runs
//! their deliveries, feeds the replica and cuts the log for snapshots.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fencelock_log::Log;
use tokio::sync::{oneshot, watch};

use super::replica::ReplicaMsg;
use super::{Delivery, RunState, SNAPSHOT_WRITE_AMPLIFICATION};
#[cfg(doc)]
use super::{EngineConfig, DEFAULT_WRITER_POLL};
use crate::audit::{AuditEntry, AuditStore};
use crate::metrics::Metrics;

pub(super) enum WriterMsg {
    Batch {
        records: Vec<Vec<u8>>,
        /// The audit entries of those records (and of refused renews).
        audit: Vec<AuditEntry>,
        /// Replies that may go out once the records are written, before their
        /// fdatasync: successful releases (see [`super::EngineTask::release`]).
        written: Vec<Delivery>,
        /// Watch events: after the fdatasync, but nobody's reply waits for them.
        events: Vec<Delivery>,
        /// Replies, grants and reads: after the fdatasync.
        deliveries: Vec<Delivery>,
    },
    /// The snapshot of the state before segment `seq` is durable (and this many bytes
    /// long): drop what it covers.
    Forget {
        seq: u64,
        snapshot_bytes: u64,
    },
    /// Encode the state for a backup, once every change answered before this
    /// message has reached the replica.
    Backup(oneshot::Sender<Vec<u8>>),
    Stop(oneshot::Sender<()>),
}

/// What the writer has written and still has to sync and deliver.
#[derive(Default)]
struct Group {
    durable: Vec<Vec<u8>>,
    audit: Vec<AuditEntry>,
    events: Vec<Delivery>,
    deliveries: Vec<Delivery>,
}

/// How long the writer holds back the fdatasync of a group that answers nobody
/// (see `Writer::run`). Bounds how much later than its holder's answer a lone
/// release's event and audit entry appear.
const HOLD_UNANSWERED_GROUP: Duration = Duration::from_millis(1);

/// How often the writer checks that the data directory is still the one it
/// opened (`Log::check_identity`: six `stat` calls). Checking before every
/// fdatasync would cost each group commit; this bounds how long a deleted or
/// replaced directory goes unnoticed (issue 19, item 5). Rolls, snapshots and the
/// shutdown check too.
const IDENTITY_CHECK_EVERY: Duration = Duration::from_millis(200);

/// Whether the writer may hold `group`, held for `held_for` so far, back for the next
/// batch's fdatasync: only if it has records to sync, nobody's reply waits for it,
/// and it has not been held for [`HOLD_UNANSWERED_GROUP`] already (a stream of lone
/// releases must not keep their events and audit entries back forever).
fn may_hold(group: &Group, held_for: Duration) -> bool {
    !group.durable.is_empty() && group.deliveries.is_empty() && held_for < HOLD_UNANSWERED_GROUP
}

/// The first poll window once batches are seen to follow each other closely (or
/// the bound, if that is smaller).
const SPIN_START: Duration = Duration::from_micros(50);
/// The largest write (records) after which the writer still polls: a larger one
/// means many clients at once, whose work needs the cores more than the writer
/// needs a fast wake-up.
const SPIN_MAX_RECORDS: usize = 2;

/// How long the writer polls its channel before it sleeps (see
/// [`DEFAULT_WRITER_POLL`]): the window grows while the next batch keeps arriving
/// within `max` of the last write, shrinks to nothing when it does not, and is shut
/// after writes of more than [`SPIN_MAX_RECORDS`] records.
#[derive(Debug)]
struct SpinPolicy {
    window: Duration,
    /// The bound of the window ([`EngineConfig::writer_poll`]).
    max: Duration,
    /// Records written since the last receive.
    records: usize,
}

impl SpinPolicy {
    fn new(max: Duration) -> SpinPolicy {
        SpinPolicy {
            window: Duration::ZERO,
            max,
            records: 0,
        }
    }

    /// Receives the next message: polls for up to the window (never past
    /// `deadline`), then blocks (until `deadline`, if any).
    fn recv<T>(
        &mut self,
        rx: &std::sync::mpsc::Receiver<T>,
        deadline: Option<Instant>,
    ) -> Result<T, std::sync::mpsc::RecvTimeoutError> {
        use std::sync::mpsc::{RecvTimeoutError, TryRecvError};
        let started = Instant::now();
        let mut until = started + self.window();
        if let Some(deadline) = deadline {
            until = until.min(deadline);
        }
        loop {
            match rx.try_recv() {
                Ok(msg) => {
                    self.observe(started.elapsed());
                    return Ok(msg);
                }
                Err(TryRecvError::Disconnected) => return Err(RecvTimeoutError::Disconnected),
                Err(TryRecvError::Empty) if Instant::now() < until => std::hint::spin_loop(),
                Err(TryRecvError::Empty) => break,
            }
        }
        let got = match deadline {
            None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
            Some(deadline) => rx.recv_timeout(deadline.saturating_duration_since(Instant::now())),
        };
        if got.is_ok() {
            self.observe(started.elapsed());
        }
        got
    }

    /// The poll window for the next receive.
    fn window(&self) -> Duration {
        if self.records > SPIN_MAX_RECORDS {
            Duration::ZERO
        } else {
            self.window
        }
    }

    /// Adapts the window to a message that came `waited` after the receive began.
    fn observe(&mut self, waited: Duration) {
        if self.records > SPIN_MAX_RECORDS {
            self.window = Duration::ZERO;
        } else if waited <= self.window {
            // Caught while polling: keep the window.
        } else if waited <= self.max {
            // A wider window would have caught it.
            self.window = (self.window * 2).clamp(SPIN_START.min(self.max), self.max);
        } else {
            // Too far apart to poll for: halve, down to nothing.
            self.window /= 2;
            if self.window < SPIN_START / 4 {
                self.window = Duration::ZERO;
            }
        }
    }
}

/// The writer thread: appends batches, syncs once per group, feeds the replica,
/// runs deliveries, and cuts the log for snapshots.
pub(super) struct Writer {
    pub(super) log: Log,
    pub(super) audit: AuditStore,
    pub(super) metrics: Arc<Metrics>,
    pub(super) state: watch::Sender<RunState>,
    pub(super) replica: std::sync::mpsc::Sender<ReplicaMsg>,
    pub(super) snapshot_after_bytes: u64,
    pub(super) last_snapshot_bytes: u64,
    pub(super) bytes_since_cut: u64,
    pub(super) cut_in_flight: bool,
    /// Whether to hold back groups that answer nobody (only when syncing: without
    /// fdatasync there is nothing to share).
    pub(super) hold_unanswered: bool,
    /// The bound of the writer's polling for the next batch.
    pub(super) writer_poll: Duration,
    /// Tests hold the fdatasync here to see what goes out before it.
    #[cfg(test)]
    pub(super) sync_gate: Option<Arc<gate::SyncGate>>,
    /// Tests hold the writer here, after a group's answers and before the replica
    /// hears of its records.
    #[cfg(test)]
    pub(super) replica_gate: Option<Arc<gate::SyncGate>>,
}

impl Writer {
    fn fail(&self, what: String) {
        tracing::error!(error = %what, "storage failed; stopping (fail-stop): nothing more will be acknowledged");
        let _ = self.state.send(RunState::Failed(what));
    }

    /// False (and the engine failed) if the data directory is no longer the one
    /// the log opened.
    fn check_identity(&mut self) -> bool {
        match self.log.check_identity() {
            Ok(()) => true,
            Err(e) => {
                self.fail(format!(
                    "data directory {} was deleted or replaced while serving; stopped \
                     acknowledging (what was acknowledged since it went is gone with it; \
                     restart with --fence-floor): {e}",
                    self.log.dir().display()
                ));
                false
            }
        }
    }

    /// Makes a group durable (one fdatasync), appends its audit entries, feeds the
    /// replica, runs its events and deliveries, and cuts the log for a snapshot when
    /// due. False if storage failed (the writer has stopped).
    fn commit(&mut self, group: Group) -> bool {
        let Group {
            durable,
            audit: audit_entries,
            events,
            deliveries,
        } = group;
        if !durable.is_empty() {
            #[cfg(test)]
            if let Some(gate) = &self.sync_gate {
                gate.pass();
            }
            let started = Instant::now();
            if let Err(e) = self.log.sync() {
                self.fail(format!("sync: {e}"));
                return false;
            }
            self.metrics
                .fsync
                .observe(started.elapsed().as_micros() as u64);
            self.metrics.batch_size.observe(durable.len() as u64);
        }
        // The audit entries of the records just made durable go to the audit
        // log (and its index, for queries) before anyone hears of the change.
        // They are synced before the records they derive from may be dropped
        // (Forget, in `run`); until then a crash is repaired at start by replaying
        // the records past the audit store's high-water mark.
        if !audit_entries.is_empty() {
            let started = Instant::now();
            if let Err(e) = self.audit.append(audit_entries) {
                self.fail(format!("audit log: {e}"));
                return false;
            }
            self.metrics
                .audit_write
                .observe(started.elapsed().as_micros() as u64);
            self.metrics
                .audit_entries
                .store(self.audit.len() as u64, Ordering::Relaxed);
        }
        // Events first: a watcher sees a change no later than the client it answers
        // (releases excepted: they were answered once written).
        for delivery in events.into_iter().chain(deliveries) {
            delivery.deliver();
        }
        // The replica hears of the records after the clients do: waking its thread
        // is a system call (and, on a VM, often a wake-up of an idle vCPU) that
        // would otherwise sit between the fdatasync and every answer. A backup
        // still includes every change answered before it was asked for: it is
        // asked of the writer (`WriterMsg::Backup`), which passes it on only after
        // this send, in the same channel.
        if !durable.is_empty() {
            #[cfg(test)]
            if let Some(gate) = &self.replica_gate {
                gate.pass();
            }
            let _ = self.replica.send(ReplicaMsg::Records(durable));
        }
        // Snapshot once the log since the last one is as large as the configured
        // threshold or a quarter of the last snapshot, whichever is larger:
        // recovery then replays at most that much log, and snapshots never write
        // more than four times what the log did.
        let threshold = self
            .snapshot_after_bytes
            .max(self.last_snapshot_bytes / SNAPSHOT_WRITE_AMPLIFICATION);
        if self.bytes_since_cut >= threshold && !self.cut_in_flight {
            match self.log.start_segment() {
                Ok(seq) => {
                    self.bytes_since_cut = 0;
                    self.cut_in_flight = true;
                    let _ = self.replica.send(ReplicaMsg::Cut(seq));
                }
                Err(e) => {
                    self.fail(format!("start a segment: {e}"));
                    return false;
                }
            }
        }
        true
    }

    pub(super) fn run(mut self, rx: std::sync::mpsc::Receiver<WriterMsg>) {
        // Written but not yet synced: a group whose every reply already went out
        // (releases), held back for the next batch to share its fdatasync, and
        // since when.
        let mut held: Option<(Group, Instant)> = None;
        let mut spin = SpinPolicy::new(self.writer_poll);
        let mut next_check = Instant::now() + IDENTITY_CHECK_EVERY;
        loop {
            if Instant::now() >= next_check {
                next_check = Instant::now() + IDENTITY_CHECK_EVERY;
                if !self.check_identity() {
                    return;
                }
            }
            let first = match &held {
                None => match spin.recv(&rx, Some(next_check)) {
                    Ok(first) => first,
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
                },
                Some((_, since)) => match spin.recv(&rx, Some(*since + HOLD_UNANSWERED_GROUP)) {
                    Ok(first) => first,
                    Err(timeout_or_gone) => {
                        let (group, _) = held.take().expect("matched Some");
                        if !self.commit(group) {
                            return;
                        }
                        match timeout_or_gone {
                            std::sync::mpsc::RecvTimeoutError::Timeout => continue,
                            std::sync::mpsc::RecvTimeoutError::Disconnected => return,
                        }
                    }
                },
            };
            // Group commit: every batch that queued up while the last sync ran, up
            // to (and including) the next control message, which must see them
            // durable.
            let mut pending = vec![first];
            while matches!(pending.last(), Some(WriterMsg::Batch { .. })) {
                match rx.try_recv() {
                    Ok(more) => pending.push(more),
                    Err(_) => break,
                }
            }
            let (mut group, held_since) = match held.take() {
                Some((group, since)) => (group, Some(since)),
                None => (Group::default(), None),
            };
            let mut written = Vec::new();
            let mut after = None;
            spin.records = 0;
            for msg in pending {
                match msg {
                    WriterMsg::Batch {
                        records,
                        audit,
                        written: w,
                        events,
                        deliveries,
                    } => {
                        group.audit.extend(audit);
                        spin.records += records.len();
                        for record in &records {
                            if let Err(e) = self.log.append(record) {
                                return self.fail(format!("append: {e}"));
                            }
                            self.bytes_since_cut += record.len() as u64;
                        }
                        group.durable.extend(records);
                        written.extend(w);
                        group.events.extend(events);
                        group.deliveries.extend(deliveries);
                    }
                    other => after = Some(other),
                }
            }
            // Releases are answered once their records are written (see
            // `EngineTask::release`); the rest waits for the fdatasync.
            if !written.is_empty() {
                if let Err(e) = self.log.write() {
                    return self.fail(format!("write: {e}"));
                }
                for delivery in written {
                    delivery.deliver();
                }
            }
            // A group that answers nobody (a lone release: its holder has its
            // answer; only its event and audit entry wait) is held for the next
            // batch, HOLD_UNANSWERED_GROUP at most from when it was first held: a
            // client that releases and then acquires would otherwise find the
            // writer in the release's fdatasync and wait for it before its own
            // could start.
            if self.hold_unanswered && after.is_none() {
                let since = held_since.unwrap_or_else(Instant::now);
                if may_hold(&group, since.elapsed()) {
                    held = Some((group, since));
                    continue;
                }
            }
            if !self.commit(group) {
                return;
            }
            match after {
                Some(WriterMsg::Forget {
                    seq,
                    snapshot_bytes,
                }) => {
                    self.cut_in_flight = false;
                    self.last_snapshot_bytes = snapshot_bytes;
                    // The audit entries of the records about to be dropped can no
                    // longer be rebuilt from them: make them durable first.
                    if let Err(e) = self.audit.sync() {
                        return self.fail(format!("audit log sync: {e}"));
                    }
                    if let Err(e) = self.log.forget_before(seq) {
                        return self.fail(format!("drop log covered by snapshot {seq}: {e}"));
                    }
                }
                Some(WriterMsg::Backup(reply)) => {
                    let _ = self.replica.send(ReplicaMsg::Backup(reply));
                }
                Some(WriterMsg::Stop(done)) => {
                    // A directory that vanished is no clean stop: say so (the
                    // engine then does not report `Stopped`).
                    if !self.check_identity() {
                        return;
                    }
                    // A clean stop leaves nothing to rebuild.
                    if let Err(e) = self.audit.sync() {
                        return self.fail(format!("audit log sync: {e}"));
                    }
                    // A snapshot the replica is writing must land while the data
                    // directory is still ours; then close the logs (releasing their
                    // directory locks) before saying we stopped: a server started
                    // right after must find neither the directory in use nor a
                    // snapshot appearing under its feet.
                    let (replica_done, replica_stopped) = oneshot::channel();
                    if self.replica.send(ReplicaMsg::Stop(replica_done)).is_ok() {
                        let _ = replica_stopped.blocking_recv();
                    }
                    drop(self);
                    let _ = done.send(());
                    return;
                }
                Some(WriterMsg::Batch { .. }) | None => {}
            }
        }
    }
}

/// What tests hold the writer at.
#[cfg(test)]
pub(crate) mod gate {
    use std::cell::RefCell;
    use std::sync::{Arc, Condvar, Mutex};

    /// Holds the writer before its fdatasync while closed.
    #[derive(Default)]
    pub(crate) struct SyncGate {
        closed: Mutex<bool>,
        opened: Condvar,
    }

    impl SyncGate {
        pub(crate) fn pass(&self) {
            let closed = self.closed.lock().unwrap();
            drop(self.opened.wait_while(closed, |closed| *closed).unwrap());
        }

        pub(crate) fn set(&self, closed: bool) {
            *self.closed.lock().unwrap() = closed;
            self.opened.notify_all();
        }
    }

    thread_local! {
        /// The gate for the next engine started on this thread.
        pub(crate) static SYNC_GATE: RefCell<Option<Arc<SyncGate>>> = const { RefCell::new(None) };
        /// The replica gate (see `Writer::replica_gate`) of the next engine started
        /// on this thread.
        pub(crate) static REPLICA_GATE: RefCell<Option<Arc<SyncGate>>> = const { RefCell::new(None) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::DEFAULT_WRITER_POLL;

    #[test]
    fn the_writer_polls_only_while_small_writes_follow_each_other_closely() {
        const SPIN_MAX: Duration = DEFAULT_WRITER_POLL;
        let mut spin = SpinPolicy::new(SPIN_MAX);
        assert_eq!(
            spin.window(),
            Duration::ZERO,
            "no polling before any traffic"
        );
        // Batches 80 µs apart (W1's rhythm): the window opens and grows to its bound.
        spin.records = 2;
        spin.observe(Duration::from_micros(80));
        assert_eq!(spin.window(), SPIN_START);
        spin.observe(Duration::from_micros(80));
        assert_eq!(spin.window(), SPIN_START * 2);
        spin.observe(Duration::from_micros(80));
        assert_eq!(spin.window(), Duration::from_micros(100), "caught: kept");
        spin.observe(Duration::from_micros(150));
        spin.observe(Duration::from_micros(190));
        assert_eq!(spin.window(), SPIN_MAX, "never past the bound");
        // A busy server (large writes) does not poll, whatever the rhythm.
        spin.records = SPIN_MAX_RECORDS + 1;
        assert_eq!(spin.window(), Duration::ZERO);
        spin.observe(Duration::from_micros(80));
        spin.records = 2;
        assert_eq!(spin.window(), Duration::ZERO, "closed after a large write");
        // Sparse traffic closes the window again.
        spin.observe(Duration::from_micros(80));
        spin.observe(Duration::from_micros(80));
        spin.observe(Duration::from_micros(80));
        assert_eq!(spin.window(), SPIN_START * 2);
        for _ in 0..4 {
            spin.observe(Duration::from_millis(5));
        }
        assert_eq!(
            spin.window(),
            Duration::ZERO,
            "batches 5 ms apart: no polling"
        );
        // A bound of zero turns polling off.
        let mut off = SpinPolicy::new(Duration::ZERO);
        off.records = 1;
        for _ in 0..3 {
            off.observe(Duration::from_micros(80));
            assert_eq!(off.window(), Duration::ZERO);
        }
        off.observe(Duration::ZERO);
        assert_eq!(off.window(), Duration::ZERO);
    }

    #[test]
    fn a_polling_writer_still_takes_a_message_that_comes_after_its_window() {
        let (tx, rx) = std::sync::mpsc::channel();
        let mut spin = SpinPolicy::new(DEFAULT_WRITER_POLL);
        spin.window = DEFAULT_WRITER_POLL;
        spin.records = 1;
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            tx.send(7).unwrap();
            tx
        });
        assert_eq!(spin.recv(&rx, None).unwrap(), 7);
        // And a deadline ends the wait with a timeout, not a message.
        let deadline = Instant::now() + Duration::from_millis(5);
        assert!(matches!(
            spin.recv(&rx, Some(deadline)),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout)
        ));
        assert!(Instant::now() >= deadline);
        drop(sender.join().unwrap());
        assert!(matches!(
            spin.recv(&rx, None),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected)
        ));
    }

    #[test]
    fn only_a_group_that_answers_nobody_is_held_and_never_past_the_bound() {
        let lone_release = || Group {
            durable: vec![b"record".to_vec()],
            events: vec![Delivery::Read(Box::new(|| {}))],
            ..Group::default()
        };
        assert!(may_hold(&lone_release(), Duration::ZERO));
        assert!(!may_hold(&lone_release(), HOLD_UNANSWERED_GROUP));
        let mut answers = lone_release();
        answers.deliveries.push(Delivery::Read(Box::new(|| {})));
        assert!(!may_hold(&answers, Duration::ZERO), "a reply waits for it");
        assert!(
            !may_hold(&Group::default(), Duration::ZERO),
            "nothing to sync"
        );
    }
}
