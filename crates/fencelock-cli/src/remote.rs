//! The client subcommands: `acquire`, `renew`, `release`, `ls`, `show`, `watch`,
//! `force-release`. They speak gRPC through the `fencelock` client library. Output is
//! for people by default and one JSON document (or one JSON line per event) with
//! `--json`.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use fencelock::{AcquireSpec, ErrorKind, FencelockBackend, Lease, LockBackend, ServerConfig};
use fencelock::{EventKind, LockEvent, LockInfo, LockMode, WaitEnd, WatchPosition};
use serde_json::{json, Value};

use crate::exit;

/// How to reach the server (shared by every client subcommand).
#[derive(Args, Debug, Clone)]
pub struct Connection {
    /// Server URL; for a cluster, the members' URLs separated by commas (requests
    /// follow the leader).
    #[arg(
        long,
        env = "FENCELOCK_SERVER",
        default_value = "http://127.0.0.1:7420"
    )]
    pub server: String,
    /// Bearer token, if the server requires one.
    #[arg(long, env = "FENCELOCK_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// For https:// servers with a private CA: the CA certificate (PEM) to trust.
    #[arg(long, env = "FENCELOCK_CA_CERT")]
    pub ca_cert: Option<std::path::PathBuf>,
    /// Print JSON instead of text: results on stdout, a failure as one line
    /// `{"error":{"code","message","exit_code"}}` on stderr.
    #[arg(long)]
    pub json: bool,
}

impl Connection {
    /// Connects, or explains why not (exit code [`exit::UNAVAILABLE`]).
    pub async fn connect(&self) -> Result<FencelockBackend, Failure> {
        let mut config = ServerConfig::new(self.server.clone());
        config.token = self.token.clone();
        if let Some(path) = &self.ca_cert {
            config.ca_cert_pem = Some(std::fs::read(path).map_err(|e| Failure {
                message: format!("cannot read the CA certificate {}: {e}", path.display()),
                code: exit::USAGE,
            })?);
        }
        FencelockBackend::connect(config)
            .await
            .map_err(Failure::from)
    }
}

/// A failed client command: what to print and which exit code to return.
#[derive(Debug)]
pub struct Failure {
    /// The message for stderr.
    pub message: String,
    /// The process exit code.
    pub code: u8,
}

impl From<fencelock::Error> for Failure {
    fn from(e: fencelock::Error) -> Failure {
        Failure {
            code: exit::for_error(e.kind()),
            message: crate::explain::client_error(&e),
        }
    }
}

impl Failure {
    /// Prints the failure on stderr: `fencelock: MESSAGE`, or with `json` one line
    /// `{"error":{"code":NAME,"message":…,"exit_code":N}}` (the names of
    /// `fencelock help exit-codes`).
    pub fn print(&self, json: bool) {
        if json {
            eprintln!(
                "{}",
                json!({"error": {
                    "code": exit::name(self.code),
                    "message": self.message,
                    "exit_code": self.code,
                }})
            );
        } else {
            eprintln!("fencelock: {}", self.message);
        }
    }
}

/// The outcome of a client subcommand, as the process exit code; a failure is
/// printed as [`Failure::print`] says.
pub fn finish(result: Result<(), Failure>, json: bool) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            f.print(json);
            ExitCode::from(f.code)
        }
    }
}

/// The wall-clock time `after` from now, in RFC 3339 (UTC, milliseconds): the
/// client's estimate of when a lease ends, for scripts.
pub fn rfc3339_after(after: Duration) -> String {
    rfc3339(std::time::SystemTime::now().checked_add(after))
}

/// `at` in RFC 3339, within what the format can say (1970 to 9999; only a confused
/// server sends durations that reach past it).
fn rfc3339(at: Option<std::time::SystemTime>) -> String {
    use std::time::UNIX_EPOCH;
    let last = UNIX_EPOCH + Duration::from_secs(253_402_300_799);
    let at = at.unwrap_or(last).clamp(UNIX_EPOCH, last);
    humantime::format_rfc3339_millis(at).to_string()
}

