//! The watcher: follows the checkpoints under each source root while they
//! are written, and turns what it sees into transfers.
//!
//! Each immediate subdirectory of a source root is one checkpoint (the
//! layout every supported framework uses: `step_N/`, `global_stepN/`,
//! `iter_NNNNNNN/`, `checkpoint-N/`; files directly in the root, such as
//! DeepSpeed's `latest`, are the checkpoints' siblings). inotify (the
//! `notify` crate) is the fast path: it reports closes after writes, which
//! is what makes a file complete. A periodic rescan is the safety net (an
//! inotify queue overflow, a watcher started after the writes) and the only
//! path on network file systems (`mode = "poll"`), where a file counts as
//! complete once its version stays unchanged for the quiet period and its
//! format check passes ([`formats::content_check`]).
//!
//! This module is the driver, and does the I/O: inotify and the rescans
//! (each file's [`FileVersion`] from its metadata: device, inode, size,
//! mtime, ctime), reading what the core asks for, catalog lookups and
//! writes, and the views' channels. Every decision (completeness, the
//! format's verdict, selection, the checkpoint's life, the idle timeout,
//! re-saves, when a transfer starts) is taken by the pure
//! [`WatchCore`](super::watch_core::WatchCore), fed each scan and the
//! current time; this module carries out the actions it returns. A
//! transfer's view ([`CheckpointView`]) is read by the streaming sender.

use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, UNIX_EPOCH};

use ferry_catalog::{now_ms, NewWatchedTransfer, Transfer};
use ferry_proto::state::{CheckpointState, Profile, TransferId, TransferState};
use scheduler::Class;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::watch_core::{
    Action, Announced, Answers, Commit, DirScan, FileVersion, Filter, Now, PastTransfer, Questions,
    RootScan, Sample, ScannedFile, WatchCore,
};
use super::{CheckpointView, Inner, RootConfig, ViewFile, ViewState};
use crate::formats::{self, FileState, Format};
use crate::storage::WatchEvent;

/// When a watched checkpoint's transfer starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Start {
    /// When the checkpoint opens: shards stream while they are written.
    #[default]
    OnOpen,
    /// When the checkpoint commits (copy after commit).
    OnCommit,
}

/// How the watcher learns about changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// inotify events plus the periodic rescan.
    #[default]
    Inotify,
    /// The periodic rescan only (network file systems).
    Poll,
}

/// Which checkpoints of a root are replicated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Selection {
    /// Every checkpoint.
    #[default]
    All,
    /// Only the newest step: an older checkpoint still moving is cancelled
    /// when a newer one opens.
    LatestOnly,
    /// Only steps that are multiples of N (the eval cadence).
    EveryNSteps(u64),
}

/// Watcher settings of one source root.
#[derive(Debug, Clone, Default)]
pub struct RootWatch {
    /// Checkpoint format; `None` recognises it from the layout (`auto`),
    /// falling back to the generic marker rule.
    pub format: Option<Format>,
    /// When transfers start.
    pub start: Start,
    /// inotify or poll.
    pub mode: Mode,
    /// Globs over paths relative to the checkpoint directory: when not
    /// empty, only matching files are replicated.
    pub include: Vec<String>,
    /// Globs of files never replicated.
    pub exclude: Vec<String>,
    /// Which checkpoints are replicated.
    pub select: Selection,
    /// Which files of each checkpoint.
    pub profile: Profile,
}

/// Checks a root's globs.
///
/// # Errors
/// A message naming the glob that does not parse.
pub fn check_globs(w: &RootWatch) -> Result<(), String> {
    Filter::new(w).map(|_| ())
}

/// Timing of the watcher, shared by all roots.
#[derive(Debug, Clone)]
pub struct WatchTiming {
    /// Full rescan period (also the poll period).
    pub rescan: Duration,
    /// A file unchanged for this long (and passing its format check) is
    /// complete when no close event was seen for it.
    pub quiet: Duration,
    /// An open checkpoint with no change for this long is abandoned.
    pub idle_timeout: Duration,
}

