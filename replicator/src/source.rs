//! The sending side: a pool of QUIC connections per link (the first also
//! carries the control stream), transfers taken from the
//! catalog in the scheduler's order, each checkpoint read once (hashing
//! and sending in one pass), chunks packed back to back into large batches
//! on several unidirectional streams, then the sealed manifest sent as the
//! commit. Chunks the sink already has are skipped; chunks it asks for
//! again are re-read and re-sent.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::bufpool::BufPool;
use crate::storage::remote::RemoteRoot;
use crate::storage::router::Router;
use crate::storage::{read_chunks_versioned, FileVersion, RangeRead, ScanError, SourceStore};
use ferry_catalog::{
    Catalog, CatalogError, DeadlineState, NewWatchedTransfer, ProgressNote, SourceTimes, Transfer,
};
use ferry_proto::manifest::{hex, ChunkMap, FileEntry, FileInfo, Hash, Manifest};
use ferry_proto::state::{CheckpointState, Profile, TransferId, TransferState};
use ferry_proto::wire::{
    CheckpointInfo, Commit, Control, Hello, Open, RecordHeader, TransferKey, MIN_SOURCE_VERSION,
    ORIGIN_VERSION, PROTOCOL_VERSION,
};
use quinn::{Connection, Endpoint, VarInt};
use serde::Serialize;
use tokio::sync::{mpsc, watch, Notify};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use crate::cc::Share;
use crate::conn::{code, read_frame, ConnError, ControlSender};
use crate::hold::{HoldPoint, Holds};
use crate::metrics::{LinkSampler, LinkStats, MetricsError, RateWindow, SourceMetrics};
use crate::tls;
use crate::transport::{transport_config, SocketFactory, Tuning};

mod dispatch;
mod parts;
pub(crate) mod phases;
pub mod pins;
mod shared;
mod streaming;
pub mod watch_core;
pub mod watch_lease;
pub mod watcher;

use dispatch::{LinkSched, Lost};
use watcher::wake;

pub use streaming::{CheckpointView, ViewFile, ViewState};

#[cfg(feature = "fault-injection")]
pub use dispatch::SentChunk;
pub use parts::FAULT_PAUSE_AFTER_PART_ENV;

/// A link as the source sees it.
#[derive(Debug, Clone)]
pub struct LinkConfig {
    /// Link name.
    pub name: String,
    /// Address to dial, `host:port` (the sink, or a link emulator in front
    /// of it); the host is looked up at each dial, so a name that does not
    /// resolve yet only delays the link.
    pub peer: String,
    /// Agent name the sink's certificate must carry.
    pub peer_name: String,
    /// Further sink agents of the peer site's pool (sharing its catalog
    /// and sink root), tried in order after `peer` when it cannot be
    /// reached: the link's connections all go to one sink agent at a
    /// time, and to the next one in the list once that one is lost.
    pub more_peers: Vec<SinkPeer>,
    /// Ferry's share of the WAN, bit/s.
    pub rate_bps: u64,
    /// Expected base RTT.
    pub rtt: Duration,
    /// QUIC connections serving the link (at least 1; see
    /// [`default_connections`]). Each has its own endpoint and UDP socket
    /// when the source has a [`SocketFactory`], and a congestion
    /// controller aiming at `rate_bps / connections`.
    pub connections: usize,
}

/// A sink agent a link may dial: its address and the name its
/// certificate must carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SinkPeer {
    /// Address to dial, `host:port` (looked up at each dial).
    pub addr: String,
    /// Agent name the sink's certificate must carry.
    pub name: String,
}

impl LinkConfig {
    /// The sink agents the link may dial, in order: `peer` first, then
    /// `more_peers`.
    pub fn sinks(&self) -> Vec<SinkPeer> {
        std::iter::once(SinkPeer {
            addr: self.peer.clone(),
            name: self.peer_name.clone(),
        })
        .chain(self.more_peers.iter().cloned())
        .collect()
    }
}

/// Link rate served by one connection when the count is not configured,
/// bit/s (2 Gbit/s): about what one core's packet processing and crypto
/// keep up with in a release build (`ops/bench/RESULTS.md`, bare quinn on
/// loopback, one connection: 2.3-3.4 Gbit/s on a loaded 2-core machine).
pub const RATE_PER_CONNECTION: u64 = 2_000_000_000;

/// Most connections a link gets by default (more can be configured, up to
/// [`MAX_CONNECTIONS`]).
pub const MAX_DEFAULT_CONNECTIONS: usize = 16;

/// Most connections a link may be configured with.
pub const MAX_CONNECTIONS: usize = 64;

/// The default connection count of a link with rate cap `rate_bps` (bit/s)
/// on a host with `cores` cores: one per [`RATE_PER_CONNECTION`] of the
/// rate (rounded up), at most one per core and at most
/// [`MAX_DEFAULT_CONNECTIONS`], at least 1. A 1 Gbit/s link gets 1; a
/// 10 Gbit/s link 5 on a host with 8 cores, 2 on one with 2.
pub fn default_connections(rate_bps: u64, cores: usize) -> usize {
    let by_rate = rate_bps.div_ceil(RATE_PER_CONNECTION).max(1);
    let by_rate = usize::try_from(by_rate).unwrap_or(usize::MAX);
    by_rate.min(cores.max(1)).min(MAX_DEFAULT_CONNECTIONS)
}

/// A directory tree whose checkpoints belong to one job and go over one
/// link.
#[derive(Debug, Clone)]
pub struct RootConfig {
    /// Absolute path.
    pub path: PathBuf,
    /// Job name.
    pub job: String,
    /// Link name.
    pub link: String,
    /// How the watcher follows this root.
    pub watch: watcher::RootWatch,
}

/// Source settings.
#[derive(Debug, Clone)]
pub struct SourceConfig {
    /// This agent's name.
    pub agent: String,
    /// This agent's site.
    pub site: String,
    /// Chunk size in bytes.
    pub chunk_size: u32,
    /// Commit marker file names (generic rule); published last.
    pub markers: Vec<String>,
    /// Source roots.
    pub roots: Vec<RootConfig>,
    /// The stores of the roots whose paths are URLs (`hdfs://`, `s3://`),
    /// opened by the caller ([`crate::storage::router::open_remote`]);
    /// empty when every root is a local directory.
    pub remotes: Vec<(RemoteRoot, Arc<dyn SourceStore>)>,
    /// Links.
    pub links: Vec<LinkConfig>,
    /// Stream writers per connection of a link: each writes one batch (a
    /// QUIC stream) at a time, so this many batches of the link's
    /// transfers are in flight per connection.
    pub streams: usize,
    /// Target batch size in bytes (a stream is finished after this many
    /// payload bytes).
    pub batch_bytes: u64,
    /// How often the watcher rescans source roots (the safety net under
    /// inotify, and the poll period); `None` turns the watcher off (only
    /// `ferry push` starts transfers then).
    pub scan_interval: Option<Duration>,
    /// A file with no close event counts as complete once unchanged for
    /// this long (and its format check passes).
    pub quiet_period: Duration,
    /// An open checkpoint with no change for this long is abandoned.
    pub checkpoint_idle_timeout: Duration,
    /// How transfers are ranked and the link shared (`[scheduler]`).
    pub policy: scheduler::Policy,
    /// Which signals pin the checkpoints around them at the sinks, and
    /// for how long (`[source] pin_on`, `pin_for`; see [`pins`]).
    pub pins: pins::SignalPins,
    /// The agent's membership of its site's pool: with it, a transfer
    /// runs only under a lease claimed in the catalog
    /// ([`ferry_catalog::Catalog::claim_transfer`]), transfers other
    /// agents hold are left to them and count against `max_active`, and
    /// a run whose lease was not renewed in time stops. `None`: no
    /// leases (a source started on its own, as in the crate's tests).
    pub pool: Option<crate::pool::Membership>,
}

/// Live progress of one run of a transfer (from its start or resume to
/// its pause, reconnect or end); what earlier runs did is in the catalog.
#[derive(Debug, Default, Serialize, Clone, Copy, utoipa::ToSchema)]
pub struct Progress {
    /// Bytes in the checkpoint (while it is written, known so far).
    pub bytes_total: u64,
    /// Payload bytes written to QUIC streams in this run (resends
    /// included).
    pub bytes_sent: u64,
    /// Bytes the sink already had when this run started (0 until it
    /// says, right after the start; for a watched checkpoint striped
    /// across the pool, when its run last opened it again, its own
    /// confirmed bytes included), and, for the coordinator of a striped
    /// transfer, those of parts other agents of the pool sent since.
    pub bytes_skipped: u64,
    /// Payload bytes of this run the sink confirmed written and verified
    /// (whole batches, protocol version 4 on); progress follows these,
    /// not the bytes handed to QUIC, which may still wait in the
    /// connection's send buffers. Equal to `bytes_sent` with an older
    /// sink, which confirms nothing.
    pub bytes_verified: u64,
    /// Payload bit/s written for this transfer over the last ~5 s
    /// ([`crate::metrics::RATE_WINDOW_MS`]; resends included), updated
    /// every second; 0 when idle.
    pub rate_bps: f64,
}

/// Counters of one run of a transfer, and the catalog's figures from
/// before it (so what is reported never moves backwards).
#[derive(Default)]
struct LiveProgress {
    total: AtomicU64,
    /// Payload bytes sent in this run.
    sent: AtomicU64,
    /// Payload bytes of this run in batches the sink confirmed.
    pub(crate) verified: AtomicU64,
    /// Whether the sink confirms batches (protocol version 4 on): then
    /// progress follows `verified`, else `sent`.
    confirms: std::sync::atomic::AtomicBool,
    skipped: AtomicU64,
    /// Payload bytes of a striped transfer's parts that other agents of
    /// the pool sent and released (its coordinator's run counts them).
    by_others: AtomicU64,
    /// [`Progress::rate_bps`] as `f64` bits, set by the sampler.
    rate_bits: AtomicU64,
    /// The catalog's `bytes_done` when this run started.
    done_before: u64,
    /// The catalog's `bytes_sent` when this run started (earlier runs).
    sent_before: u64,
}

impl LiveProgress {
    /// Bytes at the sink as far as the source knows: those it had when
    /// this run started and those it confirmed since (with a sink that
    /// confirms nothing, those sent; resends can count twice, hence the
    /// cap at the total), never less than before the run.
    fn done(&self) -> u64 {
        let total = self.total.load(Ordering::Relaxed);
        let run = self.skipped.load(Ordering::Relaxed)
            + self.by_others.load(Ordering::Relaxed)
            + self.verified_or_sent();
        self.done_before.max(run.min(total))
    }

    /// Payload bytes of this run the sink confirmed (with a sink that
    /// confirms nothing, those sent).
    fn verified_or_sent(&self) -> u64 {
        if self.confirms.load(Ordering::Relaxed) {
            self.verified.load(Ordering::Relaxed)
        } else {
            self.sent.load(Ordering::Relaxed)
        }
    }

    fn snapshot(&self) -> Progress {
        Progress {
            bytes_total: self.total.load(Ordering::Relaxed),
            bytes_sent: self.sent.load(Ordering::Relaxed),
            bytes_skipped: self.skipped.load(Ordering::Relaxed)
                + self.by_others.load(Ordering::Relaxed),
            bytes_verified: self.verified_or_sent(),
            rate_bps: f64::from_bits(self.rate_bits.load(Ordering::Relaxed)),
        }
    }

    /// What to keep in the catalog from this run.
    fn note(&self) -> ProgressNote {
        ProgressNote {
            bytes_total: self.total.load(Ordering::Relaxed),
            bytes_done: self.done(),
            bytes_sent: self.sent_before + self.sent.load(Ordering::Relaxed),
        }
    }
}

/// When a transfer's replica must be ready, as a client gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deadline {
    /// At this time, Unix ms.
    At(i64),
    /// This long after the checkpoint's commit (for a pushed directory,
    /// after it was queued).
    AfterCommit(Duration),
}

/// Why a transfer could not be submitted.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// The path is not usable.
    #[error("{0}")]
    BadPath(String),
    /// No such link.
    #[error("unknown link {0:?}")]
    UnknownLink(String),
    /// The job does not match the path's source root.
    #[error("{0}")]
    BadJob(String),
    /// Catalog failure.
    #[error(transparent)]
    Catalog(#[from] CatalogError),
}

/// Kinds of signal a training controller may send (`POST /v1/signals`).
pub const SIGNAL_KINDS: [&str; 5] = [
    "loss_spike",
    "grad_norm_spike",
    "nan",
    "eval_regression",
    "manual",
];

/// What a signal did.
#[derive(Debug, Clone)]
pub struct SignalOutcome {
    /// The stored signal.
    pub signal: ferry_catalog::Signal,
    /// False if its idempotency key was seen before (nothing changed).
    pub new: bool,
    /// The transfer promoted to `urgent`, if the job had an unpublished
    /// checkpoint.
    pub promoted: Option<TransferId>,
    /// Until when it stays `urgent`, Unix ms.
    pub urgent_until: Option<i64>,
    /// The promoted transfer's state (a `paused` one stays paused, urgent
    /// once resumed).
    pub promoted_state: Option<TransferState>,
    /// The pins it asked the sinks for, in words (`step 1200: the last
    /// checkpoint before it`); empty when its kind does not pin (`[source]
    /// pin_on`).
    pub pins: Vec<String>,
}

/// Why an operator or controller request was refused.
#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    /// No such job.
    #[error("unknown job {0:?} (not in [[jobs]], not set through the API, not the job of a source root)")]
    UnknownJob(String),
    /// No such transfer.
    #[error("no transfer {0}")]
    UnknownTransfer(TransferId),
    /// A field is out of range; the message names it.
    #[error("{0}")]
    Invalid(String),
    /// The transfer's state does not allow it.
    #[error("{0}")]
    Conflict(String),
    /// Catalog failure.
    #[error(transparent)]
    Catalog(CatalogError),
}

impl From<CatalogError> for OpsError {
    /// A value the catalog refuses is the caller's mistake (its message
    /// names the field); anything else is the catalog's.
    fn from(e: CatalogError) -> Self {
        match e {
            CatalogError::Invalid(m) => OpsError::Invalid(m),
            other => OpsError::Catalog(other),
        }
    }
}

/// Refuses an operator action on a transfer that has finished.
fn not_final(t: &Transfer) -> Result<(), OpsError> {
    if t.state.is_final() {
        return Err(OpsError::Conflict(format!(
            "transfer {} is already {}",
            t.id, t.state
        )));
    }
    Ok(())
}

/// Why a transfer ranks where it does (`GET /v1/transfers/{id}`).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Ranking {
    /// `priority` or `fifo` (under `fifo` the score is shown but unused).
    pub policy: &'static str,
    /// Effective class now.
    pub class: scheduler::Class,
    /// Promoted to `urgent` by a signal until this time (Unix ms).
    pub promoted_until: Option<i64>,
    /// The score and its four terms.
    pub score: scheduler::Score,
    /// Model parameters used (`None`: unknown, size term 1).
    pub model_params: Option<f64>,
    /// Importance used, 0..1.
    pub importance: f64,
    /// Where the importance came from: `transfer` (override), `job`, or
    /// `default` (0, job unknown to the catalog).
    pub importance_from: &'static str,
    /// Live severity of the job's signals, 0..1.
    pub severity: f64,
    /// Seconds since the transfer was queued (the aging term's input).
    pub waiting_s: f64,
    /// Running on its link now (queued transfers have no share).
    pub active: bool,
    /// Its class's weight on the link now, 0..1.
    pub class_weight: Option<f64>,
    /// Its expected share of the link's rate cap now, 0..1.
    pub share: Option<f64>,
    /// Estimated seconds to send what is left at that share.
    pub eta_s: Option<f64>,
}

struct LinkState {
    cfg: LinkConfig,
    client: quinn::ClientConfig,
    /// Wakes the link worker: a transfer was queued, changed or stopped.
    wake: Notify,
    share: Share,
    /// The link's scheduler and the queues of its active transfers.
    sched: Arc<LinkSched>,
    /// Connections established since the agent started (a pool of `n`
    /// counts `n`).
    connections: AtomicU64,
    /// Endpoints of the pool's connections after the first (which uses
    /// the agent's endpoint), made once by the source's socket factory
    /// and kept across reconnects.
    endpoints: Mutex<Vec<Endpoint>>,
    /// Rates by class and their history, fed by the sampler.
    sampler: Mutex<LinkSampler>,
    /// The protocol version the link's next dial speaks:
    /// [`PROTOCOL_VERSION`], or an older one a sink asked for by naming
    /// the versions it speaks when it refused a hello.
    speak: Arc<AtomicU16>,
    /// The link's rate cap, bit/s (the config's, or one set through the
    /// API): the budget of the whole pool on this link.
    cap: AtomicU64,
    /// This agent's fraction of `cap` (f64 bits), 1 unless other agents
    /// of the pool run transfers on the link
    /// ([`scheduler::LinkScheduler::pool_fraction`]).
    fraction: AtomicU64,
    /// This agent's fractions of `cap` for the classes below the highest
    /// busy anywhere in the pool, by class (urgent, scheduled,
    /// background; [`scheduler::PoolShare::class_caps`]): those classes
    /// are paced at them even while nothing of a higher class is ready
    /// here. All `None` outside a pool.
    class_caps: Mutex<[Option<f64>; 3]>,
    /// Ids of the signals the link's scheduler has counted (each once,
    /// whether this agent took it or another agent of the pool did).
    signals: Mutex<BTreeSet<i64>>,
    /// Pins signals asked for, not yet sent to the sink (the link worker
    /// dials for them and sends them once connected; lost if this agent
    /// stops first).
    pins: Mutex<Vec<ferry_proto::wire::PinRequest>>,
    /// Index in [`LinkConfig::sinks`] of the sink agent the next dial
    /// tries first: the one last connected to, moved on to the next when
    /// its pool was lost or a dial of it failed.
    sink_at: Arc<AtomicUsize>,
    /// Index of the sink agent last connected to (`usize::MAX`: none
    /// yet).
    sink_last: AtomicUsize,
    /// The newest publishes' times from last byte to publish at the sink,
    /// ms ([`LinkState::note_finish`]).
    finishes: Mutex<VecDeque<i64>>,
}

/// Publishes of a link whose last-byte-to-publish time the deadline
/// margin follows (the median of the newest).
const FINISH_HISTORY: usize = 20;

/// How long a replica took at the sink from its last byte to its publish,
/// ms: its `verifying` and `publishing` phases after the commit.
fn finish_ms(p: &ferry_proto::phases::Phases) -> i64 {
    use ferry_proto::phases::Phase;
    let d: Duration = [Phase::Verifying, Phase::Publishing]
        .iter()
        .filter_map(|k| p.after.get(k))
        .sum();
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The median of `v` (the upper one of an even count); 0 when empty.
fn median(v: &VecDeque<i64>) -> i64 {
    let mut s: Vec<i64> = v.iter().copied().collect();
    s.sort_unstable();
    s.get(s.len() / 2).copied().unwrap_or(0)
}

impl LinkState {
    /// Notes how long a publish took at the sink after its last byte
    /// (`ms`); the link's deadline margin then adds the median of the
    /// last [`FINISH_HISTORY`] ([`scheduler::LinkScheduler::set_finish_ms`]).
    fn note_finish(&self, ms: i64) {
        let m = {
            let mut f = crate::lock::lock(&self.finishes);
            f.push_back(ms);
            while f.len() > FINISH_HISTORY {
                f.pop_front();
            }
            median(&f)
        };
        self.sched.lock().ls.set_finish_ms(m);
    }

    /// Paces the link at its cap times this agent's fraction of it, and
    /// each capped class at its own fraction (each at least
    /// [`MIN_PACE_BPS`]). With `ease`, a lower pace reaches the
    /// connections' windows over one RTT ([`crate::cc::Share::ease_rate_bps`]:
    /// a striped transfer's share split again among more holders); else
    /// at once.
    fn apply_rate(&self, ease: bool) {
        let cap = self.cap.load(Ordering::Relaxed);
        let pace_of = |f: f64| ((cap as f64 * f) as u64).max(MIN_PACE_BPS).min(cap);
        let pace = pace_of(f64::from_bits(self.fraction.load(Ordering::Relaxed)));
        let caps = crate::lock::lock(&self.class_caps)
            .map(|f| f.map(|f| dispatch::payload_rate(pace_of(f).min(pace))));
        if ease {
            self.share.ease_rate_bps(pace);
        } else {
            self.share.set_rate_bps(pace);
        }
        {
            let now = ferry_catalog::now_ms();
            let mut s = self.sched.lock();
            s.ls.set_rate(dispatch::payload_rate(pace), now);
            s.ls.set_class_rates(caps, now);
        }
        self.sched.poke();
    }

    /// Counts signal `g` in the job's severity unless it was counted
    /// already; true if it is new to the link.
    fn count_signal(&self, g: &ferry_catalog::Signal) -> bool {
        let mut seen = crate::lock::lock(&self.signals);
        if !seen.insert(g.id) {
            return false;
        }
        // Ids of signals long decayed need not be kept.
        while seen.len() > MAX_SIGNAL_IDS {
            seen.pop_first();
        }
        drop(seen);
        self.sched
            .lock()
            .ls
            .signal(&g.job, g.severity, g.received_at);
        true
    }
}

/// Signal ids a link remembers as counted (the newest are kept).
const MAX_SIGNAL_IDS: usize = 10_000;

/// Sends the pins signals asked for to the link's sink (a sink before
/// protocol version 6 cannot take them: they are dropped, said once per
/// batch); those a failed send left are tried again at the next pass.
async fn send_pins(link: &LinkState, c: &LinkConn) {
    let pending = std::mem::take(&mut *crate::lock::lock(&link.pins));
    if c.version < ferry_proto::wire::PIN_VERSION {
        warn!(
            link = link.cfg.name,
            version = c.version,
            pins = pending.len(),
            "the sink speaks wire protocol {}, which has no pins: the pins signals asked for are not sent (upgrade the sink)",
            c.version
        );
        return;
    }
    for (i, p) in pending.iter().enumerate() {
        match c.ctl.send(&Control::Pin(p.clone())).await {
            Ok(()) => {
                info!(link = link.cfg.name, job = p.job, target = ?p.target, "pin sent to the sink")
            }
            Err(e) => {
                warn!(link = link.cfg.name, error = %e, "sending pins to the sink; trying again");
                crate::lock::lock(&link.pins).extend_from_slice(&pending[i..]);
                return;
            }
        }
    }
}

/// The least rate an agent paces a link at when other agents of its pool
/// take most of it, bit/s (1 Mbit/s): a transfer admitted between two
/// reloads of the queue still moves.
const MIN_PACE_BPS: u64 = 1_000_000;

struct Inner {
    cfg: SourceConfig,
    /// The scheduler's policy now: `cfg.policy`, or in a pool the
    /// catalog's, changed while the agent runs ([`Source::set_policy`]).
    policy: Mutex<scheduler::Policy>,
    catalog: Catalog,
    /// Where checkpoints are read.
    store: Arc<dyn SourceStore>,
    endpoint: Endpoint,
    /// Makes the sockets of a link's further connections; `None`: every
    /// connection on `endpoint`.
    sockets: Option<SocketFactory>,
    links: HashMap<String, Arc<LinkState>>,
    progress: Mutex<HashMap<TransferId, Arc<LiveProgress>>>,
    /// Views of watched checkpoints, by transfer id (see [`watcher`]).
    views: Mutex<HashMap<TransferId, watch::Receiver<CheckpointView>>>,
    /// Each live transfer's phase log (see [`phases`]).
    phase_clocks: phases::PhaseClocks,
    /// Weights-first transfers whose weights-only commit went: the root
    /// of its manifest, which the sink's [`Control::Published`] of that
    /// version carries (it is not the transfer's end).
    weights_roots: Mutex<HashMap<TransferId, Hash>>,
    /// Checkpoints signals' pins picked for replication whatever `select`
    /// says, for the watchers of their roots: (root, pick, until Unix
    /// ms). Each root's watcher takes its own at its next pass.
    picks: Mutex<Vec<(PathBuf, watch_core::Pick, i64)>>,
    /// Pins waiting for the first checkpoint at or after a step to appear
    /// under a root (root, step, reason, until Unix ms): once its watcher
    /// picks it, the pin goes to the sink for that step.
    step_pins: Mutex<Vec<(PathBuf, u64, String, i64)>>,
    shutdown: CancellationToken,
    tasks: TaskTracker,
    /// Test hook: flip one byte in this many chunks after hashing them
    /// (`FERRY_FAULT_CORRUPT_CHUNKS`), to prove the sink catches it. Only
    /// with the `fault-injection` feature.
    #[cfg(feature = "fault-injection")]
    corrupt: AtomicU64,
    /// Test hook: points where runs are held (see [`Source::hold_at`];
    /// empty without the `fault-injection` feature).
    holds: Arc<Holds>,
    /// This source's Prometheus registry.
    metrics: SourceMetrics,
    /// Shared settings this agent could not use at the last read (each
    /// logged once).
    unusable_settings: Mutex<Vec<String>>,
    /// Taken by [`Source::set_link_rate`] from recording a rate to
    /// applying it.
    rate_changes: tokio::sync::Mutex<()>,
    /// Chunk buffers, back from quinn once their bytes were acknowledged.
    bufs: Arc<BufPool>,
}

/// A running source; cheap to clone.
#[derive(Clone)]
pub struct Source {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Source")
            .field("agent", &self.inner.cfg.agent)
            .finish()
    }
}

