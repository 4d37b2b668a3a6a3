//! Harness for Ferry's end-to-end tests: real `ferry` processes (agents,
//! the `link-emu` relay, one-shot commands), each with its own directory,
//! config file, loopback ports and log files.
//!
//! Every long-lived child is owned by a [`Proc`] that kills and reaps it on
//! drop, so a failing (panicking) test leaves no process behind. Every wait
//! is bounded and fails through [`World::fail`], which appends the tail of
//! every agent's stderr to the panic message.

pub mod pg;
pub mod remote;

use std::collections::{BTreeMap, HashSet};
use std::fmt::Display;
use std::fs::{self, File, OpenOptions};
use std::io::Read;
use std::net::{TcpListener, UdpSocket};
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The binary under test.
pub const FERRY: &str = env!("CARGO_BIN_EXE_ferry");
/// Source agent name (its certificate SAN).
pub const SOURCE_NAME: &str = "train-a-1";
/// Source site.
pub const SOURCE_SITE: &str = "train-a";
/// Sink agent name (its certificate SAN).
pub const SINK_NAME: &str = "eval-b-1";
/// Sink site.
pub const SINK_SITE: &str = "eval-b";
/// Job of the source root.
pub const JOB: &str = "llama-7b";
/// Link name used by the source.
pub const LINK: &str = "to-eval";

/// The `[api]` lines of test agents unless a test sets tokens.
pub const OPEN_API: &str = "allow_unauthenticated = true\n";

/// How long an agent may take to answer `/healthz` after being spawned.
const STARTUP: Duration = Duration::from_secs(30);
/// Lines of each log shown when a test fails.
const LOG_TAIL_LINES: usize = 150;

// ---------------------------------------------------------------- ports --

fn handed_out() -> &'static Mutex<HashSet<u16>> {
    static PORTS: OnceLock<Mutex<HashSet<u16>>> = OnceLock::new();
    PORTS.get_or_init(Mutex::default)
}

/// A loopback TCP port that was free a moment ago (bound to port 0, then
/// released) and was never handed out before in this test process.
pub fn free_tcp_port() -> u16 {
    loop {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let p = l.local_addr().unwrap().port();
        if handed_out().lock().unwrap().insert(p) {
            return p;
        }
    }
}

/// Same as [`free_tcp_port`] for UDP.
pub fn free_udp_port() -> u16 {
    loop {
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        let p = s.local_addr().unwrap().port();
        if handed_out().lock().unwrap().insert(p) {
            return p;
        }
    }
}

// ------------------------------------------------------------ processes --

/// A child process killed (SIGKILL) and reaped when dropped.
#[derive(Debug)]
pub struct Proc {
    child: Child,
}

impl Proc {
    /// Owns `child` from now on.
    pub fn new(child: Child) -> Proc {
        Proc { child }
    }

