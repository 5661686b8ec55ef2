//! The HTTP/JSON v1 contract (docs/design.md §4), tested through a real server on a random
//! port with its own data directory, with a raw HTTP/1.1 client (`support`).
//!
//! Run: `cargo test -p fencelock-server --test it http_api::`

use crate::support;

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::{metric, pct, poll_until, Client, Response, TestServer};

/// Upper bound for every poll on a server-side timer (expiry, lock-delay, waiters).
const POLL: Duration = Duration::from_secs(10);

fn keys(v: &Value) -> Vec<&str> {
    let mut k: Vec<&str> = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {v}"))
        .keys()
        .map(String::as_str)
        .collect();
    k.sort_unstable();
    k
}

fn assert_hex128(s: &Value) {
    let s = s.as_str().unwrap_or_else(|| panic!("not a string: {s}"));
    assert_eq!(s.len(), 32, "not 128 bits of hex: {s:?}");
    assert!(
        s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
        "not lower-case hex: {s:?}"
    );
}

fn fence(v: &Value) -> u64 {
    v["fence"]
        .as_u64()
        .unwrap_or_else(|| panic!("no fence in {v}"))
}

/// `POST /v1/acquire`, expecting a grant.
async fn grant(c: &Client, body: Value) -> Value {
    let r = c.post("/v1/acquire", &body).await;
    let g = r.expect_json(200);
    assert_hex128(&g["owner_token"]);
    assert!(fence(&g) >= 1);
    g
}

async fn release(c: &Client, g: &Value) -> Response {
    c.post(
        "/v1/release",
        &json!({"name": g["name"], "owner_token": g["owner_token"]}),
    )
    .await
}

async fn renew(c: &Client, g: &Value) -> Response {
    c.post(
        "/v1/renew",
        &json!({"name": g["name"], "owner_token": g["owner_token"]}),
    )
    .await
}

async fn show(c: &Client, name: &str) -> Response {
    c.get(&format!("/v1/locks/{}", pct(name))).await
}

async fn metrics_text(c: &Client) -> String {
    let r = c.get("/metrics").await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.text()
}

async fn metric_value(c: &Client, name: &str) -> f64 {
    let text = metrics_text(c).await;
    metric(&text, name).unwrap_or_else(|| panic!("metric {name} missing:\n{text}"))
}

/// Polls `GET /v1/locks/{name}` until `cond` holds for the response.
async fn poll_lock(c: &Client, name: &str, what: &str, cond: impl Fn(&Response) -> bool) {
    poll_until(what, POLL, || async {
        let r = show(c, name).await;
        cond(&r).then_some(())
    })
    .await
}

fn waiters_are(n: u64) -> impl Fn(&Response) -> bool {
    move |r| r.status == 200 && r.json()["waiters"] == n
}

fn is_free(r: &Response) -> bool {
    r.status == 404
}

