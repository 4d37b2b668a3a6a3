//! `ferry gen --format F`: writes one checkpoint the way a training
//! framework does, over time, so a watcher sees what it would see in
//! production: files created under their final names and appended to,
//! temp files renamed while open, commit markers written in place, and
//! markers that land before every rank is done.
//!
//! The per-format rules (file names, write order, who waits for whom) are
//! in [`layout`], each citing `docs/CHECKPOINT_FORMATS.md` or the traced
//! saves in `tests/fixtures/`. The tensor list is the one [`super::Plan`]
//! scales for [`super::generate`] (by default the multimodal model with
//! more than 60 % of tensors under 16 KiB; [`SaveOptions::model`] picks a
//! [`Preset`], [`SaveOptions::scale`] a scale instead of a size),
//! multiplied by the state each framework saves per parameter
//! (weights, fp32 main copy, AdamW moments; 12-14 bytes per parameter for
//! training formats, 2 for weights-only ones), and the framing is measured
//! so the files add up to about [`SaveOptions::total_bytes`].
//!
//! Each rank is a thread; writes from all ranks share one byte budget paced
//! to [`SaveOptions::write_rate_bps`] with sleeps ([`pace`]). Contents are
//! incompressible pseudo-random bytes seeded per file from the seed and
//! the file's path, so a seed always yields the same bytes.
//!
//! [`save_into`] runs the same plan into a store that takes whole files
//! one after the other (an HDFS directory or S3 prefix behind
//! [`crate::output::Output`]): same names and bytes, markers last (its
//! docs say what becomes of renames and in-place rewrites there).

mod framing;
mod layout;
mod pace;
mod seq;

use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::SystemTime;

use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};

use self::framing::{Crc32, Sink};
use self::layout::{Cut, Event, FileJob, How, Layout, Step, Until};
use self::pace::Throttle;
pub use self::seq::save_into;
use super::{file_seed, Preset, DEFAULT_SMALL_FRACTION_TARGET, SMALL_SHARD_BYTES};

/// A checkpoint format [`save`] can write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GenFormat {
    /// PyTorch DCP (`torch.distributed.checkpoint.save`): `step_%08d/`
    /// with `__{rank}_0.distcp` and `.metadata`. Name `dcp`.
    Dcp,
    /// Megatron-Core torch_dist: `iter_%07d/` with `.distcp` files,
    /// `.metadata`, `metadata.json`, and the tracker. Name `megatron_dist`.
    MegatronDist,
    /// Megatron-LM legacy: `iter_%07d/mp_rank_TT/model_optim_rng.pt` and
    /// `distrib_optim.pt`, and the tracker. Name `megatron`.
    MegatronLegacy,
    /// DeepSpeed ZeRO-2: `global_stepN/` and the root file `latest`.
    /// Name `deepspeed`.
    DeepSpeed,
    /// transformers `save_pretrained` (sharded safetensors): `step-N/`.
    /// Name `hf`.
    Hf,
    /// HF Trainer: `checkpoint-N/` with the model, optimizer, scheduler,
    /// RNG states and `trainer_state.json`. Name `hf_trainer`.
    HfTrainer,
    /// One file per tensor and a marker file: `step_%08d/`. Name `generic`.
    Generic,
    /// torchtitan: a DCP save into `step-N/`. Name `torchtitan`.
    Torchtitan,
    /// NeMo 2 `ModelCheckpoint`: `model--step=N-consumed_samples=M/` with
    /// `weights/` (torch_dist) and `context/`, bracketed by the sibling
    /// marker file `<name>-unfinished`. Name `nemo`.
    Nemo,
    /// Orbax on POSIX: `<N>.orbax-checkpoint-tmp-<ts>/` (OCDBT) renamed
    /// to `<N>/`. Name `orbax`.
    Orbax,
    /// ByteCheckpoint: `global_step_N/` with DCP-style `model/` and
    /// `optimizer/` and `extra_state/`. Name `bytecheckpoint`.
    ByteCheckpoint,
}

