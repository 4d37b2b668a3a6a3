//! A transfer striped across a source pool: its plan and parts (the
//! `transfer_plans`, `transfer_parts` and `part_claims` tables,
//! migration 0020).
//!
//! The agent holding a pushed transfer's lease (its coordinator) writes
//! the transfer's file table once and splits its chunks into parts of
//! about `part_size` bytes ([`split_into_parts`]). Any source agent of
//! the pool claims parts ([`Catalog::claim_parts`]): a lease like a
//! transfer's (see [`crate::pool`]), until `lease_until` by the database's
//! clock, renewed with each heartbeat of its holder, every claim under
//! the part's next epoch. A lapsed lease is never renewed: the next
//! claim takes the part over. The holder releases a part once the sink
//! confirmed each of its chunks, recording their hashes and the versions
//! of the files it read ([`Catalog::release_part`]); the coordinator
//! seals the manifest from those rows.

use ferry_proto::manifest::{chunk_count, validate_files, FileInfo, Hash};
use ferry_proto::state::TransferId;
use serde::{Deserialize, Serialize};
use sqlx::Row;

use crate::{Catalog, CatalogError};

/// Bits of a chunk key that hold the chunk index (see
/// [`ferry_proto::manifest::ChunkMap`]).
const KEY_CHUNK_BITS: u32 = 32;

/// One part of a plan: chunk keys `first_key` (included) to `end_key`
/// (excluded), in key order (`file << 32 | chunk`), `bytes` of payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartRange {
    /// The part's number, from 0 in key order.
    pub part: u64,
    /// Its first chunk key.
    pub first_key: u64,
    /// One more than its last chunk key (keys in between that name no
    /// chunk of the file table name none of the part's either).
    pub end_key: u64,
    /// Payload bytes.
    pub bytes: u64,
}

impl PartRange {
    /// Whether chunk key `key` belongs to this part.
    pub fn contains(&self, key: u64) -> bool {
        (self.first_key..self.end_key).contains(&key)
    }
}

/// Splits the chunks of `files` (`chunk_size`-byte chunks) into parts:
/// whole chunks in key order, a part closed once it holds at least
/// `part_size` bytes, so small files are packed together and a large file
/// is split at chunk boundaries. Empty files hold no chunk and belong to
/// no part. A `part_size` below `chunk_size` gives one chunk per part.
pub fn split_into_parts(files: &[FileInfo], chunk_size: u32, part_size: u64) -> Vec<PartRange> {
    split_into_parts_where(files, chunk_size, part_size, |_, _| true)
}

/// As [`split_into_parts`], over only the chunks `send(file, chunk)`
/// keeps (file: position in `files`; chunk: index in the file): a chunk
/// left out closes the part before it, so every chunk of a part's key
/// range is kept. A watched checkpoint striped while it is written or at
/// its commit leaves out the chunks the watching agent already sent and
/// confirmed, and the files still being written.
pub fn split_into_parts_where(
    files: &[FileInfo],
    chunk_size: u32,
    part_size: u64,
    send: impl Fn(u32, u64) -> bool,
) -> Vec<PartRange> {
    let mut parts = Vec::new();
    let mut open: Option<PartRange> = None;
    for (f, info) in files.iter().enumerate() {
        let n = chunk_count(info.size, chunk_size);
        for c in 0..n {
            if !send(f as u32, c) {
                parts.extend(open.take());
                continue;
            }
            let key = (f as u64) << KEY_CHUNK_BITS | c;
            let len = (info.size - c * u64::from(chunk_size)).min(u64::from(chunk_size));
            let p = open.get_or_insert(PartRange {
                part: parts.len() as u64,
                first_key: key,
                end_key: key,
                bytes: 0,
            });
            p.end_key = key + 1;
            p.bytes += len;
            if p.bytes >= part_size {
                parts.extend(open.take());
            }
        }
    }
    parts.extend(open);
    parts
}

/// The file table a plan was made from, as stored (JSON in the `files`
/// column): each file's path, size (bytes), mode and mtime (ns), in the
/// transfer's order, and the indices of its commit markers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct StoredTable {
    files: Vec<(String, u64, u32, i64)>,
    markers: Vec<u32>,
}

/// A transfer's plan (see [`Catalog::plan_transfer`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferPlan {
    /// The transfer.
    pub transfer: TransferId,
    /// Chunk size, bytes.
    pub chunk_size: u32,
    /// The part size the plan was made with, bytes.
    pub part_size: u64,
    /// The file table, in the transfer's order.
    pub files: Vec<FileInfo>,
    /// Indices into `files` of the commit markers, in publish order.
    pub markers: Vec<u32>,
    /// The agent that made it.
    pub planned_by: String,
    /// When it was stored, Unix ms by the database's clock: with
    /// `planned_by`, which plan this is (a dropped plan stored again has
    /// another).
    pub planned_at: i64,
    /// Whether every agent of the pool may claim its parts; false while
    /// only `planned_by` may ([`Catalog::plan_transfer_quietly`],
    /// [`Catalog::announce_plan`]) or only agents whose sink takes
    /// joining opens may ([`Catalog::announce_plan_to_joiners`]).
    pub announced: bool,
    /// Whether an agent whose sink takes joining opens
    /// ([`ferry_proto::wire::Open::joins`]) may claim its parts: the plan
    /// is announced, or announced to such agents.
    pub joinable: bool,
}

/// `transfer_parts.state` of the parts of a plan not yet announced
/// ([`Catalog::plan_transfer_quietly`]): queued, for the plan's maker
/// only. Not `queued`, so that agents from before this state (which
/// claim `queued` parts and lapsed `held` ones, and ignore
/// `transfer_plans.announced`) do not claim them either while a pool is
/// upgraded one agent at a time. [`Catalog::announce_plan`] makes them
/// `queued`.
const QUIET: &str = "quiet";

/// The SQL value the parts of a stopping agent are queued under: `quiet`
/// while their plan is not announced, `queued` after. The plans' rows
/// are not locked here, so a part may stay `quiet` past a concurrent
/// announcement; every claim query of this release takes `quiet` parts
/// of an announced plan too.
pub(crate) const REQUEUED: &str = "CASE WHEN EXISTS (SELECT 1 FROM transfer_plans qp \
     WHERE qp.transfer = transfer_parts.transfer AND qp.announced = 0) \
     THEN 'quiet' ELSE 'queued' END";

/// What a part is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartState {
    /// Waiting for an agent to claim it (stored as `queued`, or as
    /// `quiet` while its plan is not announced and only its maker may
    /// claim it).
    Queued,
    /// Claimed by an agent (its lease may have lapsed).
    Held,
    /// Every chunk verified at the sink; hashes and versions recorded.
    Done,
}

