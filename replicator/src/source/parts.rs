//! One pushed transfer, or what can no longer change of a watched one while it is
//! written and its rest at its commit ([`stripe_watched`]), striped across the source agents of a pool
//! (ARCHITECTURE.md, "Pool", "Parts").
//!
//! The agent holding the transfer's lease, its coordinator, lists the
//! checkpoint and stores the plan quietly: the file table and its chunks
//! grouped into parts ([`ferry_catalog::parts`]), claimable by it alone.
//! It sends its open, its first parts' registrations and their chunks
//! without waiting (with a sink of protocol version 10; the sink holds a
//! chunk until its part's registration is recorded) and announces the
//! plan once the sink answered the open (so that the sink's row exists
//! before any other agent opens the transfer at another sink agent). Then every source agent of the pool,
//! the coordinator included, claims parts (at most `max_parts` at once),
//! opens the transfer at a sink agent of the link with the plan's file
//! table, reads and hashes each part's chunks, sends those the sink
//! lacked when it opened, waits until the sink confirmed every batch
//! (confirmed means recorded in the sink's catalog), and releases the
//! part with its hashes and what it saw of each file before and after
//! reading it. A part whose lease may have lapsed is not sent further
//! ([`crate::pool::Membership::holds_part`]): another agent takes it over
//! under the next epoch.
//!
//! Once every part is done, the coordinator seals: the manifest comes
//! from the parts' hashes; a file whose recorded sizes, mtimes or version
//! tokens differ (rewritten while its parts were read) has its parts
//! queued again, and one whose size changed makes the transfer plan
//! again from a new listing. The commit then goes as for any pushed
//! transfer; the sink counts the chunks the other agents' opens recorded
//! (`absorb_recorded` in the sink).

use std::sync::atomic::AtomicBool;
use std::time::Instant;

use ferry_catalog::parts::split_into_parts_where;
use ferry_catalog::{PartFileRead, PartRange, TransferPlan};
use ferry_proto::manifest::chunk_len;

use super::*;

/// Test hook, read only in builds with the `fault-injection` feature:
/// set (to anything) in an agent's environment, that agent stops itself
/// (SIGSTOP) right after the sink recorded the epochs of the first parts
/// it claimed of a transfer another agent coordinates, before sending
/// them; continued (SIGCONT), it sends them without checking its own
/// leases first, so that only the sink's epoch check stands between its
/// late chunks and the replica.
pub const FAULT_PAUSE_AFTER_PART_ENV: &str = "FERRY_FAULT_PAUSE_AFTER_PART";

/// Whether the [`FAULT_PAUSE_AFTER_PART_ENV`] pause happened in this
/// process (its own part lease check is off from then on).
#[cfg(feature = "fault-injection")]
static PAUSED_AFTER_PART: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The [`FAULT_PAUSE_AFTER_PART_ENV`] pause, once per process.
#[cfg(feature = "fault-injection")]
fn pause_after_part() {
    if std::env::var_os(FAULT_PAUSE_AFTER_PART_ENV).is_none()
        || PAUSED_AFTER_PART.swap(true, Ordering::SeqCst)
    {
        return;
    }
    warn!("fault injection: stopping this agent after registering parts ({FAULT_PAUSE_AFTER_PART_ENV}); once continued it does not check its own part leases");
    let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGSTOP);
}

#[cfg(not(feature = "fault-injection"))]
fn pause_after_part() {}

/// Whether this agent will make the [`FAULT_PAUSE_AFTER_PART_ENV`]
/// pause: it then waits for its registrations' answers before sending,
/// so that the pause comes after the sink recorded its epochs.
fn pauses_after_part() -> bool {
    #[cfg(feature = "fault-injection")]
    {
        std::env::var_os(FAULT_PAUSE_AFTER_PART_ENV).is_some()
            && !PAUSED_AFTER_PART.load(Ordering::SeqCst)
    }
    #[cfg(not(feature = "fault-injection"))]
    {
        false
    }
}

/// Whether this agent checks its own part leases while sending (always,
/// but after the [`FAULT_PAUSE_AFTER_PART_ENV`] pause).
pub(super) fn checks_own_leases() -> bool {
    #[cfg(feature = "fault-injection")]
    {
        !PAUSED_AFTER_PART.load(Ordering::SeqCst)
    }
    #[cfg(not(feature = "fault-injection"))]
    {
        true
    }
}

/// How long the coordinator waits between looks at the parts other
/// agents hold.
const PARTS_POLL: Duration = Duration::from_millis(500);

/// How long a coordinator whose first round failed waits for the catalog
/// to announce its plan before it gives its parts back anyway.
const ANNOUNCE_ON_ERROR: Duration = Duration::from_secs(5);

/// Whether transfer `t`, whose listing holds `bytes_total` bytes, is
/// striped across the pool: a pushed, whole (`full` profile) transfer of
/// an agent on a PostgreSQL catalog, larger than one part. A transfer that has a plan
/// already (an earlier coordinator made it) stays striped.
pub(super) fn striped(inner: &Inner, t: &Transfer, bytes_total: u64) -> bool {
    // A single agent on SQLite (a pool of one) sends it whole.
    if inner.catalog.dialect() != ferry_catalog::dialect::Dialect::Postgres {
        return false;
    }
    inner.cfg.pool.as_ref().is_some_and(|p| {
        t.format.is_none() && t.profile == Profile::Full && bytes_total > p.config().part_size
    })
}

/// What an agent's run of a striped transfer sends from: the plan, its
/// chunk map, the chunks the sink had when the run opened the transfer,
/// and where the run's progress is counted.
struct Striping<'a> {
    t: &'a Transfer,
    plan: &'a TransferPlan,
    map: Arc<ChunkMap>,
    /// The chunks the sink had when the run opened the transfer (a
    /// helper's open is answered while it registers its first parts).
    have: Mutex<Arc<HashSet<u64>>>,
    /// Whether the sink's answer to the run's open came (`have` holds
    /// it).
    opened: AtomicBool,
    /// Whether the plan is announced to the pool: false while a
    /// coordinator's quietly stored plan waits for the sink's answer to
    /// its open ([`announce_when_open`]).
    announced: AtomicBool,
    /// A coordinator's quiet plan is announced to the agents whose sink
    /// takes joining opens ([`ferry_proto::wire::Open::joins`]: they wait
    /// there for this open's row instead of racing it) as soon as the
    /// run claimed and began sending its first parts, without waiting for
    /// the sink's answer to its open: this run's sink speaks
    /// [`ferry_proto::wire::JOIN_VERSION`] too. To every agent once the
    /// answer came, as without it.
    announce_early: bool,
    /// Whether the plan was announced to the agents whose sink takes
    /// joining opens ([`Striping::announce_early`]).
    joiners_told: AtomicBool,
    progress: Arc<LiveProgress>,
    /// Whether the run's open set [`ferry_proto::wire::Open::parts_first`]:
    /// a part claimed for the first time is sent right behind its
    /// registration, whose answer is checked before the part is released.
    parts_first: bool,
    /// The sink's answers to the run's registrations
    /// ([`Control::PartEpoch`]): the epoch it holds, by part.
    epochs: Mutex<HashMap<u64, u64>>,
}

/// What reading one part gave: each chunk's hash in key order and what
/// was seen of each file read.
struct PartRead {
    hashes: Vec<Hash>,
    reads: Vec<PartFileRead>,
}

