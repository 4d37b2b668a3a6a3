//! A replica's life after its publish: retention policies
//! ([`super::retention`], run after each publish and every
//! `retention_interval`), operators' pins, reader leases on versions,
//! the deletion of versions a re-save replaced (once no lease holds
//! them), and removal.
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

use std::time::Duration;

use ferry_catalog::{now_ms, CatalogError, LeaseProblem, RemovalReason, Replica};
use ferry_proto::state::TransferState;
use tracing::{info, warn};

use super::retention::{self, Expired, Version};
use super::{blocking, Inner, LeaseGrant, Resolution, Sink};

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
    /// A newer version replaced this one at its path: its files stay only
    /// while a reader lease holds them.
    #[error("replica {id} was replaced by replica {by} at {path}; a replaced version stays only while a reader lease holds it, and goes when the lease ends (force ends its leases)")]
    Replaced {
        /// Row id.
        id: i64,
        /// The newer row.
        by: i64,
        /// The local path.
        path: String,
    },
    /// Pinned: removing it needs `force`.
    #[error("replica {id} is pinned ({reason}{until}); unpin it, or remove it with --force (force=true in the API)")]
    Pinned {
        /// Row id.
        id: i64,
        /// The pin's reason.
        reason: String,
        /// `, until <RFC 3339>` or empty.
        until: String,
    },
    /// A reader lease holds it: removing it needs `force`.
    #[error(
        "replica {id} is leased by {holders} until {until}; wait, or remove it with force=true"
    )]
    Leased {
        /// Row id.
        id: i64,
        /// The holders' token names, comma-separated.
        holders: String,
        /// The latest expiry, RFC 3339.
        until: String,
    },
    /// No live lease has this id.
    #[error("{0}")]
    Lease(String),
    /// The replica lives under another sink agent's root (a pool whose
    /// agents do not share storage).
    #[error("replica {id} is at {path}, outside this agent's sink root {root}; remove it through the sink agent that holds it")]
    Elsewhere {
        /// Row id.
        id: i64,
        /// Its local path.
        path: String,
        /// This agent's sink root.
        root: String,
    },
    /// The lease is not known (never granted here, or forgotten a day
    /// after it ended).
    #[error("no lease {0} (a lease is forgotten a day after it ends)")]
    LeaseUnknown(String),
    /// The lease expired or was released: it holds nothing any more.
    #[error("{0}")]
    LeaseEnded(String),
    /// The caller is neither the lease's holder nor an operator.
    #[error("lease {id} is held by {holder}; only its holder or an operator may {action} it")]
    NotHolder {
        /// The lease id.
        id: String,
        /// Its holder.
        holder: String,
        /// `renew` or `release`.
        action: &'static str,
    },
    /// A policy set through the API is not valid.
    #[error("{0}")]
    Invalid(String),
    /// This sink's storage publishes in place (HDFS without `[sink.hdfs]
    /// versions`): no version a lease could hold.
    #[error("this sink's storage publishes replicas in place, without version directories (HDFS without [sink.hdfs] versions = true); leases are not available on it")]
    NotVersioned,
    /// A catalog error.
    #[error(transparent)]
    Catalog(#[from] CatalogError),
}

impl LifecycleError {
    /// A copy of a [`LifecycleError::Leased`] (other variants become a
    /// generic message; only called on that one).
    fn clone_leased(&self) -> LifecycleError {
        match self {
            LifecycleError::Leased { id, holders, until } => LifecycleError::Leased {
                id: *id,
                holders: holders.clone(),
                until: until.clone(),
            },
            other => LifecycleError::Lease(other.to_string()),
        }
    }
}

/// A policy's verdict on replica `r` in words: (kept, why, until).
fn describe_verdict(
    p: &retention::RetentionPolicy,
    r: &Replica,
    outcome: &Result<retention::Kept, Expired>,
    now: i64,
) -> (bool, String, Option<i64>) {
    use retention::Kept;
    match outcome {
        Ok(Kept::Pinned) => {
            let pin = r.pin.as_ref();
            (
                true,
                format!("pinned: {}", pin.map_or("", |p| p.reason.as_str())),
                pin.and_then(|p| p.until),
            )
        }
        Ok(Kept::Leased) => (
            true,
            "held by a reader lease (no rule keeps it: it goes when the lease ends)".into(),
            r.leased_until.filter(|u| *u > now),
        ),
        Ok(Kept::MinAge) => (
            true,
            format!(
                "younger than min_age {}",
                p.min_age
                    .map_or(String::new(), |d| humantime::format_duration(d).to_string())
            ),
            p.min_age.map(|d| {
                r.published_at
                    .unwrap_or(r.created_at)
                    .saturating_add(d.as_millis() as i64)
            }),
        ),
        Ok(Kept::KeepEvery) => (
            true,
            format!(
                "its step is a multiple of keep_every {}",
                p.keep_every.unwrap_or(0)
            ),
            None,
        ),
        Ok(Kept::KeepLast) => (
            true,
            match p.keep_last {
                Some(n) => {
                    format!("among the newest {n} (keep_last): goes once {n} newer are published")
                }
                None => "keep_last unset: every version is kept by it".into(),
            },
            None,
        ),
        Err(e) => {
            let why = match e {
                Expired::NotKept => "kept by no rule".to_string(),
                Expired::MaxBytes(b) => format!("over max_bytes ({b} bytes held)"),
            };
            let when = if p.dry_run {
                "dry run: would be removed"
            } else {
                "removed at the next pass"
            };
            (false, format!("{why}: {when}"), None)
        }
    }
}

