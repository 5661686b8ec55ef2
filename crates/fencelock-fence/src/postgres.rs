//! The PostgreSQL gate: one conditional `UPDATE` per fenced write.
//!
//! # Schema
//!
//! The protected table gets one column, and every row starts at fence 0:
//!
//! ```sql
//! ALTER TABLE inventory ADD COLUMN fence BIGINT NOT NULL DEFAULT 0;
//! ```
//!
//! # The SQL, for any driver
//!
//! A fenced write is a single statement. The database applies the `WHERE` and the `SET`
//! under the row lock, so the check and the write are atomic, also between concurrent
//! transactions:
//!
//! ```sql
//! UPDATE inventory
//!    SET stock = stock - 1, fence = $fence
//!  WHERE id = $id AND fence < $fence;
//! ```
//!
//! One row updated: applied. Zero rows: the fence is stale — or there is no such row.
//! To tell them apart, read the row's fence afterwards (a missing row is "not found"):
//!
//! ```sql
//! SELECT fence FROM inventory WHERE id = $id;
//! ```
//!
//! Fences are `u64`; `BIGINT` is signed, so fences above `i64::MAX` cannot be stored.
//! fencelock never issues them in practice (it would take 292,000 years at a million
//! grants per second), but the helper refuses them explicitly
//! ([`ErrorKind::FenceOutOfRange`]) rather than wrap around to a negative number.
//!
//! Keep every writer of the row on the fenced statement: an unfenced `UPDATE` in some
//! other code path bypasses the check.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio_postgres::types::ToSql;
use tokio_postgres::GenericClient;

use crate::{ErrorKind, FenceError, FenceGate, GateMetrics};

/// Builds and runs the fenced `UPDATE` for one table (see the [module docs](self) for
/// the SQL and the schema).
///
/// Works with a `tokio_postgres::Client` or inside a `Transaction` (anything that
/// implements `GenericClient`).
///
/// ```no_run
/// # async fn demo(client: &tokio_postgres::Client) -> Result<(), fencelock_fence::FenceError> {
/// use fencelock_fence::PgFence;
/// let inventory = PgFence::new("inventory")?;
/// let (item_id, fence): (i64, u64) = (1, 42);
/// // UPDATE "inventory" SET stock = stock - $1, "fence" = $2 WHERE "id" = $3 AND "fence" < $2
/// inventory
///     .update(client, &item_id, fence, "stock = stock - $1", &[&1i32])
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct PgFence {
    name: String,
    table: String,
    id_column: String,
    fence_column: String,
    stale_rejections: AtomicU64,
}

impl PgFence {
    /// The fence for `table` (optionally schema-qualified: `shop.inventory`), with key
    /// column `id` and fence column `fence`; its metrics name is `"postgres"`.
    ///
    /// Identifiers must be plain (`[A-Za-z_][A-Za-z0-9_]*`); they are quoted in the SQL.
    pub fn new(table: &str) -> Result<PgFence, FenceError> {
        Ok(PgFence {
            name: "postgres".to_owned(),
            table: quote_path(table)?,
            id_column: quote_ident(default_id())?,
            fence_column: quote_ident(default_fence())?,
            stale_rejections: AtomicU64::new(0),
        })
    }

    /// Uses other column names for the row key and the fence.
    pub fn with_columns(
        mut self,
        id_column: &str,
        fence_column: &str,
    ) -> Result<PgFence, FenceError> {
        self.id_column = quote_ident(id_column)?;
        self.fence_column = quote_ident(fence_column)?;
        Ok(self)
    }

    /// Sets the name used as the `gate` label in metrics.
    pub fn named(mut self, name: impl Into<String>) -> PgFence {
        self.name = name.into();
        self
    }

    /// The statement [`update`](PgFence::update) runs. `set` is the caller's assignment
    /// list using parameters `$1..=$set_params`; the fence becomes parameter
    /// `$set_params+1` and the row id `$set_params+2`. An empty `set` only advances the
    /// fence.
    pub fn update_sql(&self, set: &str, set_params: usize) -> String {
        let (fence, id) = (set_params + 1, set_params + 2);
        let assign = if set.trim().is_empty() {
            String::new()
        } else {
            format!("{set}, ")
        };
        format!(
            "UPDATE {table} SET {assign}{f} = ${fence} WHERE {id_col} = ${id} AND {f} < ${fence}",
            table = self.table,
            f = self.fence_column,
            id_col = self.id_column,
        )
    }

