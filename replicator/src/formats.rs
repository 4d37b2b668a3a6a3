//! Checkpoint format detectors: which framework wrote a checkpoint
//! directory, and whether its commit predicate holds.
//!
//! Everything here is pure: the file-system watcher hands in a
//! [`Snapshot`] of one checkpoint directory (file names, sizes, mtimes,
//! whether each file was closed after its last write, and the bytes of the
//! few small files [`wants_content`] asks for) and reads back a
//! [`Verdict`]. No function in this module touches the file system or a
//! clock, so every rule can be tested with hand-made snapshots.
//!
//! The rules encode docs/CHECKPOINT_FORMATS.md ("Per framework", "Format
//! checks that need no framework", "Publish rule"); each function names the
//! framework behaviour it relies on.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;

use ferry_proto::paths::is_temporary;
use serde::{Deserialize, Serialize};

/// Largest file, in bytes, whose content the watcher reads for
/// [`verdict`] (1 MiB). Markers and trackers are far smaller; a JSON
/// marker above this size is judged without its content (see [`verdict`]).
pub const MAX_CONTENT: u64 = 1 << 20;

/// A checkpoint format. The config names are those of [`fmt::Display`]
/// and [`FromStr`]; `"auto"` in the config means "call [`recognise`]" and
/// is not a variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Format {
    /// PyTorch DCP (`torch.distributed.checkpoint.save`): `__{rank}_{k}.distcp`
    /// and `.metadata` (`"dcp"`).
    #[serde(rename = "dcp")]
    Dcp,
    /// torchtitan `checkpoint/step-N/`, holding DCP or HF safetensors
    /// (`"torchtitan"`).
    #[serde(rename = "torchtitan")]
    Torchtitan,
    /// Megatron-LM legacy `iter_%07d/mp_rank_*/model_optim_rng.pt` with the
    /// tracker `latest_checkpointed_iteration.txt` (`"megatron"`).
    #[serde(rename = "megatron")]
    MegatronLegacy,
    /// Megatron core `torch_dist`: DCP files plus `metadata.json`
    /// (`"megatron_dist"`).
    #[serde(rename = "megatron_dist")]
    MegatronDist,
    /// DeepSpeed `global_stepN/` with the root tag file `latest`
    /// (`"deepspeed"`).
    #[serde(rename = "deepspeed")]
    DeepSpeed,
    /// Hugging Face `save_pretrained`: safetensors shards and
    /// `model.safetensors.index.json` (`"hf"`).
    #[serde(rename = "hf")]
    HfPretrained,
    /// Hugging Face Trainer `checkpoint-N/` with `trainer_state.json`
    /// (`"hf_trainer"`).
    #[serde(rename = "hf_trainer")]
    HfTrainer,
    /// NeMo 2 `<name>/weights/` (torch_dist) + `context/`, with a sibling
    /// `<name>-unfinished` marker while saving (`"nemo"`).
    #[serde(rename = "nemo")]
    Nemo,
    /// Orbax `<step>.orbax-checkpoint-tmp[-ts]/` renamed to `<step>/`, or
    /// `<step>/commit_success.txt` (`"orbax"`).
    #[serde(rename = "orbax")]
    Orbax,
    /// ByteCheckpoint `global_step_N/{model,optimizer,extra_state}/`
    /// (`"bytecheckpoint"`).
    #[serde(rename = "bytecheckpoint")]
    ByteCheckpoint,
    /// Any directory committed by a configured marker file name
    /// (`"generic"`); never recognised automatically.
    #[serde(rename = "generic")]
    Generic,
}

/// The config names of all formats, in [`Format::ALL`] order, for error
/// messages.
const FORMAT_NAMES: &str = "dcp, torchtitan, megatron, megatron_dist, deepspeed, hf, hf_trainer, \
                            nemo, orbax, bytecheckpoint, generic";

impl Format {
    /// Every format, in declaration order.
    pub const ALL: [Format; 11] = [
        Format::Dcp,
        Format::Torchtitan,
        Format::MegatronLegacy,
        Format::MegatronDist,
        Format::DeepSpeed,
        Format::HfPretrained,
        Format::HfTrainer,
        Format::Nemo,
        Format::Orbax,
        Format::ByteCheckpoint,
        Format::Generic,
    ];

    /// The config name (`"dcp"`, `"megatron_dist"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Format::Dcp => "dcp",
            Format::Torchtitan => "torchtitan",
            Format::MegatronLegacy => "megatron",
            Format::MegatronDist => "megatron_dist",
            Format::DeepSpeed => "deepspeed",
            Format::HfPretrained => "hf",
            Format::HfTrainer => "hf_trainer",
            Format::Nemo => "nemo",
            Format::Orbax => "orbax",
            Format::ByteCheckpoint => "bytecheckpoint",
            Format::Generic => "generic",
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A format name that is not one of [`Format::ALL`]'s config names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown checkpoint format {0:?}: expected one of {FORMAT_NAMES}, \
     or \"auto\" to recognise it from the layout"
)]
pub struct UnknownFormat(pub String);

impl FromStr for Format {
    type Err = UnknownFormat;

    /// Parses a config name exactly (`"dcp"`, `"hf_trainer"`, ...).
    /// `"auto"` is refused here: it is the absence of a format, handled by
    /// the caller with [`recognise`].
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Format::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| UnknownFormat(s.to_string()))
    }
}

/// One file of a checkpoint directory (or of its source root) as the
/// watcher sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileState {
    /// Path relative to the checkpoint directory, `/`-separated (for a
    /// sibling: its name in the source root).
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// Modification time, nanoseconds since the Unix epoch.
    pub mtime_ns: i64,
    /// Closed after its last write (inotify `IN_CLOSE_WRITE` with no later
    /// write), or, in poll mode, size and mtime unchanged for the quiet
    /// period and [`content_check`] passed (CHECKPOINT_FORMATS.md, "Three
    /// facts": a name appearing proves nothing).
    pub complete: bool,
    /// The file's bytes, filled by the watcher only when
    /// [`wants_content`] is true for it and `size <= MAX_CONTENT`.
    pub content: Option<Vec<u8>>,
}

/// What a detector sees of one checkpoint directory and its surroundings.
#[derive(Debug, Clone, Copy)]
pub struct Snapshot<'a> {
    /// The checkpoint directory's name relative to the source root: each
    /// immediate subdirectory of a source root is one checkpoint
    /// (`global_step100`, `iter_0000200`, `checkpoint-500`,
    /// `step_00000002`, `5.orbax-checkpoint-tmp-1234`, ...).
    pub dir: &'a str,
    /// Every regular file under the directory, recursively, temporaries
    /// included.
    pub files: &'a [FileState],
    /// Regular files directly in the source root: DeepSpeed `latest`,
    /// Megatron `latest_checkpointed_iteration.txt`, NeMo
    /// `<name>-unfinished`; content filled per [`wants_content`].
    pub siblings: &'a [FileState],
    /// Names of the other immediate subdirectories of the source root.
    pub sibling_dirs: &'a [String],
}

/// The state of one checkpoint directory according to its format.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Verdict {
    /// Still being written, or not yet recognisably complete.
    Open,
    /// The format's commit predicate holds: marker present and, where
    /// CHECKPOINT_FORMATS.md says so, the expected file set complete.
    Committed {
        /// Files of the checkpoint directory that are commit markers, in
        /// the order the framework writes them (CHECKPOINT_FORMATS.md
        /// "Publish rule" item 4); the sink publishes them last, in this
        /// order. Paths relative to the directory. Empty when the commit
        /// lives outside the directory (DeepSpeed `latest`, the Megatron
        /// tracker, an Orbax directory rename, NeMo's `-unfinished`
        /// removal).
        markers: Vec<String>,
        /// Commit identity, an opaque string that changes when the same
        /// directory is committed again (a re-save): the markers' path,
        /// size and mtime, or, without markers in the directory, the count,
        /// total size and newest mtime of its files.
        identity: String,
    },
    /// The writer gave up, for a reason visible in the snapshot alone
    /// (a tracker moved past this step while it is incomplete, an Orbax
    /// temporary directory outlived a newer commit, ...). Holds the reason.
    /// The idle timeout is the watcher's job, not this module's.
    Abandoned(String),
}

// ---------------------------------------------------------------------
// Names
// ---------------------------------------------------------------------

/// The last `/`-separated component of `path`.
fn file_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// True if any component of `path` is a temporary name
/// ([`ferry_proto::paths::is_temporary`], CHECKPOINT_FORMATS.md "Publish rule"
/// item 2): such files are never part of a checkpoint's file set.
fn is_temp_path(path: &str) -> bool {
    path.split('/').any(is_temporary)
}

/// Parses a non-empty string of ASCII digits.
fn digits(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// True if `name` is `prefix` followed by one or more digits.
fn is_prefixed_number(name: &str, prefix: &str) -> bool {
    name.strip_prefix(prefix).and_then(digits).is_some()
}

/// The training step of a checkpoint directory name, or `None`.
///
/// Rules, in order:
/// 1. Orbax temporaries `<name>.orbax-checkpoint-tmp[-ts]` take the step
///    of `<name>` (Orbax `step_name_format`): `5.orbax-checkpoint-tmp-123`
///    is step 5.
/// 2. NeMo names carry `step=N` among other `key=value` fields
///    (`model--step=99-consumed_samples=1600.0`): the digits after the last
///    `step=`.
/// 3. Otherwise the trailing ASCII digits: `global_step100` (DeepSpeed),
///    `iter_0000200` (Megatron), `checkpoint-500` (HF Trainer), `step-3`
///    (torchtitan), `step_00000002`, `global_step_7` (ByteCheckpoint), `5`
///    (Orbax).
///
/// `None` when no digits apply (`release`) or the number exceeds `u64`.
pub fn step_of(dir: &str) -> Option<u64> {
    let name = file_name(dir);
    let name = match name.find(".orbax-checkpoint-tmp") {
        Some(i) => &name[..i],
        None => name,
    };
    if let Some(i) = name.rfind("step=") {
        let rest = &name[i + "step=".len()..];
        let end = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        if let Some(n) = digits(&rest[..end]) {
            return Some(n);
        }
    }
    let start = name
        .rfind(|c: char| !c.is_ascii_digit())
        .map_or(0, |i| i + 1);
    digits(&name[start..])
}

// ---------------------------------------------------------------------
// Snapshot helpers
// ---------------------------------------------------------------------

/// The content of a marker or tracker as far as the snapshot shows it.
enum Content<'a> {
    /// Complete and read: the bytes.
    Ready(&'a [u8]),
    /// Complete but larger than [`MAX_CONTENT`], so never read.
    TooLarge,
    /// Still being written, or not read yet: look again later
    /// (CHECKPOINT_FORMATS.md "Three facts" item 2: a half-written marker
    /// is re-read, never declared corrupt).
    Pending,
}

fn content_of(f: &FileState) -> Content<'_> {
    if !f.complete {
        return Content::Pending;
    }
    match &f.content {
        Some(bytes) => Content::Ready(bytes),
        None if f.size > MAX_CONTENT => Content::TooLarge,
        None => Content::Pending,
    }
}

/// The trimmed UTF-8 text of a complete, read tracker file.
fn tracker_text(f: Option<&FileState>) -> Option<&str> {
    match content_of(f?) {
        Content::Ready(bytes) => std::str::from_utf8(bytes).ok().map(str::trim),
        Content::TooLarge | Content::Pending => None,
    }
}

