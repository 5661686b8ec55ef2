//! Shared helpers for the server's integration tests: a throwaway server per test and a
//! tiny HTTP/1.1 client written directly on a tokio `TcpStream`.
//!
//! The client is deliberately dumb so that tests can send anything: arbitrary methods,
//! paths and headers, bodies of any size and content type, or raw bytes that are not
//! HTTP at all. One TCP connection per request; responses are parsed by
//! `Content-Length`, `Transfer-Encoding: chunked` or end of stream.
#![allow(dead_code)] // Each test binary uses a different part of this module.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use fencelock_server::{EngineConfig, Server, ServerConfig};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Longest any single request may take before the test fails (instead of hanging).
pub const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// A server on a random port with its own temporary data directory.
pub struct TestServer {
    server: Server,
    /// A client for the server's address.
    pub client: Client,
    dir: tempfile::TempDir,
}

impl TestServer {
    /// Starts a server on `127.0.0.1:0` with a fresh temporary data directory.
    pub async fn start() -> TestServer {
        TestServer::start_with(|_| {}).await
    }

    /// Like [`TestServer::start`], with the engine configuration adjusted by `adjust`.
    pub async fn start_with(adjust: impl FnOnce(&mut EngineConfig)) -> TestServer {
        TestServer::start_configured(|c| adjust(&mut c.engine)).await
    }

    /// Like [`TestServer::start`], with the whole server configuration adjusted.
    pub async fn start_configured(adjust: impl FnOnce(&mut ServerConfig)) -> TestServer {
        let dir = tempfile::tempdir().expect("create a temporary data directory");
        let mut config = ServerConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            EngineConfig::new(dir.path()),
        );
        adjust(&mut config);
        let server = Server::start(config).await.expect("server starts");
        let client = Client::new(server.local_addr());
        TestServer {
            server,
            client,
            dir,
        }
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    /// The underlying server.
    pub fn server(&self) -> &Server {
        &self.server
    }

    /// Shuts the server down gracefully and asserts that it stopped cleanly, within
    /// [`IO_TIMEOUT`].
    pub async fn stop(self) {
        let TestServer { server, dir, .. } = self;
        let stopped = tokio::time::timeout(IO_TIMEOUT, server.shutdown())
            .await
            .expect("server shuts down in time");
        stopped.expect("server shuts down cleanly");
        drop(dir);
    }
}

/// A parsed HTTP response.
#[derive(Debug, Clone)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Header fields, names lower-cased, in order.
    pub headers: Vec<(String, String)>,
    /// The body (de-chunked).
    pub body: Vec<u8>,
}

impl Response {
    /// The first header with this (case-insensitive) name.
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body as text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as JSON; panics with the status and body if it is not JSON.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "response {} is not JSON ({e}): {:?}",
                self.status,
                self.text()
            )
        })
    }

    /// `error.code` of a JSON error body, if the body is one.
    pub fn error_code(&self) -> Option<String> {
        let v: Value = serde_json::from_slice(&self.body).ok()?;
        v.get("error")?.get("code")?.as_str().map(str::to_owned)
    }

    /// Panics (showing the body) unless the status is `status`; returns the JSON body.
    pub fn expect_json(&self, status: u16) -> Value {
        assert_eq!(
            self.status,
            status,
            "unexpected status; body: {}",
            self.text()
        );
        self.json()
    }

    /// Panics unless this is an error response with `status` and `code` in the
    /// documented shape `{"error":{"code","message"}}` with a non-empty message.
    /// Returns the message.
    pub fn expect_error(&self, status: u16, code: &str) -> String {
        let v = self.expect_json(status);
        assert_eq!(v["error"]["code"], code, "unexpected error code; body: {v}");
        let message = v["error"]["message"]
            .as_str()
            .unwrap_or_else(|| panic!("error without a message: {v}"));
        assert!(!message.is_empty(), "empty error message: {v}");
        message.to_owned()
    }
}

/// An HTTP/1.1 client for one server address. Every request uses its own connection.
#[derive(Debug, Clone, Copy)]
pub struct Client {
    addr: SocketAddr,
}