    /// Applies `SET {set}` to the row `id` if `fence` is greater than the row's fence,
    /// and sets the row's fence to `fence`, in one statement.
    ///
    /// `params` are the values of `$1..` in `set`. Errors: [`ErrorKind::Stale`] (with
    /// the row's current fence in [`FenceError::last_fence`]), [`ErrorKind::NotFound`]
    /// (no such row), [`ErrorKind::FenceOutOfRange`] (fence above `i64::MAX`),
    /// [`ErrorKind::Database`]. In the first three cases nothing changed.
    pub async fn update<C>(
        &self,
        client: &C,
        id: &(dyn ToSql + Sync),
        fence: u64,
        set: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<(), FenceError>
    where
        C: GenericClient + Sync,
    {
        let fence_sql = to_bigint(fence)?;
        let sql = self.update_sql(set, params.len());
        let mut all: Vec<&(dyn ToSql + Sync)> = Vec::with_capacity(params.len() + 2);
        all.extend_from_slice(params);
        all.push(&fence_sql);
        all.push(id);
        let updated = client
            .execute(sql.as_str(), &all)
            .await
            .map_err(|e| db_error("fenced update", e))?;
        match updated {
            1 => Ok(()),
            0 => match self.current_fence(client, id).await? {
                None => Err(FenceError::new(
                    ErrorKind::NotFound,
                    format!("no row in {} with that {}", self.table, self.id_column),
                )
                .with_fence(fence)),
                Some(current) => {
                    self.stale_rejections.fetch_add(1, Ordering::Relaxed);
                    Err(FenceError::stale(
                        &format_args!("row of {}", self.table),
                        fence,
                        Some(current),
                    ))
                }
            },
            n => Err(FenceError::new(
                ErrorKind::InvalidInput,
                format!(
                    "the fenced update matched {n} rows of {}: {} must be unique",
                    self.table, self.id_column
                ),
            )),
        }
    }

    /// The row's fence (`None` if there is no such row).
    pub async fn last_fence<C>(
        &self,
        client: &C,
        id: &(dyn ToSql + Sync),
    ) -> Result<Option<u64>, FenceError>
    where
        C: GenericClient + Sync,
    {
        self.current_fence(client, id).await
    }

    async fn current_fence<C>(
        &self,
        client: &C,
        id: &(dyn ToSql + Sync),
    ) -> Result<Option<u64>, FenceError>
    where
        C: GenericClient + Sync,
    {
        let sql = format!(
            "SELECT {f} FROM {table} WHERE {id_col} = $1",
            f = self.fence_column,
            table = self.table,
            id_col = self.id_column
        );
        let row = client
            .query_opt(sql.as_str(), &[id])
            .await
            .map_err(|e| db_error("read the row's fence", e))?;
        match row {
            None => Ok(None),
            Some(row) => {
                let fence: i64 = row
                    .try_get(0)
                    .map_err(|e| db_error("read the fence column as BIGINT", e))?;
                Ok(Some(fence.max(0) as u64))
            }
        }
    }
}

impl GateMetrics for PgFence {
    fn name(&self) -> &str {
        &self.name
    }

    fn stale_rejections(&self) -> u64 {
        self.stale_rejections.load(Ordering::Relaxed)
    }
}

/// A write for [`PgGate`]: the assignment list and its parameters (`$1..`).
pub struct PgWrite {
    /// The assignments, e.g. `"stock = stock - $1"`.
    pub set: String,
    /// The values of `$1..` in `set`.
    pub params: Vec<Box<dyn ToSql + Send + Sync>>,
}

impl PgWrite {
    /// A write with the given assignments and no parameters yet.
    pub fn new(set: impl Into<String>) -> PgWrite {
        PgWrite {
            set: set.into(),
            params: Vec::new(),
        }
    }

    /// Adds the value of the next parameter.
    pub fn param(mut self, value: impl ToSql + Send + Sync + 'static) -> PgWrite {
        self.params.push(Box::new(value));
        self
    }
}

impl std::fmt::Debug for PgWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgWrite")
            .field("set", &self.set)
            .field("params", &self.params)
            .finish()
    }
}

/// A [`PgFence`] with its own connection, as a [`FenceGate`] keyed by row id.
///
/// ```no_run
/// # async fn demo(client: tokio_postgres::Client) -> Result<(), fencelock_fence::FenceError> {
/// use fencelock_fence::{FenceGate, PgFence, PgGate, PgWrite};
/// let gate = PgGate::new(client, PgFence::new("inventory")?);
/// gate.apply(&1i64, 42, PgWrite::new("stock = stock - $1").param(1i32)).await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct PgGate {
    client: Arc<tokio_postgres::Client>,
    fence: Arc<PgFence>,
}

