//! Source side: the `transfers` table, one row per replication of a
//! checkpoint over a link.

use ferry_proto::state::{CheckpointState, Profile, TransferId, TransferState};
use scheduler::Class;
use sqlx::any::AnyRow;
use sqlx::Row;

use crate::convert::{parsed, profile, transfer_id};
use crate::events::{self, Change};
use crate::jobs::check_unit;
use crate::{now_ms, Catalog, CatalogError};

/// Records the arrival of transfer `id`, just inserted on `tx` at `at_ms`
/// in `class`, without an importance override and with its size not yet
/// known (a pushed directory is listed when its run starts; a watched
/// checkpoint is still being written).
async fn record_arrival(
    c: &Catalog,
    tx: &mut sqlx::AnyConnection,
    at_ms: i64,
    id: TransferId,
    link: &str,
    job: &str,
    class: Class,
) -> Result<(), sqlx::Error> {
    let change = Change::Arrival {
        transfer: id,
        link: link.to_string(),
        job: job.to_string(),
        class,
        importance: None,
        bytes: None,
    };
    events::record(c.db, tx, at_ms, &change).await
}

/// A source-side transfer row.
#[derive(Debug, Clone, PartialEq)]
pub struct Transfer {
    /// Transfer id (also sent to the sink).
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
    /// The agent holding the transfer's lease, while the lease is live
    /// by the database clock (see [`Catalog::claim_transfer`]); `None`:
    /// no agent runs it.
    pub holder: Option<String>,
    /// When its replica must be ready (Unix ms), if a client said so: the
    /// time it gave, or the commit time plus
    /// [`Transfer::deadline_after_commit`] once the commit is seen.
    pub deadline_at: Option<i64>,
    /// A deadline given as a duration after the checkpoint's commit, ms.
    pub deadline_after_commit: Option<i64>,
    /// What was said about the deadline: `None` (nothing yet), at risk,
    /// met or missed.
    pub deadline_state: Option<DeadlineState>,
    /// Where the time to eval-ready went ([`crate::phases`]), recorded
    /// when the sink said it published; `None` until then.
    pub phases: Option<ferry_proto::phases::Phases>,
    /// Readers (eval ranks starting at once) its replica should expect,
    /// as an announcement or a push said; `None` when not said.
    pub readers: Option<i64>,
}

impl Transfer {
    /// Its deadline (Unix ms), if it has one and it is known: the time
    /// given, or the commit time plus the duration given once committed.
    pub fn deadline_ms(&self) -> Option<i64> {
        self.deadline_at.or_else(|| {
            self.committed_at
                .zip(self.deadline_after_commit)
                .map(|(c, a)| c.saturating_add(a))
        })
    }
}

/// What was said about a transfer's deadline (the `deadline_state`
/// column). It only moves forward: nothing, then at risk, then met or
/// missed; each is said once ([`Catalog::note_deadline`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DeadlineState {
    /// The fluid model's ready time passed the deadline (`at_risk`).
    AtRisk,
    /// Published at or before the deadline (`met`).
    Met,
    /// Not published by the deadline (`missed`).
    Missed,
}

impl DeadlineState {
    /// The column's text: `at_risk`, `met` or `missed`.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadlineState::AtRisk => "at_risk",
            DeadlineState::Met => "met",
            DeadlineState::Missed => "missed",
        }
    }
}

impl std::fmt::Display for DeadlineState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A `deadline_state` that is not `at_risk`, `met` or `missed`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown deadline state {0:?} (at_risk, met, missed)")]
pub struct UnknownDeadlineState(pub String);

impl std::str::FromStr for DeadlineState {
    type Err = UnknownDeadlineState;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "at_risk" => Ok(DeadlineState::AtRisk),
            "met" => Ok(DeadlineState::Met),
            "missed" => Ok(DeadlineState::Missed),
            o => Err(UnknownDeadlineState(o.into())),
        }
    }
}

