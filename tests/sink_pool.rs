//! A sink pool: two sink agents (real `ferry serve` processes) of one
//! site on one PostgreSQL catalog (a fresh database on the server at
//! `FERRY_TEST_PG_URL`) and one sink root (a local directory, an HDFS
//! directory or an S3 prefix on the servers `ops/test` starts), each
//! behind its own `ferry link-emu`. One source agent's link names both
//! (`more_peers`). Leases last 5 s, heartbeats come every second.
//!
//! - A sink agent SIGKILLed mid-transfer: the source moves to the other,
//!   which resumes from what the pool's catalog and staging area hold;
//!   the replica is published once, byte-identical, and both sink agents
//!   resolve it alike.
//! - The publishing sink agent SIGKILLed inside its publish (the
//!   fault-injection kill points) and kept down: the other claims the
//!   lapsed publish lease and finishes the publish from disk.
//! - The sink site's PostgreSQL gone for 10 s mid-transfer: nothing is
//!   confirmed meanwhile, and once it is back the transfer finishes with
//!   every chunk recorded and the publish recorded.
//! - `ferry demo --agents 2` runs both pools as processes.
//! - One checkpoint striped across two source agents (a source pool on
//!   its own PostgreSQL database) and two sink agents: parts of 8 MiB,
//!   claimed by both source agents, received by both sink agents into one
//!   staging area, published once.

#![allow(clippy::unwrap_used)]

#[allow(dead_code)]
mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::pg::*;
use common::remote::*;
use common::*;
use replicator::storage::build;
use replicator::storage::posix::Posix;
use serde_json::Value;
use sqlx::{Connection, Row};

/// The second sink agent of the site.
const SINK_2: &str = "eval-b-2";

/// The second source agent of the source site (striped tests).
const SOURCE_2: &str = "train-a-2";

/// [`replicator::sink::FAULT_KILL_ENV`].
const FAULT_ENV: &str = "FERRY_FAULT_KILL_IN_PUBLISH";

/// Bound for a transfer that should complete, a sink agent's death
/// noticed (the QUIC idle timeout, 10 s) included.
const TRANSFER: Duration = Duration::from_secs(120);

struct SinkPool {
    db: String,
    source: Agent,
    sinks: [Agent; 2],
    _relays: [Relay; 2],
}

/// Two sink agents sharing a fresh PostgreSQL catalog and the sink root
/// (`remote`'s, or [`World::sink_root`]), each behind a relay at `rate`,
/// the first one started with `first_env`; one source agent (its own
/// SQLite catalog) whose link dials the first, then the second.
async fn sink_pool(
    w: &World,
    name: &str,
    remote: Option<&RemoteSink>,
    rate: &str,
    first_env: &[(&str, &str)],
) -> SinkPool {
    sink_pool_via(w, name, remote, rate, first_env, None).await
}

/// [`sink_pool`], the sink agents reaching their catalog through `cut`
/// when given.
async fn sink_pool_via(
    w: &World,
    name: &str,
    remote: Option<&RemoteSink>,
    rate: &str,
    first_env: &[(&str, &str)],
    cut: Option<&Cut>,
) -> SinkPool {
    let db = fresh_db(&format!("sink_pool_{name}")).await;
    w.certs("certs", &[SOURCE_NAME, SINK_NAME, SINK_2]).await;
    let url = match cut {
        Some(c) => db.replacen(
            &pg_addr().await.to_string(),
            &format!("127.0.0.1:{}", c.port),
            1,
        ),
        None => db.clone(),
    };
    let tail = format!(
        "\n[catalog]\nurl = {}\n\n[pool]\nheartbeat_interval = \"1s\"\nlease_timeout = \"5s\"\n",
        toml_str(&url)
    );
    let mut first = w.sink_config();
    first.tail = tail.clone();
    if let Some(r) = remote {
        let spec = first.sink.as_mut().unwrap();
        spec.root = PathBuf::from(&r.url);
        spec.extra = r.lines.clone();
    }
    let mut second = first.clone();
    let certs = w.root.join("certs");
    second.name = SINK_2.into();
    second.cert = certs.join(format!("{SINK_2}.pem"));
    second.key = certs.join(format!("{SINK_2}.key"));
    second.data_dir = w.root.join("sink-2").join("data");
    second.api_port = free_tcp_port();
    second.quic_listen = format!("127.0.0.1:{}", free_udp_port());
    let s1 = w.start_agent("sink", first, first_env).await;
    let s2 = w.start_agent("sink-2", second, &[]).await;
    let r1 = w.start_relay(&s1.cfg.quic_listen, rate).await;
    let r2 = w.start_relay(&s2.cfg.quic_listen, rate).await;
    let mut src = w.source_config(&format!("127.0.0.1:{}", r1.port), rate);
    src.links[0].more_peers = vec![(format!("127.0.0.1:{}", r2.port), SINK_2.to_string())];
    let source = w.start_agent("source", src, &[]).await;
    SinkPool {
        db,
        source,
        sinks: [s1, s2],
        _relays: [r1, r2],
    }
}

/// Waits until the source's transfer `id` is published.
async fn wait_published(w: &World, source: &Agent, id: i64) -> Value {
    w.wait_until("the transfer to be published", TRANSFER, async || {
        let t = w.transfer(source, id).await;
        match s(&t, "state") {
            "published" => Ok(t),
            "failed" | "cancelled" => w.fail(format!("the transfer ended: {t}")),
            _ => Err(format!("{t}")),
        }
    })
    .await
}

/// Waits until `sink`'s catalog records 4 MiB of the transfer verified.
async fn holds_part(w: &World, sink: &Agent) {
    let url = format!("{}/v1/replicas?limit=10", sink.url());
    w.wait_until(
        "the first sink agent to hold part of the transfer",
        Duration::from_secs(60),
        async || {
            let v = w.get_json(&url).await;
            let done = v["items"][0]["bytes_done"].as_u64().unwrap_or(0);
            if done >= 4 << 20 {
                Ok(())
            } else {
                Err(format!("{done} bytes verified: {v}"))
            }
        },
    )
    .await;
}

/// Fails unless the replica of `ckpt` at `rel` matches it byte for byte
/// (file paths, sizes and chunk hashes; on a local root the whole tree).
fn assert_replica(w: &World, remote: Option<&RemoteSink>, ckpt: &Path, rel: &str) {
    let Some(r) = remote else {
        w.assert_same_tree(ckpt, &w.replica_path(rel));
        return;
    };
    let markers = ["COMMITTED".to_string()];
    let chunk = ferry_proto::manifest::MIN_CHUNK_SIZE;
    let original = build(&Posix, ckpt, &markers, chunk).unwrap();
    let replica = PathBuf::from(format!("{}/{SOURCE_SITE}/{JOB}/{rel}", r.root));
    w.ensure((r.committed)(&replica), || {
        format!("{}: not committed", replica.display())
    });
    let copy = build(&*r.store, &replica, &markers, chunk).unwrap();
    w.ensure(content(&copy) == content(&original), || {
        format!(
            "the replica at {} differs from the checkpoint",
            replica.display()
        )
    });
}

/// The sink catalog's replica rows of `rel` by state, and the publish
/// leases taken on its path (epochs).
async fn catalog_view(db: &str, rel: &str) -> (Vec<String>, Vec<(Option<String>, i64)>) {
    let mut c = sqlx::PgConnection::connect(db).await.unwrap();
    let like = format!("%/{rel}");
    let states = sqlx::query("SELECT state FROM replicas WHERE local_path LIKE $1 ORDER BY id")
        .bind(&like)
        .fetch_all(&mut c)
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<String, _>("state"))
        .collect();
    let leases =
        sqlx::query("SELECT holder, lease_epoch FROM publish_leases WHERE local_path LIKE $1")
            .bind(&like)
            .fetch_all(&mut c)
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get("holder"), r.get("lease_epoch")))
            .collect();
    c.close().await.unwrap();
    (states, leases)
}

