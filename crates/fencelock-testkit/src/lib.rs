//! Throwaway servers for fencelock's tests: PostgreSQL, MariaDB, Redis (plain, TLS,
//! Sentinel, Cluster), etcd and ZooKeeper.
//!
//! Each server is a real binary from a Debian package, started on a random free
//! loopback port with its data in a fresh temporary directory, and stopped (killed and
//! reaped, directory removed) when its handle is dropped. Tests never touch servers
//! that happen to run on the machine (PostgreSQL on 5432, Redis on 6379): every test
//! gets its own instance.
//!
//! ```no_run
//! let pg = fencelock_testkit::Postgres::start()?;
//! // tokio_postgres::connect(&pg.connection_string(), NoTls)...
//! let redis = fencelock_testkit::Redis::start()?;
//! println!("redis on 127.0.0.1:{}", redis.port());
//! # Ok::<(), fencelock_testkit::Error>(())
//! ```
//!
//! All servers share one small core, [`ServerProcess`]: spawn a command on a chosen
//! port, poll a readiness probe (bounded in time), and stop it on drop. Adding another
//! server means writing its command line and its probe.
//!
//! PostgreSQL refuses to run as root. When the tests run as root (as CI does), `initdb`
//! and `postgres` run as the `postgres` system user that Debian's package creates, and
//! the temporary directory is handed to that user; MariaDB likewise runs as `mysql`.
#![deny(missing_docs)]

use std::ffi::{CString, OsString};
use std::fmt;
use std::fs::File;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod etcd;
mod mariadb;
mod postgres;
mod proxy;
mod redis;
mod tls;
mod zookeeper;

pub use etcd::{Etcd, EtcdOptions, EtcdUser, ETCD_ROOT_PASSWORD};
pub use mariadb::{MariaDb, MariaDbOptions, MARIADB_DATABASE, MARIADB_USER};
pub use postgres::{Postgres, PostgresOptions};
pub use proxy::Proxy;
pub use redis::{Redis, RedisCluster, RedisSentinel};
pub use tls::TestCa;
pub use zookeeper::{ZooKeeper, ZooKeeperOptions, ZOOKEEPER_SUPER_USER};

/// How long a server may take to become ready before [`ServerProcess::spawn`] gives up.
pub const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a stopped server may take to exit after its stop signal before it is
/// killed with `SIGKILL`.
pub const STOP_GRACE: Duration = Duration::from_secs(10);

/// How many random ports are tried when a server fails to start (another process may
/// take a free port between our probe and the server's bind).
const PORT_ATTEMPTS: usize = 5;

/// What went wrong while starting a test server.
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    message: String,
}

/// The category of an [`Error`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A server binary (or the user to run it as) is not installed.
    Missing,
    /// The server (or a setup step such as `initdb`) failed or exited early.
    Failed,
    /// The server did not become ready within [`READY_TIMEOUT`].
    Timeout,
    /// A local I/O operation (temp dir, log file, port probe) failed.
    Io,
}

impl Error {
    /// The category of this error.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub(crate) fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error {
            kind,
            message: message.into(),
        }
    }

    pub(crate) fn io(what: impl fmt::Display, err: std::io::Error) -> Error {
        Error::new(ErrorKind::Io, format!("{what}: {err}"))
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

/// A Unix user (and its primary group) to run a server as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunAs {
    /// The user id.
    pub uid: u32,
    /// The primary group id.
    pub gid: u32,
}

impl RunAs {
    /// Looks a system user up by name (`getpwnam`).
    pub fn user(name: &str) -> Result<RunAs, Error> {
        let c_name = CString::new(name)
            .map_err(|_| Error::new(ErrorKind::Missing, format!("bad user name {name:?}")))?;
        // SAFETY: getpwnam takes a NUL-terminated string and returns a pointer to static
        // storage or null; we copy the two fields out at once. Tests call this rarely and
        // the only race (another thread calling getpwnam) would at worst read another
        // user's entry for a well-known system account.
        let entry = unsafe { libc::getpwnam(c_name.as_ptr()) };
        if entry.is_null() {
            return Err(Error::new(
                ErrorKind::Missing,
                format!("no system user {name:?}"),
            ));
        }
        // SAFETY: non-null pointer returned by getpwnam.
        let (uid, gid) = unsafe { ((*entry).pw_uid, (*entry).pw_gid) };
        Ok(RunAs { uid, gid })
    }

