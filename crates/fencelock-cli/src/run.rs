//! `fencelock run NAME -- COMMAND…`: runs a command while holding a lock.
//!
//! The command runs in its own process group with `FENCELOCK_LOCK` and
//! `FENCELOCK_FENCE` in its environment. When `run` is in the foreground of a
//! terminal, that group is made the terminal's foreground group for as long as the
//! command runs (as a shell does for a job), so an interactive command can read the
//! terminal and gets Ctrl-C itself; `run` takes the terminal back when it ends. If the
//! command is stopped (Ctrl-Z), `run` stops too and, when continued, continues it.
//!
//! The lock is renewed while the command runs; SIGINT, SIGTERM, SIGHUP, SIGQUIT,
//! SIGUSR1 and SIGUSR2 sent to `run` are forwarded to the group. If the lock is lost
//! (the server refused a renewal, or none was confirmed before the lease's safe
//! deadline), the group gets SIGTERM (and SIGCONT, should it be stopped), then SIGKILL
//! after `--grace`, and `run` exits with [`exit::LOCK_LOST`]. When the command ends by
//! itself the lock is released and `run` exits with the command's code (128 + N if
//! killed by signal N).

use std::os::unix::process::CommandExt;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use fencelock::{Client, LockOptions, LostReason};
use serde_json::json;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;

use crate::exit;
use crate::remote::{default_owner, human, not_acquired, parse_duration, Connection, Failure};

/// `fencelock run`.
#[derive(Args, Debug)]
#[command(override_usage = "fencelock run [OPTIONS] <NAME> -- <COMMAND>...")]
pub struct RunArgs {
    /// The lock to hold while the command runs.
    #[arg(value_name = "NAME", required_unless_present = "lock")]
    pub name: Option<String>,
    /// The lock's name (deprecated: give it as the first argument).
    #[arg(long, hide = true, value_name = "NAME", conflicts_with = "name")]
    pub lock: Option<String>,
    /// Lease length; renewed every third of it while the command runs.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub ttl: Duration,
    /// How long to wait for the lock (0: fail at once if it is held).
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
    /// Server, token, CA certificate; `--json`: `run`'s own messages (the grant,
    /// failures, a lost lock) as JSON lines on stderr (stdout is the command's).
    #[command(flatten)]
    pub connection: Connection,
    /// The command and its arguments (after `--`).
    #[arg(last = true, required = true, num_args = 1..)]
    pub command: Vec<String>,
}

/// Runs the command under the lock; returns the exit code described in the module docs.
pub async fn run(args: RunArgs) -> ExitCode {
    let json = args.connection.json;
    match run_command(args).await {
        Ok(code) => ExitCode::from(code),
        Err(f) => {
            say("run", &f, json);
            ExitCode::from(f.code)
        }
    }
}

pub(crate) fn failure(code: u8, message: impl std::fmt::Display) -> Failure {
    Failure {
        message: message.to_string(),
        code,
    }
}

/// Prints a subcommand's own message: `fencelock WHO: …`, or JSON (see
/// [`Failure::print`]).
pub(crate) fn say(who: &str, f: &Failure, json: bool) {
    if json {
        f.print(true);
    } else {
        eprintln!("fencelock {who}: {}", f.message);
    }
}

