//! [`LeaderBackend`]: a [`LockBackend`] over every member of a cluster that sends each
//! call to the leader.
//!
//! A call goes to the member believed to lead. On `not_leader` it moves to the
//! leader the answer names (the message says "send the request to URL"; the client
//! library has no code for `not_leader` and reports it as a protocol error), else —
//! and on a connection failure or a timeout — it asks every member's
//! `GET /v1/cluster` who leads (falling back to the next member in turn) and retries
//! the **same** call: an acquire keeps its `request_id`, so a grant whose answer was
//! lost is returned again, never granted twice. A member that is stopped (`SIGSTOP`)
//! accepts connections but never answers, so every attempt is bounded: an acquire
//! asks the server to wait at most [`ATTEMPT_WAIT`] (the client library retries a
//! `timeout` with the same request id while its own wait budget lasts), and every
//! attempt is abandoned [`ATTEMPT_SLACK`] after the time it asked the server to wait.
//!
//! When no leader answers within the call's bound, the call fails as `unavailable`
//! (transient): the client retries acquires within its wait, and a renewal that
//! cannot reach a leader before the lease's conservative deadline makes the guard
//! report the lock lost.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use fencelock::{
    AcquireSpec, BoxFuture, Capabilities, Error, ErrorKind, FencelockBackend, Lease, LockBackend,
    ServerConfig,
};
use tokio::time::Instant;

use crate::http;

/// The longest wait one acquire attempt asks a member for.
pub const ATTEMPT_WAIT: Duration = Duration::from_secs(1);
/// How long beyond its server-side wait one attempt may take before it is abandoned.
pub const ATTEMPT_SLACK: Duration = Duration::from_secs(1);
/// How long one call may keep looking for a leader, beyond its server-side wait.
const CALL_BOUND: Duration = Duration::from_secs(5);
/// Most attempts of one call.
const MAX_ATTEMPTS: u32 = 64;
/// Pause between attempts while no leader is known.
const RETRY_PAUSE: Duration = Duration::from_millis(50);

/// One member: its URL and its connection.
#[derive(Debug)]
struct Member {
    url: String,
    backend: FencelockBackend,
}

/// Routes every call to the cluster's leader (see the module docs).
#[derive(Debug)]
pub struct LeaderBackend {
    members: Vec<Member>,
    /// The member believed to lead (an index into `members`).
    current: AtomicUsize,
}

impl LeaderBackend {
    /// A backend over the members at `urls` (`http://127.0.0.1:PORT`), connecting
    /// lazily.
    pub fn new(urls: &[String]) -> Result<LeaderBackend, crate::ChaosError> {
        if urls.is_empty() {
            return Err("no member URLs".into());
        }
        let mut members = Vec::with_capacity(urls.len());
        for url in urls {
            let mut config = ServerConfig::new(url.clone());
            config.connect_timeout = Duration::from_millis(500);
            config.request_timeout = ATTEMPT_SLACK + Duration::from_millis(500);
            let backend = FencelockBackend::connect_lazy(config).map_err(|e| e.to_string())?;
            members.push(Member {
                url: url.clone(),
                backend,
            });
        }
        Ok(LeaderBackend {
            members,
            current: AtomicUsize::new(0),
        })
    }

    fn index_of(&self, url: &str) -> Option<usize> {
        let url = url.trim_end_matches('/');
        self.members
            .iter()
            .position(|m| m.url.trim_end_matches('/') == url)
    }

    /// Asks every member who leads and moves `current` to the leader named in the
    /// highest term (a leader cut off from the others still names itself, in its old
    /// term), or to the next member when nobody knows.
    async fn discover(&self) {
        let start = self.current.load(Ordering::Relaxed);
        let n = self.members.len();
        let mut best: Option<(u64, usize)> = None;
        for i in 0..n {
            let Some(port) = http::url_port(&self.members[i].url) else {
                continue;
            };
            let answer = tokio::task::spawn_blocking(move || {
                http::call(port, "GET", "/v1/cluster", None, Duration::from_millis(300))
            })
            .await
            .ok()
            .flatten();
            let Some((200, body)) = answer else { continue };
            let term = body.get("term").and_then(|t| t.as_u64()).unwrap_or(0);
            let leader = http::leader_url(&body).and_then(|url| self.index_of(&url));
            if let Some(leader) = leader {
                if best.is_none_or(|(t, _)| term > t) {
                    best = Some((term, leader));
                }
            }
        }
        let next = best.map_or((start + 1) % n, |(_, leader)| leader);
        self.current.store(next, Ordering::Relaxed);
    }

