//! The engine task's inbox: client requests are bounded, the engine's own messages
//! are never refused.
//!
//! One FIFO channel carries both, and a counter bounds the client requests in it
//! ([`ENGINE_QUEUE`]). Two channels would let a wait's cancellation overtake the
//! acquire it cancels; a reserve of capacity can run out. The other messages are
//! bounded by what was admitted: at most one cancellation and one orphan release
//! per acquire, one abandonment and one tick answer per proposal, one drain and one
//! shutdown per stop.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc;

use super::Msg;

/// Most client requests (acquires, commands, reads) that may wait for the engine
/// task. One more is refused at once with 503 `unavailable` ("the server is
/// overloaded; retry"): nothing blocks a runtime thread and the queue never grows
/// without bound. About 64 K requests are a few hundred milliseconds of the
/// engine's work, and a few tens of MiB.
pub const ENGINE_QUEUE: usize = 65_536;

/// Why a message did not reach the engine task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refused {
    /// [`ENGINE_QUEUE`] client requests are already waiting.
    Full,
    /// The engine task is gone (stopped, or storage failed).
    Closed,
}

/// The sending side; cheap to clone.
#[derive(Clone)]
pub(super) struct EngineTx {
    tx: mpsc::UnboundedSender<Msg>,
    queued: Arc<AtomicUsize>,
    capacity: usize,
}

/// The engine task's receiving side.
pub(super) struct EngineRx {
    rx: mpsc::UnboundedReceiver<Msg>,
    queued: Arc<AtomicUsize>,
}

/// A new inbox with room for [`ENGINE_QUEUE`] client requests (in unit tests,
/// what [`test_capacity::set`] asked for on this thread).
pub(super) fn queue() -> (EngineTx, EngineRx) {
    #[cfg(test)]
    let capacity = test_capacity::take().unwrap_or(ENGINE_QUEUE);
    #[cfg(not(test))]
    let capacity = ENGINE_QUEUE;
    let (tx, rx) = mpsc::unbounded_channel();
    let queued = Arc::new(AtomicUsize::new(0));
    let tx = EngineTx {
        tx,
        queued: queued.clone(),
        capacity,
    };
    (tx, EngineRx { rx, queued })
}

impl Msg {
    /// Whether this is a client's request, which the bound applies to.
    fn is_request(&self) -> bool {
        matches!(
            self,
            Msg::Acquire { .. } | Msg::Command { .. } | Msg::Read(_)
        )
    }
}

impl EngineTx {
    /// Queues `msg`; a client request only if fewer than the bound are waiting.
    pub(super) fn send(&self, msg: Msg) -> Result<(), Refused> {
        let request = msg.is_request();
        if request
            && self
                .queued
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < self.capacity).then_some(n + 1)
                })
                .is_err()
        {
            return Err(Refused::Full);
        }
        self.tx.send(msg).map_err(|_| {
            if request {
                self.queued.fetch_sub(1, Ordering::AcqRel);
            }
            Refused::Closed
        })
    }
}

impl EngineRx {
    /// The next message; `None` once every sender is gone.
    pub(super) async fn recv(&mut self) -> Option<Msg> {
        // Cancel-safe: nothing is awaited after a message is taken.
        let msg = self.rx.recv().await?;
        self.taken(&msg);
        Some(msg)
    }

    /// The next message if one is waiting.
    pub(super) fn try_recv(&mut self) -> Result<Msg, mpsc::error::TryRecvError> {
        let msg = self.rx.try_recv()?;
        self.taken(&msg);
        Ok(msg)
    }

    /// A client request left the queue: room for another.
    fn taken(&self, msg: &Msg) {
        if msg.is_request() {
            self.queued.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Unit tests fill the queue with a tiny bound.
#[cfg(test)]
pub(crate) mod test_capacity {
    use std::cell::Cell;

    thread_local! {
        static CAPACITY: Cell<Option<usize>> = const { Cell::new(None) };
    }

    /// The bound of the next engine started on this thread.
    pub(crate) fn set(capacity: usize) {
        CAPACITY.with(|c| c.set(Some(capacity)));
    }

    pub(super) fn take() -> Option<usize> {
        CAPACITY.with(Cell::take)
    }
}
