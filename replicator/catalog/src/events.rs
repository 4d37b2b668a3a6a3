//! Source side: the `events` table, the append-only history of the
//! changes the scheduler acts on (ARCHITECTURE.md, "Recorded events").
//!
//! Each row is written by the catalog function that makes the change, in
//! the same transaction: a transfer queued ([`Catalog::insert_transfer`],
//! [`Catalog::insert_watched_transfer`]), an operator's class or importance
//! change ([`Catalog::reprioritise_transfer`]), pause, resume or cancel
//! ([`Catalog::pause_transfer`], [`Catalog::resume_transfer`],
//! [`Catalog::cancel_transfer`]), a job's size or importance changed
//! ([`Catalog::put_job`], [`Catalog::sync_config_jobs`],
//! [`Catalog::seed_config_jobs`]), a signal
//! ([`Catalog::insert_signal`]) and a link's rate cap
//! ([`Catalog::record_link_rate`], [`Catalog::sync_config_link_rates`];
//! on a single agent the rate lives in memory, so the row is its only
//! record; in a pool the `settings` table holds it too, see
//! [`crate::settings`]). A change that
//! fails writes no row, and a row is never written without its change.
//!
//! Not recorded: a signal's promotion of a transfer to `urgent` (a replay
//! derives it from the signal under the policy it replays), failures, and
//! the agent's own state changes (active, verifying, published, a watched
//! checkpoint abandoned or deleted).

use std::fmt;
use std::str::FromStr;

use ferry_proto::state::TransferId;
use scheduler::Class;
use sqlx::any::AnyRow;
use sqlx::{AnyConnection, Row};

use crate::convert::{parsed, transfer_id_opt};
use crate::dialect::Dialect;
use crate::{Catalog, CatalogError};

/// What a recorded change was (the `kind` column).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// A transfer was queued.
    Arrival,
    /// An operator cancelled a transfer.
    Cancel,
    /// An operator set a transfer's class.
    Class,
    /// An operator set or cleared a transfer's importance override.
    Importance,
    /// A job's size or importance changed.
    Job,
    /// An operator paused a transfer.
    Pause,
    /// A link's rate cap changed.
    Rate,
    /// An operator resumed a paused transfer.
    Resume,
    /// A training controller's signal was stored.
    Signal,
}

impl EventKind {
    /// Every kind, in the order of the enum.
    pub const ALL: [EventKind; 9] = [
        EventKind::Arrival,
        EventKind::Cancel,
        EventKind::Class,
        EventKind::Importance,
        EventKind::Job,
        EventKind::Pause,
        EventKind::Rate,
        EventKind::Resume,
        EventKind::Signal,
    ];

    /// The kind's name as stored (and as the trace format's `event`).
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Arrival => "arrival",
            EventKind::Cancel => "cancel",
            EventKind::Class => "class",
            EventKind::Importance => "importance",
            EventKind::Job => "job",
            EventKind::Pause => "pause",
            EventKind::Rate => "rate",
            EventKind::Resume => "resume",
            EventKind::Signal => "signal",
        }
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A stored event kind this version does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown event kind {0:?} (this version knows arrival, cancel, class, importance, job, pause, rate, resume, signal)")]
pub struct UnknownEventKind(pub String);

impl FromStr for EventKind {
    type Err = UnknownEventKind;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        EventKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| UnknownEventKind(s.to_string()))
    }
}

