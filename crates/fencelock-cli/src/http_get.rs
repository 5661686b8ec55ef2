//! The admin commands' HTTP requests (`backup`, `audit`, `sessions`, `cluster`): a
//! blocking call around hyper's HTTP/1.1 client connection, over TCP for `http://`
//! and rustls (ring provider) for `https://` URLs. hyper is already built for tonic
//! and axum; its one-connection client is enough for one request per command (the
//! pooled `hyper_util` client would want a TLS connector crate besides), and the
//! client library has no call for these admin endpoints.
//!
//! The base URL may list a cluster's members, separated by commas: a request goes to
//! the first that can be reached, and follows a `not_leader` answer to the leader it
//! names (or moves on to the next member when none is named).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HOST};
use hyper::{Method, Request, Uri};
use hyper_util::rt::TokioIo;
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

/// Bytes left as they are in a URL path segment or query value (RFC 3986's
/// unreserved characters); every other byte is percent-encoded.
const UNRESERVED: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// `text` percent-encoded for a URL path segment or query value.
pub fn pct(text: &str) -> String {
    utf8_percent_encode(text, UNRESERVED).to_string()
}

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
/// Longest wait for a connection to a member; then it counts as unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest silence while waiting for the answer or the next part of its body.
const READ_TIMEOUT: Duration = Duration::from_secs(60);
/// Largest answer read (a snapshot of a big server is the largest there is).
const MAX_ANSWER_BYTES: u64 = 4 << 30;

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
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
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
        let error = match runtime.block_on(send_once(method, &url, path, token, ca_cert, body)) {
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

/// Where a request goes: from a member's base URL.
#[derive(Debug, PartialEq, Eq)]
struct Target {
    tls: bool,
    /// The host to connect to and to check the certificate for (no brackets).
    host: String,
    port: u16,
    /// The `Host` header: the URL's authority.
    authority: String,
}

impl Target {
    fn parse(base: &str, ca_cert: Option<&Path>) -> Result<Target> {
        let uri: Uri = base
            .parse()
            .with_context(|| format!("{base:?} is not a server URL"))?;
        let tls = match uri.scheme_str() {
            Some("https") => true,
            Some("http") if ca_cert.is_some() => {
                bail!("a CA certificate was given, but {base:?} is not an https:// URL")
            }
            Some("http") => false,
            _ => bail!("the server URL must start with http:// or https://, not {base:?}"),
        };
        let Some(authority) = uri.authority() else {
            bail!("the server URL {base:?} names no host");
        };
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            bail!("the server URL {base:?} must be scheme://host:port, without a path");
        }
        Ok(Target {
            tls,
            host: authority
                .host()
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned(),
            port: authority.port_u16().unwrap_or(if tls { 443 } else { 80 }),
            authority: authority.as_str().to_owned(),
        })
    }
}