impl<'a> Snapshot<'a> {
    /// The file at `path` (relative to the directory).
    fn file(&self, path: &str) -> Option<&'a FileState> {
        self.files.iter().find(|f| f.path == path)
    }

    /// The sibling file named `name` in the source root.
    fn sibling(&self, name: &str) -> Option<&'a FileState> {
        self.siblings.iter().find(|f| f.path == name)
    }

    /// Files that belong to the checkpoint's file set (not temporaries).
    fn data_files(&self) -> impl Iterator<Item = &'a FileState> {
        self.files.iter().filter(|f| !is_temp_path(&f.path))
    }

    /// Files directly in the checkpoint directory (no `/` in the path).
    fn root_files(&self) -> impl Iterator<Item = &'a FileState> {
        self.files.iter().filter(|f| !f.path.contains('/'))
    }

    /// True when no write is in flight: every data file is complete, and
    /// so is every temporary (a temporary still open means the writer is
    /// active, e.g. a safetensors `.tmpXXXXXX` shard or `.metadata.tmp`;
    /// one left complete by a crash is ignored). CHECKPOINT_FORMATS.md
    /// "Three facts" item 3: a marker may land before other ranks finish.
    fn quiescent(&self) -> bool {
        self.files.iter().all(|f| f.complete)
    }

    /// A file named `.metadata.tmp` anywhere in the directory: DCP (and
    /// ByteCheckpoint) write `.metadata` under this name and rename it, so
    /// its presence means a commit is in progress or was left behind.
    fn has_metadata_tmp(&self) -> bool {
        self.files
            .iter()
            .any(|f| file_name(&f.path) == ".metadata.tmp")
    }

    /// Identity of a commit whose markers are `markers`: each marker's
    /// path, size and mtime.
    fn marker_identity(&self, markers: &[String]) -> String {
        markers
            .iter()
            .filter_map(|m| self.file(m))
            .map(|f| format!("{}:{}:{}", f.path, f.size, f.mtime_ns))
            .collect::<Vec<_>>()
            .join(";")
    }

    /// Identity of a commit without markers in the directory: number of
    /// data files, their total size and the newest mtime. A re-save into
    /// the same directory rewrites the files, so the newest mtime moves.
    fn set_identity(&self) -> String {
        let (mut n, mut bytes, mut newest) = (0u64, 0u64, i64::MIN);
        for f in self.data_files() {
            n += 1;
            bytes = bytes.saturating_add(f.size);
            newest = newest.max(f.mtime_ns);
        }
        format!("files:{n}:{bytes}:{newest}")
    }

    /// `Committed` with `markers` and their identity.
    fn committed(&self, markers: Vec<String>) -> Verdict {
        let identity = if markers.is_empty() {
            self.set_identity()
        } else {
            self.marker_identity(&markers)
        };
        Verdict::Committed { markers, identity }
    }
}

/// True if `tuples` (all of one length) fill the box `0..=max` in every
/// dimension: no rank below the highest one seen is missing. A rank above
/// the highest seen cannot be detected from names alone.
fn full_grid(tuples: &BTreeSet<Vec<u64>>) -> bool {
    let Some(first) = tuples.iter().next() else {
        return false;
    };
    let dims = first.len();
    if tuples.iter().any(|t| t.len() != dims) {
        return false;
    }
    let mut cells: u128 = 1;
    for d in 0..dims {
        let max = tuples.iter().map(|t| t[d]).max().unwrap_or(0);
        cells = cells.saturating_mul(u128::from(max) + 1);
    }
    // The tuples are distinct and inside the box, so they fill it exactly
    // when there are as many as the box has cells.
    tuples.len() as u128 == cells
}

/// Parses `a_b_c` (after a prefix) into numbers, e.g. the `TT_PPP_EEE` of
/// Megatron's `mp_rank_TT_PPP_EEE`.
fn rank_tuple(s: &str) -> Option<Vec<u64>> {
    s.split('_').map(digits).collect()
}

/// Parses JSON, `None` if it does not parse (yet).
fn json(bytes: &[u8]) -> Option<serde_json::Value> {
    serde_json::from_slice(bytes).ok()
}

/// True if `f` is a complete Megatron `metadata.json` that parses and
/// names its `sharded_backend` (Megatron core `dist_checkpointing.save`
/// writes it after the strategy saved every shard).
fn megatron_metadata_json_ok(f: Option<&FileState>) -> bool {
    let Some(f) = f else { return false };
    match content_of(f) {
        Content::Ready(bytes) => json(bytes).is_some_and(|v| v.get("sharded_backend").is_some()),
        Content::TooLarge | Content::Pending => false,
    }
}

// ---------------------------------------------------------------------
// recognise
// ---------------------------------------------------------------------

/// Recognises a format from the layout (config `format = "auto"`), or
/// `None` until the layout says something (an empty directory, only
/// `config.json`, only a `.tmpXXXXXX`). [`Format::Generic`] is never
/// recognised: it needs a configured marker name.
///
/// Checks run in this order; the first that matches wins:
/// 1. **Orbax**: name contains `.orbax-checkpoint-tmp`, or a
///    `commit_success.txt`, `_CHECKPOINT_METADATA`, `manifest.ocdbt` or
///    item `_METADATA` file. First because an Orbax temporary directory is
///    recognisable by name before any file exists.
/// 2. **NeMo 2**: files under both `weights/` and `context/`, or under
///    `weights/` with a sibling `<dir>-unfinished`. Before the DCP checks
///    because `weights/` itself is torch_dist.
/// 3. **ByteCheckpoint**: `model/.metadata` or `model/*.distcp` together
///    with `optimizer/` or `extra_state/`, or any file in a directory named
///    `global_step_N` (DeepSpeed's `global_stepN` has no underscore).
/// 4. **HF Trainer**: `trainer_state.json`, `training_args.bin`,
///    `scheduler.pt` or `rng_state*.pth` at the top, or any file in a
///    directory named `checkpoint-N`. Before DCP and DeepSpeed because the
///    Trainer nests their layouts (`pytorch_model_fsdp_0/`, `global_stepN/`).
/// 5. **Megatron legacy**: `mp_rank_*/model_optim_rng.pt` or
///    `mp_rank_*/distrib_optim.pt`.
/// 6. **DCP family**, when `.metadata`, `.metadata.tmp` or `*.distcp` is at
///    the top: Megatron torch_dist if the name is `iter_NNNNNNN`, or
///    `common.pt` is present, or `metadata.json` is present and does not
///    parse as JSON without `sharded_backend` (a half-written one counts:
///    plain DCP never writes it); else torchtitan if the name is `step-N`;
///    else DCP.
/// 7. **DeepSpeed**: `*model_states.pt` or `*optim_states.pt` at the top.
/// 8. **torchtitan** (HF variant): name `step-N` with a `*.safetensors` or
///    `model.safetensors.index.json` at the top.
/// 9. **HF `save_pretrained`**: `*.safetensors`,
///    `model.safetensors.index.json` or `pytorch_model.bin.index.json` at
///    the top.
pub fn recognise(s: &Snapshot<'_>) -> Option<Format> {
    let has = |pred: &dyn Fn(&str) -> bool| s.files.iter().any(|f| pred(&f.path));
    let top = |pred: &dyn Fn(&str) -> bool| s.root_files().any(|f| pred(&f.path));
    let name = file_name(s.dir);

    // 1. Orbax.
    if name.contains(".orbax-checkpoint-tmp")
        || has(&|p| {
            let n = file_name(p);
            p == "commit_success.txt"
                || p == "_CHECKPOINT_METADATA"
                || n == "manifest.ocdbt"
                || (p.contains('/') && n == "_METADATA")
        })
    {
        return Some(Format::Orbax);
    }
    // 2. NeMo 2.
    let in_weights = has(&|p| p.starts_with("weights/"));
    let unfinished = format!("{name}-unfinished");
    if in_weights
        && (has(&|p| p.starts_with("context/"))
            || s.sibling(&unfinished).is_some()
            || s.sibling_dirs.contains(&unfinished))
    {
        return Some(Format::Nemo);
    }
    // 3. ByteCheckpoint.
    let model_dcp =
        has(&|p| p == "model/.metadata" || (p.starts_with("model/") && p.ends_with(".distcp")));
    if (model_dcp && has(&|p| p.starts_with("optimizer/") || p.starts_with("extra_state/")))
        || (is_prefixed_number(name, "global_step_") && !s.files.is_empty())
    {
        return Some(Format::ByteCheckpoint);
    }
    // 4. HF Trainer.
    if top(&|p| {
        p == "trainer_state.json"
            || p == "training_args.bin"
            || p == "scheduler.pt"
            || (p.starts_with("rng_state") && p.ends_with(".pth"))
    }) || (is_prefixed_number(name, "checkpoint-") && !s.files.is_empty())
    {
        return Some(Format::HfTrainer);
    }
    // 5. Megatron legacy.
    if has(&|p| {
        p.split_once('/').is_some_and(|(d, f)| {
            d.starts_with("mp_rank_") && (f == "model_optim_rng.pt" || f == "distrib_optim.pt")
        })
    }) {
        return Some(Format::MegatronLegacy);
    }
    // 6. DCP family.
    if top(&|p| p == ".metadata" || p == ".metadata.tmp" || p.ends_with(".distcp")) {
        let metadata_json_says_megatron =
            s.file("metadata.json").is_some_and(|f| match &f.content {
                Some(bytes) => json(bytes).is_none_or(|v| v.get("sharded_backend").is_some()),
                None => true,
            });
        if is_iter_dir(name) || s.file("common.pt").is_some() || metadata_json_says_megatron {
            return Some(Format::MegatronDist);
        }
        if is_prefixed_number(name, "step-") {
            return Some(Format::Torchtitan);
        }
        return Some(Format::Dcp);
    }
    // 7. DeepSpeed.
    if top(&|p| p.ends_with("model_states.pt") || p.ends_with("optim_states.pt")) {
        return Some(Format::DeepSpeed);
    }
    let hf_files = |p: &str| {
        p.ends_with(".safetensors")
            || p == "model.safetensors.index.json"
            || p == "pytorch_model.bin.index.json"
    };
    // 8. torchtitan, HF variant.
    if is_prefixed_number(name, "step-") && top(&hf_files) {
        return Some(Format::Torchtitan);
    }
    // 9. HF save_pretrained.
    if top(&hf_files) {
        return Some(Format::HfPretrained);
    }
    None
}

/// Megatron's `iter_%07d` directory name (at least 7 digits).
fn is_iter_dir(name: &str) -> bool {
    name.strip_prefix("iter_")
        .is_some_and(|d| d.len() >= 7 && digits(d).is_some())
}

// ---------------------------------------------------------------------
// verdict
// ---------------------------------------------------------------------

