//! The operator dashboard at `/` and the audit query API `GET /v1/audit`.
//!
//! Server-rendered HTML (hand-written templates: every value that comes from a
//! user, such as lock names, owners and reasons, goes through [`esc`]), made live
//! with the vendored htmx and its SSE extension (`assets/`, served from
//! `/ui/assets/`; no build step, nothing from a CDN). One SSE stream per page
//! (`/ui/stream`) pushes the lock table and the health panel every second and at
//! once after each durable lock event, and each event as a row of "recent events".
//!
//! Authorization: every page and stream calls [`auth::authorize`] (fails closed);
//! with no tokens configured every caller is the anonymous admin. Browsers sign in
//! with the form at `/ui/login`, which sets the `fencelock_token` cookie (HttpOnly,
//! SameSite=Strict); state-changing requests authenticated by that cookie must be
//! same-origin (checked by the auth layer). Force-release needs the admin role and a
//! reason, is confirmed in the browser (`hx-confirm`), and is recorded in the audit
//! log with the caller's token name as actor.

use std::collections::HashMap;
use std::convert::Infallible;
use std::fmt::Write as _;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::rejection::{FormRejection, PathRejection, QueryRejection};
use axum::extract::{Extension, Form, Path, Query, State};
use axum::http::{header, Extensions, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use fencelock_core::{Event, EventKind, Fence, GrantEnd, LockName, LockView, Reason};
use futures_util::StreamExt;
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
/// Most locks shown on the dashboard at once.
pub const MAX_DASHBOARD_LOCKS: usize = 500;
/// Recent events shown when a page loads.
const RECENT_EVENTS: usize = 50;
/// How often the live view re-renders the lock table (lease countdowns, health).
const REFRESH: Duration = Duration::from_secs(1);

const HTMX_JS: &str = include_str!("../assets/htmx.min.js");
const HTMX_SSE_JS: &str = include_str!("../assets/htmx-ext-sse.min.js");
const STYLE: &str = "body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}\
h1{font-size:1.3em;margin:0}h2{font-size:1.1em;margin:1.2em 0 .4em}\
header{display:flex;gap:1em;align-items:baseline;justify-content:space-between}\
table{border-collapse:collapse;width:100%}th,td{text-align:left;padding:.25em .6em;border-bottom:1px solid #ddd}\
th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}\
.health{display:flex;flex-wrap:wrap;gap:.5em 1.5em}.health div b{display:block;font-size:1.2em}\
.muted{color:#777}.error{color:#b00}.ok{color:#070}form.inline{display:inline}\
input[type=text],input[type=password]{padding:.3em;min-width:18em}button{padding:.3em .8em}\
.kind-forced_release{color:#b00;font-weight:bold}.kind-expiry{color:#a60}";

/// HTML-escapes text for element content and quoted attribute values.
pub fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Percent-encodes text for a URL path segment or query value.
fn url(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~:".contains(&b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// A duration in ms as short text: `850 ms`, `12.3 s`, `4 m 05 s`, `2 h 03 m`.
fn dur(ms: u64) -> String {
    match ms {
        0..=999 => format!("{ms} ms"),
        1_000..=59_999 => format!("{:.1} s", ms as f64 / 1000.0),
        60_000..=3_599_999 => format!("{} m {:02} s", ms / 60_000, ms / 1000 % 60),
        _ => format!("{} h {:02} m", ms / 3_600_000, ms / 60_000 % 60),
    }
}

/// Milliseconds since the Unix epoch as `YYYY-MM-DD HH:MM:SS.mmm` UTC.
pub fn utc(wall_ms: u64) -> String {
    let secs = wall_ms / 1000;
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}.{:03}",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        wall_ms % 1000
    )
}

fn page(title: &str, who: Option<&Principal>, body: &str) -> Html<String> {
    let user = match who {
        Some(p) if !p.is_anonymous() => format!(
            "<span>signed in as <b>{}</b> ({}) <form class=\"inline\" method=\"post\" action=\"/ui/logout\"><button>sign out</button></form></span>",
            esc(p.name()),
            esc(p.role().as_str())
        ),
        Some(_) => "<span class=\"muted\">authentication off (loopback only)</span>".to_owned(),
        None => String::new(),
    };
    Html(format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
<meta name=\"viewport\" content=\"width=device-width\"><title>{} · fencelock</title>\
<style>{STYLE}</style><script src=\"/ui/assets/htmx.min.js\"></script>\
<script src=\"/ui/assets/htmx-ext-sse.min.js\"></script></head>\
<body hx-ext=\"sse\"><header><h1><a href=\"/\">fencelock</a> · {}</h1>{user}</header>\n{body}\n</body></html>",
        esc(title),
        esc(title)
    ))
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
                let body = format!("<p class=\"error\">{}</p>", esc(e.message()));
                let mut r = page("not allowed", None, &body).into_response();
                *r.status_mut() = StatusCode::FORBIDDEN;
                r
            }
        })
    })
}

