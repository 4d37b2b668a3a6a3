//! `ferry demo`: a realistic checkpoint replicated between two agents in
//! this process across an in-memory emulated WAN link, with the measures
//! of ARCHITECTURE.md ("Measures") printed at the end.

use std::io::Read;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ferry_linkemu::{memory_pair, LinkParams};
use ferry_proto::state::TransferState;
use replicator::sink::Resolution;

use crate::agent::{self, Overrides};
use crate::config::{
    format_rate, AgentSection, ApiSection, Config, LinkSection, QuicSection, Role, RootSection,
    SinkSection, SourceSection, TlsSection,
};
use crate::out::noteln;
use replicator::transport::SocketFactory;

mod keep;
mod pool;
mod priority;
mod weights;

pub use keep::{handles_interrupts, interrupt};

/// Options of `ferry demo`.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Checkpoint size, e.g. 1.4GB, 200MB.
    #[arg(long, default_value = "1.4GB", value_parser = ferry_proto::units::parse_size)]
    pub size: u64,
    /// Link rate cap, e.g. 1Gbit/s.
    #[arg(long, default_value = "1Gbit/s", value_parser = crate::config::parse_rate)]
    pub rate: u64,
    /// Round-trip time of the emulated link.
    #[arg(long, default_value = "100ms", value_parser = humantime::parse_duration)]
    pub rtt: Duration,
    /// Random loss probability per datagram, 0..1, each direction.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub loss: f64,
    /// Print the summary as one JSON object on the last line of stdout.
    #[arg(long)]
    pub json: bool,
    /// Work directory (default: a new temporary directory, removed at
    /// the end unless --keep).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Keep the work directory (checkpoint, replica, catalogs, certs).
    #[arg(long)]
    pub keep: bool,
    /// Write rate of the second phase's training job (a DCP save of
    /// --size bytes by 4 ranks that the watcher replicates while it is
    /// written); default half the link rate. With --agents: instead of
    /// pushing, a training job writes one checkpoint of --size at this
    /// rate the way transformers' save_pretrained does (safetensors
    /// shards one after another, the index last) into a root every source
    /// agent watches (one holds the watch); prints how long after its
    /// commit the replica was published and how many parts each source
    /// agent claimed before the commit.
    #[arg(long, value_parser = crate::config::parse_rate)]
    pub write_rate: Option<u64>,
    /// When the second phase's transfer starts: "on_open" (stream while
    /// the checkpoint is written) or "on_commit" (copy after the commit).
    #[arg(long, default_value = "on_open", value_parser = ["on_open", "on_commit"])]
    pub start: String,
    /// Skip the second phase (push only).
    #[arg(long)]
    pub no_watch: bool,
    /// Run the scheduler scenario instead of the push and watch phases: a
    /// checkpoint alone, then against background copies filling the link
    /// with a loss-spike signal (urgent), then the same under fifo; prints
    /// each wall time over the solo time and the pre-emption latency.
    #[arg(long, conflicts_with_all = ["size", "write_rate", "start", "no_watch"])]
    pub priority: bool,
    /// After the first replica (and the watch phase), keep both agents,
    /// their API and web UI running with a background load and a new
    /// checkpoint every --checkpoint-every, printing each agent's address,
    /// until Ctrl-C; then stop them and remove the work directory (unless
    /// --keep or --dir). The newest 2 checkpoints and replicas are kept.
    #[arg(long, conflicts_with_all = ["json", "priority"])]
    pub keep_running: bool,
    /// --keep-running: how often the training job starts a new checkpoint
    /// (DCP, 4 ranks, --size bytes at --write-rate), e.g. 30s, 2m.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration, requires = "keep_running")]
    pub checkpoint_every: Duration,
    /// --keep-running: size of each background push (a generated dataset
    /// in class background; one moves while the next is generated); 0
    /// turns the load off.
    #[arg(long, default_value = "200MB", value_parser = ferry_proto::units::parse_size, requires = "keep_running")]
    pub load_size: u64,
    /// --priority: size of the checkpoint that becomes urgent.
    #[arg(long, default_value = "300MB", value_parser = ferry_proto::units::parse_size, requires = "priority")]
    pub urgent_size: u64,
    /// --priority: total size of the background copies (4 of them).
    #[arg(long, default_value = "1.6GB", value_parser = ferry_proto::units::parse_size, requires = "priority")]
    pub background_size: u64,
    /// --priority: then this many runs of two urgent checkpoints (each
    /// --urgent-size) against the background copies, with deadlines at
    /// 1.2 x and 2.0 x the solo time after they are queued, under
    /// earliest-deadline-first and again in score order
    /// (`deadline_first = false`); prints how often each deadline is met.
    /// 0 skips them.
    #[arg(long, default_value_t = 5, requires = "priority")]
    pub deadline_runs: usize,
    /// Run the weights-first scenario instead: a DeepSpeed save of the 7b
    /// model (--scale) into a root with publish = "weights-first"; prints
    /// how long after the commit the weights-only version and the full
    /// replica were published.
    #[arg(long, conflicts_with_all = ["size", "write_rate", "start", "no_watch", "priority", "keep_running"])]
    pub weights_first: bool,
    /// Run N source agents and N sink agents (1 to 8), each a `ferry
    /// serve` process, as a source pool and a sink pool on a throwaway
    /// PostgreSQL cluster (started here; needs Debian's postgresql
    /// package), behind the emulated link; pushes --checkpoints
    /// checkpoints (2 x N by default) that add up to --size through the
    /// source agents in turn (each runs on whichever source agent of the
    /// pool claims it; one larger than --part-size is striped across
    /// them all) and prints each agent's payload bytes.
    #[arg(long, value_name = "N", conflicts_with_all = ["start", "no_watch", "priority", "keep_running", "weights_first"])]
    pub agents: Option<usize>,
    /// --agents: how many checkpoints to push (1 to 64; default 2 x N).
    /// One checkpoint shows one transfer striped across the pool.
    #[arg(
        long,
        value_name = "K",
        requires = "agents",
        conflicts_with = "write_rate"
    )]
    pub checkpoints: Option<usize>,
    /// --agents: the pool's part size (`[pool] part_size`), e.g. 32MiB:
    /// a checkpoint larger than this is striped across the source agents.
    /// Default 256MiB.
    #[arg(long, value_name = "SIZE", requires = "agents", value_parser = ferry_proto::units::parse_size)]
    pub part_size: Option<u64>,
    /// --agents: each sink agent's emulated link carries at most this
    /// (bit/s, e.g. 200Mbit/s), while --rate stays the pool's budget
    /// (the links' rate cap): one agent pair then cannot use the whole
    /// budget, as one pair's connections and cores cannot fill a 60
    /// Gbit/s link. Default --rate. Not with --netns.
    #[arg(long, requires = "agents", conflicts_with = "netns", value_parser = crate::config::parse_rate)]
    pub pair_rate: Option<u64>,
    /// --agents --write-rate: how the training job saves: hf
    /// (transformers' save_pretrained: safetensors shards one after
    /// another, so complete files accumulate while it writes) or dcp
    /// (PyTorch DCP, 4 ranks writing their files at once; they complete
    /// with the commit, and the pool takes their full chunks while they
    /// grow).
    #[arg(long, default_value = "hf", value_parser = ["hf", "dcp"], requires_all = ["write_rate", "agents"])]
    pub save: String,
    /// --agents --write-rate: the source agents' `[pool]
    /// stripe_while_writing = false` (the watching agent sends the
    /// checkpoint alone until the commit), to compare.
    #[arg(long, requires_all = ["write_rate", "agents"])]
    pub no_stripe_while_writing: bool,
    /// --agents: pre-emption across the pool instead. A background
    /// checkpoint of --size is striped over every source agent; once
    /// each holds parts of it and it ran 10 RTT (2 s at least), an urgent
    /// checkpoint of a quarter of --size is pushed and its job sent a
    /// loss-spike signal. Prints the time from the signal to the first
    /// 100 ms in which the background checkpoint's bytes at the sink
    /// fall to 20 % of the link's budget (--rate) or below, and to the
    /// first in which the urgent checkpoint's reach 80 % of it, and both
    /// checkpoints' arrival rates per 50 ms around the signal.
    #[arg(long, requires = "agents", conflicts_with_all = ["checkpoints", "write_rate"])]
    pub preempt: bool,
    /// --agents: run the source agents in network namespace `ferry-src`
    /// and the sink agents in `ferry-dst`, joined by the emulator that
    /// `ops/wanem/netns` runs (start it first; needs root), instead of one
    /// user-space relay per sink agent in this process. The link's RTT,
    /// rate and loss are then the emulator's (give --rtt the same RTT:
    /// the agents' `rtt_hint` and the RTT counts are taken from it), and
    /// --rate is only the pool's budget (the links' rate cap). Needs `ip`
    /// (Debian package iproute2).
    #[arg(long, requires = "agents")]
    pub netns: bool,
    /// --weights-first: the 7b model's scale (0 < S <= 1; 1 is the full
    /// 7B model, about 98 GB as DeepSpeed ZeRO-2 with its optimizer
    /// state); the default 0.01 saves about 1 GB.
    #[arg(
        long,
        default_value_t = 0.01,
        requires = "weights_first",
        allow_negative_numbers = true
    )]
    pub scale: f64,
}

