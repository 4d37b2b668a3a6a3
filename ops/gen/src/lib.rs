//! Realistic synthetic checkpoint generator (`ferry gen`).
//!
//! Writes a checkpoint directory with one file per tensor (a per-tensor
//! shard layout) whose file count, size spread and share of tiny files
//! follow the "Realistic sizes" section of `docs/CHECKPOINT_FORMATS.md` (the
//! project's checkpoint-format notes), scaled down so that CI disks suffice.
//!
//! # Model
//!
//! A multimodal model with three parts (all tensors bf16, 2 bytes per
//! element):
//!
//! * a Llama-style decoder (`model/`) with `L` layers, hidden size `h`,
//!   grouped-query attention with `n_kv * d = h / 4`, SwiGLU MLP width
//!   `f = 3.5 h` and untied embeddings over a vocabulary of `V = 25 h`
//!   (about 128 k at `h = 5120`). Its weights follow the dense-decoder
//!   formula of `docs/CHECKPOINT_FORMATS.md`,
//!   `P = V*h*2 + L*(2h^2 + 2h*n_kv*d + 3h*f + 2h) + h`, in `9L + 3`
//!   tensors of which `2L + 1` are norm weights, plus Qwen2-style q/k/v
//!   biases (`3L` more small tensors);
//! * a vision tower (`vision_tower/`, InternViT-style, width `h / 2`):
//!   `D` blocks of 16 tensors, 12 of them LayerNorm weights and biases,
//!   q/k-norm weights, layer scales and linear biases, plus patch/position
//!   embeddings and a projector;
//! * an audio tower (`audio_tower/`, Conformer-style, width `h / 2`):
//!   `D` blocks of 40 tensors, 29 of them small (LayerNorm weights and
//!   biases, linear and convolution biases, batch-norm statistics,
//!   relative-position biases, the depthwise convolution kernel), plus a
//!   subsampling stem and a projector.
//!
//! `docs/CHECKPOINT_FORMATS.md` notes that modality towers are what push a large
//! multimodal checkpoint past 60 % of tensors under 16 KiB (the seed
//! paper's production trace); the towers above reproduce that mix.
//!
//! # Scaling formula
//!
//! For a target of `T` bytes:
//!
//! 1. `u = max(1, round(T / 32 MiB))`; `L = min(u, 80)` decoder layers,
//!    so file counts grow with the target (about 2,900 files at the 1.4 GB
//!    default) up to a 70B-class depth;
//! 2. `h = 128 * max(u, 32)`: the Llama-2 7B/13B aspect ratio `h = 128 L`,
//!    at least a 7B-class width, and wider instead of deeper beyond 80
//!    layers (above about 2.7 GB);
//! 3. tower depth `D = L`, raised one block at a time while the fraction
//!    of shards under 16 KiB is below
//!    [`GenOptions::small_fraction_target`] (at most `4L + 4`);
//! 4. every tensor's reference element count `n_i` follows from `L`, `h`
//!    and `D` as above; the scale factor is `s = (T / 2) / sum(n_i)` and
//!    each tensor gets `m_i = max(1, round(s * n_i))` elements, i.e.
//!    `2 * m_i` bytes. Counts and ratios between tensors are kept, as
//!    `docs/CHECKPOINT_FORMATS.md` asks of scaled-down generators;
//! 5. `model/lm_head.bin`, written last, absorbs the rounding
//!    remainder, so the files add up to exactly `T` bytes.
//!
//! The reference model holds about `(22 L + 57) h^2` elements (with
//! `D = L`), so a scaled matrix gets about `T / (22 L + 57)` bytes per `h^2`
//! reference elements and a vector `h` times less. With about 32 MiB per
//! decoder layer every matrix (at least `h^2 / 4` reference elements) stays
//! well above 16 KiB and every vector (at most `4.5 h`) well below it, so
//! the small-shard share hardly depends on `T`: 65.6 % (93 files) at 20 MB,
//! 67.2 % (433 files) at 200 MB, 67.6 % (2,881 files, two of 34 MiB) at
//! the 1.4 GB default and 67.6 % (5,465 files) from 2.7 GB up. Below
//! about 6 MB the smallest matrices drop under 16 KiB too.
//!
//! # Presets, scale and exact file counts
//!
//! The rule above is the default (`ferry gen` without `--model`,
//! `--scale` or `--shards`, and [`GenOptions::new`]). [`Preset`] adds
//! fixed tensor lists at full scale (Llama-2-7B, Llama-2-70B and this
//! multimodal model at `L = D = 32`, `h = 4096`; parameter counts in the
//! [`preset`] docs), sized one of three ways:
//!
//! * [`GenOptions::scale`] `S` (`0 < S <= 1`): every tensor gets
//!   `max(1, round(S * n_i))` elements, so counts and ratios are kept and
//!   the total follows from `S` ([`preview`] tells it before writing);
//! * a total in bytes with a Llama preset: the largest `S <= 1` whose
//!   tensors fit in `T` bytes (found by bisection, since the
//!   one-element floor makes the total a step function of `S`), with
//!   `model/lm_head.bin` absorbing the remainder, so the files add up to
//!   exactly `T`; a `T` above the full-scale size is refused. The `mm`
//!   preset sized in bytes is the size-driven rule above;
//! * [`GenOptions::shards`] `N`: the preset's layer pattern repeated or
//!   cut to exactly `N` tensors (the rule in the [`preset`] docs), then
//!   sized to `T` bytes as above.
//!
//! File contents are incompressible pseudo-random bytes from a
//! [`SmallRng`] seeded per file from [`GenOptions::seed`], so a seed always
//! yields the same bytes.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};

pub mod format;
pub mod output;
pub mod preset;

use self::output::Output;
use self::preset::RefModel;
pub use self::preset::{Preset, MAX_SHARDS};

/// Default target size of a generated checkpoint, in bytes (1.4 GB, the
/// `--size` default of `ferry gen`).
pub const DEFAULT_TOTAL_BYTES: u64 = 1_400_000_000;

/// Default minimum fraction (0.0-1.0, by file count) of shards under
/// [`SMALL_SHARD_BYTES`].
pub const DEFAULT_SMALL_FRACTION_TARGET: f64 = 0.65;

/// Size threshold in bytes below which a shard counts as small (16 KiB).
pub const SMALL_SHARD_BYTES: u64 = 16 * 1024;

