//! Source side: the `jobs` table, a training run's model size and
//! importance as the scheduler ranks it.

use sqlx::any::AnyRow;
use sqlx::{AnyConnection, Row};

use crate::{now_ms, Catalog, CatalogError};

/// Where a [`Job`] row came from.
pub mod origin {
    /// The `[[jobs]]` of the config file, rewritten at every start.
    pub const CONFIG: &str = "config";
    /// The API; kept across restarts until set again, whatever the config
    /// file says.
    pub const API: &str = "api";
}

/// A job (training run) as the scheduler ranks it.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    /// Job name.
    pub name: String,
    /// Model size in parameters; `None` = unknown (the size term is 1).
    pub model_params: Option<f64>,
    /// Importance, 0..1.
    pub importance: f64,
    /// Where the values came from: [`origin::CONFIG`] or [`origin::API`].
    pub origin: String,
    /// When the row was last written (Unix ms).
    pub updated_at: i64,
}

pub(crate) const JOB_COLS: &str = "name, model_params, importance, origin, updated_at";

pub(crate) fn job_row(r: &AnyRow) -> Result<Job, sqlx::Error> {
    Ok(Job {
        name: r.try_get("name")?,
        model_params: r.try_get("model_params")?,
        importance: r.try_get("importance")?,
        origin: r.try_get("origin")?,
        updated_at: r.try_get("updated_at")?,
    })
}

/// `v` if it is a number from 0 to 1, else an error naming `field`.
pub(crate) fn check_unit(field: &str, v: f64) -> Result<f64, CatalogError> {
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(CatalogError::Invalid(format!(
            "{field} must be a number from 0 to 1, got {v}"
        )))
    }
}

/// A model size in parameters: `None` and 0 are unknown (`None`); a
/// negative or non-finite size is an error naming `field`.
pub(crate) fn check_params(field: &str, v: Option<f64>) -> Result<Option<f64>, CatalogError> {
    match v {
        None => Ok(None),
        Some(0.0) => Ok(None),
        Some(p) if p.is_finite() && p > 0.0 && p <= MAX_MODEL_PARAMS => Ok(Some(p)),
        Some(p) => Err(CatalogError::Invalid(format!(
            "{field} must be a number of parameters from 0 to {MAX_MODEL_PARAMS:e} (0 = unknown), got {p}"
        ))),
    }
}

/// Largest model size a job may declare, in parameters (1e15, a thousand
/// times today's largest models): the score's size term stays at most
/// `1 + a x 6` (4 with the default `a`), so no job can take the link by
/// declaring an absurd size.
pub const MAX_MODEL_PARAMS: f64 = 1e15;

/// A job name usable in paths, else an error naming `field`.
/// A checked config job: name, model_params (`None`: unknown),
/// importance.
pub(crate) type ConfigJob<'a> = (&'a String, Option<f64>, f64);

/// A config's jobs `(name, model_params, importance)` checked, with
/// `model_params` of 0 read as unknown.
///
/// # Errors
/// [`CatalogError::Invalid`] naming the job and the bad field.
pub(crate) fn check_config_jobs(
    jobs: &[(String, Option<f64>, f64)],
) -> Result<Vec<ConfigJob<'_>>, CatalogError> {
    jobs.iter()
        .map(|(name, params, importance)| {
            check_job_name("job name", name)?;
            let params = check_params(&format!("job {name:?} model_params"), *params)?;
            let importance = check_unit(&format!("job {name:?} importance"), *importance)?;
            Ok((name, params, importance))
        })
        .collect()
}

pub(crate) fn check_job_name(field: &str, name: &str) -> Result<(), CatalogError> {
    ferry_proto::paths::check_name(name).map_err(|e| CatalogError::Invalid(format!("{field}: {e}")))
}

/// Records a `job` event for `name` with the size and importance about to
/// be written on `tx`, unless the stored row has them already or, with
/// `from_config`, is a row set through the API, which the config does not
/// overwrite. True if an event was recorded.
///
/// One statement that writes (an `INSERT ... SELECT ... WHERE NOT
/// EXISTS`), run before the job's own write: a transaction that read the
/// row first and wrote after could be refused by SQLite when another
/// connection wrote in between (a busy snapshot is not retried).
async fn record_job_if_changed(
    c: &Catalog,
    tx: &mut AnyConnection,
    at_ms: i64,
    name: &str,
    params: Option<f64>,
    importance: f64,
    from_config: bool,
) -> Result<bool, sqlx::Error> {
    // NULL never equals NULL in SQL, so an unknown size is its own test.
    let same_params = if params.is_some() {
        "model_params = ?"
    } else {
        "model_params IS NULL"
    };
    let same = format!("importance = ? AND {same_params}");
    let kept = if from_config {
        format!("(origin <> '{}' OR ({same}))", origin::CONFIG)
    } else {
        same
    };
    let q = format!(
        "INSERT INTO events (at_ms, kind, job, model_params, importance) \
         SELECT ?, 'job', ?, ?, ? WHERE NOT EXISTS (SELECT 1 FROM jobs WHERE name = ? AND {kept})"
    );
    let sql = c.db.sql(&q);
    let mut q = sqlx::query(&sql)
        .bind(at_ms)
        .bind(name)
        .bind(crate::convert::real(params))
        .bind(importance)
        .bind(name)
        .bind(importance);
    if let Some(p) = params {
        q = q.bind(p);
    }
    let r = q.execute(&mut *tx).await?;
    Ok(r.rows_affected() > 0)
}

