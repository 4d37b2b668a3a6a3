//! Prometheus metrics and live rates.
//!
//! Each source and sink owns its own registry (no global recorder:
//! `ferry demo` runs two agents in one process) and renders it in the
//! Prometheus text exposition format (version 0.0.4); the API's
//! `/metrics` concatenates the two for an agent with both roles, after
//! each has updated the gauges computed at scrape time (queue depth and states from the catalog, rate caps and
//! utilisation from the source's sampler).
//!
//! Names follow `ferry_<name>_<unit>`; counters end in `_total`.
//!
//! Source:
//! - `ferry_sent_bytes_total{link,class}`: payload bytes written to QUIC
//!   streams (chunk bytes only: no record or batch headers, no QUIC
//!   retransmissions; chunks sent again are counted again), by the
//!   transfer's effective class when the chunk was written (`urgent` while
//!   a signal promotes it).
//! - `ferry_chunk_retries_total{link}`: chunks the sink asked for again
//!   (a `Need`: the chunk failed BLAKE3 on arrival, or was missing or wrong
//!   when the commit was checked), counted once per chunk each time the
//!   source queues such a request for re-sending. Not counted: chunks sent
//!   again because a transfer resumed on a new pool after its control
//!   connection was lost (the resumed run sends what the sink had not
//!   verified), chunks moved off a lost connection of the pool
//!   (`ferry_chunks_moved_total`), chunks of a watched
//!   file sent again because the file changed while it was written, and
//!   QUIC packet retransmissions.
//! - `ferry_chunks_moved_total{link}`: chunks queued again for the link's
//!   other connections because the connection they went on was lost
//!   before the sink confirmed their batch (protocol version 4; the
//!   control connection's loss restarts the pool instead and is not
//!   counted).
//! - `ferry_link_capacity_bits_per_second{link}`: the link's rate cap.
//! - `ferry_link_connections{link}`: QUIC connections of the link's pool
//!   open now (its `connections` setting when all are up).
//! - `ferry_link_utilisation_ratio{link}`: payload bit/s over the last
//!   [`RATE_WINDOW_MS`] divided by the rate cap (ARCHITECTURE.md
//!   "Measures": at most about 1448/1500 at a 1500-byte MTU).
//! - `ferry_queue_depth_transfers{link,class}`: transfers not in a final
//!   state, by link and effective class.
//! - `ferry_state_transfers{state}`: transfers per state.
//! - `ferry_job_backlog_bytes{job}`, `ferry_job_next_ready_seconds{job}`
//!   and `ferry_job_keeps_up{job}`: each job's outlook (a job with a
//!   source root here; see `Source::outlook`), computed at scrape time.
//! - `ferry_deadlines_total{class,outcome}`: transfer deadlines said to
//!   be `at_risk` (once, when the fluid model's ready time first passes
//!   the deadline), `met` or `missed` (once), by the transfer's class.
//!
//! Sink:
//! - `ferry_received_bytes_total{peer}`: payload bytes that matched their
//!   BLAKE3 hash and were written to staging, by source agent.
//! - `ferry_replicas_removed_total{reason}` and
//!   `ferry_replica_freed_bytes_total{reason}`: replicas removed since the
//!   sink started and their manifests' bytes, by `rule` (a retention
//!   policy), `pressure` or `operator`, counted when their files are gone.
//! - `ferry_pinned_replicas`: published replicas with a live pin.
//! - `ferry_leased_replicas`: versions a live reader lease holds.
//! - `ferry_verification_failures_total`: chunks whose bytes did not hash
//!   to the BLAKE3 sent with them, chunks whose verified hash differed
//!   from the sealed manifest's at commit, and sealed manifests that did
//!   not match the transfer's file table.
//! - `ferry_part_chunks_refused_total`: chunks of a striped transfer's
//!   part refused because their sender registered the part under an
//!   older epoch than the catalog's (the part was taken over).
//! - `ferry_published_replicas_total`: replicas published (moved into
//!   place) by this process.
//! - `ferry_commit_to_replica_lag_seconds{class}`: histogram of publish
//!   time minus the source's commit time (a pushed directory's commit is
//!   its push), by the class the replica was served in at commit
//!   (`unknown` from an older source).
//! - `ferry_eval_ready_phase_seconds{phase,class}`: histogram of the time
//!   each replica spent in each phase after its commit (ARCHITECTURE.md,
//!   "Time to eval-ready"): `waiting_for_writer`, `queued`, `sending`,
//!   `verifying`, `publishing`.
//! - `ferry_replica_state_replicas{state}`: sink-side rows per state.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

use ferry_catalog::CatalogError;
use ferry_proto::state::TransferState;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use scheduler::Class;
use serde::Serialize;

/// The `Content-Type` of [`render`]'s output: the Prometheus text
/// exposition format, version 0.0.4.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// Live rates (transfer, link, class) are averaged over about this long,
/// ms.
pub const RATE_WINDOW_MS: i64 = 5_000;

/// The source's sampler runs this often, ms.
pub const SAMPLE_EVERY_MS: u64 = 1_000;

/// Points of per-class throughput history kept per link: one per
/// sample, 10 minutes.
pub const HISTORY_POINTS: usize = 600;

/// Upper bounds of the commit-to-replica lag histogram's buckets,
/// seconds (0.1 s to 1 h).
pub const LAG_BUCKETS_S: [f64; 15] = [
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0,
];

/// Classes in index order (see [`class_index`]).
pub(crate) const CLASSES: [Class; 3] = [Class::Urgent, Class::Scheduled, Class::Background];

/// Source-side transfer states, always reported (0 when none).
const TRANSFER_STATES: [TransferState; 7] = [
    TransferState::Queued,
    TransferState::Active,
    TransferState::Paused,
    TransferState::Verifying,
    TransferState::Published,
    TransferState::Failed,
    TransferState::Cancelled,
];

/// Sink-side row states, always reported (0 when none).
const REPLICA_STATES: [TransferState; 6] = [
    TransferState::Receiving,
    TransferState::Published,
    TransferState::Failed,
    TransferState::Cancelled,
    TransferState::Removing,
    TransferState::Removed,
];