/// A request whose head and body have been written but whose response has not been
/// read yet (for example a long poll). Dropping it closes the connection.
pub struct Pending {
    stream: TcpStream,
}

impl Pending {
    /// Reads the response, failing the test after [`IO_TIMEOUT`].
    pub async fn response(mut self) -> Response {
        tokio::time::timeout(IO_TIMEOUT, read_response(&mut self.stream))
            .await
            .expect("response arrives in time")
            .expect("response is well-formed HTTP")
    }

    /// Reads the response, or `None` if none arrived within `within`.
    pub async fn response_within(&mut self, within: Duration) -> Option<Response> {
        match tokio::time::timeout(within, read_response(&mut self.stream)).await {
            Ok(r) => Some(r.expect("response is well-formed HTTP")),
            Err(_) => None,
        }
    }

    /// Reads raw bytes (head and body, for a stream such as SSE) until they contain
    /// `needle`; returns them as text. Fails the test after `within`.
    pub async fn read_until(&mut self, needle: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        let mut seen = Vec::new();
        let mut buf = vec![0u8; 8192];
        // Only the bytes that came since the last look (and a needle's length
        // before them) can hold a new match: a long stream is not scanned anew
        // after every read.
        let mut from = 0;
        while find(&seen[from..], needle.as_bytes()).is_none() {
            from = seen.len().saturating_sub(needle.len());
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.stream.read(&mut buf)).await {
                Ok(Ok(n)) if n > 0 => seen.extend_from_slice(&buf[..n]),
                Ok(_) => panic!(
                    "stream ended before {needle:?}: {}",
                    String::from_utf8_lossy(&seen)
                ),
                Err(_) => panic!(
                    "no {needle:?} within {within:?}: {}",
                    String::from_utf8_lossy(&seen)
                ),
            }
        }
        String::from_utf8_lossy(&seen).into_owned()
    }

    /// Closes the connection without reading the response.
    pub fn close(self) {
        drop(self.stream);
    }
}

fn head(
    method: &str,
    path: &str,
    addr: SocketAddr,
    headers: &[(&str, &str)],
    len: usize,
) -> Vec<u8> {
    let mut h = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\n");
    let mut has_length = false;
    for (name, value) in headers {
        has_length |= name.eq_ignore_ascii_case("content-length")
            || name.eq_ignore_ascii_case("transfer-encoding");
        h.push_str(&format!("{name}: {value}\r\n"));
    }
    if !has_length && (len > 0 || method != "GET") {
        h.push_str(&format!("Content-Length: {len}\r\n"));
    }
    h.push_str("\r\n");
    h.into_bytes()
}

impl Client {
    /// A client for `addr`.
    pub fn new(addr: SocketAddr) -> Client {
        Client { addr }
    }

    /// `GET path`.
    pub async fn get(&self, path: &str) -> Response {
        self.request("GET", path, &[], b"").await
    }

    /// `DELETE path` without a body.
    pub async fn delete(&self, path: &str) -> Response {
        self.request("DELETE", path, &[], b"").await
    }

    /// `POST path` with `body` serialized as JSON.
    pub async fn post(&self, path: &str, body: &Value) -> Response {
        let bytes = serde_json::to_vec(body).expect("serialize JSON");
        self.request(
            "POST",
            path,
            &[("Content-Type", "application/json")],
            &bytes,
        )
        .await
    }

    /// `POST path` with raw body bytes and an optional content type.
    pub async fn post_raw(&self, path: &str, body: &[u8], content_type: Option<&str>) -> Response {
        let headers: Vec<(&str, &str)> = content_type
            .map(|ct| vec![("Content-Type", ct)])
            .unwrap_or_default();
        self.request("POST", path, &headers, body).await
    }

