//! A deterministic simulation of fencelock: a server node running the real
//! [`fencelock_core::Core`] over a simulated disk, clients that follow the client
//! library's rules, and a resource behind the real [`fencelock_fence::MemoryGate`],
//! all on one virtual clock driven by one seed.
//!
//! Faults come from the seed: client pauses longer than the TTL (also between the
//! deadline check and the write), one-way and two-way partitions between a client and
//! the server (the resource stays reachable), message delay, loss and duplication,
//! server crashes that lose what was not fsynced, server pauses, wall-clock jumps,
//! and client deaths.
//! After the faults stop, a quiet tail lets every lease free.
//!
//! Some seeds add a reader-writer lock (`rw`), which clients take shared or
//! exclusive (readers do not write the resource); a writer that has written may
//! downgrade to a reader before it releases.
//!
//! Some seeds add multi-lock clients (random overlapping sets of the plain locks,
//! in random order, all or nothing; each exclusive part of a mutex written once
//! with its own fence; released together or one by one, or given up at the
//! deadline) and election clients (campaign on `leader` with a value, proclaim
//! while leading, resign, ask who leads), under the same faults.
//!
//! Invariants checked on every step (see [`Invariant`]): at most `limit` holders per
//! lock, and never a writer with another holder; fences of acknowledged grants strictly increasing per lock and never handed
//! out twice, across crashes; the resource never accepts a write whose fence is not
//! newer than one it accepted; FIFO grants; no grant to a request whose wait or
//! session ended; no acknowledged grant lost across a crash; no more clients
//! believing they hold a lock than its limit (nor a writer believing it while a
//! reader does); a multi-lock request granted all at once, each part at the head
//! of its queue; at most one leader per term, terms strictly increasing, a
//! client's observed terms never going back and every observed value one that
//! term's leader campaigned or proclaimed with; and, at the end, every lease
//! freed and every multi-lock request granted or ended (no deadlock).
//!
//! The same seed gives the same run, bit for bit (one SplitMix64 seed, forked into
//! independent streams; only ordered maps; no wall clock, threads or I/O).
//!
//! # Running
//!
//! - `cargo test -p fencelock-sim`: 1,000 seeds, the planted-bug tests, replay and
//!   wall-clock checks. Each run prints a summary line (seeds, operations, faults by
//!   kind, violations).
//! - `FENCELOCK_SIM_SEEDS=N` runs N seeds (`FENCELOCK_SIM_FIRST_SEED=S` from S);
//!   `FENCELOCK_SIM_SEED=S cargo test -p fencelock-sim --test it seeds::every_seed -- --nocapture`
//!   replays seed S with a step trace (`FENCELOCK_SIM_PLANT=NAME` with a planted bug).
//! - `cargo run -p fencelock-sim --release -- --seeds 100000` for long runs.
//!
//! # The model
//!
//! - **Server**: [`fencelock_core::Core`] driven as the engine drives it: every command
//!   at the monotonic service time, logged if it changed state, replies held until
//!   the group commit syncs; a snapshot (`Core::export`) now and then at a sync point.
//!   A crash loses the replies waiting for a sync and the unsynced records (all of
//!   them on a power loss; a killed process keeps the prefix it had written);
//!   recovery imports the snapshot, replays the durable records, continues the
//!   service clock from the last logged time and logs a `Recover`. A paused server
//!   (GC, swapping) handles nothing while its monotonic clock runs on.
//! - **Clients**: the client library's rules: a request id per acquire, retried with
//!   backoff within the wait budget; a conservative deadline of *first send + ttl −
//!   ttl/10*, and a confirming renewal when the grant came after a long wait; renewal
//!   every ttl/3; lost at the deadline (then a best-effort release with the owner
//!   token); writes only while the deadline has not passed. Some clients hold their
//!   locks on a session instead (open, keep-alive every ttl/3, close).
//! - **Resource**: [`fencelock_fence::MemoryGate`], reached directly by the clients
//!   (also while they are partitioned from the server); each grant writes each key at
//!   most once, as the gate requires.
//!
//! Not modelled: forced releases (they take a lock from a holder that still believes
//! it holds it, by design), a replicated server, client clocks that drift.
#![deny(missing_docs)]

mod check;
mod rng;
mod sim;

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};

pub use check::{Invariant, Violation};
pub use rng::Rng;