    /// Its process id.
    #[allow(dead_code)]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILLs the process and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// `Some(status)` if the process has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Sends SIGTERM and waits up to `within` for the process to exit;
    /// returns its status and how long it took, or `None` if it is still
    /// running (it is then killed when dropped).
    pub fn terminate(&mut self, within: Duration) -> Option<(std::process::ExitStatus, Duration)> {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let start = std::time::Instant::now();
        while start.elapsed() < within {
            if let Some(status) = self.exited() {
                return Some((status, start.elapsed()));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// What a one-shot command printed and how it ended.
#[derive(Debug)]
pub struct CmdOutput {
    /// Exit code (`None` if killed by a signal).
    pub code: Option<i32>,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

impl CmdOutput {
    /// Exit code 0.
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }

    /// Standard output and standard error together.
    pub fn all(&self) -> String {
        format!("{}\n{}", self.stdout, self.stderr)
    }
}

impl Display for CmdOutput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit code {:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

// --------------------------------------------------------------- config --

/// One `[[links]]` entry.
#[derive(Debug, Clone)]
pub struct LinkSpec {
    /// `name`
    pub name: String,
    /// `peer` (`host:port`)
    pub peer: String,
    /// `peer_name`
    pub peer_name: String,
    /// `more_peers`: further sink agents, `(peer, peer_name)`.
    pub more_peers: Vec<(String, String)>,
    /// `rate`
    pub rate: String,
    /// `rtt_hint`
    pub rtt_hint: String,
    /// `connections` (`None`: the agent's default)
    pub connections: Option<u32>,
}

/// `[source]` with one root.
#[derive(Debug, Clone)]
pub struct SourceSpec {
    /// `[[source.roots]]` path.
    pub root: PathBuf,
    /// `markers`
    pub markers: Vec<String>,
    /// `scan_interval`: `"0s"` (the watcher off: every transfer is an
    /// explicit `ferry push`) unless a test turns the watcher on.
    pub scan_interval: String,
    /// Extra TOML lines for `[source]` (e.g. `quiet_period = "1s"`).
    pub extra: String,
    /// Extra TOML lines for the `[[source.roots]]` entry (e.g. `format =
    /// "dcp"`).
    pub root_extra: String,
}

/// `[sink]`
#[derive(Debug, Clone)]
pub struct SinkSpec {
    /// `root`
    pub root: PathBuf,
    /// `reserve`, if not the default.
    pub reserve: Option<String>,
    /// Extra TOML lines for `[sink]` (keys, then `[[sink.retention]]`
    /// tables).
    pub extra: String,
}

/// Everything written into an agent's TOML config file.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// `[agent] name`
    pub name: String,
    /// `[agent] site`
    pub site: String,
    /// `[agent] role`
    pub role: String,
    /// `[agent] data_dir`
    pub data_dir: PathBuf,
    /// `[api] listen` port on 127.0.0.1.
    pub api_port: u16,
    /// `[quic] listen`
    pub quic_listen: String,
    /// Lines of `[api]` after `listen` (default: `allow_unauthenticated =
    /// true`); `[[api.tokens]]` tables may follow.
    pub api: String,
    /// `[tls] ca`
    pub ca: PathBuf,
    /// `[tls] cert`
    pub cert: PathBuf,
    /// `[tls] key`
    pub key: PathBuf,
    /// `[[links]]`
    pub links: Vec<LinkSpec>,
    /// `[source]`
    pub source: Option<SourceSpec>,
    /// `[sink]`
    pub sink: Option<SinkSpec>,
    /// TOML tables appended at the end of the file (`[catalog]`, ...).
    pub tail: String,
}

/// A TOML basic string holding `s`, correctly escaped.
pub fn toml_str(s: impl AsRef<str>) -> String {
    toml::Value::String(s.as_ref().to_string()).to_string()
}

fn toml_path(p: &Path) -> String {
    toml_str(p.to_str().expect("test paths are UTF-8"))
}

impl AgentConfig {
    /// The config file's text.
    pub fn to_toml(&self) -> String {
        let mut t = format!(
            "[agent]\nname = {}\nsite = {}\nrole = {}\ndata_dir = {}\n\n\
             [api]\nlisten = {}\n{}\n[quic]\nlisten = {}\n\n\
             [tls]\nca = {}\ncert = {}\nkey = {}\n",
            toml_str(&self.name),
            toml_str(&self.site),
            toml_str(&self.role),
            toml_path(&self.data_dir),
            toml_str(format!("127.0.0.1:{}", self.api_port)),
            self.api,
            toml_str(&self.quic_listen),
            toml_path(&self.ca),
            toml_path(&self.cert),
            toml_path(&self.key),
        );
        for l in &self.links {
            t += &format!(
                "\n[[links]]\nname = {}\npeer = {}\npeer_name = {}\nrate = {}\nrtt_hint = {}\n",
                toml_str(&l.name),
                toml_str(&l.peer),
                toml_str(&l.peer_name),
                toml_str(&l.rate),
                toml_str(&l.rtt_hint),
            );
            if let Some(n) = l.connections {
                t += &format!("connections = {n}\n");
            }
            if !l.more_peers.is_empty() {
                let more: Vec<String> = l
                    .more_peers
                    .iter()
                    .map(|(p, n)| {
                        format!("{{ peer = {}, peer_name = {} }}", toml_str(p), toml_str(n))
                    })
                    .collect();
                t += &format!("more_peers = [{}]\n", more.join(", "));
            }
        }
        if let Some(s) = &self.source {
            let markers: Vec<String> = s.markers.iter().map(toml_str).collect();
            t += &format!(
                "\n[source]\nmarkers = [{}]\nscan_interval = {}\n{}\n\
                 [[source.roots]]\npath = {}\njob = {}\nlink = {}\n{}",
                markers.join(", "),
                toml_str(&s.scan_interval),
                s.extra,
                toml_path(&s.root),
                toml_str(JOB),
                toml_str(LINK),
                s.root_extra,
            );
        }
        if let Some(s) = &self.sink {
            t += &format!("\n[sink]\nroot = {}\n", toml_path(&s.root));
            if let Some(r) = &s.reserve {
                t += &format!("reserve = {}\n", toml_str(r));
            }
            t += &s.extra;
        }
        t += &self.tail;
        t
    }
}

// ---------------------------------------------------------------- world --

/// One test's private world: a temporary directory (removed at the end
/// unless `E2E_KEEP` is set), certificates, the logs of every process
/// started, an HTTP client.
pub struct World {
    _tmp: Option<tempfile::TempDir>,
    /// Canonical path of the temporary directory.
    pub root: PathBuf,
    logs: Mutex<Vec<(String, PathBuf)>>,
    http: reqwest::Client,
}

/// A running agent (`ferry serve`).
pub struct Agent {
    /// Label used for its directory and in failure messages.
    pub label: String,
    /// Its config.
    pub cfg: AgentConfig,
    /// Its config file.
    pub config_path: PathBuf,
    /// Its stderr (appended to across restarts).
    pub stderr_path: PathBuf,
    env: Vec<(String, String)>,
    /// A command (and its arguments) that runs `ferry serve` (appended
    /// to it), e.g. `unshare` to give the agent its own mount namespace;
    /// empty: `ferry serve` itself.
    pub wrap: Vec<String>,
    dir: PathBuf,
    proc: Option<Proc>,
}

impl Agent {
    /// The API base URL.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.cfg.api_port)
    }

    /// Sets (or with `None` removes) an environment variable of the
    /// agent's next (re)start.
    #[allow(dead_code)]
    pub fn set_env(&mut self, key: &str, value: Option<&str>) {
        self.env.retain(|(k, _)| k != key);
        if let Some(v) = value {
            self.env.push((key.to_string(), v.to_string()));
        }
    }

    /// `Some(status)` once the agent's process has exited by itself.
    #[allow(dead_code)]
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.proc.as_mut()?.exited()
    }

    /// Its process id, while it runs.
    #[allow(dead_code)]
    pub fn pid(&self) -> Option<u32> {
        self.proc.as_ref().map(Proc::pid)
    }

    /// SIGKILLs the agent (no draining) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }

    /// SIGTERMs the agent and waits up to `within` for it to drain and
    /// exit; see [`Proc::terminate`].
    pub fn terminate(&mut self, within: Duration) -> Option<(std::process::ExitStatus, Duration)> {
        let r = self.proc.as_mut()?.terminate(within);
        if r.is_some() {
            self.proc = None;
        }
        r
    }

    /// Everything it wrote to stderr so far.
    pub fn stderr(&self) -> String {
        fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }
}

/// A running `ferry link-emu` relay.
pub struct Relay {
    /// The UDP port sources send to.
    pub port: u16,
    /// Its standard output: the banner, one line per cut and restore, the
    /// counters when it stops.
    pub stdout_path: PathBuf,
    proc: Proc,
}

#[allow(dead_code)]
impl Relay {
    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }

    /// Sends `sig` to the relay (SIGUSR1 cuts the link, SIGUSR2 restores
    /// it).
    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        let pid = nix::unistd::Pid::from_raw(self.pid() as i32);
        nix::sys::signal::kill(pid, sig)
            .unwrap_or_else(|e| panic!("cannot send {sig} to the relay: {e}"));
    }

