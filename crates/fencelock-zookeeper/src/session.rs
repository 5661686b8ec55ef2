//! One ZooKeeper session over tokio: a task owns the connection, matches replies to
//! requests by xid (many in flight), delivers watch events, pings at a third of the
//! negotiated timeout and reconnects with the session's id and password.
//!
//! **Session states.** `Connected`; `Suspended` = the connection is gone but the
//! session may still live on the server (requests fail as disconnected, nothing is
//! known about the lease); `Lost` = the server said the session expired, or no server
//! answered for a whole session timeout since the last reply (as Curator does: after
//! that long the server may have expired it, so it is treated as expired and never
//! resumed); `Closed` = the owner dropped the session and it was closed on the server.
//!
//! **Invariant:** a `Connected` answer to a request proves the session was alive when
//! the server processed it, which is after the request was sent; the server expires a
//! session no earlier than its timeout after the last request it processed.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, watch, Notify, Semaphore};
use tokio::time::Instant;

use super::jute::{self, code, op, xid, Reader};

/// Where a session connects and how hard it tries.
#[derive(Debug)]
pub(super) struct Dial {
    /// `host:port` of each server, tried in turn.
    pub servers: Vec<String>,
    /// Longest wait for one connection and handshake when opening a session.
    pub connect_timeout: Duration,
    /// Requests one session may have in flight.
    pub max_in_flight: usize,
}

/// Where a session stands (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum State {
    Connected,
    Suspended,
    Lost,
    Closed,
}

/// Why a request did not get an answer.
#[derive(Debug, Clone)]
pub(super) enum Fault {
    /// No connection now, or it dropped before the answer: the session may be alive,
    /// and the request may or may not have been applied.
    Disconnected,
    /// The session expired, or was given up (see [`State::Lost`]).
    Lost,
    /// The session was closed by its owner.
    Closed,
    /// Too many requests or watches in flight on this session.
    Busy,
    /// The server answered with this error code.
    Server(i32),
    /// The server could not be reached to open a session.
    Unreachable(String),
    /// The server sent something this client does not understand.
    Protocol(String),
}

/// Longest wait for the server's answer to `closeSession` when a session is dropped.
const CLOSE_WAIT: Duration = Duration::from_secs(1);
/// Most watch registrations one session keeps (each waiter holds at most its limit).
const MAX_WATCHES: usize = 1 << 16;
/// Bytes read from the socket at a time.
const READ_CHUNK: usize = 64 * 1024;

/// A ZooKeeper session. Dropping it closes the session on the server (deleting its
/// ephemeral nodes) if the server can be reached.
#[derive(Debug)]
pub(super) struct Session {
    shared: Arc<Shared>,
    commands: mpsc::Sender<Call>,
}

#[derive(Debug)]
struct Shared {
    id: i64,
    timeout: Duration,
    state: watch::Sender<State>,
    watches: Mutex<Watches>,
    in_flight: Semaphore,
    watch_events: AtomicU64,
    /// Node-name prefixes whose nodes are being deleted in the background.
    retiring: watch::Sender<HashSet<String>>,
}

#[derive(Debug, Default)]
struct Watches {
    next_id: u64,
    count: usize,
    by_path: HashMap<String, Vec<(u64, Arc<Notify>)>>,
}

#[derive(Debug)]
struct Call {
    op: i32,
    body: Vec<u8>,
    reply: Reply,
}

/// Where a call's answer goes: the reply's error code and body, or why none came.
type Reply = oneshot::Sender<Result<(i32, Vec<u8>), Fault>>;

/// How a connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Broken,
    Expired,
    Closed,
}

impl Session {
    /// Opens a new session asking for `timeout_ms`, trying each server in turn from a
    /// random one (spreading clients over an ensemble).
    pub async fn open(dial: Arc<Dial>, timeout_ms: i32) -> Result<Session, Fault> {
        let mut last_error = String::from("no servers configured");
        let count = dial.servers.len();
        let first = random_index(count);
        for server in (0..count).map(|i| &dial.servers[(first + i) % count]) {
            let attempt = handshake(server, timeout_ms, 0, &[0; 16], 0);
            match tokio::time::timeout(dial.connect_timeout, attempt).await {
                Ok(Ok(Some(est))) => return Ok(Session::start(dial.clone(), est, timeout_ms)),
                Ok(Ok(None)) => last_error = format!("{server} refused to open a session"),
                Ok(Err(e)) => last_error = format!("{server}: {e}"),
                Err(_) => {
                    last_error = format!("{server}: no handshake within {:?}", dial.connect_timeout)
                }
            }
        }
        Err(Fault::Unreachable(last_error))
    }

