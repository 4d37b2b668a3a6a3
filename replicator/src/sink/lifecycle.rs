//! A replica's life after its publish: retention policies
//! ([`super::retention`], run after each publish and every
//! `retention_interval`), operators' pins, and removal.
//!
//! A removal, by a policy or an operator, goes in this order:
//!
//! 1. the catalog row becomes `removing` with the removal's record (why,
//!    the rule or note, bytes, forced): resolve no longer names it;
//! 2. under the publish lock of its local path, the version directory is
//!    moved aside in one step ([`crate::storage::SinkStore::withdraw`]) to
//!    `<root>/.ferry/retired/<row id>`: no published path names a part of
//!    it, whatever happens next;
//! 3. a background task deletes it there ([`crate::storage::SinkStore::retire`]) and the
//!    row becomes `removed`, counted in `ferry_replicas_removed_total`.
//!
//! A crash anywhere in between leaves the row `removing`; the sink
//! finishes the removal at its next start (and at each retention pass),
//! moving the directory aside first if it had not been (unless a newer
//! version was published at that path meanwhile).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferry_catalog::{now_ms, CatalogError, RemovalReason, Replica};
use ferry_proto::state::TransferState;
use tracing::{info, warn};

use super::retention::{self, Expired, Version};
use super::{blocking, Inner, Sink};

/// Why a pin or a removal was refused.
#[derive(Debug, thiserror::Error)]
pub enum LifecycleError {
    /// No sink-side row has this id.
    #[error("no replica {0}")]
    NotFound(i64),
    /// The row is not a published replica (receiving, failed, removed...).
    #[error("replica {id} is {state}; only a published replica can be {action}")]
    NotPublished {
        /// Row id.
        id: i64,
        /// Its state.
        state: TransferState,
        /// `removed` or `pinned`.
        action: &'static str,
    },
    /// A newer version replaced this one at its path (its files went
    /// then).
    #[error("replica {id} was replaced by replica {by} at {path}; its files went then")]
    Replaced {
        /// Row id.
        id: i64,
        /// The newer row.
        by: i64,
        /// The local path.
        path: String,
    },
    /// Pinned: removing it needs `force`.
    #[error("replica {id} is pinned ({reason}{until}); unpin it or remove it with force=true")]
    Pinned {
        /// Row id.
        id: i64,
        /// The pin's reason.
        reason: String,
        /// `, until <RFC 3339>` or empty.
        until: String,
    },
    /// A catalog error.
    #[error(transparent)]
    Catalog(#[from] CatalogError),
}

/// Where a removed version waits for its deletion.
fn retired_path(root: &Path, id: i64) -> PathBuf {
    root.join(".ferry").join("retired").join(id.to_string())
}

impl Sink {
    /// Pins published replica `id` until `until` (Unix ms; `None`: until
    /// unpinned) for `reason`: it never expires, and a removal by hand
    /// needs `force`. Returns the row as it is now.
    ///
    /// # Errors
    /// [`LifecycleError::NotFound`], [`LifecycleError::NotPublished`],
    /// [`LifecycleError::Replaced`] (a re-save replaced it), or a catalog
    /// error.
    pub async fn pin(
        &self,
        id: i64,
        until: Option<i64>,
        reason: &str,
    ) -> Result<Replica, LifecycleError> {
        let cat = &self.inner.catalog;
        let r = cat.replica(id).await?.ok_or(LifecycleError::NotFound(id))?;
        // A version a re-save replaced has no files left: a pin on it
        // would protect nothing.
        if let Some(by) = newer_version(&self.inner, &r).await? {
            return Err(LifecycleError::Replaced {
                id,
                by,
                path: r.local_path,
            });
        }
        if !cat.pin_replica(id, until, reason).await? {
            return Err(LifecycleError::NotPublished {
                id,
                state: r.state,
                action: "pinned",
            });
        }
        info!(replica = id, reason, until, "replica pinned");
        cat.replica(id).await?.ok_or(LifecycleError::NotFound(id))
    }