    /// Runs `call` against the leader until it answers something other than "not the
    /// leader" or "unreachable", within `bound` overall and `per_attempt` each.
    async fn route<T, F, Fut>(
        &self,
        what: &str,
        bound: Duration,
        per_attempt: Duration,
        mut call: F,
    ) -> Result<T, Error>
    where
        F: FnMut(usize) -> Fut,
        Fut: Future<Output = Result<T, Error>>,
    {
        let end = Instant::now() + bound;
        let mut last = String::from("no attempt");
        for attempt in 0..MAX_ATTEMPTS {
            if attempt > 0 && Instant::now() >= end {
                break;
            }
            let i = self.current.load(Ordering::Relaxed);
            let error = match tokio::time::timeout(per_attempt, call(i)).await {
                Ok(Ok(value)) => return Ok(value),
                Ok(Err(e)) => e,
                Err(_) => Error::new(
                    ErrorKind::Unavailable,
                    format!("no answer within {per_attempt:?}"),
                ),
            };
            if let Some(redirect) = not_leader(&error) {
                match redirect.and_then(|url| self.index_of(&url)) {
                    Some(leader) if leader != i => self.current.store(leader, Ordering::Relaxed),
                    _ => {
                        self.discover().await;
                        tokio::time::sleep(RETRY_PAUSE).await;
                    }
                }
            } else if error.kind() == ErrorKind::Unavailable {
                self.discover().await;
                tokio::time::sleep(RETRY_PAUSE).await;
            } else {
                return Err(error);
            }
            last = format!("{}: {error}", self.members[i].url);
        }
        Err(Error::new(
            ErrorKind::Unavailable,
            format!("{what}: no leader answered within {bound:?} (last: {last})"),
        ))
    }
}

/// `Some(leader URL if named)` when `e` is a `not_leader` answer.
fn not_leader(e: &Error) -> Option<Option<String>> {
    let message = e.message();
    if !message.contains("not the leader") {
        return None;
    }
    Some(
        message
            .split("send the request to ")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .map(|url| url.trim_end_matches(['.', ',', ';']).to_owned()),
    )
}

impl LockBackend for LeaderBackend {
    fn capabilities(&self) -> Capabilities {
        let mut capabilities = self.members[0].backend.capabilities();
        // Only acquires, renewals and releases pass through: claim nothing else.
        capabilities.downgrade = false;
        capabilities.elections = false;
        capabilities.multi = false;
        capabilities
    }

    fn acquire<'a>(&'a self, spec: &'a AcquireSpec) -> BoxFuture<'a, Result<Lease, Error>> {
        Box::pin(async move {
            let mut attempt_spec = spec.clone();
            attempt_spec.wait = spec.wait.min(ATTEMPT_WAIT);
            let per_attempt = attempt_spec.wait + ATTEMPT_SLACK;
            let spec = &attempt_spec;
            self.route("acquire", per_attempt + CALL_BOUND, per_attempt, |i| {
                self.members[i].backend.acquire(spec)
            })
            .await
        })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Duration, Error>> {
        Box::pin(async move {
            self.route("renew", CALL_BOUND, ATTEMPT_SLACK, |i| {
                self.members[i].backend.renew(lease, ttl)
            })
            .await
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            self.route("release", CALL_BOUND, ATTEMPT_SLACK, |i| {
                self.members[i].backend.release(lease)
            })
            .await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_leader_answers_are_recognised() {
        let e = Error::new(
            ErrorKind::Protocol,
            "this member is not the leader; send the request to http://127.0.0.1:7001",
        );
        assert_eq!(
            not_leader(&e),
            Some(Some("http://127.0.0.1:7001".to_owned()))
        );
        let e = Error::new(
            ErrorKind::Protocol,
            "this member is not the leader and no leader is known yet; retry shortly",
        );
        assert_eq!(not_leader(&e), Some(None));
        let e = Error::new(ErrorKind::NotHeld, "not held");
        assert_eq!(not_leader(&e), None);
    }

    #[test]
    fn members_are_found_by_url() {
        let urls = vec![
            "http://127.0.0.1:1".to_owned(),
            "http://127.0.0.1:2".to_owned(),
        ];
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _guard = runtime.enter();
        let backend = LeaderBackend::new(&urls).unwrap();
        assert_eq!(backend.index_of("http://127.0.0.1:2/"), Some(1));
        assert_eq!(backend.index_of("http://127.0.0.1:3"), None);
        assert!(LeaderBackend::new(&[]).is_err());
    }
}