/// Bytes of target size per decoder layer when choosing `L` (32 MiB).
const BYTES_PER_LAYER: u64 = 32 * 1024 * 1024;

/// Largest number of decoder layers the generator chooses.
const MAX_LAYERS: u64 = 80;

/// Bytes per tensor element (bf16).
const ELEM_BYTES: u64 = 2;

/// Size of the reusable write buffer, in bytes (8 MiB).
const WRITE_BUF_BYTES: u64 = 8 * 1024 * 1024;

/// Options for [`generate`].
#[derive(Debug, Clone, PartialEq)]
pub struct GenOptions {
    /// Output directory; created if missing. Existing files with the same
    /// names are overwritten.
    pub out: PathBuf,
    /// Target total size of all tensor files, in bytes (the marker is not
    /// counted). The files add up to exactly this many bytes. Ignored when
    /// [`GenOptions::scale`] is set.
    pub total_bytes: u64,
    /// The model whose tensors are written (default
    /// [`Preset::Multimodal`]).
    pub model: Preset,
    /// Scale factor `S` (`0 < S <= 1`) applied to every tensor's
    /// full-scale element count (at least one element each) instead of
    /// sizing by `total_bytes`; `None` (the default) sizes by
    /// `total_bytes`. Excludes [`GenOptions::shards`].
    pub scale: Option<f64>,
    /// Exactly this many tensor files (1 to [`MAX_SHARDS`]; the marker
    /// comes on top) adding up to `total_bytes`, by the rule of the
    /// [`preset`] docs; `None` (the default) writes the preset's own
    /// count.
    pub shards: Option<u64>,
    /// Minimum fraction (0.0-1.0, by file count) of tensor files smaller
    /// than [`SMALL_SHARD_BYTES`]; the modality towers are deepened until
    /// it is reached. Used by the size-driven `mm` plan only: a fixed
    /// preset list has the share its shape gives (see [`preset`]). The
    /// natural mix is about 0.66-0.68 (0.656 for targets under 48 MiB), so
    /// lower targets change nothing; up to about 0.71 is
    /// reachable (0.70 nearly doubles the tower depth), higher targets fail
    /// with [`io::ErrorKind::InvalidInput`]. Default
    /// [`DEFAULT_SMALL_FRACTION_TARGET`] (0.65).
    pub small_fraction_target: f64,
    /// Seed of the pseudo-random file contents; the same seed and options
    /// give byte-identical files.
    pub seed: u64,
    /// File name of a commit marker written directly in `out` after every
    /// tensor file is closed (e.g. `"COMMITTED"`), or `None` for no marker.
    /// A plain file name: no path separators, not `.` or `..`.
    pub marker: Option<String>,
}

impl GenOptions {
    /// Options for `total_bytes` bytes (see [`GenOptions::total_bytes`]) in
    /// `out`, with the default small fraction (0.65), seed 0 and no marker:
    /// the size-driven `mm` plan, no scale, no shard count.
    pub fn new(out: impl Into<PathBuf>, total_bytes: u64) -> Self {
        Self {
            out: out.into(),
            total_bytes,
            model: Preset::Multimodal,
            scale: None,
            shards: None,
            small_fraction_target: DEFAULT_SMALL_FRACTION_TARGET,
            seed: 0,
            marker: None,
        }
    }
}

/// What [`generate`] wrote (tensor files only; the marker is not counted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GenSummary {
    /// Number of tensor files written.
    pub shards: u64,
    /// Total size of the tensor files, in bytes.
    pub bytes: u64,
    /// Number of tensor files smaller than [`SMALL_SHARD_BYTES`] (16 KiB).
    pub small_shards: u64,
    /// Size of the largest tensor file, in bytes.
    pub largest: u64,
}

