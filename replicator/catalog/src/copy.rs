//! `ferry catalog migrate`: a single agent's SQLite catalog copied, row
//! for row and with its ids, into an empty PostgreSQL catalog.

use sqlx::{Row, ValueRef};

use crate::convert::real;
use crate::dialect::Dialect;
use crate::{Catalog, CatalogError};

/// The tables copied, parents first (`chunks` refers to `replicas`).
/// `_sqlx_migrations` and `catalog_site` belong to the target; the
/// catalog's id (`catalog_identity`) is carried over. `settings` is empty
/// on SQLite (a single agent's settings are its config's, which seed the
/// pool's at its first start on PostgreSQL).
pub const COPIED_TABLES: [&str; 11] = [
    "transfers",
    "jobs",
    "signals",
    "events",
    "replicas",
    "replica_files",
    "chunks",
    "leases",
    "pin_requests",
    "replica_events",
    "webhook_positions",
];

/// Rows copied per table, in [`COPIED_TABLES`] order.
pub type CopyCounts = Vec<(&'static str, u64)>;

/// A PostgreSQL column's type, which decides how a value is read from
/// SQLite and bound.
#[derive(Clone, Copy)]
enum Kind {
    Int,
    Real,
    Text,
    Bytes,
}

impl Catalog {
    /// Copies every row of this SQLite catalog into `target`, an empty
    /// PostgreSQL catalog, in one transaction of the target, keeping ids;
    /// each identity column then continues after the largest id copied.
    ///
    /// # Errors
    /// [`CatalogError::Invalid`] if this is not SQLite or `target` not
    /// PostgreSQL, or `target` already holds transfers or replicas
    /// (nothing is copied then); SQL errors (the target is left as it
    /// was).
    pub async fn copy_into(&self, target: &Catalog) -> Result<CopyCounts, CatalogError> {
        if self.db != Dialect::Sqlite || target.db != Dialect::Postgres {
            return Err(CatalogError::Invalid(
                "a catalog is copied from SQLite into PostgreSQL only".into(),
            ));
        }
        let mut tx = target.pool.begin().await?;
        for t in ["transfers", "replicas"] {
            let n: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {t}"))
                .fetch_one(&mut *tx)
                .await?;
            if n > 0 {
                return Err(CatalogError::Invalid(format!(
                    "the target catalog already holds {n} {t}; copy into an empty catalog \
                     (a new database)"
                )));
            }
        }
        let mut counts = Vec::new();
        for table in COPIED_TABLES {
            let cols: Vec<(String, String)> = sqlx::query(
                "SELECT column_name::text AS name, data_type::text AS ty \
                 FROM information_schema.columns \
                 WHERE table_schema = current_schema() AND table_name = $1 \
                 ORDER BY ordinal_position",
            )
            .bind(table)
            .fetch_all(&mut *tx)
            .await?
            .iter()
            .map(|r| Ok((r.try_get("name")?, r.try_get("ty")?)))
            .collect::<Result<_, sqlx::Error>>()?;
            let kinds: Vec<Kind> = cols
                .iter()
                .map(|(name, ty)| match ty.as_str() {
                    "bigint" | "integer" | "smallint" => Ok(Kind::Int),
                    "double precision" | "real" => Ok(Kind::Real),
                    "text" => Ok(Kind::Text),
                    "bytea" => Ok(Kind::Bytes),
                    other => Err(CatalogError::Invalid(format!(
                        "{table}.{name} has type {other}, which the copy does not know"
                    ))),
                })
                .collect::<Result<_, _>>()?;
            let names: Vec<&str> = cols.iter().map(|c| c.0.as_str()).collect();
            let list = names.join(", ");
            let marks = vec!["?"; names.len()].join(", ");
            let insert = target
                .db
                .sql(&format!("INSERT INTO {table} ({list}) VALUES ({marks})"))
                .into_owned();
            let rows = sqlx::query(&format!("SELECT {list} FROM {table}"))
                .fetch_all(&self.pool)
                .await?;
            for row in &rows {
                let mut q = sqlx::query(&insert);
                for (i, kind) in kinds.iter().enumerate() {
                    let null = row.try_get_raw(i)?.is_null();
                    q = match kind {
                        Kind::Int => q.bind(if null {
                            None
                        } else {
                            Some(row.try_get::<i64, _>(i)?)
                        }),
                        Kind::Real => q.bind(real(if null {
                            None
                        } else {
                            Some(row.try_get::<f64, _>(i)?)
                        })),
                        Kind::Text => q.bind(if null {
                            None
                        } else {
                            Some(row.try_get::<String, _>(i)?)
                        }),
                        Kind::Bytes => q.bind(if null {
                            None
                        } else {
                            Some(row.try_get::<Vec<u8>, _>(i)?)
                        }),
                    };
                }
                q.execute(&mut *tx).await?;
            }
            // `replica_files` is keyed by replica, `leases` by a random text id.
            if names.contains(&"id") && table != "replica_files" && table != "leases" {
                sqlx::query(&format!(
                    "SELECT setval(pg_get_serial_sequence('{table}', 'id'), \
                     COALESCE(MAX(id), 0) + 1, false) FROM {table}"
                ))
                .execute(&mut *tx)
                .await?;
            }
            counts.push((table, rows.len() as u64));
        }
        // The catalog keeps its id: sinks key this agent's transfers by
        // it, so they resume after the move.
        sqlx::query("UPDATE catalog_identity SET catalog_id = $1 WHERE id = 1")
            .bind(self.id())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(counts)
    }
}
