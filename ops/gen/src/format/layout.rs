//! Per-format save plans: which files each rank writes, in which order,
//! and where a rank waits for another. Pure: building a [`Layout`] does no
//! I/O; the executor in [`super`] runs it.
//!
//! Every rule below is the framework's own, as recorded in
//! `docs/CHECKPOINT_FORMATS.md` and the traced saves in `tests/fixtures/`
//! (`dcp/FIXTURE.md`, `safetensors/FIXTURE.md`).

use std::io;
use std::path::{Path, PathBuf};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::framing::{
    pickle, safetensors_header, torch_archive, write_distcp, write_safetensors, write_zip, Counter,
    Entry, Item, Py, Sink, StTensor,
};
use super::{Fault, GenFormat, SaveOptions};
use crate::{file_seed, invalid, validate_marker, Plan, Sizing};

/// One action of a rank.
#[derive(Debug)]
pub(super) enum Step {
    /// Create a directory (and its parents).
    Mkdir(PathBuf),
    /// Write one file.
    Write(FileJob),
    /// Delete a file (NeMo's `-unfinished` marker, removed last).
    Remove(PathBuf),
    /// Rename a directory (Orbax's commit: the temporary directory
    /// becomes `<step>/`).
    RenameDir {
        /// Current name, relative to the root.
        from: PathBuf,
        /// New name, relative to the root.
        to: PathBuf,
    },
    /// Cut a closed file short (the truncated and zero-byte faults).
    Damage {
        /// File, relative to the root.
        path: PathBuf,
        /// How much is left.
        cut: Cut,
    },
    /// Tell the other ranks something happened.
    Post(Event),
    /// Block until the other ranks have posted enough.
    Wait(Until),
    /// The commit marker is written: record the commit time.
    Commit,
}

/// One file write.
#[derive(Debug)]
pub(super) struct FileJob {
    /// Final name, relative to the root.
    pub(super) path: PathBuf,
    /// What goes into it.
    pub(super) content: Content,
    /// How it reaches its final name.
    pub(super) how: How,
    /// fsync before close (DCP's `sync_files=True`).
    pub(super) fsync: bool,
    /// Hold the tail (ZIP central directory) until the marker is written:
    /// the rank that finishes after the commit marker.
    pub(super) hold: bool,
    /// Final size in bytes.
    pub(super) size: u64,
}

/// How a file reaches its final name.
#[derive(Debug, PartialEq)]
pub(super) enum How {
    /// Created (O_TRUNC) under its final name and written there.
    InPlace,
    /// safetensors 0.8: a hidden temp file (O_EXCL) pre-sized to the final
    /// size, written, renamed into place while open, then closed.
    Presized {
        /// Temp name, relative to the root.
        tmp: PathBuf,
    },
    /// DCP `.metadata`: written to a temp name, fsynced, closed, renamed.
    RenameAfterClose {
        /// Temp name, relative to the root.
        tmp: PathBuf,
    },
}

/// Contents of a file.
#[derive(Debug)]
pub(super) enum Content {
    /// Known bytes (JSON, trackers, scripts, pickles).
    Text(Vec<u8>),
    /// One raw tensor of this many pseudo-random bytes.
    Tensor(u64),
    /// Raw tensors of these sizes, back to back (an OCDBT data file).
    Tensors(Vec<u64>),
    /// A `torch.save` archive.
    Zip(Vec<Entry>),
    /// A DCP `.distcp`: `torch.save` records appended one per item.
    DistCp(Vec<Item>),
    /// A safetensors file.
    Safetensors {
        /// Length prefix and JSON header.
        header: Vec<u8>,
        /// Tensors in data order.
        tensors: Vec<StTensor>,
    },
}

/// What remains of a damaged file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Cut {
    /// The first half.
    Half,
    /// Nothing.
    Zero,
}

/// Something a rank tells the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Event {
    /// This rank's data files are closed.
    DataClosed,
    /// This rank holds a file open, waiting for the marker.
    Pending,
    /// The commit marker is written.
    MarkerWritten,
}

/// What a rank waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Until {
    /// This many ranks posted [`Event::DataClosed`].
    DataClosed(u32),
    /// This many ranks posted [`Event::Pending`].
    Pending(u32),
    /// Some rank posted [`Event::MarkerWritten`].
    MarkerWritten,
}

/// The plan of one save.
#[derive(Debug)]
pub(super) struct Layout {
    /// Checkpoint directory, relative to the root.
    pub(super) dir: PathBuf,
    /// The directory the files are written in when it is not `dir`
    /// (Orbax's temporary directory, renamed to `dir` at the commit).
    pub(super) staging: Option<PathBuf>,
    /// Run before the ranks start: the directory, any stale marker.
    pub(super) prelude: Vec<Step>,
    /// Steps of each rank, run in parallel threads.
    pub(super) ranks: Vec<Vec<Step>>,
    /// Bytes of all files the ranks write (final sizes).
    pub(super) expected_bytes: u64,
    /// The commit marker, relative to the root.
    pub(super) marker: PathBuf,
    /// Files outside `dir` that the save writes (trackers), relative.
    pub(super) root_files: Vec<PathBuf>,
    /// The file the truncated or zero-byte fault damages, relative.
    pub(super) damaged: Option<PathBuf>,
    /// Tensors of the model plan.
    pub(super) tensors: u64,
    /// The plan's factor on the preset's full-scale element counts.
    pub(super) scale: Option<f64>,
}

/// The checkpoint directory's name for `format` at `step`: the
/// framework's own naming (DCP as in the fixture and torchtitan's
/// `step-N` for HF exports; Megatron `iter_%07d`; DeepSpeed
/// `global_stepN`; HF Trainer `checkpoint-N`; NeMo 2's default
/// `{model_name}--{step}-{consumed_samples}` filename with a global batch
/// of [`NEMO_GLOBAL_BATCH`]; Orbax's bare step; ByteCheckpoint
/// `global_step_N`). For Orbax this is the name after the commit rename.
pub(super) fn dir_name(format: GenFormat, step: u64) -> String {
    match format {
        GenFormat::Dcp | GenFormat::Generic => format!("step_{step:08}"),
        GenFormat::MegatronDist | GenFormat::MegatronLegacy => format!("iter_{step:07}"),
        GenFormat::DeepSpeed => format!("global_step{step}"),
        GenFormat::Hf | GenFormat::Torchtitan => format!("step-{step}"),
        GenFormat::HfTrainer => format!("checkpoint-{step}"),
        GenFormat::Nemo => format!(
            "model--step={step}-consumed_samples={}.0",
            step.saturating_mul(NEMO_GLOBAL_BATCH)
        ),
        GenFormat::Orbax => step.to_string(),
        GenFormat::ByteCheckpoint => format!("global_step_{step}"),
    }
}

/// Global batch size behind the `consumed_samples` of NeMo directory names.
pub(super) const NEMO_GLOBAL_BATCH: u64 = 8;

/// Base of the seconds in Orbax temporary directory names
/// (`<N>.orbax-checkpoint-tmp-<ts>`), 2023-11-14; the seed adds to it.
const ORBAX_TS_BASE: u64 = 1_700_000_000;

