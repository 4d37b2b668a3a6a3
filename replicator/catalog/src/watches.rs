//! Watches of source roots in a pool (the `watches` table) and the
//! agents' fingerprints of those roots (`root_fingerprints`).
//!
//! A watch is a lease like a transfer's (see [`crate::pool`]): one agent
//! at a time watches a root, until `lease_until` by the database's clock,
//! renewed with each heartbeat of its holder ([`Catalog::heartbeat`]). A
//! lapsed watch lease is never renewed; another agent (or the same one)
//! must claim it again, under the next epoch.

use sqlx::Row;

use crate::{Catalog, CatalogError};

/// A watch claimed (see [`Catalog::claim_watch`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchClaim {
    /// The lease's epoch: one more than the root's previous watch lease
    /// (the same when the agent renewed a lease it held).
    pub epoch: i64,
    /// The agent whose watch lease lapsed before this claim, if another
    /// agent watched the root last (a takeover).
    pub took_over_from: Option<String>,
}

/// A root's watch as the catalog records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchLease {
    /// The root's path, as the source agents of the pool read it.
    pub root: String,
    /// The agent watching it (or that watched it last, if the lease
    /// lapsed); `None` when released.
    pub holder: Option<String>,
    /// Whether the lease is live now (by the database clock).
    pub live: bool,
    /// When the lease ends unless renewed, Unix ms (database clock).
    pub lease_until: Option<i64>,
    /// The lease's epoch (0: never claimed).
    pub epoch: i64,
}

/// One agent's fingerprint of one root (see `root_fingerprints` in
/// migration 0011).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RootFingerprint {
    /// The root's path.
    pub root: String,
    /// The agent that recorded it.
    pub agent: String,
    /// JSON `[[relative path, size in bytes, mtime in Unix ms], ...]`:
    /// the root's first 100 regular files (sorted depth-first walk)
    /// modified at or before `cutoff_ms`.
    pub entries: String,
    /// Files modified after this time (Unix ms, the agent's clock) are
    /// left out.
    pub cutoff_ms: i64,
    /// When it was recorded, Unix ms (database clock).
    pub recorded_at: i64,
    /// How long ago it was recorded, ms (database clock).
    pub age_ms: i64,
    /// Why the agent refuses to watch the root (`None`: it agrees with
    /// the watching agent's, or had nothing to compare with).
    pub refused: Option<String>,
}

