//! `ferry-bench`: the benchmark harness behind `ops/bench/run`.
//!
//! It brings the emulated WAN up (`ops/wanem/netns`: namespaces `ferry-src`
//! and `ferry-dst` joined by the TUN emulator), checks the emulator (ping
//! RTT, iperf3 TCP), generates checkpoints with `ferry gen`, and copies them
//! with Ferry (two agents, `POST /v1/transfers`), rsync in daemon mode,
//! rclone (`copy` from `rclone serve http`, 16 transfers) and per-file
//! sequential fetch (curl, one request per shard over one kept-alive
//! connection), verifying every copy byte for byte. Results go to stdout,
//! `ops/bench/RESULTS.md` (the generated section) and
//! `ops/bench/results/latest.json`, plus `results/rtt.svg`.
//!
//! Needs root and the tools `ops/bench/run` installs. Every step is bounded
//! by a time cap; the namespaces are torn down whatever happens.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::Parser;
use ferry_bench::{compare_trees, fill_ratios, list_tree, parse_snmp, LossCounters, Record};
use serde_json::{json, Value};

const SRC_NS: &str = "ferry-src";
const DST_NS: &str = "ferry-dst";
/// Source side of the emulated link.
const SRC_ADDR: &str = "10.47.0.1";
/// Sink side of the emulated link.
const DST_ADDR: &str = "10.47.0.2";
/// The management veth addresses of the namespaces (ops/wanem/netns).
const SRC_MGMT: &str = "10.48.1.2";
const DST_MGMT: &str = "10.48.2.2";
const JOB: &str = "bench";
const RSYNC_PORT: u16 = 8730;
const HTTP_PORT: u16 = 8080;
/// Shards fetched one by one in the per-file run; the rest is projected.
const PER_FILE_SUBSET: usize = 300;

#[derive(Parser, Debug)]
#[command(
    about = "Ferry against rsync, rclone and per-file fetch on one emulated WAN link (run through ops/bench/run).",
    long_about = "Ferry against rsync, rclone and per-file fetch on one emulated WAN link. \
                  Scenarios: throughput, rtt, loss, coexist, scale, cpu, priority, lag, \
                  hdfs-source (not in a full run: ops/bench/hdfs-source). \
                  Needs root (network namespaces) and rsync, rclone, iperf3, curl, ping; \
                  ops/bench/run installs them and builds the binaries first."
)]
struct Args {
    /// Throughput only, on a ~300 MB checkpoint (under 3 minutes).
    #[arg(long)]
    quick: bool,
    /// Run only these scenarios (comma-separated).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Throughput scenario: only these tools (comma-separated: ferry, rsync,
    /// rclone, per-file).
    #[arg(long, value_delimiter = ',')]
    tools: Vec<String>,
    /// Link rate cap (each direction).
    #[arg(long, default_value = "1Gbit/s", value_parser = ferry_proto::units::parse_rate)]
    rate: u64,
    /// Round-trip time of the throughput scenario.
    #[arg(long, default_value = "100ms", value_parser = humantime::parse_duration)]
    rtt: Duration,
    /// Checkpoint size of the throughput scenario (default 1.4GB, 300MB with --quick).
    #[arg(long, value_parser = ferry_proto::units::parse_size)]
    size: Option<u64>,
    /// Shards of the scale scenario's checkpoint (its size is 4 KiB each).
    #[arg(long, default_value_t = 100_000)]
    scale_shards: u64,
    /// Scale scenario: submissions of the 1,000 queued transfers in flight
    /// at once (`POST /v1/transfers` from that many threads), as a burst
    /// of jobs arrives; 1 submits them one after another.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=1000))]
    scale_submitters: u32,
    /// Work directory (checkpoints, copies, agent data); emptied at the start
    /// if it is empty or was made by ferry-bench (refused otherwise).
    #[arg(long, default_value = "/var/tmp/ferry-bench")]
    work: PathBuf,
    /// Where RESULTS.md and results/ are written.
    #[arg(long, default_value = "ops/bench")]
    out: PathBuf,
    /// Directory holding the release binaries (ferry, wanem, quinn-bare).
    #[arg(long, default_value = "target/release")]
    bin: PathBuf,
    /// cpu scenario: runs of each tool (quinn-bare and Ferry alternating);
    /// medians and ranges are reported.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=50))]
    cpu_runs: u32,
    /// QUIC connections per link, forced: `connections = N` in the
    /// source's `[[links]]` of every scenario, and `quinn-bare
    /// --connections N` in the cpu scenario. Default: Ferry's own default
    /// for the link's rate on this host (one per 2 Gbit/s, at most one per
    /// core), and the same count for quinn-bare.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    connections: Option<u32>,
    /// hdfs-source scenario: rounds, each a copy from the POSIX root and
    /// one from the HDFS root, alternating; medians are reported.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=20))]
    hdfs_runs: u32,
}