/// A close after writing, as reported by inotify: the file's version,
/// size and mtime right after the close.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ClosedAt {
    version: FileVersion,
    size: u64,
    mtime_ns: i64,
}

/// Files closed after writing, by path; `None` for a close whose file was
/// already renamed or removed when the event was handled (events are
/// handled on the notify thread, after the fact): a rename of that path
/// then completes its new name.
type Closed = Arc<Mutex<HashMap<PathBuf, Option<ClosedAt>>>>;

/// Logs a catalog write of the watcher that failed; the watcher carries on
/// (its next scan repeats what is still needed).
fn logged<T>(what: &str, r: Result<T, ferry_catalog::CatalogError>) {
    if let Err(e) = r {
        warn!(error = %e, "catalog: {what}");
    }
}

/// The version token of a file on a POSIX file system (the storage
/// backend's: inode, size, mtime and ctime).
fn file_version(md: &std::fs::Metadata) -> FileVersion {
    crate::storage::posix::version_of(md)
}

fn mtime_ns(md: &std::fs::Metadata) -> i64 {
    md.mtime() * 1_000_000_000 + md.mtime_nsec()
}

/// Reads the first and last 64 KiB of a file for its format check.
fn head_tail(path: &Path, size: u64) -> std::io::Result<(Vec<u8>, Vec<u8>)> {
    use std::os::unix::fs::FileExt;
    const N: u64 = 64 << 10;
    let f = std::fs::File::open(path)?;
    let mut head = vec![0u8; size.min(N) as usize];
    f.read_exact_at(&mut head, 0)?;
    let tail_len = size.min(N);
    let mut tail = vec![0u8; tail_len as usize];
    f.read_exact_at(&mut tail, size - tail_len)?;
    Ok((head, tail))
}

fn read_small(path: &Path) -> Option<Vec<u8>> {
    let mut buf = Vec::new();
    std::fs::File::open(path)
        .ok()?
        .take(formats::MAX_CONTENT)
        .read_to_end(&mut buf)
        .ok()?;
    Some(buf)
}

/// Lists the regular files under checkpoint directory `name` of `root`
/// with their versions, whether a close was seen for that version, the
/// content the format wants, and the head and tail of the files the core
/// wants to check.
fn scan_dir(
    root: &Path,
    name: &str,
    core: &WatchCore,
    closed: &HashMap<PathBuf, Option<ClosedAt>>,
    now: Instant,
) -> Option<DirScan> {
    let dir = root.join(name);
    let md = std::fs::symlink_metadata(&dir).ok()?;
    if !md.is_dir() {
        return None;
    }
    let format = core.scan_format(name);
    let mut out = DirScan {
        created_ms: md
            .created()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map(|d| d.as_millis() as i64),
        files: Vec::new(),
    };
    let mut stack = vec![String::new()];
    while let Some(rel) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(dir.join(&rel)) else {
            continue;
        };
        for e in rd.flatten() {
            let Some(file_name) = e.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            let rel_child = if rel.is_empty() {
                file_name
            } else {
                format!("{rel}/{file_name}")
            };
            let Ok(ft) = e.file_type() else { continue };
            if ft.is_dir() {
                stack.push(rel_child);
                continue;
            }
            if !ft.is_file() {
                continue;
            }
            let Ok(md) = e.metadata() else { continue };
            let abs = e.path();
            let size = md.len();
            let version = file_version(&md);
            let was_closed = closed
                .get(&abs)
                .is_some_and(|c| c.is_some_and(|c| c.version == version));
            let sample = core
                .wants_sample(name, &rel_child, version, was_closed, now)
                .then(|| match head_tail(&abs, size) {
                    Ok((head, tail)) => Sample::Read { head, tail },
                    Err(_) => Sample::Unreadable,
                });
            let content = (formats::wants_content(format, &rel_child)
                && size <= formats::MAX_CONTENT)
                .then(|| read_small(&abs))
                .flatten();
            out.files.push(ScannedFile {
                path: rel_child,
                size,
                mtime_ns: mtime_ns(&md),
                mode: md.permissions().mode() & 0o7777,
                version,
                closed: was_closed,
                content,
                sample,
            });
        }
    }
    out.files.sort_by(|a, b| a.path.cmp(&b.path));
    Some(out)
}

