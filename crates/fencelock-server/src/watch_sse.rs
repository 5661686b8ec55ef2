//! `GET /v1/watch?prefix=&after=`: lock events as Server-Sent Events.
//!
//! Each event is `id:` its [`Position`], `event:` its kind, `data:` its JSON
//! ([`WatchEventJson`]: the event fields the audit log uses too, with the wall-clock
//! `time` in RFC 3339 and `time_ms`). A client that reconnects with the last id it
//! saw (`after=`, or the standard `Last-Event-ID` header, which wins: a browser's
//! `EventSource` sends it on its own when it reconnects to the same URL) gets every
//! event since, then live ones, with no gap and no repeat. If the server cannot
//! resume there the request is answered 410 `watch_compacted` before the stream
//! starts; if it cannot go on during the stream (the engine stops), a last `end`
//! event says why (`data: {"error":{"code","message"}}`) and the stream ends. A
//! watcher that falls behind the live events catches up from the history on its
//! own. Heartbeat comments keep idle connections open through proxies.
//!
//! Auth is the other `/v1` reads': the `watch` action, and only events of locks
//! within the requested prefix and the token's prefixes (as the gRPC `Watch`).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use fencelock_core::EventKind;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::{broadcast, watch};
use utoipa::IntoParams;

use crate::auth::{Action, Caller, StreamSlot};
use crate::engine::{Handle, Position, RunState, SharedEvent, WatchEvent};
use crate::error::{ApiError, ApiErrorKind, CommonErrors, ErrorBody};
use crate::input::{self, invalid};
use crate::vocab::EventFields;

/// How often an idle stream sends a heartbeat comment.
pub const HEARTBEAT: Duration = Duration::from_secs(15);

/// The query of `GET /v1/watch`.
#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct WatchParams {
    /// Only events of locks whose names start with this (default: all the token
    /// may read).
    #[serde(default)]
    prefix: String,
    /// Resume after this position (`INDEX.ORDINAL`, an event's `id`); the
    /// `Last-Event-ID` header wins over it. Absent: from now on.
    after: Option<String>,
}

/// The stable name of an event's kind (the SSE `event:` field and `kind`): the
/// vocabulary's.
pub fn kind_name(kind: EventKind) -> &'static str {
    crate::vocab::event(kind).name()
}

/// A watch event's JSON (the SSE `data:`): its `position`, the shared event fields
/// ([`EventFields`]), and the names it had before the vocabulary, kept for existing
/// readers.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[schema(as = WatchEvent)]
pub struct WatchEventJson {
    /// Where the event stands in the log (`INDEX.ORDINAL`): what `after=` and
    /// `Last-Event-ID` resume after.
    pub position: String,
    /// The fields every event has.
    #[serde(flatten)]
    pub fields: EventFields,
    /// Deprecated: the same as `time`.
    #[schema(deprecated)]
    pub at: String,
    /// Deprecated: the same as `time_ms`.
    #[schema(deprecated)]
    pub wall_ms: u64,
    /// Deprecated: the server's service time (its uptime clock; only differences
    /// mean anything). Use `time_ms`.
    #[schema(deprecated)]
    pub at_ms: u64,
}

/// A watch event's JSON.
pub fn event_json(e: &WatchEvent) -> WatchEventJson {
    let fields = EventFields::of(&e.event, e.wall_ms);
    WatchEventJson {
        position: e.position.to_string(),
        at: fields.time.clone(),
        wall_ms: e.wall_ms,
        at_ms: e.at_ms,
        fields,
    }
}

/// The position a request resumes after: `Last-Event-ID` if sent, else `after`.
fn resume_position(headers: &HeaderMap, after: Option<&str>) -> Result<Option<Position>, ApiError> {
    if let Some(id) = headers.get("last-event-id") {
        let id = id
            .to_str()
            .map_err(|_| invalid("Last-Event-ID", "must be a watch position INDEX.ORDINAL"))?;
        return id.parse().map(Some);
    }
    after.map(str::parse).transpose()
}

/// Lock events as Server-Sent Events, resumable (see the module docs).
#[utoipa::path(get, path = "/v1/watch", tag = "locks",
    params(WatchParams),
    responses(
        (status = 200, description = "An event stream: `id:` the position, `event:` the kind, `data:` the event's JSON (the `WatchEvent` schema: `position` and the event fields shared with the audit log: `kind`, `handoff`, `name`, `fence`, `owner`, `session`, `mode`, `value`, `time` (RFC 3339), `time_ms`, `duration_ms`, `reason`, `wait_end`); a last `end` event (`{\"error\":{\"code\",\"message\"}}`) if the stream cannot go on.", content_type = "text/event-stream", body = String),
        (status = 410, description = "`watch_compacted`: the server cannot resume after that position (re-read the locks and watch from now).", body = ErrorBody),
        CommonErrors,
    ))]
