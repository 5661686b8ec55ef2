//! A throwaway single-member etcd (Debian `etcd-server`, etcd 3.4).

use std::ffi::OsString;

use crate::{find_program, free_port, probe, Error, ErrorKind, ServerProcess, ServerSpec};

/// A one-member etcd cluster on a random loopback client port (and another for peers),
/// its data in a temporary directory, with etcd's durable defaults (the WAL is
/// fsync'd). Killed and removed on drop.
#[derive(Debug)]
pub struct Etcd {
    // Field order matters: the process stops before its directory is removed.
    process: ServerProcess,
    dir: tempfile::TempDir,
}

impl Etcd {
    /// Starts `etcd` and waits until `/health` reports healthy.
    pub fn start() -> Result<Etcd, Error> {
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
        let peer_port = free_port()?;
        let args = move |port: u16| -> Vec<OsString> {
            let client = format!("http://127.0.0.1:{port}");
            let peer = format!("http://127.0.0.1:{peer_port}");
            let mut a: Vec<OsString> = vec!["--name".into(), "test".into(), "--data-dir".into()];
            a.push(data.clone().into());
            for (flag, value) in [
                ("--listen-client-urls", &client),
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
            a
        };
        let ready = |port: u16| {
            probe(
                port,
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
        Ok(Etcd { process, dir })
    }

    /// The client port (on 127.0.0.1).
    pub fn port(&self) -> u16 {
        self.process.port()
    }

    /// `http://127.0.0.1:PORT`, the client endpoint.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port())
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