/// The error for a lease that cannot be renewed or released.
fn lease_problem(id: &str, p: LeaseProblem) -> LifecycleError {
    match p {
        LeaseProblem::Unknown => LifecycleError::LeaseUnknown(id.to_string()),
        LeaseProblem::Expired(at) => LifecycleError::LeaseEnded(format!(
            "lease {id} expired at {}; its version may be gone: resolve again for a new lease",
            super::rfc3339(at)
        )),
        LeaseProblem::Released(at) => {
            LifecycleError::LeaseEnded(format!("lease {id} was released at {}", super::rfc3339(at)))
        }
        LeaseProblem::VersionGone(replica) => LifecycleError::LeaseEnded(format!(
            "lease {id} holds nothing: its version (replica {replica}) was removed; resolve again"
        )),
    }
}

/// Whether a newer version replaced row `id` at its path, by the catalog.
async fn replaced_now(inner: &Inner, id: i64) -> Result<bool, CatalogError> {
    match inner.catalog.replica(id).await? {
        Some(r) => Ok(newer_version(inner, &r).await?.is_some()),
        None => Ok(true),
    }
}

/// [`LifecycleError::Leased`] if a live reader lease holds `r` now.
async fn leased_error(inner: &Inner, r: &Replica) -> Result<Option<LifecycleError>, CatalogError> {
    let now = now_ms();
    let Some(fresh) = inner.catalog.replica(r.id).await? else {
        return Ok(None);
    };
    if !fresh.leased_at(now) {
        return Ok(None);
    }
    let mut holders: Vec<String> = inner
        .catalog
        .live_leases(now)
        .await?
        .into_iter()
        .filter(|l| l.replica == r.id)
        .map(|l| l.holder)
        .collect();
    holders.sort();
    holders.dedup();
    Ok(Some(LifecycleError::Leased {
        id: r.id,
        holders: if holders.is_empty() {
            "a reader".into()
        } else {
            holders.join(", ")
        },
        until: super::rfc3339(fresh.leased_until.unwrap_or(now)),
    }))
}

