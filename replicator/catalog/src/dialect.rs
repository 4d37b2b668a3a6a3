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

/// Seconds a catalog call waits for a free database connection (and for a
/// new one to connect) before it fails: [`sqlx::Error::PoolTimedOut`].
pub(crate) const ACQUIRE_TIMEOUT_S: u64 = 10;

/// PostgreSQL ends an agent's session that sits this long (ms) inside a
/// transaction without a statement. An agent cut off from the database
/// mid-transaction (its route silent, the connection not closed) would
/// otherwise keep the transaction's row locks until the server notices
/// the dead connection (TCP keepalive: hours), and the other agents'
/// claims of those transfers and watches would skip them (`SKIP LOCKED`)
/// or wait (`FOR UPDATE`). The catalog's own transactions never pause.
pub const IDLE_IN_TRANSACTION_TIMEOUT_MS: u64 = 5_000;

/// A database the catalog can live in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// SQLite, one file in the agent's data directory (the default).
    Sqlite,
    /// PostgreSQL, one database per site (`[catalog] url`).
    Postgres,
}

impl Dialect {
    /// `sql` written for this dialect. Statements are written with `?`
    /// placeholders, which SQLite takes as they are (no copy); for
    /// PostgreSQL they are numbered `$1`, `$2`, ... in order. A `?`
    /// inside a string literal (`'...'`), a quoted identifier (`"..."`)
    /// or a `--` comment is left as it is.
    pub fn sql(self, sql: &str) -> Cow<'_, str> {
        match self {
            Dialect::Sqlite => Cow::Borrowed(sql),
            Dialect::Postgres => Cow::Owned(number_placeholders(sql)),
        }
    }

    /// The scalar function giving the smaller of its arguments: SQLite's
    /// two-argument `MIN`, PostgreSQL's `LEAST` (where `MIN` is only an
    /// aggregate).
    pub fn least(self) -> &'static str {
        match self {
            Dialect::Sqlite => "MIN",
            Dialect::Postgres => "LEAST",
        }
    }

    /// The scalar function giving the larger of its arguments: SQLite's
    /// two-argument `MAX`, PostgreSQL's `GREATEST`.
    pub fn greatest(self) -> &'static str {
        match self {
            Dialect::Sqlite => "MAX",
            Dialect::Postgres => "GREATEST",
        }
    }

    /// An expression for the database clock's time now, in Unix
    /// milliseconds (`BIGINT`): leases and heartbeats are timed by the
    /// database, so agents whose clocks disagree still agree on who holds
    /// what. PostgreSQL's `clock_timestamp()` (the time the expression is
    /// evaluated, also inside a long transaction); SQLite's `julianday`.
    pub fn now_ms(self) -> &'static str {
        match self {
            Dialect::Sqlite => "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)",
            Dialect::Postgres => "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)",
        }
    }

    /// The clause that locks the rows a `SELECT` reads until the
    /// transaction ends, waiting for other transactions' locks
    /// (PostgreSQL's `FOR UPDATE`); empty for SQLite.
    pub fn lock_for_update(self) -> &'static str {
        match self {
            Dialect::Sqlite => "",
            Dialect::Postgres => " FOR UPDATE",
        }
    }

    /// The clause that locks the rows a `SELECT` reads until the
    /// transaction ends and skips rows another transaction holds
    /// (PostgreSQL's `FOR UPDATE SKIP LOCKED`, the claim of a job
    /// queue); empty for SQLite, whose writers are serialised anyway.
    pub fn lock_skip_locked(self) -> &'static str {
        match self {
            Dialect::Sqlite => "",
            Dialect::Postgres => " FOR UPDATE SKIP LOCKED",
        }
    }

    /// ` FOR SHARE` on PostgreSQL (the rows read are locked against
    /// updates until the transaction ends), nothing on SQLite (one writer
    /// at a time).
    pub fn lock_for_share(self) -> &'static str {
        match self {
            Dialect::Sqlite => "",
            Dialect::Postgres => " FOR SHARE",
        }
    }
}

