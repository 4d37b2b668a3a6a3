//! Router tests with `oneshot`.
#![allow(clippy::unwrap_used)]
use std::path::PathBuf;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use ferry_catalog::Catalog;
use replicator::sink::SinkConfig;
use replicator::source::{LinkConfig, RootConfig, SourceConfig};
use replicator::tls::{self, AgentIdentity};
use replicator::transport::{self, SocketKind};
use serde_json::{json, Value};
use tower::ServiceExt;

use super::*;

fn bare() -> Router {
    router(AppState::new("a".into(), None, None, Auth::open(vec![])))
}

async fn call(r: Router, req: Request<Body>) -> (StatusCode, serde_json::Value) {
    let resp = r.oneshot(req).await.unwrap();
    let status = resp.status();
    let ct = resp.headers().get("content-type").cloned();
    if ct.is_some_and(|c| c.as_bytes().starts_with(b"text/event-stream")) {
        // An endless stream: the first event is enough.
        let mut body = resp.into_body().into_data_stream();
        let first =
            tokio::time::timeout(Duration::from_secs(10), futures::StreamExt::next(&mut body))
                .await
                .expect("no event within 10 s")
                .expect("the stream ended")
                .unwrap();
        let text = String::from_utf8(first.to_vec()).unwrap();
        return (status, json!({ "event_stream": text }));
    }
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
    let ep = transport::endpoint(SocketKind::Udp("127.0.0.1:0".parse().unwrap()), None).unwrap();
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
    let r = router(AppState::new(
        "s".into(),
        None,
        Some(sink),
        Auth::open(vec![]),
    ));
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
    // An agent serves only its roles' routes and says what it is.
    let (s, v) = call(bare(), get("/v1/resolve?path=/x")).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let e = v["error"].as_str().unwrap();
    assert!(
        e.contains("GET /v1/resolve") && e.contains("no role"),
        "{e}"
    );
    let w = with_source().await;
    let (s, v) = call(w.r(), get("/v1/replicas")).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let e = v["error"].as_str().unwrap();
    assert!(
        e.contains("role is source") && e.contains("/openapi.json"),
        "{e}"
    );
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
    let w = with_source().await;
    let bare = || w.r();
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
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(v["error"].as_str().unwrap().contains("/x"), "{v}");
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
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(v["error"].as_str().unwrap().contains("path"), "{v}");
    let (s, v) = call(bare(), get("/v1/transfers?limit=abc")).await;
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
        more_peers: Vec::new(),
        rate_bps,
        rtt: Duration::from_millis(10),
        connections: 1,
    };
    let mut policy = scheduler::Policy::default();
    policy.weights.importance = IMPORTANCE_WEIGHT;
    let cfg = SourceConfig {
        agent: "src".into(),
        site: "train-a".into(),
        chunk_size: ferry_proto::manifest::MIN_CHUNK_SIZE,
        markers: vec![],
        roots: vec![RootConfig {
            path: root.clone(),
            job: "job".into(),
            link: "l".into(),
            watch: Default::default(),
        }],
        remotes: Vec::new(),
        links: vec![link("l", 10_000_000_000), link("m", 1_000_000_000)],
        streams: 1,
        batch_bytes: 256 << 10,
        scan_interval: None,
        quiet_period: Duration::from_millis(300),
        checkpoint_idle_timeout: Duration::from_secs(600),
        policy,
        pins: Default::default(),
        pool: None,
    };
    let ep = transport::endpoint(SocketKind::Udp("127.0.0.1:0".parse().unwrap()), None).unwrap();
    let catalog = Catalog::open(&d.path().join("data")).await.unwrap();
    let source = Source::start(cfg, catalog, ep, &identity).unwrap();
    let router = router(AppState::new(
        "src".into(),
        Some(source.clone()),
        None,
        Auth::open(vec![]),
    ));
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
    let r = post(r#"{"job": "job", "kind": "nan", "severity": 0.5, "step": -3}"#);
    refused(
        call(w.r(), r).await,
        StatusCode::UNPROCESSABLE_ENTITY,
        &["step", "-3"],
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
    assert!(first["urgent_until"].as_i64().unwrap() > ferry_catalog::now_ms());
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
        call(w.r(), put(r#"{"importance": 0.5, "model_params": 1e308}"#)).await,
        StatusCode::UNPROCESSABLE_ENTITY,
        &["model_params", "1e15"],
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
    // The sink never answers here: one connection each, none open.
    assert_eq!(
        v,
        json!({ "name": "l", "rate_bps": 250_000_000u64, "connections": 1, "connections_open": 0 })
    );
    let (s, v) = call(w.r(), get("/v1/links")).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        v["items"],
        json!([
            { "name": "l", "rate_bps": 250_000_000u64, "connections": 1, "connections_open": 0 },
            { "name": "m", "rate_bps": 1_000_000_000u64, "connections": 1, "connections_open": 0 },
        ])
    );
    assert_eq!(w.source.link_rate("l"), Some(250_000_000));
}

/// A single agent (SQLite catalog): `GET /v1/settings` shows its config's
/// values, not shared; a link's rate changes through `PUT
/// /v1/settings/link.NAME.rate` as through `PUT /v1/links`; a scheduler
/// setting is refused (its `[scheduler]` is the config file's), and a bad
/// name or value is named.
#[tokio::test]
async fn settings_of_a_single_agent() {
    let w = with_source().await;
    let put = |name: &str, body: &str| send("PUT", &format!("/v1/settings/{name}"), body);
    let (s, v) = call(w.r(), get("/v1/settings")).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["shared"], json!(false));
    let item = |v: &serde_json::Value, name: &str| {
        v["items"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("no {name} in {v}"))
    };
    assert_eq!(
        item(&v, "scheduler.max_active"),
        json!({ "name": "scheduler.max_active", "value": w.source.policy().max_active,
                "updated_at": null, "updated_by": null })
    );
    assert_eq!(item(&v, "link.l.rate")["value"], json!(10_000_000_000u64));
    let policy = w.source.policy();

    let (s, v) = call(w.r(), put("link.l.rate", r#"{"value": "250Mbit"}"#)).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(item(&v, "link.l.rate")["value"], json!(250_000_000u64));
    assert_eq!(w.source.link_rate("l"), Some(250_000_000));
    refused(
        call(w.r(), put("link.nowhere.rate", r#"{"value": 5000000}"#)).await,
        StatusCode::NOT_FOUND,
        &["nowhere"],
    );
    refused(
        call(w.r(), put("link.l.rate", r#"{"value": "fast"}"#)).await,
        StatusCode::UNPROCESSABLE_ENTITY,
        &["link.l.rate"],
    );
    refused(
        call(w.r(), put("scheduler.max_active", r#"{"value": 8}"#)).await,
        StatusCode::CONFLICT,
        &["scheduler.max_active", "config file"],
    );
    assert_eq!(w.source.policy(), policy);
    refused(
        call(w.r(), put("scheduler.nope", r#"{"value": 8}"#)).await,
        StatusCode::UNPROCESSABLE_ENTITY,
        &["unknown setting \"scheduler.nope\""],
    );
    // A job's importance, as through `PUT /v1/jobs/{job}`.
    let (s, v) = call(w.r(), put("job.job.importance", r#"{"value": "0.7"}"#)).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        w.source
            .catalog()
            .job("job")
            .await
            .unwrap()
            .unwrap()
            .importance,
        0.7
    );
    refused(
        call(w.r(), put("job.job.importance", r#"{"value": 2}"#)).await,
        StatusCode::UNPROCESSABLE_ENTITY,
        &["importance"],
    );
    // A typo does not create a job.
    refused(
        call(w.r(), put("job.typo.importance", r#"{"value": 0.5}"#)).await,
        StatusCode::NOT_FOUND,
        &["unknown job \"typo\""],
    );
    assert_eq!(w.source.catalog().job("typo").await.unwrap(), None);
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

/// A token of each role and the access rule that accepts them.
fn tokens() -> (Auth, Vec<(Role, String)>) {
    tokens_named("")
}

/// As [`tokens`], each token named `{prefix}{role}-token`.
fn tokens_named(prefix: &str) -> (Auth, Vec<(Role, String)>) {
    let mut entries = Vec::new();
    let mut toks = Vec::new();
    for role in Role::ALL {
        let t = auth::new_token();
        entries.push(TokenEntry {
            name: format!("{prefix}{role}-token"),
            role,
            hash: auth::parse_hash(&auth::hash_token(&t)).unwrap(),
        });
        toks.push((role, t));
    }
    (Auth::tokens(entries), toks)
}

fn with_token(mut r: Request<Body>, token: Option<&str>) -> Request<Body> {
    if let Some(t) = token {
        r.headers_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    r
}

/// Every operation in `doc`, as (method, path template, lowest role or
/// `None` when it needs no token).
fn operations(doc: &Value) -> Vec<(String, String, Option<Role>)> {
    let mut ops = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let sec = op["security"]
                .as_array()
                .unwrap_or_else(|| panic!("{method} {path} has no security requirement"));
            let role = sec.iter().find_map(|req| {
                let scopes = req.get("bearer")?.as_array()?;
                assert_eq!(scopes.len(), 1, "{method} {path}: {req}");
                Some(scopes[0].as_str().unwrap().parse::<Role>().unwrap())
            });
            ops.push((method.to_uppercase(), path.clone(), role));
        }
    }
    ops
}

/// Checks that every `$ref` in `v` points at a schema in `doc`.
fn refs_resolve(doc: &Value, v: &Value, at: &str) {
    match v {
        Value::Object(m) => {
            if let Some(r) = m.get("$ref").and_then(Value::as_str) {
                let name = r
                    .strip_prefix("#/components/schemas/")
                    .unwrap_or_else(|| panic!("{at}: unexpected $ref {r}"));
                assert!(
                    doc["components"]["schemas"].get(name).is_some(),
                    "{at}: $ref {r} points at nothing"
                );
            }
            for (k, x) in m {
                refs_resolve(doc, x, &format!("{at}/{k}"));
            }
        }
        Value::Array(a) => a.iter().for_each(|x| refs_resolve(doc, x, at)),
        _ => {}
    }
}

async fn openapi(r: &Router) -> Value {
    let (s, doc) = call(r.clone(), get("/openapi.json")).await;
    assert_eq!(s, StatusCode::OK, "openapi.json needs no token: {doc}");
    doc
}

#[tokio::test]
async fn openapi_lists_exactly_the_routes_served_and_their_roles_are_enforced() {
    let w = with_source().await;
    let id = w.push("step-1", None).await;
    let (_sink_router, d) = with_sink().await;
    let catalog = Catalog::open(&d.path().join("data2")).await.unwrap();
    let ep = transport::endpoint(SocketKind::Udp("127.0.0.1:0".parse().unwrap()), None).unwrap();
    let sink = Sink::start(
        SinkConfig {
            agent: "both".into(),
            site: "eval".into(),
            root: d.path().join("root2"),
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
    let (auth, toks) = tokens();
    let both = router(AppState::new(
        "both".into(),
        Some(w.source.clone()),
        Some(sink.clone()),
        auth.clone(),
    ));
    let doc = openapi(&both).await;
    assert!(
        doc["openapi"].as_str().unwrap().starts_with("3.1"),
        "{}",
        doc["openapi"]
    );
    assert!(doc["info"]["title"].is_string() && doc["info"]["version"].is_string());
    refs_resolve(&doc, &doc, "#");
    let ops = operations(&doc);
    let listed: std::collections::BTreeSet<(String, String)> =
        ops.iter().map(|(m, p, _)| (m.clone(), p.clone())).collect();
    for want in [
        ("GET", "/healthz"),
        ("GET", "/openapi.json"),
        ("GET", "/v1/resolve"),
        ("GET", "/v1/replicas"),
        ("POST", "/v1/transfers"),
        ("GET", "/v1/transfers/{id}"),
        ("POST", "/v1/transfers/{id}/pause"),
        ("PUT", "/v1/links/{link}"),
        ("POST", "/v1/signals"),
        ("POST", "/v1/checkpoints/announce"),
    ] {
        assert!(
            listed.contains(&(want.0.to_string(), want.1.to_string())),
            "{want:?} is not listed"
        );
    }

    let concrete = |p: &str| {
        p.replace("{id}", &id.to_string())
            .replace("{job}", "job")
            .replace("{link}", "l")
    };
    // Every listed operation is served (never the fallback), refuses a
    // missing token with 401 and a lower role with 403, and lets its
    // role through.
    for (method, path, role) in &ops {
        let uri = concrete(path);
        let req = |tok: Option<&str>| with_token(send(method, &uri, "{}"), tok);
        let (s, v) = call(both.clone(), req(None)).await;
        let Some(role) = role else {
            assert!(s.is_success(), "{method} {path} without a token: {s} {v}");
            continue;
        };
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{method} {path}: {v}");
        assert!(
            v["error"]
                .as_str()
                .unwrap()
                .contains("missing bearer token"),
            "{v}"
        );
        for (r, t) in &toks {
            let (s, v) = call(both.clone(), req(Some(t))).await;
            if r < role {
                assert_eq!(s, StatusCode::FORBIDDEN, "{method} {path} as {r}: {v}");
                let e = v["error"].as_str().unwrap();
                assert!(e.contains(r.as_str()) && e.contains(role.as_str()), "{e}");
                assert!(!e.contains(t.as_str()), "a token was echoed: {e}");
            } else {
                assert!(
                    s != StatusCode::UNAUTHORIZED && s != StatusCode::FORBIDDEN,
                    "{method} {path} as {r}: {s} {v}"
                );
                let e = v["error"].as_str().unwrap_or("");
                assert!(!e.contains("no such route"), "{method} {path}: {e}");
            }
        }
    }
    // A bad token is 401 whatever the role needed.
    let (s, v) = call(
        both.clone(),
        with_token(get("/v1/transfers"), Some("ferry_nope")),
    )
    .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert!(v["error"].as_str().unwrap().contains("unknown"), "{v}");

    // A source-only and a sink-only agent list only their roles' routes,
    // and the other role's routes are not served.
    let src_only = router(AppState::new(
        "s".into(),
        Some(w.source.clone()),
        None,
        auth.clone(),
    ));
    let sink_only = router(AppState::new("k".into(), None, Some(sink), auth));
    let op_token = &toks[2].1;
    for (r, has, lacks) in [
        (&src_only, "/v1/transfers", "/v1/resolve"),
        (&sink_only, "/v1/resolve", "/v1/transfers"),
    ] {
        let doc = openapi(r).await;
        let paths = doc["paths"].as_object().unwrap();
        assert!(
            paths.contains_key(has) && !paths.contains_key(lacks),
            "{paths:?}"
        );
        assert!(paths.contains_key("/healthz"));
        let (s, v) = call(r.clone(), with_token(get(lacks), Some(op_token))).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{lacks}: {v}");
        assert!(
            v["error"].as_str().unwrap().contains("no such route"),
            "{v}"
        );
        let served: Vec<_> = operations(&doc)
            .into_iter()
            .filter(|(_, p, _)| !p.contains('{'))
            .collect();
        assert!(!served.is_empty());
    }
}

#[tokio::test]
async fn errors_are_json_for_405_and_413_too() {
    let w = with_source().await;
    let (s, v) = call(w.r(), send("DELETE", "/v1/transfers", "")).await;
    assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED);
    let e = v["error"].as_str().unwrap();
    assert!(e.contains("DELETE /v1/transfers"), "{e}");
    let pad = "x".repeat(MAX_BODY + 1);
    let (s, v) = call(w.r(), send("PUT", "/v1/links/l", &pad)).await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(v["error"].is_string(), "{v}");
}

#[tokio::test]
async fn lists_page_with_limit_and_offset() {
    let w = with_source().await;
    let ids = [
        w.push("step-1", None).await,
        w.push("step-2", None).await,
        w.push("step-3", None).await,
    ];
    let page = |q: &str| get(&format!("/v1/transfers?{q}"));
    let (s, v) = call(w.r(), page("limit=2")).await;
    assert_eq!(s, StatusCode::OK);
    let got: Vec<i64> = v["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_i64().unwrap())
        .collect();
    assert_eq!(got, [ids[2], ids[1]], "newest first");
    assert_eq!(
        (v["limit"].as_i64(), v["offset"].as_i64()),
        (Some(2), Some(0))
    );
    let (s, v) = call(w.r(), page("limit=2&offset=2")).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["items"][0]["id"], ids[0]);
    assert_eq!(v["items"].as_array().unwrap().len(), 1);
    for bad in ["limit=0", "limit=1001", "offset=-1", "limit=x"] {
        let (s, v) = call(w.r(), page(bad)).await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{bad}: {v}");
        let field = bad.split('=').next().unwrap();
        assert!(v["error"].as_str().unwrap().contains(field), "{bad}: {v}");
    }
    let (s, v) = call(w.r(), get("/v1/links?limit=1&offset=1")).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        v["items"],
        json!([{ "name": "m", "rate_bps": 1_000_000_000u64, "connections": 1, "connections_open": 0 }])
    );
}

#[tokio::test]
async fn the_ui_page_needs_no_token_and_its_data_does() {
    let w = with_source().await;
    let (auth, toks) = tokens();
    let r = router(AppState::new(
        "src".into(),
        Some(w.source.clone()),
        None,
        auth,
    ));
    let resp = r.clone().oneshot(get("/")).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/html"));
    let html = axum::body::to_bytes(resp.into_body(), 1 << 22)
        .await
        .unwrap();
    let html = String::from_utf8(html.to_vec()).unwrap();
    for needle in [
        "<title>Ferry</title>",
        "id=\"queue\"",
        "/v1/events",
        "Authorization",
    ] {
        assert!(html.contains(needle), "the page lacks {needle}");
    }
    let (s, _) = call(r.clone(), get("/v1/status")).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _) = call(r.clone(), get("/v1/events")).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, v) = call(r.clone(), with_token(get("/v1/whoami"), Some(&toks[0].1))).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v, json!({ "name": "reader-token", "role": "reader" }));
}

#[tokio::test]
async fn status_and_events_show_the_queue_in_rank_order_with_score_terms() {
    let w = with_source().await;
    let low = w.push("logs", Some("background")).await;
    let high = w.push("step-1", Some("urgent")).await;
    let mid = w.push("step-2", None).await;
    let (s, st) = call(w.r(), get("/v1/status?history=true")).await;
    assert_eq!(s, StatusCode::OK, "{st}");
    assert_eq!(st["agent"], "src");
    assert_eq!(st["roles"], json!(["source"]));
    assert_eq!(st["open"], true);
    let ids: Vec<i64> = st["transfers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_i64().unwrap())
        .collect();
    assert_eq!(ids, [high, mid, low], "urgent, scheduled, background");
    let row = &st["transfers"][0];
    assert_eq!(row["ranking"]["class"], "urgent");
    assert!(row["ranking"]["score"]["value"].as_f64().unwrap() > 0.0);
    assert_eq!(row["state"], "queued");
    let links = st["links"].as_array().unwrap();
    assert_eq!(links.len(), 2, "{st}");
    assert_eq!(links[0]["name"], "l");
    assert_eq!(links[0]["rate_bps"], 10_000_000_000u64);
    assert!(links[0]["history"].is_array());
    assert_eq!(st["signals"], json!([]));
    let (s, v) = call(w.r(), get("/v1/status?history=maybe")).await;
    refused((s, v), StatusCode::UNPROCESSABLE_ENTITY, &["history"]);

    // The event stream's first event is the same status.
    let (s, v) = call(w.r(), get("/v1/events")).await;
    assert_eq!(s, StatusCode::OK);
    let text = v["event_stream"].as_str().unwrap();
    assert!(text.starts_with("event: status\n"), "{text}");
    let data: String = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    let ev: Value = serde_json::from_str(&data).unwrap();
    assert_eq!(ev["transfers"][0]["id"], high);
    assert_eq!(
        ev["links"][0]["history"],
        json!([]),
        "events carry no history"
    );
}

/// Collects what the agent logs while `f` runs.
#[derive(Clone, Default)]
struct LogBuf(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for LogBuf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The test binary's log, captured by a global subscriber installed once.
///
/// Regression: `tokens_never_reach_the_log` used a thread-local
/// subscriber, and its pause's `operator action` line was sometimes
/// missing although the pause answered 200 (one run in four with the
/// other tests of this binary, never alone). tracing caches per log
/// statement whether any subscriber wants it, and other tests reaching
/// the same statement on other threads raced with the thread-local
/// subscriber's registration. A global subscriber is counted for every
/// statement from the start; the other tests' lines land in the buffer
/// too, which the assertions allow for.
fn global_log() -> &'static LogBuf {
    static LOG: std::sync::OnceLock<LogBuf> = std::sync::OnceLock::new();
    LOG.get_or_init(|| {
        let buf = LogBuf::default();
        let sub = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer({
                let b = buf.clone();
                move || b.clone()
            })
            .finish();
        tracing::subscriber::set_global_default(sub)
            .expect("one global subscriber per test binary");
        buf
    })
}

#[tokio::test]
async fn tokens_never_reach_the_log() {
    let buf = global_log();
    let w = with_source().await;
    let id = w.push("step-1", None).await;
    let (auth, toks) = tokens_named("log-test-");
    let r = router(AppState::new(
        "src".into(),
        Some(w.source.clone()),
        None,
        auth,
    ));
    let op = &toks[2].1;
    let reader = &toks[0].1;
    let mut statuses = Vec::new();
    for (req, tok) in [
        (send("POST", &format!("/v1/transfers/{id}/pause"), ""), op),
        (
            send(
                "PATCH",
                &format!("/v1/transfers/{id}"),
                r#"{"class": "urgent"}"#,
            ),
            op,
        ),
        (send("PUT", "/v1/links/l", r#"{"rate_bps": 5000000}"#), op),
        (
            send("PUT", "/v1/settings/link.m.rate", r#"{"value": "7Mbit/s"}"#),
            op,
        ),
        (
            send("PUT", "/v1/links/l", r#"{"rate_bps": 5000000}"#),
            reader,
        ),
        (get("/v1/transfers"), &format!("{op}x")),
    ] {
        let (s, v) = call(r.clone(), with_token(req, Some(tok))).await;
        assert!(s != StatusCode::INTERNAL_SERVER_ERROR, "{v}");
        statuses.push(s);
    }
    assert_eq!(
        statuses[..4],
        [StatusCode::OK; 4],
        "the operator's requests"
    );
    let log = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
    // Other tests log to the same buffer: this test's lines are the ones
    // naming its operator token.
    let mine: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("by=\"log-test-operator-token\""))
        .collect();
    assert!(
        mine.iter()
            .any(|l| l.contains("operator action") && l.contains("action=\"pause\"")),
        "the pause was not logged with its actor: {mine:?}"
    );
    assert!(
        mine.iter()
            .any(|l| l.contains("operator changed a transfer")),
        "the class change was not logged with its actor: {mine:?}"
    );
    assert!(
        mine.iter().any(|l| l.contains("link rate cap changed")
            && l.contains("link=\"m\"")
            && l.contains("rate_bps=7000000")),
        "the change through /v1/settings was not logged with its actor: {mine:?}"
    );
    for (_, t) in &toks {
        let secret = &t[auth::TOKEN_PREFIX.len()..];
        assert!(!log.contains(secret), "a token is in the log:\n{log}");
    }
}

#[tokio::test]
async fn every_body_is_limited_and_validated_naming_the_field() {
    let w = with_source().await;
    let id = w.push("step-1", None).await;
    let doc = openapi(&w.r()).await;
    let mut with_body = 0;
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            if op.get("requestBody").is_none() {
                continue;
            }
            with_body += 1;
            let uri = path
                .replace("{id}", &id.to_string())
                .replace("{job}", "job")
                .replace("{link}", "l");
            let m = method.to_uppercase();
            // Over the limit: 413 with a JSON error, before any parsing.
            let big = format!(r#"{{"pad": "{}"}}"#, "x".repeat(MAX_BODY));
            let (s, v) = call(w.r(), send(&m, &uri, &big)).await;
            assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE, "{m} {path}: {v}");
            assert!(v["error"].is_string(), "{m} {path}: {v}");
            // An unknown field: 422 naming it.
            let (s, v) = call(w.r(), send(&m, &uri, r#"{"bogus_field": 1}"#)).await;
            refused((s, v), StatusCode::UNPROCESSABLE_ENTITY, &["bogus_field"]);
            // Not JSON at all: 4xx naming the problem, never a 500.
            let (s, v) = call(w.r(), send(&m, &uri, "{not json")).await;
            assert!(s.is_client_error(), "{m} {path}: {s} {v}");
            assert!(v["error"].is_string(), "{m} {path}: {v}");
        }
    }
    assert_eq!(with_body, 7, "operations with a body");
}

#[tokio::test]
async fn cross_origin_changes_are_refused_and_same_origin_ones_pass() {
    let w = with_source().await;
    let id = w.push("step-1", None).await;
    let pause = |origin: Option<&str>| {
        let mut r = send("POST", &format!("/v1/transfers/{id}/pause"), "");
        r.headers_mut()
            .insert("host", "127.0.0.1:7070".parse().unwrap());
        if let Some(o) = origin {
            r.headers_mut().insert("origin", o.parse().unwrap());
        }
        r
    };
    let (s, v) = call(w.r(), pause(Some("https://evil.example"))).await;
    refused(
        (s, v),
        StatusCode::FORBIDDEN,
        &["cross-origin", "evil.example"],
    );
    let (s, v) = call(w.r(), pause(Some("null"))).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    assert_eq!(
        w.transfer(id).await["state"],
        "queued",
        "a refused pause paused"
    );
    let (s, v) = call(w.r(), pause(Some("http://127.0.0.1:7070"))).await;
    assert_eq!(s, StatusCode::OK, "the UI's own origin: {v}");
    let (s, v) = call(
        w.r(),
        send("POST", &format!("/v1/transfers/{id}/resume"), ""),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "no Origin (CLI, curl): {v}");
    // Reading is never refused for its origin.
    let mut r = get("/v1/transfers");
    r.headers_mut()
        .insert("origin", "https://evil.example".parse().unwrap());
    let (s, _) = call(w.r(), r).await;
    assert_eq!(s, StatusCode::OK);
}

#[tokio::test]
async fn live_views_are_capped_and_the_long_queue_shows_its_best_rows() {
    let w = with_source().await;
    // More unfinished transfers than the view shows; the urgent one is
    // the oldest and must stay in view.
    let urgent = w.push("step-0", Some("urgent")).await;
    for i in 1..=ui::MAX_QUEUE_ROWS {
        w.push(&format!("step-{i}"), None).await;
    }
    let (s, st) = call(w.r(), get("/v1/status")).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(st["unfinished"], ui::MAX_QUEUE_ROWS + 1);
    assert_eq!(st["counts"]["queued"], ui::MAX_QUEUE_ROWS + 1);
    let rows = st["transfers"].as_array().unwrap();
    assert_eq!(rows.len(), ui::MAX_QUEUE_ROWS);
    assert_eq!(rows[0]["id"], urgent, "the best-ranked row comes first");

    // Streams hold their slot until dropped; one too many is a JSON 503.
    let mut open = Vec::new();
    for _ in 0..ui::MAX_EVENT_STREAMS {
        let resp = w.r().oneshot(get("/v1/events")).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        open.push(resp);
    }
    let (s, v) = call(w.r(), get("/v1/events")).await;
    refused((s, v), StatusCode::SERVICE_UNAVAILABLE, &["live views"]);
    open.pop();
    let (s, _) = call(w.r(), get("/v1/events")).await;
    assert_eq!(s, StatusCode::OK, "a closed stream frees its slot");
}

#[tokio::test]
async fn transfer_ids_and_classes_from_a_client_are_checked() {
    let w = with_source().await;
    let (s, v) = call(w.r(), get("/v1/transfers/abc")).await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    assert!(v["error"].as_str().unwrap().contains("not a number"), "{v}");
    // Ids are positive: a negative one names no transfer.
    let (s, v) = call(w.r(), get("/v1/transfers/-3")).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    assert!(
        v["error"].as_str().unwrap().contains("no transfer -3"),
        "{v}"
    );
    let id = w.push("step-9", None).await;
    let (s, v) = call(
        w.r(),
        send(
            "PATCH",
            &format!("/v1/transfers/{id}"),
            r#"{"class": "soon"}"#,
        ),
    )
    .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    let e = v["error"].as_str().unwrap();
    assert!(e.contains("class") && e.contains("soon"), "{e}");
    // Nothing changed.
    assert_eq!(w.transfer(id).await["class"], "scheduled");
}

/// Status, content type and body text of `req`.
async fn call_text(r: Router, req: Request<Body>) -> (StatusCode, String, String) {
    let resp = r.oneshot(req).await.unwrap();
    let status = resp.status();
    let ct = resp
        .headers()
        .get("content-type")
        .map(|c| c.to_str().unwrap().to_string())
        .unwrap_or_default();
    let body = axum::body::to_bytes(resp.into_body(), 16 << 20)
        .await
        .unwrap();
    (status, ct, String::from_utf8(body.to_vec()).unwrap())
}

#[tokio::test]
async fn the_trace_is_json_lines_for_operators_and_since_is_checked() {
    use scheduler::trace::{Trace, What};

    let w = with_source().await;
    let (auth, toks) = tokens();
    let r = router(AppState::new(
        "src".into(),
        Some(w.source.clone()),
        None,
        auth,
    ));
    let trace_as = |uri: &str, role: Option<Role>| {
        let tok = role.map(|role| toks.iter().find(|(r, _)| *r == role).unwrap().1.as_str());
        with_token(get(uri), tok)
    };
    let (s, _, body) = call_text(r.clone(), trace_as("/v1/trace", None)).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED, "{body}");
    for role in [Role::Reader, Role::Signaler] {
        let (s, _, body) = call_text(r.clone(), trace_as("/v1/trace", Some(role))).await;
        assert_eq!(s, StatusCode::FORBIDDEN, "{role}: {body}");
        assert!(
            body.contains(role.as_str()) && body.contains("operator"),
            "{body}"
        );
    }
    for bad in ["abc", "-5", "1.5", "", "99999999999999999999"] {
        let (s, _, body) = call_text(
            r.clone(),
            trace_as(&format!("/v1/trace?since={bad}"), Some(Role::Operator)),
        )
        .await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "since={bad}: {body}");
        assert!(body.contains("`since`"), "{body}");
    }

    // Two transfers, a pause and a rate change, then the trace.
    let a = w.push("step-1", Some("background")).await;
    let b = w.push("step-2", None).await;
    let (s, v) = call(w.r(), send("POST", &format!("/v1/transfers/{a}/pause"), "")).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, v) = call(
        w.r(),
        send("PUT", "/v1/links/m", r#"{"rate_bps": 5000000}"#),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, ct, body) = call_text(r.clone(), trace_as("/v1/trace", Some(Role::Operator))).await;
    assert_eq!(s, StatusCode::OK, "{body}");
    assert_eq!(ct, TRACE_CONTENT_TYPE);
    let t = Trace::parse(&body).unwrap_or_else(|e| panic!("{e}\n{body}"));
    let links: Vec<(&str, u64, u64)> = t
        .header
        .links
        .iter()
        .map(|l| (l.link.as_str(), l.rate_bps, l.rtt_ms))
        .collect();
    assert_eq!(
        links,
        [("l", 10_000_000_000, 10), ("m", 1_000_000_000, 10)],
        "the configured rates hold at 0"
    );
    let ids = |id: i64| ferry_proto::state::TransferId::from_i64(id).unwrap();
    let what: Vec<&What> = t.events.iter().map(|e| &e.what).collect();
    assert!(
        matches!(
            what.as_slice(),
            [
                What::Arrival { id: i1, class: scheduler::Class::Background, link: l1, .. },
                What::Arrival { id: i2, class: scheduler::Class::Scheduled, .. },
                What::Pause { id: i3 },
                What::Rate { link: l2, rate_bps: 5_000_000 },
            ] if *i1 == ids(a) && *i2 == ids(b) && *i3 == ids(a) && l1 == "l" && l2 == "m"
        ),
        "{what:?}"
    );
    // From after the last event: the rates in force then, the queue then.
    let last = t.events.last().unwrap().at_ms;
    let (s, _, body) = call_text(
        r.clone(),
        trace_as(
            &format!("/v1/trace?since={}", last + 1),
            Some(Role::Operator),
        ),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{body}");
    let t = Trace::parse(&body).unwrap();
    assert_eq!(t.header.links[1].rate_bps, 5_000_000);
    let what: Vec<&What> = t.events.iter().map(|e| &e.what).collect();
    assert!(
        matches!(
            what.as_slice(),
            [What::Arrival { id: i1, .. }, What::Pause { id: i2 }, What::Arrival { id: i3, .. }]
                if *i1 == ids(a) && *i2 == ids(a) && *i3 == ids(b)
        ),
        "{what:?}"
    );
    assert!(t.events.iter().all(|e| e.at_ms == last + 1));
}

/// A catalog that does not answer (here: closed) makes a listing a 503
/// that says so, not a 500 that hides the cause.
#[tokio::test]
async fn a_catalog_that_does_not_answer_is_a_503_naming_it() {
    let w = with_source().await;
    w.source.catalog().close().await;
    let (s, v) = call(w.r(), get("/v1/transfers")).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    let msg = v["error"].as_str().unwrap_or_default();
    assert!(
        msg.contains("the catalog does not answer") && msg.contains("retry"),
        "{v}"
    );
}

/// A directory `name` under `w`'s root holding one sparse file of
/// `bytes`, pushed with `extra` fields; the answer.
async fn push_sized(w: &WithSource, name: &str, bytes: u64, extra: Value) -> Value {
    let dir = w.root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::File::create(dir.join("shard.bin"))
        .unwrap()
        .set_len(bytes)
        .unwrap();
    let mut body = json!({ "path": dir.to_str().unwrap() });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let (s, v) = call(w.r(), send("POST", "/v1/transfers", &body.to_string())).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    v
}

/// The value of the series `name{labels}` in the metrics text, 0 if
/// absent.
async fn metric(w: &WithSource, series: &str) -> f64 {
    let (s, _, text) = call_text(w.r(), get("/metrics")).await;
    assert_eq!(s, StatusCode::OK);
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn a_deadline_is_answered_at_once_and_said_at_risk_then_missed_once() {
    let w = with_source().await;
    // Link l: 10 Gbit/s, nothing answers, so nothing moves.
    let gb = 1_000_000_000u64;
    let ok = push_sized(&w, "step-1", gb, json!({ "deadline": "1h" })).await;
    let a = &ok["admission"];
    assert_eq!(a["feasible"], true, "{ok}");
    assert!(
        a["class_needed"].is_null() && a["bytes_over"].is_null(),
        "{a}"
    );
    let created = ok["created_at"].as_i64().unwrap();
    assert_eq!(
        ok["deadline"].as_i64().unwrap(),
        created + 3_600_000,
        "{ok}"
    );
    // 1 GB at 10 Gbit/s less packet headers: about 0.8 s.
    let eta = a["eta_ms"].as_i64().unwrap() - created;
    assert!((700..3_000).contains(&eta), "eta {eta} ms: {a}");

    // A background transfer behind 200 GB of scheduled ones: at its
    // floor it is late; in class scheduled, earliest deadline first, it
    // is in time.
    // (A deadline makes a pushed directory's size known at once.)
    push_sized(&w, "step-2", 200 * gb, json!({ "deadline": "30d" })).await;
    let bg = push_sized(
        &w,
        "logs",
        10 * gb,
        json!({ "class": "background", "deadline": "60s" }),
    )
    .await;
    let a = &bg["admission"];
    assert_eq!(a["feasible"], false, "{bg}");
    assert_eq!(a["class_needed"], "scheduled", "{a}");
    assert!(a["bytes_over"].is_null(), "{a}");

    // 100 GB due in 3 s: no class makes it; the bytes over budget are
    // about what 10 Gbit/s carries in the rest of the time.
    let late = push_sized(
        &w,
        "step-3",
        100 * gb,
        json!({ "class": "urgent", "deadline": humantime::format_rfc3339_millis(
            std::time::SystemTime::now() + Duration::from_secs(3)).to_string() }),
    )
    .await;
    let a = &late["admission"];
    assert_eq!(a["feasible"], false, "{late}");
    assert!(a["class_needed"].is_null(), "{a}");
    let over = a["bytes_over"].as_u64().unwrap();
    assert!(over > 50 * gb && over < 100 * gb, "{a}");
    let id = late["id"].as_i64().unwrap();

    // Said at risk within a few checks, missed once the time passed;
    // each once.
    let mut seen = Vec::new();
    for _ in 0..100 {
        let st = w.transfer(id).await["deadline_state"].clone();
        if seen.last() != Some(&st) {
            seen.push(st.clone());
        }
        if st == "missed" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(seen.last().unwrap(), "missed", "{seen:?}");
    assert!(seen.contains(&json!("at_risk")), "{seen:?}");
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let at_risk = "ferry_deadlines_total{class=\"urgent\",outcome=\"at_risk\"}";
    let missed = "ferry_deadlines_total{class=\"urgent\",outcome=\"missed\"}";
    assert_eq!(metric(&w, at_risk).await, 1.0);
    assert_eq!(metric(&w, missed).await, 1.0);
    // The background one is at risk too (it is answered late), the
    // first, feasible one is not.
    let first = w.transfer(ok["id"].as_i64().unwrap()).await;
    assert!(first["deadline_state"].is_null(), "{first}");

    // Bad deadlines are refused naming the field.
    let dir = w.root.join("step-4");
    std::fs::create_dir_all(&dir).unwrap();
    for bad in ["soon", "0s", "2026-13-01T00:00:00Z"] {
        let body = json!({ "path": dir.to_str().unwrap(), "deadline": bad }).to_string();
        refused(
            call(w.r(), send("POST", "/v1/transfers", &body)).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            &["deadline", bad],
        );
    }
}

#[tokio::test]
async fn a_job_writing_faster_than_its_link_is_told_so_in_numbers() {
    let w = with_source().await;
    // Five 15 MB checkpoints (small: sized when queued) 20 ms apart on a
    // 10 Gbit/s link that never connects.
    let mb = 1_000_000u64;
    for i in 0..5 {
        push_sized(&w, &format!("step-{i}"), 15 * mb, json!({})).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (s, o) = call(w.r(), get("/v1/jobs/job/outlook")).await;
    assert_eq!(s, StatusCode::OK, "{o}");
    assert_eq!(
        (o["job"].as_str(), o["link"].as_str()),
        (Some("job"), Some("l")),
        "{o}"
    );
    assert_eq!(o["backlog_bytes"], 75 * mb, "{o}");
    assert_eq!(o["checkpoint_bytes"], 15 * mb, "{o}");
    // The fluid model has the next one after the backlog: 90 MB at
    // about 1.2 GB/s.
    let now = ferry_catalog::now_ms();
    let next = o["next_ready_ms"].as_i64().unwrap() - now;
    assert!((40..2_000).contains(&next), "{next} ms: {o}");
    let cadence = o["cadence_ms"].as_i64().unwrap();
    assert!((15..1_000).contains(&cadence), "{o}");
    assert_eq!(o["keeps_up"], false, "{o}");
    assert!(o["every_k"].as_u64().unwrap() >= 2, "{o}");
    assert!(
        o["rate_needed_bps"].as_u64().unwrap() > 10_000_000_000,
        "{o}"
    );
    assert_eq!(
        metric(&w, "ferry_job_backlog_bytes{job=\"job\"}").await,
        (75 * mb) as f64
    );
    assert_eq!(metric(&w, "ferry_job_keeps_up{job=\"job\"}").await, 0.0);

    refused(
        call(w.r(), get("/v1/jobs/nobody/outlook")).await,
        StatusCode::NOT_FOUND,
        &["nobody"],
    );
}

#[tokio::test]
async fn readers_are_checked_and_kept_with_the_transfer() {
    let w = with_source().await;
    let v = push_sized(&w, "step-r", 1000, json!({ "readers": 20_000 })).await;
    assert_eq!(v["readers"], 20_000, "{v}");
    let id = v["id"].as_i64().unwrap();
    let (s, t) = call(w.r(), get(&format!("/v1/transfers/{id}"))).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(t["readers"], 20_000, "{t}");
    let plain = push_sized(&w, "step-p", 1000, json!({})).await;
    assert!(plain["readers"].is_null(), "{plain}");
    for bad in [json!(0), json!(10_000_001u64), json!(-3), json!("many")] {
        let dir = w.root.join("step-bad");
        std::fs::create_dir_all(&dir).unwrap();
        let body = json!({ "path": dir.to_str().unwrap(), "readers": bad });
        let (s, v) = call(w.r(), send("POST", "/v1/transfers", &body.to_string())).await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{bad}: {v}");
        assert!(
            v["error"].as_str().unwrap().contains("readers"),
            "{bad}: {v}"
        );
    }
}