/// A change the scheduler acts on, with exactly the fields its kind has.
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    /// A transfer was queued; its class, job and own importance as they
    /// were then.
    Arrival {
        /// The transfer.
        transfer: TransferId,
        /// Link it goes over.
        link: String,
        /// Job.
        job: String,
        /// Class it was queued in.
        class: Class,
        /// Its own importance 0..1 (`None`: the job's counts).
        importance: Option<f64>,
        /// Payload bytes, if known when it was queued (`None`: not yet,
        /// e.g. a pushed directory is listed when its run starts and a
        /// watched checkpoint is still being written).
        bytes: Option<u64>,
    },
    /// An operator cancelled a transfer.
    Cancel {
        /// The transfer.
        transfer: TransferId,
    },
    /// An operator set a transfer's class (which also ends a promotion by
    /// a signal, so it is recorded even when the class is the same).
    Class {
        /// The transfer.
        transfer: TransferId,
        /// The class set.
        class: Class,
    },
    /// An operator set (or with `None` cleared) a transfer's importance.
    Importance {
        /// The transfer.
        transfer: TransferId,
        /// The override 0..1 (`None`: the job's counts again).
        importance: Option<f64>,
    },
    /// A job's values changed (or a job was added).
    Job {
        /// Job name.
        job: String,
        /// Model size in parameters (`None`: unknown).
        model_params: Option<f64>,
        /// Importance 0..1.
        importance: f64,
    },
    /// An operator paused a transfer.
    Pause {
        /// The transfer.
        transfer: TransferId,
    },
    /// A link's rate cap changed.
    Rate {
        /// Link name.
        link: String,
        /// The new cap, bit/s (at least 1).
        rate_bps: u64,
    },
    /// An operator resumed a paused transfer.
    Resume {
        /// The transfer.
        transfer: TransferId,
    },
    /// A training controller's signal was stored.
    Signal {
        /// Job it is about.
        job: String,
        /// What was seen (`loss_spike`, ...).
        kind: String,
        /// Severity 0..1 when received.
        severity: f64,
    },
}

impl Change {
    /// Its kind.
    pub fn kind(&self) -> EventKind {
        match self {
            Change::Arrival { .. } => EventKind::Arrival,
            Change::Cancel { .. } => EventKind::Cancel,
            Change::Class { .. } => EventKind::Class,
            Change::Importance { .. } => EventKind::Importance,
            Change::Job { .. } => EventKind::Job,
            Change::Pause { .. } => EventKind::Pause,
            Change::Rate { .. } => EventKind::Rate,
            Change::Resume { .. } => EventKind::Resume,
            Change::Signal { .. } => EventKind::Signal,
        }
    }

    /// The transfer it is about, if it is about one.
    pub fn transfer(&self) -> Option<TransferId> {
        match self {
            Change::Arrival { transfer, .. }
            | Change::Cancel { transfer }
            | Change::Class { transfer, .. }
            | Change::Importance { transfer, .. }
            | Change::Pause { transfer }
            | Change::Resume { transfer } => Some(*transfer),
            Change::Job { .. } | Change::Rate { .. } | Change::Signal { .. } => None,
        }
    }
}

/// A recorded change: one row of the `events` table.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// Row id; orders events recorded in the same millisecond.
    pub id: i64,
    /// When the change was made, Unix ms (the source's clock).
    pub at_ms: i64,
    /// What changed.
    pub change: Change,
}

/// The columns of an `events` row, in [`EVENT_COLS`] order after `id`
/// and `at_ms`.
#[derive(Default)]
struct Columns<'a> {
    transfer: Option<i64>,
    link: Option<&'a str>,
    job: Option<&'a str>,
    class: Option<&'static str>,
    importance: Option<f64>,
    model_params: Option<f64>,
    bytes: Option<i64>,
    rate_bps: Option<i64>,
    severity: Option<f64>,
    signal_kind: Option<&'a str>,
}

/// The columns of `events` as read back, for `SELECT` (prefixed `e.` so
/// they can be joined with other tables).
pub(crate) const EVENT_COLS: &str = "e.id, e.at_ms, e.kind, e.transfer, e.link, e.job, \
    e.class, e.importance, e.model_params, e.bytes, e.rate_bps, e.severity, e.signal_kind";

fn columns(c: &Change) -> Columns<'_> {
    let id = |t: &TransferId| Some(t.as_i64());
    match c {
        Change::Arrival {
            transfer,
            link,
            job,
            class,
            importance,
            bytes,
        } => Columns {
            transfer: id(transfer),
            link: Some(link),
            job: Some(job),
            class: Some(class.as_str()),
            importance: *importance,
            // Sizes above i64::MAX bytes do not exist; saturate rather
            // than wrap if one is ever claimed.
            bytes: bytes.map(|b| i64::try_from(b).unwrap_or(i64::MAX)),
            ..Columns::default()
        },
        Change::Cancel { transfer } | Change::Pause { transfer } | Change::Resume { transfer } => {
            Columns {
                transfer: id(transfer),
                ..Columns::default()
            }
        }
        Change::Class { transfer, class } => Columns {
            transfer: id(transfer),
            class: Some(class.as_str()),
            ..Columns::default()
        },
        Change::Importance {
            transfer,
            importance,
        } => Columns {
            transfer: id(transfer),
            importance: *importance,
            ..Columns::default()
        },
        Change::Job {
            job,
            model_params,
            importance,
        } => Columns {
            job: Some(job),
            model_params: *model_params,
            importance: Some(*importance),
            ..Columns::default()
        },
        Change::Rate { link, rate_bps } => Columns {
            link: Some(link),
            rate_bps: Some(i64::try_from(*rate_bps).unwrap_or(i64::MAX)),
            ..Columns::default()
        },
        Change::Signal {
            job,
            kind,
            severity,
        } => Columns {
            job: Some(job),
            severity: Some(*severity),
            signal_kind: Some(kind),
            ..Columns::default()
        },
    }
}