/// The wall-clock time `before` ago, as [`rfc3339_after`].
pub fn rfc3339_before(before: Duration) -> String {
    rfc3339(
        std::time::SystemTime::now()
            .checked_sub(before)
            .or(Some(std::time::UNIX_EPOCH)),
    )
}

/// Why `name` was not acquired within `wait`, with who holds it (asked of the
/// server after the refusal; the server's own words if that fails).
pub async fn not_acquired_failure(
    backend: &FencelockBackend,
    name: &str,
    wait: Duration,
    e: &fencelock::Error,
) -> Failure {
    let why = match backend.get_lock(name).await {
        Ok(lock) => crate::explain::holders(&lock),
        // Freed in the meantime: the server's refusal is all there is to say.
        Err(_) => format!("busy ({})", e.message()),
    };
    Failure {
        message: crate::explain::not_acquired(name, wait, &why),
        code: exit::NOT_ACQUIRED,
    }
}

/// A duration flag that is not a duration (clap names the flag in front of it).
#[derive(Debug)]
pub struct BadDuration {
    text: String,
    problem: String,
}

impl std::fmt::Display for BadDuration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} is not a duration: {} (examples: 500ms, 30s, 1m 30s, 2h, 7d; a bare \
             number is seconds)",
            self.text, self.problem
        )
    }
}

impl std::error::Error for BadDuration {}

/// Parses durations like `500ms`, `30s`, `1m 30s`, `2h`, `7d` ([`humantime`]'s
/// syntax), or a bare number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, BadDuration> {
    let text = text.trim();
    let bad = |problem: String| BadDuration {
        text: text.to_owned(),
        problem,
    };
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        let seconds = text
            .parse()
            .map_err(|_| bad("too many seconds".to_owned()))?;
        return Ok(Duration::from_secs(seconds));
    }
    humantime::parse_duration(text).map_err(|e| bad(e.to_string()))
}

