// Each attacks_* file uses part of this module.
#![allow(dead_code)]

//! What the `attacks_*` tests share: the real `fencelock serve` with a config file,
//! tokens, and raw HTTP/1.1 requests with any headers (the attacks are in the
//! headers: `Host`, `Origin`, `Content-Type`).
//!
//! `FENCELOCK_ATTACK_BIN=/path/to/older/fencelock` runs the attacks against another
//! build, to see them succeed before the defences.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Child;
use std::time::Duration;

use serde_json::Value;

/// A running `fencelock serve`, killed on drop.
pub struct Server {
    child: Child,
    /// Its loopback address.
    pub addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `fencelock serve` on a random loopback port with `config` (TOML, may be
/// empty) and waits until it serves.
pub fn serve(config: &str) -> Server {
    let dir = tempfile::tempdir().expect("tempdir");
    let config_path = dir.path().join("fencelock.toml");
    std::fs::write(&config_path, config).expect("write config");
    let bin =
        std::env::var("FENCELOCK_ATTACK_BIN").unwrap_or_else(|_| super::support::BIN.to_owned());
    let (child, addr) = super::support::serve_bin(
        bin,
        [
            "--config".as_ref(),
            config_path.as_os_str(),
            "--data-dir".as_ref(),
            dir.path().join("data").as_os_str(),
        ],
    );
    Server {
        child,
        addr,
        _dir: dir,
    }
}

/// A `[[auth.tokens]]` entry whose token is `secret`.
pub fn token(name: &str, role: &str, prefixes: &[&str], secret: &str, extra: &str) -> String {
    format!(
        "[[auth.tokens]]\nname = {name:?}\nrole = {role:?}\nprefixes = {prefixes:?}\nsha256 = {:?}\n{extra}\n",
        fencelock_server::auth::hash_token(secret)
    )
}

/// An answer: status, headers and body as text.
pub struct Answer {
    /// The HTTP status.
    pub status: u16,
    /// The body.
    pub body: String,
}

impl Answer {
    /// The body as JSON (`Null` if it is not).
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }

    /// The stable error code of an error answer.
    pub fn code(&self) -> String {
        self.json()["error"]["code"]
            .as_str()
            .unwrap_or("")
            .to_owned()
    }
}

/// One request on its own connection, with exactly the headers given (plus
/// `Content-Length` and `Connection: close`).
pub fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Answer {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str(&format!(
        "Connection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    ));
    s.write_all(head.as_bytes()).expect("send");
    let mut out = Vec::new();
    s.read_to_end(&mut out).expect("read the answer");
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Answer { status, body }
}

/// The value of the sample `name` (a metric without labels) in `/metrics`, read with
/// `token`; `None` if the server does not export it.
pub fn metric(addr: SocketAddr, token: &str, name: &str) -> Option<u64> {
    let auth = format!("Bearer {token}");
    let a = http(
        addr,
        "GET",
        "/metrics",
        &[("Host", "localhost"), ("Authorization", &auth)],
        "",
    );
    assert_eq!(a.status, 200, "metrics: {}", a.body);
    a.body.lines().find_map(|l| {
        l.strip_prefix(name)
            .and_then(|v| v.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    })
}
