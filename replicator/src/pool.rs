//! An agent's membership of its site's pool: registration, the heartbeat
//! that keeps it (and its transfer leases) alive in the catalog, and what
//! it knows of its own standing (ARCHITECTURE.md, "Pool").
//!
//! Every `heartbeat_interval` the agent writes its heartbeat and renews
//! the leases it holds, in one transaction timed by the database clock
//! ([`ferry_catalog::Catalog::heartbeat`]). Its leases run until the
//! database's now plus `lease_timeout`; another agent may claim a
//! transfer whose lease lapsed. The agent itself stops trusting its
//! leases `lease_timeout - heartbeat_interval` after the start of its
//! last heartbeat that succeeded ([`Membership::leases_valid`]): a lease
//! renewed by a statement sent at local time `t` runs at least until
//! `t + lease_timeout`, so an agent that cannot reach the catalog (or was
//! paused) stops its runs before any other agent may take them over.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_catalog::{AgentState, Catalog, Heartbeat};
use ferry_proto::state::TransferId;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// Timing of the pool (`[pool]` in the config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// How often the agent writes its heartbeat and renews its leases
    /// (default 2 s).
    pub heartbeat_interval: Duration,
    /// How long a lease (and the agent's membership) lasts without a
    /// heartbeat (default 9 s): after this, other agents see the agent
    /// down and may claim its transfers and parts. At least three
    /// heartbeat intervals; shorter than the QUIC idle timeout
    /// ([`crate::transport::IDLE_TIMEOUT`], 10 s) unless said otherwise
    /// ([`PoolConfig::caveat`]).
    pub lease_timeout: Duration,
    /// Payload bytes per part of a striped transfer (default 256 MiB):
    /// on a PostgreSQL catalog, a pushed transfer's chunks (and a watched
    /// one's complete files and full chunks while it is written, see
    /// [`PoolConfig::stripe_while_writing`], and
    /// what is left of it at its commit) are grouped into parts of about
    /// this size, which any source agent of the pool claims. At least one
    /// chunk.
    pub part_size: u64,
    /// Most parts an agent holds at once (default 4).
    pub max_parts: usize,
    /// Whether what can no longer change of a watched checkpoint still
    /// being written (complete files, full chunks of files only ever
    /// appended to) is striped across the pool, once more than one part
    /// per live source agent of it waits (default true); false leaves it
    /// to the watching agent until the commit.
    pub stripe_while_writing: bool,
}

/// Default [`PoolConfig::part_size`]: 256 MiB.
pub const DEFAULT_PART_SIZE: u64 = 256 << 20;

/// Default [`PoolConfig::max_parts`].
pub const DEFAULT_MAX_PARTS: usize = 4;

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            heartbeat_interval: Duration::from_secs(2),
            lease_timeout: Duration::from_secs(9),
            part_size: DEFAULT_PART_SIZE,
            max_parts: DEFAULT_MAX_PARTS,
            stripe_while_writing: true,
        }
    }
}

impl PoolConfig {
    /// What an agent should say at start about a timing it accepts but
    /// advises against: a lease not shorter than the QUIC idle timeout
    /// ([`crate::transport::IDLE_TIMEOUT`]). With a shorter lease, the
    /// parts of an agent that stopped answering are taken over before its
    /// connections time out, and an agent paused past its lease comes
    /// back on a live connection whose late chunks the sink's epochs
    /// refuse. `None` when the timing is as advised.
    pub fn caveat(&self) -> Option<String> {
        let idle = crate::transport::IDLE_TIMEOUT;
        (self.lease_timeout >= idle).then(|| {
            format!(
                "pool.lease_timeout ({:?}) is not shorter than the QUIC idle timeout ({idle:?}): \
                 an unresponsive agent's parts are taken over only after its connections \
                 time out; a shorter lease is advised (default 9s)",
                self.lease_timeout
            )
        })
    }