/// NeMo's `ModelCheckpoint.UNFINISHED_CHECKPOINT_SUFFIX`.
pub(super) const NEMO_UNFINISHED: &str = "-unfinished";

/// Megatron's tracker file, beside the `iter_*` directories.
pub(super) const MEGATRON_TRACKER: &str = "latest_checkpointed_iteration.txt";

/// Bytes per parameter of each format's state, summed over what is saved
/// (`docs/CHECKPOINT_FORMATS.md`: AdamW checkpoints hold 12-14 bytes per
/// parameter, bf16 weights 2).
fn bytes_per_param(format: GenFormat) -> u64 {
    match format {
        // fp32 weights, exp_avg, exp_avg_sq (FSDP2 state dict).
        // Orbax: fp32 params and optax Adam's mu and nu.
        GenFormat::Dcp
        | GenFormat::HfTrainer
        | GenFormat::Torchtitan
        | GenFormat::Orbax
        | GenFormat::ByteCheckpoint => 12,
        // bf16 weights; fp32 main params, exp_avg, exp_avg_sq.
        GenFormat::MegatronDist
        | GenFormat::MegatronLegacy
        | GenFormat::DeepSpeed
        | GenFormat::Nemo => 14,
        // bf16 weights only.
        GenFormat::Hf | GenFormat::Generic => 2,
    }
}

/// Plans a save of about `opts.total_bytes` bytes with content seed
/// `seed`. Framing (ZIP headers, pickles, JSON, small files) is measured
/// and the tensor budget shrunk to leave room for it, so the files add up
/// to within about 0.5 % of the target (exactly, for generic).
///
/// With [`SaveOptions::scale`] the plan is that scale of the model, and
/// the size is whatever it comes to.
///
/// # Errors
/// [`io::ErrorKind::InvalidInput`] for options no save can satisfy: zero
/// ranks, a bad marker name, a stale-marker fault at step 0, a small
/// fraction the tensor plan cannot reach, a total too small for the
/// format's framing or too large for the model at full scale, a bad
/// scale, a shard count with a format other than generic.
pub(super) fn build(opts: &SaveOptions, seed: u64) -> io::Result<Layout> {
    if opts.ranks == 0 {
        return Err(invalid("ranks must be at least 1"));
    }
    if let (Some(n), false) = (opts.shards, opts.format == GenFormat::Generic) {
        return Err(invalid(format!(
            "{n} shards: an exact shard count applies to the per-tensor layout (no format, \
             or the generic format), not to {}",
            opts.format
        )));
    }
    if opts.format == GenFormat::Generic {
        validate_marker(&opts.marker)?;
    }
    let no_stale = [GenFormat::Nemo, GenFormat::Orbax, GenFormat::ByteCheckpoint];
    if opts.fault == Fault::StaleMarker && no_stale.contains(&opts.format) {
        // NeMo commits by removing a file, Orbax by renaming a directory:
        // there is no marker to leave stale. ByteCheckpoint's is not
        // modelled.
        return Err(invalid(format!(
            "the stale-marker fault is not modelled for the {} format",
            opts.format
        )));
    }
    if opts.fault == Fault::ReusedDir && opts.format == GenFormat::Orbax {
        // Orbax refuses to save a step that exists, and a directory
        // rename onto a non-empty `<step>/` fails.
        return Err(invalid(
            "the reused-dir fault does not apply to orbax: a step is never saved twice",
        ));
    }
    if opts.fault == Fault::StaleMarker && opts.step == 0 {
        return Err(invalid(
            "the stale-marker fault needs a step above 0 (the stale marker is step - 1's)",
        ));
    }
    if opts.scale.is_some() {
        return build_for(opts, seed, opts.total_bytes);
    }
    let target = opts.total_bytes;
    let mut budget = target;
    let mut layout = build_for(opts, seed, budget)?;
    for _ in 0..4 {
        let over = i128::from(layout.expected_bytes) - i128::from(target);
        if over.unsigned_abs() * 200 <= u128::from(target) {
            break;
        }
        let next = i128::from(budget) - over;
        if next <= 0 {
            return Err(invalid(format!(
                "a size (--size) of {target} bytes is too small for the {} format: its \
                 framing alone takes about {} bytes",
                opts.format, layout.expected_bytes
            )));
        }
        budget = next as u64;
        layout = build_for(opts, seed, budget)?;
    }
    Ok(layout)
}

/// One layout whose tensor data (all state kinds) adds up to `budget`
/// (ignored with a scale).
fn build_for(opts: &SaveOptions, seed: u64, budget: u64) -> io::Result<Layout> {
    let per_param = bytes_per_param(opts.format);
    let plan = match opts.scale {
        Some(s) => Plan::build(opts.model, Sizing::Scale(s), opts.shards, 0.0)?,
        None => {
            // The plan is in bf16 weights (2 bytes per parameter).
            let plan_bytes = budget.saturating_mul(2) / per_param;
            Plan::build(
                opts.model,
                Sizing::Bytes(plan_bytes),
                opts.shards,
                opts.small_fraction_target,
            )
            .map_err(|e| {
                invalid(format!(
                    "a size (--size) of {} bytes does not suit the {} format ({per_param} \
                     bytes per parameter, so about {plan_bytes} bytes of bf16 weights): {e}",
                    opts.total_bytes, opts.format
                ))
            })?
        }
    };
    let (tensors, scale) = (plan.tensors.len() as u64, plan.scale);
    let b = Builder::new(opts, seed, plan);
    let mut layout = match opts.format {
        GenFormat::Dcp | GenFormat::Torchtitan => b.distcp(false),
        GenFormat::Nemo => b.nemo(),
        GenFormat::Orbax => b.orbax(),
        GenFormat::ByteCheckpoint => b.bytecheckpoint(),
        GenFormat::MegatronDist => b.distcp(true),
        GenFormat::MegatronLegacy => b.megatron_legacy(),
        GenFormat::DeepSpeed => b.deepspeed(),
        GenFormat::Hf => b.hf(),
        GenFormat::HfTrainer => b.hf_trainer(),
        GenFormat::Generic => b.generic(),
    };
    layout.tensors = tensors;
    layout.scale = scale;
    layout.expected_bytes = layout
        .ranks
        .iter()
        .flatten()
        .map(|s| match s {
            Step::Write(job) => job.size,
            _ => 0,
        })
        .sum();
    Ok(layout)
}

/// Writes `content` into `sink`; with `hold`, calls [`Sink::hold`] before
/// the file's tail.
pub(super) fn write_content(sink: &mut dyn Sink, content: &Content, hold: bool) -> io::Result<()> {
    match content {
        Content::Text(bytes) => {
            sink.put(bytes)?;
            if hold {
                sink.hold()?;
            }
            Ok(())
        }
        Content::Tensor(n) => {
            sink.put_random(*n, None)?;
            sink.tensor_done(*n);
            Ok(())
        }
        Content::Tensors(sizes) => {
            for &n in sizes {
                sink.put_random(n, None)?;
                sink.tensor_done(n);
            }
            Ok(())
        }
        Content::Zip(entries) => write_zip(sink, entries, hold),
        Content::DistCp(items) => write_distcp(sink, items, hold).map(drop),
        Content::Safetensors { header, tensors } => write_safetensors(sink, header, tensors),
    }
}

