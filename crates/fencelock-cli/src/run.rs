//! `fencelock run`: runs a command while holding a lock.
//!
//! The command runs in its own process group with `FENCELOCK_LOCK` and
//! `FENCELOCK_FENCE` in its environment. The lock is renewed while it runs; SIGINT,
//! SIGTERM and SIGHUP sent to `fencelock run` are forwarded to the group. If the lock
//! is lost (the server refused a renewal, or none was confirmed before the lease's
//! safe deadline), the group gets SIGTERM, then SIGKILL after `--grace`, and `run`
//! exits with [`exit::LOCK_LOST`]. When the command ends by itself the lock is released
//! and `run` exits with the command's code (128 + N if killed by signal N).

use std::os::unix::process::ExitStatusExt;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use fencelock::{Client, LockOptions};
use tokio::signal::unix::{signal, SignalKind};

use crate::exit;
use crate::remote::{default_owner, not_acquired, parse_duration, Connection, Spinner};

/// `fencelock run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// The lock to hold while the command runs.
    #[arg(long)]
    pub lock: String,
    /// Lease length; renewed every third of it while the command runs.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub ttl: Duration,
    /// How long to wait for the lock.
    #[arg(long, default_value = "1m", value_parser = parse_duration)]
    pub wait: Duration,
    /// Who holds the lock (default: user@host, pid and the command).
    #[arg(long)]
    pub owner: Option<String>,
    /// Holders the lock admits (a semaphore).
    #[arg(long, default_value_t = 1)]
    pub limit: u32,
    /// After a lost lock: how long the command has to exit after SIGTERM before SIGKILL.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub grace: Duration,
    #[command(flatten)]
    pub connection: Connection,
    /// The command and its arguments (after `--`).
    #[arg(last = true, required = true, num_args = 1..)]
    pub command: Vec<String>,
}

fn fail(code: u8, message: impl std::fmt::Display) -> ExitCode {
    eprintln!("fencelock run: {message}");
    ExitCode::from(code)
}

/// Runs the command under the lock; returns the exit code described in the module docs.
pub async fn run(args: RunArgs) -> ExitCode {
    let owner = args.owner.clone().unwrap_or_else(|| {
        let mut text = format!("{}: {}", default_owner(), args.command.join(" "));
        if text.len() > 512 {
            let mut end = 509;
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            text.truncate(end);
            text.push_str("...");
        }
        text
    });
    let backend = match args.connection.connect().await {
        Ok(b) => b,
        Err(f) => return fail(f.code, f.message),
    };
    let client = Client::new(backend);
    let options = LockOptions::default()
        .ttl(args.ttl)
        .wait(args.wait)
        .owner(owner)
        .limit(args.limit);
    let spinner = Spinner::start(&args.lock, !args.wait.is_zero());
    let acquired = client
        .lock(args.lock.clone())
        .options(options)
        .acquire()
        .await;
    spinner.stop();
    let guard = match acquired {
        Ok(g) => g,
        Err(e) if not_acquired(e.kind()) => {
            return fail(
                exit::NOT_ACQUIRED,
                format!("{:?} not acquired within {:?}: {e}", args.lock, args.wait),
            )
        }
        Err(e) => return fail(exit::for_error(e.kind()), e),
    };

    // Signal handlers before the child exists, so no signal is missed.
    let (mut int, mut term, mut hup) = match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
    ) {
        (Ok(i), Ok(t), Ok(h)) => (i, t, h),
        _ => return fail(exit::FAILURE, "cannot install signal handlers"),
    };

    let mut child = match tokio::process::Command::new(&args.command[0])
        .args(&args.command[1..])
        .env("FENCELOCK_LOCK", &args.lock)
        .env("FENCELOCK_FENCE", guard.fence().to_string())
        .process_group(0)
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            let _ = guard.release().await;
            let code = match e.kind() {
                std::io::ErrorKind::NotFound => exit::COMMAND_NOT_FOUND,
                _ => exit::CANNOT_EXECUTE,
            };
            return fail(code, format!("cannot run {:?}: {e}", args.command[0]));
        }
    };
    let Some(pgid) = child.id().map(|id| id as libc::pid_t) else {
        return fail(
            exit::FAILURE,
            "the command exited before it could be watched",
        );
    };
    let lost = guard.lost();
    tokio::pin!(lost);

    loop {
        tokio::select! {
            status = child.wait() => {
                let code = match status {
                    Ok(s) => status_code(s),
                    Err(e) => return fail(exit::FAILURE, format!("cannot wait for the command: {e}")),
                };
                if let Err(e) = guard.release().await {
                    eprintln!("fencelock run: the command finished, but releasing {:?} failed (it will expire): {e}", args.lock);
                }
                return ExitCode::from(code);
            }
            _ = int.recv() => signal_group(pgid, libc::SIGINT),
            _ = term.recv() => signal_group(pgid, libc::SIGTERM),
            _ = hup.recv() => signal_group(pgid, libc::SIGHUP),
            reason = &mut lost => {
                let error = reason.into_error(&args.lock);
                eprintln!("fencelock run: {error}; stopping the command (SIGTERM, SIGKILL after {:?})", args.grace);
                signal_group(pgid, libc::SIGTERM);
                if tokio::time::timeout(args.grace, child.wait()).await.is_err() {
                    signal_group(pgid, libc::SIGKILL);
                    let _ = child.wait().await;
                }
                // Best effort: the grant may still exist if only renewals failed.
                let _ = tokio::time::timeout(Duration::from_secs(2), guard.release()).await;
                return ExitCode::from(exit::LOCK_LOST);
            }
        }
    }
}

fn signal_group(pgid: libc::pid_t, signal: libc::c_int) {
    // SAFETY: kill(2) with a negative pid signals the process group; no memory is
    // touched. A group that is already gone gives ESRCH, which is fine.
    unsafe {
        libc::kill(-pgid, signal);
    }
}

fn status_code(status: std::process::ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code as u8,
        (None, Some(signal)) => 128u8.saturating_add(signal as u8),
        (None, None) => exit::FAILURE,
    }
}
