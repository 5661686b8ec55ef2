//! `fencelock-bench`: runs the benchmark (see the crate docs and `BENCHMARKS.md`).
//!
//! ```text
//! fencelock-bench run --fencelock-bin target/release/fencelock --out DIR   # full run
//! fencelock-bench run --smoke --fencelock-bin target/debug/fencelock       # seconds, for CI
//! fencelock-bench report --results DIR/results.jsonl --out DIR             # tables + chart again
//! fencelock-bench run --targets fencelock-3,etcd-3,zk-3 --workloads w1,w2,w3,failover  # clusters
//! fencelock-bench cluster-report --results A.jsonl --results B.jsonl …    # medians of runs
//! fencelock-bench run --targets fencelock,etcd,zookeeper --workloads w6,election  # issue 22
//! fencelock-bench issue22-report --results A.jsonl --results B.jsonl …   # medians of runs
//! ```
//! Exit status: 0 when every run completed and the checker found no violation in
//! fencelock; 1 otherwise (peers' violations are reported, not failures).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use serde_json::{json, Value};

use fencelock_bench::cluster::{self, Cluster};
use fencelock_bench::election::{self, CandidateSpec, ElectionSpec};
use fencelock_bench::failover::{self, FailoverSpec};
use fencelock_bench::fleet::{self, RecoverySpec, SessionsSpec};
use fencelock_bench::read_mostly::{self, RwSpec, Store};
use fencelock_bench::targets::cluster::{FencelockClusterLocker, Spread};
use fencelock_bench::targets::etcd::EtcdLocker;
use fencelock_bench::targets::fencelock::{FencelockGrpcLocker, FencelockLocker, FencelockTarget};
use fencelock_bench::targets::mysql::MysqlTableLocker;
use fencelock_bench::targets::pg::{self, PgAdvisoryLocker, PgTableLocker};
use fencelock_bench::targets::redis::{RedisConfig, RedisLocker};
use fencelock_bench::targets::zk::ZkLocker;
use fencelock_bench::targets::Locker;
use fencelock_bench::workload::{self, Keys, Outcome, Spec};
use fencelock_bench::{peers, report};

#[derive(Parser)]
#[command(about = "Benchmarks fencelock against etcd, ZooKeeper, Redis and PostgreSQL")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start the peers, run the workloads, write results.jsonl, report.md, chart.svg.
    Run(RunArgs),
    /// Regenerate report.md and chart.svg from a results.jsonl.
    Report {
        /// The JSON lines of a run.
        #[arg(long)]
        results: PathBuf,
        /// Where report.md and chart.svg go.
        #[arg(long)]
        out: PathBuf,
    },
    /// Print the "Cluster (3 members)" tables of BENCHMARKS.md: per figure, the
    /// median over the given runs of each run's own ratio, and the failover rounds.
    ClusterReport {
        /// The JSON lines of each run (give it once per run).
        #[arg(long, required = true)]
        results: Vec<PathBuf>,
    },
    /// Print the W6 and election tables of BENCHMARKS.md over several runs: per figure
    /// the median over the runs, per ratio the median of each run's own ratio.
    Issue22Report {
        /// The JSON lines of each run (give it once per run).
        #[arg(long, required = true)]
        results: Vec<PathBuf>,
    },
    /// One candidate of the election failover (started by `run`, not by hand):
    /// campaign, write through the fence once leading, report on stdout.
    #[command(hide = true)]
    Candidate(CandidateArgs),
}

#[derive(clap::Args)]
struct CandidateArgs {
    /// fencelock, etcd or zookeeper.
    #[arg(long)]
    store: String,
    /// The server's URL (fencelock, etcd) or port (zookeeper).
    #[arg(long)]
    endpoint: String,
    /// The election's name.
    #[arg(long)]
    election: String,
    /// This candidate's name.
    #[arg(long)]
    id: String,
    /// The leader's lease, in milliseconds.
    #[arg(long)]
    ttl_ms: u64,
    /// The fence gate's directory.
    #[arg(long)]
    gate_dir: PathBuf,
}

