//! `fencelock audit`: query a running server's audit log (`GET /v1/audit`).

use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Args;
use serde_json::{json, Value};

use crate::exit;
use crate::http_get;
use crate::remote::{self, Connection, Failure};

/// The most entries the server returns for one query.
const MAX_ENTRIES: usize = 1000;

/// Flags of `fencelock audit`.
#[derive(Debug, Args)]
pub struct AuditArgs {
    /// Only entries about this lock.
    #[arg(value_name = "NAME")]
    pub name: Option<String>,
    /// Only entries about this lock (deprecated: give it as the first argument).
    #[arg(long, hide = true, value_name = "NAME", conflicts_with = "name")]
    pub lock: Option<String>,
    /// Only entries from this time on: a time ago (`90s`, `15m`, `1h`, `7d`) or a
    /// wall-clock time in RFC 3339 (`2026-12-02T14:00:00Z`, `2026-12-02T15:00:00+01:00`,
    /// `2026-12-02`).
    #[arg(long, value_parser = parse_when)]
    pub since: Option<When>,
    /// Only entries up to this time (written as for --since).
    #[arg(long, value_parser = parse_when)]
    pub until: Option<When>,
    /// Only entries of these kinds, comma-separated (`granted,force_released`; the
    /// names of `fencelock watch`). The old names `grant`, `handoff`, `release`,
    /// `expiry`, `forced_release`, `session_end`, `downgrade`, `proclaim` still work.
    #[arg(long, value_name = "KIND[,KIND…]", value_parser = parse_kinds)]
    pub kind: Option<String>,
    /// At most this many entries (the newest; 1..=1000).
    #[arg(long, default_value_t = 100)]
    pub limit: usize,
    /// Server, token (at least the reader role), CA certificate; `--json`: the
    /// entries as JSON (`{"entries":[…]}`, times as RFC 3339 `time` and `time_ms`).
    #[command(flatten)]
    pub connection: Connection,
}

/// A point in time given on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    /// This long before now.
    Ago(Duration),
    /// This wall-clock time.
    At(SystemTime),
}

impl When {
    /// Milliseconds since the Unix epoch, with `now` for relative times.
    fn unix_ms(self, now: SystemTime) -> u64 {
        let at = match self {
            When::Ago(d) => now.checked_sub(d).unwrap_or(UNIX_EPOCH),
            When::At(t) => t,
        };
        at.duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }
}

/// A time flag that is neither a duration nor an RFC 3339 time.
#[derive(Debug)]
pub struct BadTime(String);

impl std::fmt::Display for BadTime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} is neither a time ago (e.g. 90s, 15m, 1h, 7d) nor an RFC 3339 time \
             (e.g. 2026-12-02T14:00:00Z, 2026-12-02T15:00:00+01:00, 2026-12-02)",
            self.0
        )
    }
}

impl std::error::Error for BadTime {}

/// Parses `--since`/`--until`: a duration ago, or an RFC 3339 time (`Z` or a
/// `±HH:MM` offset; a date alone is its midnight UTC).
pub fn parse_when(text: &str) -> Result<When, BadTime> {
    let text = text.trim();
    if let Ok(ago) = remote::parse_duration(text) {
        return Ok(When::Ago(ago));
    }
    let bad = || BadTime(text.to_owned());
    if text.len() == 10 {
        return humantime::parse_rfc3339(&format!("{text}T00:00:00Z"))
            .map(When::At)
            .map_err(|_| bad());
    }
    // A numeric offset: the time in UTC is the local time minus the offset.
    let split = text
        .len()
        .checked_sub(6)
        .filter(|i| text.is_char_boundary(*i))
        .map(|i| text.split_at(i));
    let (local, offset) = match split {
        Some((local, off))
            if off.is_ascii()
                && (off.starts_with('+') || off.starts_with('-'))
                && off.as_bytes()[3] == b':' =>
        {
            let hours: u64 = off[1..3].parse().map_err(|_| bad())?;
            let minutes: u64 = off[4..6].parse().map_err(|_| bad())?;
            if hours > 23 || minutes > 59 {
                return Err(bad());
            }
            let secs = Duration::from_secs(hours * 3600 + minutes * 60);
            (format!("{local}Z"), Some((off.starts_with('+'), secs)))
        }
        _ => (text.to_owned(), None),
    };
    let at = humantime::parse_rfc3339(&local.replacen(' ', "T", 1)).map_err(|_| bad())?;
    let at = match offset {
        None => Some(at),
        Some((true, east)) => at.checked_sub(east),
        Some((false, west)) => at.checked_add(west),
    };
    at.map(When::At).ok_or_else(bad)
}

/// Checks `--kind` here, so a misspelt name is a usage error that lists the names.
fn parse_kinds(text: &str) -> Result<String, String> {
    fencelock::vocab::KindFilter::parse_list(text)?;
    Ok(text.split(',').map(str::trim).collect::<Vec<_>>().join(","))
}

/// Runs the command; exit codes as the other client commands.
pub fn run(args: AuditArgs) -> ExitCode {
    let json = args.connection.json;
    remote::finish(query(args), json)
}

