//! The sink's per-transfer decisions, without I/O: checks of an open
//! request, what to do with the catalog row a transfer finds (new, resume,
//! already published, start over, refuse), the space check, the file
//! table and whether a record lies inside it, matching the sealed manifest to the
//! table, and the verdict at commit (publish, or ask again for what is
//! missing or wrong). Snapshots in, verdicts out, like `formats.rs`; the
//! driver in `sink.rs` reads the catalog and the storage, calls these and
//! carries the verdicts out.

use std::collections::{HashMap, HashSet};

use ferry_proto::manifest::{validate_files, ChunkMap, FileInfo, Hash, Manifest};
use ferry_proto::paths::{check_name, check_relative};
use ferry_proto::state::TransferState;
use ferry_proto::wire::{RecordHeader, TransferKey, WireError};

/// Checks an open request before anything is stored: a valid file table
/// (paths, counts, chunk size), a job name and relative path usable in
/// paths, and `bytes_total` equal to the sum of the file sizes.
///
/// # Errors
/// Why the transfer is refused, naming the field.
pub(crate) fn check_open(
    key: &TransferKey,
    chunk_size: u32,
    bytes_total: u64,
    files: &[FileInfo],
) -> Result<(), String> {
    validate_files(files, chunk_size).map_err(|e| e.to_string())?;
    check_name(&key.job).map_err(|e| format!("job name: {e}"))?;
    check_relative(&key.rel).map_err(|e| format!("relative path: {e}"))?;
    let sum: u64 = files.iter().map(|f| f.size).sum();
    if sum != bytes_total {
        return Err(format!(
            "bytes_total {bytes_total} != sum of file sizes {sum}"
        ));
    }
    Ok(())
}

/// The catalog row an opening transfer found, as much as the decision
/// needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Existing {
    /// Its state.
    pub(crate) state: TransferState,
    /// Its chunk size in bytes.
    pub(crate) chunk_size: u32,
}

/// What to do with an opening transfer's catalog row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum OpenPlan {
    /// No row: create one (and a staging area), reusing unchanged files of
    /// a published older version where possible.
    New,
    /// Published already (the source missed the answer): every chunk is
    /// here; the commit is answered from the catalog.
    AnswerFromReplica,
    /// A resume with the same chunk size: keep the verified chunks,
    /// re-keyed to the file table sent now.
    Resume,
    /// The chunk size changed since the first attempt: forget every chunk
    /// and start over with the new table.
    StartOver,
    /// The row is final (failed or cancelled): refuse with this reason.
    Refuse(String),
}

/// Decides what an opening transfer does with the row it found.
pub(crate) fn plan_open(
    id: impl std::fmt::Display,
    existing: Option<Existing>,
    error: Option<&str>,
    chunk_size: u32,
) -> OpenPlan {
    match existing {
        None => OpenPlan::New,
        Some(e) if e.state == TransferState::Published => OpenPlan::AnswerFromReplica,
        Some(e) if e.state == TransferState::Receiving && e.chunk_size == chunk_size => {
            OpenPlan::Resume
        }
        Some(e) if e.state == TransferState::Receiving => OpenPlan::StartOver,
        Some(e) => OpenPlan::Refuse(format!(
            "transfer {id} already {} at this sink: {}",
            e.state,
            error.unwrap_or("no reason recorded")
        )),
    }
}

/// Verified chunks kept at open, under the file table `map`, and the bytes
/// they cover; keys outside the table are dropped.
pub(crate) fn verified_at_open(
    map: &ChunkMap,
    have: Vec<(u64, Hash)>,
) -> (HashMap<u64, Hash>, u64) {
    let mut verified = HashMap::with_capacity(have.len());
    let mut done = 0u64;
    for (g, h) in have {
        if let Some((f, c)) = map.locate(g) {
            done += map.span(f, c).1;
            verified.insert(g, h);
        }
    }
    (verified, done)
}

