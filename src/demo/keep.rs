//! `ferry demo --keep-running`: after the demo's phases, both agents, their
//! API and web UI stay up with something to watch until Ctrl-C (or
//! SIGTERM):
//!
//! - a background load: generated datasets pushed in class `background`,
//!   one after another, through two directories that are rewritten each
//!   time (a re-push replaces the replica, so the disk use stays bounded);
//! - a new checkpoint every `--checkpoint-every`, written by the simulated
//!   training job (PyTorch DCP, 4 ranks, at `--write-rate`) and replicated
//!   by the watcher while it is written; only the newest
//!   [`KEEP_CHECKPOINTS`] checkpoints (and their replicas) are kept.
//!
//! Then the load and the writer stop, and the caller stops the agents
//! cleanly and removes the work directory.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::Result;
use ferry_proto::state::{TransferId, TransferState};
use indicatif::DecimalBytes;
use replicator::sink::{Resolution, Sink};
use replicator::source::Source;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::DemoArgs;
use crate::config::format_rate;
use crate::out::noteln;

/// Checkpoints (and replicas) kept at each end; older ones are deleted
/// once their replica is published.
pub const KEEP_CHECKPOINTS: usize = 2;

/// Job of the background datasets' source root.
pub const LOAD_JOB: &str = "datasets";

/// Files per background dataset.
const LOAD_FILES: u64 = 32;

/// True once the keep-running phase waits for Ctrl-C: main then hands
/// interrupts to it ([`interrupt`]) instead of ending the process.
static OWNS_INTERRUPTS: AtomicBool = AtomicBool::new(false);

/// Interrupts handed over by main.
static INTERRUPTS: AtomicUsize = AtomicUsize::new(0);

fn interrupted() -> &'static Notify {
    static N: OnceLock<Notify> = OnceLock::new();
    N.get_or_init(Notify::new)
}

/// True while `ferry demo --keep-running` stops itself on Ctrl-C and
/// SIGTERM: main then passes each one to [`interrupt`].
pub fn handles_interrupts() -> bool {
    OWNS_INTERRUPTS.load(Ordering::Relaxed)
}

/// Main received Ctrl-C or SIGTERM while [`handles_interrupts`]: the first
/// starts a clean stop; returns true from the second on (stop at once).
pub fn interrupt() -> bool {
    let n = INTERRUPTS.fetch_add(1, Ordering::Relaxed) + 1;
    interrupted().notify_one();
    n >= 2
}

/// What the keep-running phase works with.
pub(super) struct Running<'a> {
    /// The demo's options.
    pub args: &'a DemoArgs,
    /// Source agent's API base URL (`http://127.0.0.1:PORT`).
    pub source_url: String,
    /// Sink agent's API base URL.
    pub sink_url: String,
    /// The sink role, to see replicas arrive.
    pub sink: Sink,
    /// The source role, to follow the background pushes.
    pub source: Source,
    /// The checkpoint root the watcher follows (job `mm-demo`).
    pub checkpoints: PathBuf,
    /// The background datasets' source root (job [`LOAD_JOB`]).
    pub datasets: PathBuf,
    /// Write rate of the training job, bit/s.
    pub write_rate: u64,
    /// Step of the last checkpoint the demo wrote so far.
    pub last_step: u64,
}

