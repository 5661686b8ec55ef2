//! A minimal blocking HTTP/1.1 client for admin commands (`backup`, `audit`,
//! `sessions`, `cluster`), over plain TCP for `http://` and rustls (ring provider) for
//! `https://` URLs.
//!
//! The base URL may list a cluster's members, separated by commas: a request goes to
//! the first that can be reached, and follows a `not_leader` answer to the leader it
//! names (or moves on to the next member when none is named).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};

/// Fetches `path` from `base` (e.g. `http://127.0.0.1:7420` or `https://host:7420`),
/// sending `token` (if any) as `Authorization: Bearer <token>`, and returns the body
/// of a 200 response; any other status is an error carrying the server's message.
/// For `https://`, the server's certificate is checked against `ca_cert` (a PEM file)
/// if given, else against the system's roots.
pub fn get_as(
    base: &str,
    path: &str,
    token: Option<&str>,
    ca_cert: Option<&Path>,
) -> Result<Vec<u8>> {
    request_as("GET", base, path, token, ca_cert)
}

/// [`get_as`] with another bodiless `method` (`DELETE`). State-changing requests
/// say `Content-Type: application/json`, as the server asks of them.
pub fn request_as(
    method: &str,
    base: &str,
    path: &str,
    token: Option<&str>,
    ca_cert: Option<&Path>,
) -> Result<Vec<u8>> {
    send(method, base, path, token, ca_cert, None)
}

/// A non-200 answer: its status and body (the server's `{"error":…}`).
#[derive(Debug)]
pub struct HttpStatus {
    /// The HTTP status.
    pub status: u16,
    /// The body, as text.
    pub body: String,
}

impl HttpStatus {
    /// The server's stable error code, if the body has one.
    pub fn code(&self) -> Option<String> {
        let v: serde_json::Value = serde_json::from_str(&self.body).ok()?;
        v["error"]["code"].as_str().map(str::to_owned)
    }

    /// With `not_leader`: the leader's URL, when the member named it.
    pub fn leader(&self) -> Option<String> {
        let v: serde_json::Value = serde_json::from_str(&self.body).ok()?;
        v["error"]["leader"]
            .as_str()
            .filter(|url| !url.is_empty())
            .map(str::to_owned)
    }
}

impl std::fmt::Display for HttpStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "server answered {}: {}", self.status, self.body)
    }
}

impl std::error::Error for HttpStatus {}

/// No connection could be made: nothing was sent, so another member may be asked.
#[derive(Debug)]
pub struct Unreachable(pub String);

impl std::fmt::Display for Unreachable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Unreachable {}

/// Most members one request visits (configured ones plus leaders they name).
const MAX_HOPS: usize = 16;

/// Sends `method path` with an optional JSON `body` to `base` (one URL or a comma
/// list of a cluster's members), following `not_leader` answers; see [`get_as`].
/// A failure is an [`HttpStatus`] (an answer other than 200) or an [`Unreachable`]
/// (no member could be reached) inside the error's chain.
pub fn send(
    method: &str,
    base: &str,
    path: &str,
    token: Option<&str>,
    ca_cert: Option<&Path>,
    body: Option<&[u8]>,
) -> Result<Vec<u8>> {
    let mut pending: std::collections::VecDeque<String> = base
        .split(',')
        .map(|u| u.trim().trim_end_matches('/').to_owned())
        .filter(|u| !u.is_empty())
        .collect();
    if pending.is_empty() {
        bail!("no server URL was given");
    }
    let mut tried: Vec<String> = Vec::new();
    let mut last = None;
    while let Some(url) = pending.pop_front() {
        if tried.contains(&url) {
            continue;
        }
        if tried.len() >= MAX_HOPS {
            break;
        }
        tried.push(url.clone());
        let error = match send_once(method, &url, path, token, ca_cert, body) {
            Ok(answer) => return Ok(answer),
            Err(e) => e,
        };
        match next_hop(&error) {
            Hop::Leader(leader) => pending.push_front(leader.trim_end_matches('/').to_owned()),
            Hop::Next => {}
            Hop::Stop => return Err(error),
        }
        last = Some(error);
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("no server URL was given")))
}

/// What a failed request to one member says about the next one.
#[derive(Debug, PartialEq, Eq)]
enum Hop {
    /// The member named the leader.
    Leader(String),
    /// The member could not be reached, or could not serve (503): try the next.
    Next,
    /// A real answer (or a failure after the request may have been sent).
    Stop,
}

fn next_hop(error: &anyhow::Error) -> Hop {
    if error.downcast_ref::<Unreachable>().is_some() {
        return Hop::Next;
    }
    match error.downcast_ref::<HttpStatus>() {
        Some(answer) if answer.status == 503 => match answer.leader() {
            Some(leader) if answer.code().as_deref() == Some("not_leader") => Hop::Leader(leader),
            _ => Hop::Next,
        },
        _ => Hop::Stop,
    }
}

