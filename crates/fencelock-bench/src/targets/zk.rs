//! ZooKeeper 3.8 with the Curator `InterProcessMutex` recipe: create an
//! ephemeral-sequential node under the lock's parent, list the children, and if ours
//! is not the lowest, watch the one just before it and wait for its deletion. Release
//! deletes our node. The fence is our node's sequence number, which orders holders.
//!
//! Speaks the ZooKeeper (jute) protocol itself: connect, create, delete, exists,
//! getChildren, ping and watch notifications, one request at a time per connection.
//! About 200 lines instead of a client crate with its own runtime plumbing.

use std::time::Duration;

use anyhow::{bail, Context};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use super::{Grant, Locker, TTL};

const OP_CREATE: i32 = 1;
const OP_DELETE: i32 = 2;
const OP_EXISTS: i32 = 3;
const OP_GET_CHILDREN: i32 = 8;
const OP_PING: i32 = 11;
const XID_WATCH: i32 = -1;
const XID_PING: i32 = -2;
const ERR_NO_NODE: i32 = -101;
const ERR_NODE_EXISTS: i32 = -110;
const FLAG_EPHEMERAL_SEQUENTIAL: i32 = 3;
/// The parent of every lock's parent.
const ROOT: &str = "/fencelock-bench";

/// One ZooKeeper session.
pub struct ZkLocker {
    io: BufReader<TcpStream>,
    xid: i32,
    ping_every: Duration,
    node: Option<String>,
    parents: std::collections::HashSet<String>,
}

struct Writer(Vec<u8>);

impl Writer {
    fn int(&mut self, v: i32) -> &mut Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn long(&mut self, v: i64) -> &mut Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn string(&mut self, s: &str) -> &mut Self {
        self.int(s.len() as i32);
        self.0.extend_from_slice(s.as_bytes());
        self
    }
    fn bool(&mut self, b: bool) -> &mut Self {
        self.0.push(b as u8);
        self
    }
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn int(&mut self) -> anyhow::Result<i32> {
        anyhow::ensure!(self.0.len() >= 4, "short zookeeper frame");
        let (head, rest) = self.0.split_at(4);
        self.0 = rest;
        Ok(i32::from_be_bytes(head.try_into()?))
    }
    fn long(&mut self) -> anyhow::Result<i64> {
        Ok(((self.int()? as i64) << 32) | (self.int()? as u32 as i64))
    }
    fn string(&mut self) -> anyhow::Result<String> {
        let len = self.int()?;
        if len < 0 {
            return Ok(String::new());
        }
        anyhow::ensure!(self.0.len() >= len as usize, "short zookeeper string");
        let (head, rest) = self.0.split_at(len as usize);
        self.0 = rest;
        Ok(String::from_utf8(head.to_vec())?)
    }
}

impl ZkLocker {
    async fn send(&mut self, xid: i32, op: i32, body: &[u8]) -> anyhow::Result<()> {
        let mut frame = Writer(Vec::with_capacity(12 + body.len()));
        frame.int(8 + body.len() as i32).int(xid).int(op);
        frame.0.extend_from_slice(body);
        self.io.get_mut().write_all(&frame.0).await?;
        Ok(())
    }

    async fn read_frame(&mut self) -> anyhow::Result<Vec<u8>> {
        let len = self.io.read_i32().await?;
        anyhow::ensure!(
            (0..16 << 20).contains(&len),
            "bad zookeeper frame length {len}"
        );
        let mut frame = vec![0; len as usize];
        self.io.read_exact(&mut frame).await?;
        Ok(frame)
    }

    /// Sends one request and returns (error code, response body), skipping pings and
    /// watch notifications that arrive meanwhile.
    async fn call(&mut self, op: i32, body: &[u8]) -> anyhow::Result<(i32, Vec<u8>)> {
        self.xid += 1;
        let xid = self.xid;
        self.send(xid, op, body).await?;
        loop {
            let frame = self.read_frame().await?;
            let mut r = Reader(&frame);
            let got = r.int()?;
            let _zxid = r.long()?;
            let err = r.int()?;
            if got == xid {
                return Ok((err, r.0.to_vec()));
            }
            anyhow::ensure!(
                got == XID_WATCH || got == XID_PING,
                "zookeeper answered xid {got}, expected {xid}"
            );
        }
    }

    /// Waits for the deletion notification of `path`, pinging to keep the session.
    async fn wait_deleted(&mut self, path: &str) -> anyhow::Result<()> {
        loop {
            let frame = match tokio::time::timeout(self.ping_every, self.read_frame()).await {
                Ok(frame) => frame?,
                Err(_) => {
                    self.send(XID_PING, OP_PING, &[]).await?;
                    continue;
                }
            };
            let mut r = Reader(&frame);
            let xid = r.int()?;
            let _zxid = r.long()?;
            let _err = r.int()?;
            if xid == XID_WATCH {
                let _type = r.int()?;
                let _state = r.int()?;
                if r.string()? == path {
                    return Ok(());
                }
            }
        }
    }

