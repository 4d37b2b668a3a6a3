//! `ferry demo --priority`: the scheduler under load (ARCHITECTURE.md,
//! "Measures"). Three runs over the same emulated link, each on fresh
//! agents:
//!
//! 1. **solo**: a checkpoint pushed alone; its wall time (request to
//!    publish) is the reference.
//! 2. **priority**: background copies fill the link; the checkpoint is
//!    queued and a loss-spike signal for its job follows at once. Its wall
//!    time over the solo time, and the pre-emption latency: from the
//!    signal's acceptance to the end of the first 100 ms window in which
//!    its bytes arriving at the sink reach 80 % of the rate cap (the sink's
//!    catalog records when each chunk arrived).
//! 3. **fifo**: the same as 2 with `policy = "fifo"`.
//! 4. **deadlines** (`--deadline-runs N`, default 5): background copies
//!    fill the link; two urgent checkpoints are queued together with
//!    deadlines at 1.2 x and 2.0 x the solo time after they are queued.
//!    N runs with `deadline_first` (earliest deadline first while one is
//!    at risk) and N in score order; how often each deadline is met, and
//!    what the admission answer predicted.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ferry_catalog::Arrivals;
use ferry_proto::state::TransferState;
use replicator::sink::{Resolution, Sink};
use serde_json::{json, Value};

use super::{round3, start_pair, DemoArgs};
use crate::config::{RootSection, SchedulerSection};

/// Background copies that fill the link.
const BACKGROUND_COPIES: usize = 4;

/// Share of the rate cap urgent bytes must reach in one window for
/// pre-emption to count as done (ARCHITECTURE.md "Measures").
pub(super) const PREEMPTED_SHARE: f64 = 0.8;

/// Targets (ARCHITECTURE.md, "Measures"): urgent wall time over solo.
const MAX_OVER_SOLO: f64 = 1.1;
/// Targets: pre-emption latency in RTTs.
const MAX_LATENCY_RTT: f64 = 2.0;

/// How long the background load runs alone before the signal.
const LOAD_FIRST: Duration = Duration::from_secs(3);

