//! Source routes: transfers and their control, jobs, links, signals,
//! announcements and the recorded scheduling history as a trace.

use std::path::PathBuf;

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use ferry_proto::state::TransferId;
use replicator::source::{OpsError, Progress, Ranking, Source, SubmitError};
use serde::{Deserialize, Serialize};

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::model::{Job, Signal, SignalOutcome, Transfer};
use crate::{AppState, Page};

/// Who acted, for the log: the token's configured name.
type By = Option<axum::Extension<Caller>>;

fn by(c: &By) -> &str {
    c.as_ref().map_or("unknown", |c| c.0.name.as_str())
}

pub(crate) fn source(s: &AppState) -> Result<&Source, ApiError> {
    s.source
        .as_ref()
        .ok_or_else(|| ApiError::not_found("this agent is not a source; ask the source agent"))
}

/// Body of `POST /v1/transfers`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct CreateTransfer {
    /// Absolute path of a directory under a source root.
    #[schema(pattern = "^/")]
    path: String,
    /// Link to use instead of the source root's.
    link: Option<String>,
    /// `scheduled` (default), `background` or `urgent`.
    #[schema(value_type = Option<scheduler::Class>)]
    class: Option<String>,
    /// When the replica must be ready: an RFC 3339 time
    /// (`2026-12-01T10:00:00Z`) or a duration after the checkpoint's
    /// commit (`15m`, `1h 30m`; for a pushed directory, after it is
    /// queued). The answer carries `admission`.
    #[schema(example = "15m")]
    deadline: Option<String>,
    /// Readers (eval ranks starting at once) the replica should expect,
    /// 1 to 10,000,000: an HDFS sink raises the replication of the files
    /// every rank reads to `ceil(readers / readers_per_replica)` before
    /// the publish (its `[sink.hdfs]` settings).
    #[schema(minimum = 1, maximum = 10_000_000)]
    readers: Option<u64>,
}

/// Most readers a transfer or an announcement may say to expect.
const MAX_READERS: u64 = 10_000_000;

/// Checks a `readers` field (1 to [`MAX_READERS`]).
fn check_readers(r: Option<u64>) -> Result<Option<i64>, ApiError> {
    match r {
        None => Ok(None),
        Some(n) if (1..=MAX_READERS).contains(&n) => Ok(Some(n as i64)),
        Some(n) => Err(ApiError::unprocessable(format!(
            "`readers` must be from 1 to {MAX_READERS}, got {n}"
        ))),
    }
}

/// Gives transfer `t` the expected readers `r`, if any.
async fn with_readers(
    src: &Source,
    mut t: ferry_catalog::Transfer,
    r: Option<i64>,
) -> Result<ferry_catalog::Transfer, ApiError> {
    if r.is_some() {
        src.catalog()
            .set_transfer_readers(t.id, r)
            .await
            .map_err(ApiError::catalog)?;
        t.readers = r;
    }
    Ok(t)
}

/// A transfer with its live progress, as the API shows it.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct TransferView {
    #[serde(flatten)]
    transfer: Transfer,
    /// Live progress while it runs (`null` otherwise).
    progress: Option<Progress>,
    /// The admission answer to its deadline, in the answer to the request
    /// that gave one: whether the fluid model of the link has it ready in
    /// time at the current queue and rates, when, and if not, the class
    /// that would, or the bytes over budget.
    #[serde(skip_serializing_if = "Option::is_none")]
    admission: Option<scheduler::Admission>,
}

/// Reads a `deadline` field: an RFC 3339 time or a duration after
/// commit.
fn parse_deadline(s: &str) -> Result<replicator::source::Deadline, ApiError> {
    let s = s.trim();
    if let Ok(t) = humantime::parse_rfc3339_weak(s) {
        let ms = t
            .duration_since(std::time::UNIX_EPOCH)
            .map_err(|_| ApiError::unprocessable("`deadline` is before 1970"))?
            .as_millis();
        return Ok(replicator::source::Deadline::At(
            i64::try_from(ms).unwrap_or(i64::MAX),
        ));
    }
    match humantime::parse_duration(s) {
        Ok(d) if d.as_millis() > 0 && d <= std::time::Duration::from_secs(365 * 24 * 3600) => {
            Ok(replicator::source::Deadline::AfterCommit(d))
        }
        _ => Err(ApiError::unprocessable(format!(
            "`deadline` must be an RFC 3339 time (2026-12-01T10:00:00Z) or a duration after \
             commit from 1ms to 365 days (15m, 1h 30m), got {s:?}"
        ))),
    }
}

/// Gives transfer `t` the deadline `d`, if any, and returns it with the
/// admission answer.
async fn with_deadline(
    src: &Source,
    t: ferry_catalog::Transfer,
    d: Option<replicator::source::Deadline>,
) -> Result<TransferView, ApiError> {
    let Some(d) = d else {
        return Ok(view(src, t));
    };
    let t = src
        .set_deadline(t.id, Some(d))
        .await
        .map_err(ApiError::catalog)?
        .unwrap_or(t);
    let admission = src.admission(&t).await.map_err(ApiError::catalog)?;
    let mut v = view(src, t);
    v.admission = admission;
    Ok(v)
}