/// Generates a synthetic checkpoint as described in the [module
/// docs](self): one file per tensor under `opts.out`, then the marker (if
/// any) last. A stale marker of the same name is removed before the first
/// tensor file is written.
///
/// `progress` is called after every write (at most 8 MiB each) with the
/// number of tensor bytes written so far, up to the total [`preview`]
/// reports (`opts.total_bytes` unless a scale is set).
///
/// # Errors
///
/// [`io::ErrorKind::InvalidInput`] for a bad marker name or any sizing
/// [`preview`] refuses; any I/O error from creating directories or
/// writing files.
pub fn generate(opts: &GenOptions, progress: &dyn Fn(u64)) -> io::Result<GenSummary> {
    let marker = match &opts.marker {
        Some(name) => Some(opts.out.join(validate_marker(name)?)),
        None => None,
    };
    let plan = Plan::for_options(opts)?;

    fs::create_dir_all(&opts.out)?;
    if let Some(path) = &marker {
        match fs::remove_file(path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    for dir in plan.dirs() {
        fs::create_dir_all(opts.out.join(dir))?;
    }

    let buf_len = plan.largest().min(WRITE_BUF_BYTES);
    let mut buf = vec![0u8; usize::try_from(buf_len).map_err(invalid)?];
    let mut written = 0u64;
    for (index, (tensor, &bytes)) in plan.tensors.iter().zip(&plan.bytes).enumerate() {
        let mut rng = SmallRng::seed_from_u64(file_seed(opts.seed, index as u64));
        let mut file = File::create(opts.out.join(tensor.path()))?;
        let mut left = bytes;
        while left > 0 {
            let chunk = &mut buf[..usize::try_from(left.min(buf_len)).map_err(invalid)?];
            rng.fill_bytes(chunk);
            file.write_all(chunk)?;
            left -= chunk.len() as u64;
            written += chunk.len() as u64;
            progress(written);
        }
    }

    if let Some(path) = &marker {
        let summary = plan.summary();
        let text = format!(
            "ferry gen seed={} shards={} bytes={}\n",
            opts.seed, summary.shards, summary.bytes
        );
        fs::write(path, text)?;
    }
    Ok(plan.summary())
}

/// [`generate`] into a store that takes whole files (an HDFS or S3 root
/// behind [`Output`]): the same files with the same bytes, in the same
/// order (tensor files in plan order, each finished before the next,
/// then, after an [`Output::barrier`], the marker), paths relative to the store's root; `opts.out` is
/// not used. A marker of the same name is removed first.
///
/// `progress` is called after every piece (at most 1 MiB) with the
/// number of tensor bytes written so far.
///
/// # Errors
///
/// [`io::ErrorKind::InvalidInput`] as [`generate`]; the store's errors.
pub fn generate_into(
    opts: &GenOptions,
    out: &dyn Output,
    progress: &dyn Fn(u64),
) -> io::Result<GenSummary> {
    let marker = match &opts.marker {
        Some(name) => Some(PathBuf::from(validate_marker(name)?)),
        None => None,
    };
    let plan = Plan::for_options(opts)?;
    if let Some(path) = &marker {
        out.remove(path)?;
    }
    let buf_len = plan.largest().min(output::PIECE_BYTES);
    let mut buf = vec![0u8; usize::try_from(buf_len).map_err(invalid)?];
    let mut written = 0u64;
    for (index, (tensor, &bytes)) in plan.tensors.iter().zip(&plan.bytes).enumerate() {
        let mut rng = SmallRng::seed_from_u64(file_seed(opts.seed, index as u64));
        let mut file = out.create(&tensor.path(), bytes)?;
        let mut left = bytes;
        while left > 0 {
            let chunk = &mut buf[..usize::try_from(left.min(buf_len)).map_err(invalid)?];
            rng.fill_bytes(chunk);
            file.write(chunk)?;
            left -= chunk.len() as u64;
            written += chunk.len() as u64;
            progress(written);
        }
        file.finish()?;
    }
    // Every tensor file whole before the marker (and before this returns).
    out.barrier()?;
    if let Some(path) = &marker {
        let summary = plan.summary();
        let text = format!(
            "ferry gen seed={} shards={} bytes={}\n",
            opts.seed, summary.shards, summary.bytes
        );
        let mut file = out.create(path, text.len() as u64)?;
        file.write(text.as_bytes())?;
        file.finish()?;
        out.barrier()?;
    }
    Ok(plan.summary())
}

/// What [`generate`] would write for some options, without writing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Preview {
    /// File count, total, small files and largest file, as
    /// [`generate`] would report them.
    pub summary: GenSummary,
    /// The factor applied to the preset's full-scale element counts
    /// (0.0-1.0): [`GenOptions::scale`] if set, else the one found for
    /// `total_bytes`; `None` for the size-driven `mm` plan, which has no
    /// fixed full scale.
    pub scale: Option<f64>,
}

/// Plans `opts` as [`generate`] would, without touching the disk: the
/// files' count and total size (the size to check free space against and
/// to print for a `--scale`).
///
/// # Errors
///
/// [`io::ErrorKind::InvalidInput`] for a `small_fraction_target` outside
/// 0.0-1.0 or above what the towers can reach; a scale outside
/// `0 < S <= 1` or set together with a shard count; a shard count outside
/// the preset's fixed tensors to [`MAX_SHARDS`]; a `total_bytes` too small
/// for one element per tensor, larger than the (stretched) preset at full
/// scale, or (for `mm` with a shard count) leaving no more than 60 % of the
/// files under 16 KiB. Messages name the numbers that clash.
pub fn preview(opts: &GenOptions) -> io::Result<Preview> {
    let plan = Plan::for_options(opts)?;
    Ok(Preview {
        summary: plan.summary(),
        scale: plan.scale,
    })
}

/// Parses a scale factor for `--scale`: a decimal number `S` with
/// `0 < S <= 1`, e.g. `"0.01"`, `"1e-3"`, `"1"`.
///
/// # Errors
/// A message naming the value for anything else (not a number, zero,
/// negative, above 1, not finite).
pub fn parse_scale(s: &str) -> Result<f64, String> {
    let value: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("invalid scale {s:?}: expected a number such as 0.01"))?;
    check_scale(value).map_err(|e| format!("invalid scale {s:?}: {e}"))
}

/// Checks `0 < scale <= 1`.
fn check_scale(scale: f64) -> Result<f64, String> {
    if scale > 0.0 && scale <= 1.0 {
        Ok(scale)
    } else {
        Err(format!(
            "{scale} is not in 0 < S <= 1 (a scale shrinks the full-scale model; \
             it never grows it)"
        ))
    }
}

/// Directory of the decoder tensors.
const MODEL: &str = "model";
/// Directory of the vision-tower tensors.
const VISION: &str = "vision_tower";
/// Directory of the audio-tower tensors.
const AUDIO: &str = "audio_tower";

/// One tensor of the reference model: its file name parts and unscaled
/// element count.
#[derive(Debug, Clone, Copy)]
struct Tensor {
    /// Directory under the output root.
    dir: &'static str,
    /// Block prefix such as `"layers"`, or `None` for a top-level tensor.
    block: Option<(&'static str, u64)>,
    /// Tensor name within its block, without the `.bin` suffix.
    name: &'static str,
    /// Element count before scaling.
    ref_elems: f64,
}

impl Tensor {
    /// Path of the tensor file relative to the output root.
    fn path(&self) -> PathBuf {
        let file = match self.block {
            Some((prefix, i)) => format!("{prefix}.{i}.{}.bin", self.name),
            None => format!("{}.bin", self.name),
        };
        Path::new(self.dir).join(file)
    }

    /// Dotted state-dict name, e.g. `model.layers.0.mlp.up_proj.weight`
    /// (the file path without `.bin`, `/` read as `.`).
    fn fqn(&self) -> String {
        match self.block {
            Some((prefix, i)) => format!("{}.{prefix}.{i}.{}", self.dir, self.name),
            None => format!("{}.{}", self.dir, self.name),
        }
    }
}

/// How a [`Plan`] is sized.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Sizing {
    /// A total in bytes.
    Bytes(u64),
    /// A factor on the full-scale element counts.
    Scale(f64),
}

/// The scaled tensor list for one target size. `layers`, `hidden` and
/// `tower_depth` describe the reference shape (the scaling formula's
/// tests check them; `save_pretrained` writes them into `config.json`).
#[derive(Debug)]
#[cfg_attr(not(test), allow(dead_code))]
struct Plan {
    /// Decoder layers `L`.
    layers: u64,
    /// Reference hidden size `h`.
    hidden: u64,
    /// Vision and audio tower depth `D` (0 without towers).
    tower_depth: u64,
    /// Tensors in write order; the last one is `model/lm_head`.
    tensors: Vec<Tensor>,
    /// Scaled size of each tensor in bytes, parallel to `tensors`.
    bytes: Vec<u64>,
    /// Factor on a preset's full-scale element counts; `None` for the
    /// size-driven `mm` plan.
    scale: Option<f64>,
}

