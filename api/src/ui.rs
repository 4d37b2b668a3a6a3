//! The ops web UI: one page at `/` (HTML, CSS and plain JavaScript
//! embedded at compile time from `api/ui/`), fed by `GET /v1/status` and
//! the server-sent events of `GET /v1/events` (one `status` event a
//! second). The page asks for a token and sends it as a bearer header; it
//! needs `reader` to watch and `operator` to act.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use ferry_catalog::Transfer;
use ferry_proto::state::{TransferId, TransferState};
use replicator::source::Ranking;
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use crate::error::{ApiError, ErrorBody};
use crate::model::{Replica, Signal};
use crate::source_api::{view, TransferView};
use crate::AppState;

/// The page, assembled once from its three files.
const PAGE: &str = concat!(
    include_str!("../ui/head.html"),
    "<style>\n",
    include_str!("../ui/app.css"),
    "</style>\n",
    include_str!("../ui/body.html"),
    "<script>\n",
    include_str!("../ui/app.js"),
    "</script>\n</body>\n</html>\n"
);

/// How often `/v1/events` sends a status.
pub const EVENT_INTERVAL: Duration = Duration::from_secs(1);

/// Finished transfers stay in the queue view this long, ms.
const RECENT_MS: i64 = 10 * 60 * 1000;

/// Most unfinished transfers in one status.
pub(crate) const MAX_QUEUE_ROWS: usize = 200;

/// The ops web UI (HTML). No token needed to load the page; its data
/// needs `reader`, its actions `operator`.
#[utoipa::path(
    get, path = "/", tag = "agent",
    security(()),
    responses((status = 200, description = "The ops web UI", content_type = "text/html"))
)]
pub(crate) async fn index() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        PAGE,
    )
        .into_response()
}

/// One row of the queue view.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct QueueRow {
    #[serde(flatten)]
    transfer: TransferView,
    /// Why it ranks where it does (unfinished transfers only).
    ranking: Option<Ranking>,
}

/// A published checkpoint as the source saw it.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct PublishedRow {
    /// Transfer id.
    #[schema(value_type = i64)]
    id: TransferId,
    /// Job name.
    job: String,
    /// Checkpoint path relative to its source root.
    rel: String,
    /// Bytes in the checkpoint.
    bytes_total: i64,
    /// Replica path at the sink.
    local_path: Option<String>,
    /// When the sink confirmed the publish, Unix ms (source clock).
    published_at: Option<i64>,
    /// Publish confirmation minus commit time, seconds (source clock);
    /// `null` when the commit time is unknown.
    commit_to_replica_s: Option<f64>,
    /// Where that time went (`Transfer::phases`).
    phases: Option<crate::model::PhaseTimes>,
}

/// Everything the UI shows, at one instant.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct Status {
    /// Agent name.
    agent: String,
    /// `source` and/or `sink`.
    roles: Vec<&'static str>,
    /// Server time, Unix ms.
    now_ms: i64,
    /// True if requests without a token may act (`allow_unauthenticated`).
    open: bool,
    /// Links with rate cap, utilisation and throughput per class (source);
    /// `history` is filled only when asked for.
    #[schema(value_type = Vec<Object>)]
    links: Vec<replicator::metrics::LinkStats>,
    /// Transfers per state, all of them (source).
    counts: std::collections::BTreeMap<String, i64>,
    /// Unfinished transfers (all of them, source); `transfers` shows the
    /// first 200 in rank order.
    unfinished: usize,
    /// Unfinished transfers in rank order (class, then score; at most
    /// 200), then those finished in the last 10 minutes, newest first
    /// (source).
    transfers: Vec<QueueRow>,
    /// The last 20 published checkpoints with commit-to-replica lag
    /// (source).
    published: Vec<PublishedRow>,
    /// The last 10 signals (source).
    signals: Vec<Signal>,
    /// The last 30 replicas, incoming and published, with lag (sink).
    replicas: Vec<Replica>,
    /// Every agent of the site's pool, by name (empty outside a pool or
    /// while the catalog does not answer).
    pool: Vec<crate::pool_api::PoolAgentView>,
    /// Whether this agent's last heartbeat reached the catalog.
    catalog_up: bool,
}

