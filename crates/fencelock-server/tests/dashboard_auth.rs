//! The dashboard with tokens configured: the login form sets the cookie, pages and
//! the live stream need a token, listings and the audit log are cut to the token's
//! prefixes, force-release needs an admin, a reason and a same-origin request, and
//! the audit log names the admin.
//!
//! Run: `cargo test -p fencelock-server --test it dashboard_auth::`

use crate::support;

use fencelock_server::{AuthConfig, Role, TokenConfig};
use serde_json::{json, Value};
use support::{pct, Response, TestServer};

const OPS: &str = "flk_ops-secret";
const VIEWER: &str = "flk_viewer-secret";

fn token(name: &str, role: Role, prefixes: &[&str], secret: &str) -> TokenConfig {
    TokenConfig {
        name: name.to_owned(),
        role,
        prefixes: prefixes.iter().map(|p| (*p).to_owned()).collect(),
        sha256: fencelock_server::auth::hash_token(secret),
        acquire_rate: None,
        request_rate: None,
        quotas: Default::default(),
    }
}

async fn server() -> TestServer {
    TestServer::start_configured(|c| {
        c.auth = AuthConfig {
            tokens: vec![
                token("ops", Role::Admin, &[""], OPS),
                token("viewer", Role::Reader, &["a:"], VIEWER),
            ],
        };
    })
    .await
}

fn cookie(secret: &str) -> String {
    format!("fencelock_token={secret}")
}

async fn get_as(t: &TestServer, path: &str, secret: &str) -> Response {
    t.client
        .request("GET", path, &[("Cookie", &cookie(secret))], b"")
        .await
}

async fn acquire(t: &TestServer, name: &str) -> Value {
    let auth = format!("Bearer {OPS}");
    let body = json!({"name": name, "ttl_ms": 60_000, "owner": "w"}).to_string();
    t.client
        .request(
            "POST",
            "/v1/acquire",
            &[("Authorization", &auth)],
            body.as_bytes(),
        )
        .await
        .expect_json(200)
}

async fn force_release(t: &TestServer, secret: &str, origin: bool, body: &str) -> Response {
    let c = cookie(secret);
    let origin_value = format!("http://{}", t.addr());
    let mut headers = vec![
        ("Cookie", c.as_str()),
        ("Content-Type", "application/x-www-form-urlencoded"),
    ];
    if origin {
        headers.push(("Origin", origin_value.as_str()));
    }
    t.client
        .request("POST", "/ui/force-release", &headers, body.as_bytes())
        .await
}

async fn held(t: &TestServer, name: &str) -> bool {
    get_as(t, &format!("/v1/locks/{}", pct(name)), OPS)
        .await
        .status
        == 200
}

#[tokio::test]
async fn login_sets_an_http_only_strict_cookie_and_pages_need_it() {
    let t = server().await;
    // No token: the login form, 401.
    let r = t.client.get("/").await;
    assert_eq!(r.status, 401);
    assert!(r.text().contains("name=\"token\""), "{}", r.text());
    // A wrong token in the cookie: the form again, saying so.
    let r = get_as(&t, "/", "flk_wrong").await;
    assert_eq!(r.status, 401);
    assert!(r.text().contains("not accepted"));
    // The live stream and the audit API refuse too.
    assert_eq!(t.client.get("/ui/stream").await.status, 401);
    assert_eq!(t.client.get("/v1/audit").await.status, 401);
    // The assets and the login form are open (the form needs them before a login).
    assert_eq!(t.client.get("/ui/assets/htmx.min.js").await.status, 200);
    assert_eq!(t.client.get("/ui/login").await.status, 200);

    let body = format!("token={}", pct(VIEWER));
    let r = t
        .client
        .request(
            "POST",
            "/ui/login",
            &[("Content-Type", "application/x-www-form-urlencoded")],
            body.as_bytes(),
        )
        .await;
    assert_eq!(r.status, 303);
    assert_eq!(r.header("location"), Some("/"));
    let set = r.header("set-cookie").expect("a cookie");
    assert!(
        set.starts_with(&format!("fencelock_token={VIEWER};")),
        "{set}"
    );
    assert!(
        set.contains("HttpOnly") && set.contains("SameSite=Strict"),
        "{set}"
    );
    assert!(!set.contains("Secure"), "plain http: {set}");
    // Over https (as the browser's Origin says) the cookie is Secure.
    let r = t
        .client
        .request(
            "POST",
            "/ui/login",
            &[
                ("Content-Type", "application/x-www-form-urlencoded"),
                ("Origin", "https://locks.example"),
            ],
            body.as_bytes(),
        )
        .await;
    assert!(r.header("set-cookie").unwrap().contains("; Secure"));
    // Something that would inject cookie attributes is refused.
    let r = t
        .client
        .request(
            "POST",
            "/ui/login",
            &[("Content-Type", "application/x-www-form-urlencoded")],
            b"token=x%3B%20Domain%3Devil.example",
        )
        .await;
    assert_eq!(r.status, 400);
    assert!(r.header("set-cookie").is_none());

    let r = get_as(&t, "/", VIEWER).await;
    assert_eq!(r.status, 200);
    assert!(r.text().contains("signed in as <b>viewer</b>"));
    let r = t.client.request("POST", "/ui/logout", &[], b"").await;
    assert!(r.header("set-cookie").unwrap().contains("Max-Age=0"));
    t.stop().await;
}