/// A transfer with its ranking (`GET /v1/transfers/{id}`).
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct TransferDetail {
    #[serde(flatten)]
    view: TransferView,
    /// Why it ranks where it does: class, score term by term, share.
    ranking: Ranking,
}

/// A transfer with live progress; while it runs, `bytes_total`,
/// `bytes_done` and `bytes_sent` are the larger of the catalog's and the
/// live counts (see [`Source::with_progress`]), so they never move
/// backwards across pause, resume or reconnect.
pub(crate) fn view(src: &Source, t: ferry_catalog::Transfer) -> TransferView {
    let (transfer, progress) = src.with_progress(t);
    TransferView {
        transfer: transfer.into(),
        progress,
        admission: None,
    }
}

/// Queue a transfer of a directory under a source root (any directory:
/// a checkpoint, or a dataset in class `background`).
#[utoipa::path(
    post, path = "/v1/transfers", tag = "source",
    request_body = CreateTransfer,
    security(("bearer" = ["operator"])),
    responses(
        (status = 201, description = "Queued", body = TransferView),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 403, description = "The token's role is below operator", body = ErrorBody),
        (status = 413, description = "Body over 64 KiB", body = ErrorBody),
        (status = 422, description = "A field is invalid; the message names it", body = ErrorBody),
    )
)]
pub(crate) async fn create_transfer(
    State(s): State<AppState>,
    body: Result<Json<CreateTransfer>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    let src = source(&s)?;
    if !req.path.starts_with('/')
        && !replicator::storage::router::is_url(std::path::Path::new(&req.path))
    {
        return Err(ApiError::unprocessable(
            "`path` must be an absolute path at the source, or the hdfs:// or s3:// URL of a \
             checkpoint under a source root there",
        ));
    }
    let class = match req.class.as_deref() {
        None => scheduler::Class::Scheduled,
        Some(c) => c
            .parse()
            .map_err(|e| ApiError::unprocessable(format!("`class`: {e}")))?,
    };
    let deadline = req.deadline.as_deref().map(parse_deadline).transpose()?;
    let readers = check_readers(req.readers)?;
    let t = src
        .submit_as(&PathBuf::from(&req.path), req.link.as_deref(), class)
        .await
        .map_err(submit_error)?;
    let t = with_readers(src, t, readers).await?;
    let v = with_deadline(src, t, deadline).await?;
    Ok((StatusCode::CREATED, Json(v)).into_response())
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
        SubmitError::Catalog(e) => ApiError::catalog(e),
    }
}

/// Body of `POST /v1/checkpoints/announce`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Announce {
    /// Job name.
    #[schema(min_length = 1)]
    job: String,
    /// Training step of the checkpoint.
    step: u64,
    /// Absolute path the checkpoint will be written to, under a source
    /// root.
    #[schema(pattern = "^/")]
    path: String,
    /// Expected size, bytes (0 = unknown).
    #[serde(default)]
    expected_bytes: u64,
    /// When the replica must be ready: an RFC 3339 time or a duration
    /// after the checkpoint's commit (`15m`). The answer's transfer
    /// carries `admission` (before the commit, answered as if it
    /// committed now, with `expected_bytes` as its size).
    #[schema(example = "15m")]
    deadline: Option<String>,
    /// Readers (eval ranks starting at once) the replica should expect,
    /// 1 to 10,000,000, for an HDFS sink's hot-file replication hints.
    #[schema(minimum = 1, maximum = 10_000_000)]
    readers: Option<u64>,
}

/// Answer of `POST /v1/checkpoints/announce`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct AnnounceOutcome {
    /// False if the root's `every_n_steps` skips this step.
    selected: bool,
    /// The queued transfer, when selected.
    #[serde(skip_serializing_if = "Option::is_none")]
    transfer: Option<TransferView>,
    /// Why it was not selected.
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
    /// The job's outlook with this checkpoint's `expected_bytes` as its
    /// size (see `GET /v1/jobs/{job}/outlook`): the backpressure answer
    /// to the training controller.
    #[serde(skip_serializing_if = "Option::is_none")]
    outlook: Option<scheduler::Outlook>,
}

