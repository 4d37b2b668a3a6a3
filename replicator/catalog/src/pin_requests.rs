//! Sink side: pins a source asked for because of an anomaly signal (the
//! `pin_requests` table, migration 13; wire protocol version 6). A request
//! names a replica of a job from a source site by what it is to the
//! signal (the newest, the one of a step, the first at or after a step);
//! the sink pins that replica once it is present, until the request's
//! end.

use ferry_proto::wire::PinTarget;
use sqlx::any::AnyRow;
use sqlx::Row;

use crate::{now_ms, Catalog, CatalogError};

/// A pin a source asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PinRequestRow {
    /// Row id.
    pub id: i64,
    /// The source site that asked.
    pub source_site: String,
    /// The job.
    pub job: String,
    /// Which replica.
    pub target: PinTarget,
    /// Why (the signal, and which checkpoint this is to it).
    pub reason: String,
    /// When it arrived (Unix ms).
    pub created_at: i64,
    /// Until when the pin lasts (Unix ms).
    pub until: i64,
    /// The replica it pinned, once it did.
    pub applied_to: Option<i64>,
}

const COLS: &str = "id, source_site, job, target, step, reason, created_at, until, applied_to";

fn row(r: &AnyRow) -> Result<PinRequestRow, sqlx::Error> {
    let step: Option<i64> = r.try_get("step")?;
    let step = step.map_or(0, |s| s.max(0) as u64);
    let kind: String = r.try_get("target")?;
    let target = match kind.as_str() {
        "newest" => PinTarget::Newest,
        "step" => PinTarget::Step(step),
        "at_or_after" => PinTarget::AtOrAfter(step),
        other => {
            return Err(sqlx::Error::Decode(
                format!("pin_requests.target: unknown target {other:?}").into(),
            ))
        }
    };
    Ok(PinRequestRow {
        id: r.try_get("id")?,
        source_site: r.try_get("source_site")?,
        job: r.try_get("job")?,
        target,
        reason: r.try_get("reason")?,
        created_at: r.try_get("created_at")?,
        until: r.try_get("until")?,
        applied_to: r.try_get("applied_to")?,
    })
}

impl Catalog {
    /// Records a pin request from `source_site` lasting until `until`
    /// (Unix ms); returns its id.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn record_pin_request(
        &self,
        source_site: &str,
        job: &str,
        target: PinTarget,
        reason: &str,
        until: i64,
    ) -> Result<i64, CatalogError> {
        let (kind, step) = match target {
            PinTarget::Newest => ("newest", None),
            PinTarget::Step(s) => ("step", Some(i64::try_from(s).unwrap_or(i64::MAX))),
            PinTarget::AtOrAfter(s) => ("at_or_after", Some(i64::try_from(s).unwrap_or(i64::MAX))),
        };
        let id: i64 = sqlx::query_scalar(&self.db.sql(
            "INSERT INTO pin_requests (source_site, job, target, step, reason, created_at, until) \
             VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING id",
        ))
        .bind(source_site)
        .bind(job)
        .bind(kind)
        .bind(step)
        .bind(reason)
        .bind(now_ms())
        .bind(until)
        .fetch_one(&self.pool)
        .await?;
        Ok(id)
    }

    /// Pin requests not yet applied and not ended at `now` (Unix ms),
    /// oldest first.
    ///
    /// # Errors
    /// SQL errors; a stored target this version does not know.
    pub async fn pending_pin_requests(&self, now: i64) -> Result<Vec<PinRequestRow>, CatalogError> {
        let q = format!(
            "SELECT {COLS} FROM pin_requests WHERE applied_to IS NULL AND until > ? ORDER BY id"
        );
        let rows = sqlx::query(&self.db.sql(&q))
            .bind(now)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(row).collect::<Result<_, _>>()?)
    }

    /// Applies pin request `request` to published replica `replica`: the
    /// replica is pinned until `until` for `reason` unless a pin that
    /// lasts as long already holds it (an operator's pin is never
    /// shortened), and the request is marked applied. True if the replica
    /// is pinned by it now.
    ///
    /// # Errors
    /// SQL errors (nothing is written then).
    pub async fn apply_pin_request(
        &self,
        request: i64,
        replica: i64,
        until: i64,
        reason: &str,
    ) -> Result<bool, CatalogError> {
        let mut tx = self.pool.begin().await?;
        let r = sqlx::query(&self.db.sql(
            "UPDATE replicas SET pinned_at = ?, pinned_until = ?, pin_reason = ? \
             WHERE id = ? AND state = 'published' \
             AND (pinned_at IS NULL OR (pinned_until IS NOT NULL AND pinned_until < ?))",
        ))
        .bind(now_ms())
        .bind(until)
        .bind(reason)
        .bind(replica)
        .bind(until)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            &self
                .db
                .sql("UPDATE pin_requests SET applied_to = ? WHERE id = ? AND applied_to IS NULL"),
        )
        .bind(replica)
        .bind(request)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(r.rows_affected() == 1)
    }
}