/// Files directly in the root (markers beside checkpoint directories) and
/// the names of its subdirectories.
///
/// # Errors
/// The root cannot be listed (gone, unmounted, no permission): the pass
/// is skipped, so nothing under it is judged deleted.
fn scan_root(
    root: &Path,
    format: Option<Format>,
) -> std::io::Result<(Vec<FileState>, Vec<String>)> {
    let mut files = Vec::new();
    let mut dirs = Vec::new();
    let rd = std::fs::read_dir(root)?;
    for e in rd.flatten() {
        let Some(name) = e.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        let Ok(ft) = e.file_type() else { continue };
        if ft.is_dir() {
            if !name.starts_with('.') {
                dirs.push(name);
            }
        } else if ft.is_file() {
            let Ok(md) = e.metadata() else { continue };
            let content = (formats::wants_content(format, &name)
                && md.len() <= formats::MAX_CONTENT)
                .then(|| read_small(&e.path()))
                .flatten();
            files.push(FileState {
                path: name,
                size: md.len(),
                mtime_ns: mtime_ns(&md),
                complete: true,
                content,
            });
        }
    }
    dirs.sort();
    Ok((files, dirs))
}

/// One pass over a root in a remote store (HDFS, S3), which has no
/// events to follow: one recursive listing of the root, split into the
/// files directly in it (siblings), its subdirectories, and each
/// subdirectory's files, with the content and samples the format and the
/// core want (read with ranged reads). Temporaries are not listed
/// ([`crate::storage::remote::skipped`]), except NeMo's `<dir>-unfinished`
/// beside a directory with `weights/`, asked for by name; no close is
/// ever seen, and directories have no birth time.
///
/// # Errors
/// The root cannot be listed (the pass is skipped, so nothing under it
/// is judged deleted).
fn scan_remote(
    store: &dyn crate::storage::SourceStore,
    root: &Path,
    format: Option<Format>,
    core: &WatchCore,
    now: Instant,
) -> std::io::Result<RootScan> {
    const N: u64 = 64 << 10;
    let listing = store
        .list(root, &[])
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    let read = |rel: &str, offset: u64, len: u64| {
        store
            .open(&root.join(rel))
            .and_then(|f| f.read_range(offset, len))
    };
    let mut siblings = Vec::new();
    let mut dirs: Vec<String> = Vec::new();
    let mut scans: HashMap<String, DirScan> = HashMap::new();
    for f in listing.files {
        let info = f.info;
        let Some((dir, rel)) = info.path.split_once('/') else {
            let content = (formats::wants_content(format, &info.path)
                && info.size <= formats::MAX_CONTENT)
                .then(|| read(&info.path, 0, info.size).ok())
                .flatten();
            siblings.push(FileState {
                path: info.path,
                size: info.size,
                mtime_ns: info.mtime_ns,
                complete: true,
                content,
            });
            continue;
        };
        if dir.starts_with('.') {
            continue;
        }
        let fmt = core.scan_format(dir);
        let sample = core.wants_sample(dir, rel, f.version, false, now).then(|| {
            let tail = info.size.min(N);
            match (
                read(&info.path, 0, info.size.min(N)),
                read(&info.path, info.size - tail, tail),
            ) {
                (Ok(head), Ok(tail)) => Sample::Read { head, tail },
                _ => Sample::Unreadable,
            }
        });
        let content = (formats::wants_content(fmt, rel) && info.size <= formats::MAX_CONTENT)
            .then(|| read(&info.path, 0, info.size).ok())
            .flatten();
        let file = ScannedFile {
            path: rel.to_string(),
            size: info.size,
            mtime_ns: info.mtime_ns,
            mode: info.mode & 0o7777,
            version: f.version,
            closed: false,
            content,
            sample,
        };
        let scan = scans.entry(dir.to_string()).or_insert_with(|| {
            dirs.push(dir.to_string());
            DirScan::default()
        });
        scan.files.push(file);
    }
    dirs.sort();
    // NeMo's `<name>-unfinished` marker has a temporary's name, which the
    // listing leaves out: ask for it beside each directory that has
    // `weights/` (one stat each per pass, on NeMo-like directories only).
    for d in &dirs {
        let nemo_like = scans
            .get(d)
            .is_some_and(|s| s.files.iter().any(|f| f.path.starts_with("weights/")));
        if !nemo_like {
            continue;
        }
        let marker = format!("{d}-unfinished");
        match store.stat(&root.join(&marker)) {
            Ok((size, mtime_ns, _)) => siblings.push(FileState {
                path: marker,
                size,
                mtime_ns,
                complete: true,
                content: None,
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            // Not knowing is not "gone": skip the pass, as for a listing
            // that fails.
            Err(e) => return Err(e),
        }
    }
    let scanned = dirs
        .iter()
        .map(|d| {
            let mut s = scans.remove(d).unwrap_or_default();
            s.files.sort_by(|a, b| a.path.cmp(&b.path));
            (d.clone(), Some(s))
        })
        .collect();
    Ok(RootScan {
        siblings,
        dirs,
        scanned,
    })
}

/// Watches `root` until `stop` is cancelled (the agent stops, or, in a
/// pool, the agent no longer holds the root's watch). The views it gave
/// out are withdrawn then: the runs of its checkpoints stop, and the
/// transfers stay in the catalog for whichever agent watches the root
/// next.
pub(super) async fn watch_root(
    inner: Arc<Inner>,
    root: RootConfig,
    timing: WatchTiming,
    stop: CancellationToken,
) {
    let mut views = HashMap::new();
    // Cancelled at once, even in the middle of a catalog call that waits
    // on a database that does not answer.
    tokio::select! {
        _ = follow(&inner, &root, timing, &stop, &mut views) => {}
        _ = stop.cancelled() => {}
    }
    let mut v = crate::lock::lock(&inner.views);
    for id in views.keys() {
        v.remove(id);
    }
}

/// [`watch_root`]'s loop; `views` holds the senders of the views of the
/// transfers it follows.
async fn follow(
    inner: &Arc<Inner>,
    root: &RootConfig,
    timing: WatchTiming,
    stop: &CancellationToken,
    views: &mut HashMap<TransferId, watch::Sender<CheckpointView>>,
) {
    let mut core = match WatchCore::new(&root.watch, inner.cfg.markers.clone(), &timing) {
        Ok(c) => c,
        Err(e) => {
            warn!(root = %root.path.display(), "not watching: {e}");
            return;
        }
    };
    let closed: Closed = Arc::default();
    let (tx, mut rx) = mpsc::channel::<()>(1);
    let overflow = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // inotify: closes after writes make files complete; any event wakes
    // the scan. The watcher object must live as long as the loop.
    // Checkpoint directories touched by events since the last pass; only
    // those are scanned again until the next full rescan.
    let dirty: Arc<Mutex<HashSet<String>>> = Arc::default();
    let watching = if root.watch.mode == Mode::Inotify {
        let (closed, tx, overflow) = (closed.clone(), tx.clone(), overflow.clone());
        let (dirty, base, store) = (dirty.clone(), root.path.clone(), inner.store.clone());
        let stat = {
            let store = store.clone();
            move |p: &Path| {
                store
                    .stat(p)
                    .ok()
                    .map(|(size, mtime_ns, version)| ClosedAt {
                        version,
                        size,
                        mtime_ns,
                    })
            }
        };
        let handler = move |ev: WatchEvent| {
            match ev {
                WatchEvent::Overflow => {
                    overflow.store(true, std::sync::atomic::Ordering::Relaxed);
                }
                WatchEvent::Touched(paths) => {
                    let mut d = crate::lock::lock(&dirty);
                    for p in &paths {
                        let first = p
                            .strip_prefix(&base)
                            .ok()
                            .and_then(|r| r.components().next())
                            .and_then(|c| c.as_os_str().to_str());
                        if let Some(first) = first {
                            d.insert(first.to_string());
                        }
                    }
                }
                // A file closed and then renamed into place (DCP
                // `.metadata.tmp` -> `.metadata`) stays complete.
                WatchEvent::Renamed { from, to } => {
                    // A rename changes the file's ctime, hence its
                    // version: the new name takes the version it has now
                    // if its size and mtime are those of the close.
                    let now = stat(&to);
                    let mut c = crate::lock::lock(&closed);
                    match c.remove(&from) {
                        // Closed, then renamed before this thread could
                        // stat it: take the new name as is.
                        Some(None) => {
                            if let Some(n) = now {
                                c.insert(to, Some(n));
                            }
                        }
                        Some(Some(v)) => {
                            let n = now
                                .filter(|n| (n.size, n.mtime_ns) == (v.size, v.mtime_ns))
                                .unwrap_or(v);
                            c.insert(to, Some(n));
                        }
                        None => {}
                    }
                }
                WatchEvent::ClosedAfterWrite(p) => {
                    let v = stat(&p);
                    crate::lock::lock(&closed).insert(p, v);
                }
            }
            let _ = tx.try_send(());
        };
        match store.watch(&root.path, Box::new(handler)) {
            Ok(Some(w)) => Some(w),
            Ok(None) => {
                warn!(root = %root.path.display(), "this store cannot watch; polling every {:?}", timing.rescan);
                None
            }
            Err(e) => {
                warn!(root = %root.path.display(), "inotify unavailable, polling every {:?}: {e}", timing.rescan);
                None
            }
        }
    } else {
        None
    };
    drop(tx);
    // The mode in effect: a root configured for inotify that could not
    // have it is polled.
    let mode = if watching.is_some() {
        "inotify".to_string()
    } else {
        format!("polling every {:?}", timing.rescan)
    };
    info!(root = %root.path.display(), job = root.job, configured = ?root.watch.mode, mode, start = ?root.watch.start, "watching for checkpoints");
    let mut next_full = tokio::time::Instant::now();
    let mut unreadable = false;
    loop {
        // A full pass scans every checkpoint directory (the safety net:
        // missed events, idle timeouts, quiet periods); the passes between
        // scan only the directories events touched.
        let full = tokio::time::Instant::now() >= next_full;
        if full {
            next_full = tokio::time::Instant::now() + timing.rescan;
        }
        let touched: HashSet<String> = std::mem::take(&mut *crate::lock::lock(&dirty));
        // Checkpoints a signal's pins picked here (whatever `select`
        // says).
        {
            let mut picks = crate::lock::lock(&inner.picks);
            picks.retain(|(r, pick, until)| {
                if *r != root.path {
                    return true;
                }
                core.add_pick(pick.clone(), *until);
                false
            });
        }
        // One instant for the scan and the core, so the files the core
        // wants sampled are those it then judges.
        let at = Instant::now();
        // The core goes to the scanning thread (it says which files to
        // sample) and comes back with the scan.
        let pass = tokio::task::spawn_blocking({
            let (path, fmt, closed) = (root.path.clone(), root.watch.format, closed.clone());
            let store = inner.store.clone();
            move || {
                if crate::storage::router::is_url(&path) {
                    let scan = scan_remote(&*store, &path, fmt, &core, at);
                    return (core, scan);
                }
                let (siblings, dirs) = match scan_root(&path, fmt) {
                    Ok(r) => r,
                    Err(e) => return (core, Err(e)),
                };
                let closed = crate::lock::lock(&closed).clone();
                let scanned = dirs
                    .iter()
                    .filter(|d| full || touched.contains(*d))
                    .map(|d| (d.clone(), scan_dir(&path, d, &core, &closed, at)))
                    .collect();
                let scan = RootScan {
                    siblings,
                    dirs,
                    scanned,
                };
                (core, Ok(scan))
            }
        })
        .await;
        let Ok((back, scan)) = pass else {
            return;
        };
        core = back;
        let scan = match scan {
            Ok(scan) => {
                if unreadable {
                    info!(root = %root.path.display(), "the root can be listed again");
                    unreadable = false;
                }
                scan
            }
            Err(e) => {
                if !unreadable {
                    warn!(root = %root.path.display(), "cannot list the root ({e}): skipping its scans until it can (nothing under it counts as deleted meanwhile)");
                    unreadable = true;
                }
                tokio::select! {
                    _ = tokio::time::sleep(timing.rescan) => {}
                    _ = stop.cancelled() => return,
                }
                next_full = tokio::time::Instant::now();
                continue;
            }
        };
        for (dir, from) in core.settle_picks(&scan.dirs, now_ms()) {
            info!(root = %root.path.display(), dir, "a signal's pin picked this checkpoint: replicating it whatever select says");
            super::pins::send_step_pins(inner, root, &dir, from);
        }
        let answers = answers(inner, root, &core.questions(&scan)).await;
        let now = Now {
            at,
            unix_ms: now_ms(),
        };
        for action in core.handle_scan(scan, &answers, now) {
            act(inner, root, &mut core, views, action).await;
        }
        if overflow.swap(false, std::sync::atomic::Ordering::Relaxed) {
            debug!(root = %root.path.display(), "inotify overflow or error: rescanning");
            next_full = tokio::time::Instant::now();
            continue;
        }
        tokio::select! {
            _ = rx.recv() => {
                // Let a burst of events settle into one scan.
                tokio::time::sleep(Duration::from_millis(20)).await;
                while rx.try_recv().is_ok() {}
            }
            _ = tokio::time::sleep_until(next_full) => {}
            _ = stop.cancelled() => return,
        }
    }
}

/// The catalog lookups the core asked for, and the announced checkpoints
/// of this root.
async fn answers(inner: &Inner, root: &RootConfig, q: &Questions) -> Answers {
    let mut a = Answers::default();
    for dir in &q.history {
        let abs = root.path.join(dir);
        match inner
            .catalog
            .transfers_for_path(&abs.to_string_lossy())
            .await
        {
            Ok(ts) => {
                a.history
                    .insert(dir.clone(), ts.iter().map(past_transfer).collect());
            }
            Err(e) => warn!(error = %e, "catalog"),
        }
    }
    for id in &q.finished {
        if let Ok(Some(t)) = inner.catalog.transfer(*id).await {
            if t.state.is_final() {
                a.finished.insert(*id);
            }
        }
    }
    if let Ok(ts) = inner.catalog.unfinished_transfers().await {
        a.announced = ts
            .into_iter()
            .filter(|t| {
                t.checkpoint == CheckpointState::Announced
                    && Path::new(&t.source_path).parent() == Some(root.path.as_path())
            })
            .map(|t| Announced {
                id: t.id,
                dir: t.rel,
                created_ms: t.created_at,
            })
            .collect();
    }
    a
}

fn past_transfer(t: &Transfer) -> PastTransfer {
    PastTransfer {
        id: t.id,
        link: t.link.clone(),
        state: t.state,
        checkpoint: t.checkpoint,
        format: t.format.clone(),
        opened_ms: t.opened_at,
        commit_identity: t.commit_identity.clone(),
        created_ms: t.created_at,
    }
}

/// Carries out one action of the core.
async fn act(
    inner: &Arc<Inner>,
    root: &RootConfig,
    core: &mut WatchCore,
    views: &mut HashMap<TransferId, watch::Sender<CheckpointView>>,
    action: Action,
) {
    let abs = |dir: &str| root.path.join(dir).to_string_lossy().into_owned();
    match action {
        Action::Adopt {
            transfer,
            link,
            opened_ms,
            ..
        } => {
            let (tx, rx) = watch::channel(CheckpointView {
                files: Vec::new(),
                state: ViewState::Open,
                opened_ms,
            });
            {
                let mut v = crate::lock::lock(&inner.views);
                v.insert(transfer, rx);
            }
            views.insert(transfer, tx);
            // The view is filled by this pass before the sender reads it.
            if let Some(l) = inner.links.get(&link) {
                l.wake.notify_one();
            }
        }
        Action::AnnouncedOpened {
            dir,
            transfer,
            opened_ms,
        } => {
            // Announced by a training controller; its first bytes are here.
            info!(transfer = %transfer, path = abs(&dir), "announced checkpoint opened");
            logged(
                "set checkpoint state",
                inner
                    .catalog
                    .set_checkpoint_state(transfer, CheckpointState::Open, None, None)
                    .await,
            );
            logged(
                "set opened at",
                inner.catalog.set_opened_at(transfer, opened_ms).await,
            );
        }
        Action::EndTransfer {
            transfer,
            checkpoint_state,
            why,
        } => {
            let tx = views.remove(&transfer);
            end_transfer(inner, transfer, tx.as_ref(), checkpoint_state, &why).await;
        }
        Action::ExpireAnnouncement { transfer, why } => {
            info!(transfer = %transfer, "{why}");
            logged(
                "set checkpoint state",
                inner
                    .catalog
                    .set_checkpoint_state(transfer, CheckpointState::Abandoned, None, None)
                    .await,
            );
            logged(
                "set transfer state",
                inner
                    .catalog
                    .set_transfer_state(transfer, TransferState::Cancelled, Some(&why))
                    .await,
            );
        }
        Action::MarkCommitted {
            dir,
            transfer,
            format,
            commit,
        } => {
            info!(transfer = %transfer, dir = abs(&dir), %format, "checkpoint committed");
            seen_commit(inner, transfer, commit.committed_ms);
            if let Err(e) = inner
                .catalog
                .set_checkpoint_state(
                    transfer,
                    CheckpointState::Committed,
                    Some(commit.committed_ms),
                    Some(&commit.identity),
                )
                .await
            {
                warn!(error = %e, "catalog");
            }
        }
        Action::Recognised {
            dir,
            format,
            transfer,
        } => {
            debug!(dir = abs(&dir), format = %format, "checkpoint format recognised");
            if let Some(id) = transfer {
                if let Err(e) = inner
                    .catalog
                    .set_transfer_format(id, &format.to_string())
                    .await
                {
                    warn!(error = %e, "catalog");
                }
            }
        }
        Action::ReleaseView { transfer } => {
            {
                let mut v = crate::lock::lock(&inner.views);
                v.remove(&transfer);
            }
            views.remove(&transfer);
        }
        Action::SetNote {
            dir,
            transfer,
            note,
        } => set_note(inner, transfer, &abs(&dir), note.as_deref()).await,
        Action::Skip { dir, format, why } => {
            warn!(dir = abs(&dir), %format, "not replicated: {why}");
        }
        Action::StartTransfer {
            dir,
            format,
            files,
            state,
            opened_ms,
            commit,
            note,
        } => {
            let path = abs(&dir);
            let Some((id, tx)) = start_transfer(
                inner, root, &path, &dir, format, files, state, opened_ms, commit,
            )
            .await
            else {
                return;
            };
            core.started(&dir, id);
            views.insert(id, tx);
            if note.is_some() {
                set_note(inner, id, &path, note.as_deref()).await;
            }
        }
        Action::UpdateView {
            transfer,
            files,
            state,
            opened_ms,
        } => {
            if let Some(tx) = views.get(&transfer) {
                update_view(tx, files, state, opened_ms);
            }
        }
    }
}

/// Says on the transfer why it waits (`None` clears it).
async fn set_note(inner: &Inner, id: TransferId, path: &str, note: Option<&str>) {
    if let Some(n) = note {
        warn!(transfer = %id, dir = path, "{n}");
    }
    logged(
        "set transfer note",
        inner.catalog.set_transfer_note(id, note).await,
    );
}

pub(super) fn wake(inner: &Inner, t: &Transfer) {
    if let Some(l) = inner.links.get(&t.link) {
        l.wake.notify_one();
    }
}

fn update_view(
    tx: &watch::Sender<CheckpointView>,
    files: Vec<ViewFile>,
    state: ViewState,
    opened_ms: i64,
) {
    let v = CheckpointView {
        files,
        state,
        opened_ms,
    };
    tx.send_if_modified(|cur| {
        if *cur == v {
            false
        } else {
            *cur = v;
            true
        }
    });
}

/// Queues a transfer of a watched checkpoint and makes its view; `None`
/// when the catalog refused it (the next scan tries again).
#[allow(clippy::too_many_arguments)]
async fn start_transfer(
    inner: &Arc<Inner>,
    root: &RootConfig,
    abs: &str,
    rel: &str,
    format: Format,
    files: Vec<ViewFile>,
    view_state: ViewState,
    opened_ms: i64,
    commit: Option<Commit>,
) -> Option<(TransferId, watch::Sender<CheckpointView>)> {
    let ckpt = if commit.is_some() {
        CheckpointState::Committed
    } else {
        CheckpointState::Open
    };
    let id = match inner
        .catalog
        .insert_watched_transfer(&NewWatchedTransfer {
            link: &root.link,
            job: &root.job,
            source_path: abs,
            rel,
            class: Class::Scheduled,
            checkpoint: ckpt,
            format: &format.to_string(),
            opened_at: Some(opened_ms),
            committed_at: commit.as_ref().map(|c| c.committed_ms),
            profile: root.watch.profile,
        })
        .await
    {
        Ok(id) => id,
        Err(e) => {
            warn!(error = %e, path = abs, "could not queue the checkpoint");
            return None;
        }
    };
    if let Some(c) = &commit {
        seen_commit(inner, id, c.committed_ms);
        logged(
            "set checkpoint state",
            inner
                .catalog
                .set_checkpoint_state(id, CheckpointState::Committed, None, Some(&c.identity))
                .await,
        );
    }
    info!(transfer = %id, path = abs, %format, checkpoint = %ckpt, "checkpoint queued for replication");
    let (tx, rx) = watch::channel(CheckpointView {
        files,
        state: view_state,
        opened_ms,
    });
    {
        let mut v = crate::lock::lock(&inner.views);
        v.insert(id, rx);
    }
    if let Some(l) = inner.links.get(&root.link) {
        l.wake.notify_one();
    }
    Some((id, tx))
}

/// Marks the checkpoint abandoned or deleted and tells its sender, which
/// cancels the transfer (the sink drops its staging data). A transfer
/// that never started is cancelled here.
async fn end_transfer(
    inner: &Arc<Inner>,
    id: TransferId,
    tx: Option<&watch::Sender<CheckpointView>>,
    ckpt: CheckpointState,
    why: &str,
) {
    info!(transfer = %id, "{why}");
    if let Err(e) = inner
        .catalog
        .set_checkpoint_state(id, ckpt, None, None)
        .await
    {
        warn!(error = %e, "catalog");
    }
    if let Some(tx) = tx {
        tx.send_modify(|v| v.state = ViewState::Gone(why.to_string()));
    }
    if let Ok(Some(t)) = inner.catalog.transfer(id).await {
        if t.state == TransferState::Queued {
            logged(
                "set transfer state",
                inner
                    .catalog
                    .set_transfer_state(id, TransferState::Cancelled, Some(why))
                    .await,
            );
        }
    }
}

/// Starts the phases after the commit of transfer `id` now: the writer's
/// share is the time since the commit marker's mtime (`committed_ms`,
/// Unix ms).
fn seen_commit(inner: &Inner, id: TransferId, committed_ms: i64) {
    let writer = ferry_catalog::now_ms().saturating_sub(committed_ms).max(0);
    inner.phase_clocks.note(
        id,
        super::phases::Event::CommitSeen {
            writer: std::time::Duration::from_millis(writer as u64),
        },
    );
}
