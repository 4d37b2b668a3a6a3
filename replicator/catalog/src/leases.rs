//! Sink side: reader leases (the `leases` table, migration 13). A lease
//! keeps one published version of a replica (its directory under
//! `<sink root>/.ferry/versions/`) until it expires or is released, so a
//! reader that resolved a path keeps reading the bytes it resolved even
//! when a re-save publishes a newer version.
//!
//! The latest expiry of a replica's live leases is also kept on its row
//! (`replicas.leased_until`): granting a lease, starting a removal
//! ([`Catalog::begin_replica_removal`]) and deleting a replaced version
//! ([`Catalog::claim_replaced_version`]) each update that one row under a
//! condition on it, so the database decides them one after the other.

use rand::RngCore;
use sqlx::any::AnyRow;
use sqlx::Row;

use crate::{now_ms, Catalog, CatalogError};

/// A reader lease on one version of a replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReaderLease {
    /// 32 hex digits (128 random bits).
    pub id: String,
    /// The replica row (version) it holds.
    pub replica: i64,
    /// The API token's name that took it.
    pub holder: String,
    /// When it was granted (Unix ms).
    pub created_at: i64,
    /// How long each renewal extends it from the renewal (ms).
    pub duration_ms: i64,
    /// When it expires unless renewed (Unix ms).
    pub expires_at: i64,
    /// When it was released (Unix ms), if it was.
    pub released_at: Option<i64>,
}

impl ReaderLease {
    /// Whether it holds its version at `now` (Unix ms): not released and
    /// not expired.
    pub fn live_at(&self, now: i64) -> bool {
        self.released_at.is_none() && self.expires_at > now
    }
}

/// Why a lease could not be renewed or released.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseProblem {
    /// No lease has this id (or it was forgotten a day after it ended).
    Unknown,
    /// It expired at this time (Unix ms): its version may be gone.
    Expired(i64),
    /// It was released at this time (Unix ms).
    Released(i64),
    /// Its version is gone (removed by hand with force, say): it holds
    /// nothing although it has not expired.
    VersionGone(i64),
}

/// How long a lease that ended is remembered (renewing it then says it
/// expired rather than that it is unknown): one day, in ms.
pub const LEASE_MEMORY_MS: i64 = 24 * 3600 * 1000;

const LEASE_COLS: &str = "id, replica, holder, created_at, duration_ms, expires_at, released_at";

fn lease_row(r: &AnyRow) -> Result<ReaderLease, sqlx::Error> {
    Ok(ReaderLease {
        id: r.try_get("id")?,
        replica: r.try_get("replica")?,
        holder: r.try_get("holder")?,
        created_at: r.try_get("created_at")?,
        duration_ms: r.try_get("duration_ms")?,
        expires_at: r.try_get("expires_at")?,
        released_at: r.try_get("released_at")?,
    })
}