/// Whether replica `r` lives under this agent's sink root. Agents of a
/// pool share the catalog, not necessarily the storage: each applies the
/// policies, space pressure and removals to the replicas it can reach
/// (all of them when they share one root).
fn mine(inner: &Inner, r: &Replica) -> bool {
    Path::new(&r.local_path).starts_with(&inner.cfg.root)
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
        if !mine(inner, &r) {
            return Err(LifecycleError::Elsewhere {
                id,
                path: r.local_path,
                root: inner.cfg.root.display().to_string(),
            });
        }
        // A newer version at the same path (published, or removed since)
        // replaced this one: its files stay only while a lease holds them.
        // With force, its leases end and it goes at the next sweep.
        if let Some(by) = newer_version(inner, &r).await? {
            if force && r.leased_at(now_ms()) {
                let n = inner.catalog.end_leases_of(id).await?;
                info!(replica = id, leases = n, note, "the leases of a replaced version ended by hand (force): it goes at the next sweep");
                inner
                    .sweep_wanted
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                inner.retention_wake.notify_one();
                inner.changed.send_modify(|v| *v += 1);
                return inner
                    .catalog
                    .replica(id)
                    .await?
                    .ok_or(LifecycleError::NotFound(id));
            }
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
        let leased = leased_error(inner, &r).await?;
        if let (Some(e), false) = (&leased, force) {
            return Err(e.clone_leased());
        }
        let mut detail = note.to_string();
        if let Some(p) = pin {
            let sep = if note.is_empty() { "" } else { "; " };
            detail = format!("forced past the pin ({}){sep}{detail}", p.reason);
        }
        if let Some(LifecycleError::Leased { holders, .. }) = &leased {
            let sep = if detail.is_empty() { "" } else { "; " };
            detail = format!("forced past the lease of {holders}{sep}{detail}");
        }
        if !remove_version(inner, &r, RemovalReason::Operator, &detail, force, false).await? {
            // A lease granted meanwhile.
            if let (Some(e), false) = (leased_error(inner, &r).await?, force) {
                return Err(e);
            }
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

    /// Resolves `path` as [`Sink::resolve`] (as [`Sink::resolve_full`]
    /// with `full`) and, when it is local, grants
    /// `holder` a lease of `duration` on the version it names: the answer's
    /// `local_path` (POSIX) or `url` (S3: the version's own prefix, whose
    /// `.ferry-commit` lists its files; HDFS with versions: its
    /// directory) then names that version, which
    /// stays (whatever a re-save publishes, whatever a policy says) until
    /// the lease expires or is released. Other answers carry no lease.
    ///
    /// # Errors
    /// [`LifecycleError::NotVersioned`] on storage without versions
    /// (HDFS without `[sink.hdfs] versions`); catalog errors.
    pub async fn resolve_with_lease(
        &self,
        path: &str,
        full: bool,
        duration: Duration,
        holder: &str,
    ) -> Result<Resolution, LifecycleError> {
        let inner = &self.inner;
        if !inner.store.versioned() {
            return Err(LifecycleError::NotVersioned);
        }
        let ms = i64::try_from(duration.as_millis()).unwrap_or(i64::MAX);
        // A re-save or a removal between the answer and the grant makes
        // the grant fail (or find no directory): ask again.
        for _ in 0..5 {
            let (res, row) = self.resolve_row(path, full).await?;
            let (
                Resolution::Local {
                    manifest_root,
                    published_at,
                    profile,
                    ..
                },
                Some((id, suffix)),
            ) = (&res, row)
            else {
                return Ok(res);
            };
            let Some(row_path) = inner
                .catalog
                .replica(id)
                .await?
                .map(|r| PathBuf::from(r.local_path))
            else {
                continue;
            };
            if !row_path.starts_with(&inner.cfg.root) {
                return Err(LifecycleError::Elsewhere {
                    id,
                    path: row_path.display().to_string(),
                    root: inner.cfg.root.display().to_string(),
                });
            }
            let Some(lease) = inner.catalog.grant_lease(id, holder, ms).await? else {
                continue;
            };
            let version = super::version_dir(&inner.cfg.root, id);
            let local = if suffix.as_os_str().is_empty() {
                version.clone()
            } else {
                version.join(&suffix)
            };
            let Some((local_path, url)) = self.twin_there(&local).await else {
                let _ = inner.catalog.release_lease(&lease.id).await?;
                let (store, v2) = (inner.store.clone(), version.clone());
                let version_there = blocking(move || store.exists(&v2)).await.unwrap_or(false);
                if !version_there && !replaced_now(inner, id).await? {
                    return Err(LifecycleError::Lease(format!(
                        "replica {id} has no version directory ({}); it was published before \
                         version directories and could not be moved into one (see the log)",
                        self.twin(&version)
                            .1
                            .unwrap_or_else(|| version.display().to_string())
                    )));
                }
                continue;
            };
            info!(replica = id, lease = lease.id, holder, expires_at = %super::rfc3339(lease.expires_at), "reader lease granted");
            inner.changed.send_modify(|v| *v += 1);
            return Ok(Resolution::Local {
                local_path,
                url,
                manifest_root: manifest_root.clone(),
                published_at: published_at.clone(),
                profile: *profile,
                replica: id,
                hot: None,
                lease: Some(LeaseGrant::of(&lease)),
            });
        }
        Err(LifecycleError::Lease(
            "the replica changed five times while a lease was being granted; ask again".into(),
        ))
    }

    /// Extends lease `id` by its duration from now. `caller` is the API
    /// token's name; only the holder or an `operator` may.
    ///
    /// # Errors
    /// [`LifecycleError`] naming why (unknown, ended, not the holder).
    pub async fn renew_lease(
        &self,
        id: &str,
        caller: &str,
        operator: bool,
    ) -> Result<LeaseGrant, LifecycleError> {
        self.lease_holder_check(id, caller, operator, "renew")
            .await?;
        match self.inner.catalog.renew_lease(id).await? {
            Ok(l) => Ok(LeaseGrant::of(&l)),
            Err(p) => Err(lease_problem(id, p)),
        }
    }

    /// Releases lease `id` now (only its holder or an `operator`); the
    /// version it held goes if nothing else keeps it.
    ///
    /// # Errors
    /// [`LifecycleError`] naming why (unknown, ended, not the holder).
    pub async fn release_lease(
        &self,
        id: &str,
        caller: &str,
        operator: bool,
    ) -> Result<LeaseGrant, LifecycleError> {
        self.lease_holder_check(id, caller, operator, "release")
            .await?;
        match self.inner.catalog.release_lease(id).await? {
            Ok(l) => {
                info!(
                    replica = l.replica,
                    lease = id,
                    by = caller,
                    "reader lease released"
                );
                self.inner.retention_wake.notify_one();
                self.inner.changed.send_modify(|v| *v += 1);
                Ok(LeaseGrant::of(&l))
            }
            Err(p) => Err(lease_problem(id, p)),
        }
    }

    /// The live reader leases, oldest first.
    ///
    /// # Errors
    /// Catalog errors.
    pub async fn leases(&self) -> Result<Vec<LeaseGrant>, CatalogError> {
        Ok(self
            .inner
            .catalog
            .live_leases(now_ms())
            .await?
            .iter()
            .map(LeaseGrant::of)
            .collect())
    }

    async fn lease_holder_check(
        &self,
        id: &str,
        caller: &str,
        operator: bool,
        action: &'static str,
    ) -> Result<(), LifecycleError> {
        let Some(l) = self.inner.catalog.lease(id).await? else {
            return Err(LifecycleError::LeaseUnknown(id.chars().take(64).collect()));
        };
        if l.holder != caller && !operator {
            return Err(LifecycleError::NotHolder {
                id: l.id,
                holder: l.holder,
                action,
            });
        }
        Ok(())
    }

    /// The retention policies in force and their verdict on each current
    /// version of this agent's root, now.
    ///
    /// # Errors
    /// Catalog errors.
    pub async fn retention(&self) -> Result<RetentionView, CatalogError> {
        let inner = &self.inner;
        refresh_policies(inner).await;
        let (list, set_by) = {
            let p = crate::lock::lock(&inner.policies);
            (p.list.clone(), p.set_by.clone())
        };
        let now = now_ms();
        let mut rows = inner.catalog.current_replicas().await?;
        rows.retain(|r| mine(inner, r));
        let versions = versions_of(&rows, now, inner.store.hard_links(), |r| {
            list.iter()
                .find(|p| p.matches(&r.job))
                .is_some_and(|p| p.max_bytes.is_some())
        })
        .await;
        let verdicts: std::collections::HashMap<i64, retention::Verdict> =
            retention::evaluate(&list, &versions, now)
                .into_iter()
                .map(|v| (v.id, v))
                .collect();
        let mut jobs: Vec<JobRetention> = Vec::new();
        for r in &rows {
            let verdict = verdicts.get(&r.id);
            let (kept, why, until) = match verdict {
                None => (true, "no policy matches its job: kept".to_string(), None),
                Some(v) => describe_verdict(&list[v.policy], r, &v.outcome, now),
            };
            let vv = VersionVerdict {
                replica: r.id,
                step: r.step,
                local_path: r.local_path.clone(),
                published_at: r.published_at,
                bytes: r.bytes_total,
                kept,
                why,
                until,
            };
            match jobs
                .iter_mut()
                .find(|j| j.job == r.job && j.source_site == r.source_site)
            {
                Some(j) => j.versions.push(vv),
                None => jobs.push(JobRetention {
                    job: r.job.clone(),
                    source_site: r.source_site.clone(),
                    policy: verdict.map(|v| v.policy),
                    versions: vec![vv],
                }),
            }
        }
        for j in &mut jobs {
            j.versions.sort_by_key(|v| {
                std::cmp::Reverse((v.step.unwrap_or(-1), v.published_at, v.replica))
            });
        }
        jobs.sort_by(|a, b| (&a.job, &a.source_site).cmp(&(&b.job, &b.source_site)));
        let pending_pins = inner
            .catalog
            .pending_pin_requests(now)
            .await?
            .into_iter()
            .map(|p| PendingPin {
                target: match p.target {
                    ferry_proto::wire::PinTarget::Newest => "newest".into(),
                    ferry_proto::wire::PinTarget::Step(s) => format!("step {s}"),
                    ferry_proto::wire::PinTarget::AtOrAfter(s) => {
                        format!("first at or after step {s}")
                    }
                },
                source_site: p.source_site,
                job: p.job,
                reason: p.reason,
                until: p.until,
            })
            .collect();
        Ok(RetentionView {
            policies: list.iter().map(retention::PolicySpec::of).collect(),
            set_by,
            jobs,
            pending_pins,
        })
    }

    /// Replaces the retention policies (for every sink agent of the pool,
    /// stored in the catalog as the `sink.retention` setting, recorded
    /// with `by`); they run at once. An empty list keeps everything.
    ///
    /// # Errors
    /// [`LifecycleError::Invalid`] naming the bad policy and key (nothing
    /// changes then); catalog errors.
    pub async fn set_retention(
        &self,
        specs: &[retention::PolicySpec],
        by: &str,
    ) -> Result<RetentionView, LifecycleError> {
        let inner = &self.inner;
        let value = serde_json::to_value(specs)
            .map_err(|e| LifecycleError::Invalid(format!("policies: {e}")))?;
        for p in parse_policies(&value).map_err(LifecycleError::Invalid)? {
            if p.keeps_everything() {
                warn!(job = p.job, "a retention policy set through the API sets neither keep_last nor max_bytes: it keeps every version (keep_every and min_age only protect from those)");
            }
        }
        inner
            .catalog
            .put_setting(RETENTION_SETTING, &value, by)
            .await?;
        info!(
            policies = specs.len(),
            by, "retention policies set through the API"
        );
        refresh_policies(inner).await;
        inner.retention_wake.notify_one();
        Ok(self.retention().await?)
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
    refresh_policies(&inner).await;
    adopt_unversioned(&inner).await;
    finish_removals(&inner).await;
    sweep_versions(&inner).await;
    let every = inner
        .cfg
        .retention_interval
        .max(std::time::Duration::from_millis(100));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        // Woken by a publish, a pin request or a released lease, or the
        // interval passed (what time alone changes: leases, pins and
        // min_age running out, and other agents' policies).
        let ticked = tokio::select! {
            _ = inner.shutdown.cancelled() => return,
            _ = tick.tick() => true,
            _ = inner.retention_wake.notified() => false,
        };
        if ticked {
            refresh_policies(&inner).await;
        }
        finish_removals(&inner).await;
        apply_pin_requests(&inner).await;
        if let Err(e) = retention_pass(&inner, false).await {
            warn!(error = %e, "retention pass failed; trying again at the next one");
        }
        if ticked
            || inner
                .sweep_wanted
                .swap(false, std::sync::atomic::Ordering::Relaxed)
        {
            sweep_versions(&inner).await;
        }
        pressure_pass(&inner).await;
        if ticked {
            if let Err(e) = inner.catalog.forget_ended_leases(now_ms()).await {
                warn!(error = %e, "forgetting ended leases");
            }
            // Publish events are kept 7 days.
            if let Err(e) = inner.catalog.prune_replica_events().await {
                warn!(error = %e, "deleting publish events older than 7 days");
            }
        }
    }
}

/// The catalog setting that holds retention policies set through the API.
pub const RETENTION_SETTING: &str = "sink.retention";

/// The retention policies in force, and where they come from.
#[derive(Debug, Clone)]
pub(super) struct Policies {
    list: Arc<Vec<retention::RetentionPolicy>>,
    /// `config`, or `API (by NAME at TIME)`.
    pub(super) set_by: String,
    /// The catalog setting's value they were read from (`None`: the
    /// config's).
    from_setting: Option<String>,
}

impl Policies {
    /// The config's `[[sink.retention]]`.
    pub(super) fn from_config(list: &[retention::RetentionPolicy]) -> Policies {
        Policies {
            list: Arc::new(list.to_vec()),
            set_by: "config".into(),
            from_setting: None,
        }
    }
}

/// The retention policies in force and what they decide now for each
/// current version (`GET /v1/retention`).
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct RetentionView {
    /// The policies in force, in order: the first whose `job` glob matches
    /// a job applies to it.
    pub policies: Vec<retention::PolicySpec>,
    /// Where they come from: `config` (`[[sink.retention]]`), or `API
    /// (by NAME at TIME)`.
    pub set_by: String,
    /// Per (job, source site): its current versions, newest first.
    pub jobs: Vec<JobRetention>,
    /// Pins signals asked for whose replica is not here yet (published
    /// later, or never if its source does not send it).
    pub pending_pins: Vec<PendingPin>,
}

/// A signal's pin waiting for its replica.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct PendingPin {
    /// The source site that asked.
    pub source_site: String,
    /// The job.
    pub job: String,
    /// Which replica: `newest`, `step N`, or `first at or after step N`.
    pub target: String,
    /// Why (the signal).
    pub reason: String,
    /// When the request ends unapplied (Unix ms).
    pub until: i64,
}

/// The versions of one (job, source site) and their verdicts.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct JobRetention {
    /// The job.
    pub job: String,
    /// The source site.
    pub source_site: String,
    /// Index of the policy that applies in `policies`; `null`: none (all
    /// kept).
    pub policy: Option<usize>,
    /// Its current versions, newest first.
    pub versions: Vec<VersionVerdict>,
}

