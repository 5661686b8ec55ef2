//! `fencelock serve` settings: defaults < TOML config file < environment < flags.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use fencelock_server::{
    AuthConfig, Durability, EngineConfig, Limits, QuotaOverrides, RateLimit, Role, ServerConfig,
    TlsConfig, TokenConfig,
};
use serde::Deserialize;

/// Default listen address.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7420";
/// Default data directory.
pub const DEFAULT_DATA_DIR: &str = "./fencelock-data";

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Text on a terminal, JSON otherwise.
    Auto,
    /// Human-readable text.
    Text,
    /// One JSON object per line.
    Json,
}

/// Durability as written in flags and config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DurabilityArg {
    /// fdatasync every batch before replying (default).
    Fsync,
    /// UNSAFE, benchmarks only: never sync; a crash can lose grants and repeat fences.
    None,
}

/// Flags of `fencelock serve`; each can also come from the environment.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// TOML config file (flags and environment override it).
    #[arg(long, env = "FENCELOCK_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address for HTTP/JSON and gRPC [default: 127.0.0.1:7420].
    #[arg(long, env = "FENCELOCK_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Data directory [default: ./fencelock-data].
    #[arg(long, env = "FENCELOCK_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// fsync (default) or none (UNSAFE, benchmarks only).
    #[arg(long, env = "FENCELOCK_DURABILITY", value_enum)]
    pub durability: Option<DurabilityArg>,
    /// Threads of the async runtime (connections and the lock engine) [default: one
    /// per core but one, at least one: the log writer and the snapshot replica run on
    /// threads of their own].
    #[arg(long, env = "FENCELOCK_WORKERS")]
    pub workers: Option<usize>,
    /// Longest the log writer polls for the next batch (µs) before it sleeps, while
    /// small writes follow each other closely: lower latency for up to one core
    /// spent polling; 0 never polls [default: 200].
    #[arg(long, env = "FENCELOCK_WRITER_POLL_US")]
    pub writer_poll_us: Option<u64>,
    /// Log format [default: auto = text on a terminal, JSON otherwise].
    #[arg(long, env = "FENCELOCK_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
    /// Log filter, e.g. `info` or `fencelock_server=debug` [default: info].
    #[arg(long, env = "FENCELOCK_LOG")]
    pub log_level: Option<String>,
    /// Serve a non-loopback address even though no tokens are configured (anyone who
    /// can reach it may do anything).
    #[arg(long, env = "FENCELOCK_INSECURE")]
    pub insecure: bool,
    /// TLS certificate chain, PEM (with --tls-key; overrides tls.cert of the config).
    #[arg(long, env = "FENCELOCK_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// TLS private key, PEM (with --tls-cert; overrides tls.key of the config).
    #[arg(long, env = "FENCELOCK_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// The least fence the next grant may get: at start, a data directory whose next
    /// fence is lower is raised to it (a no-op otherwise). For a restart into an
    /// empty or lost data directory: pass a fence above any issued before, e.g. the
    /// `next fence` of the last backup or `fencelock backup`'s output, or
    /// `now` (microseconds since the Unix epoch, what `fencelock restore` uses).
    #[arg(long, env = "FENCELOCK_FENCE_FLOOR")]
    pub fence_floor: Option<FenceFloor>,
    /// Cluster mode: this member's id (with --peers and --peer-listen).
    #[arg(long, env = "FENCELOCK_NODE_ID")]
    pub node_id: Option<u64>,
    /// Cluster mode: where this member listens for its peers.
    #[arg(long, env = "FENCELOCK_PEER_LISTEN")]
    pub peer_listen: Option<SocketAddr>,
    /// Cluster mode: every initial member's peer address, `1=127.0.0.1:7521,2=…`
    /// (the same list on every member; a fresh cluster forms from it).
    #[arg(long, env = "FENCELOCK_PEERS")]
    pub peers: Option<String>,
    /// Cluster mode: the URL clients should use for this member [default:
    /// http://<listen>].
    #[arg(long, env = "FENCELOCK_ADVERTISE_URL")]
    pub advertise_url: Option<String>,
    /// Cluster mode: a file holding the shared secret that authenticates peer
    /// traffic (at least 16 characters; required unless peers listen on loopback).
    #[arg(long, env = "FENCELOCK_CLUSTER_SECRET_FILE")]
    pub cluster_secret_file: Option<PathBuf>,
    /// Cluster mode: this member's peer TLS certificate, PEM (with --peer-tls-key
    /// and --peer-tls-ca): the peer port speaks mutual TLS. The certificate needs
    /// extendedKeyUsage serverAuth and clientAuth and a subjectAltName IP entry for
    /// the IP of this member's peer address as --peers lists it.
    #[arg(long, env = "FENCELOCK_PEER_TLS_CERT")]
    pub peer_tls_cert: Option<PathBuf>,
    /// Cluster mode: the private key of --peer-tls-cert, PEM.
    #[arg(long, env = "FENCELOCK_PEER_TLS_KEY")]
    pub peer_tls_key: Option<PathBuf>,
    /// Cluster mode: the CA certificate that signs every member's peer certificate,
    /// PEM: peers are verified against it both ways (a peer without a certificate
    /// from it is refused), which authenticates peer traffic.
    #[arg(long, env = "FENCELOCK_PEER_TLS_CA")]
    pub peer_tls_ca: Option<PathBuf>,
    /// Cluster mode: the Raft heartbeat in ms; elections time out after 5–10
    /// heartbeats, and leases must be at least 3 of the longest election timeouts
    /// (1,200 ms at the default) [default: 40].
    #[arg(long, env = "FENCELOCK_RAFT_HEARTBEAT_MS")]
    pub raft_heartbeat_ms: Option<u64>,
    /// Cluster mode: dial some members elsewhere than their peer address,
    /// `2=127.0.0.1:9001,…` (fault-injection proxies, address translation).
    #[arg(long, env = "FENCELOCK_PEER_DIAL")]
    pub peer_dial: Option<String>,
    /// Cluster mode: start empty and wait to be added to a running cluster with
    /// `fencelock cluster add` (instead of forming one; --peers not needed).
    #[arg(long, env = "FENCELOCK_JOIN")]
    pub join: bool,
    /// Cluster mode: do not probe a silent leader's peer port. By default a
    /// follower whose leader has been silent for two heartbeats tries a TCP
    /// connection to it, and if it is refused (the leader's process is gone)
    /// campaigns as soon as the other members would vote, not a random election
    /// timeout later. Turn it off on networks that refuse connections during a
    /// partition.
    #[arg(long, env = "FENCELOCK_NO_LEADER_PROBE")]
    pub no_leader_probe: bool,
}

