//! Property-based fuzzing of the sans-IO wire codec and of the path checks
//! that guard the sink root.
//!
//! Every property runs a fixed budget of cases with a fixed seed, so a CI
//! run is reproducible: [`cases`] per property, 2,000 unless the
//! `FERRY_FUZZ_CASES` environment variable raises it for a soak, and the
//! seed is `FERRY_FUZZ_SEED` (default below).
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::{Component, Path};

use ferry_proto::limits::{MAX_CHUNK, MAX_FRAME, MAX_SIBLINGS, MAX_SIBLING_BYTES};
use ferry_proto::manifest::{chunk_count, FileEntry, FileInfo, Manifest, MIN_CHUNK_SIZE};
use ferry_proto::paths::{check_name, check_relative};
use ferry_proto::phases::{Phase, Phases};
use ferry_proto::state::{Profile, TransferId};
use ferry_proto::wire::{
    frame_len, BatchHeader, CheckpointInfo, Commit, Control, Hello, Open, PinRequest, PinTarget,
    RecordHeader, TransferKey, WireError, BATCH_HEADER_LEN, BATCH_HEADER_V4_LEN, DATA_MAGIC,
    RECORD_HEADER_LEN,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};

/// Cases per property in one run.
fn cases() -> u32 {
    std::env::var("FERRY_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000)
}

fn config() -> Config {
    let seed = std::env::var("FERRY_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x00fe_7272_2024_0007);
    Config {
        cases: cases(),
        rng_seed: RngSeed::Fixed(seed),
        // No regression files are written into the source tree; the fixed
        // seed makes every failure reproducible instead.
        failure_persistence: None,
        max_shrink_iters: 2000,
        ..Config::default()
    }
}

/// Heap bytes a decoded message holds, counted generously (every string
/// byte, every vector element at its encoded size). A decoder that only
/// allocates what the input carries keeps this at most the body length.
fn payload_bytes(m: &Control) -> usize {
    let infos = |fs: &[FileInfo]| fs.iter().map(|f| f.path.len() + 24).sum::<usize>();
    match m {
        Control::Hello(h) => h.agent.len() + h.site.len(),
        Control::Open(Open { key, files, .. }) => {
            key.job.len() + key.source_path.len() + key.rel.len() + infos(files)
        }
        Control::Have { chunks, .. } | Control::Need { chunks, .. } => chunks.len() * 8,
        Control::BatchDone { seqs, .. } => seqs.len() * 8,
        Control::Refuse { reason, .. } | Control::Cancel { reason, .. } => reason.len(),
        Control::Files { files, .. } => infos(files),
        Control::Commit(Commit {
            manifest,
            siblings,
            lost,
            ..
        }) => {
            lost.len() * 8
                + manifest
                    .files
                    .iter()
                    .map(|f| f.path.len() + 28 + f.chunks.len() * 32)
                    .sum::<usize>()
                + manifest.markers.len() * 4
                + siblings
                    .iter()
                    .map(|(n, b)| n.len() + b.len())
                    .sum::<usize>()
        }
        Control::Published { local_path, .. } => local_path.len() + 32,
        Control::Pin(p) => p.job.len() + p.reason.len(),
        Control::Error { message } => message.len(),
        // Fixed size: no heap.
        Control::Part { .. } | Control::PartEpoch { .. } => 0,
    }
}

/// What every successful decode of `body` must satisfy: the value is no
/// larger than its input, respects the documented limits, and encodes back
/// to exactly the same bytes (the encoding is canonical).
fn check_decoded(body: &[u8], m: &Control) {
    assert!(
        payload_bytes(m) <= body.len(),
        "{} decoded to {} payload bytes from a {}-byte body",
        m.name(),
        payload_bytes(m),
        body.len()
    );
    if let Control::Commit(Commit {
        manifest, siblings, ..
    }) = m
    {
        assert!(siblings.len() <= MAX_SIBLINGS as usize);
        assert!(siblings
            .iter()
            .all(|(_, b)| b.len() <= MAX_SIBLING_BYTES as usize));
        manifest.validate().unwrap();
    }
    let again = m.encode();
    assert_eq!(&again[4..], body, "re-encoding {} differs", m.name());
    assert_eq!(frame_len(again[..4].try_into().unwrap()), Ok(body.len()));
}

/// Feeds `body` to every decoder that takes a byte slice.
fn decode_all(body: &[u8]) {
    if let Ok(m) = Control::decode(body) {
        check_decoded(body, &m);
    }
    if let Ok(m) = Manifest::decode(body) {
        m.validate().unwrap();
        assert_eq!(m.encode(), body);
    }
    match BatchHeader::decode(body) {
        Ok(h) => {
            assert_eq!(h.encode(), body);
            assert_eq!(h.seq.is_some(), body.len() == BATCH_HEADER_V4_LEN);
        }
        Err(WireError::BadMagic) => assert_ne!(body[..4], DATA_MAGIC),
        Err(e) => {
            assert!(matches!(e, WireError::Invalid { .. }), "{e}");
            assert!(body.len() != BATCH_HEADER_LEN && body.len() != BATCH_HEADER_V4_LEN);
        }
    }
    if let Ok(b) = <&[u8; RECORD_HEADER_LEN]>::try_from(body) {
        let len = u32::from_be_bytes(b[8..12].try_into().unwrap());
        match RecordHeader::decode(b) {
            Ok(h) => {
                assert!(h.len <= MAX_CHUNK);
                assert_eq!(&h.encode(), b);
            }
            Err(e) => {
                assert!(len > MAX_CHUNK, "{e}");
                assert!(matches!(e, WireError::TooLarge { .. }));
            }
        }
    }
}

// ---- strategies for valid values ----

/// Phase durations before and after a commit (protocol version 7).
fn phases() -> impl Strategy<Value = Phases> {
    let side = || prop::collection::vec((0..Phase::ALL.len(), any::<u64>()), 0..5);
    (side(), side()).prop_map(|(before, after)| {
        let mut p = Phases::default();
        for (after_commit, list) in [(false, before), (true, after)] {
            for (i, us) in list {
                let side = if after_commit {
                    &mut p.after
                } else {
                    &mut p.before
                };
                side.insert(Phase::ALL[i], std::time::Duration::from_micros(us));
            }
        }
        p
    })
}

fn short_str() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z0-9._-]{0,12}",
        any::<String>().prop_map(|s| s.chars().take(40).collect()),
    ]
}

