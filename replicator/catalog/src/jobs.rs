//! Source side: the `jobs` table, a training run's model size and
//! importance as the scheduler ranks it.

use sqlx::any::AnyRow;
use sqlx::Row;

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

const JOB_COLS: &str = "name, model_params, importance, origin, updated_at";

fn job_row(r: &AnyRow) -> Result<Job, sqlx::Error> {
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
pub(crate) fn check_job_name(field: &str, name: &str) -> Result<(), CatalogError> {
    ferry_proto::paths::check_name(name).map_err(|e| CatalogError::Invalid(format!("{field}: {e}")))
}

impl Catalog {
    /// Writes the config file's `[[jobs]]` `(name, model_params,
    /// importance)` in one transaction: new jobs are added and config jobs
    /// updated (origin `config`), but a job last set through the API
    /// (origin `api`) keeps its API values across restarts until it is set
    /// again; the config file does not overwrite it. Jobs no longer in the
    /// config file are left as they are. `model_params` of `None` or 0 is
    /// an unknown size; importance is 0..1.
    ///
    /// # Errors
    /// [`CatalogError::Invalid`] naming the job and field (nothing is
    /// written then); SQL errors.
    pub async fn sync_config_jobs(
        &self,
        jobs: &[(String, Option<f64>, f64)],
    ) -> Result<(), CatalogError> {
        let mut rows = Vec::with_capacity(jobs.len());
        for (name, params, importance) in jobs {
            check_job_name("job name", name)?;
            let params = check_params(&format!("job {name:?} model_params"), *params)?;
            let importance = check_unit(&format!("job {name:?} importance"), *importance)?;
            rows.push((name, params, importance));
        }
        let now = now_ms();
        let mut tx = self.pool.begin().await?;
        for (name, params, importance) in rows {
            sqlx::query(&self.db.sql(
                "INSERT INTO jobs (name, model_params, importance, origin, updated_at) \
                 VALUES (?, ?, ?, ?, ?) \
                 ON CONFLICT (name) DO UPDATE SET model_params = excluded.model_params, \
                 importance = excluded.importance, updated_at = excluded.updated_at \
                 WHERE jobs.origin = ?",
            ))
            .bind(name)
            .bind(params)
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
    /// overwrite it, also after a restart. Returns the row as stored.
    ///
    /// # Errors
    /// [`CatalogError::Invalid`] naming the field; SQL errors.
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
        let r = sqlx::query(&self.db.sql(&q))
            .bind(name)
            .bind(params)
            .bind(importance)
            .bind(origin::API)
            .bind(now_ms())
            .fetch_one(&self.pool)
            .await?;
        Ok(job_row(&r)?)
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