/// `[cluster]` of the config file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileCluster {
    node_id: Option<u64>,
    peer_listen: Option<SocketAddr>,
    peers: Option<String>,
    advertise_url: Option<String>,
    secret_file: Option<PathBuf>,
    peer_tls_cert: Option<PathBuf>,
    peer_tls_key: Option<PathBuf>,
    peer_tls_ca: Option<PathBuf>,
    heartbeat_ms: Option<u64>,
    join: Option<bool>,
    leader_probe: Option<bool>,
}

/// Parses `1=127.0.0.1:7521,2=127.0.0.1:7522`.
fn parse_peers(s: &str) -> Result<std::collections::BTreeMap<u64, SocketAddr>> {
    let mut peers = std::collections::BTreeMap::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((id, addr)) = part.split_once('=') else {
            bail!("--peers: `{part}` is not ID=HOST:PORT");
        };
        let id: u64 = id
            .trim()
            .parse()
            .map_err(|_| anyhow::anyhow!("--peers: `{id}` is not a member id"))?;
        let addr: SocketAddr = addr.trim().parse().map_err(|_| {
            anyhow::anyhow!("--peers: `{addr}` is not an address like 127.0.0.1:7521")
        })?;
        if peers.insert(id, addr).is_some() {
            bail!("--peers lists member {id} twice");
        }
    }
    if peers.is_empty() {
        bail!("--peers is empty");
    }
    Ok(peers)
}

/// The cluster settings, if any cluster flag or `[cluster]` key is given.
fn cluster_config(
    args: &ServeArgs,
    file: &FileCluster,
) -> Result<Option<fencelock_server::cluster::ClusterConfig>> {
    let node_id = args.node_id.or(file.node_id);
    let peer_listen = args.peer_listen.or(file.peer_listen);
    let join = args.join || file.join.unwrap_or(false);
    let peers = args.peers.clone().or(file.peers.clone());
    if node_id.is_none() && peer_listen.is_none() && peers.is_none() && !join {
        return Ok(None);
    }
    let peers = match (node_id, peer_listen, peers) {
        (Some(_), Some(_), Some(peers)) => parse_peers(&peers)?,
        (Some(_), Some(_), None) if join => Default::default(),
        _ => bail!(
            "cluster mode needs --node-id, --peer-listen and --peers together (--join instead of --peers to join a running cluster)"
        ),
    };
    let (Some(node_id), Some(peer_listen)) = (node_id, peer_listen) else {
        unreachable!("checked above");
    };
    let secret = match args
        .cluster_secret_file
        .clone()
        .or(file.secret_file.clone())
    {
        Some(path) => Some(
            std::fs::read_to_string(&path)
                .map_err(|e| {
                    anyhow::anyhow!("cannot read the cluster secret {}: {e}", path.display())
                })?
                .trim()
                .to_owned(),
        ),
        None => None,
    };
    let tls = match (
        args.peer_tls_cert.clone().or(file.peer_tls_cert.clone()),
        args.peer_tls_key.clone().or(file.peer_tls_key.clone()),
        args.peer_tls_ca.clone().or(file.peer_tls_ca.clone()),
    ) {
        (Some(cert_path), Some(key_path), Some(ca_path)) => {
            let tls = fencelock_server::PeerTlsConfig {
                cert_path,
                key_path,
                ca_path,
            };
            // Read the files now, so a bad path is a configuration error (exit 2).
            tls.acceptor().map_err(anyhow::Error::msg)?;
            tls.connector().map_err(anyhow::Error::msg)?;
            Some(tls)
        }
        (None, None, None) => None,
        _ => bail!(
            "peer TLS needs --peer-tls-cert, --peer-tls-key and --peer-tls-ca together (every member both serves and dials its peers, so it needs its certificate and the CA that verifies theirs)"
        ),
    };
    let heartbeat = std::time::Duration::from_millis(
        args.raft_heartbeat_ms.or(file.heartbeat_ms).unwrap_or(40),
    );
    let dial = match &args.peer_dial {
        Some(s) => parse_peers(s).map_err(|e| anyhow::anyhow!("--peer-dial: {e}"))?,
        None => Default::default(),
    };
    let config = fencelock_server::cluster::ClusterConfig {
        dial,
        node_id,
        peer_listen,
        peers,
        join,
        advertise_url: args
            .advertise_url
            .clone()
            .or(file.advertise_url.clone())
            .unwrap_or_default(),
        secret,
        tls,
        heartbeat,
        leader_probe: !args.no_leader_probe && file.leader_probe.unwrap_or(true),
    };
    config.validate().map_err(anyhow::Error::msg)?;
    Ok(Some(config))
}

