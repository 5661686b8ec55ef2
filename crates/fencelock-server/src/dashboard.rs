//! The operator dashboard at `/` and the audit query API `GET /v1/audit`.
//!
//! Server-rendered HTML from [`maud`] templates, which escape every value they
//! insert (lock names, owners, reasons, prefixes, error messages: everything that
//! comes from a user), made live with the vendored htmx and its SSE extension
//! (`assets/`, served from `/ui/assets/`; no build step, nothing from a CDN). One SSE
//! stream per page (`/ui/stream`) pushes the lock table and the health panel every
//! second and at once after each durable lock event, and each event as a row of
//! "recent events".
//!
//! Markup that is not escaped (`PreEscaped`) is only ever a constant of this file:
//! the style sheet `STYLE` in the page head. (`maud::DOCTYPE` is maud's own.)
//!
//! Authorization: every page and stream calls [`auth::authorize`] (fails closed);
//! with no tokens configured every caller is the anonymous admin. Browsers sign in
//! with the form at `/ui/login`, which sets the `fencelock_token` cookie (HttpOnly,
//! SameSite=Strict); state-changing requests authenticated by that cookie must be
//! same-origin (checked by the auth layer). Force-release needs the admin role and a
//! reason, is confirmed in the browser (`hx-confirm`), and is recorded in the audit
//! log with the caller's token name as actor.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::vocab::EventFields;
use axum::extract::rejection::{FormRejection, PathRejection, QueryRejection};
use axum::extract::{Extension, Form, Path, Query, State};
use axum::http::{header, Extensions, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use cookie::{Cookie, SameSite};
use fencelock_core::{Event, Fence, LockName, LockView, Reason};
use fencelock_proto::vocab::{self, Event as VocabEvent, KindFilter};
use futures_util::StreamExt;
use maud::{html, Markup, PreEscaped, DOCTYPE};
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;
use tokio::sync::broadcast::error::RecvError;

use crate::audit::{AuditEntry, AuditQuery};
use crate::auth::{self, Action, Principal};
use crate::engine::{Handle, RunState, SharedEvent};
use crate::error::{ApiError, ApiErrorKind};
use crate::input::{self, invalid};

/// Largest page of `GET /v1/audit`.
pub const MAX_AUDIT_PAGE: usize = 1000;
/// Locks on one page of the dashboard's list.
pub const DASHBOARD_PAGE: usize = 100;
/// Highest page number the list accepts.
const MAX_PAGE: usize = 1_000_000;
/// History rows on a lock's page (its newest audit entries).
const HISTORY_ROWS: usize = 200;
/// Recent events shown when a page loads.
const RECENT_EVENTS: usize = 50;
/// How often the live view re-renders the lock table (lease countdowns, health).
const REFRESH: Duration = Duration::from_secs(1);

const HTMX_JS: &str = include_str!("../assets/htmx.min.js");
const HTMX_SSE_JS: &str = include_str!("../assets/htmx-ext-sse.min.js");
const DASHBOARD_JS: &str = include_str!("../assets/dashboard.js");
/// The vendored chart library (uPlot, MIT, `assets/uPlot.LICENSE`), served under
/// its version so it can be cached for good.
const UPLOT_JS: &str = include_str!("../assets/uPlot-1.6.32.iife.min.js");
const UPLOT_CSS: &str = include_str!("../assets/uPlot-1.6.32.min.css");
const UPLOT_JS_PATH: &str = "/ui/assets/uPlot-1.6.32.iife.min.js";
const UPLOT_CSS_PATH: &str = "/ui/assets/uPlot-1.6.32.min.css";
/// Light by default, dark when the system asks for it (`prefers-color-scheme`).
const STYLE: &str = ":root{color-scheme:light dark;--fg:#222;--bg:#fff;--muted:#777;--line:#ddd;\
--head:#f4f4f4;--link:#0645ad;--err:#b00;--ok:#070;--warn:#a60}\
@media (prefers-color-scheme:dark){:root{--fg:#ddd;--bg:#161616;--muted:#999;--line:#333;\
--head:#242424;--link:#8ab4f8;--err:#ff6b6b;--ok:#6c6;--warn:#e0a040}}\
body{font:14px system-ui,sans-serif;margin:1.5em;color:var(--fg);background:var(--bg)}\
a{color:var(--link)}h1{font-size:1.3em;margin:0}h2{font-size:1.1em;margin:1.2em 0 .4em}h3{font-size:1em;margin:1em 0 .3em}\
header{display:flex;gap:1em;align-items:baseline;justify-content:space-between}\
table{border-collapse:collapse;width:100%}th,td{text-align:left;padding:.25em .6em;border-bottom:1px solid var(--line)}\
th{background:var(--head)}td.num{text-align:right;font-variant-numeric:tabular-nums}\
.health{display:flex;flex-wrap:wrap;gap:.5em 1.5em}.health div b{display:block;font-size:1.2em}\
.muted{color:var(--muted)}.error{color:var(--err)}.ok{color:var(--ok)}form.inline{display:inline}\
input[type=text],input[type=password]{padding:.3em;min-width:18em}input.short{min-width:5em;width:6em}button{padding:.3em .8em}\
nav.pages{margin:.3em 0}#charts{display:flex;flex-wrap:wrap;gap:1em}.chart .u-title{font-size:1em}";

/// The style sheet: [`STYLE`] and the event rows' classes, named from the vocabulary
/// (`kind-force_released`), so the CSS cannot fall behind a rename.
fn style() -> &'static str {
    static SHEET: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SHEET.get_or_init(|| {
        format!(
            "{STYLE}.kind-{}{{color:var(--err);font-weight:bold}}.kind-{}{{color:var(--warn)}}",
            VocabEvent::ForceReleased.name(),
            VocabEvent::Expired.name()
        )
    })
}

/// Bytes left as they are in a URL path segment or query value; every other byte
/// is percent-encoded.
const URL_SAFE: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~')
    .remove(b':');

/// Percent-encodes text for a URL path segment or query value.
fn url(text: &str) -> String {
    utf8_percent_encode(text, URL_SAFE).to_string()
}

/// A duration in ms as short text: the vocabulary's format for people
/// ([`vocab::human_ms`]: `850ms`, `12s300ms`, `4m5s`, `2h3m`).
fn dur(ms: u64) -> String {
    vocab::human_ms(ms)
}

/// Milliseconds since the Unix epoch as a UTC date and time (`None` past year 9999).
fn civil(wall_ms: u64) -> Option<time::OffsetDateTime> {
    time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(wall_ms) * 1_000_000).ok()
}

/// Milliseconds since the Unix epoch as `YYYY-MM-DD HH:MM:SS.mmm` UTC.
fn utc(wall_ms: u64) -> String {
    match civil(wall_ms) {
        Some(t) => format!(
            "{:04}-{:02}-{:02} {:02}:{:02}:{:02}.{:03}",
            t.year(),
            u8::from(t.month()),
            t.day(),
            t.hour(),
            t.minute(),
            t.second(),
            t.millisecond()
        ),
        None => format!("{wall_ms} ms after 1970"),
    }
}

/// Milliseconds since the Unix epoch as RFC 3339 UTC with milliseconds
/// (`2026-03-02T12:30:45.123Z`; always three digits, so the text sorts).
pub(crate) fn rfc3339(wall_ms: u64) -> String {
    utc(wall_ms).replacen(' ', "T", 1) + "Z"
}

fn page(title: &str, who: Option<&Principal>, body: Markup) -> Html<String> {
    let markup = html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width";
                title { (title) " · fencelock" }
                // A constant of this file, not user data.
                style { (PreEscaped(style())) }
                link rel="stylesheet" href=(UPLOT_CSS_PATH);
                script src="/ui/assets/htmx.min.js" {}
                script src="/ui/assets/htmx-ext-sse.min.js" {}
                script src=(UPLOT_JS_PATH) defer {}
                script src="/ui/assets/dashboard.js" defer {}
            }
            body hx-ext="sse" {
                header {
                    h1 { a href="/" { "fencelock" } " · " (title) }
                    @match who {
                        Some(p) if !p.is_anonymous() => span {
                            "signed in as " b { (p.name()) } " (" (p.role().as_str()) ") "
                            form.inline method="post" action="/ui/logout" { button { "sign out" } }
                        },
                        Some(_) => span.muted { "authentication off (loopback only)" },
                        None => {},
                    }
                }
                (body)
            }
        }
    };
    Html(markup.into_string())
}

/// An error message as a paragraph.
fn error_p(message: &str) -> Markup {
    html! { p.error { (message) } }
}

/// The caller if it may do `action`; a page answer (login form or error) if not.
fn page_caller(
    ext: &Extensions,
    headers: &HeaderMap,
    action: Action,
    name: Option<&str>,
) -> Result<Principal, Box<Response>> {
    auth::authorize(ext, action, name).map_err(|e| {
        Box::new(match e.kind() {
            ApiErrorKind::Unauthenticated => {
                let rejected = has_token_cookie(headers);
                let mut r =
                    login_page(rejected.then_some("That token was not accepted.")).into_response();
                *r.status_mut() = StatusCode::UNAUTHORIZED;
                r
            }
            _ => {
                let mut r = page("not allowed", None, error_p(e.message())).into_response();
                *r.status_mut() = StatusCode::FORBIDDEN;
                r
            }
        })
    })
}

