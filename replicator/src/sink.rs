//! The receiving side: accepts QUIC connections from sources, writes chunks
//! into a staging area inside the sink root, verifies each with BLAKE3,
//! records verified chunks in the catalog, asks again for anything that
//! fails, and publishes the replica atomically once the source has sealed
//! the manifest and every chunk matches it.
//!
//! Layout under the sink root: replicas published at
//! `<root>/<site>/<job>/<rel>`, a symbolic link to the current version's
//! directory `<root>/.ferry/versions/<row id>`; staging at
//! `<root>/.ferry/staging/<row id>` (same file system, so the move into
//! the version directory is one `rename`); versions being removed at
//! `<root>/.ferry/retired/<row id>` (see [`lifecycle`]).

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant, UNIX_EPOCH};

use ferry_catalog::{
    now_ms, Catalog, CatalogError, CheckpointMeta, NewReplica, PublishedReplica, SourceTimes,
    VerifiedChunk,
};
use ferry_proto::manifest::{hex, ChunkMap, FileInfo, Hash, Manifest};
use ferry_proto::paths::check_name;
use ferry_proto::phases::Phases;
use ferry_proto::state::{Profile, TransferId, TransferState};
use ferry_proto::wire::{
    BatchHeader, Commit, Control, Hello, Open, RecordHeader, MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION, RECORD_HEADER_LEN,
};
use quinn::{Connection, Endpoint, RecvStream, VarInt};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use crate::bufpool::BufPool;
use crate::conn::{code, read_frame, ConnError, ControlSender};
use crate::hold::{HoldPoint, Holds};
use crate::metrics::{MetricsError, SinkMetrics};
use crate::storage::hdfs::{Hdfs, HotFiles};
use crate::storage::posix::Posix;
use crate::storage::s3::{S3Config, S3};
use crate::storage::{PublishOutcome, SinkStore};
use crate::tls;
use decide::Table;

mod decide;
pub mod lifecycle;
pub mod pressure;
mod publish_lease;
pub mod retention;

pub use crate::storage::posix::publish::FAULT_KILL_ENV;

/// Sink settings.
#[derive(Debug, Clone)]
pub struct SinkConfig {
    /// This agent's name (its certificate SAN).
    pub agent: String,
    /// This agent's site.
    pub site: String,
    /// Directory that holds replicas and staging: a local directory, or
    /// with a remote [`SinkConfig::storage`], set from its URL (the path
    /// part: `/eval` for `hdfs://nn:8020/eval`) by [`Sink::start`].
    pub root: PathBuf,
    /// The store `root` is in: the local file system, HDFS or S3.
    pub storage: SinkStorage,
    /// Source agent names allowed to connect; empty allows any peer whose
    /// certificate chains to the CA.
    pub accept_peers: Vec<String>,
    /// Bytes of free space to keep in the sink root's file system; a
    /// transfer that would cut into it is refused.
    pub reserve_bytes: u64,
    /// Read every staged chunk back and hash it before publishing, so
    /// bytes changed on disk after they were verified on arrival are
    /// fetched again (see `publish`). Costs one read of the checkpoint
    /// at publish time (from the page cache when it still holds it).
    pub reread_before_publish: bool,
    /// Retention policies (`[[sink.retention]]`), first match per job;
    /// empty keeps every replica.
    pub retention: Vec<retention::RetentionPolicy>,
    /// How often the policies run besides after each publish.
    pub retention_interval: Duration,
    /// `[sink] min_free` and `target_free`: below `min_free` free, the
    /// sink removes replicas until `target_free` is free, and an incoming
    /// transfer that does not fit makes room the same way
    /// ([`pressure`]); `None` removes nothing for space.
    pub pressure: Option<pressure::SpacePressure>,
    /// The agent's membership of its site's pool: with it, a publish
    /// claims the published path's publish lease in the catalog first
    /// (the sink agents of a pool share the sink root); `None` (a sink
    /// alone, in-process tests) takes only this process's lock.
    pub pool: Option<crate::pool::Membership>,
}

/// The store a sink keeps its replicas in.
#[derive(Debug, Clone, Default)]
pub enum SinkStorage {
    /// The local directory [`SinkConfig::root`] (POSIX).
    #[default]
    Local,
    /// An HDFS directory, natively ([`crate::storage::hdfs`]).
    Hdfs {
        /// `hdfs://namenode:port/dir`.
        url: String,
        /// Bytes replicas may fill under the directory; `None` uses its
        /// space quota, if it has one.
        capacity: Option<u64>,
        /// Hot-file replication hints; `None`: files keep the factor they
        /// are written with.
        hot: Option<HotFiles>,
        /// Each version in its own directory, named by a pointer file
        /// (`[sink.hdfs] versions`, [`Hdfs::with_versions`]): reader
        /// leases, and no moment without a replica at a re-save.
        versions: bool,
    },
    /// A prefix of an S3 bucket ([`crate::storage::s3`]).
    S3 {
        /// `s3://bucket/prefix`.
        url: String,
        /// Endpoint, region, credentials (redacted in `Debug`) and
        /// capacity.
        config: S3Config,
    },
}

impl SinkStorage {
    /// The hot-file hints of an HDFS sink, if it gives them.
    pub fn hot(&self) -> Option<&HotFiles> {
        match self {
            SinkStorage::Hdfs { hot, .. } => hot.as_ref(),
            _ => None,
        }
    }

    /// The root URL of a remote store; `None` for a local directory.
    pub fn url(&self) -> Option<&str> {
        match self {
            SinkStorage::Local => None,
            SinkStorage::Hdfs { url, .. } | SinkStorage::S3 { url, .. } => Some(url),
        }
    }

    /// Opens the store for reading, as `ferry verify` reads a published
    /// replica: [`Posix`] for a local directory, otherwise the HDFS or S3
    /// client, checked as [`SinkStorage::open`] checks it. Blocks as that
    /// does.
    ///
    /// # Errors
    /// As [`SinkStorage::open`].
    pub fn reader(&self) -> io::Result<Arc<dyn crate::storage::SourceStore>> {
        Ok(match self {
            SinkStorage::Local => Arc::new(Posix),
            SinkStorage::Hdfs {
                url,
                capacity,
                versions,
                ..
            } => Arc::new(Hdfs::connect(url, *capacity)?.with_versions(*versions)),
            SinkStorage::S3 { url, config } => Arc::new(S3::connect(url, config)?),
        })
    }

    /// Opens the store, checking that it answers, and says where the sink
    /// root is in it: `local_root` for a local directory, the URL's path
    /// for a remote store. Blocks for the remote server's answer (bounded
    /// by [`crate::storage::remote::CALL_TIMEOUT`]).
    ///
    /// # Errors
    /// The server's error (unreachable, refused credentials, missing
    /// bucket or directory), naming the URL.
    pub fn open(&self, local_root: &Path) -> io::Result<(Arc<dyn SinkStore>, PathBuf)> {
        Ok(match self {
            SinkStorage::Local => (Arc::new(Posix), local_root.to_path_buf()),
            SinkStorage::Hdfs {
                url,
                capacity,
                hot,
                versions,
            } => {
                let h = Hdfs::connect(url, *capacity)?
                    .with_hot(hot.clone())
                    .with_versions(*versions);
                let root = h.root().path.clone();
                (Arc::new(h), root)
            }
            SinkStorage::S3 { url, config } => {
                let s = S3::connect(url, config)?;
                let root = s.root().path.clone();
                (Arc::new(s), root)
            }
        })
    }
}

/// A reader lease as resolve and the lease routes answer it.
#[derive(Debug, Clone, Serialize, PartialEq, utoipa::ToSchema)]
pub struct LeaseGrant {
    /// The lease id (32 hex digits), for `POST /v1/leases/{id}/renew` and
    /// `DELETE /v1/leases/{id}`.
    pub id: String,
    /// The replica row (version) it holds.
    pub replica: i64,
    /// When it expires unless renewed, RFC 3339.
    pub expires_at: String,
    /// How long each renewal extends it, seconds.
    pub duration_s: f64,
    /// The API token's name that took it.
    pub holder: String,
}

impl LeaseGrant {
    /// The catalog's lease as the API shows it.
    pub fn of(l: &ferry_catalog::ReaderLease) -> LeaseGrant {
        LeaseGrant {
            id: l.id.clone(),
            replica: l.replica,
            expires_at: rfc3339(l.expires_at),
            duration_s: l.duration_ms as f64 / 1000.0,
            holder: l.holder.clone(),
        }
    }
}

/// A hot-file replication hint in force, as the API shows it.
#[derive(Debug, Clone, Serialize, PartialEq, utoipa::ToSchema)]
pub struct HotView {
    /// The HDFS replication factor of the replica's hot files.
    pub factor: i64,
    /// The factor they go back to.
    pub previous: i64,
    /// When they go back, RFC 3339.
    pub until: String,
}

impl HotView {
    /// The catalog's hint, if it is still in force at `now` (Unix ms).
    pub fn of(h: Option<ferry_catalog::HotHint>, now: i64) -> Option<HotView> {
        h.filter(|h| h.until > now).map(|h| HotView {
            factor: h.factor,
            previous: h.previous,
            until: rfc3339(h.until),
        })
    }
}

/// What resolve answers for a source path.
// One answer per request, moved once: the size of `Local` costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, Serialize, PartialEq, utoipa::ToSchema)]
#[serde(tag = "state", rename_all = "lowercase")]
pub enum Resolution {
    /// A verified replica is published here.
    Local {
        /// Local twin of the requested path, on a sink whose root is a
        /// local directory; absent on an HDFS or S3 sink (see `url`).
        #[serde(skip_serializing_if = "Option::is_none")]
        local_path: Option<String>,
        /// The twin's URL on an HDFS or S3 sink
        /// (`hdfs://eval-nn:8020/eval/train-a/job/step-100`,
        /// `s3://bucket/eval/train-a/job/step-100`); absent on a local one.
        #[serde(skip_serializing_if = "Option::is_none")]
        url: Option<String>,
        /// Hex BLAKE3 manifest root.
        manifest_root: String,
        /// Publish time, RFC 3339.
        published_at: String,
        /// `weights-only` for a replica without optimizer state (a file
        /// of the checkpoint may then have no local twin); absent for a
        /// full replica.
        #[serde(skip_serializing_if = "Option::is_none")]
        profile: Option<Profile>,
        /// The replica's row id (its version), for `/v1/replicas/{id}`.
        replica: i64,
        /// On an HDFS sink with hot-file hints: the raised replication of
        /// its hot files while it lasts; absent otherwise.
        #[serde(skip_serializing_if = "Option::is_none")]
        hot: Option<HotView>,
        /// With `lease`: the lease that keeps this version, whose
        /// `local_path` then names this version's own directory (the same
        /// bytes for the lease's whole life, whatever is published
        /// later); absent without.
        #[serde(skip_serializing_if = "Option::is_none")]
        lease: Option<LeaseGrant>,
    },
    /// Chunks are arriving.
    Replicating {
        /// Bytes verified so far.
        bytes_done: u64,
        /// Bytes in the checkpoint.
        bytes_total: u64,
        /// Estimated seconds to completion at the recent rate, if known.
        eta_s: Option<f64>,
    },
    /// The sink has heard of it but holds no replica (failed or
    /// cancelled).
    Remote {
        /// Why it is not here, if known.
        reason: Option<String>,
    },
    /// Nothing known about this path.
    Unknown,
}

/// Per-transfer state shared by all the streams of a connection.
struct Live {
    id: i64,
    /// The transfer's file table; grows while the checkpoint is written.
    table: std::sync::RwLock<Table>,
    /// Bumped whenever `table` changes, for data streams waiting on it.
    table_changed: watch::Sender<u64>,
    /// Bumped when the transfer's commit arrives, when it fails and when
    /// its publish starts, for data streams waiting on its parts
    /// ([`wait_for_parts`]).
    state_changed: watch::Sender<u64>,
    /// When the table was last written to the catalog.
    table_saved: Mutex<Instant>,
    /// A delayed write of the table to the catalog is scheduled.
    table_pending: std::sync::atomic::AtomicBool,
    chunk_size: u32,
    /// Manifest root of a replica that was already published when the
    /// source (re)opened it; its commit is answered without touching disk.
    published_root: Option<Hash>,
    staging: PathBuf,
    local_path: PathBuf,
    /// Where the staging area and the replica live.
    store: Arc<dyn SinkStore>,
    started: Instant,
    st: Mutex<LiveState>,
    /// Bytes written to staging since the last background `syncfs`.
    unsynced: std::sync::atomic::AtomicU64,
    /// A background `syncfs` is running.
    syncing: std::sync::atomic::AtomicBool,
    /// Chunk writes hold it shared, publishing holds it exclusively.
    writes: Arc<tokio::sync::RwLock<()>>,
    /// Held while a batch confirmation is sent: batches finishing
    /// meanwhile go together in the next one.
    confirming: tokio::sync::Mutex<()>,
    /// A weights-first transfer's weights-only version (on storage that
    /// keeps version directories); `None` for every other transfer.
    weights: Option<WeightsVersion>,
}

/// The weights-only version of a weights-first transfer: its own row
/// (made with the transfer's at open, older than it) and the staging
/// area its files are hard-linked into from the transfer's at the
/// weights-only commit.
#[derive(Debug, Clone)]
struct WeightsVersion {
    id: i64,
    staging: PathBuf,
}

/// A weights-only commit waiting for its batches and chunks
/// ([`Commit::weights_only`]).
struct WeightsCommit {
    manifest: Manifest,
    batches: u64,
    times: SourceTimes,
    meta: CheckpointMeta,
    siblings: Vec<(String, Vec<u8>)>,
    phases: Phases,
    at: Instant,
}

/// Staging bytes written before a background `syncfs` starts. Flushing as
/// the data arrives leaves little for the publish step, which must make
/// the replica durable before the catalog calls it published.
const SYNC_EVERY: u64 = 128 << 20;

impl Live {
    /// Counts `bytes` written and starts a background `syncfs` of the
    /// staging file system once [`SYNC_EVERY`] bytes are pending.
    fn wrote(self: &Arc<Self>, bytes: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let pending = self.unsynced.fetch_add(bytes, Relaxed) + bytes;
        if pending < SYNC_EVERY || self.syncing.swap(true, Relaxed) {
            return;
        }
        self.unsynced.store(0, Relaxed);
        let live = self.clone();
        tokio::task::spawn_blocking(move || {
            if let Err(e) = live.store.flush(&live.staging) {
                debug!(error = %e, "background syncfs");
            }
            live.syncing.store(false, Relaxed);
        });
    }
}

#[derive(Default)]
struct LiveState {
    verified: HashMap<u64, Hash>,
    bytes_done: u64,
    bytes_at_open: u64,
    commit: Option<(Manifest, u64)>,
    times: SourceTimes,
    /// When the latest commit arrived, the phases the source measured
    /// until it went, and whether the source takes the sink's phases in
    /// its published answer (protocol version 7).
    commit_at: Option<Instant>,
    source_phases: Phases,
    answer_phases: bool,
    /// The step and class the source sent with the commit.
    meta: CheckpointMeta,
    siblings: Vec<(String, Vec<u8>)>,
    /// Batches of this run that arrived whole.
    batches_in: decide::BatchesIn,
    /// Batches the source's latest commit lists as lost (protocol version
    /// 4): not waited for, and not read if they arrive after it.
    lost: std::collections::HashSet<u64>,
    /// Batches arrived whole and not yet confirmed to the source
    /// ([`Control::BatchDone`]).
    unconfirmed: Vec<u64>,
    publishing: bool,
    failed: bool,
    /// Publish attempts that found staged chunks changed on disk.
    changed_on_disk: u32,
    /// The weights-only commit of a weights-first transfer, until its
    /// version is published (or the full replica is first).
    weights_commit: Option<WeightsCommit>,
    /// The weights-only version is being published: the full publish
    /// waits (chunk writes go on).
    weights_publishing: bool,
    /// Root of the weights-only version's manifest once published.
    weights_published: Option<Hash>,
}

/// What the catalog writer records ([`catalog_writer`]).
enum CatalogOp {
    Chunk(VerifiedChunk),
    Flush(oneshot::Sender<()>),
    /// A replica in place and durable on disk; the answer is the
    /// commit-to-replica lag stored, or why it could not be recorded.
    Publish(PublishedReplica, PublishAnswer),
}

/// Where the catalog writer answers a publish: the commit-to-replica lag
/// stored (seconds), or why it could not be recorded.
type PublishAnswer = oneshot::Sender<Result<Option<f64>, String>>;

/// Most publishes the catalog writer records in one transaction.
const PUBLISHES_PER_BATCH: usize = 256;