impl GenFormat {
    /// Every format, in the order of the names in [`GenFormat::NAMES`].
    pub const ALL: [Self; 11] = [
        Self::Dcp,
        Self::MegatronDist,
        Self::MegatronLegacy,
        Self::DeepSpeed,
        Self::Hf,
        Self::HfTrainer,
        Self::Generic,
        Self::Torchtitan,
        Self::Nemo,
        Self::Orbax,
        Self::ByteCheckpoint,
    ];

    /// The names [`FromStr`] accepts.
    pub const NAMES: [&'static str; 11] = [
        "dcp",
        "megatron_dist",
        "megatron",
        "deepspeed",
        "hf",
        "hf_trainer",
        "generic",
        "torchtitan",
        "nemo",
        "orbax",
        "bytecheckpoint",
    ];

    /// The format's name, e.g. `"megatron_dist"`.
    pub fn name(self) -> &'static str {
        let index = Self::ALL.iter().position(|&f| f == self).unwrap_or(0);
        Self::NAMES[index]
    }
}

impl fmt::Display for GenFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for GenFormat {
    type Err = String;

    /// Parses a name of [`GenFormat::NAMES`].
    ///
    /// # Errors
    /// A message naming the value and listing the names.
    fn from_str(s: &str) -> Result<Self, String> {
        Self::NAMES
            .iter()
            .position(|&n| n == s)
            .map(|i| Self::ALL[i])
            .ok_or_else(|| {
                format!(
                    "unknown checkpoint format {s:?}; expected one of: {}",
                    Self::NAMES.join(", ")
                )
            })
    }
}

/// A failure [`save`] simulates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fault {
    /// A normal save. Name `none`.
    #[default]
    None,
    /// The writers stop for good once about half the bytes are written:
    /// partial files (and temp files) stay, no marker is written, and
    /// [`save`] returns `Ok` with `committed_at: None`. Name `kill`.
    KillMidSave,
    /// One data file is cut to half its length after it was closed, and
    /// the marker is written anyway. Name `truncated`.
    Truncated,
    /// One data file is left 0 bytes long, and the marker is written
    /// anyway. Name `zero-byte`.
    ZeroByte,
    /// Before any data, the commit marker of the previous step (`step - 1`)
    /// is written (DCP `.metadata` in the directory; Megatron tracker;
    /// DeepSpeed `latest`; HF index or `trainer_state.json`; the generic
    /// marker); the save then overwrites it when it commits. Name
    /// `stale-marker`.
    StaleMarker,
    /// Two complete saves into the same directory, the second with seed
    /// `seed + 1`, each committing. Name `reused-dir`.
    ReusedDir,
}

impl Fault {
    /// Every fault, in the order of [`Fault::NAMES`].
    pub const ALL: [Self; 6] = [
        Self::None,
        Self::KillMidSave,
        Self::Truncated,
        Self::ZeroByte,
        Self::StaleMarker,
        Self::ReusedDir,
    ];

    /// The names [`FromStr`] accepts.
    pub const NAMES: [&'static str; 6] = [
        "none",
        "kill",
        "truncated",
        "zero-byte",
        "stale-marker",
        "reused-dir",
    ];

