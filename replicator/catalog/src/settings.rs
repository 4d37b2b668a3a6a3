//! The pool's shared settings: the `settings` table (the scheduler's
//! policy and each link's rate cap, one row per setting, its value as
//! JSON), the seeding of jobs from an agent's config, and the
//! PostgreSQL notifications that tell every agent of the pool to read
//! them again (ARCHITECTURE.md, "Pool").
//!
//! On PostgreSQL the catalog's values win over an agent's config: an
//! agent's config seeds a setting (or a job) only when the catalog has
//! none yet ([`Catalog::seed_settings`], [`Catalog::seed_config_jobs`]);
//! later changes come through the API ([`Catalog::put_setting`],
//! [`Catalog::put_job`]). Each change, and each new signal, is announced
//! on the channel [`POOL_CHANNEL`] in the transaction that makes it
//! (`pg_notify`, delivered at commit), so the other agents apply it at
//! once; they also read the table about every second, which covers a
//! notification lost with a listener's connection. A single agent on
//! SQLite writes no setting and announces nothing.

use std::time::Duration;

use sqlx::any::AnyRow;
use sqlx::Row;

use crate::jobs::{check_config_jobs, job_row, Job, JOB_COLS};
use crate::notify::announce;
use crate::{now_ms, origin, Catalog, CatalogError};

pub use crate::notify::{payload, POOL_CHANNEL};

/// Longest setting name accepted, bytes.
pub const MAX_SETTING_NAME: usize = 200;

/// One shared setting as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct Setting {
    /// Its name, e.g. `scheduler.max_active`, `link.to-eval.rate`.
    pub name: String,
    /// Its value (a JSON number, or a string for durations and names).
    pub value: serde_json::Value,
    /// When it was last written (Unix ms).
    pub updated_at: i64,
    /// Who wrote it: `config of AGENT` when seeded from an agent's
    /// config, else the API token's name.
    pub updated_by: String,
}

const SETTING_COLS: &str = "name, value, updated_at, updated_by";

fn setting_row(r: &AnyRow) -> Result<Setting, CatalogError> {
    let name: String = r.try_get("name")?;
    let text: String = r.try_get("value")?;
    let value = serde_json::from_str(&text).map_err(|e| {
        CatalogError::Corrupt(format!("setting {name:?}: value {text:?} is not JSON: {e}"))
    })?;
    Ok(Setting {
        name,
        value,
        updated_at: r.try_get("updated_at")?,
        updated_by: r.try_get("updated_by")?,
    })
}

fn check_setting_name(name: &str) -> Result<(), CatalogError> {
    if name.is_empty()
        || name.len() > MAX_SETTING_NAME
        || name.chars().any(|c| c.is_control() || c.is_whitespace())
    {
        return Err(CatalogError::Invalid(format!(
            "setting name {name:?} must be 1 to {MAX_SETTING_NAME} bytes without spaces or \
             control characters"
        )));
    }
    Ok(())
}

/// The key of the PostgreSQL advisory lock that writes of checked
/// settings take ([`Catalog::put_setting_checked`]): an arbitrary
/// constant of this project.
const SETTINGS_LOCK: i64 = 0x0046_4552_5259_5345; // "FERRYSE"

impl Catalog {
    /// Writes each `(name, value)` that the catalog does not hold yet,
    /// recording `by` (e.g. `config of AGENT`) as its writer, and returns
    /// every stored setting, by name: the values the pool uses, which
    /// for a name stored before are not `values`' (the first agent to
    /// start wins). Announces the change when anything was written.
    ///
    /// # Errors
    /// [`CatalogError::Invalid`] naming a bad name (nothing is written
    /// then); SQL errors.
    pub async fn seed_settings(
        &self,
        values: &[(String, serde_json::Value)],
        by: &str,
    ) -> Result<Vec<Setting>, CatalogError> {
        for (name, _) in values {
            check_setting_name(name)?;
        }
        let now = now_ms();
        let mut tx = self.pool.begin().await?;
        let mut written = 0;
        for (name, value) in values {
            let r = sqlx::query(&self.db.sql(
                "INSERT INTO settings (name, value, updated_at, updated_by) VALUES (?, ?, ?, ?) \
                 ON CONFLICT (name) DO NOTHING",
            ))
            .bind(name.as_str())
            .bind(value.to_string())
            .bind(now)
            .bind(by)
            .execute(&mut *tx)
            .await?;
            written += r.rows_affected();
        }
        if written > 0 {
            announce(self.db, &mut tx, payload::SETTINGS).await?;
        }
        tx.commit().await?;
        self.settings().await
    }