fn has_token_cookie(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(Cookie::split_parse)
        .any(|c| c.is_ok_and(|c| c.name() == auth::TOKEN_COOKIE))
}

fn login_page(message: Option<&str>) -> Html<String> {
    page(
        "sign in",
        None,
        html! {
            @if let Some(m) = message { (error_p(m)) }
            form method="post" action="/ui/login" {
                p {
                    label { "Token " input type="password" name="token" autocomplete="off" required; }
                    " "
                    button { "Sign in" }
                }
                p.muted {
                    "A token from the server's config (" code { "fencelock token new" }
                    "). It is kept in an HttpOnly cookie."
                }
            }
        },
    )
}

#[derive(Deserialize)]
struct LoginForm {
    token: String,
}

async fn login_form() -> Html<String> {
    login_page(None)
}

/// Characters a token may contain in a cookie (no `;`, `,`, spaces or controls).
fn cookie_safe(token: &str) -> bool {
    !token.is_empty()
        && token.len() <= auth::MAX_TOKEN_BYTES
        && token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.~+/=".contains(&b))
}

/// The token cookie's `Set-Cookie` value: HttpOnly, SameSite=Strict, the whole
/// site, and `Secure` when the page came over https.
fn token_cookie(value: &str, https: bool) -> Cookie<'_> {
    Cookie::build((auth::TOKEN_COOKIE, value))
        .path("/")
        .http_only(true)
        .same_site(SameSite::Strict)
        .secure(https)
        .build()
}

async fn login(headers: HeaderMap, form: Result<Form<LoginForm>, FormRejection>) -> Response {
    let Ok(Form(form)) = form else {
        return (StatusCode::BAD_REQUEST, login_page(Some("Send a token."))).into_response();
    };
    let token = form.token.trim();
    if !cookie_safe(token) {
        return (
            StatusCode::BAD_REQUEST,
            login_page(Some("That is not a fencelock token.")),
        )
            .into_response();
    }
    // The browser says in `Origin` whether the page came over https; then the
    // cookie must never travel over plain http.
    let https = headers
        .get(header::ORIGIN)
        .is_some_and(|o| o.as_bytes().starts_with(b"https://"));
    let mut r = Redirect::to("/").into_response();
    if let Ok(v) = HeaderValue::from_str(&token_cookie(token, https).to_string()) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r
}

async fn logout() -> Response {
    let mut r = Redirect::to("/ui/login").into_response();
    let mut gone = token_cookie("", false);
    gone.set_max_age(cookie::time::Duration::ZERO);
    if let Ok(v) = HeaderValue::from_str(&gone.to_string()) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r
}

async fn asset(Path(file): Path<String>) -> Response {
    const JS: &str = "text/javascript; charset=utf-8";
    // A versioned file never changes under its name; the others may change with
    // the server.
    const FOR_GOOD: &str = "public, max-age=31536000, immutable";
    const AN_HOUR: &str = "public, max-age=3600";
    let (body, kind, cache) = match file.as_str() {
        "htmx.min.js" => (HTMX_JS, JS, AN_HOUR),
        "htmx-ext-sse.min.js" => (HTMX_SSE_JS, JS, AN_HOUR),
        "dashboard.js" => (DASHBOARD_JS, JS, AN_HOUR),
        f if Some(f) == UPLOT_JS_PATH.strip_prefix("/ui/assets/") => (UPLOT_JS, JS, FOR_GOOD),
        f if Some(f) == UPLOT_CSS_PATH.strip_prefix("/ui/assets/") => {
            (UPLOT_CSS, "text/css; charset=utf-8", FOR_GOOD)
        }
        _ => return ApiError::new(ApiErrorKind::NotFound, "no such asset").into_response(),
    };
    (
        [(header::CONTENT_TYPE, kind), (header::CACHE_CONTROL, cache)],
        body,
    )
        .into_response()
}

/// The list's query string: `prefix`, `sort` (`name`, `held`, `waiters`),
/// `contended` (`on`: only locks with waiters), `held_over` (a duration such as
/// `30s`: only locks held at least that long) and `page` (from 1).
#[derive(Deserialize, Default)]
struct ListParams {
    #[serde(default)]
    prefix: String,
    #[serde(default)]
    sort: String,
    #[serde(default)]
    contended: String,
    #[serde(default)]
    held_over: String,
    #[serde(default)]
    page: String,
}

/// How the lock list is ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
enum Sort {
    /// By name.
    #[default]
    Name,
    /// Longest held first.
    Held,
    /// Most waiters first.
    Waiters,
}

impl Sort {
    fn as_str(self) -> &'static str {
        match self {
            Sort::Name => "name",
            Sort::Held => "held",
            Sort::Waiters => "waiters",
        }
    }
}

/// A validated [`ListParams`]: what one page of the lock list shows.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct ListQuery {
    prefix: String,
    sort: Sort,
    contended: bool,
    /// Only locks held at least this long (0: every lock).
    held_over_ms: u64,
    /// The page, from 1.
    page: usize,
}

impl Default for ListQuery {
    fn default() -> ListQuery {
        ListQuery::of_prefix(String::new())
    }
}

impl ListQuery {
    /// The first page of every lock under `prefix`, by name.
    fn of_prefix(prefix: String) -> ListQuery {
        ListQuery {
            prefix,
            sort: Sort::Name,
            contended: false,
            held_over_ms: 0,
            page: 1,
        }
    }

    /// The query of `p`, or a 400 `invalid_argument` naming the bad field.
    fn parse(p: ListParams) -> Result<ListQuery, ApiError> {
        let prefix = input::prefix(p.prefix)?;
        let sort = match p.sort.as_str() {
            "" | "name" => Sort::Name,
            "held" => Sort::Held,
            "waiters" => Sort::Waiters,
            _ => return Err(invalid("sort", "must be name, held or waiters")),
        };
        let contended = match p.contended.as_str() {
            "" | "off" | "false" => false,
            "on" | "true" => true,
            _ => return Err(invalid("contended", "must be on or off")),
        };
        let held_over_ms = match p.held_over.trim() {
            "" => 0,
            d => humantime::parse_duration(d)
                .ok()
                .and_then(|d| u64::try_from(d.as_millis()).ok())
                .ok_or_else(|| invalid("held_over", "must be a duration such as 30s or 5m"))?,
        };
        let page = match p.page.trim() {
            "" => 1,
            n => n
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=MAX_PAGE).contains(n))
                .ok_or_else(|| invalid("page", format!("must be between 1 and {MAX_PAGE}")))?,
        };
        Ok(ListQuery {
            prefix,
            sort,
            contended,
            held_over_ms,
            page,
        })
    }

    /// Whether `v` passes the filters.
    fn shows(&self, v: &LockView) -> bool {
        (!self.contended || v.waiters > 0)
            && (self.held_over_ms == 0 || held_ms(v) >= self.held_over_ms)
    }

    /// The query string of this query at page `page` (empty fields left out).
    fn href(&self, page: usize) -> String {
        let mut q = format!("/?prefix={}&sort={}", url(&self.prefix), self.sort.as_str());
        if self.contended {
            q.push_str("&contended=on");
        }
        if self.held_over_ms > 0 {
            q.push_str(&format!("&held_over={}ms", self.held_over_ms));
        }
        q.push_str(&format!("&page={page}"));
        q
    }
}

/// How long the longest holder of `v` has held it (0 if free).
fn held_ms(v: &LockView) -> u64 {
    v.holders.iter().map(|h| h.held_ms).max().unwrap_or(0)
}

/// One page of the lock list and the counts around it.
struct ListPage {
    /// Locks on this page, in the query's order.
    views: Vec<LockView>,
    /// Locks under the prefix the caller may see.
    total: usize,
    /// Of those, the ones that pass the filters.
    matched: usize,
}

/// The page `q.page` of the locks under `q.prefix` that `who` may see, filtered and
/// sorted. One read of the engine's state (the path `GET /v1/locks` takes): it
/// counts and sorts every visible lock under the prefix, but list views carry no
/// waiter lists, so it costs O(locks), and only one page of views comes back.
async fn visible_locks(h: &Handle, who: &Principal, q: &ListQuery) -> Result<ListPage, ApiError> {
    let ranges = who.ranges(&q.prefix)?;
    let q = q.clone();
    h.read(move |core| {
        let mut total = 0;
        let mut shown: Vec<LockView> = Vec::new();
        for range in &ranges {
            for v in core.locks(range, None, usize::MAX) {
                total += 1;
                if q.shows(&v) {
                    shown.push(v);
                }
            }
        }
        match q.sort {
            Sort::Name => shown.sort_by(|a, b| a.name.cmp(&b.name)),
            Sort::Held => {
                shown.sort_by(|a, b| held_ms(b).cmp(&held_ms(a)).then(a.name.cmp(&b.name)))
            }
            Sort::Waiters => {
                shown.sort_by(|a, b| b.waiters.cmp(&a.waiters).then(a.name.cmp(&b.name)))
            }
        }
        let matched = shown.len();
        let views = shown
            .into_iter()
            .skip((q.page - 1).saturating_mul(DASHBOARD_PAGE))
            .take(DASHBOARD_PAGE)
            .collect();
        ListPage {
            views,
            total,
            matched,
        }
    })
    .await
}