    fn start(dial: Arc<Dial>, est: Established, timeout_ms: i32) -> Session {
        let timeout = Duration::from_millis(u64::try_from(est.timeout_ms).unwrap_or(0));
        let shared = Arc::new(Shared {
            id: est.session_id,
            timeout,
            state: watch::Sender::new(State::Connected),
            watches: Mutex::new(Watches::default()),
            in_flight: Semaphore::new(dial.max_in_flight),
            watch_events: AtomicU64::new(0),
            retiring: watch::Sender::new(HashSet::new()),
        });
        let (commands, inbox) = mpsc::channel(dial.max_in_flight.max(1));
        let task = Task {
            shared: shared.clone(),
            dial,
            password: est.password,
            timeout_ms,
            last_zxid: 0,
        };
        tokio::spawn(task.run(est.conn, inbox));
        Session { shared, commands }
    }

    /// The session id.
    pub fn id(&self) -> i64 {
        self.shared.id
    }

    /// The timeout the server granted.
    pub fn timeout(&self) -> Duration {
        self.shared.timeout
    }

    /// The current state.
    pub fn state(&self) -> State {
        *self.shared.state.borrow()
    }

    /// Watch notifications received so far.
    #[cfg(test)]
    pub fn watch_events(&self) -> u64 {
        self.shared.watch_events.load(Ordering::Relaxed)
    }

    /// Watch registrations held by this session's waiters.
    #[cfg(test)]
    pub fn watch_count(&self) -> usize {
        lock(&self.shared.watches).count
    }

    /// Waits until the session is connected (or lost), at most until `until`.
    pub async fn connected(&self, until: Instant) -> Result<(), Fault> {
        let mut states = self.shared.state.subscribe();
        let settled = async {
            let state = states.wait_for(|s| *s != State::Suspended).await;
            state.map(|s| *s)
        };
        match tokio::time::timeout_at(until, settled).await {
            Err(_) => Err(Fault::Disconnected),
            Ok(Err(_)) => Err(Fault::Closed),
            Ok(Ok(State::Connected)) => Ok(()),
            Ok(Ok(State::Lost)) => Err(Fault::Lost),
            Ok(Ok(State::Closed | State::Suspended)) => Err(Fault::Closed),
        }
    }

    /// Sends one request once connected (waiting at most until `connect_by`) and
    /// returns the reply body; a non-zero error code is a [`Fault`].
    pub async fn call(
        &self,
        op: i32,
        body: Vec<u8>,
        connect_by: Instant,
    ) -> Result<Vec<u8>, Fault> {
        let _permit = self
            .shared
            .in_flight
            .try_acquire()
            .map_err(|_| Fault::Busy)?;
        self.connected(connect_by).await?;
        let (reply, answer) = oneshot::channel();
        if self.commands.send(Call { op, body, reply }).await.is_err() {
            return Err(self.gone());
        }
        // The task answers every call, at the latest when it declares the connection
        // dead (two thirds of the timeout without a byte from the server).
        match tokio::time::timeout(self.shared.timeout, answer).await {
            Ok(Ok(Ok((code::OK, body)))) => Ok(body),
            Ok(Ok(Ok((code::SESSION_EXPIRED, _)))) => Err(Fault::Lost),
            Ok(Ok(Ok((code::CONNECTION_LOSS, _)))) => Err(Fault::Disconnected),
            Ok(Ok(Ok((err, _)))) => Err(Fault::Server(err)),
            Ok(Ok(Err(fault))) => Err(fault),
            Ok(Err(_)) => Err(self.gone()),
            Err(_) => Err(Fault::Disconnected),
        }
    }

    fn gone(&self) -> Fault {
        match self.state() {
            State::Lost => Fault::Lost,
            State::Closed => Fault::Closed,
            State::Connected | State::Suspended => Fault::Disconnected,
        }
    }

    /// A handle to wait for deletions of nodes watched with `getData(watch)`.
    pub fn watcher(&self) -> Watcher {
        let mut watches = lock(&self.shared.watches);
        watches.next_id += 1;
        Watcher {
            shared: self.shared.clone(),
            id: watches.next_id,
            notify: Arc::new(Notify::new()),
            paths: Vec::new(),
        }
    }

    /// Marks `key` as being retired; false if it already is.
    pub fn begin_retire(&self, key: &str) -> bool {
        self.shared
            .retiring
            .send_if_modified(|keys| keys.insert(key.to_owned()))
    }

    /// Ends the retirement of `key`.
    pub fn end_retire(&self, key: &str) {
        self.shared
            .retiring
            .send_if_modified(|keys| keys.remove(key));
    }