/// Runs the three runs and returns their measures as JSON.
///
/// # Errors
/// Any step that fails, named.
pub(super) async fn run(a: &DemoArgs, dir: &Path, say: &dyn Fn(String)) -> Result<Value> {
    let train = dir.join("train").join("mm-demo");
    let data = dir.join("data");
    let ckpt = train.join("step_005000");
    say(format!(
        "priority: a {} checkpoint against {} background copies of {} each; pre-emption latency = signal to the end of the first 100 ms in which its bytes reach 80 % of the link at the sink",
        mb(a.urgent_size),
        BACKGROUND_COPIES,
        mb(a.background_size / BACKGROUND_COPIES as u64)
    ));
    let mut sets = Vec::new();
    for i in 0..BACKGROUND_COPIES {
        sets.push(data.join(format!("set-{i}")));
    }
    let warmup = data.join("warmup");
    let second = train.join("step_006000");
    {
        let mut jobs = vec![(ckpt.clone(), a.urgent_size), (warmup.clone(), 100_000)];
        if a.deadline_runs > 0 {
            jobs.push((second.clone(), a.urgent_size));
        }
        for s in &sets {
            jobs.push((s.clone(), a.background_size / BACKGROUND_COPIES as u64));
        }
        let d = dir.to_path_buf();
        tokio::task::spawn_blocking(move || -> Result<()> {
            for (out, size) in jobs {
                ferry_gen::generate(&ferry_gen::GenOptions::new(out, size), &|_| {})?;
            }
            // The sink makes each replica durable with a syncfs at publish:
            // flush the generated data now, or the first publish pays for it.
            let f = std::fs::File::open(&d)?;
            nix::unistd::syncfs(std::os::fd::AsRawFd::as_raw_fd(&f))?;
            Ok(())
        })
        .await??;
    }
    let ckpt = std::fs::canonicalize(&ckpt)?;
    let sets: Vec<PathBuf> = sets
        .iter()
        .map(std::fs::canonicalize)
        .collect::<std::io::Result<_>>()?;
    let roots = vec![
        RootSection::new(std::fs::canonicalize(&train)?, "mm-demo", "to-eval"),
        RootSection::new(std::fs::canonicalize(&data)?, "archive", "to-eval"),
    ];

    let solo = {
        let run_dir = dir.join("run-solo");
        let pair = start_pair(
            dir,
            &run_dir,
            a,
            roots.clone(),
            Duration::ZERO,
            Default::default(),
        )
        .await?;
        let api = pair.source.api_addr;
        let sink = pair.sink.sink.clone().context("sink role")?;
        // The other runs find the connection up (their load opened it):
        // so does this one, after a small copy.
        let warmup = std::fs::canonicalize(&warmup)?;
        post(api, "/v1/transfers", json!({ "path": warmup })).await?;
        wait_local(&sink, &warmup, Instant::now()).await?;
        let t0 = Instant::now();
        post(api, "/v1/transfers", json!({ "path": ckpt })).await?;
        let wall = wait_local(&sink, &ckpt, t0).await?;
        pair.source.stop(Duration::from_secs(5)).await;
        pair.sink.stop(Duration::from_secs(5)).await;
        remove_run(run_dir).await;
        say(format!("  solo      {wall:.2} s"));
        wall
    };

    let mut out = json!({
        "urgent_bytes": a.urgent_size,
        "background_bytes": a.background_size,
        "background_copies": BACKGROUND_COPIES,
        "solo_s": round3(solo),
    });
    for policy in ["priority", "fifo"] {
        let run_dir = dir.join(format!("run-{policy}"));
        let sched = SchedulerSection {
            policy: policy.into(),
            ..Default::default()
        };
        let pair = start_pair(dir, &run_dir, a, roots.clone(), Duration::ZERO, sched).await?;
        let api = pair.source.api_addr;
        let sink = pair.sink.sink.clone().context("sink role")?;
        let mut background = Vec::new();
        for s in &sets {
            let t = post(
                api,
                "/v1/transfers",
                json!({ "path": s, "class": "background" }),
            )
            .await?;
            background.push(t["id"].as_i64().context("transfer id")?);
        }
        tokio::time::sleep(LOAD_FIRST).await;
        let t0 = Instant::now();
        post(api, "/v1/transfers", json!({ "path": ckpt })).await?;
        let sig = post(
            api,
            "/v1/signals",
            json!({ "job": "mm-demo", "kind": "loss_spike", "severity": 0.9, "step": 5000 }),
        )
        .await?;
        let signal_ms = sig["signal"]["received_at"]
            .as_i64()
            .context("signal time")?;
        let wall = wait_local(&sink, &ckpt, t0).await?;
        let rows = sink
            .catalog()
            .replicas_for_source(&ckpt.to_string_lossy())
            .await?;
        let row = rows
            .iter()
            .find(|r| r.state == TransferState::Published)
            .context("the urgent replica has no catalog row")?;
        let arrivals = sink.catalog().chunk_arrivals(row.id).await?;
        let latency = preemption_latency_s(&arrivals, signal_ms, a.rate);
        // The load is not needed any more.
        for id in &background {
            let _ = post(api, &format!("/v1/transfers/{id}/cancel"), json!({})).await;
        }
        pair.source.stop(Duration::from_secs(5)).await;
        pair.sink.stop(Duration::from_secs(5)).await;
        remove_run(run_dir).await;
        let rtt = a.rtt.as_secs_f64();
        say(format!(
            "  {policy:<9} {wall:.2} s ({:.3} x solo); pre-emption latency {}",
            wall / solo,
            latency.map_or("not reached".into(), |l| format!(
                "{:.3} s ({:.2} RTT)",
                l,
                l / rtt
            ))
        ));
        out[policy] = json!({
            "wall_s": round3(wall),
            "over_solo": round3(wall / solo),
            "preemption_latency_s": latency.map(round3),
            "preemption_latency_rtt": latency.map(|l| round3(l / rtt)),
        });
    }
    if a.deadline_runs > 0 {
        let second = std::fs::canonicalize(&second)?;
        out["deadlines"] =
            deadline_runs(a, dir, &roots, &sets, [&ckpt, &second], solo, say).await?;
    }
    let p = &out["priority"];
    let ratio_ok = p["over_solo"].as_f64().is_some_and(|r| r <= MAX_OVER_SOLO);
    let latency_ok = p["preemption_latency_rtt"]
        .as_f64()
        .is_some_and(|l| l <= MAX_LATENCY_RTT);
    let verdict = |ok: bool| if ok { "met" } else { "missed" };
    say(format!(
        "  targets (priority run): urgent <= {MAX_OVER_SOLO} x solo {}; pre-emption latency <= {MAX_LATENCY_RTT} RTT {}",
        verdict(ratio_ok),
        verdict(latency_ok)
    ));
    out["targets"] = json!({
        "max_over_solo": MAX_OVER_SOLO,
        "over_solo_met": ratio_ok,
        "max_preemption_latency_rtt": MAX_LATENCY_RTT,
        "preemption_latency_met": latency_ok,
    });
    Ok(out)
}