fn rel_path() -> impl Strategy<Value = String> {
    prop::collection::vec("[a-zA-Z0-9_-][a-zA-Z0-9._-]{0,10}", 1..4).prop_map(|v| v.join("/"))
}

fn file_info() -> impl Strategy<Value = FileInfo> {
    (short_str(), any::<u64>(), any::<u32>(), any::<i64>()).prop_map(
        |(path, size, mode, mtime_ns)| FileInfo {
            path,
            size,
            mode,
            mtime_ns,
        },
    )
}

/// A manifest that passes [`Manifest::validate`]: distinct single-level
/// paths, chunk hashes matching the sizes, markers naming files.
fn manifest() -> impl Strategy<Value = Manifest> {
    (
        MIN_CHUNK_SIZE..=MAX_CHUNK,
        prop::collection::btree_map("[a-z0-9_-][a-z0-9._-]{0,10}", (0u64..4, any::<u8>()), 0..5),
        prop::collection::vec(any::<u32>(), 0..3),
        any::<u32>(),
        any::<i64>(),
    )
        .prop_map(|(chunk_size, files, markers, mode, mtime_ns)| {
            let files: Vec<FileEntry> = files
                .into_iter()
                .map(|(path, (chunks, fill))| {
                    // A size with exactly `chunks` chunks.
                    let size = if chunks == 0 {
                        0
                    } else {
                        (chunks - 1) * u64::from(chunk_size) + 1 + u64::from(fill)
                    };
                    let n = chunk_count(size, chunk_size);
                    FileEntry {
                        path,
                        size,
                        mode,
                        mtime_ns,
                        chunks: (0..n).map(|i| [fill ^ i as u8; 32]).collect(),
                    }
                })
                .collect();
            let markers = if files.is_empty() {
                vec![]
            } else {
                markers.iter().map(|m| m % files.len() as u32).collect()
            };
            Manifest {
                chunk_size,
                files,
                markers,
            }
        })
}