/// The commit predicate of `format` on snapshot `s`, per
/// CHECKPOINT_FORMATS.md "Per framework" (each rule is documented on its
/// private helper below and summarised here).
///
/// Common to every format except an Orbax final directory: a `Committed`
/// verdict also needs every file in the directory complete (data files
/// and any temporary still being written), because a marker may land
/// before other ranks finish (DeepSpeed `latest`, HF `trainer_state.json`;
/// "Three facts" item 3). Temporaries ([`ferry_proto::paths::is_temporary`] on
/// any path component) are not part of the file set.
///
/// - `Dcp`: `.metadata` complete, no `.metadata.tmp`. Markers
///   `[".metadata"]`.
/// - `Torchtitan`: the DCP rule when `.metadata`, `.metadata.tmp` or a
///   `.distcp` is at the top, else the `HfPretrained` rule.
/// - `MegatronLegacy`: tracker `latest_checkpointed_iteration.txt` (a
///   sibling) says N (or `release`), or a later step, and every
///   `mp_rank_*` directory holds a non-empty `model_optim_rng.pt` (and
///   `distrib_optim.pt` in all of them if in any), the ranks forming a full
///   TP x PP (x EP) grid. Markers `[]`: the tracker lives beside the
///   directory and the sink writes its own. Tracker past N while
///   incomplete: `Abandoned`.
/// - `MegatronDist`: `.metadata` complete, no `.metadata.tmp`,
///   `metadata.json` parses with `sharded_backend`. Markers `[".metadata",
///   "metadata.json", "integrity.json" if present]`. Tracker past N while
///   not committed: `Abandoned`.
/// - `DeepSpeed`: sibling `latest` == the directory name (or a tag with a
///   later step), at least one `*model_states.pt`, no 0-byte file, and the
///   `zero_pp_rank_D_mp_rank_XX_*` files of each kind forming a full D x XX
///   grid. Markers `[]` (`latest` is a sibling). `latest` past N while
///   incomplete: `Abandoned`.
/// - `HfPretrained`: `model.safetensors.index.json` (or
///   `pytorch_model.bin.index.json`) parses and every shard in its
///   `weight_map` is present and complete (markers `[index]`); or, without
///   an index, a complete `model.safetensors` / `pytorch_model.bin`
///   (markers `[]`). A half-written index is `Open`.
/// - `HfTrainer`: `trainer_state.json` parses with `global_step` == the N
///   of the name, `rng_state_{i}.pth` ranks contiguous from 0, and the
///   `HfPretrained` rule if an index is present. Markers `[index if
///   present, "trainer_state.json"]`.
/// - `Nemo`: while `<dir>-unfinished` exists (sibling file or directory):
///   `Open`, or `Abandoned` if a sibling with a later `step=` and no marker
///   of its own exists. Once it is gone: `weights/` committed as
///   torch_dist. Markers `["weights/.metadata", "weights/metadata.json"]`.
/// - `Orbax`: a `<step>.orbax-checkpoint-tmp*` name is `Open`, or
///   `Abandoned` once a sibling with the same prefix and a later step
///   exists; a final name is `Committed` (the rename is the commit;
///   completeness flags are not required because files moved in by a
///   directory rename may never show a close) with markers `[]`, unless a
///   `commit_success.txt` is present, which must then be complete (markers
///   `["commit_success.txt"]`).
/// - `ByteCheckpoint`: `model/.metadata` complete, `optimizer/.metadata`
///   complete if `optimizer/` exists, no `.metadata.tmp`, the
///   `extra_state_rank_{r}.pt` ranks contiguous from 0. Markers
///   `["optimizer/.metadata" if present, "model/.metadata"]`.
/// - `Generic`: a configured name from `generic_markers` (a file at the
///   top of the directory) present and complete. Markers: the configured
///   names present, in configured order.
///
/// A JSON marker larger than [`MAX_CONTENT`] is never read: a large
/// `trainer_state.json` is then accepted on completeness alone, and a large
/// safetensors index falls back to the shard names
/// (`*-0000i-of-0000n.safetensors` all present for i in 1..=n).
///
/// Limits: a rank whose file has not been created at all, above the
/// highest rank seen, is invisible in a snapshot (DeepSpeed writes `latest`
/// before its final barrier). Whether a sibling directory committed is
/// unknown here, so "a newer sibling committed" is only used where names
/// prove it (Orbax, NeMo).
pub fn verdict(format: Format, s: &Snapshot<'_>, generic_markers: &[String]) -> Verdict {
    match format {
        Format::Dcp => dcp(s),
        Format::Torchtitan => {
            if has_top_dcp(s) {
                dcp(s)
            } else {
                hf_pretrained(s)
            }
        }
        Format::MegatronLegacy => megatron_legacy(s),
        Format::MegatronDist => megatron_dist(s),
        Format::DeepSpeed => deepspeed(s),
        Format::HfPretrained => hf_pretrained(s),
        Format::HfTrainer => hf_trainer(s),
        Format::Nemo => nemo(s),
        Format::Orbax => orbax(s),
        Format::ByteCheckpoint => bytecheckpoint(s),
        Format::Generic => generic(s, generic_markers),
    }
}

/// DCP content at the top of the directory.
fn has_top_dcp(s: &Snapshot<'_>) -> bool {
    s.root_files()
        .any(|f| f.path == ".metadata" || f.path == ".metadata.tmp" || f.path.ends_with(".distcp"))
}

/// PyTorch DCP: rank 0 writes `.metadata.tmp`, fsyncs, closes and renames
/// it to `.metadata` only after every rank closed its `__r_k.distcp`
/// (`FileSystemWriter.finish`; fixtures/dcp trace). A `.metadata.tmp`
/// beside an old `.metadata` is a re-save about to commit: `Open`.
fn dcp(s: &Snapshot<'_>) -> Verdict {
    match s.file(".metadata") {
        Some(m) if m.complete && !s.has_metadata_tmp() && s.quiescent() => {
            s.committed(vec![".metadata".into()])
        }
        _ => Verdict::Open,
    }
}

/// What a step tracker beside the checkpoint directories says about this
/// one.
#[derive(PartialEq, Eq)]
enum Tracker {
    /// Names this checkpoint.
    Here,
    /// Names a later step: the writer moved on.
    Past,
    /// Absent, unread, still being written, or naming an earlier step.
    Unknown,
}

/// Compares the tracker sibling `name` with the directory. `Here` when
/// its text equals the directory name (DeepSpeed tag, Megatron `release`)
/// or, with `by_step`, names the directory's step (Megatron writes the bare
/// iteration number); `Past` when it names a later step.
fn tracker(s: &Snapshot<'_>, name: &str, by_step: bool) -> Tracker {
    let Some(text) = tracker_text(s.sibling(name)) else {
        return Tracker::Unknown;
    };
    let dir = file_name(s.dir);
    if text == dir {
        return Tracker::Here;
    }
    let theirs = digits(text).or_else(|| step_of(text));
    match (theirs, step_of(dir)) {
        (Some(t), Some(mine)) if by_step && t == mine => Tracker::Here,
        (Some(t), Some(mine)) if t > mine => Tracker::Past,
        _ => Tracker::Unknown,
    }
}

/// Megatron's tracker file, written by rank 0 after the save's final
/// barrier (Megatron-LM `save_checkpoint`).
const MEGATRON_TRACKER: &str = "latest_checkpointed_iteration.txt";

/// Megatron legacy: tracker == N and every TP x PP rank directory holds a
/// complete file. The tracker is written after all ranks finished, and
/// only moves past N after N's save returned, so a complete set with the
/// tracker past N is still committed (its identity does not depend on the
/// tracker, so a commit seen earlier keeps its identity).
fn megatron_legacy(s: &Snapshot<'_>) -> Verdict {
    let tracker = tracker(s, MEGATRON_TRACKER, true);
    let mut ranks: BTreeMap<&str, (Option<&FileState>, Option<&FileState>)> = BTreeMap::new();
    for f in s.data_files() {
        if let Some((d, rest)) = f.path.split_once('/') {
            if d.starts_with("mp_rank_") {
                let e = ranks.entry(d).or_default();
                match rest {
                    "model_optim_rng.pt" => e.0 = Some(f),
                    "distrib_optim.pt" => e.1 = Some(f),
                    _ => {}
                }
            }
        }
    }
    let any_distrib = ranks.values().any(|r| r.1.is_some());
    let tuples: Option<BTreeSet<Vec<u64>>> = ranks
        .keys()
        .map(|d| rank_tuple(&d["mp_rank_".len()..]))
        .collect();
    let complete = s.quiescent()
        && !ranks.is_empty()
        && ranks.values().all(|(model, distrib)| {
            model.is_some_and(|f| f.size > 0)
                && (!any_distrib || distrib.is_some_and(|f| f.size > 0))
        })
        && tuples.is_some_and(|t| full_grid(&t));
    match tracker {
        Tracker::Here | Tracker::Past if complete => s.committed(Vec::new()),
        Tracker::Past => Verdict::Abandoned(format!(
            "{MEGATRON_TRACKER} moved past {} while it is incomplete",
            s.dir
        )),
        _ => Verdict::Open,
    }
}

/// Megatron core torch_dist: `.metadata` (DCP, after all ranks) and a
/// parsable `metadata.json` (written last by `dist_checkpointing.save`);
/// the tracker == N only confirms. `integrity.json` is a marker too when
/// present (CHECKPOINT_FORMATS.md "Publish rule": `.metadata`,
/// `metadata.json`, `integrity.json`, then the tracker).
fn megatron_dist(s: &Snapshot<'_>) -> Verdict {
    if let Some(markers) = torch_dist_markers(s, "") {
        let mut markers = markers;
        if s.file("integrity.json").is_some() {
            markers.push("integrity.json".into());
        }
        return s.committed(markers);
    }
    if tracker(s, MEGATRON_TRACKER, true) == Tracker::Past {
        return Verdict::Abandoned(format!(
            "{MEGATRON_TRACKER} moved past {} before it committed",
            s.dir
        ));
    }
    Verdict::Open
}

/// The torch_dist commit predicate under `prefix` (`""` or `"weights/"`):
/// `.metadata` complete, no `.metadata.tmp`, `metadata.json` with
/// `sharded_backend`, nothing in flight. Returns the two markers.
fn torch_dist_markers(s: &Snapshot<'_>, prefix: &str) -> Option<Vec<String>> {
    let metadata = format!("{prefix}.metadata");
    let metadata_json = format!("{prefix}metadata.json");
    let ok = s.file(&metadata).is_some_and(|f| f.complete)
        && s.file(&format!("{prefix}.metadata.tmp")).is_none()
        && megatron_metadata_json_ok(s.file(&metadata_json))
        && s.quiescent();
    ok.then(|| vec![metadata, metadata_json])
}

/// DeepSpeed: rank 0 writes `latest` (the tag) *before* the final
/// barrier, so the file set must be complete too: at least one
/// `*model_states.pt`, no 0-byte file, and for every kind of ZeRO file
/// (`[bf16_]zero_pp_rank_D_mp_rank_XX_{optim,model}_states.pt`) the ranks
/// D x XX form a full grid. `latest` naming a later tag while this set is
/// incomplete: `Abandoned`.
fn deepspeed(s: &Snapshot<'_>) -> Verdict {
    let tracker = tracker(s, "latest", false);
    let mut has_model = false;
    let mut zero: BTreeMap<String, BTreeSet<Vec<u64>>> = BTreeMap::new();
    let mut names_ok = true;
    for f in s.data_files().filter(|f| !f.path.contains('/')) {
        let n = f.path.as_str();
        has_model |= n.ends_with("model_states.pt");
        if let Some(i) = n.find("zero_pp_rank_") {
            let rest = &n[i + "zero_pp_rank_".len()..];
            let parsed = rest.split_once("_mp_rank_").and_then(|(d, tail)| {
                let (xx, kind) = tail.split_once('_')?;
                Some((digits(d)?, digits(xx)?, kind))
            });
            match parsed {
                Some((d, xx, kind)) => {
                    zero.entry(format!("{}{kind}", &n[..i]))
                        .or_default()
                        .insert(vec![d, xx]);
                }
                None => names_ok = false,
            }
        }
    }
    let complete = s.quiescent()
        && has_model
        && names_ok
        && s.data_files().all(|f| f.size > 0)
        && zero.values().all(full_grid);
    match tracker {
        Tracker::Here | Tracker::Past if complete => s.committed(Vec::new()),
        Tracker::Past => Verdict::Abandoned(format!(
            "latest moved past {} while it is incomplete",
            s.dir
        )),
        _ => Verdict::Open,
    }
}

/// The HF index file names: safetensors (transformers default) and the
/// older `torch.save` shards (`safe_serialization=False`).
const HF_INDEXES: [&str; 2] = [
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
];

/// HF `save_pretrained`: the index is written last and in place (fixtures
/// safetensors trace), so it counts once it is closed, parses, and every
/// shard of its `weight_map` is present and complete. Without an index, a
/// single complete `model.safetensors` (or `pytorch_model.bin`) is the
/// whole model.
fn hf_pretrained(s: &Snapshot<'_>) -> Verdict {
    match hf_model_markers(s) {
        Some(markers) if s.quiescent() => s.committed(markers),
        _ => Verdict::Open,
    }
}

