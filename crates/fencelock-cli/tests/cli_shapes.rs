//! What the CLI shows, pinned: every command's `--help` and the JSON shapes it
//! prints (insta snapshots in `tests/snapshots/`; review a change with
//! `cargo insta review` or `INSTA_UPDATE=always`), shell completions and the man page
//! naming every command, the exit-code table, and `backup`'s and `audit`'s flags.
//!
//! Run: `cargo test -p fencelock-cli --test it cli_shapes::`

use crate::support;

use std::ffi::OsStr;
use std::path::Path;
use std::process::{Child, Command, Output};

use serde_json::{Map, Value};

/// `fencelock ARGS…` with an empty environment (no `FENCELOCK_*` shown in help
/// or used as defaults), its output.
fn fencelock(args: &[&str]) -> Output {
    Command::new(support::BIN)
        .args(args)
        .env_clear()
        .output()
        .expect("run fencelock")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The names under the "Commands:" heading of a help text.
fn commands_in(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| *l != "Commands:")
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| *name != "help" || !help.contains("Print this message"))
        .map(str::to_owned)
        .collect()
}

/// Every command path (`["run"]`, `["cluster", "add"]`, …), found through the help
/// texts themselves.
fn command_paths() -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    let mut pending: Vec<Vec<String>> = vec![vec![]];
    while let Some(path) = pending.pop() {
        let mut args: Vec<&str> = path.iter().map(String::as_str).collect();
        args.push("--help");
        let help = stdout(&fencelock(&args));
        for name in commands_in(&help) {
            let mut sub = path.clone();
            sub.push(name);
            pending.push(sub);
        }
        paths.push(path);
    }
    paths.sort();
    paths
}

#[test]
fn every_help_text_is_pinned() {
    let paths = command_paths();
    // The enumeration itself is checked: it found the nested commands.
    for expected in [
        &["run"][..],
        &["cluster", "transfer-leader"],
        &["sessions", "close"],
    ] {
        assert!(
            paths.iter().any(|p| p == expected),
            "{expected:?} not in {paths:?}"
        );
    }
    for path in &paths {
        let mut args: Vec<&str> = path.iter().map(String::as_str).collect();
        args.push("--help");
        let out = fencelock(&args);
        assert!(out.status.success(), "{args:?}: {out:?}");
        let name = if path.is_empty() {
            "help".to_owned()
        } else {
            format!("help_{}", path.join("_"))
        };
        insta::assert_snapshot!(name, stdout(&out));
    }
    // The deprecated spelling works but is not advertised.
    let run_help = stdout(&fencelock(&["run", "--help"]));
    assert!(!run_help.contains("--lock"), "{run_help}");
}

#[test]
fn completions_and_the_man_page_name_every_command() {
    let top: Vec<String> = command_paths()
        .into_iter()
        .filter(|p| p.len() == 1)
        .map(|p| p[0].clone())
        .collect();
    assert!(top.len() >= 18, "{top:?}");
    let nested = ["transfer-leader", "status", "close"];
    for shell in ["bash", "zsh", "fish"] {
        let out = fencelock(&["completions", shell]);
        assert!(out.status.success(), "{shell}: {out:?}");
        let script = stdout(&out);
        for name in top.iter().map(String::as_str).chain(nested) {
            assert!(script.contains(name), "{shell} completions lack {name}");
        }
        assert!(script.contains("ttl") && script.contains("json"), "{shell}");
    }
    let out = fencelock(&["man"]);
    assert!(out.status.success(), "{out:?}");
    let page = stdout(&out);
    assert!(
        page.starts_with(".ie") || page.contains(".TH fencelock 1"),
        "{page}"
    );
    for name in &top {
        // roff escapes the dash.
        let entry = format!("fencelock\\-{}(1)", name.replace('-', "\\-"));
        assert!(page.contains(&entry), "the man page lacks {entry}");
        let sub = fencelock(&["man", name]);
        assert!(sub.status.success(), "man {name}: {sub:?}");
        assert!(stdout(&sub).contains(".SH \"EXIT STATUS\""), "man {name}");
    }
    assert!(page.contains(".SH \"EXIT STATUS\""), "{page}");
    assert!(page.contains("\\fB124\\fR (not_acquired)"), "{page}");
    assert_eq!(fencelock(&["man", "nope"]).status.code(), Some(2));
}

