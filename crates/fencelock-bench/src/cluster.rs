//! Three-member clusters on loopback — fencelock, etcd and ZooKeeper — that the
//! failover workload can `kill -9` and restart.
//!
//! Unlike [`crate::peers`] (one process, a port chosen at spawn), every member here
//! gets its ports once, before any member starts: each member must name the others'
//! peer ports in its own arguments, and a killed member must come back on the same
//! addresses and the same data directory, as a real member would after a crash.
//! Every member runs with its durable defaults (fencelock `--durability fsync`, etcd's
//! fsync'd WAL, ZooKeeper's `forceSync=yes`). All processes are killed, and the
//! directory removed, on drop.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Members per cluster.
pub const MEMBERS: usize = 3;

/// How long a fresh cluster may take to elect a leader and serve (three JVMs starting
/// on two shared cores take a while).
pub const START_TIMEOUT: Duration = Duration::from_secs(90);

/// How far behind the leader (in log entries) a fencelock member may be and still
/// count as caught up after a restart.
const MAX_LAG_ENTRIES: u64 = 1_000;

/// Where Debian's `zookeeper` package puts the server jar (as `fencelock-testkit`).
const ZOOKEEPER_JAR: &str = "/usr/share/java/zookeeper.jar";
/// The logging backend the server jar needs on its class path.
const SLF4J_JAR: &str = "/usr/share/java/slf4j-simple.jar";

/// Which service the cluster runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `fencelock serve` in cluster mode (`--node-id`, `--peers`).
    Fencelock,
    /// etcd 3.4 (Debian `etcd-server`), a static three-member cluster.
    Etcd,
    /// ZooKeeper 3.8 (Debian `zookeeper`), a three-server ensemble (`QuorumPeerMain`).
    ZooKeeper,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Fencelock => "fencelock",
            Kind::Etcd => "etcd",
            Kind::ZooKeeper => "zookeeper",
        }
    }
}

/// One member: fixed ports and directory, and its process while it runs.
#[derive(Debug)]
struct Member {
    /// 1, 2 or 3 (fencelock's `--node-id`, ZooKeeper's `myid`, etcd's `m1`…).
    id: usize,
    client_port: u16,
    peer_port: u16,
    /// ZooKeeper's leader-election port (unused by the others).
    election_port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

/// A running three-member cluster (see the module docs).
#[derive(Debug)]
pub struct Cluster {
    kind: Kind,
    program: PathBuf,
    /// Appended to every fencelock member's arguments (e.g. `--raft-heartbeat-ms 50`).
    extra_args: Vec<String>,
    members: Vec<Member>,
    // Last: the processes stop (in `Drop`) before the directory goes.
    root: tempfile::TempDir,
}

/// `n` distinct free loopback ports, reserved for this process (see
/// [`fencelock_testkit::free_port`]: no other process picking the same way, nor an
/// outgoing connection, can take one before its member binds it).
fn free_ports(n: usize) -> anyhow::Result<Vec<u16>> {
    (0..n)
        .map(|_| fencelock_testkit::free_port().context("find a free port"))
        .collect()
}

fn program(kind: Kind, fencelock_bin: &Path) -> anyhow::Result<PathBuf> {
    let (path, package) = match kind {
        Kind::Fencelock => {
            anyhow::ensure!(
                fencelock_bin.is_file(),
                "no fencelock server binary at {} (build it: cargo build -p fencelock-cli)",
                fencelock_bin.display()
            );
            return Ok(fencelock_bin.to_owned());
        }
        Kind::Etcd => ("/usr/bin/etcd", "etcd-server"),
        Kind::ZooKeeper => {
            anyhow::ensure!(
                Path::new(ZOOKEEPER_JAR).is_file(),
                "{ZOOKEEPER_JAR} not found: install the Debian package zookeeper"
            );
            ("/usr/bin/java", "default-jre-headless")
        }
    };
    let path = PathBuf::from(path);
    anyhow::ensure!(
        path.is_file(),
        "{} not found: install the Debian package {package}",
        path.display()
    );
    Ok(path)
}

/// The last 4 KiB of a member's log, for error messages.
fn log_tail(dir: &Path) -> String {
    let mut text = Vec::new();
    if let Ok(mut f) = File::open(dir.join("server.log")) {
        let _ = f.read_to_end(&mut text);
    }
    let start = text.len().saturating_sub(4096);
    String::from_utf8_lossy(&text[start..]).into_owned()
}

impl Cluster {
    /// Starts three members of `kind` and waits (at most [`START_TIMEOUT`]) until the
    /// cluster is healthy (see [`Cluster::wait_healthy`]). `fencelock_bin` and
    /// `fencelock_args` (appended to each member's `fencelock serve` arguments) are
    /// only used for [`Kind::Fencelock`].
    pub async fn start(
        kind: Kind,
        fencelock_bin: &Path,
        fencelock_args: &[String],
    ) -> anyhow::Result<Cluster> {
        let program = program(kind, fencelock_bin)?;
        let root = tempfile::Builder::new()
            .prefix(&format!("fencelock-bench-{}-3-", kind.name()))
            .tempdir()?;
        let ports = free_ports(3 * MEMBERS)?;
        let mut members = Vec::with_capacity(MEMBERS);
        for i in 0..MEMBERS {
            let dir = root.path().join(format!("m{}", i + 1));
            std::fs::create_dir_all(dir.join("data"))?;
            members.push(Member {
                id: i + 1,
                client_port: ports[3 * i],
                peer_port: ports[3 * i + 1],
                election_port: ports[3 * i + 2],
                dir,
                child: None,
            });
        }
        let mut cluster = Cluster {
            kind,
            program,
            extra_args: if kind == Kind::Fencelock {
                fencelock_args.to_vec()
            } else {
                Vec::new()
            },
            members,
            root,
        };
        if kind == Kind::ZooKeeper {
            cluster.write_zookeeper_config()?;
        }
        for i in 0..MEMBERS {
            cluster.spawn(i)?;
        }
        cluster.wait_healthy(START_TIMEOUT).await?;
        Ok(cluster)
    }

