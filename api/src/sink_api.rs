//! Sink routes: where a checkpoint is local, the replicas held here, and
//! their pins and removal.

use std::time::{Duration, Instant};

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::Json;
use ferry_proto::state::TransferState;
use replicator::sink::lifecycle::LifecycleError;
use replicator::sink::{LeaseGrant, Resolution, Sink};
use serde::Deserialize;
use tracing::info;

use crate::auth::{Caller, Role};
use crate::error::{ApiError, ErrorBody};
use crate::model::Replica;
use crate::{AppState, Page, MAX_WAIT};

/// Who acted, for the log and the removal record: the token's name.
type By = Option<axum::Extension<Caller>>;

fn by(c: &By) -> &str {
    c.as_ref().map_or("unknown", |c| c.0.name.as_str())
}

pub(crate) fn sink(s: &AppState) -> Result<&Sink, ApiError> {
    s.sink
        .as_ref()
        .ok_or_else(|| ApiError::not_found("this agent is not a sink; ask the sink agent"))
}

/// A replica row as the API shows it, with its URL on an HDFS or S3 sink.
fn replica_view(s: &AppState, r: ferry_catalog::Replica) -> Result<Replica, ApiError> {
    let url = sink(s)?.replica_url(std::path::Path::new(&r.local_path), r.id);
    Ok(Replica {
        url,
        ..Replica::from(r)
    })
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
    /// Take a reader lease for this long (`10m`, `2h`; 1 s to 7 days) on
    /// the version a `local` answer names: its `local_path` (or, on S3,
    /// its `url`) is then in that version's own directory (prefix), which
    /// stays, whatever a re-save publishes or a policy expires, until the
    /// lease expires or is released. Renew with `POST
    /// /v1/leases/{id}/renew`. Not on an HDFS sink without `[sink.hdfs]
    /// versions` (409).
    lease: Option<String>,
    /// `full`: only the full replica answers `local`. Under a weights-first
    /// publish the weights-only version is published first (a plain
    /// resolve answers it, with `profile: weights-only`); with
    /// `profile=full` the answer stays `replicating` until the full
    /// replica replaces it (with `wait`, a long poll until then).
    profile: Option<String>,
}

/// Longest reader lease (and renewal), 7 days.
pub(crate) const MAX_LEASE: Duration = Duration::from_secs(7 * 86_400);

/// A lease duration: 1 s to [`MAX_LEASE`].
fn lease_duration(text: &str) -> Result<Duration, ApiError> {
    let d = humantime::parse_duration(text.trim()).map_err(|e| {
        ApiError::unprocessable(format!(
            "`lease` {text:?} is not a positive duration like 10m or 2h: {e}"
        ))
    })?;
    if d < Duration::from_secs(1) || d > MAX_LEASE {
        return Err(ApiError::unprocessable(format!(
            "`lease` {text:?} must be at least 1s and at most 7d"
        )));
    }
    Ok(d)
}

