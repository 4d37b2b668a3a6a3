//! The scenarios of ops/bench/run (issue text and ARCHITECTURE.md
//! "Measures" define each number).

use ferry_proto::state::TransferState;

use super::agents::{proc_cpu_s, wait_port, Agents, Placement};
use super::*;

/// Longest copy of the throughput and rtt scenarios (seconds).
const COPY_CAP: Duration = Duration::from_secs(300);
/// Cap per tool under 1 % loss (seconds).
const LOSS_CAP: Duration = Duration::from_secs(120);
/// RTTs of the sweep (ms).
const RTT_SWEEP_MS: [u64; 4] = [10, 50, 100, 200];
/// The coexistence window (seconds).
const COEXIST_S: u64 = 30;

/// The servers the baselines copy from, in the source namespace.
struct Servers {
    rsync: Option<Guard>,
    http: Option<Guard>,
    /// A MiniDFSCluster in the source namespace and the URL of the HDFS
    /// source root holding the checkpoint (`hdfs://127.0.0.1:PORT/ckpt`).
    hdfs: Option<(Guard, String)>,
}

impl Servers {
    fn none() -> Servers {
        Servers {
            rsync: None,
            http: None,
            hdfs: None,
        }
    }

    /// Starts a MiniDFSCluster in the source namespace (class path from
    /// `FERRY_BENCH_MINIDFS_CP`, set by ops/bench/hdfs-source) and copies
    /// `ck` into it with Hadoop's own `FsShell -put -t 16` (the copy is
    /// not timed; `ferry gen --out hdfs://` writes one file after another
    /// and `hdfs-native` waits 500 ms in most closes, about 25 minutes for
    /// 2,881 files). The replica is compared with the POSIX copy. The
    /// cluster stops when the guard drops (SIGTERM).
    fn hdfs(&mut self, b: &Bench, ck: &Ckpt) -> Result<()> {
        if self.hdfs.is_some() {
            return Ok(());
        }
        let cp = std::env::var("FERRY_BENCH_MINIDFS_CP").map_err(|_| {
            anyhow!("FERRY_BENCH_MINIDFS_CP is not set: run the hdfs-source scenario through ops/bench/hdfs-source")
        })?;
        let base = b.work.join("minidfs");
        if base.exists() {
            std::fs::remove_dir_all(&base)?;
        }
        std::fs::create_dir_all(&base)?;
        let log = b.log("minidfs.log");
        say("hdfs-source: starting a MiniDFSCluster in the source namespace");
        let mut child = in_ns(SRC_NS, "java")
            .arg("-cp")
            .arg(&cp)
            .arg("ferry.MiniDfs")
            .arg(&base)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .context("starting java (the MiniDFSCluster)")?;
        let out = child
            .stdout
            .take()
            .context("no stdout of the MiniDFSCluster")?;
        let guard = Guard::new(child);
        // Its one line, the NameNode's URL, once the cluster is up.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(out).read_line(&mut line);
            let _ = tx.send(line);
        });
        let url = rx
            .recv_timeout(Duration::from_secs(300))
            .ok()
            .map(|l| l.trim().to_string())
            .filter(|l| l.starts_with("hdfs://"))
            .with_context(|| {
                format!(
                    "the MiniDFSCluster did not print its URL within 300 s; see {}",
                    log.display()
                )
            })?;
        let root = format!("{url}/ckpt");
        say(format!(
            "hdfs-source: {url} up; copying {} into {root} (FsShell -put -t 16)",
            ck.name
        ));
        // FsShell reads its client configuration from the class path;
        // empty files keep Hadoop's defaults.
        let conf = b.work.join("minidfs-conf");
        std::fs::create_dir_all(&conf)?;
        for f in ["core-site.xml", "hdfs-site.xml"] {
            std::fs::write(conf.join(f), "<?xml version=\"1.0\"?>\n<configuration/>\n")?;
        }
        let t0 = Instant::now();
        let shell = |args: &[&str]| {
            let mut c = in_ns(SRC_NS, "java");
            c.arg("-cp")
                .arg(format!("{}:{cp}", conf.display()))
                .args(["org.apache.hadoop.fs.FsShell", "-fs", &url])
                .args(args);
            c
        };
        cmd_ok(&mut shell(&["-mkdir", "-p", "/ckpt"]), "hdfs dfs -mkdir")?;
        cmd_ok(
            &mut shell(&[
                "-put",
                "-t",
                "16",
                &ck.dir.to_string_lossy(),
                &format!("/ckpt/{}", ck.name),
            ]),
            "hdfs dfs -put",
        )?;
        say(format!(
            "hdfs-source: copied in {:.1} s",
            t0.elapsed().as_secs_f64()
        ));
        self.hdfs = Some((guard, root));
        Ok(())
    }

    fn rsync(&mut self, b: &Bench) -> Result<()> {
        if self.rsync.is_some() {
            return Ok(());
        }
        let conf = b.work.join("rsyncd.conf");
        std::fs::write(
            &conf,
            format!(
                "uid = root\ngid = root\nuse chroot = no\n\n[src]\npath = {}\nread only = yes\n",
                b.src_root().display()
            ),
        )?;
        let child = in_ns(SRC_NS, "rsync")
            .args(["--daemon", "--no-detach"])
            .arg(format!("--config={}", conf.display()))
            .arg(format!("--port={RSYNC_PORT}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(b.log("rsyncd.log"))?)
            .spawn()
            .context("starting rsync --daemon")?;
        self.rsync = Some(Guard::new(child));
        wait_port(&format!("{SRC_MGMT}:{RSYNC_PORT}"), Duration::from_secs(10))
    }

    fn http(&mut self, b: &Bench) -> Result<()> {
        if self.http.is_some() {
            return Ok(());
        }
        let child = in_ns(SRC_NS, "rclone")
            .args(["serve", "http"])
            .arg(b.src_root())
            .args(["--addr", &format!("0.0.0.0:{HTTP_PORT}")])
            .arg("--config")
            .arg(rclone_conf(b)?)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(b.log("rclone-serve.log"))?)
            .spawn()
            .context("starting rclone serve http")?;
        self.http = Some(Guard::new(child));
        wait_port(&format!("{SRC_MGMT}:{HTTP_PORT}"), Duration::from_secs(10))
    }
}

/// An empty rclone config file (rclone warns without one).
fn rclone_conf(b: &Bench) -> Result<PathBuf> {
    let p = b.work.join("rclone.conf");
    if !p.exists() {
        std::fs::write(&p, "")?;
    }
    Ok(p)
}

/// Bytes in a (partial) copy.
fn tree_bytes(dir: &Path) -> u64 {
    list_tree(dir).map_or(0, |fs| fs.iter().map(|f| f.len).sum())
}

