//! The catalog: Ferry's durable state in SQL, one module per table.
//!
//! Source side: [`transfers`], [`jobs`], [`signals`] and [`events`] (the
//! append-only history of the changes the scheduler acts on, exported as a
//! trace by [`Catalog::export_trace`]). Sink side:
//! [`replicas`] (one row per incoming transfer; published rows are
//! replicas) and [`chunks`] (verified chunks in staging, the resume point
//! after a crash). Each module owns its row types; the API converts them
//! to its own types, so the schema of the REST API and of the catalog can
//! change apart.
//!
//! Values are typed at this boundary ([`convert`]): states, classes and
//! profiles are enums everywhere else, stored as their names; a stored
//! name this version does not know is a decode error naming the column.
//!
//! # Dialects
//!
//! Queries run through sqlx's `Any` driver, so one implementation serves
//! every database: SQLite in the data directory (WAL mode), the embedded
//! default for a single agent ([`Catalog::open`]), or PostgreSQL, one
//! database per site ([`Catalog::open_postgres`], `[catalog] url` in the
//! agent's config). Everything that differs between dialects lives in
//! [`dialect`]: how a database is opened (for SQLite: the file, its
//! pragmas, the agent lock; for PostgreSQL: the URL, its password kept
//! out of every message, the site check), and [`dialect::Dialect::sql`],
//! which every statement passes through and which numbers the `?`
//! placeholders for PostgreSQL (`$1`, `$2`, ...). Statements use only SQL
//! that both dialects accept (`RETURNING`, `ON CONFLICT ... DO UPDATE`,
//! `COALESCE`); the scalar minimum and maximum are
//! [`dialect::Dialect::least`] and [`dialect::Dialect::greatest`].
//! Migrations are embedded, one folder per dialect with the same schema:
//! `migrations/sqlite/` and `migrations/postgres/` (which also records
//! the site, `0007_site.sql`). The crate's tests are one conformance
//! suite: each runs on SQLite and on a fresh PostgreSQL database of the
//! server at `FERRY_TEST_PG_URL` (started by `ops/test`).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::fcntl::{Flock, FlockArg};
use sqlx::AnyPool;

pub mod chunks;
mod convert;
mod copy;
pub mod dialect;
pub mod events;
mod export;
pub mod jobs;
pub mod leases;
pub mod notify;
pub mod parts;
pub mod phases;
pub mod pin_requests;
pub mod pool;
pub mod publish_leases;
pub mod replica_events;
pub mod replicas;
pub mod settings;
pub mod signals;
#[cfg(test)]
mod tests;
pub mod transfers;
pub mod watches;

use dialect::Dialect;
pub use dialect::{redact_url_passwords, PostgresUrl};

pub use chunks::{Arrivals, VerifiedChunk, ARRIVAL_BIN_MS, MAX_ARRIVAL_BINS};
pub use copy::{CopyCounts, COPIED_TABLES};
pub use events::{Change, Event, EventKind};
pub use export::TraceExport;
pub use jobs::{origin, Job, MAX_MODEL_PARAMS};
pub use leases::{LeaseProblem, ReaderLease, LEASE_MEMORY_MS};
pub use parts::{
    Claimable, PartClaim, PartClaimRecord, PartEpoch, PartFileRead, PartRange, PartRow, PartState,
    PartsStatus, TransferPlan,
};
pub use pin_requests::PinRequestRow;
pub use pool::{AgentState, Beat, Claim, Forget, Heartbeat, LeaseRecord, PoolAgent};
pub use publish_leases::{PublishClaim, PublishHolder};
pub use replica_events::{ReplicaEvent, REPLICA_EVENT_DAYS};
pub use replicas::{
    CheckpointMeta, HotHint, NewReplica, Pin, PublishedReplica, Removal, RemovalReason, Replica,
    SourceTimes,
};
pub use settings::{PoolListener, Setting, POOL_CHANNEL};
pub use signals::Signal;
pub use transfers::{
    DeadlineState, NewWatchedTransfer, ProgressNote, Transfer, UnknownDeadlineState,
};
pub use watches::{RootFingerprint, WatchClaim, WatchLease};

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
    /// The PostgreSQL catalog cannot be reached, refuses the login, or
    /// cannot be migrated. The URL is shown with its password replaced by
    /// `***`, and the message holds no password.
    #[error("catalog {url}: {why}")]
    Database {
        /// The catalog's URL, password redacted.
        url: String,
        /// What went wrong.
        why: String,
    },
    /// The PostgreSQL catalog's server does not answer (no connection,
    /// refused, timed out): it may be starting. Password redacted as in
    /// [`CatalogError::Database`].
    #[error("catalog {url}: {why}")]
    Unreachable {
        /// The catalog's URL, password redacted.
        url: String,
        /// What went wrong.
        why: String,
    },
    /// The PostgreSQL catalog belongs to another site: one database holds
    /// one site's catalog.
    #[error(
        "catalog {url} belongs to site '{catalog_site}', not to this agent's site \
         '{agent_site}': give each site its own database"
    )]
    OtherSite {
        /// The catalog's URL, password redacted.
        url: String,
        /// The site recorded in the catalog.
        catalog_site: String,
        /// The site of the agent that opened it.
        agent_site: String,
    },
    /// Another process runs under this agent's name in the pool (or
    /// took the name over): the message names it.
    #[error("{0}")]
    AgentName(String),
    /// An SQL error.
    #[error("catalog: {}", sql_text(.0))]
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
    /// The catalog did not answer within the time a caller allowed.
    #[error("catalog: no answer within {0:?}")]
    Timeout(std::time::Duration),
}