    /// Everything it printed on stdout so far.
    pub fn stdout(&self) -> String {
        fs::read_to_string(&self.stdout_path).unwrap_or_default()
    }

    /// SIGTERMs the relay and waits up to `within` for it to print its
    /// counters and exit; returns its whole stdout, or `None` if it is
    /// still running (it is then killed when dropped).
    pub fn stop(&mut self, within: Duration) -> Option<String> {
        self.proc.terminate(within)?;
        Some(self.stdout())
    }
}

/// A sink, a relay in front of it and a source dialing the relay.
pub struct Cluster {
    /// The source agent.
    pub source: Agent,
    /// The emulated WAN link (kept running until the cluster is dropped).
    pub _relay: Relay,
    /// The sink agent.
    pub sink: Agent,
}

#[allow(dead_code)]
impl Cluster {
    /// The relay between the source and the sink.
    pub fn relay(&self) -> &Relay {
        &self._relay
    }

    /// The relay, to stop it.
    pub fn relay_mut(&mut self) -> &mut Relay {
        &mut self._relay
    }
}

impl World {
    /// A fresh world with a development CA and certificates for the source
    /// and the sink in `certs/`.
    pub async fn new(test: &str) -> World {
        let tmp = tempfile::Builder::new()
            .prefix(&format!("ferry-e2e-{test}-"))
            .tempdir()
            .unwrap();
        let root = fs::canonicalize(tmp.path()).unwrap();
        // E2E_KEEP=1 keeps the directory (configs, logs, trees) to inspect.
        let tmp = if std::env::var_os("E2E_KEEP").is_some() {
            eprintln!("E2E_KEEP: keeping {}", tmp.keep().display());
            None
        } else {
            Some(tmp)
        };
        let w = World {
            _tmp: tmp,
            root,
            logs: Mutex::default(),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(15))
                .build()
                .unwrap(),
        };
        fs::create_dir_all(w.source_root()).unwrap();
        fs::create_dir_all(w.sink_root()).unwrap();
        w.certs("certs", &[SOURCE_NAME, SINK_NAME]).await;
        w
    }

    /// Where the source's checkpoints live (the `[[source.roots]]` path).
    pub fn source_root(&self) -> PathBuf {
        self.root.join("source-root")
    }

    /// The sink's `[sink] root`.
    pub fn sink_root(&self) -> PathBuf {
        self.root.join("sink-root")
    }

    /// Where the replica of `<source root>/<rel>` is published.
    pub fn replica_path(&self, rel: &str) -> PathBuf {
        self.sink_root().join(SOURCE_SITE).join(JOB).join(rel)
    }

    /// The tail of every log registered so far, for failure messages.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for (label, path) in self.logs.lock().unwrap().iter() {
            let text = fs::read_to_string(path).unwrap_or_else(|e| format!("(cannot read: {e})"));
            let lines: Vec<&str> = text.lines().collect();
            let skip = lines.len().saturating_sub(LOG_TAIL_LINES);
            out += &format!(
                "\n===== {label}: {} (last {} of {} lines) =====\n{}\n",
                path.display(),
                lines.len() - skip,
                lines.len(),
                lines[skip..].join("\n")
            );
        }
        out
    }

    /// Fails the test with `msg` and every agent's log.
    pub fn fail(&self, msg: impl Display) -> ! {
        panic!("{msg}\n{}", self.logs())
    }

    /// Fails the test with `msg()` and every agent's log unless `cond`.
    pub fn ensure(&self, cond: bool, msg: impl FnOnce() -> String) {
        if !cond {
            self.fail(msg());
        }
    }

    /// Polls `probe` every 200 ms until it returns `Ok`, for at most
    /// `timeout`; fails with the last `Err` (what was seen) otherwise.
    pub async fn wait_until<T>(
        &self,
        what: &str,
        timeout: Duration,
        mut probe: impl AsyncFnMut() -> Result<T, String>,
    ) -> T {
        let deadline = Instant::now() + timeout;
        loop {
            let last = match probe().await {
                Ok(v) => return v,
                Err(e) => e,
            };
            if Instant::now() >= deadline {
                self.fail(format!(
                    "timed out after {timeout:?} waiting for {what}; last seen: {last}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    // ----------------------------------------------------- commands --

    /// Runs `ferry ARGS` to completion (killed after `timeout`, which fails
    /// the test) and returns what it printed.
    pub async fn ferry(&self, args: &[&str], env: &[(&str, &str)], timeout: Duration) -> CmdOutput {
        let mut cmd = tokio::process::Command::new(FERRY);
        cmd.args(args)
            .env_remove("FERRY_CONFIG")
            .env_remove("FERRY_SERVER")
            .env_remove("FERRY_LOG")
            .env_remove("FERRY_CATALOG_URL")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .kill_on_drop(true);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = match tokio::time::timeout(timeout, cmd.output()).await {
            Ok(r) => r.unwrap_or_else(|e| self.fail(format!("cannot run {FERRY} {args:?}: {e}"))),
            Err(_) => self.fail(format!(
                "`ferry {}` did not finish within {timeout:?}",
                args.join(" ")
            )),
        };
        CmdOutput {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// `ferry certs init --out <root>/DIR --agent NAME...`; a new directory
    /// gets a new CA. Returns the directory.
    pub async fn certs(&self, dir: &str, agents: &[&str]) -> PathBuf {
        let out_dir = self.root.join(dir);
        let mut args = vec!["certs", "init", "--out", out_dir.to_str().unwrap()];
        for a in agents {
            args.extend(["--agent", a]);
        }
        let out = self.ferry(&args, &[], Duration::from_secs(60)).await;
        self.ensure(out.success(), || format!("ferry certs init failed: {out}"));
        out_dir
    }

    /// `ferry gen --out DIR --size SIZE --marker COMMITTED`.
    pub async fn gen(&self, out: &Path, size: &str) {
        let args = [
            "gen",
            "--out",
            out.to_str().unwrap(),
            "--size",
            size,
            "--marker",
            "COMMITTED",
        ];
        let out = self.ferry(&args, &[], Duration::from_secs(120)).await;
        self.ensure(out.success(), || format!("ferry gen failed: {out}"));
    }

    /// Starts `ferry gen --out ROOT --format dcp --step STEP --size SIZE
    /// --write-rate RATE` in the background: a DCP save written at a
    /// training job's pace, for the watcher to follow while it grows
    /// (`ROOT/step_<STEP, 8 digits>`). Killed if dropped.
    pub fn spawn_dcp_save(
        &self,
        root: &Path,
        step: &str,
        size: &str,
        rate: &str,
    ) -> tokio::process::Child {
        tokio::process::Command::new(FERRY)
            .args(["gen", "--out", root.to_str().unwrap(), "--format", "dcp"])
            .args(["--step", step, "--size", size, "--write-rate", rate])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| self.fail(format!("cannot start ferry gen: {e}")))
    }

    /// `ferry push PATH --server <source API> [EXTRA...]`.
    pub async fn push(&self, source: &Agent, path: &Path, extra: &[&str]) -> CmdOutput {
        let url = source.url();
        let mut args = vec!["push", path.to_str().unwrap(), "--server", &url];
        args.extend_from_slice(extra);
        self.ferry(&args, &[], Duration::from_secs(120)).await
    }

    /// `ferry push --no-wait`; returns the transfer id it printed.
    pub async fn push_no_wait(&self, source: &Agent, path: &Path) -> i64 {
        let out = self.push(source, path, &["--no-wait"]).await;
        self.ensure(out.success(), || {
            format!("ferry push --no-wait failed: {out}")
        });
        out.stdout
            .split_whitespace()
            .skip_while(|w| *w != "transfer")
            .nth(1)
            .and_then(|id| id.parse().ok())
            .unwrap_or_else(|| {
                self.fail(format!("no transfer id in the output of ferry push: {out}"))
            })
    }

    /// `ferry verify PATH --config <sink config>`.
    pub async fn verify(&self, sink: &Agent, path: &Path) -> CmdOutput {
        let args = [
            "verify",
            path.to_str().unwrap(),
            "--config",
            sink.config_path.to_str().unwrap(),
        ];
        self.ferry(&args, &[], Duration::from_secs(60)).await
    }

    // -------------------------------------------------------- agents --

    /// A sink config with fresh ports, certificates from `certs/`.
    pub fn sink_config(&self) -> AgentConfig {
        let certs = self.root.join("certs");
        AgentConfig {
            name: SINK_NAME.into(),
            site: SINK_SITE.into(),
            role: "sink".into(),
            data_dir: self.root.join("sink").join("data"),
            api_port: free_tcp_port(),
            quic_listen: format!("127.0.0.1:{}", free_udp_port()),
            api: OPEN_API.into(),
            ca: certs.join("ca.pem"),
            cert: certs.join(format!("{SINK_NAME}.pem")),
            key: certs.join(format!("{SINK_NAME}.key")),
            links: Vec::new(),
            source: None,
            sink: Some(SinkSpec {
                root: self.sink_root(),
                reserve: None,
                extra: String::new(),
            }),
            tail: String::new(),
        }
    }

    /// A source config dialing `peer` (the relay) with a fresh API port,
    /// certificates from `certs/`, one root ([`World::source_root`]).
    pub fn source_config(&self, peer: &str, rate: &str) -> AgentConfig {
        let certs = self.root.join("certs");
        AgentConfig {
            name: SOURCE_NAME.into(),
            site: SOURCE_SITE.into(),
            role: "source".into(),
            data_dir: self.root.join("source").join("data"),
            api_port: free_tcp_port(),
            quic_listen: "127.0.0.1:0".into(),
            api: OPEN_API.into(),
            ca: certs.join("ca.pem"),
            cert: certs.join(format!("{SOURCE_NAME}.pem")),
            key: certs.join(format!("{SOURCE_NAME}.key")),
            links: vec![LinkSpec {
                name: LINK.into(),
                peer: peer.into(),
                peer_name: SINK_NAME.into(),
                more_peers: Vec::new(),
                rate: rate.into(),
                rtt_hint: "20ms".into(),
                connections: None,
            }],
            source: Some(SourceSpec {
                root: self.source_root(),
                markers: vec!["COMMITTED".into()],
                scan_interval: "0s".into(),
                extra: String::new(),
                root_extra: String::new(),
            }),
            sink: None,
            tail: String::new(),
        }
    }

    /// Writes `cfg` to `<root>/<label>/ferry.toml`, starts `ferry serve`
    /// with `env` and waits until its API answers.
    pub async fn start_agent(&self, label: &str, cfg: AgentConfig, env: &[(&str, &str)]) -> Agent {
        self.start_agent_wrapped(label, cfg, env, &[]).await
    }

    /// [`World::start_agent`], `ferry serve` run through `wrap` (see
    /// [`Agent::wrap`]).
    pub async fn start_agent_wrapped(
        &self,
        label: &str,
        cfg: AgentConfig,
        env: &[(&str, &str)],
        wrap: &[String],
    ) -> Agent {
        let dir = self.root.join(label);
        fs::create_dir_all(&dir).unwrap();
        let config_path = dir.join("ferry.toml");
        fs::write(&config_path, cfg.to_toml()).unwrap();
        let stderr_path = dir.join("stderr.log");
        self.logs
            .lock()
            .unwrap()
            .push((format!("{label} stderr"), stderr_path.clone()));
        let mut agent = Agent {
            label: label.into(),
            cfg,
            config_path,
            stderr_path,
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            wrap: wrap.to_vec(),
            dir,
            proc: None,
        };
        self.restart(&mut agent).await;
        agent
    }

    /// (Re)starts `agent` with its config and waits until its API answers.
    pub async fn restart(&self, agent: &mut Agent) {
        agent.kill();
        let append = |p: &Path| {
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .unwrap()
        };
        let mut cmd = match agent.wrap.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(FERRY);
                c
            }
            None => Command::new(FERRY),
        };
        cmd.args(["serve", "--config", agent.config_path.to_str().unwrap()])
            .current_dir(&agent.dir)
            .env_remove("FERRY_CONFIG")
            .env_remove("FERRY_LOG")
            .env_remove("FERRY_CATALOG_URL")
            .env_remove("FERRY_FAULT_CORRUPT_CHUNKS")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(append(&agent.dir.join("stdout.log")))
            .stderr(append(&agent.stderr_path));
        // E2E_FERRY_LOG=debug (say) raises the agents' log level.
        if let Ok(level) = std::env::var("E2E_FERRY_LOG") {
            cmd.env("FERRY_LOG", level);
        }
        for (k, v) in &agent.env {
            cmd.env(k, v);
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| self.fail(format!("cannot start {}: {e}", agent.label)));
        agent.proc = Some(Proc::new(child));
        let url = format!("{}/healthz", agent.url());
        let label = agent.label.clone();
        let proc = agent.proc.as_mut().unwrap();
        self.wait_until(&format!("{label} to answer {url}"), STARTUP, async || {
            if let Some(status) = proc.exited() {
                self.fail(format!("{label} exited during startup: {status}"));
            }
            match self.http.get(&url).send().await {
                Ok(r) if r.status().is_success() => Ok(()),
                Ok(r) => Err(format!("HTTP {}", r.status())),
                Err(e) => Err(e.to_string()),
            }
        })
        .await;
    }

    /// `ferry link-emu --listen 127.0.0.1:<new port> --forward
    /// 127.0.0.1:<forward_port> --rate RATE --rtt 20ms`, once it listens.
    #[allow(dead_code)]
    pub async fn start_relay(&self, forward: &str, rate: &str) -> Relay {
        self.start_relay_with(forward, rate, &[]).await
    }

    /// [`World::start_relay`] with `extra` link-emu flags (e.g. `--loss
    /// 0.01 --seed 3`; a later `--rtt` overrides the 20 ms).
    pub async fn start_relay_with(&self, forward: &str, rate: &str, extra: &[&str]) -> Relay {
        let dir = self.root.join("relay");
        fs::create_dir_all(&dir).unwrap();
        let port = free_udp_port();
        let (out_path, err_path) = (dir.join("stdout.log"), dir.join("stderr.log"));
        self.logs
            .lock()
            .unwrap()
            .push(("relay stderr".into(), err_path.clone()));
        self.logs
            .lock()
            .unwrap()
            .push(("relay stdout".into(), out_path.clone()));
        let listen = format!("127.0.0.1:{port}");
        let child = Command::new(FERRY)
            .args(["link-emu", "--listen", &listen, "--forward", forward])
            .args(["--rate", rate, "--rtt", "20ms"])
            .args(extra)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(File::create(&out_path).unwrap())
            .stderr(File::create(&err_path).unwrap())
            .spawn()
            .unwrap_or_else(|e| self.fail(format!("cannot start ferry link-emu: {e}")));
        let mut proc = Proc::new(child);
        self.wait_until("ferry link-emu to listen", STARTUP, async || {
            if let Some(status) = proc.exited() {
                self.fail(format!("ferry link-emu exited during startup: {status}"));
            }
            let out = fs::read_to_string(&out_path).unwrap_or_default();
            if out.contains("link-emu:") {
                Ok(())
            } else {
                Err(format!("stdout so far: {out:?}"))
            }
        })
        .await;
        Relay {
            port,
            stdout_path: out_path,
            proc,
        }
    }

    /// Starts a sink, a relay (RATE, 20 ms RTT) in front of its QUIC port
    /// and a source whose link goes through the relay. `tweak` may change
    /// both configs (sink, source) first; `source_env` is added to the
    /// source's environment.
    pub async fn start_cluster(
        &self,
        rate: &str,
        source_env: &[(&str, &str)],
        tweak: impl FnOnce(&mut AgentConfig, &mut AgentConfig),
    ) -> Cluster {
        self.start_cluster_with(rate, &[], source_env, tweak).await
    }

    /// [`World::start_cluster`] with `relay_args` added to the relay's
    /// `ferry link-emu` flags (see [`World::start_relay_with`]).
    pub async fn start_cluster_with(
        &self,
        rate: &str,
        relay_args: &[&str],
        source_env: &[(&str, &str)],
        tweak: impl FnOnce(&mut AgentConfig, &mut AgentConfig),
    ) -> Cluster {
        let mut sink_cfg = self.sink_config();
        // An empty peer is filled in below with the relay's address.
        let mut source_cfg = self.source_config("", rate);
        tweak(&mut sink_cfg, &mut source_cfg);
        let sink = self.start_agent("sink", sink_cfg, &[]).await;
        let relay = self
            .start_relay_with(&sink.cfg.quic_listen, rate, relay_args)
            .await;
        for l in &mut source_cfg.links {
            if l.peer.is_empty() {
                l.peer = format!("127.0.0.1:{}", relay.port);
            }
        }
        let source = self.start_agent("source", source_cfg, source_env).await;
        Cluster {
            source,
            _relay: relay,
            sink,
        }
    }

    // ---------------------------------------------------------- HTTP --

    /// GET `url` as JSON; `Err` on any failure (for polling loops).
    pub async fn try_get_json(&self, url: &str) -> Result<Value, String> {
        let r = self
            .http
            .get(url)
            .send()
            .await
            .map_err(|e| format!("GET {url}: {e}"))?;
        let status = r.status();
        let body = r.text().await.map_err(|e| format!("GET {url}: {e}"))?;
        if !status.is_success() {
            return Err(format!("GET {url}: HTTP {status}: {body}"));
        }
        serde_json::from_str(&body).map_err(|e| format!("GET {url}: {e}: {body}"))
    }

    /// GET `url` as JSON; fails the test on any error.
    pub async fn get_json(&self, url: &str) -> Value {
        match self.try_get_json(url).await {
            Ok(v) => v,
            Err(e) => self.fail(e),
        }
    }

    /// The sink's `GET /v1/resolve?path=PATH` (no wait), or an error.
    pub async fn try_resolve(&self, sink: &Agent, path: &Path) -> Result<Value, String> {
        let url = reqwest::Url::parse_with_params(
            &format!("{}/v1/resolve", sink.url()),
            &[("path", path.to_str().unwrap())],
        )
        .unwrap();
        self.try_get_json(url.as_str()).await
    }

    /// The sink's `GET /v1/resolve?path=PATH`; fails the test on an error.
    pub async fn resolve(&self, sink: &Agent, path: &Path) -> Value {
        match self.try_resolve(sink, path).await {
            Ok(v) => v,
            Err(e) => self.fail(e),
        }
    }

    /// Checks where a published replica's time went, on one host: the
    /// sink's row (`GET /v1/replicas`) lists phases after the commit,
    /// each 0 or more, that include `must` and add up to its
    /// `commit_to_replica_s` within 50 ms; the source's transfer row
    /// lists the same phases after the commit. Returns the sink's
    /// phases.
    pub fn assert_phases_add_up(&self, replica: &Value, transfer: &Value, must: &[&str]) -> Value {
        let p = &replica["phases"];
        let after = p["after_commit"].as_object().cloned().unwrap_or_default();
        self.ensure(!after.is_empty(), || {
            format!("no phases after the commit: {replica}")
        });
        for (k, v) in &after {
            self.ensure(v.as_f64().is_some_and(|x| x >= 0.0), || {
                format!("phase {k} is {v}: {replica}")
            });
        }
        for m in must {
            self.ensure(after.contains_key(*m), || format!("no phase {m}: {p}"));
        }
        let sum: f64 = after.values().filter_map(Value::as_f64).sum();
        let total = replica["commit_to_replica_s"].as_f64().unwrap_or(f64::NAN);
        self.ensure((sum - total).abs() <= 0.05, || {
            format!("the phases after the commit add up to {sum} s, commit to eval-ready took {total} s: {p}")
        });
        self.ensure(
            p["unattributed_s"]
                .as_f64()
                .is_some_and(|u| u.abs() <= 0.05),
            || format!("unattributed: {p}"),
        );
        let tp = &transfer["phases"]["after_commit"];
        self.ensure(
            tp.as_object().map(|o| o.keys().collect::<Vec<_>>()) == Some(after.keys().collect()),
            || format!("the source's phases {tp} are not the sink's {p}"),
        );
        p.clone()
    }

    /// The source's `GET /v1/transfers/{id}`.
    pub async fn transfer(&self, source: &Agent, id: i64) -> Value {
        self.get_json(&format!("{}/v1/transfers/{id}", source.url()))
            .await
    }

    /// The source's transfers (`GET /v1/transfers`).
    pub async fn transfers(&self, source: &Agent) -> Vec<Value> {
        let v = self
            .get_json(&format!("{}/v1/transfers", source.url()))
            .await;
        v["items"].as_array().cloned().unwrap_or_default()
    }

    /// `GET /metrics` of `agent`: its Prometheus text, checked to come
    /// with the text format's content type (version 0.0.4). The only
    /// place a metrics request is built, so the only one to change when
    /// the API wants a token.
    pub async fn metrics_text(&self, agent: &Agent) -> String {
        let url = format!("{}/metrics", agent.url());
        let r = self
            .http
            .get(&url)
            .send()
            .await
            .unwrap_or_else(|e| self.fail(format!("GET {url}: {e}")));
        let status = r.status();
        let ct = r
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        let body = r
            .text()
            .await
            .unwrap_or_else(|e| self.fail(format!("GET {url}: {e}")));
        self.ensure(status.is_success(), || {
            format!("GET {url}: HTTP {status}: {body}")
        });
        self.ensure(ct.starts_with("text/plain; version=0.0.4"), || {
            format!("GET {url}: content type {ct:?}, not the Prometheus text format")
        });
        body
    }

    // --------------------------------------------------------- trees --

    /// Fails unless `replica` holds exactly the files and directories of
    /// `original`, with the same bytes, modes and modification times.
    pub fn assert_same_tree(&self, original: &Path, replica: &Path) {
        self.compare(original, replica, true);
    }

    /// Like [`World::assert_same_tree`] but ignoring modification times:
    /// same entries, bytes and modes.
    pub fn assert_same_bytes(&self, original: &Path, replica: &Path) {
        self.compare(original, replica, false);
    }

    fn compare(&self, original: &Path, replica: &Path, mtimes: bool) {
        if let Err(e) = compare_trees(original, replica, mtimes) {
            self.fail(format!(
                "replica {} differs from {}: {e}",
                replica.display(),
                original.display()
            ));
        }
    }

    /// Fails unless the sink root holds nothing but the hidden `.ferry`
    /// directory.
    pub fn assert_nothing_published(&self) {
        let entries: Vec<String> = fs::read_dir(self.sink_root())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n != ".ferry")
            .collect();
        self.ensure(entries.is_empty(), || {
            format!(
                "the sink root {} should hold nothing but .ferry, found {entries:?}",
                self.sink_root().display()
            )
        });
    }
}

/// What a tree entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Dir,
    File,
    Other,
}

/// Every entry under `root` by relative path (`/`-separated).
pub fn walk(root: &Path) -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let e = e.unwrap();
            let p = e.path();
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            if e.file_type().unwrap().is_dir() {
                stack.push(p.clone());
            }
            out.insert(rel, p);
        }
    }
    out
}

