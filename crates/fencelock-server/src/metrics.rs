//! Prometheus metrics: lock-free counters and fixed-bucket histograms, rendered in the
//! text exposition format at `/metrics`. They count every tenant's locks and traffic,
//! so only a token that covers every lock may read them ([`crate::auth::Action::Metrics`]).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::vocab::Event;

/// A fixed-bucket histogram. Observations are in the histogram's own unit; the
/// rendering divides by `scale` to report seconds (or leaves counts as they are).
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [u64],
    buckets: Vec<AtomicU64>,
    count: AtomicU64,
    sum: AtomicU64,
    scale: f64,
}

impl Histogram {
    fn new(bounds: &'static [u64], scale: f64) -> Histogram {
        Histogram {
            bounds,
            buckets: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum: AtomicU64::new(0),
            scale,
        }
    }

    /// A histogram of durations in µs, rendered in seconds, with the buckets of
    /// the log syncs (50 µs to 1 s).
    pub fn sync_micros() -> Histogram {
        Histogram::new(MICROS_BOUNDS, 1_000_000.0)
    }

    /// Records one observation.
    pub fn observe(&self, value: u64) {
        if let Some(i) = self.bounds.iter().position(|b| value <= *b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum.fetch_add(value, Ordering::Relaxed);
    }

    /// How many observations were recorded.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// The mean observation in the histogram's own unit, if there was any.
    pub fn mean(&self) -> Option<f64> {
        let count = self.count();
        (count > 0).then(|| self.sum.load(Ordering::Relaxed) as f64 / count as f64)
    }

    /// The upper bound of the bucket holding quantile `q` (0..=1), in the
    /// histogram's own unit; `None` without observations or above the last bound.
    pub fn quantile_bound(&self, q: f64) -> Option<u64> {
        let count = self.count();
        if count == 0 {
            return None;
        }
        let rank = ((count as f64) * q).ceil().max(1.0) as u64;
        let mut cumulative = 0;
        for (bound, bucket) in self.bounds.iter().zip(&self.buckets) {
            cumulative += bucket.load(Ordering::Relaxed);
            if cumulative >= rank {
                return Some(*bound);
            }
        }
        None
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, bucket) in self.bounds.iter().zip(&self.buckets) {
            cumulative += bucket.load(Ordering::Relaxed);
            let le = *bound as f64 / self.scale;
            let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {cumulative}");
        }
        let count = self.count();
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let sum = self.sum.load(Ordering::Relaxed) as f64 / self.scale;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {count}");
    }
}

const MS_BOUNDS: &[u64] = &[
    1, 2, 5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000, 300_000,
    1_800_000, 3_600_000,
];
const MICROS_BOUNDS: &[u64] = &[
    50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000, 500_000, 1_000_000,
];
const BATCH_BOUNDS: &[u64] = &[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096];

