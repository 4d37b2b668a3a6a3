//! Pins around an anomaly signal: on a signal of a kind that pins
//! (`[source] pin_on`), the source picks from its own listing of the job's
//! checkpoints the last one before the signal's step (the last good one)
//! and the first at or after it, replicates them if its `select` rule
//! skipped them and they still exist, and asks every sink of the job's
//! links to pin them for `pin_for` (wire protocol version 6,
//! [`Control::Pin`](ferry_proto::wire::Control::Pin)). When no checkpoint
//! at or after the step exists yet, the sink pins the first one published
//! later, and the watcher replicates the first one that appears whatever
//! `select` says; a signal without a step pins the newest replica. A
//! picked checkpoint is replicated by its root's watcher, as any other:
//! once its format says it committed (a crashed save is never published).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ferry_catalog::Signal;
use ferry_proto::state::TransferState;
use ferry_proto::wire::{PinRequest, PinTarget};
use tracing::{info, warn};

use super::watch_core::Pick;
use super::Inner;

/// Which signals pin, and for how long (`[source] pin_on`, `pin_for`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignalPins {
    /// Signal kinds that pin (of [`super::SIGNAL_KINDS`]); empty: none.
    pub kinds: Vec<String>,
    /// How long the pins last.
    pub pin_for: Duration,
}

impl Default for SignalPins {
    /// Every kind, for 7 days.
    fn default() -> Self {
        SignalPins {
            kinds: super::SIGNAL_KINDS.iter().map(|k| k.to_string()).collect(),
            pin_for: Duration::from_secs(7 * 86_400),
        }
    }
}

/// A checkpoint directory and the step its name carries.
pub type Stepped = (u64, PathBuf);

/// The checkpoints around step `s` among `listing`: the one with the
/// largest step below `s`, and the one with the smallest step at or above
/// it.
pub fn around(listing: &[Stepped], s: u64) -> (Option<&Stepped>, Option<&Stepped>) {
    let before = listing
        .iter()
        .filter(|(x, _)| *x < s)
        .max_by_key(|(x, _)| *x);
    let after = listing
        .iter()
        .filter(|(x, _)| *x >= s)
        .min_by_key(|(x, _)| *x);
    (before, after)
}

/// The directories directly under `root` whose names carry a step
/// (`formats::step_of`), with it; an unreadable root lists nothing
/// (logged).
fn list_steps(root: &Path) -> Vec<(u64, PathBuf)> {
    let rd = match std::fs::read_dir(root) {
        Ok(rd) => rd,
        Err(e) => {
            warn!(root = %root.display(), error = %e, "listing the job's checkpoints for a signal's pins");
            return Vec::new();
        }
    };
    rd.flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                return None;
            }
            crate::formats::step_of(&name).map(|s| (s, e.path()))
        })
        .collect()
}