    /// Removes the pin of replica `id` (no error if it had none), then runs
    /// the retention policies. Returns the row as it is now.
    ///
    /// # Errors
    /// [`LifecycleError::NotFound`] or a catalog error.
    pub async fn unpin(&self, id: i64) -> Result<Replica, LifecycleError> {
        let cat = &self.inner.catalog;
        if cat.replica(id).await?.is_none() {
            return Err(LifecycleError::NotFound(id));
        }
        if cat.unpin_replica(id).await? {
            info!(replica = id, "replica unpinned");
            self.inner.retention_wake.notify_one();
        }
        cat.replica(id).await?.ok_or(LifecycleError::NotFound(id))
    }

    /// An operator removes published replica `id`: refused if it is pinned
    /// unless `force` (recorded with the removal), or if a newer version
    /// replaced it. It leaves the published namespace before this returns
    /// (the row is `removing`); its files are deleted in the background.
    ///
    /// # Errors
    /// [`LifecycleError`] naming why; nothing is removed then.
    pub async fn remove(
        &self,
        id: i64,
        force: bool,
        note: &str,
    ) -> Result<Replica, LifecycleError> {
        let inner = &self.inner;
        let r = inner
            .catalog
            .replica(id)
            .await?
            .ok_or(LifecycleError::NotFound(id))?;
        if r.state != TransferState::Published {
            return Err(LifecycleError::NotPublished {
                id,
                state: r.state,
                action: "removed",
            });
        }
        // A newer version at the same path (published, or removed since)
        // replaced this one on disk: nothing of it is left to remove.
        if let Some(by) = newer_version(inner, &r).await? {
            return Err(LifecycleError::Replaced {
                id,
                by,
                path: r.local_path,
            });
        }
        let pin = r
            .pin
            .as_ref()
            .filter(|p| p.until.is_none_or(|u| u > now_ms()));
        if let (Some(p), false) = (pin, force) {
            return Err(LifecycleError::Pinned {
                id,
                reason: p.reason.clone(),
                until: p
                    .until
                    .map_or(String::new(), |u| format!(", until {}", super::rfc3339(u))),
            });
        }
        let mut detail = note.to_string();
        if let Some(p) = pin {
            let sep = if note.is_empty() { "" } else { "; " };
            detail = format!("forced past the pin ({}){sep}{note}", p.reason);
        }
        if !remove_version(inner, &r, RemovalReason::Operator, &detail, force, false).await? {
            // Replaced by a re-save, or removed (by a policy, say),
            // meanwhile.
            if let Some(by) = newer_version(inner, &r).await? {
                return Err(LifecycleError::Replaced {
                    id,
                    by,
                    path: r.local_path,
                });
            }
            let now = inner.catalog.replica(id).await?;
            return Err(LifecycleError::NotPublished {
                id,
                state: now.map_or(TransferState::Removed, |r| r.state),
                action: "removed",
            });
        }
        inner
            .catalog
            .replica(id)
            .await?
            .ok_or(LifecycleError::NotFound(id))
    }

    /// Runs the retention policies once now (they also run after each
    /// publish and every `retention_interval`); returns the ids of the
    /// replicas they expired (with `dry_run`, that would expire).
    ///
    /// # Errors
    /// Catalog errors.
    pub async fn apply_retention(&self) -> Result<Vec<i64>, CatalogError> {
        retention_pass(&self.inner, false).await
    }
}

/// The background task of a sink: finishes removals a crash interrupted,
/// then runs the policies after each publish and every interval.
pub(super) async fn run(inner: Arc<Inner>) {
    finish_removals(&inner).await;
    let every = inner
        .cfg
        .retention_interval
        .max(std::time::Duration::from_millis(100));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = inner.shutdown.cancelled() => return,
            _ = tick.tick() => {}
            _ = inner.retention_wake.notified() => {}
        }
        finish_removals(&inner).await;
        if let Err(e) = retention_pass(&inner, false).await {
            warn!(error = %e, "retention pass failed; trying again at the next one");
        }
        pressure_pass(&inner).await;
    }
}