impl Plan {
    /// The plan [`generate`] writes for `opts`.
    fn for_options(opts: &GenOptions) -> io::Result<Self> {
        let sizing = match opts.scale {
            Some(s) => Sizing::Scale(s),
            None => Sizing::Bytes(opts.total_bytes),
        };
        Self::build(opts.model, sizing, opts.shards, opts.small_fraction_target)
    }

    /// Plans `model` sized by `sizing`, with exactly `shards` tensors if
    /// set (see the module docs and [`preview`] for the errors).
    fn build(
        model: Preset,
        sizing: Sizing,
        shards: Option<u64>,
        small_fraction_target: f64,
    ) -> io::Result<Self> {
        match (sizing, shards) {
            (Sizing::Scale(s), Some(n)) => Err(invalid(format!(
                "scale {s} and {n} shards exclude each other: an exact shard count is sized \
                 by total_bytes"
            ))),
            (Sizing::Scale(s), None) => {
                let s = check_scale(s).map_err(|e| invalid(format!("scale {e}")))?;
                Ok(Self::at_scale(model.full(), s))
            }
            (Sizing::Bytes(total), None) if model == Preset::Multimodal => {
                Self::new(total, small_fraction_target)
            }
            (Sizing::Bytes(total), None) => Self::fitted(model, model.full(), total)
                .map_err(|e| invalid(format!("size {total} bytes: {e}"))),
            (Sizing::Bytes(total), Some(n)) => {
                let clash = |e: String| {
                    invalid(format!("{n} shards cannot be met with {total} bytes: {e}"))
                };
                let reference = model.with_shards(n)?;
                let plan =
                    Self::fitted(model, reference, total).map_err(|e| clash(e.to_string()))?;
                let fraction = plan.small_fraction();
                if model == Preset::Multimodal && fraction <= preset::SHARDS_MIN_SMALL_FRACTION {
                    return Err(clash(format!(
                        "only {:.1} % of the files would be under 16 KiB, and the {model} \
                         preset keeps more than {:.0} % (use more shards or a smaller size)",
                        100.0 * fraction,
                        100.0 * preset::SHARDS_MIN_SMALL_FRACTION
                    )));
                }
                Ok(plan)
            }
        }
    }

    /// `reference` with every element count multiplied by `scale` (at
    /// least one element each).
    fn at_scale(reference: RefModel, scale: f64) -> Self {
        let bytes = reference
            .tensors
            .iter()
            .map(|t| scaled_elems(t.ref_elems, scale) * ELEM_BYTES)
            .collect();
        Self::from_reference(reference, bytes, scale)
    }