/// A new lease id: 128 random bits in hex.
fn new_lease_id() -> String {
    let mut b = [0u8; 16];
    rand::thread_rng().fill_bytes(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl Catalog {
    /// Lease `id` read in `tx`: `Err` when there is none or it was
    /// released.
    async fn open_lease(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Any>,
        id: &str,
    ) -> Result<Result<ReaderLease, LeaseProblem>, CatalogError> {
        let q = format!("SELECT {LEASE_COLS} FROM leases WHERE id = ?");
        let Some(lease) = sqlx::query(&self.db.sql(&q))
            .bind(id)
            .fetch_optional(&mut **tx)
            .await?
            .as_ref()
            .map(lease_row)
            .transpose()?
        else {
            return Ok(Err(LeaseProblem::Unknown));
        };
        Ok(match lease.released_at {
            Some(at) => Err(LeaseProblem::Released(at)),
            None => Ok(lease),
        })
    }

    /// Grants `holder` a lease of `duration_ms` on replica `replica`:
    /// `None` (nothing written) when the row is not `published`, or its
    /// version's directory was deleted after a re-save replaced it.
    ///
    /// # Errors
    /// SQL errors (nothing is written then).
    pub async fn grant_lease(
        &self,
        replica: i64,
        holder: &str,
        duration_ms: i64,
    ) -> Result<Option<ReaderLease>, CatalogError> {
        let now = now_ms();
        let expires = now.saturating_add(duration_ms.max(1));
        let mut tx = self.pool.begin().await?;
        let r = sqlx::query(&self.db.sql(
            "UPDATE replicas SET leased_until = CASE WHEN leased_until IS NULL \
             OR leased_until < ? THEN ? ELSE leased_until END \
             WHERE id = ? AND state = 'published' AND version_deleted_at IS NULL",
        ))
        .bind(expires)
        .bind(expires)
        .bind(replica)
        .execute(&mut *tx)
        .await?;
        if r.rows_affected() != 1 {
            tx.rollback().await?;
            return Ok(None);
        }
        let lease = ReaderLease {
            id: new_lease_id(),
            replica,
            holder: holder.to_string(),
            created_at: now,
            duration_ms: duration_ms.max(1),
            expires_at: expires,
            released_at: None,
        };
        sqlx::query(&self.db.sql(&format!(
            "INSERT INTO leases ({LEASE_COLS}) VALUES (?, ?, ?, ?, ?, ?, NULL)"
        )))
        .bind(&lease.id)
        .bind(lease.replica)
        .bind(&lease.holder)
        .bind(lease.created_at)
        .bind(lease.duration_ms)
        .bind(lease.expires_at)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Some(lease))
    }

    /// The lease `id`, live or not (ended leases are forgotten
    /// [`LEASE_MEMORY_MS`] after they end).
    ///
    /// # Errors
    /// SQL errors.
    pub async fn lease(&self, id: &str) -> Result<Option<ReaderLease>, CatalogError> {
        let q = format!("SELECT {LEASE_COLS} FROM leases WHERE id = ?");
        let r = sqlx::query(&self.db.sql(&q))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(lease_row).transpose()?)
    }

    /// Extends live lease `id` to its duration from now.
    ///
    /// # Errors
    /// SQL errors; `Ok(Err(_))` says why a lease cannot be renewed
    /// (nothing is written then).
    pub async fn renew_lease(
        &self,
        id: &str,
    ) -> Result<Result<ReaderLease, LeaseProblem>, CatalogError> {
        let now = now_ms();
        let mut tx = self.pool.begin().await?;
        let mut lease = match self.open_lease(&mut tx, id).await? {
            Ok(l) => l,
            Err(p) => {
                tx.rollback().await?;
                return Ok(Err(p));
            }
        };
        let expires = now.saturating_add(lease.duration_ms);
        // Only while the row still counts it as live: once its expiry has
        // passed on the row, its version may be deleted already.
        let r = sqlx::query(&self.db.sql(
            "UPDATE replicas SET leased_until = CASE WHEN leased_until < ? THEN ? \
             ELSE leased_until END WHERE id = ? AND leased_until > ? AND state = 'published'",
        ))
        .bind(expires)
        .bind(expires)
        .bind(lease.replica)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        if lease.expires_at <= now {
            tx.rollback().await?;
            return Ok(Err(LeaseProblem::Expired(lease.expires_at)));
        }
        if r.rows_affected() != 1 {
            tx.rollback().await?;
            return Ok(Err(LeaseProblem::VersionGone(lease.replica)));
        }
        sqlx::query(&self.db.sql("UPDATE leases SET expires_at = ? WHERE id = ?"))
            .bind(expires)
            .bind(id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        lease.expires_at = expires;
        Ok(Ok(lease))
    }

    /// Releases lease `id`: its version is no longer held by it (other
    /// live leases on the version still hold it).
    ///
    /// # Errors
    /// SQL errors; `Ok(Err(_))` when there is no live lease `id` (nothing
    /// is written then).
    pub async fn release_lease(
        &self,
        id: &str,
    ) -> Result<Result<ReaderLease, LeaseProblem>, CatalogError> {
        let now = now_ms();
        let mut tx = self.pool.begin().await?;
        let mut lease = match self.open_lease(&mut tx, id).await? {
            Ok(l) => l,
            Err(p) => {
                tx.rollback().await?;
                return Ok(Err(p));
            }
        };
        if lease.expires_at <= now {
            tx.rollback().await?;
            return Ok(Err(LeaseProblem::Expired(lease.expires_at)));
        }
        // Lock the row first, so that a lease granted on it meanwhile is
        // seen by the maximum taken below (a later statement on
        // PostgreSQL reads what committed before it).
        sqlx::query(
            &self
                .db
                .sql("UPDATE replicas SET leased_until = leased_until WHERE id = ?"),
        )
        .bind(lease.replica)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            &self
                .db
                .sql("UPDATE leases SET released_at = ? WHERE id = ?"),
        )
        .bind(now)
        .bind(id)
        .execute(&mut *tx)
        .await?;
        sqlx::query(&self.db.sql(
            "UPDATE replicas SET leased_until = (SELECT MAX(expires_at) FROM leases \
             WHERE replica = ? AND released_at IS NULL) WHERE id = ?",
        ))
        .bind(lease.replica)
        .bind(lease.replica)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        lease.released_at = Some(now);
        Ok(Ok(lease))
    }

    /// Leases live at `now` (Unix ms), oldest first.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn live_leases(&self, now: i64) -> Result<Vec<ReaderLease>, CatalogError> {
        // A lease on a version removed by hand (force) holds nothing.
        let cols = LEASE_COLS
            .split(", ")
            .map(|c| format!("l.{c}"))
            .collect::<Vec<_>>()
            .join(", ");
        let q = format!(
            "SELECT {cols} FROM leases l JOIN replicas r ON r.id = l.replica \
             WHERE l.released_at IS NULL AND l.expires_at > ? AND r.state = 'published' \
             AND r.version_deleted_at IS NULL ORDER BY l.created_at, l.id"
        );
        let rows = sqlx::query(&self.db.sql(&q))
            .bind(now)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(lease_row).collect::<Result<_, _>>()?)
    }

    /// Forgets leases that ended more than [`LEASE_MEMORY_MS`] before
    /// `now`; returns how many.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn forget_ended_leases(&self, now: i64) -> Result<u64, CatalogError> {
        let before = now.saturating_sub(LEASE_MEMORY_MS);
        let r = sqlx::query(&self.db.sql(
            "DELETE FROM leases WHERE expires_at < ? OR (released_at IS NOT NULL AND released_at < ?)",
        ))
        .bind(before)
        .bind(before)
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected())
    }

    /// Replicas a lease holds at `now` (Unix ms), for metrics.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn leased_replica_count(&self, now: i64) -> Result<i64, CatalogError> {
        let r = sqlx::query(&self.db.sql(
            "SELECT COUNT(*) AS n FROM replicas WHERE leased_until > ? \
             AND state = 'published' AND version_deleted_at IS NULL",
        ))
        .bind(now)
        .fetch_one(&self.pool)
        .await?;
        Ok(r.try_get("n")?)
    }

    /// Ends every lease on `replica` now (an operator frees a replaced
    /// version a lease holds); returns how many. Its row is then no longer
    /// leased.
    ///
    /// # Errors
    /// SQL errors (nothing is written then).
    pub async fn end_leases_of(&self, replica: i64) -> Result<u64, CatalogError> {
        let now = now_ms();
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            &self
                .db
                .sql("UPDATE replicas SET leased_until = NULL WHERE id = ?"),
        )
        .bind(replica)
        .execute(&mut *tx)
        .await?;
        let r = sqlx::query(&self.db.sql(
            "UPDATE leases SET released_at = ? WHERE replica = ? AND released_at IS NULL \
             AND expires_at > ?",
        ))
        .bind(now)
        .bind(replica)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(r.rows_affected())
    }

    /// Claims the directory of version `replica`, which a re-save
    /// replaced (or whose transfer failed after its files were moved into
    /// place), for deletion: true, and no lease is granted on it after,
    /// unless a live lease holds it.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn claim_replaced_version(&self, replica: i64) -> Result<bool, CatalogError> {
        let now = now_ms();
        let r = sqlx::query(&self.db.sql(
            "UPDATE replicas SET version_deleted_at = ? WHERE id = ? \
             AND version_deleted_at IS NULL AND (leased_until IS NULL OR leased_until <= ?)",
        ))
        .bind(now)
        .bind(replica)
        .bind(now)
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected() == 1)
    }
}