/// The coordinator's run of striped transfer `t`: plan (unless a plan
/// exists: a run after a takeover continues it), send parts alongside
/// the other agents, seal, commit. `listed` is the checkpoint's listing
/// (file table in send order, marker indices) when the run listed it.
pub(super) async fn run_coordinated(
    inner: &Arc<Inner>,
    c: &LinkConn,
    t: &Transfer,
    existing: Option<TransferPlan>,
    listed: Option<(Vec<FileInfo>, Vec<u32>)>,
) -> Result<(), RunError> {
    let id = t.id;
    let pool = pool_of(inner)?;
    let (files, markers) = match (&existing, listed) {
        (Some(p), _) => (p.files.clone(), p.markers.clone()),
        (None, Some(l)) => l,
        (None, None) => return Err(RunError::Retry("a striped transfer without a plan".into())),
    };
    let bytes_total: u64 = files.iter().map(|f| f.size).sum();
    if (t.bytes_total, t.shards) != (bytes_total as i64, files.len() as i64) {
        inner
            .catalog
            .set_transfer_size(id, bytes_total, files.len() as u64)
            .await?;
    }
    let progress = track_run(inner, c, t, bytes_total);
    let cfg = pool.config();
    // A new plan is stored quietly (only this agent may claim its parts)
    // so that this agent's open and its first parts' registrations go to
    // the sink in one round trip; the plan is announced to the pool once
    // the sink answered the open, so its row for the transfer exists
    // before any other agent opens the transfer at another sink agent.
    let plan = match existing {
        Some(p) => p,
        None => {
            inner
                .catalog
                .plan_transfer_quietly(
                    id,
                    &files,
                    &markers,
                    inner.cfg.chunk_size,
                    cfg.part_size,
                    &inner.cfg.agent,
                )
                .await?
        }
    };
    if plan.files != files || plan.chunk_size != inner.cfg.chunk_size {
        return Err(RunError::Retry(
            "the stored plan's file table differs from the one listed".into(),
        ));
    }
    // Not waited for only while the plan is this agent's alone; an
    // announced plan (or another agent's, not announced because that
    // agent stopped) lets others open the transfer meanwhile: the
    // sink's row must exist first.
    let quiet = !plan.announced
        && plan.planned_by == inner.cfg.agent
        && c.version >= ferry_proto::wire::PARTS_VERSION;
    let (mut rx, have) = open_on_sink(inner, c, t, quiet, files.clone(), true, false).await?;
    if !quiet && !plan.announced {
        inner.catalog.announce_plan(id).await?;
    }
    let status = inner.catalog.parts_status(id).await?;
    info!(
        transfer = %id,
        files = files.len(),
        bytes_total,
        parts = status.total,
        parts_done = status.done,
        part_size = plan.part_size,
        "striped across the source pool: any source agent may claim its parts"
    );
    let map = Arc::new(ChunkMap::new(&files, plan.chunk_size));
    let skipped = map.bytes_of(have.iter().copied());
    progress.skipped.store(skipped, Ordering::Relaxed);
    let s = Striping {
        t,
        plan: &plan,
        map: map.clone(),
        have: Mutex::new(Arc::new(have)),
        opened: AtomicBool::new(!quiet),
        announced: AtomicBool::new(!quiet),
        announce_early: quiet && c.version >= ferry_proto::wire::JOIN_VERSION,
        joiners_told: AtomicBool::new(false),
        progress: progress.clone(),
        parts_first: super::opens_parts_first(c),
        epochs: Mutex::default(),
    };
    let mut need = Vec::new();
    loop {
        send_until_done(inner, c, &s, &mut rx, &mut need, None).await?;
        if let Some(sealed) = seal(inner, t, &plan, &map).await? {
            inner.holds.hold(id, HoldPoint::Commit).await;
            let dir = PathBuf::from(&t.source_path);
            return commit_loop(inner, c, t, &dir, &progress, &mut rx, need, sealed).await;
        }
    }
}

/// The coordinator's part of striped transfer `s`: claims and sends
/// parts alongside the other agents until every part is done, waiting
/// for those others hold (or for their leases to lapse), answering the
/// sink meanwhile and, for a watched checkpoint, following the
/// watcher's `view`.
///
/// # Errors
/// [`RunError::Cancelled`] when the watcher gives the checkpoint up,
/// [`RunError::Retry`] when it stops following it; catalog, sink and
/// connection errors.
async fn send_until_done(
    inner: &Arc<Inner>,
    c: &LinkConn,
    s: &Striping<'_>,
    rx: &mut mpsc::UnboundedReceiver<Control>,
    need: &mut Vec<u64>,
    mut view: Option<&mut watch::Receiver<CheckpointView>>,
) -> Result<(), RunError> {
    let id = s.t.id;
    loop {
        send_parts(inner, c, s, rx, need, false).await?;
        // Also when this agent claimed nothing (a higher class's parts go
        // first): the other agents may claim once the plan is announced.
        announce_when_open(inner, s, rx, need).await?;
        count_others(inner, id, &s.progress).await;
        let st = inner.catalog.parts_status(id).await?;
        if st.done >= st.total {
            return Ok(());
        }
        let until = tokio::time::Instant::now() + PARTS_POLL;
        loop {
            let watcher = async {
                match view.as_deref_mut() {
                    Some(v) => v.changed().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                m = rx.recv() => on_striping_control(s, m, need)?,
                r = watcher => {
                    if r.is_err() {
                        return Err(RunError::Retry("the watcher stopped following this checkpoint".into()));
                    }
                    if let Some(ViewState::Gone(why)) = view.as_deref().map(|v| v.borrow().state.clone()) {
                        return Err(RunError::Cancelled(why));
                    }
                }
                _ = tokio::time::sleep_until(until) => break,
                _ = inner.shutdown.cancelled() => return Err(RunError::Shutdown),
            }
        }
    }
}

/// Whether watched transfer `t` is striped across the pool (what of it
/// can no longer change while it is written, its rest at its commit; see
/// [`stripe_watched`]): an agent of a pool on PostgreSQL, a whole (`full`
/// profile) transfer not sent weights first.
pub(super) fn watched_striped(inner: &Inner, t: &Transfer, weights_first: bool) -> bool {
    inner.cfg.pool.is_some()
        && inner.catalog.dialect() == ferry_catalog::dialect::Dialect::Postgres
        && t.profile == Profile::Full
        && !weights_first
}

/// Bytes of a watched checkpoint still being written that can no longer
/// change and that its run has not confirmed (complete files it has not
/// read in full, full chunks of files only ever appended to that it has
/// not sent) there must be before they are striped across the pool
/// ([`stripe_watched`]): one part per live source agent of the pool. `None` when this agent is in no pool, is the
/// only live source agent of its pool, or its `[pool]
/// stripe_while_writing` is false: its run sends them itself.
pub(super) fn writing_threshold(inner: &Inner) -> Option<u64> {
    let pool = inner.cfg.pool.as_ref()?;
    if !pool.config().stripe_while_writing {
        return None;
    }
    let peers = u64::from(pool.live_peers());
    (peers > 1).then(|| pool.config().part_size.max(1).saturating_mul(peers))
}

/// What of a watched checkpoint can no longer change, as its run hands
/// it to [`stripe_watched`]: at its commit, every file of the committed
/// view; while it is written, the files complete so far and the full
/// chunks of those only ever appended to.
pub(super) struct WatchedFiles<'a> {
    /// The run's file table (what the sink was sent), in its order.
    pub table: &'a [FileInfo],
    /// Positions in `table` of the complete files to stripe (at the
    /// commit, every file).
    pub files: Vec<u32>,
    /// Files still being written that are only ever appended to, before
    /// the commit: (position in `table`, chunks below its current end).
    /// Those full chunks cannot change; the run keeps the tail.
    pub growing: Vec<(u32, u32)>,
    /// Positions in `table` of the commit markers, in publish order
    /// (none before the commit).
    pub markers: Vec<u32>,
    /// Whether the checkpoint is committed (its file set final).
    pub committed: bool,
    /// `planned_at` of the plan this run stored last (Unix ms), if any:
    /// a later round replaces it rather than continuing it.
    pub made: Option<i64>,
    /// Whether the run has chunk `chunk` of the file at position `file`
    /// read in full and its hash (it confirmed the whole file).
    pub known: &'a (dyn Fn(u32, u64) -> bool + Sync),
}