/// A duration for people: the event vocabulary's one format
/// ([`fencelock::vocab::human_ms`]: `250ms`, `1s500ms`, `1m48s`, `2h3m`).
pub fn human(d: Duration) -> String {
    human_ms(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// [`human`] of a number of milliseconds.
pub fn human_ms(ms: u64) -> String {
    fencelock::vocab::human_ms(ms)
}

/// `fencelock acquire`.
#[derive(Args, Debug)]
pub struct AcquireArgs {
    /// The lock name.
    pub name: String,
    /// Lease length (not renewed: renew it with `fencelock renew`).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub ttl: Duration,
    /// How long to wait if the lock is held.
    #[arg(long, default_value = "0s", value_parser = parse_duration)]
    pub wait: Duration,
    /// Who holds the lock (shown to operators).
    #[arg(long)]
    pub owner: Option<String>,
    /// Holders the lock admits (a semaphore).
    #[arg(long, default_value_t = 1)]
    pub limit: u32,
    /// Lock-delay after an expiry or forced release.
    #[arg(long, default_value = "0s", value_parser = parse_duration)]
    pub lock_delay: Duration,
    #[command(flatten)]
    pub connection: Connection,
}

/// Takes a lock once, without renewal, and prints the grant.
pub async fn acquire(args: AcquireArgs) -> Result<(), Failure> {
    let backend = args.connection.connect().await?;
    let mut spec = AcquireSpec::new(args.name, args.ttl);
    spec.wait = args.wait;
    spec.owner = args.owner.unwrap_or_else(default_owner);
    spec.limit = args.limit;
    spec.lock_delay = args.lock_delay;
    let spinner = Spinner::start(&spec.name, !args.wait.is_zero());
    let result = backend.acquire(&spec).await;
    spinner.stop();
    let lease = match result {
        Ok(lease) => lease,
        Err(e) if not_acquired(e.kind()) => {
            return Err(not_acquired_failure(&backend, &spec.name, args.wait, &e).await)
        }
        Err(e) => return Err(e.into()),
    };
    if args.connection.json {
        print_json(&json!({
            "name": lease.name,
            "fence": lease.fence,
            "owner_token": lease.owner_token,
            "ttl_ms": lease.ttl.as_millis() as u64,
            "expires_at": rfc3339_after(lease.ttl),
        }));
    } else {
        println!(
            "acquired {:?}: fence {}, ttl {}\nowner token: {}",
            lease.name,
            lease.fence,
            human(lease.ttl),
            lease.owner_token
        );
    }
    Ok(())
}

/// The owner text of CLI acquisitions: `user@host (fencelock cli)`.
pub fn default_owner() -> String {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        // SAFETY: getuid(2) cannot fail and touches no memory.
        .unwrap_or_else(|_| format!("uid {}", unsafe { libc::getuid() }));
    let host = std::fs::read_to_string("/etc/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "unknown-host".into());
    format!("{user}@{host} pid {}", std::process::id())
}

/// `fencelock renew`.
#[derive(Args, Debug)]
pub struct RenewArgs {
    /// The lock name.
    pub name: String,
    /// The grant's owner token (printed by `acquire`).
    #[arg(
        long = "owner-token",
        env = "FENCELOCK_OWNER_TOKEN",
        hide_env_values = true
    )]
    pub owner_token: String,
    /// New lease length.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub ttl: Duration,
    #[command(flatten)]
    pub connection: Connection,
}

/// Extends a lease.
pub async fn renew(args: RenewArgs) -> Result<(), Failure> {
    let backend = args.connection.connect().await?;
    let lease = Lease::new(args.name.clone(), 0, args.owner_token, args.ttl);
    let ttl = backend.renew(&lease, args.ttl).await?;
    if args.connection.json {
        print_json(&json!({
            "name": args.name,
            "ttl_ms": ttl.as_millis() as u64,
            "expires_at": rfc3339_after(ttl),
        }));
    } else {
        println!("renewed {:?} for {}", args.name, human(ttl));
    }
    Ok(())
}

/// `fencelock release`.
#[derive(Args, Debug)]
pub struct ReleaseArgs {
    /// The lock name.
    pub name: String,
    /// The grant's owner token (printed by `acquire`).
    #[arg(
        long = "owner-token",
        env = "FENCELOCK_OWNER_TOKEN",
        hide_env_values = true
    )]
    pub owner_token: String,
    #[command(flatten)]
    pub connection: Connection,
}

/// Gives a lock back.
pub async fn release(args: ReleaseArgs) -> Result<(), Failure> {
    let backend = args.connection.connect().await?;
    let lease = Lease::new(args.name.clone(), 0, args.owner_token, Duration::ZERO);
    let released = backend.release(&lease).await?;
    if args.connection.json {
        print_json(&json!({"name": args.name, "released": released}));
    } else if released {
        println!("released {:?}", args.name);
    } else {
        println!(
            "{:?} was not held by this token (already released or expired)",
            args.name
        );
    }
    Ok(())
}

/// `fencelock ls`.
#[derive(Args, Debug)]
pub struct LsArgs {
    /// Only locks whose names start with this.
    #[arg(long, default_value = "")]
    pub prefix: String,
    #[command(flatten)]
    pub connection: Connection,
}

