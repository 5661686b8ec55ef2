//! `GET /v1/watch`: lock events as Server-Sent Events, resumable with `after=` or
//! `Last-Event-ID` (issue 22, item 5), its bad input answered 400, a position the
//! server cannot resume from answered 410, and tenant isolation as on every read.

use crate::support;

use std::time::Duration;

use fencelock_server::{AuthConfig, Role, TokenConfig};
use serde_json::json;
use support::{Pending, TestServer};

const WITHIN: Duration = Duration::from_secs(20);

use support::{sse_events as events, Sse};

async fn open(t: &TestServer, path: &str, headers: &[(&str, &str)]) -> Pending {
    t.client.send("GET", path, headers, b"").await
}

/// Acquires and releases `name` over HTTP: the events it makes (`kind name fence`).
async fn round(t: &TestServer, name: &str, auth: Option<&str>) -> Vec<String> {
    let bearer = auth.map(|a| format!("Bearer {a}"));
    let mut headers = vec![
        ("Content-Type", "application/json"),
        ("Connection", "close"),
    ];
    if let Some(b) = &bearer {
        headers.push(("Authorization", b.as_str()));
    }
    let body = json!({"name": name, "ttl_ms": 60_000}).to_string();
    let grant = t
        .client
        .request("POST", "/v1/acquire", &headers, body.as_bytes())
        .await
        .expect_json(200);
    let body = json!({"name": name, "owner_token": grant["owner_token"]}).to_string();
    t.client
        .request("POST", "/v1/release", &headers, body.as_bytes())
        .await
        .expect_json(200);
    let fence = grant["fence"].as_u64().unwrap();
    vec![
        format!("granted {name} {fence}"),
        format!("released {name} {fence}"),
    ]
}

fn whats(events: &[Sse]) -> Vec<String> {
    events
        .iter()
        .map(|e| {
            format!(
                "{} {} {}",
                e.event,
                e.data["name"].as_str().unwrap_or("?"),
                e.data["fence"].as_u64().unwrap_or(0)
            )
        })
        .collect()
}

#[tokio::test]
async fn sse_streams_events_and_resumes_after_a_position_or_last_event_id() {
    let t = TestServer::start().await;
    let mut live = open(&t, "/v1/watch?prefix=s:", &[]).await;
    let head = live.read_until("\r\n\r\n", WITHIN).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("text/event-stream"), "{head}");

    let mut expected = Vec::new();
    for name in ["s:a", "t:other", "s:b"] {
        let made = round(&t, name, None).await;
        if name.starts_with("s:") {
            expected.extend(made);
        }
    }
    expected.extend(round(&t, "s:end", None).await);
    // The last event: `kind` and `name` are neighbours in the JSON.
    let raw = live
        .read_until("\"kind\":\"released\",\"name\":\"s:end\"", WITHIN)
        .await;
    let seen = events(&format!("{head}{raw}"));
    assert_eq!(whats(&seen), expected);
    for e in &seen {
        assert_eq!(e.data["position"].as_str(), Some(e.id.as_str()), "{e:?}");
        let at = e.data["at"].as_str().unwrap();
        assert!(at.ends_with('Z') && at.contains('T'), "RFC 3339: {at}");
        assert!(e.data["wall_ms"].as_u64().unwrap() > 1_700_000_000_000);
    }
    live.close();

    // Resumed after the second event: the rest, and nothing before.
    let after = &seen[1].id;
    let mut resumed = open(&t, &format!("/v1/watch?prefix=s:&after={after}"), &[]).await;
    let last_id = format!("id: {}\n", seen.last().unwrap().id);
    let resumed_raw = resumed.read_until(&last_id, WITHIN).await;
    assert_eq!(whats(&events(&resumed_raw)), expected[2..].to_vec());

    // `Last-Event-ID` (what a browser sends when it reconnects) wins over `after`.
    let fourth = seen[3].id.clone();
    let mut by_header = open(
        &t,
        &format!("/v1/watch?prefix=s:&after={after}"),
        &[("Last-Event-ID", fourth.as_str())],
    )
    .await;
    let raw = by_header.read_until(&last_id, WITHIN).await;
    assert_eq!(whats(&events(&raw)), expected[4..].to_vec());
    t.stop().await;
}

