//! `fencelock elect NAME VALUE -- COMMAND…` runs a command while leading an election;
//! `fencelock leader NAME [--watch]` shows who leads.
//!
//! `elect` campaigns (waits to lead, up to `--wait`, by default forever), then runs the
//! command exactly as `fencelock run` does (see [`crate::run::Supervise`]) with the term
//! in `FENCELOCK_TERM` and `FENCELOCK_FENCE` (pass it as the fence with every write),
//! the election in `FENCELOCK_ELECTION` and the value in `FENCELOCK_VALUE`. When the
//! command ends, the leader resigns and `elect` exits with the command's code; if
//! leadership is lost first, the command is stopped and `elect` exits with
//! [`exit::LOCK_LOST`].

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use fencelock::{Client, Leader, LockOptions, MAX_NAME_BYTES, MAX_VALUE_BYTES};
use futures_util::StreamExt;
use serde_json::json;

use crate::exit;
use crate::remote::{default_owner, not_acquired, parse_duration, rfc3339_after, Connection};
use crate::remote::{human, Failure};
use crate::run::{failure, say, Ended, Supervise};

/// `fencelock elect`.
#[derive(Args, Debug)]
#[command(override_usage = "fencelock elect [OPTIONS] <NAME> <VALUE> -- <COMMAND>...")]
pub struct ElectArgs {
    /// The election.
    #[arg(value_name = "NAME")]
    pub name: String,
    /// What the followers read while this candidate leads (an address, say; at most
    /// 4096 bytes, no control characters).
    #[arg(value_name = "VALUE")]
    pub value: String,
    /// Lease length; renewed every third of it while the command runs. A leader that
    /// dies is replaced within about this long.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub ttl: Duration,
    /// How long to wait to lead (default: for ever).
    #[arg(long, value_parser = parse_duration)]
    pub wait: Option<Duration>,
    /// Who campaigns (default: user@host, pid and the command).
    #[arg(long)]
    pub owner: Option<String>,
    /// After lost leadership: how long the command has to exit after SIGTERM before
    /// SIGKILL.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub grace: Duration,
    /// Server, token, CA certificate; `--json`: `elect`'s own messages (leading,
    /// failures, lost leadership) as JSON lines on stderr (stdout is the command's).
    #[command(flatten)]
    pub connection: Connection,
    /// The command and its arguments (after `--`).
    #[arg(last = true, required = true, num_args = 1..)]
    pub command: Vec<String>,
}

/// `fencelock leader`.
#[derive(Args, Debug)]
pub struct LeaderArgs {
    /// The election.
    pub name: String,
    /// Keep printing: one line per change of leader, value or term (reconnecting
    /// after errors), until interrupted.
    #[arg(long)]
    pub watch: bool,
    #[command(flatten)]
    pub connection: Connection,
}

/// Runs `elect`; returns the exit code described in the module docs.
pub async fn elect(args: ElectArgs) -> ExitCode {
    let json = args.connection.json;
    match elect_command(args).await {
        Ok(code) => ExitCode::from(code),
        Err(f) => {
            say("elect", &f, json);
            ExitCode::from(f.code)
        }
    }
}

/// A usage error about an argument, named as `--help` shows it.
fn bad_argument(arg: &str, why: impl std::fmt::Display) -> Failure {
    failure(exit::USAGE, format!("invalid {arg}: {why}"))
}

/// Checks the election name as the server would, naming the argument.
fn check_name(name: &str) -> Result<(), Failure> {
    if name.is_empty() {
        return Err(bad_argument("NAME", "the election name must not be empty"));
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(bad_argument(
            "NAME",
            format!("the election name must be at most {MAX_NAME_BYTES} bytes"),
        ));
    }
    if name.chars().any(char::is_control) {
        return Err(bad_argument(
            "NAME",
            "the election name must not contain control characters",
        ));
    }
    Ok(())
}

/// Checks the value (the client would refuse it too, but without naming `VALUE`).
fn check_value(value: &str) -> Result<(), Failure> {
    if value.len() > MAX_VALUE_BYTES {
        return Err(bad_argument(
            "VALUE",
            format!(
                "the value is {} bytes; at most {MAX_VALUE_BYTES} are allowed",
                value.len()
            ),
        ));
    }
    if value.chars().any(char::is_control) {
        return Err(bad_argument(
            "VALUE",
            "the value must not contain control characters",
        ));
    }
    Ok(())
}

