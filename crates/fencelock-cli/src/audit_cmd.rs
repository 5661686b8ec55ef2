//! `fencelock audit`: query a running server's audit log (`GET /v1/audit`).

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::Value;

use crate::http_get;
use crate::remote::{self, Connection};

/// Flags of `fencelock audit`.
#[derive(Debug, Args)]
pub struct AuditArgs {
    /// Server, token (at least the reader role), CA certificate, `--json` (the
    /// server's JSON instead of a table).
    #[command(flatten)]
    pub connection: Connection,
    /// Only entries about this lock.
    #[arg(long)]
    pub lock: Option<String>,
    /// Only entries from this long ago until now, e.g. `90s`, `15m`, `1h`, `7d`.
    #[arg(long, value_parser = remote::parse_duration)]
    pub since: Option<Duration>,
    /// At most this many entries (the newest; 1..=1000).
    #[arg(long, default_value_t = 100)]
    pub limit: usize,
}

/// Runs the command.
pub fn run(args: AuditArgs) -> Result<ExitCode> {
    let mut query = format!("/v1/audit?limit={}", args.limit);
    if let Some(lock) = &args.lock {
        query.push_str(&format!("&lock={}", http_get::pct(lock)));
    }
    if let Some(age) = args.since {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .context("the system clock is before 1970")?;
        let since = now.saturating_sub(age).as_millis();
        query.push_str(&format!("&since_ms={since}"));
    }
    let body = http_get::get_as(
        &args.connection.server,
        &query,
        args.connection.token.as_deref(),
        args.connection.ca_cert.as_deref(),
    )
    .with_context(|| format!("cannot query the audit log of {}", args.connection.server))?;
    if args.connection.json {
        println!("{}", String::from_utf8_lossy(&body).trim_end());
        return Ok(ExitCode::SUCCESS);
    }
    let v: Value = serde_json::from_slice(&body).context("the server sent invalid JSON")?;
    let Some(entries) = v["entries"].as_array() else {
        bail!("the server's answer has no entries: {v}");
    };
    print!("{}", table(entries));
    Ok(ExitCode::SUCCESS)
}

/// The human-readable table, one entry per line, oldest first.
pub fn table(entries: &[Value]) -> String {
    let s = |e: &Value, k: &str| e[k].as_str().unwrap_or("").to_owned();
    let rows: Vec<[String; 6]> = entries
        .iter()
        .map(|e| {
            let mut detail = Vec::new();
            if let Some(r) = e["reason"].as_str() {
                detail.push(format!("reason={r:?}"));
            }
            if let Some(a) = e["actor"].as_str() {
                detail.push(format!("actor={a}"));
            }
            if let Some(d) = e["detail"].as_str() {
                detail.push(d.to_owned());
            }
            if let Some(r) = e["request_id"].as_str() {
                detail.push(format!("request_id={r}"));
            }
            if let Some(sess) = e["session"].as_str() {
                detail.push(format!("session={sess}"));
            }
            if let Some(ms) = e["duration_ms"].as_u64().filter(|ms| *ms > 0) {
                detail.push(format!("{ms}ms"));
            }
            [
                s(e, "time")
                    .replace('T', " ")
                    .trim_end_matches('Z')
                    .to_owned(),
                s(e, "kind"),
                s(e, "lock"),
                e["fence"]
                    .as_u64()
                    .map(|f| f.to_string())
                    .unwrap_or_default(),
                s(e, "owner"),
                detail.join(" "),
            ]
        })
        .collect();
    let head = ["TIME (UTC)", "KIND", "LOCK", "FENCE", "OWNER", "DETAIL"];
    let mut widths = head.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: [&str; 6]| {
        let mut l = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            if i == 5 {
                l.push_str(cell);
            } else {
                l.push_str(&format!("{cell:<w$}  "));
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(head);
    for row in &rows {
        line([&row[0], &row[1], &row[2], &row[3], &row[4], &row[5]]);
    }
    if rows.is_empty() {
        out.push_str("(no entries)\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_lines_up_and_shows_details() {
        let entries: Vec<Value> = serde_json::from_str(
            r#"[{"time":"2026-12-02T14:00:00.000Z","kind":"grant","lock":"a","fence":1,"owner":"w1","duration_ms":0},
                {"time":"2026-12-02T14:00:01.000Z","kind":"forced_release","lock":"a","fence":1,"owner":"w1","actor":"ops","reason":"stuck","duration_ms":1000}]"#,
        )
        .unwrap();
        let t = table(&entries);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3, "{t}");
        assert!(lines[0].starts_with("TIME (UTC)"));
        assert!(lines[2].contains("forced_release"));
        assert!(
            lines[2].ends_with("reason=\"stuck\" actor=ops 1000ms"),
            "{t}"
        );
        let kind_col = lines[0].find("KIND").unwrap();
        assert_eq!(lines[1].find("grant"), Some(kind_col));
        assert!(table(&[]).contains("(no entries)"));
    }
}
