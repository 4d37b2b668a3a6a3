//! The `ferry` command: agents (`serve`), API clients (`status`,
//! `resolve`, `signal`, `push`, `trace`), `verify`, tools (`certs`, `token`, `gen`,
//! `link-emu`) and the self-contained `demo`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use ferry::out::{noteln, outln};
use ferry::{agent, client, commands, config, demo, out};
use ferry_linkemu::{spawn_relay, LinkParams};
use tracing_subscriber::EnvFilter;

/// Ferry replicates LLM training checkpoints from a training datacenter to
/// an evaluation datacenter over QUIC, verified with BLAKE3 and published
/// atomically, and tells eval jobs where the replica is (a local path, or a URL
/// on an HDFS or S3 sink).
#[derive(Debug, Parser)]
#[command(
    name = "ferry",
    version,
    about = "Replicates LLM training checkpoints between datacenters over QUIC, verified with BLAKE3 \
             and published atomically, and tells eval jobs where the replica is.",
    after_help = "Try it without any setup: ferry demo\n\
                  Run agents: ferry certs init ..., then ferry serve --config FILE \
                  (every key: ops/ferry.example.toml)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run an agent (source, sink or both) from a TOML config file.
    ///
    /// See ops/ferry.example.toml for every key, its default and unit.
    /// The catalog is SQLite in agent.data_dir unless [catalog] url, or the
    /// environment variable FERRY_CATALOG_URL (which wins), names a
    /// PostgreSQL database (postgres://USER@HOST/DB; the password may come
    /// from catalog.password_file and is never printed).
    /// SIGTERM or Ctrl-C drains: batches stop at a chunk boundary, in-flight
    /// writes finish, the catalog is flushed; exits within 10 s.
    ///
    /// Wire protocol: this build speaks version 10. A sink accepts sources
    /// of versions 2 to 10; a source speaks 10, or the newest version a sink
    /// of an earlier release names when it refuses 10 (4 at least), and
    /// sends each version's additions only to a sink that speaks it
    /// (version 8: weights-first publishes; version 9: parts of striped
    /// transfers registered under their epochs; version 10: a part's
    /// chunks sent right behind its registration). Upgrade the sinks of a site
    /// pair first, then the sources; upgrade every agent of a pool before
    /// a root uses publish = "weights-first".
    Serve {
        /// Config file.
        #[arg(long, short, env = "FERRY_CONFIG")]
        config: PathBuf,
    },
    /// Replicate a committed checkpoint directory now (a client of
    /// `POST /v1/transfers` on the source agent; needs an operator token
    /// unless the agent allows unauthenticated requests).
    Push {
        /// Checkpoint directory; must be under a configured source root (a
        /// local path, or an hdfs:// or s3:// URL under such a root).
        path: PathBuf,
        /// Link to use instead of the source root's.
        #[arg(long)]
        link: Option<String>,
        /// Scheduler class: "scheduled" (default), "background" (datasets,
        /// logs: the rest of the link, at least its floor) or "urgent".
        #[arg(long, default_value = "scheduled", value_parser = ["scheduled", "background", "urgent"])]
        class: String,
        /// When the replica must be ready: an RFC 3339 time
        /// (2026-12-01T10:00:00Z) or a duration from now (15m). The agent
        /// answers at once whether its link's queue makes it, and if not,
        /// which class would or how many bytes are over budget.
        #[arg(long)]
        deadline: Option<String>,
        #[command(flatten)]
        server: client::ServerArgs,
        /// Return after queueing instead of waiting for the replica.
        #[arg(long)]
        no_wait: bool,
    },
    /// What an agent holds and moves: a source's transfers per state, its
    /// active and queued ones (class, progress) and its links' rate caps;
    /// a sink's replicas. Needs a reader token.
    Status {
        #[command(flatten)]
        server: client::ServerArgs,
        /// Print the API's JSON (healthz, links, transfers, replicas)
        /// instead.
        #[arg(long)]
        json: bool,
        /// List the N slowest replicas published in the last 24 hours
        /// (default 10) instead: commit to eval-ready, the phase that
        /// took longest and every phase after the commit (a sink's
        /// replicas; a source's published transfers).
        #[arg(
            long,
            value_name = "N",
            num_args = 0..=1,
            default_missing_value = "10",
            value_parser = clap::value_parser!(u32).range(1..=10_000),
            conflicts_with = "json"
        )]
        slow: Option<u32>,
    },
    /// Where a checkpoint is at a sink: prints where its replica is (a
    /// local path, or its hdfs:// or s3:// URL on an HDFS or S3 sink;
    /// exit code 0), or its state and progress on stderr (exit code 3:
    /// no replica at the sink yet). Needs a reader token.
    #[command(
        after_help = "Exit codes: 0 replicated (the path or URL is printed; the API calls \
                            this state local), 3 not replicated yet (replicating, only at the \
                            source, or unknown), 1 error; with a command, the command's own.\n\
                            Example: ckpt=$(ferry resolve /ckpt/mm-large/step_001000 --wait 5m \
                            --server https://eval-b-1:7070) && run_eval \"$ckpt\"\n\
                            With a lease, the version read cannot change or go while the \
                            command runs, even if training re-saves the checkpoint:\n  \
                            ferry resolve /ckpt/mm-large/step_001000 --wait 5m --lease 10m \
                            -- run_eval {}"
    )]
    Resolve {
        /// The checkpoint's absolute path at the source (or a path inside
        /// it), or its hdfs:// or s3:// URL when it is under such a
        /// source root.
        path: String,
        /// Wait up to this long (e.g. 30s, 5m; at most 5m) for the
        /// replica to be published before answering.
        #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
        wait: Duration,
        /// Take a reader lease of this length (1s to 7d, e.g. 10m) on the
        /// version found: the printed path (on HDFS or S3, URL) then names
        /// that version's own directory (prefix), kept until the lease
        /// expires or is released; not on an HDFS sink without
        /// [sink.hdfs] versions. With a
        /// command after `--`, the lease is renewed while the command
        /// runs and released when it ends; without, it is printed (id and
        /// expiry on stderr) and left to expire.
        #[arg(long, value_parser = humantime::parse_duration)]
        lease: Option<Duration>,
        /// Only the full replica counts as local: under a weights-first
        /// publish the weights-only version, published first (and answered
        /// without --full, with a note), is not it. With --wait, waits for
        /// the full replica.
        #[arg(long)]
        full: bool,
        /// A command to run on the leased path (on HDFS or S3, URL) while
        /// the lease holds (after `--`): `{}` in its arguments becomes it,
        /// and the
        /// environment variable FERRY_PATH holds it (FERRY_LEASE the
        /// lease id). Needs --lease. SIGTERM to ferry goes to the command;
        /// the lease is held until the command exits.
        #[arg(last = true, value_name = "COMMAND")]
        command: Vec<String>,
        #[command(flatten)]
        server: client::ServerArgs,
        /// Print the API's JSON answer instead (exit codes unchanged).
        #[arg(long)]
        json: bool,
    },
    /// Send an anomaly signal for a training job to the source: the job's
    /// score rises and its newest unpublished checkpoint becomes urgent
    /// for a while (`[scheduler] urgent_for`). Needs a signaler token.
    Signal {
        /// Job name.
        #[arg(long)]
        job: String,
        /// What was seen: loss_spike, grad_norm_spike, nan,
        /// eval_regression or manual.
        #[arg(long)]
        kind: String,
        /// How bad, 0..1.
        #[arg(long, value_parser = parse_severity)]
        severity: f64,
        /// Training step at which it was seen.
        #[arg(long)]
        step: Option<i64>,
        /// A retry with the same key (1 to 200 bytes) changes nothing and
        /// prints the first signal's outcome.
        #[arg(long)]
        idempotency_key: Option<String>,
        #[command(flatten)]
        server: client::ServerArgs,
        /// Print the API's JSON answer instead.
        #[arg(long)]
        json: bool,
    },
    /// Export the source agent's recorded scheduling history as a trace
    /// for `ferry replay FILE`: try a scheduler change (weights, floors,
    /// half-lives, admission limits) on yesterday's traffic before rolling
    /// it out. Needs an operator token.
    ///
    /// The trace is JSON lines (format version 1): a header with the
    /// links' rate caps and RTTs and the jobs' sizes and importances at the
    /// start, then one event per line in time order: transfers queued
    /// (class, job, bytes), class and importance changes, job changes,
    /// pauses, resumes, cancels, rate changes and signals. Transfers still
    /// queued or moving at the start arrive again at the start, as they
    /// were then.
    #[command(
        after_help = "Examples: ferry trace --since 24h -o yesterday.trace, then ferry replay \
                      yesterday.trace --policy priority --policy new-weights.toml\n\
                      ferry trace --since 2025-06-01T00:00:00Z > june.trace"
    )]
    Trace {
        /// Start of the trace: a duration before now (24h, 90m, 7days) or
        /// an RFC 3339 time in UTC (2025-06-01T00:00:00Z). Default: all
        /// that was recorded.
        #[arg(long, value_name = "DURATION|RFC3339", value_parser = commands::parse_since)]
        since: Option<commands::Since>,
        /// Write the trace to FILE instead of stdout.
        #[arg(long, short = 'o', value_name = "FILE")]
        output: Option<PathBuf>,
        #[command(flatten)]
        server: client::ServerArgs,
    },
    /// The site's pool: every agent sharing the catalog of the agent
    /// asked, its state (live, draining, down, stopped), its last
    /// heartbeat, the transfers it holds and its rates. Needs a reader
    /// token. `ferry pool settings` shows the settings the pool shares,
    /// `ferry pool set KEY VALUE` changes one (their options, such as
    /// `--server`, go after the subcommand).
    #[command(args_conflicts_with_subcommands = true)]
    Pool {
        #[command(subcommand)]
        command: Option<PoolCommand>,
        #[command(flatten)]
        server: client::ServerArgs,
        /// Print the API's JSON answer instead.
        #[arg(long)]
        json: bool,
    },
    /// Drain an agent of the pool (any agent of the pool takes the
    /// request): it claims no new transfer, finishes what it holds, and
    /// hands the source roots it watches over to the other agents at once.
    /// The drain lasts across restarts until `--undo`. Without `--wait`
    /// the command returns once the drain is recorded. Needs an operator
    /// token.
    Drain {
        /// The agent's name (as `ferry pool` lists it).
        name: String,
        /// Undo an earlier drain: the agent claims transfers again.
        #[arg(long)]
        undo: bool,
        /// Wait up to this long (e.g. 5m) until the agent holds nothing;
        /// exit code 1 if it still does then.
        #[arg(long, value_parser = humantime::parse_duration, conflicts_with = "undo")]
        wait: Option<Duration>,
        #[command(flatten)]
        server: client::ServerArgs,
        /// Print the API's JSON answer instead.
        #[arg(long)]
        json: bool,
    },
    /// Replicas at a sink: list (with removal records), pin, unpin,
    /// remove. Listing needs a reader token, the others an operator token.
    Replica {
        #[command(subcommand)]
        command: ReplicaCommand,
    },
    /// API bearer tokens.
    Token {
        #[command(subcommand)]
        command: TokenCommand,
    },
    /// The agent's catalog.
    Catalog {
        #[command(subcommand)]
        command: CatalogCommand,
    },
    /// Re-hash a published replica against its manifest and report any
    /// difference (reads the sink's catalog, and the replica through the
    /// sink's store: a local directory, HDFS or S3).
    #[command(
        after_help = "Examples: ferry verify /eval/train-a/job/step_100 --config sink.toml\n  \
                      ferry verify hdfs://eval-nn:8020/eval/train-a/job/step_100 --config sink.toml\n\
                      Exit codes: 0 every chunk matches, 1 a difference (each printed as \
                      MISMATCH) or an error."
    )]
    Verify {
        /// The replica as `ferry resolve` prints it: its directory at the
        /// sink, or on an HDFS or S3 sink its URL (under `[sink] root`).
        path: String,
        /// The sink agent's config file (for its data directory).
        #[arg(long, short, env = "FERRY_CONFIG")]
        config: PathBuf,
    },
    /// Certificates for agents.
    Certs {
        #[command(subcommand)]
        command: CertsCommand,
    },
    /// Generate a realistic synthetic checkpoint (thousands of per-tensor
    /// shards, more than 60 % under 16 KiB, a few large ones).
    ///
    /// --model picks a preset (7b, 70b, mm); --scale shrinks its full-scale
    /// tensors by a factor instead of sizing by --size; --shards writes
    /// exactly N tensor files of --size in all.
    ///
    /// With --format, write it the way a training framework saves, over
    /// time: one thread per rank, the framework's file names, write order
    /// and commit marker (including the races where a marker lands before
    /// every rank is done), optionally paced and with a simulated failure.
    ///
    /// --out may also be hdfs://NAMENODE:PORT/DIR or s3://BUCKET/PREFIX:
    /// then every file is written whole, one after the other (HDFS:
    /// sequentially, in pieces of 1 MiB; S3: object by object, one PUT up
    /// to 8 MiB, else a multipart upload of 8 MiB parts), same names and
    /// bytes as in a local directory, in an order the framework's ranks
    /// close them, markers last: temporary names and renames are dropped
    /// (Orbax writes straight into <N>/), a marker rewritten in place gets
    /// its final content last, NeMo's -unfinished file is deleted last.
    #[command(
        after_help = "Examples:\n  ferry gen --out hdfs://namenode:8020/ckpt/job --format dcp --size 200MB\n  \
                      ferry gen --out s3://bucket/ckpt/job --format hf --s3-endpoint http://10.0.0.5:8333 \\\n    \
                      --s3-access-key-id KEYID --s3-secret-access-key-file /etc/ferry/s3.key"
    )]
    Gen {
        /// Output directory (created), or hdfs://NAMENODE:PORT/DIR, or
        /// s3://BUCKET/PREFIX. With --format: the source root; the
        /// checkpoint directory is created inside it (ROOT/step_00001000 for
        /// dcp and generic, ROOT/iter_0001000 for megatron and
        /// megatron_dist, ROOT/global_step1000 for deepspeed, ROOT/step-1000
        /// for hf, ROOT/checkpoint-1000 for hf_trainer) and root-level
        /// markers (DeepSpeed `latest`, Megatron
        /// `latest_checkpointed_iteration.txt`) beside it.
        #[arg(long)]
        out: PathBuf,
        /// Total size, e.g. 1.4GB, 200MB, 512MiB. With --format, the size of
        /// all files of the checkpoint, framing included (within about 1 %).
        /// With a 7b or 70b --model, the preset is scaled to it (never
        /// above its full size).
        #[arg(long, visible_alias = "target-bytes", default_value = "1.4GB", value_parser = ferry_proto::units::parse_size)]
        size: u64,
        /// Model preset: 7b (Llama-2-7B, 6.74e9 parameters, 291 tensors),
        /// 70b (Llama-2-70B, 6.90e10, 723 tensors), mm (decoder with vision
        /// and audio towers, more than 60 % of tensors under 16 KiB; sized
        /// by --size it grows with the size, at --scale 1 it has 1.28e10
        /// parameters in 2,201 tensors).
        #[arg(long, default_value = "mm")]
        model: ferry_gen::Preset,
        /// Multiply every tensor's full-scale element count by S
        /// (0 < S <= 1, at least one element each), keeping counts and
        /// ratios; the resulting size is printed. Instead of --size.
        #[arg(long, value_parser = ferry_gen::parse_scale, conflicts_with_all = ["size", "shards"])]
        scale: Option<f64>,
        /// Exactly N tensor files (plus the marker) adding up to --size:
        /// the model's layer pattern repeated or cut to N. At least the
        /// preset's fixed tensors (3 for 7b and 70b, 25 for mm), at most
        /// 100000, and enough of them for the preset's share of files
        /// under 16 KiB at this --size (the error says when not). Only for
        /// the per-tensor layout (no --format, or --format generic).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=ferry_gen::MAX_SHARDS))]
        shards: Option<u64>,
        /// Seed for the content (same seed, same bytes).
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Commit marker file written last (the per-tensor layout and
        /// --format generic).
        #[arg(long, default_value = "COMMITTED")]
        marker: String,
        /// Write like a framework: dcp (PyTorch DCP), megatron_dist
        /// (Megatron-Core torch_dist), megatron (Megatron-LM legacy
        /// mp_rank_XX/model_optim_rng.pt), deepspeed (ZeRO-2 with `latest`),
        /// hf (transformers save_pretrained, sharded safetensors),
        /// hf_trainer (HF Trainer checkpoint-N), generic (per-tensor files
        /// and --marker), torchtitan (DCP in step-N), nemo (NeMo 2
        /// weights/ + context/ with a <name>-unfinished marker), orbax
        /// (<N>.orbax-checkpoint-tmp-<ts>/ renamed to <N>/), bytecheckpoint
        /// (global_step_N/{model,optimizer,extra_state}). Without it: per-tensor files directly in --out,
        /// the marker last.
        #[arg(long)]
        format: Option<ferry_gen::format::GenFormat>,
        /// Training step of the checkpoint (names the directory; written
        /// into trackers and trainer_state.json).
        #[arg(long, default_value_t = 1000, requires = "format")]
        step: u64,
        /// Parallel writers, one thread each: DCP/FSDP ranks, Megatron
        /// tensor-parallel ranks, DeepSpeed data-parallel ranks, HF Trainer
        /// processes (hf writes from one).
        #[arg(long, default_value_t = 4, requires = "format", value_parser = clap::value_parser!(u32).range(1..=4096))]
        ranks: u32,
        /// Aggregate write bandwidth of all ranks, e.g. 500Mbit/s, 2Gbit/s
        /// (paced with sleeps; default: as fast as the disk).
        #[arg(long, value_parser = config::parse_rate, requires = "format")]
        write_rate: Option<u64>,
        /// Simulate a failure: none; kill (stop for good half-way: partial
        /// files, no marker); truncated (one data file cut to half, marker
        /// written); zero-byte (one data file left empty, marker written);
        /// stale-marker (the previous step's marker is written first);
        /// reused-dir (two complete saves into the same directory, the
        /// second with seed + 1).
        #[arg(long, default_value = "none", requires = "format")]
        fault: ferry_gen::format::Fault,
        #[command(flatten)]
        s3: GenS3Args,
        /// hdfs:// --out only: how many finished files may wait to be
        /// closed together. Closing an HDFS file waits for the NameNode to
        /// complete its last block (often half a second), so closes run
        /// together at the save's ordering points (before a marker, and at
        /// the end) or when this many wait; 1 closes each file as it is
        /// finished.
        #[arg(long, default_value_t = ferry::remote_gen::PENDING_CLOSES, value_name = "N",
              value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=4096))]
        hdfs_closes: usize,
    },
    /// User-space WAN emulator: a UDP relay adding one-way delay and
    /// jitter, a rate cap with a bounded drop-tail queue, loss, corruption,
    /// duplication and reordering, and a link cut on demand.
    ///
    /// Send SIGUSR1 to cut the link: every datagram in both directions is
    /// dropped, also those in flight when they fall due, until SIGUSR2
    /// restores it; each prints one line ("link-emu: link cut ...",
    /// "link-emu: link restored ..."). Ctrl-C or SIGTERM stops the relay
    /// and prints its counters per direction: datagrams delivered (copies
    /// included), dropped by queue, by loss and by cut, duplicated,
    /// reordered and corrupted.
    #[command(
        after_help = "Example, a 20 s cut after 30 s: ferry link-emu --listen 127.0.0.1:7444 \
                      --forward 127.0.0.1:7443 --rate 100Mbit/s --rtt 40ms --loss 0.01 \
                      --jitter 5ms --reorder --duplicate 0.02 --seed 7 & sleep 30; \
                      kill -USR1 $!; sleep 20; kill -USR2 $!"
    )]
    LinkEmu(LinkEmuArgs),
    /// One command, no config, no root: generate a checkpoint, start a
    /// source and a sink agent behind an emulated WAN link, replicate, and
    /// print what happened.
    Demo(demo::DemoArgs),
    /// Try scheduler policies on recorded or generated traffic: replays a
    /// trace (or --preset) through the agents' own scheduler on a
    /// simulated link, in simulated time, and prints per class the time to
    /// ready (p50, p90, p99, max) for each --policy side by side. No
    /// network, no files moved, no agent needed.
    Replay(ferry::replay::ReplayArgs),
}