#[tokio::test]
async fn readers_see_only_their_prefixes_and_cannot_force_release() {
    let t = server().await;
    acquire(&t, "a:1").await;
    acquire(&t, "b:secret").await;
    let html = get_as(&t, "/", VIEWER).await.text();
    assert!(html.contains("a:1"));
    assert!(
        !html.contains("b:secret"),
        "another prefix leaked into the page"
    );
    let mut stream = t
        .client
        .send("GET", "/ui/stream", &[("Cookie", &cookie(VIEWER))], b"")
        .await;
    let text = stream
        .read_until("event: health", support::IO_TIMEOUT)
        .await;
    assert!(text.contains("a:1") && !text.contains("b:secret"), "{text}");
    stream.close();
    assert_eq!(get_as(&t, "/ui/lock/b:secret", VIEWER).await.status, 403);
    let page = get_as(&t, "/ui/lock/a:1", VIEWER).await;
    assert_eq!(page.status, 200);
    assert!(
        !page.text().contains("force-release"),
        "no admin form for a reader"
    );
    let entries = get_as(&t, "/v1/audit", VIEWER).await.expect_json(200);
    let locks: Vec<&str> = entries["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["lock"].as_str().unwrap())
        .collect();
    assert_eq!(locks, vec!["a:1"]);
    assert_eq!(
        get_as(&t, "/v1/audit?lock=b:secret", VIEWER).await.status,
        403
    );

    let r = force_release(&t, VIEWER, true, "name=a%3A1&reason=no").await;
    assert_eq!(r.status, 403, "{}", r.text());
    assert!(held(&t, "a:1").await);
    t.stop().await;
}

#[tokio::test]
async fn admins_force_release_same_origin_only_and_are_named_in_the_audit_log() {
    let t = server().await;
    acquire(&t, "a:stuck").await;
    // Cookie without Origin: could be another site's form (CSRF). Refused.
    let r = force_release(&t, OPS, false, "name=a%3Astuck&reason=stuck").await;
    assert_eq!(r.status, 401, "{}", r.text());
    assert!(held(&t, "a:stuck").await);
    let r = force_release(&t, OPS, true, "name=a%3Astuck&reason=stuck%20worker").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(!held(&t, "a:stuck").await);
    let audit = get_as(&t, "/v1/audit?lock=a:stuck", OPS)
        .await
        .expect_json(200);
    let last = audit["entries"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["kind"], "force_released");
    assert_eq!(last["actor"], "ops");
    assert_eq!(last["reason"], "stuck worker");
    t.stop().await;
}

/// The list's sort, filters and pages, the charts' data and the lock page's waiter
/// list follow the same rules: sign-in needed, a reader sees its prefixes only
/// (counts included), and the whole-server charts need a token covering every lock.
#[tokio::test]
async fn new_dashboard_routes_follow_the_login_and_tenant_rules() {
    let t = server().await;
    acquire(&t, "a:1").await;
    acquire(&t, "b:secret").await;
    acquire(&t, "b:other").await;
    for path in [
        "/ui/series",
        "/?sort=held&contended=on&page=1",
        "/ui/lock/a:1",
    ] {
        assert_eq!(
            t.client.get(path).await.status,
            401,
            "{path} without a cookie"
        );
    }
    // The count is of the reader's locks only.
    let html = get_as(&t, "/?sort=waiters", VIEWER).await.text();
    assert!(html.contains("Showing 1–1 of 1 locks"), "{html}");
    assert!(!html.contains("b:secret"), "{html}");
    // Filtered, the count of all locks is still the reader's.
    let html = get_as(&t, "/?held_over=1ms", VIEWER).await.text();
    assert!(
        !html.contains("of 3") && !html.contains("(3 locks"),
        "{html}"
    );
    // Another prefix asked for outright is refused, not shown empty.
    let r = get_as(&t, "/?prefix=b:&sort=held", VIEWER).await;
    assert!(!r.text().contains("b:secret"), "{}", r.text());
    // The charts count every tenant's traffic: not for a prefix-limited token.
    get_as(&t, "/ui/series", VIEWER)
        .await
        .expect_error(403, "permission_denied");
    assert!(!get_as(&t, "/", VIEWER)
        .await
        .text()
        .contains("id=\"charts\""));
    let series = get_as(&t, "/ui/series", OPS).await.expect_json(200);
    let minutes = series["minutes"].as_array().expect("minutes");
    assert_eq!(minutes.len(), 60);
    let grants: u64 = minutes.iter().map(|m| m["grants"].as_u64().unwrap()).sum();
    assert_eq!(grants, 3, "{series}");
    assert!(get_as(&t, "/", OPS).await.text().contains("id=\"charts\""));
    // Bad list parameters are a 400 with the field named, nothing else.
    let r = get_as(&t, "/?sort=sideways", OPS).await;
    assert_eq!(r.status, 400);
    assert!(r.text().contains("sort"), "{}", r.text());
    let r = get_as(&t, "/?held_over=soon", OPS).await;
    assert_eq!(r.status, 400);
    assert_eq!(get_as(&t, "/?page=0", OPS).await.status, 400);
    t.stop().await;
}
