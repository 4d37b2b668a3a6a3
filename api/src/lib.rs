//! Ferry's REST API (axum): resolve and replicas (pin, unpin, remove) on
//! sinks; transfers,
//! jobs, links, signals, announcements and the recorded scheduling history
//! (`GET /v1/trace`, JSON lines for `ferry replay`) on sources; health,
//! metrics, the OpenAPI document and the ops web UI everywhere.
//!
//! Each agent serves the routes of the roles it has; `GET /openapi.json`
//! (OpenAPI 3.1, generated from the handlers' annotations) lists exactly
//! those, with the token role each needs as its security requirement.
//! Errors are JSON objects `{"error": "<message naming the problem>"}`:
//! 401 without a valid token, 403 when its role is too low, 404, 409, 413
//! for a body over [`MAX_BODY`], 422 naming the invalid field, 408 when a
//! request outlives its timeout. Lists take `limit` (1..1000, default 100)
//! and `offset` and answer `{"items", "limit", "offset"}`.
//!
//! Auth: see [`auth`]. `/`, `/healthz` and `/openapi.json` need no token.

pub mod auth;
pub mod error;
mod metrics;
pub mod model;
mod pool_api;
mod sink_api;
mod source_api;
mod ui;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode, Uri};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use replicator::sink::Sink;
use replicator::source::Source;
use serde::{Deserialize, Serialize};
use tower_http::timeout::TimeoutLayer;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

pub use auth::{Auth, Role, TokenEntry};
pub use error::{ApiError, ErrorBody};
pub use source_api::{RATE_BOUNDS, TRACE_CONTENT_TYPE};

/// Largest request body accepted, in bytes (64 KiB).
pub const MAX_BODY: usize = 64 << 10;

/// Longest `wait` honoured by resolve.
pub const MAX_WAIT: Duration = Duration::from_secs(300);

/// Timeout of every request but the long polls (resolve with `wait`), and
/// of reading a request's headers.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// What the handlers can reach; cheap to clone.
#[derive(Debug, Clone)]
pub struct AppState {
    /// This agent's name.
    pub agent: String,
    /// The source role, if this agent has it.
    pub source: Option<Source>,
    /// The sink role, if this agent has it.
    pub sink: Option<Sink>,
    /// Who may do what.
    pub auth: Auth,
    /// The OpenAPI document, serialised once the router is built.
    openapi: Arc<OnceLock<String>>,
    /// What the live views share.
    live: Arc<ui::Live>,
    /// The agent's membership of its site's pool (`None` in tests that
    /// start a bare source or sink).
    pub pool: Option<replicator::pool::Membership>,
}

impl AppState {
    /// State for an agent named `agent` with the given roles and access
    /// rule.
    pub fn new(agent: String, source: Option<Source>, sink: Option<Sink>, auth: Auth) -> Self {
        AppState {
            agent,
            source,
            sink,
            auth,
            openapi: Arc::new(OnceLock::new()),
            live: Arc::default(),
            pool: None,
        }
    }

    /// The same state with the agent's pool membership (`/v1/pool`,
    /// `/v1/agents/{name}/drain`, the pool's metrics).
    pub fn with_pool(mut self, pool: replicator::pool::Membership) -> Self {
        self.pool = Some(pool);
        self
    }

    /// The roles this agent has, as named in `/healthz`.
    pub fn roles(&self) -> Vec<&'static str> {
        let mut roles = Vec::new();
        if self.source.is_some() {
            roles.push("source");
        }
        if self.sink.is_some() {
            roles.push("sink");
        }
        roles
    }
}

/// `limit` and `offset` of a list.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct Page {
    /// Items per page, 1..1000 (default 100).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<i64>,
    /// Items to skip (default 0).
    #[param(minimum = 0, maximum = 4294967295_i64)]
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
        if !(0..=i64::from(u32::MAX)).contains(&offset) {
            return Err(ApiError::unprocessable(
                "`offset` must be from 0 to 4294967295",
            ));
        }
        Ok((limit, offset))
    }
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Ferry agent API",
        description = "Replicas and checkpoint paths (sink), transfers, jobs, links, signals and the \
                       recorded scheduling history as a trace for `ferry replay` (source). \
                       Send `Authorization: Bearer <token>`; each operation's security requirement names \
                       the lowest role that may call it (reader < signaler < operator).",
        license(name = "Apache-2.0", identifier = "Apache-2.0")
    ),
    modifiers(&BearerScheme),
    tags(
        (name = "agent", description = "Every agent"),
        (name = "sink", description = "Agents with the sink role"),
        (name = "source", description = "Agents with the source role"),
    )
)]
struct ApiDoc;

