//! A small RESP2 client: one request at a time per connection, Lua scripts by
//! `EVALSHA` (loaded once per connection), and a bounded pool of connections.
//!
//! Hand-written instead of the `redis` crate: the backend needs a handful of commands
//! (`EVALSHA`, `SCRIPT LOAD`, `CONFIG GET`, `SUBSCRIBE`), and the parser below is the
//! whole of it. Every reply is bounded (line length, bulk size, array length, nesting),
//! so a misbehaving server cannot make the client allocate without limit.

use std::time::Duration;

use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, SemaphorePermit};

use fencelock_backend::{Error, ErrorKind};

/// Longest status, error or length line accepted.
const MAX_LINE_BYTES: usize = 64 * 1024;
/// Largest bulk string accepted (`INFO` output is the largest reply the backend reads).
const MAX_BULK_BYTES: usize = 8 * 1024 * 1024;
/// Most elements of one array accepted.
const MAX_ARRAY_LEN: usize = 1024 * 1024;
/// Deepest nesting of arrays accepted.
const MAX_DEPTH: usize = 8;
/// Idle connections a pool keeps for reuse.
const MAX_IDLE: usize = 16;

/// One RESP2 reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reply {
    Status(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Reply>>),
}

impl Reply {
    /// The reply, or an [`Error`] if Redis answered with an error reply.
    pub(crate) fn into_result(self) -> Result<Reply, Error> {
        match self {
            Reply::Error(message) => Err(server_error(&message)),
            reply => Ok(reply),
        }
    }

    /// The elements of an array reply.
    pub(crate) fn into_array(self) -> Result<Vec<Reply>, Error> {
        match self.into_result()? {
            Reply::Array(Some(items)) => Ok(items),
            other => Err(unexpected("an array", &other)),
        }
    }

    /// An integer reply.
    pub(crate) fn as_int(&self) -> Result<i64, Error> {
        match self {
            Reply::Int(n) => Ok(*n),
            other => Err(unexpected("an integer", other)),
        }
    }

    /// A bulk or status reply as text.
    pub(crate) fn as_text(&self) -> Result<&str, Error> {
        match self {
            Reply::Bulk(Some(bytes)) => std::str::from_utf8(bytes)
                .map_err(|_| Error::new(ErrorKind::Protocol, "redis sent a non-UTF-8 string")),
            Reply::Status(text) => Ok(text),
            other => Err(unexpected("a string", other)),
        }
    }
}

pub(crate) fn unexpected(what: &str, reply: &Reply) -> Error {
    let mut shown = format!("{reply:?}");
    shown.truncate(200);
    Error::new(
        ErrorKind::Protocol,
        format!("redis answered {shown}, expected {what}"),
    )
}

/// Maps a Redis error reply to an [`Error`] by its code (the first word).
pub(crate) fn server_error(message: &str) -> Error {
    let code = message.split(' ').next().unwrap_or_default();
    let kind = match code {
        // Transient: the server is starting, busy in a script, failing over, or this
        // is a replica that a failover will promote.
        "LOADING" | "BUSY" | "TRYAGAIN" | "MASTERDOWN" | "CLUSTERDOWN" | "READONLY" => {
            ErrorKind::Unavailable
        }
        "OOM" => ErrorKind::ResourceExhausted,
        "NOAUTH" | "NOPERM" | "WRONGPASS" => ErrorKind::PermissionDenied,
        // Someone else's value under a fencelock key.
        "WRONGTYPE" => ErrorKind::Protocol,
        _ => ErrorKind::Internal,
    };
    Error::new(kind, format!("redis: {message}"))
}

fn broken(what: &str, e: std::io::Error) -> Error {
    Error::new(
        ErrorKind::Unavailable,
        format!("redis connection failed while {what}: {e}"),
    )
}

fn bad_frame(message: impl Into<String>) -> Error {
    Error::new(ErrorKind::Protocol, message)
}

/// Appends the RESP encoding of a command to `out`.
pub(crate) fn encode(args: &[&[u8]], out: &mut Vec<u8>) {
    out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for arg in args {
        out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        out.extend_from_slice(arg);
        out.extend_from_slice(b"\r\n");
    }
}