/// The temporary work directory of a running demo, for cleanup after an
/// interruption (see [`remove_work_dir`]).
static WORK_DIR: std::sync::Mutex<Option<PathBuf>> = std::sync::Mutex::new(None);

/// Removes the temporary work directory of an interrupted demo (call after
/// its agents stopped); returns a note for the user.
pub fn remove_work_dir() -> String {
    let dir = WORK_DIR.lock().ok().and_then(|mut w| w.take());
    match dir {
        Some(d) if d.exists() => match std::fs::remove_dir_all(&d) {
            Ok(()) => format!("; removed the demo's temporary directory {}", d.display()),
            Err(e) => format!("; could not remove {}: {e}", d.display()),
        },
        Some(d) => format!("; removed the demo's temporary directory {}", d.display()),
        None => String::new(),
    }
}

/// File marking a `--dir` as the demo's own.
const DEMO_STAMP: &str = ".ferry-demo";

/// Longest demo transfer accepted, in seconds of physical limit.
const MAX_DEMO_S: f64 = 600.0;

/// Physical limit in seconds (ARCHITECTURE.md, "Measures"): payload bytes x 8 x
/// 1500/1448 / rate + 1.5 RTT.
pub fn physical_limit_s(bytes: u64, rate_bps: u64, rtt: Duration) -> f64 {
    bytes as f64 * 8.0 * 1500.0 / 1448.0 / rate_bps as f64 + 1.5 * rtt.as_secs_f64()
}