/// `sql` with each `?` placeholder outside literals, quoted identifiers
/// and `--` comments replaced by `$1`, `$2`, ... (PostgreSQL's form).
fn number_placeholders(sql: &str) -> String {
    #[derive(PartialEq)]
    enum In {
        Code,
        Literal,
        Identifier,
        Comment,
    }
    let mut out = String::with_capacity(sql.len() + 16);
    let mut state = In::Code;
    let mut n = 0u32;
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        match state {
            In::Code => match c {
                '?' => {
                    n += 1;
                    out.push('$');
                    out.push_str(&n.to_string());
                    continue;
                }
                '\'' => state = In::Literal,
                '"' => state = In::Identifier,
                '-' if chars.peek() == Some(&'-') => state = In::Comment,
                _ => {}
            },
            // A doubled quote inside a literal or identifier closes and
            // reopens it: the same state after both characters.
            In::Literal if c == '\'' => state = In::Code,
            In::Identifier if c == '"' => state = In::Code,
            In::Comment if c == '\n' => state = In::Code,
            _ => {}
        }
        out.push(c);
    }
    out
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
        .acquire_timeout(Duration::from_secs(ACQUIRE_TIMEOUT_S))
        .after_connect(move |conn, _| {
            Box::pin(async move {
                conn.execute(pragmas).await?;
                Ok(())
            })
        })
        .connect_with(opts)
        .await
}

/// The address of a PostgreSQL catalog: a `postgres://` (or
/// `postgresql://`) URL, `postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE`
/// with libpq's query options (`sslmode=...`). Shown (`Display`, `Debug`)
/// with its password replaced by `***`, so it can go into logs and errors.
#[derive(Clone, PartialEq, Eq)]
pub struct PostgresUrl {
    url: url::Url,
    /// The file the password was read from, named in login errors.
    password_file: Option<std::path::PathBuf>,
}

impl PostgresUrl {
    /// Parses `s`.
    ///
    /// # Errors
    /// A message (never holding the password) when `s` is not a URL, has
    /// another scheme, or names no host.
    pub fn parse(s: &str) -> Result<PostgresUrl, String> {
        let url = url::Url::parse(s).map_err(|e| {
            format!(
                "not a postgres:// URL ({e}): expected postgres://USER:PASSWORD@HOST:PORT/DATABASE"
            )
        })?;
        let shown = PostgresUrl {
            url,
            password_file: None,
        };
        if !matches!(shown.url.scheme(), "postgres" | "postgresql") {
            return Err(format!(
                "{shown}: the scheme must be postgres:// (or postgresql://), not {}://",
                shown.url.scheme()
            ));
        }
        if shown.url.host_str().is_none_or(str::is_empty) {
            return Err(format!("{shown}: names no host"));
        }
        Ok(shown)
    }

    /// The same URL with `password` as its password (read from a
    /// `password_file`), percent-encoded as a URL needs.
    ///
    /// # Errors
    /// A message if the URL cannot hold a password.
    pub fn with_password(mut self, password: &str) -> Result<PostgresUrl, String> {
        self.url
            .set_password(Some(password))
            .map_err(|()| format!("{self}: cannot hold a password"))?;
        Ok(self)
    }

