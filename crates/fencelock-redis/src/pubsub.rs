//! One shared pub/sub connection per Redis server, multiplexing the wake-up channels
//! of every lock this backend is waiting for.
//!
//! A waiter [`subscribe`](Subscriber::subscribe)s to a lock's channel and gets a
//! [`Subscription`] only once Redis has confirmed the `SUBSCRIBE`: a release published
//! after that point is never missed. Channels are reference-counted; the last
//! subscription of a channel dropped sends `UNSUBSCRIBE`. Each channel has at most one
//! `SUBSCRIBE` or `UNSUBSCRIBE` in flight, so Redis's confirmations (which come in
//! command order) always match the channel's state.
//!
//! When the connection fails, every channel is dropped at once: each subscription sees
//! [`Subscription::changed`] return `false` and its waiter subscribes again (on a new
//! connection) before its next attempt.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncWriteExt, BufReader};
use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use super::resp::{encode, read_reply, Endpoint, Reply};
use fencelock_backend::{Error, ErrorKind};

/// The subscriber of one backend (stops its connection when dropped).
#[derive(Debug)]
pub(crate) struct Subscriber {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    endpoint: Endpoint,
    max_channels: usize,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// Incremented whenever the connection is given up; tasks and subscriptions of an
    /// older epoch no longer touch the state.
    epoch: u64,
    connected: bool,
    closed: bool,
    channels: HashMap<Vec<u8>, Channel>,
    /// Commands for the writer, in order.
    outbox: Vec<Vec<u8>>,
    /// Wakes this epoch's writer.
    wake_writer: Arc<Notify>,
    /// Set to `true` to stop this epoch's tasks.
    stop: watch::Sender<bool>,
}

#[derive(Debug, PartialEq, Eq, Clone, Copy)]
enum Phase {
    /// `SUBSCRIBE` sent, not yet confirmed.
    Subscribing,
    Subscribed,
    /// `UNSUBSCRIBE` sent, not yet confirmed.
    Unsubscribing,
}

#[derive(Debug)]
struct Channel {
    users: usize,
    phase: Phase,
    confirmed: watch::Sender<bool>,
    /// Count of messages received (only its changes matter).
    messages: watch::Sender<u64>,
    /// When the last `SUBSCRIBE` for it was queued.
    subscribe_sent: Instant,
}

impl State {
    fn send(&mut self, verb: &[u8], channel: &[u8]) {
        let mut out = Vec::new();
        encode(&[verb, channel], &mut out);
        self.outbox.push(out);
        self.wake_writer.notify_one();
    }

    /// Gives the connection up: drops every channel (waking their subscriptions) and
    /// stops the epoch's tasks. A later subscribe connects afresh.
    fn reset(&mut self) {
        self.epoch += 1;
        self.connected = false;
        self.channels.clear();
        self.outbox.clear();
        self.stop.send_replace(true);
        self.stop = watch::channel(false).0;
        self.wake_writer.notify_one();
        self.wake_writer = Arc::new(Notify::new());
    }
}

impl Subscriber {
    pub(crate) fn new(endpoint: Endpoint, max_channels: usize) -> Subscriber {
        let state = State {
            epoch: 0,
            connected: false,
            closed: false,
            channels: HashMap::new(),
            outbox: Vec::new(),
            wake_writer: Arc::new(Notify::new()),
            stop: watch::channel(false).0,
        };
        Subscriber {
            shared: Arc::new(Shared {
                endpoint,
                max_channels,
                state: Mutex::new(state),
            }),
        }
    }

    /// Subscribes to `channel`, returning once Redis confirmed it (at most `timeout`).
    pub(crate) async fn subscribe(
        &self,
        channel: &[u8],
        timeout: Duration,
    ) -> Result<Subscription, Error> {
        let (mut confirmed, subscription) = {
            let mut state = self.shared.lock()?;
            if state.closed {
                return Err(Error::new(
                    ErrorKind::Unavailable,
                    "the redis backend is closed",
                ));
            }
            if !state.channels.contains_key(channel)
                && state.channels.len() >= self.shared.max_channels
            {
                return Err(Error::new(
                    ErrorKind::ResourceExhausted,
                    format!(
                        "this backend already waits on {} locks",
                        self.shared.max_channels
                    ),
                ));
            }
            if !state.connected {
                state.connected = true;
                let epoch = state.epoch;
                let stop = state.stop.subscribe();
                tokio::spawn(run(self.shared.clone(), epoch, stop));
            }
            let epoch = state.epoch;
            if !state.channels.contains_key(channel) {
                state.send(b"SUBSCRIBE", channel);
                state.channels.insert(
                    channel.to_vec(),
                    Channel {
                        users: 0,
                        phase: Phase::Subscribing,
                        subscribe_sent: Instant::now(),
                        confirmed: watch::channel(false).0,
                        messages: watch::channel(0).0,
                    },
                );
            }
            let Some(entry) = state.channels.get_mut(channel) else {
                return Err(Error::new(ErrorKind::Internal, "a channel vanished"));
            };
            entry.users += 1;
            let subscription = Subscription {
                shared: self.shared.clone(),
                channel: channel.to_vec(),
                epoch,
                messages: entry.messages.subscribe(),
            };
            (entry.confirmed.subscribe(), subscription)
        };
        let confirmation = async { confirmed.wait_for(|c| *c).await.is_ok() };
        match tokio::time::timeout(timeout, confirmation).await {
            Ok(true) => Ok(subscription),
            Ok(false) => Err(Error::new(
                ErrorKind::Unavailable,
                "the redis pub/sub connection failed",
            )),
            Err(_) => {
                // A SUBSCRIBE unconfirmed for a whole request timeout means a stalled
                // or broken connection: give it up, so the next waiter connects afresh.
                // (A short wait running out says nothing yet; other waiters share the
                // connection.)
                if let Ok(mut state) = self.shared.lock() {
                    let stalled = state.channels.get(channel).is_some_and(|c| {
                        c.phase == Phase::Subscribing
                            && c.subscribe_sent.elapsed() >= self.shared.endpoint.request_timeout
                    });
                    if state.epoch == subscription.epoch && stalled {
                        state.reset();
                    }
                }
                Err(Error::new(
                    ErrorKind::Unavailable,
                    format!("redis did not confirm a SUBSCRIBE within {timeout:?}"),
                ))
            }
        }
    }