async fn elect_command(args: ElectArgs) -> Result<u8, Failure> {
    check_name(&args.name)?;
    check_value(&args.value)?;
    let name = args.name.clone();
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
    let client = Client::new(backend);
    let options = LockOptions::default().ttl(args.ttl).owner(owner);
    let options = match args.wait {
        Some(wait) => options.wait(wait),
        None => options.wait_forever(),
    };
    let election = client.election(name.clone()).options(options);
    let waiting = args.wait.is_none_or(|w| !w.is_zero());
    let spinner = crate::remote::Spinner::start(&name, waiting);
    let campaigned = election.campaign(args.value.clone()).await;
    spinner.stop();
    let leadership = match campaigned {
        Ok(l) => l,
        Err(e) if not_acquired(e.kind()) => {
            let who = match election.leader().await {
                Ok(Some(leader)) => format!(
                    "; {:?} leads at term {} ({:?})",
                    leader.owner, leader.term, leader.value
                ),
                _ => String::new(),
            };
            let waited = args
                .wait
                .map(|w| format!(" within {}", human(w)))
                .unwrap_or_default();
            return Err(failure(
                exit::NOT_ACQUIRED,
                format!("did not become leader of {name:?}{waited}{who}"),
            ));
        }
        Err(e) => return Err(e.into()),
    };
    let term = leadership.term();
    if args.connection.json {
        eprintln!(
            "{}",
            json!({"leading": {
                "name": name,
                "term": term,
                "value": args.value,
                "ttl_ms": args.ttl.as_millis() as u64,
                "at": rfc3339_after(Duration::ZERO),
            }})
        );
    }
    let env = [
        ("FENCELOCK_ELECTION", name.clone()),
        ("FENCELOCK_VALUE", args.value.clone()),
        ("FENCELOCK_TERM", term.to_string()),
        ("FENCELOCK_FENCE", term.to_string()),
    ];
    let child = Supervise {
        who: "elect",
        name: &name,
        command: &args.command,
        env: &env,
        grace: args.grace,
        json: args.connection.json,
    };
    let outcome = child.run(leadership.lost()).await;
    // Best effort in every case: the lease expires anyway if this fails.
    let resigned = tokio::time::timeout(Duration::from_secs(2), leadership.resign()).await;
    match outcome {
        Ok(Ended::Exited(code)) => {
            if !matches!(resigned, Ok(Ok(_))) {
                eprintln!("fencelock elect: the command finished, but resigning from {name:?} failed (the term will expire)");
            }
            Ok(code)
        }
        Ok(Ended::Lost) => Ok(exit::LOCK_LOST),
        Err(f) => Err(f),
    }
}

/// Runs `leader`.
pub async fn leader(args: LeaderArgs) -> Result<(), Failure> {
    check_name(&args.name)?;
    let backend = args.connection.connect().await?;
    let client = Client::new(backend);
    let election = client.election(args.name.clone());
    if args.watch {
        return watch(&election, args.connection.json).await;
    }
    let leader = election.leader().await?;
    print_leader(&args.name, leader.as_ref(), args.connection.json, false);
    match leader {
        Some(_) => Ok(()),
        None => Err(failure(
            exit::FAILURE,
            format!("election {:?} has no leader", args.name),
        )),
    }
}

/// Prints one leader (or none): `OWNER leads NAME at term T: VALUE`, or a JSON line.
/// `stamped`: with the time it was seen (for `--watch`).
fn print_leader(name: &str, leader: Option<&Leader>, json: bool, stamped: bool) {
    let at = rfc3339_after(Duration::ZERO);
    if json {
        let leader = leader.map(|l| json!({"owner": l.owner, "value": l.value, "term": l.term}));
        let mut line = json!({"name": name, "leader": leader});
        if stamped {
            line["at"] = json!(at);
        }
        println!("{line}");
        return;
    }
    let prefix = if stamped {
        format!("{at}  ")
    } else {
        String::new()
    };
    match leader {
        Some(l) => println!(
            "{prefix}{:?} leads {name:?} at term {}: {}",
            l.owner, l.term, l.value
        ),
        None => println!("{prefix}no leader of {name:?}"),
    }
}

/// Prints the leader, then each change; after an error, says so on stderr and
/// follows again after a backoff (only errors no retry can fix end it).
async fn watch(election: &fencelock::Election, json: bool) -> Result<(), Failure> {
    const FIRST_BACKOFF: Duration = Duration::from_millis(200);
    const MAX_BACKOFF: Duration = Duration::from_secs(10);
    let name = election.name().to_owned();
    let mut last: Option<Option<Leader>> = None;
    let mut backoff = FIRST_BACKOFF;
    loop {
        let mut changes = Box::pin(election.observe());
        while let Some(item) = changes.next().await {
            match item {
                Ok(leader) => {
                    backoff = FIRST_BACKOFF;
                    // After a reconnection the current leader comes again.
                    if last.as_ref() != Some(&leader) {
                        print_leader(&name, leader.as_ref(), json, true);
                        last = Some(leader);
                    }
                }
                Err(e) if permanent(e.kind()) => return Err(e.into()),
                Err(e) => {
                    let f = Failure::from(e);
                    if json {
                        f.print(true);
                    } else {
                        eprintln!(
                            "fencelock leader: {}; following again in {}",
                            f.message,
                            human(backoff)
                        );
                    }
                    break;
                }
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Errors that following again would only repeat.
fn permanent(kind: fencelock::ErrorKind) -> bool {
    use fencelock::ErrorKind::*;
    matches!(kind, InvalidArgument | PermissionDenied | Unsupported)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_names_and_values_name_the_argument() {
        let empty = check_name("").unwrap_err();
        assert_eq!(empty.code, exit::USAGE);
        assert!(empty.message.contains("NAME"), "{}", empty.message);
        let long = "v".repeat(MAX_VALUE_BYTES + 1);
        let too_long = check_value(&long).unwrap_err();
        assert_eq!(too_long.code, exit::USAGE);
        assert!(too_long.message.contains("VALUE"), "{}", too_long.message);
        assert!(check_value(&"v".repeat(MAX_VALUE_BYTES)).is_ok());
        assert!(check_value("").is_ok());
        assert!(check_name("scheduler").is_ok());
        assert!(check_value("a\nb").is_err());
    }

    #[test]
    fn only_unfixable_errors_end_a_watch() {
        assert!(permanent(fencelock::ErrorKind::PermissionDenied));
        assert!(!permanent(fencelock::ErrorKind::Unavailable));
    }
}