/// Copies `ck` with `tool` over `link` and verifies the copy.
fn copy_with(
    b: &mut Bench,
    link: &Link,
    servers: &mut Servers,
    tool: &str,
    ck: &Ckpt,
    scenario: &str,
    cap: Duration,
) -> Result<Record> {
    say(format!(
        "{scenario}: {tool} copies {} ({:.0} MB, {} files) at RTT {} ms",
        ck.name,
        ck.bytes as f64 / 1e6,
        ck.files,
        link.rtt.as_millis()
    ));
    let rate = link.rate;
    let mk = |wall: f64, bytes: u64, files: u64| {
        Record::copy(
            scenario,
            tool,
            bytes,
            files,
            wall,
            rate,
            link.rtt_ms(),
            link.loss,
        )
    };
    let before;
    let mut rec = match tool {
        "ferry" | "ferry-hdfs" => {
            // The source root and the path pushed: the checkpoint's
            // directory, or its URL in the MiniDFSCluster.
            let (root, path) = match (tool, &servers.hdfs) {
                ("ferry", _) => (b.src_root(), ck.dir.clone()),
                (_, Some((_, root))) => (
                    PathBuf::from(root),
                    PathBuf::from(format!("{root}/{}", ck.name)),
                ),
                (_, None) => bail!("ferry-hdfs needs the MiniDFSCluster (Servers::hdfs) first"),
            };
            let agents = Agents::start(b, Placement::Wan, rate, link.rtt, &[root], scenario)?;
            before = link.snap()?;
            // The MiniDFSCluster's JVM (NameNode and DataNode) serves the
            // HDFS source's reads on the same cores.
            let hdfs_cpu = || {
                servers
                    .hdfs
                    .as_ref()
                    .and_then(|(g, _)| g.pid())
                    .map_or(0.0, proc_cpu_s)
            };
            let (cpu0, emu0, jvm0) = (agents.cpu_s(), link.cpu_s(), hdfs_cpu());
            let pushed = agents.push_and_wait(&path, cap)?;
            let (cpu1, emu1, jvm1) = (agents.cpu_s(), link.cpu_s(), hdfs_cpu());
            let mut rec = mk(pushed.wall_s, ck.bytes, ck.files);
            // Where the two cores went during the copy.
            rec.extra = json!({
                "cpu_source_s": cpu1.0 - cpu0.0,
                "cpu_sink_s": cpu1.1 - cpu0.1,
                "cpu_emulator_s": emu1 - emu0,
            });
            if tool == "ferry-hdfs" {
                rec.extra["cpu_hdfs_s"] = json!(jvm1 - jvm0);
            }
            if pushed.state == Some(TransferState::Published) {
                let local = PathBuf::from(
                    pushed.view["local_path"]
                        .as_str()
                        .context("published transfer without local_path")?,
                );
                compare_trees(&ck.dir, &local, None)
                    .with_context(|| format!("ferry's replica of {} differs", ck.name))?;
                rec.verified = true;
            } else {
                rec.finished = false;
                let done = pushed.view["progress"]["bytes_sent"].as_u64().unwrap_or(0);
                rec.extra["state"] = json!(pushed.state);
                rec.extra["bytes_done"] = json!(done);
                rec.extra["error"] = pushed.view["error"].clone();
                agents.cancel(pushed.id).ok();
            }
            let sink_root = agents.sink_root.clone();
            agents.stop();
            b.discard(&sink_root);
            rec
        }
        "rsync" | "rclone" => {
            let dest = b.dest(tool)?;
            let mut cmd;
            if tool == "rsync" {
                servers.rsync(b)?;
                cmd = in_ns(DST_NS, "rsync");
                cmd.arg("-a")
                    .arg(format!("rsync://{SRC_ADDR}:{RSYNC_PORT}/src/{}/", ck.name))
                    .arg(format!("{}/", dest.display()));
            } else {
                servers.http(b)?;
                cmd = in_ns(DST_NS, "rclone");
                cmd.arg("copy")
                    .arg(format!(":http:{}", ck.name))
                    .arg(&dest)
                    .args(["--http-url", &format!("http://{SRC_ADDR}:{HTTP_PORT}/")])
                    .args(["--transfers", "16"])
                    .arg("--config")
                    .arg(rclone_conf(b)?);
            }
            before = link.snap()?;
            let (wall, finished, code) =
                timed(&mut cmd, cap, &b.log(&format!("{scenario}-{tool}.log")))?;
            let mut rec = mk(wall, ck.bytes, ck.files);
            if finished && code == Some(0) {
                compare_trees(&ck.dir, &dest, None)
                    .with_context(|| format!("{tool}'s copy of {} differs", ck.name))?;
                rec.verified = true;
            } else {
                rec.finished = false;
                rec.extra = json!({ "bytes_done": tree_bytes(&dest), "exit_code": code });
            }
            b.discard(&dest);
            rec
        }
        "per-file" => {
            servers.http(b)?;
            let dest = b.dest(tool)?;
            let files = list_tree(&ck.dir)?;
            let step = (files.len() / PER_FILE_SUBSET).max(1);
            let subset: Vec<PathBuf> = files
                .iter()
                .step_by(step)
                .take(PER_FILE_SUBSET)
                .map(|f| f.rel.clone())
                .collect();
            let sub_bytes: u64 = files
                .iter()
                .step_by(step)
                .take(PER_FILE_SUBSET)
                .map(|f| f.len)
                .sum();
            let mut cfg = String::new();
            for rel in &subset {
                let rel_s = rel.to_string_lossy();
                cfg += &format!(
                    "url = \"http://{SRC_ADDR}:{HTTP_PORT}/{}/{rel_s}\"\noutput = \"{}\"\n",
                    ck.name,
                    dest.join(rel).display()
                );
            }
            let cfg_path = b.work.join("per-file.curl");
            std::fs::write(&cfg_path, cfg)?;
            let mut cmd = in_ns(DST_NS, "curl");
            cmd.args([
                "--silent",
                "--show-error",
                "--fail",
                "--create-dirs",
                "--config",
            ])
            .arg(&cfg_path);
            before = link.snap()?;
            let (wall, finished, code) =
                timed(&mut cmd, cap, &b.log(&format!("{scenario}-per-file.log")))?;
            if !(finished && code == Some(0)) {
                bail!(
                    "per-file fetch failed (exit {code:?}); see {}",
                    b.log(&format!("{scenario}-per-file.log")).display()
                );
            }
            let checked =
                compare_trees(&ck.dir, &dest, Some(&subset)).context("per-file copy differs")?;
            // Projection to the whole checkpoint: the subset is every
            // step-th shard in path order, so its sizes follow the whole.
            let projected = wall * files.len() as f64 / subset.len() as f64;
            let mut rec = mk(projected, ck.bytes, ck.files);
            rec.verified = checked.files == subset.len() as u64;
            rec.extra = json!({
                "projected": true,
                "subset_files": subset.len(),
                "subset_bytes": sub_bytes,
                "subset_wall_s": wall,
                "per_file_ms": wall * 1000.0 / subset.len() as f64,
            });
            b.discard(&dest);
            rec
        }
        other => bail!("unknown tool {other}"),
    };
    let after = link.snap()?;
    rec.counters = Link::counters(&before, &after);
    if !rec.finished {
        // Measures of what was done, not of the whole checkpoint.
        let done = rec.extra["bytes_done"].as_u64().unwrap_or(0);
        rec.goodput_bps = done as f64 * 8.0 / rec.wall_s;
        rec.utilisation = ferry_bench::utilisation(done, rec.link_rate_bps, rec.wall_s);
    }
    if tool.starts_with("ferry") {
        say(format!(
            "  CPU during the copy: source {:.2} s, sink {:.2} s, emulator {:.2} s{} (wall {:.2} s, 2 cores)",
            rec.extra["cpu_source_s"].as_f64().unwrap_or(0.0),
            rec.extra["cpu_sink_s"].as_f64().unwrap_or(0.0),
            rec.extra["cpu_emulator_s"].as_f64().unwrap_or(0.0),
            rec.extra["cpu_hdfs_s"]
                .as_f64()
                .map(|s| format!(", MiniDFSCluster {s:.2} s"))
                .unwrap_or_default(),
            rec.wall_s
        ));
    }
    say(format!(
        "  {tool}: {:.2} s{}, {:.0} Mbit/s, utilisation {:.3}, {:.3} x limit{}",
        rec.wall_s,
        if rec.extra["projected"] == json!(true) {
            " (projected)"
        } else {
            ""
        },
        rec.goodput_bps / 1e6,
        rec.utilisation,
        rec.wall_over_limit,
        if rec.finished {
            String::new()
        } else {
            " NOT FINISHED".into()
        }
    ));
    b.records.push(rec.clone());
    Ok(rec)
}

