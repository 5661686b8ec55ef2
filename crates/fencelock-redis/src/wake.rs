//! Wake-ups: one pub/sub connection per backend (the redis crate's `aio::PubSub`),
//! opened on the first wait and shared by every lock the backend waits on.
//!
//! A waiter [`subscribe`](Subscriber::subscribe)s to a lock's channel and gets a
//! [`Subscription`] once Redis has confirmed the `SUBSCRIBE`: a release published
//! after that point is never missed. Channels are reference-counted; the last
//! subscription of a channel dropped sends `UNSUBSCRIBE`. Every `SUBSCRIBE` and
//! `UNSUBSCRIBE` is decided and sent under one lock, so they reach Redis in the order
//! the channel's state changed.
//!
//! When the connection fails (or a `SUBSCRIBE` is not confirmed in time), every
//! channel is dropped at once: each subscription turns dead
//! ([`Subscription::is_dead`]) and its waiter subscribes again, on a new connection,
//! before its next attempt.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::{PubSubSink, PubSubStream};
use tokio::sync::{oneshot, watch};

use crate::conn::{map_error, SentinelMaster};
use fencelock_backend::{Error, ErrorKind};

/// Where the pub/sub connection goes.
pub(crate) enum WakeSource {
    /// No pub/sub connection: waiters sleep on the holder's remaining lease, bounded
    /// by the poll interval.
    Off,
    /// This server (for a cluster: any node; a `PUBLISH` reaches every node).
    Client(Box<redis::Client>),
    /// The master Sentinel names at connect time.
    Sentinel(Arc<SentinelMaster>),
}

/// The subscriber of one backend (stops its connection when dropped).
pub(crate) struct Subscriber {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscriber")
            .field("enabled", &self.enabled())
            .finish_non_exhaustive()
    }
}

struct Shared {
    source: WakeSource,
    max_channels: usize,
    state: Mutex<State>,
    /// The open connection's sending half; held while a `SUBSCRIBE` or `UNSUBSCRIBE`
    /// is decided and sent.
    connection: tokio::sync::Mutex<Option<Connection>>,
}

struct Connection {
    generation: u64,
    sink: PubSubSink,
    /// Dropped to stop the connection's reader task (and with it the connection).
    _stop: oneshot::Sender<()>,
}

struct State {
    /// Incremented whenever a connection is given up.
    generation: u64,
    next_id: u64,
    channels: HashMap<String, Channel>,
}

struct Channel {
    id: u64,
    users: usize,
    subscribed: bool,
    /// Count of messages received (only its changes matter).
    messages: watch::Sender<u64>,
}

impl State {
    /// Gives the connection of `generation` up: every channel goes (their
    /// subscriptions turn dead).
    fn reset(&mut self, generation: u64) {
        if self.generation == generation {
            self.generation += 1;
            self.channels.clear();
        }
    }
}

impl Subscriber {
    pub(crate) fn new(source: WakeSource, max_channels: usize) -> Subscriber {
        Subscriber {
            shared: Arc::new(Shared {
                source,
                max_channels: max_channels.max(1),
                state: Mutex::new(State {
                    generation: 0,
                    next_id: 0,
                    channels: HashMap::new(),
                }),
                connection: tokio::sync::Mutex::new(None),
            }),
        }
    }

    /// Whether waiters are woken by releases (else they poll).
    pub(crate) fn enabled(&self) -> bool {
        !matches!(self.shared.source, WakeSource::Off)
    }

    /// Subscribes to `channel`, returning once Redis confirmed it (at most `timeout`).
    pub(crate) async fn subscribe(
        &self,
        channel: &str,
        timeout: Duration,
    ) -> Result<Subscription, Error> {
        let subscription = {
            let mut state = lock(&self.shared.state)?;
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
            let id = state.next_id;
            state.next_id += 1;
            let entry = state
                .channels
                .entry(channel.to_owned())
                .or_insert_with(|| Channel {
                    id,
                    users: 0,
                    subscribed: false,
                    messages: watch::channel(0).0,
                });
            entry.users += 1;
            Subscription {
                shared: self.shared.clone(),
                channel: channel.to_owned(),
                id: entry.id,
                messages: entry.messages.subscribe(),
            }
        };
        match tokio::time::timeout(timeout, self.confirm(&subscription)).await {
            Ok(Ok(())) => Ok(subscription),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(Error::new(
                ErrorKind::Unavailable,
                format!("redis did not confirm a SUBSCRIBE within {timeout:?}"),
            )),
        }
    }

