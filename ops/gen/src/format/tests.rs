//! Tests of [`save`]: per format, the file set, the order of operations
//! (from the save's own trace), sizes, framing, and each fault.

use std::cell::Cell;

use replicator::formats as rf;

use super::framing::{central_directory, tail_eocd};
use super::*;

/// Small enough to keep the suite fast, big enough for every plan.
const TOTAL: u64 = 3_000_000;

struct Run {
    _tmp: tempfile::TempDir,
    opts: SaveOptions,
    summary: SaveSummary,
    trace: Vec<Op>,
    progress: u64,
}

impl Run {
    fn root(&self) -> &Path {
        &self.opts.root
    }

    /// Relative path inside the checkpoint directory.
    fn rel(&self, name: &str) -> PathBuf {
        PathBuf::from(layout::dir_name(self.opts.format, self.opts.step)).join(name)
    }

    /// Index of the first operation of `kind` on `path` (relative to root).
    fn first(&self, kind: &OpKind, path: &Path) -> usize {
        self.trace
            .iter()
            .position(|op| &op.kind == kind && op.path == path)
            .unwrap_or_else(|| panic!("no {kind:?} of {path:?} in {:#?}", self.trace))
    }

    /// Index of the last operation of `kind` on `path`.
    fn last(&self, kind: &OpKind, path: &Path) -> usize {
        self.trace
            .iter()
            .rposition(|op| &op.kind == kind && op.path == path)
            .unwrap_or_else(|| panic!("no {kind:?} of {path:?}"))
    }

    /// Every regular file under the checkpoint directory: relative path
    /// (to the directory) and size.
    fn files(&self) -> Vec<(PathBuf, u64)> {
        let dir = &self.summary.dir;
        let mut out = Vec::new();
        let mut stack = vec![dir.clone()];
        while let Some(d) = stack.pop() {
            for entry in fs::read_dir(&d).unwrap() {
                let entry = entry.unwrap();
                let meta = entry.metadata().unwrap();
                if meta.is_dir() {
                    stack.push(entry.path());
                } else {
                    let rel = entry.path().strip_prefix(dir).unwrap().to_path_buf();
                    out.push((rel, meta.len()));
                }
            }
        }
        out.sort();
        out
    }

    fn read(&self, rel_to_root: impl AsRef<Path>) -> Vec<u8> {
        fs::read(self.root().join(rel_to_root)).unwrap()
    }

    fn mtime(&self, rel_to_root: impl AsRef<Path>) -> SystemTime {
        fs::metadata(self.root().join(rel_to_root))
            .unwrap()
            .modified()
            .unwrap()
    }
}

fn options(dir: &Path, format: GenFormat, fault: Fault, ranks: u32) -> SaveOptions {
    SaveOptions {
        ranks,
        fault,
        seed: 11,
        ..SaveOptions::new(dir.join("root"), format, TOTAL)
    }
}

fn run_with(opts: SaveOptions, tmp: tempfile::TempDir) -> Run {
    let last = Cell::new(0u64);
    let (summary, trace) = save_traced(&opts, &|n| {
        assert!(n >= last.get(), "progress never goes back");
        last.set(n);
    })
    .unwrap();
    Run {
        _tmp: tmp,
        opts,
        summary,
        trace,
        progress: last.get(),
    }
}

fn run(format: GenFormat, fault: Fault, ranks: u32) -> Run {
    let tmp = tempfile::tempdir().unwrap();
    let opts = options(tmp.path(), format, fault, ranks);
    run_with(opts, tmp)
}

/// Checks shared by every committed save: on-disk totals match the
/// summary and the target, the marker exists and was committed.
fn check_committed(r: &Run) {
    let s = &r.summary;
    let files = r.files();
    let root_bytes: u64 = s.bytes - files.iter().map(|f| f.1).sum::<u64>();
    assert!(
        root_bytes < 100,
        "only small root-level markers: {root_bytes}"
    );
    assert!(s.files >= files.len() as u64);
    assert!(
        s.bytes.abs_diff(TOTAL) * 100 <= TOTAL * 2,
        "{} bytes for a {TOTAL} target",
        s.bytes
    );
    assert!(s.marker.exists(), "{:?}", s.marker);
    let committed = s.committed_at.unwrap();
    assert!(committed >= s.opened_at);
    assert!(s.tensors > 0);
    if r.opts.fault == Fault::None {
        assert_eq!(r.progress, s.bytes, "every byte on disk was reported once");
    }
}

fn small_fraction(s: &SaveSummary) -> f64 {
    s.small_tensors as f64 / s.tensors as f64
}

fn has_tail_eocd(bytes: &[u8]) -> bool {
    tail_eocd(bytes).is_some_and(|e| e.archive_start + e.cd_offset < bytes.len() as u64)
}

#[test]
fn gen_format_and_fault_names_round_trip() {
    for f in GenFormat::ALL {
        assert_eq!(f.to_string().parse::<GenFormat>(), Ok(f));
    }
    for f in Fault::ALL {
        assert_eq!(f.to_string().parse::<Fault>(), Ok(f));
    }
    assert_eq!("megatron".parse(), Ok(GenFormat::MegatronLegacy));
    assert_eq!("kill".parse(), Ok(Fault::KillMidSave));
    let err = "torch".parse::<GenFormat>().unwrap_err();
    assert!(
        err.contains("\"torch\"") && err.contains("hf_trainer, generic"),
        "{err}"
    );
    let err = "crash".parse::<Fault>().unwrap_err();
    assert!(
        err.contains("zero-byte") && err.contains("reused-dir"),
        "{err}"
    );
}

