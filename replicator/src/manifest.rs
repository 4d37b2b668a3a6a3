//! Checkpoint manifests: the shards of a checkpoint directory with size,
//! mode, mtime and per-chunk BLAKE3 hashes, and one BLAKE3 root over all.

use std::collections::HashSet;
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::paths::{check_relative, is_temporary};
use crate::wire::{FileInfo, Reader, WireError, Writer, MAX_CHUNKS, MAX_FILES};

/// A BLAKE3 hash (32 bytes).
pub type Hash = [u8; 32];

/// Default chunk size in bytes (4 MiB): the unit of hashing, resume and
/// scheduling (ARCHITECTURE.md, "Vocabulary").
pub const DEFAULT_CHUNK_SIZE: u32 = 4 << 20;

/// Smallest chunk size accepted from a peer, in bytes (64 KiB).
pub const MIN_CHUNK_SIZE: u32 = 64 << 10;

/// Domain separation for the manifest root, so a root can never be
/// confused with the hash of a data chunk.
const ROOT_CONTEXT: &[u8] = b"ferry manifest v1\0";

/// One shard of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileEntry {
    /// Path relative to the checkpoint directory, `/`-separated.
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// Unix permission bits.
    pub mode: u32,
    /// Modification time, nanoseconds since the Unix epoch.
    pub mtime_ns: i64,
    /// BLAKE3 hash of each chunk, in order; `ceil(size / chunk_size)`
    /// entries (none for an empty file).
    pub chunks: Vec<Hash>,
}

impl FileEntry {
    /// The file's identity without hashes.
    pub fn info(&self) -> FileInfo {
        FileInfo {
            path: self.path.clone(),
            size: self.size,
            mode: self.mode,
            mtime_ns: self.mtime_ns,
        }
    }
}

/// The sealed list of a checkpoint's shards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    /// Chunk size in bytes.
    pub chunk_size: u32,
    /// Files in transfer order (commit markers last).
    pub files: Vec<FileEntry>,
    /// Indices into `files` of the commit markers, in the order the sink
    /// must publish them (after everything else).
    pub markers: Vec<u32>,
}

/// Number of chunks of a file of `size` bytes.
pub fn chunk_count(size: u64, chunk_size: u32) -> u64 {
    size.div_ceil(u64::from(chunk_size))
}

/// Length in bytes of chunk `chunk` of a file of `size` bytes.
pub fn chunk_len(size: u64, chunk_size: u32, chunk: u64) -> u64 {
    let start = chunk * u64::from(chunk_size);
    (size.saturating_sub(start)).min(u64::from(chunk_size))
}

/// Maps (file, chunk) pairs to chunk keys for one file table and back.
///
/// A chunk key is `file << 32 | chunk` (a `u64`): it names a chunk by its
/// file's position in the transfer's file table and its index in that
/// file, so keys stay valid while the table grows (new files appended,
/// files still being written getting longer). Keys are what `Have` and
/// `Need` carry and what the sink's catalog records per verified chunk.
#[derive(Debug, Clone)]
pub struct ChunkMap {
    chunk_size: u32,
    sizes: Vec<u64>,
}

/// Bits of a chunk key that hold the chunk index.
const KEY_CHUNK_BITS: u32 = 32;

impl ChunkMap {
    /// Builds the map for `files` with `chunk_size`-byte chunks.
    pub fn new(files: &[FileInfo], chunk_size: u32) -> Self {
        ChunkMap {
            chunk_size,
            sizes: files.iter().map(|f| f.size).collect(),
        }
    }

    /// Total number of chunks.
    pub fn total(&self) -> u64 {
        self.sizes
            .iter()
            .map(|s| chunk_count(*s, self.chunk_size))
            .sum()
    }

    /// Number of files in the table.
    pub fn len(&self) -> usize {
        self.sizes.len()
    }

    /// True if the table has no files.
    pub fn is_empty(&self) -> bool {
        self.sizes.is_empty()
    }

    /// Sets the size of `file` (bytes), appending empty entries up to it
    /// if the table is shorter: files grow and appear while a checkpoint
    /// is written.
    pub fn set_size(&mut self, file: u32, size: u64) {
        let f = file as usize;
        if self.sizes.len() <= f {
            self.sizes.resize(f + 1, 0);
        }
        self.sizes[f] = size;
    }