    /// Waits until `key` is not being retired, at most until `until`; false on time-out.
    pub async fn retired(&self, key: &str, until: Instant) -> bool {
        let mut keys = self.shared.retiring.subscribe();
        let done = async { keys.wait_for(|keys| !keys.contains(key)).await.is_ok() };
        matches!(tokio::time::timeout_at(until, done).await, Ok(true))
    }
}

/// Wakes one waiter when any node it watches is deleted or changed, or when the
/// session's connection changes (watches do not survive a reconnect; the waiter looks
/// again). Its registrations are removed when it is dropped.
#[derive(Debug)]
pub(super) struct Watcher {
    shared: Arc<Shared>,
    id: u64,
    notify: Arc<Notify>,
    paths: Vec<String>,
}

impl Watcher {
    /// Registers interest in `path` (before asking the server to watch it, so that no
    /// notification can be missed).
    pub fn watch(&mut self, path: &str) -> Result<(), Fault> {
        let mut watches = lock(&self.shared.watches);
        if watches.count >= MAX_WATCHES {
            return Err(Fault::Busy);
        }
        watches.count += 1;
        let entry = (self.id, self.notify.clone());
        watches
            .by_path
            .entry(path.to_owned())
            .or_default()
            .push(entry);
        self.paths.push(path.to_owned());
        Ok(())
    }

    /// Drops every registration (before registering a new set).
    pub fn reset(&mut self) {
        let mut watches = lock(&self.shared.watches);
        for path in self.paths.drain(..) {
            if let Some(list) = watches.by_path.get_mut(&path) {
                let before = list.len();
                list.retain(|(id, _)| *id != self.id);
                let removed = before - list.len();
                watches.count -= removed;
                if watches.by_path.get(&path).is_some_and(Vec::is_empty) {
                    watches.by_path.remove(&path);
                }
            }
        }
    }

    /// Resolves once a watched node changed or the connection changed since the last
    /// call (a wake-up that arrived earlier is kept).
    pub async fn changed(&self) {
        self.notify.notified().await;
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.reset();
    }
}

impl Shared {
    fn set_state(&self, state: State) {
        self.state.send_replace(state);
        self.fire_all();
    }

    fn fire(&self, path: &str) {
        self.watch_events.fetch_add(1, Ordering::Relaxed);
        let mut watches = lock(&self.watches);
        if let Some(list) = watches.by_path.remove(path) {
            watches.count -= list.len();
            list.iter().for_each(|(_, notify)| notify.notify_one());
        }
    }

    fn fire_all(&self) {
        let mut watches = lock(&self.watches);
        watches.count = 0;
        for (_, list) in watches.by_path.drain() {
            list.iter().for_each(|(_, notify)| notify.notify_one());
        }
    }
}