async fn run_command(args: RunArgs) -> Result<u8, Failure> {
    let Some(name) = args.name.clone().or_else(|| args.lock.clone()) else {
        return Err(failure(exit::USAGE, "the lock name is missing"));
    };
    if args.lock.is_some() && !args.connection.json {
        eprintln!("fencelock run: --lock is deprecated; write `fencelock run {name} -- COMMAND`");
    }
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
    let backend = args.connection.connect().await?;
    let client = Client::new(backend.clone());
    let options = LockOptions::default()
        .ttl(args.ttl)
        .wait(args.wait)
        .owner(owner)
        .limit(args.limit);
    let spinner = crate::remote::Spinner::start(&name, !args.wait.is_zero());
    let acquired = client.lock(name.clone()).options(options).acquire().await;
    spinner.stop();
    let guard = match acquired {
        Ok(g) => g,
        Err(e) if not_acquired(e.kind()) => {
            let f = crate::remote::not_acquired_failure(&backend, &name, args.wait, &e).await;
            return Err(failure(f.code, f.message));
        }
        Err(e) => return Err(e.into()),
    };
    if args.connection.json {
        eprintln!(
            "{}",
            json!({"acquired": {
                "name": name,
                "fence": guard.fence(),
                "ttl_ms": args.ttl.as_millis() as u64,
            }})
        );
    }

    let env = [
        ("FENCELOCK_LOCK", name.clone()),
        ("FENCELOCK_FENCE", guard.fence().to_string()),
    ];
    let child = Supervise {
        who: "run",
        name: &name,
        command: &args.command,
        env: &env,
        grace: args.grace,
        json: args.connection.json,
    };
    match child.run(guard.lost()).await {
        Ok(Ended::Exited(code)) => {
            if let Err(e) = guard.release().await {
                eprintln!("fencelock run: the command finished, but releasing {name:?} failed (it will expire): {e}");
            }
            Ok(code)
        }
        Ok(Ended::Lost) => {
            // Best effort: the grant may still exist if only renewals failed.
            let _ = tokio::time::timeout(Duration::from_secs(2), guard.release()).await;
            Ok(exit::LOCK_LOST)
        }
        Err(f) => {
            let _ = tokio::time::timeout(Duration::from_secs(2), guard.release()).await;
            Err(f)
        }
    }
}

/// How a supervised command ended.
#[derive(Debug)]
pub(crate) enum Ended {
    /// By itself, with this exit code (128 + N if killed by signal N).
    Exited(u8),
    /// The lock (or leadership) was lost, so it was stopped.
    Lost,
}

/// A command run while something is held (`run`'s lock, `elect`'s leadership): in
/// its own process group, in the terminal's foreground, with signals forwarded, and
/// stopped (SIGTERM, SIGKILL after `grace`) when what is held is lost.
pub(crate) struct Supervise<'a> {
    /// The subcommand, for messages (`fencelock run: …`).
    pub who: &'static str,
    /// The lock or election held, for messages.
    pub name: &'a str,
    /// The command and its arguments.
    pub command: &'a [String],
    /// Added to the command's environment.
    pub env: &'a [(&'static str, String)],
    /// After a loss: how long the command has after SIGTERM before SIGKILL.
    pub grace: Duration,
    /// Messages as JSON lines.
    pub json: bool,
}