/// What the policy decides for one version now.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct VersionVerdict {
    /// The replica (version) id.
    pub replica: i64,
    /// Its training step, if known.
    pub step: Option<i64>,
    /// Its local path.
    pub local_path: String,
    /// Publish time (Unix ms).
    pub published_at: Option<i64>,
    /// Bytes in its manifest.
    pub bytes: i64,
    /// Kept now; false: the next pass removes it (unless the policy is a
    /// dry run).
    pub kept: bool,
    /// Why, in words: the rule that keeps it (and what would end that),
    /// or why it expires.
    pub why: String,
    /// When the reason that keeps it ends (Unix ms: a pin's or a lease's
    /// end, or when it grows older than `min_age`); `null` when it does
    /// not end by time.
    pub until: Option<i64>,
}

/// The policies in force now.
fn policies(inner: &Inner) -> Arc<Vec<retention::RetentionPolicy>> {
    crate::lock::lock(&inner.policies).list.clone()
}

/// Parses the `sink.retention` setting's JSON value (a list of
/// [`retention::PolicySpec`]).
fn parse_policies(value: &serde_json::Value) -> Result<Vec<retention::RetentionPolicy>, String> {
    let specs: Vec<retention::PolicySpec> =
        serde_json::from_value(value.clone()).map_err(|e| format!("{RETENTION_SETTING}: {e}"))?;
    specs
        .iter()
        .enumerate()
        .map(|(i, p)| p.policy().map_err(|e| format!("policy {i}: {e}")))
        .collect()
}

