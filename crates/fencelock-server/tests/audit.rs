//! The audit log through the HTTP API: what is recorded, query filters, rebuilding
//! lost entries from the command log, and the dashboard's pages over it.
//!
//! Run: `cargo test -p fencelock-server --test it audit::`

use crate::support;

use std::path::Path;

use serde_json::{json, Value};
use support::{pct, Client, TestServer};

async fn start_in(dir: &Path) -> TestServer {
    let dir = dir.to_path_buf();
    TestServer::start_configured(move |c| c.engine.data_dir = dir).await
}

async fn acquire(c: &Client, body: Value) -> Value {
    c.post("/v1/acquire", &body).await.expect_json(200)
}

async fn audit(c: &Client, query: &str) -> Vec<Value> {
    let v = c.get(&format!("/v1/audit{query}")).await.expect_json(200);
    v["entries"].as_array().expect("entries").clone()
}

fn kinds(entries: &[Value]) -> Vec<(String, Option<u64>)> {
    entries
        .iter()
        .map(|e| (e["kind"].as_str().unwrap().to_owned(), e["fence"].as_u64()))
        .collect()
}

#[tokio::test]
async fn records_grants_handoffs_releases_renew_failures_and_forced_releases() {
    let s = TestServer::start().await;
    let c = &s.client;
    let a = acquire(
        c,
        json!({"name": "job:a", "ttl_ms": 30_000, "owner": "worker-1", "request_id": "req-1"}),
    )
    .await;
    let fa = a["fence"].as_u64().unwrap();
    // A waiter, handed the lock on release.
    let waiter = c
        .send_json(
            "/v1/acquire",
            &json!({"name": "job:a", "ttl_ms": 30_000, "wait_ms": 20_000, "owner": "worker-2"}),
        )
        .await;
    support::poll_until("the waiter queues", support::IO_TIMEOUT, || async {
        let v = c.get("/v1/locks/job:a").await.json();
        (v["waiters"] == 1).then_some(())
    })
    .await;
    c.post(
        "/v1/release",
        &json!({"name": "job:a", "owner_token": a["owner_token"]}),
    )
    .await
    .expect_json(200);
    let b = waiter.response().await.expect_json(200);
    let fb = b["fence"].as_u64().unwrap();
    // A renew with the old token fails: recorded, though nothing changed.
    c.post(
        "/v1/renew",
        &json!({"name": "job:a", "owner_token": a["owner_token"]}),
    )
    .await
    .expect_error(409, "not_held");
    c.post(
        "/v1/admin/force-release",
        &json!({"name": "job:a", "reason": "worker-2 is stuck <b>hard</b>"}),
    )
    .await
    .expect_json(200);
    acquire(c, json!({"name": "other", "ttl_ms": 30_000})).await;

    let entries = audit(c, "?lock=job:a").await;
    assert_eq!(
        kinds(&entries),
        vec![
            ("granted".to_owned(), Some(fa)),
            ("released".to_owned(), Some(fa)),
            ("granted".to_owned(), Some(fb)),
            ("renew_failed".to_owned(), None),
            ("force_released".to_owned(), Some(fb)),
        ],
        "{entries:#?}"
    );
    // A hand-off is a grant with the flag set; other kinds have no flag.
    assert_eq!(entries[0]["handoff"], false);
    assert_eq!(entries[2]["handoff"], true);
    assert!(entries[1].get("handoff").is_none(), "{}", entries[1]);
    assert_eq!(entries[0]["owner"], "worker-1");
    assert_eq!(entries[0]["request_id"], "req-1");
    assert_eq!(entries[2]["owner"], "worker-2");
    assert_eq!(entries[3]["detail"], "not_held");
    assert_eq!(entries[4]["reason"], "worker-2 is stuck <b>hard</b>");
    assert_eq!(entries[4]["actor"], "anonymous");
    for e in &entries {
        assert!(e["time_ms"].as_u64().unwrap() > 1_600_000_000_000, "{e}");
        assert!(e["time"].as_str().unwrap().ends_with('Z'), "{e}");
    }
    // Newest last, across locks.
    let all = audit(c, "").await;
    assert_eq!(all.last().unwrap()["lock"], "other");
    // limit keeps the newest.
    let last_two = audit(c, "?limit=2").await;
    assert_eq!(last_two.len(), 2);
    assert_eq!(last_two[0]["kind"], "force_released");
    assert_eq!(last_two[1]["lock"], "other");
    // since_ms filters by commit time.
    let future = all.last().unwrap()["time_ms"].as_u64().unwrap() + 60_000;
    assert!(audit(c, &format!("?since_ms={future}")).await.is_empty());
    let since = all.last().unwrap()["time_ms"].as_u64().unwrap();
    assert!(!audit(c, &format!("?since_ms={since}")).await.is_empty());
    // until_ms: nothing before the first entry, everything up to the last.
    let first = all[0]["time_ms"].as_u64().unwrap();
    assert!(audit(c, &format!("?until_ms={}", first - 1))
        .await
        .is_empty());
    assert_eq!(
        audit(c, &format!("?until_ms={since}")).await.len(),
        all.len()
    );
    // kind filters by the vocabulary's names, and takes the old names as aliases.
    let of = |q: &'static str| async move {
        kinds(&audit(c, &format!("?lock=job:a&kind={q}")).await)
            .into_iter()
            .map(|(k, f)| format!("{k} {}", f.unwrap_or(0)))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        of("granted").await,
        [format!("granted {fa}"), format!("granted {fb}")]
    );
    assert_eq!(
        of("grant").await,
        [format!("granted {fa}")],
        "direct grants only"
    );
    assert_eq!(
        of("handoff").await,
        [format!("granted {fb}")],
        "hand-offs only"
    );
    assert_eq!(
        of("forced_release,release").await,
        [format!("released {fa}"), format!("force_released {fb}")]
    );
    assert_eq!(of("force_released").await, of("forced_release").await);
    s.stop().await;
}

