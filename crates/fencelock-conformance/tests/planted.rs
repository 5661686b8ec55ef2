//! The suite must catch broken backends, or passing it proves nothing. Each test wraps
//! the fencelock server's backend in one planted bug and asserts that the case meant
//! to catch it fails (panics), while the same case passes on the honest backend.

use crate::planted_support;
use crate::support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencelock::{AcquireSpec, BoxFuture, Capabilities, Error, ErrorKind, Lease, LockBackend};
use fencelock_conformance::cases;
use planted_support::Planted;

/// One bug, planted in an otherwise correct backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bug {
    /// None: the honest backend (the control run).
    Honest,
    /// A refused acquire is reported as granted.
    GrantWhenHeld,
    /// Every grant reports the same fence.
    FenceReused,
    /// Release frees the lock by name, whoever holds it.
    ReleaseIgnoresOwner,
    /// Renew answers "renewed" without asking the store.
    RenewBlind,
    /// Each retry is sent as a new request.
    RetryNotIdempotent,
    /// Waiting is not supported: every acquire answers at once.
    IgnoresWait,
}

/// The grants made through every client of one fixture, by lock name (what a
/// release-by-name bug would consult).
type Registry = Arc<Mutex<HashMap<String, Lease>>>;

struct Buggy {
    inner: Arc<dyn LockBackend>,
    bug: Bug,
    grants: Registry,
}

impl LockBackend for Buggy {
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn acquire<'a>(&'a self, spec: &'a AcquireSpec) -> BoxFuture<'a, Result<Lease, Error>> {
        Box::pin(async move {
            let mut spec = spec.clone();
            match self.bug {
                Bug::RetryNotIdempotent => {
                    spec.request_id = AcquireSpec::new("x", spec.ttl).request_id
                }
                Bug::IgnoresWait => spec.wait = Duration::ZERO,
                _ => {}
            }
            let result = self.inner.acquire(&spec).await;
            let lease = match (self.bug, result) {
                (Bug::GrantWhenHeld, Err(e)) if e.kind() == ErrorKind::Held => {
                    Lease::new(spec.name.clone(), u64::MAX, "planted".to_owned(), spec.ttl)
                }
                (Bug::FenceReused, Ok(lease)) => {
                    Lease::new(lease.name, 1, lease.owner_token, lease.ttl)
                }
                (_, result) => result?,
            };
            self.grants
                .lock()
                .unwrap()
                .insert(lease.name.clone(), lease.clone());
            Ok(lease)
        })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Duration, Error>> {
        if self.bug == Bug::RenewBlind {
            return Box::pin(async move { Ok(ttl) });
        }
        self.inner.renew(lease, ttl)
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            if self.bug == Bug::ReleaseIgnoresOwner {
                let current = self.grants.lock().unwrap().get(&lease.name).cloned();
                if let Some(current) = current {
                    return self.inner.release(&current).await;
                }
            }
            self.inner.release(lease).await
        })
    }
}

/// A fresh fencelock server whose clients carry `bug`.
async fn fixture(bug: Bug) -> Arc<Planted<support::Fencelock>> {
    let grants = Registry::default();
    Arc::new(Planted::new(support::start().await, move |inner| {
        Arc::new(Buggy {
            inner,
            bug,
            grants: grants.clone(),
        })
    }))
}

catches!(
    exclusion_catches_a_grant_while_held,
    Bug::GrantWhenHeld,
    exclusion
);
catches!(
    fences_increase_catches_a_reused_fence,
    Bug::FenceReused,
    fences_increase
);
catches!(
    owner_case_catches_release_by_name,
    Bug::ReleaseIgnoresOwner,
    release_and_renew_check_the_owner
);
catches!(
    owner_case_catches_a_blind_renew,
    Bug::RenewBlind,
    release_and_renew_check_the_owner
);
catches!(
    expiry_case_catches_a_blind_renew,
    Bug::RenewBlind,
    expiry_frees_the_lock
);
catches!(
    retry_case_catches_a_non_idempotent_retry,
    Bug::RetryNotIdempotent,
    retry_with_the_same_request_id_is_idempotent
);
catches!(
    wake_case_catches_a_backend_that_cannot_wait,
    Bug::IgnoresWait,
    waiter_wakes_on_release
);
catches!(
    queue_case_catches_a_backend_that_cannot_wait,
    Bug::IgnoresWait,
    waiters_are_all_served
);