/// Takes up policies set through the API (by this agent or another of
/// the pool) from the catalog; the config's stay when none are stored.
async fn refresh_policies(inner: &Arc<Inner>) {
    let stored = match inner.catalog.settings().await {
        Ok(all) => all.into_iter().find(|s| s.name == RETENTION_SETTING),
        Err(e) => {
            warn!(error = %e, "reading the retention policies set through the API; keeping those in force");
            return;
        }
    };
    let Some(stored) = stored else {
        return;
    };
    let text = stored.value.to_string();
    if crate::lock::lock(&inner.policies).from_setting.as_deref() == Some(text.as_str()) {
        return;
    }
    match parse_policies(&stored.value) {
        Ok(list) => {
            let set_by = format!(
                "API (by {} at {})",
                stored.updated_by,
                super::rfc3339(stored.updated_at)
            );
            info!(policies = list.len(), set_by, "retention policies set through the API are in force (they replace [[sink.retention]] of the config)");
            *crate::lock::lock(&inner.policies) = Policies {
                list: Arc::new(list),
                set_by,
                from_setting: Some(text),
            };
        }
        Err(e) => {
            warn!(error = %e, "the retention policies stored in the catalog are not valid; keeping those in force")
        }
    }
}

/// Longest pin a signal may ask for, ms (100 years, as an operator's).
const MAX_SIGNAL_PIN_MS: u64 = 100 * 31_557_600_000;