#[test]
fn gen_format_sizes_track_the_target_at_any_scale() {
    for format in GenFormat::ALL {
        for (total, ranks) in [(2_000_000, 1), (50_000_000, 4), (1_400_000_000, 8)] {
            let opts = SaveOptions {
                ranks,
                ..SaveOptions::new("/nonexistent", format, total)
            };
            let layout = layout::build(&opts, 0).unwrap();
            let err = layout.expected_bytes.abs_diff(total) as f64 / total as f64;
            assert!(err < 0.01, "{format} {total}: {}", layout.expected_bytes);
        }
    }
}

#[test]
fn gen_format_rejects_impossible_options() {
    let tmp = tempfile::tempdir().unwrap();
    let check = |opts: SaveOptions| {
        let err = save(&opts, &|_| {}).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");
    };
    let base = options(tmp.path(), GenFormat::Dcp, Fault::None, 2);
    check(SaveOptions {
        ranks: 0,
        ..base.clone()
    });
    check(SaveOptions {
        write_rate_bps: Some(0),
        ..base.clone()
    });
    check(SaveOptions {
        total_bytes: 10_000,
        ..base.clone()
    });
    check(SaveOptions {
        fault: Fault::StaleMarker,
        step: 0,
        ..base.clone()
    });
    check(SaveOptions {
        format: GenFormat::Generic,
        marker: "../x".into(),
        ..base.clone()
    });
    assert!(
        !base.root.exists(),
        "nothing is written for invalid options"
    );
}

#[test]
fn gen_dcp_metadata_is_renamed_in_after_every_distcp_closed() {
    let r = run(GenFormat::Dcp, Fault::None, 3);
    check_committed(&r);
    let names: Vec<_> = r.files().into_iter().map(|f| f.0).collect();
    let want: Vec<PathBuf> = [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
        .iter()
        .map(PathBuf::from)
        .collect();
    assert_eq!(names, want);
    assert_eq!(r.trace[0].kind, OpKind::Mkdir);
    let tmp = r.rel(".metadata.tmp");
    let meta = r.rel(".metadata");
    let created = r.first(&OpKind::Create, &tmp);
    for rank in 0..3 {
        let data = r.rel(&format!("__{rank}_0.distcp"));
        let fsync = r.first(&OpKind::Fsync, &data);
        let close = r.first(&OpKind::Close, &data);
        assert!(r.first(&OpKind::Create, &data) < fsync && fsync < close);
        assert!(
            close < created,
            "__{rank}_0.distcp closed before .metadata.tmp"
        );
        assert!(
            has_tail_eocd(&r.read(&data)),
            "the file ends in a whole record"
        );
        assert!(r.mtime(&data) <= r.mtime(&meta));
    }
    let fsync = r.first(&OpKind::Fsync, &tmp);
    let close = r.first(&OpKind::Close, &tmp);
    let rename = r.first(&OpKind::Rename(meta.clone()), &tmp);
    assert!(created < fsync && fsync < close && close < rename);
    assert_eq!(
        rename,
        r.trace.len() - 1,
        "the rename is the last operation"
    );
    // DCP's tensor records are per tensor: the plan's mix shows through.
    assert!(small_fraction(&r.summary) > 0.6, "{:?}", r.summary);
    let pickle = r.read(&meta);
    assert_eq!(&pickle[..2], b"\x80\x02");
    assert!(pickle.windows(9).any(|w| w == b"__2_0.dis"));
}

#[test]
fn gen_megatron_dist_writes_metadata_json_then_the_tracker() {
    let r = run(GenFormat::MegatronDist, Fault::None, 2);
    check_committed(&r);
    let meta = r.first(&OpKind::Rename(r.rel(".metadata")), &r.rel(".metadata.tmp"));
    let json = r.first(&OpKind::Close, &r.rel("metadata.json"));
    let tracker = Path::new(layout::MEGATRON_TRACKER);
    let tracker_at = r.first(&OpKind::Create, tracker);
    for rank in 0..2 {
        assert!(r.first(&OpKind::Close, &r.rel(&format!("__{rank}_0.distcp"))) < meta);
    }
    assert!(meta < json && json < tracker_at);
    assert_eq!(r.read(tracker), b"1000");
    let config: serde_json::Value =
        serde_json::from_slice(&r.read(r.rel("metadata.json"))).unwrap();
    assert_eq!(config["sharded_backend"], "torch_dist");
    assert_eq!(r.summary.marker, r.root().join(tracker));
    assert!(small_fraction(&r.summary) > 0.6);
}

#[test]
fn gen_megatron_legacy_ranks_write_their_dirs_before_the_tracker() {
    let r = run(GenFormat::MegatronLegacy, Fault::None, 2);
    check_committed(&r);
    let names: Vec<_> = r.files().into_iter().map(|f| f.0).collect();
    let want: Vec<PathBuf> = [
        "mp_rank_00/distrib_optim.pt",
        "mp_rank_00/model_optim_rng.pt",
        "mp_rank_01/distrib_optim.pt",
        "mp_rank_01/model_optim_rng.pt",
    ]
    .iter()
    .map(PathBuf::from)
    .collect();
    assert_eq!(names, want);
    let tracker = Path::new(layout::MEGATRON_TRACKER);
    let tracker_at = r.first(&OpKind::Create, tracker);
    for rank in ["mp_rank_00", "mp_rank_01"] {
        let optim = r.rel(&format!("{rank}/distrib_optim.pt"));
        let model = r.rel(&format!("{rank}/model_optim_rng.pt"));
        assert!(r.first(&OpKind::Close, &optim) < r.first(&OpKind::Create, &model));
        assert!(r.first(&OpKind::Close, &model) < tracker_at);
        for f in [optim, model] {
            assert!(has_tail_eocd(&r.read(&f)), "{f:?}");
        }
    }
    assert_eq!(r.read(tracker), b"1000");
    assert!(small_fraction(&r.summary) > 0.6);
}

#[test]
fn gen_deepspeed_latest_lands_before_the_last_rank_closes() {
    let r = run(GenFormat::DeepSpeed, Fault::None, 3);
    check_committed(&r);
    let names: Vec<_> = r.files().into_iter().map(|f| f.0).collect();
    let want: Vec<PathBuf> = [
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt",
        "mp_rank_00_model_states.pt",
        "zero_to_fp32.py",
    ]
    .iter()
    .map(PathBuf::from)
    .collect();
    assert_eq!(names, want);
    let latest = Path::new("latest");
    assert_eq!(r.read(latest), b"global_step1000");
    let latest_closed = r.first(&OpKind::Close, latest);
    let last = r.rel("bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt");
    assert!(r.first(&OpKind::Create, &last) < r.first(&OpKind::Create, latest));
    assert!(
        latest_closed < r.first(&OpKind::Close, &last),
        "the documented race"
    );
    assert!(r.mtime(latest) <= r.mtime(&last));
    // Rank 0's own files are closed before it writes `latest`.
    for f in [
        "mp_rank_00_model_states.pt",
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_to_fp32.py",
    ] {
        assert!(r.first(&OpKind::Close, &r.rel(f)) < latest_closed, "{f}");
    }
    for (f, _) in r.files() {
        if f.extension().is_some_and(|e| e == "pt") {
            assert!(has_tail_eocd(&r.read(r.rel(f.to_str().unwrap()))), "{f:?}");
        }
    }
    // Model states hold one storage per weight: the plan's mix.
    let model = r.read(r.rel("mp_rank_00_model_states.pt"));
    let cd = central_directory(&model, tail_eocd(&model).unwrap());
    let storages: Vec<u64> = cd
        .iter()
        .filter(|e| e.0.contains("/data/"))
        .map(|e| e.2)
        .collect();
    let small = storages.iter().filter(|&&b| b < SMALL_SHARD_BYTES).count();
    assert!(small as f64 / storages.len() as f64 > 0.6);
}

/// Parses a safetensors file: (tensor names, header length N, max end).
fn parse_safetensors(bytes: &[u8]) -> (Vec<String>, u64, u64) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    let json: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n as usize]).unwrap();
    let mut names = Vec::new();
    let mut max_end = 0;
    for (name, t) in &json {
        if name == "__metadata__" {
            continue;
        }
        assert!(["BF16", "F32"].contains(&t["dtype"].as_str().unwrap()));
        let end = t["data_offsets"][1].as_u64().unwrap();
        let begin = t["data_offsets"][0].as_u64().unwrap();
        assert!(begin <= end);
        max_end = max_end.max(end);
        names.push(name.clone());
    }
    (names, n, max_end)
}