/// What the pool's parts gave a watched run (see [`stripe_watched`]).
pub(super) struct StripedRest {
    /// `planned_at` of the plan whose parts were sent (Unix ms).
    pub planned_at: i64,
    /// The chunks the sink held when the run opened the transfer again.
    pub have: HashSet<u64>,
    /// Each part-read chunk's key and BLAKE3 hash.
    pub hashes: Vec<(u64, Hash)>,
    /// Each file read in parts: its position, and size (bytes) and mtime
    /// (ns) now, unchanged since its parts were read.
    pub stable: Vec<(u32, u64, i64)>,
}

/// What of a watched checkpoint can no longer change, striped across the
/// source pool like a pushed transfer: the chunks of `w.files` the run
/// has not read in full and confirmed, and the full chunks of
/// `w.growing` it has not sent, split into parts any agent of the pool
/// claims, the run's agent among them. At the commit (`w.files` is then
/// the final file set) `None`, and nothing done, when what is left fits
/// in one part; while the checkpoint is written (a round of its own for
/// each batch of it), when the pool has one live source agent or what is
/// left fits in one part per live source agent (at least two): the run
/// sends those itself. Otherwise: waits
/// until every batch the run sent is confirmed, opens the transfer at the
/// sink again with the run's table (the sink records the table in its
/// catalog, so the sink pool's other agents find it when the source
/// pool's other agents open the transfer; `rx` is replaced by the new
/// open's), stores the plan (or continues this table's plan from an
/// earlier run), sends parts until none is left, and checks each file
/// read in parts against what it is now: one rewritten while read has its
/// parts read again. The run keeps the returned hashes and seals with
/// them. A plan stored by an earlier round of this run is replaced (its
/// parts are done; the numbering of the new one's first claims goes on
/// after its epochs); one stored by another run with the same table is
/// continued (this agent took the watch over).
///
/// # Errors
/// [`RunError::Cancelled`] when the watcher gives the checkpoint up
/// meanwhile; [`RunError::Retry`] when a file's size changed since it was
/// complete (the next run plans again, from the stored plan's file order)
/// or another run stored a plan of another table in between; catalog,
/// sink and connection errors.
#[allow(clippy::too_many_arguments)]
pub(super) async fn stripe_watched(
    inner: &Arc<Inner>,
    c: &LinkConn,
    t: &Transfer,
    w: WatchedFiles<'_>,
    rx: &mut mpsc::UnboundedReceiver<Control>,
    need: &mut Vec<u64>,
    progress: &Arc<LiveProgress>,
    view: &mut watch::Receiver<CheckpointView>,
) -> Result<Option<StripedRest>, RunError> {
    let id = t.id;
    let pool = pool_of(inner)?;
    let cfg = pool.config();
    let chunk_size = inner.cfg.chunk_size;
    let map = Arc::new(ChunkMap::new(w.table, chunk_size));
    // Chunks of each file that may go into parts: all of a complete
    // file's, a growing one's below its end.
    let mut limit = vec![0u64; w.table.len()];
    for f in &w.files {
        if let Some(l) = limit.get_mut(*f as usize) {
            *l = ferry_proto::manifest::chunk_count(w.table[*f as usize].size, chunk_size);
        }
    }
    for (f, full) in &w.growing {
        if let Some(l) = limit.get_mut(*f as usize) {
            *l = u64::from(*full);
        }
    }
    let unread: u64 = (0..w.table.len() as u32)
        .map(|f| {
            (0..limit[f as usize])
                .filter(|&ci| !(w.known)(f, ci))
                .map(|ci| map.span(f, ci as u32).1)
                .sum::<u64>()
        })
        .sum();
    let worth = if w.committed {
        unread > cfg.part_size
    } else {
        writing_threshold(inner).is_some_and(|limit| unread > limit)
    };
    if !worth {
        return Ok(None);
    }
    // Every batch so far recorded at the sink, then a new open there: its
    // batch count starts again, and its answer is what the sink holds.
    loop {
        let changes = c.sched.changes();
        tokio::pin!(changes);
        changes.as_mut().enable();
        if c.sched.renumber_batches(id) {
            break;
        }
        tokio::select! {
            _ = &mut changes => {}
            m = rx.recv() => on_control(m, need)?,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            e = c.conn.closed() => return Err(RunError::Retry(format!("connection to the sink lost: {e}"))),
            _ = inner.shutdown.cancelled() => return Err(RunError::Shutdown),
        }
    }
    let (new_rx, have) = open_on_sink(inner, c, t, false, w.table.to_vec(), false, false).await?;
    *rx = new_rx;
    // What the sink holds now is what it lacks no longer; what it lacks
    // of what the run sent the run finds from `have` (streaming.rs).
    need.clear();
    // The transfer's progress starts again from what the sink holds: it
    // counts every batch this run sent before and every part another
    // agent sent of an earlier plan (the new plan's parts from none).
    let at_sink = map.bytes_of(have.iter().copied());
    // What this run's own counter holds stays (clients show its sent
    // bytes beside the skipped ones).
    let mine = progress.verified_or_sent();
    progress
        .skipped
        .store(at_sink.saturating_sub(mine), Ordering::Relaxed);
    progress.by_others.store(0, Ordering::Relaxed);
    let send = |f: u32, ci: u64| {
        ci < limit.get(f as usize).copied().unwrap_or(0)
            && !((w.known)(f, ci) && map.index(f, ci as u32).is_some_and(|k| have.contains(&k)))
    };
    // A part's bytes are those it has to send: chunks the sink holds
    // already are read and hashed, not sent (claims are shared, and the
    // progress counted, by what is sent).
    let mut planned = split_into_parts_where(w.table, chunk_size, cfg.part_size.max(1), send);
    for p in &mut planned {
        let held = map.bytes_of(part_keys(&map, p).into_iter().filter(|k| have.contains(k)));
        p.bytes = p.bytes.saturating_sub(held);
    }
    let plan = match inner.catalog.transfer_plan(id).await? {
        // An earlier run of this table planned it (this agent took the
        // watch over): its parts go on, the rest is read again below.
        Some(p)
            if p.files == w.table && p.chunk_size == chunk_size && Some(p.planned_at) != w.made =>
        {
            p
        }
        other => {
            if other.is_some() {
                inner.catalog.drop_plan(id).await?;
            }
            inner
                .catalog
                .plan_transfer_parts(
                    id,
                    w.table,
                    &w.markers,
                    chunk_size,
                    cfg.part_size,
                    &inner.cfg.agent,
                    &planned,
                )
                .await?
        }
    };
    if plan.files != w.table || plan.chunk_size != chunk_size {
        // Another run stored its plan in between.
        return Err(RunError::Retry(
            "the stored plan's file table differs from the one opened at the sink".into(),
        ));
    }
    let status = inner.catalog.parts_status(id).await?;
    if w.committed {
        info!(
            transfer = %id,
            unread_bytes = unread,
            parts = status.total,
            parts_done = status.done,
            part_size = plan.part_size,
            "checkpoint committed: the rest is striped across the source pool; any source agent may claim its parts"
        );
    } else {
        info!(
            transfer = %id,
            unread_bytes = unread,
            complete_files = w.files.len(),
            growing_files = w.growing.len(),
            parts = status.total,
            parts_done = status.done,
            part_size = plan.part_size,
            "checkpoint still being written: what can no longer change (complete files, full chunks of files only appended to) is striped across the source pool; any source agent may claim its parts"
        );
    }
    let growing: HashSet<u32> = w.growing.iter().map(|(f, _)| *f).collect();
    let s = Striping {
        t,
        plan: &plan,
        map: map.clone(),
        have: Mutex::new(Arc::new(have.clone())),
        opened: AtomicBool::new(true),
        announced: AtomicBool::new(true),
        announce_early: false,
        joiners_told: AtomicBool::new(false),
        progress: progress.clone(),
        parts_first: false,
        epochs: Mutex::default(),
    };
    loop {
        let round = async {
            send_until_done(inner, c, &s, rx, need, Some(&mut *view)).await?;
            check_parts(inner, t, &plan, &map, false, !w.committed, &growing).await
        }
        .await;
        // A file deleted under the parts' reads: the watcher says why.
        let checked = match round {
            Err(e @ (RunError::Fatal(_) | RunError::Retry(_))) => {
                return Err(unless_gone(inner, view, e).await);
            }
            other => other?,
        };
        if let Some(ck) = checked {
            let stable = ck
                .now
                .iter()
                .enumerate()
                .filter_map(|(fi, n)| n.map(|(size, mtime, _)| (fi as u32, size, mtime)))
                .collect();
            return Ok(Some(StripedRest {
                planned_at: plan.planned_at,
                have,
                hashes: ck.hashes.into_iter().collect(),
                stable,
            }));
        }
    }
}