/// Every metric the server exports.
#[derive(Debug)]
pub struct Metrics {
    /// Lock events by vocabulary event (`fencelock_events_total{event=…}`), indexed
    /// like [`Event::ALL`]; only watch events are counted and exported.
    pub events: [AtomicU64; Event::ALL.len()],
    /// Grants made (direct and hand-off).
    pub grants: AtomicU64,
    /// Grants released by their holders.
    pub releases: AtomicU64,
    /// Grants whose lease expired.
    pub expiries: AtomicU64,
    /// Grants taken away by an operator.
    pub forced_releases: AtomicU64,
    /// Queued requests that timed out.
    pub wait_timeouts: AtomicU64,
    /// Acquires refused because the lock was held and the caller did not wait.
    pub acquire_conflicts: AtomicU64,
    /// Gauge: grants held now.
    pub held: AtomicU64,
    /// Gauge: requests queued now.
    pub waiters: AtomicU64,
    /// Gauge: open sessions.
    pub sessions: AtomicU64,
    /// Gauge: lock records.
    pub locks: AtomicU64,
    /// Gauge: the next fence.
    pub next_fence: AtomicU64,
    /// Time from queueing to grant, ms.
    pub acquire_wait: Histogram,
    /// Time a grant was held, ms.
    pub hold_time: Histogram,
    /// Duration of each log sync (write + fdatasync), µs.
    pub fsync: Histogram,
    /// Records per log sync.
    pub batch_size: Histogram,
    /// Duration of each audit log write (the entries of one group commit), µs.
    pub audit_write: Histogram,
    /// Gauge: audit entries retained.
    pub audit_entries: AtomicU64,
    /// Requests refused for a missing or wrong token (401).
    pub refused_unauthenticated: AtomicU64,
    /// Requests refused for a token's role or prefixes (403).
    pub refused_permission_denied: AtomicU64,
    /// Acquires refused by a token's rate limit (429).
    pub refused_rate_limited: AtomicU64,
    /// Client requests refused because the engine's queue was full (503).
    pub refused_overloaded: AtomicU64,
    /// Connection admission (see `admission.rs`): refusals, closes, the
    /// unauthenticated pool. Shared with the accept loop.
    pub connections: Arc<ConnectionMetrics>,
    /// Connections that spoke the wire protocol `flw/1`.
    pub wire_connections: AtomicU64,
    /// Renders of a dashboard live view (lock table and health panel), each shared
    /// by every stream of that view.
    pub dashboard_renders: AtomicU64,
    /// Gauge: distinct dashboard live views being rendered.
    pub dashboard_views: AtomicU64,
    /// Cluster mode's Raft figures; rendered only in cluster mode.
    pub cluster: ClusterMetrics,
    /// Grants made in exclusive mode.
    pub grants_exclusive: AtomicU64,
    /// Grants made in shared mode.
    pub grants_shared: AtomicU64,
    /// Gauge: shared grants held now.
    pub held_shared: AtomicU64,
    /// Gauge: shared acquires queued now.
    pub waiters_shared: AtomicU64,
    /// Exclusive grants downgraded to shared.
    pub downgrades: AtomicU64,
    /// New values election leaders proclaimed.
    pub proclaims: AtomicU64,
    /// The last hour per minute, for the dashboard's charts.
    pub series: crate::series::Series,
}

/// Raft figures of a cluster member (see [`CLUSTER_METRIC_NAMES`]).
#[derive(Debug)]
pub struct ClusterMetrics {
    /// Set once this member runs in cluster mode.
    pub enabled: std::sync::atomic::AtomicBool,
    /// Gauge: 1 while this member leads.
    pub leader: AtomicU64,
    /// Gauge: the current term.
    pub term: AtomicU64,
    /// Gauge: the last committed log index.
    pub committed: AtomicU64,
    /// Gauge: the last applied log index.
    pub applied: AtomicU64,
    /// Times this member became leader.
    pub leader_changes: AtomicU64,
    /// On the leader: entries each member is behind the leader's last log index.
    pub peer_lag: std::sync::Mutex<std::collections::BTreeMap<u64, u64>>,
    /// Duration of each Raft log sync (write and fdatasync of a group), µs. Shared
    /// with the Raft log's writer thread (`LogStore::sync_histogram`).
    pub log_sync: Arc<Histogram>,
    /// Pre-Vote elections the dead-leader watchdog started (`cluster::watchdog`).
    /// Shared with the watchdog task.
    pub watchdog_elections: Arc<AtomicU64>,
}

impl Default for ClusterMetrics {
    fn default() -> ClusterMetrics {
        ClusterMetrics {
            enabled: Default::default(),
            leader: AtomicU64::new(0),
            term: AtomicU64::new(0),
            committed: AtomicU64::new(0),
            applied: AtomicU64::new(0),
            leader_changes: AtomicU64::new(0),
            peer_lag: Default::default(),
            log_sync: Arc::new(Histogram::sync_micros()),
            watchdog_elections: Arc::default(),
        }
    }
}

/// The metric families a cluster member adds.
pub const CLUSTER_METRIC_NAMES: &[&str] = &[
    "fencelock_raft_leader",
    "fencelock_raft_term",
    "fencelock_raft_committed_index",
    "fencelock_raft_applied_index",
    "fencelock_raft_leader_changes_total",
    "fencelock_raft_peer_lag_entries",
    "fencelock_raft_log_sync_seconds",
    "fencelock_raft_watchdog_elections_total",
];

