//! Predictive replication: the transfer of a checkpoint that is still being
//! written (ARCHITECTURE.md, "Data path", steps 1-2).
//!
//! The watcher publishes a [`CheckpointView`] of the checkpoint each time it
//! changes. From it this module:
//!
//! - announces new files and new sizes to the sink ([`Control::Files`]);
//! - streams chunks as soon as they can no longer change: whole files once
//!   they are complete, and the full chunks below the current end of files
//!   that are only ever appended to (DCP `.distcp`, torch.save archives),
//!   while they are still being written;
//! - once such a file is complete, reads it again and re-sends any chunk
//!   whose bytes changed, so a file rewritten below its old end is caught.
//!   This second read compares a fast XXH3-64 of each chunk with the one
//!   taken when the chunk was sent, and computes BLAKE3 again only for
//!   chunks that differ: it runs between the last rank's close and the
//!   commit, so its speed is commit-to-replica lag. XXH3 guards against a
//!   training job rewriting its own file, not against an adversary with
//!   write access to the checkpoint; what reaches the sink is verified with
//!   BLAKE3 either way;
//! - in a pool on PostgreSQL, hands what can no longer change (complete
//!   files, full chunks of appended files) to the pool as parts any source
//!   agent claims, while the checkpoint is written once enough of it
//!   waits, and the rest at its commit ([`parts::stripe_watched`],
//!   [`HandOver`]), keeping the parts' hashes;
//! - at commit, seals the manifest from the chunk hashes of the frozen file
//!   set (temporaries and filtered files were never in the view) and hands
//!   it to the commit loop shared with `ferry push`.
//!
//! A checkpoint the watcher declares abandoned or deleted cancels the
//! transfer; the sink then removes its staging data.

use crate::formats::Format;
use ferry_proto::manifest::{chunk_count, chunk_len};

use super::*;

/// One file of a checkpoint as the watcher last saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ViewFile {
    /// Path (relative to the checkpoint directory), size in bytes, mode
    /// and mtime from the watcher's last `stat`.
    pub info: FileInfo,
    /// Closed after its last write (inotify), or quiet for the quiet period
    /// and passing its format check (poll mode).
    pub complete: bool,
    /// Only ever appended to, so full chunks below its current end may be
    /// sent before it is complete (see [`crate::formats::appendable`]).
    pub appendable: bool,
}

/// Where a watched checkpoint stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ViewState {
    /// Being written.
    Open,
    /// The format's commit predicate holds.
    Committed {
        /// Paths of the commit markers in the order the sink publishes
        /// them (last, after every other file).
        markers: Vec<String>,
        /// Commit time at the source, Unix ms (the marker's appearance).
        committed_ms: i64,
        /// Markers beside the checkpoint directory that name this
        /// checkpoint (DeepSpeed `latest`, Megatron's tracker): `(file
        /// name, content)`, written beside the replica after it is in
        /// place.
        siblings: Vec<(String, Vec<u8>)>,
    },
    /// Abandoned or deleted: the transfer is cancelled with this reason.
    Gone(String),
}

/// What the watcher knows about one checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointView {
    /// Files to replicate: temporaries and files excluded by the root's
    /// globs or profile are not listed.
    pub files: Vec<ViewFile>,
    /// Open, committed or gone.
    pub state: ViewState,
    /// When the checkpoint opened, Unix ms.
    pub opened_ms: i64,
}

/// Per file of the table: what was sent.
#[derive(Debug, Default, Clone)]
struct Track {
    /// Hash of each chunk as sent or as found at the sink, by chunk index.
    hashes: Vec<Option<Hash>>,
    /// XXH3-64 of each chunk's bytes when its hash was taken.
    quick: Vec<Option<u64>>,
    /// Some chunks went while the file was still growing.
    provisional: bool,
    /// `(size, mtime_ns)` of the file when it was last read in full with
    /// every chunk confirmed; `None` until then.
    verified: Option<(u64, i64)>,
}

/// Work for the reading thread: chunks `from..to` of one file.
struct FileJob {
    idx: u32,
    path: PathBuf,
    size: u64,
    from: u32,
    to: u32,
    /// Hashes already at the sink for chunks `from..to` (`None`: unknown).
    known: Vec<Option<Hash>>,
    /// XXH3-64 of those chunks when their hashes were taken.
    quick: Vec<Option<u64>>,
    /// The whole file is read, to confirm every chunk.
    full: bool,
}

struct JobResult {
    idx: u32,
    full: bool,
    /// `(chunk, BLAKE3, XXH3-64)` of every chunk read.
    hashes: Vec<(u32, Hash, u64)>,
    /// Some chunk was sent (not just confirmed).
    sent: bool,
    /// `(size, mtime_ns)` if the file did not change while it was read.
    stable: Option<(u64, i64)>,
}