    /// The fault's name, e.g. `"zero-byte"`.
    pub fn name(self) -> &'static str {
        let index = Self::ALL.iter().position(|&f| f == self).unwrap_or(0);
        Self::NAMES[index]
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Fault {
    type Err = String;

    /// Parses a name of [`Fault::NAMES`].
    ///
    /// # Errors
    /// A message naming the value and listing the names.
    fn from_str(s: &str) -> Result<Self, String> {
        Self::NAMES
            .iter()
            .position(|&n| n == s)
            .map(|i| Self::ALL[i])
            .ok_or_else(|| {
                format!(
                    "unknown fault {s:?}; expected one of: {}",
                    Self::NAMES.join(", ")
                )
            })
    }
}

/// Stops a running [`save`] from another thread: once [`StopFlag::stop`]
/// is called, every rank's next write fails and `save` returns the error
/// "save stopped" (what was written so far stays on disk, no marker).
#[derive(Debug, Clone, Default)]
pub struct StopFlag(Arc<AtomicBool>);

impl StopFlag {
    /// Asks the save to stop.
    pub fn stop(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// Whether [`StopFlag::stop`] was called.
    pub fn is_stopped(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

impl PartialEq for StopFlag {
    /// The same flag (clones of one another).
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// Options of [`save`].
#[derive(Debug, Clone, PartialEq)]
pub struct SaveOptions {
    /// The source root; the checkpoint directory is created inside it
    /// (see [`SaveOptions::checkpoint_dir`]), and root-level markers
    /// (DeepSpeed `latest`, Megatron's tracker) are written here.
    pub root: PathBuf,
    /// The framework whose save to imitate.
    pub format: GenFormat,
    /// Training step (iteration) of the checkpoint.
    pub step: u64,
    /// Parallel writers (threads): DCP/FSDP ranks, tensor-parallel ranks
    /// for Megatron, data-parallel ranks for DeepSpeed, processes for the
    /// HF Trainer. `hf` writes from one process whatever this is. At least
    /// 1; default 4.
    pub ranks: u32,
    /// Approximate total size of the checkpoint in bytes (all files the
    /// save writes, framing included); met within about 1 %.
    pub total_bytes: u64,
    /// Minimum fraction (0.0-1.0, by count) of model tensors under 16 KiB
    /// (see [`super::GenOptions::small_fraction_target`]).
    pub small_fraction_target: f64,
    /// Aggregate write rate of all ranks in bit/s, paced with sleeps;
    /// `None` writes as fast as the disk takes it.
    pub write_rate_bps: Option<u64>,
    /// Seed of the contents; the same options give the same bytes.
    pub seed: u64,
    /// File name of the generic format's marker (default `COMMITTED`).
    pub marker: String,
    /// The failure to simulate.
    pub fault: Fault,
    /// The model whose parameters are saved (default
    /// [`Preset::Multimodal`], sized by `total_bytes` as before presets
    /// existed).
    pub model: Preset,
    /// Scale factor `S` (`0 < S <= 1`) on every tensor's full-scale
    /// element count (at least one element each); the checkpoint's size
    /// then follows from `S`, the format's bytes per parameter and its
    /// framing ([`preview`] tells it), and `total_bytes` is ignored. `None`
    /// (the default) sizes by `total_bytes`.
    pub scale: Option<f64>,
    /// Exactly this many tensor files (see
    /// [`super::GenOptions::shards`]); only for [`GenFormat::Generic`], the
    /// per-tensor layout. `None` by default.
    pub shards: Option<u64>,
    /// Stops the save early when set (see [`StopFlag`]); never by default.
    pub stop: StopFlag,
}

impl SaveOptions {
    /// Options for a `total_bytes` save of `format` into `root`: step
    /// 1000, 4 ranks, unpaced, seed 0, marker `COMMITTED`, no fault, the
    /// size-driven `mm` model, no scale, no shard count.
    pub fn new(root: impl Into<PathBuf>, format: GenFormat, total_bytes: u64) -> Self {
        Self {
            root: root.into(),
            format,
            step: 1000,
            ranks: 4,
            total_bytes,
            small_fraction_target: DEFAULT_SMALL_FRACTION_TARGET,
            write_rate_bps: None,
            seed: 0,
            marker: "COMMITTED".to_string(),
            fault: Fault::None,
            model: Preset::Multimodal,
            scale: None,
            shards: None,
            stop: StopFlag::default(),
        }
    }

    /// The checkpoint directory [`save`] creates: `root/step_00001000`
    /// (dcp, generic), `root/iter_0001000` (Megatron), `root/global_step1000`
    /// (DeepSpeed), `root/step-1000` (hf, torchtitan), `root/checkpoint-1000`
    /// (hf_trainer), `root/model--step=1000-consumed_samples=8000.0` (nemo),
    /// `root/1000` (orbax, once renamed), `root/global_step_1000`
    /// (bytecheckpoint).
    pub fn checkpoint_dir(&self) -> PathBuf {
        self.root.join(layout::dir_name(self.format, self.step))
    }
}

/// What [`save`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct SaveSummary {
    /// The checkpoint directory (for an Orbax save killed before its
    /// rename, the temporary directory it was written in).
    pub dir: PathBuf,
    /// Regular files in `dir` (recursively) plus the root-level marker,
    /// as on disk at the end (a killed save's temp files included).
    pub files: u64,
    /// Total size of those files in bytes.
    pub bytes: u64,
    /// Tensors written in full (DCP records, ZIP storages, safetensors
    /// tensors, generic files).
    pub tensors: u64,
    /// Of those, tensors under 16 KiB.
    pub small_tensors: u64,
    /// When the checkpoint directory was created.
    pub opened_at: SystemTime,
    /// When the commit marker was written; `None` for a killed save.
    pub committed_at: Option<SystemTime>,
    /// The commit marker (written or, for a killed save, not).
    pub marker: PathBuf,
    /// The file the truncated or zero-byte fault damaged.
    pub damaged: Option<PathBuf>,
}

/// Writes one checkpoint as [`SaveOptions::format`] does, blocking until
/// every rank is done; for [`Fault::ReusedDir`], two. `progress` is called
/// from the calling thread with the bytes written so far (all files, all
/// ranks; both saves for `reused-dir`).
///
/// # Errors
/// [`io::ErrorKind::InvalidInput`] for impossible options (zero ranks, a
/// zero rate, a bad marker name, a size too small for the format's
/// framing, a stale-marker fault at step 0, an unreachable small
/// fraction, a shard count with a format other than generic, a scale or
/// size the model refuses as [`super::preview`] does); otherwise the first
/// I/O error of any rank.
pub fn save(opts: &SaveOptions, progress: &dyn Fn(u64)) -> io::Result<SaveSummary> {
    save_traced(opts, progress).map(|(summary, _)| summary)
}

/// What [`save`] would write for some options (one pass), without
/// writing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SavePreview {
    /// Total size of the files, in bytes (framing included).
    pub bytes: u64,
    /// Tensors of the model, before any sharding across ranks.
    pub tensors: u64,
    /// The factor applied to the preset's full-scale element counts;
    /// `None` for the size-driven `mm` plan (see [`super::Preview`]).
    pub scale: Option<f64>,
}

/// Plans `opts` as [`save`] would, without touching the disk.
///
/// # Errors
/// As [`save`] for impossible options.
pub fn preview(opts: &SaveOptions) -> io::Result<SavePreview> {
    let layout = layout::build(opts, opts.seed)?;
    Ok(SavePreview {
        bytes: layout.expected_bytes,
        tensors: layout.tensors,
        scale: layout.scale,
    })
}

/// A file-system operation of a save, in the order they happened (the
/// shape of the traces in `tests/fixtures/`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(not(test), allow(dead_code))]
struct Op {
    /// Rank that did it (the prelude counts as rank 0).
    rank: u32,
    /// What happened.
    kind: OpKind,
    /// Path relative to the root.
    path: PathBuf,
}

/// Kinds of [`Op`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(not(test), allow(dead_code))]
enum OpKind {
    Close,
    Create,
    Fsync,
    Mkdir,
    Remove,
    Rename(PathBuf),
    Truncate(u64),
}

/// [`save`], also returning every file-system operation in order.
fn save_traced(opts: &SaveOptions, progress: &dyn Fn(u64)) -> io::Result<(SaveSummary, Vec<Op>)> {
    if opts.write_rate_bps == Some(0) {
        return Err(super::invalid("write_rate_bps must be above 0"));
    }
    let first = save_once(opts, opts.seed, progress, 0)?;
    if opts.fault != Fault::ReusedDir {
        return Ok((first.summary, first.trace));
    }
    let second = save_once(opts, opts.seed.wrapping_add(1), progress, first.written)?;
    let mut trace = first.trace;
    trace.extend(second.trace);
    Ok((second.summary, trace))
}

/// The outcome of one pass of a save.
struct Pass {
    summary: SaveSummary,
    trace: Vec<Op>,
    written: u64,
}

/// State shared by the ranks of one save.
struct Shared {
    root: PathBuf,
    seed: u64,
    throttle: Throttle,
    board: Board,
    tensors: AtomicU64,
    small_tensors: AtomicU64,
    committed_at: Mutex<Option<SystemTime>>,
    trace: Mutex<Vec<Op>>,
}

impl Shared {
    fn record(&self, rank: u32, kind: OpKind, path: &Path) {
        let op = Op {
            rank,
            kind,
            path: path.to_path_buf(),
        };
        lock(&self.trace).push(op);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Writes one checkpoint with `seed`; `written_before` offsets progress.
fn save_once(
    opts: &SaveOptions,
    seed: u64,
    progress: &dyn Fn(u64),
    written_before: u64,
) -> io::Result<Pass> {
    let layout = layout::build(opts, seed)?;
    let kill_at = (opts.fault == Fault::KillMidSave).then_some(layout.expected_bytes / 2);
    let shared = Shared {
        root: opts.root.clone(),
        seed,
        throttle: Throttle::new(opts.write_rate_bps, kill_at, opts.stop.clone()),
        board: Board::default(),
        tensors: AtomicU64::new(0),
        small_tensors: AtomicU64::new(0),
        committed_at: Mutex::new(None),
        trace: Mutex::new(Vec::new()),
    };
    let opened_at = SystemTime::now();
    let (tx, rx) = mpsc::channel::<u64>();
    let mut written = written_before;
    // The training job's checkpoint root exists before a save starts (NeMo
    // writes its `-unfinished` marker there before the directory).
    fs::create_dir_all(&opts.root)?;
    run_steps(&shared, 0, &layout.prelude, &tx)?;
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = layout
            .ranks
            .iter()
            .enumerate()
            .map(|(rank, steps)| {
                let tx = tx.clone();
                let shared = &shared;
                s.spawn(move || run_rank(shared, rank as u32, steps, &tx))
            })
            .collect();
        drop(tx);
        while let Ok(n) = rx.recv() {
            written += n;
            while let Ok(more) = rx.try_recv() {
                written += more;
            }
            progress(written);
        }
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(io::Error::other("a rank thread panicked")))
            })
            .collect::<Vec<_>>()
    });
    let killed = shared.throttle.killed();
    let mut first_error = None;
    for e in results.into_iter().filter_map(Result::err) {
        let secondary = pace::is_killed(&e) || is_peer_failed(&e);
        if !secondary {
            return Err(e);
        }
        first_error.get_or_insert(e);
    }
    if let (Some(e), false) = (first_error, killed) {
        return Err(e);
    }
    let summary = summarize(opts, &layout, &shared, opened_at, killed)?;
    let trace = std::mem::take(&mut *lock(&shared.trace));
    Ok(Pass {
        summary,
        trace,
        written,
    })
}