/// Where a source path is at this sink: `local` (with the local path),
/// `replicating` (progress and ETA), `remote` or `unknown`. With `wait`, a
/// long poll that answers as soon as the path is local. With `lease`, a
/// `local` answer holds a reader lease on the version it names.
#[utoipa::path(
    get, path = "/v1/resolve", tag = "sink",
    params(ResolveQuery),
    security(("bearer" = ["reader"])),
    responses(
        (status = 200, description = "Where the path is", body = Resolution),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 409, description = "`lease` on a sink whose storage keeps no version directories (HDFS without versions)", body = ErrorBody),
        (status = 422, description = "A parameter is missing or invalid", body = ErrorBody),
    )
)]
pub(crate) async fn resolve(
    State(s): State<AppState>,
    caller: By,
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
            "`path` must be an absolute source path (or an hdfs:// or s3:// URL) without `..` components",
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
    let lease = match q.lease.as_deref() {
        None => None,
        Some(l) => Some(lease_duration(l)?),
    };
    let full = match q.profile.as_deref() {
        None | Some("") => false,
        Some("full") => true,
        Some(p) => {
            return Err(ApiError::unprocessable(format!(
                "`profile` {p:?} is not known: `full` asks for the full replica only (leave it out for the first publish an eval can use)"
            )))
        }
    };
    let deadline = Instant::now() + wait;
    let mut changes = sink.changes();
    loop {
        let r = match (lease, full) {
            (None, false) => sink.resolve(&path).await.map_err(ApiError::catalog)?,
            (None, true) => sink.resolve_full(&path).await.map_err(ApiError::catalog)?,
            (Some(d), _) => sink
                .resolve_with_lease(&path, full, d, by(&caller))
                .await
                .map_err(lifecycle_error)?,
        };
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

/// Query of `GET /v1/replicas`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct ReplicasQuery {
    /// Items per page, 1..1000 (default 100).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<i64>,
    /// Items to skip (default 0).
    #[param(minimum = 0, maximum = 4294967295_i64)]
    offset: Option<i64>,
    /// Only rows in this state: `queued` (a weights-first transfer's
    /// weights-only version before its publish), `receiving`,
    /// `published`, `failed`, `cancelled`, `removing` or `removed` (the
    /// removal records).
    state: Option<String>,
}

/// Replicas at this sink (published, incoming, and removed with their
/// removal records), newest first; `state` filters.
#[utoipa::path(
    get, path = "/v1/replicas", tag = "sink",
    params(ReplicasQuery),
    security(("bearer" = ["reader"])),
    responses(
        (status = 200, description = "A page of replicas", body = ReplicaPage),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 422, description = "`limit`, `offset` or `state` invalid", body = ErrorBody),
    )
)]
pub(crate) async fn replicas(
    State(s): State<AppState>,
    q: Result<Query<ReplicasQuery>, QueryRejection>,
) -> Result<Json<ReplicaPage>, ApiError> {
    let Query(q) = q?;
    let (limit, offset) = Page {
        limit: q.limit,
        offset: q.offset,
    }
    .get()?;
    const SINK_STATES: [TransferState; 7] = [
        TransferState::Queued,
        TransferState::Receiving,
        TransferState::Published,
        TransferState::Failed,
        TransferState::Cancelled,
        TransferState::Removing,
        TransferState::Removed,
    ];
    let state = match q.state.as_deref() {
        None | Some("") => None,
        Some(name) => Some(
            SINK_STATES
                .into_iter()
                .find(|st| st.as_str() == name)
                .ok_or_else(|| {
                    ApiError::unprocessable(format!(
                        "`state` {name:?} is not one of queued, receiving, published, failed, cancelled, removing, removed"
                    ))
                })?,
        ),
    };
    let catalog = sink(&s)?.catalog();
    let rows = catalog
        .replicas_in(state, limit, offset)
        .await
        .map_err(ApiError::catalog)?;
    // A published row a re-save replaced says by which.
    let mut items: Vec<Replica> = Vec::with_capacity(rows.len());
    let mut newer: std::collections::HashMap<String, Vec<(i64, TransferState)>> =
        std::collections::HashMap::new();
    for r in &rows {
        if r.state == TransferState::Published && !newer.contains_key(&r.local_path) {
            let at = catalog
                .replica_versions_at(&r.local_path)
                .await
                .map_err(ApiError::catalog)?;
            newer.insert(r.local_path.clone(), at);
        }
    }
    let live = sink(&s)?.leases().await.map_err(ApiError::catalog)?;
    for r in rows {
        let by = (r.state == TransferState::Published)
            .then(|| newer.get(&r.local_path))
            .flatten()
            .and_then(|v| {
                v.iter()
                    .filter(|(id, st)| {
                        *id > r.id
                            && matches!(
                                st,
                                TransferState::Published
                                    | TransferState::Removing
                                    | TransferState::Removed
                            )
                    })
                    .map(|(id, _)| *id)
                    .min()
            });
        let mut v = replica_view(&s, r)?;
        v.replaced_by = by;
        v.leases = live.iter().filter(|l| l.replica == v.id).cloned().collect();
        items.push(v);
    }
    Ok(Json(ReplicaPage {
        items,
        limit,
        offset,
    }))
}

/// A replica id from the path: 422 when not a number, 404 when negative.
fn replica_id(id: Result<Path<String>, PathRejection>) -> Result<i64, ApiError> {
    let Path(id) = id?;
    let n: i64 = id
        .parse()
        .map_err(|_| ApiError::unprocessable(format!("replica id {id:?} is not a number")))?;
    if n < 0 {
        return Err(ApiError::not_found(format!("no replica {n}")));
    }
    Ok(n)
}