struct Inner {
    /// False while the catalog writer cannot record (the catalog does not
    /// answer): batches wait to be read.
    recording: watch::Sender<bool>,
    cfg: SinkConfig,
    catalog: Catalog,
    live: Mutex<HashMap<i64, Arc<Live>>>,
    chunks: mpsc::Sender<CatalogOp>,
    changed: watch::Sender<u64>,
    shutdown: CancellationToken,
    tasks: TaskTracker,
    /// This sink's Prometheus registry.
    metrics: SinkMetrics,
    /// One lock per local path a publish is moving a replica into.
    publish_locks: Mutex<HashMap<PathBuf, Arc<tokio::sync::Mutex<()>>>>,
    /// Where replicas are staged and published.
    store: Arc<dyn SinkStore>,
    /// Test hook: points where transfers are held (see [`Sink::hold_at`];
    /// empty without the `fault-injection` feature).
    holds: Arc<Holds>,
    /// The transfers opened by each source, by (certificate name, site),
    /// shared by all the connections of that source (a link's pool): data
    /// of a transfer may arrive on any of them.
    sources: Mutex<HashMap<(String, String), Weak<Opened>>>,
    /// Wakes the retention loop (a replica was published).
    retention_wake: tokio::sync::Notify,
    /// Rows whose files a task is deleting now.
    retiring: Mutex<std::collections::HashSet<i64>>,
    /// Held while space pressure removes replicas: one relief at a time.
    relief: tokio::sync::Mutex<()>,
    /// Replicas a `dry_run` policy was logged as removing (once each).
    dry_run_said: Mutex<std::collections::HashSet<i64>>,
    /// The retention policies in force: the config's, or those set
    /// through the API (the catalog's `sink.retention` setting).
    policies: Mutex<lifecycle::Policies>,
    /// A publish replaced a version, or a lease was released: the next
    /// lifecycle pass looks for version directories to delete (it also
    /// does at every interval).
    sweep_wanted: std::sync::atomic::AtomicBool,
    /// Chunk buffers: each record is copied out of quinn into one, and it
    /// comes back once the chunk is in staging.
    bufs: Arc<BufPool>,
    /// The previous [`Sink::received_bps`] sample: when, and the bytes
    /// received then.
    received_sample: Mutex<Option<(std::time::Instant, u64)>>,
}

impl Inner {
    /// The state of the source `peer` (certificate name) at `site`, shared
    /// by its connections; made new when it has none open.
    fn opened_for(&self, peer: &str, site: &str) -> Arc<Opened> {
        let mut m = crate::lock::lock(&self.sources);
        m.retain(|_, o| o.strong_count() > 0);
        let key = (peer.to_string(), site.to_string());
        if let Some(o) = m.get(&key).and_then(Weak::upgrade) {
            return o;
        }
        let o = Arc::new(Opened {
            received: self.metrics.received_for(peer),
            ..Opened::default()
        });
        m.insert(key, Arc::downgrade(&o));
        o
    }

    /// Where replica row `id` published at `local_path` is as users see
    /// it: the path itself on a local directory, its URL on HDFS or S3
    /// ([`crate::storage::SinkStore::replica_url`]).
    fn shown(&self, local_path: &Path, id: i64) -> String {
        self.store
            .replica_url(local_path, &version_dir(&self.cfg.root, id))
            .unwrap_or_else(|| local_path.to_string_lossy().into_owned())
    }

    /// The lock serialising publishes into `local_path`. Locks nobody
    /// holds or waits for are dropped from the map on the way.
    fn publish_lock(&self, local_path: &Path) -> Arc<tokio::sync::Mutex<()>> {
        let mut m = crate::lock::lock(&self.publish_locks);
        m.retain(|_, l| Arc::strong_count(l) > 1);
        m.entry(local_path.to_path_buf()).or_default().clone()
    }
}

/// A running sink; cheap to clone.
#[derive(Clone)]
pub struct Sink {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Sink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sink")
            .field("root", &self.inner.cfg.root)
            .finish()
    }
}

/// Errors that fail one incoming transfer.
#[derive(Debug, thiserror::Error)]
enum TransferError {
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    #[error("{0}")]
    Io(#[from] io::Error),
}

impl Sink {
    /// Starts accepting connections on `endpoint`.
    ///
    /// # Errors
    /// [`io::Error`] if the sink root or its staging area cannot be
    /// created.
    pub fn start(mut cfg: SinkConfig, catalog: Catalog, endpoint: Endpoint) -> io::Result<Sink> {
        let (store, root) = cfg.storage.open(&cfg.root)?;
        cfg.root = root;
        let name = cfg
            .storage
            .url()
            .map_or_else(|| cfg.root.display().to_string(), str::to_string);
        store
            .make_dir(&staging_root(&cfg.root))
            .map_err(|e| io::Error::new(e.kind(), format!("sink root {name}: {e}")))?;
        if cfg.pool.is_some() && catalog.dialect() == ferry_catalog::dialect::Dialect::Postgres {
            // Sink agents of a pool share the root: each publish relies on
            // what every agent checks here.
            store
                .check_pool_ready(&cfg.root.join(".ferry"))
                .map_err(|e| {
                    io::Error::new(
                        e.kind(),
                        format!(
                            "sink root {name} cannot be shared by a sink pool (the catalog is PostgreSQL): {e}; \
                             put the root on a file system that supports both (a local file system, \
                             or HDFS or S3 natively), or give this agent a catalog of its own"
                        ),
                    )
                })?;
        }
        if let Some(p) = cfg.pressure {
            let capacity = store.capacity(&cfg.root)?;
            p.bytes(capacity, cfg.reserve_bytes)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        }
        let (tx, rx) = mpsc::channel(65_536);
        let policies = lifecycle::Policies::from_config(&cfg.retention);
        let inner = Arc::new(Inner {
            cfg,
            catalog: catalog.clone(),
            live: Mutex::new(HashMap::new()),
            chunks: tx,
            changed: watch::channel(0).0,
            shutdown: CancellationToken::new(),
            tasks: TaskTracker::new(),
            metrics: SinkMetrics::new(),
            publish_locks: Mutex::default(),
            store,
            holds: Arc::default(),
            sources: Mutex::new(HashMap::new()),
            retention_wake: tokio::sync::Notify::new(),
            retiring: Mutex::default(),
            relief: tokio::sync::Mutex::new(()),
            dry_run_said: Mutex::default(),
            policies: Mutex::new(policies),
            sweep_wanted: std::sync::atomic::AtomicBool::new(false),
            bufs: BufPool::new(crate::bufpool::AGENT_POOL_BYTES),
            received_sample: Mutex::new(None),
            recording: watch::channel(true).0,
        });
        tokio::spawn(catalog_writer(
            catalog,
            rx,
            inner.recording.clone(),
            inner.shutdown.clone(),
        ));
        inner.tasks.spawn(lifecycle::run(inner.clone()));
        if let Some(h) = inner.cfg.storage.hot() {
            // Checked four times per TTL (a hint ends at most a quarter
            // late), at most every 30 s, at least every 250 ms.
            let every = (h.ttl / 4).clamp(Duration::from_millis(250), Duration::from_secs(30));
            inner.tasks.spawn(lower_hot_files(inner.clone(), every));
        }
        let i = inner.clone();
        inner.tasks.spawn(async move {
            loop {
                tokio::select! {
                    _ = i.shutdown.cancelled() => break,
                    inc = endpoint.accept() => {
                        let Some(inc) = inc else { break };
                        let i2 = i.clone();
                        i.tasks.spawn(async move { handle_connection(i2, inc).await });
                    }
                }
            }
            endpoint.close(VarInt::from_u32(code::SHUTDOWN), b"sink shutting down");
            // Let the close reach the peers so they resume promptly.
            let _ = tokio::time::timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
        });
        Ok(Sink { inner })
    }

    /// The catalog.
    pub fn catalog(&self) -> &Catalog {
        &self.inner.catalog
    }

    /// Test hook: the next open of any transfer to reach `point` is held
    /// there until the returned [`crate::hold::Hold`] is released or
    /// dropped. Only with the `fault-injection` feature.
    #[cfg(feature = "fault-injection")]
    pub fn hold_at(&self, point: HoldPoint) -> crate::hold::Hold {
        self.inner.holds.arm(point)
    }

    /// The sink root: a local directory, or the root's path in its HDFS
    /// or S3 store.
    pub fn root(&self) -> &Path {
        &self.inner.cfg.root
    }

    /// The sink root as a user names it: its directory, or its URL.
    pub fn root_name(&self) -> String {
        self.inner
            .cfg
            .storage
            .url()
            .map_or_else(|| self.inner.cfg.root.display().to_string(), str::to_string)
    }

    /// How resolve names path `p` of the sink's store: `(Some(local
    /// path), None)` on a local directory, `(None, Some(URL))` on HDFS or
    /// S3.
    pub fn twin(&self, p: &Path) -> (Option<String>, Option<String>) {
        match self.inner.store.url_of(p) {
            Some(u) => (None, Some(u)),
            None => (Some(p.to_string_lossy().into_owned()), None),
        }
    }

    /// The URL of replica row `id` published at `local_path` on an HDFS
    /// or S3 sink (the version's own directory where each version has
    /// one readers use: HDFS with versions); `None` on a local directory.
    pub fn replica_url(&self, local_path: &Path, id: i64) -> Option<String> {
        self.inner
            .store
            .replica_url(local_path, &version_dir(&self.inner.cfg.root, id))
    }

    /// Publish event `e` as clients get it: its `location` (the row's
    /// path) as its URL on an HDFS or S3 sink ([`Sink::replica_url`]).
    pub fn event_view(&self, mut e: ferry_catalog::ReplicaEvent) -> ferry_catalog::ReplicaEvent {
        if let Some(u) = self.replica_url(Path::new(&e.location), e.replica) {
            e.location = u;
        }
        e
    }

    /// [`Sink::twin`] of `p` if something is there (a replica, or a file
    /// or directory of one), its URL where a reader finds it (an S3
    /// version names files kept from an earlier one by their key:
    /// [`crate::storage::SinkStore::located_url`]); `None` when nothing
    /// is there or the store cannot tell.
    pub(crate) async fn twin_there(&self, p: &Path) -> Option<(Option<String>, Option<String>)> {
        let (store, p2) = (self.inner.store.clone(), p.to_path_buf());
        let (there, url) = blocking(move || {
            if !store.exists(&p2)? {
                return Ok((false, None));
            }
            Ok((true, store.located_url(&p2)?))
        })
        .await
        .ok()?;
        there.then(|| match url {
            Some(u) => (None, Some(u)),
            None => (Some(p.to_string_lossy().into_owned()), None),
        })
    }

    /// Payload bytes verified and written to staging per second since
    /// the previous call (0 on the first), in bit/s: the rate the
    /// agent's heartbeat records in the pool (one caller).
    pub fn received_bps(&self) -> f64 {
        let total = self.inner.metrics.received_total.get();
        let now = std::time::Instant::now();
        let mut last = crate::lock::lock(&self.inner.received_sample);
        let rate = match *last {
            Some((at, bytes)) if now > at => {
                total.saturating_sub(bytes) as f64 * 8.0 / (now - at).as_secs_f64()
            }
            _ => 0.0,
        };
        *last = Some((now, total));
        rate
    }

    /// This sink's metrics in the Prometheus text exposition format
    /// (version 0.0.4, [`crate::metrics::CONTENT_TYPE`]); the gauges of
    /// replicas per state are read from the catalog first.
    ///
    /// # Errors
    /// [`MetricsError`].
    pub async fn render_metrics(&self) -> Result<String, MetricsError> {
        let read = async {
            let states = self.inner.catalog.replica_state_counts().await?;
            let pinned = self.inner.catalog.pinned_replica_count(now_ms()).await?;
            let leased = self.inner.catalog.leased_replica_count(now_ms()).await?;
            Ok::<_, CatalogError>((states, pinned, leased))
        };
        match tokio::time::timeout(crate::metrics::SCRAPE_CATALOG_WAIT, read).await {
            Ok(Ok((states, pinned, leased))) => {
                Ok(self.inner.metrics.render(Some((&states, pinned, leased)))?)
            }
            other => {
                if let Ok(Err(e)) = other {
                    warn!(error = %e, "metrics: the catalog did not answer; replica gauges keep their last values");
                }
                Ok(self.inner.metrics.render(None)?)
            }
        }
    }

    /// A counter that changes whenever a replica is published or progress
    /// is made; used by long-polling resolve.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.inner.changed.subscribe()
    }

    /// Resolves a source path (the checkpoint directory or any file under
    /// it) to its local twin or its replication status.
    ///
    /// # Errors
    /// Catalog errors.
    pub async fn resolve(&self, path: &str) -> Result<Resolution, CatalogError> {
        Ok(self.resolve_row(path, false).await?.0)
    }

    /// [`Sink::resolve`] asking for the full replica (`full`): a
    /// weights-only version is then not an answer. While the full
    /// replica of a weights-first transfer is still on its way the answer
    /// is `replicating`; a weights-only replica with nothing newer coming
    /// (a root whose profile is `weights-only`) is `remote`, saying so.
    ///
    /// # Errors
    /// Catalog errors.
    pub async fn resolve_full(&self, path: &str) -> Result<Resolution, CatalogError> {
        Ok(self.resolve_row(path, true).await?.0)
    }

    /// [`Sink::resolve`] (only the full replica with `full`), and for a
    /// `local` answer the replica row and the path of the answer below
    /// the replica's directory.
    pub(crate) async fn resolve_row(
        &self,
        path: &str,
        full: bool,
    ) -> Result<(Resolution, Option<(i64, PathBuf)>), CatalogError> {
        let Some(path) = normalize_source_path(path) else {
            return Ok((Resolution::Unknown, None));
        };
        let path = path.as_str();
        let mut ancestor = Some(Path::new(path));
        while let Some(a) = ancestor {
            let a_str = a.to_string_lossy();
            if a_str.is_empty() || a_str == "/" {
                break;
            }
            let rows = self.inner.catalog.replicas_for_source(&a_str).await?;
            if let Some(first) = rows.first() {
                let suffix = Path::new(path).strip_prefix(a).unwrap_or(Path::new(""));
                // A newer version being moved into the same place (or whose
                // move a crash interrupted) makes the published row's
                // directory hold neither version for certain: not local
                // until that publish is finished.
                // (Asking the store may cross the network on HDFS or S3:
                // on a blocking thread.)
                let settling = async |p: &ferry_catalog::Replica| {
                    let stagings: Vec<PathBuf> = rows
                        .iter()
                        .filter(|r| {
                            r.id > p.id
                                && r.state != TransferState::Published
                                && r.local_path == p.local_path
                        })
                        .map(|r| PathBuf::from(&r.staging_path))
                        .collect();
                    if stagings.is_empty() {
                        return false;
                    }
                    let store = self.inner.store.clone();
                    // Unknown counts as settling: not local yet.
                    blocking(move || Ok(stagings.iter().any(|s| store.publish_under_way(s))))
                        .await
                        .unwrap_or(true)
                };
                // The newest published version, unless a newer one was
                // removed since (the older row's bytes went with the
                // re-save the removed one was).
                let newest = rows.iter().find(|r| {
                    matches!(
                        r.state,
                        TransferState::Published | TransferState::Removing | TransferState::Removed
                    )
                });
                let published = newest.filter(|p| p.state == TransferState::Published);
                let settled = match published {
                    Some(p) => !settling(p).await,
                    None => false,
                };
                // Only the full replica asked for: a weights-only version
                // is not it.
                if let Some(p) = published.filter(|p| full && p.profile == Profile::WeightsOnly) {
                    let coming = rows.iter().find(|r| {
                        r.id > p.id
                            && r.state == TransferState::Receiving
                            && r.local_path == p.local_path
                    });
                    if let Some(r) = coming {
                        return Ok((self.replicating(r), None));
                    }
                    return Ok((
                        Resolution::Remote {
                            reason: Some(format!(
                                "replica {} is weights-only and no full replica is on its way",
                                p.id
                            )),
                        },
                        None,
                    ));
                }
                if let Some(p) = published.filter(|_| settled) {
                    let local = if suffix.as_os_str().is_empty() {
                        PathBuf::from(&p.local_path)
                    } else {
                        Path::new(&p.local_path).join(suffix)
                    };
                    // A file the checkpoint does not hold has no twin.
                    let Some((local_path, url)) = self.twin_there(&local).await else {
                        return Ok((Resolution::Unknown, None));
                    };
                    return Ok((
                        Resolution::Local {
                            local_path,
                            url,
                            manifest_root: p.manifest_root.clone().unwrap_or_default(),
                            published_at: rfc3339(p.published_at.unwrap_or(0)),
                            profile: (p.profile != Profile::Full).then_some(p.profile),
                            replica: p.id,
                            hot: HotView::of(p.hot, now_ms()),
                            lease: None,
                        },
                        Some((p.id, suffix.to_path_buf())),
                    ));
                }
                if let Some(r) = rows.iter().find(|r| r.state == TransferState::Receiving) {
                    return Ok((self.replicating(r), None));
                }
                if let Some(r) = newest.filter(|r| r.state != TransferState::Published) {
                    let why = r
                        .removal
                        .as_ref()
                        .map_or(String::new(), |m| format!(" ({}: {})", m.reason, m.detail));
                    return Ok((
                        Resolution::Remote {
                            reason: Some(format!("replica {} was removed{why}", r.id)),
                        },
                        None,
                    ));
                }
                return Ok((
                    Resolution::Remote {
                        reason: first
                            .error
                            .clone()
                            .or_else(|| Some(first.state.to_string())),
                    },
                    None,
                ));
            }
            ancestor = a.parent();
        }
        Ok((Resolution::Unknown, None))
    }

    /// The `replicating` answer for incoming row `r`: its live progress
    /// and ETA while this agent receives it, else the catalog's bytes.
    fn replicating(&self, r: &ferry_catalog::Replica) -> Resolution {
        let live = self
            .inner
            .live
            .lock()
            .ok()
            .and_then(|m| m.get(&r.id).cloned());
        let (done, eta) = match live {
            Some(l) => l.progress(),
            None => (r.bytes_done as u64, None),
        };
        Resolution::Replicating {
            bytes_done: done,
            bytes_total: r.bytes_total as u64,
            eta_s: eta,
        }
    }

    /// Stops accepting, lets in-flight chunk writes finish, flushes the
    /// catalog, and waits at most `deadline` for all tasks.
    pub async fn shutdown(&self, deadline: Duration) {
        self.inner.shutdown.cancel();
        self.inner.tasks.close();
        let _ = tokio::time::timeout(deadline, self.inner.tasks.wait()).await;
        // Bounded: a catalog that does not answer is not waited for (the
        // writer gives up once the sink stops).
        let _ = tokio::time::timeout(deadline, flush(&self.inner)).await;
    }
}