enum RunError {
    /// Connection-level trouble: reconnect and resume.
    Retry(String),
    /// The transfer cannot succeed.
    Fatal(String),
    /// The agent is stopping.
    Shutdown,
    /// The checkpoint was abandoned or deleted at the source.
    Cancelled(String),
    /// An operator paused or cancelled the transfer (the catalog holds
    /// which).
    Stopped,
}

impl From<ConnError> for RunError {
    fn from(e: ConnError) -> Self {
        RunError::Retry(e.to_string())
    }
}
impl From<CatalogError> for RunError {
    fn from(e: CatalogError) -> Self {
        RunError::Retry(format!("catalog: {e}"))
    }
}

impl Source {
    /// Starts one worker per link on `endpoint` (a client endpoint); work
    /// left unfinished in the catalog resumes. Every connection of a link
    /// uses `endpoint` (see [`Source::start_with_sockets`]).
    ///
    /// # Errors
    /// TLS configuration errors.
    pub fn start(
        cfg: SourceConfig,
        catalog: Catalog,
        endpoint: Endpoint,
        identity: &tls::AgentIdentity,
    ) -> Result<Source, tls::TlsError> {
        Source::start_with_sockets(cfg, catalog, endpoint, None, identity)
    }

    /// As [`Source::start`]; a link's connections after the first each get
    /// an endpoint on a socket of `sockets` (made at the first dial, kept
    /// across reconnects).
    ///
    /// # Errors
    /// TLS configuration errors.
    pub fn start_with_sockets(
        cfg: SourceConfig,
        catalog: Catalog,
        endpoint: Endpoint,
        sockets: Option<SocketFactory>,
        identity: &tls::AgentIdentity,
    ) -> Result<Source, tls::TlsError> {
        let crypto = tls::client_crypto(identity)?;
        let metrics = SourceMetrics::new();
        let mut links = HashMap::new();
        for l in &cfg.links {
            let share = Share::new(l.rate_bps);
            let mut ls = scheduler::LinkScheduler::new(
                cfg.policy.clone(),
                dispatch::payload_rate(l.rate_bps),
                l.rtt.as_millis() as u64,
                ferry_catalog::now_ms(),
            );
            ls.set_chunk_bytes(u64::from(cfg.chunk_size));
            let sched = Arc::new(LinkSched::new(ls, metrics.link(&l.name)));
            let mut client = quinn::ClientConfig::new(crypto.clone());
            let tuning = Tuning {
                rate_bps: l.rate_bps,
                rtt: l.rtt,
            };
            let n = u32::try_from(l.connections.max(1)).unwrap_or(u32::MAX);
            client.transport_config(Arc::new(transport_config(tuning, Some(share.clone()), n)));
            links.insert(
                l.name.clone(),
                Arc::new(LinkState {
                    cfg: l.clone(),
                    client,
                    wake: Notify::new(),
                    share,
                    sched,
                    connections: AtomicU64::new(0),
                    endpoints: Mutex::new(Vec::new()),
                    sampler: Mutex::new(LinkSampler::default()),
                    speak: Arc::new(AtomicU16::new(PROTOCOL_VERSION)),
                    cap: AtomicU64::new(l.rate_bps),
                    fraction: AtomicU64::new(1.0f64.to_bits()),
                    class_caps: Mutex::new([None; 3]),
                    signals: Mutex::new(BTreeSet::new()),
                    pins: Mutex::new(Vec::new()),
                    finishes: Mutex::new(VecDeque::new()),
                    sink_at: Arc::new(AtomicUsize::new(0)),
                    sink_last: AtomicUsize::new(usize::MAX),
                }),
            );
        }
        #[cfg(feature = "fault-injection")]
        let corrupt = std::env::var("FERRY_FAULT_CORRUPT_CHUNKS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let mut router = Router::new();
        for (root, store) in &cfg.remotes {
            router.add(root.clone(), store.clone());
        }
        let store: Arc<dyn SourceStore> = Arc::new(router);
        let inner = Arc::new(Inner {
            policy: Mutex::new(cfg.policy.clone()),
            cfg,
            catalog,
            store,
            endpoint,
            sockets,
            links,
            progress: Mutex::new(HashMap::new()),
            views: Mutex::new(HashMap::new()),
            phase_clocks: phases::PhaseClocks::default(),
            weights_roots: Mutex::default(),
            picks: Mutex::new(Vec::new()),
            step_pins: Mutex::new(Vec::new()),
            shutdown: CancellationToken::new(),
            tasks: TaskTracker::new(),
            #[cfg(feature = "fault-injection")]
            corrupt: AtomicU64::new(corrupt),
            holds: Arc::default(),
            metrics,
            unusable_settings: Mutex::new(Vec::new()),
            rate_changes: tokio::sync::Mutex::new(()),
            bufs: BufPool::new(crate::bufpool::AGENT_POOL_BYTES),
        });
        inner.tasks.spawn(sampler(inner.clone()));
        inner.tasks.spawn(deadline_watch(inner.clone()));
        for link in inner.links.values() {
            let (i, l) = (inner.clone(), link.clone());
            inner.tasks.spawn(link_worker(i, l));
        }
        if let Some(every) = inner.cfg.scan_interval {
            let timing = watcher::WatchTiming {
                rescan: every,
                quiet: inner.cfg.quiet_period,
                idle_timeout: inner.cfg.checkpoint_idle_timeout,
            };
            // In a pool (a PostgreSQL catalog) each root is watched by
            // one agent at a time, under a lease; a single agent watches
            // its roots itself.
            let pool =
                inner.cfg.pool.clone().filter(|_| {
                    inner.catalog.dialect() == ferry_catalog::dialect::Dialect::Postgres
                });
            for root in inner.cfg.roots.clone() {
                let i = inner.clone();
                match &pool {
                    Some(p) => inner.tasks.spawn(watch_lease::supervise_root(
                        i,
                        root,
                        timing.clone(),
                        p.clone(),
                    )),
                    None => {
                        let stop = inner.shutdown.clone();
                        inner
                            .tasks
                            .spawn(watcher::watch_root(i, root, timing.clone(), stop))
                    }
                };
            }
        }
        let source = Source { inner };
        if source.inner.catalog.dialect() == ferry_catalog::dialect::Dialect::Postgres {
            let stop = source.inner.shutdown.clone();
            source
                .inner
                .tasks
                .spawn(shared::follow(source.clone(), stop));
        }
        Ok(source)
    }

    /// Test hook: the next run of any transfer to reach `point` is held
    /// there until the returned [`crate::hold::Hold`] is released or
    /// dropped. Only with
    /// the `fault-injection` feature.
    #[cfg(feature = "fault-injection")]
    pub fn hold_at(&self, point: HoldPoint) -> crate::hold::Hold {
        self.inner.holds.arm(point)
    }

    /// Test hook: connection `connection` (0: the control one) of `link`'s
    /// pool is closed, as if its socket died, once it has taken `chunks`
    /// more chunks (once). False for an unknown link. Only with the
    /// `fault-injection` feature.
    #[cfg(feature = "fault-injection")]
    pub fn close_connection_after(&self, link: &str, connection: usize, chunks: u64) -> bool {
        let Some(l) = self.inner.links.get(link) else {
            return false;
        };
        crate::lock::lock(&l.sched.faults).close_after = Some((connection, chunks.max(1)));
        true
    }

    /// Test hook: every chunk handed to quinn on `link` since the agent
    /// started, in the order the writes completed (empty for an unknown
    /// link). Only with the `fault-injection` feature.
    #[cfg(feature = "fault-injection")]
    pub fn sent_chunks(&self, link: &str) -> Vec<SentChunk> {
        self.inner
            .links
            .get(link)
            .map(|l| crate::lock::lock(&l.sched.faults).sent.clone())
            .unwrap_or_default()
    }

    /// The catalog.
    pub fn catalog(&self) -> &Catalog {
        &self.inner.catalog
    }

    /// Transfer `t` (a catalog row) as it stands now, and its live
    /// progress if it is running: `bytes_total`, `bytes_done` and
    /// `bytes_sent` are the larger of the catalog's (what earlier runs
    /// achieved) and the running one's, so they never move backwards,
    /// also across pause, resume and reconnect.
    pub fn with_progress(&self, mut t: Transfer) -> (Transfer, Option<Progress>) {
        // Where its time went so far, until the publish records it.
        if t.phases.is_none() {
            t.phases = self.inner.phase_clocks.phases(t.id);
        }
        let live = self
            .inner
            .progress
            .lock()
            .ok()
            .and_then(|m| m.get(&t.id).cloned());
        let Some(p) = live else {
            return (t, None);
        };
        if t.state != TransferState::Published {
            let n = p.note();
            let total = t.bytes_total.max(n.bytes_total as i64);
            t.bytes_done = t.bytes_done.max(n.bytes_done as i64).min(total);
            t.bytes_total = total;
            t.bytes_sent = t.bytes_sent.max(n.bytes_sent as i64);
        }
        (t, Some(p.snapshot()))
    }

    /// Live progress of a transfer that is running now (this run's
    /// counters; see [`Source::with_progress`] for the whole transfer).
    pub fn progress(&self, id: TransferId) -> Option<Progress> {
        let m = crate::lock::lock(&self.inner.progress);
        Some(m.get(&id)?.snapshot())
    }

    /// Live rates of every link, sorted by name: rate cap, payload bit/s
    /// by class over the last ~5 s and, if `with_history`, one point per
    /// second for the last 10 minutes (leave it out when polling often).
    pub fn link_stats(&self, with_history: bool) -> Vec<LinkStats> {
        let mut out: Vec<LinkStats> = self
            .inner
            .links
            .values()
            .map(|l| link_stats(l, with_history))
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// This source's metrics in the Prometheus text exposition format
    /// (version 0.0.4, [`crate::metrics::CONTENT_TYPE`]); the gauges of
    /// queue depth and states are computed from the catalog first.
    ///
    /// # Errors
    /// [`MetricsError`].
    pub async fn render_metrics(&self) -> Result<String, MetricsError> {
        let inner = &self.inner;
        let read = async {
            let states = inner.catalog.transfer_state_counts().await?;
            let unfinished = inner.catalog.unfinished_transfers().await?;
            Ok::<_, CatalogError>((states, unfinished))
        };
        let catalog = match tokio::time::timeout(crate::metrics::SCRAPE_CATALOG_WAIT, read).await {
            Ok(Ok((states, unfinished))) => {
                let now = ferry_catalog::now_ms();
                let mut queued: HashMap<(String, scheduler::Class), i64> = HashMap::new();
                for t in &unfinished {
                    let class = scheduler::effective_class(t.class, t.urgent_until, now);
                    *queued.entry((t.link.clone(), class)).or_default() += 1;
                }
                Some((queued, states))
            }
            Ok(Err(e)) => {
                warn!(error = %e, "metrics: the catalog did not answer; queue and state gauges keep their last values");
                None
            }
            Err(_) => {
                warn!("metrics: the catalog did not answer within 2 s; queue and state gauges keep their last values");
                None
            }
        };
        if catalog.is_some() {
            let mut names: Vec<&str> = inner.cfg.roots.iter().map(|r| r.job.as_str()).collect();
            names.sort_unstable();
            names.dedup();
            let read = async {
                let now = ferry_catalog::now_ms();
                let mut out = Vec::new();
                for job in names {
                    if let Some((_, o)) = self.outlook(job, None).await? {
                        out.push((
                            job.to_string(),
                            o.backlog_bytes,
                            o.next_ready_ms.map(|r| (r - now).max(0) as f64 / 1000.0),
                            o.keeps_up,
                        ));
                    }
                }
                Ok::<_, CatalogError>(out)
            };
            match tokio::time::timeout(crate::metrics::SCRAPE_CATALOG_WAIT, read).await {
                Ok(Ok(jobs)) => inner.metrics.set_jobs(&jobs),
                Ok(Err(e)) => warn!(error = %e, "metrics: the jobs' outlooks: catalog"),
                Err(_) => warn!(
                    "metrics: the jobs' outlooks took over 2 s; gauges keep their last values"
                ),
            }
        }
        let links = self
            .link_stats(false)
            .into_iter()
            .map(|l| (l.name, l.rate_bps, l.utilisation, l.connections_open))
            .collect();
        Ok(inner
            .metrics
            .render(&crate::metrics::SourceScrape { links, catalog })?)
    }

    /// Changes a link's rate cap (bit/s) at run time: the scheduler's
    /// token bucket at once, the congestion controller of its connection on
    /// the next ack. The change is recorded in the catalog first (a `rate`
    /// event), then applied. On a single agent's SQLite catalog it lasts
    /// until the agent restarts; in a pool (PostgreSQL) it is also stored
    /// as the pool's setting `link.NAME.rate`, kept across restarts, and
    /// every agent of the pool applies it ([`crate::settings`]). Returns
    /// false, recording nothing, for an unknown link.
    ///
    /// # Errors
    /// Catalog errors (the rate is left as it was), a rate of 0 among them
    /// ([`CatalogError::Invalid`]).
    pub async fn set_link_rate(&self, link: &str, rate_bps: u64) -> Result<bool, CatalogError> {
        self.set_link_rate_as(link, rate_bps, "unknown").await
    }

    /// [`Source::set_link_rate`], with `by` (the API token's name)
    /// recorded as the writer of the pool's setting.
    ///
    /// # Errors
    /// As [`Source::set_link_rate`].
    pub async fn set_link_rate_as(
        &self,
        link: &str,
        rate_bps: u64,
        by: &str,
    ) -> Result<bool, CatalogError> {
        let Some(l) = self.inner.links.get(link) else {
            return Ok(false);
        };
        // Held from the record to the change, so concurrent changes reach
        // the link in the order they were recorded.
        let _order = self.inner.rate_changes.lock().await;
        if self.inner.catalog.dialect() == ferry_catalog::dialect::Dialect::Postgres {
            if rate_bps == 0 {
                return Err(CatalogError::Invalid(
                    "rate_bps must be at least 1 bit/s".into(),
                ));
            }
            self.inner
                .catalog
                .put_setting(
                    &crate::settings::link_rate_setting(link),
                    &serde_json::json!(rate_bps),
                    by,
                )
                .await?;
        }
        self.inner.catalog.record_link_rate(link, rate_bps).await?;
        l.cap.store(rate_bps, Ordering::Relaxed);
        l.apply_rate(false);
        Ok(true)
    }

    /// The recorded history from `since_ms` (Unix ms) as a trace for
    /// `ferry replay`, over this agent's configured links (their
    /// configured rate caps and RTT hints); see
    /// [`ferry_catalog::Catalog::export_trace`] for the rules.
    ///
    /// # Errors
    /// Catalog errors.
    pub async fn trace(&self, since_ms: i64) -> Result<ferry_catalog::TraceExport, CatalogError> {
        let mut links: Vec<scheduler::trace::LinkSpec> = self
            .inner
            .cfg
            .links
            .iter()
            .map(|l| scheduler::trace::LinkSpec {
                link: l.name.clone(),
                // The config refuses a rate below 1 kbit/s; a 0 here would
                // make the header one `Trace::parse` refuses.
                rate_bps: l.rate_bps.max(1),
                rtt_ms: l.rtt.as_millis() as u64,
            })
            .collect();
        links.sort_by(|a, b| a.link.cmp(&b.link));
        self.inner.catalog.export_trace(since_ms, &links).await
    }

    /// Names of the configured links.
    pub fn links(&self) -> Vec<String> {
        self.inner.links.keys().cloned().collect()
    }

    /// A link's current rate cap, bit/s (`None`: unknown link): the
    /// pool's budget on it, of which this agent paces at its fraction
    /// ([`LinkStats::pool_fraction`]).
    pub fn link_rate(&self, link: &str) -> Option<u64> {
        self.inner
            .links
            .get(link)
            .map(|l| l.cap.load(Ordering::Relaxed))
    }

    /// For a link naming several sink agents, the one `link`'s
    /// connections go to now (`None` while not connected, for a link to
    /// one sink agent, or an unknown link).
    pub fn link_sink(&self, link: &str) -> Option<String> {
        self.inner.links.get(link).and_then(|l| connected_sink(l))
    }

    /// The connections of `link`: how many serve it when all are up, and
    /// how many are open now (`None`: unknown link).
    pub fn link_pool(&self, link: &str) -> Option<(usize, usize)> {
        self.inner
            .links
            .get(link)
            .map(|l| (l.cfg.connections.max(1), l.sched.open_connections()))
    }

    /// Connections to the sink established on `link` since the agent
    /// started (`None`: unknown link); a pool of `connections` counts that
    /// many, so more than the link's `connections` means it reconnected.
    pub fn link_connections(&self, link: &str) -> Option<u64> {
        self.inner
            .links
            .get(link)
            .map(|l| l.connections.load(Ordering::Relaxed))
    }

    /// The scheduler's settings now: the config's, or in a pool the
    /// catalog's (see [`crate::settings`]).
    pub fn policy(&self) -> scheduler::Policy {
        crate::lock::lock(&self.inner.policy).clone()
    }

    /// Runs the scheduler with `policy` from now on: every link's
    /// scheduler re-scores its transfers, and the link workers admit by
    /// the new limits at their next look at the queue. True if it
    /// differs from the policy it replaces.
    pub fn set_policy(&self, policy: scheduler::Policy) -> bool {
        {
            let mut p = crate::lock::lock(&self.inner.policy);
            if *p == policy {
                return false;
            }
            *p = policy.clone();
        }
        for l in self.inner.links.values() {
            l.sched.lock().ls.set_policy(policy.clone());
        }
        self.wake_all();
        true
    }

    /// Sets scheduler setting `name` (`scheduler.max_active`, ...; see
    /// [`crate::settings::SCHEDULER_SETTINGS`]) to `value` (a JSON value,
    /// or its text such as `"8"` or `"10m"`) for the whole pool: stored
    /// in the catalog (its writer `by`, the API token's name), announced
    /// to the other agents, and applied here at once.
    ///
    /// # Errors
    /// [`OpsError::Conflict`] on a single agent's SQLite catalog (its
    /// `[scheduler]` comes from its config file); [`OpsError::Invalid`]
    /// naming the setting; catalog errors (nothing changes then).
    pub async fn put_policy_setting(
        &self,
        name: &str,
        value: &serde_json::Value,
        by: &str,
    ) -> Result<ferry_catalog::Setting, OpsError> {
        let v = crate::settings::parse_value(name, value).map_err(OpsError::Invalid)?;
        if self.inner.catalog.dialect() != ferry_catalog::dialect::Dialect::Postgres {
            return Err(OpsError::Conflict(format!(
                "{name}: a single agent (catalog in SQLite) takes [scheduler] from its config \
                 file; shared settings need a pool's PostgreSQL catalog"
            )));
        }
        let _order = self.inner.rate_changes.lock().await;
        // Checked in the writing transaction against every stored
        // scheduler setting, under a lock every such write takes: two
        // agents' changes valid alone but not together are not both
        // stored.
        let base = self.inner.cfg.policy.clone();
        let stored = match self
            .inner
            .catalog
            .put_setting_checked(name, &v, by, |all| {
                crate::settings::check_stored_policy(&base, all)
            })
            .await
        {
            Ok(s) => s,
            Err(CatalogError::Invalid(e)) => return Err(OpsError::Invalid(e)),
            Err(e) => return Err(e.into()),
        };
        let (p, _) = crate::settings::policy_from(&base, &self.inner.catalog.settings().await?);
        self.set_policy(p);
        Ok(stored)
    }

    /// Reads the pool's shared settings and recent signals from the
    /// catalog and applies what changed: the scheduler's policy, each
    /// link's rate cap (not recorded again: the agent that changed it
    /// did), and each signal no link of this agent counted yet (another
    /// agent took it). Run every second and on each notification by
    /// [`crate::settings::follow`] (PostgreSQL only).
    ///
    /// # Errors
    /// Catalog errors (nothing is applied then).
    pub async fn refresh_shared(&self) -> Result<(), CatalogError> {
        let inner = &self.inner;
        // Taken before the read: a change this agent is making is read
        // after it is stored, never undone by an older read.
        let _order = inner.rate_changes.lock().await;
        let horizon = 20 * self.policy().severity_half_life_ms as i64;
        let (stored, sigs) = inner
            .catalog
            .shared_state(ferry_catalog::now_ms() - horizon)
            .await?;
        let (policy, unusable) = crate::settings::policy_from(&inner.cfg.policy, &stored);
        {
            let mut known = crate::lock::lock(&inner.unusable_settings);
            for e in unusable.iter().filter(|e| !known.contains(*e)) {
                warn!(
                    "the pool's catalog holds a value this agent cannot use; keeping its own: {e}"
                );
            }
            *known = unusable;
        }
        if self.set_policy(policy.clone()) {
            info!(
                policy = policy.kind.as_str(),
                max_active = policy.max_active,
                "scheduler: the pool's settings changed; applied"
            );
        }
        for s in &stored {
            let Some(link) = crate::settings::link_of_setting(&s.name) else {
                continue;
            };
            let (Some(l), Some(bps)) = (inner.links.get(link), s.value.as_u64()) else {
                continue;
            };
            if bps > 0 && l.cap.load(Ordering::Relaxed) != bps {
                l.cap.store(bps, Ordering::Relaxed);
                l.apply_rate(false);
                info!(
                    link,
                    rate_bps = bps,
                    by = s.updated_by,
                    "link rate cap: the pool's setting changed; applied"
                );
            }
        }
        let mut new = false;
        for g in &sigs {
            for l in inner.links.values() {
                new |= l.count_signal(g);
            }
        }
        if new {
            // Scores changed, and the signal may have promoted a transfer
            // to `urgent`: the link workers reload the queue and this
            // agent's fraction of each link's budget now.
            self.wake_all();
        }
        Ok(())
    }

    /// True if `job` is known: configured or set through the API (the
    /// catalog's jobs), or the job of a source root.
    ///
    /// # Errors
    /// Catalog errors.
    pub async fn known_job(&self, job: &str) -> Result<bool, CatalogError> {
        Ok(self.inner.cfg.roots.iter().any(|r| r.job == job)
            || self.inner.catalog.job(job).await?.is_some())
    }

    /// Records a training controller's signal about `job`: the job's
    /// severity rises (decaying with the policy's half-life) and its
    /// newest unpublished, non-background transfer becomes `urgent` for
    /// the policy's `urgent_for` (whatever the severity: a `manual`
    /// signal of severity 0 is a plain "I need it now"). A repeated `idempotency_key` returns the first
    /// signal's outcome and changes nothing.
    ///
    /// # Errors
    /// [`OpsError::UnknownJob`]; [`OpsError::Invalid`] naming the field
    /// (`kind` not one of [`SIGNAL_KINDS`], `severity` outside 0..1, a
    /// negative `step`);
    /// catalog errors.
    pub async fn signal(
        &self,
        job: &str,
        kind: &str,
        severity: f64,
        step: Option<i64>,
        idempotency_key: Option<&str>,
    ) -> Result<SignalOutcome, OpsError> {
        let inner = &self.inner;
        if !SIGNAL_KINDS.contains(&kind) {
            return Err(OpsError::Invalid(format!(
                "kind: unknown kind {kind:?} (expected one of {})",
                SIGNAL_KINDS.join(", ")
            )));
        }
        if !severity.is_finite() || !(0.0..=1.0).contains(&severity) {
            return Err(OpsError::Invalid(format!(
                "severity: must be a number from 0 to 1, got {severity}"
            )));
        }
        if let Some(s) = step.filter(|s| *s < 0) {
            return Err(OpsError::Invalid(format!(
                "step: must be a training step, 0 or more, got {s}"
            )));
        }
        if !self.known_job(job).await? {
            return Err(OpsError::UnknownJob(job.to_string()));
        }
        let (mut sig, new) = inner
            .catalog
            .insert_signal(job, kind, severity, step, idempotency_key)
            .await?;
        if !new {
            let t = match sig.transfer {
                Some(id) => inner.catalog.transfer(id).await?,
                None => None,
            };
            return Ok(SignalOutcome {
                urgent_until: t.as_ref().and_then(|t| t.urgent_until),
                promoted_state: t.as_ref().map(|t| t.state),
                pins: Vec::new(),
                promoted: sig.transfer,
                signal: sig,
                new: false,
            });
        }
        for l in inner.links.values() {
            l.count_signal(&sig);
        }
        let mut outcome = SignalOutcome {
            promoted: None,
            urgent_until: None,
            promoted_state: None,
            pins: Vec::new(),
            signal: sig.clone(),
            new: true,
        };
        if let Some(t) = inner.catalog.newest_unpublished_transfer(job).await? {
            let until = sig.received_at + self.policy().urgent_for_ms as i64;
            inner.catalog.promote_urgent(t.id, until, sig.id).await?;
            inner.catalog.set_signal_transfer(sig.id, t.id).await?;
            sig.transfer = Some(t.id);
            info!(
                job,
                kind,
                severity,
                transfer = %t.id,
                path = t.source_path,
                "signal: transfer promoted to urgent"
            );
            outcome = SignalOutcome {
                promoted: Some(t.id),
                urgent_until: Some(until),
                promoted_state: Some(t.state),
                pins: Vec::new(),
                signal: sig,
                new: true,
            };
            wake(inner, &t);
        } else {
            info!(
                job,
                kind, severity, "signal: no unpublished checkpoint to promote"
            );
        }
        for l in inner.links.values() {
            l.sched.poke();
        }
        outcome.pins = pins::pin_around(inner, &outcome.signal).await;
        Ok(outcome)
    }

    /// Sets a job's importance (0..1) and model size through the API:
    /// `model_params` `None` keeps the size it has, `Some(None)` (or 0)
    /// makes it unknown, `Some(Some(p))` sets it (parameters). Scores
    /// follow within a second. A new size or importance is recorded as a
    /// `job` event with the change.
    ///
    /// # Errors
    /// [`OpsError::Invalid`] naming the field (`model_params` above
    /// [`ferry_catalog::MAX_MODEL_PARAMS`], `importance` outside 0..1);
    /// catalog errors.
    pub async fn put_job(
        &self,
        name: &str,
        model_params: Option<Option<f64>>,
        importance: f64,
    ) -> Result<ferry_catalog::Job, OpsError> {
        // The catalog checks name, size and importance (errors name them).
        let params = match model_params {
            Some(p) => p,
            None => self
                .inner
                .catalog
                .job(name)
                .await?
                .and_then(|j| j.model_params),
        };
        let job = self.inner.catalog.put_job(name, params, importance).await?;
        self.wake_all();
        Ok(job)
    }

    fn wake_all(&self) {
        for l in self.inner.links.values() {
            l.wake.notify_one();
            l.sched.poke();
        }
    }

    async fn existing(&self, id: TransferId) -> Result<Transfer, OpsError> {
        self.inner
            .catalog
            .transfer(id)
            .await?
            .ok_or(OpsError::UnknownTransfer(id))
    }

    /// Pauses transfer `id`: its chunks stop at the next chunk boundary;
    /// what the sink verified stays (resume continues from there). The
    /// pause is recorded as a `pause` event with the state change.
    ///
    /// # Errors
    /// [`OpsError::UnknownTransfer`]; [`OpsError::Conflict`] if it is
    /// finished or already paused; catalog errors.
    pub async fn pause(&self, id: TransferId) -> Result<Transfer, OpsError> {
        let t = self.existing(id).await?;
        not_final(&t)?;
        if t.state == TransferState::Paused {
            return Err(OpsError::Conflict(format!(
                "transfer {id} is already paused"
            )));
        }
        if !self.inner.catalog.pause_transfer(id).await? {
            return Err(self.changed_meanwhile(id, "paused").await);
        }
        wake(&self.inner, &t);
        self.existing(id).await
    }

    /// Resumes paused transfer `id` (it is queued again, in its class),
    /// recorded as a `resume` event with the state change.
    ///
    /// # Errors
    /// [`OpsError::UnknownTransfer`]; [`OpsError::Conflict`] if it is not
    /// paused; catalog errors.
    pub async fn resume(&self, id: TransferId) -> Result<Transfer, OpsError> {
        let t = self.existing(id).await?;
        if t.state != TransferState::Paused {
            return Err(OpsError::Conflict(format!(
                "transfer {id} is {}, not paused",
                t.state
            )));
        }
        if !self.inner.catalog.resume_transfer(id).await? {
            return Err(self.changed_meanwhile(id, "resumed").await);
        }
        // The row as the resume left it (queued), read before the link
        // worker is woken: once woken it may start the transfer at once.
        let resumed = self.existing(id).await;
        wake(&self.inner, &t);
        resumed
    }

    /// Cancels transfer `id`: it stops, and the sink drops its staging
    /// data. A checkpoint the watcher still follows is not copied again
    /// unless it is re-saved. Recorded as a `cancel` event with the state
    /// change.
    ///
    /// # Errors
    /// [`OpsError::UnknownTransfer`]; [`OpsError::Conflict`] if it is
    /// finished; catalog errors.
    pub async fn cancel(&self, id: TransferId) -> Result<Transfer, OpsError> {
        let t = self.existing(id).await?;
        not_final(&t)?;
        if !self
            .inner
            .catalog
            .cancel_transfer(id, "cancelled by an operator")
            .await?
        {
            return Err(self.changed_meanwhile(id, "cancelled").await);
        }
        wake(&self.inner, &t);
        self.existing(id).await
    }

    /// The refusal of an operator action the catalog did not make because
    /// the transfer's state changed after it was checked (it finished, or
    /// another operator got there first).
    async fn changed_meanwhile(&self, id: TransferId, action: &str) -> OpsError {
        match self.existing(id).await {
            Ok(t) => OpsError::Conflict(format!(
                "transfer {id} was not {action}: it is {} now",
                t.state
            )),
            Err(e) => e,
        }
    }

    /// Sets the class of transfer `id` (`urgent`, `scheduled`,
    /// `background`), ending any promotion by a signal; and/or its
    /// importance override (0..1; `Some(None)` returns to the job's). Both
    /// change in one catalog transaction with their `class` and
    /// `importance` events.
    ///
    /// # Errors
    /// [`OpsError::UnknownTransfer`]; [`OpsError::Invalid`] naming the
    /// field, or when there is nothing to change; [`OpsError::Conflict`]
    /// if it is finished; catalog errors.
    pub async fn reprioritise(
        &self,
        id: TransferId,
        class: Option<scheduler::Class>,
        importance: Option<Option<f64>>,
    ) -> Result<Transfer, OpsError> {
        let t = self.existing(id).await?;
        not_final(&t)?;
        if let Some(Some(i)) = importance {
            if !i.is_finite() || !(0.0..=1.0).contains(&i) {
                return Err(OpsError::Invalid(format!(
                    "importance: must be a number from 0 to 1, got {i}"
                )));
            }
        }
        if !self
            .inner
            .catalog
            .reprioritise_transfer(id, class, importance)
            .await?
        {
            return Err(self.changed_meanwhile(id, "changed").await);
        }
        wake(&self.inner, &t);
        for l in self.inner.links.values() {
            l.sched.poke();
        }
        self.existing(id).await
    }

    /// Why transfer `t` ranks where it does now: its effective class,
    /// score term by term and, if it is active, its share of the link.
    ///
    /// # Errors
    /// Catalog errors.
    pub async fn ranking(&self, t: &Transfer) -> Result<Ranking, CatalogError> {
        let job = self.inner.catalog.job(&t.job).await?;
        let jobs: HashMap<String, ferry_catalog::Job> =
            job.iter().map(|j| (j.name.clone(), j.clone())).collect();
        Ok(self.ranking_with(t, &jobs, ferry_catalog::now_ms()))
    }

    /// [`Source::ranking`] of each of `ts`, with one catalog read for all
    /// (for views of the whole queue).
    ///
    /// # Errors
    /// Catalog errors.
    pub async fn rankings(&self, ts: &[Transfer]) -> Result<Vec<Ranking>, CatalogError> {
        let jobs: HashMap<String, ferry_catalog::Job> = self
            .inner
            .catalog
            .jobs()
            .await?
            .into_iter()
            .map(|j| (j.name.clone(), j))
            .collect();
        let now = ferry_catalog::now_ms();
        Ok(ts
            .iter()
            .map(|t| self.ranking_with(t, &jobs, now))
            .collect())
    }

    fn ranking_with(
        &self,
        t: &Transfer,
        jobs: &HashMap<String, ferry_catalog::Job>,
        now: i64,
    ) -> Ranking {
        let job = jobs.get(&t.job);
        let st = sched_transfer(t, jobs, now);
        let link = self.inner.links.get(&t.link);
        let (explained, severity) = match link {
            Some(l) => {
                let s = l.sched.lock();
                (s.ls.explain(t.id, now), s.ls.severity(&t.job, now))
            }
            None => (None, 0.0),
        };
        let policy = self.policy();
        let score = scheduler::score(
            &policy,
            scheduler::ScoreInputs {
                model_params: st.model_params,
                importance: st.importance,
                severity,
                waiting_ms: (now - t.created_at).max(0) as u64,
            },
        );
        Ranking {
            policy: policy.kind.as_str(),
            class: st.class,
            promoted_until: t.urgent_until.filter(|u| *u > now),
            score: explained.map_or(score, |e| e.score),
            model_params: st.model_params,
            importance: st.importance,
            importance_from: if t.importance.is_some() {
                "transfer"
            } else if job.is_some() {
                "job"
            } else {
                "default"
            },
            severity,
            waiting_s: (now - t.created_at).max(0) as f64 / 1000.0,
            active: explained.is_some(),
            class_weight: explained.map(|e| e.class_weight),
            share: explained.map(|e| e.share),
            eta_s: explained.and_then(|e| e.eta_s),
        }
    }

    /// Queues a replication of the directory `path`, which must lie under
    /// a configured source root; `link` overrides the root's link. If the
    /// same path is already queued or moving on that link, that transfer
    /// is returned; once it is published, a new push copies it again (a
    /// re-save becomes a new replica version).
    ///
    /// # Errors
    /// [`SubmitError::BadPath`] if the path is missing, not a directory or
    /// not under a source root; [`SubmitError::UnknownLink`]; catalog
    /// errors.
    pub async fn submit(&self, path: &Path, link: Option<&str>) -> Result<Transfer, SubmitError> {
        submit(&self.inner, path, link, scheduler::Class::Scheduled).await
    }

    /// Like [`Source::submit`], in `class`: `background` for datasets,
    /// logs and archives (any directory under a source root), so every
    /// cross-DC copy of the service goes through the link's scheduler.
    ///
    /// # Errors
    /// As [`Source::submit`].
    pub async fn submit_as(
        &self,
        path: &Path,
        link: Option<&str>,
        class: scheduler::Class,
    ) -> Result<Transfer, SubmitError> {
        submit(&self.inner, path, link, class).await
    }

    /// Records a training controller's announcement that `job` will write
    /// the checkpoint of `step` at `path` (about `expected_bytes` bytes):
    /// a transfer is queued at once and starts when the watcher sees the
    /// first bytes. If the path already has a transfer that is not
    /// finished, that one is returned. `Ok(None)` when the root's selection
    /// (`every_n_steps`) skips this step.
    ///
    /// # Errors
    /// [`SubmitError::BadPath`] if `path` is not a directory name directly
    /// under a configured source root of `job` (it need not exist yet);
    /// catalog errors.
    pub async fn announce(
        &self,
        job: &str,
        step: u64,
        path: &Path,
        expected_bytes: u64,
    ) -> Result<Option<Transfer>, SubmitError> {
        let inner = &self.inner;
        let bad = |s: String| SubmitError::BadPath(s);
        let parent = path
            .parent()
            .ok_or_else(|| bad("path has no parent".into()))?;
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| bad(format!("{} has no directory name", path.display())))?;
        let parent = if crate::storage::router::is_url(parent) {
            PathBuf::from(parent.to_string_lossy().trim_end_matches('/'))
        } else {
            std::fs::canonicalize(parent).map_err(|e| {
                bad(format!(
                    "{} is not under a watched source root ({}: {e})",
                    path.display(),
                    parent.display()
                ))
            })?
        };
        let root = inner
            .cfg
            .roots
            .iter()
            .find(|r| r.path == parent && inner.cfg.scan_interval.is_some())
            .ok_or_else(|| {
                bad(format!(
                    "{} is not a checkpoint directory directly under a watched source root",
                    path.display()
                ))
            })?;
        if root.job != job {
            return Err(SubmitError::BadJob(format!(
                "{} belongs to job {:?}, not {job:?}",
                parent.display(),
                root.job
            )));
        }
        if name.starts_with('.') || ferry_proto::paths::is_temporary(name) {
            return Err(bad(format!(
                "{name:?} is a hidden or temporary name, not a checkpoint directory"
            )));
        }
        let abs_probe = parent.join(name);
        if abs_probe.exists() && !abs_probe.is_dir() {
            return Err(bad(format!("{} is not a directory", abs_probe.display())));
        }
        if let watcher::Selection::EveryNSteps(n) = root.watch.select {
            if step % n != 0 {
                return Ok(None);
            }
        }
        let abs = parent.join(name);
        let abs_s = abs.to_string_lossy().into_owned();
        if let Some(t) = inner.catalog.transfer_by_path(&abs_s).await? {
            if !t.state.is_final() {
                return Ok(Some(t));
            }
        }
        let format = root
            .watch
            .format
            .map_or_else(|| "auto".to_string(), |f| f.to_string());
        let id = inner
            .catalog
            .insert_watched_transfer(&NewWatchedTransfer {
                link: &root.link,
                job: &root.job,
                source_path: &abs_s,
                rel: name,
                class: scheduler::Class::Scheduled,
                checkpoint: CheckpointState::Announced,
                format: &format,
                opened_at: None,
                committed_at: None,
                profile: root.watch.profile,
            })
            .await?;
        inner
            .catalog
            .set_transfer_size(id, expected_bytes, 0)
            .await?;
        info!(
            transfer = %id,
            path = abs_s,
            job,
            step,
            expected_bytes,
            "checkpoint announced"
        );
        Ok(inner.catalog.transfer(id).await?)
    }

    /// Gives transfer `id` a deadline (`None` clears it) and returns the
    /// row as it is now (`None` if there is no such transfer). A duration
    /// after commit on a pushed directory, which is complete when queued,
    /// counts from when it was queued.
    ///
    /// # Errors
    /// Catalog errors.
    pub async fn set_deadline(
        &self,
        id: TransferId,
        deadline: Option<Deadline>,
    ) -> Result<Option<Transfer>, CatalogError> {
        let c = &self.inner.catalog;
        let Some(t) = c.transfer(id).await? else {
            return Ok(None);
        };
        let ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        let (at, after) = match deadline {
            None => (None, None),
            Some(Deadline::At(at)) => (Some(at), None),
            Some(Deadline::AfterCommit(d)) if t.format.is_none() => {
                (Some(t.created_at.saturating_add(ms(d))), None)
            }
            Some(Deadline::AfterCommit(d)) => (None, Some(ms(d))),
        };
        c.set_transfer_deadline(id, at, after).await?;
        // A pushed directory's size is known once its run lists it; a
        // deadline needs it now.
        let local = !crate::storage::router::is_url(Path::new(&t.source_path));
        if deadline.is_some() && t.bytes_total == 0 && t.format.is_none() && local {
            let dir = PathBuf::from(&t.source_path);
            let size =
                tokio::task::spawn_blocking(move || tree_size(&dir, u64::MAX, DEADLINE_TREE_FILES))
                    .await
                    .ok()
                    .flatten();
            if let Some((bytes, files)) = size {
                c.set_transfer_size(id, bytes, files).await?;
            }
        }
        c.transfer(id).await
    }

    /// The admission answer for transfer `t`'s deadline at the current
    /// queue and rates of its link ([`scheduler::LinkScheduler::admission`]:
    /// every unfinished, unpaused transfer of the link counts, wherever it
    /// runs in a pool, with its live bytes left). A deadline after commit
    /// of a checkpoint not committed yet is answered as if it committed
    /// now. `None` without a deadline or for an unknown link.
    ///
    /// # Errors
    /// Catalog errors.
    pub async fn admission(
        &self,
        t: &Transfer,
    ) -> Result<Option<scheduler::Admission>, CatalogError> {
        let inner = &self.inner;
        let now = ferry_catalog::now_ms();
        let deadline = t
            .deadline_ms()
            .or_else(|| t.deadline_after_commit.map(|a| now.saturating_add(a)));
        let (Some(deadline), Some(link)) = (deadline, inner.links.get(&t.link)) else {
            return Ok(None);
        };
        let jobs: HashMap<String, ferry_catalog::Job> = inner
            .catalog
            .jobs()
            .await?
            .into_iter()
            .map(|j| (j.name.clone(), j))
            .collect();
        let view = |t: &Transfer| {
            let mut st = sched_transfer(t, &jobs, now);
            if let Some(left) = live_bytes_left(inner, t.id) {
                st.bytes_left = left;
            }
            st
        };
        let others: Vec<scheduler::Transfer> = inner
            .catalog
            .unfinished_transfers()
            .await?
            .iter()
            .filter(|o| o.link == t.link && o.id != t.id && o.state != TransferState::Paused)
            .map(view)
            .collect();
        let mut me = view(t);
        me.deadline_ms = Some(deadline);
        Ok(link.sched.lock().ls.admission(&me, &others, &[], now))
    }

    /// What job `job` can expect from its link now
    /// ([`scheduler::LinkScheduler::outlook`]): its backlog, when a
    /// checkpoint committed now would be ready, and whether replication
    /// keeps up with its checkpoint interval, with advice when not. The
    /// checkpoint size is the mean of its last [`OUTLOOK_HISTORY`]
    /// committed checkpoints (or `planned_bytes` when given, e.g. an
    /// announcement's), the interval the median between their commits (or
    /// queue times). The link is the job's source root's, else its newest
    /// transfer's. `Ok(None)`: the job has no root and no transfer, or its
    /// link is not configured here.
    ///
    /// # Errors
    /// Catalog errors.
    pub async fn outlook(
        &self,
        job: &str,
        planned_bytes: Option<u64>,
    ) -> Result<Option<(String, scheduler::Outlook)>, CatalogError> {
        let inner = &self.inner;
        let recent = inner
            .catalog
            .recent_job_transfers(job, OUTLOOK_HISTORY)
            .await?;
        let link = inner
            .cfg
            .roots
            .iter()
            .find(|r| r.job == job)
            .map(|r| r.link.clone())
            .or_else(|| recent.first().map(|t| t.link.clone()));
        let Some(link_name) = link else {
            return Ok(None);
        };
        let Some(link) = inner.links.get(&link_name) else {
            return Ok(None);
        };
        let now = ferry_catalog::now_ms();
        let jobs: HashMap<String, ferry_catalog::Job> = inner
            .catalog
            .jobs()
            .await?
            .into_iter()
            .map(|j| (j.name.clone(), j))
            .collect();
        let others: Vec<scheduler::Transfer> = inner
            .catalog
            .unfinished_transfers()
            .await?
            .iter()
            .filter(|t| t.link == link_name && t.state != TransferState::Paused)
            .map(|t| {
                let mut st = sched_transfer(t, &jobs, now);
                if let Some(left) = live_bytes_left(inner, t.id) {
                    st.bytes_left = left;
                }
                st
            })
            .collect();
        let sizes: Vec<u64> = recent.iter().map(|t| t.bytes_total.max(0) as u64).collect();
        let bytes = planned_bytes
            .filter(|b| *b > 0)
            .unwrap_or_else(|| sizes.iter().sum::<u64>() / sizes.len().max(1) as u64);
        let mut times: Vec<i64> = recent
            .iter()
            .map(|t| t.committed_at.unwrap_or(t.created_at))
            .collect();
        times.sort_unstable();
        let mut gaps: Vec<i64> = times
            .windows(2)
            .map(|w| w[1] - w[0])
            .filter(|g| *g > 0)
            .collect();
        gaps.sort_unstable();
        let cadence = (!gaps.is_empty()).then(|| gaps[gaps.len() / 2]);
        let job_row = jobs.get(job);
        let next = scheduler::Transfer {
            // An id no transfer has.
            id: TransferId(u64::MAX >> 1),
            class: scheduler::Class::Scheduled,
            job: job.to_string(),
            model_params: job_row.and_then(|j| j.model_params),
            importance: job_row.map_or(0.0, |j| j.importance),
            bytes_left: bytes,
            created_ms: now,
            size_final: true,
            deadline_ms: None,
        };
        let o = link.sched.lock().ls.outlook(&next, &others, cadence, now);
        Ok(Some((link_name, o)))
    }

    /// Stops: running batches end at the next chunk boundary, transfers
    /// stay resumable in the catalog; waits at most `deadline`.
    pub async fn shutdown(&self, deadline: Duration) {
        self.inner.shutdown.cancel();
        self.inner.tasks.close();
        let _ = tokio::time::timeout(deadline, self.inner.tasks.wait()).await;
        let mut endpoints = vec![self.inner.endpoint.clone()];
        for l in self.inner.links.values() {
            endpoints.extend(crate::lock::lock(&l.endpoints).iter().cloned());
        }
        for e in &endpoints {
            e.close(VarInt::from_u32(code::SHUTDOWN), b"source shutting down");
        }
        let idle = futures::future::join_all(endpoints.iter().map(|e| e.wait_idle()));
        let _ = tokio::time::timeout(Duration::from_secs(1), idle).await;
    }
}

async fn submit(
    inner: &Arc<Inner>,
    path: &Path,
    link: Option<&str>,
    class: scheduler::Class,
) -> Result<Transfer, SubmitError> {
    let bad = |s: String| SubmitError::BadPath(s);
    let remote = crate::storage::router::is_url(path);
    let abs = if remote {
        // A URL under a remote root: what is there is checked by the
        // listing below, once the root is known.
        PathBuf::from(path.to_string_lossy().trim_end_matches('/'))
    } else {
        let abs =
            std::fs::canonicalize(path).map_err(|e| bad(format!("{}: {e}", path.display())))?;
        if !abs.is_dir() {
            return Err(bad(format!("{} is not a directory", abs.display())));
        }
        abs
    };
    let root = inner
        .cfg
        .roots
        .iter()
        .filter(|r| abs.starts_with(&r.path))
        .max_by_key(|r| r.path.as_os_str().len())
        .ok_or_else(|| {
            bad(format!(
                "{} is not under any configured source root ([[source.roots]] path)",
                abs.display()
            ))
        })?;
    let link = link.unwrap_or(&root.link);
    let state = inner
        .links
        .get(link)
        .ok_or_else(|| SubmitError::UnknownLink(link.to_string()))?;
    let rel = match abs.strip_prefix(&root.path) {
        Ok(r) if !r.as_os_str().is_empty() => r.to_string_lossy().into_owned(),
        _ => {
            return Err(bad(format!(
                "{} is a source root itself; push a checkpoint directory below it",
                abs.display()
            )))
        }
    };
    // A remote directory exists when its listing has files (an object
    // store has no empty directories).
    let listed = if remote {
        let (store, dir) = (inner.store.clone(), abs.clone());
        let l = tokio::task::spawn_blocking(move || store.list(&dir, &[]))
            .await
            .map_err(|e| bad(format!("{}: {e}", abs.display())))?
            .map_err(|e| bad(e.to_string()))?;
        if l.files.is_empty() {
            return Err(bad(format!("{}: no files there", abs.display())));
        }
        Some(l)
    } else {
        None
    };
    // Pushing a checkpoint that is already queued or moving returns that
    // transfer instead of starting a second copy of the same bytes.
    if let Some(t) = inner
        .catalog
        .transfer_by_path(&abs.to_string_lossy())
        .await?
    {
        if !t.state.is_final() && t.link == link {
            return Ok(t);
        }
    }
    // A small directory's size is known at once, so the scheduler can
    // start it beside the large ones (`[scheduler] small_transfer`); the
    // run's own listing stays what is sent.
    let policy = crate::lock::lock(&inner.policy).clone();
    let small = if let (true, Some(l)) = (policy.max_small_active > 0, &listed) {
        let bytes: u64 = l.files.iter().map(|f| f.info.size).sum();
        let files = l.files.len() as u64;
        (bytes > 0 && bytes <= policy.small_bytes && files <= SMALL_TREE_FILES)
            .then_some((bytes, files))
    } else if policy.max_small_active > 0 {
        let (limit, dir) = (policy.small_bytes, abs.clone());
        tokio::task::spawn_blocking(move || small_tree_size(&dir, limit))
            .await
            .ok()
            .flatten()
    } else {
        None
    };
    let t = inner
        .catalog
        .insert_pushed_transfer(link, &root.job, &abs.to_string_lossy(), &rel, class, small)
        .await?;
    info!(transfer = %t.id, path = %abs.display(), link, %class, "transfer queued");
    state.wake.notify_one();
    Ok(t)
}

/// Size (bytes) and file count of the regular files under `dir` if they
/// add up to more than 0 and at most `limit` bytes in at most
/// [`SMALL_TREE_FILES`] files; `None` as soon as they do not, or on any
/// error (the transfer is then not treated as small).
fn small_tree_size(dir: &Path, limit: u64) -> Option<(u64, u64)> {
    tree_size(dir, limit, SMALL_TREE_FILES)
}

/// Bytes and files of the regular files under `dir`; `None` if a
/// directory cannot be read, it holds none, or more than `max_bytes` or
/// `max_files`.
fn tree_size(dir: &Path, max_bytes: u64, max_files: u64) -> Option<(u64, u64)> {
    let (mut bytes, mut files) = (0u64, 0u64);
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).ok()? {
            let e = e.ok()?;
            let ty = e.file_type().ok()?;
            if ty.is_dir() {
                todo.push(e.path());
            } else if ty.is_file() {
                bytes = bytes.saturating_add(e.metadata().ok()?.len());
                files += 1;
                if bytes > max_bytes || files > max_files {
                    return None;
                }
            }
        }
    }
    (bytes > 0).then_some((bytes, files))
}