/// Runs until main hands over Ctrl-C or SIGTERM ([`interrupt`]), then
/// stops the load and the writer (within a few seconds) and returns; the
/// caller stops the agents.
///
/// # Errors
/// Building the HTTP client failed.
pub(super) async fn run(r: Running<'_>) -> Result<()> {
    let a = r.args;
    OWNS_INTERRUPTS.store(true, Ordering::Relaxed);
    noteln!(
        "\nkeep-running: both agents stay up until Ctrl-C\n  source  demo-source  {}/   (web UI and API)\n  sink    demo-sink    {}/\n  \
         no token needed (the demo's agents allow unauthenticated requests): ferry status --server {}",
        r.source_url, r.sink_url, r.source_url
    );
    if a.load_size > 0 {
        noteln!(
            "  load: background pushes of {} generated datasets, one after another",
            DecimalBytes(a.load_size)
        );
    }
    noteln!(
        "  a new DCP checkpoint of {} every {} (written at {}), replicated by the watcher while it is written; the newest {KEEP_CHECKPOINTS} checkpoints and replicas are kept\n\
         Ctrl-C stops the agents and removes the work directory{}.",
        DecimalBytes(a.size),
        humantime::format_duration(a.checkpoint_every),
        format_rate(r.write_rate),
        if a.keep || a.dir.is_some() {
            " (kept: --keep or --dir)"
        } else {
            ""
        }
    );
    let stop = CancellationToken::new();
    let save_stop = ferry_gen::format::StopFlag::default();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()?;
    let load = (a.load_size > 0).then(|| {
        tokio::spawn(load_loop(
            http.clone(),
            r.source_url.clone(),
            r.source.clone(),
            r.datasets.clone(),
            a.load_size,
            stop.clone(),
        ))
    });
    let writer = tokio::spawn(checkpoint_loop(
        r.sink.clone(),
        r.checkpoints.clone(),
        a.size,
        r.write_rate,
        a.checkpoint_every,
        r.last_step,
        stop.clone(),
        save_stop.clone(),
    ));
    interrupted().notified().await;
    noteln!(
        "\nstopping: the load and the training job, then both agents (Ctrl-C again to stop at once)"
    );
    stop.cancel();
    save_stop.stop();
    for t in [Some(writer), load].into_iter().flatten() {
        if tokio::time::timeout(Duration::from_secs(5), t)
            .await
            .is_err()
        {
            eprintln!("warning: a demo task did not stop within 5 s");
        }
    }
    Ok(())
}

/// Sleeps for `d` unless `stop` fires first; false if it fired.
async fn pause(stop: &CancellationToken, d: Duration) -> bool {
    tokio::select! {
        _ = stop.cancelled() => false,
        _ = tokio::time::sleep(d) => true,
    }
}

/// Background pushes until `stop`: two dataset directories, rewritten in
/// turn with new contents and pushed in class `background`, so that one
/// moves while the next is generated.
async fn load_loop(
    http: reqwest::Client,
    source_url: String,
    source: Source,
    root: PathBuf,
    size: u64,
    stop: CancellationToken,
) {
    let slots = [root.join("set-0"), root.join("set-1")];
    // The transfer of each slot's last push.
    let mut pushed: [Option<TransferId>; 2] = [None, None];
    for round in 0u64.. {
        let i = (round % 2) as usize;
        // A slot is rewritten only once its last push is finished.
        if !wait_final(&source, pushed[i], &stop).await {
            return;
        }
        let (out, seed) = (slots[i].clone(), 1_000 + round);
        let made = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            if out.exists() {
                std::fs::remove_dir_all(&out)?;
            }
            let opts = ferry_gen::GenOptions {
                seed,
                shards: Some(LOAD_FILES),
                ..ferry_gen::GenOptions::new(out, size)
            };
            ferry_gen::generate(&opts, &|_| {}).map(|_| ())
        })
        .await;
        match made {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                eprintln!(
                    "warning: background load stopped: generating {}: {e}",
                    slots[i].display()
                );
                return;
            }
            Err(_) => return,
        }
        if stop.is_cancelled() {
            return;
        }
        let push = http
            .post(format!("{source_url}/v1/transfers"))
            .json(&serde_json::json!({ "path": slots[i], "class": "background" }))
            .send()
            .await;
        let answer: serde_json::Value = match push {
            Ok(resp) if resp.status().is_success() => resp.json().await.unwrap_or_default(),
            Ok(resp) => {
                let body = resp.text().await.unwrap_or_default();
                eprintln!("warning: background load stopped: push refused: {body}");
                return;
            }
            Err(e) => {
                eprintln!("warning: background load stopped: push failed: {e}");
                return;
            }
        };
        pushed[i] = answer["id"].as_i64().and_then(TransferId::from_i64);
        // The other slot is rewritten once its push is done: at most one
        // background push waits in the queue.
    }
}

/// Waits until transfer `id` (if any) is published, failed or cancelled;
/// false if `stop` fired first.
async fn wait_final(source: &Source, id: Option<TransferId>, stop: &CancellationToken) -> bool {
    let Some(id) = id else {
        return !stop.is_cancelled();
    };
    loop {
        match source.catalog().transfer(id).await {
            Ok(Some(t)) if !t.state.is_final() => {}
            _ => return !stop.is_cancelled(),
        }
        if !pause(stop, Duration::from_millis(250)).await {
            return false;
        }
    }
}

