//! The watcher's decision core: what to do about the checkpoint
//! directories of one source root, given what a scan found and the time.
//!
//! Pure logic in the sans-IO style of `quinn-proto`: no file system, no
//! catalog, no tokio and no clock. The driver
//! ([`super::watcher`]) scans the root, asks the core which files it wants
//! sampled for their format check ([`WatchCore::wants_sample`]), looks up
//! in the catalog what the core asks ([`WatchCore::questions`]), hands the
//! scan, the answers and the current time to [`WatchCore::handle_scan`],
//! and carries out the [`Action`]s it returns, in order. A transfer the
//! driver queued for a [`Action::StartTransfer`] is reported back with
//! [`WatchCore::started`].
//!
//! The rules kept here:
//! - completeness of a file: closed after its last write (the driver's
//!   inotify record matches the file's current [`FileVersion`]), or
//!   unchanged for the quiet period; and, for formats with file checks,
//!   passing [`formats::content_check`], run once per version;
//! - the format (configured, recognised, or the generic marker rule) and
//!   its [`formats::verdict`];
//! - selection (`every_n_steps`, `latest_only`) and the `weights-only`
//!   profile;
//! - a checkpoint's life: open, committed, abandoned (by its format, the
//!   idle timeout, or a newer committed sibling), deleted; announcements
//!   that never appeared;
//! - when a transfer starts (`on_open` or `on_commit`), and re-saves: a
//!   commit identity the catalog has not replicated yet starts a new
//!   transfer, hence a new replica version.

use std::collections::hash_map::{DefaultHasher, Entry};
use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::time::{Duration, Instant};

use ferry_proto::manifest::FileInfo;
use ferry_proto::paths::is_temporary;
use ferry_proto::state::{CheckpointState, Profile, TransferId, TransferState};
use globset::{Glob, GlobSet, GlobSetBuilder};

use super::watcher::{RootWatch, Selection, Start, WatchTiming};
use super::{ViewFile, ViewState};
use crate::formats::{self, FileState, Format, Snapshot, Verdict};

/// A file's version token (see [`crate::storage::FileVersion`]): the
/// scanner fills it in from whatever its storage offers, so a rewrite that
/// keeps size and mtime, or a file replaced by another, still counts as a
/// change. Only compared for equality.
pub use crate::storage::FileVersion;

/// The first and last bytes of a file, read for its format check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sample {
    /// Up to 64 KiB from the start and up to 64 KiB from the end.
    Read {
        /// The first bytes.
        head: Vec<u8>,
        /// The last bytes.
        tail: Vec<u8>,
    },
    /// The file could not be read: its check fails.
    Unreadable,
}

/// One regular file of a checkpoint directory as the scanner saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScannedFile {
    /// Path relative to the checkpoint directory, `/`-separated.
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// Modification time, nanoseconds since the Unix epoch.
    pub mtime_ns: i64,
    /// Permission bits (`0o7777` at most).
    pub mode: u32,
    /// The file's version at this scan.
    pub version: FileVersion,
    /// A close after writing was seen for exactly this version.
    pub closed: bool,
    /// The file's bytes when [`formats::wants_content`] asks for them and
    /// the file is at most [`formats::MAX_CONTENT`] bytes.
    pub content: Option<Vec<u8>>,
    /// Head and tail bytes, present when [`WatchCore::wants_sample`] was
    /// true for this file and version.
    pub sample: Option<Sample>,
}

/// One checkpoint directory as the scanner saw it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DirScan {
    /// The directory's birth time, Unix ms, when the file system has one.
    pub created_ms: Option<i64>,
    /// Every regular file under the directory, recursively.
    pub files: Vec<ScannedFile>,
}

/// One pass over a source root.
#[derive(Debug, Clone, Default)]
pub struct RootScan {
    /// Files directly in the root (markers beside checkpoint directories),
    /// complete, with content per [`formats::wants_content`].
    pub siblings: Vec<FileState>,
    /// Names of every subdirectory of the root: a directory the core
    /// follows that is not listed here was deleted.
    pub dirs: Vec<String>,
    /// The directories scanned in this pass (all of them, or those events
    /// touched); `None` for one that vanished before it could be scanned.
    pub scanned: Vec<(String, Option<DirScan>)>,
}

/// The current time, read by the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Now {
    /// Monotonic time, for the quiet period and the idle timeout.
    pub at: Instant,
    /// Wall-clock time, Unix ms, for times stored in the catalog.
    pub unix_ms: i64,
}

/// A transfer of a checkpoint's path as the catalog has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PastTransfer {
    /// Its id.
    pub id: TransferId,
    /// The link it goes over.
    pub link: String,
    /// Its state.
    pub state: TransferState,
    /// The checkpoint's state as recorded.
    pub checkpoint: CheckpointState,
    /// The format recorded for it, as stored (a format name).
    pub format: Option<String>,
    /// When its checkpoint opened, Unix ms.
    pub opened_ms: Option<i64>,
    /// The commit identity it replicates, once committed.
    pub commit_identity: Option<String>,
    /// When it was queued, Unix ms.
    pub created_ms: i64,
}

/// An announced checkpoint of this root whose transfer is unfinished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Announced {
    /// The transfer.
    pub id: TransferId,
    /// The checkpoint directory's name under the root.
    pub dir: String,
    /// When it was announced, Unix ms.
    pub created_ms: i64,
}

/// Catalog lookups the core needs for one scan ([`WatchCore::questions`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Questions {
    /// Directories (names under the root) whose transfers the driver lists
    /// in [`Answers::history`]: those the core follows no transfer of.
    pub history: Vec<String>,
    /// Transfers whose state the driver checks for [`Answers::finished`].
    pub finished: Vec<TransferId>,
}

/// The driver's answers to [`Questions`], plus the announcements.
#[derive(Debug, Clone, Default)]
pub struct Answers {
    /// Per directory asked about, every transfer of its path, oldest
    /// first. A directory missing here could not be looked up: no
    /// transfer of it is adopted or started from a commit in this pass.
    pub history: HashMap<String, Vec<PastTransfer>>,
    /// The transfers asked about that are in a final state.
    pub finished: HashSet<TransferId>,
    /// Unfinished announced checkpoints of this root.
    pub announced: Vec<Announced>,
}

/// A commit of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Commit {
    /// Commit time, Unix ms: the newest marker's mtime, or when the commit
    /// was seen.
    pub committed_ms: i64,
    /// The format's commit identity ([`Verdict::Committed`]).
    pub identity: String,
}