/// Reads the jobs' chunks in order, hashes them and queues those the sink
/// does not have with the same hash. A file that vanished or shrank while
/// read ends its job early and is reported as not stable; once `stop`
/// says so, the round ends after the chunk in hand (the jobs left, and
/// the rest of the one under way, are not stable and go again); once
/// `stop_between` says so, before the next job.
fn run_jobs(
    inner: &Inner,
    jobs: Vec<FileJob>,
    have: &HashSet<u64>,
    chunk_size: u32,
    out: &mpsc::Sender<Record>,
    stop: &dyn Fn() -> bool,
    stop_between: &dyn Fn() -> bool,
) -> Result<Vec<JobResult>, String> {
    let mut results = Vec::with_capacity(jobs.len());
    for job in jobs {
        if stop() || stop_between() {
            break;
        }
        let mut r = JobResult {
            idx: job.idx,
            full: job.full,
            hashes: Vec::new(),
            sent: false,
            stable: None,
        };
        let file = match inner.store.open(&job.path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                results.push(r);
                continue;
            }
            Err(e) => return Err(format!("{}: {e}", job.path.display())),
        };
        let before = file
            .current()
            .map_err(|e| format!("{}: {e}", job.path.display()))?;
        let mut complete_read = true;
        for c in job.from..job.to {
            if stop() {
                complete_read = false;
                break;
            }
            let len = chunk_len(job.size, chunk_size, u64::from(c)) as usize;
            // A pooled buffer per chunk, not zero-filled: a sent chunk's
            // record keeps it until quinn is done with it.
            let mut data = inner.bufs.take(len);
            if file
                .read_range_into(u64::from(c) * u64::from(chunk_size), len as u64, &mut data)
                .is_err()
            {
                // Shorter than it was: the next view shows the new size.
                inner.bufs.give(data);
                complete_read = false;
                break;
            }
            let i = (c - job.from) as usize;
            let quick = xxhash_rust::xxh3::xxh3_64(&data);
            let known = job.known.get(i).copied().flatten();
            if let Some(h) = known.filter(|_| job.quick.get(i).copied().flatten() == Some(quick)) {
                // Unchanged since it was sent.
                r.hashes.push((c, h, quick));
                inner.bufs.give(data);
                continue;
            }
            let hash = *blake3::hash(&data).as_bytes();
            r.hashes.push((c, hash, quick));
            let key = u64::from(job.idx) << 32 | u64::from(c);
            if known == Some(hash) || (known.is_none() && have.contains(&key)) {
                inner.bufs.give(data);
                continue;
            }
            maybe_corrupt(inner, &mut data);
            r.sent = true;
            out.blocking_send(Record {
                header: RecordHeader {
                    file: job.idx,
                    chunk: c,
                    len: len as u32,
                    hash,
                },
                data: inner.bufs.bytes(data),
            })
            .map_err(|_| "sending stopped".to_string())?;
        }
        // Stable when nothing changed while it was read: the same version
        // token (size, mtime, and on POSIX the inode and ctime too) before
        // and after.
        if let Ok(after) = inner.store.stat(&job.path) {
            if complete_read && before.2 == after.2 && before.0 == job.size {
                r.stable = Some((before.0, before.1));
            }
        }
        results.push(r);
    }
    Ok(results)
}

/// When a send round of a striped checkpoint still being written ends
/// early, before its next file: at its commit, or once what waits beyond
/// the round adds up to more than [`parts::writing_threshold`] (then the
/// pool takes it): complete files that the round does not read in full
/// and that were not confirmed before it, and full chunks of files only
/// ever appended to beyond what the round reads or was sent before.
struct HandOver {
    view: std::sync::Mutex<watch::Receiver<CheckpointView>>,
    /// Paths of the files read in full by this round or confirmed before.
    settled: HashSet<String>,
    /// Bytes from the start of each file sent before this round or read
    /// by it (its full chunks, in order), by path.
    covered: HashMap<String, u64>,
    /// Chunk size, bytes.
    chunk_size: u32,
    /// [`parts::writing_threshold`] at the round's start, bytes.
    limit: u64,
    /// Once due, due for the rest of the round.
    fired: std::sync::atomic::AtomicBool,
}

