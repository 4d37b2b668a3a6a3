//! `ferry serve` configuration: TOML, every key documented with its default
//! and unit in `ops/ferry.example.toml`. Unknown keys are errors; every
//! error names the key (TOML errors quote the offending line).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use ferry_proto::units::parse_size;
use replicator::sink::pressure::{SpacePressure, Threshold};
use serde::{Deserialize, Deserializer};

/// The whole file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `[agent]`
    pub agent: AgentSection,
    /// `[api]`
    #[serde(default)]
    pub api: ApiSection,
    /// `[quic]`
    #[serde(default)]
    pub quic: QuicSection,
    /// `[tls]`
    pub tls: TlsSection,
    /// `[[links]]`
    #[serde(default)]
    pub links: Vec<LinkSection>,
    /// `[[jobs]]`
    #[serde(default)]
    pub jobs: Vec<JobSection>,
    /// `[source]`
    pub source: Option<SourceSection>,
    /// `[sink]`
    pub sink: Option<SinkSection>,
    /// `[scheduler]`; every key optional.
    #[serde(default)]
    pub scheduler: SchedulerSection,
    /// `[catalog]`; absent = SQLite in `agent.data_dir`.
    #[serde(default)]
    pub catalog: CatalogSection,
    /// `[pool]`; every key optional.
    #[serde(default)]
    pub pool: PoolSection,
}

/// `[pool]`: the timing of the agent's membership of its site's pool
/// (agents sharing one PostgreSQL catalog; a single agent on SQLite is a
/// pool of one). See [`replicator::pool`].
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSection {
    /// How often the agent writes its heartbeat and renews its transfer
    /// leases. Default 2 s.
    #[serde(default = "default_heartbeat", with = "humantime_serde")]
    pub heartbeat_interval: Duration,
    /// How long the agent's leases (and its membership) last without a
    /// heartbeat: after this other agents see it down and take its
    /// transfers and parts over. At least three heartbeat intervals;
    /// shorter than the QUIC idle timeout (10 s) is advised (said at
    /// start otherwise). Default 9 s.
    #[serde(default = "default_lease_timeout", with = "humantime_serde")]
    pub lease_timeout: Duration,
    /// Payload per part of a striped transfer (`"256MiB"`): on a
    /// PostgreSQL catalog a pushed transfer's chunks (and a watched one's
    /// complete files while it is written, and what is left of it at its
    /// commit) are grouped into parts of about this size, which every
    /// source agent of the pool claims and sends. At least 1MiB. Default
    /// 256MiB.
    #[serde(default = "default_part_size", deserialize_with = "de_size")]
    pub part_size: u64,
    /// Most parts one agent holds at once (1..64). Default 4.
    #[serde(default = "default_max_parts")]
    pub max_parts: usize,
    /// Stripe what can no longer change of a watched checkpoint still
    /// being written (complete files, full chunks of files only ever
    /// appended to) across the pool, once more than one part per live
    /// source agent of it waits; false leaves it to the watching agent
    /// until the commit. Default true.
    #[serde(default = "default_true")]
    pub stripe_while_writing: bool,
}

fn default_part_size() -> u64 {
    replicator::pool::DEFAULT_PART_SIZE
}

fn default_max_parts() -> usize {
    replicator::pool::DEFAULT_MAX_PARTS
}

fn default_heartbeat() -> Duration {
    replicator::pool::PoolConfig::default().heartbeat_interval
}

fn default_lease_timeout() -> Duration {
    replicator::pool::PoolConfig::default().lease_timeout
}

impl Default for PoolSection {
    fn default() -> Self {
        PoolSection {
            heartbeat_interval: default_heartbeat(),
            lease_timeout: default_lease_timeout(),
            part_size: default_part_size(),
            max_parts: default_max_parts(),
            stripe_while_writing: true,
        }
    }
}

impl PoolSection {
    /// The pool's timing.
    pub fn config(&self) -> replicator::pool::PoolConfig {
        replicator::pool::PoolConfig {
            heartbeat_interval: self.heartbeat_interval,
            lease_timeout: self.lease_timeout,
            part_size: self.part_size,
            max_parts: self.max_parts,
            stripe_while_writing: self.stripe_while_writing,
        }
    }
}

/// The environment variable that overrides `catalog.url` (a
/// `postgres://` URL; empty = not set).
pub const CATALOG_URL_ENV: &str = "FERRY_CATALOG_URL";

/// `[catalog]`: where the agent's catalog lives. Without `url` (and
/// without [`CATALOG_URL_ENV`]) it is SQLite, `agent.data_dir/ferry.db`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CatalogSection {
    /// `postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE`: the site's
    /// PostgreSQL catalog, one database per site. Shown everywhere with
    /// its password as `***`.
    pub url: Option<ferry_catalog::PostgresUrl>,
    /// A file holding the password (one line), so the config file need
    /// not; relative to the config file's directory.
    pub password_file: Option<PathBuf>,
}

/// What an agent does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Sends checkpoints.
    Source,
    /// Receives and publishes replicas.
    Sink,
    /// Both.
    Both,
}

/// `[agent]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentSection {
    /// Agent name; must equal its certificate's SAN.
    pub name: String,
    /// Site (datacenter) name.
    pub site: String,
    /// `source`, `sink` or `both`.
    pub role: Role,
    /// Directory for the catalog; default `./ferry-data`.
    #[serde(default = "default_data_dir")]
    pub data_dir: PathBuf,
}

fn default_data_dir() -> PathBuf {
    PathBuf::from("ferry-data")
}

/// `[api]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiSection {
    /// Listen address (HTTPS with `tls_cert` and `tls_key`, plain HTTP
    /// otherwise); default `127.0.0.1:7070`. Without TLS it must be a
    /// loopback address unless `allow_plaintext` is set.
    #[serde(default = "default_api_listen")]
    pub listen: SocketAddr,
    /// PEM certificate chain (leaf first) the API serves HTTPS with;
    /// relative to the config file. Given with `tls_key` or not at all;
    /// default none (plain HTTP).
    #[serde(default)]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `tls_cert`; relative to the config file.
    #[serde(default)]
    pub tls_key: Option<PathBuf>,
    /// Serve plain HTTP on a non-loopback `listen` (tokens then cross the
    /// network in clear; only for a trusted management network); default
    /// false.
    #[serde(default)]
    pub allow_plaintext: bool,
    /// Serve requests without a token as if they had every role (a local
    /// demo only); default false.
    #[serde(default)]
    pub allow_unauthenticated: bool,
    /// `[[api.tokens]]`: accepted bearer tokens, by hash.
    #[serde(default)]
    pub tokens: Vec<TokenSection>,
    /// Most API connections open at once (more are closed at once);
    /// default 256.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
}

fn default_max_connections() -> usize {
    crate::apiserve::DEFAULT_MAX_CONNECTIONS
}

impl Default for ApiSection {
    fn default() -> Self {
        ApiSection {
            listen: default_api_listen(),
            tls_cert: None,
            tls_key: None,
            allow_plaintext: false,
            allow_unauthenticated: false,
            tokens: Vec::new(),
            max_connections: default_max_connections(),
        }
    }
}

/// `[[api.tokens]]`: one accepted token (`ferry token new` prints the
/// entry).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenSection {
    /// Name shown in logs and 403 answers instead of the token.
    pub name: String,
    /// `reader`, `signaler` or `operator`.
    pub role: String,
    /// `blake3:<64 hex digits>`, the BLAKE3 hash of the token.
    pub hash: String,
}

impl ApiSection {
    /// The API's certificate and key files when HTTPS is configured.
    ///
    /// # Errors
    /// A message naming `api.tls_cert` or `api.tls_key` when only one of
    /// them is given.
    pub fn tls(&self) -> Result<Option<(&Path, &Path)>> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(c), Some(k)) => Ok(Some((c.as_path(), k.as_path()))),
            (None, None) => Ok(None),
            (Some(_), None) => bail!(
                "api.tls_cert is set but api.tls_key is not: give both (HTTPS) or neither (plain HTTP on loopback)"
            ),
            (None, Some(_)) => bail!(
                "api.tls_key is set but api.tls_cert is not: give both (HTTPS) or neither (plain HTTP on loopback)"
            ),
        }
    }

    /// Checks the transport settings: TLS files both or neither, and no
    /// plain HTTP on a non-loopback address unless `allow_plaintext`.
    ///
    /// # Errors
    /// A message naming the key and how to fix it.
    pub fn check_transport(&self) -> Result<()> {
        let tls = self.tls()?;
        if tls.is_none() && !self.listen.ip().is_loopback() && !self.allow_plaintext {
            bail!(
                "api.listen = \"{}\" is not a loopback address and the API has no TLS: \
                 tokens and answers would cross the network in clear. Set api.tls_cert and \
                 api.tls_key to serve HTTPS (`ferry certs init --api-host HOST` makes a \
                 certificate), listen on 127.0.0.1, or set api.allow_plaintext = true for a \
                 trusted management network",
                self.listen
            );
        }
        if self.allow_unauthenticated && !self.listen.ip().is_loopback() {
            bail!(
                "api.allow_unauthenticated = true needs a loopback api.listen (it is \"{}\"): \
                 anyone reaching the port could act as an operator. Make tokens with \
                 `ferry token new --role R` instead",
                self.listen
            );
        }
        if self.max_connections == 0 {
            bail!("api.max_connections must be at least 1");
        }
        Ok(())
    }

    /// The access rule these settings describe.
    ///
    /// # Errors
    /// A message naming the bad `api.tokens` entry.
    pub fn auth(&self) -> Result<api::Auth> {
        let mut entries = Vec::new();
        for (i, t) in self.tokens.iter().enumerate() {
            if t.name.is_empty() {
                bail!("api.tokens[{i}].name must not be empty");
            }
            if self.tokens[..i].iter().any(|o| o.name == t.name) {
                bail!("api.tokens[{i}].name {:?} is used twice", t.name);
            }
            let role: api::Role = t
                .role
                .parse()
                .map_err(|e| anyhow::anyhow!("api.tokens[{i}].role: {e}"))?;
            let hash = api::auth::parse_hash(&t.hash)
                .map_err(|e| anyhow::anyhow!("api.tokens[{i}].hash: {e}"))?;
            if entries.iter().any(|e: &api::TokenEntry| e.hash == hash) {
                bail!("api.tokens[{i}].hash is the hash of an earlier entry's token");
            }
            entries.push(api::TokenEntry {
                name: t.name.clone(),
                role,
                hash,
            });
        }
        Ok(if self.allow_unauthenticated {
            api::Auth::open(entries)
        } else {
            api::Auth::tokens(entries)
        })
    }
}

fn default_api_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 7070))
}

/// `[quic]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuicSection {
    /// UDP listen address (sinks accept here; sources dial from here);
    /// default `0.0.0.0:7443` for sinks, `0.0.0.0:0` for sources.
    pub listen: Option<SocketAddr>,
    /// Largest link rate this sink serves, sizing receive windows
    /// (bit/s); default 1 Gbit/s.
    #[serde(default = "default_rate", deserialize_with = "de_rate")]
    pub max_link_rate: u64,
    /// Largest RTT this sink serves, sizing receive windows; default 200 ms.
    #[serde(default = "default_max_rtt", with = "humantime_serde")]
    pub max_rtt: Duration,
}

impl Default for QuicSection {
    fn default() -> Self {
        QuicSection {
            listen: None,
            max_link_rate: default_rate(),
            max_rtt: default_max_rtt(),
        }
    }
}

fn default_rate() -> u64 {
    1_000_000_000
}
fn default_max_rtt() -> Duration {
    Duration::from_millis(200)
}

/// `[tls]`: PEM files; relative paths are relative to the config file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSection {
    /// CA certificate.
    pub ca: PathBuf,
    /// This agent's certificate (SAN = agent name).
    pub cert: PathBuf,
    /// This agent's private key.
    pub key: PathBuf,
}