fn agent_config(dir: &Path, name: &str, role: Role, api: SocketAddr) -> Config {
    let certs = dir.join("certs");
    Config {
        agent: AgentSection {
            name: name.into(),
            site: if role == Role::Sink {
                "eval-b"
            } else {
                "train-a"
            }
            .into(),
            role,
            data_dir: dir.join(format!("{name}-data")),
        },
        // The demo's agents are local and short-lived: no tokens.
        api: ApiSection {
            listen: api,
            allow_unauthenticated: true,
            ..ApiSection::default()
        },
        quic: QuicSection::default(),
        tls: TlsSection {
            ca: certs.join("ca.pem"),
            cert: certs.join(format!("{name}.pem")),
            key: certs.join(format!("{name}.key")),
        },
        links: Vec::new(),
        jobs: Vec::new(),
        source: None,
        sink: None,
        scheduler: Default::default(),
        catalog: Default::default(),
        pool: Default::default(),
    }
}

/// The most the demo's links carry together, in bit/s: `--rate` (the
/// budget), or with `--agents N --pair-rate P` (each agent pair's
/// emulated link carries at most P) the lesser of it and N x P.
fn carried_rate(a: &DemoArgs) -> u64 {
    match (a.agents, a.pair_rate) {
        (Some(n), Some(p)) => a.rate.min(p.saturating_mul(n.max(1) as u64)),
        _ => a.rate,
    }
}

