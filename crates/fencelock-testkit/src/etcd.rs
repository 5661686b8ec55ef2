//! A throwaway single-member etcd (Debian `etcd-server`, etcd 3.4), optionally with
//! TLS and with auth turned on.

use std::cell::Cell;
use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::Duration;

use crate::{find_program, free_port, probe, Error, ErrorKind, ServerProcess, ServerSpec, TestCa};

/// The password of etcd's `root` user, when [`EtcdOptions::users`] turns auth on.
pub const ETCD_ROOT_PASSWORD: &str = "fencelock-test-root";

/// How a throwaway etcd is set up (see [`Etcd::start_with`]).
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct EtcdOptions {
    /// Serve clients over TLS (`https://`) with this CA's server certificate
    /// (`--cert-file`, `--key-file`). Default: plain http.
    pub tls: Option<TestCa>,
    /// Require client certificates signed by the CA (`--client-cert-auth`,
    /// `--trusted-ca-file`): mutual TLS. Needs `tls`.
    pub client_cert_auth: bool,
    /// Users to create, each with a role of its own that grants read and write on the
    /// keys starting with its prefix, and nothing else. Non-empty turns etcd's auth on
    /// (user `root`, password [`ETCD_ROOT_PASSWORD`], is created for that).
    pub users: Vec<EtcdUser>,
    /// How long a simple auth token lives unused (`--auth-token-ttl`, seconds).
    /// Default etcd's (300 s).
    pub auth_token_ttl_s: Option<u32>,
}

/// An etcd user for [`EtcdOptions::users`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdUser {
    /// The user name (also the name of its role).
    pub name: String,
    /// Its password.
    pub password: String,
    /// It may read and write the keys starting with this (all keys if empty).
    pub prefix: String,
}

impl EtcdUser {
    /// A user allowed to read and write the keys starting with `prefix`.
    pub fn new(name: &str, password: &str, prefix: &str) -> EtcdUser {
        EtcdUser {
            name: name.to_owned(),
            password: password.to_owned(),
            prefix: prefix.to_owned(),
        }
    }
}

/// A one-member etcd cluster on a random loopback client port (and another for peers),
/// its data in a temporary directory, with etcd's durable defaults (the WAL is
/// fsync'd). Killed and removed on drop.
///
/// With TLS, it also serves plain http on [`Etcd::admin_port`], for the testkit's own
/// readiness probe and auth setup.
#[derive(Debug)]
pub struct Etcd {
    // Field order matters: the process stops before its directory is removed.
    process: ServerProcess,
    dir: tempfile::TempDir,
    tls: bool,
    admin_port: u16,
}

impl Etcd {
    /// Starts `etcd` and waits until `/health` reports healthy.
    pub fn start() -> Result<Etcd, Error> {
        Etcd::start_with(&EtcdOptions::default())
    }

    /// Like [`Etcd::start`], set up as `options` say; with users, auth is on when this
    /// returns.
    pub fn start_with(options: &EtcdOptions) -> Result<Etcd, Error> {
        if options.client_cert_auth && options.tls.is_none() {
            return Err(Error::new(
                ErrorKind::Failed,
                "client_cert_auth needs tls: client certificates are a part of TLS",
            ));
        }
        let program = find_program("etcd", &[]).ok_or_else(|| {
            Error::new(
                ErrorKind::Missing,
                "etcd not found on PATH: install the Debian package etcd-server",
            )
        })?;
        let dir = tempfile::Builder::new()
            .prefix("fencelock-etcd-")
            .tempdir()
            .map_err(|e| Error::io("create a temporary directory for etcd", e))?;
        let data = dir.path().join("data");
        // The peer port, and with TLS a second, plain listener that serves the probe and
        // the setup, are chosen for each attempt: a clash shows up as etcd exiting, and
        // the next attempt picks every port again.
        let peer_port = Cell::new(0u16);
        let extra_port = Cell::new(None::<u16>);
        let args = |port: u16| -> Vec<OsString> {
            peer_port.set(free_port().unwrap_or(0));
            extra_port.set(options.tls.as_ref().map(|_| free_port().unwrap_or(0)));
            let (peer_port, extra_port) = (peer_port.get(), extra_port.get());
            let scheme = if options.tls.is_some() {
                "https"
            } else {
                "http"
            };
            let client = format!("{scheme}://127.0.0.1:{port}");
            let listen = match extra_port {
                Some(admin) => format!("{client},http://127.0.0.1:{admin}"),
                None => client.clone(),
            };
            let peer = format!("http://127.0.0.1:{peer_port}");
            let mut a: Vec<OsString> = vec!["--name".into(), "test".into(), "--data-dir".into()];
            a.push(data.clone().into());
            for (flag, value) in [
                ("--listen-client-urls", &listen),
                ("--advertise-client-urls", &client),
                ("--listen-peer-urls", &peer),
                ("--initial-advertise-peer-urls", &peer),
            ] {
                a.push(flag.into());
                a.push(value.into());
            }
            a.push("--initial-cluster".into());
            a.push(format!("test={peer}").into());
            a.extend(["--log-level", "warn", "--logger", "zap"].map(OsString::from));
            // Hashing passwords at the lowest cost keeps setup and logins quick.
            a.extend(["--bcrypt-cost", "4"].map(OsString::from));
            if let Some(ttl_s) = options.auth_token_ttl_s {
                a.push("--auth-token-ttl".into());
                a.push(ttl_s.to_string().into());
            }
            if let Some(ca) = &options.tls {
                a.push("--cert-file".into());
                a.push(ca.server_cert.clone().into());
                a.push("--key-file".into());
                a.push(ca.server_key.clone().into());
                // etcd asks for client certificates as soon as it has a CA for them.
                if options.client_cert_auth {
                    a.push("--client-cert-auth".into());
                    a.push("--trusted-ca-file".into());
                    a.push(ca.ca_cert.clone().into());
                }
            }
            a
        };
        let ready = |port: u16| {
            probe(
                extra_port.get().unwrap_or(port),
                b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                512,
            )
            .is_some_and(|reply| String::from_utf8_lossy(&reply).contains("\"health\":\"true\""))
        };
        let process = ServerProcess::spawn(&ServerSpec {
            name: "etcd",
            program,
            args: &args,
            dir: dir.path(),
            run_as: None,
            stop_signal: libc::SIGKILL,
            ready: &ready,
        })?;
        let etcd = Etcd {
            admin_port: extra_port.get().unwrap_or(process.port()),
            process,
            dir,
            tls: options.tls.is_some(),
        };
        if !options.users.is_empty() {
            etcd.enable_auth(&options.users)?;
        }
        Ok(etcd)
    }