/// Least time a watched run whose parts failed waits for the watcher to
/// say the checkpoint is gone (a checkpoint deleted while read fails its
/// reads before the watcher notices); with a rescan interval, two of
/// them if longer (a root the watcher polls notices at its next scan).
const GONE_WAIT: Duration = Duration::from_secs(1);

/// `e`, or [`RunError::Cancelled`] with the watcher's reason if it says
/// within [`GONE_WAIT`] (or two rescans) that the checkpoint is gone.
async fn unless_gone(
    inner: &Inner,
    view: &mut watch::Receiver<CheckpointView>,
    e: RunError,
) -> RunError {
    let wait = inner
        .cfg
        .scan_interval
        .map_or(GONE_WAIT, |s| GONE_WAIT.max(s * 2));
    let gone = tokio::time::timeout(
        wait,
        view.wait_for(|v| matches!(v.state, ViewState::Gone(_))),
    )
    .await;
    match gone {
        Ok(Ok(v)) => match &v.state {
            ViewState::Gone(why) => RunError::Cancelled(why.clone()),
            _ => e,
        },
        _ => e,
    }
}

/// Another agent's run of striped transfer `t` (held by its coordinator
/// elsewhere): opens it at the sink with the plan's file table and sends
/// parts while any is left to claim. Ends `Ok` when none is; records
/// nothing in the transfer's row (the coordinator's).
pub(super) async fn run_helper(
    inner: &Arc<Inner>,
    c: &LinkConn,
    t: &Transfer,
) -> Result<(), RunError> {
    let id = t.id;
    // A plan not announced yet is its coordinator's alone: its open may
    // not have reached the sink (this agent's open elsewhere would race
    // it).
    // With a sink that takes joining opens, this agent's open waits there
    // for the coordinator's row: a plan announced to such agents will do.
    let joins = c.version >= ferry_proto::wire::JOIN_VERSION;
    let Some(plan) = inner
        .catalog
        .transfer_plan(id)
        .await?
        .filter(|p| p.announced || (joins && p.joinable))
    else {
        return Ok(());
    };
    if inner
        .catalog
        .parts_status(id)
        .await
        .map(|s| s.claimable == 0)?
    {
        return Ok(());
    }
    // The open's answer (what the sink has) is awaited together with the
    // first parts' registrations: one round trip, not two. A sink
    // without part registrations is waited for.
    let wait = c.version < ferry_proto::wire::PARTS_VERSION;
    let (mut rx, have) = open_on_sink(inner, c, t, !wait, plan.files.clone(), true, true).await?;
    let s = Striping {
        t,
        plan: &plan,
        map: Arc::new(ChunkMap::new(&plan.files, plan.chunk_size)),
        have: Mutex::new(Arc::new(have)),
        opened: AtomicBool::new(wait),
        announced: AtomicBool::new(true),
        announce_early: false,
        joiners_told: AtomicBool::new(false),
        // This agent's bytes of the transfer: not the transfer's
        // progress, which its coordinator keeps.
        progress: Arc::new(LiveProgress::default()),
        parts_first: super::opens_parts_first(c),
        epochs: Mutex::default(),
    };
    let mut need = Vec::new();
    send_parts(inner, c, &s, &mut rx, &mut need, true).await
}

/// Counts in the coordinator's `progress` the parts of `id` other agents
/// sent and released (the transfer's progress is its coordinator's).
async fn count_others(inner: &Inner, id: TransferId, progress: &LiveProgress) {
    match inner
        .catalog
        .parts_done_bytes_by_others(id, &inner.cfg.agent)
        .await
    {
        Ok(b) => progress.by_others.store(b, Ordering::Relaxed),
        Err(e) => {
            debug!(transfer = %id, error = %e, "catalog: reading the parts other agents sent")
        }
    }
}

fn pool_of(inner: &Inner) -> Result<&crate::pool::Membership, RunError> {
    inner
        .cfg
        .pool
        .as_ref()
        .ok_or_else(|| RunError::Fatal("a striped transfer needs a pool".into()))
}

/// A control message while waiting: `Need` is kept for the commit,
/// a refusal or cancel ends the run, a lost control stream retries it.
fn on_control(m: Option<Control>, need: &mut Vec<u64>) -> Result<(), RunError> {
    match m {
        Some(Control::Need { chunks, .. }) => {
            need.extend(chunks);
            Ok(())
        }
        Some(Control::Refuse { reason, .. }) => {
            Err(RunError::Fatal(format!("sink refused: {reason}")))
        }
        Some(Control::Cancel { reason, .. }) => {
            Err(RunError::Fatal(format!("sink cancelled: {reason}")))
        }
        Some(_) => Ok(()),
        None => Err(RunError::Retry("connection to the sink lost".into())),
    }
}

/// Writes transfer `id`'s place in the pool's claim order from this
/// link's scheduler: its class and score now.
async fn write_rank(inner: &Inner, c: &LinkConn, id: TransferId) {
    let Some(e) = c.sched.lock().ls.explain(id, ferry_catalog::now_ms()) else {
        return;
    };
    let rank = match e.class {
        scheduler::Class::Urgent => 2,
        scheduler::Class::Scheduled => 1,
        scheduler::Class::Background => 0,
    };
    if let Err(err) = inner.catalog.set_plan_rank(id, rank, e.score.value).await {
        warn!(transfer = %id, error = %err, "catalog: writing the transfer's claim rank");
    }
}