/// An iperf3 server in the sink namespace, listening once this returns.
fn iperf3_server() -> Result<Guard> {
    let server = Guard::new(
        in_ns(DST_NS, "iperf3")
            .arg("-s")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting iperf3 -s")?,
    );
    wait_port(&format!("{DST_MGMT}:5201"), Duration::from_secs(10))?;
    Ok(server)
}

/// Checks the emulator: ping RTT within 5 % of the setting; with `iperf`,
/// a 10 s iperf3 TCP flow within 10 % of the cap.
fn check_emulator(b: &mut Bench, link: &Link, iperf: bool) -> Result<()> {
    let out = cmd_ok(
        in_ns(SRC_NS, "ping").args(["-c", "10", "-i", "0.2", "-q", DST_ADDR]),
        "ping across the emulator",
    )?;
    // rtt min/avg/max/mdev = 100.267/100.383/100.871/0.170 ms
    let avg = out
        .lines()
        .find(|l| l.contains("min/avg/max"))
        .and_then(|l| l.split('=').nth(1))
        .and_then(|v| v.trim().split('/').nth(1))
        .and_then(|v| v.parse::<f64>().ok())
        .context("no RTT in ping's output")?;
    let setting = link.rtt_ms();
    let dev = (avg - setting).abs() / setting.max(1e-9);
    say(format!(
        "emulator: ping RTT {avg:.2} ms for {setting:.0} ms ({:+.1} %)",
        (avg / setting - 1.0) * 100.0
    ));
    let mut rec = Record::copy(
        "emulator",
        "ping",
        0,
        0,
        avg / 1000.0,
        link.rate,
        setting,
        link.loss,
    );
    rec.goodput_bps = 0.0;
    rec.verified = dev <= 0.05;
    rec.extra = json!({ "rtt_avg_ms": avg, "within_5pct": dev <= 0.05 });
    b.records.push(rec);
    if iperf {
        let _server = iperf3_server()?;
        // Goodput over seconds 2-12 of a 12 s flow (after slow start),
        // from the TCP bytes the emulator delivered: iperf3's own interval
        // figures are bursty (application reads) and its --omit summary
        // over-counts.
        let before = link.snap()?;
        let mut client = Guard::new(
            in_ns(SRC_NS, "iperf3")
                .args(["-c", DST_ADDR, "-t", "12", "-J"])
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .context("starting iperf3 -c")?,
        );
        std::thread::sleep(Duration::from_secs(2));
        let (tcp0, _) = link.forward_bytes()?;
        let t0 = Instant::now();
        std::thread::sleep(Duration::from_secs(10));
        let (tcp1, _) = link.forward_bytes()?;
        let window = t0.elapsed().as_secs_f64();
        let child = client.0.take().context("iperf3 client")?;
        unregister(child.id());
        let out = child.wait_with_output().context("iperf3 -c")?;
        let after = link.snap()?;
        let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        let iperf_bps = v["end"]["sum_received"]["bits_per_second"].as_f64();
        // IP bytes to TCP payload: 1448 of every 1500 (timestamps on).
        let ip_bps = (tcp1 - tcp0) as f64 * 8.0 / window;
        let bps = ip_bps * ferry_bench::PAYLOAD_PER_PACKET / ferry_bench::PACKET;
        let secs = window;
        let ratio = bps / link.rate as f64;
        say(format!(
            "emulator: iperf3 TCP {:.0} Mbit/s goodput after slow start = {:.3} of the cap (IP {:.3} of the cap; iperf3's whole-run figure {} Mbit/s)",
            bps / 1e6,
            ratio,
            ip_bps / link.rate as f64,
            iperf_bps.map_or("?".into(), |b| format!("{:.0}", b / 1e6))
        ));
        let bytes = (bps * secs / 8.0) as u64;
        let mut rec = Record::copy(
            "emulator", "iperf3", bytes, 0, secs, link.rate, setting, link.loss,
        );
        rec.verified = ratio >= 0.9;
        rec.counters = Link::counters(&before, &after);
        rec.extra = json!({
            "ratio_to_cap": ratio,
            "ip_ratio_to_cap": ip_bps / link.rate as f64,
            "iperf3_whole_run_bps": iperf_bps,
            "within_10pct": ratio >= 0.9,
        });
        b.records.push(rec);
    }
    Ok(())
}

/// throughput: every tool on the default link.
pub fn scenario_throughput(b: &mut Bench, ck: &Ckpt) -> Result<()> {
    let link = Link::up(b, b.args.rtt, 0.0)?;
    check_emulator(b, &link, true)?;
    let mut servers = Servers::none();
    for tool in ["ferry", "rsync", "rclone", "per-file"] {
        if !b.args.tools.is_empty() && !b.args.tools.iter().any(|t| t == tool) {
            continue;
        }
        copy_with(b, &link, &mut servers, tool, ck, "throughput", COPY_CAP)?;
    }
    drop(servers);
    link.down();
    Ok(())
}

/// hdfs-source: the main checkpoint from a POSIX source root and from an
/// HDFS source root (a MiniDFSCluster in the source namespace) over the
/// same emulated link, `--hdfs-runs` rounds, the order alternating each
/// round; prints each tool's median wall time against the physical limit.
pub fn scenario_hdfs_source(b: &mut Bench, ck: &Ckpt) -> Result<()> {
    let link = Link::up(b, b.args.rtt, 0.0)?;
    check_emulator(b, &link, false)?;
    let mut servers = Servers::none();
    servers.hdfs(b, ck)?;
    let mut walls: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for round in 0..b.args.hdfs_runs {
        let order = if round % 2 == 0 {
            ["ferry", "ferry-hdfs"]
        } else {
            ["ferry-hdfs", "ferry"]
        };
        for tool in order {
            let rec = copy_with(b, &link, &mut servers, tool, ck, "hdfs-source", COPY_CAP)?;
            if !rec.finished || !rec.verified {
                bail!(
                    "hdfs-source: {tool}'s copy did not finish verified; see the logs in {}",
                    b.log("").display()
                );
            }
            walls.entry(tool).or_default().push(rec.wall_s);
        }
    }
    let limit = ferry_bench::limit_s(ck.bytes, link.rate, link.rtt_ms() / 1000.0);
    let mut medians = BTreeMap::new();
    for (tool, w) in &mut walls {
        let (med, lo, hi) = spread(w);
        medians.insert(*tool, med);
        say(format!(
            "hdfs-source: {tool}: median {med:.2} s ({lo:.2}-{hi:.2}), {:.3} x the physical limit ({limit:.2} s)",
            med / limit
        ));
    }
    if let (Some(h), Some(p)) = (medians.get("ferry-hdfs"), medians.get("ferry")) {
        say(format!(
            "hdfs-source: from HDFS / from POSIX, medians: {:.3}",
            h / p
        ));
    }
    drop(servers);
    link.down();
    Ok(())
}

/// The baseline with the shortest wall time in the throughput scenario
/// (rsync when it did not run).
fn best_baseline(b: &Bench) -> String {
    b.records
        .iter()
        .filter(|r| r.scenario == "throughput" && r.tool != "ferry" && r.finished)
        .min_by(|x, y| x.wall_s.total_cmp(&y.wall_s))
        .map_or("rsync".to_string(), |r| r.tool.clone())
}

/// rtt: Ferry and the best baseline at each RTT of the sweep.
pub fn scenario_rtt(b: &mut Bench, ck: &Ckpt) -> Result<()> {
    let best = best_baseline(b);
    for ms in RTT_SWEEP_MS {
        let rtt = Duration::from_millis(ms);
        let same = b
            .records
            .iter()
            .filter(|r| r.scenario == "throughput" && (r.rtt_ms - ms as f64).abs() < 1e-9)
            .filter(|r| r.tool == "ferry" || r.tool == best)
            .cloned()
            .collect::<Vec<_>>();
        if same.len() == 2 {
            // Measured in the throughput scenario on the same link.
            for mut r in same {
                r.scenario = "rtt".into();
                r.extra["from"] = json!("throughput");
                b.records.push(r);
            }
            continue;
        }
        let link = Link::up(b, rtt, 0.0)?;
        check_emulator(b, &link, false)?;
        let mut servers = Servers::none();
        for tool in ["ferry", best.as_str()] {
            copy_with(b, &link, &mut servers, tool, ck, "rtt", COPY_CAP)?;
        }
        drop(servers);
        link.down();
    }
    Ok(())
}