/// What the driver does, in the order given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Follow a transfer the catalog already had for this directory (the
    /// agent restarted): give it an empty open view and wake its link.
    Adopt {
        /// Directory name under the root.
        dir: String,
        /// The transfer.
        transfer: TransferId,
        /// Its link.
        link: String,
        /// When the checkpoint opened, Unix ms.
        opened_ms: i64,
    },
    /// An announced checkpoint's first bytes are here: record it open.
    AnnouncedOpened {
        /// Directory name under the root.
        dir: String,
        /// The announced transfer.
        transfer: TransferId,
        /// When the checkpoint opened, Unix ms.
        opened_ms: i64,
    },
    /// The checkpoint was abandoned or deleted: record its state, tell the
    /// transfer's sender (which cancels it), cancel it if still queued,
    /// and drop its view.
    EndTransfer {
        /// The transfer.
        transfer: TransferId,
        /// `Abandoned` or `Deleted`.
        checkpoint_state: CheckpointState,
        /// Why, for the log and the transfer's error.
        why: String,
    },
    /// An announced checkpoint never appeared within the idle timeout:
    /// record it abandoned and cancel its transfer.
    ExpireAnnouncement {
        /// The announced transfer.
        transfer: TransferId,
        /// Why.
        why: String,
    },
    /// A followed transfer's checkpoint committed (first seen now): record
    /// the commit.
    MarkCommitted {
        /// Directory name under the root.
        dir: String,
        /// The transfer.
        transfer: TransferId,
        /// The checkpoint's format.
        format: Format,
        /// The commit.
        commit: Commit,
    },
    /// The checkpoint's format is known from now on.
    Recognised {
        /// Directory name under the root.
        dir: String,
        /// The format.
        format: Format,
        /// The transfer following it, whose recorded format is set.
        transfer: Option<TransferId>,
    },
    /// The transfer reached a final state: drop its view.
    ReleaseView {
        /// The transfer.
        transfer: TransferId,
    },
    /// Say why a transfer waits (or clear it, `None`).
    SetNote {
        /// Directory name under the root.
        dir: String,
        /// The transfer.
        transfer: TransferId,
        /// The note.
        note: Option<String>,
    },
    /// The checkpoint cannot be replicated as configured (said once).
    Skip {
        /// Directory name under the root.
        dir: String,
        /// Its format.
        format: Format,
        /// Why.
        why: String,
    },
    /// Queue a transfer of the checkpoint with this view, then report its
    /// id with [`WatchCore::started`].
    StartTransfer {
        /// Directory name under the root.
        dir: String,
        /// Its format.
        format: Format,
        /// The files to replicate.
        files: Vec<ViewFile>,
        /// Open or committed.
        state: ViewState,
        /// When the checkpoint opened, Unix ms.
        opened_ms: i64,
        /// The commit, when it starts committed.
        commit: Option<Commit>,
        /// A note to set on it at once (see [`Action::SetNote`]).
        note: Option<String>,
    },
    /// The checkpoint as it is now, for the transfer's sender (unchanged
    /// views need not be sent again).
    UpdateView {
        /// The transfer.
        transfer: TransferId,
        /// The files to replicate.
        files: Vec<ViewFile>,
        /// Open or committed.
        state: ViewState,
        /// When the checkpoint opened, Unix ms.
        opened_ms: i64,
    },
}

/// Compiled include/exclude globs.
#[derive(Debug, Clone)]
pub(crate) struct Filter {
    include: Option<GlobSet>,
    exclude: GlobSet,
}

impl Filter {
    /// Compiles a root's globs; the error names the glob that does not
    /// parse.
    pub(crate) fn new(w: &RootWatch) -> Result<Filter, String> {
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

/// What the core keeps per file between scans.
#[derive(Debug, Clone, Copy)]
struct Track {
    version: FileVersion,
    /// When this version was first seen.
    since: Instant,
    /// The format check's result for this version, once run.
    checked: Option<bool>,
}

/// One checkpoint directory as the core follows it.
#[derive(Debug)]
struct Ckpt {
    format: Option<Format>,
    opened_ms: i64,
    /// File count and a hash of every file's path and version: any change
    /// resets the idle timeout.
    signature: (usize, u64),
    last_change: Instant,
    /// Per file of the last scan.
    files: HashMap<String, Track>,
    /// The transfer following this checkpoint now.
    transfer: Option<TransferId>,
    /// The state of the view last given to that transfer is committed.
    view_committed: bool,
    /// Do not start a transfer when it opens (it was replicated,
    /// abandoned, superseded or failed before); a commit with a new
    /// identity still does.
    settled: bool,
    /// The format's commit predicate held at the last look.
    committed: bool,
    /// The note last set on the current transfer (why it waits).
    note: Option<String>,
}

impl Ckpt {
    fn drop_transfer(&mut self) {
        self.transfer = None;
        self.view_committed = false;
        self.note = None;
    }
}

/// Settings the rules read.
#[derive(Debug)]
struct Rules {
    watch: RootWatch,
    filter: Filter,
    markers: Vec<String>,
    quiet: Duration,
    idle_timeout: Duration,
    picks: Picks,
}

/// What a signal's pins asked the watcher to replicate whatever `select`
/// says (`source/pins.rs`): a directory of the root, or the first one
/// with a step at or above a step (which becomes a directory once it
/// appears).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pick {
    /// This checkpoint directory (a name directly under the root).
    Dir(String),
    /// The directory with the smallest step at or above this one, once
    /// one exists.
    AtOrAfter(u64),
}

/// The root's picks, each until a time (Unix ms).
#[derive(Debug, Clone, Default)]
struct Picks {
    dirs: HashMap<String, i64>,
    at_or_after: Vec<(u64, i64)>,
}

/// The watcher's decisions for one source root (see the module docs).
#[derive(Debug)]
pub struct WatchCore {
    rules: Rules,
    ckpts: HashMap<String, Ckpt>,
}

impl WatchCore {
    /// A core for a root with these settings, the generic rule's marker
    /// names, and the watcher's timing (quiet period, idle timeout).
    ///
    /// # Errors
    /// A message naming a glob that does not parse.
    pub fn new(
        watch: &RootWatch,
        markers: Vec<String>,
        timing: &WatchTiming,
    ) -> Result<WatchCore, String> {
        Ok(WatchCore {
            rules: Rules {
                filter: Filter::new(watch)?,
                watch: watch.clone(),
                markers,
                quiet: timing.quiet,
                idle_timeout: timing.idle_timeout,
                picks: Picks::default(),
            },
            ckpts: HashMap::new(),
        })
    }

    /// True if the root's selection keeps directory `dir`
    /// (`every_n_steps`; `latest_only` is decided per scan), or a
    /// signal's pins picked it.
    pub fn selects(&self, dir: &str) -> bool {
        match self.rules.watch.select {
            Selection::EveryNSteps(n) if n > 0 => {
                formats::step_of(dir).is_some_and(|s| s % n == 0)
                    || self.rules.picks.dirs.contains_key(dir)
            }
            _ => true,
        }
    }

    /// A signal's pins picked `pick` until `until_ms` (Unix ms): it is
    /// replicated whatever `select` says.
    pub fn add_pick(&mut self, pick: Pick, until_ms: i64) {
        match pick {
            Pick::Dir(d) => {
                let u = self.rules.picks.dirs.entry(d).or_insert(until_ms);
                *u = (*u).max(until_ms);
            }
            Pick::AtOrAfter(s) => self.rules.picks.at_or_after.push((s, until_ms)),
        }
    }

    /// With the root's listing `dirs` at `now_ms`: each step pick whose
    /// directory exists now becomes a pick of that directory (the
    /// smallest step at or above it), and ended picks are dropped.
    /// Returns the directories picked now, each with the step of the pick
    /// it settles.
    pub fn settle_picks(&mut self, dirs: &[String], now_ms: i64) -> Vec<(String, u64)> {
        let picks = &mut self.rules.picks;
        picks.dirs.retain(|_, u| *u > now_ms);
        picks.at_or_after.retain(|(_, u)| *u > now_ms);
        let mut found = Vec::new();
        picks.at_or_after.retain(|&(s, until)| {
            let first = dirs
                .iter()
                .filter_map(|d| formats::step_of(d).filter(|x| *x >= s).map(|x| (x, d)))
                .min();
            match first {
                Some((_, d)) => {
                    found.push((d.clone(), s, until));
                    false
                }
                None => true,
            }
        });
        let mut out = Vec::new();
        for (d, s, until) in found {
            out.push((d.clone(), s));
            let u = picks.dirs.entry(d).or_insert(until);
            *u = (*u).max(until);
        }
        out
    }

    /// The format to scan `dir` with: the one recognised so far, else the
    /// configured one (`None`: auto). It decides which files' content the
    /// scanner reads ([`formats::wants_content`]).
    pub fn scan_format(&self, dir: &str) -> Option<Format> {
        self.ckpts
            .get(dir)
            .and_then(|c| c.format)
            .or(self.rules.watch.format)
    }

    /// True if the scanner should read the head and tail of file `path`
    /// of `dir` ([`ScannedFile::sample`]): its format has file checks, it
    /// is settled at `now` (closed, or this version unchanged for the quiet
    /// period), and this version was not checked yet. Pass the same `now`
    /// to [`WatchCore::handle_scan`].
    pub fn wants_sample(
        &self,
        dir: &str,
        path: &str,
        version: FileVersion,
        closed: bool,
        now: Instant,
    ) -> bool {
        if !self.selects(dir) || !has_checks(self.scan_format(dir)) {
            return false;
        }
        let known = self
            .ckpts
            .get(dir)
            .and_then(|c| c.files.get(path))
            .filter(|t| t.version == version);
        let since = known.map_or(now, |t| t.since);
        let settled = closed || now.saturating_duration_since(since) >= self.rules.quiet;
        settled && known.is_none_or(|t| t.checked.is_none())
    }