/// Bytes a transfer still needs at the sink that the store does not have
/// room for, keeping `reserve` bytes free; `None` when it fits or the
/// store cannot tell (`avail` of `None`, an object store).
pub(crate) fn space_shortfall(
    bytes_total: u64,
    done: u64,
    avail: Option<u64>,
    reserve: u64,
) -> Option<u64> {
    let needed = bytes_total.saturating_sub(done);
    match avail {
        Some(a) if a < needed.saturating_add(reserve) => Some(needed),
        _ => None,
    }
}

/// Matches the sealed manifest to the file table by path (setting each
/// file's final size) and returns its chunk keys with their hashes, one
/// per chunk in manifest order.
///
/// # Errors
/// Why the manifest cannot belong to this transfer.
pub(crate) fn seal(
    table: &mut Table,
    chunk_size: u32,
    m: &Manifest,
) -> Result<Vec<(u64, Hash)>, String> {
    if m.chunk_size != chunk_size {
        return Err(format!(
            "sealed manifest uses {}-byte chunks, the transfer {}",
            m.chunk_size, chunk_size
        ));
    }
    let mut keys = Vec::new();
    for f in &m.files {
        let Some(&fi) = table.by_path.get(&f.path) else {
            return Err(format!(
                "sealed manifest lists {:?}, which the source never announced",
                f.path
            ));
        };
        table.map.set_size(fi, f.size);
        for (ci, h) in f.chunks.iter().enumerate() {
            keys.push((u64::from(fi) << 32 | ci as u64, *h));
        }
    }
    Ok(keys)
}

/// The verdict at commit, once every batch is in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CommitVerdict {
    /// Every chunk of the manifest is verified with its hash: publish.
    Publish,
    /// Ask for these keys again; `wrong` of them were verified against the
    /// hash sent with them but not the manifest's.
    Need {
        /// Keys to send again, in manifest order.
        keys: Vec<u64>,
        /// How many had a hash other than the manifest's.
        wrong: u64,
    },
}

/// Compares the manifest's chunks (`keys`, from [`seal`]) with the chunks
/// verified on arrival.
pub(crate) fn commit_verdict(keys: &[(u64, Hash)], verified: &HashMap<u64, Hash>) -> CommitVerdict {
    let mut need = Vec::new();
    let mut wrong = 0u64;
    for (k, h) in keys {
        match verified.get(k) {
            Some(v) if v == h => {}
            Some(_) => {
                wrong += 1;
                need.push(*k);
            }
            None => need.push(*k),
        }
    }
    if need.is_empty() {
        CommitVerdict::Publish
    } else {
        CommitVerdict::Need { keys: need, wrong }
    }
}

/// The batches of a transfer's run that arrived whole.
#[derive(Debug, Default)]
pub(crate) struct BatchesIn {
    /// Batches without a sequence number (from a version 2 or 3 source),
    /// counted.
    pub(crate) counted: u64,
    /// Sequence numbers of batches from a version 4 source.
    pub(crate) seqs: HashSet<u64>,
}

/// Whether a commit can be decided now: it has arrived, every batch the
/// source announced with it is in (from a version 4 source: each of the
/// sequence numbers `0..announced` except the `lost` ones; from an older
/// one: as many batches as announced), and no publish or failure is under
/// way.
pub(crate) fn commit_ready(
    announced_batches: Option<u64>,
    lost: &HashSet<u64>,
    done: &BatchesIn,
    publishing: bool,
    failed: bool,
) -> bool {
    let Some(b) = announced_batches else {
        return false;
    };
    if publishing || failed {
        return false;
    }
    let awaited = b.saturating_sub(lost.iter().filter(|s| **s < b).count() as u64);
    let arrived = done.counted
        + done
            .seqs
            .iter()
            .filter(|s| **s < b && !lost.contains(s))
            .count() as u64;
    arrived >= awaited
}

/// A transfer's file table: files by position (chunk keys name positions,
/// see [`ChunkMap`]) and by path.
pub(crate) struct Table {
    pub(crate) files: Vec<FileInfo>,
    pub(crate) map: ChunkMap,
    pub(crate) by_path: HashMap<String, u32>,
    /// Every directory that holds a file of the table (`a`, `a/b` for
    /// `a/b/c`), so a new file cannot also be a directory.
    dirs: std::collections::HashSet<String>,
    pub(crate) bytes_total: u64,
    pub(crate) chunks_total: u64,
}