/// The sink agent holding part of the transfer is SIGKILLed once the
/// pool's catalog records 4 MiB of it verified: the source dials the
/// other sink agent, which resumes (sending less than the whole), and
/// publishes once, byte-identical. Restarted, the killed agent resolves
/// the checkpoint as the other does.
async fn sink_killed_mid_transfer(w: &World, remote: Option<&RemoteSink>, name: &str) {
    let ckpt = w.source_root().join("step_000100");
    let total = 24_000_000.0;
    w.gen(&ckpt, "24MB").await;
    // 24 MB at 24 Mbit/s: about 8 s, time to kill the receiver midway.
    let mut pool = sink_pool(w, name, remote, "24Mbit/s", &[]).await;
    let id = w.push_no_wait(&pool.source, &ckpt).await;
    holds_part(w, &pool.sinks[0]).await;
    let links = format!("{}/v1/links", pool.source.url());
    let v = w.get_json(&links).await;
    w.ensure(v["items"][0]["sink"] == SINK_NAME, || {
        format!("/v1/links should name the sink agent the link is connected to: {v}")
    });
    pool.sinks[0].kill();
    // The rest of the transfer goes to the other sink agent (after the
    // QUIC idle timeout), which /v1/links names meanwhile.
    w.wait_until(
        "the link to be connected to the other sink agent",
        TRANSFER,
        async || {
            let v = w.get_json(&links).await;
            if v["items"][0]["sink"] == SINK_2 {
                return Ok(());
            }
            let t = w.transfer(&pool.source, id).await;
            if s(&t, "state") == "published" {
                w.fail(format!("published before /v1/links named {SINK_2}: {v}"));
            }
            Err(format!("{v}"))
        },
    )
    .await;
    wait_published(w, &pool.source, id).await;
    assert_replica(w, remote, &ckpt, "step_000100");
    let log = pool.source.stderr();
    w.ensure(
        log.contains("connected to another sink agent of the link"),
        || format!("the source should say it moved to the other sink agent:\n{log}"),
    );
    let m = w.metrics_text(&pool.sinks[1]).await;
    let received: f64 = m
        .lines()
        .filter(|l| l.starts_with("ferry_received_bytes_total{"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum();
    w.ensure(received > 0.0 && received < total * 0.9, || {
        format!("the second sink agent received {received} of {total} bytes: it should resume\n{m}")
    });
    let (states, _) = catalog_view(&pool.db, "step_000100").await;
    w.ensure(states == ["published"], || {
        format!("one replica row, published once: {states:?}")
    });
    // Both sink agents answer alike.
    w.restart(&mut pool.sinks[0]).await;
    let a = w.resolve(&pool.sinks[0], &ckpt).await;
    let b = w.resolve(&pool.sinks[1], &ckpt).await;
    w.ensure(
        s(&a, "state") == "local"
            && a["replica"] == b["replica"]
            && a["url"] == b["url"]
            && a["local_path"] == b["local_path"],
        || format!("resolve through each sink agent: {a} vs {b}"),
    );
    for a in &mut pool.sinks {
        a.kill();
    }
    pool.source.kill();
    drop_db(&pool.db).await;
}

/// The first sink agent SIGKILLs itself at publish step `point` (see
/// `FAULT_KILL_ENV`) and stays down: the source moves to the second,
/// which takes the publish lease over once it lapsed and finishes the
/// publish from disk: published once, byte-identical, resolvable.
async fn publisher_killed_kept_down(
    w: &World,
    remote: Option<&RemoteSink>,
    name: &str,
    point: &str,
) {
    let ckpt = w.source_root().join("step_000200");
    w.gen(&ckpt, "3MB").await;
    let mut pool = sink_pool(w, name, remote, "200Mbit/s", &[(FAULT_ENV, point)]).await;
    let id = w.push_no_wait(&pool.source, &ckpt).await;
    let first = &mut pool.sinks[0];
    let status = w
        .wait_until(
            &format!("the first sink agent to kill itself at {point}"),
            TRANSFER,
            async || first.exited().ok_or_else(|| "still running".to_string()),
        )
        .await;
    w.ensure(
        std::os::unix::process::ExitStatusExt::signal(&status) == Some(9),
        || format!("{point}: the sink exited with {status}, not SIGKILL"),
    );
    wait_published(w, &pool.source, id).await;
    assert_replica(w, remote, &ckpt, "step_000200");
    let log = pool.sinks[1].stderr();
    w.ensure(
        log.contains("took over the publish lease of a sink agent whose lease lapsed"),
        || format!("{point}: the second sink agent should take the publish over:\n{log}"),
    );
    let (states, leases) = catalog_view(&pool.db, "step_000200").await;
    w.ensure(states == ["published"], || {
        format!("{point}: one replica row, published once: {states:?}")
    });
    w.ensure(leases == [(None, 2)], || {
        format!("{point}: two publish leases (the lapsed one, the taker's, released): {leases:?}")
    });
    let res = w.resolve(&pool.sinks[1], &ckpt).await;
    w.ensure(s(&res, "state") == "local", || {
        format!("{point}: resolve {res}")
    });
    pool.sinks[1].kill();
    pool.source.kill();
    drop_db(&pool.db).await;
}

#[tokio::test]
async fn a_sink_agent_killed_mid_transfer_is_replaced_by_another_of_the_pool() {
    let w = World::new("sink-pool-kill").await;
    sink_killed_mid_transfer(&w, None, "kill").await;
}

#[tokio::test]
async fn a_sink_pool_on_s3_survives_a_sink_agent_killed_mid_transfer() {
    let w = World::new("sink-pool-s3-kill").await;
    let r = s3_sink(&w, "sink-pool-s3-kill");
    sink_killed_mid_transfer(&w, Some(&r), "s3_kill").await;
}

#[tokio::test]
async fn a_sink_pool_on_hdfs_survives_a_sink_agent_killed_mid_transfer() {
    let w = World::new("sink-pool-hdfs-kill").await;
    let r = hdfs_sink("sink-pool-hdfs-kill");
    sink_killed_mid_transfer(&w, Some(&r), "hdfs_kill").await;
}

#[tokio::test]
async fn a_publish_cut_short_by_a_killed_sink_agent_is_finished_by_another() {
    let w = World::new("sink-pool-publish").await;
    publisher_killed_kept_down(&w, None, "publish", "placed").await;
}

#[tokio::test]
async fn an_s3_publish_cut_short_by_a_killed_sink_agent_is_finished_by_another() {
    let w = World::new("sink-pool-s3-publish").await;
    let r = s3_sink(&w, "sink-pool-s3-publish");
    publisher_killed_kept_down(&w, Some(&r), "s3_publish", "markers-in").await;
}

#[tokio::test]
async fn an_hdfs_publish_cut_short_by_a_killed_sink_agent_is_finished_by_another() {
    let w = World::new("sink-pool-hdfs-publish").await;
    let r = hdfs_sink("sink-pool-hdfs-publish");
    publisher_killed_kept_down(&w, Some(&r), "hdfs_publish", "switched").await;
}

/// `ferry demo --agents 2`: two source agents and two sink agents, each a
/// process of its own, on the PostgreSQL cluster the demo starts; its JSON
/// summary lists each agent's payload bytes, which add up to the
/// checkpoints' on each side; every replica matched its checkpoint. Fewer
/// than 1 or more than 8 agents are refused, naming the range, and so is
/// `--loss` with `--netns`.
#[tokio::test]
async fn ferry_demo_with_agents_runs_a_source_pool_and_a_sink_pool() {
    let w = World::new("demo-agents").await;
    let out = w
        .ferry(&["demo", "--agents", "9"], &[], Duration::from_secs(30))
        .await;
    w.ensure(
        !out.success() && out.all().contains("--agents must be 1 to 8, got 9"),
        || format!("ferry demo --agents 9: {out}"),
    );
    // A background checkpoint too small to stripe over every agent is
    // refused before anything starts, naming both values.
    let out = w
        .ferry(
            &["demo", "--agents", "2", "--preempt", "--size", "1MB"],
            &[],
            Duration::from_secs(30),
        )
        .await;
    w.ensure(
        !out.success()
            && out
                .all()
                .contains("--size 1000000 (1 MB) is below 2 x --part-size")
            && !out.all().contains("PostgreSQL"),
        || format!("ferry demo --preempt --size 1MB: {out}"),
    );
    // A watched checkpoint too small for its save's format: refused
    // before anything starts, naming the format.
    let out = w
        .ferry(
            &[
                "demo",
                "--agents",
                "2",
                "--write-rate",
                "400Mbit/s",
                "--save",
                "dcp",
                "--size",
                "100kB",
            ],
            &[],
            Duration::from_secs(30),
        )
        .await;
    w.ensure(
        !out.success()
            && out.all().contains(
                "--size 100000 is too small for a --save dcp checkpoint: the smallest is about",
            )
            && !out.all().contains("PostgreSQL"),
        || format!("ferry demo --write-rate --save dcp --size 100kB: {out}"),
    );
    // Under --netns the loss is the emulator's: refused before anything
    // starts, whether or not the namespaces are up.
    let out = w
        .ferry(
            &["demo", "--agents", "2", "--netns", "--loss", "0.01"],
            &[],
            Duration::from_secs(30),
        )
        .await;
    w.ensure(
        !out.success()
            && out.all().contains("--loss is the emulator's under --netns")
            && !out.all().contains("PostgreSQL"),
        || format!("ferry demo --agents 2 --netns --loss 0.01: {out}"),
    );
    let v = demo_json(
        &w,
        &["--agents", "2", "--size", "8MB", "--rate", "100Mbit/s"],
    )
    .await;
    let p = &v["pool"];
    w.ensure(
        p["identical"] == true && p["checkpoints"] == 4 && p["bytes"] == 8_000_000,
        || format!("summary: {v}"),
    );
    let agents = p["per_agent"].as_array().cloned().unwrap_or_default();
    let names: Vec<&str> = agents.iter().filter_map(|a| a["name"].as_str()).collect();
    w.ensure(
        names == ["train-a-1", "train-a-2", "eval-b-1", "eval-b-2"],
        || format!("agents: {v}"),
    );
    for role in ["source", "sink"] {
        let sum: u64 = agents
            .iter()
            .filter(|a| a["role"] == role)
            .filter_map(|a| a["bytes"].as_u64())
            .sum();
        // (A chunk sent again after a lost connection counts twice.)
        w.ensure((8_000_000..8_800_000).contains(&sum), || {
            format!("the {role} agents' bytes add up to {sum}: {v}")
        });
    }
    // Each agent's CPU, the machine's idle share and the catalogs' load
    // over the replication window (heartbeats alone make transactions).
    w.ensure(
        agents
            .iter()
            .all(|a| a["cpu_s"].as_f64().is_some_and(|c| c >= 0.0))
            && p["cpu"]["machine_idle_share"]
                .as_f64()
                .is_some_and(|i| (0.0..=1.0).contains(&i))
            && p["cpu"]["cores"].as_u64().is_some_and(|c| c >= 1)
            && p["catalog_tps"]["source_site"]
                .as_f64()
                .is_some_and(|t| t > 0.0)
            && p["catalog_tps"]["sink_site"]
                .as_f64()
                .is_some_and(|t| t > 0.0),
        || format!("CPU and catalog load: {v}"),
    );
    // Pre-emption across the pool: the background checkpoint is striped
    // over both source agents (the demo waits for that), the urgent one
    // is published and its latency reported.
    let v = demo_json(
        &w,
        &[
            "--agents",
            "2",
            "--preempt",
            "--part-size",
            "1MiB",
            "--size",
            "16MB",
            "--rate",
            "100Mbit/s",
        ],
    )
    .await;
    let p = &v["pool_preempt"];
    w.ensure(
        p["urgent_bytes"] == 4_000_000
            && p["urgent_wall_s"].as_f64().is_some_and(|s| s > 0.0)
            && ["preemption_latency_s", "background_yield_s"]
                .iter()
                .all(|k| p[k].is_null() || p[k].as_f64().is_some_and(|l| l >= 0.0))
            && v["stderr"]
                .as_str()
                .is_some_and(|e| e.contains("waiting until all 2 source agents hold parts")),
        || format!("pre-emption summary: {v}"),
    );
}

/// `ferry demo ARGS --rtt 20ms --json`, which must succeed: its summary
/// (the last line of its output), with its stderr added as `stderr`.
async fn demo_json(w: &World, args: &[&str]) -> Value {
    let mut all = vec!["demo"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--rtt", "20ms", "--json"]);
    let out = w.ferry(&all, &[], TRANSFER).await;
    w.ensure(out.success(), || format!("ferry {}: {out}", all.join(" ")));
    let last = out.stdout.lines().last().unwrap_or_default();
    let mut v: Value = serde_json::from_str(last).unwrap_or_else(|e| w.fail(format!("{e}: {out}")));
    v["stderr"] = Value::from(out.stderr.clone());
    v
}

/// The sink site's catalog is cut off from both sink agents for 10 s while
/// the first receives (as if its PostgreSQL stopped): nothing is published
/// meanwhile, and the first stops on SIGTERM though its records wait.
/// Once the catalog is back the transfer finishes through the second,
/// byte-identical; the catalog recorded the publish and every chunk's
/// arrival (none verified in the outage is lost), so both sink agents
/// resolve the replica.
#[tokio::test]
async fn a_sink_site_whose_catalog_stops_for_10_s_records_everything_after_it() {
    let w = World::new("sink-pool-pg-stop").await;
    let cut = Cut::start(pg_addr().await).await;
    let ckpt = w.source_root().join("step_000300");
    w.gen(&ckpt, "24MB").await;
    let mut pool = sink_pool_via(&w, "pg_stop", None, "24Mbit/s", &[], Some(&cut)).await;
    let id = w.push_no_wait(&pool.source, &ckpt).await;
    holds_part(&w, &pool.sinks[0]).await;
    cut.down();
    // The whole checkpoint reaches the sink within the outage, but none
    // of it past the cut is confirmed: the transfer cannot finish.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let t = w.transfer(&pool.source, id).await;
    w.ensure(s(&t, "state") != "published", || {
        format!("published while the sink's catalog was gone: {t}")
    });
    let log = pool.sinks[0].stderr();
    w.ensure(
        log.contains("no batch is confirmed to the sources meanwhile"),
        || format!("the sink should say it confirms nothing without its catalog:\n{log}"),
    );
    // A sink agent stopped with records waiting stops, the catalog gone
    // or not; what it had not recorded goes to the other sink agent.
    // (Waited for here without blocking the test's runtime, which runs
    // the catalog's forwarder.)
    let pid = pool.sinks[0].pid().unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let first = &mut pool.sinks[0];
    w.wait_until(
        "the first sink agent to stop on SIGTERM while its catalog is gone",
        Duration::from_secs(30),
        async || {
            first
                .exited()
                .map(|_| ())
                .ok_or_else(|| "running".to_string())
        },
    )
    .await;
    cut.up();
    wait_published(&w, &pool.source, id).await;
    w.assert_same_tree(&ckpt, &w.replica_path("step_000300"));
    let mut c = sqlx::PgConnection::connect(&pool.db).await.unwrap();
    let row = sqlx::query(
        "SELECT state, bytes_total, arrivals FROM replicas WHERE local_path LIKE '%/step_000300'",
    )
    .fetch_one(&mut c)
    .await
    .unwrap();
    c.close().await.unwrap();
    let (state, total): (String, i64) = (row.get("state"), row.get("bytes_total"));
    let arrivals: Value = serde_json::from_str(&row.get::<String, _>("arrivals")).unwrap();
    let recorded: u64 = arrivals["bins"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|b| b[1].as_u64())
        .sum();
    // (Each chunk's bytes are spread over the bins its arrival spans,
    // rounded: a few bytes off, far less than a chunk.)
    let chunk = u64::from(ferry_proto::manifest::MIN_CHUNK_SIZE);
    w.ensure(state == "published" && recorded.abs_diff(total as u64) < chunk, || {
        format!("the catalog should record the publish and every chunk's arrival: {state}, {recorded} of {total} bytes: {arrivals}")
    });
    w.restart(&mut pool.sinks[0]).await;
    for sink in &pool.sinks {
        let r = w.resolve(sink, &ckpt).await;
        w.ensure(s(&r, "state") == "local", || {
            format!("{}: resolve {r}", sink.label)
        });
    }
    let db = pool.db.clone();
    drop(pool);
    drop_db(&db).await;
}

/// Two source agents on one PostgreSQL catalog and two sink agents on
/// another, each sink agent behind its own relay at `rate`; each source
/// link names both sink agents, in another order on each source agent.
/// Parts of 8 MiB, at most 2 held per agent.
struct Striped {
    source_db: String,
    sink_db: String,
    sources: [Agent; 2],
    sinks: [Agent; 2],
    relays: [Relay; 2],
}

async fn striped_pool(w: &World, name: &str, rate: &str, source_env: &[(&str, &str)]) -> Striped {
    striped_pool_with(w, name, rate, source_env, StripedOn::default()).await
}

/// Where a striped pool's sink agents write and how its source agents
/// reach their catalog.
#[derive(Default)]
struct StripedOn<'a> {
    /// The sink root on S3 or HDFS (none: a local directory).
    remote: Option<&'a RemoteSink>,
    /// The source agents' catalog through this cut (none: directly).
    source_cut: Option<&'a Cut>,
    /// Part size (none: 8 MiB).
    part_size: Option<&'a str>,
    /// Both source agents watch the source root (rescans every 0.5 s,
    /// 1 s quiet period); one of them holds its watch.
    watch: bool,
    /// The sink agents' `reserve` (none: the default).
    sink_reserve: Option<&'a str>,
    /// Environment of both sink agents.
    sink_env: &'a [(&'a str, &'a str)],
    /// More lines of the source agents' `[pool]` section.
    source_pool: &'a str,
}

async fn striped_pool_with(
    w: &World,
    name: &str,
    rate: &str,
    source_env: &[(&str, &str)],
    on: StripedOn<'_>,
) -> Striped {
    let sink_db = fresh_db(&format!("striped_sink_{name}")).await;
    let source_db = fresh_db(&format!("striped_source_{name}")).await;
    w.certs("certs", &[SOURCE_NAME, SOURCE_2, SINK_NAME, SINK_2])
        .await;
    let pool = "[pool]\nheartbeat_interval = \"1s\"\nlease_timeout = \"5s\"\n";
    let certs = w.root.join("certs");
    let mut first = w.sink_config();
    first.tail = format!("\n[catalog]\nurl = {}\n\n{pool}", toml_str(&sink_db));
    if let Some(r) = on.remote {
        let spec = first.sink.as_mut().unwrap();
        spec.root = PathBuf::from(&r.url);
        spec.extra = r.lines.clone();
    }
    if let Some(r) = on.sink_reserve {
        first.sink.as_mut().unwrap().reserve = Some(r.to_string());
    }
    let source_url = match on.source_cut {
        Some(c) => source_db.replacen(
            &pg_addr().await.to_string(),
            &format!("127.0.0.1:{}", c.port),
            1,
        ),
        None => source_db.clone(),
    };
    let part_size = on.part_size.unwrap_or("8MiB");
    let mut second = first.clone();
    second.name = SINK_2.into();
    second.cert = certs.join(format!("{SINK_2}.pem"));
    second.key = certs.join(format!("{SINK_2}.key"));
    second.data_dir = w.root.join("sink-2").join("data");
    second.api_port = free_tcp_port();
    second.quic_listen = format!("127.0.0.1:{}", free_udp_port());
    let s1 = w.start_agent("sink", first, on.sink_env).await;
    let s2 = w.start_agent("sink-2", second, on.sink_env).await;
    let r1 = w.start_relay(&s1.cfg.quic_listen, rate).await;
    let r2 = w.start_relay(&s2.cfg.quic_listen, rate).await;
    let (p1, p2) = (
        format!("127.0.0.1:{}", r1.port),
        format!("127.0.0.1:{}", r2.port),
    );
    let start = async |label: &str, agent: &str, peer: (&str, &str), more: (&str, &str)| {
        let mut cfg = w.source_config(peer.0, rate);
        cfg.name = agent.into();
        cfg.cert = certs.join(format!("{agent}.pem"));
        cfg.key = certs.join(format!("{agent}.key"));
        cfg.data_dir = w.root.join(label).join("data");
        cfg.links[0].peer_name = peer.1.into();
        cfg.links[0].more_peers = vec![(more.0.to_string(), more.1.to_string())];
        cfg.tail = format!(
            "\n[catalog]\nurl = {}\n\n{pool}part_size = \"{part_size}\"\nmax_parts = 2\n{}",
            toml_str(&source_url),
            on.source_pool
        );
        if let Some(s) = cfg.source.as_mut().filter(|_| on.watch) {
            s.scan_interval = "500ms".into();
            s.extra = "quiet_period = \"1s\"\n".into();
        }
        w.start_agent(label, cfg, source_env).await
    };
    let a = start("source", SOURCE_NAME, (&p1, SINK_NAME), (&p2, SINK_2)).await;
    let b = start("source-2", SOURCE_2, (&p2, SINK_2), (&p1, SINK_NAME)).await;
    Striped {
        source_db,
        sink_db,
        sources: [a, b],
        sinks: [s1, s2],
        relays: [r1, r2],
    }
}

impl Striped {
    /// Kills every agent and drops both databases.
    async fn finish(mut self) {
        for a in self.sinks.iter_mut().chain(self.sources.iter_mut()) {
            a.kill();
        }
        drop_db(&self.sink_db).await;
        drop_db(&self.source_db).await;
    }
}

/// Waits until both source agents hold parts (claims not ended).
async fn both_hold_parts(w: &World, pool: &Striped) {
    w.wait_until("both source agents to hold parts", TRANSFER, async || {
        let claims = part_claims(&pool.source_db).await;
        let holding = |a: &str| claims.iter().any(|c| c.2 == a && c.4.is_none());
        if holding(SOURCE_NAME) && holding(SOURCE_2) {
            Ok(())
        } else {
            Err(format!("{claims:?}"))
        }
    })
    .await;
}

/// The claims of a transfer's parts in the source catalog: (part, epoch,
/// agent, claimed_at, ended_at, end_reason), by part and epoch.
type PartClaimRow = (i64, i64, String, i64, Option<i64>, Option<String>);

async fn part_claims(db: &str) -> Vec<PartClaimRow> {
    let mut c = sqlx::PgConnection::connect(db).await.unwrap();
    let rows = sqlx::query(
        "SELECT part, epoch, agent, claimed_at, ended_at, end_reason FROM part_claims \
         ORDER BY part, epoch",
    )
    .fetch_all(&mut c)
    .await
    .unwrap();
    c.close().await.unwrap();
    rows.iter()
        .map(|r| {
            (
                r.get("part"),
                r.get("epoch"),
                r.get("agent"),
                r.get("claimed_at"),
                r.get("ended_at"),
                r.get("end_reason"),
            )
        })
        .collect()
}

/// Fails if two claims of one part overlap in time (database clock).
fn assert_claims_apart(w: &World, claims: &[PartClaimRow]) {
    for pair in claims.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        if a.0 != b.0 {
            continue;
        }
        w.ensure(a.4.is_some_and(|end| end <= b.3) && a.1 < b.1, || {
            format!("claims of part {} overlap: {a:?} then {b:?}", a.0)
        });
    }
}

/// Fails unless both source agents claimed parts, every claim was
/// released (its part verified), and no two claims of a part overlap.
fn assert_shared_and_released(w: &World, claims: &[PartClaimRow]) {
    for agent in [SOURCE_NAME, SOURCE_2] {
        w.ensure(claims.iter().any(|c| c.2 == agent), || {
            format!("{agent} should have claimed parts: {claims:?}")
        });
    }
    w.ensure(
        claims.iter().all(|c| c.5.as_deref() == Some("released")),
        || format!("every claim released once its part was verified: {claims:?}"),
    );
    assert_claims_apart(w, claims);
}

/// Payload bytes a sink agent received (its metrics).
async fn received(w: &World, sink: &Agent) -> f64 {
    counter_total(w, sink, "ferry_received_bytes_total").await
}

/// Payload bytes source agent `source` wrote to QUIC (its
/// `ferry_sent_bytes_total`, every link and class).
async fn sent(w: &World, source: &Agent) -> f64 {
    counter_total(w, source, "ferry_sent_bytes_total").await
}

/// The sum of counter `name` over its labels in `agent`'s metrics.
async fn counter_total(w: &World, agent: &Agent, name: &str) -> f64 {
    let m = w.metrics_text(agent).await;
    m.lines()
        .filter(|l| l.strip_prefix(name).is_some_and(|r| r.starts_with('{')))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// One checkpoint striped across two source and two sink agents: each
/// source agent claims parts, each sink agent receives some, the replica
/// is published once, byte-identical, resolvable from both sink agents,
/// and no two claims of a part overlap.
#[tokio::test]
async fn one_checkpoint_is_striped_across_two_source_and_two_sink_agents() {
    let w = World::new("striped").await;
    // At least 4 x 2 agents x max_parts 2 = 16 parts of 8 MiB.
    striped_over(&w, None, "two", "160MB", "8MiB").await;
}

/// As above, the sink agents writing to S3 (parts of 2 MiB, at least 16).
#[tokio::test]
async fn one_checkpoint_is_striped_across_two_sink_agents_on_s3() {
    let w = World::new("striped-s3").await;
    let r = s3_sink(&w, "striped-s3");
    striped_over(&w, Some(&r), "s3", "64MB", "2MiB").await;
}

/// As above, the sink agents writing to HDFS (parts of 2 MiB, at least
/// 16).
#[tokio::test]
async fn one_checkpoint_is_striped_across_two_sink_agents_on_hdfs() {
    let w = World::new("striped-hdfs").await;
    let r = hdfs_sink("striped-hdfs");
    striped_over(&w, Some(&r), "hdfs", "64MB", "2MiB").await;
}

/// The sink refuses a striped transfer's open (no room: a reserve larger
/// than any disk) while its coordinator's first parts' registrations are
/// already on the way (sent in the same round trip): the transfer fails
/// with the sink's reason, once, and the sink keeps the connection (it
/// ignores registrations of a refused open instead of closing it).
#[tokio::test]
async fn a_striped_transfer_refused_at_its_open_fails_with_the_sink_s_reason() {
    let w = World::new("striped-refused").await;
    let ckpt = w.source_root().join("step_000400");
    w.gen(&ckpt, "40MB").await;
    let on = StripedOn {
        sink_reserve: Some("1PiB"),
        ..Default::default()
    };
    let pool = striped_pool_with(&w, "refused", "400Mbit/s", &[], on).await;
    let id = w.push_no_wait(&pool.sources[0], &ckpt).await;
    let t = w
        .wait_until("the transfer to fail", TRANSFER, async || {
            let t = w.transfer(&pool.sources[0], id).await;
            match s(&t, "state") {
                "failed" => Ok(t),
                "published" => w.fail(format!("published despite the reserve: {t}")),
                _ => Err(format!("{t}")),
            }
        })
        .await;
    let why = t["error"].as_str().unwrap_or_default().to_string();
    w.ensure(why.contains("not enough space at the sink"), || {
        format!("the sink's reason should reach the transfer: {t}")
    });
    let sinks = pool.sinks[0].stderr() + &pool.sinks[1].stderr();
    w.ensure(!sinks.contains("never opened"), || {
        format!("a registration of the refused open closed the connection:\n{sinks}")
    });
    let log = pool.sources[0].stderr() + &pool.sources[1].stderr();
    w.ensure(log.contains("striped across the source pool"), || {
        format!("the transfer should have been striped:\n{log}")
    });
    pool.finish().await;
}

/// A source agent whose joining opens the sink refuses (fault injection:
/// both sink agents refuse every one) gives back each part it claimed at
/// once, rather than holding it (its heartbeats would renew the claim
/// for as long as it lives), and waits before it helps again; the
/// coordinator sends every part: published once, byte-identical.
#[tokio::test]
async fn a_source_agent_refused_at_its_join_gives_its_parts_back() {
    let w = World::new("striped-join-refused").await;
    let ckpt = w.source_root().join("step_000500");
    w.gen(&ckpt, "64MB").await;
    let on = StripedOn {
        sink_env: &[(replicator::sink::FAULT_REFUSE_JOINS_ENV, "1")],
        ..Default::default()
    };
    let pool = striped_pool_with(&w, "join_refused", "400Mbit/s", &[], on).await;
    let id = w.push_no_wait(&pool.sources[0], &ckpt).await;
    wait_published(&w, &pool.sources[0], id).await;
    assert_replica(&w, None, &ckpt, "step_000500");
    let claims = part_claims(&pool.source_db).await;
    let coordinator = &claims
        .iter()
        .find(|c| c.0 == 0 && c.1 == 1)
        .expect("part 0's first claim")
        .2;
    for c in &claims {
        let expected = if &c.2 == coordinator {
            "released"
        } else {
            "given back"
        };
        w.ensure(c.5.as_deref() == Some(expected), || {
            format!("each claim of the refused agent given back, each of the coordinator's released: {claims:?}")
        });
    }
    w.ensure(claims.iter().any(|c| &c.2 != coordinator), || {
        format!("the other agent should have claimed parts (and been refused): {claims:?}")
    });
    let (states, _) = catalog_view(&pool.sink_db, "step_000500").await;
    w.ensure(states == ["published"], || {
        format!("one replica row, published once: {states:?}")
    });
    let log = pool.sources[0].stderr() + &pool.sources[1].stderr();
    w.ensure(log.contains("helping it again in 2 s"), || {
        format!("the refused agent should say it waits before helping again:\n{log}")
    });
    pool.finish().await;
}

/// A checkpoint of `size` in parts of `part_size` (at least 16 of them)
/// striped over two source and two sink agents: each source agent claims
/// parts, each sink agent receives some, every claim released, none
/// overlapping; published once, byte-identical, resolvable from both
/// sink agents.
async fn striped_over(
    w: &World,
    remote: Option<&RemoteSink>,
    name: &str,
    size: &str,
    part_size: &str,
) {
    let ckpt = w.source_root().join("step_000300");
    w.gen(&ckpt, size).await;
    let on = StripedOn {
        remote,
        part_size: Some(part_size),
        ..Default::default()
    };
    let pool = striped_pool_with(w, name, "400Mbit/s", &[], on).await;
    let id = w.push_no_wait(&pool.sources[0], &ckpt).await;
    wait_published(w, &pool.sources[0], id).await;
    assert_replica(w, remote, &ckpt, "step_000300");
    let claims = part_claims(&pool.source_db).await;
    let parts: std::collections::BTreeSet<i64> = claims.iter().map(|c| c.0).collect();
    w.ensure(parts.len() >= 16, || {
        format!("at least 16 parts of {part_size}: {claims:?}")
    });
    assert_shared_and_released(w, &claims);
    for sink in &pool.sinks {
        let r = received(w, sink).await;
        w.ensure(r > 0.0, || {
            format!("{} should have received parts: {r} bytes", sink.cfg.name)
        });
    }
    let (states, leases) = catalog_view(&pool.sink_db, "step_000300").await;
    w.ensure(states == ["published"], || {
        format!("one replica row, published once: {states:?}")
    });
    w.ensure(leases.len() == 1 && leases[0].0.is_none(), || {
        format!("one publish, its lease released: {leases:?}")
    });
    let a = w.resolve(&pool.sinks[0], &ckpt).await;
    let b = w.resolve(&pool.sinks[1], &ckpt).await;
    w.ensure(
        s(&a, "state") == "local"
            && a["replica"] == b["replica"]
            && a["url"] == b["url"]
            && a["local_path"] == b["local_path"],
        || format!("resolve through each sink agent: {a} vs {b}"),
    );
    let log = pool.sources[0].stderr() + &pool.sources[1].stderr();
    w.ensure(log.contains("striped across the source pool"), || {
        format!("the coordinator should say the transfer is striped:\n{log}")
    });
    pool.finish().await;
}

/// A checkpoint the watcher streams while a training job writes it,
/// faster than one agent pair sends (striping while it is written
/// switched off): at its commit, the rest is striped across the pool
/// (the watching agent opens the transfer at the sink again and plans
/// parts of what it has not sent and confirmed); both source agents claim
/// parts, every claim released, none overlapping; published once,
/// byte-identical; the source agents sent each byte once (the parts hold
/// chunks the watching agent streamed while the rank files grew: read
/// again, not sent again).
#[tokio::test]
async fn a_watched_checkpoint_s_rest_is_striped_across_the_pool_at_its_commit() {
    let w = World::new("striped-watched").await;
    let root = w.source_root();
    std::fs::create_dir_all(&root).unwrap();
    let on = StripedOn {
        watch: true,
        source_pool: "stripe_while_writing = false\n",
        ..Default::default()
    };
    let pool = striped_pool_with(&w, "watched", "80Mbit/s", &[], on).await;
    // 96 MB written at 400 Mbit/s (about 2 s; the ranks append to their
    // files side by side) while each link carries 80 Mbit/s: most of it
    // is left at the commit, and some was streamed, spread over the rank
    // files (at least 4 x 2 agents x max_parts 2 = 16 parts of
    // 8 MiB would need 128 MiB; the point here is the hand-over, not the
    // part count).
    let mut gen = w.spawn_dcp_save(&root, "800", "96MB", "400Mbit/s");
    let status = gen.wait().await.unwrap();
    w.ensure(status.success(), || format!("ferry gen failed: {status}"));
    assert_striped_replica(&w, &pool, &root.join("step_00000800")).await;
    let log = pool.sources[0].stderr() + &pool.sources[1].stderr();
    w.ensure(
        log.contains("the rest is striped across the source pool"),
        || format!("the watching agent should say the rest is striped:\n{log}"),
    );
    pool.finish().await;
}

/// A checkpoint still being written: once its complete files add up to
/// more than a part per live source agent, they are striped across the
/// pool before the commit (both source agents send and release parts of
/// them while its commit marker does not exist yet), in a round of their
/// own for each batch of them (a later round's plan replaces the earlier
/// one's); the rest follows at the commit. Published once,
/// byte-identical, every claim released, none overlapping, each byte
/// sent once.
#[tokio::test]
async fn complete_files_of_a_checkpoint_still_being_written_are_striped_across_the_pool() {
    let w = World::new("striped-writing").await;
    // Copied in file by file: two of the save's data files (4 ranks of 24
    // MB, 3 parts each), then the other two once both source agents
    // released parts of the first, then its `.metadata` (the commit) once
    // a part of the second round's plan was released.
    let (pool, made, ckpt, names) = watched_pool_and_save(&w, "writing", "900").await;
    let data: Vec<&String> = names.iter().filter(|n| n.ends_with(".distcp")).collect();
    let copy = |n: &str| std::fs::copy(made.join(n), ckpt.join(n)).unwrap();
    for n in names
        .iter()
        .filter(|n| *n != ".metadata" && !data[2..].contains(n))
    {
        copy(n);
    }
    let first = both_released(&w, &pool, "of the first complete files").await;
    for n in &data[2..] {
        copy(n);
    }
    // The next round's plan: its first claims come under epochs above
    // every earlier claim's.
    let top = first.iter().map(|c| c.1).max().unwrap_or(0);
    w.wait_until(
        "a part of the next round's plan to be released",
        TRANSFER,
        async || {
            let claims = part_claims(&pool.source_db).await;
            if claims
                .iter()
                .any(|c| c.1 > top && c.5.as_deref() == Some("released"))
            {
                Ok(())
            } else {
                Err(format!("{claims:?}"))
            }
        },
    )
    .await;
    let path = ckpt.to_str().unwrap().to_string();
    let ts = w.transfers(&pool.sources[0]).await;
    w.ensure(
        ts.iter()
            .any(|t| s(t, "source_path") == path && s(t, "state") == "active"),
        || format!("the checkpoint's transfer should be active before its commit: {ts:?}"),
    );
    std::fs::copy(made.join(".metadata"), ckpt.join(".metadata")).unwrap();
    assert_striped_replica(&w, &pool, &ckpt).await;
    let log = pool.sources[0].stderr() + &pool.sources[1].stderr();
    let rounds = log
        .matches("what can no longer change (complete files, full chunks of files only appended to) is striped")
        .count();
    w.ensure(rounds >= 2, || {
        format!("the watching agent should say it stripes complete files twice:\n{log}")
    });
    pool.finish().await;
}

/// Files still being written that are only ever appended to (a DCP
/// save's ranks write theirs at once, and they complete together with
/// the commit): their full chunks below the current end are striped
/// across the pool while the files are still open for writing; the
/// watching agent keeps the tails and reads each file again once it is
/// complete. Published once, byte-identical, every claim released, none
/// overlapping, each byte sent once.
#[tokio::test]
async fn full_chunks_of_files_still_being_written_are_striped_across_the_pool() {
    use std::io::Write as _;
    let w = World::new("striped-growing").await;
    let (pool, made, ckpt, names) = watched_pool_and_save(&w, "growing", "950").await;
    // Each rank's file: its first half written, the file left open.
    let mut open = Vec::new();
    for n in names.iter().filter(|n| *n != ".metadata") {
        let bytes = std::fs::read(made.join(n)).unwrap();
        let mut f = std::fs::File::create(ckpt.join(n)).unwrap();
        let half = bytes.len() / 2;
        f.write_all(&bytes[..half]).unwrap();
        f.flush().unwrap();
        open.push((f, bytes, half));
    }
    both_released(&w, &pool, "while the files are open").await;
    for (mut f, bytes, half) in open {
        f.write_all(&bytes[half..]).unwrap();
    }
    std::fs::copy(made.join(".metadata"), ckpt.join(".metadata")).unwrap();
    assert_striped_replica(&w, &pool, &ckpt).await;
    pool.finish().await;
}

/// Two source agents watching the source root (see [`StripedOn::watch`])
/// and two sink agents on a local root, links of 80 Mbit/s, both source
/// agents live; and a 96 MB DCP save of step `step` made beside the root
/// (under `<world>/staging`, not watched) for a test to copy in piece by
/// piece. Returns the pool, the save's directory, the checkpoint's
/// directory under the source root (created, empty) and the save's file
/// names, sorted: 4 `.distcp` data files and `.metadata` (checked).
async fn watched_pool_and_save(
    w: &World,
    name: &str,
    step: &str,
) -> (Striped, PathBuf, PathBuf, Vec<String>) {
    let root = w.source_root();
    std::fs::create_dir_all(&root).unwrap();
    let on = StripedOn {
        watch: true,
        ..Default::default()
    };
    let pool = striped_pool_with(w, name, "80Mbit/s", &[], on).await;
    let staging = w.root.join("staging");
    let mut gen = w.spawn_dcp_save(&staging, step, "96MB", "8Gbit/s");
    let status = gen.wait().await.unwrap();
    w.ensure(status.success(), || format!("ferry gen failed: {status}"));
    let dir = format!("step_{step:0>8}");
    let (made, ckpt) = (staging.join(&dir), root.join(&dir));
    std::fs::create_dir_all(&ckpt).unwrap();
    let mut names: Vec<String> = std::fs::read_dir(&made)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let data = names.iter().filter(|n| n.ends_with(".distcp")).count();
    w.ensure(
        data == 4 && names.len() == 5 && names.iter().any(|n| n == ".metadata"),
        || format!("the DCP save should have 4 data files and .metadata: {names:?}"),
    );
    both_live(w, &pool).await;
    (pool, made, ckpt, names)
}

/// Waits until watched checkpoint `ckpt` (under the source root) is
/// published through `pool`, then checks it: the replica byte-identical,
/// every part claim released and none overlapping, one replica row
/// published once, each byte sent once ([`assert_sent_once`]).
async fn assert_striped_replica(w: &World, pool: &Striped, ckpt: &Path) {
    let path = ckpt.to_str().unwrap().to_string();
    let name = ckpt.file_name().unwrap().to_str().unwrap();
    published_at(w, &pool.sources[0], &path).await;
    w.assert_same_tree(ckpt, &w.replica_path(name));
    assert_shared_and_released(w, &part_claims(&pool.source_db).await);
    let (states, _) = catalog_view(&pool.sink_db, name).await;
    w.ensure(states == ["published"], || {
        format!("one replica row, published once: {states:?}")
    });
    assert_sent_once(w, pool, ckpt).await;
}

/// Checks that `pool`'s source agents sent, together, each byte of
/// checkpoint `ckpt` once: chunks one of them sent and the sink holds
/// are not sent again by a part that holds them.
async fn assert_sent_once(w: &World, pool: &Striped, ckpt: &Path) {
    let size = tree_bytes(ckpt);
    let got = sent(w, &pool.sources[0]).await + sent(w, &pool.sources[1]).await;
    if got as u64 != size {
        // Chunks the sinks asked for again are sent again by right.
        let mut asked = 0.0;
        for a in &pool.sources {
            asked += counter_total(w, a, "ferry_chunk_retries_total").await;
        }
        w.fail(format!(
            "the source agents should have sent each of the {size} bytes once: {got} bytes \
             ({asked} chunks asked for again)"
        ));
    }
}

/// Waits until the one transfer of source path `path` that `source`
/// lists is published; fails at once if it failed or was cancelled.
async fn published_at(w: &World, source: &Agent, path: &str) {
    w.wait_until("the checkpoint to publish", TRANSFER, async || {
        let ts = w.transfers(source).await;
        let mine: Vec<&Value> = ts.iter().filter(|t| s(t, "source_path") == path).collect();
        match mine.as_slice() {
            [t] if s(t, "state") == "published" => Ok(()),
            [t] if matches!(s(t, "state"), "failed" | "cancelled") => {
                w.fail(format!("the transfer ended: {t}"))
            }
            [t] => Err(format!("transfer {}", s(t, "state"))),
            more => Err(format!("{} transfers: {more:?}", more.len())),
        }
    })
    .await;
}

/// Waits until both source agents have released a part (`when` says at
/// what point of the test); returns the claims then.
async fn both_released(w: &World, pool: &Striped, when: &str) -> Vec<PartClaimRow> {
    w.wait_until(
        &format!("both source agents to release parts {when}"),
        TRANSFER,
        async || {
            let claims = part_claims(&pool.source_db).await;
            let released = |a: &str| {
                claims
                    .iter()
                    .any(|c| c.2 == a && c.5.as_deref() == Some("released"))
            };
            if released(SOURCE_NAME) && released(SOURCE_2) {
                Ok(claims)
            } else {
                Err(format!("{claims:?}"))
            }
        },
    )
    .await
}

/// Waits until source agent 0's `GET /v1/pool` lists both source agents
/// live, then two heartbeats more: striping while a checkpoint is written
/// needs a second live source agent, as each agent counts them at its
/// heartbeats (every second here).
async fn both_live(w: &World, pool: &Striped) {
    w.wait_until("both source agents to be live", TRANSFER, async || {
        let pool_now = w
            .get_json(&format!("{}/v1/pool", pool.sources[0].url()))
            .await;
        let live = |name: &str| {
            pool_now["agents"]
                .as_array()
                .is_some_and(|v| v.iter().any(|x| x["name"] == name && x["state"] == "live"))
        };
        if live(SOURCE_NAME) && live(SOURCE_2) {
            Ok(())
        } else {
            Err(format!("{pool_now}"))
        }
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
}

/// The source site's PostgreSQL gone for 10 s while both source agents
/// hold parts: they stop sending the parts before their leases could
/// lapse, nothing is published meanwhile; once it is back the lapsed
/// parts are claimed again under later epochs and the replica is
/// published once, byte-identical, no two claims of a part overlapping.
#[tokio::test]
async fn a_striped_transfer_survives_the_source_site_s_catalog_stopped_for_10_s() {
    let w = World::new("striped-pg-stop").await;
    let cut = Cut::start(pg_addr().await).await;
    let ckpt = w.source_root().join("step_000600");
    // 8 parts; each agent's two take about 7 s at its half of 40 Mbit/s,
    // longer than a lease: both are still sending when their leases run out.
    w.gen(&ckpt, "64MB").await;
    let on = StripedOn {
        source_cut: Some(&cut),
        ..Default::default()
    };
    let pool = striped_pool_with(&w, "pg_stop", "40Mbit/s", &[], on).await;
    let id = w.push_no_wait(&pool.sources[0], &ckpt).await;
    both_hold_parts(&w, &pool).await;
    cut.down();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let (states, _) = catalog_view(&pool.sink_db, "step_000600").await;
    w.ensure(!states.iter().any(|s| s == "published"), || {
        format!("published while the source site's catalog was gone: {states:?}")
    });
    // Each stopped on a part's lease (or, the coordinator, on the
    // transfer's, which ends its parts' sending with it).
    let stopped_sending = |a: &Agent| {
        let log = a.stderr();
        log.contains("may no longer hold the part's lease")
            || log.contains("may no longer hold the transfer's lease")
    };
    w.ensure(pool.sources.iter().all(stopped_sending), || {
        let log = pool.sources[0].stderr() + &pool.sources[1].stderr();
        format!("each source agent should stop sending its parts before its leases lapse:\n{log}")
    });
    cut.up();
    wait_published(&w, &pool.sources[0], id).await;
    assert_replica(&w, None, &ckpt, "step_000600");
    let claims = part_claims(&pool.source_db).await;
    let ended_at_cut: Vec<&PartClaimRow> = claims
        .iter()
        .filter(|c| matches!(c.5.as_deref(), Some("lapsed" | "given back")))
        .collect();
    w.ensure(!ended_at_cut.is_empty(), || {
        format!("the parts held at the cut should have lapsed: {claims:?}")
    });
    w.ensure(
        ended_at_cut.iter().all(|l| {
            claims
                .iter()
                .any(|c| c.0 == l.0 && c.1 > l.1 && c.5.as_deref() == Some("released"))
        }),
        || format!("each part held at the cut released later under a later epoch: {claims:?}"),
    );
    assert_claims_apart(&w, &claims);
    let (states, _) = catalog_view(&pool.sink_db, "step_000600").await;
    w.ensure(states == ["published"], || {
        format!("one replica row, published once: {states:?}")
    });
    pool.finish().await;
}

/// Whether process `pid` is stopped (SIGSTOP): its state in
/// `/proc/<pid>/stat` is `T`.
fn stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| rest.starts_with('T')))
        .unwrap_or(false)
}

/// A source agent stops itself (the fault-injection pause point) right
/// after the sink recorded the epoch of the first part it claimed; the
/// other takes the part over once its lease lapsed and registers the
/// next epoch at the sink; continued, the stopped agent sends the part
/// without checking its own lease: every sink agent refuses those late
/// chunks. The replica is published once, byte-identical; the part's
/// claims do not overlap.
#[tokio::test]
async fn a_paused_source_agent_s_late_chunks_are_refused_after_its_part_was_taken_over() {
    let w = World::new("striped-pause").await;
    let ckpt = w.source_root().join("step_000400");
    w.gen(&ckpt, "160MB").await;
    // Only the agent that does not coordinate the transfer pauses.
    let env = [("FERRY_FAULT_PAUSE_AFTER_PART", "1")];
    let pool = striped_pool(&w, "pause", "200Mbit/s", &env).await;
    let id = w.push_no_wait(&pool.sources[0], &ckpt).await;
    let paused = w
        .wait_until(
            "a source agent to stop itself after registering a part",
            TRANSFER,
            async || {
                pool.sources
                    .iter()
                    .position(|a| a.pid().is_some_and(stopped))
                    .ok_or_else(|| "none stopped yet".to_string())
            },
        )
        .await;
    let name = pool.sources[paused].cfg.name.clone();
    // The part it holds is claimed again by the other agent and that
    // epoch recorded at the sink.
    let taken = w
        .wait_until(
            "the paused agent's part to be taken over and registered at the sink",
            TRANSFER,
            async || {
                let claims = part_claims(&pool.source_db).await;
                let mut c = sqlx::PgConnection::connect(&pool.sink_db).await.unwrap();
                let epochs: Vec<(i64, i64)> =
                    sqlx::query_as("SELECT part, epoch FROM part_epochs WHERE epoch >= 2")
                        .fetch_all(&mut c)
                        .await
                        .unwrap();
                c.close().await.unwrap();
                claims
                    .iter()
                    .find(|cl| cl.2 == name && cl.1 == 1 && epochs.iter().any(|e| e.0 == cl.0))
                    .map(|cl| cl.0)
                    .ok_or_else(|| format!("claims {claims:?}, epochs at the sink {epochs:?}"))
            },
        )
        .await;
    // The taker's link is cut until the late chunks were refused: the
    // replica cannot be published (and the paused agent's run ended)
    // before they reach the sink.
    let taker_link = &pool.relays[1 - paused];
    taker_link.signal(nix::sys::signal::Signal::SIGUSR1);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pool.sources[paused].pid().unwrap() as i32),
        nix::sys::signal::Signal::SIGCONT,
    )
    .unwrap();
    // Its late chunks reached a sink agent and were refused there.
    let mut refused = 0.0;
    w.wait_until("the late chunks to be refused", TRANSFER, async || {
        refused = 0.0;
        for sink in &pool.sinks {
            let m = w.metrics_text(sink).await;
            refused += m
                .lines()
                .filter(|l| l.starts_with("ferry_part_chunks_refused_total"))
                .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
                .sum::<f64>();
        }
        if refused > 0.0 {
            Ok(())
        } else {
            Err("no chunk refused yet".to_string())
        }
    })
    .await;
    taker_link.signal(nix::sys::signal::Signal::SIGUSR2);
    wait_published(&w, &pool.sources[1 - paused], id).await;
    assert_replica(&w, None, &ckpt, "step_000400");
    let claims = part_claims(&pool.source_db).await;
    let of_part: Vec<&PartClaimRow> = claims.iter().filter(|c| c.0 == taken).collect();
    w.ensure(
        of_part.len() == 2
            && of_part[0].2 == name
            && of_part[0].5.as_deref() == Some("lapsed")
            && of_part[1].5.as_deref() == Some("released"),
        || {
            format!(
                "part {taken}: claimed by {name}, lapsed, then released by the other: {of_part:?}"
            )
        },
    );
    assert_claims_apart(&w, &claims);
    let (states, _) = catalog_view(&pool.sink_db, "step_000400").await;
    w.ensure(states == ["published"], || {
        format!("one replica row, published once: {states:?}")
    });
    pool.finish().await;
}