/// A training controller says a checkpoint is coming: the transfer is
/// queued before the first byte is written.
#[utoipa::path(
    post, path = "/v1/checkpoints/announce", tag = "source",
    request_body = Announce,
    security(("bearer" = ["signaler"])),
    responses(
        (status = 201, description = "Queued", body = AnnounceOutcome),
        (status = 200, description = "Not selected (every_n_steps)", body = AnnounceOutcome),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 403, description = "The token's role is below signaler", body = ErrorBody),
        (status = 413, description = "Body over 64 KiB", body = ErrorBody),
        (status = 422, description = "A field is invalid; the message names it", body = ErrorBody),
    )
)]
pub(crate) async fn announce(
    State(s): State<AppState>,
    body: Result<Json<Announce>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    let src = source(&s)?;
    if !req.path.starts_with('/')
        && !replicator::storage::router::is_url(std::path::Path::new(&req.path))
    {
        return Err(ApiError::unprocessable(
            "`path` must be an absolute path at the source, or the hdfs:// or s3:// URL of a \
             checkpoint under a source root there",
        ));
    }
    if req.job.is_empty() {
        return Err(ApiError::unprocessable("`job` must not be empty"));
    }
    let deadline = req.deadline.as_deref().map(parse_deadline).transpose()?;
    let readers = check_readers(req.readers)?;
    let t = src
        .announce(
            &req.job,
            req.step,
            &PathBuf::from(&req.path),
            req.expected_bytes,
        )
        .await
        .map_err(submit_error)?;
    let outlook = src
        .outlook(&req.job, Some(req.expected_bytes))
        .await
        .map_err(ApiError::catalog)?
        .map(|(_, o)| o);
    Ok(match t {
        Some(t) => (
            StatusCode::CREATED,
            Json(AnnounceOutcome {
                selected: true,
                transfer: Some(
                    with_deadline(src, with_readers(src, t, readers).await?, deadline).await?,
                ),
                reason: None,
                outlook,
            }),
        )
            .into_response(),
        None => Json(AnnounceOutcome {
            selected: false,
            transfer: None,
            outlook,
            reason: Some(format!(
                "step {} is not selected by the root's every_n_steps",
                req.step
            )),
        })
        .into_response(),
    })
}

/// A page of transfers.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct TransferPage {
    items: Vec<TransferView>,
    limit: i64,
    offset: i64,
}

/// Transfers with live progress, newest first.
#[utoipa::path(
    get, path = "/v1/transfers", tag = "source",
    params(Page),
    security(("bearer" = ["reader"])),
    responses(
        (status = 200, description = "A page of transfers", body = TransferPage),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 422, description = "`limit` or `offset` out of range", body = ErrorBody),
    )
)]
pub(crate) async fn list_transfers(
    State(s): State<AppState>,
    p: Result<Query<Page>, QueryRejection>,
) -> Result<Json<TransferPage>, ApiError> {
    let Query(p) = p?;
    let (limit, offset) = p.get()?;
    let src = source(&s)?;
    let rows = src
        .catalog()
        .transfers(limit, offset)
        .await
        .map_err(ApiError::catalog)?;
    let items = rows.into_iter().map(|t| view(src, t)).collect();
    Ok(Json(TransferPage {
        items,
        limit,
        offset,
    }))
}

fn transfer_id(id: Result<Path<String>, PathRejection>) -> Result<TransferId, ApiError> {
    let Path(id) = id?;
    let n: i64 = id
        .parse()
        .map_err(|_| ApiError::unprocessable(format!("transfer id {id:?} is not a number")))?;
    // Ids are positive: a negative number names no transfer.
    TransferId::from_i64(n).ok_or_else(|| ApiError::not_found(format!("no transfer {n}")))
}

/// One transfer with its ranking: effective class, score term by term and
/// their inputs, share of the link and ETA.
#[utoipa::path(
    get, path = "/v1/transfers/{id}", tag = "source",
    params(("id" = i64, Path, description = "Transfer id")),
    security(("bearer" = ["reader"])),
    responses(
        (status = 200, description = "The transfer", body = TransferDetail),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 404, description = "No such transfer", body = ErrorBody),
        (status = 422, description = "The id is not a number", body = ErrorBody),
    )
)]
pub(crate) async fn get_transfer(
    State(s): State<AppState>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Json<TransferDetail>, ApiError> {
    let id = transfer_id(id)?;
    let src = source(&s)?;
    let t = src
        .catalog()
        .transfer(id)
        .await
        .map_err(ApiError::catalog)?
        .ok_or_else(|| ApiError::not_found(format!("no transfer {id}")))?;
    let ranking = src.ranking(&t).await.map_err(ApiError::catalog)?;
    Ok(Json(TransferDetail {
        view: view(src, t),
        ranking,
    }))
}

/// An operator or controller request refused by the source, as 404, 409
/// or 422 naming the field.
fn ops_error(e: OpsError) -> ApiError {
    match e {
        OpsError::UnknownJob(_) | OpsError::UnknownTransfer(_) => {
            ApiError::not_found(e.to_string())
        }
        OpsError::Invalid(m) => ApiError::unprocessable(m),
        OpsError::Conflict(m) => ApiError::new(StatusCode::CONFLICT, m),
        OpsError::Catalog(e) => ApiError::catalog(e),
    }
}

macro_rules! action {
    ($name:ident, $verb:literal, $doc:literal) => {
        #[doc = $doc]
        #[utoipa::path(
            post, path = concat!("/v1/transfers/{id}/", $verb), tag = "source",
            params(("id" = i64, Path, description = "Transfer id")),
            security(("bearer" = ["operator"])),
            responses(
                (status = 200, description = "Done; the transfer as it is now", body = TransferView),
                (status = 401, description = "No or unknown token", body = ErrorBody),
                (status = 403, description = "The token's role is below operator", body = ErrorBody),
                (status = 404, description = "No such transfer", body = ErrorBody),
                (status = 409, description = "The transfer's state does not allow it", body = ErrorBody),
                (status = 422, description = "The id is not a number", body = ErrorBody),
            )
        )]
        pub(crate) async fn $name(
            State(s): State<AppState>,
            caller: By,
            id: Result<Path<String>, PathRejection>,
        ) -> Result<Json<TransferView>, ApiError> {
            let id = transfer_id(id)?;
            let src = source(&s)?;
            let t = src.$name(id).await.map_err(ops_error)?;
            tracing::info!(transfer = %id, action = $verb, by = by(&caller), "operator action");
            Ok(Json(view(src, t)))
        }
    };
}

