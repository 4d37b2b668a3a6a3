//! Ferry's wire protocol, version 2: a sans-IO codec.
//!
//! Version 2 added [`Control::Files`] (a transfer's file table grows while
//! its checkpoint is written), stable chunk keys (see
//! [`crate::manifest::ChunkMap`]) and the commit and open times in
//! [`Control::Commit`].
//!
//! Two kinds of QUIC streams carry it:
//!
//! - one bidirectional **control stream** per connection, opened by the
//!   source, carrying length-prefixed [`Control`] frames: `u32` big-endian
//!   body length, then a `u8` message type, then the body. The first frame in
//!   each direction is a [`Hello`].
//! - unidirectional **data streams**, one per [`batch`](BatchHeader): a batch
//!   header followed by chunk records back to back until the stream ends. A
//!   batch can end after any record, which is how the sender interrupts a
//!   batch at a chunk boundary.
//!
//! Every length read from a peer is bounded before anything is allocated
//! (see the `MAX_*` constants); a violation is a [`WireError`], never a panic.
//! All integers are big-endian. Strings are UTF-8 with a `u16` length.

use std::fmt;

use crate::manifest::{FileEntry, Hash, Manifest};

/// Protocol version carried in [`Hello`]. Peers with a different version
/// refuse the connection with [`Control::Error`] naming both versions.
pub const PROTOCOL_VERSION: u16 = 2;

/// Largest control frame body accepted, in bytes (64 MiB: a manifest of
/// 100,000 shards with 4 MiB chunks is about 10 MiB).
pub const MAX_FRAME: usize = 64 << 20;

/// Largest chunk payload accepted in a data record, in bytes (64 MiB).
pub const MAX_CHUNK: u32 = 64 << 20;

/// Largest number of files in one manifest.
pub const MAX_FILES: u32 = 4_000_000;

/// Largest number of chunks in one list (have, need, manifest total).
pub const MAX_CHUNKS: u32 = 64_000_000;

/// Largest number of sibling markers in one commit.
pub const MAX_SIBLINGS: u32 = 8;

/// Largest sibling marker accepted, in bytes.
pub const MAX_SIBLING_BYTES: u32 = 4096;

/// Largest relative path accepted, in bytes (Linux `PATH_MAX`).
pub const MAX_PATH: usize = 4096;

/// Magic bytes at the start of every data stream.
pub const DATA_MAGIC: [u8; 4] = *b"FRY1";

/// Size of a [`BatchHeader`] on the wire, in bytes.
pub const BATCH_HEADER_LEN: usize = 4 + 8;

/// Size of a [`RecordHeader`] on the wire, in bytes.
pub const RECORD_HEADER_LEN: usize = 4 + 4 + 4 + 32;

/// A malformed or out-of-bounds message from a peer.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    /// The buffer ended before the message did.
    #[error("message truncated: needed {needed} more bytes for {what}")]
    Truncated {
        /// What was being decoded.
        what: &'static str,
        /// How many more bytes were needed.
        needed: usize,
    },
    /// A length field exceeds its bound.
    #[error("{what} of {got} exceeds the limit of {limit}")]
    TooLarge {
        /// Which length.
        what: &'static str,
        /// The value sent.
        got: u64,
        /// The bound.
        limit: u64,
    },
    /// Unknown message type byte.
    #[error("unknown control message type {0}")]
    UnknownType(u8),
    /// A string was not UTF-8.
    #[error("{0} is not valid UTF-8")]
    Utf8(&'static str),
    /// Bytes left over after a complete message.
    #[error("{0} trailing bytes after message")]
    Trailing(usize),
    /// Data stream does not start with [`DATA_MAGIC`].
    #[error("data stream does not start with the Ferry magic bytes")]
    BadMagic,
    /// A field holds a value that cannot be right.
    #[error("invalid {what}: {why}")]
    Invalid {
        /// Which field.
        what: &'static str,
        /// Why it is invalid.
        why: String,
    },
}

/// First message in each direction on the control stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// [`PROTOCOL_VERSION`] of the sender.
    pub version: u16,
    /// The sender's agent name (also its certificate SAN).
    pub agent: String,
    /// The sender's site, e.g. `train-a`.
    pub site: String,
}