/// The save_pretrained part of an hf or hf_trainer save.
fn check_save_pretrained(r: &Run) -> usize {
    let config = r.first(&OpKind::Close, &r.rel("config.json"));
    let index = r.rel("model.safetensors.index.json");
    let index_at = r.first(&OpKind::Create, &index);
    let index_json: serde_json::Value = serde_json::from_slice(&r.read(&index)).unwrap();
    let weight_map = index_json["weight_map"].as_object().unwrap();
    let mut listed = 0;
    let mut total = 0;
    let shards: Vec<PathBuf> = r
        .files()
        .into_iter()
        .map(|f| f.0)
        .filter(|f| f.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    assert!(shards.len() >= 2, "{shards:?}");
    for shard in &shards {
        let name = shard.to_str().unwrap();
        assert!(name.ends_with(&format!("-of-{:05}.safetensors", shards.len())));
        let path = r.rel(name);
        let bytes = r.read(&path);
        let (names, n, max_end) = parse_safetensors(&bytes);
        assert_eq!(bytes.len() as u64, 8 + n + max_end, "{name}");
        assert_eq!(n % 8, 0);
        total += max_end;
        for t in &names {
            assert_eq!(weight_map[t], name);
            listed += 1;
        }
        // Temp file, pre-sized, renamed while open, then closed.
        let rename = r
            .trace
            .iter()
            .position(|op| op.kind == OpKind::Rename(path.clone()))
            .unwrap();
        let tmp = &r.trace[rename].path;
        assert!(tmp
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with(".tmp"));
        let create = r.first(&OpKind::Create, tmp);
        // Other ranks' operations may come in between (HF Trainer writes
        // its rng states in parallel): the next one on this file counts.
        let next = r.trace[create + 1..]
            .iter()
            .find(|op| &op.path == tmp)
            .unwrap();
        assert_eq!(next.kind, OpKind::Truncate(bytes.len() as u64));
        assert!(rename < r.first(&OpKind::Close, &path));
        assert!(config < create);
        assert!(r.first(&OpKind::Close, &path) < index_at);
        assert!(r.mtime(&path) <= r.mtime(&index));
    }
    assert_eq!(listed, weight_map.len());
    assert_eq!(index_json["metadata"]["total_size"], total);
    r.first(&OpKind::Close, &index)
}

#[test]
fn gen_hf_shards_go_through_presized_temp_files_and_the_index_is_last() {
    let r = run(GenFormat::Hf, Fault::None, 2);
    check_committed(&r);
    let index_closed = check_save_pretrained(&r);
    assert_eq!(index_closed, r.trace.len() - 1, "the index is written last");
    assert!(r.trace.iter().all(|op| op.rank == 0), "one process writes");
    assert!(small_fraction(&r.summary) > 0.6);
    assert!(!r
        .files()
        .iter()
        .any(|f| f.0.to_str().unwrap().starts_with(".tmp")));
}

#[test]
fn gen_hf_trainer_rng_states_of_other_ranks_close_after_trainer_state() {
    let r = run(GenFormat::HfTrainer, Fault::None, 3);
    check_committed(&r);
    let index_closed = check_save_pretrained(&r);
    let state = r.rel("trainer_state.json");
    let state_created = r.first(&OpKind::Create, &state);
    let state_closed = r.first(&OpKind::Close, &state);
    for f in [
        "training_args.bin",
        "optimizer.pt",
        "scheduler.pt",
        "rng_state_0.pth",
    ] {
        let closed = r.first(&OpKind::Close, &r.rel(f));
        assert!(index_closed < closed && closed < state_created, "{f}");
    }
    for rank in [1, 2] {
        let rng = r.rel(&format!("rng_state_{rank}.pth"));
        assert!(r.first(&OpKind::Create, &rng) < state_created);
        assert!(
            state_closed < r.first(&OpKind::Close, &rng),
            "the documented race"
        );
        assert!(has_tail_eocd(&r.read(&rng)));
    }
    let json: serde_json::Value = serde_json::from_slice(&r.read(&state)).unwrap();
    assert_eq!(json["global_step"], 1000);
    assert!(small_fraction(&r.summary) > 0.6);

    // One process: `rng_state.pth`, nothing to wait for.
    let one = run(GenFormat::HfTrainer, Fault::None, 1);
    check_committed(&one);
    assert!(one.summary.dir.join("rng_state.pth").exists());
}

#[test]
fn gen_generic_writes_the_per_tensor_layout_then_the_marker() {
    let r = run(GenFormat::Generic, Fault::None, 3);
    check_committed(&r);
    let files = r.files();
    let marker = r.rel("COMMITTED");
    let marker_at = r.first(&OpKind::Create, &marker);
    for (f, _) in &files {
        if f != Path::new("COMMITTED") {
            let path = r.rel(f.to_str().unwrap());
            assert!(r.first(&OpKind::Close, &path) < marker_at, "{f:?}");
        }
    }
    assert_eq!(files.len() as u64, r.summary.tensors + 1);
    assert!(r.summary.dir.join("model/lm_head.bin").exists());
    assert!(r.summary.dir.join("vision_tower").is_dir());
    assert!(small_fraction(&r.summary) > 0.6);
    let ranks: std::collections::BTreeSet<u32> = r.trace.iter().map(|op| op.rank).collect();
    assert_eq!(ranks.len(), 3, "every rank wrote tensors");
}

#[test]
fn gen_kill_leaves_partial_files_and_no_marker() {
    for format in [GenFormat::Dcp, GenFormat::DeepSpeed, GenFormat::Hf] {
        let r = run(format, Fault::KillMidSave, 2);
        let s = &r.summary;
        assert_eq!(s.committed_at, None, "{format}");
        assert!(!s.marker.exists(), "{format}: {:?}", s.marker);
        let layout = layout::build(&r.opts, r.opts.seed).unwrap();
        let half = layout.expected_bytes / 2;
        assert_eq!(r.progress, half, "{format}: writes stop at the kill point");
        let files = r.files();
        let partial = files.iter().any(|(f, _)| {
            let bytes = r.read(r.rel(f.to_str().unwrap()));
            match f.extension().and_then(|e| e.to_str()) {
                Some("distcp" | "pt") => !has_tail_eocd(&bytes),
                _ => f.to_str().unwrap().starts_with(".tmp"),
            }
        });
        assert!(partial, "{format}: {files:?}");
    }
}

#[test]
fn gen_truncated_and_zero_byte_damage_one_file_and_still_commit() {
    for format in [
        GenFormat::Dcp,
        GenFormat::MegatronLegacy,
        GenFormat::Hf,
        GenFormat::Generic,
    ] {
        let full = run(format, Fault::None, 2);
        for fault in [Fault::Truncated, Fault::ZeroByte] {
            let r = run(format, fault, 2);
            let s = &r.summary;
            assert!(
                s.committed_at.is_some() && s.marker.exists(),
                "{format} {fault}"
            );
            let damaged = s.damaged.clone().unwrap();
            let rel = damaged.strip_prefix(r.root()).unwrap();
            let whole = fs::metadata(full.root().join(rel)).unwrap().len();
            let len = fs::metadata(&damaged).unwrap().len();
            let want = if fault == Fault::ZeroByte {
                0
            } else {
                whole / 2
            };
            assert_eq!(len, want, "{format} {fault}: {rel:?}");
            // Cut after its close and before the marker.
            let cut = r.first(&OpKind::Truncate(want), rel);
            assert!(r.first(&OpKind::Close, rel) < cut);
            let marker = s.marker.strip_prefix(r.root()).unwrap();
            let marker_at = r
                .trace
                .iter()
                .rposition(|op| op.path == marker || op.kind == OpKind::Rename(marker.into()))
                .unwrap();
            assert!(cut < marker_at, "{format} {fault}");
            if fault == Fault::Truncated && format != GenFormat::Generic {
                let bytes = fs::read(&damaged).unwrap();
                if format == GenFormat::Hf {
                    let (_, n, end) = parse_safetensors(&bytes);
                    assert!((bytes.len() as u64) < 8 + n + end, "{format}");
                } else {
                    assert!(!has_tail_eocd(&bytes), "{format}");
                }
            }
        }
    }
}

#[test]
fn gen_stale_marker_is_written_first_then_replaced() {
    let cases = [
        (
            GenFormat::DeepSpeed,
            "latest",
            "global_step999",
            "global_step1000",
        ),
        (
            GenFormat::MegatronLegacy,
            layout::MEGATRON_TRACKER,
            "999",
            "1000",
        ),
    ];
    for (format, marker, stale, fresh) in cases {
        let r = run(format, Fault::StaleMarker, 2);
        let marker = Path::new(marker);
        let stale_at = r.first(&OpKind::Close, marker);
        let first_data = r
            .trace
            .iter()
            .position(|op| op.kind == OpKind::Create && op.path.starts_with(r.rel("")))
            .unwrap();
        assert!(
            stale_at < first_data,
            "{format}: the stale marker comes first"
        );
        assert!(r.last(&OpKind::Create, marker) > first_data);
        assert_eq!(r.read(marker), fresh.as_bytes());
        assert_ne!(stale, fresh);
        check_committed(&r);
    }
    // Markers inside the directory: present, stale, from the first write.
    for (format, marker) in [
        (GenFormat::Dcp, ".metadata"),
        (GenFormat::Hf, "model.safetensors.index.json"),
        (GenFormat::HfTrainer, "trainer_state.json"),
        (GenFormat::Generic, "COMMITTED"),
    ] {
        let r = run(format, Fault::StaleMarker, 2);
        let marker = r.rel(marker);
        let stale_at = r.first(&OpKind::Close, &marker);
        assert_eq!(r.trace[0].kind, OpKind::Mkdir);
        assert!(
            r.trace[..stale_at]
                .iter()
                .all(|op| op.kind == OpKind::Mkdir || op.path == marker),
            "{format}: nothing but the stale marker before the data"
        );
        check_committed(&r);
    }
    let r = run(GenFormat::HfTrainer, Fault::StaleMarker, 2);
    let json: serde_json::Value =
        serde_json::from_slice(&r.read(r.rel("trainer_state.json"))).unwrap();
    assert_eq!(json["global_step"], 1000);
}

#[test]
fn gen_reused_dir_saves_twice_and_the_second_equals_a_fresh_save_with_seed_plus_one() {
    let r = run(GenFormat::Dcp, Fault::ReusedDir, 2);
    check_committed(&r);
    let meta = r.rel(".metadata");
    let tmp = r.rel(".metadata.tmp");
    let renames: Vec<usize> = r
        .trace
        .iter()
        .enumerate()
        .filter(|(_, op)| op.kind == OpKind::Rename(meta.clone()) && op.path == tmp)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(renames.len(), 2, "committed twice");
    let second_wave = r.trace[renames[0]..]
        .iter()
        .filter(|op| {
            op.kind == OpKind::Create && op.path.extension().is_some_and(|e| e == "distcp")
        })
        .count();
    assert_eq!(
        second_wave, 2,
        "every rank rewrote its file after the first commit"
    );
    assert!(
        r.progress > r.summary.bytes * 19 / 10,
        "both saves reported"
    );

    let tmp_dir = tempfile::tempdir().unwrap();
    let fresh = SaveOptions {
        seed: r.opts.seed + 1,
        ..options(tmp_dir.path(), GenFormat::Dcp, Fault::None, 2)
    };
    let fresh = run_with(fresh, tmp_dir);
    let first = SaveOptions {
        fault: Fault::None,
        ..r.opts.clone()
    };
    let first_dir = tempfile::tempdir().unwrap();
    let first = run_with(
        SaveOptions {
            root: first_dir.path().join("root"),
            ..first
        },
        first_dir,
    );
    for (f, _) in r.files() {
        let name = r.rel(f.to_str().unwrap());
        assert_eq!(
            r.read(&name),
            fresh.read(&name),
            "{f:?} is the second save's"
        );
        if f.extension().is_some_and(|e| e == "distcp") {
            assert_ne!(
                r.read(&name),
                first.read(&name),
                "{f:?} differs from the first"
            );
        }
    }
}

#[test]
fn gen_format_pacing_passes_through_the_throttle() {
    // The sleep budget itself is tested as a pure function in `pace`;
    // here a fast rate only has to leave the result unchanged.
    let tmp = tempfile::tempdir().unwrap();
    let paced = SaveOptions {
        write_rate_bps: Some(10_000_000_000_000),
        ..options(tmp.path(), GenFormat::Generic, Fault::None, 2)
    };
    let r = run_with(paced, tmp);
    check_committed(&r);
    let other = run(GenFormat::Generic, Fault::None, 2);
    assert_eq!(r.files(), other.files());
    let lm = r.rel("model/lm_head.bin");
    assert_eq!(r.read(&lm), other.read(&lm), "same seed, same bytes");
}

#[test]
fn gen_format_presets_with_a_scale_or_a_size() {
    let at = |format, model, scale, total| SaveOptions {
        model,
        scale,
        ..SaveOptions::new("/nonexistent", format, total)
    };
    // A scale fixes the tensors; the size follows (12 bytes per
    // parameter for DCP, plus about 5 MB of framing for 4 ranks' records).
    let small = preview(&at(GenFormat::Dcp, Preset::Llama7b, Some(1e-3), 0)).unwrap();
    let double = preview(&at(GenFormat::Dcp, Preset::Llama7b, Some(2e-3), 0)).unwrap();
    assert_eq!((small.tensors, small.scale), (291, Some(1e-3)));
    let weights = 1e-3 * Preset::Llama7b.params() as f64;
    let per_param = small.bytes as f64 / weights;
    assert!((12.0..13.0).contains(&per_param), "{per_param}");
    let growth = double.bytes as f64 / small.bytes as f64;
    assert!((1.9..2.0).contains(&growth), "{growth}");
    // A size scales the preset to it.
    let sized = preview(&at(GenFormat::Dcp, Preset::Llama70b, None, 50_000_000)).unwrap();
    assert!(sized.bytes.abs_diff(50_000_000) < 500_000, "{sized:?}");
    assert_eq!(sized.tensors, 723);
    assert!(sized.scale.is_some_and(|s| s > 0.0 && s < 1.0), "{sized:?}");
    // The default keeps the size-driven multimodal plan (no scale).
    assert_eq!(
        preview(&SaveOptions::new("/x", GenFormat::Dcp, TOTAL))
            .unwrap()
            .scale,
        None
    );
    // Above the full-scale size: Llama-2-7B in DCP is about 81 GB.
    let err = preview(&at(GenFormat::Dcp, Preset::Llama7b, None, 100_000_000_000)).unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    let msg = err.to_string();
    assert!(msg.contains("100000000000") && msg.contains("dcp"), "{msg}");

    // save_pretrained records the preset's shape.
    let tmp = tempfile::tempdir().unwrap();
    let opts = SaveOptions {
        root: tmp.path().join("root"),
        ..at(GenFormat::Hf, Preset::Llama7b, Some(1e-4), 0)
    };
    let r = run_with(opts, tmp);
    let config: serde_json::Value = serde_json::from_slice(&r.read(r.rel("config.json"))).unwrap();
    assert_eq!(config["hidden_size"], 4096);
    assert_eq!(config["num_hidden_layers"], 32);
    assert_eq!(r.summary.tensors, 291);
}

#[test]
fn gen_generic_shards_write_exactly_n_tensor_files() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = SaveOptions {
        shards: Some(400),
        ..options(tmp.path(), GenFormat::Generic, Fault::None, 3)
    };
    let r = run_with(opts, tmp);
    check_committed(&r);
    assert_eq!(r.files().len(), 401, "400 tensors and the marker");
    assert_eq!(r.summary.tensors, 400);
    assert!(small_fraction(&r.summary) > 0.6, "{:?}", r.summary);

    // Only the per-tensor layout has a file per tensor to count.
    for format in GenFormat::ALL {
        let opts = SaveOptions {
            shards: Some(400),
            ..SaveOptions::new("/nonexistent", format, TOTAL)
        };
        match (format, preview(&opts)) {
            (GenFormat::Generic, result) => assert!(result.is_ok()),
            (_, result) => {
                let err = result.unwrap_err();
                assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
                assert!(err.to_string().contains(format.name()), "{err}");
            }
        }
    }
    // A Llama preset has no tower directories.
    let tmp = tempfile::tempdir().unwrap();
    let opts = SaveOptions {
        model: Preset::Llama7b,
        ..options(tmp.path(), GenFormat::Generic, Fault::None, 2)
    };
    let r = run_with(opts, tmp);
    assert_eq!(r.files().len(), 292);
    assert!(!r.summary.dir.join("vision_tower").exists());
}