/// Position of `c` in [`CLASSES`].
pub(crate) fn class_index(c: Class) -> usize {
    match c {
        Class::Urgent => 0,
        Class::Scheduled => 1,
        Class::Background => 2,
    }
}

/// Why the metrics could not be rendered.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// Reading the catalog for the scrape-time gauges failed.
    #[error("reading the catalog for metrics: {0}")]
    Catalog(#[from] CatalogError),
    /// Encoding the text failed.
    #[error("encoding metrics: {0}")]
    Encode(#[from] std::fmt::Error),
}

// ------------------------------------------------------------- rates --

/// Bits per second between two readings of a byte counter.
fn bps(bytes: u64, ms: i64) -> f64 {
    if ms <= 0 {
        return 0.0;
    }
    bytes as f64 * 8.0 * 1000.0 / ms as f64
}

/// A sliding window over `N` cumulative byte counters sampled at explicit
/// times (Unix ms): rates are taken between the newest sample and the
/// newest one at least the window's width older (or the oldest kept,
/// while fewer have been taken).
#[derive(Debug, Clone)]
pub(crate) struct RateWindow<const N: usize> {
    width_ms: i64,
    samples: VecDeque<(i64, [u64; N])>,
}

impl<const N: usize> RateWindow<N> {
    /// An empty window `width_ms` wide.
    pub(crate) fn new(width_ms: i64) -> Self {
        RateWindow {
            width_ms: width_ms.max(1),
            samples: VecDeque::new(),
        }
    }

    /// Adds the counters' values at `at_ms`. A sample older than the
    /// newest (the clock stepped back) or a counter that went down (it
    /// was replaced) starts the window afresh.
    pub(crate) fn push(&mut self, at_ms: i64, totals: [u64; N]) {
        if let Some((t, v)) = self.samples.back() {
            if at_ms <= *t || v.iter().zip(&totals).any(|(old, new)| new < old) {
                self.samples.clear();
            }
        }
        self.samples.push_back((at_ms, totals));
        // Keep one sample at or before the window's start.
        while self
            .samples
            .get(1)
            .is_some_and(|(t, _)| *t <= at_ms - self.width_ms)
        {
            self.samples.pop_front();
        }
    }

    /// Bit/s of each counter over the window; 0 with fewer than two
    /// samples.
    pub(crate) fn rates_bps(&self) -> [f64; N] {
        let mut out = [0.0; N];
        if let (Some((t0, v0)), Some((t1, v1))) = (self.samples.front(), self.samples.back()) {
            for (i, o) in out.iter_mut().enumerate() {
                *o = bps(v1[i].saturating_sub(v0[i]), t1 - t0);
            }
        }
        out
    }
}

/// Payload bit/s of one link by class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct ClassRates {
    /// `urgent` class, bit/s.
    pub urgent: f64,
    /// `scheduled` class, bit/s.
    pub scheduled: f64,
    /// `background` class, bit/s.
    pub background: f64,
}

impl ClassRates {
    fn from_array(r: [f64; 3]) -> ClassRates {
        ClassRates {
            urgent: r[0],
            scheduled: r[1],
            background: r[2],
        }
    }

    /// All classes together, bit/s.
    pub fn total(&self) -> f64 {
        self.urgent + self.scheduled + self.background
    }
}

/// One second of a link's throughput history.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct HistoryPoint {
    /// End of the interval, Unix ms.
    pub at_ms: i64,
    /// `urgent` payload bit/s over the interval (about one second).
    pub urgent_bps: f64,
    /// `scheduled` payload bit/s over the interval.
    pub scheduled_bps: f64,
    /// `background` payload bit/s over the interval.
    pub background_bps: f64,
}

/// A link's live rates, as `Source::link_stats` reports them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LinkStats {
    /// Link name.
    pub name: String,
    /// The link's rate cap, bit/s: in a pool, the budget of all its
    /// agents on the link.
    pub rate_bps: u64,
    /// This agent's fraction of the cap, 0..1: 1 unless other agents of
    /// its pool run transfers on the link, when the class rules over the
    /// pool's active transfers divide it (ARCHITECTURE.md, "Pool").
    pub pool_fraction: f64,
    /// The rate this agent paces the link at, bit/s: `rate_bps` x
    /// `pool_fraction` (at least 1 Mbit/s).
    pub pace_bps: u64,
    /// QUIC connections the link is served by when all are up (its
    /// `connections` setting).
    pub connections: usize,
    /// Of those, open now: fewer after a connection of the pool was lost
    /// (until the pool is replaced once the link is idle), 0 while the
    /// link is not connected.
    pub connections_open: usize,
    /// For a link naming several sink agents (`more_peers`): the one its
    /// connections go to now, by certificate name; absent while the link
    /// is not connected, and for a link to one sink agent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sink: Option<String>,
    /// Payload bit/s written to the link, all classes, over the last
    /// [`RATE_WINDOW_MS`] (resent chunks included).
    pub goodput_bps: f64,
    /// `goodput_bps / pace_bps` (0 with no cap), a ratio: at most about
    /// 0.97 on a full link (payload is about 1448 of every 1500 bytes on
    /// the wire), more for a few seconds after the cap is lowered.
    pub utilisation: f64,
    /// Payload bit/s per class over the last [`RATE_WINDOW_MS`].
    pub class_bps: ClassRates,
    /// Per-class payload bit/s, one point per sample (every second),
    /// oldest first, the last 10 minutes at most ([`HISTORY_POINTS`]);
    /// empty when not asked for.
    pub history: Vec<HistoryPoint>,
}

/// A link's rate window by class and its per-second history.
#[derive(Debug, Clone)]
pub(crate) struct LinkSampler {
    window: RateWindow<3>,
    last: Option<(i64, [u64; 3])>,
    history: VecDeque<HistoryPoint>,
}

impl Default for LinkSampler {
    fn default() -> Self {
        LinkSampler {
            window: RateWindow::new(RATE_WINDOW_MS),
            last: None,
            history: VecDeque::with_capacity(HISTORY_POINTS),
        }
    }
}