impl Live {
    /// Verified bytes and an ETA in seconds from the rate since open.
    fn progress(&self) -> (u64, Option<f64>) {
        let st = crate::lock::lock(&self.st);
        let secs = self.started.elapsed().as_secs_f64();
        let gained = st.bytes_done.saturating_sub(st.bytes_at_open) as f64;
        let total = self.table.read().map(|t| t.bytes_total).unwrap_or(0);
        let eta = (secs > 0.5 && gained > 0.0)
            .then(|| (total.saturating_sub(st.bytes_done)) as f64 / (gained / secs));
        (st.bytes_done, eta)
    }
}

/// Lexically normalises an absolute source path, or the URL of a
/// checkpoint under an HDFS or S3 source root (`hdfs://nn:8020/ckpt/x`,
/// `s3://bucket/ckpt/x`, normalised in its path part): repeated and
/// trailing slashes and `.` components are dropped. `None` for a relative
/// path, another scheme, or a `..` component (refused rather than
/// interpreted, since the source's symlinks are unknown here).
pub fn normalize_source_path(path: &str) -> Option<String> {
    // A checkpoint under an HDFS or S3 source root is named by its URL:
    // the path part is normalised, the store kept as written.
    if let Some((scheme, rest)) = path.split_once("://") {
        if !matches!(scheme, "hdfs" | "s3") {
            return None;
        }
        let (authority, p) = rest.split_once('/').unwrap_or((rest, ""));
        if authority.is_empty() {
            return None;
        }
        let p = normalize_source_path(&format!("/{p}"))?;
        return Some(format!(
            "{scheme}://{authority}{}",
            if p == "/" { "" } else { &p }
        ));
    }
    if !path.starts_with('/') || path.contains('\0') {
        return None;
    }
    let mut out = String::with_capacity(path.len());
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => return None,
            p => {
                out.push('/');
                out.push_str(p);
            }
        }
    }
    if out.is_empty() {
        out.push('/');
    }
    Some(out)
}

fn rfc3339(ms: i64) -> String {
    let t = UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_seconds(t).to_string()
}

fn staging_root(root: &Path) -> PathBuf {
    root.join(".ferry").join("staging")
}

/// Where the sink keeps the version directories of its replicas.
pub(crate) fn versions_root(root: &Path) -> PathBuf {
    root.join(".ferry").join("versions")
}

/// The version directory of replica row `id`: its files, which the
/// published path names (a symbolic link) while it is the current
/// version, and a leased path names for the lease's life.
pub fn version_dir(root: &Path, id: i64) -> PathBuf {
    versions_root(root).join(id.to_string())
}

/// Records verified chunks and publishes in the catalog: everything
/// queued meanwhile goes in one transaction ([`Catalog::record_batch`]),
/// so the chunks and publishes of many small transfers arriving together
/// cost one commit. Should a batch with publishes fail, each is retried
/// on its own, so that one bad row does not keep the others unrecorded.
async fn catalog_writer(
    catalog: Catalog,
    mut rx: mpsc::Receiver<CatalogOp>,
    recording: watch::Sender<bool>,
    stop: CancellationToken,
) {
    let mut batch = Vec::new();
    let mut published = Vec::new();
    let mut waiters = Vec::new();
    while let Some(op) = rx.recv().await {
        let mut next = Some(op);
        while let Some(op) = next.take() {
            match op {
                CatalogOp::Chunk(c) => batch.push(c),
                CatalogOp::Flush(w) => waiters.push(w),
                CatalogOp::Publish(p, w) => published.push((p, w)),
            }
            if batch.len() < 4096 && published.len() < PUBLISHES_PER_BATCH {
                next = rx.try_recv().ok();
            }
        }
        record(&catalog, &mut batch, &mut published, &recording, &stop).await;
        for w in waiters.drain(..) {
            let _ = w.send(());
        }
    }
}

/// One batch of [`catalog_writer`]; empties `chunks` and `published`,
/// answering each publish.
async fn record(
    catalog: &Catalog,
    chunks: &mut Vec<VerifiedChunk>,
    published: &mut Vec<(PublishedReplica, PublishAnswer)>,
    recording: &watch::Sender<bool>,
    stop: &CancellationToken,
) {
    if chunks.is_empty() && published.is_empty() {
        return;
    }
    let recs: Vec<PublishedReplica> = published.iter().map(|(p, _)| p.clone()).collect();
    // While the catalog does not answer, the batch waits and is tried
    // again: nothing counts as verified (no batch is confirmed to the
    // source) until it is recorded, and senders queueing behind it wait
    // too, so the sources slow down through QUIC flow control.
    let mut wait = Duration::from_millis(250);
    let mut said = false;
    let result = loop {
        match catalog.record_batch(chunks, &recs).await {
            Err(e) if e.is_unavailable() => {
                if !said {
                    warn!(error = %e, chunks = chunks.len(), publishes = recs.len(), "the catalog does not answer: verified chunks and publishes wait to be recorded, and no batch is confirmed to the sources meanwhile");
                    said = true;
                    // No more batches are read meanwhile.
                    recording.send_replace(false);
                }
                if stop.is_cancelled() {
                    // Stopping: not recorded, so sent again after the
                    // restart (the sources were told of none of them).
                    warn!(chunks = chunks.len(), publishes = recs.len(), "the sink stops while the catalog does not answer: what waited goes unrecorded and is sent again after the restart");
                    for (_, w) in published.drain(..) {
                        let _ = w.send(Err("the sink is stopping".into()));
                    }
                    chunks.clear();
                    return;
                }
                tokio::select! {
                    _ = stop.cancelled() => {}
                    _ = tokio::time::sleep(wait) => {}
                }
                wait = (wait * 2).min(Duration::from_secs(2));
            }
            r => {
                if said {
                    info!(
                        chunks = chunks.len(),
                        publishes = recs.len(),
                        "the catalog answers again: recorded what waited"
                    );
                    recording.send_replace(true);
                }
                break r;
            }
        }
    };
    match result {
        Ok(lags) => {
            for ((_, w), lag) in published.drain(..).zip(lags) {
                let _ = w.send(Ok(lag));
            }
        }
        Err(e) if published.is_empty() => {
            // The chunks stay in staging; they are fetched again after a
            // restart because the catalog does not list them.
            warn!(error = %e, chunks = chunks.len(), "could not record verified chunks");
        }
        Err(e) => {
            debug!(error = %e, publishes = published.len(), "a catalog batch failed; recording its parts one by one");
            if let Err(e) = catalog.add_chunks(chunks).await {
                warn!(error = %e, chunks = chunks.len(), "could not record verified chunks");
            }
            for (p, w) in published.drain(..) {
                let r = catalog
                    .record_batch(&[], std::slice::from_ref(&p))
                    .await
                    .map(|lags| lags.into_iter().next().flatten())
                    .map_err(|e| e.to_string());
                let _ = w.send(r);
            }
        }
    }
    chunks.clear();
}

async fn flush(inner: &Inner) {
    let (tx, rx) = oneshot::channel();
    if inner.chunks.send(CatalogOp::Flush(tx)).await.is_ok() {
        let _ = rx.await;
    }
}

async fn handle_connection(inner: Arc<Inner>, incoming: quinn::Incoming) {
    let remote = incoming.remote_address();
    let conn = match incoming.await {
        Ok(c) => c,
        Err(e) => {
            warn!(%remote, "refused connection: {}", tls::explain_handshake_error(&e));
            return;
        }
    };
    let peer = tls::peer_agent_name(&conn).unwrap_or_default();
    if !inner.cfg.accept_peers.is_empty() && !inner.cfg.accept_peers.contains(&peer) {
        warn!(%remote, peer, "refused peer: its certificate name is not in [sink] accept_peers");
        conn.close(
            VarInt::from_u32(code::NOT_ACCEPTED),
            b"agent name not accepted by this sink",
        );
        return;
    }
    info!(%remote, peer, "source connected");
    match serve_connection(&inner, &conn, &peer).await {
        Ok(()) => info!(peer, "source disconnected"),
        // The peer went away (closed, crashed, or the link died): not an
        // error of ours; it resumes when it reconnects.
        Err(e @ (ConnError::Read(_) | ConnError::Connection(_))) => {
            info!(peer, reason = %e, "source disconnected")
        }
        Err(e) => {
            warn!(peer, error = %e, "closing the connection");
            conn.close(VarInt::from_u32(code::PROTOCOL), e.to_string().as_bytes());
        }
    }
}

async fn serve_connection(
    inner: &Arc<Inner>,
    conn: &Connection,
    peer: &str,
) -> Result<(), ConnError> {
    let (send, mut recv) = tokio::select! {
        r = conn.accept_bi() => r?,
        _ = inner.shutdown.cancelled() => return Ok(()),
    };
    let ctl = Arc::new(ControlSender::new(send));
    let hello = match read_frame(&mut recv).await? {
        Some(Control::Hello(h)) => h,
        Some(m) => {
            return Err(ConnError::Unexpected(format!(
                "expected hello, got {}",
                m.name()
            )))
        }
        None => return Ok(()),
    };
    if !(MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&hello.version) {
        let message = format!(
            "incompatible protocol version: peer speaks {}, this sink speaks \
             {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}",
            hello.version
        );
        ctl.send_last(
            &Control::Error {
                message: message.clone(),
            },
            Duration::from_secs(2),
        )
        .await;
        return Err(ConnError::Peer(message));
    }
    if let Err(e) = check_name(&hello.site) {
        return Err(ConnError::Unexpected(format!("bad site name: {e}")));
    }
    // Answered in the source's version (an older source checks for its
    // own).
    ctl.send(&Control::Hello(Hello {
        version: hello.version,
        agent: inner.cfg.agent.clone(),
        site: inner.cfg.site.clone(),
    }))
    .await?;

    // Transfers opened by this source (on this connection or another of
    // its link's pool), by source transfer id.
    let open = inner.opened_for(peer, &hello.site);
    let version = hello.version;
    let streams = {
        let (inner, conn, open, ctl) = (inner.clone(), conn.clone(), open.clone(), ctl.clone());
        tokio::spawn(async move {
            while let Ok(s) = conn.accept_uni().await {
                let (inner, open, ctl, conn) =
                    (inner.clone(), open.clone(), ctl.clone(), conn.clone());
                inner.clone().tasks.spawn(async move {
                    match receive_batch(&inner, &open, &ctl, version, s).await {
                        Ok(()) => {}
                        // The connection went away; the source resumes later.
                        Err(e @ (ConnError::Read(_) | ConnError::Connection(_))) => {
                            debug!(error = %e, "data stream ended early")
                        }
                        Err(e) => {
                            warn!(error = %e, "bad data stream; closing the connection");
                            conn.close(VarInt::from_u32(code::PROTOCOL), e.to_string().as_bytes());
                        }
                    }
                });
            }
        })
    };
    // Messages of one transfer are handled in order, each in a task that
    // waits for the one before it; different transfers go on at once, so
    // a publish (a sync, catalog writes) does not hold up the opens and
    // commits behind it on the control stream. At most
    // CONTROL_TASKS_PER_CONNECTION are under way; the stream is read no
    // further meanwhile.
    let mut chains: HashMap<TransferId, tokio::task::JoinHandle<()>> = HashMap::new();
    let in_flight = Arc::new(tokio::sync::Semaphore::new(CONTROL_TASKS_PER_CONNECTION));
    let site = hello.site.clone();
    let result = async {
        loop {
            let msg = tokio::select! {
                m = read_frame(&mut recv) => m?,
                _ = inner.shutdown.cancelled() => {
                    conn.close(VarInt::from_u32(code::SHUTDOWN), b"sink shutting down");
                    return Ok(());
                }
            };
            let Some(msg) = msg else { return Ok(()) };
            // When it arrived: a commit's phases at the sink start here,
            // not when its transfer's earlier messages are done.
            let arrived = Instant::now();
            debug!(msg = msg.name(), "control");
            if let Control::Pin(p) = msg {
                // About replicas, not a transfer: recorded and applied by
                // the lifecycle task.
                let (inner2, site2) = (inner.clone(), site.clone());
                inner
                    .tasks
                    .spawn(async move { lifecycle::pin_requested(&inner2, &site2, p).await });
                continue;
            }
            let id = match &msg {
                Control::Open(request) => request.key.id,
                Control::Files { id, .. } | Control::Commit(Commit { id, .. }) => *id,
                Control::Cancel { id, .. } | Control::Part { id, .. } => *id,
                Control::Error { message } => return Err(ConnError::Peer(message.clone())),
                other => {
                    return Err(ConnError::Unexpected(format!(
                        "unexpected {} from a source",
                        other.name()
                    )))
                }
            };
            let permit = tokio::select! {
                p = in_flight.clone().acquire_owned() => p.map_err(|_| ConnError::Unexpected("closed".into()))?,
                _ = inner.shutdown.cancelled() => {
                    conn.close(VarInt::from_u32(code::SHUTDOWN), b"sink shutting down");
                    return Ok(());
                }
            };
            let before = chains.remove(&id);
            let (inner2, conn2, open2, ctl2) =
                (inner.clone(), conn.clone(), open.clone(), ctl.clone());
            let (peer2, site2) = (peer.to_string(), site.clone());
            let task = inner.tasks.spawn(async move {
                if let Some(before) = before {
                    let _ = before.await;
                }
                let r = handle_control(
                    &inner2, &open2, &ctl2, &peer2, &site2, version, arrived, msg,
                )
                .await;
                drop(permit);
                match r {
                    Ok(()) => {}
                    // The connection went away; the source resumes later.
                    Err(e @ (ConnError::Read(_) | ConnError::Connection(_) | ConnError::Write(_))) => {
                        debug!(transfer = %id, error = %e, "control answer not sent")
                    }
                    Err(e) => {
                        warn!(peer = %peer2, error = %e, "closing the connection");
                        conn2.close(VarInt::from_u32(code::PROTOCOL), e.to_string().as_bytes());
                    }
                }
            });
            chains.insert(id, task);
            if chains.len() > 4 * CONTROL_TASKS_PER_CONNECTION {
                chains.retain(|_, t| !t.is_finished());
            }
        }
    }
    .await;
    streams.abort();
    result
}

/// Control messages of a connection handled at once (see
/// `serve_connection`): enough for a burst of small transfers' opens and
/// commits, few enough to bound what one source can start.
const CONTROL_TASKS_PER_CONNECTION: usize = 64;

/// Handles one control message about a transfer (open, file-table
/// update, commit or cancel) that `arrived` then, answering on `ctl`.
#[allow(clippy::too_many_arguments)]
async fn handle_control(
    inner: &Arc<Inner>,
    open: &Opened,
    ctl: &Arc<ControlSender>,
    peer: &str,
    site: &str,
    version: u16,
    arrived: Instant,
    msg: Control,
) -> Result<(), ConnError> {
    match msg {
        Control::Open(request) => {
            let id = request.key.id;
            let parts_first = request.parts_first;
            inner.holds.hold(id, HoldPoint::Open).await;
            match open_transfer(inner, peer, site, request).await {
                Ok((live, have)) => {
                    open.insert(id, live, ctl.clone(), parts_first);
                    ctl.send(&Control::Have { id, chunks: have }).await?;
                }
                Err(TransferError::Catalog(e)) if e.is_unavailable() => {
                    // Not the transfer's fault: the source retries once
                    // its connection is gone (on this sink agent or
                    // another), backing off until the catalog answers.
                    return Err(ConnError::Local(format!(
                        "the sink's catalog does not answer ({e}); open transfer {id} again later"
                    )));
                }
                Err(e) => {
                    open.refuse(id);
                    warn!(transfer = %id, peer, "refused transfer: {e}");
                    ctl.send(&Control::Refuse {
                        id,
                        reason: e.to_string(),
                    })
                    .await?;
                }
            }
        }
        Control::Files { id, files } => {
            let Some(live) = open.get(id) else {
                // Refused or cancelled here already: nothing to grow.
                return Ok(());
            };
            if let Err(e) = grow_table(inner, &live, &files).await {
                let reason = e.to_string();
                warn!(transfer = %id, peer, "{reason}");
                open.remove(id);
                cancel_live(inner, &live, TransferState::Failed, &reason).await;
                ctl.send(&Control::Cancel { id, reason }).await?;
            }
        }
        Control::Commit(Commit {
            id,
            committed_ms,
            opened_ms,
            batches,
            manifest,
            siblings,
            checkpoint,
            lost,
            phases,
            weights_only,
        }) => {
            let live = open.get(id);
            let Some(live) = live else {
                return Err(ConnError::Unexpected(format!(
                    "commit for unknown transfer {id}"
                )));
            };
            if weights_only {
                let commit = WeightsCommit {
                    manifest,
                    batches,
                    times: SourceTimes {
                        committed_ms,
                        opened_ms,
                    },
                    meta: checkpoint_meta(id, checkpoint),
                    siblings,
                    phases,
                    at: arrived,
                };
                return weights_commit(inner, &live, ctl, id, version, commit, lost).await;
            }
            {
                let mut st = crate::lock::lock(&live.st);
                debug!(
                    transfer = %id,
                    batches,
                    lost = lost.len(),
                    batches_counted = st.batches_in.counted,
                    batches_numbered = st.batches_in.seqs.len(),
                    bytes_done = st.bytes_done,
                    "commit received"
                );
                st.commit = Some((manifest, batches));
                // The latest commit's list: the source's losses of this
                // run so far.
                st.lost = lost.into_iter().collect();
                st.times = SourceTimes {
                    committed_ms,
                    opened_ms,
                };
                st.siblings = siblings;
                st.meta = checkpoint_meta(id, checkpoint);
                // The sink's phases start again at each commit: those
                // before it are in the source's.
                st.commit_at = Some(arrived);
                st.source_phases = phases;
                st.answer_phases = version >= ferry_proto::wire::PHASES_VERSION;
            }
            // Chunks waiting for their part's registration are judged
            // against the sealed manifest from now on.
            live.state_changed.send_modify(|v| *v += 1);
            maybe_finish(inner, &live, ctl, id).await?;
        }
        Control::Part {
            id,
            part,
            epoch,
            first_key,
            end_key,
        } => {
            let Some(live) = open.get(id) else {
                if open.is_refused(id) {
                    // Registrations sent with the open, before its
                    // refusal reached the source (a coordinator sends
                    // both in one round trip): the refusal answers them.
                    debug!(transfer = %id, part, "registration of a part of a refused transfer ignored");
                    return Ok(());
                }
                return Err(ConnError::Unexpected(format!(
                    "a part of transfer {id}, which this connection's source never opened"
                )));
            };
            let range = ferry_catalog::PartRange {
                part,
                first_key,
                end_key,
                bytes: 0,
            };
            let now = match inner
                .catalog
                .register_part_epoch(live.id, range, epoch, peer)
                .await
            {
                Ok(e) => e,
                Err(e) if e.is_unavailable() => {
                    return Err(ConnError::Local(format!(
                        "the sink's catalog does not answer ({e}); register the part again later"
                    )));
                }
                Err(e) => {
                    return Err(ConnError::Local(format!(
                        "recording part {part} of transfer {id}: {e}"
                    )))
                }
            };
            open.register_part(id, range, epoch);
            ctl.send(&Control::PartEpoch {
                id,
                part,
                epoch: now,
            })
            .await?;
        }
        Control::Cancel { id, reason } => {
            let live = open.remove(id);
            // Batches still on their way are dropped, not waited
            // for (they would hold the connection up).
            open.refuse(id);
            if let Some(live) = live {
                info!(transfer = %id, reason, "transfer cancelled by source");
                cancel_live(inner, &live, TransferState::Cancelled, &reason).await;
            }
        }
        other => {
            return Err(ConnError::Unexpected(format!(
                "unexpected {} from a source",
                other.name()
            )))
        }
    }
    Ok(())
}