    /// `reference` scaled to exactly `total_bytes` bytes: the largest
    /// scale `S <= 1` whose element counts fit, found by bisection, with
    /// the last tensor (`model/lm_head`) taking the remainder.
    ///
    /// # Errors
    /// [`io::ErrorKind::InvalidInput`] if `total_bytes` is under one
    /// element per tensor or above the full-scale size.
    fn fitted(model: Preset, reference: RefModel, total_bytes: u64) -> io::Result<Self> {
        let n = reference.tensors.len() as u64;
        let least = n * ELEM_BYTES;
        if total_bytes < least {
            return Err(invalid(format!(
                "each of the {n} tensor files needs at least one {ELEM_BYTES}-byte element \
                 ({least} bytes)"
            )));
        }
        let full = reference.params();
        let target = total_bytes / ELEM_BYTES;
        if target > full {
            return Err(invalid(format!(
                "the {model} preset holds {} bytes at full scale in {n} tensor files, and a \
                 scale never exceeds 1",
                full * ELEM_BYTES
            )));
        }
        let count = |s: f64| -> u64 {
            reference
                .tensors
                .iter()
                .map(|t| scaled_elems(t.ref_elems, s))
                .sum()
        };
        let (mut lo, mut hi) = (0.0, 1.0);
        if count(hi) <= target {
            lo = hi;
        }
        // count(lo) <= target < count(hi) unless lo == hi, and count never
        // decreases; 80 halvings leave a gap far below any scale's ulp-level
        // effect on a rounded count.
        for _ in 0..80 {
            let mid = (lo + hi) / 2.0;
            if count(mid) <= target {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let mut elems: Vec<u64> = reference
            .tensors
            .iter()
            .map(|t| scaled_elems(t.ref_elems, lo))
            .collect();
        let spare = target - elems.iter().sum::<u64>();
        let last = elems.len() - 1;
        elems[last] += spare;
        let mut bytes: Vec<u64> = elems.iter().map(|e| e * ELEM_BYTES).collect();
        bytes[last] += total_bytes % ELEM_BYTES;
        Ok(Self::from_reference(reference, bytes, lo))
    }

    fn from_reference(reference: RefModel, bytes: Vec<u64>, scale: f64) -> Self {
        Self {
            layers: reference.layers,
            hidden: reference.hidden,
            tower_depth: reference.tower_depth,
            tensors: reference.tensors,
            bytes,
            scale: Some(scale),
        }
    }

    /// The directories of the tensors, each once, in write order.
    fn dirs(&self) -> Vec<&'static str> {
        let mut dirs: Vec<&'static str> = Vec::new();
        for t in &self.tensors {
            if !dirs.contains(&t.dir) {
                dirs.push(t.dir);
            }
        }
        dirs
    }

    /// Chooses `L`, `h` and `D` for `total_bytes` bytes and a minimum small
    /// fraction, and scales the tensors (see the module docs).
    fn new(total_bytes: u64, small_fraction_target: f64) -> io::Result<Self> {
        if !(0.0..=1.0).contains(&small_fraction_target) {
            return Err(invalid(format!(
                "small_fraction_target {small_fraction_target} is not between 0 and 1"
            )));
        }
        let units = (total_bytes.saturating_add(BYTES_PER_LAYER / 2) / BYTES_PER_LAYER).max(1);
        let layers = units.min(MAX_LAYERS);
        let hidden = 128 * units.max(32);
        let max_depth = 4 * layers + 4;
        let mut depth = layers;
        loop {
            let plan = Self::scaled(total_bytes, layers, hidden, depth)?;
            let fraction = plan.small_fraction();
            if fraction >= small_fraction_target {
                return Ok(plan);
            }
            if depth >= max_depth {
                return Err(invalid(format!(
                    "small_fraction_target {small_fraction_target} is above the {fraction:.3} \
                     the generator reaches for {total_bytes} bytes"
                )));
            }
            depth += 1;
        }
    }

    /// Builds and scales the tensor list for fixed `L`, `h` and `D`.
    fn scaled(total_bytes: u64, layers: u64, hidden: u64, depth: u64) -> io::Result<Self> {
        let tensors = preset::multimodal(layers, hidden, depth);
        let ref_total: f64 = tensors.iter().map(|t| t.ref_elems).sum();
        let scale = (total_bytes / ELEM_BYTES) as f64 / ref_total;
        let mut bytes: Vec<u64> = tensors
            .iter()
            .map(|t| ((t.ref_elems * scale).round() as u64).max(1) * ELEM_BYTES)
            .collect();
        let last = bytes.len() - 1;
        let others: u64 = bytes[..last].iter().sum();
        if total_bytes < others + ELEM_BYTES {
            return Err(invalid(format!(
                "{total_bytes} bytes of tensor data are too few: at least {} are needed (one bf16 element per tensor)",
                (last as u64 + 1) * ELEM_BYTES
            )));
        }
        bytes[last] = total_bytes - others;
        Ok(Self {
            layers,
            hidden,
            tower_depth: depth,
            tensors,
            bytes,
            scale: None,
        })
    }

    /// Number of tensors under [`SMALL_SHARD_BYTES`].
    fn small_shards(&self) -> u64 {
        self.bytes
            .iter()
            .filter(|&&b| b < SMALL_SHARD_BYTES)
            .count() as u64
    }

    /// Fraction (0.0-1.0) of tensors under [`SMALL_SHARD_BYTES`].
    fn small_fraction(&self) -> f64 {
        self.small_shards() as f64 / self.bytes.len() as f64
    }

    /// Size of the largest tensor in bytes.
    fn largest(&self) -> u64 {
        self.bytes.iter().copied().max().unwrap_or(0)
    }

    /// Summary of what writing this plan produces.
    fn summary(&self) -> GenSummary {
        GenSummary {
            shards: self.bytes.len() as u64,
            bytes: self.bytes.iter().sum(),
            small_shards: self.small_shards(),
            largest: self.largest(),
        }
    }
}

/// `ref_elems * scale` rounded, at least 1.
fn scaled_elems(ref_elems: f64, scale: f64) -> u64 {
    ((ref_elems * scale).round() as u64).max(1)
}

/// Per-file RNG seed: distinct for every file index under one seed.
fn file_seed(seed: u64, index: u64) -> u64 {
    seed ^ index.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Checks that a marker name is a plain file name.
fn validate_marker(name: &str) -> io::Result<&str> {
    if name.is_empty() || name == "." || name == ".." || name.contains(['/', '\\', '\0']) {
        return Err(invalid(format!(
            "invalid marker name {name:?}: expected a plain file name"
        )));
    }
    if [MODEL, VISION, AUDIO].contains(&name) {
        return Err(invalid(format!(
            "invalid marker name {name:?}: the generator writes a directory of that name"
        )));
    }
    Ok(name)
}

/// Checks that the file system that will hold `dir` (or its nearest
/// existing ancestor) has `bytes` free plus 64 MiB.
///
/// # Errors
/// [`io::ErrorKind::StorageFull`]-like error naming the directory, the
/// free and the needed bytes.
pub fn ensure_space(dir: &Path, bytes: u64) -> io::Result<()> {
    let mut probe = dir;
    while !probe.exists() {
        probe = probe.parent().unwrap_or(Path::new("/"));
    }
    let st = nix::sys::statvfs::statvfs(probe).map_err(io::Error::from)?;
    let free = st.blocks_available() as u64 * st.fragment_size() as u64;
    let needed = bytes.saturating_add(64 << 20);
    if free < needed {
        return Err(io::Error::other(format!(
            "{} has {free} bytes free; this needs {needed} (including a 64 MiB margin)",
            probe.display()
        )));
    }
    Ok(())
}

/// An [`io::ErrorKind::InvalidInput`] error with `msg`.
fn invalid(msg: impl ToString) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg.to_string())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::time::SystemTime;

    /// Every regular file under `root` with its size and mtime.
    fn walk(root: &Path) -> Vec<(PathBuf, u64, SystemTime)> {
        let mut out = Vec::new();
        let mut stack = vec![root.to_path_buf()];
        while let Some(dir) = stack.pop() {
            for entry in fs::read_dir(&dir).unwrap() {
                let entry = entry.unwrap();
                let meta = entry.metadata().unwrap();
                if meta.is_dir() {
                    stack.push(entry.path());
                } else {
                    let rel = entry.path().strip_prefix(root).unwrap().to_path_buf();
                    out.push((rel, meta.len(), meta.modified().unwrap()));
                }
            }
        }
        out.sort();
        out
    }

    /// Generates `total` bytes into a fresh temp dir and checks the summary
    /// against what is on disk.
    fn generate_checked(total: u64, seed: u64) -> (tempfile::TempDir, GenSummary) {
        let dir = tempfile::tempdir().unwrap();
        let mut opts = GenOptions::new(dir.path().join("ckpt"), total);
        opts.seed = seed;
        let last = Cell::new(0u64);
        let summary = generate(&opts, &|n| {
            assert!(n > last.get(), "progress must increase");
            last.set(n);
        })
        .unwrap();
        assert_eq!(last.get(), summary.bytes);
        let files = walk(&opts.out);
        assert_eq!(files.len() as u64, summary.shards);
        assert_eq!(files.iter().map(|f| f.1).sum::<u64>(), summary.bytes);
        let small = files.iter().filter(|f| f.1 < SMALL_SHARD_BYTES).count() as u64;
        assert_eq!(small, summary.small_shards);
        assert_eq!(files.iter().map(|f| f.1).max().unwrap(), summary.largest);
        (dir, summary)
    }

    fn assert_within_2_percent(total: u64, summary: &GenSummary) {
        let err = summary.bytes.abs_diff(total) as f64 / total as f64;
        assert!(err <= 0.02, "{} bytes for a {total} target", summary.bytes);
    }

