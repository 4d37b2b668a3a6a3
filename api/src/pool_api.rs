//! Pool routes: the site's agents as the shared catalog sees them, and
//! draining one.

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::Json;
use replicator::pool::Membership;
use serde::Serialize;

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::AppState;

/// Who acted, for the log: the token's configured name.
type By = Option<axum::Extension<Caller>>;

fn pool(s: &AppState) -> Result<&Membership, ApiError> {
    s.pool
        .as_ref()
        .ok_or_else(|| ApiError::not_found("this agent runs outside a pool"))
}

/// One agent of the pool.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct PoolAgentView {
    /// Agent name.
    name: String,
    /// `source`, `sink` or `both`.
    role: String,
    /// The ferry version it runs.
    version: String,
    /// Its REST API's base URL.
    api_url: String,
    /// `live`, `draining` (claims nothing new), `down` (no heartbeat within
    /// its lease timeout; its leases lapsed) or `stopped` (stopped
    /// cleanly, holding nothing).
    state: String,
    /// When it last started, Unix ms.
    started_at: i64,
    /// Seconds since its last heartbeat, by the catalog's clock.
    heartbeat_age_s: f64,
    /// Its lease timeout, seconds.
    lease_timeout_s: f64,
    /// Transfers it holds live leases on.
    held: i64,
    /// Bytes left to send of those transfers (as last recorded), bytes.
    held_bytes_left: i64,
    /// Source roots whose watches it holds (live leases).
    watches: i64,
    /// Payload bit/s it sent at its last heartbeat (0 once it is down or
    /// stopped).
    sent_bps: f64,
    /// Payload bit/s it received (verified) at its last heartbeat (0 once
    /// it is down or stopped).
    received_bps: f64,
}

impl From<ferry_catalog::PoolAgent> for PoolAgentView {
    fn from(a: ferry_catalog::PoolAgent) -> Self {
        // A down or stopped agent's last rates are history, not its rates.
        let up = matches!(
            a.state,
            ferry_catalog::AgentState::Live | ferry_catalog::AgentState::Draining
        );
        let rate = |r: f64| if up { r } else { 0.0 };
        PoolAgentView {
            name: a.name,
            role: a.role,
            version: a.version,
            api_url: a.api_url,
            state: a.state.as_str().to_string(),
            started_at: a.started_at,
            heartbeat_age_s: a.heartbeat_age_ms as f64 / 1000.0,
            lease_timeout_s: a.timeout_ms as f64 / 1000.0,
            held: a.held,
            held_bytes_left: a.held_bytes_left,
            watches: a.watches,
            sent_bps: rate(a.sent_bps),
            received_bps: rate(a.received_bps),
        }
    }
}

/// The pool as this agent sees it.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct PoolView {
    /// This agent's name.
    agent: String,
    /// Whether this agent's last heartbeat reached the catalog.
    catalog_up: bool,
    /// Why it did not, if it did not.
    #[serde(skip_serializing_if = "Option::is_none")]
    catalog_error: Option<String>,
    /// Heartbeat interval, seconds.
    heartbeat_interval_s: f64,
    /// Every agent that ever registered in the catalog, by name.
    agents: Vec<PoolAgentView>,
    /// Every source root a source agent of the pool is configured to
    /// watch, by path.
    watches: Vec<WatchView>,
}

/// A source root's watch: who watches it, and which agents refuse to
/// (their fingerprint of the root differs from the watching agent's).
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct WatchView {
    /// The root's path.
    root: String,
    /// The agent watching it (or that watched it last, when `live` is
    /// false); none when released.
    holder: Option<String>,
    /// Whether the holder's lease is live (by the catalog's clock).
    live: bool,
    /// The watch lease's epoch: one more at every takeover or release
    /// and claim.
    epoch: i64,
    /// Agents running now (live or draining) that recorded a fingerprint
    /// of the root, by name.
    agents: Vec<String>,
    /// Agents running now that refuse to watch the root, and why.
    refused: Vec<WatchRefusal>,
}

/// An agent that refuses to watch a root.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct WatchRefusal {
    /// Agent name.
    agent: String,
    /// Why: how its fingerprint differs.
    reason: String,
}