/// Relative paths of the regular files under `root`, sorted.
pub fn files_under(root: &Path) -> Vec<String> {
    walk(root)
        .into_iter()
        .filter(|(_, p)| p.symlink_metadata().map(|m| m.is_file()).unwrap_or(false))
        .map(|(r, _)| r)
        .collect()
}

fn kind(md: &fs::Metadata) -> Kind {
    if md.is_dir() {
        Kind::Dir
    } else if md.is_file() {
        Kind::File
    } else {
        Kind::Other
    }
}

fn compare_trees(a: &Path, b: &Path, mtimes: bool) -> Result<(), String> {
    if !b.is_dir() {
        return Err(format!("{} is not a directory", b.display()));
    }
    let (ta, tb) = (walk(a), walk(b));
    let only_a: Vec<&String> = ta.keys().filter(|k| !tb.contains_key(*k)).collect();
    let only_b: Vec<&String> = tb.keys().filter(|k| !ta.contains_key(*k)).collect();
    if !only_a.is_empty() || !only_b.is_empty() {
        return Err(format!(
            "missing in the replica: {only_a:?}; extra in the replica: {only_b:?}"
        ));
    }
    let mut problems = Vec::new();
    for (rel, pa) in &ta {
        let pb = &tb[rel];
        let (ma, mb) = (
            pa.symlink_metadata().unwrap(),
            pb.symlink_metadata().unwrap(),
        );
        if kind(&ma) != kind(&mb) {
            problems.push(format!("{rel}: {:?} vs {:?}", kind(&ma), kind(&mb)));
            continue;
        }
        if kind(&ma) != Kind::File {
            continue;
        }
        if ma.len() != mb.len() {
            problems.push(format!("{rel}: {} bytes vs {} bytes", ma.len(), mb.len()));
            continue;
        }
        let (mode_a, mode_b) = (
            ma.permissions().mode() & 0o7777,
            mb.permissions().mode() & 0o7777,
        );
        if mode_a != mode_b {
            problems.push(format!("{rel}: mode {mode_a:o} vs {mode_b:o}"));
        }
        let (t_a, t_b) = ((ma.mtime(), ma.mtime_nsec()), (mb.mtime(), mb.mtime_nsec()));
        if mtimes && t_a != t_b {
            problems.push(format!("{rel}: mtime (s, ns) {t_a:?} vs {t_b:?}"));
        }
        if let Some(off) = first_difference(pa, pb) {
            problems.push(format!("{rel}: contents differ at byte {off}"));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{} difference(s):\n  {}",
            problems.len(),
            problems.join("\n  ")
        ))
    }
}