// ---------------------------------------------------------------------------------
// 1. The core contract: acquire, renew, release, show, list.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_renew_release_follow_the_contract() {
    let s = TestServer::start().await;
    let c = s.client;
    let name = "inventory:item:1234";

    let g = grant(
        &c,
        json!({"name": name, "ttl_ms": 30_000, "owner": "worker-1"}),
    )
    .await;
    assert_eq!(keys(&g), ["fence", "mode", "name", "owner_token", "ttl_ms"]);
    assert_eq!(g["mode"], "exclusive");
    assert_eq!(g["name"], name);
    assert_eq!(g["ttl_ms"], 30_000);

    // Held: without wait_ms, and with wait_ms 0, the answer is immediate.
    for body in [
        json!({"name": name, "ttl_ms": 1000}),
        json!({"name": name, "ttl_ms": 1000, "wait_ms": 0}),
    ] {
        let msg = c.post("/v1/acquire", &body).await.expect_error(409, "held");
        assert!(msg.contains(name), "message names the lock: {msg}");
    }

    // With wait_ms: 409 timeout, only after waiting.
    let started = Instant::now();
    c.post(
        "/v1/acquire",
        &json!({"name": name, "ttl_ms": 1000, "wait_ms": 200}),
    )
    .await
    .expect_error(409, "timeout");
    assert!(
        started.elapsed() >= Duration::from_millis(195),
        "timed out after {:?}, before wait_ms",
        started.elapsed()
    );

    // The lock as operators see it.
    let v = show(&c, name).await.expect_json(200);
    assert_eq!(
        keys(&v),
        [
            "holders",
            "limit",
            "lock_delay_remaining_ms",
            "name",
            "waiters"
        ]
    );
    assert_eq!(v["name"], name);
    assert_eq!(v["limit"], 1);
    assert_eq!(v["waiters"], 0);
    assert_eq!(v["lock_delay_remaining_ms"], 0);
    let holders = v["holders"].as_array().unwrap();
    assert_eq!(holders.len(), 1);
    let h = &holders[0];
    assert_eq!(
        keys(h),
        ["fence", "held_ms", "mode", "owner", "ttl_remaining_ms"]
    );
    assert_eq!(h["fence"], g["fence"]);
    assert_eq!(h["owner"], "worker-1");
    assert!(h["held_ms"].as_u64().unwrap() >= 195, "held_ms counts: {h}");
    let left = h["ttl_remaining_ms"].as_u64().unwrap();
    assert!(left > 0 && left <= 30_000, "{h}");

    // Renew keeps the fence; without ttl_ms it keeps the ttl, with it changes it.
    let r = renew(&c, &g).await.expect_json(200);
    assert_eq!(keys(&r), ["fence", "name", "ttl_ms"]);
    assert_eq!(r["name"], name);
    assert_eq!(r["fence"], g["fence"]);
    assert_eq!(r["ttl_ms"], 30_000);
    let r = c
        .post(
            "/v1/renew",
            &json!({"name": name, "owner_token": g["owner_token"], "ttl_ms": 90_000}),
        )
        .await
        .expect_json(200);
    assert_eq!(r["fence"], g["fence"]);
    assert_eq!(r["ttl_ms"], 90_000);
    let v = show(&c, name).await.expect_json(200);
    assert!(v["holders"][0]["ttl_remaining_ms"].as_u64().unwrap() > 30_000);

    // Renew with a token that never held it, or for another lock: not_held.
    let stranger = "0123456789abcdef0123456789abcdef";
    c.post("/v1/renew", &json!({"name": name, "owner_token": stranger}))
        .await
        .expect_error(409, "not_held");
    c.post(
        "/v1/renew",
        &json!({"name": "inventory:item:9999", "owner_token": g["owner_token"]}),
    )
    .await
    .expect_error(409, "not_held");

    // Release, then the idempotent repeat.
    let r = release(&c, &g).await.expect_json(200);
    assert_eq!(r, json!({"released": true}));
    let r = release(&c, &g).await.expect_json(200);
    assert_eq!(r, json!({"released": false, "reason": "already_released"}));
    renew(&c, &g).await.expect_error(409, "not_held");
    show(&c, name).await.expect_error(404, "not_found");

    // The next grant gets a larger fence.
    let g2 = grant(&c, json!({"name": name, "ttl_ms": 1000})).await;
    assert!(fence(&g2) > fence(&g));
    assert_eq!(show(&c, name).await.json()["holders"][0]["owner"], "");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renew_and_release_after_expiry_say_expired() {
    let s = TestServer::start().await;
    let c = s.client;
    let g = grant(&c, json!({"name": "short", "ttl_ms": 50})).await;
    poll_lock(&c, "short", "the 50 ms lease to expire", is_free).await;

    renew(&c, &g).await.expect_error(409, "expired");
    // Release of an expired grant did nothing either, and says why.
    release(&c, &g).await.expect_error(409, "expired");

    let g2 = grant(&c, json!({"name": "short", "ttl_ms": 10_000})).await;
    assert!(fence(&g2) > fence(&g));
    // The old token still cannot touch the new holder.
    renew(&c, &g).await.expect_error(409, "expired");
    release(&c, &g).await.expect_error(409, "expired");
    assert_eq!(
        show(&c, "short").await.expect_json(200)["holders"][0]["fence"],
        g2["fence"]
    );
    assert_eq!(metric_value(&c, "fencelock_expiries_total").await, 1.0);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_and_foreign_tokens_never_touch_the_holder() {
    let s = TestServer::start().await;
    let c = s.client;
    let a = grant(&c, json!({"name": "job", "ttl_ms": 30_000, "owner": "a"})).await;
    release(&c, &a).await.expect_json(200);
    let b = grant(&c, json!({"name": "job", "ttl_ms": 30_000, "owner": "b"})).await;
    let other = grant(&c, json!({"name": "other", "ttl_ms": 30_000})).await;

    // A's stale token: its own release already happened; it releases nothing now.
    let r = release(&c, &a).await.expect_json(200);
    assert_eq!(r, json!({"released": false, "reason": "already_released"}));
    renew(&c, &a).await.expect_error(409, "not_held");
    // Someone else's token (valid, for another lock), and a never-issued token.
    for token in [
        other["owner_token"].clone(),
        json!("ffffffffffffffffffffffffffffffff"),
    ] {
        let body = json!({"name": "job", "owner_token": token});
        c.post("/v1/release", &body)
            .await
            .expect_error(409, "not_held");
        c.post("/v1/renew", &body)
            .await
            .expect_error(409, "not_held");
    }

    let v = show(&c, "job").await.expect_json(200);
    assert_eq!(v["holders"].as_array().unwrap().len(), 1);
    assert_eq!(v["holders"][0]["fence"], b["fence"]);
    assert_eq!(v["holders"][0]["owner"], "b");
    // The holder still renews and releases normally; so does the other lock's.
    assert_eq!(renew(&c, &b).await.expect_json(200)["fence"], b["fence"]);
    assert_eq!(release(&c, &b).await.expect_json(200)["released"], true);
    assert_eq!(release(&c, &other).await.expect_json(200)["released"], true);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_names_with_slashes_colons_and_utf8_work_in_paths() {
    let s = TestServer::start().await;
    let c = s.client;
    let names = [
        "tenant:kind:id",
        "file/report.csv",
        "a//b",
        "/leading",
        "trailing/",
        "a/../b",
        "job:daily-settlement:2026-09-16",
        "é:ü:日本語 space",
        "100%",
        "a?b#c&d=e",
        "a+b",
        &"é".repeat(128), // 256 bytes
    ];
    let mut fences = Vec::new();
    for name in names {
        let g = grant(&c, json!({"name": name, "ttl_ms": 30_000, "owner": name})).await;
        assert_eq!(g["name"], name);
        fences.push(fence(&g));
    }
    for (name, f) in names.iter().zip(&fences) {
        // Percent-encoded everything; and `/` and `:` left as they are.
        let encoded = pct(name).replace("%2F", "/").replace("%3A", ":");
        for path in [pct(name), encoded] {
            let r = c.get(&format!("/v1/locks/{path}")).await;
            let v = r.expect_json(200);
            assert_eq!(v["name"], *name, "GET /v1/locks/{path}");
            assert_eq!(v["holders"][0]["fence"], *f);
            assert_eq!(v["holders"][0]["owner"], *name);
        }
    }
    // A free lock is 404 not_found, also for an odd name.
    for name in ["free", "a/b/c", "日本"] {
        show(&c, name).await.expect_error(404, "not_found");
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_filters_by_prefix_and_paginates() {
    let s = TestServer::start().await;
    let c = s.client;
    let mut all = vec![
        "app:a:1", "app:a:10", "app:a:2", "app:b:1", "app", "apq", "ap", "zzz:1", "é:1", "é:2", "a",
    ];
    for name in &all {
        grant(&c, json!({"name": name, "ttl_ms": 30_000})).await;
    }
    all.sort_unstable(); // byte order, as the server orders names

    async fn list(c: &Client, query: &str) -> (Vec<String>, Value) {
        let v = c.get(&format!("/v1/locks?{query}")).await.expect_json(200);
        assert_eq!(keys(&v), ["locks", "next_after"], "{v}");
        let names = v["locks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| {
                assert_eq!(
                    keys(l),
                    [
                        "holders",
                        "limit",
                        "lock_delay_remaining_ms",
                        "name",
                        "waiters"
                    ]
                );
                l["name"].as_str().unwrap().to_owned()
            })
            .collect();
        (names, v["next_after"].clone())
    }

    let expect = |prefix: &str| -> Vec<String> {
        all.iter()
            .filter(|n| n.starts_with(prefix))
            .map(|n| n.to_string())
            .collect()
    };
    for prefix in [
        "", "app:", "app:a:", "app:a:1", "ap", "app", "é", "é:2", "b", "zzz:1x", "~",
    ] {
        let (names, next) = list(&c, &format!("prefix={}", pct(prefix))).await;
        assert_eq!(names, expect(prefix), "prefix {prefix:?}");
        assert_eq!(
            next,
            Value::Null,
            "prefix {prefix:?}: a short page is the last"
        );
    }
    // No prefix parameter at all lists everything.
    assert_eq!(list(&c, "").await.0, expect(""));

    // Walk every prefix with every page size; pages join up to the full listing.
    for prefix in ["", "app:", "ap", "é"] {
        for limit in [1, 2, 3, 1000] {
            let mut walked = Vec::new();
            let mut after: Option<String> = None;
            for _page in 0..=all.len() + 1 {
                let mut q = format!("prefix={}&limit={limit}", pct(prefix));
                if let Some(a) = &after {
                    q.push_str(&format!("&after={}", pct(a)));
                }
                let (names, next) = list(&c, &q).await;
                assert!(names.len() <= limit);
                walked.extend(names.iter().cloned());
                match next.as_str() {
                    Some(n) => {
                        assert_eq!(names.len(), limit, "next_after only on a full page");
                        assert_eq!(Some(n), names.last().map(String::as_str));
                        after = Some(n.to_owned());
                    }
                    None => break,
                }
            }
            assert_eq!(walked, expect(prefix), "prefix {prefix:?} limit {limit}");
        }
    }
    // `after` outside the prefix range.
    assert_eq!(list(&c, "prefix=app%3A&after=a").await.0, expect("app:"));
    assert_eq!(
        list(&c, "prefix=app%3A&after=zzz").await.0,
        Vec::<String>::new()
    );
    s.stop().await;
}

// ---------------------------------------------------------------------------------
// 2. Sessions.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_hold_many_locks_and_close_releases_them() {
    let s = TestServer::start().await;
    let c = s.client;
    let v = c
        .post("/v1/sessions", &json!({"ttl_ms": 30_000, "owner": "svc-1"}))
        .await
        .expect_json(200);
    assert_eq!(keys(&v), ["handle", "session", "ttl_ms"]);
    assert_hex128(&v["session"]);
    let handle = v["handle"].as_str().unwrap().to_owned();
    assert_eq!(handle.len(), 16);
    assert_eq!(v["ttl_ms"], 30_000);
    let id = v["session"].as_str().unwrap().to_owned();

    let g1 = grant(&c, json!({"name": "s:1", "session": id, "owner": "o1"})).await;
    assert_eq!(
        keys(&g1),
        ["fence", "mode", "name", "owner_token", "session", "ttl_ms"]
    );
    assert_eq!(g1["session"], id.as_str());
    assert_eq!(g1["ttl_ms"], 30_000);
    let g2 = grant(&c, json!({"name": "s:2", "session": id})).await;
    assert!(fence(&g2) > fence(&g1));
    let h = &show(&c, "s:1").await.expect_json(200)["holders"][0];
    // Lock views show the session's handle, never its id (issue 19 item 3).
    assert_eq!(h["session"], handle.as_str());
    assert_eq!(h["owner"], "o1");

    // Keepalive restores the session's lease (seen on its locks): after it, at most
    // the time since the keepalive was sent has run off.
    poll_lock(&c, "s:1", "the session lease to run down a little", |r| {
        r.json()["holders"][0]["ttl_remaining_ms"].as_u64().unwrap() < 29_900
    })
    .await;
    let sent = Instant::now();
    let k = c
        .post_raw(&format!("/v1/sessions/{id}/keepalive"), b"", None)
        .await
        .expect_json(200);
    assert_eq!(k, json!({"session": id, "ttl_ms": 30_000}));
    let left = show(&c, "s:1").await.json()["holders"][0]["ttl_remaining_ms"]
        .as_u64()
        .unwrap();
    let since = sent.elapsed().as_millis() as u64 + 1;
    assert!(
        left >= 30_000 - since,
        "keepalive did not renew the lease: {left} ms left, {since} ms after keepalive"
    );

    // A session-held lock renews through its session, without a ttl of its own.
    assert_eq!(renew(&c, &g1).await.expect_json(200)["fence"], g1["fence"]);
    c.post(
        "/v1/renew",
        &json!({"name": "s:1", "owner_token": g1["owner_token"], "ttl_ms": 1000}),
    )
    .await
    .expect_error(400, "invalid_argument");

    // ttl_ms together with session is refused; so is an unknown session.
    c.post(
        "/v1/acquire",
        &json!({"name": "s:3", "session": id, "ttl_ms": 1000}),
    )
    .await
    .expect_error(400, "invalid_argument");
    let unknown = "00000000000000000000000000000001";
    c.post("/v1/acquire", &json!({"name": "s:3", "session": unknown}))
        .await
        .expect_error(404, "session_not_found");
    c.post_raw(&format!("/v1/sessions/{unknown}/keepalive"), b"", None)
        .await
        .expect_error(404, "session_not_found");
    c.delete(&format!("/v1/sessions/{unknown}"))
        .await
        .expect_error(404, "session_not_found");
    show(&c, "s:3").await.expect_error(404, "not_found");

    // Close: both locks released, cleanly (no lock-delay), and the session is gone.
    let r = c
        .delete(&format!("/v1/sessions/{id}"))
        .await
        .expect_json(200);
    assert_eq!(r, json!({"closed": true, "released": 2}));
    show(&c, "s:1").await.expect_error(404, "not_found");
    show(&c, "s:2").await.expect_error(404, "not_found");
    c.delete(&format!("/v1/sessions/{id}"))
        .await
        .expect_error(404, "session_not_found");
    c.post_raw(&format!("/v1/sessions/{id}/keepalive"), b"", None)
        .await
        .expect_error(404, "session_not_found");
    c.post("/v1/acquire", &json!({"name": "s:1", "session": id}))
        .await
        .expect_error(404, "session_not_found");
    renew(&c, &g1).await.expect_error(409, "not_held");
    let g3 = grant(&c, json!({"name": "s:1", "ttl_ms": 1000})).await;
    assert!(fence(&g3) > fence(&g2));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_expiry_frees_its_locks_and_ends_its_waits() {
    let s = TestServer::start().await;
    let c = s.client;
    let open = |ttl: u64| async move {
        let v = c
            .post("/v1/sessions", &json!({"ttl_ms": ttl}))
            .await
            .expect_json(200);
        v["session"].as_str().unwrap().to_owned()
    };
    let blocker = grant(&c, json!({"name": "exp:3", "ttl_ms": 60_000})).await;
    // Two sessions with the same short ttl: one is kept alive, one is not.
    let dying = open(500).await;
    let kept = open(500).await;
    grant(&c, json!({"name": "exp:1", "session": dying})).await;
    grant(&c, json!({"name": "exp:2", "session": dying})).await;
    let kept_grant = grant(&c, json!({"name": "exp:kept", "session": kept})).await;
    // The dying session also waits for a held lock.
    let waiting = c
        .send_json(
            "/v1/acquire",
            &json!({"name": "exp:3", "session": dying, "wait_ms": 60_000}),
        )
        .await;
    poll_lock(
        &c,
        "exp:3",
        "the session's request to queue",
        waiters_are(1),
    )
    .await;

    // Keep `kept` alive until `dying` has expired (no fixed sleep: the end of
    // `dying` is the clock).
    let deadline = Instant::now() + POLL;
    while show(&c, "exp:1").await.status != 404 {
        assert!(Instant::now() < deadline, "session never expired");
        c.post_raw(&format!("/v1/sessions/{kept}/keepalive"), b"", None)
            .await
            .expect_json(200);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    show(&c, "exp:2").await.expect_error(404, "not_found");
    waiting
        .response()
        .await
        .expect_error(404, "session_not_found");
    let v = show(&c, "exp:3").await.expect_json(200);
    assert_eq!(v["waiters"], 0);
    assert_eq!(v["holders"][0]["fence"], blocker["fence"]);
    let v = show(&c, "exp:kept").await.expect_json(200);
    assert_eq!(v["holders"][0]["fence"], kept_grant["fence"]);

    c.post_raw(&format!("/v1/sessions/{dying}/keepalive"), b"", None)
        .await
        .expect_error(404, "session_not_found");
    c.post("/v1/acquire", &json!({"name": "exp:1", "session": dying}))
        .await
        .expect_error(404, "session_not_found");
    assert_eq!(metric_value(&c, "fencelock_sessions").await, 1.0);
    s.stop().await;
}

// ---------------------------------------------------------------------------------
// 3. Semaphores, lock-delay, idempotency, forced release.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphore_admits_limit_holders() {
    let s = TestServer::start().await;
    let c = s.client;
    let mut grants = Vec::new();
    for i in 0..3 {
        let g = grant(
            &c,
            json!({"name": "sem", "ttl_ms": 30_000, "limit": 3, "owner": format!("h{i}")}),
        )
        .await;
        if let Some(prev) = grants.last() {
            assert!(fence(&g) > fence(prev), "each holder has its own fence");
        }
        grants.push(g);
    }
    c.post(
        "/v1/acquire",
        &json!({"name": "sem", "ttl_ms": 30_000, "limit": 3}),
    )
    .await
    .expect_error(409, "held");
    for limit in [json!(1), json!(2), json!(4), Value::Null] {
        let mut body = json!({"name": "sem", "ttl_ms": 30_000});
        if !limit.is_null() {
            body["limit"] = limit;
        }
        c.post("/v1/acquire", &body)
            .await
            .expect_error(409, "limit_mismatch");
    }
    let v = show(&c, "sem").await.expect_json(200);
    assert_eq!(v["limit"], 3);
    let holders: Vec<u64> = v["holders"].as_array().unwrap().iter().map(fence).collect();
    assert_eq!(holders, grants.iter().map(fence).collect::<Vec<_>>());

    // A freed slot goes to the next request.
    release(&c, &grants[1]).await.expect_json(200);
    let g4 = grant(&c, json!({"name": "sem", "ttl_ms": 30_000, "limit": 3})).await;
    assert!(fence(&g4) > fence(&grants[2]));
    assert_eq!(
        show(&c, "sem").await.json()["holders"]
            .as_array()
            .unwrap()
            .len(),
        3
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_delay_after_expiry_or_force_release_but_not_after_release() {
    let s = TestServer::start().await;
    let c = s.client;

    // Expiry: the lock stays unavailable for lock_delay_ms.
    let g = grant(
        &c,
        json!({"name": "ld", "ttl_ms": 50, "lock_delay_ms": 2000}),
    )
    .await;
    poll_lock(&c, "ld", "the lease to expire into lock-delay", |r| {
        r.status == 200 && r.json()["holders"].as_array().unwrap().is_empty()
    })
    .await;
    let v = show(&c, "ld").await.expect_json(200);
    let delay = v["lock_delay_remaining_ms"].as_u64().unwrap();
    assert!(delay > 0 && delay <= 2000, "{v}");
    let msg = c
        .post("/v1/acquire", &json!({"name": "ld", "ttl_ms": 1000}))
        .await
        .expect_error(409, "held");
    assert!(msg.contains("lock-delay"), "message says why: {msg}");
    // A waiter is granted when the delay ends.
    let g2 = grant(
        &c,
        json!({"name": "ld", "ttl_ms": 30_000, "wait_ms": 10_000}),
    )
    .await;
    assert!(fence(&g2) > fence(&g));

    // Clean release: no delay, even with a long lock_delay_ms.
    let g = grant(
        &c,
        json!({"name": "ld2", "ttl_ms": 30_000, "lock_delay_ms": 60_000}),
    )
    .await;
    release(&c, &g).await.expect_json(200);
    show(&c, "ld2").await.expect_error(404, "not_found");
    grant(&c, json!({"name": "ld2", "ttl_ms": 30_000})).await;

    // Forced release: the delay applies.
    grant(
        &c,
        json!({"name": "ld3", "ttl_ms": 30_000, "lock_delay_ms": 60_000}),
    )
    .await;
    c.post(
        "/v1/admin/force-release",
        &json!({"name": "ld3", "reason": "test"}),
    )
    .await
    .expect_json(200);
    let msg = c
        .post("/v1/acquire", &json!({"name": "ld3", "ttl_ms": 1000}))
        .await
        .expect_error(409, "held");
    assert!(msg.contains("lock-delay"), "{msg}");
    let v = show(&c, "ld3").await.expect_json(200);
    assert!(
        v["lock_delay_remaining_ms"].as_u64().unwrap() > 50_000,
        "{v}"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_with_the_same_request_id_returns_the_same_grant() {
    let s = TestServer::start().await;
    let c = s.client;
    let body = json!({"name": "idem", "ttl_ms": 30_000, "request_id": "req-1"});
    let g1 = grant(&c, body.clone()).await;
    let g2 = grant(&c, body.clone()).await;
    assert_eq!(g1, g2, "a retry gets the first grant");
    // A different request id is a different request.
    c.post(
        "/v1/acquire",
        &json!({"name": "idem", "ttl_ms": 30_000, "request_id": "req-2"}),
    )
    .await
    .expect_error(409, "held");
    // The same id on another lock is unrelated.
    let other = grant(
        &c,
        json!({"name": "idem-2", "ttl_ms": 30_000, "request_id": "req-1"}),
    )
    .await;
    assert_ne!(other["owner_token"], g1["owner_token"]);
    assert_eq!(
        show(&c, "idem").await.json()["holders"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    // Once released, the id is free again: a new grant.
    release(&c, &g1).await.expect_json(200);
    let g3 = grant(&c, body).await;
    assert!(fence(&g3) > fence(&other));
    assert_ne!(g3["owner_token"], g1["owner_token"]);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_release_needs_a_reason_and_the_next_fence_is_larger() {
    let s = TestServer::start().await;
    let c = s.client;
    let g = grant(&c, json!({"name": "fr", "ttl_ms": 30_000})).await;

    let bad = [
        (json!({"name": "fr"}), 400, "invalid_argument"),
        (json!({"name": "fr", "reason": ""}), 400, "invalid_argument"),
        (
            json!({"name": "fr", "reason": "x", "fence": 0}),
            400,
            "invalid_argument",
        ),
        (
            json!({"name": "fr", "reason": "x".repeat(1025)}),
            400,
            "invalid_argument",
        ),
        (
            json!({"name": "fr", "reason": "x", "fence": fence(&g) + 1}),
            409,
            "not_held",
        ),
        (json!({"name": "free", "reason": "x"}), 409, "not_held"),
    ];
    for (body, status, code) in bad {
        c.post("/v1/admin/force-release", &body)
            .await
            .expect_error(status, code);
    }
    assert_eq!(
        show(&c, "fr").await.expect_json(200)["holders"][0]["fence"],
        g["fence"],
        "refused forced releases left the holder alone"
    );

    let r = c
        .post(
            "/v1/admin/force-release",
            &json!({"name": "fr", "fence": g["fence"], "reason": "stuck worker, ticket 42"}),
        )
        .await
        .expect_json(200);
    assert_eq!(r, json!({"fences": [g["fence"]]}));
    show(&c, "fr").await.expect_error(404, "not_found");
    renew(&c, &g).await.expect_error(409, "not_held");
    release(&c, &g).await.expect_error(409, "not_held");
    let g2 = grant(&c, json!({"name": "fr", "ttl_ms": 30_000})).await;
    assert!(fence(&g2) > fence(&g));
    assert_eq!(
        metric_value(&c, "fencelock_forced_releases_total").await,
        1.0
    );
    s.stop().await;
}

// ---------------------------------------------------------------------------------
// 4. Waiting.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_waiters_are_granted_in_fifo_order_one_per_release() {
    const N: usize = 50;
    let s = TestServer::start().await;
    let c = s.client;
    let first = grant(
        &c,
        json!({"name": "fifo", "ttl_ms": 60_000, "owner": "first"}),
    )
    .await;

    let mut pending = Vec::new();
    for i in 0..N {
        let p = c
            .send_json(
                "/v1/acquire",
                &json!({
                    "name": "fifo",
                    "ttl_ms": 60_000,
                    "wait_ms": 60_000,
                    "owner": format!("w{i:02}"),
                }),
            )
            .await;
        pending.push(p);
        poll_lock(&c, "fifo", "the waiter to queue", waiters_are(i as u64 + 1)).await;
    }
    let grants_before = metric_value(&c, "fencelock_grants_total").await;
    assert_eq!(metric_value(&c, "fencelock_waiters").await, N as f64);

    let mut holder = first;
    for (i, p) in pending.into_iter().enumerate() {
        assert_eq!(
            release(&c, &holder).await.expect_json(200)["released"],
            true
        );
        // The hand-off happens in the release's own transition: no polling needed.
        let v = show(&c, "fifo").await.expect_json(200);
        let holders = v["holders"].as_array().unwrap();
        assert_eq!(holders.len(), 1);
        assert_eq!(holders[0]["owner"], format!("w{i:02}"), "FIFO order");
        assert_eq!(
            v["waiters"],
            (N - i - 1) as u64,
            "exactly one waiter left the queue"
        );
        let g = p.response().await.expect_json(200);
        assert_eq!(g["name"], "fifo");
        assert_eq!(holders[0]["fence"], g["fence"]);
        assert!(
            fence(&g) > fence(&holder),
            "fences increase: {g} after {holder}"
        );
        // Exactly one grant per release: no herd.
        let want = grants_before + (i + 1) as f64;
        let got = poll_until("the grant to be counted", POLL, || async {
            let v = metric_value(&c, "fencelock_grants_total").await;
            (v >= want).then_some(v)
        })
        .await;
        assert_eq!(got, want, "grants after release {i}");
        holder = g;
    }
    release(&c, &holder).await.expect_json(200);
    show(&c, "fifo").await.expect_error(404, "not_found");
    assert_eq!(metric_value(&c, "fencelock_waiters").await, 0.0);
    assert_eq!(
        metric_value(&c, "fencelock_grants_total").await,
        grants_before + N as f64
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_connection_closes_leaves_the_queue() {
    let s = TestServer::start().await;
    let c = s.client;
    let holder = grant(&c, json!({"name": "q", "ttl_ms": 60_000})).await;
    let body =
        |owner: &str| json!({"name": "q", "ttl_ms": 60_000, "wait_ms": 60_000, "owner": owner});

    let gone = c.send_json("/v1/acquire", &body("gone")).await;
    poll_lock(&c, "q", "first waiter", waiters_are(1)).await;
    // The same, for a client that asked for `Connection: close` (Python's urllib).
    let bytes = serde_json::to_vec(&body("gone-too")).unwrap();
    let gone_too = c
        .send(
            "POST",
            "/v1/acquire",
            &[
                ("Connection", "close"),
                ("Content-Type", "application/json"),
            ],
            &bytes,
        )
        .await;
    poll_lock(&c, "q", "second waiter", waiters_are(2)).await;
    let mut stays = c.send_json("/v1/acquire", &body("stays")).await;
    poll_lock(&c, "q", "third waiter", waiters_are(3)).await;

    gone.close();
    poll_lock(&c, "q", "the closed waiter to leave", waiters_are(2)).await;
    gone_too.close();
    poll_lock(&c, "q", "the closed waiter to leave", waiters_are(1)).await;
    assert!(
        stays
            .response_within(Duration::from_millis(1))
            .await
            .is_none(),
        "the remaining waiter still waits"
    );

    release(&c, &holder).await.expect_json(200);
    let g = stays.response().await.expect_json(200);
    let v = show(&c, "q").await.expect_json(200);
    assert_eq!(v["holders"][0]["owner"], "stays");
    assert_eq!(v["holders"][0]["fence"], g["fence"]);
    assert_eq!(v["waiters"], 0);
    // Exactly two grants were made: no grant went to a departed client.
    assert_eq!(metric_value(&c, "fencelock_grants_total").await, 2.0);
    s.stop().await;
}

// ---------------------------------------------------------------------------------
// 5. Bad input.

/// One request that must be refused with `status` and `code`.
struct Case {
    what: String,
    method: &'static str,
    path: String,
    headers: Vec<(&'static str, String)>,
    body: Vec<u8>,
    status: u16,
    code: &'static str,
}

fn case(what: &str, method: &'static str, path: &str, body: impl AsRef<[u8]>) -> Case {
    // Bodies go as JSON (with authentication off nothing else is accepted); a case
    // can say otherwise with `header`.
    let headers = if body.as_ref().is_empty() {
        Vec::new()
    } else {
        vec![("Content-Type", "application/json".to_owned())]
    };
    Case {
        what: what.to_owned(),
        method,
        path: path.to_owned(),
        headers,
        body: body.as_ref().to_vec(),
        status: 400,
        code: "invalid_argument",
    }
}

impl Case {
    fn expect(mut self, status: u16, code: &'static str) -> Case {
        self.status = status;
        self.code = code;
        self
    }
    fn header(mut self, name: &'static str, value: &str) -> Case {
        self.headers.retain(|(n, _)| !n.eq_ignore_ascii_case(name));
        self.headers.push((name, value.to_owned()));
        self
    }
}

fn post(what: &str, path: &str, body: Value) -> Case {
    case(what, "POST", path, serde_json::to_vec(&body).unwrap())
}

fn get(what: &str, path: &str) -> Case {
    case(what, "GET", path, Vec::new())
}

/// Runs every case and reports all mismatches at once. Each answer must be the
/// documented error shape; a 5xx is never acceptable.
async fn check(c: &Client, cases: &[Case]) {
    let mut failures = Vec::new();
    for k in cases {
        let headers: Vec<(&str, &str)> = k.headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
        let r = c.request(k.method, &k.path, &headers, &k.body).await;
        let code = r.error_code();
        let shape_ok = serde_json::from_slice::<Value>(&r.body)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(|m| !m.is_empty()))
            .unwrap_or(false);
        if r.status != k.status || code.as_deref() != Some(k.code) || !shape_ok {
            failures.push(format!(
                "{}: {} {} → {} {:?}, want {} {}",
                k.what,
                k.method,
                k.path,
                r.status,
                r.text(),
                k.status,
                k.code
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} case(s) failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Everything observable about the locks, minus the clocks.
async fn state(c: &Client) -> (Value, Vec<f64>) {
    let mut v = c.get("/v1/locks?limit=1000").await.expect_json(200);
    for l in v["locks"].as_array_mut().unwrap() {
        for h in l["holders"].as_array_mut().unwrap() {
            let h = h.as_object_mut().unwrap();
            h.remove("held_ms");
            h.remove("ttl_remaining_ms");
        }
    }
    let text = metrics_text(c).await;
    let gauges = [
        "fencelock_grants_total",
        "fencelock_releases_total",
        "fencelock_forced_releases_total",
        "fencelock_held_locks",
        "fencelock_waiters",
        "fencelock_sessions",
        "fencelock_locks",
        "fencelock_next_fence",
    ]
    .iter()
    .map(|n| metric(&text, n).unwrap())
    .collect();
    (v, gauges)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_a_stable_4xx_and_changes_nothing() {
    let s = TestServer::start().await;
    let c = s.client;
    let victim = grant(
        &c,
        json!({"name": "victim", "ttl_ms": 60_000, "owner": "v", "request_id": "rid"}),
    )
    .await;
    let token = victim["owner_token"].as_str().unwrap().to_owned();
    let session = c
        .post("/v1/sessions", &json!({"ttl_ms": 60_000}))
        .await
        .expect_json(200)["session"]
        .as_str()
        .unwrap()
        .to_owned();
    let before = state(&c).await;

    let long_name = "n".repeat(257);
    let mut cases = Vec::new();

    // Not JSON, or not the expected shape: 400 invalid_json.
    let raw_acquires: [(&str, &[u8]); 7] = [
        ("malformed", b"{\"name\":"),
        ("not an object", b"[1,2]"),
        ("trailing garbage", b"{\"name\":\"x\",\"ttl_ms\":100} x"),
        ("invalid UTF-8", b"{\"name\":\"\xff\",\"ttl_ms\":100}"),
        ("empty body", b""),
        ("whitespace body", b"  \n "),
        (
            "ttl above u64",
            b"{\"name\":\"x\",\"ttl_ms\":18446744073709551616}",
        ),
    ];
    for (what, body) in raw_acquires {
        cases.push(case(what, "POST", "/v1/acquire", body).expect(400, "invalid_json"));
    }
    let json_mistakes = [
        (
            "string ttl",
            "/v1/acquire",
            json!({"name": "x", "ttl_ms": "100"}),
        ),
        (
            "negative ttl",
            "/v1/acquire",
            json!({"name": "x", "ttl_ms": -1}),
        ),
        (
            "float ttl",
            "/v1/acquire",
            json!({"name": "x", "ttl_ms": 100.5}),
        ),
        (
            "huge ttl",
            "/v1/acquire",
            json!({"name": "x", "ttl_ms": 1e30}),
        ),
        (
            "null name",
            "/v1/acquire",
            json!({"name": null, "ttl_ms": 100}),
        ),
        (
            "number name",
            "/v1/acquire",
            json!({"name": 7, "ttl_ms": 100}),
        ),
        (
            "unknown field",
            "/v1/acquire",
            json!({"name": "x", "ttl_ms": 100, "ttl": 5}),
        ),
        (
            "limit above u32",
            "/v1/acquire",
            json!({"name": "x", "ttl_ms": 100, "limit": 1u64 << 32}),
        ),
        (
            "negative limit",
            "/v1/acquire",
            json!({"name": "x", "ttl_ms": 100, "limit": -1}),
        ),
        (
            "renew unknown field",
            "/v1/renew",
            json!({"name": "victim", "owner_token": token, "x": 1}),
        ),
        (
            "session unknown field",
            "/v1/sessions",
            json!({"ttl_ms": 1000, "id": "x"}),
        ),
    ];
    for (what, path, body) in json_mistakes {
        cases.push(post(what, path, body).expect(400, "invalid_json"));
    }
    // A required field that is missing is a missing argument, like a `ttl_ms`
    // missing without a session: 400 invalid_argument, the message naming it.
    let missing = [
        ("missing name", "/v1/acquire", json!({"ttl_ms": 100})),
        ("missing ttl", "/v1/acquire", json!({"name": "x"})),
        (
            "release without token",
            "/v1/release",
            json!({"name": "victim"}),
        ),
        ("session without ttl", "/v1/sessions", json!({"owner": "x"})),
        (
            "force-release without reason",
            "/v1/admin/force-release",
            json!({"name": "victim"}),
        ),
    ];
    for (what, path, body) in missing {
        cases.push(post(what, path, body).expect(400, "invalid_argument"));
    }

    // Well-formed but out of range: 400 invalid_argument.
    let acquires = [
        ("empty name", json!({"name": "", "ttl_ms": 100})),
        ("257-byte name", json!({"name": long_name, "ttl_ms": 100})),
        ("name with newline", json!({"name": "a\nb", "ttl_ms": 100})),
        ("name with NUL", json!({"name": "a\u{0}b", "ttl_ms": 100})),
        ("name with NEL", json!({"name": "a\u{85}b", "ttl_ms": 100})),
        ("name with DEL", json!({"name": "a\u{7f}b", "ttl_ms": 100})),
        (
            "owner of 1025 bytes",
            json!({"name": "x", "ttl_ms": 100, "owner": "o".repeat(1025)}),
        ),
        (
            "owner with control",
            json!({"name": "x", "ttl_ms": 100, "owner": "a\tb"}),
        ),
        (
            "request_id of 129 bytes",
            json!({"name": "x", "ttl_ms": 100, "request_id": "r".repeat(129)}),
        ),
        (
            "empty request_id",
            json!({"name": "x", "ttl_ms": 100, "request_id": ""}),
        ),
        ("no ttl, no session", json!({"name": "x"})),
        ("ttl 0", json!({"name": "x", "ttl_ms": 0})),
        ("ttl below minimum", json!({"name": "x", "ttl_ms": 9})),
        (
            "ttl above 24h",
            json!({"name": "x", "ttl_ms": 86_400_001u64}),
        ),
        ("ttl u64::MAX", json!({"name": "x", "ttl_ms": u64::MAX})),
        (
            "wait above 1h",
            json!({"name": "x", "ttl_ms": 100, "wait_ms": 3_600_001u64}),
        ),
        (
            "wait u64::MAX",
            json!({"name": "victim", "ttl_ms": 100, "wait_ms": u64::MAX}),
        ),
        ("limit 0", json!({"name": "x", "ttl_ms": 100, "limit": 0})),
        (
            "limit 1025",
            json!({"name": "x", "ttl_ms": 100, "limit": 1025}),
        ),
        (
            "limit 0 on a held lock",
            json!({"name": "victim", "ttl_ms": 100, "limit": 0}),
        ),
        (
            "lock delay above 60s",
            json!({"name": "x", "ttl_ms": 100, "lock_delay_ms": 60_001}),
        ),
        (
            "ttl and session",
            json!({"name": "x", "ttl_ms": 100, "session": session}),
        ),
        (
            "session not hex",
            json!({"name": "x", "session": "not-a-session"}),
        ),
        ("session too short", json!({"name": "x", "session": "abc"})),
    ];
    for (what, body) in acquires {
        cases.push(post(what, "/v1/acquire", body));
    }
    let renews = [
        (
            "token not hex",
            json!({"name": "victim", "owner_token": "z".repeat(32)}),
        ),
        (
            "token of 31 digits",
            json!({"name": "victim", "owner_token": &token[1..]}),
        ),
        (
            "token of 33 digits",
            json!({"name": "victim", "owner_token": format!("{token}0")}),
        ),
        (
            "token with sign",
            json!({"name": "victim", "owner_token": format!("+{}", &token[1..])}),
        ),
        ("empty token", json!({"name": "victim", "owner_token": ""})),
        (
            "ttl 0",
            json!({"name": "victim", "owner_token": token, "ttl_ms": 0}),
        ),
        (
            "ttl above 24h",
            json!({"name": "victim", "owner_token": token, "ttl_ms": 86_400_001u64}),
        ),
        ("empty name", json!({"name": "", "owner_token": token})),
    ];
    for (what, body) in renews {
        cases.push(post(&format!("renew: {what}"), "/v1/renew", body));
    }
    let others = [
        (
            "release token not hex",
            "/v1/release",
            json!({"name": "victim", "owner_token": "g".repeat(32)}),
        ),
        (
            "release token non-ASCII",
            "/v1/release",
            json!({"name": "victim", "owner_token": "é".repeat(16)}),
        ),
        (
            "release name with control",
            "/v1/release",
            json!({"name": "victim\n", "owner_token": token}),
        ),
        ("session ttl 0", "/v1/sessions", json!({"ttl_ms": 0})),
        (
            "session ttl above 24h",
            "/v1/sessions",
            json!({"ttl_ms": 86_400_001u64}),
        ),
        (
            "session owner too long",
            "/v1/sessions",
            json!({"ttl_ms": 1000, "owner": "o".repeat(1025)}),
        ),
        (
            "force-release empty reason",
            "/v1/admin/force-release",
            json!({"name": "victim", "reason": ""}),
        ),
        (
            "force-release empty name",
            "/v1/admin/force-release",
            json!({"name": "", "reason": "r"}),
        ),
    ];
    for (what, path, body) in others {
        cases.push(post(what, path, body));
    }
    let show_path = format!("/v1/locks/{long_name}");
    let list_path = format!("/v1/locks?prefix={long_name}");
    let gets = [
        ("show name with newline", "/v1/locks/a%0Ab"),
        ("show name with NUL", "/v1/locks/a%00b"),
        ("show name with NEL", "/v1/locks/a%C2%85b"),
        ("show 257-byte name", &show_path),
        ("show invalid UTF-8", "/v1/locks/%FF%FE"),
        ("list limit 0", "/v1/locks?limit=0"),
        ("list limit 1001", "/v1/locks?limit=1001"),
        ("list limit not a number", "/v1/locks?limit=ten"),
        ("list limit negative", "/v1/locks?limit=-1"),
        ("list limit huge", "/v1/locks?limit=99999999999999999999999"),
        ("list unknown parameter", "/v1/locks?prefix=a&color=red"),
        ("list repeated parameter", "/v1/locks?limit=1&limit=2"),
        ("list empty after", "/v1/locks?after="),
        ("list after with control", "/v1/locks?after=%0A"),
        ("list prefix too long", &list_path),
    ];
    for (what, path) in gets {
        cases.push(get(what, path));
    }
    cases.push(case(
        "keepalive bad id",
        "POST",
        "/v1/sessions/xyz/keepalive",
        b"",
    ));
    cases.push(case("close bad id", "DELETE", "/v1/sessions/xyz", b""));
    cases.push(case(
        "close id with control",
        "DELETE",
        "/v1/sessions/%0A",
        b"",
    ));

    // Size: 413 payload_too_large.
    for (what, path, body, chunk) in [
        (
            "body of 64 KiB + 1",
            "/v1/acquire",
            oversized(64 * 1024 + 1),
            false,
        ),
        ("body of 1 MiB", "/v1/renew", oversized(1 << 20), false),
        (
            "chunked body of 100 KiB",
            "/v1/acquire",
            oversized(100 * 1024),
            true,
        ),
    ] {
        let mut k = case(what, "POST", path, body).expect(413, "payload_too_large");
        if chunk {
            k.body = chunked(&k.body);
            k = k.header("Transfer-Encoding", "chunked");
        }
        cases.push(k);
    }

    // Routes and methods: 404 not_found, 405 method_not_allowed.
    let session_path = format!("/v1/sessions/{session}");
    let keepalive_path = format!("/v1/sessions/{session}/keepalive");
    let routes = [
        ("unknown route", "GET", "/v2/acquire", 404, "not_found"),
        (
            "unknown route under v1",
            "GET",
            "/v1/lock/victim",
            404,
            "not_found",
        ),
        ("extra segment", "POST", "/v1/acquire/now", 404, "not_found"),
        ("empty lock name", "GET", "/v1/locks/", 404, "not_found"),
        (
            "GET acquire",
            "GET",
            "/v1/acquire",
            405,
            "method_not_allowed",
        ),
        ("PUT renew", "PUT", "/v1/renew", 405, "method_not_allowed"),
        (
            "DELETE lock",
            "DELETE",
            "/v1/locks/victim",
            405,
            "method_not_allowed",
        ),
        ("POST list", "POST", "/v1/locks", 405, "method_not_allowed"),
        (
            "GET session",
            "GET",
            &session_path,
            405,
            "method_not_allowed",
        ),
        (
            "GET keepalive",
            "GET",
            &keepalive_path,
            405,
            "method_not_allowed",
        ),
        (
            "POST healthz",
            "POST",
            "/healthz",
            405,
            "method_not_allowed",
        ),
        (
            "PATCH force-release",
            "PATCH",
            "/v1/admin/force-release",
            405,
            "method_not_allowed",
        ),
    ];
    for (what, method, path, status, code) in routes {
        cases.push(case(what, method, path, b"").expect(status, code));
    }

    // Contention and strangers on the victim: not bad input, but they change nothing
    // either.
    let strangers = [
        (
            "victim held",
            "/v1/acquire",
            json!({"name": "victim", "ttl_ms": 100}),
            409,
            "held",
        ),
        (
            "victim with another limit",
            "/v1/acquire",
            json!({"name": "victim", "ttl_ms": 100, "limit": 2}),
            409,
            "limit_mismatch",
        ),
        (
            "release with a stranger's token",
            "/v1/release",
            json!({"name": "victim", "owner_token": "0".repeat(32)}),
            409,
            "not_held",
        ),
        (
            "victim's token on another lock",
            "/v1/release",
            json!({"name": "victim2", "owner_token": token}),
            409,
            "not_held",
        ),
        (
            "unknown session",
            "/v1/acquire",
            json!({"name": "x", "session": "1".repeat(32)}),
            404,
            "session_not_found",
        ),
    ];
    for (what, path, body, status, code) in strangers {
        cases.push(post(what, path, body).expect(status, code));
    }

    // With authentication off, a body must be sent as JSON: the content types a web
    // page may send to another site without asking are refused (issue 19 item 6).
    for ct in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "application/octet-stream",
    ] {
        cases.push(
            case(
                &format!("form body as {ct}"),
                "POST",
                "/v1/acquire",
                b"name=x&ttl_ms=100",
            )
            .header("Content-Type", ct)
            .expect(403, "permission_denied"),
        );
    }
    check(&c, &cases).await;

    // The limit is on the body, not its meaning: exactly 64 KiB is read and judged.
    let exact = padded(json!({"name": "victim", "ttl_ms": 100}), 64 * 1024);
    c.post_raw("/v1/acquire", &exact, Some("application/json"))
        .await
        .expect_error(409, "held");

    assert_eq!(state(&c).await, before, "bad input changed the state");
    // The victim is untouched: same holder, and it can still renew and release.
    assert_eq!(
        renew(&c, &victim).await.expect_json(200)["fence"],
        victim["fence"]
    );
    assert_eq!(
        release(&c, &victim).await.expect_json(200)["released"],
        true
    );
    assert_eq!(c.get("/healthz").await.status, 200);
    s.stop().await;
}

/// Regression: every error while reading the body used to be reported as
/// `413 payload_too_large` ("larger than 65536 bytes"), also for a 30-byte body cut
/// short or with broken chunked framing. Those are 400s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_cannot_be_read_is_400_not_413() {
    let s = TestServer::start().await;
    let c = s.client;
    check(
        &c,
        &[
            case(
                "bad chunk size",
                "POST",
                "/v1/acquire",
                &b"zz\r\n{}\r\n0\r\n\r\n"[..],
            )
            .header("Transfer-Encoding", "chunked")
            .expect(400, "invalid_json"),
            case(
                "chunk longer than declared",
                "POST",
                "/v1/acquire",
                &b"2\r\n{}xx\r\n0\r\n\r\n"[..],
            )
            .header("Transfer-Encoding", "chunked")
            .expect(400, "invalid_json"),
        ],
    )
    .await;
    // The client half-closes after 8 of 1000 announced bytes; it can still read.
    let answer = c
        .raw(
            b"POST /v1/acquire HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"name\":",
            Duration::from_secs(10),
        )
        .await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("HTTP/1.1 400 ") && answer.contains("\"invalid_json\""),
        "truncated body: {answer:?}"
    );
    show(&c, "x").await.expect_error(404, "not_found");
    s.stop().await;
}

/// A syntactically valid JSON acquire padded with spaces to `len` bytes.
fn padded(v: Value, len: usize) -> Vec<u8> {
    let mut b = serde_json::to_vec(&v).unwrap();
    assert!(b.len() <= len);
    b.resize(len, b' ');
    b
}

fn oversized(len: usize) -> Vec<u8> {
    padded(json!({"name": "victim", "ttl_ms": 100}), len)
}

fn chunked(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    for part in body.chunks(8 * 1024) {
        out.extend_from_slice(format!("{:x}\r\n", part.len()).as_bytes());
        out.extend_from_slice(part);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_are_inclusive() {
    let s = TestServer::start().await;
    let c = s.client;
    let name256 = "é".repeat(128);
    let ok = [
        json!({"name": "n".repeat(256), "ttl_ms": 1000}),
        json!({"name": "min-ttl", "ttl_ms": 10}),
        json!({"name": name256, "ttl_ms": 86_400_000u64}),
        json!({"name": "owner", "ttl_ms": 1000, "owner": "o".repeat(1024)}),
        json!({"name": "rid", "ttl_ms": 1000, "request_id": "r".repeat(128)}),
        json!({"name": "wait", "ttl_ms": 1000, "wait_ms": 3_600_000u64}),
        json!({"name": "limit", "ttl_ms": 1000, "limit": 1024}),
        json!({"name": "delay", "ttl_ms": 1000, "lock_delay_ms": 60_000}),
    ];
    for body in ok {
        grant(&c, body).await;
    }
    let v = show(&c, &name256).await.expect_json(200);
    assert_eq!(v["name"], name256.as_str());
    assert!(v["holders"][0]["ttl_remaining_ms"].as_u64().unwrap() > 86_000_000);
    show(&c, &"n".repeat(256)).await.expect_json(200);
    assert_eq!(
        show(&c, "owner").await.json()["holders"][0]["owner"],
        "o".repeat(1024)
    );
    assert_eq!(show(&c, "limit").await.json()["limit"], 1024);
    let sess = c
        .post(
            "/v1/sessions",
            &json!({"ttl_ms": 10, "owner": "o".repeat(1024)}),
        )
        .await
        .expect_json(200);
    assert_eq!(sess["ttl_ms"], 10);
    // A body of exactly 64 KiB is accepted.
    let r = c
        .post_raw(
            "/v1/acquire",
            &padded(json!({"name": "big-body", "ttl_ms": 1000}), 64 * 1024),
            Some("application/json"),
        )
        .await;
    assert_eq!(r.expect_json(200)["name"], "big-body");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_the_socket_does_not_hurt_the_server() {
    let s = TestServer::start().await;
    let c = s.client;
    let held = grant(&c, json!({"name": "survivor", "ttl_ms": 60_000})).await;
    let mut tls_hello = vec![
        0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03,
    ];
    tls_hello.extend([0xAB; 200]);
    let long_header = format!(
        "GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Long: {}\r\n\r\n",
        "a".repeat(512 * 1024)
    );
    let garbage: Vec<(&str, Vec<u8>)> = vec![
        ("binary noise", (0..=255u8).cycle().take(10_000).collect()),
        ("NUL bytes", vec![0; 4096]),
        ("only CRLFs", b"\r\n\r\n\r\n\r\n".to_vec()),
        ("SSH banner", b"SSH-2.0-OpenSSH_9.6\r\n".to_vec()),
        ("TLS client hello", tls_hello),
        ("HTTP/2 preface then noise", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x12\x04garbage".to_vec()),
        ("bad version", b"GET /healthz HTTP/9.9\r\n\r\n".to_vec()),
        ("no version", b"GET /healthz\r\n\r\n".to_vec()),
        ("invalid UTF-8 path", b"GET /v1/locks/\xff\xfe HTTP/1.1\r\nHost: localhost\r\n\r\n".to_vec()),
        ("space in path", b"GET /v1/locks/a b HTTP/1.1\r\nHost: localhost\r\n\r\n".to_vec()),
        ("bad header", b"POST /v1/acquire HTTP/1.1\r\nHost x\r\n\r\n".to_vec()),
        ("two content lengths", b"POST /v1/acquire HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2\r\nContent-Length: 5\r\n\r\n{}".to_vec()),
        ("negative content length", b"POST /v1/acquire HTTP/1.1\r\nHost: localhost\r\nContent-Length: -5\r\n\r\n".to_vec()),
        ("bad chunk size", b"POST /v1/acquire HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n".to_vec()),
        ("truncated body", b"POST /v1/acquire HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1000\r\n\r\n{\"name\":".to_vec()),
        ("truncated head", b"POST /v1/acquire HTTP/1.1\r\nHost: localhost\r\nContent-Le".to_vec()),
        ("huge header", long_header.into_bytes()),
        ("pipelined junk after a request", b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n\x00\x01\x02garbage\r\n\r\n".to_vec()),
    ];
    for (what, bytes) in &garbage {
        let answer = c.raw(bytes, Duration::from_secs(5)).await;
        if answer.starts_with(b"HTTP/1.1 5") {
            panic!("{what}: answered {:?}", String::from_utf8_lossy(&answer));
        }
        let r = c.get("/healthz").await;
        assert_eq!(r.status, 200, "after {what}");
    }
    // Connections that go away at every stage.
    for cut in [1, 10, 30, 60] {
        let req = b"POST /v1/acquire HTTP/1.1\r\nHost: localhost\r\nContent-Length: 30\r\n\r\n{\"name\":\"survivor\",\"ttl_ms\":1}";
        let mut stream = tokio::net::TcpStream::connect(s.addr()).await.unwrap();
        use tokio::io::AsyncWriteExt;
        stream.write_all(&req[..cut.min(req.len())]).await.unwrap();
        drop(stream);
    }
    let v = show(&c, "survivor").await.expect_json(200);
    assert_eq!(v["holders"][0]["fence"], held["fence"]);
    assert_eq!(
        s.server().handle().state(),
        fencelock_server::RunState::Running
    );
    assert_eq!(c.get("/readyz").await.status, 200);
    assert!(metrics_text(&c).await.contains("fencelock_held_locks 1\n"));
    s.stop().await;
}

// ---------------------------------------------------------------------------------
// 6. Health and metrics.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_readiness_and_metrics_reflect_state() {
    let s = TestServer::start().await;
    let c = s.client;
    let r = c.get("/healthz").await;
    assert_eq!((r.status, r.text().trim()), (200, "ok"));
    let r = c.get("/readyz").await;
    assert_eq!((r.status, r.text().trim()), (200, "ready"));

    let r = c.get("/metrics").await;
    assert_eq!(r.status, 200);
    assert!(
        r.header("content-type")
            .unwrap_or_default()
            .starts_with("text/plain"),
        "{:?}",
        r.headers
    );
    let text = r.text();
    for name in fencelock_server::metrics::METRIC_NAMES {
        assert!(
            text.contains(&format!("# TYPE {name} ")),
            "{name} missing:\n{text}"
        );
    }
    for series in [
        "fencelock_acquire_wait_seconds_bucket{le=\"+Inf\"}",
        "fencelock_log_sync_seconds_count",
        "fencelock_hold_seconds_sum",
    ] {
        assert!(text.contains(series), "{series} missing");
    }
    assert_eq!(metric(&text, "fencelock_held_locks"), Some(0.0));
    assert_eq!(metric(&text, "fencelock_grants_total"), Some(0.0));

    let g = grant(&c, json!({"name": "m", "ttl_ms": 60_000})).await;
    c.post("/v1/acquire", &json!({"name": "m", "ttl_ms": 60_000}))
        .await
        .expect_error(409, "held");
    c.post(
        "/v1/acquire",
        &json!({"name": "m", "ttl_ms": 60_000, "wait_ms": 20}),
    )
    .await
    .expect_error(409, "timeout");
    // Metrics are counted when replies go out; a read orders after them.
    show(&c, "m").await.expect_json(200);
    let text = metrics_text(&c).await;
    for (name, want) in [
        ("fencelock_held_locks", 1.0),
        ("fencelock_locks", 1.0),
        ("fencelock_grants_total", 1.0),
        ("fencelock_acquire_conflicts_total", 1.0),
        ("fencelock_wait_timeouts_total", 1.0),
        ("fencelock_waiters", 0.0),
        ("fencelock_next_fence", fence(&g) as f64 + 1.0),
        ("fencelock_acquire_wait_seconds_count", 1.0),
    ] {
        assert_eq!(metric(&text, name), Some(want), "{name}");
    }
    assert!(metric(&text, "fencelock_log_sync_seconds_count").unwrap() >= 1.0);
    assert!(text.contains("fencelock_acquire_wait_seconds_bucket{le=\"0.001\"} 1\n"));

    release(&c, &g).await.expect_json(200);
    show(&c, "m").await.expect_error(404, "not_found");
    let text = metrics_text(&c).await;
    assert_eq!(metric(&text, "fencelock_held_locks"), Some(0.0));
    assert_eq!(metric(&text, "fencelock_releases_total"), Some(1.0));
    assert_eq!(metric(&text, "fencelock_hold_seconds_count"), Some(1.0));
    s.stop().await;
}

// ---------------------------------------------------------------------------------
// Server bounds.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_bounds_answer_429_resource_exhausted_and_change_nothing() {
    let s = TestServer::start_with(|e| {
        e.core.max_locks = 2;
        e.core.max_waiters_per_lock = 1;
        e.core.max_sessions = 1;
        e.core.max_locks_per_session = 1;
    })
    .await;
    let c = &s.client;
    grant(c, json!({"name": "a", "ttl_ms": 60_000})).await;
    let b = grant(c, json!({"name": "b", "ttl_ms": 60_000})).await;
    let msg = c
        .post("/v1/acquire", &json!({"name": "c", "ttl_ms": 60_000}))
        .await
        .expect_error(429, "resource_exhausted");
    assert!(msg.contains("maximum"), "{msg}");

    // One waiter per lock: the second is refused at once instead of queueing.
    let first = c
        .send_json(
            "/v1/acquire",
            &json!({"name": "a", "ttl_ms": 1000, "wait_ms": 60_000}),
        )
        .await;
    poll_lock(c, "a", "one waiter queued", |r| r.json()["waiters"] == 1).await;
    c.post(
        "/v1/acquire",
        &json!({"name": "a", "ttl_ms": 1000, "wait_ms": 60_000}),
    )
    .await
    .expect_error(429, "resource_exhausted");
    first.close();

    // One session, holding at most one lock.
    let opened = c
        .post("/v1/sessions", &json!({"ttl_ms": 60_000}))
        .await
        .expect_json(200);
    let session = opened["session"].as_str().unwrap().to_owned();
    c.post("/v1/sessions", &json!({"ttl_ms": 60_000}))
        .await
        .expect_error(429, "resource_exhausted");
    release(c, &b).await.expect_json(200);
    grant(c, json!({"name": "b", "session": session})).await;
    let msg = c
        .post(
            "/v1/acquire",
            &json!({"name": "a", "session": session, "wait_ms": 1000}),
        )
        .await
        .expect_error(429, "resource_exhausted");
    assert!(msg.contains("session"), "{msg}");
    // Nothing changed: b is the session's, a has its one holder and no waiter.
    let show_b = show(c, "b").await.expect_json(200);
    assert_eq!(show_b["holders"][0]["session"], opened["handle"]);
    poll_lock(c, "a", "the closed waiter left", |r| {
        r.json()["waiters"] == 0
    })
    .await;
    s.stop().await;
}

/// Reads until the server closes the connection; returns what it sent, or `None` if
/// it was still open after `within`.
async fn read_until_closed(
    stream: &mut tokio::net::TcpStream,
    within: Duration,
) -> Option<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut seen = Vec::new();
    let read_all = async {
        let mut buf = [0u8; 1024];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => seen.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(within, read_all)
        .await
        .ok()
        .map(|()| seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_and_idle_connections_are_closed() {
    use tokio::io::AsyncWriteExt;
    let s =
        TestServer::start_configured(|c| c.header_read_timeout = Duration::from_millis(300)).await;

    // Headers that never finish (slowloris).
    let mut stalled = tokio::net::TcpStream::connect(s.addr()).await.unwrap();
    stalled
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n")
        .await
        .unwrap();
    let sent = read_until_closed(&mut stalled, Duration::from_secs(10)).await;
    assert!(
        sent.is_some(),
        "a connection with unfinished headers was kept open"
    );

    // A keep-alive connection that goes quiet after one request.
    let mut idle = tokio::net::TcpStream::connect(s.addr()).await.unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .await
        .unwrap();
    let sent = read_until_closed(&mut idle, Duration::from_secs(10)).await;
    let sent = String::from_utf8_lossy(&sent.expect("an idle keep-alive connection was kept open"))
        .into_owned();
    assert!(sent.starts_with("HTTP/1.1 200"), "{sent}");

    // The server still serves.
    assert_eq!(s.client.get("/healthz").await.status, 200);
    s.stop().await;
}

/// Issue 23: a missing `name` was `invalid_json` while a missing `ttl_ms` was
/// `invalid_argument`. Every missing required field is `invalid_argument` now, and
/// the message names the field, as for any other bad value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_field_is_invalid_argument_naming_the_field() {
    let s = TestServer::start().await;
    let c = s.client;
    let cases = [
        ("/v1/acquire", json!({"ttl_ms": 1000}), "name"),
        ("/v1/acquire", json!({"name": "m"}), "ttl_ms"),
        ("/v1/renew", json!({"name": "m"}), "owner_token"),
        ("/v1/sessions", json!({}), "ttl_ms"),
        ("/v1/admin/force-release", json!({"name": "m"}), "reason"),
    ];
    for (path, body, field) in cases {
        let message = c
            .post(path, &body)
            .await
            .expect_error(400, "invalid_argument");
        assert!(message.starts_with(field), "{path} {body}: {message}");
    }
    // A field of the wrong type stays a malformed body.
    c.post("/v1/acquire", &json!({"name": 1, "ttl_ms": 1000}))
        .await
        .expect_error(400, "invalid_json");
    s.stop().await;
}