    #[test]
    fn mix_and_total_at_20_mb() {
        let total = 20_000_000;
        let (_dir, s) = generate_checked(total, 1);
        let fraction = s.small_shards as f64 / s.shards as f64;
        assert!(fraction > 0.6, "{s:?}");
        assert!(fraction >= DEFAULT_SMALL_FRACTION_TARGET, "{s:?}");
        assert_within_2_percent(total, &s);
        assert_eq!(s.bytes, total);
    }

    #[test]
    fn mix_and_total_at_200_mb() {
        let total = 200_000_000;
        let (_dir, s) = generate_checked(total, 2);
        let fraction = s.small_shards as f64 / s.shards as f64;
        assert!(fraction > 0.6, "{s:?}");
        assert_within_2_percent(total, &s);
        assert_eq!(s.bytes, total);
    }

    #[test]
    fn default_size_plan() {
        let plan = Plan::new(DEFAULT_TOTAL_BYTES, DEFAULT_SMALL_FRACTION_TARGET).unwrap();
        let s = plan.summary();
        assert_eq!(s.bytes, DEFAULT_TOTAL_BYTES);
        assert!((2_500..=3_300).contains(&s.shards), "{s:?}");
        assert!(plan.small_fraction() > 0.65, "{s:?}");
        assert!((10 << 20..100 << 20).contains(&s.largest), "{s:?}");
        // Counts of the reference model: decoder 9L + 3 (2L + 1 norms) plus
        // 3L biases, 16 tensors per vision block, 40 per audio block.
        let (l, d) = (plan.layers, plan.tower_depth);
        assert_eq!(s.shards, 12 * l + 3 + (4 + 16 * d + 6) + (8 + 40 * d + 4));
        assert_eq!(plan.hidden, 128 * l.max(32));
        let norms = plan
            .tensors
            .iter()
            .filter(|t| t.dir == MODEL && t.name.contains("norm"))
            .count() as u64;
        assert_eq!(norms, 2 * l + 1);
    }

    #[test]
    fn mix_is_stable_across_sizes() {
        for total in [
            10_000_000,
            50_000_000,
            500_000_000,
            5_000_000_000,
            50_000_000_000,
            500_000_000_000,
        ] {
            let plan = Plan::new(total, DEFAULT_SMALL_FRACTION_TARGET).unwrap();
            let f = plan.small_fraction();
            assert!((0.65..0.72).contains(&f), "{total}: {f}");
            assert_eq!(plan.summary().bytes, total);
            // Vectors (at most 9 * tower width elements) stay small and
            // square-ish matrices stay big, so the mix does not drift.
            let h = plan.hidden as f64;
            for (t, &b) in plan.tensors.iter().zip(&plan.bytes) {
                if t.ref_elems <= 4.5 * h {
                    assert!(b < SMALL_SHARD_BYTES, "{total}: {t:?} {b}");
                } else if t.ref_elems >= h * h / 4.0 {
                    assert!(b >= SMALL_SHARD_BYTES, "{total}: {t:?} {b}");
                }
            }
        }
    }

    #[test]
    fn deterministic_for_a_seed() {
        let total = 3_000_000;
        let (a, sa) = generate_checked(total, 7);
        let (b, sb) = generate_checked(total, 7);
        let (c, _) = generate_checked(total, 8);
        assert_eq!(sa, sb);
        let (ra, rb, rc) = (
            a.path().join("ckpt"),
            b.path().join("ckpt"),
            c.path().join("ckpt"),
        );
        let files = walk(&ra);
        let mut differs = 0;
        for (rel, _, _) in &files {
            let bytes = fs::read(ra.join(rel)).unwrap();
            assert_eq!(bytes, fs::read(rb.join(rel)).unwrap(), "{rel:?}");
            if bytes != fs::read(rc.join(rel)).unwrap() {
                differs += 1;
            }
        }
        assert!(
            differs > files.len() * 9 / 10,
            "another seed changes the bytes"
        );
        // Files differ from each other too (per-file streams).
        let embed = fs::read(ra.join("model/embed_tokens.bin")).unwrap();
        let head = fs::read(ra.join("model/lm_head.bin")).unwrap();
        assert_ne!(embed[..4096], head[..4096]);
    }

