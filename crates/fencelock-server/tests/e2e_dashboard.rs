//! The dashboard in a real browser: starts a server, holds some locks, and runs
//! `tests/e2e/dashboard.mjs`, which drives headless Debian Chromium with
//! playwright-core: the held lock and its fence appear, the page updates live (no
//! reload) when the lock is released, a force-release with a reason goes through
//! the confirmation, and a lock name containing `<script>` is shown as text.
//! Screenshots are saved to `target/e2e/` (`dashboard.png`, …).
//!
//! Needs `node`, `/usr/bin/chromium` (or `$CHROMIUM`) and `npm ci` in `tests/e2e`;
//! `scripts/test.sh` installs them. Missing tools fail this test, they never skip it.
//!
//! Run: `cargo test -p fencelock-server --test it e2e_dashboard::`

use crate::support;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::json;
use support::TestServer;

fn e2e_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2e")
}

fn shots_dir() -> PathBuf {
    // CARGO_TARGET_TMPDIR is `<target>/tmp`.
    Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("target dir")
        .join("e2e")
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_in_headless_chromium() {
    require_tools();
    let s = TestServer::start().await;
    let c = &s.client;
    let held = c
        .post(
            "/v1/acquire",
            &json!({"name": "e2e:job:1", "ttl_ms": 120_000, "owner": "worker-7"}),
        )
        .await
        .expect_json(200);
    c.post(
        "/v1/acquire",
        &json!({"name": "e2e:stuck", "ttl_ms": 120_000, "owner": "stuck-worker", "lock_delay_ms": 500}),
    )
    .await
    .expect_json(200);
    let evil = "e2e:<script>alert('x')</script>";
    c.post(
        "/v1/acquire",
        &json!({"name": evil, "ttl_ms": 120_000, "owner": "<b>bold</b>"}),
    )
    .await
    .expect_json(200);

    let shots = shots_dir();
    let _ = std::fs::remove_file(shots.join("dashboard.png"));
    let url = format!("http://{}", s.addr());
    let fence = held["fence"].as_u64().unwrap().to_string();
    let token = held["owner_token"].as_str().unwrap().to_owned();
    let (dir, shots_env) = (e2e_dir(), shots.clone());
    let out = tokio::task::spawn_blocking(move || {
        Command::new("node")
            .arg("dashboard.mjs")
            .current_dir(dir)
            .env("FENCELOCK_URL", url)
            .env("E2E_LOCK", "e2e:job:1")
            .env("E2E_FENCE", fence)
            .env("E2E_TOKEN", token)
            .env("E2E_STUCK", "e2e:stuck")
            .env("E2E_EVIL", evil)
            .env("E2E_SHOTS", shots_env)
            .output()
            .expect("run node")
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("E2E OK"),
        "browser test failed ({}):\n{stdout}\n{stderr}",
        out.status
    );

    // What the browser did reached the server: the forced release is audited with
    // its reason and actor.
    let audit = c.get("/v1/audit?lock=e2e:stuck").await.expect_json(200);
    let forced = audit["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["kind"] == "force_released")
        .unwrap_or_else(|| panic!("no force_released entry: {audit}"));
    assert_eq!(forced["reason"], "e2e: holder is stuck");
    assert_eq!(forced["actor"], "anonymous");
    assert_eq!(c.get("/v1/locks/e2e:job:1").await.status, 404);

    let png = std::fs::read(shots.join("dashboard.png")).expect("a screenshot was saved");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    s.stop().await;
}