impl Metrics {
    /// Sets the state gauges (held grants, waiters, sessions, locks, next fence)
    /// from the core: after every batch, and at start from the recovered state,
    /// so a restarted server does not report zeros until its first command.
    pub fn set_state_gauges(&self, stats: &fencelock_core::Stats) {
        self.held.store(stats.holders as u64, Ordering::Relaxed);
        self.waiters.store(stats.waiters as u64, Ordering::Relaxed);
        self.sessions
            .store(stats.sessions as u64, Ordering::Relaxed);
        self.locks.store(stats.locks as u64, Ordering::Relaxed);
        self.next_fence.store(stats.next_fence, Ordering::Relaxed);
        self.held_shared
            .store(stats.shared_holders as u64, Ordering::Relaxed);
        self.waiters_shared
            .store(stats.shared_waiters as u64, Ordering::Relaxed);
        self.series
            .waiters(crate::audit::wall_ms(), stats.waiters as u64);
    }
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics {
            events: Default::default(),
            grants: AtomicU64::new(0),
            releases: AtomicU64::new(0),
            expiries: AtomicU64::new(0),
            forced_releases: AtomicU64::new(0),
            wait_timeouts: AtomicU64::new(0),
            acquire_conflicts: AtomicU64::new(0),
            held: AtomicU64::new(0),
            waiters: AtomicU64::new(0),
            sessions: AtomicU64::new(0),
            locks: AtomicU64::new(0),
            next_fence: AtomicU64::new(0),
            acquire_wait: Histogram::new(MS_BOUNDS, 1_000.0),
            hold_time: Histogram::new(MS_BOUNDS, 1_000.0),
            fsync: Histogram::sync_micros(),
            batch_size: Histogram::new(BATCH_BOUNDS, 1.0),
            audit_write: Histogram::new(MICROS_BOUNDS, 1_000_000.0),
            audit_entries: AtomicU64::new(0),
            refused_unauthenticated: AtomicU64::new(0),
            refused_permission_denied: AtomicU64::new(0),
            refused_rate_limited: AtomicU64::new(0),
            refused_overloaded: AtomicU64::new(0),
            connections: Arc::default(),
            wire_connections: AtomicU64::new(0),
            dashboard_renders: AtomicU64::new(0),
            dashboard_views: AtomicU64::new(0),
            cluster: ClusterMetrics::default(),
            grants_exclusive: AtomicU64::new(0),
            grants_shared: AtomicU64::new(0),
            held_shared: AtomicU64::new(0),
            waiters_shared: AtomicU64::new(0),
            downgrades: AtomicU64::new(0),
            proclaims: AtomicU64::new(0),
            series: Default::default(),
        }
    }
}

/// What the accept loop and connection admission count.
#[derive(Debug, Default)]
pub struct ConnectionMetrics {
    /// Connections refused over `max_connections` (when they tried to authenticate).
    pub refused_over_cap: AtomicU64,
    /// Connections refused over `max_connections_per_ip`.
    pub refused_per_ip: AtomicU64,
    /// Unauthenticated connections closed to make room for a new one.
    pub evicted_unauthenticated: AtomicU64,
    /// Connections closed because they did not authenticate within `auth_timeout`.
    pub closed_auth_timeout: AtomicU64,
    /// Connections closed after `idle_timeout` with no request in flight.
    pub closed_idle: AtomicU64,
    /// Gauge: connections not yet authenticated.
    pub unauthenticated: AtomicU64,
}

/// A counter's help text, naming the vocabulary event it counts (operators find
/// the same name in the audit log, watch and `fencelock_events_total`).
fn help_of(help: &str, event: Option<Event>) -> String {
    match event {
        Some(e) => format!("{help} (`{e}` events)."),
        None => help.to_owned(),
    }
}

/// Every metric name exported, for dashboards and their tests.
pub const METRIC_NAMES: &[&str] = &[
    "fencelock_grants_total",
    "fencelock_releases_total",
    "fencelock_expiries_total",
    "fencelock_forced_releases_total",
    "fencelock_wait_timeouts_total",
    "fencelock_acquire_conflicts_total",
    "fencelock_held_locks",
    "fencelock_waiters",
    "fencelock_sessions",
    "fencelock_locks",
    "fencelock_next_fence",
    "fencelock_acquire_wait_seconds",
    "fencelock_hold_seconds",
    "fencelock_log_sync_seconds",
    "fencelock_log_batch_records",
    "fencelock_audit_write_seconds",
    "fencelock_audit_entries",
    "fencelock_requests_refused_total",
    "fencelock_connections_refused_total",
    "fencelock_wire_connections_total",
    "fencelock_dashboard_renders_total",
    "fencelock_dashboard_views",
    "fencelock_connections_refused_per_ip_total",
    "fencelock_connections_closed_total",
    "fencelock_unauthenticated_connections",
    "fencelock_grants_by_mode_total",
    "fencelock_held_locks_by_mode",
    "fencelock_waiters_by_mode",
    "fencelock_downgrades_total",
    "fencelock_proclaims_total",
    "fencelock_events_total",
];

