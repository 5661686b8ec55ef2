//! Issue 19's browser-side and naming attacks against the real binary, each printing
//! one `ATTACK <item>: … -> …` line (collected into docs/security.md):
//!
//! - item 6, with authentication off: a cross-site POST (`text/plain`, foreign
//!   `Origin`) that force-released a lock, and DNS rebinding (`Host: evil.example`)
//!   reading `/v1/locks` and a snapshot;
//! - item 8: a reader limited to `a:` reading global counts in `/metrics` and the
//!   dashboard's health panel, and a lock name with a zero-width space that looks
//!   like another (`a:\u{200B}x` vs `a:x`).
//!
//! The same page-on-another-origin attack in a real browser is
//! `crates/fencelock-server/tests/e2e_cross_origin.rs`.

use crate::attack;

use attack::{http, serve, token};
use serde_json::json;

const ADMIN: &str = "flk_attack_admin_secret";
const TENANT_READER: &str = "flk_attack_tenant_reader";

#[test]
fn cross_site_post_cannot_force_release_with_auth_off() {
    let s = serve("");
    let host = format!("127.0.0.1:{}", s.addr.port());
    let json_post = |path: &str, body: &serde_json::Value| {
        http(
            s.addr,
            "POST",
            path,
            &[("Host", &host), ("Content-Type", "application/json")],
            &body.to_string(),
        )
    };
    let held = json_post(
        "/v1/acquire",
        &json!({"name": "billing:ledger", "ttl_ms": 600_000}),
    );
    assert_eq!(held.status, 200, "{}", held.body);
    let fence = held.json()["fence"].as_u64().unwrap();

    let body = json!({"name": "billing:ledger", "reason": "csrf"}).to_string();
    // What a page on evil.example can send without a preflight, and the JSON it can
    // only send after one (which the browser then refuses for it; here it is sent
    // anyway, as a client that ignores CORS would).
    let attempts: [(&str, Vec<(&str, &str)>); 5] = [
        (
            "text/plain with a foreign Origin",
            vec![
                ("Content-Type", "text/plain"),
                ("Origin", "http://evil.example"),
            ],
        ),
        (
            "form data with Origin null",
            vec![
                ("Content-Type", "application/x-www-form-urlencoded"),
                ("Origin", "null"),
            ],
        ),
        (
            "text/plain without Origin",
            vec![("Content-Type", "text/plain")],
        ),
        ("no content type", vec![]),
        (
            "JSON with a foreign Origin",
            vec![
                ("Content-Type", "application/json"),
                ("Origin", "http://evil.example"),
            ],
        ),
    ];
    let mut refused = 0;
    for (what, extra) in &attempts {
        let mut headers = vec![("Host", host.as_str())];
        headers.extend(extra.iter().copied());
        let a = http(s.addr, "POST", "/v1/admin/force-release", &headers, &body);
        if a.status == 403 && a.code() == "permission_denied" {
            refused += 1;
        } else {
            eprintln!("{what}: {} {}", a.status, a.body);
        }
    }
    // The preflight a browser sends before the JSON post gets no CORS headers.
    let preflight = http(
        s.addr,
        "OPTIONS",
        "/v1/admin/force-release",
        &[
            ("Host", &host),
            ("Origin", "http://evil.example"),
            ("Access-Control-Request-Method", "POST"),
        ],
        "",
    );
    let lock = http(
        s.addr,
        "GET",
        "/v1/locks/billing:ledger",
        &[("Host", &host)],
        "",
    );
    let still_held = lock.status == 200 && lock.json()["holders"][0]["fence"] == fence;
    println!(
        "ATTACK 6: cross-site POST /v1/admin/force-release with auth off, {} ways (text/plain \
         or form data with a foreign or null Origin, text/plain or untyped without Origin, \
         JSON with a foreign Origin) -> {refused} refused with 403 permission_denied, \
         preflight answered {} without CORS headers, lock {}",
        attempts.len(),
        preflight.status,
        if still_held {
            "still held with its fence"
        } else {
            "RELEASED"
        }
    );
    assert_eq!(refused, attempts.len());
    assert!(!preflight.body.is_empty() && preflight.status >= 400);
    assert!(still_held, "{}", lock.body);
    // The server's own clients are unaffected: JSON from no or the same origin.
    let same_origin = format!("http://{host}");
    let own = http(
        s.addr,
        "POST",
        "/v1/admin/force-release",
        &[
            ("Host", &host),
            ("Content-Type", "application/json"),
            ("Origin", &same_origin),
        ],
        &body,
    );
    assert_eq!(own.status, 200, "{}", own.body);
}

