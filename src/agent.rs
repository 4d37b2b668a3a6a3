//! Starting and stopping one agent (`ferry serve`, and both demo agents):
//! catalog, QUIC endpoint, source and/or sink role, REST API.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use ferry_catalog::Catalog;
use replicator::sink::{Sink, SinkConfig};
use replicator::source::{LinkConfig, RootConfig, Source, SourceConfig};
use replicator::tls::{self, AgentIdentity};
use replicator::transport::{self, SocketFactory, SocketKind, Tuning};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, Role};

/// A running agent.
#[derive(Debug)]
pub struct Agent {
    /// Agent name.
    pub name: String,
    /// Bound API address.
    pub api_addr: SocketAddr,
    /// The API's base URL: `https://ADDR` with `[api] tls_cert`,
    /// `http://ADDR` otherwise (no trailing slash).
    pub api_url: String,
    /// Bound QUIC address.
    pub quic_addr: SocketAddr,
    /// Source role.
    pub source: Option<Source>,
    /// Sink role.
    pub sink: Option<Sink>,
    /// Membership of the site's pool.
    pub pool: replicator::pool::Membership,
    catalog: Catalog,
    stop_pool: CancellationToken,
    pool_task: tokio::task::JoinHandle<()>,
    stop_api: CancellationToken,
    api_task: tokio::task::JoinHandle<()>,
}

/// Overrides used by the demo and tests: a given UDP socket (an in-memory
/// emulated link) instead of binding `quic.listen`.
#[derive(Debug, Default)]
pub struct Overrides {
    /// Socket for the QUIC endpoint.
    pub socket: Option<Arc<dyn quinn::AsyncUdpSocket>>,
    /// Sockets of a link's further connections (with `socket`; without
    /// it, each is a UDP socket on the address family of `quic.listen`,
    /// any port). `None` with `socket`: every connection on `socket`.
    pub sockets: Option<SocketFactory>,
    /// The value of `FERRY_CATALOG_URL` to apply over `[catalog] url`:
    /// `ferry serve` passes the environment's, `ferry demo` none (its
    /// agents always keep their catalogs in their own data directories).
    pub catalog_url_env: Option<String>,
}