/// Identity of a transfer: where the checkpoint lives at the source and
/// where its replica goes at the sink (`<sink root>/<site>/<job>/<rel>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferKey {
    /// Transfer id assigned by the source (its catalog row id).
    pub id: u64,
    /// The job that wrote the checkpoint.
    pub job: String,
    /// Absolute path of the checkpoint directory at the source.
    pub source_path: String,
    /// Path of the checkpoint relative to its source root.
    pub rel: String,
    /// Replication profile: empty for every file, `weights-only` for a
    /// replica without optimizer state.
    pub profile: String,
}

/// A file of a transfer as announced in [`Control::Open`], before its
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

/// Messages on the control stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Control {
    /// Handshake; see [`Hello`].
    Hello(Hello),
    /// Source to sink: a transfer starts (or resumes). The sink answers
    /// [`Control::Have`] or [`Control::Refuse`].
    Open {
        /// Which transfer.
        key: TransferKey,
        /// Chunk size in bytes used for every file of this transfer.
        chunk_size: u32,
        /// Total bytes of all files.
        bytes_total: u64,
        /// Files in manifest order.
        files: Vec<FileInfo>,
    },
    /// Sink to source: chunk keys already verified at the sink.
    Have {
        /// Source transfer id.
        id: u64,
        /// Chunk keys (see [`crate::manifest::ChunkMap`]).
        chunks: Vec<u64>,
    },
    /// Sink to source: the transfer cannot be accepted.
    Refuse {
        /// Source transfer id.
        id: u64,
        /// Human-readable reason naming the problem.
        reason: String,
    },
    /// Sink to source: send these chunks again (failed verification or
    /// missing at commit).
    Need {
        /// Source transfer id.
        id: u64,
        /// Chunk keys.
        chunks: Vec<u64>,
    },
    /// Source to sink: the file table of a transfer grew while its
    /// checkpoint is being written. Each entry whose path is already in the
    /// table updates that file's size, mode and mtime; any other entry is
    /// appended. Positions never change, so chunk keys stay valid. Sent
    /// before any chunk that needs the new entries.
    Files {
        /// Source transfer id.
        id: u64,
        /// New or changed files.
        files: Vec<FileInfo>,
    },
    /// Source to sink: every chunk was sent; here is the sealed manifest.
    /// Files are matched to the transfer's file table by path; files of the
    /// table that the manifest does not list are not part of the replica.
    Commit {
        /// Source transfer id.
        id: u64,
        /// When the checkpoint was committed at the source (its marker
        /// appeared), Unix milliseconds; 0 if unknown.
        committed_ms: i64,
        /// When the checkpoint opened at the source (its first file or
        /// directory), Unix milliseconds; 0 if unknown.
        opened_ms: i64,
        /// Number of data streams the source sent for this transfer on this
        /// connection, so the sink knows when all of them have arrived.
        batches: u64,
        /// The sealed manifest.
        manifest: Manifest,
        /// Markers that live beside the checkpoint directory (DeepSpeed
        /// `latest`, Megatron's `latest_checkpointed_iteration.txt`):
        /// `(file name, content)`, written next to the replica after it is
        /// in place. At most [`MAX_SIBLINGS`] of [`MAX_SIBLING_BYTES`].
        siblings: Vec<(String, Vec<u8>)>,
    },
    /// Sink to source: the replica is published.
    Published {
        /// Source transfer id.
        id: u64,
        /// Path of the replica at the sink.
        local_path: String,
        /// BLAKE3 root of the published manifest.
        root: Hash,
    },
    /// Either direction: stop this transfer and discard its staging data.
    Cancel {
        /// Source transfer id.
        id: u64,
        /// Why.
        reason: String,
    },
    /// Either direction: a fatal protocol error; the connection closes.
    Error {
        /// Human-readable message.
        message: String,
    },
}