impl FileJob {
    /// A job writing `content` in place; its size is measured here.
    fn new(path: PathBuf, content: Content) -> Self {
        let mut counter = Counter::default();
        // A counter never fails.
        let _ = write_content(&mut counter, &content, false);
        Self {
            path,
            content,
            how: How::InPlace,
            fsync: false,
            hold: false,
            size: counter.pos(),
        }
    }

    fn text(path: PathBuf, text: impl Into<Vec<u8>>) -> Self {
        Self::new(path, Content::Text(text.into()))
    }

    fn how(mut self, how: How) -> Self {
        self.how = how;
        self
    }

    fn fsync(mut self) -> Self {
        self.fsync = true;
        self
    }

    fn hold(mut self, hold: bool) -> Self {
        self.hold = hold;
        self
    }
}

/// One state kind saved per parameter (weights, an optimizer moment).
#[derive(Debug, Clone, Copy)]
struct Kind {
    /// Name before the parameter's name.
    prefix: &'static str,
    /// Name after it.
    suffix: &'static str,
    /// Bytes per element.
    elem_bytes: u64,
}

/// PyTorch DCP with FSDP2: `get_state_dict(model, optim)` flattened, as in
/// `tests/fixtures/dcp/make.py`.
const DCP_KINDS: [Kind; 3] = [
    Kind {
        prefix: "model.",
        suffix: "",
        elem_bytes: 4,
    },
    Kind {
        prefix: "optimizer.state.",
        suffix: ".exp_avg",
        elem_bytes: 4,
    },
    Kind {
        prefix: "optimizer.state.",
        suffix: ".exp_avg_sq",
        elem_bytes: 4,
    },
];

/// Megatron-Core torch_dist with the distributed optimizer: bf16 weights
/// and fp32 main params and moments as sharded tensors.
const MEGATRON_KINDS: [Kind; 4] = [
    Kind {
        prefix: "",
        suffix: "",
        elem_bytes: 2,
    },
    Kind {
        prefix: "optimizer.state.fp32_param.",
        suffix: "",
        elem_bytes: 4,
    },
    Kind {
        prefix: "optimizer.state.exp_avg.",
        suffix: "",
        elem_bytes: 4,
    },
    Kind {
        prefix: "optimizer.state.exp_avg_sq.",
        suffix: "",
        elem_bytes: 4,
    },
];

/// Builds the layout of one format from a scaled tensor plan.
struct Builder<'a> {
    opts: &'a SaveOptions,
    seed: u64,
    plan: Plan,
    /// Dotted parameter names, in plan order.
    names: Vec<String>,
    /// Element counts (the plan's bf16 bytes / 2), in plan order.
    elems: Vec<u64>,
    ranks: u32,
    /// Checkpoint directory, relative to the root.
    dir: PathBuf,
}

impl<'a> Builder<'a> {
    fn new(opts: &'a SaveOptions, seed: u64, plan: Plan) -> Self {
        let names = plan.tensors.iter().map(|t| t.fqn()).collect();
        let elems = plan.bytes.iter().map(|b| (b / 2).max(1)).collect();
        Self {
            opts,
            seed,
            plan,
            names,
            elems,
            ranks: opts.ranks,
            dir: PathBuf::from(dir_name(opts.format, opts.step)),
        }
    }

    /// `name` inside the checkpoint directory.
    fn at(&self, name: impl AsRef<Path>) -> PathBuf {
        self.dir.join(name)
    }

    fn step(&self) -> u64 {
        self.opts.step
    }

    fn last_rank(&self) -> u32 {
        self.ranks - 1
    }

    /// The damage step for `path` if the fault asks for one.
    fn damage(&self, path: &Path) -> Option<Step> {
        let cut = match self.opts.fault {
            Fault::Truncated => Cut::Half,
            Fault::ZeroByte => Cut::Zero,
            _ => return None,
        };
        Some(Step::Damage {
            path: path.to_path_buf(),
            cut,
        })
    }

    fn stale(&self) -> bool {
        self.opts.fault == Fault::StaleMarker
    }

    /// The layout skeleton: `ranks` empty step lists, the directory made
    /// first.
    fn layout(&self, marker: PathBuf) -> Layout {
        Layout {
            dir: self.dir.clone(),
            staging: None,
            prelude: vec![Step::Mkdir(self.dir.clone())],
            ranks: (0..self.ranks).map(|_| Vec::new()).collect(),
            expected_bytes: 0,
            marker,
            root_files: Vec::new(),
            damaged: None,
            tensors: 0,
            scale: None,
        }
    }

    /// Splits `elems` elements of parameter `index` among the ranks the
    /// way FSDP's `Shard(0)` (or Megatron's tensor parallelism) does:
    /// `(rank, first element, count)`, near-equal parts; a tensor with
    /// fewer elements than ranks stays whole on one rank.
    fn shards(&self, index: usize, elems: u64) -> Vec<(usize, u64, u64)> {
        let r = u64::from(self.ranks);
        if elems < r {
            return vec![(index % self.ranks as usize, 0, elems)];
        }
        (0..r)
            .map(|k| {
                let start = elems * k / r;
                (k as usize, start, elems * (k + 1) / r - start)
            })
            .collect()
    }

    /// PyTorch DCP (`megatron = false`: `step_N/__{r}_0.distcp`, then
    /// `.metadata`) or Megatron-Core torch_dist (`iter_N/` with the same
    /// files, then `metadata.json` and the tracker).
    ///
    /// DCP: every rank creates its `.distcp` under the final name, appends
    /// one `torch.save` record per item (non-tensor items first), fsyncs
    /// and closes it; rank 0 writes `.metadata.tmp`, fsyncs it and renames
    /// it to `.metadata` only after every rank closed its file
    /// (`tests/fixtures/dcp/FIXTURE.md`). Megatron then writes
    /// `metadata.json` in place, and rank 0 the tracker in place.
    fn distcp(&self, megatron: bool) -> Layout {
        let kinds: &[Kind] = if megatron {
            &MEGATRON_KINDS
        } else {
            &DCP_KINDS
        };
        let items = self.dcp_items(kinds, true, true, !megatron);
        let metadata = self.at(".metadata");
        let mut layout = self.layout(metadata.clone());
        let storage = self.dcp_data(&mut layout, Path::new(""), items, true);
        for steps in &mut layout.ranks {
            steps.push(Step::Post(Event::DataClosed));
        }
        let metadata_pickle = |step: u64, storage: Vec<(Py, Py)>| self.dcp_metadata(step, storage);
        let tracker = PathBuf::from(MEGATRON_TRACKER);
        if self.stale() {
            let prev = self.step() - 1;
            layout.prelude.push(Step::Write(FileJob::text(
                metadata.clone(),
                metadata_pickle(prev, Vec::new()),
            )));
            if megatron {
                layout.prelude.push(Step::Write(FileJob::text(
                    tracker.clone(),
                    prev.to_string(),
                )));
            }
        }
        let rank0 = &mut layout.ranks[0];
        rank0.push(Step::Wait(Until::DataClosed(self.ranks)));
        rank0.push(Step::Write(
            FileJob::text(metadata.clone(), metadata_pickle(self.step(), storage))
                .how(How::RenameAfterClose {
                    tmp: self.at(".metadata.tmp"),
                })
                .fsync(),
        ));
        if megatron {
            let config = serde_json::json!({
                "sharded_backend": "torch_dist",
                "sharded_backend_version": 1,
                "common_backend": "torch",
                "common_backend_version": 1,
            });
            rank0.push(Step::Write(FileJob::text(
                self.at("metadata.json"),
                config.to_string(),
            )));
            rank0.push(Step::Write(FileJob::text(
                tracker.clone(),
                self.step().to_string(),
            )));
            layout.marker = tracker.clone();
            layout.root_files.push(tracker);
        }
        rank0.push(Step::Commit);
        rank0.push(Step::Post(Event::MarkerWritten));
        layout
    }

