//! The catalog: Ferry's durable state in SQL (sqlx; SQLite in the data
//! directory by default, WAL mode). Schema: `migrations/`.
//!
//! Source side: `transfers`. Sink side: `replicas` (one row per incoming
//! transfer; published rows are replicas) and `chunks` (verified chunks in
//! staging, the resume point after a crash).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ferry_proto::manifest::FileInfo;
use ferry_proto::manifest::Hash;
use ferry_proto::state::{CheckpointState, Profile, TransferId, TransferState};
use nix::fcntl::{Flock, FlockArg};
use scheduler::Class;
use serde::Serialize;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Row, SqlitePool};

/// Catalog failures.
#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    /// The data directory could not be created or locked.
    #[error("data directory {path}: {why}")]
    DataDir {
        /// The directory.
        path: PathBuf,
        /// What went wrong.
        why: String,
    },
    /// The catalog file cannot be opened, is damaged or cannot be
    /// migrated; the message names the file. It is left as it is.
    #[error("catalog {path}: {why}")]
    File {
        /// The catalog file (`data_dir/ferry.db`).
        path: PathBuf,
        /// What went wrong and what to do.
        why: String,
    },
    /// An SQL error.
    #[error("catalog: {0}")]
    Sql(#[from] sqlx::Error),
    /// Migrations failed (a newer or damaged catalog).
    #[error("catalog migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// Stored data could not be decoded.
    #[error("catalog holds bad data: {0}")]
    Corrupt(String),
    /// A value to store is out of range; the message names the field.
    #[error("{0}")]
    Invalid(String),
}

/// Milliseconds since the Unix epoch, the catalog's time unit.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_millis() as i64
}

/// A source-side transfer row.
#[derive(Debug, Clone, Serialize, PartialEq, utoipa::ToSchema)]
pub struct Transfer {
    /// Transfer id (also sent to the sink).
    #[schema(value_type = i64)]
    pub id: TransferId,
    /// Link name.
    pub link: String,
    /// Job name.
    pub job: String,
    /// Absolute checkpoint path at the source.
    pub source_path: String,
    /// Path relative to the source root.
    pub rel: String,
    /// Scheduler class: the class set by hand or by the config, which a
    /// promoted transfer returns to (see [`Transfer::urgent_until`]).
    pub class: Class,
    /// Transfer state.
    pub state: TransferState,
    /// Bytes in the checkpoint; while it is written (checkpoint `announced`
    /// or `open`), the announced size or the bytes known so far.
    pub bytes_total: i64,
    /// Bytes at the sink as far as the source knows: what the sink had
    /// when the latest run began plus what that run sent (an estimate
    /// until published, when it is `bytes_total`). It never decreases,
    /// also across pause, resume, reconnect and restart.
    pub bytes_done: i64,
    /// Payload bytes put on the wire over all runs (resends included).
    pub bytes_sent: i64,
    /// Number of shards.
    pub shards: i64,
    /// Hex BLAKE3 manifest root once sealed.
    pub manifest_root: Option<String>,
    /// Path of the replica at the sink once published.
    pub local_path: Option<String>,
    /// Last error, if failed.
    pub error: Option<String>,
    /// Creation time (Unix ms).
    pub created_at: i64,
    /// When the transfer first became active (Unix ms).
    pub started_at: Option<i64>,
    /// When it reached a final state (Unix ms).
    pub finished_at: Option<i64>,
    /// The checkpoint's state at the source.
    pub checkpoint: CheckpointState,
    /// Format that recognised the checkpoint, if the watcher found it.
    pub format: Option<String>,
    /// When the checkpoint opened (Unix ms), if known.
    pub opened_at: Option<i64>,
    /// When the checkpoint was committed (Unix ms), if it is.
    pub committed_at: Option<i64>,
    /// Commit identity the watcher saw (marker size and mtime or the
    /// like); a new one in the same directory is a re-save.
    pub commit_identity: Option<String>,
    /// Replication profile.
    pub profile: Profile,
    /// Importance override for this transfer, 0..1; `None` = the job's
    /// importance.
    pub importance: Option<f64>,
    /// While now (Unix ms) is before this, the transfer is `urgent`
    /// because a signal promoted it; [`Transfer::class`] is the class it
    /// returns to. `None` = not promoted.
    pub urgent_until: Option<i64>,
    /// Id of the signal that promoted it ([`Signal::id`]), if any.
    pub signal: Option<i64>,
}

/// How far a transfer got, for [`Catalog::note_transfer_progress`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProgressNote {
    /// Bytes in the checkpoint, or known so far while it is written.
    pub bytes_total: u64,
    /// Bytes at the sink as far as the source knows.
    pub bytes_done: u64,
    /// Payload bytes put on the wire over all runs (resends included).
    pub bytes_sent: u64,
}

/// A sink-side row: an incoming transfer, or a replica once published.
#[derive(Debug, Clone, Serialize, PartialEq, utoipa::ToSchema)]
pub struct Replica {
    /// Row id.
    pub id: i64,
    /// Source agent name (certificate SAN).
    pub peer: String,
    /// Source site.
    pub source_site: String,
    /// Transfer id at the source.
    #[schema(value_type = i64)]
    pub source_transfer: TransferId,
    /// Job name.
    pub job: String,
    /// Absolute checkpoint path at the source.
    pub source_path: String,
    /// Path relative to the source root.
    pub rel: String,
    /// Chunk size in bytes.
    pub chunk_size: i64,
    /// State: `receiving`, `published`, `failed` or `cancelled`.
    pub state: TransferState,
    /// Bytes in the checkpoint.
    pub bytes_total: i64,
    /// Bytes verified in staging.
    pub bytes_done: i64,
    /// Staging directory.
    pub staging_path: String,
    /// Where the replica is (or will be) published.
    pub local_path: String,
    /// Hex BLAKE3 manifest root once published.
    pub manifest_root: Option<String>,
    /// Last error.
    pub error: Option<String>,
    /// Creation time (Unix ms).
    pub created_at: i64,
    /// Publish time (Unix ms).
    pub published_at: Option<i64>,
    /// When the source committed the checkpoint (Unix ms, source clock).
    pub committed_at: Option<i64>,
    /// Publish time minus the source's commit time, seconds (can be
    /// negative only if the two agents' clocks disagree).
    pub commit_to_replica_s: Option<f64>,
    /// Publish time minus the time the checkpoint opened at the source,
    /// seconds.
    pub open_to_replica_s: Option<f64>,
    /// Replication profile.
    pub profile: Profile,
}

/// New sink-side row.
#[derive(Debug, Clone)]
pub struct NewReplica<'a> {
    /// Source agent name.
    pub peer: &'a str,
    /// Source site.
    pub source_site: &'a str,
    /// Transfer id at the source.
    pub source_transfer: TransferId,
    /// Job.
    pub job: &'a str,
    /// Source path.
    pub source_path: &'a str,
    /// Relative path.
    pub rel: &'a str,
    /// Chunk size in bytes.
    pub chunk_size: u32,
    /// File list.
    pub files: &'a [FileInfo],
    /// Total bytes.
    pub bytes_total: u64,
    /// Staging directory.
    pub staging_path: &'a str,
    /// Publish path.
    pub local_path: &'a str,
    /// Replication profile.
    pub profile: Profile,
}

/// When a checkpoint opened and was committed at the source (Unix ms,
/// the source's clock; 0 = unknown), as carried by the commit message.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SourceTimes {
    /// Commit time.
    pub committed_ms: i64,
    /// Open time.
    pub opened_ms: i64,
}

/// Where a [`Job`] row came from.
pub mod origin {
    /// The `[[jobs]]` of the config file, rewritten at every start.
    pub const CONFIG: &str = "config";
    /// The API; kept across restarts until set again, whatever the config
    /// file says.
    pub const API: &str = "api";
}

/// A job (training run) as the scheduler ranks it.
#[derive(Debug, Clone, Serialize, PartialEq, utoipa::ToSchema)]
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

/// An anomaly report from a training controller.
#[derive(Debug, Clone, Serialize, PartialEq, utoipa::ToSchema)]
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
    #[schema(value_type = Option<i64>)]
    pub transfer: Option<TransferId>,
    /// When it was received (Unix ms).
    pub received_at: i64,
}

/// A chunk verified at the sink, as [`Catalog::add_chunks`] records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VerifiedChunk {
    /// Sink-side row id.
    pub replica: i64,
    /// Chunk key (`file position << 32 | chunk index`).
    pub key: u64,
    /// Its BLAKE3 hash.
    pub hash: Hash,
    /// Its length, bytes.
    pub bytes: u64,
    /// When its last byte arrived, Unix ms; `None` = when recorded (a
    /// chunk found in staging or reused from an older version).
    pub arrived_ms: Option<i64>,
    /// When its first byte arrived, Unix ms, if known.
    pub arrival_started_ms: Option<i64>,
}

/// Handle to the catalog; cheap to clone.
#[derive(Debug, Clone)]
pub struct Catalog {
    pool: SqlitePool,
    _lock: Option<std::sync::Arc<Flock<File>>>,
}

const TRANSFER_COLS: &str = "id, link, job, source_path, rel, class, state, bytes_total, \
    bytes_done, bytes_sent, shards, manifest_root, local_path, error, created_at, started_at, finished_at, \
    checkpoint, format, opened_at, committed_at, commit_identity, profile, importance, \
    urgent_until, signal";

const REPLICA_COLS: &str = "id, peer, source_site, source_transfer, job, source_path, rel, \
    chunk_size, state, bytes_total, bytes_done, staging_path, local_path, manifest_root, error, \
    created_at, published_at, committed_at, commit_to_replica_s, open_to_replica_s, profile";