async fn send_once(
    method: &str,
    base: &str,
    path: &str,
    token: Option<&str>,
    ca_cert: Option<&Path>,
    body: Option<&[u8]>,
) -> Result<Vec<u8>> {
    if token.is_some_and(|t| t.bytes().any(|b| b.is_ascii_control() || b == b' ')) {
        bail!("the token contains spaces or control characters");
    }
    let target = Target::parse(base, ca_cert)?;
    let method = Method::from_bytes(method.as_bytes())
        .with_context(|| format!("{method:?} is not an HTTP method"))?;
    let mut request = Request::builder()
        .method(method.clone())
        .uri(path)
        .header(HOST, &target.authority);
    if let Some(t) = token {
        request = request.header(AUTHORIZATION, format!("Bearer {t}"));
    }
    // State-changing requests say JSON, as the server asks of them.
    if method != Method::GET || body.is_some() {
        request = request.header(CONTENT_TYPE, "application/json");
    }
    let request = request
        .body(Full::new(Bytes::copy_from_slice(body.unwrap_or_default())))
        .with_context(|| format!("cannot make a request for {path:?}"))?;

    let connect = TcpStream::connect((target.host.as_str(), target.port));
    let tcp = match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
        Ok(Ok(tcp)) => tcp,
        Ok(Err(e)) => {
            return Err(Unreachable(format!("cannot connect to {}: {e}", target.authority)).into())
        }
        Err(_) => {
            return Err(Unreachable(format!(
                "cannot connect to {}: no answer within {CONNECT_TIMEOUT:?}",
                target.authority
            ))
            .into())
        }
    };
    let (status, answer) = if target.tls {
        let connector = tokio_rustls::TlsConnector::from(tls_config(ca_cert)?);
        let name = rustls::pki_types::ServerName::try_from(target.host.clone())
            .with_context(|| format!("{:?} is not a valid server name", target.host))?;
        let stream = tokio::time::timeout(READ_TIMEOUT, connector.connect(name, tcp))
            .await
            .map_err(|_| anyhow::anyhow!("TLS handshake with {}: no answer", target.authority))?
            .with_context(|| format!("TLS handshake with {} failed", target.authority))?;
        exchange(stream, request).await?
    } else {
        exchange(tcp, request).await?
    };
    if status != 200 {
        return Err(HttpStatus {
            status,
            body: String::from_utf8_lossy(&answer).into_owned(),
        }
        .into());
    }
    Ok(answer)
}

/// Sends `request` over `io` and reads the whole answer: its status and body.
async fn exchange<S>(io: S, request: Request<Full<Bytes>>) -> Result<(u16, Vec<u8>)>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .context("HTTP handshake failed")?;
    // The connection does the I/O of the exchange; it ends with it.
    let connection = tokio::spawn(connection);
    let response = tokio::time::timeout(READ_TIMEOUT, sender.send_request(request))
        .await
        .map_err(|_| anyhow::anyhow!("no answer within {READ_TIMEOUT:?}"))?
        .context("the request failed")?;
    let status = response.status().as_u16();
    let mut body = response.into_body();
    let mut answer = Vec::new();
    // Bounded: each turn waits at most READ_TIMEOUT and adds data, up to the cap.
    loop {
        let frame = tokio::time::timeout(READ_TIMEOUT, body.frame())
            .await
            .map_err(|_| anyhow::anyhow!("the answer stalled for {READ_TIMEOUT:?}"))?;
        let Some(frame) = frame else { break };
        let frame = frame.context("reading the answer failed")?;
        if let Ok(data) = frame.into_data() {
            answer.extend_from_slice(&data);
        }
        if answer.len() as u64 > MAX_ANSWER_BYTES {
            bail!("the answer is larger than {MAX_ANSWER_BYTES} bytes");
        }
    }
    connection.abort();
    Ok((status, answer))
}

/// The TLS client config: the CA in `ca_cert` (PEM) if given, else the system's roots.
fn tls_config(ca_cert: Option<&Path>) -> Result<Arc<rustls::ClientConfig>> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
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
    Ok(Arc::new(config))
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
    fn server_urls_are_checked() {
        let t = Target::parse("https://[::1]:7420", None).unwrap();
        assert_eq!(
            t,
            Target {
                tls: true,
                host: "::1".into(),
                port: 7420,
                authority: "[::1]:7420".into()
            }
        );
        let t = Target::parse("http://locks.example/", None).unwrap();
        assert_eq!(
            (t.tls, t.port, t.host.as_str()),
            (false, 80, "locks.example")
        );
        assert_eq!(Target::parse("https://h", None).unwrap().port, 443);
        let ca = Path::new("ca.pem");
        for (bad, ca, says) in [
            ("ftp://h:1", None, "http:// or https://"),
            ("h:1", None, "http:// or https://"),
            ("http://h:1/v1", None, "without a path"),
            ("http://h:1", Some(ca), "not an https:// URL"),
            ("http://", None, "not a server URL"),
        ] {
            let e = Target::parse(bad, ca).unwrap_err();
            assert!(e.to_string().contains(says), "{bad}: {e:#}");
        }
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