/// Deadlines of the two urgent checkpoints, as multiples of the solo
/// time after they are queued.
const DEADLINE_FACTORS: [f64; 2] = [1.2, 2.0];

/// The deadline runs (see the module's documentation): per mode, how
/// often each deadline was met and the admission answers.
async fn deadline_runs(
    a: &DemoArgs,
    dir: &Path,
    roots: &[RootSection],
    sets: &[PathBuf],
    ckpts: [&Path; 2],
    solo: f64,
    say: &dyn Fn(String),
) -> Result<Value> {
    say(format!(
        "deadlines: two urgent {} checkpoints against the background copies, due {} x and {} x solo ({:.2} s, {:.2} s) after queued; {} runs each way",
        mb(a.urgent_size),
        DEADLINE_FACTORS[0],
        DEADLINE_FACTORS[1],
        DEADLINE_FACTORS[0] * solo,
        DEADLINE_FACTORS[1] * solo,
        a.deadline_runs
    ));
    let mut out = json!({ "factors": DEADLINE_FACTORS, "runs": a.deadline_runs });
    for (mode, edf) in [("deadline_first", true), ("score_order", false)] {
        let mut met = [0usize; 2];
        let mut feasible = [0usize; 2];
        let mut walls: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
        for run in 0..a.deadline_runs {
            let run_dir = dir.join(format!("run-{mode}-{run}"));
            let sched = SchedulerSection {
                deadline_first: edf,
                ..Default::default()
            };
            let pair = start_pair(dir, &run_dir, a, roots.to_vec(), Duration::ZERO, sched).await?;
            let api = pair.source.api_addr;
            let sink = pair.sink.sink.clone().context("sink role")?;
            let mut background = Vec::new();
            for s in sets {
                let t = post(
                    api,
                    "/v1/transfers",
                    json!({ "path": s, "class": "background" }),
                )
                .await?;
                background.push(t["id"].as_i64().context("transfer id")?);
            }
            tokio::time::sleep(LOAD_FIRST).await;
            let t0 = Instant::now();
            for (i, c) in ckpts.iter().enumerate() {
                let due_ms = (DEADLINE_FACTORS[i] * solo * 1000.0).round() as u64;
                let t = post(
                    api,
                    "/v1/transfers",
                    json!({ "path": c, "class": "urgent", "deadline": format!("{due_ms}ms") }),
                )
                .await?;
                if t["admission"]["feasible"] == json!(true) {
                    feasible[i] += 1;
                }
            }
            let (w0, w1) = tokio::join!(
                wait_local(&sink, ckpts[0], t0),
                wait_local(&sink, ckpts[1], t0)
            );
            let w = [w0?, w1?];
            // Where each one's time after its push went.
            let mut why = [String::new(), String::new()];
            for (i, c) in ckpts.iter().enumerate() {
                let rows = sink
                    .catalog()
                    .replicas_for_source(&c.to_string_lossy())
                    .await?;
                if let Some(p) = rows
                    .iter()
                    .find(|r| r.state == TransferState::Published)
                    .and_then(|r| r.phases.as_ref())
                {
                    why[i] = format!(" [{}]", super::phase_line(p));
                }
            }
            for i in 0..2 {
                walls[i].push(w[i]);
                if w[i] <= DEADLINE_FACTORS[i] * solo {
                    met[i] += 1;
                }
            }
            for id in &background {
                let _ = post(api, &format!("/v1/transfers/{id}/cancel"), json!({})).await;
            }
            pair.source.stop(Duration::from_secs(5)).await;
            pair.sink.stop(Duration::from_secs(5)).await;
            remove_run(run_dir).await;
            say(format!(
                "  {mode:<14} run {}: {:.2} s ({:.2} x solo){}, {:.2} s ({:.2} x solo){}",
                run + 1,
                w[0],
                w[0] / solo,
                why[0],
                w[1],
                w[1] / solo,
                why[1]
            ));
        }
        say(format!(
            "  {mode:<14} met {}/{} at {} x, {}/{} at {} x (admission said feasible {}/{} and {}/{})",
            met[0],
            a.deadline_runs,
            DEADLINE_FACTORS[0],
            met[1],
            a.deadline_runs,
            DEADLINE_FACTORS[1],
            feasible[0],
            a.deadline_runs,
            feasible[1],
            a.deadline_runs
        ));
        out[mode] = json!({
            "met": met,
            "admission_feasible": feasible,
            "over_solo": walls.iter().map(|ws| ws.iter().map(|w| round3(w / solo)).collect::<Vec<_>>()).collect::<Vec<_>>(),
        });
    }
    Ok(out)
}

