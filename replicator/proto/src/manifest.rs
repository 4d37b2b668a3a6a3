//! Checkpoint manifests: the shards of a checkpoint directory with size,
//! mode, mtime and per-chunk BLAKE3 hashes, and one BLAKE3 root over all.

use std::collections::HashSet;

use crate::codec::{Reader, WireError, Writer};
use crate::limits::{MAX_CHUNK, MAX_CHUNKS, MAX_FILES};
use crate::paths::check_relative;

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

/// A file of a transfer as announced in [`crate::wire::Control::Open`], before its
/// chunks are hashed.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FileInfo {
    /// Path relative to the checkpoint directory, `/`-separated.
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// Unix mode bits (permissions only).
    pub mode: u32,
    /// Modification time, nanoseconds since the Unix epoch.
    pub mtime_ns: i64,
}

impl FileInfo {
    /// Appends the wire encoding: path (`u32` length), size, mode, mtime.
    pub(crate) fn encode(&self, w: &mut Writer) {
        w.long_str(&self.path);
        w.u64(self.size);
        w.u32(self.mode);
        w.i64(self.mtime_ns);
    }

    /// Smallest encoding in bytes, for bounding a count before allocating.
    pub(crate) const MIN_ENCODED: usize = 4 + 8 + 4 + 8;

    /// Reads one encoded by [`FileInfo::encode`].
    pub(crate) fn decode(r: &mut Reader<'_>) -> Result<FileInfo, WireError> {
        Ok(FileInfo {
            path: r.long_str("file path")?,
            size: r.u64("file size")?,
            mode: r.u32("file mode")?,
            mtime_ns: r.i64("file mtime")?,
        })
    }
}

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

    /// Appends the wire encoding: as [`FileInfo::encode`], then the chunk
    /// hashes (`u32` count, 32 bytes each).
    fn encode(&self, w: &mut Writer) {
        w.long_str(&self.path);
        w.u64(self.size);
        w.u32(self.mode);
        w.i64(self.mtime_ns);
        w.u32(self.chunks.len() as u32);
        for h in &self.chunks {
            w.0.extend_from_slice(h);
        }
    }

    /// Reads one encoded by [`FileEntry::encode`].
    fn decode(r: &mut Reader<'_>) -> Result<FileEntry, WireError> {
        let path = r.long_str("file path")?;
        let size = r.u64("file size")?;
        let mode = r.u32("file mode")?;
        let mtime_ns = r.i64("file mtime")?;
        let n = r.count("chunk count", MAX_CHUNKS, 32)?;
        let mut chunks = Vec::with_capacity(n);
        for _ in 0..n {
            chunks.push(r.hash("chunk hash")?);
        }
        Ok(FileEntry {
            path,
            size,
            mode,
            mtime_ns,
            chunks,
        })
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

    /// Payload bytes of the chunks `keys` names, each counted as often as
    /// it is named; a key naming no chunk of the map counts 0.
    pub fn bytes_of(&self, keys: impl IntoIterator<Item = u64>) -> u64 {
        keys.into_iter()
            .filter_map(|k| self.locate(k))
            .map(|(f, c)| self.span(f, c).1)
            .sum()
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
    if !(MIN_CHUNK_SIZE..=MAX_CHUNK).contains(&chunk_size) {
        return Err(invalid(
            "chunk size",
            format!(
                "{chunk_size} bytes is outside {MIN_CHUNK_SIZE}..={}",
                MAX_CHUNK
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
            f.encode(&mut w);
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
            files.push(FileEntry::decode(r)?);
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
        // Bytes of keys: whole and last chunks, a key named twice counts
        // twice, a key of no chunk counts nothing.
        let (a, last) = (m.index(2, 0).unwrap(), m.index(2, 3).unwrap());
        assert_eq!(m.bytes_of([a, last]), 64 + 8);
        assert_eq!(m.bytes_of([a, a, 1 << 32, 4 << 32 | 9]), 128);
        assert_eq!(m.bytes_of(m.keys().collect::<Vec<_>>()), 10 + 200 + 64 + 1);
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