action!(
    pause,
    "pause",
    "Pause a transfer: its batches stop at a chunk boundary; it keeps its place and resumes with `resume` (also after a restart)."
);
action!(
    resume,
    "resume",
    "Resume a paused transfer (it is queued again)."
);
action!(
    cancel,
    "cancel",
    "Cancel a transfer for good; nothing is published."
);

/// Body of `PATCH /v1/transfers/{id}`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct PatchTransfer {
    /// `urgent`, `scheduled` or `background`.
    #[schema(value_type = Option<scheduler::Class>)]
    class: Option<String>,
    /// A number 0..1, or `null` to return to the job's importance.
    #[serde(default, deserialize_with = "some_or_null")]
    #[schema(value_type = Option<f64>, minimum = 0.0, maximum = 1.0)]
    importance: Option<Option<f64>>,
}

/// Tells an absent field (`None`) from an explicit `null` (`Some(None)`).
fn some_or_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Option<f64>>, D::Error> {
    Option::<f64>::deserialize(d).map(Some)
}

/// Set a transfer's class and/or importance override.
#[utoipa::path(
    patch, path = "/v1/transfers/{id}", tag = "source",
    params(("id" = i64, Path, description = "Transfer id")),
    request_body = PatchTransfer,
    security(("bearer" = ["operator"])),
    responses(
        (status = 200, description = "Changed; the transfer as it is now", body = TransferView),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 403, description = "The token's role is below operator", body = ErrorBody),
        (status = 404, description = "No such transfer", body = ErrorBody),
        (status = 409, description = "The transfer has finished", body = ErrorBody),
        (status = 413, description = "Body over 64 KiB", body = ErrorBody),
        (status = 422, description = "A field is invalid; the message names it", body = ErrorBody),
    )
)]
pub(crate) async fn patch_transfer(
    State(s): State<AppState>,
    caller: By,
    id: Result<Path<String>, PathRejection>,
    body: Result<Json<PatchTransfer>, JsonRejection>,
) -> Result<Json<TransferView>, ApiError> {
    let id = transfer_id(id)?;
    let Json(req) = body?;
    if req.class.is_none() && req.importance.is_none() {
        return Err(ApiError::unprocessable(
            "nothing to change: give `class` and/or `importance`",
        ));
    }
    let class = req
        .class
        .as_deref()
        .map(str::parse::<scheduler::Class>)
        .transpose()
        .map_err(|e| ApiError::unprocessable(format!("class: {e}")))?;
    let src = source(&s)?;
    let t = src
        .reprioritise(id, class, req.importance)
        .await
        .map_err(ops_error)?;
    tracing::info!(transfer = %id, class = req.class, importance = ?req.importance, by = by(&caller), "operator changed a transfer");
    Ok(Json(view(src, t)))
}

/// A page of jobs.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct JobPage {
    items: Vec<Job>,
    limit: i64,
    offset: i64,
}

/// Jobs as the scheduler ranks them (from `[[jobs]]` or `PUT /v1/jobs`).
#[utoipa::path(
    get, path = "/v1/jobs", tag = "source",
    params(Page),
    security(("bearer" = ["reader"])),
    responses(
        (status = 200, description = "A page of jobs, by name", body = JobPage),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 422, description = "`limit` or `offset` out of range", body = ErrorBody),
    )
)]
pub(crate) async fn list_jobs(
    State(s): State<AppState>,
    p: Result<Query<Page>, QueryRejection>,
) -> Result<Json<JobPage>, ApiError> {
    let Query(p) = p?;
    let (limit, offset) = p.get()?;
    let src = source(&s)?;
    let jobs = src.catalog().jobs().await.map_err(ApiError::catalog)?;
    let items = jobs
        .into_iter()
        .skip(offset as usize)
        .take(limit as usize)
        .map(Job::from)
        .collect();
    Ok(Json(JobPage {
        items,
        limit,
        offset,
    }))
}

/// Answer of `GET /v1/jobs/{job}/outlook`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct JobOutlook {
    /// The job.
    job: String,
    /// The link its checkpoints go on.
    link: String,
    /// The outlook (times Unix ms, rates bit/s, sizes bytes).
    #[serde(flatten)]
    outlook: scheduler::Outlook,
}