fn query(args: AuditArgs) -> Result<(), Failure> {
    if args.lock.is_some() && !args.connection.json {
        eprintln!(
            "fencelock audit: --lock is deprecated; give the lock name as the first argument"
        );
    }
    let now = SystemTime::now();
    let since = args.since.map(|w| w.unix_ms(now));
    let until = args.until.map(|w| w.unix_ms(now));
    if let (Some(since), Some(until)) = (since, until) {
        if since > until {
            return Err(Failure {
                message: "--since is after --until".into(),
                code: exit::USAGE,
            });
        }
    }
    if args.limit == 0 || args.limit > MAX_ENTRIES {
        return Err(Failure {
            message: format!("--limit must be between 1 and {MAX_ENTRIES}"),
            code: exit::USAGE,
        });
    }
    let mut path = format!("/v1/audit?limit={}", args.limit);
    if let Some(lock) = args.name.as_ref().or(args.lock.as_ref()) {
        path.push_str(&format!("&lock={}", http_get::pct(lock)));
    }
    if let Some(since) = since {
        path.push_str(&format!("&since_ms={since}"));
    }
    if let Some(until) = until {
        path.push_str(&format!("&until_ms={until}"));
    }
    if let Some(kind) = &args.kind {
        path.push_str(&format!("&kind={}", http_get::pct(kind)));
    }
    let c = &args.connection;
    let body = http_get::get_as(&c.server, &path, c.token.as_deref(), c.ca_cert.as_deref())
        .map_err(crate::explain::http_failure)?;
    let v: Value = serde_json::from_slice(&body).map_err(|e| Failure {
        message: format!("the server sent invalid JSON: {e}"),
        code: exit::FAILURE,
    })?;
    let Some(entries) = v["entries"].as_array() else {
        return Err(Failure {
            message: format!("the server's answer has no entries: {v}"),
            code: exit::FAILURE,
        });
    };
    if c.json {
        println!("{}", json!({ "entries": entries }));
    } else {
        print!("{}", table(entries));
    }
    Ok(())
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
            if e["handoff"].as_bool() == Some(true) {
                detail.push("handoff".to_owned());
            }
            if let Some(ms) = e["duration_ms"].as_u64().filter(|ms| *ms > 0) {
                detail.push(format!("after={}", remote::human_ms(ms)));
            }
            [
                s(e, "time")
                    .replace('T', " ")
                    .trim_end_matches('Z')
                    .to_owned(),
                s(e, "kind"),
                // `lock`: a server from before the one vocabulary of event fields.
                if e["name"].is_string() {
                    s(e, "name")
                } else {
                    s(e, "lock")
                },
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
            r#"[{"time":"2026-12-02T14:00:00.000Z","kind":"granted","handoff":false,"name":"a","fence":1,"owner":"w1","duration_ms":0},
                {"time":"2026-12-02T14:00:01.000Z","kind":"force_released","name":"a","fence":1,"owner":"w1","actor":"ops","reason":"stuck","duration_ms":108860}]"#,
        )
        .unwrap();
        let t = table(&entries);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3, "{t}");
        assert!(lines[0].starts_with("TIME (UTC)"));
        assert!(lines[2].contains("force_released"));
        assert!(
            lines[2].ends_with("reason=\"stuck\" actor=ops after=1m48s"),
            "{t}"
        );
        let kind_col = lines[0].find("KIND").unwrap();
        assert_eq!(lines[1].find("granted"), Some(kind_col));
        assert!(table(&[]).contains("(no entries)"));
        // A server from before the one vocabulary names the lock `lock`.
        let old: Value = serde_json::from_str(
            r#"{"time":"2026-12-02T14:00:00.000Z","kind":"released","lock":"old-name","duration_ms":0}"#,
        )
        .unwrap();
        assert!(table(&[old]).lines().nth(1).unwrap().contains("old-name"));
    }

    #[test]
    fn kinds_take_the_vocabulary_and_the_old_audit_names() {
        assert_eq!(
            parse_kinds("granted, force_released").unwrap(),
            "granted,force_released"
        );
        assert_eq!(parse_kinds("forced_release").unwrap(), "forced_release");
        let e = parse_kinds("forced_releases").unwrap_err();
        assert!(e.contains("force_released"), "{e}");
    }

    #[test]
    fn times_are_relative_or_rfc_3339() {
        let at = |text: &str| match parse_when(text).unwrap() {
            When::At(t) => t.duration_since(UNIX_EPOCH).unwrap().as_secs(),
            other => panic!("{text}: {other:?}"),
        };
        assert_eq!(
            parse_when("90s").unwrap(),
            When::Ago(Duration::from_secs(90))
        );
        assert_eq!(
            parse_when("7d").unwrap(),
            When::Ago(Duration::from_secs(7 * 86400))
        );
        let utc = at("2026-12-02T14:00:00Z");
        assert_eq!(utc, 1_796_220_000);
        assert_eq!(at("2026-12-02T15:00:00+01:00"), utc);
        assert_eq!(at("2026-12-02T09:30:00-04:30"), utc);
        assert_eq!(at("2026-12-02 14:00:00Z"), utc);
        assert_eq!(at("2026-12-02T14:00:00.250Z"), utc);
        assert_eq!(at("2026-12-02"), utc - 14 * 3600);
        for bad in [
            "soon",
            "2026-13-02",
            "2026-12-02T14:00:00+25:00",
            "",
            "12:00",
            "ééééé",
            "2026-12-02T14:00:00+é:0",
        ] {
            let e = parse_when(bad).expect_err(bad);
            assert!(e.to_string().contains("RFC 3339"), "{e}");
        }
        let now = UNIX_EPOCH + Duration::from_secs(1000);
        assert_eq!(When::Ago(Duration::from_secs(10)).unix_ms(now), 990_000);
        assert_eq!(When::Ago(Duration::from_secs(2000)).unix_ms(now), 0);
    }
}