/// Offset of the first differing byte of two files of equal length.
fn first_difference(a: &Path, b: &Path) -> Option<u64> {
    let (mut fa, mut fb) = (File::open(a).unwrap(), File::open(b).unwrap());
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    let mut off = 0u64;
    loop {
        let n = read_full(&mut fa, &mut ba);
        let m = read_full(&mut fb, &mut bb);
        if n != m || ba[..n] != bb[..m] {
            let i = ba[..n]
                .iter()
                .zip(&bb[..m])
                .position(|(x, y)| x != y)
                .unwrap_or(n.min(m));
            return Some(off + i as u64);
        }
        if n == 0 {
            return None;
        }
        off += n as u64;
    }
}

fn read_full(f: &mut File, buf: &mut [u8]) -> usize {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]).unwrap() {
            0 => break,
            k => n += k,
        }
    }
    n
}

/// Total size of the regular files under `root`.
pub fn tree_bytes(root: &Path) -> u64 {
    files_under(root)
        .iter()
        .map(|f| root.join(f).metadata().unwrap().len())
        .sum()
}

/// Flips every bit of the byte at `offset` of `path`, in place.
pub fn flip_byte(path: &Path, offset: u64) {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, offset).unwrap();
    b[0] ^= 0xff;
    f.write_all_at(&b, offset).unwrap();
}