#[tokio::test]
async fn sse_refuses_bad_positions_with_400_and_lost_ones_with_410() {
    let t = TestServer::start_with(|e| e.watch_history = 2).await;
    for bad in [
        "x",
        "1",
        "1.",
        ".1",
        "-1.0",
        "1.2.3",
        "99999999999999999999.0",
    ] {
        let r = t.client.get(&format!("/v1/watch?after={bad}")).await;
        r.expect_error(400, "invalid_argument");
    }
    let r = t
        .client
        .request(
            "GET",
            "/v1/watch",
            &[("Last-Event-ID", "nope"), ("Connection", "close")],
            b"",
        )
        .await;
    r.expect_error(400, "invalid_argument");
    let r = t.client.get("/v1/watch?prefix=bad%20name%00").await;
    assert_eq!(r.status, 400, "{}", r.text());
    let r = t.client.get("/v1/watch?unknown=1").await;
    assert_eq!(r.status, 400, "{}", r.text());

    // Three rounds (six events) through a history of two: the first is gone.
    let mut live = open(&t, "/v1/watch", &[]).await;
    for _ in 0..3 {
        round(&t, "h:a", None).await;
    }
    let raw = live.read_until("event: granted\n", WITHIN).await;
    let first = events(&raw)[0].id.clone();
    live.close();
    let r = t.client.get(&format!("/v1/watch?after={first}")).await;
    let message = r.expect_error(410, "watch_compacted");
    assert!(message.contains("re-read"), "{message}");
    // From another data directory (past this log's end): refused too.
    let r = t.client.get("/v1/watch?after=999999.0").await;
    r.expect_error(410, "watch_compacted");
    t.stop().await;
}

fn token(name: &str, role: Role, prefixes: &[&str]) -> TokenConfig {
    TokenConfig {
        name: name.to_owned(),
        role,
        prefixes: prefixes.iter().map(|p| (*p).to_owned()).collect(),
        sha256: fencelock_server::auth::hash_token(name),
        acquire_rate: None,
        request_rate: None,
        quotas: Default::default(),
    }
}

#[tokio::test]
async fn sse_shows_a_token_only_its_own_prefixes_events() {
    let t = TestServer::start_configured(|c| {
        c.auth = AuthConfig {
            tokens: vec![
                token("reader-a", Role::Reader, &["a:"]),
                token("client-a", Role::Client, &["a:"]),
                token("client-b", Role::Client, &["b:"]),
            ],
        }
    })
    .await;
    let unauthenticated = t.client.get("/v1/watch").await;
    assert_eq!(unauthenticated.status, 401, "{}", unauthenticated.text());
    let r = t
        .client
        .request(
            "GET",
            "/v1/watch?prefix=b:",
            &[
                ("Authorization", "Bearer reader-a"),
                ("Connection", "close"),
            ],
            b"",
        )
        .await;
    r.expect_error(403, "permission_denied");

    // Watching everything, reader-a gets a:'s events only.
    let mut live = open(&t, "/v1/watch", &[("Authorization", "Bearer reader-a")]).await;
    let head = live.read_until("\r\n\r\n", WITHIN).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let mut expected = Vec::new();
    round(&t, "b:secret", Some("client-b")).await;
    expected.extend(round(&t, "a:mine", Some("client-a")).await);
    round(&t, "b:secret2", Some("client-b")).await;
    expected.extend(round(&t, "a:end", Some("client-a")).await);
    let raw = live
        .read_until("\"kind\":\"released\",\"name\":\"a:end\"", WITHIN)
        .await;
    let raw = format!("{head}{raw}");
    assert_eq!(whats(&events(&raw)), expected);
    assert!(!raw.contains("b:secret"), "{raw}");

    // Resuming from before b:'s events shows none of them either.
    let after = events(&raw)[0].id.clone();
    let mut resumed = open(
        &t,
        &format!("/v1/watch?after={after}"),
        &[("Authorization", "Bearer reader-a")],
    )
    .await;
    let last = format!("id: {}\n", events(&raw).last().unwrap().id);
    let raw = resumed.read_until(&last, WITHIN).await;
    assert_eq!(whats(&events(&raw)), expected[1..].to_vec());
    assert!(!raw.contains("b:secret"), "{raw}");
    t.stop().await;
}