/// `ferry gen`'s settings of an s3:// --out (as `[sink.s3]`).
#[derive(Debug, Clone, Default, clap::Args)]
struct GenS3Args {
    /// s3:// --out only: endpoint URL of an S3-compatible store, e.g.
    /// http://10.0.0.5:8333 (default: AWS_ENDPOINT, else AWS S3).
    #[arg(long, value_name = "URL")]
    s3_endpoint: Option<String>,
    /// s3:// --out only: region (default: AWS_REGION, else us-east-1).
    #[arg(long, value_name = "REGION")]
    s3_region: Option<String>,
    /// s3:// --out only: access key id (default: AWS_ACCESS_KEY_ID).
    #[arg(long, value_name = "ID")]
    s3_access_key_id: Option<String>,
    /// s3:// --out only: file holding the secret access key, one line
    /// (default: AWS_SECRET_ACCESS_KEY). The key is never printed.
    #[arg(long, value_name = "FILE")]
    s3_secret_access_key_file: Option<PathBuf>,
}

impl GenS3Args {
    fn settings(self) -> ferry::remote_gen::S3Settings {
        ferry::remote_gen::S3Settings {
            endpoint: self.s3_endpoint,
            region: self.s3_region,
            access_key_id: self.s3_access_key_id,
            secret_access_key_file: self.s3_secret_access_key_file,
        }
    }
}

