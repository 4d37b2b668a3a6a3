//! `ferry replay`: a recorded trace or a generated preset through the
//! scheduler crate's replay ([`scheduler::replay`]) under one or more
//! policies, side by side, with an optional SVG chart.
//!
//! stdout is deterministic (same trace, seed and policies: same bytes);
//! the wall-clock speed goes to stderr.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use scheduler::replay::{self, preset, ClassSummary, Options, Report};
use scheduler::trace::{Trace, What};
use scheduler::{Class, Policy, PolicyKind};
use serde_json::{json, Value};

use crate::config::SchedulerSection;
use crate::outln;

/// Arguments of `ferry replay`.
#[derive(Debug, clap::Args)]
#[command(after_long_help = "\
Trace format (version 1, JSON lines; ARCHITECTURE.md \"Policy replay\"):
  first line  {\"ferry_trace\": 1, \"links\": [{\"link\", \"rate_bps\", \"rtt_ms\"}], \"jobs\": [{\"job\", \"model_params\"?, \"importance\"}]}
  then events {\"at_ms\": <Unix ms>, \"event\": KIND, ...}, in time order, KIND one of
    arrival    id, link, bytes, class, job, importance?, deadline_ms?
    class      id, class            (an operator's change)
    importance id, importance|null
    job        job, model_params?, importance
    pause | resume | cancel   id
    rate       link, rate_bps
    signal     job, severity, kind?
  An agent exports its own traffic in this format: `ferry trace --since 24h -o day.jsonl`
  (GET /v1/trace, operator role).

Presets (--preset):
  seed-208       a day at the scale of the ByteDance Seed paper (OSDI 2026): 60 Gbit/s,
                 100 ms; 19 training jobs (1.3B to 162B parameters, 16 bytes per parameter
                 per checkpoint: 2.6 TB for the largest) checkpointing every 1,000 steps
                 (1 to 2 h); 208 background transfers (the paper's concurrent jobs)
                 queued in the first minute and 320 an hour after (logs 1-10 GB, datasets
                 10-100 GB, migrations 100 GB-1 TB), the link 92 % busy on average with
                 the checkpoints; a loss-spike signal after 4.3 % of
                 checkpoints (the paper's 156 serious regressions in 3,589 evals).
                 --seed varies it, --hours sets its length. Simulated in 64 MiB chunks.
  demo-priority  `ferry demo --priority` with its defaults: 1 Gbit/s, 100 ms; four
                 400 MB background copies, then at 3 s a 300 MB checkpoint and a
                 loss-spike signal for its job.

What the replay models: each link's admission (max_active per class, small transfers
up to max_small_active besides, or max_active in all under fifo), class floors, shares by score, aging, signal severity and promotion to urgent
(urgent_for), the rate cap (token bucket), operators' class and importance changes,
pauses, resumes, cancels and rate changes, and half an RTT from the last chunk to the
publish; the link is a wire of the rate cap (alone, a transfer is ready bytes x 8 / rate
+ RTT / 2 after it starts). It uses the agents' own scheduler code (LinkScheduler, Policy,
score).
What it does not model: CPU, disk and storage limits; packet loss and congestion
control (the link always delivers its rate cap); the extra round trips of a resumed or
re-saved transfer; checkpoints still being written (all bytes are there at arrival);
the sink's verification and publish time; a pool of agents.

A transfer counts as urgent if it was urgent at any time (its class, an operator, or a
signal's promotion under that policy), so a class can hold different transfers under
different policies: the 'transfers' row shows each count. 'over alone' is its time to
ready over its time alone on the link under the same policy.

Examples:
  ferry replay --preset seed-208
  ferry replay --preset demo-priority --policy fifo --policy priority
  ferry replay day.jsonl --policy priority --policy tuned.toml --svg day.svg")]
pub struct ReplayArgs {
    /// Trace file (JSON lines; `-` reads stdin). Instead of --preset.
    #[arg(conflicts_with = "preset")]
    pub trace: Option<PathBuf>,
    /// A generated workload instead of a trace: seed-208 or demo-priority
    /// (see below).
    #[arg(long, value_parser = preset::NAMES)]
    pub preset: Option<String>,
    /// A policy to replay under, repeatable, shown side by side in the
    /// order given: `fifo`, `priority` (the defaults) or a TOML file with
    /// a `[scheduler]` section as in an agent's config (or a whole agent
    /// config). Default: fifo and priority.
    #[arg(long = "policy", value_name = "fifo|priority|FILE.toml")]
    pub policies: Vec<String>,
    /// Seed of --preset seed-208 (default 1).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Hours of arrivals of --preset seed-208, more than 0 and at most 744
    /// (default 24; the replay runs on until the last transfer is ready).
    #[arg(long)]
    pub hours: Option<f64>,
    /// Simulated chunk length (the scheduling quantum), 64KiB to 1GiB;
    /// default the trace's own (`chunk_bytes` in its header: 64 MiB for
    /// seed-208), else 4 MiB (the agents' chunk_size).
    #[arg(long, value_parser = parse_chunk)]
    pub chunk: Option<u64>,
    /// Also write a chart (time-to-ready distribution per class, one line
    /// per policy) to this SVG file.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// Also write the replayed trace (e.g. a preset, to edit) to this file.
    #[arg(long, value_name = "FILE")]
    pub write_trace: Option<PathBuf>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// Smallest and largest `--chunk`, bytes.
const CHUNK_RANGE: std::ops::RangeInclusive<u64> = (64 << 10)..=(1 << 30);

/// At most this many scheduler decisions per policy (bytes / chunk); a
/// larger replay asks for a larger `--chunk`.
const MAX_DECISIONS: u64 = 200_000_000;

fn parse_chunk(s: &str) -> Result<u64, String> {
    let v = ferry_proto::units::parse_size(s)?;
    if CHUNK_RANGE.contains(&v) {
        Ok(v)
    } else {
        Err(format!("must be from 64KiB to 1GiB, got {v} bytes"))
    }
}

/// A policy to replay under and the name it is shown with.
#[derive(Debug, Clone, PartialEq)]
pub struct NamedPolicy {
    /// `fifo`, `priority` or the file's name.
    pub name: String,
    /// The settings.
    pub policy: Policy,
}

/// Reads `fifo`, `priority` or a TOML file (see [`ReplayArgs::policies`]).
///
/// # Errors
/// The file cannot be read, is not TOML, has an unknown key (named by
/// toml with its line) or a bad setting (named by [`Policy::check`]).
pub fn parse_policy(arg: &str) -> Result<NamedPolicy> {
    let named = |name: &str, kind| NamedPolicy {
        name: name.into(),
        policy: Policy {
            kind,
            ..Policy::default()
        },
    };
    match arg {
        "fifo" => return Ok(named("fifo", PolicyKind::Fifo)),
        "priority" => return Ok(named("priority", PolicyKind::Priority)),
        _ => {}
    }
    let path = Path::new(arg);
    let text = std::fs::read_to_string(path).with_context(|| {
        format!("policy {arg:?}: not fifo or priority, and not a readable file")
    })?;
    let table: toml::Table = toml::from_str(&text).with_context(|| format!("policy file {arg}"))?;
    let Some(section) = table.get("scheduler") else {
        bail!(
            "policy file {arg}: it has no [scheduler] section (keys found: {})",
            table.keys().cloned().collect::<Vec<_>>().join(", ")
        );
    };
    let others: Vec<&String> = table.keys().filter(|k| *k != "scheduler").collect();
    if !others.is_empty() {
        eprintln!(
            "note: policy file {arg}: only its [scheduler] section is used ({} ignored)",
            others
                .iter()
                .map(|k| k.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let section: SchedulerSection = section
        .clone()
        .try_into()
        .with_context(|| format!("policy file {arg}, [scheduler]"))?;
    let policy = section
        .policy()
        .with_context(|| format!("policy file {arg}"))?;
    let name = path
        .file_name()
        .map_or_else(|| arg.to_string(), |n| n.to_string_lossy().into_owned());
    Ok(NamedPolicy { name, policy })
}

/// One policy's replay.
struct Run {
    name: String,
    report: Report,
    classes: Vec<ClassSummary>,
}

/// Runs `ferry replay`.
///
/// # Errors
/// A bad trace (the line named), policy or output file.
pub fn run(a: &ReplayArgs) -> Result<()> {
    // Everything given is checked before anything is written or run.
    let mut policies = Vec::new();
    for p in &a.policies {
        policies.push(parse_policy(p)?);
    }
    if policies.is_empty() {
        policies = vec![parse_policy("fifo")?, parse_policy("priority")?];
    }
    // Two files of one name are shown by their paths.
    let names: Vec<String> = policies.iter().map(|p| p.name.clone()).collect();
    for (i, p) in policies.iter_mut().enumerate() {
        if names.iter().filter(|n| **n == p.name).count() > 1 {
            if let Some(arg) = a.policies.get(i) {
                p.name = arg.clone();
            }
        }
    }
    for (flag, path) in [("--svg", &a.svg), ("--write-trace", &a.write_trace)] {
        let Some(path) = path else { continue };
        if path.is_dir() {
            bail!(
                "{flag}: {} is a directory; give a file name",
                path.display()
            );
        }
        if let Some(parent) = path.parent() {
            if !parent.as_os_str().is_empty() && !parent.is_dir() {
                bail!("{flag}: directory {} does not exist", parent.display());
            }
        }
    }
    let (trace, what) = load(a)?;
    if trace.arrivals() == 0 {
        bail!("{what}: no transfer arrives in it, nothing to replay");
    }
    let chunk = a
        .chunk
        .or(trace.header.chunk_bytes)
        .unwrap_or(4 << 20)
        .max(1);
    let total: u64 = trace
        .events
        .iter()
        .filter_map(|e| match e.what {
            What::Arrival { bytes, .. } => Some(bytes),
            _ => None,
        })
        .sum();
    if total / chunk > MAX_DECISIONS {
        bail!(
            "{what}: {total} bytes in {} chunks would take {} scheduler decisions per policy (at most {MAX_DECISIONS}); give a larger --chunk, e.g. --chunk {}MiB",
            size(chunk),
            total / chunk,
            ((total / MAX_DECISIONS) >> 20) + 1
        );
    }
    if let Some(p) = &a.write_trace {
        std::fs::write(p, trace.to_json_lines())
            .with_context(|| format!("writing the trace to {}", p.display()))?;
    }
    let opts = Options { chunk_bytes: chunk };
    let t0 = Instant::now();
    let mut runs = Vec::new();
    let mut simulated_h = 0.0;
    for p in &policies {
        let report = replay::run(&trace, &p.policy, &opts);
        simulated_h += report.simulated_s() / 3600.0;
        let classes = replay::summarize(&trace, &p.policy, &opts, &report);
        runs.push(Run {
            name: p.name.clone(),
            report,
            classes,
        });
    }
    let wall = t0.elapsed().as_secs_f64();
    if a.json {
        outln!("{}", to_json(&what, &trace, chunk, &runs))?;
    } else {
        outln!("{}", table(&what, &trace, chunk, &runs).trim_end())?;
    }
    if let Some(p) = &a.svg {
        chart(&runs, p, &what).with_context(|| format!("writing the chart {}", p.display()))?;
    }
    eprintln!(
        "replayed {} in {wall:.2} s: {:.1} simulated hours per wall second",
        plural(runs.len(), "policy", "policies"),
        simulated_h / wall.max(1e-6)
    );
    Ok(())
}

/// The trace and a one-line description of where it came from.
fn load(a: &ReplayArgs) -> Result<(Trace, String)> {
    if let Some(name) = &a.preset {
        let seed_208 = name == "seed-208";
        if !seed_208 && (a.seed.is_some() || a.hours.is_some()) {
            bail!("--seed and --hours are for --preset seed-208 only");
        }
        let (seed, hours) = (a.seed.unwrap_or(1), a.hours.unwrap_or(24.0));
        if !(hours.is_finite() && hours > 0.0 && hours <= 24.0 * 31.0) {
            bail!("--hours must be more than 0 and at most 744 (31 days), got {hours}");
        }
        let t = preset::by_name(name, seed, hours).ok_or_else(|| {
            anyhow!(
                "unknown preset {name:?} (expected {})",
                preset::NAMES.join(", ")
            )
        })?;
        let what = if seed_208 {
            format!("preset seed-208 (seed {seed}, {hours} h of arrivals)")
        } else {
            format!("preset {name}")
        };
        return Ok((t, what));
    }
    if a.seed.is_some() || a.hours.is_some() {
        bail!("--seed and --hours are for --preset seed-208 only");
    }
    let Some(path) = a.trace.as_ref() else {
        bail!(
            "give a trace file (JSON lines, `-` for stdin; `ferry trace` exports one) or --preset {}",
            preset::NAMES.join("|")
        );
    };
    let (text, what) = if path.as_os_str() == "-" {
        (
            std::io::read_to_string(std::io::stdin()).context("reading the trace from stdin")?,
            "the trace on stdin".to_string(),
        )
    } else {
        (
            std::fs::read_to_string(path)
                .with_context(|| format!("reading the trace {}", path.display()))?,
            format!("trace {}", path.display()),
        )
    };
    let t = Trace::parse(&text).with_context(|| what.clone())?;
    Ok((t, what))
}

/// "1 transfer", "2 transfers".
fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

fn counts(trace: &Trace) -> (usize, usize) {
    let signals = trace
        .events
        .iter()
        .filter(|e| matches!(e.what, What::Signal { .. }))
        .count();
    (trace.arrivals(), signals)
}

fn links(trace: &Trace) -> String {
    trace
        .header
        .links
        .iter()
        .map(|l| {
            format!(
                "{} {} {} ms",
                l.link,
                ferry_proto::units::format_rate(l.rate_bps),
                l.rtt_ms
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// 4194304 -> "4 MiB", 1073741824 -> "1 GiB".
fn size(b: u64) -> String {
    if b >= 1 << 30 && b % (1 << 30) == 0 {
        format!("{} GiB", b >> 30)
    } else if b >= 1 << 20 && b % (1 << 20) == 0 {
        format!("{} MiB", b >> 20)
    } else if b >= 1 << 10 && b % (1 << 10) == 0 {
        format!("{} KiB", b >> 10)
    } else {
        format!("{b} B")
    }
}

fn secs(s: f64) -> String {
    if s >= 100.0 {
        format!("{s:.0}")
    } else if s >= 10.0 {
        format!("{s:.1}")
    } else {
        format!("{s:.2}")
    }
}

const CLASSES: [Class; 3] = [Class::Urgent, Class::Scheduled, Class::Background];

fn of(r: &Run, c: Class) -> Option<&ClassSummary> {
    r.classes.iter().find(|s| s.class == c)
}

/// The side-by-side table.
fn table(what: &str, trace: &Trace, chunk: u64, runs: &[Run]) -> String {
    let (arrivals, signals) = counts(trace);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "replay of {what}: {}, {}; {} {}; {} chunks",
        plural(arrivals, "transfer", "transfers"),
        plural(signals, "signal", "signals"),
        if trace.header.links.len() == 1 {
            "link"
        } else {
            "links"
        },
        links(trace),
        size(chunk)
    );
    let w = runs.iter().map(|r| r.name.len()).max().unwrap_or(0).max(10);
    let row = |s: &mut String, label: &str, cells: Vec<String>| {
        let _ = write!(s, "{label:<34}");
        for c in cells {
            let _ = write!(s, " {c:>w$}");
        }
        s.push('\n');
    };
    row(
        &mut s,
        "policy",
        runs.iter().map(|r| r.name.clone()).collect(),
    );
    row(
        &mut s,
        "simulated",
        runs.iter()
            .map(|r| {
                let s = r.report.simulated_s();
                if s >= 3600.0 {
                    format!("{:.2} h", s / 3600.0)
                } else {
                    format!("{} s", secs(s))
                }
            })
            .collect(),
    );
    row(
        &mut s,
        "mean transfers in system",
        runs.iter()
            .map(|r| format!("{:.1}", r.report.mean_in_system))
            .collect(),
    );
    for c in CLASSES {
        if !runs.iter().any(|r| of(r, c).is_some()) {
            continue;
        }
        let _ = writeln!(s, "{c}, time to ready in s");
        row(
            &mut s,
            "  transfers",
            runs.iter()
                .map(|r| of(r, c).map_or(0, |x| x.arrived).to_string())
                .collect(),
        );
        for (i, p) in ["p50", "p90", "p99", "max"].iter().enumerate() {
            row(
                &mut s,
                &format!("  {p}"),
                runs.iter()
                    .map(|r| {
                        of(r, c)
                            .and_then(|x| x.time_to_ready_s)
                            .map_or("-".into(), |v| secs(v[i]))
                    })
                    .collect(),
            );
        }
        if c == Class::Urgent {
            for (i, p) in ["p50", "max"].iter().enumerate() {
                row(
                    &mut s,
                    &format!("  over alone, {p}"),
                    runs.iter()
                        .map(|r| {
                            of(r, c)
                                .and_then(|x| x.over_alone)
                                .map_or("-".into(), |v| format!("{:.2} x", v[i]))
                        })
                        .collect(),
                );
            }
        }
        if runs
            .iter()
            .any(|r| of(r, c).is_some_and(|x| x.deadlines.is_some()))
        {
            row(
                &mut s,
                "  deadlines met",
                runs.iter()
                    .map(|r| {
                        of(r, c)
                            .and_then(|x| x.deadlines)
                            .map_or("-".into(), |(m, n)| format!("{m}/{n}"))
                    })
                    .collect(),
            );
        }
        let unready: Vec<String> = runs
            .iter()
            .map(|r| of(r, c).map_or(0, |x| x.arrived - x.ready).to_string())
            .collect();
        if unready.iter().any(|u| u != "0") {
            row(&mut s, "  not ready (cancelled, paused)", unready);
        }
    }
    if runs.len() > 1 {
        let base = &runs[0];
        let p50 = |r: &Run, c| of(r, c).and_then(|x| x.time_to_ready_s).map(|v| v[0]);
        for c in [Class::Urgent, Class::Scheduled] {
            if let Some(b) = p50(base, c) {
                row(
                    &mut s,
                    &format!("{c} p50, {} over this", base.name),
                    runs.iter()
                        .map(|r| {
                            p50(r, c).map_or("-".into(), |v| format!("{:.2} x", b / v.max(1e-3)))
                        })
                        .collect(),
                );
            }
        }
    }
    s
}

fn to_json(what: &str, trace: &Trace, chunk: u64, runs: &[Run]) -> Value {
    let (arrivals, signals) = counts(trace);
    let policies: Vec<Value> = runs
        .iter()
        .map(|r| {
            let classes: Vec<Value> = r
                .classes
                .iter()
                .map(|c| {
                    json!({
                        "class": c.class,
                        "transfers": c.arrived,
                        "ready": c.ready,
                        "time_to_ready_s": c.time_to_ready_s.map(|v| json!({
                            "p50": v[0], "p90": v[1], "p99": v[2], "max": v[3],
                        })),
                        "over_alone": c.over_alone.map(|v| json!({"p50": v[0], "max": v[1]})),
                        "deadlines": c.deadlines.map(|(m, n)| json!({"met": m, "given": n})),
                    })
                })
                .collect();
            json!({
                "policy": r.name,
                "simulated_s": r.report.simulated_s(),
                "mean_in_system": r.report.mean_in_system,
                "chunks": r.report.chunks,
                "bytes_sent": r.report.bytes_sent,
                "classes": classes,
            })
        })
        .collect();
    json!({
        "source": what,
        "transfers": arrivals,
        "signals": signals,
        "chunk_bytes": chunk,
        "policies": policies,
    })
}

/// Time-to-ready distributions (one panel per class, log time axis, one
/// line per policy).
fn chart(runs: &[Run], path: &Path, what: &str) -> Result<()> {
    use plotters::prelude::*;
    let e = |e: DrawingAreaErrorKind<_>| anyhow!("{e}");
    let classes: Vec<Class> = CLASSES
        .into_iter()
        .filter(|c| runs.iter().any(|r| of(r, *c).is_some()))
        .collect();
    let height = 60 + 260 * classes.len().max(1) as u32;
    let root = SVGBackend::new(path, (760, height)).into_drawing_area();
    root.fill(&WHITE).map_err(e)?;
    let root = root
        .titled(&format!("Time to ready, {what}"), ("sans-serif", 18))
        .map_err(e)?;
    let panels = root.split_evenly((classes.len().max(1), 1));
    let palette = [RED, BLUE, GREEN, MAGENTA, CYAN, BLACK];
    for (panel, class) in panels.iter().zip(&classes) {
        let mut lines = Vec::new();
        let mut lo = f64::MAX;
        let mut hi = 0.0f64;
        for r in runs {
            let mut t: Vec<f64> = r
                .report
                .outcomes
                .iter()
                .filter(|o| o.group == *class)
                .filter_map(|o| o.time_to_ready_ms())
                .map(|ms| (ms as f64 / 1000.0).max(0.001))
                .collect();
            t.sort_by(f64::total_cmp);
            if let (Some(a), Some(b)) = (t.first(), t.last()) {
                lo = lo.min(*a);
                hi = hi.max(*b);
            }
            // The empirical distribution as a step function from 0.
            let n = t.len() as f64;
            let mut pts = Vec::with_capacity(2 * t.len());
            for (i, v) in t.iter().enumerate() {
                pts.push((*v, i as f64 / n));
                pts.push((*v, (i + 1) as f64 / n));
            }
            lines.push((r.name.clone(), pts));
        }
        if hi <= 0.0 {
            continue;
        }
        let (lo, hi) = (lo * 0.8, hi * 1.25);
        let mut ch = ChartBuilder::on(panel)
            .caption(format!("{class}"), ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(50)
            .build_cartesian_2d((lo..hi).log_scale(), 0.0..1.0)
            .map_err(e)?;
        ch.configure_mesh()
            .x_label_formatter(&|v| secs(*v))
            .x_desc("time to ready (s, log scale)")
            .y_desc("fraction ready")
            .draw()
            .map_err(e)?;
        for (i, (name, pts)) in lines.into_iter().enumerate() {
            let color = palette[i % palette.len()];
            // A few transfers: a dot at each, so one alone still shows.
            if pts.len() <= 40 {
                ch.draw_series(
                    pts.iter()
                        .skip(1)
                        .step_by(2)
                        .map(|p| Circle::new(*p, 3, color.filled())),
                )
                .map_err(e)?;
            }
            ch.draw_series(LineSeries::new(pts, color.stroke_width(2)))
                .map_err(e)?
                .label(name)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
        }
        ch.configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::LowerRight)
            .draw()
            .map_err(e)?;
    }
    root.present().map_err(e)?;
    Ok(())
}