/// Fault injection (`fault-injection` builds only): set in a sink agent's
/// environment, it refuses every joining open ([`Open::joins`]) at once,
/// so a test can follow what a source agent does with a refused join.
pub const FAULT_REFUSE_JOINS_ENV: &str = "FERRY_FAULT_REFUSE_JOINS";

/// How long a joining open ([`Open::joins`]) waits for its transfer's
/// row: the coordinator's open, sent at about the same time, creates it
/// (at this sink agent or another of the pool).
const JOIN_WAIT: Duration = Duration::from_secs(5);

/// How often a joining open looks for its transfer's row.
const JOIN_POLL: Duration = Duration::from_millis(25);

/// The row a joining open of `key` (owned by `owner`) continues, and the
/// file table it works with ([`decide::join_table`] of `files` and the
/// row's): `existing` if it agrees, else read again every [`JOIN_POLL`]
/// until the coordinator's open created the row and wrote its table.
/// A row that is not receiving (published, failed) is returned as it is,
/// with `files`, for [`decide::plan_open`] to answer.
///
/// # Errors
/// [`TransferError::Refused`] after [`JOIN_WAIT`], naming what is still
/// missing (no row, or the first file that differs); catalog errors.
async fn row_to_join(
    inner: &Arc<Inner>,
    owner: &str,
    key: &ferry_proto::wire::TransferKey,
    files: &[FileInfo],
    mut existing: Option<ferry_catalog::Replica>,
) -> Result<(ferry_catalog::Replica, Vec<FileInfo>), TransferError> {
    #[cfg(feature = "fault-injection")]
    if std::env::var_os(FAULT_REFUSE_JOINS_ENV).is_some() {
        return Err(TransferError::Refused(format!(
            "fault injection: joining opens refused ({FAULT_REFUSE_JOINS_ENV})"
        )));
    }
    let deadline = tokio::time::Instant::now() + JOIN_WAIT;
    loop {
        let why = match existing.take() {
            Some(r) if r.state != TransferState::Receiving => return Ok((r, files.to_vec())),
            Some(r) => {
                // The catalog's copy is the latest non-joining open's.
                // This sink agent's live table may be newer (a growing
                // table is saved every few seconds), or an older run's.
                match decide::join_table(files, &inner.catalog.replica_files(r.id).await?) {
                    Ok(t) => return Ok((r, t)),
                    Err(why) => {
                        let live = crate::lock::lock(&inner.live)
                            .get(&r.id)
                            .and_then(|l| l.table.read().ok().map(|t| t.files.clone()));
                        match live.map(|t| decide::join_table(files, &t)) {
                            Some(Ok(t)) => return Ok((r, t)),
                            _ => why,
                        }
                    }
                }
            }
            None => format!(
                "no transfer {} from this source pool to join at this sink: its coordinator's open did not arrive",
                key.id
            ),
        };
        if tokio::time::Instant::now() >= deadline {
            return Err(TransferError::Refused(format!(
                "{why} (waited {} s)",
                JOIN_WAIT.as_secs()
            )));
        }
        tokio::time::sleep(JOIN_POLL).await;
        existing = inner
            .catalog
            .find_replica(owner, key.id, &key.source_path)
            .await?;
    }
}

/// Opens (or resumes) a transfer the source announced with `open`.
async fn open_transfer(
    inner: &Arc<Inner>,
    peer: &str,
    site: &str,
    open: Open,
) -> Result<(Arc<Live>, Vec<u64>), TransferError> {
    let Open {
        key,
        chunk_size,
        mut bytes_total,
        mut files,
        parts_first: _,
        joins,
    } = open;
    let refuse = |s: String| TransferError::Refused(s);
    decide::check_open(&key, chunk_size, bytes_total, &files).map_err(refuse)?;
    let root = &inner.cfg.root;
    let local_path = root.join(site).join(&key.job).join(&key.rel);
    if let Some(other) = inner
        .catalog
        .overlapping_replica(&local_path.to_string_lossy())
        .await?
    {
        return Err(refuse(format!(
            "{} would overlap the replica at {other}: one checkpoint directory may not contain another",
            local_path.display()
        )));
    }
    // The rows of this source path, newest first: the transfer's own row,
    // if it has one, is almost always among them, and so is a published
    // version a re-save can reuse files from. One query for both.
    let same_source = inner.catalog.replicas_for_source(&key.source_path).await?;
    // Whose transfer it is: the source's catalog (protocol 5 on), so any
    // agent of the source's pool continues it, or the agent for an older
    // source.
    let origin = key.origin.as_ref().map(|o| format!("catalog:{o}"));
    let owner = origin.as_deref().unwrap_or(peer);
    let find = async |owner: &str| -> Result<Option<ferry_catalog::Replica>, CatalogError> {
        match same_source
            .iter()
            .find(|r| r.peer == owner && r.source_transfer == key.id)
        {
            Some(r) => Ok(Some(r.clone())),
            None if same_source.len() >= ferry_catalog::replicas::SAME_SOURCE_ROWS => {
                inner
                    .catalog
                    .find_replica(owner, key.id, &key.source_path)
                    .await
            }
            None => Ok(None),
        }
    };
    let mut existing = find(owner).await?;
    if existing.is_none() && origin.is_some() {
        // First opened by this agent before it spoke protocol 5: the row
        // is keyed by its name; it continues under its catalog's key.
        if let Some(r) = find(peer).await? {
            if inner.catalog.set_replica_peer(r.id, owner).await? {
                info!(transfer = %key.id, peer, owner, "transfer re-keyed to its source catalog");
                existing = Some(ferry_catalog::Replica {
                    peer: owner.to_string(),
                    ..r
                });
            }
        }
    }
    if joins {
        // Another agent of the source's pool: the transfer's row is its
        // coordinator's open's to make (at this sink agent or another).
        let (r, table) = row_to_join(inner, owner, &key, &files, existing).await?;
        existing = Some(r);
        bytes_total = table.iter().map(|f| f.size).sum();
        files = table;
    }
    let mut published_root = None;
    let plan = decide::plan_open(
        key.id,
        existing.as_ref().map(|r| decide::Existing {
            state: r.state,
            chunk_size: u32::try_from(r.chunk_size).unwrap_or(0),
        }),
        existing
            .as_ref()
            .and_then(|r| {
                // A removed replica says why in its removal, not its error.
                r.removal
                    .as_ref()
                    .map(|m| match m.detail.as_str() {
                        "" => format!("by {}", m.reason),
                        d => format!("by {}: {d}", m.reason),
                    })
                    .or_else(|| r.error.clone())
            })
            .as_deref(),
        chunk_size,
    );
    // The row's id, state, staging and local paths, and the chunks it has.
    let (row, have) = match (plan, existing) {
        (decide::OpenPlan::Refuse(why), _) => return Err(refuse(why)),
        (
            plan @ (decide::OpenPlan::AnswerFromReplica
            | decide::OpenPlan::Resume
            | decide::OpenPlan::StartOver),
            Some(r),
        ) => {
            let old_files = inner.catalog.replica_files(r.id).await?;
            let chunks = if plan == decide::OpenPlan::AnswerFromReplica {
                // Already published (the source missed our answer): every
                // chunk is here; the commit is answered from the catalog.
                let bytes = inner
                    .catalog
                    .replica_manifest(r.id)
                    .await?
                    .unwrap_or_default();
                let m =
                    Manifest::decode(&bytes).map_err(|e| CatalogError::Corrupt(e.to_string()))?;
                published_root = Some(m.root());
                decide::published_keys(&m, &files)
            } else if plan == decide::OpenPlan::Resume && joins {
                // Joined: the row's chunks and table stay as they are
                // (`files` agrees with the table, see `row_to_join`).
                flush(inner).await;
                inner.catalog.chunks(r.id).await?
            } else if plan == decide::OpenPlan::Resume {
                // A resume: keep what is verified, re-keyed to the file
                // table the source sends now (matched by path). Chunks of
                // files that changed since are caught at commit, where
                // every hash is compared with the sealed manifest.
                //
                // Regression: the catalog's copy of a growing file table is
                // rewritten at most every TABLE_SAVE_EVERY, so a transfer
                // resumed sooner (a pause, then a resume) found a table
                // without the newest files; their verified chunks could
                // not be re-keyed and were all sent again. The previous
                // run's live table, while it is still here, is newer; and
                // chunk records still on their way to the catalog are
                // waited for.
                flush(inner).await;
                let live_files = crate::lock::lock(&inner.live)
                    .get(&r.id)
                    .and_then(|l| l.table.read().ok().map(|t| t.files.clone()));
                let saved = old_files.clone();
                let old_files = live_files.unwrap_or(old_files);
                let old = inner.catalog.chunks(r.id).await?;
                let kept = decide::rekey_chunks(&old_files, &files, chunk_size, &old);
                if kept != old {
                    let new_map = ChunkMap::new(&files, chunk_size);
                    let done = new_map.bytes_of(kept.iter().map(|(k, _)| *k));
                    inner.catalog.replace_chunks(r.id, &kept, done).await?;
                }
                // Compared with the catalog's copy, not the live table: a
                // watched checkpoint striped at its commit opens again so
                // that the other sink agents of the pool find its whole
                // table in the catalog when the source pool's other
                // agents open it.
                if saved != files {
                    inner
                        .catalog
                        .set_replica_files(r.id, &files, bytes_total)
                        .await?;
                }
                kept
            } else if joins {
                return Err(refuse(format!(
                    "transfer {} is recorded at this sink with chunks of {} bytes, the joining open says {chunk_size}: only its coordinator's open may start it over",
                    key.id, r.chunk_size
                )));
            } else {
                // The files changed at the source since the first attempt:
                // start over for this transfer.
                inner
                    .catalog
                    .drop_chunks(
                        r.id,
                        &inner
                            .catalog
                            .chunks(r.id)
                            .await?
                            .iter()
                            .map(|c| c.0)
                            .collect::<Vec<_>>(),
                        0,
                    )
                    .await?;
                inner
                    .catalog
                    .set_replica_files(r.id, &files, bytes_total)
                    .await?;
                Vec::new()
            };
            (RowAtOpen::of(&r), chunks)
        }
        (_, _) => {
            // One staging directory per (peer, transfer, source path), the
            // catalog row's key: a source that lost its catalog reuses
            // transfer ids, and two agents may share a name by mistake.
            let path_tag = blake3::hash(key.source_path.as_bytes()).to_hex();
            let staging = staging_root(root).join(format!(
                "{}-{}-{}",
                sanitize(owner),
                key.id,
                &path_tag[..16]
            ));
            // Left by a row this catalog no longer has: not ours to reuse.
            let (leftover, store) = (staging.clone(), inner.store.clone());
            if let Err(e) = blocking(move || store.discard(&leftover)).await {
                warn!(error = %e, "removing a leftover staging area");
            }
            let weights_first = key.profile == Profile::WeightsFirst;
            let new = NewReplica {
                peer: owner,
                source_site: site,
                source_transfer: key.id,
                job: &key.job,
                source_path: &key.source_path,
                rel: &key.rel,
                chunk_size,
                files: &files,
                bytes_total,
                staging_path: &staging.to_string_lossy(),
                local_path: &local_path.to_string_lossy(),
                profile: if weights_first {
                    Profile::Full
                } else {
                    key.profile
                },
            };
            let (id, weights_version) = if weights_first && inner.store.hard_links() {
                let w_staging = weights_staging(&staging);
                let (leftover, store) = (w_staging.clone(), inner.store.clone());
                if let Err(e) = blocking(move || store.discard(&leftover)).await {
                    warn!(error = %e, "removing a leftover staging area");
                }
                let (id, w) = inner
                    .catalog
                    .insert_replica_weights_first(&new, &w_staging.to_string_lossy())
                    .await?;
                (id, Some(w))
            } else {
                if weights_first {
                    info!(
                        transfer = %key.id,
                        "weights-first asked, but this sink's storage cannot share files between two staging areas (HDFS, S3): the full replica is published alone"
                    );
                }
                (inner.catalog.insert_replica(&new).await?, None)
            };
            // Known without reading it back.
            let row = RowAtOpen {
                id,
                state: TransferState::Receiving,
                staging_path: staging.to_string_lossy().into_owned(),
                local_path: local_path.to_string_lossy().into_owned(),
                weights_version,
            };
            let reused = reuse_published(
                inner,
                &same_source,
                &local_path,
                &files,
                chunk_size,
                &staging,
            )
            .await;
            for (g, h, len) in &reused {
                let c = VerifiedChunk {
                    replica: id,
                    key: *g,
                    hash: *h,
                    bytes: *len,
                    arrived_ms: None,
                    arrival_started_ms: None,
                };
                if inner.chunks.send(CatalogOp::Chunk(c)).await.is_err() {
                    // Only after shutdown: the chunk is verified again at
                    // the next open.
                    debug!("catalog writer stopped; a verified chunk goes unrecorded");
                }
            }
            (row, reused.into_iter().map(|(g, h, _)| (g, h)).collect())
        }
    };
    let map = ChunkMap::new(&files, chunk_size);
    let (verified, done) = decide::verified_at_open(&map, have);
    if row.state != TransferState::Published {
        let (r, store) = (root.clone(), inner.store.clone());
        let avail = blocking(move || store.free_space(&r)).await?;
        if let Some(needed) =
            decide::space_shortfall(bytes_total, done, avail, inner.cfg.reserve_bytes)
        {
            let pressure = lifecycle::make_room(inner, needed).await;
            let (r, store) = (root.clone(), inner.store.clone());
            let avail = blocking(move || store.free_space(&r)).await?;
            if decide::space_shortfall(bytes_total, done, avail, inner.cfg.reserve_bytes).is_some()
            {
                let msg = format!(
                "not enough space at the sink: {} has {} bytes free (keeping {} in reserve), the checkpoint needs {} more bytes{}",
                root.display(),
                avail.unwrap_or(0),
                inner.cfg.reserve_bytes,
                needed,
                pressure.map_or(String::new(), |why| format!("; {why}"))
            );
                inner
                    .catalog
                    .set_replica_state(row.id, TransferState::Failed, Some(&msg))
                    .await?;
                return Err(refuse(msg));
            }
        }
    }
    let staging = PathBuf::from(&row.staging_path);
    // A weights-first transfer's weights-only version: still to publish
    // (`queued`), or published already (its root, and the files it
    // shares with staging).
    let mut weights = None;
    let mut weights_published = None;
    if let (Some(w), None) = (row.weights_version, published_root) {
        match inner.catalog.replica(w).await? {
            Some(r) if r.state == TransferState::Queued => {
                weights = Some(WeightsVersion {
                    id: w,
                    staging: PathBuf::from(&r.staging_path),
                });
            }
            Some(r) if r.state == TransferState::Published => {
                let bytes = inner.catalog.replica_manifest(w).await?.unwrap_or_default();
                let m =
                    Manifest::decode(&bytes).map_err(|e| CatalogError::Corrupt(e.to_string()))?;
                weights_published = Some(m.root());
                weights = Some(WeightsVersion {
                    id: w,
                    staging: PathBuf::from(&r.staging_path),
                });
            }
            _ => {}
        }
    }
    if published_root.is_none() {
        let (s2, store) = (staging.clone(), inner.store.clone());
        blocking(move || store.make_dir(&s2)).await?;
    }
    let have_list: Vec<u64> = verified.keys().copied().collect();
    let live = Arc::new(Live {
        id: row.id,
        table: std::sync::RwLock::new(Table::new(files, chunk_size)),
        table_changed: watch::channel(0).0,
        state_changed: watch::channel(0).0,
        table_saved: Mutex::new(Instant::now()),
        table_pending: Default::default(),
        chunk_size,
        published_root,
        staging,
        store: inner.store.clone(),
        local_path: if published_root.is_some() {
            PathBuf::from(&row.local_path)
        } else {
            local_path
        },
        started: Instant::now(),
        st: Mutex::new(LiveState {
            verified,
            bytes_done: done,
            bytes_at_open: done,
            weights_published,
            ..LiveState::default()
        }),
        unsynced: Default::default(),
        syncing: Default::default(),
        writes: Default::default(),
        confirming: Default::default(),
        weights,
    });
    {
        let mut m = crate::lock::lock(&inner.live);
        if joins {
            // The coordinator's open here, if any, stays the one this
            // agent knows the transfer by.
            m.entry(row.id).or_insert_with(|| live.clone());
        } else {
            m.insert(row.id, live.clone());
        }
    }
    info!(transfer = %key.id, peer, path = %key.source_path, bytes_total, resumed_bytes = done, joins, "transfer opened");
    Ok((live, have_list))
}