/// A column holding one of a typed enum's names (`as_str`), parsed back.
fn parsed<T>(r: &sqlx::sqlite::SqliteRow, col: &'static str) -> Result<T, sqlx::Error>
where
    T: FromStr,
    T::Err: std::error::Error + Send + Sync + 'static,
{
    let text: String = r.try_get(col)?;
    text.parse().map_err(|e| sqlx::Error::ColumnDecode {
        index: col.into(),
        source: Box::new(e),
    })
}

/// A transfer id column (`BIGINT`, never negative).
fn transfer_id(r: &sqlx::sqlite::SqliteRow, col: &'static str) -> Result<TransferId, sqlx::Error> {
    let v: i64 = r.try_get(col)?;
    TransferId::from_i64(v).ok_or_else(|| sqlx::Error::ColumnDecode {
        index: col.into(),
        source: format!("negative transfer id {v}").into(),
    })
}

/// A nullable transfer id column.
fn transfer_id_opt(
    r: &sqlx::sqlite::SqliteRow,
    col: &'static str,
) -> Result<Option<TransferId>, sqlx::Error> {
    let v: Option<i64> = r.try_get(col)?;
    v.map(|_| transfer_id(r, col)).transpose()
}

/// The `profile` column: `NULL` for every file, else the profile's name.
fn profile(r: &sqlx::sqlite::SqliteRow) -> Result<Profile, sqlx::Error> {
    let name: Option<String> = r.try_get("profile")?;
    Profile::from_stored(name.as_deref()).map_err(|e| sqlx::Error::ColumnDecode {
        index: "profile".into(),
        source: Box::new(e),
    })
}

fn transfer_row(r: &sqlx::sqlite::SqliteRow) -> Result<Transfer, sqlx::Error> {
    Ok(Transfer {
        id: transfer_id(r, "id")?,
        link: r.try_get("link")?,
        job: r.try_get("job")?,
        source_path: r.try_get("source_path")?,
        rel: r.try_get("rel")?,
        class: parsed(r, "class")?,
        state: parsed(r, "state")?,
        bytes_total: r.try_get("bytes_total")?,
        bytes_done: r.try_get("bytes_done")?,
        bytes_sent: r.try_get("bytes_sent")?,
        shards: r.try_get("shards")?,
        manifest_root: r.try_get("manifest_root")?,
        local_path: r.try_get("local_path")?,
        error: r.try_get("error")?,
        created_at: r.try_get("created_at")?,
        started_at: r.try_get("started_at")?,
        finished_at: r.try_get("finished_at")?,
        checkpoint: parsed(r, "checkpoint")?,
        format: r.try_get("format")?,
        opened_at: r.try_get("opened_at")?,
        committed_at: r.try_get("committed_at")?,
        commit_identity: r.try_get("commit_identity")?,
        profile: profile(r)?,
        importance: r.try_get("importance")?,
        urgent_until: r.try_get("urgent_until")?,
        signal: r.try_get("signal")?,
    })
}

const JOB_COLS: &str = "name, model_params, importance, origin, updated_at";

const SIGNAL_COLS: &str = "id, job, kind, severity, step, idempotency_key, transfer, received_at";

fn job_row(r: &sqlx::sqlite::SqliteRow) -> Result<Job, sqlx::Error> {
    Ok(Job {
        name: r.try_get("name")?,
        model_params: r.try_get("model_params")?,
        importance: r.try_get("importance")?,
        origin: r.try_get("origin")?,
        updated_at: r.try_get("updated_at")?,
    })
}

fn signal_row(r: &sqlx::sqlite::SqliteRow) -> Result<Signal, sqlx::Error> {
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

/// `v` if it is a number from 0 to 1, else an error naming `field`.
fn check_unit(field: &str, v: f64) -> Result<f64, CatalogError> {
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
fn check_params(field: &str, v: Option<f64>) -> Result<Option<f64>, CatalogError> {
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
fn check_job_name(field: &str, name: &str) -> Result<(), CatalogError> {
    ferry_proto::paths::check_name(name).map_err(|e| CatalogError::Invalid(format!("{field}: {e}")))
}

/// Rows of `table` (`transfers` or `replicas`) per state.
async fn state_counts(
    pool: &SqlitePool,
    table: &'static str,
) -> Result<Vec<(TransferState, i64)>, CatalogError> {
    let q = format!("SELECT state, COUNT(*) AS n FROM {table} GROUP BY state ORDER BY state");
    let rows = sqlx::query(&q).fetch_all(pool).await?;
    Ok(rows
        .iter()
        .map(|r| Ok((parsed(r, "state")?, r.try_get("n")?)))
        .collect::<Result<_, sqlx::Error>>()?)
}

fn replica_row(r: &sqlx::sqlite::SqliteRow) -> Result<Replica, sqlx::Error> {
    Ok(Replica {
        id: r.try_get("id")?,
        peer: r.try_get("peer")?,
        source_site: r.try_get("source_site")?,
        source_transfer: transfer_id(r, "source_transfer")?,
        job: r.try_get("job")?,
        source_path: r.try_get("source_path")?,
        rel: r.try_get("rel")?,
        chunk_size: r.try_get("chunk_size")?,
        state: parsed(r, "state")?,
        bytes_total: r.try_get("bytes_total")?,
        bytes_done: r.try_get("bytes_done")?,
        staging_path: r.try_get("staging_path")?,
        local_path: r.try_get("local_path")?,
        manifest_root: r.try_get("manifest_root")?,
        error: r.try_get("error")?,
        created_at: r.try_get("created_at")?,
        published_at: r.try_get("published_at")?,
        committed_at: r.try_get("committed_at")?,
        commit_to_replica_s: r.try_get("commit_to_replica_s")?,
        open_to_replica_s: r.try_get("open_to_replica_s")?,
        profile: profile(r)?,
    })
}

impl Catalog {
    /// Opens (creating if needed) `data_dir/ferry.db`, takes an exclusive
    /// lock on `data_dir/agent.lock` so two agents never share one data
    /// directory, and applies the embedded migrations.
    ///
    /// # Errors
    /// [`CatalogError::DataDir`] if the directory cannot be created or is
    /// locked by another agent; [`CatalogError::File`], naming the file,
    /// if the catalog cannot be opened, fails SQLite's `quick_check` or
    /// cannot be migrated (a damaged catalog is reported, never deleted).
    pub async fn open(data_dir: &Path) -> Result<Catalog, CatalogError> {
        let dd = |why: String| CatalogError::DataDir {
            path: data_dir.to_path_buf(),
            why,
        };
        std::fs::create_dir_all(data_dir).map_err(|e| dd(e.to_string()))?;
        let lock_file = File::create(data_dir.join("agent.lock")).map_err(|e| dd(e.to_string()))?;
        let lock = Flock::lock(lock_file, FlockArg::LockExclusiveNonblock).map_err(|(_, e)| {
            dd(format!(
                "already in use by another ferry agent (agent.lock is held: {e})"
            ))
        })?;
        let db = data_dir.join("ferry.db");
        let file = |why: String| CatalogError::File {
            path: db.clone(),
            why: format!(
                "{why}; the file is left as it is (nothing was deleted): restore it from a \
                 backup, or move it and its -wal and -shm files aside to start with an empty \
                 catalog"
            ),
        };
        let url = format!("sqlite://{}", db.display());
        let opts = SqliteConnectOptions::from_str(&url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(5));
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(opts)
            .await
            .map_err(|e| file(format!("cannot open it: {e}")))?;
        // A damaged page would otherwise surface later, in the middle of
        // a transfer or a resolve; refuse at start instead.
        let check: Vec<String> = sqlx::query_scalar("PRAGMA quick_check")
            .fetch_all(&pool)
            .await
            .map_err(|e| file(format!("damaged (SQLite quick_check failed: {e})")))?;
        if check.first().map(String::as_str) != Some("ok") {
            let shown: Vec<&str> = check.iter().take(3).map(String::as_str).collect();
            return Err(file(format!(
                "damaged (SQLite quick_check: {})",
                shown.join("; ")
            )));
        }
        sqlx::migrate!("../migrations")
            .run(&pool)
            .await
            .map_err(|e| file(format!("cannot migrate it: {e}")))?;
        Ok(Catalog {
            pool,
            _lock: Some(std::sync::Arc::new(lock)),
        })
    }

    /// Opens an existing catalog read-only, without the agent lock, so
    /// tools like `ferry verify` can read it while the agent runs.
    ///
    /// # Errors
    /// [`CatalogError::DataDir`] if there is no catalog; SQL errors.
    pub async fn open_read_only(data_dir: &Path) -> Result<Catalog, CatalogError> {
        let db = data_dir.join("ferry.db");
        if !db.is_file() {
            return Err(CatalogError::DataDir {
                path: data_dir.to_path_buf(),
                why: "no catalog (ferry.db) here; is this the agent's data_dir?".into(),
            });
        }
        let opts = SqliteConnectOptions::from_str(&format!("sqlite://{}", db.display()))?
            .read_only(true)
            .busy_timeout(Duration::from_secs(5));
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(opts)
            .await?;
        Ok(Catalog { pool, _lock: None })
    }

    /// Closes the pool, waiting for queries in flight.
    pub async fn close(&self) {
        self.pool.close().await;
    }

    // ---- source side ----

    /// Inserts a queued transfer; returns its id.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn insert_transfer(
        &self,
        link: &str,
        job: &str,
        source_path: &str,
        rel: &str,
        class: Class,
    ) -> Result<TransferId, CatalogError> {
        let r = sqlx::query(
            "INSERT INTO transfers (link, job, source_path, rel, class, state, created_at) \
             VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING id",
        )
        .bind(link)
        .bind(job)
        .bind(source_path)
        .bind(rel)
        .bind(class.as_str())
        .bind(TransferState::Queued.as_str())
        .bind(now_ms())
        .fetch_one(&self.pool)
        .await?;
        Ok(transfer_id(&r, "id")?)
    }

    /// Inserts a transfer of a checkpoint found by the watcher, in
    /// checkpoint state `ckpt` ([`checkpoint`]); returns its id.
    ///
    /// # Errors
    /// SQL errors.
    #[allow(clippy::too_many_arguments)]
    pub async fn insert_watched_transfer(
        &self,
        link: &str,
        job: &str,
        source_path: &str,
        rel: &str,
        class: Class,
        ckpt: CheckpointState,
        format: &str,
        opened_at: Option<i64>,
        committed_at: Option<i64>,
        profile: Profile,
    ) -> Result<TransferId, CatalogError> {
        let r = sqlx::query(
            "INSERT INTO transfers (link, job, source_path, rel, class, state, created_at, \
             checkpoint, format, opened_at, committed_at, profile) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
        )
        .bind(link)
        .bind(job)
        .bind(source_path)
        .bind(rel)
        .bind(class.as_str())
        .bind(TransferState::Queued.as_str())
        .bind(now_ms())
        .bind(ckpt.as_str())
        .bind(format)
        .bind(opened_at)
        .bind(committed_at)
        .bind(profile.stored_name())
        .fetch_one(&self.pool)
        .await?;
        Ok(transfer_id(&r, "id")?)
    }

    /// Records the checkpoint state of a transfer ([`checkpoint`]) and,
    /// when committed, the commit time (Unix ms) and commit identity.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn set_checkpoint_state(
        &self,
        id: TransferId,
        ckpt: CheckpointState,
        committed_at: Option<i64>,
        identity: Option<&str>,
    ) -> Result<(), CatalogError> {
        sqlx::query(
            "UPDATE transfers SET checkpoint = ?, committed_at = COALESCE(?, committed_at), \
             commit_identity = COALESCE(?, commit_identity) WHERE id = ?",
        )
        .bind(ckpt.as_str())
        .bind(committed_at)
        .bind(identity)
        .bind(id.as_i64())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Sets the format that recognised a transfer's checkpoint (an
    /// announced one is queued before its format is known).
    ///
    /// # Errors
    /// SQL errors.
    pub async fn set_transfer_format(
        &self,
        id: TransferId,
        format: &str,
    ) -> Result<(), CatalogError> {
        sqlx::query("UPDATE transfers SET format = ? WHERE id = ?")
            .bind(format)
            .bind(id.as_i64())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Sets when a transfer's checkpoint opened (Unix ms).
    ///
    /// # Errors
    /// SQL errors.
    pub async fn set_opened_at(&self, id: TransferId, opened_at: i64) -> Result<(), CatalogError> {
        sqlx::query("UPDATE transfers SET opened_at = ? WHERE id = ?")
            .bind(opened_at)
            .bind(id.as_i64())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// One transfer by id.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn transfer(&self, id: TransferId) -> Result<Option<Transfer>, CatalogError> {
        let q = format!("SELECT {TRANSFER_COLS} FROM transfers WHERE id = ?");
        let r = sqlx::query(&q)
            .bind(id.as_i64())
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(transfer_row).transpose()?)
    }

    /// Transfers, newest first, at most `limit`, starting after `offset`.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn transfers(&self, limit: i64, offset: i64) -> Result<Vec<Transfer>, CatalogError> {
        let q = format!("SELECT {TRANSFER_COLS} FROM transfers ORDER BY id DESC LIMIT ? OFFSET ?");
        let rows = sqlx::query(&q)
            .bind(limit)
            .bind(offset)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(transfer_row).collect::<Result<_, _>>()?)
    }

    /// Source-side transfers per state (states with none are left out).
    ///
    /// # Errors
    /// SQL errors.
    pub async fn transfer_state_counts(&self) -> Result<Vec<(TransferState, i64)>, CatalogError> {
        state_counts(&self.pool, "transfers").await
    }

    /// Sink-side rows (incoming transfers and replicas) per state (states
    /// with none are left out).
    ///
    /// # Errors
    /// SQL errors.
    pub async fn replica_state_counts(&self) -> Result<Vec<(TransferState, i64)>, CatalogError> {
        state_counts(&self.pool, "replicas").await
    }

    /// Transfers not in a final state, oldest first (the work to resume
    /// after a restart).
    ///
    /// # Errors
    /// SQL errors.
    pub async fn unfinished_transfers(&self) -> Result<Vec<Transfer>, CatalogError> {
        let q = format!(
            "SELECT {TRANSFER_COLS} FROM transfers WHERE state NOT IN (?, ?, ?) ORDER BY id"
        );
        let rows = sqlx::query(&q)
            .bind(TransferState::Published.as_str())
            .bind(TransferState::Failed.as_str())
            .bind(TransferState::Cancelled.as_str())
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(transfer_row).collect::<Result<_, _>>()?)
    }

    /// The newest transfer of `source_path` (exact match), if any.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn transfer_by_path(
        &self,
        source_path: &str,
    ) -> Result<Option<Transfer>, CatalogError> {
        let q = format!(
            "SELECT {TRANSFER_COLS} FROM transfers WHERE source_path = ? ORDER BY id DESC LIMIT 1"
        );
        let r = sqlx::query(&q)
            .bind(source_path)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(transfer_row).transpose()?)
    }

    /// Every transfer of `source_path`, oldest first.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn transfers_for_path(
        &self,
        source_path: &str,
    ) -> Result<Vec<Transfer>, CatalogError> {
        let q = format!("SELECT {TRANSFER_COLS} FROM transfers WHERE source_path = ? ORDER BY id");
        let rows = sqlx::query(&q)
            .bind(source_path)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(transfer_row).collect::<Result<_, _>>()?)
    }

    /// True if an earlier transfer than `id` of `source_path` was
    /// published (the sink may then hold most of its bytes already).
    ///
    /// # Errors
    /// SQL errors.
    pub async fn published_before(
        &self,
        source_path: &str,
        id: TransferId,
    ) -> Result<bool, CatalogError> {
        let r = sqlx::query(
            "SELECT id FROM transfers WHERE source_path = ? AND id < ? AND state = 'published' LIMIT 1",
        )
        .bind(source_path)
        .bind(id.as_i64())
        .fetch_optional(&self.pool)
        .await?;
        Ok(r.is_some())
    }

    /// Sets a transfer's state (and error text for `failed`), stamping
    /// `started_at` on the first `active` and `finished_at` on final states.
    /// A final state is never left, and a `paused` transfer does not become
    /// `active` or `verifying` (only resume, cancel or a failure move it):
    /// the transfer task's own writes must not undo an operator's pause or
    /// cancel that landed while it was starting or sending; such a write
    /// changes nothing.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn set_transfer_state(
        &self,
        id: TransferId,
        new_state: TransferState,
        error: Option<&str>,
    ) -> Result<(), CatalogError> {
        let now = now_ms();
        let new_state = new_state.as_str();
        sqlx::query(
            "UPDATE transfers SET state = ?, error = COALESCE(?, error), \
             started_at = CASE WHEN ? = 'active' AND started_at IS NULL THEN ? ELSE started_at END, \
             finished_at = CASE WHEN ? IN ('published', 'failed', 'cancelled') THEN ? ELSE finished_at END \
             WHERE id = ? AND state NOT IN ('published', 'failed', 'cancelled') \
             AND NOT (state = 'paused' AND ? IN ('active', 'verifying'))",
        )
        .bind(new_state)
        .bind(error)
        .bind(new_state)
        .bind(now)
        .bind(new_state)
        .bind(now)
        .bind(id.as_i64())
        .bind(new_state)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Sets (or with `None` clears) a transfer's last-problem text without
    /// changing its state, e.g. why its link cannot connect.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn set_transfer_note(
        &self,
        id: TransferId,
        note: Option<&str>,
    ) -> Result<(), CatalogError> {
        sqlx::query("UPDATE transfers SET error = ? WHERE id = ?")
            .bind(note)
            .bind(id.as_i64())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Records the size and shard count of a transfer's checkpoint: the
    /// announced size, the listing of a pushed directory, or the sealed
    /// manifest of a watched one. `bytes_done` stays at most `bytes_total`.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn set_transfer_size(
        &self,
        id: TransferId,
        bytes_total: u64,
        shards: u64,
    ) -> Result<(), CatalogError> {
        let total = bytes_total as i64;
        sqlx::query(
            "UPDATE transfers SET bytes_total = ?, shards = ?, bytes_done = MIN(bytes_done, ?) \
             WHERE id = ?",
        )
        .bind(total)
        .bind(shards as i64)
        .bind(total)
        .bind(id.as_i64())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Records how far a transfer got, never moving backwards: each of
    /// `bytes_total` (bytes known so far, for a checkpoint still being
    /// written), `bytes_done` and `bytes_sent` only grows, and `bytes_done`
    /// stays at most `bytes_total`. A transfer's run writes this whenever
    /// it stops (pause, reconnect, shutdown, failure) and while it runs, so
    /// what a run achieved stays visible when the next one starts.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn note_transfer_progress(
        &self,
        id: TransferId,
        p: ProgressNote,
    ) -> Result<(), CatalogError> {
        let total = p.bytes_total as i64;
        sqlx::query(
            "UPDATE transfers SET bytes_total = MAX(bytes_total, ?), \
             bytes_done = MIN(MAX(bytes_done, ?), MAX(bytes_total, ?)), \
             bytes_sent = MAX(bytes_sent, ?) WHERE id = ?",
        )
        .bind(total)
        .bind(p.bytes_done as i64)
        .bind(total)
        .bind(p.bytes_sent as i64)
        .bind(id.as_i64())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Marks a transfer published at `local_path` with manifest `root`.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn set_transfer_published(
        &self,
        id: TransferId,
        root_hex: &str,
        local_path: &str,
    ) -> Result<(), CatalogError> {
        sqlx::query(
            "UPDATE transfers SET state = 'published', manifest_root = ?, local_path = ?, \
             bytes_done = bytes_total, finished_at = ? WHERE id = ?",
        )
        .bind(root_hex)
        .bind(local_path)
        .bind(now_ms())
        .bind(id.as_i64())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Sets a transfer's class (`urgent`, `scheduled` or `background`),
    /// e.g. an operator re-prioritising it. Also ends any promotion by a
    /// signal (clears `urgent_until` and `signal`): the class set by hand
    /// is the one that holds.
    ///
    /// # Errors
    /// [`CatalogError::Invalid`] naming `class` for an unknown class; SQL
    /// errors.
    pub async fn set_transfer_class(
        &self,
        id: TransferId,
        class: Class,
    ) -> Result<(), CatalogError> {
        sqlx::query(
            "UPDATE transfers SET class = ?, urgent_until = NULL, signal = NULL WHERE id = ?",
        )
        .bind(class.as_str())
        .bind(id.as_i64())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Sets (`Some`, 0..1) or clears (`None`: the job's importance holds
    /// again) a transfer's importance override.
    ///
    /// # Errors
    /// [`CatalogError::Invalid`] naming `importance` outside 0..1; SQL
    /// errors.
    pub async fn set_transfer_importance(
        &self,
        id: TransferId,
        importance: Option<f64>,
    ) -> Result<(), CatalogError> {
        let importance = importance
            .map(|v| check_unit("importance", v))
            .transpose()?;
        sqlx::query("UPDATE transfers SET importance = ? WHERE id = ?")
            .bind(importance)
            .bind(id.as_i64())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Promotes a transfer to `urgent` until `until_ms` (Unix ms) because
    /// of signal `signal_id`; its `class` stays the class it returns to.
    /// A later promotion replaces an earlier one.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn promote_urgent(
        &self,
        id: TransferId,
        until_ms: i64,
        signal_id: i64,
    ) -> Result<(), CatalogError> {
        sqlx::query("UPDATE transfers SET urgent_until = ?, signal = ? WHERE id = ?")
            .bind(until_ms)
            .bind(signal_id)
            .bind(id.as_i64())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// The transfer of `job` that a signal promotes: the one created last
    /// (largest `created_at`, then largest id) that is not published,
    /// failed or cancelled, and not in class `background` (datasets and
    /// logs are not checkpoints; a checkpoint an operator put there stays
    /// there). Queued, active, paused and verifying transfers all count.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn newest_unpublished_transfer(
        &self,
        job: &str,
    ) -> Result<Option<Transfer>, CatalogError> {
        let q = format!(
            "SELECT {TRANSFER_COLS} FROM transfers WHERE job = ? AND state NOT IN (?, ?, ?) \
             AND class <> 'background' ORDER BY created_at DESC, id DESC LIMIT 1"
        );
        let r = sqlx::query(&q)
            .bind(job)
            .bind(TransferState::Published.as_str())
            .bind(TransferState::Failed.as_str())
            .bind(TransferState::Cancelled.as_str())
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(transfer_row).transpose()?)
    }

    // ---- jobs and signals (source side) ----

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
            sqlx::query(
                "INSERT INTO jobs (name, model_params, importance, origin, updated_at) \
                 VALUES (?, ?, ?, ?, ?) \
                 ON CONFLICT (name) DO UPDATE SET model_params = excluded.model_params, \
                 importance = excluded.importance, updated_at = excluded.updated_at \
                 WHERE jobs.origin = ?",
            )
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
        let r = sqlx::query(&q)
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
        let r = sqlx::query(&q)
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
        let rows = sqlx::query(&q).fetch_all(&self.pool).await?;
        Ok(rows.iter().map(job_row).collect::<Result<_, _>>()?)
    }

    /// Records a signal about `job` (severity 0..1, received now). With an
    /// idempotency `key` already used, nothing is inserted and the signal
    /// first stored under that key is returned, whatever its job, kind or
    /// severity. The flag is true if the signal is new.
    ///
    /// # Errors
    /// [`CatalogError::Invalid`] naming the field (job name, severity);
    /// SQL errors.
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
        let r = sqlx::query(&q)
            .bind(job)
            .bind(kind)
            .bind(severity)
            .bind(step)
            .bind(key)
            .bind(now_ms())
            .fetch_optional(&self.pool)
            .await?;
        if let Some(r) = r {
            return Ok((signal_row(&r)?, true));
        }
        // Only a used key makes the insert do nothing.
        let q = format!("SELECT {SIGNAL_COLS} FROM signals WHERE idempotency_key = ?");
        let r = sqlx::query(&q)
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
        sqlx::query("UPDATE signals SET transfer = ? WHERE id = ?")
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
        let rows = sqlx::query(&q).bind(since_ms).fetch_all(&self.pool).await?;
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
        let rows = sqlx::query(&q)
            .bind(limit.max(0))
            .bind(offset.max(0))
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(signal_row).collect::<Result<_, _>>()?)
    }

    // ---- sink side ----

    /// The row of an incoming transfer, if known.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn find_replica(
        &self,
        peer: &str,
        source_transfer: TransferId,
        source_path: &str,
    ) -> Result<Option<Replica>, CatalogError> {
        let q = format!(
            "SELECT {REPLICA_COLS} FROM replicas WHERE peer = ? AND source_transfer = ? AND source_path = ?"
        );
        let r = sqlx::query(&q)
            .bind(peer)
            .bind(source_transfer.as_i64())
            .bind(source_path)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(replica_row).transpose()?)
    }

    /// Inserts an incoming transfer in state `receiving`; returns its id.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn insert_replica(&self, n: &NewReplica<'_>) -> Result<i64, CatalogError> {
        let files =
            serde_json::to_string(n.files).map_err(|e| CatalogError::Corrupt(e.to_string()))?;
        let mut tx = self.pool.begin().await?;
        let r = sqlx::query(
            "INSERT INTO replicas (peer, source_site, source_transfer, job, source_path, rel, \
             chunk_size, files, state, bytes_total, staging_path, local_path, created_at, profile) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
        )
        .bind(n.peer)
        .bind(n.source_site)
        .bind(n.source_transfer.as_i64())
        .bind(n.job)
        .bind(n.source_path)
        .bind(n.rel)
        .bind(i64::from(n.chunk_size))
        .bind("")
        .bind(TransferState::Receiving.as_str())
        .bind(n.bytes_total as i64)
        .bind(n.staging_path)
        .bind(n.local_path)
        .bind(now_ms())
        .bind(n.profile.stored_name())
        .fetch_one(&mut *tx)
        .await?;
        let id: i64 = r.try_get("id")?;
        sqlx::query("INSERT INTO replica_files (replica, files) VALUES (?, ?)")
            .bind(id)
            .bind(files)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(id)
    }

    /// The file list stored for a sink-side row.
    ///
    /// # Errors
    /// SQL errors, or [`CatalogError::Corrupt`] if it cannot be decoded.
    pub async fn replica_files(&self, id: i64) -> Result<Vec<FileInfo>, CatalogError> {
        let r = sqlx::query("SELECT files FROM replica_files WHERE replica = ?")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .ok_or_else(|| CatalogError::Corrupt(format!("replica {id} has no file list")))?;
        let s: String = r.try_get("files")?;
        serde_json::from_str(&s)
            .map_err(|e| CatalogError::Corrupt(format!("file list of replica {id}: {e}")))
    }

    /// Replaces the file list of a row (a resumed transfer whose files
    /// changed at the source) and its total.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn set_replica_files(
        &self,
        id: i64,
        files: &[FileInfo],
        bytes_total: u64,
    ) -> Result<(), CatalogError> {
        let s = serde_json::to_string(files).map_err(|e| CatalogError::Corrupt(e.to_string()))?;
        let mut tx = self.pool.begin().await?;
        sqlx::query("UPDATE replica_files SET files = ? WHERE replica = ?")
            .bind(s)
            .bind(id)
            .execute(&mut *tx)
            .await?;
        sqlx::query("UPDATE replicas SET bytes_total = ? WHERE id = ?")
            .bind(bytes_total as i64)
            .bind(id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Verified chunks of a sink-side row: `(chunk key, hash)`.
    ///
    /// # Errors
    /// SQL errors; [`CatalogError::Corrupt`] for a hash that is not 32 bytes.
    pub async fn chunks(&self, replica: i64) -> Result<Vec<(u64, Hash)>, CatalogError> {
        let rows = sqlx::query("SELECT idx, hash FROM chunks WHERE replica = ? ORDER BY idx")
            .bind(replica)
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| {
                let idx: i64 = r.try_get("idx")?;
                let h: Vec<u8> = r.try_get("hash")?;
                let h: Hash = h.try_into().map_err(|_| {
                    CatalogError::Corrupt(format!("chunk {idx} of replica {replica}"))
                })?;
                Ok((idx as u64, h))
            })
            .collect()
    }

    /// When the bytes of a sink-side row arrived, in [`Arrivals`] bins;
    /// from the chunk rows while the transfer is receiving, from the
    /// summary kept at publish afterwards. Chunks recorded before catalog
    /// version 3 (no time) are left out. Shows whose bytes reached the
    /// sink when (the priority tests and the pre-emption latency read it).
    ///
    /// # Errors
    /// SQL errors; [`CatalogError::Corrupt`] for an unreadable summary.
    pub async fn chunk_arrivals(&self, replica: i64) -> Result<Arrivals, CatalogError> {
        let mut conn = self.pool.acquire().await?;
        let live = arrival_bins(&mut conn, replica).await?;
        if !live.bins.is_empty() {
            return Ok(live);
        }
        let kept: Option<Option<String>> =
            sqlx::query_scalar("SELECT arrivals FROM replicas WHERE id = ?")
                .bind(replica)
                .fetch_optional(&mut *conn)
                .await?;
        match kept.flatten() {
            Some(j) => serde_json::from_str(&j)
                .map_err(|e| CatalogError::Corrupt(format!("arrivals of replica {replica}: {e}"))),
            None => Ok(Arrivals {
                bin_ms: ARRIVAL_BIN_MS,
                bins: Vec::new(),
            }),
        }
    }

    /// Replaces every verified chunk of a sink-side row with `chunks`
    /// `(key, hash)` and sets its `bytes_done`, in one transaction (a
    /// resumed transfer whose file table was renumbered).
    ///
    /// # Errors
    /// SQL errors (nothing changes then).
    pub async fn replace_chunks(
        &self,
        replica: i64,
        chunks: &[(u64, Hash)],
        bytes_done: u64,
    ) -> Result<(), CatalogError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("DELETE FROM chunks WHERE replica = ?")
            .bind(replica)
            .execute(&mut *tx)
            .await?;
        for (idx, hash) in chunks {
            sqlx::query("INSERT INTO chunks (replica, idx, hash) VALUES (?, ?, ?)")
                .bind(replica)
                .bind(*idx as i64)
                .bind(&hash[..])
                .execute(&mut *tx)
                .await?;
        }
        sqlx::query("UPDATE replicas SET bytes_done = ? WHERE id = ?")
            .bind(bytes_done as i64)
            .bind(replica)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Records verified chunks in one transaction, each with its length
    /// and arrival time, and bumps each row's `bytes_done` by the chunk's
    /// length. A chunk already recorded is left as it is (first arrival
    /// wins).
    ///
    /// # Errors
    /// SQL errors (nothing is recorded then).
    pub async fn add_chunks(&self, chunks: &[VerifiedChunk]) -> Result<(), CatalogError> {
        let now = now_ms();
        let mut tx = self.pool.begin().await?;
        // One bytes_done update per replica and batch: an UPDATE rewrites
        // the whole row.
        let mut gained: Vec<(i64, i64)> = Vec::new();
        for c in chunks {
            let r = sqlx::query(
                "INSERT INTO chunks (replica, idx, hash, verified_at, bytes, arrival_started) \
                 VALUES (?, ?, ?, ?, ?, ?) \
                 ON CONFLICT DO NOTHING",
            )
            .bind(c.replica)
            .bind(c.key as i64)
            .bind(&c.hash[..])
            .bind(c.arrived_ms.unwrap_or(now))
            .bind(c.bytes as i64)
            .bind(c.arrival_started_ms)
            .execute(&mut *tx)
            .await?;
            if r.rows_affected() > 0 {
                match gained.iter_mut().find(|(id, _)| *id == c.replica) {
                    Some((_, n)) => *n += c.bytes as i64,
                    None => gained.push((c.replica, c.bytes as i64)),
                }
            }
        }
        for (id, n) in gained {
            sqlx::query("UPDATE replicas SET bytes_done = bytes_done + ? WHERE id = ?")
                .bind(n)
                .bind(id)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Forgets verified chunks (they will be fetched again) and resets
    /// `bytes_done` to `bytes_done`.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn drop_chunks(
        &self,
        replica: i64,
        idx: &[u64],
        bytes_done: u64,
    ) -> Result<(), CatalogError> {
        let mut tx = self.pool.begin().await?;
        for i in idx {
            sqlx::query("DELETE FROM chunks WHERE replica = ? AND idx = ?")
                .bind(replica)
                .bind(*i as i64)
                .execute(&mut *tx)
                .await?;
        }
        sqlx::query("UPDATE replicas SET bytes_done = ? WHERE id = ?")
            .bind(bytes_done as i64)
            .bind(replica)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Marks a row published: stores the sealed manifest and its root and
    /// deletes the per-chunk rows (no longer needed). Returns the
    /// commit-to-replica lag it stored, seconds (`None`: commit time
    /// unknown).
    ///
    /// # Errors
    /// SQL errors.
    pub async fn set_replica_published(
        &self,
        id: i64,
        manifest: &[u8],
        root_hex: &str,
        local_path: &str,
        bytes: u64,
        times: SourceTimes,
    ) -> Result<Option<f64>, CatalogError> {
        let now = now_ms();
        let lag = |t: i64| (t > 0).then(|| (now - t) as f64 / 1000.0);
        let known = |t: i64| (t > 0).then_some(t);
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "UPDATE replicas SET state = 'published', manifest = ?, manifest_root = ?, \
             local_path = ?, bytes_total = ?, bytes_done = ?, published_at = ?, opened_at = ?, \
             committed_at = ?, commit_to_replica_s = ?, open_to_replica_s = ? WHERE id = ?",
        )
        .bind(manifest)
        .bind(root_hex)
        .bind(local_path)
        .bind(bytes as i64)
        .bind(bytes as i64)
        .bind(now)
        .bind(known(times.opened_ms))
        .bind(known(times.committed_ms))
        .bind(lag(times.committed_ms))
        .bind(lag(times.opened_ms))
        .bind(id)
        .execute(&mut *tx)
        .await?;
        // Keep when the bytes arrived (in bins) before the chunk rows go.
        let windows = arrival_bins(&mut tx, id).await?;
        let json = serde_json::to_string(&windows)
            .map_err(|e| CatalogError::Corrupt(format!("arrival windows: {e}")))?;
        sqlx::query("UPDATE replicas SET arrivals = ? WHERE id = ?")
            .bind(json)
            .bind(id)
            .execute(&mut *tx)
            .await?;
        sqlx::query("DELETE FROM chunks WHERE replica = ?")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(lag(times.committed_ms))
    }

    /// Sets a sink-side row's state and error.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn set_replica_state(
        &self,
        id: i64,
        new_state: TransferState,
        error: Option<&str>,
    ) -> Result<(), CatalogError> {
        sqlx::query("UPDATE replicas SET state = ?, error = COALESCE(?, error) WHERE id = ?")
            .bind(new_state.as_str())
            .bind(error)
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// One sink-side row by id.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn replica(&self, id: i64) -> Result<Option<Replica>, CatalogError> {
        let q = format!("SELECT {REPLICA_COLS} FROM replicas WHERE id = ?");
        let r = sqlx::query(&q).bind(id).fetch_optional(&self.pool).await?;
        Ok(r.as_ref().map(replica_row).transpose()?)
    }

    /// The sealed manifest of a published row.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn replica_manifest(&self, id: i64) -> Result<Option<Vec<u8>>, CatalogError> {
        let r = sqlx::query("SELECT manifest FROM replicas WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(match r {
            Some(r) => r.try_get("manifest")?,
            None => None,
        })
    }

    /// Sink-side rows, newest first; only published ones if `published`.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn replicas(
        &self,
        published: bool,
        limit: i64,
        offset: i64,
    ) -> Result<Vec<Replica>, CatalogError> {
        let q = if published {
            format!("SELECT {REPLICA_COLS} FROM replicas WHERE state = 'published' ORDER BY id DESC LIMIT ? OFFSET ?")
        } else {
            format!("SELECT {REPLICA_COLS} FROM replicas ORDER BY id DESC LIMIT ? OFFSET ?")
        };
        let rows = sqlx::query(&q)
            .bind(limit)
            .bind(offset)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(replica_row).collect::<Result<_, _>>()?)
    }

    /// The sink-side rows for a checkpoint at `source_path`, newest first:
    /// the newest published one and the newest one overall tell resolve
    /// what to answer.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn replicas_for_source(
        &self,
        source_path: &str,
    ) -> Result<Vec<Replica>, CatalogError> {
        let q = format!(
            "SELECT {REPLICA_COLS} FROM replicas WHERE source_path = ? ORDER BY id DESC LIMIT 16"
        );
        let rows = sqlx::query(&q)
            .bind(source_path)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(replica_row).collect::<Result<_, _>>()?)
    }

    /// A live or published row (not failed or cancelled) whose
    /// `local_path` lies strictly inside `local_path` or strictly contains
    /// it, if any: two such replicas would overlap on disk.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn overlapping_replica(
        &self,
        local_path: &str,
    ) -> Result<Option<String>, CatalogError> {
        let base = local_path.trim_end_matches('/');
        // Descendants: paths in [base + "/", base + "0"), "0" being the
        // byte after "/".
        let r = sqlx::query(
            "SELECT local_path FROM replicas WHERE state IN ('receiving', 'published') \
             AND local_path >= ? AND local_path < ? LIMIT 1",
        )
        .bind(format!("{base}/"))
        .bind(format!("{base}0"))
        .fetch_optional(&self.pool)
        .await?;
        if let Some(r) = r {
            return Ok(Some(r.try_get("local_path")?));
        }
        let mut p = Path::new(base).parent();
        while let Some(a) = p {
            let r = sqlx::query(
                "SELECT local_path FROM replicas WHERE state IN ('receiving', 'published') \
                 AND local_path = ? LIMIT 1",
            )
            .bind(a.to_string_lossy().as_ref())
            .fetch_optional(&self.pool)
            .await?;
            if let Some(r) = r {
                return Ok(Some(r.try_get("local_path")?));
            }
            p = a.parent();
        }
        Ok(None)
    }

    /// The newest published row whose `local_path` is `local_path`.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn replica_by_local_path(
        &self,
        local_path: &str,
    ) -> Result<Option<Replica>, CatalogError> {
        let q = format!(
            "SELECT {REPLICA_COLS} FROM replicas WHERE local_path = ? AND state = 'published' \
             ORDER BY id DESC LIMIT 1"
        );
        let r = sqlx::query(&q)
            .bind(local_path)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(replica_row).transpose()?)
    }
}