/// One protection switched off, to show the checker catches its absence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlantedBug {
    /// The resource writes without `MemoryGate`'s fence check.
    NoFenceCheckAtResource,
    /// The fence counter is not recovered: after a restart it continues just above
    /// the fences still held, so released fences are issued again.
    FenceCounterNotDurable,
    /// The core releases by lock name only, ignoring the owner token
    /// (`PlantedBugs::release_by_name_only`).
    ReleaseByNameOnly,
    /// The core's hand-off grants a request whose wait is over
    /// (`PlantedBugs::grant_expired_waiters`).
    GrantExpiredWaiters,
    /// The server never arms its deadline timer, so expiries wait for the next
    /// command: safe, but a dead holder's lease never frees on a quiet server (shows
    /// the liveness check works).
    NoExpiryTimer,
    /// A reader arriving while readers hold a reader-writer lock is granted at once,
    /// past a queued writer (`PlantedBugs::reader_jumps_writer`).
    ReaderJumpsWriter,
    /// A multi-lock request at the head of one queue is granted that lock alone
    /// (`PlantedBugs::partial_multi_grant`).
    PartialMultiGrant,
    /// An election campaign is granted the last fence again: a term reused
    /// (`PlantedBugs::reuse_term`).
    ReuseTerm,
}

impl PlantedBug {
    /// The name used by `FENCELOCK_SIM_PLANT` and `--plant`.
    pub fn name(self) -> &'static str {
        match self {
            PlantedBug::NoFenceCheckAtResource => "no-fence-check",
            PlantedBug::FenceCounterNotDurable => "fence-counter-not-durable",
            PlantedBug::ReleaseByNameOnly => "release-by-name-only",
            PlantedBug::GrantExpiredWaiters => "grant-expired-waiters",
            PlantedBug::NoExpiryTimer => "no-expiry-timer",
            PlantedBug::ReaderJumpsWriter => "reader-jumps-writer",
            PlantedBug::PartialMultiGrant => "partial-multi-grant",
            PlantedBug::ReuseTerm => "reuse-term",
        }
    }

    /// The bug with this [`name`](PlantedBug::name).
    pub fn from_name(name: &str) -> Option<PlantedBug> {
        PlantedBug::ALL.into_iter().find(|b| b.name() == name)
    }

    /// Every planted bug.
    pub const ALL: [PlantedBug; 8] = [
        PlantedBug::NoFenceCheckAtResource,
        PlantedBug::FenceCounterNotDurable,
        PlantedBug::ReleaseByNameOnly,
        PlantedBug::GrantExpiredWaiters,
        PlantedBug::NoExpiryTimer,
        PlantedBug::ReaderJumpsWriter,
        PlantedBug::PartialMultiGrant,
        PlantedBug::ReuseTerm,
    ];
}

/// How to run a seed.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// A protection to switch off (`None`: the real system).
    pub planted: Option<PlantedBug>,
    /// Whether wall-clock jump faults move the server's wall clock (they are still
    /// drawn, so turning them off changes nothing else in the run).
    pub wall_clock_jumps: bool,
    /// Print every step to stderr.
    pub trace: bool,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            planted: None,
            wall_clock_jumps: true,
            trace: false,
        }
    }
}

/// Faults injected, by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultCounts {
    /// Client pauses (longer than half the TTL, up to three TTLs).
    pub pause: u64,
    /// Pauses between a client's deadline check and its write reaching the resource.
    pub stall: u64,
    /// One-way partitions between a client and the server.
    pub partition_one_way: u64,
    /// Two-way partitions between a client and the server.
    pub partition_two_way: u64,
    /// Server crashes (unsynced records and replies lost).
    pub crash: u64,
    /// Of those, crashes of the process alone, where part of the unsynced log had
    /// already been written and survived.
    pub crash_kept_unsynced: u64,
    /// Wall-clock jumps.
    pub wall_jump: u64,
    /// Clients that died (possibly holding a lock).
    pub client_death: u64,
    /// Stop-the-world pauses of the server (its monotonic clock runs on).
    pub server_pause: u64,
    /// Messages lost.
    pub msg_lost: u64,
    /// Messages delivered twice.
    pub msg_duplicated: u64,
    /// Messages delayed far beyond the usual.
    pub msg_delayed: u64,
}

impl FaultCounts {
    /// All faults.
    pub fn total(&self) -> u64 {
        self.pause
            + self.stall
            + self.partition_one_way
            + self.partition_two_way
            + self.crash
            + self.wall_jump
            + self.client_death
            + self.server_pause
            + self.msg_lost
            + self.msg_duplicated
            + self.msg_delayed
    }
}

impl fmt::Display for FaultCounts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "pause={} stall={} partition_one_way={} partition_two_way={} crash={} (kept_unsynced={}) wall_jump={} client_death={} server_pause={} msg_lost={} msg_duplicated={} msg_delayed={}",
            self.pause,
            self.stall,
            self.partition_one_way,
            self.partition_two_way,
            self.crash,
            self.crash_kept_unsynced,
            self.wall_jump,
            self.client_death,
            self.server_pause,
            self.msg_lost,
            self.msg_duplicated,
            self.msg_delayed
        )
    }
}

