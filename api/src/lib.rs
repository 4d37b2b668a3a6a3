//! Ferry's REST API (axum): resolve and replicas on sinks, transfers on
//! sources, health everywhere. Errors are JSON objects
//! `{"error": "<message naming the problem>"}`.
//!
//! Routes:
//! - `GET /healthz`: `{"status": "ok", "agent", "roles"}`
//! - `GET /v1/resolve?path=SOURCE_PATH[&wait=30s]` (sink): a
//!   [`replicator::sink::Resolution`]; `wait` long-polls (at most 300 s)
//!   until the path is local.
//! - `GET /v1/replicas[?limit=&offset=]` (sink): replicas, newest first.
//! - `POST /v1/transfers` `{"path": "...", "link": "..."}` (source): queue
//!   a transfer; answers 201 with the transfer.
//! - `GET /v1/transfers[?limit=&offset=]`, `GET /v1/transfers/{id}`
//!   (source): transfers with live progress; one transfer also has its
//!   `ranking` (class, score term by term, share of the link).
//! - `POST /v1/transfers/{id}/pause|resume|cancel`, `PATCH
//!   /v1/transfers/{id}` `{"class"?, "importance"?}` (source): operator
//!   control; 409 when the transfer's state does not allow it.
//! - `GET /v1/jobs`, `PUT /v1/jobs/{job}` `{"model_params"?, "importance"}`
//!   (source): jobs as the scheduler ranks them (`model_params` absent
//!   keeps the size, `null` makes it unknown).
//! - `GET /v1/links`, `PUT /v1/links/{link}` `{"rate_bps"}` (source): a
//!   link's rate cap, changed live until the agent restarts (then the
//!   config's `rate` holds again).
//! - `POST /v1/signals` `{"job", "kind", "severity", "step"?,
//!   "idempotency_key"?}`, `GET /v1/signals[?limit=]` (source): anomaly
//!   signals from training controllers; 404 for an unknown job.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use replicator::catalog::Transfer;
use replicator::sink::{Resolution, Sink};
use replicator::source::{OpsError, Progress, Source, SubmitError};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tower_http::timeout::TimeoutLayer;

mod metrics;

/// Largest request body accepted, in bytes (64 KiB).
pub const MAX_BODY: usize = 64 << 10;

/// Longest `wait` honoured by resolve.
pub const MAX_WAIT: Duration = Duration::from_secs(300);

/// What the handlers can reach.
#[derive(Debug, Clone)]
pub struct AppState {
    /// This agent's name.
    pub agent: String,
    /// The source role, if this agent has it.
    pub source: Option<Source>,
    /// The sink role, if this agent has it.
    pub sink: Option<Sink>,
}

/// An error answer: status code and a message naming the problem.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
        }
    }
    fn unprocessable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, message)
    }
    fn internal(e: impl std::fmt::Display) -> Self {
        tracing::error!(error = %e, "internal error");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal error; see the agent's log",
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(json!({ "error": self.message }))).into_response()
    }
}

impl From<QueryRejection> for ApiError {
    fn from(r: QueryRejection) -> Self {
        ApiError::unprocessable(r.body_text())
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        let status = match r.status() {
            StatusCode::PAYLOAD_TOO_LARGE => StatusCode::PAYLOAD_TOO_LARGE,
            StatusCode::UNSUPPORTED_MEDIA_TYPE => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            _ => StatusCode::UNPROCESSABLE_ENTITY,
        };
        ApiError::new(status, r.body_text())
    }
}

/// Builds the router for `state`.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/v1/resolve", get(resolve))
        .route("/v1/replicas", get(replicas))
        .route("/v1/transfers", get(list_transfers).post(create_transfer))
        .route(
            "/v1/transfers/{id}",
            get(get_transfer).patch(patch_transfer),
        )
        .route("/v1/transfers/{id}/{action}", post(transfer_action))
        .route("/v1/jobs", get(list_jobs))
        .route("/v1/jobs/{job}", put(put_job))
        .route("/v1/links", get(list_links))
        .route("/v1/links/{link}", put(put_link))
        .route("/v1/signals", get(list_signals).post(post_signal))
        .route("/v1/checkpoints/announce", post(announce))
        .route("/metrics", get(metrics::handler))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such route") })
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            MAX_WAIT + Duration::from_secs(30),
        ))
        .with_state(state)
}

async fn healthz(State(s): State<AppState>) -> Json<serde_json::Value> {
    let mut roles = Vec::new();
    if s.source.is_some() {
        roles.push("source");
    }
    if s.sink.is_some() {
        roles.push("sink");
    }
    Json(json!({ "status": "ok", "agent": s.agent, "roles": roles }))
}

fn sink(s: &AppState) -> Result<&Sink, ApiError> {
    s.sink.as_ref().ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "this agent is not a sink; ask the sink agent",
        )
    })
}

fn source(s: &AppState) -> Result<&Source, ApiError> {
    s.source.as_ref().ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "this agent is not a source; ask the source agent",
        )
    })
}

#[derive(Debug, Deserialize)]
struct ResolveQuery {
    path: Option<String>,
    wait: Option<String>,
}