/// A source asked (protocol version 6) to pin a replica of one of its
/// jobs because of a signal: recorded, then applied by the lifecycle task
/// now if the replica is here, or once it is published before the pin's
/// end.
pub(super) async fn pin_requested(
    inner: &Arc<Inner>,
    site: &str,
    p: ferry_proto::wire::PinRequest,
) {
    if let Err(e) = ferry_proto::paths::check_name(&p.job) {
        warn!(site, error = %e, "a pin request names a bad job; ignored");
        return;
    }
    let until = now_ms().saturating_add(p.for_ms.min(MAX_SIGNAL_PIN_MS) as i64);
    let reason: String = p.reason.chars().take(1000).collect();
    match inner
        .catalog
        .record_pin_request(site, &p.job, p.target, &reason, until)
        .await
    {
        Ok(id) => {
            info!(request = id, site, job = p.job, target = ?p.target, reason, until = %super::rfc3339(until), "pin requested by a signal");
            inner.retention_wake.notify_one();
        }
        Err(e) => {
            warn!(site, job = p.job, error = %e, "could not record a pin request; it is lost")
        }
    }
}

/// Applies the pin requests whose replica is here now (before each
/// retention pass, so a replica a signal pins is never expired first).
async fn apply_pin_requests(inner: &Arc<Inner>) {
    let now = now_ms();
    let pending = match inner.catalog.pending_pin_requests(now).await {
        Ok(p) => p,
        Err(e) => {
            warn!(error = %e, "reading pin requests; trying again at the next pass");
            return;
        }
    };
    if pending.is_empty() {
        return;
    }
    let rows = match inner.catalog.current_replicas().await {
        Ok(rows) => rows,
        Err(e) => {
            warn!(error = %e, "listing replicas for pin requests");
            return;
        }
    };
    let versions = versions_of(&rows, now, inner.store.hard_links(), |_| false).await;
    for p in pending {
        let group: Vec<Version> = versions
            .iter()
            .zip(&rows)
            .filter(|(_, r)| r.job == p.job && r.source_site == p.source_site)
            .map(|(v, _)| v.clone())
            .collect();
        let Some(id) = retention::pin_target(&group, p.target) else {
            continue;
        };
        match inner
            .catalog
            .apply_pin_request(p.id, id, p.until, &p.reason)
            .await
        {
            Ok(pinned) => {
                info!(
                    replica = id,
                    request = p.id,
                    job = p.job,
                    pinned,
                    until = %super::rfc3339(p.until),
                    reason = p.reason,
                    "signal pin applied{}",
                    if pinned { "" } else { " (a longer pin holds the replica already)" }
                );
                inner.changed.send_modify(|v| *v += 1);
            }
            Err(e) => warn!(replica = id, error = %e, "applying a pin request"),
        }
    }
}

/// Moves each current replica published before version directories (a
/// directory at its published path) into its own version directory, the
/// published path becoming a link to it (see
/// [`crate::storage::SinkStore::adopt`]); once, at start.
async fn adopt_unversioned(inner: &Arc<Inner>) {
    if !inner.store.versioned() {
        return;
    }
    let rows = match inner.catalog.current_replicas().await {
        Ok(rows) => rows,
        Err(e) => {
            warn!(error = %e, "listing replicas to move into version directories");
            return;
        }
    };
    let mut moved = 0usize;
    for r in rows.into_iter().filter(|r| mine(inner, r)) {
        let local = PathBuf::from(&r.local_path);
        let lock = inner.publish_lock(&local);
        let _guard = lock.lock_owned().await;
        let version = super::version_dir(&inner.cfg.root, r.id);
        let store = inner.store.clone();
        match blocking(move || store.adopt(&local, &version)).await {
            Ok(true) => moved += 1,
            Ok(false) => {}
            Err(e) => {
                warn!(replica = r.id, error = %e, "could not move a replica into its version directory; it stays where it is, and leases on it are refused")
            }
        }
    }
    if moved > 0 {
        info!(
            replicas = moved,
            "moved replicas published before version directories into their own"
        );
    }
}