/// Counts what is on disk.
fn summarize(
    opts: &SaveOptions,
    layout: &Layout,
    shared: &Shared,
    opened_at: SystemTime,
    killed: bool,
) -> io::Result<SaveSummary> {
    let mut dir = opts.root.join(&layout.dir);
    if let (Some(staging), false) = (&layout.staging, dir.exists()) {
        dir = opts.root.join(staging);
    }
    let (mut files, mut bytes) = (0, 0);
    let mut stack = vec![dir.clone()];
    while let Some(d) = stack.pop() {
        for entry in fs::read_dir(&d)? {
            let entry = entry?;
            let meta = entry.metadata()?;
            if meta.is_dir() {
                stack.push(entry.path());
            } else {
                files += 1;
                bytes += meta.len();
            }
        }
    }
    for f in &layout.root_files {
        if let Ok(meta) = fs::metadata(opts.root.join(f)) {
            files += 1;
            bytes += meta.len();
        }
    }
    let committed_at = if killed {
        None
    } else {
        *lock(&shared.committed_at)
    };
    Ok(SaveSummary {
        dir,
        files,
        bytes,
        tensors: shared.tensors.load(Ordering::Relaxed),
        small_tensors: shared.small_tensors.load(Ordering::Relaxed),
        opened_at,
        committed_at,
        marker: opts.root.join(&layout.marker),
        damaged: layout.damaged.as_ref().map(|p| opts.root.join(p)),
    })
}