    /// Channels currently subscribed or being subscribed (for tests).
    #[cfg(test)]
    pub(crate) fn channels(&self) -> usize {
        self.shared.lock().map(|s| s.channels.len()).unwrap_or(0)
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        if let Ok(mut state) = self.shared.lock() {
            state.closed = true;
            state.reset();
        }
    }
}

impl Shared {
    fn lock(&self) -> Result<std::sync::MutexGuard<'_, State>, Error> {
        self.state
            .lock()
            .map_err(|_| Error::new(ErrorKind::Internal, "redis subscriber state poisoned"))
    }
}

/// A confirmed subscription to one channel.
#[derive(Debug)]
pub(crate) struct Subscription {
    shared: Arc<Shared>,
    channel: Vec<u8>,
    epoch: u64,
    messages: watch::Receiver<u64>,
}

impl Subscription {
    /// Waits for a message published after the subscription (or after the previous
    /// `changed`). `false` if the connection failed: subscribe again.
    pub(crate) async fn changed(&mut self) -> bool {
        self.messages.changed().await.is_ok()
    }

    /// Whether the connection behind this subscription is gone.
    pub(crate) fn is_dead(&self) -> bool {
        self.messages.has_changed().is_err()
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let Ok(mut state) = self.shared.lock() else {
            return;
        };
        if state.epoch != self.epoch {
            return;
        }
        let Some(entry) = state.channels.get_mut(&self.channel) else {
            return;
        };
        entry.users = entry.users.saturating_sub(1);
        if entry.users == 0 && entry.phase == Phase::Subscribed {
            entry.phase = Phase::Unsubscribing;
            entry.confirmed.send_replace(false);
            state.send(b"UNSUBSCRIBE", &self.channel);
        }
    }
}

