//! What the planted-bug tests (`planted.rs`, `planted_kinds.rs`) share: a fixture
//! that wraps every backend it connects in one planted bug, the runner that says
//! whether a case passed, and `catches!`, which asserts a case passes on the honest
//! backend and fails with the bug. Each test file keeps only its bugs (a `Bug` enum
//! with an `Honest` variant, the wrapper that plants them) and an
//! `async fn fixture(bug: Bug) -> Arc<impl Fixture>` that `catches!` calls.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use fencelock::{BoxFuture, Error, LockBackend};
use fencelock_conformance::Fixture;

/// Turns an honest backend into one with a bug planted (or leaves it honest).
type Plant = Box<dyn Fn(Arc<dyn LockBackend>) -> Arc<dyn LockBackend> + Send + Sync>;

/// `inner`'s store, with every client it connects wrapped by `plant`.
pub struct Planted<F> {
    inner: F,
    plant: Plant,
}

impl<F: Fixture> Planted<F> {
    /// Wraps `inner`'s clients with `plant`.
    pub fn new(
        inner: F,
        plant: impl Fn(Arc<dyn LockBackend>) -> Arc<dyn LockBackend> + Send + Sync + 'static,
    ) -> Planted<F> {
        Planted {
            inner,
            plant: Box::new(plant),
        }
    }
}

impl<F: Fixture> Fixture for Planted<F> {
    fn addrs(&self) -> Vec<SocketAddr> {
        self.inner.addrs()
    }

    fn connect<'a>(
        &'a self,
        addrs: &'a [SocketAddr],
    ) -> BoxFuture<'a, Result<Arc<dyn LockBackend>, Error>> {
        Box::pin(async move {
            let inner = self.inner.connect(addrs).await?;
            Ok((self.plant)(inner))
        })
    }

    fn short_ttl(&self) -> Duration {
        self.inner.short_ttl()
    }
}

/// Runs `case` on `fixture` in a task of its own: whether it passed (a failed case
/// panics).
pub async fn passes<X, Fut>(fixture: Arc<X>, case: impl FnOnce(Arc<X>) -> Fut) -> bool
where
    Fut: Future<Output = ()> + Send + 'static,
{
    tokio::spawn(case(fixture)).await.is_ok()
}

/// `catches!(test_name, Bug::Variant, case)`: a test asserting that `cases::case`
/// passes on `fixture(Bug::Honest)` and fails on `fixture(Bug::Variant)`.
macro_rules! catches {
    ($test:ident, $bug:expr, $case:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            let honest = planted_support::passes(fixture(Bug::Honest).await, |f| async move {
                cases::$case(&*f).await
            })
            .await;
            assert!(honest, "{} fails on the honest backend", stringify!($case));
            let buggy =
                planted_support::passes(
                    fixture($bug).await,
                    |f| async move { cases::$case(&*f).await },
                )
                .await;
            assert!(
                !buggy,
                "{} passed with {:?} planted: the suite misses that bug",
                stringify!($case),
                $bug
            );
        }
    };
}
