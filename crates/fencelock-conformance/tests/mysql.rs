//! The conformance suite against MariaDB, each case on its own throwaway server: table
//! mode (`fencelock::mysql::MysqlBackend`) and `GET_LOCK` mode
//! (`fencelock::mysql::MysqlGetLockBackend`), each built from a URL and from an
//! application's `mysql_async::Pool`. Store-specific tests are in `mysql_specific.rs`.

use std::net::SocketAddr;
use std::sync::Arc;

use fencelock::mysql::{MysqlBackend, MysqlConfig, MysqlGetLockBackend};
use fencelock::{BoxFuture, Error, LockBackend};
use fencelock_conformance::Fixture;
use fencelock_testkit::{MariaDb, MARIADB_DATABASE, MARIADB_USER};

/// Which backend, built how.
#[derive(Clone, Copy)]
enum Mode {
    TableUrl,
    TablePool,
    GetLockUrl,
    GetLockPool,
}

struct Maria {
    server: MariaDb,
    mode: Mode,
}

fn url(addr: SocketAddr) -> String {
    format!(
        "mysql://{MARIADB_USER}:{MARIADB_USER}@{}:{}/{MARIADB_DATABASE}",
        addr.ip(),
        addr.port()
    )
}

/// The application's pool, as an application would make it (TCP, not the socket the
/// server advertises, so that proxies see the traffic).
fn app_pool(addr: SocketAddr) -> mysql_async::Pool {
    mysql_async::Pool::from_url(format!("{}?prefer_socket=false", url(addr))).expect("a valid URL")
}

impl Fixture for Maria {
    fn addrs(&self) -> Vec<SocketAddr> {
        vec![SocketAddr::from(([127, 0, 0, 1], self.server.port()))]
    }

    fn connect<'a>(
        &'a self,
        addrs: &'a [SocketAddr],
    ) -> BoxFuture<'a, Result<Arc<dyn LockBackend>, Error>> {
        Box::pin(async move {
            let config = MysqlConfig::default();
            let backend: Arc<dyn LockBackend> = match self.mode {
                Mode::TableUrl => Arc::new(MysqlBackend::connect(&url(addrs[0]), config).await?),
                Mode::TablePool => {
                    Arc::new(MysqlBackend::with_pool(app_pool(addrs[0]), config).await?)
                }
                Mode::GetLockUrl => {
                    Arc::new(MysqlGetLockBackend::connect(&url(addrs[0]), config).await?)
                }
                Mode::GetLockPool => {
                    Arc::new(MysqlGetLockBackend::with_pool(app_pool(addrs[0]), config).await?)
                }
            };
            Ok(backend)
        })
    }
}

async fn start(mode: Mode) -> Maria {
    let server = tokio::task::spawn_blocking(MariaDb::start)
        .await
        .expect("start task")
        .expect("MariaDB starts");
    Maria { server, mode }
}

mod table_url {
    use super::*;
    fencelock_conformance::conformance_suite!(start(Mode::TableUrl));
}

mod table_pool {
    use super::*;
    fencelock_conformance::conformance_suite!(start(Mode::TablePool));
}

mod get_lock_url {
    use super::*;
    fencelock_conformance::conformance_suite!(start(Mode::GetLockUrl));
}

mod get_lock_pool {
    use super::*;
    fencelock_conformance::conformance_suite!(start(Mode::GetLockPool));
}