#[tokio::test]
async fn sse_ends_with_an_end_event_when_the_server_stops() {
    let t = TestServer::start().await;
    let mut live = open(&t, "/v1/watch", &[]).await;
    let head = live.read_until("\r\n\r\n", WITHIN).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let stopping = tokio::spawn(t.stop());
    let raw = live.read_until("Last-Event-ID", WITHIN).await;
    let end = events(&raw).pop().unwrap();
    assert_eq!(end.event, "end");
    assert_eq!(end.data["error"]["code"], "unavailable", "{raw}");
    assert!(
        end.data["error"]["message"]
            .as_str()
            .unwrap()
            .contains("Last-Event-ID"),
        "{raw}"
    );
    tokio::time::timeout(WITHIN, stopping)
        .await
        .expect("the stream does not hold the shutdown up")
        .unwrap();
}

/// With authentication off, a page on a rebound name (`Host: evil.example`) cannot
/// read the event stream, as it cannot read any other `/v1` route.
#[tokio::test]
async fn sse_refuses_a_foreign_host_with_authentication_off() {
    let t = TestServer::start().await;
    let raw = t
        .client
        .raw(
            b"GET /v1/watch HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n",
            WITHIN,
        )
        .await;
    let raw = String::from_utf8_lossy(&raw);
    assert!(raw.starts_with("HTTP/1.1 403"), "{raw}");
    assert!(raw.contains("permission_denied"), "{raw}");
    t.stop().await;
}

/// A watcher that falls further behind than the live channel holds catches up
/// from the history by itself: every event, in order, none twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_sse_watcher_catches_up_from_the_history() {
    use fencelock_core::{LockName, Owner};
    use fencelock_server::engine::{AcquireArgs, Durability, Requester, EVENT_BUFFER};
    let t = TestServer::start_with(|e| e.durability = Durability::None).await;
    let mut live = open(&t, "/v1/watch", &[]).await;
    let head = live.read_until("\r\n\r\n", WITHIN).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    // Two events a round, while nothing is read: with 1 KiB owners, more than the
    // socket buffers hold, so the stream stops taking events from the channel,
    // and then more than the channel holds.
    let rounds = EVENT_BUFFER;
    let owner = Owner::new(&"o".repeat(1000)).unwrap();
    let h = t.server().handle().clone();
    let anyone = Requester::anonymous();
    for i in 0..rounds {
        let name = LockName::new(if i + 1 == rounds { "lag:end" } else { "lag:x" }).unwrap();
        let args = AcquireArgs {
            name: name.clone(),
            ttl_ms: Some(60_000),
            wait_ms: 0,
            owner: owner.clone(),
            request_id: None,
            limit: 1,
            lock_delay_ms: 0,
            session: None,
            mode: Default::default(),
            value: None,
        };
        let grant = h.acquire(&anyone, args).await.unwrap();
        assert!(h.release(&anyone, name, grant.token).await.unwrap());
    }
    let raw = live
        .read_until("\"kind\":\"released\",\"name\":\"lag:end\"", WITHIN)
        .await;
    let seen = events(&format!("{head}{raw}"));
    assert_eq!(seen.len(), 2 * rounds, "every event, once");
    for pair in seen.windows(2) {
        let p = |id: &str| {
            let (i, o) = id.split_once('.').unwrap();
            (i.parse::<u64>().unwrap(), o.parse::<u32>().unwrap())
        };
        assert!(
            p(&pair[0].id) < p(&pair[1].id),
            "{} then {}",
            pair[0].id,
            pair[1].id
        );
    }
    let kinds: Vec<&str> = seen.iter().map(|e| e.event.as_str()).collect();
    assert!(
        kinds.chunks(2).all(|c| c == ["granted", "released"]),
        "out of order"
    );
    live.close();
    t.stop().await;
}