/// A random index below `count` (0 when `count` is 0).
fn random_index(count: usize) -> usize {
    let count = u64::try_from(count).unwrap_or(u64::MAX).max(1);
    usize::try_from(fencelock_backend::random_u64() % count).unwrap_or(0)
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The data behind these mutexes stays consistent at every await-free step.
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// One TCP connection to a server, with a buffer of bytes read but not yet parsed.
struct Conn {
    reader: OwnedReadHalf,
    writer: OwnedWriteHalf,
    buf: Vec<u8>,
    chunk: Box<[u8]>,
}

impl Conn {
    /// Reads more bytes (cancel-safe); false at end of stream.
    async fn fill(&mut self) -> std::io::Result<bool> {
        let n = self.reader.read(&mut self.chunk).await?;
        self.buf.extend_from_slice(&self.chunk[..n]);
        Ok(n > 0)
    }

    /// The next complete frame in the buffer, if any.
    fn next_frame(&mut self) -> Result<Option<Vec<u8>>, String> {
        let Some(head) = self.buf.get(..4) else {
            return Ok(None);
        };
        let len = i32::from_be_bytes([head[0], head[1], head[2], head[3]]);
        let len = usize::try_from(len)
            .ok()
            .filter(|len| *len <= jute::MAX_FRAME_BYTES)
            .ok_or_else(|| format!("bad frame length {len}"))?;
        if self.buf.len() < 4 + len {
            return Ok(None);
        }
        let frame = self.buf[4..4 + len].to_vec();
        self.buf.drain(..4 + len);
        Ok(Some(frame))
    }

    async fn read_frame(&mut self) -> Result<Vec<u8>, String> {
        loop {
            if let Some(frame) = self.next_frame()? {
                return Ok(frame);
            }
            match self.fill().await {
                Ok(true) => {}
                Ok(false) => return Err("connection closed".to_owned()),
                Err(e) => return Err(e.to_string()),
            }
        }
    }
}

/// A session the server accepted on a fresh connection.
struct Established {
    conn: Conn,
    session_id: i64,
    timeout_ms: i32,
    password: Vec<u8>,
}

/// Connects and asks for a session (`session_id` 0 = a new one); `None` when the
/// server says the session has expired.
async fn handshake(
    server: &str,
    timeout_ms: i32,
    session_id: i64,
    password: &[u8],
    last_zxid: i64,
) -> Result<Option<Established>, String> {
    let stream = TcpStream::connect(server)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let _ = stream.set_nodelay(true);
    let (reader, writer) = stream.into_split();
    let mut conn = Conn {
        reader,
        writer,
        buf: Vec::new(),
        chunk: vec![0; READ_CHUNK].into_boxed_slice(),
    };
    let hello = jute::connect_frame(last_zxid, timeout_ms, session_id, password);
    conn.writer
        .write_all(&hello)
        .await
        .map_err(|e| format!("send handshake: {e}"))?;
    let frame = conn.read_frame().await?;
    let mut r = Reader(&frame);
    let parsed = (|| {
        let _protocol = r.int()?;
        let timeout_ms = r.int()?;
        let session_id = r.long()?;
        let password = r.buffer()?.to_vec();
        Ok::<_, jute::Malformed>((timeout_ms, session_id, password))
    })();
    let (timeout_ms, id, password) = parsed.map_err(|e| format!("handshake answer: {}", e.0))?;
    if timeout_ms <= 0 || id == 0 || (session_id != 0 && id != session_id) {
        return Ok(None);
    }
    Ok(Some(Established {
        conn,
        session_id: id,
        timeout_ms,
        password,
    }))
}

/// The task that owns a session's connections.
struct Task {
    shared: Arc<Shared>,
    dial: Arc<Dial>,
    password: Vec<u8>,
    timeout_ms: i32,
    last_zxid: i64,
}

impl Task {
    async fn run(mut self, mut conn: Conn, mut inbox: mpsc::Receiver<Call>) {
        loop {
            let (end, last_heard) = self.serve(&mut conn, &mut inbox).await;
            match end {
                End::Closed => return self.shared.set_state(State::Closed),
                End::Expired => return self.shared.set_state(State::Lost),
                End::Broken => self.shared.set_state(State::Suspended),
            }
            match self.reconnect(&mut inbox, last_heard).await {
                Ok(fresh) => {
                    conn = fresh;
                    self.shared.set_state(State::Connected);
                }
                Err(End::Closed) => return self.shared.set_state(State::Closed),
                Err(_) => return self.shared.set_state(State::Lost),
            }
        }
    }

    /// Serves one connection until it breaks, the session expires or the owner drops
    /// the session; returns how it ended and when the server was last heard from.
    async fn serve(&mut self, conn: &mut Conn, inbox: &mut mpsc::Receiver<Call>) -> (End, Instant) {
        let timeout = self.shared.timeout;
        let mut pending: HashMap<i32, Reply> = HashMap::new();
        let mut next_xid: i32 = 1;
        let mut last_heard = Instant::now();
        let mut last_sent = Instant::now();
        let end = loop {
            let ping_at = last_sent + timeout / 3;
            let dead_at = last_heard + timeout * 2 / 3;
            tokio::select! {
                call = inbox.recv() => {
                    let Some(call) = call else {
                        close(conn, next_xid).await;
                        break End::Closed;
                    };
                    let xid = next_xid;
                    next_xid = next_xid.checked_add(1).unwrap_or(1);
                    let frame = jute::request_frame(xid, call.op, &call.body);
                    if !write(conn, &frame, dead_at).await {
                        let _ = call.reply.send(Err(Fault::Disconnected));
                        break End::Broken;
                    }
                    pending.insert(xid, call.reply);
                    last_sent = Instant::now();
                }
                read = conn.fill() => {
                    if !matches!(read, Ok(true)) {
                        break End::Broken;
                    }
                    last_heard = Instant::now();
                    if let Some(end) = self.dispatch(conn, &mut pending) {
                        break end;
                    }
                }
                _ = tokio::time::sleep_until(ping_at) => {
                    let frame = jute::request_frame(xid::PING, op::PING, &[]);
                    if !write(conn, &frame, dead_at).await {
                        break End::Broken;
                    }
                    last_sent = Instant::now();
                }
                _ = tokio::time::sleep_until(dead_at) => break End::Broken,
            }
        };
        let fault = match end {
            End::Broken => Fault::Disconnected,
            End::Expired => Fault::Lost,
            End::Closed => Fault::Closed,
        };
        for (_, reply) in pending.drain() {
            let _ = reply.send(Err(fault.clone()));
        }
        (end, last_heard)
    }

    /// Handles every complete frame in the buffer; `Some` when the connection ends.
    fn dispatch(&mut self, conn: &mut Conn, pending: &mut HashMap<i32, Reply>) -> Option<End> {
        loop {
            let frame = match conn.next_frame() {
                Ok(Some(frame)) => frame,
                Ok(None) => return None,
                Err(_) => return Some(End::Broken),
            };
            let mut r = Reader(&frame);
            let Ok((reply_xid, zxid, err)) =
                (|| Ok::<_, jute::Malformed>((r.int()?, r.long()?, r.int()?)))()
            else {
                return Some(End::Broken);
            };
            self.last_zxid = self.last_zxid.max(zxid);
            match reply_xid {
                xid::WATCH => {
                    let Ok((_kind, state, path)) =
                        (|| Ok::<_, jute::Malformed>((r.int()?, r.int()?, r.string()?)))()
                    else {
                        return Some(End::Broken);
                    };
                    if state == code::SESSION_EXPIRED {
                        return Some(End::Expired);
                    }
                    if !path.is_empty() {
                        self.shared.fire(&path);
                    }
                }
                xid::PING | xid::AUTH | xid::SET_WATCHES => {}
                _ => match pending.remove(&reply_xid) {
                    Some(reply) => {
                        let _ = reply.send(Ok((err, r.0.to_vec())));
                    }
                    // An answer to nothing we asked: the stream is out of step.
                    None => return Some(End::Broken),
                },
            }
            if err == code::SESSION_EXPIRED {
                return Some(End::Expired);
            }
        }
    }

    /// Re-establishes the session on some server, until a whole session timeout has
    /// passed since the server was last heard from (then the session is given up).
    async fn reconnect(
        &mut self,
        inbox: &mut mpsc::Receiver<Call>,
        last_heard: Instant,
    ) -> Result<Conn, End> {
        let timeout = self.shared.timeout;
        let give_up = last_heard + timeout;
        let per_attempt =
            (timeout / 3).clamp(Duration::from_millis(100), self.dial.connect_timeout);
        let servers = self.dial.servers.len().max(1);
        let first = random_index(servers);
        let mut attempt: usize = 0;
        while Instant::now() < give_up {
            let server = &self.dial.servers[(first + attempt) % servers];
            let until = (Instant::now() + per_attempt).min(give_up);
            let hello = handshake(
                server,
                self.timeout_ms,
                self.shared.id,
                &self.password,
                self.last_zxid,
            );
            match refusing_calls(inbox, tokio::time::timeout_at(until, hello)).await {
                None => return Err(End::Closed),
                Some(Ok(Ok(Some(est)))) => return Ok(est.conn),
                Some(Ok(Ok(None))) => return Err(End::Expired),
                Some(_) => {}
            }
            let pause = Duration::from_millis(20 << attempt.min(5)).min(per_attempt);
            let resume = (Instant::now() + pause).min(give_up);
            if refusing_calls(inbox, tokio::time::sleep_until(resume))
                .await
                .is_none()
            {
                return Err(End::Closed);
            }
            attempt += 1;
        }
        Err(End::Expired)
    }
}

/// Runs `work` while answering every call that arrives meanwhile as disconnected;
/// `None` if the owner dropped the session.
async fn refusing_calls<F: Future>(inbox: &mut mpsc::Receiver<Call>, work: F) -> Option<F::Output> {
    tokio::pin!(work);
    loop {
        tokio::select! {
            out = &mut work => return Some(out),
            call = inbox.recv() => match call {
                Some(call) => { let _ = call.reply.send(Err(Fault::Disconnected)); }
                None => return None,
            },
        }
    }
}

/// Writes a frame unless the connection is declared dead first.
async fn write(conn: &mut Conn, frame: &[u8], dead_at: Instant) -> bool {
    matches!(
        tokio::time::timeout_at(dead_at, conn.writer.write_all(frame)).await,
        Ok(Ok(()))
    )
}

/// Closes the session on the server (deleting its ephemeral nodes), waiting briefly
/// for the answer.
async fn close(conn: &mut Conn, close_xid: i32) {
    let frame = jute::request_frame(close_xid, op::CLOSE_SESSION, &[]);
    let _ = tokio::time::timeout(CLOSE_WAIT, async {
        conn.writer.write_all(&frame).await.ok()?;
        loop {
            let frame = conn.read_frame().await.ok()?;
            if Reader(&frame).int().ok()? == close_xid {
                return Some(());
            }
        }
    })
    .await;
}