/// Runs one rank's steps; on an error, wakes the ranks waiting for it.
fn run_rank(shared: &Shared, rank: u32, steps: &[Step], tx: &Sender<u64>) -> io::Result<()> {
    let result = run_steps(shared, rank, steps, tx);
    if result.is_err() {
        shared.board.fail();
    }
    result
}

fn run_steps(shared: &Shared, rank: u32, steps: &[Step], tx: &Sender<u64>) -> io::Result<()> {
    for step in steps {
        match step {
            Step::Mkdir(path) => {
                fs::create_dir_all(shared.root.join(path))?;
                shared.record(rank, OpKind::Mkdir, path);
            }
            Step::Write(job) => write_file(shared, rank, job, tx)?,
            Step::Remove(path) => {
                fs::remove_file(shared.root.join(path))?;
                shared.record(rank, OpKind::Remove, path);
            }
            Step::RenameDir { from, to } => {
                fs::rename(shared.root.join(from), shared.root.join(to))?;
                shared.record(rank, OpKind::Rename(to.clone()), from);
            }
            Step::Damage { path, cut } => {
                let file = OpenOptions::new()
                    .write(true)
                    .open(shared.root.join(path))?;
                let len = match cut {
                    Cut::Half => file.metadata()?.len() / 2,
                    Cut::Zero => 0,
                };
                file.set_len(len)?;
                shared.record(rank, OpKind::Truncate(len), path);
            }
            Step::Post(event) => shared.board.post(*event),
            Step::Wait(until) => shared.board.wait(*until)?,
            Step::Commit => *lock(&shared.committed_at) = Some(SystemTime::now()),
        }
    }
    Ok(())
}