/// One pass of the policies over the current versions; with `wait`, the
/// files of what it removes are deleted before it returns.
async fn retention_pass(inner: &Arc<Inner>, wait: bool) -> Result<Vec<i64>, CatalogError> {
    let policies = &inner.cfg.retention;
    if policies.is_empty() {
        return Ok(Vec::new());
    }
    let now = now_ms();
    let rows = inner.catalog.current_replicas().await?;
    let versions = versions_of(&rows, now, |r| {
        policies
            .iter()
            .find(|p| p.matches(&r.job))
            .is_some_and(|p| p.max_bytes.is_some())
    })
    .await;
    let mut expired = Vec::new();
    for v in retention::evaluate(policies, &versions, now) {
        let Err(why) = v.outcome else { continue };
        let Some(r) = rows.iter().find(|r| r.id == v.id) else {
            continue;
        };
        let p = &policies[v.policy];
        let why = match why {
            Expired::NotKept => "kept by no rule".to_string(),
            Expired::MaxBytes(b) => format!("oldest while its job held {b} bytes"),
        };
        let detail = format!("{}; {why}", p.describe());
        expired.push(v.id);
        if p.dry_run {
            // Said once per replica, not at every pass.
            if !crate::lock::lock(&inner.dry_run_said).insert(v.id) {
                continue;
            }
            info!(
                replica = v.id,
                job = r.job,
                step = r.step,
                path = r.local_path,
                rule = detail,
                "dry run: the retention policy would remove this replica"
            );
            continue;
        }
        if let Err(e) = remove_version(inner, r, RemovalReason::Rule, &detail, false, wait).await {
            warn!(replica = v.id, error = %e, "could not remove an expired replica");
        }
    }
    Ok(expired)
}

/// The published `rows` as the policies see them at `now` (Unix ms); the
/// files of a row for which `count_files` is true are listed by identity
/// (hard links count once), the others count as one file of their size.
async fn versions_of(
    rows: &[Replica],
    now: i64,
    count_files: impl Fn(&Replica) -> bool,
) -> Vec<Version> {
    let mut versions = Vec::with_capacity(rows.len());
    for r in rows {
        let files = if count_files(r) {
            let dir = PathBuf::from(&r.local_path);
            blocking(move || Ok(file_identities(&dir)))
                .await
                .unwrap_or_default()
        } else {
            vec![((u64::MAX, r.id as u64), r.bytes_total.max(0) as u64)]
        };
        versions.push(Version {
            id: r.id,
            job: r.job.clone(),
            source_site: r.source_site.clone(),
            step: r.step.and_then(|s| u64::try_from(s).ok()),
            published_ms: r.published_at.unwrap_or(r.created_at),
            files,
            pinned: r
                .pin
                .as_ref()
                .is_some_and(|p| p.until.is_none_or(|u| u > now)),
        });
    }
    versions
}

/// Free bytes in the sink root's storage now (`None`: it cannot tell, or
/// the call failed, logged).
async fn free_now(inner: &Inner) -> Option<u64> {
    let (store, root) = (inner.store.clone(), inner.cfg.root.clone());
    match blocking(move || store.free_space(&root)).await {
        Ok(f) => f,
        Err(e) => {
            warn!(error = %e, "measuring the sink's free space");
            None
        }
    }
}

/// `[sink] min_free` and `target_free` in bytes now (percentages of the
/// storage's capacity now); `None` without them, or when they cannot be
/// worked out (logged).
async fn pressure_bytes(inner: &Inner) -> Option<(u64, u64)> {
    let p = inner.cfg.pressure?;
    let (store, root) = (inner.store.clone(), inner.cfg.root.clone());
    let capacity = blocking(move || store.capacity(&root))
        .await
        .unwrap_or_else(|e| {
            warn!(error = %e, "measuring the sink's capacity");
            None
        });
    match p.bytes(capacity, inner.cfg.reserve_bytes) {
        Ok(b) => Some(b),
        Err(e) => {
            warn!(error = %e, "space pressure is off");
            None
        }
    }
}

