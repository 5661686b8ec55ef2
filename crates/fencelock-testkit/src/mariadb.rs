//! A throwaway MariaDB server.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{
    find_program, probe, running_as_root, Error, ErrorKind, RunAs, ServerProcess, ServerSpec,
};

/// The test account [`MariaDb::start`] creates (password the same), with every
/// privilege, and its default database.
pub const MARIADB_USER: &str = "fencelock";
/// The database [`MariaDb::url`] names.
pub const MARIADB_DATABASE: &str = "fencelock";

/// How a throwaway server is set up (see [`MariaDb::start_with`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MariaDbOptions {
    /// Keep InnoDB's durable default (`innodb_flush_log_at_trx_commit = 1`: the redo
    /// log is flushed to disk at every commit), as a benchmark against it needs.
    /// Default: off (`2`: written at commit, flushed once a second), since the data is
    /// thrown away. Either way a killed server keeps every committed transaction;
    /// only an operating-system crash could lose the last second without it.
    pub durable: bool,
    /// `max_connections`. Default 200.
    pub max_connections: u32,
}

impl Default for MariaDbOptions {
    fn default() -> MariaDbOptions {
        MariaDbOptions {
            durable: false,
            max_connections: 200,
        }
    }
}

/// A MariaDB server (`mariadbd`, Debian package `mariadb-server`) on a random
/// loopback port with a fresh data directory in a temporary directory. It has real
/// authentication: connect as [`MARIADB_USER`] with the same password, over TCP
/// ([`MariaDb::url`]). The machine's own MariaDB (port 3306, `/etc/mysql`) is never
/// touched: the server reads no option files. Killed and removed on drop.
#[derive(Debug)]
pub struct MariaDb {
    // Field order matters: the process stops before its directory is removed.
    process: ServerProcess,
    dir: tempfile::TempDir,
    program: PathBuf,
    run_as: Option<RunAs>,
    options: MariaDbOptions,
}

impl MariaDb {
    /// Creates a data directory (`mariadb-install-db`), starts `mariadbd` on it and
    /// waits until it greets clients. As root, both run as the `mysql` system user.
    pub fn start() -> Result<MariaDb, Error> {
        MariaDb::start_with(&MariaDbOptions::default())
    }

    /// Like [`MariaDb::start`], set up as `options` say.
    pub fn start_with(options: &MariaDbOptions) -> Result<MariaDb, Error> {
        let sbin = [PathBuf::from("/usr/sbin"), PathBuf::from("/usr/bin")];
        let missing = |program: &str| {
            Error::new(
                ErrorKind::Missing,
                format!("{program} not found: install the Debian package mariadb-server"),
            )
        };
        let program = find_program("mariadbd", &sbin).ok_or_else(|| missing("mariadbd"))?;
        let install = find_program("mariadb-install-db", &sbin)
            .ok_or_else(|| missing("mariadb-install-db"))?;
        let run_as = if running_as_root() {
            Some(RunAs::user("mysql").map_err(|e| {
                Error::new(
                    ErrorKind::Missing,
                    format!(
                        "{e}: MariaDB does not run as root and there is no mysql user to run \
                         it as; install the Debian package mariadb-server"
                    ),
                )
            })?)
        } else {
            None
        };
        let dir = tempfile::Builder::new()
            .prefix("fencelock-mariadb-")
            .tempdir()
            .map_err(|e| Error::io("create a temporary directory for mariadb", e))?;
        if let Some(user) = run_as {
            user.chown(dir.path())?;
        }
        let mut command = Command::new(&install);
        command
            .arg("--no-defaults")
            .arg(format!("--datadir={}", dir.path().join("data").display()))
            // Its own temporary directory: concurrent installs clash in a shared /tmp.
            .arg(format!("--tmpdir={}", dir.path().display()))
            .args([
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
                "--skip-name-resolve",
            ])
            .args(storage_args())
            .current_dir(dir.path());
        if let Some(user) = run_as {
            use std::os::unix::process::CommandExt;
            command.uid(user.uid).gid(user.gid);
        }
        let output = command
            .output()
            .map_err(|e| Error::io(format!("run {}", install.display()), e))?;
        if !output.status.success() {
            return Err(Error::new(
                ErrorKind::Failed,
                format!(
                    "mariadb-install-db failed ({}):\n{}{}",
                    output.status,
                    String::from_utf8_lossy(&output.stdout),
                    String::from_utf8_lossy(&output.stderr)
                ),
            ));
        }
        // Run at every start (so `IF NOT EXISTS`): the test account, over TCP only.
        let init = format!(
            "CREATE USER IF NOT EXISTS '{MARIADB_USER}'@'%' IDENTIFIED BY '{MARIADB_USER}';\n\
             GRANT ALL PRIVILEGES ON *.* TO '{MARIADB_USER}'@'%';\n\
             CREATE DATABASE IF NOT EXISTS {MARIADB_DATABASE};\n"
        );
        let init_path = dir.path().join("init.sql");
        std::fs::write(&init_path, init)
            .map_err(|e| Error::io(format!("write {}", init_path.display()), e))?;
        let process = spawn(&program, dir.path(), run_as, options, None)?;
        Ok(MariaDb {
            process,
            dir,
            program,
            run_as,
            options: options.clone(),
        })
    }