impl Catalog {
    /// Claims the watch of source root `root` for agent `agent` for
    /// `timeout_ms`: taken if nobody holds a live lease on it (a new
    /// epoch), renewed if `agent` holds it already. `None`: another agent
    /// holds a live lease, or `agent` is drained.
    ///
    /// # Errors
    /// SQL errors (nothing is claimed then).
    pub async fn claim_watch(
        &self,
        root: &str,
        agent: &str,
        timeout_ms: i64,
    ) -> Result<Option<WatchClaim>, CatalogError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            &self
                .db
                .sql("INSERT INTO watches (root) VALUES (?) ON CONFLICT (root) DO NOTHING"),
        )
        .bind(root)
        .execute(&mut *tx)
        .await?;
        let q = format!(
            "SELECT holder, lease_until, lease_epoch, {} AS now, \
             (SELECT COUNT(*) FROM agents WHERE name = ? AND draining = 1) AS drained \
             FROM watches WHERE root = ?{}",
            self.db.now_ms(),
            self.db.lock_for_update()
        );
        let row = sqlx::query(&self.db.sql(&q))
            .bind(agent)
            .bind(root)
            .fetch_one(&mut *tx)
            .await?;
        let holder: Option<String> = row.try_get("holder")?;
        let until: Option<i64> = row.try_get("lease_until")?;
        let epoch: i64 = row.try_get("lease_epoch")?;
        let now: i64 = row.try_get("now")?;
        let drained: i64 = row.try_get("drained")?;
        let live = until.is_some_and(|u| u >= now);
        let mine = holder.as_deref() == Some(agent);
        if drained > 0 || (live && !mine) {
            tx.rollback().await?;
            return Ok(None);
        }
        let new_epoch = if live { epoch } else { epoch + 1 };
        sqlx::query(&self.db.sql(
            "UPDATE watches SET holder = ?, lease_until = ?, lease_epoch = ?, \
             claimed_at = CASE WHEN lease_epoch = ? THEN claimed_at ELSE ? END \
             WHERE root = ? AND lease_epoch = ?",
        ))
        .bind(agent)
        .bind(now + timeout_ms)
        .bind(new_epoch)
        .bind(new_epoch)
        .bind(now)
        .bind(root)
        .bind(epoch)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Some(WatchClaim {
            epoch: new_epoch,
            took_over_from: holder.filter(|h| !live && h != agent && until.is_some()),
        }))
    }

    /// Agent `agent` releases its watch of `root` (it stops watching:
    /// drained, or stopping). Returns false if it did not hold it.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn release_watch(&self, root: &str, agent: &str) -> Result<bool, CatalogError> {
        let r = sqlx::query(&self.db.sql(
            "UPDATE watches SET holder = NULL, lease_until = NULL WHERE root = ? AND holder = ?",
        ))
        .bind(root)
        .bind(agent)
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected() > 0)
    }

    /// Every root's watch, by root.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn watches(&self) -> Result<Vec<WatchLease>, CatalogError> {
        let q = format!(
            "SELECT root, holder, lease_until, lease_epoch, \
             CASE WHEN lease_until >= {} THEN 1 ELSE 0 END AS live \
             FROM watches ORDER BY root",
            self.db.now_ms()
        );
        let rows = sqlx::query(&q).fetch_all(&self.pool).await?;
        Ok(rows.iter().map(watch_row).collect::<Result<_, _>>()?)
    }

    /// The watch of `root`, if any agent ever claimed it.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn watch(&self, root: &str) -> Result<Option<WatchLease>, CatalogError> {
        let q = format!(
            "SELECT root, holder, lease_until, lease_epoch, \
             CASE WHEN lease_until >= {} THEN 1 ELSE 0 END AS live \
             FROM watches WHERE root = ?",
            self.db.now_ms()
        );
        let r = sqlx::query(&self.db.sql(&q))
            .bind(root)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(watch_row).transpose()?)
    }

    /// Records agent `agent`'s fingerprint of `root` (replacing its
    /// previous one), with `refused` saying why it does not watch the
    /// root, if so. `entries` is the JSON of
    /// [`RootFingerprint::entries`]; `cutoff_ms` as there.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn record_root_fingerprint(
        &self,
        root: &str,
        agent: &str,
        entries: &str,
        cutoff_ms: i64,
        refused: Option<&str>,
    ) -> Result<(), CatalogError> {
        let q = format!(
            "INSERT INTO root_fingerprints (root, agent, entries, cutoff_ms, recorded_at, refused) \
             VALUES (?, ?, ?, ?, {}, ?) ON CONFLICT (root, agent) DO UPDATE SET \
             entries = excluded.entries, cutoff_ms = excluded.cutoff_ms, \
             recorded_at = excluded.recorded_at, refused = excluded.refused",
            self.db.now_ms()
        );
        sqlx::query(&self.db.sql(&q))
            .bind(root)
            .bind(agent)
            .bind(entries)
            .bind(cutoff_ms)
            .bind(refused)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// The fingerprints of `root` (every root with `None`) the agents
    /// recorded, by root then agent.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn root_fingerprints(
        &self,
        root: Option<&str>,
    ) -> Result<Vec<RootFingerprint>, CatalogError> {
        let cols = format!(
            "root, agent, entries, cutoff_ms, recorded_at, refused, {} - recorded_at AS age_ms",
            self.db.now_ms()
        );
        let rows = match root {
            Some(r) => {
                sqlx::query(&self.db.sql(&format!(
                    "SELECT {cols} FROM root_fingerprints WHERE root = ? ORDER BY root, agent"
                )))
                .bind(r)
                .fetch_all(&self.pool)
                .await?
            }
            None => {
                sqlx::query(&format!(
                    "SELECT {cols} FROM root_fingerprints ORDER BY root, agent"
                ))
                .fetch_all(&self.pool)
                .await?
            }
        };
        Ok(rows
            .iter()
            .map(|r| {
                Ok(RootFingerprint {
                    root: r.try_get("root")?,
                    agent: r.try_get("agent")?,
                    entries: r.try_get("entries")?,
                    cutoff_ms: r.try_get("cutoff_ms")?,
                    recorded_at: r.try_get("recorded_at")?,
                    age_ms: r.try_get("age_ms")?,
                    refused: r.try_get("refused")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()?)
    }
}

fn watch_row(r: &sqlx::any::AnyRow) -> Result<WatchLease, sqlx::Error> {
    Ok(WatchLease {
        root: r.try_get("root")?,
        holder: r.try_get("holder")?,
        live: r.try_get::<i64, _>("live")? != 0,
        lease_until: r.try_get("lease_until")?,
        epoch: r.try_get("lease_epoch")?,
    })
}