/// The roots' watches from the catalog's `watches` and
/// `root_fingerprints`.
fn watch_views(
    leases: Vec<ferry_catalog::WatchLease>,
    prints: Vec<ferry_catalog::RootFingerprint>,
) -> Vec<WatchView> {
    let mut roots: Vec<String> = leases
        .iter()
        .map(|w| w.root.clone())
        .chain(prints.iter().map(|f| f.root.clone()))
        .collect();
    roots.sort();
    roots.dedup();
    roots
        .into_iter()
        .map(|root| {
            let lease = leases.iter().find(|w| w.root == root);
            let mine = prints.iter().filter(|f| f.root == root);
            WatchView {
                holder: lease.and_then(|w| w.holder.clone()),
                live: lease.is_some_and(|w| w.live),
                epoch: lease.map_or(0, |w| w.epoch),
                agents: mine.clone().map(|f| f.agent.clone()).collect(),
                refused: mine
                    .filter_map(|f| {
                        f.refused.as_ref().map(|r| WatchRefusal {
                            agent: f.agent.clone(),
                            reason: r.clone(),
                        })
                    })
                    .collect(),
                root,
            }
        })
        .collect()
}

/// The site's pool: every agent sharing this agent's catalog, its state,
/// what it holds and its rates.
#[utoipa::path(
    get, path = "/v1/pool", tag = "agent",
    security(("bearer" = ["reader"])),
    responses(
        (status = 200, description = "The pool's agents, by name (none, with `catalog_up` false and `catalog_error`, while the catalog does not answer)", body = PoolView),
        (status = 401, description = "No or unknown token", body = ErrorBody),
    )
)]
pub(crate) async fn get_pool(State(s): State<AppState>) -> Result<Json<PoolView>, ApiError> {
    let p = pool(&s)?;
    let (mut catalog_up, mut catalog_error) = p.catalog_status();
    // The pool is in the catalog: without it (no answer within 3 s) the
    // answer says so, with no agents, rather than failing.
    let c = p.catalog();
    let read = async {
        let agents = c.pool_agents().await?;
        // Only agents running now speak for a root (a stopped or dead
        // agent's last refusal is history).
        let up: Vec<&str> = agents
            .iter()
            .filter(|a| {
                matches!(
                    a.state,
                    ferry_catalog::AgentState::Live | ferry_catalog::AgentState::Draining
                )
            })
            .map(|a| a.name.as_str())
            .collect();
        let prints = c
            .root_fingerprints(None)
            .await?
            .into_iter()
            .filter(|f| up.contains(&f.agent.as_str()))
            .collect();
        let watches = watch_views(c.watches().await?, prints);
        Ok::<_, ferry_catalog::CatalogError>((agents, watches))
    };
    let (agents, watches) =
        match tokio::time::timeout(std::time::Duration::from_secs(3), read).await {
            Ok(Ok(a)) => a,
            Ok(Err(e)) => {
                catalog_up = false;
                catalog_error = Some(e.to_string());
                Default::default()
            }
            Err(_) => {
                catalog_up = false;
                catalog_error = Some("no answer within 3 s".into());
                Default::default()
            }
        };
    Ok(Json(PoolView {
        agent: p.name().to_string(),
        catalog_up,
        catalog_error,
        heartbeat_interval_s: p.config().heartbeat_interval.as_secs_f64(),
        agents: agents.into_iter().map(PoolAgentView::from).collect(),
        watches,
    }))
}

async fn set_drain(
    s: &AppState,
    caller: &By,
    name: Result<Path<String>, PathRejection>,
    draining: bool,
) -> Result<Json<PoolAgentView>, ApiError> {
    let Path(name) = name?;
    let p = pool(s)?;
    let known = p
        .catalog()
        .set_agent_draining(&name, draining)
        .await
        .map_err(ApiError::catalog)?;
    if !known {
        return Err(ApiError::not_found(format!(
            "no agent {name:?} in this pool (GET /v1/pool lists them)"
        )));
    }
    tracing::info!(
        agent = name,
        draining,
        by = caller.as_ref().map_or("unknown", |c| c.0.name.as_str()),
        "{}",
        if draining {
            "agent drained: it claims nothing new and finishes what it holds"
        } else {
            "agent no longer drained"
        }
    );
    let agents = p.catalog().pool_agents().await.map_err(ApiError::catalog)?;
    agents
        .into_iter()
        .find(|a| a.name == name)
        .map(|a| Json(a.into()))
        .ok_or_else(|| ApiError::not_found(format!("no agent {name:?} in this pool")))
}