/// Before a commit's verdict: the chunks the commit's manifest names
/// that this open has not verified but the catalog records for the row
/// count as verified (their hashes are still compared with the
/// manifest's). Another source agent's open of the same transfer (a
/// striped transfer's parts), on this sink agent or another of the pool,
/// verified and recorded them into the same staging area. Nothing is
/// read unless the commit is ready and chunks are missing.
async fn absorb_recorded(inner: &Arc<Inner>, live: &Arc<Live>, id: TransferId) {
    let missing = {
        let st = crate::lock::lock(&live.st);
        let Some((m, batches)) = st.commit.as_ref() else {
            return;
        };
        if !decide::commit_ready(
            Some(*batches),
            &st.lost,
            &st.batches_in,
            st.publishing || st.weights_publishing,
            st.failed,
        ) {
            return;
        }
        let Ok(t) = live.table.read() else {
            return;
        };
        let mut missing = 0u64;
        for f in &m.files {
            let Some(pos) = t.by_path.get(&f.path) else {
                continue;
            };
            for c in 0..f.chunks.len() as u32 {
                if let Some(k) = t.map.index(*pos, c) {
                    if !st.verified.contains_key(&k) {
                        missing += 1;
                    }
                }
            }
        }
        missing
    };
    if missing == 0 {
        return;
    }
    flush(inner).await;
    let recorded = match inner.catalog.chunks(live.id).await {
        Ok(r) => r,
        Err(e) => {
            warn!(transfer = %id, error = %e, "catalog: reading the chunks other opens recorded");
            return;
        }
    };
    let Ok(t) = live.table.read() else {
        return;
    };
    let mut st = crate::lock::lock(&live.st);
    let mut added = 0u64;
    for (k, h) in recorded {
        if let std::collections::hash_map::Entry::Vacant(e) = st.verified.entry(k) {
            if let Some((f, c)) = t.map.locate(k) {
                e.insert(h);
                added += t.map.span(f, c).1;
            }
        }
    }
    st.bytes_done += added;
    if added > 0 {
        debug!(transfer = %id, bytes = added, "chunks recorded by other opens of the transfer count at its commit");
    }
}

/// What [`open_transfer`] needs of the transfer's catalog row.
struct RowAtOpen {
    id: i64,
    state: TransferState,
    staging_path: String,
    local_path: String,
    /// A weights-first transfer's weights-only version row.
    weights_version: Option<i64>,
}

impl RowAtOpen {
    fn of(r: &ferry_catalog::Replica) -> RowAtOpen {
        RowAtOpen {
            id: r.id,
            state: r.state,
            staging_path: r.staging_path.clone(),
            local_path: r.local_path.clone(),
            weights_version: r.weights_version,
        }
    }
}

/// Longest time between two catalog copies of a growing file table.
const TABLE_SAVE_EVERY: Duration = Duration::from_secs(2);

/// Applies a [`Control::Files`] update to a live transfer: validates it,
/// checks the sink still has room for the larger checkpoint, records the
/// table in the catalog (so a restart resumes with it) and wakes data
/// streams waiting for the new entries.
async fn grow_table(
    inner: &Arc<Inner>,
    live: &Arc<Live>,
    files: &[FileInfo],
) -> Result<(), TransferError> {
    // The catalog copy of the table lets a restarted sink keep the chunks
    // it verified; it is rewritten at most every TABLE_SAVE_EVERY (a
    // checkpoint of 100,000 files grows by thousands of updates). Chunks
    // of files added since the last copy are asked for again after a
    // crash, nothing worse.
    let due = live
        .table_saved
        .lock()
        .map(|mut t| {
            let due = t.elapsed() >= TABLE_SAVE_EVERY;
            if due {
                *t = Instant::now();
            }
            due
        })
        .unwrap_or(true);
    let (snapshot, total, grown) = {
        let mut t = live
            .table
            .write()
            .map_err(|_| TransferError::Refused("file table lock poisoned".into()))?;
        let before = t.bytes_total;
        t.update(files, live.chunk_size)
            .map_err(|e| TransferError::Refused(format!("file table update: {e}")))?;
        (
            due.then(|| t.files.clone()),
            t.bytes_total,
            t.bytes_total.saturating_sub(before),
        )
    };
    if grown > 0 {
        let (r, store) = (inner.cfg.root.clone(), inner.store.clone());
        let avail = blocking(move || store.free_space(&r)).await?;
        let done = crate::lock::lock(&live.st).bytes_done;
        if let Some(needed) = decide::space_shortfall(total, done, avail, inner.cfg.reserve_bytes) {
            let pressure = lifecycle::make_room(inner, needed).await;
            let (r, store) = (inner.cfg.root.clone(), inner.store.clone());
            let avail = blocking(move || store.free_space(&r)).await?;
            if decide::space_shortfall(total, done, avail, inner.cfg.reserve_bytes).is_some() {
                return Err(TransferError::Refused(format!(
                    "not enough space at the sink: {} has {} bytes free (keeping {} in reserve), the checkpoint, now {total} bytes, needs {needed} more{}",
                    inner.cfg.root.display(),
                    avail.unwrap_or(0),
                    inner.cfg.reserve_bytes,
                    pressure.map_or(String::new(), |why| format!("; {why}"))
                )));
            }
        }
    }
    if let Some(files) = snapshot {
        inner
            .catalog
            .set_replica_files(live.id, &files, total)
            .await?;
    } else if !live
        .table_pending
        .swap(true, std::sync::atomic::Ordering::Relaxed)
    {
        // Not due yet: write the table as it will be then, so the last
        // update of a checkpoint that stops growing reaches the catalog
        // too (sizes shown by resolve and /v1/replicas).
        let (inner, live) = (inner.clone(), live.clone());
        tokio::spawn(async move {
            tokio::time::sleep(TABLE_SAVE_EVERY).await;
            live.table_pending
                .store(false, std::sync::atomic::Ordering::Relaxed);
            {
                let mut t = crate::lock::lock(&live.table_saved);
                *t = Instant::now();
            }
            let snap = live
                .table
                .read()
                .ok()
                .map(|t| (t.files.clone(), t.bytes_total));
            if let Some((files, total)) = snap {
                if let Err(e) = inner
                    .catalog
                    .set_replica_files(live.id, &files, total)
                    .await
                {
                    debug!(error = %e, "file table not recorded");
                }
            }
        });
    }
    live.table_changed.send_modify(|v| *v += 1);
    inner.changed.send_modify(|v| *v += 1);
    Ok(())
}

/// A re-save of a checkpoint that already has a published replica at the
/// same place: files whose path, size, mode and mtime are unchanged are
/// hard-linked from the published version into staging and their chunks
/// counted as verified with the hashes of the published manifest, so they
/// do not cross the WAN again. Should the content differ after all, the
/// sealed manifest's hashes will not match and the chunks are asked for
/// again. Returns `(global index, hash, bytes)` of the reused chunks.
async fn reuse_published(
    inner: &Inner,
    rows: &[ferry_catalog::Replica],
    local_path: &Path,
    files: &[FileInfo],
    chunk_size: u32,
    staging: &Path,
) -> Vec<(u64, Hash, u64)> {
    let lp = local_path.to_string_lossy();
    let Some(prev) = rows
        .iter()
        .find(|r| r.state == TransferState::Published && r.local_path == lp)
    else {
        return Vec::new();
    };
    let Ok(Some(bytes)) = inner.catalog.replica_manifest(prev.id).await else {
        return Vec::new();
    };
    let Ok(old) = Manifest::decode(&bytes) else {
        return Vec::new();
    };
    if old.chunk_size != chunk_size {
        return Vec::new();
    }
    let (files, staging, old_dir, store) = (
        files.to_vec(),
        staging.to_path_buf(),
        local_path.to_path_buf(),
        inner.store.clone(),
    );
    tokio::task::spawn_blocking(move || {
        let map = ChunkMap::new(&files, chunk_size);
        let by_path: HashMap<&str, &ferry_proto::manifest::FileEntry> =
            old.files.iter().map(|f| (f.path.as_str(), f)).collect();
        let unchanged: Vec<(usize, &ferry_proto::manifest::FileEntry)> = files
            .iter()
            .enumerate()
            .filter_map(|(fi, f)| {
                let e = by_path.get(f.path.as_str())?;
                ((e.size, e.mode, e.mtime_ns) == (f.size, f.mode, f.mtime_ns)).then_some((fi, *e))
            })
            .collect();
        // Several files at once: on HDFS each share is a copy inside the
        // cluster, on S3 a few requests; a file declined is sent again.
        let shared = Mutex::new(Vec::new());
        let _ = crate::storage::remote::for_each_parallel(
            crate::storage::remote::PUBLISH_THREADS,
            unchanged.len(),
            |i| {
                let (fi, e) = unchanged[i];
                if store.share_unchanged(&old_dir, &staging, &e.path).is_ok() {
                    crate::lock::lock(&shared).push((fi, e));
                }
                Ok(())
            },
        );
        let mut out = Vec::new();
        for (fi, e) in shared.into_inner().unwrap_or_else(|p| p.into_inner()) {
            for (ci, h) in e.chunks.iter().enumerate() {
                if let Some(g) = map.index(fi as u32, ci as u32) {
                    out.push((g, *h, map.span(fi as u32, ci as u32).1));
                }
            }
        }
        out.sort_unstable_by_key(|c| c.0);
        out
    })
    .await
    .unwrap_or_default()
}

/// Runs file-system work on the blocking pool, off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| io::Error::other(e.to_string()))?
}

fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// How long a data stream waits for its transfer's open.
const OPEN_WAIT: Duration = Duration::from_secs(10);

/// Transfers opened (or refused) by one source, by source transfer id;
/// shared by the source's connections.
#[derive(Default)]
struct Opened {
    live: Mutex<HashMap<TransferId, Arc<Live>>>,
    /// The control stream each transfer was opened on: its answers (need,
    /// cancel, published) go there, whichever connection its data came on.
    ctls: Mutex<HashMap<TransferId, Arc<ControlSender>>>,
    refused: Mutex<std::collections::HashSet<TransferId>>,
    changes: watch::Sender<u64>,
    /// Verified payload bytes from this connection's peer (metrics).
    received: prometheus_client::metrics::counter::Counter,
    /// Parts of striped transfers this source registered
    /// ([`Control::Part`]), with the epoch it registered each under.
    parts: Mutex<HashMap<TransferId, Vec<(ferry_catalog::PartRange, u64)>>>,
    /// Transfers whose open set [`Open::parts_first`]: every chunk of
    /// theirs from this source lies in a part it registers first.
    parts_first: Mutex<std::collections::HashSet<TransferId>>,
}

impl Opened {
    fn get(&self, id: TransferId) -> Option<Arc<Live>> {
        crate::lock::lock(&self.live).get(&id).cloned()
    }
    fn is_refused(&self, id: TransferId) -> bool {
        self.refused
            .lock()
            .map(|r| r.contains(&id))
            .unwrap_or(false)
    }
    fn ctl(&self, id: TransferId) -> Option<Arc<ControlSender>> {
        crate::lock::lock(&self.ctls).get(&id).cloned()
    }
    fn insert(&self, id: TransferId, live: Arc<Live>, ctl: Arc<ControlSender>, parts_first: bool) {
        {
            let mut m = crate::lock::lock(&self.parts_first);
            if parts_first {
                m.insert(id);
            } else {
                m.remove(&id);
            }
        }
        {
            let mut m = crate::lock::lock(&self.live);
            m.insert(id, live);
        }
        {
            let mut m = crate::lock::lock(&self.ctls);
            m.insert(id, ctl);
        }
        {
            let mut r = crate::lock::lock(&self.refused);
            r.remove(&id);
        }
        // A new open starts without the previous one's registrations.
        crate::lock::lock(&self.parts).remove(&id);
        self.changes.send_modify(|v| *v += 1);
    }
    fn refuse(&self, id: TransferId) {
        {
            let mut r = crate::lock::lock(&self.refused);
            r.insert(id);
        }
        self.changes.send_modify(|v| *v += 1);
    }
    /// Notes that this source registered part `range` of `id` under
    /// `epoch`.
    fn register_part(&self, id: TransferId, range: ferry_catalog::PartRange, epoch: u64) {
        let mut m = crate::lock::lock(&self.parts);
        let v = m.entry(id).or_default();
        v.retain(|(r, _)| r.part != range.part);
        v.push((range, epoch));
        drop(m);
        // Chunks that overtook the registration wait for it.
        self.changes.send_modify(|v| *v += 1);
    }

    /// Whether `id`'s open set [`Open::parts_first`].
    fn parts_first(&self, id: TransferId) -> bool {
        crate::lock::lock(&self.parts_first).contains(&id)
    }

    /// The parts of `id` this source registered, with their epochs.
    fn registered(&self, id: TransferId) -> Vec<(ferry_catalog::PartRange, u64)> {
        crate::lock::lock(&self.parts)
            .get(&id)
            .cloned()
            .unwrap_or_default()
    }

    fn remove(&self, id: TransferId) -> Option<Arc<Live>> {
        crate::lock::lock(&self.parts).remove(&id);
        crate::lock::lock(&self.parts_first).remove(&id);
        crate::lock::lock(&self.ctls).remove(&id);
        let live = crate::lock::lock(&self.live).remove(&id);
        // Chunks waiting for a registration of this transfer stop waiting.
        self.changes.send_modify(|v| *v += 1);
        live
    }
}

/// Largest group of records hashed and written in one blocking task, in
/// bytes.
const GROUP_BYTES: usize = 8 << 20;