    /// Checks the timing.
    ///
    /// # Errors
    /// A message naming the setting when the interval is zero or the
    /// timeout is shorter than three intervals.
    pub fn check(&self) -> Result<(), String> {
        if self.heartbeat_interval < Duration::from_millis(100) {
            return Err(format!(
                "pool.heartbeat_interval ({:?}) must be at least 100ms: every heartbeat is a \
                 write to the catalog",
                self.heartbeat_interval
            ));
        }
        if self.heartbeat_interval > Duration::from_secs(60) {
            return Err(format!(
                "pool.heartbeat_interval ({:?}) must be at most 1m",
                self.heartbeat_interval
            ));
        }
        if self.lease_timeout > Duration::from_secs(600) {
            return Err(format!(
                "pool.lease_timeout ({:?}) must be at most 10m: a dead agent's transfers and \
                 watches wait that long for another agent",
                self.lease_timeout
            ));
        }
        if self.lease_timeout < Duration::from_secs(1) {
            return Err(format!(
                "pool.lease_timeout ({:?}) must be at least 1s",
                self.lease_timeout
            ));
        }
        if self.lease_timeout < self.heartbeat_interval * 3 {
            return Err(format!(
                "pool.lease_timeout ({:?}) must be at least three heartbeat intervals ({:?}): \
                 a lease must survive a missed heartbeat",
                self.lease_timeout,
                self.heartbeat_interval * 3
            ));
        }
        if self.part_size < 1 << 20 {
            return Err(format!(
                "pool.part_size ({} bytes) must be at least 1MiB: each part is a claim and a \
                 release in the catalog",
                self.part_size
            ));
        }
        if !(1..=64).contains(&self.max_parts) {
            return Err(format!(
                "pool.max_parts ({}) must be within 1..64",
                self.max_parts
            ));
        }
        Ok(())
    }
}

/// How long one heartbeat may take before it counts as failed: the
/// heartbeat interval, at least 1 s.
fn heartbeat_timeout(cfg: PoolConfig) -> Duration {
    cfg.heartbeat_interval.max(Duration::from_secs(1))
}

/// How often a run checks that its agent still holds its lease (100 ms).
pub const FENCE_CHECK: Duration = Duration::from_millis(100);

/// Payload rates an agent reports with its heartbeat: (sent, received),
/// bit/s.
pub type RateProbe = Box<dyn Fn() -> (f64, f64) + Send + Sync>;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: &'static str,
}

/// What the agent knows of its own standing.
#[derive(Debug, Default)]
struct Standing {
    /// Local time the last successful heartbeat was sent.
    last_ok: Option<Instant>,
    /// Whether the last heartbeat reached the catalog.
    catalog_up: bool,
    /// The last heartbeat's error, if it failed.
    error: Option<String>,
    /// Whether an operator drained the agent.
    draining: bool,
    /// Leases the last heartbeat renewed.
    held: HashSet<TransferId>,
    /// Watch leases (source roots) the last heartbeat renewed.
    watches: HashSet<String>,
    /// Publish leases (published paths) the last heartbeat renewed.
    publishes: HashSet<String>,
    /// Parts of striped transfers the last heartbeat renewed.
    parts: HashSet<(TransferId, u64)>,
    /// Live, undrained agents of its role at the last heartbeat, itself
    /// included.
    live_peers: i64,
}

struct Inner {
    catalog: Catalog,
    cfg: PoolConfig,
    name: String,
    /// This process's random id (hex), registered with the name.
    instance: String,
    role: String,
    version: String,
    api_url: Mutex<String>,
    rates: Mutex<Option<RateProbe>>,
    standing: Mutex<Standing>,
    /// Wakes the source's link workers: the agent's standing changed.
    changed: tokio::sync::Notify,
    registry: Registry,
    catalog_up: Gauge,
    agents: Family<StateLabel, Gauge>,
    takeovers: Counter,
    lost: Counter,
    heartbeats_failed: AtomicU64,
}

