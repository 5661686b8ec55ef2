//! A minimal blocking HTTP/1.1 GET for admin commands (plain `http://` only).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use anyhow::{bail, Context, Result};

/// Fetches `path` from `base` (e.g. `http://127.0.0.1:7420`), sending `token` (if
/// any) as `Authorization: Bearer <token>`, and returns the body of a 200 response;
/// any other status is an error carrying the server's message.
pub fn get_as(base: &str, path: &str, token: Option<&str>) -> Result<Vec<u8>> {
    let auth = match token {
        Some(t) if t.bytes().any(|b| b.is_ascii_control() || b == b' ') => {
            bail!("the token contains spaces or control characters")
        }
        Some(t) => format!("Authorization: Bearer {t}\r\n"),
        None => String::new(),
    };
    let authority = base
        .strip_prefix("http://")
        .context("only http:// server URLs are supported")?
        .trim_end_matches('/');
    let mut stream =
        TcpStream::connect(authority).with_context(|| format!("cannot connect to {authority}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(60)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {authority}\r\n{auth}Connection: close\r\n\r\n"
    )?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response)?;
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