/// What a run did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Simulation events processed.
    pub events: u64,
    /// Client requests sent (acquire, renew, release, retries included).
    pub ops: u64,
    /// Commands the server's core applied.
    pub commands: u64,
    /// Grants the clients received.
    pub grants_seen: u64,
    /// Of those, grants held on a session.
    pub session_grants: u64,
    /// Server restarts that loaded a snapshot before replaying the log.
    pub snapshot_restarts: u64,
    /// Holds a client ended because its own deadline passed.
    pub deadline_losses: u64,
    /// Writes sent to the resource.
    pub writes: u64,
    /// Writes the resource accepted.
    pub writes_accepted: u64,
    /// Writes the resource refused as stale.
    pub writes_rejected: u64,
    /// Multi-lock grants the clients received (each counts its parts in `grants_seen`).
    pub multi_grants: u64,
    /// Election leaderships the clients received.
    pub leaderships: u64,
    /// Values leaders proclaimed (answered).
    pub proclaims: u64,
    /// Leader queries answered with a leader.
    pub leader_reads: u64,
    /// Faults injected.
    pub faults: FaultCounts,
}

impl Stats {
    fn add(&mut self, other: &Stats) {
        self.events += other.events;
        self.ops += other.ops;
        self.commands += other.commands;
        self.grants_seen += other.grants_seen;
        self.session_grants += other.session_grants;
        self.snapshot_restarts += other.snapshot_restarts;
        self.deadline_losses += other.deadline_losses;
        self.writes += other.writes;
        self.writes_accepted += other.writes_accepted;
        self.writes_rejected += other.writes_rejected;
        self.multi_grants += other.multi_grants;
        self.leaderships += other.leaderships;
        self.proclaims += other.proclaims;
        self.leader_reads += other.leader_reads;
        self.faults.add(&other.faults);
    }
}

/// The result of one seed.
#[derive(Debug, Clone)]
pub struct SeedReport {
    /// The seed.
    pub seed: u64,
    /// The first broken invariant, if any.
    pub violation: Option<Violation>,
    /// What the run did.
    pub stats: Stats,
    /// A hash of every decision of the run (server replies, grants, resource
    /// answers): equal digests mean equal runs.
    pub digest: u64,
}

/// Runs one seed. A panic inside the run is reported as an [`Invariant::Panic`]
/// violation, never propagated.
pub fn run_seed(seed: u64, options: Options) -> SeedReport {
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let mut sim = sim::Sim::new(seed, options);
        sim.run();
        (sim.checker.violation.take(), sim.stats, sim.digest)
    }));
    match outcome {
        Ok((violation, stats, digest)) => SeedReport {
            seed,
            violation,
            stats,
            digest,
        },
        Err(panic) => {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "non-string panic".to_owned());
            SeedReport {
                seed,
                violation: Some(Violation {
                    invariant: Invariant::Panic,
                    at_ms: 0,
                    detail: message,
                }),
                stats: Stats::default(),
                digest: 0,
            }
        }
    }
}

/// Totals over many seeds.
#[derive(Debug, Clone, Default)]
pub struct Totals {
    /// Seeds run.
    pub seeds: u64,
    /// Summed statistics.
    pub stats: Stats,
    /// Seeds with a violation, with it.
    pub failures: Vec<(u64, Violation)>,
}

impl Totals {
    /// Adds one seed's report.
    pub fn add(&mut self, report: &SeedReport) {
        self.seeds += 1;
        self.stats.add(&report.stats);
        if let Some(v) = &report.violation {
            self.failures.push((report.seed, v.clone()));
        }
    }
}

impl fmt::Display for Totals {
    /// The one-line summary: seeds, operations, faults by kind, violations.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.stats;
        write!(
            f,
            "seeds={} events={} ops={} server_commands={} grants={} (on_sessions={} multi_lock={} leaderships={}) proclaims={} leader_reads={} restarts_from_snapshot={} writes={} (accepted={} stale_rejected={}) faults={} [{}] violations={}",
            self.seeds,
            s.events,
            s.ops,
            s.commands,
            s.grants_seen,
            s.session_grants,
            s.multi_grants,
            s.leaderships,
            s.proclaims,
            s.leader_reads,
            s.snapshot_restarts,
            s.writes,
            s.writes_accepted,
            s.writes_rejected,
            s.faults.total(),
            s.faults,
            self.failures.len()
        )?;
        if !self.failures.is_empty() {
            let mut by_kind = std::collections::BTreeMap::new();
            for (_, v) in &self.failures {
                *by_kind.entry(v.invariant.to_string()).or_insert(0u64) += 1;
            }
            write!(f, " {by_kind:?}")?;
        }
        Ok(())
    }
}

/// The command that replays `seed` (with `planted`, if any) with a step trace.
pub fn replay_command(seed: u64, planted: Option<PlantedBug>) -> String {
    let plant = planted.map_or(String::new(), |b| {
        format!("FENCELOCK_SIM_PLANT={} ", b.name())
    });
    format!(
        "{plant}FENCELOCK_SIM_SEED={seed} cargo test -p fencelock-sim --test it seeds::every_seed -- --nocapture"
    )
}