/// `n` with thousands separators: `5,004`.
fn grouped(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The lock table of one page, with the count line and the page links.
fn list_html(list: &ListPage, q: &ListQuery) -> Markup {
    let first = (q.page - 1) * DASHBOARD_PAGE;
    let pages = list.matched.div_ceil(DASHBOARD_PAGE).max(1);
    let filtered = q.contended || q.held_over_ms > 0;
    html! {
        p #lock-count {
            @if list.views.is_empty() {
                "Showing 0 of " (grouped(list.matched))
            } @else {
                "Showing " (grouped(first + 1)) "–" (grouped(first + list.views.len()))
                " of " (grouped(list.matched))
            }
            @if filtered {
                " matching (" (grouped(list.total)) " locks in all)"
            } @else {
                " locks"
            }
            @if pages > 1 {
                " · page " (q.page) " of " (pages)
            }
        }
        @if pages > 1 || q.page > 1 {
            nav.pages {
                @if q.page > 1 { a rel="prev" href=(q.href(q.page - 1)) { "← previous" } " " }
                @if q.page < pages { a rel="next" href=(q.href(q.page + 1)) { "next →" } }
            }
        }
        (locks_table(&list.views))
    }
}

fn lock_link(name: &str) -> Markup {
    html! { a.lock href={ "/ui/lock/" (url(name)) } { (name) } }
}

fn locks_table(views: &[LockView]) -> Markup {
    html! {
        table #lock-table {
            thead { tr {
                th { "Lock" } th { "Owner" } th { "Mode" } th { "Fence" } th { "Held" }
                th { "Lease left" } th { "Waiters" } th { "Lock-delay left" }
            } }
            tbody {
                @if views.is_empty() {
                    tr { td.muted colspan="8" { "no locks held, queued for or in lock-delay" } }
                }
                @for v in views {
                    @let name = v.name.as_str();
                    @let delay = if v.lock_delay_remaining_ms > 0 {
                        dur(v.lock_delay_remaining_ms)
                    } else {
                        "—".to_owned()
                    };
                    @if v.holders.is_empty() {
                        tr data-lock=(name) {
                            td { (lock_link(name)) } td.muted { "free" } td {} td {} td {} td {}
                            td.num { (v.waiters) } td { (delay) }
                        }
                    }
                    @for h in &v.holders {
                        tr data-lock=(name) {
                            td {
                                (lock_link(name))
                                @if v.limit > 1 { " " span.muted { "(limit " (v.limit) ")" } }
                            }
                            td.owner { (h.owner.as_str()) }
                            td.mode { (h.mode.as_str()) }
                            td.num.fence { (h.fence.get()) }
                            td.num { (dur(h.held_ms)) }
                            td.num { (dur(h.ttl_remaining_ms)) }
                            td.num { (v.waiters) }
                            td { (delay) }
                        }
                    }
                }
            }
        }
    }
}

/// The health panel. The counts are the whole server's, so a token limited to some
/// prefixes sees only the state and uptime (issue 19: a tenant must not learn how
/// many locks, sessions and waiters the others have).
fn health(h: &Handle, who: &Principal) -> Markup {
    let state = match h.state() {
        RunState::Running => "running".to_owned(),
        other => format!("{other:?}"),
    };
    let uptime = dur(h.uptime().as_millis() as u64);
    if !who.covers_everything() {
        return html! {
            div.health #health-panel {
                div { "state" b { (state) } }
                div { "uptime" b { (uptime) } }
                div.muted {
                    "Counts cover every lock; they need a token whose prefixes include every lock."
                }
            }
        };
    }
    let m = h.metrics();
    // A cluster member syncs the Raft log instead of the command log.
    let sync = if h.cluster().is_some() {
        &*m.cluster.log_sync
    } else {
        &m.fsync
    };
    let ms = |us: f64| format!("{:.2} ms", us / 1000.0);
    let fsync = match (sync.mean(), sync.quantile_bound(0.99)) {
        (Some(mean), Some(p99)) => html! {
            (ms(mean)) " " span.muted { "(p99 ≤ " (ms(p99 as f64)) ")" }
        },
        (Some(mean), None) => html! { (ms(mean)) },
        _ => html! { "—" },
    };
    let audit = m.audit_write.mean().map_or("—".to_owned(), ms);
    let batch = m
        .batch_size
        .mean()
        .map_or("—".to_owned(), |b| format!("{b:.1}"));
    html! {
        div.health #health-panel {
            div { "state" b { (state) } }
            div { "uptime" b { (uptime) } }
            div { "held" b { (m.held.load(Relaxed)) } }
            div { "waiters" b { (m.waiters.load(Relaxed)) } }
            div { "sessions" b { (m.sessions.load(Relaxed)) } }
            div { "locks" b { (m.locks.load(Relaxed)) } }
            div { "next fence" b { (m.next_fence.load(Relaxed)) } }
            div { "log sync (mean)" b { (fsync) } }
            div { "audit write (mean)" b { (audit) } }
            div { "records per sync (mean)" b { (batch) } }
            div { "syncs" b { (sync.count()) } }
            div { "audit entries" b { (m.audit_entries.load(Relaxed)) } }
        }
    }
}

/// A member's URL as a link, if it is an http(s) URL (anything else, such as a
/// `javascript:` URL, is shown as text), or `—` if unknown.
fn member_link(url: Option<&str>) -> Markup {
    html! {
        @match url {
            Some(u) if u.starts_with("http://") || u.starts_with("https://") => {
                a href=(u) { (u) }
            }
            Some(u) => (u),
            None => "—",
        }
    }
}

/// The "Cluster" section (cluster mode only): this member, the term and the leader,
/// then one row per member with its replication progress (known on the leader).
fn cluster_section(v: &crate::cluster::api::ClusterView) -> Markup {
    let num = |n: Option<u64>| n.map_or("—".to_owned(), |n| n.to_string());
    html! {
        p #cluster-self {
            "This is member " b { (v.node_id) } ", " b { (v.role) } ", term " b { (v.term) }
            ". Leader: "
            @match &v.leader {
                Some(l) => { "member " b { (l.id) } " (" (member_link(Some(l.url.as_str()))) ")" }
                None => span.error { "none known" },
            }
            "."
        }
        table #cluster-table {
            thead { tr {
                th { "Member" } th { "URL" } th { "Role" } th { "Matched index" }
                th { "Lag (entries)" }
            } }
            tbody {
                @for m in &v.members {
                    tr data-member=(m.id) {
                        td.num {
                            (m.id)
                            @if m.id == v.node_id { " " span.muted { "(this)" } }
                        }
                        td { (member_link(m.url.as_deref())) }
                        td { (m.role) }
                        td.num { (num(m.matched_index)) }
                        td.num { (num(m.lag)) }
                    }
                }
            }
        }
        @if v.last_log_index.is_none() {
            p.muted { "Replication progress is known on the leader only." }
        }
    }
}

/// The cluster section of `h`'s dashboard, `None` on a single server.
fn cluster_html(h: &Handle) -> Option<Markup> {
    h.cluster()
        .map(|c| cluster_section(&crate::cluster::api::view(c)))
}

/// A row of "recent events" or of a lock's history.
struct EventRow<'a> {
    wall_ms: u64,
    /// What happened: its name is the row's CSS class (`kind-force_released`), its
    /// label the text (`force released`).
    kind: VocabEvent,
    lock: Option<&'a str>,
    fence: Option<u64>,
    owner: &'a str,
    /// Plain text; escaped when rendered.
    detail: String,
}

impl EventRow<'_> {
    fn render(&self) -> Markup {
        html! {
            tr {
                td { (utc(self.wall_ms)) }
                td class={ "kind-" (self.kind.name()) } { (self.kind.label()) }
                td { @if let Some(l) = self.lock { (lock_link(l)) } }
                td.num { @if let Some(f) = self.fence { (f) } }
                td { (self.owner) }
                td { (self.detail) }
            }
        }
    }
}

fn audit_row(e: &AuditEntry) -> Markup {
    let mut detail = Vec::new();
    if let Some(r) = &e.reason {
        detail.push(format!("reason: {r}"));
    }
    if let Some(a) = &e.actor {
        detail.push(format!("by {a}"));
    }
    if let Some(d) = &e.detail {
        detail.push(d.clone());
    }
    if let Some(r) = &e.request_id {
        detail.push(format!("request {r}"));
    }
    if e.kind.is_handoff() {
        detail.push("hand-off".to_owned());
    }
    if e.duration_ms > 0 {
        detail.push(format!("after {}", dur(e.duration_ms)));
    }
    EventRow {
        wall_ms: e.wall_ms,
        kind: e.kind.event(),
        lock: e.lock.as_deref(),
        fence: e.fence,
        owner: e.owner.as_deref().unwrap_or(""),
        detail: detail.join(", "),
    }
    .render()
}