    /// The items each rank's `.distcp` holds, in write order: the state
    /// `kinds` of every parameter sharded as [`Builder::shards`] does, and
    /// optionally the optimizer's `param_groups` (rank 0, first), the
    /// `train_state` (last rank) and AdamW's per-parameter `step` scalar.
    fn dcp_items(
        &self,
        kinds: &[Kind],
        param_groups: bool,
        train_state: bool,
        step_scalars: bool,
    ) -> Vec<Vec<(Py, Item)>> {
        let mut items: Vec<Vec<(Py, Item)>> = vec![Vec::new(); self.ranks as usize];
        if param_groups {
            let groups = Py::List(vec![Py::Dict(vec![
                (Py::Str("lr".into()), Py::Str("0.0003".into())),
                (Py::Str("weight_decay".into()), Py::Str("0.1".into())),
                (Py::Str("params".into()), Py::Int(self.names.len() as i64)),
            ])]);
            items[0].push((
                Py::Str("optimizer.param_groups".into()),
                Item::Bytes(pickle(&groups)),
            ));
        }
        if train_state {
            let state = Py::Dict(vec![(Py::Str("step".into()), Py::Int(self.step() as i64))]);
            items[self.last_rank() as usize]
                .push((Py::Str("train_state".into()), Item::Bytes(pickle(&state))));
        }
        for (i, (name, &elems)) in self.names.iter().zip(&self.elems).enumerate() {
            for kind in kinds {
                let fqn = format!("{}{name}{}", kind.prefix, kind.suffix);
                for (rank, start, count) in self.shards(i, elems) {
                    let key = Py::Tuple(vec![Py::Str(fqn.clone()), Py::Int(start as i64)]);
                    let record = tensor_record(&fqn, count, count * kind.elem_bytes);
                    items[rank].push((key, record));
                }
            }
            if step_scalars {
                // AdamW's per-parameter `step` scalar, stored once.
                let fqn = format!("optimizer.state.{name}.step");
                let key = Py::Tuple(vec![Py::Str(fqn.clone()), Py::Int(0)]);
                items[i % self.ranks as usize].push((key, tensor_record(&fqn, 1, 4)));
            }
        }
        items
    }

    /// Appends to each rank's steps the write of its `__{rank}_0.distcp`
    /// in `sub` of the checkpoint directory (created under its final name,
    /// appended, fsynced, closed); with `damage`, the last rank's file is
    /// the fault's victim. Returns `.metadata`'s `storage_data`.
    fn dcp_data(
        &self,
        layout: &mut Layout,
        sub: &Path,
        items: Vec<Vec<(Py, Item)>>,
        damage: bool,
    ) -> Vec<(Py, Py)> {
        let mut storage = Vec::new();
        for (rank, rank_items) in items.into_iter().enumerate() {
            let file = format!("__{rank}_0.distcp");
            let path = self.at(sub.join(&file));
            let (keys, records): (Vec<Py>, Vec<Item>) = rank_items.into_iter().unzip();
            let mut counter = Counter::default();
            let spans = write_distcp(&mut counter, &records, false).unwrap_or_default();
            for (key, (offset, length)) in keys.into_iter().zip(spans) {
                let info = Py::Tuple(vec![
                    Py::Str(file.clone()),
                    Py::Int(offset as i64),
                    Py::Int(length as i64),
                ]);
                storage.push((key, info));
            }
            let steps = &mut layout.ranks[rank];
            steps.push(Step::Write(
                FileJob::new(path.clone(), Content::DistCp(records)).fsync(),
            ));
            if damage && rank as u32 == self.last_rank() {
                if let Some(d) = self.damage(&path) {
                    steps.push(d);
                    layout.damaged = Some(path);
                }
            }
        }
        storage
    }

    /// A DCP `.metadata` pickle for `step` (its `save_id` names the seed).
    fn dcp_metadata(&self, step: u64, storage: Vec<(Py, Py)>) -> Vec<u8> {
        let save_id = format!("ferry-{:016x}-{step}", self.seed);
        pickle(&Py::Dict(vec![
            (Py::Str("save_id".into()), Py::Str(save_id)),
            (Py::Str("step".into()), Py::Int(step as i64)),
            (Py::Str("storage_data".into()), Py::Dict(storage)),
        ]))
    }

    /// DCP's `.metadata` in `sub`: written as `.metadata.tmp`, fsynced,
    /// closed and renamed (`FileSystemWriter.finish`).
    fn dcp_metadata_job(&self, sub: &Path, storage: Vec<(Py, Py)>) -> FileJob {
        FileJob::text(
            self.at(sub.join(".metadata")),
            self.dcp_metadata(self.step(), storage),
        )
        .how(How::RenameAfterClose {
            tmp: self.at(sub.join(".metadata.tmp")),
        })
        .fsync()
    }

    /// NeMo 2 `ModelCheckpoint._save_checkpoint`: rank 0 touches the
    /// sibling marker `<name>-unfinished` in the root before anything else
    /// (`set_checkpoint_unfinished_marker`, then a barrier); the ranks save
    /// `<name>/weights/` as Megatron-Core torch_dist (`__{r}_0.distcp`,
    /// then `.metadata` through `.metadata.tmp`, then `metadata.json`),
    /// rank 0 dumps the trainer context into `<name>/context/`
    /// (`io.json`, `model.yaml`), and removes the marker last
    /// (`remove_checkpoint_unfinished_marker`; CHECKPOINT_FORMATS.md
    /// "Publish rule" item 4). The marker's removal is the commit.
    fn nemo(&self) -> Layout {
        let unfinished = PathBuf::from(format!(
            "{}{NEMO_UNFINISHED}",
            dir_name(GenFormat::Nemo, self.step())
        ));
        let weights = Path::new("weights");
        let metadata_json = self.at(weights.join("metadata.json"));
        let mut layout = self.layout(metadata_json.clone());
        layout.root_files.push(unfinished.clone());
        layout
            .prelude
            .insert(0, Step::Write(FileJob::text(unfinished.clone(), "")));
        layout.prelude.push(Step::Mkdir(self.at(weights)));
        let items = self.dcp_items(&MEGATRON_KINDS, true, true, false);
        let storage = self.dcp_data(&mut layout, weights, items, true);
        for steps in &mut layout.ranks {
            steps.push(Step::Post(Event::DataClosed));
        }
        let config = serde_json::json!({
            "sharded_backend": "torch_dist",
            "sharded_backend_version": 1,
            "common_backend": "torch",
            "common_backend_version": 1,
        });
        let io = serde_json::json!({
            "root": {
                "type": "ref",
                "key": "trainer_context_1",
            },
            "objects": {
                "trainer_context_1": {
                    "type": ["nemo.lightning.io.api", "TrainerContext"],
                    "model": "ferry_synthetic",
                    "step": self.step(),
                },
            },
        });
        let yaml = format!(
            "_target_: ferry.synthetic.Model\nhidden_size: {}\nnum_layers: {}\n\
             tower_depth: {}\n",
            self.plan.hidden, self.plan.layers, self.plan.tower_depth
        );
        let context = self.at("context");
        let rank0 = &mut layout.ranks[0];
        rank0.push(Step::Wait(Until::DataClosed(self.ranks)));
        rank0.push(Step::Write(self.dcp_metadata_job(weights, storage)));
        rank0.push(Step::Write(FileJob::text(
            metadata_json,
            config.to_string(),
        )));
        rank0.push(Step::Mkdir(context.clone()));
        rank0.push(Step::Write(FileJob::text(
            context.join("io.json"),
            pretty(&io),
        )));
        rank0.push(Step::Write(FileJob::text(context.join("model.yaml"), yaml)));
        rank0.push(Step::Remove(unfinished));
        rank0.push(Step::Commit);
        rank0.push(Step::Post(Event::MarkerWritten));
        layout
    }