/// The HF model commit predicate without the quiescence check: `Some`
/// with the index marker (or no marker for a single file), `None` while
/// open.
fn hf_model_markers(s: &Snapshot<'_>) -> Option<Vec<String>> {
    let Some(index) = HF_INDEXES.iter().find_map(|n| s.file(n)) else {
        let single = ["model.safetensors", "pytorch_model.bin"]
            .iter()
            .find_map(|n| s.file(n))?;
        return (single.complete && single.size > 0).then(Vec::new);
    };
    let shards_ok = match content_of(index) {
        Content::Ready(bytes) => {
            let value = json(bytes)?;
            let map = value.get("weight_map")?.as_object()?;
            let shards: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
            !shards.is_empty()
                && map.values().all(serde_json::Value::is_string)
                && shards
                    .iter()
                    .all(|n| s.file(n).is_some_and(|f| f.complete && !is_temp_path(n)))
        }
        Content::TooLarge => shards_by_name_complete(s),
        Content::Pending => false,
    };
    shards_ok.then(|| vec![index.path.clone()])
}

/// Fallback when the index is too large to read: every
/// `<prefix>-0000i-of-0000n.<ext>` at the top is complete and, for each
/// (prefix, n), all of 1..=n are present (transformers' shard naming).
fn shards_by_name_complete(s: &Snapshot<'_>) -> bool {
    let mut groups: BTreeMap<(String, u64), BTreeSet<u64>> = BTreeMap::new();
    for f in s.data_files().filter(|f| !f.path.contains('/')) {
        let Some(stem) = f
            .path
            .strip_suffix(".safetensors")
            .or_else(|| f.path.strip_suffix(".bin"))
        else {
            continue;
        };
        let Some((head, total)) = stem.rsplit_once("-of-") else {
            continue;
        };
        let Some((prefix, i)) = head.rsplit_once('-') else {
            continue;
        };
        if let (Some(i), Some(total)) = (digits(i), digits(total)) {
            if !f.complete {
                return false;
            }
            groups
                .entry((prefix.to_string(), total))
                .or_default()
                .insert(i);
        }
    }
    !groups.is_empty()
        && groups
            .iter()
            .all(|((_, total), seen)| (1..=*total).all(|i| seen.contains(&i)))
}

/// HF Trainer: `trainer_state.json` can land before other ranks'
/// `rng_state_{i}.pth` ("Three facts" item 3), so besides `global_step ==
/// N` every file must be complete and the rng ranks contiguous from 0. A
/// model index, if present, must commit as for `save_pretrained` (the
/// Trainer may also hold FSDP or DeepSpeed subdirectories, which are only
/// checked for completeness).
fn hf_trainer(s: &Snapshot<'_>) -> Verdict {
    let Some(state) = s.file("trainer_state.json") else {
        return Verdict::Open;
    };
    let state_ok = match content_of(state) {
        Content::Ready(bytes) => json(bytes).is_some_and(|v| {
            let step = v.get("global_step").and_then(serde_json::Value::as_u64);
            match (step, step_of(s.dir)) {
                (Some(got), Some(want)) => got == want,
                (Some(_), None) => true,
                (None, _) => false,
            }
        }),
        Content::TooLarge => true,
        Content::Pending => false,
    };
    let mut rng: BTreeSet<Vec<u64>> = BTreeSet::new();
    let mut rng_names_ok = true;
    for f in s.data_files().filter(|f| !f.path.contains('/')) {
        if let Some(rest) = f.path.strip_prefix("rng_state_") {
            match rest.strip_suffix(".pth").and_then(digits) {
                Some(i) => {
                    rng.insert(vec![i]);
                }
                None => rng_names_ok = false,
            }
        }
    }
    let index_present = HF_INDEXES.iter().any(|n| s.file(n).is_some());
    let model_markers = if index_present {
        hf_model_markers(s)
    } else {
        Some(Vec::new())
    };
    match model_markers {
        Some(mut markers)
            if state_ok && rng_names_ok && (rng.is_empty() || full_grid(&rng)) && s.quiescent() =>
        {
            markers.push("trainer_state.json".into());
            s.committed(markers)
        }
        _ => Verdict::Open,
    }
}

/// NeMo 2: `ModelCheckpoint` creates `<name>-unfinished` beside the
/// checkpoint before saving and removes it after the (possibly async)
/// save finalised, in save order. So while the marker exists the
/// checkpoint is open, and a later checkpoint without a marker proves this
/// one was given up. Once the marker is gone, `weights/` must be committed
/// as torch_dist.
fn nemo(s: &Snapshot<'_>) -> Verdict {
    let name = file_name(s.dir);
    let marker_of = |n: &str| {
        let base = n.strip_suffix(".ckpt").unwrap_or(n);
        format!("{base}-unfinished")
    };
    let has_marker = |n: &str| {
        let m = marker_of(n);
        s.sibling(&m).is_some() || s.sibling_dirs.contains(&m)
    };
    if has_marker(name) {
        let mine = step_of(name);
        let newer = s.sibling_dirs.iter().find(|d| {
            !is_temporary(d)
                && d.as_str() != name
                && matches!((step_of(d), mine), (Some(t), Some(m)) if t > m)
                && !has_marker(d)
        });
        return match newer {
            Some(d) => Verdict::Abandoned(format!(
                "{} still has its -unfinished marker but the later {d} finished",
                s.dir
            )),
            None => Verdict::Open,
        };
    }
    match torch_dist_markers(s, "weights/") {
        Some(markers) => s.committed(markers),
        None => Verdict::Open,
    }
}

/// Orbax: on POSIX the checkpoint is written into
/// `<step>.orbax-checkpoint-tmp[-ts]/` and renamed to `<step>/`; on
/// object stores `commit_success.txt` is written last into `<step>/`. A
/// temporary directory is open until a sibling with the same prefix and a
/// later step exists, which proves the writer moved on.
fn orbax(s: &Snapshot<'_>) -> Verdict {
    let name = file_name(s.dir);
    if let Some(i) = name.find(".orbax-checkpoint-tmp") {
        let final_name = &name[..i];
        let prefix = final_name.trim_end_matches(|c: char| c.is_ascii_digit());
        let mine = step_of(final_name);
        let newer = s.sibling_dirs.iter().find(|d| {
            d.strip_prefix(prefix)
                .and_then(digits)
                .is_some_and(|t| mine.is_some_and(|m| t > m))
        });
        return match newer {
            Some(d) => Verdict::Abandoned(format!(
                "temporary directory {} outlived the later commit {d}",
                s.dir
            )),
            None => Verdict::Open,
        };
    }
    match s.file("commit_success.txt") {
        Some(f) if f.complete => s.committed(vec!["commit_success.txt".into()]),
        Some(_) => Verdict::Open,
        None => s.committed(Vec::new()),
    }
}

/// ByteCheckpoint: `model/` and `optimizer/` are DCP-style, each with its
/// own `.metadata` (written through `.metadata.tmp`), plus
/// `extra_state/extra_state_rank_{r}.pt` per rank. Committed when both
/// `.metadata` are complete, no `.metadata.tmp` is left, and all ranks'
/// files are there.
fn bytecheckpoint(s: &Snapshot<'_>) -> Verdict {
    let model_ok = s.file("model/.metadata").is_some_and(|f| f.complete);
    let has_optimizer = s.data_files().any(|f| f.path.starts_with("optimizer/"));
    let optimizer_ok = !has_optimizer || s.file("optimizer/.metadata").is_some_and(|f| f.complete);
    let mut extra: BTreeSet<Vec<u64>> = BTreeSet::new();
    let mut extra_ok = true;
    for f in s.data_files() {
        if let Some(rest) = f.path.strip_prefix("extra_state/extra_state_rank_") {
            match rest.strip_suffix(".pt").and_then(digits) {
                Some(r) => {
                    extra.insert(vec![r]);
                }
                None => extra_ok = false,
            }
        }
    }
    if model_ok
        && optimizer_ok
        && extra_ok
        && (extra.is_empty() || full_grid(&extra))
        && !s.has_metadata_tmp()
        && s.quiescent()
    {
        let mut markers = Vec::new();
        if has_optimizer {
            markers.push("optimizer/.metadata".to_string());
        }
        markers.push("model/.metadata".to_string());
        s.committed(markers)
    } else {
        Verdict::Open
    }
}

/// Generic: the configured marker names, files at the top of the
/// directory; committed when one is present and complete and nothing is
/// in flight.
fn generic(s: &Snapshot<'_>, generic_markers: &[String]) -> Verdict {
    let present: Vec<&FileState> = generic_markers.iter().filter_map(|m| s.file(m)).collect();
    if present.iter().any(|f| f.complete) && s.quiescent() {
        s.committed(present.iter().map(|f| f.path.clone()).collect())
    } else {
        Verdict::Open
    }
}

// ---------------------------------------------------------------------
// File kinds
// ---------------------------------------------------------------------

/// True for files whose bytes are only ever appended, so chunks below the
/// current end can be streamed before the file closes
/// (CHECKPOINT_FORMATS.md "Three facts" item 1): `torch.save` ZIP archives
/// (`.pt`, `.pth`, `.bin`) and DCP `.distcp` (one `torch.save` record per
/// item, appended). False for safetensors (pre-sized with ftruncate and
/// written in place: fixtures/safetensors), JSON, text and anything else.
pub fn appendable(path: &str) -> bool {
    let n = file_name(path);
    [".pt", ".pth", ".bin", ".distcp"]
        .iter()
        .any(|ext| n.ends_with(ext))
}

/// True if the watcher must read this file's content (when it is at most
/// [`MAX_CONTENT`] bytes) for [`verdict`] or [`recognise`]. `path` is
/// relative to the checkpoint directory for files and the bare name for
/// siblings. With `format == None` (auto mode) it is true for anything any
/// format reads.
///
/// - DeepSpeed: sibling `latest` (the tag).
/// - Megatron legacy and torch_dist: sibling
///   `latest_checkpointed_iteration.txt`; torch_dist also `metadata.json`.
/// - NeMo: `weights/metadata.json`.
/// - HF `save_pretrained` and torchtitan: `model.safetensors.index.json`,
///   `pytorch_model.bin.index.json`.
/// - HF Trainer: those indexes and `trainer_state.json`.
/// - DCP, Orbax, ByteCheckpoint, generic: nothing (presence and
///   completeness suffice).
pub fn wants_content(format: Option<Format>, path: &str) -> bool {
    let Some(format) = format else {
        return Format::ALL.iter().any(|f| wants_content(Some(*f), path));
    };
    let index = HF_INDEXES.contains(&path);
    match format {
        Format::DeepSpeed => path == "latest",
        Format::MegatronLegacy => path == MEGATRON_TRACKER,
        Format::MegatronDist => path == MEGATRON_TRACKER || path == "metadata.json",
        Format::Nemo => path == "weights/metadata.json",
        Format::HfPretrained | Format::Torchtitan => index,
        Format::HfTrainer => index || path == "trainer_state.json",
        Format::Dcp | Format::Orbax | Format::ByteCheckpoint | Format::Generic => false,
    }
}