/// What the watcher would see of a checkpoint directory: every file
/// complete, content read where [`replicator::formats::wants_content`]
/// asks for it (auto mode, so a superset of any one format's).
struct Seen {
    dir: String,
    files: Vec<rf::FileState>,
    siblings: Vec<rf::FileState>,
    sibling_dirs: Vec<String>,
}

fn file_state(path: String, on_disk: &Path) -> rf::FileState {
    let meta = fs::metadata(on_disk).unwrap();
    let mtime_ns = meta
        .modified()
        .unwrap()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as i64;
    let content = rf::wants_content(None, &path).then(|| fs::read(on_disk).unwrap());
    rf::FileState {
        path,
        size: meta.len(),
        mtime_ns,
        complete: true,
        content,
    }
}

impl Seen {
    /// Snapshot of `dir` (absolute) in its root.
    fn of(dir: &Path) -> Self {
        let root = dir.parent().unwrap();
        let name = dir.file_name().unwrap().to_str().unwrap().to_string();
        let mut files = Vec::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            for entry in fs::read_dir(&d).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    stack.push(path);
                } else {
                    let rel = path.strip_prefix(dir).unwrap().to_str().unwrap();
                    files.push(file_state(rel.replace('\\', "/"), &path));
                }
            }
        }
        files.sort_by(|a, b| a.path.cmp(&b.path));
        let (mut siblings, mut sibling_dirs) = (Vec::new(), Vec::new());
        for entry in fs::read_dir(root).unwrap() {
            let path = entry.unwrap().path();
            let n = path.file_name().unwrap().to_str().unwrap().to_string();
            if path.is_dir() {
                if n != name {
                    sibling_dirs.push(n);
                }
            } else {
                siblings.push(file_state(n, &path));
            }
        }
        Self {
            dir: name,
            files,
            siblings,
            sibling_dirs,
        }
    }

    fn snap(&self) -> rf::Snapshot<'_> {
        rf::Snapshot {
            dir: &self.dir,
            files: &self.files,
            siblings: &self.siblings,
            sibling_dirs: &self.sibling_dirs,
        }
    }

    fn verdict(&self, format: rf::Format) -> rf::Verdict {
        rf::verdict(format, &self.snap(), &[])
    }

    fn paths(&self) -> Vec<&str> {
        self.files.iter().map(|f| f.path.as_str()).collect()
    }
}