/// Lists locks (all pages).
pub async fn ls(args: LsArgs) -> Result<(), Failure> {
    let backend = args.connection.connect().await?;
    let mut locks = Vec::new();
    let mut after = None;
    loop {
        let page = backend.list_locks(&args.prefix, after, 1000).await?;
        locks.extend(page.locks);
        match page.next_after {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    if args.connection.json {
        print_json(&json!({"locks": locks.iter().map(lock_json).collect::<Vec<_>>()}));
        return Ok(());
    }
    if locks.is_empty() {
        println!("no locks{}", prefix_note(&args.prefix));
        return Ok(());
    }
    println!(
        "{:<40} {:>7} {:>12} {:>10} {:>10}  OWNER",
        "NAME", "HOLDERS", "FENCE", "HELD", "TTL LEFT"
    );
    for lock in &locks {
        let first = lock.holders.first();
        println!(
            "{:<40} {:>7} {:>12} {:>10} {:>10}  {}{}",
            lock.name,
            format!("{}/{}", lock.holders.len(), lock.limit),
            first
                .map(|h| h.fence.to_string())
                .unwrap_or_else(|| "-".into()),
            first
                .map(|h| human_ms(h.held_ms))
                .unwrap_or_else(|| "-".into()),
            first
                .map(|h| human_ms(h.ttl_remaining_ms))
                .unwrap_or_else(|| "-".into()),
            first.map(|h| h.owner.as_str()).unwrap_or("-"),
            if lock.waiters > 0 {
                format!("  (+{} waiting)", lock.waiters)
            } else {
                String::new()
            }
        );
    }
    Ok(())
}

fn prefix_note(prefix: &str) -> String {
    if prefix.is_empty() {
        String::new()
    } else {
        format!(" with prefix {prefix:?}")
    }
}

/// `fencelock show`.
#[derive(Args, Debug)]
pub struct ShowArgs {
    /// The lock name.
    pub name: String,
    #[command(flatten)]
    pub connection: Connection,
}

/// Shows one lock.
pub async fn show(args: ShowArgs) -> Result<(), Failure> {
    let backend = args.connection.connect().await?;
    let lock = backend.get_lock(&args.name).await?;
    if args.connection.json {
        print_json(&lock_json(&lock));
        return Ok(());
    }
    println!("lock {:?} (limit {})", lock.name, lock.limit);
    for h in &lock.holders {
        println!(
            "  holder: fence {}, owner {:?}, held {}, ttl left {}{}",
            h.fence,
            h.owner,
            human_ms(h.held_ms),
            human_ms(h.ttl_remaining_ms),
            h.session
                .as_ref()
                .map(|s| format!(", session {s}"))
                .unwrap_or_default()
        );
    }
    if lock.holders.is_empty() {
        println!("  no holders");
    }
    println!("  waiters: {}", lock.waiters);
    if lock.lock_delay_remaining_ms > 0 {
        println!(
            "  lock-delay: {} left",
            human_ms(lock.lock_delay_remaining_ms)
        );
    }
    Ok(())
}

/// `fencelock watch`.
#[derive(Args, Debug)]
pub struct WatchArgs {
    /// Only events of locks whose names start with this.
    #[arg(long, default_value = "")]
    pub prefix: String,
    /// Resume after this event position (an event's `position` in `--json`)
    /// instead of from now on.
    #[arg(long, value_name = "POSITION")]
    pub after: Option<String>,
    #[command(flatten)]
    pub connection: Connection,
}

/// Prints lock events as they happen, until interrupted or the server ends the
/// stream. A dropped connection or a server restart is resumed without a gap (the
/// stream reconnects); a server that cannot resume is an error.
pub async fn watch(args: WatchArgs) -> Result<(), Failure> {
    let after = args
        .after
        .as_deref()
        .map(str::parse::<WatchPosition>)
        .transpose()?;
    let backend = args.connection.connect().await?;
    let mut events = backend.watch_after(&args.prefix, after).await?;
    if !args.connection.json {
        eprintln!("watching{} (Ctrl-C to stop)", prefix_note(&args.prefix));
    }
    while let Some(event) = events.next().await? {
        if args.connection.json {
            print_json(&event_json(&event));
        } else {
            println!("{}", event_line(&event));
        }
    }
    Ok(())
}

/// `fencelock force-release`.
#[derive(Args, Debug)]
pub struct ForceReleaseArgs {
    /// The lock name.
    pub name: String,
    /// Why (required; recorded with the event).
    #[arg(long)]
    pub reason: String,
    /// Only the holder with this fence (default: every holder).
    #[arg(long)]
    pub fence: Option<u64>,
    #[command(flatten)]
    pub connection: Connection,
}

/// Operator action: takes a lock from its holders.
pub async fn force_release(args: ForceReleaseArgs) -> Result<(), Failure> {
    let backend = args.connection.connect().await?;
    let fences = backend
        .force_release(&args.name, args.fence, &args.reason)
        .await?;
    if args.connection.json {
        print_json(&json!({"name": args.name, "fences": fences}));
    } else if fences.is_empty() {
        println!("{:?}: no holder was released", args.name);
    } else {
        println!("{:?}: released fences {fences:?}", args.name);
    }
    Ok(())
}

fn print_json(value: &Value) {
    println!("{value}");
}

fn lock_json(lock: &LockInfo) -> Value {
    json!({
        "name": lock.name,
        "limit": lock.limit,
        "holders": lock.holders.iter().map(|h| json!({
            "fence": h.fence,
            "owner": h.owner,
            "held_ms": h.held_ms,
            "ttl_remaining_ms": h.ttl_remaining_ms,
            // Wall-clock times for scripts, from this machine's clock.
            "held_since": rfc3339_before(Duration::from_millis(h.held_ms)),
            "expires_at": rfc3339_after(Duration::from_millis(h.ttl_remaining_ms)),
            "session": h.session,
        })).collect::<Vec<_>>(),
        "waiters": lock.waiters,
        "lock_delay_remaining_ms": lock.lock_delay_remaining_ms,
    })
}

fn kind_name(kind: EventKind) -> &'static str {
    kind.as_str()
}

fn wait_end_name(end: Option<WaitEnd>) -> Option<&'static str> {
    end.map(WaitEnd::as_str)
}