    /// The catalog lookups [`WatchCore::handle_scan`] needs for `scan`.
    pub fn questions(&self, scan: &RootScan) -> Questions {
        let mut q = Questions::default();
        for (dir, s) in &scan.scanned {
            if s.is_none() || !self.selects(dir) {
                continue;
            }
            match self.ckpts.get(dir).and_then(|c| c.transfer) {
                Some(id) => q.finished.push(id),
                None => q.history.push(dir.clone()),
            }
        }
        q
    }

    /// The transfer following directory `dir`, if any.
    pub fn transfer(&self, dir: &str) -> Option<TransferId> {
        self.ckpts.get(dir).and_then(|c| c.transfer)
    }

    /// The driver queued `transfer` for the [`Action::StartTransfer`] of
    /// `dir`; it follows the checkpoint from now on. A start that failed is
    /// not reported, and is tried again by a later scan.
    pub fn started(&mut self, dir: &str, transfer: TransferId) {
        if let Some(c) = self.ckpts.get_mut(dir) {
            c.transfer = Some(transfer);
        }
    }

    /// Applies one scan of the root at time `now`, with the driver's
    /// answers to [`WatchCore::questions`] for it.
    pub fn handle_scan(&mut self, scan: RootScan, answers: &Answers, now: Now) -> Vec<Action> {
        let mut out = Vec::new();
        let RootScan {
            siblings,
            dirs,
            scanned,
        } = scan;
        // Presence comes from the root's listing; a directory listed but
        // gone by the time it was scanned is caught by the next pass.
        let present: HashSet<&str> = dirs.iter().map(String::as_str).collect();
        let gone: Vec<String> = self
            .ckpts
            .keys()
            .filter(|d| !present.contains(d.as_str()))
            .cloned()
            .collect();
        for d in gone {
            if let Some(Ckpt {
                transfer: Some(id), ..
            }) = self.ckpts.remove(&d)
            {
                out.push(Action::EndTransfer {
                    transfer: id,
                    checkpoint_state: CheckpointState::Deleted,
                    why: "checkpoint directory deleted".into(),
                });
            }
        }
        // Announced checkpoints whose directory never appeared.
        let limit = i64::try_from(self.rules.idle_timeout.as_millis()).unwrap_or(i64::MAX);
        for a in &answers.announced {
            if !present.contains(a.dir.as_str()) && now.unix_ms - a.created_ms > limit {
                out.push(Action::ExpireAnnouncement {
                    transfer: a.id,
                    why: format!(
                        "announced checkpoint never appeared within {}",
                        humantime::format_duration(self.rules.idle_timeout)
                    ),
                });
            }
        }
        let newest_step = scanned
            .iter()
            .filter(|(_, s)| s.as_ref().is_some_and(|s| !s.files.is_empty()))
            .map(|(d, _)| d.as_str())
            .chain(
                self.ckpts
                    .iter()
                    .filter(|(_, c)| c.signature.0 > 0)
                    .map(|(d, _)| d.as_str()),
            )
            .filter_map(formats::step_of)
            .max();
        // A checkpoint still open when a newer one of the same root has
        // committed was given up by its writer (CHECKPOINT_FORMATS.md: DCP
        // and torch_dist "a newer sibling committed"; a killed save would
        // otherwise hold its link until the idle timeout).
        let newest_committed = self
            .ckpts
            .iter()
            .filter(|(_, c)| c.committed)
            .filter_map(|(d, _)| formats::step_of(d))
            .max();
        let root = RootView {
            siblings: &siblings,
            dirs: &dirs,
            newest_step,
            newest_committed,
        };
        for (dir, scan) in scanned {
            let Some(scan) = scan else { continue };
            if !self.selects(&dir) {
                continue;
            }
            // The format the scanner sampled with, before this scan
            // recognises or adopts one.
            let hint = self.scan_format(&dir);
            let history = answers.history.get(&dir);
            let c = match self.ckpts.entry(dir.clone()) {
                Entry::Occupied(e) => e.into_mut(),
                Entry::Vacant(e) => e.insert(adopt(&dir, &scan, history, now, &mut out)),
            };
            self.rules.apply(
                &dir,
                scan,
                c,
                hint,
                history,
                &answers.finished,
                &root,
                now,
                &mut out,
            );
        }
        out
    }
}

/// What one scan says about the root as a whole.
struct RootView<'a> {
    siblings: &'a [FileState],
    dirs: &'a [String],
    /// The newest step with files, among scanned and followed directories.
    newest_step: Option<u64>,
    /// The newest step whose checkpoint had committed at the last look.
    newest_committed: Option<u64>,
}

/// True for formats whose files get a content check before counting as
/// complete: the generic rule knows nothing of its files' formats (a
/// `.bin` there is raw bytes), and an unknown format checks nothing yet.
fn has_checks(format: Option<Format>) -> bool {
    !matches!(format, None | Some(Format::Generic))
}

/// First sight of a checkpoint directory: picks up a transfer the catalog
/// already has for it (the agent restarted, or it was announced).
fn adopt(
    dir: &str,
    scan: &DirScan,
    history: Option<&Vec<PastTransfer>>,
    now: Now,
    out: &mut Vec<Action>,
) -> Ckpt {
    let opened_ms = scan
        .created_ms
        .or_else(|| scan.files.iter().map(|f| f.mtime_ns / 1_000_000).min())
        .unwrap_or(now.unix_ms)
        .min(now.unix_ms);
    let mut c = Ckpt {
        format: None,
        opened_ms,
        signature: (0, 0),
        last_change: now.at,
        files: HashMap::new(),
        transfer: None,
        view_committed: false,
        settled: false,
        committed: false,
        note: None,
    };
    let Some(t) = history.and_then(|h| h.last()) else {
        return c;
    };
    if let Some(f) = t.format.as_deref().and_then(|f| f.parse().ok()) {
        c.format = Some(f);
    }
    if let Some(o) = t.opened_ms {
        c.opened_ms = o;
    }
    if t.checkpoint == CheckpointState::Announced && !t.state.is_final() {
        out.push(Action::AnnouncedOpened {
            dir: dir.to_string(),
            transfer: t.id,
            opened_ms: c.opened_ms,
        });
    }
    if !t.state.is_final() && t.format.is_some() {
        out.push(Action::Adopt {
            dir: dir.to_string(),
            transfer: t.id,
            link: t.link.clone(),
            opened_ms: c.opened_ms,
        });
        c.transfer = Some(t.id);
    } else {
        // Replicated, failed or cancelled before: only a commit with a new
        // identity (a re-save) copies it again.
        c.settled = true;
        if t.state == TransferState::Published {
            // Its files as they were when it was replicated passed their
            // format checks then: not sampled again (a first pass over a
            // large polled root would otherwise read the head and tail of
            // every file of every checkpoint it holds). A file written
            // since is checked as usual.
            for f in &scan.files {
                if f.mtime_ns / 1_000_000 <= t.created_ms {
                    c.files.insert(
                        f.path.clone(),
                        Track {
                            version: f.version,
                            since: now.at,
                            checked: Some(true),
                        },
                    );
                }
            }
        }
    }
    c
}

