//! Chaos testing of fencelock with real processes.
//!
//! A run ([`scenario::run`]) starts the real `fencelock serve` binary on a loopback
//! port and a few *worker* processes ([`worker`]). Each worker loops: acquire a lock
//! (waiting), hold it for a while (the guard renews it), write to a shared resource
//! through a [`fencelock_fence::FileGate`] with the grant's fence, release. Every
//! acquire, renew, release and write is recorded as an *invoke* and a *complete*
//! event, stamped with `CLOCK_MONOTONIC` (one clock for every process on the
//! machine), in the worker's own history file ([`history`]).
//!
//! Meanwhile the run injects faults: it `SIGSTOP`s a current holder until its lease
//! has expired and another worker has written, then `SIGCONT`s it (it wakes up still
//! "holding" and writes: the gate must refuse it), and it `kill -9`s the server under
//! load and restarts it on the same data directory and port.
//!
//! Afterwards [`checker::check`] reads all histories and reports overlapping holders,
//! stale writes that were accepted, and fence regressions. Turning the resource's
//! fence check off ([`worker::WorkerConfig::fenced`] = false) must make it report
//! violations: the planted bug that shows the checker can see one.
//!
//! [`cluster::run`] does the same over a real 3-member cluster: a TCP proxy on every
//! link between members ([`proxy`]) to cut, delay and flap single links, workers that
//! follow the leader ([`leader`]), and one fault per step (kill, stop or partition the
//! leader, isolate a follower past a snapshot, flapping links, kill all, a rolling
//! restart, a membership change), each followed by a progress measurement; at the
//! end the members' state machines are compared as well as the histories.
#![deny(missing_docs)]

pub mod checker;
pub mod cluster;
pub mod history;
pub mod http;
pub mod leader;
pub mod proxy;
pub mod scenario;
pub mod worker;

/// Why a chaos run, or one of its parts, could not be carried out (a server that would
/// not start, a port that could not be bound, …). Violations of the lock's promises are
/// not errors: they are in the run's summary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChaosError {
    message: String,
}

impl ChaosError {
    /// What went wrong.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl std::fmt::Display for ChaosError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ChaosError {}

impl From<String> for ChaosError {
    fn from(message: String) -> ChaosError {
        ChaosError { message }
    }
}

impl From<&str> for ChaosError {
    fn from(message: &str) -> ChaosError {
        ChaosError {
            message: message.to_owned(),
        }
    }
}

impl From<ChaosError> for String {
    fn from(e: ChaosError) -> String {
        e.message
    }
}

/// The environment variable that turns a process into a chaos worker: its value is
/// the worker's configuration as JSON ([`worker::WorkerConfig`]).
pub const WORKER_ENV: &str = "FENCELOCK_CHAOS_WORKER";

/// Nanoseconds on `CLOCK_MONOTONIC`: the same clock in every process on the machine
/// (on Linux it counts from boot and never jumps), so events of different workers can
/// be ordered.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own; CLOCK_MONOTONIC always
    // exists on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_MONOTONIC) failed");
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}