/// A refused pin or removal as 404 or 409 naming why (500 for the
/// catalog).
fn lifecycle_error(e: LifecycleError) -> ApiError {
    match e {
        LifecycleError::NotFound(_) => ApiError::not_found(e.to_string()),
        LifecycleError::LeaseUnknown(_) => ApiError::not_found(e.to_string()),
        LifecycleError::Invalid(_) => ApiError::unprocessable(e.to_string()),
        LifecycleError::LeaseEnded(_) => ApiError::new(StatusCode::GONE, e.to_string()),
        LifecycleError::NotHolder { .. } => ApiError::new(StatusCode::FORBIDDEN, e.to_string()),
        LifecycleError::NotPublished { .. }
        | LifecycleError::Replaced { .. }
        | LifecycleError::Pinned { .. }
        | LifecycleError::Leased { .. }
        | LifecycleError::Lease(_)
        | LifecycleError::Elsewhere { .. }
        | LifecycleError::NotVersioned => ApiError::new(StatusCode::CONFLICT, e.to_string()),
        LifecycleError::Catalog(e) => ApiError::catalog(e),
    }
}

/// The retention policies in force and, per job, what they decide for
/// each current version now: kept (by which rule, until when) or removed
/// at the next pass.
#[utoipa::path(
    get, path = "/v1/retention", tag = "sink",
    security(("bearer" = ["reader"])),
    responses(
        (status = 200, description = "Policies and verdicts", body = replicator::sink::lifecycle::RetentionView),
        (status = 401, description = "No or unknown token", body = ErrorBody),
    )
)]
pub(crate) async fn get_retention(
    State(s): State<AppState>,
) -> Result<Json<replicator::sink::lifecycle::RetentionView>, ApiError> {
    let v = sink(&s)?.retention().await.map_err(ApiError::catalog)?;
    Ok(Json(v))
}

/// Body of `PUT /v1/retention`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct RetentionBody {
    /// The policies, in order (the first whose `job` glob matches a job
    /// applies); at most 100. Empty: keep everything.
    policies: Vec<replicator::sink::retention::PolicySpec>,
}

/// Replace the retention policies (every sink agent of the pool takes
/// them up; they replace `[[sink.retention]]` of the config) and run them
/// at once. Each policy must set at least one of `keep_last`,
/// `keep_every`, `min_age`, `max_bytes`.
#[utoipa::path(
    put, path = "/v1/retention", tag = "sink",
    request_body = RetentionBody,
    security(("bearer" = ["operator"])),
    responses(
        (status = 200, description = "In force; the policies and verdicts now", body = replicator::sink::lifecycle::RetentionView),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 403, description = "The token's role is below operator", body = ErrorBody),
        (status = 413, description = "Body over 64 KiB", body = ErrorBody),
        (status = 422, description = "A policy is invalid; the message names it and the key", body = ErrorBody),
    )
)]
pub(crate) async fn put_retention(
    State(s): State<AppState>,
    caller: By,
    body: Result<Json<RetentionBody>, JsonRejection>,
) -> Result<Json<replicator::sink::lifecycle::RetentionView>, ApiError> {
    let Json(b) = body?;
    if b.policies.len() > 100 {
        return Err(ApiError::unprocessable("at most 100 policies"));
    }
    let v = sink(&s)?
        .set_retention(&b.policies, by(&caller))
        .await
        .map_err(lifecycle_error)?;
    Ok(Json(v))
}

/// The live leases: all of them.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub(crate) struct LeaseList {
    items: Vec<LeaseGrant>,
}

/// The live reader leases at this sink, oldest first.
#[utoipa::path(
    get, path = "/v1/leases", tag = "sink",
    security(("bearer" = ["reader"])),
    responses(
        (status = 200, description = "The live leases", body = LeaseList),
        (status = 401, description = "No or unknown token", body = ErrorBody),
    )
)]
pub(crate) async fn list_leases(State(s): State<AppState>) -> Result<Json<LeaseList>, ApiError> {
    let items = sink(&s)?.leases().await.map_err(ApiError::catalog)?;
    Ok(Json(LeaseList { items }))
}

/// A lease id from the path: 32 hex digits, else 404 naming it.
fn lease_id(id: Result<Path<String>, PathRejection>) -> Result<String, ApiError> {
    let Path(id) = id?;
    if id.len() != 32 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(ApiError::not_found(format!(
            "no lease {:?}: a lease id is 32 hex digits, as resolve with `lease` answers it",
            id.chars().take(64).collect::<String>()
        )));
    }
    Ok(id.to_ascii_lowercase())
}

