//! The deployment files under `ops/` against the code they deploy: the
//! example pool configs load with the agent's own config loader and form
//! one source pool and one sink pool; the systemd unit runs `ferry serve`
//! with flags that exist and waits out the agent's drain; every alert has
//! its annotations and a runbook section; and every `ferry_*` metric the
//! alert rules and the dashboard name is exposed by a running source and
//! sink agent. (`ops/check-deploy` runs promtool, systemd-analyze and the
//! JSON parse.)

#![allow(clippy::unwrap_used)]

#[allow(dead_code)]
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::pg::*;
use common::*;
use ferry::config::{Config, Role};

/// The repository root (the `ferry` crate's manifest directory).
fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    let p = repo().join(rel);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The value of the first `KEY=` line of the systemd unit.
fn unit_value<'a>(unit: &'a str, key: &str) -> &'a str {
    unit.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
        .unwrap_or_else(|| panic!("ferry@.service has no {key}= line"))
        .trim()
}

/// Every `ferry_...` name in `text`.
fn ferry_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("ferry_") {
        let name: String = rest[i..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[i + name.len()..];
        out.insert(name);
    }
    out
}

/// The example configs, by file stem, in name order.
fn pool_examples() -> BTreeMap<String, PathBuf> {
    let dir = repo().join("ops/examples/pool");
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "toml") {
            out.insert(p.file_stem().unwrap().to_str().unwrap().to_string(), p);
        }
    }
    out
}

