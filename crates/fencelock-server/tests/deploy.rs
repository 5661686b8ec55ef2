//! The files in `deploy/` stay true to the server: every metric the Grafana
//! dashboard queries is exported by a live server (and every exported metric is on
//! the dashboard), and the systemd unit keeps its hardening and its data directory.
//!
//! Run: `cargo test -p fencelock-server --test it deploy::`

use crate::support;

use std::collections::BTreeSet;
use std::path::PathBuf;

use serde_json::{json, Value};
use support::TestServer;

fn deploy_file(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy")
        .join(name)
}

/// Every string under a key named `expr`, `definition` or `query` (PromQL).
fn queries(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(map) => {
            for (k, v) in map {
                match (k.as_str(), v) {
                    ("expr" | "definition" | "query", Value::String(s)) => out.push(s.clone()),
                    _ => queries(v, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|i| queries(i, out)),
        _ => {}
    }
}

/// Identifiers in PromQL that name fencelock metrics.
fn metric_names(promql: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = promql;
    while let Some(at) = rest.find("fencelock_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.insert(tail[..end].to_owned());
        rest = &tail[end..];
    }
    names
}

#[tokio::test]
async fn every_metric_the_grafana_dashboard_queries_exists() {
    let text = std::fs::read_to_string(deploy_file("grafana-dashboard.json")).unwrap();
    let dashboard: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut all = Vec::new();
    queries(&dashboard, &mut all);
    let queried: BTreeSet<String> = all.iter().flat_map(|q| metric_names(q)).collect();
    assert!(queried.len() >= 15, "suspiciously few metrics: {queried:?}");

    let s = TestServer::start().await;
    // Some traffic, so that counters and histograms have samples.
    let g = s
        .client
        .post("/v1/acquire", &json!({"name": "m", "ttl_ms": 10_000}))
        .await
        .expect_json(200);
    s.client
        .post(
            "/v1/release",
            &json!({"name": "m", "owner_token": g["owner_token"]}),
        )
        .await
        .expect_json(200);
    let metrics = s.client.get("/metrics").await;
    assert_eq!(metrics.status, 200);
    let exported: BTreeSet<String> = metrics
        .text()
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap().to_owned())
        .collect();
    // The check catches a misspelt metric (a planted bug), so it can be trusted.
    let planted = metric_names("sum(rate(fencelock_grant_total{job=~\"$job\"}[5m]))");
    assert_eq!(
        planted.iter().next().map(String::as_str),
        Some("fencelock_grant_total")
    );
    assert!(!planted.is_subset(&exported));
    let missing: Vec<&String> = queried.difference(&exported).collect();
    assert!(
        missing.is_empty(),
        "the dashboard queries metrics the server does not export: {missing:?}"
    );
    // And the dashboard shows every metric family the server exports.
    for family in fencelock_server::metrics::METRIC_NAMES {
        assert!(
            queried.iter().any(|q| q.starts_with(family)),
            "{family} is exported but not on the dashboard"
        );
    }
    s.stop().await;
}

#[test]
fn the_systemd_unit_is_hardened_and_uses_the_state_directory() {
    let unit = std::fs::read_to_string(deploy_file("fencelock.service")).unwrap();
    let directives: BTreeSet<&str> = unit
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#') && l.contains('='))
        .collect();
    for d in [
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "PrivateDevices=yes",
        "DynamicUser=yes",
        "StateDirectory=fencelock",
        "CapabilityBoundingSet=",
        "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX",
        "SystemCallFilter=@system-service",
        "MemoryDenyWriteExecute=yes",
        "Environment=FENCELOCK_DATA_DIR=/var/lib/fencelock",
        "ExecStart=/usr/local/bin/fencelock serve --config /etc/fencelock/fencelock.toml",
        "RestartPreventExitStatus=2",
    ] {
        assert!(directives.contains(d), "deploy/fencelock.service lacks {d}");
    }
    let docker = std::fs::read_to_string(deploy_file("Dockerfile")).unwrap();
    for needle in [
        "AS build",
        "USER fencelock:fencelock",
        "VOLUME [\"/var/lib/fencelock\"]",
        "--locked",
    ] {
        assert!(docker.contains(needle), "deploy/Dockerfile lacks {needle}");
    }
}