    /// Makes `path` owned by this user and group.
    pub fn chown(&self, path: &Path) -> Result<(), Error> {
        let c_path = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| Error::new(ErrorKind::Io, format!("bad path {}", path.display())))?;
        // SAFETY: valid NUL-terminated path.
        if unsafe { libc::chown(c_path.as_ptr(), self.uid, self.gid) } != 0 {
            return Err(Error::io(
                format!("chown {}", path.display()),
                std::io::Error::last_os_error(),
            ));
        }
        Ok(())
    }
}

/// True when this process runs as root (effective uid 0).
pub fn running_as_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// A port on 127.0.0.1 that is free now and stays this process's to bind, until it
/// exits, against every other test process on the machine.
///
/// A port found by binding port 0 and releasing it can be taken before the server
/// binds it: by any outgoing connection (the kernel picks their source ports from the
/// same ephemeral range) or by another test process picking the same way. Under
/// cargo-nextest, tests run as many processes at once, and the stress pass saw a
/// cluster member fail with "Address already in use". So ports come from below the
/// ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`), where neither happens,
/// and each is reserved with an advisory lock on a file named after it in the temp
/// dir, held for the life of the process (the kernel drops it when the process dies,
/// even by `kill -9`). A member restarted on its old port finds it still reserved.
pub fn free_port() -> Result<u16, Error> {
    use std::sync::Mutex;
    // The reservations of this process: open files holding their locks.
    static HELD: Mutex<Vec<File>> = Mutex::new(Vec::new());
    let (low, high) = reservable_ports();
    let dir = std::env::temp_dir().join("fencelock-test-ports");
    std::fs::create_dir_all(&dir).map_err(|e| Error::io("create the port lock dir", e))?;
    let span = u64::from(high - low) + 1;
    let mut next = {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        nanos ^ (u64::from(std::process::id()) << 20)
    };
    for _ in 0..1000 {
        // xorshift: a different start in each process, then a walk over the range.
        next ^= next << 13;
        next ^= next >> 7;
        next ^= next << 17;
        let port = low + (next % span) as u16;
        let path = dir.join(port.to_string());
        let file = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| Error::io("open a port lock file", e))?;
        // SAFETY: flock on a file descriptor this function owns.
        if unsafe {
            libc::flock(
                std::os::fd::AsRawFd::as_raw_fd(&file),
                libc::LOCK_EX | libc::LOCK_NB,
            )
        } != 0
        {
            continue; // another process holds it
        }
        let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
        if TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
            held.push(file);
            return Ok(port);
        }
        // In use by something that does not take part in the locks: try another.
    }
    Err(Error::new(
        ErrorKind::Io,
        format!("no free port in {low}..={high} after 1000 tries"),
    ))
}

/// Ports below the kernel's ephemeral range and above the usual services' ones.
fn reservable_ports() -> (u16, u16) {
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let high = ephemeral_low.saturating_sub(1).max(20_001);
    (20_000.min(high - 1), high)
}

/// How to start one server process.
pub struct ServerSpec<'a> {
    /// Short name for messages, e.g. `"postgres"`.
    pub name: &'a str,
    /// The program to run.
    pub program: PathBuf,
    /// Its arguments, given the port chosen for this attempt.
    pub args: &'a dyn Fn(u16) -> Vec<OsString>,
    /// Working directory; the server's output goes to `server.log` in it.
    pub dir: &'a Path,
    /// Run as this user instead of the current one.
    pub run_as: Option<RunAs>,
    /// The signal that stops it cleanly and quickly (`SIGTERM`, or `SIGQUIT` for
    /// PostgreSQL's immediate shutdown, which also stops its child processes).
    pub stop_signal: libc::c_int,
    /// Returns true once a server on this port accepts and serves requests.
    pub ready: &'a dyn Fn(u16) -> bool,
}

