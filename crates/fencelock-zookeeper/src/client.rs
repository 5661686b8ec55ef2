//! The backend's view of one ZooKeeper session: a `zookeeper_client::Client` (which
//! speaks the protocol, pings, reconnects and re-registers watches), with the states
//! the recipe needs, bounded waits, and a count of requests in flight.
//!
//! **Session states.** `Connected`; `Suspended` = the connection is gone but the
//! session may still live on the server (requests fail as disconnected, nothing is
//! known about the lease); `Lost` = the session expired (the server said so on a
//! reconnect, or `zookeeper-client` gave up reconnecting, which it does 7/5 of the
//! session timeout after it last heard from the server) or failed authentication;
//! `Closed` = the client was closed.
//!
//! **Invariant:** a successful answer to a request proves the session was alive when
//! the server processed it, which is after the request was sent; the server expires a
//! session no earlier than its timeout after the last request it processed.

use std::collections::HashSet;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{watch, Semaphore};
use tokio::time::Instant;
use zookeeper_client as zk;

/// Where a session stands (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum State {
    Connected,
    Suspended,
    Lost,
    Closed,
}

/// Why a request did not get an ordinary answer.
#[derive(Debug, Clone)]
pub(super) enum Fault {
    /// No connection now, or it dropped before the answer: the session may be alive,
    /// and the request may or may not have been applied.
    Disconnected,
    /// The session expired.
    Lost,
    /// The session was closed.
    Closed,
    /// Too many requests in flight on this session.
    Busy,
    /// The server answered with this error (or the client refused the request).
    Server(zk::Error),
}

/// One ZooKeeper session and what the recipe keeps about it.
#[derive(Debug)]
pub(super) struct Session {
    client: zk::Client,
    timeout: Duration,
    in_flight: Semaphore,
    /// Node-name prefixes whose nodes are being deleted in the background.
    retiring: watch::Sender<HashSet<String>>,
    /// Node events (deletions, changes) that woke a waiter.
    watch_events: AtomicU64,
    /// Nodes watched by this session's waiters right now.
    watching: AtomicUsize,
}

impl Session {
    /// Wraps a connected client.
    pub fn new(client: zk::Client, max_in_flight: usize) -> Session {
        Session {
            timeout: client.session_timeout(),
            client,
            in_flight: Semaphore::new(max_in_flight),
            retiring: watch::Sender::new(HashSet::new()),
            watch_events: AtomicU64::new(0),
            watching: AtomicUsize::new(0),
        }
    }

    /// The session id.
    pub fn id(&self) -> i64 {
        self.client.session_id().0
    }

    /// The session timeout the server granted.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The ZooKeeper client.
    #[cfg(test)]
    pub fn client(&self) -> &zk::Client {
        &self.client
    }

    /// The current state.
    pub fn state(&self) -> State {
        state(self.client.state())
    }

    /// Waits until the session is connected (or has ended), at most until `until`.
    pub async fn connected(&self, until: Instant) -> Result<(), Fault> {
        let mut states = self.client.state_watcher();
        let mut current = states.peek_state();
        let settled = async {
            while state(current) == State::Suspended {
                current = states.changed().await;
            }
            state(current)
        };
        match tokio::time::timeout_at(until, settled).await {
            Err(_) | Ok(State::Suspended) => Err(Fault::Disconnected),
            Ok(State::Connected) => Ok(()),
            Ok(State::Lost) => Err(Fault::Lost),
            Ok(State::Closed) => Err(Fault::Closed),
        }
    }

    /// Once connected (waiting at most until `connect_by`), sends the request `start`
    /// makes and waits for its answer. `zookeeper-client` sends a request when its
    /// future is made, so it is made only after the wait.
    pub async fn run<'a, T, F>(
        &'a self,
        connect_by: Instant,
        start: impl FnOnce(&'a zk::Client) -> F,
    ) -> Result<T, Fault>
    where
        F: Future<Output = Result<T, zk::Error>> + 'a,
    {
        let _permit = self.in_flight.try_acquire().map_err(|_| Fault::Busy)?;
        self.connected(connect_by).await?;
        // The client fails a request in flight when it declares the connection dead
        // (2/5 of the session timeout without a byte from the server); this bound only
        // guards against a request that waits in its queue for a reconnect.
        match tokio::time::timeout(self.timeout, start(&self.client)).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(fault(e)),
            Err(_) => Err(Fault::Disconnected),
        }
    }

    /// Counts a waiter's wake-up by a node event.
    pub fn woken(&self) {
        self.watch_events.fetch_add(1, Ordering::Relaxed);
    }

    /// Node events that woke a waiter so far.
    #[cfg(test)]
    pub fn watch_events(&self) -> u64 {
        self.watch_events.load(Ordering::Relaxed)
    }

    /// Counts `count` nodes as watched by a waiter until the guard is dropped.
    pub fn watching(&self, count: usize) -> Watching<'_> {
        self.watching.fetch_add(count, Ordering::Relaxed);
        Watching {
            session: self,
            count,
        }
    }

    /// Nodes watched by this session's waiters right now.
    #[cfg(test)]
    pub fn watch_count(&self) -> usize {
        self.watching.load(Ordering::Relaxed)
    }

    /// Marks `key` as being retired; false if it already is.
    pub fn begin_retire(&self, key: &str) -> bool {
        self.retiring
            .send_if_modified(|keys| keys.insert(key.to_owned()))
    }

    /// Ends the retirement of `key`.
    pub fn end_retire(&self, key: &str) {
        self.retiring.send_if_modified(|keys| keys.remove(key));
    }

    /// Waits until `key` is not being retired, at most until `until`; false on time-out.
    pub async fn retired(&self, key: &str, until: Instant) -> bool {
        let mut keys = self.retiring.subscribe();
        let done = async { keys.wait_for(|keys| !keys.contains(key)).await.is_ok() };
        matches!(tokio::time::timeout_at(until, done).await, Ok(true))
    }
}

/// Nodes a waiter watches, counted while it waits.
pub(super) struct Watching<'a> {
    session: &'a Session,
    count: usize,
}

impl Drop for Watching<'_> {
    fn drop(&mut self) {
        self.session
            .watching
            .fetch_sub(self.count, Ordering::Relaxed);
    }
}

fn state(state: zk::SessionState) -> State {
    match state {
        zk::SessionState::SyncConnected | zk::SessionState::ConnectedReadOnly => State::Connected,
        zk::SessionState::Disconnected => State::Suspended,
        zk::SessionState::Expired | zk::SessionState::AuthFailed => State::Lost,
        zk::SessionState::Closed => State::Closed,
    }
}

fn fault(e: zk::Error) -> Fault {
    match e {
        // When the client gives up on a connection it fails the requests in flight
        // with the reason it gave up (an I/O error, "no response from connection"),
        // which are client-made errors, never a server's answer.
        zk::Error::ConnectionLoss
        | zk::Error::Timeout
        | zk::Error::Custom(_)
        | zk::Error::UnexpectedError(_) => Fault::Disconnected,
        zk::Error::SessionExpired | zk::Error::SessionMoved => Fault::Lost,
        zk::Error::ClientClosed => Fault::Closed,
        other => Fault::Server(other),
    }
}