/// `ferry link-emu` flags.
#[derive(Debug, clap::Args)]
struct LinkEmuArgs {
    /// Address agents send to.
    #[arg(long)]
    listen: SocketAddr,
    /// Address the relay forwards to (the sink's QUIC address).
    #[arg(long)]
    forward: SocketAddr,
    /// Rate cap per direction, e.g. 1Gbit/s.
    #[arg(long, default_value = "1Gbit/s", value_parser = config::parse_rate)]
    rate: u64,
    /// Round-trip time added (half per direction), at most 1 day.
    #[arg(long, default_value = "100ms", value_parser = parse_emulated_delay)]
    rtt: Duration,
    /// Random loss probability per datagram, 0..1.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true, value_parser = parse_probability)]
    loss: f64,
    /// Probability a datagram gets one byte flipped, 0..1.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true, value_parser = parse_probability)]
    corrupt: f64,
    /// Probability a delivered datagram is delivered twice, 0..1 (as
    /// netem's duplicate): the byte-identical copy is sent right after the
    /// original and takes link capacity and queue room like it.
    #[arg(long, value_name = "P", default_value_t = 0.0, allow_negative_numbers = true, value_parser = parse_probability)]
    duplicate: f64,
    /// Jitter, e.g. 5ms (at most 1 day): each datagram's one-way delay is
    /// RTT/2 plus a uniform offset within +-this, never below zero. Without
    /// --reorder datagrams keep their order (jitter only bunches them up).
    #[arg(long, value_name = "DURATION", default_value = "0s", value_parser = parse_emulated_delay)]
    jitter: Duration,
    /// Let jitter reorder datagrams: each arrives at its own instant,
    /// overtaking earlier ones delayed more. No effect without --jitter.
    #[arg(long)]
    reorder: bool,
    /// Seed of the random decisions (loss, corruption, duplication,
    /// jitter): the direction towards --forward uses N, the way back
    /// N + 1. The same seed and the same traffic give the same decisions.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 0,
        allow_negative_numbers = true
    )]
    seed: u64,
    /// Queue limit in bytes (default one bandwidth-delay product).
    #[arg(long, value_parser = ferry_proto::units::parse_size)]
    queue: Option<u64>,
}

#[derive(Debug, Subcommand)]
enum PoolCommand {
    /// The settings this agent uses (`GET /v1/settings`): the
    /// scheduler's and each link's rate cap; in a pool (PostgreSQL
    /// catalog) the catalog's values, which every agent of the pool uses,
    /// with who stored them. Needs a reader token.
    Settings {
        #[command(flatten)]
        server: client::ServerArgs,
        /// Print the API's JSON answer instead.
        #[arg(long)]
        json: bool,
    },
    /// Change a setting for the whole pool (`PUT /v1/settings/KEY`); any
    /// agent of the pool takes it and every agent applies it within
    /// about a second. KEY is `scheduler.NAME` (a `[scheduler]` key, e.g.
    /// `scheduler.max_active`, `scheduler.weights.severity`; a pool
    /// only), `link.NAME.rate` (e.g. `2Gbit/s`), `job.NAME.importance`
    /// or `job.NAME.model_params`. Needs an operator token.
    Set {
        /// The setting, e.g. `scheduler.max_active`, `link.to-eval.rate`.
        key: String,
        /// Its new value, e.g. `8`, `2Gbit/s`, `10m`, `0.9`.
        value: String,
        #[command(flatten)]
        server: client::ServerArgs,
        /// Print the API's JSON answer instead.
        #[arg(long)]
        json: bool,
    },
    /// Remove a stopped or down agent from the pool's listing
    /// (`DELETE /v1/agents/NAME`), e.g. a host taken out of service for
    /// good; a live agent is refused (stop it first). Needs an operator
    /// token.
    Forget {
        /// The agent's name (as `ferry pool` lists it).
        name: String,
        #[command(flatten)]
        server: client::ServerArgs,
    },
}