    /// The service's name (`fencelock`, `etcd`, `zookeeper`).
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Every member's client port, member 1 first.
    pub fn client_ports(&self) -> Vec<u16> {
        self.members.iter().map(|m| m.client_port).collect()
    }

    /// Every member's client URL (`http://127.0.0.1:PORT`), member 1 first.
    pub fn urls(&self) -> Vec<String> {
        self.client_ports()
            .iter()
            .map(|p| format!("http://127.0.0.1:{p}"))
            .collect()
    }

    /// Member `i`'s process id (index from 0), if it runs.
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.members.get(i)?.child.as_ref().map(Child::id)
    }

    /// Where the members' directories (data and `server.log`) are.
    pub fn dir(&self) -> &Path {
        self.root.path()
    }

    fn write_zookeeper_config(&self) -> anyhow::Result<()> {
        let servers: String = self
            .members
            .iter()
            .map(|m| {
                format!(
                    "server.{}=127.0.0.1:{}:{}\n",
                    m.id, m.peer_port, m.election_port
                )
            })
            .collect();
        for m in &self.members {
            // The sample configuration's timing (tickTime 2 s, initLimit 10, syncLimit
            // 5), as the standalone target; `srvr` tells the leader from followers.
            let cfg = format!(
                "tickTime=2000\ninitLimit=10\nsyncLimit=5\ndataDir={}\nclientPort={}\n\
                 clientPortAddress=127.0.0.1\nmaxClientCnxns=0\nadmin.enableServer=false\n\
                 forceSync=yes\nminSessionTimeout=1000\nmaxSessionTimeout=60000\n\
                 4lw.commands.whitelist=srvr\n{servers}",
                m.dir.join("data").display(),
                m.client_port
            );
            std::fs::write(m.dir.join("zoo.cfg"), cfg)?;
            std::fs::write(m.dir.join("data").join("myid"), format!("{}\n", m.id))?;
        }
        Ok(())
    }