    /// Orbax on a POSIX file system (`AsyncCheckpointer` with the default
    /// OCDBT PyTree handler): everything goes into
    /// `<N>.orbax-checkpoint-tmp-<ts>/`. Each process `p` writes its
    /// OCDBT data file `default/ocdbt.process_p/d/<hash>` (params and
    /// Adam's `mu` and `nu`, appended), its `manifest.ocdbt` and
    /// `default/array_metadatas/process_p`; after the barrier process 0
    /// writes `default/_sharding`, `default/_METADATA`, the merged
    /// `default/manifest.ocdbt`, `_CHECKPOINT_METADATA` and
    /// `commit_success.txt`, then renames the directory to `<N>/`, which
    /// is the commit (CHECKPOINT_FORMATS.md, Orbax row). `<ts>` is derived
    /// from the seed, so a seed always yields the same names.
    fn orbax(&self) -> Layout {
        let tmp = PathBuf::from(format!(
            "{}.orbax-checkpoint-tmp-{}",
            self.step(),
            ORBAX_TS_BASE + self.seed % 1_000_000
        ));
        let item = tmp.join("default");
        let mut layout = self.layout(self.at("commit_success.txt"));
        layout.staging = Some(tmp.clone());
        layout.prelude = vec![
            Step::Mkdir(tmp.clone()),
            Step::Mkdir(item.join("array_metadatas")),
        ];
        let mut sizes: Vec<Vec<u64>> = vec![Vec::new(); self.ranks as usize];
        for (i, &elems) in self.elems.iter().enumerate() {
            // params, mu, nu: fp32 each.
            for _ in 0..3 {
                for (rank, _, count) in self.shards(i, elems) {
                    sizes[rank].push(count * 4);
                }
            }
        }
        let mut rng = SmallRng::seed_from_u64(file_seed(self.seed, u64::MAX - 1));
        for (rank, sizes) in sizes.into_iter().enumerate() {
            let process = item.join(format!("ocdbt.process_{rank}"));
            layout.prelude.push(Step::Mkdir(process.join("d")));
            let hash: String = (0..32)
                .map(|_| char::from(b"0123456789abcdef"[rng.gen_range(0..16)]))
                .collect();
            let data = process.join("d").join(hash);
            let manifest = format!("ferry ocdbt manifest process={rank} files=1\n");
            let array_metadata = serde_json::json!({
                "array_metadatas": sizes.len(),
                "process_index": rank,
            });
            let steps = &mut layout.ranks[rank];
            steps.push(Step::Write(FileJob::new(
                data.clone(),
                Content::Tensors(sizes),
            )));
            if rank as u32 == self.last_rank() {
                if let Some(d) = self.damage(&data) {
                    steps.push(d);
                    layout.damaged = Some(data);
                }
            }
            steps.push(Step::Write(FileJob::text(
                process.join("manifest.ocdbt"),
                manifest,
            )));
            steps.push(Step::Write(FileJob::text(
                item.join("array_metadatas").join(format!("process_{rank}")),
                array_metadata.to_string(),
            )));
            steps.push(Step::Post(Event::DataClosed));
        }
        let tree: serde_json::Map<String, serde_json::Value> = self
            .names
            .iter()
            .map(|n| {
                let meta =
                    serde_json::json!({ "value_type": "jax.Array", "skip_deserialize": false });
                (format!("params.{n}"), meta)
            })
            .collect();
        let metadata = serde_json::json!({
            "tree_metadata": tree,
            "use_zarr3": false,
            "store_array_data_equal_to_fill_value": true,
        });
        let checkpoint_metadata = serde_json::json!({
            "item_handlers": "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler",
            "metrics": {},
            "performance_metrics": {},
            "init_timestamp_nsecs": (ORBAX_TS_BASE + self.seed % 1_000_000) * 1_000_000_000,
            "commit_timestamp_nsecs": null,
            "custom_metadata": { "step": self.step() },
        });
        let rank0 = &mut layout.ranks[0];
        rank0.push(Step::Wait(Until::DataClosed(self.ranks)));
        rank0.push(Step::Write(FileJob::text(item.join("_sharding"), "{}")));
        rank0.push(Step::Write(FileJob::text(
            item.join("_METADATA"),
            metadata.to_string(),
        )));
        rank0.push(Step::Write(FileJob::text(
            item.join("manifest.ocdbt"),
            format!("ferry ocdbt manifest merged processes={}\n", self.ranks),
        )));
        rank0.push(Step::Write(FileJob::text(
            tmp.join("_CHECKPOINT_METADATA"),
            checkpoint_metadata.to_string(),
        )));
        rank0.push(Step::Write(FileJob::text(
            tmp.join("commit_success.txt"),
            format!(
                "Checkpoint commit was successful to {}\n",
                self.dir.display()
            ),
        )));
        rank0.push(Step::RenameDir {
            from: tmp,
            to: self.dir.clone(),
        });
        rank0.push(Step::Commit);
        rank0.push(Step::Post(Event::MarkerWritten));
        layout
    }