/// Starts an agent from `cfg`.
///
/// # Errors
/// Anything that prevents the agent from serving: TLS files, data
/// directory, bind failures; each names what failed.
pub async fn start(cfg: &Config, ov: Overrides) -> Result<Agent> {
    let id = AgentIdentity::load(&cfg.tls.ca, &cfg.tls.cert, &cfg.tls.key).context("[tls]")?;
    if id.name() != cfg.agent.name {
        anyhow::bail!(
            "agent.name is {:?} but the certificate {} is for {:?}",
            cfg.agent.name,
            cfg.tls.cert.display(),
            id.name()
        );
    }
    let catalog = match cfg.catalog_url(ov.catalog_url_env.as_deref())? {
        Some(url) => {
            tracing::info!(catalog = %url, site = %cfg.agent.site, "catalog in PostgreSQL");
            open_postgres_waiting(&url, &cfg.agent.site).await?
        }
        None => Catalog::open(&cfg.agent.data_dir).await?,
    };
    let is_sink = matches!(cfg.agent.role, Role::Sink | Role::Both);
    let is_source = matches!(cfg.agent.role, Role::Source | Role::Both);
    let role = match cfg.agent.role {
        Role::Source => "source",
        Role::Sink => "sink",
        Role::Both => "both",
    };
    let pool = replicator::pool::Membership::new(
        catalog.clone(),
        cfg.pool.config(),
        &cfg.agent.name,
        role,
    );

    let server = if is_sink {
        let mut sc = quinn::ServerConfig::with_crypto(tls::server_crypto(&id)?);
        let tuning = Tuning {
            rate_bps: cfg.quic.max_link_rate,
            rtt: cfg.quic.max_rtt,
        };
        sc.transport_config(Arc::new(transport::transport_config(tuning, None, 1)));
        Some(sc)
    } else {
        None
    };
    let (socket, sockets) = match ov.socket {
        Some(s) => (SocketKind::Memory(s), ov.sockets),
        None => {
            let default = if is_sink { "0.0.0.0:7443" } else { "0.0.0.0:0" };
            let listen = cfg.quic.listen.unwrap_or_else(|| {
                default
                    .parse()
                    .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)))
            });
            // Further connections of a link: the same address, any port.
            let mut extra = listen;
            extra.set_port(0);
            (SocketKind::Udp(listen), Some(SocketFactory::Udp(extra)))
        }
    };
    let endpoint = transport::endpoint_with_reset_key(socket, server, Some(id.reset_key()))
        .context("[quic] listen")?;
    let quic_addr = endpoint.local_addr()?;

    let sink = match (&cfg.sink, is_sink) {
        (Some(s), true) => Some(
            Sink::start(
                SinkConfig {
                    agent: cfg.agent.name.clone(),
                    site: cfg.agent.site.clone(),
                    root: s.root.clone(),
                    storage: s.storage()?,
                    accept_peers: s.accept_peers.clone(),
                    reserve_bytes: s.reserve,
                    reread_before_publish: s.reread_before_publish,
                    retention: s
                        .retention
                        .iter()
                        .enumerate()
                        .map(|(i, r)| {
                            let p = r
                                .policy()
                                .map_err(|e| anyhow::anyhow!("sink.retention[{i}]: {e}"))?;
                            if p.keeps_everything() {
                                tracing::warn!(
                                    policy = p.describe(),
                                    "sink.retention[{i}] sets neither keep_last nor max_bytes: \
                                     keep_every and min_age alone keep every replica of its jobs"
                                );
                            }
                            Ok(p)
                        })
                        .collect::<anyhow::Result<_>>()?,
                    retention_interval: s.retention_interval,
                    pressure: s.pressure()?,
                    pool: Some(pool.clone()),
                },
                catalog.clone(),
                endpoint.clone(),
            )
            .context("[sink]")?,
        ),
        _ => None,
    };
    let source = match (&cfg.source, is_source) {
        (Some(s), true) => {
            let mut links = Vec::new();
            for l in &cfg.links {
                links.push(LinkConfig {
                    name: l.name.clone(),
                    peer: l.peer.clone(),
                    peer_name: l.peer_name.clone(),
                    more_peers: l.more_peers(),
                    rate_bps: l.rate,
                    rtt: l.rtt_hint,
                    connections: l.connections(),
                });
            }
            let mut roots = Vec::new();
            let mut remotes = Vec::new();
            for (i, r) in s.roots.iter().enumerate() {
                if replicator::storage::router::is_url(&r.path) {
                    let url = r.path.to_string_lossy().trim_end_matches('/').to_string();
                    let s3 = s.s3.clone().unwrap_or_default().config("source.s3", None)?;
                    let opened = tokio::task::spawn_blocking(move || {
                        replicator::storage::router::open_remote(&url, &s3)
                    })
                    .await?
                    .with_context(|| format!("source.roots[{i}].path"))?;
                    remotes.push(opened);
                }
                roots.push(RootConfig {
                    path: std::fs::canonicalize(&r.path).unwrap_or_else(|_| r.path.clone()),
                    job: r.job.clone(),
                    link: r.link.clone(),
                    watch: r.watch(i)?,
                });
            }
            // Jobs from the config file: on a single agent's SQLite
            // catalog, jobs set through the API keep their values (see
            // `Catalog::sync_config_jobs`); in a pool the catalog's jobs
            // win and the config only adds missing ones.
            let jobs: Vec<(String, Option<f64>, f64)> = cfg
                .jobs
                .iter()
                .map(|j| {
                    let p = (j.model_params > 0.0).then_some(j.model_params);
                    (j.name.clone(), p, j.importance)
                })
                .collect();
            let mut policy = cfg.scheduler.policy()?;
            if catalog.dialect() == ferry_catalog::dialect::Dialect::Postgres {
                // A pool: the catalog's settings win; the config seeds
                // those it lacks (replicator::settings::adopt).
                let mut rates: Vec<(String, u64)> =
                    links.iter().map(|l| (l.name.clone(), l.rate_bps)).collect();
                let (shared, _) = replicator::settings::adopt(
                    &catalog,
                    &cfg.agent.name,
                    &policy,
                    &mut rates,
                    &jobs,
                )
                .await
                .context("the pool's shared settings ([scheduler], [[links]] rate, [[jobs]])")?;
                policy = shared;
                for (l, (_, bps)) in links.iter_mut().zip(&rates) {
                    l.rate_bps = *bps;
                }
            } else {
                catalog
                    .sync_config_jobs(&jobs)
                    .await
                    .context("storing [[jobs]] in the catalog")?;
            }
            let sc = SourceConfig {
                agent: cfg.agent.name.clone(),
                site: cfg.agent.site.clone(),
                chunk_size: s.chunk_size as u32,
                markers: s.markers.clone(),
                roots,
                remotes,
                links,
                streams: s.streams,
                batch_bytes: s.batch_size,
                scan_interval: (!s.scan_interval.is_zero()).then_some(s.scan_interval),
                quiet_period: s.quiet_period,
                checkpoint_idle_timeout: s.checkpoint_idle_timeout,
                policy,
                pins: replicator::source::pins::SignalPins {
                    kinds: s.pin_on.clone(),
                    pin_for: s.pin_for,
                },
                pool: Some(pool.clone()),
            };
            // On a single agent, a rate cap set through the API lasts
            // until a restart: the configured one holds again, and the
            // recorded history (`GET /v1/trace`) says so. In a pool the
            // caps are the catalog's (recorded when they differ from the
            // last recorded one).
            let rates: Vec<(String, u64)> = sc
                .links
                .iter()
                .map(|l| (l.name.clone(), l.rate_bps))
                .collect();
            catalog
                .sync_config_link_rates(&rates)
                .await
                .context("recording the [[links]] rate caps in the catalog")?;
            tracing::info!(
                policy = sc.policy.kind.as_str(),
                max_active = sc.policy.max_active,
                "scheduler"
            );
            Some(Source::start_with_sockets(
                sc,
                catalog.clone(),
                endpoint.clone(),
                sockets,
                &id,
            )?)
        }
        _ => None,
    };

    cfg.api.check_transport()?;
    let api_tls = match cfg.api.tls()? {
        Some((cert, key)) => Some(Arc::new(
            tls::api_server_config(cert, key).context("[api] tls_cert, tls_key")?,
        )),
        None => None,
    };
    let listener = TcpListener::bind(cfg.api.listen)
        .await
        .with_context(|| format!("[api] listen {}", cfg.api.listen))?;
    let api_addr = listener.local_addr()?;
    let api_url = api_url(api_addr, api_tls.is_some());
    if api_tls.is_some() {
        tracing::info!("API and web UI at {api_url} (HTTPS only)");
    } else if api_addr.ip().is_loopback() {
        tracing::info!(
            "API and web UI at {api_url} (plain HTTP on loopback only: reachable from this host; set [api] tls_cert and tls_key for HTTPS)"
        );
    } else {
        tracing::warn!(
            "API and web UI at {api_url} (plain HTTP on a non-loopback address because [api] allow_plaintext = true: tokens and answers cross the network unencrypted)"
        );
    }
    if let Some(c) = cfg.pool.config().caveat() {
        tracing::warn!("{c}");
    }
    let auth = cfg.api.auth()?;
    if auth.is_open() {
        tracing::warn!(
            "[api] allow_unauthenticated = true: requests without a token may do anything"
        );
    } else if cfg.api.tokens.is_empty() {
        tracing::warn!("[api] has no tokens: every request but /, /healthz and /openapi.json will get 401 (make one with `ferry token new --role operator`)");
    }
    pool.set_api_url(&api_url);
    {
        let (source, sink) = (source.clone(), sink.clone());
        pool.set_rates(Box::new(move || {
            let sent = source.as_ref().map_or(0.0, |s| {
                s.link_stats(false).iter().map(|l| l.goodput_bps).sum()
            });
            let received = sink.as_ref().map_or(0.0, |s| s.received_bps());
            (sent, received)
        }));
    }
    let stop_pool = CancellationToken::new();
    let pool_task = tokio::spawn(pool.clone().run(stop_pool.clone()));
    if let (Some(sk), Some(s)) = (&sink, &cfg.sink) {
        let hooks = s
            .webhooks
            .iter()
            .enumerate()
            .map(|(i, w)| {
                w.webhook()
                    .map_err(|e| anyhow::anyhow!("sink.webhooks[{i}]: {e}"))
            })
            .collect::<Result<Vec<_>>>()?;
        crate::webhooks::spawn(sk.clone(), hooks, stop_pool.clone());
    }
    let router = api::router(
        api::AppState::new(cfg.agent.name.clone(), source.clone(), sink.clone(), auth)
            .with_pool(pool.clone()),
    );
    let stop_api = CancellationToken::new();
    let stop = stop_api.clone();
    let api_task = crate::apiserve::spawn(
        listener.into_std()?,
        api_tls,
        cfg.api.max_connections,
        router,
        stop,
    )
    .context("[api] listen")?;
    let pooled = catalog.dialect() == ferry_catalog::dialect::Dialect::Postgres;
    for j in &cfg.jobs {
        tracing::info!(
            job = j.name,
            model_params = j.model_params,
            importance = j.importance,
            "{}",
            if pooled {
                "job in the config file (the pool's catalog's values take precedence)"
            } else {
                "job in the config file (values set through PUT /v1/jobs take precedence)"
            }
        );
    }
    tracing::info!(agent = cfg.agent.name, %api_addr, %quic_addr, "agent started");
    Ok(Agent {
        name: cfg.agent.name.clone(),
        api_addr,
        api_url,
        quic_addr,
        source,
        sink,
        pool,
        catalog,
        stop_pool,
        pool_task,
        stop_api,
        api_task,
    })
}