/// Reads one line up to `\r\n`, without the terminator; at most [`MAX_LINE_BYTES`].
async fn read_line<R: AsyncBufRead + Unpin>(reader: &mut R) -> Result<Vec<u8>, Error> {
    let mut line = Vec::new();
    loop {
        let available = reader.fill_buf().await.map_err(|e| broken("reading", e))?;
        if available.is_empty() {
            return Err(Error::new(
                ErrorKind::Unavailable,
                "redis closed the connection",
            ));
        }
        let (used, done) = match available.iter().position(|&b| b == b'\n') {
            Some(end) => {
                line.extend_from_slice(&available[..end]);
                (end + 1, true)
            }
            None => {
                line.extend_from_slice(available);
                (available.len(), false)
            }
        };
        reader.consume(used);
        if line.len() > MAX_LINE_BYTES {
            return Err(bad_frame("redis sent an over-long line"));
        }
        if done {
            if line.pop() != Some(b'\r') {
                return Err(bad_frame("redis sent a line without \\r\\n"));
            }
            return Ok(line);
        }
    }
}

fn parse_int(bytes: &[u8]) -> Result<i64, Error> {
    std::str::from_utf8(bytes)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad_frame("redis sent a malformed integer"))
}

/// Reads one complete reply (arrays included, iteratively, within the bounds above).
pub(crate) async fn read_reply<R: AsyncBufRead + Unpin>(reader: &mut R) -> Result<Reply, Error> {
    // Arrays being filled: (elements so far, elements expected).
    let mut open: Vec<(Vec<Reply>, usize)> = Vec::new();
    'next: loop {
        let line = read_line(reader).await?;
        let Some((&kind, rest)) = line.split_first() else {
            return Err(bad_frame("redis sent an empty line"));
        };
        let mut value = match kind {
            b'+' => Reply::Status(String::from_utf8_lossy(rest).into_owned()),
            b'-' => Reply::Error(String::from_utf8_lossy(rest).into_owned()),
            b':' => Reply::Int(parse_int(rest)?),
            b'$' => {
                let len = parse_int(rest)?;
                if len < 0 {
                    Reply::Bulk(None)
                } else {
                    let len = usize::try_from(len).unwrap_or(usize::MAX);
                    if len > MAX_BULK_BYTES {
                        return Err(bad_frame(format!("redis sent a {len}-byte string")));
                    }
                    let mut data = vec![0; len + 2];
                    reader
                        .read_exact(&mut data)
                        .await
                        .map_err(|e| broken("reading", e))?;
                    if !data.ends_with(b"\r\n") {
                        return Err(bad_frame("redis sent a string without \\r\\n"));
                    }
                    data.truncate(len);
                    Reply::Bulk(Some(data))
                }
            }
            b'*' => {
                let len = parse_int(rest)?;
                if len < 0 {
                    Reply::Array(None)
                } else if len == 0 {
                    Reply::Array(Some(Vec::new()))
                } else {
                    let len = usize::try_from(len).unwrap_or(usize::MAX);
                    if len > MAX_ARRAY_LEN || open.len() >= MAX_DEPTH {
                        return Err(bad_frame("redis sent an over-large array"));
                    }
                    open.push((Vec::with_capacity(len.min(64)), len));
                    continue 'next;
                }
            }
            _ => return Err(bad_frame("redis sent an unknown reply type")),
        };
        while let Some((mut items, len)) = open.pop() {
            items.push(value);
            if items.len() < len {
                open.push((items, len));
                continue 'next;
            }
            value = Reply::Array(Some(items));
        }
        return Ok(value);
    }
}

/// Where and how to connect.
#[derive(Debug, Clone)]
pub(crate) struct Endpoint {
    pub addr: String,
    pub username: Option<String>,
    pub password: Option<String>,
    pub database: u32,
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
}

impl Endpoint {
    /// A new TCP connection, authenticated and on the configured database.
    pub(crate) async fn connect(&self) -> Result<TcpStream, Error> {
        let connect = async {
            let stream = TcpStream::connect(self.addr.as_str()).await.map_err(|e| {
                Error::new(
                    ErrorKind::Unavailable,
                    format!("cannot connect to redis at {}: {e}", self.addr),
                )
            })?;
            let _ = stream.set_nodelay(true);
            let mut setup: Vec<Vec<Vec<u8>>> = Vec::new();
            if let Some(password) = &self.password {
                let mut auth = vec![b"AUTH".to_vec()];
                if let Some(user) = &self.username {
                    auth.push(user.clone().into_bytes());
                }
                auth.push(password.clone().into_bytes());
                setup.push(auth);
            }
            if self.database != 0 {
                setup.push(vec![
                    b"SELECT".to_vec(),
                    self.database.to_string().into_bytes(),
                ]);
            }
            let mut io = BufReader::new(stream);
            // Pipelined: all set-up commands in one write, then their replies.
            let mut out = Vec::new();
            for command in &setup {
                let args: Vec<&[u8]> = command.iter().map(Vec::as_slice).collect();
                encode(&args, &mut out);
            }
            if !out.is_empty() {
                io.get_mut()
                    .write_all(&out)
                    .await
                    .map_err(|e| broken("connecting", e))?;
                for _ in &setup {
                    read_reply(&mut io).await?.into_result()?;
                }
            }
            Ok(io.into_inner())
        };
        match tokio::time::timeout(self.connect_timeout, connect).await {
            Ok(result) => result,
            Err(_) => Err(Error::new(
                ErrorKind::Unavailable,
                format!(
                    "no connection to redis at {} within {:?}",
                    self.addr, self.connect_timeout
                ),
            )),
        }
    }
}