/// How long the status waits for the catalog (3 s) before it answers
/// with what the agent knows without it (links and rates, `catalog_up`
/// false): the UI keeps showing the agent while the catalog is down.
const STATUS_CATALOG_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// The status of `s` now; without the catalog's parts when it does not
/// answer in time (or fails while the agent's heartbeat says it is down).
pub(crate) async fn snapshot(s: &AppState, with_history: bool) -> Result<Status, ApiError> {
    let down = || {
        let mut st = empty_status(s);
        st.catalog_up = false;
        if let Some(src) = &s.source {
            st.links = src.link_stats(with_history);
        }
        st
    };
    match tokio::time::timeout(STATUS_CATALOG_WAIT, snapshot_with_catalog(s, with_history)).await {
        Ok(Ok(st)) => Ok(st),
        Ok(Err(_)) if s.pool.as_ref().is_some_and(|p| !p.catalog_status().0) => Ok(down()),
        Ok(Err(e)) => Err(e),
        Err(_) => Ok(down()),
    }
}

fn empty_status(s: &AppState) -> Status {
    Status {
        agent: s.agent.clone(),
        roles: s.roles(),
        now_ms: ferry_catalog::now_ms(),
        open: s.auth.is_open(),
        links: Vec::new(),
        counts: Default::default(),
        unfinished: 0,
        transfers: Vec::new(),
        published: Vec::new(),
        signals: Vec::new(),
        replicas: Vec::new(),
        pool: Vec::new(),
        catalog_up: true,
    }
}

async fn snapshot_with_catalog(s: &AppState, with_history: bool) -> Result<Status, ApiError> {
    let mut st = empty_status(s);
    let now = st.now_ms;
    if let Some(p) = &s.pool {
        st.catalog_up = p.catalog_status().0;
        if let Ok(agents) = p.catalog().pool_agents().await {
            st.pool = agents.into_iter().map(Into::into).collect();
        }
    }
    if let Some(src) = &s.source {
        let cat = src.catalog();
        st.links = src.link_stats(with_history);
        st.counts = cat
            .transfer_state_counts()
            .await
            .map_err(ApiError::catalog)?
            .into_iter()
            .map(|(state, n)| (state.as_str().to_string(), n))
            .collect();
        let live = cat
            .unfinished_transfers()
            .await
            .map_err(ApiError::catalog)?;
        st.unfinished = live.len();
        // One catalog read ranks them all; the best MAX_QUEUE_ROWS are shown.
        let ranks = src.rankings(&live).await.map_err(ApiError::catalog)?;
        let mut rows: Vec<_> = live.into_iter().zip(ranks).collect();
        rows.sort_by(|(a, ra), (b, rb)| {
            // Class order is urgent, scheduled, background.
            ra.class
                .cmp(&rb.class)
                .then(rb.score.value.total_cmp(&ra.score.value))
                .then(a.id.cmp(&b.id))
        });
        rows.truncate(MAX_QUEUE_ROWS);
        st.transfers = rows
            .into_iter()
            .map(|(t, r)| QueueRow {
                transfer: view(src, t),
                ranking: Some(r),
            })
            .collect();
        let recent: Vec<Transfer> = cat
            .transfers(200, 0)
            .await
            .map_err(ApiError::catalog)?
            .into_iter()
            .filter(|t| t.state.is_final())
            .collect();
        for t in &recent {
            if t.state == TransferState::Published && st.published.len() < 20 {
                st.published.push(PublishedRow {
                    id: t.id,
                    job: t.job.clone(),
                    rel: t.rel.clone(),
                    bytes_total: t.bytes_total,
                    local_path: t.local_path.clone(),
                    published_at: t.finished_at,
                    commit_to_replica_s: t
                        .finished_at
                        .zip(
                            t.committed_at
                                .or(t.format.is_none().then_some(t.created_at)),
                        )
                        .map(|(f, c)| (f - c) as f64 / 1000.0),
                    phases: crate::model::Transfer::from(t.clone()).phases,
                });
            }
        }
        st.transfers.extend(
            recent
                .into_iter()
                .filter(|t| t.finished_at.is_some_and(|f| now - f < RECENT_MS))
                .map(|t| QueueRow {
                    transfer: view(src, t),
                    ranking: None,
                }),
        );
        st.signals = cat
            .recent_signals(10)
            .await
            .map_err(ApiError::catalog)?
            .into_iter()
            .map(Signal::from)
            .collect();
    }
    if let Some(sink) = &s.sink {
        st.replicas = sink
            .catalog()
            .replicas(false, 30, 0)
            .await
            .map_err(ApiError::catalog)?
            .into_iter()
            .map(Replica::from)
            .collect();
    }
    Ok(st)
}