/// Deletes the version directories nothing needs any more: a version a
/// re-save replaced once no lease holds it, and what a failed publish
/// left. A version a published path names, one whose transfer is still
/// receiving (a publish may be under way), and one being removed are
/// left alone. Each is claimed in the catalog first
/// ([`ferry_catalog::Catalog::claim_replaced_version`]), so a lease is
/// never granted on a version being deleted.
async fn sweep_versions(inner: &Arc<Inner>) {
    if !inner.store.versioned() {
        return;
    }
    let root = inner.cfg.root.clone();
    let dirs = [
        super::versions_root(&root),
        root.join(".ferry").join("retired"),
    ];
    let (d2, store) = (dirs.clone(), inner.store.clone());
    let listed = blocking(move || {
        let mut out = Vec::new();
        for (i, d) in d2.iter().enumerate() {
            out.extend(store.list_names(d)?.into_iter().map(|n| (i, n)));
        }
        Ok(out)
    })
    .await;
    let listed = match listed {
        Ok(l) => l,
        Err(e) => {
            warn!(error = %e, "listing version directories");
            return;
        }
    };
    if listed.is_empty() {
        return;
    }
    // The current versions, in one query: most directories are theirs.
    let current: std::collections::HashSet<String> = match inner.catalog.current_replicas().await {
        Ok(rows) => rows.iter().map(|r| r.id.to_string()).collect(),
        Err(e) => {
            warn!(error = %e, "listing current replicas; sweeping at the next pass");
            return;
        }
    };
    for (which, name) in listed {
        if which == 0 && current.contains(&name) {
            continue;
        }
        let (id_text, link) = match name.strip_suffix(".link") {
            Some(id) => (id, true),
            None => (name.as_str(), false),
        };
        let Ok(id) = id_text.parse::<i64>() else {
            continue;
        };
        let row = match inner.catalog.replica(id).await {
            Ok(Some(r)) => r,
            Ok(None) => continue,
            Err(e) => {
                warn!(error = %e, "reading a version's row; trying again at the next pass");
                return;
            }
        };
        let path = dirs[which].join(&name);
        if which == 1 {
            // retired/<id> of a replaced version whose deletion a crash
            // interrupted (a removal's is finished by finish_removals).
            if row.version_deleted_at.is_some() && row.removal.is_none() {
                let store = inner.store.clone();
                if let Err(e) = blocking(move || store.retire(&path)).await {
                    warn!(replica = id, error = %e, "deleting a replaced version");
                }
            }
            continue;
        }
        if link {
            // A link made for a publish that never finished.
            if !matches!(row.state, TransferState::Receiving | TransferState::Queued) {
                let _ = blocking(move || std::fs::remove_file(&path)).await;
            }
            continue;
        }
        // (`queued`: a weights-first transfer's weights-only version,
        // whose publish may be under way or interrupted.)
        if matches!(
            row.state,
            TransferState::Receiving
                | TransferState::Queued
                | TransferState::Removing
                | TransferState::Removed
        ) {
            continue;
        }
        let local = PathBuf::from(&row.local_path);
        let (store, l2) = (inner.store.clone(), local.clone());
        match blocking(move || store.named_version(&l2)).await {
            Ok(Some(v)) if v == path => continue,
            Ok(_) => {}
            Err(e) => {
                warn!(replica = id, error = %e, "reading what a published path names");
                continue;
            }
        }
        if row.state == TransferState::Published {
            match newer_version(inner, &row).await {
                Ok(Some(_)) => {}
                // Current by the catalog, though its path does not name
                // it (changed by hand?): kept.
                Ok(None) => continue,
                Err(e) => {
                    warn!(replica = id, error = %e, "reading a version's successor");
                    continue;
                }
            }
        }
        let claimed = row.version_deleted_at.is_some()
            || match inner.catalog.claim_replaced_version(id).await {
                Ok(c) => c,
                Err(e) => {
                    warn!(replica = id, error = %e, "claiming a replaced version");
                    continue;
                }
            };
        if !claimed {
            // A live lease holds it.
            continue;
        }
        let keep = match staying_versions(inner, &row).await {
            Ok(k) => k,
            Err(e) => {
                warn!(replica = id, error = %e, "listing the versions that stay; sweeping at the next pass");
                continue;
            }
        };
        let aside = retired_path(&root, id);
        let store = inner.store.clone();
        let res = blocking(move || {
            store.withdraw(&local, &path, &aside, &keep)?;
            store.retire(&aside)
        })
        .await;
        match res {
            Ok(()) => info!(
                replica = id,
                why = if row.state == TransferState::Published {
                    "a re-save replaced it"
                } else {
                    "its transfer did not finish"
                },
                "deleted a version no published path names and no lease holds"
            ),
            Err(e) => {
                warn!(replica = id, error = %e, "deleting a replaced version; trying again at the next pass")
            }
        }
    }
}

