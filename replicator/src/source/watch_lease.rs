//! Watching a source root in a pool: one agent at a time, under a lease.
//!
//! Every source agent of a pool configured with a root runs one
//! supervisor for it. Each heartbeat interval the supervisor reads who
//! watches the root; every [`LOOK_EVERY`], and at every heartbeat while
//! nobody holds a live watch of it, it records the agent's fingerprint
//! of the root in the catalog (see [`fingerprint`]) and, while the agent
//! does not watch it, claims the root's watch lease ([`ferry_catalog::Catalog::claim_watch`]); the agent that holds
//! it runs the watcher ([`super::watcher`]) on the root. A watch whose
//! holder stops heartbeating lapses after the lease timeout and another
//! agent takes it over: its watcher adopts the transfers of the
//! checkpoints the catalog has for the root, so a checkpoint being
//! written is replicated once. A drained agent releases its watches at
//! once. An agent whose fingerprint disagrees with the watching agent's
//! does not see the same storage at the root's path: it never watches
//! the root, and says why (log, `GET /v1/pool`). Nothing is written into
//! the root.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, UNIX_EPOCH};

use ferry_catalog::now_ms;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::watcher::{self, WatchTiming};
use super::{Inner, RootConfig};
use crate::pool::Membership;

/// How many files a fingerprint lists (the first in a sorted
/// depth-first walk of the root).
pub const FINGERPRINT_FILES: usize = 100;

/// Files modified less than this long before a fingerprint is taken are
/// left out of it (10 s): files being written differ between two looks.
pub const FINGERPRINT_SETTLE: Duration = Duration::from_secs(10);

/// How often an agent refreshes its fingerprint of a root while nothing
/// can change hands (it watches the root, or another agent's lease on it
/// is live): 15 s. Without a live watcher it looks at every heartbeat.
pub const LOOK_EVERY: Duration = Duration::from_secs(15);

/// One file of a fingerprint: path relative to the root, size in bytes,
/// mtime in Unix ms.
pub type FingerprintEntry = (String, u64, i64);

/// The first [`FINGERPRINT_FILES`] regular files under `root` (sorted
/// depth-first walk, names compared as bytes; symbolic links are not
/// followed) modified at or before `cutoff_ms` (Unix ms): their relative
/// paths, sizes and mtimes.
///
/// # Errors
/// The root cannot be listed; unreadable subdirectories and files that
/// vanish during the walk are skipped.
pub fn fingerprint(root: &Path, cutoff_ms: i64) -> std::io::Result<Vec<FingerprintEntry>> {
    let mut out = Vec::new();
    walk(root, root, cutoff_ms, &mut out, true)?;
    Ok(out)
}

/// [`fingerprint`] of a root in a remote store (HDFS, S3), from one
/// listing through `store`: the first [`FINGERPRINT_FILES`] files by path
/// (temporaries and Ferry's own files are not listed).
///
/// # Errors
/// The root cannot be listed.
pub fn fingerprint_remote(
    store: &dyn crate::storage::SourceStore,
    root: &Path,
    cutoff_ms: i64,
) -> std::io::Result<Vec<FingerprintEntry>> {
    let listing = store
        .list(root, &[])
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    let mut files: Vec<FingerprintEntry> = listing
        .files
        .into_iter()
        .map(|f| (f.info.path, f.info.size, f.info.mtime_ns / 1_000_000))
        .filter(|(_, _, mtime_ms)| *mtime_ms <= cutoff_ms)
        .collect();
    files.sort();
    files.truncate(FINGERPRINT_FILES);
    Ok(files)
}

fn walk(
    root: &Path,
    dir: &Path,
    cutoff_ms: i64,
    out: &mut Vec<FingerprintEntry>,
    top: bool,
) -> std::io::Result<()> {
    let mut names = match std::fs::read_dir(dir) {
        Ok(rd) => rd
            .filter_map(|e| e.ok().map(|e| e.file_name()))
            .collect::<Vec<_>>(),
        Err(e) if top => return Err(e),
        Err(_) => return Ok(()),
    };
    names.sort();
    for name in names {
        if out.len() >= FINGERPRINT_FILES {
            return Ok(());
        }
        let path = dir.join(&name);
        let Ok(md) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if md.is_dir() {
            walk(root, &path, cutoff_ms, out, false)?;
        } else if md.is_file() {
            let mtime_ms = md
                .modified()
                .ok()
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_millis() as i64);
            if mtime_ms > cutoff_ms {
                continue;
            }
            let rel = path
                .strip_prefix(root)
                .unwrap_or(&path)
                .to_string_lossy()
                .into_owned();
            out.push((rel, md.len(), mtime_ms));
        }
    }
    Ok(())
}