    /// ByteCheckpoint (`bytecheckpoint.save` with FSDP): every rank writes
    /// `model/__{r}_0.distcp` (fp32 weights), `optimizer/__{r}_0.distcp`
    /// (AdamW moments, `param_groups`, `step`) and
    /// `extra_state/extra_state_rank_{r}.pt` (RNG states); after the
    /// barrier rank 0 writes `optimizer/.metadata` and then
    /// `model/.metadata`, each through `.metadata.tmp` + rename as DCP does
    /// (CHECKPOINT_FORMATS.md, ByteCheckpoint row).
    fn bytecheckpoint(&self) -> Layout {
        let (model, optimizer) = (Path::new("model"), Path::new("optimizer"));
        let extra = self.at("extra_state");
        let mut layout = self.layout(self.at(model.join(".metadata")));
        for sub in [model, optimizer] {
            layout.prelude.push(Step::Mkdir(self.at(sub)));
        }
        layout.prelude.push(Step::Mkdir(extra.clone()));
        let weights = [Kind {
            prefix: "",
            suffix: "",
            elem_bytes: 4,
        }];
        let moments = [
            Kind {
                prefix: "optimizer.state.",
                suffix: ".exp_avg",
                elem_bytes: 4,
            },
            Kind {
                prefix: "optimizer.state.",
                suffix: ".exp_avg_sq",
                elem_bytes: 4,
            },
        ];
        let model_items = self.dcp_items(&weights, false, false, false);
        let model_storage = self.dcp_data(&mut layout, model, model_items, true);
        let optim_items = self.dcp_items(&moments, true, false, true);
        let optim_storage = self.dcp_data(&mut layout, optimizer, optim_items, false);
        for rank in 0..self.ranks {
            let name = format!("extra_state_rank_{rank}");
            let archive = torch_archive(
                &name,
                pickle(&rng_pickle(self.seed ^ u64::from(rank))),
                &[5056, 16],
            );
            let steps = &mut layout.ranks[rank as usize];
            steps.push(Step::Write(FileJob::new(
                extra.join(format!("{name}.pt")),
                Content::Zip(archive),
            )));
            steps.push(Step::Post(Event::DataClosed));
        }
        let rank0 = &mut layout.ranks[0];
        rank0.push(Step::Wait(Until::DataClosed(self.ranks)));
        rank0.push(Step::Write(self.dcp_metadata_job(optimizer, optim_storage)));
        rank0.push(Step::Write(self.dcp_metadata_job(model, model_storage)));
        rank0.push(Step::Commit);
        rank0.push(Step::Post(Event::MarkerWritten));
        layout
    }

    /// Megatron-LM legacy checkpoints: rank `t` (tensor-parallel rank)
    /// makes `iter_N/mp_rank_TT/`, saves the distributed optimizer's
    /// `distrib_optim.pt` and then `model_optim_rng.pt` (the order of
    /// Megatron's `save_checkpoint`), all ranks meet at a barrier, and
    /// rank 0 writes the tracker `latest_checkpointed_iteration.txt` in
    /// place with the iteration number.
    fn megatron_legacy(&self) -> Layout {
        let tracker = PathBuf::from(MEGATRON_TRACKER);
        let mut layout = self.layout(tracker.clone());
        layout.root_files.push(tracker.clone());
        let mut weights: Vec<Vec<u64>> = vec![Vec::new(); self.ranks as usize];
        for (i, &elems) in self.elems.iter().enumerate() {
            for (rank, _, count) in self.shards(i, elems) {
                weights[rank].push(count);
            }
        }
        for (rank, counts) in weights.into_iter().enumerate() {
            let rank_dir = self.at(format!("mp_rank_{rank:02}"));
            let total: u64 = counts.iter().sum();
            let optim = torch_archive(
                "distrib_optim",
                pickle(&state_pickle(&["param", "exp_avg", "exp_avg_sq"])),
                &[total * 4, total * 4, total * 4],
            );
            // bf16 weights, then the CPU and CUDA RNG states.
            let mut storages: Vec<u64> = counts.iter().map(|c| c * 2).collect();
            storages.extend([5056, 16]);
            let model = torch_archive(
                "model_optim_rng",
                pickle(&names_pickle(&self.names, self.step())),
                &storages,
            );
            let model_path = rank_dir.join("model_optim_rng.pt");
            let steps = &mut layout.ranks[rank];
            steps.push(Step::Mkdir(rank_dir.clone()));
            steps.push(Step::Write(FileJob::new(
                rank_dir.join("distrib_optim.pt"),
                Content::Zip(optim),
            )));
            steps.push(Step::Write(FileJob::new(
                model_path.clone(),
                Content::Zip(model),
            )));
            if rank as u32 == self.last_rank() {
                if let Some(d) = self.damage(&model_path) {
                    steps.push(d);
                    layout.damaged = Some(model_path);
                }
            }
            steps.push(Step::Post(Event::DataClosed));
        }
        if self.stale() {
            layout.prelude.push(Step::Write(FileJob::text(
                tracker.clone(),
                (self.step() - 1).to_string(),
            )));
        }
        let rank0 = &mut layout.ranks[0];
        rank0.push(Step::Wait(Until::DataClosed(self.ranks)));
        rank0.push(Step::Write(FileJob::text(tracker, self.step().to_string())));
        rank0.push(Step::Commit);
        rank0.push(Step::Post(Event::MarkerWritten));
        layout
    }

    /// DeepSpeed ZeRO-2 (bf16): rank 0 writes `mp_rank_00_model_states.pt`
    /// (every weight as its own storage), every data-parallel rank `d`
    /// writes `bf16_zero_pp_rank_{d}_mp_rank_00_optim_states.pt` (flat fp32
    /// partitions of two parameter groups and their moments), rank 0
    /// copies `zero_to_fp32.py` and then writes the root file `latest`
    /// (the tag) in place *before* the final barrier: the last rank is
    /// still writing its optimizer file when `latest` appears and closes it
    /// after (`docs/CHECKPOINT_FORMATS.md`, "A marker does not always mean
    /// all ranks are done").
    fn deepspeed(&self) -> Layout {
        let latest = PathBuf::from("latest");
        let mut layout = self.layout(latest.clone());
        layout.root_files.push(latest.clone());
        let tag = dir_name(GenFormat::DeepSpeed, self.step());
        let model_path = self.at("mp_rank_00_model_states.pt");
        let model = torch_archive(
            "mp_rank_00_model_states",
            pickle(&names_pickle(&self.names, self.step())),
            &self.elems.iter().map(|e| e * 2).collect::<Vec<_>>(),
        );
        layout.ranks[0].push(Step::Write(FileJob::new(
            model_path.clone(),
            Content::Zip(model),
        )));
        if let Some(d) = self.damage(&model_path) {
            layout.ranks[0].push(d);
            layout.damaged = Some(model_path);
        }
        // Parameter groups: with and without weight decay (norms, biases).
        let mut group = [0u64; 2];
        for (name, &elems) in self.names.iter().zip(&self.elems) {
            let no_decay = name.contains("norm") || name.ends_with("bias");
            group[usize::from(no_decay)] += elems;
        }
        let r = u64::from(self.ranks);
        let part = group.map(|g| g.div_ceil(r));
        for rank in 0..self.ranks {
            let name = format!("bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt");
            let stem = name.trim_end_matches(".pt").to_string();
            // base_optimizer_state (step, exp_avg, exp_avg_sq per group),
            // then single_partition_of_fp32_groups, in pickling order.
            let storages = [
                4,
                part[0] * 4,
                part[0] * 4,
                4,
                part[1] * 4,
                part[1] * 4,
                part[0] * 4,
                part[1] * 4,
            ];
            let archive = torch_archive(
                &stem,
                pickle(&state_pickle(&[
                    "base_optimizer_state",
                    "single_partition_of_fp32_groups",
                    "zero_stage",
                    "partition_count",
                ])),
                &storages,
            );
            let late = self.ranks > 1 && rank == self.last_rank();
            layout.ranks[rank as usize].push(Step::Write(
                FileJob::new(self.at(&name), Content::Zip(archive)).hold(late),
            ));
        }
        if self.stale() {
            let prev = dir_name(GenFormat::DeepSpeed, self.step() - 1);
            layout
                .prelude
                .push(Step::Write(FileJob::text(latest.clone(), prev)));
        }
        let rank0 = &mut layout.ranks[0];
        rank0.push(Step::Write(FileJob::text(
            self.at("zero_to_fp32.py"),
            ZERO_TO_FP32,
        )));
        if self.ranks > 1 {
            rank0.push(Step::Wait(Until::Pending(1)));
        }
        rank0.push(Step::Write(FileJob::text(latest, tag)));
        rank0.push(Step::Commit);
        rank0.push(Step::Post(Event::MarkerWritten));
        layout
    }

