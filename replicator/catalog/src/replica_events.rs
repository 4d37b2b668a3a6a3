//! Sink side: the `replica_events` table, the log of publish events
//! (ARCHITECTURE.md, "Publish events"). A row is written in the
//! transaction of the change it announces: a publish
//! ([`crate::replicas::publish_in`], which also writes `replaced` for the
//! version the publish replaces) and the end of a removal
//! ([`Catalog::finish_replica_removal`]). Rows older than
//! [`REPLICA_EVENT_DAYS`] days are deleted ([`Catalog::prune_replica_events`]).
//! With a PostgreSQL catalog every sink agent of a pool reads every
//! agent's events.

use sqlx::any::AnyRow;
use sqlx::Row;

use crate::{now_ms, Catalog, CatalogError};

/// How long publish events are kept, days.
pub const REPLICA_EVENT_DAYS: i64 = 7;

/// One publish event.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ReplicaEvent {
    /// The event's id (increasing; clients resume after it).
    pub id: i64,
    /// When it happened, Unix ms.
    pub at_ms: i64,
    /// `published`, `replaced` or `removed`.
    pub kind: String,
    /// The replica (catalog id).
    pub replica: i64,
    /// Job.
    pub job: String,
    /// Checkpoint path relative to its source root.
    pub rel: String,
    /// Checkpoint path at the source.
    pub source_path: String,
    /// Training step, if known.
    pub step: Option<i64>,
    /// Replication profile (`full` or `weights-only`).
    pub profile: String,
    /// Where the replica is: a local path or an hdfs:// or s3:// URL.
    pub location: String,
    /// For `replaced`: the replica that replaced it.
    pub replaced_by: Option<i64>,
}

fn event_row(r: &AnyRow) -> Result<ReplicaEvent, sqlx::Error> {
    Ok(ReplicaEvent {
        id: r.try_get("id")?,
        at_ms: r.try_get("at_ms")?,
        kind: r.try_get("kind")?,
        replica: r.try_get("replica")?,
        job: r.try_get("job")?,
        rel: r.try_get("rel")?,
        source_path: r.try_get("source_path")?,
        step: r.try_get("step")?,
        profile: r.try_get("profile")?,
        location: r.try_get("location")?,
        replaced_by: r.try_get("replaced_by")?,
    })
}

/// Writes the `published` event of replica `id` and the `replaced` event
/// of the version it replaces at the same local path, if any, on `conn`
/// (inside the publish's transaction).
pub(crate) async fn record_publish(
    db: crate::dialect::Dialect,
    conn: &mut sqlx::AnyConnection,
    id: i64,
    now: i64,
) -> Result<(), CatalogError> {
    sqlx::query(&db.sql(
        "INSERT INTO replica_events (at_ms, kind, replica, job, rel, source_path, step, profile, \
         location) SELECT ?, 'published', id, job, rel, source_path, step, COALESCE(profile, 'full'), local_path \
         FROM replicas WHERE id = ?",
    ))
    .bind(now)
    .bind(id)
    .execute(&mut *conn)
    .await?;
    // The newest older version still published at that path.
    sqlx::query(&db.sql(
        "INSERT INTO replica_events (at_ms, kind, replica, job, rel, source_path, step, profile, \
         location, replaced_by) SELECT ?, 'replaced', o.id, o.job, o.rel, o.source_path, o.step, \
         COALESCE(o.profile, 'full'), o.local_path, ? FROM replicas o WHERE o.state = 'published' AND o.id < ? \
         AND o.local_path = (SELECT local_path FROM replicas WHERE id = ?) \
         ORDER BY o.id DESC LIMIT 1",
    ))
    .bind(now)
    .bind(id)
    .bind(id)
    .bind(id)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Writes the `removed` event of replica `id` on `conn`.
pub(crate) async fn record_removed(
    db: crate::dialect::Dialect,
    conn: &mut sqlx::AnyConnection,
    id: i64,
    now: i64,
) -> Result<(), CatalogError> {
    sqlx::query(&db.sql(
        "INSERT INTO replica_events (at_ms, kind, replica, job, rel, source_path, step, profile, \
         location) SELECT ?, 'removed', id, job, rel, source_path, step, COALESCE(profile, 'full'), local_path \
         FROM replicas WHERE id = ?",
    ))
    .bind(now)
    .bind(id)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

impl Catalog {
    /// Publish events with an id above `after`, oldest first, at most
    /// `limit`.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn replica_events_after(
        &self,
        after: i64,
        limit: i64,
    ) -> Result<Vec<ReplicaEvent>, CatalogError> {
        let rows = sqlx::query(&self.db.sql(
            "SELECT id, at_ms, kind, replica, job, rel, source_path, step, profile, location, \
             replaced_by FROM replica_events WHERE id > ? ORDER BY id LIMIT ?",
        ))
        .bind(after)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(event_row).collect::<Result<_, _>>()?)
    }

    /// The newest publish event's id (0: none).
    ///
    /// # Errors
    /// SQL errors.
    pub async fn last_replica_event(&self) -> Result<i64, CatalogError> {
        let r = sqlx::query(
            &self
                .db
                .sql("SELECT COALESCE(MAX(id), 0) AS n FROM replica_events"),
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(r.try_get("n")?)
    }

    /// Deletes publish events older than [`REPLICA_EVENT_DAYS`] days;
    /// returns how many.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn prune_replica_events(&self) -> Result<u64, CatalogError> {
        let before = now_ms() - REPLICA_EVENT_DAYS * 86_400_000;
        let r = sqlx::query(&self.db.sql("DELETE FROM replica_events WHERE at_ms < ?"))
            .bind(before)
            .execute(&self.pool)
            .await?;
        Ok(r.rows_affected())
    }

    /// Where webhook `url` has delivered up to (an event id; `None`: it
    /// never delivered).
    ///
    /// # Errors
    /// SQL errors.
    pub async fn webhook_position(&self, url: &str) -> Result<Option<i64>, CatalogError> {
        let r = sqlx::query(
            &self
                .db
                .sql("SELECT last_event FROM webhook_positions WHERE url = ?"),
        )
        .bind(url)
        .fetch_optional(&self.pool)
        .await?;
        Ok(r.map(|r| r.try_get("last_event")).transpose()?)
    }

    /// Records that webhook `url` delivered every event up to `id`.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn set_webhook_position(&self, url: &str, id: i64) -> Result<(), CatalogError> {
        sqlx::query(&self.db.sql(
            "INSERT INTO webhook_positions (url, last_event) VALUES (?, ?) \
             ON CONFLICT (url) DO UPDATE SET last_event = excluded.last_event",
        ))
        .bind(url)
        .bind(id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }
}
