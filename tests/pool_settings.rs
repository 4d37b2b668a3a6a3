//! A pool's shared settings: two source agents (real `ferry serve`
//! processes) on one PostgreSQL catalog (a fresh database on the server
//! at `FERRY_TEST_PG_URL`, started by `ops/test`). The first agent's
//! config seeds the scheduler's policy, the link's rate cap and the
//! jobs; the second, whose config differs, says so and uses the
//! catalog's. A change through either agent (`ferry pool set`) and a
//! signal taken by one reach the other. No sink is needed: the
//! transfers stay queued.

#![allow(clippy::unwrap_used)]

#[allow(dead_code)]
mod common;

use std::time::Duration;

use common::pg::*;
use common::*;
use serde_json::Value;
use sqlx::Connection;

/// The second source agent of the site.
const SOURCE_2: &str = "train-a-2";

/// How long a change may take to reach another agent here: it applies
/// it within about a second (at once on a notification); generous for
/// a loaded machine.
const PROPAGATION: Duration = Duration::from_secs(20);

/// The value `agent` uses for setting `name` (`GET /v1/settings`).
async fn setting(w: &World, agent: &Agent, name: &str) -> Value {
    let v = w.get_json(&format!("{}/v1/settings", agent.url())).await;
    w.ensure(v["shared"] == Value::Bool(true), || {
        format!("{}: settings not shared in a pool: {v}", agent.label)
    });
    v["items"]
        .as_array()
        .and_then(|a| a.iter().find(|i| i["name"] == name))
        .map(|i| i["value"].clone())
        .unwrap_or_else(|| w.fail(format!("{}: no setting {name} in {v}", agent.label)))
}

/// `ferry pool set KEY VALUE --server <agent>`, which must succeed.
async fn pool_set(w: &World, agent: &Agent, key: &str, value: &str) {
    let url = agent.url();
    let out = w
        .ferry(
            &["pool", "set", key, value, "--server", &url],
            &[],
            Duration::from_secs(30),
        )
        .await;
    w.ensure(out.success(), || {
        format!("ferry pool set {key} {value}: {out}")
    });
}

/// Waits until `agent` uses `want` for setting `name`.
async fn wait_setting(w: &World, agent: &Agent, name: &str, want: Value) {
    w.wait_until(
        &format!("{} to use {name} = {want}", agent.label),
        PROPAGATION,
        async || {
            let got = setting(w, agent, name).await;
            if got == want {
                Ok(())
            } else {
                Err(format!("{name} = {got}"))
            }
        },
    )
    .await;
}