/// A fence floor: a number, or `now` (microseconds since the Unix epoch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceFloor {
    /// This fence.
    At(u64),
    /// The wall clock in microseconds since the Unix epoch, read at start.
    Now,
}

impl std::str::FromStr for FenceFloor {
    type Err = String;

    fn from_str(s: &str) -> Result<FenceFloor, String> {
        if s == "now" {
            return Ok(FenceFloor::Now);
        }
        s.parse::<u64>()
            .map(FenceFloor::At)
            .map_err(|_| format!("{s:?} is not a fence (a whole number) or `now`"))
    }
}

impl<'de> Deserialize<'de> for FenceFloor {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<FenceFloor, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Number(n) => Ok(FenceFloor::At(n)),
            Raw::Text(t) => t.parse().map_err(serde::de::Error::custom),
        }
    }
}

impl FenceFloor {
    /// The floor as a fence: `now` reads the wall clock. Refuses a floor the core
    /// would refuse (above [`fencelock_core::MAX_FENCE_FLOOR`]).
    pub fn resolve(self) -> Result<u64> {
        let floor = match self {
            FenceFloor::At(n) => n,
            FenceFloor::Now => wall_clock_fence()?,
        };
        if floor > fencelock_core::MAX_FENCE_FLOOR {
            bail!(
                "fence_floor must be at most {} (2^63), not {floor}",
                fencelock_core::MAX_FENCE_FLOOR
            );
        }
        Ok(floor)
    }
}

/// Microseconds since the Unix epoch: the fence floor of `fencelock restore` and
/// of `--fence-floor now` (see ARCHITECTURE.md, "Fences after a restore").
pub fn wall_clock_fence() -> Result<u64> {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .context("the system clock is before 1970")?;
    Ok(since.as_micros() as u64)
}

/// The config file. Unknown keys are errors, so a typo is never silently ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<SocketAddr>,
    data_dir: Option<PathBuf>,
    durability: Option<DurabilityArg>,
    workers: Option<usize>,
    writer_poll_us: Option<u64>,
    log_format: Option<LogFormat>,
    log_level: Option<String>,
    insecure: Option<bool>,
    #[serde(default)]
    limits: FileLimits,
    #[serde(default)]
    auth: FileAuth,
    tls: Option<FileTls>,
    #[serde(default)]
    storage: Storage,
    #[serde(default)]
    audit: FileAudit,
    fence_floor: Option<FenceFloor>,
    #[serde(default)]
    cluster: FileCluster,
}

/// `[audit]`: retention of the audit log.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileAudit {
    /// Drop entries older than this; 0 keeps them until `max_bytes` pushes them out.
    max_age_hours: Option<u64>,
    /// Keep at most this many bytes of entries (the oldest go first).
    max_bytes: Option<u64>,
}

/// The smallest accepted `[audit] max_bytes`.
pub const MIN_AUDIT_BYTES: u64 = 64 << 10;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileLimits {
    min_ttl_ms: Option<u64>,
    max_ttl_ms: Option<u64>,
    max_wait_ms: Option<u64>,
    max_lock_delay_ms: Option<u64>,
    max_limit: Option<u32>,
    max_locks: Option<usize>,
    max_waiters_per_lock: Option<usize>,
    max_waiters: Option<usize>,
    max_sessions: Option<usize>,
    max_locks_per_session: Option<usize>,
    // Limits at the edge of the server (`fencelock_server::Limits`).
    max_body_bytes: Option<usize>,
    max_connections: Option<usize>,
    max_streams_per_connection: Option<u32>,
    /// Per token; 0 turns rate limiting off.
    acquire_per_second: Option<u32>,
    acquire_burst: Option<u32>,
    /// Per token, for every other mutating request; 0 turns it off.
    request_per_second: Option<u32>,
    request_burst: Option<u32>,
    max_unauthenticated_connections: Option<usize>,
    auth_timeout_ms: Option<u64>,
    max_connections_per_ip: Option<usize>,
    idle_timeout_ms: Option<u64>,
    // Per-token quotas, the defaults for every token (`[[auth.tokens]]` may override).
    max_sessions_per_token: Option<u32>,
    max_held_locks_per_token: Option<u32>,
    max_waiters_per_token: Option<u32>,
    max_streams_per_token: Option<u32>,
}

/// `[auth]`: the accepted tokens. None: authentication off (loopback only).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileAuth {
    #[serde(default)]
    tokens: Vec<FileToken>,
}

/// One `[[auth.tokens]]` entry (what `fencelock token new` prints).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileToken {
    name: String,
    role: String,
    prefixes: Vec<String>,
    sha256: String,
    acquire_per_second: Option<u32>,
    acquire_burst: Option<u32>,
    request_per_second: Option<u32>,
    request_burst: Option<u32>,
    max_sessions: Option<u32>,
    max_held_locks: Option<u32>,
    max_waiters: Option<u32>,
    max_streams: Option<u32>,
}

/// `[tls]`: certificate and key, PEM.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileTls {
    cert: PathBuf,
    key: PathBuf,
    handshake_timeout_ms: Option<u64>,
}

/// A rate from `per_second` and `burst` (burst defaults to twice the rate); a rate
/// of 0 means no limit.
fn rate(per_second: u32, burst: Option<u32>) -> Option<RateLimit> {
    (per_second > 0).then(|| RateLimit {
        per_second,
        burst: burst.unwrap_or(per_second.saturating_mul(2)),
    })
}