async fn resolve(
    State(s): State<AppState>,
    q: Result<Query<ResolveQuery>, QueryRejection>,
) -> Result<Json<Resolution>, ApiError> {
    let Query(q) = q?;
    let sink = sink(&s)?;
    let path = q
        .path
        .filter(|p| !p.is_empty())
        .ok_or_else(|| ApiError::unprocessable("query parameter `path` is required"))?;
    if replicator::sink::normalize_source_path(&path).is_none() {
        return Err(ApiError::unprocessable(
            "`path` must be an absolute source path without `..` components",
        ));
    }
    let wait = match q.wait.as_deref() {
        None | Some("") => Duration::ZERO,
        Some(w) => humantime::parse_duration(w)
            .map_err(|e| {
                ApiError::unprocessable(format!("`wait` {w:?} is not a duration like 30s: {e}"))
            })?
            .min(MAX_WAIT),
    };
    let deadline = Instant::now() + wait;
    let mut changes = sink.changes();
    loop {
        let r = sink.resolve(&path).await.map_err(ApiError::internal)?;
        if matches!(r, Resolution::Local { .. }) || Instant::now() >= deadline {
            return Ok(Json(r));
        }
        let _ = tokio::time::timeout_at(deadline.into(), changes.changed()).await;
    }
}

#[derive(Debug, Deserialize)]
struct Page {
    limit: Option<i64>,
    offset: Option<i64>,
}

impl Page {
    fn get(&self) -> Result<(i64, i64), ApiError> {
        let limit = self.limit.unwrap_or(100);
        let offset = self.offset.unwrap_or(0);
        if !(1..=1000).contains(&limit) {
            return Err(ApiError::unprocessable(
                "`limit` must be between 1 and 1000",
            ));
        }
        if offset < 0 {
            return Err(ApiError::unprocessable("`offset` must not be negative"));
        }
        Ok((limit, offset))
    }
}

