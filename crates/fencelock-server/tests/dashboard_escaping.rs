//! The dashboard escapes every user-supplied string (issue 21): a lock named
//! `<script>alert(1)</script>`, held by an owner `<script>alert(2)</script>` and taken
//! over the HTTP API of a real server, shows up only escaped in the pages, in the
//! live stream's partials and in the force-release answer with its out-of-band
//! sections; so does a force-release reason with markup.
//!
//! Run: `cargo test -p fencelock-server --test it dashboard_escaping::`

use crate::support;

use serde_json::json;
use support::{pct, TestServer, IO_TIMEOUT};

const NAME: &str = "<script>alert(1)</script>";
const OWNER: &str = "<script>alert(2)</script>";
const REASON: &str = "<script>alert(3)</script>";
const WAITER: &str = "<script>alert(4)</script>";
const NAME_ESCAPED: &str = "&lt;script&gt;alert(1)&lt;/script&gt;";
const OWNER_ESCAPED: &str = "&lt;script&gt;alert(2)&lt;/script&gt;";
const REASON_ESCAPED: &str = "&lt;script&gt;alert(3)&lt;/script&gt;";
const WAITER_ESCAPED: &str = "&lt;script&gt;alert(4)&lt;/script&gt;";

/// `html` (the answer to `what`) has no `<script>` tag from user data, and has each
/// of `escaped`.
fn check(what: &str, html: &str, escaped: &[&str]) {
    assert!(
        !html.contains("<script>alert"),
        "{what}: a <script> tag from user data, unescaped: {html}"
    );
    for e in escaped {
        assert!(html.contains(e), "{what}: no {e:?} in {html}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_names_owners_and_reasons_with_script_tags_are_escaped_everywhere() {
    let s = TestServer::start().await;
    let c = &s.client;
    // The live stream, open before the lock is taken, so it sends the event's row.
    let mut stream = c.send("GET", "/ui/stream?prefix=", &[], b"").await;
    // Open once its head is here: every event after this is streamed.
    let head = stream.read_until("\r\n\r\n", IO_TIMEOUT).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let grant = c
        .post(
            "/v1/acquire",
            &json!({"name": NAME, "ttl_ms": 600_000, "owner": OWNER}),
        )
        .await
        .expect_json(200);
    assert_eq!(grant["name"], NAME, "the API keeps the name as given");

    let page = c.get("/").await;
    assert_eq!(page.status, 200);
    check("GET /", &page.text(), &[NAME_ESCAPED, OWNER_ESCAPED]);

    // The prefix is shown back in the form and in the stream's URL.
    let page = c.get(&format!("/?prefix={}", pct("<script>"))).await;
    assert_eq!(page.status, 200);
    let html = page.text();
    check("GET /?prefix=", &html, &[NAME_ESCAPED, OWNER_ESCAPED]);
    assert!(html.contains("value=\"&lt;script&gt;\""), "{html}");
    assert!(
        html.contains("sse-connect=\"/ui/stream?prefix=%3Cscript%3E&amp;sort=name&amp;page=1\""),
        "{html}"
    );

    // A waiter with markup in its owner text: listed on the lock's page, and
    // granted (so in the history) after the force-release below.
    let waiter = c
        .send_json(
            "/v1/acquire",
            &json!({"name": NAME, "ttl_ms": 600_000, "wait_ms": 60_000, "owner": WAITER}),
        )
        .await;
    support::poll_until("the waiter is queued", IO_TIMEOUT, || async {
        let v = c.get(&format!("/v1/locks/{}", pct(NAME))).await.json();
        (v["waiters"] == 1).then_some(())
    })
    .await;

    let lock_page = format!("/ui/lock/{}", pct(NAME));
    let page = c.get(&lock_page).await;
    assert_eq!(page.status, 200);
    let html = page.text();
    check(
        "the lock's page",
        &html,
        &[NAME_ESCAPED, OWNER_ESCAPED, WAITER_ESCAPED],
    );
    assert!(html.contains("<tr class=\"waiter\">"), "{html}");
    // The title, the confirmation and the hidden form field are escaped too.
    assert!(
        html.contains(&format!("<title>{NAME_ESCAPED} · fencelock</title>")),
        "{html}"
    );
    assert!(
        html.contains(&format!("hx-confirm=\"Force-release {NAME_ESCAPED}?")),
        "{html}"
    );
    assert!(
        html.contains(&format!("name=\"name\" value=\"{NAME_ESCAPED}\"")),
        "{html}"
    );

    // The stream's partials: the lock table and the event's row.
    let text = stream.read_until("event: event", IO_TIMEOUT).await;
    check("the live stream", &text, &[NAME_ESCAPED, OWNER_ESCAPED]);
    assert!(text.contains("event: locks"), "{text}");
    stream.close();

    // The force-release answer: a message and the lock's sections, out of band.
    let origin = format!("http://{}", s.addr());
    let r = c
        .request(
            "POST",
            "/ui/force-release",
            &[
                ("Content-Type", "application/x-www-form-urlencoded"),
                ("Origin", &origin),
            ],
            format!("name={}&reason={}", pct(NAME), pct(REASON)).as_bytes(),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let html = r.text();
    check(
        "the force-release answer",
        &html,
        &[NAME_ESCAPED, OWNER_ESCAPED, REASON_ESCAPED],
    );
    assert!(html.contains("hx-swap-oob=\"true\""), "{html}");

    // The waiter got the lock.
    let granted = waiter.response().await.expect_json(200);
    assert_eq!(granted["name"], NAME, "{granted}");
    let page = c.get(&lock_page).await;
    assert_eq!(page.status, 200);
    check(
        "the lock's history",
        &page.text(),
        &[NAME_ESCAPED, OWNER_ESCAPED, REASON_ESCAPED, WAITER_ESCAPED],
    );
    let page = c.get("/").await;
    check(
        "recent events",
        &page.text(),
        &[NAME_ESCAPED, OWNER_ESCAPED, REASON_ESCAPED],
    );
    s.stop().await;
}