fn event_row(e: &Event) -> Option<Markup> {
    // Queue changes are not shown: the audit log (the page's first rows) has none.
    let kind = match crate::vocab::event(e.kind) {
        VocabEvent::Queued | VocabEvent::WaitEnded => return None,
        kind => kind,
    };
    let row = EventRow {
        wall_ms: crate::audit::wall_ms(),
        kind,
        lock: Some(e.name.as_str()),
        fence: e.fence.map(|f| f.get()),
        owner: e.owner.as_str(),
        detail: e
            .reason
            .as_ref()
            .map(|r| format!("reason: {}", r.as_str()))
            .unwrap_or_default(),
    };
    Some(row.render())
}

/// The head of the "recent events" and history tables.
fn events_head() -> Markup {
    html! {
        thead { tr {
            th { "Time (UTC)" } th { "Event" } th { "Lock" } th { "Fence" } th { "Owner" }
            th { "Detail" }
        } }
    }
}

/// Audit entries the caller may see (lock-less entries only with every prefix).
fn visible_audit(h: &Handle, who: &Principal, query: &AuditQuery) -> Vec<AuditEntry> {
    let mut entries = h.audit(query);
    entries.retain(|e| match &e.lock {
        Some(l) => who.covers(l),
        None => who.covers_everything(),
    });
    entries
}

/// The list form: prefix, sort and filters, as the query `q` has them.
fn list_form(q: &ListQuery) -> Markup {
    let held_over = if q.held_over_ms > 0 {
        dur(q.held_over_ms)
    } else {
        String::new()
    };
    html! {
        form #list-form method="get" action="/" {
            label {
                "Prefix "
                input type="text" name="prefix" value=(q.prefix) placeholder="tenant:kind:";
            }
            " "
            label {
                "Sort "
                select name="sort" {
                    @for s in [Sort::Name, Sort::Held, Sort::Waiters] {
                        option value=(s.as_str()) selected[s == q.sort] {
                            (match s { Sort::Name => "name", Sort::Held => "held longest", Sort::Waiters => "most waiters" })
                        }
                    }
                }
            }
            " "
            label { input type="checkbox" name="contended" value="on" checked[q.contended]; " contended only" }
            " "
            label {
                "Held longer than "
                input.short type="text" name="held_over" value=(held_over) placeholder="30s";
            }
            " "
            button { "Show" }
        }
    }
}

/// The query string of the live stream of the list `q`.
fn stream_href(q: &ListQuery) -> String {
    q.href(q.page).replacen("/?", "/ui/stream?", 1)
}

async fn index(
    State(h): State<Handle>,
    ext: Extensions,
    headers: HeaderMap,
    params: Result<Query<ListParams>, QueryRejection>,
) -> Response {
    let who = match page_caller(&ext, &headers, Action::Read, None) {
        Ok(p) => p,
        Err(r) => return *r,
    };
    let Query(params) = params.unwrap_or_default();
    let q = match ListQuery::parse(params) {
        Ok(q) => q,
        Err(e) => {
            let body = html! { (error_p(e.message())) p { a href="/" { "← all locks" } } };
            return (StatusCode::BAD_REQUEST, page("locks", Some(&who), body)).into_response();
        }
    };
    let prefix = q.prefix.clone();
    let table = match visible_locks(&h, &who, &q).await {
        Ok(list) => list_html(&list, &q),
        Err(e) => error_p(e.message()),
    };
    let recent = visible_audit(&h, &who, &AuditQuery::newest(RECENT_EVENTS * 4));
    let events = recent
        .iter()
        .rev()
        .filter(|e| e.lock.as_deref().is_some_and(|l| l.starts_with(&prefix)))
        .take(RECENT_EVENTS);
    let body = html! {
        (list_form(&q))
        div sse-connect=(stream_href(&q)) {
            h2 { "Health" }
            div #health sse-swap="health" { (health(&h, &who)) }
            @if who.covers_everything() {
                h2 { "Last hour " span.muted { "(per minute, this server)" } }
                // The first data comes with the page (drawn as soon as the
                // scripts run); `/ui/series` refreshes it.
                div #charts data-src="/ui/series" data-series=(series_json(&h)) {}
            }
            @if let Some(cluster) = cluster_html(&h) {
                h2 { "Cluster" }
                div #cluster sse-swap="cluster" { (cluster) }
            }
            h2 { "Locks " span.muted #live { "(live)" } }
            div #locks sse-swap="locks" { (table) }
            h2 { "Recent events" }
            table {
                (events_head())
                tbody #events sse-swap="event" hx-swap="afterbegin" {
                    @for e in events { (audit_row(e)) }
                }
            }
        }
    };
    page("locks", Some(&who), body).into_response()
}

/// The last hour per minute as the JSON `/ui/series` answers.
fn series_json(h: &Handle) -> String {
    let minutes = h.metrics().series.last_hour(crate::audit::wall_ms());
    serde_json::json!({ "minutes": minutes }).to_string()
}

/// `GET /ui/series`: the last hour per minute (grants, wait p50/p99, queued, peak
/// waiters) as JSON for the charts. Whole-server figures, so only for a token
/// that covers every lock, as the health panel's counts.
async fn series_api(State(h): State<Handle>, ext: Extensions) -> Result<Response, ApiError> {
    let who = auth::authorize(&ext, Action::Read, None)?;
    if !who.covers_everything() {
        return Err(ApiError::new(
            ApiErrorKind::PermissionDenied,
            "the charts count every lock; they need a token whose prefixes include every lock",
        ));
    }
    Ok((
        [(header::CONTENT_TYPE, "application/json")],
        series_json(&h),
    )
        .into_response())
}

/// The live stream of a page: `locks` and `health` every [`REFRESH`] and after
/// events, `event` per durable lock event since the stream opened (each once, even
/// when the stream skipped frames), all from the page's shared [`LiveViews`]
/// renderer. Counted against the token's stream quota. Ends when the server drains.
async fn stream(
    State(h): State<Handle>,
    Extension(views): Extension<LiveViews>,
    ext: Extensions,
    params: Result<Query<ListParams>, QueryRejection>,
) -> Result<Response, ApiError> {
    let who = auth::authorize(&ext, Action::Watch, None)?;
    let Query(params) = params.map_err(|e| invalid("query", e.body_text()))?;
    let list = ListQuery::parse(params)?;
    who.ranges(&list.prefix)?;
    let slot = who.open_stream()?;
    let (frames, sent) = views.subscribe(&h, &who, list)?;
    let stream = futures_util::stream::unfold(
        (frames, slot, sent),
        |(mut frames, slot, mut sent)| async move {
            loop {
                match frames.recv().await {
                    Ok(frame) => {
                        let out = frame_events(&frame, &mut sent);
                        return Some((out, (frames, slot, sent)));
                    }
                    // A slow browser skips tables (the next one is whole); the rows of
                    // the skipped frames are in the next frame's `rows` too.
                    Err(RecvError::Lagged(_)) => continue,
                    Err(RecvError::Closed) => return None,
                }
            }
        },
    )
    .flat_map(|out| futures_util::stream::iter(out.into_iter().map(Ok::<_, Infallible>)));
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// The SSE events of `frame` for a stream that has sent the rows before `sent`:
/// the table, health and cluster sections, and the rows it has not sent yet.
fn frame_events(frame: &Frame, sent: &mut u64) -> Vec<SseEvent> {
    let mut out = vec![
        SseEvent::default().event("locks").data(&frame.table),
        SseEvent::default().event("health").data(&frame.health),
    ];
    out.extend(
        frame
            .cluster
            .as_ref()
            .map(|c| SseEvent::default().event("cluster").data(c)),
    );
    for (seq, row) in frame.rows.iter() {
        if *seq >= *sent {
            out.push(SseEvent::default().event("event").data(row));
            *sent = seq + 1;
        }
    }
    out
}

/// Most distinct live views (prefix and token prefixes) rendered at once; a stream
/// of one more is refused with 429 `resource_exhausted`.
pub const MAX_LIVE_VIEWS: usize = 64;
/// Shortest time between two renders of one live view: a burst of changes costs
/// one render per interval, however many changes and viewers.
const MIN_RENDER_INTERVAL: Duration = Duration::from_millis(250);
/// Frames a viewer may fall behind before it skips to the newest.
const FRAMES_BUFFERED: usize = 8;

/// What a live view shows: the list (prefix, sort, filters, page), and the
/// prefixes of the token looking (the rows and counts it may see). Tokens with the
/// same prefixes share a view.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct ViewKey {
    list: ListQuery,
    scope: Vec<String>,
}