    async fn create(&mut self, path: &str, flags: i32) -> anyhow::Result<(i32, String)> {
        let mut body = Writer(Vec::new());
        body.string(path).int(0); // empty data
        body.int(1).int(31).string("world").string("anyone"); // OPEN_ACL_UNSAFE
        body.int(flags);
        let (err, rest) = self.call(OP_CREATE, &body.0).await?;
        if err != 0 {
            return Ok((err, String::new()));
        }
        Ok((0, Reader(&rest).string()?))
    }

    async fn ensure_parent(&mut self, parent: &str) -> anyhow::Result<()> {
        if self.parents.contains(parent) {
            return Ok(());
        }
        for path in [ROOT, parent] {
            let (err, _) = self.create(path, 0).await?;
            anyhow::ensure!(
                err == 0 || err == ERR_NODE_EXISTS,
                "create {path}: error {err}"
            );
        }
        self.parents.insert(parent.to_owned());
        Ok(())
    }
}

fn sequence(name: &str) -> anyhow::Result<u64> {
    let digits = name.rsplit('-').next().unwrap_or_default();
    digits
        .parse()
        .with_context(|| format!("no sequence number in {name}"))
}

impl Locker for ZkLocker {
    /// The loopback client port.
    type Config = u16;

    async fn connect(port: &u16, _client: usize) -> anyhow::Result<Self> {
        let stream = TcpStream::connect(("127.0.0.1", *port))
            .await
            .with_context(|| format!("connect to zookeeper on port {port}"))?;
        stream.set_nodelay(true)?;
        let mut locker = ZkLocker {
            io: BufReader::new(stream),
            xid: 0,
            ping_every: TTL / 3,
            node: None,
            parents: Default::default(),
        };
        let mut request = Writer(Vec::new());
        request.int(0).long(0).int(TTL.as_millis() as i32).long(0);
        request.int(16).0.extend_from_slice(&[0; 16]);
        request.bool(false);
        let mut frame = Writer(Vec::new());
        frame.int(request.0.len() as i32);
        frame.0.extend_from_slice(&request.0);
        locker.io.get_mut().write_all(&frame.0).await?;
        let answer = locker.read_frame().await?;
        let mut r = Reader(&answer);
        let _protocol = r.int()?;
        let timeout_ms = r.int()?;
        let session = r.long()?;
        anyhow::ensure!(
            timeout_ms > 0 && session != 0,
            "zookeeper refused the session"
        );
        locker.ping_every = Duration::from_millis(timeout_ms as u64 / 3);
        Ok(locker)
    }

    async fn acquire(&mut self, key: &str) -> anyhow::Result<Grant> {
        let parent = format!("{ROOT}/{}", key.replace('/', "_"));
        self.ensure_parent(&parent).await?;
        let (err, node) = self
            .create(&format!("{parent}/lock-"), FLAG_EPHEMERAL_SEQUENTIAL)
            .await?;
        anyhow::ensure!(err == 0, "create lock node: error {err}");
        let mine = sequence(&node)?;
        self.node = Some(node);
        loop {
            let mut body = Writer(Vec::new());
            body.string(&parent).bool(false);
            let (err, rest) = self.call(OP_GET_CHILDREN, &body.0).await?;
            anyhow::ensure!(err == 0, "getChildren {parent}: error {err}");
            let mut r = Reader(&rest);
            let count = r.int()?;
            let mut predecessor: Option<(u64, String)> = None;
            for _ in 0..count {
                let child = r.string()?;
                let seq = sequence(&child)?;
                if seq < mine && predecessor.as_ref().is_none_or(|(p, _)| seq > *p) {
                    predecessor = Some((seq, child));
                }
            }
            let Some((_, child)) = predecessor else {
                return Ok(Grant { fence: Some(mine) });
            };
            let path = format!("{parent}/{child}");
            let mut body = Writer(Vec::new());
            body.string(&path).bool(true);
            let (err, _) = self.call(OP_EXISTS, &body.0).await?;
            match err {
                ERR_NO_NODE => continue,
                0 => self.wait_deleted(&path).await?,
                _ => bail!("exists {path}: error {err}"),
            }
        }
    }

    async fn release(&mut self) -> anyhow::Result<()> {
        if let Some(node) = self.node.take() {
            let mut body = Writer(Vec::new());
            body.string(&node).int(-1);
            let (err, _) = self.call(OP_DELETE, &body.0).await?;
            anyhow::ensure!(err == 0, "delete {node}: error {err}");
        }
        Ok(())
    }
}
