//! `ferry demo --weights-first`: time to eval-ready under a weights-first
//! publish (ARCHITECTURE.md, "Weights first"). A DeepSpeed ZeRO-2 save of
//! the 7B model at a scale (`--scale`; about a sixth of its bytes are the
//! weights, CHECKPOINT_FORMATS.md "Realistic sizes") is written into a
//! root with `publish = "weights-first"` whose transfers start at the
//! commit, so all of it crosses the emulated link after the commit. It
//! reports how long after the commit the weights-only version and the full
//! replica were published (the sink's `commit_to_replica_s` of each),
//! their sizes, and the weights-only version's phases.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ferry_proto::state::{Profile, TransferState};
use serde_json::{json, Value};

use super::{round3, start_pair, DemoArgs};
use crate::config::RootSection;

/// Longest wait for the full replica after the save, seconds.
const MAX_WAIT_S: u64 = 1800;

/// The save's options: DeepSpeed, the 7B model at `scale`, 8 ranks, step
/// 1000, under `root`.
fn save_options(root: &Path, scale: f64) -> ferry_gen::format::SaveOptions {
    ferry_gen::format::SaveOptions {
        step: 1000,
        ranks: 8,
        model: ferry_gen::Preset::Llama7b,
        scale: Some(scale),
        ..ferry_gen::format::SaveOptions::new(root, ferry_gen::format::GenFormat::DeepSpeed, 0)
    }
}

/// Runs the scenario and returns its measures as JSON.
///
/// # Errors
/// Any step that fails, named.
pub(super) async fn run(a: &DemoArgs, dir: &Path, say: &dyn Fn(String)) -> Result<Value> {
    let train = dir.join("train").join("llama-7b");
    std::fs::create_dir_all(&train)?;
    let train = std::fs::canonicalize(&train)?;
    let opts = save_options(&train, a.scale);
    let preview =
        ferry_gen::format::preview(&opts).with_context(|| format!("--scale {}", a.scale))?;
    ferry_gen::ensure_space(dir, preview.bytes.saturating_mul(2))
        .context("the demo needs room for the checkpoint and its replica")?;
    let est = super::physical_limit_s(preview.bytes, a.rate, a.rtt);
    if est > MAX_WAIT_S as f64 / 2.0 {
        bail!(
            "the checkpoint ({:.1} GB) would take about {est:.0} s on the link; lower --scale",
            preview.bytes as f64 / 1e9
        );
    }
    say(format!(
        "weights first: a DeepSpeed save of the 7b model at scale {} ({:.2} GB), all of it sent after its commit",
        a.scale,
        preview.bytes as f64 / 1e9
    ));
    let root = RootSection {
        format: "deepspeed".into(),
        start: "on_commit".into(),
        publish: "weights-first".into(),
        ..RootSection::new(train.clone(), "llama-7b", "to-eval")
    };
    let pair = start_pair(
        dir,
        dir,
        a,
        vec![root],
        Duration::from_secs(1),
        Default::default(),
    )
    .await?;
    let sink = pair.sink.sink.clone().context("sink role")?;

    let bar = indicatif::ProgressBar::new(preview.bytes);
    bar.set_style(indicatif::ProgressStyle::with_template(
        "saving {bar:40} {bytes}/{total_bytes}",
    )?);
    if a.json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let b2 = bar.clone();
    let summary = tokio::task::spawn_blocking(move || {
        ferry_gen::format::save(&opts, &|n| b2.set_position(n))
    })
    .await??;
    bar.finish_and_clear();
    let ckpt = summary.dir.to_string_lossy().into_owned();
    say(format!(
        "saved {} ({} files, {:.2} GB); replicating",
        summary.dir.display(),
        summary.files,
        summary.bytes as f64 / 1e9
    ));

    // Both versions, from the sink's catalog: the weights-only one when
    // the plain resolve first answers it, the full one at the end.
    let t0 = Instant::now();
    let mut changes = sink.changes();
    let mut weights_seen: Option<f64> = None;
    let rows = loop {
        if t0.elapsed() > Duration::from_secs(MAX_WAIT_S) {
            bail!("no full replica {MAX_WAIT_S} s after the save");
        }
        let rows = sink.catalog().replicas_for_source(&ckpt).await?;
        if weights_seen.is_none()
            && rows
                .iter()
                .any(|r| r.profile == Profile::WeightsOnly && r.state == TransferState::Published)
        {
            weights_seen = Some(t0.elapsed().as_secs_f64());
        }
        if let Some(r) = rows.iter().find(|r| r.state == TransferState::Failed) {
            bail!(
                "replication failed: {}",
                r.error.clone().unwrap_or_default()
            );
        }
        if rows
            .iter()
            .any(|r| r.profile == Profile::Full && r.state == TransferState::Published)
        {
            break rows;
        }
        let _ = tokio::time::timeout(Duration::from_millis(50), changes.changed()).await;
    };
    pair.source.stop(Duration::from_secs(5)).await;
    pair.sink.stop(Duration::from_secs(5)).await;

    let published = |p: Profile| {
        rows.iter()
            .find(|r| r.profile == p && r.state == TransferState::Published)
    };
    let full = published(Profile::Full).context("the full replica's row")?;
    let Some(weights) = published(Profile::WeightsOnly) else {
        bail!("the full replica was published without a weights-only version first (see the log)");
    };
    let after = |r: &ferry_catalog::Replica| r.commit_to_replica_s.unwrap_or(f64::NAN);
    let (tw, tf) = (after(weights), after(full));
    say(format!(
        "weights-only version: {:.2} GB ({:.0} % of the bytes), published {:.1} s after the commit",
        weights.bytes_total as f64 / 1e9,
        100.0 * weights.bytes_total as f64 / full.bytes_total.max(1) as f64,
        tw
    ));
    say(format!(
        "full replica: {:.2} GB, published {:.1} s after the commit; eval-ready {:.1} x sooner with weights first",
        full.bytes_total as f64 / 1e9,
        tf,
        tf / tw
    ));
    let phases = weights.phases.as_ref().map(|p| {
        p.after
            .iter()
            .map(|(k, v)| (k.as_str().to_string(), json!(round3(v.as_secs_f64()))))
            .collect::<serde_json::Map<String, Value>>()
    });
    if let Some(p) = &weights.phases {
        // In the order they happen.
        let list: Vec<String> = p
            .after
            .iter()
            .map(|(k, v)| format!("{} {:.2} s", k.as_str(), v.as_secs_f64()))
            .collect();
        say(format!(
            "  the weights-only version after the commit: {}",
            list.join(", ")
        ));
    }
    Ok(json!({
        "scale": a.scale,
        "checkpoint_bytes": summary.bytes,
        "weights_only_bytes": weights.bytes_total,
        "full_bytes": full.bytes_total,
        "weights_only_after_commit_s": round3(tw),
        "full_after_commit_s": round3(tf),
        "weights_only_seen_after_save_s": weights_seen.map(round3),
        "weights_only_phases_after_commit_s": phases,
    }))
}
