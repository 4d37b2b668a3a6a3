//! The replica lifecycle on real agents: a retention policy run at each
//! publish and every `retention_interval` (1 s here), operators' pins,
//! removal by hand (API and CLI), the removal records, metrics, bad input,
//! and a sink killed inside a removal.

#![allow(clippy::unwrap_used)]

#[allow(dead_code)]
mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use reqwest::StatusCode;
use serde_json::{json, Value};

const TRANSFER: Duration = Duration::from_secs(120);

/// The sink's API with a reader and an operator token.
struct Api {
    http: reqwest::Client,
    url: String,
    reader: String,
    operator: String,
}

impl Api {
    async fn call(
        &self,
        token: &str,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut rb = self
            .http
            .request(method, format!("{}{path}", self.url))
            .bearer_auth(token);
        if let Some(b) = body {
            rb = rb.json(&b);
        }
        let r = rb.send().await.unwrap();
        let status = r.status();
        let text = r.text().await.unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    async fn replicas(&self, state: &str) -> Vec<Value> {
        let (st, v) = self
            .call(
                &self.reader,
                reqwest::Method::GET,
                &format!("/v1/replicas?state={state}&limit=1000"),
                None,
            )
            .await;
        assert_eq!(st, StatusCode::OK, "{v}");
        v["items"].as_array().unwrap().clone()
    }

    /// The published replica of checkpoint `rel`.
    async fn published(&self, rel: &str) -> Option<Value> {
        self.replicas("published")
            .await
            .into_iter()
            .find(|r| r["rel"] == rel)
    }

    async fn resolve(&self, path: &Path) -> Value {
        let url = reqwest::Url::parse_with_params(
            &format!("{}/v1/resolve", self.url),
            &[("path", path.to_str().unwrap())],
        )
        .unwrap();
        let r = self
            .http
            .get(url)
            .bearer_auth(&self.reader)
            .send()
            .await
            .unwrap();
        r.json().await.unwrap()
    }

    async fn metrics(&self) -> String {
        self.http
            .get(format!("{}/metrics", self.url))
            .bearer_auth(&self.reader)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }
}

/// The value of the sample `name` (with its labels written as in the text
/// format, e.g. `{reason="rule"}`), 0 if absent.
fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// A reader ("evals") and an operator ("ops") token, and the
/// `[[api.tokens]]` entries that admit them.
fn reader_and_operator() -> (String, String, String) {
    let reader = api::auth::new_token();
    let operator = api::auth::new_token();
    let tokens = format!(
        "[[api.tokens]]\nname = \"evals\"\nrole = \"reader\"\nhash = \"{}\"\n\n\
         [[api.tokens]]\nname = \"ops\"\nrole = \"operator\"\nhash = \"{}\"\n",
        api::auth::hash_token(&reader),
        api::auth::hash_token(&operator)
    );
    (reader, operator, tokens)
}

/// Waits until nothing is at `path` (`what`, for the failure message).
async fn wait_gone(w: &World, path: &Path, what: &str) {
    w.wait_until(what, TRANSFER, async || {
        if path.exists() {
            Err(format!("{} still there", path.display()))
        } else {
            Ok(())
        }
    })
    .await;
}

/// Waits until replica `id` is `removed` and returns its row.
async fn wait_removed(w: &World, api: &Api, id: i64, what: &str) -> Value {
    w.wait_until(&format!("{what} to be removed"), TRANSFER, async || {
        if let Some(r) = api
            .replicas("removed")
            .await
            .into_iter()
            .find(|r| r["id"] == id)
        {
            return Ok(r);
        }
        Err(format!("removing: {:?}", api.replicas("removing").await))
    })
    .await
}

#[tokio::test]
async fn a_policy_removes_what_it_no_longer_keeps_and_operators_pin_and_remove() {
    let w = World::new("retention").await;
    let (reader, operator, tokens) = reader_and_operator();
    let mut c = w
        .start_cluster("200Mbit/s", &[], |sink, _| {
            sink.api = tokens.clone();
            sink.sink.as_mut().unwrap().extra = "retention_interval = \"1s\"\n\n\
                 [[sink.retention]]\njob = \"llama-*\"\nkeep_last = 2\nmin_age = \"4s\"\n"
                .into();
        })
        .await;
    let api = Api {
        http: reqwest::Client::new(),
        url: c.sink.url(),
        reader,
        operator: operator.clone(),
    };
    let ckpt = |step: u32| w.source_root().join(format!("step_{step:06}"));
    let push = async |step: u32| {
        w.gen(&ckpt(step), "300KB").await;
        let out = w.push(&c.source, &ckpt(step), &[]).await;
        w.ensure(out.success(), || format!("ferry push: {out}"));
        api.published(&format!("step_{step:06}")).await.unwrap()
    };
    let first = push(100).await;
    let first_id = first["id"].as_i64().unwrap();
    // The source sent its class with the commit (protocol version 3); a
    // generated checkpoint of no known format has no step.
    assert_eq!(first["class"], "scheduled", "{first}");
    assert_eq!(first["step"], Value::Null, "{first}");
    push(200).await;

    // A reader may not pin; an operator may.
    let pin_path = format!("/v1/replicas/{first_id}/pin");
    let (st, body) = api
        .call(
            &api.reader,
            reqwest::Method::POST,
            &pin_path,
            Some(json!({})),
        )
        .await;
    assert_eq!(st, StatusCode::FORBIDDEN, "{body}");
    let (st, body) = api
        .call(
            &api.operator,
            reqwest::Method::POST,
            &pin_path,
            Some(json!({"reason": "bisecting a loss spike", "for": "-5m"})),
        )
        .await;
    assert_eq!(st, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert!(body["error"].as_str().unwrap().contains("`for`"), "{body}");
    let (st, body) = api
        .call(
            &api.operator,
            reqwest::Method::POST,
            &pin_path,
            Some(json!({"reason": "bisecting a loss spike"})),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{body}");
    assert_eq!(body["pin"]["reason"], "bisecting a loss spike (by ops)");

    // Two more versions: keep_last 2 keeps 300 and 400; 200 goes once it
    // is older than min_age (4 s) at a pass, at a publish or the 1 s
    // interval; 100 stays, pinned.
    push(300).await;
    push(400).await;
    let second = wait_removed(
        &w,
        &api,
        {
            let all = api.replicas("").await;
            all.iter().find(|r| r["rel"] == "step_000200").unwrap()["id"]
                .as_i64()
                .unwrap()
        },
        "step 200",
    )
    .await;
    assert_eq!(second["removal"]["reason"], "rule", "{second}");
    let detail = second["removal"]["detail"].as_str().unwrap();
    assert!(detail.contains("keep_last 2"), "{detail}");
    assert!(second["removal"]["bytes"].as_i64().unwrap() > 0, "{second}");
    assert!(
        !w.replica_path("step_000200").exists(),
        "its files are gone"
    );
    let r = api.resolve(&ckpt(200)).await;
    assert_eq!(r["state"], "remote", "{r}");
    assert!(r["reason"].as_str().unwrap().contains("removed"), "{r}");
    for step in [100, 300, 400] {
        let r = api.resolve(&ckpt(step)).await;
        assert_eq!(r["state"], "local", "step {step}: {r}");
    }
    w.assert_same_tree(&ckpt(100), &w.replica_path("step_000100"));

    // Bad input removes nothing.
    let published_before = api.replicas("published").await.len();
    for (path, want) in [
        ("/v1/replicas/999999", StatusCode::NOT_FOUND),
        ("/v1/replicas/abc", StatusCode::UNPROCESSABLE_ENTITY),
        ("/v1/replicas/-3", StatusCode::NOT_FOUND),
    ] {
        let (st, body) = api
            .call(&api.operator, reqwest::Method::DELETE, path, None)
            .await;
        assert_eq!(st, want, "{path}: {body}");
    }
    let rm_first = format!("/v1/replicas/{first_id}");
    let (st, body) = api
        .call(&api.reader, reqwest::Method::DELETE, &rm_first, None)
        .await;
    assert_eq!(st, StatusCode::FORBIDDEN, "{body}");
    // Pinned: refused naming the pin.
    let (st, body) = api
        .call(&api.operator, reqwest::Method::DELETE, &rm_first, None)
        .await;
    assert_eq!(st, StatusCode::CONFLICT, "{body}");
    let e = body["error"].as_str().unwrap();
    assert!(
        e.contains("pinned") && e.contains("bisecting a loss spike"),
        "{e}"
    );
    // The CLI says the same.
    let server = ["--server", &api.url, "--token", &operator];
    let mut args = vec!["replica", "rm", "999999"];
    args.extend(server);
    let out = w.ferry(&args, &[], Duration::from_secs(30)).await;
    assert!(
        !out.success() && out.all().contains("no replica 999999"),
        "{out}"
    );
    assert_eq!(api.replicas("published").await.len(), published_before);
    assert_eq!(api.resolve(&ckpt(100)).await["state"], "local");

    // Forced, through the CLI: recorded as forced, by the operator.
    let id_s = first_id.to_string();
    let mut args = vec![
        "replica",
        "rm",
        &id_s,
        "--force",
        "--reason",
        "done bisecting",
    ];
    args.extend(server);
    let out = w.ferry(&args, &[], Duration::from_secs(30)).await;
    assert!(out.success(), "{out}");
    // Out of the published namespace when the command returns.
    assert_eq!(api.resolve(&ckpt(100)).await["state"], "remote");
    let first = wait_removed(&w, &api, first_id, "step 100").await;
    assert_eq!(first["removal"]["reason"], "operator", "{first}");
    assert_eq!(first["removal"]["forced"], true, "{first}");
    let detail = first["removal"]["detail"].as_str().unwrap();
    assert!(
        detail.contains("bisecting a loss spike") && detail.contains("done bisecting"),
        "{detail}"
    );
    let mut args = vec!["replica", "ls", "--state", "removed"];
    args.extend(server);
    let out = w.ferry(&args, &[], Duration::from_secs(30)).await;
    assert!(out.success(), "{out}");
    assert!(
        out.stdout.contains("operator") && out.stdout.contains("rule"),
        "{out}"
    );

    let m = api.metrics().await;
    assert_eq!(
        sample(&m, "ferry_replicas_removed_total{reason=\"rule\"}"),
        1.0,
        "{m}"
    );
    assert_eq!(
        sample(&m, "ferry_replicas_removed_total{reason=\"operator\"}"),
        1.0,
        "{m}"
    );
    assert!(
        sample(&m, "ferry_replica_freed_bytes_total{reason=\"rule\"}") > 0.0,
        "{m}"
    );
    assert_eq!(sample(&m, "ferry_pinned_replicas"), 0.0, "{m}");

    // Pin and unpin through the CLI; the gauge follows.
    let id300 = api.published("step_000300").await.unwrap()["id"]
        .as_i64()
        .unwrap()
        .to_string();
    let mut args = vec![
        "replica",
        "pin",
        &id300,
        "--reason",
        "eval baseline",
        "--for",
        "1h",
    ];
    args.extend(server);
    let out = w.ferry(&args, &[], Duration::from_secs(30)).await;
    assert!(
        out.success() && out.stdout.contains("pinned until"),
        "{out}"
    );
    assert!(out.stdout.contains("eval baseline (by ops)"), "{out}");
    assert_eq!(sample(&api.metrics().await, "ferry_pinned_replicas"), 1.0);
    let mut args = vec!["replica", "unpin", &id300, "--json"];
    args.extend(server);
    let out = w.ferry(&args, &[], Duration::from_secs(30)).await;
    assert!(out.success(), "{out}");
    let row: Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!(row["pin"], Value::Null, "{row}");
    assert_eq!(sample(&api.metrics().await, "ferry_pinned_replicas"), 0.0);

    // Step 300 saved again: the older row reads as replaced by the new
    // one, in the API and in `ferry replica ls`.
    std::fs::write(ckpt(300).join("extra.bin"), b"a re-save").unwrap();
    let out = w.push(&c.source, &ckpt(300), &[]).await;
    w.ensure(out.success(), || format!("ferry push of a re-save: {out}"));
    let both: Vec<Value> = api
        .replicas("published")
        .await
        .into_iter()
        .filter(|r| r["rel"] == "step_000300")
        .collect();
    assert_eq!(both.len(), 2, "{both:?}");
    assert_eq!(both[1]["replaced_by"], both[0]["id"], "{both:?}");
    assert_eq!(both[0]["replaced_by"], Value::Null, "{both:?}");
    let mut args = vec!["replica", "ls"];
    args.extend(server);
    let out = w.ferry(&args, &[], Duration::from_secs(30)).await;
    assert!(
        out.stdout.contains(&format!(
            "(replaced by {})",
            both[0]["id"].as_i64().unwrap()
        )),
        "{out}"
    );

    // A sink killed inside a removal: no published path names a part of
    // the replica, and the removal finishes after the restart.
    for (step, point) in [(300, "withdrawn"), (400, "retire-partial")] {
        let rel = format!("step_{step:06}");
        let id = api.published(&rel).await.unwrap()["id"].as_i64().unwrap();
        c.sink.set_env("FERRY_FAULT_KILL_IN_PUBLISH", Some(point));
        w.restart(&mut c.sink).await;
        // The answer may never come: the sink kills itself inside.
        let _ = api
            .http
            .delete(format!("{}/v1/replicas/{id}", api.url))
            .bearer_auth(&operator)
            .timeout(Duration::from_secs(20))
            .send()
            .await;
        let sink = &mut c.sink;
        w.wait_until(
            &format!("the sink to kill itself at {point}"),
            TRANSFER,
            async || sink.exited().ok_or_else(|| "still running".to_string()),
        )
        .await;
        assert!(
            !w.replica_path(&rel).exists(),
            "{point}: the published path still names (part of) the replica"
        );
        let aside = w.sink_root().join(".ferry/retired").join(id.to_string());
        assert!(aside.exists(), "{point}: the version was moved aside first");
        c.sink.set_env("FERRY_FAULT_KILL_IN_PUBLISH", None);
        w.restart(&mut c.sink).await;
        let row = wait_removed(&w, &api, id, &rel).await;
        assert_eq!(row["removal"]["reason"], "operator", "{row}");
        wait_gone(&w, &aside, "the files to be gone").await;
        assert_eq!(api.resolve(&ckpt(step)).await["state"], "remote");
    }
    // Only the version the re-save replaced is left with state
    // `published`, and it says so.
    let left = api.replicas("published").await;
    assert!(left.iter().all(|r| r["replaced_by"].is_i64()), "{left:?}");
}

/// A tmpfs of `mib` MiB mounted at `dir` for the test's life (lazily
/// unmounted on drop, also after a failed assertion). Needs root, as
/// `ops/test` runs in CI.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, mib: u64) -> Tmpfs {
        std::fs::create_dir_all(dir).unwrap();
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "ferry-test"])
            .arg(dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "mounting a {mib} MiB tmpfs at {} failed (the space pressure test needs root, \
             as ops/test runs it): {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        Tmpfs(dir.to_path_buf())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// Space pressure on a sink whose root is a 48 MiB file system, replicas
/// of 8 MiB, `min_free` 18 MiB, `target_free` 26 MiB: a publish that
/// leaves too little free removes background before scheduled replicas,
/// oldest first, never the newest; an incoming transfer that does not fit
/// removes replicas only if that makes room, and with everything kept
/// back it is refused naming why, nothing removed.
#[tokio::test]
async fn space_pressure_removes_in_order_and_refuses_when_everything_is_kept() {
    let w = World::new("pressure").await;
    let _fs = Tmpfs::mount(&w.sink_root(), 48);
    let operator = api::auth::new_token();
    let tokens = format!(
        "[[api.tokens]]\nname = \"ops\"\nrole = \"operator\"\nhash = \"{}\"\n",
        api::auth::hash_token(&operator)
    );
    let c = w
        .start_cluster("400Mbit/s", &[], |sink, _| {
            sink.api = tokens.clone();
            sink.sink.as_mut().unwrap().extra = "reserve = \"1MiB\"\nmin_free = \"18MiB\"\n\
                 target_free = \"26MiB\"\nretention_interval = \"1s\"\n"
                .into();
        })
        .await;
    let api = Api {
        http: reqwest::Client::new(),
        url: c.sink.url(),
        reader: operator.clone(),
        operator: operator.clone(),
    };
    // A checkpoint of one file of `mib` MiB (distinct bytes) and a marker.
    let make = |name: &str, mib: usize| {
        let dir = w.source_root().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let mut data = vec![0u8; mib << 20];
        let mut x = name
            .bytes()
            .fold(0x9e37_79b9_u64, |a, b| a.rotate_left(7) ^ u64::from(b));
        for c in data.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
        }
        std::fs::write(dir.join("weights.bin"), data).unwrap();
        std::fs::write(dir.join("meta.json"), b"{}").unwrap();
        dir
    };
    let push_ok = async |name: &str, class: &str| -> i64 {
        let dir = make(name, 8);
        let out = w.push(&c.source, &dir, &["--class", class]).await;
        w.ensure(out.success(), || format!("ferry push {name}: {out}"));
        api.published(name).await.unwrap()["id"].as_i64().unwrap()
    };
    let a = push_ok("a", "background").await;
    let b = push_ok("b", "scheduled").await;
    let c3 = push_ok("c", "background").await;
    // About 16 MiB free after d: below min_free. Background goes first,
    // oldest first (a, then c), until 26 MiB are free; b is older than c
    // but scheduled, d is the newest.
    let d = push_ok("d", "scheduled").await;
    for (id, what) in [(a, "a"), (c3, "c")] {
        let r = wait_removed(&w, &api, id, what).await;
        assert_eq!(r["removal"]["reason"], "pressure", "{r}");
        let detail = r["removal"]["detail"].as_str().unwrap();
        assert!(detail.contains("class background"), "{detail}");
    }
    let published: Vec<i64> = api
        .replicas("published")
        .await
        .iter()
        .map(|r| r["id"].as_i64().unwrap())
        .collect();
    assert!(
        published.contains(&b) && published.contains(&d) && published.len() == 2,
        "b and d stay: {published:?}"
    );
    w.assert_same_tree(&w.source_root().join("b"), &w.replica_path("b"));

    // b pinned, d the newest: nothing may go, and a 34 MiB checkpoint
    // does not fit in about 32 MiB free. Refused, naming why; nothing
    // removed.
    let (st, body) = api
        .call(
            &operator,
            reqwest::Method::POST,
            &format!("/v1/replicas/{b}/pin"),
            Some(json!({"reason": "baseline"})),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{body}");
    let big = make("e", 34);
    let out = w.push(&c.source, &big, &["--class", "urgent"]).await;
    assert!(!out.success(), "{out}");
    let all = out.all();
    assert!(
        all.contains("not enough space at the sink")
            && all.contains("1 pinned")
            && all.contains("its job's newest"),
        "{out}"
    );
    assert_eq!(api.replicas("published").await.len(), 2);
    assert_eq!(api.replicas("removed").await.len(), 2);

    // Unpinned, b may go: removing it makes room, so it goes and the
    // checkpoint is admitted; once it is published, d (no longer the
    // newest) goes too.
    let (st, body) = api
        .call(
            &operator,
            reqwest::Method::DELETE,
            &format!("/v1/replicas/{b}/pin"),
            None,
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{body}");
    let out = w.push(&c.source, &big, &["--class", "urgent"]).await;
    w.ensure(out.success(), || format!("ferry push e again: {out}"));
    for (id, what) in [(b, "b"), (d, "d")] {
        let r = wait_removed(&w, &api, id, what).await;
        assert_eq!(r["removal"]["reason"], "pressure", "{r}");
    }
    w.assert_same_tree(&big, &w.replica_path("e"));
    let m = api.metrics().await;
    assert_eq!(
        sample(&m, "ferry_replicas_removed_total{reason=\"pressure\"}"),
        4.0,
        "{m}"
    );
    drop(c);
}

/// Reader leases: a leased path names one version for the lease's life,
/// through a re-save under `keep_last = 1` and past the policy, until the
/// lease expires or is released; bad lease input is refused clearly and
/// removes nothing; `ferry resolve --lease -- CMD` holds a lease while
/// the command runs.
#[tokio::test]
async fn a_leased_version_outlives_a_re_save_and_its_policy_until_the_lease_ends() {
    leases(None).await;
}

/// The same on a sink whose catalog is PostgreSQL.
#[tokio::test]
async fn leases_hold_versions_on_a_postgresql_catalog() {
    let db = common::pg::fresh_db("retention_leases").await;
    leases(Some(&db)).await;
    common::pg::drop_db(&db).await;
}

/// The `[catalog]` table that puts an agent on PostgreSQL database `db`
/// (nothing: SQLite).
fn catalog_tail(db: Option<&str>) -> String {
    db.map_or_else(String::new, |u| {
        format!("\n[catalog]\nurl = {}\n", toml_str(u))
    })
}

async fn leases(db: Option<&str>) {
    let w = World::new("leases").await;
    let reader = api::auth::new_token();
    let other = api::auth::new_token();
    let operator = api::auth::new_token();
    let tokens = format!(
        "[[api.tokens]]\nname = \"evals\"\nrole = \"reader\"\nhash = \"{}\"\n\n\
         [[api.tokens]]\nname = \"other-evals\"\nrole = \"reader\"\nhash = \"{}\"\n\n\
         [[api.tokens]]\nname = \"ops\"\nrole = \"operator\"\nhash = \"{}\"\n",
        api::auth::hash_token(&reader),
        api::auth::hash_token(&other),
        api::auth::hash_token(&operator)
    );
    let c = w
        .start_cluster("200Mbit/s", &[], |sink, _| {
            sink.api = tokens.clone();
            sink.tail = catalog_tail(db);
            sink.sink.as_mut().unwrap().extra = "retention_interval = \"1s\"\n\n\
                 [[sink.retention]]\njob = \"*\"\nkeep_last = 1\n"
                .into();
        })
        .await;
    let api = Api {
        http: reqwest::Client::new(),
        url: c.sink.url(),
        reader: reader.clone(),
        operator: operator.clone(),
    };
    let get =
        async |token: &str, path: &str| api.call(token, reqwest::Method::GET, path, None).await;
    let lease_url = |path: &Path, lease: &str| {
        format!("/v1/resolve?path={}&lease={lease}", path.to_str().unwrap())
    };
    let ckpt = |step: u32| w.source_root().join(format!("step_{step:06}"));
    let push = async |step: u32| {
        let out = w.push(&c.source, &ckpt(step), &[]).await;
        w.ensure(out.success(), || format!("ferry push: {out}"));
        api.published(&format!("step_{step:06}")).await.unwrap()
    };
    w.gen(&ckpt(100), "600KB").await;
    let v1 = push(100).await;
    let v1_id = v1["id"].as_i64().unwrap();

    // A leased resolve names the version's own directory.
    let (st, r) = get(&reader, &lease_url(&ckpt(100), "10m")).await;
    assert_eq!(st, StatusCode::OK, "{r}");
    assert_eq!(r["state"], "local", "{r}");
    assert_eq!(r["replica"], v1_id, "{r}");
    let leased = std::path::PathBuf::from(r["local_path"].as_str().unwrap());
    assert!(
        leased.starts_with(w.sink_root().join(".ferry/versions")),
        "{r}"
    );
    let lease1 = r["lease"]["id"].as_str().unwrap().to_string();
    assert_eq!(r["lease"]["holder"], "evals", "{r}");
    let plain = api.resolve(&ckpt(100)).await;
    assert_eq!(
        plain["local_path"],
        w.replica_path("step_000100").to_str().unwrap()
    );
    assert!(plain.get("lease").is_none(), "{plain}");
    // The reader opens one file now; the old bytes, for later.
    let snapshot = w.root.join("step_100-v1");
    copy_tree(&ckpt(100), &snapshot);
    let files = files_under(&ckpt(100));
    let (first, rest) = files.split_first().unwrap();
    assert_eq!(
        std::fs::read(leased.join(first)).unwrap(),
        std::fs::read(snapshot.join(first)).unwrap()
    );

    // Training saves step 100 again: every file rewritten, one added.
    for f in &files {
        if f != "COMMITTED" {
            let p = ckpt(100).join(f);
            let mut b = std::fs::read(&p).unwrap();
            b.iter_mut().for_each(|x| *x = x.wrapping_add(1));
            std::fs::write(&p, b).unwrap();
        }
    }
    std::fs::write(ckpt(100).join("extra.bin"), b"new in the re-save").unwrap();
    let v2 = push(100).await;
    let v2_id = v2["id"].as_i64().unwrap();
    assert_ne!(v2_id, v1_id);
    // The published path names the new version at once...
    w.assert_same_tree(&ckpt(100), &w.replica_path("step_000100"));
    // ...while the leased path still names the old one, passes later: a
    // file the reader had not opened yet has the old version's bytes.
    tokio::time::sleep(Duration::from_secs(3)).await;
    for f in rest {
        assert_eq!(
            std::fs::read(leased.join(f)).unwrap(),
            std::fs::read(snapshot.join(f)).unwrap(),
            "{f} in the leased version"
        );
    }
    w.assert_same_tree(&snapshot, &leased);
    let row1 = api
        .replicas("published")
        .await
        .into_iter()
        .find(|r| r["id"] == v1_id)
        .unwrap();
    assert_eq!(row1["replaced_by"], v2_id, "{row1}");
    assert_eq!(row1["leases"][0]["id"], lease1.as_str(), "{row1}");
    assert!(row1["leased_until"].is_i64(), "{row1}");
    let m = api.metrics().await;
    assert_eq!(sample(&m, "ferry_leased_replicas"), 1.0, "{m}");

    // Bad input: clear errors, nothing removed.
    for (q, want, says) in [
        ("-5m", StatusCode::UNPROCESSABLE_ENTITY, "`lease`"),
        ("0s", StatusCode::UNPROCESSABLE_ENTITY, "at least 1s"),
        ("8d", StatusCode::UNPROCESSABLE_ENTITY, "at most 7d"),
        ("soon", StatusCode::UNPROCESSABLE_ENTITY, "`lease`"),
    ] {
        let (st, body) = get(&reader, &lease_url(&ckpt(100), q)).await;
        assert_eq!(st, want, "lease={q}: {body}");
        assert!(body["error"].as_str().unwrap().contains(says), "{body}");
    }
    let (st, body) = get(&reader, &lease_url(&ckpt(999), "1m")).await;
    assert_eq!(
        (st, body["state"].as_str()),
        (StatusCode::OK, Some("unknown"))
    );
    assert!(body.get("lease").is_none(), "{body}");
    let post = async |token: &str, path: &str| {
        api.call(token, reqwest::Method::POST, path, Some(json!({})))
            .await
    };
    let (st, body) = post(&reader, "/v1/leases/0123456789abcdef0123456789abcdef/renew").await;
    assert_eq!(st, StatusCode::NOT_FOUND, "{body}");
    let (st, body) = post(&reader, "/v1/leases/not-a-lease/renew").await;
    assert_eq!(st, StatusCode::NOT_FOUND, "{body}");
    let renew1 = format!("/v1/leases/{lease1}/renew");
    let (st, body) = post(&other, &renew1).await;
    assert_eq!(st, StatusCode::FORBIDDEN, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("held by evals"),
        "{body}"
    );
    let (st, body) = post(&reader, &renew1).await;
    assert_eq!(st, StatusCode::OK, "{body}");
    assert!(leased.exists());

    // A 2 s lease on the current version, then a newer checkpoint: under
    // keep_last = 1, step 100 expires, but not while the lease holds it.
    let (st, r2) = get(&reader, &lease_url(&ckpt(100), "2s")).await;
    assert_eq!(st, StatusCode::OK, "{r2}");
    assert_eq!(r2["replica"], v2_id, "{r2}");
    let leased2 = std::path::PathBuf::from(r2["local_path"].as_str().unwrap());
    // An operator's removal is refused, naming the holder.
    let (st, body) = api
        .call(
            &operator,
            reqwest::Method::DELETE,
            &format!("/v1/replicas/{v2_id}"),
            None,
        )
        .await;
    assert_eq!(st, StatusCode::CONFLICT, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("leased by evals"),
        "{body}"
    );
    w.gen(&ckpt(200), "100KB").await;
    let t = std::time::Instant::now();
    push(200).await;
    assert!(leased2.join("COMMITTED").exists(), "removed while leased");
    let gone = wait_removed(&w, &api, v2_id, "step 100 (its lease expired)").await;
    assert_eq!(gone["removal"]["reason"], "rule", "{gone}");
    assert!(
        t.elapsed() < Duration::from_secs(2 + 10 + 5),
        "removed {:?} after the push: later than the lease plus ten intervals",
        t.elapsed()
    );
    assert!(!leased2.exists());

    // Removing the replaced, leased version by hand says what holds it.
    let (st, body) = api
        .call(
            &operator,
            reqwest::Method::DELETE,
            &format!("/v1/replicas/{v1_id}"),
            None,
        )
        .await;
    assert_eq!(st, StatusCode::CONFLICT, "{body}");
    let e = body["error"].as_str().unwrap();
    assert!(
        e.contains(&format!("replaced by replica {v2_id}")) && e.contains("reader lease"),
        "{e}"
    );
    // The first lease, released by its holder: the old version goes.
    assert!(leased.exists(), "the renewed lease still holds it");
    let (st, body) = api
        .call(
            &reader,
            reqwest::Method::DELETE,
            &format!("/v1/leases/{lease1}"),
            None,
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{body}");
    wait_gone(&w, &leased, "the released version to go").await;
    let (st, body) = post(&reader, &renew1).await;
    assert_eq!(st, StatusCode::GONE, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("released"),
        "{body}"
    );

    // `ferry resolve --lease -- CMD`: the command reads the leased path
    // ({} and FERRY_PATH), the lease lives while it runs and is released
    // after; its exit code is ferry's.
    let out_file = w.root.join("cmd-out");
    let script = format!(
        "test \"$FERRY_PATH\" = \"$1\" && cat \"$1/COMMITTED\" > /dev/null && \
         echo \"$FERRY_LEASE\" > {} && exit 7",
        out_file.display()
    );
    let c200 = ckpt(200);
    let args = [
        "resolve",
        c200.to_str().unwrap(),
        "--lease",
        "1m",
        "--server",
        &api.url,
        "--token",
        &reader,
        "--",
        "sh",
        "-c",
        &script,
        "sh",
        "{}",
    ];
    let out = w.ferry(&args, &[], Duration::from_secs(60)).await;
    assert_eq!(out.code, Some(7), "{out}");
    let held = std::fs::read_to_string(&out_file).unwrap();
    let (st, body) = post(&reader, &format!("/v1/leases/{}/renew", held.trim())).await;
    assert_eq!(st, StatusCode::GONE, "released after the command: {body}");
    let (_, after) = get(&reader, "/v1/leases").await;
    assert_eq!(after["items"], json!([]), "{after}");
    // A command without --lease is refused before anything runs.
    let out = w
        .ferry(
            &[
                "resolve",
                c200.to_str().unwrap(),
                "--server",
                &api.url,
                "--",
                "true",
            ],
            &[],
            Duration::from_secs(30),
        )
        .await;
    assert!(!out.success() && out.all().contains("--lease"), "{out}");

    // SIGTERM to ferry goes to the command, and the lease is held until
    // the command has exited, then released.
    let pid_file = w.root.join("cmd-pid");
    let script = format!(
        "echo $$ > {}; trap 'sleep 1; exit 9' TERM; while true; do sleep 0.1; done",
        pid_file.display()
    );
    let mut child = tokio::process::Command::new(FERRY)
        .args(["resolve", c200.to_str().unwrap(), "--lease", "1m"])
        .args([
            "--server", &api.url, "--token", &reader, "--", "sh", "-c", &script,
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let leases_now = async || {
        get(&reader, "/v1/leases").await.1["items"]
            .as_array()
            .unwrap()
            .len()
    };
    w.wait_until("the command to start under a lease", TRANSFER, async || {
        if pid_file.exists() && leases_now().await == 1 {
            Ok(())
        } else {
            Err("not yet".to_string())
        }
    })
    .await;
    let ferry_pid = nix::unistd::Pid::from_raw(child.id().unwrap() as i32);
    nix::sys::signal::kill(ferry_pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        leases_now().await,
        1,
        "the lease went before the command ended"
    );
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(9), "the command's exit code");
    assert_eq!(leases_now().await, 0, "released once the command ended");

    // Removed by hand with force while leased: the lease holds nothing,
    // and says why.
    let (st, r) = get(&reader, &lease_url(&ckpt(200), "10m")).await;
    assert_eq!(st, StatusCode::OK, "{r}");
    let id200 = r["replica"].as_i64().unwrap();
    let lease = r["lease"]["id"].as_str().unwrap().to_string();
    let (st, body) = api
        .call(
            &operator,
            reqwest::Method::DELETE,
            &format!("/v1/replicas/{id200}?force=true"),
            None,
        )
        .await;
    assert_eq!(st, StatusCode::ACCEPTED, "{body}");
    assert_eq!(leases_now().await, 0);
    let (st, body) = post(&reader, &format!("/v1/leases/{lease}/renew")).await;
    assert_eq!(st, StatusCode::GONE, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("was removed"),
        "{body}"
    );
    drop(c);
}

/// Copies the regular files under `from` to `to`, keeping modes and
/// modification times.
fn copy_tree(from: &Path, to: &Path) {
    for f in files_under(from) {
        let (src, dst) = (from.join(&f), to.join(&f));
        std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
        std::fs::copy(&src, &dst).unwrap();
        let md = std::fs::metadata(&src).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&dst)
            .unwrap()
            .set_modified(md.modified().unwrap())
            .unwrap();
    }
}

/// A loss-spike signal pins, at the sink, the last checkpoint before its
/// step (one the source's `select` had skipped: replicated for the pin)
/// and the first at or after it (here, then one published later for a
/// second signal); under `keep_last = 1` they stay while pinned, with
/// the signal named as the reason, and go once the pins end.
#[tokio::test]
async fn a_loss_spike_pins_the_checkpoints_around_it_until_the_pins_end() {
    signal_pins(None).await;
}

/// The same on a sink whose catalog is PostgreSQL.
#[tokio::test]
async fn signal_pins_on_a_postgresql_catalog() {
    let db = common::pg::fresh_db("retention_pins").await;
    signal_pins(Some(&db)).await;
    common::pg::drop_db(&db).await;
}

async fn signal_pins(db: Option<&str>) {
    let w = World::new("signal-pins").await;
    let reader = api::auth::new_token();
    let tokens = format!(
        "[[api.tokens]]\nname = \"evals\"\nrole = \"reader\"\nhash = \"{}\"\n",
        api::auth::hash_token(&reader)
    );
    let c = w
        .start_cluster("200Mbit/s", &[], |sink, source| {
            sink.api = tokens.clone();
            sink.tail = catalog_tail(db);
            sink.sink.as_mut().unwrap().extra = "retention_interval = \"1s\"\n\n\
                 [[sink.retention]]\njob = \"*\"\nkeep_last = 1\n"
                .into();
            let s = source.source.as_mut().unwrap();
            s.scan_interval = "1s".into();
            s.extra = "pin_for = \"12s\"\npin_on = [\"loss_spike\"]\n".into();
            s.root_extra =
                "format = \"dcp\"\nselect = \"every_n_steps\"\nevery_n_steps = 200\n".into();
        })
        .await;
    let api = Api {
        http: reqwest::Client::new(),
        url: c.sink.url(),
        reader: reader.clone(),
        operator: reader.clone(),
    };
    let rel = |step: u64| format!("step_{step:08}");
    let root = w.source_root();
    let save = async |step: u64| {
        let args = [
            "gen",
            "--out",
            root.to_str().unwrap(),
            "--format",
            "dcp",
            "--step",
            &step.to_string(),
            "--size",
            "1.5MB",
        ];
        let out = w.ferry(&args, &[], Duration::from_secs(60)).await;
        w.ensure(out.success(), || format!("ferry gen: {out}"));
    };
    let published = async |step: u64| -> Value {
        w.wait_until(
            &format!("step {step} to be published"),
            TRANSFER,
            async || {
                api.published(&rel(step))
                    .await
                    .ok_or_else(|| "not yet".to_string())
            },
        )
        .await
    };
    let signal = async |step: &str| {
        let args = [
            "signal",
            "--job",
            JOB,
            "--kind",
            "loss_spike",
            "--severity",
            "0.6",
            "--step",
            step,
            "--server",
        ];
        let mut args = args.to_vec();
        let url = c.source.url();
        args.push(&url);
        let out = w.ferry(&args, &[], Duration::from_secs(30)).await;
        w.ensure(out.success(), || format!("ferry signal: {out}"));
    };
    for step in [100, 200, 300, 400] {
        save(step).await;
    }
    let s400 = published(400).await;
    let id400 = s400["id"].as_i64().unwrap();
    assert_eq!(s400["step"], 400, "{s400}");
    // select kept 300 back (every 200 steps).
    assert!(api.published(&rel(300)).await.is_none());

    // A spike at 350: 300 (skipped, so replicated now) and 400 are pinned.
    signal("350").await;
    let s300 = published(300).await;
    let id300 = s300["id"].as_i64().unwrap();
    let pinned = async |id: i64| -> Value {
        w.wait_until(
            &format!("replica {id} to be pinned"),
            TRANSFER,
            async || {
                let r = api
                    .replicas("published")
                    .await
                    .into_iter()
                    .find(|r| r["id"] == id)
                    .ok_or_else(|| format!("replica {id} is not published"))?;
                if r["pin"].is_object() {
                    Ok(r)
                } else {
                    Err(format!("not pinned: {r}"))
                }
            },
        )
        .await
    };
    let p300 = pinned(id300).await;
    let p400 = pinned(id400).await;
    let reason = |r: &Value| r["pin"]["reason"].as_str().unwrap().to_string();
    assert!(
        reason(&p300).contains("loss_spike at step 350")
            && reason(&p300).contains("the last checkpoint before it"),
        "{p300}"
    );
    assert!(
        reason(&p400).contains("the first checkpoint at or after it"),
        "{p400}"
    );
    assert!(p300["pin"]["until"].is_i64(), "a signal's pin ends: {p300}");

    // A spike at 450, past the newest checkpoint: 400 again, and the
    // first one written at or after 450: 500, which select skips, so the
    // watcher replicates it for the pin.
    signal("450").await;
    for step in [500, 600] {
        save(step).await;
    }
    let s500 = published(500).await;
    let p500 = pinned(s500["id"].as_i64().unwrap()).await;
    assert!(reason(&p500).contains("loss_spike at step 450"), "{p500}");
    published(600).await;
    // keep_last = 1: only the pins keep 300, 400 and 500 (200 went).
    let replicas = api.replicas("published").await;
    for id in [id300, id400] {
        assert!(replicas.iter().any(|r| r["id"] == id), "{replicas:?}");
    }
    assert!(api.published(&rel(200)).await.is_none(), "{replicas:?}");

    // A save that crashed (one shard, no .metadata) is the last before a
    // spike at 660: picked, but never published; its pin waits.
    let crashed = w.source_root().join(rel(650));
    std::fs::create_dir_all(&crashed).unwrap();
    std::fs::write(crashed.join("__0_0.distcp"), vec![7u8; 100_000]).unwrap();
    signal("660").await;
    // Step 400 saved again: the new version keeps the pin.
    std::fs::remove_dir_all(w.source_root().join(rel(400))).unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    save(400).await;
    let again = w
        .wait_until(
            "the re-save of step 400 to be published",
            TRANSFER,
            async || {
                api.replicas("published")
                    .await
                    .into_iter()
                    .find(|r| r["rel"] == rel(400) && r["id"] != id400)
                    .ok_or_else(|| "not yet".to_string())
            },
        )
        .await;
    let again = pinned(again["id"].as_i64().unwrap()).await;
    assert!(reason(&again).contains("loss_spike at step"), "{again}");
    assert!(
        api.published(&rel(650)).await.is_none(),
        "a crashed save was published"
    );
    let (_, v) = api
        .call(&reader, reqwest::Method::GET, "/v1/retention", None)
        .await;
    assert!(v["pending_pins"].to_string().contains("step 650"), "{v}");

    // Once the pins end (12 s after each request), the policy removes
    // them; 600 stays, the newest.
    for (r, what) in [
        (&p300, "step 300"),
        (&again, "step 400"),
        (&p500, "step 500"),
    ] {
        let r = wait_removed(&w, &api, r["id"].as_i64().unwrap(), what).await;
        assert_eq!(r["removal"]["reason"], "rule", "{r}");
    }
    assert!(api.published(&rel(600)).await.is_some());
    assert!(api.published(&rel(650)).await.is_none());
    drop(c);
}

/// Policies through the API: `GET /v1/retention` shows the config's
/// policies and each version's verdict (kept by which rule, until when);
/// `PUT /v1/retention` (operator) replaces them, refusing bad ones with
/// the key named and changing nothing, and the new ones run at once.
#[tokio::test]
async fn retention_policies_are_shown_and_replaced_through_the_api() {
    let w = World::new("retention-api").await;
    let (reader, operator, tokens) = reader_and_operator();
    let c = w
        .start_cluster("200Mbit/s", &[], |sink, _| {
            sink.api = tokens.clone();
            sink.sink.as_mut().unwrap().extra = "retention_interval = \"1s\"\n\n\
                 [[sink.retention]]\njob = \"*\"\nkeep_last = 3\nmin_age = \"1h\"\n"
                .into();
        })
        .await;
    let api = Api {
        http: reqwest::Client::new(),
        url: c.sink.url(),
        reader: reader.clone(),
        operator: operator.clone(),
    };
    let mut ids = Vec::new();
    for step in [100, 200, 300] {
        let ckpt = w.source_root().join(format!("step_{step:06}"));
        w.gen(&ckpt, "100KB").await;
        let out = w.push(&c.source, &ckpt, &[]).await;
        w.ensure(out.success(), || format!("ferry push: {out}"));
        ids.push(api.published(&format!("step_{step:06}")).await.unwrap()["id"].clone());
    }
    let (st, v) = api
        .call(&reader, reqwest::Method::GET, "/v1/retention", None)
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["set_by"], "config", "{v}");
    assert_eq!(v["policies"][0]["keep_last"], 3, "{v}");
    assert_eq!(v["policies"][0]["min_age"], "1h", "{v}");
    let versions = v["jobs"][0]["versions"].as_array().unwrap().clone();
    assert_eq!(versions.len(), 3, "{v}");
    for x in &versions {
        assert_eq!(x["kept"], true, "{x}");
        assert!(x["why"].as_str().unwrap().contains("min_age"), "{x}");
        assert!(
            x["until"].as_i64().unwrap() > x["published_at"].as_i64().unwrap(),
            "{x}"
        );
    }

    // Bad policies: refused naming what is wrong; nothing changes.
    let put = async |token: &str, body: Value| {
        api.call(token, reqwest::Method::PUT, "/v1/retention", Some(body))
            .await
    };
    let one = json!({"policies": [{"job": "*", "keep_last": 1}]});
    let (st, body) = put(&reader, one.clone()).await;
    assert_eq!(st, StatusCode::FORBIDDEN, "{body}");
    for (bad, says) in [
        (
            json!({"policies": [{"job": "*"}]}),
            "sets none of keep_last",
        ),
        (
            json!({"policies": [{"job": "*", "min_age": "soon"}]}),
            "min_age",
        ),
        (
            json!({"policies": [{"job": "*", "max_bytes": "lots"}]}),
            "max_bytes",
        ),
        (
            json!({"policies": [{"job": "*", "keep_last": 0}]}),
            "keep_last",
        ),
        (json!({"policies": [{"job": "[", "keep_last": 1}]}), "glob"),
        (
            json!({"policies": [{"job": "*", "keep_lost": 1}]}),
            "keep_lost",
        ),
    ] {
        let (st, body) = put(&operator, bad.clone()).await;
        assert_eq!(st, StatusCode::UNPROCESSABLE_ENTITY, "{bad}: {body}");
        assert!(
            body["error"].as_str().unwrap().contains(says),
            "{bad}: {body}"
        );
    }
    let (_, v) = api
        .call(&reader, reqwest::Method::GET, "/v1/retention", None)
        .await;
    assert_eq!(v["set_by"], "config", "{v}");
    assert_eq!(api.replicas("published").await.len(), 3);

    // keep_last 1 through the API: the two older versions go at once.
    let (st, v) = put(&operator, one).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert!(
        v["set_by"].as_str().unwrap().starts_with("API (by ops"),
        "{v}"
    );
    for id in &ids[..2] {
        let r = wait_removed(&w, &api, id.as_i64().unwrap(), "an older version").await;
        assert!(
            r["removal"]["detail"]
                .as_str()
                .unwrap()
                .contains("keep_last 1"),
            "{r}"
        );
    }
    let (_, v) = api
        .call(&reader, reqwest::Method::GET, "/v1/retention", None)
        .await;
    let versions = v["jobs"][0]["versions"].as_array().unwrap();
    assert_eq!(versions.len(), 1, "{v}");
    assert_eq!(versions[0]["replica"], ids[2], "{v}");
    // The API's policies outlive a restart (stored in the catalog).
    let mut sink = c.sink;
    w.restart(&mut sink).await;
    let (_, v) = api
        .call(&reader, reqwest::Method::GET, "/v1/retention", None)
        .await;
    assert!(v["set_by"].as_str().unwrap().starts_with("API"), "{v}");
    assert_eq!(v["policies"][0]["keep_last"], 1, "{v}");
}

/// Two sink agents of one site sharing a PostgreSQL catalog and one sink
/// root (a sink pool): a lease taken through one holds a version the
/// other published, against both agents' policies and sweeps; releasing
/// it through the other lets it go; a version the policy expires is
/// removed once; policies set through one agent are taken up by the
/// other.
#[tokio::test]
async fn a_sink_pool_shares_leases_policies_and_removals() {
    const SINK_2: &str = "eval-b-2";
    let w = World::new("sink-pool").await;
    w.certs("certs", &[SOURCE_NAME, SINK_NAME, SINK_2]).await;
    let db = common::pg::fresh_db("sink_pool").await;
    let (reader, operator, tokens) = reader_and_operator();
    let extra = "retention_interval = \"1s\"\n\n[[sink.retention]]\njob = \"*\"\nkeep_last = 1\n";
    let tail = format!(
        "{}\n[pool]\nheartbeat_interval = \"300ms\"\nlease_timeout = \"1500ms\"\n",
        catalog_tail(Some(&db))
    );
    let c = w
        .start_cluster("200Mbit/s", &[], |sink, _| {
            sink.api = tokens.clone();
            sink.tail = tail.clone();
            sink.sink.as_mut().unwrap().extra = extra.into();
        })
        .await;
    let mut cfg = w.sink_config();
    let certs = w.root.join("certs");
    cfg.name = SINK_2.into();
    cfg.cert = certs.join(format!("{SINK_2}.pem"));
    cfg.key = certs.join(format!("{SINK_2}.key"));
    cfg.data_dir = w.root.join("sink-2").join("data");
    cfg.api = tokens.clone();
    cfg.tail = tail.clone();
    cfg.sink.as_mut().unwrap().extra = extra.into();
    let sink2 = w.start_agent("sink-2", cfg, &[]).await;
    let api1 = Api {
        http: reqwest::Client::new(),
        url: c.sink.url(),
        reader: reader.clone(),
        operator: operator.clone(),
    };
    let api2 = Api {
        url: sink2.url(),
        http: reqwest::Client::new(),
        reader: reader.clone(),
        operator: operator.clone(),
    };
    let ckpt = |step: u32| w.source_root().join(format!("step_{step:06}"));
    let push = async |step: u32| {
        let out = w.push(&c.source, &ckpt(step), &[]).await;
        w.ensure(out.success(), || format!("ferry push: {out}"));
        api1.published(&format!("step_{step:06}")).await.unwrap()
    };
    w.gen(&ckpt(100), "300KB").await;
    let v1 = push(100).await;

    // A lease through the other agent on the version the first published.
    let (st, r) = api2
        .call(
            &reader,
            reqwest::Method::GET,
            &format!("/v1/resolve?path={}&lease=10m", ckpt(100).display()),
            None,
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{r}");
    assert_eq!(r["replica"], v1["id"], "{r}");
    let leased = std::path::PathBuf::from(r["local_path"].as_str().unwrap());
    let lease = r["lease"]["id"].as_str().unwrap().to_string();
    let snapshot = w.root.join("v1");
    copy_tree(&ckpt(100), &snapshot);
    // A re-save: both agents' sweeps leave the leased version whole.
    std::fs::write(ckpt(100).join("extra.bin"), b"re-saved").unwrap();
    let v2 = push(100).await;
    assert_ne!(v2["id"], v1["id"]);
    tokio::time::sleep(Duration::from_secs(3)).await;
    w.assert_same_tree(&snapshot, &leased);
    // Released through the first agent: the old version goes.
    let (st, body) = api1
        .call(
            &reader,
            reqwest::Method::DELETE,
            &format!("/v1/leases/{lease}"),
            None,
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{body}");
    wait_gone(&w, &leased, "the released version to go").await;

    // A newer checkpoint: keep_last 1 expires step 100, removed once.
    w.gen(&ckpt(200), "300KB").await;
    push(200).await;
    let id2 = v2["id"].as_i64().unwrap();
    let r = wait_removed(&w, &api2, id2, "step 100").await;
    assert_eq!(r["removal"]["reason"], "rule", "{r}");
    assert!(!w.replica_path("step_000100").exists());
    w.assert_same_tree(&ckpt(200), &w.replica_path("step_000200"));
    for (api, who) in [(&api1, "sink 1"), (&api2, "sink 2")] {
        let m = api.metrics().await;
        let n = sample(&m, "ferry_replicas_removed_total{reason=\"rule\"}");
        assert!(n <= 1.0, "{who} counted {n} removals: {m}");
    }
    let total: f64 = [api1.metrics().await, api2.metrics().await]
        .iter()
        .map(|m| sample(m, "ferry_replicas_removed_total{reason=\"rule\"}"))
        .sum();
    assert_eq!(total, 1.0, "the one expired version is removed once");

    // Policies set through one agent are the other's too.
    let (st, body) = api2
        .call(
            &operator,
            reqwest::Method::PUT,
            "/v1/retention",
            Some(json!({"policies": [{"job": "*", "keep_last": 4}]})),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{body}");
    let (_, v) = api1
        .call(&reader, reqwest::Method::GET, "/v1/retention", None)
        .await;
    assert_eq!(v["policies"][0]["keep_last"], 4, "{v}");
    assert!(
        v["set_by"].as_str().unwrap().starts_with("API (by ops"),
        "{v}"
    );
    for agent in [&c.sink, &sink2] {
        let log = agent.stderr();
        assert!(
            !log.contains("could not remove") && !log.contains("deleting a replaced version"),
            "{}: {log}",
            agent.label
        );
    }
    drop(sink2);
    drop(c);
    common::pg::drop_db(&db).await;
}