/// How long an agent waits at start for a PostgreSQL catalog whose
/// server does not answer (it may be starting with the host), retrying
/// every 2 s: 2 minutes. A server that answers with a refusal (login,
/// database, site, schema) fails at once.
pub const CATALOG_START_WAIT: Duration = Duration::from_secs(120);

/// Opens the PostgreSQL catalog, waiting up to [`CATALOG_START_WAIT`]
/// for a server that does not answer yet.
async fn open_postgres_waiting(
    url: &ferry_catalog::PostgresUrl,
    site: &str,
) -> Result<Catalog, ferry_catalog::CatalogError> {
    let until = std::time::Instant::now() + CATALOG_START_WAIT;
    let mut said = false;
    loop {
        match Catalog::open_postgres(url, site).await {
            Err(e @ ferry_catalog::CatalogError::Unreachable { .. })
                if std::time::Instant::now() < until =>
            {
                if !said {
                    tracing::warn!(
                        "{e}; retrying every 2 s for up to {}",
                        humantime::format_duration(CATALOG_START_WAIT)
                    );
                    said = true;
                }
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            r => return r,
        }
    }
}

/// `https://ADDR` or `http://ADDR` (IPv6 in brackets).
fn api_url(addr: SocketAddr, tls: bool) -> String {
    let scheme = if tls { "https" } else { "http" };
    format!("{scheme}://{addr}")
}

impl Agent {
    /// Drains: sources end batches at a chunk boundary, sinks finish
    /// in-flight chunk writes and flush the catalog; the API stops; all
    /// within `deadline`.
    pub async fn stop(self, deadline: Duration) {
        let half = deadline / 2;
        if let Some(s) = &self.source {
            s.shutdown(half).await;
        }
        if let Some(s) = &self.sink {
            s.shutdown(half).await;
        }
        // Recorded stopped in the catalog, its leases released.
        self.stop_pool.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(2), self.pool_task).await;
        self.stop_api.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(1), self.api_task).await;
        self.catalog.close().await;
    }
}