/// Removes a finished run's data (gigabytes: off the async threads).
async fn remove_run(dir: PathBuf) {
    let _ = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(dir)).await;
}

/// `bytes` in MB (10^6), for messages.
pub(super) fn mb(bytes: u64) -> String {
    format!("{:.0} MB", bytes as f64 / 1e6)
}

/// Width of the window of the pre-emption latency, ms (ARCHITECTURE.md
/// "Measures").
const WINDOW_MS: i64 = 100;

/// Seconds from `signal_ms` to the end of the first [`WINDOW_MS`] window
/// in which the bytes arriving at the sink reach [`PREEMPTED_SHARE`] of
/// `rate_bps`. Windows slide in steps of one arrival bin, the first
/// starting with the bin the signal came in; `None` if none reaches it.
pub(super) fn preemption_latency_s(a: &Arrivals, signal_ms: i64, rate_bps: u64) -> Option<f64> {
    let need = PREEMPTED_SHARE * rate_bps as f64 / 8.0 * WINDOW_MS as f64 / 1000.0;
    let step = a.bin_ms.max(1);
    let last = a.bins.last()?.0;
    let mut start = signal_ms.div_euclid(step) * step;
    while start <= last {
        let end = start + WINDOW_MS.max(step);
        if a.bytes_between(start, end) as f64 >= need {
            return Some((end - signal_ms) as f64 / 1000.0);
        }
        start += step;
    }
    None
}

/// Seconds from `signal_ms` to the end of the first [`WINDOW_MS`] window
/// in which the bytes of a pre-empted (lower-class) transfer arriving at
/// the sink fall to `1 -` [`PREEMPTED_SHARE`] of `rate_bps` or below:
/// how soon its senders slowed. `a` holds its arrivals up to `until_ms`
/// (Unix ms; when they were read): windows slide as in
/// [`preemption_latency_s`] while they end by then, so a transfer that
/// stopped altogether yields in the first window. `None` if no window
/// falls that low.
pub(super) fn yield_latency_s(
    a: &Arrivals,
    signal_ms: i64,
    rate_bps: u64,
    until_ms: i64,
) -> Option<f64> {
    let most = (1.0 - PREEMPTED_SHARE) * rate_bps as f64 / 8.0 * WINDOW_MS as f64 / 1000.0;
    let step = a.bin_ms.max(1);
    let mut start = signal_ms.div_euclid(step) * step;
    loop {
        let end = start + WINDOW_MS.max(step);
        if end > until_ms {
            return None;
        }
        if a.bytes_between(start, end) as f64 <= most {
            return Some((end - signal_ms) as f64 / 1000.0);
        }
        start += step;
    }
}