fn has_token_cookie(headers: &HeaderMap) -> bool {
    headers.get_all(header::COOKIE).iter().any(|v| {
        v.to_str().is_ok_and(|v| {
            v.split(';')
                .any(|p| p.trim().starts_with(&format!("{}=", auth::TOKEN_COOKIE)))
        })
    })
}

fn login_page(message: Option<&str>) -> Html<String> {
    let message = message
        .map(|m| format!("<p class=\"error\">{}</p>", esc(m)))
        .unwrap_or_default();
    page(
        "sign in",
        None,
        &format!(
            "{message}<form method=\"post\" action=\"/ui/login\"><p><label>Token <input type=\"password\" name=\"token\" autocomplete=\"off\" required></label> \
<button>Sign in</button></p><p class=\"muted\">A token from the server's config (<code>fencelock token new</code>). It is kept in an HttpOnly cookie.</p></form>"
        ),
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
    let cookie = format!(
        "{}={token}; Path=/; HttpOnly; SameSite=Strict{}",
        auth::TOKEN_COOKIE,
        if https { "; Secure" } else { "" }
    );
    let mut r = Redirect::to("/").into_response();
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r
}

async fn logout() -> Response {
    let mut r = Redirect::to("/ui/login").into_response();
    r.headers_mut().insert(
        header::SET_COOKIE,
        HeaderValue::from_str(&format!(
            "{}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0",
            auth::TOKEN_COOKIE
        ))
        .expect("a valid header"),
    );
    r
}

async fn asset(Path(file): Path<String>) -> Response {
    let body = match file.as_str() {
        "htmx.min.js" => HTMX_JS,
        "htmx-ext-sse.min.js" => HTMX_SSE_JS,
        _ => return ApiError::new(ApiErrorKind::NotFound, "no such asset").into_response(),
    };
    (
        [
            (header::CONTENT_TYPE, "text/javascript; charset=utf-8"),
            (header::CACHE_CONTROL, "public, max-age=3600"),
        ],
        body,
    )
        .into_response()
}

#[derive(Deserialize)]
struct PrefixParams {
    #[serde(default)]
    prefix: String,
}

/// Locks under `prefix` that the caller may see, in name order.
async fn visible_locks(
    h: &Handle,
    who: &Principal,
    prefix: &str,
) -> Result<Vec<LockView>, ApiError> {
    let mut out = Vec::new();
    for range in who.ranges(prefix)? {
        let left = MAX_DASHBOARD_LOCKS.saturating_sub(out.len());
        if left == 0 {
            break;
        }
        out.extend(h.locks(range, None, left).await?);
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

fn lock_link(name: &str) -> String {
    format!(
        "<a class=\"lock\" href=\"/ui/lock/{}\">{}</a>",
        url(name),
        esc(name)
    )
}

fn locks_table(views: &[LockView]) -> String {
    let mut s = String::from(
        "<table id=\"lock-table\"><thead><tr><th>Lock</th><th>Owner</th><th>Fence</th><th>Held</th>\
<th>Lease left</th><th>Waiters</th><th>Lock-delay left</th></tr></thead><tbody>",
    );
    if views.is_empty() {
        s.push_str("<tr><td colspan=\"7\" class=\"muted\">no locks held, queued for or in lock-delay</td></tr>");
    }
    for v in views {
        let name = v.name.as_str();
        let delay = if v.lock_delay_remaining_ms > 0 {
            dur(v.lock_delay_remaining_ms)
        } else {
            "—".to_owned()
        };
        if v.holders.is_empty() {
            let _ = write!(
                s,
                "<tr data-lock=\"{}\"><td>{}</td><td class=\"muted\">free</td><td></td><td></td><td></td><td class=\"num\">{}</td><td>{}</td></tr>",
                esc(name),
                lock_link(name),
                v.waiters,
                delay
            );
        }
        for h in &v.holders {
            let _ = write!(
                s,
                "<tr data-lock=\"{}\"><td>{}{}</td><td class=\"owner\">{}</td><td class=\"num fence\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td></tr>",
                esc(name),
                lock_link(name),
                if v.limit > 1 { format!(" <span class=\"muted\">(limit {})</span>", v.limit) } else { String::new() },
                esc(h.owner.as_str()),
                h.fence.get(),
                dur(h.held_ms),
                dur(h.ttl_remaining_ms),
                v.waiters,
                delay
            );
        }
    }
    s.push_str("</tbody></table>");
    s
}

/// The health panel. The counts are the whole server's, so a token limited to some
/// prefixes sees only the state and uptime (issue 19: a tenant must not learn how
/// many locks, sessions and waiters the others have).
fn health(h: &Handle, who: &Principal) -> String {
    let state = match h.state() {
        RunState::Running => "running".to_owned(),
        other => format!("{other:?}"),
    };
    if !who.covers_everything() {
        return format!(
            "<div class=\"health\" id=\"health-panel\"><div>state<b>{}</b></div><div>uptime<b>{}</b></div>\
<div class=\"muted\">Counts cover every lock; they need a token whose prefixes include every lock.</div></div>",
            esc(&state),
            dur(h.uptime().as_millis() as u64),
        );
    }
    let m = h.metrics();
    // A cluster member syncs the Raft log instead of the command log.
    let sync = if h.cluster().is_some() {
        &*m.cluster.log_sync
    } else {
        &m.fsync
    };
    let fsync = match (sync.mean(), sync.quantile_bound(0.99)) {
        (Some(mean), Some(p99)) => format!(
            "{:.2} ms <span class=\"muted\">(p99 ≤ {:.2} ms)</span>",
            mean / 1000.0,
            p99 as f64 / 1000.0
        ),
        (Some(mean), None) => format!("{:.2} ms", mean / 1000.0),
        _ => "—".to_owned(),
    };
    let audit = m
        .audit_write
        .mean()
        .map_or("—".to_owned(), |us| format!("{:.2} ms", us / 1000.0));
    let batch = m
        .batch_size
        .mean()
        .map_or("—".to_owned(), |b| format!("{b:.1}"));
    format!(
        "<div class=\"health\" id=\"health-panel\">\
<div>state<b>{}</b></div><div>uptime<b>{}</b></div><div>held<b>{}</b></div><div>waiters<b>{}</b></div>\
<div>sessions<b>{}</b></div><div>locks<b>{}</b></div><div>next fence<b>{}</b></div>\
<div>log sync (mean)<b>{fsync}</b></div><div>audit write (mean)<b>{audit}</b></div>\
<div>records per sync (mean)<b>{batch}</b></div><div>syncs<b>{}</b></div><div>audit entries<b>{}</b></div></div>",
        esc(&state),
        dur(h.uptime().as_millis() as u64),
        m.held.load(Relaxed),
        m.waiters.load(Relaxed),
        m.sessions.load(Relaxed),
        m.locks.load(Relaxed),
        m.next_fence.load(Relaxed),
        sync.count(),
        m.audit_entries.load(Relaxed),
    )
}

/// A member's URL as a link, if it is an http(s) URL (anything else, such as a
/// `javascript:` URL, is shown as text), or `—` if unknown.
fn member_link(url: Option<&str>) -> String {
    match url {
        Some(u) if u.starts_with("http://") || u.starts_with("https://") => {
            format!("<a href=\"{}\">{}</a>", esc(u), esc(u))
        }
        Some(u) => esc(u),
        None => "—".to_owned(),
    }
}

/// The "Cluster" section (cluster mode only): this member, the term and the leader,
/// then one row per member with its replication progress (known on the leader).
fn cluster_section(v: &crate::cluster::api::ClusterView) -> String {
    let leader = match &v.leader {
        Some(l) => format!(
            "member <b>{}</b> ({})",
            l.id,
            member_link(Some(l.url.as_str()))
        ),
        None => "<span class=\"error\">none known</span>".to_owned(),
    };
    let mut s = format!(
        "<p id=\"cluster-self\">This is member <b>{}</b>, <b>{}</b>, term <b>{}</b>. Leader: {leader}.</p>\
<table id=\"cluster-table\"><thead><tr><th>Member</th><th>URL</th><th>Role</th><th>Matched index</th>\
<th>Lag (entries)</th></tr></thead><tbody>",
        v.node_id,
        esc(v.role),
        v.term
    );
    let num = |n: Option<u64>| n.map_or("—".to_owned(), |n| n.to_string());
    for m in &v.members {
        let _ = write!(
            s,
            "<tr data-member=\"{}\"><td class=\"num\">{}{}</td><td>{}</td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td></tr>",
            m.id,
            m.id,
            if m.id == v.node_id { " <span class=\"muted\">(this)</span>" } else { "" },
            member_link(m.url.as_deref()),
            esc(m.role),
            num(m.matched_index),
            num(m.lag),
        );
    }
    s.push_str("</tbody></table>");
    if v.last_log_index.is_none() {
        s.push_str("<p class=\"muted\">Replication progress is known on the leader only.</p>");
    }
    s
}

/// The cluster section of `h`'s dashboard, `None` on a single server.
fn cluster_html(h: &Handle) -> Option<String> {
    h.cluster()
        .map(|c| cluster_section(&crate::cluster::api::view(c)))
}

fn audit_row(e: &AuditEntry) -> String {
    let mut detail = Vec::new();
    if let Some(r) = &e.reason {
        detail.push(format!("reason: {}", esc(r)));
    }
    if let Some(a) = &e.actor {
        detail.push(format!("by {}", esc(a)));
    }
    if let Some(d) = &e.detail {
        detail.push(esc(d));
    }
    if let Some(r) = &e.request_id {
        detail.push(format!("request {}", esc(r)));
    }
    if e.duration_ms > 0 {
        detail.push(dur(e.duration_ms));
    }
    format!(
        "<tr><td>{}</td><td class=\"kind-{}\">{}</td><td>{}</td><td class=\"num\">{}</td><td>{}</td><td>{}</td></tr>",
        utc(e.wall_ms),
        e.kind.as_str(),
        e.kind.as_str().replace('_', " "),
        e.lock.as_deref().map(lock_link).unwrap_or_default(),
        e.fence.map(|f| f.to_string()).unwrap_or_default(),
        esc(e.owner.as_deref().unwrap_or("")),
        detail.join(", ")
    )
}

fn event_row(e: &Event) -> Option<String> {
    let kind = match e.kind {
        EventKind::Granted => "grant",
        EventKind::Ended(GrantEnd::Released) => "release",
        EventKind::Ended(GrantEnd::Expired) => "expiry",
        EventKind::Ended(GrantEnd::ForceReleased) => "forced_release",
        EventKind::Queued | EventKind::WaitEnded(_) => return None,
    };
    let detail = e
        .reason
        .as_ref()
        .map(|r| format!("reason: {}", esc(r.as_str())))
        .unwrap_or_default();
    Some(format!(
        "<tr><td>{}</td><td class=\"kind-{kind}\">{}</td><td>{}</td><td class=\"num\">{}</td><td>{}</td><td>{detail}</td></tr>",
        utc(crate::audit::wall_ms()),
        kind.replace('_', " "),
        lock_link(e.name.as_str()),
        e.fence.map(|f| f.get().to_string()).unwrap_or_default(),
        esc(e.owner.as_str()),
    ))
}

const EVENTS_HEAD: &str = "<table><thead><tr><th>Time (UTC)</th><th>Event</th><th>Lock</th><th>Fence</th><th>Owner</th><th>Detail</th></tr></thead>";

/// Audit entries the caller may see (lock-less entries only with every prefix).
fn visible_audit(h: &Handle, who: &Principal, query: &AuditQuery) -> Vec<AuditEntry> {
    let mut entries = h.audit(query);
    entries.retain(|e| match &e.lock {
        Some(l) => who.covers(l),
        None => who.covers_everything(),
    });
    entries
}

async fn index(
    State(h): State<Handle>,
    ext: Extensions,
    headers: HeaderMap,
    params: Result<Query<PrefixParams>, QueryRejection>,
) -> Response {
    let who = match page_caller(&ext, &headers, Action::Read, None) {
        Ok(p) => p,
        Err(r) => return *r,
    };
    let prefix = params.map(|Query(p)| p.prefix).unwrap_or_default();
    let table = match visible_locks(&h, &who, &prefix).await {
        Ok(views) => locks_table(&views),
        Err(e) => format!("<p class=\"error\">{}</p>", esc(e.message())),
    };
    let mut events = String::new();
    let recent = visible_audit(
        &h,
        &who,
        &AuditQuery {
            lock: None,
            since_wall_ms: 0,
            limit: RECENT_EVENTS * 4,
        },
    );
    for e in recent
        .iter()
        .rev()
        .filter(|e| e.lock.as_deref().is_some_and(|l| l.starts_with(&prefix)))
        .take(RECENT_EVENTS)
    {
        events.push_str(&audit_row(e));
    }
    let cluster = cluster_html(&h)
        .map(|c| format!("<h2>Cluster</h2><div id=\"cluster\" sse-swap=\"cluster\">{c}</div>"))
        .unwrap_or_default();
    let body = format!(
        "<form method=\"get\" action=\"/\"><label>Prefix <input type=\"text\" name=\"prefix\" value=\"{}\" placeholder=\"tenant:kind:\"></label> <button>Show</button></form>\
<div sse-connect=\"/ui/stream?prefix={}\">\
<h2>Health</h2><div id=\"health\" sse-swap=\"health\">{}</div>{cluster}\
<h2>Locks <span class=\"muted\" id=\"live\">(live)</span></h2><div id=\"locks\" sse-swap=\"locks\">{}</div>\
<h2>Recent events</h2>{EVENTS_HEAD}<tbody id=\"events\" sse-swap=\"event\" hx-swap=\"afterbegin\">{}</tbody></table>\
</div>",
        esc(&prefix),
        url(&prefix),
        health(&h, &who),
        table,
        events
    );
    page("locks", Some(&who), &body).into_response()
}

/// The live stream of a page: `locks` and `health` every [`REFRESH`] and after
/// events, `event` per durable lock event, all from the page's shared [`LiveViews`]
/// renderer. Counted against the token's stream quota. Ends when the server drains.
async fn stream(
    State(h): State<Handle>,
    Extension(views): Extension<LiveViews>,
    ext: Extensions,
    params: Result<Query<PrefixParams>, QueryRejection>,
) -> Result<Response, ApiError> {
    let who = auth::authorize(&ext, Action::Watch, None)?;
    let Query(params) = params.map_err(|e| invalid("query", e.body_text()))?;
    let prefix = input::prefix(params.prefix)?;
    who.ranges(&prefix)?;
    let slot = who.open_stream()?;
    let frames = views.subscribe(&h, &who, prefix)?;
    let stream = futures_util::stream::unfold((frames, slot), |(mut frames, slot)| async move {
        loop {
            match frames.recv().await {
                Ok(frame) => return Some((frame, (frames, slot))),
                // A slow browser skips frames; the next one has the whole table.
                Err(RecvError::Lagged(_)) => continue,
                Err(RecvError::Closed) => return None,
            }
        }
    })
    .flat_map(|frame: Arc<Frame>| {
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
        out.extend(
            frame
                .rows
                .iter()
                .map(|r| SseEvent::default().event("event").data(r)),
        );
        futures_util::stream::iter(out.into_iter().map(Ok::<_, Infallible>))
    });
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// Most distinct live views (prefix and token prefixes) rendered at once; a stream
/// of one more is refused with 429 `resource_exhausted`.
pub const MAX_LIVE_VIEWS: usize = 64;
/// Shortest time between two renders of one live view: a burst of changes costs
/// one render per interval, however many changes and viewers.
const MIN_RENDER_INTERVAL: Duration = Duration::from_millis(250);
/// Frames a viewer may fall behind before it skips to the newest.
const FRAMES_BUFFERED: usize = 8;

/// What a live view shows: the prefix, and the prefixes of the token looking (the
/// rows and counts it may see). Tokens with the same prefixes share a view.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct ViewKey {
    prefix: String,
    scope: Vec<String>,
}

/// One render of a live view, sent to every stream of that view.
#[derive(Debug)]
struct Frame {
    table: String,
    health: String,
    /// The cluster section (cluster mode only).
    cluster: Option<String>,
    /// Rows of "recent events" since the previous frame, oldest first.
    rows: Vec<String>,
}

/// The dashboard's live views: one renderer task per distinct `ViewKey`, which
/// renders the lock table and health panel once per change (at most every
/// `MIN_RENDER_INTERVAL`) and every `REFRESH`, and publishes the result to all
/// the streams of that view, so N viewers cost one render. A renderer stops once
/// its last viewer is gone.
#[derive(Clone, Default)]
pub struct LiveViews {
    views: Arc<Mutex<HashMap<ViewKey, broadcast::Sender<Arc<Frame>>>>>,
}

impl LiveViews {
    /// The frames of the view of `prefix` for `who`, starting its renderer if no
    /// one is watching it yet. 429 `resource_exhausted` beyond [`MAX_LIVE_VIEWS`].
    fn subscribe(
        &self,
        h: &Handle,
        who: &Principal,
        prefix: String,
    ) -> Result<broadcast::Receiver<Arc<Frame>>, ApiError> {
        let mut scope: Vec<String> = who.prefixes().map(str::to_owned).collect();
        scope.sort_unstable();
        scope.dedup();
        let key = ViewKey { prefix, scope };
        let mut views = self.views.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(frames) = views.get(&key) {
            return Ok(frames.subscribe());
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
        views.insert(key.clone(), frames.clone());
        h.metrics()
            .dashboard_views
            .store(views.len() as u64, Relaxed);
        tokio::spawn(render_view(
            self.clone(),
            key,
            h.clone(),
            who.clone(),
            frames,
        ));
        Ok(viewer)
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
        if views.get(key).is_some_and(|f| f.same_channel(frames)) {
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
    frames: broadcast::Sender<Arc<Frame>>,
) {
    let mut events = h.subscribe();
    let mut state = h.watch_state();
    let mut tick = tokio::time::interval(REFRESH);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_render: Option<tokio::time::Instant> = None;
    let mut rows = Vec::new();
    // Keeps an event's row if the view shows its lock; false once events end.
    let take = |got: Result<SharedEvent, RecvError>, rows: &mut Vec<String>| match got {
        Ok(e) => {
            if e.name.as_str().starts_with(&key.prefix) && who.covers(e.name.as_str()) {
                rows.extend(event_row(&e));
                if rows.len() > RECENT_EVENTS {
                    rows.remove(0);
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
        let table = match visible_locks(&h, &who, &key.prefix).await {
            Ok(locks) => locks_table(&locks),
            Err(e) => format!("<p class=\"error\">{}</p>", esc(e.message())),
        };
        let frame = Frame {
            table,
            health: health(&h, &who),
            cluster: cluster_html(&h),
            rows: std::mem::take(&mut rows),
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
            let body = format!("<p class=\"error\">{}</p>", esc(e.message()));
            return (StatusCode::BAD_REQUEST, page("bad lock name", None, &body)).into_response();
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
    let force = if admin {
        format!(
            "<h2>Force release</h2><form id=\"force-release\" hx-post=\"/ui/force-release\" hx-target=\"#force-result\" \
hx-confirm=\"Force-release {}? Its holders lose it; the next grant gets a larger fence.\">\
<input type=\"hidden\" name=\"name\" value=\"{}\"><label>Reason <input type=\"text\" name=\"reason\" required maxlength=\"1024\" placeholder=\"why (recorded in the audit log)\"></label> \
<button type=\"submit\">Force release</button></form><div id=\"force-result\"></div>",
            esc(name.as_str()),
            esc(name.as_str())
        )
    } else {
        String::new()
    };
    let body = format!(
        "<p><a href=\"/\">← all locks</a></p><h2>Now</h2><div id=\"lock-now\">{current}</div>{force}\
<h2>History <span class=\"muted\">(audit log, newest first)</span></h2><div id=\"history\">{history}</div>"
    );
    page(name.as_str(), Some(&who), &body).into_response()
}

/// The "now" table and the history table of a lock's page.
async fn lock_sections(h: &Handle, name: &LockName) -> (String, String) {
    let current = match h.lock(name.clone()).await {
        Ok(Some(view)) => locks_table(&[view]),
        Ok(None) => "<p class=\"muted\">Not held, queued for or in lock-delay.</p>".to_owned(),
        Err(e) => format!("<p class=\"error\">{}</p>", esc(e.message())),
    };
    let rows: String = h
        .audit(&AuditQuery {
            lock: Some(name.as_str().to_owned()),
            since_wall_ms: 0,
            limit: MAX_AUDIT_PAGE,
        })
        .iter()
        .rev()
        .map(audit_row)
        .collect();
    let rows = if rows.is_empty() {
        "<tr><td colspan=\"6\" class=\"muted\">no audit entries (retention may have dropped them)</td></tr>".to_owned()
    } else {
        rows
    };
    (
        current,
        format!("{EVENTS_HEAD}<tbody>{rows}</tbody></table>"),
    )
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
            Html(format!("<p class=\"{class}\">{}</p>", esc(text))),
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
            Html(format!(
                "<p class=\"ok\">{}</p><div id=\"lock-now\" hx-swap-oob=\"true\">{current}</div><div id=\"history\" hx-swap-oob=\"true\">{history}</div>",
                esc(&format!("Force-released {name} (fence {}).", list.join(", ")))
            ))
            .into_response()
        }
        Err(e) => {
            let status =
                StatusCode::from_u16(e.kind().http_status()).unwrap_or(StatusCode::BAD_REQUEST);
            fragment(status, "error", e.message())
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AuditParams {
    lock: Option<String>,
    since_ms: Option<u64>,
    limit: Option<usize>,
}

/// One audit entry on the wire.
#[derive(Serialize)]
struct AuditJson {
    seq: u64,
    time_ms: u64,
    time: String,
    kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    lock: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    fence: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    owner: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    session: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    request_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    actor: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
    duration_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<String>,
}

impl From<AuditEntry> for AuditJson {
    fn from(e: AuditEntry) -> AuditJson {
        AuditJson {
            seq: e.seq,
            time_ms: e.wall_ms,
            time: utc(e.wall_ms).replace(' ', "T") + "Z",
            kind: e.kind.as_str(),
            lock: e.lock,
            fence: e.fence,
            owner: e.owner,
            session: e.session,
            request_id: e.request_id,
            actor: e.actor,
            reason: e.reason,
            duration_ms: e.duration_ms,
            detail: e.detail,
        }
    }
}

/// `GET /v1/audit?lock=NAME&since_ms=…&limit=…`: entries, newest last.
async fn audit_api(
    State(h): State<Handle>,
    ext: Extensions,
    params: Result<Query<AuditParams>, QueryRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let Query(p) = params.map_err(|e| invalid("query", e.body_text()))?;
    let lock = p
        .lock
        .as_deref()
        .map(|l| input::lock_name("lock", l))
        .transpose()?;
    let who = auth::authorize(&ext, Action::Audit, lock.as_ref().map(LockName::as_str))?;
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
            limit,
        },
    );
    let entries: Vec<AuditJson> = entries.into_iter().map(AuditJson::from).collect();
    Ok(Json(serde_json::json!({ "entries": entries })))
}

/// Content-Security-Policy of the dashboard: scripts only from this server (the
/// vendored htmx), no framing (a force-release button cannot be clickjacked), forms
/// and event streams only to this server.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
style-src 'self' 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; \
form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// Security headers on every dashboard answer (defence in depth behind [`esc`]).
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
    fn escapes_markup_and_quotes() {
        assert_eq!(
            esc("<script>alert('x')</script>&\""),
            "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;&amp;&quot;"
        );
        assert_eq!(url("a b/<c>"), "a%20b%2F%3Cc%3E");
    }

    #[test]
    fn formats_times_and_durations() {
        assert_eq!(utc(0), "1970-01-01 00:00:00.000");
        assert_eq!(utc(1_772_454_645_123), "2026-03-02 12:30:45.123");
        assert_eq!(dur(850), "850 ms");
        assert_eq!(dur(12_345), "12.3 s");
        assert_eq!(dur(245_000), "4 m 05 s");
        assert_eq!(dur(7_380_000), "2 h 03 m");
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
        let html = cluster_section(&leader_view);
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
        let html = cluster_section(&follower_view);
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
        assert_eq!(cluster_html(&h), None);
        let page = index(
            State(h.clone()),
            anonymous_admin(),
            HeaderMap::new(),
            Ok(Query(PrefixParams {
                prefix: String::new(),
            })),
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
            .map(|_| views.subscribe(&h, &who, "job:".to_owned()).unwrap())
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

    /// Distinct views are bounded: each costs a renderer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn distinct_views_are_bounded() {
        let (h, _dir) = engine();
        let views = LiveViews::default();
        let who = Principal::anonymous();
        let _viewers: Vec<_> = (0..MAX_LIVE_VIEWS)
            .map(|i| views.subscribe(&h, &who, format!("p{i}:")).unwrap())
            .collect();
        let e = views
            .subscribe(&h, &who, "one-more:".to_owned())
            .unwrap_err();
        assert_eq!(e.kind(), ApiErrorKind::ResourceExhausted, "{e}");
        // Another viewer of a view already rendered is fine.
        assert!(views.subscribe(&h, &who, "p0:".to_owned()).is_ok());
    }
}
