//! The `fencelock` command.
//!
//! Exit codes: `exit::TABLE` (shown by `fencelock help exit-codes`, the man page and
//! the README); otherwise `run` exits with its command's code.

mod audit_cmd;
mod cluster_cmd;
mod config;
mod elect;
mod exit;
mod explain;
mod http_get;
mod remote;
mod run;
mod sessions_cmd;
mod token;

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{CommandFactory, Parser, Subcommand};
use fencelock_server::{RunState, Server};

use config::{LogFormat, ServeArgs};

/// A distributed lock server with fencing tokens.
#[derive(Parser)]
#[command(
    name = "fencelock",
    version,
    about,
    long_about = None,
    // Our own `help`, which also knows the topic `exit-codes`.
    disable_help_subcommand = true,
    after_help = "`fencelock help exit-codes` lists the exit codes."
)]
struct Cli {
    #[command(subcommand)]
    command: Commands,
}

#[derive(Subcommand)]
enum Commands {
    /// Run the lock server (HTTP/JSON and gRPC on one port) with embedded storage.
    Serve(Box<ServeArgs>),
    /// Save a consistent snapshot of a running server to a file.
    Backup(BackupArgs),
    /// Run a command while holding a lock (renewed while it runs; the command is
    /// stopped if the lock is lost).
    ///
    /// `fencelock run NAME -- COMMAND [ARGS…]`. The command gets FENCELOCK_LOCK and
    /// FENCELOCK_FENCE in its environment; on a terminal it runs in the foreground
    /// (it can read input and gets Ctrl-C). Exit codes: the command's own (128+N if
    /// killed by signal N); 124 the lock was not acquired within --wait; 69 the server
    /// is unreachable; 75 the lock was lost and the command was stopped (SIGTERM,
    /// then SIGKILL after --grace); 77 not authenticated or not allowed; 126/127 the
    /// command could not be executed / was not found.
    Run(run::RunArgs),
    /// Run a command while leading an election (renewed while it runs; the command
    /// is stopped if leadership is lost).
    ///
    /// `fencelock elect NAME VALUE -- COMMAND [ARGS…]`: waits to lead (up to --wait,
    /// by default for ever), then runs the command as `run` does, with
    /// FENCELOCK_ELECTION, FENCELOCK_VALUE and the term in FENCELOCK_TERM and
    /// FENCELOCK_FENCE (pass it as the fence with every write). Resigns when the
    /// command ends. Exit codes as `run`'s: the command's own; 124 not leading within
    /// --wait; 75 leadership was lost and the command was stopped.
    Elect(elect::ElectArgs),
    /// Show who leads an election (owner, value, term; exit 1 if nobody does), or
    /// with --watch every change of leader.
    Leader(elect::LeaderArgs),
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
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell) to
    /// stdout, e.g. `fencelock completions bash > /etc/bash_completion.d/fencelock`.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Print the manual page (roff) to stdout, e.g.
    /// `fencelock man > /usr/local/share/man/man1/fencelock.1`.
    Man {
        /// A subcommand's page instead (`fencelock man run` is fencelock-run(1)).
        command: Option<String>,
    },
    /// Print help: of fencelock, of a command (`help run`, `help cluster add`), or of
    /// a topic (`help exit-codes`).
    Help {
        /// The command or topic.
        #[arg(num_args = 0..)]
        topic: Vec<String>,
    },
}