impl Table {
    pub(crate) fn new(files: Vec<FileInfo>, chunk_size: u32) -> Table {
        let map = ChunkMap::new(&files, chunk_size);
        let by_path = files
            .iter()
            .enumerate()
            .map(|(i, f)| (f.path.clone(), i as u32))
            .collect();
        let bytes_total = files.iter().map(|f| f.size).sum();
        let chunks_total = files
            .iter()
            .map(|f| ferry_proto::manifest::chunk_count(f.size, chunk_size))
            .sum();
        let dirs = files.iter().flat_map(|f| parents(&f.path)).collect();
        Table {
            files,
            map,
            by_path,
            dirs,
            bytes_total,
            chunks_total,
        }
    }

    /// Applies a [`Control::Files`] update: entries with a known path
    /// replace that file's size, mode and mtime; others are appended.
    /// Each entry is checked as [`validate_files`] checks a whole table
    /// (plain relative path, not also a directory, bounded counts), at a
    /// cost proportional to the update; on error nothing changes.
    pub(crate) fn update(&mut self, upd: &[FileInfo], chunk_size: u32) -> Result<(), WireError> {
        let invalid = |what, why: String| WireError::Invalid { what, why };
        let mut new_paths = std::collections::HashSet::new();
        let mut new_dirs = std::collections::HashSet::new();
        let mut files = self.files.len();
        let (mut bytes, mut chunks) = (self.bytes_total, self.chunks_total);
        let count = |size| ferry_proto::manifest::chunk_count(size, chunk_size);
        for f in upd {
            ferry_proto::paths::check_relative(&f.path)
                .map_err(|e| invalid("file path", e.to_string()))?;
            if let Some(&i) = self.by_path.get(&f.path) {
                let old = &self.files[i as usize];
                bytes = bytes - old.size + f.size;
                chunks = chunks - count(old.size) + count(f.size);
                continue;
            }
            if !new_paths.insert(f.path.as_str()) {
                return Err(invalid("file path", format!("{:?} listed twice", f.path)));
            }
            new_dirs.extend(parents(&f.path));
            files += 1;
            bytes += f.size;
            chunks += count(f.size);
        }
        for p in &new_paths {
            if self.dirs.contains(*p) || new_dirs.contains(*p) {
                return Err(invalid(
                    "file path",
                    format!("{p:?} is both a file and a directory"),
                ));
            }
        }
        for d in &new_dirs {
            if self.by_path.contains_key(d) {
                return Err(invalid(
                    "file path",
                    format!("{d:?} is both a file and a directory"),
                ));
            }
        }
        if files > ferry_proto::limits::MAX_FILES as usize {
            return Err(invalid("file count", format!("{files} files")));
        }
        if chunks > u64::from(ferry_proto::limits::MAX_CHUNKS) {
            return Err(invalid("chunk count", format!("{chunks} chunks")));
        }
        for f in upd {
            let i = match self.by_path.get(&f.path) {
                Some(&i) => {
                    self.files[i as usize] = f.clone();
                    i
                }
                None => {
                    let i = self.files.len() as u32;
                    self.by_path.insert(f.path.clone(), i);
                    self.files.push(f.clone());
                    i
                }
            };
            self.map.set_size(i, f.size);
        }
        self.dirs.extend(new_dirs);
        self.bytes_total = bytes;
        self.chunks_total = chunks;
        Ok(())
    }

    /// True if a record of `len` bytes for (file, chunk) lies inside the
    /// file as the table knows it.
    pub(crate) fn fits(&self, h: &RecordHeader) -> bool {
        self.map.index(h.file, h.chunk).is_some()
            && u64::from(h.len) <= self.map.span(h.file, h.chunk).1
            && h.len > 0
    }
}

