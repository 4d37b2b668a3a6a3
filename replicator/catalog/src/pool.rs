//! The site's pool of agents: the `agents` table (membership and
//! heartbeats) and transfer leases (`transfers.holder`, `lease_until`,
//! `lease_epoch`, and the history in `transfer_leases`).
//!
//! Every time here is the database's clock ([`crate::dialect::Dialect::now_ms`]),
//! so agents whose clocks disagree still agree on who holds what. A lease
//! is the claim-and-lease pattern of PostgreSQL job queues: a claim locks
//! the transfer's row (`FOR UPDATE SKIP LOCKED`: a row another agent is
//! claiming right now is skipped, not waited for), takes it if nobody
//! holds a live lease, and sets `lease_until` to the database's now plus
//! the agent's lease timeout; each heartbeat renews the leases of its
//! agent that are still live. A lapsed lease is never renewed: another
//! agent (or the same one, under a new epoch) must claim the transfer
//! again. So two leases of one transfer never overlap in time.

use std::fmt;

use ferry_proto::state::TransferId;
use sqlx::Row;

use crate::{Catalog, CatalogError};

/// What an agent writes with each heartbeat (see [`Catalog::heartbeat`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Heartbeat<'a> {
    /// The agent's name.
    pub name: &'a str,
    /// `source`, `sink` or `both`.
    pub role: &'a str,
    /// The ferry version it runs.
    pub version: &'a str,
    /// Its REST API's base URL.
    pub api_url: &'a str,
    /// Its lease timeout, milliseconds: it is down once its last
    /// heartbeat is older than this, and its leases lapse then.
    pub timeout_ms: i64,
    /// The process's random id, made at its start: one name runs in
    /// one process at a time.
    pub instance: &'a str,
    /// Payload bytes it sends now, as a source, bit/s.
    pub sent_bps: f64,
    /// Payload bytes it receives now, as a sink, bit/s.
    pub received_bps: f64,
}

/// What the catalog answers a heartbeat.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Beat {
    /// The database clock when it was written, Unix ms.
    pub at_ms: i64,
    /// Whether an operator drained the agent (it claims nothing new).
    pub draining: bool,
    /// The transfers whose leases it holds, renewed to
    /// `at_ms + timeout_ms`.
    pub held: Vec<TransferId>,
    /// The source roots whose watches it holds (see
    /// [`Catalog::claim_watch`]), renewed alike, sorted.
    pub watches: Vec<String>,
    /// The published paths whose publish leases it holds (see
    /// [`Catalog::claim_publish`]), renewed alike, sorted.
    pub publishes: Vec<String>,
    /// The parts of striped transfers it holds (transfer, part; see
    /// [`Catalog::claim_parts`]), renewed alike, sorted.
    pub parts: Vec<(TransferId, u64)>,
    /// Agents of its role that are live and not drained, itself included
    /// (at least 1): how many share the pool's work.
    pub live_peers: i64,
}

/// What [`Catalog::forget_agent`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forget {
    /// The agent was stopped or down; it is no longer listed.
    Forgotten,
    /// The agent is live (heartbeating): nothing was removed.
    Live,
    /// No agent of that name.
    NotFound,
}

/// An agent's state in the pool, judged by the database clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentState {
    /// Heartbeating, and claiming work.
    Live,
    /// Heartbeating, drained by an operator: it claims nothing new.
    Draining,
    /// No heartbeat within its timeout: it died, hung or lost the
    /// catalog; its leases have lapsed.
    Down,
    /// It stopped cleanly and released what it held.
    Stopped,
}

impl AgentState {
    /// All states, in the order they are reported.
    pub const ALL: [AgentState; 4] = [
        AgentState::Live,
        AgentState::Draining,
        AgentState::Down,
        AgentState::Stopped,
    ];

    /// The state's name (`live`, `draining`, `down`, `stopped`).
    pub fn as_str(self) -> &'static str {
        match self {
            AgentState::Live => "live",
            AgentState::Draining => "draining",
            AgentState::Down => "down",
            AgentState::Stopped => "stopped",
        }
    }
}

