//! Sink side: the `replicas` table, one row per incoming transfer (a
//! published row is a replica), with its file table.

use ferry_proto::manifest::FileInfo;
use ferry_proto::state::{Profile, TransferId, TransferState};
use scheduler::Class;
use std::path::Path;

use sqlx::any::AnyRow;
use sqlx::Row;

use crate::convert::{parsed, profile, transfer_id};
use crate::{now_ms, Catalog, CatalogError};

/// A sink-side row: an incoming transfer, or a replica once published.
#[derive(Debug, Clone, PartialEq)]
pub struct Replica {
    /// Row id.
    pub id: i64,
    /// Whose transfer it is: `catalog:<id>` (the source catalog's id, wire
    /// protocol 5 on: any agent of the source's pool continues it), or the
    /// source agent's name (certificate SAN) for an older source.
    pub peer: String,
    /// Source site.
    pub source_site: String,
    /// Transfer id at the source.
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
    /// Training step the source sent at commit (protocol version 3), if
    /// the checkpoint's format names one.
    pub step: Option<i64>,
    /// The transfer's class at commit, as the source sent it (protocol
    /// version 3); `None` from an older source.
    pub class: Option<Class>,
    /// The operator's pin, if pinned.
    pub pin: Option<Pin>,
    /// The removal, once the replica is `removing` or `removed`.
    pub removal: Option<Removal>,
    /// The latest expiry of its reader leases (Unix ms; `None`: never
    /// leased). A version is leased while this is in the future; see
    /// [`crate::leases`].
    pub leased_until: Option<i64>,
    /// When the directory of this version was deleted after a re-save
    /// replaced it (Unix ms); no lease is granted on it after.
    pub version_deleted_at: Option<i64>,
    /// The raised replication of its hot files at an HDFS sink, while
    /// the hint lasts.
    pub hot: Option<HotHint>,
    /// Where the time to eval-ready went ([`crate::phases`]); `None`
    /// before the publish or from an older source.
    pub phases: Option<ferry_proto::phases::Phases>,
    /// A weights-first transfer's row: the id of its weights-only
    /// version's row (made with it at open; `queued` until published at
    /// the commit). `None` elsewhere.
    pub weights_version: Option<i64>,
}

/// A replication hint in force on a replica's hot files (HDFS sink).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HotHint {
    /// The replication factor they were given.
    pub factor: i64,
    /// The factor they had before, restored when the hint ends.
    pub previous: i64,
    /// When the hint ends, Unix ms.
    pub until: i64,
}

impl Replica {
    /// Whether a reader lease holds this version at `now` (Unix ms).
    pub fn leased_at(&self, now: i64) -> bool {
        self.leased_until.is_some_and(|u| u > now)
    }
}

/// An operator's pin on a replica: it never expires, and a removal by hand
/// needs `force`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pin {
    /// When it was pinned (Unix ms).
    pub at: i64,
    /// Until when (Unix ms); `None` = until unpinned.
    pub until: Option<i64>,
    /// Why, as the operator gave it.
    pub reason: String,
}

/// Why a replica was removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RemovalReason {
    /// Its retention policy expired it.
    Rule,
    /// Space pressure.
    Pressure,
    /// An operator removed it by hand.
    Operator,
}

impl RemovalReason {
    /// Every reason, for metrics labels.
    pub const ALL: [RemovalReason; 3] = [
        RemovalReason::Rule,
        RemovalReason::Pressure,
        RemovalReason::Operator,
    ];

    /// The name stored in the catalog and shown in the API and metrics.
    pub const fn as_str(self) -> &'static str {
        match self {
            RemovalReason::Rule => "rule",
            RemovalReason::Pressure => "pressure",
            RemovalReason::Operator => "operator",
        }
    }
}

impl std::fmt::Display for RemovalReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for RemovalReason {
    type Err = ferry_proto::state::UnknownName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RemovalReason::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| ferry_proto::state::UnknownName {
                what: "removal reason",
                got: s.chars().take(100).collect(),
                expected: "rule pressure operator",
            })
    }
}

