//! Keeping a source agent of a pool in step with its catalog's shared
//! settings and signals (see [`crate::settings`]): read every
//! [`REFRESH`] and at once on the pool's notification channel. A
//! striped transfer's new plan wakes the agent's link workers at once,
//! so that they claim its parts, and so does a change of its parts'
//! holders, so that they recompute this agent's share of the budget.

use std::sync::Arc;
use std::time::Duration;

use ferry_catalog::dialect::Dialect;
use ferry_catalog::notify::payload;
use ferry_catalog::Catalog;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::Source;
use crate::settings::REFRESH;

/// Keeps `source` in step with its pool's catalog until `stop`: reads
/// the shared settings and recent signals ([`Source::refresh_shared`])
/// every [`REFRESH`] and at once on a notification on the catalog's
/// channel. The listener has a connection of its own; losing it stops
/// nothing: the agent goes on reading every second and connects again.
/// Does nothing on SQLite.
pub async fn follow(source: Source, stop: CancellationToken) {
    let catalog = source.catalog().clone();
    if catalog.dialect() != Dialect::Postgres {
        return;
    }
    let poke = Arc::new(Notify::new());
    let plans = Arc::new(Notify::new());
    let listener = tokio::spawn(listen(catalog, poke.clone(), plans.clone(), stop.clone()));
    let mut tick = tokio::time::interval(REFRESH);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = poke.notified() => {}
            _ = plans.notified() => {
                source.wake_all();
                continue;
            }
            _ = stop.cancelled() => break,
        }
        let read = tokio::time::timeout(REFRESH * 5, source.refresh_shared());
        match read.await {
            Ok(Ok(())) => {
                if failing {
                    info!("shared settings: the catalog answers again");
                }
                failing = false;
            }
            Ok(Err(e)) if !failing => {
                failing = true;
                warn!(error = %e, "shared settings: cannot read the catalog; retrying every second");
            }
            Err(_) if !failing => {
                failing = true;
                warn!(
                    "shared settings: the catalog did not answer within 5 s; retrying every second"
                );
            }
            _ => {}
        }
    }
    listener.abort();
}

/// Listens on the pool's channel, poking `plans` at each stored plan
/// ([`payload::PLAN`]) or change of a striped transfer's holders
/// ([`payload::HOLDERS`]: the link workers recompute this agent's share
/// of the budget at once) and `poke` at any other notification and when the
/// connection was lost (something may have been missed); connects again
/// after a failure, at most once a second.
async fn listen(catalog: Catalog, poke: Arc<Notify>, plans: Arc<Notify>, stop: CancellationToken) {
    let mut announced_down = false;
    loop {
        let attempt = tokio::select! {
            r = catalog.listen_pool(Duration::from_secs(5)) => r,
            _ = stop.cancelled() => return,
        };
        match attempt {
            Ok(Some(mut l)) => {
                if announced_down {
                    info!("shared settings: listening for the pool's notifications again");
                }
                // Whatever was announced while not listening.
                poke.notify_one();
                loop {
                    let r = tokio::select! {
                        r = l.recv() => r,
                        _ = stop.cancelled() => return,
                    };
                    match r {
                        Ok(Some(p)) if p == payload::PLAN || p == payload::HOLDERS => {
                            plans.notify_one()
                        }
                        Ok(Some(_)) => poke.notify_one(),
                        Ok(None) => {
                            warn!("shared settings: the notification connection was lost; connecting again (the settings are read every second meanwhile)");
                            poke.notify_one();
                        }
                        Err(e) => {
                            warn!(error = %e, "shared settings: the notification connection failed; reading every second until it is back");
                            announced_down = true;
                            break;
                        }
                    }
                }
            }
            Ok(None) => return,
            Err(e) => {
                if !announced_down {
                    warn!(error = %e, "shared settings: cannot listen for the pool's notifications; reading every second meanwhile");
                    announced_down = true;
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = stop.cancelled() => return,
        }
    }
}