const T_HELLO: u8 = 1;
const T_OPEN: u8 = 2;
const T_HAVE: u8 = 3;
const T_REFUSE: u8 = 4;
const T_NEED: u8 = 5;
const T_COMMIT: u8 = 6;
const T_PUBLISHED: u8 = 7;
const T_CANCEL: u8 = 8;
const T_ERROR: u8 = 9;
const T_FILES: u8 = 10;

impl Control {
    /// Short name of the message type, for logs.
    pub fn name(&self) -> &'static str {
        match self {
            Control::Hello(_) => "hello",
            Control::Open { .. } => "open",
            Control::Have { .. } => "have",
            Control::Refuse { .. } => "refuse",
            Control::Need { .. } => "need",
            Control::Files { .. } => "files",
            Control::Commit { .. } => "commit",
            Control::Published { .. } => "published",
            Control::Cancel { .. } => "cancel",
            Control::Error { .. } => "error",
        }
    }

    /// Encodes the message as one frame (length prefix included).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer(Vec::with_capacity(64));
        w.u32(0); // length placeholder
        match self {
            Control::Hello(h) => {
                w.u8(T_HELLO);
                w.u16(h.version);
                w.str(&h.agent);
                w.str(&h.site);
            }
            Control::Open {
                key,
                chunk_size,
                bytes_total,
                files,
            } => {
                w.u8(T_OPEN);
                w.u64(key.id);
                w.str(&key.job);
                w.long_str(&key.source_path);
                w.long_str(&key.rel);
                w.str(&key.profile);
                w.u32(*chunk_size);
                w.u64(*bytes_total);
                w.u32(files.len() as u32);
                for f in files {
                    w.file_info(f);
                }
            }
            Control::Have { id, chunks } => {
                w.u8(T_HAVE);
                w.u64(*id);
                w.indices(chunks);
            }
            Control::Refuse { id, reason } => {
                w.u8(T_REFUSE);
                w.u64(*id);
                w.long_str(reason);
            }
            Control::Need { id, chunks } => {
                w.u8(T_NEED);
                w.u64(*id);
                w.indices(chunks);
            }
            Control::Files { id, files } => {
                w.u8(T_FILES);
                w.u64(*id);
                w.u32(files.len() as u32);
                for f in files {
                    w.file_info(f);
                }
            }
            Control::Commit {
                id,
                committed_ms,
                opened_ms,
                batches,
                manifest,
                siblings,
            } => {
                w.u8(T_COMMIT);
                w.u64(*id);
                w.u64(*committed_ms as u64);
                w.u64(*opened_ms as u64);
                w.u64(*batches);
                manifest.encode_into(&mut w.0);
                w.u32(siblings.len() as u32);
                for (name, bytes) in siblings {
                    w.str(name);
                    w.u32(bytes.len() as u32);
                    w.0.extend_from_slice(bytes);
                }
            }
            Control::Published {
                id,
                local_path,
                root,
            } => {
                w.u8(T_PUBLISHED);
                w.u64(*id);
                w.long_str(local_path);
                w.0.extend_from_slice(root);
            }
            Control::Cancel { id, reason } => {
                w.u8(T_CANCEL);
                w.u64(*id);
                w.long_str(reason);
            }
            Control::Error { message } => {
                w.u8(T_ERROR);
                w.long_str(message);
            }
        }
        let body_len = (w.0.len() - 4) as u32;
        w.0[..4].copy_from_slice(&body_len.to_be_bytes());
        w.0
    }

    /// Decodes one frame body (without the `u32` length prefix).
    ///
    /// # Errors
    /// [`WireError`] for a truncated, oversized, unknown or trailing-garbage
    /// message.
    pub fn decode(body: &[u8]) -> Result<Control, WireError> {
        let mut r = Reader::new(body);
        let msg = match r.u8("message type")? {
            T_HELLO => Control::Hello(Hello {
                version: r.u16("version")?,
                agent: r.str("agent name")?,
                site: r.str("site")?,
            }),
            T_OPEN => {
                let key = TransferKey {
                    id: r.u64("transfer id")?,
                    job: r.str("job")?,
                    source_path: r.long_str("source path")?,
                    rel: r.long_str("relative path")?,
                    profile: r.str("profile")?,
                };
                let chunk_size = r.u32("chunk size")?;
                let bytes_total = r.u64("bytes total")?;
                let n = r.count("file count", MAX_FILES, 4 + 8 + 4 + 8)?;
                let mut files = Vec::with_capacity(n);
                for _ in 0..n {
                    files.push(r.file_info()?);
                }
                Control::Open {
                    key,
                    chunk_size,
                    bytes_total,
                    files,
                }
            }
            T_HAVE => Control::Have {
                id: r.u64("transfer id")?,
                chunks: r.indices()?,
            },
            T_REFUSE => Control::Refuse {
                id: r.u64("transfer id")?,
                reason: r.long_str("reason")?,
            },
            T_NEED => Control::Need {
                id: r.u64("transfer id")?,
                chunks: r.indices()?,
            },
            T_FILES => {
                let id = r.u64("transfer id")?;
                let n = r.count("file count", MAX_FILES, 4 + 8 + 4 + 8)?;
                let mut files = Vec::with_capacity(n);
                for _ in 0..n {
                    files.push(r.file_info()?);
                }
                Control::Files { id, files }
            }
            T_COMMIT => {
                let id = r.u64("transfer id")?;
                let committed_ms = r.u64("commit time")? as i64;
                let opened_ms = r.u64("open time")? as i64;
                let batches = r.u64("batch count")?;
                let manifest = Manifest::decode_from(&mut r)?;
                let n = r.count("sibling marker count", MAX_SIBLINGS, 2 + 4)?;
                let mut siblings = Vec::with_capacity(n);
                for _ in 0..n {
                    let name = r.str("sibling marker name")?;
                    let len = r.count("sibling marker length", MAX_SIBLING_BYTES, 1)?;
                    siblings.push((name, r.take(len, "sibling marker")?.to_vec()));
                }
                Control::Commit {
                    id,
                    committed_ms,
                    opened_ms,
                    batches,
                    manifest,
                    siblings,
                }
            }
            T_PUBLISHED => Control::Published {
                id: r.u64("transfer id")?,
                local_path: r.long_str("local path")?,
                root: r.hash("manifest root")?,
            },
            T_CANCEL => Control::Cancel {
                id: r.u64("transfer id")?,
                reason: r.long_str("reason")?,
            },
            T_ERROR => Control::Error {
                message: r.long_str("error message")?,
            },
            t => return Err(WireError::UnknownType(t)),
        };
        r.finish()?;
        Ok(msg)
    }
}