/// One render of a live view, sent to every stream of that view.
#[derive(Debug)]
struct Frame {
    table: String,
    health: String,
    /// The cluster section (cluster mode only).
    cluster: Option<String>,
    /// The newest rows of "recent events" (at most [`RECENT_EVENTS`]), oldest first,
    /// each with its number in the view: a stream sends those it has not sent, so a
    /// frame it skipped loses no row.
    rows: Arc<[(u64, String)]>,
}

/// The dashboard's live views: one renderer task per distinct `ViewKey`, which
/// renders the lock table and health panel once per change (at most every
/// `MIN_RENDER_INTERVAL`) and every `REFRESH`, and publishes the result to all
/// the streams of that view, so N viewers cost one render. A renderer stops once
/// its last viewer is gone.
#[derive(Clone, Default)]
pub struct LiveViews {
    views: Arc<Mutex<HashMap<ViewKey, View>>>,
}

/// A rendered view: where its frames go, and how many event rows it has numbered
/// (a new viewer is sent the rows from there on).
#[derive(Clone)]
struct View {
    frames: broadcast::Sender<Arc<Frame>>,
    rows_numbered: Arc<AtomicU64>,
}

impl LiveViews {
    /// The frames of the view of `prefix` for `who`, starting its renderer if no
    /// one is watching it yet, and the number of the first event row this viewer is
    /// to be sent. Every lock event after this call reaches the view: the renderer's
    /// subscription to events is taken here, not when its task first runs. 429
    /// `resource_exhausted` beyond [`MAX_LIVE_VIEWS`].
    fn subscribe(
        &self,
        h: &Handle,
        who: &Principal,
        list: ListQuery,
    ) -> Result<(broadcast::Receiver<Arc<Frame>>, u64), ApiError> {
        let mut scope: Vec<String> = who.prefixes().map(str::to_owned).collect();
        scope.sort_unstable();
        scope.dedup();
        let key = ViewKey { list, scope };
        let mut views = self.views.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(view) = views.get(&key) {
            return Ok((view.frames.subscribe(), view.rows_numbered.load(SeqCst)));
        }
        if views.len() >= MAX_LIVE_VIEWS {
            return Err(ApiError::new(
                ApiErrorKind::ResourceExhausted,
                format!(
                    "the dashboard is rendering {MAX_LIVE_VIEWS} different live views \
                     (prefix and token prefixes) already; watch one of them, or retry later"
                ),
            ));
        }
        let (frames, viewer) = broadcast::channel(FRAMES_BUFFERED);
        let view = View {
            frames,
            rows_numbered: Arc::default(),
        };
        views.insert(key.clone(), view.clone());
        h.metrics()
            .dashboard_views
            .store(views.len() as u64, Relaxed);
        let events = h.subscribe();
        tokio::spawn(render_view(
            self.clone(),
            key,
            h.clone(),
            who.clone(),
            view,
            events,
        ));
        Ok((viewer, 0))
    }

    /// Removes the view `key` if it has no viewer (under the same lock that
    /// [`LiveViews::subscribe`] takes, so no viewer can join a renderer that stops),
    /// or whatever `always` says. Whether it was removed.
    fn retire(
        &self,
        h: &Handle,
        key: &ViewKey,
        frames: &broadcast::Sender<Arc<Frame>>,
        always: bool,
    ) -> bool {
        let mut views = self.views.lock().unwrap_or_else(|e| e.into_inner());
        if !always && frames.receiver_count() > 0 {
            return false;
        }
        if views
            .get(key)
            .is_some_and(|v| v.frames.same_channel(frames))
        {
            views.remove(key);
        }
        h.metrics()
            .dashboard_views
            .store(views.len() as u64, Relaxed);
        true
    }

    /// How many views are being rendered.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.views.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// The renderer of one live view: see [`LiveViews`].
async fn render_view(
    views: LiveViews,
    key: ViewKey,
    h: Handle,
    who: Principal,
    view: View,
    mut events: broadcast::Receiver<SharedEvent>,
) {
    let View {
        frames,
        rows_numbered,
    } = view;
    let mut state = h.watch_state();
    let mut tick = tokio::time::interval(REFRESH);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_render: Option<tokio::time::Instant> = None;
    let mut rows = VecDeque::with_capacity(RECENT_EVENTS + 1);
    // Keeps an event's row, numbered, if the view shows its lock; false once events end.
    let take = |got: Result<SharedEvent, RecvError>, rows: &mut VecDeque<(u64, String)>| match got {
        Ok(e) => {
            if e.name.as_str().starts_with(&key.list.prefix) && who.covers(e.name.as_str()) {
                if let Some(row) = event_row(&e) {
                    rows.push_back((rows_numbered.fetch_add(1, SeqCst), row.into_string()));
                    if rows.len() > RECENT_EVENTS {
                        rows.pop_front();
                    }
                }
            }
            true
        }
        // Missed events: the table, rendered next, shows the state after them.
        Err(RecvError::Lagged(_)) => true,
        Err(RecvError::Closed) => false,
    };
    'views: loop {
        tokio::select! {
            _ = tick.tick() => {}
            got = events.recv() => {
                if !take(got, &mut rows) {
                    break 'views;
                }
                while let Ok(e) = events.try_recv() {
                    take(Ok(e), &mut rows);
                }
            }
            changed = state.changed() => {
                if changed.is_err() || *state.borrow() != RunState::Running {
                    break 'views;
                }
            }
        }
        // A burst of changes: wait out the interval, collecting its events.
        if let Some(last) = last_render {
            let due = last + MIN_RENDER_INTERVAL;
            loop {
                tokio::select! {
                    _ = tokio::time::sleep_until(due) => break,
                    got = events.recv() => {
                        if !take(got, &mut rows) {
                            break 'views;
                        }
                    }
                }
            }
        }
        if views.retire(&h, &key, &frames, false) {
            return;
        }
        let table = match visible_locks(&h, &who, &key.list).await {
            Ok(list) => list_html(&list, &key.list),
            Err(e) => error_p(e.message()),
        };
        let frame = Frame {
            table: table.into_string(),
            health: health(&h, &who).into_string(),
            cluster: cluster_html(&h).map(Markup::into_string),
            rows: rows.iter().cloned().collect(),
        };
        h.metrics().dashboard_renders.fetch_add(1, Relaxed);
        last_render = Some(tokio::time::Instant::now());
        // No receiver: the last viewer just left; the next turn retires the view.
        let _ = frames.send(Arc::new(frame));
    }
    // The server is stopping: the streams end once this sender is gone.
    views.retire(&h, &key, &frames, true);
}

async fn lock_page(
    State(h): State<Handle>,
    ext: Extensions,
    headers: HeaderMap,
    path: Result<Path<String>, PathRejection>,
) -> Response {
    let raw = match path {
        Ok(Path(raw)) => raw,
        Err(e) => {
            return ApiError::new(ApiErrorKind::InvalidArgument, format!("bad path: {e}"))
                .into_response()
        }
    };
    let name = match input::lock_name("name", &raw) {
        Ok(n) => n,
        Err(e) => {
            let body = error_p(e.message());
            return (StatusCode::BAD_REQUEST, page("bad lock name", None, body)).into_response();
        }
    };
    let who = match page_caller(&ext, &headers, Action::Read, Some(name.as_str())) {
        Ok(p) => p,
        Err(r) => return *r,
    };
    let (current, history) = lock_sections(&h, &name).await;
    let admin = who
        .authorize(Action::ForceRelease, Some(name.as_str()))
        .is_ok();
    let body = html! {
        p { a href="/" { "← all locks" } }
        h2 { "Now" }
        div #lock-now { (current) }
        @if admin {
            h2 { "Force release" }
            form #force-release hx-post="/ui/force-release" hx-target="#force-result"
                hx-confirm={
                    "Force-release " (name.as_str())
                    "? Its holders lose it; the next grant gets a larger fence."
                } {
                input type="hidden" name="name" value=(name.as_str());
                label {
                    "Reason "
                    input type="text" name="reason" required maxlength="1024"
                        placeholder="why (recorded in the audit log)";
                }
                " "
                button type="submit" { "Force release" }
            }
            div #force-result {}
        }
        h2 { "History " span.muted { "(audit log, newest first, at most " (HISTORY_ROWS) ")" } }
        div #history { (history) }
    };
    page(name.as_str(), Some(&who), body).into_response()
}

