//! Where commands go: one connection (a `ConnectionManager`, which reconnects by
//! itself), the master a Sentinel names (asked again after a connection failure), or
//! a Redis Cluster (`cluster_async`, which follows `MOVED`/`ASK` and failovers).
//! Every call is bounded by the backend's request timeout, and every Redis error is
//! mapped to the backend's [`Error`].

use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::sentinel::SentinelClient;
use redis::{AsyncConnectionConfig, Cmd, FromRedisValue, RedisError, ScriptInvocation};

use fencelock_backend::{Error, ErrorKind};

/// The command path of one backend (or one Redlock instance).
pub(crate) enum Commands {
    /// One server: a manager the backend opened, or the application's own.
    Manager(ConnectionManager),
    /// The master named by Sentinel.
    Sentinel(Arc<SentinelMaster>),
    /// A Redis Cluster.
    Cluster(ClusterConnection),
}

impl std::fmt::Debug for Commands {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Commands::Manager(_) => "Commands::Manager",
            Commands::Sentinel(_) => "Commands::Sentinel",
            Commands::Cluster(_) => "Commands::Cluster",
        })
    }
}

/// The master a Sentinel deployment names, and the connection to it while it works.
pub(crate) struct SentinelMaster {
    sentinel: tokio::sync::Mutex<SentinelClient>,
    config: AsyncConnectionConfig,
    /// The open connection and its generation (so a failed call drops only the
    /// connection it used, not a newer one).
    current: Mutex<(u64, Option<MultiplexedConnection>)>,
}

impl SentinelMaster {
    pub(crate) fn new(sentinel: SentinelClient, config: AsyncConnectionConfig) -> SentinelMaster {
        SentinelMaster {
            sentinel: tokio::sync::Mutex::new(sentinel),
            config,
            current: Mutex::new((0, None)),
        }
    }

    /// A client of the master the sentinels name now (asks them).
    pub(crate) async fn master_client(&self) -> Result<redis::Client, Error> {
        let mut sentinel = self.sentinel.lock().await;
        sentinel.async_get_client().await.map_err(map_error)
    }

    async fn connection(&self) -> Result<(u64, MultiplexedConnection), Error> {
        {
            let current = lock(&self.current)?;
            if let (generation, Some(connection)) = &*current {
                return Ok((*generation, connection.clone()));
            }
        }
        let client = self.master_client().await?;
        let connection = client
            .get_multiplexed_async_connection_with_config(&self.config)
            .await
            .map_err(map_error)?;
        let mut current = lock(&self.current)?;
        current.0 += 1;
        current.1 = Some(connection.clone());
        Ok((current.0, connection))
    }

    /// Forgets the connection of `generation`: the next call asks the sentinels again.
    fn drop_connection(&self, generation: u64) {
        if let Ok(mut current) = self.current.lock() {
            if current.0 == generation {
                current.1 = None;
            }
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> Result<std::sync::MutexGuard<'_, T>, Error> {
    mutex
        .lock()
        .map_err(|_| Error::new(ErrorKind::Internal, "a redis connection table was poisoned"))
}

impl Commands {
    /// Runs a script (`EVALSHA`, loading it on `NOSCRIPT`), within `timeout`.
    pub(crate) async fn script<T: FromRedisValue>(
        &self,
        invocation: &ScriptInvocation<'_>,
        timeout: Duration,
    ) -> Result<T, Error> {
        match self {
            Commands::Manager(manager) => {
                let mut connection = manager.clone();
                bounded(timeout, invocation.invoke_async(&mut connection)).await
            }
            Commands::Cluster(cluster) => {
                let mut connection = cluster.clone();
                bounded(timeout, invocation.invoke_async(&mut connection)).await
            }
            Commands::Sentinel(master) => {
                let (generation, mut connection) =
                    bounded_result(timeout, master.connection()).await?;
                let result = bounded(timeout, invocation.invoke_async(&mut connection)).await;
                if matches!(&result, Err(e) if e.kind() == ErrorKind::Unavailable) {
                    master.drop_connection(generation);
                }
                result
            }
        }
    }

    /// Runs one command within `timeout`.
    pub(crate) async fn command<T: FromRedisValue>(
        &self,
        command: &Cmd,
        timeout: Duration,
    ) -> Result<T, Error> {
        match self {
            Commands::Manager(manager) => {
                let mut connection = manager.clone();
                bounded(timeout, query(&mut connection, command)).await
            }
            Commands::Cluster(cluster) => {
                let mut connection = cluster.clone();
                bounded(timeout, query(&mut connection, command)).await
            }
            Commands::Sentinel(master) => {
                let (generation, mut connection) =
                    bounded_result(timeout, master.connection()).await?;
                let result = bounded(timeout, query(&mut connection, command)).await;
                if matches!(&result, Err(e) if e.kind() == ErrorKind::Unavailable) {
                    master.drop_connection(generation);
                }
                result
            }
        }
    }
}

async fn query<T: FromRedisValue>(
    connection: &mut impl ConnectionLike,
    command: &Cmd,
) -> Result<T, RedisError> {
    command.query_async(connection).await
}

async fn bounded<T>(
    timeout: Duration,
    work: impl std::future::Future<Output = Result<T, RedisError>>,
) -> Result<T, Error> {
    match tokio::time::timeout(timeout, work).await {
        Ok(result) => result.map_err(map_error),
        Err(_) => Err(timed_out(timeout)),
    }
}

async fn bounded_result<T>(
    timeout: Duration,
    work: impl std::future::Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    tokio::time::timeout(timeout, work)
        .await
        .unwrap_or_else(|_| Err(timed_out(timeout)))
}

fn timed_out(timeout: Duration) -> Error {
    Error::new(
        ErrorKind::Unavailable,
        format!("redis did not answer within {timeout:?}"),
    )
}

/// The backend's error for a Redis error: anything about reaching a server (I/O,
/// refused or dropped connections, timeouts, a cluster or failover in progress, a
/// replica that became read-only) is `Unavailable`, so callers retry.
pub(crate) fn map_error(e: RedisError) -> Error {
    use redis::{ErrorKind as K, ServerErrorKind as S};
    let kind = match e.kind() {
        _ if e.is_io_error()
            || e.is_timeout()
            || e.is_connection_dropped()
            || e.is_connection_refusal()
            || e.is_cluster_error() =>
        {
            ErrorKind::Unavailable
        }
        K::Server(S::BusyLoading | S::TryAgain | S::ClusterDown | S::MasterDown | S::ReadOnly)
        | K::Io
        | K::ClusterConnectionNotFound
        | K::MasterNameNotFoundBySentinel
        | K::NoValidReplicasFoundBySentinel => ErrorKind::Unavailable,
        K::AuthenticationFailed | K::Server(S::NoPerm) => ErrorKind::PermissionDenied,
        K::InvalidClientConfig | K::EmptySentinelList => ErrorKind::InvalidArgument,
        K::Parse | K::UnexpectedReturnType => ErrorKind::Protocol,
        _ => ErrorKind::Internal,
    };
    Error::new(kind, format!("redis: {e}"))
}
