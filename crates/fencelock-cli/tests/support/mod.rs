//! Starting the real `fencelock serve` for the binary's tests.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};

use serde_json::Value;

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_fencelock");

/// Starts `fencelock serve --listen 127.0.0.1:0 --log-format json ARGS…`, waits for
/// the log line that names the address it serves on, and keeps draining its stderr
/// (so the child never blocks on a full pipe). The caller owns (and kills) the child.
pub fn serve<I, S>(args: I) -> (Child, SocketAddr)
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    serve_bin(BIN, args)
}

/// [`serve`] with another `fencelock` binary (to run a test against an older build).
pub fn serve_bin<B, I, S>(bin: B, args: I) -> (Child, SocketAddr)
where
    B: AsRef<OsStr>,
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut child = Command::new(bin)
        .args(["serve", "--listen", "127.0.0.1:0", "--log-format", "json"])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn fencelock serve");
    let stderr = child.stderr.take().expect("piped stderr");
    let mut lines = BufReader::new(stderr).lines();
    let addr = loop {
        let line = lines
            .next()
            .expect("server exited before it was serving")
            .expect("read stderr");
        let v: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
        if let Some(listen) = v.get("listen").and_then(Value::as_str) {
            break listen.parse().expect("listen address");
        }
    };
    std::thread::spawn(move || for _ in lines {});
    (child, addr)
}
