//! Throwaway Redis deployments: one `redis-server` (plain or TLS), a master watched
//! by one `redis-sentinel`, and a Redis Cluster of three masters.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::{
    find_program, free_port, probe, tail, Error, ErrorKind, ServerProcess, ServerSpec, TestCa,
    PORT_ATTEMPTS, READY_TIMEOUT,
};

/// A `redis-server` on a random loopback port, persistence off, its directory in a
/// temporary dir. Stopped and cleaned up on drop.
#[derive(Debug)]
pub struct Redis {
    // Field order matters: the process stops before its directory is removed.
    process: ServerProcess,
    dir: tempfile::TempDir,
    /// The CA certificate, for a TLS server (what `redis-cli --tls` must trust).
    tls_ca: Option<PathBuf>,
}

fn redis_program(name: &str, package: &str) -> Result<PathBuf, Error> {
    find_program(name, &[]).ok_or_else(|| {
        Error::new(
            ErrorKind::Missing,
            format!("{name} not found on PATH: install the Debian package {package}"),
        )
    })
}

fn temp_dir(prefix: &str) -> Result<tempfile::TempDir, Error> {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .map_err(|e| Error::io("create a temporary directory for redis", e))
}

/// Whether the log in `dir` says the server is ready (for ports a plain probe cannot
/// talk to, such as a TLS port).
fn logged_ready(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("server.log"))
        .is_ok_and(|log| log.contains("Ready to accept connections"))
}

impl Redis {
    /// Starts `redis-server` (Debian package `redis-server`) and waits until it answers
    /// `PING`.
    pub fn start() -> Result<Redis, Error> {
        Redis::start_with(None, &[])
    }

    /// Starts `redis-server` serving only TLS on its port, with the server certificate
    /// of `ca` (clients need not present one).
    pub fn start_tls(ca: &TestCa) -> Result<Redis, Error> {
        Redis::start_with(Some(ca), &[])
    }