impl HandOver {
    /// For a round of `jobs` (`view` follows the watcher): `None` when the pool would not take anything now
    /// (see [`parts::writing_threshold`]).
    fn new(
        inner: &Inner,
        view: &watch::Receiver<CheckpointView>,
        jobs: &[FileJob],
        table: &[FileInfo],
        tracks: &[Track],
        chunk_size: u32,
    ) -> Option<Self> {
        let limit = parts::writing_threshold(inner)?;
        let mut covered: HashMap<String, u64> = HashMap::new();
        for (f, tr) in table.iter().zip(tracks) {
            let sent = tr.hashes.iter().take_while(|h| h.is_some()).count() as u64;
            covered.insert(f.path.clone(), sent * u64::from(chunk_size));
        }
        for j in jobs.iter().filter(|j| !j.full) {
            if let Some(f) = table.get(j.idx as usize) {
                let to = u64::from(j.to) * u64::from(chunk_size);
                let c = covered.entry(f.path.clone()).or_default();
                *c = (*c).max(to);
            }
        }
        let mut settled: HashSet<String> = jobs
            .iter()
            .filter(|j| j.full)
            .filter_map(|j| table.get(j.idx as usize).map(|f| f.path.clone()))
            .collect();
        for (f, tr) in table.iter().zip(tracks) {
            if tr.verified == Some((f.size, f.mtime_ns)) {
                settled.insert(f.path.clone());
            }
        }
        Some(HandOver {
            view: std::sync::Mutex::new(view.clone()),
            settled,
            covered,
            chunk_size,
            limit,
            fired: Default::default(),
        })
    }

    /// True once the round should end: the checkpoint is committed, or its
    /// what waits beyond the round adds up to more than the limit; then for
    /// the rest of the round. Looks at the watcher's view only when it
    /// changed.
    fn due(&self) -> bool {
        if self.fired.load(Ordering::Relaxed) {
            return true;
        }
        let mut rx = crate::lock::lock(&self.view);
        if !rx.has_changed().unwrap_or(false) {
            return false;
        }
        let v = rx.borrow_and_update();
        let cs = u64::from(self.chunk_size.max(1));
        let waiting = |f: &ViewFile| {
            if f.complete {
                if self.settled.contains(&f.info.path) {
                    0
                } else {
                    f.info.size
                }
            } else if f.appendable {
                let full = f.info.size / cs * cs;
                full.saturating_sub(self.covered.get(&f.info.path).copied().unwrap_or(0))
            } else {
                0
            }
        };
        let due = matches!(v.state, ViewState::Committed { .. })
            || v.files.iter().map(waiting).sum::<u64>() > self.limit;
        self.fired.store(due, Ordering::Relaxed);
        due
    }
}