/// `[[links]]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkSection {
    /// Link name.
    pub name: String,
    /// Sink address `host:port` (or a link emulator in front of it).
    pub peer: String,
    /// Agent name the sink's certificate must carry.
    pub peer_name: String,
    /// Further sink agents of the peer site's pool, tried in order after
    /// `peer` (`[{ peer = "host:port", peer_name = "..." }, ...]`); they
    /// share the peer site's catalog and sink root. Default: none.
    #[serde(default)]
    pub more_peers: Vec<MorePeer>,
    /// Ferry's share of the WAN, e.g. `"1Gbit/s"`.
    #[serde(deserialize_with = "de_rate")]
    pub rate: u64,
    /// Expected base RTT, e.g. `"100ms"`; default 100 ms.
    #[serde(default = "default_rtt", with = "humantime_serde")]
    pub rtt_hint: Duration,
    /// QUIC connections serving the link, 1 to 64, each on its own UDP
    /// socket, the link's rate split evenly across their congestion
    /// controllers. Default: one per 2 Gbit/s of `rate` (rounded up), at
    /// most one per core of the host and at most 16
    /// (`replicator::source::default_connections`).
    #[serde(default)]
    pub connections: Option<usize>,
}

/// One entry of `[[links]] more_peers`: another sink agent of the link's
/// peer site.
#[derive(Debug, Clone, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table { peer = \"host:port\", peer_name = \"...\" }"
)]
pub struct MorePeer {
    /// Its QUIC address `host:port` (or a link emulator in front of it).
    pub peer: String,
    /// The agent name its certificate must carry.
    pub peer_name: String,
}

impl LinkSection {
    /// The link's sink agents after the first, as the source dials them.
    pub fn more_peers(&self) -> Vec<replicator::source::SinkPeer> {
        self.more_peers
            .iter()
            .map(|p| replicator::source::SinkPeer {
                addr: p.peer.clone(),
                name: p.peer_name.clone(),
            })
            .collect()
    }

    /// The configured connection count, or the default for the link's
    /// rate on this host's cores.
    pub fn connections(&self) -> usize {
        self.connections.unwrap_or_else(|| {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            replicator::source::default_connections(self.rate, cores)
        })
    }
}

fn default_rtt() -> Duration {
    Duration::from_millis(100)
}

/// `[[jobs]]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSection {
    /// Job name.
    pub name: String,
    /// Model size in parameters (finite, >= 0); default 0 = unknown (the
    /// score's size term is then 1).
    #[serde(default)]
    pub model_params: f64,
    /// Importance 0..1; default 0.
    #[serde(default)]
    pub importance: f64,
}

/// `[scheduler]`: how transfers are ranked and share a link (ARCHITECTURE.md
/// "Classes and score"). Every key is optional and defaults to
/// [`scheduler::Policy::default()`]; [`SchedulerSection::policy`] turns it
/// into the scheduler's settings.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SchedulerSection {
    /// `"priority"` (default: classes, floors and scores) or `"fifo"`
    /// (first come, first served; the baseline).
    pub policy: String,
    /// `T` of the aging term `min(1 + waiting / T, cap)`; default `"10m"`.
    #[serde(with = "humantime_serde")]
    pub aging: Duration,
    /// `cap` of the aging term, 1..1000; default 2.0.
    pub aging_cap: f64,
    /// Half-life of a signal's severity; default `"10m"`.
    #[serde(with = "humantime_serde")]
    pub severity_half_life: Duration,
    /// How long a signal keeps its job's newest unpublished checkpoint
    /// `urgent`; default `"30m"`.
    #[serde(with = "humantime_serde")]
    pub urgent_for: Duration,
    /// Transfers of one class moving at once on one link, 1..64; default 4.
    pub max_active: usize,
    /// A transfer whose size is known and at most this is small: it does
    /// not count against `max_active`; default `"16MiB"`, at most 1GiB.
    #[serde(deserialize_with = "de_size")]
    pub small_transfer: u64,
    /// Small transfers moving at once on one link (all classes together),
    /// 0..4096; 0 turns the rule off; default 256.
    pub max_small_active: usize,
    /// Within a class, serve transfers with a deadline earliest deadline
    /// first while one of their deadlines is at risk, and start them at
    /// once; default true (false: by score like the others).
    pub deadline_first: bool,
    /// `[scheduler.weights]`
    pub weights: WeightsSection,
    /// `[scheduler.floors]`
    pub floors: FloorsSection,
}

/// `[scheduler.weights]`: the weights of the score's terms, each 0..100.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WeightsSection {
    /// `a`, per decade of model parameters above 1e9; default 0.5.
    pub model_size: f64,
    /// `b`, times the importance (0..1); default 1.0.
    pub importance: f64,
    /// `c`, times the live signal severity (0..1); default 2.0.
    pub severity: f64,
}

/// `[scheduler.floors]`: the share (0..0.5 of the link's rate) a lower
/// class keeps while a higher class is busy.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FloorsSection {
    /// Floor of `scheduled` while `urgent` is busy; default 0.10.
    pub scheduled: f64,
    /// Floor of `background` while a higher class is busy; default 0.05.
    pub background: f64,
}

impl Default for WeightsSection {
    fn default() -> Self {
        let w = scheduler::Weights::default();
        WeightsSection {
            model_size: w.size,
            importance: w.importance,
            severity: w.severity,
        }
    }
}

impl Default for FloorsSection {
    fn default() -> Self {
        let f = scheduler::Floors::default();
        FloorsSection {
            scheduled: f.scheduled,
            background: f.background,
        }
    }
}

impl Default for SchedulerSection {
    fn default() -> Self {
        let p = scheduler::Policy::default();
        SchedulerSection {
            policy: p.kind.as_str().into(),
            aging: Duration::from_millis(p.aging_ms),
            aging_cap: p.aging_cap,
            severity_half_life: Duration::from_millis(p.severity_half_life_ms),
            urgent_for: Duration::from_millis(p.urgent_for_ms),
            max_active: p.max_active,
            small_transfer: p.small_bytes,
            max_small_active: p.max_small_active,
            deadline_first: p.deadline_first,
            weights: WeightsSection::default(),
            floors: FloorsSection::default(),
        }
    }
}

impl SchedulerSection {
    /// The scheduler's settings, checked with [`scheduler::Policy::check`].
    /// Durations are truncated to whole milliseconds.
    ///
    /// # Errors
    /// A message naming the key, prefixed `scheduler.` (e.g.
    /// `scheduler.floors.scheduled must be from 0 to 0.5, got 0.9`).
    pub fn policy(&self) -> Result<scheduler::Policy> {
        use scheduler::PolicyKind;
        let kind = match self.policy.as_str() {
            "priority" => PolicyKind::Priority,
            "fifo" => PolicyKind::Fifo,
            o => bail!("scheduler.policy must be \"priority\" or \"fifo\", got {o:?}"),
        };
        let ms = |key: &str, d: Duration| {
            u64::try_from(d.as_millis()).map_err(|_| {
                anyhow::anyhow!(
                    "scheduler.{key} is too long, got {}",
                    humantime::format_duration(d)
                )
            })
        };
        let p = scheduler::Policy {
            kind,
            weights: scheduler::Weights {
                size: self.weights.model_size,
                importance: self.weights.importance,
                severity: self.weights.severity,
            },
            aging_ms: ms("aging", self.aging)?,
            aging_cap: self.aging_cap,
            severity_half_life_ms: ms("severity_half_life", self.severity_half_life)?,
            urgent_for_ms: ms("urgent_for", self.urgent_for)?,
            floors: scheduler::Floors {
                scheduled: self.floors.scheduled,
                background: self.floors.background,
            },
            max_active: self.max_active,
            small_bytes: self.small_transfer,
            max_small_active: self.max_small_active,
            deadline_first: self.deadline_first,
        };
        p.check().map_err(|e| anyhow::anyhow!("scheduler.{e}"))?;
        Ok(p)
    }
}

/// `[source]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceSection {
    /// `[source.s3]`: how to reach the `s3://` roots of `[[source.roots]]`
    /// (the keys of `[sink.s3]`).
    #[serde(default)]
    pub s3: Option<S3Section>,
    /// Chunk size; default `"4MiB"`.
    #[serde(default = "default_chunk", deserialize_with = "de_size")]
    pub chunk_size: u64,
    /// Commit marker file names (generic rule); default `["COMMITTED"]`.
    #[serde(default = "default_markers")]
    pub markers: Vec<String>,
    /// Stream writers per connection of a link (data streams in flight on
    /// each connection, shared by the link's transfers); default 4.
    #[serde(default = "default_streams")]
    pub streams: usize,
    /// Payload bytes per batch (stream); default `"16MiB"`.
    #[serde(default = "default_batch", deserialize_with = "de_size")]
    pub batch_size: u64,
    /// How often the watcher rescans the roots (the safety net under
    /// inotify, the period in poll mode); default `"2s"`; `"0s"` turns the
    /// watcher off.
    #[serde(default = "default_scan", with = "humantime_serde")]
    pub scan_interval: Duration,
    /// A file with no close event seen counts as complete once unchanged
    /// for this long and passing its format check; default `"2s"`.
    #[serde(default = "default_quiet", with = "humantime_serde")]
    pub quiet_period: Duration,
    /// An open checkpoint with no change for this long is abandoned (its
    /// transfer cancelled, the sink's staging removed); default `"30m"`.
    #[serde(default = "default_idle", with = "humantime_serde")]
    pub checkpoint_idle_timeout: Duration,
    /// Signal kinds that pin the checkpoints around the signal at the
    /// sinks (the last before its step and the first at or after it);
    /// default every kind, `[]` for none.
    #[serde(default = "default_pin_on")]
    pub pin_on: Vec<String>,
    /// How long a signal's pins last; default `"7d"`.
    #[serde(default = "default_pin_for", with = "humantime_serde")]
    pub pin_for: Duration,
    /// `[[source.roots]]`
    #[serde(default)]
    pub roots: Vec<RootSection>,
}

fn default_pin_on() -> Vec<String> {
    replicator::source::SIGNAL_KINDS
        .iter()
        .map(|k| k.to_string())
        .collect()
}
fn default_pin_for() -> Duration {
    Duration::from_secs(7 * 86_400)
}

fn default_chunk() -> u64 {
    4 << 20
}
fn default_markers() -> Vec<String> {
    vec!["COMMITTED".into()]
}
fn default_streams() -> usize {
    4
}
fn default_batch() -> u64 {
    16 << 20
}
fn default_scan() -> Duration {
    Duration::from_secs(2)
}
fn default_quiet() -> Duration {
    Duration::from_secs(2)
}
fn default_idle() -> Duration {
    Duration::from_secs(30 * 60)
}
fn default_auto() -> String {
    "auto".into()
}
fn default_start() -> String {
    "on_open".into()
}
fn default_mode() -> String {
    "inotify".into()
}
fn default_select() -> String {
    "all".into()
}
fn default_profile() -> String {
    "full".into()
}

/// `[[source.roots]]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RootSection {
    /// Directory holding a job's checkpoints.
    pub path: PathBuf,
    /// Job name.
    pub job: String,
    /// Link name.
    pub link: String,
    /// Checkpoint format (`dcp`, `torchtitan`, `megatron`, `megatron_dist`,
    /// `deepspeed`, `hf`, `hf_trainer`, `nemo`, `orbax`, `bytecheckpoint`,
    /// `generic`) or `auto` (default).
    #[serde(default = "default_auto")]
    pub format: String,
    /// `on_open` (default) or `on_commit`.
    #[serde(default = "default_start")]
    pub start: String,
    /// `inotify` (default) or `poll`.
    #[serde(default = "default_mode")]
    pub mode: String,
    /// Globs of files to replicate (relative to the checkpoint
    /// directory); default all.
    #[serde(default)]
    pub include: Vec<String>,
    /// Globs of files never replicated.
    #[serde(default)]
    pub exclude: Vec<String>,
    /// `all` (default), `latest_only` or `every_n_steps`.
    #[serde(default = "default_select")]
    pub select: String,
    /// The eval cadence for `select = "every_n_steps"`.
    #[serde(default)]
    pub every_n_steps: Option<u64>,
    /// `full` (default) or `weights-only` (no optimizer state; formats
    /// that keep it in separate files only).
    #[serde(default = "default_profile")]
    pub profile: String,
    /// `whole` (default): one publish of the replica. `weights-first`
    /// (with `profile = "full"`): metadata and weight files cross first
    /// and a weights-only version is published at the commit while the
    /// optimizer state still moves; the full replica replaces it.
    /// Refused for formats that do not keep them in separate files.
    #[serde(default = "default_publish")]
    pub publish: String,
}