/// What `DELETE /v1/agents/{name}` answers.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct Forgotten {
    /// The agent no longer listed.
    forgotten: String,
}

/// Remove a stopped or down agent from the pool's listing (`ferry pool
/// forget`), e.g. a host taken out of service for good: its row and its
/// fingerprints of source roots go; the records of its past leases stay.
/// A live agent is refused (409): stop it first. An agent that starts
/// again under that name registers anew.
#[utoipa::path(
    delete, path = "/v1/agents/{name}", tag = "agent",
    params(("name" = String, Path, description = "Agent name")),
    security(("bearer" = ["operator"])),
    responses(
        (status = 200, description = "The agent is no longer listed", body = Forgotten),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 403, description = "The token's role is below operator", body = ErrorBody),
        (status = 404, description = "No such agent in the pool", body = ErrorBody),
        (status = 409, description = "The agent is live", body = ErrorBody),
    )
)]
pub(crate) async fn forget(
    State(s): State<AppState>,
    caller: By,
    name: Result<Path<String>, PathRejection>,
) -> Result<Json<Forgotten>, ApiError> {
    let Path(name) = name?;
    let p = pool(&s)?;
    match p
        .catalog()
        .forget_agent(&name)
        .await
        .map_err(ApiError::catalog)?
    {
        ferry_catalog::Forget::Forgotten => {
            tracing::info!(
                agent = name,
                by = caller.as_ref().map_or("unknown", |c| c.0.name.as_str()),
                "agent removed from the pool's listing"
            );
            Ok(Json(Forgotten { forgotten: name }))
        }
        ferry_catalog::Forget::Live => Err(ApiError::new(
            axum::http::StatusCode::CONFLICT,
            format!("agent {name:?} is live (it heartbeats): stop it first, then forget it"),
        )),
        ferry_catalog::Forget::NotFound => Err(ApiError::not_found(format!(
            "no agent {name:?} in this pool (GET /v1/pool lists them)"
        ))),
    }
}

/// Drain an agent of the pool: it claims no new transfer, finishes or
/// releases those it holds, and releases its watches to the other agents
/// (its state reads `draining`, and `held` and `watches` fall to 0).
/// Any agent of the pool takes the request; the drained agent sees it at
/// its next heartbeat. A drain lasts, across restarts, until undone
/// (`DELETE`).
#[utoipa::path(
    post, path = "/v1/agents/{name}/drain", tag = "agent",
    params(("name" = String, Path, description = "Agent name")),
    security(("bearer" = ["operator"])),
    responses(
        (status = 200, description = "The agent as it is now", body = PoolAgentView),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 403, description = "The token's role is below operator", body = ErrorBody),
        (status = 404, description = "No such agent in the pool", body = ErrorBody),
    )
)]
pub(crate) async fn drain(
    State(s): State<AppState>,
    caller: By,
    name: Result<Path<String>, PathRejection>,
) -> Result<Json<PoolAgentView>, ApiError> {
    set_drain(&s, &caller, name, true).await
}

/// Undo a drain: the agent claims transfers again.
#[utoipa::path(
    delete, path = "/v1/agents/{name}/drain", tag = "agent",
    params(("name" = String, Path, description = "Agent name")),
    security(("bearer" = ["operator"])),
    responses(
        (status = 200, description = "The agent as it is now", body = PoolAgentView),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 403, description = "The token's role is below operator", body = ErrorBody),
        (status = 404, description = "No such agent in the pool", body = ErrorBody),
    )
)]
pub(crate) async fn undrain(
    State(s): State<AppState>,
    caller: By,
    name: Result<Path<String>, PathRejection>,
) -> Result<Json<PoolAgentView>, ApiError> {
    set_drain(&s, &caller, name, false).await
}
