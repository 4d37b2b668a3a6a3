//! Sink side: the `chunks` table, the chunks verified in staging (the
//! resume point after a crash) and when they arrived.

use ferry_proto::manifest::Hash;
use serde::Serialize;
use sqlx::AnyConnection;
use sqlx::Row;

use crate::dialect::Dialect;
use crate::{Catalog, CatalogError};

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
pub(crate) async fn arrival_bins(
    db: Dialect,
    conn: &mut AnyConnection,
    replica: i64,
) -> Result<Arrivals, CatalogError> {
    let rows: Vec<(Option<i64>, i64, i64)> = sqlx::query_as(&db.sql(
        "SELECT arrival_started, verified_at, bytes FROM chunks \
         WHERE replica = ? AND verified_at IS NOT NULL AND bytes IS NOT NULL",
    ))
    .bind(replica)
    .fetch_all(&mut *conn)
    .await?;
    Ok(spread_arrivals(&rows))
}

/// Bins `(first byte or None, last byte, bytes)` arrivals; see
/// [`arrival_bins`].
pub(crate) fn spread_arrivals(rows: &[(Option<i64>, i64, i64)]) -> Arrivals {
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

impl Catalog {
    /// Verified chunks of a sink-side row: `(chunk key, hash)`.
    ///
    /// # Errors
    /// SQL errors; [`CatalogError::Corrupt`] for a hash that is not 32 bytes.
    pub async fn chunks(&self, replica: i64) -> Result<Vec<(u64, Hash)>, CatalogError> {
        let rows = sqlx::query(
            &self
                .db
                .sql("SELECT idx, hash FROM chunks WHERE replica = ? ORDER BY idx"),
        )
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
        let live = arrival_bins(self.db, &mut conn, replica).await?;
        if !live.bins.is_empty() {
            return Ok(live);
        }
        let kept: Option<Option<String>> =
            sqlx::query_scalar(&self.db.sql("SELECT arrivals FROM replicas WHERE id = ?"))
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
        sqlx::query(&self.db.sql("DELETE FROM chunks WHERE replica = ?"))
            .bind(replica)
            .execute(&mut *tx)
            .await?;
        for (idx, hash) in chunks {
            sqlx::query(
                &self
                    .db
                    .sql("INSERT INTO chunks (replica, idx, hash) VALUES (?, ?, ?)"),
            )
            .bind(replica)
            .bind(*idx as i64)
            .bind(&hash[..])
            .execute(&mut *tx)
            .await?;
        }
        sqlx::query(
            &self
                .db
                .sql("UPDATE replicas SET bytes_done = ? WHERE id = ?"),
        )
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
        self.record_batch(chunks, &[]).await.map(|_| ())
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
            sqlx::query(
                &self
                    .db
                    .sql("DELETE FROM chunks WHERE replica = ? AND idx = ?"),
            )
            .bind(replica)
            .bind(*i as i64)
            .execute(&mut *tx)
            .await?;
        }
        sqlx::query(
            &self
                .db
                .sql("UPDATE replicas SET bytes_done = ? WHERE id = ?"),
        )
        .bind(bytes_done as i64)
        .bind(replica)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }
}