impl Catalog {
    /// Writes the config file's `[[jobs]]` `(name, model_params,
    /// importance)` in one transaction: new jobs are added and config jobs
    /// updated (origin `config`), but a job last set through the API
    /// (origin `api`) keeps its API values across restarts until it is set
    /// again; the config file does not overwrite it. Jobs no longer in the
    /// config file are left as they are. `model_params` of `None` or 0 is
    /// an unknown size; importance is 0..1. A job added, or whose size or
    /// importance changes, is recorded as a `job` event in the same
    /// transaction; one written again with the values it has is not.
    ///
    /// # Errors
    /// [`CatalogError::Invalid`] naming the job and field (nothing is
    /// written then); SQL errors.
    pub async fn sync_config_jobs(
        &self,
        jobs: &[(String, Option<f64>, f64)],
    ) -> Result<(), CatalogError> {
        let rows = check_config_jobs(jobs)?;
        let now = now_ms();
        let mut tx = self.pool.begin().await?;
        for (name, params, importance) in rows {
            record_job_if_changed(self, &mut tx, now, name, params, importance, true).await?;
            sqlx::query(&self.db.sql(
                "INSERT INTO jobs (name, model_params, importance, origin, updated_at) \
                 VALUES (?, ?, ?, ?, ?) \
                 ON CONFLICT (name) DO UPDATE SET model_params = excluded.model_params, \
                 importance = excluded.importance, updated_at = excluded.updated_at \
                 WHERE jobs.origin = ?",
            ))
            .bind(name)
            .bind(crate::convert::real(params))
            .bind(importance)
            .bind(origin::CONFIG)
            .bind(now)
            .bind(origin::CONFIG)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Sets a job's model size (parameters; `None` or 0 = unknown) and
    /// importance (0..1) through the API, adding the job if it is new.
    /// The row's origin becomes `api`: config file values no longer
    /// overwrite it, also after a restart. A new job, or a new size or
    /// importance, is recorded as a `job` event in the same transaction
    /// (the same values again are not), and on PostgreSQL announced to
    /// the pool (`settings` on [`crate::notify::POOL_CHANNEL`]).
    /// Returns the row as stored.
    ///
    /// # Errors
    /// [`CatalogError::Invalid`] naming the field; SQL errors (nothing is
    /// written then).
    pub async fn put_job(
        &self,
        name: &str,
        model_params: Option<f64>,
        importance: f64,
    ) -> Result<Job, CatalogError> {
        check_job_name("job name", name)?;
        let params = check_params("model_params", model_params)?;
        let importance = check_unit("importance", importance)?;
        let q = format!(
            "INSERT INTO jobs (name, model_params, importance, origin, updated_at) \
             VALUES (?, ?, ?, ?, ?) \
             ON CONFLICT (name) DO UPDATE SET model_params = excluded.model_params, \
             importance = excluded.importance, origin = excluded.origin, \
             updated_at = excluded.updated_at RETURNING {JOB_COLS}"
        );
        let now = now_ms();
        let mut tx = self.pool.begin().await?;
        record_job_if_changed(self, &mut tx, now, name, params, importance, false).await?;
        let r = sqlx::query(&self.db.sql(&q))
            .bind(name)
            .bind(crate::convert::real(params))
            .bind(importance)
            .bind(origin::API)
            .bind(now)
            .fetch_one(&mut *tx)
            .await?;
        let job = job_row(&r)?;
        crate::notify::announce(self.db, &mut tx, crate::notify::payload::SETTINGS).await?;
        tx.commit().await?;
        Ok(job)
    }

    /// One job by name.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn job(&self, name: &str) -> Result<Option<Job>, CatalogError> {
        let q = format!("SELECT {JOB_COLS} FROM jobs WHERE name = ?");
        let r = sqlx::query(&self.db.sql(&q))
            .bind(name)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(job_row).transpose()?)
    }

    /// Every job, by name.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn jobs(&self) -> Result<Vec<Job>, CatalogError> {
        let q = format!("SELECT {JOB_COLS} FROM jobs ORDER BY name");
        let rows = sqlx::query(&self.db.sql(&q)).fetch_all(&self.pool).await?;
        Ok(rows.iter().map(job_row).collect::<Result<_, _>>()?)
    }
}