/// At most this many files for a tree to count as small.
const SMALL_TREE_FILES: u64 = 4096;

/// At most this many files are counted to size a pushed directory given
/// a deadline before its run lists it (beyond, it is answered with the
/// size its run finds, 0 until then).
const DEADLINE_TREE_FILES: u64 = 1_000_000;

/// An established pool of connections to a sink. The first carries the
/// control stream the transfers use (opens, file tables, commits, cancels
/// and the sink's answers); every connection carries data streams, written
/// by the link's stream writers. When the control connection is lost, the
/// others are closed and every transfer on the pool resumes on a new one
/// (the sink keeps what it verified). When another connection is lost,
/// the pool goes on without it: the chunks of its batches the sink had not
/// confirmed are sent again on the others (`LinkSched::connection_lost`),
/// and the pool is replaced once the link has no transfer running.
#[derive(Clone)]
struct LinkConn {
    /// The control connection (the pool's first).
    conn: Connection,
    /// Every connection of the pool, the control one first.
    pool: Arc<Vec<Connection>>,
    ctl: Arc<ControlSender>,
    /// The control streams of the other connections, kept open (the sink
    /// ends a connection whose control stream ends); nothing is sent on
    /// them after the hello.
    _idle_ctls: Arc<Vec<ControlSender>>,
    inbox: Arc<Mutex<HashMap<TransferId, mpsc::UnboundedSender<Control>>>>,
    /// Opens sent on this connection whose answer (have or refuse) has not
    /// come yet, per transfer. The sink answers opens in order, so while
    /// more than one is out, an answer is for an earlier run of the
    /// transfer (stopped by a pause before its answer came) and must not
    /// reach the current run: it would start sending before the sink has
    /// handled its own open.
    unanswered: Arc<Mutex<HashMap<TransferId, u32>>>,
    /// The link's dispatcher (its writers run on this pool).
    sched: Arc<LinkSched>,
    /// Connections of the pool lost while the control one lives.
    lost: Arc<AtomicU64>,
    /// The protocol version the pool speaks.
    version: u16,
    /// The sink's hello arrived on the control connection with our
    /// protocol version: only then is the link's dial backoff reset (a
    /// sink that refuses every hello is dialled at the backoff's pace, not
    /// every 250 ms).
    greeted: Arc<AtomicBool>,
}

