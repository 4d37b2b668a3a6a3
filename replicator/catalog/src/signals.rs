//! Source side: the `signals` table, anomaly reports from training
//! controllers.

use ferry_proto::state::TransferId;
use sqlx::any::AnyRow;
use sqlx::Row;

use crate::convert::transfer_id_opt;
use crate::events::{self, Change};
use crate::jobs::{check_job_name, check_unit};
use crate::{now_ms, Catalog, CatalogError};

/// An anomaly report from a training controller.
#[derive(Debug, Clone, PartialEq)]
pub struct Signal {
    /// Signal id.
    pub id: i64,
    /// Job it is about.
    pub job: String,
    /// What was seen (loss spike, NaN, ...; the API defines the names).
    pub kind: String,
    /// Severity when received, 0..1 (it decays with the configured
    /// half-life).
    pub severity: f64,
    /// Training step the controller reported, if any.
    pub step: Option<i64>,
    /// The client's retry key, if it sent one.
    pub idempotency_key: Option<String>,
    /// The transfer it promoted to `urgent` ([`Transfer::id`]), if any.
    pub transfer: Option<TransferId>,
    /// When it was received (Unix ms).
    pub received_at: i64,
}

pub(crate) const SIGNAL_COLS: &str =
    "id, job, kind, severity, step, idempotency_key, transfer, received_at";

pub(crate) fn signal_row(r: &AnyRow) -> Result<Signal, sqlx::Error> {
    Ok(Signal {
        id: r.try_get("id")?,
        job: r.try_get("job")?,
        kind: r.try_get("kind")?,
        severity: r.try_get("severity")?,
        step: r.try_get("step")?,
        idempotency_key: r.try_get("idempotency_key")?,
        transfer: transfer_id_opt(r, "transfer")?,
        received_at: r.try_get("received_at")?,
    })
}

impl Catalog {
    /// Records a signal about `job` (severity 0..1, received now). With an
    /// idempotency `key` already used, nothing is inserted and the signal
    /// first stored under that key is returned, whatever its job, kind or
    /// severity. The flag is true if the signal is new; a new signal is
    /// recorded as a `signal` event (job, kind, severity) in the same
    /// transaction, a repeated one is not. On PostgreSQL a new signal is
    /// announced to the pool (`signal` on
    /// [`crate::notify::POOL_CHANNEL`]), so every agent counts it.
    ///
    /// # Errors
    /// [`CatalogError::Invalid`] naming the field (job name, severity);
    /// SQL errors (nothing is written then).
    pub async fn insert_signal(
        &self,
        job: &str,
        kind: &str,
        severity: f64,
        step: Option<i64>,
        key: Option<&str>,
    ) -> Result<(Signal, bool), CatalogError> {
        check_job_name("job", job)?;
        if kind.is_empty() {
            return Err(CatalogError::Invalid("kind must not be empty".into()));
        }
        let severity = check_unit("severity", severity)?;
        let q = format!(
            "INSERT INTO signals (job, kind, severity, step, idempotency_key, received_at) \
             VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (idempotency_key) DO NOTHING \
             RETURNING {SIGNAL_COLS}"
        );
        let now = now_ms();
        let mut tx = self.pool.begin().await?;
        let r = sqlx::query(&self.db.sql(&q))
            .bind(job)
            .bind(kind)
            .bind(severity)
            .bind(step)
            .bind(key)
            .bind(now)
            .fetch_optional(&mut *tx)
            .await?;
        if let Some(r) = r {
            let sig = signal_row(&r)?;
            let change = Change::Signal {
                job: sig.job.clone(),
                kind: sig.kind.clone(),
                severity: sig.severity,
            };
            events::record(self.db, &mut tx, now, &change).await?;
            // The pool's other agents raise the job's score too.
            crate::notify::announce(self.db, &mut tx, crate::notify::payload::SIGNAL).await?;
            tx.commit().await?;
            return Ok((sig, true));
        }
        tx.commit().await?;
        // Only a used key makes the insert do nothing.
        let q = format!("SELECT {SIGNAL_COLS} FROM signals WHERE idempotency_key = ?");
        let r = sqlx::query(&self.db.sql(&q))
            .bind(key)
            .fetch_optional(&self.pool)
            .await?
            .ok_or_else(|| {
                CatalogError::Corrupt(format!(
                    "signal with idempotency key {key:?} was neither inserted nor found"
                ))
            })?;
        Ok((signal_row(&r)?, false))
    }

    /// Records the transfer a signal promoted.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn set_signal_transfer(
        &self,
        signal_id: i64,
        transfer_id: TransferId,
    ) -> Result<(), CatalogError> {
        sqlx::query(&self.db.sql("UPDATE signals SET transfer = ? WHERE id = ?"))
            .bind(transfer_id.as_i64())
            .bind(signal_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Signals received at or after `since_ms` (Unix ms), oldest first (by
    /// id): the ones whose decayed severity still counts.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn signals_since(&self, since_ms: i64) -> Result<Vec<Signal>, CatalogError> {
        let q = format!("SELECT {SIGNAL_COLS} FROM signals WHERE received_at >= ? ORDER BY id");
        let rows = sqlx::query(&self.db.sql(&q))
            .bind(since_ms)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(signal_row).collect::<Result<_, _>>()?)
    }

    /// The `limit` newest signals, newest first (a negative limit is 0).
    ///
    /// # Errors
    /// SQL errors.
    pub async fn recent_signals(&self, limit: i64) -> Result<Vec<Signal>, CatalogError> {
        self.signals_page(limit, 0).await
    }

    /// Signals, newest first: `limit` of them after skipping `offset`.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn signals_page(&self, limit: i64, offset: i64) -> Result<Vec<Signal>, CatalogError> {
        let q = format!("SELECT {SIGNAL_COLS} FROM signals ORDER BY id DESC LIMIT ? OFFSET ?");
        let rows = sqlx::query(&self.db.sql(&q))
            .bind(limit.max(0))
            .bind(offset.max(0))
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(signal_row).collect::<Result<_, _>>()?)
    }
}