    /// Starts `redis-server` with `extra` arguments (TLS with `ca`'s server
    /// certificate if given).
    fn start_with(ca: Option<&TestCa>, extra: &[OsString]) -> Result<Redis, Error> {
        let program = redis_program("redis-server", "redis-server")?;
        let dir = temp_dir("fencelock-redis-")?;
        let dir_path = dir.path().to_owned();
        let tls = ca.map(|ca| {
            [
                OsString::from("--tls-cert-file"),
                ca.server_cert.clone().into_os_string(),
                OsString::from("--tls-key-file"),
                ca.server_key.clone().into_os_string(),
                OsString::from("--tls-ca-cert-file"),
                ca.ca_cert.clone().into_os_string(),
                OsString::from("--tls-auth-clients"),
                OsString::from("no"),
            ]
        });
        let extra = extra.to_vec();
        let args = move |port: u16| -> Vec<OsString> {
            let port = port.to_string();
            let port_args: &[&str] = if tls.is_some() {
                &["--port", "0", "--tls-port", &port]
            } else {
                &["--port", &port]
            };
            let mut args: Vec<OsString> = port_args.iter().map(OsString::from).collect();
            args.extend(
                [
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
                .map(OsString::from),
            );
            args.push(dir_path.clone().into_os_string());
            args.extend(tls.iter().flatten().cloned());
            args.extend(extra.iter().cloned());
            args
        };
        let log_dir = dir.path().to_owned();
        let with_tls = ca.is_some();
        let process = ServerProcess::spawn(&ServerSpec {
            name: "redis-server",
            program,
            args: &args,
            dir: dir.path(),
            run_as: None,
            stop_signal: libc::SIGTERM,
            ready: &|port| {
                if with_tls {
                    logged_ready(&log_dir)
                } else {
                    probe(port, b"PING\r\n", 64).is_some_and(|r| r.starts_with(b"+PONG"))
                }
            },
        })?;
        Ok(Redis {
            process,
            dir,
            tls_ca: ca.map(|ca| ca.ca_cert.clone()),
        })
    }

    /// The port it listens on (on 127.0.0.1).
    pub fn port(&self) -> u16 {
        self.process.port()
    }

    /// `redis://127.0.0.1:PORT/`, or `rediss://localhost:PORT/` for a TLS server (the
    /// name its certificate carries).
    pub fn url(&self) -> String {
        if self.tls_ca.is_some() {
            format!("rediss://localhost:{}/", self.port())
        } else {
            format!("redis://127.0.0.1:{}/", self.port())
        }
    }

    /// Its working directory.
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// Runs `redis-cli` against it with `args` (over TLS for a TLS server) and
    /// returns what it printed; fails if it exits with an error.
    pub fn cli(&self, args: &[&str]) -> Result<String, Error> {
        cli(self.port(), self.tls_ca.as_deref(), args)
    }
}

/// `redis-cli -p PORT ARGS…` on 127.0.0.1 (with `--tls`, trusting `tls_ca`, if
/// given): what it printed.
fn cli(port: u16, tls_ca: Option<&Path>, args: &[&str]) -> Result<String, Error> {
    let program = redis_program("redis-cli", "redis-tools")?;
    let mut command = Command::new(program);
    command.args(["-h", "127.0.0.1", "-p", &port.to_string()]);
    if let Some(ca) = tls_ca {
        command.arg("--tls").arg("--cacert").arg(ca);
    }
    let out = command
        .args(args)
        .output()
        .map_err(|e| Error::io("run redis-cli", e))?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() || text.starts_with("ERR") || text.starts_with("(error)") {
        return Err(Error::new(
            ErrorKind::Failed,
            format!(
                "redis-cli {args:?} on port {port}: {text}{}",
                String::from_utf8_lossy(&out.stderr)
            ),
        ));
    }
    Ok(text)
}

/// Polls `ready` every 50 ms until it holds, at most [`READY_TIMEOUT`].
fn await_condition(what: &str, ready: impl Fn() -> bool) -> Result<(), Error> {
    let deadline = Instant::now() + READY_TIMEOUT;
    while !ready() {
        if Instant::now() >= deadline {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!("{what} within {READY_TIMEOUT:?}"),
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// A master `redis-server` watched by one `redis-sentinel` (Debian package
/// `redis-sentinel`) under the name [`RedisSentinel::MASTER_NAME`]; no replicas.
/// Both on random loopback ports, stopped on drop.
#[derive(Debug)]
pub struct RedisSentinel {
    // The sentinel stops before the master and its directory go.
    sentinel: ServerProcess,
    dir: tempfile::TempDir,
    master: Redis,
    replica: Option<Redis>,
    tls_ca: Option<PathBuf>,
}

impl RedisSentinel {
    /// The name the sentinel monitors the master under.
    pub const MASTER_NAME: &'static str = "fencelock-master";

    /// Starts the master, then a sentinel monitoring it at 127.0.0.1:`master port`.
    pub fn start() -> Result<RedisSentinel, Error> {
        let master = Redis::start()?;
        let announced = master.port();
        RedisSentinel::start_announcing(master, announced)
    }

    /// Starts a sentinel monitoring `master` as if it were at 127.0.0.1:`port` (a
    /// proxy in front of it, say): what the sentinel tells clients.
    pub fn start_announcing(master: Redis, port: u16) -> Result<RedisSentinel, Error> {
        RedisSentinel::start_sentinel(master, port, None)
    }

    /// A TLS-only master watched by a TLS-only sentinel (which reaches the master over
    /// TLS too), both with `ca`'s server certificate.
    pub fn start_tls(ca: &TestCa) -> Result<RedisSentinel, Error> {
        let master = Redis::start_tls(ca)?;
        let announced = master.port();
        RedisSentinel::start_sentinel(master, announced, Some(ca))
    }

    fn start_sentinel(
        master: Redis,
        port: u16,
        ca: Option<&TestCa>,
    ) -> Result<RedisSentinel, Error> {
        let program = redis_program("redis-sentinel", "redis-sentinel")?;
        let dir = temp_dir("fencelock-sentinel-")?;
        let config = dir.path().join("sentinel.conf");
        let master_port = port;
        let dir_path = dir.path().to_owned();
        let log_dir = dir.path().to_owned();
        let tls = ca.map(|ca| {
            format!(
                "port 0\ntls-cert-file {}\ntls-key-file {}\ntls-ca-cert-file {}\n\
                 tls-auth-clients no\ntls-replication yes\n",
                ca.server_cert.display(),
                ca.server_key.display(),
                ca.ca_cert.display(),
            )
        });
        let args = move |port: u16| -> Vec<OsString> {
            // The sentinel rewrites its configuration file: a fresh one per attempt.
            let listen = match &tls {
                Some(tls) => format!("{tls}tls-port {port}\n"),
                None => format!("port {port}\n"),
            };
            let text = format!(
                "{listen}bind 127.0.0.1\ndaemonize no\ndir {}\n\
                 sentinel monitor {} 127.0.0.1 {master_port} 1\n\
                 sentinel down-after-milliseconds {} 5000\n",
                dir_path.display(),
                RedisSentinel::MASTER_NAME,
                RedisSentinel::MASTER_NAME,
            );
            let _ = std::fs::write(&config, text);
            vec![config.clone().into_os_string()]
        };
        let sentinel = ServerProcess::spawn(&ServerSpec {
            name: "redis-sentinel",
            program,
            args: &args,
            dir: dir.path(),
            run_as: None,
            stop_signal: libc::SIGTERM,
            ready: &|port| {
                if ca.is_some() {
                    // A sentinel logs no "Ready to accept connections".
                    std::fs::read_to_string(log_dir.join("server.log"))
                        .is_ok_and(|log| log.contains("+monitor master"))
                } else {
                    probe(port, b"PING\r\n", 64).is_some_and(|r| r.starts_with(b"+PONG"))
                }
            },
        })?;
        let sentinel_port = sentinel.port();
        let tls_ca = ca.map(|ca| ca.ca_cert.clone());
        let announced = format!("{port}");
        await_condition("the sentinel did not name its master", || {
            cli(
                sentinel_port,
                tls_ca.as_deref(),
                &[
                    "SENTINEL",
                    "get-master-addr-by-name",
                    RedisSentinel::MASTER_NAME,
                ],
            )
            .is_ok_and(|out| out.lines().any(|l| l.trim() == announced))
        })
        .map_err(|e| {
            Error::new(
                e.kind(),
                format!("{e}; its output:\n{}", tail(&dir.path().join("server.log"))),
            )
        })?;
        Ok(RedisSentinel {
            sentinel,
            dir,
            master,
            replica: None,
            tls_ca,
        })
    }

    /// Like [`RedisSentinel::start`], with one replica of the master (in sync before
    /// the sentinel starts, so the sentinel knows it at once): what a failover needs.
    pub fn start_with_replica() -> Result<RedisSentinel, Error> {
        let master = Redis::start()?;
        let replica = Redis::start_with(
            None,
            &[
                OsString::from("--replicaof"),
                OsString::from("127.0.0.1"),
                OsString::from(master.port().to_string()),
            ],
        )?;
        await_condition("the replica did not sync", || {
            replica
                .cli(&["INFO", "replication"])
                .is_ok_and(|info| info.lines().any(|l| l.trim() == "master_link_status:up"))
        })?;
        let announced = master.port();
        let mut deployment = RedisSentinel::start_announcing(master, announced)?;
        let sentinel_port = deployment.port();
        await_condition("the sentinel did not see the replica", || {
            cli(
                sentinel_port,
                None,
                &["SENTINEL", "replicas", RedisSentinel::MASTER_NAME],
            )
            .is_ok_and(|out| out.lines().any(|l| l.trim() == replica.port().to_string()))
        })?;
        deployment.replica = Some(replica);
        Ok(deployment)
    }

    /// The replica, if started with one.
    pub fn replica(&self) -> Option<&Redis> {
        self.replica.as_ref()
    }

    /// Makes the sentinel fail the master over to the replica (`SENTINEL FAILOVER`)
    /// and waits until it names the replica as master and the old master follows it.
    pub fn failover(&self) -> Result<(), Error> {
        let replica = self
            .replica
            .as_ref()
            .ok_or_else(|| Error::new(ErrorKind::Failed, "no replica to fail over to"))?;
        // Refused (NOGOODSLAVE) until the sentinel has heard from the replica itself.
        await_condition("the sentinel refused to fail over", || {
            cli(
                self.port(),
                self.tls_ca.as_deref(),
                &["SENTINEL", "FAILOVER", RedisSentinel::MASTER_NAME],
            )
            .is_ok_and(|out| out.trim() == "OK")
        })?;
        let promoted = replica.port().to_string();
        await_condition("the sentinel did not promote the replica", || {
            cli(
                self.port(),
                self.tls_ca.as_deref(),
                &[
                    "SENTINEL",
                    "get-master-addr-by-name",
                    RedisSentinel::MASTER_NAME,
                ],
            )
            .is_ok_and(|out| out.lines().any(|l| l.trim() == promoted))
        })?;
        // The failover ends when the old master is a replica (the sentinel then closes
        // its clients' connections); until then it still takes writes.
        await_condition("the old master was not turned into a replica", || {
            self.master
                .cli(&["INFO", "replication"])
                .is_ok_and(|info| info.lines().any(|l| l.trim() == "role:slave"))
        })
    }

    /// The sentinel's port (on 127.0.0.1).
    pub fn port(&self) -> u16 {
        self.sentinel.port()
    }

    /// The master.
    pub fn master(&self) -> &Redis {
        &self.master
    }

    /// The sentinel's working directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

/// A Redis Cluster of three masters (no replicas) on random loopback ports, its hash
/// slots split evenly between them. Stopped on drop.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<Redis>,
}

impl RedisCluster {
    /// Starts three `redis-server --cluster-enabled yes`, gives each a third of the
    /// slots, joins them (`CLUSTER MEET`) and waits until every node says
    /// `cluster_state:ok`.
    pub fn start() -> Result<RedisCluster, Error> {
        const SLOTS: u16 = 16384;
        let mut nodes = Vec::new();
        let mut buses = Vec::new();
        for _ in 0..3 {
            let (node, bus) = RedisCluster::start_node()?;
            nodes.push(node);
            buses.push(bus);
        }
        let share = SLOTS / 3;
        for (index, node) in nodes.iter().enumerate() {
            let first = share * index as u16;
            let last = if index == 2 {
                SLOTS - 1
            } else {
                first + share - 1
            };
            node.cli(&[
                "CLUSTER",
                "ADDSLOTSRANGE",
                &first.to_string(),
                &last.to_string(),
            ])?;
        }
        for (node, bus) in nodes.iter().zip(&buses).skip(1) {
            nodes[0].cli(&[
                "CLUSTER",
                "MEET",
                "127.0.0.1",
                &node.port().to_string(),
                &bus.to_string(),
            ])?;
        }
        await_condition("the cluster did not come up", || {
            nodes.iter().all(|node| {
                node.cli(&["CLUSTER", "INFO"])
                    .is_ok_and(|info| info.lines().any(|l| l.trim() == "cluster_state:ok"))
            })
        })?;
        Ok(RedisCluster { nodes })
    }

    /// Starts one cluster node and returns it with its bus port. The bus needs a second
    /// port (the default, port + 10000, may be taken or out of range); a bus port chosen
    /// free can still be taken before the node binds it, so a node that fails to start
    /// is retried with a fresh one.
    fn start_node() -> Result<(Redis, u16), Error> {
        let mut last_error = None;
        for _ in 0..PORT_ATTEMPTS {
            let bus = free_port()?;
            let extra: Vec<OsString> = [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-port",
                &bus.to_string(),
                "--cluster-node-timeout",
                "5000",
            ]
            .iter()
            .map(OsString::from)
            .collect();
            match Redis::start_with(None, &extra) {
                Ok(node) => return Ok((node, bus)),
                Err(e) if e.kind == ErrorKind::Failed => last_error = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last_error.expect("at least one attempt"))
    }

    /// The masters.
    pub fn nodes(&self) -> &[Redis] {
        &self.nodes
    }

    /// `redis://127.0.0.1:PORT/` of every master.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(Redis::url).collect()
    }
}