#[test]
fn help_exit_codes_lists_every_code() {
    let out = fencelock(&["help", "exit-codes"]);
    assert!(out.status.success(), "{out:?}");
    let text = stdout(&out);
    for (code, name) in [
        (0, "ok"),
        (1, "failure"),
        (2, "usage"),
        (65, "corrupt_data"),
        (69, "unavailable"),
        (71, "cannot_listen"),
        (73, "cannot_create"),
        (74, "storage_io"),
        (75, "lock_lost"),
        (77, "not_permitted"),
        (124, "not_acquired"),
        (126, "cannot_execute"),
        (127, "command_not_found"),
    ] {
        assert!(
            text.lines()
                .any(|l| l.trim_start().starts_with(&format!("{code}  {name} "))),
            "{code} {name} missing: {text}"
        );
    }
    // `help COMMAND` is the command's help; an unknown topic is a usage error.
    assert_eq!(
        stdout(&fencelock(&["help", "cluster", "add"])),
        stdout(&fencelock(&["cluster", "add", "--help"]))
    );
    assert_eq!(fencelock(&["help", "nope"]).status.code(), Some(2));
}

/// A JSON value's shape: keys and types, with the values that are part of the
/// contract (`code`, `kind`, `exit_code`) kept.
fn shape(v: &Value, key: &str) -> Value {
    match v {
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| (k.clone(), shape(v, k)))
                .collect::<Map<_, _>>(),
        ),
        Value::Array(items) => {
            Value::Array(items.first().map(|v| shape(v, key)).into_iter().collect())
        }
        Value::String(s) if key == "code" || key == "kind" => Value::String(s.clone()),
        Value::Number(n) if key == "exit_code" => Value::Number(n.clone()),
        Value::String(_) => "<string>".into(),
        Value::Number(_) => "<number>".into(),
        Value::Bool(_) => "<bool>".into(),
        Value::Null => Value::Null,
    }
}

struct Server {
    child: Child,
    url: String,
    dir: tempfile::TempDir,
}

impl Server {
    fn start() -> Server {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let (child, addr) = support::serve([OsStr::new("--data-dir"), data.as_os_str()]);
        Server {
            child,
            url: format!("http://{addr}"),
            dir,
        }
    }

    fn run(&self, args: &[&str]) -> Output {
        let mut all = args.to_vec();
        all.extend(["--server", &self.url]);
        fencelock(&all)
    }