/// Receives one batch (a data stream) of a transfer opened by this
/// connection's source (which speaks protocol `version`); answers go to
/// the control stream the transfer was opened on (`conn_ctl`, this
/// connection's, if it is unknown).
async fn receive_batch(
    inner: &Arc<Inner>,
    open: &Opened,
    conn_ctl: &Arc<ControlSender>,
    version: u16,
    mut s: RecvStream,
) -> Result<(), ConnError> {
    // While the catalog does not answer, batches are not read: what the
    // sources send waits in QUIC's receive windows, and flow control
    // slows them down.
    let mut recording = inner.recording.subscribe();
    if !*recording.borrow() {
        debug!("waiting for the catalog before reading a batch");
        tokio::select! {
            _ = recording.wait_for(|up| *up) => {}
            _ = inner.shutdown.cancelled() => return Ok(()),
        }
    }
    let header = read_batch_header(&mut s, version).await?;
    // A fresh transfer's data may overtake its open on the control stream:
    // wait for the open to be handled.
    let mut opened = open.changes.subscribe();
    let deadline = tokio::time::Instant::now() + OPEN_WAIT;
    let live = loop {
        if let Some(l) = open.get(header.transfer) {
            break l;
        }
        if open.is_refused(header.transfer) {
            let _ = s.stop(VarInt::from_u32(code::REFUSED));
            return Ok(());
        }
        if tokio::time::timeout_at(deadline, opened.changed())
            .await
            .is_err()
        {
            let _ = s.stop(VarInt::from_u32(code::UNKNOWN_TRANSFER));
            return Err(ConnError::Unexpected(format!(
                "data for transfer {} which was never opened",
                header.transfer
            )));
        }
    };
    let ctl = open
        .ctl(header.transfer)
        .unwrap_or_else(|| conn_ctl.clone());
    let ctl = &*ctl;
    if given_up(&live, header.seq) {
        let _ = s.stop(VarInt::from_u32(code::LOST_BATCH));
        return Ok(());
    }
    let mut ended = false;
    // A read that failed mid-batch (the source went away): the whole
    // records read before it are still written (and recorded, so that
    // whichever agent resumes the transfer need not send them again),
    // then the error is returned.
    let mut broken: Option<ConnError> = None;
    while !ended {
        // Records with the arrival of their first and last byte (Unix ms).
        let mut group: Vec<(RecordHeader, Vec<u8>, (i64, i64))> = Vec::new();
        let mut bytes = 0usize;
        while bytes < GROUP_BYTES && group.len() < 1024 {
            let mut rb = [0u8; RECORD_HEADER_LEN];
            match s.read_exact(&mut rb).await {
                Ok(()) => {}
                Err(quinn::ReadExactError::FinishedEarly(0)) => {
                    ended = true;
                    break;
                }
                Err(e) => {
                    broken = Some(e.into());
                    ended = true;
                    break;
                }
            }
            let first_byte = now_ms();
            let h = RecordHeader::decode(&rb)?;
            let fits = wait_for_table(&live, &h).await;
            let mut buf = inner.bufs.take(h.len as usize);
            if let Err(e) = crate::conn::read_into(&mut s, h.len as usize, &mut buf).await {
                inner.bufs.give(buf);
                broken = Some(e.into());
                ended = true;
                break;
            }
            if !fits {
                inner.bufs.give(buf);
                // Data of a file the source shrank or never announced (a
                // race with a file-table update, or a confused peer):
                // dropped unwritten; the commit asks for whatever is
                // missing.
                warn!(
                    transfer = %header.transfer,
                    "{h:?} lies outside the transfer's file table; dropped"
                );
                continue;
            }
            bytes += buf.len();
            group.push((h, buf, (first_byte, now_ms())));
        }
        // Chunks that overtook their part's registration wait for it here,
        // before the lock below: a cancel or publish must not queue behind
        // that wait.
        wait_for_parts(open, &live, header.transfer, &group).await;
        // Writes hold the read side of `writes`; publishing takes the write
        // side, so no chunk lands in staging once the replica is being
        // moved into place. Duplicates (a chunk asked for twice) and
        // anything arriving after the publish began are dropped unwritten.
        let guard = live.writes.clone().read_owned().await;
        {
            let st = crate::lock::lock(&live.st);
            if st.publishing || st.failed {
                group.clear();
            } else {
                let key = |h: &RecordHeader| u64::from(h.file) << 32 | u64::from(h.chunk);
                group.retain(|(h, _, _)| st.verified.get(&key(h)) != Some(&h.hash));
            }
        }
        if group.is_empty() {
            continue;
        }
        fence_parts(inner, open, &live, header.transfer, &mut group).await;
        if group.is_empty() {
            continue;
        }
        let arrived: HashMap<u64, (i64, i64)> = group
            .iter()
            .map(|(h, _, at)| (u64::from(h.file) << 32 | u64::from(h.chunk), *at))
            .collect();
        let group: Vec<(RecordHeader, Vec<u8>)> =
            group.into_iter().map(|(h, b, _)| (h, b)).collect();
        let l2 = live.clone();
        let bufs = inner.bufs.clone();
        let res = blocking(move || {
            let r = write_group(&l2, group, &bufs);
            drop(guard);
            r
        })
        .await;
        let (good, bad) = match res {
            Ok(r) => r,
            Err(e) => {
                let reason = format!("writing staging data under {}: {e}", live.staging.display());
                warn!(transfer = %header.transfer, "{reason}");
                cancel_live(inner, &live, TransferState::Failed, &reason).await;
                ctl.send(&Control::Cancel {
                    id: header.transfer,
                    reason,
                })
                .await?;
                return Ok(());
            }
        };
        {
            let mut st = crate::lock::lock(&live.st);
            for (g, h, len) in &good {
                // A chunk re-sent with new content (its file changed while
                // it was written) replaces the old hash; bytes count once.
                if st.verified.insert(*g, *h).is_none() {
                    st.bytes_done += len;
                }
            }
        }
        let verified: u64 = good.iter().map(|g| g.2).sum();
        open.received.inc_by(verified);
        inner.metrics.received_total.inc_by(verified);
        live.wrote(verified);
        for (g, h, len) in good {
            let c = VerifiedChunk {
                replica: live.id,
                key: g,
                hash: h,
                bytes: len,
                arrived_ms: arrived.get(&g).map(|a| a.1),
                arrival_started_ms: arrived.get(&g).map(|a| a.0),
            };
            if inner.chunks.send(CatalogOp::Chunk(c)).await.is_err() {
                // Only after shutdown: the chunk is verified again at
                // the next open.
                debug!("catalog writer stopped; a verified chunk goes unrecorded");
            }
        }
        inner.changed.send_modify(|v| *v += 1);
        if !bad.is_empty() {
            inner.metrics.verification_failures.inc_by(bad.len() as u64);
            warn!(
                transfer = %header.transfer,
                chunks = bad.len(),
                "chunks failed BLAKE3 verification; asking again"
            );
            ctl.send(&Control::Need {
                id: header.transfer,
                chunks: bad,
            })
            .await?;
        }
    }
    if let Some(e) = broken {
        return Err(e);
    }
    batch_in(inner, &live, ctl, header).await?;
    maybe_finish(inner, &live, ctl, header.transfer).await
}

/// Waits until every record of `group` lies in a part this connection's
/// source registered, when transfer `id` was opened with
/// [`Open::parts_first`]: each of its chunks lies in a part the sender
/// registers first, but a chunk may overtake the registration (it comes
/// on another QUIC stream). Returns at once for other transfers; else
/// after [`OPEN_WAIT`] at most, or as soon as this open (`live`) has
/// received the transfer's commit, failed or started publishing (each
/// bumps `live.state_changed`), or `live` is no longer this connection's
/// open of `id` (closed, or opened again). Another source agent's open
/// of the same transfer is another `live`: its commit does not end this
/// wait. [`fence_parts`] then drops what is still unregistered before the
/// commit. Holds no lock while it waits.
async fn wait_for_parts(
    open: &Opened,
    live: &Arc<Live>,
    id: TransferId,
    group: &[(RecordHeader, Vec<u8>, (i64, i64))],
) {
    if !open.parts_first(id) {
        return;
    }
    let key = |h: &RecordHeader| u64::from(h.file) << 32 | u64::from(h.chunk);
    let mut registered = open.changes.subscribe();
    let mut state = live.state_changed.subscribe();
    let deadline = tokio::time::Instant::now() + OPEN_WAIT;
    loop {
        {
            let st = crate::lock::lock(&live.st);
            if st.commit_at.is_some() || st.failed || st.publishing {
                return;
            }
        }
        if !open.get(id).is_some_and(|l| Arc::ptr_eq(&l, live)) {
            return;
        }
        let mine = open.registered(id);
        if group
            .iter()
            .all(|rec| mine.iter().any(|(r, _)| r.contains(key(&rec.0))))
        {
            return;
        }
        let changed = async {
            tokio::select! {
                r = registered.changed() => r.is_ok(),
                r = state.changed() => r.is_ok(),
            }
        };
        if !tokio::time::timeout_at(deadline, changed)
            .await
            .unwrap_or(false)
        {
            return;
        }
    }
}

/// Drops the records of `group` that belong to a part of striped
/// transfer `id` this connection's source registered under an epoch older
/// than the one the sink's catalog records now: the part was claimed
/// again, by another source agent, after this one (paused, or cut off
/// from its catalog) lost its lease. Nothing is read unless the source
/// registered parts of the transfer. If the catalog does not answer, the
/// registered parts' records are dropped (the commit asks for whatever is
/// missing). For a transfer opened with [`Open::parts_first`], records
/// outside every registered part are dropped too ([`wait_for_parts`]
/// gave their registration its time).
async fn fence_parts(
    inner: &Inner,
    open: &Opened,
    live: &Live,
    id: TransferId,
    group: &mut Vec<(RecordHeader, Vec<u8>, (i64, i64))>,
) {
    // After its commit, what the sender sends answers the sink's own
    // requests (checked against the sealed manifest): not fenced, or a
    // chunk of a part it sent under an older epoch, asked for again, would
    // be refused for ever.
    if crate::lock::lock(&live.st).commit_at.is_some() {
        return;
    }
    let key = |h: &RecordHeader| u64::from(h.file) << 32 | u64::from(h.chunk);
    let mine = open.registered(id);
    if open.parts_first(id) {
        let before = group.len();
        let (kept, unregistered): (Vec<_>, Vec<_>) = group
            .drain(..)
            .partition(|rec| mine.iter().any(|(r, _)| r.contains(key(&rec.0))));
        *group = kept;
        for rec in unregistered {
            inner.bufs.give(rec.1);
        }
        if group.len() < before {
            let dropped = before - group.len();
            inner.metrics.part_chunks_refused.inc_by(dropped as u64);
            warn!(
                transfer = %id,
                chunks = dropped,
                "dropped chunks whose part this source had not registered when their wait ended ({} s at most, less if the transfer failed or was opened again; the commit asks for them again)",
                OPEN_WAIT.as_secs()
            );
        }
    }
    if mine.is_empty() {
        return;
    }
    // Only the parts this group's chunks fall in are read (a few rows by
    // primary key): a transfer of the seed's size has thousands of parts.
    let mut touched: Vec<u64> = group
        .iter()
        .filter_map(|rec| {
            let k = key(&rec.0);
            mine.iter()
                .find(|(r, _)| r.contains(k))
                .map(|(r, _)| r.part)
        })
        .collect();
    touched.sort_unstable();
    touched.dedup();
    if touched.is_empty() {
        return;
    }
    let at_sink = match inner.catalog.part_epochs(live.id, Some(&touched)).await {
        Ok(e) => e,
        Err(e) => {
            warn!(transfer = %id, error = %e, "catalog: reading the parts' epochs; dropping this source's chunks of its parts");
            Vec::new()
        }
    };
    let before = group.len();
    let mut stale = None;
    let mut kept = Vec::with_capacity(group.len());
    for rec in group.drain(..) {
        let k = key(&rec.0);
        let Some((r, epoch)) = mine.iter().find(|(r, _)| r.contains(k)) else {
            kept.push(rec);
            continue;
        };
        let now = at_sink
            .iter()
            .find(|e| e.range.part == r.part)
            .map(|e| e.epoch);
        if now == Some(*epoch) {
            kept.push(rec);
        } else {
            stale = Some((r.part, *epoch, now));
            inner.bufs.give(rec.1);
        }
    }
    *group = kept;
    if let Some((part, epoch, now)) = stale {
        let refused = before - group.len();
        inner.metrics.part_chunks_refused.inc_by(refused as u64);
        warn!(
            transfer = %id,
            part,
            epoch,
            recorded = ?now,
            chunks = refused,
            "refused chunks of a part claimed again since this source registered it (an older epoch)"
        );
    }
}

/// Reads a data stream's batch header, of the length protocol `version`
/// gives it.
async fn read_batch_header(s: &mut RecvStream, version: u16) -> Result<BatchHeader, ConnError> {
    let mut hb = [0u8; ferry_proto::wire::BATCH_HEADER_V4_LEN];
    let hb = &mut hb[..BatchHeader::len_for(version)];
    s.read_exact(hb).await?;
    Ok(BatchHeader::decode(hb)?)
}

/// True for a batch the source gave up (its commit, already here, lists
/// it as lost): not read, since nothing waits for it.
fn given_up(live: &Live, seq: Option<u64>) -> bool {
    seq.is_some_and(|q| crate::lock::lock(&live.st).lost.contains(&q))
}

/// Counts batch `header` of `live` as arrived whole and, from a version 4
/// source (its batches carry a sequence number), confirms it on `ctl`,
/// together with any others finishing meanwhile. A numbered batch counts
/// once its confirmation is sent, so the confirmation precedes any answer
/// to the commit; it is confirmed once its verified chunks are recorded
/// in the catalog (which waits while the catalog does not answer).
async fn batch_in(
    inner: &Inner,
    live: &Live,
    ctl: &ControlSender,
    header: BatchHeader,
) -> Result<(), ConnError> {
    let Some(seq) = header.seq else {
        crate::lock::lock(&live.st).batches_in.counted += 1;
        return Ok(());
    };
    crate::lock::lock(&live.st).unconfirmed.push(seq);
    let _one_at_a_time = live.confirming.lock().await;
    // Every chunk queued so far (this batch's included) recorded: one
    // catalog transaction confirms the batches finishing meanwhile.
    flush(inner).await;
    let seqs = std::mem::take(&mut crate::lock::lock(&live.st).unconfirmed);
    if seqs.is_empty() {
        // Sent and counted by the confirmation that held the lock before.
        return Ok(());
    }
    ctl.send(&Control::BatchDone {
        id: header.transfer,
        seqs: seqs.clone(),
    })
    .await?;
    crate::lock::lock(&live.st).batches_in.seqs.extend(seqs);
    Ok(())
}

type GroupResult = (Vec<(u64, Hash, u64)>, Vec<u64>);

/// Hashes each record, writes the good ones into staging and returns
/// `(verified (index, hash, bytes), failed indices)`.
fn write_group(
    live: &Live,
    group: Vec<(RecordHeader, Vec<u8>)>,
    bufs: &BufPool,
) -> io::Result<GroupResult> {
    let mut good = Vec::with_capacity(group.len());
    let mut bad = Vec::new();
    let mut staging = live.store.staging(&live.staging);
    for (h, buf) in group {
        let (h, buf) = (h, Returned { buf, pool: bufs });
        let (g, rel) = {
            let t = live
                .table
                .read()
                .map_err(|_| io::Error::other("file table lock poisoned"))?;
            let Some(g) = t.map.index(h.file, h.chunk) else {
                continue;
            };
            (g, t.files[h.file as usize].path.clone())
        };
        let hash = *blake3::hash(&buf).as_bytes();
        if hash != h.hash {
            bad.push(g);
            continue;
        }
        staging.stage_chunk(&rel, u64::from(h.chunk) * u64::from(live.chunk_size), &buf)?;
        good.push((g, hash, buf.len() as u64));
    }
    staging.finish()?;
    Ok((good, bad))
}

/// A chunk buffer that goes back to its pool however [`write_group`]
/// leaves it (written, refused, or an I/O error).
struct Returned<'a> {
    buf: Vec<u8>,
    pool: &'a BufPool,
}

impl std::ops::Deref for Returned<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Returned<'_> {
    fn drop(&mut self) {
        self.pool.give(std::mem::take(&mut self.buf));
    }
}

/// Waits (at most [`OPEN_WAIT`]) until the file table holds the record's
/// file and chunk: a file-table update on the control stream can be
/// overtaken by the data that needs it. False if it never does.
async fn wait_for_table(live: &Live, h: &RecordHeader) -> bool {
    let fits = || live.table.read().map(|t| t.fits(h)).unwrap_or(false);
    if fits() {
        return true;
    }
    let mut changed = live.table_changed.subscribe();
    let deadline = tokio::time::Instant::now() + OPEN_WAIT;
    loop {
        if fits() {
            return true;
        }
        if tokio::time::timeout_at(deadline, changed.changed())
            .await
            .is_err()
        {
            return fits();
        }
    }
}

async fn cancel_live(inner: &Arc<Inner>, live: &Arc<Live>, new_state: TransferState, reason: &str) {
    let keep_staging = live.store.publish_under_way(&live.staging);
    {
        let mut st = crate::lock::lock(&live.st);
        if st.publishing {
            // Too late: every chunk matched and the replica is being
            // moved into place; the source hears it was published.
            info!(
                transfer = live.id,
                reason, "stop arrived during publish; publishing anyway"
            );
            return;
        }
        st.failed = true;
    }
    live.state_changed.send_modify(|v| *v += 1);
    {
        // Only this open's entry: a joining open's cancel leaves the
        // coordinator's.
        let mut m = crate::lock::lock(&inner.live);
        if m.get(&live.id).is_some_and(|l| Arc::ptr_eq(l, live)) {
            m.remove(&live.id);
        }
    }
    if let Err(e) = inner
        .catalog
        .set_replica_state(live.id, new_state, Some(reason))
        .await
    {
        warn!(error = %e, "could not record transfer state");
    }
    if let Some(w) = &live.weights {
        let why = format!("its transfer ended: {reason}");
        weights_version_unused(inner, w, &why).await;
    }
    // Group writes in flight hold the read side: once they are done, no
    // writer recreates the directory (they see `failed` and write nothing).
    let _writes = live.writes.clone().write_owned().await;
    let staging = live.staging.clone();
    if keep_staging {
        // After an exchange, staging may hold the previous published
        // version: never delete what cannot be told apart.
        warn!(
            transfer = live.id,
            staging = %staging.display(),
            "a publish of this transfer was under way; keeping its staging directory and held markers for inspection"
        );
    } else {
        let store = live.store.clone();
        if let Err(e) = blocking(move || store.discard(&staging)).await {
            warn!(transfer = live.id, error = %e, "removing the staging area");
        }
    }
    inner.changed.send_modify(|v| *v += 1);
}