async fn replicas(
    State(s): State<AppState>,
    p: Result<Query<Page>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(p) = p?;
    let (limit, offset) = p.get()?;
    let rows = sink(&s)?
        .catalog()
        .replicas(false, limit, offset)
        .await
        .map_err(ApiError::internal)?;
    Ok(Json(json!({ "items": rows, "limit": limit, "offset": offset })).into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateTransfer {
    path: String,
    link: Option<String>,
    /// `scheduled` (default), `background` or `urgent`.
    class: Option<String>,
}

/// A transfer with its live progress, as the API shows it.
#[derive(Debug, Serialize)]
struct TransferView {
    #[serde(flatten)]
    transfer: Transfer,
    progress: Option<Progress>,
}

/// A transfer with live progress; while it runs, `bytes_sent` is the
/// live count (the catalog's is updated at the end of each send round).
fn view(src: &Source, mut t: Transfer) -> TransferView {
    let progress = src.progress(t.id);
    if let Some(p) = &progress {
        t.bytes_sent = t.bytes_sent.max(p.bytes_sent as i64);
    }
    TransferView {
        transfer: t,
        progress,
    }
}

async fn create_transfer(
    State(s): State<AppState>,
    body: Result<Json<CreateTransfer>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    let src = source(&s)?;
    if !req.path.starts_with('/') {
        return Err(ApiError::unprocessable(
            "`path` must be an absolute path at the source",
        ));
    }
    let class = match req.class.as_deref() {
        None => scheduler::Class::Scheduled,
        Some(c) => c
            .parse()
            .map_err(|e| ApiError::unprocessable(format!("`class`: {e}")))?,
    };
    let t = src
        .submit_as(&PathBuf::from(&req.path), req.link.as_deref(), class)
        .await
        .map_err(submit_error)?;
    Ok((
        StatusCode::CREATED,
        Json(TransferView {
            transfer: t,
            progress: None,
        }),
    )
        .into_response())
}

/// A refused submission or announcement as a 422 naming the field (or a
/// 500 for the catalog).
fn submit_error(e: SubmitError) -> ApiError {
    match e {
        SubmitError::BadPath(m) => ApiError::unprocessable(format!("`path`: {m}")),
        SubmitError::BadJob(m) => ApiError::unprocessable(format!("`job`: {m}")),
        SubmitError::UnknownLink(l) => {
            ApiError::unprocessable(format!("`link`: unknown link {l:?}"))
        }
        SubmitError::Catalog(e) => ApiError::internal(e),
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Announce {
    job: String,
    step: u64,
    path: String,
    #[serde(default)]
    expected_bytes: u64,
}

/// `POST /v1/checkpoints/announce`: a training controller says a
/// checkpoint is coming; the transfer is queued before the first byte.
async fn announce(
    State(s): State<AppState>,
    body: Result<Json<Announce>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    let src = source(&s)?;
    if !req.path.starts_with('/') {
        return Err(ApiError::unprocessable(
            "`path` must be an absolute path at the source",
        ));
    }
    if req.job.is_empty() {
        return Err(ApiError::unprocessable("`job` must not be empty"));
    }
    let t = src
        .announce(
            &req.job,
            req.step,
            &PathBuf::from(&req.path),
            req.expected_bytes,
        )
        .await
        .map_err(submit_error)?;
    Ok(match t {
        Some(t) => (
            StatusCode::CREATED,
            Json(json!({ "selected": true, "transfer": view(src, t) })),
        )
            .into_response(),
        None => Json(json!({
            "selected": false,
            "reason": format!("step {} is not selected by the root's every_n_steps", req.step),
        }))
        .into_response(),
    })
}

async fn list_transfers(
    State(s): State<AppState>,
    p: Result<Query<Page>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(p) = p?;
    let (limit, offset) = p.get()?;
    let src = source(&s)?;
    let rows = src
        .catalog()
        .transfers(limit, offset)
        .await
        .map_err(ApiError::internal)?;
    let items: Vec<_> = rows.into_iter().map(|t| view(src, t)).collect();
    Ok(Json(json!({ "items": items, "limit": limit, "offset": offset })).into_response())
}

fn transfer_id(id: &str) -> Result<i64, ApiError> {
    id.parse()
        .map_err(|_| ApiError::unprocessable(format!("transfer id {id:?} is not a number")))
}

async fn get_transfer(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = transfer_id(&id)?;
    let src = source(&s)?;
    let t = src
        .catalog()
        .transfer(id)
        .await
        .map_err(ApiError::internal)?
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("no transfer {id}")))?;
    let ranking = src.ranking(&t).await.map_err(ApiError::internal)?;
    let mut v = serde_json::to_value(view(src, t)).map_err(ApiError::internal)?;
    v["ranking"] = serde_json::to_value(ranking).map_err(ApiError::internal)?;
    Ok(Json(v).into_response())
}

/// An operator or controller request refused by the source, as 404, 409
/// or 422 naming the field.
fn ops_error(e: OpsError) -> ApiError {
    match e {
        OpsError::UnknownJob(_) | OpsError::UnknownTransfer(_) => {
            ApiError::new(StatusCode::NOT_FOUND, e.to_string())
        }
        OpsError::Invalid(m) => ApiError::unprocessable(m),
        OpsError::Conflict(m) => ApiError::new(StatusCode::CONFLICT, m),
        OpsError::Catalog(e) => ApiError::internal(e),
    }
}

/// `POST /v1/transfers/{id}/{pause|resume|cancel}`.
async fn transfer_action(
    State(s): State<AppState>,
    Path((id, action)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let id = transfer_id(&id)?;
    let src = source(&s)?;
    let t = match action.as_str() {
        "pause" => src.pause(id).await,
        "resume" => src.resume(id).await,
        "cancel" => src.cancel(id).await,
        other => {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                format!("no action {other:?} (expected pause, resume or cancel)"),
            ))
        }
    }
    .map_err(ops_error)?;
    Ok(Json(view(src, t)).into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PatchTransfer {
    class: Option<String>,
    /// A number 0..1, or `null` to return to the job's importance.
    #[serde(default, deserialize_with = "some_or_null")]
    importance: Option<Option<f64>>,
}

/// Tells an absent field (`None`) from an explicit `null` (`Some(None)`).
fn some_or_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Option<f64>>, D::Error> {
    Option::<f64>::deserialize(d).map(Some)
}

/// `PATCH /v1/transfers/{id}`: set class and/or importance.
async fn patch_transfer(
    State(s): State<AppState>,
    Path(id): Path<String>,
    body: Result<Json<PatchTransfer>, JsonRejection>,
) -> Result<Response, ApiError> {
    let id = transfer_id(&id)?;
    let Json(req) = body?;
    if req.class.is_none() && req.importance.is_none() {
        return Err(ApiError::unprocessable(
            "nothing to change: give `class` and/or `importance`",
        ));
    }
    let src = source(&s)?;
    let t = src
        .reprioritise(id, req.class.as_deref(), req.importance)
        .await
        .map_err(ops_error)?;
    Ok(Json(view(src, t)).into_response())
}

async fn list_jobs(State(s): State<AppState>) -> Result<Response, ApiError> {
    let src = source(&s)?;
    let jobs = src.catalog().jobs().await.map_err(ApiError::internal)?;
    Ok(Json(json!({ "items": jobs })).into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PutJob {
    /// Absent: unchanged; `null` or 0: unknown.
    #[serde(default, deserialize_with = "some_or_null")]
    model_params: Option<Option<f64>>,
    importance: f64,
}

/// `PUT /v1/jobs/{job}`: a job's model size and importance.
async fn put_job(
    State(s): State<AppState>,
    Path(job): Path<String>,
    body: Result<Json<PutJob>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    let src = source(&s)?;
    let j = src
        .put_job(&job, req.model_params, req.importance)
        .await
        .map_err(ops_error)?;
    Ok(Json(j).into_response())
}

fn link_view(src: &Source, name: &str) -> serde_json::Value {
    json!({ "name": name, "rate_bps": src.link_rate(name) })
}

async fn list_links(State(s): State<AppState>) -> Result<Response, ApiError> {
    let src = source(&s)?;
    let mut names = src.links();
    names.sort();
    let items: Vec<_> = names.iter().map(|n| link_view(src, n)).collect();
    Ok(Json(json!({ "items": items })).into_response())
}

/// Smallest and largest rate cap accepted, bit/s.
pub const RATE_BOUNDS: (u64, u64) = (1_000, 1_000_000_000_000);

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PutLink {
    rate_bps: u64,
}

/// `PUT /v1/links/{link}`: change the rate cap live.
async fn put_link(
    State(s): State<AppState>,
    Path(link): Path<String>,
    body: Result<Json<PutLink>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    let src = source(&s)?;
    if !(RATE_BOUNDS.0..=RATE_BOUNDS.1).contains(&req.rate_bps) {
        return Err(ApiError::unprocessable(format!(
            "`rate_bps` must be from {} to {} bit/s, got {}",
            RATE_BOUNDS.0, RATE_BOUNDS.1, req.rate_bps
        )));
    }
    if !src.set_link_rate(&link, req.rate_bps) {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("unknown link {link:?}"),
        ));
    }
    tracing::info!(link, rate_bps = req.rate_bps, "link rate cap changed");
    Ok(Json(link_view(src, &link)).into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PostSignal {
    job: String,
    kind: String,
    severity: f64,
    step: Option<i64>,
    idempotency_key: Option<String>,
}

/// `POST /v1/signals`: 201 with what the signal did (200 when the
/// idempotency key was seen before).
async fn post_signal(
    State(s): State<AppState>,
    body: Result<Json<PostSignal>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    let src = source(&s)?;
    if let Some(k) = &req.idempotency_key {
        if k.is_empty() || k.len() > 200 {
            return Err(ApiError::unprocessable(
                "`idempotency_key` must be 1 to 200 bytes",
            ));
        }
    }
    let out = src
        .signal(
            &req.job,
            &req.kind,
            req.severity,
            req.step,
            req.idempotency_key.as_deref(),
        )
        .await
        .map_err(ops_error)?;
    let status = if out.new {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(out)).into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SignalQuery {
    limit: Option<i64>,
}

async fn list_signals(
    State(s): State<AppState>,
    q: Result<Query<SignalQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) = q?;
    let limit = q.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::unprocessable("`limit` must be from 1 to 1000"));
    }
    let src = source(&s)?;
    let items = src
        .catalog()
        .recent_signals(limit)
        .await
        .map_err(ApiError::internal)?;
    Ok(Json(json!({ "items": items })).into_response())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use replicator::catalog::Catalog;
    use replicator::sink::SinkConfig;
    use replicator::source::{LinkConfig, RootConfig, SourceConfig};
    use replicator::tls::{self, AgentIdentity};
    use replicator::transport::{self, SocketKind};
    use serde_json::Value;
    use tower::ServiceExt;

    use super::*;

    fn bare() -> Router {
        router(AppState {
            agent: "a".into(),
            source: None,
            sink: None,
        })
    }

    async fn call(r: Router, req: Request<Body>) -> (StatusCode, serde_json::Value) {
        let resp = r.oneshot(req).await.unwrap();
        let status = resp.status();
        let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap();
        (
            status,
            serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null),
        )
    }

    fn get(uri: &str) -> Request<Body> {
        Request::get(uri).body(Body::empty()).unwrap()
    }

    async fn with_sink() -> (Router, tempfile::TempDir) {
        let d = tempfile::tempdir().unwrap();
        let catalog = Catalog::open(&d.path().join("data")).await.unwrap();
        let ep =
            transport::endpoint(SocketKind::Udp("127.0.0.1:0".parse().unwrap()), None).unwrap();
        let sink = Sink::start(
            SinkConfig {
                agent: "s".into(),
                site: "eval".into(),
                root: d.path().join("root"),
                accept_peers: vec![],
                reserve_bytes: 0,
            },
            catalog,
            ep,
        )
        .unwrap();
        let r = router(AppState {
            agent: "s".into(),
            source: None,
            sink: Some(sink),
        });
        (r, d)
    }

    #[tokio::test]
    async fn healthz_names_agent_and_roles() {
        let (s, v) = call(bare(), get("/healthz")).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(v["agent"], "a");
        assert_eq!(v["roles"], serde_json::json!([]));
    }

    #[tokio::test]
    async fn unknown_route_and_missing_role_are_json_404() {
        let (s, v) = call(bare(), get("/v1/nope")).await;
        assert_eq!(s, StatusCode::NOT_FOUND);
        assert!(v["error"].as_str().unwrap().contains("no such route"));
        let (s, v) = call(bare(), get("/v1/resolve?path=/x")).await;
        assert_eq!(s, StatusCode::NOT_FOUND);
        assert!(v["error"].as_str().unwrap().contains("not a sink"));
    }

    #[tokio::test]
    async fn resolve_validates_its_parameters() {
        let (r, _d) = with_sink().await;
        let (s, v) = call(r.clone(), get("/v1/resolve")).await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
        assert!(v["error"].as_str().unwrap().contains("path"));
        let (s, v) = call(r.clone(), get("/v1/resolve?path=relative/x")).await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
        assert!(v["error"].as_str().unwrap().contains("absolute"));
        let (s, v) = call(r.clone(), get("/v1/resolve?path=/ckpt/a/../b")).await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
        assert!(v["error"].as_str().unwrap().contains(".."));
        let (s, v) = call(r.clone(), get("/v1/resolve?path=/x&wait=soon")).await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
        assert!(v["error"].as_str().unwrap().contains("wait"));
        let (s, v) = call(r.clone(), get("/v1/resolve?path=/ckpt/nothing")).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(v["state"], "unknown");
        let (s, v) = call(r, get("/v1/replicas?limit=0")).await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
        assert!(v["error"].as_str().unwrap().contains("limit"));
    }

    #[tokio::test]
    async fn resolve_wait_returns_after_the_deadline_when_nothing_arrives() {
        let (r, _d) = with_sink().await;
        let (s, v) = call(r, get("/v1/resolve?path=/ckpt/x&wait=200ms")).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(v["state"], "unknown");
    }

    #[tokio::test]
    async fn transfer_bodies_are_checked() {
        let post = |body: Vec<u8>| {
            Request::post("/v1/transfers")
                .header("content-type", "application/json")
                .body(Body::from(body))
                .unwrap()
        };
        let (s, v) = call(bare(), post(b"{\"nopath\": 1}".to_vec())).await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
        assert!(v["error"].as_str().unwrap().contains("path"), "{v}");
        let big = format!("{{\"path\": \"{}\"}}", "x".repeat(MAX_BODY + 1));
        let (s, _) = call(bare(), post(big.into_bytes())).await;
        assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
        let (s, v) = call(bare(), post(b"{\"path\": \"/x\"}".to_vec())).await;
        assert_eq!(s, StatusCode::NOT_FOUND);
        assert!(v["error"].as_str().unwrap().contains("not a source"));
        let (s, v) = call(bare(), post(b"{\"path\": \"/x\", \"prio\": 1}".to_vec())).await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
        assert!(v["error"].as_str().unwrap().contains("prio"), "{v}");
        let announce = |body: &str| {
            Request::post("/v1/checkpoints/announce")
                .header("content-type", "application/json")
                .body(Body::from(body.to_string()))
                .unwrap()
        };
        let (s, v) = call(
            bare(),
            announce(r#"{"job": "j", "path": "/ckpt/j/step_1"}"#),
        )
        .await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
        assert!(v["error"].as_str().unwrap().contains("step"), "{v}");
        let (s, v) = call(
            bare(),
            announce(r#"{"job": "j", "step": -1, "path": "/ckpt/j/step_1"}"#),
        )
        .await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
        assert!(v["error"].as_str().unwrap().contains("step"), "{v}");
        let (s, v) = call(
            bare(),
            announce(r#"{"job": "j", "step": 1, "path": "/ckpt/j/step_1"}"#),
        )
        .await;
        assert_eq!(s, StatusCode::NOT_FOUND);
        assert!(v["error"].as_str().unwrap().contains("not a source"));
        let (s, v) = call(bare(), get("/v1/replicas?limit=abc")).await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
        assert!(v["error"].as_str().unwrap().contains("limit"), "{v}");
        let (s, v) = call(bare(), get("/v1/transfers/abc")).await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
        assert!(v["error"].as_str().unwrap().contains("abc"));
    }

    /// The weight of the importance term in [`with_source`]'s policy; not
    /// the default 1, so `1 + importance` and `1 + w x importance` differ.
    const IMPORTANCE_WEIGHT: f64 = 3.0;

    /// A source agent whose links lead nowhere, so transfers stay queued.
    struct WithSource {
        router: Router,
        source: Source,
        /// Root of job `job`: `step-N` directories below it can be pushed.
        root: PathBuf,
        _nothing_answers: std::net::UdpSocket,
        _dir: tempfile::TempDir,
    }

    impl WithSource {
        fn r(&self) -> Router {
            self.router.clone()
        }

        /// A checkpoint directory `name` under the root, queued through
        /// the API in `class` (`None`: the default); returns its id.
        async fn push(&self, name: &str, class: Option<&str>) -> i64 {
            let dir = self.root.join(name);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("shard.bin"), b"weights").unwrap();
            let mut body = json!({ "path": dir.to_str().unwrap() });
            if let Some(c) = class {
                body["class"] = json!(c);
            }
            let (s, v) = call(self.r(), send("POST", "/v1/transfers", &body.to_string())).await;
            assert_eq!(s, StatusCode::CREATED, "{v}");
            v["id"].as_i64().unwrap()
        }

        async fn transfer(&self, id: i64) -> Value {
            let (s, v) = call(self.r(), get(&format!("/v1/transfers/{id}"))).await;
            assert_eq!(s, StatusCode::OK, "{v}");
            v
        }
    }

    /// A source with job `job` (root `ckpt/job`) and links `l` (10 Gbit/s)
    /// and `m` (1 Gbit/s) whose peer is a UDP socket nothing reads: the
    /// links never connect and every transfer stays queued.
    async fn with_source() -> WithSource {
        let d = tempfile::tempdir().unwrap();
        let certs = d.path().join("certs");
        tls::init_dev_pki(&certs, &["src".into()], 2).unwrap();
        let identity = AgentIdentity::load(
            &certs.join("ca.pem"),
            &certs.join("src.pem"),
            &certs.join("src.key"),
        )
        .unwrap();
        let root = d.path().join("ckpt").join("job");
        std::fs::create_dir_all(&root).unwrap();
        let root = std::fs::canonicalize(root).unwrap();
        let hole = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let peer = hole.local_addr().unwrap().to_string();
        let link = |name: &str, rate_bps| LinkConfig {
            name: name.into(),
            peer: peer.clone(),
            peer_name: "dst".into(),
            rate_bps,
            rtt: Duration::from_millis(10),
        };
        let mut policy = scheduler::Policy::default();
        policy.weights.importance = IMPORTANCE_WEIGHT;
        let cfg = SourceConfig {
            agent: "src".into(),
            site: "train-a".into(),
            chunk_size: replicator::manifest::MIN_CHUNK_SIZE,
            markers: vec![],
            roots: vec![RootConfig {
                path: root.clone(),
                job: "job".into(),
                link: "l".into(),
                watch: Default::default(),
            }],
            links: vec![link("l", 10_000_000_000), link("m", 1_000_000_000)],
            streams: 1,
            batch_bytes: 256 << 10,
            scan_interval: None,
            quiet_period: Duration::from_millis(300),
            checkpoint_idle_timeout: Duration::from_secs(600),
            policy,
        };
        let ep =
            transport::endpoint(SocketKind::Udp("127.0.0.1:0".parse().unwrap()), None).unwrap();
        let catalog = Catalog::open(&d.path().join("data")).await.unwrap();
        let source = Source::start(cfg, catalog, ep, &identity).unwrap();
        let router = router(AppState {
            agent: "src".into(),
            source: Some(source.clone()),
            sink: None,
        });
        WithSource {
            router,
            source,
            root,
            _nothing_answers: hole,
            _dir: d,
        }
    }

    fn send(method: &str, uri: &str, body: &str) -> Request<Body> {
        Request::builder()
            .method(method)
            .uri(uri)
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .unwrap()
    }

    /// Asserts the answer is `status` with an error message containing
    /// every one of `names`.
    #[track_caller]
    fn refused(got: (StatusCode, Value), status: StatusCode, names: &[&str]) {
        let (s, v) = got;
        assert_eq!(s, status, "{v}");
        let msg = v["error"]
            .as_str()
            .unwrap_or_else(|| panic!("no error: {v}"));
        for n in names {
            assert!(msg.contains(n), "error {msg:?} does not name {n:?}");
        }
    }

    #[tokio::test]
    async fn signals_are_checked_promote_the_newest_checkpoint_and_are_idempotent() {
        let w = with_source().await;
        let older = w.push("step-1", None).await;
        let newest = w.push("step-2", None).await;
        let post = |body: &str| send("POST", "/v1/signals", body);

        let r = post(r#"{"job": "nosuchjob", "kind": "loss_spike", "severity": 0.5}"#);
        refused(call(w.r(), r).await, StatusCode::NOT_FOUND, &["nosuchjob"]);
        let r = post(r#"{"job": "job", "kind": "loss_spike", "severity": 3}"#);
        refused(
            call(w.r(), r).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            &["severity"],
        );
        let r = post(r#"{"kind": "loss_spike", "severity": 0.5}"#);
        refused(
            call(w.r(), r).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            &["`job`"],
        );
        let r = post(r#"{"job": "job", "kind": "meteor", "severity": 0.5}"#);
        refused(
            call(w.r(), r).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            &["kind", "meteor"],
        );
        let r = post(r#"{"job": "job", "kind": "nan", "severity": 0.5, "idempotency_key": ""}"#);
        refused(
            call(w.r(), r).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            &["idempotency_key"],
        );
        // None of these was stored or promoted anything.
        let (s, v) = call(w.r(), get("/v1/signals")).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(v["items"], json!([]), "refused signals were stored: {v}");
        assert_eq!(w.transfer(newest).await["ranking"]["class"], "scheduled");

        let good = r#"{"job": "job", "kind": "loss_spike", "severity": 0.8, "step": 2,
                       "idempotency_key": "spike-2"}"#;
        let (s, first) = call(w.r(), post(good)).await;
        assert_eq!(s, StatusCode::CREATED, "{first}");
        assert_eq!(first["new"], true);
        assert_eq!(
            first["promoted"], newest,
            "the newest unpublished checkpoint"
        );
        assert!(first["urgent_until"].as_i64().unwrap() > replicator::catalog::now_ms());
        let sig = first["signal"]["id"].as_i64().unwrap();
        assert_eq!(first["signal"]["job"], "job");
        assert_eq!(first["signal"]["transfer"], newest);

        let (s, again) = call(w.r(), post(good)).await;
        assert_eq!(
            s,
            StatusCode::OK,
            "a repeated key is not a new signal: {again}"
        );
        assert_eq!(again["new"], false);
        assert_eq!(again["signal"]["id"], sig);
        assert_eq!(again["promoted"], newest);
        assert_eq!(again["urgent_until"], first["urgent_until"]);

        let (s, v) = call(w.r(), get("/v1/signals")).await;
        assert_eq!(s, StatusCode::OK);
        let items = v["items"].as_array().unwrap();
        assert_eq!(items.len(), 1, "{v}");
        assert_eq!(items[0]["id"], sig);
        assert_eq!(items[0]["kind"], "loss_spike");
        assert_eq!(items[0]["step"], 2);
        assert_eq!(items[0]["idempotency_key"], "spike-2");
        let (s, v) = call(w.r(), get("/v1/signals?limit=0")).await;
        refused((s, v), StatusCode::UNPROCESSABLE_ENTITY, &["limit"]);

        let promoted = w.transfer(newest).await;
        assert_eq!(promoted["class"], "scheduled", "the class it returns to");
        assert_eq!(promoted["urgent_until"], first["urgent_until"]);
        let ranking = &promoted["ranking"];
        assert_eq!(ranking["class"], "urgent", "{ranking}");
        assert_eq!(ranking["promoted_until"], first["urgent_until"]);
        let severity = ranking["severity"].as_f64().unwrap();
        assert!((0.79..=0.8).contains(&severity), "{ranking}");
        let other = w.transfer(older).await;
        assert_eq!(other["ranking"]["class"], "scheduled");
        assert_eq!(other["urgent_until"], Value::Null);
    }

    #[tokio::test]
    async fn a_job_set_through_the_api_is_listed_and_scores_its_transfers() {
        let w = with_source().await;
        let id = w.push("step-1", None).await;
        let before = w.transfer(id).await;
        assert_eq!(before["ranking"]["importance_from"], "default");
        assert_eq!(before["ranking"]["score"]["importance"], 1.0);

        let put = |body: &str| send("PUT", "/v1/jobs/job", body);
        refused(
            call(w.r(), put(r#"{"importance": 1.5}"#)).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            &["importance"],
        );
        refused(
            call(w.r(), put(r#"{"importance": 0.5, "model_params": -1}"#)).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            &["model_params"],
        );
        refused(
            call(w.r(), put(r#"{"model_params": 7e9}"#)).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            &["importance"],
        );
        let (s, v) = call(w.r(), get("/v1/jobs")).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(v["items"], json!([]), "refused jobs were stored: {v}");

        let (s, v) = call(w.r(), put(r#"{"importance": 0.6, "model_params": 7e9}"#)).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(v["name"], "job");
        assert_eq!(v["origin"], "api");
        let (s, v) = call(w.r(), get("/v1/jobs")).await;
        assert_eq!(s, StatusCode::OK);
        let items = v["items"].as_array().unwrap();
        assert_eq!(items.len(), 1, "{v}");
        assert_eq!(items[0]["name"], "job");
        assert_eq!(items[0]["origin"], "api");
        assert_eq!(items[0]["importance"], 0.6);
        assert_eq!(items[0]["model_params"], 7e9);

        let ranking = w.transfer(id).await["ranking"].clone();
        assert_eq!(ranking["importance_from"], "job", "{ranking}");
        assert_eq!(ranking["importance"], 0.6);
        assert_eq!(ranking["model_params"], 7e9);
        let term = ranking["score"]["importance"].as_f64().unwrap();
        let want = 1.0 + IMPORTANCE_WEIGHT * 0.6;
        assert!(
            (term - want).abs() < 1e-9,
            "importance term {term}, want {want}"
        );
        let s = &ranking["score"];
        let product = ["size", "importance", "severity", "aging"]
            .iter()
            .map(|k| s[k].as_f64().unwrap())
            .product::<f64>();
        assert!((s["value"].as_f64().unwrap() - product).abs() < 1e-9, "{s}");

        // Leaving `model_params` out keeps the size; `null` forgets it.
        let (s, v) = call(w.r(), put(r#"{"importance": 0.9}"#)).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(
            (v["importance"].clone(), v["model_params"].clone()),
            (json!(0.9), json!(7e9))
        );
        let (s, v) = call(w.r(), put(r#"{"importance": 0.9, "model_params": null}"#)).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(v["model_params"], json!(null));
    }

    #[tokio::test]
    async fn link_rates_change_live_and_bad_ones_are_refused() {
        let w = with_source().await;
        let put = |link: &str, body: &str| send("PUT", &format!("/v1/links/{link}"), body);
        refused(
            call(w.r(), put("nowhere", r#"{"rate_bps": 5000000}"#)).await,
            StatusCode::NOT_FOUND,
            &["nowhere"],
        );
        refused(
            call(w.r(), put("l", r#"{"rate_bps": 0}"#)).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            &["rate_bps"],
        );
        refused(
            call(w.r(), put("l", r#"{"rate_bps": -5}"#)).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            &["rate_bps"],
        );
        let (s, v) = call(w.r(), put("l", r#"{"rate_bps": 250000000}"#)).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(v, json!({ "name": "l", "rate_bps": 250_000_000u64 }));
        let (s, v) = call(w.r(), get("/v1/links")).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(
            v["items"],
            json!([
                { "name": "l", "rate_bps": 250_000_000u64 },
                { "name": "m", "rate_bps": 1_000_000_000u64 },
            ])
        );
        assert_eq!(w.source.link_rate("l"), Some(250_000_000));
    }

    #[tokio::test]
    async fn transfer_actions_follow_the_state() {
        let w = with_source().await;
        let id = w.push("step-1", None).await;
        let act = |what: &str| send("POST", &format!("/v1/transfers/{id}/{what}"), "");

        let (s, v) = call(w.r(), act("pause")).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(v["id"], id);
        assert_eq!(v["state"], "paused");
        assert_eq!(w.transfer(id).await["state"], "paused");
        refused(
            call(w.r(), act("pause")).await,
            StatusCode::CONFLICT,
            &["paused"],
        );
        let (s, v) = call(w.r(), act("resume")).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(v["state"], "queued");
        refused(
            call(w.r(), act("resume")).await,
            StatusCode::CONFLICT,
            &["not paused"],
        );
        let (s, v) = call(w.r(), act("cancel")).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(v["state"], "cancelled");
        assert!(v["finished_at"].is_i64(), "{v}");
        refused(
            call(w.r(), act("cancel")).await,
            StatusCode::CONFLICT,
            &["cancelled"],
        );
        refused(
            call(w.r(), act("pause")).await,
            StatusCode::CONFLICT,
            &["cancelled"],
        );
        refused(
            call(w.r(), act("resume")).await,
            StatusCode::CONFLICT,
            &["cancelled"],
        );
        assert_eq!(w.transfer(id).await["state"], "cancelled");

        refused(
            call(w.r(), act("explode")).await,
            StatusCode::NOT_FOUND,
            &["explode"],
        );
        let r = send("POST", "/v1/transfers/999/pause", "");
        refused(call(w.r(), r).await, StatusCode::NOT_FOUND, &["999"]);
        let r = send("POST", "/v1/transfers/abc/pause", "");
        refused(
            call(w.r(), r).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            &["abc"],
        );
        refused(
            call(w.r(), get("/v1/transfers/999")).await,
            StatusCode::NOT_FOUND,
            &["999"],
        );
    }

    #[tokio::test]
    async fn patch_sets_class_and_importance_and_null_returns_to_the_job() {
        let w = with_source().await;
        let id = w.push("step-1", None).await;
        let (s, v) = call(w.r(), send("PUT", "/v1/jobs/job", r#"{"importance": 0.6}"#)).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        let patch = |body: &str| send("PATCH", &format!("/v1/transfers/{id}"), body);

        refused(
            call(w.r(), patch(r#"{"class": "soon"}"#)).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            &["class", "soon"],
        );
        refused(
            call(w.r(), patch("{}")).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            &["class", "importance"],
        );
        refused(
            call(w.r(), patch(r#"{"importance": 1.5}"#)).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            &["importance"],
        );
        refused(
            call(w.r(), patch(r#"{"class": "background", "importance": 2}"#)).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            &["importance"],
        );
        refused(
            call(w.r(), patch(r#"{"prio": 1}"#)).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            &["prio"],
        );
        let r = send("PATCH", "/v1/transfers/999", r#"{"class": "urgent"}"#);
        refused(call(w.r(), r).await, StatusCode::NOT_FOUND, &["999"]);
        // Nothing refused changed the transfer.
        let t = w.transfer(id).await;
        assert_eq!(t["class"], "scheduled");
        assert_eq!(t["importance"], Value::Null);
        assert_eq!(t["ranking"]["importance_from"], "job");

        let (s, v) = call(
            w.r(),
            patch(r#"{"class": "background", "importance": 0.3}"#),
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(v["class"], "background");
        assert_eq!(v["importance"], 0.3);
        let t = w.transfer(id).await;
        assert_eq!(t["class"], "background");
        assert_eq!(t["ranking"]["class"], "background");
        assert_eq!(t["ranking"]["importance_from"], "transfer");
        assert_eq!(t["ranking"]["importance"], 0.3);

        let (s, v) = call(w.r(), patch(r#"{"importance": null}"#)).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(v["importance"], Value::Null);
        let t = w.transfer(id).await;
        assert_eq!(t["class"], "background", "the class is left as it was");
        assert_eq!(t["ranking"]["importance_from"], "job");
        assert_eq!(t["ranking"]["importance"], 0.6);

        let (s, _) = call(
            w.r(),
            send("POST", &format!("/v1/transfers/{id}/cancel"), ""),
        )
        .await;
        assert_eq!(s, StatusCode::OK);
        refused(
            call(w.r(), patch(r#"{"class": "urgent"}"#)).await,
            StatusCode::CONFLICT,
            &["cancelled"],
        );
    }

    #[tokio::test]
    async fn transfers_are_queued_in_the_class_asked_for() {
        let w = with_source().await;
        let id = w.push("logs", Some("background")).await;
        let t = w.transfer(id).await;
        assert_eq!(t["class"], "background");
        assert_eq!(t["state"], "queued");
        assert_eq!(t["ranking"]["class"], "background");
        let id = w.push("step-1", None).await;
        assert_eq!(w.transfer(id).await["class"], "scheduled");

        let dir = w.root.join("step-2");
        std::fs::create_dir_all(&dir).unwrap();
        let body = json!({ "path": dir.to_str().unwrap(), "class": "x" }).to_string();
        refused(
            call(w.r(), send("POST", "/v1/transfers", &body)).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            &["class", "\"x\""],
        );
        let body = json!({ "path": dir.to_str().unwrap(), "link": "nowhere" }).to_string();
        refused(
            call(w.r(), send("POST", "/v1/transfers", &body)).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            &["link", "nowhere"],
        );
        let (s, v) = call(w.r(), get("/v1/transfers")).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(v["items"].as_array().unwrap().len(), 2, "{v}");
    }

    #[tokio::test]
    async fn oversized_bodies_on_the_new_routes_are_413() {
        let w = with_source().await;
        let pad = "x".repeat(MAX_BODY + 1);
        let big = format!(
            r#"{{"job": "job", "kind": "manual", "severity": 0.5, "idempotency_key": "{pad}"}}"#
        );
        let (s, v) = call(w.r(), send("POST", "/v1/signals", &big)).await;
        assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE, "{v}");
        let big = format!(r#"{{"importance": 0.5, "pad": "{pad}"}}"#);
        let (s, v) = call(w.r(), send("PUT", "/v1/jobs/job", &big)).await;
        assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE, "{v}");
        let (s, v) = call(w.r(), get("/v1/signals")).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(v["items"], json!([]));
    }
}