/// Query of `GET /v1/status`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct StatusQuery {
    /// Include each link's per-class throughput of the last 10 minutes
    /// (one point a second).
    history: Option<bool>,
}

/// What the UI shows: links, the queue in rank order with progress, rate
/// and score terms, recent signals, published replicas with lag.
#[utoipa::path(
    get, path = "/v1/status", tag = "agent",
    params(StatusQuery),
    security(("bearer" = ["reader"])),
    responses(
        (status = 200, description = "The agent's status now", body = Status),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 422, description = "`history` is not true or false", body = ErrorBody),
    )
)]
pub(crate) async fn status(
    State(s): State<AppState>,
    q: Result<Query<StatusQuery>, QueryRejection>,
) -> Result<Json<Status>, ApiError> {
    let Query(q) = q?;
    Ok(Json(snapshot(&s, q.history.unwrap_or(false)).await?))
}

/// Most live streams (`/v1/events` and `/v1/replicas/events` together)
/// open at once; more get 503.
pub const MAX_EVENT_STREAMS: usize = 32;

/// State shared by every live view of one agent: the newest status as
/// sent (computed at most once per [`EVENT_INTERVAL`] whatever the number
/// of viewers) and the stream slots.
#[derive(Debug)]
pub(crate) struct Live {
    newest: tokio::sync::Mutex<Option<(tokio::time::Instant, Event)>>,
    /// Slots of the live streams (`/v1/events`, `/v1/replicas/events`).
    pub(crate) slots: Arc<Semaphore>,
}

impl Default for Live {
    fn default() -> Self {
        Live {
            newest: tokio::sync::Mutex::new(None),
            slots: Arc::new(Semaphore::new(MAX_EVENT_STREAMS)),
        }
    }
}

/// The newest `status` event, computed again if older than most of an
/// interval; one viewer computes while the others wait for its result.
async fn newest_event(s: &AppState) -> Event {
    let mut newest = s.live.newest.lock().await;
    let fresh = EVENT_INTERVAL.mul_f64(0.9);
    if let Some((at, ev)) = newest.as_ref() {
        if at.elapsed() < fresh {
            return ev.clone();
        }
    }
    let ev = match snapshot(s, false).await {
        Ok(st) => Event::default().event("status").json_data(st),
        Err(e) => Event::default().event("error").json_data(ErrorBody {
            error: e.message.clone(),
        }),
    }
    .unwrap_or_else(|_| Event::default().event("error").data("encoding"));
    *newest = Some((tokio::time::Instant::now(), ev.clone()));
    ev
}

/// Server-sent events: a `status` event (the body of `GET /v1/status`
/// without history) at once and then every second, until the client
/// goes away. At most 32 streams at once (503 beyond).
#[utoipa::path(
    get, path = "/v1/events", tag = "agent",
    security(("bearer" = ["reader"])),
    responses(
        (status = 200, description = "text/event-stream of `status` events", content_type = "text/event-stream"),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 503, description = "32 live views are open already", body = ErrorBody),
    )
)]
pub(crate) async fn events(State(s): State<AppState>) -> Response {
    let Ok(slot) = s.live.slots.clone().try_acquire_owned() else {
        return ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{MAX_EVENT_STREAMS} live views (GET /v1/events) are open already; close one or poll GET /v1/status"),
        )
        .into_response();
    };
    let mut tick = tokio::time::interval(EVENT_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let stream = futures::stream::unfold((s, tick, slot), |(s, mut tick, slot)| async move {
        tick.tick().await;
        let ev = newest_event(&s).await;
        Some((Ok::<_, Infallible>(ev), (s, tick, slot)))
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}