    /// The same URL with the password read from the file `path` (its
    /// content without one trailing newline), for secrets kept out of the
    /// config file.
    ///
    /// # Errors
    /// A message naming the file (never its content) when it cannot be
    /// read, is empty, or the URL holds a password already.
    pub fn with_password_file(self, path: &Path) -> Result<PostgresUrl, String> {
        if self.has_password() {
            return Err(format!(
                "{self} holds a password and password_file {} gives another: keep one",
                path.display()
            ));
        }
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("password_file {}: {e}", path.display()))?;
        let password = text
            .strip_suffix('\n')
            .map(|p| p.strip_suffix('\r').unwrap_or(p))
            .unwrap_or(&text);
        if password.is_empty() {
            return Err(format!("password_file {} is empty", path.display()));
        }
        let mut with = self.with_password(password)?;
        with.password_file = Some(path.to_path_buf());
        Ok(with)
    }

    /// The file the password was read from ([`PostgresUrl::with_password_file`]),
    /// if any.
    pub fn password_file(&self) -> Option<&Path> {
        self.password_file.as_deref()
    }

    /// Whether the URL holds a password.
    pub fn has_password(&self) -> bool {
        self.url.password().is_some()
    }

    /// `text` with every form of this URL's password (as written,
    /// percent-decoded) replaced by `***`; for messages of the database
    /// driver, which might quote what it was given.
    pub fn redact(&self, text: &str) -> String {
        let Some(encoded) = self.url.password() else {
            return text.to_string();
        };
        let mut out = text.replace(self.url.as_str(), &self.to_string());
        let decoded = url::form_urlencoded::parse(format!("p={encoded}").as_bytes())
            .next()
            .map(|(_, v)| v.into_owned());
        for p in [Some(encoded.to_string()), decoded].into_iter().flatten() {
            if !p.is_empty() {
                out = out.replace(&p, "***");
            }
        }
        out
    }

    /// The same server and login with database `name`.
    pub fn with_database(&self, name: &str) -> PostgresUrl {
        let mut url = self.url.clone();
        url.set_path(&format!("/{name}"));
        PostgresUrl {
            url,
            password_file: self.password_file.clone(),
        }
    }

    /// The same URL with login `user` (and no password).
    pub fn with_user(&self, user: &str) -> PostgresUrl {
        let mut url = self.url.clone();
        // A URL with a host always takes a user name and password.
        let _ = url.set_username(user);
        let _ = url.set_password(None);
        PostgresUrl {
            url,
            password_file: None,
        }
    }

    /// The full URL, password included, for the tests' own connections.
    #[cfg(test)]
    pub(crate) fn secret(&self) -> &str {
        self.url.as_str()
    }

    /// The URL the driver connects with, password included, with two
    /// session settings added unless the URL gives its own:
    /// `application_name=ferry` (every connection of the agent, its pool
    /// and its `LISTEN`, shows as `ferry` in `pg_stat_activity`) and
    /// `idle_in_transaction_session_timeout` of
    /// [`IDLE_IN_TRANSACTION_TIMEOUT_MS`].
    pub(crate) fn secret_named(&self) -> String {
        let mut named = self.url.clone();
        let has =
            |u: &url::Url, key: &str| u.query_pairs().any(|(k, v)| k == key || v.contains(key));
        if !has(&named, "application_name") {
            named
                .query_pairs_mut()
                .append_pair("application_name", "ferry");
        }
        if !has(&named, "idle_in_transaction_session_timeout") {
            named.query_pairs_mut().append_pair(
                "options[idle_in_transaction_session_timeout]",
                &IDLE_IN_TRANSACTION_TIMEOUT_MS.to_string(),
            );
        }
        named.into()
    }
}

impl std::fmt::Display for PostgresUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut shown = self.url.clone();
        if shown.password().is_some() {
            // A URL with a host always takes a password.
            let _ = shown.set_password(Some("***"));
        }
        f.write_str(shown.as_str())
    }
}

/// `text` with the password of every URL in it (`scheme://user:PASSWORD@`)
/// replaced by `***`: for messages that quote input that may hold one,
/// such as a config file's parse error quoting its line.
pub fn redact_url_passwords(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("://") {
        let (head, tail) = rest.split_at(i + 3);
        out.push_str(head);
        // The authority ends at the first '/', whitespace or quote; its
        // user information at the last '@' before that.
        let end = tail
            .find(|c: char| c == '/' || c.is_whitespace() || c == '"' || c == '\'')
            .unwrap_or(tail.len());
        let authority = &tail[..end];
        match authority
            .rfind('@')
            .and_then(|at| authority[..at].find(':').map(|colon| (colon, at)))
        {
            Some((colon, at)) => {
                out.push_str(&authority[..=colon]);
                out.push_str("***");
                out.push_str(&authority[at..]);
            }
            None => out.push_str(authority),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

/// From a string, as [`PostgresUrl::parse`] (config files).
impl<'de> serde::Deserialize<'de> for PostgresUrl {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        PostgresUrl::parse(&s).map_err(serde::de::Error::custom)
    }
}

impl std::fmt::Debug for PostgresUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PostgresUrl({self})")
    }
}