/// Appends `change`, made at `at_ms` (Unix ms), on `conn`: the caller's
/// transaction, so the row commits or rolls back with the change.
///
/// # Errors
/// SQL errors.
pub(crate) async fn record(
    db: Dialect,
    conn: &mut AnyConnection,
    at_ms: i64,
    change: &Change,
) -> Result<(), sqlx::Error> {
    let c = columns(change);
    sqlx::query(&db.sql(
        "INSERT INTO events (at_ms, kind, transfer, link, job, class, importance, model_params, \
         bytes, rate_bps, severity, signal_kind) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    ))
    .bind(at_ms)
    .bind(change.kind().as_str())
    .bind(c.transfer)
    .bind(c.link)
    .bind(c.job)
    .bind(c.class)
    .bind(crate::convert::real(c.importance))
    .bind(crate::convert::real(c.model_params))
    .bind(c.bytes)
    .bind(c.rate_bps)
    .bind(crate::convert::real(c.severity))
    .bind(c.signal_kind)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// A column a row of this kind must have, else a decode error naming the
/// column and the kind.
fn required<T>(v: Option<T>, col: &'static str, kind: EventKind) -> Result<T, sqlx::Error> {
    v.ok_or_else(|| sqlx::Error::ColumnDecode {
        index: col.into(),
        source: format!("NULL in a {kind} event").into(),
    })
}

/// A non-negative `BIGINT` column as `u64`, else a decode error naming it.
fn unsigned(v: i64, col: &'static str) -> Result<u64, sqlx::Error> {
    u64::try_from(v).map_err(|_| sqlx::Error::ColumnDecode {
        index: col.into(),
        source: format!("negative value {v}").into(),
    })
}

/// A fraction column (importance, severity) within 0..1, else a decode
/// error naming it: a trace carrying it would not parse.
fn fraction(v: Option<f64>, col: &'static str) -> Result<Option<f64>, sqlx::Error> {
    match v {
        Some(x) if !(0.0..=1.0).contains(&x) => Err(sqlx::Error::ColumnDecode {
            index: col.into(),
            source: format!("{x} is outside 0..1").into(),
        }),
        _ => Ok(v),
    }
}

/// An `events` row selected with [`EVENT_COLS`].
pub(crate) fn event_row(r: &AnyRow) -> Result<Event, sqlx::Error> {
    let kind: EventKind = parsed(r, "kind")?;
    let transfer = || required(transfer_id_opt(r, "transfer")?, "transfer", kind);
    let text = |col: &'static str| -> Result<String, sqlx::Error> {
        required(r.try_get::<Option<String>, _>(col)?, col, kind)
    };
    let class = || -> Result<Class, sqlx::Error> {
        required(r.try_get::<Option<String>, _>("class")?, "class", kind)?;
        parsed(r, "class")
    };
    let importance = fraction(r.try_get("importance")?, "importance")?;
    let change = match kind {
        EventKind::Arrival => Change::Arrival {
            transfer: transfer()?,
            link: text("link")?,
            job: text("job")?,
            class: class()?,
            importance,
            bytes: r
                .try_get::<Option<i64>, _>("bytes")?
                .map(|b| unsigned(b, "bytes"))
                .transpose()?,
        },
        EventKind::Cancel => Change::Cancel {
            transfer: transfer()?,
        },
        EventKind::Class => Change::Class {
            transfer: transfer()?,
            class: class()?,
        },
        EventKind::Importance => Change::Importance {
            transfer: transfer()?,
            importance,
        },
        EventKind::Job => Change::Job {
            job: text("job")?,
            model_params: r.try_get("model_params")?,
            importance: required(importance, "importance", kind)?,
        },
        EventKind::Pause => Change::Pause {
            transfer: transfer()?,
        },
        EventKind::Rate => {
            let rate = required(r.try_get("rate_bps")?, "rate_bps", kind)?;
            if rate < 1 {
                return Err(sqlx::Error::ColumnDecode {
                    index: "rate_bps".into(),
                    source: format!("rate {rate} bit/s is below 1").into(),
                });
            }
            Change::Rate {
                link: text("link")?,
                rate_bps: unsigned(rate, "rate_bps")?,
            }
        }
        EventKind::Resume => Change::Resume {
            transfer: transfer()?,
        },
        EventKind::Signal => Change::Signal {
            job: text("job")?,
            kind: text("signal_kind")?,
            severity: required(
                fraction(r.try_get("severity")?, "severity")?,
                "severity",
                kind,
            )?,
        },
    };
    Ok(Event {
        id: r.try_get("id")?,
        at_ms: r.try_get("at_ms")?,
        change,
    })
}

impl Catalog {
    /// Recorded events made at or after `since_ms` (Unix ms), in time
    /// order (by `at_ms`, then by row id).
    ///
    /// # Errors
    /// SQL errors; a row of a kind this version does not know, or missing
    /// a field its kind has, is a decode error naming the column.
    pub async fn events_since(&self, since_ms: i64) -> Result<Vec<Event>, CatalogError> {
        let q =
            format!("SELECT {EVENT_COLS} FROM events e WHERE e.at_ms >= ? ORDER BY e.at_ms, e.id");
        let rows = sqlx::query(&self.db.sql(&q))
            .bind(since_ms)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(event_row).collect::<Result<_, _>>()?)
    }

    /// Records that `link`'s rate cap is now `rate_bps` (bit/s), at the
    /// current time. The cap itself lives in memory (the source's link
    /// scheduler and congestion controller), so this row is its only
    /// durable record: write it before applying the new cap.
    ///
    /// # Errors
    /// [`CatalogError::Invalid`] naming `rate_bps` for 0; SQL errors.
    pub async fn record_link_rate(&self, link: &str, rate_bps: u64) -> Result<(), CatalogError> {
        check_rate(rate_bps)?;
        let mut conn = self.pool.acquire().await?;
        record(
            self.db,
            &mut conn,
            crate::now_ms(),
            &Change::Rate {
                link: link.to_string(),
                rate_bps,
            },
        )
        .await?;
        Ok(())
    }

    /// At start: the configured rate cap of each `(link, rate_bps)` holds
    /// again (a rate set through the API lasts until a restart), so a rate
    /// event is recorded for each link whose last recorded rate differs,
    /// or that has none yet. Returns how many were recorded.
    ///
    /// # Errors
    /// [`CatalogError::Invalid`] naming the link for a rate of 0 (nothing
    /// is written then); SQL errors.
    pub async fn sync_config_link_rates(
        &self,
        links: &[(String, u64)],
    ) -> Result<usize, CatalogError> {
        for (link, rate) in links {
            check_rate(*rate).map_err(|e| CatalogError::Invalid(format!("link {link:?}: {e}")))?;
        }
        let now = crate::now_ms();
        let mut tx = self.pool.begin().await?;
        let mut recorded = 0;
        for (link, rate) in links {
            // One statement, a write first: no read-then-write upgrade of
            // the transaction, which SQLite may refuse under a concurrent
            // writer. The last recorded rate is the last row written.
            let r = sqlx::query(&self.db.sql(
                "INSERT INTO events (at_ms, kind, link, rate_bps) SELECT ?, 'rate', ?, ? \
                 WHERE NOT EXISTS (SELECT 1 FROM events WHERE id = \
                 (SELECT MAX(id) FROM events WHERE kind = 'rate' AND link = ?) AND rate_bps = ?)",
            ))
            .bind(now)
            .bind(link.as_str())
            .bind(i64::try_from(*rate).unwrap_or(i64::MAX))
            .bind(link.as_str())
            .bind(i64::try_from(*rate).unwrap_or(i64::MAX))
            .execute(&mut *tx)
            .await?;
            recorded += r.rows_affected() as usize;
        }
        tx.commit().await?;
        Ok(recorded)
    }
}

fn check_rate(rate_bps: u64) -> Result<(), CatalogError> {
    if rate_bps == 0 {
        return Err(CatalogError::Invalid(
            "rate_bps must be at least 1 bit/s".into(),
        ));
    }
    Ok(())
}