/// Renew a reader lease: it now expires its duration from now. Only its
/// holder (the token that took it) or an operator may.
#[utoipa::path(
    post, path = "/v1/leases/{id}/renew", tag = "sink",
    params(("id" = String, Path, description = "Lease id (32 hex digits)")),
    security(("bearer" = ["reader"])),
    responses(
        (status = 200, description = "Renewed; the lease as it is now", body = LeaseGrant),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 403, description = "Another token holds it, and this one is not an operator", body = ErrorBody),
        (status = 404, description = "No such lease", body = ErrorBody),
        (status = 410, description = "The lease expired or was released; its version may be gone", body = ErrorBody),
    )
)]
pub(crate) async fn renew_lease(
    State(s): State<AppState>,
    caller: By,
    id: Result<Path<String>, PathRejection>,
) -> Result<Json<LeaseGrant>, ApiError> {
    let id = lease_id(id)?;
    let l = sink(&s)?
        .renew_lease(&id, by(&caller), is_operator(&caller))
        .await
        .map_err(lifecycle_error)?;
    Ok(Json(l))
}

/// Release a reader lease now: the version it held goes when nothing else
/// keeps it. Only its holder or an operator may.
#[utoipa::path(
    delete, path = "/v1/leases/{id}", tag = "sink",
    params(("id" = String, Path, description = "Lease id (32 hex digits)")),
    security(("bearer" = ["reader"])),
    responses(
        (status = 200, description = "Released; the lease as it was", body = LeaseGrant),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 403, description = "Another token holds it, and this one is not an operator", body = ErrorBody),
        (status = 404, description = "No such lease", body = ErrorBody),
        (status = 410, description = "The lease had expired or was released already", body = ErrorBody),
    )
)]
pub(crate) async fn release_lease(
    State(s): State<AppState>,
    caller: By,
    id: Result<Path<String>, PathRejection>,
) -> Result<Json<LeaseGrant>, ApiError> {
    let id = lease_id(id)?;
    let l = sink(&s)?
        .release_lease(&id, by(&caller), is_operator(&caller))
        .await
        .map_err(lifecycle_error)?;
    Ok(Json(l))
}

/// Whether the caller's role is operator (an open API's anonymous caller
/// is).
fn is_operator(c: &By) -> bool {
    c.as_ref().is_none_or(|c| c.0.role >= Role::Operator)
}

/// Query of `DELETE /v1/replicas/{id}`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct RemoveQuery {
    /// Remove a pinned replica anyway (recorded with the removal).
    force: Option<bool>,
    /// Why, kept with the removal record (at most 1000 characters).
    reason: Option<String>,
}

/// Remove a published replica by hand: it leaves the published namespace
/// at once (resolve stops naming it) and its files are deleted in the
/// background; `GET /v1/replicas?state=removed` lists the record. A pinned
/// replica is refused, naming the pin, unless `force=true`.
#[utoipa::path(
    delete, path = "/v1/replicas/{id}", tag = "sink",
    params(("id" = i64, Path, description = "Replica id"), RemoveQuery),
    security(("bearer" = ["operator"])),
    responses(
        (status = 202, description = "Out of the published namespace; its files are being deleted", body = Replica),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 403, description = "The token's role is below operator", body = ErrorBody),
        (status = 404, description = "No such replica", body = ErrorBody),
        (status = 409, description = "Not a published replica, replaced by a newer one, or pinned", body = ErrorBody),
        (status = 422, description = "The id is not a number, or a parameter is invalid", body = ErrorBody),
    )
)]
pub(crate) async fn remove_replica(
    State(s): State<AppState>,
    caller: By,
    id: Result<Path<String>, PathRejection>,
    q: Result<Query<RemoveQuery>, QueryRejection>,
) -> Result<impl IntoResponse, ApiError> {
    let id = replica_id(id)?;
    let Query(q) = q?;
    let reason = q.reason.unwrap_or_default();
    if reason.chars().count() > 1000 {
        return Err(ApiError::unprocessable(
            "`reason` is longer than 1000 characters",
        ));
    }
    let force = q.force.unwrap_or(false);
    let note = format!(
        "by {}{}{reason}",
        by(&caller),
        if reason.is_empty() { "" } else { ": " }
    );
    let r = sink(&s)?
        .remove(id, force, &note)
        .await
        .map_err(lifecycle_error)?;
    info!(
        replica = id,
        force,
        by = by(&caller),
        "replica removal requested"
    );
    Ok((StatusCode::ACCEPTED, Json(replica_view(&s, r)?)))
}