/// The four framework saves added with the watcher's formats, the format
/// `recognise` must name, and the markers `verdict` must commit with.
const FRAMEWORK_SAVES: [(GenFormat, rf::Format, &[&str]); 4] = [
    (
        GenFormat::Torchtitan,
        rf::Format::Torchtitan,
        &[".metadata"],
    ),
    (
        GenFormat::Nemo,
        rf::Format::Nemo,
        &["weights/.metadata", "weights/metadata.json"],
    ),
    (GenFormat::Orbax, rf::Format::Orbax, &["commit_success.txt"]),
    (
        GenFormat::ByteCheckpoint,
        rf::Format::ByteCheckpoint,
        &["optimizer/.metadata", "model/.metadata"],
    ),
];

fn markers(v: &rf::Verdict) -> Vec<String> {
    match v {
        rf::Verdict::Committed { markers, .. } => markers.clone(),
        other => panic!("not committed: {other:?}"),
    }
}

#[test]
fn gen_framework_saves_are_recognised_and_committed_by_the_watcher_detectors() {
    for (format, want, want_markers) in FRAMEWORK_SAVES {
        let r = run(format, Fault::None, 2);
        check_committed(&r);
        assert_eq!(r.summary.dir, r.opts.checkpoint_dir(), "{format}");
        let seen = Seen::of(&r.summary.dir);
        assert_eq!(rf::recognise(&seen.snap()), Some(want), "{format}");
        assert_eq!(markers(&seen.verdict(want)), want_markers, "{format}");
        assert!(
            seen.siblings.is_empty() && seen.sibling_dirs.is_empty(),
            "{format}: no marker or temporary left in the root: {:?} {:?}",
            seen.siblings,
            seen.sibling_dirs
        );
    }
}

