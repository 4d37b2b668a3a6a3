//! `GET /metrics`: the agent's Prometheus metrics in the text exposition
//! format (version 0.0.4), its source's and its sink's (see
//! [`replicator::metrics`] for the names and what each counts).

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};

use crate::{ApiError, AppState};

/// The agent's metrics in Prometheus text format 0.0.4: bytes sent per
/// link and class, link capacity and utilisation, queue depth per class,
/// transfers per state, chunk retries, verification failures, the
/// commit-to-replica lag histogram. A catalog failure is a JSON 500.
#[utoipa::path(
    get, path = "/metrics", tag = "agent",
    security(("bearer" = ["reader"])),
    responses(
        (status = 200, description = "Prometheus text exposition", content_type = "text/plain; version=0.0.4"),
        (status = 401, description = "No or unknown token", body = crate::ErrorBody),
    )
)]
pub(crate) async fn handler(State(s): State<AppState>) -> Response {
    match render(&s).await {
        Ok(text) => (
            [(header::CONTENT_TYPE, replicator::metrics::CONTENT_TYPE)],
            text,
        )
            .into_response(),
        Err(e) => ApiError::internal(e).into_response(),
    }
}

/// The source's metrics first, then the sink's, for whichever roles the
/// agent has. Gauges computed at scrape time are updated first (this reads
/// the catalog).
async fn render(s: &AppState) -> Result<String, replicator::metrics::MetricsError> {
    let mut out = String::new();
    if let Some(source) = &s.source {
        out += &source.render_metrics().await?;
    }
    if let Some(sink) = &s.sink {
        out += &sink.render_metrics().await?;
    }
    if let Some(pool) = &s.pool {
        out += &pool.render_metrics().await?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use ferry_catalog::Catalog;
    use replicator::sink::{Sink, SinkConfig};
    use replicator::transport::{self, SocketKind};
    use tower::ServiceExt;

    use crate::{router, AppState};

    async fn get_metrics(state: AppState) -> (StatusCode, String, String) {
        let req = Request::get("/metrics").body(Body::empty()).unwrap();
        let resp = router(state).oneshot(req).await.unwrap();
        let status = resp.status();
        let ct = resp
            .headers()
            .get("content-type")
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default();
        let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap();
        (status, ct, String::from_utf8(body.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn a_sink_serves_its_metrics_as_prometheus_text() {
        let d = tempfile::tempdir().unwrap();
        let catalog = Catalog::open(&d.path().join("data")).await.unwrap();
        let ep =
            transport::endpoint(SocketKind::Udp("127.0.0.1:0".parse().unwrap()), None).unwrap();
        let sink = Sink::start(
            SinkConfig {
                agent: "s".into(),
                site: "eval".into(),
                root: d.path().join("root"),
                storage: Default::default(),
                accept_peers: vec![],
                reserve_bytes: 0,
                reread_before_publish: true,
                retention: Vec::new(),
                retention_interval: std::time::Duration::from_secs(60),
                pressure: None,
                pool: None,
            },
            catalog,
            ep,
        )
        .unwrap();
        let (status, ct, text) = get_metrics(AppState::new(
            "s".into(),
            None,
            Some(sink),
            crate::Auth::open(vec![]),
        ))
        .await;
        assert_eq!(status, StatusCode::OK, "{text}");
        assert!(ct.starts_with("text/plain; version=0.0.4"), "{ct}");
        for line in [
            "# TYPE ferry_published_replicas_total counter",
            "ferry_published_replicas_total 0",
            "ferry_replica_state_replicas{state=\"published\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in:\n{text}");
        }
        // The lag and phase histograms are by class: none before the
        // first publish.
        assert!(
            !text.contains("ferry_commit_to_replica_lag_seconds_count"),
            "{text}"
        );
        assert!(
            !text.contains("ferry_sent_bytes"),
            "a sink has no source metrics"
        );
    }

    #[tokio::test]
    async fn an_agent_without_roles_answers_an_empty_exposition() {
        let (status, ct, text) = get_metrics(AppState::new(
            "a".into(),
            None,
            None,
            crate::Auth::open(vec![]),
        ))
        .await;
        assert_eq!(status, StatusCode::OK);
        assert!(ct.starts_with("text/plain; version=0.0.4"), "{ct}");
        assert_eq!(text, "");
    }
}