/// The record of a removal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Removal {
    /// Rule, pressure or operator.
    pub reason: RemovalReason,
    /// The policy that expired it, or the operator's note.
    pub detail: String,
    /// When it left the published namespace (Unix ms).
    pub started_at: i64,
    /// When its files were gone (Unix ms); `None` while `removing`.
    pub finished_at: Option<i64>,
    /// Bytes it held (its manifest's size).
    pub bytes: i64,
    /// An operator removed it past its pin (`force=true`).
    pub forced: bool,
}

/// What a version 3 source said of a checkpoint at commit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CheckpointMeta {
    /// Training step.
    pub step: Option<u64>,
    /// Class at commit.
    pub class: Option<Class>,
    /// Readers the replica should expect, as the source said (protocol
    /// version 7); not stored.
    pub readers: Option<u64>,
}

/// New sink-side row.
#[derive(Debug, Clone)]
pub struct NewReplica<'a> {
    /// Whose transfer it is (see [`Replica::peer`]).
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

/// A publish to record: a sink-side row whose replica is in place and
/// durable ([`Catalog::set_replica_published`], [`Catalog::record_batch`]).
#[derive(Debug, Clone, PartialEq)]
pub struct PublishedReplica {
    /// Sink-side row id.
    pub id: i64,
    /// The sealed manifest, encoded.
    pub manifest: Vec<u8>,
    /// Hex BLAKE3 root of the manifest.
    pub root_hex: String,
    /// Where the replica is.
    pub local_path: String,
    /// Bytes in the replica.
    pub bytes: u64,
    /// When the source opened and committed the checkpoint.
    pub times: SourceTimes,
    /// Step and class at commit.
    pub meta: CheckpointMeta,
    /// Where the replica's time went ([`crate::phases`]), with the
    /// instant its `publishing` phase was measured to: the record adds
    /// the time from that instant to its write, so the phases are in the
    /// publish's transaction and reach its time.
    pub phases: Option<(ferry_proto::phases::Phases, std::time::Instant)>,
}

/// Most rows [`Catalog::replicas_for_source`] returns (the newest).
pub const SAME_SOURCE_ROWS: usize = 16;

/// Ancestor paths per statement of [`Catalog::overlapping_replica`]
/// (SQLite allows 999 placeholders per statement in older builds).
const MAX_ANCESTORS_PER_QUERY: usize = 400;

/// Records publish `p` on `conn` (inside the caller's transaction): the
/// row becomes `published` with its manifest, root, times and the arrival
/// bins of its chunk rows, which are then deleted. Returns the
/// commit-to-replica lag stored, seconds.
pub(crate) async fn publish_in(
    db: crate::dialect::Dialect,
    conn: &mut sqlx::AnyConnection,
    p: &PublishedReplica,
    now: i64,
) -> Result<Option<f64>, CatalogError> {
    let lag = |t: i64| (t > 0).then(|| (now - t) as f64 / 1000.0);
    let known = |t: i64| (t > 0).then_some(t);
    // A write first: a transaction that reads first and writes later
    // fails at once (SQLite's `SQLITE_BUSY`, no waiting) when another
    // connection wrote meanwhile. A row published already (by another
    // sink agent of the pool that took the publish over while this one
    // waited) is left as it is: one publish is recorded once.
    let updated = sqlx::query(&db.sql(
        "UPDATE replicas SET state = 'published', manifest = ?, manifest_root = ?, \
         local_path = ?, bytes_total = ?, bytes_done = ?, published_at = ?, opened_at = ?, \
         committed_at = ?, commit_to_replica_s = ?, open_to_replica_s = ?, step = ?, \
         class = ? WHERE id = ? AND state <> 'published'",
    ))
    .bind(&p.manifest[..])
    .bind(p.root_hex.as_str())
    .bind(p.local_path.as_str())
    .bind(p.bytes as i64)
    .bind(p.bytes as i64)
    .bind(now)
    .bind(known(p.times.opened_ms))
    .bind(known(p.times.committed_ms))
    .bind(crate::convert::real(lag(p.times.committed_ms)))
    .bind(crate::convert::real(lag(p.times.opened_ms)))
    .bind(p.meta.step.and_then(|s| i64::try_from(s).ok()))
    .bind(p.meta.class.map(Class::as_str))
    .bind(p.id)
    .execute(&mut *conn)
    .await?;
    if updated.rows_affected() == 0 {
        return Ok(None);
    }
    if let Some((phases, measured_to)) = &p.phases {
        let mut phases = phases.clone();
        phases.add(
            true,
            ferry_proto::phases::Phase::Publishing,
            measured_to.elapsed(),
        );
        sqlx::query(&db.sql("UPDATE replicas SET phases = ? WHERE id = ?"))
            .bind(crate::phases::encode(&phases))
            .bind(p.id)
            .execute(&mut *conn)
            .await?;
    }
    // Keep when the bytes arrived (in bins) before the chunk rows go.
    let windows = crate::chunks::arrival_bins(db, &mut *conn, p.id).await?;
    let arrivals = serde_json::to_string(&windows)
        .map_err(|e| CatalogError::Corrupt(format!("arrival windows: {e}")))?;
    sqlx::query(&db.sql("UPDATE replicas SET arrivals = ? WHERE id = ?"))
        .bind(arrivals)
        .bind(p.id)
        .execute(&mut *conn)
        .await?;
    sqlx::query(&db.sql("DELETE FROM chunks WHERE replica = ?"))
        .bind(p.id)
        .execute(&mut *conn)
        .await?;
    // A published row takes no more chunks: its parts' epochs go too.
    sqlx::query(&db.sql("DELETE FROM part_epochs WHERE replica = ?"))
        .bind(p.id)
        .execute(&mut *conn)
        .await?;
    crate::replica_events::record_publish(db, conn, p.id, now).await?;
    Ok(lag(p.times.committed_ms))
}