/// What [`relieve`] did.
pub(super) struct Relief {
    /// Free bytes at the end (`None`: unknown).
    pub free: Option<u64>,
    /// Replicas removed under pressure.
    pub removed: usize,
    /// When the goal was not reached: what the plan could free and what
    /// it kept back, in words.
    pub short: Option<String>,
}

/// After each retention pass: when free space is below `min_free`,
/// removes until it is at least `target_free` ([`relieve`]).
async fn pressure_pass(inner: &Arc<Inner>) {
    let Some((min, target)) = pressure_bytes(inner).await else {
        return;
    };
    let Some(free) = free_now(inner).await else {
        return;
    };
    if free >= min {
        return;
    }
    warn!(
        free,
        min_free = min,
        target_free = target,
        "space pressure: free space is below min_free; removing replicas until target_free is free"
    );
    let r = relieve(inner, target, false).await;
    match r.short {
        None => info!(
            free = r.free,
            removed = r.removed,
            "space pressure relieved"
        ),
        Some(why) => warn!(
            free = r.free,
            removed = r.removed,
            target_free = target,
            "space pressure: target_free not reached: {why}"
        ),
    }
}

/// Makes room for an incoming transfer that needs `needed` bytes more
/// than `avail` free (keeping `[sink] reserve`), when `[sink] min_free`
/// is set: removes under pressure only if that frees enough. `None` when
/// it now fits; else why not, for the refusal.
pub(super) async fn make_room(inner: &Arc<Inner>, needed: u64) -> Option<String> {
    pressure_bytes(inner).await?;
    let goal = needed.saturating_add(inner.cfg.reserve_bytes);
    let r = relieve(inner, goal, true).await;
    match (r.free, r.short) {
        (Some(f), _) if f >= goal => {
            info!(
                removed = r.removed,
                free = f,
                needed,
                "space pressure: made room for an incoming transfer"
            );
            None
        }
        (_, Some(why)) => Some(why),
        (free, None) => Some(format!("{} bytes free after removals", free.unwrap_or(0))),
    }
}

/// Removes, in order, until `goal` bytes are free: the staging areas of
/// failed and cancelled transfers, the replicas a policy expires, then
/// the replicas [`super::pressure::plan`] picks, measuring free space
/// again after each. With `all_or_nothing`, the plan's replicas go only
/// if together they free enough.
async fn relieve(inner: &Arc<Inner>, goal: u64, all_or_nothing: bool) -> Relief {
    let _one = inner.relief.lock().await;
    let mut relief = Relief {
        free: free_now(inner).await,
        removed: 0,
        short: None,
    };
    let reached = |r: &Relief| r.free.is_none_or(|f| f >= goal);
    if reached(&relief) {
        return relief;
    }
    // 1. What failed or cancelled transfers left staged (kept when a
    // publish was under way: it may hold a published version).
    for state in [TransferState::Failed, TransferState::Cancelled] {
        let rows = match inner.catalog.replicas_in(Some(state), i64::MAX, 0).await {
            Ok(rows) => rows,
            Err(e) => {
                warn!(error = %e, "space pressure: listing {state} transfers");
                continue;
            }
        };
        for r in rows {
            let staging = PathBuf::from(&r.staging_path);
            if r.staging_path.is_empty() || crate::lock::lock(&inner.live).contains_key(&r.id) {
                continue;
            }
            let store = inner.store.clone();
            let s2 = staging.clone();
            // Off the async threads: the checks touch the file system too.
            let discarded = blocking(move || {
                if store.publish_under_way(&s2) || std::fs::symlink_metadata(&s2).is_err() {
                    return Ok(false);
                }
                store.discard(&s2).map(|()| true)
            })
            .await;
            match discarded {
                Ok(false) => {}
                Ok(true) => {
                    info!(transfer = r.id, staging = %staging.display(), "space pressure: removed the staging area of a {state} transfer")
                }
                Err(e) => {
                    warn!(transfer = r.id, error = %e, "space pressure: removing a staging area")
                }
            }
        }
    }
    relief.free = free_now(inner).await;
    if reached(&relief) {
        return relief;
    }
    // 2. What a policy expires anyway.
    if let Err(e) = retention_pass(inner, true).await {
        warn!(error = %e, "space pressure: retention pass failed");
    }
    relief.free = free_now(inner).await;
    if reached(&relief) {
        return relief;
    }
    // 3. By class at publish, oldest first.
    let rows = match inner.catalog.current_replicas().await {
        Ok(rows) => rows,
        Err(e) => {
            relief.short = Some(format!("the catalog could not list replicas: {e}"));
            return relief;
        }
    };
    let now = now_ms();
    let versions = versions_of(&rows, now, |_| true).await;
    let classes: Vec<_> = rows.iter().map(|r| r.class).collect();
    let need = goal.saturating_sub(relief.free.unwrap_or(0));
    let plan = super::pressure::plan(&inner.cfg.retention, &versions, &classes, now, need);
    if plan.freed < need {
        relief.short = Some(format!(
            "removing every replica that may go under space pressure ({}) would free {} of the {need} bytes needed; {}",
            plan.remove.len(),
            plan.freed,
            plan.protected_text()
        ));
        if all_or_nothing {
            return relief;
        }
    }
    for id in plan.remove {
        let Some(r) = rows.iter().find(|r| r.id == id) else {
            continue;
        };
        let detail = format!(
            "space pressure: {} bytes free, {goal} wanted; class {} at publish, oldest first",
            relief.free.unwrap_or(0),
            r.class.map_or("scheduled", |c| c.as_str())
        );
        match remove_version(inner, r, RemovalReason::Pressure, &detail, false, true).await {
            Ok(true) => relief.removed += 1,
            Ok(false) => {}
            Err(e) => warn!(replica = id, error = %e, "space pressure: could not remove a replica"),
        }
        relief.free = free_now(inner).await;
        if reached(&relief) {
            relief.short = None;
            break;
        }
    }
    relief
}