/// The parent directories of a relative path: `a/b/c` gives `a/b`, `a`.
fn parents(path: &str) -> impl Iterator<Item = String> + '_ {
    let mut p = path;
    std::iter::from_fn(move || {
        let i = p.rfind('/')?;
        p = &p[..i];
        Some(p.to_string())
    })
}

/// Keys of a published manifest's chunks under the file table `files`
/// (matched by path and size), with their hashes.
pub(crate) fn published_keys(m: &Manifest, files: &[FileInfo]) -> Vec<(u64, Hash)> {
    let by_path: HashMap<&str, &ferry_proto::manifest::FileEntry> =
        m.files.iter().map(|f| (f.path.as_str(), f)).collect();
    let map = ChunkMap::new(files, m.chunk_size);
    let mut out = Vec::new();
    for (fi, f) in files.iter().enumerate() {
        let Some(e) = by_path.get(f.path.as_str()).filter(|e| e.size == f.size) else {
            continue;
        };
        for (ci, h) in e.chunks.iter().enumerate() {
            if let Some(k) = map.index(fi as u32, ci as u32) {
                out.push((k, *h));
            }
        }
    }
    out
}

/// Re-keys verified chunks from the file table `old` to the table `new`
/// (files matched by path); chunks whose file is gone or now shorter are
/// dropped. Keys and order are unchanged when the tables agree.
pub(crate) fn rekey_chunks(
    old: &[FileInfo],
    new: &[FileInfo],
    chunk_size: u32,
    chunks: &[(u64, Hash)],
) -> Vec<(u64, Hash)> {
    let old_map = ChunkMap::new(old, chunk_size);
    let new_map = ChunkMap::new(new, chunk_size);
    let new_pos: HashMap<&str, u32> = new
        .iter()
        .enumerate()
        .map(|(i, f)| (f.path.as_str(), i as u32))
        .collect();
    chunks
        .iter()
        .filter_map(|(k, h)| {
            let (f, c) = old_map.locate(*k)?;
            let nf = *new_pos.get(old.get(f as usize)?.path.as_str())?;
            Some((new_map.index(nf, c)?, *h))
        })
        .collect()
}