    #[test]
    fn marker_is_written_last() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("step_1");
        fs::create_dir_all(&out).unwrap();
        // A stale marker from an earlier run must not survive the writes.
        fs::write(out.join("COMMITTED"), b"stale").unwrap();
        let mut opts = GenOptions::new(&out, 2_000_000);
        opts.marker = Some("COMMITTED".to_string());
        let seen_marker = Cell::new(false);
        let summary = generate(&opts, &|_| {
            if out.join("COMMITTED").exists() {
                seen_marker.set(true);
            }
        })
        .unwrap();
        assert!(
            !seen_marker.get(),
            "marker existed while tensors were written"
        );
        let files = walk(&out);
        let marker = files
            .iter()
            .find(|f| f.0 == Path::new("COMMITTED"))
            .unwrap();
        assert!(marker.1 > 0);
        for f in &files {
            assert!(marker.2 >= f.2, "{:?} is newer than the marker", f.0);
        }
        assert_eq!(files.len() as u64, summary.shards + 1);
        assert_eq!(summary.bytes, 2_000_000);
    }

    #[test]
    fn small_fraction_target_deepens_the_towers() {
        let base = Plan::new(200_000_000, 0.0).unwrap();
        let same = Plan::new(200_000_000, DEFAULT_SMALL_FRACTION_TARGET).unwrap();
        assert_eq!(base.tower_depth, same.tower_depth);
        let high = Plan::new(200_000_000, 0.70).unwrap();
        assert!(high.small_fraction() >= 0.70);
        assert!(high.tower_depth > base.tower_depth);
        assert_eq!(high.summary().bytes, 200_000_000);
    }

    #[test]
    fn invalid_options_are_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("x");
        let check = |opts: &GenOptions| {
            let err = generate(opts, &|_| {}).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");
        };
        for bad in [-0.1, 1.5, f64::NAN, 0.95] {
            let mut opts = GenOptions::new(&out, 20_000_000);
            opts.small_fraction_target = bad;
            check(&opts);
        }
        for bad in ["", ".", "..", "a/b", "../COMMITTED"] {
            let mut opts = GenOptions::new(&out, 20_000_000);
            opts.marker = Some(bad.to_string());
            check(&opts);
        }
        check(&GenOptions::new(&out, 100));
        assert!(!out.exists(), "nothing is created for invalid options");
    }

    /// A preset plan for `opts` (no I/O).
    fn plan_for(model: Preset, scale: Option<f64>, shards: Option<u64>, total: u64) -> Plan {
        let opts = GenOptions {
            model,
            scale,
            shards,
            ..GenOptions::new("/nonexistent", total)
        };
        Plan::for_options(&opts).unwrap()
    }

    /// Element count of the first tensor whose dotted name ends with
    /// `suffix`.
    fn elems_of(plan: &Plan, suffix: &str) -> u64 {
        let i = plan
            .tensors
            .iter()
            .position(|t| t.fqn().ends_with(suffix))
            .unwrap_or_else(|| panic!("no {suffix}"));
        plan.bytes[i] / ELEM_BYTES
    }

    fn error_of(opts: &GenOptions) -> String {
        let err = preview(opts).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");
        err.to_string()
    }

    #[test]
    fn scale_keeps_counts_ratios_and_the_small_share() {
        // Written to disk at about 2.7 MB.
        let dir = tempfile::tempdir().unwrap();
        let opts = GenOptions {
            model: Preset::Llama7b,
            scale: Some(2e-4),
            ..GenOptions::new(dir.path().join("ckpt"), 0)
        };
        let s = generate(&opts, &|_| {}).unwrap();
        let files = walk(&opts.out);
        assert_eq!(files.len(), 291);
        assert_eq!(s.shards, 291);
        assert_eq!(files.iter().map(|f| f.1).sum::<u64>(), s.bytes);
        // Each tensor is round(S * n) elements, so the total is S times
        // the parameters (within the rounding of 291 tensors).
        let want = 2.0 * 2e-4 * Preset::Llama7b.params() as f64;
        assert!((s.bytes as f64 - want).abs() <= 291.0 * 2.0, "{}", s.bytes);
        // The 2L + 1 norm weights and, this far down, the 4L attention
        // matrices (h^2 * S = 3,355 elements) are under 16 KiB.
        assert_eq!(s.small_shards, 65 + 4 * 32);
        assert_eq!(preview(&opts).unwrap().scale, Some(2e-4));

        // While every matrix stays above 16 KiB (S >= 4.9e-4 for the
        // smallest, h * n_kv * d), the small files are the norms, 22.3 % as
        // at full scale.
        for scale in [1e-3, 0.05, 1.0] {
            let plan = plan_for(Preset::Llama7b, Some(scale), None, 0);
            let q = elems_of(&plan, "layers.0.self_attn.q_proj.weight") as f64;
            let gate = elems_of(&plan, "layers.31.mlp.gate_proj.weight") as f64;
            let ratio = q / gate;
            assert!(
                (ratio / (4096.0 / 11008.0) - 1.0).abs() < 1e-3,
                "{scale}: {ratio}"
            );
            assert_eq!(
                elems_of(&plan, "embed_tokens"),
                elems_of(&plan, "lm_head"),
                "{scale}"
            );
            assert_eq!(plan.small_shards(), 65, "{scale}");
        }
        // Llama-2-70B norms are exactly 16 KiB at full scale, so not small;
        // any smaller scale makes all 2L + 1 of them small.
        assert_eq!(
            plan_for(Preset::Llama70b, Some(1.0), None, 0).small_shards(),
            0
        );
        assert_eq!(
            plan_for(Preset::Llama70b, Some(0.5), None, 0).small_shards(),
            161
        );
        // The multimodal mix stays above 60 % at any scale.
        for (scale, small) in [(1.0, 1_355), (0.5, 1_453), (0.4, 1_487), (1e-4, 2_199)] {
            let plan = plan_for(Preset::Multimodal, Some(scale), None, 0);
            assert_eq!(plan.tensors.len(), 2_201);
            assert_eq!(plan.small_shards(), small, "{scale}");
            assert!(plan.small_fraction() > 0.6, "{scale}");
        }
    }

    #[test]
    fn mm_preset_at_scale_is_the_size_driven_plan_of_1_gib() {
        let sized = Plan::new(1 << 30, DEFAULT_SMALL_FRACTION_TARGET).unwrap();
        let scaled = plan_for(Preset::Multimodal, Some(0.01), None, 0);
        let paths = |p: &Plan| p.tensors.iter().map(Tensor::path).collect::<Vec<_>>();
        assert_eq!(paths(&sized), paths(&scaled));
        assert_eq!(
            (sized.layers, sized.hidden, sized.tower_depth),
            (32, 4096, 32)
        );
    }

    #[test]
    fn preset_sized_in_bytes_is_exact_and_never_above_full_scale() {
        for total in [3_000_000, 3_000_001, 40_000_000] {
            for model in [Preset::Llama7b, Preset::Llama70b] {
                let plan = plan_for(model, None, None, total);
                assert_eq!(plan.summary().bytes, total, "{model}");
                let scale = plan.scale.unwrap();
                assert!(scale > 0.0 && scale < 1.0, "{model}: {scale}");
                // Ratios kept: both embeddings differ only by lm_head's
                // share of the rounding remainder.
                let (e, h) = (elems_of(&plan, "embed_tokens"), elems_of(&plan, "lm_head"));
                assert!(
                    h >= e && h - e <= plan.tensors.len() as u64,
                    "{model}: {e} {h}"
                );
            }
        }
        let full = 2 * Preset::Llama7b.params();
        let plan = plan_for(Preset::Llama7b, None, None, full);
        assert_eq!(plan.scale, Some(1.0));
        let err = error_of(&GenOptions {
            model: Preset::Llama7b,
            ..GenOptions::new("/nonexistent", full + 2)
        });
        assert!(
            err.contains(&(full + 2).to_string()) && err.contains(&full.to_string()),
            "{err}"
        );
    }

    #[test]
    fn shards_give_exactly_n_files_mostly_small() {
        let dir = tempfile::tempdir().unwrap();
        let total = 4_000_000;
        let opts = GenOptions {
            shards: Some(1_500),
            ..GenOptions::new(dir.path().join("ckpt"), total)
        };
        let s = generate(&opts, &|_| {}).unwrap();
        let files = walk(&opts.out);
        assert_eq!(files.len(), 1_500);
        assert_eq!(files.iter().map(|f| f.1).sum::<u64>(), total);
        let small = files.iter().filter(|f| f.1 < SMALL_SHARD_BYTES).count();
        assert!(small * 10 > files.len() * 6, "{small} of {}", files.len());
        assert_eq!(
            (s.shards, s.bytes, s.small_shards),
            (1_500, total, small as u64)
        );

        // The benchmark extremes, planned only: 100,000 files of 100 MB in
        // all, and few large files of a few GB.
        for (model, n, total) in [
            (Preset::Multimodal, MAX_SHARDS, 100_000_000),
            (Preset::Multimodal, 2_000, 5_000_000_000),
            (Preset::Multimodal, 97, 3_000_000),
            (Preset::Llama7b, 100, 3_000_000),
            (Preset::Llama70b, 10_000, 2_000_000_000),
        ] {
            let plan = plan_for(model, None, Some(n), total);
            let s = plan.summary();
            assert_eq!((s.shards, s.bytes), (n, total), "{model} {n} {total}");
            if model == Preset::Multimodal {
                assert!(plan.small_fraction() > 0.6, "{n} {total}: {s:?}");
            }
        }
    }

    #[test]
    fn shards_that_the_size_cannot_meet_are_refused() {
        let opts = |model, n, total| GenOptions {
            model,
            shards: Some(n),
            ..GenOptions::new("/nonexistent", total)
        };
        // Fewer than 2 bytes (one bf16 element) per file.
        let err = error_of(&opts(Preset::Multimodal, 100_000, 150_000));
        assert!(
            err.contains("100000 shards") && err.contains("150000 bytes"),
            "{err}"
        );
        // More bytes than so few files hold at full scale.
        let err = error_of(&opts(Preset::Multimodal, 100, 5_000_000_000));
        assert!(
            err.contains("100 shards") && err.contains("5000000000 bytes"),
            "{err}"
        );
        // The fixed mm tensors alone, close to full scale: 52 % small.
        let err = error_of(&opts(Preset::Multimodal, 25, 1_800_000_000));
        assert!(err.contains("25 shards") && err.contains("60 %"), "{err}");
        // Fewer files than the fixed tensors, more than the limit.
        let err = error_of(&opts(Preset::Llama7b, 2, 1_000_000));
        assert!(
            err.contains("2 shards") && err.contains("between 3"),
            "{err}"
        );
        let err = error_of(&opts(Preset::Llama7b, MAX_SHARDS + 1, 1_000_000_000));
        assert!(err.contains("100001"), "{err}");
        // A scale and a shard count together; scales out of range.
        let err = error_of(&GenOptions {
            scale: Some(0.1),
            ..opts(Preset::Multimodal, 1_000, 10_000_000)
        });
        assert!(err.contains("exclude each other"), "{err}");
        for bad in [0.0, -0.5, 1.5, f64::NAN] {
            let err = error_of(&GenOptions {
                scale: Some(bad),
                ..GenOptions::new("/nonexistent", 0)
            });
            assert!(err.contains("0 < S <= 1"), "{bad}: {err}");
        }
    }

    #[test]
    fn parse_scale_accepts_fractions_up_to_one() {
        for (s, want) in [("0.01", 0.01), ("1", 1.0), ("1e-3", 1e-3), (" 0.5 ", 0.5)] {
            assert_eq!(parse_scale(s), Ok(want), "{s:?}");
        }
        for bad in ["", "0", "-0.1", "1.01", "2", "nan", "inf", "abc", "1/2"] {
            let err = parse_scale(bad).unwrap_err();
            assert!(err.contains(&format!("{bad:?}")), "{bad:?}: {err}");
        }
    }
    #[test]
    fn generate_into_a_store_writes_the_same_files_whole_marker_last() {
        let dir = tempfile::tempdir().unwrap();
        let opts = GenOptions {
            marker: Some("COMMITTED".into()),
            seed: 3,
            ..GenOptions::new(dir.path().join("out"), 6_000_000)
        };
        let local = generate(&opts, &|_| {}).unwrap();
        let out = output::mem::MemOut::default();
        let last = Cell::new(0);
        let remote = generate_into(&opts, &out, &|n| {
            assert!(n >= last.get());
            last.set(n);
        })
        .unwrap();
        assert_eq!(remote, local);
        assert_eq!(last.get(), local.bytes);
        let mem = out.0.borrow();
        let on_disk: Vec<(PathBuf, Vec<u8>)> = walk(&opts.out)
            .into_iter()
            .map(|(rel, _, _)| {
                let bytes = fs::read(opts.out.join(&rel)).unwrap();
                (rel, bytes)
            })
            .collect();
        let stored: Vec<(PathBuf, Vec<u8>)> = mem
            .files
            .iter()
            .map(|(p, b)| (p.clone(), b.clone()))
            .collect();
        assert!(stored == on_disk, "the same files and bytes");
        assert_eq!(
            mem.seen.first(),
            Some(&output::mem::Seen::Remove("COMMITTED".into()))
        );
        assert_eq!(
            mem.seen.last(),
            Some(&output::mem::Seen::Finish("COMMITTED".into()))
        );
    }

    #[test]
    fn generate_into_a_store_completing_files_together_has_them_whole_before_the_marker() {
        let dir = tempfile::tempdir().unwrap();
        let opts = GenOptions {
            marker: Some("COMMITTED".into()),
            seed: 3,
            ..GenOptions::new(dir.path().join("out"), 6_000_000)
        };
        let out = output::mem::MemOut::deferred();
        let summary = generate_into(&opts, &out, &|_| {}).unwrap();
        let mem = out.0.borrow();
        let is_marker = |p: &Path| p == Path::new("COMMITTED");
        assert_eq!(output::mem::unbarriered(&mem.seen, is_marker), None);
        assert!(
            mem.pending.is_empty(),
            "files left incomplete: {:?}",
            mem.pending.len()
        );
        assert_eq!(mem.files.len() as u64, summary.shards + 1);
        // The tensor files are completed together, not one by one.
        let barriers = mem
            .seen
            .iter()
            .filter(|s| **s == output::mem::Seen::Barrier)
            .count();
        assert!(summary.shards > 10 && barriers == 2, "{barriers} barriers");
    }
}