    /// Key of `chunk` of `file`, or `None` if out of range.
    pub fn index(&self, file: u32, chunk: u32) -> Option<u64> {
        let size = *self.sizes.get(file as usize)?;
        (u64::from(chunk) < chunk_count(size, self.chunk_size))
            .then_some(u64::from(file) << KEY_CHUNK_BITS | u64::from(chunk))
    }

    /// The (file, chunk) pair of a key, or `None` if out of range.
    pub fn locate(&self, key: u64) -> Option<(u32, u32)> {
        let (f, c) = ((key >> KEY_CHUNK_BITS) as u32, key as u32);
        self.index(f, c).map(|_| (f, c))
    }

    /// All keys, file by file.
    pub fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.sizes.iter().enumerate().flat_map(move |(f, s)| {
            (0..chunk_count(*s, self.chunk_size)).map(move |c| (f as u64) << KEY_CHUNK_BITS | c)
        })
    }

    /// Byte offset and length of `chunk` of `file`.
    pub fn span(&self, file: u32, chunk: u32) -> (u64, u64) {
        let size = self.sizes.get(file as usize).copied().unwrap_or(0);
        let off = u64::from(chunk) * u64::from(self.chunk_size);
        (off, chunk_len(size, self.chunk_size, u64::from(chunk)))
    }

    /// Size in bytes of file `file`.
    pub fn file_size(&self, file: u32) -> u64 {
        self.sizes.get(file as usize).copied().unwrap_or(0)
    }
}

/// Validates a file list received from a peer: chunk size within bounds,
/// every path a plain relative path ([`check_relative`]), no duplicates,
/// no file that is also a directory of another, total chunks bounded.
///
/// # Errors
/// [`WireError::Invalid`] naming the offending field.
pub fn validate_files(files: &[FileInfo], chunk_size: u32) -> Result<(), WireError> {
    let invalid = |what, why: String| WireError::Invalid { what, why };
    if !(MIN_CHUNK_SIZE..=crate::wire::MAX_CHUNK).contains(&chunk_size) {
        return Err(invalid(
            "chunk size",
            format!(
                "{chunk_size} bytes is outside {MIN_CHUNK_SIZE}..={}",
                crate::wire::MAX_CHUNK
            ),
        ));
    }
    if files.len() > MAX_FILES as usize {
        return Err(invalid("file count", format!("{} files", files.len())));
    }
    let mut seen = HashSet::with_capacity(files.len());
    let mut total_chunks = 0u64;
    for f in files {
        check_relative(&f.path).map_err(|e| invalid("file path", e.to_string()))?;
        if !seen.insert(f.path.as_str()) {
            return Err(invalid("file path", format!("{:?} listed twice", f.path)));
        }
        // Sizes come from the peer: saturate rather than overflow (65,536
        // files of 2^64 - 1 bytes would wrap the total to 0).
        total_chunks = total_chunks.saturating_add(chunk_count(f.size, chunk_size));
    }
    // A file may not also be a parent directory of another file.
    for f in files {
        let mut p = f.path.as_str();
        while let Some(i) = p.rfind('/') {
            p = &p[..i];
            if seen.contains(p) {
                return Err(invalid(
                    "file path",
                    format!("{p:?} is both a file and a directory"),
                ));
            }
        }
    }
    if total_chunks > u64::from(MAX_CHUNKS) {
        return Err(invalid("chunk count", format!("{total_chunks} chunks")));
    }
    Ok(())
}

impl Manifest {
    /// The file list without hashes.
    pub fn infos(&self) -> Vec<FileInfo> {
        self.files.iter().map(FileEntry::info).collect()
    }