/// Copies the directory tree `from` to `to` (files and directories).
pub fn copy_tree(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &dest);
        } else {
            fs::copy(e.path(), &dest).unwrap();
        }
    }
}

/// The status-change time of `path` in nanoseconds.
pub fn ctime_ns(path: &Path) -> i128 {
    let md = path.symlink_metadata().unwrap();
    i128::from(md.ctime()) * 1_000_000_000 + i128::from(md.ctime_nsec())
}

/// `v[key]` as a string, or "" if absent.
pub fn s<'a>(v: &'a Value, key: &str) -> &'a str {
    v[key].as_str().unwrap_or("")
}

// ------------------------------------------------ API tokens and HTTPS --
// (used by tests/cli.rs)

/// `cfg.to_toml()` with tokens required (`allow_unauthenticated = false`)
/// and `extra` TOML lines appended to its `[api]` section: keys first
/// (e.g. `tls_cert = ...`), then `[[api.tokens]]` entries.
#[allow(dead_code)]
pub fn toml_with_api(cfg: &AgentConfig, extra: &str) -> String {
    let mut cfg = cfg.clone();
    cfg.api = format!("allow_unauthenticated = false\n{extra}\n");
    cfg.to_toml()
}

/// A token and its `[[api.tokens]]` entry, made by `ferry token new`.
#[allow(dead_code)]
#[derive(Debug, Clone)]
pub struct Token {
    /// The secret (the first line `ferry token new` prints).
    pub token: String,
    /// The rest of what it printed: TOML comments and the entry.
    pub entry: String,
}