/// A transfer of a checkpoint the watcher follows, for
/// [`Catalog::insert_watched_transfer`].
#[derive(Debug, Clone, Copy)]
pub struct NewWatchedTransfer<'a> {
    /// Link name.
    pub link: &'a str,
    /// Job name.
    pub job: &'a str,
    /// Absolute checkpoint path at the source.
    pub source_path: &'a str,
    /// Path relative to the source root.
    pub rel: &'a str,
    /// Scheduler class.
    pub class: Class,
    /// The checkpoint's state now.
    pub checkpoint: CheckpointState,
    /// The format that recognised it (`auto` until known).
    pub format: &'a str,
    /// When it opened (Unix ms), if known.
    pub opened_at: Option<i64>,
    /// When it was committed (Unix ms), if it is.
    pub committed_at: Option<i64>,
    /// Replication profile.
    pub profile: Profile,
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

/// The columns of a [`Transfer`] in `db`'s SQL; `holder` only while its
/// lease is live by the database clock.
fn transfer_cols(db: crate::dialect::Dialect) -> String {
    format!(
        "id, link, job, source_path, rel, class, state, bytes_total, \
         bytes_done, bytes_sent, shards, manifest_root, local_path, error, created_at, \
         started_at, finished_at, checkpoint, format, opened_at, committed_at, \
         commit_identity, profile, importance, urgent_until, signal, \
         deadline_at, deadline_after_commit, deadline_state, phases, readers, \
         CASE WHEN lease_until >= {} THEN holder END AS holder",
        db.now_ms()
    )
}

fn transfer_row(r: &AnyRow) -> Result<Transfer, sqlx::Error> {
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
        holder: r.try_get("holder")?,
        deadline_at: r.try_get("deadline_at")?,
        deadline_after_commit: r.try_get("deadline_after_commit")?,
        deadline_state: r
            .try_get::<Option<String>, _>("deadline_state")?
            .map(|s| {
                s.parse().map_err(|e| sqlx::Error::ColumnDecode {
                    index: "deadline_state".into(),
                    source: Box::new(e),
                })
            })
            .transpose()?,
        phases: crate::phases::column(r.try_get("phases")?)?,
        readers: r.try_get("readers")?,
    })
}

/// Rows of `table` (`transfers` or `replicas`) per state.
pub(crate) async fn state_counts(
    c: &Catalog,
    table: &'static str,
) -> Result<Vec<(TransferState, i64)>, CatalogError> {
    let q = format!("SELECT state, COUNT(*) AS n FROM {table} GROUP BY state ORDER BY state");
    let rows = sqlx::query(&c.db.sql(&q)).fetch_all(&c.pool).await?;
    Ok(rows
        .iter()
        .map(|r| Ok((parsed(r, "state")?, r.try_get("n")?)))
        .collect::<Result<_, sqlx::Error>>()?)
}