/// loss: 1 % random loss each way, Ferry and rsync, ~100 MB, 120 s cap.
pub fn scenario_loss(b: &mut Bench) -> Result<()> {
    let ck = b.gen("loss", &["--size", "100MB", "--seed", "3"])?;
    let link = Link::up(b, b.args.rtt, 0.01)?;
    let mut servers = Servers::none();
    for tool in ["ferry", "rsync"] {
        copy_with(b, &link, &mut servers, tool, &ck, "loss", LOSS_CAP)?;
    }
    drop(servers);
    link.down();
    std::fs::remove_dir_all(&ck.dir)?;
    Ok(())
}

/// coexist: Ferry beside an iperf3 TCP flow for 30 s; each one's share of
/// the link (IP bytes delivered source to sink by the emulator).
pub fn scenario_coexist(b: &mut Bench, main: &Ckpt) -> Result<()> {
    // A checkpoint large enough to last the window: hard links to the main
    // checkpoint's files, three times (no extra disk, warm page cache).
    let dir = b.src_root().join("coexist");
    for i in 0..3 {
        let copy = dir.join(format!("part{i}"));
        std::fs::create_dir_all(&copy)?;
        for f in list_tree(&main.dir)? {
            let to = copy.join(&f.rel);
            if let Some(parent) = to.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::hard_link(main.dir.join(&f.rel), &to)?;
        }
    }
    std::fs::write(dir.join("COMMITTED"), b"")?;
    let ck = Ckpt::read("coexist", dir.clone())?;
    let link = Link::up(b, b.args.rtt, 0.0)?;
    say(format!(
        "coexist: Ferry ({:.1} GB) beside iperf3 for {COEXIST_S} s",
        ck.bytes as f64 / 1e9
    ));
    let agents = Agents::start(
        b,
        Placement::Wan,
        link.rate,
        link.rtt,
        &[b.src_root()],
        "coexist",
    )?;
    let _server = iperf3_server()?;
    let id = agents.push(&ck.dir, "scheduled")?;
    let before = link.snap()?;
    let (tcp0, udp0) = link.forward_bytes()?;
    let t0 = Instant::now();
    let out = cmd_ok(
        in_ns(SRC_NS, "iperf3").args(["-c", DST_ADDR, "-t", &COEXIST_S.to_string(), "-J"]),
        "iperf3 beside ferry",
    )?;
    let window = t0.elapsed().as_secs_f64();
    // The stats file is rewritten every 200 ms.
    std::thread::sleep(Duration::from_millis(250));
    let (tcp1, udp1) = link.forward_bytes()?;
    let after = link.snap()?;
    let state = agents.transfer(id)?["state"]
        .as_str()
        .unwrap_or("?")
        .to_string();
    agents.cancel(id).ok();
    let sink_root = agents.sink_root.clone();
    agents.stop();
    b.discard(&sink_root);
    link.down();
    std::fs::remove_dir_all(&dir)?;
    let v: Value = serde_json::from_str(&out).context("iperf3 -J output")?;
    let iperf_bps = v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap_or(0.0);
    let cap_bits = b.args.rate as f64 * window;
    let tcp_share = (tcp1 - tcp0) as f64 * 8.0 / cap_bits;
    let udp_share = (udp1 - udp0) as f64 * 8.0 / cap_bits;
    say(format!(
        "  shares of the link over {window:.1} s: ferry {udp_share:.3}, iperf3 (TCP) {tcp_share:.3}; ferry's transfer was {state} at the end"
    ));
    let counters = Link::counters(&before, &after);
    for (tool, share, bytes) in [
        ("ferry", udp_share, udp1 - udp0),
        ("iperf3", tcp_share, tcp1 - tcp0),
    ] {
        let mut r = Record::copy(
            "coexist",
            tool,
            bytes,
            0,
            window,
            b.args.rate,
            link_rtt_ms(b),
            0.0,
        );
        r.limit_s = 0.0;
        r.wall_over_limit = 0.0;
        r.counters = counters;
        r.extra = json!({
            "share": share,
            "share_counts": "IP bytes (headers included) delivered source to sink by the emulator over the window",
            "iperf3_reported_bps": iperf_bps,
            "target_min_share": 0.30,
        });
        r.verified = false;
        b.records.push(r);
    }
    Ok(())
}

fn link_rtt_ms(b: &Bench) -> f64 {
    b.args.rtt.as_secs_f64() * 1000.0
}