impl LinkConn {
    /// Closes every connection of the pool.
    fn close(&self, code: u32, reason: &[u8]) {
        for c in self.pool.iter() {
            c.close(VarInt::from_u32(code), reason);
        }
    }
}

/// The endpoints of `link`'s `connections` connections: the agent's for
/// the first, then one per further connection from the source's socket
/// factory (made once; the agent's endpoint again without a factory).
fn link_endpoints(inner: &Inner, link: &LinkState) -> Result<Vec<Endpoint>, String> {
    let n = link.cfg.connections.max(1);
    let mut extra = crate::lock::lock(&link.endpoints);
    if let Some(f) = &inner.sockets {
        while extra.len() + 1 < n {
            let ep = f.endpoint().map_err(|e| {
                format!(
                    "socket of connection {} of link {}: {e}",
                    extra.len() + 2,
                    link.cfg.name
                )
            })?;
            extra.push(ep);
        }
    }
    Ok((0..n)
        .map(|i| match i {
            0 => inner.endpoint.clone(),
            i => extra
                .get(i - 1)
                .cloned()
                .unwrap_or_else(|| inner.endpoint.clone()),
        })
        .collect())
}

/// Connects `endpoint` to the sink at `peer_addr` and sends the hello on
/// a new control stream (pipelined: the sink's hello is read later).
async fn handshake(
    inner: &Inner,
    link: &LinkState,
    endpoint: &Endpoint,
    peer_addr: std::net::SocketAddr,
    peer_name: &str,
    version: u16,
) -> Result<(Connection, ControlSender, quinn::RecvStream), String> {
    let connecting = endpoint
        .connect_with(link.client.clone(), peer_addr, peer_name)
        .map_err(|e| format!("connect to {peer_name} ({peer_addr}): {e}"))?;
    let conn = connecting.await.map_err(|e| {
        format!(
            "handshake with {peer_name} ({peer_addr}): {}",
            tls::explain_handshake_error(&e)
        )
    })?;
    let (send, recv) = conn
        .open_bi()
        .await
        .map_err(|e| format!("control stream to {peer_name}: {e}"))?;
    let ctl = ControlSender::new(send);
    ctl.send(&Control::Hello(Hello {
        version,
        agent: inner.cfg.agent.clone(),
        site: inner.cfg.site.clone(),
    }))
    .await
    .map_err(|e| format!("hello to {peer_name}: {e}"))?;
    Ok((conn, ctl, recv))
}

/// Dials the link's sink agents ([`LinkConfig::sinks`]) in turn, from
/// the one last connected to, until one answers. A link of several sink
/// agents moves on to the next after a failed dial, and after losing the
/// pool of the one it was connected to (see [`LinkState::sink_at`]).
async fn dial(inner: &Inner, link: &LinkState) -> Result<LinkConn, String> {
    let sinks = link.cfg.sinks();
    let first = link.sink_at.load(Ordering::Relaxed) % sinks.len();
    let mut failed = Vec::new();
    for k in 0..sinks.len() {
        let at = (first + k) % sinks.len();
        match dial_sink(inner, link, &sinks[at], at).await {
            Ok(c) => {
                let before = link.sink_last.swap(at, Ordering::Relaxed);
                if before != at && before != usize::MAX {
                    let why = if failed.is_empty() {
                        "its connection was lost".to_string()
                    } else {
                        failed.join("; ")
                    };
                    info!(
                        link = link.cfg.name,
                        from = sinks[before % sinks.len()].name,
                        to = sinks[at].name,
                        "connected to another sink agent of the link (it resumes what the sink pool has): {why}"
                    );
                }
                link.sink_at.store(at, Ordering::Relaxed);
                return Ok(c);
            }
            Err(e) => failed.push(e),
        }
    }
    link.sink_at.store(first + 1, Ordering::Relaxed);
    Err(failed.join("; "))
}

/// Dials sink agent `sink` (index `at` of the link's sinks): the pool's
/// connections, the first one carrying the control stream.
async fn dial_sink(
    inner: &Inner,
    link: &LinkState,
    sink: &SinkPeer,
    at: usize,
) -> Result<LinkConn, String> {
    let l = &link.cfg;
    let peer_addr = tokio::net::lookup_host(&sink.addr)
        .await
        .map_err(|e| format!("looking up {}: {e}", sink.addr))?
        .next()
        .ok_or_else(|| format!("{} resolves to no address", sink.addr))?;
    let endpoints = link_endpoints(inner, link)?;
    let version = link.speak.load(Ordering::Relaxed);
    // All handshakes at once: a pool takes one round trip, not one each.
    // The first connection carries the control stream: if it fails, so
    // does the dial. A further one that fails is left out: the pool works
    // with fewer connections until the link dials again.
    let results = futures::future::join_all(
        endpoints
            .iter()
            .map(|ep| handshake(inner, link, ep, peer_addr, &sink.name, version)),
    )
    .await;
    let mut dialled = Vec::with_capacity(results.len());
    for (index, r) in results.into_iter().enumerate() {
        match r {
            Ok(d) => dialled.push(d),
            Err(e) if index == 0 => return Err(e),
            Err(e) => {
                let local = endpoints[index]
                    .local_addr()
                    .map_or_else(|_| "an unknown address".to_string(), |a| a.to_string());
                warn!(
                    link = l.name,
                    connection = index,
                    local = %local,
                    "a further connection of the link failed its handshake; going on without it: {e}"
                );
            }
        }
    }
    let inbox: Arc<Mutex<HashMap<TransferId, mpsc::UnboundedSender<Control>>>> = Arc::default();
    let unanswered: Arc<Mutex<HashMap<TransferId, u32>>> = Arc::default();
    let pool: Arc<Vec<Connection>> = Arc::new(dialled.iter().map(|d| d.0.clone()).collect());
    let pool_no = link.sched.new_pool(pool.len());
    let greeted = Arc::new(AtomicBool::new(false));
    let mut ctls = Vec::new();
    for (index, (conn, ctl, recv)) in dialled.into_iter().enumerate() {
        // Every connection's control stream is read: the control one's
        // carries the sink's answers; the others' only the sink's hello
        // (the sink answers a transfer on the connection that opened it).
        tokio::spawn(read_control(
            l.name.clone(),
            sink.name.clone(),
            index,
            conn.clone(),
            recv,
            inbox.clone(),
            unanswered.clone(),
            link.sched.clone(),
            greeted.clone(),
            version,
            link.speak.clone(),
        ));
        ctls.push(ctl);
        for w in 0..inner.cfg.streams.max(1) {
            tokio::spawn(dispatch::writer(
                link.sched.clone(),
                conn.clone(),
                dispatch::WriterId {
                    pool: pool_no,
                    connection: index,
                    writer: w,
                },
                inner.cfg.batch_bytes,
                inner.shutdown.child_token(),
            ));
        }
    }
    // The control connection lost loses the pool: the transfers' opens,
    // commits and the sink's answers travel on it, so every transfer
    // resumes on a new pool.
    let (p2, link_name, sched) = (pool.clone(), l.name.clone(), link.sched.clone());
    let (sink_at, several) = (link.sink_at.clone(), l.sinks().len() > 1);
    tokio::spawn(async move {
        let Some(control) = p2.first() else { return };
        let why = control.closed().await;
        sched.pool_closed(pool_no);
        if several && !matches!(why, quinn::ConnectionError::LocallyClosed) {
            // The sink agent went away (or reset us): the next dial tries
            // the next sink agent of the link first.
            let _ = sink_at.compare_exchange(at, at + 1, Ordering::Relaxed, Ordering::Relaxed);
        }
        if p2.len() > 1 {
            debug!(link = link_name, reason = %why, "the control connection of the link closed; closing the others");
        }
        for c in p2.iter() {
            c.close(
                VarInt::from_u32(code::PROTOCOL),
                b"the control connection of the link was lost",
            );
        }
    });
    // Another connection lost: the pool goes on without it, and the chunks
    // of its batches the sink had not confirmed go to the others.
    let lost = Arc::new(AtomicU64::new(0));
    for (index, conn) in pool.iter().enumerate().skip(1) {
        let (conn, control, lost) = (conn.clone(), pool[0].clone(), lost.clone());
        let (sched, link_name) = (link.sched.clone(), l.name.clone());
        let shutdown = inner.shutdown.clone();
        tokio::spawn(async move {
            let why = conn.closed().await;
            if control.close_reason().is_some() || shutdown.is_cancelled() {
                return;
            }
            lost.fetch_add(1, Ordering::Relaxed);
            let (batches, chunks) = sched.connection_lost(pool_no, index);
            sched.counters.moved.inc_by(chunks);
            warn!(
                link = link_name,
                connection = index,
                batches_given_up = batches,
                chunks_moved = chunks,
                reason = %why,
                "a connection of the link was lost; its unconfirmed chunks go to the others"
            );
        });
    }
    let ctl = Arc::new(ctls.remove(0));
    Ok(LinkConn {
        conn: pool[0].clone(),
        pool,
        ctl,
        _idle_ctls: Arc::new(ctls),
        inbox,
        unanswered,
        sched: link.sched.clone(),
        lost,
        greeted,
        version,
    })
}

/// The protocol version to speak next to a sink whose refusal of a hello
/// in `version` was `message`: the newest version it names ("this sink
/// speaks A to B", as every release's sink words it), if that is older
/// than `version` and at least [`MIN_SOURCE_VERSION`].
fn older_version_to_speak(message: &str, version: u16) -> Option<u16> {
    let rest = message.split("this sink speaks ").nth(1)?;
    let (lo, hi) = rest.split_once(" to ")?;
    let lo: u16 = lo.trim().parse().ok()?;
    let hi: u16 = hi
        .trim()
        .trim_end_matches(|c: char| !c.is_ascii_digit())
        .parse()
        .ok()?;
    let newest = hi.min(version.saturating_sub(1));
    (newest >= lo && newest >= MIN_SOURCE_VERSION && hi < version).then_some(newest)
}

/// Reads the sink's side of the control stream of connection `index` of a
/// link's pool: first its hello (a refusal or another version closes the
/// connection with a log line, and so the pool if it is the control one),
/// then answers, routed to the transfers' inboxes, and batch
/// confirmations, handed to the dispatcher. When the control connection's
/// ends, the inboxes are dropped: every transfer learns the pool is gone.
#[allow(clippy::too_many_arguments)]
async fn read_control(
    link_name: String,
    peer_name: String,
    index: usize,
    conn: Connection,
    mut recv: quinn::RecvStream,
    ib: Arc<Mutex<HashMap<TransferId, mpsc::UnboundedSender<Control>>>>,
    un: Arc<Mutex<HashMap<TransferId, u32>>>,
    sched: Arc<LinkSched>,
    greeted: Arc<AtomicBool>,
    version: u16,
    speak: Arc<AtomicU16>,
) {
    let c2 = conn;
    let hello = tokio::time::timeout(Duration::from_secs(15), read_frame(&mut recv)).await;
    let refusal = match hello {
        Ok(Ok(Some(Control::Hello(h)))) if h.version == version => {
            if index == 0 {
                greeted.store(true, Ordering::Relaxed);
                info!(
                    link = link_name,
                    peer = h.agent,
                    site = h.site,
                    "connected to sink"
                );
            } else {
                debug!(
                    link = link_name,
                    connection = index,
                    "data connection to sink"
                );
            }
            None
        }
        Ok(Ok(Some(Control::Hello(h)))) => Some(format!(
            "incompatible protocol version: sink speaks {}, this source speaks {version}",
            h.version
        )),
        Ok(Ok(Some(Control::Error { message }))) => {
            // A sink of an older release names the versions it speaks:
            // the next dial speaks the newest of them this source knows.
            if let Some(older) = older_version_to_speak(&message, version).filter(|_| index == 0) {
                warn!(
                    link = link_name,
                    peer = peer_name,
                    "the sink speaks protocol versions up to {older}; dialling again in \
                     version {older} (upgrade the sink: a source of this release sends \
                     version {PROTOCOL_VERSION}'s additions only to a sink that speaks it)"
                );
                speak.store(older, Ordering::Relaxed);
            }
            Some(message)
        }
        Ok(Ok(Some(m))) => Some(format!("expected hello, got {}", m.name())),
        Ok(Ok(None)) => Some("sink closed the control stream".into()),
        Ok(Err(e)) => Some(
            c2.close_reason()
                .map(|r| r.to_string())
                .unwrap_or_else(|| e.to_string()),
        ),
        Err(_) => Some("no hello within 15 s".into()),
    };
    if let Some(why) = refusal {
        warn!(
            link = link_name,
            peer = peer_name,
            "sink refused the connection: {why}"
        );
        c2.close(VarInt::from_u32(code::PROTOCOL), b"hello failed");
        if index == 0 {
            crate::lock::lock(&ib).clear();
        }
        return;
    }
    loop {
        match read_frame(&mut recv).await {
            Ok(Some(Control::BatchDone { id, seqs })) => {
                // The sink has these batches: their chunks need not be
                // kept for re-sending on another connection.
                sched.confirmed(id, &seqs);
            }
            Ok(Some(msg)) => {
                let id = match &msg {
                    Control::Have { id, .. }
                    | Control::Need { id, .. }
                    | Control::Refuse { id, .. }
                    | Control::Published { id, .. }
                    | Control::PartEpoch { id, .. }
                    | Control::Cancel { id, .. } => *id,
                    Control::Error { message } => {
                        warn!(message, "sink reported an error");
                        break;
                    }
                    other => {
                        warn!(msg = other.name(), "unexpected message from sink");
                        c2.close(VarInt::from_u32(code::PROTOCOL), b"unexpected message");
                        break;
                    }
                };
                if matches!(msg, Control::Have { .. } | Control::Refuse { .. })
                    && !answers_latest_open(&mut crate::lock::lock(&un), id)
                {
                    debug!(transfer = %id, msg = msg.name(), "answer to an earlier run's open dropped");
                    continue;
                }
                let tx = crate::lock::lock(&ib).get(&id).cloned();
                if let Some(tx) = tx {
                    let _ = tx.send(msg);
                }
            }
            Ok(None) => break,
            Err(e) => {
                let why = c2
                    .close_reason()
                    .map(|r| r.to_string())
                    .unwrap_or_else(|| e.to_string());
                if index == 0 {
                    // Once per pool: the transfers on it say they resume.
                    info!(
                        link = link_name,
                        peer = peer_name,
                        "the connection to the sink ended: {why}"
                    );
                } else {
                    debug!(
                        link = link_name,
                        connection = index,
                        "control stream ended: {why}"
                    );
                }
                break;
            }
        }
    }
    // Dropping the senders tells every transfer the pool is gone: only the
    // control connection's end does (another's only loses its batches,
    // which `LinkSched::connection_lost` sends again elsewhere).
    if index == 0 {
        crate::lock::lock(&ib).clear();
    }
}