#[tokio::test]
async fn bad_audit_queries_are_client_errors() {
    let s = TestServer::start().await;
    let c = &s.client;
    for q in [
        "?limit=0",
        "?limit=100000",
        "?since_ms=yesterday",
        "?lock=",
        "?color=blue",
        "?kind=nope",
        "?kind=granted,",
        "?until_ms=tomorrow",
    ] {
        let r = c.get(&format!("/v1/audit{q}")).await;
        assert_eq!(r.status, 400, "{q}: {}", r.text());
    }
    s.stop().await;
}

#[tokio::test]
async fn expiries_and_session_ends_are_recorded() {
    let s = TestServer::start_with(|e| e.core.min_ttl_ms = 10).await;
    let c = &s.client;
    let g = acquire(c, json!({"name": "short", "ttl_ms": 50})).await;
    let session = c
        .post("/v1/sessions", &json!({"ttl_ms": 30_000, "owner": "svc"}))
        .await
        .expect_json(200);
    let sid = session["session"].as_str().unwrap().to_owned();
    acquire(c, json!({"name": "in-session", "session": sid})).await;
    c.delete(&format!("/v1/sessions/{sid}"))
        .await
        .expect_json(200);
    let expired = support::poll_until("the lease expires", support::IO_TIMEOUT, || async {
        let e = audit(c, "?lock=short").await;
        e.iter().any(|e| e["kind"] == "expired").then_some(e)
    })
    .await;
    assert_eq!(expired.last().unwrap()["fence"], g["fence"]);
    let all = audit(c, "").await;
    let end = all
        .iter()
        .find(|e| e["kind"] == "session_ended")
        .expect("a session_ended entry");
    // The handle, never the id (issue 19 item 3), and who closed it.
    assert_eq!(end["session"], session["handle"]);
    assert_ne!(end["session"], sid.as_str());
    assert_eq!(end["reason"], "closed");
    assert_eq!(end["actor"], "anonymous");
    let expiry = expired.last().unwrap();
    assert_eq!(expiry["actor"], "server", "{expiry}");
    assert_eq!(expiry["detail"], "principal anonymous", "{expiry}");
    assert!(all
        .iter()
        .any(|e| e["kind"] == "released" && e["lock"] == "in-session"));
    s.stop().await;
}

