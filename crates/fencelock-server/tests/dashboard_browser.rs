//! The dashboard in headless Chromium at 10 and at 10,000 locks (issue 23 item 3):
//! locks are taken over the HTTP API of a real server, then Chromium loads the page,
//! runs its scripts and dumps the DOM, and the test checks
//! the count line ("Showing 1–100 of 10,000 locks"), that one page of rows is
//! rendered (not all of them), that the three uPlot charts were drawn (canvas
//! elements, after the data came from `/ui/series`), and that a lock's page lists
//! each waiter. PNG screenshots go to `target/dashboard-screenshots/` (printed).
//! The theme follows the system: with Chromium told the system prefers dark, the
//! rendered page background (a pixel of the screenshot) is dark, and light otherwise.
//!
//! Needs Debian's `chromium` (`apt-get install -y chromium`, or `$CHROMIUM`); without
//! it the test fails, saying so. It never skips.
//!
//! Run: `cargo test -p fencelock-server --test it dashboard_browser:: -- --nocapture`

use crate::support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::json;
use support::{pct, Client, TestServer};

fn chromium() -> String {
    let path = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    assert!(
        Path::new(&path).exists(),
        "{path} is missing: the dashboard's browser test needs Chromium \
         (`apt-get install -y chromium`, or set $CHROMIUM)"
    );
    path
}

fn shots_dir() -> PathBuf {
    // CARGO_TARGET_TMPDIR is `<target>/tmp`.
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("target dir")
        .join("dashboard-screenshots");
    std::fs::create_dir_all(&dir).expect("create the screenshot directory");
    dir
}