    fn args(&self, i: usize) -> Vec<OsString> {
        let m = &self.members[i];
        let data = m.dir.join("data");
        let mut a: Vec<OsString> = Vec::new();
        let mut push = |s: String| a.push(s.into());
        match self.kind {
            Kind::Fencelock => {
                let peers: Vec<String> = self
                    .members
                    .iter()
                    .map(|p| format!("{}=127.0.0.1:{}", p.id, p.peer_port))
                    .collect();
                for s in [
                    "serve".to_owned(),
                    "--node-id".to_owned(),
                    m.id.to_string(),
                    "--listen".to_owned(),
                    format!("127.0.0.1:{}", m.client_port),
                    "--peer-listen".to_owned(),
                    format!("127.0.0.1:{}", m.peer_port),
                    "--peers".to_owned(),
                    peers.join(","),
                    "--data-dir".to_owned(),
                    data.display().to_string(),
                    "--durability".to_owned(),
                    "fsync".to_owned(),
                    "--log-level".to_owned(),
                    "warn".to_owned(),
                ] {
                    push(s);
                }
                for s in &self.extra_args {
                    push(s.clone());
                }
            }
            Kind::Etcd => {
                let initial: Vec<String> = self
                    .members
                    .iter()
                    .map(|p| format!("m{}=http://127.0.0.1:{}", p.id, p.peer_port))
                    .collect();
                let client = format!("http://127.0.0.1:{}", m.client_port);
                let peer = format!("http://127.0.0.1:{}", m.peer_port);
                // etcd's defaults otherwise: heartbeat 100 ms, election timeout 1 s.
                for s in [
                    "--name".to_owned(),
                    format!("m{}", m.id),
                    "--data-dir".to_owned(),
                    data.display().to_string(),
                    "--listen-client-urls".to_owned(),
                    client.clone(),
                    "--advertise-client-urls".to_owned(),
                    client,
                    "--listen-peer-urls".to_owned(),
                    peer.clone(),
                    "--initial-advertise-peer-urls".to_owned(),
                    peer,
                    "--initial-cluster".to_owned(),
                    initial.join(","),
                    "--initial-cluster-state".to_owned(),
                    "new".to_owned(),
                    "--initial-cluster-token".to_owned(),
                    "fencelock-bench".to_owned(),
                    "--log-level".to_owned(),
                    "warn".to_owned(),
                    "--logger".to_owned(),
                    "zap".to_owned(),
                ] {
                    push(s);
                }
            }
            Kind::ZooKeeper => {
                for s in [
                    "-Xms64m".to_owned(),
                    "-Xmx512m".to_owned(),
                    "-cp".to_owned(),
                    format!("{ZOOKEEPER_JAR}:{SLF4J_JAR}"),
                    "-Dzookeeper.log.dir=.".to_owned(),
                    "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn".to_owned(),
                    "org.apache.zookeeper.server.quorum.QuorumPeerMain".to_owned(),
                    m.dir.join("zoo.cfg").display().to_string(),
                ] {
                    push(s);
                }
            }
        }
        a
    }

    fn spawn(&mut self, i: usize) -> anyhow::Result<()> {
        let args = self.args(i);
        let m = &mut self.members[i];
        anyhow::ensure!(m.child.is_none(), "member {} already runs", m.id);
        // Appended: a restarted member's log follows its earlier life.
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(m.dir.join("server.log"))?;
        let child = Command::new(&self.program)
            .args(args)
            .current_dir(&m.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("start {} ({})", self.kind.name(), self.program.display()))?;
        m.child = Some(child);
        Ok(())
    }

    /// `kill -9` member `i` (index from 0) and reap it.
    pub fn kill(&mut self, i: usize) -> anyhow::Result<()> {
        let m = self.members.get_mut(i).context("no such member")?;
        let mut child = m.child.take().context("member is not running")?;
        child.kill().context("kill -9 the member")?;
        child.wait()?;
        Ok(())
    }

    /// Starts member `i` (index from 0) again, on its ports and data directory.
    pub fn restart(&mut self, i: usize) -> anyhow::Result<()> {
        self.spawn(i)
    }

    /// Fails, with the member's log, if a member that should run has exited.
    fn check_alive(&mut self) -> anyhow::Result<()> {
        for m in &mut self.members {
            if let Some(child) = m.child.as_mut() {
                if let Some(status) = child.try_wait()? {
                    m.child = None;
                    bail!(
                        "{} member {} exited with {status}; its log:\n{}",
                        self.kind.name(),
                        m.id,
                        log_tail(&m.dir)
                    );
                }
            }
        }
        Ok(())
    }

    /// The index (from 0) of the member that is leader now, if one is known: what
    /// the members themselves say (fencelock's `/v1/cluster`, etcd's
    /// `/v3/maintenance/status`, ZooKeeper's `srvr`).
    pub async fn leader(&self) -> Option<usize> {
        match self.kind {
            Kind::Fencelock => {
                for m in self.members.iter().filter(|m| m.child.is_some()) {
                    let status = fencelock_status(m.client_port).await;
                    if let Some(id) = status.as_ref().and_then(|s| s["leader"]["id"].as_u64()) {
                        return self.members.iter().position(|m| m.id as u64 == id);
                    }
                }
                None
            }
            Kind::Etcd => {
                for (i, m) in self.members.iter().enumerate() {
                    if m.child.is_some() && etcd_is_leader(m.client_port).await == Some(true) {
                        return Some(i);
                    }
                }
                None
            }
            Kind::ZooKeeper => {
                for (i, m) in self.members.iter().enumerate() {
                    if m.child.is_some()
                        && zookeeper_mode(m.client_port).await.as_deref() == Some("leader")
                    {
                        return Some(i);
                    }
                }
                None
            }
        }
    }

