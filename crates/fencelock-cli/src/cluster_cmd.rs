//! `fencelock cluster status|add|remove|transfer-leader`: an admin looks at and
//! changes a cluster's membership over the HTTP API (`/v1/cluster`). Requests that
//! change the cluster go to the leader: `--server` may list every member, and a
//! member that is not the leader names it (see `http_get`). While no member can be
//! reached, or the cluster has no leader (every member answers 503), a command
//! retries with backoff for up to `--wait`, then exits 69.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use serde_json::{json, Value};

use crate::exit;
use crate::http_get::{self, HttpStatus, Unreachable};
use crate::remote::{self, Connection, Failure};

/// `fencelock cluster …`.
#[derive(Debug, Subcommand)]
pub enum ClusterCmd {
    /// Show the members, their roles and how far each has replicated, the term and
    /// the leader (`--json`: the server's body).
    Status(StatusArgs),
    /// Add a member: it joins as a learner, catches up, then becomes a voter.
    Add(AddArgs),
    /// Remove a member (voter or learner) by its id.
    Remove(RemoveArgs),
    /// Hand the leadership to the member with this id.
    TransferLeader(TransferArgs),
}

/// How long a cluster command keeps trying.
#[derive(Debug, Args)]
pub struct Retry {
    /// How long to keep retrying, with backoff, while no member can be reached or
    /// the cluster has no leader (members answer 503); then exit 69. `0s`: try once.
    #[arg(long, default_value = "10s", value_parser = remote::parse_duration)]
    pub wait: Duration,
}

/// Flags of `fencelock cluster status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Server(s), admin token, CA certificate, `--json`.
    #[command(flatten)]
    pub connection: Connection,
    /// `--wait` (here also while the members that answer know no leader; the last
    /// answer is printed before exiting 69).
    #[command(flatten)]
    pub retry: Retry,
}

/// Flags of `fencelock cluster add`.
#[derive(Debug, Args)]
pub struct AddArgs {
    /// The new member's node id (its `serve --node-id`).
    #[arg(long)]
    pub id: u64,
    /// The new member's peer address (its `serve --peer-listen`), `host:port`.
    #[arg(long)]
    pub peer_addr: String,
    /// The new member's client URL (its `serve --advertise-url`).
    #[arg(long)]
    pub url: String,
    /// Server(s), admin token, CA certificate, `--json`.
    #[command(flatten)]
    pub connection: Connection,
    /// `--wait`.
    #[command(flatten)]
    pub retry: Retry,
}

/// Flags of `fencelock cluster remove`.
#[derive(Debug, Args)]
pub struct RemoveArgs {
    /// The member's node id.
    pub id: u64,
    /// Server(s), admin token, CA certificate, `--json`.
    #[command(flatten)]
    pub connection: Connection,
    /// `--wait`.
    #[command(flatten)]
    pub retry: Retry,
}

/// Flags of `fencelock cluster transfer-leader`.
#[derive(Debug, Args)]
pub struct TransferArgs {
    /// The node id of the member to lead.
    pub id: u64,
    /// Server(s), admin token, CA certificate, `--json`.
    #[command(flatten)]
    pub connection: Connection,
    /// `--wait`.
    #[command(flatten)]
    pub retry: Retry,
}

/// Runs the command; exit codes as the other client commands (69 unreachable or
/// no leader within `--wait`, 77 not allowed, 2 refused as malformed, 1 otherwise).
pub fn run(cmd: ClusterCmd) -> ExitCode {
    let json = match &cmd {
        ClusterCmd::Status(a) => a.connection.json,
        ClusterCmd::Add(a) => a.connection.json,
        ClusterCmd::Remove(a) => a.connection.json,
        ClusterCmd::TransferLeader(a) => a.connection.json,
    };
    remote::finish(execute(cmd), json)
}