/// An SQL error's message, with sqlx's connection-pool wording (its own
/// pool of database connections, easy to take for the pool of agents)
/// said plainly.
fn sql_text(e: &sqlx::Error) -> String {
    match e {
        sqlx::Error::PoolTimedOut => format!(
            "no database connection could be had within {} s (the database does not answer, \
             or every connection is busy)",
            dialect::ACQUIRE_TIMEOUT_S
        ),
        sqlx::Error::PoolClosed => {
            "the database connections are closed (the agent is stopping)".into()
        }
        e => e.to_string(),
    }
}

impl CatalogError {
    /// True when the catalog's server did not answer (no connection,
    /// refused, reset, timed out, shutting down) rather than answering
    /// with a refusal: the caller may retry once it is back.
    pub fn is_unavailable(&self) -> bool {
        match self {
            CatalogError::Unreachable { .. } | CatalogError::Timeout(_) => true,
            CatalogError::Sql(e) => match e {
                sqlx::Error::Io(_)
                | sqlx::Error::PoolTimedOut
                | sqlx::Error::PoolClosed
                | sqlx::Error::WorkerCrashed => true,
                // SQLSTATE class 08 (connection exception) and 57P01-57P03
                // (admin shutdown, crash shutdown, cannot connect now), as
                // listed in PostgreSQL's "Errcodes" appendix.
                sqlx::Error::Database(d) => d
                    .code()
                    .is_some_and(|c| c.starts_with("08") || c.starts_with("57P0")),
                _ => false,
            },
            _ => false,
        }
    }
}

/// Milliseconds since the Unix epoch, the catalog's time unit.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_millis() as i64
}

/// Handle to the catalog; cheap to clone.
#[derive(Debug, Clone)]
pub struct Catalog {
    pool: AnyPool,
    db: Dialect,
    /// The catalog's id (`catalog_identity`), read at open.
    id: std::sync::Arc<str>,
    /// The PostgreSQL catalog's address, for [`Catalog::listen_pool`]
    /// (`None` on SQLite).
    url: Option<PostgresUrl>,
    _lock: Option<std::sync::Arc<Flock<File>>>,
}

/// The newest schema version this release knows (its last migration).
pub fn schema_version() -> i64 {
    sqlx::migrate!("../../migrations/postgres")
        .iter()
        .map(|m| m.version)
        .max()
        .unwrap_or(0)
}

/// Refuses a catalog whose schema is newer than `migrator` knows (an
/// agent of a newer release migrated it), naming both versions, before
/// anything is written. A catalog without a schema yet passes.
async fn refuse_newer_schema(
    pool: &AnyPool,
    migrator: &sqlx::migrate::Migrator,
) -> Result<(), String> {
    let known = migrator.iter().map(|m| m.version).max().unwrap_or(0);
    // No table yet: a new catalog.
    let Ok(newest) =
        sqlx::query_scalar::<_, Option<i64>>("SELECT MAX(version) FROM _sqlx_migrations")
            .fetch_one(pool)
            .await
    else {
        return Ok(());
    };
    match newest {
        Some(v) if v > known => Err(format!(
            "its schema is version {v}, newer than this agent's {known} (ferry {}): an agent \
             of a newer release migrated it; upgrade this agent",
            env!("CARGO_PKG_VERSION")
        )),
        _ => Ok(()),
    }
}

