//! The recorded history ([`crate::events`]) as a trace in the format of
//! [`scheduler::trace`], for `GET /v1/trace` and `ferry replay`.
//!
//! [`Catalog::export_trace`] reads what it needs in one read transaction
//! (one snapshot of the catalog) and [`assemble`] builds the trace from it
//! without I/O. The rules, also in ARCHITECTURE.md ("Recorded events"):
//!
//! - Lines: every event made at or after `since`, in time order (by
//!   `at_ms`, then by row id, so events of the same millisecond keep the
//!   order they were made in).
//! - Header links: the agent's configured links, each with the rate cap
//!   in force at `since` (its last `rate` event at or before `since`, else
//!   the configured rate) and the configured RTT hint.
//! - Header jobs: each job's size and importance at `since` (its last
//!   `job` event at or before `since`). A job whose first `job` event comes
//!   after `since` did not exist then and enters with that line; a job with
//!   no `job` event at all (none can be missing since catalog version 5
//!   recorded every job) is taken from the `jobs` table.
//! - The queue at `since`: every transfer that arrived before `since` and
//!   had not finished by then (no `finished_at` before `since`, not
//!   cancelled before `since`) arrives again at `since`, with its class and
//!   importance as they were then and, if it was paused then, a `pause`
//!   line right after. Its bytes are its whole size: how much was left at
//!   `since` is not recorded.
//! - Bytes of an arrival not known when it was recorded (a pushed
//!   directory is listed when its run starts, a watched checkpoint is
//!   still being written) are the transfer's `bytes_total` at export time:
//!   the listing's or sealed manifest's size, or what is known so far of a
//!   checkpoint still being written.
//! - What a trace cannot hold is left out and counted
//!   ([`TraceExport::left_out`]): arrivals on links the agent no longer has
//!   (the header lists only configured links) and the changes of those
//!   transfers, rate changes of such links, and changes of a transfer that
//!   has not arrived in the trace (e.g. one made after it finished before
//!   `since`). So the result always passes [`scheduler::trace::Trace::parse`].
//! - Signals before `since` are not carried over, so a job's live severity
//!   and a transfer's promotion to `urgent` at `since` are not in the trace:
//!   start a trace a few half-lives before the period of interest.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap, HashSet};

use ferry_proto::state::TransferId;
use scheduler::trace::{Event as Line, Header, JobSpec, LinkSpec, Trace, What, TRACE_VERSION};
use scheduler::Class;
use sqlx::any::AnyRow;
use sqlx::Row;

use crate::events::{event_row, Change, Event, EVENT_COLS};
use crate::jobs::{job_row, Job, JOB_COLS};
use crate::{Catalog, CatalogError};

/// A trace of the recorded history and what it had to leave out.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceExport {
    /// The trace; [`Trace::to_json_lines`] gives its text.
    pub trace: Trace,
    /// Recorded events left out because the trace cannot hold them (see
    /// the module docs): on links the agent no longer has, or about a
    /// transfer that has not arrived in the trace.
    pub left_out: usize,
}

/// What the export reads from the catalog, for [`assemble`].
#[derive(Debug, Default)]
pub(crate) struct History {
    /// Events at or after `since`, in time order, each with its
    /// transfer's `bytes_total` now (for arrivals whose bytes were
    /// unknown).
    pub window: Vec<(Event, Option<u64>)>,
    /// Arrival, class, importance, pause, resume and cancel events before
    /// `since` of the transfers not finished before `since`, in time
    /// order, each with its transfer's `bytes_total` now.
    pub queue: Vec<(Event, Option<u64>)>,
    /// Rate and job events at or before `since`, in time order.
    pub settings: Vec<Event>,
    /// The `jobs` table.
    pub jobs: Vec<Job>,
}

/// A transfer in the queue at `since`, as it was then.
struct Queued {
    link: String,
    job: String,
    class: Class,
    importance: Option<f64>,
    bytes: u64,
    paused: bool,
    cancelled: bool,
}

