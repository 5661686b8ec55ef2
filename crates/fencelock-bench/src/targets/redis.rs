//! Redis 7, single instance: `SET key token NX PX ttl` to acquire (polled while busy)
//! and a Lua compare-and-delete to release. The fenced variant takes the lock and
//! `INCR`s a per-lock fence counter in one script.
//!
//! Speaks RESP2 itself (about 80 lines) instead of pulling in a client crate: the
//! benchmark needs four commands and one connection per client.

use anyhow::{anyhow, bail, Context};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use super::{poll_pause, token, Grant, Locker, TTL};

/// Takes the lock and draws the next fence of that lock, atomically.
const FENCED_ACQUIRE: &str = "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then \
     return redis.call('INCR', KEYS[2]) else return -1 end";

/// Deletes the lock only if we still own it.
const RELEASE: &str =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end";

/// Where Redis listens and which variant to run.
#[derive(Debug, Clone)]
pub struct RedisConfig {
    /// Loopback port.
    pub port: u16,
    /// Use the fenced acquire script.
    pub fenced: bool,
}

/// A RESP reply (the kinds these commands return).
#[derive(Debug, PartialEq, Eq)]
enum Reply {
    Status(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
}

/// One Redis connection.
pub struct RedisLocker {
    io: BufReader<TcpStream>,
    fenced: bool,
    acquire_sha: String,
    release_sha: String,
    id: usize,
    n: u64,
    seed: u64,
    held: Option<(String, String)>,
    out: Vec<u8>,
}

impl RedisLocker {
    async fn command(&mut self, args: &[&[u8]]) -> anyhow::Result<Reply> {
        self.out.clear();
        self.out
            .extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
        for arg in args {
            self.out
                .extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
            self.out.extend_from_slice(arg);
            self.out.extend_from_slice(b"\r\n");
        }
        self.io.get_mut().write_all(&self.out).await?;
        self.read_reply().await
    }

    async fn read_reply(&mut self) -> anyhow::Result<Reply> {
        let mut line = String::new();
        if self.io.read_line(&mut line).await? == 0 {
            bail!("redis closed the connection");
        }
        let line = line.trim_end();
        let (kind, rest) = line.split_at(1);
        match kind {
            "+" => Ok(Reply::Status(rest.to_owned())),
            "-" => Err(anyhow!("redis error: {rest}")),
            ":" => Ok(Reply::Int(rest.parse()?)),
            "$" => {
                let len: i64 = rest.parse()?;
                if len < 0 {
                    return Ok(Reply::Bulk(None));
                }
                let mut data = vec![0; len as usize + 2];
                self.io.read_exact(&mut data).await?;
                data.truncate(len as usize);
                Ok(Reply::Bulk(Some(data)))
            }
            _ => bail!("unexpected redis reply {line:?}"),
        }
    }

    async fn load(&mut self, script: &str) -> anyhow::Result<String> {
        match self
            .command(&[b"SCRIPT", b"LOAD", script.as_bytes()])
            .await?
        {
            Reply::Bulk(Some(sha)) => Ok(String::from_utf8(sha)?),
            other => bail!("SCRIPT LOAD answered {other:?}"),
        }
    }
}

impl Locker for RedisLocker {
    type Config = RedisConfig;

    async fn connect(config: &RedisConfig, client: usize) -> anyhow::Result<Self> {
        let stream = TcpStream::connect(("127.0.0.1", config.port))
            .await
            .with_context(|| format!("connect to redis on port {}", config.port))?;
        stream.set_nodelay(true)?;
        let mut locker = RedisLocker {
            io: BufReader::new(stream),
            fenced: config.fenced,
            acquire_sha: String::new(),
            release_sha: String::new(),
            id: client,
            n: 0,
            seed: 0x2545_f491_4f6c_dd1d ^ (client as u64 + 1),
            held: None,
            out: Vec::new(),
        };
        locker.acquire_sha = locker.load(FENCED_ACQUIRE).await?;
        locker.release_sha = locker.load(RELEASE).await?;
        Ok(locker)
    }

    async fn acquire(&mut self, key: &str) -> anyhow::Result<Grant> {
        self.n += 1;
        let owner = token(self.id, self.n);
        let ttl_ms = TTL.as_millis().to_string();
        loop {
            let fence = if self.fenced {
                let sha = self.acquire_sha.clone();
                let fence_key = format!("{key}:fence");
                match self
                    .command(&[
                        b"EVALSHA",
                        sha.as_bytes(),
                        b"2",
                        key.as_bytes(),
                        fence_key.as_bytes(),
                        owner.as_bytes(),
                        ttl_ms.as_bytes(),
                    ])
                    .await?
                {
                    Reply::Int(-1) => None,
                    Reply::Int(fence) => Some(Some(u64::try_from(fence)?)),
                    other => bail!("fenced acquire answered {other:?}"),
                }
            } else {
                match self
                    .command(&[
                        b"SET",
                        key.as_bytes(),
                        owner.as_bytes(),
                        b"NX",
                        b"PX",
                        ttl_ms.as_bytes(),
                    ])
                    .await?
                {
                    Reply::Status(_) => Some(None),
                    Reply::Bulk(None) => None,
                    other => bail!("SET NX answered {other:?}"),
                }
            };
            if let Some(fence) = fence {
                self.held = Some((key.to_owned(), owner));
                return Ok(Grant { fence });
            }
            poll_pause(&mut self.seed).await;
        }
    }

    async fn release(&mut self) -> anyhow::Result<()> {
        if let Some((key, owner)) = self.held.take() {
            let sha = self.release_sha.clone();
            let reply = self
                .command(&[
                    b"EVALSHA",
                    sha.as_bytes(),
                    b"1",
                    key.as_bytes(),
                    owner.as_bytes(),
                ])
                .await?;
            anyhow::ensure!(reply == Reply::Int(1), "the lock was gone at release");
        }
        Ok(())
    }
}