impl PartState {
    fn parse(s: &str) -> Result<PartState, CatalogError> {
        match s {
            "queued" | QUIET => Ok(PartState::Queued),
            "held" => Ok(PartState::Held),
            "done" => Ok(PartState::Done),
            other => Err(CatalogError::Corrupt(format!(
                "transfer_parts.state {other:?} is not queued, held or done"
            ))),
        }
    }
}

/// A part claimed (see [`Catalog::claim_parts`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartClaim {
    /// The part.
    pub range: PartRange,
    /// The claim's epoch: one more than the part's previous claim.
    pub epoch: i64,
    /// The agent whose lease on the part lapsed before this claim (a
    /// takeover).
    pub took_over_from: Option<String>,
}

/// A part as the catalog records it (see [`Catalog::parts`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartRow {
    /// The part.
    pub range: PartRange,
    /// Queued, held or done.
    pub state: PartState,
    /// The agent holding it (held), or that held it last.
    pub holder: Option<String>,
    /// Whether a held part's lease is live now (database clock).
    pub live: bool,
    /// The epoch of its latest claim (0: never claimed).
    pub epoch: i64,
    /// The agent that released it done.
    pub done_by: Option<String>,
    /// Each chunk's BLAKE3 hash in key order (done parts).
    pub hashes: Vec<Hash>,
    /// What the releasing agent saw of each file it read (done parts).
    pub versions: Vec<PartFileRead>,
}

/// What an agent saw of one file of a part it read: the file's size
/// (bytes), mtime (ns) and version token (four words, see the storage
/// seam's `FileVersion`) before and after the read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartFileRead {
    /// The file's position in the plan's file table.
    pub file: u32,
    /// (size, mtime ns, version) before the first chunk was read.
    pub before: (u64, i64, [u64; 4]),
    /// (size, mtime ns, version) after the last chunk was read.
    pub after: (u64, i64, [u64; 4]),
}

/// One claim of a part, from the `part_claims` history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartClaimRecord {
    /// The part.
    pub part: u64,
    /// The claim's epoch.
    pub epoch: i64,
    /// The claiming agent.
    pub agent: String,
    /// When it was claimed, Unix ms (database clock).
    pub claimed_at: i64,
    /// When it ended (released, lapsed at its lease's end, or given
    /// back), Unix ms; `None` while held.
    pub ended_at: Option<i64>,
    /// `released`, `lapsed` or `given back`.
    pub end_reason: Option<String>,
}

/// A transfer with parts left to claim, in claim order (see
/// [`Catalog::claimable_transfers`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claimable {
    /// The transfer.
    pub transfer: TransferId,
    /// Parts queued or whose lease lapsed.
    pub parts: u64,
}

/// Counts of a transfer's parts by state (see [`Catalog::parts_status`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PartsStatus {
    /// Parts in the plan.
    pub total: u64,
    /// Parts done.
    pub done: u64,
    /// Parts held under a live lease.
    pub held: u64,
    /// Parts queued, or held under a lapsed lease: claimable now.
    pub claimable: u64,
}

