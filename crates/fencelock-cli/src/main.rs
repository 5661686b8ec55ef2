//! The `fencelock` command.
//!
//! Exit codes (see `exit.rs`): 0 success; 1 runtime failure (storage failed while
//! serving, corrupt backup); 2 usage error (bad flags or config file); `serve` that
//! cannot start: 65 corrupt data directory, 71 cannot listen, 73 data directory in
//! use by another server, 74 data directory unreadable or unwritable; 69 server
//! unreachable (`cluster …`: or no leader answered within `--wait`); 75 lock lost while `run`'s command ran; 77 not authenticated or not
//! allowed; 124 lock not acquired within
//! `--wait`; 126/127 `run`'s command could not be executed / was not found; otherwise
//! `run` exits with its command's code.

mod audit_cmd;
mod cluster_cmd;
mod config;
mod exit;
mod http_get;
mod remote;
mod run;
mod sessions_cmd;
mod token;

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use fencelock_server::{RunState, Server};

use config::{LogFormat, ServeArgs};

/// A distributed lock server with fencing tokens.
#[derive(Parser)]
#[command(name = "fencelock", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Commands,
}

#[derive(Subcommand)]
enum Commands {
    /// Run the lock server (HTTP/JSON and gRPC on one port) with embedded storage.
    Serve(Box<ServeArgs>),
    /// Save a consistent snapshot of a running server to a file.
    Backup {
        /// Server base URL (for a cluster: the members' URLs, separated by commas).
        #[arg(
            long,
            env = "FENCELOCK_SERVER",
            default_value = "http://127.0.0.1:7420"
        )]
        server: String,
        /// Where to write the backup.
        #[arg(long, short)]
        out: PathBuf,
        /// Admin token with the prefix "" (not needed when the server has no tokens).
        #[arg(long, env = "FENCELOCK_TOKEN", hide_env_values = true)]
        token: Option<String>,
        /// For an https:// server with a private CA: the CA certificate (PEM).
        #[arg(long, env = "FENCELOCK_CA_CERT")]
        ca_cert: Option<PathBuf>,
    },
    /// Run a command while holding a lock (renewed while it runs; the command is
    /// stopped if the lock is lost).
    ///
    /// The command gets FENCELOCK_LOCK and FENCELOCK_FENCE in its environment. Exit
    /// codes: the command's own (128+N if killed by signal N); 124 the lock was not
    /// acquired within --wait; 69 the server is unreachable; 75 the lock was lost and
    /// the command was stopped (SIGTERM, then SIGKILL after --grace); 77 the token is
    /// missing or not allowed; 126/127 the command could not be executed / was not
    /// found.
    Run(run::RunArgs),
    /// Take a lock once (no renewal) and print the grant with its owner token.
    Acquire(remote::AcquireArgs),
    /// Extend a lease taken with `acquire`.
    Renew(remote::RenewArgs),
    /// Give a lock back.
    Release(remote::ReleaseArgs),
    /// List locks (held, waited for, or in lock-delay).
    Ls(remote::LsArgs),
    /// Show one lock: holders, fences, waiters.
    Show(remote::ShowArgs),
    /// Print lock events as they happen.
    Watch(remote::WatchArgs),
    /// Operator action: take a lock from its holder(s), with a reason.
    ForceRelease(remote::ForceReleaseArgs),
    /// Create a data directory from a backup. The first fence issued after a restore
    /// is larger than any fence issued before it (see ARCHITECTURE.md, "Fences after
    /// a restore", for the assumption this rests on).
    Restore {
        /// The backup file.
        #[arg(long)]
        from: PathBuf,
        /// The data directory to create (must be empty or absent).
        #[arg(long, env = "FENCELOCK_DATA_DIR", default_value = "./fencelock-data")]
        data_dir: PathBuf,
        /// The least fence the next grant may get, as `serve --fence-floor` (a
        /// number or `now`); the restored next fence is the largest of this, the
        /// backup's and the wall clock in microseconds.
        #[arg(long, env = "FENCELOCK_FENCE_FLOOR")]
        fence_floor: Option<config::FenceFloor>,
    },
    /// Make access tokens for the auth.tokens of the server's config.
    Token(token::TokenArgs),
    /// Show a running server's audit log: grants, hand-offs, releases, expiries,
    /// forced releases (with actor and reason), session ends, refused renews.
    Audit(audit_cmd::AuditArgs),
    /// Admin: list open sessions (by handle, with their principal, locks and lease
    /// left) and close one by its handle.
    Sessions {
        /// `ls` or `close HANDLE`.
        #[command(subcommand)]
        cmd: sessions_cmd::SessionsCmd,
    },
    /// Admin: a cluster's members, term and leader (`status`), and membership
    /// changes (`add`, `remove`, `transfer-leader`); retried while the cluster has no
    /// leader, for up to `--wait` (then exit 69).
    Cluster {
        /// `status`, `add`, `remove ID` or `transfer-leader ID`.
        #[command(subcommand)]
        cmd: cluster_cmd::ClusterCmd,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Commands::Serve(args) => serve(*args),
        Commands::Backup {
            server,
            out,
            token,
            ca_cert,
        } => backup(&server, &out, token.as_deref(), ca_cert.as_deref()),
        Commands::Restore {
            from,
            data_dir,
            fence_floor,
        } => restore(&from, &data_dir, fence_floor),
        Commands::Run(args) => return client_runtime(run::run(args)),
        Commands::Acquire(args) => return client_command(remote::acquire(args)),
        Commands::Renew(args) => return client_command(remote::renew(args)),
        Commands::Release(args) => return client_command(remote::release(args)),
        Commands::Ls(args) => return client_command(remote::ls(args)),
        Commands::Show(args) => return client_command(remote::show(args)),
        Commands::Watch(args) => return client_command(remote::watch(args)),
        Commands::ForceRelease(args) => return client_command(remote::force_release(args)),
        Commands::Token(args) => token::run(args),
        Commands::Audit(args) => audit_cmd::run(args),
        Commands::Sessions { cmd } => sessions_cmd::run(cmd),
        Commands::Cluster { cmd } => return cluster_cmd::run(cmd),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("fencelock: error: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// Runs a client command on a small runtime.
fn client_runtime(command: impl std::future::Future<Output = ExitCode>) -> ExitCode {
    match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime.block_on(command),
        Err(e) => {
            eprintln!("fencelock: cannot start the async runtime: {e}");
            ExitCode::from(exit::FAILURE)
        }
    }
}

fn client_command(
    command: impl std::future::Future<Output = Result<(), remote::Failure>>,
) -> ExitCode {
    client_runtime(async move { remote::finish(command.await) })
}

fn init_logging(format: LogFormat, level: &str) -> Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_new(level)
        .with_context(|| format!("invalid log level {level:?}"))?;
    let json = match format {
        LogFormat::Json => true,
        LogFormat::Text => false,
        LogFormat::Auto => !std::io::stderr().is_terminal(),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder.json().flatten_event(true).init();
    } else {
        builder.init();
    }
    Ok(())
}

