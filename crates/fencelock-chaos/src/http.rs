//! Tiny blocking HTTP/1.1 calls to a member on loopback (status and JSON body), for
//! the harness and the workers' leader discovery. Every call is bounded by socket
//! timeouts.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::Duration;

/// Longest answer read (a cluster status or one lock's state is far smaller).
const MAX_ANSWER: u64 = 1 << 20;

/// One request to 127.0.0.1:`port`; the status and the JSON body (`Null` when the
/// body is not JSON). `None` when the member cannot be reached or does not answer
/// within `timeout` per socket operation.
pub fn call(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&serde_json::Value>,
    timeout: Duration,
) -> Option<(u16, serde_json::Value)> {
    let (status, body) = call_raw(port, method, path, body, timeout)?;
    let body = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
    Some((status, body))
}

/// [`call`], with the body as bytes.
pub fn call_raw(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&serde_json::Value>,
    timeout: Duration,
) -> Option<(u16, Vec<u8>)> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let mut s = TcpStream::connect_timeout(&addr, timeout).ok()?;
    s.set_read_timeout(Some(timeout)).ok()?;
    s.set_write_timeout(Some(timeout)).ok()?;
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let content = if body.is_empty() {
        String::new()
    } else {
        format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        )
    };
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n{content}\r\n{body}"
    )
    .ok()?;
    let mut out = Vec::new();
    s.take(MAX_ANSWER).read_to_end(&mut out).ok()?;
    let split = out.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&out[..split]);
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let body = out[split + 4..].to_vec();
    // Small answers come whole; a chunked one (axum streams /metrics) is unchunked.
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    });
    Some((status, if chunked { unchunk(&body) } else { body }))
}

/// The payload of a chunked body (what is readable of it).
fn unchunk(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = body.windows(2).position(|w| w == b"\r\n") {
        let size = std::str::from_utf8(&body[..eol])
            .ok()
            .and_then(|s| usize::from_str_radix(s.trim(), 16).ok());
        let Some(size) = size.filter(|&n| n > 0) else {
            break;
        };
        let start = eol + 2;
        let end = (start + size).min(body.len());
        out.extend_from_slice(&body[start..end]);
        body = &body[(end + 2).min(body.len())..];
    }
    out
}

/// The value of a Prometheus sample without labels, e.g. `fencelock_raft_term`.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (key, value) = l.split_once(' ')?;
        (key == name).then(|| value.trim().parse().ok()).flatten()
    })
}

/// `GET path` with a 2 s bound per socket operation.
pub fn get_json(port: u16, path: &str) -> Option<(u16, serde_json::Value)> {
    call(port, "GET", path, None, Duration::from_secs(2))
}

/// The port of a `http://host:port[/…]` URL.
pub fn url_port(url: &str) -> Option<u16> {
    let rest = url.strip_prefix("http://")?;
    let authority = rest.split('/').next()?;
    authority.rsplit_once(':')?.1.parse().ok()
}

/// The leader's URL in a `GET /v1/cluster` answer, if the member knows one.
pub fn leader_url(cluster: &serde_json::Value) -> Option<String> {
    cluster
        .get("leader")?
        .get("url")?
        .as_str()
        .map(str::to_owned)
}

/// The leader's id in a `GET /v1/cluster` answer, if the member knows one.
pub fn leader_id(cluster: &serde_json::Value) -> Option<u64> {
    cluster.get("leader")?.get("id")?.as_u64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_cluster_answers_are_read() {
        assert_eq!(url_port("http://127.0.0.1:7420"), Some(7420));
        assert_eq!(url_port("http://127.0.0.1:7420/v1"), Some(7420));
        assert_eq!(url_port("https://x:1"), None);
        assert_eq!(url_port("http://nohost"), None);
        let status: serde_json::Value = serde_json::from_str(
            r#"{"node_id":2,"term":3,"leader":{"id":1,"url":"http://127.0.0.1:9"},"members":[]}"#,
        )
        .unwrap();
        assert_eq!(leader_url(&status).as_deref(), Some("http://127.0.0.1:9"));
        assert_eq!(leader_id(&status), Some(1));
        assert_eq!(
            metric(
                "# HELP x\nfencelock_raft_term 7\nfencelock_raft_term_x 9\n",
                "fencelock_raft_term"
            ),
            Some(7.0)
        );
        assert_eq!(unchunk(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"), b"abcde");
        let none: serde_json::Value = serde_json::from_str(r#"{"leader":null}"#).unwrap();
        assert_eq!(leader_url(&none), None);
    }
}