/// Whether two fingerprints of one root taken with the same cutoff show
/// the same storage: every file both list has the same size and mtime,
/// and they list at least one file in common (or both list none). Files
/// only one lists are ignored, so files deleted or added between the two
/// looks do not count.
///
/// # Errors
/// Why they differ, naming the first file that differs.
pub fn same_storage(mine: &[FingerprintEntry], theirs: &[FingerprintEntry]) -> Result<(), String> {
    if mine.is_empty() && theirs.is_empty() {
        return Ok(());
    }
    if mine.is_empty() || theirs.is_empty() {
        return Err(format!(
            "this agent sees {} settled file(s) there, the other agent {}",
            mine.len(),
            theirs.len()
        ));
    }
    if files_in_common(mine, theirs)? == 0 {
        return Err(format!(
            "none of the first {} files here (from {:?}) is among the other agent's (from {:?})",
            mine.len(),
            mine[0].0,
            theirs[0].0
        ));
    }
    Ok(())
}

/// A Unix-ms time as RFC 3339 (UTC, milliseconds).
fn show_ms(ms: i64) -> String {
    let t = UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_millis(t).to_string()
}

/// The watcher this agent runs on a root while it holds the root's
/// watch.
struct Watching {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    /// Local time the claim returned.
    claimed: Instant,
}

impl Watching {
    /// Starts the watcher on `root`, and its fence: the watcher is
    /// stopped within [`crate::pool::FENCE_CHECK`] of the agent no longer
    /// holding the watch, whatever the supervisor is waiting on.
    fn start(
        inner: &Arc<Inner>,
        root: &RootConfig,
        timing: &WatchTiming,
        pool: &Membership,
    ) -> Self {
        let stop = inner.shutdown.child_token();
        let claimed = Instant::now();
        let task = tokio::spawn(watcher::watch_root(
            inner.clone(),
            root.clone(),
            timing.clone(),
            stop.clone(),
        ));
        let (fence_pool, fence_stop) = (pool.clone(), stop.clone());
        let key = root.path.to_string_lossy().into_owned();
        tokio::spawn(async move {
            tokio::select! {
                _ = fence_pool.watch_lost(&key, claimed) => fence_stop.cancel(),
                _ = fence_stop.cancelled() => {}
            }
        });
        Watching {
            stop,
            task,
            claimed,
        }
    }

