//! Sink routes: where a checkpoint is local, and the replicas held here.

use std::time::{Duration, Instant};

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::Json;
use replicator::sink::{Resolution, Sink};
use serde::Deserialize;

use crate::error::{ApiError, ErrorBody};
use crate::model::Replica;
use crate::{AppState, Page, MAX_WAIT};

pub(crate) fn sink(s: &AppState) -> Result<&Sink, ApiError> {
    s.sink
        .as_ref()
        .ok_or_else(|| ApiError::not_found("this agent is not a sink; ask the sink agent"))
}

/// Query of `GET /v1/resolve`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct ResolveQuery {
    /// Absolute checkpoint path (or a path inside one) at the source.
    path: Option<String>,
    /// Wait up to this long (`30s`, `2m`; at most 300 s) for the path to
    /// be local before answering.
    wait: Option<String>,
}

/// Where a source path is at this sink: `local` (with the local path),
/// `replicating` (progress and ETA), `remote` or `unknown`. With `wait`, a
/// long poll that answers as soon as the path is local.
#[utoipa::path(
    get, path = "/v1/resolve", tag = "sink",
    params(ResolveQuery),
    security(("bearer" = ["reader"])),
    responses(
        (status = 200, description = "Where the path is", body = Resolution),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 422, description = "A parameter is missing or invalid", body = ErrorBody),
    )
)]
pub(crate) async fn resolve(
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

/// A page of replicas.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub(crate) struct ReplicaPage {
    items: Vec<Replica>,
    limit: i64,
    offset: i64,
}

/// Replicas at this sink (published and incoming), newest first.
#[utoipa::path(
    get, path = "/v1/replicas", tag = "sink",
    params(Page),
    security(("bearer" = ["reader"])),
    responses(
        (status = 200, description = "A page of replicas", body = ReplicaPage),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 422, description = "`limit` or `offset` out of range", body = ErrorBody),
    )
)]
pub(crate) async fn replicas(
    State(s): State<AppState>,
    p: Result<Query<Page>, QueryRejection>,
) -> Result<Json<ReplicaPage>, ApiError> {
    let Query(p) = p?;
    let (limit, offset) = p.get()?;
    let items = sink(&s)?
        .catalog()
        .replicas(false, limit, offset)
        .await
        .map_err(ApiError::internal)?;
    Ok(Json(ReplicaPage {
        items: items.into_iter().map(Replica::from).collect(),
        limit,
        offset,
    }))
}