/// `ids` as an SQL list of integers (`1,2,3`): built from integers, never
/// from text.
fn id_list(ids: &[TransferId]) -> String {
    ids.iter()
        .map(|i| i.as_i64().to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn corrupt(what: &str, e: impl std::fmt::Display) -> CatalogError {
    CatalogError::Corrupt(format!("{what}: {e}"))
}

impl Catalog {
    /// Stores the plan of transfer `id`, made by agent `agent`, if it has
    /// none: its file table (`files` in the transfer's order, `markers`
    /// the indices of its commit markers), `chunk_size`-byte chunks and
    /// the parts [`split_into_parts`] makes of them with `part_size`.
    /// Returns the plan stored: this one, or the one another agent stored
    /// first (a coordinator that took the transfer over continues it).
    ///
    /// # Errors
    /// [`CatalogError::Invalid`] for a file table Ferry would not send;
    /// SQL errors (nothing is stored then).
    pub async fn plan_transfer(
        &self,
        id: TransferId,
        files: &[FileInfo],
        markers: &[u32],
        chunk_size: u32,
        part_size: u64,
        agent: &str,
    ) -> Result<TransferPlan, CatalogError> {
        let parts = split_into_parts(files, chunk_size, part_size.max(1));
        self.plan_transfer_parts(id, files, markers, chunk_size, part_size, agent, &parts)
            .await
    }

    /// As [`Catalog::plan_transfer`], with the parts given (see
    /// [`split_into_parts_where`]): numbered from 0 in key order, each
    /// a key range of `files`' chunks.
    ///
    /// # Errors
    /// [`CatalogError::Invalid`] for a file table Ferry would not send or
    /// parts not numbered 0, 1, ... in key order; SQL errors (nothing is
    /// stored then).
    #[allow(clippy::too_many_arguments)]
    pub async fn plan_transfer_parts(
        &self,
        id: TransferId,
        files: &[FileInfo],
        markers: &[u32],
        chunk_size: u32,
        part_size: u64,
        agent: &str,
        parts: &[PartRange],
    ) -> Result<TransferPlan, CatalogError> {
        self.store_plan(
            id, files, markers, chunk_size, part_size, agent, parts, true,
        )
        .await
    }

    /// As [`Catalog::plan_transfer`], but not announced: until
    /// [`Catalog::announce_plan`], only `agent` may claim its parts and
    /// no other agent is offered the transfer. Its coordinator stores it
    /// this way, sends its open, claims its first parts and sends their
    /// registrations without waiting for the open's answer (one round
    /// trip for both), and announces it once the sink answered the open
    /// (so the sink's row for the transfer exists before any other agent
    /// opens it at another sink agent). Until then its parts are stored
    /// in state `quiet`, which agents from before migration 0021 (they
    /// ignore the flag) do not claim. A plan stored already is returned
    /// as it is. While a quiet plan of a higher class has parts left,
    /// lower classes' parts on its link are not claimed either, as for an
    /// announced one.
    ///
    /// # Errors
    /// As [`Catalog::plan_transfer`].
    pub async fn plan_transfer_quietly(
        &self,
        id: TransferId,
        files: &[FileInfo],
        markers: &[u32],
        chunk_size: u32,
        part_size: u64,
        agent: &str,
    ) -> Result<TransferPlan, CatalogError> {
        let parts = split_into_parts(files, chunk_size, part_size.max(1));
        self.store_plan(
            id, files, markers, chunk_size, part_size, agent, &parts, false,
        )
        .await
    }

    /// Lets every agent of the pool claim the parts of transfer `id`'s
    /// plan and announces it on the pool's channel; true if it was not
    /// announced before (nothing happens otherwise).
    ///
    /// # Errors
    /// SQL errors.
    pub async fn announce_plan(&self, id: TransferId) -> Result<bool, CatalogError> {
        let mut tx = self.pool.begin().await?;
        let n =
            sqlx::query(&self.db.sql(
                "UPDATE transfer_plans SET announced = 1 WHERE transfer = ? AND announced = 0",
            ))
            .bind(id.as_i64())
            .execute(&mut *tx)
            .await?
            .rows_affected();
        if n > 0 {
            sqlx::query(&self.db.sql(
                "UPDATE transfer_parts SET state = 'queued' WHERE transfer = ? AND state = 'quiet'",
            ))
            .bind(id.as_i64())
            .execute(&mut *tx)
            .await?;
            crate::notify::announce(self.db, &mut tx, crate::notify::payload::PLAN).await?;
        }
        tx.commit().await?;
        Ok(n > 0)
    }

    /// Lets the agents of the pool whose sink takes joining opens
    /// ([`ferry_proto::wire::Open::joins`]: their opens wait at the sink
    /// for the coordinator's row instead of racing it) claim the parts of
    /// transfer `id`'s quiet plan, and announces it on the pool's
    /// channel; true if it was quiet before (nothing happens otherwise).
    /// Its parts stay `quiet` and `transfer_plans.announced` 0 (agents
    /// from before migration 0022 read only that: to them the plan is
    /// still quiet, and one that takes the transfer over announces it);
    /// [`Catalog::announce_plan`] opens them to every agent later.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn announce_plan_to_joiners(&self, id: TransferId) -> Result<bool, CatalogError> {
        let mut tx = self.pool.begin().await?;
        let n =
            sqlx::query(&self.db.sql(
                "UPDATE transfer_plans SET joinable = 1 WHERE transfer = ? AND announced = 0 AND joinable = 0",
            ))
            .bind(id.as_i64())
            .execute(&mut *tx)
            .await?
            .rows_affected();
        if n > 0 {
            crate::notify::announce(self.db, &mut tx, crate::notify::payload::PLAN).await?;
        }
        tx.commit().await?;
        Ok(n > 0)
    }

    #[allow(clippy::too_many_arguments)]
    async fn store_plan(
        &self,
        id: TransferId,
        files: &[FileInfo],
        markers: &[u32],
        chunk_size: u32,
        part_size: u64,
        agent: &str,
        parts: &[PartRange],
        announce: bool,
    ) -> Result<TransferPlan, CatalogError> {
        validate_files(files, chunk_size).map_err(|e| CatalogError::Invalid(e.to_string()))?;
        let ordered = parts.iter().enumerate().all(|(i, p)| {
            p.part == i as u64
                && p.first_key < p.end_key
                && (i == 0 || parts[i - 1].end_key <= p.first_key)
        });
        if !ordered {
            return Err(CatalogError::Invalid(
                "a plan's parts must be numbered 0, 1, ... in key order and not overlap".into(),
            ));
        }
        let table = StoredTable {
            files: files
                .iter()
                .map(|f| (f.path.clone(), f.size, f.mode, f.mtime_ns))
                .collect(),
            markers: markers.to_vec(),
        };
        let json = serde_json::to_vec(&table).map_err(|e| CatalogError::Invalid(e.to_string()))?;
        let mut tx = self.pool.begin().await?;
        let q = format!("SELECT {} AS now", self.db.now_ms());
        let now: i64 = sqlx::query_scalar(&q).fetch_one(&mut *tx).await?;
        let r = sqlx::query(&self.db.sql(
            "INSERT INTO transfer_plans (transfer, chunk_size, part_size, files, planned_by, \
             planned_at, announced) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (transfer) DO NOTHING",
        ))
        .bind(id.as_i64())
        .bind(i64::from(chunk_size))
        .bind(part_size as i64)
        .bind(json)
        .bind(agent)
        .bind(now)
        .bind(i64::from(announce))
        .execute(&mut *tx)
        .await?;
        if r.rows_affected() > 0 {
            // After a plan was dropped (a file changed size, or a watched
            // checkpoint's next round of complete files replaced it), the new
            // parts' first claims come after every earlier claim's epoch:
            // the claim history keeps its rows, and the sink refuses an
            // epoch below one it recorded for the same part number.
            let base: i64 = sqlx::query_scalar(&self.db.sql(
                "SELECT CAST(COALESCE(MAX(epoch), 0) AS BIGINT) FROM part_claims WHERE transfer = ?",
            ))
            .bind(id.as_i64())
            .fetch_one(&mut *tx)
            .await?;
            for p in parts {
                sqlx::query(&self.db.sql(
                    "INSERT INTO transfer_parts (transfer, part, first_key, end_key, bytes, \
                     lease_epoch, state) VALUES (?, ?, ?, ?, ?, ?, ?)",
                ))
                .bind(id.as_i64())
                .bind(p.part as i64)
                .bind(p.first_key as i64)
                .bind(p.end_key as i64)
                .bind(p.bytes as i64)
                .bind(base)
                .bind(if announce { "queued" } else { QUIET })
                .execute(&mut *tx)
                .await?;
            }
            // The pool's other agents claim parts at once, not at their
            // next reload of the queue.
            if announce {
                crate::notify::announce(self.db, &mut tx, crate::notify::payload::PLAN).await?;
            }
        }
        tx.commit().await?;
        self.transfer_plan(id)
            .await?
            .ok_or_else(|| CatalogError::Corrupt(format!("the plan of transfer {id} vanished")))
    }

    /// The plan of transfer `id`, if one was stored.
    ///
    /// # Errors
    /// [`CatalogError::Corrupt`] for a stored file table that does not
    /// parse or that Ferry would not send; SQL errors.
    pub async fn transfer_plan(
        &self,
        id: TransferId,
    ) -> Result<Option<TransferPlan>, CatalogError> {
        let Some(row) = sqlx::query(&self.db.sql(
            "SELECT chunk_size, part_size, files, planned_by, planned_at, announced, joinable \
             FROM transfer_plans WHERE transfer = ?",
        ))
        .bind(id.as_i64())
        .fetch_optional(&self.pool)
        .await?
        else {
            return Ok(None);
        };
        let chunk_size = u32::try_from(row.try_get::<i64, _>("chunk_size")?)
            .map_err(|e| corrupt("transfer_plans.chunk_size", e))?;
        let part_size = u64::try_from(row.try_get::<i64, _>("part_size")?)
            .map_err(|e| corrupt("transfer_plans.part_size", e))?;
        let json: Vec<u8> = row.try_get("files")?;
        let table: StoredTable =
            serde_json::from_slice(&json).map_err(|e| corrupt("transfer_plans.files", e))?;
        let files: Vec<FileInfo> = table
            .files
            .into_iter()
            .map(|(path, size, mode, mtime_ns)| FileInfo {
                path,
                size,
                mode,
                mtime_ns,
            })
            .collect();
        validate_files(&files, chunk_size).map_err(|e| corrupt("transfer_plans.files", e))?;
        if table.markers.iter().any(|m| *m as usize >= files.len()) {
            return Err(corrupt(
                "transfer_plans.files",
                "a marker index is not a file index",
            ));
        }
        Ok(Some(TransferPlan {
            transfer: id,
            chunk_size,
            part_size,
            files,
            markers: table.markers,
            planned_by: row.try_get("planned_by")?,
            planned_at: row.try_get("planned_at")?,
            announced: row.try_get::<i64, _>("announced")? != 0,
            joinable: row.try_get::<i64, _>("announced")? != 0
                || row.try_get::<i64, _>("joinable")? != 0,
        }))
    }

    /// Forgets the plan and parts of transfer `id` (its files changed
    /// size: the next run plans it again from a new listing; or a watched
    /// checkpoint's run replaces the plan of its previous round, every
    /// part of it done). Claims' history stays.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn drop_plan(&self, id: TransferId) -> Result<(), CatalogError> {
        let mut tx = self.pool.begin().await?;
        for q in [
            "DELETE FROM transfer_parts WHERE transfer = ?",
            "DELETE FROM transfer_plans WHERE transfer = ?",
        ] {
            sqlx::query(&self.db.sql(q))
                .bind(id.as_i64())
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Sets where transfer `id` stands in the claim order: `class_rank`
    /// (2 urgent, 1 scheduled, 0 background) and `weight` (its score; a
    /// transfer's next part goes before another's of the same class when
    /// its claimed bytes per unit of weight are fewer). False if it has
    /// no plan.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn set_plan_rank(
        &self,
        id: TransferId,
        class_rank: i64,
        weight: f64,
    ) -> Result<bool, CatalogError> {
        let r = sqlx::query(
            &self
                .db
                .sql("UPDATE transfer_plans SET class_rank = ?, weight = ? WHERE transfer = ?"),
        )
        .bind(class_rank)
        .bind(if weight.is_finite() && weight > 0.0 {
            weight
        } else {
            1e-9
        })
        .bind(id.as_i64())
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected() > 0)
    }

    /// Transfers among `ids` (striped transfers of one link) with parts
    /// claimable now (queued, or held under a lapsed lease), in claim
    /// order: those of the highest class rank among them only, fewest
    /// claimed bytes per unit of weight first (fair queuing over parts;
    /// see [`Catalog::set_plan_rank`]). A transfer whose claims
    /// [`Catalog::claim_parts`] would refuse now (a striped transfer of
    /// its link in a higher class rank, among `ids` or not, has parts to
    /// claim) is not listed: an agent offered it would claim nothing;
    /// nor is one whose plan is not announced yet.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn claimable_transfers(
        &self,
        ids: &[TransferId],
    ) -> Result<Vec<Claimable>, CatalogError> {
        self.claimable_transfers_for(ids, false).await
    }

    /// As [`Catalog::claimable_transfers`], for an agent whose sink takes
    /// joining opens (`joins`): plans announced to such agents only
    /// ([`Catalog::announce_plan_to_joiners`]) are listed too.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn claimable_transfers_for(
        &self,
        ids: &[TransferId],
        joins: bool,
    ) -> Result<Vec<Claimable>, CatalogError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let list = id_list(ids);
        let q = format!(
            "SELECT p.transfer AS transfer, COUNT(*) AS n, MAX(t.class_rank) AS class_rank, \
             MAX(t.claimed_bytes / t.weight) AS deficit \
             FROM transfer_parts p JOIN transfer_plans t ON t.transfer = p.transfer \
             JOIN transfers mt ON mt.id = p.transfer \
             WHERE p.transfer IN ({list}) AND (t.announced = 1 OR (t.joinable = 1 AND {joins} = 1)) \
             AND (p.state IN ('queued', 'quiet') OR (p.state = 'held' AND p.lease_until < {now})) \
             AND NOT EXISTS (SELECT 1 FROM transfer_plans o JOIN transfers ot ON ot.id = o.transfer \
             WHERE ot.link = mt.link AND o.class_rank > t.class_rank \
             AND ot.state NOT IN ('published', 'failed', 'cancelled', 'paused') \
             AND EXISTS (SELECT 1 FROM transfer_parts q WHERE q.transfer = o.transfer \
             AND (q.state IN ('queued', 'quiet') OR (q.state = 'held' AND q.lease_until < {now})))) \
             GROUP BY p.transfer \
             ORDER BY class_rank DESC, deficit ASC, transfer ASC",
            now = self.db.now_ms(),
            joins = i64::from(joins),
        );
        let rows = sqlx::query(&q).fetch_all(&self.pool).await?;
        let mut out = Vec::with_capacity(rows.len());
        let mut top = None;
        for r in rows {
            let t: i64 = r.try_get("transfer")?;
            let n: i64 = r.try_get("n")?;
            let rank: i64 = r.try_get("class_rank")?;
            // Only the highest class rank's: the others' claims wait
            // (see [`Catalog::claim_parts`]).
            if *top.get_or_insert(rank) != rank {
                break;
            }
            if let Some(transfer) = TransferId::from_i64(t) {
                out.push(Claimable {
                    transfer,
                    parts: n.max(0) as u64,
                });
            }
        }
        Ok(out)
    }

    /// Agent `agent` claims up to `max` parts of transfer `id` for
    /// `timeout_ms`, lowest part numbers first: queued parts, and held
    /// parts whose lease lapsed (taken over; the lapsed claim ends at its
    /// `lease_until`, before this one starts). Parts another agent is
    /// claiming right now are skipped (`FOR UPDATE SKIP LOCKED`). A
    /// drained agent claims nothing, and nothing is claimed while a
    /// striped transfer of the same link in a higher class rank (see
    /// [`Catalog::set_plan_rank`]) has parts to claim: its parts go
    /// first, pool wide. Only the plan's maker claims the parts of a plan
    /// not yet announced ([`Catalog::plan_transfer_quietly`]).
    ///
    /// # Errors
    /// SQL errors (nothing is claimed then).
    pub async fn claim_parts(
        &self,
        id: TransferId,
        agent: &str,
        max: usize,
        timeout_ms: i64,
    ) -> Result<Vec<PartClaim>, CatalogError> {
        self.claim_parts_for(id, agent, max, timeout_ms, false)
            .await
    }

    /// As [`Catalog::claim_parts`], for an agent whose sink takes joining
    /// opens (`joins`): it may claim the parts of a plan announced to
    /// such agents only ([`Catalog::announce_plan_to_joiners`]) too.
    ///
    /// # Errors
    /// SQL errors (nothing is claimed then).
    pub async fn claim_parts_for(
        &self,
        id: TransferId,
        agent: &str,
        max: usize,
        timeout_ms: i64,
        joins: bool,
    ) -> Result<Vec<PartClaim>, CatalogError> {
        if max == 0 {
            return Ok(Vec::new());
        }
        let mut tx = self.pool.begin().await?;
        let q = format!("SELECT {} AS now", self.db.now_ms());
        let now: i64 = sqlx::query_scalar(&q).fetch_one(&mut *tx).await?;
        let drained: Option<i64> = sqlx::query_scalar(
            &self
                .db
                .sql("SELECT 1 FROM agents WHERE name = ? AND draining = 1"),
        )
        .bind(agent)
        .fetch_optional(&mut *tx)
        .await?;
        if drained.is_some() {
            tx.rollback().await?;
            return Ok(Vec::new());
        }
        // Claim order, pool wide: while a striped transfer of the same
        // link in a higher class has parts to claim, none of this one's
        // is claimed (the caller claims that one's instead).
        let higher: Option<i64> = sqlx::query_scalar(&self.db.sql(
            "SELECT o.transfer FROM transfer_plans o \
             JOIN transfers ot ON ot.id = o.transfer \
             JOIN transfer_plans me ON me.transfer = ? \
             JOIN transfers mt ON mt.id = me.transfer \
             WHERE ot.link = mt.link AND o.class_rank > me.class_rank \
             AND ot.state NOT IN ('published', 'failed', 'cancelled', 'paused') \
             AND EXISTS (SELECT 1 FROM transfer_parts p WHERE p.transfer = o.transfer \
             AND (p.state IN ('queued', 'quiet') OR (p.state = 'held' AND p.lease_until < ?))) LIMIT 1",
        ))
        .bind(id.as_i64())
        .bind(now)
        .fetch_optional(&mut *tx)
        .await?;
        if higher.is_some() {
            tx.rollback().await?;
            return Ok(Vec::new());
        }
        // A plan not yet announced is its coordinator's alone (its queued
        // parts are `quiet`; past this check they are claimable).
        let open: Option<i64> = sqlx::query_scalar(&self.db.sql(
            "SELECT 1 FROM transfer_plans WHERE transfer = ? \
             AND (announced = 1 OR planned_by = ? OR (joinable = 1 AND ? = 1))",
        ))
        .bind(id.as_i64())
        .bind(agent)
        .bind(i64::from(joins))
        .fetch_optional(&mut *tx)
        .await?;
        if open.is_none() {
            tx.rollback().await?;
            return Ok(Vec::new());
        }
        let q = format!(
            "SELECT part, first_key, end_key, bytes, state, holder, lease_until, lease_epoch \
             FROM transfer_parts WHERE transfer = ? AND (state IN ('queued', 'quiet') \
             OR (state = 'held' AND lease_until < ?)) ORDER BY part LIMIT ?{}",
            self.db.lock_skip_locked()
        );
        let rows = sqlx::query(&self.db.sql(&q))
            .bind(id.as_i64())
            .bind(now)
            .bind(max as i64)
            .fetch_all(&mut *tx)
            .await?;
        // Whether this agent holds parts of the transfer already: if not,
        // the pool's set of holders changes, and with it every holder's
        // share of the link's budget.
        let held_before: Option<i64> = if rows.is_empty() {
            None
        } else {
            sqlx::query_scalar(&self.db.sql(
                "SELECT 1 FROM transfer_parts WHERE transfer = ? AND holder = ? \
                 AND state = 'held' AND lease_until >= ? LIMIT 1",
            ))
            .bind(id.as_i64())
            .bind(agent)
            .bind(now)
            .fetch_optional(&mut *tx)
            .await?
        };
        let mut claims = Vec::with_capacity(rows.len());
        let mut bytes = 0i64;
        for r in rows {
            let part: i64 = r.try_get("part")?;
            let epoch: i64 = r.try_get("lease_epoch")?;
            let state: String = r.try_get("state")?;
            let holder: Option<String> = r.try_get("holder")?;
            let until: Option<i64> = r.try_get("lease_until")?;
            let n = sqlx::query(&self.db.sql(
                "UPDATE transfer_parts SET state = 'held', holder = ?, lease_until = ?, \
                 lease_epoch = ? WHERE transfer = ? AND part = ? AND lease_epoch = ?",
            ))
            .bind(agent)
            .bind(now + timeout_ms)
            .bind(epoch + 1)
            .bind(id.as_i64())
            .bind(part)
            .bind(epoch)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if n == 0 {
                // Claimed since it was read (SQLite, which locks no row).
                continue;
            }
            let lapsed = state == "held";
            if lapsed {
                sqlx::query(&self.db.sql(
                    "UPDATE part_claims SET ended_at = ?, end_reason = 'lapsed' \
                     WHERE transfer = ? AND part = ? AND epoch = ? AND ended_at IS NULL",
                ))
                .bind(until.unwrap_or(now))
                .bind(id.as_i64())
                .bind(part)
                .bind(epoch)
                .execute(&mut *tx)
                .await?;
            }
            sqlx::query(&self.db.sql(
                "INSERT INTO part_claims (transfer, part, epoch, agent, claimed_at) \
                 VALUES (?, ?, ?, ?, ?)",
            ))
            .bind(id.as_i64())
            .bind(part)
            .bind(epoch + 1)
            .bind(agent)
            .bind(now)
            .execute(&mut *tx)
            .await?;
            let b: i64 = r.try_get("bytes")?;
            bytes += b;
            claims.push(PartClaim {
                range: range_of(&r)?,
                epoch: epoch + 1,
                took_over_from: holder.filter(|_| lapsed),
            });
        }
        if bytes > 0 {
            sqlx::query(&self.db.sql(
                "UPDATE transfer_plans SET claimed_bytes = claimed_bytes + ? WHERE transfer = ?",
            ))
            .bind(bytes)
            .bind(id.as_i64())
            .execute(&mut *tx)
            .await?;
        }
        if !claims.is_empty() && held_before.is_none() {
            crate::notify::announce(self.db, &mut tx, crate::notify::payload::HOLDERS).await?;
        }
        tx.commit().await?;
        Ok(claims)
    }

    /// Agent `agent` releases part `part` of transfer `id`, claimed under
    /// `epoch`, done: every chunk of it verified at the sink, with each
    /// chunk's hash (`hashes`, key order) and what it saw of each file
    /// (`reads`). Returns false, recording nothing, if the part was
    /// claimed by another agent since (a later epoch) or is not held.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn release_part(
        &self,
        id: TransferId,
        part: u64,
        agent: &str,
        epoch: i64,
        hashes: &[Hash],
        reads: &[PartFileRead],
    ) -> Result<bool, CatalogError> {
        let blob: Vec<u8> = hashes.iter().flatten().copied().collect();
        let versions =
            serde_json::to_string(reads).map_err(|e| CatalogError::Invalid(e.to_string()))?;
        self.end_part(id, part, agent, epoch, Some((blob, versions)))
            .await
    }

    /// Agent `agent` gives part `part` of transfer `id` (claimed under
    /// `epoch`) back unfinished: queued again at once, for any agent (for
    /// the plan's maker only while the plan is not announced).
    /// Returns false if it no longer held it.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn give_back_part(
        &self,
        id: TransferId,
        part: u64,
        agent: &str,
        epoch: i64,
    ) -> Result<bool, CatalogError> {
        self.end_part(id, part, agent, epoch, None).await
    }

    async fn end_part(
        &self,
        id: TransferId,
        part: u64,
        agent: &str,
        epoch: i64,
        done: Option<(Vec<u8>, String)>,
    ) -> Result<bool, CatalogError> {
        let mut tx = self.pool.begin().await?;
        let q = format!("SELECT {} AS now", self.db.now_ms());
        let now: i64 = sqlx::query_scalar(&q).fetch_one(&mut *tx).await?;
        let reason = if done.is_some() {
            "released"
        } else {
            "given back"
        };
        let (state, hashes, versions, done_by) = match done {
            Some((h, v)) => ("'done'", Some(h), Some(v), Some(agent)),
            None => (self.requeued_state(&mut tx, id).await?, None, None, None),
        };
        let q = format!(
            "UPDATE transfer_parts SET state = {state}, holder = NULL, lease_until = NULL, \
             hashes = ?, versions = ?, done_by = ? \
             WHERE transfer = ? AND part = ? AND holder = ? AND lease_epoch = ? \
             AND state = 'held'"
        );
        let n = sqlx::query(&self.db.sql(&q))
            .bind(hashes)
            .bind(versions)
            .bind(done_by)
            .bind(id.as_i64())
            .bind(part as i64)
            .bind(agent)
            .bind(epoch)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        if n == 0 {
            tx.rollback().await?;
            return Ok(false);
        }
        sqlx::query(&self.db.sql(
            "UPDATE part_claims SET ended_at = ?, end_reason = ? \
             WHERE transfer = ? AND part = ? AND epoch = ? AND ended_at IS NULL",
        ))
        .bind(now)
        .bind(reason)
        .bind(id.as_i64())
        .bind(part as i64)
        .bind(epoch)
        .execute(&mut *tx)
        .await?;
        // The agent's last live part of the transfer, and none left for it
        // to claim next: the transfer's holders changed (the others'
        // shares of the link's budget grow now, not at their next pass).
        // While parts are claimable it usually claims again at once, which
        // announces itself. (Read committed: a part another agent is
        // claiming right now still counts as queued here; if that agent
        // already held parts and this one then finds nothing to claim,
        // no one announces, and the others' shares grow at their next
        // pass. Locking the queued rows instead would make that claim
        // skip them.)
        let still: Option<i64> = sqlx::query_scalar(&self.db.sql(
            "SELECT 1 FROM transfer_parts WHERE transfer = ? \
             AND ((holder = ? AND state = 'held' AND lease_until >= ?) \
             OR state IN ('queued', 'quiet')) LIMIT 1",
        ))
        .bind(id.as_i64())
        .bind(agent)
        .bind(now)
        .fetch_optional(&mut *tx)
        .await?;
        if still.is_none() {
            crate::notify::announce(self.db, &mut tx, crate::notify::payload::HOLDERS).await?;
        }
        tx.commit().await?;
        Ok(true)
    }

    /// Gives back every part of transfer `id` agent `agent` holds (its run
    /// of the transfer stopped: paused or cancelled, and the claims it
    /// made would otherwise be renewed with the agent's other leases):
    /// their claims end as given back and the parts are queued again
    /// (`quiet` while their plan is not announced). Returns how many.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn give_back_parts_of(
        &self,
        id: TransferId,
        agent: &str,
    ) -> Result<u64, CatalogError> {
        let mut tx = self.pool.begin().await?;
        let q = format!("SELECT {} AS now", self.db.now_ms());
        let now: i64 = sqlx::query_scalar(&q).fetch_one(&mut *tx).await?;
        // The parts first, then their claims: the order a claim and a
        // release lock them in (the other order deadlocks with a takeover
        // running at the same time).
        let rows = sqlx::query(&self.db.sql(&format!(
            "UPDATE transfer_parts SET state = {REQUEUED}, holder = NULL, lease_until = NULL \
             WHERE transfer = ? AND holder = ? AND state = 'held' RETURNING part, lease_epoch"
        )))
        .bind(id.as_i64())
        .bind(agent)
        .fetch_all(&mut *tx)
        .await?;
        for r in &rows {
            let part: i64 = r.try_get("part")?;
            let epoch: i64 = r.try_get("lease_epoch")?;
            sqlx::query(&self.db.sql(
                "UPDATE part_claims SET ended_at = ?, end_reason = 'given back' \
                 WHERE transfer = ? AND part = ? AND epoch = ? AND ended_at IS NULL",
            ))
            .bind(now)
            .bind(id.as_i64())
            .bind(part)
            .bind(epoch)
            .execute(&mut *tx)
            .await?;
        }
        let n = rows.len() as u64;
        if n > 0 {
            crate::notify::announce(self.db, &mut tx, crate::notify::payload::HOLDERS).await?;
        }
        tx.commit().await?;
        Ok(n)
    }

    /// Queues done parts `parts` of transfer `id` again (a file they read
    /// changed before the seal): their hashes and reads are forgotten.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn requeue_parts(&self, id: TransferId, parts: &[u64]) -> Result<(), CatalogError> {
        let mut tx = self.pool.begin().await?;
        let state = self.requeued_state(&mut tx, id).await?;
        for p in parts {
            sqlx::query(&self.db.sql(&format!(
                "UPDATE transfer_parts SET state = {state}, hashes = NULL, versions = NULL, \
                 done_by = NULL WHERE transfer = ? AND part = ? AND state = 'done'"
            )))
            .bind(id.as_i64())
            .bind(*p as i64)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// The state (an SQL literal) a part of transfer `id` queued again
    /// in `tx` takes: `'quiet'` while its plan is not announced,
    /// `'queued'` after. The plan's row is read locked (PostgreSQL), so
    /// an announcement running at the same time, which turns `quiet`
    /// parts to `queued`, comes wholly before or after the caller's
    /// transaction (SQLite has one writer at a time).
    async fn requeued_state(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Any>,
        id: TransferId,
    ) -> Result<&'static str, CatalogError> {
        let announced: Option<i64> = sqlx::query_scalar(&self.db.sql(&format!(
            "SELECT announced FROM transfer_plans WHERE transfer = ?{}",
            self.db.lock_for_share()
        )))
        .bind(id.as_i64())
        .fetch_optional(&mut **tx)
        .await?;
        Ok(if announced == Some(0) {
            "'quiet'"
        } else {
            "'queued'"
        })
    }

    /// Counts of transfer `id`'s parts by state, now (database clock).
    ///
    /// # Errors
    /// SQL errors.
    pub async fn parts_status(&self, id: TransferId) -> Result<PartsStatus, CatalogError> {
        let q = format!(
            "SELECT COUNT(*) AS total, \
             COALESCE(SUM(CASE WHEN state = 'done' THEN 1 ELSE 0 END), 0) AS done, \
             COALESCE(SUM(CASE WHEN state = 'held' AND lease_until >= {now} THEN 1 ELSE 0 END), 0) \
             AS held FROM transfer_parts WHERE transfer = ?",
            now = self.db.now_ms()
        );
        let r = sqlx::query(&self.db.sql(&q))
            .bind(id.as_i64())
            .fetch_one(&self.pool)
            .await?;
        let get =
            |c: &str| -> Result<u64, CatalogError> { Ok(r.try_get::<i64, _>(c)?.max(0) as u64) };
        let (total, done, held) = (get("total")?, get("done")?, get("held")?);
        Ok(PartsStatus {
            total,
            done,
            held,
            claimable: total.saturating_sub(done + held),
        })
    }

    /// Payload bytes of transfer `id`'s parts done by agents other than
    /// `agent` (what its coordinator adds to its own progress).
    ///
    /// # Errors
    /// SQL errors.
    pub async fn parts_done_bytes_by_others(
        &self,
        id: TransferId,
        agent: &str,
    ) -> Result<u64, CatalogError> {
        let bytes: i64 = sqlx::query_scalar(&self.db.sql(
            "SELECT CAST(COALESCE(SUM(bytes), 0) AS BIGINT) FROM transfer_parts \
             WHERE transfer = ? AND state = 'done' AND done_by <> ?",
        ))
        .bind(id.as_i64())
        .bind(agent)
        .fetch_one(&self.pool)
        .await?;
        Ok(bytes.max(0) as u64)
    }

    /// For each transfer among `ids` whose parts are held under a live
    /// lease now: how many agents hold them, and whether `agent` is one
    /// (the split of a striped transfer's share of the link's budget).
    ///
    /// # Errors
    /// SQL errors.
    pub async fn part_holders(
        &self,
        ids: &[TransferId],
        agent: &str,
    ) -> Result<Vec<(TransferId, u64, bool)>, CatalogError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let list = id_list(ids);
        let q = format!(
            "SELECT transfer, COUNT(DISTINCT holder) AS holders, \
             MAX(CASE WHEN holder = ? THEN 1 ELSE 0 END) AS mine FROM transfer_parts \
             WHERE transfer IN ({list}) AND state = 'held' AND lease_until >= {now} \
             GROUP BY transfer",
            now = self.db.now_ms()
        );
        let rows = sqlx::query(&self.db.sql(&q))
            .bind(agent)
            .fetch_all(&self.pool)
            .await?;
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            let t: i64 = r.try_get("transfer")?;
            let n: i64 = r.try_get("holders")?;
            let mine: i64 = r.try_get("mine")?;
            if let Some(t) = TransferId::from_i64(t) {
                out.push((t, n.max(0) as u64, mine != 0));
            }
        }
        Ok(out)
    }

    /// Every part of transfer `id`, by part number.
    ///
    /// # Errors
    /// [`CatalogError::Corrupt`] for hashes or reads that do not parse;
    /// SQL errors.
    pub async fn parts(&self, id: TransferId) -> Result<Vec<PartRow>, CatalogError> {
        let q = format!(
            "SELECT part, first_key, end_key, bytes, state, holder, lease_epoch, done_by, \
             hashes, versions, CASE WHEN lease_until >= {} THEN 1 ELSE 0 END AS live \
             FROM transfer_parts WHERE transfer = ? ORDER BY part",
            self.db.now_ms()
        );
        let rows = sqlx::query(&self.db.sql(&q))
            .bind(id.as_i64())
            .fetch_all(&self.pool)
            .await?;
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            let state: String = r.try_get("state")?;
            let blob: Option<Vec<u8>> = r.try_get("hashes")?;
            let blob = blob.unwrap_or_default();
            if blob.len() % 32 != 0 {
                return Err(corrupt(
                    "transfer_parts.hashes",
                    format!("{} bytes is not a whole number of hashes", blob.len()),
                ));
            }
            let hashes = blob
                .chunks_exact(32)
                .map(|c| {
                    let mut h = [0u8; 32];
                    h.copy_from_slice(c);
                    h
                })
                .collect();
            let versions: Option<String> = r.try_get("versions")?;
            let versions = match versions {
                Some(v) => {
                    serde_json::from_str(&v).map_err(|e| corrupt("transfer_parts.versions", e))?
                }
                None => Vec::new(),
            };
            let live: i64 = r.try_get("live")?;
            out.push(PartRow {
                range: range_of(&r)?,
                state: PartState::parse(&state)?,
                holder: r.try_get("holder")?,
                live: live != 0,
                epoch: r.try_get("lease_epoch")?,
                done_by: r.try_get("done_by")?,
                hashes,
                versions,
            });
        }
        Ok(out)
    }

    /// Every claim of transfer `id`'s parts, by part and epoch.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn part_claims(&self, id: TransferId) -> Result<Vec<PartClaimRecord>, CatalogError> {
        let rows = sqlx::query(&self.db.sql(
            "SELECT part, epoch, agent, claimed_at, ended_at, end_reason FROM part_claims \
             WHERE transfer = ? ORDER BY part, epoch",
        ))
        .bind(id.as_i64())
        .fetch_all(&self.pool)
        .await?;
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            let part: i64 = r.try_get("part")?;
            out.push(PartClaimRecord {
                part: part.max(0) as u64,
                epoch: r.try_get("epoch")?,
                agent: r.try_get("agent")?,
                claimed_at: r.try_get("claimed_at")?,
                ended_at: r.try_get("ended_at")?,
                end_reason: r.try_get("end_reason")?,
            });
        }
        Ok(out)
    }
}