/// Inserts row `n` in `state` (with `weights_version`) inside the
/// caller's transaction, and its file list; returns its id.
async fn insert_in(
    db: crate::dialect::Dialect,
    tx: &mut sqlx::AnyConnection,
    n: &NewReplica<'_>,
    state: TransferState,
    weights_version: Option<i64>,
) -> Result<i64, CatalogError> {
    let files = serde_json::to_string(n.files).map_err(|e| CatalogError::Corrupt(e.to_string()))?;
    let r = sqlx::query(&db.sql(
        "INSERT INTO replicas (peer, source_site, source_transfer, job, source_path, rel, \
         chunk_size, files, state, bytes_total, staging_path, local_path, created_at, profile, \
         weights_version) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
    ))
    .bind(n.peer)
    .bind(n.source_site)
    .bind(n.source_transfer.as_i64())
    .bind(n.job)
    .bind(n.source_path)
    .bind(n.rel)
    .bind(i64::from(n.chunk_size))
    .bind("")
    .bind(state.as_str())
    .bind(n.bytes_total as i64)
    .bind(n.staging_path)
    .bind(n.local_path)
    .bind(now_ms())
    .bind(n.profile.stored_name())
    .bind(weights_version)
    .fetch_one(&mut *tx)
    .await?;
    let id: i64 = r.try_get("id")?;
    sqlx::query(&db.sql("INSERT INTO replica_files (replica, files) VALUES (?, ?)"))
        .bind(id)
        .bind(files)
        .execute(&mut *tx)
        .await?;
    Ok(id)
}

const REPLICA_COLS: &str = "id, peer, source_site, source_transfer, job, source_path, rel, \
    chunk_size, state, bytes_total, bytes_done, staging_path, local_path, manifest_root, error, \
    created_at, published_at, committed_at, commit_to_replica_s, open_to_replica_s, profile, \
    step, class, pinned_at, pinned_until, pin_reason, removal_reason, removal_detail, \
    removal_started_at, removed_at, removed_bytes, removal_forced, leased_until, version_deleted_at, \
    hot_factor, hot_previous, hot_until, phases, weights_version";