/// Claims parts of `t` and sends them until none is left to claim (or the
/// agent may claim no more: drained, or its catalog does not answer).
async fn send_parts(
    inner: &Arc<Inner>,
    c: &LinkConn,
    s: &Striping<'_>,
    rx: &mut mpsc::UnboundedReceiver<Control>,
    need: &mut Vec<u64>,
    helper: bool,
) -> Result<(), RunError> {
    let id = s.t.id;
    let pool = pool_of(inner)?;
    let cfg = pool.config();
    let me = inner.cfg.agent.as_str();
    loop {
        if inner.shutdown.is_cancelled() {
            return Err(RunError::Shutdown);
        }
        if !pool.may_claim() {
            return Ok(());
        }
        if !helper {
            // The claim order follows a signal within one claim.
            write_rank(inner, c, id).await;
            count_others(inner, id, &s.progress).await;
        }
        let want = claim_size(inner, id, cfg.max_parts, pool.live_peers()).await;
        let claims = inner
            .catalog
            .claim_parts_for(
                id,
                me,
                want,
                cfg.lease_timeout.as_millis() as i64,
                c.version >= ferry_proto::wire::JOIN_VERSION,
            )
            .await?;
        if claims.is_empty() {
            return Ok(());
        }
        let at = Instant::now();
        for cl in &claims {
            if let Some(from) = &cl.took_over_from {
                info!(
                    transfer = %id,
                    part = cl.range.part,
                    epoch = cl.epoch,
                    from = from.as_str(),
                    "took a part over: the previous holder's lease lapsed"
                );
                pool.count_takeover();
            }
        }
        debug!(
            transfer = %id,
            parts = ?claims.iter().map(|c| c.range.part).collect::<Vec<_>>(),
            "claimed parts"
        );
        if helper && !same_plan(inner, s.plan).await {
            // The plan this helper read at its start was dropped and
            // another stored: its parts name chunks of another table.
            // Given back unsent; the next helper reads the new plan.
            for cl in &claims {
                if let Err(err) = inner
                    .catalog
                    .give_back_part(id, cl.range.part, me, cl.epoch)
                    .await
                {
                    warn!(transfer = %id, part = cl.range.part, error = %err, "catalog: giving a part back (its lease lapses by itself)");
                }
            }
            debug!(transfer = %id, "the transfer was planned again since this helper started; it stops");
            return Ok(());
        }
        if helper {
            // This agent's share of the budget counts the parts it holds:
            // recomputed now (its lower classes stay capped), so that it
            // is paced for them when their registrations are answered,
            // not at the link worker's next pass (up to a second later).
            if let Some(l) = inner.links.get(&s.t.link) {
                l.wake.notify_one();
            }
        }
        // Registered at the sink first: from then on no sink agent takes
        // the part's chunks from an agent that claimed it earlier. Parts
        // claimed for the first time go right behind their registrations
        // (the sink holds chunks that overtake them), and the answers are
        // checked before release: the sink holds no later epoch unless
        // this agent stalled for a lease, and none of their chunks but
        // those of files it reused from a published copy (sent again
        // then, by the first claims only). Not when the plan left out bytes the sink held (a watched
        // checkpoint's parts) and this agent has not heard what the sink
        // holds: the registrations' answers come after the open's, which
        // says which chunks not to send.
        // An agent whose open was not waited for speaks PARTS_VERSION
        // (the open's answer then comes before the registrations'; see
        // `register`).
        debug_assert!(
            s.opened.load(Ordering::Relaxed) || c.version >= ferry_proto::wire::PARTS_VERSION
        );
        let ahead = s.parts_first
            && !pauses_after_part()
            && claims
                .iter()
                .all(|cl| cl.epoch == 1 && cl.took_over_from.is_none())
            && (s.opened.load(Ordering::Relaxed)
                || claims
                    .iter()
                    .all(|cl| s.map.bytes_of(part_keys(&s.map, &cl.range)) == cl.range.bytes));
        // From here on, an error gives back every claim this agent still
        // holds: a claim left behind would be renewed with the agent's
        // other leases and never sent.
        let claimed = claims;
        let outcome: Result<(Vec<ferry_catalog::PartClaim>, Vec<Option<PartRead>>), RunError> = async {
            let claims = if ahead {
                send_registrations(c, id, &claimed).await?;
                claimed.clone()
            } else {
                let kept = register(inner, c, id, claimed.clone(), rx, need, s).await?;
                if !helper {
                    // The sink answers an open before the registrations after it.
                    announce_when_open(inner, s, rx, need).await?;
                }
                kept
            };
            if claims.is_empty() {
                return Ok((claims, Vec::new()));
            }
            if helper {
                pause_after_part();
            }
            let ranges: Vec<PartRange> = claims.iter().map(|c| c.range).collect();
            let lost = async {
                if !checks_own_leases() {
                    return std::future::pending().await;
                }
                let mut tick = tokio::time::interval(crate::pool::FENCE_CHECK);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tick.tick().await;
                    if let Some(p) = ranges.iter().find(|r| !pool.holds_part(id, r.part, at)) {
                        return p.part;
                    }
                }
            };
            let reads = tokio::select! {
                r = send_claimed(inner, c, s, rx, need, &ranges) => r,
                part = lost => {
                    warn!(
                        transfer = %id,
                        part,
                        "this agent may no longer hold the part's lease (not renewed in time: the \
                         catalog does not answer, or the agent was paused); sending no more of its parts"
                    );
                    pool.count_lost();
                    // Chunks queued for the link's writers go too.
                    c.sched.deactivate(id);
                    Err(RunError::Stopped)
                }
            }?;
            let reads: Vec<Option<PartRead>> = if ahead {
                if !helper {
                    announce_when_open(inner, s, rx, need).await?;
                }
                // The sink's answers: a part it holds a later epoch of
                // was taken over meanwhile (its chunks were refused).
                let kept = registered_claims(inner, id, &claims, rx, need, s).await?;
                claims
                    .iter()
                    .zip(reads)
                    .map(|(cl, r)| (kept.contains(&cl.range.part)).then_some(r))
                    .collect()
            } else {
                reads.into_iter().map(Some).collect()
            };
            Ok((claims, reads))
        }
        .await;
        let (claims, reads) = match outcome {
            Ok((kept, _)) if kept.is_empty() => {
                // Every one taken over since (the sink holds a later
                // epoch): nothing of them is this agent's to give back,
                // which the catalog checks.
                give_back(inner, id, me, &claimed).await;
                continue;
            }
            Ok((kept, reads)) => {
                // Claims the sink holds a later epoch of (taken over
                // since) are not sent: see above.
                let dropped: Vec<_> = claimed
                    .iter()
                    .filter(|cl| !kept.iter().any(|k| k.range.part == cl.range.part))
                    .cloned()
                    .collect();
                give_back(inner, id, me, &dropped).await;
                (kept, reads)
            }
            Err(mut e) => {
                // A coordinator that sent its first parts ahead announces
                // its plan before it gives them back, if the sink answered
                // the open: the other agents need not wait for its retry
                // (or, if it dies, for a takeover) to claim. Not on
                // shutdown, and not for longer than ANNOUNCE_ON_ERROR.
                if ahead
                    && !helper
                    && !matches!(e, RunError::Shutdown)
                    && !s.announced.load(Ordering::Relaxed)
                {
                    // The open's answer may have come but be unread (the
                    // round failed first).
                    let mut sink_said = false;
                    while !s.opened.load(Ordering::Relaxed) {
                        let Ok(m) = rx.try_recv() else { break };
                        if let Err(said) = on_striping_control(s, Some(m), need) {
                            // The sink's own word (a refusal, a cancel)
                            // outranks the round's error.
                            e = said;
                            sink_said = true;
                            break;
                        }
                    }
                    if s.opened.load(Ordering::Relaxed) && !sink_said {
                        match tokio::time::timeout(ANNOUNCE_ON_ERROR, announce(inner, s)).await {
                            Ok(Ok(())) => {}
                            Ok(Err(err)) => {
                                warn!(transfer = %id, error = %err, "catalog: announcing the plan")
                            }
                            Err(_) => warn!(
                                transfer = %id,
                                "catalog: announcing the plan took over {} s; given up (the retry announces it)",
                                ANNOUNCE_ON_ERROR.as_secs()
                            ),
                        }
                    }
                }
                // Tried even when the lease may have lapsed: the catalog
                // gives back only a claim this agent still holds under
                // this epoch, and one left would be renewed.
                give_back(inner, id, me, &claimed).await;
                return Err(e);
            }
        };
        for (i, (cl, read)) in claims.iter().zip(reads).enumerate() {
            let Some(read) = read else {
                // Taken over since (see above).
                give_back(inner, id, me, std::slice::from_ref(cl)).await;
                continue;
            };
            if !pool.holds_part(id, cl.range.part, at) {
                warn!(transfer = %id, part = cl.range.part, "not releasing a part whose lease may have lapsed: another agent sends it again");
                give_back(inner, id, me, std::slice::from_ref(cl)).await;
                continue;
            }
            match inner
                .catalog
                .release_part(id, cl.range.part, me, cl.epoch, &read.hashes, &read.reads)
                .await
            {
                Ok(true) => {}
                Ok(false) => {
                    warn!(transfer = %id, part = cl.range.part, "the part was taken over before its release");
                }
                Err(e) => {
                    // This and the claims not released yet go back.
                    give_back(inner, id, me, &claims[i..]).await;
                    return Err(e.into());
                }
            }
        }
    }
}

/// Gives back `claims` of transfer `id` (agent `me`'s): each one the
/// catalog still records as `me`'s under its epoch is queued again.
/// Catalog errors are logged (the leases lapse once this agent stops
/// renewing them).
async fn give_back(inner: &Inner, id: TransferId, me: &str, claims: &[ferry_catalog::PartClaim]) {
    for cl in claims {
        if let Err(err) = inner
            .catalog
            .give_back_part(id, cl.range.part, me, cl.epoch)
            .await
        {
            warn!(transfer = %id, part = cl.range.part, error = %err, "catalog: giving a part back (its lease lapses once this agent stops renewing it)");
        }
    }
}