/// The epoch a sink's catalog records for a part of a striped transfer
/// (see [`Catalog::register_part_epoch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartEpoch {
    /// The part's chunk keys and number (its `bytes` are 0: not known at
    /// the sink).
    pub range: PartRange,
    /// The latest epoch registered.
    pub epoch: u64,
}

impl Catalog {
    /// Sink side: source agent `by` registers part `range` of replica row
    /// `replica` under claim epoch `epoch`, before sending its chunks.
    /// Recorded unless a later epoch is; returns the epoch recorded now
    /// (another than `epoch`: the part was claimed again since).
    ///
    /// # Errors
    /// SQL errors.
    pub async fn register_part_epoch(
        &self,
        replica: i64,
        range: PartRange,
        epoch: u64,
        by: &str,
    ) -> Result<u64, CatalogError> {
        let mut tx = self.pool.begin().await?;
        let q = format!("SELECT {} AS now", self.db.now_ms());
        let now: i64 = sqlx::query_scalar(&q).fetch_one(&mut *tx).await?;
        sqlx::query(&self.db.sql(
            "INSERT INTO part_epochs (replica, part, epoch, first_key, end_key, registered_by, \
             registered_at) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (replica, part) DO UPDATE \
             SET epoch = excluded.epoch, first_key = excluded.first_key, \
             end_key = excluded.end_key, registered_by = excluded.registered_by, \
             registered_at = excluded.registered_at WHERE part_epochs.epoch < excluded.epoch",
        ))
        .bind(replica)
        .bind(range.part as i64)
        .bind(epoch as i64)
        .bind(range.first_key as i64)
        .bind(range.end_key as i64)
        .bind(by)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        let now_epoch: i64 = sqlx::query_scalar(
            &self
                .db
                .sql("SELECT epoch FROM part_epochs WHERE replica = ? AND part = ?"),
        )
        .bind(replica)
        .bind(range.part as i64)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(now_epoch.max(0) as u64)
    }