/// What a job can expect from its link now: the backlog ahead of it
/// (bytes, when ready), the expected time to eval-ready of a checkpoint
/// committed now, and, when its checkpoint interval is shorter than that,
/// advice in numbers: replicate every k-th checkpoint, or the link rate
/// that would keep up. From the scheduler's fluid model of the link at
/// the current queue and rates; the checkpoint size and interval are
/// those of the job's recent checkpoints.
#[utoipa::path(
    get, path = "/v1/jobs/{job}/outlook", tag = "source",
    params(("job" = String, Path, description = "Job name")),
    security(("bearer" = ["reader"])),
    responses(
        (status = 200, description = "The job's outlook", body = JobOutlook),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 404, description = "No source root and no transfer of this job", body = ErrorBody),
    )
)]
pub(crate) async fn job_outlook(
    State(s): State<AppState>,
    job: Result<Path<String>, PathRejection>,
) -> Result<Json<JobOutlook>, ApiError> {
    let Path(job) = job?;
    let src = source(&s)?;
    let (link, outlook) = src
        .outlook(&job, None)
        .await
        .map_err(ApiError::catalog)?
        .ok_or_else(|| {
            ApiError::not_found(format!(
                "job {job:?} has no source root here and no transfer: nothing to plan with"
            ))
        })?;
    Ok(Json(JobOutlook { job, link, outlook }))
}

/// Body of `PUT /v1/jobs/{job}`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct PutJob {
    /// Model size in parameters, at most 1e15. Absent: unchanged; `null`
    /// or 0: unknown.
    #[serde(default, deserialize_with = "some_or_null")]
    #[schema(value_type = Option<f64>)]
    model_params: Option<Option<f64>>,
    /// Importance 0..1.
    importance: f64,
}

/// Set a job's model size and importance (kept across restarts, over the
/// config file's `[[jobs]]`).
#[utoipa::path(
    put, path = "/v1/jobs/{job}", tag = "source",
    params(("job" = String, Path, description = "Job name")),
    request_body = PutJob,
    security(("bearer" = ["operator"])),
    responses(
        (status = 200, description = "The job as stored", body = Job),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 403, description = "The token's role is below operator", body = ErrorBody),
        (status = 413, description = "Body over 64 KiB", body = ErrorBody),
        (status = 422, description = "A field is invalid; the message names it", body = ErrorBody),
    )
)]
pub(crate) async fn put_job(
    State(s): State<AppState>,
    caller: By,
    job: Result<Path<String>, PathRejection>,
    body: Result<Json<PutJob>, JsonRejection>,
) -> Result<Json<Job>, ApiError> {
    let Path(job) = job?;
    let Json(req) = body?;
    let src = source(&s)?;
    let j = src
        .put_job(&job, req.model_params, req.importance)
        .await
        .map_err(ops_error)?;
    tracing::info!(
        job,
        importance = req.importance,
        by = by(&caller),
        "operator set a job"
    );
    Ok(Json(j.into()))
}

/// A link and its rate cap.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct LinkView {
    /// Link name.
    name: String,
    /// Rate cap now, bit/s.
    rate_bps: Option<u64>,
    /// QUIC connections the link is served by when all are up.
    connections: Option<usize>,
    /// Of those, open now (fewer after one was lost, 0 while the link is
    /// not connected).
    connections_open: Option<usize>,
    /// For a link naming several sink agents: the one its connections go
    /// to now (absent while not connected, and for a link to one sink
    /// agent).
    #[serde(skip_serializing_if = "Option::is_none")]
    sink: Option<String>,
}

fn link_view(src: &Source, name: &str) -> LinkView {
    let pool = src.link_pool(name);
    LinkView {
        name: name.to_string(),
        rate_bps: src.link_rate(name),
        connections: pool.map(|p| p.0),
        connections_open: pool.map(|p| p.1),
        sink: src.link_sink(name),
    }
}

/// A page of links.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct LinkPage {
    items: Vec<LinkView>,
    limit: i64,
    offset: i64,
}

/// The source's links and their rate caps.
#[utoipa::path(
    get, path = "/v1/links", tag = "source",
    params(Page),
    security(("bearer" = ["reader"])),
    responses(
        (status = 200, description = "A page of links, by name", body = LinkPage),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 422, description = "`limit` or `offset` out of range", body = ErrorBody),
    )
)]
pub(crate) async fn list_links(
    State(s): State<AppState>,
    p: Result<Query<Page>, QueryRejection>,
) -> Result<Json<LinkPage>, ApiError> {
    let Query(p) = p?;
    let (limit, offset) = p.get()?;
    let src = source(&s)?;
    let mut names = src.links();
    names.sort();
    let items = names
        .iter()
        .skip(offset as usize)
        .take(limit as usize)
        .map(|n| link_view(src, n))
        .collect();
    Ok(Json(LinkPage {
        items,
        limit,
        offset,
    }))
}

/// Smallest and largest rate cap accepted, bit/s (1 kbit/s and 10 Tbit/s,
/// as [`ferry_proto::units::RATE_RANGE`]).
pub const RATE_BOUNDS: (u64, u64) = ferry_proto::units::RATE_RANGE;

/// Body of `PUT /v1/links/{link}`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct PutLink {
    /// New rate cap, bit/s (1,000 to 10^13).
    #[schema(minimum = 1000, maximum = 10_000_000_000_000_u64)]
    rate_bps: u64,
}

