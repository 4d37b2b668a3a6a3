//! Ferry's wire protocol, version 3: a sans-IO codec.
//!
//! Version 3 added [`Commit::checkpoint`] (the checkpoint's step and class
//! at commit, which the sink keeps with the replica for its retention
//! policy). A sink speaks versions 2 and 3 ([`MIN_PROTOCOL_VERSION`] to
//! [`PROTOCOL_VERSION`]) and answers a source's hello with the source's
//! version; a version 2 source sends no step or class.
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

use crate::codec::{Reader, Writer};
use crate::limits::{MAX_CHUNK, MAX_FILES, MAX_FRAME, MAX_SIBLINGS, MAX_SIBLING_BYTES};
use crate::manifest::{FileInfo, Hash, Manifest};
use crate::state::{Profile, TransferId};

pub use crate::codec::WireError;

/// Protocol version carried in [`Hello`]: the one a source speaks, and the
/// newest a sink speaks. A sink refuses a version outside
/// [`MIN_PROTOCOL_VERSION`]..=[`PROTOCOL_VERSION`] with [`Control::Error`]
/// naming both; a source refuses a sink whose hello names another version.
pub const PROTOCOL_VERSION: u16 = 3;

/// The oldest protocol version a sink still accepts from a source (its
/// commits carry no [`Commit::checkpoint`]).
pub const MIN_PROTOCOL_VERSION: u16 = 2;

/// Magic bytes at the start of every data stream.
pub const DATA_MAGIC: [u8; 4] = *b"FRY1";

/// Size of a [`BatchHeader`] on the wire, in bytes.
pub const BATCH_HEADER_LEN: usize = 4 + 8;

/// Size of a [`RecordHeader`] on the wire, in bytes.
pub const RECORD_HEADER_LEN: usize = 4 + 4 + 4 + 32;

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
    pub id: TransferId,
    /// The job that wrote the checkpoint.
    pub job: String,
    /// Absolute path of the checkpoint directory at the source.
    pub source_path: String,
    /// Path of the checkpoint relative to its source root.
    pub rel: String,
    /// Replication profile; on the wire an empty string for
    /// [`Profile::Full`] (which predates profiles), else its name.
    pub profile: Profile,
}

/// [`Control::Open`]: source to sink, a transfer starts (or resumes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Open {
    /// Which transfer.
    pub key: TransferKey,
    /// Chunk size in bytes used for every file of this transfer.
    pub chunk_size: u32,
    /// Total bytes of all files.
    pub bytes_total: u64,
    /// Files in manifest order.
    pub files: Vec<FileInfo>,
}

/// [`Control::Commit`]: source to sink, every chunk was sent; the sealed
/// manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Commit {
    /// Source transfer id.
    pub id: TransferId,
    /// When the checkpoint was committed at the source (its marker
    /// appeared), Unix milliseconds; 0 if unknown.
    pub committed_ms: i64,
    /// When the checkpoint opened at the source (its first file or
    /// directory), Unix milliseconds; 0 if unknown.
    pub opened_ms: i64,
    /// Number of data streams the source sent for this transfer on this
    /// connection, so the sink knows when all of them have arrived.
    pub batches: u64,
    /// The sealed manifest.
    pub manifest: Manifest,
    /// Markers that live beside the checkpoint directory (DeepSpeed
    /// `latest`, Megatron's `latest_checkpointed_iteration.txt`):
    /// `(file name, content)`, written next to the replica after it is
    /// in place. At most [`MAX_SIBLINGS`] of [`MAX_SIBLING_BYTES`].
    pub siblings: Vec<(String, Vec<u8>)>,
    /// Version 3: the checkpoint's step and class at commit; `None` from a
    /// version 2 source (encoded as nothing, so a version 2 frame decodes
    /// unchanged).
    pub checkpoint: Option<CheckpointInfo>,
}