impl fmt::Display for AgentState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One agent of the pool, as the catalog sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolAgent {
    /// Agent name.
    pub name: String,
    /// `source`, `sink` or `both`.
    pub role: String,
    /// The ferry version it runs.
    pub version: String,
    /// Its REST API's base URL.
    pub api_url: String,
    /// Its state now.
    pub state: AgentState,
    /// When it (last) started, Unix ms.
    pub started_at: i64,
    /// Its last heartbeat, Unix ms (database clock).
    pub heartbeat_at: i64,
    /// Milliseconds since its last heartbeat, by the database clock.
    pub heartbeat_age_ms: i64,
    /// Its lease timeout, ms.
    pub timeout_ms: i64,
    /// Transfers whose live leases it holds.
    pub held: i64,
    /// Bytes left to send of those transfers, as last recorded.
    pub held_bytes_left: i64,
    /// Source roots whose live watch leases it holds.
    pub watches: i64,
    /// Payload bit/s it sent at its last heartbeat.
    pub sent_bps: f64,
    /// Payload bit/s it received at its last heartbeat.
    pub received_bps: f64,
}

/// A transfer claimed (see [`Catalog::claim_transfer`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// The lease's epoch: one more than the transfer's previous lease
    /// (the same when the agent renewed a lease it held).
    pub epoch: i64,
    /// The agent whose lease lapsed before this claim, if another agent
    /// held the transfer last (a takeover).
    pub took_over_from: Option<String>,
    /// The lease runs until this time, Unix ms (database clock).
    pub lease_until: i64,
}

/// One lease of a transfer, from `transfer_leases`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRecord {
    /// Its epoch.
    pub epoch: i64,
    /// The agent that held it.
    pub agent: String,
    /// When it was claimed, Unix ms (database clock).
    pub claimed_at: i64,
    /// When it ended (`None`: still held), Unix ms (database clock).
    pub ended_at: Option<i64>,
    /// `released` or `lapsed`, once ended.
    pub end_reason: Option<String>,
}

const FINAL_OR_PAUSED: &str = "('published', 'failed', 'cancelled', 'paused')";

impl Catalog {
    /// The database clock now, Unix ms.
    ///
    /// # Errors
    /// SQL errors (the catalog cannot be reached).
    pub async fn db_now_ms(&self) -> Result<i64, CatalogError> {
        let q = format!("SELECT {} AS now", self.db.now_ms());
        Ok(sqlx::query_scalar(&q).fetch_one(&self.pool).await?)
    }

