//! The conformance suite against PostgreSQL advisory locks
//! (`fencelock::postgres::PostgresAdvisoryBackend`: no fences, one session per held
//! lock, `idle_session_timeout` as the lease), each case on its own throwaway
//! cluster.

use std::net::SocketAddr;
use std::sync::Arc;

use fencelock::postgres::{PostgresAdvisoryBackend, PostgresConfig};
use fencelock::{BoxFuture, Error, LockBackend};
use fencelock_conformance::Fixture;
use fencelock_testkit::Postgres;

struct PgAdvisory {
    server: Postgres,
}

impl Fixture for PgAdvisory {
    fn addrs(&self) -> Vec<SocketAddr> {
        vec![SocketAddr::from(([127, 0, 0, 1], self.server.port()))]
    }

    fn connect<'a>(
        &'a self,
        addrs: &'a [SocketAddr],
    ) -> BoxFuture<'a, Result<Arc<dyn LockBackend>, Error>> {
        Box::pin(async move {
            let conninfo = format!(
                "host={} port={} user=postgres dbname=postgres",
                addrs[0].ip(),
                addrs[0].port()
            );
            let backend = PostgresAdvisoryBackend::connect(PostgresConfig::new(conninfo)).await?;
            Ok(Arc::new(backend) as Arc<dyn LockBackend>)
        })
    }
}

async fn start() -> PgAdvisory {
    let server = tokio::task::spawn_blocking(Postgres::start)
        .await
        .expect("start task")
        .expect("PostgreSQL starts");
    PgAdvisory { server }
}

fencelock_conformance::conformance_suite!(start());