#[derive(Debug, Subcommand)]
enum ReplicaCommand {
    /// List the sink's replicas, newest first: id, state, job, step,
    /// bytes, pin or removal, and where it is (a local path, or its URL on
    /// an HDFS or S3 sink).
    #[command(after_help = "Example: ferry replica ls --state removed (the removal records)")]
    Ls {
        /// Only rows in this state: receiving, published, failed,
        /// cancelled, removing or removed.
        #[arg(long)]
        state: Option<String>,
        #[command(flatten)]
        server: client::ServerArgs,
        /// Print the API's JSON answer instead.
        #[arg(long)]
        json: bool,
    },
    /// Remove a published replica: it leaves the published namespace at
    /// once (resolve stops naming it) and its files are deleted in the
    /// background. A pinned replica, or one a reader lease holds, is
    /// refused unless --force. A version a re-save replaced goes by
    /// itself once no lease holds it; --force ends its leases.
    Rm {
        /// Replica id (`ferry replica ls`).
        id: i64,
        /// Remove it even if pinned or leased (recorded with the
        /// removal); for a replaced version, end its leases.
        #[arg(long)]
        force: bool,
        /// Why, kept with the removal record.
        #[arg(long)]
        reason: Option<String>,
        #[command(flatten)]
        server: client::ServerArgs,
        /// Print the API's JSON answer instead.
        #[arg(long)]
        json: bool,
    },
    /// Pin a published replica: no retention policy removes it, and
    /// `ferry replica rm` needs --force.
    Pin {
        /// Replica id.
        id: i64,
        /// Why (shown with the pin).
        #[arg(long)]
        reason: Option<String>,
        /// How long (7d, 12h); default: until unpinned.
        #[arg(long = "for", value_name = "DURATION")]
        for_: Option<String>,
        #[command(flatten)]
        server: client::ServerArgs,
        /// Print the API's JSON answer instead.
        #[arg(long)]
        json: bool,
    },
    /// Remove a replica's pin.
    Unpin {
        /// Replica id.
        id: i64,
        #[command(flatten)]
        server: client::ServerArgs,
        /// Print the API's JSON answer instead.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
enum CatalogCommand {
    /// Two jobs. With --to: copy a single agent's SQLite catalog
    /// (agent.data_dir/ferry.db) into an empty PostgreSQL catalog, every
    /// row with its id, in one transaction; then set [catalog] url in the
    /// config and restart. Without --to, for an agent whose config names a
    /// PostgreSQL catalog: bring that catalog's schema up to this
    /// release's (the upgrade step of a pool, before its agents are
    /// restarted one by one on the new release; migrations are additive
    /// within a release, so agents of the previous release keep working).
    ///
    /// With --to, stop the agent first (its lock on the data directory is
    /// taken). A target that already holds transfers or replicas is
    /// refused and left as it is; the SQLite file is left as it is. The
    /// target records the agent's site (agent.site). --to with a config
    /// that already names a PostgreSQL catalog is refused. An agent also
    /// brings its catalog's schema up to date when it starts, and refuses
    /// a schema newer than it knows, naming both versions.
    Migrate {
        /// PostgreSQL catalog to copy into: postgres://USER@HOST[:PORT]/DATABASE
        /// (give the password with --password-file rather than here, where
        /// other users of the machine can see it).
        #[arg(long, value_name = "URL")]
        to: Option<String>,
        /// File holding the target's password (one line).
        #[arg(long, value_name = "FILE")]
        password_file: Option<PathBuf>,
        /// The agent's config file (for its data directory and site).
        #[arg(long, short, env = "FERRY_CONFIG")]
        config: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
enum TokenCommand {
    /// Make a new random token: prints it once (first line of stdout) and
    /// the [[api.tokens]] entry to add to the agent's config, which holds
    /// only the token's hash. Roles: reader (resolve, list, status, UI),
    /// signaler (also signals and announcements), operator (also push,
    /// pause, resume, cancel, class, importance, jobs, rate caps, and at a
    /// sink pin, unpin and remove replicas).
    #[command(
        after_help = "Example: ferry token new --role signaler --name trainer-mm-large \
                            >> token.txt; give the first line to the client (FERRY_TOKEN), \
                            paste the rest into the agent's config file and restart it."
    )]
    New {
        /// What the token may do: reader, signaler or operator.
        #[arg(long, value_parser = ["reader", "signaler", "operator"])]
        role: String,
        /// Name shown in the agent's logs and 403 answers instead of the
        /// token (default: ROLE-<8 hex digits of its hash>).
        #[arg(long)]
        name: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
enum CertsCommand {
    /// Make a development CA (reused if present) and a certificate per
    /// agent, SAN = agent name: DIR/ca.pem, DIR/ca.key, DIR/NAME.pem,
    /// DIR/NAME.key. With --api-host, also an HTTPS certificate per agent
    /// for its API: DIR/NAME-api.pem, DIR/NAME-api.key.
    #[command(
        after_help = "HTTPS for the API: ferry certs init --out certs --agent train-a-1 \
                            --api-host localhost --api-host 127.0.0.1, then in the agent's config \
                            [api] tls_cert = \"certs/train-a-1-api.pem\", tls_key = \
                            \"certs/train-a-1-api.key\"; clients pass --ca-cert certs/ca.pem."
    )]
    Init {
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// Agent names (repeat).
        #[arg(long = "agent", required = true)]
        agents: Vec<String>,
        /// Also write NAME-api.pem and NAME-api.key, an HTTPS server
        /// certificate for each agent's API ([api] tls_cert, tls_key)
        /// valid for the agent name and this host: a DNS name or an IP
        /// address clients dial (repeat, e.g. --api-host localhost
        /// --api-host 127.0.0.1 --api-host train-a-1.example).
        #[arg(long = "api-host", value_name = "HOST")]
        api_hosts: Vec<String>,
        /// Validity in days.
        #[arg(long, default_value_t = 365)]
        days: u32,
    },
}

fn main() {
    let cli = Cli::parse();
    // PostgreSQL's notices (a migration table that exists already) are
    // not news.
    let default = if matches!(cli.command, Command::Demo(_)) {
        "warn"
    } else {
        "info,sqlx::postgres::notice=warn"
    };
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            EnvFilter::try_from_env("FERRY_LOG").unwrap_or_else(|_| EnvFilter::new(default)),
        )
        .with_writer(std::io::stderr)
        .init();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            std::process::exit(1);
        }
    };
    // The demo owns a temporary directory: on Ctrl-C or SIGTERM its agents
    // are stopped first (runtime shut down), then the directory removed.
    let is_demo = matches!(cli.command, Command::Demo(_));
    let outcome = rt.block_on(async {
        let interrupted = async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
            loop {
                match &mut term {
                    Some(term) => tokio::select! {
                        _ = tokio::signal::ctrl_c() => {}
                        _ = term.recv() => {}
                    },
                    None => {
                        let _ = tokio::signal::ctrl_c().await;
                    }
                }
                // `demo --keep-running` stops its agents itself on the
                // first one; a second one stops at once.
                if !demo::handles_interrupts() || demo::interrupt() {
                    break;
                }
            }
        };
        if is_demo {
            tokio::select! {
                r = run(cli) => Some(r),
                _ = interrupted => None,
            }
        } else {
            Some(run(cli).await)
        }
    });
    match outcome {
        Some(Ok(())) => {}
        Some(Err(e)) => {
            if let Some(client::Exit(code)) = e.downcast_ref::<client::Exit>() {
                std::process::exit(*code);
            }
            if out::is_closed(&e) {
                // The reader of stdout went away (`| head`): nothing to say.
                std::process::exit(out::CLOSED_EXIT);
            }
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
        None => {
            rt.shutdown_timeout(Duration::from_secs(3));
            let removed = demo::remove_work_dir();
            eprintln!("interrupted{removed}");
            std::process::exit(130);
        }
    }
}

async fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Serve { config } => serve(&config).await,
        Command::Push {
            path,
            link,
            class,
            deadline,
            server,
            no_wait,
        } => push(&path, link, &class, deadline, &server, no_wait).await,
        Command::Status { server, json, slow } => commands::status(&server, json, slow).await,
        Command::Resolve {
            path,
            wait,
            lease,
            full,
            command,
            server,
            json,
        } => match (lease, command.is_empty()) {
            (None, true) => commands::resolve(&server, &path, wait, full, json).await,
            (None, false) => anyhow::bail!(
                "a command after -- runs under a lease: add --lease (e.g. --lease 10m)"
            ),
            (Some(lease), _) => {
                commands::resolve_leased(&server, &path, wait, lease, &command, full, json).await
            }
        },
        Command::Signal {
            job,
            kind,
            severity,
            step,
            idempotency_key,
            server,
            json,
        } => {
            let s = commands::SignalArgs {
                job,
                kind,
                severity,
                step,
                idempotency_key,
            };
            commands::signal(&server, &s, json).await
        }
        Command::Trace {
            since,
            output,
            server,
        } => commands::trace(&server, since, output.as_deref()).await,
        Command::Pool {
            command: None,
            server,
            json,
        } => commands::pool(&server, json).await,
        Command::Pool {
            command: Some(PoolCommand::Settings { server, json }),
            ..
        } => commands::pool_settings(&server, json).await,
        Command::Pool {
            command:
                Some(PoolCommand::Set {
                    key,
                    value,
                    server,
                    json,
                }),
            ..
        } => commands::pool_set(&server, &key, &value, json).await,
        Command::Pool {
            command: Some(PoolCommand::Forget { name, server }),
            ..
        } => commands::pool_forget(&server, &name).await,
        Command::Drain {
            name,
            undo,
            wait,
            server,
            json,
        } => commands::drain(&server, &name, undo, wait, json).await,
        Command::Replica { command } => match command {
            ReplicaCommand::Ls {
                state,
                server,
                json,
            } => commands::replica_ls(&server, state.as_deref(), json).await,
            ReplicaCommand::Rm {
                id,
                force,
                reason,
                server,
                json,
            } => commands::replica_rm(&server, id, force, reason.as_deref(), json).await,
            ReplicaCommand::Pin {
                id,
                reason,
                for_,
                server,
                json,
            } => commands::replica_pin(&server, id, reason, for_, json).await,
            ReplicaCommand::Unpin { id, server, json } => {
                commands::replica_unpin(&server, id, json).await
            }
        },
        Command::Token {
            command: TokenCommand::New { role, name },
        } => {
            let role: api::Role = role.parse().map_err(|e: String| anyhow::anyhow!(e))?;
            let (_, text) = commands::token_new(role, name.as_deref())?;
            out::print(format_args!("{text}"))
        }
        Command::Verify { path, config } => verify(&path, &config).await,
        Command::Catalog {
            command:
                CatalogCommand::Migrate {
                    to,
                    password_file,
                    config,
                },
        } => catalog_migrate(to.as_deref(), password_file.as_deref(), &config).await,
        Command::Certs {
            command:
                CertsCommand::Init {
                    out,
                    agents,
                    api_hosts,
                    days,
                },
        } => {
            let written = replicator::tls::init_dev_pki_with_api(&out, &agents, &api_hosts, days)?;
            for p in written {
                outln!("wrote {}", p.display())?;
            }
            Ok(())
        }
        Command::Gen {
            out,
            size,
            model,
            scale,
            shards,
            seed,
            marker,
            format,
            step,
            ranks,
            write_rate,
            fault,
            s3,
            hdfs_closes,
        } => {
            let s3 = s3.settings();
            if !ferry::remote_gen::is_remote(&out) && s3.is_set() {
                bail!("the --s3-* options apply to an s3:// --out only");
            }
            let s3 = (s3, hdfs_closes);
            match format {
                None => {
                    let opts = ferry_gen::GenOptions {
                        model,
                        scale,
                        shards,
                        marker: Some(marker),
                        seed,
                        ..ferry_gen::GenOptions::new(out, size)
                    };
                    if ferry::remote_gen::is_remote(&opts.out) {
                        return gen_per_tensor_remote(opts, s3).await;
                    }
                    gen_per_tensor(opts).await
                }
                Some(format) => {
                    let opts = ferry_gen::format::SaveOptions {
                        step,
                        ranks,
                        write_rate_bps: write_rate,
                        seed,
                        marker,
                        fault,
                        model,
                        scale,
                        shards,
                        ..ferry_gen::format::SaveOptions::new(out, format, size)
                    };
                    if ferry::remote_gen::is_remote(&opts.root) {
                        return gen_format_remote(opts, s3).await;
                    }
                    gen_format(opts).await
                }
            }
        }
        Command::LinkEmu(args) => link_emu(args).await,
        Command::Demo(args) => demo::run(args).await,
        Command::Replay(args) => ferry::replay::run(&args),
    }
}

/// Plans `ferry gen` without --format and, for a `--scale`, says what it
/// will write.
///
/// # Errors
/// Options the plan refuses, or stdout gone.
fn gen_per_tensor_preview(opts: &ferry_gen::GenOptions) -> Result<ferry_gen::Preview> {
    let preview = ferry_gen::preview(opts).context("planning the checkpoint")?;
    if let Some(scale) = preview.scale {
        outln!(
            "model {} ({} parameters at full scale) at scale {scale:.6}: {} tensor files, \
             {} bytes, {} under 16 KiB",
            opts.model,
            opts.model.params(),
            preview.summary.shards,
            preview.summary.bytes,
            preview.summary.small_shards
        )?;
    }
    Ok(preview)
}

/// `ferry gen` without --format: the per-tensor layout of [`ferry_gen::generate`].
async fn gen_per_tensor(opts: ferry_gen::GenOptions) -> Result<()> {
    let out = opts.out.clone();
    let preview = gen_per_tensor_preview(&opts)?;
    let size = preview.summary.bytes;
    if std::fs::read_dir(&out).is_ok_and(|mut d| d.next().is_some()) {
        bail!(
            "--out {} exists and is not empty; choose a new directory",
            out.display()
        );
    }
    if out.exists() && !out.is_dir() {
        bail!("--out {} exists and is not a directory", out.display());
    }
    ferry_gen::ensure_space(&out, size).with_context(|| format!("--out {}", out.display()))?;
    let bar = gen_bar(size)?;
    let b2 = bar.clone();
    let s =
        tokio::task::spawn_blocking(move || ferry_gen::generate(&opts, &|n| b2.set_position(n)))
            .await?
            .with_context(|| format!("generating into {}", out.display()))?;
    bar.finish_and_clear();
    print_gen_summary(&out, &s)
}

/// The last line of `ferry gen` without --format.
fn print_gen_summary(out: &Path, s: &ferry_gen::GenSummary) -> Result<()> {
    outln!(
        "{}: {} shards + commit marker, {} bytes, {} under 16 KiB ({:.1} %), largest {} bytes",
        out.display(),
        s.shards,
        s.bytes,
        s.small_shards,
        100.0 * s.small_shards as f64 / s.shards.max(1) as f64,
        s.largest
    )
}

/// The "generating" progress bar of `ferry gen`, for `total` bytes.
fn gen_bar(total: u64) -> Result<indicatif::ProgressBar> {
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(indicatif::ProgressStyle::with_template(
        "generating {bar:40} {bytes}/{total_bytes} {bytes_per_sec}",
    )?);
    Ok(bar)
}

/// `ferry gen --out hdfs://... | s3://...` without --format: the files of
/// [`ferry_gen::generate`], each written whole, the marker last.
async fn gen_per_tensor_remote(
    opts: ferry_gen::GenOptions,
    (s3, closes): (ferry::remote_gen::S3Settings, usize),
) -> Result<()> {
    let preview = gen_per_tensor_preview(&opts)?;
    let size = preview.summary.bytes;
    let url = opts.out.to_string_lossy().into_owned();
    let out = tokio::task::spawn_blocking(move || -> Result<_> {
        let out = ferry::remote_gen::RemoteOut::open(&url, &s3)?.with_pending_closes(closes);
        if !out.is_empty(Path::new(""))? {
            bail!(
                "--out {} exists and is not empty; choose a new directory",
                out.url()
            );
        }
        Ok(out)
    })
    .await??;
    let bar = gen_bar(size)?;
    let b2 = bar.clone();
    let url = out.url().to_string();
    let s = tokio::task::spawn_blocking(move || {
        ferry_gen::generate_into(&opts, &out, &|n| b2.set_position(n))
    })
    .await?
    .with_context(|| format!("generating into {url}"))?;
    bar.finish_and_clear();
    print_gen_summary(Path::new(&url), &s)
}

/// `ferry gen --format F`: one checkpoint written the framework's way.
async fn gen_format(opts: ferry_gen::format::SaveOptions) -> Result<()> {
    let dir = opts.checkpoint_dir();
    if std::fs::read_dir(&dir).is_ok_and(|mut d| d.next().is_some()) {
        bail!(
            "{} exists and is not empty; choose another --step or --out",
            dir.display()
        );
    }
    if opts.root.exists() && !opts.root.is_dir() {
        bail!(
            "--out {} exists and is not a directory",
            opts.root.display()
        );
    }
    let (preview, passes) = gen_preview(&opts)?;
    ferry_gen::ensure_space(&opts.root, preview.bytes)
        .with_context(|| format!("--out {}", opts.root.display()))?;
    let bar = gen_bar(preview.bytes.saturating_mul(passes))?;
    let b2 = bar.clone();
    let (format, fault) = (opts.format, opts.fault);
    let s = tokio::task::spawn_blocking(move || {
        ferry_gen::format::save(&opts, &|n| b2.set_position(n))
    })
    .await?
    .with_context(|| format!("writing a {format} checkpoint into {}", dir.display()))?;
    bar.finish_and_clear();
    print_save_summary(format, fault, s)
}

/// Plans `ferry gen --format` and, for a `--scale`, says what it will
/// write; returns the plan and how many passes the save makes (2 for
/// `--fault reused-dir`, which saves twice).
///
/// # Errors
/// Options the plan refuses, or stdout gone.
fn gen_preview(
    opts: &ferry_gen::format::SaveOptions,
) -> Result<(ferry_gen::format::SavePreview, u64)> {
    let passes = if opts.fault == ferry_gen::format::Fault::ReusedDir {
        2
    } else {
        1
    };
    let preview = ferry_gen::format::preview(opts).context("planning the checkpoint")?;
    if let Some(scale) = preview.scale {
        outln!(
            "model {} ({} parameters at full scale) at scale {scale:.6}: {} tensors, {} bytes \
             as {}",
            opts.model,
            opts.model.params(),
            preview.tensors,
            preview.bytes,
            opts.format
        )?;
    }
    Ok((preview, passes))
}