impl LinkSampler {
    /// Adds the link's cumulative payload bytes per class (in
    /// [`CLASSES`] order) at `at_ms`; from the second sample on, a
    /// history point covers the interval since the previous one.
    pub(crate) fn sample(&mut self, at_ms: i64, totals: [u64; 3]) {
        self.window.push(at_ms, totals);
        if let Some((t, v)) = self.last {
            if at_ms > t {
                let r = |i: usize| bps(totals[i].saturating_sub(v[i]), at_ms - t);
                if self.history.len() == HISTORY_POINTS {
                    self.history.pop_front();
                }
                self.history.push_back(HistoryPoint {
                    at_ms,
                    urgent_bps: r(0),
                    scheduled_bps: r(1),
                    background_bps: r(2),
                });
            }
        }
        self.last = Some((at_ms, totals));
    }

    /// Payload bit/s per class over the window.
    pub(crate) fn class_rates(&self) -> ClassRates {
        ClassRates::from_array(self.window.rates_bps())
    }

    /// The history, oldest first.
    pub(crate) fn history(&self) -> Vec<HistoryPoint> {
        self.history.iter().copied().collect()
    }
}

// ----------------------------------------------------------- labels --

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LinkLabel {
    link: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RootLabel {
    root: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LinkClassLabel {
    link: String,
    class: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct JobLabel {
    job: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeadlineLabel {
    class: &'static str,
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PeerLabel {
    peer: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClassLabel {
    class: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseClassLabel {
    phase: String,
    class: String,
}

/// A histogram with the lag's buckets ([`LAG_BUCKETS_S`]).
fn lag_histogram() -> Histogram {
    Histogram::new(LAG_BUCKETS_S)
}

/// Upper bounds of the phase histogram's buckets, seconds: the lag's,
/// with finer ones below 0.1 s (verifying and publishing take tens of
/// ms).
pub const PHASE_BUCKETS_S: [f64; 19] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
    1200.0, 1800.0, 3600.0,
];

/// A histogram with [`PHASE_BUCKETS_S`].
fn phase_histogram() -> Histogram {
    Histogram::new(PHASE_BUCKETS_S)
}

/// Histograms by label, each with the lag's buckets.
type LagFamily<L> = Family<L, Histogram, fn() -> Histogram>;

pub(crate) fn encode(registry: &Registry) -> Result<String, std::fmt::Error> {
    let mut out = String::new();
    prometheus_client::encoding::prometheus_text::encode(&mut out, registry)?;
    Ok(out)
}

/// Sets `family` to `counts` by state, every state of `always` included.
fn set_states(
    family: &Family<StateLabel, Gauge>,
    always: &[TransferState],
    counts: &[(TransferState, i64)],
) {
    family.clear();
    let label = |s: &TransferState| StateLabel {
        state: s.as_str().to_string(),
    };
    for s in always {
        family.get_or_create(&label(s)).set(0);
    }
    for (s, n) in counts {
        family.get_or_create(&label(s)).set(*n);
    }
}

// ----------------------------------------------------------- source --

/// One link's counters, created once so that the send path only adds to
/// atomics.
#[derive(Debug, Clone, Default)]
pub(crate) struct LinkCounters {
    /// Payload bytes written, by class in [`CLASSES`] order.
    pub(crate) sent: [Counter; 3],
    /// Chunks the sink asked for again.
    pub(crate) retries: Counter,
    /// Chunks moved to other connections after theirs was lost.
    pub(crate) moved: Counter,
}

impl LinkCounters {
    /// Payload bytes written so far, by class in [`CLASSES`] order.
    pub(crate) fn sent_totals(&self) -> [u64; 3] {
        [self.sent[0].get(), self.sent[1].get(), self.sent[2].get()]
    }
}

/// How long a scrape waits for the catalog before it renders without the
/// gauges read from it (2 s): `/metrics` must answer while the catalog
/// does not, so that `ferry_catalog_up` 0 reaches Prometheus.
pub const SCRAPE_CATALOG_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// What the source knows at scrape time.
#[derive(Debug, Default)]
pub(crate) struct SourceScrape {
    /// Per configured link: name, rate cap (bit/s), utilisation (ratio),
    /// connections open.
    pub(crate) links: Vec<(String, u64, f64, usize)>,
    /// From the catalog (`None` when it did not answer in time: those
    /// gauges keep their last values): transfers not in a final state by
    /// link and effective class, and transfers per state.
    pub(crate) catalog: Option<(QueueDepths, Vec<(TransferState, i64)>)>,
}

/// Transfers not in a final state by link and effective class.
pub(crate) type QueueDepths = HashMap<(String, Class), i64>;

/// The source's registry.
pub(crate) struct SourceMetrics {
    registry: Registry,
    /// Held while the scrape-time gauges are set and the text encoded.
    scrape: Mutex<()>,
    sent: Family<LinkClassLabel, Counter>,
    retries: Family<LinkLabel, Counter>,
    moved: Family<LinkLabel, Counter>,
    capacity: Family<LinkLabel, Gauge>,
    connections: Family<LinkLabel, Gauge>,
    utilisation: Family<LinkLabel, Gauge<f64, AtomicU64>>,
    queue_depth: Family<LinkClassLabel, Gauge>,
    states: Family<StateLabel, Gauge>,
    root_watched: Family<RootLabel, Gauge>,
    root_refused: Family<RootLabel, Gauge>,
    deadlines: Family<DeadlineLabel, Counter>,
    job_backlog: Family<JobLabel, Gauge>,
    job_next_ready: Family<JobLabel, Gauge<f64, AtomicU64>>,
    job_keeps_up: Family<JobLabel, Gauge>,
}

/// One job's outlook for the scrape-time gauges: job, backlog (bytes),
/// seconds until a checkpoint committed now is ready (`None`: never),
/// whether replication keeps up with its interval (`None`: unknown).
pub(crate) type JobGauges = (String, u64, Option<f64>, Option<bool>);

impl std::fmt::Debug for SourceMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceMetrics").finish_non_exhaustive()
    }
}

impl SourceMetrics {
    /// A registry with the source's metrics.
    pub(crate) fn new() -> SourceMetrics {
        let mut registry = Registry::default();
        let m = SourceMetrics {
            registry: Registry::default(),
            scrape: Mutex::new(()),
            sent: Family::default(),
            retries: Family::default(),
            moved: Family::default(),
            capacity: Family::default(),
            connections: Family::default(),
            utilisation: Family::default(),
            queue_depth: Family::default(),
            states: Family::default(),
            root_watched: Family::default(),
            root_refused: Family::default(),
            deadlines: Family::default(),
            job_backlog: Family::default(),
            job_next_ready: Family::default(),
            job_keeps_up: Family::default(),
        };
        registry.register(
            "ferry_job_backlog_bytes",
            "Bytes of the job's unfinished transfers, by job (jobs with a source root here), \
             in bytes",
            m.job_backlog.clone(),
        );
        registry.register(
            "ferry_job_next_ready_seconds",
            "When a checkpoint of the job committed now would be ready at the sink, by the \
             fluid model of its link at the current queue and rates, in seconds from now",
            m.job_next_ready.clone(),
        );
        registry.register(
            "ferry_job_keeps_up",
            "1 if one checkpoint per the job's checkpoint interval fits in what its link \
             gives it, 0 if not (see GET /v1/jobs/JOB/outlook for the advice); absent until \
             the job has two checkpoints",
            m.job_keeps_up.clone(),
        );
        registry.register(
            "ferry_deadlines",
            "Transfer deadlines this source said something about, by class and outcome: \
             at_risk (the fluid model's ready time passed the deadline, said once), met or \
             missed (said once), in transfers",
            m.deadlines.clone(),
        );
        registry.register(
            "ferry_sent_bytes",
            "Payload bytes the source wrote to QUIC streams (chunk bytes, resent chunks \
             included), by link and by the transfer's effective class when written, in bytes",
            m.sent.clone(),
        );
        registry.register(
            "ferry_chunk_retries",
            "Chunks the sink asked for again (failed BLAKE3 on arrival, or missing or wrong \
             at commit) that the source queued for re-sending, by link, in chunks",
            m.retries.clone(),
        );
        registry.register(
            "ferry_chunks_moved",
            "Chunks queued again for the link's other connections because the connection they \
             went on was lost before the sink confirmed them, by link, in chunks",
            m.moved.clone(),
        );
        registry.register(
            "ferry_link_capacity_bits_per_second",
            "The link's rate cap (Ferry's share of the WAN), in bits per second",
            m.capacity.clone(),
        );
        registry.register(
            "ferry_link_connections",
            "QUIC connections of the link's pool open now, in connections (fewer than its \
             connections setting after one was lost; 0 while not connected)",
            m.connections.clone(),
        );
        registry.register(
            "ferry_link_utilisation_ratio",
            "Payload bits per second sent on the link over the last 5 seconds divided by its \
             rate cap, a ratio (at most about 1448/1500)",
            m.utilisation.clone(),
        );
        registry.register(
            "ferry_queue_depth_transfers",
            "Transfers not in a final state, by link and effective class, in transfers",
            m.queue_depth.clone(),
        );
        registry.register(
            "ferry_state_transfers",
            "Transfers per state, in transfers",
            m.states.clone(),
        );
        registry.register(
            "ferry_root_watched",
            "In a pool: 1 while some agent holds a live watch of this source root, as this \
             agent last read the catalog, else 0 (nobody follows its new checkpoints)",
            m.root_watched.clone(),
        );
        registry.register(
            "ferry_root_refused",
            "In a pool: 1 while this agent refuses to watch this source root (its view of the \
             root differs from the other agents', or it cannot list it), else 0",
            m.root_refused.clone(),
        );
        SourceMetrics { registry, ..m }
    }

    /// Sets the watch gauges of source root `root` (in a pool).
    pub(crate) fn set_root_watch(&self, root: &str, watched: bool, refused: bool) {
        let l = RootLabel {
            root: root.to_string(),
        };
        self.root_watched.get_or_create(&l).set(i64::from(watched));
        self.root_refused.get_or_create(&l).set(i64::from(refused));
    }

    /// Counts a deadline of a transfer in `class` said to be `outcome`
    /// (`at_risk`, `met` or `missed`).
    pub(crate) fn count_deadline(&self, class: Class, outcome: &'static str) {
        self.deadlines
            .get_or_create(&DeadlineLabel {
                class: class.as_str(),
                outcome,
            })
            .inc();
    }

    /// Sets the jobs' outlook gauges (all jobs: the ones not listed go).
    pub(crate) fn set_jobs(&self, jobs: &[JobGauges]) {
        self.job_backlog.clear();
        self.job_next_ready.clear();
        self.job_keeps_up.clear();
        for (job, backlog, next, keeps) in jobs {
            let l = JobLabel { job: job.clone() };
            self.job_backlog
                .get_or_create(&l)
                .set(i64::try_from(*backlog).unwrap_or(i64::MAX));
            if let Some(n) = next {
                self.job_next_ready.get_or_create(&l).set(*n);
            }
            if let Some(k) = keeps {
                self.job_keeps_up.get_or_create(&l).set(i64::from(*k));
            }
        }
    }

    /// The counters of `link`, created now (each a handle on the
    /// registry's series, so the send path needs no label lookup).
    pub(crate) fn link(&self, link: &str) -> LinkCounters {
        let sent = CLASSES.map(|c| {
            self.sent
                .get_or_create(&LinkClassLabel {
                    link: link.to_string(),
                    class: c.as_str(),
                })
                .clone()
        });
        let label = LinkLabel {
            link: link.to_string(),
        };
        let retries = self.retries.get_or_create(&label).clone();
        let moved = self.moved.get_or_create(&label).clone();
        LinkCounters {
            sent,
            retries,
            moved,
        }
    }

    /// Sets the scrape-time gauges from `s` and encodes the registry.
    pub(crate) fn render(&self, s: &SourceScrape) -> Result<String, std::fmt::Error> {
        let _one = crate::lock::lock(&self.scrape);
        self.capacity.clear();
        self.connections.clear();
        self.utilisation.clear();
        if s.catalog.is_some() {
            self.queue_depth.clear();
        }
        for (link, cap, util, open) in &s.links {
            let l = LinkLabel { link: link.clone() };
            self.capacity
                .get_or_create(&l)
                .set(i64::try_from(*cap).unwrap_or(i64::MAX));
            self.connections
                .get_or_create(&l)
                .set(i64::try_from(*open).unwrap_or(i64::MAX));
            self.utilisation.get_or_create(&l).set(*util);
            if s.catalog.is_some() {
                for c in CLASSES {
                    self.queue_depth
                        .get_or_create(&LinkClassLabel {
                            link: link.clone(),
                            class: c.as_str(),
                        })
                        .set(0);
                }
            }
        }
        if let Some((queued, states)) = &s.catalog {
            for ((link, class), n) in queued {
                self.queue_depth
                    .get_or_create(&LinkClassLabel {
                        link: link.clone(),
                        class: class.as_str(),
                    })
                    .set(*n);
            }
            set_states(&self.states, &TRANSFER_STATES, states);
        }
        encode(&self.registry)
    }
}

// ------------------------------------------------------------- sink --

/// The sink's registry.
pub(crate) struct SinkMetrics {
    registry: Registry,
    scrape: Mutex<()>,
    received: Family<PeerLabel, Counter>,
    /// Payload bytes verified and written to staging, every peer.
    pub(crate) received_total: Counter,
    /// Chunks and manifests that failed verification.
    pub(crate) verification_failures: Counter,
    /// Chunks of parts refused for an older epoch.
    pub(crate) part_chunks_refused: Counter,
    /// Commit-to-replica lag, seconds, by class.
    lag: LagFamily<ClassLabel>,
    /// Phases after the commit, seconds, by phase and class.
    phases: LagFamily<PhaseClassLabel>,
    /// Replicas published.
    pub(crate) published: Counter,
    replica_states: Family<StateLabel, Gauge>,
    read_back_wall: Counter<f64, AtomicU64>,
    read_back_cpu: Counter<f64, AtomicU64>,
    removed: Family<ReasonLabel, Counter>,
    freed: Family<ReasonLabel, Counter>,
    pinned: Gauge,
    leased: Gauge,
}

/// What a sink's scrape reads from its catalog: replicas per state, and
/// the pinned and leased counts.
pub(crate) type SinkGauges<'a> = (&'a [(TransferState, i64)], i64, i64);

impl std::fmt::Debug for SinkMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SinkMetrics").finish_non_exhaustive()
    }
}

impl SinkMetrics {
    /// A registry with the sink's metrics.
    pub(crate) fn new() -> SinkMetrics {
        let mut registry = Registry::default();
        let m = SinkMetrics {
            registry: Registry::default(),
            scrape: Mutex::new(()),
            received: Family::default(),
            received_total: Counter::default(),
            verification_failures: Counter::default(),
            part_chunks_refused: Counter::default(),
            lag: Family::new_with_constructor(lag_histogram as fn() -> Histogram),
            phases: Family::new_with_constructor(phase_histogram as fn() -> Histogram),
            published: Counter::default(),
            replica_states: Family::default(),
            read_back_wall: Counter::default(),
            read_back_cpu: Counter::default(),
            removed: Family::default(),
            freed: Family::default(),
            pinned: Gauge::default(),
            leased: Gauge::default(),
        };
        registry.register(
            "ferry_received_bytes",
            "Payload bytes that matched their BLAKE3 hash and were written to staging, by \
             source agent, in bytes",
            m.received.clone(),
        );
        registry.register(
            "ferry_verification_failures",
            "Chunks that failed BLAKE3 verification on arrival or differed from the sealed \
             manifest at commit, plus sealed manifests that did not match the transfer's file \
             table, in chunks (manifests count one each)",
            m.verification_failures.clone(),
        );
        registry.register(
            "ferry_part_chunks_refused",
            "Chunks of a striped transfer's part refused because their sender registered the \
             part under an older epoch than the sink's catalog holds (the part was taken over), \
             in chunks",
            m.part_chunks_refused.clone(),
        );
        registry.register(
            "ferry_published_replicas",
            "Replicas published by this sink since it started, in replicas",
            m.published.clone(),
        );
        registry.register(
            "ferry_commit_to_replica_lag_seconds",
            "Publish time at the sink minus the source's commit time, for replicas whose \
             commit time is known (negative values from clock skew count as 0), in seconds",
            m.lag.clone(),
        );
        registry.register(
            "ferry_eval_ready_phase_seconds",
            "Time each replica spent in each phase after its checkpoint's commit (phase: \
             waiting_for_writer, queued, sending, verifying, publishing; measured on the source's \
             and the sink's monotonic clocks), by the class it was served in, in seconds",
            m.phases.clone(),
        );
        registry.register(
            "ferry_replica_state_replicas",
            "Sink-side transfers and replicas per state, in replicas",
            m.replica_states.clone(),
        );
        registry.register(
            "ferry_read_back_seconds",
            "Wall time spent reading staging back and checking every chunk's BLAKE3 hash before \
             publishing ([sink] reread_before_publish), in seconds",
            m.read_back_wall.clone(),
        );
        registry.register(
            "ferry_read_back_cpu_seconds",
            "CPU time (user and system, summed over the reading threads) spent reading staging \
             back before publishing, in seconds",
            m.read_back_cpu.clone(),
        );
        registry.register(
            "ferry_replicas_removed",
            "Replicas removed since this sink started (their files deleted), by reason: rule \
             (a retention policy), pressure (space) or operator, in replicas",
            m.removed.clone(),
        );
        registry.register(
            "ferry_replica_freed_bytes",
            "Bytes of the replicas removed since this sink started (their manifests' sizes; a \
             file shared with another version by a hard link frees less), by reason, in bytes",
            m.freed.clone(),
        );
        registry.register(
            "ferry_pinned_replicas",
            "Published replicas with a live pin, in replicas",
            m.pinned.clone(),
        );
        registry.register(
            "ferry_leased_replicas",
            "Replica versions a live reader lease holds, in replicas",
            m.leased.clone(),
        );
        for r in ferry_catalog::RemovalReason::ALL {
            m.removed_by(r);
        }
        SinkMetrics { registry, ..m }
    }

    /// Counts one read-back before a publish.
    pub(crate) fn note_read_back(&self, r: crate::storage::ReadBack) {
        self.read_back_wall.inc_by(r.wall.as_secs_f64());
        self.read_back_cpu.inc_by(r.cpu.as_secs_f64());
    }

    /// The received-bytes counter of `peer` (a handle: keep it per
    /// connection).
    pub(crate) fn received_for(&self, peer: &str) -> Counter {
        self.received
            .get_or_create(&PeerLabel {
                peer: peer.to_string(),
            })
            .clone()
    }

    /// Records a commit-to-replica lag of `lag_s` seconds of a replica
    /// served in `class`.
    pub(crate) fn observe_lag(&self, lag_s: f64, class: &str) {
        if lag_s.is_finite() {
            self.lag
                .get_or_create(&ClassLabel {
                    class: class.to_string(),
                })
                .observe(lag_s.max(0.0));
        }
    }

    /// Records each phase after the commit of a replica served in
    /// `class`.
    pub(crate) fn observe_phases(&self, p: &ferry_proto::phases::Phases, class: &str) {
        for (phase, d) in &p.after {
            self.phases
                .get_or_create(&PhaseClassLabel {
                    phase: phase.as_str().to_string(),
                    class: class.to_string(),
                })
                .observe(d.as_secs_f64());
        }
    }

    /// Counts a finished removal of `bytes` for `reason`.
    pub(crate) fn removed(&self, reason: ferry_catalog::RemovalReason, bytes: u64) {
        self.removed_by(reason).inc();
        self.freed
            .get_or_create(&ReasonLabel {
                reason: reason.as_str().to_string(),
            })
            .inc_by(bytes);
    }

    fn removed_by(&self, reason: ferry_catalog::RemovalReason) -> Counter {
        let label = ReasonLabel {
            reason: reason.as_str().to_string(),
        };
        let _ = self.freed.get_or_create(&label);
        self.removed.get_or_create(&label).clone()
    }

    /// Sets the replica-state gauges from `states` and the pinned and
    /// leased counts, and encodes the registry.
    pub(crate) fn render(
        &self,
        catalog: Option<SinkGauges<'_>>,
    ) -> Result<String, std::fmt::Error> {
        let _one = crate::lock::lock(&self.scrape);
        // Without the catalog (it did not answer in time) the gauges read
        // from it keep their last values.
        if let Some((states, pinned, leased)) = catalog {
            set_states(&self.replica_states, &REPLICA_STATES, states);
            self.pinned.set(pinned);
            self.leased.set(leased);
        }
        encode(&self.registry)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const MB: u64 = 1_000_000;

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() <= 1e-9 * b.abs().max(1.0), "{a} != {b}");
    }

    #[test]
    fn window_rate_spans_about_five_seconds() {
        let mut w = RateWindow::<1>::new(5_000);
        assert_eq!(w.rates_bps(), [0.0]);
        w.push(10_000, [0]);
        assert_eq!(w.rates_bps(), [0.0], "one sample has no rate");
        // 1 MB per second for 3 s: 8 Mbit/s over the 3 s seen so far.
        for s in 1..=3 {
            w.push(10_000 + s * 1000, [s as u64 * MB]);
        }
        assert_eq!(w.rates_bps(), [8e6]);
        // Then 3 MB/s for 5 s: the window drops the slow seconds.
        for s in 1..=5 {
            w.push(13_000 + s * 1000, [3 * MB + s as u64 * 3 * MB]);
        }
        assert_eq!(w.rates_bps(), [24e6]);
        // Idle for 5 s: back to 0.
        for s in 1..=5 {
            w.push(18_000 + s * 1000, [18 * MB]);
        }
        assert_eq!(w.rates_bps(), [0.0]);
    }

    #[test]
    fn window_covers_a_late_sample_and_restarts_when_counters_go_back() {
        let mut w = RateWindow::<2>::new(5_000);
        w.push(0, [0, 0]);
        // A sampler that fell behind: 9 s since the last sample.
        w.push(9_000, [9 * MB, 0]);
        assert_eq!(w.rates_bps(), [8e6, 0.0]);
        // The counter was replaced (a transfer restarted): fresh window.
        w.push(10_000, [MB, 0]);
        assert_eq!(w.rates_bps(), [0.0, 0.0]);
        w.push(11_000, [2 * MB, MB / 2]);
        assert_eq!(w.rates_bps(), [8e6, 4e6]);
        // The clock stepped back: fresh window too.
        w.push(5_000, [3 * MB, MB]);
        assert_eq!(w.rates_bps(), [0.0, 0.0]);
    }

    #[test]
    fn history_has_one_point_per_sample_by_class_capped_at_ten_minutes() {
        let mut l = LinkSampler::default();
        l.sample(1_000, [0, 0, 0]);
        assert!(l.history().is_empty(), "the first sample has no interval");
        l.sample(2_000, [MB, 2 * MB, 0]);
        l.sample(2_500, [MB, 2 * MB, MB]);
        assert_eq!(
            l.history(),
            vec![
                HistoryPoint {
                    at_ms: 2_000,
                    urgent_bps: 8e6,
                    scheduled_bps: 16e6,
                    background_bps: 0.0,
                },
                HistoryPoint {
                    at_ms: 2_500,
                    urgent_bps: 0.0,
                    scheduled_bps: 0.0,
                    background_bps: 16e6,
                },
            ]
        );
        // Over the 1.5 s seen so far.
        let r = l.class_rates();
        close(r.urgent, 8e6 / 1.5);
        close(r.scheduled, 16e6 / 1.5);
        close(r.background, 8e6 / 1.5);
        close(r.total(), 32e6 / 1.5);
        for s in 0..700u64 {
            l.sample(3_000 + s as i64 * 1000, [MB, 2 * MB, MB + s]);
        }
        let h = l.history();
        assert_eq!(h.len(), HISTORY_POINTS);
        assert_eq!(h.last().map(|p| p.at_ms), Some(3_000 + 699 * 1000));
        assert_eq!(h.first().map(|p| p.at_ms), Some(3_000 + 100 * 1000));
        assert!(h.windows(2).all(|w| w[1].at_ms - w[0].at_ms == 1000));
        assert!(h.iter().skip(1).all(|p| p.background_bps == 8.0));
    }

    /// Checks the exposition line by line (prometheus-parse skips lines
    /// it cannot read, so it alone would not notice a malformed one):
    /// every family has HELP then TYPE, every sample belongs to the
    /// family declared last and has a number; returns the families.
    pub(crate) fn strict_families(text: &str) -> HashMap<String, String> {
        let mut families = HashMap::new();
        let mut current: Option<(String, String)> = None;
        let name_ok = |n: &str| {
            !n.is_empty()
                && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                && !n.starts_with(|c: char| c.is_ascii_digit())
        };
        let mut help: Option<String> = None;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, doc) = rest.split_once(' ').unwrap();
                assert!(name_ok(name), "bad name in {line:?}");
                assert!(!doc.trim().is_empty(), "empty HELP in {line:?}");
                help = Some(name.to_string());
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, ty) = rest.split_once(' ').unwrap();
                assert_eq!(help.as_deref(), Some(name), "TYPE without HELP: {line:?}");
                assert!(["counter", "gauge", "histogram"].contains(&ty), "{line:?}");
                assert!(
                    families.insert(name.to_string(), ty.to_string()).is_none(),
                    "family {name} twice"
                );
                current = Some((name.to_string(), ty.to_string()));
            } else {
                assert!(!line.starts_with('#'), "stray comment {line:?}");
                let (series, value) = line.rsplit_once(' ').unwrap();
                let v = value.replace("+Inf", "inf");
                assert!(v.parse::<f64>().is_ok(), "bad value in {line:?}");
                let name = series.split('{').next().unwrap();
                let (fam, ty) = current.as_ref().expect("sample before any TYPE");
                let ok = if ty == "histogram" {
                    ["_bucket", "_sum", "_count"]
                        .iter()
                        .any(|s| name.strip_suffix(s) == Some(fam.as_str()))
                } else {
                    name == fam
                };
                assert!(ok, "{name} is not a sample of family {fam} ({ty})");
                if let Some(labels) = series.strip_prefix(name) {
                    if !labels.is_empty() {
                        assert!(labels.starts_with('{') && labels.ends_with('}'), "{line:?}");
                    }
                }
            }
        }
        families
    }

    pub(crate) fn parse(text: &str) -> prometheus_parse::Scrape {
        prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).unwrap()
    }

    pub(crate) fn value(s: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
        let found: Vec<f64> = s
            .samples
            .iter()
            .filter(|x| x.metric == name && labels.iter().all(|(k, v)| x.labels.get(k) == Some(*v)))
            .map(|x| match &x.value {
                prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Untyped(v) => *v,
                other => panic!("{name}: {other:?}"),
            })
            .collect();
        assert_eq!(found.len(), 1, "{name}{labels:?}: {found:?}");
        found[0]
    }

    #[test]
    fn source_text_parses_with_the_names_labels_and_values_set() {
        let m = SourceMetrics::new();
        let l = m.link("to-eval");
        l.sent[class_index(Class::Urgent)].inc_by(5 * MB);
        l.sent[class_index(Class::Background)].inc_by(7);
        l.retries.inc_by(3);
        l.moved.inc_by(2);
        // The handle and the registry's series are the same counter.
        assert_eq!(m.link("to-eval").sent_totals(), [5 * MB, 0, 7]);
        let scrape = SourceScrape {
            links: vec![("to-eval".into(), 1_000_000_000, 0.5, 3)],
            catalog: Some((
                HashMap::from([
                    (("to-eval".into(), Class::Scheduled), 2),
                    (("gone".into(), Class::Background), 1),
                ]),
                vec![(TransferState::Queued, 2), (TransferState::Published, 4)],
            )),
        };
        let text = m.render(&scrape).unwrap();
        // A scrape while the catalog does not answer keeps the gauges read
        // from it (and still renders the rest).
        let without = m
            .render(&SourceScrape {
                links: vec![("to-eval".into(), 1_000_000_000, 0.25, 3)],
                catalog: None,
            })
            .unwrap();
        let w = parse(&without);
        assert_eq!(
            value(&w, "ferry_state_transfers", &[("state", "queued")]),
            2.0
        );
        assert_eq!(
            value(
                &w,
                "ferry_queue_depth_transfers",
                &[("link", "to-eval"), ("class", "scheduled")]
            ),
            2.0
        );
        assert_eq!(
            value(&w, "ferry_link_utilisation_ratio", &[("link", "to-eval")]),
            0.25
        );
        let fam = strict_families(&text);
        let expect = [
            ("ferry_sent_bytes_total", "counter"),
            ("ferry_chunk_retries_total", "counter"),
            ("ferry_chunks_moved_total", "counter"),
            ("ferry_link_capacity_bits_per_second", "gauge"),
            ("ferry_link_connections", "gauge"),
            ("ferry_link_utilisation_ratio", "gauge"),
            ("ferry_queue_depth_transfers", "gauge"),
            ("ferry_state_transfers", "gauge"),
        ];
        for (n, ty) in expect {
            assert_eq!(fam.get(n).map(String::as_str), Some(ty), "{n} in:\n{text}");
        }
        assert_eq!(fam.len(), expect.len(), "{text}");
        assert!(text.contains("# HELP ferry_sent_bytes_total "));
        let s = parse(&text);
        let sent = |c| {
            value(
                &s,
                "ferry_sent_bytes_total",
                &[("link", "to-eval"), ("class", c)],
            )
        };
        assert_eq!(
            (sent("urgent"), sent("scheduled"), sent("background")),
            (5e6, 0.0, 7.0)
        );
        assert_eq!(
            value(&s, "ferry_chunk_retries_total", &[("link", "to-eval")]),
            3.0
        );
        assert_eq!(
            value(&s, "ferry_chunks_moved_total", &[("link", "to-eval")]),
            2.0
        );
        assert_eq!(
            value(
                &s,
                "ferry_link_capacity_bits_per_second",
                &[("link", "to-eval")]
            ),
            1e9
        );
        assert_eq!(
            value(&s, "ferry_link_utilisation_ratio", &[("link", "to-eval")]),
            0.5
        );
        assert_eq!(
            value(&s, "ferry_link_connections", &[("link", "to-eval")]),
            3.0
        );
        let depth = |l, c| {
            value(
                &s,
                "ferry_queue_depth_transfers",
                &[("link", l), ("class", c)],
            )
        };
        assert_eq!(depth("to-eval", "scheduled"), 2.0);
        assert_eq!(depth("to-eval", "urgent"), 0.0);
        assert_eq!(depth("gone", "background"), 1.0);
        let st = |x| value(&s, "ferry_state_transfers", &[("state", x)]);
        assert_eq!(
            (st("queued"), st("published"), st("failed")),
            (2.0, 4.0, 0.0)
        );

        // The next scrape forgets what is gone.
        let text = m
            .render(&SourceScrape {
                links: vec![("to-eval".into(), 2_000_000_000, 0.0, 1)],
                catalog: Some((HashMap::new(), Vec::new())),
            })
            .unwrap();
        let s = parse(&text);
        assert!(!text.contains("gone"), "{text}");
        assert_eq!(
            value(
                &s,
                "ferry_link_capacity_bits_per_second",
                &[("link", "to-eval")]
            ),
            2e9
        );
        assert_eq!(
            value(&s, "ferry_state_transfers", &[("state", "published")]),
            0.0
        );
    }

    #[test]
    fn sink_text_parses_with_the_names_and_a_lag_histogram() {
        let m = SinkMetrics::new();
        m.received_for("train-a-1").inc_by(42);
        m.received_for("train-a-1").inc_by(8);
        m.verification_failures.inc_by(2);
        m.published.inc();
        m.observe_lag(0.3, "urgent");
        m.observe_lag(-1.0, "urgent");
        m.observe_lag(4000.0, "urgent");
        m.observe_lag(2.0, "background");
        let mut p = ferry_proto::phases::Phases::default();
        use ferry_proto::phases::Phase;
        p.add(false, Phase::Streaming, std::time::Duration::from_secs(90));
        p.add(
            true,
            Phase::Sending,
            std::time::Duration::from_millis(1_500),
        );
        p.add(
            true,
            Phase::Publishing,
            std::time::Duration::from_millis(200),
        );
        m.observe_phases(&p, "urgent");
        m.observe_phases(&p, "urgent");
        m.note_read_back(crate::storage::ReadBack {
            wall: std::time::Duration::from_millis(1500),
            cpu: std::time::Duration::from_millis(2250),
        });
        m.removed(ferry_catalog::RemovalReason::Operator, 300);
        m.removed(ferry_catalog::RemovalReason::Operator, 20);
        let text = m
            .render(Some((
                &[(TransferState::Published, 1), (TransferState::Receiving, 2)],
                4,
                5,
            )))
            .unwrap();
        let fam = strict_families(&text);
        let expect = [
            ("ferry_received_bytes_total", "counter"),
            ("ferry_verification_failures_total", "counter"),
            ("ferry_part_chunks_refused_total", "counter"),
            ("ferry_published_replicas_total", "counter"),
            ("ferry_commit_to_replica_lag_seconds", "histogram"),
            ("ferry_eval_ready_phase_seconds", "histogram"),
            ("ferry_replica_state_replicas", "gauge"),
            ("ferry_read_back_seconds_total", "counter"),
            ("ferry_read_back_cpu_seconds_total", "counter"),
            ("ferry_replicas_removed_total", "counter"),
            ("ferry_replica_freed_bytes_total", "counter"),
            ("ferry_pinned_replicas", "gauge"),
            ("ferry_leased_replicas", "gauge"),
        ];
        for (n, ty) in expect {
            assert_eq!(fam.get(n).map(String::as_str), Some(ty), "{n} in:\n{text}");
        }
        assert_eq!(fam.len(), expect.len(), "{text}");
        let s = parse(&text);
        assert_eq!(
            value(&s, "ferry_received_bytes_total", &[("peer", "train-a-1")]),
            50.0
        );
        assert_eq!(value(&s, "ferry_verification_failures_total", &[]), 2.0);
        assert_eq!(value(&s, "ferry_published_replicas_total", &[]), 1.0);
        close(value(&s, "ferry_read_back_seconds_total", &[]), 1.5);
        close(value(&s, "ferry_read_back_cpu_seconds_total", &[]), 2.25);
        let urgent = [("class", "urgent")];
        assert_eq!(
            value(&s, "ferry_commit_to_replica_lag_seconds_count", &urgent),
            3.0
        );
        close(
            value(&s, "ferry_commit_to_replica_lag_seconds_sum", &urgent),
            4000.3,
        );
        close(
            value(
                &s,
                "ferry_commit_to_replica_lag_seconds_sum",
                &[("class", "background")],
            ),
            2.0,
        );
        // Only the phases after the commit, each by phase and class.
        let sending = [("phase", "sending"), ("class", "urgent")];
        assert_eq!(
            value(&s, "ferry_eval_ready_phase_seconds_count", &sending),
            2.0
        );
        close(
            value(&s, "ferry_eval_ready_phase_seconds_sum", &sending),
            3.0,
        );
        assert!(!text.contains("phase=\"streaming\""), "{text}");
        let h = s
            .samples
            .iter()
            .find(|x| {
                x.metric == "ferry_commit_to_replica_lag_seconds"
                    && x.labels.get("class") == Some("urgent")
            })
            .map(|x| x.value.clone());
        let Some(prometheus_parse::Value::Histogram(b)) = h else {
            panic!("no histogram in {text}");
        };
        let le = |x: f64| b.iter().find(|c| c.less_than == x).map(|c| c.count);
        assert_eq!(le(0.1), Some(1.0), "the negative lag counts as 0");
        assert_eq!(le(0.5), Some(2.0));
        assert_eq!(le(3600.0), Some(2.0));
        assert_eq!(le(f64::INFINITY), Some(3.0));
        let st = |x| value(&s, "ferry_replica_state_replicas", &[("state", x)]);
        assert_eq!(
            (st("receiving"), st("published"), st("failed")),
            (2.0, 1.0, 0.0)
        );
        let rm = |r| value(&s, "ferry_replicas_removed_total", &[("reason", r)]);
        assert_eq!(
            (rm("operator"), rm("rule"), rm("pressure")),
            (2.0, 0.0, 0.0)
        );
        assert_eq!(
            value(
                &s,
                "ferry_replica_freed_bytes_total",
                &[("reason", "operator")]
            ),
            320.0
        );
        assert_eq!(value(&s, "ferry_pinned_replicas", &[]), 4.0);
        assert_eq!(value(&s, "ferry_leased_replicas", &[]), 5.0);
    }
}