fn execute(cmd: ClusterCmd) -> Result<(), Failure> {
    match cmd {
        ClusterCmd::Status(args) => {
            let c = &args.connection;
            let mut leaderless = None;
            let answer = with_retries(args.retry.wait, std::thread::sleep, || {
                let body = request(c, "GET", "/v1/cluster", None)?;
                if body["leader"].is_null() {
                    leaderless = Some(body);
                    return Err(NoLeader.into());
                }
                Ok(body)
            });
            match (answer, leaderless) {
                (Ok(body), _) => print_cluster(c, &body),
                // Still worth seeing: who answered, in which term, with whom.
                (Err(failure), Some(body)) => {
                    print_cluster(c, &body)?;
                    Err(failure)
                }
                (Err(failure), None) => Err(failure),
            }
        }
        ClusterCmd::Add(args) => {
            if args.peer_addr.trim().is_empty() || args.url.trim().is_empty() {
                return Err(Failure {
                    message: "--peer-addr and --url must not be empty".into(),
                    code: exit::USAGE,
                });
            }
            let request = json!({"id": args.id, "peer_addr": args.peer_addr, "url": args.url});
            let body = call(
                &args.connection,
                args.retry.wait,
                "POST",
                "/v1/cluster/members",
                Some(&request),
            )?;
            print_cluster(&args.connection, &body)
        }
        ClusterCmd::Remove(args) => {
            let c = &args.connection;
            let path = format!("/v1/cluster/members/{}", args.id);
            let mut attempts = 0;
            let body = with_retries(args.retry.wait, std::thread::sleep, || {
                attempts += 1;
                match request(c, "DELETE", &path, None) {
                    // After a transient failure, "not in the cluster" is what was
                    // asked for (perhaps done by the earlier attempt: a 503 for a
                    // removal that had begun but did not complete in time).
                    Err(e) if attempts > 1 && not_found(&e) => {
                        request(c, "GET", "/v1/cluster", None)
                    }
                    other => other,
                }
            })?;
            print_cluster(c, &body)
        }
        ClusterCmd::TransferLeader(args) => {
            let request = json!({"id": args.id});
            let path = "/v1/cluster/transfer-leader";
            let body = call(
                &args.connection,
                args.retry.wait,
                "POST",
                path,
                Some(&request),
            )?;
            if args.connection.json {
                println!("{body}");
            } else {
                let leader = body["leader"].as_u64().unwrap_or(args.id);
                println!("member {leader} is the leader");
            }
            Ok(())
        }
    }
}

/// One request to the cluster, retried for up to `wait` (see [`with_retries`]): its
/// JSON answer or a failure with its exit code.
fn call(
    c: &Connection,
    wait: Duration,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> Result<Value, Failure> {
    with_retries(wait, std::thread::sleep, || request(c, method, path, body))
}

/// One request to the cluster (to the first member that answers, following the
/// leader it names): its JSON answer.
fn request(
    c: &Connection,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> anyhow::Result<Value> {
    let body = body.map(|b| b.to_string().into_bytes());
    let answer = http_get::send(
        method,
        &c.server,
        path,
        c.token.as_deref(),
        c.ca_cert.as_deref(),
        body.as_deref(),
    )?;
    serde_json::from_slice(&answer)
        .map_err(|e| anyhow::anyhow!("the server sent invalid JSON: {e}"))
}

/// First pause between attempts; it doubles up to [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(100);
/// Longest pause between attempts.
const MAX_PAUSE: Duration = Duration::from_secs(1);

/// The members that answered know no leader (`cluster status`).
#[derive(Debug)]
struct NoLeader;

impl std::fmt::Display for NoLeader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the members that answered know no leader")
    }
}

impl std::error::Error for NoLeader {}

/// Whether another attempt may succeed: no member could be reached, one answered
/// 503 (no leader, a leader without a quorum, a change not possible yet), or none
/// knows a leader. Nothing else is retried: a real answer, or an I/O failure after
/// a state change may have been sent.
fn transient(e: &anyhow::Error) -> bool {
    e.downcast_ref::<Unreachable>().is_some()
        || e.downcast_ref::<NoLeader>().is_some()
        || e.downcast_ref::<HttpStatus>()
            .is_some_and(|s| s.status == 503)
}