fn auth_config(file: FileAuth) -> Result<AuthConfig> {
    let mut tokens = Vec::with_capacity(file.tokens.len());
    for t in file.tokens {
        let role: Role = t
            .role
            .parse()
            .map_err(|e| anyhow::anyhow!("auth token {:?}: {e}", t.name))?;
        let token_rate = |per_second: Option<u32>, burst: Option<u32>, what: &str| match per_second
        {
            Some(per_second) => Ok(rate(per_second, burst)),
            None if burst.is_some() => Err(anyhow::anyhow!(
                "auth token {:?}: {what}_burst needs {what}_per_second",
                t.name
            )),
            None => Ok(None),
        };
        let acquire_rate = token_rate(t.acquire_per_second, t.acquire_burst, "acquire")?;
        let request_rate = token_rate(t.request_per_second, t.request_burst, "request")?;
        tokens.push(TokenConfig {
            name: t.name,
            role,
            prefixes: t.prefixes,
            sha256: t.sha256,
            acquire_rate,
            request_rate,
            quotas: QuotaOverrides {
                max_sessions: t.max_sessions,
                max_held_locks: t.max_held_locks,
                max_waiters: t.max_waiters,
                max_streams: t.max_streams,
            },
        });
    }
    Ok(AuthConfig { tokens })
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Storage {
    segment_bytes: Option<u64>,
    snapshot_after_bytes: Option<u64>,
    /// Recent lock events kept for watches to resume from.
    watch_history: Option<usize>,
}

/// The most `storage.watch_history` may be: each event kept costs a few hundred
/// bytes of memory.
const MAX_WATCH_HISTORY: usize = 10_000_000;

/// Everything `serve` needs, resolved.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The server's configuration.
    pub server: ServerConfig,
    /// Log format.
    pub log_format: LogFormat,
    /// Log filter.
    pub log_level: String,
    /// Threads of the async runtime.
    pub workers: usize,
}

/// The most runtime threads accepted.
pub const MAX_WORKERS: usize = 1024;

/// The longest writer poll accepted (µs): past a few hundred µs a poll only burns CPU
/// (the wake-up it saves costs tens of µs).
pub const MAX_WRITER_POLL_US: u64 = 10_000;

/// The default number of runtime threads: one per core but one (the log writer, which
/// also wakes the clients of each group commit, and the snapshot replica have threads
/// of their own), at least one. On the 2-core benchmark machine one worker instead of
/// two cut the W1 latency by 13 % for 3–6 % less W2 throughput at 64 clients
/// (docs/benchmarks-history.md).
pub fn default_workers(cores: usize) -> usize {
    cores.saturating_sub(1).max(1)
}

fn load_file(path: &Path) -> Result<FileConfig> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read config file {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("invalid config file {}", path.display()))
}

