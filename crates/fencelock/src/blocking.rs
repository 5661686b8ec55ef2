//! A blocking client for programs without an async runtime.
//!
//! [`Client`] owns a small tokio runtime (one worker thread) that sends the requests
//! and renews every guard in the background while the program's own threads do
//! blocking work. Calls block the calling thread until answered. Dropping a
//! [`LockGuard`] releases the lock before `drop` returns.
//!
//! ```no_run
//! use std::time::Duration;
//!
//! fn main() -> Result<(), fencelock::Error> {
//!     let client = fencelock::blocking::Client::connect("http://127.0.0.1:7420")?;
//!     let guard = client
//!         .lock("job:daily-settlement")
//!         .ttl(Duration::from_secs(30))
//!         .wait(Duration::from_secs(10))
//!         .acquire()?;
//!     println!("writing with fence {}", guard.fence());
//!     if guard.is_lost() {
//!         return Err(fencelock::Error::new(fencelock::ErrorKind::LockLost, "lost"));
//!     }
//!     drop(guard); // released here
//!     Ok(())
//! }
//! ```
//!
//! Calling these methods from inside an async runtime would stall it; they return
//! [`ErrorKind::InvalidArgument`] there instead (use [`crate::Client`]).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::{
    Capabilities, Error, ErrorKind, Lease, LockBackend, LockOptions, LostReason, ServerConfig,
};

/// The runtime every clone of a blocking client, and every guard, shares.
#[derive(Debug)]
struct Runtime(Option<tokio::runtime::Runtime>);

impl Runtime {
    fn new() -> Result<Arc<Runtime>, Error> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("fencelock-client")
            .enable_all()
            .build()
            .map_err(|e| {
                Error::new(
                    ErrorKind::Internal,
                    format!("cannot start the client's runtime: {e}"),
                )
            })?;
        Ok(Arc::new(Runtime(Some(runtime))))
    }

    /// Runs `future` to completion on this runtime, blocking the calling thread.
    fn block_on<F: Future>(&self, future: F) -> Result<F::Output, Error> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "fencelock::blocking called from within an async runtime: use fencelock::Client",
            ));
        }
        match &self.0 {
            Some(runtime) => Ok(runtime.block_on(future)),
            None => Err(Error::new(ErrorKind::Internal, "the runtime is gone")),
        }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        // Never blocks, so dropping the last handle is safe anywhere (even inside
        // another runtime, where a plain drop would panic).
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

/// A blocking lock client. Cheap to clone; clones share the connection and the
/// runtime.
#[derive(Debug, Clone)]
pub struct Client {
    inner: crate::Client,
    runtime: Arc<Runtime>,
}

impl Client {
    /// Connects to a fencelock server (see [`crate::Client::connect`]).
    pub fn connect(url: &str) -> Result<Client, Error> {
        Client::connect_with(ServerConfig::new(url))
    }

    /// Connects with explicit settings (see [`crate::Client::connect_with`]).
    pub fn connect_with(config: ServerConfig) -> Result<Client, Error> {
        let runtime = Runtime::new()?;
        let inner = runtime.block_on(crate::Client::connect_with(config))??;
        Ok(Client { inner, runtime })
    }

    /// A blocking client over any lock store. The backend is used on the client's own
    /// runtime.
    pub fn new(backend: impl LockBackend) -> Result<Client, Error> {
        Ok(Client {
            inner: crate::Client::new(backend),
            runtime: Runtime::new()?,
        })
    }

    /// What the lock store behind this client guarantees.
    pub fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    /// Starts building an acquisition of `name` with default [`LockOptions`].
    pub fn lock(&self, name: impl Into<String>) -> LockRequest {
        LockRequest {
            inner: self.inner.lock(name),
            runtime: self.runtime.clone(),
        }
    }
}

/// An acquisition being built (see [`crate::LockRequest`]).
#[derive(Debug)]
#[must_use = "a lock request does nothing until acquired"]
pub struct LockRequest {
    inner: crate::LockRequest,
    runtime: Arc<Runtime>,
}

impl LockRequest {
    fn map(self, f: impl FnOnce(crate::LockRequest) -> crate::LockRequest) -> LockRequest {
        LockRequest {
            inner: f(self.inner),
            runtime: self.runtime,
        }
    }