/// Reads the body length from a 4-byte frame prefix and checks it against
/// [`MAX_FRAME`].
///
/// # Errors
/// [`WireError::TooLarge`] if the length exceeds [`MAX_FRAME`];
/// [`WireError::Invalid`] for an empty frame.
pub fn frame_len(prefix: [u8; 4]) -> Result<usize, WireError> {
    let len = u32::from_be_bytes(prefix) as usize;
    if len > MAX_FRAME {
        return Err(WireError::TooLarge {
            what: "control frame length",
            got: len as u64,
            limit: MAX_FRAME as u64,
        });
    }
    if len == 0 {
        return Err(WireError::Invalid {
            what: "control frame length",
            why: "empty frame".into(),
        });
    }
    Ok(len)
}

/// Header at the start of every data stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchHeader {
    /// Source transfer id the records belong to.
    pub transfer: u64,
}

impl BatchHeader {
    /// Encodes the header ([`BATCH_HEADER_LEN`] bytes).
    pub fn encode(&self) -> [u8; BATCH_HEADER_LEN] {
        let mut b = [0u8; BATCH_HEADER_LEN];
        b[..4].copy_from_slice(&DATA_MAGIC);
        b[4..].copy_from_slice(&self.transfer.to_be_bytes());
        b
    }

    /// Decodes a header.
    ///
    /// # Errors
    /// [`WireError::BadMagic`] when the magic bytes are wrong.
    pub fn decode(b: &[u8; BATCH_HEADER_LEN]) -> Result<Self, WireError> {
        if b[..4] != DATA_MAGIC {
            return Err(WireError::BadMagic);
        }
        let mut id = [0u8; 8];
        id.copy_from_slice(&b[4..]);
        Ok(BatchHeader {
            transfer: u64::from_be_bytes(id),
        })
    }
}