/// What `ferry gen --format` prints once the save is done.
fn print_save_summary(
    format: ferry_gen::format::GenFormat,
    fault: ferry_gen::format::Fault,
    s: ferry_gen::format::SaveSummary,
) -> Result<()> {
    let opened = humantime::format_rfc3339_millis(s.opened_at);
    let commit = match s.committed_at {
        Some(t) => format!(
            "committed by {} at {}",
            s.marker.display(),
            humantime::format_rfc3339_millis(t)
        ),
        None => format!("NOT committed ({} was not written)", s.marker.display()),
    };
    outln!(
        "{}: {format} checkpoint, {} files, {} bytes, {} tensors ({} under 16 KiB, {:.1} %); \
         opened at {opened}, {commit}",
        s.dir.display(),
        s.files,
        s.bytes,
        s.tensors,
        s.small_tensors,
        100.0 * s.small_tensors as f64 / s.tensors.max(1) as f64,
    )?;
    if fault != ferry_gen::format::Fault::None {
        let damaged = s
            .damaged
            .map(|p| format!(" ({} damaged)", p.display()))
            .unwrap_or_default();
        outln!("simulated fault: {fault}{damaged}")?;
    }
    Ok(())
}

/// `ferry gen --format F --out hdfs://... | s3://...`: the framework's
/// files, each written whole, in an order its ranks close them, markers
/// last ([`ferry_gen::format::save_into`]).
async fn gen_format_remote(
    mut opts: ferry_gen::format::SaveOptions,
    (s3, closes): (ferry::remote_gen::S3Settings, usize),
) -> Result<()> {
    let (preview, passes) = gen_preview(&opts)?;
    let url = opts.root.to_string_lossy().into_owned();
    let out = tokio::task::spawn_blocking(move || {
        ferry::remote_gen::RemoteOut::open(&url, &s3).map(|o| o.with_pending_closes(closes))
    })
    .await??;
    // The summary's paths are the store's URLs.
    opts.root = PathBuf::from(out.url());
    let dir = opts.checkpoint_dir();
    let rel = dir.strip_prefix(&opts.root).unwrap_or(&dir).to_path_buf();
    let out = tokio::task::spawn_blocking(move || -> Result<_> {
        if !out.is_empty(&rel)? {
            bail!(
                "{} exists and is not empty; choose another --step or --out",
                dir.display()
            );
        }
        Ok(out)
    })
    .await??;
    let bar = gen_bar(preview.bytes.saturating_mul(passes))?;
    let b2 = bar.clone();
    let (format, fault) = (opts.format, opts.fault);
    let dir = opts.checkpoint_dir();
    let s = tokio::task::spawn_blocking(move || {
        ferry_gen::format::save_into(&opts, &out, &|n| b2.set_position(n))
    })
    .await?
    .with_context(|| format!("writing a {format} checkpoint into {}", dir.display()))?;
    bar.finish_and_clear();
    print_save_summary(format, fault, s)
}

/// `--severity`: a finite number from 0 to 1 (JSON has no NaN or
/// infinity: they would reach the agent as `null`).
fn parse_severity(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number; give one from 0 to 1"))?;
    if !v.is_finite() || !(0.0..=1.0).contains(&v) {
        return Err(format!("must be a number from 0 to 1, got {s:?}"));
    }
    Ok(v)
}

/// `--loss`, `--corrupt`, `--duplicate`: a probability, a finite number
/// from 0 to 1 (clap names the flag in the error).
fn parse_probability(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number; give a probability from 0 to 1"))?;
    if !v.is_finite() || !(0.0..=1.0).contains(&v) {
        return Err(format!("must be a probability from 0 to 1, got {s:?}"));
    }
    Ok(v)
}

/// Longest `--rtt` or `--jitter` `ferry link-emu` accepts (1 day): a
/// longer one is a typo, and instants that far ahead overflow.
const MAX_EMULATED_DELAY: Duration = Duration::from_secs(24 * 3600);

/// `--rtt`, `--jitter`: a duration such as 100ms or 2s, at most
/// [`MAX_EMULATED_DELAY`].
fn parse_emulated_delay(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e} (e.g. 40ms, 2s)"))?;
    if d > MAX_EMULATED_DELAY {
        return Err(format!("{s:?} is longer than the 1 day allowed"));
    }
    Ok(d)
}

/// The role as the config file spells it, for the banner.
fn role_name(role: config::Role) -> &'static str {
    match role {
        config::Role::Source => "source",
        config::Role::Sink => "sink",
        config::Role::Both => "source and sink",
    }
}