/// The trace of `h` from `since` (Unix ms) over `links` (each with its
/// configured rate cap and RTT hint); see the module docs for the rules.
pub(crate) fn assemble(since: i64, links: &[LinkSpec], h: History) -> TraceExport {
    let mut left_out = 0;
    let mut rate_at: HashMap<&str, u64> = HashMap::new();
    let mut jobs: BTreeMap<String, JobSpec> = BTreeMap::new();
    for e in &h.settings {
        match &e.change {
            Change::Rate { link, rate_bps } => {
                rate_at.insert(link, *rate_bps);
            }
            Change::Job {
                job,
                model_params,
                importance,
            } => {
                jobs.insert(job.clone(), job_spec(job, *model_params, *importance));
            }
            _ => {}
        }
    }
    let header_links: Vec<LinkSpec> = links
        .iter()
        .map(|l| LinkSpec {
            rate_bps: rate_at.get(l.link.as_str()).copied().unwrap_or(l.rate_bps),
            ..l.clone()
        })
        .collect();
    let on_link: HashSet<&str> = links.iter().map(|l| l.link.as_str()).collect();
    let recorded: HashSet<&str> = h
        .settings
        .iter()
        .chain(h.window.iter().map(|(e, _)| e))
        .filter_map(|e| match &e.change {
            Change::Job { job, .. } => Some(job.as_str()),
            _ => None,
        })
        .collect();
    for j in &h.jobs {
        if !recorded.contains(j.name.as_str()) {
            jobs.insert(
                j.name.clone(),
                job_spec(&j.name, j.model_params, j.importance),
            );
        }
    }

    let mut order: Vec<TransferId> = Vec::new();
    let mut queue: HashMap<TransferId, Queued> = HashMap::new();
    for (e, total) in h.queue {
        match e.change {
            Change::Arrival {
                transfer,
                link,
                job,
                class,
                importance,
                bytes,
            } => {
                if let Entry::Vacant(v) = queue.entry(transfer) {
                    order.push(transfer);
                    v.insert(Queued {
                        link,
                        job,
                        class,
                        importance,
                        bytes: bytes.or(total).unwrap_or(0),
                        paused: false,
                        cancelled: false,
                    });
                }
            }
            Change::Class { transfer, class } => {
                if let Some(q) = queue.get_mut(&transfer) {
                    q.class = class;
                }
            }
            Change::Importance {
                transfer,
                importance,
            } => {
                if let Some(q) = queue.get_mut(&transfer) {
                    q.importance = importance;
                }
            }
            Change::Pause { transfer } | Change::Resume { transfer } => {
                if let Some(q) = queue.get_mut(&transfer) {
                    q.paused = matches!(e.change, Change::Pause { .. });
                }
            }
            Change::Cancel { transfer } => {
                if let Some(q) = queue.get_mut(&transfer) {
                    q.cancelled = true;
                }
            }
            Change::Job { .. } | Change::Rate { .. } | Change::Signal { .. } => {}
        }
    }

    let mut lines = Vec::new();
    let mut arrived: HashSet<TransferId> = HashSet::new();
    let at = |at_ms: i64, what: What| Line { at_ms, what };
    for id in order {
        let Some(q) = queue.remove(&id) else {
            continue;
        };
        if q.cancelled {
            continue;
        }
        if !on_link.contains(q.link.as_str()) {
            left_out += 1;
            continue;
        }
        arrived.insert(id);
        lines.push(at(
            since,
            What::Arrival {
                id,
                link: q.link,
                bytes: q.bytes,
                class: q.class,
                job: q.job,
                importance: q.importance,
                deadline_ms: None,
            },
        ));
        if q.paused {
            lines.push(at(since, What::Pause { id }));
        }
    }
    for (e, total) in h.window {
        let what = match e.change {
            Change::Arrival {
                transfer,
                link,
                job,
                class,
                importance,
                bytes,
            } => {
                if !on_link.contains(link.as_str()) || !arrived.insert(transfer) {
                    left_out += 1;
                    continue;
                }
                What::Arrival {
                    id: transfer,
                    link,
                    bytes: bytes.or(total).unwrap_or(0),
                    class,
                    job,
                    importance,
                    deadline_ms: None,
                }
            }
            Change::Class { transfer, .. }
            | Change::Importance { transfer, .. }
            | Change::Pause { transfer }
            | Change::Resume { transfer }
            | Change::Cancel { transfer }
                if !arrived.contains(&transfer) =>
            {
                left_out += 1;
                continue;
            }
            Change::Class { transfer, class } => What::Class {
                id: transfer,
                class,
            },
            Change::Importance {
                transfer,
                importance,
            } => What::Importance {
                id: transfer,
                importance,
            },
            Change::Pause { transfer } => What::Pause { id: transfer },
            Change::Resume { transfer } => What::Resume { id: transfer },
            Change::Cancel { transfer } => What::Cancel { id: transfer },
            Change::Job {
                job,
                model_params,
                importance,
            } => What::Job(job_spec(&job, model_params, importance)),
            Change::Rate { link, .. } if !on_link.contains(link.as_str()) => {
                left_out += 1;
                continue;
            }
            Change::Rate { link, rate_bps } => What::Rate { link, rate_bps },
            Change::Signal {
                job,
                kind,
                severity,
            } => What::Signal {
                job,
                severity,
                kind: Some(kind),
            },
        };
        lines.push(at(e.at_ms, what));
    }
    TraceExport {
        trace: Trace {
            header: Header {
                ferry_trace: TRACE_VERSION,
                chunk_bytes: None,
                links: header_links,
                jobs: jobs.into_values().collect(),
            },
            events: lines,
        },
        left_out,
    }
}