/// What a version 3 source tells the sink about a checkpoint at commit,
/// for the sink's retention policy (the job travels in [`TransferKey`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CheckpointInfo {
    /// The training step, when the checkpoint's format names one (from its
    /// directory name); `None` for a pushed directory of no known format.
    pub step: Option<u64>,
    /// The transfer's scheduler class at commit (`urgent`, `scheduled`,
    /// `background`; a promoted transfer's is `urgent`); empty when
    /// unknown. At most 255 bytes; the sink parses it and ignores a name
    /// it does not know.
    pub class: String,
}

/// Messages on the control stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Control {
    /// Handshake; see [`Hello`].
    Hello(Hello),
    /// Source to sink: a transfer starts (or resumes). The sink answers
    /// [`Control::Have`] or [`Control::Refuse`].
    Open(Open),
    /// Sink to source: chunk keys already verified at the sink.
    Have {
        /// Source transfer id.
        id: TransferId,
        /// Chunk keys (see [`crate::manifest::ChunkMap`]).
        chunks: Vec<u64>,
    },
    /// Sink to source: the transfer cannot be accepted.
    Refuse {
        /// Source transfer id.
        id: TransferId,
        /// Human-readable reason naming the problem.
        reason: String,
    },
    /// Sink to source: send these chunks again (failed verification or
    /// missing at commit).
    Need {
        /// Source transfer id.
        id: TransferId,
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
        id: TransferId,
        /// New or changed files.
        files: Vec<FileInfo>,
    },
    /// Source to sink: every chunk was sent; here is the sealed manifest.
    /// Files are matched to the transfer's file table by path; files of the
    /// table that the manifest does not list are not part of the replica.
    Commit(Commit),
    /// Sink to source: the replica is published.
    Published {
        /// Source transfer id.
        id: TransferId,
        /// Path of the replica at the sink.
        local_path: String,
        /// BLAKE3 root of the published manifest.
        root: Hash,
    },
    /// Either direction: stop this transfer and discard its staging data.
    Cancel {
        /// Source transfer id.
        id: TransferId,
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
            Control::Open(Open { .. }) => "open",
            Control::Have { .. } => "have",
            Control::Refuse { .. } => "refuse",
            Control::Need { .. } => "need",
            Control::Files { .. } => "files",
            Control::Commit(Commit { .. }) => "commit",
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
            Control::Open(Open {
                key,
                chunk_size,
                bytes_total,
                files,
            }) => {
                w.u8(T_OPEN);
                w.u64(key.id.0);
                w.str(&key.job);
                w.long_str(&key.source_path);
                w.long_str(&key.rel);
                w.str(key.profile.stored_name().unwrap_or(""));
                w.u32(*chunk_size);
                w.u64(*bytes_total);
                w.u32(files.len() as u32);
                for f in files {
                    f.encode(&mut w);
                }
            }
            Control::Have { id, chunks } => {
                w.u8(T_HAVE);
                w.u64(id.0);
                w.indices(chunks);
            }
            Control::Refuse { id, reason } => {
                w.u8(T_REFUSE);
                w.u64(id.0);
                w.long_str(reason);
            }
            Control::Need { id, chunks } => {
                w.u8(T_NEED);
                w.u64(id.0);
                w.indices(chunks);
            }
            Control::Files { id, files } => {
                w.u8(T_FILES);
                w.u64(id.0);
                w.u32(files.len() as u32);
                for f in files {
                    f.encode(&mut w);
                }
            }
            Control::Commit(Commit {
                id,
                committed_ms,
                opened_ms,
                batches,
                manifest,
                siblings,
                checkpoint,
            }) => {
                w.u8(T_COMMIT);
                w.u64(id.0);
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
                if let Some(c) = checkpoint {
                    // Version 3: a flag byte (bit 0: step present), the
                    // step (0 when absent), the class name.
                    w.u8(u8::from(c.step.is_some()));
                    w.u64(c.step.unwrap_or(0));
                    w.str(&c.class);
                }
            }
            Control::Published {
                id,
                local_path,
                root,
            } => {
                w.u8(T_PUBLISHED);
                w.u64(id.0);
                w.long_str(local_path);
                w.0.extend_from_slice(root);
            }
            Control::Cancel { id, reason } => {
                w.u8(T_CANCEL);
                w.u64(id.0);
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
                    id: TransferId(r.u64("transfer id")?),
                    job: r.str("job")?,
                    source_path: r.long_str("source path")?,
                    rel: r.long_str("relative path")?,
                    profile: {
                        let name = r.str("profile")?;
                        Profile::from_stored(Some(&name)).map_err(|e| WireError::Invalid {
                            what: "profile",
                            why: e.to_string(),
                        })?
                    },
                };
                let chunk_size = r.u32("chunk size")?;
                let bytes_total = r.u64("bytes total")?;
                let n = r.count("file count", MAX_FILES, FileInfo::MIN_ENCODED)?;
                let mut files = Vec::with_capacity(n);
                for _ in 0..n {
                    files.push(FileInfo::decode(&mut r)?);
                }
                Control::Open(Open {
                    key,
                    chunk_size,
                    bytes_total,
                    files,
                })
            }
            T_HAVE => Control::Have {
                id: TransferId(r.u64("transfer id")?),
                chunks: r.indices()?,
            },
            T_REFUSE => Control::Refuse {
                id: TransferId(r.u64("transfer id")?),
                reason: r.long_str("reason")?,
            },
            T_NEED => Control::Need {
                id: TransferId(r.u64("transfer id")?),
                chunks: r.indices()?,
            },
            T_FILES => {
                let id = TransferId(r.u64("transfer id")?);
                let n = r.count("file count", MAX_FILES, FileInfo::MIN_ENCODED)?;
                let mut files = Vec::with_capacity(n);
                for _ in 0..n {
                    files.push(FileInfo::decode(&mut r)?);
                }
                Control::Files { id, files }
            }
            T_COMMIT => {
                let id = TransferId(r.u64("transfer id")?);
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
                // Version 3 appends the checkpoint's step and class; a
                // version 2 commit ends here.
                let checkpoint = if r.remaining() == 0 {
                    None
                } else {
                    let flags = r.u8("checkpoint flags")?;
                    if flags > 1 {
                        return Err(WireError::Invalid {
                            what: "checkpoint flags",
                            why: format!("unknown bits in {flags:#04x}"),
                        });
                    }
                    let step = r.u64("step")?;
                    let class = r.str("class")?;
                    if class.len() > 255 {
                        return Err(WireError::TooLarge {
                            what: "class name",
                            got: class.len() as u64,
                            limit: 255,
                        });
                    }
                    Some(CheckpointInfo {
                        step: (flags & 1 == 1).then_some(step),
                        class,
                    })
                };
                Control::Commit(Commit {
                    id,
                    committed_ms,
                    opened_ms,
                    batches,
                    manifest,
                    siblings,
                    checkpoint,
                })
            }
            T_PUBLISHED => Control::Published {
                id: TransferId(r.u64("transfer id")?),
                local_path: r.long_str("local path")?,
                root: r.hash("manifest root")?,
            },
            T_CANCEL => Control::Cancel {
                id: TransferId(r.u64("transfer id")?),
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
    pub transfer: TransferId,
}