/// Makes the catalog's id if it has none yet (a random 128-bit value,
/// hex) and returns the one it has.
async fn identity(pool: &AnyPool, db: Dialect) -> Result<String, sqlx::Error> {
    let fresh: [u8; 16] = rand::random();
    let hex: String = fresh.iter().map(|b| format!("{b:02x}")).collect();
    sqlx::query(&db.sql(
        "INSERT INTO catalog_identity (id, catalog_id) VALUES (1, ?) ON CONFLICT (id) DO NOTHING",
    ))
    .bind(hex)
    .execute(pool)
    .await?;
    sqlx::query_scalar(&db.sql("SELECT catalog_id FROM catalog_identity WHERE id = 1"))
        .fetch_one(pool)
        .await
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
        let pool = dialect::open_sqlite(&db, false)
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
        let migrator = sqlx::migrate!("../../migrations/sqlite");
        refuse_newer_schema(&pool, &migrator)
            .await
            .map_err(|e| file(e.to_string()))?;
        migrator
            .run(&pool)
            .await
            .map_err(|e| file(format!("cannot migrate it: {e}")))?;
        let id = identity(&pool, Dialect::Sqlite)
            .await
            .map_err(|e| file(format!("cannot record its id: {e}")))?;
        Ok(Catalog {
            pool,
            db: Dialect::Sqlite,
            id: id.into(),
            url: None,
            _lock: Some(std::sync::Arc::new(lock)),
        })
    }

    /// Opens (migrating if needed) the PostgreSQL catalog at `url` for an
    /// agent of `site`. The first agent to open a catalog records its
    /// site; an agent of another site is refused. No lock is taken: agents
    /// of one site may share the database.
    ///
    /// # Errors
    /// [`CatalogError::Unreachable`] when the server does not answer at
    /// all; [`CatalogError::Database`] (URL and message without the password)
    /// if the server cannot be reached, refuses the login or the catalog
    /// cannot be migrated; [`CatalogError::OtherSite`] naming both sites.
    pub async fn open_postgres(url: &PostgresUrl, site: &str) -> Result<Catalog, CatalogError> {
        let db_err = |why: String| CatalogError::Database {
            url: url.to_string(),
            why: url.redact(&why),
        };
        let pool = dialect::open_postgres(url)
            .await
            .map_err(|(e, unanswered)| {
                if unanswered {
                    CatalogError::Unreachable {
                        url: url.to_string(),
                        why: url.redact(&format!("cannot connect: {e}")),
                    }
                } else {
                    // A refused login names where the password came from.
                    let from = url.password_file().map_or(String::new(), |f| {
                        format!(
                            " (the password was read from password_file {})",
                            f.display()
                        )
                    });
                    db_err(format!("cannot connect: {e}{from}"))
                }
            })?;
        let migrator = sqlx::migrate!("../../migrations/postgres");
        if let Err(e) = refuse_newer_schema(&pool, &migrator).await {
            pool.close().await;
            return Err(db_err(e.to_string()));
        }
        migrator
            .run(&pool)
            .await
            .map_err(|e| db_err(format!("cannot migrate it: {e}")))?;
        let db = Dialect::Postgres;
        sqlx::query(&db.sql(
            "INSERT INTO catalog_site (id, site, recorded_at) VALUES (1, ?, ?) \
             ON CONFLICT (id) DO NOTHING",
        ))
        .bind(site)
        .bind(now_ms())
        .execute(&pool)
        .await
        .map_err(|e| db_err(format!("cannot record the site: {e}")))?;
        let recorded: String =
            sqlx::query_scalar(&db.sql("SELECT site FROM catalog_site WHERE id = 1"))
                .fetch_one(&pool)
                .await
                .map_err(|e| db_err(format!("cannot read the site: {e}")))?;
        if recorded != site {
            pool.close().await;
            return Err(CatalogError::OtherSite {
                url: url.to_string(),
                catalog_site: recorded,
                agent_site: site.to_string(),
            });
        }
        let id = identity(&pool, db)
            .await
            .map_err(|e| db_err(format!("cannot record its id: {e}")))?;
        Ok(Catalog {
            pool,
            db,
            id: id.into(),
            url: Some(url.clone()),
            _lock: None,
        })
    }

    /// The catalog's id: made at its first open (128 random bits, hex),
    /// kept by `ferry catalog migrate`; sources send it with each open
    /// (wire protocol 5) so the sink keys transfers by catalog, not by
    /// agent. Empty for an old catalog opened read-only.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The site recorded in a PostgreSQL catalog (`None` for SQLite,
    /// which records none).
    ///
    /// # Errors
    /// SQL errors.
    pub async fn site(&self) -> Result<Option<String>, CatalogError> {
        match self.db {
            Dialect::Sqlite => Ok(None),
            Dialect::Postgres => Ok(sqlx::query_scalar(
                &self.db.sql("SELECT site FROM catalog_site WHERE id = 1"),
            )
            .fetch_optional(&self.pool)
            .await?),
        }
    }

    /// The database this catalog lives in.
    pub fn dialect(&self) -> Dialect {
        self.db
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
        let pool = dialect::open_sqlite(&db, true).await?;
        // A catalog of an older release has no identity table.
        let id: Option<String> =
            sqlx::query_scalar("SELECT catalog_id FROM catalog_identity WHERE id = 1")
                .fetch_optional(&pool)
                .await
                .unwrap_or(None);
        Ok(Catalog {
            pool,
            db: Dialect::Sqlite,
            id: id.unwrap_or_default().into(),
            url: None,
            _lock: None,
        })
    }

    /// Closes the pool, waiting for queries in flight.
    pub async fn close(&self) {
        self.pool.close().await;
    }
}
