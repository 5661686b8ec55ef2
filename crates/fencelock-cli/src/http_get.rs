//! A minimal blocking HTTP/1.1 client for admin commands (`backup`, `audit`,
//! `sessions`), over plain TCP for `http://` and rustls (ring provider) for
//! `https://` URLs.

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
    let tcp =
        TcpStream::connect(authority).with_context(|| format!("cannot connect to {authority}"))?;
    tcp.set_read_timeout(Some(Duration::from_secs(60)))?;
    let body_headers = if method == "GET" {
        ""
    } else {
        "Content-Type: application/json\r\nContent-Length: 0\r\n"
    };
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {authority}\r\n{auth}{body_headers}Connection: close\r\n\r\n"
    );
    let mut response = Vec::new();
    if tls {
        let mut stream = tls_stream(tcp, authority, ca_cert)?;
        stream.write_all(request.as_bytes())?;
        read_all(&mut stream, &mut response)?;
    } else {
        let mut stream = tcp;
        stream.write_all(request.as_bytes())?;
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
        bail!(
            "server answered {status}: {}",
            String::from_utf8_lossy(&body)
        );
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
