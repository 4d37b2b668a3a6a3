//! Publish leases of a sink pool (the `publish_leases` table, migration
//! 0019).
//!
//! The sink agents of a site share one sink root and one catalog. One of
//! them at a time moves a version into a given published path: it claims
//! the path's publish lease first, a lease like a transfer's (see
//! [`crate::pool`]), until `lease_until` by the database's clock, renewed
//! with each heartbeat of its holder ([`Catalog::heartbeat`]). A lapsed
//! lease is never renewed: another sink agent claims it under the next
//! epoch and finishes the interrupted publish from what is on disk.

use sqlx::Row;

use crate::{Catalog, CatalogError};

/// A publish lease claimed (see [`Catalog::claim_publish`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishClaim {
    /// The lease's epoch: one more than the path's previous publish lease
    /// (the same when the agent renewed a lease it held).
    pub epoch: i64,
    /// The agent whose publish lease on the path lapsed before this
    /// claim, and the replica row it was publishing: an interrupted
    /// publish the claimer finishes (a takeover).
    pub took_over_from: Option<(String, Option<i64>)>,
}

/// Who holds the publish lease on a path now (see
/// [`Catalog::publish_holder`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishHolder {
    /// The sink agent holding it.
    pub agent: String,
    /// The replica row it publishes.
    pub replica: Option<i64>,
    /// Milliseconds until the lease lapses unless renewed (database
    /// clock).
    pub left_ms: i64,
}

impl Catalog {
    /// Claims the publish lease on published path `local_path` for sink
    /// agent `agent`, publishing replica row `replica`, for `timeout_ms`:
    /// taken if nobody holds a live lease on the path (a new epoch),
    /// renewed if `agent` holds it already. `None`: another agent holds a
    /// live lease on it.
    ///
    /// # Errors
    /// SQL errors (nothing is claimed then).
    pub async fn claim_publish(
        &self,
        local_path: &str,
        replica: i64,
        agent: &str,
        timeout_ms: i64,
    ) -> Result<Option<PublishClaim>, CatalogError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(&self.db.sql(
            "INSERT INTO publish_leases (local_path) VALUES (?) ON CONFLICT (local_path) DO NOTHING",
        ))
        .bind(local_path)
        .execute(&mut *tx)
        .await?;
        let q = format!(
            "SELECT holder, replica, lease_until, lease_epoch, {} AS now \
             FROM publish_leases WHERE local_path = ?{}",
            self.db.now_ms(),
            self.db.lock_for_update()
        );
        let row = sqlx::query(&self.db.sql(&q))
            .bind(local_path)
            .fetch_one(&mut *tx)
            .await?;
        let holder: Option<String> = row.try_get("holder")?;
        let held_replica: Option<i64> = row.try_get("replica")?;
        let until: Option<i64> = row.try_get("lease_until")?;
        let epoch: i64 = row.try_get("lease_epoch")?;
        let now: i64 = row.try_get("now")?;
        let live = until.is_some_and(|u| u >= now);
        let mine = holder.as_deref() == Some(agent);
        if live && !mine {
            tx.rollback().await?;
            return Ok(None);
        }
        let new_epoch = if live { epoch } else { epoch + 1 };
        sqlx::query(&self.db.sql(
            "UPDATE publish_leases SET holder = ?, replica = ?, lease_until = ?, \
             lease_epoch = ?, claimed_at = CASE WHEN lease_epoch = ? THEN claimed_at ELSE ? END \
             WHERE local_path = ? AND lease_epoch = ?",
        ))
        .bind(agent)
        .bind(replica)
        .bind(now + timeout_ms)
        .bind(new_epoch)
        .bind(new_epoch)
        .bind(now)
        .bind(local_path)
        .bind(epoch)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        // A lease released (holder NULL) was not interrupted; one that
        // lapsed with a holder was.
        let lapsed = !live && until.is_some();
        Ok(Some(PublishClaim {
            epoch: new_epoch,
            took_over_from: holder.filter(|_| lapsed).map(|h| (h, held_replica)),
        }))
    }

    /// Sink agent `agent` releases its publish lease on `local_path` of
    /// epoch `epoch` (the publish is recorded, or failed). Returns false
    /// if it no longer held it (it lapsed and another agent claimed it).
    ///
    /// # Errors
    /// SQL errors.
    pub async fn release_publish(
        &self,
        local_path: &str,
        agent: &str,
        epoch: i64,
    ) -> Result<bool, CatalogError> {
        let r = sqlx::query(&self.db.sql(
            "UPDATE publish_leases SET holder = NULL, lease_until = NULL \
             WHERE local_path = ? AND holder = ? AND lease_epoch = ?",
        ))
        .bind(local_path)
        .bind(agent)
        .bind(epoch)
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected() > 0)
    }

    /// Who holds a live publish lease on `local_path` now, if anyone.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn publish_holder(
        &self,
        local_path: &str,
    ) -> Result<Option<PublishHolder>, CatalogError> {
        let q = format!(
            "SELECT holder, replica, lease_until - {} AS left_ms FROM publish_leases \
             WHERE local_path = ? AND holder IS NOT NULL",
            self.db.now_ms()
        );
        let row = sqlx::query(&self.db.sql(&q))
            .bind(local_path)
            .fetch_optional(&self.pool)
            .await?;
        let Some(row) = row else { return Ok(None) };
        let left_ms: i64 = row.try_get("left_ms")?;
        if left_ms < 0 {
            return Ok(None);
        }
        Ok(Some(PublishHolder {
            agent: row.try_get("holder")?,
            replica: row.try_get("replica")?,
            left_ms,
        }))
    }
}