/// Runs one connection (one epoch): connects, then writes the outbox and reads
/// confirmations and messages until it fails or is stopped.
async fn run(shared: Arc<Shared>, epoch: u64, mut stop: watch::Receiver<bool>) {
    let stream = tokio::select! {
        stream = shared.endpoint.connect() => stream,
        _ = stop.wait_for(|s| *s) => return,
    };
    let Ok(stream) = stream else {
        give_up(&shared, epoch);
        return;
    };
    let (read, mut write) = stream.into_split();
    let mut read = BufReader::new(read);
    let wake = match shared.lock() {
        Ok(state) if state.epoch == epoch => state.wake_writer.clone(),
        _ => return,
    };
    let writer = {
        let shared = shared.clone();
        let mut stop = stop.clone();
        async move {
            loop {
                let out: Vec<u8> = match shared.lock() {
                    Ok(mut state) if state.epoch == epoch => {
                        state.outbox.drain(..).flatten().collect()
                    }
                    _ => return,
                };
                if !out.is_empty() && write.write_all(&out).await.is_err() {
                    give_up(&shared, epoch);
                    return;
                }
                tokio::select! {
                    _ = wake.notified() => {}
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
        }
    };
    let reader = async {
        loop {
            let reply = tokio::select! {
                reply = read_reply(&mut read) => reply,
                _ = stop.wait_for(|s| *s) => return,
            };
            let handled = match reply {
                Ok(reply) => handle(&shared, epoch, reply),
                Err(_) => false,
            };
            if !handled {
                give_up(&shared, epoch);
                return;
            }
        }
    };
    tokio::join!(writer, reader);
}

fn give_up(shared: &Shared, epoch: u64) {
    if let Ok(mut state) = shared.lock() {
        if state.epoch == epoch {
            state.reset();
        }
    }
}

/// Applies one push message; `false` if it makes no sense (the connection is then
/// given up).
fn handle(shared: &Shared, epoch: u64, reply: Reply) -> bool {
    let Ok(mut state) = shared.lock() else {
        return false;
    };
    if state.epoch != epoch {
        return true;
    }
    let Reply::Array(Some(items)) = reply else {
        return false;
    };
    let (Some(Reply::Bulk(Some(kind))), Some(Reply::Bulk(Some(channel)))) =
        (items.first(), items.get(1))
    else {
        return false;
    };
    let Some(entry) = state.channels.get_mut(channel.as_slice()) else {
        // A message for a channel already given up: harmless.
        return kind.as_slice() == b"message";
    };
    match (kind.as_slice(), entry.phase) {
        (b"message", _) => {
            entry.messages.send_modify(|n| *n = n.wrapping_add(1));
        }
        (b"subscribe", Phase::Subscribing) => {
            if entry.users == 0 {
                entry.phase = Phase::Unsubscribing;
                let channel = channel.clone();
                state.send(b"UNSUBSCRIBE", &channel);
            } else {
                entry.phase = Phase::Subscribed;
                entry.confirmed.send_replace(true);
            }
        }
        (b"unsubscribe", Phase::Unsubscribing) => {
            if entry.users == 0 {
                state.channels.remove(channel.as_slice());
            } else {
                entry.phase = Phase::Subscribing;
                entry.subscribe_sent = Instant::now();
                let channel = channel.clone();
                state.send(b"SUBSCRIBE", &channel);
            }
        }
        _ => return false,
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resp::Pool;

    fn endpoint(port: u16) -> Endpoint {
        Endpoint {
            addr: format!("127.0.0.1:{port}"),
            username: None,
            password: None,
            database: 0,
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(5),
        }
    }

    async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
        let until = tokio::time::Instant::now() + Duration::from_secs(10);
        while !condition() {
            assert!(tokio::time::Instant::now() < until, "never: {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Two waiters share one channel; a message wakes both; the channel is given up
    /// (UNSUBSCRIBE confirmed) once both are gone; a killed connection wakes its
    /// subscriptions with `false`, and subscribing again reconnects.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn channels_are_shared_counted_and_survive_a_killed_connection() {
        let redis = tokio::task::spawn_blocking(fencelock_testkit::Redis::start)
            .await
            .expect("start task")
            .expect("redis starts");
        let pool = Pool::new(endpoint(redis.port()), 2);
        let subscriber = Subscriber::new(endpoint(redis.port()), 8);
        let timeout = Duration::from_secs(5);
        let mut a = subscriber.subscribe(b"wake:x", timeout).await.expect("a");
        let mut b = subscriber.subscribe(b"wake:x", timeout).await.expect("b");
        assert_eq!(subscriber.channels(), 1);
        let numsub = pool
            .command(&[b"PUBSUB", b"NUMSUB", b"wake:x"])
            .await
            .expect("numsub");
        assert_eq!(
            numsub,
            Reply::Array(Some(vec![
                Reply::Bulk(Some(b"wake:x".to_vec())),
                Reply::Int(1)
            ])),
            "one server-side subscription for both waiters"
        );
        pool.command(&[b"PUBLISH", b"wake:x", b"released"])
            .await
            .expect("publish");
        assert!(a.changed().await && b.changed().await);
        drop(a);
        assert_eq!(subscriber.channels(), 1, "b still waits");
        drop(b);
        eventually("the channel is given up", || subscriber.channels() == 0).await;

        let mut c = subscriber.subscribe(b"wake:y", timeout).await.expect("c");
        pool.command(&[b"CLIENT", b"KILL", b"TYPE", b"pubsub"])
            .await
            .expect("kill");
        assert!(
            !c.changed().await,
            "a killed connection must wake its waiters"
        );
        assert!(c.is_dead());
        let mut d = subscriber.subscribe(b"wake:y", timeout).await.expect("d");
        pool.command(&[b"PUBLISH", b"wake:y", b"released"])
            .await
            .expect("publish");
        assert!(d.changed().await, "the new connection receives messages");
    }

    /// A server that accepts connections and never answers: subscriptions stay
    /// unconfirmed, the channel bound refuses more, a short wait running out leaves
    /// the shared connection alone, and a SUBSCRIBE unconfirmed for a whole request
    /// timeout gives it up.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_channel_bound_holds_and_a_silent_server_is_given_up() {
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = silent.local_addr().expect("address").port();
        let accepted = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = silent.accept().await {
                held.push(socket);
            }
        });
        let mut stalled = endpoint(port);
        stalled.request_timeout = Duration::from_millis(600);
        let subscriber = Subscriber::new(stalled, 1);
        let e = subscriber
            .subscribe(b"a", Duration::from_millis(100))
            .await
            .expect_err("never confirmed");
        assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
        assert_eq!(
            subscriber.channels(),
            1,
            "a short wait reset the connection"
        );
        let e = subscriber
            .subscribe(b"b", Duration::from_secs(5))
            .await
            .expect_err("over the bound");
        assert_eq!(e.kind(), ErrorKind::ResourceExhausted, "{e}");
        let e = subscriber
            .subscribe(b"a", Duration::from_secs(1))
            .await
            .expect_err("never confirmed");
        assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
        assert_eq!(
            subscriber.channels(),
            0,
            "the stalled connection was given up"
        );
        accepted.abort();
    }
}
