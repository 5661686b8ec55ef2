//! Starts each lock service as a throwaway process: a random loopback port, a fresh
//! temporary directory, stopped (and the directory removed) on drop. Nothing depends on
//! services already running on the machine. Built on `fencelock_testkit::ServerProcess`.
//!
//! Every durable peer runs with its default, durable settings: etcd and ZooKeeper
//! fsync their logs, PostgreSQL has `fsync` and `synchronous_commit` on, and Redis is
//! started twice, without persistence (its default tier) and with `appendonly yes`
//! plus `appendfsync always`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::Context;
use fencelock_testkit::{
    probe, Etcd, MariaDb, MariaDbOptions, Postgres, PostgresOptions, ServerProcess, ServerSpec,
    ZooKeeper,
};

/// A started peer: its process and its directory.
#[derive(Debug)]
pub struct Peer {
    // Field order: the process stops before its directory is removed.
    process: ServerProcess,
    dir: tempfile::TempDir,
}

impl Peer {
    /// The loopback port it serves on.
    pub fn port(&self) -> u16 {
        self.process.port()
    }

    /// Its process id (for CPU accounting).
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Its temporary directory (data and `server.log`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

fn tempdir(name: &str) -> anyhow::Result<tempfile::TempDir> {
    Ok(tempfile::Builder::new()
        .prefix(&format!("fencelock-bench-{name}-"))
        .tempdir()?)
}

fn os(args: &[&str]) -> Vec<OsString> {
    args.iter().map(OsString::from).collect()
}

fn program(name: &str, candidates: &[&str], package: &str) -> anyhow::Result<PathBuf> {
    candidates
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .with_context(|| format!("{name} not found: install the Debian package {package}"))
}

fn http_ready(port: u16) -> bool {
    probe(
        port,
        b"GET /v1/locks/fencelock-bench-probe HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
        16,
    )
    .is_some_and(|reply| reply.starts_with(b"HTTP/1.1"))
}

/// The fdatasyncs a fencelock server has done so far: their count and their total
/// time in seconds, from its `/metrics` (`fencelock_log_sync_seconds`). `None` if the
/// server does not answer or exports no such histogram.
pub async fn fencelock_log_syncs(port: u16) -> Option<(u64, f64)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let read = async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            .await
            .ok()?;
        let mut text = Vec::new();
        // The exposition is a few kB; a bound keeps a misbehaving server harmless.
        stream.take(1 << 20).read_to_end(&mut text).await.ok()?;
        String::from_utf8(text).ok()
    };
    let text = tokio::time::timeout(std::time::Duration::from_secs(5), read)
        .await
        .ok()??;
    parse_log_syncs(&text)
}

/// The count and sum of `fencelock_log_sync_seconds` in a Prometheus exposition.
fn parse_log_syncs(text: &str) -> Option<(u64, f64)> {
    let value = |name: &str| {
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse::<f64>().ok())
    };
    let count = value("fencelock_log_sync_seconds_count")?;
    let sum = value("fencelock_log_sync_seconds_sum")?;
    Some((count as u64, sum))
}

/// A fencelock server (`fencelock serve`) on `data_dir` (a fresh one if `None`).
pub fn fencelock(binary: &Path, durable: bool, data_dir: Option<&Path>) -> anyhow::Result<Peer> {
    let dir = tempdir("fencelock")?;
    let data = data_dir.map_or_else(|| dir.path().join("data"), Path::to_owned);
    let durability = if durable { "fsync" } else { "none" };
    let args = move |port: u16| {
        let mut a = os(&["serve", "--listen"]);
        a.push(format!("127.0.0.1:{port}").into());
        a.push("--data-dir".into());
        a.push(data.clone().into());
        a.extend(os(&["--durability", durability, "--log-level", "warn"]));
        a
    };
    let process = ServerProcess::spawn(&ServerSpec {
        name: "fencelock",
        program: binary.to_owned(),
        args: &args,
        dir: dir.path(),
        run_as: None,
        stop_signal: libc::SIGKILL,
        ready: &http_ready,
    })?;
    Ok(Peer { process, dir })
}