    /// The steps of transformers' `save_pretrained` into the checkpoint
    /// directory (`tests/fixtures/safetensors/FIXTURE.md`): `config.json`
    /// and `generation_config.json` first, then each shard through a
    /// pre-sized `.tmpXXXXXX` renamed while open, then
    /// `model.safetensors.index.json` last, in place. Shards hold about a
    /// quarter of the weights each (at most 5 GB, transformers' default).
    /// With `damage`, the last shard is the fault's victim.
    fn save_pretrained(&self, dtype: &'static str, elem_bytes: u64, damage: bool) -> Pretrained {
        let mut steps = Vec::new();
        let config = serde_json::json!({
            "architectures": ["FerrySyntheticMultimodalForCausalLM"],
            "model_type": "ferry_synthetic",
            "hidden_size": self.plan.hidden,
            "num_hidden_layers": self.plan.layers,
            "tower_depth": self.plan.tower_depth,
            "torch_dtype": if elem_bytes == 2 { "bfloat16" } else { "float32" },
            "transformers_version": "5.24.0",
        });
        let generation = serde_json::json!({
            "_from_model_config": true,
            "transformers_version": "5.24.0",
        });
        steps.push(Step::Write(FileJob::text(
            self.at("config.json"),
            pretty(&config),
        )));
        steps.push(Step::Write(FileJob::text(
            self.at("generation_config.json"),
            pretty(&generation),
        )));

        let total: u64 = self.elems.iter().map(|e| e * elem_bytes).sum();
        let max_shard = total.div_ceil(4).min(5_000_000_000);
        let mut shards: Vec<Vec<StTensor>> = vec![Vec::new()];
        let mut filled = 0;
        for (name, &elems) in self.names.iter().zip(&self.elems) {
            let bytes = elems * elem_bytes;
            if filled > 0 && filled + bytes > max_shard {
                shards.push(Vec::new());
                filled = 0;
            }
            filled += bytes;
            if let Some(shard) = shards.last_mut() {
                shard.push(StTensor {
                    name: name.clone(),
                    dtype,
                    elems,
                    bytes,
                });
            }
        }
        let n = shards.len();
        let mut weight_map = serde_json::Map::new();
        let mut rng = SmallRng::seed_from_u64(file_seed(self.seed, u64::MAX));
        let mut damaged = None;
        for (k, mut tensors) in shards.into_iter().enumerate() {
            // safetensors lays data out sorted by name within a dtype.
            tensors.sort_by(|a, b| a.name.cmp(&b.name));
            let file = format!("model-{:05}-of-{n:05}.safetensors", k + 1);
            for t in &tensors {
                weight_map.insert(t.name.clone(), file.clone().into());
            }
            let tmp: String = (0..6)
                .map(|_| char::from(rng.sample(rand::distributions::Alphanumeric)))
                .collect();
            let header = safetensors_header(&tensors);
            let path = self.at(&file);
            steps.push(Step::Write(
                FileJob::new(path.clone(), Content::Safetensors { header, tensors }).how(
                    How::Presized {
                        tmp: self.at(format!(".tmp{tmp}")),
                    },
                ),
            ));
            if damage && k + 1 == n {
                if let Some(d) = self.damage(&path) {
                    steps.push(d);
                    damaged = Some(path);
                }
            }
        }
        let index = serde_json::json!({
            "metadata": { "total_size": total },
            "weight_map": weight_map,
        });
        let index_path = self.at("model.safetensors.index.json");
        let index_text = pretty(&index);
        steps.push(Step::Write(FileJob::text(
            index_path.clone(),
            index_text.clone(),
        )));
        Pretrained {
            steps,
            index: index_path,
            index_text: index_text.into_bytes(),
            damaged,
        }
    }

    /// transformers `save_pretrained` on the main process (the other
    /// ranks write nothing), bf16 weights.
    fn hf(&self) -> Layout {
        let model = self.save_pretrained("BF16", 2, true);
        let mut layout = self.layout(model.index.clone());
        if self.stale() {
            // The index of an earlier save into the same directory.
            layout
                .prelude
                .push(Step::Write(FileJob::text(model.index, model.index_text)));
        }
        layout.damaged = model.damaged;
        let rank0 = &mut layout.ranks[0];
        rank0.extend(model.steps);
        rank0.push(Step::Commit);
        rank0.push(Step::Post(Event::MarkerWritten));
        layout
    }

    /// HF Trainer `_save_checkpoint` into `checkpoint-N/`: the model
    /// (`save_pretrained`, fp32 weights) and `training_args.bin`, then
    /// `optimizer.pt` (AdamW state: step, exp_avg, exp_avg_sq per
    /// parameter), `scheduler.pt`, each process's `rng_state_{i}.pth`, and
    /// `trainer_state.json` (`global_step == N`) last from the main
    /// process. The other processes' `rng_state_{i}.pth` close only after
    /// `trainer_state.json` is written (the documented race).
    fn hf_trainer(&self) -> Layout {
        let state_path = self.at("trainer_state.json");
        let mut layout = self.layout(state_path.clone());
        let model = self.save_pretrained("F32", 4, false);
        if self.stale() {
            layout.prelude.push(Step::Write(FileJob::text(
                state_path.clone(),
                pretty(&trainer_state(self.step() - 1)),
            )));
        }
        let rank0 = &mut layout.ranks[0];
        rank0.extend(model.steps);
        rank0.push(Step::Write(FileJob::new(
            self.at("training_args.bin"),
            Content::Zip(torch_archive(
                "training_args",
                pickle(&state_pickle(&TRAINING_ARGS)),
                &[],
            )),
        )));
        let mut storages = Vec::with_capacity(3 * self.elems.len());
        for &e in &self.elems {
            storages.extend([4, e * 4, e * 4]);
        }
        let optimizer = self.at("optimizer.pt");
        rank0.push(Step::Write(FileJob::new(
            optimizer.clone(),
            Content::Zip(torch_archive(
                "optimizer",
                pickle(&names_pickle(&self.names, self.step())),
                &storages,
            )),
        )));
        if let Some(d) = self.damage(&optimizer) {
            rank0.push(d);
            layout.damaged = Some(optimizer);
        }
        rank0.push(Step::Write(FileJob::new(
            self.at("scheduler.pt"),
            Content::Zip(torch_archive(
                "scheduler",
                pickle(&state_pickle(&["base_lrs", "last_epoch", "_step_count"])),
                &[],
            )),
        )));
        for rank in 0..self.ranks {
            let name = if self.ranks == 1 {
                "rng_state.pth".to_string()
            } else {
                format!("rng_state_{rank}.pth")
            };
            let archive = torch_archive(
                name.trim_end_matches(".pth"),
                pickle(&rng_pickle(self.seed ^ u64::from(rank))),
                &[5056, 16],
            );
            let job = FileJob::new(self.at(&name), Content::Zip(archive)).hold(rank > 0);
            layout.ranks[rank as usize].push(Step::Write(job));
        }
        let rank0 = &mut layout.ranks[0];
        if self.ranks > 1 {
            rank0.push(Step::Wait(Until::Pending(self.ranks - 1)));
        }
        rank0.push(Step::Write(FileJob::text(
            state_path,
            pretty(&trainer_state(self.step())),
        )));
        rank0.push(Step::Commit);
        rank0.push(Step::Post(Event::MarkerWritten));
        layout
    }

