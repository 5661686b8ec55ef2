//! The client examples of docs/clients.md run against the real `fencelock serve`:
//! Python (`requests`) and JavaScript (`fetch`, Node.js) each take, renew and
//! release a lock and pass its fence to a resource that refuses a stale one; the
//! Python one also with a token. (The Go example is documentation only: this
//! machine has no Go toolchain.)

mod support;

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
    command
        .arg(example)
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
        "{program} {} failed ({status}):\n{stdout}\n{}",
        example.display(),
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