const ALL: [&str; 10] = [
    "throughput",
    "rtt",
    "loss",
    "coexist",
    "scale",
    "cpu",
    "priority",
    "lag",
    "hdfs-source",
    "pool",
];

/// Scenarios a run without `--only` leaves out (they need more than the
/// harness installs: hdfs-source needs Java, Maven and ops/bench/hdfs-source;
/// pool needs Debian's postgresql package).
const ONLY_WHEN_ASKED: [&str; 2] = ["hdfs-source", "pool"];

fn main() {
    if let Err(e) = run() {
        eprintln!("ferry-bench: error: {e:#}");
        std::process::exit(1);
    }
}

/// Everything a scenario needs to know.
struct Bench {
    args: Args,
    repo: PathBuf,
    work: PathBuf,
    ferry: PathBuf,
    records: Vec<Record>,
    started: Instant,
}

fn say(msg: impl AsRef<str>) {
    eprintln!("[bench] {}", msg.as_ref());
}

fn run() -> Result<()> {
    let args = Args::parse();
    handle_signals()?;
    if args.rtt < Duration::from_millis(1) {
        bail!("--rtt must be at least 1ms");
    }
    if !nix::unistd::geteuid().is_root() {
        bail!("needs root (it creates network namespaces); run ops/bench/run as root");
    }
    for t in &args.tools {
        if !["ferry", "rsync", "rclone", "per-file"].contains(&t.as_str()) {
            bail!("--tools {t:?}: unknown tool (known: ferry, rsync, rclone, per-file)");
        }
    }
    for s in &args.only {
        if !ALL.contains(&s.as_str()) {
            bail!("--only {s:?}: unknown scenario (known: {})", ALL.join(", "));
        }
    }
    let repo = std::env::current_dir()?;
    let ferry = repo.join(&args.bin).join("ferry");
    for b in ["ferry", "wanem", "quinn-bare"] {
        let p = repo.join(&args.bin).join(b);
        if !p.exists() {
            bail!("{} not built; run: cargo build --release", p.display());
        }
    }
    for tool in ["rsync", "rclone", "iperf3", "curl", "ping", "ip"] {
        if which(tool).is_none() {
            bail!("{tool} not found; ops/bench/run installs it (apt-get install rsync rclone iperf3 curl iputils-ping iproute2)");
        }
    }
    let work = args.work.clone();
    prepare_work(&work)?;
    let mut b = Bench {
        args,
        repo,
        work,
        ferry,
        records: Vec::new(),
        started: Instant::now(),
    };
    let wanted = |s: &str, b: &Bench| {
        if b.args.only.is_empty() {
            (!b.args.quick || s == "throughput") && !ONLY_WHEN_ASKED.contains(&s)
        } else {
            b.args.only.iter().any(|o| o == s)
        }
    };
    let certs = b.work.join("certs");
    cmd_ok(
        Command::new(&b.ferry)
            .args(["certs", "init", "--out"])
            .arg(&certs)
            .args(["--agent", "train-a-1", "--agent", "eval-b-1"]),
        "ferry certs init",
    )?;
    let size = b.args.size.unwrap_or(if b.args.quick {
        300_000_000
    } else {
        1_400_000_000
    });
    let needs_main = ["throughput", "rtt", "coexist", "cpu", "hdfs-source"]
        .iter()
        .any(|sc| wanted(sc, &b));
    let main_ckpt = if needs_main {
        b.gen("throughput", &["--size", &size.to_string()])?
    } else {
        Ckpt {
            name: String::new(),
            dir: PathBuf::new(),
            bytes: 0,
            files: 0,
        }
    };

    if wanted("throughput", &b) {
        scenario_throughput(&mut b, &main_ckpt)?;
    }
    if wanted("rtt", &b) {
        scenario_rtt(&mut b, &main_ckpt)?;
    }
    if wanted("loss", &b) {
        scenario_loss(&mut b)?;
    }
    if wanted("coexist", &b) {
        scenario_coexist(&mut b, &main_ckpt)?;
    }
    if wanted("scale", &b) {
        scenario_scale(&mut b)?;
    }
    if wanted("cpu", &b) {
        scenario_cpu(&mut b, &main_ckpt)?;
    }
    if wanted("priority", &b) {
        scenario_priority(&mut b)?;
    }
    if wanted("lag", &b) {
        scenario_lag(&mut b)?;
    }
    if wanted("hdfs-source", &b) {
        scenario_hdfs_source(&mut b, &main_ckpt)?;
    }
    if wanted("pool", &b) {
        scenario_pool(&mut b)?;
    }
    fill_ratios(&mut b.records);
    report::write(&b)?;
    say(format!(
        "done in {:.0} s",
        b.started.elapsed().as_secs_f64()
    ));
    Ok(())
}