#[derive(clap::Args)]
struct RunArgs {
    /// A few seconds in all, tiny sizes: proves the harness works (CI).
    #[arg(long)]
    smoke: bool,
    /// The `fencelock` server binary.
    #[arg(long, default_value = "target/release/fencelock")]
    fencelock_bin: PathBuf,
    /// Output directory (created).
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
    /// Targets to run (default: all).
    #[arg(long, value_delimiter = ',')]
    targets: Vec<Target>,
    /// Workloads to run (default: all).
    #[arg(long, value_delimiter = ',')]
    workloads: Vec<Workload>,
    /// Measured seconds per W1–W3 run.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Warm-up seconds per W1–W3 run.
    #[arg(long, default_value_t = 1.0)]
    warmup: f64,
    /// W4: sessions kept alive.
    #[arg(long, default_value_t = 100_000)]
    sessions: usize,
    /// W5: locks held at the restart.
    #[arg(long, default_value_t = 1_000_000)]
    locks: usize,
    /// W5: keep the data directory here (to profile restarts) instead of a temp dir.
    #[arg(long)]
    keep_data: Option<PathBuf>,
    /// Failover: leader kills per cluster target (1 with --smoke).
    #[arg(long, default_value_t = 10)]
    kills: usize,
    /// fencelock-3: one more argument for every member's `fencelock serve` (repeat
    /// it: `--fencelock-cluster-arg=--raft-heartbeat-ms --fencelock-cluster-arg=50`).
    #[arg(long, allow_hyphen_values = true)]
    fencelock_cluster_arg: Vec<String>,
    /// W6: clients on the one key.
    #[arg(long, default_value_t = 64)]
    w6_clients: usize,
    /// W6: seeds every client's generator of modes (95 % shared).
    #[arg(long, default_value_t = 22)]
    seed: u64,
    /// Election: leader kills per target (2 with --smoke).
    #[arg(long, default_value_t = 10)]
    election_rounds: usize,
    /// Election: every candidate's lease, in milliseconds (the same for every store).
    #[arg(long, default_value_t = 2000)]
    election_ttl_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Target {
    Fencelock,
    FencelockLibGrpc,
    FencelockGrpc,
    FencelockNone,
    Etcd,
    Zookeeper,
    Redis,
    RedisFenced,
    RedisAof,
    RedisFencedAof,
    PgTable,
    PgAdvisory,
    /// MariaDB through fencelock-mysql's lock table (durable InnoDB).
    MysqlTable,
    /// Three `fencelock serve` members; clients on the leader, following `not_leader`.
    #[value(name = "fencelock-3")]
    Fencelock3,
    /// Three etcd members; client i on member i % 3.
    #[value(name = "etcd-3")]
    Etcd3,
    /// A three-server ZooKeeper ensemble; client i on server i % 3.
    #[value(name = "zk-3")]
    Zk3,
}

impl Target {
    fn name(self) -> &'static str {
        match self {
            Target::Fencelock => "fencelock",
            Target::FencelockLibGrpc => "fencelock-lib-grpc",
            Target::FencelockGrpc => "fencelock-grpc",
            Target::FencelockNone => "fencelock-none",
            Target::Etcd => "etcd",
            Target::Zookeeper => "zookeeper",
            Target::Redis => "redis",
            Target::RedisFenced => "redis-fenced",
            Target::RedisAof => "redis-aof",
            Target::RedisFencedAof => "redis-fenced-aof",
            Target::PgTable => "pg-table",
            Target::PgAdvisory => "pg-advisory",
            Target::MysqlTable => "mysql-table",
            Target::Fencelock3 => "fencelock-3",
            Target::Etcd3 => "etcd-3",
            Target::Zk3 => "zk-3",
        }
    }

    /// A three-member cluster (run only when named: `--targets fencelock-3,…`).
    fn is_cluster(self) -> bool {
        matches!(self, Target::Fencelock3 | Target::Etcd3 | Target::Zk3)
    }

