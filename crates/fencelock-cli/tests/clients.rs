//! The client examples of docs/clients.md run against the real `fencelock serve`:
//! Python (`requests`) and JavaScript (`fetch`, Node.js) each take, renew and
//! release a lock and pass its fence to a resource that refuses a stale one; the
//! Python one also with a token. Go (`net/http`, standard library only) is built
//! with Debian's `golang-go` offline (`GOPROXY=off`, caches in a temp dir) and run
//! the same way; a missing `go` fails the test (scripts/test.sh installs it).

use crate::support;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};

/// A server that is killed when the test ends, pass or fail.
struct Server {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Server {
    fn start(config: Option<&str>) -> Server {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let data = dir.path().join("data");
        let mut args = vec![OsStr::new("--data-dir").to_owned(), data.into_os_string()];
        if let Some(config) = config {
            let path = dir.path().join("fencelock.toml");
            std::fs::write(&path, config).expect("write the config");
            args.push("--config".into());
            args.push(path.into_os_string());
        }
        let (child, addr) = support::serve(args);
        Server {
            child,
            url: format!("http://{addr}"),
            _dir: dir,
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn example(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/clients")
        .join(relative)
}

/// Runs `program example lock_name` with the server's URL (and token); fails the
/// test, showing its output, unless it exits 0.
fn run(program: &str, example: &Path, server: &Server, token: Option<&str>) -> String {
    let mut command = Command::new(program);
    command.arg(example);
    run_command(command, server, token)
}

/// Runs `command lock_name` as [`run`] does.
fn run_command(mut command: Command, server: &Server, token: Option<&str>) -> String {
    let program = command.get_program().to_string_lossy().into_owned();
    let example = command
        .get_args()
        .next()
        .map(|a| a.to_string_lossy().into_owned())
        .unwrap_or_default();
    command
        .arg("clients:example")
        .env("FENCELOCK_URL", &server.url)
        .env_remove("FENCELOCK_TOKEN");
    if let Some(token) = token {
        command.env("FENCELOCK_TOKEN", token);
    }
    let Output {
        status,
        stdout,
        stderr,
    } = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program} (is it installed?): {e}"));
    let stdout = String::from_utf8_lossy(&stdout).into_owned();
    assert!(
        status.success(),
        "{program} {example} failed ({status}):\n{stdout}\n{}",
        String::from_utf8_lossy(&stderr)
    );
    stdout
}

/// What every example prints on its way: the grant, the renewal, the refused second
/// holder, the release, the refused stale write, and `ok` at the end.
fn assert_the_whole_story(out: &str) {
    for line in [
        "acquired clients:example with fence 1",
        "renewed for 20000 ms",
        "a second holder is refused: held",
        "released",
        "the resource refused a write with fence 1",
    ] {
        assert!(out.contains(line), "missing {line:?} in:\n{out}");
    }
    assert_eq!(out.lines().last(), Some("ok"), "{out}");
}

#[test]
fn the_python_example_takes_renews_and_releases_a_lock_and_passes_the_fence_on() {
    let server = Server::start(None);
    let out = run("python3", &example("python/lock.py"), &server, None);
    assert_the_whole_story(&out);

    // With tokens configured, the same script with FENCELOCK_TOKEN.
    let secret = "a-client-token-for-the-python-example";
    let config = format!(
        "[[auth.tokens]]\nname = \"py\"\nrole = \"client\"\nprefixes = [\"clients:\"]\nsha256 = \"{}\"\n",
        fencelock_server::auth::hash_token(secret)
    );
    let secure = Server::start(Some(&config));
    let out = run("python3", &example("python/lock.py"), &secure, Some(secret));
    assert_the_whole_story(&out);
}

#[test]
fn the_javascript_example_takes_renews_and_releases_a_lock_and_passes_the_fence_on() {
    let server = Server::start(None);
    let out = run("node", &example("js/lock.mjs"), &server, None);
    assert_the_whole_story(&out);
}

/// `go build` of examples/clients/go into `out`, offline: no module proxy, no
/// toolchain download, build and module caches in `out` (never the user's).
fn build_go_example(out: &Path) -> PathBuf {
    let binary = out.join("fencelock-go-example");
    let output = Command::new("go")
        .args(["build", "-o"])
        .arg(&binary)
        .arg(".")
        .current_dir(example("go"))
        .env("GOCACHE", out.join("gocache"))
        .env("GOPATH", out.join("gopath"))
        .env("GOMODCACHE", out.join("gopath/pkg/mod"))
        .env("GOPROXY", "off")
        .env("GOTOOLCHAIN", "local")
        .env("GOFLAGS", "-mod=mod")
        .env("GO111MODULE", "on")
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run `go` ({e}): install Go (Debian: apt-get install golang-go; \
                 scripts/test.sh does it as root) to build examples/clients/go"
            )
        });
    assert!(
        output.status.success(),
        "go build of examples/clients/go failed ({}):\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    binary
}

#[test]
fn the_go_example_takes_renews_and_releases_a_lock_and_passes_the_fence_on() {
    let build = tempfile::tempdir().expect("a temporary directory");
    let binary = build_go_example(build.path());
    let server = Server::start(None);
    let out = run_command(Command::new(&binary), &server, None);
    assert_the_whole_story(&out);

    // With tokens configured, the same program with FENCELOCK_TOKEN.
    let secret = "a-client-token-for-the-go-example";
    let config = format!(
        "[[auth.tokens]]\nname = \"go\"\nrole = \"client\"\nprefixes = [\"clients:\"]\nsha256 = \"{}\"\n",
        fencelock_server::auth::hash_token(secret)
    );
    let secure = Server::start(Some(&config));
    let out = run_command(Command::new(&binary), &secure, Some(secret));
    assert_the_whole_story(&out);
}