/// File marking a directory as ferry-bench's own work directory.
const WORK_MARKER: &str = ".ferry-bench-work";

/// Empties `work` for a new run, but only if it is missing, empty or marked
/// as ours: a mistyped `--work` must not delete someone's data.
fn prepare_work(work: &Path) -> Result<()> {
    if work.exists() {
        let empty = std::fs::read_dir(work)
            .with_context(|| format!("--work {}", work.display()))?
            .next()
            .is_none();
        if !empty && !work.join(WORK_MARKER).exists() {
            bail!(
                "--work {} is not empty and not a ferry-bench work directory (no {WORK_MARKER}); refusing to empty it",
                work.display()
            );
        }
        std::fs::remove_dir_all(work).with_context(|| format!("emptying {}", work.display()))?;
    }
    std::fs::create_dir_all(work.join("logs"))
        .with_context(|| format!("creating {}", work.display()))?;
    std::fs::write(
        work.join(WORK_MARKER),
        b"ferry-bench work directory; emptied by each run\n",
    )?;
    Ok(())
}

fn which(tool: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(tool))
            .find(|p| p.is_file())
    })
}

/// Runs `cmd` to completion; an error carries its stderr.
fn cmd_ok(cmd: &mut Command, what: &str) -> Result<String> {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {what}"))?;
    let pid = child.id();
    register(pid);
    let out = child.wait_with_output();
    unregister(pid);
    let out = out.with_context(|| format!("running {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `ip netns exec NS PROGRAM`.
fn in_ns(ns: &str, program: &str) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns, program]);
    c
}

/// Every child process alive, so a SIGINT/SIGTERM of the harness stops
/// them (the emulator's script then tears the namespaces down).
static CHILDREN: std::sync::Mutex<Vec<u32>> = std::sync::Mutex::new(Vec::new());

fn register(pid: u32) {
    if let Ok(mut c) = CHILDREN.lock() {
        c.push(pid);
    }
}

fn unregister(pid: u32) {
    if let Ok(mut c) = CHILDREN.lock() {
        c.retain(|p| *p != pid);
    }
}

/// Handles SIGINT, SIGTERM and SIGHUP in one thread (signal-hook: a
/// handler and a pipe, no blocked mask for children to inherit): SIGTERM to
/// every child, a wait for their teardown, exit.
fn handle_signals() -> Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])
        .context("signal handlers")?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            let Some(sig) = signals.forever().next() else {
                return;
            };
            say(format!(
                "signal {sig}: stopping every child and tearing the link down"
            ));
            let pids = CHILDREN.lock().map(|c| c.clone()).unwrap_or_default();
            for pid in &pids {
                if let Ok(p) = i32::try_from(*pid) {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(p),
                        nix::sys::signal::Signal::SIGTERM,
                    );
                }
            }
            // The netns script removes the namespaces within a few seconds.
            let end = Instant::now() + Duration::from_secs(15);
            while Instant::now() < end
                && pids
                    .iter()
                    .any(|p| Path::new(&format!("/proc/{p}")).exists() && !zombie(*p))
            {
                std::thread::sleep(Duration::from_millis(100));
            }
            std::process::exit(128 + sig);
        })
        .context("starting the signal thread")?;
    Ok(())
}