/// One source agent and one sink agent SIGKILLed while both source
/// agents hold parts: the survivors take the killed agent's parts (and,
/// if it coordinated, the transfer) over; published once, byte-identical,
/// no two claims of a part overlapping.
#[tokio::test]
async fn a_striped_transfer_survives_a_source_and_a_sink_agent_killed_mid_transfer() {
    let w = World::new("striped-kill").await;
    let ckpt = w.source_root().join("step_000500");
    w.gen(&ckpt, "160MB").await;
    let mut pool = striped_pool(&w, "kill", "100Mbit/s", &[]).await;
    let id = w.push_no_wait(&pool.sources[0], &ckpt).await;
    both_hold_parts(&w, &pool).await;
    pool.sources[0].kill();
    pool.sinks[0].kill();
    wait_published(&w, &pool.sources[1], id).await;
    assert_replica(&w, None, &ckpt, "step_000500");
    let claims = part_claims(&pool.source_db).await;
    w.ensure(
        claims
            .iter()
            .any(|c| c.2 == SOURCE_NAME && c.5.as_deref() == Some("lapsed")),
        || format!("the killed agent's parts should have lapsed: {claims:?}"),
    );
    w.ensure(
        claims
            .iter()
            .filter(|c| c.5.as_deref() == Some("lapsed"))
            .all(|l| {
                claims
                    .iter()
                    .any(|c| c.0 == l.0 && c.1 > l.1 && c.5.as_deref() == Some("released"))
            }),
        || format!("every lapsed part was taken over and released: {claims:?}"),
    );
    assert_claims_apart(&w, &claims);
    let (states, _) = catalog_view(&pool.sink_db, "step_000500").await;
    w.ensure(states == ["published"], || {
        format!("one replica row, published once: {states:?}")
    });
    let res = w.resolve(&pool.sinks[1], &ckpt).await;
    w.ensure(s(&res, "state") == "local", || format!("resolve {res}"));
    pool.finish().await;
}

