//! `fencelock run` and the client subcommands, as a user runs them: the real binary
//! against a real server (started in this test process on 127.0.0.1:0).

use std::path::Path;
use std::process::{Output, Stdio};
use std::time::Duration;

use fencelock::{Client, ErrorKind, FencelockBackend, ServerConfig};
use tokio::process::Command;
use tokio::time::timeout;

/// Longest any step may take before the test fails instead of hanging.
const STEP: Duration = Duration::from_secs(30);

struct TestServer {
    server: fencelock_server::Server,
    _dir: tempfile::TempDir,
}

impl TestServer {
    async fn start() -> TestServer {
        let dir = tempfile::tempdir().unwrap();
        let config = fencelock_server::ServerConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            fencelock_server::EngineConfig::new(dir.path()),
        );
        let server = fencelock_server::Server::start(config).await.unwrap();
        TestServer { server, _dir: dir }
    }

    fn url(&self) -> String {
        format!("http://{}", self.server.local_addr())
    }

    async fn backend(&self) -> FencelockBackend {
        FencelockBackend::connect(ServerConfig::new(self.url()))
            .await
            .unwrap()
    }
}

fn fencelock(server: &str) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_fencelock"));
    cmd.env("FENCELOCK_SERVER", server)
        .env_remove("FENCELOCK_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd
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

async fn wait_for_file(path: &Path) {
    timeout(STEP, async {
        while !path.exists() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{} never appeared", path.display()));
}

async fn assert_free(server: &TestServer, name: &str) {
    let err = server.backend().await.get_lock(name).await.unwrap_err();
    assert_eq!(
        err.kind(),
        ErrorKind::NotFound,
        "{name} should be free: {err}"
    );
}

#[tokio::test]
async fn child_sees_the_lock_and_fence_and_its_exit_code_is_returned() {
    let server = TestServer::start().await;
    let out = finish(fencelock(&server.url()).args([
        "run",
        "job:env",
        "--",
        "sh",
        "-c",
        "echo \"$FENCELOCK_LOCK $FENCELOCK_FENCE\"; exit 7",
    ]))
    .await;
    assert_eq!(out.status.code(), Some(7), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let mut words = stdout.split_whitespace();
    assert_eq!(words.next(), Some("job:env"));
    let fence: u64 = words.next().unwrap().parse().unwrap();
    assert!(fence > 0);
    assert_free(&server, "job:env").await;
}

#[tokio::test]
async fn not_acquired_within_wait_exits_124_without_running_the_command() {
    let server = TestServer::start().await;
    let client = Client::connect(&server.url()).await.unwrap();
    let _held = client.lock("busy").acquire().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("ran");
    let out = finish(fencelock(&server.url()).args([
        "run",
        "busy",
        "--wait",
        "200ms",
        "--",
        "touch",
        marker.to_str().unwrap(),
    ]))
    .await;
    assert_eq!(out.status.code(), Some(124), "{}", text(&out.stderr));
    assert!(
        !marker.exists(),
        "the command must not run without the lock"
    );
}

#[tokio::test]
async fn unreachable_server_exits_69_and_missing_command_127() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let out = finish(
        fencelock(&format!("http://127.0.0.1:{port}")).args(["run", "--lock", "x", "--", "true"]), // the deprecated spelling still works
    )
    .await;
    assert_eq!(out.status.code(), Some(69), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("--lock is deprecated"));

    let server = TestServer::start().await;
    let out =
        finish(fencelock(&server.url()).args(["run", "nocmd", "--", "/nonexistent/command"])).await;
    assert_eq!(out.status.code(), Some(127), "{}", text(&out.stderr));
    assert_free(&server, "nocmd").await;
}

/// A force-release stops the whole process group: the shell *and* its `sleep`, so the
/// line after the sleep is never written.
#[tokio::test]
async fn lost_lock_terminates_the_command_and_exits_75() {
    let server = TestServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    let finished = dir.path().join("finished");
    let script = format!(
        "touch {}; sleep 2; touch {}",
        started.display(),
        finished.display()
    );
    let mut run = fencelock(&server.url())
        .args(["run", "lost:1", "--ttl", "1s", "--", "sh", "-c", &script])
        .spawn()
        .unwrap();
    wait_for_file(&started).await;
    let taken = server
        .backend()
        .await
        .force_release("lost:1", None, "test")
        .await
        .unwrap();
    assert_eq!(taken.len(), 1);
    let out = timeout(STEP, run.wait()).await.unwrap().unwrap();
    assert_eq!(out.code(), Some(75));
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(
        !finished.exists(),
        "the command kept running after the lock was lost"
    );
}

#[tokio::test]
async fn a_command_that_ignores_sigterm_is_killed_after_the_grace_period() {
    let server = TestServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    let script = format!("trap '' TERM; touch {}; sleep 60", started.display());
    let mut run = fencelock(&server.url())
        .args([
            "run", "stubborn", "--ttl", "1s", "--grace", "300ms", "--", "sh", "-c", &script,
        ])
        .spawn()
        .unwrap();
    wait_for_file(&started).await;
    server
        .backend()
        .await
        .force_release("stubborn", None, "test")
        .await
        .unwrap();
    // Well before the 60 s sleep ends.
    let status = timeout(STEP, run.wait()).await.unwrap().unwrap();
    assert_eq!(status.code(), Some(75));
}

#[tokio::test]
async fn stopping_the_server_stops_the_command() {
    let server = TestServer::start().await;
    let url = server.url();
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    let script = format!("touch {}; sleep 60", started.display());
    let mut run = fencelock(&url)
        .args(["run", "srv", "--ttl", "1s", "--", "sh", "-c", &script])
        .spawn()
        .unwrap();
    wait_for_file(&started).await;
    server.server.shutdown().await.unwrap();
    let status = timeout(STEP, run.wait()).await.unwrap().unwrap();
    assert_eq!(status.code(), Some(75));
}

#[tokio::test]
async fn signals_are_forwarded_and_the_lock_released() {
    let server = TestServer::start().await;
    for (signal, name) in [
        (libc::SIGTERM, "TERM"),
        (libc::SIGQUIT, "QUIT"),
        (libc::SIGUSR1, "USR1"),
        (libc::SIGHUP, "HUP"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let started = dir.path().join("started");
        let got = dir.path().join("got");
        let script = format!(
            "trap 'touch {}; exit 9' {name}; touch {}; while :; do sleep 0.05; done",
            got.display(),
            started.display()
        );
        let mut run = fencelock(&server.url())
            .args(["run", "fwd", "--", "sh", "-c", &script])
            .spawn()
            .unwrap();
        wait_for_file(&started).await;
        let pid = run.id().unwrap() as libc::pid_t;
        // SAFETY: signals the `fencelock run` process this test started.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
        let status = timeout(STEP, run.wait()).await.unwrap().unwrap();
        assert_eq!(
            status.code(),
            Some(9),
            "SIG{name}: the command's own exit code"
        );
        assert!(got.exists(), "the command received SIG{name}");
        assert_free(&server, "fwd").await;
    }
}

/// A lock not acquired says who holds it, in the flags' words (no "within 0ns");
/// `--json` turns `run`'s messages into JSON lines on stderr; a wire field never
/// shows through (`--ttl`, not `ttl_ms`).
#[tokio::test]
async fn refusals_say_who_holds_the_lock_and_name_the_flag() {
    let server = TestServer::start().await;
    let url = server.url();
    let client = Client::connect(&url).await.unwrap();
    let _held = client
        .lock("busy")
        .options(fencelock::LockOptions::default().owner("holder-1"))
        .acquire()
        .await
        .unwrap();

    let out = finish(fencelock(&url).args(["run", "busy", "--wait", "0", "--", "true"])).await;
    assert_eq!(out.status.code(), Some(124));
    let said = text(&out.stderr);
    assert!(
        said.contains(r#"not acquired: "busy" is held by "holder-1" (fence "#),
        "{said}"
    );
    assert!(!said.contains("0ns") && !said.contains("within"), "{said}");

    let out = finish(fencelock(&url).args(["acquire", "busy", "--wait", "200ms"])).await;
    assert_eq!(out.status.code(), Some(124));
    let said = text(&out.stderr);
    assert!(
        said.contains(r#"not acquired within 200ms (--wait): "busy" is held by "holder-1""#),
        "{said}"
    );

    let out =
        finish(fencelock(&url).args(["run", "busy", "--wait", "0", "--json", "--", "true"])).await;
    assert_eq!(out.status.code(), Some(124));
    let error: serde_json::Value = serde_json::from_slice(&out.stderr).unwrap();
    assert_eq!(error["error"]["code"], "not_acquired", "{error}");
    assert_eq!(error["error"]["exit_code"], 124, "{error}");

    let out = finish(fencelock(&url).args(["run", "free", "--json", "--", "true"])).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let acquired: serde_json::Value = serde_json::from_slice(&out.stderr).unwrap();
    assert_eq!(acquired["acquired"]["name"], "free", "{acquired}");
    assert!(
        acquired["acquired"]["fence"].as_u64().is_some(),
        "{acquired}"
    );

    for (args, says) in [
        (
            ["acquire", "x", "--ttl", "5ms"],
            "--ttl must be at least 10ms (got 5ms)",
        ),
        (
            ["acquire", "x", "--limit", "0"],
            "--limit must be at least 1",
        ),
    ] {
        let out = finish(fencelock(&url).args(args)).await;
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let said = text(&out.stderr);
        assert!(
            said.contains(says) && !said.contains("_ms"),
            "{args:?}: {said}"
        );
    }
}

/// Several `run`s on one lock, each child logging its start and end time with the
/// fence: no two intervals overlap, and fences grow in the order the runs held it.
#[tokio::test]
async fn concurrent_runs_on_one_lock_never_overlap() {
    let server = TestServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let script = format!(
        "echo \"start $(date +%s%N) $FENCELOCK_FENCE\" >> {log}; sleep 0.1; \
         echo \"end $(date +%s%N) $FENCELOCK_FENCE\" >> {log}",
        log = log.display()
    );
    let mut runs = Vec::new();
    for _ in 0..3 {
        for _ in 0..4 {
            runs.push(
                fencelock(&server.url())
                    .args(["run", "one", "--wait", "30s", "--", "sh", "-c", &script])
                    .spawn()
                    .unwrap(),
            );
        }
    }
    for mut run in runs {
        let status = timeout(STEP, run.wait()).await.unwrap().unwrap();
        assert_eq!(status.code(), Some(0));
    }
    let lines = std::fs::read_to_string(&log).unwrap();
    let intervals = intervals(&lines);
    assert_eq!(intervals.len(), 12, "{lines}");
    check_no_overlap(&intervals).unwrap();
}

/// (start, end, fence) per run, sorted by start.
fn intervals(log: &str) -> Vec<(u128, u128, u64)> {
    let mut starts = std::collections::HashMap::new();
    let mut out = Vec::new();
    for line in log.lines() {
        let parts: Vec<&str> = line.split_whitespace().collect();
        let (what, at, fence) = (parts[0], parts[1].parse::<u128>().unwrap(), parts[2]);
        let fence: u64 = fence.parse().unwrap();
        match what {
            "start" => {
                starts.insert(fence, at);
            }
            "end" => out.push((starts[&fence], at, fence)),
            other => panic!("bad line {other}"),
        }
    }
    out.sort();
    out
}

fn check_no_overlap(intervals: &[(u128, u128, u64)]) -> Result<(), String> {
    for pair in intervals.windows(2) {
        let ((_, end, fence_a), (start, _, fence_b)) = (pair[0], pair[1]);
        if start < end {
            return Err(format!(
                "fence {fence_b} started before fence {fence_a} ended"
            ));
        }
        if fence_b <= fence_a {
            return Err(format!("fence {fence_b} held after {fence_a}"));
        }
    }
    Ok(())
}

/// The checker above is only worth something if it catches an overlap.
#[test]
fn the_overlap_checker_catches_overlaps_and_fence_regressions() {
    assert!(check_no_overlap(&[(0, 10, 1), (10, 20, 2)]).is_ok());
    assert!(check_no_overlap(&[(0, 10, 1), (5, 20, 2)]).is_err());
    assert!(check_no_overlap(&[(0, 10, 2), (10, 20, 1)]).is_err());
}

#[tokio::test]
async fn acquire_renew_release_ls_show_and_json_output() {
    let server = TestServer::start().await;
    let url = server.url();
    let out = finish(fencelock(&url).args(["acquire", "tour:a", "--ttl", "20s", "--json"])).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let grant: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let token = grant["owner_token"].as_str().unwrap().to_owned();
    assert_eq!(grant["name"], "tour:a");
    assert_eq!(grant["ttl_ms"], 20_000);

    let out = finish(fencelock(&url).args(["acquire", "tour:a"])).await;
    assert_eq!(out.status.code(), Some(124), "held: not acquired");

    let out = finish(fencelock(&url).args(["ls", "--prefix", "tour:", "--json"])).await;
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(list["locks"][0]["holders"][0]["fence"], grant["fence"]);

    let out = finish(fencelock(&url).args(["show", "tour:a"])).await;
    assert!(text(&out.stdout).contains(&format!("fence {}", grant["fence"])));

    let out = finish(fencelock(&url).args([
        "renew",
        "tour:a",
        "--owner-token",
        &token,
        "--ttl",
        "5s",
        "--json",
    ]))
    .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let renewed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(renewed["ttl_ms"], 5000);

    let out = finish(fencelock(&url).args(["release", "tour:a", "--owner-token", &token])).await;
    assert!(out.status.success());
    assert!(text(&out.stdout).contains("released"));
    assert_free(&server, "tour:a").await;

    let out = finish(fencelock(&url).args(["show", "tour:a"])).await;
    assert_eq!(out.status.code(), Some(1), "not found");
    let out = finish(fencelock(&url).args(["acquire", "bad\u{1}name"])).await;
    assert_eq!(out.status.code(), Some(2), "invalid input is a usage error");
    let out = finish(fencelock(&url).args(["acquire", "x", "--ttl", "soon"])).await;
    assert_eq!(out.status.code(), Some(2));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("not a duration") && stderr.contains("--ttl"),
        "the error names the flag: {stderr}"
    );
}

#[tokio::test]
async fn watch_prints_events_and_force_release_takes_the_lock() {
    use tokio::io::AsyncBufReadExt;
    let server = TestServer::start().await;
    let url = server.url();
    let mut watch = fencelock(&url)
        .args(["watch", "--prefix", "w:", "--json"])
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(watch.stdout.take().unwrap()).lines();
    let client = Client::connect(&url).await.unwrap();
    // The watch starts streaming at some point after spawn: take fresh locks until
    // one's grant is printed, instead of guessing a delay.
    let mut guards = Vec::new();
    let granted = timeout(STEP, async {
        for i in 0.. {
            guards.push(client.lock(format!("w:{i}")).acquire().await.unwrap());
            if let Ok(line) = timeout(Duration::from_millis(200), lines.next_line()).await {
                let event: serde_json::Value =
                    serde_json::from_str(&line.unwrap().expect("watch ended")).unwrap();
                assert_eq!(event["kind"], "granted", "{event}");
                return event;
            }
        }
        unreachable!()
    })
    .await
    .unwrap();
    let name = granted["name"].as_str().unwrap().to_owned();
    let out = finish(fencelock(&url).args(["force-release", &name, "--reason", "stuck job"])).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains(&format!("released fences [{}]", granted["fence"])));
    let event = timeout(STEP, async {
        loop {
            let line = lines.next_line().await.unwrap().expect("watch ended");
            let event: serde_json::Value = serde_json::from_str(&line).unwrap();
            if event["kind"] == "force_released" {
                return event;
            }
        }
    })
    .await
    .unwrap();
    assert_eq!(event["name"], name.as_str());
    assert_eq!(event["fence"], granted["fence"]);
    assert_eq!(event["reason"], "stuck job");
    watch.kill().await.unwrap();
}

/// The spinner shows only when stderr is a terminal (`script` gives the command a
/// pseudo-terminal); with stderr piped, output stays clean for scripts.
#[tokio::test]
async fn a_spinner_shows_while_waiting_only_on_a_terminal() {
    let server = TestServer::start().await;
    let client = Client::connect(&server.url()).await.unwrap();
    let _held = client.lock("spin").acquire().await.unwrap();
    let command = format!(
        "{} acquire spin --wait 400ms --server {}",
        env!("CARGO_BIN_EXE_fencelock"),
        server.url()
    );
    let out = finish(
        Command::new("script")
            .args(["-q", "-e", "-c", &command, "/dev/null"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    )
    .await;
    let tty = text(&out.stdout);
    assert_eq!(out.status.code(), Some(124), "{tty}");
    assert!(
        tty.contains("waiting for \"spin\""),
        "no spinner on a terminal: {tty:?}"
    );

    let out = finish(fencelock(&server.url()).args(["acquire", "spin", "--wait", "200ms"])).await;
    assert_eq!(out.status.code(), Some(124));
    assert!(
        !text(&out.stderr).contains("waiting for"),
        "spinner on a pipe"
    );
}

/// With authentication on: no token is exit 77 (and the command never runs); the right
/// token runs it.
#[tokio::test]
async fn run_sends_the_token_and_refusal_is_exit_77() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = fencelock_server::ServerConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        fencelock_server::EngineConfig::new(dir.path().join("data")),
    );
    config.auth = fencelock_server::AuthConfig {
        tokens: vec![fencelock_server::TokenConfig {
            name: "jobs".into(),
            role: fencelock_server::Role::Client,
            prefixes: vec!["job:".into()],
            sha256: fencelock_server::auth::hash_token("jobs-secret"),
            acquire_rate: None,
            request_rate: None,
            quotas: Default::default(),
        }],
    };
    let server = fencelock_server::Server::start(config).await.unwrap();
    let url = format!("http://{}", server.local_addr());
    let marker = dir.path().join("ran");
    let touch = ["--", "touch", marker.to_str().unwrap()];

    let out = finish(fencelock(&url).args(["run", "job:a"]).args(touch)).await;
    assert_eq!(out.status.code(), Some(77), "{}", text(&out.stderr));
    assert!(!marker.exists());
    // A 401 is said as one, not as `permission_denied`.
    let said = text(&out.stderr);
    assert!(
        said.contains("not authenticated: ") && !said.contains("permission_denied"),
        "{said}"
    );
    let out = finish(
        fencelock(&url)
            .env("FENCELOCK_TOKEN", "wrong")
            .args(["acquire", "job:a"]),
    )
    .await;
    assert_eq!(out.status.code(), Some(77));
    assert!(text(&out.stderr).contains("not authenticated: unknown token"));

    let out = finish(
        fencelock(&url)
            .env("FENCELOCK_TOKEN", "jobs-secret")
            .args(["run", "other:a"])
            .args(touch),
    )
    .await;
    assert_eq!(out.status.code(), Some(77), "outside the token's prefixes");
    assert!(
        text(&out.stderr).contains("not allowed: "),
        "{}",
        text(&out.stderr)
    );

    let out = finish(
        fencelock(&url)
            .env("FENCELOCK_TOKEN", "jobs-secret")
            .args(["run", "job:a"])
            .args(touch),
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(marker.exists());
    server.shutdown().await.unwrap();
}

/// Every client command speaks TLS to an https:// server with a private CA: the gRPC
/// ones (`acquire`, `ls`) and the HTTP ones (`audit`, `backup`); without the CA the
/// certificate is refused.
#[tokio::test]
async fn client_commands_over_https_with_a_private_ca() {
    let dir = tempfile::tempdir().unwrap();
    let ca = fencelock_testkit::TestCa::create(dir.path()).unwrap();
    let mut config = fencelock_server::ServerConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        fencelock_server::EngineConfig::new(dir.path().join("data")),
    );
    config.tls = Some(fencelock_server::TlsConfig {
        cert_path: ca.server_cert.clone(),
        key_path: ca.server_key.clone(),
    });
    let server = fencelock_server::Server::start(config).await.unwrap();
    let url = format!("https://localhost:{}", server.local_addr().port());
    let with_ca = |args: &[&str]| {
        let mut cmd = fencelock(&url);
        cmd.env("FENCELOCK_CA_CERT", &ca.ca_cert).args(args);
        cmd
    };

    let out = finish(&mut with_ca(&["acquire", "tls:a", "--json"])).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = finish(&mut with_ca(&["ls", "--json"])).await;
    assert!(text(&out.stdout).contains("tls:a"), "{}", text(&out.stderr));
    let out = finish(&mut with_ca(&["audit", "--json", "--server", &url])).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("tls:a"));
    let backup = dir.path().join("backup.flsnap");
    let out = finish(&mut with_ca(&[
        "backup",
        "--server",
        &url,
        "--out",
        backup.to_str().unwrap(),
    ]))
    .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(backup.exists());

    for args in [
        ["ls", "--json"].as_slice(),
        ["audit", "--server", &url].as_slice(),
    ] {
        let out = finish(fencelock(&url).args(args)).await;
        assert!(!out.status.success(), "{args:?} trusted an unknown CA");
    }
    server.shutdown().await.unwrap();
}