/// Change a link's rate cap live. On a single agent it lasts until the
/// agent restarts (then the config's `rate` holds again); in a pool it
/// is the pool's setting `link.NAME.rate`, kept in the catalog and
/// applied by every agent within about a second.
#[utoipa::path(
    put, path = "/v1/links/{link}", tag = "source",
    params(("link" = String, Path, description = "Link name")),
    request_body = PutLink,
    security(("bearer" = ["operator"])),
    responses(
        (status = 200, description = "The link as it is now", body = LinkView),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 403, description = "The token's role is below operator", body = ErrorBody),
        (status = 404, description = "No such link", body = ErrorBody),
        (status = 413, description = "Body over 64 KiB", body = ErrorBody),
        (status = 422, description = "`rate_bps` out of range", body = ErrorBody),
    )
)]
pub(crate) async fn put_link(
    State(s): State<AppState>,
    caller: By,
    link: Result<Path<String>, PathRejection>,
    body: Result<Json<PutLink>, JsonRejection>,
) -> Result<Json<LinkView>, ApiError> {
    let Path(link) = link?;
    let Json(req) = body?;
    let src = source(&s)?;
    if !(RATE_BOUNDS.0..=RATE_BOUNDS.1).contains(&req.rate_bps) {
        return Err(ApiError::unprocessable(format!(
            "`rate_bps` must be from {} to {} bit/s (1kbit/s to 10Tbit/s), got {}",
            RATE_BOUNDS.0, RATE_BOUNDS.1, req.rate_bps
        )));
    }
    if !src
        .set_link_rate_as(&link, req.rate_bps, by(&caller))
        .await
        .map_err(ApiError::catalog)?
    {
        return Err(ApiError::not_found(format!("unknown link {link:?}")));
    }
    tracing::info!(
        link,
        rate_bps = req.rate_bps,
        by = by(&caller),
        "link rate cap changed"
    );
    Ok(Json(link_view(src, &link)))
}

/// Body of `POST /v1/signals`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct PostSignal {
    /// Job name.
    job: String,
    /// `loss_spike`, `grad_norm_spike`, `nan`, `eval_regression` or
    /// `manual`.
    kind: String,
    /// 0..1.
    severity: f64,
    /// Training step, if known (0 or more).
    step: Option<i64>,
    /// A retry with the same key (1 to 200 bytes) answers the first
    /// signal's outcome and changes nothing.
    idempotency_key: Option<String>,
}

/// An anomaly signal from a training controller: the job's score rises and
/// its newest unpublished checkpoint becomes `urgent` for a while.
#[utoipa::path(
    post, path = "/v1/signals", tag = "source",
    request_body = PostSignal,
    security(("bearer" = ["signaler"])),
    responses(
        (status = 201, description = "Stored; what it did", body = SignalOutcome),
        (status = 200, description = "The idempotency key was seen before; the first outcome", body = SignalOutcome),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 403, description = "The token's role is below signaler", body = ErrorBody),
        (status = 404, description = "Unknown job", body = ErrorBody),
        (status = 413, description = "Body over 64 KiB", body = ErrorBody),
        (status = 422, description = "A field is invalid; the message names it", body = ErrorBody),
    )
)]
pub(crate) async fn post_signal(
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
    let out: SignalOutcome = src
        .signal(
            &req.job,
            &req.kind,
            req.severity,
            req.step,
            req.idempotency_key.as_deref(),
        )
        .await
        .map_err(ops_error)?
        .into();
    let status = if out.new {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(out)).into_response())
}

/// A page of signals.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct SignalPage {
    items: Vec<Signal>,
    limit: i64,
    offset: i64,
}

/// Signals received, newest first.
#[utoipa::path(
    get, path = "/v1/signals", tag = "source",
    params(Page),
    security(("bearer" = ["reader"])),
    responses(
        (status = 200, description = "A page of signals", body = SignalPage),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 422, description = "`limit` or `offset` out of range", body = ErrorBody),
    )
)]
pub(crate) async fn list_signals(
    State(s): State<AppState>,
    p: Result<Query<Page>, QueryRejection>,
) -> Result<Json<SignalPage>, ApiError> {
    let Query(p) = p?;
    let (limit, offset) = p.get()?;
    let src = source(&s)?;
    let items = src
        .catalog()
        .signals_page(limit, offset)
        .await
        .map_err(ApiError::catalog)?;
    Ok(Json(SignalPage {
        items: items.into_iter().map(Signal::from).collect(),
        limit,
        offset,
    }))
}

/// Media type of `GET /v1/trace`: JSON lines.
pub const TRACE_CONTENT_TYPE: &str = "application/x-ndjson";

/// Query of `GET /v1/trace`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct TraceQuery {
    /// Start of the trace, Unix milliseconds (default 0: all that was
    /// recorded). Events made at or after it are lines; the header holds
    /// the rate caps and jobs in force then, and transfers queued then
    /// arrive again at it.
    #[param(value_type = Option<i64>, minimum = 0)]
    since: Option<String>,
}

/// `since` as Unix ms: an integer, 0 or more.
fn since_ms(since: Option<&str>) -> Result<i64, ApiError> {
    let Some(v) = since else {
        return Ok(0);
    };
    match v.trim().parse::<i64>() {
        Ok(ms) if ms >= 0 => Ok(ms),
        _ => Err(ApiError::unprocessable(format!(
            "`since` must be a time in Unix milliseconds (an integer, 0 or more), got {v:?}"
        ))),
    }
}