#[test]
fn gen_framework_saves_killed_mid_save_stay_open() {
    for (format, want, _) in FRAMEWORK_SAVES {
        let r = run(format, Fault::KillMidSave, 2);
        assert_eq!(r.summary.committed_at, None, "{format}");
        let seen = Seen::of(&r.summary.dir);
        assert!(!seen.files.is_empty(), "{format}: partial files stay");
        assert_eq!(rf::recognise(&seen.snap()), Some(want), "{format}");
        assert_eq!(seen.verdict(want), rf::Verdict::Open, "{format}");
    }
}

#[test]
fn gen_framework_saves_are_open_just_before_their_commit_step() {
    // torchtitan and ByteCheckpoint: the tree as it is before the last
    // `.metadata` rename (the temporary present, the final name absent).
    for (format, want, last) in [
        (GenFormat::Torchtitan, rf::Format::Torchtitan, ".metadata"),
        (
            GenFormat::ByteCheckpoint,
            rf::Format::ByteCheckpoint,
            "model/.metadata",
        ),
    ] {
        let r = run(format, Fault::None, 2);
        let mut seen = Seen::of(&r.summary.dir);
        let f = seen.files.iter_mut().find(|f| f.path == last).unwrap();
        f.path = format!("{last}.tmp");
        assert_eq!(rf::recognise(&seen.snap()), Some(want), "{format}");
        assert_eq!(seen.verdict(want), rf::Verdict::Open, "{format}");
    }
    // NeMo: everything written, the marker not yet removed.
    let r = run(GenFormat::Nemo, Fault::None, 2);
    let mut seen = Seen::of(&r.summary.dir);
    let marker = format!("{}-unfinished", seen.dir);
    seen.siblings.push(rf::FileState {
        path: marker,
        size: 0,
        mtime_ns: 0,
        complete: true,
        content: None,
    });
    assert_eq!(rf::recognise(&seen.snap()), Some(rf::Format::Nemo));
    assert_eq!(seen.verdict(rf::Format::Nemo), rf::Verdict::Open);
    // Orbax: everything written, `commit_success.txt` included, under the
    // temporary name the save renamed from.
    let r = run(GenFormat::Orbax, Fault::None, 2);
    let mut seen = Seen::of(&r.summary.dir);
    let OpKind::Rename(to) = &r.trace.last().unwrap().kind else {
        panic!("the last operation is the rename: {:?}", r.trace.last());
    };
    assert_eq!(to, Path::new("1000"));
    seen.dir = r.trace.last().unwrap().path.to_str().unwrap().to_string();
    assert!(seen.paths().contains(&"commit_success.txt"));
    assert_eq!(rf::recognise(&seen.snap()), Some(rf::Format::Orbax));
    assert_eq!(seen.verdict(rf::Format::Orbax), rf::Verdict::Open);
}