pub(crate) async fn watch(
    State(h): State<Handle>,
    Caller(caller): Caller,
    headers: HeaderMap,
    query: Result<Query<WatchParams>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(p) = query.map_err(|e| invalid("query", e.body_text()))?;
    let prefix = input::prefix(p.prefix)?;
    let after = resume_position(&headers, p.after.as_deref())?;
    caller.authorize(Action::Watch, None)?;
    let ranges = caller.ranges(&prefix)?;
    let slot = caller.open_stream()?;
    let (backlog, last, live) = match after {
        Some(after) => {
            let resume = h.resume(after)?;
            (resume.backlog.into(), after, resume.live)
        }
        None => {
            let (last, live) = h.watch_now();
            (VecDeque::new(), last, live)
        }
    };
    let run = h.watch_state();
    let stream = SseWatch {
        h,
        backlog,
        last,
        live,
        ranges,
        run,
        done: false,
        _slot: slot,
    };
    let events = futures_util::stream::unfold(stream, |mut s| async move {
        let event = s.next().await?;
        Some((Ok::<_, Infallible>(event), s))
    });
    Ok(Sse::new(events)
        .keep_alive(KeepAlive::new().interval(HEARTBEAT))
        .into_response())
}

/// One SSE watch.
struct SseWatch {
    h: Handle,
    /// Events to send before the live ones.
    backlog: VecDeque<SharedEvent>,
    /// The last event sent, or where the watch began: live events at or before it
    /// are repeats.
    last: Position,
    live: broadcast::Receiver<SharedEvent>,
    ranges: Vec<String>,
    run: watch::Receiver<RunState>,
    done: bool,
    _slot: StreamSlot,
}

impl SseWatch {
    fn wanted(&self, event: &WatchEvent) -> bool {
        self.ranges
            .iter()
            .any(|r| event.name.as_str().starts_with(r.as_str()))
    }

    fn sse(event: &WatchEvent) -> SseEvent {
        SseEvent::default()
            .id(event.position.to_string())
            .event(kind_name(event.kind))
            .data(
                // Strings and numbers only: serializing cannot fail.
                serde_json::to_string(&event_json(event)).expect("an event serializes"),
            )
    }

    /// The last event of a stream that cannot go on.
    fn end(&mut self, error: &ApiError) -> SseEvent {
        self.done = true;
        let body = json!({"error": {"code": error.kind().code(), "message": error.message()}});
        SseEvent::default().event("end").data(body.to_string())
    }

    async fn next(&mut self) -> Option<SseEvent> {
        loop {
            if self.done {
                return None;
            }
            if let Some(event) = self.backlog.pop_front() {
                self.last = event.position;
                if self.wanted(&event) {
                    return Some(Self::sse(&event));
                }
                continue;
            }
            let received = tokio::select! {
                received = self.live.recv() => Some(received),
                _ = self.run.wait_for(|s| *s != RunState::Running) => None,
            };
            let Some(received) = received else {
                let error = ApiError::new(
                    ApiErrorKind::Unavailable,
                    "the server is stopping; reconnect (with Last-Event-ID) to resume",
                );
                return Some(self.end(&error));
            };
            match received {
                Ok(event) if event.position <= self.last => {}
                Ok(event) => {
                    self.last = event.position;
                    if self.wanted(&event) {
                        return Some(Self::sse(&event));
                    }
                }
                // Fell behind the live channel: catch up from the history.
                Err(broadcast::error::RecvError::Lagged(_)) => match self.h.resume(self.last) {
                    Ok(resume) => {
                        self.backlog = resume.backlog.into();
                        self.live = resume.live;
                    }
                    Err(error) => return Some(self.end(&error)),
                },
                Err(broadcast::error::RecvError::Closed) => {
                    let error = ApiError::new(ApiErrorKind::Unavailable, "the lock engine stopped");
                    return Some(self.end(&error));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn last_event_id_wins_over_after_and_bad_positions_are_400() {
        let mut headers = HeaderMap::new();
        assert_eq!(resume_position(&headers, None).unwrap(), None);
        assert_eq!(
            resume_position(&headers, Some("3.1")).unwrap(),
            Some(Position {
                index: 3,
                ordinal: 1
            })
        );
        headers.insert("last-event-id", HeaderValue::from_static("9.2"));
        assert_eq!(
            resume_position(&headers, Some("3.1")).unwrap(),
            Some(Position {
                index: 9,
                ordinal: 2
            })
        );
        headers.insert("last-event-id", HeaderValue::from_static("nine"));
        let err = resume_position(&headers, Some("3.1")).unwrap_err();
        assert_eq!(err.kind().http_status(), 400, "{err}");
        let err = resume_position(&HeaderMap::new(), Some("3")).unwrap_err();
        assert_eq!(err.kind().http_status(), 400, "{err}");
    }
}
