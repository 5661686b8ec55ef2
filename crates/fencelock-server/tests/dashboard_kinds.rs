//! The dashboard shows the lock kinds (issue 22): each holder's mode in the list and
//! on the lock's page, each waiter's mode and the waiters per mode, and an
//! election's leader, term and value (escaped like every user string).
//!
//! Run: `cargo test -p fencelock-server --test it dashboard_kinds::`

use crate::support;

use serde_json::json;
use support::{pct, TestServer, IO_TIMEOUT};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn modes_waiters_per_mode_and_election_values_are_shown() {
    let s = TestServer::start().await;
    let c = &s.client;
    for reader in ["reader-1", "reader-2"] {
        c.post(
            "/v1/acquire",
            &json!({"name": "cfg", "ttl_ms": 600_000, "owner": reader, "mode": "shared"}),
        )
        .await
        .expect_json(200);
    }
    // Behind the readers: a writer, then a reader that must wait for the writer.
    let _writer = c
        .send_json(
            "/v1/acquire",
            &json!({"name": "cfg", "ttl_ms": 600_000, "wait_ms": 60_000,
                    "owner": "writer", "mode": "exclusive"}),
        )
        .await;
    support::poll_until("the writer is queued", IO_TIMEOUT, || async {
        let v = c.get("/v1/locks/cfg").await.json();
        (v["waiters"] == 1).then_some(())
    })
    .await;
    let _late_reader = c
        .send_json(
            "/v1/acquire",
            &json!({"name": "cfg", "ttl_ms": 600_000, "wait_ms": 60_000,
                    "owner": "late-reader", "mode": "shared"}),
        )
        .await;
    support::poll_until("the late reader is queued", IO_TIMEOUT, || async {
        let v = c.get("/v1/locks/cfg").await.json();
        (v["waiters"] == 2).then_some(())
    })
    .await;

    let page = c.get("/ui/lock/cfg").await;
    assert_eq!(page.status, 200);
    let html = page.text();
    assert_eq!(
        html.matches("<td class=\"mode\">shared</td>").count(),
        3,
        "two shared holders and one shared waiter: {html}"
    );
    assert_eq!(
        html.matches("<td class=\"mode\">exclusive</td>").count(),
        1,
        "one exclusive waiter: {html}"
    );
    assert!(
        html.contains("(2 queued: 1 exclusive, 1 shared)"),
        "waiters per mode: {html}"
    );

    let list = c.get("/?prefix=cfg").await.text();
    assert_eq!(
        list.matches("<td class=\"mode\">shared</td>").count(),
        2,
        "the list shows each holder's mode: {list}"
    );

    let value = "<b>http://10.0.0.7:8080</b>";
    let campaign = c
        .post(
            "/v1/elections/scheduler/campaign",
            &json!({"value": value, "ttl_ms": 600_000, "owner": "node-7"}),
        )
        .await
        .expect_json(200);
    let term = campaign["fence"]
        .as_u64()
        .expect("a campaign answers a fence");
    let html = c
        .get(&format!("/ui/lock/{}", pct("scheduler")))
        .await
        .text();
    assert!(
        html.contains(&format!(
            "Election leader: <span class=\"owner\">node-7</span>, term <b>{term}</b>, value \
             <code class=\"value\">&lt;b&gt;http://10.0.0.7:8080&lt;/b&gt;</code>"
        )),
        "the leader, its term and its value, escaped: {html}"
    );
    assert!(!html.contains(value), "the value unescaped: {html}");
}