/// An agent's membership of the pool; cheap to clone.
#[derive(Clone)]
pub struct Membership {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Membership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Membership")
            .field("agent", &self.inner.name)
            .finish_non_exhaustive()
    }
}

impl Membership {
    /// Membership of agent `name` (role `source`, `sink` or `both`) in the
    /// pool of `catalog`'s site. Nothing is written until [`Membership::run`].
    pub fn new(catalog: Catalog, cfg: PoolConfig, name: &str, role: &str) -> Membership {
        let mut registry = Registry::default();
        let catalog_up = Gauge::default();
        let agents = Family::<StateLabel, Gauge>::default();
        let takeovers = Counter::default();
        let lost = Counter::default();
        registry.register(
            "ferry_catalog_up",
            "1 if this agent's last heartbeat reached the catalog, else 0",
            catalog_up.clone(),
        );
        registry.register(
            "ferry_pool_agents",
            "Agents of the site's pool by state (live, draining, down, stopped), as this \
             agent's catalog sees them",
            agents.clone(),
        );
        registry.register(
            "ferry_lease_takeovers",
            "Transfers and watched source roots this agent claimed after another agent's lease \
             on them lapsed",
            takeovers.clone(),
        );
        registry.register(
            "ferry_leases_lost",
            "Leases this agent lost before its run of the transfer ended (not renewed in \
             time: the catalog was unreachable or the agent was paused)",
            lost.clone(),
        );
        Membership {
            inner: Arc::new(Inner {
                catalog,
                cfg,
                name: name.to_string(),
                instance: {
                    let r: [u8; 8] = rand::random();
                    r.iter().map(|b| format!("{b:02x}")).collect()
                },
                role: role.to_string(),
                version: env!("CARGO_PKG_VERSION").to_string(),
                api_url: Mutex::new(String::new()),
                rates: Mutex::new(None),
                standing: Mutex::new(Standing::default()),
                changed: tokio::sync::Notify::new(),
                registry,
                catalog_up,
                agents,
                takeovers,
                lost,
                heartbeats_failed: AtomicU64::new(0),
            }),
        }
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The pool's timing.
    pub fn config(&self) -> PoolConfig {
        self.inner.cfg
    }

    /// The catalog the pool shares.
    pub fn catalog(&self) -> &Catalog {
        &self.inner.catalog
    }

    /// Sets the REST API's base URL recorded with the heartbeat.
    pub fn set_api_url(&self, url: &str) {
        *crate::lock::lock(&self.inner.api_url) = url.to_string();
    }

    /// Sets how the payload rates recorded with each heartbeat are read.
    pub fn set_rates(&self, probe: RateProbe) {
        *crate::lock::lock(&self.inner.rates) = Some(probe);
    }

    fn beat(&self) -> (String, f64, f64) {
        let url = crate::lock::lock(&self.inner.api_url).clone();
        let (sent, received) = crate::lock::lock(&self.inner.rates)
            .as_ref()
            .map_or((0.0, 0.0), |p| p());
        (url, sent, received)
    }

    /// Whether the agent may act on its leases now: its last heartbeat
    /// succeeded less than `lease_timeout - heartbeat_interval` ago.
    pub fn leases_valid(&self) -> bool {
        let s = crate::lock::lock(&self.inner.standing);
        s.last_ok.is_some_and(|t| {
            t.elapsed() < self.inner.cfg.lease_timeout - self.inner.cfg.heartbeat_interval
        })
    }

    /// Whether the agent may claim work: its leases are valid and it is
    /// not drained.
    pub fn may_claim(&self) -> bool {
        self.leases_valid() && !crate::lock::lock(&self.inner.standing).draining
    }

    /// How many live, undrained agents of this agent's role the pool had
    /// at the last heartbeat, this one included (1 before the first).
    pub fn live_peers(&self) -> u32 {
        let n = crate::lock::lock(&self.inner.standing).live_peers;
        u32::try_from(n).unwrap_or(u32::MAX).max(1)
    }

    /// Whether an operator drained the agent.
    pub fn draining(&self) -> bool {
        crate::lock::lock(&self.inner.standing).draining
    }

    /// Whether the last heartbeat reached the catalog, and its error if
    /// not.
    pub fn catalog_status(&self) -> (bool, Option<String>) {
        let s = crate::lock::lock(&self.inner.standing);
        (s.catalog_up, s.error.clone())
    }

    /// Whether the agent may still act on its lease of transfer `id`,
    /// claimed (the claim returned) at local time `claimed`: its leases
    /// are valid ([`Membership::leases_valid`]), and no heartbeat sent
    /// after the claim failed to renew this one (a lease that lapsed, or
    /// was taken over, is not renewed).
    pub fn holds(&self, id: TransferId, claimed: Instant) -> bool {
        self.holds_lease(claimed, |s| s.held.contains(&id))
    }

    /// Whether the agent's leases are valid and no heartbeat sent after
    /// `claimed` failed to renew the lease `renewed` finds in the
    /// standing.
    fn holds_lease(&self, claimed: Instant, renewed: impl FnOnce(&Standing) -> bool) -> bool {
        let cfg = self.inner.cfg;
        let s = crate::lock::lock(&self.inner.standing);
        match s.last_ok {
            None => false,
            Some(t) if t.elapsed() >= cfg.lease_timeout - cfg.heartbeat_interval => false,
            Some(t) => t <= claimed || renewed(&s),
        }
    }

    /// Whether the agent may still watch source root `root`, whose watch
    /// it claimed at local time `claimed`: as [`Membership::holds`], for
    /// the root's watch lease.
    pub fn holds_watch(&self, root: &str, claimed: Instant) -> bool {
        self.holds_lease(claimed, |s| s.watches.contains(root))
    }

    /// Whether the sink agent may still act on its publish lease on
    /// published path `local_path`, claimed at local time `claimed`: as
    /// [`Membership::holds`], for the path's publish lease.
    pub fn holds_publish(&self, local_path: &str, claimed: Instant) -> bool {
        self.holds_lease(claimed, |s| s.publishes.contains(local_path))
    }

    /// Whether the agent may still send part `part` of transfer `id`,
    /// claimed at local time `claimed`: as [`Membership::holds`], for the
    /// part's lease. Once false, the agent sends no more of the part:
    /// another agent may claim it after its lease's end.
    pub fn holds_part(&self, id: TransferId, part: u64, claimed: Instant) -> bool {
        self.holds_lease(claimed, |s| s.parts.contains(&(id, part)))
    }

    /// Resolves once the agent may no longer act on its lease of transfer
    /// `id` claimed at `claimed` (see [`Membership::holds`]), checked
    /// every [`FENCE_CHECK`]: whatever the agent is doing, even waiting on
    /// a catalog that does not answer, the run is stopped before another
    /// agent may claim the transfer.
    pub async fn lost(&self, id: TransferId, claimed: Instant) {
        let mut tick = tokio::time::interval(FENCE_CHECK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if !self.holds(id, claimed) {
                return;
            }
        }
    }

    /// Resolves once the agent may no longer watch `root`, whose watch
    /// it claimed at `claimed` (see [`Membership::holds_watch`]), checked
    /// every [`FENCE_CHECK`].
    pub async fn watch_lost(&self, root: &str, claimed: Instant) {
        let mut tick = tokio::time::interval(FENCE_CHECK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if !self.holds_watch(root, claimed) {
                return;
            }
        }
    }

    /// Resolves when the agent's standing changes (a heartbeat failed or
    /// came back, a drain, a lease not renewed).
    pub async fn changed(&self) {
        self.inner.changed.notified().await
    }

    /// Counts a takeover (a claim of a transfer whose previous holder's
    /// lease lapsed).
    pub fn count_takeover(&self) {
        self.inner.takeovers.inc();
    }

    /// Counts a lease lost before its run ended.
    pub fn count_lost(&self) {
        self.inner.lost.inc();
    }

    /// Registers the agent, then heartbeats every interval until
    /// `stop`, then records a clean stop (its leases released). Failures
    /// are logged and retried at the next interval; the agent's standing
    /// says whether the catalog answers.
    pub async fn run(self, stop: CancellationToken) {
        let i = &self.inner;
        let mut registered = false;
        let mut tick = tokio::time::interval(i.cfg.heartbeat_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.cancelled() => break,
            }
            let (url, sent, received) = self.beat();
            let hb = Heartbeat {
                name: &i.name,
                role: &i.role,
                version: &i.version,
                api_url: &url,
                timeout_ms: i.cfg.lease_timeout.as_millis() as i64,
                instance: &i.instance,
                sent_bps: sent,
                received_bps: received,
            };
            let started = Instant::now();
            // Bounded: while the database is down, sqlx retries a new
            // connection with a backoff of up to 2 s inside one call, so
            // a heartbeat begun during an outage could still be waiting
            // well after the database is back. A fresh attempt at the
            // next tick connects at once.
            let result = tokio::time::timeout(heartbeat_timeout(i.cfg), async {
                if !registered {
                    i.catalog.register_agent(&hb).await?;
                    registered = true;
                }
                i.catalog.heartbeat(&hb).await
            })
            .await
            .unwrap_or(Err(ferry_catalog::CatalogError::Timeout(
                heartbeat_timeout(i.cfg),
            )));
            let mut changed = false;
            match result {
                Ok(b) => {
                    let held: HashSet<TransferId> = b.held.into_iter().collect();
                    let watches: HashSet<String> = b.watches.into_iter().collect();
                    let publishes: HashSet<String> = b.publishes.into_iter().collect();
                    let parts: HashSet<(TransferId, u64)> = b.parts.into_iter().collect();
                    let mut s = crate::lock::lock(&i.standing);
                    if !s.catalog_up {
                        if s.last_ok.is_some() || s.error.is_some() {
                            info!(agent = i.name, "the catalog answers again");
                        }
                        changed = true;
                    }
                    if s.draining != b.draining
                        || s.held.iter().any(|t| !held.contains(t))
                        || s.watches.iter().any(|r| !watches.contains(r))
                        || s.publishes.iter().any(|p| !publishes.contains(p))
                        || s.parts.iter().any(|p| !parts.contains(p))
                    {
                        changed = true;
                    }
                    if b.draining && !s.draining {
                        info!(
                            agent = i.name,
                            "drained by an operator: claiming nothing new"
                        );
                    }
                    *s = Standing {
                        last_ok: Some(started),
                        catalog_up: true,
                        error: None,
                        draining: b.draining,
                        held,
                        watches,
                        publishes,
                        parts,
                        live_peers: b.live_peers,
                    };
                    i.catalog_up.set(1);
                }
                Err(ferry_catalog::CatalogError::AgentName(why)) => {
                    // The catalog answers, but this process is not (or no
                    // longer) the pool's agent of this name: it claims
                    // nothing, and tries to register again.
                    registered = false;
                    let mut s = crate::lock::lock(&i.standing);
                    if s.error.as_deref() != Some(why.as_str()) {
                        warn!(agent = i.name, "not joining the pool: {why}");
                        changed = true;
                    }
                    s.last_ok = None;
                    s.held.clear();
                    s.watches.clear();
                    s.publishes.clear();
                    s.parts.clear();
                    s.catalog_up = true;
                    s.error = Some(why);
                    i.catalog_up.set(1);
                }
                Err(e) => {
                    let mut s = crate::lock::lock(&i.standing);
                    if s.catalog_up || s.error.is_none() {
                        warn!(agent = i.name, error = %e, "heartbeat: the catalog does not answer; leases lapse after {:?}", i.cfg.lease_timeout);
                        changed = true;
                    }
                    s.catalog_up = false;
                    s.error = Some(e.to_string());
                    i.catalog_up.set(0);
                    i.heartbeats_failed.fetch_add(1, Ordering::Relaxed);
                }
            }
            if changed {
                i.changed.notify_waiters();
            }
        }
        if registered {
            if let Err(e) = i.catalog.agent_stopped(&i.name, &i.instance).await {
                warn!(agent = i.name, error = %e, "recording a clean stop in the catalog");
            }
        }
    }