impl Catalog {
    /// Sets transfer `id`'s deadline: `at` (Unix ms) or `after_commit`
    /// (ms after its checkpoint's commit; with the commit already seen,
    /// `deadline_at` is set from it at once). `None` for both clears it.
    /// What was said about an earlier deadline is forgotten.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn set_transfer_deadline(
        &self,
        id: TransferId,
        at: Option<i64>,
        after_commit: Option<i64>,
    ) -> Result<(), CatalogError> {
        sqlx::query(&self.db.sql(
            "UPDATE transfers SET deadline_at = COALESCE(?, committed_at + ?), \
             deadline_after_commit = ?, deadline_state = NULL WHERE id = ?",
        ))
        .bind(at)
        .bind(after_commit)
        .bind(after_commit)
        .bind(id.as_i64())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Sets how many readers transfer `id`'s replica should expect
    /// (`None` clears it); sent to the sink with the commit for its
    /// hot-file replication hints.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn set_transfer_readers(
        &self,
        id: TransferId,
        readers: Option<i64>,
    ) -> Result<(), CatalogError> {
        sqlx::query(&self.db.sql("UPDATE transfers SET readers = ? WHERE id = ?"))
            .bind(readers)
            .bind(id.as_i64())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Records that transfer `id`'s deadline is `state`, if that moves it
    /// forward (nothing, then at risk, then met or missed). True if this
    /// call moved it: the caller says it (log, metric), once, even when
    /// several agents of a pool notice together.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn note_deadline(
        &self,
        id: TransferId,
        state: DeadlineState,
    ) -> Result<bool, CatalogError> {
        let from: &[&str] = match state {
            DeadlineState::AtRisk => &[],
            DeadlineState::Met | DeadlineState::Missed => &["at_risk"],
        };
        let mut cond = "deadline_state IS NULL".to_string();
        for f in from {
            cond.push_str(&format!(" OR deadline_state = '{f}'"));
        }
        let r = sqlx::query(&self.db.sql(&format!(
            "UPDATE transfers SET deadline_state = ? WHERE id = ? AND deadline_at IS NOT NULL \
             AND ({cond})"
        )))
        .bind(state.as_str())
        .bind(id.as_i64())
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected() > 0)
    }
    /// Inserts a queued transfer and records its arrival (an `arrival`
    /// event, same transaction, at its `created_at`); returns its id.
    ///
    /// # Errors
    /// SQL errors (nothing is written then).
    pub async fn insert_transfer(
        &self,
        link: &str,
        job: &str,
        source_path: &str,
        rel: &str,
        class: Class,
    ) -> Result<TransferId, CatalogError> {
        let now = now_ms();
        let mut tx = self.pool.begin().await?;
        let r = sqlx::query(&self.db.sql(
            "INSERT INTO transfers (link, job, source_path, rel, class, state, created_at) \
             VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING id",
        ))
        .bind(link)
        .bind(job)
        .bind(source_path)
        .bind(rel)
        .bind(class.as_str())
        .bind(TransferState::Queued.as_str())
        .bind(now)
        .fetch_one(&mut *tx)
        .await?;
        let id = transfer_id(&r, "id")?;
        record_arrival(self, &mut tx, now, id, link, job, class).await?;
        tx.commit().await?;
        Ok(id)
    }

    /// Inserts a queued transfer of a pushed directory, with its size and
    /// file count when they are known at once (a small directory; `None`:
    /// 0 until its run lists it), records its arrival in the same
    /// transaction and returns the new row: one transaction, no read
    /// back (a burst of pushes costs the catalog little each).
    ///
    /// # Errors
    /// SQL errors (nothing is written then).
    pub async fn insert_pushed_transfer(
        &self,
        link: &str,
        job: &str,
        source_path: &str,
        rel: &str,
        class: Class,
        size: Option<(u64, u64)>,
    ) -> Result<Transfer, CatalogError> {
        let now = now_ms();
        let (bytes, shards) = size.map_or((0, 0), |(b, n)| (b as i64, n as i64));
        let mut tx = self.pool.begin().await?;
        let cols = transfer_cols(self.db);
        let q = format!(
            "INSERT INTO transfers (link, job, source_path, rel, class, state, created_at, \
             bytes_total, shards) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING {cols}"
        );
        let r = sqlx::query(&self.db.sql(&q))
            .bind(link)
            .bind(job)
            .bind(source_path)
            .bind(rel)
            .bind(class.as_str())
            .bind(TransferState::Queued.as_str())
            .bind(now)
            .bind(bytes)
            .bind(shards)
            .fetch_one(&mut *tx)
            .await?;
        let t = transfer_row(&r)?;
        record_arrival(self, &mut tx, now, t.id, link, job, class).await?;
        tx.commit().await?;
        Ok(t)
    }

    /// Inserts a queued transfer of a checkpoint the watcher found (or a
    /// controller announced) and records its arrival (an `arrival` event,
    /// same transaction, at its `created_at`); returns its id.
    ///
    /// # Errors
    /// SQL errors (nothing is written then).
    pub async fn insert_watched_transfer(
        &self,
        t: &NewWatchedTransfer<'_>,
    ) -> Result<TransferId, CatalogError> {
        let NewWatchedTransfer {
            link,
            job,
            source_path,
            rel,
            class,
            checkpoint: ckpt,
            format,
            opened_at,
            committed_at,
            profile,
        } = *t;
        let now = now_ms();
        let mut tx = self.pool.begin().await?;
        let r = sqlx::query(&self.db.sql(
            "INSERT INTO transfers (link, job, source_path, rel, class, state, created_at, \
             checkpoint, format, opened_at, committed_at, profile) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
        ))
        .bind(link)
        .bind(job)
        .bind(source_path)
        .bind(rel)
        .bind(class.as_str())
        .bind(TransferState::Queued.as_str())
        .bind(now)
        .bind(ckpt.as_str())
        .bind(format)
        .bind(opened_at)
        .bind(committed_at)
        .bind(profile.stored_name())
        .fetch_one(&mut *tx)
        .await?;
        let id = transfer_id(&r, "id")?;
        record_arrival(self, &mut tx, now, id, link, job, class).await?;
        tx.commit().await?;
        Ok(id)
    }

    /// Records the checkpoint state of a transfer and,
    /// when committed, the commit time (Unix ms) and commit identity; a
    /// deadline given after commit then gets its time (`deadline_at`).
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
        sqlx::query(&self.db.sql(
            "UPDATE transfers SET checkpoint = ?, committed_at = COALESCE(?, committed_at), \
             commit_identity = COALESCE(?, commit_identity), \
             deadline_at = COALESCE(deadline_at, ? + deadline_after_commit) WHERE id = ?",
        ))
        .bind(ckpt.as_str())
        .bind(committed_at)
        .bind(identity)
        .bind(committed_at)
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
        sqlx::query(&self.db.sql("UPDATE transfers SET format = ? WHERE id = ?"))
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
        sqlx::query(
            &self
                .db
                .sql("UPDATE transfers SET opened_at = ? WHERE id = ?"),
        )
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
        let cols = transfer_cols(self.db);
        let q = format!("SELECT {cols} FROM transfers WHERE id = ?");
        let r = sqlx::query(&self.db.sql(&q))
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
        let cols = transfer_cols(self.db);
        let q = format!("SELECT {cols} FROM transfers ORDER BY id DESC LIMIT ? OFFSET ?");
        let rows = sqlx::query(&self.db.sql(&q))
            .bind(limit)
            .bind(offset)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(transfer_row).collect::<Result<_, _>>()?)
    }

    /// The newest `limit` transfers of `job` whose checkpoint was
    /// committed (watched and committed, or pushed), newest first: what
    /// the job's checkpoint size and interval are read from.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn recent_job_transfers(
        &self,
        job: &str,
        limit: i64,
    ) -> Result<Vec<Transfer>, CatalogError> {
        let cols = transfer_cols(self.db);
        let q = format!(
            "SELECT {cols} FROM transfers WHERE job = ? AND checkpoint = ? AND bytes_total > 0 \
             ORDER BY id DESC LIMIT ?"
        );
        let rows = sqlx::query(&self.db.sql(&q))
            .bind(job)
            .bind(CheckpointState::Committed.as_str())
            .bind(limit)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(transfer_row).collect::<Result<_, _>>()?)
    }

    /// Source-side transfers per state (states with none are left out).
    ///
    /// # Errors
    /// SQL errors.
    pub async fn transfer_state_counts(&self) -> Result<Vec<(TransferState, i64)>, CatalogError> {
        state_counts(self, "transfers").await
    }

    /// Transfers not in a final state, oldest first (the work to resume
    /// after a restart).
    ///
    /// # Errors
    /// SQL errors.
    pub async fn unfinished_transfers(&self) -> Result<Vec<Transfer>, CatalogError> {
        let cols = transfer_cols(self.db);
        let q = format!("SELECT {cols} FROM transfers WHERE state NOT IN (?, ?, ?) ORDER BY id");
        let rows = sqlx::query(&self.db.sql(&q))
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
        let cols = transfer_cols(self.db);
        let q =
            format!("SELECT {cols} FROM transfers WHERE source_path = ? ORDER BY id DESC LIMIT 1");
        let r = sqlx::query(&self.db.sql(&q))
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
        let cols = transfer_cols(self.db);
        let q = format!("SELECT {cols} FROM transfers WHERE source_path = ? ORDER BY id");
        let rows = sqlx::query(&self.db.sql(&q))
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
            &self.db.sql("SELECT id FROM transfers WHERE source_path = ? AND id < ? AND state = 'published' LIMIT 1"),
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
    /// changes nothing. Returns whether the transfer took the state (false:
    /// no such transfer, or the write was refused as above), so a run that
    /// finds its transfer paused or cancelled before it started can stop.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn set_transfer_state(
        &self,
        id: TransferId,
        new_state: TransferState,
        error: Option<&str>,
    ) -> Result<bool, CatalogError> {
        let now = now_ms();
        let new_state = new_state.as_str();
        let r = sqlx::query(
            &self.db.sql("UPDATE transfers SET state = ?, error = COALESCE(?, error), \
             started_at = CASE WHEN ? = 'active' AND started_at IS NULL THEN ? ELSE started_at END, \
             finished_at = CASE WHEN ? IN ('published', 'failed', 'cancelled') THEN ? ELSE finished_at END \
             WHERE id = ? AND state NOT IN ('published', 'failed', 'cancelled') \
             AND NOT (state = 'paused' AND ? IN ('active', 'verifying'))"),
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
        Ok(r.rows_affected() > 0)
    }

    /// A run of a transfer starts: the state becomes `active` (stamping
    /// `started_at` on the first) and the last-problem text is cleared, in
    /// one write, with the refusals of [`Catalog::set_transfer_state`]: a
    /// final or `paused` transfer stays as it is. Returns whether it took
    /// the state.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn set_transfer_active(&self, id: TransferId) -> Result<bool, CatalogError> {
        let r = sqlx::query(&self.db.sql(
            "UPDATE transfers SET state = 'active', error = NULL, \
             started_at = COALESCE(started_at, ?) \
             WHERE id = ? AND state NOT IN ('published', 'failed', 'cancelled', 'paused')",
        ))
        .bind(now_ms())
        .bind(id.as_i64())
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected() > 0)
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
        sqlx::query(&self.db.sql("UPDATE transfers SET error = ? WHERE id = ?"))
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
        let least = self.db.least();
        sqlx::query(&self.db.sql(&format!(
            "UPDATE transfers SET bytes_total = ?, shards = ?, bytes_done = {least}(bytes_done, ?) \
             WHERE id = ?",
        )))
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
        let (least, greatest) = (self.db.least(), self.db.greatest());
        sqlx::query(&self.db.sql(&format!(
            "UPDATE transfers SET bytes_total = {greatest}(bytes_total, ?), \
             bytes_done = {least}({greatest}(bytes_done, ?), {greatest}(bytes_total, ?)), \
             bytes_sent = {greatest}(bytes_sent, ?) WHERE id = ?",
        )))
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
    /// A striped transfer's parts forget their chunk hashes and file
    /// versions (kept until the seal; about 2 KiB per 256 MiB part): the
    /// parts and their claims stay, as its record.
    ///
    /// # Errors
    /// SQL errors (nothing changes then).
    pub async fn set_transfer_published(
        &self,
        id: TransferId,
        root_hex: &str,
        local_path: &str,
    ) -> Result<(), CatalogError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(&self.db.sql(
            "UPDATE transfers SET state = 'published', manifest_root = ?, local_path = ?, \
             bytes_done = bytes_total, finished_at = ? WHERE id = ?",
        ))
        .bind(root_hex)
        .bind(local_path)
        .bind(now_ms())
        .bind(id.as_i64())
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            &self
                .db
                .sql("UPDATE transfer_parts SET hashes = NULL, versions = NULL WHERE transfer = ?"),
        )
        .bind(id.as_i64())
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// An operator's change of a transfer's class and/or importance
    /// override, each recorded as its event (`class`, `importance`) in one
    /// transaction with the change. `class` (`urgent`, `scheduled` or
    /// `background`) also ends any promotion by a signal (clears
    /// `urgent_until` and `signal`): the class set by hand is the one that
    /// holds. `importance` `Some(Some(v))` sets the override (0..1),
    /// `Some(None)` clears it (the job's importance holds again). Returns
    /// false, changing and recording nothing, if the transfer does not
    /// exist or has finished (published, failed or cancelled).
    ///
    /// # Errors
    /// [`CatalogError::Invalid`] naming `importance` outside 0..1, or when
    /// there is nothing to change; SQL errors (nothing is written then).
    pub async fn reprioritise_transfer(
        &self,
        id: TransferId,
        class: Option<Class>,
        importance: Option<Option<f64>>,
    ) -> Result<bool, CatalogError> {
        if class.is_none() && importance.is_none() {
            return Err(CatalogError::Invalid(
                "nothing to change: give a class and/or an importance".into(),
            ));
        }
        if let Some(Some(v)) = importance {
            check_unit("importance", v)?;
        }
        let now = now_ms();
        let mut tx = self.pool.begin().await?;
        if let Some(class) = class {
            let r = sqlx::query(&self.db.sql(
                "UPDATE transfers SET class = ?, urgent_until = NULL, signal = NULL \
                 WHERE id = ? AND state NOT IN ('published', 'failed', 'cancelled')",
            ))
            .bind(class.as_str())
            .bind(id.as_i64())
            .execute(&mut *tx)
            .await?;
            if r.rows_affected() == 0 {
                return Ok(false);
            }
            let change = Change::Class {
                transfer: id,
                class,
            };
            events::record(self.db, &mut tx, now, &change).await?;
        }
        if let Some(importance) = importance {
            let r = sqlx::query(&self.db.sql(
                "UPDATE transfers SET importance = ? \
                 WHERE id = ? AND state NOT IN ('published', 'failed', 'cancelled')",
            ))
            .bind(crate::convert::real(importance))
            .bind(id.as_i64())
            .execute(&mut *tx)
            .await?;
            if r.rows_affected() == 0 {
                return Ok(false);
            }
            let change = Change::Importance {
                transfer: id,
                importance,
            };
            events::record(self.db, &mut tx, now, &change).await?;
        }
        tx.commit().await?;
        Ok(true)
    }

    /// An operator pauses a transfer: `paused`, recorded as a `pause`
    /// event in the same transaction. Returns false, changing and
    /// recording nothing, if the transfer does not exist, has finished or
    /// is paused already.
    ///
    /// # Errors
    /// SQL errors (nothing is written then).
    pub async fn pause_transfer(&self, id: TransferId) -> Result<bool, CatalogError> {
        self.operator_state(
            id,
            "UPDATE transfers SET state = 'paused' WHERE id = ? \
             AND state NOT IN ('published', 'failed', 'cancelled', 'paused')",
            None,
            Change::Pause { transfer: id },
        )
        .await
    }

    /// An operator resumes a paused transfer: `queued` again, recorded as
    /// a `resume` event in the same transaction. Returns false, changing
    /// and recording nothing, if the transfer does not exist or is not
    /// paused.
    ///
    /// # Errors
    /// SQL errors (nothing is written then).
    pub async fn resume_transfer(&self, id: TransferId) -> Result<bool, CatalogError> {
        self.operator_state(
            id,
            "UPDATE transfers SET state = 'queued' WHERE id = ? AND state = 'paused'",
            None,
            Change::Resume { transfer: id },
        )
        .await
    }

    /// An operator cancels a transfer: `cancelled` with `why` as its error
    /// text and `finished_at` now, recorded as a `cancel` event in the same
    /// transaction. Returns false, changing and recording nothing, if the
    /// transfer does not exist or has finished.
    ///
    /// # Errors
    /// SQL errors (nothing is written then).
    pub async fn cancel_transfer(&self, id: TransferId, why: &str) -> Result<bool, CatalogError> {
        self.operator_state(
            id,
            "UPDATE transfers SET state = 'cancelled', error = ?, finished_at = ? WHERE id = ? \
             AND state NOT IN ('published', 'failed', 'cancelled')",
            Some(why),
            Change::Cancel { transfer: id },
        )
        .await
    }

    /// Runs `update` (binding `why` and the time first when `why` is
    /// given, then `id`) and, if it changed the row, records `change`, in
    /// one transaction; true if it changed the row.
    async fn operator_state(
        &self,
        id: TransferId,
        update: &str,
        why: Option<&str>,
        change: Change,
    ) -> Result<bool, CatalogError> {
        let now = now_ms();
        let mut tx = self.pool.begin().await?;
        let sql = self.db.sql(update);
        let mut q = sqlx::query(&sql);
        if let Some(why) = why {
            q = q.bind(why).bind(now);
        }
        let r = q.bind(id.as_i64()).execute(&mut *tx).await?;
        if r.rows_affected() == 0 {
            return Ok(false);
        }
        events::record(self.db, &mut tx, now, &change).await?;
        tx.commit().await?;
        Ok(true)
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
        sqlx::query(
            &self
                .db
                .sql("UPDATE transfers SET urgent_until = ?, signal = ? WHERE id = ?"),
        )
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
        let cols = transfer_cols(self.db);
        let q = format!(
            "SELECT {cols} FROM transfers WHERE job = ? AND state NOT IN (?, ?, ?) \
             AND class <> 'background' ORDER BY created_at DESC, id DESC LIMIT 1"
        );
        let r = sqlx::query(&self.db.sql(&q))
            .bind(job)
            .bind(TransferState::Published.as_str())
            .bind(TransferState::Failed.as_str())
            .bind(TransferState::Cancelled.as_str())
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(transfer_row).transpose()?)
    }
}