    /// Total payload bytes.
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }

    /// The BLAKE3 root: the hash of the manifest's canonical encoding.
    pub fn root(&self) -> Hash {
        let mut buf = Vec::with_capacity(64 + self.files.len() * 100);
        self.encode_into(&mut buf);
        let mut h = blake3::Hasher::new();
        h.update(ROOT_CONTEXT);
        h.update(&buf);
        *h.finalize().as_bytes()
    }

    /// Appends the canonical encoding to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        let mut w = Writer(std::mem::take(out));
        w.u32(self.chunk_size);
        w.u32(self.files.len() as u32);
        for f in &self.files {
            w.file_entry(f);
        }
        w.u32(self.markers.len() as u32);
        for m in &self.markers {
            w.u32(*m);
        }
        *out = w.0;
    }

    /// Encodes to a new buffer.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::new();
        self.encode_into(&mut v);
        v
    }

    /// Decodes a manifest encoded by [`Manifest::encode`] and validates it.
    ///
    /// # Errors
    /// [`WireError`] for malformed bytes or an invalid manifest.
    pub fn decode(buf: &[u8]) -> Result<Manifest, WireError> {
        let mut r = Reader::new(buf);
        let m = Manifest::decode_from(&mut r)?;
        r.finish()?;
        Ok(m)
    }

    pub(crate) fn decode_from(r: &mut Reader<'_>) -> Result<Manifest, WireError> {
        let chunk_size = r.u32("chunk size")?;
        let n = r.count("file count", MAX_FILES, 4 + 8 + 4 + 8 + 4)?;
        let mut files = Vec::with_capacity(n);
        for _ in 0..n {
            files.push(r.file_entry()?);
        }
        let nm = r.count("marker count", MAX_FILES, 4)?;
        let mut markers = Vec::with_capacity(nm);
        for _ in 0..nm {
            markers.push(r.u32("marker index")?);
        }
        let m = Manifest {
            chunk_size,
            files,
            markers,
        };
        m.validate()?;
        Ok(m)
    }

    /// Checks paths, chunk counts against sizes and marker indices.
    ///
    /// # Errors
    /// [`WireError::Invalid`] naming what is wrong.
    pub fn validate(&self) -> Result<(), WireError> {
        validate_files(&self.infos(), self.chunk_size)?;
        for f in &self.files {
            if f.chunks.len() as u64 != chunk_count(f.size, self.chunk_size) {
                return Err(WireError::Invalid {
                    what: "chunk count",
                    why: format!(
                        "{:?} has {} bytes but {} chunk hashes",
                        f.path,
                        f.size,
                        f.chunks.len()
                    ),
                });
            }
        }
        for m in &self.markers {
            if *m as usize >= self.files.len() {
                return Err(WireError::Invalid {
                    what: "marker index",
                    why: format!("{m} is not a file index"),
                });
            }
        }
        Ok(())
    }
}

/// How to list a checkpoint directory.
#[derive(Debug, Clone, Default)]
pub struct ScanOptions {
    /// File names (not paths) that are commit markers; they go last, in
    /// this order, and are published last.
    pub markers: Vec<String>,
}

/// Result of [`scan`]: the files to send and which are markers.
#[derive(Debug, Clone)]
pub struct Scan {
    /// Files in transfer order: non-markers sorted by path, then markers.
    pub files: Vec<FileInfo>,
    /// Indices of markers in `files`, in publish order.
    pub markers: Vec<u32>,
}