fn control() -> impl Strategy<Value = Control> {
    let ids = prop::collection::vec(any::<u64>(), 0..20);
    prop_oneof![
        (any::<u16>(), short_str(), short_str()).prop_map(|(version, agent, site)| Control::Hello(
            Hello {
                version,
                agent,
                site
            }
        )),
        (
            (
                any::<u64>(),
                short_str(),
                short_str(),
                rel_path(),
                prop::sample::select(Profile::ALL)
            ),
            any::<u32>(),
            any::<u64>(),
            prop::collection::vec(file_info(), 0..6)
        )
            .prop_map(
                |((id, job, source_path, rel, profile), chunk_size, bytes_total, files)| {
                    Control::Open(Open {
                        key: TransferKey {
                            id: TransferId(id),
                            job,
                            source_path,
                            rel,
                            profile,
                            origin: None,
                        },
                        chunk_size,
                        bytes_total,
                        files,
                        parts_first: false,
                        joins: false,
                    })
                }
            ),
        (any::<u64>(), ids.clone()).prop_map(|(id, chunks)| Control::Have {
            id: TransferId(id),
            chunks
        }),
        (any::<u64>(), ids.clone()).prop_map(|(id, chunks)| Control::Need {
            id: TransferId(id),
            chunks
        }),
        (any::<u64>(), ids.clone()).prop_map(|(id, seqs)| Control::BatchDone {
            id: TransferId(id),
            seqs
        }),
        (any::<u64>(), short_str()).prop_map(|(id, reason)| Control::Refuse {
            id: TransferId(id),
            reason
        }),
        (any::<u64>(), prop::collection::vec(file_info(), 0..6)).prop_map(|(id, files)| {
            Control::Files {
                id: TransferId(id),
                files,
            }
        }),
        (
            (any::<u64>(), any::<i64>(), any::<i64>(), any::<u64>()),
            manifest(),
            prop::collection::vec(
                (short_str(), prop::collection::vec(any::<u8>(), 0..64)),
                0..=MAX_SIBLINGS as usize
            ),
            // Version 2 (nothing), 3 (checkpoint info), 4 (checkpoint
            // info and lost batches, possibly none) or 7 (and phases,
            // possibly none), or 8 (and a weights-only commit).
            prop::option::of((
                prop::option::of(any::<u64>()),
                short_str(),
                ids,
                phases(),
                prop::option::of(1..=u64::MAX),
                any::<bool>()
            ))
        )
            .prop_map(
                |((id, committed_ms, opened_ms, batches), manifest, siblings, tail)| {
                    let (checkpoint, lost, phases, weights_only) = match tail {
                        Some((step, class, lost, phases, readers, weights_only)) => (
                            Some(CheckpointInfo {
                                step,
                                class,
                                readers,
                            }),
                            lost,
                            phases,
                            weights_only,
                        ),
                        None => (None, Vec::new(), Phases::default(), false),
                    };
                    Control::Commit(Commit {
                        id: TransferId(id),
                        committed_ms,
                        opened_ms,
                        batches,
                        manifest,
                        siblings,
                        checkpoint,
                        lost,
                        phases,
                        weights_only,
                    })
                }
            ),
        (any::<u64>(), short_str(), any::<[u8; 32]>(), phases()).prop_map(
            |(id, local_path, root, phases)| Control::Published {
                id: TransferId(id),
                local_path,
                root,
                phases,
            }
        ),
        (any::<u64>(), short_str()).prop_map(|(id, reason)| Control::Cancel {
            id: TransferId(id),
            reason
        }),
        (
            short_str(),
            prop_oneof![
                Just(PinTarget::Newest),
                any::<u64>().prop_map(PinTarget::Step),
                any::<u64>().prop_map(PinTarget::AtOrAfter)
            ],
            short_str(),
            any::<u64>()
        )
            .prop_map(|(job, target, reason, for_ms)| Control::Pin(PinRequest {
                job,
                target,
                reason,
                for_ms
            })),
        short_str().prop_map(|message| Control::Error { message }),
        (
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            0..u64::MAX - 1,
            1..1000u64
        )
            .prop_map(|(id, part, epoch, first_key, len)| Control::Part {
                id: TransferId(id),
                part,
                epoch,
                first_key,
                end_key: first_key.saturating_add(len),
            }),
        (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(id, part, epoch)| {
            Control::PartEpoch {
                id: TransferId(id),
                part,
                epoch,
            }
        }),
    ]
}