/// Whether process `pid` has exited but not been reaped.
fn zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, r)| r.trim_start().starts_with('Z'))
        })
        .unwrap_or(true)
}

/// A child that is killed and reaped when dropped.
struct Guard(Option<Child>);

impl Guard {
    /// Takes ownership of a spawned child (registered for signal cleanup).
    fn new(c: Child) -> Guard {
        register(c.id());
        Guard(Some(c))
    }
}

impl Guard {
    fn pid(&self) -> Option<u32> {
        self.0.as_ref().map(Child::id)
    }
    /// SIGTERM, then SIGKILL after `grace`.
    fn stop(&mut self, grace: Duration) {
        if let Some(mut c) = self.0.take() {
            unregister(c.id());
            if let Ok(pid) = i32::try_from(c.id()) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGTERM,
                );
            }
            let end = Instant::now() + grace;
            while Instant::now() < end {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(5));
    }
}

/// Runs `cmd` with a time cap; returns (wall seconds, finished, stderr tail).
fn timed(cmd: &mut Command, cap: Duration, log: &Path) -> Result<(f64, bool, Option<i32>)> {
    let logf = std::fs::File::create(log)?;
    let t0 = Instant::now();
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(logf)
        .spawn()
        .context("starting a copy")?;
    let pid = child.id();
    register(pid);
    let result = wait_capped(&mut child, t0, cap);
    unregister(pid);
    result
}

fn wait_capped(child: &mut Child, t0: Instant, cap: Duration) -> Result<(f64, bool, Option<i32>)> {
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok((t0.elapsed().as_secs_f64(), true, status.code()));
        }
        if t0.elapsed() > cap {
            let _ = child.kill();
            let _ = child.wait();
            return Ok((t0.elapsed().as_secs_f64(), false, None));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The emulated link (ops/wanem/netns in the foreground).
struct Link {
    proc_: Guard,
    _stdout: BufReader<ChildStdout>,
    stats: PathBuf,
    rate: u64,
    rtt: Duration,
    loss: f64,
}

/// Counter snapshot of the link and both namespaces.
struct Snap {
    emu: Value,
    snmp_src: BTreeMap<String, i64>,
    snmp_dst: BTreeMap<String, i64>,
}

impl Link {
    fn up(b: &Bench, rtt: Duration, loss: f64) -> Result<Link> {
        let rate = b.args.rate;
        let stats = b.work.join("wanem-stats.json");
        let _ = std::fs::remove_file(&stats);
        say(format!(
            "link up: {} bit/s, RTT {} ms, loss {loss}",
            rate,
            rtt.as_millis()
        ));
        let mut child = Command::new(b.repo.join("ops/wanem/netns"))
            .arg("--rtt")
            .arg(format!("{}us", rtt.as_micros()))
            .args(["--rate", &rate.to_string(), "--loss", &loss.to_string()])
            .arg("--stats")
            .arg(&stats)
            .env("WANEM", b.repo.join(&b.args.bin).join("wanem"))
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(b.work.join("logs/netns.log"))?)
            .spawn()
            .context("starting ops/wanem/netns")?;
        let out = child.stdout.take().context("netns stdout")?;
        let mut guard = Guard::new(child);
        let mut reader = BufReader::new(out);
        let mut line = String::new();
        loop {
            line.clear();
            if reader.read_line(&mut line)? == 0 {
                guard.stop(Duration::from_secs(5));
                let log =
                    std::fs::read_to_string(b.work.join("logs/netns.log")).unwrap_or_default();
                bail!("ops/wanem/netns exited before the link was up: {log}");
            }
            if line.starts_with("wanem: ready") {
                break;
            }
        }
        // The stats file appears within 200 ms.
        for _ in 0..50 {
            if stats.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Link {
            proc_: guard,
            _stdout: reader,
            stats,
            rate,
            rtt,
            loss,
        })
    }

    fn rtt_ms(&self) -> f64 {
        self.rtt.as_secs_f64() * 1000.0
    }

    fn snap(&self) -> Result<Snap> {
        let emu: Value = serde_json::from_slice(&std::fs::read(&self.stats)?)?;
        let snmp = |ns: &str| -> Result<BTreeMap<String, i64>> {
            Ok(parse_snmp(&cmd_ok(
                in_ns(ns, "cat").arg("/proc/net/snmp"),
                "reading /proc/net/snmp",
            )?))
        };
        Ok(Snap {
            emu,
            snmp_src: snmp(SRC_NS)?,
            snmp_dst: snmp(DST_NS)?,
        })
    }

    /// Counters between two snapshots (the stats file lags by up to 200 ms).
    fn counters(a: &Snap, b: &Snap) -> LossCounters {
        let emu = |s: &Snap, dir: &str, k: &str| s.emu[dir][k].as_u64().unwrap_or(0);
        let d = |dir: &str, k: &str| emu(b, dir, k).saturating_sub(emu(a, dir, k));
        let n = |a: &BTreeMap<String, i64>, b: &BTreeMap<String, i64>, k: &str| {
            b.get(k).copied().unwrap_or(0) - a.get(k).copied().unwrap_or(0)
        };
        LossCounters {
            emulator_tail_drops_fwd: d("a_to_b", "dropped_queue"),
            emulator_tail_drops_rev: d("b_to_a", "dropped_queue"),
            emulator_random_drops: d("a_to_b", "dropped_loss") + d("b_to_a", "dropped_loss"),
            udp_rcvbuf_errors_src: n(&a.snmp_src, &b.snmp_src, "Udp.RcvbufErrors"),
            udp_rcvbuf_errors_dst: n(&a.snmp_dst, &b.snmp_dst, "Udp.RcvbufErrors"),
            tcp_retrans_src: n(&a.snmp_src, &b.snmp_src, "Tcp.RetransSegs"),
            tcp_retrans_dst: n(&a.snmp_dst, &b.snmp_dst, "Tcp.RetransSegs"),
        }
    }

    /// Delivered bytes source to sink so far: (tcp, udp).
    fn forward_bytes(&self) -> Result<(u64, u64)> {
        let emu: Value = serde_json::from_slice(&std::fs::read(&self.stats)?)?;
        Ok((
            emu["a_to_b"]["delivered_tcp_bytes"].as_u64().unwrap_or(0),
            emu["a_to_b"]["delivered_udp_bytes"].as_u64().unwrap_or(0),
        ))
    }

    /// CPU seconds the emulator process has used so far.
    fn cpu_s(&self) -> f64 {
        std::fs::read(&self.stats)
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            .and_then(|v| v["pid"].as_u64())
            .map_or(0.0, |pid| agents::proc_cpu_s(pid as u32))
    }

    fn down(mut self) {
        self.proc_.stop(Duration::from_secs(10));
    }
}