fn not_found(e: &anyhow::Error) -> bool {
    e.downcast_ref::<HttpStatus>()
        .is_some_and(|s| s.status == 404 && s.code().as_deref() == Some("not_found"))
}

/// Runs `attempt` until it succeeds, fails for good, or `wait` is spent on
/// transient failures ([`transient`]), pausing with `pause` between attempts
/// (100 ms doubling to 1 s). Out of time: exit 69 with the last reason.
fn with_retries<T>(
    wait: Duration,
    mut pause: impl FnMut(Duration),
    mut attempt: impl FnMut() -> anyhow::Result<T>,
) -> Result<T, Failure> {
    let started = Instant::now();
    // Time spent: real time, or the pauses alone if they did not really sleep.
    let mut paused = Duration::ZERO;
    let mut next = FIRST_PAUSE;
    loop {
        let e = match attempt() {
            Ok(value) => return Ok(value),
            Err(e) if transient(&e) => e,
            Err(e) => return Err(failure(e)),
        };
        let spent = started.elapsed().max(paused);
        if spent + next > wait {
            return Err(Failure {
                message: format!(
                    "no leader answered within {} (--wait): {e:#}",
                    crate::remote::human(wait)
                ),
                code: exit::UNAVAILABLE,
            });
        }
        pause(next);
        paused += next;
        next = (next * 2).min(MAX_PAUSE);
    }
}

/// The exit code and message of a failed request.
fn failure(e: anyhow::Error) -> Failure {
    crate::explain::http_failure(e)
}

fn print_cluster(c: &Connection, body: &Value) -> Result<(), Failure> {
    if c.json {
        println!("{body}");
    } else {
        print!("{}", table(body));
    }
    Ok(())
}