#[tokio::test]
async fn lost_audit_entries_are_rebuilt_from_the_command_log() {
    let dir = tempfile::tempdir().unwrap();
    let s = start_in(dir.path()).await;
    let mut fences = Vec::new();
    for i in 0..5 {
        let g = acquire(
            &s.client,
            json!({"name": format!("r:{i}"), "ttl_ms": 60_000}),
        )
        .await;
        fences.push(g["fence"].as_u64().unwrap());
    }
    s.client
        .post(
            "/v1/admin/force-release",
            &json!({"name": "r:0", "reason": "maintenance"}),
        )
        .await
        .expect_json(200);
    let before = audit(&s.client, "").await;
    s.stop().await;
    // As if the machine crashed after the command log's sync but before the audit
    // store's: the audit store is gone.
    std::fs::remove_dir_all(dir.path().join("audit")).unwrap();
    let s = start_in(dir.path()).await;
    let after = audit(&s.client, "").await;
    assert_eq!(
        after, before,
        "every entry is rebuilt, identical (time included)"
    );
    assert_eq!(after.len(), 6);
    s.stop().await;
    // A restart with the store intact adds no duplicates.
    let s = start_in(dir.path()).await;
    assert_eq!(audit(&s.client, "").await, before);
    s.stop().await;
}

#[tokio::test]
async fn a_corrupt_audit_log_refuses_start_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    // Two runs, so that the audit log holds two synced batches: damage in the first
    // is then provably not a torn write at the end.
    for run in 0..2 {
        let s = start_in(dir.path()).await;
        for i in 0..3 {
            acquire(
                &s.client,
                json!({"name": format!("c:{run}:{i}"), "ttl_ms": 60_000}),
            )
            .await;
        }
        s.stop().await;
    }
    let audit_dir = dir.path().join("audit");
    let seg = std::fs::read_dir(&audit_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "seg"))
        .expect("an audit segment");
    let mut bytes = std::fs::read(&seg).unwrap();
    bytes[32 + 8 + 4] ^= 0x55; // inside the first record, followed by later synced ones
    std::fs::write(&seg, bytes).unwrap();
    let mut config = fencelock_server::ServerConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        fencelock_server::EngineConfig::new(dir.path()),
    );
    config.engine.data_dir = dir.path().to_path_buf();
    let err = fencelock_server::Server::start(config)
        .await
        .err()
        .expect("start must refuse a corrupt audit log");
    assert!(
        err.message().contains("audit log") && err.message().contains("corrupt"),
        "{}",
        err.message()
    );
}