/// Counts an answer (have or refuse) to one of `id`'s opens on a
/// connection; true if it answers the latest one, false if a later open of
/// the transfer is still out (the answer belongs to an earlier run). An
/// answer with no open out is passed on.
fn answers_latest_open(unanswered: &mut HashMap<TransferId, u32>, id: TransferId) -> bool {
    match unanswered.get_mut(&id) {
        Some(n) if *n > 1 => {
            *n -= 1;
            false
        }
        Some(_) => {
            unanswered.remove(&id);
            true
        }
        None => true,
    }
}

/// How often the link worker looks at the queue without being woken
/// (promotions expire, scores age, watched checkpoints get their view).
const RECONCILE_EVERY: Duration = Duration::from_secs(1);

/// How often the link worker writes the progress of running transfers to
/// the catalog (they also write it whenever they stop).
const SAVE_PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// The scheduler's view of a catalog row at `now_ms`: effective class,
/// the job's size and importance (the transfer's override first).
fn sched_transfer(
    t: &Transfer,
    jobs: &HashMap<String, ferry_catalog::Job>,
    now_ms: i64,
) -> scheduler::Transfer {
    let job = jobs.get(&t.job);
    let class = t.class;
    scheduler::Transfer {
        id: t.id,
        class: scheduler::effective_class(class, t.urgent_until, now_ms),
        job: t.job.clone(),
        model_params: job.and_then(|j| j.model_params),
        importance: t.importance.or(job.map(|j| j.importance)).unwrap_or(0.0),
        bytes_left: (t.bytes_total - t.bytes_done).max(0) as u64,
        created_ms: t.created_at,
        // A pushed directory's size is set when it is queued (or listed);
        // a checkpoint's once it is committed.
        size_final: t.bytes_total > 0 && t.checkpoint == CheckpointState::Committed,
        deadline_ms: t.deadline_ms(),
    }
}

/// How many of a job's newest committed checkpoints its outlook reads
/// its checkpoint size and interval from ([`Source::outlook`]).
pub const OUTLOOK_HISTORY: i64 = 6;

/// How often the source checks the deadlines of unfinished transfers
/// against the fluid model (1 s).
const DEADLINE_CHECK: Duration = Duration::from_secs(1);

/// Says once when a deadline is at risk (the fluid model's ready time
/// plus the margin passes it) and once when it is missed, every
/// [`DEADLINE_CHECK`]: a warning in the log, `ferry_deadlines_total`, and
/// the transfer's `deadline_state`, which the API and the UI show.
async fn deadline_watch(inner: Arc<Inner>) {
    let mut tick = tokio::time::interval(DEADLINE_CHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = inner.shutdown.cancelled() => return,
        }
        let ts = match inner.catalog.unfinished_transfers().await {
            Ok(ts) => ts,
            Err(e) => {
                debug!(error = %e, "catalog: reading transfers for their deadlines");
                continue;
            }
        };
        if !ts.iter().any(|t| {
            t.deadline_ms().is_some() && t.deadline_state.is_none()
                || t.deadline_state == Some(DeadlineState::AtRisk)
        }) {
            continue;
        }
        let jobs: HashMap<String, ferry_catalog::Job> = match inner.catalog.jobs().await {
            Ok(js) => js.into_iter().map(|j| (j.name.clone(), j)).collect(),
            Err(_) => continue,
        };
        let now = ferry_catalog::now_ms();
        for link in inner.links.values() {
            let mine: Vec<scheduler::Transfer> = ts
                .iter()
                .filter(|t| t.link == link.cfg.name && t.state != TransferState::Paused)
                .map(|t| {
                    let mut st = sched_transfer(t, &jobs, now);
                    if let Some(left) = live_bytes_left(&inner, t.id) {
                        st.bytes_left = left;
                    }
                    st
                })
                .collect();
            let (etas, margins) = {
                let s = link.sched.lock();
                let mut busy = [false; 3];
                for t in &mine {
                    busy[class_index(t.class)] = true;
                }
                let m: HashMap<scheduler::Class, i64> = [
                    scheduler::Class::Urgent,
                    scheduler::Class::Scheduled,
                    scheduler::Class::Background,
                ]
                .into_iter()
                .map(|c| (c, s.ls.deadline_margin_ms(c, busy)))
                .collect();
                (s.ls.fluid_eta(&mine, now), m)
            };
            for st in &mine {
                let Some(t) = ts.iter().find(|t| t.id == st.id) else {
                    continue;
                };
                let Some(d) = st.deadline_ms else { continue };
                let eta = etas.get(&st.id).copied().unwrap_or(i64::MAX);
                let margin = margins.get(&st.class).copied().unwrap_or(0);
                let said = if now > d {
                    Some(DeadlineState::Missed)
                } else if t.deadline_state.is_none() && eta.saturating_add(margin) > d {
                    Some(DeadlineState::AtRisk)
                } else {
                    None
                };
                let Some(state) = said else { continue };
                match inner.catalog.note_deadline(st.id, state).await {
                    Ok(true) => say_deadline(&inner, t, st.class, state, d, Some(eta)),
                    Ok(false) => {}
                    Err(e) => warn!(transfer = %st.id, error = %e, "catalog: noting a deadline"),
                }
            }
        }
    }
}

fn class_index(c: scheduler::Class) -> usize {
    match c {
        scheduler::Class::Urgent => 0,
        scheduler::Class::Scheduled => 1,
        scheduler::Class::Background => 2,
    }
}

/// Logs and counts what was said about transfer `t`'s deadline `d`
/// (Unix ms): `eta` is the fluid model's ready time, if known.
fn say_deadline(
    inner: &Inner,
    t: &Transfer,
    class: scheduler::Class,
    state: DeadlineState,
    d: i64,
    eta: Option<i64>,
) {
    inner.metrics.count_deadline(class, state.as_str());
    let by_s = |x: i64| (x - d) as f64 / 1000.0;
    match state {
        DeadlineState::AtRisk => warn!(
            transfer = %t.id,
            job = t.job,
            class = %class,
            late_by_s = eta.filter(|e| *e < i64::MAX).map(by_s),
            "deadline_at_risk: at the current queue and rates the replica would be ready after \
             its deadline; an operator can raise its class or importance, or lower others'"
        ),
        DeadlineState::Missed => warn!(
            transfer = %t.id,
            job = t.job,
            class = %class,
            "deadline_missed: the replica was not ready by its deadline"
        ),
        DeadlineState::Met => info!(
            transfer = %t.id,
            job = t.job,
            early_by_s = -by_s(ferry_catalog::now_ms()),
            "deadline met"
        ),
    }
}

/// After transfer `id` is published: says whether its deadline, if it
/// had one, was met or missed (once).
async fn settle_deadline(inner: &Inner, id: TransferId) {
    let Ok(Some(t)) = inner.catalog.transfer(id).await else {
        return;
    };
    let Some(d) = t.deadline_ms() else { return };
    let at = t.finished_at.unwrap_or_else(ferry_catalog::now_ms);
    let state = if at <= d {
        DeadlineState::Met
    } else {
        DeadlineState::Missed
    };
    match inner.catalog.note_deadline(id, state).await {
        Ok(true) => say_deadline(inner, &t, t.class, state, d, None),
        Ok(false) => {}
        Err(e) => warn!(transfer = %id, error = %e, "catalog: noting a deadline"),
    }
}

/// Bytes a running transfer has still to send, from its live progress
/// (the catalog's `bytes_done` is only written now and then).
fn live_bytes_left(inner: &Inner, id: TransferId) -> Option<u64> {
    let m = crate::lock::lock(&inner.progress);
    let p = m.get(&id)?;
    Some(p.total.load(Ordering::Relaxed).saturating_sub(p.done()))
}

/// Keeps what the run of transfer `id` achieved so far in the catalog
/// (see [`Catalog::note_transfer_progress`]); with `end`, the run is over
/// and its live progress goes.
///
/// The live entry goes only after the catalog has the numbers: a reader
/// that finds no live progress then reads them from the catalog, never
/// an older value.
async fn save_progress(inner: &Inner, id: TransferId, end: bool) {
    let live = crate::lock::lock(&inner.progress).get(&id).cloned();
    let Some(p) = live else { return };
    if let Err(e) = inner.catalog.note_transfer_progress(id, p.note()).await {
        warn!(transfer = %id, error = %e, "catalog: recording progress");
    }
    if end {
        let mut m = crate::lock::lock(&inner.progress);
        if m.get(&id).is_some_and(|q| Arc::ptr_eq(q, &p)) {
            m.remove(&id);
        }
    }
}

/// A link's [`LinkStats`] from its sampler.
fn link_stats(l: &LinkState, with_history: bool) -> LinkStats {
    let rate_bps = l.cap.load(Ordering::Relaxed);
    let pace_bps = l.share.rate_bps();
    let s = crate::lock::lock(&l.sampler);
    let class_bps = s.class_rates();
    let goodput_bps = class_bps.total();
    LinkStats {
        name: l.cfg.name.clone(),
        rate_bps,
        pool_fraction: f64::from_bits(l.fraction.load(Ordering::Relaxed)),
        pace_bps,
        connections: l.cfg.connections.max(1),
        connections_open: l.sched.open_connections(),
        sink: connected_sink(l),
        goodput_bps,
        utilisation: if pace_bps > 0 {
            goodput_bps / pace_bps as f64
        } else {
            0.0
        },
        class_bps,
        history: if with_history {
            s.history()
        } else {
            Vec::new()
        },
    }
}

/// The sink agent a link of several sink agents is connected to now.
fn connected_sink(l: &LinkState) -> Option<String> {
    if l.cfg.more_peers.is_empty() || l.sched.open_connections() == 0 {
        return None;
    }
    let at = l.sink_last.load(Ordering::Relaxed);
    l.cfg.sinks().get(at).map(|p| p.name.clone())
}

/// A transfer's rate window and the progress counters it follows (a
/// restarted transfer gets new ones).
type TransferWindow = (Arc<LiveProgress>, RateWindow<1>);

/// Takes one sample at `at_ms`: each link's payload bytes by class, each
/// running transfer's bytes sent; stores the rates they give.
fn take_sample(inner: &Inner, at_ms: i64, windows: &mut HashMap<TransferId, TransferWindow>) {
    for l in inner.links.values() {
        let totals = l.sched.counters.sent_totals();
        crate::lock::lock(&l.sampler).sample(at_ms, totals);
    }
    let live: Vec<(TransferId, Arc<LiveProgress>)> = match inner.progress.lock() {
        Ok(m) => m.iter().map(|(id, p)| (*id, p.clone())).collect(),
        Err(_) => return,
    };
    windows.retain(|id, _| live.iter().any(|(i, _)| i == id));
    for (id, p) in live {
        let w = windows
            .entry(id)
            .or_insert_with(|| (p.clone(), RateWindow::new(crate::metrics::RATE_WINDOW_MS)));
        if !Arc::ptr_eq(&w.0, &p) {
            *w = (p.clone(), RateWindow::new(crate::metrics::RATE_WINDOW_MS));
        }
        w.1.push(at_ms, [p.sent.load(Ordering::Relaxed)]);
        let [rate] = w.1.rates_bps();
        p.rate_bits.store(rate.to_bits(), Ordering::Relaxed);
    }
}

/// The 1-second sampler behind live rates ([`Source::link_stats`],
/// [`Progress::rate_bps`], link utilisation); stops with the source.
async fn sampler(inner: Arc<Inner>) {
    let mut windows = HashMap::new();
    let mut tick = tokio::time::interval(Duration::from_millis(crate::metrics::SAMPLE_EVERY_MS));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => take_sample(&inner, ferry_catalog::now_ms(), &mut windows),
            _ = inner.shutdown.cancelled() => return,
        }
    }
}

/// A transfer task's end: its id and result.
type Ended = (TransferId, Result<(), RunError>);