fn default_publish() -> String {
    "whole".into()
}

impl RootSection {
    /// A root with the defaults of every optional key.
    pub fn new(path: PathBuf, job: &str, link: &str) -> RootSection {
        RootSection {
            path,
            job: job.into(),
            link: link.into(),
            format: default_auto(),
            start: default_start(),
            mode: default_mode(),
            include: Vec::new(),
            exclude: Vec::new(),
            select: default_select(),
            every_n_steps: None,
            profile: default_profile(),
            publish: default_publish(),
        }
    }

    /// The watcher settings of root number `i`.
    ///
    /// # Errors
    /// A message naming the key (`source.roots[i].format` ...) and the
    /// values it accepts.
    pub fn watch(&self, i: usize) -> Result<replicator::source::watcher::RootWatch> {
        use ferry_proto::state::Profile;
        use replicator::source::watcher::{Mode, RootWatch, Selection, Start};
        let format = match self.format.as_str() {
            "auto" => None,
            f => Some(
                f.parse()
                    .map_err(|e| anyhow::anyhow!("source.roots[{i}].format: {e}"))?,
            ),
        };
        let start = match self.start.as_str() {
            "on_open" => Start::OnOpen,
            "on_commit" => Start::OnCommit,
            o => bail!("source.roots[{i}].start must be \"on_open\" or \"on_commit\", got {o:?}"),
        };
        let mode = match self.mode.as_str() {
            // A root in HDFS or S3 has no events to follow: always polled.
            _ if replicator::storage::router::is_url(&self.path) => Mode::Poll,
            "inotify" => Mode::Inotify,
            "poll" => Mode::Poll,
            o => bail!("source.roots[{i}].mode must be \"inotify\" or \"poll\", got {o:?}"),
        };
        let select = match (self.select.as_str(), self.every_n_steps) {
            ("all", None) => Selection::All,
            ("latest_only", None) => Selection::LatestOnly,
            ("every_n_steps", Some(n)) if n > 0 => Selection::EveryNSteps(n),
            ("every_n_steps", _) => {
                bail!("source.roots[{i}].every_n_steps must be a positive number with select = \"every_n_steps\"")
            }
            ("all" | "latest_only", Some(_)) => {
                bail!("source.roots[{i}].every_n_steps needs select = \"every_n_steps\"")
            }
            (o, _) => bail!(
                "source.roots[{i}].select must be \"all\", \"latest_only\" or \"every_n_steps\", got {o:?}"
            ),
        };
        let profile = match self.profile.as_str() {
            "full" => Profile::Full,
            "weights-only" => Profile::WeightsOnly,
            o => bail!("source.roots[{i}].profile must be \"full\" or \"weights-only\", got {o:?}"),
        };
        if let (Profile::WeightsOnly, Some(f)) = (profile, format) {
            replicator::formats::is_optimizer_state(f, "").map_err(|why| {
                anyhow::anyhow!("source.roots[{i}].profile = \"weights-only\" is not possible with format = \"{f}\": {why}")
            })?;
        }
        let profile = match (self.publish.as_str(), profile) {
            ("whole", p) => p,
            ("weights-first", Profile::Full) => {
                if let Some(f) = format {
                    replicator::formats::splits_weights(f).map_err(|why| {
                        anyhow::anyhow!("source.roots[{i}].publish = \"weights-first\" is not possible with format = \"{f}\": {why}")
                    })?;
                }
                Profile::WeightsFirst
            }
            ("weights-first", _) => bail!(
                "source.roots[{i}].publish = \"weights-first\" needs profile = \"full\" (a weights-only root publishes its weights alone already)"
            ),
            (o, _) => bail!(
                "source.roots[{i}].publish must be \"whole\" or \"weights-first\", got {o:?}"
            ),
        };
        let w = RootWatch {
            format,
            start,
            mode,
            include: self.include.clone(),
            exclude: self.exclude.clone(),
            select,
            profile,
        };
        replicator::source::watcher::check_globs(&w)
            .map_err(|e| anyhow::anyhow!("source.roots[{i}]: {e}"))?;
        Ok(w)
    }
}

/// `[sink]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SinkSection {
    /// Where replicas go (staging under `.ferry/` there): a local
    /// directory, an HDFS directory (`hdfs://namenode:8020/eval`; Kerberos
    /// and HA name services come from `HADOOP_CONF_DIR`), or an S3 bucket
    /// prefix (`s3://bucket/eval`, see `[sink.s3]`).
    pub root: PathBuf,
    /// On an HDFS or S3 root: bytes replicas may fill there (a size,
    /// `"20TiB"`), the base of `reserve` and space pressure. Unset: the
    /// HDFS directory's space quota, or unknown (no space check) on S3. A
    /// local root uses its file system's size and refuses this key.
    #[serde(default, deserialize_with = "de_size_opt")]
    pub capacity: Option<u64>,
    /// `[sink.s3]`: how to reach an `s3://` root.
    #[serde(default)]
    pub s3: Option<S3Section>,
    /// `[sink.hdfs]`: hot-file replication hints and versions of an
    /// `hdfs://` root.
    #[serde(default)]
    pub hdfs: Option<HdfsSinkSection>,
    /// Source agent names allowed to connect; default: any with a
    /// certificate from the CA.
    #[serde(default)]
    pub accept_peers: Vec<String>,
    /// Free space to keep in the sink's file system; default `"1GiB"`.
    #[serde(default = "default_reserve", deserialize_with = "de_size")]
    pub reserve: u64,
    /// Read every staged chunk back and check its BLAKE3 hash before
    /// publishing (bytes changed on disk since they arrived, and files a
    /// re-save shares with the previous replica, are checked; a mismatch
    /// is fetched again); default `true`.
    #[serde(default = "default_true")]
    pub reread_before_publish: bool,
    /// `[[sink.retention]]`: retention policies, the first whose `job`
    /// glob matches a job applies to it; none keeps every replica.
    #[serde(default)]
    pub retention: Vec<RetentionSection>,
    /// How often the retention policies run besides after each publish;
    /// default `"60s"`.
    #[serde(default = "default_retention_interval", with = "humantime_serde")]
    pub retention_interval: Duration,
    /// Space pressure: when free space falls below `min_free` (a size,
    /// `"50GB"`, or a share of the file system's capacity, `"10%"`), the
    /// sink removes replicas until `target_free` is free: staging of
    /// failed transfers, what a policy expires, then background before
    /// scheduled before urgent replicas, oldest first, never a pinned one,
    /// a job's newest or one younger than its policy's `min_age`. Set both
    /// or neither; both above `reserve`. Unset: nothing is removed for
    /// space.
    #[serde(default, deserialize_with = "de_threshold_opt")]
    pub min_free: Option<Threshold>,
    /// See `min_free`; at least `min_free`.
    #[serde(default, deserialize_with = "de_threshold_opt")]
    pub target_free: Option<Threshold>,
    /// `[[sink.webhooks]]`: URLs each publish event (published, replaced,
    /// removed) of matching jobs is POSTed to, signed.
    #[serde(default)]
    pub webhooks: Vec<WebhookSection>,
}

/// `[[sink.webhooks]]`: one receiver of publish events (see
/// `crate::webhooks`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookSection {
    /// `http://` or `https://` URL events are POSTed to.
    pub url: String,
    /// Jobs whose events go there, a glob; default `"*"`.
    #[serde(default = "default_glob")]
    pub job: String,
    /// File holding the shared secret the body is signed with
    /// (`Ferry-Signature: sha256=<hex HMAC-SHA256>`); a trailing newline
    /// is not part of it.
    pub secret_file: PathBuf,
}

fn default_glob() -> String {
    "*".into()
}

impl WebhookSection {
    /// The hook, ready to run: the URL checked, the glob compiled, the
    /// secret read.
    ///
    /// # Errors
    /// A message naming the bad key.
    pub fn webhook(&self) -> Result<crate::webhooks::Webhook> {
        let u = reqwest::Url::parse(&self.url)
            .map_err(|e| anyhow::anyhow!("url {:?}: {e}", self.url))?;
        if !matches!(u.scheme(), "http" | "https") {
            bail!("url {:?} must be http:// or https://", self.url);
        }
        let jobs = globset::Glob::new(&self.job)
            .map_err(|e| anyhow::anyhow!("job {:?} is not a glob: {e}", self.job))?
            .compile_matcher();
        Ok(crate::webhooks::Webhook {
            url: self.url.clone(),
            jobs,
            secret: crate::webhooks::read_secret(&self.secret_file)?,
        })
    }
}

/// `[sink.hdfs]`: versions (`versions`), and replication hints for the files every eval rank reads
/// (`.metadata`, `metadata.json`, `common.pt`, `mp_rank_*_model_states.pt`,
/// `*.index.json`, `config.json`, plus `hot_files`), given in staging
/// before the publish and taken back after `hot_ttl`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HdfsSinkSection {
    /// Expected readers of each replica (eval ranks that start at once)
    /// when its transfer does not say (an announcement's or a push's
    /// `readers` wins); 0 (the default): hints only for transfers that
    /// say, and only with `datanodes` set.
    #[serde(default)]
    pub readers: u64,
    /// Readers one HDFS replica of a file serves safely; default 157 (the
    /// seed's guideline: 64 replicas for 10,000 readers, 128 for 20,000).
    #[serde(default = "default_readers_per_replica")]
    pub readers_per_replica: u64,
    /// DataNodes of the eval cluster: the factor never exceeds it.
    /// Required with `readers`; set alone, it enables the hints of
    /// transfers that say their readers.
    pub datanodes: Option<u16>,
    /// More globs over paths in a checkpoint directory that are hot.
    #[serde(default)]
    pub hot_files: Vec<String>,
    /// How long the hot files keep the raised factor; default `"6h"`.
    #[serde(default = "default_hot_ttl", with = "humantime_serde")]
    pub hot_ttl: Duration,
    /// The NameNode's HTTP address for its WebHDFS REST API
    /// (`http://eval-nn:9870`, Hadoop 3.3 or later), through which the
    /// sink sees where the raised replicas are placed; unset: the publish
    /// does not wait for them. Simple authentication only (the user
    /// name is sent as `user.name`); not for a Kerberos cluster.
    pub webhdfs: Option<String>,
    /// How long a publish waits for the hot files' raised replicas to be
    /// placed (with `webhdfs`); it goes ahead either way and logs what it
    /// saw. Default `"30s"`.
    #[serde(default = "default_hot_wait", with = "humantime_serde")]
    pub hot_wait: Duration,
    /// Publish each version into its own directory
    /// (`<root>/.ferry/versions/<id>`) and make the published path a
    /// pointer file `<path>.ferry-version` naming it: reader leases
    /// (`resolve --lease`) work, and a re-save never leaves a moment
    /// without a replica. Readers then find a replica only through
    /// `resolve`, `/v1/replicas` (whose `url` is the version's directory)
    /// or a mount table fed from them: nothing is at the published path
    /// itself. Default `false`: published in place at that path.
    #[serde(default)]
    pub versions: bool,
}

fn default_hot_wait() -> Duration {
    Duration::from_secs(30)
}

fn default_readers_per_replica() -> u64 {
    replicator::storage::hdfs::READERS_PER_REPLICA
}

fn default_hot_ttl() -> Duration {
    Duration::from_secs(6 * 3600)
}