    /// Sets `name` to `value` (written by `by`, the API token's name),
    /// adding it if new, and announces the change. Returns the row as
    /// stored.
    ///
    /// # Errors
    /// [`CatalogError::Invalid`] naming a bad name; SQL errors (nothing
    /// is written then).
    pub async fn put_setting(
        &self,
        name: &str,
        value: &serde_json::Value,
        by: &str,
    ) -> Result<Setting, CatalogError> {
        self.put_setting_checked(name, value, by, |_| Ok(())).await
    }

    /// [`Catalog::put_setting`], written only if `check` accepts every
    /// stored setting with this one changed (by name), all read in the
    /// writing transaction. On PostgreSQL the transaction first takes a
    /// lock every such write takes (`pg_advisory_xact_lock`), so two
    /// agents changing settings at once are checked one after the
    /// other: settings valid alone but not together are never both
    /// written.
    ///
    /// # Errors
    /// [`CatalogError::Invalid`] with `check`'s message, or naming a bad
    /// name; SQL errors (nothing is written then).
    pub async fn put_setting_checked(
        &self,
        name: &str,
        value: &serde_json::Value,
        by: &str,
        check: impl FnOnce(&[Setting]) -> Result<(), String>,
    ) -> Result<Setting, CatalogError> {
        check_setting_name(name)?;
        let mut tx = self.pool.begin().await?;
        if self.db == crate::dialect::Dialect::Postgres {
            sqlx::query("SELECT pg_advisory_xact_lock($1)")
                .bind(SETTINGS_LOCK)
                .execute(&mut *tx)
                .await?;
        }
        let q = format!("SELECT {SETTING_COLS} FROM settings ORDER BY name");
        let rows = sqlx::query(&self.db.sql(&q)).fetch_all(&mut *tx).await?;
        let mut all: Vec<Setting> = rows.iter().map(setting_row).collect::<Result<_, _>>()?;
        let now = now_ms();
        match all.iter_mut().find(|s| s.name == name) {
            Some(s) => s.value = value.clone(),
            None => all.push(Setting {
                name: name.to_string(),
                value: value.clone(),
                updated_at: now,
                updated_by: by.to_string(),
            }),
        }
        if let Err(e) = check(&all) {
            tx.rollback().await?;
            return Err(CatalogError::Invalid(e));
        }
        let q = format!(
            "INSERT INTO settings (name, value, updated_at, updated_by) VALUES (?, ?, ?, ?) \
             ON CONFLICT (name) DO UPDATE SET value = excluded.value, \
             updated_at = excluded.updated_at, updated_by = excluded.updated_by \
             RETURNING {SETTING_COLS}"
        );
        let r = sqlx::query(&self.db.sql(&q))
            .bind(name)
            .bind(value.to_string())
            .bind(now)
            .bind(by)
            .fetch_one(&mut *tx)
            .await?;
        let s = setting_row(&r)?;
        announce(self.db, &mut tx, payload::SETTINGS).await?;
        tx.commit().await?;
        Ok(s)
    }

    /// Every stored setting, by name.
    ///
    /// # Errors
    /// SQL errors; a value that is not JSON ([`CatalogError::Corrupt`]
    /// naming the setting).
    pub async fn settings(&self) -> Result<Vec<Setting>, CatalogError> {
        let q = format!("SELECT {SETTING_COLS} FROM settings ORDER BY name");
        let rows = sqlx::query(&self.db.sql(&q)).fetch_all(&self.pool).await?;
        rows.iter().map(setting_row).collect()
    }

    /// What an agent of a pool reads about every second: every stored
    /// setting (by name) and the signals received at or after `since_ms`
    /// (Unix ms, oldest first), in one read-only transaction (one
    /// transaction a second per agent on the catalog).
    ///
    /// # Errors
    /// SQL errors; a setting whose value is not JSON
    /// ([`CatalogError::Corrupt`] naming it).
    pub async fn shared_state(
        &self,
        since_ms: i64,
    ) -> Result<(Vec<Setting>, Vec<crate::Signal>), CatalogError> {
        let mut tx = self.pool.begin().await?;
        let q = format!("SELECT {SETTING_COLS} FROM settings ORDER BY name");
        let settings = sqlx::query(&self.db.sql(&q))
            .fetch_all(&mut *tx)
            .await?
            .iter()
            .map(setting_row)
            .collect::<Result<Vec<_>, _>>()?;
        let q = format!(
            "SELECT {} FROM signals WHERE received_at >= ? ORDER BY id",
            crate::signals::SIGNAL_COLS
        );
        let signals = sqlx::query(&self.db.sql(&q))
            .bind(since_ms)
            .fetch_all(&mut *tx)
            .await?
            .iter()
            .map(crate::signals::signal_row)
            .collect::<Result<Vec<_>, _>>()?;
        tx.commit().await?;
        Ok((settings, signals))
    }