#[allow(dead_code)]
impl World {
    /// `ferry token new --role ROLE --name NAME`.
    pub async fn token_new(&self, role: &str, name: &str) -> Token {
        let out = self
            .ferry(
                &["token", "new", "--role", role, "--name", name],
                &[],
                Duration::from_secs(30),
            )
            .await;
        self.ensure(out.success(), || format!("ferry token new failed: {out}"));
        let (token, entry) = out
            .stdout
            .split_once('\n')
            .unwrap_or_else(|| self.fail(format!("ferry token new printed one line: {out}")));
        Token {
            token: token.to_string(),
            entry: entry.to_string(),
        }
    }

    /// Like [`World::start_agent`] but the config file holds `toml` (e.g.
    /// from [`toml_with_api`]) and readiness is `health_url` answering
    /// through `client` (e.g. an `https://` URL and a client trusting the
    /// API's CA).
    pub async fn start_agent_toml(
        &self,
        label: &str,
        cfg: AgentConfig,
        toml: &str,
        health_url: &str,
        client: &reqwest::Client,
    ) -> Agent {
        let dir = self.root.join(label);
        fs::create_dir_all(&dir).unwrap();
        let config_path = dir.join("ferry.toml");
        fs::write(&config_path, toml).unwrap();
        let stderr_path = dir.join("stderr.log");
        self.logs
            .lock()
            .unwrap()
            .push((format!("{label} stderr"), stderr_path.clone()));
        let mut cmd = Command::new(FERRY);
        cmd.args(["serve", "--config", config_path.to_str().unwrap()])
            .current_dir(&dir)
            .env_remove("FERRY_CONFIG")
            .env_remove("FERRY_LOG")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(File::create(dir.join("stdout.log")).unwrap())
            .stderr(File::create(&stderr_path).unwrap());
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| self.fail(format!("cannot start {label}: {e}")));
        let mut proc = Proc { child };
        self.wait_until(
            &format!("{label} to answer {health_url}"),
            STARTUP,
            async || {
                if let Some(status) = proc.exited() {
                    self.fail(format!("{label} exited during startup: {status}"));
                }
                match client.get(health_url).send().await {
                    Ok(r) if r.status().is_success() => Ok(()),
                    Ok(r) => Err(format!("HTTP {}", r.status())),
                    Err(e) => Err(e.to_string()),
                }
            },
        )
        .await;
        Agent {
            label: label.into(),
            cfg,
            config_path,
            stderr_path,
            env: Vec::new(),
            wrap: Vec::new(),
            dir,
            proc: Some(proc),
        }
    }

    /// A plain HTTP client (15 s timeout), as the harness uses.
    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }
}