/// Runs one link: keeps a connection to its sink while there is work,
/// admits queued transfers in the scheduler's order (up to `max_active`
/// per class) and runs them concurrently, their chunks interleaved by
/// the link's dispatcher. Paused and cancelled transfers are stopped.
async fn link_worker(inner: Arc<Inner>, link: Arc<LinkState>) {
    let mut conn: Option<LinkConn> = None;
    let mut backoff = Duration::from_millis(250);
    let mut dial_after = tokio::time::Instant::now();
    let mut running: tokio::task::JoinSet<Ended> = tokio::task::JoinSet::new();
    let mut stops: HashMap<TransferId, CancellationToken> = HashMap::new();
    // Transfers whose wait for a watcher was noted in the catalog.
    let mut waits_noted: HashSet<TransferId> = HashSet::new();
    // The lease epoch each running transfer was claimed under (in a pool).
    let mut leases: HashMap<TransferId, i64> = HashMap::new();
    // Striped transfers coordinated elsewhere whose parts this agent sends
    // now (their runs are in `running` and `stops` too).
    let mut helping: HashSet<TransferId> = HashSet::new();
    // Striped transfers whose last help here ended in an error, and when
    // this agent may help them again (a sink that refuses at once would
    // otherwise be asked again at every notification).
    let mut help_after: HashMap<TransferId, tokio::time::Instant> = HashMap::new();
    // Dialling only to keep the link warm has failed since it last
    // connected (said once, at info).
    let mut warm_failing = false;
    let pool = inner.cfg.pool.clone();
    // The deadline margin starts from the sink's recent finishing times.
    match inner.catalog.transfers(200, 0).await {
        Ok(ts) => {
            let mut seen: Vec<i64> = ts
                .iter()
                .filter(|t| t.link == link.cfg.name && t.state == TransferState::Published)
                .filter_map(|t| t.phases.as_ref().map(finish_ms))
                .take(FINISH_HISTORY)
                .collect();
            seen.reverse();
            for ms in seen {
                link.note_finish(ms);
            }
        }
        Err(e) => warn!(link = link.cfg.name, error = %e, "catalog: reading recent publishes"),
    }
    let mut saved_at = tokio::time::Instant::now();
    let mut reconciled_at;
    // Signals still live after a restart raise their jobs' scores again.
    let horizon = 20 * crate::lock::lock(&inner.policy).severity_half_life_ms as i64;
    match inner
        .catalog
        .signals_since(ferry_catalog::now_ms() - horizon)
        .await
    {
        Ok(sigs) => {
            for g in &sigs {
                link.count_signal(g);
            }
        }
        Err(e) => warn!(error = %e, "catalog: loading signals"),
    }
    loop {
        if inner.shutdown.is_cancelled() {
            break;
        }
        let now = ferry_catalog::now_ms();
        reconciled_at = tokio::time::Instant::now();
        let (ts, jobs) = match (
            inner.catalog.unfinished_transfers().await,
            inner.catalog.jobs().await,
        ) {
            (Ok(ts), Ok(jobs)) => (
                ts,
                jobs.into_iter()
                    .map(|j| (j.name.clone(), j))
                    .collect::<HashMap<_, _>>(),
            ),
            (Err(e), _) | (_, Err(e)) => {
                warn!(error = %e, "catalog");
                tokio::select! {
                    _ = tokio::time::sleep(RECONCILE_EVERY) => continue,
                    _ = inner.shutdown.cancelled() => break,
                }
            }
        };
        let mine: Vec<&Transfer> = ts.iter().filter(|t| t.link == link.cfg.name).collect();
        // In a pool: transfers another agent holds a live lease on run
        // there, and count against max_active here.
        let me = inner.cfg.agent.as_str();
        let held_elsewhere =
            |t: &Transfer| pool.is_some() && t.holder.as_deref().is_some_and(|h| h != me);
        // What running transfers achieved so far survives a crash too.
        if saved_at.elapsed() >= SAVE_PROGRESS_EVERY {
            saved_at = tokio::time::Instant::now();
            for id in stops.keys() {
                save_progress(&inner, *id, false).await;
            }
        }
        // Running transfers: follow class and importance changes; stop the
        // ones an operator paused or cancelled (the catalog says so first).
        for t in &mine {
            if let Some(stop) = stops.get(&t.id) {
                if t.state == TransferState::Paused {
                    stop.cancel();
                } else {
                    let mut st = sched_transfer(t, &jobs, now);
                    st.bytes_left = live_bytes_left(&inner, t.id).unwrap_or(st.bytes_left);
                    link.sched.lock().ls.upsert(st, now);
                }
            }
        }
        let mine_ids: HashSet<TransferId> = mine.iter().map(|t| t.id).collect();
        for (id, stop) in &stops {
            if !mine_ids.contains(id) {
                // Cancelled (final) by an operator.
                stop.cancel();
            }
        }
        link.sched.poke();
        // A checkpoint only its root's watcher can run, queued for 10 s
        // with no watcher here following it: say why it waits (once).
        for t in &mine {
            if t.state == TransferState::Queued
                && t.error.is_none()
                && now.saturating_sub(t.created_at) >= 10_000
                && !held_elsewhere(t)
                && !runnable(&inner, t)
                && waits_noted.insert(t.id)
            {
                let note = "waits for the watcher of its source root to follow it (an announced \
                            checkpoint until its first files appear; in a pool, `ferry pool` lists \
                            each root's watcher, and none may watch it now)";
                if let Err(e) = inner.catalog.set_transfer_note(t.id, Some(note)).await {
                    warn!(transfer = %t.id, error = %e, "recording why a transfer waits");
                }
            }
        }
        let waiting: Vec<scheduler::Transfer> = mine
            .iter()
            .filter(|t| {
                t.state != TransferState::Paused
                    && !stops.contains_key(&t.id)
                    && !held_elsewhere(t)
                    && runnable(&inner, t)
            })
            .map(|t| sched_transfer(t, &jobs, now))
            .collect();
        let elsewhere: Vec<scheduler::Transfer> = mine
            .iter()
            .filter(|t| held_elsewhere(t) && !stops.contains_key(&t.id))
            .map(|t| sched_transfer(t, &jobs, now))
            .collect();
        // A drained agent, or one whose catalog does not answer, claims
        // nothing.
        let waiting = if pool.as_ref().is_some_and(|p| !p.may_claim()) {
            Vec::new()
        } else {
            waiting
        };
        if running.is_empty() {
            if let Some(c) = conn.as_ref().filter(|c| c.lost.load(Ordering::Relaxed) > 0) {
                // A pool that lost connections other than the control one
                // is replaced once nothing runs on it: the next transfer
                // gets every connection again.
                info!(
                    link = link.cfg.name,
                    lost = c.lost.load(Ordering::Relaxed),
                    "replacing the link's pool, which lost connections"
                );
                c.close(code::DONE, b"replacing a pool that lost connections");
                conn = None;
            }
        }
        // Striped transfers held elsewhere with parts left to claim: this
        // agent sends some (and dials for them).
        let mut helpable = Vec::new();
        let room = MAX_HELPED.saturating_sub(helping.len());
        if room > 0 && pool.as_ref().is_some_and(|p| p.may_claim()) {
            let now_i = tokio::time::Instant::now();
            help_after.retain(|_, at| *at > now_i);
            let candidates: Vec<TransferId> = mine
                .iter()
                .filter(|t| {
                    // Pushed, or watched and striped at its commit.
                    held_elsewhere(t)
                        && t.profile == Profile::Full
                        && t.state != TransferState::Paused
                        && !stops.contains_key(&t.id)
                        && !help_after.contains_key(&t.id)
                })
                .map(|t| t.id)
                .collect();
            if !candidates.is_empty() {
                let joins = conn
                    .as_ref()
                    .is_some_and(|c| c.version >= ferry_proto::wire::JOIN_VERSION);
                match inner
                    .catalog
                    .claimable_transfers_for(&candidates, joins)
                    .await
                {
                    Ok(list) => helpable = list.into_iter().take(room).collect(),
                    Err(e) => {
                        warn!(link = link.cfg.name, error = %e, "catalog: looking for parts to claim")
                    }
                }
            }
        }
        let pins_pending = !crate::lock::lock(&link.pins).is_empty();
        // An agent of a pool keeps its link's connections up while idle:
        // when another agent stores a plan, it claims and sends parts
        // without first dialling (a handshake of a round trip or two).
        let warm = pool.as_ref().is_some_and(|p| p.may_claim());
        if (!waiting.is_empty() || pins_pending || !helpable.is_empty() || warm)
            && conn
                .as_ref()
                .is_none_or(|c| c.conn.close_reason().is_some())
            && running.is_empty()
            && tokio::time::Instant::now() >= dial_after
        {
            match dial(&inner, &link).await {
                Ok(c) => {
                    link.connections
                        .fetch_add(c.pool.len() as u64, Ordering::Relaxed);
                    conn = Some(c);
                    warm_failing = false;
                }
                Err(e) => {
                    if waiting.is_empty() && helpable.is_empty() && !pins_pending {
                        // Only keeping the link warm: said once per
                        // streak of failures, since nothing waits on it.
                        if std::mem::replace(&mut warm_failing, true) {
                            debug!(link = link.cfg.name, retry_in = ?backoff, "{e}");
                        } else {
                            info!(link = link.cfg.name, retry_in = ?backoff, "keeping the link's connections up while idle: {e}");
                        }
                    } else {
                        warn!(link = link.cfg.name, retry_in = ?backoff, "{e}");
                    }
                    for t in waiting.iter().take(16) {
                        if let Err(ce) = inner.catalog.set_transfer_note(t.id, Some(&e)).await {
                            warn!(transfer = %t.id, error = %ce, "recording why the link cannot connect");
                        }
                    }
                    dial_after = tokio::time::Instant::now() + backoff;
                    backoff = (backoff * 2).min(Duration::from_secs(10));
                }
            }
        }
        if conn
            .as_ref()
            .is_some_and(|c| c.greeted.load(Ordering::Relaxed))
        {
            backoff = Duration::from_millis(250);
        }
        if let Some(c) = conn.as_ref().filter(|c| c.conn.close_reason().is_none()) {
            if pins_pending {
                send_pins(&link, c).await;
            }
            let admit = link
                .sched
                .lock()
                .ls
                .admit_in_pool(&waiting, &elsewhere, now);
            // In a pool, an agent running its share of max_active leaves
            // new transfers any agent can run to its peers for
            // SPREAD_WAIT_MS.
            let counts = |t: &Transfer| {
                let st = sched_transfer(t, &jobs, now);
                !st.is_small(link.sched.lock().ls.policy())
            };
            let mut running_big = mine
                .iter()
                .filter(|t| stops.contains_key(&t.id) && counts(t))
                .count();
            for id in admit {
                let Some(t) = mine.iter().find(|t| t.id == id).map(|t| (*t).clone()) else {
                    continue;
                };
                // A watched checkpoint runs only where its watcher is
                // (see runnable): never left to peers.
                if let Some(p) = pool.as_ref().filter(|_| t.format.is_none()) {
                    let st = sched_transfer(&t, &jobs, now);
                    if link.sched.lock().ls.leave_to_peers(
                        &st,
                        running_big,
                        p.live_peers(),
                        now.saturating_sub(t.created_at),
                        SPREAD_WAIT_MS,
                    ) {
                        continue;
                    }
                }
                let mut claimed_at = None;
                if let Some(p) = &pool {
                    let timeout = p.config().lease_timeout.as_millis() as i64;
                    match inner.catalog.claim_transfer(id, me, timeout).await {
                        Ok(Some(claim)) => {
                            if let Some(from) = &claim.took_over_from {
                                info!(
                                    link = link.cfg.name,
                                    transfer = %id,
                                    from = from.as_str(),
                                    epoch = claim.epoch,
                                    "took the transfer over: the previous holder's lease lapsed"
                                );
                                p.count_takeover();
                            }
                            leases.insert(id, claim.epoch);
                            claimed_at = Some(std::time::Instant::now());
                        }
                        // Another agent claimed it first, or it was paused.
                        Ok(None) => continue,
                        Err(e) => {
                            warn!(transfer = %id, error = %e, "catalog: claiming the transfer");
                            continue;
                        }
                    }
                }
                let st = sched_transfer(&t, &jobs, now);
                if !st.is_small(link.sched.lock().ls.policy()) {
                    running_big += 1;
                }
                link.sched.activate(st, Arc::new(LiveProgress::default()));
                inner
                    .phase_clocks
                    .begin(id, t.created_at, t.opened_at, t.format.is_none());
                inner.phase_clocks.note(id, phases::Event::RunStart);
                let stop = inner.shutdown.child_token();
                stops.insert(id, stop.clone());
                let (inner2, c2) = (inner.clone(), c.clone());
                // In a pool, the run also ends once its lease may have
                // lapsed, whatever it is waiting on (a catalog that does
                // not answer included): before another agent may claim it.
                let fence = pool.clone().zip(claimed_at);
                let (sched, link_name) = (link.sched.clone(), link.cfg.name.clone());
                running.spawn(async move {
                    let lost = async {
                        match &fence {
                            Some((p, at)) => p.lost(id, *at).await,
                            None => std::future::pending().await,
                        }
                    };
                    let fenced = || {
                        warn!(
                            link = link_name,
                            transfer = %id,
                            "this agent may no longer hold the transfer's lease (not renewed in \
                             time: the catalog does not answer, or the agent was paused); \
                             stopping its run"
                        );
                        // Chunks queued for the link's writers go too.
                        sched.deactivate(id);
                        if let Some((p, _)) = &fence {
                            p.count_lost();
                        }
                        Err(RunError::Stopped)
                    };
                    let r = tokio::select! {
                        r = run_one(&inner2, &c2, t) => r,
                        _ = stop.cancelled() => Err(RunError::Stopped),
                        _ = lost => fenced(),
                    };
                    // A run that failed just as its lease may have lapsed
                    // (the watch of its root, fenced at the same moment,
                    // stopped the watcher it was following) lost its lease
                    // too: said and counted as such, at once.
                    let r = match (&r, &fence) {
                        (
                            Err(RunError::Retry(_) | RunError::Fatal(_) | RunError::Cancelled(_)),
                            Some((p, at)),
                        ) if !p.holds(id, *at) => fenced(),
                        _ => r,
                    };
                    if r.is_err() {
                        inner2.phase_clocks.note(id, phases::Event::RunEnd);
                    }
                    (id, r)
                });
            }
        }
        // Striped transfers another agent coordinates: this agent claims
        // and sends their parts too, in the pool's claim order.
        if let Some(c) = conn.as_ref().filter(|c| c.conn.close_reason().is_none()) {
            for cl in helpable.drain(..) {
                let Some(t) = mine
                    .iter()
                    .find(|t| t.id == cl.transfer)
                    .map(|t| (*t).clone())
                else {
                    continue;
                };
                let id = t.id;
                link.sched.activate(
                    sched_transfer(&t, &jobs, now),
                    Arc::new(LiveProgress::default()),
                );
                let stop = inner.shutdown.child_token();
                stops.insert(id, stop.clone());
                helping.insert(id);
                debug!(link = link.cfg.name, transfer = %id, parts = cl.parts, "claiming parts of a striped transfer another agent coordinates");
                let (inner2, c2) = (inner.clone(), c.clone());
                running.spawn(async move {
                    let r = tokio::select! {
                        r = parts::run_helper(&inner2, &c2, &t) => r,
                        _ = stop.cancelled() => Err(RunError::Stopped),
                    };
                    (id, r)
                });
            }
        }
        if pool.is_some() {
            // The link's budget is the pool's: this agent paces at its
            // fraction of it, by the class rules over what runs anywhere.
            // A striped transfer's share is split among the agents
            // holding its parts now.
            let running_ids: Vec<TransferId> = stops.keys().copied().collect();
            let mut split: HashMap<TransferId, f64> = HashMap::new();
            match inner.catalog.part_holders(&running_ids, me).await {
                Ok(hs) => {
                    for (id, holders, mine) in hs {
                        // An agent continued after the fault-injection
                        // pause keeps its pace: what is under test then
                        // is the sink's epoch check, not the budget.
                        let mine = mine || !parts::checks_own_leases();
                        split.insert(
                            id,
                            if mine {
                                1.0 / holders.max(1) as f64
                            } else {
                                0.0
                            },
                        );
                    }
                }
                Err(e) => {
                    debug!(link = link.cfg.name, error = %e, "catalog: reading who holds parts")
                }
            }
            let ps = link.sched.lock().ls.pool_share(&elsewhere, &split, now);
            let f = ps.fraction;
            let old = f64::from_bits(link.fraction.load(Ordering::Relaxed));
            // Capped classes change when a class above them starts or ends
            // anywhere in the pool (a signal's urgent transfer): applied
            // at once, like a change of the fraction.
            let caps_moved = {
                let mut c = crate::lock::lock(&link.class_caps);
                let moved = c.iter().zip(ps.class_caps).any(|(a, b)| match (a, b) {
                    (Some(a), Some(b)) => (a - b).abs() > 0.01,
                    (None, None) => false,
                    _ => true,
                });
                if moved {
                    *c = ps.class_caps;
                }
                moved
            };
            if caps_moved || (f - old).abs() > 0.01 || (f != old && (f == 1.0 || f == 0.0)) {
                link.fraction.store(f.to_bits(), Ordering::Relaxed);
                // A fraction that falls while the class caps stay is the
                // budget split again among a transfer's holders (another
                // agent claimed its parts): eased over one RTT, so this
                // agent's connection does not fall silent meanwhile. A
                // pre-emption moves the caps and applies at once.
                link.apply_rate(!caps_moved);
                debug!(
                    link = link.cfg.name,
                    fraction = f,
                    class_caps = ?ps.class_caps,
                    "this agent's share of the link's budget"
                );
            }
        }
        let sleep = if conn.is_none() && !waiting.is_empty() {
            tokio::time::sleep_until(dial_after.max(tokio::time::Instant::now()))
        } else {
            tokio::time::sleep(RECONCILE_EVERY)
        };
        tokio::select! {
            Some(r) = running.join_next(), if !running.is_empty() => {
                // Transfers that end close together are handled in
                // one go, then reconciled once: a burst of small
                // transfers would otherwise reload the whole queue
                // from the catalog once per transfer.
                tokio::time::sleep_until(reconciled_at + MIN_RECONCILE_GAP).await;
                let mut next = Some(r);
                while let Some(r) = next.take() {
                    if let Ok((id, result)) = r {
                        stops.remove(&id);
                        link.sched.deactivate(id);
                        if pool.is_some() && !matches!(result, Err(RunError::Shutdown)) {
                            // Whatever ended the run (a pause, a cancel, an
                            // error after a claim whose answer was lost),
                            // no claim of it stays held: the heartbeat
                            // would renew it for as long as this agent
                            // lives. No other run of the transfer exists
                            // here now (a new one starts only after
                            // `stops` lost it, in this loop). Bounded: a
                            // stop often means the catalog does not answer.
                            match tokio::time::timeout(GIVE_BACK_WAIT, inner.catalog.give_back_parts_of(id, me)).await {
                                Ok(Ok(0)) => {}
                                Ok(Ok(n)) => debug!(transfer = %id, parts = n, "gave back the parts its ended run still held"),
                                Ok(Err(e)) => warn!(transfer = %id, error = %e, "catalog: giving back the parts of an ended run (their leases lapse once this agent stops)"),
                                Err(_) => warn!(transfer = %id, "catalog: giving back the parts of an ended run took over {} s; given up (their leases lapse once this agent stops)", GIVE_BACK_WAIT.as_secs()),
                            }
                        }
                        if let Some(c) = conn.as_ref() {
                            crate::lock::lock(&c.inbox).remove(&id);
                        }
                        if helping.remove(&id) {
                            // Its parts are released or given back; the
                            // transfer's row is its coordinator's.
                            match &result {
                                Ok(()) | Err(RunError::Stopped | RunError::Shutdown) => {}
                                Err(RunError::Retry(why) | RunError::Fatal(why) | RunError::Cancelled(why)) => {
                                    info!(
                                        link = link.cfg.name,
                                        transfer = %id,
                                        "sending parts of a striped transfer stopped: {why}; helping it again in {} s at the earliest",
                                        HELP_RETRY.as_secs()
                                    );
                                    help_after.insert(id, tokio::time::Instant::now() + HELP_RETRY);
                                }
                            }
                            next = running.try_join_next();
                            continue;
                        }
                        let lost = end_transfer(&inner, conn.as_ref(), id, result, backoff).await;
                        if let (Some(epoch), Some(p)) = (leases.remove(&id), &pool) {
                            if let Err(e) = p.catalog().release_transfer(id, me, epoch).await {
                                warn!(transfer = %id, error = %e, "catalog: releasing the transfer's lease (it lapses by itself)");
                            }
                        }
                        if let Some(c) = conn.as_ref().filter(|_| lost) {
                            // Every transfer on this connection resumes on a new one.
                            c.close(code::PROTOCOL, b"resuming on a new connection");
                            conn = None;
                            dial_after = tokio::time::Instant::now() + backoff;
                            backoff = (backoff * 2).min(Duration::from_secs(10));
                        }
                    }
                    next = running.try_join_next();
                }
            }
            _ = async { match &pool { Some(p) => p.changed().await, None => std::future::pending().await } } => {}
            _ = link.wake.notified() => {
                // A burst of submissions (each wakes the worker) is
                // reconciled at most every MIN_RECONCILE_GAP too.
                tokio::time::sleep_until(reconciled_at + MIN_RECONCILE_GAP).await;
            }
            _ = sleep => {}
            _ = inner.shutdown.cancelled() => {}
        }
    }
    // Stopping: transfers end at their next await; batches at a chunk
    // boundary (the writers see the same token). What they achieved stays
    // in the catalog for the restart.
    while let Some(r) = running.join_next().await {
        if let Ok((id, _)) = r {
            save_progress(&inner, id, true).await;
        }
    }
}

/// Most striped transfers coordinated by other agents whose parts one
/// agent sends at once, per link.
const MAX_HELPED: usize = 4;

/// How long the link worker waits for the catalog to give back the parts
/// an ended run still held.
const GIVE_BACK_WAIT: Duration = Duration::from_secs(5);

/// How long an agent waits before it helps a striped transfer again
/// after its help ended in an error (its parts were given back; the
/// coordinator and the other agents claim them meanwhile).
const HELP_RETRY: Duration = Duration::from_secs(2);

/// Least time between two reloads of a link's queue from the catalog
/// after transfers end or are submitted (those ending or arriving
/// meanwhile are handled together).
const MIN_RECONCILE_GAP: Duration = Duration::from_millis(10);

/// Runs transfer `t` to its end on `c`.
async fn run_one(inner: &Arc<Inner>, c: &LinkConn, t: Transfer) -> Result<(), RunError> {
    let view = crate::lock::lock(&inner.views).get(&t.id).cloned();
    match (t.format.is_some(), view) {
        (false, _) => run_transfer(inner, c, t).await,
        (true, Some(view)) => streaming::run_watched(inner, c, t, view).await,
        (true, None) => Err(RunError::Cancelled(format!("checkpoint {}", t.checkpoint))),
    }
}

/// Records how a transfer task ended; true if the connection must be
/// replaced (the transfer resumes on the next one).
async fn end_transfer(
    inner: &Inner,
    c: Option<&LinkConn>,
    id: TransferId,
    result: Result<(), RunError>,
    backoff: Duration,
) -> bool {
    save_progress(inner, id, true).await;
    if !matches!(result, Err(RunError::Retry(_))) {
        // Ended (a retry sends its weights-only commit again).
        crate::lock::lock(&inner.weights_roots).remove(&id);
    }
    let tell_sink = |why: String| async move {
        // Tell the sink, so it drops its staging data and stops reporting
        // the transfer as replicating.
        if let Some(c) = c {
            let _ = c.ctl.send(&Control::Cancel { id, reason: why }).await;
        }
    };
    match result {
        Ok(()) | Err(RunError::Shutdown) => false,
        Err(RunError::Stopped) => {
            // An operator paused or cancelled it; the catalog says which.
            if let Ok(Some(t)) = inner.catalog.transfer(id).await {
                if t.state == TransferState::Cancelled {
                    info!(transfer = %id, "transfer cancelled by an operator");
                    tell_sink("cancelled by an operator".into()).await;
                } else {
                    info!(transfer = %id, state = %t.state, "transfer stopped");
                }
            }
            false
        }
        Err(RunError::Cancelled(why)) => {
            info!(transfer = %id, "transfer cancelled: {why}");
            inner.phase_clocks.forget(id);
            tell_sink(why.clone()).await;
            if let Err(e) = inner
                .catalog
                .set_transfer_state(id, TransferState::Cancelled, Some(&why))
                .await
            {
                warn!(transfer = %id, error = %e, "recording the transfer cancelled");
            }
            false
        }
        Err(RunError::Fatal(why)) => {
            warn!(transfer = %id, "transfer failed: {why}");
            inner.phase_clocks.forget(id);
            tell_sink(why.clone()).await;
            if let Err(e) = inner
                .catalog
                .set_transfer_state(id, TransferState::Failed, Some(&why))
                .await
            {
                warn!(transfer = %id, error = %e, "recording the transfer failed");
            }
            false
        }
        Err(RunError::Retry(why)) => {
            if inner.cfg.pool.as_ref().is_some_and(|p| p.draining()) {
                // Drained: the watch (and with it the run) went to
                // another agent of the pool, which resumes it.
                info!(transfer = %id, "transfer handed over (this agent is drained): {why}");
            } else {
                warn!(transfer = %id, retry_in = ?backoff, "transfer interrupted, will resume: {why}");
            }
            true
        }
    }
}

/// How long (ms) an agent of a pool that runs its share of `max_active`
/// leaves a new transfer to the other live agents before it takes it
/// anyway ([`scheduler::LinkScheduler::leave_to_peers`]): three reconcile
/// passes of theirs.
const SPREAD_WAIT_MS: i64 = 3_000;

/// A watched checkpoint's transfer can run once the watcher follows it
/// (an announced checkpoint waits for its first bytes); others always.
fn runnable(inner: &Inner, t: &Transfer) -> bool {
    t.format.is_none()
        || t.checkpoint == CheckpointState::Abandoned
        || t.checkpoint == CheckpointState::Deleted
        || crate::lock::lock(&inner.views).contains_key(&t.id)
}

/// A chunk ready to go: where it belongs and its bytes (a clone shares
/// them).
#[derive(Clone)]
struct Record {
    header: RecordHeader,
    /// The chunk's bytes, handed to quinn without a copy
    /// (`SendStream::write_all_chunks`).
    data: bytes::Bytes,
}

/// How a run of a transfer starts, from what the catalog says (see
/// [`begin`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Start {
    /// No run of it ever reached a sink and no replica of its checkpoint
    /// was published before: the sink has nothing, so its data follows
    /// the open at once, saving a round trip.
    Fresh,
    /// The sink may hold the transfer or chunks of it already (an earlier
    /// run opened it, or unchanged files of a re-save): wait for the
    /// sink's have list before sending data.
    Resume,
    /// The transfer was paused or cancelled after the link worker admitted
    /// it: the run stops before telling the sink anything.
    Stopped,
}

/// Decides how a run starts. `started_before`: the transfer's row had
/// `started_at` when the run was admitted; `published_before`: a replica
/// of the same checkpoint was published before; `took_active`: the
/// catalog accepted the run's `active` write (it refuses one over a pause
/// or a final state).
///
/// A fresh run sends data right behind its open, and the sink files a
/// batch under whichever open of that transfer it has handled when the
/// batch arrives: a second open of a transfer on the same connection must
/// therefore never be fresh, or its data lands in the first open's state
/// and its commit waits for a batch the sink never counts for it. That
/// holds because `started_at` is stamped by the very `active` write that
/// every run needs accepted before it contacts the sink.
fn start_of(started_before: bool, published_before: bool, took_active: bool) -> Start {
    if !took_active {
        Start::Stopped
    } else if started_before || published_before {
        Start::Resume
    } else {
        Start::Fresh
    }
}

/// Marks transfer `t` (its row as the link worker admitted it) active and
/// says whether the run is fresh ([`Start::Fresh`]); a transfer paused or
/// cancelled since it was admitted is not started
/// ([`RunError::Stopped`]).
async fn begin(inner: &Inner, t: &Transfer) -> Result<bool, RunError> {
    inner.holds.hold(t.id, HoldPoint::Begin).await;
    let started_before = t.started_at.is_some();
    // Only asked when it can make a difference.
    let published_before =
        !started_before && inner.catalog.published_before(&t.source_path, t.id).await?;
    // `active` and the last note cleared in one write.
    let took_active = inner.catalog.set_transfer_active(t.id).await?;
    match start_of(started_before, published_before, took_active) {
        Start::Stopped => {
            debug!(transfer = %t.id, "paused or cancelled before its run started");
            Err(RunError::Stopped)
        }
        start => Ok(start == Start::Fresh),
    }
}

/// Registers the live progress of a run of transfer `t` (the catalog row
/// it started from: what earlier runs did) of `total` bytes on `c`.
fn track_run(inner: &Inner, c: &LinkConn, t: &Transfer, total: u64) -> Arc<LiveProgress> {
    let done = (t.bytes_done.max(0) as u64).min(total);
    let p = track_progress(inner, t.id, total, done, t.bytes_sent.max(0) as u64);
    p.confirms.store(
        c.version >= ferry_proto::wire::BATCH_SEQ_VERSION,
        Ordering::Relaxed,
    );
    p
}

/// Registers the live progress of transfer `id` of `total` bytes, of
/// which `done_before` were at the sink and `sent_before` sent before.
fn track_progress(
    inner: &Inner,
    id: TransferId,
    total: u64,
    done_before: u64,
    sent_before: u64,
) -> Arc<LiveProgress> {
    let progress = Arc::new(LiveProgress {
        total: AtomicU64::new(total),
        done_before,
        sent_before,
        ..LiveProgress::default()
    });
    {
        let mut m = crate::lock::lock(&inner.progress);
        m.insert(id, progress.clone());
    }
    progress
}

/// Whether a striped transfer's open on `c` sets
/// [`Open::parts_first`]: the sink speaks
/// [`ferry_proto::wire::PARTS_FIRST_VERSION`] (and so takes the open's
/// origin, which the flag follows on the wire).
fn opens_parts_first(c: &LinkConn) -> bool {
    c.version >= ferry_proto::wire::PARTS_FIRST_VERSION
}