impl PgGate {
    /// A gate that runs `fence`'s statements on `client`.
    pub fn new(client: impl Into<Arc<tokio_postgres::Client>>, fence: PgFence) -> PgGate {
        PgGate {
            client: client.into(),
            fence: Arc::new(fence),
        }
    }

    /// The connection.
    pub fn client(&self) -> &tokio_postgres::Client {
        &self.client
    }

    /// The statement builder.
    pub fn fence(&self) -> &PgFence {
        &self.fence
    }
}

impl GateMetrics for PgGate {
    fn name(&self) -> &str {
        self.fence.name()
    }

    fn stale_rejections(&self) -> u64 {
        self.fence.stale_rejections()
    }
}

impl FenceGate for PgGate {
    type Key = dyn ToSql + Sync;
    type Write = PgWrite;
    type Applied = ();

    /// [`PgFence::update`] on the gate's connection.
    async fn apply(&self, key: &Self::Key, fence: u64, write: PgWrite) -> Result<(), FenceError> {
        let params: Vec<&(dyn ToSql + Sync)> = write
            .params
            .iter()
            .map(|p| p.as_ref() as &(dyn ToSql + Sync))
            .collect();
        self.fence
            .update(self.client.as_ref(), key, fence, &write.set, &params)
            .await
    }
}

fn default_id() -> &'static str {
    "id"
}

fn default_fence() -> &'static str {
    "fence"
}

fn to_bigint(fence: u64) -> Result<i64, FenceError> {
    i64::try_from(fence).map_err(|_| {
        FenceError::new(
            ErrorKind::FenceOutOfRange,
            format!(
                "fence {fence} does not fit PostgreSQL's BIGINT (at most {})",
                i64::MAX
            ),
        )
        .with_fence(fence)
    })
}

fn quote_ident(ident: &str) -> Result<String, FenceError> {
    let mut chars = ident.chars();
    let valid = ident.len() <= 63
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !valid {
        return Err(FenceError::new(
            ErrorKind::InvalidInput,
            format!("{ident:?} is not a plain SQL identifier ([A-Za-z_][A-Za-z0-9_]*, at most 63 bytes)"),
        ));
    }
    Ok(format!("\"{ident}\""))
}

fn quote_path(path: &str) -> Result<String, FenceError> {
    let parts: Vec<String> = path.split('.').map(quote_ident).collect::<Result<_, _>>()?;
    if parts.len() > 2 {
        return Err(FenceError::new(
            ErrorKind::InvalidInput,
            format!("{path:?}: expected TABLE or SCHEMA.TABLE"),
        ));
    }
    Ok(parts.join("."))
}

fn db_error(what: &str, err: tokio_postgres::Error) -> FenceError {
    FenceError::new(ErrorKind::Database, format!("PostgreSQL: {what}")).with_source(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sql_appends_fence_and_id_after_the_callers_parameters() {
        let pg = PgFence::new("shop.inventory").unwrap();
        assert_eq!(
            pg.update_sql("stock = stock - $1, note = $2", 2),
            "UPDATE \"shop\".\"inventory\" SET stock = stock - $1, note = $2, \"fence\" = $3 \
             WHERE \"id\" = $4 AND \"fence\" < $3"
        );
        assert_eq!(
            pg.update_sql("  ", 0),
            "UPDATE \"shop\".\"inventory\" SET \"fence\" = $1 WHERE \"id\" = $2 AND \"fence\" < $1"
        );
        let pg = PgFence::new("t")
            .unwrap()
            .with_columns("sku", "lock_fence")
            .unwrap();
        assert_eq!(
            pg.update_sql("v = $1", 1),
            "UPDATE \"t\" SET v = $1, \"lock_fence\" = $2 WHERE \"sku\" = $3 AND \"lock_fence\" < $2"
        );
    }

    #[test]
    fn identifiers_must_be_plain() {
        for bad in ["", "a b", "t\"; DROP TABLE x; --", "1abc", "a.b.c", "a..b"] {
            let err = PgFence::new(bad).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidInput, "{bad:?}");
        }
        let err = PgFence::new("t")
            .unwrap()
            .with_columns("id", "fe-nce")
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput);
    }

    #[test]
    fn fences_above_i64_max_are_refused() {
        assert_eq!(to_bigint(i64::MAX as u64).unwrap(), i64::MAX);
        let err = to_bigint(i64::MAX as u64 + 1).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::FenceOutOfRange);
        assert_eq!(err.fence(), Some(i64::MAX as u64 + 1));
    }
}