    /// Registers agent `b.name` (process `b.instance`) at its start: its
    /// row is made or replaced (the draining flag an operator set is
    /// kept), stamped started and heartbeating now. On PostgreSQL, refused
    /// while another process of that name is live (it heartbeats and has
    /// not stopped): one name runs once in a pool, and an agent restarted
    /// after a crash joins once its old leases lapsed. On SQLite (one
    /// agent, which holds the data directory's lock) a new process always
    /// takes the row.
    ///
    /// # Errors
    /// [`CatalogError::AgentName`] naming the live agent (its API and the
    /// age of its last heartbeat); SQL errors.
    pub async fn register_agent(&self, b: &Heartbeat<'_>) -> Result<(), CatalogError> {
        let now = self.db.now_ms();
        let q = format!(
            "INSERT INTO agents (name, role, version, api_url, started_at, heartbeat_at, \
             timeout_ms, sent_bps, received_bps, stopped, instance) \
             VALUES (?, ?, ?, ?, {now}, {now}, ?, 0, 0, 0, ?) \
             ON CONFLICT (name) DO UPDATE SET role = excluded.role, version = excluded.version, \
             api_url = excluded.api_url, started_at = excluded.started_at, \
             heartbeat_at = excluded.heartbeat_at, timeout_ms = excluded.timeout_ms, \
             sent_bps = 0, received_bps = 0, stopped = 0, instance = excluded.instance{}",
            // An SQLite catalog has one agent at a time (the data
            // directory's lock): a new process is the agent restarted.
            match self.db {
                crate::dialect::Dialect::Sqlite => String::new(),
                crate::dialect::Dialect::Postgres => format!(
                    " WHERE agents.instance = excluded.instance OR agents.stopped = 1 \
                     OR agents.heartbeat_at + agents.timeout_ms < {now}"
                ),
            }
        );
        let r = sqlx::query(&self.db.sql(&q))
            .bind(b.name)
            .bind(b.role)
            .bind(b.version)
            .bind(b.api_url)
            .bind(b.timeout_ms)
            .bind(b.instance)
            .execute(&self.pool)
            .await?;
        if r.rows_affected() > 0 {
            return Ok(());
        }
        let q = format!(
            "SELECT api_url, {now} - heartbeat_at AS age, timeout_ms FROM agents WHERE name = ?"
        );
        let (url, age, timeout): (String, i64, i64) = sqlx::query_as(&self.db.sql(&q))
            .bind(b.name)
            .fetch_one(&self.pool)
            .await?;
        Err(CatalogError::AgentName(format!(
            "the pool's agent {} is live (API {url}, last heartbeat {:.1} s ago): this process \
             joins once that one stops or its heartbeat is {:.1} s old (an agent restarted \
             after a crash waits for its old leases to lapse; a second agent needs its own \
             name)",
            b.name,
            age as f64 / 1000.0,
            timeout as f64 / 1000.0
        )))
    }

    /// One heartbeat of agent `b.name`: its row says it is alive now, and
    /// every live lease it holds is renewed to now + `b.timeout_ms`, in
    /// one transaction. A lease that lapsed is not renewed (the agent
    /// must stop that transfer; see the module doc).
    ///
    /// # Errors
    /// [`CatalogError::AgentName`] if this process is not the one
    /// registered under the name; SQL errors (nothing is renewed then).
    pub async fn heartbeat(&self, b: &Heartbeat<'_>) -> Result<Beat, CatalogError> {
        let mut tx = self.pool.begin().await?;
        let q = format!("SELECT {} AS now", self.db.now_ms());
        let now: i64 = sqlx::query_scalar(&q).fetch_one(&mut *tx).await?;
        let draining: Option<i64> = sqlx::query_scalar(&self.db.sql(
            "UPDATE agents SET heartbeat_at = ?, timeout_ms = ?, sent_bps = ?, \
             received_bps = ?, stopped = 0 WHERE name = ? AND instance = ? RETURNING draining",
        ))
        .bind(now)
        .bind(b.timeout_ms)
        .bind(b.sent_bps)
        .bind(b.received_bps)
        .bind(b.name)
        .bind(b.instance)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(draining) = draining else {
            tx.rollback().await?;
            return Err(CatalogError::AgentName(format!(
                "agent {} is not registered in the catalog by this process (another process \
                 of that name registered after it)",
                b.name
            )));
        };
        let held: Vec<i64> = sqlx::query_scalar(&self.db.sql(
            "UPDATE transfers SET lease_until = ? WHERE holder = ? AND lease_until >= ? \
             RETURNING id",
        ))
        .bind(now + b.timeout_ms)
        .bind(b.name)
        .bind(now)
        .fetch_all(&mut *tx)
        .await?;
        // Watch leases and publish leases: keyed by text, renewed alike.
        let mut keyed = Vec::with_capacity(2);
        for (table, key) in [("watches", "root"), ("publish_leases", "local_path")] {
            let q = format!(
                "UPDATE {table} SET lease_until = ? WHERE holder = ? AND lease_until >= ? \
                 RETURNING {key}"
            );
            let mut held: Vec<String> = sqlx::query_scalar(&self.db.sql(&q))
                .bind(now + b.timeout_ms)
                .bind(b.name)
                .bind(now)
                .fetch_all(&mut *tx)
                .await?;
            held.sort();
            keyed.push(held);
        }
        // Parts of striped transfers.
        let parts: Vec<(i64, i64)> = sqlx::query_as(&self.db.sql(
            "UPDATE transfer_parts SET lease_until = ? WHERE holder = ? AND state = 'held' \
             AND lease_until >= ? RETURNING transfer, part",
        ))
        .bind(now + b.timeout_ms)
        .bind(b.name)
        .bind(now)
        .fetch_all(&mut *tx)
        .await?;
        let mut parts: Vec<(TransferId, u64)> = parts
            .into_iter()
            .filter_map(|(t, p)| Some((TransferId::from_i64(t)?, u64::try_from(p).ok()?)))
            .collect();
        parts.sort();
        let publishes = keyed.pop().unwrap_or_default();
        let watches = keyed.pop().unwrap_or_default();
        let live_peers: i64 = sqlx::query_scalar(&self.db.sql(
            "SELECT COUNT(*) FROM agents WHERE role = ? AND stopped = 0 AND draining = 0 \
             AND heartbeat_at + timeout_ms >= ?",
        ))
        .bind(b.role)
        .bind(now)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        let mut held: Vec<TransferId> = held.into_iter().filter_map(TransferId::from_i64).collect();
        held.sort();
        Ok(Beat {
            at_ms: now,
            draining: draining != 0,
            held,
            watches,
            publishes,
            parts,
            live_peers: live_peers.max(1),
        })
    }