/// Runs the demo.
///
/// # Errors
/// Any step that fails, named.
pub async fn run(a: DemoArgs) -> Result<()> {
    if !(0.0..1.0).contains(&a.loss) {
        bail!("--loss must be within 0..1 (a probability), got {}", a.loss);
    }
    if a.size < 1000 {
        bail!("--size must be at least 1kB, got {} bytes", a.size);
    }
    if a.rtt.is_zero() || a.rtt > Duration::from_secs(10) {
        bail!("--rtt must be more than 0 and at most 10s, got {:?}", a.rtt);
    }
    let carried = carried_rate(&a);
    let estimate = physical_limit_s(a.size, carried, a.rtt) / (1.0 - a.loss).max(0.01);
    if let Some(w) = a.write_rate.filter(|_| !a.no_watch) {
        let write_s = a.size as f64 * 8.0 / w.max(1) as f64;
        if write_s > MAX_DEMO_S {
            bail!(
                "{} would write for about {write_s:.0} s at --write-rate {} (the demo stops at {MAX_DEMO_S:.0} s); raise --write-rate or lower --size",
                if a.agents.is_some() {
                    "the training job"
                } else {
                    "the second phase"
                },
                format_rate(w)
            );
        }
    }
    if estimate > MAX_DEMO_S {
        bail!(
            "this would take about {estimate:.0} s at {}{} (the demo stops at {MAX_DEMO_S:.0} s); raise {}{} or lower --size",
            format_rate(carried),
            if a.loss > 0.0 {
                format!(" with --loss {}", a.loss)
            } else {
                String::new()
            },
            if carried < a.rate {
                "--pair-rate"
            } else {
                "--rate"
            },
            if a.loss > 0.0 { ", lower --loss" } else { "" }
        );
    }
    let mut tmp = None;
    let dir = match &a.dir {
        Some(d) => {
            std::fs::create_dir_all(d).with_context(|| format!("--dir {}", d.display()))?;
            let d = std::fs::canonicalize(d)?;
            // Only a directory the demo made (it holds the stamp) or an
            // empty one is used: the demo deletes what it made earlier.
            let stamp = d.join(DEMO_STAMP);
            let empty = std::fs::read_dir(&d)
                .map(|mut r| r.next().is_none())
                .unwrap_or(false);
            if !empty && !stamp.exists() {
                bail!(
                    "--dir {} is not empty and was not made by ferry demo; give an empty or new directory",
                    d.display()
                );
            }
            std::fs::write(
                &stamp,
                "made by ferry demo; its subdirectories are replaced on every run\n",
            )
            .with_context(|| format!("--dir {}", d.display()))?;
            // A rerun starts from scratch: remove what an earlier run left.
            for sub in [
                "train",
                "eval",
                "certs",
                "demo-source-data",
                "demo-sink-data",
                "data",
                "run-solo",
                "run-priority",
                "run-fifo",
            ] {
                let p = d.join(sub);
                if p.exists() {
                    std::fs::remove_dir_all(&p)
                        .with_context(|| format!("removing the earlier run's {}", p.display()))?;
                }
            }
            d
        }
        None => {
            let t = tempfile::Builder::new().prefix("ferry-demo-").tempdir()?;
            let p = t.path().to_path_buf();
            if let Ok(mut w) = WORK_DIR.lock() {
                *w = Some(p.clone());
            }
            tmp = Some(t);
            p
        }
    };
    let say = |s: String| {
        if a.json {
            eprintln!("{s}");
        } else {
            noteln!("{s}");
        }
    };
    if a.agents.is_some() {
        ferry_gen::ensure_space(&dir, a.size.saturating_mul(2))
            .context("the demo needs room for its checkpoints and their replicas")?;
        let out = pool::run(&a, &dir, &say).await?;
        if a.json {
            let key = if a.preempt { "pool_preempt" } else { "pool" };
            noteln!("{}", serde_json::json!({ key: out }));
        }
        if a.keep {
            if let Some(t) = tmp {
                let _ = t.keep();
            }
        }
        return Ok(());
    }
    // A scenario instead of the push and watch phases.
    if a.weights_first || a.priority {
        let name = if a.weights_first {
            if !(a.scale > 0.0 && a.scale <= 1.0) {
                bail!(
                    "--scale must be above 0 and at most 1 (1 is the full 7B model), got {}",
                    a.scale
                );
            }
            "weights-first"
        } else {
            let total = a.urgent_size.saturating_add(a.background_size);
            if a.urgent_size < 1000 || a.background_size < 4000 {
                bail!("--urgent-size must be at least 1kB and --background-size at least 4kB");
            }
            let est = physical_limit_s(total, a.rate, a.rtt);
            if est > MAX_DEMO_S {
                bail!(
                    "the fifo run would take about {est:.0} s at {} (the demo stops at {MAX_DEMO_S:.0} s); lower --urgent-size or --background-size",
                    format_rate(a.rate)
                );
            }
            ferry_gen::ensure_space(&dir, total.saturating_mul(2))
                .context("the demo needs room for its checkpoints and their replicas")?;
            "priority"
        };
        replicator::tls::init_dev_pki(
            &dir.join("certs"),
            &["demo-source".into(), "demo-sink".into()],
            30,
        )?;
        say(format!(
            "ferry demo --{name}: emulated {}, {} ms RTT link (work dir {})",
            format_rate(a.rate),
            a.rtt.as_millis(),
            dir.display()
        ));
        let out = if a.weights_first {
            weights::run(&a, &dir, &say).await?
        } else {
            priority::run(&a, &dir, &say).await?
        };
        if a.json {
            noteln!("{}", serde_json::json!({ name.replace('-', "_"): out }));
        }
        if a.keep {
            if let Some(t) = tmp {
                let _ = t.keep();
            }
        }
        return Ok(());
    }
    if a.keep_running && a.checkpoint_every < Duration::from_secs(1) {
        bail!("--checkpoint-every must be at least 1s");
    }
    let copies = if a.no_watch { 2 } else { 4 };
    // --keep-running: the newest checkpoints, one being written, their
    // replicas; two background datasets and their replicas.
    let (copies, load) = if a.keep_running {
        let kept = keep::KEEP_CHECKPOINTS as u64 + 1;
        (copies.max(2 * kept), a.load_size.saturating_mul(4))
    } else {
        (copies, 0)
    };
    ferry_gen::ensure_space(&dir, a.size.saturating_mul(copies).saturating_add(load))
        .context("the demo needs room for its checkpoints and their replicas")?;
    let write_rate = a.write_rate.unwrap_or(a.rate / 2).max(1);
    say(format!(
        "ferry demo: {} bytes over an emulated {}, {} ms RTT link{} (work dir {})",
        a.size,
        format_rate(a.rate),
        a.rtt.as_millis(),
        if a.loss > 0.0 {
            format!(", {} % loss", a.loss * 100.0)
        } else {
            String::new()
        },
        dir.display()
    ));

    // 1. A realistic checkpoint, committed by its marker.
    let src_root = dir.join("train").join("mm-demo");
    let ckpt = src_root.join("step_001000");
    if ckpt.exists() {
        std::fs::remove_dir_all(&ckpt)?;
    }
    let bar = indicatif::ProgressBar::new(a.size);
    bar.set_style(indicatif::ProgressStyle::with_template(
        "generating checkpoint {bar:40} {bytes}/{total_bytes}",
    )?);
    if a.json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    // No commit marker: the watcher leaves it alone and the push below is
    // the only transfer of it.
    let opts = ferry_gen::GenOptions::new(ckpt.clone(), a.size);
    let b2 = bar.clone();
    let summary =
        tokio::task::spawn_blocking(move || ferry_gen::generate(&opts, &|n| b2.set_position(n)))
            .await??;
    bar.finish_and_clear();
    say(format!(
        "checkpoint: {} shards ({} under 16 KiB), {} bytes",
        summary.shards, summary.small_shards, summary.bytes
    ));

    // 2. Certificates and two agents joined by an emulated link.
    replicator::tls::init_dev_pki(
        &dir.join("certs"),
        &["demo-source".into(), "demo-sink".into()],
        30,
    )?;
    let mut roots = vec![RootSection {
        start: a.start.clone(),
        ..RootSection::new(src_root.clone(), "mm-demo", "to-eval")
    }];
    let datasets = dir.join("train").join("datasets");
    if a.keep_running {
        std::fs::create_dir_all(&datasets)?;
        roots.push(RootSection::new(
            std::fs::canonicalize(&datasets)?,
            keep::LOAD_JOB,
            "to-eval",
        ));
    }
    let scan = if a.no_watch && !a.keep_running {
        Duration::ZERO
    } else {
        Duration::from_secs(1)
    };
    let DemoPair {
        source: src_agent,
        sink: sink_agent,
        link: link_up,
    } = start_pair(&dir, &dir, &a, roots, scan, Default::default()).await?;
    let sink = sink_agent.sink.clone().context("sink role")?;

    // 3. Push through the source's API, as `ferry push` does; the wall
    //    time runs from this request to the publish at the sink.
    let http = reqwest::Client::new();
    let source_path = std::fs::canonicalize(&ckpt)?.to_string_lossy().into_owned();
    let mut changes = sink.changes();
    let t0 = Instant::now();
    let resp = http
        .post(format!("http://{}/v1/transfers", src_agent.api_addr))
        .json(&serde_json::json!({ "path": source_path }))
        .send()
        .await?;
    if !resp.status().is_success() {
        bail!("push refused: {}", resp.text().await?);
    }
    let bar = indicatif::ProgressBar::new(summary.bytes);
    bar.set_style(indicatif::ProgressStyle::with_template(
        "replicating {bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    )?);
    if a.json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let deadline = t0 + Duration::from_secs_f64(MAX_DEMO_S + 60.0);
    let (wall, resolution) = loop {
        let r = sink.resolve(&source_path).await?;
        match &r {
            Resolution::Local { .. } => break (t0.elapsed(), r),
            Resolution::Replicating { bytes_done, .. } => bar.set_position(*bytes_done),
            Resolution::Remote { reason } => {
                bail!("transfer failed: {}", reason.clone().unwrap_or_default())
            }
            Resolution::Unknown => {}
        }
        if Instant::now() > deadline {
            bail!("no replica after {:.0} s", MAX_DEMO_S + 60.0);
        }
        if let Some(t) = src_agent.source.as_ref() {
            if let Ok(Some(tr)) = t.catalog().transfer_by_path(&source_path).await {
                if tr.state == TransferState::Failed {
                    bail!("transfer failed: {}", tr.error.unwrap_or_default());
                }
            }
        }
        let _ = tokio::time::timeout(Duration::from_millis(100), changes.changed()).await;
    };
    bar.finish_and_clear();
    let Resolution::Local {
        local_path: Some(local_path),
        ..
    } = &resolution
    else {
        bail!("unreachable: not a local replica");
    };
    let replica = PathBuf::from(local_path);

    // 4. Byte-for-byte comparison and the resolve answer over HTTP.
    let (c1, c2) = (ckpt.clone(), replica.clone());
    let verified = tokio::task::spawn_blocking(move || compare_trees(&c1, &c2)).await??;
    let resolve: serde_json::Value = http
        .get(format!("http://{}/v1/resolve", sink_agent.api_addr))
        .query(&[("path", source_path.as_str())])
        .send()
        .await?
        .json()
        .await?;
    let link_stats = link_up.stats();

    let bytes = summary.bytes;
    let wall_s = wall.as_secs_f64();
    let goodput = bytes as f64 * 8.0 / wall_s;
    let limit_s = physical_limit_s(bytes, a.rate, a.rtt);
    say(format!(
        "\npush phase: replicated {} shards, {} bytes in {:.2} s\n  goodput      {}\n  utilisation  {:.3} of the {} link\n  physical limit {:.2} s (wall time is {:.3} x the limit)\n  replica      {}\n  verified     {}\n  resolve      {}",
        summary.shards,
        bytes,
        wall_s,
        format_rate(goodput as u64),
        goodput / a.rate as f64,
        format_rate(a.rate),
        limit_s,
        wall_s / limit_s,
        local_path,
        if verified { "byte for byte identical to the source" } else { "DIFFERS from the source" },
        resolve
    ));

    // 5. A training job writes the next checkpoint (DCP, 4 ranks, at the
    //    write rate) while the watcher replicates it.
    let watch = if a.no_watch {
        None
    } else {
        let opts = ferry_gen::format::SaveOptions {
            step: 2000,
            seed: 2,
            write_rate_bps: Some(write_rate),
            ..ferry_gen::format::SaveOptions::new(
                &src_root,
                ferry_gen::format::GenFormat::Dcp,
                a.size,
            )
        };
        say(format!(
            "\nphase 2: a training job writes a DCP checkpoint ({} bytes, 4 ranks) at {}; the watcher replicates it ({})",
            a.size,
            format_rate(write_rate),
            a.start
        ));
        let bar = indicatif::ProgressBar::new(a.size);
        bar.set_style(indicatif::ProgressStyle::with_template(
            "writing checkpoint {bar:40} {bytes}/{total_bytes} {bytes_per_sec}",
        )?);
        if a.json {
            bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
        }
        let b2 = bar.clone();
        let saved = tokio::task::spawn_blocking(move || {
            ferry_gen::format::save(&opts, &|n| b2.set_position(n))
        })
        .await??;
        bar.finish_and_clear();
        let path = saved.dir.to_string_lossy().into_owned();
        let deadline = Instant::now() + Duration::from_secs_f64(MAX_DEMO_S + 60.0);
        let bar = indicatif::ProgressBar::new(saved.bytes);
        bar.set_style(indicatif::ProgressStyle::with_template(
            "committed; replicating the rest {bar:40} {bytes}/{total_bytes}",
        )?);
        if a.json {
            bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
        }
        let local = loop {
            match sink.resolve(&path).await? {
                Resolution::Local {
                    local_path: Some(local_path),
                    ..
                } => break PathBuf::from(local_path),
                Resolution::Local { url, .. } => {
                    bail!("the demo's sink is local, but resolve answered {url:?}")
                }
                Resolution::Replicating { bytes_done, .. } => bar.set_position(bytes_done),
                Resolution::Remote { reason } => {
                    bail!("phase 2 transfer failed: {}", reason.unwrap_or_default())
                }
                Resolution::Unknown => {}
            }
            if Instant::now() > deadline {
                bail!("phase 2: no replica after {:.0} s", MAX_DEMO_S + 60.0);
            }
            let _ = tokio::time::timeout(Duration::from_millis(50), changes.changed()).await;
        };
        bar.finish_and_clear();
        let row = sink
            .catalog()
            .replicas_for_source(&path)
            .await?
            .into_iter()
            .find(|r| r.state == TransferState::Published)
            .context("phase 2: the published replica has no catalog row")?;
        let (c1, c2) = (saved.dir.clone(), local.clone());
        let same = tokio::task::spawn_blocking(move || compare_trees(&c1, &c2)).await??;
        let write_s = saved
            .committed_at
            .and_then(|c| c.duration_since(saved.opened_at).ok())
            .map_or(0.0, |d| d.as_secs_f64());
        let commit_lag = row.commit_to_replica_s.unwrap_or(f64::NAN);
        let open_lag = row.open_to_replica_s.unwrap_or(f64::NAN);
        let phases = row.phases.clone().unwrap_or_default();
        say(format!(
            "  written in {write_s:.2} s; replica published {commit_lag:.3} s after the commit ({open_lag:.2} s after the checkpoint opened)\n  after the commit: {}\n  target with start = on_open: commit-to-replica <= 2 RTT + 1 s = {:.2} s\n  replica      {}\n  verified     {}",
            phase_line(&phases),
            2.0 * a.rtt.as_secs_f64() + 1.0,
            local.display(),
            if same { "byte for byte identical to the source" } else { "DIFFERS from the source" },
        ));
        Some((saved, write_s, commit_lag, open_lag, same, local, phases))
    };
    if a.keep_running {
        keep::run(keep::Running {
            args: &a,
            source_url: src_agent.api_url.clone(),
            sink_url: sink_agent.api_url.clone(),
            sink: sink.clone(),
            source: src_agent.source.clone().context("source role")?,
            checkpoints: std::fs::canonicalize(&src_root)?,
            datasets: std::fs::canonicalize(&datasets)?,
            write_rate,
            last_step: if a.no_watch { 1000 } else { 2000 },
        })
        .await?;
    }
    src_agent.stop(Duration::from_secs(5)).await;
    sink_agent.stop(Duration::from_secs(5)).await;

    let mut out = serde_json::json!({
        "shards": summary.shards,
        "bytes": bytes,
        "wall_s": round3(wall_s),
        "goodput_bps": goodput.round(),
        "link_rate_bps": a.rate,
        "rtt_ms": a.rtt.as_secs_f64() * 1000.0,
        "loss": a.loss,
        "utilisation": round3(goodput / a.rate as f64),
        "limit_s": round3(limit_s),
        "wall_over_limit": round3(wall_s / limit_s),
        "replica_path": local_path,
        "link_datagrams": link_stats.delivered_packets,
        "link_drops_queue": link_stats.dropped_queue,
        "link_drops_loss": link_stats.dropped_loss,
        "verified": verified,
        "resolve": resolve,
    });
    let watch_ok = watch.as_ref().is_none_or(|w| w.4);
    if let Some((saved, write_s, commit_lag, open_lag, same, local, phases)) = &watch {
        out["commit_to_replica_s"] = serde_json::json!(round3(*commit_lag));
        out["open_to_replica_s"] = serde_json::json!(round3(*open_lag));
        out["watch"] = serde_json::json!({
            "format": "dcp",
            "start": a.start,
            "bytes": saved.bytes,
            "files": saved.files,
            "write_rate_bps": write_rate,
            "write_s": round3(*write_s),
            "commit_to_replica_s": round3(*commit_lag),
            "open_to_replica_s": round3(*open_lag),
            "target_s": round3(2.0 * a.rtt.as_secs_f64() + 1.0),
            "replica_path": local,
            "verified": same,
            "phases_after_commit_s": phases
                .after
                .iter()
                .map(|(p, d)| (p.as_str().to_string(), serde_json::json!(round3(d.as_secs_f64()))))
                .collect::<serde_json::Map<_, _>>(),
        });
    }
    if a.keep || a.dir.is_some() {
        say(format!("work directory kept: {}", dir.display()));
    } else {
        say("the work directory is removed now; --keep keeps it".to_string());
    }
    if a.json {
        noteln!("{out}");
    }
    if a.keep {
        if let Some(t) = tmp {
            let _ = t.keep();
        }
    }
    if !verified || !watch_ok {
        bail!("a replica differs from its source");
    }
    Ok(())
}

/// Two agents in this process joined by an emulated link.
pub(crate) struct DemoPair {
    /// The source agent (link `to-eval`).
    pub source: agent::Agent,
    /// The sink agent.
    pub sink: agent::Agent,
    /// The source's end of the link (its statistics).
    pub link: std::sync::Arc<ferry_linkemu::MemorySocket>,
}

/// Starts a sink and a source (certificates from `dir/certs`, data dirs
/// under `data`) joined by a fresh emulated link of `a`'s rate, RTT and
/// loss; the source follows `roots` (rescanning every `scan`, 0 = no
/// watcher) and schedules with `scheduler`.
pub(crate) async fn start_pair(
    dir: &Path,
    data: &Path,
    a: &DemoArgs,
    roots: Vec<RootSection>,
    scan: Duration,
    scheduler: crate::config::SchedulerSection,
) -> Result<DemoPair> {
    let src_addr: SocketAddr = "127.0.0.1:1".parse()?;
    let dst_addr: SocketAddr = "127.0.0.1:2".parse()?;
    let mut up = LinkParams::new(a.rate, a.rtt);
    up.loss = a.loss;
    up.seed = 1;
    let mut down = up.clone();
    down.seed = 2;
    let (src_sock, dst_sock) = memory_pair(src_addr, dst_addr, up, down);
    let link = src_sock.clone();

    let loopback: SocketAddr = "127.0.0.1:0".parse()?;
    let mut sink_cfg = agent_config(dir, "demo-sink", Role::Sink, loopback);
    sink_cfg.agent.data_dir = data.join("demo-sink-data");
    sink_cfg.quic.max_link_rate = a.rate;
    sink_cfg.quic.max_rtt = a.rtt;
    sink_cfg.sink = Some(SinkSection {
        root: data.join("eval"),
        capacity: None,
        s3: None,
        hdfs: None,
        accept_peers: vec!["demo-source".into()],
        reserve: 0,
        reread_before_publish: true,
        retention: Vec::new(),
        retention_interval: std::time::Duration::from_secs(60),
        min_free: None,
        target_free: None,
        webhooks: Vec::new(),
    });
    let mut src_cfg = agent_config(dir, "demo-source", Role::Source, loopback);
    src_cfg.agent.data_dir = data.join("demo-source-data");
    src_cfg.links.push(LinkSection {
        name: "to-eval".into(),
        peer: dst_addr.to_string(),
        peer_name: "demo-sink".into(),
        more_peers: Vec::new(),
        rate: a.rate,
        rtt_hint: a.rtt,
        connections: None,
    });
    src_cfg.scheduler = scheduler;
    src_cfg.source = Some(SourceSection {
        s3: None,
        chunk_size: 4 << 20,
        markers: vec!["COMMITTED".into()],
        streams: 4,
        batch_size: 16 << 20,
        scan_interval: scan,
        quiet_period: Duration::from_secs(2),
        checkpoint_idle_timeout: Duration::from_secs(600),
        pin_on: Vec::new(),
        pin_for: Duration::from_secs(7 * 86_400),
        roots,
    });
    sink_cfg.check()?;
    src_cfg.check()?;
    let sink = agent::start(
        &sink_cfg,
        Overrides {
            socket: Some(dst_sock),
            sockets: None,
            catalog_url_env: None,
        },
    )
    .await?;
    // Further connections of the link: more source-side ends of the same
    // emulated link (one bottleneck), on 127.0.0.1:10, :11, ...
    let (first, next) = (src_sock.clone(), std::sync::atomic::AtomicU16::new(10));
    let sockets = SocketFactory::Custom(std::sync::Arc::new(move || {
        let port = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let s: std::sync::Arc<dyn quinn::AsyncUdpSocket> =
            first.sibling(SocketAddr::from(([127, 0, 0, 1], port)))?;
        Ok(s)
    }));
    let source = agent::start(
        &src_cfg,
        Overrides {
            socket: Some(src_sock),
            sockets: Some(sockets),
            catalog_url_env: None,
        },
    )
    .await?;
    Ok(DemoPair { source, sink, link })
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

/// True if both trees hold the same regular files with the same bytes.
fn compare_trees(a: &Path, b: &Path) -> Result<bool> {
    let opts = replicator::storage::posix::scan::ScanOptions::default();
    let sa = replicator::storage::posix::scan::scan(a, &opts)?;
    let sb = replicator::storage::posix::scan::scan(b, &opts)?;
    let mut pa: Vec<_> = sa.files.iter().map(|f| (&f.path, f.size)).collect();
    let mut pb: Vec<_> = sb.files.iter().map(|f| (&f.path, f.size)).collect();
    pa.sort();
    pb.sort();
    if pa != pb {
        return Ok(false);
    }
    let mut ba = vec![0u8; 1 << 20];
    let mut bb = vec![0u8; 1 << 20];
    for (p, _) in pa {
        let mut fa = std::fs::File::open(a.join(p))?;
        let mut fb = std::fs::File::open(b.join(p))?;
        loop {
            let n = fa.read(&mut ba)?;
            if n == 0 {
                if fb.read(&mut bb[..1])? != 0 {
                    return Ok(false);
                }
                break;
            }
            fb.read_exact(&mut bb[..n])?;
            if ba[..n] != bb[..n] {
                return Ok(false);
            }
        }
    }
    Ok(true)
}

/// The phases after a commit, in the order a checkpoint passes them:
/// `waiting_for_writer 1.02 s, sending 0.31 s, ...`.
pub(crate) fn phase_line(p: &ferry_proto::phases::Phases) -> String {
    if p.after.is_empty() {
        return "phases not recorded".into();
    }
    p.after
        .iter()
        .map(|(k, d)| format!("{} {:.2} s", k.as_str().replace('_', " "), d.as_secs_f64()))
        .collect::<Vec<_>>()
        .join(", ")
}