    /// Whether every member runs and the cluster is whole: for fencelock, all three
    /// agree on one leader and, in the leader's view, each is within
    /// 1,000 log entries of it; for etcd, every member's `/health` is true (it has a
    /// leader and no alarm) and one is leader; for ZooKeeper, every server serves as
    /// leader or follower, exactly one as leader.
    pub async fn healthy(&self) -> bool {
        if self.members.iter().any(|m| m.child.is_none()) {
            return false;
        }
        match self.kind {
            Kind::Fencelock => {
                let mut leader = None;
                let mut leader_view = None;
                for m in &self.members {
                    let Some(status) = fencelock_status(m.client_port).await else {
                        return false;
                    };
                    let Some(id) = status["leader"]["id"].as_u64() else {
                        return false;
                    };
                    if leader.is_some_and(|l| l != id) {
                        return false;
                    }
                    leader = Some(id);
                    if m.id as u64 == id {
                        leader_view = Some(status);
                    }
                }
                let Some(view) = leader_view else {
                    return false;
                };
                let matched: Vec<Option<u64>> = view["members"]
                    .as_array()
                    .map(|ms| ms.iter().map(|m| m["matched_index"].as_u64()).collect())
                    .unwrap_or_default();
                if matched.len() != MEMBERS || matched.iter().any(Option::is_none) {
                    return false;
                }
                let matched: Vec<u64> = matched.into_iter().flatten().collect();
                let (lo, hi) = (
                    matched.iter().min().copied().unwrap_or(0),
                    matched.iter().max().copied().unwrap_or(0),
                );
                hi - lo <= MAX_LAG_ENTRIES
            }
            Kind::Etcd => {
                let mut leaders = 0;
                for m in &self.members {
                    let health = http_get(m.client_port, "GET", "/health", "").await;
                    if !health.is_some_and(|h| h.contains("\"health\":\"true\"")) {
                        return false;
                    }
                    leaders += usize::from(etcd_is_leader(m.client_port).await == Some(true));
                }
                leaders == 1
            }
            Kind::ZooKeeper => {
                let mut leaders = 0;
                for m in &self.members {
                    match zookeeper_mode(m.client_port).await.as_deref() {
                        Some("leader") => leaders += 1,
                        Some("follower") => {}
                        _ => return false,
                    }
                }
                leaders == 1
            }
        }
    }

    /// Waits until [`Cluster::healthy`], at most `timeout`; fails early, with its log,
    /// if a member exits.
    pub async fn wait_healthy(&mut self, timeout: Duration) -> anyhow::Result<Duration> {
        let start = Instant::now();
        loop {
            self.check_alive()?;
            if self.healthy().await {
                return Ok(start.elapsed());
            }
            if start.elapsed() >= timeout {
                let logs: Vec<String> = self
                    .members
                    .iter()
                    .map(|m| format!("member {}:\n{}", m.id, log_tail(&m.dir)))
                    .collect();
                bail!(
                    "the {}-member {} cluster was not healthy within {timeout:?}; logs:\n{}",
                    MEMBERS,
                    self.kind.name(),
                    logs.join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for m in &mut self.members {
            if let Some(mut child) = m.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// One HTTP/1.1 request to 127.0.0.1:`port` and the body of its answer (any status),
/// or `None` if there is none within a second. Small bodies only (1 MiB bound).
pub async fn http_get(port: u16, method: &str, path: &str, body: &str) -> Option<String> {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut text = Vec::new();
        stream.take(1 << 20).read_to_end(&mut text).await.ok()?;
        let text = String::from_utf8(text).ok()?;
        let (_, body) = text.split_once("\r\n\r\n")?;
        Some(body.to_owned())
    };
    tokio::time::timeout(Duration::from_secs(1), exchange)
        .await
        .ok()?
}

/// A fencelock member's `/v1/cluster`.
pub async fn fencelock_status(port: u16) -> Option<Value> {
    let body = http_get(port, "GET", "/v1/cluster", "").await?;
    serde_json::from_str(&body).ok()
}

/// Whether this etcd member is the leader (`leader` = its own id in
/// `/v3/maintenance/status`).
async fn etcd_is_leader(port: u16) -> Option<bool> {
    let body = http_get(port, "POST", "/v3/maintenance/status", "{}").await?;
    let status: Value = serde_json::from_str(&body).ok()?;
    let me = status["header"]["member_id"].as_str()?;
    let leader = status["leader"].as_str()?;
    Some(me == leader)
}

/// A ZooKeeper server's `Mode:` from the `srvr` four-letter word (`leader`,
/// `follower`; `None` while it does not serve).
async fn zookeeper_mode(port: u16) -> Option<String> {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        stream.write_all(b"srvr").await.ok()?;
        let mut text = Vec::new();
        stream.take(64 << 10).read_to_end(&mut text).await.ok()?;
        let text = String::from_utf8(text).ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix("Mode: "))
            .map(|m| m.trim().to_owned())
    };
    tokio::time::timeout(Duration::from_secs(1), exchange)
        .await
        .ok()?
}