/// One `watch --json` line: the event fields of the audit log and the server's
/// watch (`kind`, `handoff`, `name`, `fence`, `owner`, `session`, `mode`, `value`,
/// `time`, `time_ms`, `duration_ms`, `reason`, `wait_end`) and the `position`;
/// absent when they do not apply. `at` is `time`'s name from before, kept for
/// existing scripts.
fn event_json(e: &LockEvent) -> Value {
    let mut line = serde_json::Map::new();
    let mut put = |key: &str, value: Value| {
        if !value.is_null() {
            line.insert(key.to_owned(), value);
        }
    };
    let time = e
        .at()
        .map(|t| humantime::format_rfc3339_millis(t).to_string());
    put("kind", json!(kind_name(e.kind)));
    put(
        "handoff",
        json!((e.kind == EventKind::Granted).then_some(e.handoff)),
    );
    put("name", json!(e.name));
    put("fence", json!(e.fence));
    put("owner", json!(e.owner));
    put("session", json!(e.session));
    put("mode", json!(e.mode.map(|m| m.as_str())));
    put("value", json!(e.value));
    put("time", json!(time));
    put("time_ms", json!((e.time_ms > 0).then_some(e.time_ms)));
    put("duration_ms", json!(e.duration_ms));
    put("reason", json!(e.reason));
    put("wait_end", json!(wait_end_name(e.wait_end)));
    put("position", json!(e.position.map(|p| p.to_string())));
    put("at", json!(time));
    Value::Object(line)
}

fn event_line(e: &LockEvent) -> String {
    let mut line = format!("{:<15} {}", kind_name(e.kind), e.name);
    if let Some(fence) = e.fence {
        line.push_str(&format!(" fence={fence}"));
    }
    if !e.owner.is_empty() {
        line.push_str(&format!(" owner={:?}", e.owner));
    }
    if e.mode == Some(LockMode::Shared) {
        line.push_str(" mode=shared");
    }
    if let Some(value) = &e.value {
        line.push_str(&format!(" value={value:?}"));
    }
    if e.handoff {
        line.push_str(" handoff");
    }
    if e.duration_ms > 0 {
        line.push_str(&format!(" after={}", human_ms(e.duration_ms)));
    }
    if let Some(reason) = &e.reason {
        line.push_str(&format!(" reason={reason:?}"));
    }
    if let Some(end) = wait_end_name(e.wait_end) {
        line.push_str(&format!(" ({end})"));
    }
    line
}