#[test]
fn dns_rebinding_cannot_read_locks_or_snapshots_with_auth_off() {
    let s = serve("");
    let port = s.addr.port();
    let local = format!("localhost:{port}");
    let a = http(
        s.addr,
        "POST",
        "/v1/acquire",
        &[("Host", &local), ("Content-Type", "application/json")],
        &json!({"name": "secret:plan", "ttl_ms": 600_000}).to_string(),
    );
    assert_eq!(a.status, 200, "{}", a.body);
    // After rebinding evil.example to 127.0.0.1, the attacker's page reads "its own"
    // origin, and the browser names it in Host.
    let mut refused = 0;
    let mut leaked = Vec::new();
    let paths = [
        "/v1/locks",
        "/v1/locks/secret:plan",
        "/v1/admin/snapshot",
        "/v1/audit",
        "/",
        "/metrics",
    ];
    for host in [
        format!("evil.example:{port}"),
        "evil.example".to_owned(),
        format!("127.0.0.1.nip.io:{port}"),
    ] {
        for path in paths {
            let a = http(s.addr, "GET", path, &[("Host", &host)], "");
            if a.status == 403 && a.code() == "permission_denied" {
                refused += 1;
            }
            if a.body.contains("secret:plan") {
                leaked.push(format!("{host}{path}"));
            }
        }
    }
    let tried = paths.len() * 3;
    println!(
        "ATTACK 6: DNS rebinding with auth off, {tried} reads of /v1/locks, a lock, a \
         snapshot, the audit log, the dashboard and /metrics with Host evil.example (3 \
         forms) -> {refused} refused with 403 permission_denied, {} leaked the lock name",
        leaked.len()
    );
    assert_eq!(refused, tried, "leaked: {leaked:?}");
    assert!(leaked.is_empty(), "{leaked:?}");
    // Names that cannot be rebound still work, and probes answer any Host.
    for host in [
        local.as_str(),
        &format!("127.0.0.1:{port}"),
        &format!("[::1]:{port}"),
    ] {
        assert_eq!(
            http(s.addr, "GET", "/v1/locks", &[("Host", host)], "").status,
            200,
            "{host}"
        );
    }
    assert_eq!(
        http(s.addr, "GET", "/healthz", &[("Host", "evil.example")], "").status,
        200
    );
}

#[test]
fn a_reader_limited_to_a_prefix_sees_no_global_counts() {
    let config = format!(
        "{}{}",
        token("root", "admin", &[""], ADMIN, ""),
        token("tenant-a", "reader", &["a:"], TENANT_READER, "")
    );
    let s = serve(&config);
    let admin = format!("Bearer {ADMIN}");
    let reader = format!("Bearer {TENANT_READER}");
    // Another tenant's activity: 7 locks under b:.
    for i in 0..7 {
        let a = http(
            s.addr,
            "POST",
            "/v1/acquire",
            &[
                ("Host", "localhost"),
                ("Authorization", &admin),
                ("Content-Type", "application/json"),
            ],
            &json!({"name": format!("b:job:{i}"), "ttl_ms": 600_000}).to_string(),
        );
        assert_eq!(a.status, 200, "{}", a.body);
    }
    let metrics = http(
        s.addr,
        "GET",
        "/metrics",
        &[("Host", "localhost"), ("Authorization", &reader)],
        "",
    );
    let page = http(
        s.addr,
        "GET",
        "/",
        &[("Host", "localhost"), ("Authorization", &reader)],
        "",
    );
    // The dashboard's health panel shows the counts as `held<b>N</b>`.
    let page_counts = page.body.contains("<div>held<b>") || page.body.contains("<div>locks<b>");
    let metrics_counts = metrics.body.contains("fencelock_held_locks");
    println!(
        "ATTACK 8: a reader limited to a: read /metrics and the dashboard while 7 b: locks \
         were held -> /metrics {} {}, dashboard {} with global counts {}",
        metrics.status,
        metrics.code(),
        page.status,
        if page_counts { "SHOWN" } else { "hidden" }
    );
    assert_eq!(metrics.status, 403, "{}", metrics.body);
    assert_eq!(metrics.code(), "permission_denied");
    assert!(metrics.json()["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("every lock"));
    assert!(!metrics_counts);
    assert_eq!(page.status, 200, "{}", page.body);
    assert!(!page_counts, "{}", page.body);
    assert!(!page.body.contains("b:job"), "another tenant's lock shown");
    // A token covering every lock still gets both.
    let all = http(
        s.addr,
        "GET",
        "/metrics",
        &[("Host", "localhost"), ("Authorization", &admin)],
        "",
    );
    assert!(all.body.contains("fencelock_held_locks 7"), "{}", all.body);
}

#[test]
fn a_lock_name_with_a_zero_width_space_is_refused() {
    let s = serve("");
    let post = |name: &str| {
        http(
            s.addr,
            "POST",
            "/v1/acquire",
            &[("Host", "localhost"), ("Content-Type", "application/json")],
            &json!({"name": name, "ttl_ms": 600_000}).to_string(),
        )
    };
    let real = post("a:x");
    assert_eq!(real.status, 200, "{}", real.body);
    let lookalikes = [
        "a:\u{200B}x",
        "a:x\u{200D}",
        "a:\u{202E}x",
        "\u{FEFF}a:x",
        "a:\u{2066}x\u{2069}",
    ];
    let mut refused = 0;
    for name in lookalikes {
        let a = post(name);
        let code = format!(
            "U+{:04X}",
            name.chars().find(|c| !c.is_ascii()).unwrap() as u32
        );
        if a.status == 400 && a.code() == "invalid_argument" && a.body.contains(&code) {
            refused += 1;
        } else {
            eprintln!("{name:?}: {} {}", a.status, a.body);
        }
    }
    let listed = http(
        s.addr,
        "GET",
        "/v1/locks?prefix=a:",
        &[("Host", "localhost")],
        "",
    )
    .json();
    let names = listed["locks"].as_array().map_or(0, Vec::len);
    println!(
        "ATTACK 8: {} acquires of names that look like a:x (zero-width space and joiner, \
         bidi override and isolate, BOM) -> {refused} refused with 400 invalid_argument \
         naming the character, {names} lock listed under a:",
        lookalikes.len()
    );
    assert_eq!(refused, lookalikes.len());
    assert_eq!(names, 1, "{listed}");
}