impl Supervise<'_> {
    /// Runs the command until it ends or `lost` resolves. The caller releases what
    /// it holds afterwards, also after an error (the command could not be started).
    pub(crate) async fn run(
        &self,
        lost: impl std::future::Future<Output = LostReason>,
    ) -> Result<Ended, Failure> {
        let who = self.who;
        let Some((program, arguments)) = self.command.split_first() else {
            return Err(failure(exit::USAGE, "the command is missing"));
        };
        // Signal handlers before the child exists, so no signal is missed.
        let handler = |kind: SignalKind| {
            signal(kind).map_err(|e| {
                failure(
                    exit::FAILURE,
                    format!("cannot install signal handlers: {e}"),
                )
            })
        };
        let mut int = handler(SignalKind::interrupt())?;
        let mut term = handler(SignalKind::terminate())?;
        let mut hup = handler(SignalKind::hangup())?;
        let mut quit = handler(SignalKind::quit())?;
        let mut usr1 = handler(SignalKind::user_defined1())?;
        let mut usr2 = handler(SignalKind::user_defined2())?;

        let terminal = Terminal::foreground();
        let mut command = std::process::Command::new(program);
        command
            .args(arguments)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .process_group(0);
        if terminal.is_some() {
            // SAFETY: the closure runs in the child between fork and exec and only makes
            // async-signal-safe calls (getpid, sigprocmask, tcsetpgrp).
            unsafe {
                command.pre_exec(|| {
                    // The child takes the terminal itself, before it can read it: the
                    // parent's own tcsetpgrp may come after the exec.
                    set_foreground(libc::STDIN_FILENO, libc::getpid());
                    Ok(())
                });
            }
        }
        let child = match command.spawn() {
            Ok(c) => c,
            Err(e) => {
                let code = match e.kind() {
                    std::io::ErrorKind::NotFound => exit::COMMAND_NOT_FOUND,
                    _ => exit::CANNOT_EXECUTE,
                };
                return Err(failure(code, format!("cannot run {program:?}: {e}")));
            }
        };
        let pgid = child.id() as libc::pid_t;
        if let Some(t) = &terminal {
            t.give(pgid);
        }
        // Given back on every way out, even an early return.
        let _terminal_back = TerminalBack(terminal.as_ref(), pgid);
        let mut states = watch_child(pgid);
        tokio::pin!(lost);

        loop {
            tokio::select! {
                state = states.recv() => match state {
                    // Job control (Ctrl-Z, a read or write from the background) stops
                    // the supervisor with its command; a SIGSTOP someone sent is theirs
                    // to undo.
                    Some(ChildState::Stopped(signal))
                        if matches!(signal, libc::SIGTSTP | libc::SIGTTIN | libc::SIGTTOU) =>
                    {
                        if let Some(t) = &terminal {
                            t.suspend_with(pgid, signal);
                        }
                    }
                    Some(ChildState::Stopped(_)) => {}
                    Some(ChildState::Exited(code)) => return Ok(Ended::Exited(code)),
                    None => return Err(failure(exit::FAILURE, "lost track of the command")),
                },
                _ = int.recv() => signal_group(pgid, libc::SIGINT),
                _ = term.recv() => signal_group(pgid, libc::SIGTERM),
                _ = hup.recv() => signal_group(pgid, libc::SIGHUP),
                _ = quit.recv() => signal_group(pgid, libc::SIGQUIT),
                _ = usr1.recv() => signal_group(pgid, libc::SIGUSR1),
                _ = usr2.recv() => signal_group(pgid, libc::SIGUSR2),
                reason = &mut lost => {
                    let error = reason.into_error(self.name);
                    let message = format!(
                        "{}; stopping the command (SIGTERM, SIGKILL after {})",
                        crate::explain::client_error(&error),
                        human(self.grace)
                    );
                    say(who, &failure(exit::LOCK_LOST, message), self.json);
                    signal_group(pgid, libc::SIGTERM);
                    // A stopped command would not act on SIGTERM until continued.
                    signal_group(pgid, libc::SIGCONT);
                    let ended = tokio::time::timeout(self.grace, exited(&mut states)).await;
                    if ended.is_err() {
                        signal_group(pgid, libc::SIGKILL);
                        exited(&mut states).await;
                    }
                    return Ok(Ended::Lost);
                }
            }
        }
    }
}

/// Until the command has exited (stops along the way are passed over).
async fn exited(states: &mut mpsc::UnboundedReceiver<ChildState>) {
    while let Some(state) = states.recv().await {
        if let ChildState::Exited(_) = state {
            return;
        }
    }
}

/// What became of the command.
#[derive(Debug)]
enum ChildState {
    /// Stopped by this signal (Ctrl-Z, SIGTTIN, SIGSTOP).
    Stopped(libc::c_int),
    /// Ended, with `run`'s exit code for it.
    Exited(u8),
}

