//! Pins around an anomaly signal: on a signal of a kind that pins
//! (`[source] pin_on`), the source picks from its own listing of the job's
//! checkpoints the last one before the signal's step (the last good one)
//! and the first at or after it, replicates them if its `select` rule
//! skipped them and they still exist, and asks every sink of the job's
//! links to pin them for `pin_for` (wire protocol version 6,
//! [`Control::Pin`](ferry_proto::wire::Control::Pin)). When no checkpoint
//! at or after the step exists yet, the sink pins the first one published
//! later; a signal without a step pins the newest replica.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ferry_catalog::Signal;
use ferry_proto::state::TransferState;
use ferry_proto::wire::{PinRequest, PinTarget};
use tracing::{info, warn};

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

/// Sends the pins signal `sig` asks for (if its kind pins), replicating
/// a checkpoint it pins that was never replicated (skipped by `select`,
/// or cancelled).
pub(super) async fn pin_around(inner: &Arc<Inner>, sig: &Signal) {
    let cfg = &inner.cfg.pins;
    if !cfg.kinds.contains(&sig.kind) {
        return;
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
    let mut targets: Vec<(PinTarget, String)> = Vec::new();
    match sig.step.and_then(|s| u64::try_from(s).ok()) {
        None => targets.push((PinTarget::Newest, format!("{what}: the newest checkpoint"))),
        Some(s) => {
            let dirs: Vec<PathBuf> = roots.iter().map(|(p, _)| p.clone()).collect();
            let listing = tokio::task::spawn_blocking(move || {
                dirs.iter().flat_map(|d| list_steps(d)).collect::<Vec<_>>()
            })
            .await
            .unwrap_or_default();
            let (before, after) = around(&listing, s);
            if let Some((step, dir)) = before {
                targets.push((
                    PinTarget::Step(*step),
                    format!("{what}: the last checkpoint before it"),
                ));
                replicate_if_skipped(inner, dir).await;
            }
            match after {
                Some((step, dir)) => {
                    targets.push((
                        PinTarget::Step(*step),
                        format!("{what}: the first checkpoint at or after it"),
                    ));
                    replicate_if_skipped(inner, dir).await;
                }
                None => targets.push((
                    PinTarget::AtOrAfter(s),
                    format!("{what}: the first checkpoint at or after it (when it comes)"),
                )),
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
}

/// Queues a replication of checkpoint `dir` if it has none that may
/// still publish (never queued: `select` skipped it; or cancelled).
async fn replicate_if_skipped(inner: &Arc<Inner>, dir: &Path) {
    // As transfers record it.
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let dir = dir.as_path();
    let path = dir.to_string_lossy();
    match inner.catalog.transfer_by_path(&path).await {
        Ok(Some(t)) if t.state != TransferState::Cancelled && t.state != TransferState::Failed => {}
        Ok(_) => match super::submit(inner, dir, None, scheduler::Class::Scheduled).await {
            Ok(t) => {
                info!(transfer = %t.id, path = %dir.display(), "signal: replicating a checkpoint to pin (select had skipped it)")
            }
            Err(e) => {
                warn!(path = %dir.display(), error = %e, "signal: could not replicate a checkpoint to pin")
            }
        },
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
