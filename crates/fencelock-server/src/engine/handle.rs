//! [`Handle`]: what the HTTP, gRPC and wire layers call. Each method turns a
//! request into a message for the engine task and awaits (or sinks) its answer.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fencelock_core::{
    Acquire, Command, Core, Fence, Grant, LockName, LockView, Owner, OwnerToken, Reason, Reply,
    SessionId, SessionView, Value,
};
use tokio::sync::{broadcast, oneshot, watch};

use super::history::{History, Position, Resume};
use super::queue::{EngineTx, Refused};
use super::typed;
use super::writer::WriterMsg;
use super::{
    random_u128, replicated, AcquireArgs, AcquireReply, ClusterShared, CommandReply, GrantSink,
    Msg, RecoveryReport, ReplySink, Requester, RunState, SharedEvent,
};
use crate::audit::{AuditEntry, AuditIndex, AuditQuery};
use crate::codec;
use crate::error::{ApiError, ApiErrorKind};
use crate::metrics::Metrics;

/// What every clone of a [`Handle`] shares.
pub(super) struct Shared {
    /// The engine task's inbox (see [`EngineTx::send`]).
    pub(super) tx: EngineTx,
    /// Backups go through the writer (see [`WriterMsg::Backup`]); `None` in
    /// cluster mode, which has no writer thread.
    pub(super) writer: Option<std::sync::mpsc::Sender<WriterMsg>>,
    /// Cluster mode: the Raft handle and who leads.
    pub(super) cluster: Option<Arc<ClusterShared>>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) events: broadcast::Sender<SharedEvent>,
    /// Recent events, for watches to resume from.
    pub(super) history: Arc<History>,
    pub(super) state: watch::Receiver<RunState>,
    pub(super) started: Instant,
    pub(super) recovery: RecoveryReport,
    pub(super) audit: Arc<std::sync::Mutex<AuditIndex>>,
    /// Numbers the acquire calls (their listeners); only ever compared, so a counter
    /// (not a random draw, a system call) is enough.
    pub(super) next_listener: std::sync::atomic::AtomicU64,
}

/// A cheap, cloneable handle to the engine: what the HTTP and gRPC layers call.
/// A request that finds [`ENGINE_QUEUE`](super::ENGINE_QUEUE) others waiting for
/// the engine is refused at once with 503 `unavailable` ("the server is
/// overloaded; retry").
#[derive(Clone)]
pub struct Handle {
    pub(super) shared: Arc<Shared>,
}

/// The message of an acquire with a fresh owner token.
pub(super) fn acquire_msg(
    caller: &Requester,
    args: AcquireArgs,
    listener: u128,
    reply: AcquireReply,
) -> Msg {
    Msg::Acquire {
        command: Command::Acquire(acquire_of(caller, args)),
        caller: caller.clone(),
        listener,
        reply,
    }
}

/// The core's acquire for `args`, with a fresh owner token.
fn acquire_of(caller: &Requester, args: AcquireArgs) -> Acquire {
    Acquire {
        name: args.name,
        token: OwnerToken::from_u128(random_u128()),
        ttl_ms: args.ttl_ms,
        wait_ms: args.wait_ms,
        owner: args.owner,
        request_id: args.request_id,
        limit: args.limit,
        lock_delay_ms: args.lock_delay_ms,
        session: args.session,
        tenant: caller.tenant.clone(),
        quota: caller.quota,
        mode: args.mode,
        value: args.value,
    }
}

/// Cancels a wait if the acquiring future is dropped before it finished; releases the
/// grant if it arrived but was never read.
struct AcquireGuard {
    shared: Arc<Shared>,
    listener: u128,
    rx: Option<oneshot::Receiver<Result<Grant, ApiError>>>,
}

impl Drop for AcquireGuard {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else {
            return;
        };
        match rx.try_recv() {
            Ok(Ok(grant)) => {
                let _ = self.shared.tx.send(Msg::ReleaseOrphan {
                    name: grant.name,
                    token: grant.token,
                });
            }
            Ok(Err(_)) | Err(oneshot::error::TryRecvError::Closed) => {}
            Err(oneshot::error::TryRecvError::Empty) => {
                let _ = self.shared.tx.send(Msg::CancelListener {
                    listener: self.listener,
                });
            }
        }
    }
}

/// [`AcquireGuard`] for a multi-lock request: cancels its wait if the future is
/// dropped, releases its grants if they arrived but were never read.
struct AcquireAllGuard {
    shared: Arc<Shared>,
    listener: u128,
    rx: Option<oneshot::Receiver<Result<Vec<Grant>, ApiError>>>,
}