fn send_once(
    method: &str,
    base: &str,
    path: &str,
    token: Option<&str>,
    ca_cert: Option<&Path>,
    body: Option<&[u8]>,
) -> Result<Vec<u8>> {
    let auth = match token {
        Some(t) if t.bytes().any(|b| b.is_ascii_control() || b == b' ') => {
            bail!("the token contains spaces or control characters")
        }
        Some(t) => format!("Authorization: Bearer {t}\r\n"),
        None => String::new(),
    };
    let (tls, authority) = if let Some(rest) = base.strip_prefix("https://") {
        (true, rest)
    } else if let Some(rest) = base.strip_prefix("http://") {
        if ca_cert.is_some() {
            bail!("a CA certificate was given, but {base:?} is not an https:// URL");
        }
        (false, rest)
    } else {
        bail!("the server URL must start with http:// or https://, not {base:?}");
    };
    let authority = authority.trim_end_matches('/');
    let tcp = TcpStream::connect(authority)
        .map_err(|e| Unreachable(format!("cannot connect to {authority}: {e}")))?;
    tcp.set_read_timeout(Some(Duration::from_secs(60)))?;
    let body_headers = match (method, body) {
        ("GET", None) => String::new(),
        (_, body) => format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.map_or(0, <[u8]>::len)
        ),
    };
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {authority}\r\n{auth}{body_headers}Connection: close\r\n\r\n"
    )
    .into_bytes();
    request.extend_from_slice(body.unwrap_or_default());
    let mut response = Vec::new();
    if tls {
        let mut stream = tls_stream(tcp, authority, ca_cert)?;
        stream.write_all(&request)?;
        read_all(&mut stream, &mut response)?;
    } else {
        let mut stream = tcp;
        stream.write_all(&request)?;
        stream.read_to_end(&mut response)?;
    }
    let split = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("malformed HTTP response")?;
    let head = std::str::from_utf8(&response[..split]).context("malformed HTTP headers")?;
    let body = &response[split + 4..];
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("malformed HTTP status line")?;
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    });
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_vec()
    };
    if status != 200 {
        return Err(HttpStatus {
            status,
            body: String::from_utf8_lossy(&body).into_owned(),
        }
        .into());
    }
    Ok(body)
}

fn tls_stream(
    tcp: TcpStream,
    authority: &str,
    ca_cert: Option<&Path>,
) -> Result<rustls::StreamOwned<rustls::ClientConnection, TcpStream>> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName};
    let mut roots = rustls::RootCertStore::empty();
    match ca_cert {
        Some(path) => {
            for cert in CertificateDer::pem_file_iter(path)
                .with_context(|| format!("cannot read the CA certificate {}", path.display()))?
            {
                let cert = cert.with_context(|| format!("bad PEM in {}", path.display()))?;
                roots.add(cert).context("unusable CA certificate")?;
            }
        }
        None => {
            for cert in rustls_native_certs::load_native_certs().certs {
                // A system certificate rustls cannot use is skipped, as browsers do.
                let _ = roots.add(cert);
            }
        }
    }
    let config = rustls::ClientConfig::builder_with_provider(fencelock_server::tls::provider())
        .with_safe_default_protocol_versions()
        .context("TLS setup")?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let host = match authority.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => authority,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let name = ServerName::try_from(host.to_owned())
        .with_context(|| format!("{host:?} is not a valid server name"))?;
    let connection = rustls::ClientConnection::new(Arc::new(config), name).context("TLS setup")?;
    Ok(rustls::StreamOwned::new(connection, tcp))
}

/// Reads to the end of a TLS stream; a peer that closes without close_notify after a
/// complete `Connection: close` response is not an error.
fn read_all(stream: &mut impl Read, out: &mut Vec<u8>) -> Result<()> {
    match stream.read_to_end(out) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !out.is_empty() => Ok(()),
        Err(e) => Err(e).context("TLS read failed"),
    }
}

fn dechunk(mut input: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = input
            .windows(2)
            .position(|w| w == b"\r\n")
            .context("malformed chunk")?;
        let size_text = std::str::from_utf8(&input[..line_end])?;
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .context("malformed chunk size")?;
        input = &input[line_end + 2..];
        if size == 0 {
            return Ok(out);
        }
        if input.len() < size + 2 {
            bail!("truncated chunk");
        }
        out.extend_from_slice(&input[..size]);
        input = &input[size + 2..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: u16, body: &str) -> anyhow::Error {
        HttpStatus {
            status,
            body: body.to_owned(),
        }
        .into()
    }

    #[test]
    fn not_leader_is_followed_and_unreachable_members_passed_over() {
        let named = answer(
            503,
            r#"{"error":{"code":"not_leader","message":"m","leader":"http://127.0.0.1:7421"}}"#,
        );
        assert_eq!(
            next_hop(&named),
            Hop::Leader("http://127.0.0.1:7421".into())
        );
        let unnamed = answer(503, r#"{"error":{"code":"not_leader","message":"m"}}"#);
        assert_eq!(next_hop(&unnamed), Hop::Next);
        let stopping = answer(503, r#"{"error":{"code":"unavailable","message":"m"}}"#);
        assert_eq!(next_hop(&stopping), Hop::Next);
        let refused = anyhow::Error::from(Unreachable("cannot connect".into()));
        assert_eq!(next_hop(&refused.context("while asking")), Hop::Next);
        // A real answer, or an I/O failure after the request may have been sent, is
        // final: a state change is not sent twice.
        let denied = answer(
            403,
            r#"{"error":{"code":"permission_denied","message":"m"}}"#,
        );
        assert_eq!(next_hop(&denied), Hop::Stop);
        let io = anyhow::Error::from(std::io::Error::other("reset"));
        assert_eq!(next_hop(&io), Hop::Stop);
    }

    #[test]
    fn every_member_unreachable_fails_with_the_last_reason() {
        // Port 1 on loopback: nothing listens there in a test environment.
        let err = send(
            "GET",
            "http://127.0.0.1:1, http://127.0.0.1:1/",
            "/v1/cluster",
            None,
            None,
            None,
        )
        .unwrap_err();
        assert!(err.downcast_ref::<Unreachable>().is_some(), "{err:#}");
        let err = send("GET", " , ", "/", None, None, None).unwrap_err();
        assert!(err.to_string().contains("no server URL"), "{err:#}");
    }
}