impl HdfsSinkSection {
    /// The hints: `ceil(readers / readers_per_replica)` replicas, at most
    /// `datanodes`, with `readers` from the transfer when it says, else
    /// this section's; `None` with neither `readers` nor `datanodes`.
    ///
    /// # Errors
    /// `readers` without `datanodes`, a zero `readers_per_replica` or
    /// `hot_ttl`, or a glob that does not parse, each named.
    pub fn hot(&self) -> Result<Option<replicator::storage::hdfs::HotFiles>> {
        if self.readers == 0 && self.datanodes.is_none() {
            return Ok(None);
        }
        let Some(datanodes) = self.datanodes.filter(|d| *d > 0) else {
            bail!("sink.hdfs.readers needs sink.hdfs.datanodes (the DataNodes of the eval cluster, at least 1)");
        };
        if self.readers_per_replica == 0 {
            bail!("sink.hdfs.readers_per_replica must be at least 1");
        }
        if self.hot_ttl.is_zero() {
            bail!("sink.hdfs.hot_ttl must be more than 0s");
        }
        let factor = replicator::storage::hdfs::HotFiles::factor_for(
            self.readers,
            self.readers_per_replica,
            datanodes,
        );
        let mut hot =
            replicator::storage::hdfs::HotFiles::new(factor, &self.hot_files, self.hot_ttl)
                .map_err(|e| anyhow::anyhow!("sink.hdfs.hot_files: {e}"))?
                .sized(self.readers_per_replica, datanodes);
        if let Some(w) = &self.webhdfs {
            let u = reqwest::Url::parse(w)
                .map_err(|e| anyhow::anyhow!("sink.hdfs.webhdfs {w:?}: not a URL: {e}"))?;
            if !matches!(u.scheme(), "http" | "https") || u.host_str().is_none() {
                bail!("sink.hdfs.webhdfs {w:?}: give the NameNode's HTTP address, e.g. http://eval-nn:9870");
            }
            hot = hot.placed_via(w, self.hot_wait);
        }
        Ok(Some(hot))
    }
}

/// `[sink.s3]`: the endpoint and credentials of an `s3://` sink root.
/// Unset keys come from the standard `AWS_ENDPOINT`, `AWS_REGION`,
/// `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY` environment variables.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct S3Section {
    /// Endpoint URL of an S3-compatible store (`"http://10.0.0.5:8333"`);
    /// unset: AWS S3 itself.
    pub endpoint: Option<String>,
    /// Region; default `"us-east-1"`.
    pub region: Option<String>,
    /// Access key id (not a secret).
    pub access_key_id: Option<String>,
    /// File holding the secret access key (one line; relative to the
    /// config file). The key is never logged.
    pub secret_access_key_file: Option<PathBuf>,
}

impl S3Section {
    /// The client settings, the secret read from `secret_access_key_file`
    /// (`what` names the section in errors: `sink.s3`); `capacity` in
    /// bytes.
    ///
    /// # Errors
    /// A key file that cannot be read, named.
    pub fn config(
        self,
        what: &str,
        capacity: Option<u64>,
    ) -> Result<replicator::storage::s3::S3Config> {
        let secret_access_key = match &self.secret_access_key_file {
            Some(f) => Some(
                std::fs::read_to_string(f)
                    .map_err(|e| {
                        anyhow::anyhow!("{what}.secret_access_key_file {}: {e}", f.display())
                    })?
                    .trim()
                    .to_string(),
            ),
            None => None,
        };
        Ok(replicator::storage::s3::S3Config {
            endpoint: self.endpoint,
            region: self.region,
            access_key_id: self.access_key_id,
            secret_access_key,
            capacity,
        })
    }
}

impl SinkSection {
    /// The store `root` is in, with its settings: the secret access key
    /// of an `s3://` root is read from `[sink.s3] secret_access_key_file`.
    ///
    /// # Errors
    /// A root URL that does not parse, or a key file that cannot be read,
    /// named.
    pub fn storage(&self) -> Result<replicator::sink::SinkStorage> {
        use replicator::sink::SinkStorage;
        let root = self.root.to_string_lossy();
        let Some((scheme, _)) = root.split_once("://") else {
            return Ok(SinkStorage::Local);
        };
        replicator::storage::remote::RemoteRoot::parse(&root)
            .map_err(|e| anyhow::anyhow!("sink.root: {e}"))?;
        let url = root.trim_end_matches('/').to_string();
        Ok(match scheme {
            "hdfs" => SinkStorage::Hdfs {
                url,
                capacity: self.capacity,
                hot: match &self.hdfs {
                    Some(h) => h.hot()?,
                    None => None,
                },
                versions: self.hdfs.as_ref().is_some_and(|h| h.versions),
            },
            _ => SinkStorage::S3 {
                url,
                config: self
                    .s3
                    .clone()
                    .unwrap_or_default()
                    .config("sink.s3", self.capacity)?,
            },
        })
    }

    /// `min_free` and `target_free` together.
    ///
    /// # Errors
    /// Only one of them is set, or both are sizes and `target_free` is
    /// below `min_free` or either is not above `reserve`.
    pub fn pressure(&self) -> Result<Option<SpacePressure>> {
        match (self.min_free, self.target_free) {
            (None, None) => Ok(None),
            (Some(min_free), Some(target_free)) => {
                if let (Threshold::Bytes(m), Threshold::Bytes(t)) = (min_free, target_free) {
                    if t < m {
                        bail!("sink.target_free ({t} bytes) must be at least sink.min_free ({m} bytes)");
                    }
                }
                let p = SpacePressure {
                    min_free,
                    target_free,
                };
                // Sizes are checked against the reserve now; percentages
                // when the sink starts and knows its capacity.
                p.bytes(Some(u64::MAX), self.reserve)
                    .map_err(|e| anyhow::anyhow!(e))?;
                Ok(Some(p))
            }
            (Some(_), None) => bail!("sink.min_free is set without sink.target_free: set both (target_free at least min_free)"),
            (None, Some(_)) => bail!("sink.target_free is set without sink.min_free: set both"),
        }
    }
}

fn de_threshold_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Threshold>, D::Error> {
    let s = String::deserialize(d)?;
    Threshold::parse(&s)
        .map(Some)
        .map_err(serde::de::Error::custom)
}

/// `[[sink.retention]]`: which replicas of matching jobs are kept
/// (ARCHITECTURE.md, "Replica lifecycle"). At least one of `keep_last`,
/// `keep_every`, `min_age`, `max_bytes` must be set.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionSection {
    /// Glob over job names (`"*"`, `"llama-*"`).
    pub job: String,
    /// Keep the newest this many replicas per (job, source site), by step
    /// (publish time when a replica has none); unset: unlimited.
    pub keep_last: Option<u32>,
    /// Keep replicas whose step is a multiple of this.
    pub keep_every: Option<u64>,
    /// Keep replicas published less than this long ago (`"1h"`).
    #[serde(default, with = "humantime_serde")]
    pub min_age: Option<Duration>,
    /// Per (job, source site), expire the oldest replicas kept only by
    /// `keep_last` or `keep_every` until the job holds at most this many
    /// bytes (`"10TB"`; each file counted once, hard links included).
    #[serde(default, deserialize_with = "de_size_opt")]
    pub max_bytes: Option<u64>,
    /// Log what the policy would remove and remove nothing; default
    /// `false`.
    #[serde(default)]
    pub dry_run: bool,
}

impl RetentionSection {
    /// The policy this section describes.
    ///
    /// # Errors
    /// As [`replicator::sink::retention::RetentionPolicy::new`].
    pub fn policy(&self) -> Result<replicator::sink::retention::RetentionPolicy, String> {
        replicator::sink::retention::RetentionPolicy::new(
            &self.job,
            self.keep_last,
            self.keep_every,
            self.min_age,
            self.max_bytes,
            self.dry_run,
        )
    }
}

fn default_retention_interval() -> Duration {
    Duration::from_secs(60)
}

fn de_size_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_size(d).map(Some)
}

/// A quantity in the config: a string with a unit (`"4MiB"`,
/// `"1Gbit/s"`) parsed by `parse`, or a whole number in the base unit
/// (`unit`: bytes, bit/s).
struct Quantity {
    /// What the key takes, for the error: `a size such as "4MiB"`.
    expecting: &'static str,
    parse: fn(&str) -> Result<u64, String>,
}

impl serde::de::Visitor<'_> for Quantity {
    type Value = u64;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(self.expecting)
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<u64, E> {
        (self.parse)(v).map_err(E::custom)
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<u64, E> {
        Ok(v)
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<u64, E> {
        u64::try_from(v)
            .map_err(|_| E::custom(format!("{v} is negative; expected {}", self.expecting)))
    }
}

fn default_true() -> bool {
    true
}

fn default_reserve() -> u64 {
    1 << 30
}

fn de_rate<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    d.deserialize_any(Quantity {
        expecting: "a rate such as \"1Gbit/s\" or a whole number of bit/s",
        parse: parse_rate,
    })
}

fn de_size<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    d.deserialize_any(Quantity {
        expecting: "a size such as \"4MiB\" or a whole number of bytes",
        parse: parse_size,
    })
}

pub use ferry_proto::units::{format_rate, parse_rate};