/// The source's recorded scheduling history as a trace for `ferry replay
/// FILE`: JSON lines in the trace format, version 1 (a header with the
/// links' rate caps and RTTs and the jobs' sizes and importances at
/// `since`, then one event per line in time order: arrivals, class and
/// importance changes, job changes, pauses, resumes, cancels, rate changes
/// and signals; times in Unix ms, rates in bit/s). Transfers queued at
/// `since` arrive again at `since` as they were then; an arrival whose size
/// was unknown when it was recorded carries the transfer's size now.
#[utoipa::path(
    get, path = "/v1/trace", tag = "source",
    params(TraceQuery),
    security(("bearer" = ["operator"])),
    responses(
        (status = 200, description = "The trace, one JSON object per line: the header \
            (`{\"ferry_trace\": 1, \"links\": [...], \"jobs\": [...]}`), then the events \
            (`{\"at_ms\": ..., \"event\": \"arrival\", ...}`)",
            content_type = "application/x-ndjson", body = String),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 403, description = "The token's role is below operator", body = ErrorBody),
        (status = 422, description = "`since` is not a time in Unix milliseconds", body = ErrorBody),
    )
)]
pub(crate) async fn trace(
    State(s): State<AppState>,
    caller: By,
    q: Result<Query<TraceQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) = q?;
    let since = since_ms(q.since.as_deref())?;
    let src = source(&s)?;
    let x = src.trace(since).await.map_err(ApiError::catalog)?;
    if x.left_out > 0 {
        tracing::warn!(
            since,
            left_out = x.left_out,
            "trace: recorded events left out (on links no longer configured, or about a \
             transfer that has not arrived in the trace)"
        );
    }
    tracing::info!(
        since,
        events = x.trace.events.len(),
        arrivals = x.trace.arrivals(),
        by = by(&caller),
        "trace exported"
    );
    Ok((
        [(header::CONTENT_TYPE, TRACE_CONTENT_TYPE)],
        x.trace.to_json_lines(),
    )
        .into_response())
}

/// One shared setting as this agent uses it.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct SettingView {
    /// `scheduler.max_active`, `scheduler.weights.severity`, ... (the
    /// config file's keys under `[scheduler]`) or `link.NAME.rate`
    /// (bit/s).
    name: String,
    /// The value in use: a number, or a string for durations (`"10m"`)
    /// and the policy's name.
    value: serde_json::Value,
    /// When the pool's catalog stored it (Unix ms); `null` when it is
    /// this agent's config value (a single agent).
    updated_at: Option<i64>,
    /// Who stored it: `config of AGENT` (seeded from that agent's
    /// config) or an API token's name; `null` as `updated_at`.
    updated_by: Option<String>,
}

/// The settings a pool shares (`GET /v1/settings`).
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct SettingsView {
    /// True in a pool (PostgreSQL catalog): the values are the catalog's,
    /// every agent of the pool uses them and a change reaches them all
    /// within about a second. False on a single agent (SQLite): its
    /// config's values; a link's rate may be changed until a restart.
    shared: bool,
    /// The scheduler's settings, then each link's rate cap, by name, then
    /// each job's `importance` and `model_params` (`null`: unknown).
    items: Vec<SettingView>,
}

async fn settings_view(src: &Source) -> Result<SettingsView, ApiError> {
    let shared = src.catalog().dialect() == ferry_catalog::dialect::Dialect::Postgres;
    let stored = if shared {
        src.catalog().settings().await.map_err(ApiError::catalog)?
    } else {
        Vec::new()
    };
    let mut values = replicator::settings::policy_settings(&src.policy());
    let mut links = src.links();
    links.sort();
    for l in &links {
        if let Some(bps) = src.link_rate(l) {
            values.push((
                replicator::settings::link_rate_setting(l),
                serde_json::json!(bps),
            ));
        }
    }
    let mut items: Vec<SettingView> = values
        .into_iter()
        .map(|(name, value)| {
            let s = stored.iter().find(|s| s.name == name);
            SettingView {
                updated_at: s.map(|s| s.updated_at),
                updated_by: s.map(|s| s.updated_by.clone()),
                name,
                value,
            }
        })
        .collect();
    // Each job's importance and model size (the jobs table; `updated_by`
    // says whether a config or the API wrote them last).
    for j in src.catalog().jobs().await.map_err(ApiError::catalog)? {
        let by = Some(j.origin.clone());
        items.push(SettingView {
            name: format!("job.{}.importance", j.name),
            value: serde_json::json!(j.importance),
            updated_at: Some(j.updated_at),
            updated_by: by.clone(),
        });
        items.push(SettingView {
            name: format!("job.{}.model_params", j.name),
            value: j
                .model_params
                .map_or(serde_json::Value::Null, |p| serde_json::json!(p)),
            updated_at: Some(j.updated_at),
            updated_by: by,
        });
    }
    Ok(SettingsView { shared, items })
}