/// The holders and waiters of a lock, as its page shows them.
fn lock_now(view: &LockView, now_wall_ms: u64) -> Markup {
    let since = |ago_ms: u64| utc(now_wall_ms.saturating_sub(ago_ms));
    html! {
        p {
            @if view.limit > 1 { "Admits " (view.limit) " holders. " }
            @if view.lock_delay_remaining_ms > 0 {
                "In lock-delay for " (dur(view.lock_delay_remaining_ms)) ". "
            }
        }
        @for h in view.holders.iter().filter(|h| h.value.is_some()) {
            p #election {
                "Election leader: " span.owner { (h.owner.as_str()) }
                ", term " b { (h.fence.get()) } ", value "
                code.value { (h.value.as_ref().map(|v| v.as_str()).unwrap_or_default()) }
            }
        }
        h3 { "Holders" }
        table #holders {
            thead { tr {
                th { "Owner" } th { "Mode" } th { "Fence" } th { "Held since (UTC)" }
                th { "Held for" } th { "Expires in" }
            } }
            tbody {
                @if view.holders.is_empty() {
                    tr { td.muted colspan="6" { "free" } }
                }
                @for h in &view.holders {
                    tr data-lock=(view.name.as_str()) {
                        td.owner { (h.owner.as_str()) }
                        td.mode { (h.mode.as_str()) }
                        td.num.fence { (h.fence.get()) }
                        td { (since(h.held_ms)) }
                        td.num { (dur(h.held_ms)) }
                        td.num { (dur(h.ttl_remaining_ms)) }
                    }
                }
            }
        }
        h3 { "Waiters " span.muted #waiter-count {
            "(" (grouped(view.waiters)) " queued: "
            (grouped(view.waiters - view.shared_waiters)) " exclusive, "
            (grouped(view.shared_waiters)) " shared)"
        } }
        table #waiters {
            thead { tr {
                th { "Position" } th { "Owner" } th { "Mode" } th { "Waiting since (UTC)" }
                th { "Waited" }
            } }
            tbody {
                @if view.waiting.is_empty() {
                    tr { td.muted colspan="5" { "nobody is waiting" } }
                }
                @for w in &view.waiting {
                    tr.waiter {
                        td.num { (w.position + 1) }
                        td.owner { (w.owner.as_str()) }
                        td.mode { (w.mode.as_str()) }
                        td { (since(w.waiting_ms)) }
                        td.num { (dur(w.waiting_ms)) }
                    }
                }
            }
        }
        @if view.waiters > view.waiting.len() {
            p.muted { "The first " (view.waiting.len()) " of " (grouped(view.waiters)) " waiters." }
        }
    }
}

/// The "now" section and the history table of a lock's page.
async fn lock_sections(h: &Handle, name: &LockName) -> (Markup, Markup) {
    let current = match h.lock(name.clone()).await {
        Ok(Some(view)) => lock_now(&view, crate::audit::wall_ms()),
        Ok(None) => html! { p.muted { "Not held, queued for or in lock-delay." } },
        Err(e) => error_p(e.message()),
    };
    let entries = h.audit(&AuditQuery {
        lock: Some(name.as_str().to_owned()),
        ..AuditQuery::newest(HISTORY_ROWS)
    });
    let history = html! {
        table {
            (events_head())
            tbody {
                @for e in entries.iter().rev() { (audit_row(e)) }
                @if entries.is_empty() {
                    tr {
                        td.muted colspan="6" {
                            "no audit entries (retention may have dropped them)"
                        }
                    }
                }
            }
        }
        @if entries.len() == HISTORY_ROWS {
            p.muted {
                "The newest " (HISTORY_ROWS) " entries; older ones: "
                code { "GET /v1/audit?lock=…" } "."
            }
        }
    };
    (current, history)
}

#[derive(Deserialize)]
struct ForceForm {
    name: String,
    reason: String,
    #[serde(default)]
    fence: String,
}

async fn force_release_form(
    State(h): State<Handle>,
    ext: Extensions,
    form: Result<Form<ForceForm>, FormRejection>,
) -> Response {
    let fragment = |status: StatusCode, class: &str, text: &str| {
        (
            status,
            Html(html! { p class=(class) { (text) } }.into_string()),
        )
            .into_response()
    };
    let Ok(Form(form)) = form else {
        return fragment(
            StatusCode::BAD_REQUEST,
            "error",
            "expected a form with name and reason",
        );
    };
    let name = match LockName::new(&form.name) {
        Ok(n) => n,
        Err(e) => return fragment(StatusCode::BAD_REQUEST, "error", &format!("name: {e}")),
    };
    let allowed = auth::authorize(&ext, Action::ForceRelease, Some(name.as_str()))
        .and_then(|p| p.take_request().map(|()| p));
    let who = match allowed {
        Ok(p) => p,
        Err(e) => {
            let status =
                StatusCode::from_u16(e.kind().http_status()).unwrap_or(StatusCode::FORBIDDEN);
            return fragment(status, "error", e.message());
        }
    };
    let reason = match Reason::new(form.reason.trim()) {
        Ok(r) => r,
        Err(e) => return fragment(StatusCode::BAD_REQUEST, "error", &format!("reason: {e}")),
    };
    let fence = match form.fence.trim() {
        "" => None,
        f => match f.parse::<u64>().ok().and_then(Fence::new) {
            Some(f) => Some(f),
            None => {
                return fragment(
                    StatusCode::BAD_REQUEST,
                    "error",
                    "fence: must be a number of at least 1",
                )
            }
        },
    };
    match h
        .force_release(
            &crate::engine::Requester::of(&who),
            name.clone(),
            fence,
            reason,
        )
        .await
    {
        Ok(fences) if fences.is_empty() => fragment(
            StatusCode::OK,
            "muted",
            &format!("{name} had no holder to release."),
        ),
        Ok(fences) => {
            let list: Vec<String> = fences.iter().map(|f| f.get().to_string()).collect();
            // The lock page's "now" and history sections are replaced too (htmx
            // out-of-band swaps), so the page shows the result of the action.
            let (current, history) = lock_sections(&h, &name).await;
            let markup = html! {
                p.ok { "Force-released " (name.as_str()) " (fence " (list.join(", ")) ")." }
                div #lock-now hx-swap-oob="true" { (current) }
                div #history hx-swap-oob="true" { (history) }
            };
            Html(markup.into_string()).into_response()
        }
        Err(e) => {
            let status =
                StatusCode::from_u16(e.kind().http_status()).unwrap_or(StatusCode::BAD_REQUEST);
            fragment(status, "error", e.message())
        }
    }
}

/// The query of `GET /v1/audit`.
#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct AuditParams {
    /// Only entries about this lock.
    lock: Option<String>,
    /// Only entries committed at or after this wall-clock time, in milliseconds since
    /// the Unix epoch (an entry's `time_ms`; default 0: all that are retained).
    since_ms: Option<u64>,
    /// Only entries committed at or before this wall-clock time, in milliseconds since
    /// the Unix epoch (default: up to now).
    until_ms: Option<u64>,
    /// Only entries of these kinds, comma-separated (`granted,force_released`). The
    /// audit log's old names are accepted too: `grant` (direct grants only),
    /// `handoff` (hand-offs only), `release`, `expiry`, `forced_release`,
    /// `session_end`, `downgrade`, `proclaim`.
    kind: Option<String>,
    /// At most this many, the newest ones, 1–1000 (default 100).
    limit: Option<usize>,
}

/// One audit entry on the wire: its place in the log (`seq`), the event fields shared
/// with watch ([`EventFields`]), what only the audit log records, and `lock`, the name
/// it had before the vocabulary (the same as `name`), kept for existing readers.
#[derive(Serialize, utoipa::ToSchema)]
#[schema(as = AuditEntry)]
pub(crate) struct AuditJson {
    /// Its place in the audit log (increasing).
    seq: u64,
    /// The fields every event has.
    #[serde(flatten)]
    fields: EventFields,
    /// The acquire's idempotency key.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    request_id: Option<String>,
    /// Who made the change (a token name, or `server`).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    actor: Option<String>,
    /// More about it, for people.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    detail: Option<String>,
    /// Deprecated: the same as `name`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false, deprecated)]
    lock: Option<String>,
}

/// `GET /v1/audit`.
#[derive(Serialize, utoipa::ToSchema)]
#[schema(as = AuditPage)]
pub(crate) struct AuditPageJson {
    /// The entries, newest last.
    entries: Vec<AuditJson>,
}

impl From<AuditEntry> for AuditJson {
    fn from(e: AuditEntry) -> AuditJson {
        let event = e.kind.event();
        AuditJson {
            seq: e.seq,
            fields: EventFields {
                kind: event.name(),
                handoff: (event == VocabEvent::Granted).then_some(e.kind.is_handoff()),
                name: e.lock.clone(),
                fence: e.fence,
                owner: e.owner,
                session: e.session,
                mode: None,
                value: None,
                time: rfc3339(e.wall_ms),
                time_ms: e.wall_ms,
                duration_ms: e.duration_ms,
                reason: e.reason,
                wait_end: None,
            },
            request_id: e.request_id,
            actor: e.actor,
            detail: e.detail,
            lock: e.lock,
        }
    }
}

/// The audit log: entries, newest last (role `reader`).
#[utoipa::path(get, path = "/v1/audit", tag = "audit",
    params(AuditParams),
    responses(
        (status = 200, description = "The entries.", body = AuditPageJson),
        crate::error::CommonErrors,
    ))]