/// Writes one file as its [`How`] says.
fn write_file(shared: &Shared, rank: u32, job: &FileJob, tx: &Sender<u64>) -> io::Result<()> {
    let path = shared.root.join(&job.path);
    let (file, open_name) = match &job.how {
        How::InPlace => (File::create(&path)?, &job.path),
        How::Presized { tmp } => {
            let file = OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(shared.root.join(tmp))?;
            (file, tmp)
        }
        How::RenameAfterClose { tmp } => (File::create(shared.root.join(tmp))?, tmp),
    };
    shared.record(rank, OpKind::Create, open_name);
    if let How::Presized { tmp } = &job.how {
        file.set_len(job.size)?;
        shared.record(rank, OpKind::Truncate(job.size), tmp);
    }
    let mut out = Out {
        file,
        shared,
        tx,
        rng: SmallRng::seed_from_u64(file_seed(shared.seed, path_hash(&job.path))),
        pos: 0,
        buf: Vec::new(),
    };
    layout::write_content(&mut out, &job.content, job.hold)?;
    if job.fsync {
        out.file.sync_all()?;
        shared.record(rank, OpKind::Fsync, open_name);
    }
    match &job.how {
        How::InPlace => {
            drop(out);
            shared.record(rank, OpKind::Close, &job.path);
        }
        How::Presized { tmp } => {
            // safetensors 0.8 renames the temp file while it is still open.
            fs::rename(shared.root.join(tmp), &path)?;
            shared.record(rank, OpKind::Rename(job.path.clone()), tmp);
            drop(out);
            shared.record(rank, OpKind::Close, &job.path);
        }
        How::RenameAfterClose { tmp } => {
            drop(out);
            shared.record(rank, OpKind::Close, tmp);
            fs::rename(shared.root.join(tmp), &path)?;
            shared.record(rank, OpKind::Rename(job.path.clone()), tmp);
        }
    }
    Ok(())
}

