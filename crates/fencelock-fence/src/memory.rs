//! The in-memory gate, for tests and examples.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::{FenceError, FenceGate, GateMetrics};

/// Values in memory, one per key, each with the last fence accepted for it.
///
/// For tests, examples and single-process services. One mutex covers the check and the
/// write, so concurrent writers end with the value of the largest fence. Cloning gives
/// another handle to the same values and counter. Keys are never forgotten (memory
/// grows with the number of keys).
///
/// `MemoryGate<()>` records fences only; it backs the HTTP middleware.
pub struct MemoryGate<V> {
    inner: Arc<Inner<V>>,
}

struct Inner<V> {
    name: String,
    entries: Mutex<HashMap<String, Entry<V>>>,
    stale_rejections: AtomicU64,
}

struct Entry<V> {
    fence: u64,
    value: V,
}

impl<V> Clone for MemoryGate<V> {
    fn clone(&self) -> Self {
        MemoryGate {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<V> std::fmt::Debug for MemoryGate<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryGate")
            .field("name", &self.inner.name)
            .field("stale_rejections", &self.stale_rejections())
            .finish_non_exhaustive()
    }
}

impl<V> Default for MemoryGate<V> {
    fn default() -> Self {
        MemoryGate::new()
    }
}

impl<V> MemoryGate<V> {
    /// An empty gate named `"memory"`.
    pub fn new() -> MemoryGate<V> {
        MemoryGate::named("memory")
    }

    /// An empty gate with the given name (its `gate` label in metrics).
    pub fn named(name: impl Into<String>) -> MemoryGate<V> {
        MemoryGate {
            inner: Arc::new(Inner {
                name: name.into(),
                entries: Mutex::new(HashMap::new()),
                stale_rejections: AtomicU64::new(0),
            }),
        }
    }

    /// Creates `key` with `value` and no accepted fence yet (last fence 0), like
    /// inserting a row with `fence DEFAULT 0`: the first fenced write (any fence above
    /// 0) applies on top of it. Returns `false`, changing nothing, if `key` exists.
    pub fn seed(&self, key: &str, value: V) -> bool {
        let mut entries = self.lock();
        if entries.contains_key(key) {
            return false;
        }
        entries.insert(key.to_owned(), Entry { fence: 0, value });
        true
    }

    /// Stores `value` under `key` if `fence` is greater than the last fence accepted for
    /// `key` (a new key has none: any fence above 0 is accepted).
    pub fn set(&self, key: &str, fence: u64, value: V) -> Result<(), FenceError> {
        self.update(key, fence, |_| value)
    }

    /// Like [`set`](MemoryGate::set), with the new value computed from the current one
    /// (`None` for a new key) under the same lock: a fenced read-modify-write.
    /// `new_value` runs only if the fence is accepted.
    pub fn update(
        &self,
        key: &str,
        fence: u64,
        new_value: impl FnOnce(Option<&V>) -> V,
    ) -> Result<(), FenceError> {
        let mut entries = self.lock();
        let current = entries.get(key);
        let last = current.map_or(0, |e| e.fence);
        if fence <= last {
            drop(entries);
            self.inner.stale_rejections.fetch_add(1, Ordering::Relaxed);
            return Err(FenceError::stale(
                &format_args!("key {key:?}"),
                fence,
                Some(last),
            ));
        }
        let value = new_value(current.map(|e| &e.value));
        entries.insert(key.to_owned(), Entry { fence, value });
        Ok(())
    }

    /// The last fence accepted for `key`, if any.
    pub fn last_fence(&self, key: &str) -> Option<u64> {
        self.lock().get(key).map(|e| e.fence)
    }

    /// The current value of `key` and the fence that wrote it.
    pub fn get(&self, key: &str) -> Option<(u64, V)>
    where
        V: Clone,
    {
        self.lock().get(key).map(|e| (e.fence, e.value.clone()))
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Entry<V>>> {
        // A panic in a caller's `new_value` happens before anything is modified, so the
        // map is consistent even if the mutex was poisoned.
        self.inner
            .entries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl<V> GateMetrics for MemoryGate<V> {
    fn name(&self) -> &str {
        &self.inner.name
    }

    fn stale_rejections(&self) -> u64 {
        self.inner.stale_rejections.load(Ordering::Relaxed)
    }
}

impl<V: Send> FenceGate for MemoryGate<V> {
    type Key = str;
    type Write = V;
    type Applied = ();

    /// [`MemoryGate::set`].
    fn apply(
        &self,
        key: &str,
        fence: u64,
        write: V,
    ) -> impl std::future::Future<Output = Result<(), FenceError>> + Send {
        let result = self.set(key, fence, write);
        std::future::ready(result)
    }
}
