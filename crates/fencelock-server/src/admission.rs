//! Connection admission: which connections the server keeps, and for how long.
//!
//! A connection is *unauthenticated* from its accept until it is *admitted*: a
//! `flw/1` Hello that succeeded (with authentication off: its first request), or an
//! HTTP request that passed authentication with a [`crate::Principal`] (`/healthz`
//! and `/readyz` are answered but admit nobody). Unauthenticated connections hold a
//! slot of their own small pool (`Limits::max_unauthenticated_connections`), never
//! one of `Limits::max_connections`, so connections that never authenticate cannot
//! lock authenticated clients out (issue 19, item 1). When that pool is full the
//! *oldest* unauthenticated connection is closed to make room: a new client always
//! gets in, and an attacker must open connections faster than a client makes its
//! first round trip to push it out before it authenticates. An unauthenticated
//! connection is also closed at `Limits::auth_timeout`, whatever it sends.
//!
//! On admission a connection moves to the `max_connections` pool; if that is full
//! the request that would admit it is refused (503 `unavailable`), and the
//! connection stays unauthenticated. Every connection, in either pool, counts
//! against `Limits::max_connections_per_ip` for its peer's address.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::limits::Limits;
use crate::metrics::ConnectionMetrics;

/// The server's connection pools.
pub(crate) struct Admission {
    state: Mutex<Pools>,
    max_unauthenticated: usize,
    max_connections: usize,
    max_per_ip: usize,
    auth_timeout: Duration,
    metrics: Arc<ConnectionMetrics>,
    /// Woken whenever a connection ends (for a graceful stop to wait on).
    ended: Notify,
}

#[derive(Default)]
struct Pools {
    next_id: u64,
    /// Unauthenticated connections by age (ids grow), with what closes each.
    unauthenticated: BTreeMap<u64, Arc<Notify>>,
    admitted: usize,
    per_ip: HashMap<IpAddr, usize>,
}

/// Why a new connection was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// Its address already has `max_connections_per_ip` connections.
    PerIp(usize),
}

/// Why a connection could not be admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NotAdmitted {
    /// `max_connections` connections are admitted already.
    Full(usize),
    /// The connection was closed meanwhile (evicted, or past its deadline).
    Closed,
}

impl NotAdmitted {
    /// The refusal the client hears: 503 `unavailable`.
    pub(crate) fn into_error(self) -> crate::ApiError {
        let message = match self {
            NotAdmitted::Full(max) => {
                format!("the server is serving its maximum of {max} connections; retry later")
            }
            NotAdmitted::Closed => {
                "this connection is closing: it did not authenticate in time; reconnect".into()
            }
        };
        crate::ApiError::new(crate::ApiErrorKind::Unavailable, message)
    }
}

/// One connection's place in the pools; leaving it (drop) frees the place.
pub(crate) struct Ticket {
    admission: Arc<Admission>,
    id: u64,
    ip: IpAddr,
    deadline: Instant,
    /// Notified when the connection is evicted from the unauthenticated pool, or
    /// admitted (then [`Ticket::unauthenticated_end`] stops watching its deadline, so
    /// an admitted connection's wake-ups poll nothing of it).
    close: Arc<Notify>,
    admitted: std::sync::atomic::AtomicBool,
}

impl Admission {
    /// Pools sized by `limits`, counting in `metrics`.
    pub(crate) fn new(limits: &Limits, metrics: Arc<ConnectionMetrics>) -> Arc<Admission> {
        Arc::new(Admission {
            state: Mutex::new(Pools::default()),
            max_unauthenticated: limits.max_unauthenticated_connections,
            max_connections: limits.max_connections,
            max_per_ip: limits.max_connections_per_ip,
            auth_timeout: limits.auth_timeout,
            metrics,
            ended: Notify::new(),
        })
    }