fn job_spec(job: &str, model_params: Option<f64>, importance: f64) -> JobSpec {
    JobSpec {
        job: job.to_string(),
        model_params,
        importance,
    }
}

/// An event row with its transfer's `bytes_total` (column
/// `transfer_bytes`, `NULL` when it is about no transfer).
fn event_with_bytes(r: &AnyRow) -> Result<(Event, Option<u64>), sqlx::Error> {
    let bytes: Option<i64> = r.try_get("transfer_bytes")?;
    let bytes = bytes
        .map(|b| {
            u64::try_from(b).map_err(|_| sqlx::Error::ColumnDecode {
                index: "bytes_total".into(),
                source: format!("negative size {b}").into(),
            })
        })
        .transpose()?;
    Ok((event_row(r)?, bytes))
}

impl Catalog {
    /// The recorded history from `since_ms` (Unix ms) as a trace in the
    /// format of [`scheduler::trace`] (version
    /// [`scheduler::trace::TRACE_VERSION`]), over `links`: the agent's
    /// configured links, each with its configured rate cap (bit/s, at
    /// least 1) and RTT hint (ms). The header's rates and jobs are those
    /// in force at `since_ms`, the transfers queued at `since_ms` arrive
    /// again then, and arrivals whose size was not known when recorded
    /// take the transfer's `bytes_total` now; see the module docs of
    /// `export.rs` for every rule. The trace always passes
    /// [`Trace::parse`]; what it cannot hold is counted in
    /// [`TraceExport::left_out`].
    ///
    /// # Errors
    /// SQL errors; a stored event of an unknown kind, missing a field its
    /// kind has, or with an importance or severity outside 0..1 or a rate
    /// below 1, is a decode error naming the column.
    pub async fn export_trace(
        &self,
        since_ms: i64,
        links: &[LinkSpec],
    ) -> Result<TraceExport, CatalogError> {
        // One read transaction: the four reads see one snapshot, so an
        // arrival and the changes made after it are never split by a
        // change committed in between.
        let mut tx = self.pool.begin().await?;
        let q = format!(
            "SELECT {EVENT_COLS}, t.bytes_total AS transfer_bytes FROM events e \
             LEFT JOIN transfers t ON t.id = e.transfer WHERE e.at_ms >= ? ORDER BY e.at_ms, e.id"
        );
        let window = sqlx::query(&self.db.sql(&q))
            .bind(since_ms)
            .fetch_all(&mut *tx)
            .await?
            .iter()
            .map(event_with_bytes)
            .collect::<Result<_, _>>()?;
        let q = format!(
            "SELECT {EVENT_COLS}, t.bytes_total AS transfer_bytes FROM events e \
             JOIN transfers t ON t.id = e.transfer WHERE e.at_ms < ? \
             AND e.kind IN ('arrival', 'class', 'importance', 'pause', 'resume', 'cancel') \
             AND (t.finished_at IS NULL OR t.finished_at >= ?) ORDER BY e.at_ms, e.id"
        );
        let queue = sqlx::query(&self.db.sql(&q))
            .bind(since_ms)
            .bind(since_ms)
            .fetch_all(&mut *tx)
            .await?
            .iter()
            .map(event_with_bytes)
            .collect::<Result<_, _>>()?;
        let q = format!(
            "SELECT {EVENT_COLS} FROM events e WHERE e.at_ms <= ? AND e.kind IN ('rate', 'job') \
             ORDER BY e.at_ms, e.id"
        );
        let settings = sqlx::query(&self.db.sql(&q))
            .bind(since_ms)
            .fetch_all(&mut *tx)
            .await?
            .iter()
            .map(event_row)
            .collect::<Result<_, _>>()?;
        let q = format!("SELECT {JOB_COLS} FROM jobs ORDER BY name");
        let jobs = sqlx::query(&self.db.sql(&q))
            .fetch_all(&mut *tx)
            .await?
            .iter()
            .map(job_row)
            .collect::<Result<_, _>>()?;
        tx.commit().await?;
        Ok(assemble(
            since_ms,
            links,
            History {
                window,
                queue,
                settings,
                jobs,
            },
        ))
    }
}