#[test]
fn gen_torchtitan_is_dcp_in_step_n() {
    let r = run(GenFormat::Torchtitan, Fault::None, 2);
    check_committed(&r);
    assert!(r.summary.dir.ends_with("step-1000"));
    let names: Vec<_> = r.files().into_iter().map(|f| f.0).collect();
    let want: Vec<PathBuf> = [".metadata", "__0_0.distcp", "__1_0.distcp"]
        .iter()
        .map(PathBuf::from)
        .collect();
    assert_eq!(names, want);
    let tmp = r.rel(".metadata.tmp");
    let rename = r.first(&OpKind::Rename(r.rel(".metadata")), &tmp);
    for rank in 0..2 {
        let data = r.rel(&format!("__{rank}_0.distcp"));
        assert!(r.first(&OpKind::Close, &data) < r.first(&OpKind::Create, &tmp));
        assert!(has_tail_eocd(&r.read(&data)));
    }
    assert_eq!(rename, r.trace.len() - 1);
}

#[test]
fn gen_nemo_marker_comes_first_and_is_removed_last() {
    let r = run(GenFormat::Nemo, Fault::None, 2);
    check_committed(&r);
    let name = layout::dir_name(GenFormat::Nemo, 1000);
    assert_eq!(name, "model--step=1000-consumed_samples=8000.0");
    let marker = PathBuf::from(format!("{name}-unfinished"));
    assert_eq!(r.trace[0].kind, OpKind::Create);
    assert_eq!(r.trace[0].path, marker, "the marker precedes the directory");
    assert_eq!(r.trace[1].kind, OpKind::Close);
    assert_eq!(r.trace[2].kind, OpKind::Mkdir);
    let removed = r.first(&OpKind::Remove, &marker);
    assert_eq!(removed, r.trace.len() - 1, "the removal is the last step");
    assert!(!r.root().join(&marker).exists());
    let names: Vec<_> = r.files().into_iter().map(|f| f.0).collect();
    let want: Vec<PathBuf> = [
        "context/io.json",
        "context/model.yaml",
        "weights/.metadata",
        "weights/__0_0.distcp",
        "weights/__1_0.distcp",
        "weights/metadata.json",
    ]
    .iter()
    .map(PathBuf::from)
    .collect();
    assert_eq!(names, want);
    let meta = r.first(
        &OpKind::Rename(r.rel("weights/.metadata")),
        &r.rel("weights/.metadata.tmp"),
    );
    for rank in 0..2 {
        assert!(
            r.first(
                &OpKind::Close,
                &r.rel(&format!("weights/__{rank}_0.distcp"))
            ) < meta
        );
    }
    let json = r.first(&OpKind::Close, &r.rel("weights/metadata.json"));
    let io = r.first(&OpKind::Close, &r.rel("context/io.json"));
    assert!(meta < json && json < io && io < removed);
    let config: serde_json::Value =
        serde_json::from_slice(&r.read(r.rel("weights/metadata.json"))).unwrap();
    assert_eq!(config["sharded_backend"], "torch_dist");
}