/// The first agent seeds the pool's settings; the second, whose config
/// differs, logs each difference (setting, config value, catalog value)
/// and uses the catalog's. A change through either agent's API reaches
/// the other, and a signal taken by one raises the job's score on the
/// other.
#[tokio::test]
async fn the_catalog_wins_and_changes_and_signals_reach_every_agent() {
    let w = World::new("pool_settings").await;
    let db = fresh_db("settings_wins").await;
    w.certs("certs", &[SOURCE_NAME, SOURCE_2]).await;
    // Nobody listens here: transfers stay queued.
    let peer = format!("127.0.0.1:{}", free_udp_port());
    let start = async |label: &str, agent: &str, rate: &str, extra: &str| {
        let mut cfg = w.source_config(&peer, rate);
        let certs = w.root.join("certs");
        cfg.name = agent.into();
        cfg.cert = certs.join(format!("{agent}.pem"));
        cfg.key = certs.join(format!("{agent}.key"));
        cfg.data_dir = w.root.join(label).join("data");
        cfg.tail = format!(
            "\n[catalog]\nurl = {}\n\n[pool]\nheartbeat_interval = \"300ms\"\n\
             lease_timeout = \"1500ms\"\n{extra}",
            toml_str(&db)
        );
        w.start_agent(label, cfg, &[]).await
    };
    let job = |importance: f64| {
        format!(
            "\n[[jobs]]\nname = {}\nimportance = {importance}\n",
            toml_str(JOB)
        )
    };
    let a = start(
        "source-a",
        SOURCE_NAME,
        "1Gbit/s",
        &format!("\n[scheduler]\nmax_active = 4\n{}", job(0.8)),
    )
    .await;
    let b = start(
        "source-b",
        SOURCE_2,
        "500Mbit/s",
        &format!("\n[scheduler]\nmax_active = 7\n{}", job(0.2)),
    )
    .await;

    // B said what differs, with both values, and uses the catalog's.
    for (name, config, catalog) in [
        ("scheduler.max_active", "7", "4"),
        ("link.to-eval.rate", "500Mbit/s", "1Gbit/s"),
        ("job.llama-7b.importance", "0.2", "0.8"),
    ] {
        w.wait_until(
            &format!("{} to log that {name} differs", b.label),
            PROPAGATION,
            async || {
                let line = b
                    .stderr()
                    .lines()
                    .find(|l| {
                        l.contains("differs from the pool's catalog")
                            && l.contains(&format!("setting=\"{name}\""))
                            || l.contains("differs from the pool's catalog")
                                && l.contains(&format!("setting={name}"))
                    })
                    .map(str::to_string);
                match line {
                    Some(l)
                        if l.contains(&format!("config={config}"))
                            && l.contains(&format!("catalog={catalog}")) =>
                    {
                        Ok(())
                    }
                    Some(l) => Err(format!("logged without both values: {l}")),
                    None => Err("not logged".into()),
                }
            },
        )
        .await;
    }
    w.ensure(
        !a.stderr().contains("differs from the pool's catalog"),
        || format!("the seeding agent logged a difference: {}", a.stderr()),
    );
    assert_eq!(setting(&w, &b, "scheduler.max_active").await, 4);
    assert_eq!(setting(&w, &b, "link.to-eval.rate").await, 1_000_000_000u64);
    let links = w.get_json(&format!("{}/v1/links", b.url())).await;
    assert_eq!(links["items"][0]["rate_bps"], 1_000_000_000u64, "{links}");
    let jobs = w.get_json(&format!("{}/v1/jobs", b.url())).await;
    assert_eq!(jobs["items"][0]["importance"], 0.8, "{jobs}");
    // The settings list the jobs too (model size unknown here).
    assert_eq!(setting(&w, &b, "job.llama-7b.importance").await, 0.8);
    assert_eq!(
        setting(&w, &b, "job.llama-7b.model_params").await,
        Value::Null
    );

    // A change through one agent is applied by the other.
    pool_set(&w, &a, "scheduler.max_active", "8").await;
    wait_setting(&w, &b, "scheduler.max_active", 8.into()).await;
    pool_set(&w, &b, "link.to-eval.rate", "2Gbit").await;
    wait_setting(&w, &a, "link.to-eval.rate", 2_000_000_000u64.into()).await;
    w.wait_until("A's link to run at the new cap", PROPAGATION, async || {
        let l = w.get_json(&format!("{}/v1/links", a.url())).await;
        match l["items"][0]["rate_bps"].as_u64() {
            Some(2_000_000_000) => Ok(()),
            other => Err(format!("rate_bps {other:?}")),
        }
    })
    .await;
    // Who changed it is recorded (the open API's caller), not a config.
    let all = w.get_json(&format!("{}/v1/settings", a.url())).await;
    let by = all["items"]
        .as_array()
        .and_then(|v| v.iter().find(|i| i["name"] == "link.to-eval.rate"))
        .map(|i| i["updated_by"].clone())
        .unwrap_or_default();
    w.ensure(
        by.as_str().is_some_and(|s| !s.starts_with("config of")),
        || format!("link.to-eval.rate updated_by {by}"),
    );
    // PUT /v1/links (the UI's rate field) records its caller too: the
    // open API's `anonymous`.
    let r = w
        .http()
        .put(format!("{}/v1/links/to-eval", a.url()))
        .json(&serde_json::json!({ "rate_bps": 1_500_000_000u64 }))
        .send()
        .await
        .unwrap();
    w.ensure(r.status().is_success(), || format!("PUT /v1/links: {r:?}"));
    wait_setting(&w, &b, "link.to-eval.rate", 1_500_000_000u64.into()).await;
    let all = w.get_json(&format!("{}/v1/settings", b.url())).await;
    let by = all["items"]
        .as_array()
        .and_then(|v| v.iter().find(|i| i["name"] == "link.to-eval.rate"))
        .map(|i| i["updated_by"].clone())
        .unwrap_or_default();
    w.ensure(by == "anonymous", || {
        format!("PUT /v1/links should record its caller: updated_by {by}")
    });

    // A signal taken by A raises the job's severity (and score) on B.
    let ckpt = w.source_root().join("step_000100");
    w.gen(&ckpt, "64kB").await;
    let id = w.push_no_wait(&a, &ckpt).await;
    let ranking = async |agent: &Agent| {
        w.get_json(&format!("{}/v1/transfers/{id}", agent.url()))
            .await["ranking"]
            .clone()
    };
    let before = ranking(&b).await;
    assert_eq!(before["severity"], 0.0, "{before}");
    assert_eq!(before["score"]["severity"], 1.0, "{before}");
    let url = a.url();
    let out = w
        .ferry(
            &[
                "signal",
                "--job",
                JOB,
                "--kind",
                "loss_spike",
                "--severity",
                "0.9",
                "--server",
                &url,
            ],
            &[],
            Duration::from_secs(30),
        )
        .await;
    w.ensure(out.success(), || format!("ferry signal: {out}"));
    w.wait_until(
        "B to count A's signal in the job's score",
        PROPAGATION,
        async || {
            let r = ranking(&b).await;
            let sev = r["severity"].as_f64().unwrap_or(0.0);
            // The score's severity term: 1 + 2 x severity (the default
            // weight), 1 before the signal.
            let term = r["score"]["severity"].as_f64().unwrap_or(0.0);
            if sev > 0.8 && term > 2.6 {
                Ok(())
            } else {
                Err(format!("ranking {r}"))
            }
        },
    )
    .await;

    // The agents' notification connections are cut: they say so, and a
    // change still reaches the other agent (read every second, and
    // heard again once the listener is back).
    let mut c = sqlx::PgConnection::connect(&db).await.unwrap();
    let cut: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND query ILIKE 'LISTEN%'",
    )
    .fetch_all(&mut c)
    .await
    .unwrap();
    c.close().await.unwrap();
    assert_eq!(cut, [true, true], "one listener per agent");
    w.wait_until("B to notice its lost listener", PROPAGATION, async || {
        if b.stderr().contains("the notification connection") {
            Ok(())
        } else {
            Err("not logged".into())
        }
    })
    .await;
    pool_set(&w, &a, "scheduler.max_active", "5").await;
    wait_setting(&w, &b, "scheduler.max_active", 5.into()).await;
    for agent in [&a, &b] {
        w.ensure(
            agent
                .stderr()
                .matches("the notification connection")
                .count()
                >= 1,
            || format!("{} did not log the lost listener", agent.label),
        );
    }
    drop((a, b));
    drop_db(&db).await;
}