struct BearerScheme;

impl utoipa::Modify for BearerScheme {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let c = openapi.components.get_or_insert_with(Default::default);
        c.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "A token from `ferry token new --role reader|signaler|operator`; \
                         the scopes of a requirement name the lowest role allowed",
                    ))
                    .build(),
            ),
        );
    }
}

/// Builds the router for `state`: the routes of the agent's roles, each
/// behind the role it needs.
pub fn router(state: AppState) -> Router {
    build(state).0
}

/// The router and the OpenAPI document describing exactly its routes.
pub fn build(state: AppState) -> (Router, utoipa::openapi::OpenApi) {
    let guard = |role| {
        middleware::from_fn_with_state(
            auth::Guard {
                auth: state.auth.clone(),
                role,
            },
            auth::require,
        )
    };

    let open: OpenApiRouter<AppState> = OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(healthz))
        .routes(routes!(openapi_json))
        .routes(routes!(ui::index))
        .route_layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            REQUEST_TIMEOUT,
        ));
    let long_timeout = MAX_WAIT + REQUEST_TIMEOUT;
    // (routes, the role they need, their timeout); axum refuses a
    // route layer on a group without routes, so only filled ones are kept.
    let mut groups: Vec<(OpenApiRouter<AppState>, Role, Option<Duration>)> = vec![
        (
            OpenApiRouter::new()
                .routes(routes!(ui::status))
                .routes(routes!(metrics::handler))
                .routes(routes!(whoami)),
            Role::Reader,
            Some(REQUEST_TIMEOUT),
        ),
        // A stream: no timeout; it ends when the client goes away.
        (
            OpenApiRouter::new().routes(routes!(ui::events)),
            Role::Reader,
            None,
        ),
    ];
    if state.sink.is_some() {
        // A stream: no timeout.
        groups.push((
            OpenApiRouter::new().routes(routes!(sink_api::replica_events)),
            Role::Reader,
            None,
        ));
        groups.push((
            OpenApiRouter::new()
                .routes(routes!(sink_api::replicas))
                .routes(routes!(sink_api::list_leases))
                .routes(routes!(sink_api::get_retention))
                .routes(routes!(sink_api::renew_lease))
                .routes(routes!(sink_api::release_lease)),
            Role::Reader,
            Some(REQUEST_TIMEOUT),
        ));
        groups.push((
            OpenApiRouter::new().routes(routes!(sink_api::resolve)),
            Role::Reader,
            Some(long_timeout),
        ));
        groups.push((
            OpenApiRouter::new()
                .routes(routes!(sink_api::remove_replica))
                .routes(routes!(sink_api::put_retention))
                .routes(routes!(sink_api::pin_replica, sink_api::unpin_replica)),
            Role::Operator,
            Some(REQUEST_TIMEOUT),
        ));
    }
    if state.pool.is_some() {
        groups.push((
            OpenApiRouter::new().routes(routes!(pool_api::get_pool)),
            Role::Reader,
            Some(REQUEST_TIMEOUT),
        ));
        groups.push((
            OpenApiRouter::new()
                .routes(routes!(pool_api::drain, pool_api::undrain))
                .routes(routes!(pool_api::forget)),
            Role::Operator,
            Some(REQUEST_TIMEOUT),
        ));
    }
    if state.source.is_some() {
        let reader = OpenApiRouter::new()
            .routes(routes!(source_api::list_transfers))
            .routes(routes!(source_api::get_transfer))
            .routes(routes!(source_api::list_jobs))
            .routes(routes!(source_api::job_outlook))
            .routes(routes!(source_api::list_links))
            .routes(routes!(source_api::list_signals))
            .routes(routes!(source_api::get_settings));
        let signaler = OpenApiRouter::new()
            .routes(routes!(source_api::post_signal))
            .routes(routes!(source_api::announce));
        let operator = OpenApiRouter::new()
            .routes(routes!(source_api::create_transfer))
            .routes(routes!(source_api::patch_transfer))
            .routes(routes!(source_api::pause))
            .routes(routes!(source_api::resume))
            .routes(routes!(source_api::cancel))
            .routes(routes!(source_api::put_job))
            .routes(routes!(source_api::put_link))
            .routes(routes!(source_api::put_setting))
            .routes(routes!(source_api::trace));
        groups.push((reader, Role::Reader, Some(REQUEST_TIMEOUT)));
        groups.push((signaler, Role::Signaler, Some(REQUEST_TIMEOUT)));
        groups.push((operator, Role::Operator, Some(REQUEST_TIMEOUT)));
    }
    let mut api = open;
    for (routes, role, timeout) in groups {
        let mut routes = routes.route_layer(guard(role));
        if let Some(t) = timeout {
            routes = routes.route_layer(TimeoutLayer::with_status_code(
                StatusCode::REQUEST_TIMEOUT,
                t,
            ));
        }
        api = api.merge(routes);
    }
    let (router, doc) = api.split_for_parts();
    let _ = state
        .openapi
        .set(doc.to_pretty_json().unwrap_or_else(|_| "{}".into()));
    let router = router
        .fallback(no_route)
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        .layer(middleware::from_fn(error::same_origin))
        .layer(middleware::from_fn(error::json_errors))
        .with_state(state);
    (router, doc)
}