/// How many parts of transfer `id` to claim now: `max_parts`, but no
/// more than an even split of the claimable parts among the pool's
/// `peers` live source agents (at least 1). Near the end every agent gets
/// a share of the last parts rather than the first to ask taking
/// `max_parts` of them and the others waiting. `max_parts` if the
/// catalog does not answer (the claim itself will say so).
async fn claim_size(inner: &Inner, id: TransferId, max_parts: usize, peers: u32) -> usize {
    if peers <= 1 {
        return max_parts;
    }
    match inner.catalog.parts_status(id).await {
        Ok(st) => even_share(st.claimable, max_parts, peers),
        Err(_) => max_parts,
    }
}

/// True if `plan` is still the stored plan of its transfer (same maker
/// and time; a plan dropped and stored again differs). A catalog error
/// counts as the same plan: the claim's own checks still hold (each part
/// is registered and fenced at the sink, and every part's hashes are
/// checked against the table at the seal).
async fn same_plan(inner: &Inner, plan: &TransferPlan) -> bool {
    match inner.catalog.transfer_plan(plan.transfer).await {
        Ok(Some(p)) => p.planned_at == plan.planned_at && p.planned_by == plan.planned_by,
        Ok(None) => false,
        Err(e) => {
            debug!(transfer = %plan.transfer, error = %e, "catalog: reading the transfer's plan");
            true
        }
    }
}

/// `claimable` parts split among `peers` agents, rounded up, within
/// 1..=`max_parts`.
fn even_share(claimable: u64, max_parts: usize, peers: u32) -> usize {
    let share = claimable.div_ceil(u64::from(peers.max(1)));
    usize::try_from(share)
        .unwrap_or(usize::MAX)
        .clamp(1, max_parts.max(1))
}

/// Keeps the sink's answer to the run's open: what it has.
fn took_have(s: &Striping<'_>, chunks: Vec<u64>) {
    let have: HashSet<u64> = chunks.into_iter().collect();
    // What the sink had counts as done in the run's progress.
    let skipped = s.map.bytes_of(have.iter().copied());
    s.progress.skipped.store(skipped, Ordering::Relaxed);
    *crate::lock::lock(&s.have) = Arc::new(have);
    s.opened.store(true, Ordering::Relaxed);
}

/// A coordinator's quietly stored plan ([`Catalog::plan_transfer_quietly`])
/// is announced to the pool once the sink answered the run's open
/// (waited for here if it has not come yet, 30 s at most). Nothing to do
/// for a plan announced already.
///
/// # Errors
/// [`RunError::Retry`] if the sink does not answer within 30 s, the
/// sink's refusal, catalog errors.
///
/// [`Catalog::plan_transfer_quietly`]: ferry_catalog::Catalog::plan_transfer_quietly
async fn announce_when_open(
    inner: &Inner,
    s: &Striping<'_>,
    rx: &mut mpsc::UnboundedReceiver<Control>,
    need: &mut Vec<u64>,
) -> Result<(), RunError> {
    if s.announced.load(Ordering::Relaxed) {
        return Ok(());
    }
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    while !s.opened.load(Ordering::Relaxed) {
        tokio::select! {
            m = rx.recv() => on_striping_control(s, m, need)?,
            _ = tokio::time::sleep_until(until) => {
                return Err(RunError::Retry("the sink did not answer the transfer's open within 30 s".into()));
            }
            _ = inner.shutdown.cancelled() => return Err(RunError::Shutdown),
        }
    }
    Ok(announce(inner, s).await?)
}

/// Announces `s`'s plan to the pool: the other agents may claim its
/// parts from now on.
///
/// # Errors
/// Catalog errors (the plan stays unannounced; call again).
async fn announce(inner: &Inner, s: &Striping<'_>) -> Result<(), ferry_catalog::CatalogError> {
    inner.catalog.announce_plan(s.t.id).await?;
    s.announced.store(true, Ordering::Relaxed);
    debug!(transfer = %s.t.id, answered = s.opened.load(Ordering::Relaxed), "the plan is announced to the pool");
    Ok(())
}

/// Registers each claim's part and epoch at the sink ([`Control::Part`])
/// and waits for the epochs it recorded ([`registered_claims`]): the
/// claims whose epoch the sink holds, to send; a claim the sink knows a
/// later epoch of was taken over since (this agent was paused): dropped,
/// neither sent nor released. A sink older than
/// [`ferry_proto::wire::PARTS_VERSION`] registers nothing: every claim is
/// kept (the source's own lease check is the only fence then). The
/// open's answer arriving meanwhile (a helper does not wait for it, nor
/// does a coordinator whose plan is not announced yet) goes to `s.have`
/// ([`took_have`]).
async fn register(
    inner: &Inner,
    c: &LinkConn,
    id: TransferId,
    claims: Vec<ferry_catalog::PartClaim>,
    rx: &mut mpsc::UnboundedReceiver<Control>,
    need: &mut Vec<u64>,
    s: &Striping<'_>,
) -> Result<Vec<ferry_catalog::PartClaim>, RunError> {
    if c.version < ferry_proto::wire::PARTS_VERSION {
        return Ok(claims);
    }
    send_registrations(c, id, &claims).await?;
    let kept = registered_claims(inner, id, &claims, rx, need, s).await?;
    Ok(claims
        .into_iter()
        .filter(|cl| kept.contains(&cl.range.part))
        .collect())
}

/// Sends each claim's registration ([`Control::Part`]) without waiting
/// for the answers.
async fn send_registrations(
    c: &LinkConn,
    id: TransferId,
    claims: &[ferry_catalog::PartClaim],
) -> Result<(), RunError> {
    for cl in claims {
        c.ctl
            .send(&Control::Part {
                id,
                part: cl.range.part,
                epoch: cl.epoch.max(0) as u64,
                first_key: cl.range.first_key,
                end_key: cl.range.end_key,
            })
            .await?;
    }
    Ok(())
}

/// Waits (30 s at most) until the sink answered the registration of
/// every claim of `claims` (answers that came already are in `s.epochs`;
/// one below the claim's epoch answers an earlier registration of the
/// part) and returns the parts whose epoch it holds; a part it holds a
/// later epoch of was taken over since this agent claimed it.
///
/// # Errors
/// [`RunError::Retry`] if an answer does not come within 30 s; the
/// sink's refusal or cancel; a lost connection; shutdown.
async fn registered_claims(
    inner: &Inner,
    id: TransferId,
    claims: &[ferry_catalog::PartClaim],
    rx: &mut mpsc::UnboundedReceiver<Control>,
    need: &mut Vec<u64>,
    s: &Striping<'_>,
) -> Result<HashSet<u64>, RunError> {
    // The sink answers the epoch it holds, at least the one registered:
    // an answer below a claim's epoch is an earlier registration's (the
    // part was queued again since, and claimed under a later epoch).
    let answered = |s: &Striping<'_>| {
        let e = crate::lock::lock(&s.epochs);
        claims.iter().all(|cl| {
            e.get(&cl.range.part)
                .is_some_and(|at_sink| *at_sink >= cl.epoch.max(0) as u64)
        })
    };
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    while !answered(s) {
        tokio::select! {
            m = rx.recv() => on_striping_control(s, m, need)?,
            _ = tokio::time::sleep_until(until) => {
                return Err(RunError::Retry("the sink did not answer a part's registration within 30 s".into()));
            }
            _ = inner.shutdown.cancelled() => return Err(RunError::Shutdown),
        }
    }
    let e = crate::lock::lock(&s.epochs);
    Ok(claims
        .iter()
        .filter(|cl| {
            let at_sink = e.get(&cl.range.part).copied().unwrap_or(0);
            let mine = cl.epoch.max(0) as u64;
            if at_sink != mine {
                warn!(
                    transfer = %id,
                    part = cl.range.part,
                    epoch = mine,
                    at_sink,
                    "the sink holds a later claim of the part: it was taken over; not sending or releasing it"
                );
            }
            at_sink == mine
        })
        .map(|cl| cl.range.part)
        .collect())
}