/// The newest row that replaced `r` at its path: published, or removed
/// since (its files went with the re-save).
async fn newer_version(inner: &Inner, r: &Replica) -> Result<Option<i64>, CatalogError> {
    Ok(inner
        .catalog
        .replicas_for_source(&r.source_path)
        .await?
        .into_iter()
        .find(|n| {
            n.id > r.id
                && n.local_path == r.local_path
                && matches!(
                    n.state,
                    TransferState::Published | TransferState::Removing | TransferState::Removed
                )
        })
        .map(|n| n.id))
}

/// Steps 1 and 2 of a removal, then step 3 in the background. False when
/// the row was no longer published, or a newer version replaced it at its
/// path (a re-save published while the removal waited for the path's
/// publish lock).
async fn remove_version(
    inner: &Arc<Inner>,
    r: &Replica,
    reason: RemovalReason,
    detail: &str,
    forced: bool,
    wait: bool,
) -> Result<bool, CatalogError> {
    let local = PathBuf::from(&r.local_path);
    let lock = inner.publish_lock(&local);
    let guard = lock.lock_owned().await;
    // Under the lock no publish moves into the path: what is there now is
    // this version unless a newer one was published before we got it.
    if newer_version(inner, r).await?.is_some()
        || replaced(inner, r).await
        || !inner
            .catalog
            .begin_replica_removal(r.id, reason, detail, forced, r.bytes_total)
            .await?
    {
        return Ok(false);
    }
    inner.changed.send_modify(|v| *v += 1);
    info!(
        replica = r.id,
        job = r.job,
        step = r.step,
        path = r.local_path,
        %reason,
        detail,
        forced,
        bytes = r.bytes_total,
        "removing a replica: out of the published namespace, its files go next"
    );
    let aside = retired_path(&inner.cfg.root, r.id);
    let (store, l2, a2) = (inner.store.clone(), local.clone(), aside.clone());
    let moved = blocking(move || store.withdraw(&l2, &a2)).await;
    drop(guard);
    if let Err(e) = moved {
        // The row stays `removing`: finished at the next pass or start.
        warn!(replica = r.id, error = %e, "could not move a removed replica aside; trying again later");
        return Ok(true);
    }
    if wait {
        retire(inner.clone(), r.clone(), aside).await;
    } else {
        spawn_retire(inner, r.clone(), aside);
    }
    Ok(true)
}

