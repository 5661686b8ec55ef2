//! The HTTP contract for the lock kinds (docs/design.md): shared/exclusive modes,
//! downgrade, multi-locks and elections, and every bad input refused with 400
//! `invalid_argument` and the state unchanged.
//!
//! Run: `cargo test -p fencelock-server --test it kinds_http::`

use crate::support;

use std::time::Duration;

use serde_json::{json, Value};
use support::{metric, pct, poll_until, Client, TestServer};

const POLL: Duration = Duration::from_secs(10);

async fn grant(c: &Client, body: Value) -> Value {
    c.post("/v1/acquire", &body).await.expect_json(200)
}

async fn show(c: &Client, name: &str) -> Value {
    c.get(&format!("/v1/locks/{}", pct(name))).await.json()
}

async fn waiters(c: &Client, name: &str, n: u64) {
    poll_until(&format!("{n} waiters on {name}"), POLL, || async {
        (show(c, name).await["waiters"] == n).then_some(())
    })
    .await
}

/// Everything observable about the locks (not their clocks), for "unchanged".
async fn state(c: &Client) -> Vec<Value> {
    let v = c.get("/v1/locks").await.expect_json(200);
    v["locks"]
        .as_array()
        .expect("locks")
        .iter()
        .map(|l| {
            let holders: Vec<Value> = l["holders"]
                .as_array()
                .expect("holders")
                .iter()
                .map(|h| json!([h["fence"], h["owner"], h["mode"], h["value"]]))
                .collect();
            json!([l["name"], l["limit"], l["waiters"], holders])
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_share_and_a_queued_writer_goes_before_later_readers() {
    let s = TestServer::start().await;
    let c = s.client;
    let r1 = grant(
        &c,
        json!({"name": "rw", "ttl_ms": 30_000, "mode": "shared"}),
    )
    .await;
    let r2 = grant(
        &c,
        json!({"name": "rw", "ttl_ms": 30_000, "mode": "shared"}),
    )
    .await;
    assert_eq!(r1["mode"], "shared");
    let v = show(&c, "rw").await;
    assert_eq!(v["holders"].as_array().map(Vec::len), Some(2));
    assert_eq!(v["holders"][0]["mode"], "shared");

    // A writer waits; a reader after it waits too (a shared acquire that does not
    // wait is told `held`).
    let writer = c
        .send_json(
            "/v1/acquire",
            &json!({"name": "rw", "ttl_ms": 30_000, "wait_ms": 20_000, "mode": "exclusive"}),
        )
        .await;
    waiters(&c, "rw", 1).await;
    c.post(
        "/v1/acquire",
        &json!({"name": "rw", "ttl_ms": 30_000, "mode": "shared"}),
    )
    .await
    .expect_error(409, "held");
    let reader = c
        .send_json(
            "/v1/acquire",
            &json!({"name": "rw", "ttl_ms": 30_000, "wait_ms": 20_000, "mode": "shared"}),
        )
        .await;
    waiters(&c, "rw", 2).await;

    for g in [&r1, &r2] {
        c.post(
            "/v1/release",
            &json!({"name": "rw", "owner_token": g["owner_token"]}),
        )
        .await
        .expect_json(200);
    }
    let w = writer.response().await.expect_json(200);
    assert_eq!(w["mode"], "exclusive");
    assert!(w["fence"].as_u64() > r2["fence"].as_u64());

    // Downgrade keeps the fence and lets the reader behind it in.
    let d = c
        .post(
            "/v1/downgrade",
            &json!({"name": "rw", "token": w["owner_token"]}),
        )
        .await
        .expect_json(200);
    assert_eq!(
        (d["mode"].clone(), d["fence"].clone()),
        (json!("shared"), w["fence"].clone())
    );
    let r3 = reader.response().await.expect_json(200);
    assert!(r3["fence"].as_u64() > w["fence"].as_u64());

    let text = c.get("/metrics").await.text();
    let shared = metric(&text, "fencelock_grants_by_mode_total{mode=\"shared\"}");
    assert_eq!(shared, Some(3.0), "{text}");
    let held = metric(&text, "fencelock_held_locks_by_mode{mode=\"shared\"}");
    assert_eq!(held, Some(2.0), "{text}");
    assert_eq!(metric(&text, "fencelock_downgrades_total"), Some(1.0));
    let waiting = metric(&text, "fencelock_waiters_by_mode{mode=\"shared\"}");
    assert_eq!(waiting, Some(0.0), "{text}");
    let audit = c.get("/v1/audit?lock=rw").await.expect_json(200);
    let entries = audit["entries"].as_array().expect("entries");
    assert!(entries.iter().any(|e| e["kind"] == "downgraded"), "{audit}");
    assert!(
        entries
            .iter()
            .any(|e| e["kind"] == "granted" && e["detail"] == "shared"),
        "{audit}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_locks_are_all_or_nothing_and_never_deadlock() {
    let s = TestServer::start().await;
    let c = s.client;
    let a = grant(&c, json!({"name": "m:a", "ttl_ms": 30_000})).await;

    // Held at once: the whole request is refused, and `m:b` stays free.
    c.post(
        "/v1/acquire",
        &json!({"names": ["m:b", "m:a"], "ttl_ms": 30_000}),
    )
    .await
    .expect_error(409, "held");
    assert_eq!(c.get("/v1/locks/m:b").await.status, 404);

    // Two requests for the same pair in opposite orders both wait ...
    let ab = c
        .send_json(
            "/v1/acquire",
            &json!({"names": ["m:a", "m:b"], "ttl_ms": 30_000, "wait_ms": 20_000}),
        )
        .await;
    waiters(&c, "m:a", 1).await;
    let ba = c
        .send_json(
            "/v1/acquire",
            &json!({"names": ["m:b", "m:a"], "ttl_ms": 30_000, "wait_ms": 20_000}),
        )
        .await;
    waiters(&c, "m:a", 2).await;
    // ... and `m:b`, free but queued for, is not taken by a newcomer.
    c.post("/v1/acquire", &json!({"name": "m:b", "ttl_ms": 30_000}))
        .await
        .expect_error(409, "held");

    c.post(
        "/v1/release",
        &json!({"name": "m:a", "owner_token": a["owner_token"]}),
    )
    .await
    .expect_json(200);
    let first = ab.response().await.expect_json(200);
    let grants = first["grants"].as_array().expect("grants").clone();
    assert_eq!(grants.len(), 2);
    assert_eq!(
        (grants[0]["name"].clone(), grants[1]["name"].clone()),
        (json!("m:a"), json!("m:b"))
    );
    assert!(grants[1]["fence"].as_u64() > grants[0]["fence"].as_u64());

    // Released together; the second request gets both, in its own order.
    let refs: Vec<Value> = grants
        .iter()
        .map(|g| json!({"name": g["name"], "owner_token": g["owner_token"]}))
        .collect();
    let r = c
        .post("/v1/release", &json!({ "grants": refs }))
        .await
        .expect_json(200);
    assert_eq!(r["released"], json!([true, true]));
    let second = ba.response().await.expect_json(200);
    assert_eq!(second["grants"][0]["name"], "m:b");
    assert_eq!(second["grants"][1]["name"], "m:a");
    // One by one works too.
    for g in second["grants"].as_array().expect("grants") {
        c.post(
            "/v1/release",
            &json!({"name": g["name"], "owner_token": g["owner_token"]}),
        )
        .await
        .expect_json(200);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_election_campaigns_proclaims_observes_and_resigns() {
    let s = TestServer::start().await;
    let c = s.client;
    let empty = c.get("/v1/elections/jobs").await.expect_json(200);
    assert_eq!(empty, json!({"leader": null}));
    let lead = c
        .post(
            "/v1/elections/jobs/campaign",
            &json!({"value": "host-1:80", "ttl_ms": 30_000, "owner": "host-1"}),
        )
        .await
        .expect_json(200);
    let term = lead["fence"].as_u64().expect("term");
    let v = c.get("/v1/elections/jobs").await.expect_json(200);
    assert_eq!(v["leader"]["value"], "host-1:80");
    assert_eq!(v["leader"]["term"], term);
    assert_eq!(v["leader"]["owner"], "host-1");

    let follower = c
        .send_json(
            "/v1/elections/jobs/campaign",
            &json!({"value": "host-2:80", "ttl_ms": 30_000, "wait_ms": 20_000}),
        )
        .await;
    waiters(&c, "jobs", 1).await;
    c.post(
        "/v1/elections/jobs/proclaim",
        &json!({"token": lead["owner_token"], "value": "host-1:81"}),
    )
    .await
    .expect_json(200);
    let v = c.get("/v1/elections/jobs").await.expect_json(200);
    assert_eq!(v["leader"]["value"], "host-1:81");

    let r = c
        .post(
            "/v1/elections/jobs/resign",
            &json!({"token": lead["owner_token"]}),
        )
        .await
        .expect_json(200);
    assert_eq!(r["released"], true);
    let next = follower.response().await.expect_json(200);
    assert!(next["fence"].as_u64().expect("term") > term);
    let v = c.get("/v1/elections/jobs").await.expect_json(200);
    assert_eq!(v["leader"]["value"], "host-2:80");
    // The old leader can no longer proclaim.
    c.post(
        "/v1/elections/jobs/proclaim",
        &json!({"token": lead["owner_token"], "value": "stale"}),
    )
    .await
    .expect_error(409, "not_held");
    let text = c.get("/metrics").await.text();
    assert_eq!(metric(&text, "fencelock_proclaims_total"), Some(1.0));
    let audit = c.get("/v1/audit?lock=jobs").await.expect_json(200);
    let proclaimed = audit["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .any(|e| e["kind"] == "proclaimed" && e["detail"] == "host-1:81");
    assert!(proclaimed, "{audit}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_kind_inputs_are_refused_and_change_nothing() {
    let s = TestServer::start().await;
    let c = s.client;
    let held = grant(&c, json!({"name": "k:held", "ttl_ms": 30_000})).await;
    let before = state(&c).await;
    let many: Vec<String> = (0..65).map(|i| format!("k:{i}")).collect();
    let cases = [
        (
            "unknown mode",
            "/v1/acquire",
            json!({"name": "k:x", "ttl_ms": 1000, "mode": "read"}),
        ),
        (
            "empty set",
            "/v1/acquire",
            json!({"names": [], "ttl_ms": 1000}),
        ),
        (
            "duplicate names",
            "/v1/acquire",
            json!({"names": ["k:x", "k:x"], "ttl_ms": 1000}),
        ),
        (
            "set too large",
            "/v1/acquire",
            json!({"names": many, "ttl_ms": 1000}),
        ),
        (
            "name and names",
            "/v1/acquire",
            json!({"name": "k:x", "names": ["k:y"], "ttl_ms": 1000}),
        ),
        (
            "bad name in set",
            "/v1/acquire",
            json!({"names": ["k:x", ""], "ttl_ms": 1000}),
        ),
        (
            "value too long",
            "/v1/elections/k:e/campaign",
            json!({"value": "v".repeat(4097), "ttl_ms": 1000}),
        ),
        (
            "control character in value",
            "/v1/elections/k:e/campaign",
            json!({"value": "a\nb", "ttl_ms": 1000}),
        ),
        (
            "proclaim value too long",
            "/v1/elections/k:held/proclaim",
            json!({"token": held["owner_token"], "value": "v".repeat(4097)}),
        ),
        (
            "downgrade bad token",
            "/v1/downgrade",
            json!({"name": "k:held", "token": "xyz"}),
        ),
        ("release nothing", "/v1/release", json!({"grants": []})),
        (
            "release grants and name",
            "/v1/release",
            json!({"name": "k:held", "owner_token": held["owner_token"], "grants": []}),
        ),
    ];
    for (what, path, body) in cases {
        let r = c.post(path, &body).await;
        let message = r.expect_error(400, "invalid_argument");
        assert!(!message.is_empty(), "{what}");
    }
    // A downgrade or proclaim by a stranger is not_held, a leader that downgrades
    // is refused; none of it changes anything.
    let stranger = "0".repeat(32);
    c.post(
        "/v1/downgrade",
        &json!({"name": "k:held", "token": stranger}),
    )
    .await
    .expect_error(409, "not_held");
    assert_eq!(state(&c).await, before);
}