/// A control message for a striped run: the open's answer goes to
/// `s.have`, a registration's answer to `s.epochs`, anything else to
/// [`on_control`].
fn on_striping_control(
    s: &Striping<'_>,
    m: Option<Control>,
    need: &mut Vec<u64>,
) -> Result<(), RunError> {
    match m {
        Some(Control::Have { chunks, .. }) => {
            took_have(s, chunks);
            Ok(())
        }
        Some(Control::PartEpoch { part, epoch, .. }) => {
            crate::lock::lock(&s.epochs).insert(part, epoch);
            Ok(())
        }
        m => on_control(m, need),
    }
}

/// Reads the parts `ranges`, sends the chunks the sink lacked, and waits
/// until the sink confirmed every batch: what each part's read gave, in
/// `ranges` order.
async fn send_claimed(
    inner: &Arc<Inner>,
    c: &LinkConn,
    s: &Striping<'_>,
    rx: &mut mpsc::UnboundedReceiver<Control>,
    need: &mut Vec<u64>,
    ranges: &[PartRange],
) -> Result<Vec<PartRead>, RunError> {
    let id = s.t.id;
    let (inner2, dir) = (inner.clone(), PathBuf::from(&s.t.source_path));
    let (files, map2, have2, ranges2) = (
        s.plan.files.clone(),
        s.map.clone(),
        crate::lock::lock(&s.have).clone(),
        ranges.to_vec(),
    );
    let chunk_size = s.plan.chunk_size;
    // Answers to the open and to registrations sent without waiting come
    // while the parts are sent: kept, and a quietly stored plan is
    // announced as soon as the open's answer is here (the other agents
    // then claim while this one sends).
    let (answers, mut answered) = mpsc::unbounded_channel();
    let sending = send_round(
        inner,
        c,
        id,
        &s.progress,
        rx,
        need,
        Some(answers),
        move |out| {
            read_parts(
                &inner2, &dir, &files, chunk_size, &map2, &ranges2, &have2, out,
            )
        },
    );
    let answering = async {
        if s.announce_early
            && !s.announced.load(Ordering::Relaxed)
            && !s.joiners_told.swap(true, Ordering::Relaxed)
        {
            match inner.catalog.announce_plan_to_joiners(id).await {
                Ok(_) => {
                    debug!(transfer = %id, "the plan is announced to the agents whose sink takes joining opens")
                }
                // The announcement at the open's answer lets them in.
                Err(e) => {
                    warn!(transfer = %id, error = %e, "catalog: announcing the plan to joining agents")
                }
            }
        }
        let mut ignored = Vec::new();
        while let Some(m) = answered.recv().await {
            let _ = on_striping_control(s, Some(m), &mut ignored);
            if s.opened.load(Ordering::Relaxed) && !s.announced.load(Ordering::Relaxed) {
                if let Err(e) = announce(inner, s).await {
                    // Again after the parts are sent.
                    warn!(transfer = %id, error = %e, "catalog: announcing the plan");
                }
            }
        }
    };
    let (reads, ()) = tokio::join!(sending, answering);
    let reads = reads?;
    // Released only once recorded at the sink.
    loop {
        let changes = c.sched.changes();
        tokio::pin!(changes);
        changes.as_mut().enable();
        if c.sched.settled(id) {
            return Ok(reads);
        }
        if c.conn.close_reason().is_some() {
            return Err(RunError::Retry("connection to the sink lost".into()));
        }
        tokio::select! {
            _ = &mut changes => {}
            m = rx.recv() => on_striping_control(s, m, need)?,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = inner.shutdown.cancelled() => return Err(RunError::Shutdown),
        }
    }
}

/// The chunk keys of `map` in part `r`, in key order.
fn part_keys(map: &ChunkMap, r: &PartRange) -> Vec<u64> {
    let (first_file, last_file) = (r.first_key >> 32, r.end_key.saturating_sub(1) >> 32);
    let mut keys = Vec::new();
    for f in first_file..=last_file.min(map.len() as u64) {
        let Ok(f) = u32::try_from(f) else { break };
        let mut c = if u64::from(f) == first_file {
            (r.first_key & 0xffff_ffff) as u32
        } else {
            0
        };
        while let Some(k) = map.index(f, c).filter(|k| *k < r.end_key) {
            keys.push(k);
            c += 1;
        }
    }
    keys
}

/// Reads each part of `ranges` (chunk keys of `map`, files of `files`
/// under `dir`): hashes every chunk, queues those not in `have`, and
/// notes each file's size, mtime and version before and after. A file
/// shorter than the plan says, or changed while read, gives zero hashes
/// for the chunks it lacks (the seal sees its size or version and plans
/// or sends its parts again).
///
/// # Errors
/// A file that cannot be opened or stated, or a read that fails while
/// the file is unchanged, named with its path and offset; a chunk key
/// not in the plan.
#[allow(clippy::too_many_arguments)]
fn read_parts(
    inner: &Inner,
    dir: &Path,
    files: &[FileInfo],
    chunk_size: u32,
    map: &ChunkMap,
    ranges: &[PartRange],
    have: &HashSet<u64>,
    out: &mpsc::Sender<Record>,
) -> Result<Vec<PartRead>, String> {
    let mut all = Vec::with_capacity(ranges.len());
    for r in ranges {
        let keys = part_keys(map, r);
        let mut hashes = Vec::with_capacity(keys.len());
        let mut reads = Vec::new();
        let mut i = 0;
        while i < keys.len() {
            let Some((fi, _)) = map.locate(keys[i]) else {
                return Err(format!("chunk key {} is not in the plan", keys[i]));
            };
            let info = files
                .get(fi as usize)
                .ok_or_else(|| format!("file {fi} is not in the plan"))?;
            let path = dir.join(&info.path);
            let f = inner
                .store
                .open(&path)
                .map_err(|e| format!("{}: {e}", path.display()))?;
            let stat = |f: &dyn RangeRead| {
                f.current()
                    .map(|(size, mtime, v)| (size, mtime, v.0))
                    .map_err(|e| format!("{}: {e}", path.display()))
            };
            let before = stat(&*f)?;
            while i < keys.len() && map.locate(keys[i]).map(|x| x.0) == Some(fi) {
                let (_, ci) = map.locate(keys[i]).unwrap_or((fi, 0));
                let (off, len) = map.span(fi, ci);
                let mut buf = inner.bufs.take(len as usize);
                let mut ok = before.0 >= off + len;
                if ok {
                    if let Err(e) = f.read_range_into(off, len, &mut buf) {
                        // A file that changed under the read is for the
                        // seal; any other read error ends the run, named
                        // (a zero hash would stall the commit).
                        if stat(&*f)? == before {
                            return Err(format!(
                                "{}: reading {len} bytes at offset {off}: {e}",
                                path.display()
                            ));
                        }
                        ok = false;
                    }
                }
                ok = ok && buf.len() as u64 == chunk_len(info.size, chunk_size, u64::from(ci));
                if !ok {
                    // Shorter than planned, or changed while read: the
                    // seal sees the file's size or version and plans or
                    // sends its parts again.
                    hashes.push([0u8; 32]);
                    i += 1;
                    continue;
                }
                let hash = *blake3::hash(&buf).as_bytes();
                hashes.push(hash);
                if !have.contains(&keys[i]) {
                    send_read_chunk(inner, out, &path, fi, ci, &mut buf, &hash)
                        .map_err(|e| e.to_string())?;
                }
                i += 1;
            }
            let after = stat(&*f)?;
            reads.push(PartFileRead {
                file: fi,
                before,
                after,
            });
        }
        all.push(PartRead { hashes, reads });
    }
    Ok(all)
}

/// What a striped transfer's done parts hold once checked against the
/// files now (see [`check_parts`]).
struct Checked {
    /// Each chunk's BLAKE3 hash, by chunk key.
    hashes: HashMap<u64, Hash>,
    /// Each file of the plan's table as it is now: (size in bytes, mtime
    /// in ns, version); `None` for one not looked at.
    now: Vec<Option<(u64, i64, [u64; 4])>>,
}