    /// Sends the channel's `SUBSCRIBE` unless it was confirmed before (connecting
    /// first if needed).
    async fn confirm(&self, subscription: &Subscription) -> Result<(), Error> {
        let shared = &self.shared;
        let mut connection = shared.connection.lock().await;
        let generation = {
            let state = lock(&shared.state)?;
            match state.channels.get(&subscription.channel) {
                Some(c) if c.id == subscription.id && c.subscribed => return Ok(()),
                Some(c) if c.id == subscription.id => {}
                _ => {
                    return Err(Error::new(
                        ErrorKind::Unavailable,
                        "the redis pub/sub connection failed",
                    ))
                }
            }
            state.generation
        };
        if connection
            .as_ref()
            .is_none_or(|c| c.generation != generation)
        {
            *connection = None;
            *connection = Some(connect(shared, generation).await?);
        }
        let Some(open) = connection.as_mut() else {
            return Err(Error::new(ErrorKind::Internal, "no pub/sub connection"));
        };
        // Given up below if it fails or times out, so a stalled connection is not
        // reused.
        let guard = ResetOnDrop {
            shared,
            generation,
            armed: true,
        };
        let sent = open.sink.subscribe(&subscription.channel).await;
        if let Err(e) = sent {
            drop(guard);
            *connection = None;
            return Err(map_error(e));
        }
        let mut guard = guard;
        guard.armed = false;
        let mut state = lock(&shared.state)?;
        if let Some(c) = state.channels.get_mut(&subscription.channel) {
            if c.id == subscription.id {
                c.subscribed = true;
            }
        }
        Ok(())
    }
}

/// Gives the connection up unless disarmed (a cancelled or failed `SUBSCRIBE`).
struct ResetOnDrop<'a> {
    shared: &'a Shared,
    generation: u64,
    armed: bool,
}

impl Drop for ResetOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            if let Ok(mut state) = self.shared.state.lock() {
                state.reset(self.generation);
            }
        }
    }
}

/// Opens the pub/sub connection of `generation` and starts its reader.
async fn connect(shared: &Arc<Shared>, generation: u64) -> Result<Connection, Error> {
    let client = match &shared.source {
        WakeSource::Off => {
            return Err(Error::new(
                ErrorKind::Internal,
                "wake-ups are off for this backend",
            ))
        }
        WakeSource::Client(client) => (**client).clone(),
        WakeSource::Sentinel(master) => master.master_client().await?,
    };
    let pubsub = client.get_async_pubsub().await.map_err(map_error)?;
    let (sink, stream) = pubsub.split();
    let (stop, stopped) = oneshot::channel();
    tokio::spawn(read(Arc::downgrade(shared), generation, stream, stopped));
    Ok(Connection {
        generation,
        sink,
        _stop: stop,
    })
}

/// Delivers the messages of one connection until it ends or is given up.
async fn read(
    shared: Weak<Shared>,
    generation: u64,
    mut stream: PubSubStream,
    mut stopped: oneshot::Receiver<()>,
) {
    loop {
        let message = tokio::select! {
            message = stream.next() => message,
            _ = &mut stopped => None,
        };
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let Ok(mut state) = shared.state.lock() else {
            return;
        };
        let Some(message) = message else {
            state.reset(generation);
            return;
        };
        if state.generation != generation {
            return;
        }
        if let Some(channel) = state.channels.get(message.get_channel_name()) {
            channel.messages.send_modify(|n| *n = n.wrapping_add(1));
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> Result<std::sync::MutexGuard<'_, T>, Error> {
    mutex
        .lock()
        .map_err(|_| Error::new(ErrorKind::Internal, "the pub/sub state was poisoned"))
}

/// One waiter's interest in a channel; `UNSUBSCRIBE`s it when the last one goes.
pub(crate) struct Subscription {
    shared: Arc<Shared>,
    channel: String,
    id: u64,
    messages: watch::Receiver<u64>,
}

impl Subscription {
    /// True once the connection failed: the waiter must subscribe again.
    pub(crate) fn is_dead(&self) -> bool {
        self.messages.has_changed().is_err()
    }

    /// Resolves on the next message (or at once if the subscription is dead).
    pub(crate) async fn changed(&mut self) {
        let _ = self.messages.changed().await;
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let Ok(mut state) = self.shared.state.lock() else {
            return;
        };
        let Some(channel) = state.channels.get_mut(&self.channel) else {
            return;
        };
        if channel.id != self.id {
            return;
        }
        channel.users = channel.users.saturating_sub(1);
        if channel.users > 0 {
            return;
        }
        state.channels.remove(&self.channel);
        drop(state);
        // Without a runtime the server keeps the subscription until the connection
        // closes; messages for it are ignored.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let shared = self.shared.clone();
            let name = std::mem::take(&mut self.channel);
            runtime.spawn(async move { unsubscribe(&shared, name).await });
        }
    }
}

/// Sends `UNSUBSCRIBE` unless a new subscription of the channel was made meanwhile.
async fn unsubscribe(shared: &Shared, channel: String) {
    let mut connection = shared.connection.lock().await;
    let generation = {
        let Ok(state) = shared.state.lock() else {
            return;
        };
        if state.channels.contains_key(&channel) {
            return;
        }
        state.generation
    };
    if let Some(open) = connection.as_mut().filter(|c| c.generation == generation) {
        // A failure here shows on the next SUBSCRIBE or in the reader.
        let _ = tokio::time::timeout(Duration::from_secs(5), open.sink.unsubscribe(&channel)).await;
    }
}