fn serve(args: ServeArgs) -> Result<ExitCode> {
    let settings = match config::resolve(args) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("fencelock: configuration error: {e:#}");
            return Ok(ExitCode::from(2));
        }
    };
    init_logging(settings.log_format, &settings.log_level)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(settings.workers)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async move {
        if settings.server.engine.durability == fencelock_server::Durability::None {
            tracing::warn!("durability=none: acknowledged grants can be lost and fences can repeat after a crash; for benchmarks only");
        }
        // Installed before the server says it is serving, so that a SIGTERM right
        // after that line always takes the graceful path (the default action would
        // kill the process).
        let signals = ShutdownSignals::install()?;
        let server = match Server::start(settings.server.clone()).await {
            Ok(server) => server,
            Err(e) => {
                // The message names the file (and the offset of corrupt log data).
                let code = exit::for_start(&e);
                eprintln!("fencelock: cannot start the server: {e}");
                return Ok(ExitCode::from(code));
            }
        };
        let r = server.handle().recovery();
        tracing::info!(
            listen = %server.local_addr(),
            data_dir = %settings.server.engine.data_dir.display(),
            snapshot_loaded = r.snapshot_loaded,
            records_replayed = r.records_replayed,
            truncated_tail_bytes = r.truncated_tail_bytes,
            locks_held = r.locks_held,
            next_fence = r.next_fence,
            recovery_ms = r.duration.as_millis() as u64,
            "fencelock serving HTTP/JSON and gRPC"
        );
        let config = &settings.server;
        match (config.auth.enabled(), config.insecure && !config.listen.ip().is_loopback()) {
            (true, _) => tracing::info!(
                tokens = config.auth.tokens.len(),
                tls = config.tls.is_some(),
                "authentication on: every request but /healthz and /readyz needs a token"
            ),
            (false, false) => tracing::info!(
                "no tokens configured: authentication is off, so only loopback addresses are served \
                 (add [[auth.tokens]] to serve other hosts; see `fencelock token new`)"
            ),
            (false, true) => tracing::warn!(
                listen = %config.listen,
                "--insecure: authentication is off on a non-loopback address; anyone who can reach it can take, force-release and back up every lock"
            ),
        }
        if r.truncated_tail_bytes > 0 {
            tracing::warn!(
                bytes = r.truncated_tail_bytes,
                "discarded a torn record at the end of the log (a write cut short by a crash; it was never acknowledged)"
            );
        }
        let mut state = server.handle().watch_state();
        let failed = async {
            loop {
                if let RunState::Failed(why) = state.borrow_and_update().clone() {
                    return why;
                }
                if state.changed().await.is_err() {
                    return "engine stopped".to_owned();
                }
            }
        };
        let signal = signals.recv();
        tokio::select! {
            why = failed => {
                tracing::error!(error = %why, "engine failed; exiting");
                return Ok(ExitCode::from(1));
            }
            name = signal => tracing::info!(signal = name, "shutting down: draining waits, finishing requests, flushing"),
        }
        let handle = server.handle().clone();
        server.shutdown().await.context("error while shutting down")?;
        // The data directory may have vanished, or failed, while stopping: then
        // what was acknowledged is not where the next start will look.
        if let RunState::Failed(why) = handle.state() {
            tracing::error!(error = %why, "engine failed while stopping; exiting");
            return Ok(ExitCode::from(1));
        }
        tracing::info!("stopped cleanly");
        Ok(ExitCode::SUCCESS)
    })
}