/// Writes a checkpoint every `every` until `stop`, reports when each one
/// is written and replicated, and deletes all but the newest
/// [`KEEP_CHECKPOINTS`] once their replicas are published.
#[allow(clippy::too_many_arguments)]
async fn checkpoint_loop(
    sink: Sink,
    root: PathBuf,
    size: u64,
    write_rate: u64,
    every: Duration,
    mut step: u64,
    stop: CancellationToken,
    save_stop: ferry_gen::format::StopFlag,
) {
    let mut next = Instant::now() + every;
    loop {
        if !pause(&stop, next.saturating_duration_since(Instant::now())).await {
            return;
        }
        next = Instant::now() + every;
        step += 1000;
        let opts = ferry_gen::format::SaveOptions {
            step,
            seed: step,
            write_rate_bps: Some(write_rate),
            stop: save_stop.clone(),
            ..ferry_gen::format::SaveOptions::new(&root, ferry_gen::format::GenFormat::Dcp, size)
        };
        let dir = opts.checkpoint_dir();
        let name = dir
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        noteln!(
            "checkpoint {name}: the training job starts writing it ({})",
            DecimalBytes(size)
        );
        let t0 = Instant::now();
        let saved =
            tokio::task::spawn_blocking(move || ferry_gen::format::save(&opts, &|_| {})).await;
        match saved {
            Ok(Ok(s)) => noteln!(
                "checkpoint {name}: committed after {:.1} s ({} files)",
                t0.elapsed().as_secs_f64(),
                s.files
            ),
            Ok(Err(_)) if stop.is_cancelled() => return,
            Ok(Err(e)) => {
                eprintln!("warning: the training job stopped: {e}");
                return;
            }
            Err(_) => return,
        }
        // Report the replica when it is published (without holding up
        // the next save).
        let (sink2, stop2, path) = (sink.clone(), stop.clone(), dir.clone());
        tokio::spawn(async move {
            let path_s = path.to_string_lossy().into_owned();
            loop {
                if let Ok(Resolution::Local {
                    local_path, url, ..
                }) = sink2.resolve(&path_s).await
                {
                    let local_path = local_path.or(url).unwrap_or_default();
                    let lag = sink2
                        .catalog()
                        .replicas_for_source(&path_s)
                        .await
                        .ok()
                        .and_then(|rows| {
                            rows.into_iter()
                                .find(|r| r.state == TransferState::Published)
                                .and_then(|r| r.commit_to_replica_s)
                        })
                        .map_or(String::new(), |l| format!(" {l:.2} s after its commit"));
                    noteln!("checkpoint {name}: replica published{lag}: {local_path}");
                    return;
                }
                if !pause(&stop2, Duration::from_millis(200)).await {
                    return;
                }
            }
        });
        prune(&sink, &root).await;
    }
}

/// Deletes every checkpoint directory under `root` but the newest
/// [`KEEP_CHECKPOINTS`] (by step number), with its replica, once the
/// replica is published.
async fn prune(sink: &Sink, root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    let mut dirs: Vec<(u64, PathBuf)> = entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let digits: String = name.chars().filter(char::is_ascii_digit).collect();
            digits.parse().ok().map(|n| (n, e.path()))
        })
        .collect();
    dirs.sort();
    let old = dirs.len().saturating_sub(KEEP_CHECKPOINTS);
    for (_, dir) in dirs.into_iter().take(old) {
        let path = dir.to_string_lossy().into_owned();
        let Ok(Resolution::Local { replica, .. }) = sink.resolve(&path).await else {
            continue;
        };
        // The replica goes the way an operator's removal does (its
        // version directory with it); then the checkpoint.
        if let Err(e) = sink
            .remove(replica, true, "ferry demo keeps the newest checkpoints")
            .await
        {
            eprintln!("warning: removing the replica of {path}: {e}");
            continue;
        }
        let src = dir.clone();
        let removed = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(&src)).await;
        if let Ok(Err(e)) = removed {
            eprintln!("warning: removing the old checkpoint {path}: {e}");
        }
    }
}