/// A running server process: killed and reaped on drop.
#[derive(Debug)]
pub struct ServerProcess {
    child: Child,
    port: u16,
    stop_signal: libc::c_int,
}

impl ServerProcess {
    /// Starts the server on a free loopback port and waits (at most [`READY_TIMEOUT`])
    /// until `spec.ready` says it serves. If the process exits early (say another
    /// process took the port first), retries on another port a few times.
    pub fn spawn(spec: &ServerSpec<'_>) -> Result<ServerProcess, Error> {
        let mut last_error = None;
        for _ in 0..PORT_ATTEMPTS {
            let port = free_port()?;
            match ServerProcess::spawn_on(spec, port) {
                Ok(process) => return Ok(process),
                Err(e) if e.kind == ErrorKind::Failed => last_error = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last_error.expect("at least one attempt"))
    }

    fn spawn_on(spec: &ServerSpec<'_>, port: u16) -> Result<ServerProcess, Error> {
        let log_path = spec.dir.join("server.log");
        let log = File::create(&log_path)
            .map_err(|e| Error::io(format!("create {}", log_path.display()), e))?;
        let log_err = log
            .try_clone()
            .map_err(|e| Error::io("duplicate the log file handle", e))?;
        let mut command = Command::new(&spec.program);
        command
            .args((spec.args)(port))
            .current_dir(spec.dir)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err);
        if let Some(user) = spec.run_as {
            command.uid(user.uid).gid(user.gid);
        }
        let child = command.spawn().map_err(|e| {
            Error::io(
                format!("start {} ({})", spec.name, spec.program.display()),
                e,
            )
        })?;
        let mut process = ServerProcess {
            child,
            port,
            stop_signal: spec.stop_signal,
        };
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if (spec.ready)(port) {
                return Ok(process);
            }
            if let Ok(Some(status)) = process.child.try_wait() {
                return Err(Error::new(
                    ErrorKind::Failed,
                    format!(
                        "{} exited with {status} before it was ready on port {port}; its output:\n{}",
                        spec.name,
                        tail(&log_path)
                    ),
                ));
            }
            if Instant::now() >= deadline {
                // Dropping `process` kills it.
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "{} was not ready on port {port} within {READY_TIMEOUT:?}; its output:\n{}",
                        spec.name,
                        tail(&log_path)
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The loopback port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        // SAFETY: signalling our own child, which has not been reaped yet (so its pid
        // cannot have been reused).
        unsafe { libc::kill(self.child.id() as libc::pid_t, self.stop_signal) };
        let deadline = Instant::now() + STOP_GRACE;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The last 4 KiB of a log file, for error messages.
fn tail(path: &Path) -> String {
    let mut text = Vec::new();
    if let Ok(mut file) = File::open(path) {
        let _ = file.read_to_end(&mut text);
    }
    let start = text.len().saturating_sub(4096);
    String::from_utf8_lossy(&text[start..]).into_owned()
}

/// Connects to 127.0.0.1:`port`, sends `request`, and returns what the server answered
/// first (up to `max` bytes), or `None` if it cannot connect or answers nothing within
/// a second. A building block for readiness probes.
pub fn probe(port: u16, request: &[u8], max: usize) -> Option<Vec<u8>> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
    stream
        .set_write_timeout(Some(Duration::from_secs(1)))
        .ok()?;
    stream.write_all(request).ok()?;
    let mut buf = vec![0; max];
    let n = stream.read(&mut buf).ok()?;
    if n == 0 {
        return None;
    }
    buf.truncate(n);
    Some(buf)
}

/// Finds `name` on `PATH` or in the given extra directories.
pub(crate) fn find_program(name: &str, extra_dirs: &[PathBuf]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(extra_dirs.iter().cloned())
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}