    /// The pools' state. Critical sections never panic between changes.
    fn lock(&self) -> std::sync::MutexGuard<'_, Pools> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Takes a new connection from `ip` into the unauthenticated pool, closing the
    /// oldest unauthenticated connection if the pool is full.
    pub(crate) fn enter(self: &Arc<Self>, ip: IpAddr) -> Result<Ticket, Refused> {
        let mut pools = self.lock();
        let from_ip = pools.per_ip.get(&ip).copied().unwrap_or(0);
        if from_ip >= self.max_per_ip {
            self.metrics.refused_per_ip.fetch_add(1, Ordering::Relaxed);
            return Err(Refused::PerIp(self.max_per_ip));
        }
        if pools.unauthenticated.len() >= self.max_unauthenticated {
            if let Some((_, close)) = pools.unauthenticated.pop_first() {
                // Stored as a permit: the connection's task sees it even if it is
                // not waiting right now.
                close.notify_one();
                self.metrics
                    .evicted_unauthenticated
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
        let id = pools.next_id;
        pools.next_id += 1;
        let close = Arc::new(Notify::new());
        pools.unauthenticated.insert(id, close.clone());
        *pools.per_ip.entry(ip).or_insert(0) += 1;
        self.gauge(&pools);
        Ok(Ticket {
            admission: self.clone(),
            id,
            ip,
            deadline: Instant::now() + self.auth_timeout,
            close,
            admitted: std::sync::atomic::AtomicBool::new(false),
        })
    }

    fn gauge(&self, pools: &Pools) {
        self.metrics
            .unauthenticated
            .store(pools.unauthenticated.len() as u64, Ordering::Relaxed);
    }

    /// Connections open now, in both pools.
    pub(crate) fn open(&self) -> usize {
        let pools = self.lock();
        pools.per_ip.values().sum()
    }

    /// Waits until every connection has ended, or `within` has passed.
    pub(crate) async fn all_ended(&self, within: Duration) {
        let wait = async {
            loop {
                let ended = self.ended.notified();
                if self.open() == 0 {
                    return;
                }
                ended.await;
            }
        };
        let _ = tokio::time::timeout(within, wait).await;
    }
}

impl Ticket {
    /// Moves the connection to the authenticated pool (once; later calls succeed
    /// at once).
    pub(crate) fn admit(&self) -> Result<(), NotAdmitted> {
        if self.admitted.load(Ordering::Acquire) {
            return Ok(());
        }
        let admission = &self.admission;
        let mut pools = admission.lock();
        if !pools.unauthenticated.contains_key(&self.id) {
            return Err(NotAdmitted::Closed);
        }
        if pools.admitted >= admission.max_connections {
            admission
                .metrics
                .refused_over_cap
                .fetch_add(1, Ordering::Relaxed);
            return Err(NotAdmitted::Full(admission.max_connections));
        }
        pools.unauthenticated.remove(&self.id);
        pools.admitted += 1;
        self.admitted.store(true, Ordering::Release);
        admission.gauge(&pools);
        self.close.notify_one();
        Ok(())
    }

    /// Whether the connection has been admitted.
    pub(crate) fn is_admitted(&self) -> bool {
        self.admitted.load(Ordering::Acquire)
    }

    /// Resolves when the connection must close because it is still unauthenticated:
    /// it was evicted to make room, or its `auth_timeout` passed. Never resolves
    /// once it is admitted. After it resolves the connection can no longer be
    /// admitted, so nothing it sent has reached the engine.
    pub(crate) async fn unauthenticated_end(&self) {
        tokio::select! {
            () = self.close.notified() => {
                if self.is_admitted() {
                    // Pending costs nothing to poll, unlike the deadline's timer.
                    std::future::pending::<()>().await;
                }
                tracing::debug!("closed an unauthenticated connection to make room");
            }
            () = tokio::time::sleep_until(self.deadline) => {
                let admission = &self.admission;
                let timed_out = {
                    let mut pools = admission.lock();
                    let removed = pools.unauthenticated.remove(&self.id).is_some();
                    admission.gauge(&pools);
                    removed
                };
                if !timed_out {
                    // Admitted (or evicted just now, which counted itself).
                    if self.is_admitted() {
                        std::future::pending::<()>().await;
                    }
                    return;
                }
                admission
                    .metrics
                    .closed_auth_timeout
                    .fetch_add(1, Ordering::Relaxed);
                tracing::debug!(
                    auth_timeout = ?admission.auth_timeout,
                    "closed a connection that did not authenticate in time"
                );
            }
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let admission = &self.admission;
        let mut pools = admission.lock();
        if self.is_admitted() {
            pools.admitted -= 1;
        } else if pools.unauthenticated.remove(&self.id).is_some() {
            admission.gauge(&pools);
        }
        if let Some(n) = pools.per_ip.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                pools.per_ip.remove(&self.ip);
            }
        }
        drop(pools);
        admission.ended.notify_waiters();
    }
}

/// The next accepted connection (with `TCP_NODELAY`), or `None` once `stop` has
/// fired. An accept error (out of file descriptors and the like) is logged with
/// `port` and retried after 50 ms: the port keeps serving.
pub(crate) async fn accept_until(
    listener: &tokio::net::TcpListener,
    stop: &mut tokio::sync::oneshot::Receiver<()>,
    port: &str,
) -> Option<(tokio::net::TcpStream, std::net::SocketAddr)> {
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    return Some((stream, peer));
                }
                Err(e) => {
                    tracing::warn!(error = %e, port, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = &mut *stop => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(unauthenticated: usize, connections: usize, per_ip: usize) -> Arc<Admission> {
        let limits = Limits {
            max_unauthenticated_connections: unauthenticated,
            max_connections: connections,
            max_connections_per_ip: per_ip,
            auth_timeout: Duration::from_millis(100),
            ..Limits::default()
        };
        Admission::new(&limits, Arc::new(ConnectionMetrics::default()))
    }

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 1));
    const B: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 2));

    fn ended<F: std::future::Future>(f: F) -> bool {
        use futures_util::FutureExt;
        Box::pin(f).now_or_never().is_some()
    }

    #[tokio::test]
    async fn a_full_unauthenticated_pool_evicts_its_oldest() {
        let a = admission(2, 10, 10);
        let first = a.enter(A).unwrap();
        let second = a.enter(A).unwrap();
        assert!(!ended(first.unauthenticated_end()));
        let third = a.enter(A).unwrap();
        assert!(ended(first.unauthenticated_end()), "the oldest stays");
        assert_eq!(first.admit(), Err(NotAdmitted::Closed));
        assert!(!ended(second.unauthenticated_end()));
        assert_eq!(second.admit(), Ok(()));
        third.admit().unwrap();
        assert_eq!(a.metrics.evicted_unauthenticated.load(Ordering::Relaxed), 1);
        assert_eq!(a.metrics.unauthenticated.load(Ordering::Relaxed), 0);
        drop(first);
        assert_eq!(a.open(), 2);
    }

    #[tokio::test]
    async fn admission_waits_for_room_in_the_authenticated_pool() {
        let a = admission(10, 1, 10);
        let first = a.enter(A).unwrap();
        let second = a.enter(A).unwrap();
        first.admit().unwrap();
        assert_eq!(second.admit(), Err(NotAdmitted::Full(1)));
        drop(first);
        assert_eq!(second.admit(), Ok(()));
    }

    #[tokio::test]
    async fn each_address_has_its_own_cap_across_both_pools() {
        let a = admission(10, 10, 2);
        let one = a.enter(A).unwrap();
        one.admit().unwrap();
        let _two = a.enter(A).unwrap();
        assert_eq!(a.enter(A).err(), Some(Refused::PerIp(2)));
        let _other = a.enter(B).unwrap();
        drop(one);
        let _three = a.enter(A).unwrap();
        assert_eq!(a.metrics.refused_per_ip.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn the_auth_deadline_closes_only_unauthenticated_connections() {
        let a = admission(10, 10, 10);
        let late = a.enter(A).unwrap();
        let admitted = a.enter(A).unwrap();
        admitted.admit().unwrap();
        late.unauthenticated_end().await;
        assert_eq!(late.admit(), Err(NotAdmitted::Closed));
        let never =
            tokio::time::timeout(Duration::from_millis(300), admitted.unauthenticated_end());
        assert!(never.await.is_err());
        assert_eq!(a.metrics.closed_auth_timeout.load(Ordering::Relaxed), 1);
    }
}