/// scale: a 100,000-shard checkpoint of tiny files, then 1,000 queued
/// transfers; time and peak resident memory of each agent.
pub fn scenario_scale(b: &mut Bench) -> Result<()> {
    let shards = b.args.scale_shards;
    let ck = b.gen(
        "scale",
        &[
            "--shards",
            &shards.to_string(),
            "--size",
            &(shards * 4096).to_string(),
            "--seed",
            "5",
        ],
    )?;
    // 1,000 small checkpoints under a second root (one job each root).
    let qroot = b.work.join("queue-src");
    for i in 0..1000 {
        let d = qroot.join(format!("ckpt-{i:04}"));
        std::fs::create_dir_all(&d)?;
        let data: Vec<u8> = (0..4096u32)
            .map(|j| (j.wrapping_mul(31) ^ i) as u8)
            .collect();
        std::fs::write(d.join("shard.bin"), data)?;
        std::fs::write(d.join("COMMITTED"), b"")?;
    }
    let link = Link::up(b, b.args.rtt, 0.0)?;
    let agents = Agents::start(
        b,
        Placement::Wan,
        link.rate,
        link.rtt,
        &[b.src_root(), qroot.clone()],
        "scale",
    )?;
    say(format!(
        "scale: {} shards ({:.0} MB)",
        ck.files,
        ck.bytes as f64 / 1e6
    ));
    let before = link.snap()?;
    let pushed = agents.push_and_wait(&ck.dir, Duration::from_secs(600))?;
    if pushed.state != Some(TransferState::Published) {
        bail!(
            "scale: the {shards}-shard transfer ended {:?}: {}",
            pushed.state,
            pushed.view["error"]
        );
    }
    let local = PathBuf::from(pushed.view["local_path"].as_str().context("local_path")?);
    compare_trees(&ck.dir, &local, None).context("scale: replica differs")?;
    let (rss_src1, rss_dst1) = agents.peak_rss();
    let mut r = Record::copy(
        "scale",
        "ferry",
        ck.bytes,
        ck.files,
        pushed.wall_s,
        link.rate,
        link.rtt_ms(),
        0.0,
    );
    r.verified = true;
    r.counters = Link::counters(&before, &link.snap()?);
    r.extra = json!({
        "case": format!("{shards} shards"),
        "peak_rss_source_bytes": rss_src1,
        "peak_rss_sink_bytes": rss_dst1,
        "target_rss_bytes": 512u64 << 20,
    });
    say(format!(
        "  {:.2} s ({:.3} x limit); peak RSS source {} MiB, sink {} MiB",
        r.wall_s,
        r.wall_over_limit,
        rss_src1 >> 20,
        rss_dst1 >> 20
    ));
    b.records.push(r);

    let submitters = b.args.scale_submitters.max(1) as usize;
    say(format!(
        "scale: 1,000 queued transfers of 4 KiB ({submitters} submissions in flight)"
    ));
    let before = link.snap()?;
    let t0 = Instant::now();
    let t0_ms = unix_ms();
    let ids = submit_all(&agents, &qroot, 1000, submitters)?;
    let submit_s = t0.elapsed().as_secs_f64();
    let submitted_ms = unix_ms();
    let mut max_queued = 0usize;
    let (published, last_ms) = loop {
        let all = agents.transfers()?;
        let mine: Vec<&Value> = all
            .iter()
            .filter(|t| t["id"].as_i64().is_some_and(|id| ids.contains(&id)))
            .collect();
        let done: Vec<&&Value> = mine.iter().filter(|t| t["state"] == "published").collect();
        let failed: Vec<&&Value> = mine
            .iter()
            .filter(|t| matches!(t["state"].as_str(), Some("failed" | "cancelled")))
            .collect();
        if let Some(f) = failed.first() {
            bail!(
                "scale: a queued transfer ended {}: {}",
                f["state"],
                f["error"]
            );
        }
        max_queued = max_queued.max(mine.iter().filter(|t| t["state"] == "queued").count());
        if done.len() == ids.len() || t0.elapsed() > Duration::from_secs(900) {
            // When the source recorded each publish (Unix ms): the last
            // one ends the burst, whenever this poll saw it.
            let last = done.iter().filter_map(|t| t["finished_at"].as_i64()).max();
            break (done.len(), last);
        }
        std::thread::sleep(Duration::from_millis(250));
    };
    let polled = t0.elapsed().as_secs_f64();
    let last_ms = last_ms.unwrap_or(t0_ms + (polled * 1000.0) as i64);
    // First submission to last publish, and last submission to last publish.
    let wall = (last_ms - t0_ms).max(0) as f64 / 1000.0;
    let tail_s = (last_ms - submitted_ms).max(0) as f64 / 1000.0;
    let (rss_src, rss_dst) = agents.peak_rss();
    let mut ok = published == ids.len();
    for (i, id) in ids.iter().enumerate().take(1000) {
        if !ok {
            break;
        }
        let v = agents.transfer(*id)?;
        let local = PathBuf::from(v["local_path"].as_str().unwrap_or(""));
        ok = compare_trees(&qroot.join(format!("ckpt-{i:04}")), &local, None).is_ok();
    }
    let bytes = 1000 * 4096;
    let mut r = Record::copy(
        "scale",
        "ferry",
        bytes,
        2000,
        wall,
        link.rate,
        link.rtt_ms(),
        0.0,
    );
    r.verified = ok;
    r.finished = published == ids.len();
    r.limit_s = 0.0;
    r.wall_over_limit = 0.0;
    r.counters = Link::counters(&before, &link.snap()?);
    r.extra = json!({
        "case": "1,000 queued transfers",
        "transfers": ids.len(),
        "published": published,
        "submit_s": submit_s,
        "submitters": submitters,
        "after_last_submit_s": tail_s,
        "max_seen_queued": max_queued,
        "per_transfer_ms": wall * 1000.0 / ids.len() as f64,
        "peak_rss_source_bytes": rss_src,
        "peak_rss_sink_bytes": rss_dst,
        "target_rss_bytes": 512u64 << 20,
    });
    say(format!(
        "  {published} published in {wall:.2} s, {tail_s:.2} s after the last submission (submitted in {submit_s:.2} s); peak RSS source {} MiB, sink {} MiB",
        rss_src >> 20,
        rss_dst >> 20
    ));
    b.records.push(r);
    let sink_root = agents.sink_root.clone();
    agents.stop();
    b.discard(&sink_root);
    link.down();
    std::fs::remove_dir_all(&ck.dir)?;
    std::fs::remove_dir_all(&qroot)?;
    Ok(())
}

/// Now, Unix milliseconds (the agents' `created_at` and `finished_at`
/// clock: the same host).
fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Submits `ckpt-0000` .. under `qroot` (`n` of them) with `in_flight`
/// requests at once; returns the transfer ids in checkpoint order.
fn submit_all(agents: &Agents, qroot: &Path, n: usize, in_flight: usize) -> Result<Vec<i64>> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let got: Vec<Result<Vec<(usize, i64)>>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..in_flight.min(n))
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if i >= n {
                            return Ok(mine);
                        }
                        let id = agents.push(&qroot.join(format!("ckpt-{i:04}")), "scheduled")?;
                        mine.push((i, id));
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| {
                w.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a submitting thread panicked")))
            })
            .collect()
    });
    let mut ids = vec![0i64; n];
    for r in got {
        for (i, id) in r? {
            ids[i] = id;
        }
    }
    Ok(ids)
}

/// The median and range of `v` (sorted in place); NaN for none.
fn spread(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    match (v.first(), v.last()) {
        (Some(lo), Some(hi)) => (v[v.len() / 2], *lo, *hi),
        _ => (f64::NAN, f64::NAN, f64::NAN),
    }
}

/// Events `perf stat` counts in the cpu scenario: instructions do not move
/// with the machine's noise (most VMs, this one included, report them as
/// not supported); page faults and context switches are software events
/// every kernel counts.
const PERF_EVENTS: &str = "instructions,page-faults,context-switches";

/// Counts from one `perf stat -x,` report; `None` where the event was not
/// counted (unsupported, or perf missing).
#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    instructions: Option<u64>,
    page_faults: Option<u64>,
    context_switches: Option<u64>,
}

impl Counts {
    /// Parses `perf stat -x,` output: `value,unit,event,...` per line, the
    /// value `<not supported>` or `<not counted>` when there is none.
    fn parse(text: &str) -> Counts {
        let mut c = Counts::default();
        for line in text.lines() {
            let f: Vec<&str> = line.split(',').collect();
            if f.len() < 3 {
                continue;
            }
            let v = f[0].trim().parse::<u64>().ok();
            match f[2].trim() {
                e if e.starts_with("instructions") => c.instructions = v,
                e if e.starts_with("page-faults") => c.page_faults = v,
                e if e.starts_with("context-switches") => c.context_switches = v,
                _ => {}
            }
        }
        c
    }

    /// The sum of two processes' counts (`None` if either lacks one).
    fn plus(self, o: Counts) -> Counts {
        let add = |a: Option<u64>, b: Option<u64>| Some(a? + b?);
        Counts {
            instructions: add(self.instructions, o.instructions),
            page_faults: add(self.page_faults, o.page_faults),
            context_switches: add(self.context_switches, o.context_switches),
        }
    }
}

/// `perf stat` attached to a running process from [`PerfStat::attach`] to
/// [`PerfStat::finish`].
struct PerfStat {
    child: Child,
    out: PathBuf,
}

impl PerfStat {
    /// Attaches to `pid`; `None` (and the counts are left out) when perf
    /// cannot be started.
    fn attach(pid: u32, out: PathBuf) -> Option<PerfStat> {
        let child = Command::new("perf")
            .args([
                "stat",
                "-x,",
                "-e",
                PERF_EVENTS,
                "-p",
                &pid.to_string(),
                "-o",
            ])
            .arg(&out)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        register(child.id());
        // perf needs a moment to open its counters on the process.
        std::thread::sleep(Duration::from_millis(200));
        Some(PerfStat { child, out })
    }

    /// Stops counting (SIGINT, as perf expects) and reads the counts.
    fn finish(mut self) -> Counts {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT);
        let deadline = Instant::now() + Duration::from_secs(10);
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        unregister(self.child.id());
        Counts::parse(&std::fs::read_to_string(&self.out).unwrap_or_default())
    }
}

/// The median of the runs' values of one counter per GB, `None` when any
/// run lacks it.
fn counter_median(runs: &[Counts], gb: f64, pick: impl Fn(&Counts) -> Option<u64>) -> Option<f64> {
    let mut v: Vec<f64> = runs
        .iter()
        .map(|c| pick(c).map(|n| n as f64 / gb))
        .collect::<Option<_>>()?;
    Some(spread(&mut v).0)
}