/// After a commit and all its batches: publish if every chunk matches the
/// sealed manifest, else ask for what is missing or wrong.
async fn maybe_finish(
    inner: &Arc<Inner>,
    live: &Arc<Live>,
    ctl: &ControlSender,
    id: TransferId,
) -> Result<(), ConnError> {
    enum Next {
        Need(Vec<u64>, u64),
        Mismatch(String),
        Publish(
            Manifest,
            (SourceTimes, CheckpointMeta),
            Vec<(u64, Hash)>,
            PhaseMarks,
        ),
    }
    maybe_publish_weights(inner, live, ctl, id).await?;
    absorb_recorded(inner, live, id).await;
    let next = {
        let mut st = crate::lock::lock(&live.st);
        let announced = st.commit.as_ref().map(|(_, batches)| *batches);
        if !decide::commit_ready(
            announced,
            &st.lost,
            &st.batches_in,
            st.publishing || st.weights_publishing,
            st.failed,
        ) {
            return Ok(());
        }
        let Some((manifest, _)) = st.commit.take() else {
            return Ok(());
        };
        match seal_table(live, &manifest) {
            Err(why) => Next::Mismatch(why),
            Ok(keys) => match decide::commit_verdict(&keys, &st.verified) {
                decide::CommitVerdict::Publish => {
                    st.publishing = true;
                    let marks = PhaseMarks {
                        commit_at: st.commit_at,
                        ready_at: Instant::now(),
                        source: std::mem::take(&mut st.source_phases),
                        answer: st.answer_phases,
                    };
                    Next::Publish(manifest, (st.times, st.meta), keys, marks)
                }
                decide::CommitVerdict::Need { keys: need, wrong } => {
                    // Verified against the hash sent with it, but not the
                    // sealed manifest's.
                    inner.metrics.verification_failures.inc_by(wrong);
                    // Drop wrong hashes so that the re-sent chunk is counted.
                    forget_verified(live, &mut st, &need);
                    Next::Need(need, st.bytes_done)
                }
            },
        }
    };
    if matches!(next, Next::Publish(..)) {
        // Chunks still waiting for their part's registration are dropped
        // now (every chunk the manifest lists is here).
        live.state_changed.send_modify(|v| *v += 1);
    }
    match next {
        Next::Mismatch(reason) => {
            inner.metrics.verification_failures.inc();
            cancel_live(inner, live, TransferState::Failed, &reason).await;
            ctl.send(&Control::Cancel { id, reason }).await
        }
        Next::Need(need, done) => {
            flush(inner).await;
            if let Err(e) = inner.catalog.drop_chunks(live.id, &need, done).await {
                // The chunks stay recorded as verified; the commit's comparison
                // with the manifest and the read-back before publish still catch
                // them, so the transfer goes on.
                warn!(transfer = %id, error = %e, "forgetting chunks to fetch again");
            }
            info!(
                transfer = %id,
                chunks = need.len(),
                "chunks missing or wrong at commit; asking again"
            );
            ctl.send(&Control::Need { id, chunks: need }).await
        }
        Next::Publish(manifest, _, _, _) if live.published_root == Some(manifest.root()) => {
            ctl.send(&Control::Published {
                id,
                local_path: inner.shown(&live.local_path, live.id),
                root: manifest.root(),
                phases: Phases::default(),
            })
            .await
        }
        Next::Publish(manifest, (times, meta), keys, marks) => {
            let t_publish = Instant::now();
            // One publish at a time per local path: two transfers moving
            // versions into the same place must not interleave their steps
            // (in a pool, whichever sink agent they reached).
            let mut path_lock =
                match publish_lease::lock_publish(inner, &live.local_path, live.id).await {
                    Ok(g) => g,
                    Err(why) => {
                        crate::lock::lock(&live.st).publishing = false;
                        return Err(ConnError::Local(why));
                    }
                };
            // Wait for chunk writes in flight; later ones see `publishing`.
            let exclusive = live.writes.clone().write_owned().await;
            flush(inner).await;
            let root_hex = hex(&manifest.root());
            let (l2, m2) = (live.clone(), manifest.clone());
            let reread = inner.cfg.reread_before_publish;
            let readers = meta.readers;
            let version = version_dir(&inner.cfg.root, live.id);
            let (store, lp) = (live.store.clone(), live.local_path.clone());
            if blocking(move || store.exists(&lp)).await.unwrap_or(false) {
                // A version is replaced: it goes once no lease holds it.
                inner
                    .sweep_wanted
                    .store(true, std::sync::atomic::Ordering::Relaxed);
            }
            let res = blocking(move || {
                l2.store.publish(
                    &l2.staging,
                    &l2.local_path,
                    &version,
                    &m2,
                    reread.then_some(&keys[..]),
                    readers,
                )
            })
            .await;
            let mut reread_ms = None;
            let mut reread_wall = Duration::ZERO;
            let mut reread_cpu_ms = None;
            let mut hot_raised = None;
            let bad = match res {
                Ok(PublishOutcome::Published { reread, hot }) => {
                    hot_raised = hot;
                    if let Some(r) = reread {
                        reread_wall = r.wall;
                        reread_ms = Some(r.wall.as_millis() as u64);
                        reread_cpu_ms = Some(r.cpu.as_millis() as u64);
                        inner.metrics.note_read_back(r);
                    }
                    None
                }
                Ok(PublishOutcome::Recovered) => {
                    warn!(
                        transfer = %id,
                        path = %live.local_path.display(),
                        "finished a publish that a crash had interrupted"
                    );
                    None
                }
                Ok(PublishOutcome::Refetch(bad)) => Some(bad),
                Err(e) if !path_lock.held() => {
                    // Paused or cut off past the lease: another sink agent
                    // may have finished this publish (and this one failed
                    // on what it moved); the catalog is that agent's to
                    // write, so nothing is recorded here.
                    warn!(transfer = %id, error = %e, path = %live.local_path.display(), "publish failed after this sink agent's publish lease lapsed; leaving the transfer to the sink agent that took the lease");
                    drop(exclusive);
                    crate::lock::lock(&live.st).publishing = false;
                    crate::lock::lock(&inner.live).remove(&live.id);
                    return Err(ConnError::Local(format!(
                        "the publish lease on {} lapsed during the publish",
                        live.local_path.display()
                    )));
                }
                Err(e) => {
                    let reason = format!("publishing {}: {e}", live.local_path.display());
                    warn!(transfer = %id, "{reason}");
                    drop(exclusive);
                    // Not published: let the cancel below record the failure
                    // (it leaves a transfer that is publishing alone).
                    {
                        let mut st = crate::lock::lock(&live.st);
                        st.publishing = false;
                    }
                    cancel_live(inner, live, TransferState::Failed, &reason).await;
                    return ctl.send(&Control::Cancel { id, reason }).await;
                }
            };
            if let Some(bad) = bad {
                drop(exclusive);
                return refetch_changed(inner, live, ctl, id, bad).await;
            }
            crate::storage::posix::publish::fault_point("on-disk");
            let siblings = live
                .st
                .lock()
                .map(|mut st| std::mem::take(&mut st.siblings))
                .unwrap_or_default();
            if !siblings.is_empty() {
                let l2 = live.clone();
                if let Err(e) =
                    blocking(move || write_siblings(&*l2.store, &l2.local_path, &siblings)).await
                {
                    warn!(transfer = %id, error = %e, "could not write the markers beside the replica");
                }
            }
            let local = live.local_path.to_string_lossy().into_owned();
            inner.metrics.published.inc();
            // Recorded by the catalog writer, in one transaction with the
            // other publishes and chunks that arrive meanwhile.
            let (tx, rx) = oneshot::channel();
            // The sink's phases until now; the record adds its own time to
            // `publishing` (in the publish's transaction).
            let measured_to = Instant::now();
            let at_sink = marks.at_sink(t_publish, reread_wall, measured_to);
            let mut all = marks.source.clone();
            all.merge(&at_sink);
            let rec = PublishedReplica {
                id: live.id,
                manifest: manifest.encode(),
                root_hex: root_hex.clone(),
                local_path: local.clone(),
                bytes: manifest.bytes(),
                times,
                meta,
                phases: Some((all.clone(), measured_to)),
            };
            if !path_lock.keep(inner).await {
                // Paused past the lease (or cut off from the catalog), and
                // another sink agent holds it now: that one finishes this
                // publish and records it.
                warn!(transfer = %id, path = %live.local_path.display(), "this sink agent's publish lease lapsed and another sink agent holds it; leaving the publish to that one");
                drop(exclusive);
                crate::lock::lock(&live.st).publishing = false;
                crate::lock::lock(&inner.live).remove(&live.id);
                return Err(ConnError::Local(format!(
                    "the publish lease on {} passed to another sink agent",
                    live.local_path.display()
                )));
            }
            let recorded = match inner.chunks.send(CatalogOp::Publish(rec, tx)).await {
                Ok(()) => rx
                    .await
                    .unwrap_or_else(|_| Err("the catalog writer stopped".into())),
                Err(_) => Err("the catalog writer stopped".into()),
            };
            match recorded {
                Ok(recorded) => {
                    let class = meta.class.map_or("unknown", |c| c.as_str());
                    if let Some(lag_s) = recorded {
                        inner.metrics.observe_lag(lag_s, class);
                    }
                    // Under weights-first the weights-only version was
                    // eval-ready, and its phases were observed.
                    let weights_published = crate::lock::lock(&live.st).weights_published;
                    if weights_published.is_none() {
                        inner.metrics.observe_phases(&all, class);
                    }
                    if let (Some(w), None) = (&live.weights, weights_published) {
                        weights_version_unused(inner, w, "the full replica was published first")
                            .await;
                    }
                    // A re-save of a pinned checkpoint stays pinned (before
                    // the policies weigh it).
                    if let Some(h) = hot_raised {
                        note_hot(inner, live.id, h).await;
                    }
                    match inner.catalog.carry_pin(live.id, &local, now_ms()).await {
                        Ok(true) => {
                            info!(transfer = %id, replica = live.id, "the version this re-save replaced was pinned: so is this one")
                        }
                        Ok(false) => {}
                        Err(e) => {
                            warn!(transfer = %id, error = %e, "carrying the replaced version's pin over")
                        }
                    }
                    let (staging, store) = (live.staging.clone(), live.store.clone());
                    if let Err(e) = blocking(move || store.publish_recorded(&staging)).await {
                        warn!(transfer = %id, error = %e, "could not remove the held-markers directory of a finished publish");
                    }
                }
                Err(e) => {
                    // The held markers stay: the publish counts as under
                    // way, and is finished again when the source retries.
                    warn!(error = %e, "replica published on disk but the catalog could not record it")
                }
            }
            drop(path_lock);
            {
                let mut m = crate::lock::lock(&inner.live);
                m.remove(&live.id);
            }
            inner.changed.send_modify(|v| *v += 1);
            // The retention policies run at each publish, and the version
            // this one replaced goes unless a lease holds it.
            inner.retention_wake.notify_one();
            info!(transfer = %id, path = %local, root = %root_hex, publish_ms = t_publish.elapsed().as_millis() as u64, reread_ms, reread_cpu_ms, "replica published");
            ctl.send(&Control::Published {
                id,
                local_path: inner.shown(&live.local_path, live.id),
                root: manifest.root(),
                phases: if marks.answer {
                    at_sink
                } else {
                    Phases::default()
                },
            })
            .await
        }
    }
}

/// The staging area of a weights-first transfer's weights-only version,
/// beside the transfer's own `staging`.
fn weights_staging(staging: &Path) -> PathBuf {
    let mut name = staging.file_name().unwrap_or_default().to_os_string();
    name.push("-weights");
    staging.with_file_name(name)
}

/// A weights-only commit ([`Commit::weights_only`]) arrived: kept until
/// its batches are in and its chunks verified, then published
/// ([`maybe_publish_weights`]). Answered at once when the version is
/// published already (a source that restarted sends it again); ignored
/// for a transfer without a weights-only version (storage without
/// version directories, or the full replica was first).
async fn weights_commit(
    inner: &Arc<Inner>,
    live: &Arc<Live>,
    ctl: &ControlSender,
    id: TransferId,
    version: u16,
    commit: WeightsCommit,
    lost: Vec<u64>,
) -> Result<(), ConnError> {
    if live.weights.is_none() {
        debug!(transfer = %id, "weights-only commit for a transfer without a weights-only version: the full replica follows");
        return Ok(());
    }
    let published = {
        let mut st = crate::lock::lock(&live.st);
        if st.weights_published.is_none() {
            st.lost = lost.into_iter().collect();
            st.answer_phases = version >= ferry_proto::wire::PHASES_VERSION;
            st.weights_commit = Some(commit);
            None
        } else {
            st.weights_published
        }
    };
    match published {
        Some(root) => {
            ctl.send(&Control::Published {
                id,
                local_path: inner.shown(&live.local_path, live.id),
                root,
                phases: Phases::default(),
            })
            .await
        }
        None => maybe_finish(inner, live, ctl, id).await,
    }
}

/// Publishes a weights-first transfer's weights-only version once its
/// commit's batches are all in and every chunk of its manifest is
/// verified, while the rest of the transfer's chunks still arrive: its
/// files are hard-linked from the transfer's staging area into its own,
/// read back, moved into a version directory of its own and named by the
/// replica's path, exactly as a full publish ([`SinkStore::publish`]),
/// and recorded under its own row. The source hears a
/// [`Control::Published`] of the weights-only root. A chunk still missing
/// leaves it waiting (the full commit asks for what is missing); a
/// failure is logged and the full replica follows.
async fn maybe_publish_weights(
    inner: &Arc<Inner>,
    live: &Arc<Live>,
    ctl: &ControlSender,
    id: TransferId,
) -> Result<(), ConnError> {
    let Some(w) = live.weights.clone() else {
        return Ok(());
    };
    let (commit, keys, marks) = {
        let mut st = crate::lock::lock(&live.st);
        let Some(c) = st.weights_commit.as_ref() else {
            return Ok(());
        };
        if !decide::commit_ready(
            Some(c.batches),
            &st.lost,
            &st.batches_in,
            st.publishing || st.weights_publishing,
            st.failed,
        ) {
            return Ok(());
        }
        let keys = match seal_table(live, &c.manifest) {
            Ok(k) => k,
            Err(why) => {
                warn!(transfer = %id, "weights-only commit refused ({why}); the full replica follows");
                st.weights_commit = None;
                return Ok(());
            }
        };
        if decide::commit_verdict(&keys, &st.verified) != decide::CommitVerdict::Publish {
            return Ok(());
        }
        // The full commit ready too: the full replica alone.
        let full_batches = st.commit.as_ref().map(|(_, b)| *b);
        if decide::commit_ready(full_batches, &st.lost, &st.batches_in, false, false) {
            st.weights_commit = None;
            return Ok(());
        }
        let Some(c) = st.weights_commit.take() else {
            return Ok(());
        };
        st.weights_publishing = true;
        let marks = PhaseMarks {
            commit_at: Some(c.at),
            ready_at: Instant::now(),
            source: c.phases.clone(),
            answer: st.answer_phases,
        };
        (c, keys, marks)
    };
    let res = publish_weights(inner, live, &w, &commit, &keys, &marks).await;
    let answer = {
        let mut st = crate::lock::lock(&live.st);
        st.weights_publishing = false;
        match res {
            Ok(at_sink) => {
                st.weights_published = Some(commit.manifest.root());
                Some(at_sink)
            }
            Err(e) => {
                warn!(transfer = %id, replica = w.id, "weights-only version not published ({e}); the full replica follows");
                None
            }
        }
    };
    inner.changed.send_modify(|v| *v += 1);
    if let Some(at_sink) = answer {
        ctl.send(&Control::Published {
            id,
            local_path: inner.shown(&live.local_path, live.id),
            root: commit.manifest.root(),
            phases: if marks.answer {
                at_sink
            } else {
                Phases::default()
            },
        })
        .await?;
    }
    Ok(())
}

/// The weights-only publish of [`maybe_publish_weights`]; returns the
/// sink's phases of it.
async fn publish_weights(
    inner: &Arc<Inner>,
    live: &Arc<Live>,
    w: &WeightsVersion,
    c: &WeightsCommit,
    keys: &[(u64, Hash)],
    marks: &PhaseMarks,
) -> Result<Phases, String> {
    let t_publish = Instant::now();
    let m = &c.manifest;
    let mut path_lock = publish_lease::lock_publish(inner, &live.local_path, w.id).await?;
    {
        // No chunk write in flight while the links are made (a write
        // after copies first: the staging files are then shared).
        let _exclusive = live.writes.clone().write_owned().await;
        let (store, from, to, m2) = (
            live.store.clone(),
            live.staging.clone(),
            w.staging.clone(),
            m.clone(),
        );
        blocking(move || {
            // A publish a crash interrupted is finished by `publish`;
            // links a crash left half made are made again.
            if store.publish_under_way(&to) {
                return Ok(());
            }
            store.discard(&to)?;
            store.make_dir(&to)?;
            for f in &m2.files {
                store.link_staged(&from, &to, f)?;
            }
            Ok(())
        })
        .await
        .map_err(|e| format!("linking the weight files into {}: {e}", w.staging.display()))?;
    }
    let (store, lp) = (live.store.clone(), live.local_path.clone());
    if blocking(move || store.exists(&lp)).await.unwrap_or(false) {
        // A version is replaced: it goes once no lease holds it.
        inner
            .sweep_wanted
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }
    let version = version_dir(&inner.cfg.root, w.id);
    let (store, staging, lp, m2) = (
        live.store.clone(),
        w.staging.clone(),
        live.local_path.clone(),
        m.clone(),
    );
    let reread = inner.cfg.reread_before_publish.then(|| keys.to_vec());
    let readers = c.meta.readers;
    let out =
        blocking(move || store.publish(&staging, &lp, &version, &m2, reread.as_deref(), readers))
            .await
            .map_err(|e| format!("publishing {}: {e}", live.local_path.display()))?;
    let mut reread_wall = Duration::ZERO;
    match out {
        PublishOutcome::Published { reread, .. } => {
            if let Some(r) = reread {
                reread_wall = r.wall;
                inner.metrics.note_read_back(r);
            }
        }
        PublishOutcome::Recovered => {}
        PublishOutcome::Refetch(bad) => {
            let (store, staging) = (live.store.clone(), w.staging.clone());
            let _ = blocking(move || store.discard(&staging)).await;
            return Err(format!(
                "{} staged chunks changed on disk after they were verified",
                bad.len()
            ));
        }
    }
    if !c.siblings.is_empty() {
        let (l2, siblings) = (live.clone(), c.siblings.clone());
        if let Err(e) =
            blocking(move || write_siblings(&*l2.store, &l2.local_path, &siblings)).await
        {
            warn!(replica = w.id, error = %e, "could not write the markers beside the replica");
        }
    }
    let measured_to = Instant::now();
    let at_sink = marks.at_sink(t_publish, reread_wall, measured_to);
    let mut all = marks.source.clone();
    all.merge(&at_sink);
    let local = live.local_path.to_string_lossy().into_owned();
    let files: Vec<FileInfo> = m
        .files
        .iter()
        .map(|f| FileInfo {
            path: f.path.clone(),
            size: f.size,
            mode: f.mode,
            mtime_ns: f.mtime_ns,
        })
        .collect();
    if let Err(e) = inner
        .catalog
        .set_replica_files(w.id, &files, m.bytes())
        .await
    {
        warn!(replica = w.id, error = %e, "catalog: recording the weights-only version's files");
    }
    let rec = PublishedReplica {
        id: w.id,
        manifest: m.encode(),
        root_hex: hex(&m.root()),
        local_path: local.clone(),
        bytes: m.bytes(),
        times: c.times,
        meta: c.meta,
        phases: Some((all.clone(), measured_to)),
    };
    if !path_lock.keep(inner).await {
        return Err(format!(
            "the publish lease on {} passed to another sink agent; the weights-only version is left to it",
            live.local_path.display()
        ));
    }
    let (tx, rx) = oneshot::channel();
    let recorded = match inner.chunks.send(CatalogOp::Publish(rec, tx)).await {
        Ok(()) => rx
            .await
            .unwrap_or_else(|_| Err("the catalog writer stopped".into())),
        Err(_) => Err("the catalog writer stopped".into()),
    };
    drop(path_lock);
    let lag = recorded.map_err(|e| {
        format!("the weights-only version is in place but the catalog could not record it: {e}")
    })?;
    let class = c.meta.class.map_or("unknown", |c| c.as_str());
    if let Some(lag_s) = lag {
        inner.metrics.observe_lag(lag_s, class);
    }
    inner.metrics.observe_phases(&all, class);
    inner.metrics.published.inc();
    let (store, staging) = (live.store.clone(), w.staging.clone());
    if let Err(e) = blocking(move || store.publish_recorded(&staging)).await {
        warn!(replica = w.id, error = %e, "could not remove the held-markers directory of a finished publish");
    }
    inner.retention_wake.notify_one();
    info!(
        replica = w.id,
        path = %local,
        files = m.files.len(),
        bytes = m.bytes(),
        publish_ms = t_publish.elapsed().as_millis() as u64,
        "weights-only version published; the optimizer state follows"
    );
    Ok(at_sink)
}