/// Step 3 in the background: [`retire`].
fn spawn_retire(inner: &Arc<Inner>, r: Replica, aside: PathBuf) {
    let inner2 = inner.clone();
    inner.tasks.spawn(retire(inner2, r, aside));
}

/// Step 3: deletes the version moved aside and records the removal done
/// (nothing if another task is deleting it already).
async fn retire(inner: Arc<Inner>, r: Replica, aside: PathBuf) {
    if !crate::lock::lock(&inner.retiring).insert(r.id) {
        return;
    }
    {
        let store = inner.store.clone();
        let res = blocking(move || store.retire(&aside)).await;
        let done = match res {
            Ok(()) => inner.catalog.finish_replica_removal(r.id).await,
            Err(e) => {
                warn!(replica = r.id, error = %e, "deleting a removed replica's files; trying again later");
                Ok(())
            }
        };
        crate::lock::lock(&inner.retiring).remove(&r.id);
        match done {
            Ok(()) => {
                let reason = r
                    .removal
                    .as_ref()
                    .map(|m| m.reason)
                    .unwrap_or(RemovalReason::Rule);
                let row = inner.catalog.replica(r.id).await.ok().flatten();
                if row
                    .as_ref()
                    .is_some_and(|x| x.state == TransferState::Removed)
                {
                    let reason = row
                        .as_ref()
                        .and_then(|x| x.removal.as_ref())
                        .map_or(reason, |m| m.reason);
                    inner.metrics.removed(reason, r.bytes_total.max(0) as u64);
                    info!(replica = r.id, path = r.local_path, %reason, bytes = r.bytes_total, "replica removed");
                }
            }
            Err(e) => warn!(replica = r.id, error = %e, "could not record a finished removal"),
        }
        inner.changed.send_modify(|v| *v += 1);
    }
}

/// Finishes removals a crash (or an I/O error) left `removing`.
async fn finish_removals(inner: &Arc<Inner>) {
    let rows = match inner.catalog.replicas_removing().await {
        Ok(r) => r,
        Err(e) => {
            warn!(error = %e, "listing unfinished removals");
            return;
        }
    };
    for r in rows {
        if crate::lock::lock(&inner.retiring).contains(&r.id) {
            continue;
        }
        let aside = retired_path(&inner.cfg.root, r.id);
        let local = PathBuf::from(&r.local_path);
        let lock = inner.publish_lock(&local);
        let guard = lock.lock_owned().await;
        if std::fs::symlink_metadata(&aside).is_err() && !replaced(inner, &r).await {
            let (store, l2, a2) = (inner.store.clone(), local.clone(), aside.clone());
            if let Err(e) = blocking(move || store.withdraw(&l2, &a2)).await {
                warn!(replica = r.id, error = %e, "could not move a removed replica aside; trying again later");
                continue;
            }
        }
        drop(guard);
        info!(
            replica = r.id,
            path = r.local_path,
            "finishing an interrupted removal"
        );
        spawn_retire(inner, r, aside);
    }
}

/// Whether a newer version holds (or is being moved into) `r`'s path, so
/// what is there is not `r`'s to move.
async fn replaced(inner: &Inner, r: &Replica) -> bool {
    let Ok(rows) = inner.catalog.replicas_for_source(&r.source_path).await else {
        return true;
    };
    rows.iter().any(|n| {
        n.id > r.id
            && n.local_path == r.local_path
            && (n.state == TransferState::Published
                || (n.state == TransferState::Receiving
                    && inner.store.publish_under_way(Path::new(&n.staging_path))))
    })
}

/// Each regular file under `dir` as ((device, inode), bytes); symlinks and
/// unreadable entries are skipped.
fn file_identities(dir: &Path) -> Vec<((u64, u64), u64)> {
    use std::os::unix::fs::MetadataExt;
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let Ok(md) = e.path().symlink_metadata() else {
                continue;
            };
            if md.is_dir() {
                stack.push(e.path());
            } else if md.is_file() {
                out.push(((md.dev(), md.ino()), md.len()));
            }
        }
    }
    out
}
