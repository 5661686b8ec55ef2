//! One conformance suite for every [`LockBackend`]: the fencelock server and each
//! store behind a `fencelock` cargo feature run the same cases, each against a real,
//! throwaway store (see `fencelock-testkit`).
//!
//! A store plugs in with a [`Fixture`] (start the store, connect a client), and one
//! line in a test file:
//!
//! ```text
//! fencelock_conformance::conformance_suite!(start_my_store());
//! ```
//!
//! which expands to one `#[tokio::test]` per case in [`cases`]. Cases never skip: where
//! a backend's `Capabilities` say it lacks a feature (semaphores, FIFO, fences), the
//! case asserts the honest answer instead (a clear `InvalidArgument`, fences of 0,
//! every waiter served eventually).
//!
//! Partitions and paused clients are made with [`Proxy`]: a client whose connections
//! go through stalled proxies cannot renew, exactly like a process stopped by SIGSTOP
//! as seen from the store.
#![deny(missing_docs)]

pub mod cases;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

pub use fencelock::{BoxFuture, LockBackend};
pub use fencelock_testkit::Proxy;

/// Longest any awaited step may take before a case fails instead of hanging.
pub const STEP: Duration = Duration::from_secs(30);

/// A running store the suite can connect clients to.
pub trait Fixture: Send + Sync + 'static {
    /// The store's addresses on loopback (one for a single server; one per instance
    /// for Redlock).
    fn addrs(&self) -> Vec<SocketAddr>;

    /// A new, independent client of the store (its own connections and, where the
    /// store has them, its own session), reaching the store at `addrs` — the store's
    /// own addresses or proxies in front of them, in the same order as
    /// [`Fixture::addrs`].
    fn connect<'a>(
        &'a self,
        addrs: &'a [SocketAddr],
    ) -> BoxFuture<'a, Result<Arc<dyn LockBackend>, fencelock::Error>>;

    /// The shortest lease the cases use. It must be one the store grants exactly
    /// (etcd rounds leases to whole seconds; ZooKeeper's session timeout has a floor).
    fn short_ttl(&self) -> Duration {
        Duration::from_secs(2)
    }
}

/// A client behind proxies: [`Partitioned::cut`] stalls everything it sends and
/// receives.
pub struct Partitioned {
    /// The client.
    pub backend: Arc<dyn LockBackend>,
    proxies: Vec<Proxy>,
}

impl Partitioned {
    /// Connects a client of `fixture` through a fresh proxy per store address.
    pub async fn connect(fixture: &dyn Fixture) -> Partitioned {
        let mut proxies = Vec::new();
        for addr in fixture.addrs() {
            proxies.push(Proxy::start(addr).await.expect("start a proxy"));
        }
        let via: Vec<SocketAddr> = proxies.iter().map(Proxy::addr).collect();
        let backend = step(fixture.connect(&via))
            .await
            .expect("connect through the proxy");
        Partitioned { backend, proxies }
    }

    /// Cuts the client off from every store instance.
    pub fn cut(&self) {
        self.proxies.iter().for_each(Proxy::pause);
    }

    /// Heals the partition.
    pub fn heal(&self) {
        self.proxies.iter().for_each(Proxy::resume);
    }
}

/// A direct client of `fixture`.
pub async fn connect(fixture: &dyn Fixture) -> Arc<dyn LockBackend> {
    step(fixture.connect(&fixture.addrs()))
        .await
        .expect("connect to the store")
}

/// Awaits `future`, failing the case if it takes longer than [`STEP`].
pub async fn step<T>(future: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(STEP, future).await {
        Ok(value) => value,
        Err(_) => panic!("a step took longer than {STEP:?}"),
    }
}

/// Expands to one `#[tokio::test]` per conformance case, each on a fresh fixture from
/// `$start` (an expression of a future that yields a [`Fixture`]).
#[macro_export]
macro_rules! conformance_suite {
    ($start:expr) => {
        $crate::conformance_suite!(@cases $start;
            capabilities_are_consistent,
            bad_input_is_refused,
            exclusion,
            semaphore,
            fences_increase,
            release_and_renew_check_the_owner,
            expiry_frees_the_lock,
            lost_signal_fires_before_another_holder,
            waiter_wakes_on_release,
            waiters_are_all_served,
            retry_with_the_same_request_id_is_idempotent,
            shared_readers_hold_together,
            shared_queued_writer_goes_first,
            downgrade_lets_readers_in,
            election_has_one_leader,
            election_term_increases_on_takeover,
            election_proclaim_is_seen,
            election_successor_leads_after_resign,
            capabilities_match_the_kinds,
        );
    };
    (@cases $start:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let fixture = $start.await;
                $crate::cases::$case(&fixture).await;
            }
        )*
    };
}
