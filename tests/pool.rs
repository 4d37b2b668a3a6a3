//! A site's pool: two source agents (real `ferry serve` processes) on one
//! PostgreSQL catalog (a fresh database on the server at
//! `FERRY_TEST_PG_URL`, started by `ops/test`), one sink behind
//! `ferry link-emu`. Transfers are claimed under leases timed by the
//! database clock; a killed agent's transfer is taken over; a drained
//! agent claims nothing.

#![allow(clippy::unwrap_used)]

#[allow(dead_code)]
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::pg::*;
use common::*;
use serde_json::Value;
use sqlx::{Connection, Row};

/// The second source agent of the site.
const SOURCE_2: &str = "train-a-2";

/// One lease of the catalog's history.
#[derive(Debug, Clone)]
struct Lease {
    transfer: i64,
    epoch: i64,
    agent: String,
    claimed_at: i64,
    ended_at: Option<i64>,
    end_reason: Option<String>,
}

async fn leases(db: &str) -> Vec<Lease> {
    let mut c = sqlx::PgConnection::connect(db).await.unwrap();
    let rows = sqlx::query(
        "SELECT transfer, epoch, agent, claimed_at, ended_at, end_reason FROM transfer_leases \
         ORDER BY transfer, epoch",
    )
    .fetch_all(&mut c)
    .await
    .unwrap();
    c.close().await.unwrap();
    rows.iter()
        .map(|r| Lease {
            transfer: r.get("transfer"),
            epoch: r.get("epoch"),
            agent: r.get("agent"),
            claimed_at: r.get("claimed_at"),
            ended_at: r.get("ended_at"),
            end_reason: r.get("end_reason"),
        })
        .collect()
}

/// Fails unless the leases of each transfer follow one another in time.
fn assert_no_overlap(w: &World, ls: &[Lease]) {
    let mut by: BTreeMap<i64, Vec<&Lease>> = BTreeMap::new();
    for l in ls {
        by.entry(l.transfer).or_default().push(l);
    }
    for (t, v) in by {
        for pair in v.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            w.ensure(
                a.ended_at.is_some_and(|e| e <= b.claimed_at) && a.epoch < b.epoch,
                || format!("leases of transfer {t} overlap: {a:?} then {b:?}"),
            );
        }
    }
}

struct Site {
    db: String,
    sink: Agent,
    _relay: Relay,
    a: Agent,
    b: Agent,
}

/// A sink, a relay at `rate`, and two source agents of one site on one
/// fresh PostgreSQL catalog with a short heartbeat (300 ms) and lease
/// timeout (1.5 s). Both read the same source root.
async fn site(w: &World, name: &str, rate: &str) -> Site {
    site_with(w, name, rate, |_, db| db.to_string(), |_| {}, &[]).await
}

/// [`site`], each source agent reaching the catalog at `url(agent, db)`, each
/// source agent's config changed by `tweak` first, the second agent run
/// through `b_wrap` (see [`Agent::wrap`]).
async fn site_with(
    w: &World,
    name: &str,
    rate: &str,
    url: impl Fn(&str, &str) -> String,
    tweak: impl Fn(&mut AgentConfig),
    b_wrap: &[String],
) -> Site {
    let db = fresh_db(&format!("pool_{name}")).await;
    w.certs("certs", &[SOURCE_NAME, SOURCE_2, SINK_NAME]).await;
    let sink = w.start_agent("sink", w.sink_config(), &[]).await;
    let relay = w.start_relay(&sink.cfg.quic_listen, rate).await;
    let tail = |url: &str| {
        format!(
            "\n[catalog]\nurl = {}\n\n[pool]\nheartbeat_interval = \"300ms\"\nlease_timeout = \"1500ms\"\n",
            toml_str(url)
        )
    };
    let start = async |label: &str, agent: &str, url: String, wrap: &[String]| {
        let mut cfg = w.source_config(&format!("127.0.0.1:{}", relay.port), rate);
        let certs = w.root.join("certs");
        cfg.name = agent.into();
        cfg.cert = certs.join(format!("{agent}.pem"));
        cfg.key = certs.join(format!("{agent}.key"));
        cfg.data_dir = w.root.join(label).join("data");
        cfg.tail = tail(&url);
        tweak(&mut cfg);
        w.start_agent_wrapped(label, cfg, &[], wrap).await
    };
    let a = start("source-a", SOURCE_NAME, url(SOURCE_NAME, &db), &[]).await;
    let b = start("source-b", SOURCE_2, url(SOURCE_2, &db), b_wrap).await;
    Site {
        db,
        sink,
        _relay: relay,
        a,
        b,
    }
}