/// Body of `POST /v1/replicas/{id}/pin`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct PinBody {
    /// Why (shown with the pin and in a refused removal), at most 1000
    /// characters.
    reason: Option<String>,
    /// How long (`7d`, `12h`); absent: until unpinned.
    #[serde(rename = "for")]
    for_: Option<String>,
}

/// Pin a published replica: it never expires under a retention policy,
/// and removing it by hand needs `force=true`. Pinning again replaces the
/// pin.
#[utoipa::path(
    post, path = "/v1/replicas/{id}/pin", tag = "sink",
    params(("id" = i64, Path, description = "Replica id")),
    request_body = PinBody,
    security(("bearer" = ["operator"])),
    responses(
        (status = 200, description = "Pinned; the replica as it is now", body = Replica),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 403, description = "The token's role is below operator", body = ErrorBody),
        (status = 404, description = "No such replica", body = ErrorBody),
        (status = 409, description = "Not a published replica", body = ErrorBody),
        (status = 413, description = "Body over 64 KiB", body = ErrorBody),
        (status = 422, description = "The id is not a number, or the body is invalid", body = ErrorBody),
    )
)]
pub(crate) async fn pin_replica(
    State(s): State<AppState>,
    caller: By,
    id: Result<Path<String>, PathRejection>,
    body: Result<Json<PinBody>, JsonRejection>,
) -> Result<Json<Replica>, ApiError> {
    let id = replica_id(id)?;
    let Json(b) = body?;
    let reason = b.reason.unwrap_or_default();
    if reason.chars().count() > 1000 {
        return Err(ApiError::unprocessable(
            "`reason` is longer than 1000 characters",
        ));
    }
    let until = match b.for_.as_deref() {
        None => None,
        Some(d) => {
            let d = humantime::parse_duration(d.trim()).map_err(|e| {
                ApiError::unprocessable(format!(
                    "`for` {d:?} is not a positive duration like 7d or 12h: {e}"
                ))
            })?;
            // humantime's year: 365.25 days, so "100y" is accepted.
            if d.is_zero() || d > Duration::from_secs(100 * 31_557_600) {
                return Err(ApiError::unprocessable(
                    "`for` must be more than 0 and at most 100 years",
                ));
            }
            Some(ferry_catalog::now_ms() + d.as_millis() as i64)
        }
    };
    let reason = if reason.is_empty() {
        format!("pinned by {}", by(&caller))
    } else {
        format!("{reason} (by {})", by(&caller))
    };
    let r = sink(&s)?
        .pin(id, until, &reason)
        .await
        .map_err(lifecycle_error)?;
    Ok(Json(replica_view(&s, r)?))
}

/// Remove a replica's pin (no error when it has none); the retention
/// policies then run.
#[utoipa::path(
    delete, path = "/v1/replicas/{id}/pin", tag = "sink",
    params(("id" = i64, Path, description = "Replica id")),
    security(("bearer" = ["operator"])),
    responses(
        (status = 200, description = "Unpinned; the replica as it is now", body = Replica),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 403, description = "The token's role is below operator", body = ErrorBody),
        (status = 404, description = "No such replica", body = ErrorBody),
        (status = 422, description = "The id is not a number", body = ErrorBody),
    )
)]
pub(crate) async fn unpin_replica(
    State(s): State<AppState>,
    caller: By,
    id: Result<Path<String>, PathRejection>,
) -> Result<Json<Replica>, ApiError> {
    let id = replica_id(id)?;
    let r = sink(&s)?.unpin(id).await.map_err(lifecycle_error)?;
    info!(replica = id, by = by(&caller), "replica unpinned");
    Ok(Json(replica_view(&s, r)?))
}

/// Query of `GET /v1/replicas/events`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct EventsQuery {
    /// Only events of jobs matching this glob (`mm-*`); default every job.
    job: Option<String>,
    /// Replay the log after this event id first (as the `Last-Event-ID`
    /// header does; the query wins). Without either, only new events.
    since: Option<String>,
}

/// How often a publish event stream reads the log when nothing woke it
/// (another agent of a pool may have written), 1 s.
const EVENT_POLL: Duration = Duration::from_secs(1);

/// Events read from the log at once.
const EVENT_BATCH: i64 = 256;