/// Finest width of the bins chunk arrivals are summed in, ms.
pub const ARRIVAL_BIN_MS: i64 = 10;

/// Most bins kept per sink-side row: a longer transfer gets bins ten
/// times wider until it fits (10 ms bins cover 100 s).
pub const MAX_ARRIVAL_BINS: i64 = 10_000;

/// Bytes verified at the sink per time bin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Arrivals {
    /// Bin width, ms: [`ARRIVAL_BIN_MS`] times a power of ten.
    pub bin_ms: i64,
    /// `(bin start, Unix ms; bytes whose chunk arrived in the bin)`, for
    /// bins with any, oldest first.
    pub bins: Vec<(i64, u64)>,
}

impl Arrivals {
    /// Bytes that arrived in bins starting within `from..to` (Unix ms).
    pub fn bytes_between(&self, from: i64, to: i64) -> u64 {
        self.bins
            .iter()
            .filter(|(s, _)| (from..to).contains(s))
            .map(|b| b.1)
            .sum()
    }
}

/// The arrival bins of one sink-side row, from its chunk rows: a chunk's
/// bytes are spread evenly over the time from its first byte to its last
/// (a 4 MiB chunk takes 34 ms at 1 Gbit/s, longer when streams share the
/// link), in proportion to each bin's overlap.
async fn arrival_bins(
    conn: &mut sqlx::SqliteConnection,
    replica: i64,
) -> Result<Arrivals, CatalogError> {
    let rows: Vec<(Option<i64>, i64, i64)> = sqlx::query_as(
        "SELECT arrival_started, verified_at, bytes FROM chunks \
         WHERE replica = ? AND verified_at IS NOT NULL AND bytes IS NOT NULL",
    )
    .bind(replica)
    .fetch_all(&mut *conn)
    .await?;
    Ok(spread_arrivals(&rows))
}