/// `fencelock backup`.
#[derive(clap::Args)]
struct BackupArgs {
    /// Where to write the backup (refused if it exists, unless --force).
    #[arg(long, short)]
    out: PathBuf,
    /// Replace --out if it exists.
    #[arg(long)]
    force: bool,
    /// Server, admin token (with the prefix ""; not needed when the server has no
    /// tokens), CA certificate, `--json`.
    #[command(flatten)]
    connection: remote::Connection,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Commands::Serve(args) => serve(*args),
        Commands::Backup(args) => {
            let json = args.connection.json;
            return remote::finish(backup(&args), json);
        }
        Commands::Restore {
            from,
            data_dir,
            fence_floor,
        } => restore(&from, &data_dir, fence_floor),
        Commands::Run(args) => return client_runtime(run::run(args)),
        Commands::Elect(args) => return client_runtime(elect::elect(args)),
        Commands::Leader(args) => {
            let json = args.connection.json;
            return client_command(elect::leader(args), json);
        }
        Commands::Acquire(args) => {
            let json = args.connection.json;
            return client_command(remote::acquire(args), json);
        }
        Commands::Renew(args) => {
            let json = args.connection.json;
            return client_command(remote::renew(args), json);
        }
        Commands::Release(args) => {
            let json = args.connection.json;
            return client_command(remote::release(args), json);
        }
        Commands::Ls(args) => {
            let json = args.connection.json;
            return client_command(remote::ls(args), json);
        }
        Commands::Show(args) => {
            let json = args.connection.json;
            return client_command(remote::show(args), json);
        }
        Commands::Watch(args) => {
            let json = args.connection.json;
            return client_command(remote::watch(args), json);
        }
        Commands::ForceRelease(args) => {
            let json = args.connection.json;
            return client_command(remote::force_release(args), json);
        }
        Commands::Token(args) => token::run(args),
        Commands::Audit(args) => return audit_cmd::run(args),
        Commands::Sessions { cmd } => return sessions_cmd::run(cmd),
        Commands::Cluster { cmd } => return cluster_cmd::run(cmd),
        Commands::Completions { shell } => {
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "fencelock",
                &mut std::io::stdout(),
            );
            Ok(ExitCode::SUCCESS)
        }
        Commands::Man { command } => man(command.as_deref()),
        Commands::Help { topic } => help(&topic),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("fencelock: error: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// `fencelock help [COMMAND…|exit-codes]`.
fn help(topic: &[String]) -> Result<ExitCode> {
    if topic == ["exit-codes"] {
        print!("{}", exit::table_text());
        return Ok(ExitCode::SUCCESS);
    }
    // Exactly what `fencelock TOPIC… --help` prints.
    let args = ["fencelock"]
        .into_iter()
        .chain(topic.iter().map(String::as_str))
        .chain(["--help"]);
    match Cli::command().try_get_matches_from(args) {
        Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelp => {
            e.print().context("cannot print the help")?;
            Ok(ExitCode::SUCCESS)
        }
        _ => {
            eprintln!(
                "fencelock: no command or help topic {:?} (topics: exit-codes; commands: \
                 see `fencelock --help`)",
                topic.join(" ")
            );
            Ok(ExitCode::from(exit::USAGE))
        }
    }
}

/// `fencelock man [COMMAND]`: the page clap_mangen renders from the definitions,
/// with an EXIT STATUS section.
fn man(command: Option<&str>) -> Result<ExitCode> {
    use clap_mangen::roff::{bold, roman, Roff};
    let mut cmd = Cli::command();
    cmd.build();
    let page = match command {
        None => cmd,
        Some(name) => match cmd.find_subcommand(name) {
            Some(sub) => sub
                .clone()
                .display_name(format!("fencelock-{name}"))
                .bin_name(format!("fencelock {name}")),
            None => {
                eprintln!("fencelock: no command {name:?} (see `fencelock --help`)");
                return Ok(ExitCode::from(exit::USAGE));
            }
        },
    };
    let man = clap_mangen::Man::new(page.clone());
    let mut out = Vec::new();
    man.render_title(&mut out)?;
    man.render_name_section(&mut out)?;
    man.render_synopsis_section(&mut out)?;
    man.render_description_section(&mut out)?;
    if page.get_arguments().any(|a| !a.is_hide_set()) {
        man.render_options_section(&mut out)?;
    }
    if page.has_subcommands() {
        man.render_subcommands_section(&mut out)?;
    }
    let mut status = Roff::new();
    status.control("SH", ["EXIT STATUS"]);
    for (code, name, meaning) in exit::TABLE {
        status.control("TP", []);
        status.text([bold(code.to_string()), roman(format!(" ({name})"))]);
        status.text([roman(*meaning)]);
    }
    status.control("PP", []);
    status.text([roman(
        "With --json, a failure is also printed to stderr as one JSON line: \
         {\"error\":{\"code\":NAME,\"message\":...,\"exit_code\":N}}.",
    )]);
    status.control("SH", ["SEE ALSO"]);
    status.text([roman(
        "fencelock help exit-codes; fencelock man COMMAND for a command's page; \
         the README and docs/ of the fencelock source.",
    )]);
    status.to_writer(&mut out)?;
    if page.get_version().is_some() {
        man.render_version_section(&mut out)?;
    }
    use std::io::Write;
    std::io::stdout()
        .write_all(&out)
        .context("cannot write the manual page")?;
    Ok(ExitCode::SUCCESS)
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
    json: bool,
) -> ExitCode {
    client_runtime(async move { remote::finish(command.await, json) })
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

fn backup(args: &BackupArgs) -> Result<(), remote::Failure> {
    let c = &args.connection;
    let out = &args.out;
    let usage = |code: u8, message: String| remote::Failure { message, code };
    if !args.force && out.exists() {
        return Err(usage(
            exit::CANNOT_CREATE,
            format!("{} exists; add --force to replace it", out.display()),
        ));
    }
    let bytes = http_get::get_as(
        &c.server,
        "/v1/admin/snapshot",
        c.token.as_deref(),
        c.ca_cert.as_deref(),
    )
    .map_err(explain::http_failure)?;
    // Refuse to write something that would not restore.
    let image = fencelock_server::codec::decode_snapshot(&bytes).map_err(|e| {
        usage(
            exit::FAILURE,
            format!("the server sent an unreadable snapshot: {e}"),
        )
    })?;
    if !args.force {
        // Claimed atomically, so a file that appeared during the download is not
        // replaced either; the write below replaces only this empty claim.
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(out)
            .map_err(|e| {
                let code = match e.kind() {
                    std::io::ErrorKind::AlreadyExists => exit::CANNOT_CREATE,
                    _ => exit::FAILURE,
                };
                usage(code, format!("cannot create {}: {e}", out.display()))
            })?;
    }
    if let Err(e) = fencelock_log::write_snapshot_file(out, &bytes) {
        if !args.force {
            let _ = std::fs::remove_file(out);
        }
        return Err(usage(
            exit::FAILURE,
            format!("cannot write {}: {e}", out.display()),
        ));
    }
    let holders: usize = image.locks.iter().map(|l| l.holders.len()).sum();
    if c.json {
        // The file's size, framing included.
        let size = std::fs::metadata(out).map_or(0, |m| m.len());
        println!(
            "{}",
            serde_json::json!({
                "path": out,
                "bytes": size,
                "locks": image.locks.len(),
                "holders": holders,
                "next_fence": image.next_fence,
            })
        );
    } else {
        println!(
            "backup written to {}: {} locks, {} holders, next fence {}",
            out.display(),
            image.locks.len(),
            holders,
            image.next_fence
        );
    }
    Ok(())
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