    /// Replaces all options.
    pub fn options(self, options: LockOptions) -> LockRequest {
        self.map(|r| r.options(options))
    }

    /// Lease length (renewed in the background).
    pub fn ttl(self, ttl: Duration) -> LockRequest {
        self.map(|r| r.ttl(ttl))
    }

    /// How long to wait for the lock.
    pub fn wait(self, wait: Duration) -> LockRequest {
        self.map(|r| r.wait(wait))
    }

    /// Waits for the lock with no limit.
    pub fn wait_forever(self) -> LockRequest {
        self.map(|r| r.wait_forever())
    }

    /// Who holds the lock, for operators.
    pub fn owner(self, owner: impl Into<String>) -> LockRequest {
        self.map(|r| r.owner(owner))
    }

    /// A semaphore admitting `limit` holders.
    pub fn limit(self, limit: u32) -> LockRequest {
        self.map(|r| r.limit(limit))
    }

    /// Lock-delay after an expiry or forced release of this grant.
    pub fn lock_delay(self, lock_delay: Duration) -> LockRequest {
        self.map(|r| r.lock_delay(lock_delay))
    }

    /// How long before the server could expire the lease the guard reports it lost.
    pub fn safety_margin(self, margin: Duration) -> LockRequest {
        self.map(|r| r.safety_margin(margin))
    }

    /// The idempotency key every attempt of this acquisition carries.
    pub fn request_id(self, id: impl Into<String>) -> LockRequest {
        self.map(|r| r.request_id(id))
    }

    /// Acquires the lock, blocking up to the wait budget (see
    /// [`crate::LockRequest::acquire`]).
    pub fn acquire(self) -> Result<LockGuard, Error> {
        let guard = self.runtime.block_on(self.inner.acquire())??;
        Ok(LockGuard {
            lease: guard.lease().clone(),
            inner: Some(guard),
            runtime: self.runtime,
        })
    }

    /// Acquires the lock only if it is free now: [`ErrorKind::Held`] otherwise.
    pub fn try_acquire(self) -> Result<LockGuard, Error> {
        self.wait(Duration::ZERO).acquire()
    }
}

/// A held lock, renewed in the background; dropping it releases the lock before
/// `drop` returns (see [`crate::LockGuard`]).
#[derive(Debug)]
pub struct LockGuard {
    lease: Lease,
    /// `Some` until dropped or released (both end the guard).
    inner: Option<crate::LockGuard>,
    runtime: Arc<Runtime>,
}

impl LockGuard {
    fn inner(&self) -> Result<&crate::LockGuard, Error> {
        self.inner
            .as_ref()
            .ok_or_else(|| Error::new(ErrorKind::Internal, "the guard was released"))
    }

    /// The lock name.
    pub fn name(&self) -> &str {
        &self.lease.name
    }

    /// The fencing token of this grant: send it with every write to the protected
    /// resource.
    pub fn fence(&self) -> u64 {
        self.lease.fence
    }

    /// The grant as the store reported it.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// How long the lock is still certainly held; `None` once it is or may be lost.
    pub fn valid_for(&self) -> Option<Duration> {
        self.inner.as_ref().and_then(|g| g.valid_for())
    }

    /// Whether the lock is, or may be, lost. Check it before each write.
    pub fn is_lost(&self) -> bool {
        self.valid_for().is_none()
    }

    /// Blocks until the lock is or may be lost, or `timeout` passes (`None`).
    pub fn wait_lost(&self, timeout: Duration) -> Result<Option<LostReason>, Error> {
        let lost = self.inner()?.lost();
        self.runtime
            .block_on(async { tokio::time::timeout(timeout, lost).await.ok() })
    }

    /// Releases the lock: `Ok(true)` if this call released it, `Ok(false)` if it was
    /// already gone.
    pub fn release(mut self) -> Result<bool, Error> {
        let Some(guard) = self.inner.take() else {
            return Ok(false);
        };
        // Inside an async runtime this is an error, and the guard, dropped unpolled
        // with the future, is released by its background task.
        self.runtime.block_on(guard.release())?
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        let Some(guard) = self.inner.take() else {
            return;
        };
        if tokio::runtime::Handle::try_current().is_ok() {
            // Blocking here would stall that runtime: the guard's own task releases.
            drop(guard);
            return;
        }
        let _ = self.runtime.block_on(guard.release());
    }
}
