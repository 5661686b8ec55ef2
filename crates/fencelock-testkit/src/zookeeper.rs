//! A throwaway standalone ZooKeeper (Debian `zookeeper`, ZooKeeper 3.8).

use std::ffi::OsString;
use std::path::PathBuf;

use crate::{find_program, probe, Error, ErrorKind, ServerProcess, ServerSpec};

/// Where Debian's `zookeeper` package puts the server jar.
const ZOOKEEPER_JAR: &str = "/usr/share/java/zookeeper.jar";
/// The logging backend the server jar needs on its class path.
const SLF4J_JAR: &str = "/usr/share/java/slf4j-simple.jar";

/// A standalone ZooKeeper on a random loopback port, its data in a temporary directory,
/// with its durable default (`forceSync=yes`) and sessions of up to 60 s. Killed and
/// removed on drop.
#[derive(Debug)]
pub struct ZooKeeper {
    // Field order matters: the process stops before its directory is removed.
    process: ServerProcess,
    dir: tempfile::TempDir,
}

impl ZooKeeper {
    /// Starts ZooKeeper under `java` and waits until a session handshake succeeds
    /// (`ruok` answers before sessions are served).
    pub fn start() -> Result<ZooKeeper, Error> {
        let jar = PathBuf::from(ZOOKEEPER_JAR);
        if !jar.is_file() {
            return Err(Error::new(
                ErrorKind::Missing,
                format!("{ZOOKEEPER_JAR} not found: install the Debian package zookeeper"),
            ));
        }
        let java = find_program("java", &[]).ok_or_else(|| {
            Error::new(
                ErrorKind::Missing,
                "java not found on PATH: install the Debian package default-jre-headless",
            )
        })?;
        let dir = tempfile::Builder::new()
            .prefix("fencelock-zookeeper-")
            .tempdir()
            .map_err(|e| Error::io("create a temporary directory for zookeeper", e))?;
        let conf = dir.path().join("zoo.cfg");
        let data = dir.path().join("data");
        std::fs::create_dir_all(&data)
            .map_err(|e| Error::io("create the zookeeper data directory", e))?;
        let args = move |port: u16| -> Vec<OsString> {
            let cfg = format!(
                "tickTime=2000\ndataDir={}\nclientPort={port}\nclientPortAddress=127.0.0.1\n\
                 maxClientCnxns=0\nadmin.enableServer=false\nforceSync=yes\n\
                 minSessionTimeout=1000\nmaxSessionTimeout=60000\n",
                data.display()
            );
            // A failed write shows up as ZooKeeper exiting, with its message in the log.
            let _ = std::fs::write(&conf, cfg);
            let mut a: Vec<OsString> = ["-Xms64m", "-Xmx1g", "-cp"].map(OsString::from).into();
            a.push(format!("{}:{SLF4J_JAR}", jar.display()).into());
            a.push("-Dzookeeper.log.dir=.".into());
            a.push("-Dorg.slf4j.simpleLogger.defaultLogLevel=warn".into());
            a.push("org.apache.zookeeper.server.ZooKeeperServerMain".into());
            a.push(conf.clone().into());
            a
        };
        let ready = |port: u16| {
            let mut hello = vec![0, 0, 0, 45];
            hello.extend_from_slice(&[0; 4 + 8]); // protocol version, last zxid
            hello.extend_from_slice(&10_000i32.to_be_bytes()); // session timeout
            hello.extend_from_slice(&[0; 8]); // session id
            hello.extend_from_slice(&16i32.to_be_bytes());
            hello.extend_from_slice(&[0; 16 + 1]); // password, read-only flag
            probe(port, &hello, 64).is_some_and(|r| r.len() >= 20 && r[12..20] != [0; 8])
        };
        let process = ServerProcess::spawn(&ServerSpec {
            name: "zookeeper",
            program: java,
            args: &args,
            dir: dir.path(),
            run_as: None,
            stop_signal: libc::SIGKILL,
            ready: &ready,
        })?;
        Ok(ZooKeeper { process, dir })
    }

    /// The client port (on 127.0.0.1).
    pub fn port(&self) -> u16 {
        self.process.port()
    }

    /// `127.0.0.1:PORT`, a ZooKeeper connect string.
    pub fn connect_string(&self) -> String {
        format!("127.0.0.1:{}", self.port())
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Its working directory (data, `zoo.cfg` and `server.log`).
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// The process and its directory, for callers that manage them together.
    pub fn into_parts(self) -> (ServerProcess, tempfile::TempDir) {
        (self.process, self.dir)
    }
}
