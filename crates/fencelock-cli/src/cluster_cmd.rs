//! `fencelock cluster status|add|remove|transfer-leader`: an admin looks at and
//! changes a cluster's membership over the HTTP API (`/v1/cluster`). Requests that
//! change the cluster go to the leader: `--server` may list every member, and a
//! member that is not the leader names it (see `http_get`).

use std::process::ExitCode;

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

/// Flags of `fencelock cluster status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Server(s), admin token, CA certificate, `--json`.
    #[command(flatten)]
    pub connection: Connection,
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
}

/// Flags of `fencelock cluster remove`.
#[derive(Debug, Args)]
pub struct RemoveArgs {
    /// The member's node id.
    pub id: u64,
    /// Server(s), admin token, CA certificate, `--json`.
    #[command(flatten)]
    pub connection: Connection,
}

/// Flags of `fencelock cluster transfer-leader`.
#[derive(Debug, Args)]
pub struct TransferArgs {
    /// The node id of the member to lead.
    pub id: u64,
    /// Server(s), admin token, CA certificate, `--json`.
    #[command(flatten)]
    pub connection: Connection,
}

/// Runs the command; exit codes as the other client commands (69 unreachable, 77
/// not allowed, 2 refused as malformed, 1 otherwise).
pub fn run(cmd: ClusterCmd) -> ExitCode {
    remote::finish(execute(cmd))
}

fn execute(cmd: ClusterCmd) -> Result<(), Failure> {
    match cmd {
        ClusterCmd::Status(args) => {
            let body = call(&args.connection, "GET", "/v1/cluster", None)?;
            print_cluster(&args.connection, &body)
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
                "POST",
                "/v1/cluster/members",
                Some(&request),
            )?;
            print_cluster(&args.connection, &body)
        }
        ClusterCmd::Remove(args) => {
            let path = format!("/v1/cluster/members/{}", args.id);
            let body = call(&args.connection, "DELETE", &path, None)?;
            print_cluster(&args.connection, &body)
        }
        ClusterCmd::TransferLeader(args) => {
            let request = json!({"id": args.id});
            let path = "/v1/cluster/transfer-leader";
            let body = call(&args.connection, "POST", path, Some(&request))?;
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

/// One request to the cluster, its JSON answer or a failure with its exit code.
fn call(c: &Connection, method: &str, path: &str, body: Option<&Value>) -> Result<Value, Failure> {
    let body = body.map(|b| b.to_string().into_bytes());
    let answer = http_get::send(
        method,
        &c.server,
        path,
        c.token.as_deref(),
        c.ca_cert.as_deref(),
        body.as_deref(),
    )
    .map_err(failure)?;
    serde_json::from_slice(&answer).map_err(|e| Failure {
        message: format!("the server sent invalid JSON: {e}"),
        code: exit::FAILURE,
    })
}

/// The exit code and message of a failed request.
fn failure(e: anyhow::Error) -> Failure {
    let code = if e.downcast_ref::<Unreachable>().is_some() {
        exit::UNAVAILABLE
    } else {
        match e.downcast_ref::<HttpStatus>().map(|s| s.status) {
            Some(401 | 403) => exit::NO_PERMISSION,
            Some(503) => exit::UNAVAILABLE,
            Some(400) => exit::USAGE,
            _ => exit::FAILURE,
        }
    };
    Failure {
        message: format!("{e:#}"),
        code,
    }
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