/// The scheduler's settings and the links' rate caps this agent uses: in
/// a pool, the values of the pool's catalog.
#[utoipa::path(
    get, path = "/v1/settings", tag = "source",
    security(("bearer" = ["reader"])),
    responses(
        (status = 200, description = "The settings in use", body = SettingsView),
        (status = 401, description = "No or unknown token", body = ErrorBody),
    )
)]
pub(crate) async fn get_settings(
    State(s): State<AppState>,
) -> Result<Json<SettingsView>, ApiError> {
    Ok(Json(settings_view(source(&s)?).await?))
}

/// Body of `PUT /v1/settings/{name}`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct PutSetting {
    /// The new value: a JSON number or string, or its text as typed
    /// (`"2Gbit/s"` or `"2Gbit"` for a rate, `"10m"` for a duration,
    /// `"16MiB"` for a size, `"8"` for a number).
    value: serde_json::Value,
}

/// Change a setting for the whole pool: `scheduler.*` (a pool only: a
/// single agent takes `[scheduler]` from its config), `link.NAME.rate`
/// (as `PUT /v1/links/{link}`), `job.NAME.importance` or
/// `job.NAME.model_params` (as `PUT /v1/jobs/{job}`). In a pool the value
/// is stored in the catalog and every agent applies it within about a
/// second.
#[utoipa::path(
    put, path = "/v1/settings/{name}", tag = "source",
    params(("name" = String, Path, description = "Setting name, e.g. scheduler.max_active")),
    request_body = PutSetting,
    security(("bearer" = ["operator"])),
    responses(
        (status = 200, description = "The settings in use after the change", body = SettingsView),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 403, description = "The token's role is below operator", body = ErrorBody),
        (status = 404, description = "No such link or job", body = ErrorBody),
        (status = 409, description = "A scheduler setting on a single agent (SQLite catalog)", body = ErrorBody),
        (status = 413, description = "Body over 64 KiB", body = ErrorBody),
        (status = 422, description = "Unknown setting or bad value; the message names it", body = ErrorBody),
    )
)]
pub(crate) async fn put_setting(
    State(s): State<AppState>,
    caller: By,
    name: Result<Path<String>, PathRejection>,
    body: Result<Json<PutSetting>, JsonRejection>,
) -> Result<Json<SettingsView>, ApiError> {
    let Path(name) = name?;
    let Json(req) = body?;
    let src = source(&s)?;
    if let Some(link) = replicator::settings::link_of_setting(&name) {
        let v = replicator::settings::parse_value(&name, &req.value)
            .map_err(ApiError::unprocessable)?;
        let bps = v.as_u64().unwrap_or(0);
        if !(RATE_BOUNDS.0..=RATE_BOUNDS.1).contains(&bps) {
            return Err(ApiError::unprocessable(format!(
                "{name} must be from 1kbit/s to 10Tbit/s, got {}",
                ferry_proto::units::format_rate(bps)
            )));
        }
        if !src
            .set_link_rate_as(link, bps, by(&caller))
            .await
            .map_err(ApiError::catalog)?
        {
            return Err(ApiError::not_found(format!("unknown link {link:?}")));
        }
        tracing::info!(
            link,
            rate_bps = bps,
            by = by(&caller),
            "link rate cap changed"
        );
    } else if let Some(rest) = name.strip_prefix("job.") {
        let (job, field) = rest.rsplit_once('.').unwrap_or((rest, ""));
        let number = |v: &serde_json::Value| match v {
            serde_json::Value::Number(n) => n.as_f64(),
            serde_json::Value::String(t) => t.trim().parse::<f64>().ok(),
            _ => None,
        };
        let v = number(&req.value)
            .filter(|v| v.is_finite())
            .ok_or_else(|| ApiError::unprocessable(format!("{name} must be a number")))?;
        let current = src.catalog().job(job).await.map_err(ApiError::catalog)?;
        let j = match field {
            "importance" => {
                // A typo must not create a job: new jobs come from the
                // config or `PUT /v1/jobs/{job}`.
                if !src.known_job(job).await.map_err(ApiError::catalog)? {
                    return Err(ApiError::not_found(format!(
                        "unknown job {job:?} (GET /v1/jobs lists them; PUT /v1/jobs/{{job}} \
                         adds one)"
                    )));
                }
                src.put_job(job, None, v).await
            }
            "model_params" => {
                let Some(c) = current else {
                    return Err(ApiError::not_found(format!(
                        "unknown job {job:?} (GET /v1/jobs lists them; PUT /v1/jobs/{{job}} \
                         adds one)"
                    )));
                };
                src.put_job(job, Some(Some(v)), c.importance).await
            }
            _ => {
                return Err(ApiError::unprocessable(format!(
                    "unknown setting {name:?}: a job's settings are job.NAME.importance and \
                     job.NAME.model_params"
                )))
            }
        }
        .map_err(ops_error)?;
        tracing::info!(
            job,
            importance = j.importance,
            model_params = %j.model_params.map_or("unknown".to_string(), |p| p.to_string()),
            by = by(&caller),
            "operator set a job"
        );
    } else {
        let stored = src
            .put_policy_setting(&name, &req.value, by(&caller))
            .await
            .map_err(ops_error)?;
        tracing::info!(
            setting = name,
            value = %stored.value,
            by = by(&caller),
            "scheduler setting changed for the pool"
        );
    }
    Ok(Json(settings_view(src).await?))
}