/// The claims of every transfer's parts: (transfer, part, agent,
/// claimed_at), by claim time.
async fn all_claims(db: &str) -> Vec<(i64, i64, String, i64)> {
    let mut c = sqlx::PgConnection::connect(db).await.unwrap();
    let rows = sqlx::query(
        "SELECT transfer, part, agent, claimed_at FROM part_claims ORDER BY claimed_at, transfer, part",
    )
    .fetch_all(&mut c)
    .await
    .unwrap();
    c.close().await.unwrap();
    rows.iter()
        .map(|r| {
            (
                r.get("transfer"),
                r.get("part"),
                r.get("agent"),
                r.get("claimed_at"),
            )
        })
        .collect()
}

/// A background checkpoint striped across two source agents, then a
/// second (scheduled) one; a signal makes the second urgent while both
/// agents hold parts of the first. From the moment the catalog's claim
/// order shows it urgent, each agent's next claim is one of its parts.
#[tokio::test]
async fn after_a_signal_every_source_agent_claims_the_urgent_transfer_s_parts_first() {
    let w = World::new("striped-signal").await;
    let (old, new) = (
        w.source_root().join("step_000600"),
        w.source_root().join("step_000700"),
    );
    w.gen(&old, "160MB").await;
    w.gen(&new, "160MB").await;
    let pool = striped_pool(&w, "signal", "100Mbit/s", &[]).await;
    let bg = ["--no-wait", "--class", "background"];
    let out = w.push(&pool.sources[0], &old, &bg).await;
    w.ensure(out.success(), || format!("ferry push: {out}"));
    both_hold_parts(&w, &pool).await;
    // Background transfers are never promoted: the second is scheduled.
    let out = w.push(&pool.sources[1], &new, &["--no-wait"]).await;
    w.ensure(out.success(), || format!("ferry push: {out}"));
    let newer: i64 = out
        .stdout
        .split_whitespace()
        .skip_while(|w| *w != "transfer")
        .nth(1)
        .and_then(|id| id.parse().ok())
        .unwrap_or_else(|| w.fail(format!("no transfer id: {out}")));
    let plans = async || {
        let mut c = sqlx::PgConnection::connect(&pool.source_db).await.unwrap();
        let v: Option<(i64, i64)> = sqlx::query_as(
            "SELECT class_rank, CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT) \
             FROM transfer_plans WHERE transfer = $1",
        )
        .bind(newer)
        .fetch_optional(&mut c)
        .await
        .unwrap();
        c.close().await.unwrap();
        v
    };
    w.wait_until(
        "the second checkpoint to be planned",
        TRANSFER,
        async || {
            plans()
                .await
                .map(|_| ())
                .ok_or_else(|| "no plan yet".to_string())
        },
    )
    .await;
    let signal = format!("{}/v1/signals", pool.sources[0].url());
    let r = w
        .http()
        .post(&signal)
        .json(&serde_json::json!({ "job": JOB, "kind": "loss_spike", "severity": 0.9 }))
        .send()
        .await
        .unwrap();
    w.ensure(r.status().as_u16() == 201, || {
        format!("POST /v1/signals: {}", r.status())
    });
    // The moment the claim order shows it urgent (database clock).
    let urgent_at = w
        .wait_until(
            "the claim order to show the signal",
            TRANSFER,
            async || match plans().await {
                Some((2, at)) => Ok(at),
                v => Err(format!("{v:?}")),
            },
        )
        .await;
    let older = w.transfers(&pool.sources[0]).await;
    let ids: Vec<i64> = older.iter().filter_map(|t| t["id"].as_i64()).collect();
    for id in &ids {
        wait_published(&w, &pool.sources[0], *id).await;
    }
    assert_replica(&w, None, &old, "step_000600");
    assert_replica(&w, None, &new, "step_000700");
    let claims = all_claims(&pool.source_db).await;
    for agent in [SOURCE_NAME, SOURCE_2] {
        let next = claims.iter().find(|c| c.2 == agent && c.3 > urgent_at);
        w.ensure(next.is_some_and(|c| c.0 == newer), || {
            format!(
                "{agent}'s first claim after the claim order showed transfer {newer} urgent (at {urgent_at}) should be one of its parts: {next:?}\n{claims:?}"
            )
        });
    }
    pool.finish().await;
}