    /// The per-tensor layout of [`crate::generate`] (same file names
    /// and sizes), written by `ranks` threads (tensor `i` by rank
    /// `i % ranks`), then the marker last by rank 0 once every rank is done.
    fn generic(&self) -> Layout {
        let marker = self.at(&self.opts.marker);
        let mut layout = self.layout(marker.clone());
        for sub in self.plan.dirs() {
            layout.prelude.push(Step::Mkdir(self.at(sub)));
        }
        let n = self.plan.tensors.len();
        for (i, (tensor, &bytes)) in self.plan.tensors.iter().zip(&self.plan.bytes).enumerate() {
            let path = self.at(tensor.path());
            let steps = &mut layout.ranks[i % self.ranks as usize];
            steps.push(Step::Write(FileJob::new(
                path.clone(),
                Content::Tensor(bytes),
            )));
            if i + 1 == n {
                if let Some(d) = self.damage(&path) {
                    steps.push(d);
                    layout.damaged = Some(path);
                }
            }
        }
        for steps in &mut layout.ranks {
            steps.push(Step::Post(Event::DataClosed));
        }
        let summary = self.plan.summary();
        if self.stale() {
            layout.prelude.push(Step::Write(FileJob::text(
                marker.clone(),
                format!("ferry gen step={}\n", self.step() - 1),
            )));
        }
        let rank0 = &mut layout.ranks[0];
        rank0.push(Step::Wait(Until::DataClosed(self.ranks)));
        rank0.push(Step::Write(FileJob::text(
            marker,
            format!(
                "ferry gen step={} seed={} shards={} bytes={}\n",
                self.step(),
                self.seed,
                summary.shards,
                summary.bytes
            ),
        )));
        rank0.push(Step::Commit);
        rank0.push(Step::Post(Event::MarkerWritten));
        layout
    }
}

/// The steps of one `save_pretrained`.
struct Pretrained {
    steps: Vec<Step>,
    /// `model.safetensors.index.json`, relative to the root.
    index: PathBuf,
    /// Its contents.
    index_text: Vec<u8>,
    /// The damaged shard, if any.
    damaged: Option<PathBuf>,
}

/// One DCP tensor record: a `torch.save` archive of one storage.
fn tensor_record(fqn: &str, elems: u64, bytes: u64) -> Item {
    let rebuild = Py::Tuple(vec![
        Py::Str("torch._utils._rebuild_tensor_v2".into()),
        Py::Str(fqn.to_string()),
        Py::Tuple(vec![Py::Int(elems as i64)]),
    ]);
    Item::Archive(torch_archive("archive", pickle(&rebuild), &[bytes]))
}

/// A `data.pkl` stand-in naming every parameter (a state dict's pickle).
fn names_pickle(names: &[String], step: u64) -> Py {
    let params = names
        .iter()
        .enumerate()
        .map(|(k, n)| (Py::Str(n.clone()), Py::Str(format!("data/{k}"))))
        .collect();
    Py::Dict(vec![
        (Py::Str("iteration".into()), Py::Int(step as i64)),
        (Py::Str("model".into()), Py::Dict(params)),
    ])
}

/// A `data.pkl` stand-in with these keys.
fn state_pickle(keys: &[&str]) -> Py {
    Py::Dict(
        keys.iter()
            .map(|k| (Py::Str((*k).to_string()), Py::None))
            .collect(),
    )
}

/// A `data.pkl` stand-in for an RNG state file: Python's Mersenne Twister
/// state (625 words) and numpy's, as `_save_rng_state` pickles them.
fn rng_pickle(seed: u64) -> Py {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut words = || {
        Py::Tuple(
            (0..625)
                .map(|_| Py::Int(i64::from(rng.gen::<u32>())))
                .collect(),
        )
    };
    Py::Dict(vec![
        (
            Py::Str("python".into()),
            Py::Tuple(vec![Py::Int(3), words(), Py::None]),
        ),
        (
            Py::Str("numpy".into()),
            Py::Tuple(vec![Py::Str("MT19937".into()), words()]),
        ),
        (Py::Str("cpu".into()), Py::Str("data/0".into())),
        (Py::Str("cuda".into()), Py::Str("data/1".into())),
    ])
}

/// HF Trainer's `trainer_state.json` for `global_step`.
fn trainer_state(global_step: u64) -> serde_json::Value {
    serde_json::json!({
        "best_global_step": null,
        "best_metric": null,
        "best_model_checkpoint": null,
        "epoch": 0.5,
        "eval_steps": 500,
        "global_step": global_step,
        "is_hyper_param_search": false,
        "is_local_process_zero": true,
        "is_world_process_zero": true,
        "log_history": [],
        "logging_steps": 500,
        "max_steps": global_step.saturating_mul(2).max(1),
        "num_input_tokens_seen": 0,
        "num_train_epochs": 1,
        "save_steps": global_step.max(1),
        "stateful_callbacks": {},
        "total_flos": 0.0,
        "train_batch_size": 8,
        "trial_name": null,
        "trial_params": null,
    })
}

/// Field names of HF `TrainingArguments` (the pickled object's keys).
const TRAINING_ARGS: [&str; 12] = [
    "output_dir",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "max_steps",
    "save_steps",
    "bf16",
    "seed",
    "report_to",
];

/// JSON with two-space indentation and a final newline, as transformers
/// writes its JSON files (`json.dumps(indent=2, sort_keys=True) + "\n"`;
/// serde_json's map keeps keys sorted).
fn pretty(value: &serde_json::Value) -> String {
    let mut text = serde_json::to_string_pretty(value).unwrap_or_default();
    text.push('\n');
    text
}

/// A stand-in for DeepSpeed's recovery script (the real one is copied
/// from the DeepSpeed package; only its presence matters to a watcher).
const ZERO_TO_FP32: &str = "#!/usr/bin/env python\n\
# Stand-in for DeepSpeed's zero_to_fp32.py, written by `ferry gen`.\n\
# The real script consolidates ZeRO partitions into fp32 weights:\n\
#   python zero_to_fp32.py . pytorch_model.bin\n\
import sys\n\
\n\
if __name__ == \"__main__\":\n\
    sys.exit(\"ferry gen wrote this checkpoint; there is nothing to recover\")\n";