/// How long opening a PostgreSQL catalog waits for its first connection
/// (an unreachable server), in seconds.
pub const POSTGRES_CONNECT_TIMEOUT_S: u64 = 15;

/// Opens the PostgreSQL catalog at `url` as a pool of up to 8
/// connections.
///
/// # Errors
/// A message (its password redacted) when the server cannot be reached
/// within [`POSTGRES_CONNECT_TIMEOUT_S`], refuses the login, or the
/// database does not exist.
///
/// The error says also whether the server did not answer at all (no
/// connection, refused, timed out: it may be starting), as opposed to
/// answering with a refusal (login, database).
pub(crate) async fn open_postgres(url: &PostgresUrl) -> Result<AnyPool, (String, bool)> {
    sqlx::any::install_default_drivers();
    let opts = AnyConnectOptions::from_str(&url.secret_named())
        .map_err(|e| (url.redact(&e.to_string()), false))?;
    // One connection first, so that a wrong address or password fails at
    // once instead of after the pool's acquire timeout.
    let first = tokio::time::timeout(
        Duration::from_secs(POSTGRES_CONNECT_TIMEOUT_S),
        AnyConnection::connect_with(&opts),
    )
    .await
    .map_err(|_| {
        (
            format!("no answer within {POSTGRES_CONNECT_TIMEOUT_S} s"),
            true,
        )
    })?
    .map_err(|e| {
        let unanswered = matches!(e, sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut);
        (url.redact(&e.to_string()), unanswered)
    })?;
    first
        .close()
        .await
        .map_err(|e| (url.redact(&e.to_string()), true))?;
    AnyPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(ACQUIRE_TIMEOUT_S))
        .connect_with(opts)
        .await
        .map_err(|e| (url.redact(&e.to_string()), true))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn placeholders_are_numbered_outside_literals_and_comments() {
        let sql = "SELECT a FROM t WHERE b = ? AND c = '?' AND \"d?\" = ? -- e?\n AND f IN (?, ?) \
                   AND g = 'it''s ?' AND h = ?";
        assert_eq!(
            Dialect::Postgres.sql(sql),
            "SELECT a FROM t WHERE b = $1 AND c = '?' AND \"d?\" = $2 -- e?\n AND f IN ($3, $4) \
             AND g = 'it''s ?' AND h = $5"
        );
        assert_eq!(Dialect::Sqlite.sql(sql), sql, "SQLite takes ? as it is");
        assert_eq!(Dialect::Postgres.sql("a - b - ?"), "a - b - $1");
    }

    #[test]
    fn a_url_shows_no_password() {
        let u = PostgresUrl::parse("postgres://ferry:s%40cret@db.example:5432/site_a").unwrap();
        assert!(u.has_password());
        assert_eq!(u.to_string(), "postgres://ferry:***@db.example:5432/site_a");
        assert!(!format!("{u:?}").contains("cret"));
        assert_eq!(
            u.redact("login s@cret failed; postgres://ferry:s%40cret@db.example:5432/site_a"),
            "login *** failed; postgres://ferry:***@db.example:5432/site_a"
        );
        let from_file = PostgresUrl::parse("postgres://ferry@db.example/site_a")
            .unwrap()
            .with_password("p@ss word/1")
            .unwrap();
        assert_eq!(
            from_file.to_string(),
            "postgres://ferry:***@db.example/site_a"
        );
        assert!(from_file.secret().contains("p%40ss%20word%2F1"));
        assert_eq!(
            redact_url_passwords(
                "line 3: url = \"postgres://u:p@ss@h:5/x\" and s3://k:v@b/o, http://h/x?a=b:c@d"
            ),
            "line 3: url = \"postgres://u:***@h:5/x\" and s3://k:***@b/o, http://h/x?a=b:c@d"
        );
        let e = PostgresUrl::parse("mysql://ferry:hunter2@db/x").unwrap_err();
        assert!(e.contains("scheme") && !e.contains("hunter2"), "{e}");
        let e = PostgresUrl::parse("hunter2").unwrap_err();
        assert!(!e.contains("hunter2"), "{e}");
    }
}