pub(crate) async fn audit_api(
    State(h): State<Handle>,
    ext: Extensions,
    params: Result<Query<AuditParams>, QueryRejection>,
) -> Result<Json<AuditPageJson>, ApiError> {
    let Query(p) = params.map_err(|e| invalid("query", e.body_text()))?;
    let lock = p
        .lock
        .as_deref()
        .map(|l| input::lock_name("lock", l))
        .transpose()?;
    let who = auth::authorize(&ext, Action::Audit, lock.as_ref().map(LockName::as_str))?;
    let kinds = p
        .kind
        .as_deref()
        .map(KindFilter::parse_list)
        .transpose()
        .map_err(|e| invalid("kind", e))?
        .unwrap_or_default();
    let limit = p.limit.unwrap_or(100);
    if limit == 0 || limit > MAX_AUDIT_PAGE {
        return Err(invalid(
            "limit",
            format!("must be between 1 and {MAX_AUDIT_PAGE}"),
        ));
    }
    let entries = visible_audit(
        &h,
        &who,
        &AuditQuery {
            lock: lock.map(|l| l.as_str().to_owned()),
            since_wall_ms: p.since_ms.unwrap_or(0),
            until_wall_ms: p.until_ms.unwrap_or(u64::MAX),
            kinds,
            limit,
        },
    );
    let entries: Vec<AuditJson> = entries.into_iter().map(AuditJson::from).collect();
    Ok(Json(AuditPageJson { entries }))
}