/// Replicates a checkpoint the watcher follows, from its first files to
/// the sink's publish.
pub(super) async fn run_watched(
    inner: &Arc<Inner>,
    c: &LinkConn,
    t: Transfer,
    mut view: watch::Receiver<CheckpointView>,
) -> Result<(), RunError> {
    let id = t.id;
    let fresh = begin(inner, &t).await?;
    let dir = PathBuf::from(&t.source_path);
    let chunk_size = inner.cfg.chunk_size;
    let first = view.borrow_and_update().clone();
    if let ViewState::Gone(why) = &first.state {
        return Err(RunError::Cancelled(why.clone()));
    }
    // A plan stored by an earlier run (what could no longer change striped while the
    // checkpoint was written or the rest at the commit, then this agent
    // took the watch over): its table's order, so that
    // its parts' chunk keys name the same files (files only this run
    // sees go after).
    // Weights first when the sink speaks it (then never striped).
    let weights_first = opens_weights_first(c, &t);
    let planned = if parts::watched_striped(inner, &t, weights_first) {
        inner.catalog.transfer_plan(id).await?
    } else {
        None
    };
    let mut table: Vec<FileInfo> = planned.map(|p| p.files).unwrap_or_default();
    for f in &first.files {
        match table.iter_mut().find(|e| e.path == f.info.path) {
            Some(e) => *e = f.info.clone(),
            None => table.push(f.info.clone()),
        }
    }
    let mut pos: HashMap<String, u32> = table
        .iter()
        .enumerate()
        .map(|(i, f)| (f.path.clone(), i as u32))
        .collect();
    let mut tracks: Vec<Track> = vec![Track::default(); table.len()];
    let total = |table: &[FileInfo]| table.iter().map(|f| f.size).sum::<u64>();
    let progress = track_run(inner, c, &t, total(&table));
    let (mut rx, have) = open_on_sink(inner, c, &t, fresh, table.clone(), false, false).await?;
    // What the sink holds already (a resume) counts as done.
    let map = ChunkMap::new(&table, chunk_size);
    let skipped = map.bytes_of(have.iter().copied());
    progress.skipped.store(skipped, Ordering::Relaxed);
    let mut have = Arc::new(have);
    info!(
        transfer = %id,
        files = table.len(),
        path = %dir.display(),
        "streaming a checkpoint as it is written"
    );
    let mut need: Vec<u64> = Vec::new();
    // Weights first (`weights_first`, above): which files are optimizer
    // state follows the format, read again at the commit (the watcher may
    // recognise it after the run began); `split` is decided there.
    let mut format: Option<Format> = t.format.as_deref().and_then(|f| f.parse().ok());
    let mut split: Option<bool> = None;
    let mut weights_root: Option<Hash> = None;
    // The commit time of the first committed view: a format whose marker
    // lies beside the directory (DeepSpeed `latest`) has none inside it,
    // and each later view would say the time it was made.
    let mut first_commit: Option<i64> = None;
    // Whether the rest was offered to the pool at the commit.
    let mut striping_tried = false;
    // `planned_at` of the plan this run stored last (what could no longer change
    // striped while the checkpoint is written, or its rest at the commit).
    let mut made: Option<i64> = None;
    let striped = parts::watched_striped(inner, &t, weights_first);
    let (markers, committed_ms, siblings, last) = loop {
        let v = view.borrow_and_update().clone();
        let committed = match &v.state {
            ViewState::Gone(why) => return Err(RunError::Cancelled(why.clone())),
            ViewState::Committed { .. } => true,
            ViewState::Open => false,
        };
        if let (true, None, ViewState::Committed { committed_ms, .. }) =
            (committed, first_commit, &v.state)
        {
            // The commit time the watcher recorded once (a restarted run
            // finds it too), else this view's.
            let row = inner.catalog.transfer(id).await.ok().flatten();
            first_commit = Some(
                row.as_ref()
                    .and_then(|r| r.committed_at)
                    .unwrap_or(*committed_ms),
            );
            if let Some(f) = row.and_then(|r| r.format).and_then(|f| f.parse().ok()) {
                format = Some(f);
            }
        }
        if committed && weights_first && split.is_none() {
            let verdict = match format {
                Some(f) => crate::formats::splits_weights(f),
                None => Err("its format is not known".to_string()),
            };
            split = Some(verdict.is_ok());
            if let Err(why) = verdict {
                info!(transfer = %id, "weights-first: this checkpoint is sent whole: {why}");
            }
        }
        // New files and new sizes go to the sink before their chunks.
        let mut grown = Vec::new();
        for f in &v.files {
            match pos.get(&f.info.path) {
                Some(&i) if table[i as usize] == f.info => {}
                Some(&i) => {
                    table[i as usize] = f.info.clone();
                    grown.push(f.info.clone());
                }
                None => {
                    pos.insert(f.info.path.clone(), table.len() as u32);
                    table.push(f.info.clone());
                    tracks.push(Track::default());
                    grown.push(f.info.clone());
                }
            }
        }
        if !grown.is_empty() {
            c.ctl.send(&Control::Files { id, files: grown }).await?;
            progress.total.store(total(&table), Ordering::Relaxed);
        }
        // Chunks the sink asked for again are sent again: by this run,
        // before the pool's next round while the checkpoint is written (a
        // round's parts send only what the sink lacks, and the sink may
        // hold other bytes under the same key).
        need.sort_unstable();
        need.dedup();
        let asked = !need.is_empty();
        c.sched.counters.retries.inc_by(need.len() as u64);
        for k in need.drain(..) {
            if let Some(tr) = tracks.get_mut((k >> 32) as usize) {
                if let Some(h) = tr.hashes.get_mut(k as u32 as usize) {
                    *h = None;
                }
                if let Some(q) = tr.quick.get_mut(k as u32 as usize) {
                    *q = None;
                }
                tr.verified = None;
            }
            // Asked for again: whatever the sink said it had, it lacks now.
            if have.contains(&k) {
                Arc::make_mut(&mut have).remove(&k);
            }
        }
        // What can no longer change goes to the pool: complete files and
        // full chunks of appended files while the checkpoint is written
        // (when enough of them wait), the rest at the commit.
        if striped && !(committed && striping_tried) && (committed || !asked) {
            striping_tried |= committed;
            let (files, markers): (Vec<u32>, Vec<u32>) = match &v.state {
                ViewState::Committed { markers, .. } => (
                    v.files.iter().map(|f| pos[&f.info.path]).collect(),
                    markers.iter().filter_map(|m| pos.get(m).copied()).collect(),
                ),
                _ => (
                    v.files
                        .iter()
                        .filter(|f| f.complete)
                        .map(|f| pos[&f.info.path])
                        .collect(),
                    Vec::new(),
                ),
            };
            // Before the commit, the full chunks of files only ever appended
            // to go too (they cannot change; the run keeps their tails).
            let growing: Vec<(u32, u32)> = if committed {
                Vec::new()
            } else {
                v.files
                    .iter()
                    .filter(|f| !f.complete && f.appendable)
                    .map(|f| {
                        let full = (f.info.size / u64::from(chunk_size)) as u32;
                        (pos[&f.info.path], full)
                    })
                    .collect()
            };
            let grows: HashSet<u32> = growing.iter().map(|(f, _)| *f).collect();
            for f in &v.files {
                let tr = &mut tracks[pos[&f.info.path] as usize];
                let n = chunk_count(f.info.size, chunk_size) as usize;
                tr.hashes.resize(n, None);
                tr.quick.resize(n, None);
            }
            // A complete file's chunk is known once the run read the whole
            // file and confirmed it; a growing file's once the run sent it.
            let known = |f: u32, ci: u64| {
                let (Some(tr), Some(vf)) = (tracks.get(f as usize), table.get(f as usize)) else {
                    return false;
                };
                let hashed = tr.hashes.get(ci as usize).copied().flatten().is_some();
                hashed
                    && (grows.contains(&f)
                        || tr
                            .verified
                            .is_some_and(|(size, mtime)| (size, mtime) == (vf.size, vf.mtime_ns)))
            };
            let watched = parts::WatchedFiles {
                table: &table,
                files,
                growing,
                markers,
                committed,
                made,
                known: &known,
            };
            let rest = parts::stripe_watched(
                inner, c, &t, watched, &mut rx, &mut need, &progress, &mut view,
            )
            .await?;
            if let Some(rest) = rest {
                made = Some(rest.planned_at);
                have = Arc::new(rest.have);
                let read_in_parts: HashSet<u64> = rest.hashes.iter().map(|(k, _)| *k).collect();
                // Every batch this run sent was confirmed before the open:
                // a chunk it sent that the sink lacks now (asked for again
                // meanwhile) goes again, as if asked for.
                for (f, tr) in tracks.iter().enumerate() {
                    for (ci, h) in tr.hashes.iter().enumerate() {
                        let k = (f as u64) << 32 | ci as u64;
                        if h.is_some() && !have.contains(&k) && !read_in_parts.contains(&k) {
                            need.push(k);
                        }
                    }
                }
                for (k, h) in rest.hashes {
                    let (f, ci) = ((k >> 32) as usize, k as u32 as usize);
                    if let Some(tr) = tracks.get_mut(f) {
                        // Sent while the file grows: read again whole once
                        // it is complete.
                        if grows.contains(&(f as u32)) {
                            tr.provisional = true;
                        }
                        if let Some(slot) = tr.hashes.get_mut(ci) {
                            // Sent by this run before, and changed since:
                            // the sink holds the old bytes (the parts send
                            // only what it lacked), so it goes again
                            // (below, as if asked for).
                            if slot.is_some_and(|old| old != h) && have.contains(&k) {
                                need.push(k);
                            }
                            *slot = Some(h);
                        }
                        // Its quick hash was of what this run read.
                        if let Some(q) = tr.quick.get_mut(ci) {
                            *q = None;
                        }
                    }
                }
                // A file read in parts, unchanged since, whose other
                // chunks this run hashed at the same size and mtime,
                // is confirmed. One this run read at another version
                // (rewritten after the commit, in place) loses this
                // run's hashes, and so does one with chunks an
                // earlier run left out of its plan: read again below.
                for (f, size, mtime) in rest.stable {
                    if let Some(tr) = tracks.get_mut(f as usize) {
                        if tr.verified != Some((size, mtime)) {
                            for (ci, h) in tr.hashes.iter_mut().enumerate() {
                                let k = u64::from(f) << 32 | ci as u64;
                                if !read_in_parts.contains(&k) {
                                    *h = None;
                                }
                            }
                        }
                        if tr.hashes.iter().all(Option::is_some) {
                            tr.verified = Some((size, mtime));
                            tr.provisional = false;
                        } else {
                            tr.verified = None;
                        }
                    }
                }
                continue;
            }
        }
        let mut jobs = Vec::new();
        let mut done = committed;
        for f in &v.files {
            let i = pos[&f.info.path];
            let tr = &mut tracks[i as usize];
            let size = f.info.size;
            let n = chunk_count(size, chunk_size) as u32;
            tr.hashes.resize(n as usize, None);
            tr.quick.resize(n as usize, None);
            let path = dir.join(&f.info.path);
            if f.complete || committed {
                if tr.verified == Some((size, f.info.mtime_ns)) {
                    continue;
                }
                done = false;
                jobs.push(FileJob {
                    idx: i,
                    path,
                    size,
                    from: 0,
                    to: n,
                    known: tr.hashes.clone(),
                    quick: tr.quick.clone(),
                    full: true,
                });
            } else {
                done = false;
                if !f.appendable {
                    continue;
                }
                // Full chunks below the current end of an appended file.
                let ready = (size / u64::from(chunk_size)) as u32;
                if let Some(from) = tr.hashes[..ready as usize].iter().position(Option::is_none) {
                    let from = from as u32;
                    jobs.push(FileJob {
                        idx: i,
                        path,
                        size,
                        from,
                        to: ready,
                        known: tr.hashes[from as usize..ready as usize].to_vec(),
                        quick: tr.quick[from as usize..ready as usize].to_vec(),
                        full: false,
                    });
                }
            }
        }
        // Metadata first, then weights, then optimizer state.
        let class = |i: u32| crate::formats::send_class(format, &table[i as usize].path);
        jobs.sort_by_key(|j| class(j.idx));
        if split == Some(true) && weights_root.is_none() && !done {
            let optimizer = |j: &FileJob| class(j.idx) == crate::formats::SendClass::Optimizer;
            if jobs.iter().all(optimizer) {
                // Every metadata and weight file is read in full and its
                // chunks handed over: commit them as the weights-only
                // version, then send the optimizer state.
                let at = first_commit.unwrap_or_default();
                weights_root =
                    Some(commit_weights(inner, c, &t, &v, at, &pos, &tracks, &table).await?);
                continue;
            }
            jobs.retain(|j| !optimizer(j));
        }
        if done {
            let ViewState::Committed {
                markers,
                committed_ms,
                siblings,
            } = v.state.clone()
            else {
                continue;
            };
            break (markers, first_commit.unwrap_or(committed_ms), siblings, v);
        }
        if !jobs.is_empty() {
            let t_round = std::time::Instant::now();
            let (n_full, n_chunks) = (
                jobs.iter().filter(|j| j.full).count(),
                jobs.iter().map(|j| u64::from(j.to - j.from)).sum::<u64>(),
            );
            let (inner2, have2) = (inner.clone(), have.clone());
            // Weights first: a round that began before the commit ends at
            // it, so that the weights left go before the optimizer state.
            let view2 = view.clone();
            let interrupt = weights_first && !committed;
            // Striped: a round that began while the checkpoint was written
            // ends at its commit (after the chunk in hand), or before its
            // next file once enough of what can no longer change waits
            // beyond it, so that the pool takes it (above).
            let handover = (striped && !committed)
                .then(|| HandOver::new(inner, &view, &jobs, &table, &tracks, chunk_size))
                .flatten();
            let results = send_round(
                inner,
                c,
                id,
                &progress,
                &mut rx,
                &mut need,
                None,
                move |out| {
                    // At the commit, a striped run hands the rest over at
                    // once: chunks it read are at the sink (the pool reads
                    // them again, it does not send them).
                    let stop = || {
                        (interrupt || handover.is_some())
                            && matches!(view2.borrow().state, ViewState::Committed { .. })
                    };
                    // Between files: a file read in part would be read
                    // again whole by the pool.
                    let between = || handover.as_ref().is_some_and(HandOver::due);
                    run_jobs(&inner2, jobs, &have2, chunk_size, out, &stop, &between)
                },
            )
            .await?;
            debug!(
                transfer = %id,
                files = n_full,
                chunks = n_chunks,
                committed,
                ms = t_round.elapsed().as_millis() as u64,
                "send round (files = whole-file reads)"
            );
            let mut moved = false;
            for r in results {
                moved |= !r.hashes.is_empty() || r.stable.is_some();
                let tr = &mut tracks[r.idx as usize];
                for (ch, h, q) in &r.hashes {
                    if let Some(slot) = tr.hashes.get_mut(*ch as usize) {
                        *slot = Some(*h);
                    }
                    if let Some(slot) = tr.quick.get_mut(*ch as usize) {
                        *slot = Some(*q);
                    }
                }
                if r.full {
                    if let Some(stable) = r.stable {
                        tr.verified = Some(stable);
                        tr.provisional = false;
                    }
                } else if r.sent {
                    tr.provisional = true;
                }
            }
            if moved {
                continue;
            }
            // Nothing could be read (files vanished or shrank): wait for
            // the watcher's next view instead of spinning.
        }
        tokio::select! {
            r = view.changed() => if r.is_err() {
                return Err(RunError::Retry("the watcher stopped following this checkpoint".into()));
            },
            m = rx.recv() => match m {
                Some(Control::Need { chunks, .. }) => need.extend(chunks),
                Some(Control::Have { .. }) => {}
                Some(Control::Refuse { reason, .. }) => {
                    return Err(RunError::Fatal(format!("sink refused: {reason}")))
                }
                Some(Control::Cancel { reason, .. }) => {
                    return Err(RunError::Fatal(format!("sink cancelled: {reason}")))
                }
                Some(m) if weights_answer(inner, id, &m) => {}
                Some(other) => {
                    return Err(RunError::Retry(format!("unexpected {} from sink", other.name())))
                }
                None => return Err(RunError::Retry("connection to the sink lost".into())),
            },
            e = c.conn.closed() => return Err(RunError::Retry(format!("connection to the sink lost: {e}"))),
            _ = inner.shutdown.cancelled() => return Err(RunError::Shutdown),
            // Appended files can grow without a new view (poll mode).
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    };

    let (manifest, slots, map) = seal(&last.files, &markers, &pos, &tracks, &table, chunk_size)?;
    let bytes_total = manifest.bytes();
    progress.total.store(bytes_total, Ordering::Relaxed);
    inner
        .catalog
        .set_transfer_size(t.id, bytes_total, manifest.files.len() as u64)
        .await?;
    inner
        .catalog
        .note_transfer_progress(t.id, progress.note())
        .await?;
    info!(
        transfer = %id,
        files = manifest.files.len(),
        bytes_total,
        "checkpoint committed; manifest sealed"
    );
    let sealed = Sealed {
        manifest: Arc::new(manifest),
        map: Arc::new(map),
        slots: Arc::new(slots),
        times: SourceTimes {
            committed_ms,
            opened_ms: last.opened_ms,
        },
        siblings,
        recheck: None,
    };
    commit_loop(inner, c, &t, &dir, &progress, &mut rx, need, sealed).await
}

/// Seals the manifest of `files` (a frozen file set): non-markers by
/// path, then the `markers` in the format's order, each file's chunk
/// hashes from `tracks`. Returns it with each file-table position's index
/// in it and the chunk map of the table at the final sizes.
fn seal(
    files: &[ViewFile],
    markers: &[String],
    pos: &HashMap<String, u32>,
    tracks: &[Track],
    table: &[FileInfo],
    chunk_size: u32,
) -> Result<(Manifest, Vec<Option<usize>>, ChunkMap), RunError> {
    let rank = |p: &str| markers.iter().position(|m| m == p);
    let mut files: Vec<&ViewFile> = files.iter().collect();
    files.sort_by(|a, b| {
        let ka = (rank(&a.info.path).map_or(0, |r| r + 1), &a.info.path);
        let kb = (rank(&b.info.path).map_or(0, |r| r + 1), &b.info.path);
        ka.cmp(&kb)
    });
    let mut entries = Vec::with_capacity(files.len());
    let mut slots: Vec<Option<usize>> = vec![None; table.len()];
    let mut map = ChunkMap::new(table, chunk_size);
    for (mi, f) in files.iter().enumerate() {
        let i = pos[&f.info.path];
        slots[i as usize] = Some(mi);
        map.set_size(i, f.info.size);
        let chunks: Option<Vec<Hash>> = tracks[i as usize].hashes.iter().copied().collect();
        let Some(chunks) = chunks else {
            return Err(RunError::Retry(format!(
                "{} has chunks not yet read at commit",
                f.info.path
            )));
        };
        entries.push(FileEntry {
            path: f.info.path.clone(),
            size: f.info.size,
            mode: f.info.mode,
            mtime_ns: f.info.mtime_ns,
            chunks,
        });
    }
    let marker_idx = files
        .iter()
        .enumerate()
        .filter(|(_, f)| rank(&f.info.path).is_some())
        .map(|(i, _)| i as u32)
        .collect();
    let manifest = Manifest {
        chunk_size,
        files: entries,
        markers: marker_idx,
    };
    Ok((manifest, slots, map))
}

/// Sends a weights-first transfer's weights-only commit
/// ([`Commit::weights_only`]) for committed view `v` (committed at
/// `committed_ms`, Unix ms): the manifest of its
/// metadata and weight files (with the markers among them), once every
/// chunk handed to the link's queues is written, naming the batches so
/// far. Returns the manifest's root, which the sink's answer carries.
#[allow(clippy::too_many_arguments)]
async fn commit_weights(
    inner: &Arc<Inner>,
    c: &LinkConn,
    t: &Transfer,
    v: &CheckpointView,
    committed_ms: i64,
    pos: &HashMap<String, u32>,
    tracks: &[Track],
    table: &[FileInfo],
) -> Result<Hash, RunError> {
    let ViewState::Committed {
        markers, siblings, ..
    } = &v.state
    else {
        return Err(RunError::Retry(
            "weights-only commit of an open checkpoint".into(),
        ));
    };
    let format: Option<Format> = inner
        .catalog
        .transfer(t.id)
        .await
        .ok()
        .flatten()
        .and_then(|now| now.format)
        .or_else(|| t.format.clone())
        .and_then(|f| f.parse().ok());
    let weights: Vec<ViewFile> = v
        .files
        .iter()
        .filter(|f| {
            crate::formats::send_class(format, &f.info.path) != crate::formats::SendClass::Optimizer
        })
        .cloned()
        .collect();
    let (manifest, _, _) = seal(&weights, markers, pos, tracks, table, inner.cfg.chunk_size)?;
    let root = manifest.root();
    // Every chunk queued so far written to a stream: the batch count is
    // final for them.
    loop {
        let changes = c.sched.changes();
        tokio::pin!(changes);
        changes.as_mut().enable();
        if c.sched.drained(t.id) {
            break;
        }
        tokio::select! {
            _ = &mut changes => {}
            e = c.conn.closed() => return Err(RunError::Retry(format!("connection to the sink lost: {e}"))),
            _ = inner.shutdown.cancelled() => return Err(RunError::Shutdown),
        }
    }
    let (batches, lost) = c.sched.commit_point(t.id);
    crate::lock::lock(&inner.weights_roots).insert(t.id, root);
    let phases = if c.version >= ferry_proto::wire::PHASES_VERSION {
        inner.phase_clocks.phases(t.id).unwrap_or_default()
    } else {
        Default::default()
    };
    let checkpoint = checkpoint_info(c, t, &manifest, t.readers);
    info!(
        transfer = %t.id,
        files = manifest.files.len(),
        bytes = manifest.bytes(),
        root = %hex(&root),
        "weights-only commit: metadata and weights are all sent"
    );
    c.ctl
        .send(&Control::Commit(Commit {
            id: t.id,
            committed_ms,
            opened_ms: v.opened_ms,
            batches,
            manifest,
            siblings: siblings.clone(),
            checkpoint: Some(checkpoint),
            lost,
            phases,
            weights_only: true,
        }))
        .await?;
    inner.holds.hold(t.id, HoldPoint::WeightsCommitted).await;
    Ok(root)
}

/// Whether transfer `t` runs weights first on connection `c`: its root
/// asks for it, the sink speaks protocol 8, and its format (when known)
/// keeps weights and optimizer state in separate files. Otherwise it is
/// opened and sent whole.
pub(super) fn opens_weights_first(c: &LinkConn, t: &Transfer) -> bool {
    t.profile == Profile::WeightsFirst
        && c.version >= ferry_proto::wire::WEIGHTS_FIRST_VERSION
        && t.format
            .as_deref()
            .and_then(|f| f.parse::<Format>().ok())
            .is_none_or(|f| crate::formats::splits_weights(f).is_ok())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn file(path: &str, size: u64, complete: bool) -> ViewFile {
        ViewFile {
            info: FileInfo {
                path: path.into(),
                size,
                mode: 0o644,
                mtime_ns: 1,
            },
            complete,
            appendable: true,
        }
    }

    fn view(files: Vec<ViewFile>, state: ViewState) -> CheckpointView {
        CheckpointView {
            files,
            state,
            opened_ms: 0,
        }
    }

    #[test]
    fn a_round_hands_over_once_enough_complete_files_it_does_not_read_wait() {
        let (tx, rx) = watch::channel(view(vec![file("a", 30, false)], ViewState::Open));
        // `a` is read whole by the round; the round (or an earlier one)
        // covers `b`'s first 40 bytes; chunks of 10 bytes.
        let round = || HandOver {
            view: std::sync::Mutex::new(rx.clone()),
            settled: ["a".to_string()].into_iter().collect(),
            covered: [("b".to_string(), 40)].into_iter().collect(),
            chunk_size: 10,
            limit: 20,
            fired: Default::default(),
        };
        let h = round();
        assert!(!h.due(), "no new view");
        // `b` grows by one full chunk (and a tail), `c` is complete: 20
        // bytes wait, not more than the limit.
        tx.send(view(
            vec![
                file("a", 30, true),
                file("b", 55, false),
                file("c", 10, true),
            ],
            ViewState::Open,
        ))
        .unwrap();
        assert!(!h.due());
        tx.send(view(
            vec![
                file("a", 30, true),
                file("b", 75, false),
                file("c", 10, true),
            ],
            ViewState::Open,
        ))
        .unwrap();
        assert!(h.due(), "b's 30 new full bytes and c's 10 wait");
        assert!(h.due(), "due for the rest of the round");
        let h = round();
        tx.send(view(
            vec![file("a", 30, true)],
            ViewState::Committed {
                markers: Vec::new(),
                committed_ms: 0,
                siblings: Vec::new(),
            },
        ))
        .unwrap();
        assert!(h.due(), "the commit ends the round");
    }
}
