//! The conformance suite against PostgreSQL in table mode
//! (`fencelock::postgres::PostgresBackend`), each case on its own throwaway cluster.
//! Table-mode-only tests (the fence measurement against the naive recipe) are in
//! `postgres_specific.rs`.

use std::net::SocketAddr;
use std::sync::Arc;

use fencelock::postgres::{PostgresBackend, PostgresConfig};
use fencelock::{BoxFuture, Error, LockBackend};
use fencelock_conformance::Fixture;
use fencelock_testkit::Postgres;

struct Pg {
    server: Postgres,
}

fn conninfo(addr: SocketAddr) -> String {
    format!(
        "host={} port={} user=postgres dbname=postgres",
        addr.ip(),
        addr.port()
    )
}

impl Fixture for Pg {
    fn addrs(&self) -> Vec<SocketAddr> {
        vec![SocketAddr::from(([127, 0, 0, 1], self.server.port()))]
    }

    fn connect<'a>(
        &'a self,
        addrs: &'a [SocketAddr],
    ) -> BoxFuture<'a, Result<Arc<dyn LockBackend>, Error>> {
        Box::pin(async move {
            let backend = PostgresBackend::connect(PostgresConfig::new(conninfo(addrs[0]))).await?;
            Ok(Arc::new(backend) as Arc<dyn LockBackend>)
        })
    }
}

async fn start() -> Pg {
    let server = tokio::task::spawn_blocking(Postgres::start)
        .await
        .expect("start task")
        .expect("PostgreSQL starts");
    Pg { server }
}

fencelock_conformance::conformance_suite!(start());
