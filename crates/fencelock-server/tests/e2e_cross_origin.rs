//! Issue 19 item 6 in a real browser: with authentication off (the loopback
//! default), a page on another origin cannot act on the server. The test holds a
//! lock, serves an attacker's page from a second origin (`127.0.0.2`, another
//! loopback address), and runs `tests/e2e/cross_origin.mjs`, which opens it in
//! headless Debian Chromium. The page tries what any web site could: `fetch` with
//! `mode: "no-cors"` and `text/plain` or no content type (no preflight), a JSON
//! `fetch` (preflighted), `navigator.sendBeacon`, and HTML form posts (`text/plain`
//! to the API, form data to the dashboard's force-release) — to force-release and
//! release the held lock and to acquire new ones. Afterwards the lock state is read
//! through the API: the lock is still held with its fence and nothing was acquired.
//!
//! Before the origin rules (`crates/fencelock-server/src/origin.rs`) the `text/plain`
//! force-release alone released the lock.
//!
//! Needs `node`, `/usr/bin/chromium` (or `$CHROMIUM`) and `npm ci` in `tests/e2e`,
//! like `e2e_dashboard.rs`. Run: `cargo test -p fencelock-server --test it e2e_cross_origin::`

use crate::support;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::json;
use support::TestServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn e2e_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2e")
}

fn require_tools() {
    let node = Command::new("node").arg("--version").output();
    assert!(
        node.is_ok_and(|o| o.status.success()),
        "`node` is needed for the browser test: run scripts/test.sh as root, or `apt-get install nodejs npm`"
    );
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    assert!(
        Path::new(&chromium).exists(),
        "{chromium} is needed for the browser test: run scripts/test.sh as root, or `apt-get install chromium`"
    );
    assert!(
        e2e_dir().join("node_modules/playwright-core").exists(),
        "playwright-core is not installed: run `npm ci` in {}",
        e2e_dir().display()
    );
}

/// The attacker's page: every request a page on another origin can make without
/// the server's consent, against `target`.
fn attacker_page(target: &str, victim: &str, owner_token: &str) -> String {
    format!(
        r#"<!doctype html><html><body>
<iframe name="sink1" id="sink1"></iframe><iframe name="sink2" id="sink2"></iframe>
<form id="api-form" method="POST" action="{target}/v1/admin/force-release" enctype="text/plain" target="sink1">
<input type="hidden" name='{{"name":"{victim}","reason":"csrf form","pad":"' value='"}}'></form>
<form id="ui-form" method="POST" action="{target}/ui/force-release" target="sink2">
<input type="hidden" name="name" value="{victim}"><input type="hidden" name="reason" value="csrf dashboard form"></form>
<script>
const target = "{target}";
const results = {{}};
async function attempt(what, path, init) {{
  try {{
    const r = await fetch(target + path, init);
    results[what] = r.type === "opaque" ? "sent, answer unreadable" : "status " + r.status;
  }} catch (e) {{
    results[what] = "blocked by the browser: " + e.message;
  }}
}}
const plain = (body) => ({{ method: "POST", mode: "no-cors", headers: {{ "Content-Type": "text/plain" }}, body: JSON.stringify(body) }});
function submit(form, frame) {{
  return new Promise((done) => {{
    document.getElementById(frame).onload = done;
    setTimeout(done, 5000);
    document.getElementById(form).submit();
  }});
}}
(async () => {{
  await attempt("force-release text/plain", "/v1/admin/force-release", plain({{ name: "{victim}", reason: "csrf" }}));
  await attempt("release text/plain", "/v1/release", plain({{ name: "{victim}", owner_token: "{owner_token}" }}));
  await attempt("acquire text/plain", "/v1/acquire", plain({{ name: "csrf:plain", ttl_ms: 600000 }}));
  await attempt("acquire without content type", "/v1/acquire",
    {{ method: "POST", mode: "no-cors", body: new Blob([JSON.stringify({{ name: "csrf:blob", ttl_ms: 600000 }})]) }});
  await attempt("acquire json (preflighted)", "/v1/acquire",
    {{ method: "POST", headers: {{ "Content-Type": "application/json" }}, body: JSON.stringify({{ name: "csrf:json", ttl_ms: 600000 }}) }});
  await attempt("force-release json (preflighted)", "/v1/admin/force-release",
    {{ method: "POST", headers: {{ "Content-Type": "application/json" }}, body: JSON.stringify({{ name: "{victim}", reason: "csrf" }}) }});
  results["sendBeacon force-release"] = navigator.sendBeacon(target + "/v1/admin/force-release",
    JSON.stringify({{ name: "{victim}", reason: "csrf beacon" }})) ? "queued" : "refused";
  await submit("api-form", "sink1");
  results["form post text/plain force-release"] = "submitted";
  await submit("ui-form", "sink2");
  results["dashboard form force-release"] = "submitted";
  // Let the beacon go out before the page is closed.
  await new Promise((done) => setTimeout(done, 500));
  window.attackDone = results;
}})();
</script></body></html>"#
    )
}