/// Files that hold optimizer state rather than weights (path relative to
/// the checkpoint directory), for the `weights-only` profile.
///
/// - DeepSpeed: `*optim_states.pt`.
/// - HF Trainer: `optimizer.pt`, `optimizer.bin`, `scheduler.pt`,
///   `scaler.pt`, `rng_state*.pth`, and FSDP `optimizer_N/` subtrees
///   (`save_fsdp_optimizer`).
/// - Megatron legacy: `distrib_optim.pt` (`model_optim_rng.pt` holds the
///   weights, so it is never skipped).
/// - ByteCheckpoint: the `optimizer/` subtree.
/// - HF `save_pretrained`: weights only, always `false`.
/// - Generic: unknown layout, always `false` (everything is shipped).
///
/// # Errors
/// The format's name when it mixes weights and optimizer state in the same
/// files, so a weights-only copy is impossible without a framework: DCP,
/// torchtitan, Megatron torch_dist, NeMo (DCP items of both kinds in each
/// `.distcp`) and Orbax (one pytree of params and optimizer state).
pub fn is_optimizer_state(format: Format, path: &str) -> Result<bool, String> {
    let n = file_name(path);
    match format {
        Format::DeepSpeed => Ok(n.ends_with("optim_states.pt")),
        Format::HfTrainer => Ok(matches!(
            n,
            "optimizer.pt" | "optimizer.bin" | "scheduler.pt" | "scaler.pt"
        ) || (n.starts_with("rng_state") && n.ends_with(".pth"))
            || path
                .split('/')
                .next()
                .and_then(|d| d.strip_prefix("optimizer_"))
                .is_some_and(|r| digits(r).is_some() && path.contains('/'))),
        Format::MegatronLegacy => Ok(n == "distrib_optim.pt"),
        Format::ByteCheckpoint => Ok(path.starts_with("optimizer/")),
        Format::HfPretrained | Format::Generic => Ok(false),
        Format::Dcp | Format::Torchtitan | Format::MegatronDist | Format::Nemo | Format::Orbax => {
            Err(format!(
                "format {format} stores weights and optimizer state in the same files; \
             a weights-only copy needs the framework"
            ))
        }
    }
}

/// Whether checkpoints of `format` keep weights and optimizer state in
/// separate files, so that a weights-first publish
/// ([`ferry_proto::state::Profile::WeightsFirst`]) has a weights-only
/// version to publish before the rest: DeepSpeed, HF Trainer, Megatron
/// legacy (`distrib_optim.pt`) and ByteCheckpoint do
/// ([`is_optimizer_state`] names their optimizer files).
///
/// # Errors
/// Why not: the format mixes both in its files (DCP, torchtitan, torch_dist,
/// NeMo, Orbax), holds no optimizer state (HF `save_pretrained`), or has no
/// known layout (generic).
pub fn splits_weights(format: Format) -> Result<(), String> {
    is_optimizer_state(format, "")?;
    match format {
        Format::HfPretrained => Err(format!(
            "format {format} holds weights only: the whole replica is the weights-only one"
        )),
        Format::Generic => Err(format!(
            "format {format} has no known layout: which files hold optimizer state is unknown"
        )),
        _ => Ok(()),
    }
}

/// Where a file goes in a transfer's send order: metadata first, then the
/// weights, then the optimizer state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SendClass {
    /// Small files a reader opens first: DCP `.metadata`, JSON and YAML
    /// configs and indexes (`model.safetensors.index.json`,
    /// `trainer_state.json`), text files (`latest`, trackers), tokenizer
    /// models.
    Metadata,
    /// Everything else: weights, and files of no known kind.
    Weights,
    /// Optimizer state, by [`is_optimizer_state`] for `format` (only a
    /// format that keeps it in separate files has any).
    Optimizer,
}

/// The [`SendClass`] of `path` (relative to the checkpoint directory) in
/// a checkpoint of `format` (`None`: not recognised).
pub fn send_class(format: Option<Format>, path: &str) -> SendClass {
    if format.is_some_and(|f| is_optimizer_state(f, path) == Ok(true)) {
        return SendClass::Optimizer;
    }
    let n = file_name(path);
    let ext = n.rsplit_once('.').map_or("", |(_, e)| e);
    if n == ".metadata"
        || n == "latest"
        || matches!(ext, "json" | "yaml" | "yml" | "txt" | "metadata" | "model")
    {
        SendClass::Metadata
    } else {
        SendClass::Weights
    }
}

// ---------------------------------------------------------------------
// content_check
// ---------------------------------------------------------------------

/// Largest safetensors header accepted, in bytes (100 MB, the limit of the
/// safetensors reference implementation).
const SAFETENSORS_MAX_HEADER: u64 = 100_000_000;

/// Format check used in poll mode (no inotify) before a quiet file counts
/// as complete (CHECKPOINT_FORMATS.md "Format checks that need no
/// framework"). `head` is the first bytes of the file and `tail` the last
/// bytes (each up to 64 KiB), `size` the file size in bytes.
///
/// - `.safetensors`: 8-byte little-endian header length N, N bytes of JSON
///   whose tensors' `data_offsets` are `[begin, end]` with begin <= end,
///   and `size == 8 + N + max(end)`. If the header is longer than `head`,
///   only `8 + N <= size` is checked (the rest cannot be seen). Writers
///   pre-size the file, so this complements the quiet period, never
///   replaces it.
/// - `.pt`, `.pth`, `.bin`, `.distcp` (torch.save ZIP): an
///   End-of-Central-Directory record `PK\x05\x06` ending exactly at the
///   end of the file (after its comment), whose central directory
///   (offset + size, from the ZIP64 record via its locator when the
///   32-bit fields are saturated) ends before the record. The offsets are
///   relative to the archive's start, which for a `.distcp` (a
///   concatenation of archives) is unknown, so "inside the file" is
///   checked as "ends at or before the record". For `.distcp` this only
///   proves that the last item is whole.
/// - `.json`: parses, when `head` holds the whole file; otherwise `true`.
/// - anything else: `true`.
pub fn content_check(path: &str, head: &[u8], tail: &[u8], size: u64) -> bool {
    let n = file_name(path);
    if n.ends_with(".safetensors") {
        safetensors_complete(head, size)
    } else if appendable(n) {
        zip_complete(tail, size)
    } else if n.ends_with(".json") {
        match usize::try_from(size) {
            Ok(len) if head.len() >= len => json(&head[..len]).is_some(),
            _ => true,
        }
    } else {
        true
    }
}

/// The safetensors check of [`content_check`].
fn safetensors_complete(head: &[u8], size: u64) -> bool {
    let Some(len_bytes) = head.get(..8) else {
        return false;
    };
    let mut le = [0u8; 8];
    le.copy_from_slice(len_bytes);
    let n = u64::from_le_bytes(le);
    if n > SAFETENSORS_MAX_HEADER || 8 + n > size {
        return false;
    }
    // n <= 100 MB, so it fits in usize.
    let Some(header) = head.get(8..8 + n as usize) else {
        // The header is longer than the head we were given.
        return true;
    };
    let Some(serde_json::Value::Object(map)) = json(header) else {
        return false;
    };
    let mut data_end = 0u64;
    for (name, tensor) in &map {
        if name == "__metadata__" {
            continue;
        }
        let Some(offsets) = tensor.get("data_offsets").and_then(|o| o.as_array()) else {
            return false;
        };
        let (Some(begin), Some(end)) = (
            offsets.first().and_then(serde_json::Value::as_u64),
            offsets.get(1).and_then(serde_json::Value::as_u64),
        ) else {
            return false;
        };
        if offsets.len() != 2 || begin > end {
            return false;
        }
        data_end = data_end.max(end);
    }
    (8 + n).checked_add(data_end) == Some(size)
}

fn le_u16(b: &[u8], at: usize) -> Option<u64> {
    let s = b.get(at..at.checked_add(2)?)?;
    Some(u64::from(u16::from_le_bytes([s[0], s[1]])))
}

fn le_u32(b: &[u8], at: usize) -> Option<u64> {
    let s = b.get(at..at.checked_add(4)?)?;
    Some(u64::from(u32::from_le_bytes([s[0], s[1], s[2], s[3]])))
}

fn le_u64(b: &[u8], at: usize) -> Option<u64> {
    let s = b.get(at..at.checked_add(8)?)?;
    let mut a = [0u8; 8];
    a.copy_from_slice(s);
    Some(u64::from_le_bytes(a))
}

