//! `fencelock sessions ls` and `fencelock sessions close HANDLE`: an admin lists and
//! closes open sessions (`GET` / `DELETE /v1/admin/sessions`). Sessions are named by
//! their handle (16 hex digits), never by their id, which only the owner knows.

use std::process::ExitCode;

use clap::{Args, Subcommand};
use serde_json::Value;

use crate::exit;
use crate::explain::http_failure;
use crate::http_get::{self, pct};
use crate::remote::{self, Connection, Failure};

/// `fencelock sessions …`.
#[derive(Debug, Subcommand)]
pub enum SessionsCmd {
    /// List the open sessions this admin token may manage: those opened by the
    /// token itself, and those holding or waiting for locks that all lie within its
    /// prefixes (every session, for a token with the prefix "").
    Ls(LsArgs),
    /// Close a session by its handle (its locks are released, its queued requests
    /// end); the audit log names this token.
    Close(CloseArgs),
}

/// Flags of `fencelock sessions ls`.
#[derive(Debug, Args)]
pub struct LsArgs {
    /// Server, admin token, CA certificate, `--json`.
    #[command(flatten)]
    pub connection: Connection,
    /// Only sessions whose locks all start with this prefix.
    #[arg(long, default_value = "")]
    pub prefix: String,
}

/// Flags of `fencelock sessions close`.
#[derive(Debug, Args)]
pub struct CloseArgs {
    /// The session's handle (from `fencelock sessions ls`, lock views or the audit log).
    pub handle: String,
    /// Server, admin token, CA certificate, `--json`.
    #[command(flatten)]
    pub connection: Connection,
}

/// Runs the command; exit codes as the other client commands.
pub fn run(cmd: SessionsCmd) -> ExitCode {
    match cmd {
        SessionsCmd::Ls(args) => remote::finish(ls(&args), args.connection.json),
        SessionsCmd::Close(args) => remote::finish(close(&args), args.connection.json),
    }
}

fn invalid_json(e: impl std::fmt::Display) -> Failure {
    Failure {
        message: format!("the server sent invalid JSON: {e}"),
        code: exit::FAILURE,
    }
}

fn ls(args: &LsArgs) -> Result<(), Failure> {
    let c = &args.connection;
    let path = format!("/v1/admin/sessions?prefix={}", pct(&args.prefix));
    let body = http_get::get_as(&c.server, &path, c.token.as_deref(), c.ca_cert.as_deref())
        .map_err(http_failure)?;
    let v: Value = serde_json::from_slice(&body).map_err(invalid_json)?;
    if c.json {
        println!("{v}");
        return Ok(());
    }
    let Some(sessions) = v["sessions"].as_array() else {
        return Err(invalid_json(format!("no sessions in {v}")));
    };
    print!("{}", table(sessions));
    Ok(())
}

fn close(args: &CloseArgs) -> Result<(), Failure> {
    let c = &args.connection;
    let path = format!("/v1/admin/sessions/{}", pct(&args.handle));
    let body = http_get::request_as(
        "DELETE",
        &c.server,
        &path,
        c.token.as_deref(),
        c.ca_cert.as_deref(),
    )
    .map_err(http_failure)?;
    let v: Value = serde_json::from_slice(&body).map_err(invalid_json)?;
    if c.json {
        println!("{v}");
    } else {
        let released = v["released"].as_u64().unwrap_or(0);
        println!(
            "session {} closed; {released} lock(s) released",
            args.handle
        );
    }
    Ok(())
}

/// One session per line: handle, principal, locks held and waited for, lease left.
fn table(sessions: &[Value]) -> String {
    let mut out = format!(
        "{:<16}  {:<20}  {:>5}  {:>7}  {:>10}  OWNER\n",
        "HANDLE", "PRINCIPAL", "LOCKS", "WAITING", "TTL_LEFT"
    );
    for s in sessions {
        let text = |k: &str| s[k].as_str().unwrap_or("-").to_owned();
        let num = |k: &str| s[k].as_u64().unwrap_or(0);
        out += &format!(
            "{:<16}  {:<20}  {:>5}  {:>7}  {:>10}  {}\n",
            text("handle"),
            text("principal"),
            num("locks"),
            num("waiting"),
            remote::human_ms(num("ttl_remaining_ms")),
            text("owner"),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_lines_up_and_shows_no_id() {
        let sessions = vec![
            serde_json::json!({"handle": "00112233445566ff", "principal": "billing", "owner": "w-1",
                "ttl_ms": 30000, "ttl_remaining_ms": 29000, "locks": 3, "waiting": 1}),
            serde_json::json!({"handle": "ffeeddccbbaa9988", "principal": null, "owner": "",
                "ttl_ms": 10000, "ttl_remaining_ms": 5, "locks": 0, "waiting": 0}),
        ];
        let text = table(&sessions);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(lines[0].starts_with("HANDLE "), "{text}");
        assert!(lines[1].starts_with("00112233445566ff  billing "), "{text}");
        // A session from before principals were recorded shows "-".
        assert!(lines[2].starts_with("ffeeddccbbaa9988  -  "), "{text}");
        // Durations for people, in one format, right-aligned.
        assert!(lines[1].contains("       29s  w-1"), "{text}");
        assert!(lines[2].contains("       5ms  "), "{text}");
    }

    #[test]
    fn prefixes_are_percent_encoded() {
        assert_eq!(pct("a:b/c d"), "a%3Ab%2Fc%20d");
        assert_eq!(pct(""), "");
    }
}