/// FNV-1a of a relative path: the per-file part of the content seed.
fn path_hash(path: &Path) -> u64 {
    path.to_string_lossy()
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
}

/// A file being written by one rank: every write is admitted by the
/// shared throttle (paced, and refused once a kill fault fires),
/// written, and reported as progress.
struct Out<'a> {
    file: File,
    shared: &'a Shared,
    tx: &'a Sender<u64>,
    rng: SmallRng,
    pos: u64,
    buf: Vec<u8>,
}

impl Out<'_> {
    fn written(&mut self, n: usize) {
        self.pos += n as u64;
        // The receiver only goes away once every rank has finished.
        let _ = self.tx.send(n as u64);
    }
}

impl Sink for Out<'_> {
    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        let mut rest = bytes;
        while !rest.is_empty() {
            let n = self.shared.throttle.admit(rest.len() as u64)? as usize;
            self.file.write_all(&rest[..n])?;
            self.written(n);
            rest = &rest[n..];
        }
        Ok(())
    }

    fn put_random(&mut self, n: u64, mut crc: Option<&mut Crc32>) -> io::Result<()> {
        let mut left = n;
        while left > 0 {
            let k = self.shared.throttle.admit(left)? as usize;
            if self.buf.len() < k {
                self.buf.resize(k, 0);
            }
            let chunk = &mut self.buf[..k];
            self.rng.fill_bytes(chunk);
            if let Some(c) = crc.as_mut() {
                c.update(chunk);
            }
            self.file.write_all(chunk)?;
            self.written(k);
            left -= k as u64;
        }
        Ok(())
    }

    fn pos(&self) -> u64 {
        self.pos
    }

    fn tensor_done(&mut self, bytes: u64) {
        self.shared.tensors.fetch_add(1, Ordering::Relaxed);
        if bytes < SMALL_SHARD_BYTES {
            self.shared.small_tensors.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn hold(&mut self) -> io::Result<()> {
        self.shared.board.post(Event::Pending);
        self.shared.board.wait(Until::MarkerWritten)
    }
}

/// Where ranks tell each other what they did, and wait for it.
#[derive(Debug, Default)]
struct Board {
    events: Mutex<Events>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct Events {
    data_closed: u32,
    pending: u32,
    marker_written: bool,
    failed: bool,
}

/// Marks the error of a rank woken because another rank failed.
#[derive(Debug)]
struct PeerFailed;

impl fmt::Display for PeerFailed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("another rank failed")
    }
}

impl std::error::Error for PeerFailed {}

fn is_peer_failed(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<PeerFailed>())
}

impl Board {
    fn post(&self, event: Event) {
        let mut e = lock(&self.events);
        match event {
            Event::DataClosed => e.data_closed += 1,
            Event::Pending => e.pending += 1,
            Event::MarkerWritten => e.marker_written = true,
        }
        self.changed.notify_all();
    }

    fn fail(&self) {
        lock(&self.events).failed = true;
        self.changed.notify_all();
    }

    /// Blocks until `until` holds.
    ///
    /// # Errors
    /// [`PeerFailed`] once any rank failed.
    fn wait(&self, until: Until) -> io::Result<()> {
        let mut e = lock(&self.events);
        loop {
            if e.failed {
                return Err(io::Error::other(PeerFailed));
            }
            let done = match until {
                Until::DataClosed(n) => e.data_closed >= n,
                Until::Pending(n) => e.pending >= n,
                Until::MarkerWritten => e.marker_written,
            };
            if done {
                return Ok(());
            }
            e = self.changed.wait(e).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;