/// Errors while listing or reading a checkpoint at the source.
#[derive(Debug, thiserror::Error)]
pub enum ScanError {
    /// An I/O error on a named path.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// A file changed while it was read (size or mtime differ).
    #[error("{path} changed while it was being read")]
    Changed {
        /// The path.
        path: PathBuf,
    },
    /// Something in the directory cannot be replicated.
    #[error("{path}: {why}")]
    Unsupported {
        /// The path.
        path: PathBuf,
        /// Why.
        why: String,
    },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> ScanError + '_ {
    move |source| ScanError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Lists the regular files under `dir` (recursively, without following
/// symlinks), skipping temporaries ([`is_temporary`]).
///
/// # Errors
/// [`ScanError`] naming the path that could not be read, or a symlink or
/// special file inside the checkpoint (refused rather than silently
/// skipped, since the replica would differ).
pub fn scan(dir: &Path, opts: &ScanOptions) -> Result<Scan, ScanError> {
    let mut files = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let abs = dir.join(&rel);
        for entry in std::fs::read_dir(&abs).map_err(io_err(&abs))? {
            let entry = entry.map_err(io_err(&abs))?;
            let name = entry.file_name();
            let Some(name_str) = name.to_str() else {
                return Err(ScanError::Unsupported {
                    path: entry.path(),
                    why: "file name is not UTF-8".into(),
                });
            };
            if is_temporary(name_str) {
                continue;
            }
            let rel_child = rel.join(name_str);
            let ft = entry.file_type().map_err(io_err(&entry.path()))?;
            if ft.is_dir() {
                stack.push(rel_child);
            } else if ft.is_file() {
                let md = entry.metadata().map_err(io_err(&entry.path()))?;
                let path = rel_child.to_string_lossy().into_owned();
                files.push(FileInfo {
                    path,
                    size: md.len(),
                    mode: md.permissions().mode() & 0o7777,
                    mtime_ns: md.mtime() * 1_000_000_000 + md.mtime_nsec(),
                });
            } else {
                return Err(ScanError::Unsupported {
                    path: entry.path(),
                    why: "symlinks and special files are not replicated".into(),
                });
            }
        }
    }
    let marker_rank = |p: &str| {
        let name = p.rsplit('/').next().unwrap_or(p);
        opts.markers.iter().position(|m| m == name)
    };
    files.sort_by(|a, b| {
        let ka = (marker_rank(&a.path).map_or(0, |r| r + 1), &a.path);
        let kb = (marker_rank(&b.path).map_or(0, |r| r + 1), &b.path);
        ka.cmp(&kb)
    });
    let markers = files
        .iter()
        .enumerate()
        .filter(|(_, f)| marker_rank(&f.path).is_some())
        .map(|(i, _)| i as u32)
        .collect();
    Ok(Scan { files, markers })
}

/// Reads `path` once, sequentially, in `chunk_size` reads, calling
/// `on_chunk(index, bytes, hash)` for each chunk; returns the chunk hashes.
/// Checks afterwards that size and mtime still match `info`.
///
/// # Errors
/// [`ScanError::Io`] on a read error, [`ScanError::Changed`] if the file
/// is shorter than announced or its size or mtime changed, and whatever
/// `on_chunk` returns.
pub fn read_chunks(
    path: &Path,
    info: &FileInfo,
    chunk_size: u32,
    mut on_chunk: impl FnMut(u32, &[u8], &Hash) -> Result<(), ScanError>,
) -> Result<Vec<Hash>, ScanError> {
    let mut f = File::open(path).map_err(io_err(path))?;
    let n = chunk_count(info.size, chunk_size);
    let mut hashes = Vec::with_capacity(n as usize);
    // Sized to the file, not the chunk: most shards are far smaller than a
    // chunk, and zeroing a 4 MiB buffer per 4 KiB file dominated the
    // source's CPU time.
    let mut buf = vec![0u8; u64::from(chunk_size).min(info.size) as usize];
    for i in 0..n {
        let len = chunk_len(info.size, chunk_size, i) as usize;
        let b = &mut buf[..len];
        f.read_exact(b).map_err(|e| {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                ScanError::Changed {
                    path: path.to_path_buf(),
                }
            } else {
                ScanError::Io {
                    path: path.to_path_buf(),
                    source: e,
                }
            }
        })?;
        let h = *blake3::hash(b).as_bytes();
        on_chunk(i as u32, b, &h)?;
        hashes.push(h);
    }
    let md = f.metadata().map_err(io_err(path))?;
    if md.len() != info.size || md.mtime() * 1_000_000_000 + md.mtime_nsec() != info.mtime_ns {
        return Err(ScanError::Changed {
            path: path.to_path_buf(),
        });
    }
    Ok(hashes)
}

/// Builds the manifest of `dir` by reading every file once.
///
/// # Errors
/// As [`scan`] and [`read_chunks`].
pub fn build(dir: &Path, opts: &ScanOptions, chunk_size: u32) -> Result<Manifest, ScanError> {
    let s = scan(dir, opts)?;
    let mut files = Vec::with_capacity(s.files.len());
    for info in s.files {
        let chunks = read_chunks(&dir.join(&info.path), &info, chunk_size, |_, _, _| Ok(()))?;
        files.push(FileEntry {
            path: info.path,
            size: info.size,
            mode: info.mode,
            mtime_ns: info.mtime_ns,
            chunks,
        });
    }
    Ok(Manifest {
        chunk_size,
        files,
        markers: s.markers,
    })
}

/// Converts a 32-byte hash to lowercase hex.
pub fn hex(h: &Hash) -> String {
    blake3::Hash::from_bytes(*h).to_hex().to_string()
}