    async fn end(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

/// Why a look at a root failed.
enum LookError {
    /// The root could not be listed (gone, unmounted, no permission).
    Root(String),
    /// The catalog did not answer, or holds a value that does not parse.
    Catalog(String),
}

/// Supervises `root` in `pool` until the agent stops (see the module
/// doc).
pub(super) async fn supervise_root(
    inner: Arc<Inner>,
    root: RootConfig,
    timing: WatchTiming,
    pool: Membership,
) {
    let key = root.path.to_string_lossy().into_owned();
    let me = pool.name().to_string();
    let catalog = inner.catalog.clone();
    let cfg = pool.config();
    let lease_ms = cfg.lease_timeout.as_millis() as i64;
    let mut tick = tokio::time::interval(cfg.heartbeat_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut watching: Option<Watching> = None;
    let mut refused: Option<String> = None;
    let mut failing: Option<String> = None;
    // Since when the root cannot be listed (it is released after the
    // lease timeout of that).
    let mut unreadable_since: Option<Instant> = None;
    let mut last_look: Option<Instant> = None;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = pool.changed() => {}
            _ = inner.shutdown.cancelled() => break,
        }
        if let Some(w) = &watching {
            let lost = !pool.holds_watch(&key, w.claimed);
            let drained = pool.draining();
            if lost || drained || w.task.is_finished() {
                if let Some(w) = watching.take() {
                    w.end().await;
                }
                if lost {
                    warn!(root = key, "lost the watch of this root (its lease was not renewed in time): stopped watching");
                } else if drained {
                    release(&catalog, &key, &me, "drained").await;
                }
            }
        }
        // Who holds the watch now decides whether there is anything to
        // do before the next periodic look: while this agent watches the
        // root, or another agent's lease on it is live, nobody can claim
        // it, so the fingerprint is only refreshed every LOOK_EVERY.
        let lease = match catalog.watch(&key).await {
            Ok(l) => l,
            Err(e) => {
                note_failure(
                    &key,
                    &mut failing,
                    format!("cannot read the root's watch: {e}"),
                );
                continue;
            }
        };
        let other_live = lease
            .as_ref()
            .is_some_and(|l| l.live && l.holder.as_deref().is_some_and(|h| h != me));
        let watched = lease.as_ref().is_some_and(|l| l.live && l.holder.is_some());
        inner.metrics.set_root_watch(
            &key,
            watched,
            refused.is_some() || unreadable_since.is_some(),
        );
        let due = last_look.is_none_or(|t: Instant| t.elapsed() >= LOOK_EVERY);
        if !due && unreadable_since.is_none() && (watching.is_some() || other_live) {
            continue;
        }
        last_look = Some(Instant::now());
        let verdict = match look(
            &inner,
            &root,
            &key,
            &me,
            watching.is_some(),
            lease.as_ref(),
            cfg,
        )
        .await
        {
            Ok(v) => {
                if failing.take().is_some() {
                    info!(root = key, "the root's fingerprint is recorded again");
                }
                unreadable_since = None;
                v
            }
            Err(LookError::Catalog(e)) => {
                note_failure(
                    &key,
                    &mut failing,
                    format!("cannot record the root's fingerprint: {e}"),
                );
                continue;
            }
            Err(LookError::Root(e)) => {
                note_failure(&key, &mut failing, e.clone());
                let since = *unreadable_since.get_or_insert_with(Instant::now);
                // Said in the catalog, so `ferry pool` shows it and no other
                // agent takes this agent's view for a reference.
                let why = format!("cannot list the root: {e}");
                let _ = catalog
                    .record_root_fingerprint(&key, &me, "[]", now_ms(), Some(&why))
                    .await;
                if watching.is_some() && since.elapsed() >= cfg.lease_timeout {
                    if let Some(w) = watching.take() {
                        w.end().await;
                    }
                    release(&catalog, &key, &me, "the root cannot be listed").await;
                }
                continue;
            }
        };
        if verdict != refused {
            match &verdict {
                Some(why) => warn!(
                    root = key,
                    "not watching this root: it does not look like the storage the other agents \
                     see at that path ({why}); every source agent of a pool must read the same \
                     storage there"
                ),
                None if refused.is_some() => {
                    info!(root = key, "the root's fingerprint agrees again")
                }
                None => {}
            }
            refused = verdict;
        }
        inner
            .metrics
            .set_root_watch(&key, watched, refused.is_some());
        if refused.is_some() {
            if let Some(w) = watching.take() {
                w.end().await;
                release(&catalog, &key, &me, "its view of the root differs").await;
            }
            continue;
        }
        if watching.is_some() || !pool.may_claim() {
            continue;
        }
        match catalog.claim_watch(&key, &me, lease_ms).await {
            Ok(Some(c)) => {
                match &c.took_over_from {
                    Some(from) => {
                        pool.count_takeover();
                        info!(
                            root = key,
                            from,
                            epoch = c.epoch,
                            "took the watch of this root over (the watching agent's lease lapsed)"
                        );
                    }
                    None => info!(
                        root = key,
                        epoch = c.epoch,
                        "holding the watch of this root"
                    ),
                }
                watching = Some(Watching::start(&inner, &root, &timing, &pool));
            }
            Ok(None) => {}
            Err(e) => warn!(root = key, error = %e, "claiming the watch of this root"),
        }
    }
    if let Some(w) = watching.take() {
        w.end().await;
    }
}

/// Logs `why` once until it changes (a failure repeated every heartbeat
/// is one line).
fn note_failure(key: &str, failing: &mut Option<String>, why: String) {
    if failing.as_deref() != Some(why.as_str()) {
        warn!(root = key, "{why}");
        *failing = Some(why);
    }
}

/// Releases this agent's watch of `key` in the catalog (the watcher was
/// stopped), saying `why` in the log.
async fn release(catalog: &ferry_catalog::Catalog, key: &str, me: &str, why: &str) {
    match catalog.release_watch(key, me).await {
        Ok(_) => info!(
            root = key,
            "{why}: released the watch of this root to the other agents"
        ),
        Err(e) => {
            warn!(root = key, error = %e, "{why}: stopped watching; releasing the watch in the catalog failed (it lapses after the lease timeout)")
        }
    }
}

/// Takes this agent's fingerprint of the root and records it, with its
/// verdict; `Some(why)` when this agent must not watch the root.
///
/// - An agent that does not hold the watch compares with the watching
///   agent's fingerprint while that agent's lease is live, else with the
///   newest fingerprint of another agent that does not refuse the root.
///   A reference recorded within `lease_timeout + LOOK_EVERY` is compared
///   strictly, at its cutoff ([`same_storage`]); an older one (its agent
///   may be long gone, and retention may have deleted every file it
///   listed) only refuses on evidence: this agent sees no settled file
///   where it saw some, or a file both list differs.
/// - The watching agent keeps its view unless it sees no settled file
///   while another agent's fresh fingerprint lists some (a missing
///   mount under the watching agent).
async fn look(
    inner: &Inner,
    root: &RootConfig,
    key: &str,
    me: &str,
    holding: bool,
    lease: Option<&ferry_catalog::WatchLease>,
    cfg: crate::pool::PoolConfig,
) -> Result<Option<String>, LookError> {
    let catalog = &inner.catalog;
    let others: Vec<_> = catalog
        .root_fingerprints(Some(key))
        .await
        .map_err(|e| LookError::Catalog(e.to_string()))?
        .into_iter()
        .filter(|f| f.agent != me)
        .collect();
    let fresh_ms = (cfg.lease_timeout + LOOK_EVERY).as_millis() as i64;
    let parse = |r: &ferry_catalog::RootFingerprint| {
        serde_json::from_str::<Vec<FingerprintEntry>>(&r.entries).map_err(|e| {
            LookError::Catalog(format!(
                "agent {}'s recorded fingerprint does not parse: {e}",
                r.agent
            ))
        })
    };
    let live_holder = lease
        .filter(|l| l.live)
        .and_then(|l| l.holder.as_deref())
        .filter(|h| *h != me);
    let reference = if holding {
        None
    } else {
        match live_holder {
            Some(h) => others.iter().find(|f| f.agent == h),
            None => others
                .iter()
                .filter(|f| f.refused.is_none())
                .max_by_key(|f| f.recorded_at),
        }
    };
    let theirs = reference.map(|r| parse(r).map(|e| (r, e))).transpose()?;
    let cutoff = now_ms() - FINGERPRINT_SETTLE.as_millis() as i64;
    let path = root.path.clone();
    let compare_at = theirs.as_ref().map(|(r, _)| r.cutoff_ms);
    let store = inner.store.clone();
    let (mine, mine_then) = tokio::task::spawn_blocking(move || {
        let take = |cutoff| {
            if crate::storage::router::is_url(&path) {
                fingerprint_remote(&*store, &path, cutoff)
            } else {
                fingerprint(&path, cutoff)
            }
        };
        let mine = take(cutoff)?;
        let then = compare_at.map(take).transpose()?;
        Ok::<_, std::io::Error>((mine, then))
    })
    .await
    .map_err(|e| LookError::Root(format!("fingerprint task: {e}")))?
    .map_err(|e| LookError::Root(format!("cannot list {}: {e}", root.path.display())))?;
    let verdict = if holding {
        let mut seen = None;
        if mine.is_empty() {
            for f in others.iter().filter(|f| f.age_ms <= fresh_ms) {
                let n = parse(f)?.len();
                if n > 0 {
                    seen = Some((f.agent.clone(), n));
                    break;
                }
            }
        }
        seen.map(|(agent, n)| {
            format!("this agent sees no settled file there, agent {agent} sees {n}")
        })
    } else {
        match (theirs, mine_then) {
            (Some((r, entries)), Some(then)) if r.age_ms <= fresh_ms => {
                same_storage(&then, &entries)
                    .err()
                    .map(|why| format!("differs from agent {}'s: {why}", r.agent))
            }
            (Some((r, entries)), _) => no_contradiction(&mine, &entries).err().map(|why| {
                format!(
                    "differs from agent {}'s fingerprint of {} s ago: {why}",
                    r.agent,
                    r.age_ms / 1000
                )
            }),
            _ => None,
        }
    };
    let entries = serde_json::to_string(&mine).map_err(|e| LookError::Catalog(e.to_string()))?;
    catalog
        .record_root_fingerprint(key, me, &entries, cutoff, verdict.as_deref())
        .await
        .map_err(|e| LookError::Catalog(e.to_string()))?;
    Ok(verdict)
}

/// The check against an old fingerprint (its files may have been deleted
/// since, and others written): `mine` must list some file if `theirs`
/// did, and no file both list may differ in size or mtime.
///
/// # Errors
/// What contradicts it.
pub fn no_contradiction(
    mine: &[FingerprintEntry],
    theirs: &[FingerprintEntry],
) -> Result<(), String> {
    if mine.is_empty() && !theirs.is_empty() {
        return Err(format!(
            "this agent sees no settled file there, that agent saw {}",
            theirs.len()
        ));
    }
    files_in_common(mine, theirs).map(|_| ())
}

/// How many files both fingerprints list, all with the same size and
/// mtime in both.
///
/// # Errors
/// The first file both list whose size or mtime differs, named.
fn files_in_common(
    mine: &[FingerprintEntry],
    theirs: &[FingerprintEntry],
) -> Result<usize, String> {
    let mut common = 0;
    for (name, size, mtime) in mine {
        if let Some((_, s, m)) = theirs.iter().find(|(n, _, _)| n == name) {
            if (s, m) != (size, mtime) {
                return Err(format!(
                    "{name}: {size} bytes modified at {} here; {s} bytes modified at {} there",
                    show_ms(*mtime),
                    show_ms(*m)
                ));
            }
            common += 1;
        }
    }
    Ok(common)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn e(n: &str, size: u64, mtime: i64) -> FingerprintEntry {
        (n.to_string(), size, mtime)
    }

    #[test]
    fn fingerprints_agree_on_common_files_and_ignore_the_rest() {
        let a = vec![e("s1/a", 1, 10), e("s1/b", 2, 11), e("s2/a", 3, 12)];
        // Deleted at the front, added at the end: still the same storage.
        let b = vec![e("s1/b", 2, 11), e("s2/a", 3, 12), e("s3/a", 4, 13)];
        assert_eq!(same_storage(&a, &b), Ok(()));
        assert_eq!(same_storage(&[], &[]), Ok(()));
        // A file both list, with another size or mtime.
        let c = vec![e("s1/b", 2, 99)];
        assert!(same_storage(&a, &c).unwrap_err().starts_with("s1/b"));
        // Nothing in common, or one side empty.
        assert!(same_storage(&a, &[e("x", 1, 1)])
            .unwrap_err()
            .contains("none of"));
        assert!(same_storage(&a, &[]).is_err());
        assert!(same_storage(&[], &a).is_err());
    }

    #[test]
    fn an_old_fingerprint_refuses_only_on_evidence() {
        let old = vec![e("s1/a", 1, 10), e("s1/b", 2, 11)];
        // Every file it listed deleted since, others written: agrees.
        assert_eq!(no_contradiction(&[e("s9/a", 5, 90)], &old), Ok(()));
        assert_eq!(no_contradiction(&[], &[]), Ok(()));
        // Nothing seen where it saw files, or a common file changed.
        assert!(no_contradiction(&[], &old)
            .unwrap_err()
            .contains("no settled file"));
        assert!(no_contradiction(&[e("s1/b", 3, 11)], &old)
            .unwrap_err()
            .starts_with("s1/b"));
    }

    #[test]
    fn a_fingerprint_lists_settled_files_in_walk_order_up_to_its_limit() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("step_2")).unwrap();
        std::fs::create_dir_all(d.path().join("step_1")).unwrap();
        std::fs::write(d.path().join("step_2/x"), b"abc").unwrap();
        std::fs::write(d.path().join("step_1/y"), b"a").unwrap();
        std::fs::write(d.path().join("latest"), b"2").unwrap();
        let now = now_ms() + 1_000;
        let f = fingerprint(d.path(), now).unwrap();
        let names: Vec<&str> = f.iter().map(|x| x.0.as_str()).collect();
        assert_eq!(names, ["latest", "step_1/y", "step_2/x"]);
        assert_eq!(f[2].1, 3);
        // A cutoff before the files were written leaves them out.
        assert!(fingerprint(d.path(), 0).unwrap().is_empty());
        for i in 0..(FINGERPRINT_FILES + 5) {
            std::fs::write(d.path().join(format!("step_1/f{i:03}")), b"").unwrap();
        }
        assert_eq!(
            fingerprint(d.path(), now + 1_000).unwrap().len(),
            FINGERPRINT_FILES
        );
        assert!(fingerprint(&d.path().join("missing"), now).is_err());
    }
}