async fn serve(path: &Path) -> Result<()> {
    let cfg = config::Config::load(path)?;
    let agent = agent::start(
        &cfg,
        agent::Overrides {
            catalog_url_env: std::env::var(config::CATALOG_URL_ENV).ok(),
            ..Default::default()
        },
    )
    .await?;
    // A closed stdout must not stop the agent.
    noteln!(
        "ferry agent {} ({}) serving: API {}/ QUIC {}",
        agent.name,
        role_name(cfg.agent.role),
        agent.api_url,
        agent.quic_addr
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("stopping: draining in-flight work (at most 10 s)");
    agent.stop(Duration::from_secs(8)).await;
    Ok(())
}

async fn push(
    path: &Path,
    link: Option<String>,
    class: &str,
    deadline: Option<String>,
    server: &client::ServerArgs,
    no_wait: bool,
) -> Result<()> {
    // A URL (a checkpoint under an HDFS or S3 source root) goes as it is;
    // a local path is made absolute here, where the user gave it.
    let abs = if replicator::storage::router::is_url(path) {
        path.to_path_buf()
    } else {
        std::fs::canonicalize(path).with_context(|| format!("{}", path.display()))?
    };
    let client = client::Client::new(server, client::REQUEST_TIMEOUT)?;
    let (_, body) = client
        .post(
            "/v1/transfers",
            &serde_json::json!({ "path": abs, "link": link, "class": class, "deadline": deadline }),
        )
        .await?;
    let id = body["id"].as_i64().context("answer has no transfer id")?;
    outln!("transfer {id} queued: {}", abs.display())?;
    if let Some(a) = body.get("admission") {
        outln!("{}", commands::admission_line(a))?;
    }
    if no_wait {
        return Ok(());
    }
    let bar = indicatif::ProgressBar::new(1);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta} {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let mut last_line = String::new();
    loop {
        let t = client.get(&format!("/v1/transfers/{id}"), &[]).await?;
        // Say what is happening whenever it changes: the state, and for a
        // transfer that cannot start, why (e.g. the sink is unreachable).
        let line = match (t["state"].as_str(), t["error"].as_str()) {
            (Some("queued"), Some(e)) => format!("queued, waiting for the link: {e}"),
            (Some(s), _) => s.to_string(),
            _ => String::new(),
        };
        if line != last_line {
            bar.suspend(|| eprintln!("transfer {id}: {line}"));
            last_line = line;
        }
        let total = commands::transfer_total(&t);
        bar.set_length(total.max(1));
        bar.set_position(commands::transfer_done(&t).min(total));
        let state = t["state"].as_str().unwrap_or("?").to_string();
        bar.set_message(state.clone());
        match state.as_str() {
            "published" => {
                bar.finish_and_clear();
                return outln!(
                    "published at the sink: {} (manifest root {})",
                    t["local_path"].as_str().unwrap_or("?"),
                    t["manifest_root"].as_str().unwrap_or("?")
                );
            }
            "failed" | "cancelled" => {
                bar.finish_and_clear();
                bail!(
                    "transfer {id} {state}: {}",
                    t["error"].as_str().unwrap_or("no reason given")
                );
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

async fn catalog_migrate(
    to: Option<&str>,
    password_file: Option<&Path>,
    cfg_path: &Path,
) -> Result<()> {
    let cfg = config::Config::load(cfg_path)?;
    let now = cfg.catalog_url(std::env::var(config::CATALOG_URL_ENV).ok().as_deref())?;
    let Some(to) = to else {
        let Some(url) = now else {
            bail!(
                "{} keeps the agent's catalog in SQLite ({}): give --to postgres://... to move \
                 it into PostgreSQL (a SQLite catalog's schema is brought up to date when the \
                 agent starts)",
                cfg_path.display(),
                cfg.agent.data_dir.join("ferry.db").display()
            );
        };
        if password_file.is_some() {
            bail!("--password-file goes with --to; the config's own catalog takes [catalog] password_file");
        }
        // Opening a PostgreSQL catalog applies the migrations it lacks,
        // and refuses one newer than this release.
        let c = ferry_catalog::Catalog::open_postgres(&url, &cfg.agent.site).await?;
        c.close().await;
        outln!(
            "catalog {url}: schema at version {}, this release's newest",
            ferry_catalog::schema_version()
        )?;
        return Ok(());
    };
    // An agent already on PostgreSQL has no SQLite catalog to move; copying
    // an empty one would point it at a new, empty pool.
    if let Some(now) = now {
        bail!(
            "{} already puts this agent's catalog in PostgreSQL ({now}); --to moves a single \
             agent's SQLite catalog (agent.data_dir/ferry.db) into PostgreSQL (to bring this \
             catalog's schema up to date, run ferry catalog migrate without --to)",
            cfg_path.display()
        );
    }
    let db = cfg.agent.data_dir.join("ferry.db");
    if !db.exists() {
        bail!(
            "{} does not exist: the agent of {} has no SQLite catalog to move",
            db.display(),
            cfg_path.display()
        );
    }
    let mut url =
        ferry_catalog::PostgresUrl::parse(to).map_err(|e| anyhow::anyhow!("--to: {e}"))?;
    if let Some(f) = password_file {
        url = url
            .with_password_file(f)
            .map_err(|e| anyhow::anyhow!("--password-file: {e}"))?;
    }
    let from = ferry_catalog::Catalog::open(&cfg.agent.data_dir).await?;
    let into = ferry_catalog::Catalog::open_postgres(&url, &cfg.agent.site).await?;
    let counts = from.copy_into(&into).await?;
    into.close().await;
    from.close().await;
    for (table, n) in &counts {
        outln!("{table}: {n} rows")?;
    }
    let password = match password_file {
        Some(f) => format!(" and password_file = \"{}\"", f.display()),
        None => String::new(),
    };
    noteln!(
        "copied {} into {url}; set [catalog] url = \"{url}\"{password} in {} \
         and start the agent; {} is left as it is",
        db.display(),
        cfg_path.display(),
        db.display(),
    );
    Ok(())
}

async fn verify(path: &str, cfg_path: &Path) -> Result<()> {
    let cfg = config::Config::load(cfg_path)?;
    let (store, at) = verify_target(&cfg, cfg_path, path).await?;
    let shown = if path.contains("://") {
        path.trim_end_matches('/').to_string()
    } else {
        at.display().to_string()
    };
    let catalog = match cfg.catalog_url(std::env::var(config::CATALOG_URL_ENV).ok().as_deref())? {
        // A PostgreSQL catalog takes several clients at once.
        Some(url) => ferry_catalog::Catalog::open_postgres(&url, &cfg.agent.site).await?,
        // Read-only use of the catalog: open the SQLite file directly so a
        // running agent keeps its lock.
        None => ferry_catalog::Catalog::open_read_only(&cfg.agent.data_dir).await?,
    };
    let report = replicator::verify::verify_replica_in(catalog, store, &at)
        .await
        .with_context(|| format!("verifying {shown}"))?;
    outln!(
        "{}: {} files, {} bytes checked against manifest root {}",
        shown,
        report.files,
        report.bytes,
        report.root
    )?;
    if report.problems.is_empty() {
        outln!("OK: every chunk matches")
    } else {
        for p in &report.problems {
            outln!("MISMATCH {p}")?;
        }
        bail!("{} problem(s) found", report.problems.len())
    }
}

/// Where `ferry verify` reads `path`: a local directory (made absolute)
/// through POSIX, or a URL under the sink's HDFS or S3 root through that
/// store, as its path in the store.
///
/// # Errors
/// No `[sink]` section for a URL, a URL of another store or outside the
/// root, a local path that does not exist, or a store that does not
/// answer.
async fn verify_target(
    cfg: &config::Config,
    cfg_path: &Path,
    path: &str,
) -> Result<(Arc<dyn replicator::storage::SourceStore>, PathBuf)> {
    use replicator::storage::remote::RemoteRoot;
    if !path.contains("://") {
        let abs = std::fs::canonicalize(path).with_context(|| path.to_string())?;
        return Ok((Arc::new(replicator::storage::posix::Posix), abs));
    }
    let sink = cfg.sink.as_ref().with_context(|| {
        format!(
            "{path}: {} has no [sink] section, so no store to read it from",
            cfg_path.display()
        )
    })?;
    let storage = sink.storage()?;
    let Some(root_url) = storage.url() else {
        bail!(
            "{path} is a URL, but this sink's root {} is a local directory: give the \
             replica's directory",
            sink.root.display()
        );
    };
    let root = RemoteRoot::parse(root_url)?;
    let target = RemoteRoot::parse(path)?;
    if (&target.scheme, &target.authority) != (&root.scheme, &root.authority) {
        bail!("{path} is not in this sink's store ([sink] root = {root_url})");
    }
    let at = PathBuf::from(root.check(&target.path)?);
    let url = root_url.to_string();
    let store = tokio::task::spawn_blocking(move || storage.reader())
        .await?
        .with_context(|| format!("opening the sink's store {url}"))?;
    Ok((store, at))
}

/// One direction's counters as `ferry link-emu` prints them at the end.
fn link_counts(s: &ferry_linkemu::LinkStats) -> String {
    format!(
        "{} packets, {} dropped by queue, {} by loss, {} by cut, {} duplicated, {} reordered, \
         {} corrupted",
        s.delivered_packets,
        s.dropped_queue,
        s.dropped_loss,
        s.dropped_cut,
        s.duplicated,
        s.reordered,
        s.corrupted
    )
}

async fn link_emu(a: LinkEmuArgs) -> Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut p = LinkParams::new(a.rate, a.rtt);
    p.loss = a.loss;
    p.corrupt = a.corrupt;
    p.duplicate = a.duplicate;
    p.jitter = a.jitter;
    p.reorder = a.reorder;
    p.seed = a.seed;
    if let Some(q) = a.queue {
        p.queue_bytes = q;
    }
    let mut down = p.clone();
    down.seed = p.seed.wrapping_add(1);
    // Handlers first: a signal must not kill the relay once it says it runs.
    let mut term = signal(SignalKind::terminate())?;
    let mut cut_signal = signal(SignalKind::user_defined1())?;
    let mut restore_signal = signal(SignalKind::user_defined2())?;
    let relay = spawn_relay(a.listen, a.forward, p, down)
        .await
        .with_context(|| format!("relay on --listen {}", a.listen))?;
    noteln!(
        "link-emu: {} -> {}, {} bit/s, RTT {:?}, loss {}, corrupt {}, duplicate {}, jitter {:?}{}, \
         seed {}; SIGUSR1 cuts the link, SIGUSR2 restores it, Ctrl-C stops",
        relay.local_addr(),
        a.forward,
        a.rate,
        a.rtt,
        a.loss,
        a.corrupt,
        a.duplicate,
        a.jitter,
        if a.reorder { " (reordering)" } else { "" },
        a.seed
    );
    let mut cut_since: Option<std::time::Instant> = None;
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
            _ = cut_signal.recv() => match cut_since {
                Some(t) => noteln!(
                    "link-emu: link cut (every datagram dropped) already, for {:.1} s; SIGUSR2 \
                     restores it",
                    t.elapsed().as_secs_f64()
                ),
                None => {
                    relay.set_cut(true);
                    cut_since = Some(std::time::Instant::now());
                    noteln!(
                        "link-emu: link cut (every datagram dropped) at {}; SIGUSR2 restores it",
                        humantime::format_rfc3339_millis(std::time::SystemTime::now())
                    );
                }
            },
            _ = restore_signal.recv() => match cut_since.take() {
                Some(t) => {
                    relay.set_cut(false);
                    let s = relay.stats();
                    noteln!(
                        "link-emu: link restored at {} after {:.1} s cut; dropped by cut so far: \
                         {} up, {} down",
                        humantime::format_rfc3339_millis(std::time::SystemTime::now()),
                        t.elapsed().as_secs_f64(),
                        s.up.dropped_cut,
                        s.down.dropped_cut
                    );
                }
                None => noteln!("link-emu: link restored (it was not cut)"),
            },
        }
    }
    let s = relay.stats();
    noteln!("up: {}; down: {}", link_counts(&s.up), link_counts(&s.down));
    relay.shutdown().await;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use clap::error::ErrorKind;

    use super::*;

    /// Parses `ferry gen --out x ARGS...`.
    fn parse_gen(args: &[&str]) -> Result<Command, clap::Error> {
        let argv = ["ferry", "gen", "--out", "x"]
            .into_iter()
            .chain(args.iter().copied());
        Cli::try_parse_from(argv).map(|cli| cli.command)
    }

    fn refused(args: &[&str], kind: ErrorKind, words: &[&str]) {
        let err = parse_gen(args).unwrap_err();
        assert_eq!(err.kind(), kind, "{args:?}: {err}");
        let text = err.to_string();
        for w in words {
            assert!(text.contains(w), "{args:?}: {text:?} lacks {w:?}");
        }
    }

    #[test]
    fn gen_flags_parse_into_the_options() {
        let Command::Gen {
            model,
            scale,
            shards,
            size,
            ..
        } = parse_gen(&["--model", "70b", "--scale", "0.01"]).unwrap()
        else {
            panic!("not gen");
        };
        assert_eq!(
            (model, scale, shards),
            (ferry_gen::Preset::Llama70b, Some(0.01), None)
        );
        assert_eq!(
            size,
            ferry_gen::DEFAULT_TOTAL_BYTES,
            "the default --size is no conflict"
        );
        let Command::Gen {
            model,
            scale,
            shards,
            size,
            ..
        } = parse_gen(&[
            "--shards",
            "100000",
            "--target-bytes",
            "100MB",
            "--format",
            "generic",
        ])
        .unwrap()
        else {
            panic!("not gen");
        };
        assert_eq!((model, scale), (ferry_gen::Preset::Multimodal, None));
        assert_eq!((shards, size), (Some(100_000), 100_000_000));
    }

    // The size parser behind every size flag (`--size`, `--load-size`, ...)
    // and the config's sizes; it has no tests of its own in the replicator.
    #[test]
    fn demo_keep_running_flags() {
        let demo = |args: &[&str]| {
            let argv = ["ferry", "demo"].into_iter().chain(args.iter().copied());
            Cli::try_parse_from(argv).map(|cli| cli.command)
        };
        let Command::Demo(a) = demo(&["--keep-running", "--checkpoint-every", "2m"]).unwrap()
        else {
            panic!("not demo");
        };
        assert!(a.keep_running);
        assert_eq!(a.checkpoint_every, Duration::from_secs(120));
        assert_eq!(a.load_size, 200_000_000);
        let e = demo(&["--checkpoint-every", "2m"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::MissingRequiredArgument, "{e}");
        let e = demo(&["--keep-running", "--json"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ArgumentConflict, "{e}");
        let e = demo(&["--keep-running", "--priority"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ArgumentConflict, "{e}");
    }

    #[test]
    fn status_slow_takes_a_count_from_1_and_not_json() {
        let slow = |args: &[&str]| {
            let mut v = vec!["ferry", "status"];
            v.extend_from_slice(args);
            Cli::try_parse_from(v).map(|c| match c.command {
                Command::Status { slow, .. } => slow,
                _ => panic!("not status"),
            })
        };
        assert_eq!(slow(&["--slow"]).unwrap(), Some(10));
        assert_eq!(slow(&["--slow", "3"]).unwrap(), Some(3));
        assert_eq!(slow(&[]).unwrap(), None);
        for bad in [
            &["--slow", "0"][..],
            &["--slow", "abc"],
            &["--slow", "--json"],
        ] {
            assert!(slow(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            slow(&["--slow", "--json"]).unwrap_err().kind(),
            ErrorKind::ArgumentConflict
        );
    }

    #[test]
    fn client_flags_and_token_env_stay_secret() {
        let cli = Cli::try_parse_from([
            "ferry",
            "status",
            "--server",
            "https://a:7070",
            "--token",
            "ferry_s3cret",
        ])
        .unwrap();
        let Command::Status { server, .. } = &cli.command else {
            panic!("not status");
        };
        assert_eq!(server.server, "https://a:7070");
        assert!(server.token.is_some());
        assert!(
            !format!("{cli:?}").contains("s3cret"),
            "Debug shows the token"
        );
        let Command::Signal { step, .. } = Cli::try_parse_from([
            "ferry",
            "signal",
            "--job",
            "j",
            "--kind",
            "nan",
            "--severity",
            "1",
            "--step",
            "7",
        ])
        .unwrap()
        .command
        else {
            panic!("not signal");
        };
        assert_eq!(step, Some(7));
        let e = Cli::try_parse_from(["ferry", "token", "new", "--role", "admin"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidValue, "{e}");
    }

    /// Regression: `--severity NaN` (or inf) went out as JSON `null` and
    /// the agent answered with a confusing type error.
    #[test]
    fn signal_severity_must_be_a_finite_number_from_0_to_1() {
        let parse = |v: &str| {
            Cli::try_parse_from([
                "ferry",
                "signal",
                "--job",
                "j",
                "--kind",
                "nan",
                &format!("--severity={v}"),
            ])
        };
        for bad in ["NaN", "nan", "inf", "-inf", "infinity", "-0.1", "1.5", "x"] {
            let e = parse(bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::ValueValidation, "{bad}: {e}");
            let text = e.to_string();
            assert!(
                text.contains("--severity") && text.contains("from 0 to 1"),
                "{bad}: {text}"
            );
        }
        for (good, v) in [("0", 0.0), ("1", 1.0), ("0.25", 0.25)] {
            let Command::Signal { severity, .. } = parse(good).unwrap().command else {
                panic!("not signal");
            };
            assert_eq!(severity, v);
        }
    }

    /// Regression: the banner showed the role as `(Source)` (Debug).
    #[test]
    fn serve_banner_names_the_role_as_configured() {
        assert_eq!(role_name(config::Role::Source), "source");
        assert_eq!(role_name(config::Role::Sink), "sink");
        assert_eq!(role_name(config::Role::Both), "source and sink");
    }

    fn parse_link_emu(args: &[&str]) -> Result<LinkEmuArgs, clap::Error> {
        let argv = [
            "ferry",
            "link-emu",
            "--listen",
            "127.0.0.1:7444",
            "--forward",
            "127.0.0.1:7443",
        ]
        .into_iter()
        .chain(args.iter().copied());
        match Cli::try_parse_from(argv)?.command {
            Command::LinkEmu(a) => Ok(a),
            other => panic!("not link-emu: {other:?}"),
        }
    }

    #[test]
    fn link_emu_flags_and_defaults() {
        let a = parse_link_emu(&[]).unwrap();
        assert_eq!((a.loss, a.corrupt, a.duplicate), (0.0, 0.0, 0.0));
        assert_eq!((a.jitter, a.reorder, a.seed), (Duration::ZERO, false, 0));
        assert_eq!(
            (a.rate, a.rtt, a.queue),
            (1_000_000_000, Duration::from_millis(100), None)
        );
        let a = parse_link_emu(&[
            "--duplicate",
            "0.05",
            "--jitter",
            "5ms",
            "--reorder",
            "--seed",
            "42",
            "--loss",
            "1",
        ])
        .unwrap();
        assert_eq!((a.duplicate, a.loss), (0.05, 1.0));
        assert_eq!(
            (a.jitter, a.reorder, a.seed),
            (Duration::from_millis(5), true, 42)
        );
    }

    #[test]
    fn link_emu_bad_values_name_their_flag() {
        for (flag, bad, words) in [
            ("--duplicate", "1.5", "from 0 to 1"),
            ("--duplicate", "-0.1", "from 0 to 1"),
            ("--duplicate", "NaN", "from 0 to 1"),
            ("--loss", "-0.1", "from 0 to 1"),
            ("--loss", "inf", "from 0 to 1"),
            ("--corrupt", "2", "from 0 to 1"),
            ("--corrupt", "x", "not a number"),
            ("--jitter", "5", "40ms"),
            ("--jitter", "2days", "1 day"),
            ("--rtt", "1000000years", "1 day"),
            ("--seed", "-1", "--seed"),
        ] {
            let e = parse_link_emu(&[flag, bad]).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::ValueValidation, "{flag} {bad}: {e}");
            let text = e.to_string();
            assert!(
                text.contains(flag) && text.contains(words),
                "{flag} {bad}: {text}"
            );
        }
    }

    #[test]
    fn gen_flag_conflicts_are_refused_with_clear_errors() {
        let conflict = ErrorKind::ArgumentConflict;
        refused(
            &["--scale", "0.1", "--size", "1GB"],
            conflict,
            &["--scale", "--size"],
        );
        refused(
            &["--scale", "0.1", "--target-bytes", "1GB"],
            conflict,
            &["--scale"],
        );
        refused(
            &["--scale", "0.1", "--shards", "500"],
            conflict,
            &["--scale", "--shards"],
        );
        let invalid = ErrorKind::ValueValidation;
        refused(&["--scale", "0"], invalid, &["\"0\"", "0 < S <= 1"]);
        refused(&["--scale", "1.5"], invalid, &["\"1.5\"", "0 < S <= 1"]);
        refused(&["--shards", "100001"], invalid, &["100001", "1..=100000"]);
        refused(&["--shards", "0"], invalid, &["--shards"]);
        refused(&["--model", "8b"], invalid, &["\"8b\"", "7b, 70b, mm"]);
    }
}