#[test]
fn gen_orbax_writes_into_the_tmp_dir_and_renames_it_last() {
    let r = run(GenFormat::Orbax, Fault::None, 2);
    check_committed(&r);
    let tmp = PathBuf::from(format!("1000.orbax-checkpoint-tmp-{}", 1_700_000_011));
    for op in &r.trace[..r.trace.len() - 1] {
        assert!(op.path.starts_with(&tmp), "{op:?} is inside {tmp:?}");
    }
    let last = r.trace.last().unwrap();
    assert_eq!(
        (&last.kind, &last.path),
        (&OpKind::Rename(PathBuf::from("1000")), &tmp)
    );
    assert!(!r.root().join(&tmp).exists());
    let names: Vec<String> = r
        .files()
        .into_iter()
        .map(|f| f.0.to_str().unwrap().to_string())
        .collect();
    for want in [
        "_CHECKPOINT_METADATA",
        "commit_success.txt",
        "default/_METADATA",
        "default/_sharding",
        "default/manifest.ocdbt",
        "default/array_metadatas/process_0",
        "default/array_metadatas/process_1",
        "default/ocdbt.process_0/manifest.ocdbt",
        "default/ocdbt.process_1/manifest.ocdbt",
    ] {
        assert!(names.iter().any(|n| n == want), "{want} in {names:?}");
    }
    assert_eq!(names.len(), 11, "and one data file per process: {names:?}");
    let commit = r.first(&OpKind::Close, &tmp.join("commit_success.txt"));
    let metadata = r.first(&OpKind::Close, &tmp.join("default/_METADATA"));
    for p in 0..2 {
        let data = r
            .trace
            .iter()
            .position(|op| {
                op.kind == OpKind::Close
                    && op
                        .path
                        .starts_with(tmp.join(format!("default/ocdbt.process_{p}/d")))
            })
            .unwrap();
        assert!(data < metadata, "process {p}'s data before _METADATA");
    }
    assert!(metadata < commit && commit == r.trace.len() - 2);
}

#[test]
fn gen_bytecheckpoint_commits_optimizer_then_model_metadata() {
    let r = run(GenFormat::ByteCheckpoint, Fault::None, 2);
    check_committed(&r);
    assert!(r.summary.dir.ends_with("global_step_1000"));
    let names: Vec<_> = r.files().into_iter().map(|f| f.0).collect();
    let want: Vec<PathBuf> = [
        "extra_state/extra_state_rank_0.pt",
        "extra_state/extra_state_rank_1.pt",
        "model/.metadata",
        "model/__0_0.distcp",
        "model/__1_0.distcp",
        "optimizer/.metadata",
        "optimizer/__0_0.distcp",
        "optimizer/__1_0.distcp",
    ]
    .iter()
    .map(PathBuf::from)
    .collect();
    assert_eq!(names, want);
    let optim_tmp = r.first(&OpKind::Create, &r.rel("optimizer/.metadata.tmp"));
    let optim = r.first(
        &OpKind::Rename(r.rel("optimizer/.metadata")),
        &r.rel("optimizer/.metadata.tmp"),
    );
    let model_tmp = r.first(&OpKind::Create, &r.rel("model/.metadata.tmp"));
    let model = r.first(
        &OpKind::Rename(r.rel("model/.metadata")),
        &r.rel("model/.metadata.tmp"),
    );
    for f in &names[..] {
        let name = f.to_str().unwrap();
        if !name.ends_with(".metadata") {
            assert!(r.first(&OpKind::Close, &r.rel(name)) < optim_tmp, "{name}");
            assert!(has_tail_eocd(&r.read(r.rel(name))), "{name}");
        }
    }
    assert!(optim < model_tmp && model == r.trace.len() - 1);
}

#[test]
fn gen_framework_saves_refuse_faults_they_cannot_show() {
    let tmp = tempfile::tempdir().unwrap();
    for (format, fault) in [
        (GenFormat::Nemo, Fault::StaleMarker),
        (GenFormat::Orbax, Fault::StaleMarker),
        (GenFormat::ByteCheckpoint, Fault::StaleMarker),
        (GenFormat::Orbax, Fault::ReusedDir),
    ] {
        let opts = options(tmp.path(), format, fault, 2);
        let err = save(&opts, &|_| {}).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{format} {fault}");
    }
}

#[test]
fn gen_stop_flag_ends_a_paced_save_early_without_a_commit() {
    let tmp = tempfile::tempdir().unwrap();
    // 3 MB at 8 Mbit/s would take 3 s.
    let opts = SaveOptions {
        write_rate_bps: Some(8_000_000),
        ..options(tmp.path(), GenFormat::Dcp, Fault::None, 4)
    };
    let stop = opts.stop.clone();
    let stopper = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(200));
        stop.stop();
    });
    let t0 = std::time::Instant::now();
    let e = save(&opts, &|_| {}).unwrap_err();
    stopper.join().unwrap();
    assert!(e.to_string().contains("save stopped"), "{e}");
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(2),
        "{:?}",
        t0.elapsed()
    );
    let dir = opts.checkpoint_dir();
    assert!(
        !dir.join(".metadata").exists(),
        "no commit marker after a stop"
    );
}