/// One vocabulary of event fields (issue 23, item 2): the audit log and watch
/// describe the same change with the same field names and values, a hand-off is
/// `granted` with `handoff: true` in both (and `false` on a direct grant), and the
/// names from before the vocabulary are still there, equal to the new ones.
#[tokio::test]
async fn audit_entries_and_watch_events_share_their_fields() {
    let t = TestServer::start().await;
    let mut live = open(&t, "/v1/watch?prefix=v:", &[]).await;
    let head = live.read_until("\r\n\r\n", WITHIN).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");

    let first = t
        .client
        .post(
            "/v1/acquire",
            &json!({"name": "v:x", "ttl_ms": 60_000, "owner": "first"}),
        )
        .await
        .expect_json(200);
    let waiting = t
        .client
        .send_json(
            "/v1/acquire",
            &json!({"name": "v:x", "ttl_ms": 60_000, "owner": "second", "wait_ms": 20_000}),
        )
        .await;
    let mut raw = live.read_until("\"kind\":\"queued\"", WITHIN).await;
    t.client
        .post(
            "/v1/release",
            &json!({"name": "v:x", "owner_token": first["owner_token"]}),
        )
        .await
        .expect_json(200);
    let second = waiting.response().await.expect_json(200);
    t.client
        .post(
            "/v1/release",
            &json!({"name": "v:x", "owner_token": second["owner_token"]}),
        )
        .await
        .expect_json(200);
    // The last event: `kind`, `name` and `fence` are neighbours in the JSON.
    let last = format!(
        "\"kind\":\"released\",\"name\":\"v:x\",\"fence\":{}",
        second["fence"]
    );
    raw.push_str(&live.read_until(&last, WITHIN).await);
    live.close();
    let watched = events(&format!("{head}{raw}"));
    let audit = t.client.get("/v1/audit?lock=v:x").await.expect_json(200);
    let audit = audit["entries"].as_array().unwrap();

    const SHARED: [&str; 10] = [
        "kind",
        "handoff",
        "name",
        "fence",
        "owner",
        "session",
        "time",
        "time_ms",
        "duration_ms",
        "reason",
    ];
    let mut compared = Vec::new();
    for w in watched.iter().filter(|w| w.event != "queued") {
        let a = audit
            .iter()
            .find(|a| a["kind"] == w.data["kind"] && a["fence"] == w.data["fence"])
            .unwrap_or_else(|| panic!("no audit entry for {w:?} in {audit:?}"));
        for field in SHARED {
            assert_eq!(
                a.get(field),
                w.data.get(field),
                "{field}: {a} vs {}",
                w.data
            );
        }
        // The names from before, kept equal to the new ones.
        assert_eq!(a["lock"], w.data["name"]);
        assert_eq!(w.data["at"], w.data["time"]);
        assert_eq!(w.data["wall_ms"], w.data["time_ms"]);
        compared.push((
            w.event.clone(),
            w.data["owner"].as_str().unwrap().to_owned(),
            w.data.get("handoff").cloned(),
        ));
    }
    assert_eq!(
        compared,
        [
            ("granted".to_owned(), "first".to_owned(), Some(json!(false))),
            ("released".to_owned(), "first".to_owned(), None),
            ("granted".to_owned(), "second".to_owned(), Some(json!(true))),
            ("released".to_owned(), "second".to_owned(), None),
        ]
    );
    let queued = watched.iter().find(|w| w.event == "queued").unwrap();
    assert_eq!(queued.data["mode"], "exclusive");
    assert!(queued.data.get("handoff").is_none(), "{:?}", queued.data);
    assert!(queued.data["time_ms"].as_u64().unwrap() > 1_700_000_000_000);
    t.stop().await;
}