/// Sends the open of `t` with the file table `files` and returns the
/// transfer's inbox of control messages and the chunk keys the sink
/// already has (none, without waiting, for a `fresh` transfer). A
/// striped transfer's open sets [`Open::parts_first`] (`parts_first`)
/// and, from an agent that is not its coordinator, [`Open::joins`]
/// (`joins`), each where the sink speaks its version.
#[allow(clippy::too_many_arguments)]
async fn open_on_sink(
    inner: &Inner,
    c: &LinkConn,
    t: &Transfer,
    fresh: bool,
    files: Vec<FileInfo>,
    parts_first: bool,
    joins: bool,
) -> Result<(mpsc::UnboundedReceiver<Control>, HashSet<u64>), RunError> {
    let id = t.id;
    let (tx, mut rx) = mpsc::unbounded_channel();
    {
        let mut m = crate::lock::lock(&c.inbox);
        m.insert(id, tx);
    }
    *crate::lock::lock(&c.unanswered).entry(id).or_insert(0) += 1;
    let origin = (c.version >= ORIGIN_VERSION).then(|| inner.catalog.id().to_string());
    c.ctl
        .send(&Control::Open(Open {
            key: TransferKey {
                id,
                job: t.job.clone(),
                source_path: t.source_path.clone(),
                rel: t.rel.clone(),
                // Sent whole: to a sink older than weights-first, or a
                // checkpoint whose format does not split its weights out.
                profile: match t.profile {
                    Profile::WeightsFirst if !streaming::opens_weights_first(c, t) => Profile::Full,
                    p => p,
                },
                origin,
            },
            chunk_size: inner.cfg.chunk_size,
            bytes_total: files.iter().map(|f| f.size).sum(),
            files,
            parts_first: parts_first && opens_parts_first(c),
            joins: joins && c.version >= ferry_proto::wire::JOIN_VERSION,
        }))
        .await?;
    let have = if fresh {
        HashSet::new()
    } else {
        match recv(inner, c, &mut rx).await? {
            Control::Have { chunks, .. } => chunks.into_iter().collect(),
            Control::Refuse { reason, .. } => {
                return Err(RunError::Fatal(format!("sink refused: {reason}")))
            }
            m => return Err(RunError::Retry(format!("expected have, got {}", m.name()))),
        }
    };
    Ok((rx, have))
}

async fn run_transfer(inner: &Arc<Inner>, c: &LinkConn, t: Transfer) -> Result<(), RunError> {
    let id = t.id;
    let t_start = std::time::Instant::now();
    let fresh = begin(inner, &t).await?;
    // A striped transfer continues from its plan (this agent took it over).
    if inner.cfg.pool.is_some() && t.profile == Profile::Full {
        if let Some(plan) = inner.catalog.transfer_plan(id).await? {
            return parts::run_coordinated(inner, c, &t, Some(plan), None).await;
        }
    }
    let t_begun = t_start.elapsed();
    let dir = PathBuf::from(&t.source_path);
    let (d2, store, markers) = (dir.clone(), inner.store.clone(), inner.cfg.markers.clone());
    let listing = tokio::task::spawn_blocking(move || store.list(&d2, &markers))
        .await
        .map_err(|e| RunError::Fatal(e.to_string()))?
        .map_err(|e| RunError::Fatal(format!("listing the checkpoint: {e}")))?;
    let mut scan = listing.into_infos();
    // Metadata first (the markers stay last, where their indices say).
    let plain = scan.files.len() - scan.markers.len().min(scan.files.len());
    scan.files[..plain].sort_by_key(|f| crate::formats::send_class(None, &f.path));
    let t_scanned = t_start.elapsed();
    let bytes_total: u64 = scan.files.iter().map(|f| f.size).sum();
    if parts::striped(inner, &t, bytes_total) {
        return parts::run_coordinated(inner, c, &t, None, Some((scan.files, scan.markers))).await;
    }
    // A small transfer's size was recorded at submit: not written again
    // unless the listing differs.
    if (t.bytes_total, t.shards) != (bytes_total as i64, scan.files.len() as i64) {
        inner
            .catalog
            .set_transfer_size(t.id, bytes_total, scan.files.len() as u64)
            .await?;
    }
    let progress = track_run(inner, c, &t, bytes_total);

    let chunk_size = inner.cfg.chunk_size;
    let t_recorded = t_start.elapsed();
    let (mut rx, have) =
        open_on_sink(inner, c, &t, fresh, scan.files.clone(), false, false).await?;
    debug!(
        transfer = %id,
        begin_ms = t_begun.as_millis() as u64,
        scan_ms = (t_scanned - t_begun).as_millis() as u64,
        record_ms = (t_recorded - t_scanned).as_millis() as u64,
        open_ms = (t_start.elapsed() - t_recorded).as_millis() as u64,
        "transfer start"
    );
    let map = Arc::new(ChunkMap::new(&scan.files, chunk_size));
    let skipped = map.bytes_of(have.iter().copied());
    progress.skipped.store(skipped, Ordering::Relaxed);
    info!(
        transfer = %id,
        files = scan.files.len(),
        bytes_total,
        already_at_sink = skipped,
        "sending"
    );

    // First pass: read every file once, hash every chunk, send the ones
    // the sink lacks.
    let files = Arc::new(scan.files);
    let mut need: Vec<u64> = Vec::new();
    let (entries, versions) = {
        let (files, map, dir, inner2) = (files.clone(), map.clone(), dir.clone(), inner.clone());
        send_round(
            inner,
            c,
            id,
            &progress,
            &mut rx,
            &mut need,
            None,
            move |out| read_all(&inner2, &dir, &files, chunk_size, &map, &have, out),
        )
        .await?
    };
    let manifest = Manifest {
        chunk_size,
        files: entries,
        markers: scan.markers,
    };
    inner
        .catalog
        .note_transfer_progress(t.id, progress.note())
        .await?;

    let slots: Vec<Option<usize>> = (0..files.len()).map(Some).collect();
    let sealed = Sealed {
        manifest: Arc::new(manifest),
        map,
        slots: Arc::new(slots),
        // A pushed directory is committed when it is pushed.
        times: SourceTimes {
            committed_ms: t.created_at,
            opened_ms: 0,
        },
        siblings: Vec::new(),
        recheck: Some(versions),
    };
    commit_loop(inner, c, &t, &dir, &progress, &mut rx, need, sealed).await
}

/// A sealed manifest and how chunk keys of the transfer's file table map
/// onto it.
struct Sealed {
    manifest: Arc<Manifest>,
    /// The file table with final sizes.
    map: Arc<ChunkMap>,
    /// For each file-table position, the index of that file in the
    /// manifest (`None`: not part of the replica).
    slots: Arc<Vec<Option<usize>>>,
    /// Open and commit times sent with the commit.
    times: SourceTimes,
    /// Markers beside the checkpoint directory, sent with the commit.
    siblings: Vec<(String, Vec<u8>)>,
    /// A pushed checkpoint (read once, not watched): each manifest file's
    /// version as it was read. Before each commit every file's size, mtime
    /// and version are compared with them, and a file rewritten after its
    /// chunks were sent is read again ([`reread_changed`]).
    recheck: Option<Vec<FileVersion>>,
}

/// Resends whatever the sink asks for, then commits; repeats until the
/// sink publishes. The commit names the batches opened in this run and
/// those given up with a lost connection ([`LinkSched::commit_point`]),
/// and goes once the transfer's queue is drained. A connection lost after
/// the commit, with batches of this transfer the sink had not confirmed,
/// makes it commit again once their chunks are sent on the other
/// connections (the sink replaces the commit it was waiting on with the
/// new one).
#[allow(clippy::too_many_arguments)]
async fn commit_loop(
    inner: &Arc<Inner>,
    c: &LinkConn,
    t: &Transfer,
    dir: &Path,
    progress: &Arc<LiveProgress>,
    rx: &mut mpsc::UnboundedReceiver<Control>,
    mut need: Vec<u64>,
    mut sealed: Sealed,
) -> Result<(), RunError> {
    let id = t.id;
    let mut root = sealed.manifest.root();
    loop {
        while let Ok(m) = rx.try_recv() {
            match m {
                Control::Need { chunks, .. } => need.extend(chunks),
                Control::Have { .. } => {}
                m if weights_answer(inner, t.id, &m) => {}
                other => return handle_end(inner, t, other, &root).await,
            }
        }
        if !need.is_empty() {
            inner.phase_clocks.note(id, phases::Event::Need);
            let mut list = std::mem::take(&mut need);
            list.sort_unstable();
            list.dedup();
            c.sched.counters.retries.inc_by(list.len() as u64);
            info!(
                transfer = %id,
                chunks = list.len(),
                "re-sending chunks the sink asked for"
            );
            let (m2, dir, inner2) = (sealed.manifest.clone(), dir.to_path_buf(), inner.clone());
            let (map2, slots) = (sealed.map.clone(), sealed.slots.clone());
            send_round(inner, c, id, progress, rx, &mut need, None, move |out| {
                read_some(&inner2, &dir, &m2, &map2, &slots, &list, out)
            })
            .await?;
            continue;
        }
        inner.holds.hold(id, HoldPoint::Commit).await;
        if let Some(versions) = sealed.recheck.clone() {
            let (m, dir2, inner2) = (sealed.manifest.clone(), dir.to_path_buf(), inner.clone());
            let changed = tokio::task::spawn_blocking(move || {
                changed_files(&*inner2.store, &dir2, &m, &versions)
            })
            .await
            .map_err(|e| RunError::Fatal(e.to_string()))??;
            if !changed.is_empty() {
                warn!(
                    transfer = %id,
                    files = changed.len(),
                    first = %sealed.manifest.files[changed[0].0].path,
                    "files changed after their chunks were sent; reading them again"
                );
                let (m, dir2, inner2) = (sealed.manifest.clone(), dir.to_path_buf(), inner.clone());
                let map2 = sealed.map.clone();
                let entries = send_round(inner, c, id, progress, rx, &mut need, None, move |out| {
                    reread_changed(&inner2, &dir2, &m, &map2, &changed, out)
                })
                .await?;
                let mut m = (*sealed.manifest).clone();
                for (fi, e, v) in entries {
                    m.files[fi] = e;
                    if let Some(vs) = sealed.recheck.as_mut() {
                        vs[fi] = v;
                    }
                }
                root = m.root();
                sealed.manifest = Arc::new(m);
                continue;
            }
        }
        inner
            .catalog
            .set_transfer_state(t.id, TransferState::Verifying, None)
            .await?;
        // The readers its replica expects, as said until now (an API
        // request may set them after the run began).
        let readers = match inner.catalog.transfer(t.id).await {
            Ok(Some(now)) => now.readers,
            Ok(None) => None,
            Err(e) => {
                warn!(transfer = %id, error = %e, "catalog: reading the expected readers");
                t.readers
            }
        };
        let checkpoint = checkpoint_info(c, t, &sealed.manifest, readers);
        let commit = |(batches, lost): (u64, Vec<u64>)| {
            // Where the time went so far, for a sink that takes it.
            inner.phase_clocks.note(id, phases::Event::CommitSent);
            let phases = if c.version >= ferry_proto::wire::PHASES_VERSION {
                inner.phase_clocks.phases(id).unwrap_or_default()
            } else {
                Default::default()
            };
            Control::Commit(Commit {
                id,
                committed_ms: sealed.times.committed_ms,
                opened_ms: sealed.times.opened_ms,
                batches,
                manifest: (*sealed.manifest).clone(),
                siblings: sealed.siblings.clone(),
                checkpoint: Some(checkpoint.clone()),
                lost,
                phases,
                weights_only: false,
            })
        };
        // The commit goes once every chunk queued is written (chunks moved
        // off a lost connection after the round included); batches given
        // up after it make it go again once their chunks are sent.
        let mut given_up = 0;
        let mut unsent = true;
        loop {
            let losses = c.sched.losses();
            tokio::pin!(losses);
            losses.as_mut().enable();
            let changes = c.sched.changes();
            tokio::pin!(changes);
            changes.as_mut().enable();
            if c.sched.lost_batches(id) > given_up {
                unsent = true;
            }
            if unsent && c.sched.drained(id) {
                let point = c.sched.commit_point(id);
                if given_up > 0 || !point.1.is_empty() {
                    info!(
                        transfer = %id,
                        batches = point.0,
                        lost = point.1.len(),
                        "committing with batches given up with a lost connection"
                    );
                }
                given_up = point.1.len();
                c.ctl.send(&commit(point)).await?;
                unsent = false;
                continue;
            }
            tokio::select! {
                m = recv(inner, c, rx) => match m? {
                    Control::Have { .. } => continue,
                    m if weights_answer(inner, t.id, &m) => continue,
                    Control::Need { chunks, .. } => {
                        need.extend(chunks);
                        inner
                            .catalog
                            .set_transfer_state(t.id, TransferState::Active, None)
                            .await?;
                        break;
                    }
                    other => return handle_end(inner, t, other, &root).await,
                },
                _ = &mut losses => {}
                _ = &mut changes, if unsent => {}
            }
        }
    }
}

/// What the commit tells the sink of the checkpoint (protocol version 3):
/// its step ([`step_at_commit`]) and the class the link's scheduler
/// serves the transfer in now (`urgent` while a signal promotes it; the
/// run's class if the scheduler no longer holds it), and from version 7
/// the `readers` its replica expects.
fn checkpoint_info(
    c: &LinkConn,
    t: &Transfer,
    m: &Manifest,
    readers: Option<i64>,
) -> CheckpointInfo {
    let class = c.sched.lock().ls.class_of(t.id).unwrap_or_else(|| {
        scheduler::effective_class(t.class, t.urgent_until, ferry_catalog::now_ms())
    });
    CheckpointInfo {
        step: step_at_commit(t.format.is_some(), &t.rel, m),
        class: class.as_str().to_string(),
        // Flag bit 3: only a version 7 sink reads it.
        readers: readers
            .filter(|_| c.version >= ferry_proto::wire::PHASES_VERSION)
            .and_then(|n| u64::try_from(n).ok())
            .filter(|n| *n > 0),
    }
}

/// The step of checkpoint `rel` (its directory name, `formats::step_of`)
/// when its format names steps: the watcher recognised it
/// (`watched_format`), or `formats::recognise` does from the sealed
/// manifest's files (a push). `None` for a directory of no known format
/// (`dataset-2024` is not step 2024).
fn step_at_commit(watched_format: bool, rel: &str, m: &Manifest) -> Option<u64> {
    use crate::formats;
    let recognised = watched_format || {
        let files: Vec<formats::FileState> = m
            .files
            .iter()
            .map(|f| formats::FileState {
                path: f.path.clone(),
                size: f.size,
                mtime_ns: f.mtime_ns,
                complete: true,
                content: None,
            })
            .collect();
        formats::recognise(&formats::Snapshot {
            dir: rel,
            files: &files,
            siblings: &[],
            sibling_dirs: &[],
        })
        .is_some()
    };
    recognised.then(|| formats::step_of(rel)).flatten()
}

/// Whether `m` is the sink's answer to transfer `id`'s weights-only
/// commit (its root is the one in [`Inner::weights_roots`]): logged, and
/// not the transfer's end.
fn weights_answer(inner: &Inner, id: TransferId, m: &Control) -> bool {
    match m {
        Control::Published {
            root, local_path, ..
        } if crate::lock::lock(&inner.weights_roots).get(&id) == Some(root) => {
            info!(
                transfer = %id,
                local_path,
                root = %hex(root),
                "weights-only version published at the sink; the optimizer state follows"
            );
            true
        }
        _ => false,
    }
}

async fn handle_end(
    inner: &Inner,
    t: &Transfer,
    msg: Control,
    root: &Hash,
) -> Result<(), RunError> {
    match msg {
        Control::Published {
            local_path,
            root: their_root,
            phases: at_sink,
            ..
        } => {
            if &their_root != root {
                return Err(RunError::Fatal(format!(
                    "sink published manifest root {} but ours is {}",
                    hex(&their_root),
                    hex(root)
                )));
            }
            // The run's counters first: a reader that sees the row
            // published reads its final bytes (a chunk sent again at the
            // commit included), not the last periodic note.
            save_progress(inner, t.id, false).await;
            inner
                .catalog
                .set_transfer_published(t.id, &hex(root), &local_path)
                .await?;
            crate::lock::lock(&inner.weights_roots).remove(&t.id);
            // Ours until the commit went (the time since is the sink's),
            // then the sink's after it arrived.
            if !at_sink.is_empty() {
                if let Some(link) = inner.links.get(&t.link) {
                    link.note_finish(finish_ms(&at_sink));
                }
            }
            if let Some(mut p) = inner.phase_clocks.finish(t.id) {
                p.merge(&at_sink);
                if let Err(e) = inner.catalog.set_transfer_phases(t.id, &p).await {
                    warn!(transfer = %t.id, error = %e, "catalog: recording the phases");
                }
            }
            info!(transfer = %t.id, local_path, root = %hex(root), "replica published at the sink");
            settle_deadline(inner, t.id).await;
            Ok(())
        }
        Control::Cancel { reason, .. } => Err(RunError::Fatal(format!("sink cancelled: {reason}"))),
        Control::Refuse { reason, .. } => Err(RunError::Fatal(format!("sink refused: {reason}"))),
        m => Err(RunError::Retry(format!(
            "unexpected {} from sink",
            m.name()
        ))),
    }
}

/// The next control message for this transfer; a lost connection or the
/// agent stopping end the wait.
async fn recv(
    inner: &Inner,
    c: &LinkConn,
    rx: &mut mpsc::UnboundedReceiver<Control>,
) -> Result<Control, RunError> {
    tokio::select! {
        m = rx.recv() => m.ok_or_else(|| RunError::Retry("connection to the sink lost".into())),
        e = c.conn.closed() => Err(RunError::Retry(format!("connection to the sink lost: {e}"))),
        _ = inner.shutdown.cancelled() => Err(RunError::Shutdown),
    }
}

/// Runs `produce` on a blocking thread; the records it makes go to the
/// link's dispatcher (which interleaves them with other transfers' in the
/// scheduler's order). Returns what `produce` returned. Control messages arriving
/// meanwhile are handled: `need` collects chunks to send again, a refusal
/// or cancel ends the round.
#[allow(clippy::too_many_arguments)]
async fn send_round<T: Send + 'static>(
    inner: &Arc<Inner>,
    c: &LinkConn,
    id: TransferId,
    progress: &Arc<LiveProgress>,
    rx_ctl: &mut mpsc::UnboundedReceiver<Control>,
    need: &mut Vec<u64>,
    answers: Option<mpsc::UnboundedSender<Control>>,
    produce: impl FnOnce(&mpsc::Sender<Record>) -> Result<T, String> + Send + 'static,
) -> Result<T, RunError> {
    let tid = id;
    let sched = c.sched.clone();
    sched.set_progress(tid, progress.clone());
    let (tx, mut rx) = mpsc::channel::<Record>(2);
    // If this round ends early (connection lost, refusal), dropping `rx`
    // makes the producer's next send fail and it stops too.
    let producer = tokio::task::spawn_blocking(move || produce(&tx));
    let mut result: Result<(), RunError> = Ok(());
    let mut ctl_open = true;
    // A control message while sending: true if the round must end.
    let mut on_ctl = |m: Option<Control>,
                      result: &mut Result<(), RunError>,
                      ctl_open: &mut bool| {
        let err = match m {
            Some(Control::Need { chunks, .. }) => {
                need.extend(chunks);
                return false;
            }
            Some(m @ (Control::Have { .. } | Control::PartEpoch { .. })) if answers.is_some() => {
                if let Some(a) = &answers {
                    let _ = a.send(m);
                }
                return false;
            }
            Some(Control::Have { .. }) => return false,
            Some(m) if weights_answer(inner, tid, &m) => return false,
            Some(Control::Refuse { reason, .. }) => {
                RunError::Fatal(format!("sink refused: {reason}"))
            }
            Some(Control::Cancel { reason, .. }) => {
                RunError::Fatal(format!("sink cancelled: {reason}"))
            }
            Some(other) => RunError::Retry(format!(
                "unexpected {} from sink while sending",
                other.name()
            )),
            None => {
                *ctl_open = false;
                RunError::Retry("connection to the sink lost".into())
            }
        };
        *result = Err(err);
        true
    };
    let lost = |e: Lost| RunError::Retry(e.0);
    'produce: loop {
        tokio::select! {
            r = rx.recv() => {
                let Some(rec) = r else { break };
                let push = sched.push(&c.conn, tid, rec);
                tokio::pin!(push);
                loop {
                    tokio::select! {
                        r = &mut push => {
                            if let Err(e) = r {
                                result = Err(lost(e));
                                break 'produce;
                            }
                            break;
                        }
                        m = rx_ctl.recv(), if ctl_open => {
                            if on_ctl(m, &mut result, &mut ctl_open) {
                                break 'produce;
                            }
                        }
                        _ = inner.shutdown.cancelled() => {
                            result = Err(RunError::Shutdown);
                            break 'produce;
                        }
                    }
                }
            }
            m = rx_ctl.recv(), if ctl_open => {
                if on_ctl(m, &mut result, &mut ctl_open) {
                    break;
                }
            }
            _ = inner.shutdown.cancelled() => {
                result = Err(RunError::Shutdown);
                break;
            }
        }
    }
    drop(rx);
    if result.is_ok() {
        let flush = sched.flush(&c.conn, tid);
        tokio::pin!(flush);
        loop {
            tokio::select! {
                r = &mut flush => {
                    if let Err(e) = r {
                        result = Err(lost(e));
                    }
                    break;
                }
                m = rx_ctl.recv(), if ctl_open => {
                    if on_ctl(m, &mut result, &mut ctl_open) {
                        break;
                    }
                }
                _ = inner.shutdown.cancelled() => {
                    result = Err(RunError::Shutdown);
                    break;
                }
            }
        }
    }
    // A sink that refuses or cancels a transfer stops its data streams and
    // says why on the control stream; the connection may look lost first.
    // While it lives, give the reason a moment to arrive.
    if matches!(result, Err(RunError::Retry(_))) && ctl_open && c.conn.close_reason().is_none() {
        let until = tokio::time::Instant::now() + Duration::from_secs(2);
        while let Ok(Some(m)) = tokio::time::timeout_at(until, rx_ctl.recv()).await {
            match m {
                Control::Refuse { reason, .. } => {
                    result = Err(RunError::Fatal(format!("sink refused: {reason}")));
                    break;
                }
                Control::Cancel { reason, .. } => {
                    result = Err(RunError::Fatal(format!("sink cancelled: {reason}")));
                    break;
                }
                Control::Need { chunks, .. } => need.extend(chunks),
                _ => {}
            }
        }
    }
    let produced = producer.await.map_err(|e| RunError::Fatal(e.to_string()))?;
    if inner.shutdown.is_cancelled() {
        return Err(RunError::Shutdown);
    }
    result?;
    produced.map_err(RunError::Fatal)
}