    /// `ARGS… --json`: its one JSON document (stdout, or stderr for a failure).
    fn json(&self, args: &[&str]) -> Value {
        let mut all = args.to_vec();
        all.push("--json");
        let out = self.run(&all);
        let text = if out.stdout.is_empty() {
            &out.stderr
        } else {
            &out.stdout
        };
        serde_json::from_slice(text).unwrap_or_else(|e| panic!("{args:?}: {e}: {out:?}"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn json_shapes_are_pinned() {
    let server = Server::start();
    let grant = server.json(&["acquire", "shape:a", "--owner", "w-1"]);
    let token = grant["owner_token"].as_str().unwrap().to_owned();
    let mut shapes = Vec::new();
    let mut pin = |what: &str, v: &Value| shapes.push(format!("{what}: {}", shape(v, "")));
    pin("acquire", &grant);
    pin(
        "renew",
        &server.json(&["renew", "shape:a", "--owner-token", &token]),
    );
    pin("ls", &server.json(&["ls", "--prefix", "shape:"]));
    let show = server.json(&["show", "shape:a"]);
    pin("show", &show);
    // Wall-clock times are RFC 3339.
    for time in [
        &grant["expires_at"],
        &show["holders"][0]["held_since"],
        &show["holders"][0]["expires_at"],
    ] {
        let text = time.as_str().unwrap_or_default();
        assert!(humantime::parse_rfc3339(text).is_ok(), "{time}");
    }
    pin(
        "error (not acquired)",
        &server.json(&["acquire", "shape:a"]),
    );
    pin(
        "error (bad flag)",
        &server.json(&["acquire", "x", "--ttl", "5ms"]),
    );
    pin(
        "release",
        &server.json(&["release", "shape:a", "--owner-token", &token]),
    );
    server.json(&["acquire", "shape:b"]);
    pin(
        "force-release",
        &server.json(&["force-release", "shape:b", "--reason", "test"]),
    );
    pin("audit", &server.json(&["audit", "shape:b"]));
    let backup = server.dir.path().join("backup.flsnap");
    let backup = backup.to_str().unwrap();
    pin("backup", &server.json(&["backup", "--out", backup]));
    pin("sessions ls", &server.json(&["sessions", "ls"]));
    insta::assert_snapshot!("json_shapes", shapes.join("\n"));
}

#[test]
fn backup_refuses_to_overwrite_unless_forced_and_fails_like_the_others() {
    let server = Server::start();
    let out_path = server.dir.path().join("b.flsnap");
    let out = out_path.to_str().unwrap();
    std::fs::write(&out_path, b"precious").unwrap();
    let refused = server.run(&["backup", "--out", out]);
    assert_eq!(refused.status.code(), Some(73), "{refused:?}");
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--force"));
    assert_eq!(std::fs::read(&out_path).unwrap(), b"precious");

    let forced = server.run(&["backup", "--out", out, "--force"]);
    assert!(forced.status.success(), "{forced:?}");
    assert_ne!(std::fs::read(&out_path).unwrap(), b"precious");
    assert!(stdout(&forced).contains("backup written to"));

    let fresh = server.dir.path().join("fresh.flsnap");
    let made = server.run(&["backup", "--out", fresh.to_str().unwrap(), "--json"]);
    assert!(made.status.success(), "{made:?}");
    let v: Value = serde_json::from_slice(&made.stdout).unwrap();
    assert_eq!(v["path"], fresh.to_str().unwrap());
    assert_eq!(
        v["bytes"].as_u64(),
        Some(std::fs::metadata(&fresh).unwrap().len())
    );

    // Unreachable: 69, as every client command; nothing is written.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let none = server.dir.path().join("none.flsnap");
    let down = fencelock(&[
        "backup",
        "--server",
        &format!("http://127.0.0.1:{port}"),
        "--out",
        none.to_str().unwrap(),
    ]);
    assert_eq!(down.status.code(), Some(69), "{down:?}");
    assert!(!Path::new(&none).exists());
}

#[test]
fn audit_takes_absolute_and_relative_since_and_until() {
    let server = Server::start();
    for i in 0..6 {
        let out = server.run(&["acquire", &format!("win:{i}")]);
        assert!(out.status.success(), "{out:?}");
    }
    let all = server.json(&["audit", "--since", "1h"]);
    let times: Vec<u64> = all["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["time_ms"].as_u64().unwrap())
        .collect();
    assert_eq!(times.len(), 6, "{all}");
    // An upper bound strictly between two entries' times (each grant was its own
    // process, so the times differ).
    let cut = times[2];
    assert!(cut < times[5], "{times:?}");
    let until = humantime::format_rfc3339_millis(
        std::time::UNIX_EPOCH + std::time::Duration::from_millis(cut),
    )
    .to_string();
    let some = server.json(&["audit", "--since", "2000-01-01", "--until", &until]);
    let kept: Vec<u64> = some["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["time_ms"].as_u64().unwrap())
        .collect();
    let expected: Vec<u64> = times.iter().copied().filter(|t| *t <= cut).collect();
    assert_eq!(kept, expected);
    // Relative --until: nothing is an hour old yet.
    let none = server.json(&["audit", "--until", "1h"]);
    assert_eq!(none["entries"], Value::Array(vec![]), "{none}");
    // The positional lock name, as the other commands; the table's durations for people.
    let one = server.run(&["audit", "win:0"]);
    let table = stdout(&one);
    assert_eq!(table.lines().count(), 2, "{table}");
    let out = server.run(&["audit", "--since", "soon"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("RFC 3339"));
    // --kind takes the event names, and the audit log's old names as aliases.
    let release = server.run(&["force-release", "win:1", "--reason", "test"]);
    assert!(release.status.success(), "{release:?}");
    let kinds = |kind: &str| -> Vec<String> {
        server.json(&["audit", "--kind", kind])["entries"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                format!(
                    "{} {}",
                    e["kind"].as_str().unwrap(),
                    e["lock"].as_str().unwrap()
                )
            })
            .collect()
    };
    assert_eq!(kinds("force_released"), ["force_released win:1"]);
    assert_eq!(
        kinds("forced_release"),
        ["force_released win:1"],
        "old name"
    );
    assert_eq!(kinds("grant").len(), 6, "old name: the six direct grants");
    assert_eq!(kinds("granted,force_released").len(), 7);
    let table = stdout(&server.run(&["audit", "--kind", "forced_release"]));
    assert!(table.contains("force_released  win:1"), "{table}");
    let out = server.run(&["audit", "--kind", "forced_releases"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("force_released"));
}

/// The unit's `Documentation=` names the man page, its header installs that page
/// with `fencelock man`, and that command renders fencelock(1).
#[test]
fn the_systemd_unit_documents_a_page_its_install_steps_install() {
    let unit_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/fencelock.service");
    let unit = std::fs::read_to_string(unit_path).unwrap();
    let docs: Vec<&str> = unit
        .lines()
        .filter_map(|l| l.strip_prefix("Documentation="))
        .collect();
    assert_eq!(docs, ["man:fencelock(1)"], "{unit}");
    assert!(
        unit.contains("#   fencelock man > /usr/local/share/man/man1/fencelock.1"),
        "the install steps must install the page: {unit}"
    );
    let page = stdout(&fencelock(&["man"]));
    assert!(page.contains(".TH fencelock 1 "), "{page}");
}