/// A file of a part already sent is rewritten (same size, other bytes)
/// while both source agents hold other parts: the seal sees its version
/// change, its part is claimed and sent again, and the replica matches
/// the file as it is now.
#[tokio::test]
async fn a_file_rewritten_while_its_transfer_is_striped_is_sent_again_at_the_seal() {
    let w = World::new("striped-rewrite").await;
    rewritten_while_striped(&w, "rewrite", false).await;
}

/// As above, but the file grows: the seal drops the plan, the next run
/// lists the checkpoint and plans it again (its claims under later
/// epochs than any before), and the replica matches the file as it is
/// now.
#[tokio::test]
async fn a_file_that_grows_while_its_transfer_is_striped_is_planned_again() {
    let w = World::new("striped-grow").await;
    rewritten_while_striped(&w, "grow", true).await;
}

/// The plan's first file (in part 0) changed once part 0 is done and
/// both source agents hold parts: each byte changed (same size), or with
/// `grow`, 1 MB appended.
async fn rewritten_while_striped(w: &World, name: &str, grow: bool) {
    let ckpt = w.source_root().join("step_000800");
    w.gen(&ckpt, "160MB").await;
    let pool = striped_pool(w, name, "100Mbit/s", &[]).await;
    let id = w.push_no_wait(&pool.sources[0], &ckpt).await;
    // The plan's first file, in part 0, once part 0 is done and both
    // agents hold parts.
    let first: String = w
        .wait_until(
            "part 0 to be done while both agents hold parts",
            TRANSFER,
            async || {
                let mut c = sqlx::PgConnection::connect(&pool.source_db).await.unwrap();
                let plan: Option<(Vec<u8>,)> =
                    sqlx::query_as("SELECT files FROM transfer_plans WHERE transfer = $1")
                        .bind(id)
                        .fetch_optional(&mut c)
                        .await
                        .unwrap();
                let done: Option<(String,)> = sqlx::query_as(
                    "SELECT state FROM transfer_parts WHERE transfer = $1 AND part = 0",
                )
                .bind(id)
                .fetch_optional(&mut c)
                .await
                .unwrap();
                c.close().await.unwrap();
                let claims = part_claims(&pool.source_db).await;
                let holding = |a: &str| claims.iter().any(|c| c.2 == a && c.4.is_none());
                match (plan, done) {
                    (Some((files,)), Some((state,)))
                        if state == "done" && holding(SOURCE_NAME) && holding(SOURCE_2) =>
                    {
                        let v: Value = serde_json::from_slice(&files).unwrap();
                        Ok(v["files"][0][0].as_str().unwrap().to_string())
                    }
                    other => Err(format!("{other:?} {claims:?}")),
                }
            },
        )
        .await;
    let path = ckpt.join(&first);
    let mut bytes = std::fs::read(&path).unwrap();
    w.ensure(!bytes.is_empty(), || format!("{first} is empty"));
    if grow {
        bytes.extend(std::iter::repeat_n(7u8, 1_000_000));
    } else {
        for b in bytes.iter_mut() {
            *b = b.wrapping_add(1);
        }
    }
    std::fs::write(&path, &bytes).unwrap();
    wait_published(w, &pool.sources[0], id).await;
    assert_replica(w, None, &ckpt, "step_000800");
    let log = pool.sources[0].stderr() + &pool.sources[1].stderr();
    let said = if grow {
        "changed size while it was sent"
    } else {
        "files changed while their parts were read"
    };
    w.ensure(log.contains(said), || {
        format!("the coordinator should say \"{said}\":\n{log}")
    });
    let claims = part_claims(&pool.source_db).await;
    w.ensure(
        claims
            .iter()
            .filter(|c| c.0 == 0 && c.5.as_deref() == Some("released"))
            .count()
            >= 2,
        || format!("part 0 released twice (sent again): {claims:?}"),
    );
    assert_claims_apart(w, &claims);
    pool.finish().await;
}