/// A Lua script, loaded into each connection's server on first use.
#[derive(Debug)]
pub(crate) struct Script {
    pub source: &'static str,
}

/// One connection for request/response commands.
#[derive(Debug)]
pub(crate) struct Conn {
    io: BufReader<TcpStream>,
    out: Vec<u8>,
    /// `SCRIPT LOAD` digests by script (by the address of its `'static` source).
    shas: Vec<(usize, String)>,
    /// Set while a command is in flight: a connection dropped mid-command (timeout,
    /// cancellation) has an unread reply and must not be reused.
    busy: bool,
    request_timeout: Duration,
}

impl Conn {
    /// Sends one command and reads its reply, within the request timeout.
    pub(crate) async fn command(&mut self, args: &[&[u8]]) -> Result<Reply, Error> {
        self.busy = true;
        self.out.clear();
        encode(args, &mut self.out);
        let exchange = async {
            self.io
                .get_mut()
                .write_all(&self.out)
                .await
                .map_err(|e| broken("writing", e))?;
            read_reply(&mut self.io).await
        };
        let reply = match tokio::time::timeout(self.request_timeout, exchange).await {
            Ok(reply) => reply?,
            Err(_) => {
                return Err(Error::new(
                    ErrorKind::Unavailable,
                    format!("redis did not answer within {:?}", self.request_timeout),
                ))
            }
        };
        self.busy = false;
        Ok(reply)
    }

    /// Runs `script` with `keys` and `args` (by `EVALSHA`, loading it first if needed).
    pub(crate) async fn eval(
        &mut self,
        script: &'static Script,
        keys: &[&[u8]],
        args: &[&[u8]],
    ) -> Result<Reply, Error> {
        let id = script.source.as_ptr() as usize;
        for _ in 0..2 {
            let sha = match self.shas.iter().find(|(p, _)| *p == id) {
                Some((_, sha)) => sha.clone(),
                None => {
                    let reply = self
                        .command(&[b"SCRIPT", b"LOAD", script.source.as_bytes()])
                        .await?
                        .into_result()?;
                    let sha = reply.as_text()?.to_owned();
                    self.shas.push((id, sha.clone()));
                    sha
                }
            };
            let numkeys = keys.len().to_string();
            let mut command: Vec<&[u8]> = vec![b"EVALSHA", sha.as_bytes(), numkeys.as_bytes()];
            command.extend_from_slice(keys);
            command.extend_from_slice(args);
            match self.command(&command).await? {
                // The server's script cache was flushed (SCRIPT FLUSH, a restart behind
                // a proxy): load it again, once.
                Reply::Error(message) if message.starts_with("NOSCRIPT") => {
                    self.shas.retain(|(p, _)| *p != id);
                }
                reply => return reply.into_result(),
            }
        }
        Err(Error::new(
            ErrorKind::Internal,
            "redis forgot a script right after loading it",
        ))
    }
}

/// A bounded pool of [`Conn`]s to one server. A connection that failed is dropped, so
/// the next call connects afresh.
#[derive(Debug)]
pub(crate) struct Pool {
    endpoint: Endpoint,
    idle: std::sync::Mutex<Vec<Conn>>,
    permits: Semaphore,
}

impl Pool {
    pub(crate) fn new(endpoint: Endpoint, max_connections: usize) -> Pool {
        Pool {
            endpoint,
            idle: std::sync::Mutex::new(Vec::new()),
            permits: Semaphore::new(max_connections.max(1)),
        }
    }

