//! A throwaway PostgreSQL cluster.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{probe, running_as_root, Error, ErrorKind, RunAs, ServerProcess, ServerSpec};

/// Where Debian's `postgresql` package puts the server binaries (`initdb`, `postgres`),
/// one directory per major version.
const DEBIAN_PG_ROOT: &str = "/usr/lib/postgresql";

/// How a throwaway cluster is set up (see [`Postgres::start_with`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PostgresOptions {
    /// Keep PostgreSQL's durable defaults (`fsync`, `synchronous_commit`,
    /// `full_page_writes` on), as a benchmark against it needs. Default: off, since
    /// the data is thrown away.
    pub durable: bool,
    /// `max_connections`. Default 50.
    pub max_connections: u32,
}

impl Default for PostgresOptions {
    fn default() -> PostgresOptions {
        PostgresOptions {
            durable: false,
            max_connections: 50,
        }
    }
}

/// A PostgreSQL server on a random loopback port with a fresh cluster in a temporary
/// directory: superuser `postgres`, database `postgres`, trust authentication on
/// 127.0.0.1, `fsync` off unless [`PostgresOptions::durable`]. Stopped (immediate
/// shutdown) and removed on drop.
#[derive(Debug)]
pub struct Postgres {
    // Field order matters: the process stops before its directory is removed.
    process: ServerProcess,
    dir: tempfile::TempDir,
}

impl Postgres {
    /// Runs `initdb` and starts `postgres`, then waits until it accepts a connection.
    ///
    /// Binaries come from `$FENCELOCK_PG_BIN` if set, else the newest
    /// `/usr/lib/postgresql/*/bin` (Debian package `postgresql`). As root, both run as
    /// the `postgres` system user.
    pub fn start() -> Result<Postgres, Error> {
        Postgres::start_with(&PostgresOptions::default())
    }

    /// Like [`Postgres::start`], set up as `options` say.
    pub fn start_with(options: &PostgresOptions) -> Result<Postgres, Error> {
        let bin = bin_dir()?;
        let run_as = if running_as_root() {
            Some(RunAs::user("postgres").map_err(|e| {
                Error::new(
                    ErrorKind::Missing,
                    format!(
                        "{e}: PostgreSQL refuses to run as root and there is no postgres user \
                         to run it as; install the Debian package postgresql"
                    ),
                )
            })?)
        } else {
            None
        };
        let dir = tempfile::Builder::new()
            .prefix("fencelock-pg-")
            .tempdir()
            .map_err(|e| Error::io("create a temporary directory for postgres", e))?;
        if let Some(user) = run_as {
            user.chown(dir.path())?;
        }
        let data = dir.path().join("data");

        let mut initdb = Command::new(bin.join("initdb"));
        initdb
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-locale"])
            .current_dir(dir.path());
        if !options.durable {
            initdb.arg("--no-sync");
        }
        if let Some(user) = run_as {
            use std::os::unix::process::CommandExt;
            initdb.uid(user.uid).gid(user.gid);
        }
        let output = initdb
            .output()
            .map_err(|e| Error::io(format!("run {}", bin.join("initdb").display()), e))?;
        if !output.status.success() {
            return Err(Error::new(
                ErrorKind::Failed,
                format!(
                    "initdb failed ({}):\n{}{}",
                    output.status,
                    String::from_utf8_lossy(&output.stdout),
                    String::from_utf8_lossy(&output.stderr)
                ),
            ));
        }

        let socket_dir = dir.path().to_owned();
        let mut settings = vec![
            "listen_addresses=127.0.0.1".to_owned(),
            format!("max_connections={}", options.max_connections),
        ];
        if !options.durable {
            settings.extend(
                [
                    "fsync=off",
                    "synchronous_commit=off",
                    "full_page_writes=off",
                    "shared_buffers=16MB",
                ]
                .map(str::to_owned),
            );
        }
        let args = move |port: u16| -> Vec<OsString> {
            let mut args: Vec<OsString> = vec!["-D".into(), data.clone().into_os_string()];
            args.extend(["-k".into(), socket_dir.clone().into_os_string()]);
            for setting in std::iter::once(format!("port={port}")).chain(settings.clone()) {
                args.extend(["-c".into(), setting.into()]);
            }
            args
        };
        let process = ServerProcess::spawn(&ServerSpec {
            name: "postgres",
            program: bin.join("postgres"),
            args: &args,
            dir: dir.path(),
            run_as,
            // Immediate shutdown: the postmaster stops its backends too.
            stop_signal: libc::SIGQUIT,
            ready: &accepts_connections,
        })?;
        Ok(Postgres { process, dir })
    }

    /// The server process and its directory, for a caller that manages them itself
    /// (the benchmark's peers). Dropping them stops the server and removes the cluster.
    pub fn into_parts(self) -> (ServerProcess, tempfile::TempDir) {
        (self.process, self.dir)
    }

    /// The port it listens on (on 127.0.0.1).
    pub fn port(&self) -> u16 {
        self.process.port()
    }

    /// A key-value connection string for `tokio-postgres` / libpq:
    /// `host=127.0.0.1 port=PORT user=postgres dbname=postgres`.
    pub fn connection_string(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            self.port()
        )
    }

    /// The same as a URL: `postgresql://postgres@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        format!("postgresql://postgres@127.0.0.1:{}/postgres", self.port())
    }

    /// The temporary directory holding the cluster (`data/`) and the server's output
    /// (`server.log`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

/// The directory with `initdb` and `postgres`.
fn bin_dir() -> Result<PathBuf, Error> {
    if let Some(dir) = std::env::var_os("FENCELOCK_PG_BIN") {
        return Ok(PathBuf::from(dir));
    }
    let missing = || {
        Error::new(
            ErrorKind::Missing,
            format!(
                "no PostgreSQL server binaries under {DEBIAN_PG_ROOT}/*/bin: install the \
                 Debian package postgresql (or set FENCELOCK_PG_BIN to a directory with \
                 initdb and postgres)"
            ),
        )
    };
    let entries = std::fs::read_dir(DEBIAN_PG_ROOT).map_err(|_| missing())?;
    let mut versions: Vec<(u32, PathBuf)> = entries
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let version: u32 = entry.file_name().to_str()?.parse().ok()?;
            let bin = entry.path().join("bin");
            (bin.join("initdb").is_file() && bin.join("postgres").is_file())
                .then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin).ok_or_else(missing)
}

/// Readiness: a startup message for user `postgres` is answered with an authentication
/// message (`R`), not an error (`E`, e.g. "the database system is starting up").
fn accepts_connections(port: u16) -> bool {
    let mut body = Vec::new();
    body.extend_from_slice(&196_608u32.to_be_bytes()); // protocol 3.0
    for part in ["user", "postgres", "database", "postgres", ""] {
        body.extend_from_slice(part.as_bytes());
        body.push(0);
    }
    let mut message = ((body.len() + 4) as u32).to_be_bytes().to_vec();
    message.extend_from_slice(&body);
    probe(port, &message, 1).is_some_and(|reply| reply[0] == b'R')
}