/// The full replica of a weights-first transfer was published before its
/// weights-only version (the weights-only commit came late, or its chunks
/// were not all verified): that version's row is cancelled, saying so,
/// and its staging area removed.
async fn weights_version_unused(inner: &Inner, w: &WeightsVersion, why: &str) {
    match inner.catalog.cancel_queued_replica(w.id, why).await {
        // Published meanwhile (by another run of the transfer): it stays.
        Ok(false) => return,
        Ok(true) => {}
        Err(e) => {
            warn!(replica = w.id, error = %e, "catalog: cancelling an unused weights-only version");
            return;
        }
    }
    let (store, staging) = (inner.store.clone(), w.staging.clone());
    if !blocking({
        let (store, staging) = (store.clone(), staging.clone());
        move || Ok(store.publish_under_way(&staging))
    })
    .await
    .unwrap_or(true)
    {
        if let Err(e) = blocking(move || store.discard(&staging)).await {
            warn!(replica = w.id, error = %e, "removing an unused weights-only staging area");
        }
    }
}

/// What a publish needs to say where its time went: when the latest
/// commit arrived, when every batch was in and the publish decided, and
/// the source's phases until its commit went.
struct PhaseMarks {
    commit_at: Option<Instant>,
    ready_at: Instant,
    source: Phases,
    /// The source takes the sink's phases back (protocol version 7).
    answer: bool,
}

impl PhaseMarks {
    /// The sink's phases after the commit arrived: the last batches
    /// (sending) until `ready_at`; verifying, from there until the
    /// publish began (`started`) plus the read-back of staging
    /// (`reread`); publishing, the rest until `recorded` (the path's
    /// publish lock, the writes in flight, moving into place, syncing and
    /// the catalog record).
    fn at_sink(&self, started: Instant, reread: Duration, recorded: Instant) -> Phases {
        use ferry_proto::phases::Phase;
        let mut p = Phases::default();
        if let Some(c) = self.commit_at {
            p.add(
                true,
                Phase::Sending,
                self.ready_at.saturating_duration_since(c),
            );
        }
        let total = recorded.saturating_duration_since(self.ready_at);
        let verifying = (started.saturating_duration_since(self.ready_at) + reread).min(total);
        p.add(true, Phase::Verifying, verifying);
        p.add(true, Phase::Publishing, total - verifying);
        p
    }
}

/// Records that replica `id`'s hot files were given `h.factor` replicas,
/// until the hint's TTL ends ([`lower_hot_files`] sets them back).
async fn note_hot(inner: &Inner, id: i64, h: crate::storage::HotRaised) {
    let ttl = inner.cfg.storage.hot().map_or(Duration::ZERO, |h| h.ttl);
    let until = now_ms().saturating_add(i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX));
    match inner
        .catalog
        .set_replica_hot(id, i64::from(h.factor), i64::from(h.previous), until)
        .await
    {
        Ok(()) => {
            let placed = match h.placed {
                Some(n) if n >= h.factor => format!("all {n} replicas were placed before the publish"),
                Some(n) => format!(
                    "the publish went ahead after [sink.hdfs] hot_wait with {n} of {} replicas placed; \
                     HDFS places the rest in the background",
                    h.factor
                ),
                None if inner.cfg.storage.hot().is_some_and(|x| x.waits()) => {
                    "no placement was seen (files without blocks, or WebHDFS did not answer: see any \
                 warning before)"
                    .to_string()
                }
                None => "HDFS places the extra replicas in the background; set [sink.hdfs] webhdfs \
                         for the publish to wait for them"
                    .to_string(),
            };
            info!(
                replica = id,
                files = h.files,
                factor = h.factor,
                previous = h.previous,
                placed = h.placed,
                until = %rfc3339(until),
                "raised the replication of the replica's hot files before its publish: {placed}"
            )
        }
        Err(e) => warn!(replica = id, error = %e, "recording the hot files' replication hint"),
    }
}

/// Sets the hot files of replicas whose hint has ended back to the
/// replication they were written with (a replica a re-save replaced, or
/// no longer published, only has its hint cleared: its files are gone
/// or are the newer version's), every `every` until the sink stops.
async fn lower_hot_files(inner: Arc<Inner>, every: Duration) {
    loop {
        tokio::select! {
            _ = inner.shutdown.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        let ended = match inner.catalog.replicas_hot_ended(now_ms()).await {
            Ok(r) => r,
            Err(e) => {
                warn!(error = %e, "listing the replicas whose hot-file hint ended");
                continue;
            }
        };
        for r in ended {
            let current = r.state == TransferState::Published
                && inner
                    .catalog
                    .replica_versions_at(&r.local_path)
                    .await
                    .map(|v| !v.iter().any(|(id, _)| *id > r.id))
                    .unwrap_or(false);
            if let (true, Some(h)) = (current, r.hot) {
                let manifest = match inner.catalog.replica_manifest(r.id).await {
                    Ok(Some(b)) => Manifest::decode(&b).ok(),
                    _ => None,
                };
                let Some(m) = manifest else {
                    warn!(
                        replica = r.id,
                        "no manifest recorded: its hot files keep their replication"
                    );
                    let _ = inner.catalog.clear_replica_hot(r.id).await;
                    continue;
                };
                let previous = u16::try_from(h.previous).unwrap_or(3);
                let (store, path) = (inner.store.clone(), PathBuf::from(&r.local_path));
                match blocking(move || store.lower_hot(&path, &m, previous)).await {
                    Ok(n) => info!(
                        replica = r.id,
                        files = n,
                        factor = previous,
                        "the hot-file hint ended: replication set back"
                    ),
                    Err(e) => {
                        warn!(replica = r.id, error = %e, "setting hot files' replication back; trying again later");
                        continue;
                    }
                }
            }
            if let Err(e) = inner.catalog.clear_replica_hot(r.id).await {
                warn!(replica = r.id, error = %e, "clearing a hot-file hint");
            }
            inner.changed.send_modify(|v| *v += 1);
        }
    }
}

/// The step and class of a version 3 commit, typed; a class name this sink
/// does not know is logged and left unknown.
fn checkpoint_meta(
    id: TransferId,
    info: Option<ferry_proto::wire::CheckpointInfo>,
) -> CheckpointMeta {
    let Some(info) = info else {
        return CheckpointMeta::default();
    };
    let class = match info.class.as_str() {
        "" => None,
        name => match name.parse::<scheduler::Class>() {
            Ok(c) => Some(c),
            Err(e) => {
                warn!(transfer = %id, "commit names {e}; stored without a class");
                None
            }
        },
    };
    CheckpointMeta {
        step: info.step,
        class,
        readers: info.readers,
    }
}

/// Forgets that the chunks `keys` were verified, taking their bytes off
/// the transfer's verified total, so that their next arrival counts.
fn forget_verified(live: &Live, st: &mut LiveState, keys: &[u64]) {
    let mut dropped = 0;
    if let Ok(t) = live.table.read() {
        for k in keys {
            if st.verified.remove(k).is_some() {
                if let Some((f, c)) = t.map.locate(*k) {
                    dropped += t.map.span(f, c).1;
                }
            }
        }
    }
    st.bytes_done -= dropped.min(st.bytes_done);
}

/// Publish attempts that may find staged chunks changed on disk before
/// the transfer fails: bytes that keep changing after they were verified
/// point at a failing disk or another writer in the sink root.
const MAX_CHANGED_ON_DISK: u32 = 3;

/// The publish step found chunks in staging that no longer match the
/// manifest: counts them as verification failures, forgets them (in memory
/// and in the catalog) and asks the source for them again, or fails the
/// transfer after [`MAX_CHANGED_ON_DISK`] such attempts.
async fn refetch_changed(
    inner: &Arc<Inner>,
    live: &Arc<Live>,
    ctl: &ControlSender,
    id: TransferId,
    bad: Vec<u64>,
) -> Result<(), ConnError> {
    inner.metrics.verification_failures.inc_by(bad.len() as u64);
    let (attempts, done) = {
        let mut st = crate::lock::lock(&live.st);
        st.publishing = false;
        st.changed_on_disk += 1;
        forget_verified(live, &mut st, &bad);
        (st.changed_on_disk, st.bytes_done)
    };
    if attempts > MAX_CHANGED_ON_DISK {
        let reason = format!(
            "staged chunks of {} changed on disk after they were verified, {attempts} times; \
             is the sink's disk failing, or does something else write under {}?",
            live.local_path.display(),
            inner.cfg.root.display()
        );
        warn!(transfer = %id, "{reason}");
        cancel_live(inner, live, TransferState::Failed, &reason).await;
        return ctl.send(&Control::Cancel { id, reason }).await;
    }
    if let Err(e) = inner.catalog.drop_chunks(live.id, &bad, done).await {
        // The chunks stay recorded as verified; the commit's comparison
        // with the manifest and the read-back before publish still catch
        // them, so the transfer goes on.
        warn!(transfer = %id, error = %e, "forgetting chunks to fetch again");
    }
    warn!(
        transfer = %id,
        chunks = bad.len(),
        "staged chunks no longer match the manifest (changed on disk since they were verified); asking for them again"
    );
    inner.changed.send_modify(|v| *v += 1);
    ctl.send(&Control::Need { id, chunks: bad }).await
}

/// Matches a sealed manifest to the transfer's file table by path, sets
/// each listed file's final size, and returns every chunk key of the
/// manifest with its expected hash. Errors name a file the source never
/// announced or a chunk size that differs.
fn seal_table(live: &Live, m: &Manifest) -> Result<Vec<(u64, Hash)>, String> {
    let mut t = live
        .table
        .write()
        .map_err(|_| "file table lock poisoned".to_string())?;
    decide::seal(&mut t, live.chunk_size, m)
}

/// Writes the markers that live beside a checkpoint directory (DeepSpeed
/// `latest`, Megatron's tracker) next to its replica, now that the replica
/// is in place: each through a temporary file and a rename, and never
/// moving a marker back to an older step than the one already there.
fn write_siblings(
    store: &dyn SinkStore,
    replica: &Path,
    siblings: &[(String, Vec<u8>)],
) -> io::Result<()> {
    let Some(parent) = replica.parent() else {
        return Ok(());
    };
    let step = |b: &[u8]| {
        let t = String::from_utf8_lossy(b);
        let digits: String = t
            .trim()
            .chars()
            .rev()
            .take_while(char::is_ascii_digit)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        digits.parse::<u64>().ok()
    };
    for (name, bytes) in siblings {
        if check_name(name).is_err()
            || bytes.len() > ferry_proto::limits::MAX_SIBLING_BYTES as usize
        {
            warn!(name, "ignoring a sibling marker with a bad name or size");
            continue;
        }
        let dst = parent.join(name);
        match store.read_small(&dst) {
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                warn!(path = %dst.display(), "not a regular file; marker not written");
                continue;
            }
            Err(e) => return Err(e),
            Ok(Some(old)) => {
                if let (Some(o), Some(n)) = (step(&old), step(bytes)) {
                    if o > n {
                        continue;
                    }
                }
            }
            Ok(None) => {}
        }
        store.replace_small(&dst, bytes)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// The catalog writer records what is queued together in one batch;
    /// when that batch fails (here a chunk of a row that does not exist),
    /// each publish in it is recorded on its own and answered, so one bad
    /// entry never leaves a durable replica unrecorded.
    #[tokio::test]
    async fn the_catalog_writer_records_each_publish_of_a_failed_batch_alone() {
        let d = tempfile::tempdir().unwrap();
        let c = Catalog::open(d.path()).await.unwrap();
        let mut ids = Vec::new();
        for n in 1..=2 {
            let files = [];
            ids.push(
                c.insert_replica(&NewReplica {
                    peer: "p",
                    source_site: "s",
                    source_transfer: TransferId(n),
                    job: "j",
                    source_path: &format!("/ck/{n}"),
                    rel: "x",
                    chunk_size: 1 << 20,
                    files: &files,
                    bytes_total: 4,
                    staging_path: "/st",
                    local_path: &format!("/eval/{n}"),
                    profile: Profile::Full,
                })
                .await
                .unwrap(),
            );
        }
        let chunk = |replica: i64| VerifiedChunk {
            replica,
            key: 0,
            hash: [1; 32],
            bytes: 4,
            arrived_ms: None,
            arrival_started_ms: None,
        };
        let (tx, rx) = mpsc::channel(16);
        let writer = tokio::spawn(catalog_writer(
            c.clone(),
            rx,
            watch::channel(true).0,
            CancellationToken::new(),
        ));
        // Queued before the writer looks: one batch.
        let mut answers = Vec::new();
        tx.send(CatalogOp::Chunk(chunk(ids[0]))).await.unwrap();
        tx.send(CatalogOp::Chunk(chunk(9_999))).await.unwrap();
        for id in &ids {
            let (w, r) = oneshot::channel();
            let rec = PublishedReplica {
                id: *id,
                manifest: b"m".to_vec(),
                root_hex: "ab".into(),
                local_path: format!("/eval/{id}"),
                bytes: 4,
                times: SourceTimes::default(),
                meta: CheckpointMeta::default(),
                phases: None,
            };
            tx.send(CatalogOp::Publish(rec, w)).await.unwrap();
            answers.push(r);
        }
        for a in answers {
            assert_eq!(a.await.unwrap(), Ok(None));
        }
        for id in &ids {
            let row = c.replica(*id).await.unwrap().unwrap();
            assert_eq!(row.state, TransferState::Published, "{row:?}");
            assert_eq!(row.manifest_root.as_deref(), Some("ab"));
        }
        drop(tx);
        writer.await.unwrap();
    }

    #[test]
    fn source_paths_are_normalised_or_refused() {
        assert_eq!(
            normalize_source_path("/a//b/./c/").as_deref(),
            Some("/a/b/c")
        );
        assert_eq!(normalize_source_path("/").as_deref(), Some("/"));
        assert_eq!(normalize_source_path("/a/../etc/passwd"), None);
        assert_eq!(normalize_source_path("a/b"), None);
        assert_eq!(
            normalize_source_path("hdfs://nn:8020/ckpt//job/./step_1/").as_deref(),
            Some("hdfs://nn:8020/ckpt/job/step_1")
        );
        assert_eq!(
            normalize_source_path("s3://bucket/a/b").as_deref(),
            Some("s3://bucket/a/b")
        );
        assert_eq!(normalize_source_path("s3://bucket/a/../../x"), None);
        assert_eq!(normalize_source_path("ftp://h/a"), None);
        assert_eq!(normalize_source_path("s3:///a"), None);
    }

    #[test]
    fn dates_format_as_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(
            rfc3339(951_782_400_000 + 86_399_000),
            "2000-02-29T23:59:59Z"
        );
    }

    #[test]
    fn sibling_markers_stay_in_place_and_never_go_back() {
        let d = tempfile::tempdir().unwrap();
        let job = d.path().join("site/job");
        std::fs::create_dir_all(job.join("global_step20")).unwrap();
        let marker = |s: &str| vec![("latest".to_string(), s.as_bytes().to_vec())];
        write_siblings(&Posix, &job.join("global_step20"), &marker("global_step20")).unwrap();
        assert_eq!(std::fs::read(job.join("latest")).unwrap(), b"global_step20");
        // An older checkpoint published later does not move it back.
        write_siblings(&Posix, &job.join("global_step10"), &marker("global_step10")).unwrap();
        assert_eq!(std::fs::read(job.join("latest")).unwrap(), b"global_step20");
        // Names a peer sends are plain names, within the replica's parent.
        let bad = vec![
            ("../escape".to_string(), b"x".to_vec()),
            ("a/b".to_string(), b"x".to_vec()),
            ("big".to_string(), vec![b'1'; 5000]),
        ];
        write_siblings(&Posix, &job.join("global_step20"), &bad).unwrap();
        assert!(!d.path().join("site/escape").exists());
        assert!(!job.join("a").exists() && !job.join("big").exists());
    }
}
