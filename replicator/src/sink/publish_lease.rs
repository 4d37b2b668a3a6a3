//! One publish into a published path at a time, across the sink pool.
//!
//! Within one process a publish takes the path's lock
//! ([`super::Inner::publish_lock`]). The sink agents of a site share one
//! sink root, so each also claims the path's publish lease in the catalog
//! ([`ferry_catalog::Catalog::claim_publish`]), renewed by its heartbeat.
//! A publish waits while another agent holds a live lease on the path. If
//! the holder dies mid-publish its lease lapses after the pool's
//! `lease_timeout`; the next agent asked to publish the transfer (the
//! source reconnects to another sink agent of the link and commits
//! again) claims it and finishes the publish from what is on disk, as an
//! agent does after its own restart (`SinkStore::publish` finds the
//! publish under way).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::Inner;
use crate::pool::Membership;

/// Held while a version moves into a published path: the process's lock
/// on the path and, in a pool, the path's publish lease (released when
/// dropped).
pub(super) struct PublishGuard {
    _lock: tokio::sync::OwnedMutexGuard<()>,
    lease: Option<HeldLease>,
}

struct HeldLease {
    pool: Membership,
    path: String,
    /// The replica row the publish is of.
    replica: i64,
    epoch: i64,
    /// Local time the claim was sent.
    claimed: Instant,
}

impl PublishGuard {
    /// Whether the publish may still record itself: outside a pool
    /// always; in a pool while the agent holds the path's lease
    /// ([`Membership::holds_publish`]). False once the lease may have
    /// lapsed (the agent was cut off from the catalog or paused), when
    /// another agent may be finishing the same publish.
    pub(super) fn held(&self) -> bool {
        self.lease
            .as_ref()
            .is_none_or(|l| l.pool.holds_publish(&l.path, l.claimed))
    }
}

impl PublishGuard {
    /// Makes sure the publish may record itself: true at once when
    /// [`PublishGuard::held`]; otherwise (the lease may have lapsed while
    /// the catalog did not answer, or the agent was paused) it claims the
    /// path's lease again, retrying while the catalog does not answer,
    /// and is true if no other sink agent took it meanwhile. False when
    /// another one holds it, or the sink stops.
    pub(super) async fn keep(&mut self, inner: &Inner) -> bool {
        let Some(l) = self.lease.as_mut() else {
            return true;
        };
        let timeout_ms = l.pool.config().lease_timeout.as_millis() as i64;
        let every = l
            .pool
            .config()
            .heartbeat_interval
            .max(Duration::from_millis(100));
        let mut said = false;
        loop {
            if l.pool.holds_publish(&l.path, l.claimed) {
                return true;
            }
            let claimed = Instant::now();
            let replica = l.replica;
            match l
                .pool
                .catalog()
                .claim_publish(&l.path, replica, l.pool.name(), timeout_ms)
                .await
            {
                Ok(Some(c)) => {
                    info!(
                        path = l.path,
                        epoch = c.epoch,
                        "claimed the publish lease again after it lapsed; nobody took it meanwhile"
                    );
                    l.epoch = c.epoch;
                    l.claimed = claimed;
                    return true;
                }
                Ok(None) => return false,
                Err(e) => {
                    if !said {
                        warn!(path = l.path, error = %e, "claiming the publish lease again; trying until the catalog answers");
                        said = true;
                    }
                }
            }
            tokio::select! {
                _ = inner.shutdown.cancelled() => return false,
                _ = tokio::time::sleep(every) => {}
            }
        }
    }
}

impl Drop for HeldLease {
    fn drop(&mut self) {
        let (pool, path, epoch) = (self.pool.clone(), self.path.clone(), self.epoch);
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let c = pool.catalog();
                if let Err(e) = c.release_publish(&path, pool.name(), epoch).await {
                    // It lapses after the lease timeout instead.
                    warn!(path, error = %e, "releasing the publish lease");
                }
            });
        }
    }
}

/// Takes the publish lock on `local_path` for replica row `replica`:
/// this process's lock, then (with a pool) the path's publish lease,
/// waiting while another sink agent holds it. A lease taken over from an
/// agent whose lease lapsed is logged (its publish is finished from disk
/// by the caller's publish).
///
/// # Errors
/// A message if the sink shuts down while waiting.
pub(super) async fn lock_publish(
    inner: &Arc<Inner>,
    local_path: &Path,
    replica: i64,
) -> Result<PublishGuard, String> {
    let lock = inner.publish_lock(local_path).lock_owned().await;
    let Some(pool) = inner.cfg.pool.clone() else {
        return Ok(PublishGuard {
            _lock: lock,
            lease: None,
        });
    };
    let path = local_path.to_string_lossy().into_owned();
    let timeout_ms = pool.config().lease_timeout.as_millis() as i64;
    let every = pool
        .config()
        .heartbeat_interval
        .max(Duration::from_millis(100));
    let mut said = None::<String>;
    loop {
        let claimed = Instant::now();
        let why = match pool
            .catalog()
            .claim_publish(&path, replica, pool.name(), timeout_ms)
            .await
        {
            Ok(Some(c)) => {
                if let Some((agent, was)) = &c.took_over_from {
                    info!(
                        path,
                        replica,
                        interrupted = agent,
                        interrupted_replica = was,
                        epoch = c.epoch,
                        "took over the publish lease of a sink agent whose lease lapsed; its publish is finished from what is on disk"
                    );
                }
                return Ok(PublishGuard {
                    _lock: lock,
                    lease: Some(HeldLease {
                        pool,
                        path,
                        replica,
                        epoch: c.epoch,
                        claimed,
                    }),
                });
            }
            Ok(None) => match pool.catalog().publish_holder(&path).await {
                Ok(Some(h)) => format!(
                    "sink agent {} holds the publish lease on {path} (replica {}, {:.1} s left unless renewed); waiting",
                    h.agent,
                    h.replica.unwrap_or(0),
                    h.left_ms as f64 / 1000.0
                ),
                _ => format!("another sink agent holds the publish lease on {path}; waiting"),
            },
            Err(e) => format!("claiming the publish lease on {path}: {e}; trying again"),
        };
        // Said once per holder, not every interval.
        let head = why.split(" (").next().unwrap_or_default().to_string();
        if said.as_deref() != Some(&head) {
            info!(replica, "{why}");
            said = Some(head);
        }
        tokio::select! {
            _ = inner.shutdown.cancelled() => {
                return Err(format!("the sink is stopping; {path} was not published"));
            }
            _ = tokio::time::sleep(every) => {}
        }
    }
}
