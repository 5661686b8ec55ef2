//! Browser protection when authentication is off: web pages cannot act on the server.
//!
//! With no tokens configured every request is the anonymous admin, so anything a
//! browser can be made to send is a command. Two attacks follow, and one rule each
//! stops them (applied by [`layer`], only with authentication off):
//!
//! - **DNS rebinding.** A page at `evil.example` re-points its own name to
//!   127.0.0.1 and reads this server as if same-origin; the browser still sends
//!   `Host: evil.example`. So only `Host` values that cannot be rebound are served:
//!   `localhost` and IP literals (`127.0.0.1`, `[::1]`, the address the server listens
//!   on, …), with any port. A name is refused with 403 `permission_denied`
//!   (`/healthz` and `/readyz` answer any `Host`: probes, nothing to read). (Any IP
//!   literal, not just loopback: a browser's origin is then that very address, which
//!   no other site can take over; and a server started with `--insecure` on
//!   `0.0.0.0` is reached by its IP.)
//! - **Cross-site requests.** A page on another origin can send a "simple" request
//!   (a form post, `fetch` with `text/plain` or no content type) without asking the
//!   server first. So a request that changes state (any method but GET, HEAD and
//!   OPTIONS) is refused with 403 `permission_denied` if it carries an `Origin` whose
//!   `host:port` is not the request's `Host` (`Origin: null` included), or says
//!   `Sec-Fetch-Site: cross-site`/`same-site`; and one with a body must say
//!   `Content-Type: application/json` (gRPC: `application/grpc…`), which a page on
//!   another origin can only send after a CORS preflight, which fails: the server
//!   sends no CORS headers, and refuses a foreign `OPTIONS` too. Bodyless requests
//!   (a session's keepalive or close) need no content type: they name a session id,
//!   a secret the page does not have. The dashboard's own forms (`/ui/…`) post form
//!   data, so there a same-origin proof is required instead: an `Origin` equal to
//!   `Host`, or `Sec-Fetch-Site: same-origin`.
//!
//! With authentication on, none of this applies: a page cannot present a bearer
//! token, and the cookie the dashboard sets is `SameSite=Strict` and accepted for
//! state-changing requests only from the server's own origin ([`crate::auth`]).
//! Rebinding gains nothing either: the rebound origin has no cookie. Servers with
//! tokens are also the ones reached by DNS names and through proxies, which a `Host`
//! rule would break.

use std::net::IpAddr;

use axum::extract::Request;
use axum::http::{header, HeaderMap, Method};
use axum::middleware::Next;
use axum::response::Response;

use crate::auth;
use crate::error::{ApiError, ApiErrorKind};

/// The middleware: see the module docs. `auth_enabled` is whether tokens are
/// configured; with them, every request passes untouched.
pub async fn layer(
    axum::extract::State(auth_enabled): axum::extract::State<bool>,
    request: Request,
    next: Next,
) -> Response {
    if !auth_enabled {
        if let Err(e) = check(request.method(), request.uri(), request.headers()) {
            tracing::debug!(path = request.uri().path(), error = %e, "refused a browser request");
            let grpc = is_grpc(request.headers());
            return auth::refuse(grpc, e);
        }
    }
    next.run(request).await
}