/// Bins `(first byte or None, last byte, bytes)` arrivals; see
/// [`arrival_bins`].
fn spread_arrivals(rows: &[(Option<i64>, i64, i64)]) -> Arrivals {
    let mut bin = ARRIVAL_BIN_MS;
    let lo = rows.iter().map(|r| r.0.unwrap_or(r.1).min(r.1)).min();
    let hi = rows.iter().map(|r| r.1).max();
    if let (Some(lo), Some(hi)) = (lo, hi) {
        while (hi - lo) / bin >= MAX_ARRIVAL_BINS {
            bin *= 10;
        }
    }
    let mut bins: std::collections::BTreeMap<i64, f64> = std::collections::BTreeMap::new();
    for &(from, to, bytes) in rows {
        let bytes = bytes.max(0) as f64;
        let from = from.unwrap_or(to).min(to);
        if to - from < 1 {
            *bins.entry(to.div_euclid(bin) * bin).or_default() += bytes;
            continue;
        }
        let span = (to - from) as f64;
        let mut start = from.div_euclid(bin) * bin;
        while start < to {
            let overlap = (start + bin).min(to) - start.max(from);
            if overlap > 0 {
                *bins.entry(start).or_default() += bytes * overlap as f64 / span;
            }
            start += bin;
        }
    }
    Arrivals {
        bin_ms: bin,
        bins: bins
            .into_iter()
            .map(|(s, b)| (s, b.round() as u64))
            .filter(|b| b.1 > 0)
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn second_agent_on_one_data_dir_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let _c = Catalog::open(d.path()).await.unwrap();
        let e = Catalog::open(d.path()).await.unwrap_err();
        assert!(e.to_string().contains("already in use"), "{e}");
    }

    #[tokio::test]
    async fn pause_and_final_states_are_not_undone_by_the_transfer_task() {
        let d = tempfile::tempdir().unwrap();
        let c = Catalog::open(d.path()).await.unwrap();
        let state_of = |id| {
            let c = c.clone();
            async move { c.transfer(id).await.unwrap().unwrap().state }
        };
        let id = c
            .insert_transfer("l", "j", "/ck/s1", "s1", Class::Scheduled)
            .await
            .unwrap();
        c.set_transfer_state(id, TransferState::Paused, None)
            .await
            .unwrap();
        for s in [TransferState::Active, TransferState::Verifying] {
            c.set_transfer_state(id, s, None).await.unwrap();
            assert_eq!(state_of(id).await, TransferState::Paused, "after {s}");
        }
        c.set_transfer_state(id, TransferState::Queued, None)
            .await
            .unwrap();
        assert_eq!(state_of(id).await, TransferState::Queued, "resumed");
        c.set_transfer_state(id, TransferState::Active, None)
            .await
            .unwrap();
        assert_eq!(state_of(id).await, TransferState::Active);
        c.set_transfer_state(id, TransferState::Paused, None)
            .await
            .unwrap();
        c.set_transfer_state(id, TransferState::Cancelled, Some("by hand"))
            .await
            .unwrap();
        let t = c.transfer(id).await.unwrap().unwrap();
        assert_eq!(
            t.state,
            TransferState::Cancelled,
            "a paused transfer can be cancelled"
        );
        let finished = t.finished_at;
        assert!(finished.is_some());
        for s in [
            TransferState::Active,
            TransferState::Verifying,
            TransferState::Queued,
            TransferState::Failed,
        ] {
            c.set_transfer_state(id, s, Some("late")).await.unwrap();
            let t = c.transfer(id).await.unwrap().unwrap();
            assert_eq!(t.state, TransferState::Cancelled, "after {s}");
            assert_eq!(
                (t.error.as_deref(), t.finished_at),
                (Some("by hand"), finished)
            );
        }
        // A paused transfer may still fail.
        let id = c
            .insert_transfer("l", "j", "/ck/s2", "s2", Class::Scheduled)
            .await
            .unwrap();
        c.set_transfer_state(id, TransferState::Paused, None)
            .await
            .unwrap();
        c.set_transfer_state(id, TransferState::Failed, Some("gone"))
            .await
            .unwrap();
        assert_eq!(state_of(id).await, TransferState::Failed);
    }

    #[tokio::test]
    async fn transfer_progress_never_moves_backwards() {
        let d = tempfile::tempdir().unwrap();
        let c = Catalog::open(d.path()).await.unwrap();
        let id = c
            .insert_transfer("l", "j", "/ck/s1", "s1", Class::Scheduled)
            .await
            .unwrap();
        let row = |c: Catalog| async move {
            let t = c.transfer(id).await.unwrap().unwrap();
            (t.bytes_total, t.bytes_done, t.bytes_sent, t.shards)
        };
        let note = |total, done, sent| ProgressNote {
            bytes_total: total,
            bytes_done: done,
            bytes_sent: sent,
        };
        // A checkpoint being written: the size known so far grows.
        c.note_transfer_progress(id, note(100, 40, 50))
            .await
            .unwrap();
        assert_eq!(row(c.clone()).await, (100, 40, 50, 0));
        // A later run that knows less (it just started) changes nothing.
        c.note_transfer_progress(id, note(60, 10, 20))
            .await
            .unwrap();
        assert_eq!(row(c.clone()).await, (100, 40, 50, 0));
        c.note_transfer_progress(id, note(150, 400, 160))
            .await
            .unwrap();
        assert_eq!(row(c.clone()).await, (150, 150, 160, 0), "done <= total");
        // The sealed size is exact; what is done stays within it.
        c.set_transfer_size(id, 120, 3).await.unwrap();
        assert_eq!(row(c.clone()).await, (120, 120, 160, 3));
        c.set_transfer_size(id, 200, 3).await.unwrap();
        assert_eq!(row(c.clone()).await, (200, 120, 160, 3));
    }

    #[tokio::test]
    async fn transfer_and_replica_rows_roundtrip() {
        let d = tempfile::tempdir().unwrap();
        let c = Catalog::open(d.path()).await.unwrap();
        let id = c
            .insert_transfer("l", "j", "/ck/s1", "s1", Class::Scheduled)
            .await
            .unwrap();
        c.set_transfer_state(id, TransferState::Active, None)
            .await
            .unwrap();
        assert_eq!(c.unfinished_transfers().await.unwrap().len(), 1);
        assert_eq!(
            c.transfer_state_counts().await.unwrap(),
            vec![(TransferState::Active, 1)]
        );
        c.set_transfer_published(id, "ab", "/eval/x").await.unwrap();
        assert_eq!(
            c.transfer_state_counts().await.unwrap(),
            vec![(TransferState::Published, 1)]
        );
        let t = c.transfer(id).await.unwrap().unwrap();
        assert_eq!(t.state, TransferState::Published);
        assert!(t.started_at.is_some() && t.finished_at.is_some());
        assert!(c.unfinished_transfers().await.unwrap().is_empty());

        let files = vec![FileInfo {
            path: "a".into(),
            size: 5,
            mode: 0o644,
            mtime_ns: 1,
        }];
        let r = c
            .insert_replica(&NewReplica {
                peer: "p",
                source_site: "s",
                source_transfer: id,
                job: "j",
                source_path: "/ck/s1",
                rel: "s1",
                chunk_size: 1 << 20,
                files: &files,
                bytes_total: 5,
                staging_path: "/st",
                local_path: "/eval/x",
                profile: Profile::WeightsOnly,
            })
            .await
            .unwrap();
        assert_eq!(c.replica_files(r).await.unwrap(), files);
        c.add_chunks(&[vc(r, 0, [7; 32], 5)]).await.unwrap();
        c.add_chunks(&[vc(r, 0, [7; 32], 5)]).await.unwrap();
        assert_eq!(c.chunks(r).await.unwrap(), vec![(0, [7; 32])]);
        assert_eq!(
            c.replica_state_counts().await.unwrap(),
            vec![(TransferState::Receiving, 1)]
        );
        let times = SourceTimes {
            committed_ms: now_ms() - 2_000,
            opened_ms: now_ms() - 5_000,
        };
        let stored_lag = c
            .set_replica_published(r, b"m", "ab", "/eval/x", 5, times)
            .await
            .unwrap();
        assert_eq!(
            c.replica_state_counts().await.unwrap(),
            vec![(TransferState::Published, 1)]
        );
        assert!(c.chunks(r).await.unwrap().is_empty());
        let rep = c.replica_by_local_path("/eval/x").await.unwrap().unwrap();
        assert_eq!(rep.bytes_done, 5);
        assert_eq!(rep.profile, Profile::WeightsOnly);
        assert_eq!(rep.committed_at, Some(times.committed_ms));
        let lag = rep.commit_to_replica_s.unwrap();
        assert_eq!(stored_lag, Some(lag), "the lag returned is the one stored");
        let open = rep.open_to_replica_s.unwrap();
        assert!(
            (2.0..60.0).contains(&lag) && (5.0..60.0).contains(&open),
            "{lag} {open}"
        );
        assert_eq!(c.replica_manifest(r).await.unwrap().unwrap(), b"m");
    }

    async fn replica_for(c: &Catalog, id: TransferId) -> i64 {
        c.insert_replica(&NewReplica {
            peer: "p",
            source_site: "s",
            source_transfer: id,
            job: "j",
            source_path: "/ck/s1",
            rel: "s1",
            chunk_size: 1 << 20,
            files: &[],
            bytes_total: 10,
            staging_path: "/st",
            local_path: "/eval/x",
            profile: Profile::Full,
        })
        .await
        .unwrap()
    }

    fn vc(replica: i64, key: u64, hash: Hash, bytes: u64) -> VerifiedChunk {
        VerifiedChunk {
            replica,
            key,
            hash,
            bytes,
            arrived_ms: None,
            arrival_started_ms: None,
        }
    }

    #[test]
    fn a_chunk_s_bytes_are_spread_over_its_arrival() {
        // 300 bytes from 1005 to 1035: 5/30, 10/30, 10/30, 5/30 of them in
        // the bins at 1000, 1010, 1020, 1030; a chunk with no start time
        // lands in its last byte's bin.
        let a = spread_arrivals(&[(Some(1005), 1035, 300), (None, 1021, 7)]);
        assert_eq!(a.bin_ms, 10);
        assert_eq!(
            a.bins,
            vec![(1000, 50), (1010, 100), (1020, 107), (1030, 50)]
        );
        assert_eq!(a.bytes_between(1000, 1040), 307);
        // A long transfer gets wider bins.
        let long = spread_arrivals(&[(Some(0), 1, 1), (None, 500_000, 1)]);
        assert_eq!(long.bin_ms, 100);
    }

    #[tokio::test]
    async fn add_chunks_records_arrival_time_and_length() {
        let d = tempfile::tempdir().unwrap();
        let c = Catalog::open(d.path()).await.unwrap();
        let r = replica_for(&c, TransferId(1)).await;
        let before = now_ms();
        c.add_chunks(&[vc(r, 0, [1; 32], 7), vc(r, 1, [2; 32], 3)])
            .await
            .unwrap();
        let after = now_ms();
        // A repeat keeps the first arrival and does not count twice.
        c.add_chunks(&[vc(r, 0, [1; 32], 99)]).await.unwrap();
        // An arrival time given is kept as given.
        c.add_chunks(&[VerifiedChunk {
            arrived_ms: Some(before - 5_003),
            ..vc(r, 2, [3; 32], 4)
        }])
        .await
        .unwrap();
        assert_eq!(
            c.chunk_arrivals(r).await.unwrap().bins.first(),
            Some(&((before - 5_003) / 10 * 10, 4))
        );
        let rows: Vec<(i64, Option<i64>, Option<i64>)> = sqlx::query_as(
            "SELECT idx, verified_at, bytes FROM chunks WHERE replica = ? AND idx < 2 ORDER BY idx",
        )
        .bind(r)
        .fetch_all(&c.pool)
        .await
        .unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[0].0, rows[0].2), (0, Some(7)));
        assert_eq!((rows[1].0, rows[1].2), (1, Some(3)));
        for (_, at, _) in &rows {
            let at = at.unwrap();
            assert!((before..=after).contains(&at), "{before} {at} {after}");
        }
        assert_eq!(c.replica(r).await.unwrap().unwrap().bytes_done, 14);
    }

    #[tokio::test]
    async fn signals_are_idempotent_by_key() {
        let d = tempfile::tempdir().unwrap();
        let c = Catalog::open(d.path()).await.unwrap();
        let (s1, new) = c
            .insert_signal("j", "loss_spike", 0.8, Some(1200), Some("k1"))
            .await
            .unwrap();
        assert!(new);
        assert_eq!(
            (s1.job.as_str(), s1.kind.as_str(), s1.severity, s1.step),
            ("j", "loss_spike", 0.8, Some(1200))
        );
        assert_eq!(s1.idempotency_key.as_deref(), Some("k1"));
        assert_eq!(s1.transfer, None);
        // The retry returns the first signal and inserts nothing.
        let (again, new) = c
            .insert_signal("j", "nan", 0.1, None, Some("k1"))
            .await
            .unwrap();
        assert!(!new);
        assert_eq!(again, s1);
        // Without a key every signal is new.
        let (s2, new2) = c
            .insert_signal("j", "manual", 1.0, None, None)
            .await
            .unwrap();
        let (s3, new3) = c
            .insert_signal("k", "manual", 0.0, None, None)
            .await
            .unwrap();
        assert!(new2 && new3);
        assert!(s1.id < s2.id && s2.id < s3.id);

        let ids = |v: Vec<Signal>| v.into_iter().map(|s| s.id).collect::<Vec<_>>();
        assert_eq!(
            ids(c.recent_signals(10).await.unwrap()),
            [s3.id, s2.id, s1.id]
        );
        assert_eq!(ids(c.recent_signals(2).await.unwrap()), [s3.id, s2.id]);
        assert!(c.recent_signals(-1).await.unwrap().is_empty());
        assert_eq!(ids(c.signals_page(2, 1).await.unwrap()), [s2.id, s1.id]);
        assert_eq!(
            ids(c.signals_since(s1.received_at).await.unwrap()),
            [s1.id, s2.id, s3.id]
        );
        assert!(c.signals_since(now_ms() + 60_000).await.unwrap().is_empty());

        c.set_signal_transfer(s2.id, TransferId(42)).await.unwrap();
        let got = c.recent_signals(3).await.unwrap();
        assert_eq!(got[1].transfer, Some(TransferId(42)));
        assert_eq!(got[0].transfer, None);

        for (sev, what) in [
            (1.5, "severity"),
            (f64::NAN, "severity"),
            (-0.1, "severity"),
        ] {
            let e = c
                .insert_signal("j", "x", sev, None, None)
                .await
                .unwrap_err();
            assert!(
                matches!(e, CatalogError::Invalid(_)) && e.to_string().contains(what),
                "{e}"
            );
        }
        let e = c.insert_signal("", "x", 0.5, None, None).await.unwrap_err();
        assert!(e.to_string().contains("job"), "{e}");
        let e = c.insert_signal("j", "", 0.5, None, None).await.unwrap_err();
        assert!(e.to_string().contains("kind"), "{e}");
        assert_eq!(c.recent_signals(100).await.unwrap().len(), 3);
    }

    #[tokio::test]
    async fn api_jobs_survive_config_sync() {
        let d = tempfile::tempdir().unwrap();
        let c = Catalog::open(d.path()).await.unwrap();
        c.sync_config_jobs(&[("a".into(), Some(7e10), 0.8), ("b".into(), Some(0.0), 0.2)])
            .await
            .unwrap();
        let a = c.job("a").await.unwrap().unwrap();
        assert_eq!(
            (a.model_params, a.importance, a.origin.as_str()),
            (Some(7e10), 0.8, origin::CONFIG)
        );
        // 0 parameters is an unknown size.
        assert_eq!(c.job("b").await.unwrap().unwrap().model_params, None);
        assert_eq!(c.job("zzz").await.unwrap(), None);

        let put = c.put_job("a", None, 1.0).await.unwrap();
        assert_eq!(
            (put.model_params, put.importance, put.origin.as_str()),
            (None, 1.0, origin::API)
        );
        assert_eq!(c.job("a").await.unwrap().unwrap(), put);

        // A restart with changed config: the API row keeps its values, the
        // config row follows the file, a new config job is added.
        c.sync_config_jobs(&[
            ("a".into(), Some(1e9), 0.1),
            ("b".into(), Some(1e9), 0.3),
            ("c".into(), None, 0.0),
        ])
        .await
        .unwrap();
        assert_eq!(c.job("a").await.unwrap().unwrap(), put);
        let b = c.job("b").await.unwrap().unwrap();
        assert_eq!((b.model_params, b.importance), (Some(1e9), 0.3));
        let names: Vec<String> = c
            .jobs()
            .await
            .unwrap()
            .into_iter()
            .map(|j| j.name)
            .collect();
        assert_eq!(names, ["a", "b", "c"]);

        // Setting it again through the API replaces the API values.
        let put2 = c.put_job("a", Some(3e9), 0.5).await.unwrap();
        assert_eq!((put2.model_params, put2.importance), (Some(3e9), 0.5));

        // Bad values name the job and field; nothing of the batch is written.
        let e = c
            .sync_config_jobs(&[("b".into(), None, 0.9), ("d".into(), None, 1.5)])
            .await
            .unwrap_err();
        assert!(e.to_string().contains("\"d\" importance"), "{e}");
        assert_eq!(c.job("b").await.unwrap().unwrap().importance, 0.3);
        assert_eq!(c.job("d").await.unwrap(), None);
        let e = c
            .sync_config_jobs(&[("e".into(), Some(-1.0), 0.5)])
            .await
            .unwrap_err();
        assert!(e.to_string().contains("\"e\" model_params"), "{e}");
        let e = c.put_job("a", Some(f64::INFINITY), 0.5).await.unwrap_err();
        assert!(e.to_string().contains("model_params"), "{e}");
        // Regression: 1e308 parameters was accepted (size term 150).
        let e = c.put_job("a", Some(1e308), 0.5).await.unwrap_err();
        assert!(
            e.to_string().contains("model_params") && e.to_string().contains("1e15"),
            "{e}"
        );
        assert!(c.put_job("z", Some(MAX_MODEL_PARAMS), 0.5).await.is_ok());
        let e = c.put_job("a", None, f64::NAN).await.unwrap_err();
        assert!(e.to_string().contains("importance"), "{e}");
        let e = c.put_job("../x", None, 0.5).await.unwrap_err();
        assert!(e.to_string().contains("job name"), "{e}");
        assert_eq!(c.job("a").await.unwrap().unwrap(), put2);
    }

    #[tokio::test]
    async fn class_importance_and_urgent_promotion() {
        let d = tempfile::tempdir().unwrap();
        let c = Catalog::open(d.path()).await.unwrap();
        let id = c
            .insert_transfer("l", "j", "/ck/s1", "s1", Class::Scheduled)
            .await
            .unwrap();
        let t = c.transfer(id).await.unwrap().unwrap();
        assert_eq!((t.importance, t.urgent_until, t.signal), (None, None, None));

        c.promote_urgent(id, 1_000_000, 7).await.unwrap();
        let t = c.transfer(id).await.unwrap().unwrap();
        assert_eq!(t.class, Class::Scheduled);
        assert_eq!((t.urgent_until, t.signal), (Some(1_000_000), Some(7)));

        c.set_transfer_class(id, Class::Background).await.unwrap();
        let t = c.transfer(id).await.unwrap().unwrap();
        assert_eq!(t.class, Class::Background);
        assert_eq!((t.urgent_until, t.signal), (None, None));

        assert_eq!(
            c.transfer(id).await.unwrap().unwrap().class,
            Class::Background
        );
        // A class the types cannot hold (written by another version, or by
        // hand) is an error naming the column, not a silent default.
        sqlx::query("UPDATE transfers SET class = 'soon' WHERE id = ?")
            .bind(id.as_i64())
            .execute(&c.pool)
            .await
            .unwrap();
        let e = c.transfer(id).await.unwrap_err().to_string();
        assert!(e.contains("class") && e.contains("soon"), "{e}");
        c.set_transfer_class(id, Class::Background).await.unwrap();

        c.set_transfer_importance(id, Some(0.7)).await.unwrap();
        assert_eq!(c.transfer(id).await.unwrap().unwrap().importance, Some(0.7));
        let e = c.set_transfer_importance(id, Some(2.0)).await.unwrap_err();
        assert!(e.to_string().contains("importance"), "{e}");
        assert_eq!(c.transfer(id).await.unwrap().unwrap().importance, Some(0.7));
        c.set_transfer_importance(id, None).await.unwrap();
        assert_eq!(c.transfer(id).await.unwrap().unwrap().importance, None);
    }

    #[tokio::test]
    async fn newest_unpublished_skips_final_transfers_and_keeps_paused() {
        let d = tempfile::tempdir().unwrap();
        let c = Catalog::open(d.path()).await.unwrap();
        assert_eq!(c.newest_unpublished_transfer("j").await.unwrap(), None);
        let mut ids = Vec::new();
        // (created_at, state): the newest is published, the one with the
        // largest id was created earlier.
        for (n, (created, st)) in [
            (3_000, TransferState::Paused),
            (2_000, TransferState::Queued),
            (4_000, TransferState::Published),
            (5_000, TransferState::Cancelled),
            (6_000, TransferState::Failed),
        ]
        .into_iter()
        .enumerate()
        {
            let id = c
                .insert_transfer("l", "j", &format!("/ck/s{n}"), "s", Class::Scheduled)
                .await
                .unwrap();
            sqlx::query("UPDATE transfers SET created_at = ?, state = ? WHERE id = ?")
                .bind(created)
                .bind(st.as_str())
                .bind(id.as_i64())
                .execute(&c.pool)
                .await
                .unwrap();
            ids.push(id);
        }
        // Another job's newer transfer does not count.
        let other = c
            .insert_transfer("l", "k", "/ck/o", "o", Class::Scheduled)
            .await
            .unwrap();
        let t = c.newest_unpublished_transfer("j").await.unwrap().unwrap();
        assert_eq!((t.id, t.state), (ids[0], TransferState::Paused));
        assert_eq!(
            c.newest_unpublished_transfer("k")
                .await
                .unwrap()
                .unwrap()
                .id,
            other
        );
        // Paused is not final: it is resumed after a restart.
        assert!(!TransferState::Paused.is_final());
        let unfinished: Vec<TransferId> = c
            .unfinished_transfers()
            .await
            .unwrap()
            .into_iter()
            .map(|t| t.id)
            .collect();
        assert_eq!(unfinished, [ids[0], ids[1], other]);
        // Equal creation times: the larger id is the newer.
        sqlx::query("UPDATE transfers SET created_at = 3000 WHERE id = ?")
            .bind(ids[1].as_i64())
            .execute(&c.pool)
            .await
            .unwrap();
        assert_eq!(
            c.newest_unpublished_transfer("j")
                .await
                .unwrap()
                .unwrap()
                .id,
            ids[1]
        );
        // A newer background copy (logs under the job's root) is not a
        // checkpoint: the signal still promotes the checkpoint.
        let logs = c
            .insert_transfer("l", "j", "/ck/logs", "logs", Class::Background)
            .await
            .unwrap();
        let t = c.newest_unpublished_transfer("j").await.unwrap().unwrap();
        assert_ne!(t.id, logs);
        assert_eq!(t.id, ids[1]);
    }

    #[tokio::test]
    async fn version_2_catalog_migrates_and_keeps_its_rows() {
        let old_files = vec![FileInfo {
            path: "model/a.bin".into(),
            size: 10,
            mode: 0o644,
            mtime_ns: 7,
        }];
        let d = tempfile::tempdir().unwrap();
        let mdir = d.path().join("migrations-v2");
        std::fs::create_dir(&mdir).unwrap();
        std::fs::write(
            mdir.join("0001_catalog.sql"),
            include_str!("../../migrations/0001_catalog.sql"),
        )
        .unwrap();
        std::fs::write(
            mdir.join("0002_checkpoints.sql"),
            include_str!("../../migrations/0002_checkpoints.sql"),
        )
        .unwrap();
        let data = d.path().join("data");
        std::fs::create_dir(&data).unwrap();
        let opts = SqliteConnectOptions::from_str(&format!(
            "sqlite://{}",
            data.join("ferry.db").display()
        ))
        .unwrap()
        .create_if_missing(true);
        let pool = SqlitePoolOptions::new().connect_with(opts).await.unwrap();
        sqlx::migrate::Migrator::new(mdir.as_path())
            .await
            .unwrap()
            .run(&pool)
            .await
            .unwrap();
        sqlx::query(
            "INSERT INTO transfers (id, link, job, source_path, rel, class, state, created_at) \
             VALUES (5, 'l', 'j', '/ck/s1', 's1', 'scheduled', 'queued', 1000)",
        )
        .execute(&pool)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO replicas (id, peer, source_site, source_transfer, job, source_path, rel, \
             chunk_size, files, state, bytes_total, staging_path, local_path, created_at) \
             VALUES (9, 'p', 's', 5, 'j', '/ck/s1', 's1', 1048576, ?, 'receiving', 10, '/st', \
             '/eval/x', 1000)",
        )
        .bind(serde_json::to_string(&old_files).unwrap())
        .execute(&pool)
        .await
        .unwrap();
        sqlx::query("INSERT INTO chunks (replica, idx, hash) VALUES (9, 0, ?)")
            .bind(&[3u8; 32][..])
            .execute(&pool)
            .await
            .unwrap();
        pool.close().await;

        let c = Catalog::open(&data).await.unwrap();
        // 0004 moved the file table out of the row.
        assert_eq!(c.replica_files(9).await.unwrap(), old_files);
        let t = c.transfer(TransferId(5)).await.unwrap().unwrap();
        assert_eq!((t.class, t.created_at), (Class::Scheduled, 1000));
        assert_eq!((t.importance, t.urgent_until, t.signal), (None, None, None));
        assert_eq!(c.chunks(9).await.unwrap(), vec![(0, [3; 32])]);
        let old: (Option<i64>, Option<i64>) =
            sqlx::query_as("SELECT verified_at, bytes FROM chunks WHERE replica = 9")
                .fetch_one(&c.pool)
                .await
                .unwrap();
        assert_eq!(old, (None, None));
        assert!(c.jobs().await.unwrap().is_empty());
        c.put_job("j", Some(7e9), 0.5).await.unwrap();
        let (s, _) = c.insert_signal("j", "nan", 1.0, None, None).await.unwrap();
        c.promote_urgent(TransferId(5), 2_000, s.id).await.unwrap();
        assert_eq!(
            c.newest_unpublished_transfer("j")
                .await
                .unwrap()
                .unwrap()
                .signal,
            Some(s.id)
        );
        let v: i64 = sqlx::query_scalar("SELECT MAX(version) FROM _sqlx_migrations")
            .fetch_one(&c.pool)
            .await
            .unwrap();
        assert_eq!(v, 4);
        c.close().await;
        drop(c);
        // Opening again applies nothing new and keeps the rows.
        let c = Catalog::open(&data).await.unwrap();
        assert_eq!(c.job("j").await.unwrap().unwrap().importance, 0.5);
    }
}