/// The file table a joining open ([`ferry_proto::wire::Open::joins`])
/// works with: the longer of the open's table `open` and the transfer's
/// table at the sink `row` when one is a prefix of the other, file by
/// file (path, size, mode and mtime equal), so every chunk key names the
/// same bytes in both. A watched checkpoint's table grows at its end, and
/// either side may have seen more of it.
///
/// # Errors
/// A reason naming the first position where the two differ.
pub(crate) fn join_table(open: &[FileInfo], row: &[FileInfo]) -> Result<Vec<FileInfo>, String> {
    if let Some((i, (o, r))) = open.iter().zip(row).enumerate().find(|(_, (o, r))| o != r) {
        return Err(format!(
            "the joining open's file table differs from the transfer's at the sink at file {i}: \
             {} ({} bytes, mtime {} ns) against {} ({} bytes, mtime {} ns)",
            o.path, o.size, o.mtime_ns, r.path, r.size, r.mtime_ns
        ));
    }
    Ok(if open.len() > row.len() { open } else { row }.to_vec())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use ferry_proto::state::{Profile, TransferId};

    use super::*;

    const CS: u32 = ferry_proto::manifest::MIN_CHUNK_SIZE;

    fn fi(path: &str, size: u64) -> FileInfo {
        FileInfo {
            path: path.into(),
            size,
            mode: 0o644,
            mtime_ns: 1,
        }
    }

    fn key(job: &str, rel: &str) -> TransferKey {
        TransferKey {
            id: TransferId(7),
            job: job.into(),
            source_path: format!("/ckpt/{job}/{rel}"),
            rel: rel.into(),
            profile: Profile::Full,
            origin: None,
        }
    }

    fn h(b: u8) -> Hash {
        [b; 32]
    }

    /// A joining open keeps the longer of two agreeing tables, whichever
    /// side saw more files, and is refused where they differ (a size,
    /// an mtime, another file in the same place), naming the position.
    #[test]
    fn a_joining_open_takes_the_longer_agreeing_table() {
        let row = vec![fi("a", 10), fi("b", 20)];
        let longer = vec![fi("a", 10), fi("b", 20), fi("c", 5)];
        assert_eq!(join_table(&row[..1], &row).unwrap(), row);
        assert_eq!(join_table(&longer, &row).unwrap(), longer);
        assert_eq!(join_table(&row, &row).unwrap(), row);
        assert_eq!(join_table(&[], &row).unwrap(), row);
        let mut grown = row.clone();
        grown[1].size = 30;
        let e = join_table(&grown, &row).unwrap_err();
        assert!(e.contains("file 1: b (30 bytes"), "{e}");
        let mut touched = row.clone();
        touched[0].mtime_ns = 2;
        assert!(join_table(&touched, &row).unwrap_err().contains("file 0"));
        let other = vec![fi("a", 10), fi("x", 20)];
        assert!(join_table(&other, &longer)
            .unwrap_err()
            .contains("file 1: x"));
    }

    #[test]
    fn file_table_grows_by_path_and_refuses_conflicts() {
        let fi = |p: &str, size| FileInfo {
            path: p.into(),
            size,
            mode: 0o644,
            mtime_ns: 0,
        };
        let cs = ferry_proto::manifest::MIN_CHUNK_SIZE;
        let mut t = Table::new(vec![fi("a/x", 10), fi("b", 0)], cs);
        let key = t.map.index(0, 0).unwrap();
        t.update(&[fi("a/x", 3 * u64::from(cs)), fi("c/d/e", 5)], cs)
            .unwrap();
        assert_eq!(t.files.len(), 3);
        assert_eq!(t.map.index(0, 0), Some(key), "keys survive growth");
        assert_eq!(t.map.file_size(0), 3 * u64::from(cs));
        assert_eq!(t.bytes_total, 3 * u64::from(cs) + 5);
        assert_eq!(t.chunks_total, 4);
        let before = (t.files.clone(), t.bytes_total);
        for bad in [
            vec![fi("a", 1)],                 // an existing directory
            vec![fi("b/y", 1)],               // under an existing file
            vec![fi("n", 1), fi("n/m", 1)],   // both in one update
            vec![fi("p", 1), fi("p", 2)],     // listed twice
            vec![fi("../escape", 1)],         // not a plain relative path
            vec![fi("ok", 1), fi("/abs", 1)], // one bad entry spoils all
        ] {
            assert!(t.update(&bad, cs).is_err(), "{bad:?} accepted");
            assert_eq!(
                (t.files.clone(), t.bytes_total),
                before,
                "{bad:?} changed the table"
            );
        }
        let h = RecordHeader {
            file: 2,
            chunk: 0,
            len: 5,
            hash: [0; 32],
        };
        assert!(t.fits(&h));
        assert!(!t.fits(&RecordHeader { len: 6, ..h }));
        assert!(!t.fits(&RecordHeader { file: 3, ..h }));
    }

    #[test]
    fn open_requests_are_checked_before_anything_is_stored() {
        let files = [fi("a", 10), fi("b/c", 5)];
        assert!(check_open(&key("job", "step_1"), CS, 15, &files).is_ok());
        let e = check_open(&key("job", "step_1"), CS, 16, &files).unwrap_err();
        assert!(e.contains("bytes_total 16") && e.contains("15"), "{e}");
        let e = check_open(&key("job", "../escape"), CS, 15, &files).unwrap_err();
        assert!(e.contains("relative path"), "{e}");
        let e = check_open(&key("a/b", "s"), CS, 15, &files).unwrap_err();
        assert!(e.contains("job name"), "{e}");
        let e = check_open(&key("job", "s"), CS, 10, &[fi("../x", 10)]).unwrap_err();
        assert!(e.contains("file path"), "{e}");
        assert!(
            check_open(&key("job", "s"), 1, 15, &files).is_err(),
            "tiny chunks"
        );
    }

    #[test]
    fn the_row_found_at_open_decides_new_resume_answer_start_over_or_refuse() {
        let row = |state, chunk_size| Some(Existing { state, chunk_size });
        assert_eq!(plan_open(7, None, None, CS), OpenPlan::New);
        assert_eq!(
            plan_open(7, row(TransferState::Published, CS), None, CS),
            OpenPlan::AnswerFromReplica
        );
        assert_eq!(
            plan_open(7, row(TransferState::Receiving, CS), None, CS),
            OpenPlan::Resume
        );
        assert_eq!(
            plan_open(7, row(TransferState::Receiving, CS * 2), None, CS),
            OpenPlan::StartOver,
            "a changed chunk size forgets every chunk"
        );
        match plan_open(7, row(TransferState::Failed, CS), Some("disk full"), CS) {
            OpenPlan::Refuse(why) => {
                assert!(
                    why.contains("transfer 7 already failed") && why.contains("disk full"),
                    "{why}"
                )
            }
            other => panic!("{other:?}"),
        }
        match plan_open(7, row(TransferState::Cancelled, CS), None, CS) {
            OpenPlan::Refuse(why) => assert!(why.contains("no reason recorded"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn verified_chunks_outside_the_table_are_dropped_at_open() {
        let map = ChunkMap::new(&[fi("a", u64::from(CS) + 10)], CS);
        let (v, done) =
            verified_at_open(&map, vec![(0, h(1)), (1, h(2)), (5, h(3)), (1 << 32, h(4))]);
        assert_eq!(v.len(), 2);
        assert_eq!(
            done,
            u64::from(CS) + 10,
            "a full chunk and the 10-byte tail"
        );
    }

    #[test]
    fn space_check_keeps_the_reserve_and_lets_unknown_space_pass() {
        assert_eq!(
            space_shortfall(100, 0, Some(150), 50),
            None,
            "exactly enough"
        );
        assert_eq!(space_shortfall(100, 0, Some(149), 50), Some(100));
        assert_eq!(
            space_shortfall(100, 60, Some(89), 50),
            Some(40),
            "only what is missing"
        );
        assert_eq!(
            space_shortfall(100, 0, None, 50),
            None,
            "an object store cannot tell"
        );
        assert_eq!(
            space_shortfall(100, 200, Some(0), 0),
            None,
            "more done than total"
        );
    }

    #[test]
    fn sealing_matches_the_manifest_by_path_and_fixes_final_sizes() {
        let mut t = Table::new(vec![fi("a", 10), fi("b", 0)], CS);
        let entry = |p: &str, size: u64, n: usize| ferry_proto::manifest::FileEntry {
            path: p.into(),
            size,
            mode: 0o644,
            mtime_ns: 1,
            chunks: vec![h(9); n],
        };
        // "b" grew after the table was sent; the manifest lists it first.
        let m = Manifest {
            chunk_size: CS,
            files: vec![entry("b", u64::from(CS) + 1, 2), entry("a", 10, 1)],
            markers: vec![],
        };
        let keys = seal(&mut t, CS, &m).unwrap();
        assert_eq!(
            keys.iter().map(|k| k.0).collect::<Vec<_>>(),
            [1 << 32, (1 << 32) | 1, 0]
        );
        assert_eq!(t.map.file_size(1), u64::from(CS) + 1);
        let other = Manifest {
            chunk_size: CS * 2,
            ..m.clone()
        };
        assert!(seal(&mut t, CS, &other).unwrap_err().contains("chunks"));
        let stranger = Manifest {
            files: vec![entry("z", 1, 1)],
            ..m
        };
        assert!(seal(&mut t, CS, &stranger)
            .unwrap_err()
            .contains("never announced"));
    }

    #[test]
    fn commit_publishes_only_when_every_chunk_matches_the_manifest() {
        let keys = [(0, h(1)), (1, h(2)), (2, h(3))];
        let mut verified: HashMap<u64, Hash> = keys.iter().copied().collect();
        assert_eq!(commit_verdict(&keys, &verified), CommitVerdict::Publish);
        verified.insert(1, h(7));
        verified.remove(&2);
        assert_eq!(
            commit_verdict(&keys, &verified),
            CommitVerdict::Need {
                keys: vec![1, 2],
                wrong: 1
            }
        );
    }

    #[test]
    fn commit_waits_for_its_batches_and_for_no_publish_under_way() {
        let none = HashSet::new();
        let counted = |n| BatchesIn {
            counted: n,
            ..BatchesIn::default()
        };
        assert!(
            !commit_ready(None, &none, &counted(5), false, false),
            "no commit yet"
        );
        assert!(
            !commit_ready(Some(3), &none, &counted(2), false, false),
            "a batch still out"
        );
        assert!(commit_ready(Some(3), &none, &counted(3), false, false));
        assert!(
            !commit_ready(Some(3), &none, &counted(3), true, false),
            "publishing"
        );
        assert!(
            !commit_ready(Some(3), &none, &counted(4), false, true),
            "failed"
        );
    }

    #[test]
    fn a_version_4_commit_waits_for_each_batch_but_the_lost_ones() {
        let seqs = |s: &[u64]| BatchesIn {
            counted: 0,
            seqs: s.iter().copied().collect(),
        };
        let lost: HashSet<u64> = [1, 4].into_iter().collect();
        // 0..5 without 1 and 4: 0, 2, 3.
        assert!(commit_ready(
            Some(5),
            &lost,
            &seqs(&[0, 2, 3]),
            false,
            false
        ));
        assert!(
            !commit_ready(Some(5), &lost, &seqs(&[0, 2]), false, false),
            "batch 3 still out"
        );
        // A lost batch that arrived anyway does not stand in for another.
        assert!(
            !commit_ready(Some(5), &lost, &seqs(&[0, 1, 2, 4]), false, false),
            "batch 3 still out"
        );
        // Nor does a batch of a later round (seq 5 and up).
        assert!(
            !commit_ready(Some(5), &lost, &seqs(&[0, 2, 5]), false, false),
            "batch 3 still out"
        );
        assert!(
            commit_ready(Some(5), &lost, &seqs(&[0, 1, 2, 3, 4, 5]), false, false),
            "everything in"
        );
        // Without losses, every batch counts.
        assert!(!commit_ready(
            Some(3),
            &HashSet::new(),
            &seqs(&[0, 2]),
            false,
            false
        ));
        assert!(commit_ready(
            Some(3),
            &HashSet::new(),
            &seqs(&[2, 0, 1]),
            false,
            false
        ));
    }

    #[test]
    fn an_older_version_s_chunks_count_only_for_files_of_the_same_path_and_size() {
        let m = Manifest {
            chunk_size: CS,
            files: vec![
                ferry_proto::manifest::FileEntry {
                    path: "w".into(),
                    size: 10,
                    mode: 0o644,
                    mtime_ns: 1,
                    chunks: vec![h(1)],
                },
                ferry_proto::manifest::FileEntry {
                    path: "o".into(),
                    size: 20,
                    mode: 0o644,
                    mtime_ns: 1,
                    chunks: vec![h(2)],
                },
            ],
            markers: vec![],
        };
        // The new table lists "o" first and with another size.
        let keys = published_keys(&m, &[fi("o", 21), fi("w", 10)]);
        assert_eq!(keys, [(1 << 32, h(1))]);
    }

    #[test]
    fn resumed_chunks_follow_their_file_when_the_table_changes() {
        let old = [fi("a", u64::from(CS) * 2), fi("b", 5)];
        let chunks = [(0, h(1)), (1, h(2)), (1 << 32, h(3))];
        assert_eq!(rekey_chunks(&old, &old, CS, &chunks), chunks, "same table");
        // "b" moved to the front, "a" shrank to one chunk, "c" is new.
        let new = [fi("b", 5), fi("a", u64::from(CS)), fi("c", 1)];
        assert_eq!(
            rekey_chunks(&old, &new, CS, &chunks),
            [(1 << 32, h(1)), (0, h(3))]
        );
        assert!(rekey_chunks(&old, &[fi("c", 9)], CS, &chunks).is_empty());
    }
}