/// Checks one request against the rules of the module docs (authentication off).
pub fn check(method: &Method, uri: &axum::http::Uri, headers: &HeaderMap) -> Result<(), ApiError> {
    let host = headers
        .get(header::HOST)
        .map(|v| v.to_str().unwrap_or("\u{fffd}"))
        .or_else(|| uri.authority().map(|a| a.as_str()));
    // Health probes name whatever host they like, and learn nothing from the answer.
    let probe = matches!(uri.path(), "/healthz" | "/readyz");
    // A request without any host is not from a browser (browsers always send one).
    if let Some(host) = host.filter(|_| !probe) {
        if !host_cannot_be_rebound(host) {
            return Err(refused(format!(
                "Host {host:?} is not served with authentication off: use localhost or an IP \
                 address, or configure tokens (a web page could otherwise rebind its own name \
                 to this server)"
            )));
        }
    }
    if matches!(*method, Method::GET | Method::HEAD) {
        return Ok(());
    }
    let origin = headers
        .get(header::ORIGIN)
        .map(|v| v.to_str().unwrap_or(""));
    let fetch_site = headers
        .get("sec-fetch-site")
        .map(|v| v.to_str().unwrap_or(""));
    if let Some(origin) = origin {
        let authority = origin.split_once("://").map(|(_, a)| a);
        if authority.is_none() || authority != host {
            return Err(refused(format!(
                "a request that changes state from another origin ({origin:?}) is refused with \
                 authentication off"
            )));
        }
    }
    if matches!(fetch_site, Some("cross-site" | "same-site")) {
        return Err(refused(
            "a request that changes state from another site is refused with authentication off"
                .to_owned(),
        ));
    }
    if *method == Method::OPTIONS {
        return Ok(());
    }
    let path = uri.path();
    if path == "/ui" || path.starts_with("/ui/") {
        // The dashboard's forms post form data: they must prove they are its own.
        if origin.is_none() && fetch_site != Some("same-origin") {
            return Err(refused(
                "a dashboard form must come from the dashboard's own pages (send Origin)"
                    .to_owned(),
            ));
        }
        return Ok(());
    }
    if has_body(headers) && !is_json(headers) && !is_grpc(headers) {
        return Err(refused(
            "with authentication off, a request that changes state must send \
             Content-Type: application/json (web pages on other sites cannot send it \
             without asking first)"
                .to_owned(),
        ));
    }
    Ok(())
}

fn refused(message: String) -> ApiError {
    ApiError::new(ApiErrorKind::PermissionDenied, message)
}

/// `localhost` or an IP literal, with or without a port. A DNS name can be pointed
/// at this server by whoever owns it; these cannot.
fn host_cannot_be_rebound(host: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        // `[v6]` or `[v6]:port`.
        match rest.split_once(']') {
            Some((v6, port)) if port.is_empty() || valid_port(port) => {
                return v6.parse::<std::net::Ipv6Addr>().is_ok();
            }
            _ => return false,
        }
    } else {
        match host.rsplit_once(':') {
            Some((name, port)) if valid_port(port) => name,
            Some(_) => return false,
            None => host,
        }
    };
    name.eq_ignore_ascii_case("localhost") || name.parse::<IpAddr>().is_ok()
}

fn valid_port(port: &str) -> bool {
    port.strip_prefix(':')
        .unwrap_or(port)
        .parse::<u16>()
        .is_ok()
}

fn has_body(headers: &HeaderMap) -> bool {
    let length = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    match length {
        Some(0) => false,
        Some(_) => true,
        // Chunked or unknown: assume a body.
        None => headers.contains_key(header::TRANSFER_ENCODING),
    }
}

fn media_type(headers: &HeaderMap) -> Option<String> {
    let value = headers.get(header::CONTENT_TYPE)?.to_str().ok()?;
    let essence = value.split(';').next().unwrap_or("").trim();
    Some(essence.to_ascii_lowercase())
}

fn is_json(headers: &HeaderMap) -> bool {
    media_type(headers).as_deref() == Some("application/json")
}