/// `ops/examples/pool/*.toml` load with `ferry serve`'s loader (all keys
/// known, all checks passed) and describe one site of two source agents
/// and one of two sink agents, each on its own PostgreSQL catalog, with
/// the settings a pool shares kept identical and each agent's data dir
/// the unit's state directory. Needs the `[pool]` table in
/// `ferry::config` (heartbeat_interval, lease_timeout).
#[test]
fn pool_example_configs_load_as_a_source_pool_and_a_sink_pool() {
    let unit = read("ops/systemd/ferry@.service");
    let state_dir = unit_value(&unit, "StateDirectory");
    let examples = pool_examples();
    let mut sources = Vec::new();
    let mut sinks = Vec::new();
    let mut pool_tables = BTreeSet::new();
    for (stem, path) in &examples {
        let cfg = Config::load(path)
            .unwrap_or_else(|e| panic!("{} does not load: {e:#}", path.display()));
        assert_eq!(
            cfg.agent.name,
            *stem,
            "{}: agent.name must be the file's name (the unit's instance)",
            path.display()
        );
        let data_dir = Path::new("/var/lib").join(state_dir.replace("%i", stem));
        assert_eq!(
            cfg.agent.data_dir,
            data_dir,
            "{}: agent.data_dir must be the unit's StateDirectory",
            path.display()
        );
        assert!(
            cfg.catalog.url.is_some(),
            "{}: a pool agent needs [catalog] url",
            path.display()
        );
        assert!(
            cfg.api
                .tokens
                .iter()
                .any(|t| t.name == "prometheus" && t.role == "reader"),
            "{}: the reader token Prometheus scrapes with (ops/RUNBOOK.md) is missing",
            path.display()
        );
        // The [pool] table, read as plain TOML so that this test compiles
        // whatever shape the config struct gives it.
        let doc: toml::Table = toml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let pool = doc
            .get("pool")
            .and_then(|p| p.as_table())
            .unwrap_or_else(|| panic!("{}: no [pool] table", path.display()));
        let duration = |key: &str| {
            let v = pool.get(key).and_then(|v| v.as_str()).unwrap_or_else(|| {
                panic!("{}: pool.{key} missing or not a string", path.display())
            });
            humantime::parse_duration(v)
                .unwrap_or_else(|e| panic!("{}: pool.{key} {v:?}: {e}", path.display()))
        };
        let (heartbeat, lease) = (duration("heartbeat_interval"), duration("lease_timeout"));
        assert!(
            heartbeat * 3 <= lease,
            "{}: a lease must outlive several heartbeats, got heartbeat_interval {heartbeat:?} and lease_timeout {lease:?}",
            path.display()
        );
        pool_tables.insert((heartbeat, lease));
        match cfg.agent.role {
            Role::Source => sources.push(cfg),
            Role::Sink => sinks.push(cfg),
            Role::Both => panic!("{}: the example pools have no role both", path.display()),
        }
    }
    assert_eq!(
        (sources.len(), sinks.len()),
        (2, 2),
        "two source and two sink agents expected in {examples:?}"
    );
    assert_eq!(
        pool_tables.len(),
        1,
        "every agent should have the same [pool] values: {pool_tables:?}"
    );

    for group in [&sources, &sinks] {
        let first = &group[0];
        for c in &group[1..] {
            assert_eq!(c.agent.site, first.agent.site, "one site per pool");
            assert_eq!(c.catalog.url, first.catalog.url, "one catalog per site");
        }
    }
    assert_ne!(sources[0].agent.site, sinks[0].agent.site);
    assert_ne!(
        sources[0].catalog.url, sinks[0].catalog.url,
        "one database per site: the two sites need two catalogs"
    );

    // Shared settings (links, jobs, scheduler) and the roots every source
    // agent reads: identical in both files.
    let links = |c: &Config| {
        c.links
            .iter()
            .map(|l| {
                // Each source agent lists the sink agents in its own
                // order (to spread over them): the set is shared.
                let mut sinks: Vec<(String, String)> =
                    std::iter::once((l.peer.clone(), l.peer_name.clone()))
                        .chain(
                            l.more_peers
                                .iter()
                                .map(|p| (p.peer.clone(), p.peer_name.clone())),
                        )
                        .collect();
                sinks.sort();
                (l.name.clone(), sinks, l.rate, l.rtt_hint)
            })
            .collect::<Vec<_>>()
    };
    let jobs = |c: &Config| {
        c.jobs
            .iter()
            .map(|j| (j.name.clone(), j.model_params, j.importance))
            .collect::<Vec<_>>()
    };
    let roots = |c: &Config| {
        c.source
            .as_ref()
            .unwrap()
            .roots
            .iter()
            .map(|r| (r.path.clone(), r.job.clone(), r.link.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(links(&sources[0]), links(&sources[1]), "[[links]] differ");
    assert_eq!(jobs(&sources[0]), jobs(&sources[1]), "[[jobs]] differ");
    assert_eq!(
        roots(&sources[0]),
        roots(&sources[1]),
        "source roots differ"
    );
    assert_eq!(
        format!("{:?}", sources[0].scheduler),
        format!("{:?}", sources[1].scheduler),
        "[scheduler] differs"
    );

    // Every source agent may watch the roots (one at a time, under a
    // lease): the watcher settings are identical too.
    let watch = |c: &Config| {
        let s = c.source.as_ref().unwrap();
        (
            s.scan_interval,
            s.roots
                .iter()
                .map(|r| format!("{:?}", r.watch(0).unwrap()))
                .collect::<Vec<_>>(),
        )
    };
    assert_eq!(
        watch(&sources[0]),
        watch(&sources[1]),
        "the source agents' watcher settings differ"
    );
    assert!(
        !sources[0].source.as_ref().unwrap().scan_interval.is_zero(),
        "the source agents should watch their roots"
    );

    let sink_names: BTreeSet<&str> = sinks.iter().map(|c| c.agent.name.as_str()).collect();
    let linked: BTreeSet<&str> = sources[0]
        .links
        .iter()
        .flat_map(|l| {
            std::iter::once(l.peer_name.as_str())
                .chain(l.more_peers.iter().map(|p| p.peer_name.as_str()))
        })
        .collect();
    assert_eq!(linked, sink_names, "every sink agent on a link");
    let firsts: BTreeSet<&str> = sources
        .iter()
        .map(|c| c.links[0].peer_name.as_str())
        .collect();
    assert_eq!(
        firsts.len(),
        sources.len(),
        "each source agent dials another sink agent first"
    );
    for r in roots(&sources[0]) {
        assert!(r.0.is_absolute(), "{r:?}");
    }
    for s in &sinks {
        let sink = s.sink.as_ref().unwrap();
        assert_eq!(
            sink.root,
            sinks[0].sink.as_ref().unwrap().root,
            "the sink agents share one sink root"
        );
        for src in &sources {
            assert!(
                sink.accept_peers.is_empty() || sink.accept_peers.contains(&src.agent.name),
                "{} does not accept {}",
                s.agent.name,
                src.agent.name
            );
        }
    }
}

/// `ferry@.service` starts `ferry serve --config /etc/ferry/%i.toml`
/// (flags `ferry serve --help` lists) and gives the agent longer than
/// the drain `ferry serve --help` promises before SIGKILL.
#[test]
fn systemd_unit_runs_serve_with_its_flags_and_waits_out_the_drain() {
    let unit = read("ops/systemd/ferry@.service");
    let exec: Vec<&str> = unit_value(&unit, "ExecStart").split_whitespace().collect();
    assert_eq!(
        exec[1..],
        ["serve", "--config", "/etc/ferry/%i.toml"],
        "ExecStart"
    );
    let out = Command::new(FERRY)
        .args(["serve", "--help"])
        .output()
        .unwrap();
    assert!(out.status.success(), "ferry serve --help: {out:?}");
    let help = String::from_utf8(out.stdout).unwrap();
    assert!(
        help.contains("--config <CONFIG>"),
        "ferry serve --help lists no --config:\n{help}"
    );
    // "... exits within 10 s." (possibly wrapped).
    let words: Vec<&str> = help.split_whitespace().collect();
    let drain_s: u64 = words
        .windows(4)
        .find(|w| w[0] == "exits" && w[1] == "within" && w[3].starts_with('s'))
        .and_then(|w| w[2].parse().ok())
        .unwrap_or_else(|| panic!("ferry serve --help names no drain time:\n{help}"));
    let stop = humantime::parse_duration(unit_value(&unit, "TimeoutStopSec")).unwrap();
    assert!(
        stop > Duration::from_secs(drain_s),
        "TimeoutStopSec {stop:?} must exceed the agent's {drain_s} s drain"
    );
    assert!(
        unit_value(&unit, "Restart") == "on-failure",
        "Restart=on-failure expected"
    );
}

/// Every alert has a summary, a description and a runbook_url pointing at
/// a section of ops/RUNBOOK.md (GitHub's heading anchors).
#[test]
fn every_alert_has_annotations_and_a_runbook_section() {
    let rules = read("ops/prometheus/ferry-alerts.yml");
    let runbook = read("ops/RUNBOOK.md");
    let anchors: BTreeSet<String> = runbook
        .lines()
        .filter(|l| l.starts_with('#'))
        .map(|l| {
            l.trim_start_matches('#')
                .trim()
                .to_lowercase()
                .chars()
                .filter(|c| c.is_alphanumeric() || *c == '-' || *c == '_' || *c == ' ')
                .map(|c| if c == ' ' { '-' } else { c })
                .collect()
        })
        .collect();
    // Split the file at each rule; the text before the first is the header.
    let alerts: Vec<&str> = rules.split("- alert: ").skip(1).collect();
    assert!(alerts.len() >= 5, "{} alerts", alerts.len());
    for a in alerts {
        let name = a.lines().next().unwrap().trim();
        for key in ["summary:", "description:", "runbook_url:"] {
            assert!(a.contains(key), "alert {name} has no {key}");
        }
        let url = a
            .lines()
            .find_map(|l| l.trim().strip_prefix("runbook_url:"))
            .unwrap()
            .trim()
            .trim_matches('"');
        let anchor = url
            .strip_prefix("ops/RUNBOOK.md#")
            .unwrap_or_else(|| panic!("alert {name}: runbook_url {url} is not ops/RUNBOOK.md#..."));
        assert_eq!(
            anchor,
            name.to_lowercase(),
            "alert {name}: runbook_url {url}"
        );
        assert!(
            anchors.contains(anchor),
            "alert {name}: ops/RUNBOOK.md has no heading for #{anchor}"
        );
    }
}

/// What an agent's `/metrics` exposes: sample names and, per family
/// (`# TYPE` line), its type.
#[derive(Default)]
struct Exposed {
    samples: BTreeSet<String>,
    families: BTreeMap<String, String>,
}

impl Exposed {
    fn add(&mut self, text: &str) {
        for line in text.lines() {
            if let Some(t) = line.strip_prefix("# TYPE ") {
                let mut it = t.split_whitespace();
                if let (Some(name), Some(kind)) = (it.next(), it.next()) {
                    self.families.insert(name.to_string(), kind.to_string());
                }
            } else if !line.starts_with('#') && !line.trim().is_empty() {
                let name = line
                    .split(|c: char| c == '{' || c.is_whitespace())
                    .next()
                    .unwrap();
                self.samples.insert(name.to_string());
            }
        }
    }

    /// `name` is a sample or family name, a counter's `_total`, or a
    /// histogram's `_bucket`, `_sum` or `_count`.
    fn has(&self, name: &str) -> bool {
        if self.samples.contains(name) || self.families.contains_key(name) {
            return true;
        }
        if let Some(base) = name.strip_suffix("_total") {
            if self.families.get(base).is_some_and(|k| k == "counter") {
                return true;
            }
        }
        ["_bucket", "_sum", "_count"].iter().any(|suffix| {
            name.strip_suffix(suffix)
                .is_some_and(|base| self.families.get(base).is_some_and(|k| k == "histogram"))
        })
    }
}

/// Every `ferry_*` metric that `ops/prometheus/ferry-alerts.yml` and
/// `ops/grafana/ferry-dashboard.json` use is exposed by a running source
/// or sink agent (a rule on a metric that does not exist never fires).
/// The agents are deployed as the pool examples are, each site's catalog
/// in PostgreSQL. One checkpoint is replicated first: a family labelled by
/// something only traffic creates (the sink's bytes by peer) has no
/// series before.
#[tokio::test]
async fn every_metric_the_alerts_and_dashboard_use_exists_on_running_agents() {
    let (src_db, sink_db) = (
        fresh_db("deploy_source").await,
        fresh_db("deploy_sink").await,
    );
    let w = World::new("deploy-metrics").await;
    let ckpt = w.source_root().join("step_000100");
    w.gen(&ckpt, "1MB").await;
    let catalog = |url: &str| format!("\n[catalog]\nurl = {}\n", toml_str(url));
    let c = w
        .start_cluster("200Mbit/s", &[], |sink, src| {
            sink.tail = catalog(&sink_db);
            src.tail = catalog(&src_db);
        })
        .await;
    let out = w.push(&c.source, &ckpt, &[]).await;
    w.ensure(out.success(), || format!("ferry push failed: {out}"));
    w.assert_same_tree(&ckpt, &w.replica_path("step_000100"));
    // The watch gauges have series once a source agent of a pool watches
    // a root: the same agent again, its watcher on.
    let mut c = c;
    if let Some(s) = c.source.cfg.source.as_mut() {
        s.scan_interval = "500ms".into();
    }
    std::fs::write(&c.source.config_path, c.source.cfg.to_toml()).unwrap();
    w.restart(&mut c.source).await;
    w.wait_until(
        "the source root's watch gauge",
        Duration::from_secs(60),
        async || {
            let m = w.metrics_text(&c.source).await;
            if m.contains("ferry_root_watched{") {
                Ok(())
            } else {
                Err("no ferry_root_watched series yet".into())
            }
        },
    )
    .await;
    let mut exposed = Exposed::default();
    exposed.add(&w.metrics_text(&c.source).await);
    exposed.add(&w.metrics_text(&c.sink).await);
    w.ensure(!exposed.families.is_empty(), || {
        "the agents' /metrics declare no family".to_string()
    });
    let mut missing = Vec::new();
    for file in [
        "ops/prometheus/ferry-alerts.yml",
        "ops/grafana/ferry-dashboard.json",
    ] {
        let names = ferry_names(&read(file));
        w.ensure(!names.is_empty(), || {
            format!("{file} names no ferry_ metric")
        });
        for n in names {
            if !exposed.has(&n) {
                missing.push(format!("{n} ({file})"));
            }
        }
    }
    w.ensure(missing.is_empty(), || {
        format!(
            "metrics used but exposed by neither agent: {missing:?}; exposed families: {:?}",
            exposed.families.keys().collect::<Vec<_>>()
        )
    });
    drop(c);
    for db in [src_db, sink_db] {
        let name = db.rsplit_once('/').unwrap().1;
        pg_admin(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await;
    }
}