async fn post(api: std::net::SocketAddr, path: &str, body: Value) -> Result<Value> {
    let r = reqwest::Client::new()
        .post(format!("http://{api}{path}"))
        .json(&body)
        .send()
        .await?;
    let status = r.status();
    let v: Value = r.json().await.unwrap_or(Value::Null);
    if !status.is_success() {
        bail!("POST {path}: {status}: {v}");
    }
    Ok(v)
}

/// Waits until `path` resolves as local at `sink`; seconds since `t0`.
async fn wait_local(sink: &Sink, path: &Path, t0: Instant) -> Result<f64> {
    let path = path.to_string_lossy();
    let mut changes = sink.changes();
    let deadline = t0 + Duration::from_secs(600);
    loop {
        match sink.resolve(&path).await? {
            Resolution::Local { .. } => return Ok(t0.elapsed().as_secs_f64()),
            Resolution::Remote { reason } => {
                bail!("transfer failed: {}", reason.unwrap_or_default())
            }
            _ => {}
        }
        if Instant::now() > deadline {
            bail!("no replica of {path} after 600 s");
        }
        let _ = tokio::time::timeout(Duration::from_millis(20), changes.changed()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_is_the_end_of_the_first_full_window_after_the_signal() {
        // 1 Gbit/s: 80 % of a 100 ms window is 10 MB; 10 ms bins.
        let mut bins = vec![(900, 20_000_000)];
        bins.extend(
            (1000..1300)
                .step_by(10)
                .map(|t| (t, if t < 1100 { 300_000 } else { 1_200_000 })),
        );
        let a = Arrivals { bin_ms: 10, bins };
        // From 1100 on, 1.2 MB per 10 ms: [1070, 1170) has 0.9 + 8.4 =
        // 9.3 MB, [1080, 1180) has 0.6 + 9.6 = 10.2 MB and is the first.
        assert_eq!(preemption_latency_s(&a, 1050, 1_000_000_000), Some(0.13));
        // Bytes before the signal do not count.
        let early = Arrivals {
            bin_ms: 10,
            bins: vec![(900, 20_000_000)],
        };
        assert_eq!(preemption_latency_s(&early, 1050, 1_000_000_000), None);
    }

    #[test]
    fn yield_is_the_end_of_the_first_window_at_a_fifth_of_the_budget_or_less() {
        // 1 Gbit/s: 20 % of a 100 ms window is 2.5 MB; 10 ms bins of
        // 1.2 MB until 1150, then 0.1 MB; read at 1400.
        let bins: Vec<(i64, u64)> = (1000..1400)
            .step_by(10)
            .map(|t| (t, if t < 1150 { 1_200_000 } else { 100_000 }))
            .collect();
        let a = Arrivals { bin_ms: 10, bins };
        // [1140, 1240) holds 1.2 + 0.9 = 2.1 MB, [1130, 1230) 2.4 + 0.8 =
        // 3.2 MB: the first is the one ending at 1240.
        assert_eq!(yield_latency_s(&a, 1050, 1_000_000_000, 1400), Some(0.19));
        // Nothing arrived after the signal (it stopped altogether): the
        // first window.
        let stopped = Arrivals {
            bin_ms: 10,
            bins: vec![(900, 20_000_000)],
        };
        assert_eq!(
            yield_latency_s(&stopped, 1050, 1_000_000_000, 1400),
            Some(0.1)
        );
        // Never below while observed: none (a window past the read is
        // not an observation).
        let busy = Arrivals {
            bin_ms: 10,
            bins: (1000..1400).step_by(10).map(|t| (t, 1_200_000)).collect(),
        };
        assert_eq!(yield_latency_s(&busy, 1050, 1_000_000_000, 1400), None);
    }
}