    /// A pool's `[[jobs]]` `(name, model_params, importance)` from an
    /// agent's config: each job the catalog does not hold yet is added
    /// (origin `config`, recorded as a `job` event); a job it holds keeps
    /// its stored values, whoever wrote them. Returns the stored rows of
    /// the given names, by name: the values the pool ranks by. (A single
    /// agent on SQLite uses [`Catalog::sync_config_jobs`], where its
    /// config file holds over earlier config values.)
    ///
    /// # Errors
    /// [`CatalogError::Invalid`] naming the job and field (nothing is
    /// written then); SQL errors.
    pub async fn seed_config_jobs(
        &self,
        jobs: &[(String, Option<f64>, f64)],
    ) -> Result<Vec<Job>, CatalogError> {
        let rows = check_config_jobs(jobs)?;
        let now = now_ms();
        let mut tx = self.pool.begin().await?;
        let mut written = 0;
        for (name, params, importance) in &rows {
            // The event first, while the row is still absent (one
            // statement that writes, as in `record_job_if_changed`).
            sqlx::query(&self.db.sql(
                "INSERT INTO events (at_ms, kind, job, model_params, importance) \
                 SELECT ?, 'job', ?, ?, ? WHERE NOT EXISTS (SELECT 1 FROM jobs WHERE name = ?)",
            ))
            .bind(now)
            .bind(name.as_str())
            .bind(crate::convert::real(*params))
            .bind(*importance)
            .bind(name.as_str())
            .execute(&mut *tx)
            .await?;
            let r = sqlx::query(&self.db.sql(
                "INSERT INTO jobs (name, model_params, importance, origin, updated_at) \
                 VALUES (?, ?, ?, ?, ?) ON CONFLICT (name) DO NOTHING",
            ))
            .bind(name.as_str())
            .bind(crate::convert::real(*params))
            .bind(*importance)
            .bind(origin::CONFIG)
            .bind(now)
            .execute(&mut *tx)
            .await?;
            written += r.rows_affected();
        }
        if written > 0 {
            announce(self.db, &mut tx, payload::SETTINGS).await?;
        }
        tx.commit().await?;
        let mut out = Vec::with_capacity(rows.len());
        for (name, _, _) in rows {
            let q = format!("SELECT {JOB_COLS} FROM jobs WHERE name = ?");
            let r = sqlx::query(&self.db.sql(&q))
                .bind(name.as_str())
                .fetch_one(&self.pool)
                .await?;
            out.push(job_row(&r)?);
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Listens on [`POOL_CHANNEL`] through a connection of its own
    /// (PostgreSQL; `None` on SQLite, where there is no pool to hear).
    /// Gives up after `timeout` when the server does not answer.
    ///
    /// # Errors
    /// [`CatalogError::Database`] (URL without its password) when the
    /// connection or the `LISTEN` fails.
    pub async fn listen_pool(
        &self,
        timeout: Duration,
    ) -> Result<Option<PoolListener>, CatalogError> {
        let Some(url) = &self.url else {
            return Ok(None);
        };
        let err = |why: String| CatalogError::Database {
            url: url.to_string(),
            why: url.redact(&why),
        };
        let listen = async {
            let mut l = sqlx::postgres::PgListener::connect(&url.secret_named()).await?;
            l.listen(POOL_CHANNEL).await?;
            Ok::<_, sqlx::Error>(l)
        };
        match tokio::time::timeout(timeout, listen).await {
            Ok(Ok(l)) => Ok(Some(PoolListener { inner: l })),
            Ok(Err(e)) => Err(err(format!("LISTEN {POOL_CHANNEL}: {e}"))),
            Err(_) => Err(err(format!(
                "LISTEN {POOL_CHANNEL}: no answer within {timeout:?}"
            ))),
        }
    }
}

/// A connection listening on [`POOL_CHANNEL`] ([`Catalog::listen_pool`]).
pub struct PoolListener {
    inner: sqlx::postgres::PgListener,
}

impl std::fmt::Debug for PoolListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PoolListener")
    }
}

impl PoolListener {
    /// The next notification's payload (see [`payload`]); `None` when
    /// the connection was lost (notifications sent meanwhile are lost:
    /// read the settings again). The next call connects again.
    ///
    /// # Errors
    /// SQL errors (the connection could not be made again).
    pub async fn recv(&mut self) -> Result<Option<String>, CatalogError> {
        Ok(self
            .inner
            .try_recv()
            .await?
            .map(|n| n.payload().to_string()))
    }
}