    /// The durability tier: acknowledged grants survive a crash ("fsync") or not.
    fn tier(self) -> &'static str {
        match self {
            Target::Fencelock
            | Target::FencelockLibGrpc
            | Target::FencelockGrpc
            | Target::Etcd
            | Target::Zookeeper
            | Target::RedisAof
            | Target::RedisFencedAof
            | Target::PgTable
            | Target::MysqlTable => "fsync",
            Target::FencelockNone | Target::Redis | Target::RedisFenced | Target::PgAdvisory => {
                "memory"
            }
            // Durable too (every member fsyncs), but compared only with each other.
            Target::Fencelock3 | Target::Etcd3 | Target::Zk3 => "cluster",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Workload {
    W1,
    W2,
    W3,
    W4,
    W5,
    /// `kill -9` the leader of each cluster target under W2 load, `--kills` times.
    Failover,
    /// Read-mostly: 64 clients on one key, 95 % shared / 5 % exclusive
    /// (fencelock, etcd, zookeeper).
    W6,
    /// Election failover: `kill -9` the leading candidate process, time to the next
    /// leader's first fenced write (fencelock, etcd, zookeeper).
    Election,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let result = match cli.command {
        Command::Run(args) => runtime.block_on(run(args)),
        Command::Report { results, out } => write_report(&results, &out).map(|()| true),
        Command::ClusterReport { results } => cluster_report(&results).map(|()| true),
        Command::Issue22Report { results } => read_runs(&results)
            .map(|files| print!("{}", report::issue22_markdown(&files)))
            .map(|()| true),
        Command::Candidate(args) => runtime.block_on(run_candidate(args)).map(|()| true),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("fencelock-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

struct Session {
    out: std::fs::File,
    started: u64,
    seq: usize,
    ok: bool,
}

impl Session {
    fn emit(&mut self, mut record: Value) -> anyhow::Result<()> {
        record["invocation"] = json!(self.started);
        let line = record.to_string();
        println!("{line}");
        writeln!(self.out, "{line}")?;
        Ok(())
    }
}

fn load() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

fn outcome_json(target: Target, workload: Workload, spec: &Spec, o: &Outcome) -> Value {
    json!({
        "target": target.name(),
        "tier": target.tier(),
        "workload": format!("{workload:?}"),
        "clients": spec.clients,
        "keys": if spec.keys == Keys::Shared { "shared" } else { "distinct" },
        "seconds": o.seconds,
        "pairs": o.pairs,
        "pairs_per_s": o.pairs as f64 / o.seconds,
        "handoffs_per_s": o.checked.handoffs as f64 / o.seconds,
        "pair_p50_us": o.pair.p50_us, "pair_p99_us": o.pair.p99_us,
        "pair_p999_us": o.pair.p999_us, "pair_max_us": o.pair.max_us,
        "wait_p50_us": o.wait.p50_us, "wait_p99_us": o.wait.p99_us,
        "wait_max_us": o.wait.max_us,
        "handoffs": o.checked.handoffs,
        "fifo_inversions": o.checked.fifo_inversions,
        "overlaps": o.checked.overlaps,
        "fence_decreases": o.checked.fence_decreases,
        "violations": o.checked.examples.iter().map(|v| json!({
            "kind": format!("{:?}", v.kind), "key": v.key, "detail": v.detail,
        })).collect::<Vec<_>>(),
        "errors": o.errors,
        "first_error": o.first_error,
        "load_avg_1m": load(),
    })
}

/// Runs every workload of `runs` against one target. `log_port`: a durable fencelock
/// server's port, whose fdatasyncs during each run (warm-up included) are recorded
/// with it (`log_syncs`, `log_sync_mean_us`), as the report's W3 ceiling needs.
async fn one<L: Locker>(
    config: L::Config,
    runs: &[(Workload, Spec)],
    target: Target,
    log_port: Option<u16>,
    session: &mut Session,
) -> anyhow::Result<()> {
    let config = Arc::new(config);
    for (workload, spec) in runs {
        let before = match log_port {
            Some(port) => peers::fencelock_log_syncs(port).await,
            None => None,
        };
        let outcome = workload::run::<L>(config.clone(), spec)
            .await
            .with_context(|| format!("{} {workload:?} c={}", target.name(), spec.clients))?;
        let after = match log_port {
            Some(port) => peers::fencelock_log_syncs(port).await,
            None => None,
        };
        let violated = outcome.checked.overlaps + outcome.checked.fence_decreases > 0;
        if target.name().starts_with("fencelock")
            && (violated || outcome.errors > 0 || outcome.pairs == 0)
        {
            session.ok = false;
        }
        let mut record = outcome_json(target, *workload, spec, &outcome);
        if let (Some((n0, s0)), Some((n1, s1))) = (before, after) {
            let syncs = n1.saturating_sub(n0);
            record["log_syncs"] = json!(syncs);
            if syncs > 0 {
                record["log_sync_mean_us"] = json!(((s1 - s0) / syncs as f64 * 1e6).round());
            }
        }
        session.emit(record)?;
    }
    Ok(())
}

async fn run_target(
    target: Target,
    args: &RunArgs,
    runs: &[(Workload, Spec)],
    session: &mut Session,
) -> anyhow::Result<()> {
    match target {
        Target::Fencelock | Target::FencelockNone => {
            let peer = peers::fencelock(&args.fencelock_bin, target == Target::Fencelock, None)?;
            let url = format!("http://127.0.0.1:{}", peer.port());
            // W3's FIFO order, audited on the server's own event stream as well.
            let stop = Arc::new(tokio::sync::Notify::new());
            let mut audits = Vec::new();
            for (w, spec) in runs.iter().filter(|(w, _)| *w == Workload::W3) {
                let audit =
                    fleet::fifo_audit(url.clone(), spec.key_prefix.clone(), stop.clone()).await?;
                audits.push((*w, spec.clients, audit));
            }
            let config = FencelockTarget {
                url,
                transport: fencelock::Transport::Wire,
            };
            let log_port = (target == Target::Fencelock).then(|| peer.port());
            let result = one::<FencelockLocker>(config, runs, target, log_port, session).await;
            // Let the last events arrive before stopping the audits.
            tokio::time::sleep(Duration::from_millis(200)).await;
            stop.notify_waiters();
            for (w, clients, audit) in audits {
                let a = audit.await?;
                if a.inversions > 0 || a.incomplete {
                    session.ok = false;
                }
                session.emit(json!({
                    "target": target.name(), "tier": target.tier(),
                    "workload": format!("{w:?}-server-fifo"), "clients": clients,
                    "grants_seen": a.grants, "server_fifo_inversions": a.inversions,
                    "incomplete": a.incomplete,
                }))?;
            }
            result
        }
        Target::FencelockLibGrpc => {
            let peer = peers::fencelock(&args.fencelock_bin, true, None)?;
            let config = FencelockTarget {
                url: format!("http://127.0.0.1:{}", peer.port()),
                transport: fencelock::Transport::Grpc,
            };
            one::<FencelockLocker>(config, runs, target, None, session).await
        }
        Target::FencelockGrpc => {
            let peer = peers::fencelock(&args.fencelock_bin, true, None)?;
            let url = format!("http://127.0.0.1:{}", peer.port());
            one::<FencelockGrpcLocker>(url, runs, target, None, session).await
        }
        Target::Etcd => {
            let peer = peers::etcd()?;
            one::<EtcdLocker>(
                format!("http://127.0.0.1:{}", peer.port()),
                runs,
                target,
                None,
                session,
            )
            .await
        }
        Target::Zookeeper => {
            let peer = peers::zookeeper()?;
            one::<ZkLocker>(peer.port(), runs, target, None, session).await
        }
        Target::Redis | Target::RedisFenced | Target::RedisAof | Target::RedisFencedAof => {
            let fsync = matches!(target, Target::RedisAof | Target::RedisFencedAof);
            let peer = peers::redis(fsync)?;
            let config = RedisConfig {
                port: peer.port(),
                fenced: matches!(target, Target::RedisFenced | Target::RedisFencedAof),
            };
            one::<RedisLocker>(config, runs, target, None, session).await
        }
        Target::PgTable | Target::PgAdvisory => {
            let peer = peers::postgres()?;
            let conninfo = peers::postgres_conninfo(&peer);
            if target == Target::PgTable {
                pg::setup(&conninfo).await?;
                one::<PgTableLocker>(conninfo, runs, target, None, session).await
            } else {
                one::<PgAdvisoryLocker>(conninfo, runs, target, None, session).await
            }
        }
        Target::MysqlTable => {
            let peer = peers::mariadb()?;
            one::<MysqlTableLocker>(peers::mariadb_url(&peer), runs, target, None, session).await
        }
        Target::Fencelock3 | Target::Etcd3 | Target::Zk3 => {
            run_cluster(target, args, runs, session).await
        }
    }
}

/// A cluster target: one three-member cluster for its W1–W3 runs and then, if asked,
/// the failover rounds.
async fn run_cluster(
    target: Target,
    args: &RunArgs,
    runs: &[(Workload, Spec)],
    session: &mut Session,
) -> anyhow::Result<()> {
    let kind = match target {
        Target::Fencelock3 => cluster::Kind::Fencelock,
        Target::Etcd3 => cluster::Kind::Etcd,
        _ => cluster::Kind::ZooKeeper,
    };
    let mut cluster =
        Cluster::start(kind, &args.fencelock_bin, &args.fencelock_cluster_arg).await?;
    let w123: Vec<(Workload, Spec)> = runs
        .iter()
        .filter(|(w, _)| *w != Workload::Failover)
        .cloned()
        .collect();
    let failover = runs.iter().find(|(w, _)| *w == Workload::Failover);
    match target {
        Target::Fencelock3 => {
            let urls = cluster.urls();
            if !w123.is_empty() {
                let leader = fencelock_bench::targets::cluster::find_leader(
                    &urls,
                    0,
                    std::time::Instant::now() + Duration::from_secs(30),
                )
                .await?;
                // W3's FIFO order, audited on the leader's own event stream too.
                let stop = Arc::new(tokio::sync::Notify::new());
                let mut audits = Vec::new();
                for (w, spec) in w123.iter().filter(|(w, _)| *w == Workload::W3) {
                    let audit =
                        fleet::fifo_audit(leader.clone(), spec.key_prefix.clone(), stop.clone())
                            .await?;
                    audits.push((*w, spec.clients, audit));
                }
                // No `log_port`: a cluster member's `fencelock_log_sync_seconds` stays at
                // zero (the Raft log's fdatasyncs are not counted there), so it would
                // record a misleading `log_syncs: 0`.
                let result =
                    one::<FencelockClusterLocker>(urls.clone(), &w123, target, None, session).await;
                tokio::time::sleep(Duration::from_millis(200)).await;
                stop.notify_waiters();
                for (w, clients, audit) in audits {
                    let a = audit.await?;
                    if a.inversions > 0 || a.incomplete {
                        session.ok = false;
                    }
                    session.emit(json!({
                        "target": target.name(), "tier": target.tier(),
                        "workload": format!("{w:?}-server-fifo"), "clients": clients,
                        "grants_seen": a.grants, "server_fifo_inversions": a.inversions,
                        "incomplete": a.incomplete,
                    }))?;
                }
                result?;
            }
            if let Some((_, spec)) = failover {
                let config = Arc::new(urls);
                let o = failover::run::<FencelockClusterLocker>(
                    &mut cluster,
                    config,
                    &failover_spec(args, spec),
                )
                .await?;
                emit_failover(target, args, spec, &o, session)?;
            }
        }
        Target::Etcd3 => {
            let urls = cluster.urls();
            if !w123.is_empty() {
                one::<Spread<EtcdLocker>>(urls.clone(), &w123, target, None, session).await?;
            }
            if let Some((_, spec)) = failover {
                let o = failover::run::<Spread<EtcdLocker>>(
                    &mut cluster,
                    Arc::new(urls),
                    &failover_spec(args, spec),
                )
                .await?;
                emit_failover(target, args, spec, &o, session)?;
            }
        }
        _ => {
            let ports = cluster.client_ports();
            if !w123.is_empty() {
                one::<Spread<ZkLocker>>(ports.clone(), &w123, target, None, session).await?;
            }
            if let Some((_, spec)) = failover {
                let o = failover::run::<Spread<ZkLocker>>(
                    &mut cluster,
                    Arc::new(ports),
                    &failover_spec(args, spec),
                )
                .await?;
                emit_failover(target, args, spec, &o, session)?;
            }
        }
    }
    Ok(())
}

/// The failover rounds' shape: `--kills` kills (1 in smoke mode) under W2's load.
fn failover_spec(args: &RunArgs, spec: &Spec) -> FailoverSpec {
    FailoverSpec {
        kills: if args.smoke { 1 } else { args.kills.max(1) },
        load_clients: spec.clients,
        settle: if args.smoke {
            Duration::from_millis(300)
        } else {
            Duration::from_secs(1)
        },
        attempt_every: Duration::from_millis(50),
        attempt_timeout: Duration::from_secs(2),
        probe_timeout: PROBE_TIMEOUT,
        heal_timeout: Duration::from_secs(90),
        key_prefix: spec.key_prefix.clone(),
    }
}

/// A failover round without a grant after this counts as this long.
const PROBE_TIMEOUT: Duration = Duration::from_secs(30);

fn emit_failover(
    target: Target,
    args: &RunArgs,
    spec: &Spec,
    o: &failover::FailoverOutcome,
    session: &mut Session,
) -> anyhow::Result<()> {
    let (p50, max) = failover::summary_ms(&o.rounds, PROBE_TIMEOUT).unwrap_or((f64::NAN, f64::NAN));
    let timeouts = o.rounds.iter().filter(|r| r.grant_after.is_none()).count();
    let violated = o.checked.overlaps + o.checked.fence_decreases > 0;
    if target == Target::Fencelock3 && (violated || timeouts > 0 || o.rounds.is_empty()) {
        session.ok = false;
    }
    let mut heal: Vec<f64> = o.rounds.iter().map(|r| r.heal.as_secs_f64()).collect();
    heal.sort_by(f64::total_cmp);
    session.emit(json!({
        "target": target.name(), "tier": target.tier(), "workload": "failover",
        "clients": spec.clients,
        "kills": o.rounds.len(),
        "kills_asked": if args.smoke { 1 } else { args.kills },
        "failover_p50_ms": p50, "failover_max_ms": max,
        "failover_ms": o.rounds.iter().map(|r| r.grant_after.map(|d| d.as_secs_f64() * 1e3)).collect::<Vec<_>>(),
        "attempts": o.rounds.iter().map(|r| r.attempts).collect::<Vec<_>>(),
        "killed_members": o.rounds.iter().map(|r| r.leader).collect::<Vec<_>>(),
        "probe_first_errors": o.rounds.iter().map(|r| r.first_error.clone()).collect::<Vec<_>>(),
        "timeouts": timeouts,
        "heal_p50_s": heal.get(heal.len() / 2).copied(),
        "load_pairs": o.load_pairs, "load_errors": o.load_errors,
        "overlaps": o.checked.overlaps, "fence_decreases": o.checked.fence_decreases,
        "violations": o.checked.examples.iter().map(|v| json!({
            "kind": format!("{:?}", v.kind), "key": v.key, "detail": v.detail,
        })).collect::<Vec<_>>(),
        "seconds": o.seconds,
        "server_args": if target == Target::Fencelock3 { args.fencelock_cluster_arg.clone() } else { Vec::new() },
        "load_avg_1m": load(),
    }))
}

async fn run(args: RunArgs) -> anyhow::Result<bool> {
    std::fs::create_dir_all(&args.out)?;
    anyhow::ensure!(
        args.fencelock_bin.is_file(),
        "no fencelock server binary at {} (build it: cargo build --release -p fencelock-cli)",
        args.fencelock_bin.display()
    );
    // Servers run in their own directories: the binary path must not be relative.
    let mut args = args;
    args.fencelock_bin = std::fs::canonicalize(&args.fencelock_bin)?;
    let results = args.out.join("results.jsonl");
    let mut session = Session {
        out: std::fs::File::create(&results)?,
        started: SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs(),
        seq: 0,
        ok: true,
    };
    let targets = if args.targets.is_empty() {
        // The clusters start nine processes each: only when named.
        Target::value_variants()
            .iter()
            .copied()
            .filter(|t| !t.is_cluster())
            .collect()
    } else {
        args.targets.clone()
    };
    let workloads = if args.workloads.is_empty() {
        Workload::value_variants().to_vec()
    } else {
        args.workloads.clone()
    };
    let (warmup, measure, small, big) = if args.smoke {
        (Duration::from_millis(100), Duration::from_millis(300), 4, 4)
    } else {
        (
            Duration::from_secs_f64(args.warmup),
            Duration::from_secs_f64(args.seconds),
            16,
            64,
        )
    };
    for target in targets {
        let mut runs = Vec::new();
        let mut push = |w: Workload, clients: usize, keys: Keys| {
            if workloads.contains(&w) {
                session.seq += 1;
                runs.push((
                    w,
                    Spec {
                        clients,
                        keys,
                        warmup,
                        measure,
                        key_prefix: format!("r{}-{}-", session.seq, session.started),
                    },
                ));
            }
        };
        push(Workload::W1, 1, Keys::Distinct);
        for c in if small == big {
            vec![small]
        } else {
            vec![small, big]
        } {
            push(Workload::W2, c, Keys::Distinct);
        }
        for c in if small == big {
            vec![small]
        } else {
            vec![small, big]
        } {
            push(Workload::W3, c, Keys::Shared);
        }
        if target.is_cluster() {
            // Under W2's load, with its smaller client count.
            push(Workload::Failover, small, Keys::Distinct);
        }
        if runs.is_empty() {
            continue;
        }
        eprintln!("fencelock-bench: {} ({} runs)", target.name(), runs.len());
        if let Err(e) = run_target(target, &args, &runs, &mut session).await {
            eprintln!("fencelock-bench: {}: {e:#}", target.name());
            session.ok = false;
            session.emit(
                json!({"target": target.name(), "tier": target.tier(), "error": format!("{e:#}")}),
            )?;
        }
    }
    for target in targets_of_issue_22(&args) {
        let w6 = workloads.contains(&Workload::W6);
        let election = workloads.contains(&Workload::Election);
        if !(w6 || election) {
            break;
        }
        eprintln!(
            "fencelock-bench: {} (issue 22: W6, election)",
            target.name()
        );
        session.seq += 1;
        let tag = format!("r{}-{}", session.seq, session.started);
        if let Err(e) = run_issue_22(target, &args, &tag, w6, election, &mut session).await {
            eprintln!("fencelock-bench: {}: {e:#}", target.name());
            session.ok = false;
            session.emit(
                json!({"target": target.name(), "tier": target.tier(), "error": format!("{e:#}")}),
            )?;
        }
    }
    if workloads.contains(&Workload::W4) {
        let spec = if args.smoke {
            SessionsSpec {
                sessions: 200,
                ttl: Duration::from_secs(1),
                hold: Duration::from_secs(2),
                expiry_sample: 5,
            }
        } else {
            SessionsSpec {
                sessions: args.sessions,
                ttl: Duration::from_secs(10),
                hold: Duration::from_secs(15),
                expiry_sample: 100,
            }
        };
        eprintln!("fencelock-bench: W4 ({} sessions)", spec.sessions);
        let peer = peers::fencelock(&args.fencelock_bin, true, None)?;
        let url = format!("http://127.0.0.1:{}", peer.port());
        let o = fleet::sessions(&url, peer.pid(), &spec).await?;
        session.ok &= o.lost == 0 && o.expiry_missing == 0;
        session.emit(json!({
            "target": "fencelock", "tier": "fsync", "workload": "W4",
            "sessions": spec.sessions, "ttl_ms": spec.ttl.as_millis() as u64,
            "opened": o.opened, "open_per_s": o.open_per_s, "lost": o.lost,
            "keepalives_per_s": o.keepalives_per_s, "max_renew_gap_s": o.max_renew_gap_s,
            "keepalive_p50_us": o.keepalive_latency.p50_us, "keepalive_p99_us": o.keepalive_latency.p99_us,
            "keepalive_max_us": o.keepalive_latency.max_us,
            "server_cpu_cores": o.server_cpu_cores, "server_rss_mib": o.server_rss_mib,
            "expiry_late_p50_ms": o.expiry_late_ms.p50_us, "expiry_late_p99_ms": o.expiry_late_ms.p99_us,
            "expiry_late_max_ms": o.expiry_late_ms.max_us, "expiry_missing": o.expiry_missing,
            "load_avg_1m": load(),
        }))?;
    }
    if workloads.contains(&Workload::W5) {
        let spec = RecoverySpec {
            locks: if args.smoke { 2_000 } else { args.locks },
            spot_checks: 100,
            keep_data: args.keep_data.clone(),
        };
        eprintln!("fencelock-bench: W5 ({} locks)", spec.locks);
        let o = fleet::recovery(&args.fencelock_bin, &spec).await?;
        session.ok &= o.lost_or_changed == 0 && o.fence_decreases == 0;
        session.emit(json!({
            "target": "fencelock", "tier": "fsync", "workload": "W5",
            "locks": o.locks, "fill_per_s": o.fill_per_s, "rss_before_mib": o.rss_before_mib,
            "data_mib": o.data_mib, "ready_s": o.ready_s, "max_fence_before": o.max_fence_before,
            "first_fence_after": o.first_fence_after, "lost_or_changed": o.lost_or_changed,
            "fence_decreases": o.fence_decreases, "load_avg_1m": load(),
        }))?;
    }
    drop(session.out);
    write_report(&results, &args.out)?;
    Ok(session.ok)
}

/// The targets of W6 and the election failover: the durable fencelock server, etcd and
/// ZooKeeper, in that order, among those asked for (all three by default).
fn targets_of_issue_22(args: &RunArgs) -> Vec<Target> {
    [Target::Fencelock, Target::Etcd, Target::Zookeeper]
        .into_iter()
        .filter(|t| args.targets.is_empty() || args.targets.contains(t))
        .collect()
}

/// W6 and the election failover against one target (a fresh peer for each).
async fn run_issue_22(
    target: Target,
    args: &RunArgs,
    tag: &str,
    w6: bool,
    election: bool,
    session: &mut Session,
) -> anyhow::Result<()> {
    // The peer process lives as long as its handle.
    let (store, _peer) = match target {
        Target::Fencelock => {
            let peer = peers::fencelock(&args.fencelock_bin, true, None)?;
            (
                Store::Fencelock(format!("http://127.0.0.1:{}", peer.port())),
                peer,
            )
        }
        Target::Etcd => {
            let peer = peers::etcd()?;
            (
                Store::Etcd(format!("http://127.0.0.1:{}", peer.port())),
                peer,
            )
        }
        _ => {
            let peer = peers::zookeeper()?;
            (Store::ZooKeeper(peer.port()), peer)
        }
    };
    if w6 {
        let spec = RwSpec {
            clients: if args.smoke { 4 } else { args.w6_clients },
            shared_percent: 95,
            seed: args.seed,
            warmup: Duration::from_secs_f64(if args.smoke { 0.1 } else { args.warmup }),
            measure: Duration::from_secs_f64(if args.smoke { 0.3 } else { args.seconds }),
            key: format!("{tag}-w6"),
        };
        let o = read_mostly::run(&store, &spec)
            .await
            .with_context(|| format!("{} W6", target.name()))?;
        let violated = o.checked.overlaps + o.checked.fence_decreases > 0;
        let grants = o.shared.grants + o.exclusive.grants;
        if target == Target::Fencelock && (violated || o.errors > 0 || grants == 0) {
            session.ok = false;
        }
        session.emit(json!({
            "target": target.name(), "tier": target.tier(), "workload": "W6",
            "clients": spec.clients, "shared_percent": spec.shared_percent, "seed": spec.seed,
            "seconds": o.seconds,
            "grants": grants, "grants_per_s": grants as f64 / o.seconds,
            "shared_grants": o.shared.grants,
            "shared_per_s": o.shared.grants as f64 / o.seconds,
            "exclusive_grants": o.exclusive.grants,
            "exclusive_per_s": o.exclusive.grants as f64 / o.seconds,
            "shared_pair_p50_us": o.shared.pair.p50_us, "shared_pair_p99_us": o.shared.pair.p99_us,
            "shared_wait_p50_us": o.shared.wait.p50_us, "shared_wait_p99_us": o.shared.wait.p99_us,
            "exclusive_pair_p50_us": o.exclusive.pair.p50_us,
            "exclusive_pair_p99_us": o.exclusive.pair.p99_us,
            "exclusive_wait_p50_us": o.exclusive.wait.p50_us,
            "exclusive_wait_p99_us": o.exclusive.wait.p99_us,
            "overlaps": o.checked.overlaps, "fence_decreases": o.checked.fence_decreases,
            "violations": o.checked.examples.iter().map(|v| json!({
                "kind": format!("{:?}", v.kind), "key": v.key, "detail": v.detail,
            })).collect::<Vec<_>>(),
            "errors": o.errors, "first_error": o.first_error,
            "load_avg_1m": load(),
        }))?;
    }
    if election {
        let spec = ElectionSpec {
            candidates: 3,
            rounds: if args.smoke {
                2
            } else {
                args.election_rounds.max(1)
            },
            ttl: Duration::from_millis(args.election_ttl_ms),
            settle: Duration::from_millis(if args.smoke { 300 } else { 1000 }),
            round_timeout: ELECTION_ROUND_TIMEOUT,
            election: format!("{tag}-election"),
        };
        let exe = std::env::current_exe().context("this binary's path")?;
        let o = election::run(&exe, &store, &spec)
            .await
            .with_context(|| format!("{} election", target.name()))?;
        let timeouts = o.rounds.iter().filter(|r| r.write_after.is_none()).count();
        if target == Target::Fencelock
            && (o.violations > 0 || timeouts > 0 || o.rounds.len() < spec.rounds)
        {
            session.ok = false;
        }
        let ms = |d: Option<Duration>| d.map(|d| d.as_secs_f64() * 1e3);
        let (p50, p99) = election::percentiles_ms(&o.rounds, ELECTION_ROUND_TIMEOUT)
            .unwrap_or((f64::NAN, f64::NAN));
        let mut leading: Vec<f64> = o
            .rounds
            .iter()
            .filter_map(|r| ms(r.leading_after))
            .collect();
        leading.sort_by(f64::total_cmp);
        session.emit(json!({
            "target": target.name(), "tier": target.tier(), "workload": "election",
            "candidates": spec.candidates, "ttl_ms": spec.ttl.as_millis() as u64,
            "rounds": o.rounds.len(), "rounds_asked": spec.rounds, "timeouts": timeouts,
            "failover_p50_ms": p50, "failover_p99_ms": p99,
            "leading_p50_ms": report::median(leading),
            "write_after_ms": o.rounds.iter().map(|r| ms(r.write_after)).collect::<Vec<_>>(),
            "leading_after_ms": o.rounds.iter().map(|r| ms(r.leading_after)).collect::<Vec<_>>(),
            "terms": o.rounds.iter().map(|r| (r.old_term, r.new_term)).collect::<Vec<_>>(),
            "final_fence": o.final_fence,
            "election_violations": o.violations, "violation_examples": o.examples,
            "load_avg_1m": load(),
        }))?;
    }
    Ok(())
}

/// An election round without a new leader's write after this is a timeout.
const ELECTION_ROUND_TIMEOUT: Duration = Duration::from_secs(30);

/// The `candidate` subcommand.
async fn run_candidate(args: CandidateArgs) -> anyhow::Result<()> {
    let spec = CandidateSpec {
        store: Store::parse(&args.store, &args.endpoint)?,
        election: args.election,
        id: args.id,
        ttl: Duration::from_millis(args.ttl_ms),
        gate_dir: args.gate_dir,
    };
    election::candidate(&spec).await
}

/// Prints the cluster tables of several runs (see `report::cluster_markdown`).
fn cluster_report(results: &[PathBuf]) -> anyhow::Result<()> {
    print!("{}", report::cluster_markdown(&read_runs(results)?));
    Ok(())
}

/// The JSON lines of each of several runs.
fn read_runs(results: &[PathBuf]) -> anyhow::Result<Vec<Vec<Value>>> {
    let mut files = Vec::with_capacity(results.len());
    for path in results {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
        let runs: Vec<Value> = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(serde_json::from_str)
            .collect::<Result<_, _>>()
            .with_context(|| format!("parse {}", path.display()))?;
        files.push(runs);
    }
    Ok(files)
}

fn write_report(results: &Path, out: &Path) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(results)?;
    let runs: Vec<Value> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    std::fs::create_dir_all(out)?;
    std::fs::write(out.join("report.md"), report::markdown(&runs))?;
    std::fs::write(out.join("chart.svg"), report::svg(&runs))?;
    eprintln!("fencelock-bench: wrote {}", out.join("report.md").display());
    Ok(())
}