    /// Kills the server (`SIGKILL`: no clean shutdown, as a crash) and starts it again
    /// on the same port and data directory; InnoDB recovers from its redo log.
    pub fn crash_and_restart(&mut self) -> Result<(), Error> {
        let port = self.port();
        // SAFETY: signalling our own child, not reaped yet (its pid cannot be reused).
        unsafe { libc::kill(self.process.pid() as libc::pid_t, libc::SIGKILL) };
        // Reaped before the new server binds the port and opens the data files.
        let _ = self.process.child.wait();
        let restarted = spawn(
            &self.program,
            self.dir.path(),
            self.run_as,
            &self.options,
            Some(port),
        )?;
        // Dropping the old handle reaps the killed process.
        self.process = restarted;
        Ok(())
    }

    /// The server process and its directory, for a caller that manages them itself
    /// (the benchmark's peers). Dropping them stops the server and removes the data.
    pub fn into_parts(self) -> (ServerProcess, tempfile::TempDir) {
        (self.process, self.dir)
    }

    /// The port it listens on (on 127.0.0.1).
    pub fn port(&self) -> u16 {
        self.process.port()
    }

    /// `mysql://fencelock:fencelock@127.0.0.1:PORT/fencelock`.
    pub fn url(&self) -> String {
        format!(
            "mysql://{MARIADB_USER}:{MARIADB_USER}@127.0.0.1:{}/{MARIADB_DATABASE}",
            self.port()
        )
    }

    /// The temporary directory holding the data (`data/`) and the server's output
    /// (`server.log`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

/// Storage settings for both the installer and the server: small files, as the data
/// is thrown away.
fn storage_args() -> [&'static str; 3] {
    [
        "--innodb-log-file-size=8M",
        "--innodb-buffer-pool-size=32M",
        "--innodb-data-file-path=ibdata1:4M:autoextend",
    ]
}

fn spawn(
    program: &Path,
    dir: &Path,
    run_as: Option<RunAs>,
    options: &MariaDbOptions,
    port: Option<u16>,
) -> Result<ServerProcess, Error> {
    let dir_owned = dir.to_owned();
    let flush = if options.durable { 1 } else { 2 };
    let max_connections = options.max_connections;
    let args = move |port: u16| -> Vec<OsString> {
        let path = |name: &str| dir_owned.join(name).display().to_string();
        let mut args: Vec<String> = vec![
            "--no-defaults".to_owned(),
            format!("--datadir={}", path("data")),
            format!("--socket={}", path("mariadbd.sock")),
            format!("--pid-file={}", path("mariadbd.pid")),
            format!("--tmpdir={}", dir_owned.display()),
            format!("--init-file={}", path("init.sql")),
            format!("--port={port}"),
            "--bind-address=127.0.0.1".to_owned(),
            "--skip-name-resolve".to_owned(),
            "--skip-log-bin".to_owned(),
            "--performance-schema=OFF".to_owned(),
            format!("--max-connections={max_connections}"),
            format!("--innodb-flush-log-at-trx-commit={flush}"),
        ];
        args.extend(storage_args().map(str::to_owned));
        args.into_iter().map(OsString::from).collect()
    };
    let spec = ServerSpec {
        name: "mariadbd",
        program: program.to_owned(),
        args: &args,
        dir,
        run_as,
        // The data is thrown away (or recovered, for a restart): no clean shutdown.
        stop_signal: libc::SIGKILL,
        ready: &greets,
    };
    match port {
        Some(port) => ServerProcess::spawn_on(&spec, port),
        None => ServerProcess::spawn(&spec),
    }
}

/// Readiness: the server's first packet is a protocol-10 handshake (byte 4 is 10), not
/// an error packet (`0xff`).
fn greets(port: u16) -> bool {
    probe(port, b"", 64).is_some_and(|reply| reply.len() > 4 && reply[4] == 10)
}