/// How a valid encoding is damaged.
#[derive(Debug, Clone)]
enum Mutation {
    /// Flip one bit at a position (taken modulo the length).
    BitFlip(usize, u8),
    /// Keep only a prefix (length modulo the body length).
    Truncate(usize),
    /// Overwrite four bytes at a position with a big-endian value: a length
    /// or count field set to something huge.
    Length(usize, u32),
    /// Overwrite one byte (e.g. the message type).
    Byte(usize, u8),
    /// Insert a byte.
    Insert(usize, u8),
    /// Remove a byte.
    Remove(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let huge = prop_oneof![
        Just(u32::MAX),
        Just(u32::MAX - 1),
        Just(MAX_FRAME as u32),
        Just(MAX_FRAME as u32 + 1),
        Just(MAX_CHUNK + 1),
        Just(1 << 31),
        Just(0x0001_0000),
        any::<u32>(),
    ];
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(i, b)| Mutation::BitFlip(i, b)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), huge).prop_map(|(i, v)| Mutation::Length(i, v)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Byte(i, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Insert(i, b)),
        any::<usize>().prop_map(Mutation::Remove),
    ]
}

fn apply(body: &mut Vec<u8>, m: &Mutation) {
    let n = body.len();
    if n == 0 {
        return;
    }
    match *m {
        Mutation::BitFlip(i, b) => body[i % n] ^= 1 << b,
        Mutation::Truncate(i) => body.truncate(i % n),
        Mutation::Length(i, v) => {
            let i = i % n;
            for (k, byte) in v.to_be_bytes().iter().enumerate() {
                if let Some(slot) = body.get_mut(i + k) {
                    *slot = *byte;
                }
            }
        }
        Mutation::Byte(i, b) => body[i % n] = b,
        Mutation::Insert(i, b) => body.insert(i % (n + 1), b),
        Mutation::Remove(i) => {
            body.remove(i % n);
        }
    }
}

proptest! {
    #![proptest_config(config())]

    /// Arbitrary bytes into every decoder: never a panic; anything accepted
    /// is bounded by its input and canonical. The first byte is biased
    /// toward the known message types so bodies reach deep into each
    /// decoder.
    #[test]
    fn arbitrary_bytes_never_panic(
        ty in prop_oneof![0u8..=13, any::<u8>()],
        rest in prop::collection::vec(any::<u8>(), 0..300),
    ) {
        let mut body = vec![ty];
        body.extend_from_slice(&rest);
        decode_all(&body);
        decode_all(&rest);
        if rest.len() >= 4 {
            let prefix: [u8; 4] = rest[..4].try_into().unwrap();
            let n = u32::from_be_bytes(prefix) as usize;
            match frame_len(prefix) {
                Ok(len) => prop_assert!(len == n && (1..=MAX_FRAME).contains(&len)),
                Err(_) => prop_assert!(n == 0 || n > MAX_FRAME),
            }
        }
    }

    /// Fixed-size headers: every 12-, 20- and 44-byte input.
    #[test]
    fn arbitrary_headers_never_panic(
        batch in any::<[u8; BATCH_HEADER_V4_LEN]>(),
        magic in any::<bool>(),
        record in prop::collection::vec(any::<u8>(), RECORD_HEADER_LEN),
    ) {
        let mut batch = batch;
        if magic {
            batch[..4].copy_from_slice(&DATA_MAGIC);
        }
        decode_all(&batch);
        decode_all(&batch[..BATCH_HEADER_LEN]);
        decode_all(&record);
    }

    /// Valid values round-trip encode → frame_len → decode.
    #[test]
    fn valid_values_roundtrip(m in control()) {
        let frame = m.encode();
        let len = frame_len(frame[..4].try_into().unwrap()).unwrap();
        prop_assert_eq!(len, frame.len() - 4);
        let back = Control::decode(&frame[4..]).unwrap();
        prop_assert_eq!(&back, &m);
        check_decoded(&frame[4..], &back);
    }

    /// Valid headers round-trip (batch headers of versions 2-3 and 4).
    #[test]
    fn valid_headers_roundtrip(
        transfer in any::<u64>(),
        seq in prop::option::of(any::<u64>()),
        file in any::<u32>(),
        chunk in any::<u32>(),
        len in 0..=MAX_CHUNK,
        hash in any::<[u8; 32]>(),
    ) {
        let b = BatchHeader { transfer: TransferId(transfer), seq };
        let bytes = b.encode();
        prop_assert_eq!(bytes.len(), BatchHeader::len_for(if seq.is_some() { 4 } else { 3 }));
        prop_assert_eq!(BatchHeader::decode(&bytes).unwrap(), b);
        let r = RecordHeader { file, chunk, len, hash };
        prop_assert!(RecordHeader::decode(&r.encode()).unwrap() == r);
    }

    /// Damaged valid encodings (one to three mutations): decode to
    /// something valid and bounded, or to an error; never a panic.
    #[test]
    fn mutated_encodings_decode_or_fail_cleanly(
        m in control(),
        muts in prop::collection::vec(mutation(), 1..4),
    ) {
        let mut body = m.encode()[4..].to_vec();
        for mu in &muts {
            apply(&mut body, mu);
        }
        decode_all(&body);
        if let Control::Commit(Commit { manifest, .. }) = &m {
            let mut mb = manifest.encode();
            for mu in &muts {
                apply(&mut mb, mu);
            }
            decode_all(&mb);
        }
    }

    /// Whatever `check_relative` accepts is a plain relative path that
    /// stays under any root it is joined to.
    #[test]
    fn accepted_paths_stay_under_the_root(
        parts in prop::collection::vec(
            prop_oneof![
                Just("..".to_string()),
                Just(".".to_string()),
                Just(String::new()),
                Just("/".to_string()),
                Just("\\".to_string()),
                Just("\0".to_string()),
                Just("a..b".to_string()),
                Just("...".to_string()),
                Just("x".repeat(256)),
                "[a-z.]{1,4}",
                any::<String>().prop_map(|s| s.chars().take(8).collect()),
            ],
            0..8,
        ),
        sep in prop_oneof![Just("/"), Just(""), Just("//"), Just("\\")],
    ) {
        let path = parts.join(sep);
        if check_relative(&path).is_ok() {
            prop_assert!(!path.is_empty());
            prop_assert!(!path.starts_with('/'));
            prop_assert!(!path.contains('\0') && !path.contains('\\'));
            prop_assert!(path.split('/').all(|c| !c.is_empty() && c != "." && c != ".."));
            prop_assert!(Path::new(&path).components().all(|c| matches!(c, Component::Normal(_))));
            let root = Path::new("/srv/ferry/root");
            let joined = root.join(&path);
            prop_assert!(joined.starts_with(root));
            // Lexically resolved, the joined path is still under the root.
            let mut depth = 0i64;
            for c in Path::new(&path).components() {
                match c {
                    Component::ParentDir => depth -= 1,
                    Component::Normal(_) => depth += 1,
                    _ => prop_assert!(false, "{c:?} in {path:?}"),
                }
                prop_assert!(depth > 0);
            }
        }
        if check_name(&path).is_ok() {
            prop_assert!(check_relative(&path).is_ok());
            prop_assert!(!path.contains('/') && !path.starts_with('.'));
            prop_assert_eq!(Path::new(&path).components().count(), 1);
        }
    }
}