impl BatchHeader {
    /// Encodes the header ([`BATCH_HEADER_LEN`] bytes).
    pub fn encode(&self) -> [u8; BATCH_HEADER_LEN] {
        let mut b = [0u8; BATCH_HEADER_LEN];
        b[..4].copy_from_slice(&DATA_MAGIC);
        b[4..].copy_from_slice(&self.transfer.0.to_be_bytes());
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
            transfer: TransferId(u64::from_be_bytes(id)),
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::manifest::FileEntry;
    use crate::state::TransferId;

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
        roundtrip(Control::Open(Open {
            key: TransferKey {
                id: TransferId(7),
                job: "mm".into(),
                source_path: "/ckpt/mm/step_1".into(),
                rel: "step_1".into(),
                profile: Profile::WeightsOnly,
            },
            chunk_size: 4 << 20,
            bytes_total: 10,
            files: vec![FileInfo {
                path: "x".into(),
                size: 10,
                mode: 0o600,
                mtime_ns: -5,
            }],
        }));
        roundtrip(Control::Have {
            id: TransferId(1),
            chunks: vec![0, 5, 9],
        });
        roundtrip(Control::Need {
            id: TransferId(1),
            chunks: vec![3],
        });
        roundtrip(Control::Refuse {
            id: TransferId(2),
            reason: "no space".into(),
        });
        roundtrip(Control::Files {
            id: TransferId(3),
            files: vec![FileInfo {
                path: "__0_0.distcp".into(),
                size: 1 << 33,
                mode: 0o644,
                mtime_ns: 17,
            }],
        });
        roundtrip(Control::Commit(Commit {
            id: TransferId(3),
            committed_ms: 1_700_000_000_000,
            opened_ms: 1_699_999_990_000,
            batches: 12,
            manifest: manifest(),
            siblings: vec![("latest".into(), b"global_step12".to_vec())],
            checkpoint: Some(CheckpointInfo {
                step: Some(12),
                class: "urgent".into(),
            }),
        }));
        // Version 2 (no checkpoint info), and version 3 without a step.
        for checkpoint in [
            None,
            Some(CheckpointInfo {
                step: None,
                class: String::new(),
            }),
        ] {
            roundtrip(Control::Commit(Commit {
                id: TransferId(4),
                committed_ms: 0,
                opened_ms: 0,
                batches: 1,
                manifest: manifest(),
                siblings: vec![],
                checkpoint,
            }));
        }
        roundtrip(Control::Published {
            id: TransferId(3),
            local_path: "/eval/x".into(),
            root: [9; 32],
        });
        roundtrip(Control::Cancel {
            id: TransferId(3),
            reason: "deleted".into(),
        });
        roundtrip(Control::Error {
            message: "bad".into(),
        });
    }

