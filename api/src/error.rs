//! Error answers: every error is a JSON object `{"error": "<message>"}`
//! whose message names what was wrong.

use axum::body::Body;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::http::{header, HeaderValue, Request, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use serde_json::json;

/// The body of every error answer.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// What was wrong, naming the field, path or role concerned.
    pub error: String,
}

/// An error answer: status code and a message naming the problem.
#[derive(Debug)]
pub struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) message: String,
}

impl ApiError {
    /// An answer with `status` and `message`.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
        }
    }
    /// 422: a field is missing or invalid; the message names it.
    pub fn unprocessable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, message)
    }
    /// 404 with `message`.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }
    /// 500; the cause goes to the agent's log, not to the client.
    pub fn internal(e: impl std::fmt::Display) -> Self {
        tracing::error!(error = %e, "internal error");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal error; see the agent's log",
        )
    }
}

impl ApiError {
    /// 503 when the catalog's server does not answer
    /// ([`ferry_catalog::CatalogError::is_unavailable`]): the message says
    /// so and that the request may be retried when it is back (the
    /// agent's `/v1/status` and `ferry_catalog_up` show when). Any other
    /// catalog error is a 500 as [`ApiError::internal`].
    pub fn catalog(e: ferry_catalog::CatalogError) -> Self {
        if e.is_unavailable() {
            tracing::warn!(error = %e, "a request needs the catalog, which does not answer");
            Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the catalog does not answer ({e}); retry when it is back"),
            )
        } else {
            Self::internal(e)
        }
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

impl From<PathRejection> for ApiError {
    fn from(r: PathRejection) -> Self {
        ApiError::unprocessable(r.body_text())
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        let status = match r.status() {
            StatusCode::PAYLOAD_TOO_LARGE => {
                return ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!(
                        "request body larger than {} bytes (64 KiB)",
                        crate::MAX_BODY
                    ),
                )
            }
            StatusCode::UNSUPPORTED_MEDIA_TYPE => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            _ => StatusCode::UNPROCESSABLE_ENTITY,
        };
        ApiError::new(status, r.body_text())
    }
}

/// Middleware: an error answer that is not JSON already (axum's 405, the
/// timeout's 408, a body limit's 413) gets a JSON body naming the request,
/// so that clients see one error shape everywhere.
pub(crate) async fn json_errors(req: Request<Body>, next: Next) -> Response {
    let what = format!("{} {}", req.method(), req.uri().path());
    let resp = next.run(req).await;
    let status = resp.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return resp;
    }
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if is_json {
        return resp;
    }
    let message = match status {
        StatusCode::METHOD_NOT_ALLOWED => format!("{what}: method not allowed on this route"),
        StatusCode::REQUEST_TIMEOUT => format!("{what}: the request timed out"),
        StatusCode::PAYLOAD_TOO_LARGE => format!(
            "{what}: request body larger than {} bytes (64 KiB)",
            crate::MAX_BODY
        ),
        s => format!(
            "{what}: {}",
            s.canonical_reason().unwrap_or("request failed")
        ),
    };
    let (mut parts, _) = resp.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let body = serde_json::to_vec(&json!({ "error": message })).unwrap_or_default();
    Response::from_parts(parts, Body::from(body))
}

/// Middleware: a request that changes something (not GET or HEAD) and
/// comes from a web page of another origin is refused with 403. Browsers
/// send `Origin` with such requests; without this an agent with
/// `allow_unauthenticated` could be steered by any page its operator
/// visits. Clients that send no `Origin` (the CLI, curl) are unaffected.
pub(crate) async fn same_origin(req: Request<Body>, next: Next) -> Response {
    use axum::http::Method;
    if req.method() == Method::GET || req.method() == Method::HEAD {
        return next.run(req).await;
    }
    let origin = req.headers().get(header::ORIGIN).map(|o| o.as_bytes());
    let host = req.headers().get(header::HOST).map(|h| h.as_bytes());
    if let Some(origin) = origin {
        // `scheme://host[:port]` must name this agent's `Host`.
        let origin_host = origin
            .iter()
            .position(|&b| b == b':')
            .and_then(|i| origin.get(i + 3..));
        if origin_host.is_none() || origin_host != host {
            return ApiError::new(
                StatusCode::FORBIDDEN,
                format!(
                    "{} {}: refused a cross-origin request (Origin {:?} is not this agent)",
                    req.method(),
                    req.uri().path(),
                    String::from_utf8_lossy(origin)
                ),
            )
            .into_response();
        }
    }
    next.run(req).await
}