/// A header line (this member, the term, the leader), then one line per member.
fn table(v: &Value) -> String {
    let num = |v: &Value| v.as_u64().map_or("-".to_owned(), |n| n.to_string());
    let text = |v: &Value| v.as_str().unwrap_or("-").to_owned();
    let leader = match &v["leader"] {
        Value::Null => "none known".to_owned(),
        l => format!("{} ({})", num(&l["id"]), text(&l["url"])),
    };
    let importing = if v["importing"] == Value::Bool(true) {
        ", importing a single server's state (clients wait)"
    } else {
        ""
    };
    let mut out = format!(
        "member {}, term {}, leader {leader}{importing}\n",
        num(&v["node_id"]),
        num(&v["term"])
    );
    out += &format!(
        "{:>4}  {:<8}  {:<28}  {:<21}  MATCHED\n",
        "ID", "ROLE", "URL", "PEER_ADDR"
    );
    for m in v["members"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
        out += &format!(
            "{:>4}  {:<8}  {:<28}  {:<21}  {}\n",
            num(&m["id"]),
            text(&m["role"]),
            text(&m["url"]),
            text(&m["peer_addr"]),
            num(&m["matched_index"]),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_table_lists_every_member() {
        let body = json!({"node_id": 2, "term": 5,
            "leader": {"id": 1, "url": "http://127.0.0.1:7420"},
            "members": [
                {"id": 1, "url": "http://127.0.0.1:7420", "peer_addr": "127.0.0.1:7520",
                 "role": "leader", "matched_index": 42},
                {"id": 2, "url": "http://127.0.0.1:7421", "peer_addr": "127.0.0.1:7521",
                 "role": "follower", "matched_index": 41},
                {"id": 4, "url": "http://127.0.0.1:7423", "peer_addr": "127.0.0.1:7523",
                 "role": "learner", "matched_index": null}]});
        let text = table(&body);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 5, "{text}");
        assert_eq!(
            lines[0],
            "member 2, term 5, leader 1 (http://127.0.0.1:7420)"
        );
        assert!(lines[1].trim_start().starts_with("ID  ROLE"), "{text}");
        assert!(
            lines[2].contains("leader") && lines[2].ends_with("42"),
            "{text}"
        );
        assert!(
            lines[4].contains("learner") && lines[4].ends_with('-'),
            "{text}"
        );
        let column = |l: &str| l.find("127.0.0.1:75").expect("a peer column");
        assert_eq!(column(lines[2]), column(lines[4]), "{text}");

        let leaderless = table(&json!({"node_id": 3, "term": 6, "leader": null, "members": []}));
        assert!(
            leaderless.starts_with("member 3, term 6, leader none known\n"),
            "{leaderless}"
        );
        let importing = table(&json!({"node_id": 1, "term": 1, "leader": null,
            "members": [], "importing": true}));
        assert!(
            importing.starts_with(
                "member 1, term 1, leader none known, importing a single server's state"
            ),
            "{importing}"
        );
    }

    fn unavailable() -> anyhow::Error {
        HttpStatus {
            status: 503,
            body: r#"{"error":{"code":"not_leader","message":"no leader is known yet"}}"#.into(),
        }
        .into()
    }

    #[test]
    fn transient_failures_are_retried_with_backoff_within_the_wait() {
        // Two 503s, then the answer: three attempts, pauses 100 and 200 ms.
        let mut pauses = Vec::new();
        let mut left = 2;
        let got = with_retries(
            Duration::from_secs(10),
            |d| pauses.push(d),
            || {
                if left == 0 {
                    return Ok("answer");
                }
                left -= 1;
                Err(unavailable())
            },
        );
        assert_eq!(got.expect("the third attempt answers"), "answer");
        assert_eq!(
            pauses,
            [Duration::from_millis(100), Duration::from_millis(200)]
        );

        // Never a leader: pauses until the wait is spent (100+200+400+800+1000+1000
        // = 3.5 s of a 4 s wait), then 69 with the last reason.
        let mut pauses = Vec::new();
        let mut attempts = 0;
        let err = with_retries(
            Duration::from_secs(4),
            |d| pauses.push(d),
            || -> anyhow::Result<()> {
                attempts += 1;
                Err(if attempts % 2 == 1 {
                    unavailable()
                } else {
                    Unreachable("cannot connect to 127.0.0.1:1".into()).into()
                })
            },
        )
        .expect_err("no leader");
        assert_eq!(err.code, exit::UNAVAILABLE);
        assert_eq!(pauses.len(), 6, "{pauses:?}");
        assert_eq!(attempts, 7);
        assert!(
            err.message
                .starts_with("no leader answered within 4s (--wait): "),
            "{}",
            err.message
        );
        assert!(
            err.message.contains("no leader is known yet"),
            "{}",
            err.message
        );

        // `--wait 0s`: one attempt.
        let mut attempts = 0;
        let err = with_retries(
            Duration::ZERO,
            |_| panic!("no pause without a wait"),
            || -> anyhow::Result<()> {
                attempts += 1;
                Err(NoLeader.into())
            },
        )
        .expect_err("no leader");
        assert_eq!((attempts, err.code), (1, exit::UNAVAILABLE));
        assert!(err.message.contains("know no leader"), "{}", err.message);

        // A real answer is not retried.
        let mut attempts = 0;
        let err = with_retries(
            Duration::from_secs(10),
            |_| panic!("a final answer is not retried"),
            || -> anyhow::Result<()> {
                attempts += 1;
                Err(HttpStatus {
                    status: 400,
                    body: String::new(),
                }
                .into())
            },
        )
        .expect_err("refused");
        assert_eq!((attempts, err.code), (1, exit::USAGE));
    }

    #[test]
    fn failures_get_the_client_exit_codes() {
        let status = |status: u16| -> anyhow::Error {
            HttpStatus {
                status,
                body: String::new(),
            }
            .into()
        };
        assert_eq!(failure(status(403)).code, exit::NO_PERMISSION);
        assert_eq!(failure(status(401)).code, exit::NO_PERMISSION);
        assert_eq!(failure(status(503)).code, exit::UNAVAILABLE);
        assert_eq!(failure(status(400)).code, exit::USAGE);
        assert_eq!(failure(status(404)).code, exit::FAILURE);
        let unreachable = anyhow::Error::from(Unreachable("no".into()));
        assert_eq!(failure(unreachable).code, exit::UNAVAILABLE);
    }
}