/// True unless a transfer of this path is moving, or one already covers
/// this commit: same commit identity (a failed one is not retried by
/// itself), or queued after the commit (e.g. by `ferry push`). False when
/// the catalog could not be asked.
fn needs_copy(history: Option<&Vec<PastTransfer>>, identity: &str, committed_ms: i64) -> bool {
    history.is_some_and(|ts| {
        !ts.iter().any(|t| {
            !t.state.is_final()
                || t.commit_identity.as_deref() == Some(identity)
                || (t.state == TransferState::Published && t.created_ms >= committed_ms)
        })
    })
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

/// File count and a hash of every file's path and version.
fn signature(files: &[ScannedFile]) -> (usize, u64) {
    let mut h = DefaultHasher::new();
    for f in files {
        f.path.hash(&mut h);
        f.version.hash(&mut h);
    }
    (files.len(), h.finish())
}

impl Rules {
    /// Completeness of each file: closed after its last write (or, without
    /// a close, unchanged for the quiet period), and passing its format's
    /// check: a shard the writer left truncated or empty (a safetensors
    /// header promising more bytes, a torch.save archive without its end
    /// record) is never complete, so its checkpoint is never committed and
    /// is abandoned after the idle timeout. Checked once per version.
    /// Returns the files for the format, their infos, and the settled
    /// files failing their check.
    fn track(
        &self,
        c: &mut Ckpt,
        hint: Option<Format>,
        files: Vec<ScannedFile>,
        now: Instant,
    ) -> (Vec<FileState>, HashMap<String, FileInfo>, Vec<String>) {
        let check = has_checks(hint);
        let mut tracks = HashMap::with_capacity(files.len());
        let mut states = Vec::with_capacity(files.len());
        let mut infos = HashMap::with_capacity(files.len());
        let mut suspect = Vec::new();
        for f in files {
            let mut t = match c.files.get(&f.path) {
                Some(t) if t.version == f.version => *t,
                _ => Track {
                    version: f.version,
                    since: now,
                    checked: None,
                },
            };
            let settled = f.closed || now.saturating_duration_since(t.since) >= self.quiet;
            if check && settled && t.checked.is_none() {
                t.checked = f.sample.as_ref().map(|s| match s {
                    Sample::Read { head, tail } => {
                        formats::content_check(&f.path, head, tail, f.size)
                    }
                    Sample::Unreadable => false,
                });
            }
            let complete = settled && (!check || t.checked == Some(true));
            if settled && check && t.checked == Some(false) {
                suspect.push(f.path.clone());
            }
            tracks.insert(f.path.clone(), t);
            infos.insert(
                f.path.clone(),
                FileInfo {
                    path: f.path.clone(),
                    size: f.size,
                    mode: f.mode,
                    mtime_ns: f.mtime_ns,
                },
            );
            states.push(FileState {
                path: f.path,
                size: f.size,
                mtime_ns: f.mtime_ns,
                complete,
                content: f.content,
            });
        }
        c.files = tracks;
        (states, infos, suspect)
    }

    /// One checkpoint directory of a scan: format, verdict, selection,
    /// transfer and view.
    #[allow(clippy::too_many_arguments)]
    fn apply(
        &self,
        dir: &str,
        mut scan: DirScan,
        c: &mut Ckpt,
        hint: Option<Format>,
        history: Option<&Vec<PastTransfer>>,
        finished: &HashSet<TransferId>,
        root: &RootView<'_>,
        now: Now,
        out: &mut Vec<Action>,
    ) {
        scan.files.sort_by(|a, b| a.path.cmp(&b.path));
        let step = formats::step_of(dir);
        let sig = signature(&scan.files);
        if c.signature != sig {
            c.signature = sig;
            c.last_change = now.at;
        }
        let (files, infos, suspect) = self.track(c, hint, scan.files, now.at);
        let snap = Snapshot {
            dir,
            files: &files,
            siblings: root.siblings,
            sibling_dirs: root.dirs,
        };
        if c.format.is_none() {
            c.format = self
                .watch
                .format
                .or_else(|| formats::recognise(&snap))
                .or_else(|| {
                    files
                        .iter()
                        .any(|f| self.markers.iter().any(|m| m == &f.path))
                        .then_some(Format::Generic)
                });
            if let Some(format) = c.format {
                out.push(Action::Recognised {
                    dir: dir.to_string(),
                    format,
                    transfer: c.transfer,
                });
            }
        }
        let Some(format) = c.format else { return };
        let weights_only = self.watch.profile == Profile::WeightsOnly;
        // torchtitan saves either DCP (weights and optimizer state mixed)
        // or HF safetensors (weights only): the files decide.
        let profile_format =
            if format == Format::Torchtitan && !files.iter().any(|f| f.path.ends_with(".distcp")) {
                Format::HfPretrained
            } else {
                format
            };
        if weights_only {
            if let Err(why) = formats::is_optimizer_state(profile_format, "") {
                if !c.settled {
                    out.push(Action::Skip {
                        dir: dir.to_string(),
                        format,
                        why: format!("profile = \"weights-only\" is not possible here: {why}"),
                    });
                    c.settled = true;
                }
                return;
            }
        }
        let mut verdict = formats::verdict(format, &snap, &self.markers);
        // The format was recognised only now, from files tracked without
        // its content check (none was known): not committed before the
        // next scan has sampled them. Else a save first seen complete,
        // with a truncated or empty shard and its marker, would commit
        // unchecked.
        if !has_checks(hint)
            && has_checks(Some(format))
            && matches!(verdict, Verdict::Committed { .. })
        {
            verdict = Verdict::Open;
        }
        let view: Vec<ViewFile> = files
            .iter()
            .filter(|f| self.filter.keeps(&f.path))
            .filter(|f| {
                !weights_only || formats::is_optimizer_state(profile_format, &f.path) == Ok(false)
            })
            .filter_map(|f| {
                Some(ViewFile {
                    info: infos.get(&f.path)?.clone(),
                    complete: f.complete,
                    appendable: formats::appendable(&f.path),
                })
            })
            .collect();
        let superseded = self.watch.select == Selection::LatestOnly
            && step.is_some()
            && root.newest_step.is_some_and(|n| Some(n) > step)
            && !self.picks.dirs.contains_key(dir);
        c.committed = matches!(verdict, Verdict::Committed { .. });
        let overtaken = step
            .zip(root.newest_committed)
            .and_then(|(s, n)| (n > s).then_some(n));
        // Say why a transfer waits when files look damaged: the checkpoint
        // cannot commit while they fail their format's check.
        let note = suspect.first().map(|first| {
            format!(
                "waiting: {} file(s) closed but failing their format check (truncated, empty or rewritten?), e.g. {first}",
                suspect.len(),
            )
        });
        match verdict {
            Verdict::Open => {
                let idle = now.at.saturating_duration_since(c.last_change) >= self.idle_timeout;
                if overtaken.is_some() && c.transfer.is_none() {
                    c.settled = true;
                }
                if let Some(id) = c.transfer {
                    if idle || superseded || overtaken.is_some() {
                        let why = if let Some(n) = overtaken {
                            format!(
                                "checkpoint abandoned: the newer checkpoint of step {n} committed while this one was still open"
                            )
                        } else if idle {
                            format!(
                                "checkpoint abandoned: nothing written for {}",
                                humantime::format_duration(self.idle_timeout)
                            )
                        } else {
                            "superseded by a newer checkpoint (select = \"latest_only\")".into()
                        };
                        out.push(Action::EndTransfer {
                            transfer: id,
                            checkpoint_state: CheckpointState::Abandoned,
                            why,
                        });
                        c.drop_transfer();
                        c.settled = true;
                    } else {
                        c.view_committed = false;
                        out.push(Action::UpdateView {
                            transfer: id,
                            files: view,
                            state: ViewState::Open,
                            opened_ms: c.opened_ms,
                        });
                    }
                } else if !c.settled
                    && !idle
                    && !superseded
                    && self.watch.start == Start::OnOpen
                    && !view.is_empty()
                    // Orbax writes under a temporary directory name and
                    // commits by renaming it: its replica can only be
                    // named after the rename, so it is copied then.
                    && (format != Format::Orbax || !dir.contains(".orbax-checkpoint-tmp"))
                {
                    c.view_committed = false;
                    c.note.clone_from(&note);
                    out.push(Action::StartTransfer {
                        dir: dir.to_string(),
                        format,
                        files: view,
                        state: ViewState::Open,
                        opened_ms: c.opened_ms,
                        commit: None,
                        note: note.clone(),
                    });
                }
            }
            Verdict::Committed { markers, identity } => {
                let committed_ms = markers
                    .iter()
                    .filter_map(|m| infos.get(m))
                    .map(|f| f.mtime_ns / 1_000_000)
                    .max()
                    .unwrap_or(now.unix_ms);
                let state = ViewState::Committed {
                    markers,
                    committed_ms,
                    siblings: sibling_markers(format, dir, root.siblings),
                };
                let commit = Commit {
                    committed_ms,
                    identity,
                };
                if let Some(id) = c.transfer {
                    if !c.view_committed {
                        out.push(Action::MarkCommitted {
                            dir: dir.to_string(),
                            transfer: id,
                            format,
                            commit,
                        });
                    }
                    c.view_committed = true;
                    out.push(Action::UpdateView {
                        transfer: id,
                        files: view,
                        state,
                        opened_ms: c.opened_ms,
                    });
                } else if !superseded
                    && !view.is_empty()
                    && needs_copy(history, &commit.identity, committed_ms)
                {
                    c.settled = false;
                    c.view_committed = true;
                    c.note.clone_from(&note);
                    out.push(Action::StartTransfer {
                        dir: dir.to_string(),
                        format,
                        files: view,
                        state,
                        opened_ms: c.opened_ms,
                        commit: Some(commit),
                        note: note.clone(),
                    });
                }
            }
            Verdict::Abandoned(why) => {
                if let Some(id) = c.transfer {
                    out.push(Action::EndTransfer {
                        transfer: id,
                        checkpoint_state: CheckpointState::Abandoned,
                        why: format!("checkpoint abandoned: {why}"),
                    });
                    c.drop_transfer();
                }
                c.settled = true;
            }
        }
        if let Some(id) = c.transfer {
            if note != c.note {
                out.push(Action::SetNote {
                    dir: dir.to_string(),
                    transfer: id,
                    note: note.clone(),
                });
                c.note = note;
            }
            // A finished transfer no longer needs its view. Only a commit
            // with a new identity (a re-save) starts another transfer of
            // this directory.
            if finished.contains(&id) {
                out.push(Action::ReleaseView { transfer: id });
                c.drop_transfer();
                c.settled = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! The core driven by hand-made scans and a fake clock: a tiny
    //! in-memory "disk" and "catalog" stand in for the driver, so each
    //! watcher rule is a test with no runtime, no sleeps and no files.
    #![allow(clippy::unwrap_used)]

    use std::collections::BTreeMap;

    use super::*;

    /// A file of the fake disk.
    #[derive(Debug, Clone)]
    struct F {
        size: u64,
        mtime_ns: i64,
        version: u64,
        closed: bool,
        /// Its format check passes.
        intact: bool,
    }

    /// A catalog row of the fake catalog.
    #[derive(Debug, Clone)]
    struct Row {
        dir: String,
        t: PastTransfer,
        note: Option<String>,
    }

    /// The driver's part, in memory.
    struct H {
        core: WatchCore,
        disk: BTreeMap<String, BTreeMap<String, F>>,
        rows: Vec<Row>,
        announced: Vec<Announced>,
        t0: Instant,
        elapsed: Duration,
        versions: u64,
        /// `(dir, path)` of every file sampled, in order.
        sampled: Vec<(String, String)>,
    }

    const QUIET: Duration = Duration::from_secs(2);
    const IDLE: Duration = Duration::from_secs(60);
    const T0_MS: i64 = 1_700_000_000_000;

    fn timing() -> WatchTiming {
        WatchTiming {
            rescan: Duration::from_secs(1),
            quiet: QUIET,
            idle_timeout: IDLE,
        }
    }

    /// An empty ZIP end-of-central-directory record: the tail of a whole
    /// torch.save archive as far as the format check can tell.
    fn eocd() -> Vec<u8> {
        let mut v = b"PK\x05\x06".to_vec();
        v.resize(22, 0);
        v
    }

    impl H {
        fn new(watch: RootWatch) -> H {
            H {
                core: WatchCore::new(&watch, vec!["COMMITTED".into()], &timing()).unwrap(),
                disk: BTreeMap::new(),
                rows: Vec::new(),
                announced: Vec::new(),
                t0: Instant::now(),
                elapsed: Duration::ZERO,
                versions: 0,
                sampled: Vec::new(),
            }
        }

        fn now(&self) -> Now {
            Now {
                at: self.t0 + self.elapsed,
                unix_ms: T0_MS + self.elapsed.as_millis() as i64,
            }
        }

        fn advance(&mut self, d: Duration) {
            self.elapsed += d;
        }

        /// Writes `path` in `dir` (still open: no close seen).
        fn write(&mut self, dir: &str, path: &str, size: u64) {
            self.versions += 1;
            let f = F {
                size,
                mtime_ns: self.now().unix_ms * 1_000_000,
                version: self.versions,
                closed: false,
                intact: true,
            };
            self.disk
                .entry(dir.into())
                .or_default()
                .insert(path.into(), f);
        }

        /// The writer closes `path`: the close is seen for its version.
        fn close(&mut self, dir: &str, path: &str) {
            self.disk
                .get_mut(dir)
                .unwrap()
                .get_mut(path)
                .unwrap()
                .closed = true;
        }

        /// Writes and closes.
        fn put(&mut self, dir: &str, path: &str, size: u64) {
            self.write(dir, path, size);
            self.close(dir, path);
        }

        /// A whole DCP save of `dir`: two shards and `.metadata`.
        fn dcp(&mut self, dir: &str) {
            self.put(dir, "__0_0.distcp", 4000);
            self.put(dir, "__1_0.distcp", 4000);
            self.put(dir, ".metadata", 300);
        }

        fn mkdir(&mut self, dir: &str) {
            self.disk.entry(dir.into()).or_default();
        }

        fn row(&self, id: TransferId) -> &Row {
            self.rows.iter().find(|r| r.t.id == id).unwrap()
        }

        fn set_state(&mut self, id: TransferId, state: TransferState) {
            self.rows.iter_mut().find(|r| r.t.id == id).unwrap().t.state = state;
        }

        /// One full pass, as the driver runs it; the actions are carried
        /// out on the fake catalog and returned.
        fn pass(&mut self) -> Vec<Action> {
            let now = self.now();
            let mut scanned = Vec::new();
            for (dir, files) in &self.disk {
                let mut ds = DirScan {
                    created_ms: None,
                    files: Vec::new(),
                };
                for (path, f) in files {
                    let version = FileVersion::from_raw(f.version);
                    let sample = self
                        .core
                        .wants_sample(dir, path, version, f.closed, now.at)
                        .then(|| {
                            self.sampled.push((dir.clone(), path.clone()));
                            Sample::Read {
                                head: Vec::new(),
                                tail: if f.intact { eocd() } else { vec![0; 22] },
                            }
                        });
                    ds.files.push(ScannedFile {
                        path: path.clone(),
                        size: f.size,
                        mtime_ns: f.mtime_ns,
                        mode: 0o644,
                        version,
                        closed: f.closed,
                        content: None,
                        sample,
                    });
                }
                scanned.push((dir.clone(), Some(ds)));
            }
            let scan = RootScan {
                siblings: Vec::new(),
                dirs: self.disk.keys().cloned().collect(),
                scanned,
            };
            let q = self.core.questions(&scan);
            let mut answers = Answers {
                announced: self.announced.clone(),
                ..Answers::default()
            };
            for d in q.history {
                let h = self
                    .rows
                    .iter()
                    .filter(|r| r.dir == d)
                    .map(|r| r.t.clone())
                    .collect();
                answers.history.insert(d, h);
            }
            for id in q.finished {
                if self.row(id).t.state.is_final() {
                    answers.finished.insert(id);
                }
            }
            let actions = self.core.handle_scan(scan, &answers, now);
            for a in &actions {
                self.carry_out(a);
            }
            actions
        }

        fn carry_out(&mut self, a: &Action) {
            match a {
                Action::StartTransfer {
                    dir,
                    format,
                    commit,
                    note,
                    opened_ms,
                    ..
                } => {
                    let id = TransferId(self.rows.len() as u64 + 1);
                    self.rows.push(Row {
                        dir: dir.clone(),
                        t: PastTransfer {
                            id,
                            link: "wan".into(),
                            state: TransferState::Queued,
                            checkpoint: if commit.is_some() {
                                CheckpointState::Committed
                            } else {
                                CheckpointState::Open
                            },
                            format: Some(format.to_string()),
                            opened_ms: Some(*opened_ms),
                            commit_identity: commit.as_ref().map(|c| c.identity.clone()),
                            created_ms: self.now().unix_ms,
                        },
                        note: note.clone(),
                    });
                    self.core.started(dir, id);
                }
                Action::MarkCommitted {
                    transfer, commit, ..
                } => {
                    let r = self.rows.iter_mut().find(|r| r.t.id == *transfer).unwrap();
                    r.t.checkpoint = CheckpointState::Committed;
                    r.t.commit_identity = Some(commit.identity.clone());
                }
                Action::EndTransfer {
                    transfer,
                    checkpoint_state,
                    ..
                } => {
                    let r = self.rows.iter_mut().find(|r| r.t.id == *transfer).unwrap();
                    r.t.checkpoint = *checkpoint_state;
                    r.t.state = TransferState::Cancelled;
                }
                Action::SetNote { transfer, note, .. } => {
                    let r = self.rows.iter_mut().find(|r| r.t.id == *transfer).unwrap();
                    r.note = note.clone();
                }
                _ => {}
            }
        }
    }

    fn starts(actions: &[Action]) -> Vec<(&str, &ViewState, &Vec<ViewFile>)> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::StartTransfer {
                    dir, state, files, ..
                } => Some((dir.as_str(), state, files)),
                _ => None,
            })
            .collect()
    }

    fn ends(actions: &[Action]) -> Vec<(TransferId, CheckpointState, &str)> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::EndTransfer {
                    transfer,
                    checkpoint_state,
                    why,
                } => Some((*transfer, *checkpoint_state, why.as_str())),
                _ => None,
            })
            .collect()
    }

    fn view_of(actions: &[Action], id: TransferId) -> Option<(&ViewState, &Vec<ViewFile>)> {
        actions.iter().find_map(|a| match a {
            Action::UpdateView {
                transfer,
                state,
                files,
                ..
            } if *transfer == id => Some((state, files)),
            _ => None,
        })
    }

    fn paths(files: &[ViewFile]) -> Vec<&str> {
        files.iter().map(|f| f.info.path.as_str()).collect()
    }

    const STEP: &str = "step_00000002";

    #[test]
    fn dcp_checkpoint_opens_then_commits() {
        let mut h = H::new(RootWatch::default());
        h.write(STEP, "__0_0.distcp", 4000);
        let a = h.pass();
        assert!(a.contains(&Action::Recognised {
            dir: STEP.into(),
            format: Format::Dcp,
            transfer: None
        }));
        let s = starts(&a);
        assert_eq!(s.len(), 1, "{a:?}");
        assert_eq!(s[0].1, &ViewState::Open);
        assert_eq!(paths(s[0].2), ["__0_0.distcp"]);
        assert!(!s[0].2[0].complete && s[0].2[0].appendable);
        let id = h.core.transfer(STEP).unwrap();

        h.close(STEP, "__0_0.distcp");
        h.put(STEP, "__1_0.distcp", 4000);
        let a = h.pass();
        let (state, files) = view_of(&a, id).unwrap();
        assert_eq!(state, &ViewState::Open);
        assert!(files.iter().all(|f| f.complete), "{files:?}");

        h.put(STEP, ".metadata", 300);
        let a = h.pass();
        let Some(Action::MarkCommitted { commit, .. }) =
            a.iter().find(|a| matches!(a, Action::MarkCommitted { .. }))
        else {
            panic!("no commit: {a:?}")
        };
        assert_eq!(commit.committed_ms, h.now().unix_ms, "the marker's mtime");
        let (state, files) = view_of(&a, id).unwrap();
        assert!(
            matches!(state, ViewState::Committed { markers, .. } if markers == &[".metadata"]),
            "{state:?}"
        );
        assert_eq!(files.len(), 3);
        // Seen committed again: the view is updated, the commit not
        // recorded twice, no second transfer.
        let a = h.pass();
        assert!(view_of(&a, id).is_some());
        assert!(!a.iter().any(|a| matches!(
            a,
            Action::MarkCommitted { .. } | Action::StartTransfer { .. }
        )));
    }

    #[test]
    fn on_open_starts_while_written_and_on_commit_waits_for_the_marker() {
        let mut h = H::new(RootWatch {
            start: Start::OnCommit,
            ..RootWatch::default()
        });
        h.put(STEP, "__0_0.distcp", 4000);
        h.put(STEP, "__1_0.distcp", 4000);
        h.put(STEP, ".metadata.tmp", 300);
        assert!(starts(&h.pass()).is_empty());
        assert!(starts(&h.pass()).is_empty());
        h.disk.get_mut(STEP).unwrap().remove(".metadata.tmp");
        h.put(STEP, ".metadata", 300);
        let a = h.pass();
        let s = starts(&a);
        assert_eq!(s.len(), 1, "{a:?}");
        assert!(matches!(s[0].1, ViewState::Committed { .. }));
        let Some(Action::StartTransfer { commit, .. }) =
            a.iter().find(|a| matches!(a, Action::StartTransfer { .. }))
        else {
            unreachable!()
        };
        assert!(commit.is_some());

        let mut h = H::new(RootWatch::default());
        h.put(STEP, "__0_0.distcp", 4000);
        let a = h.pass();
        assert_eq!(starts(&a).len(), 1);
        assert!(matches!(
            a.iter().find(|a| matches!(a, Action::StartTransfer { .. })),
            Some(Action::StartTransfer { commit: None, .. })
        ));
    }

    #[test]
    fn quiet_period_completes_a_file_no_close_was_seen_for() {
        let mut h = H::new(RootWatch {
            format: Some(Format::Dcp),
            ..RootWatch::default()
        });
        // Written before the agent started, or on a network file system:
        // no close events.
        h.write(STEP, "__0_0.distcp", 4000);
        h.write(STEP, ".metadata", 300);
        let a = h.pass();
        let id = h.core.transfer(STEP).unwrap();
        assert!(starts(&a)[0].2.iter().all(|f| !f.complete));
        assert!(h.sampled.is_empty(), "nothing is settled yet");
        h.advance(QUIET - Duration::from_millis(1));
        let a = h.pass();
        assert!(view_of(&a, id).unwrap().1.iter().all(|f| !f.complete));
        h.advance(Duration::from_millis(1));
        let a = h.pass();
        assert_eq!(h.sampled.len(), 2, "checked once settled: {:?}", h.sampled);
        let (state, files) = view_of(&a, id).unwrap();
        assert!(files.iter().all(|f| f.complete));
        assert!(matches!(state, ViewState::Committed { .. }), "{state:?}");
    }

    #[test]
    fn a_change_restarts_the_quiet_period() {
        let mut h = H::new(RootWatch {
            format: Some(Format::Dcp),
            ..RootWatch::default()
        });
        h.write(STEP, "__0_0.distcp", 4000);
        h.pass();
        let id = h.core.transfer(STEP).unwrap();
        h.advance(QUIET / 2);
        h.write(STEP, "__0_0.distcp", 8000);
        h.pass();
        h.advance(QUIET / 2);
        let a = h.pass();
        assert!(!view_of(&a, id).unwrap().1[0].complete);
        h.advance(QUIET / 2);
        let a = h.pass();
        assert!(view_of(&a, id).unwrap().1[0].complete);
    }

    #[test]
    fn idle_checkpoint_is_abandoned_after_the_idle_timeout() {
        let mut h = H::new(RootWatch::default());
        h.put(STEP, "__0_0.distcp", 4000);
        h.pass();
        let id = h.core.transfer(STEP).unwrap();
        h.advance(IDLE - Duration::from_secs(1));
        assert!(ends(&h.pass()).is_empty());
        h.advance(Duration::from_secs(1));
        let a = h.pass();
        let e = ends(&a);
        assert_eq!(e.len(), 1, "{a:?}");
        assert_eq!((e[0].0, e[0].1), (id, CheckpointState::Abandoned));
        assert!(e[0].2.contains("nothing written for 1m"), "{}", e[0].2);
        // Nothing more happens to it, however long it sits there.
        for _ in 0..3 {
            h.advance(IDLE);
            assert_eq!(h.pass(), Vec::new());
        }
        assert_eq!(h.rows.len(), 1);
    }

    #[test]
    fn deleted_before_commit_ends_the_transfer_as_deleted() {
        let mut h = H::new(RootWatch::default());
        h.put(STEP, "__1_0.distcp", 4000);
        h.write(STEP, "__0_0.distcp", 1000);
        h.pass();
        let id = h.core.transfer(STEP).unwrap();
        h.disk.remove(STEP);
        let a = h.pass();
        assert_eq!(
            ends(&a),
            [(id, CheckpointState::Deleted, "checkpoint directory deleted")]
        );
        assert_eq!(h.core.transfer(STEP), None);
        assert_eq!(h.pass(), Vec::new());
    }

    #[test]
    fn resave_after_publish_makes_a_new_version() {
        let mut h = H::new(RootWatch::default());
        h.dcp(STEP);
        let a = h.pass();
        assert_eq!(starts(&a).len(), 1);
        let first = h.core.transfer(STEP).unwrap();
        h.set_state(first, TransferState::Published);
        let a = h.pass();
        assert!(a.contains(&Action::ReleaseView { transfer: first }));
        assert_eq!(h.core.transfer(STEP), None);
        // The same commit is not copied again.
        h.advance(Duration::from_secs(5));
        assert!(starts(&h.pass()).is_empty());
        // Saved again in place: new shard bytes, `.metadata` renamed over
        // the old one (a new identity).
        h.put(STEP, "__0_0.distcp", 4000);
        h.put(STEP, ".metadata", 300);
        let a = h.pass();
        assert_eq!(starts(&a).len(), 1, "{a:?}");
        let second = h.core.transfer(STEP).unwrap();
        assert_ne!(first, second);
        assert_ne!(
            h.row(first).t.commit_identity,
            h.row(second).t.commit_identity
        );
    }

    #[test]
    fn latest_only_supersedes_an_older_open_checkpoint() {
        let mut h = H::new(RootWatch {
            select: Selection::LatestOnly,
            ..RootWatch::default()
        });
        h.put(STEP, "__0_0.distcp", 4000);
        h.put(STEP, "__1_0.distcp", 4000);
        h.pass();
        let old = h.core.transfer(STEP).unwrap();
        h.put("step_00000004", "__0_0.distcp", 4000);
        let a = h.pass();
        let e = ends(&a);
        assert_eq!(e.len(), 1, "{a:?}");
        assert_eq!((e[0].0, e[0].1), (old, CheckpointState::Abandoned));
        assert!(e[0].2.contains("latest_only"));
        assert_eq!(starts(&a).len(), 1);
        assert_eq!(starts(&a)[0].0, "step_00000004");
        // The older one is not picked up again, even when it commits.
        h.put(STEP, ".metadata", 300);
        assert!(starts(&h.pass()).is_empty());
    }

    #[test]
    fn a_newer_commit_abandons_an_older_checkpoint_still_open() {
        let mut h = H::new(RootWatch::default());
        h.put(STEP, "__0_0.distcp", 4000);
        h.pass();
        let killed = h.core.transfer(STEP).unwrap();
        h.dcp("step_00000004");
        // Seen whole at once: recognised, then sampled and committed at
        // the next scan.
        h.pass();
        h.pass();
        let a = h.pass();
        let e = ends(&a);
        assert_eq!(e.len(), 1, "{a:?}");
        assert_eq!(e[0].0, killed);
        assert!(e[0].2.contains("step 4"), "{}", e[0].2);
    }

    #[test]
    fn temporaries_are_left_out_and_hold_the_commit() {
        let mut h = H::new(RootWatch::default());
        h.put(STEP, "__0_0.distcp", 4000);
        h.put(STEP, "__1_0.distcp", 4000);
        h.put(STEP, ".metadata.tmp", 300);
        h.put(STEP, "tmp.abc.tmp", 10);
        let a = h.pass();
        let s = starts(&a);
        assert_eq!(paths(s[0].2), ["__0_0.distcp", "__1_0.distcp"]);
        assert_eq!(s[0].1, &ViewState::Open, "a .metadata.tmp is no commit");
    }

    /// At start, the files of a checkpoint replicated before are not
    /// sampled again, however long they stay; without that replication
    /// they are (a polled root: no closes), and so is a file written
    /// after it.
    #[test]
    fn files_of_a_checkpoint_replicated_before_are_not_sampled_at_start() {
        let run = |replicated: bool| {
            let mut h = H::new(RootWatch {
                format: Some(Format::Dcp),
                ..RootWatch::default()
            });
            h.write(STEP, "__0_0.distcp", 4000);
            h.write(STEP, ".metadata", 300);
            if replicated {
                h.rows.push(Row {
                    dir: STEP.into(),
                    t: PastTransfer {
                        id: TransferId(4),
                        link: "wan".into(),
                        state: TransferState::Published,
                        checkpoint: CheckpointState::Committed,
                        format: Some("dcp".into()),
                        opened_ms: Some(T0_MS - 5000),
                        commit_identity: Some("c".into()),
                        created_ms: T0_MS + 1000,
                    },
                    note: None,
                });
            }
            for _ in 0..3 {
                h.pass();
                h.advance(QUIET);
            }
            h
        };
        assert_eq!(run(false).sampled.len(), 2, "not replicated: both checked");
        let mut h = run(true);
        assert_eq!(h.sampled, [], "replicated before: not read again");
        // Rewritten after its replication: checked again once settled.
        h.advance(Duration::from_secs(5));
        h.write(STEP, "__0_0.distcp", 4000);
        for _ in 0..3 {
            h.pass();
            h.advance(QUIET);
        }
        assert_eq!(
            h.sampled,
            [(STEP.to_string(), "__0_0.distcp".to_string())],
            "the rewritten file is checked"
        );
    }

    #[test]
    fn file_changed_after_its_check_is_checked_again() {
        let mut h = H::new(RootWatch {
            format: Some(Format::Dcp),
            ..RootWatch::default()
        });
        h.put(STEP, "__0_0.distcp", 4000);
        h.pass();
        h.pass();
        assert_eq!(h.sampled.len(), 1, "checked once per version");
        // Rewritten with the same size (and, say, the same mtime): a new
        // version all the same.
        h.versions += 1;
        let f = h
            .disk
            .get_mut(STEP)
            .unwrap()
            .get_mut("__0_0.distcp")
            .unwrap();
        f.version = h.versions;
        f.closed = false;
        // This time the writer leaves it without its end record.
        f.intact = false;
        h.pass();
        assert_eq!(h.sampled.len(), 1, "not settled: no close, not quiet");
        h.close(STEP, "__0_0.distcp");
        let a = h.pass();
        assert_eq!(h.sampled.len(), 2, "{:?}", h.sampled);
        let id = h.core.transfer(STEP).unwrap();
        assert!(
            !view_of(&a, id).unwrap().1[0].complete,
            "the new check counts"
        );
        assert!(h.row(id).note.as_deref().unwrap().contains("__0_0.distcp"));
    }

    #[test]
    fn truncated_shard_waits_with_a_note_until_it_is_whole() {
        let mut h = H::new(RootWatch {
            format: Some(Format::Dcp),
            ..RootWatch::default()
        });
        h.put(STEP, "__0_0.distcp", 4000);
        h.put(STEP, "__1_0.distcp", 3000);
        h.disk
            .get_mut(STEP)
            .unwrap()
            .get_mut("__1_0.distcp")
            .unwrap()
            .intact = false;
        h.put(STEP, ".metadata", 300);
        let a = h.pass();
        let s = starts(&a);
        assert_eq!(s[0].1, &ViewState::Open, "not committed: {a:?}");
        let id = h.core.transfer(STEP).unwrap();
        assert!(h.row(id).note.as_deref().unwrap().contains("__1_0.distcp"));
        assert!(!h.pass().iter().any(|a| matches!(a, Action::SetNote { .. })));
        h.put(STEP, "__1_0.distcp", 4000);
        let a = h.pass();
        assert!(a.contains(&Action::SetNote {
            dir: STEP.into(),
            transfer: id,
            note: None
        }));
        assert!(matches!(
            view_of(&a, id).unwrap().0,
            ViewState::Committed { .. }
        ));
    }

    #[test]
    fn a_damaged_save_first_seen_complete_on_an_auto_root_is_not_committed() {
        // The root's format is auto: the first scan sees the whole save,
        // its marker and a truncated shard at once, before any sample.
        let mut h = H::new(RootWatch::default());
        h.put(STEP, "__0_0.distcp", 4000);
        h.put(STEP, "__1_0.distcp", 3000);
        h.disk
            .get_mut(STEP)
            .unwrap()
            .get_mut("__1_0.distcp")
            .unwrap()
            .intact = false;
        h.put(STEP, ".metadata", 300);
        let committed = |a: &[Action]| {
            a.iter().any(|a| {
                matches!(
                    a,
                    Action::StartTransfer {
                        state: ViewState::Committed { .. },
                        ..
                    } | Action::UpdateView {
                        state: ViewState::Committed { .. },
                        ..
                    }
                )
            })
        };
        for _ in 0..3 {
            let a = h.pass();
            assert!(!committed(&a), "committed with a truncated shard: {a:?}");
        }
        // Once whole, it commits.
        h.put(STEP, "__1_0.distcp", 4000);
        let mut seen = false;
        for _ in 0..3 {
            seen |= committed(&h.pass());
        }
        assert!(seen, "the whole save never committed");
    }

    #[test]
    fn every_n_steps_skips_off_cadence_directories() {
        let mut h = H::new(RootWatch {
            select: Selection::EveryNSteps(1000),
            ..RootWatch::default()
        });
        for d in ["step_1500", "step_2000"] {
            h.put(d, "weights.bin", 70_000);
            h.put(d, "COMMITTED", 0);
        }
        let a = h.pass();
        let s = starts(&a);
        assert_eq!(s.len(), 1, "{a:?}");
        assert_eq!(s[0].0, "step_2000");
        assert!(!h.core.selects("step_2500") && h.core.selects("step_3000"));
    }

    #[test]
    fn a_signal_pick_replicates_what_select_skips_until_it_ends() {
        let mut h = H::new(RootWatch {
            select: Selection::EveryNSteps(1000),
            ..RootWatch::default()
        });
        for d in ["step_1500", "step_2000"] {
            h.put(d, "weights.bin", 70_000);
            h.put(d, "COMMITTED", 0);
        }
        let a = h.pass();
        assert_eq!(starts(&a).len(), 1, "{a:?}");
        // A pin picks the skipped step 1500, and the first at or after
        // 2100 (none yet).
        h.core.add_pick(Pick::Dir("step_1500".into()), i64::MAX);
        h.core.add_pick(Pick::AtOrAfter(2100), i64::MAX);
        let dirs: Vec<String> = ["step_1500", "step_2000"].map(String::from).to_vec();
        assert!(h.core.settle_picks(&dirs, 0).is_empty());
        assert!(h.core.selects("step_1500"));
        let a = h.pass();
        let s = starts(&a);
        assert_eq!(s.len(), 1, "{a:?}");
        assert_eq!(s[0].0, "step_1500");
        // 2500 and 2700 appear (both off the cadence): only the first at
        // or after 2100 is picked.
        let dirs: Vec<String> = ["step_2700", "step_2500"].map(String::from).to_vec();
        assert_eq!(
            h.core.settle_picks(&dirs, 0),
            vec![("step_2500".to_string(), 2100)]
        );
        assert!(h.core.selects("step_2500") && !h.core.selects("step_2700"));
        // Picks end.
        h.core.add_pick(Pick::Dir("step_3500".into()), 10);
        assert!(h.core.selects("step_3500"));
        h.core.settle_picks(&[], 10);
        assert!(!h.core.selects("step_3500"));
    }

    #[test]
    fn weights_only_skips_a_dcp_checkpoint_once() {
        let mut h = H::new(RootWatch {
            profile: Profile::WeightsOnly,
            ..RootWatch::default()
        });
        h.dcp(STEP);
        let a = h.pass();
        assert!(starts(&a).is_empty());
        assert!(a.iter().any(|a| matches!(a, Action::Skip { .. })), "{a:?}");
        assert!(!h.pass().iter().any(|a| matches!(a, Action::Skip { .. })));
    }

    #[test]
    fn orbax_temporary_directory_waits_for_its_rename() {
        let mut h = H::new(RootWatch::default());
        let tmp = "5.orbax-checkpoint-tmp-1712345678";
        h.put(tmp, "state/array.bin", 100_000);
        assert!(starts(&h.pass()).is_empty());
        let files = h.disk.remove(tmp).unwrap();
        h.disk.insert("5".into(), files);
        h.put("5", "_CHECKPOINT_METADATA", 2);
        h.put("5", "commit_success.txt", 2);
        let a = h.pass();
        assert_eq!(starts(&a).len(), 1, "{a:?}");
        assert_eq!(starts(&a)[0].0, "5");
    }

    #[test]
    fn announced_checkpoint_opens_with_its_first_bytes_or_expires() {
        let mut h = H::new(RootWatch::default());
        h.rows.push(Row {
            dir: STEP.into(),
            t: PastTransfer {
                id: TransferId(7),
                link: "wan".into(),
                state: TransferState::Queued,
                checkpoint: CheckpointState::Announced,
                format: None,
                opened_ms: None,
                commit_identity: None,
                created_ms: T0_MS,
            },
            note: None,
        });
        h.put(STEP, "__0_0.distcp", 4000);
        let a = h.pass();
        assert!(
            matches!(a.first(), Some(Action::AnnouncedOpened { transfer, .. }) if *transfer == TransferId(7)),
            "{a:?}"
        );

        let mut h = H::new(RootWatch::default());
        h.announced.push(Announced {
            id: TransferId(9),
            dir: STEP.into(),
            created_ms: T0_MS,
        });
        h.mkdir("step_00000001");
        assert_eq!(h.pass(), Vec::new());
        h.advance(IDLE + Duration::from_millis(1));
        let a = h.pass();
        assert!(
            matches!(a.as_slice(), [Action::ExpireAnnouncement { transfer, why }] if *transfer == TransferId(9) && why.contains("never appeared")),
            "{a:?}"
        );
    }

    #[test]
    fn restart_adopts_an_unfinished_transfer() {
        let mut h = H::new(RootWatch::default());
        h.rows.push(Row {
            dir: STEP.into(),
            t: PastTransfer {
                id: TransferId(3),
                link: "wan".into(),
                state: TransferState::Active,
                checkpoint: CheckpointState::Open,
                format: Some("dcp".into()),
                opened_ms: Some(T0_MS - 5000),
                commit_identity: None,
                created_ms: T0_MS - 5000,
            },
            note: None,
        });
        h.put(STEP, "__0_0.distcp", 4000);
        let a = h.pass();
        assert_eq!(
            a.first(),
            Some(&Action::Adopt {
                dir: STEP.into(),
                transfer: TransferId(3),
                link: "wan".into(),
                opened_ms: T0_MS - 5000
            })
        );
        assert!(starts(&a).is_empty());
        assert!(view_of(&a, TransferId(3)).is_some());
    }

    #[test]
    fn a_failed_start_is_tried_again() {
        let mut h = H::new(RootWatch::default());
        h.put(STEP, "__0_0.distcp", 4000);
        // The driver could not queue it (not reported as started).
        let a = h.core.handle_scan(
            RootScan {
                siblings: Vec::new(),
                dirs: vec![STEP.into()],
                scanned: vec![(
                    STEP.into(),
                    Some(DirScan {
                        created_ms: None,
                        files: vec![ScannedFile {
                            path: "__0_0.distcp".into(),
                            size: 4000,
                            mtime_ns: 0,
                            mode: 0o644,
                            version: FileVersion::from_raw(1),
                            closed: true,
                            content: None,
                            sample: None,
                        }],
                    }),
                )],
            },
            &Answers::default(),
            h.now(),
        );
        assert_eq!(starts(&a).len(), 1);
        assert_eq!(starts(&h.pass()).len(), 1);
    }
}