/// Serves `page` to every request on `127.0.0.2`, another origin than the server's.
async fn serve_attacker(page: String) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.2:0")
        .await
        .expect("bind 127.0.0.2 (another loopback address)");
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        // Bounded: the browser asks for the page and perhaps a favicon.
        for _ in 0..16 {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            let page = page.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let answer = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/html; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{page}",
                    page.len()
                );
                let _ = stream.write_all(answer.as_bytes()).await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_on_another_origin_cannot_acquire_release_or_force_release() {
    require_tools();
    let s = TestServer::start().await;
    let c = &s.client;
    let victim = "billing:ledger";
    let held = c
        .post(
            "/v1/acquire",
            &json!({"name": victim, "ttl_ms": 600_000, "owner": "worker-1"}),
        )
        .await
        .expect_json(200);
    let fence = held["fence"].as_u64().unwrap();
    let owner_token = held["owner_token"].as_str().unwrap().to_owned();

    let target = format!("http://{}", s.addr());
    let attacker = serve_attacker(attacker_page(&target, victim, &owner_token)).await;
    let url = format!("http://{attacker}/");
    let dir = e2e_dir();
    let out = tokio::task::spawn_blocking(move || {
        Command::new("node")
            .arg("cross_origin.mjs")
            .current_dir(dir)
            .env("ATTACKER_URL", url)
            .output()
            .expect("run node")
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("RESULT "),
        "browser run failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    let result = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .unwrap_or("{}");
    let tried: serde_json::Value = serde_json::from_str(result).unwrap_or_default();
    let attempts = tried.as_object().map_or(0, |o| o.len());
    eprintln!("the attacker's page reported: {result}");

    // The server's state says whether any of it worked.
    let lock = c.get(&format!("/v1/locks/{victim}")).await;
    let still_held = lock.status == 200 && lock.expect_json(200)["holders"][0]["fence"] == fence;
    let acquired: Vec<&str> = {
        let mut acquired = Vec::new();
        for name in ["csrf:plain", "csrf:blob", "csrf:json"] {
            if c.get(&format!("/v1/locks/{name}")).await.status != 404 {
                acquired.push(name);
            }
        }
        acquired
    };
    println!(
        "ATTACK 6: a page on another origin (127.0.0.2) in headless Chromium made {attempts} \
         cross-site requests (no-cors text/plain and untyped fetch, preflighted JSON fetch, \
         sendBeacon, text/plain and dashboard form posts) to force-release, release and \
         acquire -> {}",
        if still_held && acquired.is_empty() {
            format!("refused: the lock is still held with fence {fence}, nothing acquired")
        } else {
            format!("ATTACK WORKED: lock still held: {still_held}, acquired: {acquired:?}")
        }
    );
    assert_eq!(attempts, 9, "every attack ran: {result}");
    assert!(still_held, "the page released {victim}: {}", lock.text());
    assert!(acquired.is_empty(), "the page acquired {acquired:?}");
    s.stop().await;
}