fn replica_row(r: &AnyRow) -> Result<Replica, sqlx::Error> {
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
        step: r.try_get("step")?,
        class: r
            .try_get::<Option<String>, _>("class")?
            .map(|_| parsed(r, "class"))
            .transpose()?,
        pin: match r.try_get::<Option<i64>, _>("pinned_at")? {
            Some(at) => Some(Pin {
                at,
                until: r.try_get("pinned_until")?,
                reason: r
                    .try_get::<Option<String>, _>("pin_reason")?
                    .unwrap_or_default(),
            }),
            None => None,
        },
        removal: match r.try_get::<Option<String>, _>("removal_reason")? {
            Some(_) => Some(Removal {
                reason: parsed(r, "removal_reason")?,
                detail: r
                    .try_get::<Option<String>, _>("removal_detail")?
                    .unwrap_or_default(),
                started_at: r
                    .try_get::<Option<i64>, _>("removal_started_at")?
                    .unwrap_or(0),
                finished_at: r.try_get("removed_at")?,
                bytes: r.try_get::<Option<i64>, _>("removed_bytes")?.unwrap_or(0),
                forced: r.try_get::<i64, _>("removal_forced")? != 0,
            }),
            None => None,
        },
        leased_until: r.try_get("leased_until")?,
        version_deleted_at: r.try_get("version_deleted_at")?,
        hot: match (
            r.try_get::<Option<i64>, _>("hot_factor")?,
            r.try_get::<Option<i64>, _>("hot_previous")?,
            r.try_get::<Option<i64>, _>("hot_until")?,
        ) {
            (Some(factor), Some(previous), Some(until)) => Some(HotHint {
                factor,
                previous,
                until,
            }),
            _ => None,
        },
        phases: crate::phases::column(r.try_get("phases")?)?,
        weights_version: r.try_get("weights_version")?,
    })
}

impl Catalog {
    /// Records the replication hint given to replica `id`'s hot files:
    /// `factor` now, `previous` to restore at `until` (Unix ms).
    ///
    /// # Errors
    /// Database errors.
    pub async fn set_replica_hot(
        &self,
        id: i64,
        factor: i64,
        previous: i64,
        until: i64,
    ) -> Result<(), CatalogError> {
        let sql = self.db.sql(
            "UPDATE replicas SET hot_factor = ?, hot_previous = ?, hot_until = ? WHERE id = ?",
        );
        sqlx::query(&sql)
            .bind(factor)
            .bind(previous)
            .bind(until)
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Ends replica `id`'s replication hint (its files are back to the
    /// previous factor, or gone).
    ///
    /// # Errors
    /// Database errors.
    pub async fn clear_replica_hot(&self, id: i64) -> Result<(), CatalogError> {
        let sql = self.db.sql(
            "UPDATE replicas SET hot_factor = NULL, hot_previous = NULL, hot_until = NULL \
             WHERE id = ?",
        );
        sqlx::query(&sql).bind(id).execute(&self.pool).await?;
        Ok(())
    }

    /// Replicas whose replication hint ended at or before `now` (Unix
    /// ms), oldest end first, at most 100.
    ///
    /// # Errors
    /// Database errors.
    pub async fn replicas_hot_ended(&self, now: i64) -> Result<Vec<Replica>, CatalogError> {
        let q = format!(
            "SELECT {REPLICA_COLS} FROM replicas WHERE hot_until IS NOT NULL AND hot_until <= ? \
             ORDER BY hot_until LIMIT 100"
        );
        let rows = sqlx::query(&self.db.sql(&q))
            .bind(now)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(replica_row).collect::<Result<_, _>>()?)
    }

    /// Records verified chunks (as [`Catalog::add_chunks`]) and then
    /// publishes (as [`Catalog::set_replica_published`], in order) in one
    /// transaction: the sink's catalog writer gathers what arrives close
    /// together, so a burst of small transfers costs one commit, not
    /// several per transfer. A publish's chunks may be in the same batch:
    /// they count for its arrival bins. All or nothing: after an error or
    /// a crash, none of the batch is recorded. Returns the
    /// commit-to-replica lag of each publish, seconds.
    ///
    /// # Errors
    /// SQL errors (nothing is recorded then).
    pub async fn record_batch(
        &self,
        chunks: &[crate::chunks::VerifiedChunk],
        published: &[crate::PublishedReplica],
    ) -> Result<Vec<Option<f64>>, CatalogError> {
        let now = now_ms();
        let mut tx = self.pool.begin().await?;
        // One bytes_done update per replica and batch: an UPDATE rewrites
        // the whole row. A row published in this batch gets its total then.
        let mut gained: Vec<(i64, i64)> = Vec::new();
        for c in chunks {
            let r = sqlx::query(&self.db.sql(
                "INSERT INTO chunks (replica, idx, hash, verified_at, bytes, arrival_started) \
                 VALUES (?, ?, ?, ?, ?, ?) \
                 ON CONFLICT DO NOTHING",
            ))
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
            if published.iter().any(|p| p.id == id) {
                continue;
            }
            sqlx::query(
                &self
                    .db
                    .sql("UPDATE replicas SET bytes_done = bytes_done + ? WHERE id = ?"),
            )
            .bind(n)
            .bind(id)
            .execute(&mut *tx)
            .await?;
        }
        let mut lags = Vec::with_capacity(published.len());
        for p in published {
            lags.push(publish_in(self.db, &mut tx, p, now).await?);
        }
        tx.commit().await?;
        Ok(lags)
    }