    #[test]
    fn a_version_2_commit_decodes_without_checkpoint_info_and_bad_flags_are_named() {
        let v3 = Control::Commit(Commit {
            id: TransferId(4),
            committed_ms: 1,
            opened_ms: 2,
            batches: 3,
            manifest: manifest(),
            siblings: vec![],
            checkpoint: Some(CheckpointInfo {
                step: Some(7),
                class: "scheduled".into(),
            }),
        })
        .encode();
        // The version 3 tail: flags (1), step (8), class ("scheduled", 2 + 9).
        let tail = 1 + 8 + 2 + 9;
        let v2 = &v3[4..v3.len() - tail];
        match Control::decode(v2).unwrap() {
            Control::Commit(c) => assert_eq!(c.checkpoint, None),
            other => panic!("{other:?}"),
        }
        let mut bad = v3[4..].to_vec();
        let at = bad.len() - tail;
        bad[at] = 0x80;
        match Control::decode(&bad) {
            Err(WireError::Invalid { what, .. }) => assert_eq!(what, "checkpoint flags"),
            other => panic!("{other:?}"),
        }
        // A tail cut short is truncated, not a version 2 commit.
        assert!(Control::decode(&v3[4..v3.len() - 3]).is_err());
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
    fn an_unknown_profile_is_a_decode_error_naming_it() {
        let frame = Control::Open(Open {
            key: TransferKey {
                id: TransferId(1),
                job: "j".into(),
                source_path: "/s".into(),
                rel: "r".into(),
                profile: Profile::WeightsOnly,
            },
            chunk_size: 1 << 20,
            bytes_total: 0,
            files: vec![],
        })
        .encode();
        let body = &frame[4..];
        // Rewrite the profile's name in place, same length: "weights-only"
        // becomes "weights-ohno".
        let at = body.windows(12).position(|w| w == b"weights-only").unwrap();
        let mut bad = body.to_vec();
        bad[at..at + 12].copy_from_slice(b"weights-ohno");
        match Control::decode(&bad) {
            Err(WireError::Invalid { what, why }) => {
                assert_eq!(what, "profile");
                assert!(why.contains("weights-ohno"), "{why}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn truncated_unknown_and_trailing_are_errors() {
        let frame = Control::Cancel {
            id: TransferId(1),
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
        let mut bad = BatchHeader {
            transfer: TransferId(1),
        }
        .encode();
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