/// Waits until every transfer of `ids` is published (as any agent of
/// the pool lists it).
async fn wait_published(w: &World, agent: &Agent, ids: &[i64]) {
    w.wait_until(
        "every transfer to be published",
        Duration::from_secs(120),
        async || {
            let ts = w.transfers(agent).await;
            let left: Vec<String> = ids
                .iter()
                .filter_map(|id| {
                    let t = ts.iter().find(|t| t["id"].as_i64() == Some(*id));
                    match t.map(|t| s(t, "state")) {
                        Some("published") => None,
                        Some(st) if st == "failed" || st == "cancelled" => {
                            w.fail(format!("transfer {id} ended {st}: {t:?}"))
                        }
                        st => Some(format!("{id}: {st:?}")),
                    }
                })
                .collect();
            if left.is_empty() {
                Ok(())
            } else {
                Err(left.join(", "))
            }
        },
    )
    .await;
}

/// Checkpoints pushed through either agent of the pool are replicated
/// once each, byte-identical; both agents carry transfers, and no two
/// leases of one transfer overlap. `ferry pool` on either agent lists
/// both. A drained agent claims nothing: what is pushed through it runs
/// on the other.
#[tokio::test]
async fn two_source_agents_share_the_work_and_a_drained_one_claims_nothing() {
    let w = World::new("pool").await;
    let mut names = Vec::new();
    for i in 0..6 {
        let name = format!("step_{:06}", 100 * (i + 1));
        w.gen(&w.source_root().join(&name), "3MB").await;
        names.push(name);
    }
    // 3 MB transfers are not small here, so they count against
    // max_active (4).
    let mut site = site_with(
        &w,
        "share",
        "40Mbit/s",
        |_, db| db.to_string(),
        |cfg| cfg.tail += "\n[scheduler]\nsmall_transfer = \"1MiB\"\n",
        &[],
    )
    .await;
    // All six through one agent: it runs its share of max_active (2 of
    // 4) and leaves the rest to the other agent for a while, which
    // claims them at its next pass.
    let mut ids = Vec::new();
    for n in &names {
        ids.push(w.push_no_wait(&site.a, &w.source_root().join(n)).await);
    }
    wait_published(&w, &site.a, &ids).await;
    for n in &names {
        w.assert_same_tree(&w.source_root().join(n), &w.replica_path(n));
    }
    let replicas = w
        .get_json(&format!("{}/v1/replicas?limit=1000", site.sink.url()))
        .await;
    let published: Vec<&Value> = replicas["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| s(r, "state") == "published")
        .collect();
    w.ensure(published.len() == names.len(), || {
        format!(
            "expected {} published replicas, one each: {replicas}",
            names.len()
        )
    });
    let ls = leases(&site.db).await;
    let holders: BTreeSet<&str> = ls.iter().map(|l| l.agent.as_str()).collect();
    w.ensure(
        holders.contains(SOURCE_NAME) && holders.contains(SOURCE_2),
        || format!("both agents should have carried transfers pushed through one: {ls:?}"),
    );
    w.ensure(
        ls.iter()
            .all(|l| l.end_reason.as_deref() == Some("released")),
        || format!("every lease should have been released: {ls:?}"),
    );
    assert_no_overlap(&w, &ls);

    // Either agent shows the whole pool.
    for via in [&site.a, &site.b] {
        let out = w
            .ferry(
                &["pool", "--server", &via.url()],
                &[],
                Duration::from_secs(30),
            )
            .await;
        w.ensure(
            out.success()
                && out.stdout.contains(SOURCE_NAME)
                && out.stdout.contains(SOURCE_2)
                && out.stdout.matches(" live ").count() == 2,
            || {
                format!(
                    "ferry pool through {} should list both agents live: {out}",
                    via.label
                )
            },
        );
    }

    // Drain b through a; then push through b: a runs it.
    let out = w
        .ferry(
            &[
                "drain",
                SOURCE_2,
                "--wait",
                "30s",
                "--server",
                &site.a.url(),
            ],
            &[],
            Duration::from_secs(60),
        )
        .await;
    w.ensure(
        out.success() && out.stdout.contains("holds nothing"),
        || format!("ferry drain failed: {out}"),
    );
    let pool = w.get_json(&format!("{}/v1/pool", site.b.url())).await;
    let b = pool["agents"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == SOURCE_2)
        .cloned()
        .unwrap();
    w.ensure(s(&b, "state") == "draining", || format!("{pool}"));
    // The catalog refuses the drained agent's claims at once.
    let late = w.source_root().join("step_000900");
    w.gen(&late, "2MB").await;
    let id = w.push_no_wait(&site.b, &late).await;
    wait_published(&w, &site.a, &[id]).await;
    let ls = leases(&site.db).await;
    let of_late: Vec<&Lease> = ls.iter().filter(|l| l.transfer == id).collect();
    w.ensure(
        !of_late.is_empty() && of_late.iter().all(|l| l.agent == SOURCE_NAME),
        || format!("the drained agent should not have claimed transfer {id}: {ls:?}"),
    );

    site.a.kill();
    site.b.kill();
    site.sink.kill();
    drop_db(&site.db).await;
}

/// SIGKILL the agent holding a transfer: once its lease lapses (1.5 s
/// here, by the database clock) the other agent claims the transfer
/// and publishes it, sending less than the whole (the sink keys the
/// transfer by the source catalog, not by agent); the leases do not
/// overlap, the first one ended `lapsed`, the taker counts a takeover,
/// and `ferry pool` shows the killed agent down.
#[tokio::test]
async fn a_killed_agent_s_transfer_is_taken_over_by_another() {
    let w = World::new("pool-kill").await;
    let ckpt = w.source_root().join("step_000100");
    w.gen(&ckpt, "40MB").await;
    // 40 MB at 40 Mbit/s: about 8 s, time to kill the sender midway.
    let mut site = site(&w, "kill", "40Mbit/s").await;
    let id = w.push_no_wait(&site.a, &ckpt).await;
    // Killed once the sink has 16 MiB of it verified in staging.
    w.wait_until(
        "the sink to hold part of the transfer",
        Duration::from_secs(60),
        async || {
            let v = w
                .get_json(&format!("{}/v1/replicas?limit=10", site.sink.url()))
                .await;
            let done = v["items"]
                .as_array()
                .and_then(|a| a.first())
                .and_then(|r| r["bytes_done"].as_u64())
                .unwrap_or(0);
            if done >= 16 << 20 {
                Ok(())
            } else {
                Err(format!("{done} bytes at the sink: {v}"))
            }
        },
    )
    .await;
    let ls = leases(&site.db).await;
    w.ensure(
        ls.len() == 1 && ls[0].agent == SOURCE_NAME && ls[0].ended_at.is_none(),
        || format!("the first agent should hold the only lease: {ls:?}"),
    );
    site.a.kill();
    wait_published(&w, &site.b, &[id]).await;
    w.assert_same_tree(&ckpt, &w.replica_path("step_000100"));
    let ls = leases(&site.db).await;
    assert_no_overlap(&w, &ls);
    w.ensure(
        ls.len() == 2
            && ls[0].end_reason.as_deref() == Some("lapsed")
            && ls[1].agent == SOURCE_2
            && ls[1].end_reason.as_deref() == Some("released"),
        || format!("expected a lapsed lease then the second agent's: {ls:?}"),
    );
    let metrics = w.metrics_text(&site.b).await;
    w.ensure(metrics.contains("ferry_lease_takeovers_total 1"), || {
        format!("the second agent should count one takeover:\n{metrics}")
    });
    // The sink keys the transfer by the source catalog, so the second
    // agent sent only what the sink lacked.
    let sent: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("ferry_sent_bytes_total{"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum();
    let total = 40_000_000.0;
    w.ensure(sent > 0.0 && sent < total * 0.85, || {
        format!("the second agent sent {sent} bytes of a {total}-byte checkpoint:\n{metrics}")
    });
    let pool_via_b = async || {
        w.ferry(
            &["pool", "--server", &site.b.url()],
            &[],
            Duration::from_secs(30),
        )
        .await
    };
    let out = pool_via_b().await;
    let line_a = out
        .stdout
        .lines()
        .find(|l| l.contains(SOURCE_NAME))
        .unwrap_or_default()
        .to_string();
    w.ensure(line_a.contains(" down "), || {
        format!("ferry pool should show the killed agent down: {out}")
    });
    // An operator forgets the dead agent; a live one, or an unknown name,
    // is refused, naming why.
    let forget = async |name: &str| {
        w.ferry(
            &["pool", "forget", name, "--server", &site.b.url()],
            &[],
            Duration::from_secs(30),
        )
        .await
    };
    let out = forget(SOURCE_2).await;
    w.ensure(!out.success() && out.all().contains("is live"), || {
        format!("forgetting a live agent should be refused: {out}")
    });
    let out = forget("nobody").await;
    w.ensure(
        !out.success() && out.all().contains("no agent \"nobody\""),
        || format!("forgetting an unknown agent should be refused: {out}"),
    );
    let out = forget(SOURCE_NAME).await;
    w.ensure(out.success(), || format!("ferry pool forget: {out}"));
    let out = pool_via_b().await;
    w.ensure(out.success() && !out.stdout.contains(SOURCE_NAME), || {
        format!("the forgotten agent should no longer be listed: {out}")
    });
    site.b.kill();
    site.sink.kill();
    drop_db(&site.db).await;
}

/// The value of an unlabelled sample in Prometheus text, or the sum of a
/// labelled family's samples.
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter(|l| {
            let rest = &l[name.len()..];
            rest.starts_with(' ') || rest.starts_with('{')
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// One agent loses the catalog for 10 s while it sends: its `/metrics`
/// and `/v1/pool` still answer and say so (`ferry_catalog_up 0`,
/// `catalog_up` false), it stops sending before its lease can lapse,
/// the other agent takes the transfer over, nothing is lost (published
/// once, byte-identical, leases never overlap), and once the catalog is
/// back the first agent is live again.
#[tokio::test]
async fn an_agent_that_loses_the_catalog_stops_sending_and_loses_nothing() {
    catalog_outage(false).await;
}

/// The catalog is gone for every source agent for 10 s (as if PostgreSQL
/// stopped): both say so, neither sends nor claims, and once it is back
/// the transfer is finished by one of them, nothing lost.
#[tokio::test]
async fn a_catalog_stopped_for_10_s_stops_the_pool_and_loses_nothing() {
    catalog_outage(true).await;
}

async fn catalog_outage(both: bool) {
    let w = World::new(if both { "pool-stop" } else { "pool-outage" }).await;
    let ckpt = w.source_root().join("step_000100");
    w.gen(&ckpt, "40MB").await;
    let pg = pg_addr().await;
    let cut = Cut::start(pg).await;
    let via = |agent: &str, db: &str| {
        if both || agent == SOURCE_NAME {
            db.replacen(&pg.to_string(), &format!("127.0.0.1:{}", cut.port), 1)
        } else {
            db.to_string()
        }
    };
    let name = if both { "stop" } else { "outage" };
    let mut site = site_with(&w, name, "40Mbit/s", via, |_| {}, &[]).await;
    w.ensure(site.a.cfg.tail.contains(&cut.port.to_string()), || {
        format!(
            "the first agent should reach the catalog through the cut: {}",
            site.a.cfg.tail
        )
    });
    let id = w.push_no_wait(&site.a, &ckpt).await;
    w.wait_until(
        "the first agent to send",
        Duration::from_secs(60),
        async || {
            let sent = metric(&w.metrics_text(&site.a).await, "ferry_sent_bytes_total");
            if sent > 4e6 {
                Ok(())
            } else {
                Err(format!("{sent} bytes sent"))
            }
        },
    )
    .await;
    cut.down();
    let cut_at = std::time::Instant::now();
    // Its metrics answer without the catalog and say it is gone.
    w.wait_until("ferry_catalog_up 0", Duration::from_secs(30), async || {
        let m = w.metrics_text(&site.a).await;
        if m.contains("ferry_catalog_up 0") {
            Ok(())
        } else {
            Err("still 1".into())
        }
    })
    .await;
    let cut_off: Vec<&Agent> = if both {
        vec![&site.a, &site.b]
    } else {
        vec![&site.a]
    };
    for a in &cut_off {
        w.wait_until(
            "the agent to say its catalog is gone",
            Duration::from_secs(30),
            async || {
                let pool = w.get_json(&format!("{}/v1/pool", a.url())).await;
                if pool["catalog_up"] == false {
                    Ok(())
                } else {
                    Err(format!("{pool}"))
                }
            },
        )
        .await;
    }
    // They stop sending: their leases (1.5 s) cannot be renewed.
    tokio::time::sleep(Duration::from_secs(3).saturating_sub(cut_at.elapsed())).await;
    let mut before = Vec::new();
    for a in &cut_off {
        before.push(metric(&w.metrics_text(a).await, "ferry_sent_bytes_total"));
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    for (a, before) in cut_off.iter().zip(before) {
        let after = metric(&w.metrics_text(a).await, "ferry_sent_bytes_total");
        w.ensure(after == before, || {
            format!(
                "{} without its catalog kept sending: {before} then {after} bytes",
                a.label
            )
        });
    }
    tokio::time::sleep(Duration::from_secs(10).saturating_sub(cut_at.elapsed())).await;
    cut.up();
    wait_published(&w, &site.b, &[id]).await;
    w.assert_same_tree(&ckpt, &w.replica_path("step_000100"));
    let ls = leases(&site.db).await;
    assert_no_overlap(&w, &ls);
    w.ensure(
        ls.first()
            .is_some_and(|l| l.end_reason.as_deref() == Some("lapsed")),
        || format!("the lease held through the outage should have lapsed: {ls:?}"),
    );
    w.ensure(both || ls.iter().any(|l| l.agent == SOURCE_2), || {
        format!("the second agent should have taken the transfer over: {ls:?}")
    });
    w.wait_until(
        "the first agent to be live again",
        Duration::from_secs(60),
        async || {
            let m = w.metrics_text(&site.a).await;
            let pool = w.get_json(&format!("{}/v1/pool", site.b.url())).await;
            let a = pool["agents"]
                .as_array()
                .and_then(|v| v.iter().find(|x| x["name"] == SOURCE_NAME).cloned())
                .unwrap_or_default();
            if m.contains("ferry_catalog_up 1") && a["state"] == "live" {
                Ok(())
            } else {
                Err(format!("{a}"))
            }
        },
    )
    .await;
    let m = w.metrics_text(&site.a).await;
    w.ensure(metric(&m, "ferry_leases_lost_total") >= 1.0, || {
        format!("the first agent should count its lost lease:\n{m}")
    });
    site.a.kill();
    site.b.kill();
    site.sink.kill();
    drop_db(&site.db).await;
}

/// Turns a source agent's watcher on: rescans every 0.5 s, 1 s quiet
/// period.
fn watcher_on(src: &mut AgentConfig) {
    if let Some(s) = src.source.as_mut() {
        s.scan_interval = "500ms".into();
        s.extra = "quiet_period = \"1s\"\n".into();
    }
}

/// The watch of `root` as `agent`'s `GET /v1/pool` shows it.
async fn watch_of(w: &World, agent: &Agent, root: &str) -> Value {
    let pool = w.get_json(&format!("{}/v1/pool", agent.url())).await;
    pool["watches"]
        .as_array()
        .and_then(|ws| ws.iter().find(|x| x["root"] == root).cloned())
        .unwrap_or_default()
}

/// Waits until one agent holds a live watch of `root`; its name.
async fn watcher_of(w: &World, via: &Agent, root: &str) -> String {
    w.wait_until(
        "one agent to watch the root",
        Duration::from_secs(60),
        async || {
            let v = watch_of(w, via, root).await;
            match (v["holder"].as_str(), v["live"].as_bool()) {
                (Some(h), Some(true)) => Ok(h.to_string()),
                _ => Err(format!("{v}")),
            }
        },
    )
    .await
}

/// Two source agents configured with one watched root: one of them
/// watches it. SIGKILL that one while a training job writes a checkpoint
/// it streams: the other takes the watch over once the lease lapses,
/// adopts the transfer, and the checkpoint is replicated once,
/// identical; no two leases of the transfer overlap.
#[tokio::test]
async fn a_killed_watcher_s_root_is_taken_over_and_its_checkpoint_replicated_once() {
    watched_checkpoint_moves_to_the_other_agent(false).await;
}

/// As above, but the watching agent is drained (`ferry drain --wait`):
/// it releases the watch and its transfer at once and reports that it
/// holds nothing; the other agent finishes the checkpoint.
#[tokio::test]
async fn a_drained_watcher_hands_its_root_over() {
    watched_checkpoint_moves_to_the_other_agent(true).await;
}

/// As above, but the watching agent's route to the catalog becomes a
/// black hole (connections stay open, nothing answers): it stops its run
/// and its watch before its leases lapse, and the other agent finishes.
#[tokio::test]
async fn a_watcher_cut_off_from_the_catalog_stops_before_its_leases_lapse() {
    watched_checkpoint_moves(Move::BlackHole).await;
}

#[derive(Clone, Copy, PartialEq)]
enum Move {
    Kill,
    Drain,
    BlackHole,
}

async fn watched_checkpoint_moves_to_the_other_agent(drain: bool) {
    watched_checkpoint_moves(if drain { Move::Drain } else { Move::Kill }).await;
}

async fn watched_checkpoint_moves(how: Move) {
    let w = World::new(match how {
        Move::Drain => "pool-watch-drain",
        Move::Kill => "pool-watch",
        Move::BlackHole => "pool-watch-hole",
    })
    .await;
    let pg = pg_addr().await;
    // Each agent reaches the catalog through its own proxy.
    let cuts = [Cut::start(pg).await, Cut::start(pg).await];
    let ports = [cuts[0].port, cuts[1].port];
    let root = w.source_root();
    std::fs::create_dir_all(&root).unwrap();
    let key = std::fs::canonicalize(&root)
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let mut site = site_with(
        &w,
        match how {
            Move::Drain => "watch_drain",
            Move::Kill => "watch",
            Move::BlackHole => "watch_hole",
        },
        "200Mbit/s",
        |agent, db| {
            let i = usize::from(agent != SOURCE_NAME);
            db.replacen(&pg.to_string(), &format!("127.0.0.1:{}", ports[i]), 1)
        },
        watcher_on,
        &[],
    )
    .await;
    let holder = watcher_of(&w, &site.a, &key).await;
    let holder_cut = &cuts[usize::from(holder != SOURCE_NAME)];
    let (watching, other) = if holder == SOURCE_NAME {
        (&mut site.a, &site.b)
    } else {
        (&mut site.b, &site.a)
    };
    // 40 MB at 40 Mbit/s: the save takes about 8 s.
    let mut gen = w.spawn_dcp_save(&root, "700", "40MB", "40Mbit/s");
    let ckpt = root.join("step_00000700");
    let path = ckpt.to_str().unwrap().to_string();
    w.wait_until(
        "the watching agent to stream the checkpoint",
        Duration::from_secs(60),
        async || {
            let ts = w.transfers(watching).await;
            match ts.iter().find(|t| s(t, "source_path") == path) {
                Some(t) if t["bytes_sent"].as_u64().unwrap_or(0) > 0 => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    match how {
        Move::Drain => {
            let out = w
                .ferry(
                    &["drain", &holder, "--wait", "30s", "--server", &other.url()],
                    &[],
                    Duration::from_secs(60),
                )
                .await;
            w.ensure(
                out.success() && out.stdout.contains("holds nothing"),
                || format!("ferry drain of the watching agent failed: {out}"),
            );
        }
        Move::Kill => watching.kill(),
        Move::BlackHole => {
            holder_cut.black_hole();
            let cut_at = std::time::Instant::now();
            // The lease timeout is 1.5 s: within it (and a margin for a
            // loaded machine) the run stops and stops sending.
            w.wait_until(
                "the cut-off agent to stop its run",
                Duration::from_secs(20),
                async || {
                    let log = std::fs::read_to_string(&watching.stderr_path).unwrap_or_default();
                    if log.contains("may no longer hold the transfer's lease") {
                        Ok(())
                    } else {
                        Err("no fence in its log yet".into())
                    }
                },
            )
            .await;
            let stopped_after = cut_at.elapsed();
            w.ensure(stopped_after < Duration::from_secs(6), || {
                format!(
                    "the run stopped {stopped_after:?} after the cut; the lease lapses after 1.5 s"
                )
            });
            let before = metric(&w.metrics_text(watching).await, "ferry_sent_bytes_total");
            tokio::time::sleep(Duration::from_secs(3)).await;
            let after = metric(&w.metrics_text(watching).await, "ferry_sent_bytes_total");
            w.ensure(after == before, || {
                format!("the cut-off agent kept sending: {before} then {after} bytes")
            });
        }
    }
    let status = gen.wait().await.unwrap();
    w.ensure(status.success(), || format!("ferry gen failed: {status}"));
    let t = w
        .wait_until(
            "the checkpoint to publish",
            Duration::from_secs(120),
            async || {
                let ts = w.transfers(other).await;
                let mine: Vec<&Value> = ts.iter().filter(|t| s(t, "source_path") == path).collect();
                match mine.as_slice() {
                    [t] if s(t, "state") == "published" => Ok((*t).clone()),
                    [t] => Err(format!("transfer {}", s(t, "state"))),
                    more => Err(format!("{} transfers: {more:?}", more.len())),
                }
            },
        )
        .await;
    w.ensure(s(&t, "checkpoint") == "committed", || format!("{t}"));
    w.assert_same_tree(&ckpt, &w.replica_path("step_00000700"));
    let v = watch_of(&w, other, &key).await;
    let other_name = if holder == SOURCE_NAME {
        SOURCE_2
    } else {
        SOURCE_NAME
    };
    w.ensure(
        v["holder"] == other_name && v["live"] == true && v["epoch"].as_i64() == Some(2),
        || format!("the other agent should watch the root under epoch 2: {v}"),
    );
    let replicas = w
        .get_json(&format!("{}/v1/replicas?limit=1000", site.sink.url()))
        .await;
    let published = replicas["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| s(r, "state") == "published")
        .count();
    w.ensure(published == 1, || {
        format!("the checkpoint should be published once: {replicas}")
    });
    let ls = leases(&site.db).await;
    assert_no_overlap(&w, &ls);
    w.ensure(ls.iter().any(|l| l.agent == other_name), || {
        format!("the other agent should have taken the transfer over: {ls:?}")
    });
    site.a.kill();
    site.b.kill();
    site.sink.kill();
    drop_db(&site.db).await;
}

/// Sets the mtime of every file under `dir` an hour back (settled for
/// a fingerprint).
fn age_files(dir: &std::path::Path) {
    let back = std::time::SystemTime::now() - Duration::from_secs(3600);
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            age_files(&p);
        } else {
            std::fs::File::options()
                .write(true)
                .open(&p)
                .unwrap()
                .set_modified(back)
                .unwrap();
        }
    }
}

/// The second agent runs in its own mount namespace, where another
/// directory is mounted over the root's path: it sees other storage
/// there. Whichever agent watches the root, the other one records that
/// its fingerprint differs (`GET /v1/pool`, `ferry pool`), and does not
/// take the watch over when the watching agent dies. Needs root (for
/// `unshare --mount`), as `ops/test` runs.
#[tokio::test]
async fn an_agent_that_sees_other_storage_at_the_root_refuses_to_watch_it() {
    other_storage_at_the_root(false).await;
}

/// As above, with an empty directory over the root (a missing mount):
/// even if the agent that sees nothing took the watch first, it gives it
/// up to the agent that sees the files, which watches the root in the
/// end.
#[tokio::test]
async fn an_agent_with_a_missing_mount_never_keeps_the_watch() {
    other_storage_at_the_root(true).await;
}

async fn other_storage_at_the_root(empty: bool) {
    let w = World::new(if empty {
        "pool-missing-mount"
    } else {
        "pool-fingerprint"
    })
    .await;
    let root = w.source_root();
    w.gen(&root.join("step_000100"), "1MB").await;
    let elsewhere = w.root.join("elsewhere");
    if empty {
        std::fs::create_dir_all(&elsewhere).unwrap();
    } else {
        w.gen(&elsewhere.join("step_000100"), "2MB").await;
    }
    age_files(&root);
    age_files(&elsewhere);
    let key = std::fs::canonicalize(&root)
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let wrap: Vec<String> = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        "mount --bind \"$0\" \"$1\" && shift && exec \"$@\"",
        elsewhere.to_str().unwrap(),
        &key,
    ]
    .iter()
    .map(|x| x.to_string())
    .collect();
    let mut site = site_with(
        &w,
        if empty {
            "missing_mount"
        } else {
            "fingerprint"
        },
        "200Mbit/s",
        |_, db| db.to_string(),
        watcher_on,
        &wrap,
    )
    .await;
    let mut holder = watcher_of(&w, &site.a, &key).await;
    if empty {
        // The agent that sees nothing gives the watch up (it looks every
        // 15 s while it holds it) to the one that sees the files.
        holder = w
            .wait_until(
                "the agent that sees the files to watch the root",
                Duration::from_secs(60),
                async || {
                    let v = watch_of(&w, &site.a, &key).await;
                    if v["holder"] == SOURCE_NAME && v["live"] == true {
                        Ok(SOURCE_NAME.to_string())
                    } else {
                        Err(format!("{v}"))
                    }
                },
            )
            .await;
    }
    let refuser = if holder == SOURCE_NAME {
        SOURCE_2
    } else {
        SOURCE_NAME
    };
    let v = w
        .wait_until(
            "the other agent to refuse the root",
            Duration::from_secs(60),
            async || {
                let v = watch_of(&w, &site.a, &key).await;
                let refused = v["refused"].as_array().cloned().unwrap_or_default();
                match refused.as_slice() {
                    [r] if r["agent"] == refuser => Ok(r.clone()),
                    _ => Err(format!("{v}")),
                }
            },
        )
        .await;
    let named = if empty {
        "sees 0 settled file"
    } else {
        "step_000100"
    };
    w.ensure(s(&v, "reason").contains(named), || {
        format!("the reason should say {named:?}: {v}")
    });
    let refusing = if refuser == SOURCE_NAME {
        &site.a
    } else {
        &site.b
    };
    let m = w.metrics_text(refusing).await;
    let line = format!("ferry_root_refused{{root=\"{key}\"}} 1");
    w.ensure(m.contains(&line), || {
        format!("the refusing agent should export {line}:\n{m}")
    });
    let out = w
        .ferry(
            &["pool", "--server", &site.a.url()],
            &[],
            Duration::from_secs(30),
        )
        .await;
    w.ensure(
        out.success() && out.stdout.contains("watched roots") && out.stdout.contains(refuser),
        || format!("ferry pool should show the refusal: {out}"),
    );
    // The watching agent dies; the other never takes the root over.
    let (dead, alive) = if holder == SOURCE_NAME {
        (&mut site.a, &site.b)
    } else {
        (&mut site.b, &site.a)
    };
    dead.kill();
    // Its lease (1.5 s) lapses; give the survivor three lease timeouts
    // of heartbeats to (wrongly) claim it.
    w.wait_until(
        "the dead agent's watch lease to lapse",
        Duration::from_secs(30),
        async || {
            let v = watch_of(&w, alive, &key).await;
            if v["live"] == false {
                Ok(())
            } else {
                Err(format!("{v}"))
            }
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(4500)).await;
    let v = watch_of(&w, alive, &key).await;
    w.ensure(v["holder"] == holder.as_str() && v["live"] == false, || {
        format!("nobody should watch the root after its watcher died: {v}")
    });
    site.a.kill();
    site.b.kill();
    site.sink.kill();
    drop_db(&site.db).await;
}
