//! A throwaway standalone ZooKeeper (Debian `zookeeper`, ZooKeeper 3.8), optionally
//! with a TLS client port.

use std::cell::Cell;
use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::{find_program, free_port, probe, Error, ErrorKind, ServerProcess, ServerSpec, TestCa};

/// Where Debian's `zookeeper` package puts the server jar.
const ZOOKEEPER_JAR: &str = "/usr/share/java/zookeeper.jar";
/// The logging backend the server jar needs on its class path.
const SLF4J_JAR: &str = "/usr/share/java/slf4j-simple.jar";
/// Netty codecs the secure port needs that the jar's manifest does not list (Debian's
/// `libnetty-java`, a dependency of `zookeeper`).
const NETTY_JARS: [&str; 2] = [
    "/usr/share/java/netty-codec.jar",
    "/usr/share/java/netty-resolver.jar",
];
/// The four-letter words the server answers (readiness, connection counts).
const FOUR_LETTER_WORDS: &str = "srvr,stat,cons,mntr,ruok";
/// Longest wait for a four-letter word's answer.
const FOUR_LETTER_TIMEOUT: Duration = Duration::from_secs(5);

/// The superuser configured with `superDigest`: `addauth digest super:fencelock-super`
/// passes every ACL. (Any other `user:password` authenticates as that digest user.)
pub const ZOOKEEPER_SUPER_USER: (&str, &str) = ("super", "fencelock-super");
/// `base64(sha1("super:fencelock-super"))`, as ZooKeeper's `superDigest` wants it.
const SUPER_DIGEST: &str = "super:HT9Iz1SsjdEt80bfhrhFw2zVcpA=";

/// How to start a [`ZooKeeper`].
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct ZooKeeperOptions {
    /// Also serve TLS on a second port (`secureClientPort`, Netty), with a certificate
    /// for `localhost`/`127.0.0.1` from a fresh [`TestCa`]. No client certificate is
    /// asked for.
    pub tls: bool,
}

/// A standalone ZooKeeper on a random loopback port, its data in a temporary directory,
/// with its durable default (`forceSync=yes`), sessions of 1 to 60 s, a digest
/// superuser ([`ZOOKEEPER_SUPER_USER`]) and the four-letter words `srvr`, `stat`,
/// `cons`, `mntr` and `ruok`. Killed and removed on drop.
#[derive(Debug)]
pub struct ZooKeeper {
    // Field order matters: the process stops before its directory is removed.
    process: ServerProcess,
    secure_port: Option<u16>,
    ca: Option<TestCa>,
    dir: tempfile::TempDir,
}

impl ZooKeeper {
    /// Starts a plain ZooKeeper (see [`ZooKeeper::start_with`]).
    pub fn start() -> Result<ZooKeeper, Error> {
        ZooKeeper::start_with(&ZooKeeperOptions::default())
    }