    /// Any request. `Content-Length` is added unless `headers` frame the body
    /// themselves; `Connection: close` is always sent. The body is written while the
    /// response is read, so a server that answers early (413) is seen answering.
    pub async fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Response {
        let mut all: Vec<(&str, &str)> = vec![("Connection", "close")];
        all.extend_from_slice(headers);
        let head = head(method, path, self.addr, &all, body.len());
        let mut stream = self.connect().await;
        let exchange = async {
            let (mut rd, mut wr) = stream.split();
            let write = async {
                // The server may answer and close before reading everything (413);
                // what matters is its answer, so write errors are not failures.
                let _ = wr.write_all(&head).await;
                let _ = wr.write_all(body).await;
                let _ = wr.flush().await;
            };
            let (_, response) = tokio::join!(write, read_response(&mut rd));
            response
        };
        tokio::time::timeout(IO_TIMEOUT, exchange)
            .await
            .unwrap_or_else(|_| panic!("{method} {path}: no response within {IO_TIMEOUT:?}"))
            .unwrap_or_else(|e| panic!("{method} {path}: bad response: {e}"))
    }

    /// Writes a request and returns without reading the response. No
    /// `Connection: close` is added (pass it in `headers` if wanted).
    pub async fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Pending {
        let head = head(method, path, self.addr, headers, body.len());
        let mut stream = self.connect().await;
        stream.write_all(&head).await.expect("write request head");
        stream.write_all(body).await.expect("write request body");
        stream.flush().await.expect("flush request");
        Pending { stream }
    }

    /// Like [`Client::send`]: `POST path` with a JSON body, keep-alive.
    pub async fn send_json(&self, path: &str, body: &Value) -> Pending {
        let bytes = serde_json::to_vec(body).expect("serialize JSON");
        self.send(
            "POST",
            path,
            &[("Content-Type", "application/json")],
            &bytes,
        )
        .await
    }

    /// Writes raw bytes, shuts down the write side, and returns whatever the server
    /// sends back until it closes the connection (or `within` passes, or the
    /// connection is reset). Never fails: for garbage input any reaction is allowed,
    /// as long as the server survives it.
    pub async fn raw(&self, bytes: &[u8], within: Duration) -> Vec<u8> {
        let mut stream = self.connect().await;
        let mut out = Vec::new();
        let deadline = Instant::now() + within;
        if stream.write_all(bytes).await.is_err() {
            return out;
        }
        let _ = stream.shutdown().await;
        let mut buf = vec![0u8; 4096];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, stream.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return out,
                Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            }
        }
    }

    async fn connect(&self) -> TcpStream {
        tokio::time::timeout(IO_TIMEOUT, TcpStream::connect(self.addr))
            .await
            .expect("connect in time")
            .expect("connect to the test server")
    }
}

type IoResult<T> = std::io::Result<T>;

fn bad_data(what: impl Into<String>) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, what.into())
}

/// Reads one response: head, then the body framed by `Content-Length`, chunked
/// encoding, or the end of the stream.
async fn read_response<R: AsyncReadExt + Unpin>(r: &mut R) -> IoResult<Response> {
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 8192];
    let head_end = loop {
        if let Some(i) = find(&buf, b"\r\n\r\n") {
            break i;
        }
        let n = r.read(&mut chunk).await?;
        if n == 0 {
            return Err(bad_data(format!(
                "connection closed before a full response head; got {:?}",
                String::from_utf8_lossy(&buf)
            )));
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = std::str::from_utf8(&buf[..head_end]).map_err(|_| bad_data("non-UTF-8 head"))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    if !version.starts_with("HTTP/1.") {
        return Err(bad_data(format!("bad status line {status_line:?}")));
    }
    let status: u16 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad_data(format!("bad status line {status_line:?}")))?;
    let mut headers = Vec::new();
    for line in lines {
        let (name, value) = line
            .split_once(':')
            .ok_or_else(|| bad_data(format!("bad header line {line:?}")))?;
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_owned()));
    }
    let mut rest = buf[head_end + 4..].to_vec();
    let get = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    };
    let body = if let Some(len) = get("content-length") {
        let len: usize = len
            .parse()
            .map_err(|_| bad_data(format!("bad content-length {len:?}")))?;
        while rest.len() < len {
            let n = r.read(&mut chunk).await?;
            if n == 0 {
                return Err(bad_data("connection closed inside the body"));
            }
            rest.extend_from_slice(&chunk[..n]);
        }
        rest.truncate(len);
        rest
    } else if get("transfer-encoding").is_some_and(|te| te.eq_ignore_ascii_case("chunked")) {
        read_chunked(r, rest).await?
    } else if status == 204 || status == 304 || (100..200).contains(&status) {
        Vec::new()
    } else {
        r.read_to_end(&mut rest).await?;
        rest
    };
    Ok(Response {
        status,
        headers,
        body,
    })
}