/// Publish events as server-sent events, so eval schedulers start evals
/// without polling: `published` (a replica is ready), `replaced` (a newer
/// version of its checkpoint was published; `replaced_by`) and `removed`.
/// Each event's `id:` is its id in the log, which keeps 7 days: a client
/// that reconnects with `Last-Event-ID` (or `?since=`) gets every event
/// after it, in order. `data:` is the event as JSON (replica id, job,
/// rel, source_path, step, profile, location, at_ms). In a pool every
/// sink agent streams every agent's events.
#[utoipa::path(
    get, path = "/v1/replicas/events", tag = "sink",
    params(EventsQuery),
    security(("bearer" = ["reader"])),
    responses(
        (status = 200, description = "text/event-stream of `published`, `replaced` and `removed` events", content_type = "text/event-stream"),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 422, description = "`since`, `Last-Event-ID` or `job` is invalid", body = ErrorBody),
        (status = 503, description = "32 live streams are open already", body = ErrorBody),
    )
)]
pub(crate) async fn replica_events(
    State(s): State<AppState>,
    headers: axum::http::HeaderMap,
    q: Result<Query<EventsQuery>, QueryRejection>,
) -> Result<axum::response::Response, ApiError> {
    use axum::response::sse::{Event, KeepAlive, Sse};
    let Query(q) = q?;
    let sink = sink(&s)?.clone();
    let header = headers
        .get("last-event-id")
        .map(|v| v.to_str().unwrap_or("?").to_string());
    let named = |name: &str, v: &str| {
        v.trim()
            .parse::<i64>()
            .ok()
            .filter(|n| *n >= 0)
            .ok_or_else(|| {
                ApiError::unprocessable(format!(
                    "`{name}` must be an event id (a whole number, 0 or more), got {v:?}"
                ))
            })
    };
    let since = match (&q.since, &header) {
        (Some(v), _) => Some(named("since", v)?),
        (None, Some(v)) => Some(named("Last-Event-ID", v)?),
        (None, None) => None,
    };
    let jobs = match &q.job {
        Some(g) => Some(
            globset::Glob::new(g)
                .map_err(|e| ApiError::unprocessable(format!("`job` {g:?} is not a glob: {e}")))?
                .compile_matcher(),
        ),
        None => None,
    };
    let after = match since {
        Some(n) => n,
        None => sink
            .catalog()
            .last_replica_event()
            .await
            .map_err(ApiError::catalog)?,
    };
    let Ok(slot) = s.live.slots.clone().try_acquire_owned() else {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "{} live streams are open already; close one",
                crate::ui::MAX_EVENT_STREAMS
            ),
        ));
    };
    let changes = sink.changes();
    // The stream opens with the reconnection delay a client should use,
    // so a client (and any proxy) sees the stream start at once, before
    // the first publish.
    let opening = Event::default()
        .retry(EVENT_POLL)
        .comment("ferry publish events");
    let state = (
        sink,
        after,
        changes,
        std::collections::VecDeque::from([opening]),
        slot,
    );
    let stream = futures::stream::unfold(
        state,
        move |(sink, mut after, mut changes, mut queue, slot)| {
            let jobs = jobs.clone();
            async move {
                loop {
                    if let Some(e) = queue.pop_front() {
                        return Some((
                            Ok::<_, std::convert::Infallible>(e),
                            (sink, after, changes, queue, slot),
                        ));
                    }
                    match sink
                        .catalog()
                        .replica_events_after(after, EVENT_BATCH)
                        .await
                    {
                        Ok(evs) if !evs.is_empty() => {
                            for e in evs {
                                after = e.id;
                                let e = sink.event_view(e);
                                if jobs.as_ref().is_some_and(|g| !g.is_match(&e.job)) {
                                    continue;
                                }
                                let ev = Event::default()
                                    .id(e.id.to_string())
                                    .event(e.kind.clone())
                                    .json_data(&e)
                                    .unwrap_or_else(|_| {
                                        Event::default().event("error").data("encoding")
                                    });
                                queue.push_back(ev);
                            }
                            continue;
                        }
                        Ok(_) => {}
                        Err(e) => tracing::warn!(error = %e, "catalog: reading publish events"),
                    }
                    // A sink that is stopping wakes nobody any more: poll.
                    if let Ok(Err(_)) = tokio::time::timeout(EVENT_POLL, changes.changed()).await {
                        tokio::time::sleep(EVENT_POLL).await;
                    }
                }
            }
        },
    );
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response())
}