    /// Sink side: the epochs recorded for replica row `replica`'s parts,
    /// by part: all of them, or only those numbered in `parts` (read by
    /// primary key: the sink's fence reads the few parts a group of
    /// chunks falls in).
    ///
    /// # Errors
    /// SQL errors.
    pub async fn part_epochs(
        &self,
        replica: i64,
        parts: Option<&[u64]>,
    ) -> Result<Vec<PartEpoch>, CatalogError> {
        let only = match parts {
            Some([]) => return Ok(Vec::new()),
            Some(ps) => format!(
                " AND part IN ({})",
                ps.iter()
                    .map(|p| p.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            ),
            None => String::new(),
        };
        let rows = sqlx::query(&self.db.sql(&format!(
            "SELECT part, epoch, first_key, end_key, CAST(0 AS BIGINT) AS bytes FROM part_epochs \
             WHERE replica = ?{only} ORDER BY part"
        )))
        .bind(replica)
        .fetch_all(&self.pool)
        .await?;
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            let epoch: i64 = r.try_get("epoch")?;
            out.push(PartEpoch {
                range: range_of(&r)?,
                epoch: epoch.max(0) as u64,
            });
        }
        Ok(out)
    }
}

fn range_of(r: &sqlx::any::AnyRow) -> Result<PartRange, CatalogError> {
    let get = |c: &str| -> Result<u64, CatalogError> {
        let v: i64 = r.try_get(c)?;
        u64::try_from(v).map_err(|e| corrupt(&format!("transfer_parts.{c}"), e))
    };
    Ok(PartRange {
        part: get("part")?,
        first_key: get("first_key")?,
        end_key: get("end_key")?,
        bytes: get("bytes")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &str, size: u64) -> FileInfo {
        FileInfo {
            path: path.into(),
            size,
            mode: 0o644,
            mtime_ns: 0,
        }
    }

    #[test]
    fn parts_pack_small_files_split_large_ones_and_cover_every_chunk_once() {
        let cs = 1024u32;
        // a: 3 chunks; b, c: 1 small chunk each; empty: none; d: 5 chunks.
        let files = [
            file("a", 3 * 1024),
            file("b", 10),
            file("c", 20),
            file("empty", 0),
            file("d", 4 * 1024 + 1),
        ];
        let parts = split_into_parts(&files, cs, 2048);
        let map = ferry_proto::manifest::ChunkMap::new(&files, cs);
        for k in map.keys() {
            assert_eq!(
                parts.iter().filter(|p| p.contains(k)).count(),
                1,
                "chunk key {k:#x} in exactly one part: {parts:?}"
            );
        }
        let total: u64 = parts.iter().map(|p| p.bytes).sum();
        assert_eq!(total, files.iter().map(|f| f.size).sum::<u64>());
        // a's first two chunks; a's last with b, c and d's first (packed);
        // the rest of d split.
        assert_eq!(parts[0].bytes, 2048);
        assert_eq!(parts[1].bytes, 1024 + 10 + 20 + 1024);
        assert_eq!(parts.len(), 4);
        assert!(parts.iter().all(|p| p.bytes <= 2048 + 1024));
        for (i, p) in parts.iter().enumerate() {
            assert_eq!(p.part, i as u64);
            assert!(p.first_key < p.end_key);
        }
        // A part size under the chunk size: one chunk each.
        assert_eq!(split_into_parts(&files, cs, 1).len() as u64, map.total());
        assert!(split_into_parts(&[file("e", 0)], cs, 2048).is_empty());
    }

    #[test]
    fn chunks_left_out_of_a_plan_are_in_no_part_and_cut_the_part_before_them() {
        let cs = 1024u32;
        let files = [file("a", 4 * 1024), file("b", 3 * 1024)];
        // a's chunk 1 and all of b but its last chunk were sent already.
        let send = |f: u32, c: u64| (f, c) == (0, 0) || (f == 0 && c >= 2) || (f, c) == (1, 2);
        let parts = split_into_parts_where(&files, cs, 8 * 1024, send);
        let map = ferry_proto::manifest::ChunkMap::new(&files, cs);
        for k in map.keys() {
            let (f, c) = map.locate(k).unwrap_or_default();
            let n = parts.iter().filter(|p| p.contains(k)).count();
            assert_eq!(
                n,
                usize::from(send(f, u64::from(c))),
                "chunk {f}/{c}: {parts:?}"
            );
        }
        // a0 | a2 a3 | b2: a left-out chunk closes the open part, so each
        // part's key range holds only chunks to send.
        assert_eq!(parts.len(), 3, "{parts:?}");
        assert_eq!(parts.iter().map(|p| p.bytes).sum::<u64>(), 4 * 1024);
        for (i, p) in parts.iter().enumerate() {
            assert_eq!(p.part, i as u64);
        }
    }
}