/// [`list_steps`] of a root in a remote store (HDFS, S3), from one
/// listing: the first path components that carry a step.
fn list_steps_remote(store: &dyn crate::storage::SourceStore, root: &Path) -> Vec<(u64, PathBuf)> {
    let listing = match store.list(root, &[]) {
        Ok(l) => l,
        Err(e) => {
            warn!(root = %root.display(), error = %e, "listing the job's checkpoints for a signal's pins");
            return Vec::new();
        }
    };
    let mut out: Vec<(u64, PathBuf)> = listing
        .files
        .iter()
        .filter_map(|f| f.info.path.split_once('/').map(|(d, _)| d))
        .filter(|d| !d.starts_with('.'))
        .filter_map(|d| crate::formats::step_of(d).map(|s| (s, root.join(d))))
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Sends the pins signal `sig` asks for (if its kind pins), replicating
/// a checkpoint it pins that was never replicated (skipped by `select`,
/// or cancelled); returns them in words.
pub(super) async fn pin_around(inner: &Arc<Inner>, sig: &Signal) -> Vec<String> {
    let cfg = &inner.cfg.pins;
    if !cfg.kinds.contains(&sig.kind) {
        return Vec::new();
    }
    let roots: Vec<(PathBuf, String)> = inner
        .cfg
        .roots
        .iter()
        .filter(|r| r.job == sig.job)
        .map(|r| (r.path.clone(), r.link.clone()))
        .collect();
    let mut links: Vec<String> = roots.iter().map(|(_, l)| l.clone()).collect();
    links.sort();
    links.dedup();
    if links.is_empty() {
        // A job set through the API with no root here: every link.
        links = inner.links.keys().cloned().collect();
    }
    let what = match sig.step {
        Some(s) => format!("{} at step {s} (signal {})", sig.kind, sig.id),
        None => format!("{} (signal {})", sig.kind, sig.id),
    };
    let until = ferry_catalog::now_ms()
        .saturating_add(i64::try_from(cfg.pin_for.as_millis()).unwrap_or(i64::MAX));
    let mut targets: Vec<(PinTarget, String)> = Vec::new();
    // Pins sent later, once the watcher finds their checkpoint.
    let mut later: Vec<String> = Vec::new();
    match sig.step.and_then(|s| u64::try_from(s).ok()) {
        None => targets.push((PinTarget::Newest, format!("{what}: the newest checkpoint"))),
        Some(s) => {
            let dirs: Vec<PathBuf> = roots.iter().map(|(p, _)| p.clone()).collect();
            let store = inner.store.clone();
            let listing = tokio::task::spawn_blocking(move || {
                dirs.iter()
                    .flat_map(|d| {
                        if crate::storage::router::is_url(d) {
                            list_steps_remote(&*store, d)
                        } else {
                            list_steps(d)
                        }
                    })
                    .collect::<Vec<_>>()
            })
            .await
            .unwrap_or_default();
            let (before, after) = around(&listing, s);
            if let Some((step, dir)) = before {
                targets.push((
                    PinTarget::Step(*step),
                    format!("{what}: the last checkpoint before it"),
                ));
                pick_if_skipped(inner, dir, until).await;
            }
            match after {
                Some((step, dir)) => {
                    targets.push((
                        PinTarget::Step(*step),
                        format!("{what}: the first checkpoint at or after it"),
                    ));
                    pick_if_skipped(inner, dir, until).await;
                }
                None => {
                    let reason = format!("{what}: the first checkpoint at or after it");
                    if inner.cfg.scan_interval.is_some() && !roots.is_empty() {
                        // The watcher replicates the first one that
                        // appears (whatever select says), and the pin of
                        // its step goes then (send_step_pins).
                        later.push(format!(
                            "the first step at or after {s} (when it is written)"
                        ));
                        let mut picks = crate::lock::lock(&inner.picks);
                        let mut waiting = crate::lock::lock(&inner.step_pins);
                        for (root, _) in &roots {
                            picks.push((root.clone(), Pick::AtOrAfter(s), until));
                            waiting.push((root.clone(), s, reason.clone(), until));
                        }
                    } else {
                        // No watcher here: the sink pins the first one
                        // published.
                        targets.push((PinTarget::AtOrAfter(s), reason));
                    }
                }
            }
        }
    }
    let for_ms = u64::try_from(cfg.pin_for.as_millis()).unwrap_or(u64::MAX);
    for name in &links {
        let Some(link) = inner.links.get(name) else {
            continue;
        };
        {
            let mut out = crate::lock::lock(&link.pins);
            for (target, reason) in &targets {
                out.push(PinRequest {
                    job: sig.job.clone(),
                    target: *target,
                    reason: reason.clone(),
                    for_ms,
                });
            }
        }
        link.wake.notify_one();
    }
    info!(
        job = sig.job,
        signal = sig.id,
        targets = ?targets.iter().map(|(t, _)| *t).collect::<Vec<_>>(),
        links = ?links,
        "signal: asking the sinks to pin the checkpoints around it"
    );
    let days = cfg.pin_for.as_secs_f64() / 86_400.0;
    targets
        .iter()
        .map(|(t, reason)| {
            let which = match t {
                PinTarget::Newest => "the newest replica".to_string(),
                PinTarget::Step(s) => format!("step {s}"),
                PinTarget::AtOrAfter(s) => format!("the first step at or after {s}"),
            };
            let why = reason.split_once(": ").map_or(reason.as_str(), |(_, w)| w);
            format!("{which} ({why}), for {days:.1} days")
        })
        .chain(
            later
                .into_iter()
                .map(|w| format!("{w}, for {days:.1} days")),
        )
        .collect()
}

/// The watcher of `root` picked checkpoint `dir` as the first at or after
/// step `from`: the pins waiting for it go to the sinks of the root's link
/// for its step, for what is left of their time.
pub(super) fn send_step_pins(inner: &Arc<Inner>, root: &super::RootConfig, dir: &str, from: u64) {
    let Some(step) = crate::formats::step_of(dir) else {
        return;
    };
    let now = ferry_catalog::now_ms();
    let mine: Vec<(String, i64)> = {
        let mut waiting = crate::lock::lock(&inner.step_pins);
        let mut out = Vec::new();
        waiting.retain(|(r, s, reason, until)| {
            if *until <= now {
                return false;
            }
            if *r == root.path && *s == from {
                out.push((reason.clone(), *until));
                return false;
            }
            true
        });
        out
    };
    let Some(link) = inner.links.get(&root.link) else {
        return;
    };
    {
        let mut out = crate::lock::lock(&link.pins);
        for (reason, until) in &mine {
            out.push(PinRequest {
                job: root.job.clone(),
                target: PinTarget::Step(step),
                reason: reason.clone(),
                for_ms: u64::try_from(until - now).unwrap_or(0),
            });
        }
    }
    if !mine.is_empty() {
        info!(
            job = root.job,
            step,
            dir,
            "signal: the first checkpoint at or after the signal's step is here: pinning it"
        );
        link.wake.notify_one();
    }
}

/// Asks the watcher of `dir`'s root to replicate checkpoint `dir` until
/// `until` (Unix ms) whatever `select` says, if it has no transfer that
/// may still publish (never queued: `select` skipped it; or cancelled).
async fn pick_if_skipped(inner: &Arc<Inner>, dir: &Path, until: i64) {
    // As transfers record it.
    let canonical = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let path = canonical.to_string_lossy();
    match inner.catalog.transfer_by_path(&path).await {
        Ok(Some(t)) if t.state != TransferState::Cancelled && t.state != TransferState::Failed => {}
        Ok(_) => {
            let (Some(root), Some(name)) = (dir.parent(), dir.file_name()) else {
                return;
            };
            if inner.cfg.scan_interval.is_none() {
                warn!(path = %dir.display(), "signal: a checkpoint to pin was never replicated, and the watcher is off: push it to have it pinned");
                return;
            }
            info!(path = %dir.display(), "signal: the watcher replicates a checkpoint to pin (select had skipped it) once it has committed");
            crate::lock::lock(&inner.picks).push((
                root.to_path_buf(),
                Pick::Dir(name.to_string_lossy().into_owned()),
                until,
            ));
        }
        Err(e) => {
            warn!(path = %dir.display(), error = %e, "signal: reading a checkpoint's transfers")
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn around_picks_the_last_before_and_the_first_at_or_after() {
        let l: Vec<(u64, PathBuf)> = [300, 100, 400, 200]
            .iter()
            .map(|s| (*s, PathBuf::from(format!("/ck/step_{s}"))))
            .collect();
        let steps = |s| {
            let (b, a) = around(&l, s);
            (b.map(|x| x.0), a.map(|x| x.0))
        };
        assert_eq!(steps(250), (Some(200), Some(300)));
        assert_eq!(steps(300), (Some(200), Some(300)));
        assert_eq!(steps(50), (None, Some(100)));
        assert_eq!(steps(401), (Some(400), None));
        assert_eq!(around(&[], 5), (None, None));
    }

    #[test]
    fn only_step_named_directories_are_listed() {
        let d = tempfile::tempdir().unwrap();
        for n in ["step_000100", "global_step200", "release", ".hidden_300"] {
            std::fs::create_dir(d.path().join(n)).unwrap();
        }
        std::fs::write(d.path().join("step_999"), b"a file").unwrap();
        let mut got: Vec<u64> = list_steps(d.path()).into_iter().map(|x| x.0).collect();
        got.sort_unstable();
        assert_eq!(got, vec![100, 200]);
        assert!(list_steps(&d.path().join("missing")).is_empty());
    }
}