    /// The pool's metrics in Prometheus text format (`ferry_catalog_up`,
    /// `ferry_pool_agents{state}`, `ferry_lease_takeovers_total`,
    /// `ferry_leases_lost_total`); the agents by state are read from the
    /// catalog now (left as they were if it does not answer within
    /// [`crate::metrics::SCRAPE_CATALOG_WAIT`]).
    ///
    /// # Errors
    /// Encoding errors only.
    pub async fn render_metrics(&self) -> Result<String, std::fmt::Error> {
        let read = self.inner.catalog.pool_agents();
        if let Ok(Ok(agents)) =
            tokio::time::timeout(crate::metrics::SCRAPE_CATALOG_WAIT, read).await
        {
            for st in AgentState::ALL {
                let n = agents.iter().filter(|a| a.state == st).count();
                self.inner
                    .agents
                    .get_or_create(&StateLabel { state: st.as_str() })
                    .set(n as i64);
            }
        }
        crate::metrics::encode(&self.inner.registry)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn cfg(hb_ms: u64, lease_ms: u64) -> PoolConfig {
        PoolConfig {
            heartbeat_interval: Duration::from_millis(hb_ms),
            lease_timeout: Duration::from_millis(lease_ms),
            ..PoolConfig::default()
        }
    }

    /// The default lease is shorter than the QUIC idle timeout; a longer
    /// one is accepted with a caveat naming both.
    #[test]
    fn a_lease_not_shorter_than_the_quic_idle_timeout_is_said() {
        assert!(PoolConfig::default().lease_timeout < crate::transport::IDLE_TIMEOUT);
        assert_eq!(PoolConfig::default().caveat(), None);
        let long = cfg(2_000, 10_000);
        assert_eq!(long.check(), Ok(()));
        let c = long.caveat().unwrap();
        assert!(
            c.contains("pool.lease_timeout (10s)") && c.contains("idle timeout (10s)"),
            "{c}"
        );
    }

    #[test]
    fn pool_timing_is_bounded_both_ways() {
        assert_eq!(PoolConfig::default().check(), Ok(()));
        assert_eq!(cfg(100, 1_000).check(), Ok(()));
        assert_eq!(cfg(60_000, 600_000).check(), Ok(()));
        for (bad, named) in [
            (cfg(99, 10_000), "heartbeat_interval"),
            (cfg(60_001, 600_000), "heartbeat_interval"),
            (cfg(100, 999), "lease_timeout"),
            (cfg(2_000, 5_999), "three heartbeat intervals"),
            (cfg(2_000, 600_001), "at most 10m"),
            // Far out of range: refused, no overflow.
            (
                PoolConfig {
                    heartbeat_interval: Duration::MAX,
                    lease_timeout: Duration::MAX,
                    ..PoolConfig::default()
                },
                "heartbeat_interval",
            ),
            (
                PoolConfig {
                    part_size: (1 << 20) - 1,
                    ..PoolConfig::default()
                },
                "part_size",
            ),
            (
                PoolConfig {
                    max_parts: 0,
                    ..PoolConfig::default()
                },
                "max_parts",
            ),
            (
                PoolConfig {
                    max_parts: 65,
                    ..PoolConfig::default()
                },
                "max_parts",
            ),
        ] {
            let e = bad.check().unwrap_err();
            assert!(e.contains(named), "{bad:?}: {e}");
        }
    }
}