impl Drop for AcquireAllGuard {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else {
            return;
        };
        match rx.try_recv() {
            Ok(Ok(grants)) => {
                for grant in grants {
                    let _ = self.shared.tx.send(Msg::ReleaseOrphan {
                        name: grant.name,
                        token: grant.token,
                    });
                }
            }
            Ok(Err(_)) | Err(oneshot::error::TryRecvError::Closed) => {}
            Err(oneshot::error::TryRecvError::Empty) => {
                let _ = self.shared.tx.send(Msg::CancelListener {
                    listener: self.listener,
                });
            }
        }
    }
}

fn handle_missing(handle: &str) -> ApiError {
    ApiError::new(
        ApiErrorKind::SessionNotFound,
        format!(
            "no session with handle {handle} you may manage (expired, closed, never opened, or not within your prefixes)"
        ),
    )
}

pub(super) fn unavailable() -> ApiError {
    ApiError::new(
        ApiErrorKind::Unavailable,
        "the lock engine is not running (shutting down or storage failed)",
    )
}

/// A client request refused because [`ENGINE_QUEUE`](super::ENGINE_QUEUE) requests
/// already wait.
fn overloaded() -> ApiError {
    ApiError::new(ApiErrorKind::Unavailable, "the server is overloaded; retry")
}

impl Handle {
    fn send(&self, msg: Msg) -> Result<(), ApiError> {
        self.shared.tx.send(msg).map_err(|refused| match refused {
            Refused::Full => {
                self.shared
                    .metrics
                    .refused_overloaded
                    .fetch_add(1, Ordering::Relaxed);
                overloaded()
            }
            Refused::Closed => unavailable(),
        })
    }

    async fn command(&self, caller: &Requester, command: Command) -> Result<Reply, ApiError> {
        let (tx, rx) = oneshot::channel();
        self.send(Msg::Command {
            command,
            caller: caller.clone(),
            reply: CommandReply::Channel(tx),
        })?;
        match rx.await {
            Ok(result) => result,
            Err(_) => Err(unavailable()),
        }
    }