    /// Creates `root` and `users` (each with its own role), then turns auth on,
    /// through etcd's JSON gateway on the plain listener.
    fn enable_auth(&self, users: &[EtcdUser]) -> Result<(), Error> {
        let post = |path: &str, body: String| gateway(self.admin_port, path, &body);
        post(
            "/v3/auth/user/add",
            format!(
                r#"{{"name":"root","password":{}}}"#,
                json_string(ETCD_ROOT_PASSWORD)
            ),
        )?;
        post(
            "/v3/auth/user/grant",
            r#"{"user":"root","role":"root"}"#.to_owned(),
        )?;
        for user in users {
            let name = json_string(&user.name);
            post("/v3/auth/role/add", format!(r#"{{"name":{name}}}"#))?;
            let (key, end) = prefix_range(user.prefix.as_bytes());
            post(
                "/v3/auth/role/grant",
                format!(
                    r#"{{"name":{name},"perm":{{"permType":"READWRITE","key":"{}","range_end":"{}"}}}}"#,
                    base64(&key),
                    base64(&end)
                ),
            )?;
            post(
                "/v3/auth/user/add",
                format!(
                    r#"{{"name":{name},"password":{}}}"#,
                    json_string(&user.password)
                ),
            )?;
            post(
                "/v3/auth/user/grant",
                format!(r#"{{"user":{name},"role":{name}}}"#),
            )?;
        }
        post("/v3/auth/enable", "{}".to_owned())
    }

    /// The client port (on 127.0.0.1).
    pub fn port(&self) -> u16 {
        self.process.port()
    }

    /// `http://127.0.0.1:PORT` (`https://` with TLS), the client endpoint.
    pub fn url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.port())
    }

    /// A plain-http client port: [`Etcd::port`] without TLS, a second listener with
    /// TLS.
    pub fn admin_port(&self) -> u16 {
        self.admin_port
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Its working directory (data and `server.log`).
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// The process and its directory, for callers that manage them together.
    pub fn into_parts(self) -> (ServerProcess, tempfile::TempDir) {
        (self.process, self.dir)
    }
}

/// POSTs `body` to etcd's JSON gateway at `path` on 127.0.0.1:`port`; an error
/// unless etcd answers 200.
fn gateway(port: u16, path: &str, body: &str) -> Result<(), Error> {
    let io = |e| Error::io(format!("etcd gateway {path}"), e);
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(io)?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(io)?;
    stream
        .set_write_timeout(Some(Duration::from_secs(10)))
        .map_err(io)?;
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).map_err(io)?;
    let mut reply = Vec::new();
    // The server closes the connection after its answer (`Connection: close`).
    stream.take(1 << 20).read_to_end(&mut reply).map_err(io)?;
    let reply = String::from_utf8_lossy(&reply);
    if !reply.starts_with("HTTP/1.1 200") {
        return Err(Error::new(
            ErrorKind::Failed,
            format!("etcd gateway {path} answered: {reply}"),
        ));
    }
    Ok(())
}

/// The key range of the keys starting with `prefix` (etcd's `--prefix`): the prefix,
/// and the prefix with its last byte below 0xff incremented (`\0`, every key, if
/// there is none).
fn prefix_range(prefix: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return (prefix.to_vec(), end);
        }
    }
    (prefix.to_vec(), vec![0])
}

/// `text` as a JSON string literal.
fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Standard base64 with padding (how the gateway takes bytes).
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | u32::from(b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i)) as usize & 63]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_the_standard_alphabet() {
        for (bytes, text) in [
            (&b""[..], ""),
            (b"f", "Zg=="),
            (b"fo", "Zm8="),
            (b"foo", "Zm9v"),
            (b"fencelock/", "ZmVuY2Vsb2NrLw=="),
            (&[0xff, 0xfe, 0x00], "//4A"),
        ] {
            assert_eq!(base64(bytes), text, "{bytes:?}");
        }
    }

    #[test]
    fn prefix_ranges_end_after_every_key_with_the_prefix() {
        assert_eq!(prefix_range(b"a/"), (b"a/".to_vec(), b"a0".to_vec()));
        assert_eq!(prefix_range(b"a\xff"), (b"a\xff".to_vec(), b"b".to_vec()));
        assert_eq!(prefix_range(b""), (Vec::new(), vec![0]));
    }

    #[test]
    fn json_strings_escape_quotes_and_controls() {
        assert_eq!(json_string(r#"a"b\c"#), r#""a\"b\\c""#);
        assert_eq!(json_string("x\ny"), r#""x\u000ay""#);
    }
}