async fn read_chunked<R: AsyncReadExt + Unpin>(r: &mut R, mut buf: Vec<u8>) -> IoResult<Vec<u8>> {
    let mut body = Vec::new();
    let mut chunk = vec![0u8; 8192];
    loop {
        // Chunk size line.
        let line_end = loop {
            if let Some(i) = find(&buf, b"\r\n") {
                break i;
            }
            let n = r.read(&mut chunk).await?;
            if n == 0 {
                return Err(bad_data("connection closed inside a chunk header"));
            }
            buf.extend_from_slice(&chunk[..n]);
        };
        let line = std::str::from_utf8(&buf[..line_end]).map_err(|_| bad_data("chunk size"))?;
        let size_text = line.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| bad_data(format!("bad chunk size {line:?}")))?;
        buf.drain(..line_end + 2);
        // Chunk data and its CRLF (for the last chunk: the trailer's final CRLF;
        // trailers are not supported).
        while buf.len() < size + 2 {
            let n = r.read(&mut chunk).await?;
            if n == 0 {
                return Err(bad_data("connection closed inside a chunk"));
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        if size == 0 {
            return Ok(body);
        }
        body.extend_from_slice(&buf[..size]);
        buf.drain(..size + 2);
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Percent-encodes everything but unreserved characters (RFC 3986), for path segments
/// and query values.
pub fn pct(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Polls `probe` every few milliseconds until it returns `Some`, failing the test with
/// `what` after `within`. For waiting on server-side timers without sleeping a fixed
/// amount.
pub async fn poll_until<T, F, Fut>(what: &str, within: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {within:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The value of an unlabelled metric (a counter, a gauge, or a histogram's
/// `_count`/`_sum`) in Prometheus text format.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (n, v) = l.split_once(' ')?;
        (n == name).then(|| v.trim().parse().ok()).flatten()
    })
}

/// One Server-Sent Event: `id`, `event`, `data` (parsed as JSON when it is).
#[derive(Debug, Clone)]
pub struct Sse {
    /// The `id:` field.
    pub id: String,
    /// The `event:` field.
    pub event: String,
    /// The `data:` field.
    pub data: Value,
}

/// The SSE events in a raw HTTP/1.1 response, or a later part of it (chunked:
/// every chunk's body is whole lines), heartbeat comments left out.
pub fn sse_events(raw: &str) -> Vec<Sse> {
    let body = match raw.split_once("\r\n\r\n") {
        Some((head, body)) if head.starts_with("HTTP/") => body,
        _ => raw,
    };
    let text: String = body
        .split("\r\n")
        .filter(|part| !part.is_empty() && !part.bytes().all(|b| b.is_ascii_hexdigit()))
        .collect();
    text.split("\n\n")
        .filter_map(|block| {
            let mut sse = Sse {
                id: String::new(),
                event: String::new(),
                data: Value::Null,
            };
            for line in block.lines() {
                let field = |name: &str| {
                    line.strip_prefix(name)
                        .map(|v| v.strip_prefix(' ').unwrap_or(v).to_owned())
                };
                if let Some(v) = field("id:") {
                    sse.id = v;
                } else if let Some(v) = field("event:") {
                    sse.event = v;
                } else if let Some(v) = field("data:") {
                    sse.data = serde_json::from_str(&v).unwrap_or(Value::String(v));
                }
            }
            (!sse.event.is_empty()).then_some(sse)
        })
        .collect()
}