    /// Starts ZooKeeper under `java` and waits until it serves sessions (`srvr`
    /// reports a mode; `ruok` answers before sessions are served) and, with TLS, until
    /// the secure port accepts connections.
    pub fn start_with(options: &ZooKeeperOptions) -> Result<ZooKeeper, Error> {
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
        let mut tls_conf = String::new();
        let ca = if options.tls {
            let tls_dir = dir.path().join("tls");
            std::fs::create_dir_all(&tls_dir)
                .map_err(|e| Error::io("create the zookeeper tls directory", e))?;
            let ca = TestCa::create(&tls_dir)?;
            // ZooKeeper's PEM key store: the private key and the certificate in one file.
            let keystore = tls_dir.join("keystore.pem");
            let read = |path: &PathBuf| {
                std::fs::read_to_string(path)
                    .map_err(|e| Error::io(format!("read {}", path.display()), e))
            };
            let pem = read(&ca.server_key)? + &read(&ca.server_cert)?;
            std::fs::write(&keystore, pem).map_err(|e| Error::io("write keystore.pem", e))?;
            for jar in NETTY_JARS {
                if !std::path::Path::new(jar).is_file() {
                    return Err(Error::new(
                        ErrorKind::Missing,
                        format!("{jar} not found: install the Debian package libnetty-java"),
                    ));
                }
            }
            tls_conf = format!(
                "serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory\n\
                 secureClientPortAddress=127.0.0.1\n\
                 ssl.keyStore.location={}\nssl.keyStore.type=PEM\n\
                 ssl.trustStore.location={}\nssl.trustStore.type=PEM\n\
                 ssl.clientAuth=none\n",
                keystore.display(),
                ca.ca_cert.display()
            );
            Some(ca)
        } else {
            None
        };
        let secure_port = Cell::new(0u16);
        let args = |port: u16| -> Vec<OsString> {
            let mut cfg = format!(
                "tickTime=2000\ndataDir={}\nclientPort={port}\nclientPortAddress=127.0.0.1\n\
                 maxClientCnxns=0\nadmin.enableServer=false\nforceSync=yes\n\
                 minSessionTimeout=1000\nmaxSessionTimeout=60000\n\
                 4lw.commands.whitelist={FOUR_LETTER_WORDS}\n{tls_conf}",
                data.display()
            );
            if options.tls {
                // A free port for this attempt; a clash shows up as ZooKeeper exiting,
                // and the next attempt picks both ports again.
                secure_port.set(free_port().unwrap_or(0));
                cfg.push_str(&format!("secureClientPort={}\n", secure_port.get()));
            }
            // A failed write shows up as ZooKeeper exiting, with its message in the log.
            let _ = std::fs::write(&conf, cfg);
            let mut class_path = format!("{}:{SLF4J_JAR}", jar.display());
            if options.tls {
                NETTY_JARS
                    .iter()
                    .for_each(|j| class_path += &format!(":{j}"));
            }
            let mut a: Vec<OsString> = ["-Xms64m", "-Xmx1g", "-cp"].map(OsString::from).into();
            a.push(class_path.into());
            a.push("-Dzookeeper.log.dir=.".into());
            a.push("-Dorg.slf4j.simpleLogger.defaultLogLevel=warn".into());
            a.push(
                format!("-Dzookeeper.DigestAuthenticationProvider.superDigest={SUPER_DIGEST}")
                    .into(),
            );
            a.push("org.apache.zookeeper.server.ZooKeeperServerMain".into());
            a.push(conf.clone().into());
            a
        };
        let ready = |port: u16| {
            let serving = probe(port, b"srvr", 4096)
                .is_some_and(|answer| String::from_utf8_lossy(&answer).contains("Mode:"));
            let secure = !options.tls || {
                let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, secure_port.get()));
                TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_ok()
            };
            serving && secure
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
        Ok(ZooKeeper {
            process,
            secure_port: options.tls.then(|| secure_port.get()),
            ca,
            dir,
        })
    }

    /// The client port (on 127.0.0.1).
    pub fn port(&self) -> u16 {
        self.process.port()
    }

    /// `127.0.0.1:PORT`, a ZooKeeper connect string.
    pub fn connect_string(&self) -> String {
        format!("127.0.0.1:{}", self.port())
    }

    /// The TLS client port, when started with [`ZooKeeperOptions::tls`].
    pub fn secure_port(&self) -> Option<u16> {
        self.secure_port
    }

    /// The CA that signed the TLS port's certificate, when started with TLS.
    pub fn ca(&self) -> Option<&TestCa> {
        self.ca.as_ref()
    }

    /// Sends a four-letter word (`cons`, `mntr`, `stat`, `srvr`, `ruok`) to the plain
    /// port and returns the whole answer.
    pub fn four_letter(&self, word: &str) -> Result<String, Error> {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, self.port()));
        let io = |e| Error::io(format!("zookeeper {word}"), e);
        let mut stream = TcpStream::connect_timeout(&addr, FOUR_LETTER_TIMEOUT).map_err(io)?;
        stream
            .set_read_timeout(Some(FOUR_LETTER_TIMEOUT))
            .map_err(io)?;
        stream.write_all(word.as_bytes()).map_err(io)?;
        // The server closes the connection after its answer; the read timeout and the
        // deadline bound a server that does not.
        let deadline = Instant::now() + FOUR_LETTER_TIMEOUT;
        let mut answer = Vec::new();
        let mut chunk = [0; 4096];
        while Instant::now() < deadline {
            match stream.read(&mut chunk).map_err(io)? {
                0 => return Ok(String::from_utf8_lossy(&answer).into_owned()),
                n => answer.extend_from_slice(&chunk[..n]),
            }
        }
        Err(Error::new(
            ErrorKind::Timeout,
            format!("zookeeper {word}: no end of answer within {FOUR_LETTER_TIMEOUT:?}"),
        ))
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