/// SIGTERM and SIGINT handlers, installed before serving.
struct ShutdownSignals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl ShutdownSignals {
    fn install() -> Result<ShutdownSignals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(ShutdownSignals {
            term: signal(SignalKind::terminate()).context("cannot install a SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("cannot install a SIGINT handler")?,
        })
    }

    /// The name of the first signal that arrives.
    async fn recv(mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

fn backup(
    server: &str,
    out: &Path,
    token: Option<&str>,
    ca_cert: Option<&Path>,
) -> Result<ExitCode> {
    let bytes = http_get::get_as(server, "/v1/admin/snapshot", token, ca_cert)
        .with_context(|| format!("cannot fetch a snapshot from {server}"))?;
    // Refuse to write something that would not restore.
    let image = fencelock_server::codec::decode_snapshot(&bytes)
        .context("the server sent an unreadable snapshot")?;
    fencelock_log::write_snapshot_file(out, &bytes)
        .with_context(|| format!("cannot write {}", out.display()))?;
    let holders: usize = image.locks.iter().map(|l| l.holders.len()).sum();
    println!(
        "backup written to {}: {} locks, {} holders, next fence {}",
        out.display(),
        image.locks.len(),
        holders,
        image.next_fence
    );
    Ok(ExitCode::SUCCESS)
}

fn restore(
    from: &Path,
    data_dir: &Path,
    fence_floor: Option<config::FenceFloor>,
) -> Result<ExitCode> {
    if data_dir.exists()
        && std::fs::read_dir(data_dir)
            .with_context(|| format!("cannot read {}", data_dir.display()))?
            .next()
            .is_some()
    {
        bail!(
            "{} is not empty; restore only into an empty or new directory (move the old one away first)",
            data_dir.display()
        );
    }
    let bytes = fencelock_log::read_snapshot_file(from)
        .with_context(|| format!("cannot read backup {}", from.display()))?;
    let mut image = fencelock_server::codec::decode_snapshot(&bytes)
        .with_context(|| format!("{} is not a fencelock backup", from.display()))?;
    // The same floor `serve --fence-floor now` applies, and at least the one given.
    let floor = config::wall_clock_fence()?.max(match fence_floor {
        Some(floor) => floor.resolve()?,
        None => 0,
    });
    let before = image.next_fence;
    image.next_fence = image.next_fence.max(floor);
    // Check the image the same way the server will before writing anything.
    fencelock_core::Core::import(fencelock_core::Config::default(), image.clone())
        .map_err(|e| anyhow::anyhow!("the backup is inconsistent: {e}"))?;
    let (mut log, _) = fencelock_log::Log::open(data_dir, fencelock_log::LogOptions::default())
        .with_context(|| format!("cannot create the log in {}", data_dir.display()))?;
    log.snapshot(&fencelock_server::codec::encode_snapshot(&image))
        .context("cannot write the restored snapshot")?;
    println!(
        "restored {} into {}: next fence raised from {} to {}",
        from.display(),
        data_dir.display(),
        before,
        image.next_fence
    );
    Ok(ExitCode::SUCCESS)
}