/// etcd 3.4 (Debian `etcd-server`), a single member.
pub fn etcd() -> anyhow::Result<Peer> {
    let (process, dir) = Etcd::start()?.into_parts();
    Ok(Peer { process, dir })
}

/// ZooKeeper 3.8 (Debian `zookeeper`), standalone, with its default `forceSync=yes`.
pub fn zookeeper() -> anyhow::Result<Peer> {
    let (process, dir) = ZooKeeper::start()?.into_parts();
    Ok(Peer { process, dir })
}

/// Redis 7 (Debian `redis-server`): no persistence, or an append-only file with
/// `appendfsync always` (`fsync_always`).
pub fn redis(fsync_always: bool) -> anyhow::Result<Peer> {
    let bin = program("redis-server", &["/usr/bin/redis-server"], "redis-server")?;
    let dir = tempdir("redis")?;
    let data = dir.path().to_owned();
    let args = move |port: u16| {
        let mut a = os(&["--bind", "127.0.0.1", "--port"]);
        a.push(port.to_string().into());
        a.push("--dir".into());
        a.push(data.clone().into());
        a.extend(os(&[
            "--save",
            "",
            "--daemonize",
            "no",
            "--protected-mode",
            "no",
        ]));
        if fsync_always {
            a.extend(os(&["--appendonly", "yes", "--appendfsync", "always"]));
        } else {
            a.extend(os(&["--appendonly", "no"]));
        }
        a
    };
    let ready = |port: u16| probe(port, b"PING\r\n", 7).is_some_and(|r| r.starts_with(b"+PONG"));
    let process = ServerProcess::spawn(&ServerSpec {
        name: "redis",
        program: bin,
        args: &args,
        dir: dir.path(),
        run_as: None,
        stop_signal: libc::SIGKILL,
        ready: &ready,
    })?;
    Ok(Peer { process, dir })
}

/// PostgreSQL 15 (Debian `postgresql`) with its durable defaults (`fsync`,
/// `synchronous_commit`, `full_page_writes` on); as root it runs as `postgres`.
pub fn postgres() -> anyhow::Result<Peer> {
    let mut options = PostgresOptions::default();
    options.durable = true;
    options.max_connections = 200;
    let (process, dir) = Postgres::start_with(&options)?.into_parts();
    Ok(Peer { process, dir })
}

/// MariaDB (Debian `mariadb-server`) with InnoDB's durable default (the redo log
/// flushed at every commit); as root it runs as `mysql`.
pub fn mariadb() -> anyhow::Result<Peer> {
    let mut options = MariaDbOptions::default();
    options.durable = true;
    options.max_connections = 300;
    let (process, dir) = MariaDb::start_with(&options)?.into_parts();
    Ok(Peer { process, dir })
}

/// The URL of a [`mariadb`] peer (the testkit's account and database).
pub fn mariadb_url(peer: &Peer) -> String {
    format!(
        "mysql://{user}:{user}@127.0.0.1:{}/{}",
        peer.port(),
        fencelock_testkit::MARIADB_DATABASE,
        user = fencelock_testkit::MARIADB_USER,
    )
}

/// The libpq connection string of a [`postgres`] peer.
pub fn postgres_conninfo(peer: &Peer) -> String {
    format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres",
        peer.port()
    )
}

#[cfg(test)]
mod tests {
    use super::parse_log_syncs;

    #[test]
    fn log_syncs_are_read_from_the_histogram_s_count_and_sum() {
        let text = "# TYPE fencelock_log_sync_seconds histogram\n\
            fencelock_log_sync_seconds_bucket{le=\"0.001\"} 7\n\
            fencelock_log_sync_seconds_sum 0.000812\n\
            fencelock_log_sync_seconds_count 7\n\
            fencelock_log_sync_seconds_count_other 9\n";
        assert_eq!(parse_log_syncs(text), Some((7, 0.000812)));
        assert_eq!(parse_log_syncs("fencelock_held 3\n"), None);
    }
}