/// One pass of the policies over the current versions; with `wait`, the
/// files of what it removes are deleted before it returns.
async fn retention_pass(inner: &Arc<Inner>, wait: bool) -> Result<Vec<i64>, CatalogError> {
    let policies = policies(inner);
    if policies.is_empty() {
        return Ok(Vec::new());
    }
    let now = now_ms();
    let mut rows = inner.catalog.current_replicas().await?;
    rows.retain(|r| mine(inner, r));
    let versions = versions_of(&rows, now, inner.store.hard_links(), |r| {
        policies
            .iter()
            .find(|p| p.matches(&r.job))
            .is_some_and(|p| p.max_bytes.is_some())
    })
    .await;
    let mut expired = Vec::new();
    for v in retention::evaluate(&policies, &versions, now) {
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

/// The published `rows` as the policies see them at `now` (Unix ms); on a
/// store of version directories (`listed`: POSIX, where versions share
/// unchanged files by hard links), the files of a row for which
/// `count_files` is true are listed by identity (hard links count once);
/// the others count as one file of their size.
async fn versions_of(
    rows: &[Replica],
    now: i64,
    listed: bool,
    count_files: impl Fn(&Replica) -> bool,
) -> Vec<Version> {
    let mut versions = Vec::with_capacity(rows.len());
    for r in rows {
        let files = if listed && count_files(r) {
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
            leased: r.leased_at(now),
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
    // A replica a signal pins is pinned before anything is weighed.
    apply_pin_requests(inner).await;
    // 1. Versions a re-save replaced that no lease holds, and what
    // failed or cancelled transfers left staged (kept when a publish was
    // under way: it may hold a published version).
    sweep_versions(inner).await;
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
            if r.staging_path.is_empty()
                || !staging.starts_with(&inner.cfg.root)
                || crate::lock::lock(&inner.live).contains_key(&r.id)
            {
                continue;
            }
            let store = inner.store.clone();
            let s2 = staging.clone();
            // Off the async threads: the checks touch the file system too.
            let discarded = blocking(move || {
                if store.publish_under_way(&s2) || !store.exists(&s2)? {
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
        Ok(rows) => rows
            .into_iter()
            .filter(|r| mine(inner, r))
            .collect::<Vec<_>>(),
        Err(e) => {
            relief.short = Some(format!("the catalog could not list replicas: {e}"));
            return relief;
        }
    };
    let now = now_ms();
    let versions = versions_of(&rows, now, inner.store.hard_links(), |_| true).await;
    let classes: Vec<_> = rows.iter().map(|r| r.class).collect();
    let need = goal.saturating_sub(relief.free.unwrap_or(0));
    let plan = super::pressure::plan(&policies(inner), &versions, &classes, now, need);
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

/// The version directories of the other versions at `r`'s path that stay
/// (published, not deleted): what a store whose versions name files of
/// earlier ones by reference (S3) must keep when `r` goes. Empty on a
/// store with hard links, which needs no list.
async fn staying_versions(inner: &Inner, r: &Replica) -> Result<Vec<PathBuf>, CatalogError> {
    if inner.store.hard_links() {
        return Ok(Vec::new());
    }
    Ok(inner
        .catalog
        .replicas_for_source(&r.source_path)
        .await?
        .into_iter()
        .filter(|n| {
            n.id != r.id
                && n.local_path == r.local_path
                && n.state == TransferState::Published
                && n.version_deleted_at.is_none()
        })
        .map(|n| super::version_dir(&inner.cfg.root, n.id))
        .collect())
}

/// The newest row that replaced `r` at its path: published, or removed
/// since (its files went with the re-save).
async fn newer_version(inner: &Inner, r: &Replica) -> Result<Option<i64>, CatalogError> {
    Ok(inner
        .catalog
        .replicas_for_source(&r.source_path)
        .await?
        .into_iter()
        .filter(|n| {
            n.id > r.id
                && n.local_path == r.local_path
                && matches!(
                    n.state,
                    TransferState::Published | TransferState::Removing | TransferState::Removed
                )
        })
        .map(|n| n.id)
        .min())
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
    let version = super::version_dir(&inner.cfg.root, r.id);
    let keep = staying_versions(inner, r).await?;
    let (store, l2, a2) = (inner.store.clone(), local.clone(), aside.clone());
    let moved = blocking(move || store.withdraw(&l2, &version, &a2, &keep)).await;
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
                Ok(false)
            }
        };
        crate::lock::lock(&inner.retiring).remove(&r.id);
        match done {
            // Counted by the one agent of a pool that recorded it.
            Ok(false) => {}
            Ok(true) => {
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
    for r in rows.into_iter().filter(|r| mine(inner, r)) {
        if crate::lock::lock(&inner.retiring).contains(&r.id) {
            continue;
        }
        let aside = retired_path(&inner.cfg.root, r.id);
        let local = PathBuf::from(&r.local_path);
        let lock = inner.publish_lock(&local);
        let guard = lock.lock_owned().await;
        let (store, a2) = (inner.store.clone(), aside.clone());
        let aside_there = blocking(move || store.exists(&a2)).await.unwrap_or(false);
        if !aside_there && !replaced(inner, &r).await {
            let version = super::version_dir(&inner.cfg.root, r.id);
            let keep = match staying_versions(inner, &r).await {
                Ok(k) => k,
                Err(e) => {
                    warn!(replica = r.id, error = %e, "listing the versions that stay; trying again later");
                    continue;
                }
            };
            let (store, l2, a2) = (inner.store.clone(), local.clone(), aside.clone());
            if let Err(e) = blocking(move || store.withdraw(&l2, &version, &a2, &keep)).await {
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
    if rows
        .iter()
        .any(|n| n.id > r.id && n.local_path == r.local_path && n.state == TransferState::Published)
    {
        return true;
    }
    let stagings: Vec<std::path::PathBuf> = rows
        .iter()
        .filter(|n| {
            n.id > r.id
                && n.local_path == r.local_path
                && matches!(n.state, TransferState::Receiving | TransferState::Queued)
        })
        .map(|n| std::path::PathBuf::from(&n.staging_path))
        .collect();
    if stagings.is_empty() {
        return false;
    }
    // Asking the store may cross the network (HDFS, S3): not on the
    // async threads. Unknown counts as replaced: nothing is moved.
    let store = inner.store.clone();
    tokio::task::spawn_blocking(move || stagings.iter().any(|s| store.publish_under_way(s)))
        .await
        .unwrap_or(true)
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