/// Runs headless Chromium on `url` with `extra` arguments and returns its stdout.
async fn chromium_run(url: String, extra: Vec<String>) -> String {
    let bin = chromium();
    let profile = tempfile::tempdir().expect("a profile directory");
    let profile_arg = format!("--user-data-dir={}", profile.path().display());
    let out = tokio::task::spawn_blocking(move || {
        Command::new(bin)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--hide-scrollbars",
                "--run-all-compositor-stages-before-draw",
                // Not `--virtual-time-budget`: virtual time stops while a request
                // is open, and the page's live stream never ends. This stops
                // loading after 5 s; the charts' one fetch is long done by then.
                "--timeout=5000",
                &profile_arg,
            ])
            .args(extra)
            .arg(url)
            .output()
            .expect("run chromium")
    })
    .await
    .expect("join chromium");
    assert!(
        out.status.success(),
        "chromium failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

async fn dump_dom(url: &str) -> String {
    chromium_run(url.to_owned(), vec!["--dump-dom".into()]).await
}

async fn screenshot(url: &str, file: &str) -> Vec<u8> {
    screenshot_with(url, file, Vec::new()).await
}

/// A screenshot of `url` with `extra` Chromium flags; the PNG's bytes.
async fn screenshot_with(url: &str, file: &str, extra: Vec<String>) -> Vec<u8> {
    let path = shots_dir().join(file);
    let _ = std::fs::remove_file(&path);
    let mut args = vec![
        format!("--screenshot={}", path.display()),
        "--window-size=1400,1600".into(),
    ];
    args.extend(extra);
    chromium_run(url.to_owned(), args).await;
    let png = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    println!("screenshot: {}", path.display());
    png
}

/// The RGB of pixel (`x`, `y`) of an 8-bit, non-interlaced RGB or RGBA PNG (what
/// Chromium writes): the chunks' image data inflated and its rows unfiltered.
fn png_pixel(png: &[u8], x: usize, y: usize) -> [u8; 3] {
    let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize;
    let (mut width, mut height, mut channels) = (0, 0, 0);
    let mut idat = Vec::new();
    let mut pos = 8;
    while pos + 8 <= png.len() {
        let len = be(&png[pos..]);
        let data = &png[pos + 8..pos + 8 + len];
        match &png[pos + 4..pos + 8] {
            b"IHDR" => {
                (width, height) = (be(&data[0..]), be(&data[4..]));
                assert_eq!(data[8], 8, "bit depth");
                channels = match data[9] {
                    2 => 3,
                    6 => 4,
                    other => panic!("PNG colour type {other}"),
                };
                assert_eq!(data[12], 0, "an interlaced PNG");
            }
            b"IDAT" => idat.extend_from_slice(data),
            b"IEND" => break,
            _ => {}
        }
        pos += 12 + len;
    }
    assert!(
        x < width && y < height,
        "({x}, {y}) outside {width}x{height}"
    );
    let raw = miniz_oxide::inflate::decompress_to_vec_zlib(&idat).expect("inflate the PNG");
    let stride = width * channels;
    let (mut above, mut row) = (vec![0u8; stride], vec![0u8; stride]);
    for r in 0..=y {
        let start = r * (stride + 1);
        let filter = raw[start];
        for i in 0..stride {
            let a = if i >= channels { row[i - channels] } else { 0 };
            let b = above[i];
            let c = if i >= channels {
                above[i - channels]
            } else {
                0
            };
            let predicted = match filter {
                0 => 0,
                1 => a,
                2 => b,
                3 => ((u16::from(a) + u16::from(b)) / 2) as u8,
                4 => {
                    let p = i16::from(a) + i16::from(b) - i16::from(c);
                    let (pa, pb, pc) = (
                        (p - i16::from(a)).abs(),
                        (p - i16::from(b)).abs(),
                        (p - i16::from(c)).abs(),
                    );
                    if pa <= pb && pa <= pc {
                        a
                    } else if pb <= pc {
                        b
                    } else {
                        c
                    }
                }
                other => panic!("PNG filter {other}"),
            };
            row[i] = raw[start + 1 + i].wrapping_add(predicted);
        }
        std::mem::swap(&mut above, &mut row);
    }
    let px = &above[x * channels..x * channels + 3];
    [px[0], px[1], px[2]]
}

/// Rec. 601 luma of a pixel: 0 black, 255 white.
fn luma([r, g, b]: [u8; 3]) -> u32 {
    (299 * u32::from(r) + 587 * u32::from(g) + 114 * u32::from(b)) / 1000
}

/// Takes the locks `load:{from}` up to `load:{to}` (exclusive, five digits) over
/// the HTTP API, 32 at a time.
async fn take_locks(c: Client, from: usize, to: usize) {
    let mut tasks = tokio::task::JoinSet::new();
    for worker in 0..32 {
        tasks.spawn(async move {
            for i in (from + worker..to).step_by(32) {
                c.post(
                    "/v1/acquire",
                    &json!({"name": format!("load:{i:05}"), "ttl_ms": 600_000, "owner": format!("worker-{worker}")}),
                )
                .await
                .expect_json(200);
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("an acquiring task");
    }
}

/// The text inside the element with `id` (its first text up to the next tag).
fn text_of<'a>(dom: &'a str, id: &str) -> &'a str {
    let start = dom
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("no #{id} in {dom}"));
    let rest = &dom[start..];
    let open = rest.find('>').expect("tag end") + 1;
    let close = rest[open..].find('<').expect("next tag");
    &rest[open..open + close]
}

fn check_charts(dom: &str) {
    assert!(
        dom.contains("id=\"charts\"") && dom.contains("data-drawn=\"3\""),
        "the charts were not drawn: {}",
        dom.find("id=\"charts\"")
            .map_or("no #charts", |i| &dom[i..(i + 400).min(dom.len())])
    );
    assert!(dom.matches("<canvas").count() >= 3, "uPlot drew no canvas");
    for id in ["chart-grants", "chart-wait", "chart-contention"] {
        assert!(dom.contains(&format!("id=\"{id}\"")), "no #{id}");
    }
}

/// The system's colour scheme reaches the page: Chromium says the system prefers dark
/// (`--force-dark-mode`, and Blink's `preferredColorScheme` 0) or light (1), and the
/// page as rendered — a pixel of the body's margin at the top left, which shows the
/// page background — is dark or light. Both screenshots are kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_follows_the_system_theme_in_chromium() {
    chromium();
    let s = TestServer::start().await;
    let c = s.client;
    take_locks(c, 0, 3).await;
    let base = format!("http://{}", s.addr());
    for (scheme, flags) in [
        (
            "dark",
            vec![
                "--force-dark-mode",
                "--blink-settings=preferredColorScheme=0",
            ],
        ),
        ("light", vec!["--blink-settings=preferredColorScheme=1"]),
    ] {
        for (page, url) in [
            ("dashboard", format!("{base}/")),
            ("lock-page", format!("{base}/ui/lock/{}", pct("load:00001"))),
        ] {
            let file = format!("{page}-{scheme}.png");
            let flags = flags.iter().map(|f| (*f).to_owned()).collect();
            let png = screenshot_with(&url, &file, flags).await;
            let background = png_pixel(&png, 4, 4);
            let luma = luma(background);
            let dark = luma < 64;
            let light = luma > 192;
            assert!(
                if scheme == "dark" { dark } else { light },
                "{page} with the system preferring {scheme}: the background rendered \
                 as {background:?} (luma {luma}); see {file}"
            );
        }
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_in_chromium_at_10_and_10000_locks() {
    chromium();
    let s =
        TestServer::start_with(|e| e.durability = fencelock_server::engine::Durability::None).await;
    let c = s.client;
    let base = format!("http://{}", s.addr());
    println!("screenshots in {}", shots_dir().display());

    // 10 locks, one with three waiters.
    take_locks(c, 0, 10).await;
    let mut waiting = Vec::new();
    for w in 0..3 {
        let mut pending = c
            .send_json(
                "/v1/acquire",
                &json!({"name": "load:00003", "ttl_ms": 600_000, "wait_ms": 60_000, "owner": format!("waiter-{w}")}),
            )
            .await;
        // Not answered: it is queued (the answer comes with the grant).
        assert!(pending
            .response_within(Duration::from_millis(50))
            .await
            .is_none());
        waiting.push(pending);
    }
    support::poll_until("three waiters", Duration::from_secs(10), || async {
        let v = c.get("/v1/locks/load:00003").await.json();
        (v["waiters"] == 3).then_some(())
    })
    .await;

    let dom = dump_dom(&format!("{base}/")).await;
    assert_eq!(text_of(&dom, "lock-count"), "Showing 1–10 of 10 locks");
    assert_eq!(dom.matches("<tr data-lock=").count(), 10);
    check_charts(&dom);
    screenshot(&format!("{base}/"), "dashboard-10.png").await;

    let lock_url = format!("{base}/ui/lock/{}", pct("load:00003"));
    let dom = dump_dom(&lock_url).await;
    assert_eq!(dom.matches("<tr class=\"waiter\">").count(), 3, "{dom}");
    for w in 0..3 {
        assert!(dom.contains(&format!("waiter-{w}")), "no waiter-{w}: {dom}");
    }
    assert_eq!(
        text_of(&dom, "waiter-count"),
        "(3 queued: 3 exclusive, 0 shared)"
    );
    screenshot(&lock_url, "lock-page.png").await;

    // Contended only: the one lock with waiters.
    let dom = dump_dom(&format!("{base}/?contended=on")).await;
    assert_eq!(
        text_of(&dom, "lock-count"),
        "Showing 1–1 of 1 matching (10 locks in all)"
    );
    drop(waiting);

    // 10,000 locks: one page of 100 rows, the total counted, the next page linked.
    take_locks(c, 10, 10_000).await;
    let dom = dump_dom(&format!("{base}/")).await;
    assert_eq!(
        text_of(&dom, "lock-count"),
        "Showing 1–100 of 10,000 locks · page 1 of 100"
    );
    assert_eq!(dom.matches("<tr data-lock=").count(), 100);
    assert!(dom.contains("data-lock=\"load:00099\"") && !dom.contains("data-lock=\"load:00100\""));
    assert!(dom.contains("rel=\"next\""));
    check_charts(&dom);
    screenshot(&format!("{base}/"), "dashboard-10000.png").await;

    let dom = dump_dom(&format!("{base}/?prefix=load:09&page=2")).await;
    assert_eq!(
        text_of(&dom, "lock-count"),
        "Showing 101–200 of 1,000 locks · page 2 of 10"
    );
    assert!(dom.contains("data-lock=\"load:09100\"") && !dom.contains("data-lock=\"load:09099\""));
    s.stop().await;
}
