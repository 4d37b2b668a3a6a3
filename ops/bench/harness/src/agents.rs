//! Two Ferry agents (`ferry serve`) for a measurement: configs, start,
//! push, wait for the publish, resource use.

use ferry_proto::state::TransferState;

use super::*;

/// Where the agents run: both in the namespaces across the emulated link,
/// or both on the root namespace's loopback (the cpu scenario).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Source in `ferry-src`, sink in `ferry-dst`.
    Wan,
    /// Both on 127.0.0.1, no emulator.
    Loopback,
}

/// A running source/sink pair.
pub struct Agents {
    pub src: Guard,
    pub dst: Guard,
    pub src_api: String,
    pub dst_api: String,
    pub sink_root: PathBuf,
    http: reqwest::blocking::Client,
}

/// What became of a push.
pub struct Pushed {
    pub id: i64,
    pub wall_s: f64,
    /// The final state, or where it was when the cap ran out (`None` if
    /// the API answered a state this harness does not know).
    pub state: Option<TransferState>,
    pub view: Value,
}

/// A TOML basic string (JSON string escapes are valid TOML).
fn toml_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| format!("\"{s}\""))
}

fn p(path: &Path) -> String {
    toml_str(&path.to_string_lossy())
}

impl Agents {
    /// Starts a sink and a source with fresh data directories under
    /// `WORK/ferry`, source root `roots`, the link at `rate` bit/s and
    /// `rtt`, and waits for both APIs.
    pub fn start(
        b: &Bench,
        placement: Placement,
        rate: u64,
        rtt: Duration,
        roots: &[PathBuf],
        tag: &str,
    ) -> Result<Agents> {
        let base = b.work.join("ferry");
        if base.exists() {
            std::fs::remove_dir_all(&base)?;
        }
        std::fs::create_dir_all(&base)?;
        nix::unistd::sync();
        let certs = b.work.join("certs");
        let sink_root = base.join("sink-root");
        let (src_api, dst_api, sink_quic, src_quic) = match placement {
            Placement::Wan => (
                format!("{SRC_MGMT}:7070"),
                format!("{DST_MGMT}:7071"),
                format!("{DST_ADDR}:7443"),
                format!("{SRC_ADDR}:0"),
            ),
            Placement::Loopback => (
                "127.0.0.1:17070".to_string(),
                "127.0.0.1:17071".to_string(),
                "127.0.0.1:17443".to_string(),
                "127.0.0.1:0".to_string(),
            ),
        };
        let max_rate = rate.max(1_000_000_000);
        // Placement::Wan puts the API on the namespaces' management veth
        // (not loopback): plain HTTP there is allowed explicitly, and the
        // harness uses an operator token of its own.
        let token = api::auth::new_token();
        let hash = api::auth::hash_token(&token);
        let common = |name: &str, role: &str, api: &str, quic: &str, data: &Path| {
            format!(
                "[agent]\nname = {}\nsite = {}\nrole = {}\ndata_dir = {}\n\n[api]\nlisten = {}\nallow_plaintext = true\n\
                 [[api.tokens]]\nname = \"ferry-bench\"\nrole = \"operator\"\nhash = \"{hash}\"\n\n\
                 [quic]\nlisten = {}\nmax_link_rate = {}\nmax_rtt = {}\n\n\
                 [tls]\nca = {}\ncert = {}\nkey = {}\n",
                toml_str(name),
                toml_str(if role == "source" { "train-a" } else { "eval-b" }),
                toml_str(role),
                p(data),
                toml_str(api),
                toml_str(quic),
                toml_str(&format!("{max_rate}bit/s")),
                toml_str(&format!("{}ms", rtt.as_millis().max(200))),
                p(&certs.join("ca.pem")),
                p(&certs.join(format!("{name}.pem"))),
                p(&certs.join(format!("{name}.key"))),
            )
        };
        let mut src_cfg = common(
            "train-a-1",
            "source",
            &src_api,
            &src_quic,
            &base.join("src-data"),
        );
        let connections = b
            .args
            .connections
            .map(|n| format!("connections = {n}\n"))
            .unwrap_or_default();
        src_cfg += &format!(
            "\n[[links]]\nname = \"to-eval\"\npeer = {}\npeer_name = \"eval-b-1\"\nrate = {}\nrtt_hint = {}\n{connections}\
             \n[source]\nscan_interval = \"0s\"\n",
            toml_str(&sink_quic),
            toml_str(&format!("{rate}bit/s")),
            toml_str(&format!("{}ms", rtt.as_millis().max(1))),
        );
        for (i, r) in roots.iter().enumerate() {
            src_cfg += &format!(
                "\n[[source.roots]]\npath = {}\njob = {}\nlink = \"to-eval\"\nstart = \"on_commit\"\n",
                p(r),
                toml_str(&if i == 0 { JOB.to_string() } else { format!("{JOB}-{i}") }),
            );
        }
        let mut dst_cfg = common(
            "eval-b-1",
            "sink",
            &dst_api,
            &sink_quic,
            &base.join("sink-data"),
        );
        dst_cfg += &format!("\n[sink]\nroot = {}\nreserve = \"1GiB\"\n", p(&sink_root));
        let src_path = base.join("source.toml");
        let dst_path = base.join("sink.toml");
        std::fs::write(&src_path, src_cfg)?;
        std::fs::write(&dst_path, dst_cfg)?;
        let spawn = |ns: &str, cfg: &Path, log: &str| -> Result<Guard> {
            let mut c = match placement {
                Placement::Wan => in_ns(ns, &b.ferry.to_string_lossy()),
                Placement::Loopback => Command::new(&b.ferry),
            };
            let child = c
                .arg("serve")
                .arg("--config")
                .arg(cfg)
                .env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(b.log(log))?)
                .spawn()
                .context("starting ferry serve")?;
            Ok(Guard::new(child))
        };
        let dst = spawn(DST_NS, &dst_path, &format!("{tag}-sink.log"))?;
        let src = spawn(SRC_NS, &src_path, &format!("{tag}-source.log"))?;
        let agents = Agents {
            src,
            dst,
            src_api: format!("http://{src_api}"),
            dst_api: format!("http://{dst_api}"),
            sink_root,
            http: reqwest::blocking::Client::builder()
                .timeout(Duration::from_secs(30))
                .default_headers(
                    [(
                        reqwest::header::AUTHORIZATION,
                        format!("Bearer {token}").parse()?,
                    )]
                    .into_iter()
                    .collect(),
                )
                .build()?,
        };
        for (api, log) in [
            (&agents.dst_api, format!("{tag}-sink.log")),
            (&agents.src_api, format!("{tag}-source.log")),
        ] {
            let t0 = Instant::now();
            loop {
                if let Ok(r) = agents.http.get(format!("{api}/healthz")).send() {
                    if r.status().is_success() {
                        break;
                    }
                }
                if t0.elapsed() > Duration::from_secs(20) {
                    let text = std::fs::read_to_string(b.log(&log)).unwrap_or_default();
                    bail!("agent at {api} not up within 20 s: {text}");
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(agents)
    }

    /// `POST /v1/transfers {"path", "class"}` on the source; the transfer id.
    pub fn push(&self, path: &Path, class: &str) -> Result<i64> {
        let r = self
            .http
            .post(format!("{}/v1/transfers", self.src_api))
            .json(&json!({ "path": path, "class": class }))
            .send()?;
        let status = r.status();
        let v: Value = r.json()?;
        if !status.is_success() {
            bail!("push of {} refused: {status} {v}", path.display());
        }
        v["id"].as_i64().context("no transfer id in the answer")
    }

    /// `GET /v1/transfers/{id}` on the source.
    pub fn transfer(&self, id: i64) -> Result<Value> {
        Ok(self
            .http
            .get(format!("{}/v1/transfers/{id}", self.src_api))
            .send()?
            .json()?)
    }

    /// Every transfer of the source (up to 1000), newest first.
    pub fn transfers(&self) -> Result<Vec<Value>> {
        let v: Value = self
            .http
            .get(format!("{}/v1/transfers?limit=1000", self.src_api))
            .send()?
            .json()?;
        Ok(v["items"].as_array().cloned().unwrap_or_default())
    }

    /// The sink's metric `name` (a sample without labels) from its
    /// `GET /metrics`; 0 when it is absent.
    pub fn sink_metric(&self, name: &str) -> Result<f64> {
        let text = self
            .http
            .get(format!("{}/metrics", self.dst_api))
            .send()?
            .error_for_status()?
            .text()?;
        Ok(text
            .lines()
            .filter_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .find_map(|v| v.trim().parse().ok())
            .unwrap_or(0.0))
    }

    /// `POST /v1/transfers/{id}/cancel`.
    pub fn cancel(&self, id: i64) -> Result<()> {
        self.http
            .post(format!("{}/v1/transfers/{id}/cancel", self.src_api))
            .send()?;
        Ok(())
    }

    /// Pushes `path` and polls every 10 ms until it is published, fails or
    /// `cap` passes. The wall time runs from just before the request to the
    /// poll that sees `published`.
    pub fn push_and_wait(&self, path: &Path, cap: Duration) -> Result<Pushed> {
        let t0 = Instant::now();
        let id = self.push(path, "scheduled")?;
        loop {
            let v = self.transfer(id)?;
            let state: Option<TransferState> = v["state"].as_str().and_then(|s| s.parse().ok());
            if state.is_some_and(TransferState::is_final) || t0.elapsed() > cap {
                return Ok(Pushed {
                    id,
                    wall_s: t0.elapsed().as_secs_f64(),
                    state,
                    view: v,
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Peak resident memory (VmHWM, bytes) of (source, sink).
    pub fn peak_rss(&self) -> (u64, u64) {
        (
            self.src
                .pid()
                .map_or(0, |p| proc_status_kb(p, "VmHWM") * 1024),
            self.dst
                .pid()
                .map_or(0, |p| proc_status_kb(p, "VmHWM") * 1024),
        )
    }

    /// CPU seconds (user + system) of (source, sink) so far.
    pub fn cpu_s(&self) -> (f64, f64) {
        (
            self.src.pid().map_or(0.0, proc_cpu_s),
            self.dst.pid().map_or(0.0, proc_cpu_s),
        )
    }

    /// Stops both agents (SIGTERM, they drain within 10 s).
    pub fn stop(mut self) {
        self.src.stop(Duration::from_secs(12));
        self.dst.stop(Duration::from_secs(12));
    }
}

/// A `kB` field of /proc/PID/status.
fn proc_status_kb(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(&format!("{field}:")))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

/// utime + stime of a process in seconds (/proc/PID/stat fields 14 and 15,
/// in clock ticks of 1/100 s, the Linux USER_HZ).
pub fn proc_cpu_s(pid: u32) -> f64 {
    let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the command name, which is in parentheses.
    let rest = s.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state): utime is field 14 -> index 11.
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// Free-standing helper for tools that wait on a TCP port across the
/// management network.
pub fn wait_port(addr: &str, within: Duration) -> Result<()> {
    let sa: SocketAddr = addr.parse().map_err(|e| anyhow!("{addr}: {e}"))?;
    let t0 = Instant::now();
    while TcpStream::connect_timeout(&sa, Duration::from_millis(200)).is_err() {
        if t0.elapsed() > within {
            bail!("nothing listens on {addr} after {within:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}