/// Header of one chunk record in a batch; `len` payload bytes follow.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    /// Index of the file in the transfer's file list.
    pub file: u32,
    /// Index of the chunk within the file (offset = `chunk * chunk_size`).
    pub chunk: u32,
    /// Payload length in bytes (at most [`MAX_CHUNK`]).
    pub len: u32,
    /// BLAKE3 hash of the payload as read at the source.
    pub hash: Hash,
}

impl fmt::Debug for RecordHeader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "record(file {}, chunk {}, {} B)",
            self.file, self.chunk, self.len
        )
    }
}

impl RecordHeader {
    /// Encodes the header ([`RECORD_HEADER_LEN`] bytes).
    pub fn encode(&self) -> [u8; RECORD_HEADER_LEN] {
        let mut b = [0u8; RECORD_HEADER_LEN];
        b[0..4].copy_from_slice(&self.file.to_be_bytes());
        b[4..8].copy_from_slice(&self.chunk.to_be_bytes());
        b[8..12].copy_from_slice(&self.len.to_be_bytes());
        b[12..].copy_from_slice(&self.hash);
        b
    }

    /// Decodes a header and checks `len` against [`MAX_CHUNK`].
    ///
    /// # Errors
    /// [`WireError::TooLarge`] for an oversized payload length.
    pub fn decode(b: &[u8; RECORD_HEADER_LEN]) -> Result<Self, WireError> {
        let mut r = Reader::new(b);
        let file = r.u32("file index")?;
        let chunk = r.u32("chunk index")?;
        let len = r.u32("chunk length")?;
        if len > MAX_CHUNK {
            return Err(WireError::TooLarge {
                what: "chunk length",
                got: len.into(),
                limit: MAX_CHUNK.into(),
            });
        }
        let hash = r.hash("chunk hash")?;
        Ok(RecordHeader {
            file,
            chunk,
            len,
            hash,
        })
    }
}

/// Big-endian byte writer used by the encoders.
pub(crate) struct Writer(pub(crate) Vec<u8>);

impl Writer {
    pub(crate) fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    pub(crate) fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_be_bytes());
    }
    pub(crate) fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_be_bytes());
    }
    pub(crate) fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_be_bytes());
    }
    pub(crate) fn i64(&mut self, v: i64) {
        self.0.extend_from_slice(&v.to_be_bytes());
    }
    /// A short string (`u16` length); longer input is cut at a char boundary.
    pub(crate) fn str(&mut self, s: &str) {
        let s = truncate(s, u16::MAX as usize);
        self.u16(s.len() as u16);
        self.0.extend_from_slice(s.as_bytes());
    }
    /// A long string (`u32` length).
    pub(crate) fn long_str(&mut self, s: &str) {
        let s = truncate(s, MAX_FRAME / 2);
        self.u32(s.len() as u32);
        self.0.extend_from_slice(s.as_bytes());
    }
    fn indices(&mut self, v: &[u64]) {
        self.u32(v.len() as u32);
        for i in v {
            self.u64(*i);
        }
    }
    fn file_info(&mut self, f: &FileInfo) {
        self.long_str(&f.path);
        self.u64(f.size);
        self.u32(f.mode);
        self.i64(f.mtime_ns);
    }
    pub(crate) fn file_entry(&mut self, f: &FileEntry) {
        self.long_str(&f.path);
        self.u64(f.size);
        self.u32(f.mode);
        self.i64(f.mtime_ns);
        self.u32(f.chunks.len() as u32);
        for h in &f.chunks {
            self.0.extend_from_slice(h);
        }
    }
}

fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Bounds-checked big-endian reader used by the decoders.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], WireError> {
        let left = self.buf.len() - self.pos;
        if n > left {
            return Err(WireError::Truncated {
                what,
                needed: n - left,
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    pub(crate) fn u8(&mut self, what: &'static str) -> Result<u8, WireError> {
        Ok(self.take(1, what)?[0])
    }
    pub(crate) fn u16(&mut self, what: &'static str) -> Result<u16, WireError> {
        let b = self.take(2, what)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }
    pub(crate) fn u32(&mut self, what: &'static str) -> Result<u32, WireError> {
        let b = self.take(4, what)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub(crate) fn u64(&mut self, what: &'static str) -> Result<u64, WireError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8, what)?);
        Ok(u64::from_be_bytes(a))
    }
    pub(crate) fn i64(&mut self, what: &'static str) -> Result<i64, WireError> {
        Ok(self.u64(what)? as i64)
    }
    pub(crate) fn hash(&mut self, what: &'static str) -> Result<Hash, WireError> {
        let mut h = [0u8; 32];
        h.copy_from_slice(self.take(32, what)?);
        Ok(h)
    }
    pub(crate) fn str(&mut self, what: &'static str) -> Result<String, WireError> {
        let n = self.u16(what)? as usize;
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| WireError::Utf8(what))
    }
    pub(crate) fn long_str(&mut self, what: &'static str) -> Result<String, WireError> {
        let n = self.u32(what)? as usize;
        if n > MAX_FRAME {
            return Err(WireError::TooLarge {
                what,
                got: n as u64,
                limit: MAX_FRAME as u64,
            });
        }
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| WireError::Utf8(what))
    }
    /// Reads a `u32` element count, bounded by `limit` and by what the rest
    /// of the buffer can hold at `min_elem` bytes per element, so a hostile
    /// count cannot make the decoder allocate more than the frame size.
    pub(crate) fn count(
        &mut self,
        what: &'static str,
        limit: u32,
        min_elem: usize,
    ) -> Result<usize, WireError> {
        let n = self.u32(what)?;
        if n > limit {
            return Err(WireError::TooLarge {
                what,
                got: n.into(),
                limit: limit.into(),
            });
        }
        let n = n as usize;
        if n.saturating_mul(min_elem) > self.remaining() {
            return Err(WireError::Truncated {
                what,
                needed: n * min_elem - self.remaining(),
            });
        }
        Ok(n)
    }
    fn indices(&mut self) -> Result<Vec<u64>, WireError> {
        let n = self.count("chunk index count", MAX_CHUNKS, 8)?;
        (0..n).map(|_| self.u64("chunk index")).collect()
    }
    fn file_info(&mut self) -> Result<FileInfo, WireError> {
        Ok(FileInfo {
            path: self.long_str("file path")?,
            size: self.u64("file size")?,
            mode: self.u32("file mode")?,
            mtime_ns: self.i64("file mtime")?,
        })
    }
    pub(crate) fn file_entry(&mut self) -> Result<FileEntry, WireError> {
        let path = self.long_str("file path")?;
        let size = self.u64("file size")?;
        let mode = self.u32("file mode")?;
        let mtime_ns = self.i64("file mtime")?;
        let n = self.count("chunk count", MAX_CHUNKS, 32)?;
        let mut chunks = Vec::with_capacity(n);
        for _ in 0..n {
            chunks.push(self.hash("chunk hash")?);
        }
        Ok(FileEntry {
            path,
            size,
            mode,
            mtime_ns,
            chunks,
        })
    }
    pub(crate) fn finish(&self) -> Result<(), WireError> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(WireError::Trailing(n)),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn roundtrip(m: Control) {
        let frame = m.encode();
        let len = frame_len(frame[..4].try_into().unwrap()).unwrap();
        assert_eq!(len, frame.len() - 4);
        assert_eq!(Control::decode(&frame[4..]).unwrap(), m);
    }

    fn manifest() -> Manifest {
        Manifest {
            chunk_size: 4 << 20,
            files: vec![FileEntry {
                path: "a/b.bin".into(),
                size: 5 << 20,
                mode: 0o644,
                mtime_ns: 1_700_000_000_123_456_789,
                chunks: vec![[1; 32], [2; 32]],
            }],
            markers: vec![0],
        }
    }

    #[test]
    fn every_message_roundtrips() {
        roundtrip(Control::Hello(Hello {
            version: 1,
            agent: "train-a-1".into(),
            site: "train-a".into(),
        }));
        roundtrip(Control::Open {
            key: TransferKey {
                id: 7,
                job: "mm".into(),
                source_path: "/ckpt/mm/step_1".into(),
                rel: "step_1".into(),
                profile: "weights-only".into(),
            },
            chunk_size: 4 << 20,
            bytes_total: 10,
            files: vec![FileInfo {
                path: "x".into(),
                size: 10,
                mode: 0o600,
                mtime_ns: -5,
            }],
        });
        roundtrip(Control::Have {
            id: 1,
            chunks: vec![0, 5, 9],
        });
        roundtrip(Control::Need {
            id: 1,
            chunks: vec![3],
        });
        roundtrip(Control::Refuse {
            id: 2,
            reason: "no space".into(),
        });
        roundtrip(Control::Files {
            id: 3,
            files: vec![FileInfo {
                path: "__0_0.distcp".into(),
                size: 1 << 33,
                mode: 0o644,
                mtime_ns: 17,
            }],
        });
        roundtrip(Control::Commit {
            id: 3,
            committed_ms: 1_700_000_000_000,
            opened_ms: 1_699_999_990_000,
            batches: 12,
            manifest: manifest(),
            siblings: vec![("latest".into(), b"global_step12".to_vec())],
        });
        roundtrip(Control::Published {
            id: 3,
            local_path: "/eval/x".into(),
            root: [9; 32],
        });
        roundtrip(Control::Cancel {
            id: 3,
            reason: "deleted".into(),
        });
        roundtrip(Control::Error {
            message: "bad".into(),
        });
    }

    #[test]
    fn huge_counts_are_refused_before_allocation() {
        // A "have" claiming 4 billion indices in a 13-byte body.
        let mut body = vec![T_HAVE];
        body.extend_from_slice(&1u64.to_be_bytes());
        body.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(
            Control::decode(&body),
            Err(WireError::TooLarge { .. })
        ));
        // A count under the limit but larger than the bytes present.
        let mut body = vec![T_HAVE];
        body.extend_from_slice(&1u64.to_be_bytes());
        body.extend_from_slice(&1000u32.to_be_bytes());
        assert!(matches!(
            Control::decode(&body),
            Err(WireError::Truncated { .. })
        ));
    }

    #[test]
    fn frame_and_record_lengths_are_bounded() {
        assert!(frame_len((MAX_FRAME as u32 + 1).to_be_bytes()).is_err());
        assert!(frame_len([0; 4]).is_err());
        let mut rec = RecordHeader {
            file: 0,
            chunk: 0,
            len: MAX_CHUNK + 1,
            hash: [0; 32],
        }
        .encode();
        assert!(RecordHeader::decode(&rec).is_err());
        rec[8..12].copy_from_slice(&16u32.to_be_bytes());
        assert_eq!(RecordHeader::decode(&rec).unwrap().len, 16);
    }

    #[test]
    fn truncated_unknown_and_trailing_are_errors() {
        let frame = Control::Cancel {
            id: 1,
            reason: "x".into(),
        }
        .encode();
        let body = &frame[4..];
        for cut in 0..body.len() {
            assert!(Control::decode(&body[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = body.to_vec();
        long.push(0);
        assert_eq!(Control::decode(&long), Err(WireError::Trailing(1)));
        assert_eq!(Control::decode(&[200]), Err(WireError::UnknownType(200)));
        let mut bad = BatchHeader { transfer: 1 }.encode();
        bad[0] = b'X';
        assert_eq!(BatchHeader::decode(&bad), Err(WireError::BadMagic));
    }

    #[test]
    fn decoding_random_bytes_never_panics() {
        // A small deterministic fuzz loop; the property-based fuzzer with a
        // larger budget belongs to the reliability suite.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for len in 0..2000usize {
            let mut buf = Vec::with_capacity(len % 97);
            for _ in 0..(len % 97) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                buf.push(x as u8);
            }
            if let Some(first) = buf.first_mut() {
                *first = (len % 10) as u8;
            }
            let _ = Control::decode(&buf);
        }
    }
}
