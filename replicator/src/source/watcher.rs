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
//! complete once its size and mtime stay unchanged for the quiet period
//! and its format check passes ([`formats::content_check`]).
//!
//! Per checkpoint the format's detector ([`formats::verdict`]) decides
//! open / committed / abandoned; the watcher adds the idle timeout
//! (abandoned when nothing changes for `checkpoint_idle_timeout`), a newer
//! checkpoint of the same root committing while this one is open
//! (abandoned), and deletion. A transfer is created when a checkpoint opens (`start =
//! "on_open"`, the default) or when it commits (`"on_commit"`); its view
//! ([`CheckpointView`]) is updated on every change and read by the
//! streaming sender. A commit with a new identity in a directory that was
//! already replicated (a re-save) becomes a new transfer, hence a new
//! replica version at the sink.

use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, UNIX_EPOCH};

use ferry_catalog::{now_ms, NewWatchedTransfer, Transfer};
use ferry_proto::manifest::FileInfo;
use ferry_proto::paths::is_temporary;
use ferry_proto::state::{CheckpointState, Profile, TransferId, TransferState};
use globset::{Glob, GlobSet, GlobSetBuilder};
use notify::Watcher as _;
use scheduler::Class;
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};

use super::{CheckpointView, Inner, RootConfig, ViewFile, ViewState};
use crate::formats::{self, FileState, Format, Snapshot, Verdict};

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

/// Compiled include/exclude globs.
#[derive(Debug, Clone)]
struct Filter {
    include: Option<GlobSet>,
    exclude: GlobSet,
}

impl Filter {
    fn new(w: &RootWatch) -> Result<Filter, String> {
        let build = |globs: &[String]| -> Result<GlobSet, String> {
            let mut b = GlobSetBuilder::new();
            for g in globs {
                b.add(Glob::new(g).map_err(|e| format!("glob {g:?}: {e}"))?);
            }
            b.build().map_err(|e| e.to_string())
        };
        Ok(Filter {
            include: (!w.include.is_empty())
                .then(|| build(&w.include))
                .transpose()?,
            exclude: build(&w.exclude)?,
        })
    }