    /// Agent `name` (process `instance`) stops cleanly: it releases every
    /// lease it holds (transfers and watches) and is recorded stopped. Nothing changes if another
    /// process of that name registered since.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn agent_stopped(&self, name: &str, instance: &str) -> Result<(), CatalogError> {
        let mut tx = self.pool.begin().await?;
        let q = format!("SELECT {} AS now", self.db.now_ms());
        let now: i64 = sqlx::query_scalar(&q).fetch_one(&mut *tx).await?;
        let mine: Option<i64> = sqlx::query_scalar(
            &self
                .db
                .sql("UPDATE agents SET stopped = 1 WHERE name = ? AND instance = ? RETURNING 1"),
        )
        .bind(name)
        .bind(instance)
        .fetch_optional(&mut *tx)
        .await?;
        if mine.is_none() {
            tx.rollback().await?;
            return Ok(());
        }
        release_where(self, &mut tx, now, "holder = ?", &[Bind::Text(name)]).await?;
        sqlx::query(
            &self
                .db
                .sql("UPDATE watches SET holder = NULL, lease_until = NULL WHERE holder = ?"),
        )
        .bind(name)
        .execute(&mut *tx)
        .await?;
        // Its parts go back to the queue for the others.
        sqlx::query(&self.db.sql(
            "UPDATE part_claims SET ended_at = ?, end_reason = 'given back' WHERE agent = ? \
             AND ended_at IS NULL AND (transfer, part, epoch) IN (SELECT transfer, part, \
             lease_epoch FROM transfer_parts WHERE holder = ? AND state = 'held')",
        ))
        .bind(now)
        .bind(name)
        .bind(name)
        .execute(&mut *tx)
        .await?;
        sqlx::query(&self.db.sql(&format!(
            "UPDATE transfer_parts SET state = {}, holder = NULL, lease_until = NULL \
             WHERE holder = ? AND state = 'held'",
            crate::parts::REQUEUED
        )))
        .bind(name)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Sets or clears agent `name`'s draining flag. Returns false if no
    /// such agent is registered.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn set_agent_draining(
        &self,
        name: &str,
        draining: bool,
    ) -> Result<bool, CatalogError> {
        let r = sqlx::query(&self.db.sql("UPDATE agents SET draining = ? WHERE name = ?"))
            .bind(i64::from(draining))
            .bind(name)
            .execute(&self.pool)
            .await?;
        Ok(r.rows_affected() > 0)
    }

    /// Removes agent `name` from the pool's listing (its row and its
    /// fingerprints of source roots), if it is stopped or down (no
    /// heartbeat within its timeout, by the database clock): an agent
    /// taken out of service for good. Its leases lapsed with its
    /// heartbeat; the records of its past leases stay.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn forget_agent(&self, name: &str) -> Result<Forget, CatalogError> {
        let mut tx = self.pool.begin().await?;
        let q = format!("SELECT {} AS now", self.db.now_ms());
        let now: i64 = sqlx::query_scalar(&q).fetch_one(&mut *tx).await?;
        let row: Option<(i64, i64, i64)> = sqlx::query_as(
            &self
                .db
                .sql("SELECT stopped, heartbeat_at, timeout_ms FROM agents WHERE name = ?"),
        )
        .bind(name)
        .fetch_optional(&mut *tx)
        .await?;
        let Some((stopped, heartbeat_at, timeout_ms)) = row else {
            tx.rollback().await?;
            return Ok(Forget::NotFound);
        };
        if stopped == 0 && heartbeat_at + timeout_ms >= now {
            tx.rollback().await?;
            return Ok(Forget::Live);
        }
        sqlx::query(&self.db.sql("DELETE FROM agents WHERE name = ?"))
            .bind(name)
            .execute(&mut *tx)
            .await?;
        sqlx::query(&self.db.sql("DELETE FROM root_fingerprints WHERE agent = ?"))
            .bind(name)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(Forget::Forgotten)
    }

    /// Every agent of the pool, by name, with its state and what it holds
    /// now (by the database clock).
    ///
    /// # Errors
    /// SQL errors; [`CatalogError::Corrupt`] for a stored value out of
    /// range.
    pub async fn pool_agents(&self) -> Result<Vec<PoolAgent>, CatalogError> {
        let now = self.db.now_ms();
        let q = format!(
            "SELECT a.name, a.role, a.version, a.api_url, a.started_at, a.heartbeat_at, \
             a.timeout_ms, a.draining, a.stopped, a.sent_bps, a.received_bps, \
             {now} - a.heartbeat_at AS age, \
             (SELECT COUNT(*) FROM transfers t WHERE t.holder = a.name AND t.lease_until >= {now}) AS held, \
             (SELECT CAST(COALESCE(SUM(t.bytes_total - t.bytes_done), 0) AS BIGINT) FROM transfers t \
              WHERE t.holder = a.name AND t.lease_until >= {now}) AS held_left, \
             (SELECT COUNT(*) FROM watches w WHERE w.holder = a.name AND w.lease_until >= {now}) AS watches \
             FROM agents a ORDER BY a.name"
        );
        let rows = sqlx::query(&q).fetch_all(&self.pool).await?;
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            let age: i64 = r.try_get("age")?;
            let timeout_ms: i64 = r.try_get("timeout_ms")?;
            let state = if r.try_get::<i64, _>("stopped")? != 0 {
                AgentState::Stopped
            } else if age > timeout_ms {
                AgentState::Down
            } else if r.try_get::<i64, _>("draining")? != 0 {
                AgentState::Draining
            } else {
                AgentState::Live
            };
            out.push(PoolAgent {
                name: r.try_get("name")?,
                role: r.try_get("role")?,
                version: r.try_get("version")?,
                api_url: r.try_get("api_url")?,
                state,
                started_at: r.try_get("started_at")?,
                heartbeat_at: r.try_get("heartbeat_at")?,
                heartbeat_age_ms: age,
                timeout_ms,
                held: r.try_get("held")?,
                held_bytes_left: r.try_get("held_left")?,
                watches: r.try_get("watches")?,
                sent_bps: r.try_get("sent_bps")?,
                received_bps: r.try_get("received_bps")?,
            });
        }
        Ok(out)
    }

    /// Claims transfer `id` for agent `agent` for `timeout_ms`: taken if
    /// nobody holds a live lease on it (a new epoch; a lapsed lease of
    /// another agent is ended at its `lease_until`), renewed if `agent`
    /// holds it already. `None`: another agent holds a live lease, another
    /// agent is claiming it right now, the transfer is paused or final, or
    /// `agent` is drained.
    ///
    /// # Errors
    /// SQL errors (nothing is claimed then).
    pub async fn claim_transfer(
        &self,
        id: TransferId,
        agent: &str,
        timeout_ms: i64,
    ) -> Result<Option<Claim>, CatalogError> {
        let mut tx = self.pool.begin().await?;
        // A drained agent claims nothing, from the moment the drain is
        // written (not only from its next heartbeat).
        let q = format!(
            "SELECT holder, lease_until, lease_epoch, {} AS now FROM transfers \
             WHERE id = ? AND state NOT IN {FINAL_OR_PAUSED} \
             AND NOT EXISTS (SELECT 1 FROM agents WHERE name = ? AND draining = 1){}",
            self.db.now_ms(),
            self.db.lock_skip_locked()
        );
        let Some(row) = sqlx::query(&self.db.sql(&q))
            .bind(id.as_i64())
            .bind(agent)
            .fetch_optional(&mut *tx)
            .await?
        else {
            tx.rollback().await?;
            return Ok(None);
        };
        let holder: Option<String> = row.try_get("holder")?;
        let until: Option<i64> = row.try_get("lease_until")?;
        let epoch: i64 = row.try_get("lease_epoch")?;
        let now: i64 = row.try_get("now")?;
        let live = until.is_some_and(|u| u >= now);
        let lease_until = now + timeout_ms;
        if live && holder.as_deref() == Some(agent) {
            sqlx::query(
                &self
                    .db
                    .sql("UPDATE transfers SET lease_until = ? WHERE id = ? AND lease_epoch = ?"),
            )
            .bind(lease_until)
            .bind(id.as_i64())
            .bind(epoch)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            return Ok(Some(Claim {
                epoch,
                took_over_from: None,
                lease_until,
            }));
        }
        if live {
            // Rolled back at once: a transaction dropped is rolled back
            // only when its connection is next used, and the row stays
            // locked (skipped by every claim) until then.
            tx.rollback().await?;
            return Ok(None);
        }
        let r = sqlx::query(&self.db.sql(
            "UPDATE transfers SET holder = ?, lease_until = ?, lease_epoch = ? \
             WHERE id = ? AND lease_epoch = ?",
        ))
        .bind(agent)
        .bind(lease_until)
        .bind(epoch + 1)
        .bind(id.as_i64())
        .bind(epoch)
        .execute(&mut *tx)
        .await?;
        if r.rows_affected() == 0 {
            // Claimed by another agent since it was read (possible on
            // SQLite only, which does not lock the row).
            tx.rollback().await?;
            return Ok(None);
        }
        // The previous lease, if it was not released, lapsed at its
        // lease_until (before now: no overlap).
        if let Some(u) = until {
            sqlx::query(&self.db.sql(
                "UPDATE transfer_leases SET ended_at = ?, end_reason = 'lapsed' \
                 WHERE transfer = ? AND epoch = ? AND ended_at IS NULL",
            ))
            .bind(u)
            .bind(id.as_i64())
            .bind(epoch)
            .execute(&mut *tx)
            .await?;
        }
        sqlx::query(&self.db.sql(
            "INSERT INTO transfer_leases (transfer, epoch, agent, claimed_at) VALUES (?, ?, ?, ?)",
        ))
        .bind(id.as_i64())
        .bind(epoch + 1)
        .bind(agent)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Some(Claim {
            epoch: epoch + 1,
            took_over_from: holder.filter(|h| h != agent && until.is_some()),
            lease_until,
        }))
    }

    /// Agent `agent` releases its lease of epoch `epoch` on transfer
    /// `id` (its run ended or stopped). Returns false if it no longer
    /// held it (another agent claimed the transfer since).
    ///
    /// # Errors
    /// SQL errors.
    pub async fn release_transfer(
        &self,
        id: TransferId,
        agent: &str,
        epoch: i64,
    ) -> Result<bool, CatalogError> {
        let mut tx = self.pool.begin().await?;
        let q = format!("SELECT {} AS now", self.db.now_ms());
        let now: i64 = sqlx::query_scalar(&q).fetch_one(&mut *tx).await?;
        let n = release_where(
            self,
            &mut tx,
            now,
            "id = ? AND holder = ? AND lease_epoch = ?",
            &[Bind::Int(id.as_i64()), Bind::Text(agent), Bind::Int(epoch)],
        )
        .await?;
        if n == 0 {
            tx.rollback().await?;
            return Ok(false);
        }
        tx.commit().await?;
        Ok(true)
    }

    /// Every lease transfer `id` had, oldest first.
    ///
    /// # Errors
    /// SQL errors.
    pub async fn transfer_leases(&self, id: TransferId) -> Result<Vec<LeaseRecord>, CatalogError> {
        let rows = sqlx::query(&self.db.sql(
            "SELECT epoch, agent, claimed_at, ended_at, end_reason FROM transfer_leases \
             WHERE transfer = ? ORDER BY epoch",
        ))
        .bind(id.as_i64())
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| {
                Ok(LeaseRecord {
                    epoch: r.try_get("epoch")?,
                    agent: r.try_get("agent")?,
                    claimed_at: r.try_get("claimed_at")?,
                    ended_at: r.try_get("ended_at")?,
                    end_reason: r.try_get("end_reason")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()?)
    }
}

/// Ends, on `tx` at `now`, the open lease records of the transfers
/// `cond` selects (its `?` bound to `args`, in order), then clears their
/// holders: a lease still live ends now (`released`), one that lapsed
/// ends at its `lease_until` (`lapsed`).
async fn release_where(
    c: &Catalog,
    tx: &mut sqlx::AnyConnection,
    now: i64,
    cond: &str,
    args: &[Bind<'_>],
) -> Result<u64, CatalogError> {
    // The transfers' rows are locked first, as a claim locks them (then
    // its lease record): the same order, so the two never deadlock.
    let q = format!(
        "SELECT id FROM transfers WHERE {cond}{}",
        c.db.lock_for_update()
    );
    let sql = c.db.sql(&q);
    let mut query = sqlx::query(&sql);
    for a in args {
        query = a.bind(query);
    }
    query.fetch_all(&mut *tx).await?;
    let until = "(SELECT t.lease_until FROM transfers t WHERE t.id = transfer_leases.transfer)";
    let q = format!(
        "UPDATE transfer_leases SET \
         end_reason = CASE WHEN {until} < ? THEN 'lapsed' ELSE 'released' END, \
         ended_at = {least}(COALESCE({until}, ?), ?) \
         WHERE ended_at IS NULL AND (transfer, epoch) IN \
         (SELECT id, lease_epoch FROM transfers WHERE {cond})",
        least = c.db.least()
    );
    let sql = c.db.sql(&q);
    let mut query = sqlx::query(&sql).bind(now).bind(now).bind(now);
    for a in args {
        query = a.bind(query);
    }
    query.execute(&mut *tx).await?;
    let q = format!("UPDATE transfers SET holder = NULL, lease_until = NULL WHERE {cond}");
    let sql = c.db.sql(&q);
    let mut query = sqlx::query(&sql);
    for a in args {
        query = a.bind(query);
    }
    Ok(query.execute(&mut *tx).await?.rows_affected())
}

/// A value bound to a `?` of [`release_where`]'s condition.
enum Bind<'a> {
    Int(i64),
    Text(&'a str),
}

impl<'a> Bind<'a> {
    fn bind<'q>(
        &self,
        q: sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments<'q>>,
    ) -> sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments<'q>>
    where
        'a: 'q,
    {
        match *self {
            Bind::Int(v) => q.bind(v),
            Bind::Text(v) => q.bind(v),
        }
    }
}