/// A "waiting for …" spinner on stderr, shown only when stderr is a terminal.
pub struct Spinner {
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Spinner {
    /// Starts the spinner if `waiting` and stderr is a terminal.
    pub fn start(name: &str, waiting: bool) -> Spinner {
        if !waiting || !std::io::stderr().is_terminal() {
            return Spinner { task: None };
        }
        let name = name.to_owned();
        let task = tokio::spawn(async move {
            const FRAMES: [char; 10] = ['⠋', '⠙', '⠹', '⠸', '⠼', '⠴', '⠦', '⠧', '⠇', '⠏'];
            let start = tokio::time::Instant::now();
            for frame in FRAMES.iter().cycle() {
                let waited = human(start.elapsed());
                let mut err = std::io::stderr();
                let _ = write!(err, "\r{frame} waiting for {name:?} ({waited})\x1b[K");
                let _ = err.flush();
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        Spinner { task: Some(task) }
    }

    /// Stops the spinner and clears its line.
    pub fn stop(self) {
        if let Some(task) = self.task {
            task.abort();
            let mut err = std::io::stderr();
            let _ = write!(err, "\r\x1b[K");
            let _ = err.flush();
        }
    }
}

/// Whether an error means "the lock was not granted" (for `run`'s exit code).
pub fn not_acquired(kind: ErrorKind) -> bool {
    matches!(kind, ErrorKind::Held | ErrorKind::Timeout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        let ok = [
            ("500ms", 500),
            ("30s", 30_000),
            ("30", 30_000),
            (" 30 ", 30_000),
            ("1m", 60_000),
            ("1m 30s", 90_000),
            ("1s 500ms", 1500),
            ("2h", 7_200_000),
            ("7d", 7 * 86_400_000),
            ("0s", 0),
        ];
        for (text, ms) in ok {
            assert_eq!(
                parse_duration(text).unwrap(),
                Duration::from_millis(ms),
                "{text}"
            );
        }
        for bad in [
            "",
            "s",
            "10x",
            "-1s",
            "ms5",
            "1.2.3s",
            "99999999999999999999",
        ] {
            let e = parse_duration(bad).expect_err(bad);
            assert!(e.to_string().contains("is not a duration"), "{e}");
        }
        let e = parse_duration("10x").unwrap_err().to_string();
        assert!(e.contains("\"10x\"") && e.contains("examples"), "{e}");
    }

    #[test]
    fn wall_clock_times_never_overflow() {
        let year_9999 = Duration::from_secs(253_402_300_799);
        for text in [
            rfc3339_after(Duration::from_secs(u64::MAX)),
            rfc3339_before(Duration::from_secs(u64::MAX)),
            rfc3339_after(Duration::ZERO),
        ] {
            assert!(humantime::parse_rfc3339(&text).is_ok(), "{text}");
        }
        assert!(rfc3339_before(year_9999).starts_with("1970-01-01T"));
        assert!(rfc3339_after(year_9999).starts_with("9999-12-31T"));
    }

    #[test]
    fn human_durations() {
        assert_eq!(human_ms(250), "250ms");
        assert_eq!(human_ms(1500), "1s500ms");
        assert_eq!(human_ms(1549), "1s500ms");
        assert_eq!(human_ms(61_000), "1m1s");
        assert_eq!(human_ms(108_860), "1m48s");
        assert_eq!(human_ms(3_660_000), "1h1m");
        assert_eq!(human(Duration::from_secs(30)), "30s");
        // What people read, they can type back: never more than it was, and within
        // the precision shown.
        for ms in [
            0, 7, 999, 1_000, 1_549, 59_999, 61_000, 108_860, 3_660_000, 7_380_000, 90_061_000,
        ] {
            let back = parse_duration(&human_ms(ms)).expect("parses back");
            let back = back.as_millis() as u64;
            assert!(
                back <= ms && ms - back < 3_600_000,
                "{ms} -> {}",
                human_ms(ms)
            );
        }
    }
}
