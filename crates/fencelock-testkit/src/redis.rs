//! A throwaway `redis-server`.

use std::ffi::OsString;

use crate::{find_program, probe, Error, ErrorKind, ServerProcess, ServerSpec};

/// A `redis-server` on a random loopback port, persistence off, its directory in a
/// temporary dir. Stopped and cleaned up on drop.
#[derive(Debug)]
pub struct Redis {
    // Field order matters: the process stops before its directory is removed.
    process: ServerProcess,
    dir: tempfile::TempDir,
}

impl Redis {
    /// Starts `redis-server` (Debian package `redis-server`) and waits until it answers
    /// `PING`.
    pub fn start() -> Result<Redis, Error> {
        let program = find_program("redis-server", &[]).ok_or_else(|| {
            Error::new(
                ErrorKind::Missing,
                "redis-server not found on PATH: install the Debian package redis-server",
            )
        })?;
        let dir = tempfile::Builder::new()
            .prefix("fencelock-redis-")
            .tempdir()
            .map_err(|e| Error::io("create a temporary directory for redis", e))?;
        let dir_path = dir.path().to_owned();
        let args = move |port: u16| -> Vec<OsString> {
            let mut args: Vec<OsString> = [
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--dir",
            ]
            .iter()
            .map(OsString::from)
            .collect();
            args.push(dir_path.clone().into_os_string());
            args
        };
        let process = ServerProcess::spawn(&ServerSpec {
            name: "redis-server",
            program,
            args: &args,
            dir: dir.path(),
            run_as: None,
            stop_signal: libc::SIGTERM,
            ready: &|port| probe(port, b"PING\r\n", 64).is_some_and(|r| r.starts_with(b"+PONG")),
        })?;
        Ok(Redis { process, dir })
    }

    /// The port it listens on (on 127.0.0.1).
    pub fn port(&self) -> u16 {
        self.process.port()
    }

    /// `redis://127.0.0.1:PORT/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port())
    }

    /// Its working directory.
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }
}