/// Merges flags/environment over the config file over the defaults, and checks the
/// result.
pub fn resolve(args: ServeArgs) -> Result<Settings> {
    let file = match &args.config {
        Some(path) => load_file(path)?,
        None => FileConfig::default(),
    };
    let listen = match args.listen.or(file.listen) {
        Some(a) => a,
        None => DEFAULT_LISTEN.parse().expect("valid default"),
    };
    let data_dir = args
        .data_dir
        .clone()
        .or(file.data_dir.clone())
        .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR));
    let durability = match args.durability.or(file.durability) {
        Some(DurabilityArg::None) => Durability::None,
        _ => Durability::Fsync,
    };
    let mut engine = EngineConfig::new(data_dir);
    engine.durability = durability;
    if let Some(us) = args.writer_poll_us.or(file.writer_poll_us) {
        if us > MAX_WRITER_POLL_US {
            bail!("writer_poll_us must be at most {MAX_WRITER_POLL_US} (µs), not {us}");
        }
        engine.writer_poll = std::time::Duration::from_micros(us);
    }
    let l = file.limits;
    let c = &mut engine.core;
    macro_rules! set {
        ($($field:ident),*) => { $( if let Some(v) = l.$field { c.$field = v; } )* };
    }
    set!(
        min_ttl_ms,
        max_ttl_ms,
        max_wait_ms,
        max_lock_delay_ms,
        max_limit,
        max_locks,
        max_waiters_per_lock,
        max_waiters,
        max_sessions,
        max_locks_per_session
    );
    if c.min_ttl_ms == 0 || c.min_ttl_ms > c.max_ttl_ms {
        bail!("limits: need 0 < min_ttl_ms <= max_ttl_ms");
    }
    if c.max_limit == 0 || c.max_locks == 0 {
        bail!("limits: max_limit and max_locks must be at least 1");
    }
    if let Some(floor) = args.fence_floor.or(file.fence_floor) {
        engine.fence_floor = floor.resolve()?;
    }
    engine.cluster = cluster_config(&args, &file.cluster)?;
    if let Some(v) = file.storage.segment_bytes {
        if v < 1 << 20 {
            bail!("storage.segment_bytes must be at least 1 MiB");
        }
        engine.segment_bytes = v;
    }
    if let Some(v) = file.storage.watch_history {
        if v == 0 || v > MAX_WATCH_HISTORY {
            bail!("storage.watch_history must be between 1 and {MAX_WATCH_HISTORY}, not {v}");
        }
        engine.watch_history = v;
    }
    if let Some(v) = file.storage.snapshot_after_bytes {
        engine.snapshot_after_bytes = v.max(1);
    }
    if let Some(hours) = file.audit.max_age_hours {
        engine.audit.max_age_ms = match hours {
            0 => None,
            h => Some(
                h.checked_mul(3_600_000)
                    .context("audit.max_age_hours is too large")?,
            ),
        };
    }
    if let Some(v) = file.audit.max_bytes {
        if v < MIN_AUDIT_BYTES {
            bail!("audit.max_bytes must be at least {MIN_AUDIT_BYTES} (64 KiB)");
        }
        engine.audit.max_bytes = v;
    }
    let mut limits = Limits::default();
    if let Some(v) = l.max_body_bytes {
        limits.max_body_bytes = v;
    }
    if let Some(v) = l.max_connections {
        limits.max_connections = v;
    }
    if let Some(v) = l.max_streams_per_connection {
        limits.max_streams_per_connection = v;
    }
    match (l.acquire_per_second, l.acquire_burst) {
        (Some(per_second), burst) => limits.acquire_rate = rate(per_second, burst),
        (None, Some(burst)) => {
            if let Some(r) = &mut limits.acquire_rate {
                r.burst = burst;
            }
        }
        (None, None) => {}
    }
    match (l.request_per_second, l.request_burst) {
        (Some(per_second), burst) => limits.request_rate = rate(per_second, burst),
        (None, Some(burst)) => {
            if let Some(r) = &mut limits.request_rate {
                r.burst = burst;
            }
        }
        (None, None) => {}
    }
    if let Some(v) = l.max_unauthenticated_connections {
        limits.max_unauthenticated_connections = v;
    }
    if let Some(ms) = l.auth_timeout_ms {
        limits.auth_timeout = std::time::Duration::from_millis(ms);
    }
    if let Some(v) = l.max_connections_per_ip {
        limits.max_connections_per_ip = v;
    }
    if let Some(ms) = l.idle_timeout_ms {
        limits.idle_timeout = std::time::Duration::from_millis(ms);
    }
    limits.quotas = QuotaOverrides {
        max_sessions: l.max_sessions_per_token,
        max_held_locks: l.max_held_locks_per_token,
        max_waiters: l.max_waiters_per_token,
        max_streams: l.max_streams_per_token,
    }
    .over(limits.quotas);
    let file_tls = file.tls;
    if let Some(ms) = file_tls.as_ref().and_then(|t| t.handshake_timeout_ms) {
        limits.tls_handshake_timeout = std::time::Duration::from_millis(ms);
    }
    limits.check().map_err(anyhow::Error::msg)?;
    let tls = match (args.tls_cert, args.tls_key, file_tls) {
        (Some(cert_path), Some(key_path), _) => Some(TlsConfig {
            cert_path,
            key_path,
        }),
        (_, _, Some(t)) => Some(TlsConfig {
            cert_path: t.cert,
            key_path: t.key,
        }),
        _ => None,
    };
    if let Some(tls) = &tls {
        // Read the files now, so a bad path is a configuration error (exit 2).
        tls.acceptor().map_err(anyhow::Error::msg)?;
    }
    let auth = auth_config(file.auth)?;
    fencelock_server::auth::Authenticator::with_limits(&auth, &limits)
        .map_err(anyhow::Error::msg)?;
    let workers = match args.workers.or(file.workers) {
        Some(n) if (1..=MAX_WORKERS).contains(&n) => n,
        Some(n) => bail!("workers must be between 1 and {MAX_WORKERS}, not {n}"),
        None => default_workers(std::thread::available_parallelism().map_or(1, |n| n.get())),
    };
    let insecure = args.insecure || file.insecure.unwrap_or(false);
    fencelock_server::auth::check_exposure(listen, &auth, insecure).map_err(anyhow::Error::msg)?;
    let mut server = ServerConfig::new(listen, engine);
    server.auth = auth;
    server.insecure = insecure;
    server.tls = tls;
    server.limits = limits;
    Ok(Settings {
        server,
        log_format: args
            .log_format
            .or(file.log_format)
            .unwrap_or(LogFormat::Auto),
        log_level: args
            .log_level
            .or(file.log_level)
            .unwrap_or_else(|| "info".to_owned()),
        workers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> ServeArgs {
        ServeArgs {
            config: None,
            listen: None,
            data_dir: None,
            durability: None,
            workers: None,
            writer_poll_us: None,
            log_format: None,
            log_level: None,
            insecure: false,
            tls_cert: None,
            tls_key: None,
            fence_floor: None,
            node_id: None,
            peer_listen: None,
            peers: None,
            advertise_url: None,
            cluster_secret_file: None,
            peer_tls_cert: None,
            peer_tls_key: None,
            peer_tls_ca: None,
            raft_heartbeat_ms: None,
            peer_dial: None,
            join: false,
            no_leader_probe: false,
        }
    }

    #[test]
    fn cluster_flags_go_together_and_peers_parse() {
        assert!(resolve(args()).unwrap().server.engine.cluster.is_none());
        let mut a = args();
        a.node_id = Some(2);
        let e = resolve(a).unwrap_err().to_string();
        assert!(
            e.contains("--node-id, --peer-listen and --peers together"),
            "{e}"
        );
        let mut a = args();
        a.node_id = Some(2);
        a.peer_listen = Some("127.0.0.1:7522".parse().unwrap());
        a.peers = Some("1=127.0.0.1:7521, 2=127.0.0.1:7522,3=127.0.0.1:7523".into());
        let c = resolve(a).unwrap().server.engine.cluster.unwrap();
        assert_eq!(c.node_id, 2);
        assert_eq!(c.peers.len(), 3);
        for (peers, why) in [
            ("1=127.0.0.1:7521,1=127.0.0.1:7522", "twice"),
            ("1:127.0.0.1:7521", "ID=HOST:PORT"),
            ("x=127.0.0.1:7521", "not a member id"),
            ("2=localhost", "not an address"),
            ("1=127.0.0.1:7521", "must list this member (2)"),
        ] {
            let mut a = args();
            a.node_id = Some(2);
            a.peer_listen = Some("127.0.0.1:7522".parse().unwrap());
            a.peers = Some(peers.into());
            let e = resolve(a).unwrap_err().to_string();
            assert!(e.contains(why), "{peers}: {e}");
        }
    }

    #[test]
    fn the_leader_probe_is_on_unless_the_flag_or_the_file_turns_it_off() {
        let member = |config: Option<PathBuf>, off: bool| {
            let mut a = args();
            a.node_id = Some(1);
            a.peer_listen = Some("127.0.0.1:7521".parse().unwrap());
            a.peers = Some("1=127.0.0.1:7521,2=127.0.0.1:7522".into());
            a.config = config;
            a.no_leader_probe = off;
            resolve(a)
                .unwrap()
                .server
                .engine
                .cluster
                .unwrap()
                .leader_probe
        };
        assert!(member(None, false));
        assert!(!member(None, true));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fencelock.toml");
        std::fs::write(&path, "[cluster]\nleader_probe = false\n").unwrap();
        assert!(!member(Some(path.clone()), false));
        std::fs::write(&path, "[cluster]\nleader_probe = true\n").unwrap();
        assert!(!member(Some(path), true), "the flag wins");
    }

    #[test]
    fn defaults_without_anything() {
        let s = resolve(args()).unwrap();
        assert_eq!(s.server.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(s.server.engine.data_dir, PathBuf::from(DEFAULT_DATA_DIR));
        assert_eq!(s.server.engine.durability, Durability::Fsync);
        assert_eq!(s.log_format, LogFormat::Auto);
        let cores = std::thread::available_parallelism().unwrap().get();
        assert_eq!(s.workers, default_workers(cores));
    }

    #[test]
    fn fence_floor_is_a_number_or_now_from_file_env_or_flag() {
        assert_eq!(resolve(args()).unwrap().server.engine.fence_floor, 0);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fencelock.toml");
        std::fs::write(&path, "fence_floor = 1000\n").unwrap();
        let mut a = args();
        a.config = Some(path.clone());
        assert_eq!(resolve(a).unwrap().server.engine.fence_floor, 1000);
        let mut a = args();
        a.config = Some(path.clone());
        a.fence_floor = Some("5".parse().unwrap());
        assert_eq!(
            resolve(a).unwrap().server.engine.fence_floor,
            5,
            "the flag wins"
        );
        std::fs::write(&path, "fence_floor = \"now\"\n").unwrap();
        let before = wall_clock_fence().unwrap();
        let mut a = args();
        a.config = Some(path.clone());
        assert!(resolve(a).unwrap().server.engine.fence_floor >= before);
        for bad in ["fence_floor = \"soon\"", "fence_floor = -1"] {
            std::fs::write(&path, bad).unwrap();
            let mut a = args();
            a.config = Some(path.clone());
            assert!(resolve(a).is_err(), "{bad} accepted");
        }
        let mut a = args();
        a.fence_floor = Some(FenceFloor::At(fencelock_core::MAX_FENCE_FLOOR + 1));
        let e = resolve(a).unwrap_err().to_string();
        assert!(e.contains("fence_floor must be at most"), "{e}");
        assert!("x".parse::<FenceFloor>().is_err());
    }

    #[test]
    fn writer_poll_defaults_to_the_engine_s_and_is_bounded() {
        use std::time::Duration;
        assert_eq!(
            resolve(args()).unwrap().server.engine.writer_poll,
            fencelock_server::DEFAULT_WRITER_POLL
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fencelock.toml");
        std::fs::write(&path, "writer_poll_us = 0\n").unwrap();
        let mut a = args();
        a.config = Some(path.clone());
        assert_eq!(
            resolve(a).unwrap().server.engine.writer_poll,
            Duration::ZERO,
            "0 turns polling off"
        );
        let mut a = args();
        a.config = Some(path);
        a.writer_poll_us = Some(80);
        assert_eq!(
            resolve(a).unwrap().server.engine.writer_poll,
            Duration::from_micros(80),
            "the flag wins"
        );
        let mut a = args();
        a.writer_poll_us = Some(MAX_WRITER_POLL_US + 1);
        let e = resolve(a).unwrap_err().to_string();
        assert!(e.contains("writer_poll_us must be at most"), "{e}");
    }

    #[test]
    fn workers_default_to_one_per_core_but_one() {
        assert_eq!(
            [1, 2, 3, 8].map(default_workers),
            [1, 1, 2, 7],
            "one per core but one, at least one"
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fencelock.toml");
        std::fs::write(&path, "workers = 3\n").unwrap();
        let mut a = args();
        a.config = Some(path.clone());
        assert_eq!(resolve(a).unwrap().workers, 3);
        let mut a = args();
        a.config = Some(path);
        a.workers = Some(5);
        assert_eq!(resolve(a).unwrap().workers, 5, "the flag wins");
        for bad in [0, MAX_WORKERS + 1] {
            let mut a = args();
            a.workers = Some(bad);
            let e = resolve(a).unwrap_err().to_string();
            assert!(e.contains("workers must be between 1"), "{bad}: {e}");
        }
    }

    #[test]
    fn flags_win_over_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fencelock.toml");
        std::fs::write(
            &path,
            "listen = \"127.0.0.1:9000\"\ndata_dir = \"/tmp/x\"\ndurability = \"none\"\n[limits]\nmax_locks = 7\n",
        )
        .unwrap();
        let mut a = args();
        a.config = Some(path.clone());
        let s = resolve(a).unwrap();
        assert_eq!(s.server.listen.to_string(), "127.0.0.1:9000");
        assert_eq!(s.server.engine.durability, Durability::None);
        assert_eq!(s.server.engine.core.max_locks, 7);
        let mut a = args();
        a.config = Some(path);
        a.listen = Some("127.0.0.1:9001".parse().unwrap());
        a.durability = Some(DurabilityArg::Fsync);
        let s = resolve(a).unwrap();
        assert_eq!(s.server.listen.to_string(), "127.0.0.1:9001");
        assert_eq!(s.server.engine.durability, Durability::Fsync);
        assert_eq!(s.server.engine.data_dir, PathBuf::from("/tmp/x"));
    }

    #[test]
    fn quotas_and_admission_limits_come_from_the_file_and_tokens_override_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fencelock.toml");
        let hash = fencelock_server::auth::hash_token("t");
        std::fs::write(
            &path,
            format!(
                "[limits]\nmax_sessions_per_token = 7\nmax_streams_per_token = 3\n\
                 request_per_second = 10\nmax_unauthenticated_connections = 9\n\
                 auth_timeout_ms = 1500\nmax_connections_per_ip = 11\nidle_timeout_ms = 2500\n\
                 [[auth.tokens]]\nname = \"a\"\nrole = \"client\"\nprefixes = [\"a:\"]\n\
                 sha256 = \"{hash}\"\nmax_sessions = 2\nrequest_per_second = 4\n"
            ),
        )
        .unwrap();
        let mut a = args();
        a.config = Some(path.clone());
        let s = resolve(a).unwrap();
        let l = s.server.limits;
        assert_eq!(l.quotas.max_sessions, 7);
        assert_eq!(l.quotas.max_streams, 3);
        assert_eq!(
            l.quotas.max_held_locks,
            fencelock_server::limits::DEFAULT_QUOTAS.max_held_locks
        );
        assert_eq!(
            l.request_rate,
            Some(RateLimit {
                per_second: 10,
                burst: 20
            })
        );
        assert_eq!(l.max_unauthenticated_connections, 9);
        assert_eq!(l.auth_timeout, std::time::Duration::from_millis(1500));
        assert_eq!(l.max_connections_per_ip, 11);
        assert_eq!(l.idle_timeout, std::time::Duration::from_millis(2500));
        let t = &s.server.auth.tokens[0];
        assert_eq!(t.quotas.max_sessions, Some(2));
        assert_eq!(
            t.request_rate,
            Some(RateLimit {
                per_second: 4,
                burst: 8
            })
        );
        let auth = fencelock_server::auth::Authenticator::with_limits(&s.server.auth, &l).unwrap();
        let quotas = auth.authenticate("t").unwrap().quotas().unwrap();
        assert_eq!(
            (quotas.max_sessions, quotas.max_streams),
            (2, 3),
            "token over default"
        );

        std::fs::write(&path, "[limits]\nmax_waiters_per_token = 0\n").unwrap();
        let mut a = args();
        a.config = Some(path);
        let e = resolve(a).unwrap_err().to_string();
        assert!(e.contains("must") && e.contains("at least 1"), "{e}");
    }

    #[test]
    fn watch_history_defaults_to_the_engine_s_and_is_read_from_the_file() {
        assert_eq!(
            resolve(args()).unwrap().server.engine.watch_history,
            fencelock_server::engine::DEFAULT_WATCH_HISTORY
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "[storage]\nwatch_history = 100\n").unwrap();
        let mut a = args();
        a.config = Some(path);
        assert_eq!(resolve(a).unwrap().server.engine.watch_history, 100);
    }

    #[test]
    fn typos_and_bad_values_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        for bad in [
            "lisen = \"127.0.0.1:1\"",
            "listen = 5",
            "durability = \"sometimes\"",
            "workers = 0",
            "workers = -1",
            "writer_poll_us = -1",
            "writer_poll_us = 10001",
            "[limits]\nmin_ttl_ms = 0",
            "[storage]\nsegment_bytes = 10",
            "[storage]\nwatch_history = 0",
            "[storage]\nwatch_history = 10000001",
            "[audit]\nmax_bytes = 10",
            "[audit]\nmax_age = 3",
            "[audit]\nmax_age_hours = 99999999999999999",
            "[limits]\nmax_connections = 0",
            "[limits]\nmax_body_bytes = 10",
            "[limits]\nacquire_burst = 0",
            "[auth]\ntokens = [{ name = \"a\", role = \"boss\", prefixes = [\"\"], sha256 = \"00\" }]",
            "[[auth.tokens]]\nname = \"a\"\nrole = \"client\"\nprefixes = []\nsha256 = \"00\"",
            "[[auth.tokens]]\nname = \"a\"\nrole = \"client\"\nprefixes = [\"\"]\nsha256 = \"xyz\"",
            "[[auth.tokens]]\nname = \"a\"\nrole = \"client\"\nprefix = [\"\"]\nsha256 = \"00\"",
            "[tls]\ncert = \"/nonexistent/cert.pem\"\nkey = \"/nonexistent/key.pem\"",
            "listen = \"0.0.0.0:7420\"",
            "not toml at all [",
        ] {
            let path = dir.path().join("c.toml");
            std::fs::write(&path, bad).unwrap();
            let mut a = args();
            a.config = Some(path);
            assert!(resolve(a).is_err(), "accepted {bad:?}");
        }
    }

    #[test]
    fn auth_tls_and_limits_from_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        let hash = fencelock_server::auth::hash_token("t");
        std::fs::write(
            &path,
            format!(
                "listen = \"0.0.0.0:7420\"\n\
                 [limits]\nmax_body_bytes = 4096\nmax_connections = 5\n\
                 max_streams_per_connection = 7\nacquire_per_second = 3\n\
                 [[auth.tokens]]\nname = \"w\"\nrole = \"reader\"\nprefixes = [\"a:\"]\n\
                 sha256 = \"{hash}\"\nacquire_per_second = 9\n"
            ),
        )
        .unwrap();
        let mut a = args();
        a.config = Some(path);
        let s = resolve(a).unwrap();
        let l = s.server.limits;
        assert_eq!(
            (
                l.max_body_bytes,
                l.max_connections,
                l.max_streams_per_connection
            ),
            (4096, 5, 7)
        );
        assert_eq!(
            l.acquire_rate,
            Some(RateLimit {
                per_second: 3,
                burst: 6
            })
        );
        let t = &s.server.auth.tokens[0];
        assert_eq!((t.name.as_str(), t.role), ("w", Role::Reader));
        assert_eq!(t.acquire_rate.unwrap().per_second, 9);
        assert!(!s.server.insecure);
    }

    #[test]
    fn peer_tls_from_the_file_and_flags_all_three_or_none() {
        let dir = tempfile::tempdir().unwrap();
        let ca = fencelock_testkit::TestCa::create(dir.path()).unwrap();
        let (cert, key) = ca.peer("m1", [127, 0, 0, 1].into()).unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(
            &path,
            format!(
                "[cluster]\nnode_id = 1\npeer_listen = \"127.0.0.1:7521\"\n\
                 peers = \"1=127.0.0.1:7521\"\npeer_tls_cert = {cert:?}\n\
                 peer_tls_key = {key:?}\npeer_tls_ca = {:?}\n",
                ca.ca_cert
            ),
        )
        .unwrap();
        let mut a = args();
        a.config = Some(path.clone());
        let tls = resolve(a).unwrap().server.engine.cluster.unwrap().tls;
        assert_eq!(
            tls,
            Some(fencelock_server::PeerTlsConfig {
                cert_path: cert.clone(),
                key_path: key.clone(),
                ca_path: ca.ca_cert.clone(),
            })
        );
        // A flag overrides its key; a file that cannot be read is a configuration
        // error, not a failure at the first peer connection.
        let mut a = args();
        a.config = Some(path);
        a.peer_tls_ca = Some(dir.path().join("missing.pem"));
        let e = resolve(a).unwrap_err().to_string();
        assert!(e.contains("missing.pem"), "{e}");
        let mut a = args();
        a.node_id = Some(1);
        a.peer_listen = Some("127.0.0.1:7521".parse().unwrap());
        a.peers = Some("1=127.0.0.1:7521".into());
        a.peer_tls_cert = Some(cert);
        a.peer_tls_key = Some(key);
        let e = resolve(a).unwrap_err().to_string();
        assert!(e.contains("--peer-tls-ca together"), "{e}");
    }

    #[test]
    fn non_loopback_without_auth_needs_insecure() {
        let mut a = args();
        a.listen = Some("0.0.0.0:7420".parse().unwrap());
        let e = resolve(a).unwrap_err().to_string();
        assert!(e.contains("--insecure"), "{e}");
        let mut a = args();
        a.listen = Some("0.0.0.0:7420".parse().unwrap());
        a.insecure = true;
        assert!(resolve(a).unwrap().server.insecure);
    }

    #[test]
    fn audit_retention_from_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "[audit]\nmax_age_hours = 48\nmax_bytes = 1048576\n").unwrap();
        let mut a = args();
        a.config = Some(path.clone());
        let audit = resolve(a).unwrap().server.engine.audit;
        assert_eq!(audit.max_age_ms, Some(48 * 3_600_000));
        assert_eq!(audit.max_bytes, 1 << 20);
        std::fs::write(&path, "[audit]\nmax_age_hours = 0\n").unwrap();
        let mut a = args();
        a.config = Some(path);
        assert_eq!(resolve(a).unwrap().server.engine.audit.max_age_ms, None);
        assert_eq!(
            resolve(args()).unwrap().server.engine.audit,
            fencelock_server::audit::AuditConfig::default()
        );
    }

    /// `deploy/fencelock.toml` is what operators copy: it must load with the real
    /// loader and mean what its comments say.
    #[test]
    fn the_example_config_in_deploy_loads() {
        let path = PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../deploy/fencelock.toml"
        ));
        let mut a = args();
        a.config = Some(path);
        let s = resolve(a).expect("deploy/fencelock.toml loads");
        assert_eq!(s.server.listen.to_string(), "0.0.0.0:7420");
        assert_eq!(
            s.server.engine.data_dir,
            PathBuf::from("/var/lib/fencelock")
        );
        assert_eq!(s.server.engine.durability, Durability::Fsync);
        assert!(!s.server.insecure);
        assert!(s.server.tls.is_none());
        let roles: Vec<Role> = s.server.auth.tokens.iter().map(|t| t.role).collect();
        assert_eq!(roles, vec![Role::Admin, Role::Client, Role::Reader]);
        assert_eq!(s.server.engine.audit.max_age_ms, Some(90 * 24 * 3_600_000));
        assert_eq!(s.server.engine.audit.max_bytes, 256 << 20);
        assert_eq!(s.log_format, LogFormat::Json);
    }
}