    /// Sink-side rows (incoming transfers and replicas) per state (states
    /// with none are left out).
    ///
    /// # Errors
    /// SQL errors.
    pub async fn replica_state_counts(&self) -> Result<Vec<(TransferState, i64)>, CatalogError> {
        crate::transfers::state_counts(self, "replicas").await
    }

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
        let r = sqlx::query(&self.db.sql(&q))
            .bind(peer)
            .bind(source_transfer.as_i64())
            .bind(source_path)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(replica_row).transpose()?)
    }

    /// Re-keys row `id` to `peer` (see [`Replica::peer`]): a transfer
    /// first opened by an agent of an older protocol, keyed by its name,
    /// continues under its catalog's key. Returns false if another row
    /// holds that key already.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn set_replica_peer(&self, id: i64, peer: &str) -> Result<bool, CatalogError> {
        let r = sqlx::query(&self.db.sql(
            "UPDATE replicas SET peer = ? WHERE id = ? AND NOT EXISTS \
             (SELECT 1 FROM replicas o WHERE o.peer = ? AND o.source_transfer = replicas.source_transfer \
              AND o.source_path = replicas.source_path)",
        ))
        .bind(peer)
        .bind(id)
        .bind(peer)
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected() > 0)
    }

    /// Inserts an incoming transfer in state `receiving`; returns its id.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn insert_replica(&self, n: &NewReplica<'_>) -> Result<i64, CatalogError> {
        let mut tx = self.pool.begin().await?;
        let id = insert_in(self.db, &mut tx, n, TransferState::Receiving, None).await?;
        tx.commit().await?;
        Ok(id)
    }

    /// Inserts a weights-first transfer's two rows in one transaction:
    /// first its weights-only version's (profile `weights-only`, state
    /// `queued`, peer `n.peer` + `#weights-only`, staging `weights_staging`,
    /// no files, 0 bytes until its publish), then the transfer's own (profile `full`, state
    /// `receiving`, naming the first in [`Replica::weights_version`]), so
    /// the full replica is the newer version. Returns `(transfer row,
    /// weights-only row)`.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn insert_replica_weights_first(
        &self,
        n: &NewReplica<'_>,
        weights_staging: &str,
    ) -> Result<(i64, i64), CatalogError> {
        let peer = format!("{}#weights-only", n.peer);
        let w = NewReplica {
            peer: &peer,
            files: &[],
            // Known at its publish.
            bytes_total: 0,
            staging_path: weights_staging,
            profile: Profile::WeightsOnly,
            ..n.clone()
        };
        let full = NewReplica {
            profile: Profile::Full,
            ..n.clone()
        };
        let mut tx = self.pool.begin().await?;
        let w_id = insert_in(self.db, &mut tx, &w, TransferState::Queued, None).await?;
        let id = insert_in(
            self.db,
            &mut tx,
            &full,
            TransferState::Receiving,
            Some(w_id),
        )
        .await?;
        tx.commit().await?;
        Ok((id, w_id))
    }

    /// The file list stored for a sink-side row.
    ///
    /// # Errors
    /// SQL errors, or [`CatalogError::Corrupt`] if it cannot be decoded.
    pub async fn replica_files(&self, id: i64) -> Result<Vec<FileInfo>, CatalogError> {
        let r = sqlx::query(
            &self
                .db
                .sql("SELECT files FROM replica_files WHERE replica = ?"),
        )
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
        sqlx::query(
            &self
                .db
                .sql("UPDATE replica_files SET files = ? WHERE replica = ?"),
        )
        .bind(s)
        .bind(id)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            &self
                .db
                .sql("UPDATE replicas SET bytes_total = ? WHERE id = ?"),
        )
        .bind(bytes_total as i64)
        .bind(id)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Marks a row published: stores the sealed manifest and its root and
    /// deletes the per-chunk rows (no longer needed). Returns the
    /// commit-to-replica lag it stored, seconds (`None`: commit time
    /// unknown). [`Catalog::record_batch`] records several at once.
    ///
    /// # Errors
    /// SQL errors.
    #[allow(clippy::too_many_arguments)]
    pub async fn set_replica_published(
        &self,
        id: i64,
        manifest: &[u8],
        root_hex: &str,
        local_path: &str,
        bytes: u64,
        times: SourceTimes,
        meta: CheckpointMeta,
    ) -> Result<Option<f64>, CatalogError> {
        let p = PublishedReplica {
            id,
            manifest: manifest.to_vec(),
            root_hex: root_hex.to_string(),
            local_path: local_path.to_string(),
            bytes,
            times,
            meta,
            phases: None,
        };
        let mut tx = self.pool.begin().await?;
        let lag = publish_in(self.db, &mut tx, &p, now_ms()).await?;
        tx.commit().await?;
        Ok(lag)
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
        sqlx::query(
            &self
                .db
                .sql("UPDATE replicas SET state = ?, error = COALESCE(?, error) WHERE id = ?"),
        )
        .bind(new_state.as_str())
        .bind(error)
        .bind(id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Cancels a weights-first transfer's weights-only version `id` with
    /// `reason`, only while it is still `queued` (never published).
    /// Returns whether it was.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn cancel_queued_replica(&self, id: i64, reason: &str) -> Result<bool, CatalogError> {
        let r = sqlx::query(&self.db.sql(
            "UPDATE replicas SET state = 'cancelled', error = ? WHERE id = ? AND state = 'queued'",
        ))
        .bind(reason)
        .bind(id)
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected() > 0)
    }

    /// One sink-side row by id.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn replica(&self, id: i64) -> Result<Option<Replica>, CatalogError> {
        let q = format!("SELECT {REPLICA_COLS} FROM replicas WHERE id = ?");
        let r = sqlx::query(&self.db.sql(&q))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(replica_row).transpose()?)
    }

    /// The sealed manifest of a published row.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn replica_manifest(&self, id: i64) -> Result<Option<Vec<u8>>, CatalogError> {
        let r = sqlx::query(&self.db.sql("SELECT manifest FROM replicas WHERE id = ?"))
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
        self.replicas_in(published.then_some(TransferState::Published), limit, offset)
            .await
    }

    /// Sink-side rows in `state` (any state if `None`), newest first.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn replicas_in(
        &self,
        state: Option<TransferState>,
        limit: i64,
        offset: i64,
    ) -> Result<Vec<Replica>, CatalogError> {
        let q = if state.is_some() {
            format!("SELECT {REPLICA_COLS} FROM replicas WHERE state = ? ORDER BY id DESC LIMIT ? OFFSET ?")
        } else {
            format!("SELECT {REPLICA_COLS} FROM replicas ORDER BY id DESC LIMIT ? OFFSET ?")
        };
        let sql = self.db.sql(&q);
        let mut query = sqlx::query(&sql);
        if let Some(s) = state {
            query = query.bind(s.as_str());
        }
        let rows = query.bind(limit).bind(offset).fetch_all(&self.pool).await?;
        Ok(rows.iter().map(replica_row).collect::<Result<_, _>>()?)
    }

    /// The published versions a retention policy weighs: every `published`
    /// row with no newer published, `removing` or `removed` row at its
    /// `local_path` (an older one was replaced on disk by a re-save),
    /// oldest first.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn current_replicas(&self) -> Result<Vec<Replica>, CatalogError> {
        let q = format!(
            "SELECT {REPLICA_COLS} FROM replicas r WHERE state = 'published' AND NOT EXISTS \
             (SELECT 1 FROM replicas n WHERE n.local_path = r.local_path \
             AND n.state IN ('published', 'removing', 'removed') AND n.id > r.id) ORDER BY id"
        );
        let rows = sqlx::query(&self.db.sql(&q)).fetch_all(&self.pool).await?;
        Ok(rows.iter().map(replica_row).collect::<Result<_, _>>()?)
    }

    /// Rows whose removal began but did not finish (a crash): finished
    /// after a restart.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn replicas_removing(&self) -> Result<Vec<Replica>, CatalogError> {
        self.replicas_in(Some(TransferState::Removing), i64::MAX, 0)
            .await
    }

    /// Takes published replica `id` out of the published namespace: its
    /// state becomes `removing` with the removal's record. False (and
    /// nothing written) when the row is not `published` (removed
    /// meanwhile, say), or a reader lease holds it and the removal is not
    /// `forced` (decided on the row itself, so a lease granted at the same
    /// time either comes first and stops the removal, or finds the row
    /// `removing` and is refused).
    ///
    /// # Errors
    /// SQL errors.
    pub async fn begin_replica_removal(
        &self,
        id: i64,
        reason: RemovalReason,
        detail: &str,
        forced: bool,
        bytes: i64,
    ) -> Result<bool, CatalogError> {
        let now = now_ms();
        let r = sqlx::query(&self.db.sql(
            "UPDATE replicas SET state = 'removing', removal_reason = ?, removal_detail = ?, \
             removal_started_at = ?, removed_bytes = ?, removal_forced = ? \
             WHERE id = ? AND state = 'published' \
             AND (? = 1 OR leased_until IS NULL OR leased_until <= ?)",
        ))
        .bind(reason.as_str())
        .bind(detail)
        .bind(now)
        .bind(bytes)
        .bind(i64::from(forced))
        .bind(id)
        .bind(i64::from(forced))
        .bind(now)
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected() == 1)
    }

    /// Records that the files of `removing` replica `id` are gone. True if
    /// this call recorded it; false if it was recorded already (another
    /// sink agent of the pool finished the same removal).
    ///
    /// # Errors
    /// SQL errors.
    pub async fn finish_replica_removal(&self, id: i64) -> Result<bool, CatalogError> {
        let now = now_ms();
        let mut tx = self.pool.begin().await?;
        let r = sqlx::query(&self.db.sql(
            "UPDATE replicas SET state = 'removed', removed_at = ? WHERE id = ? AND state = 'removing'",
        ))
        .bind(now)
        .bind(id)
        .execute(&mut *tx)
        .await?;
        let recorded = r.rows_affected() > 0;
        if recorded {
            crate::replica_events::record_removed(self.db, &mut tx, id, now).await?;
        }
        tx.commit().await?;
        Ok(recorded)
    }

    /// Pins published replica `id` (`until`: Unix ms, `None` = until
    /// unpinned), replacing an earlier pin. False when no published row
    /// has that id.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn pin_replica(
        &self,
        id: i64,
        until: Option<i64>,
        reason: &str,
    ) -> Result<bool, CatalogError> {
        let r = sqlx::query(&self.db.sql(
            "UPDATE replicas SET pinned_at = ?, pinned_until = ?, pin_reason = ? \
             WHERE id = ? AND state = 'published'",
        ))
        .bind(now_ms())
        .bind(until)
        .bind(reason)
        .bind(id)
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected() == 1)
    }

    /// A re-save of a pinned checkpoint stays pinned: gives published
    /// replica `id` the pin (until, reason) of the version it replaced at
    /// `local_path` (the newest older published row there), if that one
    /// is pinned at `now` (Unix ms) and `id` has no pin. True if it did.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn carry_pin(
        &self,
        id: i64,
        local_path: &str,
        now: i64,
    ) -> Result<bool, CatalogError> {
        let prev: Option<(Option<i64>, Option<i64>, Option<String>)> =
            sqlx::query_as(&self.db.sql(
                "SELECT pinned_at, pinned_until, pin_reason FROM replicas WHERE local_path = ? \
             AND id < ? AND state = 'published' ORDER BY id DESC LIMIT 1",
            ))
            .bind(local_path)
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        let Some((Some(_), until, reason)) = prev else {
            return Ok(false);
        };
        if until.is_some_and(|u| u <= now) {
            return Ok(false);
        }
        let r = sqlx::query(&self.db.sql(
            "UPDATE replicas SET pinned_at = ?, pinned_until = ?, pin_reason = ? \
             WHERE id = ? AND state = 'published' AND pinned_at IS NULL",
        ))
        .bind(now)
        .bind(until)
        .bind(reason.unwrap_or_default())
        .bind(id)
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected() == 1)
    }

    /// Removes the pin of replica `id`, if it has one; true if it had.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn unpin_replica(&self, id: i64) -> Result<bool, CatalogError> {
        let r = sqlx::query(&self.db.sql(
            "UPDATE replicas SET pinned_at = NULL, pinned_until = NULL, pin_reason = NULL \
             WHERE id = ? AND pinned_at IS NOT NULL",
        ))
        .bind(id)
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected() == 1)
    }

    /// Published replicas pinned at `now_ms` (Unix ms), for metrics.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn pinned_replica_count(&self, now_ms: i64) -> Result<i64, CatalogError> {
        let r = sqlx::query(&self.db.sql(
            "SELECT COUNT(*) AS n FROM replicas WHERE state = 'published' \
             AND pinned_at IS NOT NULL AND (pinned_until IS NULL OR pinned_until > ?)",
        ))
        .bind(now_ms)
        .fetch_one(&self.pool)
        .await?;
        Ok(r.try_get("n")?)
    }

    /// The sink-side rows for a checkpoint at `source_path`, newest first
    /// (at most [`SAME_SOURCE_ROWS`]): the newest published one and the
    /// newest one overall tell resolve what to answer.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn replicas_for_source(
        &self,
        source_path: &str,
    ) -> Result<Vec<Replica>, CatalogError> {
        let q = format!(
            "SELECT {REPLICA_COLS} FROM replicas WHERE source_path = ? ORDER BY id DESC LIMIT {SAME_SOURCE_ROWS}"
        );
        let rows = sqlx::query(&self.db.sql(&q))
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
        let ancestors: Vec<String> = Path::new(base)
            .ancestors()
            .skip(1)
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        // One statement for the descendants and every ancestor (a few
        // hundred placeholders at most per statement; a deeper path takes
        // more). `state || ''` keeps SQLite's planner on the `local_path`
        // index: on `state` it would scan every live row.
        let mut groups = ancestors.chunks(MAX_ANCESTORS_PER_QUERY);
        let mut first = true;
        loop {
            let group = groups.next().unwrap_or(&[]);
            if !first && group.is_empty() {
                return Ok(None);
            }
            let mut cond = Vec::new();
            if first {
                // Descendants: paths in [base + "/", base + "0"), "0" being
                // the byte after "/".
                cond.push("(local_path >= ? AND local_path < ?)".to_string());
            }
            if !group.is_empty() {
                cond.push(format!(
                    "local_path IN ({})",
                    vec!["?"; group.len()].join(", ")
                ));
            }
            let q = format!(
                "SELECT local_path FROM replicas WHERE state || '' IN ('receiving', 'published') \
                 AND ({}) LIMIT 1",
                cond.join(" OR ")
            );
            let sql = self.db.sql(&q);
            let mut query = sqlx::query(&sql);
            if first {
                query = query.bind(format!("{base}/")).bind(format!("{base}0"));
            }
            for a in group {
                query = query.bind(a.as_str());
            }
            if let Some(r) = query.fetch_optional(&self.pool).await? {
                return Ok(Some(r.try_get("local_path")?));
            }
            first = false;
        }
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
        let r = sqlx::query(&self.db.sql(&q))
            .bind(local_path)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(replica_row).transpose()?)
    }

    /// Every row at `local_path` as (id, state), oldest first: the
    /// versions a path held, to tell which one replaced which.
    ///
    /// # Errors
    /// SQL errors; [`CatalogError::Corrupt`] for an unknown state.
    pub async fn replica_versions_at(
        &self,
        local_path: &str,
    ) -> Result<Vec<(i64, TransferState)>, CatalogError> {
        let rows: Vec<(i64, String)> = sqlx::query_as(
            &self
                .db
                .sql("SELECT id, state FROM replicas WHERE local_path = ? ORDER BY id"),
        )
        .bind(local_path)
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|(id, st)| {
                st.parse()
                    .map(|st| (id, st))
                    .map_err(|e| CatalogError::Corrupt(format!("replica {id}: {e}")))
            })
            .collect()
    }
}