/// A checkpoint under the source root: its directory and size.
#[derive(Clone)]
struct Ckpt {
    name: String,
    dir: PathBuf,
    bytes: u64,
    files: u64,
}

impl Bench {
    fn src_root(&self) -> PathBuf {
        self.work.join("src")
    }

    /// `ferry gen` a checkpoint named `name` under the source root.
    fn gen(&self, name: &str, extra: &[&str]) -> Result<Ckpt> {
        let dir = self.src_root().join(name);
        say(format!(
            "generating checkpoint {name} ({})",
            extra.join(" ")
        ));
        cmd_ok(
            Command::new(&self.ferry)
                .args(["gen", "--out"])
                .arg(&dir)
                .args(extra),
            "ferry gen",
        )?;
        Ckpt::read(name, dir)
    }

    fn log(&self, name: &str) -> PathBuf {
        self.work.join("logs").join(name)
    }

    /// A fresh, empty destination directory.
    fn dest(&self, name: &str) -> Result<PathBuf> {
        let d = self.work.join("dst").join(name);
        if d.exists() {
            std::fs::remove_dir_all(&d)?;
        }
        std::fs::create_dir_all(&d)?;
        Ok(d)
    }

    /// Drops a copy and flushes it, so the next tool starts on a clean disk.
    fn discard(&self, path: &Path) {
        let _ = std::fs::remove_dir_all(path);
        nix::unistd::sync();
    }
}

impl Ckpt {
    fn read(name: &str, dir: PathBuf) -> Result<Ckpt> {
        let files = list_tree(&dir)?;
        Ok(Ckpt {
            name: name.into(),
            bytes: files.iter().map(|f| f.len).sum(),
            files: files.len() as u64,
            dir,
        })
    }
}

mod agents;
mod report;
mod scenarios;

use scenarios::*;