fn is_grpc(headers: &HeaderMap) -> bool {
    media_type(headers).is_some_and(|t| t.starts_with("application/grpc"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::{HeaderValue, Uri};

    /// One request through [`check`]: the code of its refusal, or `None` if served.
    fn check_request(method: &str, path: &str, headers: &[(&str, &str)]) -> Option<&'static str> {
        let mut h = HeaderMap::new();
        for (name, value) in headers {
            h.append(
                axum::http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        let method = Method::from_bytes(method.as_bytes()).unwrap();
        let uri: Uri = path.parse().unwrap();
        check(&method, &uri, &h).err().map(|e| e.kind().code())
    }

    const DENIED: Option<&str> = Some("permission_denied");
    const JSON: (&str, &str) = ("content-type", "application/json");
    const BODY: (&str, &str) = ("content-length", "20");

    #[test]
    fn hosts_that_cannot_be_rebound_are_served() {
        for host in [
            "localhost",
            "localhost:7420",
            "LOCALHOST:1",
            "127.0.0.1",
            "127.3.4.5:80",
            "[::1]",
            "[::1]:7420",
            "10.1.2.3:7420",
        ] {
            assert_eq!(
                check_request("GET", "/v1/locks", &[("host", host)]),
                None,
                "{host}"
            );
        }
        for host in [
            "evil.example",
            "evil.example:7420",
            "localhost.evil.example",
            "127.0.0.1.nip.io:7420",
            "[::1",
            "[::1]x",
            "127.0.0.1:port",
            "",
        ] {
            assert_eq!(
                check_request("GET", "/v1/locks", &[("host", host)]),
                DENIED,
                "{host}"
            );
        }
        assert_eq!(check_request("GET", "/healthz", &[("host", "x")]), None);
        // HTTP/2 names the host in the URI.
        assert_eq!(
            check_request("GET", "http://evil.example/v1/locks", &[]),
            DENIED
        );
        assert_eq!(
            check_request("GET", "http://127.0.0.1:1/v1/locks", &[]),
            None
        );
    }

    #[test]
    fn state_changes_need_json_and_no_foreign_origin() {
        let host = ("host", "127.0.0.1:7420");
        let post = |headers: &[(&str, &str)]| check_request("POST", "/v1/release", headers);
        assert_eq!(post(&[host, JSON, BODY]), None);
        assert_eq!(
            post(&[
                host,
                ("content-type", "Application/JSON; charset=utf-8"),
                BODY
            ]),
            None
        );
        assert_eq!(
            post(&[host, ("content-type", "application/grpc+proto"), BODY]),
            None
        );
        for ct in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
        ] {
            assert_eq!(post(&[host, ("content-type", ct), BODY]), DENIED, "{ct}");
        }
        assert_eq!(post(&[host, BODY]), DENIED, "no content type");
        assert_eq!(post(&[host, ("transfer-encoding", "chunked")]), DENIED);
        // Bodyless: a session keepalive or close.
        assert_eq!(post(&[host, ("content-length", "0")]), None);
        assert_eq!(check_request("DELETE", "/v1/sessions/x", &[host]), None);
        // Origin: only this server's own.
        assert_eq!(
            post(&[host, JSON, BODY, ("origin", "http://127.0.0.1:7420")]),
            None
        );
        for origin in [
            "http://evil.example",
            "http://127.0.0.1:9999",
            "null",
            "http://localhost:7420",
        ] {
            assert_eq!(
                post(&[host, JSON, BODY, ("origin", origin)]),
                DENIED,
                "{origin}"
            );
        }
        assert_eq!(
            post(&[host, JSON, BODY, ("sec-fetch-site", "cross-site")]),
            DENIED
        );
        assert_eq!(
            check_request(
                "OPTIONS",
                "/v1/release",
                &[host, ("origin", "http://evil.example")]
            ),
            DENIED
        );
        // Reads are not state changes: another origin cannot read the answer anyway.
        assert_eq!(
            check_request(
                "GET",
                "/v1/locks",
                &[host, ("origin", "http://evil.example")]
            ),
            None
        );
    }

    #[test]
    fn dashboard_forms_need_a_same_origin_proof() {
        let host = ("host", "localhost:7420");
        let form = ("content-type", "application/x-www-form-urlencoded");
        let post = |headers: &[(&str, &str)]| check_request("POST", "/ui/force-release", headers);
        assert_eq!(
            post(&[host, form, BODY, ("origin", "http://localhost:7420")]),
            None
        );
        assert_eq!(
            post(&[host, form, BODY, ("sec-fetch-site", "same-origin")]),
            None
        );
        assert_eq!(post(&[host, form, BODY]), DENIED);
        assert_eq!(
            post(&[host, form, BODY, ("origin", "http://127.0.0.2:8000")]),
            DENIED
        );
    }
}