/// One line of per-GB counter medians for the report.
fn counters_line(tool: &str, runs: &[Counts], gb: f64) -> String {
    let show = |v: Option<f64>| v.map_or("not counted".to_string(), |x| format!("{x:.0}"));
    format!(
        "  {tool} per GB (medians): instructions {}, page faults {}, context switches {}",
        show(counter_median(runs, gb, |c| c.instructions)),
        show(counter_median(runs, gb, |c| c.page_faults)),
        show(counter_median(runs, gb, |c| c.context_switches)),
    )
}

/// Counter medians per GB as JSON (null where not counted).
fn counters_json(runs: &[Counts], gb: f64) -> Value {
    json!({
        "instructions_per_gb": counter_median(runs, gb, |c| c.instructions),
        "page_faults_per_gb": counter_median(runs, gb, |c| c.page_faults),
        "context_switches_per_gb": counter_median(runs, gb, |c| c.context_switches),
    })
}

/// Link rate of the cpu scenario, bit/s (10 Gbit/s: above what either
/// agent reaches on loopback, so CPU is the limit).
const CPU_RATE: u64 = 10_000_000_000;

/// cpu: CPU seconds per GB and goodput of Ferry (source + sink) against a
/// bare quinn transfer of the same bytes, both on loopback:
/// `--cpu-runs` runs of each, alternating, medians and ranges. `cp -a`
/// of the checkpoint first gives the cost of the file I/O alone. Nothing
/// is deleted between the runs (each replica is moved aside and all are
/// removed at the end): on a VM, writing into freshly freed memory and
/// creating inodes right after deletions cost the next writer very
/// differently (RESULTS.md, "CPU profile of one agent pair").
pub fn scenario_cpu(b: &mut Bench, ck: &Ckpt) -> Result<()> {
    let runs = b.args.cpu_runs.max(1) as usize;
    let gb = ck.bytes as f64 / 1e9;
    // File I/O alone: `cp -a` of the same checkpoint (reads and writes the
    // same bytes through the page cache, as Ferry's two ends do).
    let dest = b.dest("cp")?;
    let before = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_CHILDREN)?;
    let t0 = Instant::now();
    cmd_ok(
        Command::new("cp")
            .arg("-a")
            .arg(&ck.dir)
            .arg(dest.join("copy")),
        "cp -a",
    )?;
    let cp_wall = t0.elapsed().as_secs_f64();
    let after = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_CHILDREN)?;
    let secs = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 / 1e6;
    let cp_cpu = secs(after.user_time()) - secs(before.user_time()) + secs(after.system_time())
        - secs(before.system_time());
    let kept = b.work.join("cpu-kept");
    let _ = std::fs::remove_dir_all(&kept);
    std::fs::create_dir_all(&kept)?;
    std::fs::rename(dest.join("copy"), kept.join("cp"))?;
    // The same connection count for both: forced, or Ferry's default for
    // the scenario's rate on this host.
    let connections = b.args.connections.unwrap_or_else(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        replicator::source::default_connections(CPU_RATE, cores) as u32
    });
    say(format!(
        "cpu: {runs} runs each of bare quinn and ferry, alternating, {:.0} MB on loopback, {connections} connection(s)",
        ck.bytes as f64 / 1e6
    ));
    // `perf stat` counters where perf runs here (it needs root and the
    // Debian package linux-perf); without it the counts are left out.
    let perf_ok = Command::new("perf")
        .args(["stat", "-e", "page-faults", "--", "true"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !perf_ok {
        say("  perf stat does not run here: instruction, page-fault and context-switch counts are left out");
    }
    let mut quinn_counts: Vec<Counts> = Vec::new();
    let mut ferry_counts: Vec<Counts> = Vec::new();
    let mut quinn: Vec<Value> = Vec::new();
    // (source CPU s, sink CPU s, wall s) per Ferry run.
    let mut ferry: Vec<(f64, f64, f64)> = Vec::new();
    // The sink's read-back CPU s per Ferry run (part of its CPU above).
    let mut read_back: Vec<f64> = Vec::new();
    const READ_BACK: &str = "ferry_read_back_cpu_seconds_total";
    for i in 0..runs {
        let qbin = b.repo.join(&b.args.bin).join("quinn-bare");
        let qargs = [
            "--bytes".to_string(),
            ck.bytes.to_string(),
            "--connections".to_string(),
            connections.to_string(),
        ];
        let qperf = b.log(&format!("cpu-perf-quinn-{i}.txt"));
        let out = if perf_ok {
            let o = cmd_ok(
                Command::new("perf")
                    .args(["stat", "-x,", "-e", PERF_EVENTS, "-o"])
                    .arg(&qperf)
                    .arg("--")
                    .arg(&qbin)
                    .args(&qargs),
                "quinn-bare under perf stat",
            )?;
            quinn_counts.push(Counts::parse(
                &std::fs::read_to_string(&qperf).unwrap_or_default(),
            ));
            o
        } else {
            cmd_ok(Command::new(&qbin).args(&qargs), "quinn-bare")?
        };
        let v: Value =
            serde_json::from_str(out.lines().last().unwrap_or("")).context("quinn-bare JSON")?;
        quinn.push(v);
        let agents = Agents::start(
            b,
            Placement::Loopback,
            CPU_RATE,
            Duration::from_millis(1),
            &[b.src_root()],
            "cpu",
        )?;
        let rb0 = agents.sink_metric(READ_BACK)?;
        let perf = |pid: Option<u32>, who: &str| {
            pid.filter(|_| perf_ok)
                .and_then(|p| PerfStat::attach(p, b.log(&format!("cpu-perf-{who}-{i}.txt"))))
        };
        let (ps, pd) = (
            perf(agents.src.pid(), "source"),
            perf(agents.dst.pid(), "sink"),
        );
        let (s0, d0) = agents.cpu_s();
        let pushed = agents.push_and_wait(&ck.dir, COPY_CAP)?;
        let (s1, d1) = agents.cpu_s();
        if let (Some(ps), Some(pd)) = (ps, pd) {
            ferry_counts.push(ps.finish().plus(pd.finish()));
        }
        if pushed.state != Some(TransferState::Published) {
            bail!(
                "cpu: the transfer ended {:?}: {}",
                pushed.state,
                pushed.view["error"]
            );
        }
        read_back.push(agents.sink_metric(READ_BACK)? - rb0);
        let local = PathBuf::from(pushed.view["local_path"].as_str().context("local_path")?);
        compare_trees(&ck.dir, &local, None).context("cpu: replica differs")?;
        let sink_root = agents.sink_root.clone();
        agents.stop();
        std::fs::rename(&sink_root, kept.join(format!("ferry-{i}")))?;
        let run = (s1 - s0, d1 - d0, pushed.wall_s);
        say(format!(
            "  run {}: quinn {:.2} CPU s/GB; ferry {:.2} CPU s/GB (source {:.2} s, sink {:.2} s of which read-back {:.2} s), {:.2} Gbit/s",
            i + 1,
            quinn[i]["cpu_s"].as_f64().unwrap_or(f64::NAN) / gb,
            (run.0 + run.1) / gb,
            run.0,
            run.1,
            read_back[i],
            ck.bytes as f64 * 8.0 / run.2 / 1e9
        ));
        ferry.push(run);
    }
    b.discard(&kept);
    b.discard(&dest);
    let num = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let (q_cpu, q_lo, q_hi) =
        spread(&mut quinn.iter().map(|v| num(v, "cpu_s")).collect::<Vec<_>>());
    let (q_gput, q_glo, q_ghi) = spread(
        &mut quinn
            .iter()
            .map(|v| num(v, "goodput_bps"))
            .collect::<Vec<_>>(),
    );
    let (q_wall, _, _) = spread(&mut quinn.iter().map(|v| num(v, "wall_s")).collect::<Vec<_>>());
    let (f_cpu, f_lo, f_hi) = spread(&mut ferry.iter().map(|r| r.0 + r.1).collect::<Vec<_>>());
    let (f_src, f_src_lo, f_src_hi) = spread(&mut ferry.iter().map(|r| r.0).collect::<Vec<_>>());
    let (f_sink, f_sink_lo, f_sink_hi) = spread(&mut ferry.iter().map(|r| r.1).collect::<Vec<_>>());
    let (f_rb, f_rb_lo, f_rb_hi) = spread(&mut read_back.clone());
    let (f_wall, _, _) = spread(&mut ferry.iter().map(|r| r.2).collect::<Vec<_>>());
    let gput = |wall: f64| ck.bytes as f64 * 8.0 / wall;
    let (f_gput, f_glo, f_ghi) = spread(&mut ferry.iter().map(|r| gput(r.2)).collect::<Vec<_>>());
    say(format!(
        "  medians: ferry {:.2} CPU s/GB ({:.2}-{:.2}), {:.2} Gbit/s; bare quinn {:.2} CPU s/GB ({:.2}-{:.2}), {:.2} Gbit/s: {:.2} x; cp -a {:.2} CPU s/GB",
        f_cpu / gb,
        f_lo / gb,
        f_hi / gb,
        f_gput / 1e9,
        q_cpu / gb,
        q_lo / gb,
        q_hi / gb,
        q_gput / 1e9,
        f_cpu / q_cpu,
        cp_cpu / gb
    ));
    if perf_ok {
        say(counters_line("ferry (both agents)", &ferry_counts, gb));
        say(counters_line("bare quinn", &quinn_counts, gb));
    }
    let mut r = Record::copy("cpu", "ferry", ck.bytes, ck.files, f_wall, 0, 0.0, 0.0);
    r.verified = true;
    r.extra = json!({
        "runs": runs,
        "cpu_s": f_cpu,
        "cpu_s_range": [f_lo, f_hi],
        "cpu_source_s": f_src,
        "cpu_source_s_range": [f_src_lo, f_src_hi],
        "cpu_sink_s": f_sink,
        "cpu_sink_s_range": [f_sink_lo, f_sink_hi],
        "cpu_read_back_s": f_rb,
        "cpu_read_back_s_range": [f_rb_lo, f_rb_hi],
        "cpu_s_per_gb_without_read_back": (f_cpu - f_rb) / gb,
        "cpu_s_per_gb": f_cpu / gb,
        "goodput_bps_median": f_gput,
        "goodput_bps_range": [f_glo, f_ghi],
        "over_quinn": f_cpu / q_cpu,
        "target_over_quinn": 1.5,
        "connections": connections,
        "runs_source_sink_wall_s": ferry.iter().map(|r| json!([r.0, r.1, r.2])).collect::<Vec<_>>(),
        "perf_stat": counters_json(&ferry_counts, gb),
        "note": "medians of the runs, alternating with quinn-bare; the sink's read-back before publish is included",
    });
    b.records.push(r);
    let mut r = Record::copy("cpu", "cp", ck.bytes, ck.files, cp_wall, 0, 0.0, 0.0);
    r.extra = json!({
        "cpu_s": cp_cpu,
        "cpu_s_per_gb": cp_cpu / gb,
        "note": "cp -a of the checkpoint on the same disk: what reading and writing the files costs without any network",
    });
    b.records.push(r);
    let mut r = Record::copy("cpu", "quinn", ck.bytes, 0, q_wall, 0, 0.0, 0.0);
    r.verified = false;
    r.extra = json!({
        "runs": runs,
        "cpu_s": q_cpu,
        "cpu_s_range": [q_lo, q_hi],
        "cpu_s_per_gb": q_cpu / gb,
        "goodput_bps_median": q_gput,
        "goodput_bps_range": [q_glo, q_ghi],
        "connections": connections,
        "runs_cpu_s": quinn.iter().map(|v| v["cpu_s"].clone()).collect::<Vec<_>>(),
        "perf_stat": counters_json(&quinn_counts, gb),
        "note": "medians of the runs, alternating with Ferry; the bytes are not files and are not compared",
    });
    b.records.push(r);
    Ok(())
}

/// The last stdout line of a `ferry demo --json` run, parsed.
fn demo_json(b: &Bench, args: &[&str], log: &str) -> Result<Value> {
    demo_json_at(b, args, b.args.rate, log)
}

/// [`demo_json`] at link rate `rate` (bit/s) instead of the bench's.
fn demo_json_at(b: &Bench, args: &[&str], rate: u64, log: &str) -> Result<Value> {
    let rtt = format!("{}ms", b.args.rtt.as_millis());
    let out = Command::new(&b.ferry)
        .arg("demo")
        .args(args)
        .args(["--json", "--rate", &format!("{rate}bit/s"), "--rtt", &rtt])
        .stderr(std::fs::File::create(b.log(log))?)
        .output()
        .context("starting ferry demo")?;
    if !out.status.success() {
        bail!(
            "ferry demo {} failed; see {}",
            args.join(" "),
            b.log(log).display()
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.lines().last().unwrap_or("")).context("ferry demo --json output")
}

/// Parts per source agent in the pool scenario (the measure).
const POOL_PARTS_PER_AGENT: u64 = 40;

/// Part size of the pool scenario, bytes.
const POOL_PART_SIZE: u64 = 8 << 20;

/// Each agent pair's share of the pool scenario's budget, bit/s.
const POOL_PAIR_BPS: u64 = 100_000_000;

/// pool: one checkpoint striped across 1, 2 and 4 agent pairs (`ferry
/// demo --agents N --checkpoints 1 --netns`: `ferry serve` processes,
/// the source agents in namespace `ferry-src` and the sink agents in
/// `ferry-dst`, joined by the bench's emulated link (`--rate`, 1 Gbit/s by
/// default, and `--rtt`), a throwaway PostgreSQL cluster with a database
/// per site in the root namespace), budget N x 100 Mbit/s (the links'
/// rate cap), 40 parts of 8 MiB per source agent. Aggregate goodput against N x one pair's, each
/// source agent's bytes against the mean (within max(10 %, one part)),
/// and over the replication window each process's CPU, the machine's
/// idle share and the catalogs' transactions per second (the demo's
/// `cpu` and `catalog_tps`).
pub fn scenario_pool(b: &mut Bench) -> Result<()> {
    let link = Link::up(b, b.args.rtt, 0.0)?;
    check_emulator(b, &link, false)?;
    let mut one_pair: Option<f64> = None;
    for n in [1u64, 2, 4] {
        let size = n * POOL_PARTS_PER_AGENT * POOL_PART_SIZE;
        let rate = n * POOL_PAIR_BPS;
        say(format!(
            "pool: {n} agent pair(s), one {size}-byte checkpoint, budget {rate} bit/s"
        ));
        let (agents, part, bytes) = (n.to_string(), POOL_PART_SIZE.to_string(), size.to_string());
        let v = demo_json_at(
            b,
            &[
                "--agents",
                &agents,
                "--checkpoints",
                "1",
                "--part-size",
                &part,
                "--size",
                &bytes,
                "--netns",
            ],
            rate,
            &format!("pool-{n}.log"),
        )?;
        let p = &v["pool"];
        let bytes = p["bytes"].as_u64().unwrap_or(0);
        let wall = p["wall_s"].as_f64().unwrap_or(f64::NAN);
        let sent: Vec<f64> = p["per_agent"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter(|x| x["role"] == "source")
                    .filter_map(|x| x["bytes"].as_f64())
                    .collect()
            })
            .unwrap_or_default();
        let mean = sent.iter().sum::<f64>() / sent.len().max(1) as f64;
        let worst = sent.iter().map(|x| (x - mean).abs()).fold(0.0f64, f64::max);
        let allowed = (0.1 * mean).max(POOL_PART_SIZE as f64);
        let goodput = bytes as f64 * 8.0 / wall;
        if n == 1 {
            one_pair = Some(goodput);
        }
        let over = one_pair.map(|g| goodput / (n as f64 * g));
        let mut r = Record::copy("pool", "ferry", bytes, 0, wall, rate, link_rtt_ms(b), 0.0);
        r.verified = p["identical"].as_bool().unwrap_or(false);
        r.extra = json!({
            "agents": n,
            "parts": p["parts"],
            "part_size": POOL_PART_SIZE,
            "per_agent": p["per_agent"],
            "over_n_pairs": over,
            "worst_deviation_bytes": worst,
            "allowed_deviation_bytes": allowed,
            "balanced": worst <= allowed,
            "cpu": p["cpu"],
            "catalog_tps": p["catalog_tps"],
            "link": format!(
                "ops/wanem/netns at {} bit/s, {} ms RTT; ferry serve processes in its namespaces",
                link.rate,
                link.rtt_ms()
            ),
        });
        say(format!(
            "  {:.1} s, {:.0} Mbit/s ({} x N pairs x one pair's), worst agent {:.0} bytes off the mean (allowed {allowed:.0}); agents {:.1} CPU-s/GB, emulator {:.1} CPU-s, machine idle {:.0} %, catalog {:.0} + {:.0} tx/s",
            wall,
            goodput / 1e6,
            over.map_or("-".to_string(), |o| format!("{o:.2}")),
            worst,
            p["cpu"]["agents_s_per_gb"].as_f64().unwrap_or(f64::NAN),
            p["cpu"]["emulator_s"].as_f64().unwrap_or(f64::NAN),
            p["cpu"]["machine_idle_share"].as_f64().unwrap_or(f64::NAN) * 100.0,
            p["catalog_tps"]["source_site"].as_f64().unwrap_or(f64::NAN),
            p["catalog_tps"]["sink_site"].as_f64().unwrap_or(f64::NAN),
        ));
        b.records.push(r);
    }
    // Pre-emption across two pairs: a background checkpoint striped over
    // both, then an urgent one and its job's loss-spike signal.
    let (n, size, rate) = (
        2u64,
        2 * POOL_PARTS_PER_AGENT * POOL_PART_SIZE,
        2 * POOL_PAIR_BPS,
    );
    say(format!(
        "pool: pre-emption across {n} agent pairs, budget {rate} bit/s"
    ));
    let (agents, part, bytes) = (n.to_string(), POOL_PART_SIZE.to_string(), size.to_string());
    let v = demo_json_at(
        b,
        &[
            "--agents",
            &agents,
            "--preempt",
            "--part-size",
            &part,
            "--size",
            &bytes,
            "--netns",
        ],
        rate,
        "pool-preempt.log",
    )?;
    let p = &v["pool_preempt"];
    let urgent = p["urgent_bytes"].as_u64().unwrap_or(0);
    let wall = p["urgent_wall_s"].as_f64().unwrap_or(f64::NAN);
    let mut r = Record::copy(
        "pool-preempt",
        "ferry",
        urgent,
        0,
        wall,
        rate,
        link_rtt_ms(b),
        0.0,
    );
    r.verified = true;
    r.extra = p.clone();
    let num = |k: &str, digits: usize| {
        p[k].as_f64()
            .map_or("never".to_string(), |x| format!("{x:.digits$}"))
    };
    say(format!(
        "  signal to the background checkpoint at 20 % of the budget or less: {} s ({} RTT)",
        num("background_yield_s", 3),
        num("background_yield_rtt", 1)
    ));
    say(format!(
        "  signal to the urgent checkpoint at 80 % of the budget: {} s ({} RTT)",
        num("preemption_latency_s", 3),
        num("preemption_latency_rtt", 1)
    ));
    b.records.push(r);
    link.down();
    Ok(())
}

/// priority: `ferry demo --priority` (in-process agents on the in-memory
/// emulated link of the same rate and RTT).
pub fn scenario_priority(b: &mut Bench) -> Result<()> {
    say("priority: ferry demo --priority (solo, priority, fifo)");
    let v = demo_json(b, &["--priority"], "priority-demo.log")?;
    let p = &v["priority"];
    for policy in ["priority", "fifo"] {
        let wall = p[policy]["wall_s"].as_f64().unwrap_or(f64::NAN);
        let bytes = p["urgent_bytes"].as_u64().unwrap_or(0);
        let mut r = Record::copy(
            "priority",
            "ferry",
            bytes,
            0,
            wall,
            b.args.rate,
            link_rtt_ms(b),
            0.0,
        );
        r.verified = true;
        r.extra = json!({
            "policy": policy,
            "solo_s": p["solo_s"],
            "over_solo": p[policy]["over_solo"],
            "preemption_latency_s": p[policy]["preemption_latency_s"],
            "preemption_latency_rtt": p[policy]["preemption_latency_rtt"],
            "background_bytes": p["background_bytes"],
            "link": "ferry demo: both agents in one process, in-memory emulated link",
        });
        say(format!(
            "  {policy}: {} x solo, pre-emption latency {} RTT",
            p[policy]["over_solo"], p[policy]["preemption_latency_rtt"]
        ));
        b.records.push(r);
    }
    Ok(())
}

/// lag: a DCP checkpoint written at half the link rate, `on_open` against
/// `on_commit`: commit-to-replica lag (`ferry demo` phase 2).
pub fn scenario_lag(b: &mut Bench) -> Result<()> {
    for start in ["on_open", "on_commit"] {
        say(format!("lag: ferry demo, start = {start}"));
        let v = demo_json(b, &["--start", start], &format!("lag-{start}.log"))?;
        let w = &v["watch"];
        let bytes = w["bytes"].as_u64().unwrap_or(0);
        let lag = w["commit_to_replica_s"].as_f64().unwrap_or(f64::NAN);
        let mut r = Record::copy(
            "lag",
            "ferry",
            bytes,
            w["files"].as_u64().unwrap_or(0),
            w["open_to_replica_s"].as_f64().unwrap_or(f64::NAN),
            b.args.rate,
            link_rtt_ms(b),
            0.0,
        );
        r.verified = w["verified"].as_bool().unwrap_or(false);
        r.extra = json!({
            "start": start,
            "write_rate_bps": w["write_rate_bps"],
            "write_s": w["write_s"],
            "commit_to_replica_s": lag,
            "open_to_replica_s": w["open_to_replica_s"],
            "target_s": w["target_s"],
            "link": "ferry demo: both agents in one process, in-memory emulated link",
        });
        say(format!("  commit-to-replica {lag:.3} s"));
        b.records.push(r);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn perf_stat_csv_counts_and_unsupported_events() {
        let text = "# started on Tue Dec  1 23:00:00 2026\n\n\
                    <not supported>,,instructions,0,100.00,,\n\
                    16668,,page-faults,3687360000,100.00,4.521,K/sec\n\
                    14657,,context-switches,3687360000,100.00,3.975,K/sec\n";
        let c = Counts::parse(text);
        assert_eq!(c.instructions, None);
        assert_eq!(c.page_faults, Some(16668));
        assert_eq!(c.context_switches, Some(14657));
        let sum = c.plus(Counts::parse(
            "10,,page-faults,1,100.00,,\n5,,context-switches,1,100.00,,\n",
        ));
        assert_eq!(sum.page_faults, Some(16678));
        assert_eq!(sum.context_switches, Some(14662));
        assert_eq!(sum.instructions, None);
        let runs = [sum, sum];
        assert_eq!(counter_median(&runs, 2.0, |c| c.page_faults), Some(8339.0));
        assert_eq!(counter_median(&runs, 2.0, |c| c.instructions), None);
    }
}