impl Metrics {
    /// Renders the Prometheus text exposition format.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let counters = [
            (
                METRIC_NAMES[0],
                "Grants made, direct or by hand-off",
                Some(Event::Granted),
                &self.grants,
            ),
            (
                METRIC_NAMES[1],
                "Grants released by their holders",
                Some(Event::Released),
                &self.releases,
            ),
            (
                METRIC_NAMES[2],
                "Grants whose lease expired",
                Some(Event::Expired),
                &self.expiries,
            ),
            (
                METRIC_NAMES[3],
                "Grants taken away by an operator",
                Some(Event::ForceReleased),
                &self.forced_releases,
            ),
            (
                METRIC_NAMES[4],
                "Queued acquires that timed out",
                Some(Event::WaitEnded),
                &self.wait_timeouts,
            ),
            (
                METRIC_NAMES[5],
                "Acquires refused because the lock was held.",
                None,
                &self.acquire_conflicts,
            ),
        ];
        for (name, help, event, value) in counters {
            let help = help_of(help, event);
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                load(value)
            );
        }
        let gauges = [
            (METRIC_NAMES[6], "Grants held now.", &self.held),
            (METRIC_NAMES[7], "Acquires queued now.", &self.waiters),
            (METRIC_NAMES[8], "Open sessions.", &self.sessions),
            (
                METRIC_NAMES[9],
                "Locks held, queued for or in lock-delay.",
                &self.locks,
            ),
            (
                METRIC_NAMES[10],
                "The fence the next grant gets.",
                &self.next_fence,
            ),
        ];
        for (name, help, value) in gauges {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {}",
                load(value)
            );
        }
        self.acquire_wait
            .render(&mut out, METRIC_NAMES[11], "Time from queueing to grant.");
        self.hold_time.render(
            &mut out,
            METRIC_NAMES[12],
            "Time a grant was held before it ended.",
        );
        self.fsync.render(
            &mut out,
            METRIC_NAMES[13],
            "Duration of a log sync (write and fdatasync).",
        );
        self.batch_size.render(
            &mut out,
            METRIC_NAMES[14],
            "Commands made durable per log sync.",
        );
        self.audit_write.render(
            &mut out,
            METRIC_NAMES[15],
            "Duration of an audit log write (the entries of one log sync, before its replies).",
        );
        let name = METRIC_NAMES[16];
        let _ = writeln!(
            out,
            "# HELP {name} Audit entries retained.\n# TYPE {name} gauge\n{name} {}",
            load(&self.audit_entries)
        );
        let name = METRIC_NAMES[17];
        let _ = writeln!(
            out,
            "# HELP {name} Requests refused at the edge, by reason.\n# TYPE {name} counter"
        );
        for (reason, value) in [
            ("unauthenticated", &self.refused_unauthenticated),
            ("permission_denied", &self.refused_permission_denied),
            ("rate_limited", &self.refused_rate_limited),
            ("overloaded", &self.refused_overloaded),
        ] {
            let _ = writeln!(out, "{name}{{reason=\"{reason}\"}} {}", load(value));
        }
        let name = METRIC_NAMES[18];
        let _ = writeln!(
            out,
            "# HELP {name} Connections refused over max_connections.\n# TYPE {name} counter\n{name} {}",
            load(&self.connections.refused_over_cap)
        );
        let name = METRIC_NAMES[19];
        let _ = writeln!(
            out,
            "# HELP {name} Connections that spoke the wire protocol flw/1.\n# TYPE {name} counter\n{name} {}",
            load(&self.wire_connections)
        );
        let name = METRIC_NAMES[20];
        let _ = writeln!(
            out,
            "# HELP {name} Renders of a dashboard live view, each shared by all its streams.\n# TYPE {name} counter\n{name} {}",
            load(&self.dashboard_renders)
        );
        let name = METRIC_NAMES[21];
        let _ = writeln!(
            out,
            "# HELP {name} Distinct dashboard live views being rendered.\n# TYPE {name} gauge\n{name} {}",
            load(&self.dashboard_views)
        );
        let c = &self.connections;
        let name = METRIC_NAMES[22];
        let _ = writeln!(
            out,
            "# HELP {name} Connections refused over max_connections_per_ip.\n# TYPE {name} counter\n{name} {}",
            load(&c.refused_per_ip)
        );
        let name = METRIC_NAMES[23];
        let _ = writeln!(
            out,
            "# HELP {name} Connections the server closed, by reason.\n# TYPE {name} counter"
        );
        for (reason, value) in [
            ("unauthenticated_evicted", &c.evicted_unauthenticated),
            ("auth_timeout", &c.closed_auth_timeout),
            ("idle", &c.closed_idle),
        ] {
            let _ = writeln!(out, "{name}{{reason=\"{reason}\"}} {}", load(value));
        }
        let name = METRIC_NAMES[24];
        let _ = writeln!(
            out,
            "# HELP {name} Connections not yet authenticated.\n# TYPE {name} gauge\n{name} {}",
            load(&c.unauthenticated)
        );
        self.render_kinds(&mut out, load);
        self.render_events(&mut out);
        self.render_cluster(&mut out);
        out
    }

    /// The lock-kind families: grants, holders and waiters per mode, downgrades
    /// and proclaims. Exclusive holders and waiters are the totals less the shared.
    fn render_kinds(&self, out: &mut String, load: impl Fn(&AtomicU64) -> u64) {
        let held = load(&self.held);
        let waiting = load(&self.waiters);
        let (held_shared, waiting_shared) = (load(&self.held_shared), load(&self.waiters_shared));
        let families = [
            (
                METRIC_NAMES[25],
                "Grants made, by mode.",
                "counter",
                [load(&self.grants_exclusive), load(&self.grants_shared)],
            ),
            (
                METRIC_NAMES[26],
                "Grants held now, by mode.",
                "gauge",
                [held.saturating_sub(held_shared), held_shared],
            ),
            (
                METRIC_NAMES[27],
                "Acquires queued now, by mode.",
                "gauge",
                [waiting.saturating_sub(waiting_shared), waiting_shared],
            ),
        ];
        for (name, help, kind, [exclusive, shared]) in families {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{mode=\"exclusive\"}} {exclusive}\n{name}{{mode=\"shared\"}} {shared}"
            );
        }
        for (name, help, event, value) in [
            (
                METRIC_NAMES[28],
                "Exclusive grants downgraded to shared",
                Some(Event::Downgraded),
                &self.downgrades,
            ),
            (
                METRIC_NAMES[29],
                "New values proclaimed by election leaders",
                Some(Event::Proclaimed),
                &self.proclaims,
            ),
        ] {
            let help = help_of(help, event);
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                load(value)
            );
        }
    }

    /// Counts a lock event under its vocabulary name.
    pub fn count_event(&self, event: Event) {
        if let Some(i) = Event::ALL.iter().position(|e| *e == event) {
            self.events[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// `fencelock_events_total`: one series per watch event, labelled with the
    /// vocabulary's name (the same `kind` as the audit log and watch).
    fn render_events(&self, out: &mut String) {
        let name = METRIC_NAMES[30];
        let _ = writeln!(
            out,
            "# HELP {name} Lock events, by event name (as in the audit log and watch).\n# TYPE {name} counter"
        );
        for (event, count) in Event::ALL.iter().zip(&self.events) {
            if event.pb().is_some() {
                let _ = writeln!(
                    out,
                    "{name}{{event=\"{}\"}} {}",
                    event.name(),
                    count.load(Ordering::Relaxed)
                );
            }
        }
    }

    /// Records what openraft reports of this member.
    pub fn set_cluster(&self, m: &openraft::RaftMetrics<crate::cluster::TypeConfig>) {
        let c = &self.cluster;
        c.enabled.store(true, Ordering::Relaxed);
        let leading = m.state == openraft::ServerState::Leader;
        c.leader.store(u64::from(leading), Ordering::Relaxed);
        c.term.store(m.current_term, Ordering::Relaxed);
        c.committed.store(
            m.cluster_committed.map_or(0, |id| id.index),
            Ordering::Relaxed,
        );
        c.applied
            .store(m.last_applied.map_or(0, |id| id.index), Ordering::Relaxed);
        let mut lag = c.peer_lag.lock().unwrap_or_else(|e| e.into_inner());
        lag.clear();
        if let (true, Some(replication)) = (leading, &m.replication) {
            let last = m.last_log_index.unwrap_or(0);
            for (id, matched) in replication.iter() {
                let matched = matched.map_or(0, |l| l.index);
                lag.insert(*id, last.saturating_sub(matched));
            }
        }
    }

    fn render_cluster(&self, out: &mut String) {
        let c = &self.cluster;
        if !c.enabled.load(Ordering::Relaxed) {
            return;
        }
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        for (i, kind, help, value) in [
            (
                0,
                "gauge",
                "1 while this member leads the cluster.",
                &c.leader,
            ),
            (1, "gauge", "The current Raft term.", &c.term),
            (
                2,
                "gauge",
                "The last committed Raft log index.",
                &c.committed,
            ),
            (3, "gauge", "The last applied Raft log index.", &c.applied),
            (
                4,
                "counter",
                "Times this member became leader.",
                &c.leader_changes,
            ),
        ] {
            let name = CLUSTER_METRIC_NAMES[i];
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {}",
                load(value)
            );
        }
        let name = CLUSTER_METRIC_NAMES[5];
        let _ = writeln!(
            out,
            "# HELP {name} On the leader: log entries each member is behind.\n# TYPE {name} gauge"
        );
        let lag = c.peer_lag.lock().unwrap_or_else(|e| e.into_inner());
        for (id, behind) in lag.iter() {
            let _ = writeln!(out, "{name}{{member=\"{id}\"}} {behind}");
        }
        drop(lag);
        c.log_sync.render(
            out,
            CLUSTER_METRIC_NAMES[6],
            "Duration of a Raft log sync (write and fdatasync of a group of appends, votes and commits).",
        );
        let name = CLUSTER_METRIC_NAMES[7];
        let _ = writeln!(
            out,
            "# HELP {name} Pre-Vote elections this member started because its silent leader's peer port refused connections (the leader's process was gone).\n# TYPE {name} counter\n{name} {}",
            load(&c.watchdog_elections)
        );
    }

    /// Counts a request refused with `kind`, if it is one of the edge refusals.
    pub fn count_refusal(&self, kind: crate::ApiErrorKind) {
        let counter = match kind {
            crate::ApiErrorKind::Unauthenticated => &self.refused_unauthenticated,
            crate::ApiErrorKind::PermissionDenied => &self.refused_permission_denied,
            crate::ApiErrorKind::RateLimited => &self.refused_rate_limited,
            _ => return,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_named_metric_with_cumulative_buckets() {
        let m = Metrics::default();
        m.grants.fetch_add(3, Ordering::Relaxed);
        m.acquire_wait.observe(3);
        m.acquire_wait.observe(700);
        m.acquire_wait.observe(10_000_000);
        let text = m.render();
        for name in METRIC_NAMES {
            assert!(text.contains(&format!("# TYPE {name} ")), "{name} missing");
        }
        assert!(text.contains("fencelock_grants_total 3\n"));
        m.count_event(Event::ForceReleased);
        let text = m.render();
        assert!(text.contains("fencelock_events_total{event=\"force_released\"} 1\n"));
        assert!(text.contains("fencelock_events_total{event=\"granted\"} 0\n"));
        // Audit-only events are not counted here.
        assert!(!text.contains("event=\"renew_failed\""), "{text}");
        assert!(text.contains("fencelock_acquire_wait_seconds_bucket{le=\"0.005\"} 1\n"));
        assert!(text.contains("fencelock_acquire_wait_seconds_bucket{le=\"1\"} 2\n"));
        assert!(text.contains("fencelock_acquire_wait_seconds_bucket{le=\"+Inf\"} 3\n"));
        assert!(text.contains("fencelock_acquire_wait_seconds_count 3\n"));
        // Cluster figures only in cluster mode.
        assert!(!text.contains("fencelock_raft_"), "{text}");
    }

    #[test]
    fn a_cluster_member_renders_every_cluster_metric() {
        let m = Metrics::default();
        m.cluster.enabled.store(true, Ordering::Relaxed);
        m.cluster.log_sync.observe(1_500);
        let text = m.render();
        for name in CLUSTER_METRIC_NAMES {
            assert!(text.contains(&format!("# TYPE {name} ")), "{name} missing");
        }
        assert!(text.contains("fencelock_raft_log_sync_seconds_bucket{le=\"0.002\"} 1\n"));
        assert!(text.contains("fencelock_raft_log_sync_seconds_count 1\n"));
    }
}