/// The fuzzer's budget is what the reliability report says it is.
#[test]
fn the_case_budget_is_fixed() {
    if std::env::var_os("FERRY_FUZZ_CASES").is_none() {
        assert_eq!(cases(), 2000);
    }
}

/// Sizes are peer-controlled `u64`s: 65,536 files of 2^64 - 1 bytes in
/// 64 KiB chunks hold 2^64 chunks in total, which must be refused as too
/// many chunks rather than overflow the running total (a panic in a debug
/// build, a wrap to 0 that passes the limit in a release build).
#[test]
fn chunk_totals_that_overflow_a_u64_are_refused() {
    let files: Vec<FileInfo> = (0..65_536)
        .map(|i| FileInfo {
            path: format!("f{i}"),
            size: u64::MAX,
            mode: 0o644,
            mtime_ns: 0,
        })
        .collect();
    let r = ferry_proto::manifest::validate_files(&files, MIN_CHUNK_SIZE);
    assert!(
        matches!(
            r,
            Err(WireError::Invalid {
                what: "chunk count",
                ..
            })
        ),
        "{r:?}"
    );
    // The same table inside an open frame fits well under MAX_FRAME, so a
    // peer can send it.
    let open = Control::Open(Open {
        key: TransferKey {
            id: TransferId(1),
            job: "j".into(),
            source_path: "/s".into(),
            rel: "r".into(),
            profile: Profile::Full,
            origin: None,
        },
        chunk_size: MIN_CHUNK_SIZE,
        bytes_total: u64::MAX,
        files,
        parts_first: false,
        joins: false,
    });
    assert!(open.encode().len() < MAX_FRAME);
}