impl Config {
    /// Reads, parses and checks a config file; relative TLS paths (`[tls]`,
    /// `api.tls_cert`, `api.tls_key`) are resolved against the file's
    /// directory.
    ///
    /// # Errors
    /// A message naming the file and the bad key.
    pub fn load(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("config file {}", path.display()))?;
        // A parse error quotes the line, which may hold a URL's password.
        let mut c: Config = toml::from_str(&text).map_err(|e| {
            anyhow::anyhow!(
                "config file {}: {}",
                path.display(),
                ferry_catalog::redact_url_passwords(&e.to_string())
            )
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        let api_tls = [&mut c.api.tls_cert, &mut c.api.tls_key];
        for p in [&mut c.tls.ca, &mut c.tls.cert, &mut c.tls.key]
            .into_iter()
            .chain(api_tls.into_iter().flatten())
        {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
        if let Some(p) = &mut c.catalog.password_file {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
        let key_files = [
            c.sink.as_mut().and_then(|s| s.s3.as_mut()),
            c.source.as_mut().and_then(|s| s.s3.as_mut()),
        ];
        for p in key_files
            .into_iter()
            .flatten()
            .filter_map(|s| s.secret_access_key_file.as_mut())
        {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
        c.check()
            .with_context(|| format!("config file {}", path.display()))?;
        Ok(c)
    }

    /// The PostgreSQL catalog this agent uses, its password read from
    /// `catalog.password_file` if given: `env_url` (the value of
    /// [`CATALOG_URL_ENV`], which wins; empty = unset), else
    /// `catalog.url`. `None`: SQLite in `agent.data_dir`.
    ///
    /// # Errors
    /// A message naming the variable or key (never the password): a bad
    /// URL, a password file that cannot be read or is empty, a password
    /// given twice, or `password_file` without a URL.
    pub fn catalog_url(&self, env_url: Option<&str>) -> Result<Option<ferry_catalog::PostgresUrl>> {
        let url = match env_url.filter(|u| !u.is_empty()) {
            Some(u) => Some(
                ferry_catalog::PostgresUrl::parse(u)
                    .map_err(|e| anyhow::anyhow!("{CATALOG_URL_ENV}: {e}"))?,
            ),
            None => self.catalog.url.clone(),
        };
        match (url, &self.catalog.password_file) {
            (None, Some(f)) => bail!(
                "catalog.password_file {} is set but there is no catalog.url (or {CATALOG_URL_ENV})",
                f.display()
            ),
            (None, None) => Ok(None),
            (Some(u), None) => Ok(Some(u)),
            (Some(u), Some(f)) => Ok(Some(
                u.with_password_file(f)
                    .map_err(|e| anyhow::anyhow!("catalog: {e}"))?,
            )),
        }
    }

    /// Checks cross-references and ranges.
    ///
    /// # Errors
    /// A message naming the key.
    pub fn check(&self) -> Result<()> {
        let a = &self.agent;
        if a.name.is_empty() {
            bail!("agent.name must not be empty");
        }
        ferry_proto::paths::check_name(&a.site).map_err(|e| anyhow::anyhow!("agent.site: {e}"))?;
        let is_source = matches!(a.role, Role::Source | Role::Both);
        let is_sink = matches!(a.role, Role::Sink | Role::Both);
        if is_source && self.source.is_none() {
            bail!("agent.role = source needs a [source] section");
        }
        if is_sink && self.sink.is_none() {
            bail!("agent.role = sink needs a [sink] section");
        }
        self.api.auth()?;
        self.api.check_transport()?;
        self.pool.config().check().map_err(anyhow::Error::msg)?;
        if let Some(sink) = &self.sink {
            for (i, r) in sink.retention.iter().enumerate() {
                r.policy()
                    .map_err(|e| anyhow::anyhow!("sink.retention[{i}]: {e}"))?;
            }
            if sink.retention_interval.is_zero() {
                bail!("sink.retention_interval must be more than 0");
            }
            sink.pressure()?;
        }
        for (i, l) in self.links.iter().enumerate() {
            if l.name.is_empty() {
                bail!("links[{i}].name must not be empty");
            }
            if self.links.iter().filter(|o| o.name == l.name).count() > 1 {
                bail!("links[{i}].name {:?} is used twice", l.name);
            }
            let host_port = |a: &str| {
                a.rsplit_once(':').is_some_and(|(host, port)| {
                    !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0)
                })
            };
            if !host_port(&l.peer) {
                bail!("links[{i}].peer must be host:port, got {:?}", l.peer);
            }
            if l.peer_name.trim().is_empty() {
                bail!("links[{i}].peer_name must not be empty");
            }
            for (k, p) in l.more_peers.iter().enumerate() {
                if !host_port(&p.peer) {
                    bail!(
                        "links[{i}].more_peers[{k}].peer must be host:port, got {:?}",
                        p.peer
                    );
                }
                if p.peer_name.trim().is_empty() {
                    bail!("links[{i}].more_peers[{k}].peer_name must not be empty");
                }
                let addrs =
                    std::iter::once(&l.peer).chain(l.more_peers[..k].iter().map(|o| &o.peer));
                if addrs.into_iter().any(|a| *a == p.peer) {
                    bail!(
                        "links[{i}].more_peers[{k}].peer {:?} is already the address of a sink agent of the link",
                        p.peer
                    );
                }
                let names = std::iter::once(&l.peer_name)
                    .chain(l.more_peers[..k].iter().map(|o| &o.peer_name));
                if names.into_iter().any(|n| *n == p.peer_name) {
                    bail!(
                        "links[{i}].more_peers[{k}].peer_name {:?} is already a sink agent of the link",
                        p.peer_name
                    );
                }
            }
            if l.rtt_hint.is_zero() {
                bail!("links[{i}].rtt_hint must be more than 0");
            }
            if let Some(n) = l.connections {
                let max = replicator::source::MAX_CONNECTIONS;
                if !(1..=max).contains(&n) {
                    bail!("links[{i}].connections must be 1 to {max}, got {n}");
                }
            }
        }
        for (i, j) in self.jobs.iter().enumerate() {
            ferry_proto::paths::check_name(&j.name)
                .map_err(|e| anyhow::anyhow!("jobs[{i}].name: {e}"))?;
            if let Some(k) = self.jobs[..i].iter().position(|o| o.name == j.name) {
                bail!(
                    "jobs[{i}].name {:?} is used twice (also jobs[{k}]); give each job once",
                    j.name
                );
            }
            if !(j.model_params.is_finite() && j.model_params >= 0.0) {
                bail!(
                    "jobs[{i}].model_params must be a finite number of parameters, 0 (unknown) or more, got {}",
                    j.model_params
                );
            }
            if !(0.0..=1.0).contains(&j.importance) {
                bail!(
                    "jobs[{i}].importance must be within 0..1, got {}",
                    j.importance
                );
            }
        }
        self.scheduler.policy()?;
        if let Some(s) = &self.source {
            let cs = s.chunk_size;
            if !(u64::from(ferry_proto::manifest::MIN_CHUNK_SIZE)
                ..=u64::from(ferry_proto::limits::MAX_CHUNK))
                .contains(&cs)
            {
                bail!("source.chunk_size must be within 64KiB..64MiB, got {cs} bytes");
            }
            if s.streams == 0 || s.streams > 64 {
                bail!("source.streams must be within 1..64, got {}", s.streams);
            }
            if s.batch_size < 64 << 10 {
                bail!(
                    "source.batch_size must be at least 64KiB, got {} bytes",
                    s.batch_size
                );
            }
            for (i, m) in s.markers.iter().enumerate() {
                ferry_proto::paths::check_relative(m)
                    .ok()
                    .filter(|()| !m.contains('/'))
                    .ok_or_else(|| {
                        anyhow::anyhow!("source.markers[{i}] must be a plain file name, got {m:?}")
                    })?;
            }
            if !s.scan_interval.is_zero() && s.scan_interval < Duration::from_millis(10) {
                bail!(
                    "source.scan_interval must be \"0s\" (watcher off) or at least 10ms, got {:?}",
                    s.scan_interval
                );
            }
            if s.quiet_period > Duration::from_secs(3600) {
                bail!(
                    "source.quiet_period must be at most 1h, got {}",
                    humantime::format_duration(s.quiet_period)
                );
            }
            if s.checkpoint_idle_timeout < Duration::from_secs(10)
                || s.checkpoint_idle_timeout <= s.quiet_period
            {
                bail!(
                    "source.checkpoint_idle_timeout must be at least 10s and longer than source.quiet_period ({}), got {}",
                    humantime::format_duration(s.quiet_period),
                    humantime::format_duration(s.checkpoint_idle_timeout)
                );
            }
            for k in &s.pin_on {
                if !replicator::source::SIGNAL_KINDS.contains(&k.as_str()) {
                    bail!(
                        "source.pin_on: unknown signal kind {k:?} (expected some of {})",
                        replicator::source::SIGNAL_KINDS.join(", ")
                    );
                }
            }
            if s.pin_for < Duration::from_secs(1)
                || s.pin_for > Duration::from_secs(100 * 31_557_600)
            {
                bail!(
                    "source.pin_for must be at least 1s and at most 100 years, got {}",
                    humantime::format_duration(s.pin_for)
                );
            }
            for (i, r) in s.roots.iter().enumerate() {
                if let Some(j) = s.roots[..i].iter().position(|o| o.path == r.path) {
                    bail!(
                        "source.roots[{i}].path is the same directory as source.roots[{j}].path; give each root once"
                    );
                }
                if r.path.parent().is_none() {
                    bail!("source.roots[{i}].path must not be /");
                }
                if let Some(j) = s
                    .roots
                    .iter()
                    .position(|o| o.path != r.path && o.path.starts_with(&r.path))
                {
                    bail!("source.roots[{i}].path contains source.roots[{j}].path; roots must not nest");
                }
                let path = r.path.to_string_lossy();
                if let Some((scheme, _)) = path.split_once("://") {
                    if scheme != "hdfs" && scheme != "s3" {
                        bail!(
                            "source.roots[{i}].path {path}: {scheme}:// is not a store ferry \
                             knows; give a local directory, hdfs://namenode:port/dir or \
                             s3://bucket/prefix"
                        );
                    }
                    replicator::storage::remote::RemoteRoot::parse(&path)
                        .map_err(|e| anyhow::anyhow!("source.roots[{i}].path: {e}"))?;
                } else if !r.path.is_absolute() {
                    bail!(
                        "source.roots[{i}].path must be absolute, got {}",
                        r.path.display()
                    );
                }
                ferry_proto::paths::check_name(&r.job)
                    .map_err(|e| anyhow::anyhow!("source.roots[{i}].job: {e}"))?;
                r.watch(i)?;
                if !self.links.iter().any(|l| l.name == r.link) {
                    bail!(
                        "source.roots[{i}].link {:?} is not a [[links]] name",
                        r.link
                    );
                }
            }
            if is_source && self.links.is_empty() {
                bail!("a source needs at least one [[links]] entry");
            }
        }
        if let Some(s) = &self.sink {
            let root = s.root.to_string_lossy();
            match root.split_once("://") {
                Some(("hdfs" | "s3", _)) => {
                    replicator::storage::remote::RemoteRoot::parse(&root)
                        .map_err(|e| anyhow::anyhow!("sink.root: {e}"))?;
                    if s.s3.is_some() && !root.starts_with("s3://") {
                        bail!("[sink.s3] is set but sink.root {root} is not an s3:// URL");
                    }
                    if s.hdfs.is_some() && !root.starts_with("hdfs://") {
                        bail!("[sink.hdfs] is set but sink.root {root} is not an hdfs:// URL");
                    }
                    if let Some(h) = &s.hdfs {
                        h.hot()?;
                    }
                }
                Some((scheme, _)) => bail!(
                    "sink.root {root}: {scheme}:// is not a store ferry knows; give a local \
                     directory, hdfs://namenode:port/dir or s3://bucket/prefix"
                ),
                None => {
                    if !s.root.is_absolute() {
                        bail!("sink.root must be absolute, got {}", s.root.display());
                    }
                    if s.capacity.is_some() {
                        bail!(
                            "sink.capacity is for hdfs:// and s3:// roots; a local root \
                             uses its file system's size"
                        );
                    }
                    if s.s3.is_some() || s.hdfs.is_some() {
                        bail!(
                            "[sink.{}] is set but sink.root {root} is a local directory",
                            if s.s3.is_some() { "s3" } else { "hdfs" }
                        );
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const GOOD: &str = r#"
[agent]
name = "train-a-1"
site = "train-a"
role = "source"
[tls]
ca = "ca.pem"
cert = "a.pem"
key = "a.key"
[[links]]
name = "to-eval"
peer = "127.0.0.1:7443"
peer_name = "eval-b-1"
rate = "1Gbit/s"
rtt_hint = "100ms"
[source]
[[source.roots]]
path = "/ckpt/job"
job = "job"
link = "to-eval"
"#;

    fn load(text: &str) -> Result<Config> {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("ferry.toml");
        std::fs::write(&p, text).unwrap();
        Config::load(&p)
    }

    fn err(text: &str) -> String {
        format!("{:#}", load(text).unwrap_err())
    }

    #[test]
    fn catalog_is_sqlite_unless_a_url_is_given_and_the_env_wins() {
        let c = load(GOOD).unwrap();
        assert!(c.catalog_url(None).unwrap().is_none(), "SQLite by default");
        assert!(
            c.catalog_url(Some("")).unwrap().is_none(),
            "empty env = unset"
        );
        let u = c
            .catalog_url(Some("postgres://ferry:envpw@db-env/site_a"))
            .unwrap()
            .unwrap();
        assert_eq!(u.to_string(), "postgres://ferry:***@db-env/site_a");

        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("pg.pass"), "filepw\n").unwrap();
        let text = format!(
            "{GOOD}\n[catalog]\nurl = \"postgres://ferry@db-conf:5432/site_a\"\npassword_file = \"pg.pass\"\n"
        );
        let p = d.path().join("ferry.toml");
        std::fs::write(&p, &text).unwrap();
        let c = Config::load(&p).unwrap();
        assert!(
            c.catalog.password_file.as_ref().unwrap().is_absolute(),
            "relative to the config file"
        );
        let u = c.catalog_url(None).unwrap().unwrap();
        assert_eq!(u.to_string(), "postgres://ferry:***@db-conf:5432/site_a");
        assert!(
            u.redact("filepw") == "***",
            "the file's password is in the URL"
        );
        let u = c
            .catalog_url(Some("postgres://other@db-env/site_a"))
            .unwrap()
            .unwrap();
        assert!(
            u.to_string().starts_with("postgres://other:***@db-env/"),
            "{u}"
        );
        // A password twice, a missing file, a bad URL: named, never shown.
        let e = format!(
            "{:#}",
            c.catalog_url(Some("postgres://ferry:envpw@db-env/site_a"))
                .unwrap_err()
        );
        assert!(e.contains("keep one") && !e.contains("envpw"), "{e}");
        std::fs::remove_file(d.path().join("pg.pass")).unwrap();
        let e = format!("{:#}", c.catalog_url(None).unwrap_err());
        assert!(e.contains("pg.pass"), "{e}");
        let e = format!(
            "{:#}",
            c.catalog_url(Some("mysql://u:pw9@h/x")).unwrap_err()
        );
        assert!(e.contains(CATALOG_URL_ENV) && !e.contains("pw9"), "{e}");
        let e = err(&format!("{GOOD}\n[catalog]\nurl = \"http://u:pw8@h/x\"\n"));
        assert!(
            e.contains("url =") && e.contains("scheme") && !e.contains("pw8"),
            "{e}"
        );
        let e = format!(
            "{:#}",
            load(&format!("{GOOD}\n[catalog]\npassword_file = \"x\"\n"))
                .unwrap()
                .catalog_url(None)
                .unwrap_err()
        );
        assert!(e.contains("no catalog.url"), "{e}");
        let c = load(&format!(
            "{GOOD}\n[catalog]\nurl = \"postgres://u:pw7@h/x\"\n"
        ))
        .unwrap();
        assert!(
            !format!("{c:?}").contains("pw7"),
            "Debug of the config hides it"
        );
    }

    #[test]
    fn good_config_gets_defaults() {
        let c = load(GOOD).unwrap();
        assert_eq!(c.links[0].rate, 1_000_000_000);
        assert_eq!(c.api.listen.port(), 7070);
        assert_eq!(c.source.as_ref().unwrap().chunk_size, 4 << 20);
        assert!(c.tls.ca.is_absolute());
    }

    #[test]
    fn link_connections_default_from_rate_and_cores_or_as_configured() {
        let c = load(GOOD).unwrap();
        assert_eq!(c.links[0].connections, None);
        // 1 Gbit/s: one connection whatever the cores.
        assert_eq!(c.links[0].connections(), 1);
        let c = load(&GOOD.replace("rate = \"1Gbit/s\"", "rate = \"60Gbit/s\"")).unwrap();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(c.links[0].connections(), cores.min(16));
        let with = |n: &str| {
            GOOD.replace(
                "rtt_hint = \"100ms\"",
                &format!("rtt_hint = \"100ms\"\nconnections = {n}"),
            )
        };
        assert_eq!(load(&with("3")).unwrap().links[0].connections(), 3);
        for bad in ["0", "65"] {
            let e = err(&with(bad));
            assert!(e.contains("links[0].connections must be 1 to 64"), "{e}");
        }
    }

    #[test]
    fn more_sink_agents_of_a_link_are_read_in_order_and_bad_ones_named() {
        let with = |more: &str| {
            GOOD.replace(
                "rtt_hint = \"100ms\"",
                &format!("rtt_hint = \"100ms\"\nmore_peers = {more}"),
            )
        };
        assert!(load(GOOD).unwrap().links[0].more_peers().is_empty());
        let c = load(&with(
            r#"[{ peer = "eval-b-2.example:7443", peer_name = "eval-b-2" }, { peer = "10.0.0.3:7443", peer_name = "eval-b-3" }]"#,
        ))
        .unwrap();
        let names: Vec<String> = c.links[0]
            .more_peers()
            .into_iter()
            .map(|p| p.name)
            .collect();
        assert_eq!(names, ["eval-b-2", "eval-b-3"]);
        for (bad, want) in [
            (
                r#"[{ peer = "eval-b-2", peer_name = "eval-b-2" }]"#,
                "links[0].more_peers[0].peer must be host:port",
            ),
            (
                r#"[{ peer = "h:1", peer_name = " " }]"#,
                "links[0].more_peers[0].peer_name must not be empty",
            ),
            (
                r#"[{ peer = "h:1", peer_name = "x" }, { peer = "h:1", peer_name = "y" }]"#,
                "links[0].more_peers[1].peer \"h:1\" is already the address of a sink agent",
            ),
            (r#"["h:1"]"#, "expected a table { peer = \"host:port\""),
            (
                r#"[{ peer = "h:1", peer_name = "x" }, { peer = "h:2", peer_name = "x" }]"#,
                "links[0].more_peers[1].peer_name \"x\" is already a sink agent of the link",
            ),
            (r#"[{ peer = "h:1" }]"#, "peer_name"),
            (r#"[{ peer = "h:1", peer_name = "x", port = 3 }]"#, "port"),
        ] {
            let e = err(&with(bad));
            assert!(e.contains(want), "{bad}: {e}");
        }
        let first = load(GOOD).unwrap().links[0].peer_name.clone();
        let e = err(&with(&format!(
            "[{{ peer = \"h:1\", peer_name = \"{first}\" }}]"
        )));
        assert!(e.contains("is already a sink agent of the link"), "{e}");
    }

    #[test]
    fn unknown_key_is_named() {
        let e = err(&GOOD.replace("[source]\n", "[source]\nbogus_key = 1\n"));
        assert!(e.contains("bogus_key"), "{e}");
    }

    #[test]
    fn bad_duration_and_rate_name_the_key() {
        let e = err(&GOOD.replace("rtt_hint = \"100ms\"", "rtt_hint = \"100 parsecs\""));
        assert!(e.contains("rtt_hint"), "{e}");
        let e = err(&GOOD.replace("rate = \"1Gbit/s\"", "rate = \"fast\""));
        assert!(e.contains("rate") && e.contains("fast"), "{e}");
    }

    #[test]
    fn missing_file_and_bad_references_are_named() {
        let e = format!(
            "{:#}",
            Config::load(Path::new("/nonexistent/ferry.toml")).unwrap_err()
        );
        assert!(e.contains("/nonexistent/ferry.toml"), "{e}");
        let e = err(&GOOD.replace("link = \"to-eval\"", "link = \"nope\""));
        assert!(e.contains("source.roots[0].link"), "{e}");
        let e = err(&GOOD.replace("role = \"source\"", "role = \"sink\""));
        assert!(e.contains("[sink]"), "{e}");
        let c =
            load(&GOOD.replace("path = \"/ckpt/job\"", "path = \"hdfs://nn/ckpt/job\"")).unwrap();
        let w = c.source.as_ref().unwrap().roots[0].watch(0).unwrap();
        assert_eq!(
            w.mode,
            replicator::source::watcher::Mode::Poll,
            "an HDFS root is polled"
        );
        let e = err(&GOOD.replace("path = \"/ckpt/job\"", "path = \"ftp://nn/ckpt/job\""));
        assert!(e.contains("ftp:// is not a store"), "{e}");
        let e = err(&GOOD.replace("path = \"/ckpt/job\"", "path = \"s3:///ckpt\""));
        assert!(
            e.contains("source.roots[0].path") && e.contains("no bucket"),
            "{e}"
        );
    }

    #[test]
    fn remote_sink_roots_take_their_settings_and_bad_ones_are_named() {
        use replicator::sink::SinkStorage;
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("s3.secret"), "s3cr3t\n").unwrap();
        let p = d.path().join("ferry.toml");
        let text = format!(
            "{GOOD}[sink]\nroot = \"s3://bucket/eval/\"\ncapacity = \"2TiB\"\n\
             [sink.s3]\nendpoint = \"http://127.0.0.1:8333\"\naccess_key_id = \"AK\"\n\
             secret_access_key_file = \"s3.secret\"\n"
        );
        std::fs::write(&p, text).unwrap();
        let c = Config::load(&p).unwrap();
        match c.sink.as_ref().unwrap().storage().unwrap() {
            SinkStorage::S3 { url, config } => {
                assert_eq!(url, "s3://bucket/eval");
                assert_eq!(config.endpoint.as_deref(), Some("http://127.0.0.1:8333"));
                assert_eq!(config.access_key_id.as_deref(), Some("AK"));
                assert_eq!(
                    config.secret_access_key.as_deref(),
                    Some("s3cr3t"),
                    "read from the file, relative to the config"
                );
                assert_eq!(config.capacity, Some(2 << 40));
                assert!(!format!("{config:?}").contains("s3cr3t"), "redacted");
            }
            other => panic!("expected S3, got {other:?}"),
        }
        let h = load(&format!("{GOOD}[sink]\nroot = \"hdfs://nn:8020/eval\"\n")).unwrap();
        assert!(matches!(
            h.sink.as_ref().unwrap().storage().unwrap(),
            SinkStorage::Hdfs { ref url, capacity: None, hot: None, versions: false } if url == "hdfs://nn:8020/eval"
        ));
        let l = load(&format!("{GOOD}[sink]\nroot = \"/eval\"\n")).unwrap();
        assert!(matches!(
            l.sink.as_ref().unwrap().storage().unwrap(),
            SinkStorage::Local
        ));
        // A missing key file is named when the sink starts.
        std::fs::remove_file(d.path().join("s3.secret")).unwrap();
        let e = format!("{:#}", c.sink.as_ref().unwrap().storage().unwrap_err());
        assert!(
            e.contains("secret_access_key_file") && e.contains("s3.secret"),
            "{e}"
        );
        let hot = load(&format!(
            "{GOOD}[sink]\nroot = \"hdfs://nn:8020/eval\"\n[sink.hdfs]\nreaders = 20000\n\
             datanodes = 300\nhot_files = [\"extra/*.pt\"]\n"
        ))
        .unwrap();
        match hot.sink.as_ref().unwrap().storage().unwrap() {
            SinkStorage::Hdfs { hot: Some(h), .. } => {
                assert_eq!(h.factor, 128, "the seed's guideline for 20,000 readers");
                assert!(h.matches("extra/x.pt") && h.matches("model/.metadata"));
                assert!(!h.matches("extra/deeper/x.pt") && !h.matches("shard.bin"));
                assert!(!h.waits(), "no webhdfs: the publish does not wait");
            }
            other => panic!("expected hints, got {other:?}"),
        }
        let waits = load(&format!(
            "{GOOD}[sink]\nroot = \"hdfs://nn:8020/eval\"\n[sink.hdfs]\ndatanodes = 3\n\
             webhdfs = \"http://nn:9870\"\nhot_wait = \"5s\"\n"
        ))
        .unwrap();
        match waits.sink.as_ref().unwrap().storage().unwrap() {
            SinkStorage::Hdfs { hot: Some(h), .. } => assert!(h.waits()),
            other => panic!("expected hints, got {other:?}"),
        }
        // Versions alone: no hints.
        let versions = load(&format!(
            "{GOOD}[sink]\nroot = \"hdfs://nn:8020/eval\"\n[sink.hdfs]\nversions = true\n"
        ))
        .unwrap();
        assert!(matches!(
            versions.sink.as_ref().unwrap().storage().unwrap(),
            SinkStorage::Hdfs {
                versions: true,
                hot: None,
                ..
            }
        ));
        assert_eq!(
            replicator::storage::hdfs::HotFiles::factor_for(10_000, 157, 300),
            64
        );
        assert_eq!(
            replicator::storage::hdfs::HotFiles::factor_for(10_000, 157, 20),
            20,
            "capped at the DataNodes"
        );
        for (extra, want) in [
            (
                "root = \"hdfs://nn/eval\"\n[sink.hdfs]\nreaders = 100\n",
                "needs sink.hdfs.datanodes",
            ),
            (
                "root = \"s3://b/eval\"\n[sink.hdfs]\nreaders = 100\ndatanodes = 3\n",
                "not an hdfs:// URL",
            ),
            (
                "root = \"hdfs://nn/eval\"\n[sink.hdfs]\ndatanodes = 3\nwebhdfs = \"nn:9870\"\n",
                "sink.hdfs.webhdfs",
            ),
            ("root = \"ftp://x/eval\"\n", "ftp:// is not a store"),
            ("root = \"s3:///eval\"\n", "no bucket"),
            ("root = \"hdfs://nn/a/../b\"\n", "not a plain absolute path"),
            (
                "root = \"/eval\"\ncapacity = \"1TB\"\n",
                "sink.capacity is for",
            ),
            (
                "root = \"hdfs://nn/eval\"\n[sink.s3]\nregion = \"x\"\n",
                "not an s3:// URL",
            ),
            (
                "root = \"/eval\"\n[sink.s3]\nregion = \"x\"\n",
                "is a local directory",
            ),
        ] {
            let e = err(&format!("{GOOD}[sink]\n{extra}"));
            assert!(e.contains(want), "{extra}: {e}");
        }
    }

    #[test]
    fn api_tokens_are_checked_and_name_the_entry() {
        let tok = api::auth::new_token();
        let hash = api::auth::hash_token(&tok);
        let with = |entries: &str| format!("{GOOD}\n{entries}");
        let entry = |name: &str, role: &str, hash: &str| {
            format!("[[api.tokens]]\nname = \"{name}\"\nrole = \"{role}\"\nhash = \"{hash}\"\n")
        };
        let c = load(&with(&entry("ops", "operator", &hash))).unwrap();
        let auth = c.api.auth().unwrap();
        assert!(!auth.is_open());
        let hv = format!("Bearer {tok}").parse().unwrap();
        assert_eq!(
            auth.authenticate(Some(&hv)).unwrap().role,
            api::Role::Operator
        );
        assert!(auth.authenticate(None).is_err(), "no token must be refused");

        let e = err(&with(&entry("ops", "admin", &hash)));
        assert!(
            e.contains("api.tokens[0].role") && e.contains("admin"),
            "{e}"
        );
        let e = err(&with(&entry("ops", "reader", &tok)));
        assert!(e.contains("api.tokens[0].hash"), "{e}");
        assert!(!e.contains(&tok[10..]), "the error shows the token: {e}");
        let two =
            entry("ops", "reader", &hash) + &entry("ops", "operator", &api::auth::hash_token("x"));
        let e = err(&with(&two));
        assert!(
            e.contains("api.tokens[1].name") && e.contains("twice"),
            "{e}"
        );
        let two = entry("a", "reader", &hash) + &entry("b", "operator", &hash);
        let e = err(&with(&two));
        assert!(e.contains("api.tokens[1].hash"), "{e}");
    }

    #[test]
    fn api_tls_is_both_or_neither_and_plaintext_stays_on_loopback() {
        let api = |lines: &str| format!("{GOOD}\n[api]\n{lines}\n");
        // Both files: HTTPS on any address; relative paths follow the file.
        let c = load(&api(
            "listen = \"0.0.0.0:7070\"\ntls_cert = \"api.pem\"\ntls_key = \"/etc/ferry/api.key\"",
        ))
        .unwrap();
        let (cert, key) = c.api.tls().unwrap().unwrap();
        assert!(cert.is_absolute() && cert.ends_with("api.pem"), "{cert:?}");
        assert_eq!(key, Path::new("/etc/ferry/api.key"));
        // One without the other names both keys.
        let e = err(&api("tls_cert = \"api.pem\""));
        assert!(
            e.contains("api.tls_cert is set but api.tls_key is not"),
            "{e}"
        );
        let e = err(&api("tls_key = \"api.key\""));
        assert!(
            e.contains("api.tls_key is set but api.tls_cert is not"),
            "{e}"
        );
        // Plain HTTP: loopback (v4 or v6) is fine, anything else refused.
        for ok in ["127.0.0.1:7070", "127.0.0.2:80", "[::1]:7070"] {
            let c = load(&api(&format!("listen = \"{ok}\""))).unwrap();
            assert!(c.api.tls().unwrap().is_none());
        }
        for bad in ["0.0.0.0:7070", "10.48.0.1:7070", "[::]:7070"] {
            let e = err(&api(&format!("listen = \"{bad}\"")));
            assert!(
                e.contains("api.listen")
                    && e.contains(bad)
                    && e.contains("api.tls_cert")
                    && e.contains("allow_plaintext = true"),
                "{e}"
            );
        }
        // ... unless plain HTTP is allowed explicitly.
        let c = load(&api("listen = \"10.48.0.1:7070\"\nallow_plaintext = true")).unwrap();
        assert!(c.api.allow_plaintext && c.api.tls().unwrap().is_none());
        // No token needed only on loopback, whatever the transport.
        let e = err(&api(
            "listen = \"0.0.0.0:7070\"\ntls_cert = \"a.pem\"\ntls_key = \"a.key\"\nallow_unauthenticated = true",
        ));
        assert!(
            e.contains("allow_unauthenticated")
                && e.contains("loopback")
                && e.contains("0.0.0.0:7070"),
            "{e}"
        );
        load(&api("allow_unauthenticated = true")).unwrap();
        let e = err(&api("max_connections = 0"));
        assert!(e.contains("api.max_connections"), "{e}");
        assert_eq!(
            load(&api("max_connections = 9"))
                .unwrap()
                .api
                .max_connections,
            9
        );
        // The default is loopback, plain HTTP, not allowed elsewhere.
        let d = ApiSection::default();
        assert!(d.listen.ip().is_loopback() && !d.allow_plaintext && d.tls_cert.is_none());
        d.check_transport().unwrap();
    }

    #[test]
    fn example_config_parses() {
        let c = load(include_str!("../ops/ferry.example.toml")).unwrap();
        assert_eq!(c.agent.role, Role::Source);
        assert_eq!(c.jobs[0].importance, 0.8);
        // The commented [sink] block is valid too.
        let sink = include_str!("../ops/ferry.example.toml")
            .replace("role = \"source\"", "role = \"both\"")
            .replace("# [sink]", "[sink]")
            .replace("# root = ", "root = ");
        let c = load(&sink).unwrap();
        let s = c.sink.unwrap();
        assert_eq!(s.reserve, 1 << 30);
        assert!(s.reread_before_publish);
        let off = sink.replace(
            "# reread_before_publish = true",
            "reread_before_publish = false",
        );
        assert!(!load(&off).unwrap().sink.unwrap().reread_before_publish);
        assert_eq!(s.retention_interval, Duration::from_secs(60));
        assert_eq!(s.pressure().unwrap(), None);
        // The commented space pressure thresholds are valid; one alone,
        // a target below the minimum or a minimum within the reserve are
        // refused, naming the keys.
        let on = sink
            .replace("# min_free = ", "min_free = ")
            .replace("# target_free = ", "target_free = ");
        let p = load(&on)
            .unwrap()
            .sink
            .unwrap()
            .pressure()
            .unwrap()
            .unwrap();
        assert_eq!(p.min_free, Threshold::Percent(10.0));
        assert_eq!(p.target_free, Threshold::Percent(15.0));
        let e = format!(
            "{:#}",
            load(&sink.replace("# min_free = \"10%\"", "min_free = \"5%\"")).unwrap_err()
        );
        assert!(
            e.contains("sink.min_free") && e.contains("target_free"),
            "{e}"
        );
        let e = format!(
            "{:#}",
            load(
                &on.replace("min_free = \"10%\"", "min_free = \"20GB\"")
                    .replace("target_free = \"15%\"", "target_free = \"10GB\"")
            )
            .unwrap_err()
        );
        assert!(e.contains("at least sink.min_free"), "{e}");
        let e = format!(
            "{:#}",
            load(
                &on.replace("min_free = \"10%\"", "min_free = \"512MiB\"")
                    .replace("target_free = \"15%\"", "target_free = \"2GiB\"")
            )
            .unwrap_err()
        );
        assert!(
            e.contains("sink.min_free") && e.contains("sink.reserve"),
            "{e}"
        );
        let e = format!(
            "{:#}",
            load(&on.replace("min_free = \"10%\"", "min_free = \"lots\"")).unwrap_err()
        );
        assert!(e.contains("lots") && e.contains("10%"), "{e}");
        assert!(
            s.retention.is_empty(),
            "without a policy every replica is kept"
        );
        // The commented retention policy and webhook are valid (both have
        // a `job` key, so both are uncommented together).
        let mut ret = sink.clone();
        for key in [
            "[[sink.retention]]",
            "[[sink.webhooks]]",
            "url = \"https://eval-scheduler",
            "secret_file = ",
            "job = ",
            "keep_last = ",
            "keep_every = ",
            "min_age = ",
            "max_bytes = ",
            "dry_run = ",
            "retention_interval = ",
        ] {
            ret = ret.replace(&format!("# {key}"), key);
        }
        let s = load(&ret).unwrap().sink.unwrap();
        let p = s.retention[0].policy().unwrap();
        assert_eq!(
            (p.keep_last, p.keep_every, p.min_age, p.max_bytes),
            (
                Some(3),
                Some(10_000),
                Some(Duration::from_secs(7200)),
                Some(20_000_000_000_000)
            )
        );
        assert!(p.matches("llama-7b") && !p.matches("mm-large") && !p.dry_run);
        assert_eq!(
            (s.webhooks.len(), s.webhooks[0].job.as_str()),
            (1, "llama-*")
        );
        assert!(s.webhooks[0].url.starts_with("https://"));
        // So are the commented HTTPS and token lines.
        let tok = api::auth::new_token();
        let api = include_str!("../ops/ferry.example.toml")
            .replace("# tls_cert = ", "tls_cert = ")
            .replace("# tls_key = ", "tls_key = ")
            .replace("# [[api.tokens]]", "[[api.tokens]]")
            .replace("# name = ", "name = ")
            .replace("# role = ", "role = ")
            .replace("# hash = \"blake3:", "hash = \"blake3:")
            .replace(
                &format!("blake3:{}", "0".repeat(64)),
                &api::auth::hash_token(&tok),
            );
        let c = load(&api).unwrap();
        assert!(c.api.tls().unwrap().is_some());
        assert_eq!(c.api.tokens.len(), 1);
        let hv = format!("Bearer {tok}").parse().unwrap();
        let caller = c.api.auth().unwrap().authenticate(Some(&hv)).unwrap();
        assert_eq!(caller.role, api::Role::Operator);
        // So is the commented [catalog] block.
        let cat = include_str!("../ops/ferry.example.toml")
            .replace("# [catalog]", "[catalog]")
            .replace("# url = \"postgres", "url = \"postgres")
            .replace("# password_file = ", "password_file = ");
        let c = load(&cat).unwrap();
        assert_eq!(
            c.catalog.url.unwrap().to_string(),
            "postgres://ferry@db.train-a.example:5432/ferry_train_a"
        );
        assert_eq!(
            c.catalog.password_file.unwrap(),
            PathBuf::from("/etc/ferry/catalog.password")
        );
    }

    #[test]
    fn bad_retention_policies_are_refused_naming_the_key() {
        let base = include_str!("../ops/ferry.example.toml")
            .replace("role = \"source\"", "role = \"sink\"")
            .replace("# [sink]", "[sink]")
            .replace("# root = ", "root = ");
        let with = |policy: &str| format!("{base}\n[[sink.retention]]\n{policy}\n");
        let err = |policy: &str| format!("{:#}", load(&with(policy)).unwrap_err());
        let e = err("job = \"llama-*\"\ndry_run = true");
        assert!(
            e.contains("sink.retention[0]")
                && e.contains("none of keep_last, keep_every, min_age, max_bytes"),
            "{e}"
        );
        let e = err("job = \"*\"\nmin_age = \"-5m\"");
        assert!(e.contains("min_age"), "{e}");
        let e = err("job = \"[\"\nkeep_last = 1");
        assert!(
            e.contains("sink.retention[0]") && e.contains("job glob"),
            "{e}"
        );
        let e = err("job = \"*\"\nkeep_last = -1");
        assert!(e.contains("keep_last"), "{e}");
        let e = err("job = \"*\"\nkeep_every = 0");
        assert!(e.contains("keep_every"), "{e}");
        let e = err("job = \"*\"\nkeep_lats = 2");
        assert!(e.contains("keep_lats"), "{e}");
        let zero = base.replace(
            "# retention_interval = \"60s\"",
            "retention_interval = \"0s\"",
        );
        let e = format!("{:#}", load(&zero).unwrap_err());
        assert!(e.contains("retention_interval"), "{e}");
        let ok = load(&with("job = \"llama-*\"\nmax_bytes = \"1TB\"")).unwrap();
        assert_eq!(ok.sink.unwrap().retention.len(), 1);
    }

    #[test]
    fn example_scheduler_section_is_the_default() {
        // ops/ferry.example.toml writes every [scheduler] key with its
        // default value: the documented defaults are the real ones.
        let text = include_str!("../ops/ferry.example.toml");
        assert!(text.contains("\n[scheduler]\n") && text.contains("\n[scheduler.floors]\n"));
        let c = load(text).unwrap();
        assert_eq!(c.scheduler, SchedulerSection::default());
    }

    #[test]
    fn watcher_keys_name_the_key_and_the_choices() {
        let root = |extra: &str| {
            GOOD.replace(
                "path = \"/ckpt/job\"",
                &format!("path = \"/ckpt/job\"\n{extra}"),
            )
        };
        let e = err(&root("format = \"pytorch\""));
        assert!(
            e.contains("source.roots[0].format") && e.contains("deepspeed"),
            "{e}"
        );
        let e = err(&root("start = \"now\""));
        assert!(
            e.contains("source.roots[0].start") && e.contains("on_commit"),
            "{e}"
        );
        let e = err(&root("mode = \"fanotify\""));
        assert!(e.contains("source.roots[0].mode"), "{e}");
        let e = err(&root("select = \"every_n_steps\""));
        assert!(e.contains("every_n_steps must be a positive number"), "{e}");
        let e = err(&root("every_n_steps = 1000"));
        assert!(e.contains("needs select"), "{e}");
        let e = err(&root("format = \"dcp\"\nprofile = \"weights-only\""));
        assert!(
            e.contains("source.roots[0].profile") && e.contains("dcp"),
            "{e}"
        );
        // Weights first: refused with the reason for a format that keeps
        // weights and optimizer state in one file, or has none to split.
        let e = err(&root("format = \"dcp\"\npublish = \"weights-first\""));
        assert!(
            e.contains("source.roots[0].publish") && e.contains("dcp") && e.contains("same files"),
            "{e}"
        );
        let e = err(&root("format = \"hf\"\npublish = \"weights-first\""));
        assert!(e.contains("holds weights only"), "{e}");
        let e = err(&root(
            "profile = \"weights-only\"\npublish = \"weights-first\"",
        ));
        assert!(e.contains("needs profile = \"full\""), "{e}");
        let e = err(&root("publish = \"weights\""));
        assert!(e.contains("\"whole\" or \"weights-first\""), "{e}");
        let e = err(&root("profile = \"weights-first\""));
        assert!(e.contains("source.roots[0].profile"), "{e}");
        let e = err(&GOOD.replace(
            "[source]\n",
            "[source]\ncheckpoint_idle_timeout = \"1ms\"\n",
        ));
        assert!(e.contains("source.checkpoint_idle_timeout"), "{e}");
        let e = err(&GOOD.replace("[source]\n", "[source]\npin_on = [\"loss\"]\n"));
        assert!(e.contains("source.pin_on") && e.contains("\"loss\""), "{e}");
        let e = err(&GOOD.replace("[source]\n", "[source]\npin_for = \"0s\"\n"));
        assert!(e.contains("source.pin_for"), "{e}");
        let e = err(&GOOD.replace("[source]\n", "[source]\nscan_interval = \"1ns\"\n"));
        assert!(e.contains("source.scan_interval"), "{e}");
        let e = err(&GOOD.replace("[source]\n", "[source]\nquiet_period = \"100y\"\n"));
        assert!(e.contains("source.quiet_period"), "{e}");
        let twice = format!(
            "{GOOD}[[source.roots]]\npath = \"/ckpt/job\"\njob = \"other\"\nlink = \"to-eval\"\n"
        );
        assert!(err(&twice).contains("same directory"), "{}", err(&twice));
        let e = err(&root("profile = \"tiny\""));
        assert!(e.contains("source.roots[0].profile"), "{e}");
        let e = err(&root("include = [\"[bad\"]"));
        assert!(e.contains("source.roots[0]") && e.contains("[bad"), "{e}");
        let ok = load(&root(
            "format = \"dcp\"\nstart = \"on_commit\"\nmode = \"poll\"\nselect = \"every_n_steps\"\nevery_n_steps = 1000",
        ))
        .unwrap();
        let w = ok.source.unwrap().roots[0].watch(0).unwrap();
        assert_eq!(
            w.select,
            replicator::source::watcher::Selection::EveryNSteps(1000)
        );
        assert_eq!(w.mode, replicator::source::watcher::Mode::Poll);
        for format in ["auto", "deepspeed", "hf_trainer"] {
            let ok = load(&root(&format!(
                "format = \"{format}\"\npublish = \"weights-first\""
            )))
            .unwrap();
            let w = ok.source.unwrap().roots[0].watch(0).unwrap();
            assert_eq!(
                w.profile,
                ferry_proto::state::Profile::WeightsFirst,
                "{format}"
            );
        }
    }

    #[test]
    fn source_section_limits_are_named() {
        let e = err(&GOOD.replace("[source]\n", "[source]\nbatch_size = \"0B\"\n"));
        assert!(e.contains("source.batch_size"), "{e}");
        let e = err(&GOOD.replace("[source]\n", "[source]\nmarkers = [\"a/b\"]\n"));
        assert!(e.contains("source.markers[0]"), "{e}");
        let e = err(&GOOD.replace("path = \"/ckpt/job\"", "path = \"/\""));
        assert!(e.contains("must not be /"), "{e}");
        let nested = format!(
            "{GOOD}[[source.roots]]\npath = \"/ckpt/job/sub\"\njob = \"job\"\nlink = \"to-eval\"\n"
        );
        let e = err(&nested);
        assert!(e.contains("must not nest"), "{e}");
    }

    #[test]
    fn scheduler_section_defaults_to_the_policy_defaults() {
        let c = load(GOOD).unwrap();
        assert_eq!(c.scheduler, SchedulerSection::default());
        assert_eq!(c.scheduler.policy().unwrap(), scheduler::Policy::default());
        // An empty section and an empty sub-table are the defaults too.
        let c = load(&format!("{GOOD}[scheduler]\n[scheduler.floors]\n")).unwrap();
        assert_eq!(c.scheduler.policy().unwrap(), scheduler::Policy::default());
    }

    #[test]
    fn scheduler_keys_are_read() {
        let c = load(&format!(
            "{GOOD}[scheduler]\npolicy = \"fifo\"\naging = \"90s\"\naging_cap = 3.5\n\
             severity_half_life = \"1h\"\nurgent_for = \"5m\"\nmax_active = 8\n\
             small_transfer = \"1MiB\"\nmax_small_active = 0\n\
             [scheduler.weights]\nmodel_size = 0.25\nimportance = 3\nseverity = 0\n\
             [scheduler.floors]\nscheduled = 0.2\nbackground = 0\n"
        ))
        .unwrap();
        let p = c.scheduler.policy().unwrap();
        assert_eq!(p.kind, scheduler::PolicyKind::Fifo);
        assert_eq!(
            (p.aging_ms, p.severity_half_life_ms, p.urgent_for_ms),
            (90_000, 3_600_000, 300_000)
        );
        assert_eq!((p.aging_cap, p.max_active), (3.5, 8));
        assert_eq!((p.small_bytes, p.max_small_active), (1 << 20, 0));
        assert_eq!(
            (p.weights.size, p.weights.importance, p.weights.severity),
            (0.25, 3.0, 0.0)
        );
        assert_eq!((p.floors.scheduled, p.floors.background), (0.2, 0.0));
    }

    #[test]
    fn bad_scheduler_keys_are_named() {
        let sched = |body: &str| err(&format!("{GOOD}[scheduler]\n{body}\n"));
        let e = sched("policy = \"lifo\"");
        assert!(
            e.contains("scheduler.policy") && e.contains("\"lifo\"") && e.contains("fifo"),
            "{e}"
        );
        let e = sched("[scheduler.floors]\nscheduled = 0.9");
        assert!(
            e.contains("scheduler.floors.scheduled must be from 0 to 0.5, got 0.9"),
            "{e}"
        );
        let e = sched("[scheduler.weights]\nseverity = -1");
        assert!(e.contains("scheduler.weights.severity"), "{e}");
        let e = sched("[scheduler.weights]\nimportance = nan");
        assert!(e.contains("scheduler.weights.importance"), "{e}");
        let e = sched("aging_cap = 0.5");
        assert!(e.contains("scheduler.aging_cap"), "{e}");
        let e = sched("max_small_active = 5000");
        assert!(e.contains("scheduler.max_small_active"), "{e}");
        let e = sched("small_transfer = \"2GiB\"");
        assert!(e.contains("scheduler.small_transfer"), "{e}");
        let e = sched("small_transfer = \"lots\"");
        assert!(e.contains("small_transfer"), "{e}");
        let e = sched("small_transfer = true");
        assert!(
            e.contains("a size such as \"4MiB\" or a whole number of bytes"),
            "{e}"
        );
        let e = sched("small_transfer = -5");
        assert!(e.contains("negative"), "{e}");
        // A bare number is bytes.
        let c = load(&format!("{GOOD}[scheduler]\nsmall_transfer = 5000\n")).unwrap();
        assert_eq!(c.scheduler.policy().unwrap().small_bytes, 5000);
        let e = sched("aging = \"0s\"");
        assert!(e.contains("scheduler.aging"), "{e}");
        let e = sched("severity_half_life = \"10 fortnights\"");
        assert!(e.contains("severity_half_life"), "{e}");
        let e = sched("max_active = 0");
        assert!(e.contains("scheduler.max_active"), "{e}");
        let e = sched("max_active = -1");
        assert!(e.contains("max_active"), "{e}");
        // Unknown keys, also in the sub-tables.
        let e = sched("polcy = \"fifo\"");
        assert!(e.contains("polcy"), "{e}");
        let e = sched("[scheduler.weights]\nsize = 0.5");
        assert!(e.contains("size") && e.contains("model_size"), "{e}");
        let e = sched("[scheduler.floors]\nurgent = 0.5");
        assert!(e.contains("urgent"), "{e}");
    }

    #[test]
    fn bad_jobs_are_named() {
        let job = |body: &str| err(&format!("{GOOD}[[jobs]]\nname = \"a\"\n{body}\n"));
        let e = job("[[jobs]]\nname = \"b\"\n[[jobs]]\nname = \"a\"");
        assert!(
            e.contains("jobs[2].name \"a\" is used twice") && e.contains("jobs[0]"),
            "{e}"
        );
        let e = job("model_params = -7e9");
        assert!(e.contains("jobs[0].model_params"), "{e}");
        let e = job("model_params = inf");
        assert!(e.contains("jobs[0].model_params"), "{e}");
        let e = job("importance = 1.5");
        assert!(e.contains("jobs[0].importance"), "{e}");
        let e = job("importance = nan");
        assert!(e.contains("jobs[0].importance"), "{e}");
        let e = job("weight = 1");
        assert!(e.contains("weight"), "{e}");
        let c = load(&format!("{GOOD}[[jobs]]\nname = \"a\"\nmodel_params = 0\n")).unwrap();
        assert_eq!((c.jobs[0].model_params, c.jobs[0].importance), (0.0, 0.0));
    }

    #[test]
    fn rates_format_back() {
        for r in [1_000_000_000, 2_500_000_000, 250_000_000, 5_000] {
            assert_eq!(parse_rate(&format_rate(r)), Ok(r));
        }
        assert_eq!(format_rate(1_000_000_000), "1Gbit/s");
    }

    #[test]
    fn rates_parse() {
        assert_eq!(parse_rate("1Gbit/s"), Ok(1_000_000_000));
        assert_eq!(parse_rate("2.5Gbit/s"), Ok(2_500_000_000));
        assert_eq!(parse_rate("250Mbit/s"), Ok(250_000_000));
        assert_eq!(parse_rate("5000"), Ok(5000));
        assert!(parse_rate("1 GB").is_err());
        // Terabit rates, up to 10 Tbit/s, and formatted back alike.
        assert_eq!(parse_rate("1Tbit/s"), Ok(1_000_000_000_000));
        assert_eq!(format_rate(10_000_000_000_000), "10Tbit/s");
        // Out of range, zero included: the range is named.
        for v in ["0Gbit/s", "0", "100", "11Tbit/s", "-5Mbit/s"] {
            let e = parse_rate(v).unwrap_err();
            assert!(e.contains("outside 1kbit/s..10Tbit/s"), "{v}: {e}");
        }
    }
}