/// Reports the child's stops and its end. A thread of its own waits for it (with
/// `WUNTRACED`, which the async runtime's child handling does not offer), so this
/// process alone reaps it.
fn watch_child(pid: libc::pid_t) -> mpsc::UnboundedReceiver<ChildState> {
    let (tx, rx) = mpsc::unbounded_channel();
    std::thread::spawn(move || loop {
        let mut status: libc::c_int = 0;
        // SAFETY: waitpid(2) on our own child, writing only `status`.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WUNTRACED) };
        if r < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            let _ = tx.send(ChildState::Exited(exit::FAILURE));
            return;
        }
        let state = if libc::WIFSTOPPED(status) {
            ChildState::Stopped(libc::WSTOPSIG(status))
        } else if libc::WIFEXITED(status) {
            ChildState::Exited(libc::WEXITSTATUS(status) as u8)
        } else if libc::WIFSIGNALED(status) {
            ChildState::Exited(128u8.saturating_add(libc::WTERMSIG(status) as u8))
        } else {
            continue;
        };
        let done = matches!(state, ChildState::Exited(_));
        if tx.send(state).is_err() || done {
            return;
        }
    });
    rx
}

/// The terminal `run` was started in the foreground of (its standard input).
struct Terminal {
    own_group: libc::pid_t,
}

impl Terminal {
    /// The terminal on standard input, if `run`'s process group is its foreground
    /// group (not when run in the background, from a pipe or by a service manager).
    fn foreground() -> Option<Terminal> {
        // SAFETY: isatty, tcgetpgrp and getpgrp only read.
        unsafe {
            if libc::isatty(libc::STDIN_FILENO) != 1 {
                return None;
            }
            let own_group = libc::getpgrp();
            (libc::tcgetpgrp(libc::STDIN_FILENO) == own_group).then_some(Terminal { own_group })
        }
    }

    /// Makes `group` the terminal's foreground group.
    fn give(&self, group: libc::pid_t) {
        set_foreground(libc::STDIN_FILENO, group);
    }

    /// Whether `group` is the terminal's foreground group.
    fn is_foreground(&self, group: libc::pid_t) -> bool {
        // SAFETY: tcgetpgrp only reads.
        unsafe { libc::tcgetpgrp(libc::STDIN_FILENO) == group }
    }

    /// Gives the terminal back to `run`'s group if the command's group has it (not
    /// if the shell took it back meanwhile: `run` was put in the background).
    fn take_back(&self, group: libc::pid_t) {
        if self.is_foreground(group) {
            self.give(self.own_group);
        }
    }

    /// The command was stopped by job control (Ctrl-Z): take the terminal back, stop
    /// `run` by the same signal (the shell sees the job stopped), and once continued
    /// give the command the terminal if `run` is in the foreground again (`fg`), and
    /// continue it (after `bg` too).
    fn suspend_with(&self, group: libc::pid_t, signal: libc::c_int) {
        self.take_back(group);
        // SAFETY: raise(3) sends a signal to this process; no memory is touched.
        unsafe {
            libc::raise(signal);
        }
        if self.is_foreground(self.own_group) {
            self.give(group);
        }
        signal_group(group, libc::SIGCONT);
    }
}

/// Gives the terminal back to `run`'s group when dropped (see [`Terminal::take_back`]).
struct TerminalBack<'a>(Option<&'a Terminal>, libc::pid_t);

impl Drop for TerminalBack<'_> {
    fn drop(&mut self) {
        if let Some(t) = self.0 {
            t.take_back(self.1);
        }
    }
}

/// tcsetpgrp(3) with SIGTTOU blocked: a process outside the foreground group that
/// changes it would otherwise be stopped by SIGTTOU. Async-signal-safe.
fn set_foreground(fd: libc::c_int, group: libc::pid_t) -> bool {
    // SAFETY: the sets are initialised by sigemptyset before use; sigprocmask and
    // tcsetpgrp touch only them and the terminal.
    unsafe {
        let mut block: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut block);
        libc::sigaddset(&mut block, libc::SIGTTOU);
        libc::sigprocmask(libc::SIG_BLOCK, &block, &mut old);
        let done = libc::tcsetpgrp(fd, group) == 0;
        libc::sigprocmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        done
    }
}

fn signal_group(pgid: libc::pid_t, signal: libc::c_int) {
    // SAFETY: kill(2) with a negative pid signals the process group; no memory is
    // touched. A group that is already gone gives ESRCH, which is fine.
    unsafe {
        libc::kill(-pgid, signal);
    }
}
