//! `fencelock elect` and `fencelock leader` as a user runs them: the real binary
//! against a real `fencelock serve`, and the scheduler example
//! (examples/scheduler) failing over under `fencelock elect`.

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;
use tokio::time::timeout;

const BIN: &str = env!("CARGO_BIN_EXE_fencelock");
/// Longest any step may take before the test fails instead of hanging.
const STEP: Duration = Duration::from_secs(30);

/// `fencelock serve` on a fresh data directory, once it serves.
struct Serve {
    _child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Serve {
    async fn start() -> Serve {
        let dir = tempfile::tempdir().unwrap();
        let mut child = Command::new(BIN)
            .args(["serve", "--listen", "127.0.0.1:0", "--log-format", "json"])
            .arg("--data-dir")
            .arg(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut log = lines(child.stderr.take().unwrap());
        let listen = timeout(STEP, async {
            loop {
                let line = log.recv().await.expect("server exited before serving");
                let v: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
                if let Some(listen) = v.get("listen").and_then(Value::as_str) {
                    return listen.to_owned();
                }
            }
        })
        .await
        .expect("server serves in time");
        // Keep draining its log so it never blocks on a full pipe.
        tokio::spawn(async move { while log.recv().await.is_some() {} });
        Serve {
            _child: child,
            url: format!("http://{listen}"),
            _dir: dir,
        }
    }

    fn cli(&self) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.env("FENCELOCK_SERVER", &self.url)
            .env_remove("FENCELOCK_TOKEN")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        cmd
    }
}

/// The lines of a child's output, as they come.
fn lines(
    out: impl tokio::io::AsyncRead + Unpin + Send + 'static,
) -> mpsc::UnboundedReceiver<String> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut lines = BufReader::new(out).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// The next line that satisfies `want`, within [`STEP`].
async fn line_where(
    rx: &mut mpsc::UnboundedReceiver<String>,
    what: &str,
    want: impl Fn(&str) -> bool,
) -> String {
    timeout(STEP, async {
        loop {
            match rx.recv().await {
                Some(line) if want(&line) => return line,
                Some(_) => {}
                None => panic!("output ended before {what}"),
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no {what} within {STEP:?}"))
}

async fn finish(cmd: &mut Command) -> Output {
    timeout(STEP, cmd.output())
        .await
        .expect("command finishes in time")
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Ends an `elect` with SIGTERM, which it forwards to its command.
async fn stop(elect: &mut Child) {
    // SAFETY: kill(2) on the test's own child; no memory is touched.
    unsafe {
        libc::kill(elect.id().unwrap() as i32, libc::SIGTERM);
    }
    timeout(STEP, elect.wait()).await.unwrap().unwrap();
}

fn scheduler() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/scheduler/scheduler.sh")
}

/// The term of `fencelock elect --json`'s `leading` line.
fn leading_term(line: &str) -> u64 {
    let v: Value = serde_json::from_str(line).unwrap();
    v["leading"]["term"].as_u64().unwrap()
}

fn is_leading(line: &str) -> bool {
    line.contains("\"leading\"")
}

/// One replica of the scheduler under `fencelock elect`, its outputs read as lines.
struct Replica {
    child: Child,
    stdout: mpsc::UnboundedReceiver<String>,
    stderr: mpsc::UnboundedReceiver<String>,
}

impl Replica {
    fn start(serve: &Serve, ttl: &str, value: &str, state: &Path, jobs: u32) -> Replica {
        let mut child = serve
            .cli()
            .args(["elect", "sched", value, "--ttl", ttl, "--json", "--"])
            .arg(scheduler())
            .arg("run")
            .arg(state)
            .arg(jobs.to_string())
            .env("SCHEDULER_JOB_SECONDS", "0.2")
            .spawn()
            .unwrap();
        let stdout = lines(child.stdout.take().unwrap());
        let stderr = lines(child.stderr.take().unwrap());
        Replica {
            child,
            stdout,
            stderr,
        }
    }
}

/// The events of the scheduler's state directory: `lead TERM VALUE PID` and
/// `commit JOB TERM VALUE`, in the order they happened.
fn events(state: &Path) -> Vec<Vec<String>> {
    std::fs::read_to_string(state.join("events"))
        .unwrap_or_default()
        .lines()
        .map(|l| l.split_whitespace().map(str::to_owned).collect())
        .collect()
}

/// Checks a scheduler's event log: jobs `1..=jobs` committed exactly once each, in
/// order, each by the leader of the latest `lead` before it, and terms only rising.
fn check_events(events: &[Vec<String>], jobs: u32) -> Result<(), String> {
    let mut term = 0u64;
    let mut next_job = 1u32;
    for e in events {
        let field = |i: usize| e.get(i).cloned().unwrap_or_default();
        match field(0).as_str() {
            "lead" => {
                let t: u64 = field(1).parse().map_err(|_| format!("bad event {e:?}"))?;
                if t <= term {
                    return Err(format!("term {t} after term {term}"));
                }
                term = t;
            }
            "commit" => {
                let job: u32 = field(1).parse().map_err(|_| format!("bad event {e:?}"))?;
                let t: u64 = field(2).parse().map_err(|_| format!("bad event {e:?}"))?;
                if job != next_job {
                    return Err(format!("job {job} committed where job {next_job} was due"));
                }
                if t != term {
                    return Err(format!(
                        "job {job} committed at term {t}, leader's is {term}"
                    ));
                }
                next_job += 1;
            }
            _ => return Err(format!("unknown event {e:?}")),
        }
    }
    if next_job != jobs + 1 {
        return Err(format!("{} of {jobs} jobs committed", next_job - 1));
    }
    Ok(())
}

#[test]
fn the_event_checker_catches_a_twice_run_job_a_lost_job_and_a_stale_term() {
    let ev = |s: &str| -> Vec<Vec<String>> {
        s.lines()
            .map(|l| l.split_whitespace().map(str::to_owned).collect())
            .collect()
    };
    let good = "lead 3 a 1\ncommit 1 3 a\nlead 9 b 2\ncommit 2 9 b";
    assert_eq!(check_events(&ev(good), 2), Ok(()));
    let twice = "lead 3 a 1\ncommit 1 3 a\nlead 9 b 2\ncommit 1 9 b\ncommit 2 9 b";
    assert!(check_events(&ev(twice), 2).is_err());
    let lost = "lead 3 a 1\ncommit 1 3 a\nlead 9 b 2";
    assert!(check_events(&ev(lost), 2).is_err());
    let stale = "lead 3 a 1\ncommit 1 3 a\nlead 9 b 2\ncommit 2 3 a";
    assert!(check_events(&ev(stale), 2).is_err());
    let backwards = "lead 9 a 1\ncommit 1 9 a\nlead 3 b 2\ncommit 2 3 b";
    assert!(check_events(&ev(backwards), 2).is_err());
}

/// The leader replica is killed (SIGKILL to `fencelock elect` and to its command's
/// process group); the follower leads within about one TTL, runs the remaining jobs,
/// and the old leader's term can no longer write.
#[tokio::test]
async fn scheduler_fails_over_after_kill_9_every_job_runs_once_and_old_term_is_fenced() {
    const JOBS: u32 = 12;
    const TTL: Duration = Duration::from_secs(2);
    let serve = Serve::start().await;
    let state_dir = tempfile::tempdir().unwrap();
    let state = state_dir.path();

    let mut a = Replica::start(&serve, "2s", "replica-a", state, JOBS);
    let a_line = line_where(&mut a.stderr, "replica a leading", is_leading).await;
    let a_term = leading_term(&a_line);
    // B campaigns only once A leads, so A is the first leader.
    let mut b = Replica::start(&serve, "2s", "replica-b", state, JOBS);
    for _ in 0..3 {
        line_where(&mut a.stdout, "a commit by replica a", |l| {
            l.starts_with("committed job")
        })
        .await;
    }
    let pid = events(state)
        .iter()
        .find(|e| e[0] == "lead" && e[2] == "replica-a")
        .map(|e| e[3].parse::<i32>().unwrap())
        .expect("replica a logged its start");
    // SAFETY: kill(2) on the test's own children; no memory is touched.
    unsafe {
        assert_eq!(libc::kill(a.child.id().unwrap() as i32, libc::SIGKILL), 0);
        assert_eq!(libc::kill(-pid, libc::SIGKILL), 0);
    }
    let killed = Instant::now();
    a.child.wait().await.unwrap();
    let committed_by_a = events(state).iter().filter(|e| e[0] == "commit").count();

    let b_line = line_where(&mut b.stderr, "replica b leading", is_leading).await;
    let took_over = killed.elapsed();
    let b_term = leading_term(&b_line);
    assert!(b_term > a_term, "term {b_term} after {a_term}");
    // One TTL, plus room for a loaded machine's scheduling.
    assert!(
        took_over < TTL + Duration::from_secs(5),
        "the follower led {took_over:?} after the kill (ttl {TTL:?})"
    );

    let out = timeout(STEP, b.child.wait()).await.unwrap().unwrap();
    assert_eq!(out.code(), Some(0));
    let log = events(state);
    check_events(&log, JOBS).unwrap_or_else(|e| panic!("{e}: {log:?}"));
    let leads: Vec<&str> = log
        .iter()
        .filter(|e| e[0] == "lead")
        .map(|e| e[2].as_str())
        .collect();
    assert_eq!(leads, ["replica-a", "replica-b"]);
    let by_a = log
        .iter()
        .filter(|e| e[0] == "commit" && e[3] == "replica-a")
        .count();
    assert_eq!(by_a, committed_by_a, "replica a wrote after it was killed");
    assert!(by_a >= 3 && by_a < JOBS as usize, "{log:?}");

    // A write with the old leader's term, after the takeover: refused by the fence.
    let stale = finish(
        Command::new(scheduler())
            .args(["commit"])
            .arg(state)
            .args(["99", &a_term.to_string()]),
    )
    .await;
    assert_eq!(stale.status.code(), Some(3), "{}", text(&stale.stderr));
    assert!(text(&stale.stderr).contains("refused"));
    assert!(!state.join("results/99").exists());
    assert_eq!(events(state), log, "a refused write changed the store");
}

#[tokio::test]
async fn elect_exports_the_term_and_value_returns_the_code_and_resigns() {
    let serve = Serve::start().await;
    let out = finish(serve.cli().args([
        "elect",
        "job:env",
        "10.0.0.7:80",
        "--json",
        "--",
        "sh",
        "-c",
        "echo \"$FENCELOCK_ELECTION $FENCELOCK_VALUE $FENCELOCK_TERM $FENCELOCK_FENCE\"; exit 7",
    ]))
    .await;
    assert_eq!(out.status.code(), Some(7), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let words: Vec<&str> = stdout.split_whitespace().collect();
    assert_eq!(words[..2], ["job:env", "10.0.0.7:80"]);
    assert_eq!(words[2], words[3], "FENCELOCK_FENCE is the term");
    let term: u64 = words[2].parse().unwrap();
    let leading = text(&out.stderr);
    assert_eq!(leading_term(leading.lines().next().unwrap()), term);
    // Resigned: nobody leads.
    let after = finish(serve.cli().args(["leader", "job:env"])).await;
    assert_eq!(after.status.code(), Some(1), "{}", text(&after.stderr));
    assert!(text(&after.stdout).contains("no leader"));
}

#[tokio::test]
async fn a_second_candidate_waits_and_gives_up_after_wait_with_124() {
    let serve = Serve::start().await;
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("ran");
    let mut first = serve
        .cli()
        .args(["elect", "busy", "one", "--json", "--", "sleep", "60"])
        .spawn()
        .unwrap();
    let mut first_err = lines(first.stderr.take().unwrap());
    line_where(&mut first_err, "the first leading", is_leading).await;
    let out = finish(serve.cli().args([
        "elect",
        "busy",
        "two",
        "--wait",
        "300ms",
        "--",
        "touch",
        marker.to_str().unwrap(),
    ]))
    .await;
    assert_eq!(out.status.code(), Some(124), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("\"one\""),
        "{}",
        text(&out.stderr)
    );
    assert!(!marker.exists(), "a follower ran the command");
    stop(&mut first).await;
}

#[tokio::test]
async fn leader_prints_none_then_the_leader_and_watch_sees_a_takeover() {
    let serve = Serve::start().await;
    let none = finish(serve.cli().args(["leader", "svc"])).await;
    assert_eq!(none.status.code(), Some(1));
    assert!(text(&none.stdout).contains("no leader"));
    let none_json = finish(serve.cli().args(["leader", "svc", "--json"])).await;
    assert_eq!(none_json.status.code(), Some(1));
    let v: Value = serde_json::from_slice(&none_json.stdout).unwrap();
    assert!(v["leader"].is_null(), "{v}");

    let mut watch = serve
        .cli()
        .args(["leader", "svc", "--watch", "--json"])
        .spawn()
        .unwrap();
    let mut seen = lines(watch.stdout.take().unwrap());
    let first: Value =
        serde_json::from_str(&line_where(&mut seen, "the first state", |_| true).await).unwrap();
    assert!(first["leader"].is_null(), "{first}");
    assert!(humantime::parse_rfc3339(first["at"].as_str().unwrap()).is_ok());

    let mut one = serve
        .cli()
        .args(["elect", "svc", "addr-1", "--ttl", "1s", "--json", "--"])
        .args(["sh", "-c", "echo $$; exec sleep 60"])
        .spawn()
        .unwrap();
    let mut one_out = lines(one.stdout.take().unwrap());
    let mut one_err = lines(one.stderr.take().unwrap());
    let one_group: i32 = line_where(&mut one_out, "addr-1's command", |_| true)
        .await
        .parse()
        .unwrap();
    let one_term = leading_term(&line_where(&mut one_err, "addr-1 leading", is_leading).await);

    let shown = finish(serve.cli().args(["leader", "svc", "--json"])).await;
    assert_eq!(shown.status.code(), Some(0), "{}", text(&shown.stderr));
    let v: Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(v["leader"]["value"], "addr-1");
    assert_eq!(v["leader"]["term"], one_term);
    let plain = finish(serve.cli().args(["leader", "svc"])).await;
    assert!(
        text(&plain.stdout).contains("addr-1"),
        "{}",
        text(&plain.stdout)
    );

    let led: Value = serde_json::from_str(
        &line_where(&mut seen, "addr-1 in the watch", |l| l.contains("addr-1")).await,
    )
    .unwrap();
    assert_eq!(led["leader"]["term"], one_term);

    let mut two = serve
        .cli()
        .args(["elect", "svc", "addr-2", "--json", "--", "sleep", "60"])
        .spawn()
        .unwrap();
    // Dies without resigning: addr-2 takes over once the 1 s lease runs out.
    one.kill().await.unwrap();
    // SAFETY: kill(2) on the process group of the test's own grandchild.
    unsafe {
        libc::kill(-one_group, libc::SIGKILL);
    }
    let took: Value = serde_json::from_str(
        &line_where(&mut seen, "addr-2 in the watch", |l| l.contains("addr-2")).await,
    )
    .unwrap();
    assert!(
        took["leader"]["term"].as_u64().unwrap() > one_term,
        "{took}"
    );
    stop(&mut two).await;
    watch.kill().await.unwrap();
}

#[tokio::test]
async fn bad_input_is_a_usage_error_naming_the_argument() {
    let serve = Serve::start().await;
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("ran");
    let long = "v".repeat(fencelock::MAX_VALUE_BYTES + 1);
    for (args, arg) in [
        (vec!["elect", "", "v"], "NAME"),
        (vec!["elect", "e", long.as_str()], "VALUE"),
    ] {
        let out = finish(
            serve
                .cli()
                .args(&args)
                .args(["--", "touch", marker.to_str().unwrap()]),
        )
        .await;
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert!(
            text(&out.stderr).contains(arg),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert!(!marker.exists(), "{args:?} ran the command");
    }
    let out = finish(serve.cli().args(["leader", ""])).await;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("NAME"));
    let json = finish(serve.cli().args(["leader", "", "--json"])).await;
    let v: Value = serde_json::from_slice(&json.stderr).unwrap();
    assert_eq!(v["error"]["code"], "usage");
}

/// An operator takes the election from the leader: the command is stopped and
/// `elect` exits 75, as `run` does for a lost lock.
#[tokio::test]
async fn lost_leadership_stops_the_command_and_exits_75() {
    let serve = Serve::start().await;
    // The command is one process (exec), the leader of its own process group.
    let script = "echo $$; exec sleep 20";
    let mut elect = serve
        .cli()
        .args([
            "elect", "lost:1", "v", "--ttl", "1s", "--json", "--", "sh", "-c", script,
        ])
        .spawn()
        .unwrap();
    let mut out = lines(elect.stdout.take().unwrap());
    let mut err = lines(elect.stderr.take().unwrap());
    let pgid: i32 = line_where(&mut out, "the command's pid", |_| true)
        .await
        .parse()
        .unwrap();
    let taken = finish(
        serve
            .cli()
            .args(["force-release", "lost:1", "--reason", "test"]),
    )
    .await;
    assert_eq!(taken.status.code(), Some(0), "{}", text(&taken.stderr));
    let status = timeout(STEP, elect.wait()).await.unwrap().unwrap();
    assert_eq!(status.code(), Some(75));
    let lost = line_where(&mut err, "the lost-leadership message", |l| {
        l.contains("lock_lost")
    })
    .await;
    assert!(lost.contains("stopping the command"), "{lost}");
    // SAFETY: kill(2) with signal 0 only asks whether the group exists.
    let alive = unsafe { libc::kill(-pgid, 0) };
    assert_eq!(alive, -1, "the command outlived the leadership");
    let after = finish(serve.cli().args(["leader", "lost:1"])).await;
    assert_eq!(after.status.code(), Some(1), "{}", text(&after.stdout));
}
