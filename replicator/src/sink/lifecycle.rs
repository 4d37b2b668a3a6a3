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
        if !remove_version(inner, &r, RemovalReason::Operator, &detail, force).await? {
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
        retention_pass(&self.inner).await
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
        if let Err(e) = retention_pass(&inner).await {
            warn!(error = %e, "retention pass failed; trying again at the next one");
        }
    }
}

/// One pass of the policies over the current versions.
async fn retention_pass(inner: &Arc<Inner>) -> Result<Vec<i64>, CatalogError> {
    let policies = &inner.cfg.retention;
    if policies.is_empty() {
        return Ok(Vec::new());
    }
    let now = now_ms();
    let rows = inner.catalog.current_replicas().await?;
    let mut versions = Vec::with_capacity(rows.len());
    for r in &rows {
        let counts_files = policies
            .iter()
            .find(|p| p.matches(&r.job))
            .is_some_and(|p| p.max_bytes.is_some());
        let files = if counts_files {
            // Each file once, by its identity: hard links count once.
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
        if let Err(e) = remove_version(inner, r, RemovalReason::Rule, &detail, false).await {
            warn!(replica = v.id, error = %e, "could not remove an expired replica");
        }
    }
    Ok(expired)
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
    spawn_retire(inner, r.clone(), aside);
    Ok(true)
}

/// Step 3: deletes the version moved aside and records the removal done.
fn spawn_retire(inner: &Arc<Inner>, r: Replica, aside: PathBuf) {
    if !crate::lock::lock(&inner.retiring).insert(r.id) {
        return;
    }
    let inner2 = inner.clone();
    inner.tasks.spawn(async move {
        let inner = inner2;
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
                if row.as_ref().is_some_and(|x| x.state == TransferState::Removed) {
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
    });
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