    fn keeps(&self, path: &str) -> bool {
        let name = path.rsplit('/').next().unwrap_or(path);
        !is_temporary(name)
            && !path.split('/').any(is_temporary)
            && self.include.as_ref().is_none_or(|i| i.is_match(path))
            && !self.exclude.is_match(path)
    }
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

/// What the watcher keeps per file between scans.
#[derive(Debug, Clone, Copy)]
struct Seen {
    size: u64,
    mtime_ns: i64,
    since: Instant,
    /// The format check passed for this size and mtime.
    checked: Option<bool>,
}

/// Files closed after writing, as reported by inotify: path -> (size,
/// mtime) right after the close, or [`GONE`].
type Closed = Arc<Mutex<HashMap<PathBuf, (u64, i64)>>>;

/// A close whose file was already renamed or removed when the event was
/// handled (events are handled on the notify thread, after the fact); a
/// rename of that path then completes its new name. Matches no real file.
const GONE: (u64, i64) = (u64::MAX, i64::MIN);

/// One checkpoint directory as the watcher follows it.
struct Ckpt {
    format: Option<Format>,
    opened_ms: i64,
    signature: (usize, u64, i64),
    last_change: Instant,
    /// The transfer following this checkpoint now, with its view.
    transfer: Option<(TransferId, watch::Sender<CheckpointView>)>,
    /// Do not start a transfer when it opens (it was replicated,
    /// abandoned, superseded or failed before); a commit with a new
    /// identity still does.
    settled: bool,
    /// The format's commit predicate held at the last look.
    committed: bool,
    /// The note last written on its transfer (why it waits).
    note: Option<String>,
}

/// A scan of one checkpoint directory.
struct DirScan {
    files: Vec<FileState>,
    infos: HashMap<String, FileInfo>,
    created_ms: Option<i64>,
    /// Files closed (or quiet) that fail their format's check: truncated,
    /// empty, or being rewritten.
    suspect: Vec<String>,
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

/// Lists the regular files under `dir` with their completeness.
fn scan_dir(
    dir: &Path,
    format: Option<Format>,
    closed: &Closed,
    seen: &mut HashMap<PathBuf, Seen>,
    quiet: Duration,
) -> Option<DirScan> {
    let md = std::fs::symlink_metadata(dir).ok()?;
    if !md.is_dir() {
        return None;
    }
    let created_ms = md
        .created()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_millis() as i64);
    let mut out = DirScan {
        files: Vec::new(),
        infos: HashMap::new(),
        created_ms,
        suspect: Vec::new(),
    };
    let closed = closed.lock().map(|c| c.clone()).unwrap_or_default();
    let mut stack = vec![String::new()];
    while let Some(rel) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(dir.join(&rel)) else {
            continue;
        };
        for e in rd.flatten() {
            let Some(name) = e.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            let rel_child = if rel.is_empty() {
                name
            } else {
                format!("{rel}/{name}")
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
            let (size, mt) = (md.len(), mtime_ns(&md));
            let now = Instant::now();
            let s = seen.entry(abs.clone()).or_insert(Seen {
                size,
                mtime_ns: mt,
                since: now,
                checked: None,
            });
            if (s.size, s.mtime_ns) != (size, mt) {
                *s = Seen {
                    size,
                    mtime_ns: mt,
                    since: now,
                    checked: None,
                };
            }
            let closed_ok = closed.get(&abs) == Some(&(size, mt));
            // Closed after its last write (or, without a close event,
            // unchanged for the quiet period), and passing its format's
            // check: a shard the writer left truncated or empty (a safetensors
            // header promising more bytes, a torch.save archive without its
            // end record) is never complete, so its checkpoint is never
            // committed and is abandoned after the idle timeout. The generic
            // rule knows nothing of its files' formats (a `.bin` there is raw
            // bytes): closed or quiet is enough. Checked once per size and
            // mtime.
            let settled = closed_ok || now.duration_since(s.since) >= quiet;
            let check = !matches!(format, None | Some(Format::Generic));
            let complete = settled
                && (!check || {
                    if s.checked.is_none() {
                        s.checked = Some(
                            head_tail(&abs, size)
                                .map(|(h, t)| formats::content_check(&rel_child, &h, &t, size))
                                .unwrap_or(false),
                        );
                    }
                    s.checked == Some(true)
                });
            if settled && check && s.checked == Some(false) {
                out.suspect.push(rel_child.clone());
            }
            let content = (formats::wants_content(format, &rel_child)
                && size <= formats::MAX_CONTENT)
                .then(|| read_small(&abs))
                .flatten();
            out.infos.insert(
                rel_child.clone(),
                FileInfo {
                    path: rel_child.clone(),
                    size,
                    mode: md.permissions().mode() & 0o7777,
                    mtime_ns: mt,
                },
            );
            out.files.push(FileState {
                path: rel_child,
                size,
                mtime_ns: mt,
                complete,
                content,
            });
        }
    }
    out.files.sort_by(|a, b| a.path.cmp(&b.path));
    Some(out)
}

/// Files directly in the root (markers beside checkpoint directories) and
/// the names of its subdirectories.
fn scan_root(root: &Path, format: Option<Format>) -> (Vec<FileState>, Vec<String>) {
    let mut files = Vec::new();
    let mut dirs = Vec::new();
    let Ok(rd) = std::fs::read_dir(root) else {
        return (files, dirs);
    };
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
    (files, dirs)
}

/// Starts watching `root`; runs until the agent stops.
pub(super) async fn watch_root(inner: Arc<Inner>, root: RootConfig, timing: WatchTiming) {
    let filter = match Filter::new(&root.watch) {
        Ok(f) => f,
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
    let _inotify = if root.watch.mode == Mode::Inotify {
        let (closed, tx, overflow) = (closed.clone(), tx.clone(), overflow.clone());
        let (dirty, base) = (dirty.clone(), root.path.clone());
        let handler = move |res: notify::Result<notify::Event>| {
            use notify::event::{AccessKind, AccessMode, EventKind, ModifyKind, RenameMode};
            match res {
                Ok(ev) => {
                    if ev.need_rescan() {
                        overflow.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                    if let Ok(mut d) = dirty.lock() {
                        for p in &ev.paths {
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
                    if let (EventKind::Modify(ModifyKind::Name(RenameMode::Both)), [from, to]) =
                        (&ev.kind, ev.paths.as_slice())
                    {
                        if let Ok(mut c) = closed.lock() {
                            match c.remove(from) {
                                // Closed, then renamed before this thread
                                // could stat it: stat the new name.
                                Some(GONE) => {
                                    if let Ok(md) = std::fs::symlink_metadata(to) {
                                        c.insert(to.clone(), (md.len(), mtime_ns(&md)));
                                    }
                                }
                                Some(v) => {
                                    c.insert(to.clone(), v);
                                }
                                None => {}
                            }
                        }
                    }
                    if matches!(
                        ev.kind,
                        EventKind::Access(AccessKind::Close(AccessMode::Write))
                    ) {
                        for p in &ev.paths {
                            let v = std::fs::symlink_metadata(p)
                                .map_or(GONE, |md| (md.len(), mtime_ns(&md)));
                            if let Ok(mut c) = closed.lock() {
                                c.insert(p.clone(), v);
                            }
                        }
                    }
                }
                Err(_) => overflow.store(true, std::sync::atomic::Ordering::Relaxed),
            }
            let _ = tx.try_send(());
        };
        match notify::recommended_watcher(handler).and_then(|mut w| {
            w.watch(&root.path, notify::RecursiveMode::Recursive)?;
            Ok(w)
        }) {
            Ok(w) => Some(w),
            Err(e) => {
                warn!(root = %root.path.display(), "inotify unavailable, polling every {:?}: {e}", timing.rescan);
                None
            }
        }
    } else {
        None
    };
    drop(tx);
    info!(root = %root.path.display(), job = root.job, mode = ?root.watch.mode, start = ?root.watch.start, "watching for checkpoints");
    let mut ckpts: HashMap<String, Ckpt> = HashMap::new();
    let mut seen: Arc<Mutex<HashMap<PathBuf, Seen>>> = Arc::default();
    let mut next_full = tokio::time::Instant::now();
    loop {
        // A full pass scans every checkpoint directory (the safety net:
        // missed events, idle timeouts, quiet periods); the passes between
        // scan only the directories events touched.
        let full = tokio::time::Instant::now() >= next_full;
        if full {
            next_full = tokio::time::Instant::now() + timing.rescan;
        }
        let touched: HashSet<String> = dirty
            .lock()
            .map(|mut d| std::mem::take(&mut *d))
            .unwrap_or_default();
        let pass = tokio::task::spawn_blocking({
            let (path, fmt, closed, seen) = (
                root.path.clone(),
                root.watch.format,
                closed.clone(),
                seen.clone(),
            );
            let formats_now: HashMap<String, Option<Format>> = ckpts
                .iter()
                .map(|(k, c)| (k.clone(), c.format.or(fmt)))
                .collect();
            let quiet = timing.quiet;
            move || {
                let (siblings, dirs) = scan_root(&path, fmt);
                let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
                let scans: Vec<(String, Option<DirScan>)> = dirs
                    .iter()
                    .filter(|d| full || touched.contains(*d))
                    .map(|d| {
                        let f = formats_now.get(d).copied().flatten().or(fmt);
                        (
                            d.clone(),
                            scan_dir(&path.join(d), f, &closed, &mut seen, quiet),
                        )
                    })
                    .collect();
                // Forget files that are gone.
                if full {
                    seen.retain(|p, _| p.exists());
                }
                (siblings, dirs, scans)
            }
        })
        .await;
        let Ok((siblings, dirs, scans)) = pass else {
            return;
        };
        process(
            &inner, &root, &filter, &timing, &mut ckpts, &siblings, &dirs, scans,
        )
        .await;
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
            _ = inner.shutdown.cancelled() => return,
        }
        if seen.lock().map(|s| s.len()).unwrap_or(0) > 1_000_000 {
            seen = Arc::default();
        }
    }
}

/// Applies one scan: detectors, selection, transfers and views.
#[allow(clippy::too_many_arguments)]
async fn process(
    inner: &Arc<Inner>,
    root: &RootConfig,
    filter: &Filter,
    timing: &WatchTiming,
    ckpts: &mut HashMap<String, Ckpt>,
    siblings: &[FileState],
    dirs: &[String],
    scans: Vec<(String, Option<DirScan>)>,
) {
    let markers = &inner.cfg.markers;
    // Presence comes from the root's listing; a directory listed but gone
    // by the time it was scanned is caught by the next pass.
    let present: HashSet<&str> = dirs.iter().map(String::as_str).collect();
    // Deleted directories.
    let gone: Vec<String> = ckpts
        .keys()
        .filter(|d| !present.contains(d.as_str()))
        .cloned()
        .collect();
    for d in gone {
        if let Some(c) = ckpts.remove(&d) {
            if let Some((id, tx)) = c.transfer {
                end_transfer(
                    inner,
                    id,
                    &tx,
                    CheckpointState::Deleted,
                    "checkpoint directory deleted",
                )
                .await;
            }
        }
    }
    // Announced checkpoints whose directory never appeared.
    if let Ok(ts) = inner.catalog.unfinished_transfers().await {
        let limit = timing.idle_timeout.as_millis() as i64;
        for t in ts {
            let dir = Path::new(&t.source_path);
            if t.checkpoint == CheckpointState::Announced
                && dir.parent() == Some(root.path.as_path())
                && !present.contains(t.rel.as_str())
                && now_ms() - t.created_at > limit
            {
                let why = format!(
                    "announced checkpoint never appeared within {}",
                    humantime::format_duration(timing.idle_timeout)
                );
                info!(transfer = %t.id, "{why}");
                let _ = inner
                    .catalog
                    .set_checkpoint_state(t.id, CheckpointState::Abandoned, None, None)
                    .await;
                let _ = inner
                    .catalog
                    .set_transfer_state(t.id, TransferState::Cancelled, Some(&why))
                    .await;
            }
        }
    }
    let newest_step = scans
        .iter()
        .filter(|(_, s)| s.as_ref().is_some_and(|s| !s.files.is_empty()))
        .map(|(d, _)| d.as_str())
        .chain(
            ckpts
                .iter()
                .filter(|(_, c)| c.signature.0 > 0)
                .map(|(d, _)| d.as_str()),
        )
        .filter_map(formats::step_of)
        .max();
    // A checkpoint still open when a newer one of the same root has
    // committed was given up by its writer (CHECKPOINT_FORMATS.md: DCP and
    // torch_dist "a newer sibling committed"; a killed save would
    // otherwise hold its link until the idle timeout).
    let newest_committed = ckpts
        .iter()
        .filter(|(_, c)| c.committed)
        .filter_map(|(d, _)| formats::step_of(d))
        .max();
    for (dir, scan) in scans {
        let Some(scan) = scan else { continue };
        let step = formats::step_of(&dir);
        if let Selection::EveryNSteps(n) = root.watch.select {
            if n > 0 && step.is_none_or(|s| s % n != 0) {
                continue;
            }
        }
        let abs = root.path.join(&dir);
        let abs_s = abs.to_string_lossy().into_owned();
        let signature = (
            scan.files.len(),
            scan.files.iter().map(|f| f.size).sum::<u64>(),
            scan.files.iter().map(|f| f.mtime_ns).max().unwrap_or(0),
        );
        let c = match ckpts.get_mut(&dir) {
            Some(c) => c,
            None => {
                let c = adopt(inner, &abs_s, &scan).await;
                ckpts.entry(dir.clone()).or_insert(c)
            }
        };
        if c.signature != signature {
            c.signature = signature;
            c.last_change = Instant::now();
        }
        let snap = Snapshot {
            dir: &dir,
            files: &scan.files,
            siblings,
            sibling_dirs: dirs,
        };
        if c.format.is_none() {
            c.format = root
                .watch
                .format
                .or_else(|| formats::recognise(&snap))
                .or_else(|| {
                    scan.files
                        .iter()
                        .any(|f| markers.iter().any(|m| m == &f.path))
                        .then_some(Format::Generic)
                });
            if let Some(f) = c.format {
                debug!(dir = abs_s, format = %f, "checkpoint format recognised");
                if let Some((id, _)) = &c.transfer {
                    if let Err(e) = inner.catalog.set_transfer_format(*id, &f.to_string()).await {
                        warn!(error = %e, "catalog");
                    }
                }
            }
        }
        let Some(format) = c.format else { continue };
        let weights_only = root.watch.profile == Profile::WeightsOnly;
        // torchtitan saves either DCP (weights and optimizer state mixed)
        // or HF safetensors (weights only): the files decide.
        let profile_format = if format == Format::Torchtitan
            && !scan.files.iter().any(|f| f.path.ends_with(".distcp"))
        {
            Format::HfPretrained
        } else {
            format
        };
        if weights_only {
            if let Err(why) = formats::is_optimizer_state(profile_format, "") {
                if !c.settled {
                    warn!(dir = abs_s, %format, "not replicated: profile = \"weights-only\" is not possible here: {why}");
                    c.settled = true;
                }
                continue;
            }
        }
        let verdict = formats::verdict(format, &snap, markers);
        let files: Vec<ViewFile> = scan
            .files
            .iter()
            .filter(|f| filter.keeps(&f.path))
            .filter(|f| {
                !weights_only || formats::is_optimizer_state(profile_format, &f.path) == Ok(false)
            })
            .filter_map(|f| {
                Some(ViewFile {
                    info: scan.infos.get(&f.path)?.clone(),
                    complete: f.complete,
                    appendable: formats::appendable(&f.path),
                })
            })
            .collect();
        let superseded = root.watch.select == Selection::LatestOnly
            && step.is_some()
            && newest_step.is_some_and(|n| Some(n) > step);
        c.committed = matches!(verdict, Verdict::Committed { .. });
        let overtaken = step
            .zip(newest_committed)
            .and_then(|(s, n)| (n > s).then_some(n));
        match verdict {
            Verdict::Open => {
                let idle = c.last_change.elapsed() >= timing.idle_timeout;
                if overtaken.is_some() && c.transfer.is_none() {
                    c.settled = true;
                }
                if let Some((id, tx)) = &c.transfer {
                    if idle || superseded || overtaken.is_some() {
                        let why = if let Some(n) = overtaken {
                            format!(
                                "checkpoint abandoned: the newer checkpoint of step {n} committed while this one was still open"
                            )
                        } else if idle {
                            format!(
                                "checkpoint abandoned: nothing written for {}",
                                humantime::format_duration(timing.idle_timeout)
                            )
                        } else {
                            "superseded by a newer checkpoint (select = \"latest_only\")".into()
                        };
                        end_transfer(inner, *id, tx, CheckpointState::Abandoned, &why).await;
                        c.transfer = None;
                        c.settled = true;
                    } else {
                        update_view(tx, files, ViewState::Open, c.opened_ms);
                    }
                } else if !c.settled
                    && !idle
                    && !superseded
                    && root.watch.start == Start::OnOpen
                    && !files.is_empty()
                    // Orbax writes under a temporary directory name and
                    // commits by renaming it: its replica can only be
                    // named after the rename, so it is copied then.
                    && (format != Format::Orbax || !dir.contains(".orbax-checkpoint-tmp"))
                {
                    start_transfer(
                        inner,
                        root,
                        c,
                        &abs_s,
                        &dir,
                        format,
                        files,
                        ViewState::Open,
                        None,
                    )
                    .await;
                }
            }
            Verdict::Committed { markers, identity } => {
                let committed_ms = markers
                    .iter()
                    .filter_map(|m| scan.infos.get(m))
                    .map(|f| f.mtime_ns / 1_000_000)
                    .max()
                    .unwrap_or_else(now_ms);
                let state = ViewState::Committed {
                    markers,
                    committed_ms,
                    siblings: sibling_markers(format, &dir, siblings),
                };
                if let Some((id, tx)) = &c.transfer {
                    let first = !matches!(tx.borrow().state, ViewState::Committed { .. });
                    if first {
                        info!(transfer = %id, dir = abs_s, %format, "checkpoint committed");
                        if let Err(e) = inner
                            .catalog
                            .set_checkpoint_state(
                                *id,
                                CheckpointState::Committed,
                                Some(committed_ms),
                                Some(&identity),
                            )
                            .await
                        {
                            warn!(error = %e, "catalog");
                        }
                    }
                    update_view(tx, files, state, c.opened_ms);
                } else if !superseded
                    && !files.is_empty()
                    && needs_copy(inner, &abs_s, &identity, committed_ms).await
                {
                    c.settled = false;
                    start_transfer(
                        inner,
                        root,
                        c,
                        &abs_s,
                        &dir,
                        format,
                        files,
                        state,
                        Some((committed_ms, identity)),
                    )
                    .await;
                }
            }
            Verdict::Abandoned(why) => {
                if let Some((id, tx)) = c.transfer.take() {
                    end_transfer(
                        inner,
                        id,
                        &tx,
                        CheckpointState::Abandoned,
                        &format!("checkpoint abandoned: {why}"),
                    )
                    .await;
                }
                c.settled = true;
            }
        }
        // Say why a transfer waits when files look damaged: the checkpoint
        // cannot commit while they fail their format's check.
        if let Some((id, _)) = &c.transfer {
            let note = (!scan.suspect.is_empty()).then(|| {
                format!(
                    "waiting: {} file(s) closed but failing their format check (truncated, empty or rewritten?), e.g. {}",
                    scan.suspect.len(),
                    scan.suspect[0]
                )
            });
            if note != c.note {
                if let Some(n) = &note {
                    warn!(transfer = %id, dir = abs_s, "{n}");
                }
                let _ = inner.catalog.set_transfer_note(*id, note.as_deref()).await;
                c.note = note;
            }
        }
        // A finished transfer no longer needs its view.
        if let Some((id, _)) = &c.transfer {
            if let Ok(Some(t)) = inner.catalog.transfer(*id).await {
                if t.state.is_final() {
                    if let Ok(mut v) = inner.views.lock() {
                        v.remove(id);
                    }
                    // Only a commit with a new identity (a re-save) starts
                    // another transfer of this directory.
                    c.settled = true;
                    c.transfer = None;
                }
            }
        }
    }
}

/// Markers beside the checkpoint directory that name this checkpoint, with
/// their content: DeepSpeed's `latest` (the tag, i.e. the directory name)
/// and Megatron's `latest_checkpointed_iteration.txt` (the iteration).
/// CHECKPOINT_FORMATS.md, "Publish rule" item 4: the sink writes them
/// after the directory is in place.
fn sibling_markers(format: Format, dir: &str, siblings: &[FileState]) -> Vec<(String, Vec<u8>)> {
    let name = match format {
        Format::DeepSpeed => "latest",
        Format::MegatronLegacy | Format::MegatronDist => "latest_checkpointed_iteration.txt",
        _ => return Vec::new(),
    };
    let Some(content) = siblings
        .iter()
        .find(|f| f.path == name)
        .and_then(|f| f.content.clone())
        .filter(|c| c.len() <= ferry_proto::limits::MAX_SIBLING_BYTES as usize)
    else {
        return Vec::new();
    };
    let text = String::from_utf8_lossy(&content).trim().to_string();
    let names_this = match format {
        Format::DeepSpeed => text == dir,
        _ => text
            .parse::<u64>()
            .ok()
            .is_some_and(|n| Some(n) == formats::step_of(dir)),
    };
    if names_this {
        vec![(name.to_string(), content)]
    } else {
        Vec::new()
    }
}

/// First sight of a checkpoint directory: picks up a transfer the catalog
/// already has for it (the agent restarted).
async fn adopt(inner: &Arc<Inner>, abs: &str, scan: &DirScan) -> Ckpt {
    let opened_ms = scan
        .created_ms
        .or_else(|| scan.files.iter().map(|f| f.mtime_ns / 1_000_000).min())
        .unwrap_or_else(now_ms)
        .min(now_ms());
    let mut c = Ckpt {
        format: None,
        opened_ms,
        signature: (0, 0, 0),
        last_change: Instant::now(),
        transfer: None,
        settled: false,
        committed: false,
        note: None,
    };
    let Ok(Some(t)) = inner.catalog.transfer_by_path(abs).await else {
        return c;
    };
    if let Some(f) = t.format.as_deref().and_then(|f| f.parse().ok()) {
        c.format = Some(f);
    }
    if let Some(o) = t.opened_at {
        c.opened_ms = o;
    }
    if t.checkpoint == CheckpointState::Announced && !t.state.is_final() {
        // Announced by a training controller; its first bytes are here.
        info!(transfer = %t.id, path = abs, "announced checkpoint opened");
        let _ = inner
            .catalog
            .set_checkpoint_state(t.id, CheckpointState::Open, None, None)
            .await;
        let _ = inner.catalog.set_opened_at(t.id, c.opened_ms).await;
    }
    if !t.state.is_final() && t.format.is_some() {
        let (tx, rx) = watch::channel(CheckpointView {
            files: Vec::new(),
            state: ViewState::Open,
            opened_ms: c.opened_ms,
        });
        if let Ok(mut v) = inner.views.lock() {
            v.insert(t.id, rx);
        }
        c.transfer = Some((t.id, tx));
        // The view is filled by this pass before the sender reads it.
        wake(inner, &t);
    } else {
        // Replicated, failed or cancelled before: only a commit with a new
        // identity (a re-save) copies it again.
        c.settled = true;
    }
    c
}

pub(super) fn wake(inner: &Inner, t: &Transfer) {
    if let Some(l) = inner.links.get(&t.link) {
        l.wake.notify_one();
    }
}

/// True unless a transfer of this path is moving, or one already covers
/// this commit: same commit identity (a failed one is not retried by
/// itself), or queued after the commit (e.g. by `ferry push`).
async fn needs_copy(inner: &Inner, abs: &str, identity: &str, committed_ms: i64) -> bool {
    match inner.catalog.transfers_for_path(abs).await {
        Ok(ts) => !ts.iter().any(|t| {
            !t.state.is_final()
                || t.commit_identity.as_deref() == Some(identity)
                || (t.state == TransferState::Published && t.created_at >= committed_ms)
        }),
        Err(e) => {
            warn!(error = %e, "catalog");
            false
        }
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

#[allow(clippy::too_many_arguments)]
async fn start_transfer(
    inner: &Arc<Inner>,
    root: &RootConfig,
    c: &mut Ckpt,
    abs: &str,
    rel: &str,
    format: Format,
    files: Vec<ViewFile>,
    view_state: ViewState,
    commit: Option<(i64, String)>,
) {
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
            opened_at: Some(c.opened_ms),
            committed_at: commit.as_ref().map(|c| c.0),
            profile: root.watch.profile,
        })
        .await
    {
        Ok(id) => id,
        Err(e) => {
            warn!(error = %e, path = abs, "could not queue the checkpoint");
            return;
        }
    };
    if let Some((_, identity)) = &commit {
        let _ = inner
            .catalog
            .set_checkpoint_state(id, CheckpointState::Committed, None, Some(identity))
            .await;
    }
    info!(transfer = %id, path = abs, %format, checkpoint = %ckpt, "checkpoint queued for replication");
    let (tx, rx) = watch::channel(CheckpointView {
        files,
        state: view_state,
        opened_ms: c.opened_ms,
    });
    if let Ok(mut v) = inner.views.lock() {
        v.insert(id, rx);
    }
    c.transfer = Some((id, tx));
    if let Some(l) = inner.links.get(&root.link) {
        l.wake.notify_one();
    }
}

/// Marks the checkpoint abandoned or deleted and tells its sender, which
/// cancels the transfer (the sink drops its staging data). A transfer
/// that never started is cancelled here.
async fn end_transfer(
    inner: &Arc<Inner>,
    id: TransferId,
    tx: &watch::Sender<CheckpointView>,
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
    tx.send_modify(|v| v.state = ViewState::Gone(why.to_string()));
    if let Ok(Some(t)) = inner.catalog.transfer(id).await {
        if t.state == TransferState::Queued {
            let _ = inner
                .catalog
                .set_transfer_state(id, TransferState::Cancelled, Some(why))
                .await;
        }
    }
}
