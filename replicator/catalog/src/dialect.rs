//! What differs between the SQL databases the catalog can live in: how
//! one is opened and how a statement is written for it. Every statement
//! goes through [`Dialect::sql`]; nothing else in the crate names a
//! database.

use std::borrow::Cow;
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use sqlx::any::{AnyConnectOptions, AnyPoolOptions};
use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{AnyConnection, AnyPool, ConnectOptions, Connection, Executor};

/// A database the catalog can live in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// SQLite, one file in the agent's data directory (the default).
    Sqlite,
}

impl Dialect {
    /// `sql` written for this dialect. Statements are written with `?`
    /// placeholders, which SQLite takes as they are (no copy); PostgreSQL
    /// will number them here.
    pub fn sql(self, sql: &str) -> Cow<'_, str> {
        match self {
            Dialect::Sqlite => Cow::Borrowed(sql),
        }
    }
}

/// Pragmas set on every SQLite connection: write-ahead logging (readers
/// never wait for the writer), `NORMAL` sync (durable at each checkpoint
/// of the log, the WAL mode's recommended level), foreign keys enforced,
/// and up to 5 s of waiting for a lock before `SQLITE_BUSY`.
const SQLITE_PRAGMAS: &str = "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; \
    PRAGMA foreign_keys = ON; PRAGMA busy_timeout = 5000;";

/// Opens the SQLite catalog file `db` (created if missing unless
/// `read_only`) as a pool of 4 connections (1 when read-only).
///
/// # Errors
/// sqlx errors opening the file or setting the pragmas.
pub(crate) async fn open_sqlite(db: &Path, read_only: bool) -> Result<AnyPool, sqlx::Error> {
    sqlx::any::install_default_drivers();
    let url = SqliteConnectOptions::new()
        .filename(db)
        .create_if_missing(!read_only)
        .read_only(read_only)
        .to_url_lossy();
    let opts = AnyConnectOptions::from_str(url.as_str())?;
    let pragmas = if read_only {
        "PRAGMA busy_timeout = 5000;"
    } else {
        SQLITE_PRAGMAS
    };
    // One connection first, so that a file that is not a database (or a
    // damaged one) fails here at once: the pool retries a connection whose
    // `after_connect` fails until its acquire timeout (30 s).
    let mut first = AnyConnection::connect_with(&opts).await?;
    first.execute(pragmas).await?;
    first.close().await?;
    AnyPoolOptions::new()
        .max_connections(if read_only { 1 } else { 4 })
        .acquire_timeout(Duration::from_secs(10))
        .after_connect(move |conn, _| {
            Box::pin(async move {
                conn.execute(pragmas).await?;
                Ok(())
            })
        })
        .connect_with(opts)
        .await
}