/// The ZIP check of [`content_check`]: `tail` is the last `tail.len()`
/// bytes of a `size`-byte file.
fn zip_complete(tail: &[u8], size: u64) -> bool {
    const EOCD: &[u8] = b"PK\x05\x06";
    const LOCATOR: &[u8] = b"PK\x06\x07";
    const ZIP64_EOCD: &[u8] = b"PK\x06\x06";
    let Some(tail_start) = size.checked_sub(tail.len() as u64) else {
        return false;
    };
    // Scan backwards: the record is 22 bytes plus a comment of up to
    // 65535 bytes, and must end exactly at the end of the file.
    let Some(last) = tail.len().checked_sub(22) else {
        return false;
    };
    let Some(pos) = (0..=last).rev().find(|&p| {
        tail[p..].starts_with(EOCD)
            && le_u16(tail, p + 20).is_some_and(|c| p as u64 + 22 + c == tail.len() as u64)
    }) else {
        return false;
    };
    let eocd_abs = tail_start + pos as u64;
    let (Some(entries), Some(cd_size), Some(cd_offset)) = (
        le_u16(tail, pos + 10),
        le_u32(tail, pos + 12),
        le_u32(tail, pos + 16),
    ) else {
        return false;
    };
    let saturated = entries == 0xFFFF || cd_size == 0xFFFF_FFFF || cd_offset == 0xFFFF_FFFF;
    // ZIP64: a 20-byte locator right before the EOCD, and the ZIP64 EOCD
    // record (12 bytes + its declared size) right before the locator.
    let zip64 = pos
        .checked_sub(20)
        .filter(|&l| tail[l..].starts_with(LOCATOR))
        .and_then(|l| {
            (0..l).rev().find(|&r| {
                tail[r..].starts_with(ZIP64_EOCD)
                    && le_u64(tail, r + 4).is_some_and(|n| r as u64 + 12 + n == l as u64)
            })
        });
    match zip64 {
        Some(r) => {
            let (Some(size64), Some(offset64)) = (le_u64(tail, r + 40), le_u64(tail, r + 48))
            else {
                return false;
            };
            let rec_abs = tail_start + r as u64;
            offset64
                .checked_add(size64)
                .is_some_and(|end| end <= rec_abs)
        }
        None if saturated => false,
        None => cd_offset + cd_size <= eocd_abs,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// Real transformers 5.24 / safetensors 0.8 output (tests/fixtures).
    const SHARD1: &[u8] = include_bytes!(
        "../../tests/fixtures/safetensors/checkpoint/model-00001-of-00003.safetensors"
    );
    const SHARD2: &[u8] = include_bytes!(
        "../../tests/fixtures/safetensors/checkpoint/model-00002-of-00003.safetensors"
    );
    const INDEX: &[u8] =
        include_bytes!("../../tests/fixtures/safetensors/checkpoint/model.safetensors.index.json");
    /// Real torch 2.15 DCP output (tests/fixtures).
    const DISTCP: &[u8] = include_bytes!("../../tests/fixtures/dcp/step_00000002/__0_0.distcp");
    const DCP_METADATA: &[u8] = include_bytes!("../../tests/fixtures/dcp/step_00000002/.metadata");

    fn done(path: &str, size: u64) -> FileState {
        FileState {
            path: path.into(),
            size,
            mtime_ns: 1_000,
            complete: true,
            content: None,
        }
    }

    fn open(path: &str, size: u64) -> FileState {
        FileState {
            complete: false,
            ..done(path, size)
        }
    }

    fn text(path: &str, body: &[u8]) -> FileState {
        FileState {
            content: Some(body.to_vec()),
            ..done(path, body.len() as u64)
        }
    }

    fn snap<'a>(
        dir: &'a str,
        files: &'a [FileState],
        siblings: &'a [FileState],
        sibling_dirs: &'a [String],
    ) -> Snapshot<'a> {
        Snapshot {
            dir,
            files,
            siblings,
            sibling_dirs,
        }
    }

    fn markers(v: &Verdict) -> Vec<&str> {
        match v {
            Verdict::Committed { markers, .. } => markers.iter().map(String::as_str).collect(),
            other => panic!("not committed: {other:?}"),
        }
    }

    fn is_abandoned(v: &Verdict) -> bool {
        matches!(v, Verdict::Abandoned(_))
    }

    // ---- names ----

    #[test]
    fn format_names_round_trip_and_errors_list_them() {
        for f in Format::ALL {
            assert_eq!(f.to_string().parse::<Format>(), Ok(f));
            assert_eq!(
                serde_json::to_string(&f).unwrap(),
                format!("\"{}\"", f.name())
            );
        }
        let listed: Vec<&str> = FORMAT_NAMES.split(", ").collect();
        let names: Vec<&str> = Format::ALL.iter().map(|f| f.name()).collect();
        assert_eq!(listed, names);
        let err = "auto".parse::<Format>().unwrap_err().to_string();
        assert!(
            err.contains("megatron_dist") && err.contains("\"auto\""),
            "{err}"
        );
        assert!("DCP".parse::<Format>().is_err());
    }

    #[test]
    fn step_of_reads_every_naming_scheme() {
        for (name, step) in [
            ("global_step100", Some(100)),
            ("iter_0000200", Some(200)),
            ("checkpoint-500", Some(500)),
            ("step-3", Some(3)),
            ("step_00000002", Some(2)),
            ("global_step_7", Some(7)),
            ("5", Some(5)),
            ("5.orbax-checkpoint-tmp-123", Some(5)),
            ("ckpt_12.orbax-checkpoint-tmp", Some(12)),
            (
                "gpt--val_loss=1.5-step=99-consumed_samples=1600.0",
                Some(99),
            ),
            ("gpt--step=99-last", Some(99)),
            ("release", None),
            ("", None),
            ("step-99999999999999999999999", None),
        ] {
            assert_eq!(step_of(name), step, "{name}");
        }
    }

    #[test]
    fn appendable_and_wants_content() {
        assert!(appendable("__0_0.distcp"));
        assert!(appendable("mp_rank_00/model_optim_rng.pt"));
        assert!(appendable("rng_state_1.pth"));
        assert!(appendable("training_args.bin"));
        assert!(!appendable("model-00001-of-00003.safetensors"));
        assert!(!appendable("model.safetensors.index.json"));
        assert!(!appendable("latest"));

        assert!(wants_content(Some(Format::DeepSpeed), "latest"));
        assert!(!wants_content(
            Some(Format::DeepSpeed),
            "mp_rank_00_model_states.pt"
        ));
        assert!(wants_content(Some(Format::HfTrainer), "trainer_state.json"));
        assert!(wants_content(Some(Format::MegatronDist), "metadata.json"));
        assert!(!wants_content(Some(Format::Dcp), "metadata.json"));
        assert!(wants_content(Some(Format::Nemo), "weights/metadata.json"));
        assert!(wants_content(None, "latest_checkpointed_iteration.txt"));
        assert!(wants_content(None, "model.safetensors.index.json"));
        assert!(!wants_content(None, "config.json"));
        assert!(!wants_content(None, ".metadata"));
    }

    #[test]
    fn optimizer_state_per_format() {
        let ds = Format::DeepSpeed;
        assert_eq!(
            is_optimizer_state(ds, "bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt"),
            Ok(true)
        );
        assert_eq!(
            is_optimizer_state(ds, "mp_rank_00_model_states.pt"),
            Ok(false)
        );
        let hf = Format::HfTrainer;
        for p in [
            "optimizer.pt",
            "scheduler.pt",
            "rng_state_1.pth",
            "rng_state.pth",
            "optimizer_0/__0_0.distcp",
        ] {
            assert_eq!(is_optimizer_state(hf, p), Ok(true), "{p}");
        }
        for p in [
            "model.safetensors",
            "trainer_state.json",
            "pytorch_model_fsdp_0/__0_0.distcp",
        ] {
            assert_eq!(is_optimizer_state(hf, p), Ok(false), "{p}");
        }
        assert_eq!(
            is_optimizer_state(Format::MegatronLegacy, "mp_rank_01_003/distrib_optim.pt"),
            Ok(true)
        );
        assert_eq!(
            is_optimizer_state(Format::MegatronLegacy, "mp_rank_01_003/model_optim_rng.pt"),
            Ok(false)
        );
        assert_eq!(
            is_optimizer_state(Format::ByteCheckpoint, "optimizer/__0_0.distcp"),
            Ok(true)
        );
        assert_eq!(
            is_optimizer_state(Format::ByteCheckpoint, "model/__0_0.distcp"),
            Ok(false)
        );
        for f in [
            Format::Dcp,
            Format::Torchtitan,
            Format::MegatronDist,
            Format::Nemo,
            Format::Orbax,
        ] {
            let err = is_optimizer_state(f, "__0_0.distcp").unwrap_err();
            assert!(err.contains(f.name()), "{err}");
        }
    }

    #[test]
    fn weights_first_needs_separate_optimizer_files_and_sends_metadata_first() {
        for f in [
            Format::DeepSpeed,
            Format::HfTrainer,
            Format::MegatronLegacy,
            Format::ByteCheckpoint,
        ] {
            assert_eq!(splits_weights(f), Ok(()), "{f}");
        }
        for f in [
            Format::Dcp,
            Format::Torchtitan,
            Format::MegatronDist,
            Format::Nemo,
            Format::Orbax,
            Format::HfPretrained,
            Format::Generic,
        ] {
            let why = splits_weights(f).unwrap_err();
            assert!(why.contains(f.name()), "{why}");
        }
        let ds = Some(Format::DeepSpeed);
        assert_eq!(send_class(ds, "latest"), SendClass::Metadata);
        assert_eq!(
            send_class(ds, "global_step10/mp_rank_00_model_states.pt"),
            SendClass::Weights
        );
        assert_eq!(
            send_class(
                ds,
                "global_step10/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
            ),
            SendClass::Optimizer
        );
        let hf = Some(Format::HfTrainer);
        for p in [
            "config.json",
            "trainer_state.json",
            "model.safetensors.index.json",
        ] {
            assert_eq!(send_class(hf, p), SendClass::Metadata, "{p}");
        }
        assert_eq!(
            send_class(hf, "model-00001-of-00002.safetensors"),
            SendClass::Weights
        );
        assert_eq!(send_class(hf, "optimizer.pt"), SendClass::Optimizer);
        // DCP mixes both in its shards: nothing is optimizer state alone.
        assert_eq!(
            send_class(Some(Format::Dcp), ".metadata"),
            SendClass::Metadata
        );
        assert_eq!(
            send_class(Some(Format::Dcp), "__0_0.distcp"),
            SendClass::Weights
        );
        assert_eq!(send_class(None, "optimizer.pt"), SendClass::Weights);
        let mut order = vec![
            SendClass::Optimizer,
            SendClass::Metadata,
            SendClass::Weights,
        ];
        order.sort();
        assert_eq!(
            order,
            [
                SendClass::Metadata,
                SendClass::Weights,
                SendClass::Optimizer
            ]
        );
    }

    // ---- content_check on real files ----

    #[test]
    fn content_check_accepts_real_safetensors_and_refuses_truncated() {
        for shard in [SHARD1, SHARD2] {
            let head = &shard[..shard.len().min(64 << 10)];
            assert!(content_check(
                "m.safetensors",
                head,
                &[],
                shard.len() as u64
            ));
            // Truncated: the header promises more data than the file holds.
            let cut = shard.len() as u64 - 1000;
            assert!(!content_check("m.safetensors", head, &[], cut));
            // Pre-sized but the header itself is not yet written (zeros).
            let zeros = vec![0u8; 4096];
            assert!(!content_check(
                "m.safetensors",
                &zeros,
                &[],
                shard.len() as u64
            ));
        }
        // Header being written in place: its second half still zeros.
        let n = u64::from_le_bytes(SHARD2[..8].try_into().unwrap()) as usize;
        let mut half = SHARD2[..8 + n].to_vec();
        half[8 + n / 2..].fill(0);
        assert!(!content_check(
            "m.safetensors",
            &half,
            &[],
            SHARD2.len() as u64
        ));
        // A header longer than `head` cannot be parsed: only its length is checked.
        assert!(content_check(
            "m.safetensors",
            &SHARD2[..8 + n / 2],
            &[],
            SHARD2.len() as u64
        ));
        assert!(!content_check(
            "m.safetensors",
            &SHARD2[..8 + n / 2],
            &[],
            8 + n as u64 - 1
        ));
        assert!(!content_check("m.safetensors", &SHARD2[..4], &[], 4));
    }

    #[test]
    fn content_check_finds_the_eocd_of_a_real_distcp() {
        let size = DISTCP.len() as u64;
        let tail = &DISTCP[DISTCP.len() - (64 << 10)..];
        assert!(content_check("__0_0.distcp", &DISTCP[..64], tail, size));
        // A copy truncated in memory (mid-record) has no EOCD at its end.
        let cut = &DISTCP[..DISTCP.len() - 5000];
        let tail = &cut[cut.len() - (64 << 10)..];
        assert!(!content_check(
            "__0_0.distcp",
            &cut[..64],
            tail,
            cut.len() as u64
        ));
        // A tail longer than the file is inconsistent.
        assert!(!content_check("x.pt", &[], &DISTCP[..100], 10));
        assert!(!content_check("x.pt", &[], &[], 0));
    }

    #[test]
    fn content_check_refuses_a_central_directory_past_the_eocd() {
        // Minimal archive: only an EOCD claiming a 100-byte directory at 0.
        let mut eocd = b"PK\x05\x06".to_vec();
        eocd.extend_from_slice(&[0, 0, 0, 0, 1, 0, 1, 0]);
        eocd.extend_from_slice(&100u32.to_le_bytes());
        eocd.extend_from_slice(&0u32.to_le_bytes());
        eocd.extend_from_slice(&[0, 0]);
        assert!(!content_check("x.pt", &[], &eocd, eocd.len() as u64));
        let mut ok = vec![0u8; 100];
        ok.extend_from_slice(&eocd);
        assert!(content_check("x.pt", &[], &ok, ok.len() as u64));
    }

    #[test]
    fn content_check_json_and_others() {
        assert!(content_check(
            "model.safetensors.index.json",
            INDEX,
            &[],
            INDEX.len() as u64
        ));
        let half = &INDEX[..INDEX.len() / 2];
        assert!(!content_check(
            "model.safetensors.index.json",
            half,
            &[],
            half.len() as u64
        ));
        assert!(content_check("big.json", &INDEX[..10], &[], 1 << 30));
        assert!(content_check(
            ".metadata",
            &DCP_METADATA[..100],
            &[],
            DCP_METADATA.len() as u64
        ));
    }

    // ---- recognise ----

    #[test]
    fn recognise_each_layout() {
        let none: [FileState; 0] = [];
        let nd: [String; 0] = [];
        type Case = (&'static str, Vec<FileState>, Vec<FileState>, Option<Format>);
        let cases: Vec<Case> = vec![
            ("step_00000002", vec![], vec![], None),
            ("step_00000002", vec![open(".tmpabc", 10)], vec![], None),
            (
                "step_00000002",
                vec![done("__0_0.distcp", 9)],
                vec![],
                Some(Format::Dcp),
            ),
            (
                "step_00000002",
                vec![open(".metadata.tmp", 9)],
                vec![],
                Some(Format::Dcp),
            ),
            (
                "iter_0000200",
                vec![done("__0_0.distcp", 9)],
                vec![],
                Some(Format::MegatronDist),
            ),
            (
                "ckpt",
                vec![
                    done("__0_0.distcp", 9),
                    text("metadata.json", br#"{"sharded_backend": "torch_dist"}"#),
                ],
                vec![],
                Some(Format::MegatronDist),
            ),
            (
                "ckpt",
                vec![
                    done("__0_0.distcp", 9),
                    text("metadata.json", br#"{"other": 1}"#),
                ],
                vec![],
                Some(Format::Dcp),
            ),
            (
                "step-3",
                vec![done("__0_0.distcp", 9)],
                vec![],
                Some(Format::Torchtitan),
            ),
            (
                "step-3",
                vec![done("model.safetensors", 9)],
                vec![],
                Some(Format::Torchtitan),
            ),
            (
                "iter_0000200",
                vec![done("mp_rank_00/model_optim_rng.pt", 9)],
                vec![],
                Some(Format::MegatronLegacy),
            ),
            (
                "global_step100",
                vec![done("mp_rank_00_model_states.pt", 9)],
                vec![],
                Some(Format::DeepSpeed),
            ),
            (
                "global_step100",
                vec![done("zero_to_fp32.py", 9)],
                vec![],
                None,
            ),
            (
                "checkpoint-500",
                vec![done("config.json", 9)],
                vec![],
                Some(Format::HfTrainer),
            ),
            (
                "run",
                vec![done("trainer_state.json", 9)],
                vec![],
                Some(Format::HfTrainer),
            ),
            (
                "checkpoint-500",
                vec![done("global_step500/mp_rank_00_model_states.pt", 9)],
                vec![],
                Some(Format::HfTrainer),
            ),
            (
                "final",
                vec![done("model-00001-of-00002.safetensors", 9)],
                vec![],
                Some(Format::HfPretrained),
            ),
            ("final", vec![done("config.json", 9)], vec![], None),
            (
                "5.orbax-checkpoint-tmp-1234",
                vec![],
                vec![],
                Some(Format::Orbax),
            ),
            (
                "5",
                vec![done("commit_success.txt", 0)],
                vec![],
                Some(Format::Orbax),
            ),
            (
                "5",
                vec![done("_CHECKPOINT_METADATA", 10)],
                vec![],
                Some(Format::Orbax),
            ),
            (
                "global_step_7",
                vec![done("model/__0_0.distcp", 9)],
                vec![],
                Some(Format::ByteCheckpoint),
            ),
            (
                "ckpt",
                vec![
                    done("model/.metadata", 9),
                    done("extra_state/extra_state_rank_0.pt", 9),
                ],
                vec![],
                Some(Format::ByteCheckpoint),
            ),
            (
                "gpt--step=99",
                vec![done("weights/__0_0.distcp", 9), done("context/io.json", 9)],
                vec![],
                Some(Format::Nemo),
            ),
            (
                "gpt--step=99",
                vec![done("weights/__0_0.distcp", 9)],
                vec![done("gpt--step=99-unfinished", 0)],
                Some(Format::Nemo),
            ),
        ];
        for (dir, files, siblings, want) in &cases {
            let s = snap(dir, files, siblings, &nd);
            assert_eq!(recognise(&s), *want, "{dir} {files:?}");
        }
        // Generic is never recognised.
        let files = [done("DONE", 0)];
        assert_eq!(recognise(&snap("x", &files, &none, &nd)), None);
    }

    // ---- DCP ----

    fn dcp_files() -> Vec<FileState> {
        vec![
            done("__0_0.distcp", DISTCP.len() as u64),
            done("__1_0.distcp", 3_169_478),
            done(".metadata", DCP_METADATA.len() as u64),
        ]
    }

    #[test]
    fn dcp_commits_on_metadata_and_not_on_its_temporary() {
        let files = dcp_files();
        let v = verdict(Format::Dcp, &snap("step_00000002", &files, &[], &[]), &[]);
        assert_eq!(markers(&v), [".metadata"]);
        let Verdict::Committed { identity, .. } = &v else {
            unreachable!()
        };

        // Only .metadata.tmp (fixture trace events 10-13): open.
        let mut files = dcp_files();
        files[2] = done(".metadata.tmp", 93_377);
        assert_eq!(
            verdict(Format::Dcp, &snap("s", &files, &[], &[]), &[]),
            Verdict::Open
        );
        // A re-save: new .metadata.tmp beside the old .metadata.
        let mut files = dcp_files();
        files.push(done(".metadata.tmp", 93_377));
        assert_eq!(
            verdict(Format::Dcp, &snap("s", &files, &[], &[]), &[]),
            Verdict::Open
        );
        // A rank still writing.
        let mut files = dcp_files();
        files[1].complete = false;
        assert_eq!(
            verdict(Format::Dcp, &snap("s", &files, &[], &[]), &[]),
            Verdict::Open
        );
        // The re-save committed: the identity changes with .metadata's mtime.
        let mut files = dcp_files();
        files[2].mtime_ns = 2_000;
        let Verdict::Committed {
            identity: again, ..
        } = verdict(Format::Dcp, &snap("step_00000002", &files, &[], &[]), &[])
        else {
            panic!("not committed")
        };
        assert_ne!(identity, &again);
    }

    #[test]
    fn torchtitan_uses_dcp_or_hf_rules() {
        let files = dcp_files();
        assert_eq!(
            markers(&verdict(
                Format::Torchtitan,
                &snap("step-3", &files, &[], &[]),
                &[]
            )),
            [".metadata"]
        );
        let files = [done("__0_0.distcp", 5)];
        assert_eq!(
            verdict(Format::Torchtitan, &snap("step-3", &files, &[], &[]), &[]),
            Verdict::Open
        );
        let files = hf_files();
        assert_eq!(
            markers(&verdict(
                Format::Torchtitan,
                &snap("step-3", &files, &[], &[]),
                &[]
            )),
            ["model.safetensors.index.json"]
        );
    }

    // ---- Megatron ----

    fn tracker_file(step: &str) -> FileState {
        text(MEGATRON_TRACKER, format!("{step}\n").as_bytes())
    }

    #[test]
    fn megatron_legacy_needs_tracker_and_every_rank() {
        let files = [
            done("mp_rank_00_000/model_optim_rng.pt", 10),
            done("mp_rank_01_000/model_optim_rng.pt", 10),
            done("mp_rank_00_001/model_optim_rng.pt", 10),
            done("mp_rank_01_001/model_optim_rng.pt", 10),
        ];
        let here = [tracker_file("200")];
        let v = verdict(
            Format::MegatronLegacy,
            &snap("iter_0000200", &files, &here, &[]),
            &[],
        );
        assert_eq!(markers(&v), Vec::<&str>::new());
        // No tracker yet, or one naming the previous step: open.
        assert_eq!(
            verdict(
                Format::MegatronLegacy,
                &snap("iter_0000200", &files, &[], &[]),
                &[]
            ),
            Verdict::Open
        );
        let old = [tracker_file("100")];
        assert_eq!(
            verdict(
                Format::MegatronLegacy,
                &snap("iter_0000200", &files, &old, &[]),
                &[]
            ),
            Verdict::Open
        );
        // A missing rank inside the TP x PP grid: open.
        assert_eq!(
            verdict(
                Format::MegatronLegacy,
                &snap("iter_0000200", &files[..3], &here, &[]),
                &[]
            ),
            Verdict::Open
        );
        // A rank dir without its model file: open.
        let mut partial = files.to_vec();
        partial[3] = done("mp_rank_01_001/distrib_optim.pt", 10);
        assert_eq!(
            verdict(
                Format::MegatronLegacy,
                &snap("iter_0000200", &partial, &here, &[]),
                &[]
            ),
            Verdict::Open
        );
        // "release".
        let rel = [tracker_file("release")];
        assert!(matches!(
            verdict(
                Format::MegatronLegacy,
                &snap("release", &files, &rel, &[]),
                &[]
            ),
            Verdict::Committed { .. }
        ));
    }

    #[test]
    fn megatron_tracker_moved_past_an_incomplete_iteration_abandons_it() {
        let files = [
            done("mp_rank_00/model_optim_rng.pt", 10),
            open("mp_rank_01/model_optim_rng.pt", 3),
        ];
        let past = [tracker_file("300")];
        let v = verdict(
            Format::MegatronLegacy,
            &snap("iter_0000200", &files, &past, &[]),
            &[],
        );
        assert!(is_abandoned(&v), "{v:?}");
        // Complete with the tracker past it: it committed before the tracker moved on.
        let files = [
            done("mp_rank_00/model_optim_rng.pt", 10),
            done("mp_rank_01/model_optim_rng.pt", 10),
        ];
        let v = verdict(
            Format::MegatronLegacy,
            &snap("iter_0000200", &files, &past, &[]),
            &[],
        );
        assert!(matches!(v, Verdict::Committed { .. }), "{v:?}");
        // A tracker still being written is not read.
        let mut writing = tracker_file("300");
        writing.complete = false;
        let files = [open("mp_rank_00/model_optim_rng.pt", 3)];
        assert_eq!(
            verdict(
                Format::MegatronLegacy,
                &snap("iter_0000200", &files, &[writing], &[]),
                &[]
            ),
            Verdict::Open
        );
    }

    fn megatron_dist_files() -> Vec<FileState> {
        vec![
            done("__0_0.distcp", 10),
            done("__1_0.distcp", 10),
            done("common.pt", 10),
            done(".metadata", 10),
            text(
                "metadata.json",
                br#"{"sharded_backend": "torch_dist", "sharded_backend_version": 1}"#,
            ),
        ]
    }

    #[test]
    fn megatron_dist_publishes_metadata_then_metadata_json_then_integrity() {
        let mut files = megatron_dist_files();
        let v = verdict(
            Format::MegatronDist,
            &snap("iter_0000200", &files, &[], &[]),
            &[],
        );
        assert_eq!(markers(&v), [".metadata", "metadata.json"]);
        files.push(done("integrity.json", 100));
        let v = verdict(
            Format::MegatronDist,
            &snap("iter_0000200", &files, &[], &[]),
            &[],
        );
        assert_eq!(
            markers(&v),
            [".metadata", "metadata.json", "integrity.json"]
        );
        // Half-written metadata.json: open, re-read later.
        let mut files = megatron_dist_files();
        files[4] = text("metadata.json", br#"{"sharded_back"#);
        assert_eq!(
            verdict(
                Format::MegatronDist,
                &snap("iter_0000200", &files, &[], &[]),
                &[]
            ),
            Verdict::Open
        );
        // ... and abandoned once the tracker moved on.
        let past = [tracker_file("300")];
        assert!(is_abandoned(&verdict(
            Format::MegatronDist,
            &snap("iter_0000200", &files, &past, &[]),
            &[]
        )));
        // No metadata.json at all: open.
        let files = &megatron_dist_files()[..4];
        assert_eq!(
            verdict(
                Format::MegatronDist,
                &snap("iter_0000200", files, &[], &[]),
                &[]
            ),
            Verdict::Open
        );
    }

    // ---- DeepSpeed ----

    fn deepspeed_files() -> Vec<FileState> {
        vec![
            done("mp_rank_00_model_states.pt", 100),
            done("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", 100),
            done("bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", 100),
            done("bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt", 100),
            done("zero_to_fp32.py", 100),
        ]
    }

    #[test]
    fn deepspeed_latest_before_the_last_rank_is_open_then_committed() {
        let latest = [text("latest", b"global_step100")];
        let mut files = deepspeed_files();
        // Rank 0 wrote `latest` before the barrier; rank 2 is still writing.
        files[3].complete = false;
        assert_eq!(
            verdict(
                Format::DeepSpeed,
                &snap("global_step100", &files, &latest, &[]),
                &[]
            ),
            Verdict::Open
        );
        files[3].complete = true;
        let v = verdict(
            Format::DeepSpeed,
            &snap("global_step100", &files, &latest, &[]),
            &[],
        );
        assert_eq!(markers(&v), Vec::<&str>::new());
        // Rank 1 missing entirely (below the highest rank seen): open.
        let mut gap = deepspeed_files();
        gap.remove(2);
        assert_eq!(
            verdict(
                Format::DeepSpeed,
                &snap("global_step100", &gap, &latest, &[]),
                &[]
            ),
            Verdict::Open
        );
        // `latest` names another tag of the same step: not this directory.
        let other = [text("latest", b"step100")];
        let files = deepspeed_files();
        assert_eq!(
            verdict(
                Format::DeepSpeed,
                &snap("global_step100", &files, &other, &[]),
                &[]
            ),
            Verdict::Open
        );
        // `latest` names another (older) tag: open.
        let older = [text("latest", b"global_step50")];
        let files = deepspeed_files();
        assert_eq!(
            verdict(
                Format::DeepSpeed,
                &snap("global_step100", &files, &older, &[]),
                &[]
            ),
            Verdict::Open
        );
    }

    #[test]
    fn deepspeed_zero_byte_model_file_is_open() {
        let latest = [text("latest", b"global_step100\n")];
        let mut files = deepspeed_files();
        files[0].size = 0;
        assert_eq!(
            verdict(
                Format::DeepSpeed,
                &snap("global_step100", &files, &latest, &[]),
                &[]
            ),
            Verdict::Open
        );
        // Without any model file: open.
        let files = &deepspeed_files()[1..];
        assert_eq!(
            verdict(
                Format::DeepSpeed,
                &snap("global_step100", files, &latest, &[]),
                &[]
            ),
            Verdict::Open
        );
    }

    #[test]
    fn deepspeed_latest_moved_past_an_incomplete_step_abandons_it() {
        let latest = [text("latest", b"global_step200")];
        let mut files = deepspeed_files();
        files[2].complete = false;
        assert!(is_abandoned(&verdict(
            Format::DeepSpeed,
            &snap("global_step100", &files, &latest, &[]),
            &[]
        )));
    }

    // ---- HF ----

    /// The real save_pretrained fixture, as the watcher sees it at the end.
    fn hf_files() -> Vec<FileState> {
        vec![
            done("config.json", 819),
            done("generation_config.json", 195),
            done("model-00001-of-00003.safetensors", 1_048_704),
            done("model-00002-of-00003.safetensors", 503_000),
            done("model-00003-of-00003.safetensors", 334_856),
            text("model.safetensors.index.json", INDEX),
        ]
    }

    #[test]
    fn hf_index_commits_when_every_listed_shard_is_complete() {
        let files = hf_files();
        let v = verdict(Format::HfPretrained, &snap("final", &files, &[], &[]), &[]);
        assert_eq!(markers(&v), ["model.safetensors.index.json"]);
        // Shard 3 renamed into place but not yet closed (fixture trace event 20).
        let mut files = hf_files();
        files[4].complete = false;
        assert_eq!(
            verdict(Format::HfPretrained, &snap("final", &files, &[], &[]), &[]),
            Verdict::Open
        );
        // Shard 3 still under its .tmp name: missing from the set.
        let mut files = hf_files();
        files[4] = open(".tmpVlMjPn", 334_856);
        assert_eq!(
            verdict(Format::HfPretrained, &snap("final", &files, &[], &[]), &[]),
            Verdict::Open
        );
    }

    #[test]
    fn hf_truncated_index_is_open_not_an_error() {
        let mut files = hf_files();
        files[5] = text("model.safetensors.index.json", &INDEX[..INDEX.len() / 2]);
        assert_eq!(
            verdict(Format::HfPretrained, &snap("final", &files, &[], &[]), &[]),
            Verdict::Open
        );
        // Being written in place (not closed yet), even if the bytes parse.
        let mut files = hf_files();
        files[5].complete = false;
        assert_eq!(
            verdict(Format::HfPretrained, &snap("final", &files, &[], &[]), &[]),
            Verdict::Open
        );
    }

    #[test]
    fn hf_single_file_and_large_index_fallback() {
        let files = [done("config.json", 10), done("model.safetensors", 100)];
        assert_eq!(
            markers(&verdict(
                Format::HfPretrained,
                &snap("m", &files, &[], &[]),
                &[]
            )),
            Vec::<&str>::new()
        );
        let files = [done("config.json", 10), open("model.safetensors", 100)];
        assert_eq!(
            verdict(Format::HfPretrained, &snap("m", &files, &[], &[]), &[]),
            Verdict::Open
        );

        // An index above MAX_CONTENT is never read: shard names decide.
        let mut files = hf_files();
        files[5] = done("model.safetensors.index.json", MAX_CONTENT + 1);
        assert!(matches!(
            verdict(Format::HfPretrained, &snap("m", &files, &[], &[]), &[]),
            Verdict::Committed { .. }
        ));
        files.remove(3);
        assert_eq!(
            verdict(Format::HfPretrained, &snap("m", &files, &[], &[]), &[]),
            Verdict::Open
        );
    }

    fn trainer_files(step: u64) -> Vec<FileState> {
        let mut files = hf_files();
        files.extend([
            done("training_args.bin", 5_000),
            done("optimizer.pt", 3_000_000),
            done("scheduler.pt", 1_000),
            done("rng_state_0.pth", 15_000),
            done("rng_state_1.pth", 15_000),
            text(
                "trainer_state.json",
                format!(r#"{{"global_step": {step}, "log_history": []}}"#).as_bytes(),
            ),
        ]);
        files
    }

    #[test]
    fn hf_trainer_commits_with_index_then_trainer_state() {
        let files = trainer_files(500);
        let v = verdict(
            Format::HfTrainer,
            &snap("checkpoint-500", &files, &[], &[]),
            &[],
        );
        assert_eq!(
            markers(&v),
            ["model.safetensors.index.json", "trainer_state.json"]
        );
        // trainer_state.json of another step: open.
        let files = trainer_files(400);
        assert_eq!(
            verdict(
                Format::HfTrainer,
                &snap("checkpoint-500", &files, &[], &[]),
                &[]
            ),
            Verdict::Open
        );
        // rng_state_0 missing while rng_state_1 exists: open.
        let mut files = trainer_files(500);
        files.retain(|f| f.path != "rng_state_0.pth");
        assert_eq!(
            verdict(
                Format::HfTrainer,
                &snap("checkpoint-500", &files, &[], &[]),
                &[]
            ),
            Verdict::Open
        );
    }

    #[test]
    fn hf_trainer_state_early_while_rng_state_1_incomplete_is_open() {
        let mut files = trainer_files(500);
        let rng1 = files
            .iter_mut()
            .find(|f| f.path == "rng_state_1.pth")
            .unwrap();
        rng1.complete = false;
        assert_eq!(
            verdict(
                Format::HfTrainer,
                &snap("checkpoint-500", &files, &[], &[]),
                &[]
            ),
            Verdict::Open
        );
    }

    // ---- NeMo ----

    fn nemo_files() -> Vec<FileState> {
        vec![
            done("weights/__0_0.distcp", 10),
            done("weights/common.pt", 10),
            done("weights/.metadata", 10),
            text(
                "weights/metadata.json",
                br#"{"sharded_backend": "torch_dist"}"#,
            ),
            done("context/io.json", 10),
        ]
    }

    #[test]
    fn nemo_is_open_while_unfinished_exists_and_committed_after() {
        let dir = "gpt--step=99";
        let files = nemo_files();
        let marker = [done("gpt--step=99-unfinished", 0)];
        assert_eq!(
            verdict(Format::Nemo, &snap(dir, &files, &marker, &[]), &[]),
            Verdict::Open
        );
        let v = verdict(Format::Nemo, &snap(dir, &files, &[], &[]), &[]);
        assert_eq!(markers(&v), ["weights/.metadata", "weights/metadata.json"]);
        // Marker gone but weights/ not committed: open.
        let files = &nemo_files()[..2];
        assert_eq!(
            verdict(Format::Nemo, &snap(dir, files, &[], &[]), &[]),
            Verdict::Open
        );
        // Marker still there while a later checkpoint finished: abandoned.
        let later = ["gpt--step=199".to_string()];
        let files = nemo_files();
        assert!(is_abandoned(&verdict(
            Format::Nemo,
            &snap(dir, &files, &marker, &later),
            &[]
        )));
        // ... but not while the later one is itself unfinished.
        let both = [
            done("gpt--step=99-unfinished", 0),
            done("gpt--step=199-unfinished", 0),
        ];
        assert_eq!(
            verdict(Format::Nemo, &snap(dir, &files, &both, &later), &[]),
            Verdict::Open
        );
    }

    // ---- Orbax ----

    #[test]
    fn orbax_rename_commits_and_stale_tmp_is_abandoned() {
        let files = [
            open("default/manifest.ocdbt", 10),
            done("_CHECKPOINT_METADATA", 10),
        ];
        let tmp = "5.orbax-checkpoint-tmp-1234";
        assert_eq!(
            verdict(Format::Orbax, &snap(tmp, &files, &[], &[]), &[]),
            Verdict::Open
        );
        let older = ["4".to_string()];
        assert_eq!(
            verdict(Format::Orbax, &snap(tmp, &files, &[], &older), &[]),
            Verdict::Open
        );
        let newer = ["6".to_string()];
        assert!(is_abandoned(&verdict(
            Format::Orbax,
            &snap(tmp, &files, &[], &newer),
            &[]
        )));
        // Another in-flight temporary does not count as a commit.
        let newer_tmp = ["6.orbax-checkpoint-tmp-99".to_string()];
        assert_eq!(
            verdict(Format::Orbax, &snap(tmp, &files, &[], &newer_tmp), &[]),
            Verdict::Open
        );
        // The final name: committed by the rename, whatever the close flags.
        assert_eq!(
            markers(&verdict(Format::Orbax, &snap("5", &files, &[], &[]), &[])),
            Vec::<&str>::new()
        );
        // Object-store style: commit_success.txt must be complete.
        let files = [
            done("default/manifest.ocdbt", 10),
            open("commit_success.txt", 0),
        ];
        assert_eq!(
            verdict(Format::Orbax, &snap("5", &files, &[], &[]), &[]),
            Verdict::Open
        );
        let files = [
            done("default/manifest.ocdbt", 10),
            done("commit_success.txt", 0),
        ];
        assert_eq!(
            markers(&verdict(Format::Orbax, &snap("5", &files, &[], &[]), &[])),
            ["commit_success.txt"]
        );
    }

    // ---- ByteCheckpoint ----

    fn bytecheckpoint_files() -> Vec<FileState> {
        vec![
            done("model/__0_0.distcp", 10),
            done("model/__1_0.distcp", 10),
            done("model/.metadata", 10),
            done("optimizer/__0_0.distcp", 10),
            done("optimizer/__1_0.distcp", 10),
            done("optimizer/.metadata", 10),
            done("extra_state/extra_state_rank_0.pt", 10),
            done("extra_state/extra_state_rank_1.pt", 10),
        ]
    }

    #[test]
    fn bytecheckpoint_needs_both_metadata_and_no_tmp() {
        let files = bytecheckpoint_files();
        let v = verdict(
            Format::ByteCheckpoint,
            &snap("global_step_7", &files, &[], &[]),
            &[],
        );
        assert_eq!(markers(&v), ["optimizer/.metadata", "model/.metadata"]);
        let mut files = bytecheckpoint_files();
        files[5] = done("optimizer/.metadata.tmp", 10);
        assert_eq!(
            verdict(
                Format::ByteCheckpoint,
                &snap("global_step_7", &files, &[], &[]),
                &[]
            ),
            Verdict::Open
        );
        let mut files = bytecheckpoint_files();
        files.remove(6);
        assert_eq!(
            verdict(
                Format::ByteCheckpoint,
                &snap("global_step_7", &files, &[], &[]),
                &[]
            ),
            Verdict::Open
        );
    }

    // ---- Generic ----

    #[test]
    fn generic_needs_a_configured_complete_marker() {
        let names = vec!["DONE".to_string(), "COMMITTED".to_string()];
        let files = [done("a.bin", 10), done("COMMITTED", 0)];
        assert_eq!(
            markers(&verdict(
                Format::Generic,
                &snap("x", &files, &[], &[]),
                &names
            )),
            ["COMMITTED"]
        );
        let files = [done("a.bin", 10), open("DONE", 0)];
        assert_eq!(
            verdict(Format::Generic, &snap("x", &files, &[], &[]), &names),
            Verdict::Open
        );
        let files = [open("a.bin", 10), done("DONE", 0)];
        assert_eq!(
            verdict(Format::Generic, &snap("x", &files, &[], &[]), &names),
            Verdict::Open
        );
        let files = [done("a.bin", 10), done("DONE", 0)];
        assert_eq!(
            verdict(Format::Generic, &snap("x", &files, &[], &[]), &[]),
            Verdict::Open
        );
    }
}