/// Content-Security-Policy of the dashboard: scripts only from this server (the
/// vendored htmx), no framing (a force-release button cannot be clickjacked), forms
/// and event streams only to this server.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
style-src 'self' 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; \
form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// Security headers on every dashboard answer (defence in depth behind the
/// templates' escaping).
async fn security_headers(mut response: Response) -> Response {
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    if !h.contains_key(header::CACHE_CONTROL) {
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    response
}

/// The dashboard's routes and `GET /v1/audit`, to merge into the API router.
pub fn routes() -> Router<Handle> {
    let pages = Router::new()
        .route("/", get(index))
        .route("/ui/login", get(login_form).post(login))
        .route("/ui/logout", post(logout))
        .route("/ui/assets/{file}", get(asset))
        .route("/ui/stream", get(stream))
        .route("/ui/series", get(series_api))
        .route("/ui/lock/{*name}", get(lock_page))
        .route("/ui/force-release", post(force_release_form))
        .layer(Extension(LiveViews::default()))
        .layer(axum::middleware::map_response(security_headers));
    pages.route("/v1/audit", get(audit_api))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_escape_markup_and_quotes() {
        let evil = "<script>alert('x')</script>&\"";
        assert_eq!(
            lock_link(evil).into_string(),
            "<a class=\"lock\" href=\"/ui/lock/%3Cscript%3Ealert%28%27x%27%29%3C%2Fscript%3E%26%22\">\
&lt;script&gt;alert('x')&lt;/script&gt;&amp;&quot;</a>"
        );
        assert_eq!(url("a b/<c>"), "a%20b%2F%3Cc%3E");
        assert_eq!(url("tenant:job-1_x.y~z"), "tenant:job-1_x.y~z");
        let page = page(evil, None, error_p(evil)).0;
        assert!(!page.contains("<script>alert"), "{page}");
        assert!(
            page.contains(
                "<p class=\"error\">&lt;script&gt;alert('x')&lt;/script&gt;&amp;&quot;</p>"
            ),
            "{page}"
        );
    }

    #[test]
    fn formats_times_and_durations() {
        assert_eq!(utc(0), "1970-01-01 00:00:00.000");
        assert_eq!(utc(1_772_454_645_123), "2026-03-02 12:30:45.123");
        assert_eq!(utc(951_782_400_007), "2000-02-29 00:00:00.007");
        assert_eq!(rfc3339(1_772_454_645_120), "2026-03-02T12:30:45.120Z");
        // Past year 9999: text, not a panic.
        assert_eq!(utc(u64::MAX), format!("{} ms after 1970", u64::MAX));
        assert_eq!(dur(0), "0ms");
        assert_eq!(dur(850), "850ms");
        assert_eq!(dur(12_345), "12s300ms");
        assert_eq!(dur(245_999), "4m5s");
        assert_eq!(dur(7_380_000), "2h3m");
    }

    #[test]
    fn the_token_cookie_is_http_only_strict_and_secure_over_https() {
        let plain = token_cookie("flk_abc", false).to_string();
        assert!(plain.starts_with("fencelock_token=flk_abc;"), "{plain}");
        for attribute in ["; HttpOnly", "; SameSite=Strict", "; Path=/"] {
            assert!(plain.contains(attribute), "{plain}");
        }
        assert!(!plain.contains("Secure"), "{plain}");
        assert!(token_cookie("flk_abc", true)
            .to_string()
            .contains("; Secure"));
        let mut headers = HeaderMap::new();
        headers.insert(
            header::COOKIE,
            HeaderValue::from_static("a=1; fencelock_token=x"),
        );
        assert!(has_token_cookie(&headers));
        headers.insert(
            header::COOKIE,
            HeaderValue::from_static("fencelock_tokenx=1; b"),
        );
        assert!(!has_token_cookie(&headers));
    }

    #[test]
    fn the_cluster_section_lists_members_escaped_and_links_only_http() {
        use crate::cluster::api::{ClusterView, MemberView};
        let member = |id: u64, url: Option<&str>, role, matched: Option<u64>, lag| MemberView {
            id,
            url: url.map(str::to_owned),
            peer_addr: format!("127.0.0.1:752{id}"),
            role,
            matched_index: matched,
            lag,
        };
        let leader_view = ClusterView {
            node_id: 1,
            role: "leader",
            term: 7,
            leader: Some(crate::cluster::LeaderInfo {
                id: 1,
                url: "http://10.0.0.1:7420/?a=1&b=\"<x>".into(),
            }),
            last_log_index: Some(42),
            members: vec![
                member(
                    1,
                    Some("http://10.0.0.1:7420/?a=1&b=\"<x>"),
                    "leader",
                    Some(42),
                    Some(0),
                ),
                member(
                    2,
                    Some("javascript:alert(1)"),
                    "follower",
                    Some(40),
                    Some(2),
                ),
                member(3, None, "learner", Some(0), Some(42)),
            ],
        };
        let html = cluster_section(&leader_view).into_string();
        assert!(
            html.contains("member <b>1</b>, <b>leader</b>, term <b>7</b>"),
            "{html}"
        );
        assert!(
            html.contains("<a href=\"http://10.0.0.1:7420/?a=1&amp;b=&quot;&lt;x&gt;\">"),
            "{html}"
        );
        assert!(
            !html.contains("<x>") && !html.contains("href=\"javascript"),
            "{html}"
        );
        for (id, tail) in [
            (1, "42</td><td class=\"num\">0</td>"),
            (2, "40</td><td class=\"num\">2</td>"),
            (3, "0</td><td class=\"num\">42</td>"),
        ] {
            let row = html
                .split("<tr data-member=")
                .find(|r| r.starts_with(&format!("\"{id}\"")))
                .unwrap_or_else(|| panic!("no row for member {id}: {html}"));
            assert!(row.contains(tail), "member {id}: {row}");
        }
        assert!(!html.contains("known on the leader only"), "{html}");

        // A follower knows no replication progress, and may know no leader.
        let follower_view = ClusterView {
            node_id: 2,
            role: "follower",
            leader: None,
            last_log_index: None,
            members: leader_view
                .members
                .iter()
                .map(|m| MemberView {
                    matched_index: None,
                    lag: None,
                    ..m.clone()
                })
                .collect(),
            ..leader_view
        };
        let html = cluster_section(&follower_view).into_string();
        assert!(
            html.contains("Leader: <span class=\"error\">none known</span>"),
            "{html}"
        );
        assert!(html.contains("known on the leader only"), "{html}");
        assert_eq!(html.matches("<tr data-member=").count(), 3, "{html}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_single_server_has_no_cluster_section() {
        let (h, _dir) = engine();
        assert!(cluster_html(&h).is_none());
        let page = index(
            State(h.clone()),
            anonymous_admin(),
            HeaderMap::new(),
            Ok(Query(ListParams::default())),
        )
        .await;
        let body = axum::body::to_bytes(page.into_body(), 1 << 20)
            .await
            .unwrap();
        let html = String::from_utf8_lossy(&body);
        assert!(html.contains("<h2>Health</h2>"), "{html}");
        assert!(
            !html.contains("Cluster") && !html.contains("cluster-table"),
            "{html}"
        );
        h.shutdown().await;
    }

    /// The chart library is served from the binary under its version, cached for
    /// good; the page links exactly that path.
    #[tokio::test]
    async fn the_chart_library_is_served_versioned_and_cached_for_good() {
        for (path, kind) in [
            (UPLOT_JS_PATH, "text/javascript"),
            (UPLOT_CSS_PATH, "text/css"),
        ] {
            let file = path.strip_prefix("/ui/assets/").unwrap().to_owned();
            let r = asset(Path(file)).await;
            assert_eq!(r.status(), StatusCode::OK, "{path}");
            let h = r.headers();
            assert!(h[header::CONTENT_TYPE].to_str().unwrap().starts_with(kind));
            assert_eq!(
                h[header::CACHE_CONTROL],
                "public, max-age=31536000, immutable",
                "{path}"
            );
        }
        let r = asset(Path("dashboard.js".to_owned())).await;
        assert_eq!(r.headers()[header::CACHE_CONTROL], "public, max-age=3600");
        let html = page("x", None, html! {}).0;
        assert!(html.contains(&format!("src=\"{UPLOT_JS_PATH}\"")), "{html}");
        assert!(
            html.contains(&format!("href=\"{UPLOT_CSS_PATH}\"")),
            "{html}"
        );
    }

    #[test]
    fn the_list_query_is_validated_and_round_trips_through_its_links() {
        let p = |sort: &str, contended: &str, held_over: &str, page: &str| ListParams {
            prefix: "job:".into(),
            sort: sort.into(),
            contended: contended.into(),
            held_over: held_over.into(),
            page: page.into(),
        };
        let q = ListQuery::parse(p("held", "on", "1m 30s", "3")).unwrap();
        assert_eq!(
            (q.sort, q.contended, q.held_over_ms, q.page),
            (Sort::Held, true, 90_000, 3)
        );
        assert_eq!(
            q.href(4),
            "/?prefix=job:&sort=held&contended=on&held_over=90000ms&page=4"
        );
        for bad in [
            p("sideways", "", "", ""),
            p("", "maybe", "", ""),
            p("", "", "soon", ""),
            p("", "", "", "0"),
            p("", "", "", "-1"),
        ] {
            let e = ListQuery::parse(bad).unwrap_err();
            assert_eq!(e.kind(), ApiErrorKind::InvalidArgument, "{e}");
        }
        assert_eq!(grouped(0), "0");
        assert_eq!(grouped(999), "999");
        assert_eq!(grouped(5_004), "5,004");
        assert_eq!(grouped(1_234_567), "1,234,567");
    }

    #[test]
    fn cookie_values_cannot_inject_attributes() {
        assert!(cookie_safe("flk_abcDEF-123_x"));
        assert!(!cookie_safe("abc; Domain=evil"));
        assert!(!cookie_safe("a b"));
        assert!(!cookie_safe(""));
    }

    fn engine() -> (Handle, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let mut config = crate::engine::EngineConfig::new(dir.path());
        config.durability = crate::engine::Durability::None;
        (crate::engine::start(config).unwrap(), dir)
    }

    /// A request's extensions as the auth layer leaves them with authentication off.
    fn anonymous_admin() -> Extensions {
        let mut ext = Extensions::new();
        ext.insert(Principal::anonymous());
        ext
    }

    async fn acquire(h: &Handle, name: &str) {
        let anonymous = crate::engine::Requester::anonymous();
        h.acquire(
            &anonymous,
            crate::engine::AcquireArgs {
                name: LockName::new(name).unwrap(),
                ttl_ms: Some(600_000),
                wait_ms: 0,
                owner: fencelock_core::Owner::default(),
                request_id: None,
                limit: 1,
                lock_delay_ms: 0,
                session: None,
                mode: Default::default(),
                value: None,
            },
        )
        .await
        .unwrap();
    }

    /// Issue 19 item 4: every `/ui/stream` rendered the lock table itself, so N
    /// viewers cost N renders per change. Now the viewers of one view share its
    /// renders: with 40 viewers and 20 changes there are about as many renders as
    /// changes (plus one a second), not 40 × 20. With the sharing taken out (a
    /// renderer per stream, as before) it counted 80 renders and failed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn viewers_of_one_view_share_its_renders() {
        const VIEWERS: usize = 40;
        const CHANGES: usize = 20;
        let (h, _dir) = engine();
        let views = LiveViews::default();
        let who = Principal::anonymous();
        let started = std::time::Instant::now();
        let mut viewers: Vec<_> = (0..VIEWERS)
            .map(|_| {
                views
                    .subscribe(&h, &who, ListQuery::of_prefix("job:".to_owned()))
                    .unwrap()
                    .0
            })
            .collect();
        assert_eq!(views.len(), 1);
        for i in 0..CHANGES {
            acquire(&h, &format!("job:{i:02}")).await;
        }
        let last = format!("job:{:02}", CHANGES - 1);
        // Every viewer gets a frame that shows the last change (bounded wait).
        for viewer in &mut viewers {
            loop {
                let frame = tokio::time::timeout(Duration::from_secs(10), viewer.recv())
                    .await
                    .expect("a frame within 10 s")
                    .expect("the view is live");
                if frame.table.contains(&last) {
                    break;
                }
            }
        }
        let renders = h.metrics().dashboard_renders.load(Relaxed);
        // One render per change at most, and one per REFRESH tick.
        let bound = CHANGES as u64 + 2 + started.elapsed().as_secs();
        println!("{VIEWERS} viewers, {CHANGES} changes: {renders} renders (bound {bound})");
        assert!(renders <= bound, "{renders} renders for {CHANGES} changes");

        // The renderer stops once its last viewer is gone.
        drop(viewers);
        for _ in 0..50 {
            if views.len() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(
            views.len(),
            0,
            "the renderer of a view nobody watches stopped"
        );
        assert_eq!(h.metrics().dashboard_views.load(Relaxed), 0);
    }

    /// Issue 32: a stream opened before a lock is taken must send that lock's event
    /// row. The renderer subscribed to events only when its task first ran, so under
    /// load an event published between the stream's answer and that first run was
    /// never shown (CI saw `dashboard_escaping` time out waiting for `event: event`).
    /// Here the renderer's runtime is not driven until the grant is done, which is
    /// that schedule made certain: before the fix no frame had the row.
    #[test]
    fn an_event_right_after_the_stream_opens_reaches_it() {
        let engine_rt = tokio::runtime::Runtime::new().unwrap();
        let (h, _dir) = engine_rt.block_on(async { engine() });
        let views_rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let views = LiveViews::default();
        let who = Principal::anonymous();
        let (mut viewer, sent) = {
            let _in_views_rt = views_rt.enter();
            views
                .subscribe(&h, &who, ListQuery::of_prefix("job:".to_owned()))
                .unwrap()
        };
        assert_eq!(sent, 0);
        // The grant, while the renderer's task has not run once.
        engine_rt.block_on(acquire(&h, "job:first"));
        let row = views_rt.block_on(async {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            let mut sent = sent;
            loop {
                let frame = tokio::time::timeout_at(deadline, viewer.recv())
                    .await
                    .expect("the grant's row within 5 s (3 tables a second)")
                    .expect("the view is live");
                let events = frame_events(&frame, &mut sent);
                if events.len() > 2 {
                    return frame.rows[0].1.clone();
                }
            }
        });
        assert!(row.contains("job:first"), "{row}");
    }

    /// A stream that skipped frames (a slow browser) still sends every row once: the
    /// rows of a skipped frame are in the next one, and none is sent twice.
    #[test]
    fn skipped_frames_lose_no_row_and_repeat_none() {
        let frame = |rows: &[(u64, &str)]| Frame {
            table: String::new(),
            health: String::new(),
            cluster: None,
            rows: rows.iter().map(|(n, r)| (*n, r.to_string())).collect(),
        };
        let rows_sent = |f: &Frame, sent: &mut u64| frame_events(f, sent).len() - 2;
        let mut sent = 0;
        assert_eq!(rows_sent(&frame(&[(0, "a")]), &mut sent), 1);
        // Frame 2 (rows a, b) skipped; frame 3 has a, b, c: b and c are new.
        assert_eq!(
            rows_sent(&frame(&[(0, "a"), (1, "b"), (2, "c")]), &mut sent),
            2
        );
        assert_eq!(rows_sent(&frame(&[(1, "b"), (2, "c")]), &mut sent), 0);
        assert_eq!(sent, 3);
        // A viewer that joined at row 5 gets none before it.
        let mut late = 5;
        assert_eq!(rows_sent(&frame(&[(4, "e"), (5, "f")]), &mut late), 1);
    }

    /// Distinct views are bounded: each costs a renderer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn distinct_views_are_bounded() {
        let (h, _dir) = engine();
        let views = LiveViews::default();
        let who = Principal::anonymous();
        let _viewers: Vec<_> = (0..MAX_LIVE_VIEWS)
            .map(|i| {
                views
                    .subscribe(&h, &who, ListQuery::of_prefix(format!("p{i}:")))
                    .unwrap()
                    .0
            })
            .collect();
        let e = views
            .subscribe(&h, &who, ListQuery::of_prefix("one-more:".to_owned()))
            .unwrap_err();
        assert_eq!(e.kind(), ApiErrorKind::ResourceExhausted, "{e}");
        // Another viewer of a view already rendered is fine.
        assert!(views
            .subscribe(&h, &who, ListQuery::of_prefix("p0:".to_owned()))
            .is_ok());
    }
}