// ------------------------------------------------------- fault tests --
// (used by tests/faults.rs)

/// `Ok` if `replica` holds exactly the files and directories of
/// `original` with the same bytes, modes and modification times; what
/// differs otherwise. The non-failing form of
/// [`World::assert_same_tree`], for oracles that count.
#[allow(dead_code)]
pub fn tree_diff(original: &Path, replica: &Path) -> Result<(), String> {
    compare_trees(original, replica, true)
}

/// `GET /metrics` of `agent`, parsed as Prometheus text.
pub async fn scrape(w: &World, agent: &Agent) -> prometheus_parse::Scrape {
    let text = w.metrics_text(agent).await;
    prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).unwrap_or_else(|e| {
        w.fail(format!(
            "{} /metrics does not parse: {e}\n{text}",
            agent.label
        ))
    })
}

/// The value of the one sample of `name` with `labels` (among others),
/// if there is one; a histogram's `_sum` and `_count` are samples of
/// their own.
pub fn metric(s: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut found = s
        .samples
        .iter()
        .filter(|x| x.metric == name && labels.iter().all(|(k, v)| x.labels.get(k) == Some(*v)));
    let one = found.next()?;
    assert!(found.next().is_none(), "more than one {name}{labels:?}");
    match one.value {
        prometheus_parse::Value::Counter(v)
        | prometheus_parse::Value::Gauge(v)
        | prometheus_parse::Value::Untyped(v) => Some(v),
        _ => None,
    }
}

// ------------------------------------------------------ storage servers --

/// The value of `var`, set by the test command once it started the
/// storage servers (`ops/with-test-servers`); panics naming that command
/// when unset, so a test never skips silently.
#[allow(dead_code)]
pub fn server_env(var: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| {
        panic!(
            "{var} is not set: this test needs the storage servers that ops/test starts \
             (run ops/test, or ops/with-test-servers cargo test --test NAME)"
        )
    })
}

/// A directory or key prefix of a test's own in a shared store:
/// `/<area>/<name>-<pid>-<ns since the epoch>`.
#[allow(dead_code)]
pub fn unique_in(area: &str, name: &str) -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("/{area}/{name}-{}-{t}", std::process::id())
}