    /// Reads the core's state after everything before it is durable.
    /// In cluster mode the read is linearizable: the leader confirms it still leads
    /// (ReadIndex) and reads once everything committed before is applied; another
    /// member answers `not_leader`.
    pub async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Core) -> T + Send + 'static,
    ) -> Result<T, ApiError> {
        self.read_at(move |core, _| f(core), false).await
    }

    /// Reads this member's state as applied so far, without asking the leader
    /// (`?stale=true`): possibly behind the cluster. The same as
    /// [`Handle::read`] on a single server.
    pub async fn read_local<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Core) -> T + Send + 'static,
    ) -> Result<T, ApiError> {
        self.read_at(move |core, _| f(core), true).await
    }

    /// [`Handle::read`] (or with `stale`, [`Handle::read_local`]), with the
    /// service time of the read for `f`: on a single server the time of the tick
    /// that precedes every read; on a cluster member its clock at the read (see
    /// `EngineTask::read_time_ms`), so views do not stop at the last applied
    /// command's time while the cluster is idle.
    async fn read_at<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Core, u64) -> T + Send + 'static,
        stale: bool,
    ) -> Result<T, ApiError> {
        // A member importing a single server's state would show an empty one.
        if self.shared.cluster().is_some_and(|c| c.importing()) {
            return Err(replicated::importing_error());
        }
        if let (Some(cluster), false) = (self.shared.cluster(), stale) {
            cluster.read_barrier().await?;
        }
        let (tx, rx) = oneshot::channel();
        self.send(Msg::Read(Box::new(move |core, now_ms| {
            let value = f(core, now_ms);
            Box::new(move || {
                let _ = tx.send(value);
            })
        })))?;
        rx.await.map_err(|_| unavailable())
    }

    /// Acquires a lock, waiting up to `args.wait_ms`. Dropping the future cancels the
    /// wait; a grant that arrives for a dropped future is released.
    pub async fn acquire(&self, caller: &Requester, args: AcquireArgs) -> Result<Grant, ApiError> {
        let listener = self.new_listener();
        let (tx, rx) = oneshot::channel();
        self.send(acquire_msg(
            caller,
            args,
            listener,
            AcquireReply::Channel(tx),
        ))?;
        let mut guard = AcquireGuard {
            shared: self.shared.clone(),
            listener,
            rx: Some(rx),
        };
        let result = guard.rx.as_mut().expect("set above").await;
        guard.rx = None;
        result.unwrap_or_else(|_| Err(unavailable()))
    }

    /// Acquires several locks as one request (see `Command::AcquireAll`): all of
    /// them or none, waiting up to the parts' `wait_ms` (the same in every part, as
    /// are every field but the name, mode and limit). The grants come back in the
    /// order asked. Dropping the future cancels the wait; grants that arrive for a
    /// dropped future are released.
    pub async fn acquire_all(
        &self,
        caller: &Requester,
        parts: Vec<AcquireArgs>,
    ) -> Result<Vec<Grant>, ApiError> {
        let listener = self.new_listener();
        let (tx, rx) = oneshot::channel();
        let parts = parts.into_iter().map(|a| acquire_of(caller, a)).collect();
        self.send(Msg::Acquire {
            command: Command::AcquireAll(parts),
            caller: caller.clone(),
            listener,
            reply: AcquireReply::All(tx),
        })?;
        let mut guard = AcquireAllGuard {
            shared: self.shared.clone(),
            listener,
            rx: Some(rx),
        };
        let Some(rx) = guard.rx.as_mut() else {
            return Err(unavailable());
        };
        let result = rx.await;
        guard.rx = None;
        result.unwrap_or_else(|_| Err(unavailable()))
    }

    /// Turns an exclusive grant into a shared one (fence kept). `Ok` also when it
    /// was shared already.
    pub async fn downgrade(
        &self,
        caller: &Requester,
        name: LockName,
        token: OwnerToken,
    ) -> Result<Grant, ApiError> {
        typed::downgraded(
            self.command(caller, Command::Downgrade { name, token })
                .await?,
        )
    }

    /// Changes the value an election's leader publishes.
    pub async fn proclaim(
        &self,
        caller: &Requester,
        name: LockName,
        token: OwnerToken,
        value: Value,
    ) -> Result<Grant, ApiError> {
        typed::proclaimed(
            self.command(caller, Command::Proclaim { name, token, value })
                .await?,
        )
    }

    /// Releases several grants in one step; per grant, `false` if its token had
    /// released it already.
    pub async fn release_all(
        &self,
        caller: &Requester,
        grants: Vec<(LockName, OwnerToken)>,
    ) -> Result<Vec<bool>, ApiError> {
        typed::released_all(self.command(caller, Command::ReleaseAll { grants }).await?)
    }

    /// A fresh listener id for [`Handle::acquire_to`].
    pub(crate) fn new_listener(&self) -> u128 {
        u128::from(self.shared.next_listener.fetch_add(1, Ordering::Relaxed))
    }

    /// Sends an acquire whose answer goes to `sink` (see [`GrantSink`]) rather than
    /// to an awaiting future. `listener` (from [`Handle::new_listener`]) is what
    /// [`Handle::cancel_listener`] takes to stop the wait.
    pub(crate) fn acquire_to(
        &self,
        caller: &Requester,
        args: AcquireArgs,
        listener: u128,
        sink: GrantSink,
    ) -> Result<(), ApiError> {
        self.send(acquire_msg(
            caller,
            args,
            listener,
            AcquireReply::Sink(sink),
        ))
    }

    /// The client behind `listener` stopped waiting: its request leaves the queue (a
    /// grant already on its way finds the sink refusing it and is released).
    pub(crate) fn cancel_listener(&self, listener: u128) {
        let _ = self.send(Msg::CancelListener { listener });
    }

    /// Sends a client's `command` (a renew or a release) whose answer goes to `sink`
    /// (see [`ReplySink`]) rather than to an awaiting future.
    pub(crate) fn command_to(
        &self,
        caller: &Requester,
        command: Command,
        sink: ReplySink,
    ) -> Result<(), ApiError> {
        self.send(Msg::Command {
            command,
            caller: caller.clone(),
            reply: CommandReply::Sink(sink),
        })
    }

    /// Extends a lease (or the holding session).
    pub async fn renew(
        &self,
        caller: &Requester,
        name: LockName,
        token: OwnerToken,
        ttl_ms: Option<u64>,
    ) -> Result<Grant, ApiError> {
        typed::renewed(
            self.command(
                caller,
                Command::Renew {
                    name,
                    token,
                    ttl_ms,
                },
            )
            .await?,
        )
    }

    /// Releases a grant. `Ok(false)`: this token had already released it.
    pub async fn release(
        &self,
        caller: &Requester,
        name: LockName,
        token: OwnerToken,
    ) -> Result<bool, ApiError> {
        typed::released(
            self.command(caller, Command::Release { name, token })
                .await?,
        )
    }

    /// Operator action: takes a lock from its holder(s). Returns the fences taken.
    /// The audit log records the caller as the actor, with the reason.
    pub async fn force_release(
        &self,
        caller: &Requester,
        name: LockName,
        fence: Option<Fence>,
        reason: Reason,
    ) -> Result<Vec<Fence>, ApiError> {
        tracing::warn!(lock = %name, ?fence, reason = reason.as_str(), actor = caller.actor(), "forced release requested");
        typed::force_released(
            self.command(
                caller,
                Command::ForceRelease {
                    name,
                    fence,
                    reason,
                },
            )
            .await?,
        )
    }

    /// Opens a session owned by the caller's principal (within its quota); returns
    /// its id, which only the caller learns.
    pub async fn open_session(
        &self,
        caller: &Requester,
        ttl_ms: u64,
        owner: Owner,
    ) -> Result<(SessionId, u64), ApiError> {
        let id = SessionId::from_u128(random_u128());
        let command = Command::OpenSession {
            id,
            ttl_ms,
            owner,
            tenant: caller.tenant.clone(),
            quota: caller.quota,
        };
        typed::session_opened(self.command(caller, command).await?)
    }

    /// Renews a session; returns its ttl. Another principal's session (see
    /// [`Requester::may_manage`]) is `session_not_found`, like a missing one.
    pub async fn keep_alive(&self, caller: &Requester, id: SessionId) -> Result<u64, ApiError> {
        typed::kept_alive(self.command(caller, Command::KeepAlive { id }).await?)
    }

    /// Closes a session; returns how many locks it released. Another principal's
    /// session (see [`Requester::may_manage`]) is `session_not_found`.
    pub async fn close_session(
        &self,
        caller: &Requester,
        id: SessionId,
    ) -> Result<usize, ApiError> {
        typed::session_closed(self.command(caller, Command::CloseSession { id }).await?)
    }

    /// An admin closes the session with handle `handle` (see
    /// `input::session_handle`) if [`Requester::may_manage`] allows; the audit
    /// log names the admin. Returns how many locks it released.
    ///
    /// The handle is resolved off the engine (hashing every open session's id is
    /// O(sessions): a million take a fraction of a second the engine must not
    /// stall for), then the close goes through the same ownership check as by id.
    pub async fn close_session_by_handle(
        &self,
        caller: &Requester,
        handle: String,
    ) -> Result<usize, ApiError> {
        let ids = self.read(|core| core.session_ids()).await?;
        let wanted = handle.clone();
        let found: Vec<SessionId> = tokio::task::spawn_blocking(move || {
            ids.into_iter()
                .filter(|id| crate::input::session_handle(*id) == wanted)
                .collect()
        })
        .await
        .map_err(|_| unavailable())?;
        match found.as_slice() {
            [id] => self.close_session(caller, *id).await.map_err(|e| {
                if e.kind() == ApiErrorKind::SessionNotFound {
                    handle_missing(&handle)
                } else {
                    e
                }
            }),
            [] => Err(handle_missing(&handle)),
            _ => Err(ApiError::new(
                ApiErrorKind::InvalidArgument,
                format!(
                    "{} open sessions share the handle {handle}: close by id, or wait for one to end",
                    found.len()
                ),
            )),
        }
    }

    /// The open sessions `caller` may manage ([`Requester::may_manage`]) whose locks all
    /// start with `prefix`, in id order, at most `max`.
    pub async fn sessions(
        &self,
        caller: &Requester,
        prefix: String,
        max: usize,
    ) -> Result<Vec<SessionView>, ApiError> {
        let caller = caller.clone();
        self.read_at(
            move |core, now_ms| {
                let mut ids = core.session_ids();
                ids.sort_unstable();
                ids.into_iter()
                    .filter_map(|id| core.session_at(id, now_ms))
                    .filter(|s| caller.may_manage(s))
                    .filter(|s| {
                        s.holding
                            .iter()
                            .chain(&s.waiting)
                            .all(|n| n.as_str().starts_with(&prefix))
                    })
                    .take(max)
                    .collect()
            },
            false,
        )
        .await
    }

    /// The view of one lock, if it exists.
    pub async fn lock(&self, name: LockName) -> Result<Option<LockView>, ApiError> {
        self.lock_with(name, false).await
    }

    /// [`Handle::lock`], or with `stale` this member's view (see
    /// [`Handle::read_local`]).
    pub async fn lock_with(
        &self,
        name: LockName,
        stale: bool,
    ) -> Result<Option<LockView>, ApiError> {
        self.read_at(move |core, now_ms| core.lock_at(&name, now_ms), stale)
            .await
    }

    /// [`Handle::locks`], or with `stale` this member's view (see
    /// [`Handle::read_local`]).
    pub async fn locks_with(
        &self,
        prefix: String,
        after: Option<LockName>,
        max: usize,
        stale: bool,
    ) -> Result<Vec<LockView>, ApiError> {
        self.read_at(
            move |core, now_ms| core.locks_at(&prefix, after.as_ref(), max, now_ms),
            stale,
        )
        .await
    }

    /// Locks by prefix, paginated by name.
    pub async fn locks(
        &self,
        prefix: String,
        after: Option<LockName>,
        max: usize,
    ) -> Result<Vec<LockView>, ApiError> {
        self.locks_with(prefix, after, max, false).await
    }

    /// A consistent snapshot of the whole durable state (for `fencelock backup`). It
    /// includes every change acknowledged before the call: the request goes through
    /// the writer, after everything it has answered (a release answered before its
    /// fdatasync included: the backup waits for that fdatasync). It is encoded by the
    /// replica, so the engine does not pause for it.
    pub async fn snapshot(&self) -> Result<Vec<u8>, ApiError> {
        let Some(writer) = &self.shared.writer else {
            // Cluster mode: everything committed before is applied once the barrier
            // passes.
            return self
                .read(|core| codec::encode_snapshot(&core.export()))
                .await;
        };
        let (tx, rx) = oneshot::channel();
        writer
            .send(WriterMsg::Backup(tx))
            .map_err(|_| unavailable())?;
        rx.await.map_err(|_| unavailable())
    }

    /// Cluster mode: the Raft handle and leadership; `None` on a single server.
    pub fn cluster(&self) -> Option<&Arc<ClusterShared>> {
        self.shared.cluster()
    }

    /// Durable lock events from now on. A slow watcher that falls behind by more
    /// than the channel's capacity is told how many events it missed.
    pub fn subscribe(&self) -> broadcast::Receiver<SharedEvent> {
        self.shared.events.subscribe()
    }

    /// A watch resumed after `after` (the position of the last event its client
    /// saw): the events since, then live ones (the receiver may repeat some of the
    /// backlog; drop events at or before the last one sent). Refused with
    /// [`ApiErrorKind::WatchCompacted`] if this server no longer has (or never had)
    /// the events right after `after`.
    pub fn resume(&self, after: Position) -> Result<Resume, ApiError> {
        self.shared.history.resume(&self.shared.events, after)
    }

    /// A watch from now on: the position it starts after, and the live events
    /// (drop those at or before the position: they came before the watch).
    pub fn watch_now(&self) -> (Position, broadcast::Receiver<SharedEvent>) {
        self.shared.history.now(&self.shared.events)
    }

    /// Audit entries matching `query`, newest last. Every change acknowledged
    /// before the call is included (entries are durable and indexed before the
    /// change is acknowledged; a release's once the fdatasync that follows its early
    /// answer completes, see `EngineTask::release`), unless retention has dropped it.
    pub fn audit(&self, query: &AuditQuery) -> Vec<AuditEntry> {
        self.shared
            .audit
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .query(query)
    }

    /// The server's metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    /// What recovery found at start.
    pub fn recovery(&self) -> &RecoveryReport {
        &self.shared.recovery
    }

    /// Time since the engine started.
    pub fn uptime(&self) -> Duration {
        self.shared.started.elapsed()
    }

    /// The current run state.
    pub fn state(&self) -> RunState {
        self.shared.state.borrow().clone()
    }

    /// A receiver that sees every run-state change (for shutdown and fail-stop).
    pub fn watch_state(&self) -> watch::Receiver<RunState> {
        self.shared.state.clone()
    }

    /// Starts shutting down: every wait ends with `unavailable`, new waits are
    /// refused, everything else is still served.
    pub fn drain(&self) {
        let _ = self.send(Msg::Drain);
    }

    /// Stops the engine after making everything applied so far durable.
    pub async fn shutdown(&self) {
        let (tx, rx) = oneshot::channel();
        if self.send(Msg::Shutdown(tx)).is_ok() {
            let _ = rx.await;
        }
    }
}