/// Parses 64 hex digits into a hash.
pub fn from_hex(s: &str) -> Option<Hash> {
    blake3::Hash::from_hex(s).ok().map(|h| *h.as_bytes())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn write(dir: &Path, rel: &str, len: usize) {
        let p = dir.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, (0..len).map(|i| (i * 7 % 251) as u8).collect::<Vec<_>>()).unwrap();
    }

    #[test]
    fn scan_orders_markers_last_and_skips_temporaries() {
        let d = tempfile::tempdir().unwrap();
        write(d.path(), ".metadata", 10);
        write(d.path(), "__0_0.distcp", 100);
        write(d.path(), "sub/b", 3);
        write(d.path(), ".metadata.tmp", 5);
        write(d.path(), "COMMITTED", 0);
        let s = scan(
            d.path(),
            &ScanOptions {
                markers: vec![".metadata".into(), "COMMITTED".into()],
            },
        )
        .unwrap();
        let names: Vec<_> = s.files.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(names, ["__0_0.distcp", "sub/b", ".metadata", "COMMITTED"]);
        assert_eq!(s.markers, [2, 3]);
    }

    #[test]
    fn chunk_hashes_match_blake3_of_each_range() {
        let d = tempfile::tempdir().unwrap();
        let cs = MIN_CHUNK_SIZE;
        write(d.path(), "big", cs as usize * 2 + 17);
        write(d.path(), "empty", 0);
        let m = build(d.path(), &ScanOptions::default(), cs).unwrap();
        let data = std::fs::read(d.path().join("big")).unwrap();
        let big = &m.files[0];
        assert_eq!(big.chunks.len(), 3);
        assert_eq!(
            big.chunks[2],
            *blake3::hash(&data[2 * cs as usize..]).as_bytes()
        );
        assert!(m.files[1].chunks.is_empty());
        let again = Manifest::decode(&m.encode()).unwrap();
        assert_eq!(again.root(), m.root());
        // Any change to the content changes the root.
        write(d.path(), "empty", 1);
        assert_ne!(
            build(d.path(), &ScanOptions::default(), cs).unwrap().root(),
            m.root()
        );
    }

    #[test]
    fn chunk_map_roundtrips_indices() {
        let files: Vec<FileInfo> = [10u64, 0, 200, 64]
            .iter()
            .enumerate()
            .map(|(i, s)| FileInfo {
                path: format!("f{i}"),
                size: *s,
                mode: 0,
                mtime_ns: 0,
            })
            .collect();
        let mut m = ChunkMap::new(&files, 64);
        // 10 B -> 1 chunk, 0 B -> none, 200 B -> 4, 64 B -> 1.
        assert_eq!(m.total(), 6);
        let keys: Vec<u64> = m.keys().collect();
        assert_eq!(keys.len(), 6);
        for g in &keys {
            let (f, c) = m.locate(*g).unwrap();
            assert_eq!(m.index(f, c), Some(*g));
        }
        assert_eq!(m.index(1, 0), None);
        assert_eq!(m.index(2, 4), None);
        assert_eq!(m.locate(4 << 32), None);
        // Keys stay valid while a file grows and the table gets longer.
        let k = m.index(2, 3).unwrap();
        m.set_size(2, 1000);
        m.set_size(5, 1);
        assert_eq!(m.index(2, 3), Some(k));
        assert_eq!(m.span(2, 3), (192, 64));
        assert_eq!(m.locate(5 << 32), Some((5, 0)));
        m.set_size(2, 200);
        assert_eq!(m.span(2, 3), (192, 8));
    }

    #[test]
    fn hostile_manifests_are_rejected() {
        let entry = |p: &str, size: u64, n: usize| FileEntry {
            path: p.into(),
            size,
            mode: 0o644,
            mtime_ns: 0,
            chunks: vec![[0; 32]; n],
        };
        let cs = MIN_CHUNK_SIZE;
        for files in [
            vec![entry("../x", 1, 1)],
            vec![entry("/abs", 1, 1)],
            vec![entry("a\0b", 1, 1)],
            vec![entry("a", 1, 2)],
            vec![entry("a", 1, 1), entry("a", 1, 1)],
            vec![entry("a", 1, 1), entry("a/b", 1, 1)],
        ] {
            let m = Manifest {
                chunk_size: cs,
                files,
                markers: vec![],
            };
            assert!(Manifest::decode(&m.encode()).is_err(), "{m:?}");
        }
        let m = Manifest {
            chunk_size: cs,
            files: vec![entry("a", 1, 1)],
            markers: vec![3],
        };
        assert!(m.validate().is_err());
        let m = Manifest {
            chunk_size: 1,
            files: vec![],
            markers: vec![],
        };
        assert!(m.validate().is_err());
    }
}