/// Flips the first byte of `data` while [`Inner::corrupt`] counts chunks
/// left to corrupt.
#[cfg(feature = "fault-injection")]
fn maybe_corrupt(inner: &Inner, data: &mut [u8]) {
    if data.is_empty() {
        return;
    }
    let left = inner.corrupt.load(Ordering::Relaxed);
    if left > 0
        && inner
            .corrupt
            .compare_exchange(left, left - 1, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        warn!("fault injection: corrupting one chunk after hashing (FERRY_FAULT_CORRUPT_CHUNKS)");
        data[0] ^= 0xff;
    }
}

/// Without the `fault-injection` feature there is no hook: this build
/// never reads `FERRY_FAULT_CORRUPT_CHUNKS`.
#[cfg(not(feature = "fault-injection"))]
fn maybe_corrupt(_inner: &Inner, _data: &mut [u8]) {}

/// Queues chunk `ci` of file-table position `fi`, just read from `path`
/// into `buf` with BLAKE3 `hash`: the record takes the buffer (no copy;
/// it goes back to the pool once quinn is done with it).
///
/// # Errors
/// [`ScanError::Unsupported`] when the send round has stopped.
fn send_read_chunk(
    inner: &Inner,
    out: &mpsc::Sender<Record>,
    path: &Path,
    fi: u32,
    ci: u32,
    buf: &mut Vec<u8>,
    hash: &Hash,
) -> Result<(), ScanError> {
    let mut data = std::mem::take(buf);
    maybe_corrupt(inner, &mut data);
    let rec = Record {
        header: RecordHeader {
            file: fi,
            chunk: ci,
            len: data.len() as u32,
            hash: *hash,
        },
        data: inner.bufs.bytes(data),
    };
    out.blocking_send(rec).map_err(|_| ScanError::Unsupported {
        path: path.to_path_buf(),
        why: "sending stopped".into(),
    })
}

/// First pass over a checkpoint: each file read once, sequentially, one
/// chunk per read; chunks the sink lacks are queued for sending.
fn read_all(
    inner: &Inner,
    dir: &Path,
    files: &[FileInfo],
    chunk_size: u32,
    map: &ChunkMap,
    have: &HashSet<u64>,
    out: &mpsc::Sender<Record>,
) -> Result<(Vec<FileEntry>, Vec<FileVersion>), String> {
    let mut entries = Vec::with_capacity(files.len());
    let mut versions = Vec::with_capacity(files.len());
    for (fi, info) in files.iter().enumerate() {
        let path = dir.join(&info.path);
        let pool = Some(&*inner.bufs);
        let (chunks, version) = read_chunks_versioned(
            &*inner.store,
            &path,
            info,
            chunk_size,
            pool,
            |ci, buf, hash| {
                let g = map.index(fi as u32, ci).unwrap_or(u64::MAX);
                if have.contains(&g) {
                    return Ok(());
                }
                send_read_chunk(inner, out, &path, fi as u32, ci, buf, hash)
            },
        )
        .map_err(|e| e.to_string())?;
        entries.push(FileEntry {
            path: info.path.clone(),
            size: info.size,
            mode: info.mode,
            mtime_ns: info.mtime_ns,
            chunks,
        });
        versions.push(version);
    }
    Ok((entries, versions))
}

/// The files of pushed manifest `m` under `dir` whose mtime or version
/// differ now from the manifest's and `versions` (as read before), by
/// manifest position, with their mtime now (ns).
///
/// # Errors
/// [`RunError::Retry`] when a file's size changed (the sink's file table
/// holds the old size: the run starts over with a new open), or a file
/// cannot be looked at.
fn changed_files(
    store: &dyn SourceStore,
    dir: &Path,
    m: &Manifest,
    versions: &[FileVersion],
) -> Result<Vec<(usize, i64)>, RunError> {
    let mut changed = Vec::new();
    for (fi, f) in m.files.iter().enumerate() {
        let p = dir.join(&f.path);
        let (size, mtime_ns, version) = store
            .stat(&p)
            .map_err(|e| RunError::Retry(format!("{} after it was sent: {e}", p.display())))?;
        if size != f.size {
            return Err(RunError::Retry(format!(
                "{} changed size after it was sent ({} to {size} bytes); starting over",
                p.display(),
                f.size
            )));
        }
        // The version catches a rewrite that restored the mtime (`cp -p`,
        // `rsync -a`, `touch -r`): on POSIX it covers the ctime.
        if mtime_ns != f.mtime_ns || versions.get(fi) != Some(&version) {
            changed.push((fi, mtime_ns));
        }
    }
    Ok(changed)
}

/// Reads the files `changed` of `m` (manifest positions with their new
/// mtime) again, sends each chunk whose hash differs from the manifest's,
/// and returns their new manifest entries.
fn reread_changed(
    inner: &Inner,
    dir: &Path,
    m: &Manifest,
    map: &ChunkMap,
    changed: &[(usize, i64)],
    out: &mpsc::Sender<Record>,
) -> Result<Vec<(usize, FileEntry, FileVersion)>, String> {
    let mut entries = Vec::with_capacity(changed.len());
    for &(fi, mtime_ns) in changed {
        let old = &m.files[fi];
        let info = FileInfo {
            path: old.path.clone(),
            size: old.size,
            mode: old.mode,
            mtime_ns,
        };
        let path = dir.join(&old.path);
        let pool = Some(&*inner.bufs);
        let (chunks, version) = read_chunks_versioned(
            &*inner.store,
            &path,
            &info,
            m.chunk_size,
            pool,
            |ci, buf, hash| {
                if old.chunks.get(ci as usize) == Some(hash) || map.index(fi as u32, ci).is_none() {
                    return Ok(());
                }
                send_read_chunk(inner, out, &path, fi as u32, ci, buf, hash)
            },
        )
        .map_err(|e| e.to_string())?;
        entries.push((
            fi,
            FileEntry {
                path: old.path.clone(),
                size: old.size,
                mode: old.mode,
                mtime_ns,
                chunks,
            },
            version,
        ));
    }
    Ok(entries)
}

/// Re-reads the chunks `list` (keys of the file table `map`, whose
/// positions `slots` maps to manifest entries) and queues them; a chunk
/// whose bytes no longer match the sealed manifest means the source file
/// changed after it was read.
fn read_some(
    inner: &Inner,
    dir: &Path,
    m: &Manifest,
    map: &ChunkMap,
    slots: &[Option<usize>],
    list: &[u64],
    out: &mpsc::Sender<Record>,
) -> Result<(), String> {
    let mut open: Option<(u32, Box<dyn RangeRead>)> = None;
    for g in list {
        let Some((fi, ci, entry)) = map.locate(*g).and_then(|(fi, ci)| {
            let e = m.files.get((*slots.get(fi as usize)?)?)?;
            Some((fi, ci, e))
        }) else {
            return Err(format!("sink asked for chunk {g}, which does not exist"));
        };
        if open.as_ref().map(|o| o.0) != Some(fi) {
            let p = dir.join(&entry.path);
            open = Some((
                fi,
                inner
                    .store
                    .open(&p)
                    .map_err(|e| format!("{}: {e}", p.display()))?,
            ));
        }
        let (off, len) = map.span(fi, ci);
        let mut data = inner.bufs.take(len as usize);
        match &open {
            Some((_, f)) => f.read_range_into(off, len, &mut data).map_err(|e| {
                if e.kind() == std::io::ErrorKind::UnexpectedEof {
                    format!(
                        "{} changed while it was being copied (shorter than its manifest)",
                        dir.join(&entry.path).display()
                    )
                } else {
                    format!("{}: {e}", dir.join(&entry.path).display())
                }
            })?,
            None => data.clear(),
        }
        let hash = *blake3::hash(&data).as_bytes();
        if hash != entry.chunks[ci as usize] {
            return Err(format!(
                "{} changed while it was being copied",
                dir.join(&entry.path).display()
            ));
        }
        maybe_corrupt(inner, &mut data);
        out.blocking_send(Record {
            header: RecordHeader {
                file: fi,
                chunk: ci,
                len: len as u32,
                hash,
            },
            data: inner.bufs.bytes(data),
        })
        .map_err(|_| "sending stopped".to_string())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn the_finish_time_is_verifying_plus_publishing_and_its_median_resists_outliers() {
        use ferry_proto::phases::{Phase, Phases};
        let mut p = Phases::default();
        p.add(true, Phase::Sending, Duration::from_secs(9));
        p.add(true, Phase::Verifying, Duration::from_millis(300));
        p.add(true, Phase::Publishing, Duration::from_millis(45));
        p.add(false, Phase::Streaming, Duration::from_secs(60));
        assert_eq!(finish_ms(&p), 345);
        assert_eq!(finish_ms(&Phases::default()), 0);
        assert_eq!(median(&VecDeque::new()), 0);
        assert_eq!(median(&VecDeque::from([300, 90_000, 280, 310])), 310);
        assert_eq!(median(&VecDeque::from([300, 90_000, 280])), 300);
    }

    #[test]
    fn default_connections_follow_the_rate_up_to_the_cores() {
        assert_eq!(default_connections(1_000_000_000, 8), 1);
        assert_eq!(default_connections(2_000_000_000, 8), 1);
        assert_eq!(default_connections(2_000_000_001, 8), 2);
        assert_eq!(default_connections(10_000_000_000, 8), 5);
        assert_eq!(default_connections(10_000_000_000, 2), 2);
        assert_eq!(
            default_connections(60_000_000_000, 64),
            MAX_DEFAULT_CONNECTIONS
        );
        assert_eq!(default_connections(0, 0), 1);
        assert_eq!(default_connections(u64::MAX, 4), 4);
    }

    #[test]
    fn a_commit_names_the_step_only_of_a_checkpoint_format() {
        use ferry_proto::manifest::FileEntry;
        let m = |paths: &[&str]| Manifest {
            chunk_size: 1 << 20,
            files: paths
                .iter()
                .map(|p| FileEntry {
                    path: (*p).into(),
                    size: 1,
                    mode: 0o644,
                    mtime_ns: 0,
                    chunks: vec![[0; 32]],
                })
                .collect(),
            markers: vec![],
        };
        // A pushed DeepSpeed save: recognised from its files.
        let ds = m(&[
            "mp_rank_00_model_states.pt",
            "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        ]);
        assert_eq!(step_at_commit(false, "global_step1200", &ds), Some(1200));
        // A pushed directory of no known format has no step, digits or not.
        let data = m(&["shard-0.bin", "COMMITTED"]);
        assert_eq!(step_at_commit(false, "dataset-2024", &data), None);
        // The watcher's format counts (its files were checked then).
        assert_eq!(step_at_commit(true, "step_00000300", &data), Some(300));
        assert_eq!(step_at_commit(true, "release", &data), None);
    }

    #[test]
    fn only_the_answer_to_the_latest_open_reaches_the_run() {
        let mut un = HashMap::new();
        let (a, b) = (TransferId(1), TransferId(2));
        // Run 1 of `a` opens, is paused before its answer; run 2 opens.
        un.insert(a, 2);
        un.insert(b, 1);
        assert!(!answers_latest_open(&mut un, a), "run 1's answer");
        assert!(answers_latest_open(&mut un, b));
        assert!(answers_latest_open(&mut un, a), "run 2's answer");
        assert!(un.is_empty());
        // An answer with no open out (a fresh run does not wait) passes.
        assert!(answers_latest_open(&mut un, a));
    }
    use crate::metrics::{class_index, HistoryPoint};
    use crate::transport::{endpoint, SocketKind};

    const MB: u64 = 1_000_000;

    #[test]
    fn a_run_is_fresh_only_if_no_run_ever_started_and_stops_if_not_started() {
        // The first run of a never-published checkpoint.
        assert_eq!(start_of(false, false, true), Start::Fresh);
        // An earlier run was started (it may have opened the transfer at
        // the sink), or the checkpoint was published before.
        assert_eq!(start_of(true, false, true), Start::Resume);
        assert_eq!(start_of(false, true, true), Start::Resume);
        assert_eq!(start_of(true, true, true), Start::Resume);
        // Paused or cancelled after admission: whatever else holds, the
        // run never reaches the sink. Regression: such a run went on, so
        // a transfer opened at the sink still had no `started_at`, and
        // its resumed run counted as fresh.
        for started in [false, true] {
            for published in [false, true] {
                assert_eq!(start_of(started, published, false), Start::Stopped);
            }
        }
    }

    /// A source with job `job` (its root `ckpt/job` on link `l`) and links
    /// `l` (1 Gbit/s) and `m` (10 Gbit/s) whose peer is a UDP socket
    /// nothing reads: transfers stay queued.
    async fn quiet_source() -> (Source, PathBuf, std::net::UdpSocket, tempfile::TempDir) {
        let d = tempfile::tempdir().unwrap();
        let certs = d.path().join("certs");
        tls::init_dev_pki(&certs, &["src".into()], 2).unwrap();
        let identity = tls::AgentIdentity::load(
            &certs.join("ca.pem"),
            &certs.join("src.pem"),
            &certs.join("src.key"),
        )
        .unwrap();
        let root = d.path().join("ckpt").join("job");
        std::fs::create_dir_all(&root).unwrap();
        let root = std::fs::canonicalize(root).unwrap();
        let hole = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let link = |name: &str, rate_bps| LinkConfig {
            name: name.into(),
            peer: hole.local_addr().unwrap().to_string(),
            peer_name: "dst".into(),
            more_peers: Vec::new(),
            rate_bps,
            rtt: Duration::from_millis(10),
            connections: 1,
        };
        let cfg = SourceConfig {
            agent: "src".into(),
            site: "train-a".into(),
            chunk_size: ferry_proto::manifest::MIN_CHUNK_SIZE,
            markers: vec![],
            roots: vec![RootConfig {
                path: root.clone(),
                job: "job".into(),
                link: "l".into(),
                watch: Default::default(),
            }],
            remotes: Vec::new(),
            // Not in name order: link_stats sorts.
            links: vec![link("m", 10_000_000_000), link("l", 1_000_000_000)],
            streams: 1,
            batch_bytes: 256 << 10,
            scan_interval: None,
            quiet_period: Duration::from_millis(300),
            checkpoint_idle_timeout: Duration::from_secs(600),
            policy: scheduler::Policy::default(),
            pins: Default::default(),
            pool: None,
        };
        let ep = endpoint(SocketKind::Udp("127.0.0.1:0".parse().unwrap()), None).unwrap();
        let catalog = Catalog::open(&d.path().join("data")).await.unwrap();
        let source = Source::start(cfg, catalog, ep, &identity).unwrap();
        (source, root, hole, d)
    }

    /// The sampler's maths, driven with explicit timestamps once the
    /// source (and its own 1-second sampler) stopped: a transfer's rate,
    /// each link's class rates, utilisation and history, and the gauges
    /// rendered from them.
    #[tokio::test]
    async fn sampled_rates_feed_progress_link_stats_and_the_utilisation_gauge() {
        let (source, _root, _hole, _d) = quiet_source().await;
        source.shutdown(Duration::from_secs(5)).await;
        let inner = &source.inner;
        let progress = track_progress(inner, TransferId(7), 100 * MB, 0, 0);
        let l = inner.links["l"].sched.counters.clone();
        let (urgent, scheduled) = (
            class_index(scheduler::Class::Urgent),
            class_index(scheduler::Class::Scheduled),
        );
        let mut windows = HashMap::new();
        // Later than any sample the stopped sampler may have taken.
        let t0 = ferry_catalog::now_ms() + 60_000;
        take_sample(inner, t0, &mut windows);
        assert_eq!(source.progress(TransferId(7)).unwrap().rate_bps, 0.0);
        // 1 MB/s of the transfer (scheduled) for 7 s; urgent 2 MB/s from
        // the third second on.
        for k in 1..=7i64 {
            progress.sent.fetch_add(MB, Ordering::Relaxed);
            l.sent[scheduled].inc_by(MB);
            if k >= 3 {
                l.sent[urgent].inc_by(2 * MB);
            }
            take_sample(inner, t0 + k * 1000, &mut windows);
        }
        // Over the last 5 s.
        assert_eq!(source.progress(TransferId(7)).unwrap().rate_bps, 8e6);
        let stats = source.link_stats(true);
        let names: Vec<&str> = stats.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["l", "m"]);
        let s = &stats[0];
        assert_eq!(s.rate_bps, 1_000_000_000);
        assert_eq!(
            (
                s.class_bps.urgent,
                s.class_bps.scheduled,
                s.class_bps.background
            ),
            (16e6, 8e6, 0.0)
        );
        assert_eq!(s.goodput_bps, 24e6);
        assert_eq!(s.utilisation, 0.024);
        assert_eq!(s.history.len(), 7);
        assert_eq!(
            s.history[1],
            HistoryPoint {
                at_ms: t0 + 2000,
                urgent_bps: 0.0,
                scheduled_bps: 8e6,
                background_bps: 0.0,
            }
        );
        assert_eq!(s.history[6].urgent_bps, 16e6);
        assert!(source
            .link_stats(false)
            .iter()
            .all(|s| s.history.is_empty()));
        assert_eq!(stats[1].goodput_bps, 0.0);

        // A rate change shows in the cap and the utilisation at once.
        assert!(source.set_link_rate("l", 100_000_000).await.unwrap());
        assert!(!source.set_link_rate("nowhere", 100_000_000).await.unwrap());
        let text = source.render_metrics().await.unwrap();
        let gauge = |name: &str| {
            text.lines()
                .find_map(|line| line.strip_prefix(&format!("{name}{{link=\"l\"}} ")))
                .unwrap_or_else(|| panic!("no {name} for l in:\n{text}"))
                .parse::<f64>()
                .unwrap()
        };
        assert_eq!(gauge("ferry_link_capacity_bits_per_second"), 1e8);
        assert_eq!(gauge("ferry_link_utilisation_ratio"), 0.24);

        // Idle for 5 s: the transfer's rate and the link's drop to 0,
        // and a transfer that restarted gets a fresh window.
        for k in 8..=12i64 {
            take_sample(inner, t0 + k * 1000, &mut windows);
        }
        assert_eq!(source.progress(TransferId(7)).unwrap().rate_bps, 0.0);
        assert_eq!(source.link_stats(false)[0].goodput_bps, 0.0);
        let again = track_progress(inner, TransferId(7), 100 * MB, 0, 0);
        again.sent.store(MB, Ordering::Relaxed);
        take_sample(inner, t0 + 13_000, &mut windows);
        again.sent.store(2 * MB, Ordering::Relaxed);
        take_sample(inner, t0 + 14_000, &mut windows);
        assert_eq!(source.progress(TransferId(7)).unwrap().rate_bps, 8e6);
    }

    /// Queue depth counts unfinished transfers by link and effective
    /// class (a signal's promotion included), states by state.
    #[tokio::test]
    async fn queue_depth_and_states_come_from_the_catalog() {
        let (source, root, _hole, _d) = quiet_source().await;
        for name in ["a", "b", "c"] {
            std::fs::create_dir_all(root.join(name)).unwrap();
        }
        source.submit(&root.join("a"), None).await.unwrap();
        source
            .submit_as(&root.join("b"), None, scheduler::Class::Background)
            .await
            .unwrap();
        let c = source.submit(&root.join("c"), Some("m")).await.unwrap();
        // Promotes the newest unpublished, non-background transfer: c.
        let out = source
            .signal("job", "manual", 0.5, None, None)
            .await
            .unwrap();
        assert_eq!(out.promoted, Some(c.id));
        let text = source.render_metrics().await.unwrap();
        source.shutdown(Duration::from_secs(1)).await;
        let value = |series: &str| {
            text.lines()
                .find_map(|line| line.strip_prefix(&format!("{series} ")))
                .unwrap_or_else(|| panic!("no {series} in:\n{text}"))
                .parse::<f64>()
                .unwrap()
        };
        let depth = |l: &str, c: &str| {
            value(&format!(
                "ferry_queue_depth_transfers{{link=\"{l}\",class=\"{c}\"}}"
            ))
        };
        assert_eq!(depth("l", "scheduled"), 1.0);
        assert_eq!(depth("l", "background"), 1.0);
        assert_eq!(depth("l", "urgent"), 0.0);
        assert_eq!(depth("m", "urgent"), 1.0);
        assert_eq!(depth("m", "scheduled"), 0.0);
        // The link worker may have made a transfer active already; none
        // is final.
        let st = |s: &str| value(&format!("ferry_state_transfers{{state=\"{s}\"}}"));
        assert_eq!(st("queued") + st("active"), 3.0);
        assert_eq!(st("published") + st("failed") + st("cancelled"), 0.0);
        assert_eq!(
            value("ferry_sent_bytes_total{link=\"m\",class=\"urgent\"}"),
            0.0
        );
    }

    /// Regression: a signal with a negative step was stored, and a job
    /// could declare 1e308 parameters (a size term of 150).
    #[tokio::test]
    async fn negative_step_and_absurd_model_size_are_refused_naming_the_field() {
        let (source, _root, _hole, _d) = quiet_source().await;
        let e = source
            .signal("job", "loss_spike", 0.5, Some(-1), None)
            .await
            .unwrap_err();
        assert!(
            matches!(&e, OpsError::Invalid(m) if m.starts_with("step:")),
            "{e}"
        );
        assert!(source
            .catalog()
            .recent_signals(10)
            .await
            .unwrap()
            .is_empty());
        let s = source
            .signal("job", "loss_spike", 0.5, Some(0), None)
            .await
            .unwrap();
        assert_eq!(s.signal.step, Some(0));
        for p in [1e308, 2e15, f64::INFINITY] {
            let e = source.put_job("job", Some(Some(p)), 0.5).await.unwrap_err();
            assert!(
                matches!(&e, OpsError::Invalid(m) if m.contains("model_params") && m.contains("1e15")),
                "{p}: {e}"
            );
        }
        let j = source.put_job("job", Some(Some(7e10)), 0.5).await.unwrap();
        assert_eq!(j.model_params, Some(7e10));
        source.shutdown(Duration::from_secs(1)).await;
    }

    #[test]
    fn a_sink_naming_older_versions_is_spoken_to_in_the_newest_it_names() {
        let refusal = |hi: u16| {
            format!("incompatible protocol version: peer speaks 5, this sink speaks 2 to {hi}")
        };
        assert_eq!(older_version_to_speak(&refusal(4), 5), Some(4));
        // Never below what this source can speak, never up again.
        assert_eq!(older_version_to_speak(&refusal(3), 5), None);
        assert_eq!(older_version_to_speak(&refusal(5), 5), None);
        assert_eq!(older_version_to_speak(&refusal(6), 5), None);
        assert_eq!(older_version_to_speak("sink refused: full", 5), None);
        assert_eq!(older_version_to_speak("this sink speaks x to y", 5), None);
    }
}