async fn no_route(method: axum::http::Method, uri: Uri, State(s): State<AppState>) -> ApiError {
    let roles = s.roles();
    let roles = match roles.as_slice() {
        [] => "this agent has no role".to_string(),
        [one] => format!("this agent's role is {one}"),
        many => format!("this agent's roles are {}", many.join(" and ")),
    };
    ApiError::not_found(format!(
        "no such route: {method} {} ({roles}; GET /openapi.json lists its routes)",
        uri.path()
    ))
}

/// Answer of `GET /healthz`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
struct Health {
    /// Always `ok` when the agent answers.
    status: &'static str,
    /// Agent name.
    agent: String,
    /// `source` and/or `sink`.
    roles: Vec<&'static str>,
}

/// Liveness, the agent's name and roles. No token needed.
#[utoipa::path(
    get, path = "/healthz", tag = "agent",
    security(()),
    responses((status = 200, description = "The agent is up", body = Health))
)]
async fn healthz(State(s): State<AppState>) -> Json<Health> {
    Json(Health {
        status: "ok",
        roles: s.roles(),
        agent: s.agent,
    })
}

/// This document: the routes this agent serves (OpenAPI 3.1). No token
/// needed.
#[utoipa::path(
    get, path = "/openapi.json", tag = "agent",
    security(()),
    responses((status = 200, description = "OpenAPI 3.1 document", content_type = "application/json"))
)]
async fn openapi_json(State(s): State<AppState>) -> Response {
    let doc = s.openapi.get().cloned().unwrap_or_else(|| "{}".into());
    ([(header::CONTENT_TYPE, "application/json")], doc).into_response()
}

/// Who the caller is (`GET /v1/whoami`).
#[derive(Debug, Serialize, utoipa::ToSchema)]
struct WhoAmI {
    /// The token's configured name (`anonymous` without a token on an
    /// agent with `allow_unauthenticated`).
    name: String,
    /// Its role.
    role: Role,
}

/// The caller's token name and role (the UI shows it and offers actions
/// only to operators).
#[utoipa::path(
    get, path = "/v1/whoami", tag = "agent",
    security(("bearer" = ["reader"])),
    responses(
        (status = 200, description = "The caller", body = WhoAmI),
        (status = 401, description = "No or unknown token", body = ErrorBody),
    )
)]
async fn whoami(caller: Option<axum::Extension<auth::Caller>>) -> Result<Json<WhoAmI>, ApiError> {
    let axum::Extension(c) =
        caller.ok_or_else(|| ApiError::internal("whoami reached without authentication"))?;
    Ok(Json(WhoAmI {
        name: c.name,
        role: c.role,
    }))
}

#[cfg(test)]
mod tests;