    pub(crate) fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// A connection for one caller: an idle one, or a new one. Waits (at most the
    /// request timeout) while `max_connections` are in use.
    pub(crate) async fn get(&self) -> Result<Pooled<'_>, Error> {
        let permit = tokio::time::timeout(self.endpoint.request_timeout, self.permits.acquire())
            .await
            .map_err(|_| {
                Error::new(
                    ErrorKind::ResourceExhausted,
                    "every redis connection of this backend stayed busy",
                )
            })?
            .map_err(|_| Error::new(ErrorKind::Unavailable, "the redis backend is closed"))?;
        let reused = self.idle.lock().map(|mut idle| idle.pop()).unwrap_or(None);
        let conn = match reused {
            Some(conn) => conn,
            None => Conn {
                io: BufReader::new(self.endpoint.connect().await?),
                out: Vec::new(),
                shas: Vec::new(),
                busy: false,
                request_timeout: self.endpoint.request_timeout,
            },
        };
        Ok(Pooled {
            pool: self,
            conn: Some(conn),
            _permit: permit,
        })
    }

    /// One command on a pooled connection.
    pub(crate) async fn command(&self, args: &[&[u8]]) -> Result<Reply, Error> {
        self.get().await?.command(args).await
    }

    /// One script on a pooled connection.
    pub(crate) async fn eval(
        &self,
        script: &'static Script,
        keys: &[&[u8]],
        args: &[&[u8]],
    ) -> Result<Reply, Error> {
        self.get().await?.eval(script, keys, args).await
    }
}

/// A connection borrowed from a [`Pool`]; returned on drop unless it broke.
pub(crate) struct Pooled<'a> {
    pool: &'a Pool,
    conn: Option<Conn>,
    _permit: SemaphorePermit<'a>,
}

impl std::ops::Deref for Pooled<'_> {
    type Target = Conn;
    fn deref(&self) -> &Conn {
        self.conn
            .as_ref()
            .expect("a pooled connection is present until drop")
    }
}

impl std::ops::DerefMut for Pooled<'_> {
    fn deref_mut(&mut self) -> &mut Conn {
        self.conn
            .as_mut()
            .expect("a pooled connection is present until drop")
    }
}

impl Drop for Pooled<'_> {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            if let Ok(mut idle) = self.pool.idle.lock() {
                if conn.busy {
                    // It broke (or was abandoned mid-command). The idle ones likely
                    // share its fate (a server restart): reconnect afresh.
                    idle.clear();
                } else if idle.len() < MAX_IDLE {
                    idle.push(conn);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn parse(bytes: &[u8]) -> Result<Reply, Error> {
        read_reply(&mut BufReader::new(bytes)).await
    }

    #[tokio::test]
    async fn parses_every_reply_type_and_nesting() {
        let reply = parse(b"*4\r\n:1\r\n$3\r\nabc\r\n*2\r\n+OK\r\n$-1\r\n-ERR no\r\n")
            .await
            .expect("valid reply");
        assert_eq!(
            reply,
            Reply::Array(Some(vec![
                Reply::Int(1),
                Reply::Bulk(Some(b"abc".to_vec())),
                Reply::Array(Some(vec![Reply::Status("OK".into()), Reply::Bulk(None)])),
                Reply::Error("ERR no".into()),
            ]))
        );
        assert_eq!(
            parse(b"*0\r\n").await.expect("empty"),
            Reply::Array(Some(vec![]))
        );
        assert_eq!(parse(b"*-1\r\n").await.expect("nil"), Reply::Array(None));
    }

    #[tokio::test]
    async fn refuses_malformed_and_oversized_replies() {
        for (what, bytes) in [
            ("unknown type", &b"?x\r\n"[..]),
            ("bad integer", b":12a\r\n"),
            ("no carriage return", b"+OK\n"),
            ("huge bulk", b"$999999999999\r\n"),
            ("huge array", b"*999999999999\r\n"),
            ("bulk without terminator", b"$3\r\nabcxx"),
            (
                "too deep",
                b"*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n:1\r\n",
            ),
        ] {
            let e = parse(bytes).await.expect_err(what);
            assert_eq!(e.kind(), ErrorKind::Protocol, "{what}: {e}");
        }
        let e = parse(b"*2\r\n:1\r\n").await.expect_err("truncated");
        assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    }

    #[test]
    fn error_codes_map_to_kinds() {
        assert_eq!(server_error("LOADING x").kind(), ErrorKind::Unavailable);
        assert_eq!(server_error("OOM x").kind(), ErrorKind::ResourceExhausted);
        assert_eq!(server_error("NOPERM x").kind(), ErrorKind::PermissionDenied);
        assert_eq!(server_error("ERR x").kind(), ErrorKind::Internal);
    }
}