/// Checks striped transfer `t`'s done parts against its files now: the
/// hashes to seal with, or `None` when parts were queued again (a file
/// rewritten while its parts were read, or a part's record incomplete)
/// or are not all done. Looks at every file of the plan (`all`, a pushed
/// transfer: the manifest lists each) or only those read in parts. With
/// `writing` (a watched checkpoint still being written), a file whose size
/// differs from the plan's is left out instead: none of its hashes, `None`
/// as its state now (its watching run reads it again once it is complete).
/// Files at `growing` positions (being written, only ever appended to:
/// their parts hold full chunks below the end they had) are not looked
/// at: their hashes are kept, their state now is `None`.
///
/// # Errors
/// [`RunError::Retry`] when a file's size differs from the plan's and not
/// `writing` (the next run lists and plans again; a pushed transfer's plan
/// is dropped here), or when a file cannot be looked at; catalog errors.
async fn check_parts(
    inner: &Arc<Inner>,
    t: &Transfer,
    plan: &TransferPlan,
    map: &Arc<ChunkMap>,
    all: bool,
    writing: bool,
    growing: &HashSet<u32>,
) -> Result<Option<Checked>, RunError> {
    let id = t.id;
    let parts = inner.catalog.parts(id).await?;
    if parts
        .iter()
        .any(|p| p.state != ferry_catalog::PartState::Done)
    {
        return Ok(None);
    }
    let mut look = vec![all; plan.files.len()];
    for p in &parts {
        for r in &p.versions {
            if let Some(l) = look.get_mut(r.file as usize) {
                *l = !growing.contains(&r.file);
            }
        }
    }
    // What each file looks like now.
    let (store, dir, files) = (
        inner.store.clone(),
        PathBuf::from(&t.source_path),
        plan.files.clone(),
    );
    let now = tokio::task::spawn_blocking(move || {
        files
            .iter()
            .zip(look)
            .map(|(f, look)| {
                if !look {
                    return Ok(None);
                }
                let p = dir.join(&f.path);
                store
                    .stat(&p)
                    .map(|(s, m, v)| Some((s, m, v.0)))
                    .map_err(|e| format!("{}: {e}", p.display()))
            })
            .collect::<Result<Vec<_>, String>>()
    })
    .await
    .map_err(|e| RunError::Fatal(e.to_string()))?
    .map_err(|e| RunError::Retry(format!("looking at the files before the seal: {e}")))?;
    let mut now = now;
    let mut resized = vec![false; plan.files.len()];
    for (fi, f) in plan.files.iter().enumerate() {
        if writing && now[fi].is_some_and(|n| n.0 != f.size) {
            resized[fi] = true;
            now[fi] = None;
            continue;
        }
        if let Some(n) = now[fi].filter(|n| n.0 != f.size) {
            // A watched transfer's plan stays until its next run plans
            // again: that run starts its file table from the plan's, so
            // every file keeps its position (and chunk keys their
            // meaning) for the agents still sending the old parts.
            if all {
                inner.catalog.drop_plan(id).await?;
            }
            return Err(RunError::Retry(format!(
                "{} changed size while it was sent ({} to {} bytes); planning the transfer again",
                f.path, f.size, n.0
            )));
        }
    }
    let mut hashes: HashMap<u64, Hash> = HashMap::new();
    let mut seen: Vec<Vec<(u64, i64, [u64; 4])>> = vec![Vec::new(); plan.files.len()];
    let mut parts_of: Vec<Vec<u64>> = vec![Vec::new(); plan.files.len()];
    let mut requeue: BTreeSet<u64> = BTreeSet::new();
    for p in &parts {
        let keys = part_keys(map, &p.range);
        if keys.len() != p.hashes.len() {
            warn!(transfer = %id, part = p.range.part, "a part's record has {} hashes for {} chunks; reading it again", p.hashes.len(), keys.len());
            requeue.insert(p.range.part);
            continue;
        }
        hashes.extend(
            keys.iter()
                .copied()
                .zip(p.hashes.iter().copied())
                .filter(|(k, _)| !resized.get((k >> 32) as usize).copied().unwrap_or(false)),
        );
        for r in &p.versions {
            let f = r.file as usize;
            if f < seen.len() && !resized[f] && !growing.contains(&r.file) {
                seen[f].push(r.before);
                seen[f].push(r.after);
                parts_of[f].push(p.range.part);
            }
        }
    }
    let mut changed = Vec::new();
    for (fi, obs) in seen.iter().enumerate() {
        if obs.iter().any(|o| Some(*o) != now[fi]) {
            changed.push(plan.files[fi].path.clone());
            requeue.extend(parts_of[fi].iter().copied());
        }
    }
    if !requeue.is_empty() {
        if !changed.is_empty() {
            warn!(
                transfer = %id,
                files = changed.len(),
                first = %changed[0],
                "files changed while their parts were read; reading those parts again"
            );
        }
        let list: Vec<u64> = requeue.into_iter().collect();
        inner.catalog.requeue_parts(id, &list).await?;
        return Ok(None);
    }
    Ok(Some(Checked { hashes, now }))
}

/// Seals striped transfer `t` from its done parts: the manifest to
/// commit, or `None` when parts were queued again (see [`check_parts`]).
///
/// # Errors
/// As [`check_parts`].
async fn seal(
    inner: &Arc<Inner>,
    t: &Transfer,
    plan: &TransferPlan,
    map: &Arc<ChunkMap>,
) -> Result<Option<Sealed>, RunError> {
    let Some(Checked { hashes, now }) =
        check_parts(inner, t, plan, map, true, false, &HashSet::new()).await?
    else {
        return Ok(None);
    };
    let now: Vec<(u64, i64, [u64; 4])> = now
        .into_iter()
        .map(|n| n.ok_or_else(|| RunError::Fatal("a file of the plan was not looked at".into())))
        .collect::<Result<_, _>>()?;
    let mut entries = Vec::with_capacity(plan.files.len());
    let mut versions = Vec::with_capacity(plan.files.len());
    for (fi, f) in plan.files.iter().enumerate() {
        let n = ferry_proto::manifest::chunk_count(f.size, plan.chunk_size) as u32;
        let mut chunks = Vec::with_capacity(n as usize);
        for ci in 0..n {
            let k = map
                .index(fi as u32, ci)
                .and_then(|k| hashes.get(&k))
                .ok_or_else(|| {
                    RunError::Retry(format!("no part recorded chunk {ci} of {}", f.path))
                })?;
            chunks.push(*k);
        }
        entries.push(FileEntry {
            path: f.path.clone(),
            size: f.size,
            mode: f.mode,
            mtime_ns: now[fi].1,
            chunks,
        });
        versions.push(FileVersion(now[fi].2));
    }
    let n = entries.len();
    Ok(Some(Sealed {
        manifest: Arc::new(Manifest {
            chunk_size: plan.chunk_size,
            files: entries,
            markers: plan.markers.clone(),
        }),
        map: map.clone(),
        slots: Arc::new((0..n).map(Some).collect()),
        // A pushed directory is committed when it is pushed.
        times: SourceTimes {
            committed_ms: t.created_at,
            opened_ms: 0,
        },
        siblings: Vec::new(),
        recheck: Some(versions),
    }))
}

#[cfg(test)]
mod tests {
    use super::even_share;

    #[test]
    fn the_last_parts_are_split_evenly_among_the_pool() {
        // Plenty left: each claim is max_parts.
        assert_eq!(even_share(160, 4, 4), 4);
        // 6 left for 4 agents: 2 each (rounded up), not 4 to the first.
        assert_eq!(even_share(6, 4, 4), 2);
        assert_eq!(even_share(3, 4, 4), 1);
        // Nothing claimable still asks for one (a lapsed lease may be).
        assert_eq!(even_share(0, 4, 4), 1);
        // Never above max_parts, whatever the split.
        assert_eq!(even_share(1000, 2, 1), 2);
        assert_eq!(even_share(5, 4, 0), 4);
    }
}
