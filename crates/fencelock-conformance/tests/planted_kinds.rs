//! The cases for reader-writer locks and elections must catch broken backends too.
//! The fencelock server has neither yet, so each test wraps the etcd backend (which
//! has both) in one planted bug and asserts that the case meant to catch it fails,
//! while the same case passes on the honest backend. The planted fixture, the runner
//! and `catches!` are shared with `planted.rs` (`planted_support/`).

use crate::planted_support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencelock::etcd::{EtcdBackend, EtcdConfig};
use fencelock::{
    AcquireSpec, BoxFuture, Capabilities, Error, Leader, Lease, LockBackend, LockMode,
};
use fencelock_conformance::{cases, Fixture};
use fencelock_testkit::Etcd;
use planted_support::Planted;

/// One bug, planted in an otherwise correct backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bug {
    /// None: the honest backend (the control run).
    Honest,
    /// A shared request is taken as an exclusive one.
    SharedAsExclusive,
    /// Says it has no shared locks, but grants a shared request as exclusive (what
    /// the Redis, MySQL and PostgreSQL table backends did before they refused it).
    SilentlyExclusive,
    /// Every leader reports the first term this backend ever handed out.
    TermReused,
    /// Proclaim answers success without changing the value.
    ProclaimIgnored,
}

struct Buggy {
    inner: Arc<dyn LockBackend>,
    bug: Bug,
    /// The first term handed out through any client of the fixture.
    first_term: Arc<Mutex<Option<u64>>>,
}

impl LockBackend for Buggy {
    fn capabilities(&self) -> Capabilities {
        let mut caps = self.inner.capabilities();
        if self.bug == Bug::SilentlyExclusive {
            caps.shared = false;
        }
        caps
    }

    fn acquire<'a>(&'a self, spec: &'a AcquireSpec) -> BoxFuture<'a, Result<Lease, Error>> {
        Box::pin(async move {
            let mut spec = spec.clone();
            if matches!(self.bug, Bug::SharedAsExclusive | Bug::SilentlyExclusive) {
                spec.mode = LockMode::Exclusive;
            }
            self.inner.acquire(&spec).await
        })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Duration, Error>> {
        self.inner.renew(lease, ttl)
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<bool, Error>> {
        self.inner.release(lease)
    }

    fn downgrade<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<(), Error>> {
        self.inner.downgrade(lease)
    }

    fn campaign<'a>(
        &'a self,
        spec: &'a AcquireSpec,
        value: &'a str,
    ) -> BoxFuture<'a, Result<Lease, Error>> {
        Box::pin(async move {
            let lease = self.inner.campaign(spec, value).await?;
            if self.bug != Bug::TermReused {
                return Ok(lease);
            }
            let term = *self.first_term.lock().unwrap().get_or_insert(lease.fence);
            Ok(Lease::new(lease.name, term, lease.owner_token, lease.ttl))
        })
    }

    fn proclaim<'a>(
        &'a self,
        lease: &'a Lease,
        value: &'a str,
    ) -> BoxFuture<'a, Result<(), Error>> {
        if self.bug == Bug::ProclaimIgnored {
            return Box::pin(async { Ok(()) });
        }
        self.inner.proclaim(lease, value)
    }

    fn leader<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<Leader>, Error>> {
        self.inner.leader(name)
    }

    fn leader_change<'a>(
        &'a self,
        name: &'a str,
        known: Option<&'a Leader>,
        wait: Duration,
    ) -> BoxFuture<'a, Result<Option<Leader>, Error>> {
        self.inner.leader_change(name, known, wait)
    }
}

/// A throwaway etcd as a fixture (the honest backend the bugs are planted in).
struct EtcdStore {
    etcd: Etcd,
}

impl Fixture for EtcdStore {
    fn addrs(&self) -> Vec<SocketAddr> {
        vec![SocketAddr::from(([127, 0, 0, 1], self.etcd.port()))]
    }

    fn connect<'a>(
        &'a self,
        addrs: &'a [SocketAddr],
    ) -> BoxFuture<'a, Result<Arc<dyn LockBackend>, Error>> {
        Box::pin(async move {
            let config = EtcdConfig::new(format!("http://{}", addrs[0]));
            Ok(Arc::new(EtcdBackend::connect(config).await?) as Arc<dyn LockBackend>)
        })
    }
}

/// A fresh etcd whose clients carry `bug`.
async fn fixture(bug: Bug) -> Arc<Planted<EtcdStore>> {
    let etcd = tokio::task::spawn_blocking(Etcd::start)
        .await
        .expect("start task")
        .expect("etcd starts (Debian package etcd-server)");
    let first_term: Arc<Mutex<Option<u64>>> = Arc::default();
    Arc::new(Planted::new(EtcdStore { etcd }, move |inner| {
        Arc::new(Buggy {
            inner,
            bug,
            first_term: first_term.clone(),
        })
    }))
}

catches!(
    readers_case_catches_shared_granted_as_exclusive,
    Bug::SharedAsExclusive,
    shared_readers_hold_together
);
catches!(
    kinds_case_catches_a_silent_exclusive_grant,
    Bug::SilentlyExclusive,
    capabilities_match_the_kinds
);
catches!(
    takeover_case_catches_a_reused_term,
    Bug::TermReused,
    election_term_increases_on_takeover
);
catches!(
    successor_case_catches_a_reused_term,
    Bug::TermReused,
    election_successor_leads_after_resign
);
catches!(
    proclaim_case_catches_an_ignored_proclaim,
    Bug::ProclaimIgnored,
    election_proclaim_is_seen
);