#[tokio::test]
async fn dashboard_shows_locks_escapes_names_and_force_releases_with_a_reason() {
    let s = TestServer::start().await;
    let c = &s.client;
    let evil = "<script>alert(1)</script>";
    let g = acquire(
        c,
        json!({"name": evil, "ttl_ms": 60_000, "owner": "<img src=x onerror=alert(2)>"}),
    )
    .await;
    let fence = g["fence"].as_u64().unwrap();
    let page = c.get("/").await;
    assert_eq!(page.status, 200);
    assert!(page
        .header("content-type")
        .unwrap()
        .starts_with("text/html"));
    let html = page.text();
    assert!(!html.contains(evil), "unescaped lock name in the page");
    assert!(!html.contains("<img src=x"), "unescaped owner in the page");
    assert!(html.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
    assert!(html.contains(&format!("<td class=\"num fence\">{fence}</td>")));
    assert!(html.contains("/ui/assets/htmx.min.js"));
    let csp = page.header("content-security-policy").expect("a CSP");
    assert!(
        csp.contains("script-src 'self'") && csp.contains("frame-ancestors 'none'"),
        "{csp}"
    );
    // The vendored scripts are served.
    let js = c.get("/ui/assets/htmx.min.js").await;
    assert_eq!(js.status, 200);
    assert!(js.text().starts_with("/*! htmx.org 2.0.11"));
    assert_eq!(c.get("/ui/assets/nope.js").await.status, 404);
    // Force release through the dashboard's form: a reason is required. The browser
    // names the page's origin, which must be the server's own.
    let origin = format!("http://{}", s.addr());
    let form = |body: String| {
        let origin = origin.clone();
        async move {
            c.request(
                "POST",
                "/ui/force-release",
                &[
                    ("Content-Type", "application/x-www-form-urlencoded"),
                    ("Origin", &origin),
                ],
                body.as_bytes(),
            )
            .await
        }
    };
    let r = form(format!("name={}&reason=", pct(evil))).await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(c.get(&format!("/v1/locks/{}", pct(evil))).await.status, 200);
    let r = form(format!(
        "name={}&reason={}",
        pct(evil),
        pct("stuck <i>x</i>")
    ))
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.text().contains(&format!("fence {fence}")), "{}", r.text());
    assert!(!r.text().contains("<script>"));
    assert_eq!(c.get(&format!("/v1/locks/{}", pct(evil))).await.status, 404);
    // The lock's history page shows the forced release, escaped.
    let hist = c.get(&format!("/ui/lock/{}", pct(evil))).await;
    assert_eq!(hist.status, 200);
    let html = hist.text();
    assert!(html.contains("force released"), "{html}");
    assert!(html.contains("kind-force_released"), "{html}");
    assert!(
        html.contains("reason: stuck &lt;i&gt;x&lt;/i&gt;"),
        "{html}"
    );
    assert!(!html.contains(evil));
    // Bad input is a client error, never a 500.
    assert_eq!(c.get("/ui/lock/").await.status / 100, 4);
    let r = form("garbage".to_owned()).await;
    assert_eq!(r.status, 400);
    let r = form(format!("name={}&reason=x&fence=0", pct("a"))).await;
    assert_eq!(r.status, 400);
    s.stop().await;
}

#[tokio::test]
async fn the_live_stream_sends_the_lock_table_and_events() {
    let s = TestServer::start().await;
    let c = &s.client;
    let mut pending = c.send("GET", "/ui/stream?prefix=live:", &[], b"").await;
    // The stream is open (its events are the ones after this) once its head is here.
    let head = pending.read_until("\r\n\r\n", support::IO_TIMEOUT).await;
    assert!(head.contains("text/event-stream"), "{head}");
    acquire(
        c,
        json!({"name": "live:1", "ttl_ms": 60_000, "owner": "me"}),
    )
    .await;
    acquire(c, json!({"name": "dead:1", "ttl_ms": 60_000})).await;
    // Read the stream until the table shows live:1 and an event row arrived.
    let text = pending
        .read_until("event: event", support::IO_TIMEOUT)
        .await;
    assert!(text.contains("event: locks"), "{text}");
    assert!(text.contains("live:1"), "{text}");
    assert!(
        !text.contains("dead:1"),
        "other prefixes are not streamed: {text}"
    );
    s.stop().await;
}

#[tokio::test]
async fn entries_survive_snapshots_and_restarts_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_path_buf();
    let start = || {
        let path = path.clone();
        TestServer::start_configured(move |c| {
            c.engine.data_dir = path;
            // Snapshot (and drop the log before it) every few KiB of log.
            c.engine.snapshot_after_bytes = 4096;
        })
    };
    let mut fences = Vec::new();
    for run in 0..3 {
        let s = start().await;
        for i in 0..100 {
            let g = acquire(
                &s.client,
                json!({"name": format!("snap:{run}:{i}"), "ttl_ms": 600_000}),
            )
            .await;
            fences.push(g["fence"].as_u64().unwrap());
        }
        s.stop().await;
    }
    let snapshots = std::fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("snap-")
        })
        .count();
    assert!(snapshots >= 1, "no snapshot was taken");
    let s = start().await;
    let grants: Vec<u64> = audit(&s.client, "?limit=1000")
        .await
        .iter()
        .filter(|e| e["kind"] == "granted")
        .map(|e| e["fence"].as_u64().unwrap())
        .collect();
    assert_eq!(grants, fences, "every grant exactly once, in order");
    s.stop().await;
}
